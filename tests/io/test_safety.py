"""What `convert` may delete, replace or leave behind (DESIGN §7, docs/design.md "Output format").

- It deletes or replaces only what it wrote: an output directory with a
  `.convert-manifest.json` listing every file in it. The input, its ancestors
  and descendants, files, links and other directories are refused (exit 2)
  and left byte for byte as they were (sha256 of every file before and after).
- The previous output stays intact until the new one is complete, also when
  the run is interrupted (SIGINT: exit 130) or killed (SIGKILL), which the
  subprocess tests below do at a fixed point of a real CLI run.
- Temporaries of dead runs are removed by the next run, with a warning; a
  second run on the same output exits 3 naming the process that holds it.
- Disk full, permission, read-only and name-too-long errors exit 3 with one
  line naming the output and the fix, leaving nothing new on disk.
- Directories and files follow the process umask.
"""

import errno
import hashlib
import json
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

import convert
import convert.io.atomic as atomic
import convert.io.writer as writer_module
from convert.cli import main
from convert.errors import ConvertError, EnvironmentFailure
from convert.io import MANIFEST_NAME, CheckpointWriter, output_lock

from conftest import REPO, TINY_LLAMA

# ------------------------------------------------------------------ helpers


def _tree(root: Path) -> dict[str, str]:
    """Every entry under `root`: sha256 of each file, the target of each link, '<dir>' for folders."""
    entries = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(folder, name)
            rel = path.relative_to(root).as_posix()
            if path.is_symlink():
                entries[rel] = "-> " + os.readlink(path)
            elif path.is_dir():
                entries[rel] = "<dir>"
            else:
                entries[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return entries


def _hidden(directory: Path) -> list[str]:
    """Leftovers beside an output: temporaries (.x.tmp-*, .x.old-*) and locks (.x.lock)."""
    return sorted(n for n in os.listdir(directory) if n.startswith("."))


def _run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def _convert(src: Path, out: Path, **options):
    return convert.gqa2mla(src, out, verify=False, progress=False, **options)


def _one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1, f"expected one line, got {text!r}"
    return lines[0]


@pytest.fixture
def src(tmp_path) -> Path:
    path = tmp_path / "src"
    shutil.copytree(TINY_LLAMA, path)
    return path


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    """One conversion of the shipped checkpoint; tests copy it to get an earlier output."""
    out = tmp_path_factory.mktemp("converted") / "out"
    _convert(TINY_LLAMA, out)
    return out


@pytest.fixture
def previous(tmp_path, converted) -> Path:
    """An earlier convert output at tmp_path/out (a factored one, to tell it from a new one)."""
    out = tmp_path / "out"
    shutil.copytree(converted, out)
    return out


# ------------------------------------------------------------------ 1. only what it wrote


def _refused(tmp_path: Path, src_arg, out, *flags, must_name=()) -> str:
    """The CLI must refuse (exit 2, one line naming out) and change nothing under tmp_path."""
    before = _tree(tmp_path)
    result = _run("gqa2mla", src_arg, "-o", out, "--no-verify", "-q", *flags)
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    line = _one_line(result.stderr)
    assert line.startswith("error: ") and "Traceback" not in result.output
    for name in [out, *must_name]:
        assert str(name) in line, f"{name} not named in {line!r}"
    assert _tree(tmp_path) == before
    return line


def _unrelated_dir(tmp_path: Path, src: Path) -> Path:
    photos = tmp_path / "photos"
    (photos / "2023").mkdir(parents=True)
    (photos / "a.jpg").write_bytes(b"\xff\xd8 not really a jpeg")
    (photos / "2023" / "b.jpg").write_bytes(b"\xff\xd8 another")
    return photos


def _regular_file(tmp_path: Path, src: Path) -> Path:
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    return notes


def _link_to_input(tmp_path: Path, src: Path) -> Path:
    link = tmp_path / "link"
    link.symlink_to(src, target_is_directory=True)
    return link


def _existing_dir_inside_input(tmp_path: Path, src: Path) -> Path:
    sub = src / "extra"
    sub.mkdir()
    (sub / "readme.txt").write_text("part of the input\n")
    return sub


# -o target -> why it is refused (the input relations name the input too)
TARGETS = {
    "input weights": (lambda t, s: s / "model.safetensors", "is inside the input"),
    "input config": (lambda t, s: s / "config.json", "is inside the input"),
    "the input": (lambda t, s: s, "is the input"),
    "input's parent": (lambda t, s: t, "contains the input"),
    "input's grandparent": (lambda t, s: t.parent, "contains the input"),
    "new dir inside input": (lambda t, s: s / "mla", "is inside the input"),
    "dir inside input": (_existing_dir_inside_input, "is inside the input"),
    "unrelated dir": (_unrelated_dir, "did not write"),
    "regular file": (_regular_file, "is a file"),
    "link to input": (_link_to_input, "is the input"),
}


@pytest.mark.parametrize("force", [True, False], ids=["force", "no-force"])
@pytest.mark.parametrize("target", list(TARGETS))
def test_refused_outputs(tmp_path, src, target, force):
    make, why = TARGETS[target]
    out = make(tmp_path, src)
    why = f"{why} {src}" if why.endswith("input") else why
    _refused(tmp_path, src, out, *(["--force"] if force else []), must_name=[why])


def test_single_file_input(tmp_path, src):
    weights = src / "model.safetensors"
    _refused(tmp_path, weights, weights, "--force", must_name=[f"is the input {weights}"])
    _refused(tmp_path, weights, src, "--force", must_name=[f"contains the input {weights}"])
    _refused(tmp_path, weights, src / "config.json", "--force", must_name=["is a file"])


def test_input_through_a_link(tmp_path, src):
    # the input named through a link, the output through the real path: the same directory
    link = _link_to_input(tmp_path, src)
    _refused(tmp_path, link, src, "--force", must_name=[f"is the input {link}"])
    _refused(tmp_path, link, src / "mla", "--force", must_name=[f"is inside the input {link}"])


def test_hf_cache_layout(tmp_path, src):
    # a Hugging Face cache snapshot: the weights are links into blobs/
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    shutil.move(src / "model.safetensors", blobs / "0123abcd")
    (src / "model.safetensors").symlink_to(blobs / "0123abcd")
    _refused(tmp_path, src, blobs, "--force", must_name=[f"contains the input {src}"])


def _add_file(out: Path) -> str:
    (out / "notes.txt").write_text("a person's file\n")
    return "notes.txt"


def _add_nested_file(out: Path) -> str:
    (out / "sub").mkdir()
    (out / "sub" / "keep.bin").write_bytes(b"\0" * 10)
    return "sub"


def _change_file(out: Path) -> str:
    with open(out / "config.json", "a") as f:
        f.write("\n")
    return "config.json"


def _unfinished_manifest(out: Path) -> str:
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    (out / MANIFEST_NAME).write_text(json.dumps({**manifest, "complete": False}))
    return MANIFEST_NAME


def _no_manifest(out: Path) -> str:
    (out / MANIFEST_NAME).unlink()
    return MANIFEST_NAME


@pytest.mark.parametrize("damage", [_add_file, _add_nested_file, _change_file, _unfinished_manifest, _no_manifest])
def test_force_refuses_a_touched_output(tmp_path, src, previous, damage):
    name = damage(previous)
    _refused(tmp_path, src, previous, "--force", must_name=[name])


def test_force_refuses_a_link_to_an_output(tmp_path, src, previous):
    link = tmp_path / "link-out"
    link.symlink_to(previous, target_is_directory=True)
    _refused(tmp_path, src, link, "--force", must_name=["symbolic link"])


def test_without_force_an_earlier_output_is_kept(tmp_path, src, previous):
    _refused(tmp_path, src, previous, must_name=["--force"])


def test_force_replaces_an_earlier_output(tmp_path, src, previous):
    old = _tree(previous)
    result = _run("gqa2mla", src, "-o", previous, "--no-verify", "-q", "--force", "--layout", "factored")
    assert result.exit_code == 0, (result.output, result.exception)
    assert _tree(previous) != old
    assert json.loads((previous / "config.json").read_text())["mla"]["layout"] == "factored"
    assert _hidden(tmp_path) == []


def test_manifest_lists_every_file(tmp_path, src):
    out = tmp_path / "out"
    _convert(src, out)
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    assert manifest["format"] == "convert-output" and manifest["complete"] is True
    assert manifest["converter"] == convert.__version__ and manifest["pid"] == os.getpid()
    on_disk = {p.relative_to(out).as_posix(): p.stat().st_size for p in out.rglob("*") if p.is_file()}
    on_disk.pop(MANIFEST_NAME)
    assert manifest["files"] == on_disk
    assert {"model.safetensors", "config.json", "generation_config.json"} <= set(on_disk)


# ------------------------------------------------------------------ 2. atomic replacement


def _write_one(out: Path, force: bool = True) -> CheckpointWriter:
    import torch

    w = CheckpointWriter(out, {"a": ((3,), torch.float32)}, 10**9, force=force)
    w.write("a", torch.ones(3))
    w.write_json("config.json", {"new": True})
    return w


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2-exchange", "rename-aside"])
def test_replacement_keeps_old_output_until_new_is_complete(tmp_path, previous, monkeypatch, exchange):
    old = _tree(previous)
    if not exchange:
        monkeypatch.setattr(atomic, "_exchange", lambda new, target: False)
    moved_aside = []

    def checked_move_aside(target, aside):
        # the new output is complete (finished manifest) before the old one leaves
        assert json.loads((w.tmp_dir / MANIFEST_NAME).read_text())["complete"] is True
        assert _tree(target) == old
        moved_aside.append(aside)
        os.rename(target, aside)

    monkeypatch.setattr(atomic, "_move_aside", checked_move_aside)
    w = _write_one(previous)
    assert _tree(previous) == old  # untouched while the new one is written
    w.commit()
    assert json.loads((previous / "config.json").read_text()) == {"new": True}
    if not exchange:
        assert moved_aside, "the fallback did not move the old output aside"
    assert _hidden(tmp_path) == []


def test_failed_swap_puts_old_output_back(tmp_path, previous, monkeypatch):
    old = _tree(previous)
    monkeypatch.setattr(atomic, "_exchange", lambda new, target: False)
    real_rename = os.rename

    def rename(a, b):
        if ".tmp-" in str(a) and Path(b) == previous:
            raise PermissionError(errno.EACCES, "Permission denied", str(b))
        real_rename(a, b)

    monkeypatch.setattr(os, "rename", rename)
    w = _write_one(previous)
    with pytest.raises(EnvironmentFailure, match="writable"):
        w.commit()
    assert _tree(previous) == old
    assert _hidden(tmp_path) == []


def test_temporary_names_carry_the_pid(tmp_path):
    w = _write_one(tmp_path / "out", force=False)
    name = w.tmp_dir.name
    assert name.startswith(f".out.tmp-{os.getpid()}-") and w.tmp_dir.parent == tmp_path
    assert json.loads((w.tmp_dir / MANIFEST_NAME).read_text())["pid"] == os.getpid()
    assert (tmp_path / ".out.lock").read_text().strip() == str(os.getpid())
    w.abort()
    assert os.listdir(tmp_path) == []


# ------------------------------------------------------------------ 3. crashes, leftovers, a second run


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _leftover(parent: Path, kind: str, pid: int, source: Path | None = None) -> Path:
    path = parent / f".out.{kind}-{pid}-0123abcd"
    if source is not None:
        shutil.copytree(source, path)
    else:
        path.mkdir()
        (path / "model.safetensors").write_bytes(b"\0" * 100)
    return path


def test_next_run_removes_leftovers_of_dead_runs(tmp_path, src, previous, caplog):
    dead = _dead_pid()
    stale_tmp = _leftover(tmp_path, "tmp", dead)
    stale_old = _leftover(tmp_path, "old", dead, source=previous)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        live_tmp = _leftover(tmp_path, "tmp", live.pid)
        with caplog.at_level(logging.WARNING, logger="convert"):
            _convert(src, previous, force=True)
        assert not stale_tmp.exists() and not stale_old.exists()
        assert live_tmp.is_dir(), "a live process's directory was removed"
        warned = " ".join(r.getMessage() for r in caplog.records)
        assert str(stale_tmp) in warned and str(stale_old) in warned and str(dead) in warned
    finally:
        live.kill()
        live.wait()


def test_old_output_moved_aside_by_a_dead_run_is_restored(tmp_path, previous, caplog):
    old = _tree(previous)
    aside = tmp_path / f".out.old-{_dead_pid()}-0123abcd"
    previous.rename(aside)
    with caplog.at_level(logging.WARNING, logger="convert"), output_lock(previous, force=True):
        pass
    assert _tree(previous) == old and not aside.exists()
    assert "restored" in caplog.text
    assert _hidden(tmp_path) == []


DRIVER = '''
"""The real CLI, pausing at one point (PAUSE_AT) so a test can signal the process there."""
import os, sys, time
import convert.io.atomic as atomic
import convert.io.writer as writer

def pause(where):
    print("PAUSED", where, flush=True)
    time.sleep(float(os.environ.get("PAUSE_S", "120")))

if os.environ["PAUSE_AT"] == "write":  # after the third tensor, before commit
    real_put, count = writer.CheckpointWriter._put, [0]
    def put(self, *args):
        real_put(self, *args)
        count[0] += 1
        if count[0] == 3:
            pause(self.tmp_dir)
    writer.CheckpointWriter._put = put
else:  # between the two renames of the fallback swap: the old output aside, the new not yet in
    atomic._exchange = lambda new, target: False
    real_aside = atomic._move_aside
    def move_aside(target, aside):
        real_aside(target, aside)
        pause(aside)
    atomic._move_aside = move_aside

from convert.cli import main
main(sys.argv[1:], prog_name="convert")
'''


def _start(tmp_path: Path, src: Path, out: Path, pause_at: str, pause_s: float = 120) -> tuple[subprocess.Popen, Path]:
    """Run `convert gqa2mla src -o out --force` in a subprocess until it pauses; returns it and where."""
    driver = tmp_path.parent / f"{tmp_path.name}-driver.py"
    driver.write_text(DRIVER)
    env = {**os.environ, "PAUSE_AT": pause_at, "PAUSE_S": str(pause_s), "PYTHONPATH": str(REPO)}
    args = [sys.executable, str(driver), "gqa2mla", str(src), "-o", str(out), "--force", "--no-verify", "-q"]
    # a shell's background job inherits SIGINT ignored; Python then installs no KeyboardInterrupt handler,
    # so the child gets SIGINT's default disposition back, as it has when a user runs it in a terminal
    restore_sigint = lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)
    proc = subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO, preexec_fn=restore_sigint
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], deadline - time.monotonic())
        line = proc.stdout.readline() if ready else ""
        if line.startswith("PAUSED "):
            return proc, Path(line.split(" ", 1)[1].strip())
        if not line:
            break
    proc.kill()
    raise AssertionError(f"the conversion never paused: {proc.communicate()[1]}")


def _stop(proc: subprocess.Popen, sig: int) -> tuple[int, str]:
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=120)
    return proc.returncode, stderr


@pytest.mark.slow
def test_sigkill_mid_write_and_a_second_run(tmp_path, src, previous, caplog):
    old = _tree(previous)
    proc, tmp_dir = _start(tmp_path, src, previous, "write")
    try:
        assert tmp_dir.is_dir() and tmp_dir.parent == tmp_path
        # a second run on the same output: exit 3 naming the process that holds it
        with pytest.raises(EnvironmentFailure) as err:
            _convert(src, previous, force=True)
        assert err.value.exit_code == 3 and str(proc.pid) in _one_line(str(err.value))
        cli = _run("gqa2mla", src, "-o", previous, "--force", "--no-verify", "-q")
        assert cli.exit_code == 3, (cli.output, cli.exception)
        assert str(proc.pid) in _one_line(cli.stderr) and str(previous) in cli.stderr
    finally:
        code, _ = _stop(proc, signal.SIGKILL)
    assert code == -signal.SIGKILL
    assert _tree(previous) == old, "the earlier output changed"
    assert tmp_dir.is_dir(), "the kill did not land mid-write"
    # the next run removes what the killed one left, says so, and writes its output
    with caplog.at_level(logging.WARNING, logger="convert"):
        _convert(src, previous, force=True, layout="factored")
    assert not tmp_dir.exists() and str(tmp_dir) in caplog.text and str(proc.pid) in caplog.text
    assert json.loads((previous / "config.json").read_text())["mla"]["layout"] == "factored"
    assert _hidden(tmp_path) == []


@pytest.mark.slow
def test_sigint_mid_write(tmp_path, src, previous):
    old = _tree(previous)
    proc, tmp_dir = _start(tmp_path, src, previous, "write")
    code, stderr = _stop(proc, signal.SIGINT)
    assert code == 130, stderr
    assert _one_line(stderr).startswith("error: ")
    assert _tree(previous) == old
    assert not tmp_dir.exists() and _hidden(tmp_path) == []


@pytest.mark.slow
def test_sigkill_between_renames_is_undone_by_the_next_run(tmp_path, src, previous):
    old = _tree(previous)
    proc, aside = _start(tmp_path, src, previous, "aside")
    code, _ = _stop(proc, signal.SIGKILL)
    assert code == -signal.SIGKILL
    assert not previous.exists() and _tree(aside) == old, "the kill did not land between the renames"
    with output_lock(previous, force=True):
        assert _tree(previous) == old
    assert _hidden(tmp_path) == []


@pytest.mark.slow
def test_sigint_waits_for_the_swap(tmp_path, src, previous):
    proc, aside = _start(tmp_path, src, previous, "aside", pause_s=3.0)
    code, stderr = _stop(proc, signal.SIGINT)
    assert code == 130, stderr
    # the swap finished before the interrupt took effect: the new output, whole
    assert json.loads((previous / MANIFEST_NAME).read_text())["pid"] == proc.pid
    assert not aside.exists() and _hidden(tmp_path) == []


# ------------------------------------------------------------------ 4. the machine says no: exit 3


def _fail_on(predicate, code: int):
    def fake(real):
        def call(*args, **kwargs):
            if predicate(*args):
                raise OSError(code, os.strerror(code), str(args[0]))
            return real(*args, **kwargs)

        return call

    return fake


class _FullDisk:
    """A file whose writes fail with `code` (data writes into a shard)."""

    def __init__(self, f, code: int):
        self._f, self._code = f, code

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()

    def __getattr__(self, name):  # seek, flush, fileno, close: the real file's
        return getattr(self._f, name)

    def write(self, data):
        raise OSError(self._code, os.strerror(self._code))


def _inject(monkeypatch, where: str, code: int) -> None:
    if where == "write":
        real_open = open
        full = lambda path, mode="r", *a, **k: (  # noqa: E731
            _FullDisk(real_open(path, mode, *a, **k), code) if mode == "r+b" else real_open(path, mode, *a, **k)
        )
        monkeypatch.setattr(writer_module, "open", full, raising=False)
    elif where == "fsync":
        monkeypatch.setattr(os, "fsync", _fail_on(lambda fd: True, code)(os.fsync))
    elif where == "mkdir":
        monkeypatch.setattr(os, "mkdir", _fail_on(lambda p, *a: ".tmp-" in str(p), code)(os.mkdir))
    elif where == "lock":
        monkeypatch.setattr(os, "open", _fail_on(lambda p, *a: str(p).endswith(".lock"), code)(os.open))


ENVIRONMENT = [
    ("write", errno.ENOSPC, "free at least"),
    ("write", errno.EDQUOT, "quota"),
    ("fsync", errno.ENOSPC, "free at least"),
    ("mkdir", errno.EACCES, "writable for you"),
    ("mkdir", errno.EROFS, "writable file system"),
    ("mkdir", errno.ENAMETOOLONG, "shorter"),
    ("lock", errno.EROFS, "writable file system"),
    ("lock", errno.EACCES, "writable for you"),
]


@pytest.mark.parametrize("where,code,fix", ENVIRONMENT, ids=[f"{errno.errorcode[c]}-{w}" for w, c, _ in ENVIRONMENT])
def test_environment_failures(tmp_path, src, previous, monkeypatch, where, code, fix):
    before = _tree(tmp_path)
    _inject(monkeypatch, where, code)
    with pytest.raises(EnvironmentFailure) as err:
        _convert(src, previous, force=True)
    monkeypatch.undo()
    assert err.value.exit_code == 3 and isinstance(err.value, ConvertError)
    line = _one_line(str(err.value))
    assert str(previous) in line and fix in line, line
    assert _tree(tmp_path) == before  # the earlier output intact, nothing new


def test_disk_full_on_the_command_line(tmp_path, src, previous, monkeypatch):
    before = _tree(tmp_path)
    _inject(monkeypatch, "write", errno.ENOSPC)
    result = _run("gqa2mla", src, "-o", previous, "--force", "--no-verify", "-q")
    assert result.exit_code == 3, (result.output, result.exception)
    line = _one_line(result.stderr)
    assert str(previous) in line and "no space left" in line
    assert _tree(tmp_path) == before


def test_name_too_long_on_the_command_line(tmp_path, src):
    before = _tree(tmp_path)
    out = tmp_path / ("n" * 250)  # a valid name, but its lock and temporary names are too long
    result = _run("gqa2mla", src, "-o", out, "--no-verify", "-q")
    assert result.exit_code == 3, (result.output, result.exception)
    assert "shorter" in _one_line(result.stderr)
    assert _tree(tmp_path) == before


# ------------------------------------------------------------------ 5. modes follow the umask


@pytest.mark.parametrize("umask,dir_mode,file_mode", [(0o022, 0o755, 0o644), (0o027, 0o750, 0o640)])
def test_modes_follow_umask(tmp_path, src, umask, dir_mode, file_mode):
    old = os.umask(umask)
    try:
        out = tmp_path / "deep" / "out"
        _convert(src, out)
    finally:
        os.umask(old)
    assert (out.stat().st_mode & 0o777, out.parent.stat().st_mode & 0o777) == (dir_mode, dir_mode)
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()}
    assert set(modes.values()) == {file_mode}, modes
