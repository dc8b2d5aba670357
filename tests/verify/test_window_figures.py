"""`compare_models` computes a window's float64 figures `FIGURE_ROWS` positions at a time
(convert/verify/e2e.py): the same figures as the whole window at once, without its (L × V)
float64 tensors (a 151,936-word vocabulary's were 1.2 GB each)."""

import math

import pytest
import torch

from convert.verify import e2e
from convert.verify.memory import FIGURE_ROWS, whole_model_activation_bytes


def whole_window(ref: torch.Tensor, got: torch.Tensor, ids: torch.Tensor) -> dict:
    """The figures of one window (L, V) computed at once, as `compare_models` did before rows."""
    ref, got = ref.double(), got.double()
    logp_ref, logp_got = torch.log_softmax(ref, -1), torch.log_softmax(got, -1)
    kl = (logp_ref.exp() * (logp_ref - logp_got)).sum(-1)  # (L,)
    diff = got - ref
    nll = [-lp[:-1].gather(-1, ids[1:, None])[:, 0] for lp in (logp_ref, logp_got)]  # (L-1,) each
    return {
        "sq_diff": float(diff.square().sum()),
        "sq_ref": float(ref.square().sum()),
        "max_abs": float(diff.abs().max()),
        "kl_sum": float(kl.sum()),
        "kl_max": float(kl.max()),
        "agree": float((ref.argmax(-1) == got.argmax(-1)).sum()),
        "nll_ref": nll[0],
        "nll_got": nll[1],
    }


@pytest.mark.parametrize("length", [1, 2, 5, 6, 7, 13])
def test_rows_give_the_whole_windows_figures(length, monkeypatch):
    monkeypatch.setattr(e2e, "FIGURE_ROWS", 3)  # windows of 1 to 13 positions: every edge of a row block
    g = torch.Generator().manual_seed(length)
    ref, got = torch.randn(length, 50, generator=g) * 4, torch.randn(length, 50, generator=g) * 4
    ids = torch.randint(0, 50, (length,), generator=g)
    rows, whole = e2e.window_figures(ref, got, ids), whole_window(ref, got, ids)
    for key in ("sq_diff", "sq_ref", "max_abs", "kl_sum", "kl_max", "agree"):
        assert rows[key] == pytest.approx(whole[key], rel=1e-12, abs=1e-12), key
    for key in ("nll_ref", "nll_got"):  # each position's loss on its own next token
        assert rows[key].shape == (length - 1,)
        torch.testing.assert_close(rows[key], whole[key], rtol=1e-12, atol=1e-12)


def test_compare_models_perplexity_is_the_rows_mean_loss():
    class Table(torch.nn.Module):  # logits are a row of a fixed table per token
        def __init__(self, seed):
            super().__init__()
            self.table = torch.randn(40, 40, generator=torch.Generator().manual_seed(seed)) * 3

        def forward(self, ids):
            return type("Out", (), {"logits": self.table[ids]})()

    ref, got = Table(0), Table(1)
    ids = torch.randint(0, 40, (1, 300), generator=torch.Generator().manual_seed(2))
    figures = e2e.compare_models(ref, got, ids, window=200)  # two windows, each longer than FIGURE_ROWS
    logits = ref.table[ids[0]].double()
    losses = [
        -torch.log_softmax(logits[s : s + 200], -1)[:-1].gather(-1, ids[0, s + 1 : s + 200, None]) for s in (0, 200)
    ]
    assert figures["ppl_original"] == pytest.approx(math.exp(float(torch.cat(losses).mean())), rel=1e-12)


def test_the_memory_bound_counts_rows_not_the_window():
    vocab = 151_936
    # 2 float64 logits of the window + 6 float64 (FIGURE_ROWS x V) tensors: under half the old 6 whole windows
    assert whole_model_activation_bytes(4096, vocab) == (2 * 1024 + 6 * FIGURE_ROWS) * vocab * 8
    assert whole_model_activation_bytes(4096, vocab) < 6 * 1024 * vocab * 8 / 2
    assert whole_model_activation_bytes(64, vocab) == (2 + 6) * 64 * vocab * 8  # a short text: its own rows
