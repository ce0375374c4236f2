"""The study's report: every table, verdict and figure of docs/results.md, computed from the parts of
study/plan.py and the committed files in study/runs/ alone (docs/study.md declares the tests and rules).

    python -m study.report                # = python -m study.run --report

One path serves every part: a test (plan.Test) gives paired units, a p (sign-flip one- or two-sided, or
Fisher's exact test; Holm where a part declares it) and a verdict (verdict()); the questions table gathers the
parts' questions; each part with a section adds it (its own table where its cells are its own); the cost line
sums each part's attempts.
"""
import math
import os
import random
import statistics

import runs
from study.plan import (COLLAPSE_WINDOW, KEEP, LADDER, METHODS, N_SAMPLES, PARTS, PILOT_SEED, STUDY,
                        TEST_SEEDS, arm, collapse_step, load, part, part_jobs, trailing)

def train_accuracy(d):
    """Mean accuracy reward over the run's RL steps, as % of its 10 points."""
    vals = [r["rewards/accuracy"] for r in d["rl"] if "rewards/accuracy" in r]
    return 10.0 * statistics.fmean(vals) if vals else None


def pass1(d, s, subset=None):
    """(pass@1 on eval set s, per-problem correct counts or None); subset: problem indices."""
    e = d["evals"].get(s)
    if e is None:
        return None, None
    c = e.get("per_problem_correct")
    if subset is None:
        return e["pass@k"]["1"], c
    if not subset or c is None:
        return None, None
    c = [c[p] for p in subset]
    return statistics.fmean(x / N_SAMPLES for x in c), c


def runs_of(p):
    """The part's trained runs (warm-ups aside), as (arm, seed)."""
    return [(a, s) for a in p.arm_list() if a.start for s in a.seeds]


def solvable(s="ood"):
    """Problems of set s with >= 1 correct sample in any finished run of the main part, pooled over runs
    and seeds (blind to which method solved it)."""
    solved = set()
    for a, seed in runs_of(part("main")):
        d = load(a.run_id(seed))
        c = d and d["evals"].get(s, {}).get("per_problem_correct")
        solved |= {p for p, x in enumerate(c or []) if x > 0}
    return sorted(solved)


def collapsed(d):
    """1 if the run collapsed (collapse_step), else 0; None while it has fewer than COLLAPSE_WINDOW RL steps."""
    if len(d["rl"]) < COLLAPSE_WINDOW:
        return None, None
    return float(collapse_step(d["rl"], d.get("diverged.json")) is not None), None


def metrics():
    """plan.Test's metric names -> (words, a run's committed files -> (value, per-problem counts or None))."""
    ood = solvable()
    return {"id": ("ID pass@1", lambda d: pass1(d, "id")), "id-final": ("ID pass@1, final", lambda d: pass1(d, "id")),
            "id-best": ("ID pass@1, best", lambda d: pass1(d, "id-best")),
            "ood-solvable": (f"OOD pass@1, {len(ood)} solvable", lambda d: pass1(d, "ood", ood)),
            "train": ("training accuracy %", lambda d: (train_accuracy(d), None)),
            "id16": ("ID pass@1 (16)", lambda d: pass1(d, "id")),
            "ood16": ("OOD pass@1 (16)", lambda d: pass1(d, "ood")),
            "collapsed": ("collapses", collapsed)}


# -----------------------------------------------------------------------------
# the tests and the verdict rule

def sign_flip_p(diffs, sided=2):
    """Exact sign-flip permutation p of mean(diffs) over paired units, all 2^m sign patterns (a zero difference
    flips to itself). sided=2: the share whose |sum| is at least the observed |sum|; sided=1: the share whose sum
    reaches the observed one in its own direction (1 when it is 0: no direction)."""
    obs, m = sum(diffs), len(diffs)
    if sided == 1 and obs == 0:
        return 1.0
    way = 1 if obs > 0 else -1
    sums = [sum(d if mask >> i & 1 else -d for i, d in enumerate(diffs)) for mask in range(2 ** m)]
    hits = sum((abs(s) if sided == 2 else way * s) >= abs(obs) - 1e-12 for s in sums)
    return hits / 2 ** m


def fisher_one_sided(a, n_a, b, n_b):
    """Fisher's exact test, one-sided: P(A's count >= a) given the margins of the 2 x 2 table
    (a of n_a collapsed, b of n_b), the hypergeometric tail."""
    k, n = a + b, n_a + n_b
    return sum(math.comb(n_a, x) * math.comb(n_b, k - x) for x in range(a, min(k, n_a) + 1)) / math.comb(n, k)


def holm(ps):
    """Holm's step-down adjusted p-values, in the order given."""
    order, out, top = sorted(range(len(ps)), key=lambda i: ps[i]), [0.0] * len(ps), 0.0
    for rank, i in enumerate(order):
        top = max(top, min(1.0, (len(ps) - rank) * ps[i]))
        out[i] = top
    return out


def bootstrap_ci(per_unit, reps=10000, seed=0):
    """95 % percentile interval of the mean per-problem difference (per_unit: one list per paired
    run, the difference in correct share per problem), problems resampled with replacement: the
    noise of evaluating these trained models on finitely many problems, not that of training."""
    P = len(per_unit[0])
    d = [statistics.fmean(u[p] for u in per_unit) for p in range(P)]
    rng = random.Random(seed)
    stats = sorted(sum(d[rng.randrange(P)] for _ in range(P)) / P for _ in range(reps))
    return stats[int(0.025 * reps)], stats[int(0.975 * reps) - 1]


def verdict(sign, mean, p, ci=None, regime=None, names=("A", "B")):
    """docs/study.md's words for every part. sign: +1 / -1 where the paper says A above / below B, 0 for no
    claim; p: the test's (two-sided, or one-sided in the observed direction); ci: the problem-level interval.
    p <= 0.05 is the rule; a sign-flip p (k / 2^m) never equals 0.05, so for it this is also p < 0.05."""
    if regime:
        return f"not testable here ({regime})"
    ci_out = ci is not None and (ci[0] > 0 or ci[1] < 0)
    if sign == 0:
        word = f"{names[0]} above {names[1]}" if mean > 0 else f"{names[0]} below {names[1]}" if mean < 0 \
            else "no difference"
        return (f"{word} (across seeds)" if p <= 0.05 else f"{word} (for these runs)" if ci_out
                else f"{word}, within noise" if mean else word)
    agree = mean * sign > 0
    if p <= 0.05:
        return "holds" if agree else "contradicted"
    if ci_out:
        return "holds for these runs" if agree else "contradicted for these runs"
    return "same direction, within noise" if agree else "opposite direction, within noise" if mean else "no difference"


def paired_units(contrasts, metric, p):
    """Units (one per contrast and seed where every term's run has the metric): (seed, A - B, per-problem
    contrast when every run has counts, each term's value)."""
    units = []
    for terms in contrasts:
        arms = [arm(n, p) for _, n in terms]
        for s in sorted(set.intersection(*(set(a.seeds if a else ()) for a in arms))):
            got = [metric(d) if d else (None, None) for d in (load(a.run_id(s), p.base) for a in arms)]
            if any(v is None for v, _ in got):
                continue
            value = sum(c * v for (c, _), (v, _) in zip(terms, got))
            counts = None if any(c is None for _, c in got) else \
                [sum(c * x[q] for (c, _), (_, x) in zip(terms, got)) / N_SAMPLES for q in range(len(got[0][1]))]
            units.append((s, value, counts, [v for v, _ in got]))
    return units


def test_row(t, p, with_ci=False):
    """One test's units, mean, p and verdict (the questions table's row); `expected`: the units it has once every
    run of its arms' common seeds is in."""
    words, metric = metrics()[t.metric]
    units = paired_units(t.contrasts, metric, p)
    expected = sum(len(set.intersection(*(set(a.seeds if a else ()) for a in (arm(n, p) for _, n in terms))))
                   for terms in t.contrasts)
    if not units:
        return {"q": t.label, "claim": t.claim, "metric": words, "units": 0, "expected": expected}
    diffs = [v for _, v, _, _ in units]
    mean, row = statistics.fmean(diffs), {}
    if t.test == "fisher":
        a, b, n = round(sum(u[3][0] for u in units)), round(sum(u[3][1] for u in units)), len(units)
        p_ = fisher_one_sided(a, n, b, n) if a > b else fisher_one_sided(b, n, a, n) if b > a else 1.0
        row["counts"] = (a, b)
    else:
        p_ = sign_flip_p(diffs, 1 if t.test.endswith("one-sided") else 2)
    ci = bootstrap_ci([c for _, _, c, _ in units]) if with_ci and all(c is not None for _, _, c, _ in units) else None
    first = t.contrasts[0]
    terms = " ".join(f"{'+' if c > 0 else '−'} {n}" for c, n in first).lstrip("+ ")
    if abs(first[0][0]) != 1:                       # a mean over terms: (gtpo-a6 − grpo-a6 + ...) / 2
        terms = f"({terms}) / {round(1 / abs(first[0][0]))}"
    both = " (both Adam settings)" if len(t.contrasts) > 1 else ""
    return {"q": t.label, "claim": t.claim, "contrast": terms + both, "metric": words, "units": len(units),
            "values": diffs, "mean": mean, "p": p_, "ci": ci, "min_p": 2 / 2 ** len(units),
            "verdict": verdict(t.sign, mean, p_, ci, t.regime, t.names), "expected": expected, **row}


def test_rows(p, tests, with_ci=False):
    """The tests' rows, Holm-adjusted within each group a part declares (`p_holm`, and the verdict from it)."""
    rows = [test_row(t, p, with_ci) for t in tests]
    for group in {t.holm for t in tests if t.holm}:
        idx = [i for i, t in enumerate(tests) if t.holm == group and "p" in rows[i]]
        for i, q in zip(idx, holm([rows[i]["p"] for i in idx])):
            rows[i]["p_holm"] = q
            rows[i]["verdict"] = verdict(tests[i].sign, rows[i]["mean"], q, None, tests[i].regime, tests[i].names)
    return rows


def sentence(t, r):
    """A test's verdict in one sentence: the words, the counts or mean beside them, the test and its p."""
    if not r["expected"]:
        return "not run"
    if r["units"] < r["expected"]:
        return f"not finished ({r['units']} of {r['expected']} seeds have both runs)"
    a, b, n = *t.names, r["units"]
    if t.test == "fisher":
        return (f"{r['verdict']}: {a} collapses in {r['counts'][0]} of {n} seeds, {b} in {r['counts'][1]} of {n}; "
                f"Fisher's exact test, one-sided, p = {r['p']:.3f}")
    sided = "one-sided" if t.test.endswith("one-sided") else "two-sided"
    return (f"{r['verdict']}: {r['metric']} {a} − {b} {r['mean']:+.3f} on average, {a} higher in "
            f"{sum(v > 0 for v in r['values'])} of {n} seeds; exact {sided} sign-flip test, p = {r['p']:.3f}"
            + (f", Holm-adjusted {r['p_holm']:.3f}" if "p_holm" in r else ""))


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
    head, cells = CELLS[p.cells]
    lines = list(head)
    for s in sorted({s for a in p.arm_list() if a.flags for s in a.seeds}):
        found = [(a, d) for a in p.arm_list() if a.start or not a.flags for owner in [arm(a.name, p)]
                 for d in [load(owner.run_id(s), p.base) if s in owner.seeds else None]
                 if d is not None and len(d["rl"]) >= COLLAPSE_WINDOW]
        if any(a.flags for a, _ in found):                 # a seed this part has trained a run of
            lines += [f"| {s} | {a.label} | {cells(d)}" for a, d in found]
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


def curve_cells(d):
    """A run's entropy and formatting (trailing COLLAPSE_WINDOW-step means): first -> extreme -> last,
    its mean accuracy over the last window, and its collapse step."""
    w, rows = COLLAPSE_WINDOW, d["rl"]
    ent = trailing([r["entropy"] for r in rows], w)
    fmt = trailing([10 * r["rewards/format"] for r in rows], w)
    acc = statistics.fmean(10 * r["rewards/accuracy"] for r in rows[-w:])
    step = collapse_step(rows, d.get("diverged.json"))
    return (f"{ent[w - 1]:.2f} → {max(ent):.2f} → {ent[-1]:.2f} | {fmt[w - 1]:.0f} → {min(fmt):.0f} → {fmt[-1]:.0f} | "
            f"{acc:.1f} | {step or 'none'} |")


def kl_cell(d):
    """The run's KL to its start at its last evaluated checkpoint (the `kl` evaluation), or – ."""
    kl = d["evals"].get("kl")
    return f"{kl['points'][-1]['kl']:.3f} (step {kl['points'][-1]['step']})" if kl else "–"


def h_ini_of(d):
    h = d["config.json"].get("h_ini")
    return "–" if h is None else f"{h:.3f}"


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


def zero_gradient_steps(d):
    """RL steps whose gradient was exactly 0 (grad_norm == 0: no completion carried a loss term)."""
    return sum(r.get("grad_norm") == 0 for r in d["rl"])


def flat_reward_steps(d):
    """RL steps whose group rewards were all equal (reward_std == 0): no advantage, only the entropy term acts."""
    return sum(r.get("reward_std") == 0 for r in d["rl"])


def q6_cells(d):
    """A Q6 run's cells: collapse step, zero-gradient steps, share filtered, the curves, KL, ID pass@1 final."""
    step = collapse_step(d["rl"], d.get("diverged.json"))
    filt = statistics.fmean(r.get("gtpo/filtered_frac", 0.0) for r in d["rl"])
    final = pass1(d, "rung")[0] if "rung" in d["evals"] else None
    return (f"{step or 'none'} | {zero_gradient_steps(d)} | {100 * filt:.1f} | {curve_cells(d).rsplit('|', 2)[0]}| "
            f"{kl_cell(d)} | {'–' if final is None else f'{final:.3f}'} |")


def q7_cells(d):
    """A Q7 run's table cells: ID pass@1 final with its formatting share and mean length, best checkpoint,
    OOD, training formatting and accuracy (first 10 -> last 10 RL steps), entropy, steps with no reward spread,
    zero-gradient steps, share filtered, KL at step 200, host."""
    w, rows, ev = COLLAPSE_WINDOW, d["rl"], d["evals"]
    first, last = rows[:w], rows[-w:]
    ent = trailing([r["entropy"] for r in rows], w)
    idf, best = ev.get("id"), ev.get("id-best")
    kl = ev.get("kl200") or ev.get("kl")
    kl200 = next((p["kl"] for p in kl["points"] if p["step"] == 200), None) if kl else None
    host = d.get("host.json", {}).get("hosts", d.get("host.json", {}).get("cpu", ["–"]))

    def pct(rs, key):
        return statistics.fmean(10 * r[key] for r in rs)
    return (f"{idf['pass@k']['1']:.3f} | {100 * idf['format_rate']:.0f} | {idf['mean_length']:.0f} | "
            if idf else "– | – | – | ") + (
        f"{best['pass@k']['1']:.3f} ({d.get('best.json', {}).get('step', '?')}) | " if best else "– | ") + (
        f"{ev['ood']['pass@k']['1']:.3f} | " if "ood" in ev else "– | ") + (
        f"{pct(first, 'rewards/format'):.0f} → {pct(last, 'rewards/format'):.0f} | "
        f"{pct(first, 'rewards/accuracy'):.1f} → {pct(last, 'rewards/accuracy'):.1f} | "
        f"{ent[w - 1]:.2f} → {min(ent):.2f} → {ent[-1]:.2f} | {flat_reward_steps(d)} | {zero_gradient_steps(d)} | "
        f"{100 * statistics.fmean(r.get('gtpo/filtered_frac', 0.0) for r in rows):.1f} | "
        f"{'–' if kl200 is None else f'{kl200:.3f}'} | {'; '.join(host)} |")


CELLS = {  # a per-seed table's header and cells function, by plan.Part.cells
    "q6_cells": (["| seed | method | collapse step | zero-gradient steps | filtered % | entropy (trailing 10): first → "
                  "max → last | format % (trailing 10): first → min → last | accuracy % (last 10) | KL to the warm-up, "
                  "last checkpoint | ID pass@1 final |", "|---|---|---|---|---|---|---|---|---|---|"], q6_cells),
    "q7_cells": (["| seed | method | ID pass@1 final | ID format % | ID length | ID pass@1 best (step) | OOD pass@1 | "
                  "train format % (first 10 → last 10) | train accuracy % (first 10 → last 10) | entropy (trailing 10): "
                  "first → min → last | steps with no reward spread | zero-gradient steps | filtered % | KL to the "
                  "warm-up, step 200 | host |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"], q7_cells)}


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
    lines = ["## Questions, tests, verdicts (docs/study.md declares them)", ""] + question_lines(rows) + [
        "", "run-level p: exact two-sided sign-flip test over the paired runs (its smallest possible value in "
        "brackets); problem-level CI: the problems resampled, the runs fixed."]
    for _, title, rule, body in sections:
        lines += ["", f"## {title} — {rule}", ""] + body
    names = list(dict.fromkeys(p.cost for p in PARTS if p.cost))
    cost = "; ".join(f"{n} {cost_hours(n):.2f}" for n in names)
    lines += ["", "## Configurations (mean ± sample std over the finished seeds)", ""] + summary_lines() + [
        "", f"Worker-hours (every attempt, both workers summed): {cost}"]
    runs.write_text(os.path.join(STUDY, "summary.md"), "\n".join(lines) + "\n")
    runs.write_json(os.path.join(STUDY, "summary.json"), {"questions": rows, **{k: r for k, _, r, _ in sections}})
    print("\n".join(lines))


def report():
    from study import figures                           # matplotlib: only where figures are drawn
    write_summary()
    for p in PARTS:
        for name, plot, kwargs in p.figures:
            done = getattr(figures, plot)(os.path.join(STUDY, name), p, **kwargs)
            print(f"{STUDY}/{name}: {'written' if done else 'not yet (no seed has every run of the figure)'}")


if __name__ == "__main__":
    report()
