"""Run the original model one decoder layer at a time, from its checkpoint.

Verification and calibration need the hidden states that really reach each layer. Each layer is built, loaded lazily
from the safetensors files, run and dropped, so the model's size is not capped by the machine's memory.
"""

import functools
from typing import cast

import torch

from convert.arch import ARCHS
from convert.hf import causal_mask, hf_classes, hf_config, layer_rotary, reference_attention
from convert.layouts import module_layout


def load_module(module: torch.nn.Module, checkpoint, prefix: str, device, dtype) -> torch.nn.Module:
    """Load the tensors under `prefix` into `module` (strictly) on `device`/`dtype`."""
    module.load_state_dict(checkpoint_tensors(checkpoint, prefix), strict=True)
    return module.to(device=device, dtype=dtype).eval()


def materialize(build, checkpoint, prefix: str, device, dtype) -> torch.nn.Module:
    """`build()`'s module with the checkpoint's tensors under `prefix`, loaded strictly.

    The module is built on the meta device and its storage allocated once, directly in
    `dtype` on `device` (casting before loading keeps float64 tensors exact); the tensors
    are read and copied in one at a time, so the peak is the module plus its largest tensor.
    """
    with torch.device("meta"):
        module = build()
    names = {k[len(prefix) :] for k in checkpoint.keys() if k.startswith(prefix)}
    expected = set(module.state_dict())
    if names != expected:
        raise RuntimeError(
            f"{prefix}: tensors do not fit the module (missing {sorted(expected - names)[:3]}, "
            f"unexpected {sorted(names - expected)[:3]})"
        )
    buffers = {n for n, _ in module.named_buffers()}
    if buffers - expected:  # buffers the checkpoint does not hold: build them for real
        module = build().to(device=device, dtype=dtype)
    else:
        module = module.to(dtype).to_empty(device=device)
    with torch.no_grad():  # plain reads (`TensorSource.read`), not a file's mapping
        for name, target in module.state_dict(keep_vars=True).items():
            target.copy_(checkpoint.read(prefix + name))
    return module.eval()


def layer_output(out) -> torch.Tensor:
    """The hidden states a decoder layer (or an attention) returns: its output, or a tuple's first."""
    return out[0] if isinstance(out, tuple) else out


def checkpoint_tensors(checkpoint, prefix: str) -> dict[str, torch.Tensor]:
    """The tensors under `prefix`, named relative to it (plain reads: `TensorSource.read`)."""
    return {k[len(prefix) :]: checkpoint.read(k) for k in checkpoint.keys() if k.startswith(prefix)}


def embedding_rows(checkpoint, name: str, token_ids: torch.Tensor) -> torch.Tensor:
    """Rows `token_ids` (B, L) of the embedding table `name` -> (B, L, D), read row by row:
    the whole table (vocab × hidden) is never in memory."""
    rows = [torch.cat([checkpoint.read_rows(name, t, t + 1) for t in seq]) for seq in token_ids.tolist()]
    return torch.stack(rows)  # (B, L, D)


class LayerStream:
    """The original transformers model of `config`, run layer by layer from `checkpoint`.

    config: a config.json dict (a converted one's `mla` section is ignored).
    Reference modules use SDPA, whose softmax keeps float64 in float64 (eager
    attention does it in float32); masks are made additive (eager) so the MLA
    modules can take them too.
    """

    def __init__(self, checkpoint, config: dict, device, dtype):
        self.checkpoint, self.device, self.dtype = module_layout(checkpoint, config), device, dtype
        self.arch = ARCHS[config.get("mla", {}).get("source_architecture") or config["model_type"]]
        self.mask_config = hf_config(config)
        self.ref_config = hf_config(config, attention=reference_attention(config))
        self.attention_cls, self.decoder_cls, rotary_cls = hf_classes(self.arch.name)
        self.rotary = rotary_cls(self.ref_config).to(device)

    def attention(self, layer: int, checkpoint=None) -> torch.nn.Module:
        """transformers' own attention module of `layer`, with the original weights (or `checkpoint`'s)."""
        prefix = self.arch.layer_prefixes[0].format(i=layer)
        source = self.checkpoint if checkpoint is None else checkpoint
        return load_module(self.attention_cls(self.ref_config, layer), source, prefix, self.device, self.dtype)

    def inputs(self, layer: int, x: torch.Tensor):
        """(position ids, rotary (cos, sin), additive mask) for hidden states x (B, L, D)."""
        positions = torch.arange(x.shape[1], device=self.device)[None]  # (1, L)
        rotary = self.layer_rotary(layer)(x, positions)
        return positions, rotary, causal_mask(self.mask_config, layer, x, positions)

    def layer_rotary(self, layer: int):
        """The rotary embedding of `layer` (Gemma 3: its layer type's), (x, positions) -> (cos, sin)."""
        return layer_rotary(self.rotary, self.ref_config, layer)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """(B, L) ids -> (B, L, D) hidden states entering layer 0 (Gemma: embeddings × √D, as its model does)."""
        assert self.arch.embed is not None  # transformers' families (`hf_classes`) all name it
        hidden = embedding_rows(self.checkpoint, self.arch.embed, token_ids).to(self.device, self.dtype)
        if self.arch.gemma_scores:
            hidden = hidden * torch.tensor(self.ref_config.hidden_size**0.5, dtype=self.dtype)
        return hidden

    def decoder(self, layer: int) -> torch.nn.Module:
        """transformers' own decoder layer `layer`, with the original weights."""
        build = functools.partial(self.decoder_cls, self.ref_config, layer)
        return materialize(build, self.checkpoint, f"model.layers.{layer}.", self.device, self.dtype)

    def final_norm(self, checkpoint=None) -> torch.nn.Module:
        """The model's final norm (the family's own class, as its decoder layers use), from
        `checkpoint` (default the original's)."""
        with torch.device("meta"):
            cls = type(self.decoder_cls(self.mask_config, 0).post_attention_layernorm)
        build = lambda: cls(self.ref_config.hidden_size, eps=getattr(self.ref_config, "rms_norm_eps", 1e-6))
        source = self.checkpoint if checkpoint is None else checkpoint
        return materialize(build, source, "model.norm.", self.device, self.dtype)

    def head_name(self, checkpoint=None) -> str:
        """The lm_head's tensor: its own, or the embedding table it is tied to."""
        source = self.checkpoint if checkpoint is None else checkpoint
        if "lm_head.weight" in source:
            return "lm_head.weight"
        assert self.arch.embed is not None  # transformers' families (`hf_classes`) all name it
        return self.arch.embed

    @property
    def final_softcap(self) -> float | None:
        """The causal LM's final logit soft-cap (Gemma 2), else None."""
        return getattr(self.ref_config, "final_logit_softcapping", None) if self.arch.gemma_scores else None

    def run(self, token_ids: torch.Tensor, n_layers: int, progress=iter):
        """Yield (layer, x, decoder, (positions, rotary, mask)) for each layer, x (B, L, D)
        the normed hidden states entering its attention; advances when resumed."""
        hidden = self.embed(token_ids)  # (B, L, D)
        for layer in progress(range(n_layers)):
            decoder = self.decoder(layer)
            with torch.no_grad():
                if self.arch.pre_norm:  # cast: torch types a Module's attributes Tensor | Module
                    x = cast(torch.nn.Module, decoder.input_layernorm)(hidden)
                else:  # OLMo 2: post-norm
                    x = hidden
                inputs = self.inputs(layer, x)
                yield layer, x, decoder, inputs
                positions, rotary, mask = inputs
                hidden = decoder(hidden, attention_mask=mask, position_embeddings=rotary, position_ids=positions)
