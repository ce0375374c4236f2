"""Tests for rollout.py and train.py: masks on a tiny random-weight model, one optimizer
step per method, a 2-step run of the embedded model with a resume, and bad flags."""
import json
import os
import subprocess
import sys

import pytest
import torch

import train
from models import embedded_model_dir, load_tokenizer
from rollout import completion_mask, rollout

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """A 2-layer random Llama with the embedded model's tokenizer, saved as a local folder."""
    from transformers import LlamaConfig, LlamaForCausalLM
    tok = load_tokenizer(embedded_model_dir())
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    d = tmp_path_factory.mktemp("tiny")
    LlamaForCausalLM(cfg).save_pretrained(d)
    tok.save_pretrained(d)
    return str(d)


def test_completion_mask_stops_after_first_eos():
    ids = torch.tensor([[5, 6, 2, 7, 2], [5, 5, 5, 5, 5], [2, 9, 9, 9, 9]])
    mask, truncated = completion_mask(ids, [2])
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]
    assert truncated.tolist() == [False, True, False]
    mask, truncated = completion_mask(ids, [2, 7])                  # several EOS ids
    assert mask[0].tolist() == [1, 1, 1, 0, 0] and not truncated[0]


def test_rollout_on_tiny_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM
    tok = load_tokenizer(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    # make EOS likely so that some completions stop early and others are truncated
    with torch.no_grad():
        model.lm_head.weight[tok.eos_token_id] *= 0
        model.lm_head.bias = None
    torch.manual_seed(3)
    prompts = ["a short prompt", "a somewhat longer prompt with more words in it"]
    ro = rollout(model, tok, prompts, group_size=3, max_new_tokens=12)
    N, L = ro.completion_ids.shape
    assert N == 6 and L <= 12
    enc = tok(prompts, padding=True, return_tensors="pt", add_special_tokens=False)
    assert torch.equal(ro.prompt_ids, enc["input_ids"].repeat_interleave(3, 0))     # groups consecutive
    for i in range(N):
        row, m = ro.completion_ids[i].tolist(), ro.completion_mask[i].tolist()
        n = sum(m)
        assert m == [1] * n + [0] * (L - n)                           # right-padded
        if ro.truncated[i]:
            assert n == L and tok.eos_token_id not in row
        else:
            assert row[n - 1] == tok.eos_token_id and tok.eos_token_id not in row[:n - 1]
            assert all(t == tok.pad_token_id for t in row[n:])


def _run(tmp_path, tiny_model_dir, monkeypatch, *extra):
    # a random model earns no reward; a fake reward that varies within each group makes the
    # advantages non-zero so that every method has a gradient to apply
    def fake_score(texts, answers, task):
        r = torch.arange(len(texts), dtype=torch.float32) % 3
        return r, r, torch.zeros_like(r)
    monkeypatch.setattr(train, "score", fake_score)
    out = str(tmp_path / "run")
    argv = ["--model", tiny_model_dir, "--dataset", "arithmetic", "--max_steps", "1", "--lora_rank", "4",
            "--generation_size", "4", "--max_completion_length", "8", "--lr", "1e-2", "--output_dir", out,
            "--entropy_filter", "off", "--no-one_shot", "--optimizer", "adamw_torch", "--adam_beta1", "0.9",
            "--adam_beta2", "0.95", "--warmup_ratio", "0", *extra]
    assert train.main(argv) == 0
    from safetensors.torch import load_file
    return out, load_file(os.path.join(out, "final", "adapter_model.safetensors"))


@pytest.mark.parametrize("method", [["--use_gtpo"], ["--use_grpo", "--beta", "0.04"], ["--use_sft"]])
def test_one_step_changes_lora_weights(tmp_path, tiny_model_dir, monkeypatch, method):
    out, w = _run(tmp_path, tiny_model_dir, monkeypatch, *method)
    lora_b = [v for k, v in w.items() if "lora_B" in k]
    assert lora_b and any(v.abs().sum() > 0 for v in lora_b)         # B starts at exactly 0
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert len(rows) == 1 and rows[0]["step"] == 1
    if method[0] != "--use_sft":
        for k in ("reward", "reward_std", "rewards/format", "rewards/accuracy", "frac_reward_zero_std",
                  "entropy", "completions/mean_length", "completions/clipped_ratio", "loss", "grad_norm", "lr"):
            assert k in rows[0], k
    if method[0] == "--use_grpo":
        assert rows[0]["kl"] == pytest.approx(0.0, abs=1e-6)          # policy == reference at step 1
    if method[0] == "--use_gtpo":
        assert "gtpo/conflict_frac" in rows[0] and "gtpo/filtered_frac" in rows[0]


def _cli(*args, cwd=HERE):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "train.py", *args], cwd=cwd, capture_output=True, text=True,
                          env=env, timeout=900)


def test_embedded_two_steps_then_resume(tmp_path):
    out = str(tmp_path / "demo")
    # the demo profile: step 1 is the SFT warm-up, steps 2-3 are GTPO
    common = ["--output_dir", out, "--generation_size", "2", "--max_completion_length", "16",
              "--ent_ini_prompts", "2", "--save_steps", "2", "--sft_warmup_steps", "1"]
    r = _cli("--max_steps", "2", *common)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert [row["step"] for row in rows] == [1, 2]
    assert os.path.isfile(os.path.join(out, "checkpoint-2", "adapter_model.safetensors"))
    assert os.path.isfile(os.path.join(out, "checkpoint-2", "trainer_state.pt"))
    assert os.path.getsize(os.path.join(out, "samples.jsonl")) > 0
    assert "entropy filter" in r.stdout                               # the Eq. 6 decision is logged
    # the same command again is refused; with --resume it continues to step 3
    r = _cli("--max_steps", "3", *common)
    assert r.returncode == 2 and "--resume" in r.stderr
    r = _cli("--max_steps", "3", "--resume", *common)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stdout and "checkpoint-2" in r.stdout
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert [row["step"] for row in rows] == [1, 2, 3]
    assert [row["phase"] for row in rows] == ["sft", "rl", "rl"]
    state = torch.load(os.path.join(out, "checkpoint-3", "trainer_state.pt"), weights_only=False)
    assert state["step"] == 3


@pytest.mark.parametrize("args,msg", [
    (["--generation_size", "1"], "need G >= 2"),
    (["--model", "no-such-model"], "unknown model 'no-such-model'"),
    (["--dataset", "gsm9k"], "unknown dataset 'gsm9k'"),
    (["--resume"], "no run in"),
])
def test_bad_flags_fail_with_a_clear_message(tmp_path, args, msg):
    r = _cli("--output_dir", str(tmp_path / "x"), *args)
    assert r.returncode == 2 and msg in r.stderr and "Traceback" not in r.stderr


def test_contradictory_methods_are_refused():
    r = _cli("--use_gtpo", "--use_sft")
    assert r.returncode == 2 and "not allowed with argument" in r.stderr


def test_help_explains_batch_size():
    r = _cli("--help")
    assert r.returncode == 0 and "PROMPTS per optimizer step" in r.stdout
