"""Calibration: second moments of the inputs that really reach each attention layer."""

from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from convert.stream import LayerStream


@dataclass
class LayerStats:
    """E[x xᵀ] and E[x] of a layer's attention inputs x (post-norm hidden states), float64,
    and for the Fisher method the gradient second moments of its key and value outputs."""

    moment: torch.Tensor  # (D, D)
    mean: torch.Tensor  # (D,)
    key_fisher: torch.Tensor | None = None  # (G·d, G·d) E[g gᵀ], g = ∂loss/∂k (q/k norm: ∂loss/∂n) (fisher)
    value_fisher: torch.Tensor | None = None  # (G·d, G·d) E[g gᵀ], g = ∂loss/∂v
    normed_key_moment: torch.Tensor | None = None  # q/k norm: (G·d, G·d) E[n nᵀ], n the normed keys

    def augmented(self) -> torch.Tensor:
        """Second moment of [x; 1] (D+1, D+1), for affine maps (a bias as an extra column)."""
        top = torch.cat([self.moment, self.mean[:, None]], dim=1)
        bottom = torch.cat([self.mean, torch.ones(1, dtype=self.mean.dtype)])[None]
        return torch.cat([top, bottom])


def windows(token_ids: torch.Tensor, window: int) -> torch.Tensor:
    """(1, N) ids -> (N // window, window) rows (the tail that does not fill a window is dropped)."""
    n = token_ids.shape[-1] // window * window
    return token_ids[0, :n].reshape(-1, window)


def calibrate(
    checkpoint,
    config: dict,
    token_ids: torch.Tensor,
    n_layers: int,
    window: int = 1024,
    device="cpu",
    dtype=torch.float32,
    progress=iter,
) -> list[LayerStats]:
    """Stream the original model over `token_ids` (1, N) and collect every layer's input moments."""
    rows = windows(token_ids, min(window, token_ids.shape[-1]))  # (B, L)
    stream = LayerStream(checkpoint, config, torch.device(device), dtype)
    stats = []
    for _, x, decoder, _ in stream.run(rows, n_layers, progress):
        flat = x.reshape(-1, x.shape[-1]).double().cpu()  # (B·L, D)
        layer = LayerStats(flat.T @ flat / flat.shape[0], flat.mean(0))
        if hasattr(decoder.self_attn, "k_norm"):
            with torch.no_grad():
                n = normed_keys(decoder.self_attn, x).double().cpu()  # (B·L, G·d)
            layer.normed_key_moment = n.T @ n / n.shape[0]
        stats.append(layer)
    return stats


def normed_keys(attention: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
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
    rows = windows(token_ids, min(window, token_ids.shape[-1]))  # (B, L)
    layers = model.model.layers
    dim = layers[0].self_attn.k_proj.in_features
    acc = [
        {
            "moment": torch.zeros(dim, dim, dtype=torch.float64),
            "sum": torch.zeros(dim, dtype=torch.float64),
            "key": 0,
            "value": 0,
            "tokens": 0,
        }
        for _ in layers
    ]
    hooks = []
    for i, layer in enumerate(layers):
        attention = layer.self_attn
        if hasattr(attention, "k_norm"):  # q/k norm: the keys that matter are the normed ones, n
            hooks.append(_hook(attention.k_proj, acc[i], None, inputs=True))
            hooks.append(_normed_key_hook(attention.k_norm, acc[i], attention.k_proj.out_features))
        else:
            hooks.append(_hook(attention.k_proj, acc[i], "key", inputs=True))
        hooks.append(_hook(attention.v_proj, acc[i], "value", inputs=False))
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
    return [
        LayerStats(
            a["moment"] / a["tokens"],
            a["sum"] / a["tokens"],
            key_fisher=a["key"] / a["tokens"],
            value_fisher=a["value"] / a["tokens"],
            normed_key_moment=a["normed"] / a["tokens"] if "normed" in a else None,
        )
        for a in acc
    ]


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


def _hook(linear: torch.nn.Module, acc: dict, name: str | None, inputs: bool):
    """Accumulate the input moments (once per layer) and E[g gᵀ] of the output's gradient
    (under `name`; None: no gradient)."""

    def forward_hook(module, args, output):
        if inputs:
            flat = args[0].detach().reshape(-1, args[0].shape[-1]).double()  # (B·L, D)
            acc["moment"] += flat.T @ flat
            acc["sum"] += flat.sum(0)
            acc["tokens"] += flat.shape[0]
        if name is None:
            return

        def grad_hook(grad):
            g = grad.detach().reshape(-1, grad.shape[-1]).double()  # (B·L, G·d)
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
