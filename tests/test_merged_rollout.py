"""speedups/merged_rollout.py: the sampling copy computes what the policy computes (exactly without 4-bit,
within bf16/NF4 rounding with it), leaves the policy untouched, shares what it does not merge, and
rollout(path="merged") returns what the other paths return."""
import pytest
import torch

from conftest import assert_draws_match
from machinery.models import load_model
from rollout import rollout
from speedups import memory_plan, merged_rollout
from speedups.memory import pick_sampler


def _policy(model_dir):
    model, tok, _ = load_model(model_dir, lora_rank=4, log=lambda *a: None)
    torch.manual_seed(1)
    for n, p in model.named_parameters():
        if "lora_B" in n:                                   # B = 0 at init would hide a missing merge
            torch.nn.init.normal_(p, std=0.1)
    return model.eval(), tok


def test_merged_copy_equals_the_policy_and_leaves_it_untouched(tiny_model_dir):
    model, _ = _policy(tiny_model_dir)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = torch.randint(0, 1000, (2, 12))
    with torch.no_grad():
        want = model(input_ids=ids).logits
        plain = merged_rollout.merged_copy(model)
        got = plain(input_ids=ids).logits
    assert not hasattr(plain, "peft_config") and torch.allclose(got, want, atol=1e-5, rtol=0)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    shared = plain.get_input_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    merged = plain.model.layers[0].self_attn.q_proj.weight
    assert shared and merged.data_ptr() != model.base_model.model.model.layers[0].self_attn.q_proj.weight.data_ptr()


def _embedded_policy(dtype):
    """The embedded model in NF4 with `dtype` compute and LoRA (B drawn small, the same each time),
    and one worked problem as ids with the index where its solution starts."""
    from machinery.data import format_prompt, load_task, one_shot_example, tagged_solution
    model, tok, _ = load_model("smollm2-135m", lora_rank=8, load_in_4bit=True, dtype=dtype, log=lambda *a: None)
    torch.manual_seed(1)
    for n, p in model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.01)
    example, rec = one_shot_example(load_task("arithmetic", "train")[0]), load_task("arithmetic", "test")[0]
    prompt = format_prompt(tok, rec["question"], example)
    ids = tok(prompt + tagged_solution(rec), return_tensors="pt", add_special_tokens=False)["input_ids"]
    return model.eval(), ids, len(tok(prompt, add_special_tokens=False)["input_ids"])


def _logits(model, ids, start):
    with torch.no_grad():
        return model(input_ids=ids).logits[0, start - 1:-1].float()          # (solution tokens, V)


@pytest.mark.slow
def test_merged_copy_of_the_4bit_policy_is_within_its_own_bf16_rounding():
    """Tolerance: the bf16 merged copy (NF4 dequantized once, LoRA merged, rounded to bf16) differs
    from the bf16 4-bit policy by no more than that policy differs from itself computed in fp32, in
    the largest and in the mean |logit| difference over a worked solution; and it picks the same
    greedy token wherever the policy's top-2 margin exceeds twice their largest difference."""
    policy32, ids, start = _embedded_policy(torch.float32)
    exact = _logits(policy32, ids, start)
    del policy32
    policy, ids, start = _embedded_policy(torch.bfloat16)
    want, got = _logits(policy, ids, start), _logits(merged_rollout.merged_copy(policy), ids, start)
    own, diff = (want - exact).abs(), (got - want).abs()
    assert diff.max() <= own.max() and diff.mean() <= own.mean(), (diff.max(), own.max(), diff.mean(), own.mean())
    top2 = want.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * diff.max()
    assert clear.float().mean() >= 0.25 and torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])


def test_rollout_through_the_merged_copy(tiny_model_dir):
    model, tok = _policy(tiny_model_dir)
    torch.manual_seed(0)
    ro = rollout(model, tok, ["a prompt", "a longer prompt than that"], 3, 6, path="merged")
    assert ro.prompt_ids.shape[0] == 6 and ro.prompt_ids.shape[1] % merged_rollout.PAD_MULTIPLE == 0
    assert ro.completion_ids.shape == ro.completion_mask.shape and ro.completion_ids.shape[1] <= 6
    assert len(ro.texts) == 6 and model.training is False


def _compiled(device):
    """The decode step compiled as on CUDA, with dynamo's eager backend (no compiler needed on CPU)."""
    return dict(backend="eager", fullgraph=True)


def _live_models():
    from transformers import PreTrainedModel
    import gc
    return sum(issubclass(type(o), PreTrainedModel) for o in gc.get_objects())      # type(): weak proxies too


@pytest.mark.slow                                  # real runs in this process or a child: the slow tier
def test_the_merged_copy_is_kept_and_refreshed_in_place_with_compile_on(tiny_model_dir, monkeypatch):
    """--rollout merged with its CUDA setting (the compiled decode step) forced on CPU: the number of
    live models stays the same from step to step (no copy outlives its step), the copy's weights keep
    their addresses, and after the adapters change it computes what the policy computes."""
    import gc
    model, tok = _policy(tiny_model_dir)
    monkeypatch.setattr(merged_rollout, "compile_options", _compiled)                 # as on CUDA, eager backend
    gc.collect()
    gc.disable()                        # only reference counting frees: what a step of a run relies on
    try:
        counts, ptrs = [], []
        for k in range(3):
            rollout(model, tok, ["a prompt", "a longer prompt than that"], 2, 4, path="merged")
            plain = merged_rollout._SAMPLERS[model]
            ptrs.append(plain.model.layers[0].self_attn.q_proj.weight.data_ptr())
            counts.append(_live_models())
            with torch.no_grad():                           # the policy's adapters move, as after a step
                for n, p in model.named_parameters():
                    if "lora_B" in n:
                        p.add_(0.05)
            del plain
    finally:
        gc.enable()
    assert counts[0] == counts[1] == counts[2] and len(set(ptrs)) == 1, (counts, ptrs)
    plain = merged_rollout.merged_sampler(model)            # refreshed with the latest adapters
    ids = torch.randint(0, 1000, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(plain(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-5, rtol=0)


def test_auto_on_cuda_takes_the_merged_copy_when_the_budget_holds_it(tiny_model_dir):
    """--rollout auto on CUDA (memory_plan.plan_memory; --memory_budget_gb given, so no device is queried): the
    merged copy when the step fits with it held at some micro-batch, `generate` when only the step without
    it fits; the choice is one line and the memory line counts the copy only when it is taken."""
    import dataclasses
    from speedups import memory
    import train
    from machinery.config import parse_args
    argv = ["--model", tiny_model_dir, "--device", "cuda", "--no-load_in_4bit", "--lora_rank", "4",
            "--max_completion_length", "64"]
    model, _, _ = load_model(tiny_model_dir, lora_rank=4)
    smallest = memory.Settings.from_config(parse_args(argv), 100, 4)
    smallest = dataclasses.replace(smallest, micro_batch_size=1, gradient_checkpointing=True, share_prompt=False)
    need = {k: memory.estimate(model.config, dataclasses.replace(smallest, sampler=k))["card"]
            for k in ("merged", "generate")}
    assert need["merged"] > need["generate"]
    for budget, want in ((2e9, "merged"), ((need["merged"] + need["generate"]) / 2, "generate")):
        cfg, lines = parse_args(argv + ["--memory_budget_gb", str(budget / 1e9)]), []
        cfg = memory_plan.plan_memory(cfg, load_model(tiny_model_dir, lora_rank=4)[0], 100, "cuda", lines.append)
        assert cfg.rollout == want and lines[0].startswith(f"sampler: {want} (--rollout auto: ")
        assert ("sampler " in lines[1]) == (want == "merged") and lines[1].startswith("memory: estimated")
    forced = parse_args(argv + ["--memory_budget_gb", str(need["generate"] / 2e9), "--rollout", "merged"])
    with pytest.raises(Exception, match="does not fit"):
        memory_plan.plan_memory(forced, model, 100, "cuda", [].append)


@pytest.mark.slow                                  # real runs in this process or a child: the slow tier
def test_a_run_through_the_auto_choice_equals_a_forced_merged_run(tiny_args, tmp_path, monkeypatch):
    """Three steps of train.py with the CUDA setting forced on CPU (the memory plan runs, and the merged
    copy's decode step compiles, eager backend): --rollout auto with a roomy budget logs the very values
    --rollout merged logs."""
    import json
    import train
    monkeypatch.setattr(merged_rollout, "compile_options", _compiled)
    monkeypatch.setattr(memory_plan, "on_cuda", lambda device: True)
    rows = {}
    for path in ("auto", "merged"):
        out = tmp_path / path
        argv = tiny_args(out, max_steps=3, rollout=path, memory_budget_gb=2, save_steps=3)
        assert train.main(argv) == 0
        assert json.load(open(out / "config.json"))["rollout"] == "merged"
        with open(out / "metrics.jsonl") as f:
            rows[path] = [{k: v for k, v in json.loads(line).items() if not k.startswith("time/") and k != "step_time"}
                          for line in f]
    assert len(rows["auto"]) == 3 and rows["auto"] == rows["merged"]


def test_eval_samples_through_the_same_choice_on_cuda(tiny_model_dir, monkeypatch):
    """eval.py --rollout auto: on CUDA the merged copy when sampling with it held fits the device (its total
    memory, queried), else generate; on CPU rollout.py's own auto, unchanged. With the merged copy the decode
    loop is sized once: a call's most rows (here one problem's 8 samples) and the longest prompt."""
    import types
    import eval as ev
    from machinery.data import longest_prompt
    model, tok = _policy(tiny_model_dir)
    records = [{"question": "What is 2 + 3?", "answer": "5"}, {"question": "What is 12 + 30 + 7?", "answer": "49"}]
    args = ev.parse_args(["--n_samples", "8", "--batch_size", "8", "--max_completion_length", "64"])
    said, sized = [], []
    monkeypatch.setattr(merged_rollout, "reserve", lambda *a: sized.append(a))
    for total, want in ((80e9, "merged"), (1e8, "generate")):
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d, t=total: types.SimpleNamespace(total_memory=t))
        assert pick_sampler(args, model, tok, records, None, "cuda", said.append) == want
        assert said[-1].startswith(f"sampler: {want} (--rollout auto: ")
    assert sized == [(model, 8, longest_prompt(tok, records), 64)]
    assert pick_sampler(args, model, tok, records, None, "cpu", said.append) == "auto" and len(said) == 2
    forced = ev.parse_args(["--rollout", "generate"])
    assert pick_sampler(forced, model, tok, records, None, "cuda", said.append) == "generate"
    forced = ev.parse_args(["--rollout", "merged", "--n_samples", "2", "--batch_size", "8"])
    assert pick_sampler(forced, model, tok, records, None, "cpu", said.append) == "merged" and len(said) == 2
    assert sized[-1][1] == 4                            # both problems' 2 samples in one call


def test_out_of_memory_in_the_merged_copy_falls_back_to_generate_for_the_rest_of_the_run(tiny_model_dir, monkeypatch,
                                                                                         capsys):
    """The copy running out of memory (a patched call raises torch's OutOfMemoryError) is freed, one line says
    why, the same rollout completes through `generate` with every row, and the policy samples through
    `generate` from then on."""
    model, tok = _policy(tiny_model_dir)
    merged_rollout.merged_sampler(model)                                  # a kept copy, as after earlier steps
    calls = []

    def out_of_memory(policy):
        calls.append(policy)
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore detail")
    monkeypatch.setattr(merged_rollout, "merged_sampler", out_of_memory)
    torch.manual_seed(0)
    ro = rollout(model, tok, ["a prompt", "a longer prompt than that"], 3, 6, path="merged")
    assert ro.completion_ids.shape[0] == ro.prompt_ids.shape[0] == 6 and len(ro.texts) == 6
    said = capsys.readouterr().out.splitlines()
    assert said == ["sampler: the merged copy ran out of memory (CUDA out of memory. Tried to allocate 2.00 GiB); "
                    "freed, this rollout and the rest of the run sample through generate"]
    assert model not in merged_rollout._SAMPLERS
    rollout(model, tok, ["a prompt"], 2, 4, path="merged")
    assert len(calls) == 1 and capsys.readouterr().out == ""


def _prompts(tok):
    enc = tok(["a prompt", "a longer prompt than that one"], return_tensors="pt", padding=True, add_special_tokens=False)
    return enc["input_ids"], enc["attention_mask"]


def test_the_decode_loop_draws_the_tokens_generate_draws_greedily(tiny_model_dir):
    """merged_rollout.Decoder with temperature 0 on the merged copy equals transformers' greedy `generate` on the
    same copy token for token, also with its prompts padded further and rows added (the run's fixed shape)."""
    from rollout import eos_ids
    model, tok = _policy(tiny_model_dir)
    plain = merged_rollout.merged_sampler(model)
    ids, attn = _prompts(tok)
    eos, pad = eos_ids(model, tok), tok.pad_token_id
    want = plain.generate(input_ids=ids.repeat_interleave(3, 0), attention_mask=attn.repeat_interleave(3, 0),
                          do_sample=False, max_new_tokens=20, eos_token_id=eos, pad_token_id=pad,
                          cache_implementation="static")[:, ids.shape[1]:]                       # (6, 20)
    for rows, prompt_len in ((6, ids.shape[1]), (8, ids.shape[1] + 9)):
        got = merged_rollout.Decoder(plain, rows, prompt_len, 24, None)(plain, ids, attn, 3, 20, 0, eos, pad,
                                                                          temperature=0.0)
        assert got.shape == want.shape and torch.equal(got, want)


def test_the_decode_step_compiles_once_in_a_run(tiny_model_dir, monkeypatch, capsys):
    """Compile forced as on CUDA (eager backend): sized once to the run's longest prompt and most rows
    (merged_rollout.reserve), rollouts whose prompts fall in both 64-token buckets, with fewer rows last,
    compile the decode step exactly once, and one line says so."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    torch._dynamo.reset()                              # what earlier tests compiled would be found in its cache
    monkeypatch.setattr(merged_rollout, "compile_options", _compiled)
    model, tok = _policy(tiny_model_dir)
    merged_rollout.reserve(model, 6, 90, 8)
    before = counters["stats"]["unique_graphs"]
    widths = []
    for prompts, g in ((["a prompt", "b"], 3), (["word " * 70, "c"], 3), (["another prompt"], 2)):
        ro = rollout(model, tok, prompts, g, 8, path="merged")
        widths.append(ro.prompt_ids.shape[1])
        assert ro.completion_ids.shape[0] == len(prompts) * g
    assert widths == [64, 128, 64] and counters["stats"]["unique_graphs"] - before == 1
    assert merged_rollout._DECODERS[model].compiles == 1
    assert capsys.readouterr().out.count("sampler: the decode step compiled (1 in this run)") == 1


@pytest.mark.slow
def test_the_decode_loop_samples_what_generate_samples(small_vocab_lm):
    """Temperature 1 and top-p 0.9 on the copy of a policy with a peaked distribution (conftest.small_vocab_lm):
    over 2,000 rows the first token's frequencies match transformers' `generate` on the same copy and the exact
    nucleus probabilities within 5 binomial standard errors, and the mean per-token log-prob of 6 drawn tokens
    under the policy matches generate's draws within 5 standard errors."""
    model = small_vocab_lm
    plain = merged_rollout.merged_sampler(model)
    ids, eos, pad, n = torch.tensor([[5, 17]]), [2], 0, 2000
    attn = torch.ones_like(ids)
    torch.manual_seed(0)
    ours = merged_rollout.Decoder(plain, n, ids.shape[1], 6, None)(plain, ids, attn, n, 6, 6, eos, pad, 1.0, 0.9)
    torch.manual_seed(1)
    theirs = plain.generate(input_ids=ids.repeat(n, 1), attention_mask=attn.repeat(n, 1), do_sample=True,
                            temperature=1.0, top_p=0.9, top_k=0, max_new_tokens=6, min_new_tokens=6, eos_token_id=eos,
                            pad_token_id=pad, cache_implementation="static")[:, ids.shape[1]:]
    assert_draws_match(model, ids, ours, theirs, 0.9, logits_of=plain)


def _sdpa_key_shapes(attention, module, q, k, v, mask):
    """The shapes of the keys scaled_dot_product_attention receives when `attention` is traced by torch.compile
    (fullgraph, dynamo's graph only), and its output."""
    shapes = []

    def backend(gm, example_inputs):
        for node in gm.graph.nodes:
            if node.target is torch._C._nn.scaled_dot_product_attention:
                shapes.append(tuple(node.args[1].meta["example_value"].shape))
        return gm
    out, _ = torch.compile(attention, backend=backend, fullgraph=True)(module, q, k, v, mask, scaling=0.125)
    return shapes, out


def test_grouped_attention_reads_each_kv_head_once_under_compile():
    """One query token (the decode step), 8 heads on 2 K/V heads, a padding mask: compiled, transformers' SDPA
    path hands SDPA keys repeated to 8 heads over the whole cache; grouped_sdpa hands it the 2 heads as they
    are, and its output equals transformers' within float rounding, eagerly bit for bit."""
    import torch._dynamo
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    torch._dynamo.reset()
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 4, True
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 8, 1, 16), torch.randn(3, 2, 40, 16), torch.randn(3, 2, 40, 16)   # (B, H, 1, D), (B, H_kv, L, D)
    mask = torch.ones(3, 1, 1, 40, dtype=torch.bool)
    mask[0, ..., :7] = False                                               # a left-padded row
    theirs_shapes, theirs = _sdpa_key_shapes(sdpa_attention_forward, module, q, k, v, mask)
    ours_shapes, ours = _sdpa_key_shapes(merged_rollout.grouped_sdpa, module, q, k, v, mask)
    assert theirs_shapes == [(3, 8, 40, 16)] and ours_shapes == [(3, 2, 40, 16)]
    assert ours.shape == (3, 1, 8, 16)
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-5)
    eager = sdpa_attention_forward(module, q, k, v, mask, scaling=0.125)[0]
    assert torch.equal(merged_rollout.grouped_sdpa(module, q, k, v, mask, scaling=0.125)[0], eager)


def test_the_copy_attends_with_grouped_heads_and_samples_what_sdpa_samples(tiny_model_dir):
    """The merged copy of an SDPA policy attends with grouped_sdpa; its decode loop draws, greedily and bit for
    bit, what the same copy draws with transformers' SDPA."""
    from rollout import eos_ids
    model, tok = _policy(tiny_model_dir)
    plain = merged_rollout.merged_copy(model)
    assert model.config._attn_implementation == "sdpa" and plain.config._attn_implementation == "gtpo_grouped_sdpa"
    ids, attn = _prompts(tok)
    eos, pad = eos_ids(model, tok), tok.pad_token_id
    draws = []
    for name in ("gtpo_grouped_sdpa", "sdpa"):
        plain.set_attn_implementation(name)
        draws.append(merged_rollout.Decoder(plain, 6, ids.shape[1] + 5, 16, None)(plain, ids, attn, 3, 16, 0, eos,
                                                                                 pad, temperature=0.0))
    assert draws[0].shape == (6, 16) and torch.equal(draws[0], draws[1])
