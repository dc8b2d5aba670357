#!/usr/bin/env python3
"""Training step, prefill memory and compile time: the original model against its conversions.

Models (`--model`): `smollm2` (the real SmolLM2-135M, float32, its tokenizer) or `tiny`
(fixtures/tiny-llama, byte-level token ids modulo its 128-token vocabulary: the tests' run, in
seconds). Each is run as it is and converted in memory by `convert.to_mla`:

  original         transformers' model (SDPA attention, its default)
  absorbed         layout absorbed, exact
  absorbed-factored  the same, its query and output maps as their factors, as
                   `convert.factored_training(model)` trains it (convert/mla/lowrank.py)
  factored         layout factored, exact
  factored-kv0.25  layout factored, kv_cache_ratio 0.25, calibrated on `--calib-tokens` (2,048)
                   tokens of Pride and Prejudice
  absorbed-kv0.25  layout absorbed, kv_cache_ratio 0.25, the same calibration
  factored-kv0.5, absorbed-kv0.5, absorbed-kv0.75
                   the same at 50% and 75% of the cache (the absorbed ones' query and output maps
                   are refined whole, of rank above d a head: `factored_training` leaves them dense)

What is measured, float32, on `--device` (auto: CUDA when there is one):

  training step    transformers' `Trainer` (its defaults: AdamW, lr 1e-5 constant here, gradient
                   clipping at 1.0), batches of `--batch` windows of `--window` tokens of Emma
                   (labels = inputs), gradient checkpointing off and on, `--steps` optimizer steps
                   per run. Seconds per optimizer step: from `on_step_begin` to `on_step_end` (the
                   forward, backward, clipping, optimizer step and zero_grad of one step), the first
                   step left out (warm-up: the optimizer's state is created), medians over steps
                   and repeats; wall time, and the process's CPU time over the same span (on a
                   shared CPU machine, with `--threads 1`, the work itself: other processes stretch
                   the wall time, and with several threads torch's thread pool waits on
                   descheduled threads, up to 20× on 2 busy cores). Peak memory of a step (the
                   last step of the first repeat, not timed): CUDA `torch.cuda.max_memory_allocated`
                   over the step; CPU the bytes of the training state live at the step's start
                   (parameters, buffers, gradients, optimizer state, each storage once) plus the
                   peak of the bytes allocated during the step, from torch.profiler's memory events
                   (`_common.AllocationPeak`).
  prefill peak     one forward of batch 1 × `--prefill-tokens` (2,048) tokens of Emma, no grad,
                   use_cache=True, logits_to_keep=1 (as `generate`'s prefill: the full logits,
                   2,048 × 49,152 floats for SmolLM2, would hide the attention): the peak of the
                   bytes allocated during the call above the weights (`AllocationPeak`: the
                   profiler's memory events on CPU, the allocator's peak on CUDA), the KV cache it
                   returns included.
  training FLOPs   torch's FLOP counter over one training forward and backward of a batch: the
                   matmuls (projections, MLP, LM head; it has no formula for SDPA on a CPU), the
                   arithmetic a step's time varies around (deterministic, where the times are not).
  compile time     `torch.compile(model)` on a training step's forward and backward (train mode,
                   labels, use_cache=False) of one training batch: the first compiled forward
                   minus the eager forward, plus the first compiled backward (AOTAutograd compiles
                   the backward graph there) minus the eager backward (eager: medians of 2 after
                   a warm-up); the two parts are recorded too. Each model compiled with Dynamo
                   reset and a fresh, empty Inductor cache (`torch._inductor.utils.fresh_cache`),
                   after an untimed compile of a small module (Inductor's one-time start-up).
                   `--compile-layers N`: the models cut to their first N decoder layers for this
                   measure only (0, default: all).

Every figure of a conversion is also given as its ratio to the original's, measured in the same
run; the models take turns in an order that rotates each repeat. The issue's goals: prefill peak ≤
1.0× the original's, training step time and peak ≤ 1.1×, compile time ≤ 1.5×.

    python bench/train_step.py [--model smollm2|tiny] [--batch 2] [--window 256] [--steps 6]
                               [--repeats 3] [--prefill-tokens 2048] [--compile-layers 0]
                               [--models NAME...] [--compile-models NAME...] [--threads N] [--keep-freed-memory] [--device auto|cpu|cuda]
                               [--out PATH]

Writes bench/results/train_step/train_step_<device>.json (`--model tiny`: train_step_tiny_<device>.json).
On 2 shared CPU cores (SmolLM2's two calibrations alone took 4-9 min there):

    python bench/train_step.py --batch 1 --window 128 --steps 4 --repeats 2 --compile-layers 4 --threads 1
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

MODELS = {
    "original": None,
    "absorbed": dict(layout="absorbed"),
    "absorbed-factored": dict(layout="absorbed", factored_training=True),
    "factored": dict(layout="factored"),
    "factored-kv0.25": dict(layout="factored", kv_cache_ratio=0.25),
    "absorbed-kv0.25": dict(layout="absorbed", kv_cache_ratio=0.25),
    "factored-kv0.5": dict(layout="factored", kv_cache_ratio=0.5),
    "absorbed-kv0.5": dict(layout="absorbed", kv_cache_ratio=0.5),
    "absorbed-kv0.75": dict(layout="absorbed", kv_cache_ratio=0.75),
}
GOALS = {"prefill": 1.0, "step": 1.1, "peak": 1.1, "compile": 1.5}
CHECKPOINTING = ("off", "on")


def text(book: str) -> str:
    """An Austen novel: data/<book>.txt (fixtures/realdata.py --into data), else the fixture cache."""
    path = C.REPO / "data" / f"{book}.txt"
    if path.is_file():
        return path.read_text(encoding="utf-8")
    import realdata

    return realdata.austen_text(book)


def load(name: str, dtype):
    """(model, token ids of a text): SmolLM2 with its tokenizer, or the tiny Llama on bytes."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if name == "smollm2":
        path = C.REPO / "data" / "smollm2"
        path = path if path.is_dir() else C.smollm2_dir()
        tokenizer = AutoTokenizer.from_pretrained(str(path))
        return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype), lambda s: tokenizer(s).input_ids
    model = AutoModelForCausalLM.from_pretrained(str(C.FIXTURES / "tiny-llama"), dtype=dtype)
    vocab = model.config.vocab_size
    return model, lambda s: [b % vocab for b in s.encode("utf-8")]


def keep_freed_memory() -> None:
    """Have glibc's malloc serve every allocation from its heap and keep what is freed there.

    By default an allocation above its threshold (the tied embedding's 113 MB gradient, the logits)
    is a fresh mapping, and each step's first touch of it page-faults: in a profile of two Trainer
    steps of SmolLM2, `fill_` and `add` on such buffers took 2.6 s of 4.7 s, and 0.13 s of 1.8 s in
    two steps of its factored conversion: the largest swing seen between steps of one model here."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    m_trim_threshold, m_mmap_max = -1, -4  # malloc.h; mallopt takes a C int
    if not (libc.mallopt(m_mmap_max, 0) and libc.mallopt(m_trim_threshold, 2**31 - 1)):
        raise SystemExit("--keep-freed-memory: glibc's mallopt refused")  # no mapping per buffer, no trim


def tensor_bytes(tensors) -> int:
    """Bytes of the storages behind `tensors`, each storage once."""
    seen = {}
    for t in tensors:
        if t is not None and t.numel():
            storage = t.untyped_storage()
            seen[(t.device, storage.data_ptr())] = storage.nbytes()
    return sum(seen.values())


def training_state(model, optimizer):
    """The tensors a training step starts with: parameters, buffers, gradients, optimizer state."""
    import torch

    yield from model.parameters()
    yield from model.buffers()
    yield from (p.grad for p in model.parameters())
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper
    if inner is not None:
        for state in inner.state.values():
            yield from (v for v in state.values() if isinstance(v, torch.Tensor))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", choices=["smollm2", "tiny"])
    parser.add_argument("--batch", type=int, default=2, help="windows per optimizer step (default 2)")
    parser.add_argument("--window", type=int, default=256, help="tokens per window (default 256)")
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps per Trainer run (default 6; ≥ 3)")
    parser.add_argument("--repeats", "--repeat", dest="repeat", type=int, default=3, help="repeats (default 3)")
    parser.add_argument("--prefill-tokens", type=int, default=2048, help="prefill length, batch 1 (default 2048)")
    parser.add_argument("--calib-tokens", type=int, default=2048, help="calibration tokens (default 2048)")
    parser.add_argument("--compile-layers", type=int, default=0, help="decoder layers compiled (default 0: all)")
    parser.add_argument("--compile-repeats", type=int, default=1, help="compilations per model (default 1)")
    parser.add_argument(
        "--keep-freed-memory",
        action="store_true",
        help="glibc keeps freed memory for reuse (mallopt): no page faults on each step's large buffers",
    )
    parser.add_argument(
        "--models", nargs="+", choices=list(MODELS), help="models run (default all; the original always is)"
    )
    parser.add_argument(
        "--compile-models", nargs="*", choices=list(MODELS), help="models to compile (default all; none: no compile)"
    )
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument(
        "--threads", type=int, help="torch CPU threads of the training and compile phases (default: torch's)"
    )
    parser.add_argument(
        "--out", type=Path, help="JSON output (default bench/results/train_step/train_step_<device>.json)"
    )
    parser.add_argument("--max-busy", type=float, default=0.15, help="quiet: CPU use over 5 s below this (0.15)")
    parser.add_argument("--max-load", type=float, default=1.0, help="recorded with the load average (default 1.0)")
    parser.add_argument("--wait", type=float, default=600.0, help="seconds to wait for a quiet machine (600)")
    args = parser.parse_args(argv)
    if args.keep_freed_memory:
        keep_freed_memory()
    if args.steps < 3:
        parser.error("--steps must be at least 3 (a warm-up step, a timed step, a measured step)")

    import torch
    from transformers import PrinterCallback, Trainer, TrainerCallback, TrainingArguments
    from transformers.utils import logging as hf_logging

    import convert
    from convert.errors import ConvertError
    from convert.mla.lowrank import factor_absorbed
    from convert.options import resolve_device

    try:
        device = resolve_device(args.device)
    except ConvertError as err:
        parser.error(str(err))
    cuda = device.type == "cuda"
    suffix = "tiny_" if args.model == "tiny" else ""
    args.out = args.out or C.result_file("train_step", f"train_step_{suffix}{device.type}.json")
    dtype = torch.float32

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    quiet = C.wait_quiet(args.max_load, args.wait, args.max_busy)
    whole_run = C.Contention()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()

    t0 = time.perf_counter()
    original, tokenize = load(args.model, dtype)
    original = original.to(device).eval()
    calib = torch.tensor([tokenize(text("prideprejudice"))[: args.calib_tokens]], device=device)
    emma = tokenize(text("emma"))
    need = args.batch * args.window * args.steps + args.prefill_tokens
    if len(emma) < need:
        parser.error(f"Emma has {len(emma)} tokens; --batch × --window × --steps + --prefill-tokens needs {need}")
    prefill_ids = torch.tensor([emma[: args.prefill_tokens]], device=device)
    train_ids = torch.tensor(emma[args.prefill_tokens : need]).view(-1, args.window)  # (windows, window)
    models, convert_s = {}, {}
    for name, options in MODELS.items():
        if args.models and name != "original" and name not in args.models:
            continue
        t1 = time.perf_counter()
        if options is None:
            models[name] = original
        else:
            options = dict(options)
            factored = options.pop("factored_training", False)
            extra = dict(calib=calib, calib_tokens=args.calib_tokens) if options.get("kv_cache_ratio") else {}
            models[name] = convert.to_mla(original, **options, **extra)
            if factored:  # as `convert.factored_training(model)` holds it, for the whole run
                factor_absorbed(models[name])
        convert_s[name] = time.perf_counter() - t1
        print(f"{name}: ready in {convert_s[name]:.1f}s", flush=True)
    names = list(models)
    weights = {n: tensor_bytes([*m.parameters(), *m.buffers()]) for n, m in models.items()}
    parameters = {n: sum(p.numel() for p in m.parameters()) for n, m in models.items()}
    print(f"loaded and converted in {time.perf_counter() - t0:.1f}s", flush=True)

    # -- prefill: peak bytes allocated, once per model (a deterministic figure)
    prefill = {}
    with torch.no_grad():
        for name in names:
            model = models[name].eval()
            model(prefill_ids[:, :16], use_cache=True, logits_to_keep=1)  # warm-up
            sync()
            t1 = time.perf_counter()
            with C.AllocationPeak(device) as peak:
                out = model(prefill_ids, use_cache=True, logits_to_keep=1)
            seconds = time.perf_counter() - t1
            cache = out["cache"] if "cache" in out else out["past_key_values"]  # transformers 5.24 renamed it
            kv = tensor_bytes(t for layer in cache.layers for t in (layer.keys, layer.values))
            prefill[name] = {"peak_bytes": peak.bytes, "kv_cache_bytes": kv, "seconds": seconds}
            if not cuda:
                prefill[name]["largest_allocation_bytes"] = peak.largest
            del out, cache
            gc.collect()
            print(f"{name}: prefill peak {peak.bytes / 2**20:.1f} MiB (KV cache {kv / 2**20:.1f} MiB)", flush=True)

    # -- the arithmetic of a training forward and backward: torch's FLOP counter over one batch (its
    # matmuls: the projections, the MLP and the LM head; it has no formula for SDPA on a CPU)
    from torch.utils.flop_counter import FlopCounterMode

    flops = {}
    flop_ids = train_ids[: args.batch].to(device)
    for name in names:
        model = models[name].train()
        with FlopCounterMode(display=False) as counter:
            model(input_ids=flop_ids, labels=flop_ids, use_cache=False).loss.backward()
        model.zero_grad(set_to_none=True)
        model.eval()
        flops[name] = counter.get_total_flops()
        print(f"{name}: training forward and backward {flops[name] / 1e9:.2f} GFLOP (matmuls)", flush=True)

    # -- training steps under Trainer
    class StepProbe(TrainerCallback):
        """Times each optimizer step; measures the peak memory of step `measure` (not timed)."""

        def __init__(self, measure: int | None):
            self.measure, self.peak, self.state_bytes = measure, None, 0
            self.times, self.cpu_times = [], []

        def on_step_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
            sync()
            self.measuring = state.global_step + 1 == self.measure
            if self.measuring:
                self.state_bytes = tensor_bytes(training_state(model, optimizer))
                self.probe = C.AllocationPeak(device).__enter__()
            self.t0, self.cpu0 = time.perf_counter(), time.process_time()

        def on_step_end(self, args, state, control, **kwargs):
            sync()
            seconds, cpu_seconds = time.perf_counter() - self.t0, time.process_time() - self.cpu0
            if self.measuring:
                self.probe.__exit__(None, None, None)
                self.peak = self.state_bytes + self.probe.bytes
                if cuda:  # the allocator's own peak over the step, everything on the device
                    self.peak = self.probe.start + self.probe.bytes
            elif state.global_step > 1:
                self.times.append(seconds)
                self.cpu_times.append(cpu_seconds)

    # transformers 5.24 renamed gradient checkpointing to activation checkpointing
    ckpt = "activation" if "activation_checkpointing" in TrainingArguments.__dataclass_fields__ else "gradient"

    def train(model, checkpointing: bool, measure: bool, workdir: str) -> StepProbe:
        getattr(model, f"{ckpt}_checkpointing_disable")()
        training = TrainingArguments(
            output_dir=workdir,
            max_steps=args.steps,
            per_device_train_batch_size=args.batch,
            learning_rate=1e-5,
            lr_scheduler_type="constant",
            **{f"{ckpt}_checkpointing": checkpointing},
            save_strategy="no",
            logging_strategy="no",
            report_to="none",
            disable_tqdm=True,
            use_cpu=not cuda,
            dataloader_pin_memory=False,
            seed=0,
        )
        data = [{"input_ids": w, "labels": w} for w in train_ids]
        probe = StepProbe(args.steps if measure else None)
        trainer = Trainer(model=model, args=training, train_dataset=data, callbacks=[probe])
        trainer.remove_callback(PrinterCallback)  # its end-of-training metrics line
        trainer.train()
        probe.optim = training.optim
        getattr(model, f"{ckpt}_checkpointing_disable")()
        model.eval()
        del trainer
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        return probe

    if args.threads:
        torch.set_num_threads(args.threads)
    steps = {f"{n}:{g}": [] for n in names for g in CHECKPOINTING}
    cpu_steps = {f"{n}:{g}": [] for n in names for g in CHECKPOINTING}
    peaks, state_bytes, contention, optim = {}, {}, [], None
    with tempfile.TemporaryDirectory(prefix="train_step-") as workdir:
        for rep in range(args.repeat):
            watch = C.Contention()
            for name in C.rotate(names, rep):
                for g in C.rotate(list(CHECKPOINTING), rep):
                    probe = train(models[name], g == "on", rep == 0, workdir)
                    steps[f"{name}:{g}"] += probe.times
                    cpu_steps[f"{name}:{g}"] += probe.cpu_times
                    optim = probe.optim
                    if rep == 0:
                        peaks[f"{name}:{g}"], state_bytes[f"{name}:{g}"] = probe.peak, probe.state_bytes
            contention.append(watch.report())
            print(
                f"repeat {rep + 1}/{args.repeat}: "
                + ", ".join(f"{k} {C.median(v):.3f}s" for k, v in steps.items())
                + f"; other processes used {contention[-1]['other_cpu_cores']} cores",
                flush=True,
            )

    # -- torch.compile: first compiled training forward and backward minus the eager ones
    from torch._inductor.utils import fresh_cache

    batch_ids = train_ids[: args.batch].to(device)

    def forward(model):
        loss = model(input_ids=batch_ids, labels=batch_ids, use_cache=False).loss
        sync()
        return loss

    def compile_once(model) -> dict:
        layers = model.model.layers
        if args.compile_layers:
            model.model.layers = layers[: args.compile_layers]
        model.train()
        try:
            torch._dynamo.reset()
            with fresh_cache():
                eager, eager_back = [], []
                for _ in range(3):
                    t1 = time.perf_counter()
                    loss = forward(model)
                    t2 = time.perf_counter()
                    loss.backward()
                    sync()
                    eager.append(t2 - t1)
                    eager_back.append(time.perf_counter() - t2)
                    model.zero_grad(set_to_none=True)
                compiled = torch.compile(model)
                t1 = time.perf_counter()
                loss = forward(compiled)
                first = time.perf_counter() - t1
                t1 = time.perf_counter()
                loss.backward()  # AOTAutograd compiles the backward graph at its first call
                sync()
                first_back = time.perf_counter() - t1
                model.zero_grad(set_to_none=True)
                t1 = time.perf_counter()
                forward(compiled)
                again = time.perf_counter() - t1
        finally:
            model.model.layers = layers
            model.zero_grad(set_to_none=True)
            model.eval()
            torch._dynamo.reset()
        eager_s, eager_back_s = C.median(eager[1:]), C.median(eager_back[1:])
        forward_s, backward_s = first - eager_s, first_back - eager_back_s
        return {
            "eager_s": eager_s,
            "eager_backward_s": eager_back_s,
            "first_compiled_s": first,
            "first_compiled_backward_s": first_back,
            "compile_forward_s": forward_s,
            "compile_backward_s": backward_s,
            "compile_s": forward_s + backward_s,
            "compiled_s": again,
        }

    if args.compile_repeats and args.compile_models != []:
        warm = torch.nn.Linear(8, 8).to(device)  # Inductor's one-time start-up, untimed
        with fresh_cache():
            torch.compile(warm)(torch.randn(4, 8, device=device)).sum().backward()
        torch._dynamo.reset()
    compiles = {n: [] for n in names}
    compiled_names = [n for n in names if args.compile_models is None or n in args.compile_models]
    for rep in range(args.compile_repeats if compiled_names else 0):
        for name in C.rotate(compiled_names, rep):
            compiles[name].append(compile_once(models[name]))
            done = compiles[name][-1]
            print(
                f"{name}: compile {done['compile_s']:.1f}s (forward {done['compile_forward_s']:.1f}s, "
                f"backward {done['compile_backward_s']:.1f}s)",
                flush=True,
            )

    # -- summary
    def ratio(x, ref):
        return None if x is None or not ref else x / ref

    summary = {}
    for name in names:
        row = {
            "parameters": parameters[name],
            "weights_bytes": weights[name],
            "convert_s": None if name == "original" else convert_s[name],
            "train_matmul_flops": flops[name],
            "train_matmul_flops_ratio": ratio(flops[name], flops["original"]),
            "prefill_peak_bytes": prefill[name]["peak_bytes"],
            "prefill_ratio": ratio(prefill[name]["peak_bytes"], prefill["original"]["peak_bytes"]),
            "prefill_kv_cache_bytes": prefill[name]["kv_cache_bytes"],
            "compile_s": C.median([c["compile_s"] for c in compiles[name]]),
            "compile_forward_s": C.median([c["compile_forward_s"] for c in compiles[name]]),
            "compile_backward_s": C.median([c["compile_backward_s"] for c in compiles[name]]),
            "eager_forward_s": C.median([c["eager_s"] for c in compiles[name]]),
            "train": {},
        }
        for part in ("", "_forward", "_backward"):
            reference = C.median([c[f"compile{part}_s"] for c in compiles["original"]])
            row[f"compile{part}_ratio"] = ratio(row[f"compile{part}_s"], reference)
        for g in CHECKPOINTING:
            key, ref = f"{name}:{g}", f"original:{g}"
            med, cpu = C.median(steps[key]), C.median(cpu_steps[key])
            row["train"][g] = {
                "median_step_s": med,
                "time_ratio": ratio(med, C.median(steps[ref])),
                "median_step_cpu_s": cpu,
                "cpu_time_ratio": ratio(cpu, C.median(cpu_steps[ref])),
                "peak_bytes": peaks[key],
                "peak_ratio": ratio(peaks[key], peaks[ref]),
                "state_bytes": state_bytes[key],
                "steps_timed": len(steps[key]),
            }
        summary[name] = row

    def verdict(x, goal):
        return "" if x is None else ("" if x <= goal else " (over)")

    print()
    for name, row in summary.items():
        parts = [f"{name}:"]
        for g in CHECKPOINTING:
            t = row["train"][g]
            part = (
                f"step (checkpointing {g}) {t['median_step_s']:.3f}s (CPU time {t['median_step_cpu_s']:.3f}s), "
                f"peak {t['peak_bytes'] / 2**30:.3f} GiB"
            )
            if name != "original":
                part += f" ({t['time_ratio']:.3f}×{verdict(t['time_ratio'], GOALS['step'])}, "
                part += f"CPU time {t['cpu_time_ratio']:.3f}×{verdict(t['cpu_time_ratio'], GOALS['step'])} / "
                part += f"peak {t['peak_ratio']:.3f}×{verdict(t['peak_ratio'], GOALS['peak'])})"
            parts.append(part + ";")
        part = f"training matmuls {row['train_matmul_flops'] / 1e9:.2f} GFLOP"
        if name != "original":
            part += f" ({row['train_matmul_flops_ratio']:.3f}×)"
        parts.append(part + ";")
        part = f"prefill peak {row['prefill_peak_bytes'] / 2**20:.1f} MiB"
        if name != "original":
            part += f" ({row['prefill_ratio']:.3f}×{verdict(row['prefill_ratio'], GOALS['prefill'])})"
        parts.append(part + ";")
        part = "not compiled" if row["compile_s"] is None else f"compile {row['compile_s']:.1f}s"
        if row["compile_s"] is not None:
            part += f" (forward {row['compile_forward_s']:.1f}s, backward {row['compile_backward_s']:.1f}s)"
        if name != "original" and row["compile_ratio"] is not None:
            part += f" ({row['compile_ratio']:.3f}×{verdict(row['compile_ratio'], GOALS['compile'])})"
        parts.append(part)
        print(" ".join(parts), flush=True)

    where = torch.cuda.get_device_name(device) if cuda else f"CPU, {torch.get_num_threads()} threads"
    layers = f"first {args.compile_layers} decoder layers" if args.compile_layers else "all decoder layers"
    print(
        f"\n### {args.model}, float32, {where}: Trainer steps of {args.batch} × {args.window} tokens "
        f"(medians of {args.repeat} repeats × {args.steps - 2}–{args.steps - 1} timed steps), prefill of "
        f"1 × {args.prefill_tokens} tokens, torch.compile of a training forward and backward ({layers})\n"
    )
    rows = []
    for name, row in summary.items():
        off, on = row["train"]["off"], row["train"]["on"]
        rows.append(
            [
                name,
                off["median_step_s"],
                off["time_ratio"],
                off["cpu_time_ratio"],
                off["peak_bytes"] / 2**20,
                off["peak_ratio"],
                on["median_step_s"],
                on["time_ratio"],
                on["cpu_time_ratio"],
                on["peak_bytes"] / 2**20,
                on["peak_ratio"],
                row["prefill_peak_bytes"] / 2**20,
                row["prefill_ratio"],
                row["compile_s"],
                row["compile_ratio"],
            ]
        )
    print(
        C.table(
            [
                "model",
                "s / step",
                "× orig.",
                "CPU time × orig.",
                "peak MiB",
                "× orig.",
                "s / step (ckpt)",
                "× orig.",
                "CPU time × orig. (ckpt)",
                "peak MiB (ckpt)",
                "× orig.",
                "prefill peak MiB",
                "× orig.",
                "compile s",
                "× orig.",
            ],
            rows,
        )
    )
    run_report = whole_run.report()
    print("\n" + C.contention_line(run_report))

    data = C.header("train_step", str(device), quiet)
    data.update(
        {
            "model": args.model,
            "dtype": "float32",
            "models": {n: MODELS[n] for n in names},
            "goals": GOALS,
            "batch": args.batch,
            "window": args.window,
            "steps": args.steps,
            "repeat": args.repeat,
            "optimizer": str(optim),
            "prefill_tokens": args.prefill_tokens,
            "calib_tokens": args.calib_tokens,
            "compile_layers": args.compile_layers or None,
            "compile_repeats": args.compile_repeats,
            "compile_models": [n for n in names if compiles[n]],
            "measures": {
                "train_matmul_flops": "torch.utils.flop_counter over one training forward and backward of "
                "a batch (labels, use_cache=False): its matmuls (projections, MLP, LM head); no SDPA on a CPU",
                "step_s": "on_step_begin to on_step_end, first step of each run left out, last step of "
                "the first repeat left out (measured for memory); wall time, and the process's CPU time "
                "(time.process_time: with --threads 1 the work itself, whatever other processes run)",
                "peak_bytes": "CUDA: torch.cuda.max_memory_allocated over the step; CPU: the training "
                "state's bytes at the step's start + the peak of torch.profiler's memory events over the step",
                "prefill_peak_bytes": "peak bytes allocated during the prefill call above what was allocated "
                "before it (CPU: torch.profiler memory events; CUDA: the allocator's peak), logits_to_keep=1",
                "compile_s": "first call of torch.compile(model) on a training forward minus the eager call, "
                "plus its first backward minus the eager backward (compile_forward_s, compile_backward_s)",
            },
            "summary": summary,
            "step_samples_s": steps,
            "step_cpu_samples_s": cpu_steps,
            "threads": args.threads or torch.get_num_threads(),
            "prefill": prefill,
            "compile": compiles,
            "contention_per_repeat": contention,
            "contention": run_report,
            "torch_threads": torch.get_num_threads(),
            "env": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "TORCHINDUCTOR_COMPILE_THREADS")},
        }
    )
    C.write_json(args.out, data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
