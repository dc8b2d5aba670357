"""The absorbed layout's query and output maps trained in factored form (`factored_training`).

At the exact rank the absorbed maps are G times the source's (docs/math.md, "Absorption"):
`Ŵ^Q_h = (W^UK_h)ᵀ W^Q_h` is r_K × D a head against W^Q_h's d × D, and `Ŵ^O_h = W^O_h W^UV_h` is
D × r_V against d. Each is of rank d, so a head's map is the product of two factors that cost,
at r = G·d, about a third of its multiplications, its gradients and its optimizer state. SmolLM2
under transformers' `Trainer` on a CPU (docs/healing.md, "Under transformers' Trainer"): trained
dense, 1.30 times the source's matmul FLOPs a step and 1.27 times its peak memory; as the
products, 1.05 and 1.04 times (the factored layout's), the step 1.07–1.16 times against 1.32–1.36.

`FactoredQuery` and `FactoredOutput` are those products. Their `state_dict` holds the dense
product under the dense module's names (`weight`, `bias`) and `load_state_dict` takes those
names, so a checkpoint written while they are in place (`save_pretrained`, a `Trainer`
checkpoint) is an ordinary absorbed checkpoint.
"""

from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from convert.mla.attention import MLAAttention

#: The share of a head's map (its Frobenius norm) that its factors may miss, times the weights'
#: machine epsilon: the rounding of a product of rank d stored in that dtype (float32 and bfloat16
#: conversions measured well under it), and far under any map trained or fitted whole.
ROUNDING_TAIL = 2.0
#: Maps with at most this many rows or columns are factored by a full SVD; larger ones by a range
#: finder (`_range`), with OVERSAMPLE dims beyond d and POWER_STEPS subspace iterations.
FULL_SVD_DIM, OVERSAMPLE, POWER_STEPS = 512, 8, 2
#: Heads factored at once (float64: one block of maps and its products in memory).
HEAD_BLOCK = 8


def _range(block: torch.Tensor, width: int) -> torch.Tensor:
    """An orthonormal basis (h, m, width) of the leading range of each map of `block` (h, m, n):
    seeded random probes, then POWER_STEPS subspace iterations (Halko, Martinsson and Tropp 2011,
    algorithm 4.4), so that the rounding beyond rank d does not tilt it."""
    probe = torch.randn(block.shape[-1], width, generator=torch.Generator().manual_seed(0), dtype=block.dtype)
    basis, _ = torch.linalg.qr(block @ probe.to(block.device))  # (h, m, width)
    for _ in range(POWER_STEPS):
        rows, _ = torch.linalg.qr(block.transpose(1, 2) @ basis)  # (h, n, width)
        basis, _ = torch.linalg.qr(block @ rows)
    return basis


def _head_factors(heads: torch.Tensor, rank: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
    """heads (H, m, n) -> left (H, m, rank), right (H, rank, n) with left @ right = heads, computed in
    float64 and cast to `dtype`, the singular values split evenly between them; None when a head's
    map is not of rank `rank` up to `dtype`'s rounding: measured, the residual of the factors'
    product against the map itself.

    A map of at most FULL_SVD_DIM rows or columns (SmolLM2's 192 × 576) is factored by its SVD, the
    best rank-`rank` fit; a larger one by its SVD within the range `_range` finds, O(m·n·rank) a
    head where a full SVD of a Llama-3-8B head's 1,024 × 4,096 map takes about a second.
    """
    n_heads, m, n = heads.shape
    left, right = heads.new_empty(n_heads, m, rank, dtype=dtype), heads.new_empty(n_heads, rank, n, dtype=dtype)
    limit = ROUNDING_TAIL * torch.finfo(dtype).eps
    for start in range(0, n_heads, HEAD_BLOCK):
        block = heads[start : start + HEAD_BLOCK].double()  # (h, m, n)
        if min(m, n) <= FULL_SVD_DIM:
            u, s, vh = torch.linalg.svd(block, full_matrices=False)
        else:
            basis = _range(block, min(rank + OVERSAMPLE, m, n))  # (h, m, width)
            u, s, vh = torch.linalg.svd(basis.transpose(1, 2) @ block, full_matrices=False)  # within it
            u = basis @ u  # (h, m, width)
        root = s[:, :rank].sqrt()
        l_block = u[:, :, :rank] * root[:, None, :]  # (h, m, rank)
        r_block = root[:, :, None] * vh[:, :rank]  # (h, rank, n)
        miss = (block - l_block @ r_block).flatten(1).norm(dim=1) / block.flatten(1).norm(dim=1).clamp_min(1e-300)
        if miss.max() > limit:
            return None
        left[start : start + HEAD_BLOCK], right[start : start + HEAD_BLOCK] = l_block, r_block
    return left, right


class FactoredQuery(nn.Module):
    """x (…, D) -> (…, H·r): `inner` (the head queries, H·d × D), then each head's `up` (H, r, d),
    and the dense map's bias. Equal to the dense `q_absorbed` it was made from (`from_dense`)."""

    def __init__(self, inner: torch.Tensor, up: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.n_heads, self.rank, self.head_dim = up.shape
        self.inner = nn.Linear(inner.shape[1], inner.shape[0], bias=False, device=inner.device, dtype=inner.dtype)
        self.inner.weight.data.copy_(inner)
        self.up = nn.Parameter(up.contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone())
        self.register_state_dict_post_hook(_dense_state)
        self.register_load_state_dict_pre_hook(_factor_state)

    @classmethod
    def from_dense(cls, linear: nn.Linear, n_heads: int, head_dim: int) -> "FactoredQuery | None":
        """The factors of `linear` (H·r × D), or None where a head's rows are not of rank `head_dim`."""
        weight = linear.weight.detach()
        factors = _head_factors(cls._heads(weight, n_heads), head_dim, weight.dtype)
        if factors is None:
            return None
        up, inner = factors  # (H, r, d), (H, d, D)
        return cls(inner.reshape(n_heads * head_dim, -1), up, linear.bias)

    def dense(self) -> torch.Tensor:
        """The dense map (H·r, D) the factors multiply to."""
        inner = self.inner.weight.view(self.n_heads, self.head_dim, -1)  # (H, d, D)
        return torch.matmul(self.up.float(), inner.float()).flatten(0, 1).to(self.up.dtype)  # rounded once

    @staticmethod
    def _heads(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
        """The dense map (H·r, D) as its heads' maps (H, r, D)."""
        return weight.view(n_heads, -1, weight.shape[1])

    def _set_dense(self, weight: torch.Tensor) -> bool:
        factors = _head_factors(self._heads(weight, self.n_heads), self.head_dim, self.up.dtype)
        if factors is None:
            return False
        with torch.no_grad():
            self.up.copy_(factors[0])
            self.inner.weight.copy_(factors[1].flatten(0, 1))
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.inner(x).unflatten(-1, (self.n_heads, self.head_dim))  # (…, H, d)
        out = torch.einsum("...hd,hrd->...hr", q, self.up).flatten(-2)  # (…, H·r)
        return out if self.bias is None else out + self.bias


class FactoredOutput(nn.Module):
    """o (…, H·r) -> (…, D): each head's `down` (H, d, r), then `outer` (D × H·d, with the dense map's
    bias). Equal to the dense `o_absorbed` it was made from (`from_dense`)."""

    def __init__(self, down: torch.Tensor, outer: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.n_heads, self.head_dim, self.rank = down.shape
        self.down = nn.Parameter(down.contiguous())
        self.outer = nn.Linear(
            outer.shape[1], outer.shape[0], bias=bias is not None, device=outer.device, dtype=outer.dtype
        )
        with torch.no_grad():
            self.outer.weight.copy_(outer)
            if bias is not None:
                self.outer.bias.copy_(bias)
        self.register_state_dict_post_hook(_dense_state)
        self.register_load_state_dict_pre_hook(_factor_state)

    @property
    def bias(self) -> torch.Tensor | None:
        """The dense map's bias (the outer map's)."""
        return self.outer.bias

    @classmethod
    def from_dense(cls, linear: nn.Linear, n_heads: int, head_dim: int) -> "FactoredOutput | None":
        """The factors of `linear` (D × H·r), or None where a head's columns are not of rank `head_dim`."""
        weight = linear.weight.detach()
        factors = _head_factors(cls._heads(weight, n_heads), head_dim, weight.dtype)
        if factors is None:
            return None
        outer, down = factors  # (H, D, d), (H, d, r)
        return cls(down, outer.transpose(0, 1).flatten(1), linear.bias)  # outer: (D, H·d)

    def dense(self) -> torch.Tensor:
        """The dense map (D, H·r) the factors multiply to."""
        outer = self.outer.weight.view(-1, self.n_heads, self.head_dim).transpose(0, 1)  # (H, D, d)
        dense = torch.matmul(outer.float(), self.down.float())  # (H, D, r), rounded once below
        return dense.transpose(0, 1).flatten(1).to(self.down.dtype)  # (D, H·r)

    @staticmethod
    def _heads(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
        """The dense map (D, H·r) as its heads' maps (H, D, r)."""
        return weight.view(weight.shape[0], n_heads, -1).transpose(0, 1)

    def _set_dense(self, weight: torch.Tensor) -> bool:
        factors = _head_factors(self._heads(weight, self.n_heads), self.head_dim, self.down.dtype)
        if factors is None:
            return False
        with torch.no_grad():
            self.outer.weight.copy_(factors[0].transpose(0, 1).flatten(1))
            self.down.copy_(factors[1])
        return True

    def forward(self, o: torch.Tensor) -> torch.Tensor:
        h = torch.einsum("...hr,hdr->...hd", o.unflatten(-1, (self.n_heads, self.rank)), self.down)  # (…, H, d)
        return self.outer(h.flatten(-2))


def _dense_state(module, state_dict, prefix, local_metadata) -> None:
    """state_dict post-hook: the dense module's entries (`weight`, `bias`) in place of the factors'."""
    for name in [k for k in state_dict if k.startswith(prefix)]:
        del state_dict[name]
    state_dict[prefix + "weight"] = module.dense().detach()
    if module.bias is not None:
        state_dict[prefix + "bias"] = module.bias.detach()


def _factor_state(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
    """load_state_dict pre-hook: a dense `weight` (and `bias`) factored into the module's parameters."""
    weight = state_dict.pop(prefix + "weight", None)
    if weight is None:
        return  # the factors' own names, or missing: load_state_dict says which
    if not module._set_dense(weight.to(next(module.parameters()).device)):
        error_msgs.append(f"{prefix}weight: a head's map is not of rank {module.head_dim}, so it has no factored form")
        return
    bias = state_dict.pop(prefix + "bias", None)
    target = module.bias
    if (bias is None) != (target is None):
        error_msgs.append(f"{prefix}bias: {'missing' if bias is None else 'unexpected'}")
    elif bias is not None:
        with torch.no_grad():
            target.copy_(bias)
    # the factors are set: they load as themselves, so none is missing
    for name, parameter in module.named_parameters():
        state_dict[prefix + name] = parameter.detach()


def _attentions(model: nn.Module) -> list["MLAAttention"]:
    from convert.mla.attention import MLAAttention

    return [m for m in model.modules() if isinstance(m, MLAAttention) and m.layout == "absorbed"]


def factor_absorbed(model: nn.Module) -> dict[str, int]:
    """Put each absorbed attention's `q_absorbed` and `o_absorbed` of rank above the head dim in
    factored form (`FactoredQuery`, `FactoredOutput`), the same maps; in place. A map whose heads are
    not of rank d (the weights' rounding apart), as after dense training, stays dense.

    Returns counts: `factored` maps, `dense` maps left (rank not above d: nothing to gain; or not of
    rank d)."""
    counts = {"factored": 0, "dense": 0}
    for attn in _attentions(model):
        for name, cls, rank in (
            ("q_absorbed", FactoredQuery, attn.rank_k),
            ("o_absorbed", FactoredOutput, attn.rank_v),
        ):
            linear = getattr(attn, name, None)
            if type(linear) is not nn.Linear:
                continue  # absent (a q/k norm computes the query live), factored already, or wrapped (PEFT)
            factored = cls.from_dense(linear, attn.n_heads, attn.head_dim) if rank > attn.head_dim else None
            if factored is None:
                counts["dense"] += 1
                continue
            factored.requires_grad_(linear.weight.requires_grad)
            setattr(attn, name, factored)
            counts["factored"] += 1
    return counts


def absorb_factors(model: nn.Module) -> int:
    """Multiply every `FactoredQuery` / `FactoredOutput` of `model` back into a dense `nn.Linear`
    (the checkpoint's `q_absorbed` / `o_absorbed`); in place. Returns how many were multiplied."""
    count = 0
    for attn in _attentions(model):
        for name in ("q_absorbed", "o_absorbed"):
            factored = getattr(attn, name, None)
            if not isinstance(factored, FactoredQuery | FactoredOutput):
                continue
            weight = factored.dense().detach()
            linear = nn.Linear(
                weight.shape[1],
                weight.shape[0],
                bias=factored.bias is not None,
                device=weight.device,
                dtype=weight.dtype,
            )
            with torch.no_grad():
                linear.weight.copy_(weight)
                if factored.bias is not None:
                    linear.bias.copy_(factored.bias)
            linear.requires_grad_(any(p.requires_grad for p in factored.parameters()))
            setattr(attn, name, linear)
            count += 1
    return count


@contextmanager
def factored_training(model: nn.Module):
    """Train an absorbed model's query and output maps as their factors, multiplied back on exit.

        with convert.factored_training(model):
            trainer = Trainer(model=model, ...)   # build the optimizer inside: it takes the factors
            trainer.train()
        model.save_pretrained(path)              # the absorbed checkpoint

    Inside, each absorbed `q_absorbed`/`o_absorbed` wider than the head dim and of rank d a head
    (the exact rank's; not a compression's that its refinement fitted whole, nor one trained dense)
    is a `FactoredQuery`/`FactoredOutput`, the same map; what a step multiplies, and what it keeps
    for the backward, is then about the source model's. The maps trained stay of rank d a head, as
    converted. `state_dict` and `save_pretrained` give the dense names and values inside too, so a
    `Trainer` checkpoint is an absorbed checkpoint; a `Trainer` resumed inside from one factors its
    maps again, in another basis than the one its saved AdamW moments were taken in: those moments
    then do not fit their factors (restart the optimizer where that matters). Yields
    `factor_absorbed`'s counts.
    """
    counts = factor_absorbed(model)
    try:
        yield counts
    finally:
        absorb_factors(model)
