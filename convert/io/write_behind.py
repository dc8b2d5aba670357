"""The writer's background thread (`WriteBehind`): queued byte ranges written into the shard files while the caller computes.

Computed tensors come as memory, copied tensors as lazily read pieces or as spans copied file to file in the kernel.
"""

from __future__ import annotations

import errno
import os
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from convert.errors import ConvertError
from convert.io.locate import RAW_CHUNK

QUEUE_BYTES = 64 * 2**20  # queued tensor bytes before write() waits for the writer thread
SYNC_BYTES = 64 * 2**20  # written bytes per shard before the writer thread flushes them to disk


@dataclass
class Span:
    """`nbytes` bytes at `offset` of the file `path`: copied file to file, never through memory."""

    path: Path
    offset: int


@dataclass
class Job:
    """Bytes for one slot, `nbytes` long: `pieces` is a memoryview, an iterable of bytes read
    lazily, or a `Span` of another file."""

    name: str
    path: Path
    offset: int
    pieces: Any
    nbytes: int
    queued: int  # bytes held in memory while queued (0 for lazily read pieces)


class WriteBehind:
    """One thread writing queued byte ranges into the shard files while the caller computes.

    `submit` blocks while more than `limit` bytes are queued (one larger job is let through
    alone). The first error is kept and raised by the next `submit` or `wait`; the jobs after it
    are dropped. `sync` bytes written to a file since its last flush trigger an fdatasync on this
    thread, so the disk works during the computation instead of all at commit.
    """

    def __init__(
        self, open_shard: Callable[[Path], BinaryIO], limit: int = QUEUE_BYTES, sync: int = SYNC_BYTES
    ) -> None:
        self._open_shard = open_shard  # a preallocated shard file, opened for writing in place
        self._limit, self._sync = limit, sync
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._room = threading.Condition()
        self._queued = 0
        self._error: BaseException | None = None
        self._stop = False
        self._files: dict[Path, Any] = {}
        self._unsynced: dict[Path, int] = {}
        self._thread: threading.Thread | None = None

    def submit(self, job: Job) -> None:
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

    def _write(self, job: Job) -> None:
        f = self._files.get(job.path)
        if f is None:
            f = self._files[job.path] = self._open_shard(job.path)
        if isinstance(job.pieces, Span):
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

    def _copy(self, span: Span, out: int, offset: int, nbytes: int) -> None:
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
