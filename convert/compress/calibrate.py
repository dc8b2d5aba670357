"""Calibration: second moments of the inputs that really reach each attention layer."""

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from convert.stream import LayerStream, layer_output
from convert.text import batched_windows


@dataclass
class LayerStats:
    """E[x xᵀ] and E[x] of a layer's attention inputs x (post-norm hidden states), float64,
    and for the Fisher method the gradient second moments of its key and value outputs."""

    moment: torch.Tensor  # (D, D)
    mean: torch.Tensor  # (D,)
    key_fisher: torch.Tensor | None = None  # (G·d, G·d) E[g gᵀ], g = ∂loss/∂k (q/k norm: ∂loss/∂n) (fisher)
    value_fisher: torch.Tensor | None = None  # (G·d, G·d) E[g gᵀ], g = ∂loss/∂v
    normed_key_moment: torch.Tensor | None = None  # q/k norm: (G·d, G·d) E[n nᵀ], n the normed keys
    rotation_fit: torch.Tensor | None = None  # vllm target: (H, 2, d/2, 2) (convert.targets.vllm.nope_fit)
    output_moment: torch.Tensor | None = None  # vllm target, o_proj bias: (H·d, H·d) E[o oᵀ] of the attention output
    output_mean: torch.Tensor | None = None  # (H·d,) E[o]

    def augmented(self) -> torch.Tensor:
        """Second moment of [x; 1] (D+1, D+1), for affine maps (a bias as an extra column)."""
        top = torch.cat([self.moment, self.mean[:, None]], dim=1)
        bottom = torch.cat([self.mean, torch.ones(1, dtype=self.mean.dtype)])[None]
        return torch.cat([top, bottom])


@dataclass(frozen=True)
class CalibrationRun:
    """How the original model runs over the calibration text, streamed a decoder layer at a
    time: in rows of `window` tokens, on `device`, in `dtype`."""

    window: int = 1024
    device: str | torch.device = "cpu"
    dtype: torch.dtype = torch.float32


def calibrate(
    checkpoint,
    config: dict,
    token_ids: torch.Tensor,
    n_layers: int,
    run: CalibrationRun = CalibrationRun(),
    progress=iter,
    observe=None,
) -> list[LayerStats]:
    """Stream the original model over `token_ids` (1, N) and collect every layer's input moments.

    observe: called as observe(layer, x, decoder, (positions, rotary, mask), stats) after each
    layer's moments, to add what a target needs of the same pass (x (B, L, D) its normed inputs)."""
    rows = batched_windows(token_ids, min(run.window, token_ids.shape[-1]))  # (B, L)
    stream = LayerStream(checkpoint, config, torch.device(run.device), run.dtype)
    stats = []
    for index, x, decoder, inputs in stream.run(rows, n_layers, progress):
        flat = x.reshape(-1, x.shape[-1]).double().cpu()  # (B·L, D)
        layer = LayerStats(flat.T @ flat / flat.shape[0], flat.mean(0))
        if hasattr(decoder.self_attn, "k_norm"):
            with torch.no_grad():
                n = normed_keys(decoder.self_attn, x).double().cpu()  # (B·L, G·d)
            layer.normed_key_moment = n.T @ n / n.shape[0]
        if observe is not None:
            with torch.no_grad():
                observe(index, x, decoder, inputs, layer)
        stats.append(layer)
    return stats


def normed_keys(attention: Any, x: torch.Tensor) -> torch.Tensor:
    """The q/k-normed keys n of a transformers attention module (Qwen3, Gemma 3, OLMo 2) for
    inputs x (…, D): (N, G·d), heads in the source's order, before RoPE."""
    k = attention.k_proj(x.reshape(-1, x.shape[-1]))  # (N, G·d)
    norm = attention.k_norm
    if norm.weight.numel() == k.shape[-1]:  # over the whole projection (OLMo 2)
        return norm(k)
    return norm(k.unflatten(-1, (-1, norm.weight.numel()))).flatten(-2)  # per head: (N, G, d) -> (N, G·d)


def fisher_calibrate(model, token_ids: torch.Tensor, window: int = 1024, progress=iter) -> list[LayerStats]:
    """Input moments plus the Fisher information of each layer's key and value outputs.

    One forward and backward pass of the whole original model (a transformers
    causal LM) over `token_ids` (1, N). For keys k = W^K y, the loss change of an
    error Δk is ≈ ½ E[(gᵀ Δk)²] with g = ∂loss/∂k; factored as
    E[g gᵀ] ⊗ E[y yᵀ] (K-FAC), the weighted SVD of E[g gᵀ]^{1/2} W E[y yᵀ]^{1/2}
    orders components by the loss they carry, comparable across every layer.
    """
    rows = batched_windows(token_ids, min(window, token_ids.shape[-1]))  # (B, L)
    layers = model.model.layers
    acc = [_accumulator(layer.self_attn.o_proj.out_features) for layer in layers]
    hooks = [h for layer, a in zip(layers, acc) for h in _fisher_hooks(layer.self_attn, a)]
    # only activations' gradients are wanted: no weight gradients (a model's worth of memory, and
    # half the backward's work); they flow from the embeddings, which require one
    trainable = [p for p in model.parameters() if p.requires_grad]
    try:
        for p in trainable:
            p.requires_grad_(False)
        for row in progress(rows):
            ids = row[None]  # (1, L)
            embeds = model.model.embed_tokens(ids).detach().requires_grad_(True)
            summed_loss(model, embeds, ids).backward()
    finally:
        for h in hooks:
            h.remove()
        for p in trainable:
            p.requires_grad_(True)
    return [_layer_stats(a) for a in acc]


def fisher_calibrate_streamed(
    checkpoint,
    config: dict,
    token_ids: torch.Tensor,
    n_layers: int,
    run: CalibrationRun = CalibrationRun(),
    progress=iter,
) -> list[LayerStats]:
    """`fisher_calibrate`'s statistics without the whole model in memory: the original model's
    decoder layers are read one at a time from `checkpoint`, forward (keeping each layer's input
    hidden states), then the loss's gradient through the final norm and the lm_head in
    vocabulary chunks, then backward from the last layer to the first, each layer rebuilt and
    re-run on its stored input. The same K-FAC statistics (in `run.dtype`, float32 by default as the
    whole model computes them; its loss gradient a little closer to float64's, since the whole
    model's cross-entropy on float32 logits cancels in p − 1 at confident tokens). Memory: one
    decoder layer, one vocabulary chunk, and n_layers × tokens × D hidden states
    (bench/calib_memory.py measures it)."""
    rows = batched_windows(token_ids, min(run.window, token_ids.shape[-1]))  # (B, L)
    stream = LayerStream(checkpoint, config, torch.device(run.device), run.dtype)
    stored = []  # each layer's input hidden states (B, L, D)
    hidden = stream.embed(rows)
    with torch.no_grad():
        for layer in progress(range(n_layers)):
            stored.append(hidden)
            hidden = _run_decoder(stream, stream.decoder(layer), layer, hidden)
    hidden = hidden.detach().requires_grad_(True)
    normed = stream.final_norm()(hidden)  # (B, L, D)
    (grad,) = torch.autograd.grad(normed, hidden, _loss_grad(stream, normed.detach(), rows))
    acc = []
    for layer in progress(reversed(range(n_layers))):
        decoder: Any = stream.decoder(layer).requires_grad_(False)  # its modules read by name (`_fisher_hooks`)
        acc.append(_accumulator(decoder.self_attn.o_proj.out_features))  # D
        hooks = _fisher_hooks(decoder.self_attn, acc[-1])
        x = stored.pop().requires_grad_(True)
        try:
            (grad,) = torch.autograd.grad(_run_decoder(stream, decoder, layer, x), x, grad)
        finally:
            for h in hooks:
                h.remove()
    return [_layer_stats(a) for a in reversed(acc)]


def _run_decoder(stream: LayerStream, decoder, layer: int, hidden: torch.Tensor) -> torch.Tensor:
    positions, rotary, mask = stream.inputs(layer, hidden)
    return layer_output(decoder(hidden, attention_mask=mask, position_embeddings=rotary, position_ids=positions))


def _loss_grad(stream: LayerStream, normed: torch.Tensor, rows: torch.Tensor, chunk: int = 8192) -> torch.Tensor:
    """∂(summed next-token loss)/∂(final normed hidden states) (B, L, D), the lm_head read `chunk`
    rows at a time: a first pass for each token's logsumexp, a second for softmax − one-hot
    times the rows (through the soft-cap's derivative where there is one). The last token of
    each row predicts nothing."""
    name, cap = stream.head_name(), stream.final_softcap
    h = normed.reshape(-1, normed.shape[-1]).to(torch.promote_types(normed.dtype, torch.float32))  # (N, D)
    targets = torch.cat([rows[:, 1:], torch.full_like(rows[:, :1], -1)], 1).reshape(-1)  # (N,), -1: none
    vocab = stream.checkpoint.shape(name)[0]
    read = stream.checkpoint.read_rows

    def logits(start: int):
        w = read(name, start, min(start + chunk, vocab)).to(h.device, h.dtype)  # (C, D)
        z = h @ w.T  # (N, C)
        return w, z, (torch.tanh(z / cap) * cap if cap is not None else z)

    lse = torch.full((h.shape[0],), float("-inf"), device=h.device, dtype=h.dtype)
    for start in range(0, vocab, chunk):
        lse = torch.logaddexp(lse, torch.logsumexp(logits(start)[2], -1))
    grad = torch.zeros_like(h)
    for start in range(0, vocab, chunk):
        w, z, capped = logits(start)
        p = torch.exp(capped - lse[:, None])  # (N, C) softmax
        inside = (targets >= start) & (targets < start + w.shape[0])
        p[inside.nonzero()[:, 0], targets[inside] - start] -= 1.0
        if cap is not None:
            p = p * (1 - torch.tanh(z / cap) ** 2)
        grad += p @ w
    grad[targets < 0] = 0.0
    return grad.reshape(normed.shape).to(normed.dtype)


def _accumulator(dim: int) -> dict:
    return {
        "moment": torch.zeros(dim, dim, dtype=torch.float64),
        "sum": torch.zeros(dim, dtype=torch.float64),
        "key": 0,
        "value": 0,
        "tokens": 0,
    }


def _fisher_hooks(attention: Any, acc: dict) -> list:
    """The hooks that accumulate a layer's input moments and its K/V output gradients' E[g gᵀ]
    (`attention`: a transformers attention module, its projections read by name)."""
    if hasattr(attention, "k_norm"):  # q/k norm: the keys that matter are the normed ones, n
        keys = [
            _hook(attention.k_proj, acc, None, inputs=True),
            _normed_key_hook(attention.k_norm, acc, attention.k_proj.out_features),
        ]
    elif hasattr(attention, "qkv_proj"):  # fused (Phi-3): output rows [q (H·d) | k (G·d) | v (G·d)]
        queries = attention.config.num_attention_heads * attention.head_dim
        keys = attention.config.num_key_value_heads * attention.head_dim
        return [
            _hook(attention.qkv_proj, acc, "key", inputs=True, rows=slice(queries, queries + keys)),
            _hook(attention.qkv_proj, acc, "value", inputs=False, rows=slice(queries + keys, None)),
        ]
    else:
        keys = [_hook(attention.k_proj, acc, "key", inputs=True)]
    return keys + [_hook(attention.v_proj, acc, "value", inputs=False)]


def _layer_stats(a: dict) -> LayerStats:
    return LayerStats(
        a["moment"] / a["tokens"],
        a["sum"] / a["tokens"],
        key_fisher=a["key"] / a["tokens"],
        value_fisher=a["value"] / a["tokens"],
        normed_key_moment=a["normed"] / a["tokens"] if "normed" in a else None,
    )


#: Tokens per chunk of the calibration loss: (chunk × vocab) logits live at once, not (window × vocab).
LOSS_CHUNK = 128


def summed_loss(model, embeds: torch.Tensor, ids: torch.Tensor, chunk: int | None = None) -> torch.Tensor:
    """The next-token loss of a transformers causal LM, summed over the tokens of `ids` (1, L),
    as `model(inputs_embeds=embeds, labels=ids)` computes it (float32 logits, a final soft-cap
    where the config has one), but in chunks of `chunk` tokens whose logits are recomputed in
    the backward pass: the whole window's (L × vocab) logits never exist (Gemma: 262k per token).
    chunk: default `LOSS_CHUNK`."""
    chunk = chunk or LOSS_CHUNK
    hidden = model.model(inputs_embeds=embeds).last_hidden_state  # (1, L, D)
    cap = getattr(model.config, "final_logit_softcapping", None)

    def chunk_loss(h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = model.lm_head(h).float()  # (1, C, V)
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")

    length = ids.shape[-1]
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, length - 1, chunk):
        end = min(start + chunk, length - 1)
        total = total + checkpoint(chunk_loss, hidden[:, start:end], ids[:, start + 1 : end + 1], use_reentrant=False)
    return total


def _hook(linear: torch.nn.Module, acc: dict, name: str | None, inputs: bool, rows: slice = slice(None)):
    """Accumulate the input moments (once per layer) and E[g gᵀ] of the output's gradient
    (under `name`; None: no gradient), on the output's `rows` (a fused projection's part)."""

    def forward_hook(module, args, output):
        if inputs:
            flat = args[0].detach().reshape(-1, args[0].shape[-1]).double()  # (B·L, D)
            acc["moment"] += flat.T @ flat
            acc["sum"] += flat.sum(0)
            acc["tokens"] += flat.shape[0]
        if name is None:
            return

        def grad_hook(grad):
            g = grad.detach()[..., rows]
            g = g.reshape(-1, g.shape[-1]).double()  # (B·L, G·d)
            acc[name] = acc[name] + g.T @ g

        output.register_hook(grad_hook)

    return linear.register_forward_hook(forward_hook)


def _normed_key_hook(norm: torch.nn.Module, acc: dict, width: int):
    """Accumulate E[n nᵀ] of a k norm's output n and E[g gᵀ] of g = ∂loss/∂n (as "key"), both
    (G·d, G·d) in head order. Qwen3 and OLMo 2 norm (B, L, G, d) / (B, L, G·d); Gemma 3 norms
    after moving heads first, (B, G, L, d)."""

    def flat(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 4 and t.shape[-1] * t.shape[1] == width and t.shape[2] * t.shape[-1] != width:
            t = t.transpose(1, 2)  # (B, G, L, d) -> (B, L, G, d)
        return t.detach().reshape(-1, width).double()  # (B·L, G·d)

    def forward_hook(module, args, output):
        n = flat(output)
        acc["normed"] = acc.get("normed", 0) + n.T @ n

        def grad_hook(grad):
            g = flat(grad)
            acc["key"] = acc["key"] + g.T @ g

        output.register_hook(grad_hook)

    return norm.register_forward_hook(forward_hook)
