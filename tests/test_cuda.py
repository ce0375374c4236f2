"""CUDA checks, skipped without a GPU (CI has none): both samplers, the step's gradients against
CPU, and short runs with the CUDA defaults (4-bit NF4, bf16 autocast, paged 8-bit AdamW,
checkpointing, a fitted micro-batch), through `generate` and through the merged copy."""
import dataclasses
import os

import pytest
import torch

import rewards
import step
import train
from conftest import grads
from gtpo import Objective
from machinery.config import Config
from machinery.models import load_tokenizer
from rollout import rollout

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_both_rollout_paths_on_cuda_agree_under_greedy(tiny_model_dir, tiny_lm):
    """`generate` (the CUDA default) and the shared decode loop: valid masks, same shapes, and at
    (near) zero temperature the same tokens."""
    model, tok = tiny_lm(lora=True).cuda(), load_tokenizer(tiny_model_dir)
    prompts = ["a short prompt", "a somewhat longer prompt with more words in it"]
    out = {p: rollout(model, tok, prompts, 3, 8, temperature=1e-6, path=p) for p in ("generate", "shared")}
    a, b = out["generate"], out["shared"]
    assert a.completion_ids.is_cuda and a.completion_ids.shape == b.completion_ids.shape
    m = a.completion_mask.bool()
    assert torch.equal(a.completion_mask, b.completion_mask) and torch.equal(a.completion_ids[m], b.completion_ids[m])


def test_rl_step_gradients_on_cuda_equal_cpu(tiny_model_dir, tiny_lm, monkeypatch):
    """One GTPO step on a fixed rollout (fp32): the same loss and LoRA gradients on CUDA as on CPU."""
    from test_step import _fixed_rollout
    tok = load_tokenizer(tiny_model_dir)
    reward = lambda texts, answers, task, counts=None: (torch.tensor([0., 1, 2, 2, 0, 1]),) * 2 + (torch.zeros(6),)  # noqa: E731
    monkeypatch.setattr(rewards, "reward", reward)                        # rewards.reward, the one entry point
    cfg = Config(dataset="arithmetic", generation_size=3, max_completion_length=5, logprob_chunk=4,
                 micro_batch_size=2, objective=Objective(entropy_filter="off"))
    out = {}
    for device in ("cpu", "cuda"):
        torch.manual_seed(0)
        model = tiny_lm(lora=True).to(device)
        ro = _fixed_rollout(tok, model.config.vocab_size, 2, 3, P=6, L=5)
        ro = dataclasses.replace(ro, **{k: getattr(ro, k).to(device) for k in
                                        ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")})
        monkeypatch.setattr(step, "rollout", lambda *a, **k: ro)
        m, _, _ = step.rl_step(model, model, tok, ["p", "q"], ["1", "2"], cfg)
        out[device] = (m["loss"], {n: g.cpu() for n, g in grads(model).items()})
    assert out["cuda"][0] == pytest.approx(out["cpu"][0], abs=1e-5)
    for n, g in out["cpu"][1].items():
        torch.testing.assert_close(out["cuda"][1][n], g, atol=1e-5, rtol=1e-4, msg=n)


@pytest.fixture(scope="module")
def nf4_dir(tmp_path_factory):
    """A 2-layer random Llama wide enough for NF4's 64-value blocks, with the embedded tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from machinery.models import embedded_model_dir
    tok = load_tokenizer(embedded_model_dir())
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    d = tmp_path_factory.mktemp("nf4")
    LlamaForCausalLM(cfg).save_pretrained(d)
    tok.save_pretrained(d)
    return str(d)


@pytest.mark.parametrize("rollout_path", ["auto", "merged"])
def test_two_steps_with_the_paper_recipe_on_cuda(tmp_path, nf4_dir, monkeypatch, rollout_path):
    """train.py on CUDA with its CUDA defaults -- 4-bit NF4, bf16 autocast, paged 8-bit AdamW,
    checkpointing, the micro-batch fitted by speedups/memory.py -- sampling through `generate` or the
    merged copy."""
    import json
    def fake_score(texts, answers, task, counts=None):
        r = torch.arange(len(texts), dtype=torch.float32) % 3
        return r, r, torch.zeros_like(r)
    monkeypatch.setattr(rewards, "reward", fake_score)
    out = str(tmp_path / "run")
    assert train.main(["--model", nf4_dir, "--output_dir", out, "--max_steps", "2", "--device", "cuda",
                       "--generation_size", "4", "--max_completion_length", "8", "--lora_rank", "4", "--no-one_shot",
                       "--entropy_filter", "off", "--rollout", rollout_path]) == 0
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    cfg = json.load(open(os.path.join(out, "config.json")))
    assert len(rows) == 2 and all(r["grad_norm"] > 0 for r in rows)
    # a whole group of 4 x 8 tokens fits without checkpointing, so the planner turns it off
    assert (cfg["optimizer"], cfg["load_in_4bit"], cfg["gradient_checkpointing"]) == ("adamw_8bit", True, False)
    assert cfg["micro_batch_size"] >= 1 and cfg["dtype"] == "auto"
    assert os.path.isfile(os.path.join(out, "final", "adapter_model.safetensors"))
