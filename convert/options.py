"""The options of a conversion: one field per CLI flag."""

from dataclasses import dataclass, fields
from pathlib import Path

from convert.errors import ConvertError

LAYOUTS = ("absorbed", "factored")
LATENTS = ("split", "joint")
DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("float32", "float64", "bfloat16", "float16")
METHODS = ("svd", "whitened", "fisher")
ALLOCATIONS = ("uniform", "global")


@dataclass
class ConvertOptions:
    """Everything `gqa2mla` can be told. Defaults give the exact conversion.

    Model description (only needed for a bare file without config.json):
      arch, n_heads, n_kv_heads, head_dim.
    Math: head_map (grouped|tiled, default from the architecture), latent
      (split|joint), layout (absorbed|factored), rank (latent dims per latent;
      None = exact).
    Compression (below the exact rank, lossy): kv_cache_ratio (fraction of the
      GQA cache to keep) or rank; method (svd|whitened|fisher; default
      fisher with calib, else svd); allocation (uniform|global; default global
      for fisher); calib (a text file, or token ids (1, N) from the API), calib_tokens.
    Output: max_shard_size (bytes or "5GB"), force (replace an existing output),
      progress (a progress bar on a terminal).
    Verification: verify, text (a text file; else random inputs), tokens,
      device (auto|cpu|cuda), dtype (of the verification run; default float64),
      max_ppl_ratio (how a lossy conversion is judged: perplexity on `text`).
    """

    arch: str | None = None
    n_heads: int | None = None
    n_kv_heads: int | None = None
    head_dim: int | None = None
    head_map: str | None = None
    latent: str = "split"
    layout: str = "absorbed"
    rank: int | None = None
    kv_cache_ratio: float | None = None
    method: str | None = None
    allocation: str | None = None
    calib: Path | None = None
    calib_tokens: int = 4096
    max_shard_size: int | str = "5GB"
    force: bool = False
    progress: bool = True
    verify: bool = True
    text: Path | None = None
    tokens: int = 256
    device: str = "auto"
    dtype: str = "float64"
    max_ppl_ratio: float | None = None

    def __post_init__(self) -> None:
        _choice("--layout", self.layout, LAYOUTS)
        _choice("--latent", self.latent, LATENTS)
        _choice("--device", self.device, DEVICES)
        _choice("--dtype", self.dtype, DTYPES)
        if self.rank is not None and self.rank <= 0:
            raise ConvertError(
                f"--rank {self.rank} must be a positive number of latent dims (omit it for the exact rank)"
            )
        self._check_compression()
        if self.tokens <= 1:
            raise ConvertError(f"--tokens {self.tokens} must be at least 2")

    @property
    def lossy(self) -> bool:
        """Whether this asks for less than the exact rank."""
        return self.rank is not None or (self.kv_cache_ratio is not None and self.kv_cache_ratio < 1)

    @property
    def resolved_method(self) -> str:
        return self.method or ("fisher" if self.calib is not None else "svd")

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
        if self.calib_tokens < 2:
            raise ConvertError(f"--calib-tokens {self.calib_tokens} must be at least 2")

    def check_verifiable(self) -> None:
        """A lossy conversion is judged by perplexity on real text: both must be given."""
        if self.lossy and self.verify and (self.max_ppl_ratio is None or self.text is None):
            raise ConvertError(
                "a compressed conversion is lossy: verification judges it by perplexity on real text, so pass "
                "--text FILE and --max-ppl-ratio R (e.g. 1.2), or --no-verify"
            )

    @classmethod
    def from_kwargs(cls, **kwargs) -> "ConvertOptions":
        """Build from keyword options, refusing unknown names with the list of known ones."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**kwargs)


def _choice(flag: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConvertError(f"{flag} {value!r} is not one of {', '.join(allowed)}")
