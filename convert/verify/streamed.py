"""End-to-end verification streamed layer by layer: `compare_models`' figures without either whole model in memory.

One original and one converted decoder layer are in memory at a time; the logits follow in vocabulary chunks of the
lm_head, so no (tokens × vocab) tensor exists (docs/design.md, "Verification").
"""

from functools import partial

import torch

from convert.arch import ARCHS
from convert.heap import release_freed_memory
from convert.io import Checkpoint
from convert.io.reader import dtype_itemsize
from convert.layouts import module_layout
from convert.mla.attention import build_mla_attention
from convert.mla.config import MLASection
from convert.plan import cache_dims
from convert.stream import LayerStream, embedding_rows, layer_output, materialize
from convert.verify.run import VerifyRun

VOCAB_CHUNK = 8192  # lm_head rows per chunk: chunk logits (L, C) stay small


class _Stream:
    """The pieces both streams share: classes, configs, rotary embedding, masks."""

    def __init__(self, run: VerifyRun):
        original, config, device, dtype = run.original, run.config, run.device, run.dtype
        self.original, self.converted, self.config = module_layout(original, config), run.converted, config
        self.twin = run.twin  # the original's equivalent twin (`convert.verify.twin`), run as a third stream
        assert run.mla is not None  # streamed: a native run, its `mla` section parsed
        self.mla, self.device, self.dtype = run.mla, device, dtype
        self.layers = LayerStream(original, config, device, dtype)
        self.arch = ARCHS[self.mla.source_architecture]
        # What Gemma's model forward adds around its layers: embeddings × √D, logits soft-capped.
        self.embed_scale = config["hidden_size"] ** 0.5 if self.arch.gemma_scores else None
        self.final_softcap = self.layers.final_softcap

    def original_layer(self, layer: int, checkpoint: Checkpoint | None = None) -> torch.nn.Module:
        """The family's own decoder layer with the original's tensors (or `checkpoint`'s: the twin's)."""
        build = lambda: self.layers.decoder_cls(self.layers.ref_config, layer)
        source = self.original if checkpoint is None else checkpoint
        return materialize(build, source, f"model.layers.{layer}.", self.device, self.dtype)

    def converted_layer(self, layer: int) -> torch.nn.Module:
        """The family's decoder layer with its attention swapped for MLAAttention, as
        `load_mla_model` builds it (eager config), with the converted tensors."""

        def build():
            decoder = self.layers.decoder_cls(self.layers.mask_config, layer)
            window = getattr(decoder.self_attn, "sliding_window", None)
            decoder.self_attn = build_mla_attention(
                self.mla, layer, rotary=self.layers.layer_rotary(layer), sliding_window=window
            )
            return decoder

        return materialize(build, self.converted, f"model.layers.{layer}.", self.device, self.dtype)

    def embed(self, checkpoint: Checkpoint, ids: torch.Tensor) -> torch.Tensor:
        """Embedding rows of `ids` (1, L) -> (1, L, D), read row by row (never the whole table)."""
        assert self.arch.embed is not None  # only the seed's family has none, and it runs no end-to-end check
        rows = embedding_rows(checkpoint, self.arch.embed, ids).to(device=self.device, dtype=self.dtype)
        if self.embed_scale is not None:  # as Gemma2Model does, the factor rounded to the run dtype
            rows = rows * torch.tensor(self.embed_scale, dtype=self.dtype)
        return rows

    def cap(self, logits: torch.Tensor) -> torch.Tensor:
        """The final logit soft-cap of the family's causal LM (Gemma 2), or the logits unchanged."""
        if self.final_softcap is None:
            return logits
        return torch.tanh(logits / self.final_softcap) * self.final_softcap

    def head_name(self, checkpoint: Checkpoint) -> str:
        return self.layers.head_name(checkpoint)

    def norm(self, checkpoint: Checkpoint, hidden: torch.Tensor) -> torch.Tensor:
        """The final norm (the family's own class, as its decoder layers use) applied to hidden."""
        return self.layers.final_norm(checkpoint)(hidden)


def hidden_states(stream: _Stream, windows: list[torch.Tensor], progress=iter):
    """Final-normed hidden states of each model for each window: ([ref (1, L, D)], [got (1, L, D)],
    [twin (1, L, D)] or None without a twin)."""
    ref = [stream.embed(stream.original, w) for w in windows]
    got = [stream.embed(stream.converted, w) for w in windows]
    twin = None if stream.twin is None else list(ref)  # the twin's embeddings are the original's
    with torch.no_grad():
        for layer in progress(range(stream.mla.n_layers)):
            inputs = [stream.layers.inputs(layer, h) for h in ref]  # (positions, rotary, mask)
            builds = [(partial(stream.original_layer, layer), ref), (partial(stream.converted_layer, layer), got)]
            if twin is not None:
                builds.append((partial(stream.original_layer, layer, stream.twin), twin))
            for build, hidden in builds:  # each stream in place, one decoder layer in memory at a time
                decoder = build()
                hidden[:] = [_run(decoder, h, i) for h, i in zip(hidden, inputs)]
                del decoder
        ref = [stream.norm(stream.original, h) for h in ref]
        got = [stream.norm(stream.converted, h) for h in got]
        twin = None if twin is None else [stream.norm(stream.original, h) for h in twin]
    return ref, got, twin


def _run(decoder, hidden, inputs):
    positions, rotary, mask = inputs
    return layer_output(decoder(hidden, attention_mask=mask, position_embeddings=rotary, position_ids=positions))


def _chunks(stream: _Stream, checkpoint: Checkpoint):
    """(start, lm_head rows start:start+C (C, D) in the run's dtype) over the vocabulary."""
    name = stream.head_name(checkpoint)
    vocab = checkpoint.shape(name)[0]
    for start in range(0, vocab, VOCAB_CHUNK):
        rows = checkpoint.read_rows(name, start, min(start + VOCAB_CHUNK, vocab))
        yield start, rows.to(device=stream.device, dtype=stream.dtype)


def _logits_chunks(stream, ref_h, got_h, got_checkpoint: Checkpoint):
    """Yield (start, ref logits (L, C) float64, the other model's logits (L, C) float64) per vocabulary
    chunk, computed in the run's dtype (as the whole model computes them) and compared in float64;
    got_checkpoint: the other model's (its lm_head)."""
    for (start, w_ref), (_, w_got) in zip(_chunks(stream, stream.original), _chunks(stream, got_checkpoint)):
        ref = stream.cap(torch.nn.functional.linear(ref_h[0], w_ref)).double()  # (L, C), run dtype -> float64
        got = stream.cap(torch.nn.functional.linear(got_h[0], w_got)).double()
        yield start, ref, got


def _window_figures(stream, ref_h, got_h, ids: torch.Tensor, got_checkpoint: Checkpoint) -> dict:
    """Sums and maxima of one window (ids (1, L)), in one pass over the vocabulary.

    Per row, with m the running maximum of the original's logits r (converted: g):
    s = Σ exp(r − m), t = Σ exp(r − m)(r − g), rescaled when m grows; then
    KL(p_r ‖ p_g) = Σ p_r (log p_r − log p_g) = t / s − lse(r) + lse(g).
    """
    length, device = ids.shape[-1], stream.device
    neg_inf = torch.full((length,), float("-inf"), dtype=torch.float64, device=device)
    lse_got, m = neg_inf.clone(), neg_inf.clone()
    s = torch.zeros(length, dtype=torch.float64, device=device)
    t = s.clone()
    best_ref, best_got = neg_inf.clone(), neg_inf.clone()
    arg_ref = torch.zeros(length, dtype=torch.long, device=device)
    arg_got = arg_ref.clone()
    target = ids[0, 1:].to(device)  # (L-1,) next tokens
    tgt_ref = torch.zeros(length - 1, dtype=torch.float64, device=device)
    tgt_got = tgt_ref.clone()
    sq_diff = sq_ref = max_abs = 0.0
    for start, ref, got in _logits_chunks(stream, ref_h, got_h, got_checkpoint):  # (L, C) each, float64
        diff = got - ref
        sq_diff, sq_ref = sq_diff + float(diff.square().sum()), sq_ref + float(ref.square().sum())
        max_abs = max(max_abs, float(diff.abs().max()))
        lse_got = torch.logaddexp(lse_got, torch.logsumexp(got, -1))
        m_new = torch.maximum(m, ref.max(-1).values)
        scale = torch.exp(m - m_new)  # (L,) 0 on the first chunk
        weights = torch.exp(ref - m_new[:, None])  # (L, C)
        s = s * scale + weights.sum(-1)
        t = t * scale - (weights * diff).sum(-1)
        m = m_new
        for logits, best, arg in ((ref, best_ref, arg_ref), (got, best_got, arg_got)):
            value, index = logits.max(-1)
            better = value > best  # strictly: the first maximum wins, as argmax over the whole row
            best[better], arg[better] = value[better], index[better] + start
        inside = (target >= start) & (target < start + ref.shape[-1])
        local = (target - start).clamp(0, ref.shape[-1] - 1)[:, None]
        tgt_ref += torch.where(inside, ref[:-1].gather(-1, local)[:, 0], 0.0)
        tgt_got += torch.where(inside, got[:-1].gather(-1, local)[:, 0], 0.0)
    lse_ref = m + s.log()
    kl = t / s - lse_ref + lse_got  # (L,)
    return {
        "sq_diff": sq_diff,
        "sq_ref": sq_ref,
        "max_abs": max_abs,
        "kl_sum": float(kl.sum()),
        "kl_max": float(kl.max()),
        "agree": float((arg_ref == arg_got).sum()),
        "nll_ref": lse_ref[:-1] - tgt_ref,  # (L-1,)
        "nll_got": lse_got[:-1] - tgt_got,
    }


def segment_windows(n_tokens: int, window: int, segments=None) -> list[tuple[int, int, int]]:
    """(start, stop, segment) of each window over `n_tokens` tokens: windows of at most `window`
    tokens that never cross a segment's end. segments: [(name, tokens), ...] in order, summing to
    n_tokens (the texts the ids hold, one after the other); None: one segment."""
    lengths = [n_tokens] if segments is None else [length for _, length in segments]
    spans, offset = [], 0
    for index, length in enumerate(lengths):
        spans += [(s, min(s + window, offset + length), index) for s in range(offset, offset + length, window)]
        offset += length
    return spans


def by_segment(segments, spans, nll_ref: list, nll_got: list) -> list[dict] | None:
    """Each segment's perplexity, original and converted, from the windows' NLLs (None: no segments)."""
    if segments is None:
        return None
    rows = []
    for index, (name, length) in enumerate(segments):
        ref = [n for n, span in zip(nll_ref, spans) if span[2] == index and len(n)]
        got = [n for n, span in zip(nll_got, spans) if span[2] == index and len(n)]
        ppl_ref, ppl_got = float(torch.cat(ref).mean().exp()), float(torch.cat(got).mean().exp())
        rows.append(
            {
                "text": name,
                "tokens": length,
                "ppl_original": ppl_ref,
                "ppl_converted": ppl_got,
                "ppl_ratio": ppl_got / ppl_ref,
            }
        )
    return rows


def compare_streamed(run: VerifyRun, ids: torch.Tensor, window=1024, progress=iter, segments=None) -> dict:
    """`compare_models`' figures (same keys, same windows) on `ids` (1, N), with the models streamed
    layer by layer; with a twin (the original's equivalent twin) its figures against the original
    too, as `floor`; with `segments` each text's perplexities, as `by_text`."""
    stream = _Stream(run)
    spans = segment_windows(ids.shape[-1], window, segments)
    windows = [ids[:, start:stop] for start, stop, _ in spans]  # (1, ≤window) each
    ref_h, got_h, twin_h = hidden_states(stream, windows, progress)
    release_freed_memory()  # the decoder layers' freed pages, before the vocabulary chunks
    figures = _figures(stream, windows, ref_h, got_h, stream.converted, (segments, spans))
    result = {"tokens": ids.shape[-1], "window": window} | figures
    if twin_h is not None:
        floor = _figures(stream, windows, ref_h, twin_h, stream.original)  # the twin's head is the original's
        result["floor"] = {k: v for k, v in floor.items() if k != "by_text"}
    return result


def _figures(
    stream: _Stream,
    windows,
    ref_h,
    got_h,
    got_checkpoint: Checkpoint,
    segments: tuple[list | None, list | None] = (None, None),
) -> dict:
    """The figures of one model's hidden states `got_h` against the original's `ref_h`, window by
    window; segments: (the texts, `segment_windows`' spans) for `by_text`."""
    total = {"sq_diff": 0.0, "sq_ref": 0.0, "max_abs": 0.0, "kl_sum": 0.0, "kl_max": 0.0, "agree": 0.0}
    window_nll_ref: list[torch.Tensor] = []
    window_nll_got: list[torch.Tensor] = []
    with torch.no_grad():
        for w, ref, got in zip(windows, ref_h, got_h):
            fig = _window_figures(stream, ref, got, w, got_checkpoint)
            for key in ("sq_diff", "sq_ref", "kl_sum", "agree"):
                total[key] += fig[key]
            total["max_abs"], total["kl_max"] = (
                max(total["max_abs"], fig["max_abs"]),
                max(total["kl_max"], fig["kl_max"]),
            )
            window_nll_ref.append(fig["nll_ref"])  # (L-1,) per window
            window_nll_got.append(fig["nll_got"])
    n, texts = sum(w.shape[-1] for w in windows), by_segment(*segments, window_nll_ref, window_nll_got)
    nll_ref, nll_got = torch.cat(window_nll_ref), torch.cat(window_nll_got)
    ppl_ref, ppl_got = float(nll_ref.mean().exp()), float(nll_got.mean().exp())
    return {
        "logits_max_abs_diff": total["max_abs"],
        "logits_rel_error": (total["sq_diff"] / total["sq_ref"]) ** 0.5,
        "kl_mean": total["kl_sum"] / n,
        "kl_max": total["kl_max"],
        "top1_agreement": total["agree"] / n,
        "ppl_original": ppl_ref,
        "ppl_converted": ppl_got,
        "ppl_ratio": ppl_got / ppl_ref,
        "nll_abs_diff_mean": float((nll_got - nll_ref).abs().mean()),  # |log ppl ratio| is at most this
        "by_text": texts,
    }


def params(checkpoint: Checkpoint) -> int:
    """Parameters of the checkpoint's model (a tied lm_head is not stored, so not counted)."""
    return sum(_numel(checkpoint.shape(name)) for name in checkpoint.keys())


def _numel(shape) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


def cache_bytes_per_token(mla: MLASection, ckpt_dtype: torch.dtype) -> tuple[float, float]:
    """(original, converted) KV-cache bytes per token, in `ckpt_dtype`, from the configs: what
    `convert.mla.model.cache_bytes_per_token` measures on the whole models (tests check so)."""
    size = dtype_itemsize(ckpt_dtype)
    original = mla.n_layers * 2 * mla.n_kv_heads * mla.head_dim * size
    # the latents (the factored layout's key positions are not counted)
    converted = sum(cache_dims(layer.ranks) for layer in mla.layers) * size
    return float(original), float(converted)


def greedy_streamed(run: VerifyRun, ids: torch.Tensor, prompt: int, new: int, eos: set[int]) -> tuple[list, list]:
    """Greedy continuations of both models (`new` tokens after the first `prompt` of `ids`, stopping
    after an `eos` token, as `generate` does) with one decoder layer in memory at a time: each new
    token is one pass over the original's layers. The converted model's choices come from one pass
    over the original's whole continuation (teacher forcing: they are its own greedy tokens for as
    long as they agree); past a disagreement it goes on alone, a pass per token."""
    stream = _Stream(run)
    ref = _generate(stream, stream.original, stream.original_layer, ids[:, :prompt], new, eos)
    forced = torch.tensor([ids[0, :prompt].tolist() + ref], device=ids.device)  # (1, prompt + len(ref))
    hidden = _final_hidden(stream, stream.converted, stream.converted_layer, forced)[0, prompt - 1 : -1]  # (n, D)
    got = []
    for position, token in enumerate(ref):
        got.append(_argmax(stream, stream.converted, hidden[position : position + 1]))
        if got[-1] != token:
            break
    if got != ref:
        prefix = torch.tensor([ids[0, :prompt].tolist() + got], device=ids.device)
        got += (
            []
            if got[-1] in eos
            else _generate(stream, stream.converted, stream.converted_layer, prefix, new - len(got), eos)
        )
    return ref, got


def _generate(stream: _Stream, checkpoint: Checkpoint, build_layer, prefix: torch.Tensor, new: int, eos: set[int]):
    """Up to `new` greedy tokens after `prefix` (1, L), a streamed pass over the model per token."""
    tokens = []
    for _ in range(new):
        hidden = _final_hidden(stream, checkpoint, build_layer, prefix)[0, -1:]  # (1, D)
        tokens.append(_argmax(stream, checkpoint, hidden))
        if tokens[-1] in eos:
            break
        prefix = torch.cat([prefix, prefix.new_tensor([[tokens[-1]]])], dim=1)
    return tokens


def _final_hidden(stream: _Stream, checkpoint: Checkpoint, build_layer, ids: torch.Tensor) -> torch.Tensor:
    """The final-normed hidden states (1, L, D) of `ids` (1, L), one decoder layer in memory at a time."""
    with torch.no_grad():
        hidden = stream.embed(checkpoint, ids)
        for layer in range(stream.mla.n_layers):
            decoder = build_layer(layer)
            hidden = _run(decoder, hidden, stream.layers.inputs(layer, hidden))
            del decoder
        return stream.norm(checkpoint, hidden)


def _argmax(stream: _Stream, checkpoint: Checkpoint, hidden: torch.Tensor) -> int:
    """The most likely next token for one final hidden state (1, D), over the vocabulary in chunks
    (the first maximum wins, as argmax over the whole row)."""
    best, arg = float("-inf"), 0
    with torch.no_grad():
        for start, rows in _chunks(stream, checkpoint):
            value, index = stream.cap(torch.nn.functional.linear(hidden, rows))[0].max(-1)
            if float(value) > best:
                best, arg = float(value), start + int(index)
    return arg
