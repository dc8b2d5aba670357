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
An `o_proj` bias (a constant on the residual, with no place in the export) is refused.
"""

from dataclasses import dataclass

import torch

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
