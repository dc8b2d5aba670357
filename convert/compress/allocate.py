"""Spending a KV-cache budget across layers, keys and values (docs/design.md, "Compression").

Every component of every latent competes for the budget by the error it removes per cache dim it costs.
"""

from dataclasses import dataclass

import torch


@dataclass
class Latent:
    """One latent to allocate: its name, spectrum, and the cache dims per component."""

    layer: int
    name: str  # "rank_k" or "rank_v"
    spectrum: torch.Tensor  # descending singular values
    cost: int  # cache dims per kept component
    minimum: int = 1  # components kept whatever the budget


def allocate_global(latents: list[Latent], budget: int, normalize: bool = True) -> list[dict]:
    """Ranks per layer, {"rank_k", "rank_v"}, spending exactly `budget` cache dims when possible.

    normalize: rank components by their share of their own latent's energy
    (spectra in unrelated units); False when the spectra share one unit
    (Fisher weighting: loss), so the largest σ² anywhere goes first.

    Keeping component i of a latent removes σ_i² from its weighted error; keeping the best per cache
    dim (a RoPE key pair costs 2) until the budget is spent minimizes the sum over latents of
    weighted error (relative to each latent's energy when `normalize`).
    """
    kept = {id(lat): lat.minimum for lat in latents}
    spent = sum(lat.minimum * lat.cost for lat in latents)
    if spent > budget:
        raise ValueError(f"a budget of {budget} dims is below the minimum of {spent} (one component per latent)")
    candidates = []
    for lat in latents:
        share = lat.spectrum.double() ** 2
        if normalize:
            share = share / share.sum().clamp(min=1e-300)
        candidates += [(float(share[i]) / lat.cost, i, lat) for i in range(lat.minimum, len(share))]
    candidates.sort(key=lambda c: -c[0])
    for _, _, lat in candidates:  # per latent the shares descend, so each latent keeps a prefix
        if spent + lat.cost <= budget:
            kept[id(lat)] += 1
            spent += lat.cost
    return _ranks(latents, kept)


def _ranks(latents: list[Latent], kept: dict) -> list[dict]:
    n_layers = max(lat.layer for lat in latents) + 1
    ranks: list[dict[str, int]] = [{} for _ in range(n_layers)]
    for lat in latents:
        ranks[lat.layer][lat.name] = kept[id(lat)] * lat.cost
    return ranks
