"""The vllm export's DeepSeek-V3 tensors as llama.cpp's `deepseek2` GGUF (`write_gguf`) and back
(`read_gguf`): names, shapes and keys as llama.cpp's `src/models/deepseek2.cpp` reads them, the latent
at its used width, the residual and latent scales chosen for the tensor type (docs/design.md,
"Deployment targets")."""

import math
from pathlib import Path

import gguf
import numpy as np
import torch

from convert.errors import ConvertError

ARCH = "deepseek2"
KV_LORA_RANK = 512  # the vllm export's latent; llama.cpp gets its used dims only
NORM_EPS_LOG2 = 40  # the vllm export's rms_norm_eps = 2^40
TYPES = {
    "float32": gguf.GGMLQuantizationType.F32,
    "float16": gguf.GGMLQuantizationType.F16,
    "bfloat16": gguf.GGMLQuantizationType.BF16,
}
#: Largest |value| a residual-writing tensor may have in a half-precision or quantized file (F16's
#: range, and the F16 block scales of Q8_0/Q4_K); how far the latent's scale may lag the residual's.
HALF_MAX_LOG2, HALF_LAG_LOG2 = 14, 10

_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight",
    "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight",
}
_RESIDUAL = ("token_embd.weight", "attn_output.weight", "ffn_down.weight")


def scales(tensors: dict, half: bool) -> tuple[int, int]:
    """(k, j): the residual stream × 2^-k, the latent before its norm × 2^-j, both against the vllm
    export's. Its latent norm is linear because eps 2^40 ≫ the latent's mean square m; llama.cpp reads
    one eps for every norm, so eps × 2^-2k keeps the other norms exact, and the latent norm stays
    linear to m·2^(2(k-j)-41). float32/bfloat16 hold the export's range (k = j = 0); float16 and the
    quantized files' F16 block scales do not: k brings the largest residual-writing value under
    2^HALF_MAX_LOG2, j keeps the latent's weights out of F16's subnormals."""
    if not half:
        return 0, 0
    largest = max(float(t.abs().max()) for n, t in tensors.items() if _gguf_name(n).endswith(_RESIDUAL))
    k = max(0, math.ceil(math.log2(largest)) - HALF_MAX_LOG2)
    return k, max(0, k - HALF_LAG_LOG2)


def _gguf_name(name: str) -> str:
    if name in _NAMES:
        return _NAMES[name]
    _, _, layer, rest = name.split(".", 3)
    return f"blk.{layer}.{_LAYER_NAMES.get(rest, rest)}"


def gguf_tensors(tensors: dict, config: dict, latent: int, k: int, j: int, tied: float | None = None):
    """(GGUF name, float32 tensor in HF orientation) of the export's tensors: the latent cut to its
    `latent` used dims (the rest are zero: vLLM's fixed 512), kv_b split per head into llama.cpp's
    attn_k_b (H, latent, nope) and attn_v_b (H, v, latent); the biases dropped, as vLLM drops them.
    Tied embeddings stay tied (no output.weight: llama.cpp's deepseek2 reads token_embd then), the
    final norm's weight ÷ c·2^-k undoing the embedding's scales in the logits (tied: `tied_scale`'s c)."""
    H, nope, v = config["num_attention_heads"], config["qk_nope_head_dim"], config["v_head_dim"]
    for name, tensor in tensors.items():
        if name.endswith("bias") or (tied and name == "lm_head.weight"):
            continue
        t = tensor.float()
        out = _gguf_name(name)
        if tied and name == "model.norm.weight":  # the logits read token_embd, × c·2^-k the head
            yield out, t * (2.0**k / tied)
        elif out.endswith(_RESIDUAL):
            yield out, t * 2.0**-k
        elif name.endswith("kv_a_proj_with_mqa.weight"):
            _check_unused(t[latent:KV_LORA_RANK], name)
            yield out, torch.cat([t[:latent] * 2.0**-j, t[KV_LORA_RANK:]])
        elif name.endswith("kv_a_layernorm.weight"):
            yield out, t[:latent] * 2.0 ** (j - k)
        elif name.endswith("kv_b_proj.weight"):
            _check_unused(t[:, latent:], name)
            kv_b = t[:, :latent].reshape(H, nope + v, latent)  # (H, nope + v, latent)
            prefix = out.removesuffix("self_attn.kv_b_proj.weight")  # blk.N.
            yield prefix + "attn_k_b.weight", kv_b[:, :nope].transpose(1, 2).contiguous()  # (H, latent, nope)
            yield prefix + "attn_v_b.weight", kv_b[:, nope:].contiguous()  # (H, v, latent)
        else:
            yield out, t


def tied_scale(tensors: dict, rows: int = 4096) -> float | None:
    """c where the export's head is its embedding / c (a tied source: the vllm construction writes the
    head as its own tensor, and the embedding × c, its residual stream's scale), else None; read
    `rows` rows at a time (a 150,000-token vocabulary's float64 copies would be gigabytes)."""
    head, embedding = tensors.get("lm_head.weight"), tensors.get("model.embed_tokens.weight")
    if head is None or embedding is None or head.shape != embedding.shape:
        return None
    dot = norm = 0.0
    for start in range(0, head.shape[0], rows):
        h, e = head[start : start + rows].double(), embedding[start : start + rows].double()
        dot, norm = dot + float((e * h).sum()), norm + float((h * h).sum())
    c = dot / norm if norm > 0 else 0.0
    if c <= 0:
        return None
    bound = 1e-6 * float(embedding.abs().max())
    for start in range(0, head.shape[0], rows):
        h, e = head[start : start + rows].double(), embedding[start : start + rows].double()
        if float((e - c * h).abs().max()) > bound:
            return None
    return c


def _check_unused(t: torch.Tensor, name: str) -> None:
    if t.numel() and float(t.abs().max()) != 0:
        raise ConvertError(f"{name}: latent dims past the used ones are not zero; this is a converter bug, report it")


def write_gguf(path: Path, tensors: dict, config: dict, latent: int, tensor_type: str, vocab, half=None) -> dict:
    """Write the export (`tensors`, HF names; `config`, its DeepseekV3 config dict) as one deepseek2
    GGUF at `path`. latent: the latent's used dims; tensor_type: float32, float16 or bfloat16 (norms
    stay float32, as llama.cpp's own converter writes them); vocab: a `GGUFVocab`; half: scale for
    F16 ranges (default: when tensor_type is float16; a file to be quantized needs it too). Returns what the
    file's construction chose (scales, eps, a tied head), for config.json."""
    k, j = scales(tensors, tensor_type == "float16" if half is None else half)
    tied = tied_scale(tensors)
    eps = 2.0 ** (NORM_EPS_LOG2 - 2 * k)
    writer = gguf.GGUFWriter(str(path), ARCH)
    _hparams(writer, config, latent, eps, tensor_type)
    vocab.add_to(writer, config["vocab_size"])
    for name, t in gguf_tensors(tensors, config, latent, k, j, tied):
        _add_tensor(writer, name, t, tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    chosen = {"residual_scale_log2": -k, "latent_scale_log2": -j, "rms_norm_eps": eps, "kv_lora_rank": latent}
    return chosen | {"tie_word_embeddings": tied is not None}


def _hparams(writer, config: dict, latent: int, eps: float, tensor_type: str) -> None:
    """deepseek2's keys (`llama_model_deepseek2::load_arch_hparams`): MLA with a plain query, a dense
    SwiGLU MLP in every layer, one rotary key of qk_rope_head_dim dims with one frequency set."""
    layers, nope, v = config["num_hidden_layers"], config["qk_nope_head_dim"], config["v_head_dim"]
    rope = config["qk_rope_head_dim"]
    writer.add_name(config.get("convert_export", {}).get("source_model_type", "converted") + " (MLA)")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_block_count(layers)
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(1)  # MLA runs as MQA over the latent
    writer.add_layer_norm_rms_eps(eps)
    writer.add_rope_dimension_count(rope)
    writer.add_rope_freq_base(float(config["rope_parameters"]["rope_theta"]))
    writer.add_leading_dense_block_count(layers)
    writer.add_q_lora_rank(0)
    writer.add_kv_lora_rank(latent)
    writer.add_key_length(latent + rope)
    writer.add_value_length(latent)
    writer.add_key_length_mla(nope + rope)
    writer.add_value_length_mla(v)
    writer.add_expert_feed_forward_length(config["intermediate_size"])
    writer.add_expert_shared_count(0)
    writer.add_vocab_size(config["vocab_size"])
    writer.add_file_type({"float32": 0, "float16": 1, "bfloat16": 32}[tensor_type])


def _add_tensor(writer, name: str, t: torch.Tensor, tensor_type: str) -> None:
    kind = gguf.GGMLQuantizationType.F32 if t.dim() == 1 else TYPES[tensor_type]
    if kind == gguf.GGMLQuantizationType.BF16:
        data = t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint8)  # (..., 2·columns) bytes
        writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=kind)  # a byte shape, as gguf reads it
    else:
        writer.add_tensor(name, t.numpy().astype(np.float16 if kind == gguf.GGMLQuantizationType.F16 else np.float32))


# ------------------------------------------------------------------ back: the GGUF as DeepseekV3 tensors


def read_gguf(path: Path) -> tuple[dict, dict]:
    """(the file's tensors under DeepseekV3ForCausalLM's names, float32; its keys), the inverse of
    `write_gguf` for llama.cpp's own arithmetic: the latent norm's eps is returned with the keys
    (`deepseek2.attention.layer_norm_rms_epsilon`), the residual and latent scales stay in the weights,
    quantized tensors dequantized. A file this target did not write is refused."""
    reader = gguf.GGUFReader(str(path))
    keys = {f.name: _field_value(f) for f in reader.fields.values() if not f.name.startswith("tokenizer.ggml.")}
    if keys.get("general.architecture") != ARCH:
        raise ConvertError(f"{path}: not a deepseek2 GGUF (architecture {keys.get('general.architecture')!r})")
    H, rope = keys[f"{ARCH}.attention.head_count"], keys[f"{ARCH}.rope.dimension_count"]
    nope = keys[f"{ARCH}.attention.key_length_mla"] - rope
    out = {}
    for t in reader.tensors:
        shape = tuple(int(n) for n in reversed(t.shape))
        values = torch.from_numpy(np.array(gguf.dequantize(t.data, t.tensor_type), dtype=np.float32))
        out.update(_hf_tensors(t.name, values.reshape(shape), H, nope))
    return _merged_kv_b(out, H), keys


def _field_value(field):
    return field.contents()


_BACK = {v: k for k, v in _NAMES.items()} | {v: k for k, v in _LAYER_NAMES.items()}


def _hf_tensors(name: str, t: torch.Tensor, H: int, nope: int):
    if name in _BACK:
        return {_BACK[name]: t}
    _, layer, rest = name.split(".", 2)
    prefix = f"model.layers.{layer}."
    if rest in ("attn_k_b.weight", "attn_v_b.weight"):
        return {prefix + rest: t}  # merged into kv_b_proj by `_merged_kv_b`
    if rest not in _BACK:
        raise ConvertError(f"tensor {name!r} is not one the llamacpp target writes; was this file made by convert?")
    return {prefix + _BACK[rest]: t}


def _merged_kv_b(tensors: dict, H: int) -> dict:
    """attn_k_b (H, latent, nope) and attn_v_b (H, v, latent) as kv_b_proj (H·(nope + v), latent)."""
    for name in [n for n in tensors if n.endswith("attn_k_b.weight")]:
        prefix = name.removesuffix("attn_k_b.weight")
        k_b, v_b = tensors.pop(name), tensors.pop(prefix + "attn_v_b.weight")
        kv_b = torch.cat([k_b.transpose(1, 2), v_b], dim=1)  # (H, nope + v, latent)
        tensors[prefix + "self_attn.kv_b_proj.weight"] = kv_b.reshape(-1, kv_b.shape[-1])
    return tensors
