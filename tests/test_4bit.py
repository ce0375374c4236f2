"""The paper's GPU recipe (Listing 1: 4-bit NF4 base + LoRA + bf16 compute + 8-bit AdamW) rehearsed
on CPU through bitsandbytes' CPU backend, on tiny random Llamas: one with a separate LM head, one
with tied embeddings (as Qwen2.5 has)."""
import os
import shutil

import pytest
import torch

import rewards
import step
import train
from conftest import DATA_DIR
from machinery.models import embedded_model_dir, load_model, load_tokenizer
from rollout import rollout
from speedups.logprobs import sequence_logprobs

pytestmark = pytest.mark.slow                         # subprocess runs: the slow tier


def settle(model):
    """One no-grad forward in eval mode: on CPUs with AVX-512 bitsandbytes repacks each 4-bit layer's
    weights and absmax (bf16) for its kernel at the first such forward, once and deterministically,
    as the rollout does in training. Snapshots taken after it compare like with like on every host."""
    model.eval()
    with torch.no_grad():
        model(input_ids=torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]]))
    model.train()
    return model


RECIPE = ["--load_in_4bit", "--dtype", "bfloat16", "--optimizer", "adamw_8bit"]


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    """{"untied": folder, "tied": folder} of 2-layer random Llamas with the embedded tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM
    tok = load_tokenizer(embedded_model_dir())
    out = {}
    for name, tied in (("untied", False), ("tied", True)):
        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                          tie_word_embeddings=tied, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                          pad_token_id=tok.pad_token_id)
        d = tmp_path_factory.mktemp(name)
        LlamaForCausalLM(cfg).save_pretrained(d)
        tok.save_pretrained(d)
        out[name] = str(d)
    return out


def _argv(model_dir, out, *extra):
    return ["--model", model_dir, "--output_dir", str(out), "--generation_size", "4", "--max_completion_length", "6",
            "--entropy_filter", "off", "--lora_rank", "4", "--no-one_shot", "--lr", "1e-2", "--warmup_ratio", "0",
            *RECIPE, *extra]


def _split(model):
    """(4-bit base tensors, LoRA tensors) by name, cloned: the packed NF4 weights with their
    quantization state, and the trainable adapters."""
    import bitsandbytes as bnb
    base, lora = {}, {}
    for name, mod in model.named_modules():
        if isinstance(mod, bnb.nn.Linear4bit):
            base[name] = mod.weight.data.clone()
            base[name + ".absmax"] = mod.weight.quant_state.absmax.clone()
    for n, p in model.named_parameters():
        if p.requires_grad:
            lora[n] = p.detach().clone()
    return base, lora


def _varied_reward(texts, answers, task, counts=None):
    """A random model earns no reward; a reward that varies within each group gives GRPO a gradient."""
    r = torch.arange(len(texts), dtype=torch.float32) % 3
    return r, r, torch.zeros_like(r)


def _trained_model(monkeypatch):
    """Keep the model train.main ends with (train.save_final receives it)."""
    kept, save_final = {}, train.save_final
    def keep(args, model, *rest):
        kept["model"] = model
        return save_final(args, model, *rest)
    monkeypatch.setattr(train, "save_final", keep)
    return kept


@pytest.mark.parametrize("kind", ["untied", "tied"])
@pytest.mark.parametrize("method", [["--use_gtpo"], ["--use_grpo", "--beta", "0.04"]])
def test_4bit_bf16_step_trains_lora_and_leaves_the_base_untouched(tmp_path, tiny_dirs, monkeypatch, kind, method):
    torch.manual_seed(3407)
    fresh, _, info = load_model(tiny_dirs[kind], lora_rank=4, load_in_4bit=True, dtype=torch.bfloat16)
    assert info["quantized_4bit"] and info["dtype"] == "torch.bfloat16"
    base0, lora0 = _split(settle(fresh))
    assert base0 and all(v.dtype == torch.uint8 for k, v in base0.items() if not k.endswith("absmax"))
    kept = _trained_model(monkeypatch)
    monkeypatch.setattr(rewards, "reward", _varied_reward)
    assert train.main(_argv(tiny_dirs[kind], tmp_path / "run", "--max_steps", "2", *method)) == 0
    base1, lora1 = _split(kept["model"])
    assert base1.keys() == base0.keys() and all(torch.equal(base1[k], base0[k]) for k in base0)
    changed = [k for k in lora0 if not torch.equal(lora0[k], lora1[k])]
    assert lora0.keys() == lora1.keys() and any("lora_B" in k for k in changed)
    assert all(torch.isfinite(v).all() for v in lora1.values())
    import bitsandbytes as bnb
    layers = [m for m in kept["model"].modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert layers and all(m.compute_dtype == torch.bfloat16 for m in layers)    # what trained was NF4 + bf16


@pytest.mark.parametrize("kind", ["untied", "tied"])
def test_4bit_chunked_logprobs_match_full_logits(tiny_dirs, kind):
    torch.manual_seed(0)
    model, tok, _ = load_model(tiny_dirs[kind], lora_rank=4, load_in_4bit=True, dtype=torch.bfloat16)
    for n, p in model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.1)                      # adapters that do something
    ro = rollout(model, tok, ["Ava has 3 apples.", "How many?"], 3, 8)
    args = (ro.prompt_ids, ro.prompt_mask, ro.completion_ids, ro.completion_mask)
    full_lp, full_h = sequence_logprobs(model, *args, logprob_chunk=0)
    chunk_lp, chunk_h = sequence_logprobs(model, *args, logprob_chunk=3)
    m = ro.completion_mask.bool()
    assert torch.allclose(full_lp[m].float(), chunk_lp[m].float(), atol=2e-2, rtol=2e-2)
    assert torch.allclose(full_h[m].float(), chunk_h[m].float(), atol=2e-2, rtol=2e-2)
    (full_lp[m].sum()).backward()
    g_full = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    (chunk_lp[m].sum()).backward()
    g_chunk = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert g_full.keys() == g_chunk.keys() and g_full
    for n in g_full:
        assert torch.allclose(g_full[n], g_chunk[n], atol=5e-2 * g_full[n].abs().max().item() + 1e-6), n


def test_4bit_resume_is_bit_exact(tmp_path, tiny_dirs):
    """Stopped after checkpoint-1 and resumed, a 4-bit run ends with the uninterrupted run's adapter,
    optimizer state and metrics."""
    from safetensors.torch import load_file
    flags = ["--max_steps", "2", "--save_steps", "1"]
    a = tmp_path / "a"
    assert train.main(_argv(tiny_dirs["untied"], a, *flags)) == 0
    b = tmp_path / "b"                                          # the same run, stopped after step 1
    shutil.copytree(a, b)
    for d in ("checkpoint-2", "final"):
        shutil.rmtree(b / d)
    assert train.main(_argv(tiny_dirs["untied"], b, *flags, "--resume")) == 0
    wa, wb = (load_file(os.path.join(x, "final", "adapter_model.safetensors")) for x in (a, b))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    sa, sb = (torch.load(os.path.join(x, "checkpoint-2", "trainer_state.pt"), map_location="cpu", weights_only=False)
              for x in (a, b))
    for k, v in sa["optimizer"]["state"].items():
        for name, t in v.items():
            if isinstance(t, torch.Tensor):
                assert torch.equal(t, sb["optimizer"]["state"][k][name]), name
    clock = ("step_time", "eval/seconds")
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith("time/") and k not in clock} for r in rows]
    la, lb = ((a / "metrics.jsonl").read_text().splitlines(), (b / "metrics.jsonl").read_text().splitlines())
    import json
    assert strip(map(json.loads, la)) == strip(map(json.loads, lb))


@pytest.mark.needs_data
def test_the_papers_flag_set_runs_two_steps_in_4bit(tmp_path, tiny_dirs, monkeypatch):
    """README's paper command (`--dataset gsm8k --use_gtpo`, Listing 1's defaults) on the tiny model, with
    what CUDA would default to made explicit (4-bit + bf16), 2 steps with short completions."""
    monkeypatch.setenv("GTPO_DATA_DIR", DATA_DIR)
    argv = ["--model", tiny_dirs["tied"], "--dataset", "gsm8k", "--use_gtpo", "--load_in_4bit", "--dtype", "bfloat16",
            "--max_steps", "2", "--max_completion_length", "8", "--ent_ini_prompts", "2",
            "--output_dir", str(tmp_path / "paper")]
    args = train.parse_args(argv)
    assert (args.lr, args.generation_size, args.batch_size, args.epochs, args.adam_beta1, args.optimizer,
            args.load_in_4bit) == (1e-6, 12, 1, 1, 0.999999, "adamw_8bit", True)
    assert train.main(argv) == 0
    import json
    rows = [json.loads(x) for x in (tmp_path / "paper" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["phase"] == "rl"] == [1, 2]
    assert [r["step"] for r in rows if r["phase"] == "eval"] == [0, 2]    # held-out: RL's start and its last step
    cfg = json.loads((tmp_path / "paper" / "config.json").read_text())
    assert cfg["load_in_4bit"] is True and cfg["dtype"] == "bfloat16" and cfg["method"] == "gtpo"


@pytest.mark.parametrize("with_adapter", [False, True])
def test_eval_loads_4bit_with_or_without_an_adapter(tmp_path, tiny_dirs, with_adapter):
    """eval.py --load_in_4bit: the base in NF4 (no adapters to train, so LoRA rank 0 is no obstacle),
    with a 4-bit run's adapter on top; it evaluates and writes results.json."""
    import json
    import eval as ev
    from bitsandbytes.nn import Linear4bit
    adapter = None
    if with_adapter:
        assert train.main(_argv(tiny_dirs["untied"], tmp_path / "run", "--max_steps", "1")) == 0
        adapter = str(tmp_path / "run" / "final")
    model, _ = ev.load_eval_model(tiny_dirs["untied"], adapter, "cpu", True, torch.bfloat16, log=lambda *a: None)
    assert any(isinstance(m, Linear4bit) for m in model.modules()) and hasattr(model, "peft_config") == with_adapter
    out = tmp_path / "eval"
    argv = ["--model", tiny_dirs["untied"], "--load_in_4bit", "--dtype", "bfloat16", "--limit", "2", "--n_samples", "2",
            "--max_completion_length", "4", "--one_shot_from", "none", "--output_dir", str(out)]
    assert ev.main(argv + (["--adapter", adapter] if adapter else [])) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["n_samples"] == 2 and len(res["per_problem_correct"]) == 2
