"""A converted model in every pipeline a user would try, on tiny models: transformers' `Trainer`
(gradient checkpointing, gradient accumulation), TRL's `SFTTrainer`, PEFT LoRA, `torch.compile`,
`generate` with every cache implementation, `output_attentions`, `device_map="auto"` loading,
`save_pretrained` and an `accelerate.Accelerator` training step.

Each runs on the outputs a user gets: each exact layout of `convert.to_mla` in memory
("absorbed", "factored"), a compression ("compressed": half the cache, factored, calibrated on
token ids) and a checkpoint `convert.gqa2mla` wrote, loaded by `AutoModelForCausalLM` ("disk").
Exact conversions are compared with the original model; the compression, which is not the
original, with itself where an equality is asked for.
"""

import copy
import math
import re
import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM

import convert
from convert.mla.causal_lm import MLAForCausalLM

from conftest import TINY_LLAMA, TokenDataset, hf_model, random_ids, rel_err

VARIANTS = ["absorbed", "factored", "compressed", "disk"]
EXACT = ["absorbed", "factored", "disk"]
LAYOUTS = ["absorbed", "factored"]
# The MLA projections of each layout (convert/mla/attention.py: MLAAttention), LoRA's targets
PROJECTIONS = {
    "absorbed": ["q_absorbed", "o_absorbed", "k_down", "v_down"],
    "factored": ["q_proj", "k_up", "v_up", "o_proj", "k_down", "v_down"],
}


def _calib_ids() -> torch.Tensor:
    return torch.randint(0, 128, (1, 256), generator=torch.Generator().manual_seed(7))


@pytest.fixture(scope="module")
def original():
    """The shipped tiny Llama (GQA 4:2) as transformers loads it."""
    return AutoModelForCausalLM.from_pretrained(TINY_LLAMA).eval()


@pytest.fixture(scope="module")
def disk_checkpoints(tmp_path_factory) -> dict:
    """`convert.gqa2mla` of the tiny Llama, once per layout (None: the default layout)."""
    root = tmp_path_factory.mktemp("converted")
    out = {}
    for layout in [None, *LAYOUTS]:
        options = {} if layout is None else {"layout": layout}
        out[layout] = convert.gqa2mla(TINY_LLAMA, root / str(layout), verify=False, progress=False, **options).output
    return out


@pytest.fixture(scope="module")
def make(original, disk_checkpoints):
    """make(variant) -> a fresh converted model of the tiny Llama (training changes it in place): each
    in-memory variant converted once per module (calibrating the compression is the slow part), then
    copied; the disk one loaded each time."""
    built = {}

    def convert_once(variant: str):
        if variant == "disk":
            model = AutoModelForCausalLM.from_pretrained(disk_checkpoints[None])
        elif variant == "compressed":
            model = convert.to_mla(original, layout="factored", kv_cache_ratio=0.5, calib=_calib_ids())
            comp = model.config.mla["compression"]
            assert comp["cache_dims"] == comp["gqa_cache_dims"] // 2
        else:
            model = convert.to_mla(original, layout=variant)
        assert type(model) is MLAForCausalLM
        return model

    def build(variant: str):
        if variant == "disk":  # loaded anew: what from_pretrained returns, not a copy
            return convert_once(variant)
        if variant not in built:
            built[variant] = convert_once(variant)
        return copy.deepcopy(built[variant])

    return build


def _attention_params(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters() if ".self_attn." in name}


def _assert_attention_moved(model, before: dict[str, torch.Tensor]) -> None:
    assert before, "no attention parameters"
    now = dict(model.named_parameters())
    still = [name for name, p in before.items() if torch.equal(now[name].detach().float(), p.float())]
    assert not still, f"attention weights not trained: {still}"


def _count_calls(module) -> list:
    calls = []
    module.register_forward_hook(lambda *_: calls.append(1))
    return calls


# ------------------------------------------------------------------ 1. transformers Trainer


def _bf16_cases():
    return [pytest.param(variant, True, id=f"{variant}-bf16") for variant in ("absorbed", "factored")]


@pytest.mark.slow
@pytest.mark.parametrize(("variant", "bf16"), [*[pytest.param(v, False, id=v) for v in VARIANTS], *_bf16_cases()])
def test_trainer_with_gradient_checkpointing_and_accumulation(make, tmp_path, variant, bf16):
    """2 optimizer steps of 2 micro-batches each: every micro-batch's attention runs twice (its
    forward, and again in the backward: checkpointing is on), every loss is finite and every
    attention weight moved. bf16: mixed precision (autocast), on CUDA where there is one, else on
    the CPU (torch's bf16 autocast)."""
    from transformers import Trainer, TrainingArguments
    from transformers.utils.generic import find_labels

    model = make(variant)
    assert find_labels(type(model)) == ["labels"]  # forward was a property: Trainer crashed here
    before = _attention_params(model)
    calls = _count_calls(model.model.layers[0].self_attn)
    args = TrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=not torch.cuda.is_available(),
        report_to=[],
        max_steps=2,
        gradient_checkpointing=True,
        gradient_accumulation_steps=2,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        bf16=bf16,
    )
    trainer = Trainer(model=model, args=args, train_dataset=TokenDataset())
    result = trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses), trainer.state.log_history
    assert math.isfinite(result.training_loss)
    assert trainer.state.global_step == 2
    assert model.model.gradient_checkpointing
    assert len(calls) == 2 * 2 * 2, len(calls)  # steps × accumulation × (forward + recomputation)
    _assert_attention_moved(model, before)


@pytest.mark.parametrize("variant", ["absorbed", "factored", "compressed"])
def test_gradient_checkpointing_gives_the_same_gradients(make, variant):
    """Recomputing each decoder layer in the backward (checkpointing) gives the gradients of an
    ordinary backward: the attention keeps no state between its forward and the recomputation."""
    grads = []
    for checkpointing in (False, True):
        model = make(variant).train()
        if checkpointing:
            model.gradient_checkpointing_enable()
        ids = random_ids(2, 16)
        mask = torch.ones_like(ids)
        mask[1, :5] = 0  # left padding
        model(input_ids=ids, attention_mask=mask, labels=ids, use_cache=False).loss.backward()
        grads.append({name: p.grad.clone() for name, p in model.named_parameters() if ".self_attn." in name})
    plain, recomputed = grads
    assert plain.keys() == recomputed.keys() and plain
    for name in plain:
        assert rel_err(recomputed[name], plain[name]) <= 1e-5, name


# ------------------------------------------------------------------ 2. TRL SFTTrainer


def _word_tokenizer():
    """A tokenizer for the tiny models' 128 ids (token `t<i>` is id i; pad 0, bos 1, eos 2): SFTTrainer
    needs one for its padding, the data being token ids already."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(128)}
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t3")),
        pad_token="t0",
        bos_token="t1",
        eos_token="t2",
        unk_token="t3",
    )


@pytest.mark.parametrize("variant", VARIANTS)
def test_trl_sft_trainer(make, tmp_path, variant):
    """TRL's SFTTrainer, 2 steps on a pre-tokenized dataset (an `input_ids` column, sequences of
    different lengths, padded by its collator): finite losses, the attention weights moved."""
    datasets = pytest.importorskip("datasets")
    from trl import SFTConfig, SFTTrainer

    gen = torch.Generator().manual_seed(1)
    rows = [torch.randint(4, 128, (n,), generator=gen).tolist() for n in (12, 16, 9, 14, 16, 11, 10, 13)]
    dataset = datasets.Dataset.from_dict({"input_ids": rows})
    model = make(variant)
    before = _attention_params(model)
    config = SFTConfig(
        output_dir=str(tmp_path),
        use_cpu=not torch.cuda.is_available(),
        report_to=[],
        max_steps=2,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
    )
    trainer = SFTTrainer(model=model, args=config, train_dataset=dataset, processing_class=_word_tokenizer())
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses), trainer.state.log_history
    assert trainer.state.global_step == 2
    _assert_attention_moved(model, before)


# ------------------------------------------------------------------ 3. PEFT LoRA


@pytest.mark.parametrize("variant", ["absorbed", "factored", "compressed"])
def test_peft_lora_trains_only_the_adapters_and_merges(make, variant):
    """LoRA on every MLA projection: forward and backward through the adapted model give gradients
    to the LoRA weights only (all of them); `merge_and_unload()` returns the MLA model with the same
    logits as the adapted one (and the adapters did change them)."""
    peft = pytest.importorskip("peft")

    model = make(variant)
    targets = PROJECTIONS["absorbed" if variant == "absorbed" else "factored"]
    attn = model.model.layers[0].self_attn
    assert all(isinstance(getattr(attn, name), torch.nn.Linear) for name in targets)
    ids = random_ids(2, 16)
    with torch.no_grad():
        base_logits = model(ids).logits
    # random B (init_lora_weights=False): the adapters change the function, so merging has work to do
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
    adapted = peft.get_peft_model(model, config)
    lora = {name for name, _ in adapted.named_parameters() if "lora_" in name}
    n_layers = len(model.model.layers)
    assert len(lora) == 2 * len(targets) * n_layers  # A and B of each target in each layer
    adapted.train()
    adapted(input_ids=ids, labels=ids).loss.backward()
    with_grad = {name for name, p in adapted.named_parameters() if p.grad is not None}
    assert with_grad == lora
    assert all(adapted.get_parameter(name).grad.abs().sum() > 0 for name in lora)
    adapted.eval()
    with torch.no_grad():
        adapted_logits = adapted(input_ids=ids).logits
        merged = adapted.merge_and_unload()
        merged_logits = merged(ids).logits
    assert type(merged) is MLAForCausalLM
    assert not any("lora_" in name for name, _ in merged.named_parameters())
    assert rel_err(adapted_logits, base_logits) > 1e-2
    assert rel_err(merged_logits, adapted_logits) <= 1e-5


# ------------------------------------------------------------------ 4. torch.compile


def _breaks_in_convert(explanation) -> list[str]:
    """The graph breaks whose reason or user frames are in the convert package."""
    found = []
    for brk in explanation.break_reasons:
        frames = [f"{frame.filename}:{frame.lineno}" for frame in brk.user_stack]
        if any("/convert/" in frame for frame in frames) or "/convert/" in brk.reason:
            found.append(f"{brk.reason.splitlines()[0]} at {frames[-3:]}")
    return found


@pytest.mark.parametrize("layout", LAYOUTS)
def test_no_graph_break_in_training_forward(make, layout):
    """`torch._dynamo.explain` of a training forward (no cache): no graph break in convert's code,
    and no warning from torch.compile about it."""
    model = make(layout).train()
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        explanation = torch._dynamo.explain(model)(random_ids(2, 16), use_cache=False)
    assert not _breaks_in_convert(explanation), _breaks_in_convert(explanation)
    ours = [str(w.message) for w in caught if "/convert/" in str(w.message) or "/convert/" in str(w.filename)]
    assert not ours, ours


def test_no_graph_break_in_factored_training(make):
    """The same inside `convert.factored_training` (the absorbed maps as their factors)."""
    model = make("absorbed").train()
    with convert.factored_training(model) as counts:
        assert counts["factored"] == 2 * len(model.model.layers)
        torch._dynamo.reset()
        explanation = torch._dynamo.explain(model)(random_ids(2, 16), use_cache=False)
    assert not _breaks_in_convert(explanation), _breaks_in_convert(explanation)


@pytest.mark.parametrize("cache_kind", ["static", "dynamic"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_no_graph_break_in_prefill_or_decode(make, layout, cache_kind):
    """A prefill and a decode step with a KV cache of latents: no graph break in convert's code
    (the absorbed decode step on the CPU folded the heads by `torch.get_num_threads()`, an int
    torch.compile cannot trace: a break in every layer of every step)."""
    from transformers import DynamicCache, StaticCache

    model = make(layout)
    cache = StaticCache(config=model.config, max_cache_len=32) if cache_kind == "static" else DynamicCache()
    ids = random_ids(2, 10)
    for step, (tokens, start) in enumerate([(ids, 0), (ids[:, -1:], 10)]):
        positions = torch.arange(start, start + tokens.shape[1])
        torch._dynamo.reset()
        with torch.no_grad():
            explanation = torch._dynamo.explain(model)(
                tokens, cache=cache, use_cache=True, position_ids=positions[None].expand(2, -1)
            )
        assert not _breaks_in_convert(explanation), (step, _breaks_in_convert(explanation))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_compiled_model_equals_eager(make, layout):
    """`torch.compile` (inductor): the same logits as eager, to 1e-5."""
    model = make(layout)
    ids = random_ids(2, 16)
    torch._dynamo.reset()
    compiled = torch.compile(model)
    with torch.no_grad():
        eager = model(ids, use_cache=False).logits
        got = compiled(ids, use_cache=False).logits
    assert rel_err(got, eager) <= 1e-5


@pytest.mark.parametrize("layout", LAYOUTS)
def test_generate_with_a_fullgraph_compiled_static_cache(original, make, layout):
    """generate's own compilation of the decode step (static cache, `fullgraph=True`, which our
    `_can_compile_fullgraph` promises; transformers does it on its own on GPUs, asked here on the CPU
    with dynamo's eager backend): the original's greedy tokens."""
    from transformers import CompileConfig

    model = make(layout)
    compile_config = CompileConfig(fullgraph=True, backend="eager")
    compile_config._compile_all_devices = True  # transformers compiles on its own only on GPUs
    kwargs = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": 0, "cache_implementation": "static"}
    torch._dynamo.reset()
    got = model.generate(random_ids(1, 8), compile_config=compile_config, **kwargs)
    assert torch.equal(got, original.generate(random_ids(1, 8), **kwargs))


# ------------------------------------------------------------------ 5. generate with every cache implementation


def _prompts():
    """A single prompt with no mask, and a batch of 2 whose second row is left-padded by 3."""
    ids = random_ids(2, 8, seed=5).clamp(min=3)
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = 0, 0
    return [{"input_ids": ids[:1]}, {"input_ids": ids, "attention_mask": mask}]


def _generate(model, cache_implementation, prompt, **options):
    """Greedy tokens, or the exception generate raised (type and message)."""
    kwargs = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0, **options}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # deprecated implementations' warnings
            return model.generate(**prompt, cache_implementation=cache_implementation, **kwargs)
    except Exception as err:  # compared with the original's failure
        return f"{type(err).__name__}: {err}"


@pytest.fixture(scope="module")
def generations():
    """generations(name, model, cache_implementation, **options) -> `_generate` on each prompt, computed
    once per module for each name (the reference models' outputs serve every variant's test)."""
    memo = {}

    def run(name, model, cache_implementation, **options):
        key = (name, cache_implementation, tuple(sorted(options.items())))
        if key not in memo:
            memo[key] = [_generate(model, cache_implementation, prompt, **options) for prompt in _prompts()]
        return memo[key]

    return run


def _assert_same_or_skip(got: list, want: list, original_outcome, cache_implementation: str) -> None:
    """Per prompt: `got` (greedy tokens or an error) equal to `want`; where `got` is an error, a skip
    if the original fails the same way (CUDA-only offloading on a CPU, optimum-quanto missing: not
    the conversion's), else a failure."""
    for i, (g, w) in enumerate(zip(got, want)):
        if isinstance(g, str):
            if original_outcome()[i] == g:
                pytest.skip(f"the original model fails the same way: {g.splitlines()[0]}")
            pytest.fail(f"{cache_implementation}: the converted model fails, the original does not: {g}")
        assert isinstance(w, torch.Tensor), w
        assert torch.equal(g, w), (cache_implementation, list(_prompts()[i]), g, w)


def _cache_implementations() -> tuple[str, ...]:
    from transformers.generation.configuration_utils import ALL_CACHE_IMPLEMENTATIONS

    return tuple(ALL_CACHE_IMPLEMENTATIONS)


@pytest.mark.parametrize("cache_implementation", _cache_implementations())
@pytest.mark.parametrize("variant", EXACT)
def test_generate_with_every_cache_implementation(original, make, generations, variant, cache_implementation):
    """Greedy tokens identical to the original's with the same cache implementation, for a single
    prompt and a left-padded batch."""
    want = generations("original", original, cache_implementation)
    got = [_generate(make(variant), cache_implementation, prompt) for prompt in _prompts()]
    _assert_same_or_skip(got, want, lambda: want, cache_implementation)


@pytest.mark.parametrize("cache_implementation", _cache_implementations())
def test_compressed_generates_alike_with_every_cache_implementation(original, make, generations, cache_implementation):
    """The compression is not the original: with each cache implementation its greedy tokens equal
    its own without a cache (every step recomputed from the tokens)."""
    model = make("compressed")
    want = generations("compressed", model, None, use_cache=False)  # the compression is deterministic
    got = [_generate(model, cache_implementation, prompt) for prompt in _prompts()]
    _assert_same_or_skip(
        got, want, lambda: generations("original", original, cache_implementation), cache_implementation
    )


@pytest.mark.parametrize("cache_implementation", ["dynamic", "static"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("family", ["qwen2", "mistral", "gemma2", "gemma3_text"])
def test_generate_other_families(generations, family, layout, cache_implementation):
    """Attention biases (Qwen2), a sliding window (Mistral), soft-capping and alternating sliding
    layers (Gemma 2), q/k norms and a local RoPE base (Gemma 3): the original's greedy tokens with
    a dynamic and a static cache (a static one holds empty slots past the prompt at the prefill)."""
    model = hf_model(family)
    want = generations(family, model, cache_implementation)
    got = [_generate(convert.to_mla(model, layout=layout), cache_implementation, prompt) for prompt in _prompts()]
    _assert_same_or_skip(got, want, lambda: want, cache_implementation)


# ------------------------------------------------------------------ 6. output_attentions


@pytest.mark.parametrize("variant", EXACT)
def test_output_attentions_equal_the_originals_eager_weights(make, variant):
    """`output_attentions=True`: one (B, H, L, S) tensor per layer, equal (1e-5) to the original's
    eager attention weights on every real query of a left-padded batch; a padded query's row is
    finite (nothing NaN to spread). The original is loaded after the conversion, as a user comparing
    them would: transformers registers the family's recorded classes anew with each model it builds."""
    converted = make(variant)
    eager = AutoModelForCausalLM.from_pretrained(TINY_LLAMA, attn_implementation="eager").eval()
    _assert_attentions_equal(eager, converted)


@pytest.mark.parametrize("family", ["qwen2", "gemma2"])
def test_output_attentions_other_families(family):
    """The same for attention biases (Qwen2) and soft-capped, alternating sliding-window layers (Gemma 2)."""
    for layout in LAYOUTS:
        converted = convert.to_mla(hf_model(family), layout=layout)
        eager = hf_model(family)  # built after the conversion
        eager.config._attn_implementation = "eager"
        _assert_attentions_equal(eager, converted)


def _assert_attentions_equal(eager, converted):
    ids = random_ids(2, 12)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    with torch.no_grad():
        want = eager(ids, attention_mask=mask, output_attentions=True).attentions
        got = converted(ids, attention_mask=mask, output_attentions=True).attentions
    n_layers, heads = eager.config.num_hidden_layers, eager.config.num_attention_heads
    assert got is not None and len(got) == len(want) == n_layers
    real = mask.bool()  # (B, L): the queries that are tokens
    for layer, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape == (2, heads, 12, 12), (layer, g.shape)
        assert torch.isfinite(g).all(), layer
        g, w = g.permute(0, 2, 1, 3)[real], w.permute(0, 2, 1, 3)[real]  # (real queries, H, S)
        assert (g - w).abs().max() <= 1e-5, (layer, float((g - w).abs().max()))


# ------------------------------------------------------------------ 7. device_map="auto"


def _decoder_layer_split(device_map: dict) -> list[str]:
    """The device-map entries that are parts of a decoder layer (deeper than `model.layers.<i>`)."""
    return [name for name in device_map if re.match(r"model\.layers\.\d+\.", name)]


@pytest.mark.parametrize("layout", [None, *LAYOUTS])
def test_device_map_auto(original, disk_checkpoints, tmp_path, layout):
    """`from_pretrained(out, device_map="auto")` gives the same logits; `_no_split_modules` names the
    family's decoder layer class, and accelerate's device map keeps each decoder layer whole on a
    budget that would split one (it does without the class), and loads and runs so offloaded."""
    from accelerate import infer_auto_device_map
    from accelerate.utils import compute_module_sizes

    out = disk_checkpoints[layout]
    plain = AutoModelForCausalLM.from_pretrained(out)
    auto = AutoModelForCausalLM.from_pretrained(out, device_map="auto")
    ids = random_ids(2, 12)
    with torch.no_grad():
        want = plain(ids).logits
        assert torch.equal(auto(ids).logits.to(want.device), want)
        assert rel_err(want, original(ids).logits) <= 1e-5
    layer_class = type(plain.model.layers[0]).__name__
    assert layer_class == "LlamaDecoderLayer" and layer_class in plain._no_split_modules

    sizes = compute_module_sizes(plain)
    budget = sizes["model.embed_tokens"] + sizes["model.layers.0"] + sizes["model.layers.1"] // 2
    max_memory = {"cpu": budget, "disk": 1 << 30}
    split = infer_auto_device_map(plain, max_memory=max_memory, no_split_module_classes=[])
    assert _decoder_layer_split(split), split  # the budget does cut through a layer
    whole = infer_auto_device_map(plain, max_memory=max_memory, no_split_module_classes=list(plain._no_split_modules))
    assert not _decoder_layer_split(whole), whole
    assert len(set(whole.values())) > 1, whole

    offloaded = AutoModelForCausalLM.from_pretrained(
        out, device_map="auto", max_memory={"cpu": budget}, offload_folder=str(tmp_path / "offload")
    )
    assert len(set(offloaded.hf_device_map.values())) > 1 and not _decoder_layer_split(offloaded.hf_device_map)
    with torch.no_grad():  # offloaded (hooked) projections run whole, not in chunks of heads: the
        # same products summed in another order (tests/mla/test_head_chunks.py)
        assert rel_err(offloaded(ids).logits, want) <= 1e-6
    kwargs = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    assert torch.equal(offloaded.generate(ids[:1], **kwargs), plain.generate(ids[:1], **kwargs))


def test_no_split_modules_name_each_familys_decoder_layer():
    for family in ("qwen2", "gemma2", "mixtral"):
        model = convert.to_mla(hf_model(family), layout="absorbed")
        assert type(model.model.layers[0]).__name__ in model._no_split_modules, family


# ------------------------------------------------------------------ 8. save_pretrained, Auto reload


@pytest.mark.parametrize("variant", VARIANTS)
def test_save_pretrained_then_auto_reload(make, tmp_path, variant):
    """A trained step, `save_pretrained`, then `AutoModelForCausalLM.from_pretrained`: the same
    class, the trained weights and logits, the same greedy tokens; and `load_mla_model` reads it."""
    model = make(variant).train()
    ids = random_ids(2, 12)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    model.eval()
    model.save_pretrained(tmp_path / "saved")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    assert type(reloaded) is MLAForCausalLM
    want = model.state_dict()
    got = reloaded.state_dict()
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
    with torch.no_grad():
        logits = model(ids).logits
        assert torch.equal(reloaded(ids).logits, logits)
        assert torch.equal(convert.load_mla_model(tmp_path / "saved")(ids).logits, logits)
    kwargs = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": 0}
    assert torch.equal(reloaded.generate(ids[:1], **kwargs), model.generate(ids[:1], **kwargs))


# ------------------------------------------------------------------ 9. accelerate


@pytest.mark.parametrize("variant", VARIANTS)
def test_accelerator_prepare_and_train_step(make, variant):
    """`accelerate.Accelerator(cpu=True)`: prepare the model, optimizer and data loader, one step
    with `accelerator.backward`: a finite loss, the attention weights moved, the unwrapped model
    is the MLA model."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    model = make(variant).train()
    before = _attention_params(model)
    accelerator = Accelerator(cpu=True)
    try:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        loader = torch.utils.data.DataLoader(TokenDataset(), batch_size=4)
        prepared, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        batch = next(iter(loader))
        loss = prepared(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        assert math.isfinite(loss.item())
        assert accelerator.unwrap_model(prepared) is model
        _assert_attention_moved(model, before)
    finally:
        accelerator.free_memory()
        AcceleratorState._reset_state(True)
