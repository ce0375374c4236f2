"""analysis/conflicts.py: the logged conflict-token counts and the Fig. 9 rendering agree with
gtpo.conflict_weights; a run's counts add up to its logged n_conflict and survive --resume."""
import json
import os
import shutil

import pytest
import torch

import gtpo
import rewards
import step
import train
from analysis.conflicts import CATEGORIES, ConflictLog, format_token_ids, group_rows, pick_group, render_html, render_png
from machinery.data import tagged_solution
from machinery.models import embedded_model_dir, load_tokenizer
from rollout import Rollout

# App. 10 / Fig. 9: "What is 2 + 2?", two correct and two wrong completions in the tag format
FIG9 = [("2 + 2 = 4.", "4", 10.0), ("2 + 2 is 3.", "3", 0.0), ("Two plus two: 2 + 2 = 4.", "4", 10.0),
        ("2 + 2 = 3, I think.", "3", 0.0)]


@pytest.fixture(scope="module")
def fig9():
    """(tokenizer, Rollout of the group, scored dict) for the Fig. 9 group, EOS-terminated."""
    tok = load_tokenizer(embedded_model_dir())
    texts = [tagged_solution({"solution": s, "answer": a}) for s, a, _ in FIG9]
    seqs = [tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for t in texts]
    L = max(map(len, seqs))
    ids = torch.full((len(seqs), L), tok.pad_token_id)
    mask = torch.zeros(len(seqs), L, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)], mask[i, :len(s)] = torch.tensor(s), 1
    rewards = torch.tensor([r for *_, r in FIG9])
    adv = gtpo.group_advantages(rewards, len(FIG9))
    w, _, n = gtpo.conflict_weights(ids, mask, adv)
    ro = Rollout(ids[:, :1], torch.ones(len(seqs), 1, dtype=torch.long), ids, mask,
                 torch.zeros(len(seqs), dtype=torch.bool), texts)
    return tok, ro, {"rewards": rewards, "advantages": adv, "weights": w, "n": n}


def test_counts_and_lambdas_equal_conflict_weights(fig9, tmp_path):
    tok, ro, scored = fig9
    ids, mask, w = ro.completion_ids, ro.completion_mask.bool(), scored["weights"]
    log = ConflictLog(len(tok), format_token_ids(tok))
    log.add(ids, mask, scored["advantages"], len(FIG9))
    V = len(tok)
    amplified, protected = w == 2, (w == 0) & mask                          # lambda 2 / lambda 0
    assert amplified.any() and protected.any()
    c = dict(zip(CATEGORIES, log.counts))
    assert torch.equal(c["any"], torch.bincount(ids[amplified | protected], minlength=V))
    assert int(c["any"].sum()) == int(scored["n"].sum())                    # = sum of n_conflict
    assert torch.equal(((c["fwd_pos"] + c["bwd_pos"]) > 0), torch.bincount(ids[amplified], minlength=V) > 0)
    assert torch.equal(((c["fwd_neg"] + c["bwd_neg"]) > 0), torch.bincount(ids[protected], minlength=V) > 0)
    s = log.summary(tok)
    fmt = set(format_token_ids(tok).tolist())
    in_fmt = sum(int(t) in fmt for t in ids[amplified | protected])
    assert s["conflict_positions"] == int(scored["n"].sum()) and s["format_positions"] == in_fmt
    assert s["top"]["any"][0][2] == int(c["any"].max())
    # the rows kept in samples.jsonl redraw the same lambdas, token by token
    rows = group_rows(tok, ro, scored, range(len(FIG9)), 7, "What is 2 + 2?", "4")
    for i, r in enumerate(rows):
        n = int(mask[i].sum())
        assert r["lambda"] == w[i, :n].tolist() and len(r["tokens"]) == n
        assert "".join(r["tokens"]).startswith(ro.texts[i])                 # + the EOS token
        assert r["advantage"] == scored["advantages"][i].item()
    render_html(rows, tmp_path / "g.html")
    page = (tmp_path / "g.html").read_text()
    assert page.count('title="λ = 2"') == int(amplified.sum()) and page.count('title="λ = 0"') == int(protected.sum())
    render_png(rows, tmp_path / "g.png")
    assert os.path.getsize(tmp_path / "g.png") > 5000
    assert pick_group(rows + [{"step": 9, "completion": "old row, no tokens"}]) == rows


@pytest.mark.slow                                  # real runs in this process or a child: the slow tier
def test_run_counts_add_up_and_survive_resume(tmp_path, tiny_args, monkeypatch):
    """A tiny GTPO run at low temperature (near-identical completions, so conflicts happen) with a
    reward that splits each group: conflicts.json's total equals the sum of n_conflict in
    metrics.jsonl, and a run resumed from checkpoint-1 ends with the same counts."""
    def split_reward(texts, answers, task, counts=None):
        r = (torch.arange(len(texts)) % 2).float() * 10
        return r, r, torch.zeros_like(r)
    monkeypatch.setattr(rewards, "reward", split_reward)
    argv = lambda out, *x: tiny_args(out, max_steps=3, save_steps=1, temperature=1e-4, max_completion_length=6,
                                     optimizer="adamw_torch") + list(x)
    a = tmp_path / "a"
    assert train.main(argv(a)) == 0
    rows = [json.loads(x) for x in (a / "metrics.jsonl").read_text().splitlines()]
    logged = sum(round(r["gtpo/mean_conflict_tokens"] * 4) for r in rows)   # N = 1 prompt x G = 4
    summary = json.loads((a / "conflicts.json").read_text())
    assert summary["rl_steps"] == 3 and summary["conflict_positions"] == logged > 0
    samples = [json.loads(x) for x in (a / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 8 and all(len(s["tokens"]) == len(s["lambda"]) for s in samples)   # steps 1 and 3
    b = tmp_path / "b"
    shutil.copytree(a, b)
    for d in ("checkpoint-2", "checkpoint-3", "final"):
        shutil.rmtree(b / d)
    assert train.main(argv(b, "--resume")) == 0
    assert json.loads((b / "conflicts.json").read_text()) == summary
    g = tmp_path / "grpo"                      # GRPO's conflict spans are counted too (GTPO protects them)
    assert train.main(argv(g, "--use_grpo")) == 0
    grpo = json.loads((g / "conflicts.json").read_text())
    assert grpo["rl_steps"] == 3 and grpo["conflict_positions"] > 0 and 0 <= grpo["format_share_of_tokens"] <= 1


def test_every_lambda_gets_its_shade_whatever_the_objective():
    """The drawing colours a token by how its lambda compares with 1 and 2, so a conflict weight other than
    Eq. 5's 0 and 2 (or the product's 4) is drawn too."""
    from analysis.conflicts import SHADES, color
    protected, amplified, more = (c for _, c in SHADES)
    assert color(1.0) is None and color(None) is None
    assert color(0.0) == color(0.5) == protected and color(1.5) == color(2.0) == amplified
    assert color(3.0) == color(4.0) == more


def test_a_render_says_when_the_positives_are_right_for_their_format_alone(fig9, tmp_path):
    """The drawing of a group marks each completion correct or not and says how many of the completions with
    A > 0 are correct; when none is, it says their advantage comes from the format alone."""
    import html
    from analysis.conflicts import positives_note
    tok, ro, scored = fig9
    pos = scored["advantages"] > 0
    for correct, words in ((torch.zeros(len(pos)), "none of the"), (pos.float(), f"{int(pos.sum())} of the")):
        rows = group_rows(tok, ro, {**scored, "correctness": correct * 10}, range(len(FIG9)), 7, "q", "4")
        assert positives_note(rows).startswith(words)
        render_html(rows, tmp_path / "g.html")
        page = (tmp_path / "g.html").read_text()
        assert html.escape(positives_note(rows)) in page and page.count("✓") == int((correct > 0).sum()) + 1  # + legend
    assert positives_note([{k: v for k, v in r.items() if k != "correct"} for r in rows]) is None   # older rows
