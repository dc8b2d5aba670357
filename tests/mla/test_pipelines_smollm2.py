"""A real model through the pipeline most users start with: SmolLM2-135M-Instruct (fixtures/realdata.py)
compressed in memory to a quarter of its KV cache (`convert.to_mla`, factored, calibrated on ~1,024
tokens of *Pride and Prejudice*), then trained by transformers' `Trainer` with gradient
checkpointing and gradient accumulation on 128-token windows of the same book after the
calibration text."""

import math

import pytest
import torch

import convert
from convert.mla.causal_lm import MLAForCausalLM

pytestmark = [pytest.mark.realdata, pytest.mark.slow]

CALIB_TOKENS = 1024
WINDOW = 128


class Windows(torch.utils.data.Dataset):
    def __init__(self, ids: torch.Tensor):
        self.ids = ids  # (N, WINDOW)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _mean_loss(model, windows: torch.Tensor) -> float:
    model.eval()
    with torch.no_grad():
        return sum(float(model(input_ids=w[None], labels=w[None]).loss) for w in windows) / len(windows)


def test_smollm2_compressed_in_memory_trains_under_trainer(smollm2_original, smollm2_tokenizer, tmp_path):
    import realdata
    from transformers import Trainer, TrainingArguments

    ids = smollm2_tokenizer(realdata.austen_text("prideprejudice"))["input_ids"]
    calib = torch.tensor(ids[:CALIB_TOKENS])[None]
    windows = torch.tensor(ids[CALIB_TOKENS : CALIB_TOKENS + 4 * WINDOW]).view(4, WINDOW)  # after the calibration

    # whitened, global allocation, each layer factored on the original's hidden states: Fisher
    # calibration with the sequential refit (the defaults, which the tiny models' pipeline tests take)
    # takes 3-5 minutes here on 2 cores, this ~20 s, and the same kind of model comes out (ranks
    # spread across layers, the factored layout's modules); no attention-output refinement (+~3 minutes,
    # the same modules with other values: tests/compress/test_refine.py)
    options = {"method": "whitened", "allocation": "global", "calibration": "original", "refine_steps": 0}
    model = convert.to_mla(smollm2_original, layout="factored", kv_cache_ratio=0.25, calib=calib, **options)
    assert type(model) is MLAForCausalLM
    comp = model.config.mla["compression"]
    assert comp["cache_dims"] == comp["gqa_cache_dims"] // 4, comp

    before_loss = _mean_loss(model, windows)
    before = {name: p.detach().clone() for name, p in model.named_parameters() if ".self_attn." in name}
    args = TrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=True,
        report_to=[],
        max_steps=2,
        gradient_checkpointing=True,
        gradient_accumulation_steps=2,
        per_device_train_batch_size=1,
        learning_rate=1e-4,
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=Windows(windows))
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses), trainer.state.log_history
    assert model.model.gradient_checkpointing

    now = dict(model.named_parameters())
    still = [name for name, p in before.items() if torch.equal(now[name].detach(), p)]
    assert not still, f"attention weights not trained: {still[:3]}"
    after_loss = _mean_loss(model, windows)
    print(f"loss on the 4 training windows: {before_loss:.4f} -> {after_loss:.4f}; logged {losses}")
    assert math.isfinite(after_loss) and after_loss < before_loss
