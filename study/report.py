"""The study's report: every table, verdict and figure of docs/results.md, computed from the parts of
study/plan.py and the committed files in study/runs/ alone (docs/study.md declares the tests and rules).

    python -m study.report                # = python -m study.run --report

One concern, the layout of the results: the answers table (a row per study.answers.ANSWERS entry) opens summary.md; a
test (plan.Test) gives paired units, a p and a verdict (study/verdicts.py); the questions table gathers the
parts' questions; each part with a section adds it (its own table where its cells are its own); the cost line
sums each part's attempts.
"""
import dataclasses
import os
import statistics

from machinery import runs
from study.answers import ANSWERS
from study.cells import curve_cells, fingerprint, h_ini_of, kl_cell, seed_table
from study.plan import (COLLAPSE_WINDOW, KEEP, LADDER, METHODS, PARTS, PILOT_SEED, Q9_ARMS, STUDY, TEST_SEEDS, arm,
                        collapse_step, load, part, part_jobs)
from study.q10 import q10_lines, q10_outcome    # noqa: F401 -- found by name (Part.section, Answer.outcome)
from study.q11 import q11_lines, q11_outcome    # noqa: F401 -- found by name (Part.section, Answer.outcome)
from study.verdicts import pass1, runs_of, sentence, sign_flip_p, solvable, test_row, test_rows, train_accuracy


def question_rows():
    """Every part's questions, in PARTS' order: units, mean, run-level p, problem-level CI, verdict."""
    return [{k: v for k, v in r.items() if k != "expected"} for p in PARTS for r in test_rows(p, p.questions, True)]


def question_lines(rows):
    head = ["Q", "the paper's claim", "A − B", "metric", "paired runs", "A − B per run", "mean", "run-level p (min)",
            "problem-level 95 % CI", "verdict"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if not r["units"]:
            lines.append(f"| {r['q']} | {r['claim']} | | {r['metric']} | 0 | | | | | not run yet |")
            continue
        digits = 1 if "%" in r["metric"] else 3
        ci = "–" if r["ci"] is None else f"{r['ci'][0]:+.3f} … {r['ci'][1]:+.3f}"
        lines.append(f"| {r['q']} | {r['claim']} | {r['contrast']} | {r['metric']} | {r['units']} | "
                     f"{' '.join(f'{v:+.{digits}f}' for v in r['values'])} | {r['mean']:+.{digits}f} | "
                     f"{r['p']:.3f} ({r['min_p']:.3f}) | {ci} | {r['verdict']} |")
    return lines


# -----------------------------------------------------------------------------
# the parts' sections: each gives [(summary.json key, heading, verdict or rule, lines)]

def per_seed_lines(p, rows=None):
    """A row per seed and run (CELLS[p.cells] after seed and label) on the seeds the part has trained a run of,
    the runs it reads from other parts beside its own; then the part's verdicts: in the heading when it has one
    test, else a line each below the table."""
    lines = seed_table(p, p.arm_list(), p.cells)
    rows = rows or test_rows(p, p.tests)
    if len(p.tests) == 1:
        return [(p.key, p.title, sentence(p.tests[0], rows[0]), lines)]
    rule = "; ".join(f"{t.claim}: {r.get('verdict', 'not run') if r['units'] == r['expected'] else 'not finished'}"
                     for t, r in zip(p.tests, rows) if t.holm)
    return [(p.key, p.title, rule, lines + [""] + [f"- {t.claim}: {sentence(t, r)}" for t, r in zip(p.tests, rows)])]


def q8_lines(p):
    """Q8's table and verdicts (per_seed_lines), and the declared rule's choice of the default entropy term."""
    rows = test_rows(p, p.tests)
    (key, title, rule, lines), = per_seed_lines(p, rows)
    term, why = default_term(p, rows)
    return [(key, title, rule, lines + ["", f"Default entropy term by part 7's rule: `{term}` ({why})"])]


def q9_lines(p):
    """Q9: per seed, the warm-up's ID and OOD pass@1 (its fingerprint against Q7's warm-up, and its ID formatting
    share) and each arm's final value minus it; then the verdicts, Holm within each set."""
    rows = test_rows(p, p.tests)
    names = [n for n, _ in Q9_ARMS]
    lines = ["| seed | warm-up = Q7's (fingerprint) | warm-up ID pass@1 (format %) | warm-up OOD pass@1 | "
             + " | ".join(f"{arm(n, p).label}: ID (OOD) final − warm-up" for n in names) + " |",
             "|" + "---|" * (4 + len(names))]
    for s in arm("warmup-q9", p).seeds:
        w = load(f"warmup-q9-s{s}")
        if w is None or "ood" not in w["evals"]:
            continue
        same = fingerprint(f"warmup-q9-s{s}") == fingerprint(f"warmup-q7-s{s}")
        cells = []
        for n in names:
            d = load(arm(n, p).run_id(s))
            cells.append("–" if not d or "ood" not in d["evals"] else
                         f"{pass1(d, 'id')[0] - pass1(w, 'id')[0]:+.3f} ({pass1(d, 'ood')[0] - pass1(w, 'ood')[0]:+.3f})")
        lines.append(f"| {s} | {'equal' if same else 'differs: paired by recipe and seed'} | "
                     f"{pass1(w, 'id')[0]:.3f} ({100 * w['evals']['id']['format_rate']:.0f}) | "
                     f"{pass1(w, 'ood')[0]:.3f} | " + " | ".join(cells) + " |")
    def said(t, r):
        return f"{t.names[0]} {r.get('verdict', 'not run') if r['units'] == r['expected'] else 'not finished'}"
    rule = "; ".join(f"{m.upper()}: " + ", ".join(said(t, r) for t, r in zip(p.tests, rows) if t.metric == m)
                     for m in ("id", "ood"))
    return [(p.key, p.title, rule, lines + [""] + [f"- {t.claim} ({t.metric.upper()}): {sentence(t, r)}"
                                                   for t, r in zip(p.tests, rows)])]


def default_term(p, rows=None):
    """docs/study.md part 7: `released` if released - Eq. 7 is positive with two-sided p <= 0.05 and released is
    not contradicted against GRPO; else `eq7` -> (term, why). Until every test has all its seeds: eq7, not
    decided."""
    rows = {t.claim: r for t, r in zip(p.tests, rows or test_rows(p, p.tests))}
    vs_eq7, vs_grpo = rows["released − Eq. 7"], rows["released − GRPO"]
    if any(r["units"] < r["expected"] for r in rows.values()) or not vs_eq7["units"]:
        return "eq7", "not decided: the runs are not all evaluated"
    better = vs_eq7["mean"] > 0 and vs_eq7["p"] <= 0.05
    if better and vs_grpo["verdict"] != "contradicted":
        return "released", f"released − Eq. 7 {vs_eq7['mean']:+.3f}, p = {vs_eq7['p']:.3f}; against GRPO " \
                           f"{vs_grpo['verdict']}"
    return "eq7", (f"released − Eq. 7 {vs_eq7['mean']:+.3f}, two-sided p = {vs_eq7['p']:.3f}" +
                   ("; released is contradicted against GRPO" if better else ""))


def collapse_lines(p):
    """Q4: per long run, <H>_ini, first and last formatting / entropy, its collapse step and its
    KL to the start (drift); the rule once the four runs have 20 steps."""
    lines = ["| run | <H>_ini of its start | format % first 10 → last 10 | entropy first 10 → last 10 | "
             "collapse step | KL to the start at its last checkpoint |", "|---|---|---|---|---|---|"]
    found = {}
    gtpo = arm("gtpo-long", p)
    gtpo_runs = {s: load(gtpo.run_id(s)) for s in gtpo.seeds}                     # they log <H>_ini
    for a in runs_of(p):
        d = load(a[0].run_id(a[1]))
        if d is None or len(d["rl"]) < 2 * COLLAPSE_WINDOW:
            continue
        (name, label), s, rows, w = (a[0].name, a[0].label), a[1], d["rl"], COLLAPSE_WINDOW
        fmt, ent = [10 * r["rewards/format"] for r in rows], [r["entropy"] for r in rows]
        found[(name, s)] = collapse_step(rows)
        h = gtpo_runs[s] and gtpo_runs[s]["config.json"].get("h_ini")
        lines.append(f"| {label}, seed {s} | {h:.3f} |" if h is not None else f"| {label}, seed {s} | – |")
        lines[-1] += (f" {statistics.fmean(fmt[:w]):.1f} → {statistics.fmean(fmt[-w:]):.1f} | "
                      f"{statistics.fmean(ent[:w]):.3f} → {statistics.fmean(ent[-w:]):.3f} | "
                      f"{found[(name, s)] or 'none'} | {kl_cell(d)} |")
    if len(found) < 4:
        return [("collapse", p.title, "not finished", lines)]
    g = [found[("gtpo-long", s)] for s in (1, 2)]
    r = [found[("grpo-long", s)] for s in (1, 2)]
    rule = ("holds (GRPO collapses in both seeds, GTPO in neither)" if all(r) and not any(g) else
            "not observed (no run collapses within 200 steps)" if not any(r + g) else
            "contradicted (GTPO collapses in both seeds, GRPO in neither)" if all(g) and not any(r) else
            "mixed (see the table)")
    return [("collapse", p.title, rule, lines)]


def conflict_lines(p):
    """Q5: the share of conflict-token positions that are format tokens, per RL run of the main part,
    beside the share of format tokens among all completion tokens."""
    lines = ["| run | seeds | format share of conflict positions | format share of all tokens | conflict positions / "
             "tokens |", "|---|---|---|---|---|"]
    shares = []
    for a in (arm(n) for n in ("gtpo-a6", "gtpo-a9", "grpo-a6", "grpo-a9")):
        cs = [d["conflicts.json"] for d in (load(a.run_id(s)) for s in a.seeds) if d and "conflicts.json" in d]
        if not cs:
            continue
        share = [c["format_share"] for c in cs]
        shares += share
        base = [c["format_share_of_tokens"] for c in cs if "format_share_of_tokens" in c]
        lines.append(f"| {a.label} | {len(cs)} | {' '.join(f'{x:.2f}' for x in share)} | "
                     f"{' '.join(f'{x:.2f}' for x in base) or '–'} | "
                     f"{' '.join(format(c['conflict_share'], '.3f') for c in cs)} |")
    rule = ("not finished" if not shares else "holds (format tokens are the majority in every run)"
            if min(shares) > 0.5 else "does not hold (a minority in every run)" if max(shares) <= 0.5 else
            "mixed (the majority in some runs only)")
    return [("conflicts", p.title, rule, lines)]


def collapse_part_lines(p):
    """Part 3: the pilot ladder (ladder_lines), then the test at the chosen rung (collapse_test_lines)."""
    ladder, rule = ladder_lines()
    return [("ladder", "Collapse part, pilot ladder", rule, ladder), ("collapse_test", "Collapse part, the test",
                                                                      *collapse_test_lines(p))]


def ladder_lines():
    """The pilot: per rung and method, the curves' summary and the collapse step; the chosen rung."""
    lines = ["| rung | task | lr | method | <H>_ini | entropy (trailing 10): first → max → last | "
             "format % (trailing 10): first → min → last | accuracy % (last 10) | collapse step |",
             "|---|---|---|---|---|---|---|---|---|"]
    chosen = pending = None
    for name, task, lr in LADDER:
        for method in ("grpo", "gtpo"):
            d = load(f"pilot-{name}-{method}-s{PILOT_SEED}")
            if d is None or len(d["rl"]) < COLLAPSE_WINDOW:
                pending = pending or (chosen is None and method == "grpo")
                continue
            lines.append(f"| {name} | {task} | {lr} | {METHODS[method]} | {h_ini_of(d)} | " + curve_cells(d))
            if method == "grpo" and chosen is None and collapse_step(d["rl"], d.get("diverged.json")):
                chosen = name
        if chosen:
            break
    rule = (f"test at {chosen} (the first rung whose GRPO run collapses)" if chosen else
            "pilot not finished" if pending else "not testable here (no rung collapses GRPO)")
    return lines, rule


def filtered_entropy(rl_rows):
    """Mean <H>_i of the completions delta_i removed over a run (each step's mean weighted by its share
    filtered), or None when none was or the run's metrics predate gtpo/filtered_entropy."""
    rows = [r for r in rl_rows if "gtpo/filtered_entropy" in r]
    weight = sum(r["gtpo/filtered_frac"] for r in rows)
    if not rows or len(rows) < len(rl_rows) or weight == 0:
        return None
    return sum(r["gtpo/filtered_frac"] * r["gtpo/filtered_entropy"] for r in rows) / weight


def collapse_test_lines(p):
    """The test: per seed, each method's collapse step and ID pass@1 (final; last checkpoint before the
    collapse); the verdict (the part's Fisher test) once every run has finished; the secondary pass@1
    comparison (sign-flip p); then each run's curves (test_curve_lines) -> (verdict, lines)."""
    lines = ["| seed | <H>_ini | GRPO collapse step | GTPO collapse step | GTPO filtered % | GTPO <H>_i of the "
             "filtered | ID pass@1 final GRPO / GTPO | ID pass@1 before the collapse GRPO / GTPO |",
             "|---|---|---|---|---|---|---|---|"]
    diffs = []
    cell = lambda x: "–" if x is None else f"{x:.3f}"                            # noqa: E731
    for s in TEST_SEEDS:
        d = {m: load(f"collapse-{m}-s{s}") for m in ("grpo", "gtpo")}
        if any(v is None for v in d.values()):
            continue
        step = {m: collapse_step(v["rl"], v.get("diverged.json")) for m, v in d.items()}
        final = {m: pass1(v, "rung")[0] for m, v in d.items()}
        before = {m: pass1(v, "rung-precollapse")[0] for m, v in d.items()}
        if None not in final.values():
            diffs.append(final["gtpo"] - final["grpo"])
        filt = statistics.fmean(r.get("gtpo/filtered_frac", 0.0) for r in d["gtpo"]["rl"])
        lines.append(f"| {s} | {h_ini_of(d['gtpo'])} | {step['grpo'] or 'none'} | {step['gtpo'] or 'none'} | "
                     f"{100 * filt:.1f} | {cell(filtered_entropy(d['gtpo']['rl']))} | "
                     f"{cell(final['grpo'])} / {cell(final['gtpo'])} | "
                     f"{cell(before['grpo'])} / {cell(before['gtpo'])} |")
    rule = sentence(p.tests[0], test_rows(p, p.tests)[0])
    if diffs and not rule.startswith("not finished"):
        lines += ["", f"ID pass@1 final, GTPO − GRPO per seed {' '.join(f'{x:+.3f}' for x in diffs)}, mean "
                      f"{statistics.fmean(diffs):+.3f}, sign-flip p {sign_flip_p(diffs):.3f}"]
    return rule, lines + ["", "Each test run's curves (described; the rule above decides what counts as a collapse):",
                          ""] + test_curve_lines()


def test_curve_lines():
    """The test's runs one by one, described as the pilot's are (curve_cells): how each run ends,
    beside the rule's collapse step and its drift from the start (kl_cell)."""
    lines = ["| seed | method | entropy (trailing 10): first → max → last | format % (trailing 10): first → min → "
             "last | accuracy % (last 10) | collapse step | KL to the start at its last checkpoint |",
             "|---|---|---|---|---|---|---|"]
    for s in TEST_SEEDS:
        lines += [f"| {s} | {METHODS[m]} | " + curve_cells(d) + f" {kl_cell(d)} |" for m in ("grpo", "gtpo")
                  for d in [load(f"collapse-{m}-s{s}")] if d is not None and len(d["rl"]) >= COLLAPSE_WINDOW]
    return lines


# -----------------------------------------------------------------------------
# the answers: docs/results.md's opening table, a row per question

def answer_lines():
    """A row per study.answers.ANSWERS entry: the claim and setting as declared, the verdict (its test's sentence without
    the test's name, with its p; or the part's section rule) and what a user sees (answer.outcome)."""
    lines = ["| Q | the paper's claim | setting | verdict | what a user sees |", "|---|---|---|---|---|"]
    for a in ANSWERS:
        lines.append(f"| {a.q} | {a.claim} | {a.setting} | {answer_verdict(a)} | {globals()[a.outcome](a)} |")
    return lines


def answer_verdict(a):
    p = part(a.part)
    if isinstance(a.verdict, str):
        return next(rule for key, _, rule, _ in globals()[p.section](p) if key == a.verdict)
    asked = any(t.label == a.verdict[0] for t in p.tests)
    own = [dataclasses.replace(t, names=a.names) if a.names and (t.label, t.claim, t.metric) == a.verdict else t
           for t in (p.tests if asked else p.questions)]
    (t,) = [t for t in own if (t.label, t.claim, t.metric) == a.verdict]
    r = test_rows(p, own)[own.index(t)] if t.holm else test_row(t, p, with_ci=not asked)   # CI: as question_rows
    words = sentence(t, r).split("; exact")[0].split("; Fisher")[0]
    return f"{words} (p = {r.get('p_holm', r.get('p', 1.0)):.3f}{', Holm' if 'p_holm' in r else ''})" \
        if "p" in r else words


def pass1_outcome(a):
    """Each arm's mean pass@1 on a.evals over its evaluated seeds, with the share of its samples in the format."""
    cells = []
    for owner in filter(None, map(arm, a.arms)):                                  # arms the plan trains so far
        ev = [d["evals"][a.evals] for d in (load(owner.run_id(s)) for s in owner.seeds) if d and a.evals in d["evals"]]
        if ev:
            fmt = [e["format_rate"] for e in ev if "format_rate" in e]
            cells.append(f"{owner.label}: {statistics.fmean(e['pass@k']['1'] for e in ev):.3f}"
                         + (f", {100 * statistics.fmean(fmt):.0f} % formatted" if fmt else ""))
    what = {"id": "ID pass@1", "rung": "pass@1 on the rung's task"}[a.evals]
    return f"{what} (mean of seeds) — " + "; ".join(cells) if cells else "not run"


def gain_outcome(a):
    """Q9: the warm-up's mean ID (OOD) pass@1 over its evaluated seeds, then each arm's over the same seeds."""
    warm = arm(a.arms[0])
    seeds = [s for s in warm.seeds if (d := load(warm.run_id(s))) and "ood" in d["evals"]]
    if not seeds:
        return "not run"

    def mean(owner, s_):
        ds = [load(owner.run_id(s)) for s in seeds]
        return statistics.fmean(pass1(d, s_)[0] for d in ds)
    cells = [f"{arm(n).label} {mean(arm(n), 'id'):.3f} ({mean(arm(n), 'ood'):.3f})" for n in a.arms[1:]]
    return (f"ID (OOD) pass@1, mean of {len(seeds)} seeds — warm-up {mean(warm, 'id'):.3f} "
            f"({mean(warm, 'ood'):.3f}) → " + "; ".join(cells))


def conflict_outcome(a):
    """The share of format tokens among the conflict positions of the main part's runs, beside their share of all
    completion tokens (conflict_lines' numbers)."""
    cs = [d["conflicts.json"] for owner in map(arm, ("gtpo-a6", "gtpo-a9", "grpo-a6", "grpo-a9"))
          for d in (load(owner.run_id(s)) for s in owner.seeds) if d and "conflicts.json" in d]
    if not cs:
        return "not run"
    share, base = [c["format_share"] for c in cs], [c["format_share_of_tokens"] for c in cs]
    return (f"format tokens are {100 * min(share):.0f}–{100 * max(share):.0f} % of conflict positions, "
            f"{100 * min(base):.0f}–{100 * max(base):.0f} % of all tokens")


# -----------------------------------------------------------------------------
# the configurations, the cost, the summary

def mean_std(xs):
    """(mean, sample std, n) of the values present, or None."""
    xs = [x for x in xs if x is not None]
    return (statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0, len(xs)) if xs else None


def summary_lines():
    """Per configuration of the main and long parts: mean ± std over its finished seeds of the training and
    evaluation columns."""
    ood = solvable()
    cols = [("format % (last 5)", lambda d: 10 * statistics.fmean(r["rewards/format"] for r in d["rl"][-5:])
             if d["rl"] else None),
            ("training accuracy %", train_accuracy),
            ("entropy (last 5)", lambda d: statistics.fmean(r["entropy"] for r in d["rl"][-5:]) if d["rl"] else None),
            ("ID pass@1", lambda d: pass1(d, "id")[0]), ("ID pass@8", lambda d: d["evals"].get("id", {})
                                                          .get("pass@k", {}).get("8")),
            ("ID maj@8", lambda d: d["evals"].get("id", {}).get("maj@k", {}).get("8")),
            (f"OOD pass@1 ({len(ood)} solvable)", lambda d: pass1(d, "ood", ood)[0]),
            ("OOD pass@1 (all 48)", lambda d: pass1(d, "ood")[0]),
            ("ID pass@1 best ckpt", lambda d: pass1(d, "id-best")[0]),
            ("train min/run", lambda d: sum(map(worked, d.get("times.json", {}).get("train", []))) / 60 or None)]
    head = ["config", "seeds"] + [c for c, _ in cols]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for a in part("main").arm_list() + [a for a in part("long").arm_list() if a.start]:
        data = [d for d in (load(a.run_id(s)) for s in a.seeds) if d is not None]
        cells = []
        for label, f in cols:
            v = mean_std([f(d) for d in data if d["rl"] or "%" not in label and "entropy" not in label])
            digits = 1 if "%" in label or "min" in label else 3
            cells.append("–" if v is None else f"{v[0]:.{digits}f} ± {v[1]:.{digits}f}" + ("" if v[2] == len(data)
                                                                                          else f" (n={v[2]})"))
        lines.append(f"| {a.label} | {len(data)}/{len(a.seeds)} | " + " | ".join(cells) + " |")
    return lines


def worked(attempt):
    """An attempt's seconds of work: its wall time less paused_seconds, where the workers were stopped
    (SIGSTOP) for other work."""
    return attempt["seconds"] - attempt.get("paused_seconds", 0)


def attempts(run_id):
    """Every attempt of a run's jobs in its times.json (not load(): a run stopped before it finished has
    attempts too)."""
    path = os.path.join(KEEP, run_id, "times.json")
    return [t for ts in runs.read_json(path).values() for t in ts] if os.path.isfile(path) else []


def cost_hours(name):
    """Worker-hours spent (every attempt, worked()) by the parts whose cost is `name`: each run counts for the
    first part that trains it, and a warm-up that a part with `since` starts from but another part trained
    counts for the later part from that date on (it trained it again)."""
    owner, again = {}, {}
    for p in PARTS:
        for run_id, *_ in part_jobs(p):
            owner.setdefault(run_id, p)
    for p in PARTS:
        for start in {job[3] for job in part_jobs(p) if p.since and job[3] and owner.get(job[3]) is not p}:
            again[start] = p                            # and before `since`, the part that declares its arm
            owner.setdefault(start, next(q for q in PARTS if arm(start.rsplit("-s", 1)[0], q) in q.arm_list()))
    def payer(run_id, attempt):
        late = run_id in again and attempt.get("date", "") >= again[run_id].since
        return again[run_id] if late else owner[run_id]
    return sum(worked(t) for run_id in owner for t in attempts(run_id) if payer(run_id, t).cost == name) / 3600


def write_summary():
    rows = question_rows()
    sections = [s for p in PARTS if p.section for s in globals()[p.section](p)]
    lines = ["## Answers (docs/results.md opens with this table)", ""] + answer_lines() + [
        "", "## Questions, tests, verdicts (docs/study.md declares them)", ""] + question_lines(rows) + [
        "", "run-level p: exact two-sided sign-flip test over the paired runs (its smallest possible value in "
        "brackets); problem-level CI: the problems resampled, the runs fixed."]
    for _, title, rule, body in sections:
        lines += ["", f"## {title} — {rule}", ""] + body
    names = list(dict.fromkeys(p.cost for p in PARTS if p.cost))
    cost = "; ".join(f"{n} {cost_hours(n):.2f}" for n in names)
    lines += ["", "## Configurations (mean ± sample std over the finished seeds)", ""] + summary_lines() + [
        "", f"Worker-hours (every attempt, both workers summed): {cost}"]
    runs.write_text(os.path.join(STUDY, "summary.md"), "\n".join(lines) + "\n")
    write_results_table(answer_lines())
    runs.write_json(os.path.join(STUDY, "summary.json"), {"questions": rows, **{k: r for k, _, r, _ in sections}})
    print("\n".join(lines))


def write_results_table(table):
    """docs/results.md opens with the answers table: replace it there (its header line to the first blank line),
    the rest of the page untouched; a study folder outside a checkout (a test's) has no results.md to keep."""
    path = os.path.join(os.path.dirname(STUDY), "docs", "results.md")
    if not os.path.exists(path):
        return
    with open(path) as f:
        lines = f.read().splitlines()
    start = lines.index(table[0])
    end = lines.index("", start)
    runs.write_text(path, "\n".join(lines[:start] + table + lines[end:]) + "\n")


def report():
    from study import figures                           # matplotlib: only where figures are drawn
    write_summary()
    for p in PARTS:
        for name, plot, kwargs in p.figures:
            done = getattr(figures, plot)(os.path.join(STUDY, name), p, **kwargs)
            print(f"{STUDY}/{name}: {'written' if done else 'not yet (no seed has every run of the figure)'}")


if __name__ == "__main__":
    report()
