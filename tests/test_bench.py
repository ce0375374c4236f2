"""bench/gpu.py through `python -m bench --parts gpu`, dry-run on CPU on the tiny shape: the parts
run the code a GPU runs and print their tables; on CPU the same 3 steps twice are identical. And how
the determinism part reports two runs that differ."""
import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from conftest import ENV, HERE


@pytest.mark.slow                                     # a subprocess run of the benchmark: the slow tier
def test_gpu_part_dry_run_on_cpu(tmp_path):
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "-m", "bench", "--parts", "gpu", "--gpu_shape", "tiny", "--gpu_sample_tokens", "4",
                        "--gpu_step_tokens", "8", "--gpu_det_tokens", "4", "--flags", "--generation_size 4",
                        "--gpu_parts", "samplers,step,determinism,h_ini,gqa",
                        "--out", str(out)], cwd=HERE, env=ENV, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    text = r.stdout
    assert "| generate |" in text and "| merged |" in text                         # samplers (compile: CUDA only)
    assert "| forward |" in text and "| backward |" in text and "| optimizer |" in text
    res = json.loads(out.read_text())["gpu"]
    samplers = {k: v for k, v in res["samplers"].items() if k != "meta"}           # meta: shape, device, seconds
    assert set(samplers) == {"generate", "merged", "merged loop"} and res["samplers"]["meta"]["shape"] == "tiny"
    assert all(v["seconds"] > 0 and v["first_call_seconds"] > 0 for v in samplers.values())
    assert res["step"]["estimate"]["peak"] > res["step"]["estimate"]["weights"] > 0
    assert sum(res["step"]["first"]["seconds"].values()) > 0 and res["step"]["total"] > 0      # two full steps
    assert res["determinism"]["differ"] == {}                                   # CPU: bit for bit
    assert "identical: every metric and the weights bit for bit" in text
    assert res["h_ini"]["seconds"] > 0 and res["h_ini"]["estimate"] > 0 and res["h_ini"]["mean"] > 0
    assert set(res["gqa"]) == {"merged loop", "merged loop, K/V repeated", "meta"} and "7. gqa: G 4 x 8" in text
    assert all(res["gqa"][k]["seconds"] > 0 for k in ("merged loop", "merged loop, K/V repeated"))


@pytest.mark.slow                                     # the device script's dry run: the embedded model, every part
def test_all_gpu_parts_dry_run_on_cpu_with_the_embedded_model(tmp_path):
    """`python -m bench --parts gpu --gpu_parts all --device cpu --gpu_shape smollm2-135m`: the script a lent
    GPU runs, tiny, writes one JSON with the four parts: the samplers, the step with its estimate, the
    capped child's 2 steps, and TRL's GRPOTrainer against our step. The embedded model in bf16 over NF4 runs
    on CPU at AVX-512's bf16 kernels' speed; an AVX2-only host emulates them and takes past the 15 minutes
    allowed, so it runs this on hosts with AVX-512 (the tiny-shape dry run above runs the same parts' code
    everywhere)."""
    pytest.importorskip("trl")
    import torch
    if not torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        pytest.skip(f"bf16 on an {torch.backends.cpu.get_cpu_capability()} CPU: past 15 minutes here (AVX-512 only)")
    out = tmp_path / "gpu.json"
    r = subprocess.run([sys.executable, "-m", "bench", "--parts", "gpu", "--gpu_parts", "all", "--device", "cpu",
                        "--gpu_shape", "smollm2-135m", "--out", str(tmp_path / "bench.json"), "--gpu_out", str(out)],
                       cwd=HERE, env=ENV, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert list(res) == ["samplers", "step", "cap40", "trl"]
    assert set(res["samplers"]) == {"generate", "merged", "merged loop", "meta"} and res["samplers"]["merged"]["tokens_per_s_per_sequence"] > 0
    assert res["step"]["tokens"] == 16 and res["step"]["total"] > 0 and res["step"]["estimate"]["card"] > 0
    assert res["cap40"]["out_of_memory"] is False and len(res["cap40"]["steps"]) == 2 and res["cap40"]["budget_gb"] == 40
    assert res["trl"]["grpo_trainer_s"] > 0 and res["trl"]["ours_s"] > 0 and res["trl"]["trl_step_ends"] == 3
    assert res["trl"]["trl_over_ours"] == res["trl"]["grpo_trainer_s"] / res["trl"]["ours_s"]
    assert "3. cap40" in r.stdout and "4. trl" in r.stdout
    assert all(v["meta"]["shape"] == "smollm2-135m" and v["meta"]["device"].startswith("cpu") for v in res.values())


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


@pytest.mark.parametrize("device, index", [("cuda", 3), ("cuda:1", 1)])
def test_the_cap_reaches_torch_with_a_device_index(monkeypatch, device, index):
    """torch.cuda.set_per_process_memory_fraction refuses a bare "cuda"; the cap names the current device
    then. The CUDA calls are replaced: this checks what reaches them, not the cap itself."""
    import torch

    from bench.gpu import cap_process
    seen = {}

    def properties(i):
        seen["props"] = i
        return SimpleNamespace(total_memory=80e9)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, i: seen.update(fraction=f, index=i))
    assert cap_process(device, 40) == 0.5
    assert seen == {"props": index, "fraction": 0.5, "index": index}
    assert cap_process(device, 120) == 1.0                                      # a cap above the card: the card


def test_step_flops_count_every_linear_and_the_head_on_completion_tokens(tiny_lm):
    """The gradient pass's matmul FLOPs (bench/cpu.py's GFLOP/s): the tiny Llama's 7 projections per layer (q 32x32,
    k and v 16x32, o 32x32, gate and up 64x32, down 32x64: 9,216 multiply-adds a token) and LoRA r 4 on q, v, up
    (832) over every token through the policy; the LM head over the completion tokens only. Backward adds the
    weight gradients of the trainable (LoRA) layers."""
    from bench.cpu import step_flops
    model = tiny_lm(lora=True)
    V = model.get_output_embeddings().weight.shape[0]
    fwd, bwd = step_flops(model, policy_tokens=10, completion_tokens=6)
    base, lora, head = 2 * 2 * 9216, 2 * 2 * 832, 2 * 32 * V * 6
    assert fwd == (base + lora) * 10 + head
    assert bwd == (base + 2 * lora) * 10 + head


def test_decode_products_time_runs_every_packed_product_once_per_pass(tiny_lm, monkeypatch):
    """bench's matmul-only decode rate times the decoder's own products: per pass, q/k/v, o, gate/up and down of
    every layer and the LM head, each over `rows` rows, and no other op of the decoder."""
    from speedups import cpu_decoder
    from bench.cpu import decode_products_time
    model = tiny_lm(lora=True)
    calls, real = [], cpu_decoder.linear
    monkeypatch.setattr(cpu_decoder, "linear", lambda x, w, b=None: calls.append(x.shape[0]) or real(x, w, b))
    for name in ("rms_norm", "rotate"):
        monkeypatch.setattr(cpu_decoder, name, lambda *a: pytest.fail(f"{name} is not a product"))
    t = decode_products_time(model, rows=8, repeats=2)
    layers = model.config.num_hidden_layers
    assert t > 0 and calls == [8] * ((4 * layers + 1) * 3)                      # a warm-up pass and 2 timed ones
