"""Calibration: second moments of the inputs that really reach each attention layer."""

from dataclasses import dataclass

import torch

from convert.stream import LayerStream


@dataclass
class LayerStats:
    """E[x xᵀ] and E[x] of a layer's attention inputs x (post-norm hidden states), float64."""

    moment: torch.Tensor  # (D, D)
    mean: torch.Tensor  # (D,)
    tokens: int

    def augmented(self) -> torch.Tensor:
        """Second moment of [x; 1] (D+1, D+1), for affine maps (a bias as an extra column)."""
        top = torch.cat([self.moment, self.mean[:, None]], dim=1)
        bottom = torch.cat([self.mean, torch.ones(1, dtype=self.mean.dtype)])[None]
        return torch.cat([top, bottom])


def windows(token_ids: torch.Tensor, window: int) -> torch.Tensor:
    """(1, N) ids -> (N // window, window) rows (the tail that does not fill a window is dropped)."""
    n = token_ids.shape[-1] // window * window
    return token_ids[0, :n].reshape(-1, window)


def calibrate(checkpoint, config: dict, token_ids: torch.Tensor, n_layers: int, window: int = 1024,
              device="cpu", dtype=torch.float32, progress=iter) -> list[LayerStats]:
    """Stream the original model over `token_ids` (1, N) and collect every layer's input moments."""
    rows = windows(token_ids, min(window, token_ids.shape[-1]))  # (B, L)
    stream = LayerStream(checkpoint, config, torch.device(device), dtype)
    stats = []
    for _, x, _, _ in stream.run(rows, n_layers, progress):
        flat = x.reshape(-1, x.shape[-1]).double().cpu()  # (B·L, D)
        stats.append(LayerStats(flat.T @ flat / flat.shape[0], flat.mean(0), flat.shape[0]))
    return stats
