"""The memory model of verification: what whole-model and streamed verification hold, and the
memory free to hold it (docs/performance.md, "Memory"). `--e2e auto` decides from it whether to verify
whole models or stream them, and whether greedy generation runs; bench/memory.py holds the
estimates against measured peaks."""

import math
import os
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path

import torch

from convert.errors import ConvertError
from convert.io.reader import dtype_itemsize
from convert.sizes import gib
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
    mla = config.get("mla") or {}  # a bare file's config has only its `mla` section
    hidden = config.get("hidden_size") or mla["hidden_size"]
    n_heads = config.get("num_attention_heads") or mla["n_heads"]
    intermediate = config.get("intermediate_size") or 4 * hidden
    w = min(tokens, window)
    modules = stored.layer_bytes * run // stored_size + stored.tensor_bytes
    streams = 3 if stored_size < 4 else 2
    states = streams * 2 * tokens * hidden * run
    inside = w * (3 * intermediate + 6 * hidden) * run + 2 * n_heads * w * w * max(run, 4)
    chunk = min(VOCAB_CHUNK, config.get("vocab_size") or VOCAB_CHUNK)  # rows of the lm_head read at once
    logits = 9 * w * chunk * 8 + 2 * chunk * hidden * (run + stored_size)
    return modules + states + inside + logits


#: Positions of a window whose float64 figures `convert.verify.e2e.window_figures` computes at once: a
#: 151,936-word vocabulary's (1,024 × V) float64 tensors were 1.2 GB each, several at a time (the 1.5B's
#: healing ran out of memory in its after-figures, the optimizer's state still held).
FIGURE_ROWS = 128


def whole_model_activation_bytes(tokens: int, vocab: int, window: int = 1024) -> int:
    """The (window × vocab) tensors whole-model verification holds at once: what `whole_model_memory_bytes`
    leaves out. Both models' logits (2 × 8 bytes a value at most) and, for `FIGURE_ROWS` positions at a
    time, their float64 copies, log-softmaxes, difference and p (6 × 8 bytes)."""
    rows = min(tokens, window)
    return 2 * rows * vocab * 8 + 6 * min(rows, FIGURE_ROWS) * vocab * 8


def available_memory_bytes(device: torch.device) -> int:
    """Memory free for new tensors on `device`: on a GPU what CUDA reports free; on the CPU the
    kernel's MemAvailable, or the headroom of a memory-limited cgroup (a container) if smaller."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    # an int: the headroom is a float only where infinite (no cgroup limit), and then MemAvailable is the least
    return int(min(_mem_available(), _cgroup_headroom()))


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


# --------------------------------------------------------------------------- the cap (--max-memory)

# The default cap on a run's resident memory: what the process held when the run began, plus the original
# checkpoint's size, plus this (or what streamed verification needs, if more). From the command line (0.38 GiB
# of imports): SmolLM2 in float32 (538 MB) 1.48 GB, Qwen2.5-0.5B in float32 (1.98 GB) 2.94 GB.
DEFAULT_CAP_EXTRA = 2**29  # 0.5 GiB
# A default cap raised to what a run needs leaves this much more: the resident memory it was raised from moves
# before the run checks its room (the 1.5B's llamacpp export was refused by a few bytes, after converting).
RAISED_CAP_SLACK = 2**27  # 128 MiB
_RUN_START: ContextVar[int | None] = ContextVar("run_start_rss", default=None)
_CAP_ACCEPTED: ContextVar[bool] = ContextVar("cap_accepted", default=False)  # --max-memory checked up front
PROC_STATUS = Path("/proc/self/status")


def _status_bytes(key: str) -> int:
    """A /proc/self/status memory field (VmRSS, VmHWM) in bytes; 0 where there is none (not Linux)."""
    try:
        for line in PROC_STATUS.read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def process_rss_bytes() -> int:
    """This process's resident memory now (VmRSS)."""
    return _status_bytes("VmRSS")


def process_peak_bytes() -> int:
    """This process's peak resident memory so far (VmHWM): what the report states as measured."""
    return _status_bytes("VmHWM")


@contextmanager
def memory_run():
    """The scope of one run (a conversion and its verification, or a verification alone): the resident
    memory when it began is what the default cap is counted from. Nested scopes keep the outer one's."""
    if _RUN_START.get() is not None:
        yield
        return
    token, accepted = _RUN_START.set(process_rss_bytes()), _CAP_ACCEPTED.set(False)
    try:
        yield
    finally:
        _RUN_START.reset(token)
        _CAP_ACCEPTED.reset(accepted)


@dataclass(frozen=True)
class MemoryCap:
    """The bound a run keeps its resident memory under: `cap_bytes`, from `--max-memory` (`explicit`)
    or the default (`DEFAULT_CAP_EXTRA` over the original checkpoint, or more where the model's
    streamed verification, or an export's whole one, needs it); `why`: how it was chosen."""

    cap_bytes: int
    explicit: bool
    why: str

    def room(self, device: torch.device) -> tuple[int, str]:
        """Bytes verification may still allocate on `device`: the memory free less the margin
        (`free_margin_bytes`), and on the CPU no more than the cap less this process's resident
        memory; with the figures, for a reason line. A GPU's own memory is bounded by what it has free."""
        free = available_memory_bytes(device)
        usable = free - free_margin_bytes(free)
        words = f"the {gib(max(usable, 0))} usable of the {gib(free)} free on {device}"
        if device.type == "cpu":
            headroom = self.cap_bytes - process_rss_bytes()
            if headroom < usable:
                usable, words = (
                    headroom,
                    f"the {gib(max(headroom, 0))} left under the memory cap of {gib(self.cap_bytes)}",
                )
        return usable, words

    def to_report(self, peak: int) -> dict:
        return {"cap_bytes": self.cap_bytes, "cap_explicit": self.explicit, "cap_why": self.why, "peak_rss_bytes": peak}


def memory_cap(cap: int | None, checkpoint_bytes: int, needed: int, what: str) -> MemoryCap:
    """The run's cap on this process's resident memory: `cap` (--max-memory) when given, refused (exit 2,
    naming the smallest cap that works) where it cannot hold `needed` bytes beside the resident memory
    now; else the default: the resident memory when the run began (`memory_run`), the checkpoint's
    `checkpoint_bytes` and `DEFAULT_CAP_EXTRA`, raised to what `needed` asks. what: the least the run
    needs `needed` for, in words."""
    smallest = process_rss_bytes() + needed
    if cap is not None:
        if cap < smallest and not _CAP_ACCEPTED.get():  # refused once, up front: then the run keeps to its least
            raise ConvertError(
                f"--max-memory {gib(cap)} cannot hold {what}: it needs about {gib(smallest)} (this process "
                f"{gib(process_rss_bytes())} and {gib(needed)} more); pass --max-memory {_round_up(smallest)} or "
                "more, or --no-verify"
            )
        _CAP_ACCEPTED.set(True)
        return MemoryCap(cap, True, "--max-memory")
    start = _RUN_START.get() or process_rss_bytes()
    default = start + checkpoint_bytes + DEFAULT_CAP_EXTRA
    if smallest > default:
        return MemoryCap(smallest + RAISED_CAP_SLACK, False, f"default, raised to what {what} needs")
    words = f"default: the {gib(start)} held at the start, the checkpoint's {gib(checkpoint_bytes)} and {gib(DEFAULT_CAP_EXTRA)}"
    return MemoryCap(default, False, words)


def _round_up(n: int) -> str:
    """`n` bytes rounded up to a tenth of a GiB, as --max-memory takes it: `1.4GiB`."""
    return f"{math.ceil(n / 2**30 * 10) / 10:.1f}GiB"


def stored_layers(original: dict, converted: dict, n_layers: int) -> StoredLayers:
    """`StoredLayers` of a pair given as {tensor name: (shape, dtype)}: the larger of a converted
    decoder layer and an original one plus a converted attention, the largest decoder tensor. A
    checkpoint without numbered decoder layers (the seed's notation) counts as one layer."""
    nbytes = lambda shape, dtype: math.prod(shape) * dtype_itemsize(dtype)
    numbered = any(".layers." in n for n in converted)

    def layer(tensors: dict, i: int, part: str = "") -> int:
        inside = (lambda n: n.startswith(f"model.layers.{i}.{part}")) if numbered else (lambda n: True)
        return sum(nbytes(*tensors[n]) for n in tensors if inside(n))

    layers = range(n_layers) if numbered else range(1)
    layer_bytes = max(max(layer(converted, i), layer(original, i) + layer(converted, i, "self_attn.")) for i in layers)
    decoder = {n: v for n, v in {**original, **converted}.items() if ".layers." in n or not numbered}
    tensor_bytes = max(nbytes(*v) for v in decoder.values())
    return StoredLayers(layer_bytes, tensor_bytes, next(dtype for _, dtype in decoder.values()))
