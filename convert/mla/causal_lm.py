"""The converted model's transformers classes: `MLAConfig` and `MLAForCausalLM` (the source family's
causal LM with MLA attention), registered as model type `convert_mla` with transformers' Auto classes
on `import convert` (`register`; docs/design.md, "Output format")."""

import inspect
from typing import cast

import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.initialization import no_init_weights
from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY

from convert.arch import tied_embeddings
from convert.hf import empty_weights, family_causal_lm, layer_rotary, reference_attention
from convert.mla.attention import MLAAttention, build_mla_attention
from convert.mla.config import MLASection
from convert.mla.format import MLA_MODEL_TYPE


def swap_attention(model, mla: MLASection) -> None:
    """Replace every decoder layer's attention with an MLAAttention (weights uninitialised)."""
    inner = model.model
    for i, layer in enumerate(inner.layers):
        old = layer.self_attn
        window = getattr(old, "sliding_window", None)
        dtype = next(old.parameters()).dtype
        rotary = layer_rotary(inner.rotary_emb, model.config, i)
        layer.self_attn = build_mla_attention(mla, i, rotary=rotary, sliding_window=window, dtype=dtype)


def _record_mla_attentions(inner) -> None:
    """Let `output_attentions` record the MLA modules' weights: transformers records the outputs of
    the classes a decoder stack's class lists (`_can_record_outputs`, `LlamaModel`: `LlamaAttention`);
    MLAAttention is added beside the family's own, which an original model's stack still finds."""
    records = dict(_CAN_RECORD_REGISTRY.get(inner))
    family = records.get("attentions")
    if family is None or MLAAttention in (family if isinstance(family, list) else [family]):
        return
    records["attentions"] = [*(family if isinstance(family, list) else [family]), MLAAttention]
    _CAN_RECORD_REGISTRY[inner] = records


class MLAConfig(PretrainedConfig):
    """A converted checkpoint's config: the source model's fields plus the `mla` section."""

    model_type = MLA_MODEL_TYPE

    def __init__(self, mla: dict | None = None, **kwargs):
        self.mla = mla
        # The source's RoPE scaling is the source config's to read (MLAForCausalLM builds one from
        # these fields): held out of PretrainedConfig's legacy-RoPE conversion, which fails here
        # for llama3/yarn scaling (it reads max_position_embeddings before setting it).
        rope_scaling = kwargs.pop("rope_scaling", None)
        # a published config may leave the key out (Gemma's): the source family's default, as its class has
        kwargs.setdefault("tie_word_embeddings", tied_embeddings({**kwargs, "mla": mla or {}}))
        super().__init__(**kwargs)
        if rope_scaling is not None and getattr(self, "rope_parameters", None) is None:
            self.rope_parameters = rope_scaling  # as the deprecated `rope_scaling` setter does, without its warning
            self.standardize_rope_params()


class MLAForCausalLM(PreTrainedModel, GenerationMixin):
    """The source family's causal LM with every attention replaced by MLAAttention.

    Submodules and tensor names are the source model's (`model.*`, `lm_head`), so the
    converted checkpoint loads as is; forward is the family's own (logits, `labels=`
    loss, a KV cache of latents), so it plugs into ordinary training and generation.
    """

    config_class = MLAConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True  # the family's decoder layers recompute themselves
    # What tools read off the class: attention through torch's SDPA (and eager, for soft-capping and
    # output_attentions), no flash-attn / flex kernels; static-cache decoding compiles in one graph.
    _supports_sdpa = True
    _supports_flash_attn = False
    _supports_flex_attn = False
    _supports_attention_backend = False
    _can_compile_fullgraph = True
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: MLAConfig):
        super().__init__(config)
        with no_init_weights():  # initialised once, by post_init below, unless it is being loaded
            # the family's masks as for SDPA: none where causal attention needs none (SDPA's own causal
            # kernels), boolean where padding or a window needs one; never a (B, 1, L, S) float mask
            fields = config.to_dict()
            # transformers annotates `dtype` str | torch.dtype | None; PretrainedConfig turns a str into a torch.dtype
            dtype = cast(torch.dtype, config.dtype or torch.float32)
            source = family_causal_lm(fields, dtype, reference_attention(fields))
            swap_attention(source, MLASection.parse(config.mla, "config.json"))  # checked as it is loaded
        self.model, self.lm_head = source.model, source.lm_head
        self._family = type(source)
        self._no_split_modules = source._no_split_modules  # the decoder layers: what FSDP wraps one by one
        self._cache_arg = _cache_argument(self._family)  # `cache` from transformers 5.24 on, `past_key_values` before
        self.post_init()

    @classmethod
    def from_converted_config(cls, config: dict, dtype: torch.dtype):
        """The model of a converted config.json dict (format 1 or 2) in `dtype`, built under
        `empty_weights`: no storage, nothing initialised (`allocate` it, then load it)."""
        mla = {"source_model_type": config["model_type"], **config["mla"]}  # format 1: the source's own type
        fields = {k: v for k, v in config.items() if k not in ("model_type", "mla")}
        hf = MLAConfig(mla=mla, **fields)
        hf.dtype = dtype
        with empty_weights():
            model = cls(hf)
        model.tie_weights()
        return model

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        cache=None,
        inputs_embeds=None,
        labels=None,
        use_cache=None,
        logits_to_keep=0,
        **kwargs,
    ):
        """The family's own causal-LM forward (`LlamaForCausalLM.forward`, …) on this model: logits,
        the loss when `labels` are given, a KV cache of latents; family-specific arguments (Mixtral's
        `output_router_logits`), `output_attentions` and `output_hidden_states` pass as keywords.

        A plain method with the family's parameters, so that what inspects `type(model).forward`
        (`Trainer`'s label names, `generate`'s padding mask and `logits_to_keep`) finds them."""
        cache_arg = self._cache_arg
        if not torch.compiler.is_compiling():
            # transformers registers a family's recorded classes anew with each model of the family it
            # builds (the original, loaded after this one): MLAAttention back beside them, before the
            # family's forward installs its output_attentions hooks
            _record_mla_attentions(self.model)
        return self._family.forward(
            self,
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            labels=labels,
            use_cache=use_cache,
            logits_to_keep=logits_to_keep,
            **{cache_arg: cache if cache is not None else kwargs.pop(cache_arg, None)},
            **kwargs,
        )


def _cache_argument(family: type[PreTrainedModel]) -> str:
    """The name under which a family's forward takes its KV cache."""
    return "cache" if "cache" in inspect.signature(family.forward).parameters else "past_key_values"


def register() -> None:
    """Register `convert_mla` with transformers' AutoConfig / AutoModelForCausalLM (idempotent)."""
    AutoConfig.register(MLA_MODEL_TYPE, MLAConfig, exist_ok=True)
    AutoModelForCausalLM.register(MLAConfig, MLAForCausalLM, exist_ok=True)
