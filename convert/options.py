"""The options of a conversion and of a verification, declared once: flag, help, choices and section.

`convert.cli` builds its click options from these fields, so the CLI and the Python API cannot drift apart
(tests/cli/test_cli_parity.py). No torch at import: --help and bad flags answer at once (tests/cli/test_cli_startup.py).
"""

from __future__ import annotations

import numbers
import os
import re
from dataclasses import MISSING, dataclass, field, fields, replace
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

from convert.arch.registry import ARCHS, HEAD_MAPS
from convert.errors import ConvertError, UnknownOption, speak_python

if TYPE_CHECKING:
    import torch

#: The `--target` choices: the names of `convert.targets.TARGETS`, which checks the flags each takes.
TARGETS = ("mla", "transformers", "vllm")
LAYOUTS = ("absorbed", "factored")
LATENTS = ("split", "joint")
DEVICES = ("auto", "cpu", "cuda")
MIXED_PRECISIONS = ("auto", "no", "bf16", "fp16")
TRACKERS = ("auto", "none", "tensorboard", "wandb", "mlflow")
E2E_MODES = ("auto", "whole", "streamed")
METHODS = ("svd", "whitened", "fisher")
ALLOCATIONS = ("uniform", "global")
CALIBRATIONS = ("original", "sequential")
ARCH_NAMES = tuple(ARCHS)  # --arch: the registry's families, in one place (help, choices and find_arch's error)
DTYPES = ("float64", "float32", "bfloat16", "float16")
RUN_DTYPES = ("auto", *DTYPES)  # verification: auto follows the checkpoint (`VerifyOptions.run_dtype`)

#: The sections of `--help`, in the order people reach for them; `option(group=...)` names one.
GROUPS = {
    "output": "Input and output",
    "layout": "Layout (exact)",
    "compression": "Compression (lossy; the default is the exact conversion)",
    "verification": "Verification",
    "training": "Training",
    "target": "Target",
    "advanced": "Advanced",
}


@cache
def _torch_dtypes() -> dict[str, torch.dtype]:
    import torch  # heavy: options is on the light CLI path (--help, refusals), which must not import torch

    return {name: getattr(torch, name) for name in DTYPES}


def __getattr__(name: str):
    """`TORCH_DTYPES` ({"float32": torch.float32, ...}), built on first use (PEP 562)."""
    if name == "TORCH_DTYPES":
        return _torch_dtypes()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16" (the name options, configs and reports use)."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class Flag:
    """How one option shows on the command line, besides its help and section.

    flag: the long flag (default `--field-name`); off_flag: for a boolean whose CLI flag switches
    it off (`verify` <- `--no-verify`); kind: the click value type when it differs from the
    default's (Path, int, float, str); cli: False for an option of the Python API alone.
    """

    choices: tuple | None = None
    flag: str | None = None
    short: str | None = None
    off_flag: str | None = None
    kind: type | None = None
    cli: bool = True


def option(default, help: str, *, group: str, **flag):
    """A dataclass field with its CLI description as metadata: `help`, `group` (its section of
    `--help`, a key of GROUPS) and the fields of `Flag` (`flag`: their values)."""
    if group not in GROUPS:
        raise ValueError(f"group {group!r} is not one of {', '.join(GROUPS)}")
    return field(default=default, metadata={"help": help, "group": group, **vars(Flag(**flag))})


def suggest(word: str, known) -> list[str]:
    """The known names `word` is likely a typo of, best first: those it begins or that begin with
    it, else the closest by spelling, only those near the best (no list of unrelated options)."""
    import difflib

    known = sorted(known)
    stem = word.lstrip("-")
    prefixed = [
        k for k in known if len(stem) >= 2 and (k.lstrip("-").startswith(stem) or stem.startswith(k.lstrip("-")))
    ]
    if prefixed:
        return prefixed[:3]
    scored = sorted(((difflib.SequenceMatcher(None, word, k).ratio(), k) for k in known), reverse=True)
    best = scored[0][0] if scored else 0.0
    return [k for score, k in scored if score >= 0.6 and score >= best - 0.05][:3]


class _FromKwargs:
    @classmethod
    def from_kwargs(cls, **kwargs):
        """Build from keyword options, refusing an unknown name with the likely one it misspells."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            name = unknown[0]
            likely = suggest(name, known)
            fix = f"did you mean {' or '.join(likely)}?" if likely else f"the options are {', '.join(sorted(known))}"
            raise UnknownOption(f"unknown option {name}={kwargs[name]!r}; {fix}")
        for f in fields(cls):
            if f.name in kwargs:
                _check_type(f.name, kwargs[f.name], f.type)
        return cls(**kwargs)


def as_path(name: str, value, expected: str = "a path (str or os.PathLike)") -> Path:
    """A path argument of the Python API as a Path, or a ConvertError naming the parameter."""
    if not isinstance(value, (str, os.PathLike)):
        raise ConvertError(f"{name}={value!r:.60}: expected {expected}, got {type(value).__name__}")
    return Path(value)


#: An annotation's names -> what a value of it may be, and how a message names it.
_TYPES = {
    "int": ((numbers.Integral,), "an int"),
    "float": ((numbers.Real,), "a number"),
    "str": ((str,), "a str"),
    "bool": ((bool,), "True or False"),
    "Path": ((str, os.PathLike), "a path"),
    "None": ((type(None),), "None"),
}


def _check_type(name: str, value, annotation: str) -> None:
    """Refuse a keyword option whose value is not of its field's annotation ("int | None", ...)
    as a ConvertError naming it, before it fails deep inside as a TypeError."""
    kinds = [kind.strip() for kind in annotation.split("|")]
    if "torch.Tensor" in kinds and type(value).__module__.split(".")[0] == "torch":
        return
    accepted = [_TYPES[kind] for kind in kinds if kind in _TYPES]
    ok = any(isinstance(value, types) for types, _ in accepted)
    if isinstance(value, bool) and "bool" not in kinds:
        ok = False  # True is an int to Python, not a count or a ratio
    if not ok:
        names = [text for _, text in accepted] + (["a torch.Tensor"] if "torch.Tensor" in kinds else [])
        raise ConvertError(f"{name}={value!r}: expected {' or '.join(names)}, got {type(value).__name__}")


@dataclass
class VerifyOptions(_FromKwargs):
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
    )
    e2e: str = option(
        "auto",
        "End-to-end check. streamed = one decoder layer of each model at a time, logits in vocabulary chunks "
        "(memory: about two layers, whatever the model's size); auto = whole when the memory free on the "
        "device (host, container or GPU; a fifth, at least 1 GiB, kept free) holds both whole models; else "
        "streamed, then greedy generation from each whole model in turn (one in memory at a time, float32 "
        "unless --dtype says otherwise) when one fits, else skipped with the reason; whole = both whole "
        "models in memory at once (the same figures and greedy generation, in the run's dtype).",
        group="advanced",
        choices=E2E_MODES,
    )
    progress: bool = option(
        True, "No progress bar or summary.", group="advanced", flag="--quiet", short="-q", off_flag="--quiet"
    )

    def __post_init__(self) -> None:
        _choice("--device", self.device, DEVICES)
        _choice("--dtype", self.dtype, RUN_DTYPES)
        _choice("--e2e", self.e2e, E2E_MODES)
        if self.device == "cuda":
            resolve_device(self.device)  # refuse now, before any work, when there is no CUDA
        if self.tokens <= 1:
            raise ConvertError(f"--tokens {self.tokens} must be at least 2")
        if self.max_ppl_ratio is not None and not self.max_ppl_ratio > 0:
            raise ConvertError(f"--max-ppl-ratio {self.max_ppl_ratio} must be a positive ratio (e.g. 1.2)")

    def run_dtype(self, checkpoint_dtype: torch.dtype) -> torch.dtype:
        """The verification run's dtype for a checkpoint stored in `checkpoint_dtype` (resolves auto)."""
        import torch  # heavy: options is on the light CLI path (--help, refusals), which must not import torch

        if self.dtype != "auto":
            return _torch_dtypes()[self.dtype]
        return torch.float32 if torch.finfo(checkpoint_dtype).bits < 32 else torch.float64

    def greedy_dtype(self, checkpoint_dtype: torch.dtype) -> torch.dtype:
        """Greedy generation's dtype under --e2e auto: the --dtype given, else float32 (float64 for a
        float64 checkpoint): the tokens as users would generate them, and one whole model in that
        precision is what has to fit in the memory free (half the memory of float64)."""
        import torch  # heavy: options is on the light CLI path (--help, refusals), which must not import torch

        if self.dtype != "auto":
            return _torch_dtypes()[self.dtype]
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
    (1, N) from the API), calib_tokens. Output: max_shard_size, force. Verification:
    verify and the `VerifyOptions` fields.
    """

    layout: str = option(
        "absorbed",
        "absorbed: Ŵ^Q/Ŵ^O over the latent (MQA, head dim r), the faster decode, checkpoint +30%; factored: keep "
        "W^Q, W^UK, W^UV, W^O, checkpoint +5%, the layout to compress in. Both exact, KV cache = GQA's. "
        "Figures: SmolLM2-135M.",
        group="layout",
        choices=LAYOUTS,
    )
    latent: str = option(
        "split",
        "split: separate K and V latents; joint: one shared latent (keys without RoPE only).",
        group="layout",
        choices=LATENTS,
    )
    kv_cache_ratio: float | None = option(
        None,
        "Keep this fraction of the GQA KV cache (e.g. 0.5). Needs --calib FILE (or --method svd, far worse), "
        "and --text + --max-ppl-ratio for verification (or --no-verify).",
        group="compression",
        kind=float,
    )
    rank: int | None = option(
        None,
        "Latent dims per latent (default: the exact rank). Below it compresses, as --kv-cache-ratio does, "
        "with the same needs.",
        group="compression",
        kind=int,
    )
    method: str | None = option(
        None,
        "plain weight SVD; activation-whitened SVD; whitened + weighted by the loss's Fisher "
        "information of each key/value output (one backward pass on --calib, one decoder layer in memory at a "
        "time). whitened and fisher need --calib. Default: fisher with --calib, else svd.",
        group="compression",
        choices=METHODS,
    )
    calib: Path | torch.Tensor | None = option(
        None,
        "Real text to calibrate the compression on (UTF-8); use a different text for --text.",
        group="compression",
        kind=Path,
    )
    calib_tokens: int = option(4096, "Tokens of --calib to use.", group="compression")
    allocation: str | None = option(
        None,
        "The same rank in every latent, or spend the budget across layers and K/V by weighted energy "
        "(global needs --kv-cache-ratio). Default: global for fisher.",
        group="compression",
        choices=ALLOCATIONS,
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
    )
    refine_steps: int | None = option(
        None,
        "After factoring, fit each compressed layer to the original layer's attention output on --calib "
        "(Adam steps per layer, one calibration window each; 0: off). Default: sized to the device that "
        "refines (CUDA when there is one: 500; CPU: 50, ~3 s per SmolLM2-135M layer on 2 cores).",
        group="compression",
        kind=int,
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
        "mla: this package (and transformers after `import convert`); the only target that compresses; KV "
        "cache = GQA's when exact; checkpoint +5% (--layout factored) to +30% (absorbed). transformers: "
        "DeepseekV3 for stock transformers, exact; KV cache +1%, checkpoint +38%. vllm: DeepseekV3 for "
        "vLLM's MLA kernels; KV cache 576 per token and layer (+50%; less than GQA's from ~7B); "
        "checkpoint +44%; lossy unless one K/V head of dim 64 (needs --calib). Figures: SmolLM2-135M.",
        group="target",
        choices=TARGETS,
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
        _choice("--target", self.target, TARGETS)
        _choice("--layout", self.layout, LAYOUTS)
        _choice("--latent", self.latent, LATENTS)
        if self.head_map is not None:
            _choice("--head-map", self.head_map, HEAD_MAPS)
        if self.arch is not None:
            _choice("--arch", self.arch, ARCH_NAMES)
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
    def resolved_method(self) -> str:
        return self.method or ("fisher" if self.calib is not None else "svd")

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
            _choice("--method", self.method, METHODS)
        if self.allocation is not None:
            _choice("--allocation", self.allocation, ALLOCATIONS)
        if self.rank is not None and self.kv_cache_ratio is not None:
            raise ConvertError("--rank and --kv-cache-ratio both set the cache size; give one of them")
        if self.kv_cache_ratio is not None and not 0 < self.kv_cache_ratio <= 1:
            raise ConvertError(
                f"--kv-cache-ratio {self.kv_cache_ratio} must be in (0, 1], e.g. 0.5 keeps half the GQA cache"
            )
        if self.resolved_method != "svd" and self.calib is None and self.lossy:
            raise ConvertError(
                f"--method {self.resolved_method} weights the error by real inputs: pass --calib FILE (a text)"
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
            _choice("--calibration", self.calibration, CALIBRATIONS)
        if self.calibration == "sequential" and self.lossy and self.resolved_method == "svd":
            raise ConvertError(
                "--calibration sequential refits on calibration text: pass --calib FILE (method whitened or fisher)"
            )
        if not self.nope_angle >= 0:
            raise ConvertError(f"--nope-angle {self.nope_angle} must be a non-negative angle in radians (0: off)")
        if self.calib_tokens < 2:
            raise ConvertError(f"--calib-tokens {self.calib_tokens} must be at least 2")
        if self.refine_steps is not None and self.refine_steps < 0:
            raise ConvertError(f"--refine-steps {self.refine_steps} must be 0 (no refinement) or more")
        if self.refine_steps and self.lossy and self.resolved_method == "svd":
            raise ConvertError(
                "--refine-steps fits each layer to its attention output on calibration text: pass --calib FILE "
                "(method whitened or fisher), or --refine-steps 0"
            )

    def check_calibrated(self) -> None:
        """Compression picks its method on purpose: calibration text, or an explicit --method svd."""
        if self.lossy and self.method is None and self.calib is None:
            raise ConvertError(
                "compressing below the exact rank needs calibration text: pass --calib FILE (a text unlike --text; "
                "the fisher method, the best measured), or --method svd to accept plain weight SVD, which loses "
                "far more (perplexity ×100s on real models)"
            )

    def check_verifiable(self) -> None:
        """A lossy conversion is judged by perplexity on real text: both must be given."""
        if self.lossy and self.verify and (self.max_ppl_ratio is None or self.text is None):
            raise ConvertError(
                "a compressed conversion is lossy: verification judges it by perplexity on real text, so pass "
                "--text FILE and --max-ppl-ratio R (e.g. 1.2), or --no-verify"
            )

    def verify_options(self) -> VerifyOptions:
        """The verification part of these options."""
        return VerifyOptions(**{f.name: getattr(self, f.name) for f in fields(VerifyOptions)})


@dataclass
class HealOptions(_FromKwargs):
    """How `heal` trains: KL distillation of the MLA projections toward the original model.
    Every field is a flag of `convert heal` and a keyword of `convert.heal`."""

    force: bool = option(
        False, "Replace the output directory if it exists (only one that convert wrote).", group="output"
    )
    steps: int | None = option(
        None,
        "Optimizer steps (each on one global batch of windows: see --batch-size). Default: sized by the "
        "device (CPU 200, CUDA 2,000).",
        group="training",
        kind=int,
    )
    lr: float = option(
        1e-3,
        "AdamW learning rate of the MLA projections, relative: each tensor's is this times its RMS "
        "(warmed up over 10 steps, then a cosine to 0).",
        group="training",
    )
    window: int | None = option(
        None,
        "Tokens per training window. Default: sized by the device (CPU 256, CUDA 1,024).",
        group="training",
        kind=int,
    )
    eval_window: int = option(1024, "Tokens per window of the before/after perplexity.", group="training")
    tokens: int | None = option(
        None,
        "Tokens of --text to use (the last eighth is held out unless --eval-text; of the rest, the last "
        "sixteenth, at most 32,768, is kept for --check-every). Default: sized by the device (CPU 16,384, "
        "CUDA 4,194,304).",
        group="training",
        kind=int,
    )
    check_every: int = option(
        25,
        "Every N steps, measure the KL on a slice of --text held out from training (its last sixteenth): "
        "keep the best weights, and when the KL got worse go back to them at half the rate. 0: no checks.",
        group="training",
    )
    seed: int = option(0, "Seed of the window order.", group="training")
    batch_size: int | None = option(
        None,
        "Windows per micro-batch, per process (a step trains on batch size x grad accum x processes). "
        "Default: sized by the device (CPU 1, CUDA 8).",
        group="training",
        kind=int,
    )
    grad_accum: int = option(1, "Micro-batches accumulated per optimizer step, per process.", group="training")
    text_field: str = option("text", "The text's field in --text JSONL / Parquet rows.", group="training")
    streaming: bool = option(
        False,
        "Read --text as a stream, epoch after epoch (corpora larger than memory): needs --eval-text; the "
        "check tokens are the stream's first --tokens/16 (at most 32,768).",
        group="training",
    )
    save_every: int = option(
        0, "Write a checkpoint every N steps to the training directory (0: none); see --resume.", group="training"
    )
    resume: bool = option(
        False, "Continue from the latest checkpoint in the training directory (same options).", group="training"
    )
    device: str = option(
        "auto", "Where to train: auto = CUDA when present, else CPU.", group="advanced", choices=DEVICES
    )
    mixed_precision: str = option(
        "auto", "auto = bf16 on CUDA, no (float32) on CPU.", group="advanced", choices=MIXED_PRECISIONS
    )
    gradient_checkpointing: bool = option(
        False, "Recompute activations in the backward pass: less memory, more time.", group="advanced"
    )
    log_with: str = option(
        "auto",
        "Metrics tracker (in the training directory): auto = TensorBoard when installed; also in healing.json.",
        group="advanced",
        choices=TRACKERS,
    )
    max_shard_size: int | str = option(
        "5GB", "Start a new safetensors shard above this many bytes.", group="advanced", kind=str
    )
    progress: bool = option(
        True, "No progress bar or summary.", group="advanced", flag="--quiet", short="-q", off_flag="--quiet"
    )

    def __post_init__(self) -> None:
        _choice("--device", self.device, DEVICES)
        if self.device == "cuda":
            resolve_device(self.device)
        if self.steps is not None and self.steps < 1:
            raise ConvertError(f"--steps {self.steps} must be at least 1")
        if not self.lr > 0:
            raise ConvertError(f"--lr {self.lr} must be a positive learning rate (e.g. 1e-3)")
        if (self.window is not None and self.window < 2) or self.eval_window < 2:
            raise ConvertError(f"--window {self.window} / --eval-window {self.eval_window}: at least 2 tokens each")
        if self.tokens is not None and self.tokens < 4:
            raise ConvertError(f"--tokens {self.tokens} must be at least 4")
        if self.check_every < 0:
            raise ConvertError(f"--check-every {self.check_every} must be 0 (no checks) or a number of steps")
        _choice("--mixed-precision", self.mixed_precision, MIXED_PRECISIONS)
        _choice("--log-with", self.log_with, TRACKERS)
        for flag, value in (("--batch-size", self.batch_size), ("--grad-accum", self.grad_accum)):
            if value is not None and value < 1:
                raise ConvertError(f"{flag} {value} must be at least 1")
        if self.save_every < 0:
            raise ConvertError(f"--save-every {self.save_every} must be 0 (no checkpoints) or a number of steps")

    @property
    def torch_device(self) -> torch.device:
        return resolve_device(self.device)

    def sized(self) -> HealOptions:
        """These options with every size left unset (None) taken from `HEAL_SIZES` for the device."""
        sizes = HEAL_SIZES["cuda" if self.torch_device.type == "cuda" else "cpu"]
        return replace(self, **{k: v for k, v in sizes.items() if getattr(self, k) is None})


#: Healing's sizes by device, for the options left unset: what two CPU cores train in minutes
#: (measured: docs/healing.md), and a GPU's (16,384 tokens a step; docs/healing.md, "Sized by the device").
HEAL_SIZES = {
    "cpu": {"steps": 200, "window": 256, "tokens": 16384, "batch_size": 1},
    "cuda": {"steps": 2000, "window": 1024, "tokens": 1 << 22, "batch_size": 8},
}


#: The local lm_eval tasks shipped in convert/eval_tasks/ (`convert.lm_tasks.LOCAL_TASKS`).
EVAL_TASKS = "convert_ppl,convert_mc"


@dataclass
class EvalOptions(_FromKwargs):
    """How `convert eval` runs lm-evaluation-harness. Every field is a flag of `convert eval` and a
    keyword of `convert.evaluate.evaluate`."""

    tasks: str = option(
        EVAL_TASKS,
        "lm_eval tasks, comma-separated: the local ones (no download), or any of lm_eval's own.",
        group="output",
    )
    limit: int | None = option(None, "Documents per task (default: all).", group="output", kind=int)
    batch_size: int = option(1, "lm_eval's batch size.", group="advanced")
    device: str = option(
        "auto", "Where the models run: auto = CUDA when present, else CPU.", group="advanced", choices=DEVICES
    )
    dtype: str = option("float32", "Precision of the runs.", group="advanced", choices=DTYPES)
    max_length: int | None = option(
        None,
        "lm_eval's context, the longest window of a rolling perplexity (default: the original's "
        "max_position_embeddings).",
        group="advanced",
        kind=int,
        cli=False,
    )

    def __post_init__(self) -> None:
        _choice("--device", self.device, DEVICES)
        _choice("--dtype", self.dtype, DTYPES)
        if not self.task_names:
            raise ConvertError(f"--tasks {self.tasks!r}: no task given; pass e.g. --tasks {EVAL_TASKS}")
        if self.limit is not None and self.limit < 1:
            raise ConvertError(f"--limit {self.limit} must be at least 1 (documents per task)")
        if self.batch_size < 1:
            raise ConvertError(f"--batch-size {self.batch_size} must be at least 1")
        if self.max_length is not None and self.max_length < 2:
            raise ConvertError(f"max_length {self.max_length} must be at least 2 tokens")

    @property
    def task_names(self) -> list[str]:
        return [task.strip() for task in self.tasks.split(",") if task.strip()]


def cli_fields(cls) -> list:
    """The dataclass fields of `cls` that are CLI flags, in `--help` order: by section (GROUPS);
    within one, its own fields before its base's (gqa2mla's before verify's), as declared."""
    rank = {group: i for i, group in enumerate(GROUPS)}
    inherited = {f.name for base in cls.__mro__[1:] if hasattr(base, "__dataclass_fields__") for f in fields(base)}
    cli = [f for f in fields(cls) if f.metadata.get("cli", False)]
    return sorted(cli, key=lambda f: (rank[f.metadata["group"]], f.name in inherited))  # stable sort


def field_default(f):
    return None if f.default is MISSING else f.default


def resolve_device(name: str) -> torch.device:
    """auto = CUDA when present, else CPU; an explicit cuda without one is refused."""
    import torch  # heavy: options is on the light CLI path (--help, refusals), which must not import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConvertError("--device cuda: no CUDA device is visible to torch; use --device auto or cpu")
    return torch.device(name)


def _choice(flag: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConvertError(f"{flag} {value!r} is not one of {', '.join(allowed)}")


#: Flags that are not options fields: the commands' own paths (cli.py), by their API keyword.
_PATH_FLAGS = {
    "-o": "output",
    "--output": "output",
    "--report-dir": "report_dir",
    "--eval-text": "eval_texts",
    "--original": "original",
    "--training-dir": "training_dir",
}


@cache
def _keywords() -> dict[str, tuple[str, object, tuple]]:
    """Each command-line flag -> (its API keyword, the value a boolean flag sets or None, its choices)."""
    table = {flag: (name, None, ()) for flag, name in _PATH_FLAGS.items()}
    for cls in (ConvertOptions, HealOptions, EvalOptions):
        for f in cli_fields(cls):
            meta, default = f.metadata, field_default(f)
            if meta["off_flag"]:
                flag, entry = meta["off_flag"], (f.name, not default, ())
            else:
                flag = meta["flag"] or "--" + f.name.replace("_", "-")
                entry = (f.name, True if isinstance(default, bool) else None, meta["choices"] or ())
            table[flag] = entry
            if meta["short"]:
                table[meta["short"]] = entry
    return table


_FLAG = re.compile(
    r"(?<![\w-])(-[a-zA-Z]|--[a-z][a-z0-9-]*)(?![\w-])(?: ('[^']*'|-?\d[\d.e+-]*|[A-Z][A-Z_]*\b|[a-z][\w-]*))?"
)


def python_terms(message: str) -> str:
    """A message's command-line flags as the Python API's keywords: `--kv-cache-ratio 0.5` ->
    `kv_cache_ratio=0.5`, `--method svd` -> `method='svd'`, `--force` -> `force=True`, `-o` -> `output`.
    Words that are not flags of convert's commands are left as they are."""

    def keyword(match: re.Match) -> str:
        known = _keywords().get(match.group(1))
        if known is None:
            return match.group(0)
        name, flag_value, choices = known
        value = match.group(2)
        if flag_value is not None:
            return f"{name}={flag_value}" + (f" {value}" if value else "")
        if value is None:
            return name
        if value[0].islower():  # a word: the option's value only if it is one of its choices
            return f"{name}={value!r}" if value in choices else f"{name} {value}"
        return f"{name}={value}"

    return _FLAG.sub(keyword, message)


speak_python(python_terms)
