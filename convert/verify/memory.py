"""The memory model of verification: what whole-model and streamed verification hold, and the
memory free to hold it (docs/design.md, "Memory"). `--e2e auto` decides from it whether to verify
whole models or stream them, and whether greedy generation runs; bench/memory.py holds the
estimates against measured peaks."""

import math
import os
from dataclasses import dataclass
from pathlib import Path

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
# `--e2e auto` loads whole models only into the free memory less a margin: the larger of 1 GiB and
# a fifth of what is free. The estimates run up to 7% under measured peaks (bench/memory.py), and
# the free memory is a snapshot: other processes (or a GPU's other users) grow meanwhile, and part
# of MemAvailable is page cache holding the very checkpoints being read.
FREE_MARGIN_MIN = 2**30
FREE_MARGIN_FRACTION = 0.2
# Where the CPU's free memory is read (module constants, so that tests can point them at fakes).
MEMINFO = Path("/proc/meminfo")
PROC_CGROUP = Path("/proc/self/cgroup")
CGROUP_ROOT = Path("/sys/fs/cgroup")
# Per cgroup version: the limit's file, the usage's, and the usage's reclaimable part (in memory.stat).
CGROUP_FILES = {
    2: ("memory.max", "memory.current", "inactive_file"),
    1: ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"),
}


def whole_model_memory_bytes(checkpoint_bytes: int, checkpoint_dtype: torch.dtype, run_dtype: torch.dtype) -> int:
    """Memory that whole-model verification needs: both models and activations, in `run_dtype`."""
    return int(WHOLE_MODEL_FACTOR * checkpoint_bytes * dtype_itemsize(run_dtype) / dtype_itemsize(checkpoint_dtype))


def one_model_memory_bytes(checkpoint_bytes: int, checkpoint_dtype: torch.dtype, dtype: torch.dtype) -> int:
    """Memory of one whole model in `dtype` (a few dozen tokens' KV cache and activations besides,
    and the tensor being read in), `ONE_MODEL_FACTOR` x its weights."""
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
    """Memory free for new tensors on `device`: on a GPU what CUDA reports free; on the CPU the
    kernel's MemAvailable, or the headroom of a memory-limited cgroup (a container) if smaller."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return min(_mem_available(), _cgroup_headroom())


def free_margin_bytes(free: int) -> int:
    """What `--e2e auto` leaves unused of `free` bytes (`FREE_MARGIN_FRACTION`, at least `FREE_MARGIN_MIN`)."""
    return max(FREE_MARGIN_MIN, int(FREE_MARGIN_FRACTION * free))


def _mem_available() -> int:
    try:
        fields = dict(line.split(":", 1) for line in MEMINFO.read_text().splitlines())
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _cgroup_headroom() -> float:
    """The least headroom (limit less usage) of the memory cgroups this process is in, its own and
    each above it, v2 or v1; infinite where none sets a limit ("max", or no such files)."""
    return min((_headroom(directory, *CGROUP_FILES[v]) for directory, v in _cgroup_dirs()), default=math.inf)


def _cgroup_dirs():
    """(directory, version) of this process's memory cgroup and of each above it, from /proc/self/cgroup
    ("0::/path" for v2, "N:...memory...:/path" for v1); in a container the mount's root is its own."""
    try:
        lines = PROC_CGROUP.read_text().splitlines()
    except OSError:
        return
    for hierarchy, controllers, path in (line.split(":", 2) for line in lines if line.count(":") >= 2):
        version = 2 if hierarchy == "0" and not controllers else 1 if "memory" in controllers.split(",") else None
        if version is None:
            continue
        root = CGROUP_ROOT if version == 2 else CGROUP_ROOT / "memory"
        directory = root / path.strip("/")
        while directory != root:
            yield directory, version
            directory = directory.parent
        yield root, version


def _headroom(directory: Path, limit_file: str, usage_file: str, reclaimable: str) -> float:
    """A cgroup's limit less its usage, the reclaimable page cache not counted as used."""
    try:
        limit = (directory / limit_file).read_text().strip()
        if limit == "max":
            return math.inf
        return int(limit) - int((directory / usage_file).read_text()) + _stat(directory).get(reclaimable, 0)
    except (OSError, ValueError):
        return math.inf


def _stat(directory: Path) -> dict[str, int]:
    try:
        pairs = [line.split() for line in (directory / "memory.stat").read_text().splitlines()]
        return {pair[0]: int(pair[1]) for pair in pairs if len(pair) == 2}
    except (OSError, ValueError):
        return {}
