"""The attention's own operators (`convert.mla.latent_rope.latent_rope`, `convert.mla.kernels.merged_value_heads`):
the values and gradients of the traced code they stand for, bit for bit; torch.library's own checks
(schemas, fake tensors, autograd, AOT dispatch); and that a compiled absorbed compression reaches
Inductor through them, with no graph break and eager's loss and gradients."""

import pytest
import torch
from transformers import AutoModelForCausalLM

import convert
from convert.mla.kernels import merge_heads, merged_value_heads, merged_value_heads_backward
from convert.mla.latent_rope import latent_rope, latent_rope_backward
from convert.rope.rotation import apply_rope, latent_cos_sin

from conftest import TINY_LLAMA, random_ids, rel_err

FREQS = torch.tensor([0, 3, 5, 1])  # 4 latent pairs' source frequencies (of d/2 = 6)


def _angles(dtype=torch.float64):
    gen = torch.Generator().manual_seed(0)
    cos = torch.randn(2, 1, 5, 12, generator=gen, dtype=dtype)  # (B, 1, L, d): the source's, d/2 = 6 frequencies
    sin = torch.randn(2, 1, 5, 12, generator=gen, dtype=dtype)
    return cos, sin


@pytest.mark.parametrize("width", [8, 11], ids=["all-rotary", "with-nope"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_latent_rope_is_the_traced_rope(width, dtype):
    """latent_rope == apply_rope(x, *latent_cos_sin(...)): the same values, memory layout and
    gradient, bit for bit (refinement's fits and their bytes go through it)."""
    cos, sin = _angles(dtype)
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(2, 5, 3 * width, generator=gen, dtype=dtype)  # (B, L, h·r): queries as the projection gives them
    x = base.view(2, 5, 3, width).transpose(1, 2).requires_grad_()  # (B, h, L, r), not contiguous
    want = apply_rope(x, *latent_cos_sin(cos, sin, FREQS))
    got = latent_rope(x, cos, sin, FREQS)
    assert torch.equal(got, want) and got.stride() == want.stride()
    grad = torch.randn(want.shape, generator=gen, dtype=dtype)
    (want_grad,) = torch.autograd.grad(want, x, grad)
    (got_grad,) = torch.autograd.grad(got, x, grad)
    assert torch.equal(got_grad, want_grad)


def test_latent_rope_in_bfloat16_with_float32_angles():
    """Autocast's mix (bf16 latents, the rotary embedding's float32 cos/sin): x's dtype kept, as before."""
    cos, sin = _angles(torch.float32)
    x = torch.randn(2, 3, 5, 11).bfloat16().requires_grad_()
    want = apply_rope(x, *latent_cos_sin(cos, sin, FREQS))
    got = latent_rope(x, cos, sin, FREQS)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    grad = torch.randn_like(want)
    assert rel_err(torch.autograd.grad(got, x, grad)[0], torch.autograd.grad(want, x, grad)[0]) <= 1e-2


@pytest.mark.slow
@pytest.mark.parametrize("width", [8, 11], ids=["all-rotary", "with-nope"])
def test_latent_rope_operators_pass_torch_library_checks(width):
    """torch.library.opcheck (schema, fake tensor, autograd registration, AOT dispatch) of both
    operators, and gradcheck/gradgradcheck (the backward's own backward is the rotation)."""
    cos, sin = _angles()
    x = torch.randn(2, 3, 5, width, dtype=torch.float64, requires_grad=True)
    torch.library.opcheck(latent_rope, (x, cos, sin, FREQS))
    torch.library.opcheck(latent_rope_backward, (x, cos, sin, FREQS))
    assert torch.autograd.gradcheck(lambda t: latent_rope(t, cos, sin, FREQS), (x,))
    assert torch.autograd.gradgradcheck(lambda t: latent_rope(t, cos, sin, FREQS), (x,))


@pytest.mark.parametrize("n_heads", [1, 3])
def test_merged_value_heads_is_the_traced_slice(n_heads):
    """merge_heads of a padded output == out[..., :f].transpose(1, 2).reshape(B, L, H·f), values
    and gradients bit for bit; an unpadded one is that reshape itself; torch.library's checks."""
    out = torch.randn(2, n_heads, 5, 8, dtype=torch.float64, requires_grad=True)  # (B, H, L, e)
    want = out[..., :6].transpose(1, 2).reshape(2, 5, n_heads * 6)
    got = merge_heads(out, 6)
    assert torch.equal(got, want) and got.is_contiguous()
    grad = torch.randn_like(want)
    assert torch.equal(torch.autograd.grad(got, out, grad)[0], torch.autograd.grad(want, out, grad)[0])
    assert torch.equal(merge_heads(out, 8), out.transpose(1, 2).reshape(2, 5, n_heads * 8))
    torch.library.opcheck(merged_value_heads, (out, 6))
    torch.library.opcheck(merged_value_heads_backward, (grad.requires_grad_(), n_heads, 8))
    assert torch.autograd.gradgradcheck(lambda t: merged_value_heads(t, 6), (out,))


@pytest.fixture(scope="module")
def absorbed_compressed(tiny_original):
    """The tiny Llama absorbed at half the cache (ranks r_K != r_V: padded values, merged heads)."""
    calib = torch.randint(0, 128, (1, 256), generator=torch.Generator().manual_seed(7))
    model = convert.to_mla(tiny_original, layout="absorbed", kv_cache_ratio=0.5, calib=calib)
    ranks = [(layer.self_attn.rank_k, layer.self_attn.rank_v) for layer in model.model.layers]
    assert any(rank_v < rank_k for rank_k, rank_v in ranks), ranks  # some layer pads its values
    return model


@pytest.fixture(scope="module")
def tiny_original():
    return AutoModelForCausalLM.from_pretrained(TINY_LLAMA).eval()


@pytest.mark.slow
def test_compiled_absorbed_compression_reaches_inductor_through_the_operators(absorbed_compressed):
    """A training forward of an absorbed compression traced whole (`fullgraph=True`): every layer's
    latent RoPE (queries and keys) and padded output reach the compiler as the operators, and
    Inductor's loss and gradients equal eager's."""
    model = absorbed_compressed.train()
    ids = random_ids(2, 16)
    graphs = []

    def recording(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=recording, fullgraph=True)(input_ids=ids, labels=ids, use_cache=False)
    targets = [node.target for gm in graphs for node in gm.graph.nodes if node.op == "call_function"]
    attentions = [layer.self_attn for layer in model.model.layers]
    assert targets.count(torch.ops.convert.latent_rope.default) == 2 * len(attentions)  # queries and keys
    padded = sum(a.rank_v < a.rank_k for a in attentions)  # the layers whose values SDPA gets padded
    assert targets.count(torch.ops.convert.merged_value_heads.default) == padded
    assert torch.index_select not in targets  # the latent's gather runs inside latent_rope

    def loss_and_grads(m):
        model.zero_grad(set_to_none=True)
        loss = m(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    eager_loss, eager_grads = loss_and_grads(model)
    torch._dynamo.reset()
    compiled_loss, compiled_grads = loss_and_grads(torch.compile(model, fullgraph=True))
    model.zero_grad(set_to_none=True)
    model.eval()
    assert rel_err(compiled_loss, eager_loss) <= 1e-5
    assert compiled_grads.keys() == eager_grads.keys()
    worst = max(rel_err(compiled_grads[n], eager_grads[n]) for n in eager_grads)
    assert worst <= 1e-4, worst
