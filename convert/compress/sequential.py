"""Sequential calibration (GPTQ's order): each layer is compressed for the inputs it will see.

The calibration windows run through the original model and the model compressed so far, side by side, one decoder
layer at a time; memory stays one decoder layer plus the two streams' hidden states (docs/design.md, "Compression").
"""

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from convert.compress.calibrate import normed_keys
from convert.compress.refine import NO_REFINEMENT, Refined, Refinement, refine_attention
from convert.mla.attention import build_mla_attention
from convert.mla.config import MLASection
from convert.stream import LayerStream, layer_output
from convert.text import batched_windows


@dataclass
class SequentialStats:
    """Moments of one layer's attention inputs: y from the compressed model, y° from the original."""

    moment: torch.Tensor  # E[y yᵀ] (D, D)
    mean: torch.Tensor  # E[y] (D,)
    cross: torch.Tensor  # E[y° yᵀ] (D, D)
    mean_original: torch.Tensor  # E[y°] (D,)
    normed_keys: tuple[torch.Tensor, torch.Tensor] | None = None  # q/k norm: (E[n nᵀ], E[n° nᵀ]) (G·d, G·d)

    def augmented(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(E[[y; 1][y; 1]ᵀ], E[[y°; 1][y; 1]ᵀ]) for an affine key latent (a bias column)."""
        one = torch.ones(1, dtype=self.mean.dtype)
        moment = torch.cat([torch.cat([self.moment, self.mean[:, None]], 1), torch.cat([self.mean, one])[None]])
        cross = torch.cat([torch.cat([self.cross, self.mean_original[:, None]], 1), torch.cat([self.mean, one])[None]])
        return moment, cross


class SequentialCalibration:
    """The calibration windows' hidden states in the original model and in the compressed one."""

    def __init__(
        self,
        checkpoint,
        config: dict,
        token_ids: torch.Tensor,
        window: int = 1024,
        dtype=torch.float32,
        refinement: Refinement = NO_REFINEMENT,
    ):
        self.refinement = refinement
        self.refined: list[Refined] = []
        rows = batched_windows(token_ids, min(window, token_ids.shape[-1]))  # (B, L)
        self.stream = LayerStream(checkpoint, config, torch.device("cpu"), dtype)
        self.original = self.stream.embed(rows)  # (B, L, D)
        self.compressed = self.original.clone()
        # transformers' decoder layer of the family (its modules read by name), loaded by `_load` until advanced
        self.decoder: Any | None = None

    def _normed(self, hidden: torch.Tensor) -> torch.Tensor:
        assert self.decoder is not None  # loaded
        return self.decoder.input_layernorm(hidden) if self.stream.arch.pre_norm else hidden

    def _load(self, layer: int) -> None:
        if self.decoder is None:
            self.decoder = self.stream.decoder(layer)

    def stats(self, layer: int) -> SequentialStats:
        """Load layer `layer` and measure its inputs in both models."""
        self._load(layer)
        assert self.decoder is not None
        with torch.no_grad():
            y = self._normed(self.compressed).reshape(-1, self.compressed.shape[-1]).double()  # (B·L, D)
            y0 = self._normed(self.original).reshape(-1, self.original.shape[-1]).double()
        n = y.shape[0]
        stats = SequentialStats(y.T @ y / n, y.mean(0), y0.T @ y / n, y0.mean(0))
        attention = self.decoder.self_attn
        if hasattr(attention, "k_norm"):  # the normed keys, in both models
            with torch.no_grad():
                k = normed_keys(attention, self._normed(self.compressed)).double()  # (B·L, G·d)
                k0 = normed_keys(attention, self._normed(self.original)).double()
            stats.normed_keys = (k.T @ k / n, k0.T @ k / n)
        return stats

    def advance(self, layer: int, mla: MLASection, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Run layer `layer` in both models: the original's attention, then the converted one
        (refined first when asked). Returns the converted tensors as run (refined or not)."""
        self._load(layer)
        assert self.decoder is not None
        window = getattr(self.decoder.self_attn, "sliding_window", None)
        tensors = {name: t.to(self.stream.dtype) for name, t in tensors.items()}
        rope = self.stream.layer_rotary(layer)
        attention = build_mla_attention(mla, layer, tensors, rotary=rope, sliding_window=window)
        self.advance_with(layer, attention, refine=self.refinement.steps > 0)
        return {name: t.detach() for name, t in attention.state_dict().items()}

    def advance_with(self, layer: int, attention: torch.nn.Module, refine: bool = False) -> None:
        """Run layer `layer` in both models: the original with its own attention, the compressed one
        with `attention` in its place (called as the decoder calls its self_attn). refine: first fit
        `attention` so that the compressed layer computes what the original does (`_refine`)."""
        self._load(layer)
        assert self.decoder is not None
        positions, rotary, mask = self.stream.inputs(layer, self.original)
        inputs = lambda h: dict(
            hidden_states=h, attention_mask=mask, position_embeddings=rotary, position_ids=positions
        )
        residual = self.original  # the original stream's input to the layer (B, L, D)
        with torch.no_grad():
            self.original = layer_output(self.decoder(**inputs(self.original)))
        self.decoder.self_attn = attention
        if refine:  # the refinement's last forward, which measured it, is the compressed stream's advance
            refined = self._refine(attention, inputs(self.compressed), residual)
            assert refined.output is not None  # `_refine` keeps the output
            self.compressed = refined.output
            self.refined.append(dataclasses.replace(refined, output=None))
        else:
            with torch.no_grad():
                self.compressed = layer_output(self.decoder(**inputs(self.compressed)))
        self.decoder = None

    def _refine(self, attention, inputs: dict, residual: torch.Tensor) -> Refined:
        """Fit `attention` within the loaded decoder layer, on the compressed stream's `inputs`, so that the layer's
        output is the goal (`self.original` is the original stream already advanced, `residual` its input). Where the
        family adds the attention's output to the residual stream as it is, the goal is the original's stream: each
        layer also takes back what the layers before it lost. Where the decoder norms the attention's output first
        (Gemma 2/3, OLMo 2), taking the streams' drift back through that norm measured far worse on Gemma 3
        (docs/compression.md): the goal is the compressed stream plus what the original layer adds to its own."""
        if self.stream.arch.post_attention_norm:
            goal, base = self.compressed + (self.original - residual), self.compressed  # (B, L, D) each
        else:
            goal, base = self.original, residual
        return refine_attention(
            attention, inputs, goal, self.refinement, within=self.decoder, base=base, keep_output=True
        )
