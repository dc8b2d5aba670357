"""The options of a conversion (`ConvertOptions`) and of a verification (`VerifyOptions`)."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING

from convert.arch.registry import HEAD_MAPS
from convert.corpus import KINDS, shipped_kind
from convert.errors import ConvertError
from convert.options.fields import (
    ALLOCATIONS,
    ARCH_NAMES,
    CALIBRATIONS,
    DEVICES,
    E2E_MODES,
    GGUF_TYPES,
    LATENTS,
    LAYOUTS,
    METHODS,
    RUN_DTYPES,
    TARGETS,
    FromKwargs,
    choice,
    option,
    resolve_device,
    torch_dtypes,
)
from convert.sizes import parse_size

if TYPE_CHECKING:
    import torch


@dataclass
class VerifyOptions(FromKwargs):
    """How verification runs: on which inputs, where, in which precision, and how a lossy
    conversion is judged. Every field is a flag of `convert verify` and `convert gqa2mla`."""

    text: Path | None = option(
        None,
        "Real text to verify on (UTF-8); default: random tokens and hidden states. A lossy conversion "
        "needs it, with --max-ppl-ratio.",
        group="verification",
        kind=Path,
    )
    tokens: int = option(256, "Tokens of --text (or random) to verify on.", group="verification")
    device: str = option(
        "auto", "Where verification runs: auto = CUDA when present, else CPU.", group="advanced", choices=DEVICES
    )
    dtype: str = option(
        "auto",
        "Precision of the verification run; thresholds follow the coarser of it and the checkpoint's (in "
        "bfloat16/float16: 4x the noise floor of the original's equivalent twin, measured in the run). auto = "
        "float64 for a float32/float64 checkpoint, float32 for a bfloat16/float16 one (whose own round-off is "
        "8,000-65,000x float32's: float64 would buy nothing and double the memory).",
        group="advanced",
        choices=RUN_DTYPES,
    )
    max_ppl_ratio: float | None = option(
        None,
        "Lossy conversions: FAIL when converted/original perplexity on --text exceeds this (e.g. 1.2).",
        group="verification",
        kind=float,
        needs="calibrates",
    )
    max_memory: int | str | None = option(
        None,
        "Bound on the run's resident memory, verification included (e.g. 8GiB, 1500MB). The run plans within "
        "it (both whole models at once when they fit, else one decoder layer of each at a time, greedy "
        "generation from one whole model when it fits, else streamed too) and is refused up front, naming the "
        "smallest cap that works, when it cannot verify the model within it. Default: what the process held "
        "when the run began + the original checkpoint's size + 0.5 GiB (or what streamed verification needs, "
        "if more), never more than the memory free. The report states the cap and the peak measured.",
        group="verification",
        kind=str,
    )
    calibrated_on: list | None = option(
        None,
        "What the conversion was calibrated on (`ConvertOptions.calibration_names`), for the report's warning "
        "when it judges on the same kind; None: not known (a separate `convert verify`).",
        group="verification",
        cli=False,
    )
    e2e: str = option(
        "auto",
        "End-to-end check. streamed = one decoder layer of each model at a time, logits in vocabulary chunks "
        "(memory: about two layers, whatever the model's size); auto = whole when the memory cap (--max-memory) "
        "and the memory free on the device (host, container or GPU; a fifth, at least 1 GiB, kept free) hold "
        "both whole models; else streamed, then greedy generation from each whole model in turn (one in memory "
        "at a time, float32 unless --dtype says otherwise) when one fits, else streamed as well (each new token "
        "one pass over both checkpoints); whole = both whole models in memory at once (the same figures and "
        "greedy generation, in the run's dtype).",
        group="advanced",
        choices=E2E_MODES,
    )
    progress: bool = option(
        True, "No progress bar or summary.", group="advanced", flag="--quiet", short="-q", off_flag="--quiet"
    )

    def __post_init__(self) -> None:
        choice("--device", self.device, DEVICES)
        choice("--dtype", self.dtype, RUN_DTYPES)
        choice("--e2e", self.e2e, E2E_MODES)
        if self.device == "cuda":
            resolve_device(self.device)  # refuse now, before any work, when there is no CUDA
        if self.tokens <= 1:
            raise ConvertError(f"--tokens {self.tokens} must be at least 2")
        if self.max_ppl_ratio is not None and not self.max_ppl_ratio > 0:
            raise ConvertError(f"--max-ppl-ratio {self.max_ppl_ratio} must be a positive ratio (e.g. 1.2)")
        if self.max_memory is not None:
            parse_size(self.max_memory, "--max-memory")

    @property
    def max_memory_bytes(self) -> int | None:
        """--max-memory in bytes (None: the default cap, which depends on the checkpoint)."""
        return None if self.max_memory is None else parse_size(self.max_memory, "--max-memory")

    def run_dtype(self, checkpoint_dtype: torch.dtype) -> torch.dtype:
        """The verification run's dtype for a checkpoint stored in `checkpoint_dtype` (resolves auto)."""
        import torch  # heavy: options is on the light CLI path (--help, refusals), which must not import torch

        if self.dtype != "auto":
            return torch_dtypes()[self.dtype]
        return torch.float32 if torch.finfo(checkpoint_dtype).bits < 32 else torch.float64

    def greedy_dtype(self, checkpoint_dtype: torch.dtype) -> torch.dtype:
        """Greedy generation's dtype under --e2e auto: the --dtype given, else float32 (float64 for a
        float64 checkpoint): the tokens as users would generate them, and one whole model in that
        precision is what has to fit in the memory free (half the memory of float64)."""
        import torch  # heavy: options is on the light CLI path (--help, refusals), which must not import torch

        if self.dtype != "auto":
            return torch_dtypes()[self.dtype]
        return torch.float64 if checkpoint_dtype == torch.float64 else torch.float32

    @property
    def torch_device(self) -> torch.device:
        return resolve_device(self.device)


@dataclass
class ConvertOptions(VerifyOptions):
    """Everything `gqa2mla` can be told. Defaults give the exact conversion, verified.

    Model description (only for a bare file without config.json): arch, n_heads,
    n_kv_heads, head_dim. Math: head_map, latent, layout, rank. Compression (lossy):
    kv_cache_ratio or rank; method, allocation, calib (a text file, or token ids
    (1, N) from the API), calib_tokens, fisher_tokens. Output: max_shard_size, force. Verification:
    verify and the `VerifyOptions` fields.
    """

    layout: str = option(
        "absorbed",
        "absorbed: Ŵ^Q/Ŵ^O over the latent (MQA, head dim r), the faster decode, checkpoint +30%; factored: keep "
        "W^Q, W^UK, W^UV, W^O, checkpoint +5%, the layout to compress in. Both exact, KV cache = GQA's. "
        "Figures: SmolLM2-135M.",
        group="layout",
        choices=LAYOUTS,
        needs="compresses",
    )
    latent: str = option(
        "split",
        "split: separate K and V latents; joint: one shared latent (keys without RoPE only).",
        group="layout",
        choices=LATENTS,
        needs="compresses",
    )
    kv_cache_ratio: float | None = option(
        None,
        "Keep this fraction of the GQA KV cache (e.g. 0.5), calibrated on --calib (default: the shipped mix) and "
        "judged by the perplexity ratio on each kind of text against --max-ppl-ratio (or --no-verify). With "
        "--target llamacpp: the latent plus its 64-dim rotary key.",
        group="compression",
        kind=float,
        needs="sized",
    )
    rank: int | None = option(
        None,
        "Latent dims per latent (default: the exact rank). Below it compresses, as --kv-cache-ratio does, "
        "with the same needs.",
        group="compression",
        kind=int,
        needs="compresses",
    )
    method: str | None = option(
        None,
        "plain weight SVD; activation-whitened SVD; whitened + weighted by the loss's Fisher "
        "information of each key/value output (one backward pass on --calib, one decoder layer in memory at a "
        "time). Default: fisher (svd for a checkpoint no transformers model runs, e.g. the seed's).",
        group="compression",
        choices=METHODS,
        needs="compresses",
    )
    calib: Path | list | torch.Tensor | None = option(
        None,
        "Text to calibrate a compression (or a lossy vllm or llamacpp export) on: UTF-8 .txt/.md, .jsonl or "
        ".parquet (a 'text' field); repeat for several files, a window of each in turn. A name fiction, "
        "technical, code or dialogue (no such file) is that kind of the shipped text. Default: the shipped mix "
        "of all four (convert/corpus/SOURCES.md).",
        group="compression",
        kind=Path,
        multiple=True,
        needs="calibrates",
    )
    calib_tokens: int = option(
        16384,
        "Tokens of --calib to use: the sequential calibration and the refinement run on all of them (windows of "
        "1,024), the Fisher statistics on the first --fisher-tokens.",
        group="compression",
    )
    fisher_tokens: int = option(
        4096,
        "Tokens of --calib (its first) that --method fisher's statistics read: a forward and backward pass "
        "through the whole model per window, the costly part per token.",
        group="compression",
    )
    allocation: str | None = option(
        None,
        "The same rank in every latent, or spend the budget across layers and K/V by weighted energy "
        "(global needs --kv-cache-ratio). Default: global for fisher.",
        group="compression",
        choices=ALLOCATIONS,
        needs="compresses",
    )
    calibration: str | None = option(
        None,
        "Factor every layer on the original model's hidden states, or (sequential, needs --calib) on those "
        "of the model compressed so far, refitting its up-projections to the original layer's keys and "
        "values (GPTQ's order; one layer in memory). Default: sequential in the factored layout, original "
        "in the absorbed one (what measured best). With --target vllm: how a latent compressed into vLLM's "
        "512 dims (7B+) is factored; default original (what measured best at 25% and 75%).",
        group="compression",
        choices=CALIBRATIONS,
        needs="calibrates",
    )
    refine_steps: int | None = option(
        None,
        "After factoring, fit each compressed layer to the original layer's attention output on --calib "
        "(Adam steps per layer, one calibration window each, --refine-queries of its positions; 0: off). "
        "Default: sized to the device that refines (CUDA when there is one: 500; CPU: 100, ~5 s per "
        "SmolLM2-135M layer on 2 cores). With --target vllm or llamacpp: a compressed latent (vLLM's 512 dims "
        "for 7B+ sources, --kv-cache-ratio in llama.cpp) is refined the same way.",
        group="compression",
        kind=int,
    )
    refine_queries: int | None = option(
        None,
        "Query positions each refinement step fits, drawn at random from its window, each attending to every "
        "key before it (a step costs less with fewer). Default: sized to the device (CPU: 128 "
        "of the window's 1,024; CUDA: all).",
        group="compression",
        kind=int,
        needs="calibrates",
    )
    shrinkage: float = option(
        0.05,
        "Pull the calibration statistics (input moments, Fisher information) this far toward isotropic ones of "
        "the same trace before factoring (0: as measured; 1: plain weight SVD), so directions the calibration "
        "text barely excited keep some weight: at 0.05, SmolLM2 at 50% of the cache does better on the kinds of "
        "text it was not calibrated on (docs/compression.md, 'Text unlike the calibration').",
        group="compression",
        kind=float,
    )
    nope_angle: float = option(
        3.0,
        "Absorbed compression with RoPE: key frequencies that turn less than this many radians over "
        "min(max_position_embeddings, 4096) tokens are cached as NoPE dims, compressed freely across "
        "frequencies and heads (the rest stay per-frequency rotary pairs); 0 keeps every frequency rotary.",
        group="compression",
        kind=float,
    )
    verify: bool = option(
        True, "Skip verification (no report is written).", group="verification", off_flag="--no-verify"
    )
    target: str = option(
        "mla",
        "mla: this package's format, every layout and compression. transformers: DeepseekV3 for stock "
        "transformers, exact. vllm: DeepseekV3 for vLLM's MLA kernels (576 cached values per token and "
        "layer). llamacpp: one GGUF (deepseek2) for llama.cpp, sized by --kv-cache-ratio. vllm and llamacpp "
        "are lossy unless one K/V head of dim 64 (docs/serving.md).",
        group="target",
        choices=TARGETS,
    )
    gguf_type: str | None = option(
        None,
        "With --target llamacpp: the GGUF's tensor type, F32, F16 or BF16 (default: the checkpoint's dtype), or "
        "Q8_0 / Q4_K_M by llama.cpp's own quantizer (built by scripts/llamacpp_env.sh; lossy: --max-ppl-ratio).",
        group="output",
        choices=GGUF_TYPES,
    )
    latent_multiple: int | None = option(
        None,
        "With --target llamacpp: round the latent's width (kv_lora_rank) up to a multiple of N, e.g. 128: "
        "llama.cpp's CPU attention runs such widths several times as fast (docs/serving.md). With "
        "--kv-cache-ratio the compressed rank is rounded up (more of the latent kept, a larger cache); without "
        "it the dims past the latent's need are zeros (as exact as before, a larger cache).",
        group="output",
        kind=int,
    )
    force: bool = option(
        False, "Replace the output directory if it exists (only one that convert wrote).", group="output"
    )
    head_map: str | None = option(
        None,
        "Which K/V head each query head reads: grouped = h // (H/G) (Hugging Face), tiled = h mod G (the seed). "
        "Default: the architecture's.",
        group="advanced",
        choices=HEAD_MAPS,
    )
    arch: str | None = option(
        None, "Architecture, only when there is no config.json.", group="advanced", choices=ARCH_NAMES
    )
    n_heads: int | None = option(None, "Query heads H (only when config.json lacks them).", group="advanced", kind=int)
    n_kv_heads: int | None = option(
        None, "Key/value heads G (only when config.json lacks them).", group="advanced", kind=int
    )
    head_dim: int | None = option(None, "Head dim d (default: inferred from the shapes).", group="advanced", kind=int)
    max_shard_size: int | str = option(
        "5GB",
        "Start a new safetensors shard above this many bytes (e.g. 500MB, 5GB, 2GiB).",
        group="advanced",
        kind=str,
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.calib, (str, os.PathLike)):  # one path (the API): a list of one
            self.calib = [Path(self.calib)]
        elif isinstance(self.calib, (list, tuple)):  # the CLI's repeated --calib; none given: the default
            self.calib = [Path(p) for p in self.calib] or None
        choice("--target", self.target, TARGETS)
        if self.gguf_type is not None:
            self.gguf_type = str(self.gguf_type).upper()  # q4_k_m as llama.cpp's tools accept it
            choice("--gguf-type", self.gguf_type, GGUF_TYPES)
        choice("--layout", self.layout, LAYOUTS)
        choice("--latent", self.latent, LATENTS)
        if self.head_map is not None:
            choice("--head-map", self.head_map, HEAD_MAPS)
        if self.arch is not None:
            choice("--arch", self.arch, ARCH_NAMES)
        if self.latent_multiple is not None and self.latent_multiple <= 0:
            raise ConvertError(f"--latent-multiple {self.latent_multiple} must be a positive number of dims, e.g. 128")
        if self.rank is not None and self.rank <= 0:
            raise ConvertError(
                f"--rank {self.rank} must be a positive number of latent dims (omit it for the exact rank)"
            )
        self._check_compression()

    @property
    def lossy(self) -> bool:
        """Whether this asks for less than the exact rank."""
        return self.rank is not None or (self.kv_cache_ratio is not None and self.kv_cache_ratio < 1)

    @property
    def calib_paths(self) -> list[Path]:
        """The --calib paths given (none for the shipped text or token ids): inputs an output must not replace."""
        return list(self.calib) if isinstance(self.calib, list) else []

    @property
    def resolved_method(self) -> str:
        return self.method or "fisher"

    @property
    def resolved_calibration(self) -> str:
        """sequential for the factored layout (measured better at 75/50/25% of the cache on SmolLM2),
        original for the absorbed one (sequential is worse there below 75%): bench/compression.py."""
        if self.calibration is not None:
            return self.calibration
        return "sequential" if self.layout == "factored" and self.resolved_method != "svd" else "original"

    @property
    def resolved_allocation(self) -> str:
        return self.allocation or ("global" if self.resolved_method == "fisher" else "uniform")

    def _check_compression(self) -> None:
        if self.method is not None:
            choice("--method", self.method, METHODS)
        if self.allocation is not None:
            choice("--allocation", self.allocation, ALLOCATIONS)
        if self.rank is not None and self.kv_cache_ratio is not None:
            raise ConvertError("--rank and --kv-cache-ratio both set the cache size; give one of them")
        if self.kv_cache_ratio is not None and not 0 < self.kv_cache_ratio <= 1:
            raise ConvertError(
                f"--kv-cache-ratio {self.kv_cache_ratio} must be in (0, 1], e.g. 0.5 keeps half the GQA cache"
            )
        if self.allocation == "global" and self.rank is not None:
            raise ConvertError(
                "--allocation global spends a --kv-cache-ratio budget; with --rank every latent has that rank"
            )
        if (
            self.latent == "joint"
            and self.lossy
            and (self.resolved_method != "svd" or self.resolved_allocation != "uniform")
        ):
            raise ConvertError("--latent joint compresses only with --method svd and uniform ranks; use --latent split")
        if self.calibration is not None:
            choice("--calibration", self.calibration, CALIBRATIONS)
        if self.calibration == "sequential" and self.lossy and self.resolved_method == "svd":
            raise ConvertError("--calibration sequential refits on calibration text: use --method whitened or fisher")
        if not 0 <= self.shrinkage <= 1:
            raise ConvertError(f"--shrinkage {self.shrinkage} must be in [0, 1] (0: the statistics as measured)")
        if not self.nope_angle >= 0:
            raise ConvertError(f"--nope-angle {self.nope_angle} must be a non-negative angle in radians (0: off)")
        if self.calib_tokens < 2:
            raise ConvertError(f"--calib-tokens {self.calib_tokens} must be at least 2")
        if self.fisher_tokens < 2:
            raise ConvertError(f"--fisher-tokens {self.fisher_tokens} must be at least 2")
        if self.refine_steps is not None and self.refine_steps < 0:
            raise ConvertError(f"--refine-steps {self.refine_steps} must be 0 (no refinement) or more")
        if self.refine_queries is not None and self.refine_queries < 1:
            raise ConvertError(f"--refine-queries {self.refine_queries} must be at least 1 (query positions a step)")
        if self.refine_steps and self.lossy and self.resolved_method == "svd":
            raise ConvertError(
                "--refine-steps fits each layer to its attention output on calibration text: use --method whitened "
                "or fisher, or --refine-steps 0"
            )

    def check_verifiable(self) -> None:
        """A lossy conversion is judged by its perplexity ratio: the bound must be given."""
        if self.lossy and self.verify and self.max_ppl_ratio is None:
            raise ConvertError(
                "a compressed conversion is lossy: verification judges it by the perplexity ratio on each kind of "
                "text (the shipped held-out text, and --text FILE when given), so pass --max-ppl-ratio R (e.g. "
                "1.5), or --no-verify"
            )

    @property
    def calibration_names(self) -> list[str] | None:
        """What a compression (or an export that calibrates) calibrates on, for its report: the shipped
        kinds by name, files by file name (None: an exact native conversion, or weight SVD, reads no text)."""
        if (self.target == "mla" and not self.lossy) or (self.lossy and self.resolved_method == "svd"):
            return None  # an exact native conversion, or weight SVD: no text read
        if self.calib is None:
            return list(KINDS)
        if not isinstance(self.calib, list):
            return ["token ids given"]
        return [shipped_kind(p) or Path(p).name for p in self.calib]

    def verify_options(self) -> VerifyOptions:
        """The verification part of these options, with what the compression was calibrated on."""
        given = {f.name: getattr(self, f.name) for f in fields(VerifyOptions) if f.name != "calibrated_on"}
        return VerifyOptions(**given, calibrated_on=self.calibration_names)
