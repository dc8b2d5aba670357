"""Shared test helpers: tiny transformers models, transformers' own attention as the
reference, and the converted `MLAAttention` on the same inputs.

`fixtures/` (make_tiny.py, realdata.py) is put on sys.path so tests can
`from make_tiny import tiny_hf_model`.
"""

import copy
import ctypes
import os
import re
import sys
from pathlib import Path

# Memory allocation, before torch allocates anything. The real-model tests move
# tensors of 0.2–0.4 GB per window (logits over a 49,152-token vocabulary, and
# their float64 copies); by default every one of them is a fresh mmap, faulted in
# 4 KiB pages and unmapped on free. torch's own switch puts its large allocations on
# transparent huge pages, and glibc is told to serve big blocks from its heap and
# keep freed memory for reuse (test_smollm2.py on a 2-core machine: 344 s -> 259 s,
# system time 168 s -> 63 s, peak RSS +0.5 GB). Only speed changes: the same
# values are computed.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
if sys.platform.startswith("linux"):
    try:
        _libc = ctypes.CDLL("libc.so.6")
        _libc.mallopt(-4, 0)  # M_MMAP_MAX: no per-block mmap
        _libc.mallopt(-1, 1 << 40)  # M_TRIM_THRESHOLD: keep freed heap for the next window
    except (OSError, AttributeError):  # not glibc: keep its defaults
        pass

import pytest  # noqa: E402
import torch  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "fixtures"
TESTS = REPO / "tests"
for _path in (FIXTURES, TESTS):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

TINY_LLAMA = FIXTURES / "tiny-llama"

# Relative Frobenius error allowed for an exact conversion, by dtype (DESIGN §8).
EXACT_TOL = {torch.float32: 1e-5, torch.float64: 1e-10}


#: A paragraph of real prose (repeated), for calibration and evaluation texts of the tiny models.
PROSE = (
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want "
    "of a wife. However little known the feelings or views of such a man may be on his first entering a "
    "neighbourhood, this truth is so well fixed in the minds of the surrounding families. "
) * 12


#: A line `convert` itself writes on stderr off a terminal: its opening line, a progress or phase line,
#: a note or a warning (anything else there, a third party's warning say, is a bug: issue 36).
CONVERT_STDERR_LINE = re.compile(r"^(convert \w+ .+|[a-z][\w ()-]*( \.\.\.|: .+)|(note|warning): .+)$")


def bench_module(name: str):
    """The benchmark script `bench/<name>.py` as a module (bench/ is not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"bench_{name.lstrip('_')}", REPO / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rel_err(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """Relative Frobenius error ||approx - exact|| / ||exact||."""
    approx, exact = approx.detach(), exact.detach()
    return float((approx - exact).norm() / exact.norm())


def compression_cli_args(tmp_path: Path, **overrides) -> tuple[list[str], Path]:
    """A tiny Llama (`hf_model("llama", **overrides)`) saved at tmp_path/src and a calibration text
    beside it: (the `gqa2mla` arguments that compress it to half the cache, unverified and quiet;
    the calibration file). The caller adds `-o`, `--calib` and what it tests."""
    hf_model("llama", **overrides).save_pretrained(tmp_path / "src", safe_serialization=True)
    calib = tmp_path / "calib.txt"
    calib.write_text("It is a truth universally acknowledged, that a single man in possession of a good fortune. " * 20)
    return ["gqa2mla", str(tmp_path / "src"), "--kv-cache-ratio", "0.5", "--no-verify", "-q"], calib


def random_ids(batch: int = 2, length: int = 24, seed: int = 3) -> torch.Tensor:
    """(batch, length) random token ids below 128 (the tiny models' vocabulary)."""
    return torch.randint(0, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


def assert_same_as_transformers(model, converted, tol: float, ids: torch.Tensor | None = None) -> None:
    """The converted model's logits within `tol` (relative, Frobenius) of the original's, and 24
    greedy tokens from an 8-token prompt identical."""
    ids = random_ids() if ids is None else ids
    with torch.no_grad():
        ref, got = model(ids).logits, converted(ids).logits
    assert rel_err(got, ref) <= tol
    kwargs = {"max_new_tokens": 24, "do_sample": False, "pad_token_id": 0}
    assert torch.equal(converted.generate(ids[:1, :8], **kwargs), model.generate(ids[:1, :8], **kwargs))


class TokenDataset(torch.utils.data.Dataset):
    """`n` random sequences of `length` token ids, each its own labels."""

    def __init__(self, n: int = 8, length: int = 16, seed: int = 1):
        self.ids = torch.randint(3, 128, (n, length), generator=torch.Generator().manual_seed(seed))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def hf_model(model_type: str, seed: int = 0, dtype=torch.float32, random_biases: bool = True, **overrides):
    """`tiny_hf_model`, with random (non-zero) attention biases, ready to be a reference.

    transformers initialises biases to zero, which would let a converter that
    drops or misplaces them pass; here every attention bias is random. For
    float64 the reference runs SDPA: transformers' eager attention does its
    softmax in float32 even for float64 inputs, which would cap the reference
    at float32 accuracy.
    """
    from make_tiny import tiny_hf_model

    model = tiny_hf_model(model_type, seed=seed, dtype=dtype, **overrides)
    if random_biases:
        gen = torch.Generator().manual_seed(1000 + seed)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if ".self_attn." in name and name.endswith(".bias"):
                    param.copy_(0.5 * torch.randn(param.shape, generator=gen, dtype=torch.float64).to(dtype))
    if dtype == torch.float64:
        model.config._attn_implementation = "sdpa"
        model.config._experts_implementation = "eager"  # a MoE's grouped matmul refuses float64
    return model


def _mask_function(config):
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    # The same choice the Mistral/Qwen2 model forward makes.
    return create_sliding_window_causal_mask if getattr(config, "sliding_window", None) else create_causal_mask


def hf_inputs(model, batch: int = 2, length: int = 12, seed: int = 0, padding=None):
    """Random hidden states, positions, the model's own rotary embeddings, and its
    causal mask (for the reference module) plus the same mask as an additive float
    4-D tensor (for MLAAttention).

    padding: optional (batch, length) 0/1 attention mask (1 = real token).
    """
    dtype = model.dtype
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, length, model.config.hidden_size, generator=gen, dtype=torch.float64).to(dtype)
    positions = torch.arange(length)[None].expand(batch, -1)
    position_embeddings = model.model.rotary_emb(x, positions)
    make_mask = _mask_function(model.config)
    ref_mask = make_mask(
        config=model.config, inputs_embeds=x, attention_mask=padding, past_key_values=None, position_ids=positions
    )
    eager = copy.copy(model.config)
    eager._attn_implementation = "eager"  # eager masks are additive float (B, 1, L, S)
    mla_mask = make_mask(
        config=eager, inputs_embeds=x, attention_mask=padding, past_key_values=None, position_ids=positions
    )
    assert mla_mask is not None and mla_mask.dtype == dtype and mla_mask.dim() == 4
    return {
        "x": x,
        "positions": positions,
        "position_embeddings": position_embeddings,
        "ref_mask": ref_mask,
        "mla_mask": mla_mask,
    }


@torch.no_grad()
def reference_attention(model, layer: int, inputs: dict) -> torch.Tensor:
    """transformers' own attention module of `layer` on `inputs` (see hf_inputs)."""
    attn = model.model.layers[layer].self_attn
    out = attn(
        inputs["x"],
        position_embeddings=inputs["position_embeddings"],
        attention_mask=inputs["ref_mask"],
        position_ids=inputs["positions"],
    )
    return out[0]


def mla_attention(converted, layer: int, dtype=None, rotary=None):
    """Build `MLAAttention` for `layer` from a converted state dict (with `.config`)."""
    from convert.mla import build_mla_attention, layer_tensors
    from convert.mla.config import MLASection

    mla = MLASection.from_dict(converted.config["mla"])
    return build_mla_attention(mla, layer, layer_tensors(converted, mla, layer), rotary=rotary, dtype=dtype)


@torch.no_grad()
def converted_attention(converted, layer: int, inputs: dict, dtype) -> torch.Tensor:
    """The converted layer's output on the same inputs as `reference_attention`."""
    module = mla_attention(converted, layer, dtype)
    out = module(
        inputs["x"],
        position_embeddings=inputs["position_embeddings"],
        attention_mask=inputs["mla_mask"],
        position_ids=inputs["positions"],
    )
    return out[0]


def seed_gqa(D: int, H: int, G: int, d: int, seed: int = 0, dtype=torch.float32, scale: float = 2.0):
    """The seed's MyGQA(D, D, d, d, H, G) with random weights large enough that
    attention is far from uniform (nn.Linear's default init nearly flattens it)."""
    from convert.verify.seed import MyGQA

    module = MyGQA(D, D, d, d, H, G)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for lin in (module.W_Q, module.W_K, module.W_V, module.W_O):
            fan_in = lin.weight.shape[1]
            lin.weight.copy_(scale * torch.randn(lin.weight.shape, generator=gen, dtype=torch.float64) / fan_in**0.5)
    return module.to(dtype).eval()


@pytest.fixture
def tiny_llama_dir() -> Path:
    """The shipped fixture checkpoint (read-only: copy it before editing)."""
    assert (TINY_LLAMA / "model.safetensors").is_file(), "run python fixtures/make_tiny.py"
    return TINY_LLAMA


# ------------------------------------------------------------------ SmolLM2-135M (real model), once per session
#
# The real-model tests (test_smollm2.py) share one load of the original model, one
# tokenization of Emma, one conversion per layout and the original's logits on each
# distinct window: converting and running the same model again and again was most
# of the suite's time. Every test still makes its own claim on these outputs.

EVAL_TOKENS = 8192  # tokens of Emma compared end to end (bench/README.md: "8,192 tokens of *Emma*")
GREEDY_TOKENS = 32  # greedy tokens that must be identical (bench/README.md: "32 greedy tokens identical")
SMOLLM2_LAYOUTS = ["absorbed", "factored"]


class MemoizedLM:
    """A causal LM's forward, run once per distinct input and then replayed.

    `compare_models` and `perplexity` only call `model(ids).logits` under no_grad;
    a model's logits on the same ids in the same process are the same numbers, so
    the original's logits on an Emma window are computed once and read by every
    layout's comparison (and by the Fisher test's perplexity on a prefix).
    """

    def __init__(self, model):
        self.model = model
        self.config = model.config
        self._logits: dict[tuple, torch.Tensor] = {}

    def __call__(self, ids: torch.Tensor):
        from types import SimpleNamespace

        key = (tuple(ids.shape), ids.cpu().numpy().tobytes())
        if key not in self._logits:
            with torch.no_grad():
                self._logits[key] = self.model(ids).logits
        return SimpleNamespace(logits=self._logits[key])


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """The cached float32 SmolLM2-135M-Instruct directory (fixtures/realdata.py)."""
    realdata = pytest.importorskip("realdata")
    return Path(realdata.smollm2_dir())


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2)


@pytest.fixture(scope="session")
def emma_ids(smollm2_tokenizer) -> torch.Tensor:
    """The first EVAL_TOKENS token ids of Emma, (1, EVAL_TOKENS)."""
    import realdata

    ids = smollm2_tokenizer(realdata.austen_text("emma"))["input_ids"]
    assert len(ids) >= EVAL_TOKENS
    return torch.tensor(ids[:EVAL_TOKENS])[None]


@pytest.fixture(scope="session")
def smollm2_original(smollm2):
    """The original model as transformers loads it, float32, eval mode."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32)
    assert model.config.num_attention_heads == 9 and model.config.num_key_value_heads == 3
    return model.eval()


@pytest.fixture(scope="session")
def smollm2_original_lm(smollm2_original) -> MemoizedLM:
    """The original's forward, each distinct window computed once per session."""
    return MemoizedLM(smollm2_original)


@pytest.fixture(scope="session")
def smollm2_greedy_prompt(emma_ids) -> torch.Tensor:
    return emma_ids[:, 1000:1016]


@pytest.fixture(scope="session")
def smollm2_original_greedy(smollm2_original, smollm2_greedy_prompt) -> torch.Tensor:
    """The original's greedy continuation of the prompt (computed once, compared per layout)."""
    out = smollm2_original.generate(smollm2_greedy_prompt, max_new_tokens=GREEDY_TOKENS, do_sample=False)
    assert out.shape[-1] == smollm2_greedy_prompt.shape[-1] + GREEDY_TOKENS
    return out


@pytest.fixture(scope="session", params=SMOLLM2_LAYOUTS)
def smollm2_converted(request, smollm2, tmp_path_factory):
    """SmolLM2 converted exactly, once per layout per session (verified by the tests that read it)."""
    import convert

    out = tmp_path_factory.mktemp("smollm2") / f"smollm2-{request.param}"
    return convert.gqa2mla(smollm2, out, layout=request.param, verify=False, progress=False)
