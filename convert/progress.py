"""Progress of long work: a tqdm bar on a terminal; without one (a log file, CI, nohup) a plain
line on stderr every `INTERVAL` seconds and one at the end, so redirected runs are not silent."""

import operator
import sys
import time

from tqdm.auto import tqdm

INTERVAL = 30.0  # seconds between log lines off a terminal; read at each item, so tests may patch it
_clock = time.monotonic  # patchable too: tests run the log on a fake clock


def progress(iterable, desc: str, unit: str, enabled: bool, total: int | None = None):
    """Wrap `iterable` (or, if None, count `update()` calls up to `total`). Quiet when not `enabled`.
    The result iterates like the iterable and has tqdm's `update(n)`, `set_postfix(dict)`, `close()`."""
    if not enabled or sys.stderr.isatty():
        return tqdm(iterable, total=total, desc=desc, unit=unit, disable=not enabled)
    return LogProgress(iterable, desc, unit, total)


def _duration(seconds: float) -> str:
    minutes, s = divmod(int(seconds), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{s:02d}"


class LogProgress:
    """Log lines instead of a bar: "verifying: layer 12/30, 0.52 layer/s, ETA 0:00:35"."""

    def __init__(self, iterable, desc: str, unit: str, total: int | None = None):
        self.iterable, self.desc, self.unit = iterable, desc, unit
        self.total = total if total is not None or iterable is None else operator.length_hint(iterable, 0) or None
        self.n, self.postfix, self.closed = 0, {}, False
        self.start = self.last = _clock()

    def __iter__(self):
        for item in self.iterable:
            yield item
            self.update()  # the consumer asks for the next item: this one is done (as tqdm counts)
        self.close()

    def set_postfix(self, values: dict | None = None, **more) -> None:
        self.postfix = {**(values or {}), **more}

    def update(self, n: int = 1) -> None:
        self.n += n
        now = _clock()
        if now - self.last >= INTERVAL:
            self.last = now
            self._log(now)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._log(_clock(), done=True)

    def _log(self, now: float, done: bool = False) -> None:
        elapsed = now - self.start
        rate = self.n / elapsed if elapsed > 0 else None
        parts = [f"{self.desc}: {self.unit} {self.n}" + (f"/{self.total}" if self.total else "")]
        if rate is not None:
            parts.append(f"{rate:.3g} {self.unit}/s" if rate < 1000 else f"{rate:.0f} {self.unit}/s")
        parts += [f"{key}={value}" for key, value in self.postfix.items()]
        if done:
            parts.append(f"done in {_duration(elapsed)}")
        elif self.total:
            parts.append(f"ETA {_duration((self.total - self.n) / rate)}" if rate else "ETA unknown")
        print(", ".join(parts), file=sys.stderr, flush=True)
