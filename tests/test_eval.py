"""Tests for eval.py: pass@k and maj@k against hand values and brute-force enumeration,
equivalent answers voting together, --rescore reproducing results.json, plots, and a tiny
end-to-end evaluation of the embedded model on 2 GSM8K test problems."""
import itertools
import json
import math
import os
import random
from collections import Counter

import pytest
import torch

import eval as ev
from machinery.data import DataError

DATA_DIR = os.environ.get("GTPO_DATA_DIR")


# -----------------------------------------------------------------------------
# pass@k

@pytest.mark.parametrize("n,c,k,want", [
    (4, 1, 1, 0.25),
    (4, 1, 2, 1 - 3 / 6),            # 1 - C(3,2)/C(4,2)
    (5, 2, 3, 1 - 1 / 10),           # 1 - C(3,3)/C(5,3)
    (10, 3, 2, 1 - 21 / 45),         # 1 - C(7,2)/C(10,2)
    (8, 0, 8, 0.0),
    (8, 1, 8, 1.0),
    (3, 3, 1, 1.0),
])
def test_pass_at_k_hand_values(n, c, k, want):
    assert ev.pass_at_k(n, c, k) == pytest.approx(want, abs=1e-12)


def test_pass_at_k_equals_enumeration_of_all_subsets():
    for n in range(1, 8):
        for c in range(n + 1):
            correct = [1] * c + [0] * (n - c)
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(range(n), k))
                brute = sum(any(correct[i] for i in s) for s in subsets) / len(subsets)
                assert ev.pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12), (n, c, k)


def test_pass_at_k_large_n_is_stable():
    # C(200, 100) overflows a float; the product form does not
    want = 1 - math.comb(150, 100) / math.comb(200, 100)
    assert ev.pass_at_k(200, 50, 100) == pytest.approx(want, rel=1e-9)


def test_k_larger_than_n_is_a_clear_error():
    with pytest.raises(ValueError, match="1 <= k <= n"):
        ev.pass_at_k(4, 1, 5)
    with pytest.raises(DataError, match="lower --k or raise --n_samples"):
        ev.check_ks([1, 2, 8], 4)


# -----------------------------------------------------------------------------
# maj@k

def maj_brute(cls, cls_correct, k):
    """Literal definition: every k-subset votes; the most frequent class wins, ties to the class
    whose first member comes first; no votes = wrong."""
    n, wins = len(cls), 0
    subsets = list(itertools.combinations(range(n), k))
    for s in subsets:
        votes = Counter(cls[i] for i in s if cls[i] >= 0)
        if not votes:
            continue
        best = max(votes.values())
        winner = next(cls[i] for i in s if cls[i] >= 0 and votes[cls[i]] == best)
        wins += cls_correct[winner]
    return wins / len(subsets)


def test_maj_at_k_exact_path_equals_brute_force():
    rng = random.Random(0)
    for _ in range(150):
        n = rng.randint(1, 8)
        C = rng.randint(1, 4)
        cls = [rng.randint(-1, C - 1) for _ in range(n)]
        used = sorted({c for c in cls if c >= 0})
        remap = {c: i for i, c in enumerate(used)}                 # classes in order of first appearance
        order = []
        for c in cls:
            if c >= 0 and remap[c] not in order:
                order.append(remap[c])
        cls = [order.index(remap[c]) if c >= 0 else -1 for c in cls]
        ok = [rng.random() < 0.5 for _ in used]
        for k in range(1, n + 1):
            assert ev.maj_at_k(cls, ok, k) == pytest.approx(maj_brute(cls, ok, k), abs=1e-9), (cls, ok, k)


def test_maj_at_k_sampled_path_close_to_exact(monkeypatch):
    cls = [0, 1, 0, 2, 1, 1, -1, 0, 2, 1]
    ok = [True, False, False]
    exact = [maj_brute(cls, ok, k) for k in (3, 5)]
    monkeypatch.setattr(ev, "EXACT_MAJ_SUBSETS", 1)               # force random subsets
    sampled = [ev.maj_at_k(cls, ok, k, n_subsets=20000, seed=1) for k in (3, 5)]
    assert sampled == pytest.approx(exact, abs=0.015)
    assert ev.maj_at_k(cls, ok, 3, 500, seed=7) == ev.maj_at_k(cls, ok, 3, 500, seed=7)  # deterministic


def test_equivalent_latex_answers_are_one_vote():
    answers = ["0.5", "\\frac12", "3", "3", None, "1/2", "3", "\\dfrac{1}{2}"]
    cls, ok = ev.vote_classes(answers, "\\frac{1}{2}", "math")
    assert cls == [0, 0, 1, 1, -1, 0, 1, 0]
    assert ok == [True, False]
    # all 8: four votes for 1/2 against three for 3 -> correct; textual voting would pick "3"
    assert ev.maj_at_k(cls, ok, 8) == 1.0
    assert Counter(answers).most_common(1)[0][0] == "3"
    # without the last sample it is a 3-3 tie, broken toward the first answer seen (0.5)
    assert ev.maj_at_k(cls[:7], ok, 7) == 1.0


def test_equivalent_numeric_answers_are_one_vote():
    cls, ok = ev.vote_classes(["1,000", "$1000.00", "999", "1000 dollars", "999"], "1000", "gsm8k")
    assert cls == [0, 0, 1, 0, 1] and ok == [True, False]
    assert ev.maj_at_k(cls, ok, 5) == 1.0
    assert ev.maj_at_k(cls, ok, 1) == pytest.approx(3 / 5)


# -----------------------------------------------------------------------------
# results, --rescore, plots

def _row(p, i, completion, ref, task="gsm8k"):
    return {"problem": p, "sample": i, "task": task, "question": f"q{p}", "reference": ref,
            "completion": completion, "answer": None, "format": 0.0, "correct": 0.0, "length": 10 + i,
            "truncated": i == 0}


def _tagged(ans):
    return f"<reasoning>r</reasoning><answer>{ans}</answer>"


def test_rescore_computes_results_from_completion_text(tmp_path):
    rows = [_row(0, 0, _tagged("7"), "7"), _row(0, 1, _tagged("8"), "7"),
            _row(0, 2, "<answer>7.0</answer>", "7"), _row(0, 3, "no tags", "7"),
            _row(1, 0, _tagged("1"), "2"), _row(1, 1, _tagged("3"), "2"),
            _row(1, 2, _tagged("3"), "2"), _row(1, 3, _tagged("2"), "2")]
    d = tmp_path / "ev"
    d.mkdir()
    with open(d / "samples.jsonl", "w") as f:               # stored rewards are wrong on purpose
        f.writelines(json.dumps(r) + "\n" for r in rows)
    assert ev.main(["--rescore", str(d / "samples.jsonl"), "--k", "1", "2", "4"]) == 0
    res = json.load(open(d / "results.json"))
    # problem 0: 2 of 4 correct, problem 1: 1 of 4
    assert res["per_problem_correct"] == [2, 1]
    assert res["pass@k"]["1"] == pytest.approx((2 / 4 + 1 / 4) / 2)
    assert res["pass@k"]["2"] == pytest.approx((1 - 1 / 6 + 1 - 3 / 6) / 2)
    assert res["pass@k"]["4"] == 1.0
    # maj@4: problem 0 votes 7 (x2) vs 8 -> right; problem 1 votes 3 (x2) -> wrong
    assert res["maj@k"]["4"] == 0.5
    assert res["format_rate"] == 6 / 8 and res["mean_format_reward"] == (60 + 1 + 0) / 8
    assert res["mean_length"] == 11.5 and res["truncated_frac"] == 0.25
    saved = [json.loads(line) for line in open(d / "samples.jsonl")]
    assert saved == rows                                       # the samples file is never rewritten


def test_rescore_with_task_compares_answers_that_way_and_names_it(tmp_path):
    rows = [_row(0, i, _tagged(a), ref, task="gsm8k") for i, (a, ref) in
            enumerate([("\\sqrt{2}", "\\sqrt{2}"), ("x^2", "x^{2}"), ("3", "3"), ("4", "3")])]
    d = tmp_path / "ev"
    d.mkdir()
    with open(d / "samples.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    out = {}
    for task in ("auto", "latex"):
        assert ev.main(["--rescore", str(d / "samples.jsonl"), "--task", task, "--output_dir", str(tmp_path / task)]) == 0
        out[task] = json.load(open(tmp_path / task / "results.json"))
    assert out["auto"]["per_problem_correct"] == [1] and out["auto"]["task"] == "gsm8k"      # numbers only
    assert out["latex"]["per_problem_correct"] == [3] and out["latex"]["task"] == "latex"    # math-verify
    assert out["latex"]["dataset"].startswith("unknown")                # no results.json beside the samples


def test_plots_write_png(tmp_path):
    res = {"pass@k": {"1": 0.2, "2": 0.3, "4": 0.4}, "maj@k": {"1": 0.2, "2": 0.2, "4": 0.3}}
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        json.dump(res, open(tmp_path / name / "results.json", "w"))
        with open(tmp_path / name / "metrics.jsonl", "w") as f:
            f.write(json.dumps({"step": 1, "phase": "sft", "loss": 2.0}) + "\n")
            for s in range(2, 12):
                f.write(json.dumps({"step": s, "phase": "rl", "reward": s, "rewards/format": s / 2,
                                    "entropy": 1 / s, "gtpo/conflict_frac": 0.1, "loss": 0.0}) + "\n")
    files = [str(tmp_path / n / "results.json") for n in "ab"]
    curves = [str(tmp_path / n / "metrics.jsonl") for n in "ab"]
    out = tmp_path / "plots"
    assert ev.main(["--plot", *files, "--curves", *curves, "--output_dir", str(out)]) == 0
    for png in ("passk.png", "curves.png"):
        data = open(out / png, "rb").read()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    (tmp_path / "bad.jsonl").write_text('{"step": 1}\n{oops\n')
    with pytest.raises(DataError, match="bad.jsonl:2"):
        ev.main(["--curves", str(tmp_path / "bad.jsonl"), "--output_dir", str(out)])


def test_k_above_n_fails_before_loading_anything(tmp_path):
    with pytest.raises(DataError, match="k = \\[16\\] with n = 8"):
        ev.main(["--k", "1", "16", "--output_dir", str(tmp_path / "x"), "--model", "no/such-model"])


@pytest.mark.slow                                  # real runs in this process or a child: the slow tier
@pytest.mark.needs_data
def test_end_to_end_two_gsm8k_problems_and_rescore(tmp_path):
    out = tmp_path / "ev"
    argv = ["--dataset", "gsm8k", "--limit", "2", "--n_samples", "3", "--max_completion_length", "24",
            "--batch_size", "4", "--output_dir", str(out), "--data_dir", DATA_DIR]
    assert ev.main(argv) == 0
    rows = [json.loads(line) for line in open(out / "samples.jsonl")]
    assert len(rows) == 6 and sorted({r["problem"] for r in rows}) == [0, 1]
    assert [r["reference"] for r in rows[::3]] == ["18", "3"]      # GSM8K test items 1 and 2
    assert all(1 <= r["length"] <= 24 for r in rows)
    res = json.load(open(out / "results.json"))
    assert res["n_problems"] == 2 and res["n_samples"] == 3 and res["ks"] == [1, 2, 3]
    assert res["model"] == "smollm2-135m" and res["dataset"] == "gsm8k"
    assert os.path.getsize(out / "passk.png") > 5000
    with pytest.raises(DataError, match="already holds an evaluation"):
        ev.main(argv)                                              # nothing overwritten
    assert [json.loads(line) for line in open(out / "samples.jsonl")] == rows
    # --rescore into another folder reproduces results.json exactly (except date and provenance)
    again = tmp_path / "again"
    os.makedirs(again)
    import shutil
    shutil.copy(out / "results.json", again / "results.json")
    shutil.copy(out / "samples.jsonl", again / "samples.jsonl")
    assert ev.main(["--rescore", str(again / "samples.jsonl")]) == 0
    res2 = json.load(open(again / "results.json"))
    assert res2.pop("rescored_from") and res2.pop("date") and res.pop("date")
    assert res2 == res


def test_resume_keeps_whole_problems_and_refuses_other_flags(tmp_path):
    recs = [{"question": f"q{p}", "answer": "1"} for p in range(4)]
    rows = [_row(p, i, _tagged("1"), "1") for p in range(3) for i in range(2)][:-1]   # problem 2 half done
    path = tmp_path / "samples.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    keep = ev.resumable_rows(str(path), recs, 2)
    assert [(r["problem"], r["sample"]) for r in keep] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    with pytest.raises(DataError, match="--n_samples 3"):
        ev.resumable_rows(str(path), recs, 3)
    with pytest.raises(DataError, match="different question"):
        ev.resumable_rows(str(path), [{"question": "other", "answer": "1"}] + recs[1:], 2)


def test_resume_keeps_every_finished_sample(tmp_path, tiny_model_dir, monkeypatch, capsys):
    """Rows marked after an evaluation survive its --resume: a finished evaluation samples nothing (no model is
    loaded) and gives the same results; one that lost its last call's problem keeps every earlier problem (marked)
    and samples that one again; one stopped inside a call keeps the calls before it, the call's finished problem
    drawn again with the call's others (so every later call batches what an uninterrupted run would)."""
    from machinery import models
    out = tmp_path / "ev"
    argv = ["--model", tiny_model_dir, "--limit", "3", "--n_samples", "2", "--batch_size", "4", "--one_shot_from",
            "none", "--max_completion_length", "4", "--output_dir", str(out)]       # 2 problems a call: [0, 1], [2]
    assert ev.main(argv) == 0
    first = json.loads((out / "results.json").read_text())
    samples = out / "samples.jsonl"

    def mark(keep):
        rows = [{**json.loads(line), "marked": True} for line in samples.read_text().splitlines()]
        samples.write_text("".join(json.dumps(r) + "\n" for r in rows if r["problem"] in keep))

    def resumed():
        assert ev.main(argv + ["--resume"]) == 0
        return {(r["problem"], r["sample"]): r.get("marked", False) for r in map(json.loads, samples.read_text().split("\n")[:-1])}
    mark({0, 1, 2})
    real = models.load_eval_model
    monkeypatch.setattr(ev, "load_eval_model", lambda *a, **k: pytest.fail("a finished evaluation loaded a model"))
    assert set(resumed().values()) == {True} and "nothing to sample" in capsys.readouterr().out
    again = json.loads((out / "results.json").read_text())
    assert {k: v for k, v in again.items() if k != "date"} == {k: v for k, v in first.items() if k != "date"}
    monkeypatch.setattr(ev, "load_eval_model", real)
    mark({0, 1})                                                        # killed in the last call
    assert resumed() == {(0, 0): True, (0, 1): True, (1, 0): True, (1, 1): True, (2, 0): False, (2, 1): False}
    mark({0})                                                           # killed inside the first call
    assert set(resumed().values()) == {False}


def test_ctrl_c_stops_an_evaluation_with_one_line(tmp_path, tiny_model_dir, monkeypatch, capsys):
    def interrupted(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(ev, "sample_problems", interrupted)
    out = tmp_path / "ev"
    assert ev.main(["--model", tiny_model_dir, "--limit", "1", "--n_samples", "2", "--one_shot_from", "none",
                    "--output_dir", str(out)]) == ev.STOPPED
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"stopped (Ctrl-C): every whole problem sampled is in {out}/samples.jsonl; continue with the " \
                      f"same command plus --resume"


def test_loading_an_adapter_prints_no_warning(tiny_lm, tiny_model_dir, tmp_path):
    """eval.py --adapter loads a LoRA folder without transformers' deprecation warnings from PEFT,
    and the loaded adapter is the saved one."""
    import warnings
    saved = tiny_lm(lora=True)
    saved.save_pretrained(tmp_path / "adapter")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        model, _ = ev.load_eval_model(tiny_model_dir, str(tmp_path / "adapter"), "cpu", load_in_4bit=False,
                                      log=lambda *a: None)
    assert [str(w.message) for w in seen] == []
    want = {n: p for n, p in saved.named_parameters() if "lora_" in n}
    got = {n: p for n, p in model.named_parameters() if "lora_" in n}
    assert want.keys() == got.keys() and all(torch.equal(want[n], got[n]) for n in want)


def test_passk_plot_labels_different_problem_sets_and_repeats():
    """--plot over evaluations of one set: its name, problem count and n in the title, one label per model; over
    different sets or problem counts: each label names its set and the title says to compare within a set; a label
    that would repeat is numbered."""
    from analysis import plots
    r = {"dataset": "gsm8k", "n_problems": 50, "n_samples": 8, "pass@k": {"1": 0.2, "8": 0.5}, "maj@k": {"1": 0.2, "8": 0.3}}
    same = [("untrained m", r), ("run, final", dict(r))]
    assert plots.passk_labels(same) == ("gsm8k, 50 problems, n = 8 samples a problem", ["untrained m", "run, final"])
    mixed = [("run, final", r), ("run, final", {**r, "n_problems": 20}), ("run, final", {**r, "dataset": "math"})]
    title, labels = plots.passk_labels(mixed)
    assert title.startswith("different problem sets") and labels == [
        "run, final (gsm8k, 50 problems)", "run, final (gsm8k, 20 problems)", "run, final (math, 50 problems)"]
    assert plots.passk_labels([("a", r), ("a", r)])[1] == ["a", "a #2"]


def test_plot_legend_says_trained_or_untrained():
    assert ev.model_label({"model": "smollm2-135m", "adapter": None}) == "untrained smollm2-135m"
    assert ev.model_label({"model": "smollm2-135m", "adapter": "runs/gtpo-smollm2-135m-arithmetic/final"}) == \
        "gtpo-smollm2-135m-arithmetic, final"
    assert ev.model_label({"model": "smollm2-135m", "adapter": "runs/gtpo-smollm2-135m-arithmetic/checkpoint-8"}) == \
        "gtpo-smollm2-135m-arithmetic, checkpoint-8 (step 8)"


@pytest.mark.slow                                  # real runs in this process or a child: the slow tier
def test_drift_is_zero_at_the_start_and_grows_with_the_adapter(tiny_lm, tiny_model_dir, tmp_path):
    """eval.py --drift: KL(pi_c || start) per scheduled checkpoint (not one a stop signal saved);
    exactly 0 at step 0 and for a checkpoint equal to the start, positive for one that moved;
    written to results.json by the command."""
    from machinery import runs
    start = tiny_lm(lora=True)
    start.save_pretrained(tmp_path / "start")
    start.save_pretrained(tmp_path / "run" / "checkpoint-2")
    start.save_pretrained(tmp_path / "run" / "checkpoint-3")                  # off the save_steps schedule
    with torch.no_grad():
        for n, p in start.named_parameters():
            if "lora_B" in n:
                p.add_(0.5 * torch.randn_like(p))
    start.save_pretrained(tmp_path / "run" / "checkpoint-4")
    runs.write_json(str(tmp_path / "run" / "config.json"), {"model": tiny_model_dir, "init_from": str(tmp_path / "start"),
                                                            "max_completion_length": 6, "save_steps": 2,
                                                            "max_steps": 4})
    assert ev.main(["--drift", str(tmp_path / "run"), "--limit", "2", "--n_samples", "2", "--one_shot_from",
                    "none"]) == 0
    res = runs.read_json(str(tmp_path / "run" / "eval-kl" / "results.json"))
    assert [p["step"] for p in res["points"]] == [0, 2, 4] and all(p["tokens"] > 0 for p in res["points"])
    assert res["points"][0]["kl"] == 0.0 and res["points"][1]["kl"] == 0.0 and res["points"][2]["kl"] > 0
    assert ev.main(["--drift", str(tmp_path / "run"), "--drift_steps", "4", "--limit", "2", "--n_samples", "2",
                    "--one_shot_from", "none", "--output_dir", str(tmp_path / "kl4")]) == 0
    assert runs.read_json(str(tmp_path / "kl4" / "results.json"))["points"] == res["points"][2:]    # the same point
    with pytest.raises(DataError, match="no scheduled checkpoint there"):
        ev.main(["--drift", str(tmp_path / "run"), "--drift_steps", "3", "--one_shot_from", "none"])
    with pytest.raises(DataError, match="no config.json"):
        ev.main(["--drift", str(tmp_path / "start")])


def test_training_curves_mark_whole_steps(tmp_path, monkeypatch):
    """A short run's curves (3 RL steps) are ticked at whole steps, not at 1.5 or 2.5."""
    import matplotlib.pyplot as plt
    from analysis import plots
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "phase": "rl", "reward": s, "loss": 0.1 * s}) + "\n" for s in (1, 2, 3)))
    plots.plot_curves([str(path)], str(tmp_path / "curves.png"), smooth=1)
    ticks = [t for ax in figures[0].axes if ax.get_title() for t in ax.get_xticks()]
    assert ticks and all(float(t).is_integer() for t in ticks), ticks
