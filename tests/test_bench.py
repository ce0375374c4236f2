"""bench/gpu.py through `python -m bench --parts gpu`, dry-run on CPU on the tiny shape: the four parts
run the code a GPU runs and print their tables; on CPU the same 3 steps twice are identical. And how
the determinism part reports two runs that differ."""
import json
import subprocess
import sys

import pytest

from conftest import ENV, HERE


@pytest.mark.slow                                     # a subprocess run of the benchmark: the slow tier
def test_gpu_part_dry_run_on_cpu(tmp_path):
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "-m", "bench", "--parts", "gpu", "--gpu_shape", "tiny", "--gpu_sample_tokens", "4",
                        "--gpu_step_tokens", "8", "--gpu_det_tokens", "4", "--flags", "--generation_size 4",
                        "--gpu_parts", "sampling,step,determinism,h_ini",
                        "--out", str(out)], cwd=HERE, env=ENV, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    text = r.stdout
    assert "| generate |" in text and "| merged |" in text                         # samplers (compile: CUDA only)
    assert "| forward |" in text and "| backward |" in text and "| optimizer |" in text
    res = json.loads(out.read_text())["gpu"]
    assert set(res["sampling"]) == {"generate", "merged"}
    assert all(v["seconds"] > 0 and v["first_call_seconds"] > 0 for v in res["sampling"].values())
    assert res["step"]["estimate"]["peak"] > res["step"]["estimate"]["weights"] > 0
    assert res["determinism"]["differ"] == {}                                   # CPU: bit for bit
    assert "identical: every metric and the weights bit for bit" in text
    assert res["h_ini"]["seconds"] > 0 and res["h_ini"]["estimate"] > 0 and res["h_ini"]["mean"] > 0


def test_differences_name_each_metric_with_its_first_step_and_largest_relative_gap():
    from bench.gpu import differences
    a = ([{"loss": 1.0, "reward": 2.0, "note": "x"}, {"loss": 2.0, "reward": 2.0, "note": "x"}], (1, 2))
    b = ([{"loss": 1.0, "reward": 2.0, "note": "y"}, {"loss": 2.5, "reward": 2.0, "note": "y"}], (1, 2))
    assert differences(a, a) == {}
    assert differences(a, b) == {"loss": {"step": 2, "rel": 0.2}}               # strings are not metrics
    c = ([{"loss": 0.5, "reward": 2.0}, {"loss": 2.0, "reward": 1.0}], (1, 3))
    assert differences(a, c) == {"loss": {"step": 1, "rel": 0.5}, "reward": {"step": 2, "rel": 0.5}, "weights": {}}
    nan = ([{"loss": float("nan")}], (1,))                                   # a metric with nothing to average
    assert differences(nan, nan) == {}
