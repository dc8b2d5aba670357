"""A GGUF file's header (llama.cpp's format, v2/v3, little-endian), read with every count and length
checked against the bytes left before anything is allocated for it, and what it describes in Hugging
Face terms: the config.json dict and each tensor's transformers name. No torch: the command line
checks a GGUF SRC with it (`convert.io.locate`); `convert.io.gguf` reads the tensors.

Layout: magic b"GGUF", u32 version, u64 tensor count, u64 key/value count; the key/value pairs (string
key, u32 value type, value); the tensor infos (string name, u32 n_dims, u64 dims[n_dims] fastest first,
u32 ggml type, u64 offset into the data); the data from the next `general.alignment` boundary (32)."""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from convert.arch import geometry
from convert.errors import ConvertError
from convert.rope.scaling import llama3_factors

MAGIC = b"GGUF"
VERSIONS = (2, 3)  # v1 counted in 32 bits; llama.cpp has written v3 since 2023
MAX_KV = 1 << 16  # a model has ~50 keys
MAX_TENSORS = 1 << 20  # a large mixture of experts has a few thousand tensors
MAX_ARRAY = 1 << 24  # a vocabulary has ~10^5 tokens
MAX_STRING = 1 << 24  # a chat template has ~10^4 characters
MAX_NAME = 256  # ggml's own limit on tensor names is 64
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ALIGNMENT = 1 << 16
READ_HINT = "re-download it, or re-export it with llama.cpp's convert_hf_to_gguf.py"

# value type -> (struct format, width) of the fixed-size ones; 8 is a string, 9 an array
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_INTEGER_TYPES = {0, 1, 2, 3, 4, 5, 10, 11}
_STRING, _ARRAY = 8, 9

#: ggml type id -> name, for every type ggml defines (gguf.GGMLQuantizationType)
GGML_NAMES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1", 10: "Q2_K",
    11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS",
    19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32",
    27: "I64", 28: "F64", 29: "IQ1_M", 30: "BF16", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4", 40: "NVFP4", 41: "Q1_0",
}  # fmt: skip
#: the types read: id -> (elements per block, bytes per block), gguf.GGML_QUANT_SIZES
READ_TYPES = {
    0: (1, 4), 1: (1, 2), 30: (1, 2),  # F32, F16, BF16: read as stored
    2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34),  # Q4_0 Q4_1 Q5_0 Q5_1 Q8_0
    10: (256, 84), 11: (256, 110), 12: (256, 144), 13: (256, 176), 14: (256, 210),  # Q2_K … Q6_K
}  # fmt: skip
FLOAT_TYPES = {0: "float32", 1: "float16", 30: "bfloat16"}


def _refuse(path: Path, why: str) -> ConvertError:
    return ConvertError(f"{path}: not a readable GGUF file: {why}; {READ_HINT}")


# ------------------------------------------------------------------ the parse


@dataclass(frozen=True)
class ArrayInfo:
    """A metadata array left unread (a vocabulary, scores): its element type and count."""

    element_type: int
    count: int


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as the file stores it: dims fastest first (ggml's ne), its type and absolute bytes."""

    name: str
    dims: tuple[int, ...]
    type_id: int
    start: int  # absolute offset in the file
    nbytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape in torch's order (slowest first)."""
        return tuple(reversed(self.dims))

    @property
    def type_name(self) -> str:
        return GGML_NAMES.get(self.type_id, str(self.type_id))


@dataclass(frozen=True)
class GGUFHeader:
    """A checked GGUF header: metadata (scalars, strings, numeric arrays of at most `SMALL_ARRAY`
    items as tuples, other arrays as `ArrayInfo`), the tensors in file order, the file's size."""

    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]
    data_start: int
    size: int
    value_types: dict[str, int] = field(default_factory=dict)


SMALL_ARRAY = 4096


class _Cursor:
    """Reads the header from a memory map, refusing any read past its end."""

    def __init__(self, path: Path, data: mmap.mmap, size: int):
        self.path, self.data, self.size, self.pos = path, data, size, 0

    def take(self, n: int, what: str) -> int:
        """The offset of the next `n` bytes (then skipped); refused when fewer are left."""
        if n > self.size - self.pos:
            raise _refuse(self.path, f"{what} needs {n} bytes at offset {self.pos}, but the file ends at {self.size}")
        start, self.pos = self.pos, self.pos + n
        return start

    def scalar(self, fmt: str, what: str) -> Any:
        width = struct.calcsize(fmt)
        return struct.unpack_from("<" + fmt, self.data, self.take(width, what))[0]

    def string(self, limit: int, what: str) -> str:
        length = self.scalar("Q", f"the length of {what}")
        if length > limit:
            raise _refuse(self.path, f"{what} is {length} bytes long (at most {limit} are read)")
        start = self.take(length, what)
        try:
            return self.data[start : start + length].decode("utf-8")
        except UnicodeDecodeError:
            raise _refuse(self.path, f"{what} is not UTF-8 text") from None

    def skip_string(self, what: str) -> None:
        length = self.scalar("Q", f"the length of {what}")
        self.take(length, what)


def _value(cursor: _Cursor, value_type: int, key: str) -> Any:
    if value_type in _SCALARS:
        return cursor.scalar(_SCALARS[value_type], f"the value of {key!r}")
    if value_type == _STRING:
        return cursor.string(MAX_STRING, f"the value of {key!r}")
    if value_type != _ARRAY:
        raise _refuse(cursor.path, f"key {key!r} has value type {value_type}, which GGUF does not define")
    element_type = cursor.scalar("I", f"the element type of {key!r}")
    count = cursor.scalar("Q", f"the length of {key!r}")
    if count > MAX_ARRAY:
        raise _refuse(cursor.path, f"array {key!r} claims {count} items (at most {MAX_ARRAY} are read)")
    if element_type == _STRING:
        cursor.take(8 * count, f"array {key!r}")  # every string has its 8-byte length: a bound before the walk
        cursor.pos -= 8 * count
        for i in range(count):
            cursor.skip_string(f"item {i} of {key!r}")
        return ArrayInfo(element_type, count)
    if element_type not in _SCALARS:
        raise _refuse(cursor.path, f"array {key!r} holds items of type {element_type} (nested or unknown)")
    fmt = _SCALARS[element_type]
    start = cursor.take(struct.calcsize(fmt) * count, f"array {key!r}")
    if count > SMALL_ARRAY:
        return ArrayInfo(element_type, count)
    return struct.unpack_from(f"<{count}{fmt}", cursor.data, start)


def _metadata(cursor: _Cursor, count: int) -> tuple[dict[str, Any], dict[str, int]]:
    metadata, types = {}, {}
    for i in range(count):
        key = cursor.string(MAX_STRING, f"key {i}")
        if key in metadata:
            raise _refuse(cursor.path, f"key {key[:80]!r} appears twice")
        types[key] = cursor.scalar("I", f"the value type of {key!r}")
        metadata[key] = _value(cursor, types[key], key)
    return metadata, types


def _tensor_info(cursor: _Cursor, i: int) -> tuple[str, tuple[int, ...], int, int]:
    name = cursor.string(MAX_NAME, f"the name of tensor {i}")
    n_dims = cursor.scalar("I", f"the dimension count of {name!r}")
    if not 1 <= n_dims <= MAX_DIMS:
        raise _refuse(cursor.path, f"tensor {name!r} has {n_dims} dimensions (ggml allows 1 to {MAX_DIMS})")
    dims = tuple(cursor.scalar("Q", f"the dimensions of {name!r}") for _ in range(n_dims))
    if not all(1 <= d < 1 << 62 for d in dims):
        raise _refuse(cursor.path, f"tensor {name!r} has dimensions {list(dims)}")
    type_id = cursor.scalar("I", f"the type of {name!r}")
    offset = cursor.scalar("Q", f"the data offset of {name!r}")
    return name, dims, type_id, offset


def _alignment(path: Path, metadata: dict, types: dict) -> int:
    alignment = metadata.get("general.alignment", 32)
    if "general.alignment" in types and types["general.alignment"] != 4:  # u32, as llama.cpp requires
        raise _refuse(path, "general.alignment is not a u32")
    if not (0 < alignment <= MAX_ALIGNMENT and alignment & (alignment - 1) == 0):
        raise _refuse(path, f"general.alignment={alignment} is not a power of two up to {MAX_ALIGNMENT}")
    return alignment


def _nbytes(path: Path, name: str, dims: tuple[int, ...], type_id: int) -> int:
    """The stored bytes of a tensor of a type read here; a type that is not is refused by name."""
    if type_id not in GGML_NAMES:
        raise _refuse(path, f"tensor {name!r} has type id {type_id}, which ggml does not define")
    if type_id not in READ_TYPES:
        read = ", ".join(GGML_NAMES[t] for t in READ_TYPES)
        raise ConvertError(
            f"{path}: tensor {name!r} is stored as {GGML_NAMES[type_id]}, which convert does not read "
            f"(it reads {read}); use a GGUF of one of those types, or the model's safetensors"
        )
    block, block_bytes = READ_TYPES[type_id]
    if dims[0] % block:
        raise _refuse(path, f"tensor {name!r} has rows of {dims[0]}, not a multiple of its {block}-value blocks")
    return math.prod(dims) // block * block_bytes


def _tensors(cursor: _Cursor, raw: list, data_start: int, alignment: int) -> dict[str, TensorInfo]:
    """The tensor infos checked: known types, aligned offsets, data inside the file, no overlaps."""
    path, tensors = cursor.path, {}
    for name, dims, type_id, offset in raw:
        if name in tensors:
            raise _refuse(path, f"tensor {name!r} appears twice")
        nbytes = _nbytes(path, name, dims, type_id)
        if offset % alignment or offset + nbytes > cursor.size - data_start:
            raise _refuse(
                path,
                f"tensor {name!r} data at offset {offset} ({nbytes} bytes) is misaligned or runs past the end "
                f"of the file ({cursor.size - data_start} data bytes): truncated or damaged",
            )
        tensors[name] = TensorInfo(name, dims, type_id, data_start + offset, nbytes)
    ordered = sorted(tensors.values(), key=lambda t: t.start)
    for before, after in zip(ordered, ordered[1:]):
        if after.start < before.start + before.nbytes:
            raise _refuse(path, f"tensors {before.name!r} and {after.name!r} overlap")
    return tensors


def parse_header(path: Path) -> GGUFHeader:
    """The checked header of the GGUF file `path`; ConvertError (one line) for anything malformed."""
    try:
        size = path.stat().st_size
        f = open(path, "rb")
    except OSError as exc:
        raise ConvertError.unreadable(path, exc) from None
    with f:
        if size < 24:
            raise _refuse(path, f"only {size} bytes, too short for a GGUF header")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _parse(_Cursor(path, data, size))


def _parse(cursor: _Cursor) -> GGUFHeader:
    path = cursor.path
    magic = bytes(cursor.data[0:4])
    if magic != MAGIC:
        raise _refuse(path, f"it starts with {magic!r}, not GGUF's magic b'GGUF'")
    cursor.pos = 4
    version = cursor.scalar("I", "the version")
    if version not in VERSIONS:
        big_endian = " (a big-endian file?)" if version in {v << 24 for v in VERSIONS} else ""
        raise _refuse(path, f"GGUF version {version}{big_endian}; convert reads versions 2 and 3")
    n_tensors, n_kv = cursor.scalar("Q", "the tensor count"), cursor.scalar("Q", "the key count")
    if n_kv > MAX_KV or n_tensors > MAX_TENSORS:
        raise _refuse(path, f"it claims {n_tensors} tensors and {n_kv} metadata keys")
    metadata, types = _metadata(cursor, n_kv)
    raw = [_tensor_info(cursor, i) for i in range(n_tensors)]
    alignment = _alignment(path, metadata, types)
    data_start = -(-cursor.pos // alignment) * alignment
    if data_start > cursor.size:
        raise _refuse(path, f"the data would start at {data_start}, past the end of the file ({cursor.size})")
    tensors = _tensors(cursor, raw, data_start, alignment)
    return GGUFHeader(path, version, metadata, tensors, data_start, cursor.size, types)


def read_gguf_header(path: Path | str) -> GGUFHeader:
    """`parse_header` of a path given as a string or a Path (~0.4 s for a 150,000-token vocabulary)."""
    return parse_header(Path(path))


def is_gguf(path: Path | str) -> bool:
    """Whether `path` is a file named .gguf or starting with GGUF's magic (Ollama's blobs have no suffix)."""
    path = Path(path)
    if not path.is_file():
        return False
    if path.suffix.lower() == ".gguf":
        return True
    try:
        with open(path, "rb") as f:
            return f.read(4) == MAGIC
    except OSError:
        return False


# ------------------------------------------------------------------ what the header describes


@dataclass(frozen=True)
class Family:
    """How llama.cpp stores one transformers family: its architecture name in GGUF, the transformers
    model type and class, layer tensor names that differ from Llama's, whether q/k rows are permuted
    (llama.cpp's `permute` for its interleaved RoPE) and whether norms are stored as 1 + w (Gemma)."""

    model_type: str
    architecture: str
    layer_names: dict[str, str] = field(default_factory=dict)
    permuted_qk: bool = False
    norm_plus_one: bool = False


#: blk.N.<name> -> model.layers.N.<name> in a Llama-style decoder
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
MODEL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_POST_NORMS = {"post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}

FAMILIES = {
    "llama": Family("llama", "LlamaForCausalLM", permuted_qk=True),
    "qwen2": Family("qwen2", "Qwen2ForCausalLM"),
    "qwen3": Family("qwen3", "Qwen3ForCausalLM"),
    "gemma2": Family(
        "gemma2", "Gemma2ForCausalLM", {**_POST_NORMS, "ffn_norm": "pre_feedforward_layernorm"}, norm_plus_one=True
    ),
    "gemma3": Family(
        "gemma3_text", "Gemma3ForCausalLM", {**_POST_NORMS, "ffn_norm": "pre_feedforward_layernorm"}, norm_plus_one=True
    ),
    "olmo2": Family("olmo2", "Olmo2ForCausalLM", dict(_POST_NORMS)),
    "phi3": Family("phi3", "Phi3ForCausalLM", {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}),
}
#: tokenizer.ggml.model values transformers builds a tokenizer from (its GGUF_TOKENIZER_TYPES)
TOKENIZER_MODELS = ("gpt2", "llama", "t5", "gemma4")
#: tensors llama.cpp adds for RoPE that transformers keeps in config.json (`rope_scaling`)
ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


def family_of(header: GGUFHeader) -> tuple[str, Family]:
    """(GGUF architecture, its `Family`); refused in one line when convert does not read it."""
    arch = header.metadata.get("general.architecture")
    if not isinstance(arch, str):
        raise _refuse(header.path, "it has no general.architecture string")
    if arch not in FAMILIES:
        raise ConvertError(
            f"{header.path}: GGUF architecture {arch[:60]!r} is not one convert reads "
            f"({', '.join(FAMILIES)}; Mistral is 'llama' in GGUF)"
        )
    tokenizer = header.metadata.get("tokenizer.ggml.model", "gpt2")
    if tokenizer not in TOKENIZER_MODELS:
        raise ConvertError(
            f"{header.path}: its tokenizer (tokenizer.ggml.model={str(tokenizer)[:40]!r}) is not one transformers "
            f"builds ({', '.join(TOKENIZER_MODELS)}); convert the model's safetensors"
        )
    if header.metadata.get(f"{arch}.expert_count", 0):
        raise ConvertError(f"{header.path}: a mixture-of-experts {arch} GGUF is not read; convert its safetensors")
    return arch, FAMILIES[arch]


def hf_name(gguf_name: str, family: Family, n_layers: int) -> str | None:
    """The transformers name of a GGUF tensor, None when the family has none."""
    stem, dot, kind = gguf_name.rpartition(".")
    if kind not in ("weight", "bias") or not dot:
        return None
    if stem in MODEL_NAMES:
        return f"{MODEL_NAMES[stem]}.{kind}"
    parts = stem.split(".")
    if len(parts) != 3 or parts[0] != "blk" or not parts[1].isdigit() or int(parts[1]) >= n_layers:
        return None
    names = {**LAYER_NAMES, **family.layer_names}
    if parts[2] not in names or str(int(parts[1])) != parts[1]:
        return None
    return f"model.layers.{parts[1]}.{names[parts[2]]}.{kind}"


class _Keys:
    """Typed reads of one architecture's metadata keys: a key of the wrong type or range is refused by name."""

    def __init__(self, header: GGUFHeader, arch: str):
        self.header, self.arch = header, arch

    def _get(self, key: str, kinds: set[int], what: str, required: bool) -> Any:
        full = key if key.startswith(("general.", "tokenizer.")) else f"{self.arch}.{key}"
        if full not in self.header.metadata:
            if required:
                raise _refuse(self.header.path, f"it has no {full}")
            return None
        if self.header.value_types[full] not in kinds:
            raise _refuse(self.header.path, f"{full} is not {what}")
        return full, self.header.metadata[full]

    def int(self, key: str, default: Any = None, required: bool = False, minimum: int = 1) -> Any:
        found = self._get(key, _INTEGER_TYPES, "an integer", required)
        if found is None:
            return default
        full, value = found
        if not minimum <= value < 1 << 31:
            raise _refuse(self.header.path, f"{full}={value} is out of range")
        return value

    def float(self, key: str, default: Any = None, required: bool = False) -> Any:
        found = self._get(key, {6, 12}, "a number", required)
        if found is None:
            return default
        full, value = found
        if not math.isfinite(value):
            raise _refuse(self.header.path, f"{full}={value} is not finite")
        return _shortest(value)

    def string(self, key: str, default: Any = None) -> Any:
        found = self._get(key, {_STRING}, "a string", False)
        return default if found is None else found[1]


def _shortest(value: float) -> float:
    """A float32 metadata value as the shortest decimal that rounds to it (1e-06, not 9.99999997e-07):
    what the model's config.json said, and the same float32."""
    try:
        if struct.unpack("<f", struct.pack("<f", value))[0] != value:
            return value  # a float64 value: kept as is
    except OverflowError:
        return value
    for digits in range(1, 18):
        if struct.unpack("<f", struct.pack("<f", float(text := f"{value:.{digits}g}")))[0] == value:
            return float(text)
    return value


def hf_config(header: GGUFHeader) -> dict[str, Any]:
    """The transformers config.json dict the GGUF's metadata describes (what transformers' own GGUF
    loader builds, with the keys a published config.json of the family carries)."""
    arch, family = family_of(header)
    keys = _Keys(header, arch)
    heads = keys.int("attention.head_count", required=True)
    hidden = keys.int("embedding_length", required=True)
    head_dim = keys.int("attention.key_length") or keys.int("rope.dimension_count") or hidden // heads
    if keys.int("attention.value_length", head_dim) != head_dim:
        raise ConvertError(f"{header.path}: values narrower or wider than keys are not read; convert its safetensors")
    config = {
        "architectures": [family.architecture],
        "model_type": family.model_type,
        "hidden_size": hidden,
        "intermediate_size": keys.int("feed_forward_length", required=True),
        "num_hidden_layers": keys.int("block_count", required=True),
        "num_attention_heads": heads,
        "num_key_value_heads": keys.int("attention.head_count_kv", heads),
        "max_position_embeddings": keys.int("context_length", required=True),
        "rms_norm_eps": keys.float("attention.layer_norm_rms_epsilon", required=True),
        "rope_theta": keys.float("rope.freq_base", 10000.0),
        "vocab_size": _vocab_size(header),
        "tie_word_embeddings": "output.weight" not in header.tensors,
        "torch_dtype": _dtype(header),
    }
    _check_heads(header, config)
    if head_dim != hidden // heads or family.model_type in ("qwen3", "gemma2", "gemma3_text"):
        config["head_dim"] = head_dim
    for key, name in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("padding", "pad_token_id")):
        config[name] = token = keys.int(f"tokenizer.ggml.{key}_token_id", minimum=0)  # None: no such token
        if token is not None and token >= config["vocab_size"]:
            raise _refuse(
                header.path, f"tokenizer.ggml.{key}_token_id={token} is outside the {config['vocab_size']} tokens"
            )
    config |= _rope(header, keys, family, head_dim) | _family_fields(header, keys, family, config)
    return config


def _check_heads(header: GGUFHeader, config: dict) -> None:
    """The head counts divide as transformers requires, and the embedding is hidden_size wide."""
    hidden, heads, kv = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    if hidden % heads or heads % kv:
        raise _refuse(header.path, f"{heads} heads and {kv} key/value heads do not divide a hidden size of {hidden}")
    if header.tensors["token_embd.weight"].dims[0] != hidden:
        raise _refuse(header.path, f"token_embd.weight is not {hidden} wide, the embedding length it states")


def _vocab_size(header: GGUFHeader) -> int:
    embedding = header.tensors.get("token_embd.weight")
    if embedding is None or len(embedding.dims) != 2:
        raise _refuse(header.path, "it has no 2-D token_embd.weight")
    return embedding.dims[1]


def _dtype(header: GGUFHeader) -> str:
    """The checkpoint's dtype as config.json says it: the first layer's query weight's float type,
    float32 where it is quantized (read dequantized to float32)."""
    q = header.tensors.get("blk.0.attn_q.weight") or header.tensors.get("blk.0.attn_qkv.weight")
    return FLOAT_TYPES.get(q.type_id, "float32") if q is not None else "float32"


def _rope(header: GGUFHeader, keys: _Keys, family: Family, head_dim: int) -> dict[str, Any]:
    """rope_scaling (and Phi-3's partial rotary factor) from the rope.* keys and llama.cpp's rope tensors."""
    fields: dict[str, Any] = {}
    n_rot = keys.int("rope.dimension_count", head_dim)
    if n_rot != head_dim:
        if family.model_type != "phi3":
            raise ConvertError(f"{header.path}: RoPE over {n_rot} of {head_dim} dims is not read for this family")
        fields["partial_rotary_factor"] = n_rot / head_dim
    kind = keys.string("rope.scaling.type", "none")
    factor = keys.float("rope.scaling.factor", 1.0)
    original = keys.int("rope.scaling.original_context_length")
    if "rope_freqs.weight" in header.tensors:
        fields["rope_scaling"] = _llama3_scaling(header, keys.float("rope.freq_base", 10000.0), n_rot)
    elif "rope_factors_long.weight" in header.tensors:
        fields |= _longrope(header, original, n_rot)
    elif kind == "linear" and factor != 1.0:
        fields["rope_scaling"] = {"rope_type": "linear", "factor": factor}
    elif kind == "yarn":
        if original is None:
            raise _refuse(header.path, "YaRN scaling without rope.scaling.original_context_length")
        yarn = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original}
        for key, name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            if (value := keys.float(f"rope.scaling.{key}")) is not None:
                yarn[name] = value
        fields["rope_scaling"] = yarn
    elif kind not in ("none", "linear"):
        raise ConvertError(f"{header.path}: RoPE scaling {kind[:40]!r} is not read; convert its safetensors")
    return fields


def small_floats(header: GGUFHeader, name: str, count: int) -> list[float]:
    """A small F32 vector of the file (llama.cpp's RoPE factors), read straight from the file."""
    info = header.tensors[name]
    if info.type_id != 0 or info.dims != (count,):
        raise _refuse(header.path, f"{name} is not {count} F32 values")
    with open(header.path, "rb") as f:
        f.seek(info.start)
        data = f.read(info.nbytes)
    if len(data) != info.nbytes:
        raise _refuse(header.path, f"{name} ends early (file shrank while open?)")
    return [_shortest(v) for v in struct.unpack(f"<{count}f", data)]


def _llama3_scaling(header: GGUFHeader, theta: float, n_rot: int) -> dict[str, Any]:
    """The Llama 3 rope_scaling whose factors are the file's rope_freqs: Meta's low/high frequency
    factors (1, 4) and original context (8192) with the file's largest factor, checked against every
    stored value; any other set of factors is refused, not guessed."""
    stored = small_floats(header, "rope_freqs.weight", n_rot // 2)
    scaling: dict[str, Any] = {
        "rope_type": "llama3",
        "factor": max(stored),
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    expected = llama3_factors(theta, n_rot, scaling["factor"], 1.0, 4.0, 8192)
    if any(abs(a - b) > 1e-5 * abs(b) for a, b in zip(stored, expected)):  # llama.cpp computes in float32
        raise ConvertError(
            f"{header.path}: rope_freqs.weight holds RoPE factors that no Llama 3 rope_scaling with low/high "
            "frequency factors 1/4 and original context 8192 gives; convert its safetensors"
        )
    return scaling


def _longrope(header: GGUFHeader, original: int | None, n_rot: int) -> dict[str, Any]:
    """Phi-3's LongRoPE: its two factor lists, stored by llama.cpp as tensors."""
    if original is None or "rope_factors_short.weight" not in header.tensors:
        raise _refuse(header.path, "rope_factors_long.weight without its short factors or original context length")
    long, short = (small_floats(header, f"rope_factors_{k}.weight", n_rot // 2) for k in ("long", "short"))
    return {
        "rope_scaling": {"rope_type": "longrope", "long_factor": long, "short_factor": short},
        "original_max_position_embeddings": original,
    }


def _family_fields(header: GGUFHeader, keys: _Keys, family: Family, config: dict) -> dict[str, Any]:
    """What a family's config.json has beyond Llama's: biases, sliding windows, Gemma's scaling and
    soft-capping (llama.cpp's rules where the file says nothing: Gemma's 27B query scale, Gemma 3's
    local RoPE base and its five sliding-window layers to one global)."""
    fields: dict[str, Any] = {}
    layer0 = {t.split(".", 2)[2] for t in header.tensors if t.startswith("blk.0.")}
    if family.model_type in ("llama", "qwen3", "olmo2"):
        fields["attention_bias"] = "attn_q.bias" in layer0
    if family.model_type == "llama":
        fields["mlp_bias"] = "ffn_up.bias" in layer0
    if (window := keys.int("attention.sliding_window")) is not None:
        fields["sliding_window"] = window
    if family.model_type in ("gemma2", "gemma3_text"):
        head_dim, layers = config.get("head_dim"), config["num_hidden_layers"]
        big = layers == (46 if family.model_type == "gemma2" else 62)  # llama.cpp's LLM_TYPE_27B
        fields["query_pre_attn_scalar"] = config["hidden_size"] // config["num_attention_heads"] if big else head_dim
        caps = (50.0, 30.0) if family.model_type == "gemma2" else (None, None)  # llama.cpp's defaults
        fields["attn_logit_softcapping"] = keys.float("attn_logit_softcapping", caps[0])
        fields["final_logit_softcapping"] = keys.float("final_logit_softcapping", caps[1])
        fields["hidden_activation"] = "gelu_pytorch_tanh"
    if family.model_type == "gemma3_text":
        fields["rope_local_base_freq"] = keys.float("rope.freq_base_swa", 10000.0)
        fields["sliding_window_pattern"] = 6
    return fields


@dataclass(frozen=True)
class HFTensor:
    """A GGUF tensor as transformers holds it: `heads` undoes llama.cpp's q/k row permutation over that
    many heads (None: stored in transformers' order); `minus_one`, a norm stored as 1 + w (Gemma)."""

    info: TensorInfo
    heads: int | None = None
    minus_one: bool = False


def hf_tensors(header: GGUFHeader, config: dict) -> dict[str, HFTensor]:
    """Every tensor of the file under its transformers name, in file order; a tensor the family has
    no place for is refused by name (never dropped, never guessed)."""
    _, family = family_of(header)
    tensors = {}
    for name, info in header.tensors.items():
        if name in ROPE_TENSORS:
            continue  # read into config.json's rope_scaling (`hf_config`)
        hf = hf_name(name, family, config["num_hidden_layers"])
        if hf is None:
            raise ConvertError(
                f"{header.path}: tensor {name!r} has no place in a transformers {family.model_type} model; "
                "convert does not guess where it goes (convert the model's safetensors instead)"
            )
        if hf in tensors:
            raise _refuse(header.path, f"tensor {name!r} is a second {hf}")
        heads = _permuted_heads(header, family, name, config)
        tensors[hf] = HFTensor(info, heads, family.norm_plus_one and name.endswith("norm.weight"))
    return tensors


def _permuted_heads(header: GGUFHeader, family: Family, name: str, config: dict) -> int | None:
    """The head count llama.cpp's `permute` split q or k rows by (Llama's GGUF only), checked to divide."""
    if not family.permuted_qk or not (".attn_q." in name or ".attn_k." in name):
        return None
    heads = config["num_attention_heads" if ".attn_q." in name else "num_key_value_heads"]
    head_dim = geometry.head_dim(config)
    rows = header.tensors[name].shape[0]
    if rows != heads * head_dim or head_dim % 2:
        raise _refuse(header.path, f"tensor {name!r} has {rows} rows, which do not split into {heads} heads")
    return heads


def gguf_config(path: Path | str) -> dict[str, Any]:
    """The config.json dict of the GGUF file `path`, once its header and every tensor's place in the
    family are checked (what the command line asks before it imports torch)."""
    return checked_gguf(path)[1]


def checked_gguf(path: Path | str) -> tuple[GGUFHeader, dict[str, Any]]:
    """(header, config.json dict) of the GGUF file `path`, its header parsed once and every tensor's
    place in the family checked."""
    header = read_gguf_header(path)
    config = hf_config(header)
    hf_tensors(header, config)
    return header, config
