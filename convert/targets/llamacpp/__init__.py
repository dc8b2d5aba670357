"""Target `llamacpp`: one GGUF file (`model.gguf`, architecture `deepseek2`) that llama.cpp runs with MLA,
built from the vllm target's DeepSeek-V3 construction (one shared rotary key, head_dim wide at the full
latent: `rotary_width`) with the latent at its used width, behind the target interface (`convert.targets.Target`). docs/design.md, "Deployment
targets"; docs/serving.md says what is exact."""

import json
import tempfile
from pathlib import Path

import gguf
import torch

from convert.arch import AttentionSpec
from convert.errors import ConvertError, EnvironmentFailure
from convert.hf import build_causal_lm, load_strict
from convert.io.reader import dtype_itemsize
from convert.layouts import attention_view
from convert.options import dtype_name
from convert.rope import config as rope_config
from convert.source import LazyTensors, StateDictSource
from convert.targets import Build
from convert.targets.deepseek import check_deepseek, export_sizes, export_spec
from convert.targets.llamacpp.engine import QUANTIZED, engine_python, quantize
from convert.targets.llamacpp.gguf_file import read_gguf, write_gguf
from convert.targets.llamacpp.vocab import source_vocab
from convert.targets.vllm import export_choices
from convert.targets.vllm import report as vllm_report
from convert.targets.vllm.export import stream_export
from convert.targets.vllm.geometry import LATENT_DIMS, ROPE_DIM

NAME = "llamacpp"
FILE = "model.gguf"
#: --gguf-type's plain types as `write_gguf`'s names (the quantized ones, `QUANTIZED`, stay as named)
TENSOR_TYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "Q8_0": "Q8_0", "Q4_K_M": "Q4_K_M"}
CACHE_DTYPES = (torch.float16, torch.bfloat16)
#: Per-tensor types given to llama.cpp's quantizer (its `--tensor-type`) over its mix. Q4_K_M's mix gives
#: the original's `attn_v` Q6_K in about half the layers and has no rule for deepseek2's latent tensors,
#: which get its 4-5 bits; at Q8_0 they cost SmolLM2's 50% file 3 MB (3%) and take Q4_K_M's extra loss
#: away (the worst kind's ratio +0.124 over the F16 file's, -0.011 so: bench/llamacpp_quant.py).
QUANT_OVERRIDES = {"Q4_K_M": [(r"attn_kv_a_mqa|attn_k_b|attn_v_b", "Q8_0")]}
FOREIGN = "llama.cpp (and llama-cpp-python, Ollama, LM Studio) runs model.gguf as deepseek2 MLA"
__all__ = ["FILE", "FOREIGN", "NAME", "QUANTIZED", "build", "check", "load", "model", "quantize", "report"]


def check(spec: AttentionSpec, opts) -> None:
    """What deepseek2's dense layers cannot hold: q/k norms, fused projections (`check_deepseek`)."""
    check_deepseek(spec, NAME)


def _check_family(config: dict) -> None:
    """What llama.cpp's deepseek2 computes besides the attention: a SwiGLU MLP, default RoPE."""
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise ConvertError(
            f"--target llamacpp: hidden_act={act!r}, and llama.cpp's deepseek2 MLP is SwiGLU (silu) only; "
            "use --target mla"
        )
    kind = rope_config.rope_type(config)
    if kind != "default":
        raise ConvertError(
            f"--target llamacpp: rope_type={kind!r} is not written for llama.cpp yet (default RoPE only); "
            "use --target vllm or mla"
        )


def build(source, opts) -> Build:
    """The export made as the vllm target makes it (float32), written as one GGUF into the output
    directory (`Build.extra`) beside config.json (its `convert_export`) and the tokenizer files;
    quantized (--gguf-type Q8_0, Q4_K_M) by llama.cpp's own quantizer from an F16 file written first."""
    config = source.config or {}
    _check_family(config)
    state = LazyTensors(source)
    export_config, view, spec = export_spec(state, config, NAME, opts)
    stored = view.dtype(spec.tensor(0, "q"))
    tensor_type = TENSOR_TYPES.get(opts.gguf_type) or dtype_name(stored if stored in CACHE_DTYPES else torch.float32)
    _check_tensor_type(opts, tensor_type, stored)
    _, ds_config, tensors = stream_export(
        state, export_config, view, spec, _choices(source, view, spec, export_config, opts)
    )
    vocab = source_vocab(getattr(source, "root", None) or Path("."))
    written: dict = {}
    counted: dict = {}  # the file's attention parameters, once written

    def extra(directory: Path) -> None:
        out = dict(tensors)  # one model in memory (float32)
        path, latent = Path(directory) / FILE, latent_width(ds_config, opts)
        if opts.gguf_type not in QUANTIZED:
            chosen = write_gguf(path, out, ds_config, latent, tensor_type, vocab)
        else:  # llama.cpp quantizes an F16 file (its scales chosen for F16's range), written here first
            plain = Path(directory) / f"{FILE}.f16"
            chosen = write_gguf(plain, out, ds_config, latent, "float16", vocab, half=True)
            out.clear()
            quantize(plain, path, opts.gguf_type, QUANT_OVERRIDES.get(opts.gguf_type, ()))
            plain.unlink()  # ours: written just above
        written.update(_config(chosen, ds_config, tensor_type, vocab, narrowed(tensor_type, stored)))
        counted["attention"] = attention_params(path)

    return Build(
        layout={},
        copied=[],
        tensors=iter(()),
        config=lambda: written,
        notes=lambda: [short_note(written["convert_export"]), FOREIGN] + ([vocab.note] if vocab.note else []),
        sizes=lambda: _sizes(source, spec, opts, written, stored, counted.get("attention")),
        metadata={"format": "pt"},
        options=opts,
        extra=extra,
    )


def narrowed(tensor_type: str, stored: torch.dtype) -> bool:
    """Whether the file's tensors are coarser than the checkpoint's (quantized, or a float type other
    than the checkpoint's own and float32): every matrix of the model rounded, not only the attention's."""
    return tensor_type not in ("float32", dtype_name(stored))


def _check_tensor_type(opts, tensor_type: str, stored: torch.dtype) -> None:
    """A quantized file needs llama.cpp's quantizer (exit 3 without it); a narrowed one is lossy, so
    verification needs a perplexity bound."""
    if tensor_type in QUANTIZED and engine_python() is None:
        raise EnvironmentFailure(
            f"--gguf-type {opts.gguf_type} runs llama.cpp's own quantizer, which is not built here: run "
            "bash scripts/llamacpp_env.sh (about 40 min), or write F16 and quantize with llama-quantize"
        )
    if narrowed(tensor_type, stored) and opts.verify and opts.max_ppl_ratio is None:
        raise ConvertError(
            f"--gguf-type {opts.gguf_type} rounds every matrix of this {dtype_name(stored)} checkpoint (lossy): "
            "verification judges it by the perplexity ratio on each kind of text, so pass --max-ppl-ratio R "
            "(e.g. 1.1), or --no-verify"
        )


def _choices(source, view, spec: AttentionSpec, export_config: dict, opts):
    """The vllm construction's choices for this file (`export_choices`): float32, the latent `latent_rank`
    wide beside a `rotary_width` key."""
    rank, rope_dim = latent_rank(spec, opts), rotary_width(spec, opts)
    return export_choices(source, view, spec, export_config, opts, NAME, torch.float32, rank, rope_dim)


def rotary_width(spec: AttentionSpec, opts) -> int:
    """deepseek2's rotary key width (`n_rot`, read from the file): head_dim at the full latent, so that
    every source pair turns at its own frequency (vLLM's fixed 64 dims turn a head_dim-128 source's
    pairs two to a slot, one of them at its neighbour's frequency); vLLM's 64 under --kv-cache-ratio,
    whose budget the rotary key shares with the latent."""
    return spec.head_dim if opts.kv_cache_ratio is None else ROPE_DIM


def latent_rank(spec: AttentionSpec, opts) -> int:
    """The latent dims --kv-cache-ratio leaves beside deepseek2's 64-dim rotary key: llama.cpp caches
    `kv_lora_rank + 64` values per token and layer, that share of the GQA cache's 2·G·d (all of
    vLLM's usable latent, `LATENT_DIMS`, without the flag: the latent then at the width it needs,
    beside a head_dim-wide rotary key: `rotary_width`), rounded up to a multiple of --latent-multiple."""
    if opts.kv_cache_ratio is None:
        return LATENT_DIMS
    values, rope = round(opts.kv_cache_ratio * 2 * spec.n_kv_heads * spec.head_dim), rotary_width(spec, opts)
    if values - rope < 1:
        least = (rope + 1) / (2 * spec.n_kv_heads * spec.head_dim)
        raise ConvertError(
            f"--kv-cache-ratio {opts.kv_cache_ratio} keeps {values} values per token and layer, and llama.cpp's "
            f"deepseek2 caches a {rope}-dim rotary key besides the latent; give at least {least:.3f}"
        )
    return min(_round_up(values - rope, opts.latent_multiple), LATENT_DIMS)


def latent_width(ds_config: dict, opts) -> int:
    """The file's kv_lora_rank: the latent dims the export uses (the rest of vLLM's 512 are zero), or
    those rounded up to a multiple of --latent-multiple (a divisor of 512: `check_options`), the dims
    past them zeros (llama.cpp's CPU attention vectorises in blocks of 64 and 128: docs/serving.md)."""
    return _round_up(ds_config["convert_export"]["latent_dims_used"], opts.latent_multiple)


def _round_up(n: int, multiple: int | None) -> int:
    return n if multiple is None else -(-n // multiple) * multiple


def _config(chosen: dict, ds_config: dict, tensor_type: str, vocab, rounded: bool = False) -> dict:
    """config.json of the output: the DeepseekV3 config the GGUF holds (what `load` rebuilds) and
    `convert_export` (the vllm construction's record, then the file's)."""
    out = dict(ds_config)
    export = dict(out.pop("convert_export"))
    latent = chosen["kv_lora_rank"]
    out |= {"kv_lora_rank": latent, "rms_norm_eps": chosen["rms_norm_eps"], "attention_bias": False}
    out["tie_word_embeddings"] = chosen["tie_word_embeddings"]  # no output.weight in the file when tied
    out["dtype"] = "float16" if tensor_type in QUANTIZED else tensor_type  # llama.cpp's cache: F16 by default
    export |= {
        "target": NAME,
        "file": FILE,
        "tensor_type": tensor_type,
        "exact": export["exact"] and not rounded,
        "rounded": rounded,  # every matrix rounded to a coarser type than the checkpoint's (`narrowed`)
        "residual_scale_log2": chosen["residual_scale_log2"],
        "latent_scale_log2": chosen["latent_scale_log2"],
        "kv_cache_dims_per_token_per_layer": latent + out["qk_rope_head_dim"],
        "latent_padded_to": latent if latent > export["latent_dims_used"] else None,  # --latent-multiple's zeros
        "tokenizer_note": vocab.note,
    }
    out["convert_export"] = export
    return out


def _sizes(source, spec: AttentionSpec, opts, config: dict, dtype: torch.dtype, attention: int | None) -> dict:
    """Attention parameters and the KV cache per token (what llama.cpp caches: latent + rotary key),
    before and after, in the checkpoint's `dtype` (`export_sizes`); the parameters after as counted in
    the file (`attention_params`; None: not written, the conversion stopped before it)."""
    sizes = export_sizes(source, spec, opts, {}, config)
    if attention is None:
        return sizes
    return sizes | {"attention_params_after": attention, "attention_bytes_after": attention * dtype_itemsize(dtype)}


def attention_params(path: Path) -> int:
    """The parameters of the GGUF's attention tensors (`blk.N.attn_*` but the layer's input norm; the
    latent cut to its used dims)."""
    names = ((t.name, int(t.n_elements)) for t in gguf.GGUFReader(str(path)).tensors)
    return sum(n for name, n in names if ".attn_" in name and not name.endswith(".attn_norm.weight"))


def model(state: dict, config: dict, opts, dtype: torch.dtype, device):
    """`to_mla(target="llamacpp")`: the model llama.cpp computes from the file, in memory (transformers'
    DeepseekV3 on the GGUF's tensors, read back)."""
    if opts.gguf_type is not None:
        raise ConvertError(
            f"--gguf-type {opts.gguf_type}: the model in memory is llama.cpp's arithmetic in float32; write the file "
            "with gqa2mla to choose its tensor type"
        )
    source = attention_view(StateDictSource(state, config), config)
    _check_family(config)
    export_config, view, spec = export_spec(state, config, NAME, opts)
    _, ds_config, tensors = stream_export(
        state, export_config, view, spec, _choices(source, view, spec, export_config, opts)
    )
    out, vocab = dict(tensors), source_vocab(Path(tempfile.gettempdir()) / "no-tokenizer")
    with tempfile.TemporaryDirectory(prefix="convert-llamacpp-") as tmp:
        path = Path(tmp) / FILE
        chosen = write_gguf(path, out, ds_config, latent_width(ds_config, opts), "float32", vocab)
        return _deepseek(path, _config(chosen, ds_config, "float32", vocab), dtype, device)


def load(path, device, dtype):
    """The GGUF as llama.cpp computes it: transformers' DeepseekV3 on its tensors (dequantized), every
    norm's eps the file's (the latent norm's included, which transformers hard-codes to 1e-6)."""
    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    return _deepseek(path / config["convert_export"].get("file", FILE), config, dtype, device)


def _deepseek(gguf_path: Path, config: dict, dtype, device):
    tensors, keys = read_gguf(gguf_path)
    fields = {k: v for k, v in config.items() if k != "convert_export"}
    fields |= {
        "kv_lora_rank": keys["deepseek2.attention.kv_lora_rank"],
        "rms_norm_eps": keys["deepseek2.attention.layer_norm_rms_epsilon"],
        "attention_bias": False,
        "dtype": dtype_name(dtype or torch.float32),
        "tie_word_embeddings": "lm_head.weight" not in tensors,  # llama.cpp reads token_embd without output
    }
    deepseek = build_causal_lm(fields, dtype or torch.float32, device=device)
    load_strict(deepseek, {n: t.to(dtype or torch.float32) for n, t in tensors.items()}, f"{gguf_path}")
    for layer in deepseek.model.layers:  # transformers hard-codes this eps; llama.cpp reads the file's
        norm = layer.self_attn.kv_a_layernorm
        setattr(norm, "variance_epsilon" if hasattr(norm, "variance_epsilon") else "eps", fields["rms_norm_eps"])
    return deepseek.eval()


def report(export: dict, e2e: dict | None, ckpt_dtype: torch.dtype) -> dict:
    """The report's section: the vllm target's (the cache llama.cpp keeps against the GQA original's,
    bytes in the original checkpoint's dtype, as llama.cpp's default F16 cache of a half model), with
    the file and its tensor type."""
    section = vllm_report(export, e2e, ckpt_dtype)
    return section | {
        "name": NAME,
        "file": export["file"],
        "tensor_type": export["tensor_type"],
        "note": short_note(export),
    }


def short_note(export: dict) -> str:
    """What the file keeps and loses, in one line."""
    cache, gqa = export["kv_cache_dims_per_token_per_layer"], export["gqa_cache_dims_per_token_per_layer"]
    size = f"llama.cpp caches {cache} values per token and layer (GQA: {gqa})"
    if export.get("latent_compressed"):
        size += (
            f"; the latent COMPRESSED to {export['latent_dims_used']} of the {export['latent_content_dims']} dims the "
            "position-free keys and values need (--kv-cache-ratio)"
        )
    if export.get("latent_padded_to"):
        size += f"; the latent zero-padded from {export['latent_dims_used']} to {export['latent_padded_to']} dims"
    if export["exact"]:
        return f"for llama.cpp ({FILE}): exact; {size}"
    why = []
    shared = export["n_kv_heads"] > 1 or export.get("frequency_fold", 1) > 1
    if shared or export.get("source_rope_type", "default") != "default":
        rope = export["head_dim"] // export.get("frequency_fold", 1)
        why.append(f"one {rope}-dim rotary key shared by all {export['n_kv_heads']} key heads (the other rotary "
                   "mixtures position-free)")  # fmt: skip
    if export.get("attention_biases"):
        why.append("the attention biases carried in the weights")
    if export.get("latent_compressed"):
        why.append("the latent compressed")
    if export["tensor_type"] in QUANTIZED:
        kept = " (the latent's tensors Q8_0)" if export["tensor_type"] in QUANT_OVERRIDES else ""
        why.append(f"quantized to {export['tensor_type']} by llama.cpp's quantizer{kept}")
    elif export.get("rounded"):
        why.append(f"every matrix rounded to {export['tensor_type']}")
    return f"for llama.cpp ({FILE}): LOSSY, {'; '.join(why)}: check the perplexity ratio before serving; {size}"
