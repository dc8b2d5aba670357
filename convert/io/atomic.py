"""File-system primitives for writing an output safely: a new output replaces the old one in one step.

An `OSError` from the machine becomes one `EnvironmentFailure` line (exit 3) naming the output and the fix; Ctrl-C and
SIGTERM wait until a swap has finished.
"""

from __future__ import annotations

import ctypes
import errno
import os
import secrets
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from convert.errors import EnvironmentFailure

_FIXES: dict[int | None, str] = {  # by OSError.errno (None for an error raised without one)
    errno.ENOSPC: "no space left on the device: free {need}space on it or choose another -o",
    errno.EDQUOT: "disk quota exceeded: free {need}space or raise the quota, or choose another -o",
    errno.EACCES: "permission denied: make {parent} writable for you or choose another -o",
    errno.EPERM: "operation not permitted: make {parent} writable for you or choose another -o",
    errno.EROFS: "read-only file system: choose an -o on a writable file system",
    errno.ENAMETOOLONG: "file name too long: choose a shorter -o (each name at most 230 bytes)",
}


def environment_failure(err: OSError, output: Path | str, needed: int | None = None) -> EnvironmentFailure:
    """One line for an OS error met while writing `output`: what failed, where, and the fix."""
    need = f"at least {needed:,} bytes of " if needed else ""
    default = f"{err.strerror or err}: check the disk and the path, or choose another -o"
    fix = _FIXES.get(err.errno, default).format(need=need, parent=Path(output).parent)
    where = f" ({err.filename})" if err.filename and str(err.filename) != str(output) else ""
    return EnvironmentFailure(f"cannot write {output}{where}: {fix}".replace("\n", " "))


@contextmanager
def environment_errors(output: Path | str, needed: int | None = None) -> Iterator[None]:
    """Turn any `OSError` inside the block into an `EnvironmentFailure` about `output`."""
    try:
        yield
    except OSError as err:
        raise environment_failure(err, output, needed) from err


# ------------------------------------------------------------------ names


def sibling_name(output: Path, kind: str, pid: int | None = None) -> Path:
    """`.NAME.KIND-<pid>-<random>` beside `output` (KIND is tmp or old): the pid lets a later run tell a dead
    process left it."""
    pid = os.getpid() if pid is None else pid
    return output.parent / f".{output.name}.{kind}-{pid}-{secrets.token_hex(4)}"


def make_sibling(output: Path, kind: str) -> Path:
    """Create an empty hidden directory beside `output`, with the process umask (not mkdtemp's 0700)."""
    while True:
        path = sibling_name(output, kind)
        try:
            os.mkdir(path)
            return path
        except FileExistsError:  # the random part collided: draw again
            continue


def process_alive(pid: int) -> bool:
    """Whether process `pid` exists (a process of another user counts as alive)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ------------------------------------------------------------------ renames

_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2
_UNSUPPORTED = {errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP}


def _load_renameat2():
    try:
        return getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    except (OSError, TypeError):  # no C library to load (some platforms)
        return None


_renameat2 = _load_renameat2()


def _rename2(src: Path, dst: Path, flags: int) -> bool:
    """renameat2(src, dst, flags); False when the kernel or file system lacks it."""
    if _renameat2 is None:
        return False
    rc = _renameat2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags)
    if rc == 0:
        return True
    code = ctypes.get_errno()
    if code in _UNSUPPORTED:
        return False
    raise OSError(code, os.strerror(code), str(dst))


def _exchange(new: Path, target: Path) -> bool:
    """Swap two directories in one step; False where that is not supported."""
    return _rename2(new, target, _RENAME_EXCHANGE)


def _rename_new(new: Path, target: Path) -> None:
    """Rename `new` to `target`, which must not exist (never silently replaces one)."""
    if _rename2(new, target, _RENAME_NOREPLACE):
        return
    if os.path.lexists(target):
        raise FileExistsError(errno.EEXIST, "appeared during the conversion", str(target))
    os.rename(new, target)


def _move_aside(target: Path, aside: Path) -> None:
    os.rename(target, aside)


def move_into_place(new: Path, target: Path) -> Path | None:
    """Put directory `new` at `target`; return where the replaced one now is (None if none).

    Either the old `target` or the new one is in place at every moment, except
    between the two renames of the fallback, where the old one waits at a
    `.NAME.old-<pid>-*` sibling that a later run restores if this one dies.
    The swap is one `renameat2(RENAME_EXCHANGE)` where the kernel has it; the fallback renames
    the old one aside, the new one in, and puts the old one back on failure.
    """
    if not os.path.lexists(target):
        _rename_new(new, target)
        return None
    if _exchange(new, target):
        return new  # the old output now sits at new's name
    aside = sibling_name(target, "old")
    try:
        _move_aside(target, aside)
        os.rename(new, target)
    except BaseException:
        if os.path.lexists(aside) and not os.path.lexists(target):
            os.rename(aside, target)
        raise
    return aside


@contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold SIGINT and SIGTERM until the block is done, then deliver them (main thread only).

    A Python-level handler, not a signal mask: the kernel may hand a process
    signal to any thread (torch starts several), and only the handler is sure
    to see it.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(sig) is not None:  # None: a handler set outside Python, left alone
            previous[sig] = signal.signal(sig, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for signum in dict.fromkeys(caught):
            signal.raise_signal(signum)


def fsync_dir(path: Path) -> None:
    """fsync a directory so a rename in it is durable (not supported on every OS)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
