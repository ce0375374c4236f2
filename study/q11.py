"""Part 11 (Q11) of docs/study.md, one concern: does GTPO protect against collapse, on fresh seeds, every arm of a
seed from its one warm-up, one host kind. From study/plan.py's part q11 and the committed files: the declared power
calculation that fixed the number of seeds (power, seeds_needed), the declared rule for the project's default
(default_rule), the answer a user reads (answer), its section of the summary (q11_lines, q11_outcome) and its
figure (plot_q11).
"""
import math
import statistics

from study.plan import Q11_SEEDS, load, part

Q10_RATES = {"grpo": 6 / 8, "released": 2 / 8, "eq7": 1 / 8}  # Q10's observed collapse shares; eq7's 0 of 8 read as 1
SEED_CAP, TARGET_POWER, ALPHA = 16, 0.8, 0.05


def power(n, p_grpo, p_arm, alpha):
    """The paired exact test's power (verdicts.paired_exact_one_sided, GRPO's direction) over n seeds, each arm
    collapsing independently of the other given the seed at its rate: the chance the test rejects at `alpha`."""
    p10, p01 = p_grpo * (1 - p_arm), (1 - p_grpo) * p_arm          # GRPO only / the arm only
    q, pd, total = p10 / (p10 + p01), p10 + p01, 0.0
    for d in range(n + 1):
        p_d = math.comb(n, d) * pd ** d * (1 - pd) ** (n - d)
        for b in range(d // 2 + 1, d + 1):
            if sum(math.comb(d, x) for x in range(b, d + 1)) / 2 ** d <= alpha:
                total += p_d * math.comb(d, b) * q ** b * (1 - q) ** (d - b)
    return total


def seeds_needed(rates=Q10_RATES, cap=SEED_CAP):
    """The declared number of seeds: the fewest (from 8) at which the default's test, the harder of the two, reaches
    TARGET_POWER at Holm's first level (ALPHA / 2) for Q10's rates; the cap where none within it does."""
    return next((n for n in range(8, cap + 1) if power(n, rates["grpo"], rates["released"], ALPHA / 2)
                 >= TARGET_POWER), cap)


# docs/study.md part 11, "The default's rule": (γ 0.03 protects, the default protects) -> what the project does
RULE = {(True, False): "change",        # the default becomes Eq. 7 at γ 0.03
        (True, True): "keep, both",     # the default stays: it protects too
        (False, True): "keep, withdraw",  # the default stays; Q10's advice is withdrawn
        (False, False): "keep, unconfirmed"}  # the default stays; Q10's advice is not confirmed


def default_rule(eq7_protects, released_protects):
    """The declared rule's outcome for the project's default objective (RULE)."""
    return RULE[(bool(eq7_protects), bool(released_protects))]


def verdicts(p=None):
    """(Eq. 7 at γ 0.03's test row, the default's), Holm over the two; None until both have every seed."""
    from study.verdicts import test_rows
    p = p or part("q11")
    rows = test_rows(p, p.tests)
    if any("p" not in r or r["units"] < r["expected"] for r in rows):
        return None
    released, eq7 = rows                          # plan.q11_tests' order: the default, then γ 0.03
    return eq7, released


assert len(Q11_SEEDS) == seeds_needed(), "Q11_SEEDS must hold the declared power calculation's number of seeds"


# -----------------------------------------------------------------------------
# the answer, the section, the answers table's cell and the figure, from the committed files

ARMS = ("q11-grpo", "q11-released", "q11-eq7")
FOLLOWS = {"change": "the default objective becomes Eq. 7 at γ 0.03 (`--entropy_term eq7 --ent_gamma 0.03`)",
           "keep, both": "the default stays (it protects too)",
           "keep, withdraw": "the default stays; Q10's advice (Eq. 7 at γ 0.03) is withdrawn",
           "keep, unconfirmed": "the default stays; Q10's advice is not confirmed on fresh seeds, and no objective "
                                "tried is shown to protect in this setting"}


def seeds_done(p=None):
    """The seeds every arm of which has its metrics and its `rung` evaluation committed."""
    from study.plan import arm
    p = p or part("q11")
    done = []
    for s in Q11_SEEDS:
        ds = [load(arm(n, p).run_id(s)) for n in ARMS]
        if all(d is not None and "rung" in d["evals"] for d in ds):
            done.append(s)
    return done


def answer(p=None):
    """What a user reads first: each GTPO arm's verdict on the paired test, Holm over the two, and what the declared
    rule does with the default; "not finished" until every seed has its three runs evaluated."""
    p = p or part("q11")
    found = verdicts(p)
    if found is None:
        return f"not finished: {len(seeds_done(p))} of {len(Q11_SEEDS)} seeds have all three runs evaluated"
    eq7, released = found
    rule = default_rule(eq7["verdict"] == "holds", released["verdict"] == "holds")

    def said(label, r):
        word = "protects" if r["verdict"] == "holds" else "is not shown to protect"
        return (f"{label} {word}: it collapses in {r['counts'][1]} of {r['units']} seeds where GRPO collapses in "
                f"{r['counts'][0]} (paired, Holm p = {r['p_holm']:.3f})")
    return f"{FOLLOWS[rule]} — {said('Eq. 7 at γ 0.03', eq7)}; {said('the default (released, γ 0.1)', released)}"


def arm_summary(name, p):
    """An arm's collapses, `rung` pass@1 and formatting share, and final trailing entropy, over its finished seeds."""
    from study.plan import COLLAPSE_WINDOW, arm, collapse_step
    a = arm(name, p)
    ds = [d for d in (load(a.run_id(s)) for s in a.seeds) if d and len(d["rl"]) >= COLLAPSE_WINDOW]
    ev = [d["evals"]["rung"] for d in ds if "rung" in d["evals"]]
    if not ds:
        return None
    last = [statistics.fmean(r["entropy"] for r in d["rl"][-COLLAPSE_WINDOW:]) for d in ds]
    return {"label": a.label, "n": len(ds), "collapses": sum(collapse_step(d["rl"], d.get("diverged.json")) is not None
                                                           for d in ds),
            "pass1": ev and statistics.fmean(e["pass@k"]["1"] for e in ev),
            "format": ev and statistics.fmean(e["format_rate"] for e in ev), "entropy": statistics.fmean(last)}


def q11_outcome(a):
    """The answers table's cell: each arm's collapses, `rung` pass@1 and formatting share over its finished seeds."""
    p = part("q11")
    cells = [f"{s['label']}: collapses {s['collapses']} of {s['n']}, pass@1 {s['pass1']:.3f}, "
             f"{100 * s['format']:.0f} % formatted" for s in (arm_summary(n, p) for n in ARMS) if s and s["pass1"] != []]
    return "; ".join(cells) if cells else "not run"


def q11_lines(p):
    """The section: the answer by the declared rule, the arms' table, each test's sentence (paired, Holm), Fisher's
    unpaired p beside for comparison with Q10, the two GTPO arms against each other, then each run."""
    from study.cells import seed_table
    from study.verdicts import fisher_one_sided, paired_exact_one_sided, sentence, test_rows
    rows = test_rows(p, p.tests)
    lines = ["| arm | seeds | collapses | pass@1 on the rung's task | formatted % | entropy, last 10 steps |",
             "|---|---|---|---|---|---|"]
    for s in filter(None, (arm_summary(n, p) for n in ARMS)):
        num = "–" if s["pass1"] == [] else f"{s['pass1']:.3f}"
        fmt = "–" if s["format"] == [] else f"{100 * s['format']:.0f}"
        lines.append(f"| {s['label']} | {s['n']} | {s['collapses']} | {num} | {fmt} | {s['entropy']:.2f} |")
    lines.append("")
    for t, r in zip(p.tests, rows):
        lines.append(f"- {t.claim}: {sentence(t, r)}")
        if "counts" in r:
            a, b, n = r["counts"][0], r["counts"][1], r["units"]
            fisher = fisher_one_sided(a, n, b, n) if a > b else fisher_one_sided(b, n, a, n) if b > a else 1.0
            lines.append(f"  (beside it, unpaired as Q10 counted: Fisher's one-sided p = {fisher:.3f})")
    both = [(collapsed(ARMS[1], s, p), collapsed(ARMS[2], s, p)) for s in seeds_done(p)]
    if both:
        q, b, c = paired_exact_one_sided(both)
        lines.append(f"- (no rule) the default against Eq. 7 at γ 0.03, paired: seeds where only the default "
                     f"collapses {b}, where only γ 0.03 does {c} (p = {q:.3f})")
    lines += ["", "Each run (⟨H⟩_ini and the filter as the run applied them):", ""]
    return [("q11", p.title, answer(p), lines + seed_table(p, p.arm_list(), "q11_cells"))]


def collapsed(name, seed, p):
    """1 if the arm's run of the seed collapsed (Q6's rule), else 0."""
    from study.plan import arm, collapse_step
    d = load(arm(name, p).run_id(seed))
    return int(collapse_step(d["rl"], d.get("diverged.json")) is not None)


def plot_q11(path, p):
    """Each seed's collapse step under the three arms, a line joining a seed's arms (those finished so far); a run that
    never collapsed sits on the top row ("none")."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from study.plan import arm, collapse_step
    seeds = [s for s in Q11_SEEDS if any(load(arm(n, p).run_id(s)) for n in ARMS)]
    if not seeds:
        return False
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    top = 110
    for k, s in enumerate(seeds):
        runs = [(i, load(arm(n, p).run_id(s))) for i, n in enumerate(ARMS)]
        xy = [(i, collapse_step(d["rl"], d.get("diverged.json"))) for i, d in runs if d]
        jitter = (k - len(seeds) / 2) * 0.012
        ax.plot([i + jitter for i, _ in xy], [top if v is None else v for _, v in xy], "-o", color=f"C{k % 10}",
                alpha=0.7, ms=5, lw=1, label=f"seed {s}")
    ax.set_xticks(range(3), [arm(n, p).label for n in ARMS])
    ax.set_yticks([0, 25, 50, 75, 100, top], ["0", "25", "50", "75", "100", "none"])
    ax.set_ylim(0, top + 5)
    ax.set_xlim(-0.3, 2.3)
    ax.legend(fontsize=7, ncol=4, loc="lower center")
    ax.set_ylabel("collapse step (Q6's rule)")
    ax.set_title(f"Q11: collapse step per seed, a line per seed ({len(seeds_done(p))} of {len(Q11_SEEDS)} seeds "
                 f"with all three runs)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
