"""Shared helpers of the benchmark scripts: the machine, medians, tables, JSON.

Not a benchmark itself. Each script in bench/ imports it as `_common` (the
scripts put their own directory on sys.path).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
FIXTURES = REPO / "fixtures"
RESULTS = BENCH / "results"

if str(FIXTURES) not in sys.path:
    sys.path.insert(0, str(FIXTURES))


def smollm2_dir() -> Path:
    """The cached float32 SmolLM2-135M-Instruct directory (fixtures/realdata.py)."""
    import realdata

    return Path(realdata.smollm2_dir())


def austen_file(book: str = "emma") -> Path:
    """A UTF-8 text file with one of Austen's novels, written once into the results dir."""
    import realdata

    path = RESULTS / "austen.tmp" / f"{book}.txt"  # *.tmp is git-ignored; .txt, as --calib and --text ask
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.is_file():
        path.write_text(realdata.austen_text(book), encoding="utf-8")
    return path


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def load_average() -> tuple[float, float, float] | None:
    try:
        return os.getloadavg()
    except OSError:
        return None


def busy_cores(seconds: float = 5.0) -> float | None:
    """Cores the whole machine kept busy over `seconds` (/proc/stat), sampled now."""
    before = Contention._busy_s()
    time.sleep(seconds)
    after = Contention._busy_s()
    return None if before is None or after is None else (after - before) / seconds


def wait_quiet(max_load: float, max_wait_s: float, max_busy: float = 0.15) -> dict:
    """Wait (up to max_wait_s) until the machine is quiet, then go on either way.

    Quiet: over a 5-second sample the machine's CPU use (/proc/stat) is below
    `max_busy` cores. The 1-minute load average is recorded too (and `max_load`
    with it), but it is not the criterion: it stays high for a minute after a
    previous benchmark of our own. The JSON says what was seen.
    """
    start = time.time()
    while True:
        busy = busy_cores()
        load = load_average()
        quiet = busy is None or busy < max_busy
        if quiet or time.time() - start >= max_wait_s:
            break
        print(f"[bench] other processes keep {busy:.2f} cores busy; waiting ...", file=sys.stderr, flush=True)
        time.sleep(10)
    if not quiet:
        print(
            f"[bench] WARNING: the machine is not quiet ({busy:.2f} cores busy); timings will be noisy", file=sys.stderr
        )
    return {
        "busy_cores_before_start": None if busy is None else round(busy, 3),
        "max_busy": max_busy,
        "load_average_at_start": load,
        "max_load": max_load,
        "quiet": quiet,
        "waited_s": round(time.time() - start, 1),
    }


class Contention:
    """CPU time used by *other* processes while a benchmark runs.

    /proc/stat's busy time of the whole machine minus this process's (and its
    waited-for children's) own CPU time, over the wall time: 0 on a quiet
    machine, ~1 when another process keeps one core busy. The load average
    cannot tell this apart from the benchmark's own threads.
    """

    def __init__(self):
        self.start = self._snapshot()

    @staticmethod
    def _busy_s() -> float | None:
        try:
            fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
        except OSError:
            return None
        user, nice, system, idle, iowait, irq, softirq, steal = (int(x) for x in fields[:8])
        return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")

    @staticmethod
    def _own_s() -> float:
        import resource

        total = 0.0
        for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
            r = resource.getrusage(who)
            total += r.ru_utime + r.ru_stime
        return total

    def _snapshot(self):
        return time.perf_counter(), self._busy_s(), self._own_s()

    def report(self) -> dict:
        t1, busy1, own1 = self._snapshot()
        t0, busy0, own0 = self.start
        if busy0 is None or busy1 is None:
            return {"other_cpu_cores": None}
        wall = t1 - t0
        other = max(0.0, (busy1 - busy0) - (own1 - own0))
        return {
            "wall_s": round(wall, 1),
            "own_cpu_s": round(own1 - own0, 1),
            "other_cpu_s": round(other, 1),
            "other_cpu_cores": round(other / wall, 3) if wall > 0 else None,
            "load_average_at_end": load_average(),
        }


def contention_line(report: dict, limit: float = 0.1) -> str:
    """One line for the end of a run: how much CPU other processes used."""
    cores = report.get("other_cpu_cores")
    line = f"other processes used {cores} cores on average during the run"
    if cores is not None and cores > limit:
        line += " -- WARNING: not a quiet machine, these timings are inflated (rerun when it is quiet)"
    return line


def cpuinfo_field(field: str) -> str:
    """The first processor's `field` in /proc/cpuinfo ("model name", "flags"; "" where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, _, value = line.partition(":")
            if name.strip() == field:
                return value.strip()
    except OSError:
        pass
    return ""


def _cpu_model() -> str:
    return cpuinfo_field("model name") or platform.processor() or platform.machine()


def _mem_total_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def machine(device: str = "cpu") -> dict:
    import torch

    info = {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memory_gib": _mem_total_gib(),
        "torch": torch.__version__,
        "device": device,
        "env": {
            k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "MKL_NUM_THREADS")
        },
    }
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:  # pragma: no cover
        pass
    try:
        import safetensors

        info["safetensors"] = safetensors.__version__
    except ImportError:  # pragma: no cover
        pass
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(0)
        info["cuda"] = torch.version.cuda
    try:
        info["git_commit"] = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "convert"], cwd=REPO, capture_output=True, text=True)
        info["convert_dirty"] = bool(dirty.stdout.strip())
    except (OSError, subprocess.CalledProcessError):
        pass
    return info


def command_line() -> str:
    return " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv])


def header(name: str, device: str, quiet: dict) -> dict:
    return {
        "benchmark": name,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command_line(),
        "machine": machine(device),
        "load": quiet,
    }


def result_file(bench: str, name: str | None = None) -> Path:
    """Where `bench` writes by default: bench/results/<bench>/<name>, one folder per bench (name: <bench>.json)."""
    return RESULTS / bench / (name or f"{bench}.json")


def source_commit() -> str:
    """The commit the benches run from, "+changes" when tracked files but results differ from it ("unknown": no git)."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True)
        code = [".", ":(exclude)bench/results"]  # a result written a moment ago is not a change to the code
        dirty = subprocess.run(
            ["git", "diff", "--quiet", "HEAD", "--", *code], cwd=REPO, capture_output=True
        ).returncode
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head.stdout.strip() + ("+changes" if dirty else "")


def write_json(path: Path, data: dict) -> None:
    """Write a bench's result, stamped with the commit it ran from (`source_commit`) unless it names one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {**data, "commit": data.get("commit") or source_commit()}
    path.write_text(json.dumps(data, indent=2, default=_default) + "\n")
    print(f"\nwrote {path}")


def _default(obj):
    if isinstance(obj, Path):
        return str(obj)
    if hasattr(obj, "tolist"):
        return obj.tolist()
    raise TypeError(f"not JSON serializable: {type(obj)}")


def table(headers: list[str], rows: list[list]) -> str:
    """A Markdown table."""
    cells = [[_cell(c) for c in row] for row in rows]
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out += ["| " + " | ".join(row) + " |" for row in cells]
    return "\n".join(out)


def _cell(value) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        if value == 0:
            return "0"
        if abs(value) >= 100:
            return f"{value:.0f}"
        if abs(value) >= 1:
            return f"{value:.2f}"
        if abs(value) >= 1e-3:
            return f"{value:.3f}"
        return f"{value:.2e}"
    return str(value)


def rotate(items: list, k: int) -> list:
    """items rotated by k: interleaved variants change position from repeat to repeat."""
    k %= len(items)
    return items[k:] + items[:k]


def add_common_args(parser, name: str, repeat: int = 5) -> None:
    parser.add_argument("--repeat", type=int, default=repeat, help=f"repeats (default {repeat})")
    parser.add_argument(
        "--out",
        type=Path,
        default=result_file(name),
        help=f"JSON output (default bench/results/{name}/{name}.json)",
    )
    parser.add_argument(
        "--max-busy",
        type=float,
        default=0.15,
        help="quiet = the machine's CPU use over 5 s below this many cores (default 0.15)",
    )
    parser.add_argument(
        "--max-load", type=float, default=1.0, help="recorded with the 1-minute load average (default 1.0)"
    )
    parser.add_argument(
        "--wait",
        type=float,
        default=600.0,
        help="seconds to wait for a quiet machine before starting anyway (default 600)",
    )


class AllocationPeak:
    """The peak of the bytes torch allocates on `device` inside a `with` block, above what was
    allocated at its start: `with AllocationPeak("cpu") as peak: ...`, then `peak.bytes`.

    CUDA: the caching allocator's own count (`torch.cuda.max_memory_allocated` after
    `reset_peak_memory_stats`, minus `memory_allocated` at the start; `peak.start` is that start).
    CPU, where torch keeps no such count: torch.profiler's memory events (`profile_memory=True`),
    one per allocation and free of torch's CPU allocator with its address, on every thread that
    reports to the profiler, in time order; their running sum's maximum is the peak. Blocks
    allocated before the block are unknown to the profiler: their frees are left out, so the
    figure never undershoots (a block that frees older tensors is charged for its allocations
    only). Memory outside torch's allocator (numpy, Python objects) is not counted; nor are the
    profiler's own buffers.

    `peak.largest` (CPU): the largest single allocation in the block (a (B, H, L, S) score tensor
    shows there). detail=True (CPU): `peak.live_at_peak` lists the allocations live at the peak, largest first,
    each with its size and the ops and Python functions that made it (innermost first), and
    `peak.top(n)` prints them: what dominates a peak."""

    def __init__(self, device="cpu", detail: bool = False):
        import torch

        self.device = torch.device(device)
        self.detail = detail
        self.bytes: int | None = None
        self.largest: int | None = None
        self.start: int | None = None
        self.live_at_peak: list[tuple[int, str]] = []
        self._profiler = None

    def __enter__(self):
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.start = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            from torch.profiler import ProfilerActivity, profile

            self._profiler = profile(
                activities=[ProfilerActivity.CPU], profile_memory=True, with_stack=self.detail, record_shapes=False
            )
            self._profiler.__enter__()
        return self

    def __exit__(self, *exc):
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.bytes = torch.cuda.max_memory_allocated(self.device) - self.start
            return False
        self._profiler.__exit__(*exc)
        if exc[0] is None:
            self.bytes, self.largest, self.live_at_peak = _cpu_allocation_peak(self._profiler, self.detail)
        self._profiler = None
        return False

    def top(self, n: int = 10) -> str:
        """The `n` largest allocations live at the peak, one line each (detail=True)."""
        lines = [f"peak {self.bytes:,} B; largest allocations live at the peak:"]
        lines += [f"  {size:>14,} B  {where}" for size, where in self.live_at_peak[:n]]
        return "\n".join(lines)


def peak_allocated(fn, *args, device="cpu", **kwargs):
    """(fn(*args, **kwargs), the peak bytes it allocated on `device` above what was allocated
    before it): `AllocationPeak` around one call."""
    with AllocationPeak(device) as peak:
        result = fn(*args, **kwargs)
    return result, peak.bytes


def _cpu_allocation_peak(profiler, detail: bool) -> tuple[int, int, list[tuple[int, str]]]:
    """(peak bytes, largest allocation, [(bytes, made by) live at the peak, largest first]) of a
    profiler's CPU allocation events: allocations and frees paired by address, in time order."""
    from torch._C._profiler import _EventType

    events = []  # (time, ptr, size, node)
    stack = list(profiler.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node.tag == _EventType.Allocation:
            fields = node.extra_fields
            if fields.device.type == "cpu":
                events.append((node.start_time_ns, fields.ptr, fields.alloc_size, node))
    events.sort(key=lambda e: e[0])
    live, total, peak, peak_at = {}, 0, 0, -1
    for k, (_, ptr, size, _) in enumerate(events):
        if size > 0:
            live[ptr] = size
            total += size
        elif ptr in live:  # a free of a block allocated before the profiler started is not known
            total -= live.pop(ptr)
        if total > peak:
            peak, peak_at = total, k
    largest = max((size for _, _, size, _ in events), default=0)
    if not detail:
        return peak, largest, []
    live = {}
    for _, ptr, size, node in events[: peak_at + 1]:
        if size > 0:
            live[ptr] = (size, node)
        else:
            live.pop(ptr, None)
    made = sorted(((size, _made_by(node)) for size, node in live.values()), key=lambda x: -x[0])
    return peak, largest, made


def _made_by(node, depth: int = 6) -> str:
    """The ops and Python functions around a profiler allocation event, innermost first."""
    names, parent = [], node.parent
    while parent is not None and len(names) < depth:
        name = parent.name
        skip = name.startswith(("torch/nn/modules/module.py", "<built-in method", "torch/_ops.py", "torch/utils/"))
        if not skip and name not in names:
            names.append(name.replace(str(REPO) + "/", ""))
        parent = parent.parent
    return " <- ".join(names)
