"""The study's report: every table and figure of docs/results.md from the committed files in study/
alone (study/run.py runs the plan and copies them there; docs/study.md declares the tests and rules).

    python -m study.report                # = python -m study.run --report

Sections: the questions (Q1-Q3 and the first design re-tested: paired units, sign-flip p,
problem-level interval, verdict); Q4 and the collapse part (the pilot ladder, the test, Fisher's
exact test); Q6; Q7 (the default objective over 200 steps, one-sided sign-flip test); Q5 (conflict
tokens); the configuration summary; cost; plots.
"""
import math
import os
import random
import statistics
from dataclasses import dataclass
from typing import Callable

import runs
from study.run import (COLLAPSE_WINDOW, EVALS, KEEP, STUDY, LADDER, N_SAMPLES, PILOT_SEED, Q6_SEEDS, Q6_START, Q7_SEEDS, RUNS,
                       TEST_SEEDS, collapse_jobs, collapse_step, jobs, load, q6_jobs, q6_pair, q7_jobs, q7_pair,
                       trailing)


V1 = os.path.join(KEEP, "v1")          # the first design's runs: 16 problems per set, no per-problem counts
V1_RUNS = {"gtpo": (1, 2, 3), "grpo": (1, 2, 3), "grpo-kl": (1, 2, 3), "sft": (1, 2, 3), "gtpo-masks-only": (1, 2),
           "gtpo-delta": (1, 2), "gtpo-onlyneg": (1, 2), "grpo-entropy": (1, 2), "gtpo-hot": (1, 2),
           "grpo-hot": (1, 2), "grpo-kl-hot": (1, 2)}

NAMES = {"gtpo-a6": "GTPO, Adam β 0.999999", "gtpo-a9": "GTPO, Adam β (0.9, 0.95)",
         "grpo-a6": "GRPO β=0, Adam β 0.999999", "grpo-a9": "GRPO β=0, Adam β (0.9, 0.95)",
         "grpo-kl6": "GRPO β=1e-6, Adam β (0.9, 0.95)", "sft": "SFT",
         "gtpo-long": "GTPO, 200 steps", "grpo-long": "GRPO β=0, 200 steps", "warmup": "SFT warm-up (the start)"}
METHODS = {"grpo": "GRPO β=0", "gtpo": "GTPO"}
STYLE = {"gtpo-a6": ("tab:blue", "-"), "gtpo-a9": ("tab:blue", "--"), "grpo-a6": ("tab:orange", "-"),
         "grpo-a9": ("tab:orange", "--"), "grpo-kl6": ("tab:red", "--"), "sft": ("tab:green", "-"),
         "gtpo-long": ("tab:blue", "-"), "grpo-long": ("tab:orange", "-")}


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


def solvable(names, s="ood"):
    """Problems of set s with >= 1 correct sample in any finished run of `names`, pooled over runs
    and seeds (blind to which method solved it)."""
    solved = set()
    for name, _, seeds, _, _ in RUNS:
        for seed in seeds:
            d = load(f"{name}-s{seed}") if name in names else None
            c = d and d["evals"].get(s, {}).get("per_problem_correct")
            solved |= {p for p, x in enumerate(c or []) if x > 0}
    return sorted(solved)


def sign_flip_p(diffs):
    """Two-sided exact sign-flip permutation p of mean(diffs) = 0 over paired runs: the share of
    the 2^m sign patterns whose |sum| is at least the observed |sum|."""
    obs, m = abs(sum(diffs)), len(diffs)
    hits = sum(abs(sum(d if mask >> i & 1 else -d for i, d in enumerate(diffs))) >= obs - 1e-12
               for mask in range(2 ** m))
    return hits / 2 ** m


def bootstrap_ci(per_unit, reps=10000, seed=0):
    """95 % percentile interval of the mean per-problem difference (per_unit: one list per paired
    run, the difference in correct share per problem), problems resampled with replacement: the
    noise of evaluating these trained models on finitely many problems, not that of training."""
    P = len(per_unit[0])
    d = [statistics.fmean(u[p] for u in per_unit) for p in range(P)]
    rng = random.Random(seed)
    stats = sorted(sum(d[rng.randrange(P)] for _ in range(P)) / P for _ in range(reps))
    return stats[int(0.025 * reps)], stats[int(0.975 * reps) - 1]


def verdict(sign, mean, p, ci, regime=None):
    """docs/study.md's rule. sign: +1 / -1 where the paper says A above / below B, 0 for no claim."""
    if regime:
        return f"not testable here ({regime})"
    ci_out = ci is not None and (ci[0] > 0 or ci[1] < 0)
    if sign == 0:
        word = "A above B" if mean > 0 else "A below B" if mean < 0 else "no difference"
        return (f"{word} (across seeds)" if p < 0.05 else f"{word} (for these runs)" if ci_out
                else f"{word}, within noise" if mean else word)
    agree = mean * sign > 0
    if p < 0.05:
        return "holds" if agree else "contradicted"
    if ci_out:
        return "holds for these runs" if agree else "contradicted for these runs"
    return "same direction, within noise" if agree else "opposite direction, within noise" if mean else "no difference"


@dataclass
class Question:
    """One comparison of docs/study.md: the paper's claim, tested on paired units."""
    label: str                     # Q1 ... Q4, or v1 (the first design re-tested)
    claim: str                     # the paper's claim, in words
    contrasts: list                # each: [(coefficient, configuration)]; one unit per contrast and seed
    metric_name: str
    metric: Callable               # a run's committed files -> (value, per-problem counts or None)
    sign: int = 1                  # +1 / -1: the paper says A above / below B; 0: no claim
    base: str = None               # the runs' folder (V1 for the first design), default study/
    regime: str = None             # why the claim is not testable here, or None


def _id(d):
    return pass1(d, "id")


def _train(d):
    return train_accuracy(d), None


def questions():
    """docs/study.md's questions, in its order; `v1` rows re-test the first design's runs."""
    ood = solvable([n for n, p, *_ in RUNS if p == "main"])
    _ood = lambda d: pass1(d, "ood", ood)                                           # noqa: E731
    _ood16 = lambda d: pass1(d, "ood")                                              # noqa: E731
    g_vs_r = [[(1, "gtpo-a6"), (-1, "grpo-a6")], [(1, "gtpo-a9"), (-1, "grpo-a9")]]
    # seeds as the units: a seed's two Adam settings share its warm-up, prompts and first samples
    by_seed = [[(0.5, "gtpo-a6"), (-0.5, "grpo-a6"), (0.5, "gtpo-a9"), (-0.5, "grpo-a9")]]
    inter = [[(1, "gtpo-a6"), (-1, "grpo-a6"), (-1, "gtpo-a9"), (1, "grpo-a9")]]
    long = [[(1, "gtpo-long"), (-1, "grpo-long")]]
    hot = "Fig. 1's collapse comes after hundreds of steps; these runs have 20"
    eq6 = "delta_i acts only when <H>_ini < ln 2 (Eq. 6); <H>_ini was 1.2-1.6 here"
    acc = "training accuracy %"
    Q, fig2 = Question, "GTPO above GRPO β=0 (Fig. 2)"
    return [
        Q("Q1", fig2, g_vs_r, "ID pass@1", _id),
        Q("Q1", fig2, g_vs_r, f"OOD pass@1, {len(ood)} solvable", _ood),
        Q("Q1", fig2, g_vs_r, acc, _train),
        Q("Q1", fig2 + ", seeds as units", by_seed, "ID pass@1", _id),
        Q("Q1", fig2 + ", seeds as units", by_seed, f"OOD pass@1, {len(ood)} solvable", _ood),
        Q("Q1", "GTPO above GRPO β=1e-6 (Fig. 2)", [[(1, "gtpo-a9"), (-1, "grpo-kl6")]], "ID pass@1", _id),
        Q("Q2", "(no claim) GTPO's edge the same under both Adam settings", inter, "ID pass@1", _id, sign=0),
        Q("Q2", "(no claim) Adam β 0.999999 vs (0.9, 0.95), GTPO", [[(1, "gtpo-a6"), (-1, "gtpo-a9")]], "ID pass@1",
          _id, sign=0),
        Q("Q2", "(no claim) Adam β 0.999999 vs (0.9, 0.95), GRPO", [[(1, "grpo-a6"), (-1, "grpo-a9")]], "ID pass@1",
          _id, sign=0),
        Q("Q3", "GTPO above SFT (Fig. 2-3, Sec. 6)", [[(1, "gtpo-a6"), (-1, "sft")]], "ID pass@1", _id),
        Q("Q3", "GTPO above SFT (Fig. 2-3, Sec. 6)", [[(1, "gtpo-a6"), (-1, "sft")]],
          f"OOD pass@1, {len(ood)} solvable", _ood),
        Q("Q4", "GTPO above GRPO β=0 after 200 steps", long, "ID pass@1, final", _id),
        Q("Q4", "GTPO above GRPO β=0, best checkpoints", long, "ID pass@1, best", lambda d: pass1(d, "id-best")),
        Q("v1", fig2, [[(1, "gtpo"), (-1, "grpo")]], "ID pass@1 (16)", _id, base=V1),
        Q("v1", fig2, [[(1, "gtpo"), (-1, "grpo")]], acc, _train, base=V1),
        Q("v1", "GTPO above GRPO β=0.04 (Fig. 2)", [[(1, "gtpo"), (-1, "grpo-kl")]], acc, _train, base=V1),
        Q("v1", "GTPO above SFT OOD (Sec. 6)", [[(1, "gtpo"), (-1, "sft")]], "OOD pass@1 (16)", _ood16, base=V1),
        Q("v1", "GRPO β=0.04 above SFT OOD (Sec. 6: RL generalises)", [[(1, "grpo-kl"), (-1, "sft")]],
          "OOD pass@1 (16)", _ood16, base=V1),
        Q("v1", "conflict masks alone above GRPO (Fig. 5)", [[(1, "gtpo-masks-only"), (-1, "grpo")]], acc, _train,
          base=V1),
        Q("v1", "full GTPO above masks alone (Fig. 5)", [[(1, "gtpo"), (-1, "gtpo-masks-only")]], acc, _train,
          base=V1),
        Q("v1", "filter on all above no filter (Fig. 4)", [[(1, "gtpo-delta"), (-1, "gtpo")]], acc, _train, base=V1,
          regime=eq6),
        Q("v1", "OnlyNeg below filter-on-all in accuracy (App. 13)", [[(1, "gtpo-onlyneg"), (-1, "gtpo-delta")]],
          acc, _train, sign=-1, base=V1, regime=eq6),
        Q("v1", "filter + γ improve GRPO (App. 14)", [[(1, "grpo-entropy"), (-1, "grpo")]], acc, _train, base=V1),
        Q("v1", "GTPO above GRPO + filter + γ (App. 14)", [[(1, "gtpo"), (-1, "grpo-entropy")]], acc, _train,
          base=V1),
        Q("v1", "GTPO above GRPO β=0 at lr 1e-3 (Fig. 1)", [[(1, "gtpo-hot"), (-1, "grpo-hot")]], acc, _train,
          base=V1, regime=hot),
    ]


def seeds_of(name, base):
    if name.startswith("q7-"):
        return Q7_SEEDS
    return V1_RUNS[name] if base == V1 else next(ss for n, _, ss, _, _ in RUNS if n == name)


def paired_units(contrasts, metric, base):
    """Units (one per contrast and seed where every term's run has the metric): their values, the
    per-problem contrast lists when every run has counts."""
    units = []
    for terms in contrasts:
        seeds = set.intersection(*(set(seeds_of(n, base)) for _, n in terms))
        for s in sorted(seeds):
            got = [metric(d) if d else (None, None) for d in (load(f"{n}-s{s}", base) for _, n in terms)]
            if any(v is None for v, _ in got):
                continue
            value = sum(c * v for (c, _), (v, _) in zip(terms, got))
            counts = None if any(c is None for _, c in got) else \
                [sum(c * x[p] for (c, _), (_, x) in zip(terms, got)) / N_SAMPLES for p in range(len(got[0][1]))]
            units.append((s, value, counts))
    return units


def question_rows():
    """One dict per question: its units, mean, run-level p, problem-level CI and verdict."""
    out = []
    for q in questions():
        units = paired_units(q.contrasts, q.metric, q.base)
        if not units:
            out.append({"q": q.label, "claim": q.claim, "metric": q.metric_name, "units": 0})
            continue
        diffs = [v for _, v, _ in units]
        mean, p = statistics.fmean(diffs), sign_flip_p(diffs)
        ci = bootstrap_ci([c for *_, c in units]) if all(c is not None for *_, c in units) else None
        first = q.contrasts[0]
        terms = " ".join(f"{'+' if c > 0 else '−'} {n}" for c, n in first).lstrip("+ ")
        if abs(first[0][0]) != 1:                       # a mean over terms: (gtpo-a6 − grpo-a6 + ...) / 2
            terms = f"({terms}) / {round(1 / abs(first[0][0]))}"
        both = " (both Adam settings)" if len(q.contrasts) > 1 else ""
        out.append({"q": q.label, "claim": q.claim, "contrast": terms + both, "metric": q.metric_name,
                    "units": len(units), "values": diffs, "mean": mean, "p": p, "ci": ci, "min_p": 2 / 2 ** len(units),
                    "verdict": verdict(q.sign, mean, p, ci, q.regime)})
    return out


def collapse_lines():
    """Q4: per long run, <H>_ini, first and last formatting / entropy, its collapse step and its
    KL to the start (drift)."""
    lines = ["| run | <H>_ini of its start | format % first 10 → last 10 | entropy first 10 → last 10 | "
             "collapse step | KL to the start at its last checkpoint |", "|---|---|---|---|---|---|"]
    found = {}
    gtpo_runs = {s: load(f"gtpo-long-s{s}") for s in seeds_of("gtpo-long", None)}   # they log <H>_ini
    for name in ("gtpo-long", "grpo-long"):
        for s in seeds_of(name, None):
            d = load(f"{name}-s{s}")
            if d is None or len(d["rl"]) < 2 * COLLAPSE_WINDOW:
                continue
            rows, w = d["rl"], COLLAPSE_WINDOW
            fmt, ent = [10 * r["rewards/format"] for r in rows], [r["entropy"] for r in rows]
            found[(name, s)] = collapse_step(rows)
            h = gtpo_runs[s] and gtpo_runs[s]["config.json"].get("h_ini")
            lines.append(f"| {NAMES[name]}, seed {s} | {h:.3f} |" if h is not None else f"| {NAMES[name]}, seed {s} | – |")
            lines[-1] += (f" {statistics.fmean(fmt[:w]):.1f} → {statistics.fmean(fmt[-w:]):.1f} | "
                          f"{statistics.fmean(ent[:w]):.3f} → {statistics.fmean(ent[-w:]):.3f} | "
                          f"{found[(name, s)] or 'none'} |")
            lines[-1] += f" {kl_cell(d)} |"
    if len(found) < 4:
        return lines, "not finished"
    g = [found[("gtpo-long", s)] for s in (1, 2)]
    r = [found[("grpo-long", s)] for s in (1, 2)]
    rule = ("holds (GRPO collapses in both seeds, GTPO in neither)" if all(r) and not any(g) else
            "not observed (no run collapses within 200 steps)" if not any(r + g) else
            "contradicted (GTPO collapses in both seeds, GRPO in neither)" if all(g) and not any(r) else
            "mixed (see the table)")
    return lines, rule


def conflict_lines():
    """Q5: the share of conflict-token positions that are format tokens, per RL run of the main part,
    beside the share of format tokens among all completion tokens."""
    lines = ["| run | seeds | format share of conflict positions | format share of all tokens | conflict positions / "
             "tokens |", "|---|---|---|---|---|"]
    shares = []
    for name in ("gtpo-a6", "gtpo-a9", "grpo-a6", "grpo-a9"):
        cs = [d["conflicts.json"] for d in (load(f"{name}-s{s}") for s in seeds_of(name, None))
              if d and "conflicts.json" in d]
        if not cs:
            continue
        share = [c["format_share"] for c in cs]
        shares += share
        base = [c["format_share_of_tokens"] for c in cs if "format_share_of_tokens" in c]
        lines.append(f"| {NAMES[name]} | {len(cs)} | {' '.join(f'{x:.2f}' for x in share)} | "
                     f"{' '.join(f'{x:.2f}' for x in base) or '–'} | "
                     f"{' '.join(format(c['conflict_share'], '.3f') for c in cs)} |")
    rule = ("not finished" if not shares else "holds (format tokens are the majority in every run)"
            if min(shares) > 0.5 else "does not hold (a minority in every run)" if max(shares) <= 0.5 else
            "mixed (the majority in some runs only)")
    return lines, rule


def mean_std(xs):
    """(mean, sample std, n) of the values present, or None."""
    xs = [x for x in xs if x is not None]
    return (statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0, len(xs)) if xs else None


def summary_lines():
    """Per configuration: mean ± std over its finished seeds of the training and evaluation columns."""
    ood = solvable([n for n, p, *_ in RUNS if p == "main"])
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
    for name, part, seeds, _, _ in [("warmup", "start", (1, 2, 3), None, None)] + RUNS:
        data = [d for d in (load(f"{name}-s{s}") for s in seeds) if d is not None]
        cells = []
        for label, f in cols:
            v = mean_std([f(d) for d in data if d["rl"] or "%" not in label and "entropy" not in label])
            digits = 1 if "%" in label or "min" in label else 3
            cells.append("–" if v is None else f"{v[0]:.{digits}f} ± {v[1]:.{digits}f}" + ("" if v[2] == len(data)
                                                                                          else f" (n={v[2]})"))
        lines.append(f"| {NAMES[name]} | {len(data)}/{len(seeds)} | " + " | ".join(cells) + " |")
    return lines


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


def worked(attempt):
    """An attempt's seconds of work: its wall time less paused_seconds, where the workers were stopped
    (SIGSTOP) for other work."""
    return attempt["seconds"] - attempt.get("paused_seconds", 0)


def cost_hours(collapse=False, q6=False, q7=False):
    """Worker-hours spent (every attempt, worked()): the main and long parts; with collapse=True the
    collapse part; with q6=True Q6 -- its own runs, and the attempts of the warm-ups it reused from
    Q6_START on (their weights are not committed, so Q6 trained them again); with q7=True Q7's runs and
    warm-ups."""
    q7_ids = {run_id for run_id, *_ in q7_jobs()}
    if q7:
        return sum(worked(t) for run_id in q7_ids for t in attempts(run_id)) / 3600
    q6_ids = {run_id for run_id, *_ in q6_jobs()}
    reused = {start for *_, start, _ in q6_jobs() if start} - q6_ids        # part 3's warm-ups, trained again
    part = {run_id for run_id, *_ in collapse_jobs()} | reused
    # an id repeats for its evaluations; Q7's runs are counted above, and only there
    ids = dict.fromkeys([run_id for run_id, *_ in jobs() if run_id not in q7_ids] + sorted(reused))

    def counted(run_id, attempt):
        again = run_id in reused and attempt.get("date", "") >= Q6_START
        if q6:
            return run_id in q6_ids or again
        if collapse:
            return run_id in part and run_id not in q6_ids and not again
        return run_id not in part and run_id not in q6_ids
    return sum(worked(t) for run_id in ids for t in attempts(run_id) if counted(run_id, t)) / 3600


def attempts(run_id):
    """Every attempt of a run's jobs in its times.json (not load(): a run stopped before it finished has
    attempts too)."""
    path = os.path.join(KEEP, run_id, "times.json")
    return [t for ts in runs.read_json(path).values() for t in ts] if os.path.isfile(path) else []


# -----------------------------------------------------------------------------
# the collapse part (docs/study.md, part 3): the pilot ladder, then the test at its chosen rung

def fisher_one_sided(a, n_a, b, n_b):
    """Fisher's exact test, one-sided: P(A's count >= a) given the margins of the 2 x 2 table
    (a of n_a collapsed, b of n_b), the hypergeometric tail."""
    k, n = a + b, n_a + n_b
    return sum(math.comb(n_a, x) * math.comb(n_b, k - x) for x in range(a, min(k, n_a) + 1)) / math.comb(n, k)


def collapse_verdict(grpo, gtpo):
    """docs/study.md's verdict rule on the collapsed flags of each method's seeds -> (verdict, p)."""
    r, g = sum(grpo), sum(gtpo)
    if r > g:
        p = fisher_one_sided(r, len(grpo), g, len(gtpo))
        return ("holds" if p <= 0.05 else "same direction, within noise"), p
    if g > r:
        p = fisher_one_sided(g, len(gtpo), r, len(grpo))
        return ("contradicted" if p <= 0.05 else "opposite direction, within noise"), p
    return "no difference", 1.0


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


def collapse_test_lines():
    """The test: per seed, each method's collapse step and ID pass@1 (final; last checkpoint before the
    collapse); the verdict (Fisher's exact test) once every run has finished; the secondary pass@1
    comparison (sign-flip p)."""
    lines = ["| seed | <H>_ini | GRPO collapse step | GTPO collapse step | GTPO filtered % | GTPO <H>_i of the "
             "filtered | ID pass@1 final GRPO / GTPO | ID pass@1 before the collapse GRPO / GTPO |",
             "|---|---|---|---|---|---|---|---|"]
    flags, diffs = {"grpo": [], "gtpo": []}, []
    for s in TEST_SEEDS:
        d = {m: load(f"collapse-{m}-s{s}") for m in ("grpo", "gtpo")}
        if any(v is None for v in d.values()):
            continue
        step = {m: collapse_step(v["rl"], v.get("diverged.json")) for m, v in d.items()}
        for m in flags:
            flags[m].append(step[m] is not None)
        final = {m: pass1(v, "rung")[0] for m, v in d.items()}
        before = {m: pass1(v, "rung-precollapse")[0] for m, v in d.items()}
        if None not in final.values():
            diffs.append(final["gtpo"] - final["grpo"])
        filt = statistics.fmean(r.get("gtpo/filtered_frac", 0.0) for r in d["gtpo"]["rl"])
        cell = lambda x: "–" if x is None else f"{x:.3f}"                            # noqa: E731
        lines.append(f"| {s} | {h_ini_of(d['gtpo'])} | {step['grpo'] or 'none'} | {step['gtpo'] or 'none'} | "
                     f"{100 * filt:.1f} | {cell(filtered_entropy(d['gtpo']['rl']))} | "
                     f"{cell(final['grpo'])} / {cell(final['gtpo'])} | "
                     f"{cell(before['grpo'])} / {cell(before['gtpo'])} |")
    n = len(flags["grpo"])
    if n < len(TEST_SEEDS):
        return lines, f"not finished ({n} of {len(TEST_SEEDS)} seeds)", None
    verdict_, p = collapse_verdict(flags["grpo"], flags["gtpo"])
    secondary = (f"ID pass@1 final, GTPO − GRPO per seed {' '.join(f'{x:+.3f}' for x in diffs)}, mean "
                 f"{statistics.fmean(diffs):+.3f}, sign-flip p {sign_flip_p(diffs):.3f}") if diffs else None
    return lines, (f"{verdict_}: GRPO collapses in {sum(flags['grpo'])} of {n} seeds, GTPO in "
                   f"{sum(flags['gtpo'])} of {n}; Fisher's exact test, one-sided, p = {p:.3f}"), secondary


def zero_gradient_steps(d):
    """RL steps whose gradient was exactly 0 (grad_norm == 0: no completion carried a loss term)."""
    return sum(r.get("grad_norm") == 0 for r in d["rl"])


def q6_lines():
    """Q6 (docs/study.md, part 4): per seed, GRPO beta = 0 and GTPO with Eq. 7's entropy term side by side --
    collapse step, zero-gradient steps, share filtered, KL to the warm-up, formatting and accuracy, ID
    pass@1 -- and the verdict (Part 3's rule) once all 8 + 8 runs have finished."""
    lines = ["| seed | method | collapse step | zero-gradient steps | filtered % | entropy (trailing 10): first → max "
             "→ last | format % (trailing 10): first → min → last | accuracy % (last 10) | KL to the warm-up, last "
             "checkpoint | ID pass@1 final |", "|---|---|---|---|---|---|---|---|---|---|"]
    flags, n = {"grpo": [], "gtpo": []}, 0
    for s in Q6_SEEDS:
        d = dict(zip(("grpo", "gtpo"), (load(run_id) for run_id in q6_pair(s))))
        for m, v in d.items():
            if v is None or len(v["rl"]) < COLLAPSE_WINDOW:
                continue
            step = collapse_step(v["rl"], v.get("diverged.json"))
            filt = statistics.fmean(r.get("gtpo/filtered_frac", 0.0) for r in v["rl"])
            cells = curve_cells(v).rsplit("|", 2)[0]                  # without its collapse step
            final = pass1(v, "rung")[0] if "rung" in v["evals"] else None
            label = METHODS[m] + (", Eq. 7" if m == "gtpo" else "")
            lines.append(f"| {s} | {label} | {step or 'none'} | {zero_gradient_steps(v)} | {100 * filt:.1f} | {cells}| "
                         f"{kl_cell(v)} | {'–' if final is None else f'{final:.3f}'} |")
        if all(v is not None and len(v["rl"]) >= COLLAPSE_WINDOW for v in d.values()):
            n += 1
            for m, v in d.items():
                flags[m].append(collapse_step(v["rl"], v.get("diverged.json")) is not None)
    if n < len(Q6_SEEDS):
        return lines, f"not finished ({n} of {len(Q6_SEEDS)} seeds have both runs)"
    verdict_, p = collapse_verdict(flags["grpo"], flags["gtpo"])
    return lines, (f"{verdict_}: GRPO collapses in {sum(flags['grpo'])} of {n} seeds, GTPO (Eq. 7) in "
                   f"{sum(flags['gtpo'])} of {n}; Fisher's exact test, one-sided, p = {p:.3f}")


# -----------------------------------------------------------------------------
# Q7 (docs/study.md, part 6): the default objective against GRPO over the long part's 200 steps

def sign_flip_one_sided(diffs):
    """Exact one-sided sign-flip p of mean(diffs) > 0: the share of the 2^m sign patterns whose sum is at
    least the observed sum (a zero difference flips to itself)."""
    obs, m = sum(diffs), len(diffs)
    return sum(sum(d if mask >> i & 1 else -d for i, d in enumerate(diffs)) >= obs - 1e-12
               for mask in range(2 ** m)) / 2 ** m


def q7_verdict(diffs):
    """docs/study.md part 6's rule on the paired differences GTPO - GRPO -> (verdict, p of the observed
    direction)."""
    mean = statistics.fmean(diffs)
    if mean == 0:
        return "no difference", 1.0
    if mean > 0:
        p = sign_flip_one_sided(diffs)
        return ("holds" if p <= 0.05 else "same direction, within noise"), p
    p = sign_flip_one_sided([-d for d in diffs])
    return ("contradicted" if p <= 0.05 else "opposite direction, within noise"), p


def q7_cells(d):
    """A Q7 run's table cells: ID pass@1 final with its formatting share and mean length, best checkpoint,
    OOD, training formatting and accuracy (first 10 -> last 10 RL steps), entropy, zero-gradient steps,
    share filtered, KL at step 200, host."""
    w, rows, ev = COLLAPSE_WINDOW, d["rl"], d["evals"]
    first, last = rows[:w], rows[-w:]
    ent = trailing([r["entropy"] for r in rows], w)
    idf = ev.get("id")
    best = ev.get("id-best")
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
        f"{ent[w - 1]:.2f} → {min(ent):.2f} → {ent[-1]:.2f} | {zero_gradient_steps(d)} | "
        f"{100 * statistics.fmean(r.get('gtpo/filtered_frac', 0.0) for r in rows):.1f} | "
        f"{'–' if kl200 is None else f'{kl200:.3f}'} | {'; '.join(host)} |")


def q7_lines():
    """Q7's table, a row per run (the optional released-form arm where it ran), and the verdict once all 8
    seeds have both runs' ID evaluations; the released-form contrast, two-sided, where its seeds are done."""
    lines = ["| seed | method | ID pass@1 final | ID format % | ID length | ID pass@1 best (step) | OOD pass@1 | "
             "train format % (first 10 → last 10) | train accuracy % (first 10 → last 10) | entropy (trailing 10): "
             "first → min → last | zero-gradient steps | filtered % | KL to the warm-up, step 200 | host |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    diffs, released = [], []
    for s in Q7_SEEDS:
        grpo, gtpo = (load(run_id) for run_id in q7_pair(s))
        rel = load(f"q7-released-s{s}")
        for label, d in (("GRPO β=0", grpo), ("GTPO, Eq. 7 (default)", gtpo), ("GTPO, released form", rel)):
            if d is not None and len(d["rl"]) >= COLLAPSE_WINDOW:
                lines.append(f"| {s} | {label} | {q7_cells(d)}")
        if grpo and gtpo and "id" in grpo["evals"] and "id" in gtpo["evals"]:
            diffs.append(pass1(gtpo, "id")[0] - pass1(grpo, "id")[0])
        if gtpo and rel and "id" in gtpo["evals"] and "id" in rel["evals"]:
            released.append(pass1(gtpo, "id")[0] - pass1(rel, "id")[0])
    extra = []
    if released:
        mean, p = statistics.fmean(released), sign_flip_p(released)
        word = "no difference" if mean == 0 else ("Eq. 7 above released" if mean > 0 else "Eq. 7 below released")
        extra = ["", f"Optional arm, GTPO Eq. 7 − released form on {len(released)} seeds: mean ID pass@1 difference "
                 f"{mean:+.3f}, two-sided sign-flip p = {p:.3f} ({word}{', within noise' if p > 0.05 else ''})"]
    if len(diffs) < len(Q7_SEEDS):
        return lines + extra, f"not finished ({len(diffs)} of {len(Q7_SEEDS)} seeds have both runs evaluated)"
    verdict_, p = q7_verdict(diffs)
    return lines + extra, (f"{verdict_}: ID pass@1 GTPO − GRPO {statistics.fmean(diffs):+.3f} on average, GTPO "
                           f"higher in {sum(d > 0 for d in diffs)} of {len(diffs)} seeds; exact one-sided sign-flip "
                           f"test, p = {p:.3f}")


def write_summary():
    rows = question_rows()
    q4, q4_rule = collapse_lines()
    q5, q5_rule = conflict_lines()
    ladder, ladder_rule = ladder_lines()
    test, test_rule, secondary = collapse_test_lines()
    q6, q6_rule = q6_lines()
    q7, q7_rule = q7_lines()
    lines = ["## Questions, tests, verdicts (docs/study.md declares them)", ""] + question_lines(rows) + [
        "", "run-level p: exact two-sided sign-flip test over the paired runs (its smallest possible value in "
        "brackets); problem-level CI: the problems resampled, the runs fixed.", "",
        f"## Q4: collapse over 200 steps — {q4_rule}", ""] + q4 + [
        "", f"## Collapse part, pilot ladder — {ladder_rule}", ""] + ladder + [
        "", f"## Collapse part, the test — {test_rule}", ""] + test + ([""] + [secondary] if secondary else []) + [
        "", "Each test run's curves (described; the rule above decides what counts as a collapse):", ""] + \
        test_curve_lines() + [
        "", f"## Q6: with Eq. 7's entropy term as written, does GTPO collapse less than GRPO? — {q6_rule}", ""] + q6 + [
        "", f"## Q7: does the default objective (Eq. 7 as written) reach a higher ID pass@1 than GRPO β = 0 after 200 "
        f"steps? — {q7_rule}", ""] + q7 + [
        "", f"## Q5: conflict tokens are mostly format tokens (Sec. 4.1) — {q5_rule}", ""] + q5 + [
        "", "## Configurations (mean ± sample std over the finished seeds)", ""] + summary_lines() + [
        "", f"Worker-hours (every attempt, both workers summed): main and long parts {cost_hours():.2f}; "
        f"collapse part {cost_hours(collapse=True):.2f}; Q6 {cost_hours(q6=True):.2f}; Q7 {cost_hours(q7=True):.2f}"]
    runs.write_text(os.path.join(STUDY, "summary.md"), "\n".join(lines) + "\n")
    runs.write_json(os.path.join(STUDY, "summary.json"), {"questions": rows, "collapse": q4_rule, "conflicts": q5_rule,
                                                         "ladder": ladder_rule, "collapse_test": test_rule,
                                                         "q6": q6_rule, "q7": q7_rule})
    print("\n".join(lines))


# -----------------------------------------------------------------------------
# plots: paired seeds only (those every configuration of a figure has finished), words in legends

def paired_seeds(names, base=None):
    return [s for s in sorted(set.intersection(*(set(seeds_of(n, base)) for n in names)))
            if all(load(f"{n}-s{s}", base) for n in names)]


PANELS = [("rewards/format", 10.0, "formatting (% of 10 points)"), ("rewards/accuracy", 10.0, "accuracy (% of 10)"),
          ("entropy", 1.0, "mean token entropy <H> (nats)"),
          ("gtpo/conflict_frac", 1.0, "conflict tokens / tokens (logged by GTPO only)")]


def plot_curves(names, title, path, smooth, base=None, labels=None, kl=False):
    """PANELS per RL step for each configuration, the mean over paired seeds; kl: one more panel, the
    drift from the start at each checkpoint (the `kl` evaluation)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    seeds = paired_seeds(names, base)
    if kl:
        seeds = [s for s in seeds if all(load(f"{n}-s{s}", base)["evals"].get("kl") for n in names)]
    if not seeds:
        return False
    fig, axes = plt.subplots(1, len(PANELS) + kl, figsize=(4.2 * (len(PANELS) + kl), 3.8))
    for i, name in enumerate(names):
        color, ls = STYLE.get(name, (f"C{i}", "-"))
        rows = [load(f"{name}-s{s}", base)["rl"] for s in seeds]
        for ax, (key, scale, _) in zip(axes, PANELS):
            curves = [[scale * r[key] for r in rr if key in r] for rr in rows]
            if not all(curves):
                continue
            n = min(map(len, curves))
            steps = [r["step"] for r in rows[0] if key in r][:n]
            per_step = [statistics.fmean(c[j] for c in curves) for j in range(n)]
            ax.plot(steps, trailing(per_step, smooth), color=color, ls=ls, lw=1.6,
                    label=(labels or NAMES).get(name, name))
        if kl:
            points = [load(f"{name}-s{s}", base)["evals"]["kl"]["points"] for s in seeds]
            axes[-1].plot([p["step"] for p in points[0]], [statistics.fmean(p[j]["kl"] for p in points)
                                                           for j in range(len(points[0]))],
                          color=color, ls=ls, lw=1.6, marker="o", ms=3)
    if kl:
        probe = load(f"{names[0]}-s{seeds[0]}", base)["evals"]["kl"]
        axes[-1].set_title(f"KL(π || start), k3 on {probe['problems'] * probe['samples_per_problem']} samples "
                           f"per checkpoint", fontsize=9)
        axes[-1].set_xlabel("RL step (checkpoints)", fontsize=9)
        axes[-1].grid(alpha=0.3)
    for ax, (key, _, ylabel) in zip(axes, PANELS):
        ax.set_xlabel("RL step", fontsize=9)
        ax.set_title(ylabel, fontsize=9)
        ax.grid(alpha=0.3)
        if key == "entropy":
            ax.axhline(math.log(2), color="k", ls=":", lw=1, label="ln 2 (Eq. 6)")
    axes[2].legend(fontsize=8)
    fig.suptitle(f"{title}: mean of seeds {', '.join(map(str, seeds))} ({smooth}-step trailing mean); one prompt "
                 f"per step, the same prompts for every method of a seed, so the curves follow prompt difficulty",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_passk(path):
    """pass@k and maj@k, k = 1, 2, 4, 8, on both sets: the main part's configurations, paired seeds."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = [n for n, p, *_ in RUNS if p == "main"]
    seeds = [s for s in paired_seeds(names) if all(load(f"{n}-s{s}")["evals"].get(e) for n in names for e in EVALS)]
    if not seeds:
        return False
    fig, grid = plt.subplots(2, 2, figsize=(10, 7))
    for col, s_name in enumerate(EVALS):
        for row, key in enumerate(("pass@k", "maj@k")):
            ax = grid[row][col]
            for name in names:
                res = [load(f"{name}-s{s}")["evals"][s_name] for s in seeds]
                ks = sorted(int(k) for k in res[0][key])
                color, ls = STYLE[name]
                ax.plot(ks, [statistics.fmean(r[key][str(k)] for r in res) for k in ks], marker="o", ms=4,
                        color=color, ls=ls, label=NAMES[name])
                ax.set_xscale("log", base=2)
                ax.set_xticks(ks, [str(k) for k in ks])
                ax.minorticks_off()
            ax.set_title(f"{key}, {s_name} ({EVALS[s_name][-1]} problems × {N_SAMPLES} samples)", fontsize=9)
            ax.set_xlabel("k", fontsize=9)
            ax.grid(alpha=0.3)
    grid[0][0].legend(fontsize=8)
    fig.suptitle(f"Mean over seeds {', '.join(map(str, seeds))}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


Q7_LABELS = {"q7-gtpo": "GTPO, Eq. 7 as written (default)", "q7-grpo": "GRPO β=0"}
V1_LABELS = {"gtpo": "GTPO", "grpo": "GRPO β=0", "gtpo-masks-only": "conflict masks only (γ=0, no δ)",
             "gtpo-delta": "GTPO, δ_i on all", "gtpo-onlyneg": "GTPO, δ_i on negatives (OnlyNeg)",
             "grpo-entropy": "GRPO + δ_i + γ"}


RUN_PANELS = [("entropy", 1.0, "mean token entropy (nats), trailing 10 steps"),
              ("rewards/format", 10.0, "formatting (% of 10 points), trailing 10 steps"),
              ("rewards/accuracy", 10.0, "accuracy (% of 10 points), trailing 10 steps")]


def plot_runs(rows, title, path):
    """Entropy, formatting and accuracy (trailing COLLAPSE_WINDOW-step means) per RL step of single runs,
    and their KL to the start at each checkpoint where the `kl` evaluation is there; one row of panels
    per list of lines in rows, each line (run id, label, color, line style); a collapse step is marked."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    found = [[(d, *rest) for run_id, *rest in lines for d in [load(run_id)]
              if d is not None and len(d["rl"]) >= COLLAPSE_WINDOW] for lines in rows]
    found = [row for row in found if row]
    if not found:
        return False
    kl = any(d["evals"].get("kl") for row in found for d, *_ in row)
    cols = len(RUN_PANELS) + kl
    fig, axes = plt.subplots(len(found), cols, figsize=(5.2 * cols, 3.6 * len(found) + 0.4), squeeze=False,
                             layout="constrained")                  # it leaves room for the suptitle
    for row, ax_row in zip(found, axes):
        plot_run_row(row, ax_row, kl)
    for ax, (_, _, name) in zip(axes[0], RUN_PANELS):
        ax.set_title(name, fontsize=9)
    if kl:
        axes[0][-1].set_title("KL(π || start), k3, at each checkpoint", fontsize=9)
    for ax in axes[-1]:
        ax.set_xlabel("RL step", fontsize=9)
    fig.suptitle(title, fontsize=9)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_run_row(row, axes, kl):
    for d, label, color, ls in row:
        steps = [r["step"] for r in d["rl"]]
        step = collapse_step(d["rl"], d.get("diverged.json"))
        for ax, (key, scale, _) in zip(axes, RUN_PANELS):
            ax.plot(steps, trailing([scale * r[key] for r in d["rl"]], COLLAPSE_WINDOW), color=color, ls=ls, lw=1.4,
                    label=label + (f", collapses at {step}" if step else ""))
            if step:
                ax.axvline(step, color=color, ls=":", lw=1)
        if kl and d["evals"].get("kl"):
            points = d["evals"]["kl"]["points"]
            axes[-1].plot([p["step"] for p in points], [p["kl"] for p in points], color=color, ls=ls, lw=1.4,
                          marker="o", ms=3)
    axes[0].axhline(math.log(2), color="k", ls=":", lw=1, label="ln 2 (the rule's entropy bar)")
    for ax in axes:
        ax.grid(alpha=0.3)
    # the accuracy panel falls to 0 early and leaves its upper right free; the entropy panel has no free corner
    axes[len(RUN_PANELS) - 1].legend(*axes[0].get_legend_handles_labels(), fontsize=7, loc="upper right")


def ladder_plot_rows():
    colors = dict(zip([name for name, _, _ in LADDER], ("tab:gray", "tab:olive", "tab:purple", "tab:red", "black")))
    return [[(f"pilot-{name}-{m}-s{PILOT_SEED}", f"{name} ({task}, lr {lr}) {METHODS[m]}", colors[name],
              "-" if m == "grpo" else "--") for name, task, lr in LADDER for m in ("grpo", "gtpo")]]


def test_plot_rows():
    """One row per seed: its GRPO and GTPO runs."""
    return [[(f"collapse-{m}-s{s}", f"{METHODS[m]}, seed {s}", STYLE[f"{m}-long"][0], "-" if m == "grpo" else "--")
             for m in ("grpo", "gtpo")] for s in TEST_SEEDS]


def report():
    write_summary()
    plots = [("curves-main.png", lambda p: plot_curves([n for n, q, *_ in RUNS if q == "main" and n != "sft"],
                                                        "GTPO vs GRPO β=0 under both Adam settings", p, 5)),
             ("curves-long.png", lambda p: plot_curves(["gtpo-long", "grpo-long"], "200 steps from <H>_ini < ln 2",
                                                       p, 10, kl=True)),
             ("curves-q7.png", lambda p: plot_curves(["q7-gtpo", "q7-grpo"], "Q7: the default objective against "
                                                     "GRPO, 200 steps", p, 10, labels=Q7_LABELS)),
             ("passk.png", plot_passk),
             ("collapse-ladder.png", lambda p: plot_runs(ladder_plot_rows(), "The collapse pilot (seed "
                                                         f"{PILOT_SEED}): GRPO solid, GTPO dashed", p)),
             ("collapse-test.png", lambda p: plot_runs(test_plot_rows(), "The collapse test at the chosen rung, "
                                                      "a row per seed", p)),
             ("curves-v1-ablation.png", lambda p: plot_curves(list(V1_LABELS), "First design's ablations", p, 5,
                                                              V1, V1_LABELS))]
    for name, plot in plots:
        done = plot(os.path.join(STUDY, name))
        print(f"{STUDY}/{name}: {'written' if done else 'not yet (no seed has every run of the figure)'}")


if __name__ == "__main__":
    report()
