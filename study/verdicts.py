"""What a declared test (plan.Test) gives, from the committed runs alone: each run's metric (pass@1, training
accuracy, collapse), the paired units of a contrast, the p (exact sign-flip, one- or two-sided; Fisher's exact
test, unpaired; the exact McNemar test, paired; Holm where a part declares it) and the verdict in docs/study.md's
words. study/report.py lays these out as tables and sentences; study/figures.py reads the same metrics.
"""
import math
import random
import statistics

from study.plan import COLLAPSE_WINDOW, N_SAMPLES, arm, collapse_step, load, part


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
            "ood": ("OOD pass@1", lambda d: pass1(d, "ood")),
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


def paired_exact_one_sided(pairs):
    """The exact McNemar test, one-sided in the observed direction: pairs of 0/1 values (A, B), one per seed; only
    the seeds where A and B disagree count, and under no difference each is A's with probability 1/2 ->
    (p, A's discordant count, B's). p = P(Bin(b + c, 1/2) >= max(b, c)); 1 when b = c (no direction)."""
    b = sum(1 for a, x in pairs if a and not x)
    c = sum(1 for a, x in pairs if x and not a)
    if b == c:
        return 1.0, b, c
    n, k = b + c, max(b, c)
    return sum(math.comb(n, x) for x in range(k, n + 1)) / 2 ** n, b, c


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
    if t.test in ("fisher", "paired exact"):
        a, b, n = round(sum(u[3][0] for u in units)), round(sum(u[3][1] for u in units)), len(units)
        p_ = fisher_one_sided(a, n, b, n) if a > b else fisher_one_sided(b, n, a, n) if b > a else 1.0
        row["counts"] = (a, b)
        if t.test == "paired exact":
            p_, *row["discordant"] = paired_exact_one_sided([u[3] for u in units])
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
    if t.test == "paired exact":
        return (f"{r['verdict']}: {a} collapses in {r['counts'][0]} of {n} seeds, {b} in {r['counts'][1]} of {n}; "
                f"of the seeds where they disagree, {r['discordant'][0]} collapse with {a} only and "
                f"{r['discordant'][1]} with {b} only; exact paired (McNemar) test, one-sided, p = {r['p']:.3f}"
                + (f", Holm-adjusted {r['p_holm']:.3f}" if "p_holm" in r else ""))
    sided = "one-sided" if t.test.endswith("one-sided") else "two-sided"
    return (f"{r['verdict']}: {r['metric']} {a} − {b} {r['mean']:+.3f} on average, {a} higher in "
            f"{sum(v > 0 for v in r['values'])} of {n} seeds; exact {sided} sign-flip test, p = {r['p']:.3f}"
            + (f", Holm-adjusted {r['p_holm']:.3f}" if "p_holm" in r else ""))
