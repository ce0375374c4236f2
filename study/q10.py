"""Part 10 (Q10) of docs/study.md, one concern: which gamma of Eq. 7 keeps Q6's protection without Q7's cost, and
whether the default protects. From study/plan.py's part q10 and the committed files: the declared next step
(next_step), the answer a user reads (answer), its section of the summary (q10_lines, q10_outcome) and its figure
(plot_q10).
"""
import statistics

from study.cells import seed_table
from study.plan import arm, collapse_step, load, part
from study.verdicts import holm, test_row, test_rows, verdict

GRPO_COLLAPSE, GRPO_LEARN = "q6-grpo", "q10-learn-grpo"
DEFAULT = ("q10-collapse-released", "q7-released")              # the released term at gamma 0.1, in each setting
# (label, gamma or None, the collapse setting's arm, the learning setting's arm), in gamma's order
ROWS = [("GRPO β=0", None, GRPO_COLLAPSE, GRPO_LEARN),
        ("GRPO β=0, Q7's runs", None, None, "q7-grpo"),
        ("Eq. 7, γ 0", 0.0, None, "q8-nogamma"),
        ("Eq. 7, γ 0.001", 0.001, "q10-collapse-g0.001", "q10-learn-g0.001"),
        ("Eq. 7, γ 0.01", 0.01, "q10-collapse-g0.01", "q10-learn-g0.01"),
        ("Eq. 7, γ 0.03", 0.03, "q10-collapse-g0.03", "q10-learn-g0.03"),
        ("Eq. 7, γ 0.1", 0.1, "q6-gtpo", "q7-gtpo"),
        ("released, γ 0.1 (the default)", 0.1, *DEFAULT)]


def family(p, name):
    """The part's protects / costs test whose contrast names the arm."""
    return next(t for t in p.tests if t.holm and any(n == name for _, n in t.contrasts[0]))


def adjusted(p, tests):
    """The tests' rows with each verdict from Holm over exactly these tests; None until every one has all its
    seeds."""
    rows = [test_row(t, p) for t in tests]
    if any("p" not in r or r["units"] < r["expected"] for r in rows):
        return None
    for t, r, q in zip(tests, rows, holm([r["p"] for r in rows])):
        r["p_holm"], r["verdict"] = q, verdict(t.sign, r["mean"], q, None, t.regime, t.names)
    return rows


def next_step(p=None):
    """docs/study.md part 10's one next step, from the default's and gamma 0.01's three tests, Holm over those three
    -> "0.001" (0.01 protects and costs), "0.03" (it neither protects nor costs), "stop" (it does both, or it costs
    and does not protect), or None until the three have every seed."""
    p = p or part("q10")
    rows = adjusted(p, [family(p, DEFAULT[0]), family(p, "q10-collapse-g0.01"), family(p, "q10-learn-g0.01")])
    if rows is None:
        return None
    protects, costs = rows[1]["verdict"] == "holds", rows[2]["verdict"] == "contradicted"
    return "0.001" if protects and costs else "0.03" if not protects and not costs else "stop"


def gamma_verdicts(p, rows):
    """gamma -> (protects row, costs row) for each gamma of Eq. 7 whose two tests have every seed."""
    by_test = dict(zip(map(id, p.tests), rows))
    out = {}
    for _, g, collapse, learn in ROWS:
        if g and learn.startswith("q10-"):               # an Eq. 7 gamma Q10 trains in both settings
            pr, co = by_test[id(family(p, collapse))], by_test[id(family(p, learn))]
            if all("p" in r and r["units"] == r["expected"] for r in (pr, co)):
                out[g] = (pr, co)
    return out


def answer(p=None):
    """What a user reads first: the gammas that protect (Q6's test) and do not cost (Q7's), Holm over the whole
    family, or that none tried does; the default's protection beside it."""
    p = p or part("q10")
    rows = test_rows(p, p.tests)
    found, step = gamma_verdicts(p, rows), next_step(p)
    if 0.01 not in found or step is None:
        return "not finished: the first step's runs are not all evaluated"
    more = {"0.001": 0.001, "0.03": 0.03}.get(step)
    if more is not None and more not in found:
        return f"not finished: the rule's next step, γ {step}, is not all evaluated"
    both = [g for g, (pr, co) in found.items() if pr["verdict"] == "holds" and co["verdict"] != "contradicted"]
    said = "; ".join(f"γ {g}: collapses in {pr['counts'][1]} of {pr['units']} seeds against GRPO's {pr['counts'][0]} "
                     f"(Holm p = {pr['p_holm']:.3f}), ID pass@1 {co['mean']:+.3f} against GRPO (Holm p = "
                     f"{co['p_holm']:.3f})" for g, (pr, co) in sorted(found.items()))
    d = rows[p.tests.index(family(p, DEFAULT[0]))]
    default = (f"the default (released term, γ 0.1) {'protects' if d['verdict'] == 'holds' else 'does not protect'}: "
               f"it collapses in {d['counts'][1]} of {d['units']} seeds against GRPO's {d['counts'][0]} "
               f"(Holm p = {d['p_holm']:.3f})")
    head = (" or ".join(f"use `--entropy_term eq7 --ent_gamma {g}`" for g in both) +
            " (it protects and no drop in ID pass@1 is detected)" if both else "no γ tried does both")
    return f"{head} — {said}; {default}"


def arm_cells(name, setting):
    """An arm's mean figures over its finished seeds in one setting -> dict, or None when it has none."""
    a = name and arm(name)
    ds = [d for d in (load(a.run_id(s)) for s in a.seeds) if d and len(d["rl"]) >= 10] if a else []
    if setting == "collapse":
        ev = [d["evals"]["rung"] for d in ds if "rung" in d["evals"]]
        return ds and {"n": len(ds), "collapses": sum(collapse_step(d["rl"], d.get("diverged.json")) is not None
                                                      for d in ds),
                       "rung": ev and statistics.fmean(e["pass@k"]["1"] for e in ev), "rung_n": len(ev),
                       "rung_format": ev and statistics.fmean(e["format_rate"] for e in ev)}
    ev = [d["evals"] for d in ds if "id" in d["evals"]]
    return ev and {"n": len(ev), "id": statistics.fmean(e["id"]["pass@k"]["1"] for e in ev),
                   "id_format": statistics.fmean(e["id"]["format_rate"] for e in ev),
                   "ood": statistics.fmean(e["ood"]["pass@k"]["1"] for e in ev if "ood" in e) if all(
                       "ood" in e for e in ev) else None}


def arm_lines():
    """A row per arm of ROWS that has finished runs: collapses out of its seeds and the `rung` figures where GRPO
    collapses; ID pass@1, its formatting share and OOD pass@1 where the model learns."""
    lines = ["| arm | collapses (of seeds) | pass@1 / format % on the rung's task | ID pass@1 (seeds) | ID format % | "
             "OOD pass@1 | runs: collapse / learning |", "|---|---|---|---|---|---|---|"]
    pct = lambda x: "–" if x in (None, []) else f"{100 * x:.0f}"            # noqa: E731
    num = lambda x: "–" if x in (None, []) else f"{x:.3f}"                  # noqa: E731
    for label, _, collapse, learn in ROWS:
        c, l_ = arm_cells(collapse, "collapse"), arm_cells(learn, "learn")
        if not (c or l_):
            continue
        where = " / ".join("–" if not n else "Q10" if n.startswith("q10-") else "read" for n in (collapse, learn))
        collapsed = f"{c['collapses']} of {c['n']}" if c else "–"
        rung = f"{num(c['rung'])} / {pct(c['rung_format'])}" if c else "–"
        rung += f" ({c['rung_n']} evaluated)" if c and c["rung_n"] < c["n"] else ""
        id_ = f"{num(l_['id'])} ({l_['n']})" if l_ else "–"
        lines.append(f"| {label} | {collapsed} | {rung} | {id_} | {pct(l_ and l_['id_format'])} | "
                     f"{num(l_ and l_['ood'])} | {where} |")
    return lines


def q10_lines(p):
    """The section: the answer as its rule, the arms' table, each test's sentence with Holm over the family, the
    next step, then the per-seed tables of both settings."""
    from study.verdicts import sentence
    rows = test_rows(p, p.tests)
    step = next_step(p)
    arms = p.arm_list()
    collapse = [a for a in arms if a.name.startswith("q10-collapse") or a.name in ("q6-grpo", "q6-gtpo")]
    learn = [a for a in arms if a.name.startswith("q10-learn") or a.name.startswith(("q7-", "q8-"))]
    later = {a.name for a in arms if a.when and a.when != step}        # a next step the rule has not taken
    shown = [(t, r) for t, r in zip(p.tests, rows) if not later & {n for _, n in t.contrasts[0]}]
    lines = arm_lines() + [""] + [f"- {t.claim}: {sentence(t, r)}" for t, r in shown]
    lines += ["", "Next step by the declared rule (the default's and γ 0.01's tests, Holm over those three): " +
              {None: "not decided yet (γ 0.001 if γ 0.01 costs, γ 0.03 if it does not protect)", "stop": "stop",
               "0.001": "γ 0.001 in both settings", "0.03": "γ 0.03 in both settings"}[step]]
    lines += ["", "Where GRPO collapses (Q6's setting), each run:", ""] + seed_table(p, collapse, "q6_cells")
    lines += ["", "Where the model learns (Q7's setting), each run:", ""] + seed_table(p, learn, "q7_cells")
    return [("q10", p.title, answer(p), lines)]


def q10_outcome(a):
    """The answers table's cell: each arm's collapses where GRPO collapses, and its ID pass@1 where the model
    learns, for settings whose seeds are all in; an arm still running is pointed to, so the table changes only
    when an arm completes."""
    cells, running = [], False
    for label, _, collapse, learn in ROWS:
        c, l_ = arm_cells(collapse, "collapse"), arm_cells(learn, "learn")
        whole = lambda name, got: got and got["n"] == len(arm(name).seeds)          # noqa: E731
        running |= any(got and not whole(name, got) for name, got in ((collapse, c), (learn, l_)))
        said = ([f"collapses {c['collapses']} of {c['n']}"] if whole(collapse, c) else []) + (
            [f"ID pass@1 {l_['id']:.3f}, {100 * l_['id_format']:.0f} % formatted"] if whole(learn, l_) else [])
        if said and label != "GRPO β=0, Q7's runs":
            cells.append(f"{label}: {', '.join(said)}")
    cells += ["arms still running: study/summary.md, Q10"] if running else []
    return "; ".join(cells) if cells else "not run"


def plot_q10(path, p):
    """Collapses out of 8 (left) and each seed's ID pass@1 with the arm's mean (right) against gamma on a log axis,
    gamma = 0 at its left; the default marked apart, GRPO as lines; hollow: runs read from Q6-Q8."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    zero = 3e-4                                            # where gamma = 0 sits on the log axis
    drawn = False
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for label, g, collapse, learn in ROWS:
        if g is None:
            continue
        default = (collapse, learn) == DEFAULT
        x = (g or zero) * (1.25 if default else 1.0)
        marker, color = ("*", "tab:purple") if default else ("o", "tab:blue")
        c = arm_cells(collapse, "collapse")
        if c:
            here = collapse.startswith("q10-")
            left.plot([x], [c["collapses"]], marker, ms=12 if default else 8, color=color,
                      mfc=color if here else "none", label="the default (released, γ 0.1)" if default else None)
            drawn |= here
        a = learn and arm(learn)
        vals = [d["evals"]["id"]["pass@k"]["1"] for d in (load(a.run_id(s)) for s in a.seeds)
                if d and "id" in d["evals"]] if a else []
        if vals:
            here = learn.startswith("q10-")
            right.plot([x] * len(vals), vals, ".", color=color, alpha=0.5)
            right.plot([x], [statistics.fmean(vals)], marker, ms=12 if default else 8, color=color,
                       mfc=color if here else "none")
            drawn |= here
    grpo = arm_cells(GRPO_COLLAPSE, "collapse")
    if grpo:
        left.axhline(grpo["collapses"], color="tab:orange", ls="--", label=f"GRPO β=0 ({grpo['n']} seeds)")
    for name, ls, label in ((GRPO_LEARN, "--", "GRPO β=0, same warm-ups"), ("q7-grpo", ":", "GRPO β=0, Q7's runs")):
        g = arm_cells(name, "learn")
        if g:
            right.axhline(g["id"], color="tab:orange", ls=ls, label=label)
    if not drawn:
        plt.close(fig)
        return False
    ticks = [zero, 1e-3, 1e-2, 3e-2, 1e-1]
    for ax, title, ylabel in ((left, "where GRPO collapses (Q6's setting)", "runs collapsed (of 8)"),
                              (right, "where the model learns (Q7's setting)", "ID pass@1 (dots: seeds)")):
        ax.set_xscale("log")
        ax.set_xticks(ticks, ["0", "0.001", "0.01", "0.03", "0.1"])
        ax.set_xlim(zero / 2, 0.2)
        ax.set_xlabel("γ of the entropy term (Eq. 7 as written; ★ the released term)")
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8, loc="best")
    left.set_ylim(-0.5, 8.5)
    left.text(zero, 4, "not run\nin this\nsetting", ha="center", va="center", fontsize=8, color="gray")
    fig.suptitle("Q10: the entropy term's γ (filled: trained for Q10; hollow: Q6–Q8's runs, other hosts)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
