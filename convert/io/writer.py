"""Streaming, atomic, sharded safetensors writer: a checkpoint written while the caller computes the next layer.

A failed or interrupted run leaves no half-written output.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import queue
import re
import shutil
import struct
import threading
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

import torch

from convert.errors import ConvertError
from convert.io.atomic import environment_errors, fsync_dir, make_sibling, move_into_place, signals_deferred
from convert.io.locate import INDEX_NAME, RAW_CHUNK, SINGLE_NAME
from convert.io.output import MANIFEST_NAME, check_output, finish_manifest, output_lock, start_manifest
from convert.io.reader import TORCH_TO_SAFETENSORS, dtype_itemsize

log = logging.getLogger("convert")

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> int:
    """Parse a byte size: ``"5GB"`` -> 5*10**9, ``"2GiB"`` -> 2*2**30, ``"1000"`` -> 1000."""
    if isinstance(text, int) and not isinstance(text, bool) and text > 0:
        return text
    match = _SIZE_RE.match(str(text))
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise ConvertError(f"--max-shard-size: cannot parse {str(text)!r}; use bytes or a unit like 5GB, 500MB, 2GiB")
    try:
        size = int(Decimal(match.group(1)) * _UNITS[unit])
    except InvalidOperation:  # pragma: no cover - the regex admits only decimals
        size = 0
    if size <= 0:
        raise ConvertError(f"--max-shard-size: {str(text)!r} is not a positive size; use e.g. 5GB, 500MB, 2GiB")
    return size


@dataclass
class _Slot:
    """Where one planned tensor goes."""

    shard: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int = 0  # absolute offset in the shard file
    nbytes: int = 0


@dataclass
class _Shard:
    """One output file: its tensors in data order and its total size."""

    names: list[str] = field(default_factory=list)
    data_bytes: int = 0
    filename: str = ""
    file_size: int = 0


def _shard_filename(index: int, count: int) -> str:
    if count == 1:
        return SINGLE_NAME
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes in row-major order, without numpy dtype limitations."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    # Viewing as uint8 works for every dtype (bf16, fp8, bool) and numpy
    # always understands uint8; no copy beyond contiguous() is made.
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


QUEUE_BYTES = 64 * 2**20  # queued tensor bytes before write() waits for the writer thread
SYNC_BYTES = 64 * 2**20  # written bytes per shard before the writer thread flushes them to disk


@dataclass
class _Span:
    """`nbytes` bytes at `offset` of the file `path`: copied file to file, never through memory."""

    path: Path
    offset: int


@dataclass
class _Job:
    """Bytes for one slot, `nbytes` long: `pieces` is a memoryview, an iterable of bytes read
    lazily, or a `_Span` of another file."""

    name: str
    path: Path
    offset: int
    pieces: Any
    nbytes: int
    queued: int  # bytes held in memory while queued (0 for lazily read pieces)


class _WriteBehind:
    """One thread writing queued byte ranges into the shard files while the caller computes.

    `submit` blocks while more than `limit` bytes are queued (one larger job is let through
    alone). The first error is kept and raised by the next `submit` or `wait`; the jobs after it
    are dropped. `sync` bytes written to a file since its last flush trigger an fdatasync on this
    thread, so the disk works during the computation instead of all at commit.
    """

    def __init__(self, limit: int = QUEUE_BYTES, sync: int = SYNC_BYTES) -> None:
        self._limit, self._sync = limit, sync
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._room = threading.Condition()
        self._queued = 0
        self._error: BaseException | None = None
        self._stop = False
        self._files: dict[Path, Any] = {}
        self._unsynced: dict[Path, int] = {}
        self._thread: threading.Thread | None = None

    def submit(self, job: _Job) -> None:
        self._raise()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="convert-writer", daemon=True)
            self._thread.start()
        with self._room:
            while self._queued and self._queued + job.queued > self._limit and self._error is None:
                self._room.wait()
            self._queued += job.queued
        self._jobs.put(job)

    def wait(self) -> None:
        """Until everything submitted is written (or failed); raises the first error."""
        if self._thread is not None:
            self._jobs.join()
        self._raise()

    def close(self) -> None:
        """Stop (the job in progress ends at its next piece), join the thread, close the files."""
        self._stop = True
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()
            self._thread = None
        for f in self._files.values():
            f.close()
        self._files.clear()

    def _raise(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            self._stop = True
            raise error

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                if self._error is None and not self._stop:
                    self._write(job)
            except BaseException as error:  # handed to the caller's thread
                self._error = error
            finally:
                with self._room:
                    self._queued -= job.queued
                    self._room.notify_all()
                self._jobs.task_done()
        self._jobs.task_done()

    def _write(self, job: _Job) -> None:
        f = self._files.get(job.path)
        if f is None:
            f = self._files[job.path] = open(job.path, "r+b")
        if isinstance(job.pieces, _Span):
            self._copy(job.pieces, f.fileno(), job.offset, job.nbytes)
            self._written_to(job.path, f, job.nbytes)
            return
        f.seek(job.offset)
        written = 0
        for piece in [job.pieces] if isinstance(job.pieces, memoryview) else job.pieces:
            if self._stop:
                return
            written += len(piece)
            if written > job.nbytes:
                break
            f.write(piece)
        if written != job.nbytes:
            raise ConvertError(
                f"tensor '{job.name}': got {written} bytes, plan needs {job.nbytes}; fix the plan or the data"
            )
        self._written_to(job.path, f, written)

    def _written_to(self, path: Path, f, nbytes: int) -> None:
        f.flush()  # readable by other handles once `wait` returns
        self._unsynced[path] = self._unsynced.get(path, 0) + nbytes
        if self._unsynced[path] >= self._sync:
            os.fdatasync(f.fileno())
            self._unsynced[path] = 0

    def _copy(self, span: _Span, out: int, offset: int, nbytes: int) -> None:
        """Copy in the kernel (copy_file_range: no pass through this process's memory), or, where
        the file systems refuse it, through one reused buffer."""
        with open(span.path, "rb", buffering=0) as source:
            done = 0
            try:
                while done < nbytes and not self._stop:
                    step = os.copy_file_range(source.fileno(), out, nbytes - done, span.offset + done, offset + done)
                    if step == 0:
                        break
                    done += step
            except OSError as error:
                if error.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
                    raise
            buffer = memoryview(bytearray(min(RAW_CHUNK, max(nbytes - done, 1))))
            while done < nbytes and not self._stop:
                step = os.preadv(source.fileno(), [buffer[: nbytes - done]], span.offset + done)
                if step == 0:
                    break
                os.pwrite(out, buffer[:step], offset + done)
                done += step
        if done != nbytes and not self._stop:
            raise ConvertError(
                f"{span.path}: {nbytes - done} bytes missing at the end of a tensor (file shrank while open?); "
                "re-download or re-export the checkpoint"
            )


class CheckpointWriter:
    """Write a (possibly sharded) safetensors checkpoint atomically.

    ``plan`` maps every tensor name to ``(shape, dtype)``, in the order the
    tensors should be laid out across shards. A new shard starts when the
    next tensor would push the current one past ``max_shard_size`` bytes.
    Use as a context manager; ``commit()`` must be called explicitly, and
    leaving the block without it (or with an exception) aborts.

    Construction claims the output with ``output_lock`` (ConvertError for an
    output convert must not create or replace, EnvironmentFailure while
    another run holds it) until ``commit()`` or ``abort()``; a caller that
    already holds it (re-entrant) keeps it longer.

    Since the plan is known up front, every shard's header is written and its file preallocated
    first; tensors then arrive in any order and are written by background threads while the
    caller computes. Everything goes to a hidden temporary sibling (``.NAME.tmp-<pid>-<random>``)
    that ``commit()`` moves into place in one step, listing every file in
    ``.convert-manifest.json``. An ``OSError`` becomes one ``EnvironmentFailure`` line naming the
    output and the fix (exit 3).
    """

    def __init__(
        self,
        output: Path,
        plan: dict[str, tuple[tuple[int, ...], torch.dtype]],
        max_shard_size: int,
        force: bool = False,
        metadata: dict[str, str] | None = None,
    ) -> None:
        self.output = Path(output)
        self.force = force
        self._path = Path(os.path.abspath(output))
        if max_shard_size <= 0:
            raise ConvertError(f"--max-shard-size: must be positive, got {max_shard_size}; use e.g. 5GB")
        self._metadata = self._check_metadata(metadata)
        self._slots = self._check_plan(plan)
        self._shards = self._assign_shards(max_shard_size)
        self._written: set[str] = set()
        # Computed tensors and file-to-file copies on two threads: a tensor never waits in memory
        # behind a long copy of the embeddings.
        self._behind, self._copies = _WriteBehind(), _WriteBehind()
        self._done = False
        self._replaced: Path | None = None  # the previous output, moved away by commit()
        self._tmp: Path | None = None
        # Held until commit() or abort(): re-entrant, so a caller may hold it longer.
        self._claim = ExitStack()
        self._claim.enter_context(output_lock(self.output, (), force))
        try:
            with self._os_errors():
                self._tmp = make_sibling(self._path, "tmp")
                start_manifest(self._tmp)
                self._preallocate()
        except BaseException:
            self.abort()
            raise

    # ------------------------------------------------------------ planning

    @staticmethod
    def _check_metadata(metadata: dict[str, str] | None) -> dict[str, str]:
        # transformers refuses safetensors files whose metadata lacks format=pt.
        merged = {"format": "pt", **(metadata or {})}
        for key, value in merged.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise ConvertError(
                    f"safetensors metadata {key!r}: keys and values must be strings; convert them with str()"
                )
        return merged

    @staticmethod
    def _check_plan(plan: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> dict[str, _Slot]:
        slots: dict[str, _Slot] = {}
        for name, (shape, dtype) in plan.items():
            if name == "__metadata__":
                raise ConvertError("tensor name '__metadata__' is reserved by safetensors; rename the tensor")
            if dtype not in TORCH_TO_SAFETENSORS:
                raise ConvertError(
                    f"tensor '{name}': dtype {dtype} cannot be stored in safetensors; cast it to "
                    "float32, float16 or bfloat16"
                )
            shape = tuple(int(d) for d in shape)
            if any(d < 0 for d in shape):
                raise ConvertError(f"tensor '{name}': negative dimension in planned shape {shape}; fix the plan")
            nbytes = math.prod(shape) * dtype_itemsize(dtype)
            slots[name] = _Slot(shard=-1, shape=shape, dtype=dtype, nbytes=nbytes)
        return slots

    def _assign_shards(self, max_shard_size: int) -> list[_Shard]:
        shards = [_Shard()]
        for name, slot in self._slots.items():
            current = shards[-1]
            if current.names and current.data_bytes + slot.nbytes > max_shard_size:
                current = _Shard()
                shards.append(current)
            current.names.append(name)
            current.data_bytes += slot.nbytes
            slot.shard = len(shards) - 1
        for i, shard in enumerate(shards):
            shard.filename = _shard_filename(i, len(shards))
        return shards

    def _header_bytes(self, shard: _Shard) -> bytes:
        """Lay out ``shard``'s tensors and return its padded header (length prefix included)."""
        # Largest item size first keeps every tensor aligned to its element
        # size (the data section starts at a multiple of 8), as safetensors does.
        ordered = sorted(shard.names, key=lambda n: -dtype_itemsize(self._slots[n].dtype))
        shard.names = ordered
        header: dict[str, Any] = {"__metadata__": self._metadata}
        cursor = 0
        for name in ordered:
            slot = self._slots[name]
            header[name] = {
                "dtype": TORCH_TO_SAFETENSORS[slot.dtype],
                "shape": list(slot.shape),
                "data_offsets": [cursor, cursor + slot.nbytes],
            }
            slot.offset = cursor  # relative for now; made absolute below
            cursor += slot.nbytes
        body = json.dumps(header, separators=(",", ":")).encode("utf-8")
        body += b" " * (-len(body) % 8)
        return struct.pack("<Q", len(body)) + body

    def _preallocate(self) -> None:
        for shard in self._shards:
            head = self._header_bytes(shard)
            for name in shard.names:
                self._slots[name].offset += len(head)
            shard.file_size = len(head) + shard.data_bytes
            with open(self._tmp / shard.filename, "wb") as f:
                f.write(head)
                # Sparse preallocation: reserves the final size so writes can
                # seek anywhere, without touching the data blocks.
                f.truncate(shard.file_size)

    # ------------------------------------------------------------ writing

    @property
    def tmp_dir(self) -> Path:
        """The temporary directory everything is written to before commit."""
        return self._tmp

    @property
    def shard_files(self) -> list[str]:
        """Shard file names, in order."""
        return [s.filename for s in self._shards]

    def _slot_for(self, name: str, nbytes: int | None = None) -> _Slot:
        self._check_open()
        slot = self._slots.get(name)
        if slot is None:
            raise ConvertError(f"tensor '{name}' is not in the output plan; add it to the plan or drop it")
        if name in self._written:
            raise ConvertError(f"tensor '{name}' written twice; write each planned tensor once")
        if nbytes is not None and nbytes != slot.nbytes:
            raise ConvertError(
                f"tensor '{name}': got {nbytes} bytes, plan needs {slot.nbytes} "
                f"({list(slot.shape)} x {slot.dtype}); fix the plan or the data"
            )
        return slot

    def _put(self, name: str, slot: _Slot, pieces, queued: int) -> None:
        path = self._tmp / self._shards[slot.shard].filename
        thread = self._behind if queued else self._copies
        with self._os_errors():
            thread.submit(_Job(name, path, slot.offset, pieces, slot.nbytes, queued))
        self._written.add(name)

    def flush(self) -> None:
        """Wait until every tensor handed over is on its way to disk (written, not yet fsynced);
        raises what the writer thread met. After it, the sources of `write_chunks` may close."""
        self._check_open()
        with self._os_errors():
            self._behind.wait()
            self._copies.wait()

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write planned tensor ``name``; shape and dtype must match the plan exactly.

        It is written by the writer thread: the tensor must not change after this call."""
        slot = self._slot_for(name)
        if tuple(tensor.shape) != slot.shape or tensor.dtype != slot.dtype:
            raise ConvertError(
                f"tensor '{name}': got shape {list(tensor.shape)} {tensor.dtype}, plan says "
                f"{list(slot.shape)} {slot.dtype}; fix the conversion or the plan"
            )
        self._put(name, slot, _tensor_bytes(tensor), slot.nbytes)

    def write_raw(self, name: str, data: bytes) -> None:
        """Write planned tensor ``name`` from its exact little-endian bytes."""
        slot = self._slot_for(name, len(data))
        self._put(name, slot, memoryview(data), slot.nbytes)

    def write_chunks(self, name: str, chunks) -> None:
        """Write planned tensor ``name`` from its exact bytes in consecutive pieces, pulled from
        the iterable `chunks` by the writer thread (a copy that never holds the whole tensor);
        they must add up to the planned size. Keep their source open until `flush`."""
        self._put(name, self._slot_for(name), chunks, 0)

    def copy_span(self, name: str, path: Path, offset: int, nbytes: int) -> None:
        """Write planned tensor ``name`` as a copy of `nbytes` bytes at `offset` of the file `path`
        (its stored bytes in a source checkpoint): file to file by the writer thread."""
        self._put(name, self._slot_for(name, nbytes), _Span(Path(path), offset), 0)

    def _extra_path(self, filename: str) -> Path:
        self._check_open()
        rel = Path(filename)
        reserved = {INDEX_NAME, MANIFEST_NAME, *self.shard_files}
        if rel.is_absolute() or ".." in rel.parts or not rel.parts or str(rel) in reserved:
            raise ConvertError(
                f"output file '{filename}': must be a relative name inside the output directory "
                "and not a weights file; choose another name"
            )
        path = self._tmp / rel
        with self._os_errors():
            path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def write_json(self, filename: str, obj: Any) -> None:
        """Write ``obj`` as indented JSON to ``filename`` in the output directory."""
        self.write_text(filename, json.dumps(obj, indent=2) + "\n")

    def write_text(self, filename: str, text: str) -> None:
        """Write UTF-8 ``text`` to ``filename`` in the output directory."""
        path = self._extra_path(filename)
        with self._os_errors():
            path.write_text(text, encoding="utf-8")

    def write_file(self, filename: str, data: bytes) -> None:
        """Write raw ``data`` to ``filename`` in the output directory."""
        path = self._extra_path(filename)
        with self._os_errors():
            path.write_bytes(data)

    def copy_file(self, filename: str, source: Path) -> None:
        """Copy the file ``source`` to ``filename`` in the output directory (contents only, umask modes)."""
        path = self._extra_path(filename)
        with self._os_errors():
            shutil.copyfile(source, path)

    # ------------------------------------------------------------ finishing

    def _os_errors(self) -> AbstractContextManager[None]:
        """OSError -> EnvironmentFailure naming the output, the fix and the space it needs."""
        return environment_errors(self.output, sum(s.file_size for s in self._shards) or None)

    def _check_open(self) -> None:
        if self._done:
            raise ConvertError(f"{self.output}: writer already committed or aborted; create a new writer")

    def _check_complete(self) -> None:
        missing = [n for n in self._slots if n not in self._written]
        if missing:
            more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
            raise ConvertError(
                f"{self.output}: planned tensor '{missing[0]}'{more} never written; "
                "this is a converter bug, please report it"
            )

    def write_index(self) -> None:
        """Write the shard index now (commit writes it too), so the temporary directory
        opens as a checkpoint before the commit: verification reads it there."""
        self.flush()
        self._check_complete()
        with self._os_errors():
            self._write_index()

    def _write_index(self) -> None:
        if len(self._shards) == 1:
            return
        weight_map = {name: self._shards[slot.shard].filename for name, slot in self._slots.items()}
        index = {
            "metadata": {"total_size": sum(s.nbytes for s in self._slots.values())},
            "weight_map": weight_map,
        }
        (self._tmp / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")

    def _fsync_tree(self) -> None:
        for path in sorted(self._tmp.rglob("*")):
            if path.is_file():
                with open(path, "rb") as f:
                    os.fsync(f.fileno())
        fsync_dir(self._tmp)

    def _swap_into_place(self) -> None:
        # Checked again: someone may have put files into the old output during the run.
        check_output(self.output, (), self.force)
        # Ctrl-C waits for the swap, so the renames are never left half done.
        with signals_deferred():
            self._replaced = move_into_place(self._tmp, self._path)
            self._done = True
        fsync_dir(self._path.parent)

    def commit(self) -> Path:
        """Check completeness, list the files, fsync, and move into place; returns the output dir.

        The previous output (``force``) stays in place until the new one takes
        its place in one step, and is deleted after. On failure the temporary
        directory is removed and nothing is created or replaced.
        """
        self._check_open()
        try:
            self.flush()
            self._behind.close()
            self._copies.close()
            self._check_complete()
            with self._os_errors():
                self._write_index()
                finish_manifest(self._tmp)
                self._fsync_tree()
                self._swap_into_place()
        finally:
            self.abort()  # after a successful swap: only deletes the replaced output and unlocks
        return self.output

    def abort(self) -> None:
        """Discard everything written and release the output; safe to call more than once."""
        self._behind.close()
        self._copies.close()
        if not self._done:
            self._done = True
            if self._tmp is not None:
                shutil.rmtree(self._tmp, ignore_errors=True)
        if self._replaced is not None:
            _remove_replaced(self._replaced)
            self._replaced = None
        self._claim.close()

    def __enter__(self) -> CheckpointWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        # commit() is deliberate; leaving the block without it discards the output.
        self.abort()


def _remove_replaced(path: Path) -> None:
    """Delete the output that commit() replaced; a later run removes what this cannot."""
    shutil.rmtree(path, ignore_errors=True)
    if os.path.lexists(path):
        log.warning("could not remove the replaced output at %s; remove it by hand", path)
