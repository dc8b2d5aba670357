"""bench/gpu.py --small: the GPU benchmark's code (write, convert + verify, load + decode) on a tiny
Llama on the CPU, so that what runs on a GPU machine has run in CI."""

import json
import subprocess
import sys

import pytest

from conftest import REPO


@pytest.mark.slow
def test_gpu_benchmark_runs_small_on_cpu(tmp_path):
    cmd = [sys.executable, str(REPO / "bench" / "gpu.py"), "--small", "--steps", "2", "--out-dir", str(tmp_path)]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=900)
    written = json.loads((tmp_path / "gpu_write.json").read_text())
    assert written["bytes"] > 0 and written["config"]["num_hidden_layers"] == 2
    conversions = json.loads((tmp_path / "gpu_convert.json").read_text())["conversions"]
    assert set(conversions) == {"absorbed-exact", "factored-exact", "absorbed-25pct"}
    assert all(c["verdict"] == "PASS" for c in conversions.values()), conversions
    assert conversions["absorbed-exact"]["rule"].startswith("exact conversion in bfloat16")  # the noise floor
    assert (
        conversions["absorbed-25pct"]["kv_cache_bytes_per_token"]
        < conversions["absorbed-exact"]["kv_cache_bytes_per_token"]
    )
    decode = json.loads((tmp_path / "gpu_decode.json").read_text())["decode"]
    assert set(decode) == {"original", *conversions}
    for name in conversions:
        assert decode[name]["load_ratio"] > 0 and decode[name]["step_ratio"] > 0 and decode[name]["steps"] == 2
