"""The options of a conversion: one field per CLI flag."""

from dataclasses import dataclass, fields
from pathlib import Path

from convert.errors import ConvertError

LAYOUTS = ("absorbed", "factored")
LATENTS = ("split", "joint")
DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("float32", "float64", "bfloat16", "float16")


@dataclass
class ConvertOptions:
    """Everything `gqa2mla` can be told. Defaults give the exact conversion.

    Model description (only needed for a bare file without config.json):
      arch, n_heads, n_kv_heads, head_dim.
    Math: head_map (grouped|tiled, default from the architecture), latent
      (split|joint), layout (absorbed|factored), rank (latent dims per latent;
      None = exact).
    Output: max_shard_size (bytes or "5GB"), force (replace an existing output),
      progress (a progress bar on a terminal).
    Verification: verify, text (a text file; else random inputs), tokens,
      device (auto|cpu|cuda), dtype (of the verification run; default float64).
    """

    arch: str | None = None
    n_heads: int | None = None
    n_kv_heads: int | None = None
    head_dim: int | None = None
    head_map: str | None = None
    latent: str = "split"
    layout: str = "absorbed"
    rank: int | None = None
    max_shard_size: int | str = "5GB"
    force: bool = False
    progress: bool = True
    verify: bool = True
    text: Path | None = None
    tokens: int = 256
    device: str = "auto"
    dtype: str = "float64"

    def __post_init__(self) -> None:
        _choice("--layout", self.layout, LAYOUTS)
        _choice("--latent", self.latent, LATENTS)
        _choice("--device", self.device, DEVICES)
        _choice("--dtype", self.dtype, DTYPES)
        if self.rank is not None and self.rank <= 0:
            raise ConvertError(f"--rank {self.rank} must be a positive number of latent dims (omit it for the exact rank)")
        if self.tokens <= 1:
            raise ConvertError(f"--tokens {self.tokens} must be at least 2")

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
