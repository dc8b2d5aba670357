"""Attention biases (Qwen2's q/k/v, Llama's attention_bias) in a vLLM DeepSeek-V3 export, whose
attention Linears have none: each carried into its weight on the layer's calibration inputs."""

from dataclasses import dataclass, replace

import torch

from convert.compress.calibrate import LayerStats
from convert.compress.weights import ridge
from convert.transform import LayerWeights

#: A key bias's share in a rotary slot is carried only where vLLM turns that slot by at least this many
#: radians over the span the position-free terms are fitted for (`key_bias_slots`).
KEY_BIAS_ANGLE = 1.0


@dataclass(frozen=True)
class BiasCarrier:
    """How one layer's biases ride on its inputs: `direction` a (D,) with W' = W + b aᵀ, and
    `left_out` E[(1 − aᵀx)²], the share of each bias's mean square that aᵀx does not reproduce.

    The best linear stand-in for an affine map `W x + b` on inputs of second moment M = E[x xᵀ] and
    mean μ = E[x] is `W' = W + b aᵀ`, a = M⁻¹ μ (least squares of W'x against Wx + b): the bias
    rides on whatever the inputs hold nearly constant. What it leaves out is the same share of every
    bias of the layer, 1 − μᵀ M⁻¹ μ. Where each goes:
    - a query bias: into W^Q, so into both the position-free query and `q_pe`;
    - a key bias: only its share in the rotary slots that turn (`key_bias_slots`), into `k_pe`.
      A key bias b adds q·R b to every score of a query; where the export drops the rotation (the
      position-free keys) or the slot turns slowly, that is the same for every key, so leaving it
      out changes no attention weight, while carrying it gives each key its own error
      (1 − aᵀx)·q·b. Qwen2.5's key biases (norm ~1,200 in the 1.5B's first layer, in its slowest
      pairs) made that error larger than the scores: carried whole, the export's perplexity was
      ×3.4 million the original's (`bench/every_path.py`);
    - a value bias: into W^V. The source adds Σα·b = b after attention; the export reproduces it
      through the latent, each value's error averaged by attention;
    - an `o_proj` bias: into W^O, on the attention's outputs (their moments gathered by
      `output_observer`): it rides on what they hold nearly constant (attention sinks' values,
      the value bias's own Σα·b_v = b_v)."""

    direction: torch.Tensor
    left_out: float

    def carry(self, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """weight (n, D) with `bias` (n,) carried in it, float64 (weight as it is without a bias)."""
        if bias is None:
            return weight
        return weight.double() + torch.outer(bias.double(), self.direction)


def key_bias_slots(rotary_freq: torch.Tensor, fold: int, span: int) -> torch.Tensor:
    """(d/2/fold,) bool: the rotary slots whose share of a key bias is carried, those the engine turns by at
    least `KEY_BIAS_ANGLE` radians over `span` tokens. rotary_freq (d/2,): the rate the engine turns each
    source pair's rotary key by (`rope_frequencies`), slot s = pair s·fold."""
    return rotary_freq[::fold] * span >= KEY_BIAS_ANGLE


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


def carried_biases(weights: LayerWeights, layer_stats, figures: list) -> tuple[BiasCarrier | None, LayerWeights]:
    """(the layer's `BiasCarrier` for its q/k/v biases, or None without; its weights with an o_proj
    bias carried into W^O on the attention outputs), the figures appended to `figures` when it has
    biases: {"left_out": share, "q"/"k"/"v"/"o": the projection's relative output error,
    "o_left_out": the o_proj carrier's share}."""
    biases = {"q": weights.q_bias, "k": weights.k_bias, "v": weights.v_bias}
    if all(b is None for b in (*biases.values(), weights.o_bias)):
        return None, weights
    entry, carrier = {}, None
    if any(b is not None for b in biases.values()):
        carrier = bias_carrier(layer_stats)
        entry["left_out"] = carrier.left_out
    for proj, bias in biases.items():
        if bias is not None:
            assert carrier is not None  # made above: a q/k/v bias
            entry[proj] = output_error(getattr(weights, proj), bias, layer_stats, carrier)
    if weights.o_bias is not None:
        outputs = output_stats(layer_stats)
        o_carrier = bias_carrier(outputs)
        entry["o"] = output_error(weights.o, weights.o_bias, outputs, o_carrier)
        entry["o_left_out"] = o_carrier.left_out
        weights = replace(weights, o=o_carrier.carry(weights.o, weights.o_bias), o_bias=None)
    figures.append(entry)
    return carrier, weights


def bias_summary(figures: list[dict]) -> dict | None:
    """convert_export's `attention_biases`: None without biases, else the per-layer figures."""
    if not figures:
        return None
    projections = [p for p in "qkvo" if p in figures[0]]
    summary = {
        "carried": [p + "_proj" for p in projections],
        "where": "in the projection weights, on the calibration inputs' constant (least squares); a key bias only "
        "in the rotary slots that turn (elsewhere it adds the same to every score of a query)",
        "left_out_share": [f.get("left_out", 0.0) for f in figures],
        "output_error": {p + "_proj": [f[p] for f in figures] for p in projections},
    }
    if "o" in projections:  # o_proj's carrier: the attention outputs' constant
        summary["o_proj_left_out_share"] = [f["o_left_out"] for f in figures]
    return summary
