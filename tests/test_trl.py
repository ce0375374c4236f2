"""Tests for gtpo_trl/trainer.py (skipped without TRL): GTPOTrainer's loss and gradients equal gtpo.policy_loss on the
same completions at another temperature (tests/test_objective.py holds every setting of the objective equal to
the loop's); its <H>_i pass; groups split by micro-batches or by processes keep their advantages; flat groups;
config refusals."""
import dataclasses

import pytest
import torch

pytest.importorskip("trl", reason="needs TRL, an optional extra: pip install -r requirements-trl.txt")

import gtpo                                                            # noqa: E402
from conftest import grads                                             # noqa: E402
from gtpo_trl import GTPOConfig, GTPOTrainer, per_token_advantages                         # noqa: E402
from gtpo_trl.trainer import flat_groups_to_zero                                           # noqa: E402
from machinery.models import load_tokenizer                                      # noqa: E402
from speedups.logprobs import sequence_logprobs                                 # noqa: E402


def _args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), num_generations=4, per_device_train_batch_size=4, max_completion_length=8,
                bf16=False, use_cpu=True, report_to="none", entropy_filter="off")
    return GTPOConfig(**{**base, **kw})


def _planted(V, G=4, B=2, T=7, seed=0):
    """B groups of G completions with shared leading and trailing spans, ragged lengths, and rewards: mixed
    in the first group, all equal in the second."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, V, (B * G, T), generator=g)
    ids[:, :2] = 7                                                     # a shared leading span
    lengths = torch.tensor([7, 5, 6, 4, 7, 3, 6, 5])[:B * G]
    for i, n in enumerate(lengths.tolist()):
        ids[i, n - 2:n] = 9                                            # a shared trailing span
    mask = (torch.arange(T)[None] < lengths[:, None]).long()
    rewards = torch.tensor([2.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])[:B * G]      # group 2 is flat
    return ids, mask, rewards


def _trainer(tmp_path, model, tok, **kw):
    from datasets import Dataset
    ds = Dataset.from_list([{"prompt": "one two three"}] * 8)
    t = GTPOTrainer(model=model, processing_class=tok, reward_funcs=[lambda completions, **k: [0.0] * len(completions)],
                    args=_args(tmp_path, **kw), train_dataset=ds)
    t.current_gradient_accumulation_steps = 1
    return t


@pytest.mark.parametrize("term", ["eq7", "released"])
@pytest.mark.parametrize("filter_mode,loss_type",
                         [("off", "grpo"), ("all", "grpo"), ("neg", "dapo"), ("all", "dr_grpo")])
def test_trainer_loss_and_gradients_equal_ours_at_a_temperature(tmp_path, tiny_model_dir, tiny_lm, filter_mode,
                                                                 loss_type, term):
    """At T = 0.7 both take log-probs and entropies of softmax(logits / T), the sampled distribution; with "eq7"
    both add gamma <H>_i with its gradient (TRL's entropies there, ours from the chunked head); both aggregate
    as the loss type says (TRL's normalisers, train.py's gtpo.aggregate)."""
    model, tok = tiny_lm(lora=True), load_tokenizer(tiny_model_dir)
    ids, mask, rewards = _planted(model.config.vocab_size)
    ids = ids.masked_fill(mask == 0, tok.pad_token_id)
    N = len(ids)
    p_ids = torch.randint(5, model.config.vocab_size, (N, 5), generator=torch.Generator().manual_seed(1))
    p_mask = torch.ones_like(p_ids)                                    # no padding: both compute positions alike
    with torch.no_grad():
        _, ent = sequence_logprobs(model, p_ids, p_mask, ids, mask, temperature=0.7)
    h = gtpo.masked_mean(ent, mask, dim=1)                             # (N,) <H>_i
    t = _trainer(tmp_path, model, tok, entropy_filter=filter_mode, ent_threshold=float(h.median()), temperature=0.7,
                 entropy_term=term, loss_type=loss_type)
    objective = t.objective
    out = {"prompt_ids": p_ids, "prompt_mask": p_mask, "completion_ids": ids, "completion_mask": mask}
    torch.testing.assert_close(t._mean_entropy(out), h, atol=1e-4, rtol=1e-5)
    adv = gtpo.group_advantages(rewards, 4, objective)
    per_token, metrics = per_token_advantages(ids, mask, adv, h, 4, objective, filter_mode)
    model.train()
    model.zero_grad()
    inputs = {**out, "advantages": per_token, "num_items_in_batch": mask.sum()}
    loss = t._compute_loss(model, inputs)
    loss.backward()
    model.eval()
    with torch.no_grad():                                              # as TRL's evaluation computes it
        assert t._compute_loss(model, inputs).item() == pytest.approx(loss.item(), abs=1e-6)
    model.train()
    g_trl = grads(model)
    # ours: gtpo.policy_loss on the same completions, as the loop calls it
    model.zero_grad()
    adv = gtpo.group_advantages(rewards, 4, objective)
    weights, _, n_conf = gtpo.batch_conflict_weights(ids, mask, adv, 4, objective)
    logp, ent = sequence_logprobs(model, p_ids, p_mask, ids, mask, temperature=0.7,
                                  entropy_grad=objective.entropy_grad("gtpo"))
    h_ours = gtpo.masked_mean(ent, mask, dim=1)                        # (N,) with grad under "eq7"
    assert h_ours.requires_grad == (term == "eq7")
    ours, _, _ = gtpo.policy_loss(objective, "gtpo", filter_mode, logp, mask, adv, h_ours, weights, n_conf,
                                  totals=gtpo.Totals(N, float(mask.sum()), t.args.max_completion_length))
    ours.backward()
    assert loss.item() == pytest.approx(ours.item(), abs=1e-6) and ours.item() != 0
    g_ours = grads(model)
    assert g_trl.keys() == g_ours.keys() and len(g_ours) > 0
    for n in g_ours:
        torch.testing.assert_close(g_trl[n], g_ours[n], atol=1e-5, rtol=1e-4, msg=n)
    assert metrics["gtpo/conflict_frac"] > 0


def test_entropy_pass_computes_each_prompt_once_and_equals_trls_pass(tmp_path, tiny_model_dir, tiny_lm):
    """<H>_i from the pass that runs each prompt once for its completions equals TRL's own joint pass
    (two prompts, the second left-padded; ragged completions; a peaked head so entropies differ)."""
    model, tok = tiny_lm(lora=True), load_tokenizer(tiny_model_dir)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(30)
    t = _trainer(tmp_path, model, tok)
    assert not t._shards_parameters()
    g = torch.Generator().manual_seed(2)
    p = torch.randint(5, 1000, (8, 6), generator=g)
    p[:4], p[4:] = p[0], p[4]
    pm = torch.ones_like(p)
    p[4:, :2], pm[4:, :2] = tok.pad_token_id, 0
    c = torch.randint(5, 1000, (8, 7), generator=g)
    cm = (torch.arange(7)[None] < torch.tensor([7, 3, 5, 7, 2, 7, 6, 1])[:, None]).long()
    out = {"prompt_ids": p, "prompt_mask": pm, "completion_ids": c.masked_fill(cm == 0, tok.pad_token_id),
           "completion_mask": cm}
    h = t._mean_entropy(out)
    with torch.no_grad():
        _, ent, _ = t._get_per_token_logps_and_entropies(model, torch.cat([p, out["completion_ids"]], 1),
                                                         torch.cat([pm, cm], 1), 7, 8, compute_entropy=True)
    torch.testing.assert_close(h, gtpo.masked_mean(ent.float(), cm, dim=1), atol=1e-4, rtol=1e-4)
    assert h.std() > 0.1


def test_under_sharded_parameters_every_process_calls_the_model_alike(tmp_path, tiny_model_dir, tiny_lm, monkeypatch):
    """Where an engine shards the parameters (ZeRO-3, FSDP: _shards_parameters), <H>_i comes from TRL's own
    no-grad forward, which gathers them: as many calls when every completion is one token long as when they are
    long, so that processes with different completions make the same collective calls; and the same <H>_i as
    the loop's pass (unpadded prompts)."""
    model, tok = tiny_lm(lora=True), load_tokenizer(tiny_model_dir)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(30)
    t = _trainer(tmp_path, model, tok, per_device_train_batch_size=4)
    g = torch.Generator().manual_seed(2)
    p = torch.randint(5, 1000, (8, 6), generator=g)
    c = torch.randint(5, 1000, (8, 7), generator=g)
    calls, real = [], model.forward

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)
    model.forward = counting
    for lengths in ([7, 3, 5, 7, 2, 7, 6, 1], [1] * 8):
        cm = (torch.arange(7)[None] < torch.tensor(lengths)[:, None]).long()
        out = {"prompt_ids": p, "prompt_mask": torch.ones_like(p), "completion_ids": c.masked_fill(cm == 0, 2),
               "completion_mask": cm}
        whole = t._mean_entropy(out)                                     # the loop's pass
        monkeypatch.setattr(t, "_shards_parameters", lambda: True)
        calls.clear()
        h = t._mean_entropy(out)
        assert len(calls) == 2, lengths                                 # 8 rows in chunks of 4, on every process
        torch.testing.assert_close(h, whole, atol=1e-4, rtol=1e-4)
        assert h.std() > 0.01                                           # entropies that differ
        monkeypatch.undo()


def test_flat_group_gives_no_conflicts_and_zero_advantage():
    """A group whose rewards are all equal gets A = 0 exactly, even where TRL's mean leaves a residue
    (flat_groups_to_zero): no conflict masks. Under Eq. 7 its per-token advantage is 0 (its gamma <H>_i is the
    loss's own term); in the released form it is -gamma <H>_i on every real token (as in our own loop)."""
    ids, mask, rewards = _planted(50)
    adv = gtpo.group_advantages(rewards, 4)
    assert (adv[4:] == 0).all() and (adv[:4] != 0).all()
    residue = adv.clone()
    residue[4:] = torch.tensor([1e-9, -1e-9, 2e-9, -2e-9])            # what a rounded group mean can leave
    per_func = torch.stack([rewards, torch.full_like(rewards, float("nan"))], 1)   # a second function unscored
    per_func[5, 0] = float("nan")                                       # a row no function scored: not counted
    torch.testing.assert_close(flat_groups_to_zero(residue, per_func, 4), adv, rtol=0, atol=0)
    w, conflict, _ = gtpo.batch_conflict_weights(ids, mask, adv, 4)
    assert not conflict[4:].any() and conflict[:4].any()
    h = torch.full((8,), 0.3)
    per_token, m = per_token_advantages(ids, mask, adv, h, 4, gtpo.Objective(entropy_term="eq7"), "off")
    assert (per_token[4:] == 0).all()
    torch.testing.assert_close(per_token[:4], w[:4] * adv[:4].unsqueeze(1))
    per_token, m = per_token_advantages(ids, mask, adv, h, 4, gtpo.Objective(), "off")   # the default: released
    torch.testing.assert_close(per_token[4:], -0.1 * 0.3 * mask[4:].float())   # the flat group
    torch.testing.assert_close(per_token[:4], w[:4] * (adv[:4] - 0.1 * 0.3).unsqueeze(1))


def _one_generation(model_dir, out, steps=1, **kw):
    """GTPOTrainer on the tiny model for `steps` optimizer steps of one generation batch (2 prompts x
    G = 8, top-k 2 so that completions share spans, a reward that varies within groups) -> ({row key:
    [its lambda_{i,t} over the whole group, from the first generation batch]}, {row key: [the per-token advantages
    TRL's loss read, shaped there with <H>_i from its forward]}); a key (prompt, completion) can repeat."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tok = load_tokenizer(model_dir)
    generated, seen = {}, {}

    def key(inputs, i):
        n = int(inputs["completion_mask"][i].sum())
        return tuple(inputs["prompt_ids"][i].tolist()), tuple(inputs["completion_ids"][i, :n].tolist())

    class Recording(GTPOTrainer):
        def _generate_and_score_completions(self, inputs):
            out_ = super()._generate_and_score_completions(inputs)
            if not generated:
                for i in range(len(out_["completion_ids"])):
                    k = key(out_, i)
                    generated.setdefault(k, []).append(out_["gtpo_weights"][i, :len(k[1])].tolist())
            return out_

        def _shape_in_loss(self, entropies):
            super()._shape_in_loss(entropies)
            given, inputs = self._in_loss[:2]
            for i in range(len(inputs["completion_ids"])):
                k = key(inputs, i)
                seen.setdefault(k, []).append(given["advantages"][i, :len(k[1])].tolist())

    ds = Dataset.from_list([{"prompt": "one two three"}, {"prompt": "four five six seven"}] * 4)
    args = GTPOConfig(output_dir=str(out), num_generations=8, max_completion_length=6, max_steps=steps, bf16=False,
                      use_cpu=True, report_to="none", save_strategy="no", top_k=2, seed=0, entropy_filter="off",
                      logging_steps=1, disable_tqdm=True, **kw)
    reward = lambda completions, **_: [float(ord(c[-1]) % 2) if c else 0.0 for c in completions]   # noqa: E731
    Recording(model=model, processing_class=tok, reward_funcs=[reward], args=args, train_dataset=ds).train()
    return generated, seen


def test_micro_batches_and_accumulation_carry_each_rows_advantages(tmp_path, tiny_model_dir):
    """TRL shuffles a generation batch and splits it into micro-batches (gradient accumulation,
    steps_per_generation): every row reaches the loss with its lambda_{i,t} computed over its whole group and its
    A_i shaped there with <H>_i from the loss forward, the same as with one micro-batch (to float rounding: the
    forward's batch differs)."""
    one, seen1 = _one_generation(tiny_model_dir, tmp_path / "a", per_device_train_batch_size=16)
    assert sum(map(len, one.values())) == 16 and sum(map(len, seen1.values())) == 16
    assert any(len(set(w)) > 1 for rows in one.values() for w in rows)   # conflict-weighted tokens in some row
    assert any(len(set(a)) > 1 for rows in seen1.values() for a in rows)
    for name, kw, steps in [("ga", dict(per_device_train_batch_size=8, gradient_accumulation_steps=2), 1),
                            ("ga4", dict(per_device_train_batch_size=4, gradient_accumulation_steps=4), 1)]:
        gen, seen = _one_generation(tiny_model_dir, tmp_path / name, steps, **kw)
        assert {k: sorted(v) for k, v in gen.items()} == {k: sorted(v) for k, v in one.items()}, name   # the same
        assert seen.keys() == seen1.keys(), name                       # completions and lambda
        for k in seen1:
            torch.testing.assert_close(torch.tensor(sorted(seen[k])), torch.tensor(sorted(seen1[k])), rtol=1e-5,
                                       atol=1e-6, msg=name)


def test_added_fields_are_the_settings_gtpo_reads(tmp_path):
    """GTPOConfig adds to GRPOConfig the objective's settings GTPO reads (gtpo.Objective's declarations) and no
    other; TRL's own defaults that GTPO needs are kept (one iteration, no KL)."""
    a = _args(tmp_path, entropy_filter="auto")
    assert (a.loss_type, a.scale_rewards, a.num_iterations, a.beta) == ("grpo", "group", 1, 0.0)
    added = {f.name for f in dataclasses.fields(GTPOConfig)} - {g.name for g in dataclasses.fields(
        GTPOConfig.__mro__[2])}
    reads = {f.name for f in dataclasses.fields(gtpo.Objective) if gtpo.GTPO in f.metadata["reads"]}
    assert added == reads - {"loss_type", "scale_rewards"}            # those two replace TRL's own fields


def test_h_ini_is_saved_with_trls_checkpoint_and_restored_on_resume(tmp_path, tiny_model_dir):
    """Eq. 6's <H>_ini comes from the first training batch; a resumed trainer reads it from the
    checkpoint (gtpo_state.json) instead of measuring the checkpoint's own first batch."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    import json
    seen = []

    class Watching(GTPOTrainer):
        def _filter_mode(self, all_h, mode):
            seen.append((self._h_ini, None if all_h is None else all_h.mean().item()))
            return super()._filter_mode(all_h, mode)

    def trainer(steps):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        args = GTPOConfig(output_dir=str(tmp_path), num_generations=4, per_device_train_batch_size=4,
                          max_completion_length=6, max_steps=steps, bf16=False, use_cpu=True, report_to="none",
                          save_strategy="steps", save_steps=1, seed=0, disable_tqdm=True, entropy_filter="auto",
                          learning_rate=0.05)
        reward = lambda completions, **_: [float(len(c) % 2) for c in completions]   # noqa: E731
        return Watching(model=model, processing_class=load_tokenizer(tiny_model_dir), reward_funcs=[reward],
                        args=args, train_dataset=Dataset.from_list([{"prompt": "one two three"}] * 8))
    first = trainer(1)
    first.train()
    h_ini = first._h_ini
    assert seen[0] == (None, pytest.approx(h_ini))                     # measured on the first batch
    assert json.loads((tmp_path / "checkpoint-1" / "gtpo_state.json").read_text()) == {"h_ini": h_ini}
    seen.clear()
    resumed = trainer(2)
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-1"))
    assert seen == [(h_ini, None)]                                     # not measured again: no <H>_i pass at all


def _two_process_worker(model_dir, out):
    """Run by test_two_processes_see_whole_groups under torchrun: one GTPO step, G = 8 and 4
    completions per process, so the group straddles the two processes; each saves what it gathered,
    the rows it kept and the advantages they got."""
    from gtpo_trl import trainer
    recorded = {}
    compute = trainer.per_token_advantages

    def recording(ids, mask, adv, h, G, objective, filter_mode, own):
        recorded.update(ids=ids.clone(), mask=mask.clone(), adv=adv.clone(), h=h.clone(), G=G,
                        filter_mode=filter_mode, objective=dataclasses.asdict(objective))
        return compute(ids, mask, adv, h, G, objective, filter_mode, own)
    trainer.per_token_advantages = recording

    class Saving(GTPOTrainer):
        def _generate_and_score_completions(self, inputs):
            got = super()._generate_and_score_completions(inputs)
            if "rows" not in recorded:
                recorded.update(rows=got["completion_ids"].clone(), rows_mask=got["completion_mask"].clone(),
                                rows_adv=got["advantages"].clone())
            return got

    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tok = load_tokenizer(model_dir)
    args = GTPOConfig(output_dir=out, num_generations=8, per_device_train_batch_size=4, max_completion_length=6,
                      max_steps=1, bf16=False, use_cpu=True, report_to="none", save_strategy="no", top_k=2, seed=0,
                      disable_tqdm=True)
    reward = lambda completions, **_: [float(ord(c[-1]) % 2) if c else 0.0 for c in completions]   # noqa: E731
    t = Saving(model=model, processing_class=tok, reward_funcs=[reward], args=args,
               train_dataset=Dataset.from_list([{"prompt": "one two three"}] * 8))
    t.train()
    torch.save({**recorded, "rank": t.accelerator.process_index, "world": t.accelerator.num_processes},
               f"{out}/rank{t.accelerator.process_index}.pt")
    t.accelerator.end_training()                        # tear the group down: gloo's threads can abort at exit


@pytest.mark.slow
def test_two_processes_see_whole_groups(tmp_path, tiny_model_dir):
    """2 CPU processes (torchrun, gloo), a group of 8 split 4 + 4 between them: both gather the same
    whole group, and each keeps its own rows with the advantages one process computes on the group."""
    import subprocess
    import sys
    from conftest import ENV, HERE, free_port
    port = free_port()
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                        str(port), __file__, tiny_model_dir, str(tmp_path)], cwd=HERE, capture_output=True,
                       text=True, env={**ENV, "OMP_NUM_THREADS": "1", "PYTHONPATH": HERE}, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{i}.pt", map_location="cpu") for i in range(2)]
    assert [x["world"] for x in ranks] == [2, 2] and [x["rank"] for x in ranks] == [0, 1]
    a, b = ranks
    assert a["G"] == 8 and len(a["rows"]) == len(b["rows"]) == 4         # the group straddles the processes
    for k in ("ids", "mask", "adv", "h"):
        assert torch.equal(a[k], b[k]), k                               # both gathered the same whole group
    one, _ = per_token_advantages(a["ids"], a["mask"], a["adv"], a["h"], 8, gtpo.Objective(**a["objective"]),
                                  a["filter_mode"])                     # one process, all 8 rows
    assert any(len(set(row[m.bool()].tolist())) > 1 for row, m in zip(one, a["mask"]))   # conflict weights
    for x in ranks:
        T = x["rows"].shape[1]
        mine = slice(4 * x["rank"], 4 * x["rank"] + 4)
        assert torch.equal(x["rows"][x["rows_mask"].bool()], a["ids"][mine, :T][x["rows_mask"].bool()])
        torch.testing.assert_close(x["rows_adv"], one[mine, :T], rtol=0, atol=0)


if __name__ == "__main__":
    import sys
    _two_process_worker(sys.argv[1], sys.argv[2])


def test_an_eval_dataset_logs_the_held_out_share_correct_under_trls_names(tmp_path, tiny_model_dir, tiny_lm):
    """rewards.trl_rewards splits the paper's reward into formatting and correctness, whose sum is trl_reward's;
    GTPOTrainer with an eval_dataset and eval_strategy="steps" then logs eval_rewards/accuracy_reward/mean (ten
    times the held-out share correct) at its evaluation, and eval_rewards/format_reward/mean beside it."""
    from gtpo_trl import example_dataset
    from rewards import trl_reward, trl_rewards
    texts = ["<reasoning>2 + 3 = 5</reasoning>\n<answer>5</answer>", "<answer>4</answer>", "5"]
    fmt, acc = (f(texts, ["5"] * 3) for f in trl_rewards("arithmetic"))
    assert [f + a for f, a in zip(fmt, acc)] == trl_reward("arithmetic")(texts, ["5"] * 3) and acc[0] == 10.0
    model, tok = tiny_lm(lora=True), load_tokenizer(tiny_model_dir)
    train, held = example_dataset(tok).select(range(8)), example_dataset(tok, split="test").select(range(4))
    args = _args(tmp_path, max_steps=1, eval_strategy="steps", eval_steps=1, per_device_eval_batch_size=4,
                 logging_steps=1, save_strategy="no")
    t = GTPOTrainer(model=model, processing_class=tok, reward_funcs=trl_rewards("arithmetic"), args=args,
                    train_dataset=train, eval_dataset=held)
    t.train()
    evals = [r for r in t.state.log_history if "eval_rewards/accuracy_reward/mean" in r]
    assert [r["step"] for r in evals] == [1]
    assert all(0.0 <= r["eval_rewards/accuracy_reward/mean"] <= 10.0 and "eval_rewards/format_reward/mean" in r
               for r in evals)


@pytest.mark.parametrize("iterations, filt, passes", [(1, "off", 0), (1, "auto", 1), (2, "auto", 0)])
def test_h_i_comes_from_a_forward_trl_makes_anyway(tmp_path, tiny_model_dir, iterations, filt, passes):
    """<H>_i without a pass of its own: at one iteration from the loss forward (the advantages shaped in the loss),
    with num_iterations=2 from TRL's old-log-probability forward; a pass of its own only for the first batch's
    <H>_ini under "auto" when TRL makes no such forward. Each <H>_i used equals the separate pass's on the same
    completions and weights (the policy that sampled them), to float rounding."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    used, own_pass = [], []

    class Watching(GTPOTrainer):
        def _mean_entropy(self, out, own=None):
            own_pass.append(1)
            return super()._mean_entropy(out, own)

        def _shape_in_loss(self, entropies):
            super()._shape_in_loss(entropies)
            inputs, own = self._in_loss[1], self._in_loss[2]
            used.append((gtpo.masked_mean(entropies.detach(), own, dim=1), super()._mean_entropy(inputs, own)))

        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            if self._scored_h is not None:
                used.append((self._scored_h, super()._mean_entropy(out)))
            return out

        _scored_h = None

        def _get_per_token_logps_and_entropies(self, *a, **kw):
            scoring = self._keep_scoring
            got = super()._get_per_token_logps_and_entropies(*a, **kw)
            if scoring:
                self._scored_h = gtpo.masked_mean(self._scored.float(), a[2][:, -a[3]:], dim=1)
            return got

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    args = GTPOConfig(output_dir=str(tmp_path), num_generations=4, per_device_train_batch_size=4, max_completion_length=6,
                      max_steps=2 * iterations, num_iterations=iterations, bf16=False, use_cpu=True, report_to="none",
                      save_strategy="no", seed=0, disable_tqdm=True, entropy_filter=filt, learning_rate=0.05, top_k=2)
    reward = lambda completions, **_: [float(len(c) % 2) for c in completions]   # noqa: E731
    Watching(model=model, processing_class=load_tokenizer(tiny_model_dir), reward_funcs=[reward], args=args,
             train_dataset=Dataset.from_list([{"prompt": "one two three"}] * 8)).train()
    assert len(own_pass) == passes and len(used) == 2 - passes
    for h, separate in used:
        torch.testing.assert_close(h, separate, atol=1e-4, rtol=1e-4)
