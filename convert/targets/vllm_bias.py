"""Attention biases on q/k/v (Qwen2, Qwen2.5) in a vLLM DeepSeek-V3 export, whose attention Linears
have none: each bias carried into its weight on the layer's calibration inputs.

The best linear stand-in for an affine map `W x + b` on inputs of second moment M = E[x xᵀ] and mean
μ = E[x] is `W' = W + b aᵀ`, a = M⁻¹ μ (least squares of W'x against Wx + b): the bias rides on
whatever the inputs hold nearly constant (real hidden states carry such directions). What it leaves
out is the same share of every bias of the layer, E[(1 − aᵀx)²] = 1 − μᵀ M⁻¹ μ. Where each goes:
- a query bias: into W^Q, so into both the position-free query and `q_pe`;
- a key bias: into W^K before the rotary mixture is taken, so its share in the 64 rotary dims
  rotates in `k_pe` and the rest rides with the position-free keys in the latent. In the source
  that rest is rotated (qᵀ R_Δ b depends on the distance Δ); in the export it meets the same fitted
  stand-in as the keys' content, so the key bias loses what the content loses there (measured:
  carrying it this way beats dropping the position-free share, which would be exact only if the
  source did not rotate it);
- a value bias: into W^V. The source adds Σα·b = b after attention (a constant W^O b on the
  residual); the export reproduces it through the latent, each value's error averaged by attention.
- an `o_proj` bias: a constant on the residual, which the export has no bias to hold. Carried the
  same way into W^O, on the attention's outputs (their moments gathered by `output_observer`): the
  bias rides on what the attention outputs hold nearly constant (the values of attention sinks,
  the value bias's own Σα·b_v = b_v). What that leaves out is reported like the others.
"""

from dataclasses import dataclass

import torch

from convert.compress.calibrate import LayerStats
from convert.compress.weights import ridge


@dataclass(frozen=True)
class BiasCarrier:
    """How one layer's biases ride on its inputs: `direction` a (D,) with W' = W + b aᵀ, and
    `left_out` E[(1 − aᵀx)²], the share of each bias's mean square that aᵀx does not reproduce."""

    direction: torch.Tensor
    left_out: float

    def carry(self, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """weight (n, D) with `bias` (n,) carried in it, float64 (weight as it is without a bias)."""
        if bias is None:
            return weight
        return weight.double() + torch.outer(bias.double(), self.direction)


def bias_carrier(layer_stats) -> BiasCarrier:
    """The layer's `BiasCarrier` from its calibration statistics (`LayerStats`: moment, mean)."""
    moment, mean = layer_stats.moment.double(), layer_stats.mean.double()
    direction = torch.linalg.solve(ridge(moment), mean)  # (D,)
    left_out = 1.0 - 2.0 * float(direction @ mean) + float(direction @ moment @ direction)
    return BiasCarrier(direction, max(left_out, 0.0))


def output_error(weight: torch.Tensor, bias: torch.Tensor, layer_stats, carrier: BiasCarrier) -> float:
    """The mean-square error the carried bias leaves in the projection's output (on the calibration
    inputs), relative to the output's mean square: left_out·‖b‖² / E‖Wx + b‖²."""
    w, b = weight.double(), bias.double()
    moment, mean = layer_stats.moment.double(), layer_stats.mean.double()
    energy = float(torch.einsum("id,de,ie->", w, moment, w)) + 2.0 * float(b @ (w @ mean)) + float(b @ b)
    return carrier.left_out * float(b @ b) / energy


def biased_projections(spec, source) -> list[str]:
    """The attention projections ("q", "k", "v", "o") with a bias in any layer of `source`."""
    return sorted(
        {proj for layer in range(spec.n_layers) for proj in "qkvo" if spec.tensor(layer, proj, "bias") in source}
    )


def output_observer():
    """A `convert.compress.calibrate` observer that stores the moments of each layer's attention
    output, the input of `o_proj` (B·L, H·d), in its stats' `output_moment` and `output_mean`:
    what an `o_proj` bias is carried on. Runs the layer's attention once more on its normed inputs."""

    def observe(layer: int, x: torch.Tensor, decoder, inputs, layer_stats) -> None:
        _, rotary, mask = inputs
        seen = []
        hook = decoder.self_attn.o_proj.register_forward_pre_hook(lambda _module, args: seen.append(args[0]))
        try:
            decoder.self_attn(hidden_states=x, position_embeddings=rotary, attention_mask=mask)
        finally:
            hook.remove()
        flat = seen[0].reshape(-1, seen[0].shape[-1]).double().cpu()  # (B·L, H·d)
        layer_stats.output_moment, layer_stats.output_mean = flat.T @ flat / flat.shape[0], flat.mean(0)

    return observe


def observers(*observe):
    """One `calibrate` observer that calls each of `observe` that is not None (None if none is)."""
    given = [fn for fn in observe if fn is not None]
    if not given:
        return None

    def each(*args) -> None:
        for fn in given:
            fn(*args)

    return each


def output_stats(layer_stats) -> LayerStats:
    """The attention outputs' moments (`output_observer`) as a `LayerStats`, for `bias_carrier`."""
    if layer_stats is None or layer_stats.output_moment is None:
        raise ValueError("an o_proj bias needs the attention outputs' moments (output_observer) to be carried")
    return LayerStats(layer_stats.output_moment, layer_stats.output_mean)
