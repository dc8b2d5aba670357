"""Per-layer verification, streamed: one original decoder layer in memory at a time.

For each layer the original attention (transformers' own module, or the seed's
MyGQA) and the converted `MLAAttention` see the same inputs, positions, rotary
embeddings and mask. With token ids, the inputs are the hidden states that
really reach that layer: the original decoder layers run one after another on
captured hidden states. Without, they are random N(0, 1) (post-norm scale).
"""

import importlib
from dataclasses import dataclass

import torch

from convert.arch import ARCHS
from convert.io import Checkpoint
from convert.mla.attention import MLAAttention
from convert.mla.model import hf_config
from convert.verify.seed import MyGQA


@dataclass
class LayerRun:
    """Everything a layer check needs besides the layer index."""

    original: Checkpoint
    converted: Checkpoint
    config: dict  # the converted config.json (source config + `mla`)
    device: torch.device
    dtype: torch.dtype

    @property
    def mla(self) -> dict:
        return self.config["mla"]

    def prefix(self, layer: int) -> str:
        return self.mla["layer_prefix"].format(i=layer)


def _load(module: torch.nn.Module, checkpoint: Checkpoint, prefix: str, run: LayerRun) -> torch.nn.Module:
    """Load the tensors under `prefix` into `module` (strictly) on the run's device/dtype."""
    state = {k[len(prefix) :]: checkpoint.get(k) for k in checkpoint.keys() if k.startswith(prefix)}
    module.load_state_dict(state, strict=True)
    return module.to(device=run.device, dtype=run.dtype).eval()


def _hf_classes(arch_name: str) -> tuple[type, type, type]:
    """transformers' (Attention, DecoderLayer, RotaryEmbedding) classes of the family."""
    module_name, attention = ARCHS[arch_name].hf_attention.split(":")
    module = importlib.import_module(module_name)
    family = attention.removesuffix("Attention")
    return getattr(module, attention), getattr(module, f"{family}DecoderLayer"), getattr(module, f"{family}RotaryEmbedding")


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(relative Frobenius error, max abs error), computed in float64."""
    diff = (got.double() - ref.double())
    norm = ref.double().norm()
    return float(diff.norm() / norm) if norm > 0 else float(diff.norm()), float(diff.abs().max())


def _mla_module(run: LayerRun, layer: int, rotary=None) -> MLAAttention:
    mla = run.mla
    module = MLAAttention(mla["hidden_size"], mla, mla["layers"][layer], layer, rotary=rotary, causal=mla["causal"])
    return _load(module, run.converted, run.prefix(layer), run)


def _mask(config, layer: int, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """transformers' own additive mask for this layer (causal, sliding window where the layer has one)."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    layer_types = getattr(config, "layer_types", None)
    sliding = layer_types[layer] == "sliding_attention" if layer_types else getattr(config, "sliding_window", None)
    make = create_sliding_window_causal_mask if sliding else create_causal_mask
    return make(config=config, inputs_embeds=x, attention_mask=None, past_key_values=None, position_ids=positions)


def check_hf_layers(run: LayerRun, token_ids: torch.Tensor | None, n_tokens: int, progress) -> list[dict]:
    """Per-layer errors of a transformers architecture (Llama, Mistral, Qwen2)."""
    mask_config = hf_config(run.config)  # eager: masks come out additive
    ref_config = hf_config(run.config)
    ref_config._attn_implementation = "sdpa"  # eager softmax is float32 even for float64 inputs
    attention_cls, decoder_cls, rotary_cls = _hf_classes(run.mla["source_architecture"])
    rotary = rotary_cls(ref_config).to(run.device)
    length = n_tokens if token_ids is None else token_ids.shape[-1]
    positions = torch.arange(length, device=run.device)[None]  # (1, L)
    generator = torch.Generator().manual_seed(0)
    hidden = None
    if token_ids is not None:
        embed = run.original.get(ARCHS[run.mla["source_architecture"]].embed)
        hidden = embed[token_ids].to(device=run.device, dtype=run.dtype)  # (1, L, D)
    results = []
    for layer in progress(range(run.mla["n_layers"])):
        with torch.no_grad():
            if hidden is None:
                decoder = None
                x = torch.randn(1, length, run.mla["hidden_size"], generator=generator).to(run.device, run.dtype)
                reference = _load(attention_cls(ref_config, layer), run.original, run.prefix(layer), run)
            else:
                decoder = _load(decoder_cls(ref_config, layer), run.original, f"model.layers.{layer}.", run)
                x, reference = decoder.input_layernorm(hidden), decoder.self_attn
            pe = rotary(x, positions)
            mask = _mask(mask_config, layer, x, positions)
            ref = reference(x, position_embeddings=pe, attention_mask=mask)[0]
            got = _mla_module(run, layer, rotary)(x, pe, mask, position_ids=positions)[0]
            if decoder is not None:
                hidden = decoder(hidden, attention_mask=mask, position_embeddings=pe, position_ids=positions)
        results.append(_layer_result(run, layer, got, ref))
    return results


def check_seed_layers(run: LayerRun, n_tokens: int, progress) -> list[dict]:
    """Per-layer errors of a seed-notation checkpoint against the seed's MyGQA (x attends to x)."""
    mla = run.mla
    generator = torch.Generator().manual_seed(0)
    results = []
    for layer in progress(range(mla["n_layers"])):
        d, hidden = mla["head_dim"], mla["hidden_size"]
        reference = _load(MyGQA(hidden, hidden, d, d, mla["n_heads"], mla["n_kv_heads"]), run.original, run.prefix(layer), run)
        x = torch.randn(1, n_tokens, hidden, generator=generator).to(run.device, run.dtype)
        with torch.no_grad():
            ref = reference(x, x)
            got = _mla_module(run, layer)(x)[0]
        results.append(_layer_result(run, layer, got, ref))
    return results


def _layer_result(run: LayerRun, layer: int, got: torch.Tensor, ref: torch.Tensor) -> dict:
    rel, max_abs = relative_error(got, ref)
    entry = run.mla["layers"][layer]
    ranks = {k: v for k, v in entry.items() if k.startswith("rank")}
    return {
        "layer": layer,
        "rel_error": rel,
        "max_abs_error": max_abs,
        "ranks": ranks,
        "retained_energy": entry.get("retained_energy"),
        "factor_error": entry.get("factor_error"),
    }
