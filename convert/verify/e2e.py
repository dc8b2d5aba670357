"""End-to-end verification: logits, KL, top-1, perplexity and greedy generation
of the original transformers model against the loaded MLA model."""

import torch

from convert.heap import release_freed_memory
from convert.hf import load_original
from convert.io import Checkpoint
from convert.mla.model import cache_bytes_per_token, load_mla_model
from convert.options import dtype_name
from convert.text import scored_windows
from convert.verify import streamed
from convert.verify.memory import FIGURE_ROWS
from convert.verify.run import VerifyRun
from convert.verify.streamed import by_segment, segment_windows

GREEDY_PROMPT, GREEDY_NEW = 8, 32


def _nll(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Per-position next-token negative log-likelihood (float64)."""
    logp = torch.log_softmax(logits[0, :-1].double(), dim=-1)
    return -logp.gather(-1, ids[0, 1:, None])[:, 0]


def _greedy(model, ids: torch.Tensor) -> list[int]:
    prompt = ids[:, :GREEDY_PROMPT]
    # the prompt is unpadded: without the mask, generate would take its pad token's (id 0) occurrences for padding
    mask = torch.ones_like(prompt)
    out = model.generate(prompt, attention_mask=mask, max_new_tokens=GREEDY_NEW, do_sample=False, pad_token_id=0)
    return out[0, prompt.shape[1] :].tolist()


def perplexity(model, ids: torch.Tensor, window: int = 1024) -> float:
    """exp(mean next-token NLL) of `ids` (1, N) in non-overlapping windows of `window` tokens."""
    with torch.no_grad():
        nll = [_nll(model(chunk).logits, chunk) for chunk in scored_windows(ids, window)]  # chunk (1, ≤window)
    return float(torch.cat(nll).mean().exp())


def window_figures(ref: torch.Tensor, got: torch.Tensor, ids: torch.Tensor) -> dict:
    """One window's sums and maxima, `FIGURE_ROWS` positions at a time in float64.

    ref, got: the two models' logits (L, V) in any dtype; ids (L,): the window's tokens. Returns
    sq_diff, sq_ref, max_abs, kl_sum, kl_max, agree (floats) and nll_ref, nll_got ((L-1,) float64:
    position i's loss on token i+1)."""
    length = ref.shape[0]
    figures = dict(sq_diff=0.0, sq_ref=0.0, max_abs=0.0, kl_sum=0.0, kl_max=0.0, agree=0.0)
    nll_ref, nll_got = [], []
    for row in range(0, length, FIGURE_ROWS):
        r, g = ref[row : row + FIGURE_ROWS].double(), got[row : row + FIGURE_ROWS].double()  # (R, V)
        logp_ref, logp_got = torch.log_softmax(r, -1), torch.log_softmax(g, -1)
        kl = (logp_ref.exp() * (logp_ref - logp_got)).sum(-1)  # (R,)
        diff = g - r
        figures["sq_diff"] += float(diff.square().sum())
        figures["sq_ref"] += float(r.square().sum())
        figures["max_abs"] = max(figures["max_abs"], float(diff.abs().max()))
        figures["kl_sum"] += float(kl.sum())
        figures["kl_max"] = max(figures["kl_max"], float(kl.max()))
        figures["agree"] += float((r.argmax(-1) == g.argmax(-1)).sum())
        targets = ids[row + 1 : row + FIGURE_ROWS + 1, None]  # (≤R, 1): the next tokens, none after the last
        nll_ref.append(-logp_ref[: targets.shape[0]].gather(-1, targets)[:, 0])
        nll_got.append(-logp_got[: targets.shape[0]].gather(-1, targets)[:, 0])
    return figures | {"nll_ref": torch.cat(nll_ref), "nll_got": torch.cat(nll_got)}


def compare_models(ref_model, mla_model, ids: torch.Tensor, window: int = 1024, segments=None) -> dict:
    """Logit agreement and perplexity of two models on `ids` (1, N), window by window; with
    `segments` (`segment_windows`) each text's perplexities too, as `by_text`."""
    sq_diff = sq_ref = kl_sum = kl_max = max_abs = agree = 0.0
    window_nll_ref: list[torch.Tensor] = []
    window_nll_got: list[torch.Tensor] = []
    spans = segment_windows(ids.shape[-1], window, segments)
    with torch.no_grad():
        for start, stop, _ in spans:
            chunk = ids[:, start:stop]  # (1, ≤window)
            ref = ref_model(chunk).logits[0]  # (L, V)
            got = mla_model(chunk).logits[0]  # (L, V)
            w = window_figures(ref, got, chunk[0])
            del ref, got
            sq_diff, sq_ref = sq_diff + w["sq_diff"], sq_ref + w["sq_ref"]
            max_abs, kl_sum, kl_max = max(max_abs, w["max_abs"]), kl_sum + w["kl_sum"], max(kl_max, w["kl_max"])
            agree += w["agree"]
            window_nll_ref.append(w["nll_ref"])  # empty for a one-token window
            window_nll_got.append(w["nll_got"])
    n, texts = ids.shape[-1], by_segment(segments, spans, window_nll_ref, window_nll_got)
    nll_ref, nll_got = torch.cat(window_nll_ref), torch.cat(window_nll_got)
    ppl_ref, ppl_got = float(nll_ref.mean().exp()), float(nll_got.mean().exp())
    return {
        "tokens": n,
        "window": window,
        "logits_max_abs_diff": max_abs,
        "logits_rel_error": (sq_diff / sq_ref) ** 0.5,
        "kl_mean": kl_sum / n,
        "kl_max": kl_max,
        "top1_agreement": agree / n,
        "ppl_original": ppl_ref,
        "ppl_converted": ppl_got,
        "ppl_ratio": ppl_got / ppl_ref,
        "nll_abs_diff_mean": float((nll_got - nll_ref).abs().mean()),  # |log ppl ratio| is at most this
        "by_text": texts,
    }


def end_to_end(run: VerifyRun, load_converted, ids: torch.Tensor, tokenizer=None, segments=None) -> dict:
    """Compare the whole original and converted models on `ids` (1, N).

    load_converted(device, dtype): the converted model (MLA, or an export target's).
    KV-cache bytes are counted in the checkpoint's dtype `run.ckpt_dtype`, as deployed;
    with a tokenizer the greedy continuations are decoded to text too. The run's twin (the
    original's equivalent twin, `convert.verify.twin`): its figures against the original are the
    `floor`; it is built once the converted model is freed (two whole models in memory at a time).
    """
    config, device, dtype, ckpt_dtype = run.config, run.device, run.dtype, run.ckpt_dtype
    assert ckpt_dtype is not None  # both verifications set it: the dtype KV-cache bytes are counted in
    ref_model = load_original(run.original, config, device, dtype)
    mla_model = load_converted(device, dtype)
    ids = ids.to(device)
    result = compare_models(ref_model, mla_model, ids, segments=segments)
    result |= greedy_fields(_greedy(ref_model, ids), _greedy(mla_model, ids), ids, tokenizer, dtype)
    result |= {
        "kv_cache_bytes_per_token_original": cache_bytes_per_token(ref_model, as_dtype=ckpt_dtype),
        "kv_cache_bytes_per_token_converted": cache_bytes_per_token(mla_model, as_dtype=ckpt_dtype),
        "kv_cache_dtype": dtype_name(ckpt_dtype),
        "params_original": sum(p.numel() for p in ref_model.parameters()),
        "params_converted": sum(p.numel() for p in mla_model.parameters()),
        "mode": "whole",
        "greedy_skipped": None,
    }
    if run.twin is not None:
        del mla_model
        release_freed_memory()
        floor = compare_models(ref_model, load_original(run.twin, config, device, dtype), ids)
        result["floor"] = {k: v for k, v in floor.items() if k not in ("tokens", "window", "by_text")}
    return result


def greedy_fields(
    greedy_ref, greedy_got, ids: torch.Tensor, tokenizer, dtype: torch.dtype | None, how: str = "whole models"
) -> dict:
    """The report's greedy entries from the two token lists (all None when greedy generation did
    not run), the dtype it ran in and how (whole models, or streamed and why)."""
    ran = greedy_ref is not None
    decode = (lambda tokens: tokenizer.decode(tokens)) if ran and tokenizer is not None else (lambda tokens: None)
    return {
        "greedy_dtype": dtype_name(dtype) if ran and dtype is not None else None,  # ran: it has a dtype
        "greedy_how": how if ran else None,
        "greedy_original": greedy_ref,
        "greedy_converted": greedy_got,
        "greedy_match": greedy_ref == greedy_got if ran else None,
        "greedy_prompt_text": decode(ids[0, :GREEDY_PROMPT].tolist()),
        "greedy_text_original": decode(greedy_ref),
        "greedy_text_converted": decode(greedy_got),
    }


def greedy_in_turn(original: Checkpoint, converted, config: dict, ids: torch.Tensor, device, dtype) -> tuple:
    """Greedy continuations of the original and the converted model (directory `converted`), each
    whole model built in `dtype`, filled a tensor at a time, run and freed before the next is
    built: one model in memory at a time, not two. Returns (original's tokens, converted's, dtype, how)."""
    ids = ids.to(device)
    greedy_ref = _greedy(load_original(original, config, device, dtype, mapped=False), ids)  # its pages go with it
    release_freed_memory()
    greedy_got = _greedy(load_mla_model(converted, device=device, dtype=dtype), ids)
    release_freed_memory()
    return greedy_ref, greedy_got, dtype, "one whole model at a time"


def streamed_end_to_end(
    run: VerifyRun,
    ids: torch.Tensor,
    greedy: tuple | None = None,
    why: str | None = None,
    tokenizer=None,
    segments=None,
) -> dict:
    """`end_to_end`'s report with the models streamed one decoder layer at a time
    (`convert.verify.streamed`). Greedy generation needs a whole model with a KV cache:
    `greedy` holds (the original's tokens, the converted's, the dtype[, how they were generated]) of
    `greedy_in_turn` or `greedy_streamed` when one ran, else `greedy_skipped` says `why`; with
    a twin, the twin runs as a third stream and its figures are the `floor`; `segments` as `end_to_end`'s."""
    greedy_ref, greedy_got, greedy_dtype, *how = greedy or (None, None, None)
    mla, ckpt_dtype = run.mla, run.ckpt_dtype
    assert mla is not None and ckpt_dtype is not None  # a native run: `_verify_with` sets both
    result = streamed.compare_streamed(run, ids.to(run.device), segments=segments)
    cache_original, cache_converted = streamed.cache_bytes_per_token(mla, ckpt_dtype)
    return (
        result
        | greedy_fields(greedy_ref, greedy_got, ids, tokenizer, greedy_dtype, *how)
        | {
            "kv_cache_bytes_per_token_original": cache_original,
            "kv_cache_bytes_per_token_converted": cache_converted,
            "kv_cache_dtype": dtype_name(ckpt_dtype),
            "params_original": streamed.params(run.original),
            "params_converted": streamed.params(run.converted),
            "mode": "streamed",
            "greedy_skipped": None if greedy else why,
        }
    )
