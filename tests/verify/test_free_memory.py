"""Verification sized by the memory free (convert/verify/memory.py): what is free on the CPU, a
container's limit included, and what `--e2e auto` runs with it."""

import pytest
import torch

import convert.verify as verify_module
from convert.api import gqa2mla
from convert.errors import ConvertError
from convert.io import open_checkpoint
from convert.mla.model import read_mla_config
from convert.verify import memory, verify_paths
from convert.verify.memory import FREE_MARGIN_MIN, one_model_memory_bytes, whole_model_activation_bytes
from convert.verify.run import VerifyRun

GiB = 2**30
CPU = torch.device("cpu")


@pytest.fixture
def fake_proc(tmp_path, monkeypatch):
    """/proc/meminfo with 20 GiB available, and an empty cgroup tree: write files to limit it."""
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal:       33554432 kB\nMemFree:         1048576 kB\nMemAvailable:   {20 * 2**20} kB\n")
    root = tmp_path / "cgroup"
    root.mkdir()
    monkeypatch.setattr(memory, "MEMINFO", meminfo)
    monkeypatch.setattr(memory, "PROC_CGROUP", tmp_path / "self-cgroup")
    monkeypatch.setattr(memory, "CGROUP_ROOT", root)
    return tmp_path


def _cgroup(directory, limit, usage, stat="", version=2):
    """A fake cgroup directory: its limit ("max" for none), usage and memory.stat."""
    directory.mkdir(parents=True, exist_ok=True)
    limit_file, usage_file, _ = memory.CGROUP_FILES[version]
    (directory / limit_file).write_text(f"{limit}\n")
    (directory / usage_file).write_text(f"{usage}\n")
    (directory / "memory.stat").write_text(stat)


def test_free_memory_is_memavailable_without_a_cgroup_limit(fake_proc):
    assert memory.available_memory_bytes(CPU) == 20 * GiB  # no /proc/self/cgroup
    (fake_proc / "self-cgroup").write_text("0::/job\n")
    _cgroup(fake_proc / "cgroup" / "job", "max", 3 * GiB)
    assert memory.available_memory_bytes(CPU) == 20 * GiB


def test_free_memory_is_a_v2_containers_headroom_when_smaller(fake_proc):
    """cgroup v2: the least of memory.max less memory.current (inactive page cache reclaimable) over
    the process's cgroup and those above it."""
    (fake_proc / "self-cgroup").write_text("0::/user.slice/job\n")
    root = fake_proc / "cgroup"
    _cgroup(root / "user.slice", "max", 9 * GiB)
    _cgroup(root / "user.slice" / "job", 4 * GiB, 3 * GiB, f"anon 1\ninactive_file {GiB // 2}\n")
    assert memory.available_memory_bytes(CPU) == GiB + GiB // 2
    _cgroup(root / "user.slice", 10 * GiB, 9 * GiB + GiB // 4)  # the parent's limit is nearer
    assert memory.available_memory_bytes(CPU) == 3 * GiB // 4


def test_free_memory_is_a_v1_containers_headroom_when_smaller(fake_proc):
    """cgroup v1: memory.limit_in_bytes less memory.usage_in_bytes; in a container the mount's root
    is the container's own cgroup, whatever path /proc/self/cgroup names."""
    (fake_proc / "self-cgroup").write_text("5:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n0::/\n")
    _cgroup(fake_proc / "cgroup" / "memory", 2 * GiB, GiB, f"total_inactive_file {GiB // 4}\n", version=1)
    assert memory.available_memory_bytes(CPU) == GiB + GiB // 4
    _cgroup(fake_proc / "cgroup" / "memory", 2**63 - 4096, GiB, version=1)  # v1's "no limit"
    assert memory.available_memory_bytes(CPU) == 20 * GiB


def test_free_memory_without_meminfo_asks_the_kernel(fake_proc, monkeypatch):
    monkeypatch.setattr(memory, "MEMINFO", fake_proc / "missing")
    assert memory.available_memory_bytes(CPU) > 0


def test_margin_keeps_a_fifth_and_at_least_1_gib_free():
    assert memory.free_margin_bytes(2 * GiB) == FREE_MARGIN_MIN == GiB
    assert memory.free_margin_bytes(20 * GiB) == 4 * GiB


@pytest.fixture
def tiny_mla(tiny_llama_dir, tmp_path):
    """The tiny fixture converted, and (one whole model in float32, both whole models in float64
    with 24 tokens' logits): what auto needs for greedy generation and for whole-model verification."""
    out = tmp_path / "mla"
    gqa2mla(tiny_llama_dir, out, verify=False, progress=False)
    with open_checkpoint(tiny_llama_dir) as orig, open_checkpoint(out) as conv:
        sizes = [c.total_bytes() for c in (orig, conv)]
        vocab = orig.config["vocab_size"]
    one = max(one_model_memory_bytes(n, torch.float32, torch.float32) for n in sizes)
    both = sum(one_model_memory_bytes(n, torch.float32, torch.float64) for n in sizes)
    return out, one, both + whole_model_activation_bytes(24, vocab)


#: this process's resident memory as the tests' caps see it (pytest's own varies with what ran before)
RSS = GiB // 2


def _auto(tiny_llama_dir, out, monkeypatch, free: int, max_memory: int | None = 1024 * GiB) -> dict:
    """auto with `free` bytes free and a cap (default: none that binds), this process at `RSS`."""
    monkeypatch.setattr(memory, "available_memory_bytes", lambda device: free)
    monkeypatch.setattr(memory, "process_rss_bytes", lambda: RSS)
    return verify_paths(tiny_llama_dir, out, tokens=24, progress=False, max_memory=max_memory)["end_to_end"]


def test_auto_verifies_whole_models_when_both_fit(tiny_llama_dir, tiny_mla, monkeypatch):
    out, _, whole = tiny_mla
    for free in (64 * GiB, FREE_MARGIN_MIN + whole):  # a big machine; just enough
        e2e = _auto(tiny_llama_dir, out, monkeypatch, free)
        assert e2e["mode"] == "whole" and e2e["greedy_skipped"] is None and e2e["greedy_match"]
        assert e2e["greedy_dtype"] == "float64"  # the run's dtype: the models verified are the ones generating


def test_auto_streams_with_greedy_when_only_one_model_fits(tiny_llama_dir, tiny_mla, monkeypatch):
    out, one, whole = tiny_mla
    for free in (FREE_MARGIN_MIN + whole - 1, FREE_MARGIN_MIN + one):
        e2e = _auto(tiny_llama_dir, out, monkeypatch, free)
        assert e2e["mode"] == "streamed" and e2e["greedy_skipped"] is None and e2e["greedy_match"]
        assert e2e["greedy_dtype"] == "float32" and e2e["greedy_how"] == "one whole model at a time"


def test_auto_generates_streamed_naming_the_memory_when_no_model_fits(tiny_llama_dir, tiny_mla, monkeypatch):
    """No whole model fits: greedy generation still runs, streamed a decoder layer at a time, and
    gives the tokens the whole models give."""
    out, one, _ = tiny_mla
    whole = _auto(tiny_llama_dir, out, monkeypatch, 64 * GiB)
    e2e = _auto(tiny_llama_dir, out, monkeypatch, FREE_MARGIN_MIN + one - 1)
    assert e2e["mode"] == "streamed" and e2e["greedy_skipped"] is None and e2e["greedy_match"]
    assert e2e["greedy_original"] == whole["greedy_original"] and len(whole["greedy_original"]) == 32
    assert e2e["greedy_converted"] == whole["greedy_converted"]
    how = e2e["greedy_how"]
    assert how.startswith("streamed") and f"needs ~{one / GiB:.2f} GiB" in how
    assert f"{(FREE_MARGIN_MIN + one - 1 - FREE_MARGIN_MIN) / GiB:.2f} GiB usable" in how


def test_the_cap_decides_as_the_free_memory_does(tiny_llama_dir, tiny_mla, monkeypatch):
    """With memory free, --max-memory alone chooses: whole models under a cap that holds them beside
    the process, else streamed with one whole model in turn; a cap below what streaming needs (here
    more than a whole tiny model: its vocabulary chunk's float64 logits) is refused, naming the
    smallest cap that works, which then runs."""
    out, one, whole = tiny_mla
    decide = lambda cap: _auto(tiny_llama_dir, out, monkeypatch, 64 * GiB, cap)
    e2e = decide(RSS + whole)
    assert e2e["mode"] == "whole"
    e2e = decide(RSS + whole - 1)
    assert e2e["mode"] == "streamed" and e2e["greedy_how"] == "one whole model at a time"
    with pytest.raises(ConvertError, match=r"cannot hold the verification of this model streamed") as refused:
        decide(RSS + one)
    smallest = float(str(refused.value).split("pass max_memory=")[1].split("GiB")[0])
    assert decide(int(smallest * GiB))["greedy_match"]  # runs (rounded up to a tenth of a GiB, whole here)


def test_streamed_and_whole_ignore_the_free_memory(tiny_llama_dir, tiny_mla, monkeypatch):
    out, _, _ = tiny_mla
    monkeypatch.setattr(memory, "available_memory_bytes", lambda device: 64 * GiB)
    streamed = verify_paths(tiny_llama_dir, out, tokens=24, e2e="streamed", progress=False)["end_to_end"]
    assert streamed["mode"] == "streamed" and "--e2e streamed" in streamed["greedy_skipped"]
    monkeypatch.setattr(memory, "available_memory_bytes", lambda device: 0)
    assert verify_paths(tiny_llama_dir, out, tokens=24, e2e="whole", progress=False)["end_to_end"]["mode"] == "whole"


@pytest.mark.realdata
@pytest.mark.parametrize("smollm2_converted", ["absorbed"], indirect=True)  # the default layout
def test_smollm2_default_cap_streams_and_generates_from_one_model(smollm2, smollm2_converted, monkeypatch):
    """Issue 69: on a 24 GiB machine (22 GiB free) the default cap (run start + the 0.50 GiB checkpoint
    + 0.5 GiB) streams SmolLM2 and generates from one float32 model at a time; --max-memory 4GiB
    verifies it whole in float64, as the free memory alone did; 1.5 GiB free, no whole model."""
    ids = torch.zeros(1, 256, dtype=torch.long)  # the default --tokens
    monkeypatch.setattr(memory, "process_rss_bytes", lambda: 2 * GiB // 5)  # the command line's 0.38 GiB of imports
    with open_checkpoint(smollm2) as orig, open_checkpoint(smollm2_converted.output) as conv:
        run = VerifyRun(orig, conv, read_mla_config(smollm2_converted.output)[0], CPU, torch.float64)

        def decide(free: int, cap: int | None) -> tuple[bool, bool]:  # (both whole models fit, one fits)
            monkeypatch.setattr(memory, "available_memory_bytes", lambda device: free)
            with memory.memory_run():
                limit = memory.memory_cap(cap, orig.total_bytes(), 0, "nothing")
                whole = verify_module._whole_models_fit(run, ids, limit)
                return whole, verify_module._one_model_fits(orig, conv, CPU, torch.float32, limit)[0]

        assert decide(22 * GiB, None) == (False, True)
        assert decide(22 * GiB, 4 * GiB) == (True, True)
        assert decide(4 * GiB, 64 * GiB) == (False, True)
        assert decide(3 * GiB // 2, 64 * GiB) == (False, False)


def test_a_raised_default_cap_still_holds_what_it_was_raised_for(monkeypatch):
    """The default cap, raised to what a run needs, is not refused when the process's resident memory
    has grown a little by the time the run checks its room (Qwen2.5-Coder-1.5B's llamacpp export was
    refused so, by a few bytes, after it had converted)."""

    rss = [2**30]  # 1 GiB when the cap is decided
    monkeypatch.setattr(memory, "process_rss_bytes", lambda: rss[0])
    monkeypatch.setattr(memory, "available_memory_bytes", lambda device: 64 * 2**30)
    needed = 16 * 2**30
    cap = memory.memory_cap(None, 3 * 2**30, needed, "verifying an export (both whole models)")
    assert not cap.explicit and "raised" in cap.why
    rss[0] += 2**20  # 1 MiB more at the check
    room, words = cap.room(torch.device("cpu"))
    assert room >= needed, words


def test_an_export_that_cannot_be_verified_is_refused_before_converting(tiny_llama_dir, tmp_path, monkeypatch):
    """Verifying an export loads both whole models; where they cannot fit, `gqa2mla` says so (exit 2)
    before converting anything, not after (the 1.5B's llamacpp export was refused after 48 minutes)."""
    import convert.api

    monkeypatch.setattr(memory, "available_memory_bytes", lambda device: FREE_MARGIN_MIN + 1)
    monkeypatch.setattr(convert.api, "_write", lambda *args: pytest.fail("converted before refusing"))
    with pytest.raises(ConvertError, match="both whole models, which do not fit"):
        gqa2mla(tiny_llama_dir, tmp_path / "out", target="transformers", progress=False)
    assert not (tmp_path / "out").exists()
    monkeypatch.undo()
    assert gqa2mla(tiny_llama_dir, tmp_path / "out", target="transformers", progress=False).passed
