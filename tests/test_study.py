"""study/plan.py, study/run.py and study/report.py: the parts give every run the same budget, the statistics and
verdict rule of docs/study.md, and a report recomputed from the committed small files alone."""
import json
import os

import pytest

from study import figures, plan
from study import report as study_report
from study import verdicts
from study import run as study


def _flag(flags, name):
    """The value train.py reads for `name`: its last occurrence (argparse's last wins)."""
    return flags[len(flags) - flags[::-1].index(name)]


def _recorded_keys():
    """The settings a committed config.json must give back: the run's identity (the start aside) and the
    micro-batches and ⟨H⟩_ini prompts the study pins."""
    from machinery.config import identity_keys
    return [k for k in identity_keys() if k != "init_from"] + ["micro_batch_size", "sft_micro_batch_size",
                                                               "ent_ini_prompts"]


def test_plan_re_runs_every_committed_run_with_the_settings_it_ran_with():
    """The demo profile may change; the study's commands, parsed now, still give each committed run's recorded
    objective, recipe and micro-batches (config.json), so --resume and a re-run make the same experiment."""
    from machinery.config import parse_args, record
    keys = _recorded_keys()
    checked = 0
    for run_id, flags, seed, _, _ in plan.jobs():
        path = os.path.join(plan.KEEP, run_id, "config.json")
        if not os.path.exists(path):
            continue
        with open(path) as f:
            have = json.load(f)
        cfg = parse_args([*flags, "--seed", str(seed)])
        assert {k: record(cfg)[k] for k in keys if k in have} == {k: have[k] for k in keys if k in have}, run_id
        checked += 1
    assert checked > 100


def test_run_table_same_budget_and_warm_ups_first():
    jobs = study.jobs()
    ids = [run_id for run_id, *_ in jobs]
    assert len({(job[0], job[4]) for job in jobs}) == len(jobs)        # a run id repeats only to evaluate more
    warm = {run_id for run_id, _, _, start, _ in jobs if start is None}
    for i, (run_id, flags, seed, start, evals) in enumerate(jobs):
        assert run_id.endswith(f"-s{seed}")
        if start is None:
            continue
        assert start in warm and ids.index(start) < i and start.endswith(f"-s{seed}")
        assert flags[:len(plan.COMMON)] == plan.COMMON              # same prompts per step, G, tokens
        extra = flags[len(plan.COMMON):]
        budget = {"--batch_size", "--generation_size", "--max_completion_length", "--sft_warmup_steps"}
        assert not budget & set(extra)
    main = {a.name: (a.flags[len(plan.COMMON):], a.seeds) for a in plan.part("main").arm_list() if a.start}
    assert all(ss == (1, 2, 3) for _, ss in main.values())
    # the objective is crossed with the optimizer: both methods under both Adam settings
    for method in ("--use_gtpo", "--use_grpo"):
        for betas in (plan.A6, plan.A9):
            assert any(f[0] == method and f[1:] == betas for f, _ in main.values())
    long = [a.flags[len(plan.COMMON):] for a in plan.part("long").arm_list() if a.start]
    assert len(long) == 2 and long[0][1:] == long[1][1:]                # same settings but the method


def test_sign_flip_p_exact_values():
    assert verdicts.sign_flip_p([1.0, 2.0, 3.0]) == pytest.approx(2 / 8)    # all same sign: the minimum 2/2^m
    assert verdicts.sign_flip_p([1.0] * 6) == pytest.approx(2 / 64)
    assert verdicts.sign_flip_p([1.0, -1.0]) == 1.0
    # [3, 1, -1]: |sum| = 3; patterns with |sum| >= 3: +-(3, 1, -1), +-(3, 1, 1), +-(3, -1, -1) -> 6 of 8
    assert verdicts.sign_flip_p([3.0, 1.0, -1.0]) == pytest.approx(6 / 8)


def test_bootstrap_ci_brackets_the_mean_and_excludes_zero_when_every_problem_agrees():
    same = [[0.25] * 40, [0.125] * 40]
    lo, hi = verdicts.bootstrap_ci(same, reps=2000)
    assert lo == pytest.approx(0.1875) and hi == pytest.approx(0.1875)
    mixed = [[0.5, -0.5] * 20]
    lo, hi = verdicts.bootstrap_ci(mixed, reps=2000)
    assert lo < 0 < hi


@pytest.mark.parametrize("sign,mean,p,ci,want", [
    (1, 0.1, 0.03, (0.01, 0.2), "holds"), (1, -0.1, 0.03, None, "contradicted"),
    (1, 0.1, 0.25, (0.01, 0.2), "holds for these runs"), (1, -0.1, 0.25, (-0.2, -0.01), "contradicted for these runs"),
    (1, 0.1, 0.25, (-0.01, 0.2), "same direction, within noise"), (-1, 0.1, 0.5, None, "opposite direction, within noise"),
    (0, 0.1, 0.25, (0.01, 0.2), "A above B (for these runs)"), (0, -0.1, 0.5, None, "A below B, within noise")])
def test_verdict_rule(sign, mean, p, ci, want):
    assert verdicts.verdict(sign, mean, p, ci) == want
    assert verdicts.verdict(sign, mean, p, ci, regime="why").startswith("not testable here")


def test_collapse_rule():
    rows = [{"step": k, "rewards/format": 9.5, "entropy": 0.4} for k in range(1, 31)]
    assert plan.collapse_step(rows) is None
    for r in rows[18:]:
        r["rewards/format"], r["entropy"] = 5.0, 1.5                   # formatting breaks, entropy up
    step = plan.collapse_step(rows)
    assert step is not None and 20 <= step <= 30
    for r in rows[18:]:
        r["entropy"] = 0.5                                             # below ln 2: not the paper's collapse
    assert plan.collapse_step(rows) is None


def test_best_checkpoint_is_the_highest_reward_window():
    rows = [{"step": k, "phase": "rl", "reward": 1.0 if 26 <= k <= 50 else 0.5} for k in range(1, 101)]
    assert study.best_checkpoint(rows, [25, 50, 75, 100]) == (50, 1.0)


def committed_in(folder, monkeypatch):
    """The study's committed files (study/runs/, and summary.md and the figures in study/) read from and written
    to `folder`."""
    for module in (plan, study, study_report):
        monkeypatch.setattr(module, "KEEP", str(folder))
        monkeypatch.setattr(module, "STUDY", str(folder))


def _write_run(keep, run_id, acc, counts):
    d = keep / run_id
    d.mkdir(parents=True)
    rows = [{"step": i + 1, "phase": "rl", "rewards/format": 9.0, "rewards/accuracy": a, "entropy": 0.5,
             "reward": 9.0 + a} for i, a in enumerate(acc)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for s in ("id", "ood"):
        res = {"n_samples": 8, "pass@k": {"1": sum(counts) / 8 / len(counts), "8": 0.5}, "maj@k": {"1": 0.1, "8": 0.2},
               "per_problem_correct": counts}
        (d / f"eval-{s}.json").write_text(json.dumps(res))
    (d / "times.json").write_text(json.dumps({"train": [{"seconds": 600.0, "finished": True, "workers": 2}]}))


def test_report_recomputes_questions_from_committed_files(tmp_path, monkeypatch):
    committed_in(tmp_path, monkeypatch)
    _write_run(tmp_path, "warmup-s1", [], [1, 0, 0, 0, 0])
    study_report.report()                                                     # only a warm-up has finished
    assert "| SFT warm-up (the start) | 1/3 |" in (tmp_path / "summary.md").read_text()
    for s in (1, 2, 3):                       # GTPO: one more correct sample per problem than GRPO, every run
        for name, extra in (("gtpo-a6", 1), ("gtpo-a9", 1), ("grpo-a6", 0), ("grpo-a9", 0), ("grpo-kl6", 0),
                            ("sft", 0)):
            _write_run(tmp_path, f"{name}-s{s}", [1.0 + extra] * 20, [2 + extra, 4 + extra, extra, extra, 0])
    for name in ("gtpo-a6", "gtpo-a9", "grpo-a6", "grpo-a9"):
        for s in (1, 2, 3):
            (tmp_path / f"{name}-s{s}" / "conflicts.json").write_text(json.dumps(
                {"format_share": 0.6, "format_share_of_tokens": 0.4, "conflict_share": 0.1}))
    rows, every = {}, study_report.question_rows()
    for r in every:
        rows.setdefault((r["q"], r["metric"]), r)                      # the first row of each (question, metric)
    kl6 = next(r for r in every if "1e-6" in r["claim"])
    assert kl6["units"] == 3 and kl6["verdict"] == "holds for these runs"
    q1 = rows[("Q1", "ID pass@1")]
    assert q1["units"] == 6 and q1["values"] == [pytest.approx(4 / 8 / 5)] * 6
    assert q1["p"] == pytest.approx(2 / 64) and q1["verdict"] == "holds"
    ood = next(r for (q, m), r in rows.items() if q == "Q1" and m.startswith("OOD"))
    assert "4 solvable" in ood["metric"] and ood["values"][0] == pytest.approx(1 / 8)   # problem 4: no model
    assert rows[("Q1", "training accuracy %")]["mean"] == pytest.approx(10.0)
    q2 = next(r for (q, m), r in rows.items() if q == "Q2")
    assert q2["units"] == 3 and q2["mean"] == 0 and q2["verdict"] == "no difference"
    q3 = rows[("Q3", "ID pass@1")]
    assert q3["units"] == 3 and q3["verdict"] == "holds for these runs"   # p = 0.25 at 3 units; CI > 0
    assert rows[("Q4", "ID pass@1, final")]["units"] == 0
    (tmp_path / "pilot-r1-gtpo-s11").mkdir()                  # stopped before it finished: its attempt still counts
    (tmp_path / "pilot-r1-gtpo-s11" / "times.json").write_text(json.dumps(
        {"train": [{"seconds": 900.0, "finished": False, "workers": 2, "paused_seconds": 360.0}]}))
    study_report.report()
    text = (tmp_path / "summary.md").read_text()
    assert "| Q1 | GTPO above GRPO β=0 (Fig. 2) | gtpo-a6 − grpo-a6 (both Adam settings) | ID pass@1 | 6 |" in text
    assert "Q5: conflict tokens are mostly format tokens (Sec. 4.1) — holds" in text
    assert "| GTPO, Adam β 0.999999 | 3 | 0.60 0.60 0.60 | 0.40 0.40 0.40 |" in text
    assert "Worker-hours (every attempt, both workers summed): main and long parts 3.17; collapse part 0.15" \
        in text                                                  # 19 runs x 600 s; 900 s less 360 s paused
    for f in ("summary.json", "curves-main.png", "passk.png"):
        assert os.path.getsize(tmp_path / f) > 0
    assert not (tmp_path / "curves-long.png").exists()                   # its runs have not finished


def test_collapse_table_reads_h_ini_and_applies_the_rule(tmp_path, monkeypatch):
    committed_in(tmp_path, monkeypatch)
    for name in ("gtpo-long", "grpo-long"):
        for s in (1, 2):
            d = tmp_path / f"{name}-s{s}"
            d.mkdir()
            rows = [{"step": k, "phase": "rl", "rewards/format": 9.5 if name == "gtpo-long" or k < 20 else 5.0,
                     "entropy": 0.4 if name == "gtpo-long" or k < 20 else 1.5} for k in range(1, 41)]
            (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
            (d / "config.json").write_text(json.dumps({"h_ini": 0.401}))
            (d / "eval-kl.json").write_text(json.dumps({"points": [{"step": 0, "kl": 0.0}, {"step": 40, "kl": s / 10}],
                                                        "problems": 16, "samples_per_problem": 2}))
    (_, _, rule, lines), = study_report.collapse_lines(plan.part("long"))
    assert rule.startswith("holds") and len(lines) == 6
    assert lines[2] == "| GTPO, 200 steps, seed 1 | 0.401 | 95.0 → 95.0 | 0.400 → 0.400 | none | 0.100 (step 40) |"
    assert lines[5].startswith("| GRPO β=0, 200 steps, seed 2 |") and lines[5].endswith("| 0.200 (step 40) |")
    assert figures.plot_curves(str(tmp_path / "long.png"), plan.part("long"), ["gtpo-long", "grpo-long"], "long",
                                    10, kl=True)


def test_paused_seconds_are_not_counted_as_work(tmp_path, monkeypatch):
    committed_in(tmp_path, monkeypatch)
    _write_run(tmp_path, "gtpo-a6-s1", [1.0] * 20, [1, 0, 0, 0, 0])
    (tmp_path / "gtpo-a6-s1" / "times.json").write_text(json.dumps({
        "train": [{"seconds": 900.0, "finished": True, "workers": 2, "paused_seconds": 300}],
        "eval-id": [{"seconds": 1200.0, "finished": True, "workers": 2}]}))
    assert study_report.cost_hours("main and long parts") == pytest.approx((600 + 1200) / 3600)
    row = next(line for line in study_report.summary_lines() if line.startswith("| GTPO, Adam β 0.999999 |"))
    assert row.endswith("| 10.0 ± 0.0 |")                               # train minutes: 600 s worked


def test_collapse_part_ladder_stops_at_the_first_rung_where_grpo_collapses(tmp_path, monkeypatch):
    """Part 3 (docs/study.md): the pilot runs rung by rung; the first rung whose GRPO run collapses
    is the test's setting, later rungs are skipped, and the test's jobs (fresh seeds, both methods)
    join the table with that rung's flags; a rung's runs wait for every earlier rung's GRPO run. A
    run stopped on non-finite losses counts as collapsed."""
    committed_in(tmp_path, monkeypatch)
    assert plan.chosen_rung() is None
    assert not any(j[0].startswith("collapse-") for j in plan.part_jobs(plan.part("collapse")))
    calm = [{"step": k, "phase": "rl", "rewards/format": 9.5, "entropy": 0.3} for k in range(1, 101)]
    broke = [dict(r, **({"rewards/format": 4.0, "entropy": 1.4} if r["step"] > 60 else {})) for r in calm]
    for run_id, rows in (("pilot-r1-grpo-s11", calm), ("pilot-r2-grpo-s11", broke)):
        (tmp_path / run_id).mkdir()
        (tmp_path / run_id / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert plan.chosen_rung() == "r2"
    assert not plan.pilot_skipped("pilot-r2-gtpo-s11") and plan.pilot_skipped("pilot-r3-grpo-s11")
    tests = [j for j in plan.part_jobs(plan.part("collapse")) if j[0].startswith("collapse-")]
    assert sorted({j[2] for j in tests}) == list(plan.TEST_SEEDS) and len(tests) == 4 * len(plan.TEST_SEEDS)
    n = 2 * len(plan.TEST_SEEDS)
    assert [j[4] for j in tests] == [("rung", "rung-precollapse")] * n + [("kl",)] * n      # the drift last
    flags = tests[0][1]
    assert _flag(flags, "--lr") == "1e-3" and _flag(flags, "--dataset") == "arithmetic"
    assert flags[:len(plan.COMMON)] == plan.COMMON and {j[3] for j in tests} == \
        {f"warmup-collapse-s{s}" for s in plan.TEST_SEEDS}
    assert not plan.earlier_rungs_pending("pilot-r3-gtpo-s11") and plan.earlier_rungs_pending("pilot-r4-gtpo-s11")
    assert plan.collapse_step(calm[:40], {"step": 40}) == 40                     # diverged: collapsed there
    assert plan.collapse_step(broke, {"step": 99}) < 99                           # the rule's earlier step wins


def test_fisher_exact_one_sided_hand_values_and_the_declared_verdicts():
    """docs/study.md's sizes: 4/4 vs 0/4 p = 1/70, 5/6 vs 1/6 p = 37/924; with 5 + 5 seeds 5/5 vs 1/5
    and 4/5 vs 0/5 reach 0.05, 4/5 vs 1/5 does not."""
    f = verdicts.fisher_one_sided
    assert f(4, 4, 0, 4) == pytest.approx(1 / 70) and f(5, 6, 1, 6) == pytest.approx(37 / 924)
    assert f(5, 5, 1, 5) == pytest.approx(5 / 210) and f(4, 5, 0, 5) == pytest.approx(5 / 210)
    assert f(4, 5, 1, 5) == pytest.approx(26 / 252) and f(0, 5, 0, 5) == 1.0
    v = verdicts.verdict                              # a count difference and its one-sided p, as test_row
    assert v(1, 4 / 5, f(5, 5, 1, 5)) == "holds"
    assert v(1, 3 / 5, f(4, 5, 1, 5)) == "same direction, within noise"
    assert v(1, -1, f(5, 5, 0, 5)) == "contradicted"
    assert v(1, 0, 1.0) == "no difference"


def _write_rl(folder, run_id, rows, h_ini=None, evals=()):
    d = folder / run_id
    d.mkdir()
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "config.json").write_text(json.dumps({"h_ini": h_ini}))
    for name, p1 in evals:
        (d / f"eval-{name}.json").write_text(json.dumps({"pass@k": {"1": p1}}))


def test_filtered_entropy_weights_each_step_by_its_share_filtered():
    rows = [{"gtpo/filtered_frac": 0.25, "gtpo/filtered_entropy": 1.0},
            {"gtpo/filtered_frac": 0.75, "gtpo/filtered_entropy": 2.0},
            {"gtpo/filtered_frac": 0.0, "gtpo/filtered_entropy": 0.0}]
    assert study_report.filtered_entropy(rows) == pytest.approx(1.75)
    assert study_report.filtered_entropy(rows + [{"gtpo/filtered_frac": 0.5}]) is None    # partly logged
    assert study_report.filtered_entropy(rows[2:]) is None                               # nothing filtered


def test_ladder_and_test_tables_from_committed_runs(tmp_path, monkeypatch):
    """The pilot's table stops at the first rung whose GRPO run collapses and names it; the test's
    table gives each seed's collapse steps and pass@1, and its verdict once every seed has finished."""
    committed_in(tmp_path, monkeypatch)
    calm = [{"step": k, "phase": "rl", "rewards/format": 9.5, "rewards/accuracy": 1.0, "entropy": 0.3,
             "gtpo/filtered_frac": 0.25} for k in range(1, 101)]
    broke = [dict(r, **({"rewards/format": 4.0, "entropy": 1.4} if r["step"] > 60 else {})) for r in calm]
    _write_rl(tmp_path, "pilot-r1-grpo-s11", calm)
    lines, rule = study_report.ladder_lines()
    assert rule == "pilot not finished" and len(lines) == 3
    _write_rl(tmp_path, "pilot-r1-gtpo-s11", calm, h_ini=0.39)
    _write_rl(tmp_path, "pilot-r2-grpo-s11", broke)
    _write_rl(tmp_path, "pilot-r3-grpo-s11", calm)                    # a later rung: not in the table
    lines, rule = study_report.ladder_lines()
    assert rule.startswith("test at r2") and len(lines) == 5
    assert lines[3] == ("| r1 | arithmetic | 5e-4 | GTPO | 0.390 | 0.30 → 0.30 → 0.30 | 95 → 95 → 95 | 10.0 | "
                        "none |")
    # GRPO r2 collapses at 64: 4 broken steps take the trailing format to 9.5 - 4 x 0.55 <= 7.5, entropy 0.74
    assert lines[4].startswith("| r2 | arithmetic | 1e-3 | GRPO β=0 | – |") and lines[4].endswith("| 64 |")
    for s in plan.TEST_SEEDS[:-1]:
        _write_rl(tmp_path, f"collapse-grpo-s{s}", broke, evals=(("rung", 0.1), ("rung-precollapse", 0.3)))
        _write_rl(tmp_path, f"collapse-gtpo-s{s}", calm, 0.4, evals=(("rung", 0.2), ("rung-precollapse", 0.2)))
    rule, lines = study_report.collapse_test_lines(plan.part("collapse"))
    assert rule == "not finished (4 of 5 seeds have both runs)" and "sign-flip" not in "\n".join(lines)
    assert lines[2] == "| 21 | 0.400 | 64 | none | 25.0 | – | 0.100 / 0.200 | 0.300 / 0.200 |"  # rows predate the key
    s = plan.TEST_SEEDS[-1]
    _write_rl(tmp_path, f"collapse-grpo-s{s}", calm, evals=(("rung", 0.1),))
    _write_rl(tmp_path, f"collapse-gtpo-s{s}", calm, 0.4, evals=(("rung", 0.1),))
    rule, lines = study_report.collapse_test_lines(plan.part("collapse"))
    assert rule == ("holds: GRPO collapses in 4 of 5 seeds, GTPO in 0 of 5; Fisher's exact test, one-sided, "
                    "p = 0.024")
    assert lines[6].endswith("| 0.100 / 0.100 | – / – |") and "sign-flip p 0.125" in lines[8]
    curves = study_report.test_curve_lines()
    # steps 61-100 broken: the last 10 are all broken (entropy 1.4, format 4.0 of 10 points)
    assert len(curves) == 2 + 10 and curves[2] == ("| 21 | GRPO β=0 | 0.30 → 1.40 → 1.40 | 95 → 40 → 40 | "
                                                   "10.0 | 64 | – |")
    assert figures.plot_runs(str(tmp_path / "ladder.png"), plan.part("collapse"), "ladder_plot_rows")
    (tmp_path / f"collapse-gtpo-s{s}" / "eval-kl.json").write_text(json.dumps({"points": [{"step": 0, "kl": 0.0},
                                                                                        {"step": 100, "kl": 0.3}]}))
    assert study_report.test_curve_lines()[-1].endswith("| none | 0.300 (step 100) |")
    assert figures.plot_runs(str(tmp_path / "test.png"), plan.part("collapse"), "test_plot_rows")  # + a KL panel


def test_precollapse_evaluation_reads_the_checkpoint_before_the_collapse(tmp_path, monkeypatch):
    """The last scheduled checkpoint before the collapse step; the final adapter's own evaluation when the
    run never collapsed; the warm-up, shared by the seed's two runs, when no checkpoint came before the collapse."""
    keep, work = tmp_path / "study", tmp_path / "runs"
    keep.mkdir()
    committed_in(keep, monkeypatch)
    calm = [{"step": k, "phase": "rl", "rewards/format": 9.5, "entropy": 0.3} for k in range(1, 101)]
    for run_id, breaks in (("collapse-grpo-s21", 60), ("collapse-gtpo-s21", 10), ("collapse-grpo-s22", None)):
        rows = [dict(r, **({"rewards/format": 4.0, "entropy": 1.4} if breaks and r["step"] > breaks else {}))
                for r in calm]
        _write_rl(keep, run_id, rows)
        out = work / run_id
        for n in (25, 50, 60, 75, 100):                             # 60: saved by a stop signal, not on schedule
            (out / f"checkpoint-{n}").mkdir(parents=True)
        (out / "final").mkdir()
        (out / "config.json").write_text(json.dumps({"init_from": str(work / "warmup-collapse-s21" / "final"),
                                                     "save_steps": 25, "max_steps": 100}))
    rung = lambda run_id: study.rung_adapter(run_id, str(work / run_id), "rung-precollapse")  # noqa: E731
    assert rung("collapse-grpo-s21") == (str(work / "collapse-grpo-s21" / "checkpoint-50"), None)   # collapses at 64
    assert rung("collapse-gtpo-s21") == (str(work / "warmup-collapse-s21" / "final"),
                                         str(keep / "warmup-collapse-s21" / "eval-rung.json"))
    assert rung("collapse-grpo-s22") == (str(work / "collapse-grpo-s22" / "final"),
                                         str(keep / "collapse-grpo-s22" / "eval-rung.json"))
    assert json.loads((keep / "collapse-gtpo-s21" / "precollapse.json").read_text()) == {"collapse_step": 14,
                                                                                         "checkpoint": None}


def test_a_collapse_test_run_costs_its_time_once_though_listed_twice(tmp_path, monkeypatch):
    """The drift jobs repeat the test's run ids at the table's end; each attempt counts once."""
    committed_in(tmp_path, monkeypatch)
    broke = [{"step": k, "phase": "rl", "rewards/format": 9.5 if k <= 60 else 4.0, "entropy": 0.3 if k <= 60 else 1.4}
             for k in range(1, 101)]
    _write_rl(tmp_path, "pilot-r1-grpo-s11", broke)                   # r1 collapses: the test joins the table
    _write_rl(tmp_path, "collapse-grpo-s21", broke)
    (tmp_path / "collapse-grpo-s21" / "times.json").write_text(json.dumps({
        "train": [{"seconds": 3000.0, "finished": True, "workers": 2}],
        "eval-kl": [{"seconds": 600.0, "finished": True, "workers": 2}]}))
    assert [j[0] for j in study.jobs()].count("collapse-grpo-s21") == 2
    assert study_report.cost_hours("collapse part") == pytest.approx(1.0)


def test_q6_runs_gtpo_with_eq7_on_eight_seeds_and_grpo_on_the_new_three():
    """docs/study.md part 4: what the verdict needs first (warm-ups, training), then `rung`, then `kl`."""
    jobs = plan.part_jobs(plan.part("q6"))
    assert [j[0] for j in jobs[:3]] == ["warmup-collapse-s26", "warmup-collapse-s27", "warmup-collapse-s28"]
    trained = [j for j in jobs if j[4] == ()][3:]
    assert sorted(j[0] for j in trained) == sorted([f"q6-gtpo-s{s}" for s in range(21, 29)] +
                                                   [f"q6-grpo-s{s}" for s in (26, 27, 28)])
    assert [j[4] for j in jobs[3:]] == [()] * 11 + [("rung",)] * 11 + [("kl",)] * 11
    for run_id, flags, seed, start, _ in trained:
        assert start == f"warmup-collapse-s{seed}" and _flag(flags, "--lr") == "2e-3"
        assert flags[flags.index("--dataset", flags.index("--max_steps")) + 1] == "arithmetic-hard"
        # GTPO's term as written; GRPO reads no term, and its runs recorded eq7, the default then
        assert flags == plan.rung_flags(run_id.split("-")[1], "arithmetic-hard", "2e-3") + ["--entropy_term", "eq7"]


def test_q6_table_verdict_and_cost_from_committed_files(tmp_path, monkeypatch):
    """Q6's table has each run's zero-gradient steps beside its collapse step; the verdict waits for all 8
    seeds, then is part 3's rule; the warm-ups Q6 trained again count in Q6's cost, not part 3's."""
    committed_in(tmp_path, monkeypatch)
    calm = [{"step": k, "phase": "rl", "rewards/format": 9.5, "rewards/accuracy": 0.0, "entropy": 0.3,
             "grad_norm": 0.2} for k in range(1, 101)]
    broke = [dict(r, **({"rewards/format": 4.0, "entropy": 1.4, "grad_norm": 0.0} if r["step"] > 60 else {}))
             for r in calm]
    for s in range(21, 29):
        grpo, gtpo = (plan.arm(name).run_id(s) for name in ("q6-grpo", "q6-gtpo"))
        _write_rl(tmp_path, grpo, broke if s <= 26 else calm)                     # GRPO: 6 of 8 collapse
        _write_rl(tmp_path, gtpo, broke if s == 21 else calm)                     # GTPO: 1 of 8
        if s == 21:
            (_, _, rule, lines), = study_report.per_seed_lines(plan.part("q6"))
            assert rule == "not finished (1 of 8 seeds have both runs)"
            assert "| 21 | GTPO, Eq. 7 | 64 | 40 | 0.0 |" in "\n".join(lines)      # 40 steps with grad_norm 0
    assert plan.arm("q6-grpo").run_id(21) == "collapse-grpo-s21" and plan.arm("q6-grpo").run_id(27) == "q6-grpo-s27"
    (_, _, rule, lines), = study_report.per_seed_lines(plan.part("q6"))
    assert rule == "holds: GRPO collapses in 6 of 8 seeds, GTPO (Eq. 7) in 1 of 8; Fisher's exact test, " \
                   "one-sided, p = 0.020" and len(lines) == 2 + 16
    attempt = lambda date: {"seconds": 1800.0, "finished": True, "workers": 2, "date": date}   # noqa: E731
    (tmp_path / "warmup-collapse-s21").mkdir()
    (tmp_path / "warmup-collapse-s21" / "times.json").write_text(json.dumps(
        {"train": [attempt("2026-11-20T10:00:00"), attempt("2026-11-25T15:00:00")]}))
    (tmp_path / "q6-gtpo-s21" / "times.json").write_text(json.dumps({"train": [attempt("2026-11-25T16:00:00")]}))
    assert study_report.cost_hours("Q6") == pytest.approx(1.0)
    assert study_report.cost_hours("collapse part") == pytest.approx(0.5)


def test_one_sided_sign_flip_hand_values():
    """8 of 8 in one direction: 1/256 (either direction: the p is the observed direction's); the sum's rank among
    the 2^m patterns otherwise; a zero flips to itself; no direction at all: 1."""
    one = lambda d: verdicts.sign_flip_p(d, sided=1)                       # noqa: E731
    assert one([0.1] * 8) == one([-0.1] * 8) == 1 / 256
    assert one([0.3, -0.1]) == 2 / 4          # +-: 0.2 observed; ++ 0.4 and +- reach it
    assert one([0.1, 0.0]) == 2 / 4            # the 0 unit's two signs tie
    assert one([-0.1] * 7 + [0.05]) == 2 / 256 and one([0.1, -0.1] * 4) == 1.0
    v = lambda d: verdicts.verdict(1, sum(d) / len(d), one(d))            # noqa: E731
    assert v([0.1] * 8) == "holds" and v([-0.1] * 7 + [0.05]) == "contradicted"
    assert v([0.1, -0.1] * 4) == "no difference" and v([0.1] * 6 + [-0.1] * 2) == "same direction, within noise"
    assert verdicts.holm([0.01, 0.04]) == [0.02, 0.04] and verdicts.holm([0.04, 0.01]) == [0.04, 0.02]
    assert verdicts.holm([0.03, 0.02]) == [0.04, 0.04]                      # step-down keeps the order


def test_q7_table_and_verdict_from_committed_files(tmp_path, monkeypatch):
    """Q7's table gives each run's ID pass@1 beside its formatting share, best checkpoint, OOD, curves, steps
    with no reward spread, zero-gradient steps and KL at step 200; the verdict waits for all 8 seeds' ID evaluations, then is
    the one-sided sign-flip rule; the cost counts Q7's runs and warm-ups only."""
    committed_in(tmp_path, monkeypatch)
    rows = [{"step": k, "phase": "rl", "rewards/format": 9.0 + (k > 190), "rewards/accuracy": 1.0 + 3 * (k > 190),
             "entropy": 0.5 - k / 1000, "grad_norm": 0.0 if k in (3, 4) else 0.1, "gtpo/filtered_frac": 0.25,
             "reward_std": 0.0 if k in (3, 4, 5) else 0.3} for k in range(1, 201)]
    ev = lambda p1: ("id", {"pass@k": {"1": p1}, "format_rate": 0.99, "mean_length": 52.4})   # noqa: E731
    for s in plan.Q7_SEEDS:
        grpo, gtpo = (plan.arm(name).run_id(s) for name in ("q7-grpo", "q7-gtpo"))
        assert (grpo, gtpo) == (f"q7-grpo-s{s}", f"q7-gtpo-s{s}")
        for run_id, p1 in ((grpo, 0.40), (gtpo, 0.45 if s != 8 else 0.30)):   # GTPO higher in 7 of 8
            _write_rl(tmp_path, run_id, rows)
            for name, res in (ev(p1), ("ood", {"pass@k": {"1": 0.2}}),
                              ("kl200", {"points": [{"step": 200, "kl": 0.321, "tokens": 900}]})):
                (tmp_path / run_id / f"eval-{name}.json").write_text(json.dumps(res))
        if s == 1:
            (_, _, rule, lines), = study_report.per_seed_lines(plan.part("q7"))
            assert rule == "not finished (1 of 8 seeds have both runs)"
            assert "| 1 | GTPO, Eq. 7 | 0.450 | 99 | 52 | – | 0.200 | 90 → 100 | 10.0 → 40.0 | " \
                   "0.49 → 0.30 → 0.30 | 3 | 2 | 25.0 | 0.321 | – |" in "\n".join(lines)
    (_, _, rule, lines), = study_report.per_seed_lines(plan.part("q7"))
    diffs = [0.05] * 7 + [-0.10]
    p = sum(sum(d if m >> i & 1 else -d for i, d in enumerate(diffs)) >= sum(diffs) - 1e-12 for m in range(256)) / 256
    assert rule == (f"{'holds' if p <= 0.05 else 'same direction, within noise'}: ID pass@1 GTPO − GRPO "
                    f"{sum(diffs) / 8:+.3f} on average, GTPO higher in 7 of 8 seeds; exact one-sided sign-flip test, "
                    f"p = {p:.3f}") and len(lines) == 2 + 16
    # sum 0.25 reached with -0.10 kept and no 0.05 flipped (1), or with +0.10 and at most two flipped (1 + 7 + 21)
    assert p == 30 / 256 and rule.startswith("same direction, within noise")
    (tmp_path / "q7-gtpo-s1" / "times.json").write_text(json.dumps({"train": [{"seconds": 1800.0}],
                                                                     "eval-id": [{"seconds": 1800.0}]}))
    (tmp_path / "warmup-q7-s1").mkdir()
    (tmp_path / "warmup-q7-s1" / "times.json").write_text(json.dumps({"train": [{"seconds": 360.0}]}))
    assert study_report.cost_hours("Q7") == pytest.approx(1.1)
    assert sum(study_report.cost_hours(n) for n in ("main and long parts", "Q6", "collapse part", "Q8")) == 0


def test_q7_runs_are_evaluated_in_the_job_that_trains_them():
    """docs/study.md part 6: per seed its own warm-up, then GRPO and GTPO (Eq. 7 as written, its term named), each job
    carrying its evaluations (the released-form arm is Q8's)."""
    jobs = plan.part_jobs(plan.part("q7"))
    assert len(jobs) == 3 * len(plan.Q7_SEEDS)
    for k, s in enumerate(plan.Q7_SEEDS):
        warm, grpo, gtpo = jobs[3 * k:3 * k + 3]
        assert warm[0] == f"warmup-q7-s{s}" and warm[1] == plan.WARMUP_LONG and warm[3] is None
        assert gtpo[0] == f"q7-gtpo-s{s}" and gtpo[3] == warm[0] and gtpo[4] == ("id", "id-best", "ood", "kl200")
        assert grpo[0] == f"q7-grpo-s{s}" and grpo[3] == warm[0] and grpo[4] == gtpo[4]
        assert gtpo[1][-4:] == ["--entropy_term", "eq7", "--entropy_filter", "auto"] and "--use_gtpo" in gtpo[1]
        assert "--use_grpo" in grpo[1] and gtpo[1][:len(plan.COMMON)] == grpo[1][:len(plan.COMMON)]
        common = len(plan.COMMON)
        assert [f for f in gtpo[1][common:] if f not in grpo[1][common:]] == ["--use_gtpo", "--entropy_filter", "auto"]
        assert grpo[1][-2:] == ["--entropy_term", "eq7"]               # as its runs recorded; GRPO reads no term


def test_q8_runs_start_from_their_own_warm_up_and_add_grpo_where_it_differs_from_q7s(tmp_path, monkeypatch):
    """docs/study.md part 7: per seed a Q8 warm-up, the released-term and gamma = 0 arms with Q7's GTPO flags
    otherwise; q8-grpo on seeds 1-2 only once that seed's warm-up fingerprint differs from Q7's."""
    committed_in(tmp_path, monkeypatch)
    jobs = plan.part_jobs(plan.part("q8"))
    q7 = {j[0]: j for j in plan.part_jobs(plan.part("q7"))}
    assert [j[0] for j in jobs[:3]] == ["warmup-q8-s1", "q7-released-s1", "q8-nogamma-s1"]
    warm, rel, nog = jobs[:3]
    assert warm[1] == q7["warmup-q7-s1"][1] and warm[3] is None and rel[3] == nog[3] == "warmup-q8-s1"
    gtpo = q7["q7-gtpo-s1"][1]
    assert rel[1] == [*gtpo[:-4], "--entropy_term", "released", "--entropy_filter", "auto"]
    assert nog[1] == gtpo + ["--ent_gamma", "0"] and rel[4] == nog[4] == q7["q7-gtpo-s1"][4]
    assert len(jobs) == 3 * len(plan.Q7_SEEDS) and plan.warmup_differs(1) is None
    for w, fp in (("warmup-q7", [1, 2]), ("warmup-q8", [1, 2])):
        for s in (1, 3):
            (tmp_path / f"{w}-s{s}").mkdir()
            (tmp_path / f"{w}-s{s}" / "adapter_fingerprint.json").write_text(json.dumps({"fingerprint": fp}))
    assert plan.warmup_differs(1) is False and len(plan.part_jobs(plan.part("q8"))) == len(jobs)
    for s in (1, 3):
        (tmp_path / f"warmup-q8-s{s}" / "adapter_fingerprint.json").write_text(json.dumps({"fingerprint": [1, 3]}))
    grpo = [j for j in plan.part_jobs(plan.part("q8")) if j[0].startswith("q8-grpo")]
    assert [j[0] for j in grpo] == ["q8-grpo-s1"] and grpo[0][1] == q7["q7-grpo-s1"][1] and grpo[0][3] == "warmup-q8-s1"


def test_a_run_another_worker_is_training_is_waited_for_not_trained_twice(tmp_path):
    """study.run.training_elsewhere: a live other process's training.pid says "wait"; this process's own,
    a dead one's or none says "train"."""
    import subprocess
    import sys
    (tmp_path / "training.pid").write_text(str(os.getpid()))
    assert not study.training_elsewhere(str(tmp_path))
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        (tmp_path / "training.pid").write_text(str(other.pid))
        assert study.training_elsewhere(str(tmp_path))
    finally:
        other.kill()
        other.wait()
    assert not study.training_elsewhere(str(tmp_path))                 # its process is gone
    assert not study.training_elsewhere(str(tmp_path / "nothing-here"))


def test_list_says_a_committed_run_without_weights_trains_again_before_its_evaluations(tmp_path, monkeypatch,
                                                                                        capsys):
    """runs/study/ is never committed: on a fresh checkout a Q6 run with committed metrics but no `kl` yet
    must be trained again first, and --list says so with its last finished attempt's seconds."""
    committed_in(tmp_path, monkeypatch)
    monkeypatch.setattr(study, "WORK", str(tmp_path / "work"))
    _write_rl(tmp_path, "q6-gtpo-s25", [{"step": k, "phase": "rl", "rewards/format": 9.5, "entropy": 0.3}
                                        for k in range(1, 101)])
    (tmp_path / "q6-gtpo-s25" / "times.json").write_text(json.dumps({"train": [
        {"seconds": 900.0, "finished": False, "workers": 2}, {"seconds": 1121.4, "finished": True, "workers": 2},
        {"seconds": 50.0, "finished": False, "workers": 2}]}))
    study.status()
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("q6-gtpo-s25 ")]
    assert [ln.split()[1] for ln in lines] == ["done", "train", "train"]          # training, rung, kl
    assert lines[2].endswith("(its last finished training attempt: 1121 s)")
    assert "(its last" not in lines[0] and study.last_training_seconds("q6-gtpo-s24") is None


def test_a_run_trained_again_must_log_what_was_committed_or_it_stops(tmp_path, monkeypatch):
    """study.run.train on a run whose metrics are committed: timings may differ, anything else stops the
    worker before a committed file is overwritten (its evaluations would describe another run)."""
    (tmp_path / "keep").mkdir()
    committed_in(tmp_path / "keep", monkeypatch)
    monkeypatch.setattr(study, "WORK", str(tmp_path / "work"))
    rows = [{"step": k, "phase": "rl", "loss": 0.1 * k, "grad_norm": 0.5, "step_time": 20.0, "time/generate": 9.0}
            for k in (1, 2, 3)]
    _write_rl(tmp_path / "keep", "q6-gtpo-s25", rows)
    out = tmp_path / "work" / "q6-gtpo-s25"
    (out / "final").mkdir(parents=True)                                  # trained: train() copies only
    again = [dict(r, step_time=31.0, **{"time/generate": 12.5, "entropy": 0.2}) for r in rows]
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in again))
    study.train("q6-gtpo-s25", [], 25, "warmup-collapse-s25", (0, 2), 1)      # timings and a new metric only
    assert (tmp_path / "keep" / "q6-gtpo-s25" / "metrics.jsonl").read_text() == (out / "metrics.jsonl").read_text()
    committed = (tmp_path / "keep" / "q6-gtpo-s25" / "metrics.jsonl").read_text()
    again[1]["loss"] = 0.2000001
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in again))
    with pytest.raises(SystemExit, match="differ from the committed ones from step 2"):
        study.train("q6-gtpo-s25", [], 25, "warmup-collapse-s25", (0, 2), 1)
    assert (tmp_path / "keep" / "q6-gtpo-s25" / "metrics.jsonl").read_text() == committed
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in again[:2]))
    assert study.first_difference(str(tmp_path / "keep" / "q6-gtpo-s25" / "metrics.jsonl"),
                                  str(out / "metrics.jsonl")) == 2
    held = {"step": 0, "phase": "eval", "eval/pass@1": 0.25}           # held-out rows on one side only: not training
    kept = [json.loads(line) for line in committed.splitlines()]
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [held, *kept[:2], dict(held, step=2),
                                                                             kept[2]]))
    assert study.first_difference(str(tmp_path / "keep" / "q6-gtpo-s25" / "metrics.jsonl"),
                                  str(out / "metrics.jsonl")) is None


def test_a_committed_run_from_another_kind_of_host_is_not_trained_again_here(tmp_path, monkeypatch, capsys):
    """Float results differ between AVX2 and AVX-512 kernels in the last bits, so a committed run whose
    metrics another kind of host logged (host.json) stops before any training starts (not after it,
    when the metrics differ), and --list says which kind; a run trained on the same kind trains, and
    each attempt records its host's kind in times.json."""
    committed_in(tmp_path, monkeypatch)
    monkeypatch.setattr(study, "WORK", str(tmp_path / "work"))
    monkeypatch.setattr(study, "cpu", lambda: "AVX2")
    _write_rl(tmp_path, "q6-gtpo-s25", [{"step": 1, "phase": "rl", "loss": 0.1}])
    (tmp_path / "q6-gtpo-s25" / "host.json").write_text(json.dumps({"cpu": ["AVX512"]}))
    (tmp_path / "q6-gtpo-s25" / "times.json").write_text(json.dumps({"train": [                   # not what decides
        {"seconds": 1121.4, "finished": True, "workers": 2, "cpu": "AVX2"}]}))
    monkeypatch.setattr(study, "attempt", lambda *a: pytest.fail("trained on another kind of host"))
    with pytest.raises(SystemExit, match="from a AVX512 host and this one is AVX2"):
        study.train("q6-gtpo-s25", [], 25, "warmup-collapse-s25", (0, 2), 1)
    study.status()
    line = next(ln for ln in capsys.readouterr().out.splitlines()
                if ln.startswith("q6-gtpo-s25 ") and "train again" in ln)
    assert line.endswith("(trained on AVX512; this host: AVX2)")
    study.record_time("q6-gtpo-s25", "train", 3.0, True, (0, 1))
    assert json.loads((tmp_path / "q6-gtpo-s25" / "times.json").read_text())["train"][-1]["cpu"] == "AVX2"
    monkeypatch.setattr(study, "cpu", lambda: "AVX512")                   # the same kind: it trains
    calls = []
    out = tmp_path / "work" / "q6-gtpo-s25"
    monkeypatch.setattr(study, "attempt", lambda *a: calls.append(a) or (out / "final").mkdir())
    monkeypatch.setattr(study, "wait_for", lambda path: path)
    out.mkdir(parents=True)
    (out / "metrics.jsonl").write_text(json.dumps({"step": 1, "phase": "rl", "loss": 0.1}) + "\n")
    study.train("q6-gtpo-s25", [], 25, "warmup-collapse-s25", (0, 2), 1)
    assert len(calls) == 1
    assert json.loads((tmp_path / "q6-gtpo-s25" / "host.json").read_text()) == {"cpu": ["AVX512"],
                                                                               "hosts": [study.host()]}
    assert study.host().count(";") == 1 and "torch 2." in study.host() and "family" in study.host()


def test_a_run_resumes_and_is_evaluated_only_on_the_host_that_began_it(tmp_path, monkeypatch):
    """A run stopped part-way has no committed metrics or fingerprint to compare, so its folder keeps the host
    that began it (host.txt): another host stops before resuming, or before evaluating it; the same one
    resumes (--resume)."""
    committed_in(tmp_path / "keep", monkeypatch)
    monkeypatch.setattr(study, "WORK", str(tmp_path / "work"))
    monkeypatch.setattr(study, "wait_for", lambda path: path)
    out = tmp_path / "work" / "q8-nogamma-s4"
    calls = []
    monkeypatch.setattr(study, "attempt", lambda *a: calls.append(a[2]))        # stopped: no final/
    monkeypatch.setattr(study, "host", lambda: "AMD EPYC family 25 model 17; torch 2.13.0")
    study.train("q8-nogamma-s4", ["--ent_gamma", "0"], 4, "warmup-q8-s4", (0, 2), 1)
    assert (out / "host.txt").read_text() == "AMD EPYC family 25 model 17; torch 2.13.0"
    assert "--resume" not in calls[0]
    (out / "config.json").write_text("{}")                                      # train.py began it
    monkeypatch.setattr(study, "host", lambda: "Intel Xeon family 6 model 143; torch 2.13.0")
    with pytest.raises(SystemExit, match=r"interrupted on another host \(AMD EPYC family 25"):
        study.train("q8-nogamma-s4", ["--ent_gamma", "0"], 4, "warmup-q8-s4", (0, 2), 1)
    assert len(calls) == 1
    monkeypatch.setattr(study, "host", lambda: "AMD EPYC family 25 model 17; torch 2.13.0")
    monkeypatch.setattr(study, "attempt", lambda *a: calls.append(a[2]) or (out / "final").mkdir())
    study.train("q8-nogamma-s4", ["--ent_gamma", "0"], 4, "warmup-q8-s4", (0, 2), 1)
    assert calls[1][-1] == "--resume"
    (out / "config.json").write_text(json.dumps({"dataset": "arithmetic"}))     # its evaluation: the same rule
    monkeypatch.setattr(study, "host", lambda: "Intel Xeon family 6 model 143; torch 2.13.0")
    with pytest.raises(SystemExit, match=r"trained on another host \(AMD EPYC.*Evaluate it there"):
        study.evaluate("q8-nogamma-s4", str(out), ["id"], (0, 2), 1)
    assert len(calls) == 2


def test_q8_verdicts_holm_and_the_default_term_rule_on_hand_made_runs(tmp_path, monkeypatch):
    """docs/study.md part 7: the two primary one-sided tests are Holm-adjusted together; the default becomes
    `released` only if released − Eq. 7 is positive with two-sided p <= 0.05 and released is not contradicted
    against GRPO; before every run is in, Eq. 7 stays and the rule says it has not decided."""
    committed_in(tmp_path, monkeypatch)
    rows = [{"step": k, "phase": "rl", "rewards/format": 9.0, "rewards/accuracy": 2.0, "entropy": 0.3}
            for k in range(1, 21)]
    q8 = plan.part("q8")

    def write(values):                                          # arm -> 8 ID pass@1 values
        for name, ps in values.items():
            for s, p1 in zip(plan.Q7_SEEDS, ps):
                d = tmp_path / f"{name}-s{s}"
                d.mkdir(exist_ok=True)
                (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
                (d / "eval-id.json").write_text(json.dumps({"pass@k": {"1": p1}, "format_rate": 1.0,
                                                            "mean_length": 40.0}))
    write({"q7-grpo": [0.40] * 8, "q7-gtpo": [0.30] * 8, "q7-released": [0.45] * 8})
    assert study_report.default_term(q8) == ("eq7", "not decided: the runs are not all evaluated")
    write({"q8-nogamma": [0.35] * 7 + [0.45]})
    (_, _, rule, lines), = study_report.q8_lines(q8)
    assert rule == "released − GRPO: holds; γ = 0 − GRPO: contradicted"
    text = "\n".join(lines)
    assert len([ln for ln in lines if ln.startswith("| 1 |")]) == 4                      # the 4 arms of seed 1
    # released: 8 of 8 above GRPO, one-sided p 1/256, Holm: doubled; γ = 0: 7 of 8 below, p 9/256, Holm: itself
    assert "- released − GRPO: holds: ID pass@1 released − GRPO +0.050 on average, released higher in 8 of 8 " \
           "seeds; exact one-sided sign-flip test, p = 0.004, Holm-adjusted 0.008" in text
    assert "γ = 0 higher in 1 of 8 seeds; exact one-sided sign-flip test, p = 0.035, Holm-adjusted 0.035" in text
    assert "- released − Eq. 7: released above Eq. 7 (across seeds): ID pass@1" in text
    assert "Default entropy term by part 7's rule: `released` (released − Eq. 7 +0.150, p = 0.008" in text
    assert study_report.default_term(q8)[0] == "released"
    write({"q7-released": [0.31] * 6 + [0.29] * 2})                # above Eq. 7 on 6 of 8: p = 2 x 37/256 > 0.05
    assert study_report.default_term(q8)[0] == "eq7"
    write({"q7-released": [0.35] * 8, "q7-grpo": [0.50] * 8})      # above Eq. 7 on 8, but below GRPO on 8
    term, why = study_report.default_term(q8)
    assert term == "eq7" and why.endswith("released is contradicted against GRPO")


def test_a_warm_up_trained_again_must_match_its_committed_fingerprint(tmp_path, monkeypatch):
    """Runs started from a warm-up that another host's numerics changed would start elsewhere: the runner stops."""
    committed_in(tmp_path, monkeypatch)
    monkeypatch.setattr(study, "WORK", str(tmp_path / "work"))
    (tmp_path / "work" / "warmup-q8-s1" / "final").mkdir(parents=True)
    (tmp_path / "work" / "warmup-q8-s1" / "metrics.jsonl").write_text("")
    monkeypatch.setattr(study, "adapter_fingerprint", lambda folder: [1, 2])
    study.train("warmup-q8-s1", [], 1, None, (0, 1), 1)
    assert json.loads((tmp_path / "warmup-q8-s1" / "adapter_fingerprint.json").read_text()) == {"fingerprint": [1, 2]}
    study.train("warmup-q8-s1", [], 1, None, (0, 1), 1)                                   # the same one: fine
    monkeypatch.setattr(study, "adapter_fingerprint", lambda folder: [1, 3])
    with pytest.raises(SystemExit, match="differs from the committed one"):
        study.train("warmup-q8-s1", [], 1, None, (0, 1), 1)


def _answers_in(path):
    """The answers table (its header line to the first blank line) of a file, and the lines before it."""
    lines = open(path).read().splitlines()
    start = lines.index("| Q | the paper's claim | setting | verdict | what a user sees |")
    end = lines.index("", start)
    return lines[start:end], lines[:start]


def test_results_md_opens_with_what_to_run_and_the_answers_of_summary_md():
    """docs/results.md's first 45 lines say what to run and hold study/summary.md's answers table exactly, a row per
    question Q1-Q11 (and part 3)."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    table, before = _answers_in(os.path.join(here, "docs", "results.md"))
    assert len(before) + len(table) <= 45 and any(line.startswith("**What to run:**") for line in before)
    assert table == _answers_in(os.path.join(here, "study", "summary.md"))[0]
    assert [row.split(" | ")[0][2:] for row in table[2:]] == ["Q1", "Q2", "Q3", "Q4", "Part 3", "Q5", "Q6", "Q7", "Q8",
                                                         "Q9", "Q10", "Q11"]


@pytest.mark.slow
def test_summary_md_answers_are_computed_from_the_plan_and_the_committed_runs():
    """study/summary.md's answers table is what study.report computes now from study.answers.ANSWERS and study/runs/."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    assert _answers_in(os.path.join(here, "study", "summary.md"))[0] == study_report.answer_lines()


def test_watch_trains_and_evaluates_seed_1_as_the_study_did():
    """study.watch's commands, parsed as train.py / eval.py parse them, give the committed runs' recorded settings
    (warmup-q9-s1, q7-released-s1: config.json, eval-id.json), the RL run starting from the warm-up it trained."""
    import eval as evaluate
    from machinery.config import parse_args, record
    from study import watch
    keys = _recorded_keys()
    steps = watch.commands(1, "runs/watch-s1")
    assert [cmd[0] for cmd, _ in steps] == ["train.py", "train.py", "eval.py", "eval.py"]
    for (cmd, _), run_id in zip(steps, ("warmup-q9-s1", "q7-released-s1")):
        with open(os.path.join(plan.KEEP, run_id, "config.json")) as f:
            have = json.load(f)
        cfg = parse_args(cmd[1:])
        assert {k: record(cfg)[k] for k in keys if k in have} == {k: have[k] for k in keys if k in have}, run_id
    assert parse_args(steps[1][0][1:]).init_from == steps[0][1]
    for (cmd, _), run_id, run in zip(steps[2:], ("warmup-q9-s1", "q7-released-s1"), ("warmup", "rl")):
        with open(os.path.join(plan.KEEP, run_id, "eval-id.json")) as f:
            have = json.load(f)
        args = evaluate.parse_args(cmd[1:])
        assert args.adapter == f"runs/watch-s1/{run}/final"
        assert (args.split, args.limit, args.n_samples, args.seed, args.max_completion_length) == \
               (have["split"], have["n_problems"], have["n_samples"], have["seed"], have["max_completion_length"])


@pytest.mark.needs_data
def test_table1_small_run_sets_ours_beside_the_authors_and_resumes(tmp_path, tiny_model_dir, capsys):
    """study.table1 on the tiny model, 2 problems a set, n = 4 (a problem a rollout call), k <= 4: our rows for each run on AIME 2024, AIME 2025
    and AMC 2023 beside the authors' rows for the model and training set, quoted from their file. Run again after
    a set lost its last problem (as a kill leaves it), the rows marked in every set survive, only that problem is
    sampled again and the table is whole; run again on the whole table, no model is loaded. Ctrl-C stops it with
    one line."""
    import json
    from study import table1
    out = tmp_path / "t1"
    argv = ["--model", tiny_model_dir, "--run", "base=none", "--limit", "2", "--n_samples", "4", "--pass_k", "1", "4",
            "--maj_k", "4", "--eval_flags", "--max_completion_length 4 --batch_size 4", "--output_dir", str(out)]
    assert table1.main(argv) == 0
    res = json.loads((out / "table1.json").read_text())
    assert [c[:2] for c in res["columns"]] == [[s, "pass"] for s in table1.SETS for _ in (1, 4)] + [["amc23", "maj"]]
    assert [r["name"] for r in res["rows"]] == ["ours: base"]            # a folder: no authors' rows for it
    for s in table1.SETS:                                               # every row marked as the first run left it
        f = out / "base" / s / "samples.jsonl"
        rows = [{**json.loads(line), "marked": True} for line in f.read_text().splitlines()]
        assert len(rows) == 8 and {r["problem"] for r in rows} == {0, 1}
        f.write_text("".join(json.dumps(r) + "\n" for r in rows if s != "aime25" or r["problem"] == 0))
    assert table1.main(argv + ["--authors_model", "llama-8b"]) == 0      # the authors' rows of a model they ran
    for s in table1.SETS:
        again = [json.loads(line) for line in (out / "base" / s / "samples.jsonl").read_text().splitlines()]
        assert len(again) == 8 and [r.get("marked", False) for r in again] == \
            [True] * 4 + [s != "aime25"] * 4                            # aime25's problem 1 alone sampled again
    import eval as evaluate
    real_load = evaluate.load_eval_model
    evaluate.load_eval_model = lambda *a, **k: pytest.fail("a finished set loaded a model")
    try:
        assert table1.main(argv + ["--authors_model", "llama-8b"]) == 0
    finally:
        evaluate.load_eval_model = real_load
    res = json.loads((out / "table1.json").read_text())
    names = [r["name"] for r in res["rows"]]
    assert names == ["ours: base", "authors: sft (llama-8b, gsm8k)", "authors: grpo (llama-8b, gsm8k)",
                     "authors: gtpo (llama-8b, gsm8k)"]
    gtpo_row = res["rows"][-1]["values"]
    assert gtpo_row[res["columns"].index(["amc23", "maj", 4])] == 25.0     # their Table 1, as transcribed
    assert gtpo_row[res["columns"].index(["aime24", "pass", 1])] == 0.0
    md = (out / "table1.md").read_text()
    assert "their Table 1 (winstonsmith1897/GTPO" in md and "| ours: base |" in md
    calls = []

    def stopped_in_the_second(argv_):
        calls.append(argv_)
        return 0 if len(calls) == 1 else evaluate.STOPPED              # Ctrl-C during the second set
    evaluate_main, evaluate.main = evaluate.main, stopped_in_the_second
    try:
        capsys.readouterr()
        assert table1.main(argv) == evaluate.STOPPED
    finally:
        evaluate.main = evaluate_main
    assert capsys.readouterr().err.splitlines() == ["stopped (Ctrl-C) after 1 of 3 evaluations; the same command "
                                                    "again samples nothing for those and continues the next from its "
                                                    "last whole problem"]


@pytest.mark.needs_data
def test_fig4_panels_change_exactly_what_they_ablate():
    """study.fig4's commands parse as train.py parses them (every flag exists), each run changes against its panel's
    base exactly the settings it declares, and docs/study.md Part 9 lists every command as the module prints it."""
    from machinery.config import parse_args, record
    from conftest import HERE
    from study import fig4
    with open(os.path.join(HERE, "docs", "study.md")) as f:
        page = f.read()
    for panel, arms in fig4.PANELS.items():
        cmds = fig4.commands(panel)
        assert cmds[0][0] == arms[0][0] and arms[0][2] == set()
        base = record(parse_args(cmds[0][1][2:]))
        for (run, argv), (_, _, changes) in zip(cmds, arms):
            got = record(parse_args(argv[2:]))
            assert {k for k in base if base[k] != got[k]} - {"output_dir", "sources"} == changes, (panel, run)
            assert " ".join(argv) in page, (panel, run)
    assert len({" ".join(a) for p in fig4.PANELS for _, a in fig4.commands(p)}) == 17


def test_q10_arms_change_only_what_part_10_declares():
    """docs/study.md part 10: each seed's own warm-up (the committed command); where GRPO collapses, Q6's GTPO flags
    with the released term or Eq. 7 at gamma 0.01; where the model learns, Q7's GTPO flags at gamma 0.01 and Q7's
    GRPO flags again; the next step's gammas after every first-step run, each evaluated in its training's job."""
    from machinery.config import parse_args
    jobs = plan.part_jobs(plan.part("q10"))
    first = [j for j in jobs if not (plan.arm(j[0].rsplit("-s", 1)[0]).when)]
    assert jobs[:len(first)] == first and len(jobs) == len(first) + 5 * 8
    order = [j[0] for j in jobs]                        # a worker trains a run's warm-up before the run
    assert all(order.index(f"warmup-q10h-collapse-s{s}") < order.index(f"q10-collapse-g0.03-s{s}") for s in plan.Q6_SEEDS)
    assert [j[0] for j in first[:3]] == ["warmup-q10-learn-s1", "q10-learn-grpo-s1", "q10-learn-g0.01-s1"]
    for run_id, flags, seed, start, evals in jobs:
        name = run_id.rsplit("-s", 1)[0]
        if start is None:
            assert flags == plan.WARMUP_LONG and name in ("warmup-q10-learn", "warmup-q10-collapse",
                                                          "warmup-q10h-collapse")
            continue
        objective = parse_args([*flags, "--seed", str(seed)]).objective
        if "collapse" in name:
            warmup = "warmup-q10h-collapse" if name.endswith("g0.03") else "warmup-q10-collapse"   # the amendment
            assert seed in plan.Q6_SEEDS and start == f"{warmup}-s{seed}" and evals == ("rung",)
            assert flags[:len(plan.Q6_FLAGS["gtpo"])] == plan.Q6_FLAGS["gtpo"]
            want = ("released", 0.1) if name.endswith("released") else ("eq7", float(name.split("-g")[1]))
        else:
            assert seed in plan.Q7_SEEDS and start == f"warmup-q10-learn-s{seed}" and evals == plan.Q7_EVALS[0]
            if name == "q10-learn-grpo":
                assert flags == plan.Q7_GRPO
                continue
            assert flags[:len(plan.Q7_GTPO)] == plan.Q7_GTPO
            want = ("eq7", float(name.split("-g")[1]))
        assert (objective.entropy_term, objective.ent_gamma) == want, run_id
        assert objective.entropy_filter == "auto", run_id
    assert {plan.arm(n).when for n in ("q10-collapse-g0.001", "q10-learn-g0.001")} == {"0.001"}


def _q10_runs(folder, collapsed, id_pass1):
    """Hand-made Q10 runs: collapsed {arm: seeds that collapse (of Q6's 8)}; id_pass1 {arm: 8 ID pass@1 values}."""
    from study import q10
    calm = [{"step": k, "phase": "rl", "rewards/format": 9.5, "rewards/accuracy": 0.0, "entropy": 0.3,
             "grad_norm": 0.2} for k in range(1, 101)]
    broke = [dict(r, **({"rewards/format": 4.0, "entropy": 1.4} if r["step"] > 60 else {})) for r in calm]
    for name, bad in collapsed.items():
        for s in plan.Q6_SEEDS:
            d = folder / plan.arm(name).run_id(s)
            d.mkdir(exist_ok=True)
            (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (broke if s in bad else calm)))
            (d / "eval-rung.json").write_text(json.dumps({"pass@k": {"1": 0.0}, "format_rate": 0.5}))
    for name, values in id_pass1.items():
        for s, v in zip(plan.Q7_SEEDS, values):
            d = folder / f"{name}-s{s}"
            d.mkdir(exist_ok=True)
            (d / "metrics.jsonl").write_text("".join(json.dumps(dict(r, step=k)) + "\n" for k, r in
                                                     enumerate(calm * 2, 1)))
            for ev in ("id", "ood"):
                (d / f"eval-{ev}.json").write_text(json.dumps({"pass@k": {"1": v}, "format_rate": 1.0,
                                                               "mean_length": 40.0}))
    return q10


@pytest.mark.parametrize("c001, cost, step, head", [
    ((), 0.45, "stop", "use `--entropy_term eq7 --ent_gamma 0.01`"),        # protects (0 of 8), no drop
    ((), 0.30, "0.001", None),                                                 # protects and costs
    ((21, 22, 23, 24), 0.45, "0.03", None),                                    # no protection, no cost
    ((21, 22, 23, 24), 0.30, "stop", "no γ tried does both"),                  # costs and does not protect
    ((21,), [0.45] * 6 + [0.30] * 2, "0.03", None),                            # each p <= 0.05 alone, not with Holm
])
def test_q10_next_step_and_answer_follow_the_declared_rule(tmp_path, monkeypatch, c001, cost, step, head):
    """docs/study.md part 10: protection is Q6's Fisher test against Q6's GRPO (6 of 8 collapse), cost Q7's one-sided
    sign-flip test against GRPO from the same warm-ups, Holm over the default's and gamma 0.01's three tests; the
    rule's step, and what a user reads once the runs it needs are in."""
    committed_in(tmp_path, monkeypatch)
    grpo = {"q6-grpo": (21, 22, 23, 24, 25, 26), "q10-collapse-released": (21, 22, 23)}
    q10 = _q10_runs(tmp_path, grpo, {"q10-learn-grpo": [0.40] * 8})
    assert q10.next_step() is None and q10.answer().startswith("not finished")
    cost = cost if isinstance(cost, list) else [cost] * 8
    _q10_runs(tmp_path, {"q10-collapse-g0.01": c001}, {"q10-learn-g0.01": cost})
    assert q10.next_step() == step
    if head is None:
        assert q10.answer() == f"not finished: the rule's next step, γ {step}, is not all evaluated"
        assert not study.not_chosen(f"q10-learn-g{step}-s1") and study.not_chosen("q10-learn-g0.001-s1") == \
            (step != "0.001")
        return
    assert study.not_chosen("q10-learn-g0.001-s1") and study.not_chosen("q10-collapse-g0.03-s21")
    said = q10.answer()
    assert said.startswith(head + (" (it protects and no drop in ID pass@1 is detected) —" if "use" in head else " —"))
    default = said.split("; the default ")[1]                # 6 of 8 vs 3 of 8: one-sided Fisher p = 1800/11440
    assert default.startswith("(released term, γ 0.1) does not protect: it collapses in 3 of 8 seeds against GRPO's "
                              "6 (Holm p = ") and float(default[-6:-1]) >= round(1800 / 11440, 3)


def test_q10_holm_spans_the_whole_family_once_the_next_step_has_run(tmp_path, monkeypatch):
    """After the second step the verdicts are Holm-adjusted over all five tests; the rule's step was taken over the
    first three; the section shows the chosen step's tests and not the other's; the figure is drawn."""
    committed_in(tmp_path, monkeypatch)
    q10 = _q10_runs(tmp_path, {"q6-grpo": (21, 22, 23, 24, 25, 26), "q10-collapse-released": (21, 22, 23),
                               "q10-collapse-g0.01": (), "q10-collapse-g0.001": (21,)},
                    {"q10-learn-grpo": [0.40] * 8, "q10-learn-g0.01": [0.30] * 8, "q10-learn-g0.001": [0.41] * 8})
    assert q10.next_step() == "0.001"
    (_, _, rule, lines), = q10.q10_lines(plan.part("q10"))
    text = "\n".join(lines)
    # Fisher one-sided against GRPO's 6 of 8: 0 of 8 28/8008, 1 of 8 232/11440, 3 of 8 1800/11440; sign-flip 8 of 8
    # one way 1/256. Holm over the five: 5 x 28/8008 = 0.0175 for the three smallest, 2 x 232/11440, then 0.157
    assert rule.startswith("use `--entropy_term eq7 --ent_gamma 0.001` (it protects and no drop in ID pass@1 is "
                           "detected) — γ 0.001: collapses in 1 of 8 seeds against GRPO's 6 (Holm p = 0.041), ID pass@1 "
                           "+0.010 against GRPO (Holm p = 0.017); γ 0.01: collapses in 0 of 8 seeds against GRPO's 6 "
                           "(Holm p = 0.017), ID pass@1 -0.100 against GRPO (Holm p = 0.017); the default")
    assert "Eq. 7 γ 0.03" not in text and "- Eq. 7 γ 0.001 above GRPO: holds" in text
    assert "| Eq. 7, γ 0.001 | 1 of 8 | 0.000 / 50 | 0.410 (8) | 100 | 0.410 | Q10 / Q10 |" in text
    assert figures.plot_q10(str(tmp_path / "q10.png"), plan.part("q10")) and (tmp_path / "q10.png").stat().st_size


def test_paired_exact_test_hand_values_and_its_verdicts():
    """The exact McNemar test counts only the seeds where the two disagree: 6 GRPO-only, 0 arm-only, p = 1/64;
    9 against 1, p = 11/1024; seeds where both collapse or neither do not move it; a tie has no direction."""
    f = verdicts.paired_exact_one_sided
    assert f([(1, 0)] * 6 + [(0, 0)] * 2) == (pytest.approx(1 / 64), 6, 0)
    assert f([(1, 0)] * 9 + [(0, 1)] + [(1, 1)] * 6)[0] == pytest.approx(11 / 1024)
    assert f([(1, 0)] * 9 + [(0, 1)] + [(0, 0)] * 6)[0] == f([(1, 0)] * 9 + [(0, 1)])[0]
    assert f([(0, 1)] * 5 + [(1, 0)])[0] == pytest.approx(7 / 64)        # the observed direction: the arm's
    assert f([(1, 0), (0, 1), (1, 1)]) == (1.0, 1, 1)
    assert verdicts.verdict(1, 6 / 8, verdicts.holm([1 / 64, 0.2])[0]) == "holds"
    assert verdicts.verdict(1, 2 / 8, 0.25) == "same direction, within noise"


def test_q11_declares_fresh_seeds_paired_arms_with_q10s_flags_and_the_powered_number():
    """docs/study.md part 11: 16 fresh seeds (not Q6's 21-28, not the pilot's 11, none a committed run has), one
    warm-up per seed (Q6's command) that every arm of the seed starts from, the three arms with exactly the flags
    Q10 and Q6 ran, each evaluated on the rung in its training's job; the number is the power calculation's."""
    from machinery.config import parse_args
    from study import q11
    p = plan.part("q11")
    assert p.one_host and p.order == "seed" and len(plan.Q11_SEEDS) == 16
    used = {int(d.rsplit("-s", 1)[1]) for d in os.listdir(plan.KEEP)
            if d.rsplit("-s", 1)[-1].isdigit() and not d.startswith(("q11-", "warmup-q11-"))}
    assert not set(plan.Q11_SEEDS) & (used | set(plan.Q6_SEEDS) | {plan.PILOT_SEED})
    jobs = plan.part_jobs(p)
    assert len(jobs) == 16 * 4 and [j[0] for j in jobs[:4]] == ["warmup-q11-s31", "q11-grpo-s31",
                                                                "q11-released-s31", "q11-eq7-s31"]
    same = {"q11-grpo": "q6-grpo", "q11-released": "q10-collapse-released", "q11-eq7": "q10-collapse-g0.03"}
    for run_id, flags, seed, start, evals in jobs:
        name = run_id.rsplit("-s", 1)[0]
        if start is None:
            assert flags == plan.WARMUP_LONG and name == "warmup-q11"
            continue
        assert start == f"warmup-q11-s{seed}" and evals == ("rung",) and flags == plan.arm(same[name]).flags
    o = {n: parse_args([*plan.arm(n).flags, "--seed", "31"]).objective for n in ("q11-released", "q11-eq7")}
    assert (o["q11-released"].entropy_term, o["q11-released"].ent_gamma) == ("released", 0.1)
    assert (o["q11-eq7"].entropy_term, o["q11-eq7"].ent_gamma) == ("eq7", 0.03)
    assert [t.test for t in p.tests] == ["paired exact"] * 2 and {t.holm for t in p.tests} == {"q11"}
    # the power at Q10's rates: the default's test stays under 0.8 at Holm's first level even at the cap
    assert q11.power(16, 0.75, 0.25, 0.025) == pytest.approx(0.702, abs=5e-4)
    assert q11.power(16, 0.75, 0.25, 0.05) == pytest.approx(0.800, abs=5e-4)
    assert q11.power(16, 0.75, 0.125, 0.025) == pytest.approx(0.926, abs=5e-4)
    assert q11.seeds_needed() == 16 and q11.seeds_needed(dict(q11.Q10_RATES, released=0.0)) == 9
    assert q11.default_rule(True, False) == "change" and q11.default_rule(True, True) == "keep, both"
    assert q11.default_rule(False, True) == "keep, withdraw" and q11.default_rule(False, False) == "keep, unconfirmed"


def test_a_one_host_part_trains_nothing_on_another_host(tmp_path, monkeypatch):
    """Part 11 runs on one host kind: once any of its runs has a committed host (host.json or an attempt in
    times.json), another host stops before training any of its jobs, naming both (and, where only the packages
    differ, the pip install that makes it the part's kind); the same host trains; a part without the declaration
    is not held."""
    committed_in(tmp_path, monkeypatch)
    monkeypatch.setattr(study, "WORK", str(tmp_path / "work"))
    monkeypatch.setattr(study, "wait_for", lambda path: path)
    here, there = "AMD EPYC family 25 model 17; torch 2.13.0 peft 0.21.2", "Intel Xeon family 6 model 207; torch 2.13.0"
    monkeypatch.setattr(study, "host", lambda: here)
    study.check_part_host("q11-eq7-s40")                                  # nothing committed yet: any host
    study.record_time("warmup-q11-s31", "train", 300.0, False, (0, 2))    # an unfinished attempt counts
    monkeypatch.setattr(study, "host", lambda: there)
    monkeypatch.setattr(study, "attempt", lambda *a: pytest.fail("trained on another host kind"))
    with pytest.raises(SystemExit, match=r"one host kind \(AMD EPYC family 25 model 17.*Intel.*another kind\)$"):
        study.train("q11-grpo-s46", [], 46, "warmup-q11-s46", (0, 2), 1)
    study.check_part_host("q10-collapse-released-s21")                     # not a one-host part
    monkeypatch.setattr(study, "host", lambda: "AMD EPYC family 25 model 17; torch 2.13.0 peft 0.22.0")
    with pytest.raises(SystemExit, match=r"processor is the part's: pip install peft==0\.21\.2, then run again$"):
        study.check_part_host("q11-grpo-s46")                               # packages differ: say which to install
    monkeypatch.setattr(study, "host", lambda: here)
    calls = []
    out = tmp_path / "work" / "q11-grpo-s46"
    monkeypatch.setattr(study, "attempt", lambda *a: calls.append(a) or (out / "final").mkdir())
    study.train("q11-grpo-s46", [], 46, "warmup-q11-s46", (0, 2), 1)
    assert len(calls) == 1


def _q11_runs(folder, grpo, released, eq7, seeds=None):
    """Hand-made Q11 runs: for each arm the seeds (of Q11's) that collapse; every run evaluated on the rung."""
    calm = [{"step": k, "phase": "rl", "rewards/format": 9.5, "rewards/accuracy": 0.0, "entropy": 0.3,
             "grad_norm": 0.2} for k in range(1, 101)]
    broke = [dict(r, **({"rewards/format": 4.0, "entropy": 1.4} if r["step"] > 60 else {})) for r in calm]
    for name, bad in (("q11-grpo", grpo), ("q11-released", released), ("q11-eq7", eq7)):
        for s in seeds or plan.Q11_SEEDS:
            d = folder / f"{name}-s{s}"
            d.mkdir()
            (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (broke if s in bad else calm)))
            (d / "config.json").write_text(json.dumps({"h_ini": 0.41, "entropy_filter_applied": "all"}))
            (d / "eval-rung.json").write_text(json.dumps({"pass@k": {"1": 0.0}, "format_rate": 0.5}))


@pytest.mark.parametrize("grpo, released, eq7, rule", [
    (range(31, 43), (), (), "keep, both"),                # GRPO 12 of 16, both arms 0: both protect
    (range(31, 43), range(31, 43), (), "change"),         # γ 0.03 protects, the default collapses with GRPO
    (range(31, 43), (), range(31, 43), "keep, withdraw"),
    (range(31, 35), range(31, 35), range(31, 35), "keep, unconfirmed"),
])
def test_q11_verdicts_are_paired_with_holm_and_apply_the_declared_default_rule(tmp_path, monkeypatch, grpo,
                                                                                released, eq7, rule):
    """docs/study.md part 11 on hand-made runs: the paired exact test counts the seeds where GRPO and the arm disagree,
    Holm over the two; the answer names the rule's outcome for the default; the section gives Fisher's unpaired p
    beside; the figure is drawn once a seed has its three runs."""
    from study import q11
    committed_in(tmp_path, monkeypatch)
    _q11_runs(tmp_path, set(grpo), set(released), set(eq7))
    eq7_row, released_row = q11.verdicts()
    assert eq7_row["units"] == released_row["units"] == 16
    assert eq7_row["discordant"] == [len(set(grpo) - set(eq7)), len(set(eq7) - set(grpo))]
    assert q11.default_rule(eq7_row["verdict"] == "holds", released_row["verdict"] == "holds") == rule
    said = q11.answer()
    assert said.startswith(q11.FOLLOWS[rule]) and f"{len(set(eq7))} of 16 seeds" in said
    section = q11.q11_lines(plan.part("q11"))[0]
    assert section[2] == said and any("Fisher's one-sided p" in line for line in section[3])
    assert q11.plot_q11(str(tmp_path / "q11.png"), plan.part("q11")) and (tmp_path / "q11.png").is_file()


def test_q11_is_not_finished_until_every_seed_has_its_three_runs(tmp_path, monkeypatch):
    from study import q11
    committed_in(tmp_path, monkeypatch)
    _q11_runs(tmp_path, {31, 32}, set(), set(), seeds=(31, 32, 33))
    assert q11.verdicts() is None and q11.answer() == "not finished: 3 of 16 seeds have all three runs evaluated"
    assert "collapses 2 of 3" in q11.q11_outcome(None)
