"""The bridge to transformers: the one module that talks to its config, model and tokenizer classes.

Everything else in the package works on plain config dicts and state dicts.
"""

import contextlib
import copy
import functools
import importlib
import inspect
import re

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
)
from transformers.initialization import no_init_weights
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.utils import is_accelerate_available, logging

from convert.arch import ARCHS, tied_embeddings
from convert.errors import ConvertError
from convert.io import Checkpoint
from convert.layouts import module_layout

# config.json keys that describe the file, not the model.
_NOT_MODEL_FIELDS = ("mla", "architectures", "transformers_version")


def source_fields(config: dict) -> dict:
    """The source model's config fields, from a source or converted config.json dict.

    A converted config (format 2) has `model_type: convert_mla` and the source's in
    `mla.source_model_type`; format 1 kept the source's `model_type` itself.
    """
    fields = {k: v for k, v in config.items() if k not in _NOT_MODEL_FIELDS}
    source_type = (config.get("mla") or {}).get("source_model_type")
    if source_type is not None:
        fields["model_type"] = source_type
    return fields


def hf_config(config: dict, dtype: torch.dtype | None = None, attention: str = "eager"):
    """The SOURCE model's transformers config from a config.json dict (source or converted).

    attention: transformers' attention implementation. "eager" takes the additive
    4-D mask MLAAttention takes too; "sdpa" keeps float64 in the softmax (eager
    does it in float32), which a float64 reference needs.
    """
    fields = copy.deepcopy(source_fields(config))  # transformers edits nested dicts (rope_scaling) in place
    hf = AutoConfig.for_model(fields.pop("model_type"), **fields)
    hf._attn_implementation = attention
    # Mixture-of-experts MLPs (Mixtral) as a plain loop over experts: transformers' grouped
    # matmul refuses float64, which verification runs in.
    hf._experts_implementation = "eager"
    if dtype is not None:
        hf.dtype = dtype
    return hf


def hf_classes(arch_name: str) -> tuple[type, type, type]:
    """transformers' (Attention, DecoderLayer, RotaryEmbedding) classes of the family."""
    reference = ARCHS[arch_name].hf_attention
    assert reference is not None  # asked of transformers' families only (the seed has none)
    module_name, attention = reference.split(":")
    module = importlib.import_module(module_name)
    family = attention.removesuffix("Attention")
    return (
        getattr(module, attention),
        getattr(module, f"{family}DecoderLayer"),
        getattr(module, f"{family}RotaryEmbedding"),
    )


def layer_rotary(rotary, config, layer: int):
    """The model's rotary embedding as layer `layer` uses it: a callable (x, positions) -> (cos, sin).

    Gemma 3 has one RoPE per layer type (a local base for sliding-window layers, a global one
    for the others): its rotary embedding takes the layer type, bound here; every other family's
    is returned as is.
    """
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None or "layer_type" not in inspect.signature(rotary.forward).parameters:
        return rotary
    return functools.partial(rotary, layer_type=layer_types[layer])


def causal_mask(config, layer: int, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """transformers' own mask for this layer (causal, sliding window where the layer has one)."""
    layer_types = getattr(config, "layer_types", None)
    sliding = layer_types[layer] == "sliding_attention" if layer_types else getattr(config, "sliding_window", None)
    make = create_sliding_window_causal_mask if sliding else create_causal_mask
    # no cache: transformers 5.24 renamed the argument (`past_key_values` -> `cache`)
    no_cache = {"cache" if "cache" in inspect.signature(make).parameters else "past_key_values": None}
    return make(config=config, inputs_embeds=x, attention_mask=None, position_ids=positions, **no_cache)


@contextlib.contextmanager
def empty_weights():
    """Modules built inside get their parameters on the meta device (no storage, so nothing to
    initialise) and torch's and transformers' weight initialisation is off; buffers are built for
    real, as each module computes them (RoPE frequencies, Gemma 3's embedding scale: not loaded)."""
    register = torch.nn.Module.register_parameter

    def register_on_meta(module, name, param):
        if param is not None and param.device.type != "meta":
            param = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    torch.nn.Module.register_parameter = register_on_meta
    try:
        with no_init_weights():
            yield
    finally:
        torch.nn.Module.register_parameter = register


def allocate(model: torch.nn.Module, device) -> torch.nn.Module:
    """`model` (built under `empty_weights`) with uninitialised storage for its meta parameters,
    allocated once directly on `device` (a tied lm_head still shares the embedding's), and its
    buffers moved there: ready to be filled with a checkpoint's tensors."""
    if torch.device(device).type != "meta":
        made = {}  # id -> (meta parameter, its storage): shared parameters stay shared
        for module in model.modules():
            for name, param in module._parameters.items():
                if param is not None and param.device.type == "meta":
                    if id(param) not in made:
                        storage = torch.empty_like(param, device=device)
                        made[id(param)] = param, torch.nn.Parameter(storage, requires_grad=param.requires_grad)
                    module._parameters[name] = made[id(param)][1]
    return model.to(device)  # the buffers


def family_causal_lm(config: dict, dtype: torch.dtype, attention: str = "eager"):
    """transformers' own causal LM class of the config, built on the ambient device."""
    return AutoModelForCausalLM.from_config(hf_config(config, dtype, attention), dtype=dtype)


def build_causal_lm(config: dict, dtype: torch.dtype, attention: str = "eager", device="cpu"):
    """The config's causal LM (transformers' own class), its weights allocated on `device` but not
    initialised (`empty_weights`, `allocate`): to be loaded, strictly, before use."""
    with empty_weights():
        model = family_causal_lm(config, dtype, attention)
    model.tie_weights()  # before allocating: a tied lm_head gets no storage of its own
    return allocate(model, device)


def reference_attention(config: dict) -> str:
    """transformers' attention implementation for a reference run: SDPA (its softmax keeps float64),
    or eager where SDPA would skip part of the family's attention (Gemma 2's soft-capping)."""
    return "eager" if config.get("attn_logit_softcapping") is not None else "sdpa"


def load_original(original: Checkpoint, config: dict, device, dtype, mapped: bool = True):
    """The source model as transformers builds it, with the original weights (`reference_attention`).
    mapped=False reads every tensor into the model's own memory (`fill_strict`): its pages leave the
    process with the model, where mapped ones stay resident while `original` is open."""
    model = build_causal_lm(config, dtype, attention=reference_attention(config), device=device)
    original = module_layout(original, config)  # Mixtral: the stored experts stacked as the modules hold them
    fill_strict(model, original, getattr(original, "path", "the original weights"), mapped)
    return model.eval()


def _check_names(model, missing, unexpected, where) -> set[str]:
    """Refuse weights that do not fit `model` (a tied lm_head may be missing); returns the tied names."""
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    if unexpected or set(missing) - tied:
        raise ConvertError(
            f"{where}: weights do not fit the model (missing {sorted(set(missing) - tied)[:3]}, "
            f"unexpected {sorted(unexpected)[:3]}); was it written by this version of convert?"
        )
    return tied


def load_strict(model, state: dict, where) -> None:
    """Load `state` into `model`: every tensor used, none missing but a tied lm_head."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    if _check_names(model, missing, unexpected, where):
        model.tie_weights()


def fill_strict(model, checkpoint, where, mapped: bool = True) -> None:
    """`load_strict` from a checkpoint, a tensor at a time, never a second copy of the model (a state
    dict) in memory. On the CPU a tensor stored in the model's dtype is not copied at all: the model
    takes the file's own tensor (`Checkpoint.get`: a view of its copy-on-write mapping, as transformers'
    `from_pretrained` loads), read at first use; any other is read straight into the model's tensor
    (`read_into`: to another dtype or device, a chunk at a time; from a state dict, a copy). mapped=False
    reads every tensor so."""
    targets = model.state_dict(keep_vars=True)
    names = set(checkpoint.keys())
    tied = _check_names(model, set(targets) - names, names - set(targets), where)
    with torch.no_grad():
        for name in sorted(names):
            target = targets[name]
            if mapped and _mappable(checkpoint, name, target):
                target.data = checkpoint.get(name)  # the parameter keeps its identity (and ties)
            else:
                checkpoint.read_into(name, target)
    if tied:
        model.tie_weights()


def _mappable(checkpoint, name: str, target: torch.Tensor) -> bool:
    """Whether `target` can be the checkpoint's own tensor: a file's (a view may assemble its own),
    on the CPU, in the stored dtype and shape."""
    if not isinstance(checkpoint, Checkpoint) or target.device.type != "cpu":
        return False
    return target.dtype == checkpoint.dtype(name) and tuple(target.shape) == tuple(checkpoint.shape(name))


def load_pretrained(path, device, dtype, attention: str = "eager"):
    """A checkpoint directory as stock transformers loads it (an export target's, say).

    transformers builds the model on the meta device and reads each tensor once, in `dtype`;
    straight onto a GPU only with `accelerate` installed (its `device_map`), else through the CPU.
    """
    on_device = is_accelerate_available() and torch.device(device).type != "cpu"
    placement = {"device_map": {"": torch.device(device)}} if on_device else {}
    shown = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()  # our own progress bars and summary only
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attention, **placement)
    finally:
        if shown:
            logging.enable_progress_bar()
    return model.to(device).eval()


def meta_state_dict(config: dict) -> dict[str, torch.Tensor]:
    """Every tensor of the config's model as a meta tensor (shape and dtype, no data).

    Builds one decoder layer on the meta device and repeats its names for every
    layer (all layers of the supported families have the same tensors), so a
    70B config takes milliseconds.
    """
    one_layer = {**config, "num_hidden_layers": 1}
    one_layer.pop("layer_types", None)
    dtype = _config_dtype(config)
    with torch.device("meta"):
        model = build_causal_lm(one_layer, dtype, device="meta")
    state = {}
    for name, tensor in model.state_dict().items():
        if ".layers.0." not in name:
            state[name] = tensor
            continue
        for layer in range(config["num_hidden_layers"]):
            state[re.sub(r"\.layers\.0\.", f".layers.{layer}.", name, count=1)] = tensor
    if tied_embeddings(config):
        state.pop("lm_head.weight", None)
    return state


def _config_dtype(config: dict) -> torch.dtype:
    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    return getattr(torch, name) if isinstance(getattr(torch, str(name), None), torch.dtype) else torch.float32


def load_tokenizer(model_root):
    """The tokenizer saved in a model directory."""
    return AutoTokenizer.from_pretrained(model_root)
