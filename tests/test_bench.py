"""bench/gpu.py through `python -m bench --parts gpu`, dry-run on CPU on the tiny shape: the three parts
run the code a GPU runs and print their tables; on CPU the same 3 steps twice are identical."""
import json
import subprocess
import sys

import pytest

from conftest import ENV, HERE

pytestmark = pytest.mark.slow                         # a subprocess run of the benchmark: the slow tier


def test_gpu_part_dry_run_on_cpu(tmp_path):
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "-m", "bench", "--parts", "gpu", "--gpu_shape", "tiny", "--gpu_sample_tokens", "4",
                        "--gpu_step_tokens", "8", "--gpu_det_tokens", "4", "--flags", "--generation_size 4",
                        "--out", str(out)], cwd=HERE, env=ENV, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    text = r.stdout
    assert "| generate |" in text and "| merged |" in text                         # samplers (compile: CUDA only)
    assert "| forward |" in text and "| backward |" in text and "| optimizer |" in text
    res = json.loads(out.read_text())["gpu"]
    assert set(res["sampling"]) == {"generate", "merged"} and all(v["seconds"] > 0 for v in res["sampling"].values())
    assert res["step"]["estimate"]["peak"] > res["step"]["estimate"]["weights"] > 0
    assert res["determinism"]["differ"] == []                                   # CPU: bit for bit
    assert "identical: every metric and the weights bit for bit" in text
