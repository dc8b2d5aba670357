"""The memory model of verification: what whole-model and streamed verification hold, the memory
bound a default run keeps to, and the memory available (docs/design.md, "Memory"). `--e2e auto`
decides from it whether to verify whole models or stream them, and whether greedy generation runs;
bench/memory.py holds the estimates against measured peaks."""

import math
import os
import re
from dataclasses import dataclass

import torch

from convert.io.reader import dtype_itemsize
from convert.verify.streamed import VOCAB_CHUNK

# Whole-model verification holds both models plus activations: this many times
# the checkpoint (in the run's dtype).
WHOLE_MODEL_FACTOR = 2.5
# One whole model for greedy generation (`one_model_memory_bytes`): its weights, read straight into
# it, and the transients of building it and of a short generation (measured: 1.08x SmolLM2's
# converted model, 1.18x a 2-layer Llama-3-8B shape's).
ONE_MODEL_FACTOR = 1.2
# The memory bound of a streamed run (`memory_bound_bytes`): this plus twice the largest layer.
MEMORY_BOUND_BASE = 2**30
# A process's own memory once torch, transformers and convert are imported (bench/memory.py's
# baseline: 0.33 GiB on CPU), which the bound includes.
PROCESS_BASE_BYTES = 350 * 2**20


def whole_model_memory_bytes(checkpoint_bytes: int, checkpoint_dtype: torch.dtype, run_dtype: torch.dtype) -> int:
    """Memory that whole-model verification needs: both models and activations, in `run_dtype`."""
    return int(WHOLE_MODEL_FACTOR * checkpoint_bytes * dtype_itemsize(run_dtype) / dtype_itemsize(checkpoint_dtype))


def largest_layer_bytes(*checkpoints) -> int:
    """The largest single layer as stored in any of `checkpoints`: one decoder layer's tensors
    together, or one tensor outside the decoder layers (the embedding, the lm_head)."""
    layers: dict[tuple, int] = {}
    for i, checkpoint in enumerate(checkpoints):
        for name in checkpoint.keys():
            match = re.search(r"\.layers\.(\d+)\.", name)
            key = (i, match.group(1) if match else name)
            nbytes = math.prod(checkpoint.shape(name)) * dtype_itemsize(checkpoint.dtype(name))
            layers[key] = layers.get(key, 0) + nbytes
    return max(layers.values(), default=0)


def memory_bound_bytes(largest_layer: int) -> int:
    """The peak a streamed conversion with verification keeps to (the process included): 1 GiB
    plus two of its largest layers. `--e2e auto` runs greedy generation only within it."""
    return MEMORY_BOUND_BASE + 2 * largest_layer


def one_model_memory_bytes(checkpoint_bytes: int, checkpoint_dtype: torch.dtype, dtype: torch.dtype) -> int:
    """Memory of one whole model in `dtype` (greedy generation under --e2e auto: a few dozen tokens'
    KV cache and activations besides, and the tensor being read in), `ONE_MODEL_FACTOR` x its weights."""
    return int(ONE_MODEL_FACTOR * checkpoint_bytes * dtype_itemsize(dtype) / dtype_itemsize(checkpoint_dtype))


@dataclass(frozen=True)
class StoredLayers:
    """What streamed verification reads of its checkpoints, as stored.

    layer_bytes: the most module bytes in memory at once: the larger of a converted decoder layer
    and (per-layer check) an original decoder layer plus a converted attention. tensor_bytes: the
    largest single tensor. dtype: the checkpoint's.
    """

    layer_bytes: int
    tensor_bytes: int
    dtype: torch.dtype


def streamed_verify_memory_bytes(
    stored: StoredLayers, config: dict, run_dtype: torch.dtype, tokens: int, window: int = 1024
) -> int:
    """Tensor memory of streamed verification (convert.verify.streamed, .layers), the process not counted.

    Modules are allocated in `run_dtype` and filled one tensor at a time, each read as stored and
    cast by the copy into the module. Then both models' hidden states of all `tokens`, one layer's
    activations on a window (MLP (w, 3·intermediate), attention scores (heads, w, w) twice; sizes
    from config.json), and one vocabulary chunk (`VOCAB_CHUNK` rows): two models' lm_head rows
    (chunk, hidden) as read and in the run's dtype, and the float64 (w, chunk) tensors
    `streamed._window_figures` holds at once (both models' logits, the previous chunk's while the
    next is made, their difference, the softmax weights and the temporaries of their products:
    nine). A half-precision checkpoint's exact conversion runs the original's twin
    (`convert.verify.twin`) as a third stream.
    """
    run, stored_size = dtype_itemsize(run_dtype), dtype_itemsize(stored.dtype)
    hidden, intermediate, n_heads = config["hidden_size"], config["intermediate_size"], config["num_attention_heads"]
    w = min(tokens, window)
    modules = stored.layer_bytes * run // stored_size + stored.tensor_bytes
    streams = 3 if stored_size < 4 else 2
    states = streams * 2 * tokens * hidden * run
    inside = w * (3 * intermediate + 6 * hidden) * run + 2 * n_heads * w * w * max(run, 4)
    logits = 9 * w * VOCAB_CHUNK * 8 + 2 * VOCAB_CHUNK * hidden * (run + stored_size)
    return modules + states + inside + logits


def whole_model_activation_bytes(tokens: int, vocab: int, window: int = 1024) -> int:
    """The (window × vocab) float64 tensors whole-model verification holds at once (the logits of
    both models, their log-softmaxes, the difference, p): what `whole_model_memory_bytes` leaves out."""
    return 6 * min(tokens, window) * vocab * 8


def available_memory_bytes(device: torch.device) -> int:
    """Memory free for new tensors on `device` (CPU: the kernel's MemAvailable)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
