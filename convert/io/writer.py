"""Streaming, atomic, sharded safetensors writer: a checkpoint written while the caller computes the next layer.

Shards are planned up front (`convert.io.shards`) and filled by background threads (`convert.io.write_behind`);
a failed or interrupted run leaves no half-written output.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from contextlib import AbstractContextManager, ExitStack
from pathlib import Path
from typing import Any

import torch

from convert.errors import ConvertError
from convert.io.atomic import environment_errors, fsync_dir, make_sibling, move_into_place, signals_deferred
from convert.io.locate import INDEX_NAME
from convert.io.output import MANIFEST_NAME, check_output, finish_manifest, output_lock, start_manifest
from convert.io.shards import Slot, assign_shards, check_metadata, header_bytes, plan_slots
from convert.io.write_behind import QUEUE_BYTES, Job, Span, WriteBehind

# Importers of `convert.io.writer` find these here too.
__all__ = ["QUEUE_BYTES", "CheckpointWriter"]

log = logging.getLogger("convert")


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes in row-major order, without numpy dtype limitations."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    # Viewing as uint8 works for every dtype (bf16, fp8, bool) and numpy
    # always understands uint8; no copy beyond contiguous() is made.
    array = flat.view(torch.uint8).numpy()
    return memoryview(array).cast("B")  # type: ignore[arg-type]  # numpy's stubs: ndarray.__buffer__ is 3.12+ only


def _open_shard(path: Path):
    """A preallocated shard file, opened to be written in place (by the writer threads)."""
    return open(path, "r+b")


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
        self._metadata = check_metadata(metadata)
        self._slots = plan_slots(plan)
        self._shards = assign_shards(self._slots, max_shard_size)
        self._written: set[str] = set()
        # Computed tensors and file-to-file copies on two threads: a tensor never waits in memory
        # behind a long copy of the embeddings.
        self._behind, self._copies = WriteBehind(_open_shard), WriteBehind(_open_shard)
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

    def _preallocate(self) -> None:
        """Every shard file: its header written, its data area reserved (sparse)."""
        for shard in self._shards:
            head = header_bytes(shard, self._slots, self._metadata)
            for name in shard.names:
                self._slots[name].offset += len(head)
            shard.file_size = len(head) + shard.data_bytes
            with open(self.tmp_dir / shard.filename, "wb") as f:
                f.write(head)
                # Sparse preallocation: reserves the final size so writes can
                # seek anywhere, without touching the data blocks.
                f.truncate(shard.file_size)

    # ------------------------------------------------------------ writing

    @property
    def tmp_dir(self) -> Path:
        """The temporary directory everything is written to before commit."""
        assert self._tmp is not None  # set in __init__, which aborts and raises without it
        return self._tmp

    @property
    def shard_files(self) -> list[str]:
        """Shard file names, in order."""
        return [s.filename for s in self._shards]

    def _slot_for(self, name: str, nbytes: int | None = None) -> Slot:
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

    def _put(self, name: str, slot: Slot, pieces, queued: int) -> None:
        path = self.tmp_dir / self._shards[slot.shard].filename
        thread = self._behind if queued else self._copies
        with self._os_errors():
            thread.submit(Job(name, path, slot.offset, pieces, slot.nbytes, queued))
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
        self._put(name, self._slot_for(name, nbytes), Span(Path(path), offset), 0)

    def _extra_path(self, filename: str) -> Path:
        self._check_open()
        rel = Path(filename)
        reserved = {INDEX_NAME, MANIFEST_NAME, *self.shard_files}
        if rel.is_absolute() or ".." in rel.parts or not rel.parts or str(rel) in reserved:
            raise ConvertError(
                f"output file '{filename}': must be a relative name inside the output directory "
                "and not a weights file; choose another name"
            )
        path = self.tmp_dir / rel
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
        if len(self._shards) <= 1:
            return
        weight_map = {name: self._shards[slot.shard].filename for name, slot in self._slots.items()}
        index = {
            "metadata": {"total_size": sum(s.nbytes for s in self._slots.values())},
            "weight_map": weight_map,
        }
        (self.tmp_dir / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")

    def _fsync_tree(self) -> None:
        for path in sorted(self.tmp_dir.rglob("*")):
            if path.is_file():
                with open(path, "rb") as f:
                    os.fsync(f.fileno())
        fsync_dir(self.tmp_dir)

    def _swap_into_place(self) -> None:
        # Checked again: someone may have put files into the old output during the run.
        check_output(self.output, (), self.force)
        # Ctrl-C waits for the swap, so the renames are never left half done.
        with signals_deferred():
            self._replaced = move_into_place(self.tmp_dir, self._path)
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
                finish_manifest(self.tmp_dir)
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
