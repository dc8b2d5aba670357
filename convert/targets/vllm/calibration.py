"""What the vllm export learns from calibration text: the fitted stand-in for the dropped rotations
(`rotation_fit_observer`) and the sequential factoring and refinement of a compressed latent."""

import torch

from convert import compress
from convert.arch import AttentionSpec
from convert.compress.refine import NO_REFINEMENT, Refinement
from convert.compress.sequential import SequentialCalibration
from convert.hf import hf_config
from convert.linalg.heads import group_of_head
from convert.progress import progress_bar
from convert.rope.frequencies import fold
from convert.source import read_layer
from convert.targets.vllm.bias import observers, output_observer
from convert.targets.vllm.geometry import ROPE_DIM
from convert.targets.vllm.nope_fit import (
    SAMPLES,
    attention_probabilities,
    fit_normal_equations,
    fit_rotation_stand_in,
    key_remainder,
    per_pair,
    rotary_coefficients,
    rotary_mixture,
    sample_keys,
)
from convert.targets.vllm.rope import rope_frequencies
from convert.targets.vllm.rotary import rotary_directions
from convert.targets.vllm.runtime import ExportAttention
from convert.text import fisher_ids

STAND_INS = ("fit", "nope", "drop", "expected")
#: How the vllm target's compressed latent is calibrated unless --calibration says: in the closed form,
#: original measured better at 75% and 25% of the latent's need on SmolLM2, sequential at 50%; refined
#: (the default; before the drift entered the target), the two measured the same at 25%, x1.502 and x1.501
#: (bench/vllm_latent.py).
VLLM_CALIBRATION = "original"


def export_statistics(
    source,
    config: dict,
    view,
    spec: AttentionSpec,
    ids: torch.Tensor,
    fisher: bool,
    lossy: bool = True,
    output_bias: bool = False,
    progress: bool = False,
    fisher_tokens: int | None = None,
    rope_dim: int = ROPE_DIM,
) -> list:
    """Per-layer statistics of `source` (a checkpoint) on the calibration token `ids` (1, N), what the
    export is calibrated with (`ExportChoices.stats`): the layers' input moments, with the fitted stand-in
    for the dropped rotations where the export is `lossy` (`needs_calibration`), the attention outputs'
    moments where `output_bias` (an o_proj bias is carried), and with `fisher` the Fisher rows that
    weigh a compressed latent in loss units, from the first `fisher_tokens` of `ids` (None: all). view: the
    source's attention view (`resolve_vllm_spec`); rope_dim: the export's rotary key width."""
    rotation_fit = rotation_fit_observer(view, spec, config, rope_dim=rope_dim) if lossy else None
    observe = observers(rotation_fit, output_observer() if output_bias else None)
    bar = progress_bar("calibrating", "layer", progress)
    stats = compress.calibrate(source, config, ids, spec.n_layers, progress=bar, observe=observe)
    if fisher:
        bar = progress_bar("fisher statistics", "layer", progress)
        rows = compress.fisher_calibrate_streamed(
            source, config, fisher_ids(ids, fisher_tokens), spec.n_layers, progress=bar
        )
        for layer_stats, layer_fisher in zip(stats, rows):
            layer_stats.key_fisher, layer_stats.value_fisher = layer_fisher.key_fisher, layer_fisher.value_fisher
    return stats


def latent_sequential(
    source, config: dict, ids: torch.Tensor, calibration: str | None = None, refinement: Refinement = NO_REFINEMENT
) -> "SequentialLatents | None":
    """What a compressed latent's factoring runs through (`ExportChoices.sequential`) on the token `ids`:
    with `calibration` "sequential" (None: `VLLM_CALIBRATION`) its up-projections refit on the inputs the
    export's own earlier layers give it, and each layer's attention refined `refinement.steps`; None where
    neither is asked."""
    refit = (calibration or VLLM_CALIBRATION) == "sequential"
    if not (refit or refinement.steps):
        return None
    module_source = getattr(source, "module_source", source)
    return SequentialLatents(module_source, config, ids, refit=refit, refinement=refinement)


def position_free_stand_in(
    mode: str, layer_stats, n_heads: int, inv_freq: torch.Tensor, span: int = 1024
) -> torch.Tensor | None:
    """`attention_tensors`' stand_in (H, 2, d/2, 2) for the position-free (NoPE) terms, or None
    for the terms unrotated (their rotation dropped: right at distance 0). mode fit: the
    calibration's fit (`layer_stats.rotation_fit`, from `rotation_fit_observer`; None without
    one); drop: (α, β) = (0, 0); expected: (E[cos θ_j Δ], 0) over Δ uniform in [0, span); nothing
    added to the rotary query but with fit. Measured on a dev text: bench/vllm_variants.py."""
    if mode == "fit":
        return getattr(layer_stats, "rotation_fit", None)
    if mode == "nope":
        return None
    if mode == "drop":
        alpha = torch.zeros_like(inv_freq)
    elif mode == "expected":
        alpha = torch.cos(inv_freq[:, None] * torch.arange(span, dtype=torch.float64)[None, :]).mean(1)
    else:
        raise ValueError(f"unknown stand-in {mode!r}; use one of {STAND_INS}")
    stand_in = torch.zeros(n_heads, 2, len(inv_freq), 2, dtype=torch.float64)
    stand_in[:, 0, :, 0] = alpha
    return stand_in


def rotation_fit_observer(source, spec: AttentionSpec, config, samples: int = SAMPLES, rope_dim: int = ROPE_DIM):
    """A `convert.compress.calibrate` observer that stores each layer's fitted stand-in for the
    dropped rotations (`convert.targets.vllm.nope_fit`) in its stats' `rotation_fit` (H, 2, d/2, 2):
    the layer's rotary directions from the moment just gathered, `samples` keys per query drawn
    from the original's attention probabilities (seeded by the layer index: the same every run).
    source: the in-memory source of `resolve_vllm_spec`; rope_dim: the export's rotary key width."""
    H, G, d = spec.n_heads, spec.n_kv_heads, spec.head_dim
    inv_freq, rotary_freq = rope_frequencies(hf_config(config), d, rope_dim)  # (d/2,) each: slot s turns at θ'_s
    groups = group_of_head(H, G, spec.head_map)  # (H,)
    f = fold(d, rope_dim)

    def observe(layer: int, x: torch.Tensor, decoder, inputs, layer_stats) -> None:
        _, rotary, mask = inputs
        u, _ = rotary_directions(read_layer(source, spec, layer), spec, layer_stats.moment, rope_dim)  # (slots, G·f)
        base = rotary_coefficients(u, groups, G)  # (H, d/2)
        attention = decoder.self_attn
        generator = torch.Generator().manual_seed(layer)
        gram: torch.Tensor | int
        rhs: torch.Tensor | int
        gram, rhs = 0, 0
        for window in x.split(1):  # one (1, L, D) window at a time: its probabilities are (H, L, L)
            L = window.shape[1]
            q = attention.q_proj(window).view(L, H, d)  # pre-RoPE queries
            k = attention.k_proj(window).view(1, L, G, d)  # pre-RoPE keys
            mixture = rotary_mixture(k, u)  # (1, L, rope_dim): what k_pe holds
            remainder = key_remainder(k, u, mixture)[0][:, groups]  # (L, H, d): each head's group's
            rotary_key = per_pair(mixture[0], f)  # (L, d): the rotary key each query pair meets
            probs = attention_probabilities(attention, window, rotary, None if mask is None else mask[:1])
            keys = sample_keys(probs[0].cpu(), samples, generator)  # (H, L, S)
            window_gram, window_rhs = fit_normal_equations(
                q.cpu(), remainder.cpu(), rotary_key.cpu(), keys, inv_freq, rotary_freq, base
            )
            gram, rhs = gram + window_gram, rhs + window_rhs
        assert isinstance(gram, torch.Tensor) and isinstance(rhs, torch.Tensor)  # x has at least one window
        layer_stats.rotation_fit = fit_rotation_stand_in(gram, rhs)

    return observe


class SequentialLatents:
    """Sequential calibration of the vllm target's compressed latent (`convert.compress.sequential`):
    the calibration text runs through the original model and, side by side, through the source
    with the export's attention in the layers converted so far, so layer ℓ's latent is factored
    for the inputs it will see and its up-projections refit to the original layer's keys and
    values (refit=False: factored on the original's inputs as without it). With `refinement`
    steps, each compressed layer's export attention is then fitted to the original layer's
    attention output (`convert.compress.refine`). One decoder layer in memory, plus both streams'
    hidden states."""

    def __init__(
        self,
        checkpoint,
        config: dict,
        token_ids: torch.Tensor,
        refit: bool = True,
        refinement: Refinement = NO_REFINEMENT,
    ):
        self.refit = refit
        self.calibration = SequentialCalibration(checkpoint, config, token_ids, refinement=refinement)

    @property
    def refine_steps(self) -> int:
        return self.calibration.refinement.steps

    def stats(self, layer: int):
        """Layer `layer`'s `SequentialStats` (loads it); None when the latent is not refit."""
        return self.calibration.stats(layer) if self.refit else None

    def advance(
        self, layer: int, tensors: dict[str, torch.Tensor], export_config: dict, s: float, refine: bool = False
    ) -> dict[str, torch.Tensor]:
        """Run layer `layer` in both streams, the export's attention (`tensors`, by name relative to
        `self_attn.`) in the compressed one, refined first when `refine` and steps are asked.
        Returns the layer's tensors as run (refined or the given ones)."""
        attention = ExportAttention(export_config, layer, tensors, s)
        refine = refine and self.refine_steps > 0
        self.calibration.advance_with(layer, attention, refine=refine)
        return attention.export_tensors(s) if refine else tensors
