"""Progress of long work: a tqdm bar on a terminal; without one (a log file, CI, nohup) plain lines
on stderr: a bar's every `INTERVAL` seconds and at its end; a phase's (`phase`; a whole command is
one, `opening`) once it has run `FIRST` seconds, then a heartbeat thread's whenever `INTERVAL`
passes with no line, so redirected runs are never silent and quick work (or a quick refusal) adds none."""

import operator
import sys
import threading
import time
from contextlib import contextmanager

from tqdm.auto import tqdm

INTERVAL = 30.0  # seconds between log lines off a terminal; read at each item, so tests may patch it
FIRST = 2.0  # a phase says it started once it has run this long with no other line
_EARLY = 0.95  # the heartbeat speaks after this share of INTERVAL of silence: its wake-up never stretches a gap
_clock = time.monotonic  # patchable too: tests run the log on a fake clock

_lock = threading.RLock()
_wake = threading.Condition(_lock)  # the heartbeat waits on it; a phase that opens makes a line due sooner
_open: list = []  # the open phases, and the bars inside them, innermost last: the heartbeat speaks for it
_said = 0.0  # _clock() when the last line was printed
_stop: threading.Event | None = None  # set to end the heartbeat thread once no phase is open


def progress(iterable, desc: str, unit: str, enabled: bool, total: int | None = None):
    """Wrap `iterable` (or, if None, count `update()` calls up to `total`). Quiet when not `enabled`.
    The result iterates like the iterable and has tqdm's `update(n)`, `set_postfix(dict)`, `close()`."""
    if not enabled or sys.stderr.isatty():
        return tqdm(iterable, total=total, desc=desc, unit=unit, disable=not enabled)
    return LogProgress(iterable, desc, unit, total)


def progress_bar(desc: str, unit: str, enabled: bool):
    """Progress over an iterable: a bar on a terminal, log lines otherwise, nothing when quiet."""
    return lambda items: progress(items, desc, unit, enabled)


@contextmanager
def phase(desc: str, enabled: bool, end: bool = True):
    """Work that is not a loop (loading a model, an end-to-end check). Off a terminal: "desc ..." once
    it has run `FIRST` seconds with no other line, "desc: 0:00:30 elapsed, still working" whenever
    it is silent for `INTERVAL`, and (`end`) "desc: done in 0:01:05" if it said anything; nothing
    more if it raises (the error says why). On a terminal "desc ..." at once. Quiet when not `enabled`."""
    if not enabled or sys.stderr.isatty():
        if enabled:
            tqdm.write(f"{desc} ...", file=sys.stderr)
        yield
        return
    work = _Phase(desc)
    _opened(work)
    try:
        yield
        if end and work.said:
            now = _clock()
            _say(f"{desc}: done in {_duration(now - work.start)}", now)
    finally:
        _closed(work)


def opening(desc: str, enabled: bool):
    """A whole command as a `phase` (its first line within `FIRST` seconds, then the heartbeat in
    every part of it), with no line at the end: the summary follows."""
    return phase(desc, enabled, end=False)


def _duration(seconds: float) -> str:
    minutes, s = divmod(int(seconds), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{s:02d}"


def _say(line: str, now: float) -> None:
    """One line on stderr, whole (the heartbeat thread writes too), and the time it was said."""
    global _said
    with _lock:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
        _said = now


def _opened(work: "_Phase") -> None:
    """`work` is open, the innermost: a line is due `FIRST` seconds from its start at the latest."""
    global _said, _stop
    with _lock:
        if INTERVAL <= 0:  # every item logs: no heartbeat, a phase says it started at once
            work.beat(work.start)
        due = work.start - INTERVAL * _EARLY + min(FIRST, INTERVAL * _EARLY)  # as if a line had been said then
        work.before, _said = _said, min(_said, due) if _open else due
        if not _open and INTERVAL > 0:
            _stop = threading.Event()
            threading.Thread(target=_heartbeat, args=(_stop,), daemon=True).start()
        _open.append(work)
        _wake.notify_all()


def _closed(work) -> None:
    global _said, _stop
    with _lock:
        if work in _open:
            del _open[_open.index(work) :]  # with the bars an error left open inside it
        if isinstance(work, _Phase) and not work.said:
            _said = max(_said, work.before)  # a quick phase: the line it made due is not owed
        if not _open and _stop is not None:
            _stop.set()
            _stop = None
            _wake.notify_all()


def _heartbeat(stop: threading.Event) -> None:
    """Until `stop`: whenever INTERVAL (less a margin) passes with no line, the innermost open phase
    or bar says where it is."""
    with _lock:
        while not stop.is_set():
            now = _clock()
            if now - _said >= INTERVAL * _EARLY:
                _open[-1].beat(now)
            _wake.wait(max(_said + INTERVAL * _EARLY - now, 0.01))


class _Phase:
    """An open `phase` for the heartbeat: its opening line, if not yet said, else the time it has taken."""

    def __init__(self, desc: str):
        self.desc, self.said, self.start, self.before = desc, False, _clock(), 0.0

    def beat(self, now: float) -> None:
        if self.said:
            _say(f"{self.desc}: {_duration(now - self.start)} elapsed, still working", now)
        else:
            self.said = True
            _say(f"{self.desc} ...", now)


class LogProgress:
    """Log lines instead of a bar: "verifying: layer 12/30, 0.52 layer/s, ETA 0:00:35"; inside a phase,
    while no item completes, "verifying: layer 12/30, 0:01:05 elapsed, still working"."""

    postfix: dict[str, object]  # `set_postfix`'s values, shown as key=value

    def __init__(self, iterable, desc: str, unit: str, total: int | None = None):
        global _said
        self.iterable, self.desc, self.unit = iterable, desc, unit
        self.total = total if total is not None or iterable is None else operator.length_hint(iterable, 0) or None
        self.n, self.n_said, self.postfix, self.closed = 0, 0, {}, False
        self.start = _clock()
        with _lock:
            if _open:  # inside a phase: the heartbeat speaks for it
                _open.append(self)
            else:  # on its own (the API's bars): a line once INTERVAL passes, as items complete
                _said = self.start

    def __iter__(self):
        finished = False
        try:
            for item in self.iterable:
                yield item
                self.update()  # the consumer asks for the next item: this one is done (as tqdm counts)
            finished = True
        finally:
            if finished:
                self.close()
            else:  # the consumer stopped early (an error): no line, the error says why
                self.closed = True
                _closed(self)

    def set_postfix(self, values: dict | None = None, **more) -> None:
        self.postfix = {**(values or {}), **more}

    def update(self, n: int = 1) -> None:
        self.n += n
        now = _clock()
        if now - _said >= INTERVAL:
            self._log(now)

    def beat(self, now: float) -> None:
        self._log(now, still=self.n == self.n_said)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            _closed(self)
            self._log(_clock(), done=True)

    def _log(self, now: float, done: bool = False, still: bool = False) -> None:
        elapsed = now - self.start
        rate = self.n / elapsed if elapsed > 0 else None
        parts = [f"{self.desc}: {self.unit} {self.n}" + (f"/{self.total}" if self.total else "")]
        if rate is not None and not still:
            parts.append(f"{rate:.3g} {self.unit}/s" if rate < 1000 else f"{rate:.0f} {self.unit}/s")
        parts += [f"{key}={value}" for key, value in self.postfix.items()]
        if done:
            parts.append(f"done in {_duration(elapsed)}")
        elif still:
            parts.append(f"{_duration(elapsed)} elapsed, still working")
        elif self.total:
            parts.append(f"ETA {_duration((self.total - self.n) / rate)}" if rate else "ETA unknown")
        self.n_said = self.n
        _say(", ".join(parts), now)
