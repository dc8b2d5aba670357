"""Where a conversion may write, and how one run claims that place (docs/design.md, "Output format").

An output is never an input, a file or a symbolic link; it replaces an existing one only with `force` and only where
convert wrote it. One run at a time holds it, and cleans up what dead runs left beside it.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import shutil
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

from convert._version import __version__
from convert.errors import ConvertError, EnvironmentFailure
from convert.io.atomic import environment_errors, process_alive

MANIFEST_NAME = ".convert-manifest.json"
MANIFEST_FORMAT = "convert-output"
MANIFEST_VERSION = 1

log = logging.getLogger("convert")


class _Foreign(Exception):
    """Why an existing path is not an output convert may replace."""


def _absolute(path: Path | str) -> Path:
    return Path(os.path.abspath(path))


# ------------------------------------------------------------------ manifest


def _manifest_base(complete: bool) -> dict:
    return {
        "format": MANIFEST_FORMAT,
        "format_version": MANIFEST_VERSION,
        "converter": __version__,
        "pid": os.getpid(),
        "complete": complete,
    }


def _write_manifest(directory: Path, manifest: dict) -> None:
    (directory / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")


def start_manifest(directory: Path) -> None:
    """Mark a fresh temporary directory as this process's, unfinished (the pid is inside)."""
    _write_manifest(directory, _manifest_base(complete=False))


def finish_manifest(directory: Path) -> dict[str, int]:
    """List every file under `directory` with its size; returns that list."""
    files = {}
    for root, _dirs, names in os.walk(directory):
        for name in names:
            path = Path(root, name)
            rel = path.relative_to(directory).as_posix()
            if rel != MANIFEST_NAME:
                files[rel] = path.lstat().st_size
    files = dict(sorted(files.items()))
    _write_manifest(directory, {**_manifest_base(complete=True), "files": files})
    return files


def _listed_files(directory: Path) -> dict[str, int]:
    """The files a finished manifest in `directory` lists, with their sizes."""
    path = directory / MANIFEST_NAME
    if path.is_symlink() or not path.is_file():
        raise _Foreign(f"has no {MANIFEST_NAME}, so convert did not write it")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise _Foreign(f"has an unreadable {MANIFEST_NAME} ({err})") from err
    files = manifest.get("files") if isinstance(manifest, dict) else None
    valid = isinstance(files, dict) and all(isinstance(k, str) and type(v) is int for k, v in files.items())
    if not valid or manifest.get("format") != MANIFEST_FORMAT or manifest.get("complete") is not True:
        raise _Foreign(f"has a {MANIFEST_NAME} that is not a finished convert manifest")
    assert isinstance(files, dict)  # checked by `valid`
    return files


def _raise(err: OSError) -> None:
    raise err


def _check_tree(directory: Path, files: dict[str, int]) -> None:
    """Every entry under `directory` is a listed file of its listed size (or a folder of them)."""
    folders = {parent.as_posix() for rel in files for parent in Path(rel).parents if parent != Path(".")}
    try:
        for root, dirs, names in os.walk(directory, onerror=_raise):
            for name in dirs + names:
                path = Path(root, name)
                rel = path.relative_to(directory).as_posix()
                is_folder = path.is_dir() and not path.is_symlink()
                if rel == MANIFEST_NAME or (is_folder and rel in folders):
                    continue
                if rel not in files:
                    raise _Foreign(f"holds {rel}, which convert did not write")
                size = path.lstat().st_size
                if path.is_symlink() or not path.is_file() or size != files[rel]:
                    raise _Foreign(f"holds {rel}, changed since convert wrote it ({size} bytes, not {files[rel]})")
    except OSError as err:
        raise _Foreign(f"cannot be read in full ({err.strerror}: {err.filename})") from err


def _why_not_replaceable(out: Path) -> str | None:
    """None when `out` is a directory convert wrote and nobody added to; else why not."""
    if out.is_symlink():
        return "is a symbolic link"
    if not out.is_dir():
        return "is a file, not a directory"
    try:
        _check_tree(out, _listed_files(out))
    except _Foreign as why:
        return str(why)
    return None


# ------------------------------------------------------------------ checks


def _spellings(path: Path | str) -> set[Path]:
    """`path` as written (made absolute) and with every symbolic link resolved."""
    return {_absolute(path), Path(os.path.realpath(path))}


def _input_spellings(src: Path | str) -> set[Path]:
    """An input's spellings, plus where the symbolic links directly inside it point (HF cache layout)."""
    paths = _spellings(src)
    if os.path.isdir(src):
        with suppress(OSError), os.scandir(src) as entries:
            paths |= {Path(os.path.realpath(e.path)) for e in entries if e.is_symlink()}
    return paths


def _relation(out: Path, src: Path) -> str | None:
    if out == src:
        return "is the"
    if out in src.parents:
        return "contains the"
    if src in out.parents:
        return "is inside the"
    return None


def _check_not_input(output: Path | str, inputs: Iterable[Path | str | None]) -> None:
    outs = _spellings(output)
    for src in inputs:
        if src is None:
            continue
        for out in outs:
            for path in _input_spellings(src):
                relation = _relation(out, path)
                if relation:
                    raise ConvertError(
                        f"output {output} {relation} input {src}; convert never writes into, over or around "
                        "its input: choose another -o"
                    )


def _check_parents(output: Path | str, out: Path) -> None:
    if not out.name:
        raise ConvertError(f"output {output} is a file system root; choose a directory to create, with -o")
    for parent in out.parents:
        if os.path.lexists(parent):
            if not os.path.isdir(parent):
                raise ConvertError(f"output {output}: {parent} is a file, not a directory; choose another -o")
            return


def default_output(src: Path | str) -> Path:
    """`<name>-mla` beside the input: ckpt.safetensors -> ckpt-mla/, model_dir -> model_dir-mla/."""
    src = Path(src)
    name = src.stem if src.is_file() else src.name
    return src.resolve().parent / f"{name}-mla"


def check_output(output: Path | str, inputs: Iterable[Path | str | None] = (), force: bool = False) -> None:
    """Refuse (ConvertError, exit 2) an output this run must not create or replace.

    inputs: every path the run reads (the checkpoint, --text, --calib; None is
    skipped). Nothing is written: call it before any work starts.
    """
    out = _absolute(output)
    _check_not_input(output, inputs)
    _check_parents(output, out)
    if not os.path.lexists(out):
        return
    why = _why_not_replaceable(out)
    if why:
        raise ConvertError(
            f"output {output} {why}; --force replaces only a directory convert wrote: move it away yourself "
            "or choose another -o"
        )
    if not force:
        raise ConvertError(
            f"output {output} exists (an earlier conversion); pass --force to replace it or choose another -o"
        )


# ------------------------------------------------------------------ leftovers of dead runs


def _leftover_pattern(out: Path) -> re.Pattern:
    return re.compile(rf"\.{re.escape(out.name)}\.(tmp|old)-(\d+)-[0-9a-f]+")


def _owner_pids(path: Path, kind: str, pid: int) -> set[int]:
    """The pid in the name, and for a temporary directory also the one recorded inside."""
    pids = {pid}
    if kind == "tmp":
        with suppress(OSError, ValueError, AttributeError):
            inside = json.loads((path / MANIFEST_NAME).read_text(encoding="utf-8")).get("pid")
            if type(inside) is int:
                pids.add(inside)
    return pids


def _dispose(path: Path, kind: str, pid: int, out: Path) -> None:
    """Restore a moved-aside old output whose place is empty; otherwise delete the leftover."""
    try:
        if kind == "old" and not os.path.lexists(out):
            os.rename(path, out)
            log.warning("restored %s from %s: convert run %d was stopped while replacing it", out, path.name, pid)
            return
        shutil.rmtree(path)
        log.warning("removed %s, left behind by an interrupted convert run (pid %d)", path, pid)
    except OSError as err:
        log.warning("could not remove %s, left by convert run %d (%s); remove it by hand", path, pid, err.strerror)


def remove_stale_temporaries(output: Path | str) -> None:
    """Dispose of what dead runs left beside `output` (live runs' directories are left alone)."""
    out = _absolute(output)
    pattern = _leftover_pattern(out)
    try:
        with os.scandir(out.parent) as it:
            entries = sorted((e.name, e.is_dir(follow_symlinks=False)) for e in it)
    except OSError:
        return
    for name, is_dir in entries:
        match = pattern.fullmatch(name)
        if not match or not is_dir:
            continue
        path, kind, pid = out.parent / name, match[1], int(match[2])
        if not any(process_alive(p) for p in _owner_pids(path, kind, pid)):
            _dispose(path, kind, pid, out)


# ------------------------------------------------------------------ the lock


@dataclass
class _Claim:
    """This process's hold on one output: the locked file, how often entered, parents it made."""

    fd: int
    count: int = 1
    made_dirs: list[Path] = field(default_factory=list)


_CLAIMS: dict[Path, _Claim] = {}
_CLAIMS_GUARD = threading.Lock()


def lock_path(output: Path | str) -> Path:
    """`.NAME.lock` beside the output."""
    out = _absolute(output)
    return out.parent / f".{out.name}.lock"


def _make_parents(directory: Path) -> list[Path]:
    """mkdir -p; returns the directories it created, deepest first."""
    missing = []
    while not os.path.lexists(directory):
        missing.append(directory)
        directory = directory.parent
    for path in reversed(missing):
        with suppress(FileExistsError):
            os.mkdir(path)
    return missing


def _remove_empty(dirs: list[Path]) -> None:
    for path in dirs:
        try:
            os.rmdir(path)
        except OSError:  # not empty: the output (or someone else's file) is in it
            return


def _holder(fd: int) -> str:
    with suppress(OSError, UnicodeDecodeError):
        return os.pread(fd, 64, 0).decode().strip() or "unknown"
    return "unknown"


def _same_file(fd: int, path: Path) -> bool:
    try:
        here, there = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def _open_locked(output: Path | str, path: Path) -> int:
    """Open and flock `path`; EnvironmentFailure naming the holder when another run has it."""
    for _ in range(100):
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise EnvironmentFailure(
                f"output {output} is being written by another convert run (pid {holder}); wait for it to "
                "finish or choose another -o"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        # The holder deletes the file before it lets go; if that happened between
        # our open and our flock, we hold a deleted file: open the new one.
        if _same_file(fd, path):
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            return fd
        os.close(fd)
    raise EnvironmentFailure(f"output {output}: its lock {path} keeps changing; retry, or choose another -o")


def _acquire(output: Path | str) -> _Claim:
    path = lock_path(output)
    with _CLAIMS_GUARD:
        claim = _CLAIMS.get(path)
        if claim is not None:
            claim.count += 1
            return claim
        with environment_errors(output):
            made = _make_parents(path.parent)
            try:
                fd = _open_locked(output, path)
            except BaseException:
                _remove_empty(made)
                raise
        claim = _CLAIMS[path] = _Claim(fd, made_dirs=made)
        return claim


def _release(output: Path | str) -> None:
    path = lock_path(output)
    with _CLAIMS_GUARD:
        claim = _CLAIMS[path]
        claim.count -= 1
        if claim.count:
            return
        del _CLAIMS[path]
        with suppress(OSError):
            os.unlink(path)  # while still locked: see _open_locked
        os.close(claim.fd)
        _remove_empty(claim.made_dirs)


@contextmanager
def output_lock(output: Path | str, inputs: Iterable[Path | str | None] = (), force: bool = False) -> Iterator[None]:
    """Claim `output` for this run: check it, lock it, clean up after dead runs, check again.

    ConvertError (exit 2) for an output that must not be written (`check_output`),
    EnvironmentFailure (exit 3) when another run holds it or the lock cannot be
    made. Re-entrant within one process; the lock file and any parent
    directories it needed are removed again on leaving, unless the output is in them.

        with output_lock(output, [src], force):    # checks, locks, cleans up
            ...plan, then CheckpointWriter(output, ...), write, commit...
    """
    inputs = list(inputs)
    check_output(output, inputs, force)  # before the lock file, which must not land inside an input
    claim = _acquire(output)
    try:
        if claim.count == 1:
            remove_stale_temporaries(output)
            check_output(output, inputs, force)  # a restored or changed output, now that no one else writes
        yield
    finally:
        _release(output)
