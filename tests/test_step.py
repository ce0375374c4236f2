"""Tests for step.py and the shared-prompt paths (speedups/cpu_rollout.py, speedups.logprobs.PolicyPass): computing each prompt once per group
(PolicyPass with prompt_index, the pre-filled rollout, merged LoRA for sampling) gives what G copies
give -- log-probs, entropy, loss, KL and every gradient -- on a tiny random Llama."""
import contextlib
import dataclasses

import pytest
import torch

import gtpo
import rewards
import step
from conftest import grads
from machinery.config import Config
from machinery.models import load_tokenizer
from rollout import Rollout, rollout
from speedups.cpu_rollout import Blocked, blocked, merged_lora, prefill_shared, sample_next
from speedups.logprobs import positions, sequence_logprobs


def _group(V, B, G, P, L, seed=0):
    """B left-padded prompts of different lengths (B, P) and G completions each (B*G, L)."""
    g = torch.Generator().manual_seed(seed)
    p_ids = torch.randint(0, V, (B, P), generator=g)
    p_mask = torch.ones(B, P, dtype=torch.long)
    for b in range(1, B):
        p_mask[b, :2 * b] = 0                           # prompt b is 2b tokens shorter
    c_ids = torch.randint(0, V, (B * G, L), generator=g)
    lengths = torch.randint(1, L + 1, (B * G,), generator=g)
    lengths[0] = L
    c_mask = (torch.arange(L)[None] < lengths[:, None]).long()
    return p_ids, p_mask, c_ids, c_mask


@pytest.mark.parametrize("lora", [True, False])
@pytest.mark.parametrize("B", [1, 2])
@pytest.mark.parametrize("chunk", [0, 4])
def test_shared_prompt_pass_equals_copies(tiny_lm, lora, B, chunk):
    """Log-probs, entropy and gradients (through the prompt's shared KV cache) match G copies."""
    model = tiny_lm(lora)
    G, P, L = 3, 7, 6
    p_ids, p_mask, c_ids, c_mask = _group(model.config.vocab_size, B, G, P, L)
    index = torch.arange(B * G) // G
    w = torch.randn(B * G, L, generator=torch.Generator().manual_seed(1))
    out = []
    for shared in (False, True):
        model.zero_grad()
        args = (p_ids, p_mask, None) if shared else (p_ids[index], p_mask[index], None)
        logp, ent = sequence_logprobs(model, args[0], args[1], c_ids, c_mask, logprob_chunk=chunk,
                                      prompt_index=index if shared else None)
        (logp * w * c_mask).sum().backward()
        out.append((logp.detach(), ent, grads(model)))
    m = c_mask.bool()
    (lp0, e0, g0), (lp1, e1, g1) = out
    torch.testing.assert_close(lp1[m], lp0[m], atol=1e-5, rtol=0)
    torch.testing.assert_close(e1[m], e0[m], atol=1e-5, rtol=1e-5)    # ~10.8 nats: relative
    assert g0.keys() == g1.keys() and len(g0) > 0
    assert any("embed_tokens" in n for n in g0) != lora                 # full fine-tuning reaches the prompt's embeddings
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], atol=1e-5, rtol=1e-4, msg=n)


def _fixed_rollout(tok, V, B, G, P, L):
    p_ids, p_mask, c_ids, c_mask = _group(V, B, G, P, L, seed=3)
    c_ids = c_ids.masked_fill(c_mask == 0, tok.pad_token_id)
    return Rollout(prompt_ids=p_ids.repeat_interleave(G, 0), prompt_mask=p_mask.repeat_interleave(G, 0),
                   completion_ids=c_ids, completion_mask=c_mask, truncated=c_mask.all(1).bool(),
                   texts=[f"t{i}" for i in range(B * G)])


@pytest.mark.parametrize("method,beta", [("gtpo", 0.0), ("grpo", 0.04)])
def test_rl_step_shared_equals_unshared_with_micro_batches(tiny_model_dir, tiny_lm, monkeypatch, method, beta):
    """The whole RL step (micro-batches cut across groups, GRPO's reference pass with adapters off)
    leaves the same gradients and metrics with and without prompt sharing."""
    model = tiny_lm(lora=True)
    tok = load_tokenizer(tiny_model_dir)
    B, G = 2, 3
    ro = _fixed_rollout(tok, model.config.vocab_size, B, G, P=6, L=5)
    monkeypatch.setattr(step, "rollout", lambda *a, **k: ro)
    reward = lambda texts, answers, task, counts=None: (torch.tensor([0., 1, 2, 2, 0, 1]),) * 2 + (torch.zeros(6),)  # noqa: E731
    monkeypatch.setattr(rewards, "reward", reward)                        # rewards.reward, the one entry point
    base = Config(method=method, dataset="arithmetic", generation_size=G, max_completion_length=5, logprob_chunk=4,
                  objective=gtpo.Objective(beta=beta, entropy_filter="off"))
    results = {}
    for share, mb in [(False, 0), (True, 0), (True, 2), (True, 4), (False, 4)]:
        model.zero_grad()
        cfg = dataclasses.replace(base, share_prompt=share, micro_batch_size=mb)
        m, _, _ = step.rl_step(model, model, tok, ["p", "q"], ["1", "2"], cfg)
        results[(share, mb)] = (m, grads(model))
    m0, g0 = results[(False, 0)]
    assert any(v.abs().sum() > 0 for n, v in g0.items() if "lora_A" in n)
    for key, (m, g) in results.items():
        for k in ("loss", "entropy") + (("kl",) if beta else ("gtpo/conflict_frac",)):
            assert m[k] == pytest.approx(m0[k], abs=1e-5), (key, k)
        for n in g0:
            torch.testing.assert_close(g[n], g0[n], atol=1e-6, rtol=1e-4, msg=f"{key} {n}")
    if beta:
        assert m0["kl"] > 0                            # lora_B != 0, so the policy differs from the reference


def test_each_prompt_runs_once_per_step_whatever_the_micro_batches(tiny_model_dir, tiny_lm, monkeypatch):
    """With --share_prompt the step's policy pass reads the prompt tokens once, in one call, for micro-batches
    of 0, 2 and 4 completions (2 prompts x G = 3; 2 and 4 cut across the groups); without it, every
    completion's pass reads its own copy."""
    model, tok = tiny_lm(lora=True), load_tokenizer(tiny_model_dir)
    ro = _fixed_rollout(tok, model.config.vocab_size, 2, 3, P=6, L=5)
    monkeypatch.setattr(step, "rollout", lambda *a, **k: ro)
    reward = lambda texts, answers, task, counts=None: (torch.tensor([0., 1, 2, 2, 0, 1]),) * 2 + (torch.zeros(6),)  # noqa: E731
    monkeypatch.setattr(rewards, "reward", reward)
    prompt_rows = []                                    # per call of the model: its rows that start with a prompt
    real = model.forward

    def counting(*args, input_ids=None, **kwargs):
        starts = [row for row in input_ids.tolist() if row[:6] in ro.prompt_ids.tolist()]
        prompt_rows.append(len(starts))
        return real(*args, input_ids=input_ids, **kwargs)
    monkeypatch.setattr(model, "forward", counting)
    base = Config(dataset="arithmetic", generation_size=3, max_completion_length=5, logprob_chunk=4,
                  objective=gtpo.Objective(entropy_filter="off"))
    for share, mb, reads in [(True, 0, [2]), (True, 2, [2]), (True, 4, [2]), (False, 2, [2, 2, 2])]:
        prompt_rows.clear()
        step.rl_step(model, model, tok, ["p", "q"], ["1", "2"], dataclasses.replace(base, share_prompt=share,
                                                                                     micro_batch_size=mb))
        assert [n for n in prompt_rows if n] == reads, (share, mb)


def test_micro_batches_put_each_group_longest_first_and_end_at_their_longest_completion():
    """Below one pass: each group's completions longest first (ties in rollout order), micro-batches cut
    across groups, each as wide as its longest completion; one pass keeps the rollout's rows and width."""
    lengths = torch.tensor([2, 5, 3, 5, 1, 4, 4, 2])                         # two groups of 4
    mask = (torch.arange(6)[None] < lengths[:, None]).long()                 # (8, 6), right-padded
    batches = step.micro_batches(mask, 4, 3)
    assert [(rows.tolist(), width) for rows, width in batches] == [([1, 3, 2], 5), ([0, 5, 6], 4), ([7, 4], 2)]
    (rows, width), = step.micro_batches(mask, 4, 8)
    assert rows.tolist() == list(range(8)) and width == 6


def test_micro_batches_give_the_same_loss_and_gradients_under_every_objective(tiny_model_dir, small_vocab_lm,
                                                                             monkeypatch):
    """Micro-batches of 0 (all), 2 and 4 completions, cut across groups: the same loss and LoRA gradients
    for the paper's and the released code's objectives, each with every setting moved off its value once
    (conftest.objective_cases, from gtpo.Objective's declarations), GTPO and GRPO (gtpo.aggregate divides by
    the step's totals). The 512-token model: the embedded tokenizer's 49,152-entry head would dominate the tier."""
    from conftest import objective_cases
    model, tok = small_vocab_lm, load_tokenizer(tiny_model_dir)
    ro = _fixed_rollout(tok, model.config.vocab_size, 2, 3, P=6, L=5)
    monkeypatch.setattr(step, "rollout", lambda *a, **k: ro)
    reward = lambda texts, answers, task, counts=None: (torch.tensor([0., 1, 2, 2, 0, 1]),) * 2 + (torch.zeros(6),)  # noqa: E731
    monkeypatch.setattr(rewards, "reward", reward)
    base = Config(dataset="arithmetic", generation_size=3, max_completion_length=5, logprob_chunk=4, h_ini=0.5,
                  objective=gtpo.Objective(entropy_filter="off"))
    model.zero_grad()
    m, _, _ = step.rl_step(model, model, tok, ["p", "q"], ["1", "2"], base)
    filtered, moving = set(), []
    for method in ("gtpo", "grpo"):
        for label, objective in objective_cases(m["entropy"]):       # about half of the completions above it
            results = []
            for mb in (0, 2, 4):
                model.zero_grad()
                cfg = dataclasses.replace(base, method=method, micro_batch_size=mb, objective=objective)
                m, _, _ = step.rl_step(model, model, tok, ["p", "q"], ["1", "2"], cfg)
                results.append((m, torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])))
            (m0, g0), others = results[0], results[1:]
            moving.append(bool((g0 != 0).any()))   # not all: a case may filter or zero out every kept token
            for m, g in others:
                assert m["loss"] == pytest.approx(m0["loss"], rel=1e-5, abs=1e-6), (method, label)
                atol = max(1e-6, 1e-4 * g0.abs().max().item())     # float32 rounding grows with the gradient
                torch.testing.assert_close(g, g0, atol=atol, rtol=1e-4, msg=f"{method} {label}")   # every LoRA gradient
            filtered.add(0 < m0.get("gtpo/filtered_frac", 0) < 1)
    assert filtered == {True, False}                    # the filter's active branch is among the cases
    assert sum(moving) > 0.8 * len(moving)              # and nearly every case has a gradient to compare


class _TwoRanks:
    """runs.Dist's mean over two ranks, as rank 0 sees it, for a step computed in this one process."""

    def __init__(self, other_tokens):
        self.other = other_tokens

    def mean(self, values):
        return {"tokens": (values["tokens"] + self.other) / 2}


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo", "luspo"])   # bnpo: each rank's own mean
def test_one_rank_and_two_ranks_give_the_same_update(tiny_model_dir, tiny_lm, monkeypatch, loss_type):
    """Two ranks of one prompt each, their gradients averaged as DDP averages them, equal one rank with both
    prompts, for every loss type: token-level (dapo) divides by the token count over all ranks."""
    model, tok = tiny_lm(lora=True), load_tokenizer(tiny_model_dir)
    ro = _fixed_rollout(tok, model.config.vocab_size, 2, 3, P=6, L=5)
    halves = [Rollout(**{f.name: getattr(ro, f.name)[i * 3:(i + 1) * 3] for f in dataclasses.fields(ro)})
              for i in (0, 1)]
    by_text = dict(zip(ro.texts, [0., 1, 2, 2, 0, 1]))                 # each completion keeps its reward

    def reward(texts, answers, task, counts=None):
        r = torch.tensor([float(by_text[t]) for t in texts])
        return r, r, torch.zeros(len(texts))
    monkeypatch.setattr(rewards, "reward", reward)
    cfg = Config(dataset="arithmetic", generation_size=3, max_completion_length=5, logprob_chunk=4,
                 objective=gtpo.Objective(entropy_filter="off", loss_type=loss_type))
    monkeypatch.setattr(step, "rollout", lambda *a, **k: ro)
    model.zero_grad()
    m1, _, _ = step.rl_step(model, model, tok, ["p", "q"], ["1", "2"], cfg)
    g1 = grads(model)
    tokens = [float(h.completion_mask.sum()) for h in halves]
    assert tokens[0] != tokens[1]                       # ranks with different token counts
    per_rank = []
    for r, half in enumerate(halves):
        monkeypatch.setattr(step, "rollout", lambda *a, **k: half)
        model.zero_grad()
        m, _, _ = step.rl_step(model, model, tok, [["p", "q"][r]], [["1", "2"][r]], cfg, ranks=_TwoRanks(tokens[1 - r]))
        per_rank.append((m, grads(model)))
    assert (per_rank[0][0]["loss"] + per_rank[1][0]["loss"]) / 2 == pytest.approx(m1["loss"], abs=1e-6)
    for n in g1:
        torch.testing.assert_close((per_rank[0][1][n] + per_rank[1][1][n]) / 2, g1[n], atol=1e-6, rtol=1e-4, msg=n)


def _rl_grads(model, tok, monkeypatch, **settings):
    """One GTPO rl_step on a fixed rollout of 2 prompts x 3 completions, the objective's `settings` ->
    (metrics, {name: grad})."""
    ro = _fixed_rollout(tok, model.config.vocab_size, 2, 3, P=6, L=5)
    monkeypatch.setattr(step, "rollout", lambda *a, **k: ro)
    reward = lambda texts, answers, task, counts=None: (torch.tensor([0., 1, 2, 2, 0, 1]),) * 2 + (torch.zeros(6),)  # noqa: E731
    monkeypatch.setattr(rewards, "reward", reward)                        # rewards.reward, the one entry point
    cfg = Config(dataset="arithmetic", generation_size=3, max_completion_length=5, logprob_chunk=4,
                 objective=gtpo.Objective(**settings))
    model.zero_grad()
    m, _, _ = step.rl_step(model, model, tok, ["p", "q"], ["1", "2"], cfg)
    return m, grads(model)


def test_every_completion_filtered_released_has_no_gradient_eq7_has(tiny_model_dir, tiny_lm, monkeypatch):
    """--entropy_filter all --ent_threshold 0: delta_i = 0 for all. The released form's gradient is exactly 0;
    Eq. 7's entropy term still moves every completion's entropy."""
    model, tok = tiny_lm(lora=True), load_tokenizer(tiny_model_dir)
    m, g = _rl_grads(model, tok, monkeypatch, entropy_filter="all", ent_threshold=0.0, entropy_term="released")
    assert g and all((v == 0).all() for v in g.values()) and m["loss"] == 0
    m, g = _rl_grads(model, tok, monkeypatch, entropy_filter="all", ent_threshold=0.0, entropy_term="eq7")
    assert any((v != 0).any() for n, v in g.items() if "lora" in n)
    assert m["loss"] == pytest.approx(0.1 * m["entropy"], rel=1e-5)      # gamma <H> alone


def test_gamma_zero_and_filter_off_both_forms_give_the_same_step(tiny_model_dir, tiny_lm, monkeypatch):
    model, tok = tiny_lm(lora=True), load_tokenizer(tiny_model_dir)
    out = {term: _rl_grads(model, tok, monkeypatch, entropy_filter="off", ent_gamma=0.0, entropy_term=term)
           for term in ("eq7", "released")}
    (m7, g7), (mr, gr) = out["eq7"], out["released"]
    assert m7["loss"] == mr["loss"] and g7.keys() == gr.keys()
    assert all(torch.equal(g7[n], gr[n]) for n in g7) and any((v != 0).any() for v in g7.values())


@pytest.mark.parametrize("method,beta", [("gtpo", 0.0), ("grpo", 0.04)])
def test_gradient_checkpointing_gives_the_same_loss_and_gradients(tiny_model_dir, tiny_lm, monkeypatch, method, beta):
    """--gradient_checkpointing (what CUDA defaults to) recomputes each layer in backward: the RL
    step's loss, metrics and LoRA gradients equal those without it, micro-batches and GRPO's
    reference pass included."""
    from machinery.models import checkpoint_activations
    tok = load_tokenizer(tiny_model_dir)
    B, G = 2, 3
    reward = lambda texts, answers, task, counts=None: (torch.tensor([0., 1, 2, 2, 0, 1]),) * 2 + (torch.zeros(6),)  # noqa: E731
    monkeypatch.setattr(rewards, "reward", reward)                        # rewards.reward, the one entry point
    cfg = Config(method=method, dataset="arithmetic", generation_size=G, max_completion_length=5, logprob_chunk=4,
                 share_prompt=False, micro_batch_size=4, objective=gtpo.Objective(beta=beta, entropy_filter="off"))
    results = {}
    for ckpt in (False, True):
        torch.manual_seed(0)
        model = tiny_lm(lora=True)
        if ckpt:
            checkpoint_activations(model)
        model.train()
        ro = _fixed_rollout(tok, model.config.vocab_size, B, G, P=6, L=5)
        monkeypatch.setattr(step, "rollout", lambda *a, **k: ro)
        m, _, _ = step.rl_step(model, model, tok, ["p", "q"], ["1", "2"], cfg)
        results[ckpt] = (m, grads(model))
    (m0, g0), (m1, g1) = results[False], results[True]
    assert g0.keys() == g1.keys() and any(v.abs().sum() > 0 for v in g0.values())
    for k in ("loss", "entropy") + (("kl",) if beta else ("gtpo/conflict_frac",)):
        assert m1[k] == pytest.approx(m0[k], abs=1e-6), k
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], atol=1e-6, rtol=1e-5, msg=n)


def test_prefilled_rollout_gives_the_same_tokens_under_greedy(tiny_model_dir, tiny_lm):
    """Pre-filling each prompt once and merging LoRA for sampling: the same tokens as a plain
    `generate` over G copies with the adapters unmerged, at (near) zero temperature."""
    model = tiny_lm(lora=True).eval()
    tok = load_tokenizer(tiny_model_dir)
    prompts = ["a short prompt", "a somewhat longer prompt with more words in it"]
    G, new = 3, 10
    ro = rollout(model, tok, prompts, G, new, temperature=1e-6, path="shared")
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        ref = model.generate(input_ids=enc["input_ids"].repeat_interleave(G, 0),
                             attention_mask=enc["attention_mask"].repeat_interleave(G, 0), do_sample=False,
                             max_new_tokens=new, min_new_tokens=new, pad_token_id=tok.pad_token_id)
    ref = ref[:, enc["input_ids"].shape[1]:]
    m = ro.completion_mask.bool()
    assert ro.completion_ids.shape[1] >= 1 and torch.equal(ro.completion_ids[m], ref[:, :m.shape[1]][m])
    assert torch.equal(ro.prompt_ids, enc["input_ids"].repeat_interleave(G, 0))


@pytest.mark.parametrize("path", ["shared", "generate"])
def test_initial_entropy_is_the_policy_pass_entropy_of_its_samples_and_keeps_no_logits(tiny_model_dir, tiny_lm,
                                                                                      monkeypatch, path):
    """<H>_ini's <H>_i (step.initial_entropy): H_t of softmax(logits / T) from a no-grad pass of the chunked
    head over the samples, averaged per completion, for 8 prompts per call (here 10: two calls); and
    `generate` is never asked to keep every step's logits."""
    import gtpo
    import rollout as rollout_mod
    model = tiny_lm(lora=True).eval()
    tok = load_tokenizer(tiny_model_dir)
    prompts = [f"prompt number {i} with some words" for i in range(10)]
    cfg = Config(dataset="arithmetic", max_completion_length=6, temperature=0.7, rollout=path)
    calls, seen = [], []
    real_generate = model.generate
    monkeypatch.setattr(model, "generate", lambda **kw: seen.append(kw.get("output_logits")) or real_generate(**kw))
    real_rollout = step.rollout
    monkeypatch.setattr(step, "rollout", lambda *a, **k: calls.append(real_rollout(*a, **k)) or calls[-1])
    h = step.initial_entropy(model, tok, prompts, cfg)
    assert h.shape == (10,) and len(calls) == 2 and [len(ro.texts) for ro in calls] == [8, 2]
    want = []
    for ro in calls:
        with torch.no_grad():
            _, ent = sequence_logprobs(model, ro.prompt_ids, ro.prompt_mask, ro.completion_ids, ro.completion_mask,
                                       logprob_chunk=0, temperature=0.7)          # full logits, of what was sampled
        want.append(gtpo.masked_mean(ent, ro.completion_mask, dim=1))
    torch.testing.assert_close(h, torch.cat(want), atol=1e-5, rtol=1e-5)
    assert h.std() > 0 and (path == "shared") == (seen == []) and not any(seen)
    assert step.initial_entropy(model, tok, [], cfg).shape == (0,)        # a rank with no prompt
    asked = []                                                             # lengths forced as rl_step forces them
    monkeypatch.setattr(step, "rollout", lambda *a, **k: asked.append(k["min_new_tokens"]) or real_rollout(*a, **k))
    step.initial_entropy(model, tok, prompts[:3], dataclasses.replace(cfg, min_new_tokens=6))
    assert asked == [6]


def test_blocked_layers_and_prefilled_cache_give_the_same_next_token_logits(tiny_lm):
    """The rollout's pre-allocated, expanded cache and Blocked linear layers, with the adapters on
    and with LoRA merged: the logits of the next token after each prompt, for each of its G rows,
    equal a plain forward over the whole prompt; every original layer is back afterwards and no
    weight was written."""
    model = tiny_lm(lora=True).eval()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, model.config.vocab_size, (2, 7), generator=g)
    attn = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]])            # left-padded
    attn_g = attn.repeat_interleave(3, 0)
    modules = dict(model.named_modules())
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=attn, position_ids=positions(attn)).logits[:, -1]  # (B, V)
    # every nn.Linear but lora_A (4 outputs, not a multiple of 16): 14 projections, 6 lora_B, the head
    for merge in (False, True):
        with torch.no_grad(), merged_lora(model) if merge else contextlib.nullcontext():
            cache = prefill_shared(model, ids, attn, 3, 4)
            with blocked(model):
                assert sum(isinstance(m, Blocked) for m in model.modules()) == 14 + 6 + 1
                got = model(input_ids=ids[:, -1:].repeat_interleave(3, 0), attention_mask=attn_g,
                            position_ids=positions(attn_g)[:, -1:], past_key_values=cache,
                            use_cache=True).logits[:, -1]                         # (B*G, V)
        after = dict(model.named_modules())
        assert after.keys() == modules.keys() and all(after[k] is modules[k] for k in modules)
        assert all(torch.equal(weights[n], p) for n, p in model.named_parameters())
        assert cache.layers[0].keys.shape[0] == 6 and cache.layers[0].keys.shape[2] == 7 + 4
        torch.testing.assert_close(got, want.repeat_interleave(3, 0), atol=1e-5, rtol=1e-5)


def test_sample_next_draws_from_softmax_with_top_p_and_temperature():
    """The rollout's sampler: frequencies over 40,000 draws match softmax(z / T) within 4 standard
    errors per token; top_p keeps the smallest set of most likely tokens whose mass reaches top_p
    (as transformers' TopPLogitsWarper); tokens of probability 0 are never drawn."""
    torch.manual_seed(0)
    z = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, float("-inf")])                   # (V,)
    n = 40_000
    for T, top_p in [(1.0, 1.0), (0.7, 1.0), (1.0, 0.8)]:
        draws = sample_next(z.expand(n, -1), temperature=T, top_p=top_p)          # (n,)
        p = (z / T).softmax(-1)
        if top_p < 1.0:                                                           # keep 0, 1, 2: mass >= 0.8
            assert p[:2].sum() < top_p <= p[:3].sum()
            p = torch.where(torch.arange(6) < 3, p, 0.0)
            p = p / p.sum()
        freq = torch.bincount(draws, minlength=6).double() / n
        se = (p.double() * (1 - p.double()) / n).sqrt()
        assert ((freq - p.double()).abs() <= 4 * se + 1e-12).all(), (T, top_p, freq, p)
        assert freq[p == 0].sum() == 0
    assert torch.equal(sample_next(torch.tensor([[0.0, 3.0, 1.0]]), temperature=1e-6), torch.tensor([1]))


def test_merged_lora_is_exact_and_leaves_base_weights_bit_identical(tiny_lm):
    model = tiny_lm(lora=True).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(2))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        want = model(input_ids=ids).logits
        with merged_lora(model):
            got = model(input_ids=ids).logits
            swapped = sum(not torch.equal(before[n], p) for n, p in model.named_parameters() if "base_layer" in n)
        after = model(input_ids=ids).logits
    assert swapped == 2 * 3                             # q, v, up in both layers: merged weights in use
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(after, want)                     # adapters back on, exactly as before
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())


def test_grpo_takes_the_entropy_filter_and_term_only_when_asked():
    """App. 14 / Fig. 10c: GRPO + filtering + gamma, in both readings of Eq. 7's term. Default GRPO is the
    plain baseline (Eq. 1)."""
    g = torch.Generator().manual_seed(4)
    logp = torch.randn(4, 5, generator=g).requires_grad_()
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 1, 1, 0]])
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    h = torch.tensor([1.2, 1.5, 0.9, 1.2])                     # <H>_i: rows 0, 1 and 3 above 1.05
    def policy_loss(objective):
        return gtpo.policy_loss(objective, "grpo", objective.filter_mode("grpo"), logp, mask, adv, h)
    plain, _, delta = policy_loss(gtpo.Objective())
    assert delta is None and plain.item() == gtpo.grpo_loss(logp, None, None, mask, adv)[0].item()
    # released: delta_i (A_i - gamma <H>_i)
    objective = gtpo.Objective(entropy_filter="all", ent_threshold=1.05, ent_gamma=0.1, entropy_term="released")
    filtered, m, delta = policy_loss(objective)
    assert delta.tolist() == [0.0, 0.0, 1.0, 0.0]
    want = torch.tensor([0.0, 0.0, 0.5 - 0.09, 0.0])
    torch.testing.assert_close(gtpo.shaped_advantages(adv, h, objective, "all"), want)
    assert filtered.item() == pytest.approx(gtpo.grpo_loss(logp, None, None, mask, want)[0].item(), abs=1e-7)
    assert filtered.item() != pytest.approx(plain.item())
    neg, _, delta = policy_loss(dataclasses.replace(objective, entropy_filter="neg"))
    assert delta.tolist() == [1.0, 0.0, 1.0, 0.0]                    # OnlyNeg keeps row 0 (A > 0)
    want = torch.tensor([1.0 - 0.12, 0.0, 0.41, 0.0])
    assert neg.item() == pytest.approx(gtpo.grpo_loss(logp, None, None, mask, want)[0].item(), abs=1e-7)
    # Eq. 7: delta_i A_i, and + gamma <H>_i over every completion, filtered or not
    eq7, _, delta = policy_loss(dataclasses.replace(objective, entropy_term="eq7"))
    assert delta.tolist() == [0.0, 0.0, 1.0, 0.0]
    want = gtpo.grpo_loss(logp, None, None, mask, torch.tensor([0.0, 0.0, 0.5, 0.0]))[0].item()
    assert eq7.item() == pytest.approx(want + 0.1 * (1.2 + 1.5 + 0.9 + 1.2) / 4, abs=1e-6)


def test_sft_step_micro_batches_give_the_same_loss_and_gradient(tiny_model_dir, tiny_lm):
    from machinery.data import arithmetic_task
    model, tok = tiny_lm(lora=True), load_tokenizer(tiny_model_dir)
    records = arithmetic_task("train")[:5]
    out = {}
    for mb, sft_mb in ((0, 0), (2, 0), (4, 2)):        # sft_micro_batch_size overrides micro_batch_size
        model.zero_grad()
        cfg = Config(method="sft", dataset="arithmetic", generation_size=1, max_completion_length=8,
                              micro_batch_size=mb, sft_micro_batch_size=sft_mb)
        out[mb, sft_mb] = (step.sft_step(model, tok, records, None, cfg, "cpu")["loss"], grads(model))
    assert out[2, 0][0] == pytest.approx(out[0, 0][0], abs=1e-6) and out[0, 0][0] > 0
    for n, g in out[0, 0][1].items():
        torch.testing.assert_close(out[2, 0][1][n], g, atol=1e-6, rtol=1e-5, msg=n)
        assert torch.equal(out[4, 2][1][n], out[2, 0][1][n]), n   # the same passes of 2: bit-identical
    assert out[4, 2][0] == out[2, 0][0]


def test_sft_step_runs_the_prompts_common_opening_once_with_the_same_loss_and_gradient(tiny_model_dir, tiny_lm):
    """The system prompt and the one-shot example, shared by every prompt, run once per pass (PolicyPass)
    and the rows continue them: the loss and gradient of one full sequence per record."""
    from machinery.data import arithmetic_task, one_shot_example
    model, tok = tiny_lm(lora=True), load_tokenizer(tiny_model_dir)
    train = arithmetic_task("train")
    records, example = train[1:6], one_shot_example(train[0])
    p_ids, p_mask, ids, mask, target, index = step.sft_batch(tok, records, example, "cpu")
    assert p_ids.shape[0] == 1 and p_ids.shape[1] > 100 and index.tolist() == [0] * 5   # the opening, once
    assert target.sum() < mask.sum() and (target <= mask).all()        # each row's own prompt is not a target
    out = {}
    for share, mb in ((True, 0), (True, 2), (False, 0)):
        model.zero_grad()
        cfg = Config(method="sft", dataset="arithmetic", generation_size=1, max_completion_length=8,
                     sft_micro_batch_size=mb, share_prompt=share)
        out[share, mb] = (step.sft_step(model, tok, records, example, cfg, "cpu")["loss"], grads(model))
    for key in ((True, 0), (True, 2)):
        assert out[key][0] == pytest.approx(out[False, 0][0], abs=1e-6)
        for n, g in out[False, 0][1].items():
            torch.testing.assert_close(out[key][1][n], g, atol=1e-6, rtol=1e-5, msg=n)
