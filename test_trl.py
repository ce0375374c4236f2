"""Tests for gtpo_trl.py (skipped without TRL): GTPOTrainer's loss and gradients equal step.policy_loss /
gtpo.gtpo_loss on the same completions; flat groups; config refusals."""
import dataclasses

import pytest
import torch

pytest.importorskip("trl")

import gtpo                                                            # noqa: E402
import step                                                            # noqa: E402
from config import Config                                              # noqa: E402
from conftest import grads                                             # noqa: E402
from gtpo_trl import GTPOConfig, GTPOTrainer, token_advantages         # noqa: E402
from logprobs import sequence_logprobs                                 # noqa: E402
from models import load_tokenizer                                      # noqa: E402


def _args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), num_generations=4, per_device_train_batch_size=4, max_completion_length=8,
                bf16=False, use_cpu=True, report_to="none", entropy_filter="off")
    return GTPOConfig(**{**base, **kw})


def _planted(V, G=4, B=2, T=7, seed=0):
    """B groups of G completions with shared leading and trailing spans, ragged lengths, mixed
    rewards and one flat group carrying TRL-like residues."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, V, (B * G, T), generator=g)
    ids[:, :2] = 7                                                     # a shared leading span
    lengths = torch.tensor([7, 5, 6, 4, 7, 3, 6, 5])[:B * G]
    for i, n in enumerate(lengths.tolist()):
        ids[i, n - 2:n] = 9                                            # a shared trailing span
    mask = (torch.arange(T)[None] < lengths[:, None]).long()
    adv = torch.tensor([1.2, -0.4, -0.4, -0.4, 3e-12, 3e-12, 3e-12, 3e-12])[:B * G]   # group 2 is flat
    return ids, mask, adv


def _trainer(tmp_path, model, tok, **kw):
    from datasets import Dataset
    ds = Dataset.from_list([{"prompt": "one two three"}] * 8)
    t = GTPOTrainer(model=model, processing_class=tok, reward_funcs=[lambda completions, **k: [0.0] * len(completions)],
                    args=_args(tmp_path, **kw), train_dataset=ds)
    t.current_gradient_accumulation_steps = 1
    return t


@pytest.mark.parametrize("gate,norm", [("off", False), ("all", False), ("neg", True), ("all", True)])
def test_trainer_loss_and_gradients_equal_ours(tmp_path, tiny_model_dir, tiny_lm, gate, norm):
    model, tok = tiny_lm(lora=True), load_tokenizer(tiny_model_dir)
    ids, mask, adv = _planted(model.config.vocab_size)
    ids = ids.masked_fill(mask == 0, tok.pad_token_id)
    N = len(ids)
    p_ids = torch.randint(5, model.config.vocab_size, (N, 5), generator=torch.Generator().manual_seed(1))
    p_mask = torch.ones_like(p_ids)                                    # no padding: both compute positions alike
    with torch.no_grad():
        _, ent = sequence_logprobs(model, p_ids, p_mask, ids, mask)
    h = gtpo.masked_mean(ent, mask, dim=1)                             # (N,) <H>_i
    t = _trainer(tmp_path, model, tok, entropy_filter=gate, conflict_norm=norm, ent_threshold=float(h.median()))
    per_token, metrics = token_advantages(ids, mask, adv, h, 4, t.args, gate)
    model.train()
    model.zero_grad()
    loss = t._compute_loss(model, {"prompt_ids": p_ids, "prompt_mask": p_mask, "completion_ids": ids,
                                   "completion_mask": mask, "advantages": per_token})
    loss.backward()
    g_trl = grads(model)
    # ours: the loop's own policy_loss on the same completions, advantages zeroed in flat groups
    model.zero_grad()
    ours_adv = gtpo.group_advantages(torch.tensor([2., 0, 0, 0, 5, 5, 5, 5]), 4)   # ~ adv's signs, exact 0s
    ours_adv = torch.where(ours_adv == 0, 0.0, adv)
    weights, _, n_conf = gtpo.batch_conflict_weights(ids, mask, ours_adv, 4)
    cfg = Config(dataset="arithmetic", generation_size=4, entropy_filter=gate, conflict_norm=norm,
                 ent_threshold=float(h.median()))
    logp, _ = sequence_logprobs(model, p_ids, p_mask, ids, mask)
    ours, _, _ = step.policy_loss(cfg, logp, mask, ours_adv, h, weights, n_conf)
    ours.backward()
    assert loss.item() == pytest.approx(ours.item(), abs=1e-6) and ours.item() != 0
    g_ours = grads(model)
    assert g_trl.keys() == g_ours.keys() and len(g_ours) > 0
    for n in g_ours:
        torch.testing.assert_close(g_trl[n], g_ours[n], atol=1e-5, rtol=1e-4, msg=n)
    assert metrics["gtpo/conflict_frac"] > 0


def test_flat_group_residues_give_no_conflicts_and_zero_advantage(tmp_path):
    """TRL's ~1e-12 residues in a flat group become A = 0 exactly: no conflict masks, and only
    Eq. 7's -gamma <H>_i on every real token (as in our own loop)."""
    ids, mask, adv = _planted(50)
    args = _args(tmp_path)
    per_token, m = token_advantages(ids, mask, adv, torch.full((8,), 0.3), 4, args, "off")
    torch.testing.assert_close(per_token[4:], -0.1 * 0.3 * mask[4:].float())   # the flat group
    w, conflict, _ = gtpo.batch_conflict_weights(ids, mask, torch.cat([adv[:4], torch.zeros(4)]), 4)
    assert not conflict[4:].any() and conflict[:4].any()
    torch.testing.assert_close(per_token[:4], w[:4] * (adv[:4] - 0.1 * 0.3).unsqueeze(1))


def test_rows_shuffled_by_trl_keep_their_per_token_advantages(tmp_path):
    """Advantages are fixed per row before TRL shuffles and splits the batch: any permutation and
    micro-batching of the rows carries each row's own (T,) advantages."""
    ids, mask, adv = _planted(50)
    per_token, _ = token_advantages(ids, mask, adv, torch.full((8,), 0.3), 4, _args(tmp_path), "off")
    perm = torch.randperm(8, generator=torch.Generator().manual_seed(3))
    for part in perm.split(3):                                         # micro-batches of a shuffled batch
        again, _ = token_advantages(ids, mask, adv, torch.full((8,), 0.3), 4, _args(tmp_path), "off")
        assert torch.equal(again[part], per_token[part])


@pytest.mark.parametrize("kw,msg", [({"loss_type": "dapo"}, "loss_type"), ({"beta": 0.04}, "beta"),
                                    ({"top_entropy_quantile": 0.2}, "top_entropy_quantile"),
                                    ({"scale_rewards": "batch"}, "scale_rewards"),
                                    ({"entropy_filter": "sometimes"}, "entropy_filter")])
def test_config_refuses_what_would_change_the_method(tmp_path, kw, msg):
    with pytest.raises(ValueError, match=msg):
        _args(tmp_path, **kw)


def test_defaults_are_the_papers(tmp_path):
    a = _args(tmp_path, entropy_filter="auto")
    assert (a.loss_type, a.scale_rewards, a.num_iterations, a.beta, a.conflict_weight) == ("grpo", "group", 1, 0.0, 2.0)
    assert dataclasses.fields(a) and a.ent_gamma == 0.1
