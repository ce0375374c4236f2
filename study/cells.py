"""The study's per-run cells: what a per-seed table says of one run (its curves, zero-gradient and flat steps, its
evaluations, its host), and the table itself for a part's arms. study/report.py and study/q10.py lay them out.
"""
import os
import statistics

from machinery import runs
from study import plan
from study.plan import COLLAPSE_WINDOW, arm, collapse_step, load, trailing
from study.verdicts import pass1


def seed_table(p, arms, cells):
    """CELLS[cells]'s header, then a row per seed and run of `arms` (the part's own and those it reads) on the
    seeds the part has trained a run of."""
    head, cell = CELLS[cells]
    lines = list(head)
    for s in sorted({s for a in arms if a.flags for s in a.seeds}):
        found = [(a, d) for a in arms if a.start or not a.flags for owner in [arm(a.name, p)]
                 for d in [load(owner.run_id(s), p.base) if owner and s in owner.seeds else None]
                 if d is not None and len(d["rl"]) >= COLLAPSE_WINDOW]
        if any(a.flags for a, _ in found):                 # a seed this part has trained a run of
            lines += [f"| {s} | {a.label} | {cell(d)}" for a, d in found]
    return lines


def fingerprint(run_id):
    path = os.path.join(plan.KEEP, run_id, "adapter_fingerprint.json")   # read when called: tests move KEEP
    return runs.read_json(path)["fingerprint"] if os.path.isfile(path) else None


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


def q11_cells(d):
    """A Q11 run's cells: collapse step, <H>_ini and the filter as applied, the curves, the `rung` pass@1 and
    formatting share."""
    step = collapse_step(d["rl"], d.get("diverged.json"))
    rung = d["evals"].get("rung")
    filt = d["config.json"].get("entropy_filter_applied", "–")
    return (f"{step or 'none'} | {h_ini_of(d)}, {filt} | {curve_cells(d).rsplit('|', 2)[0]}| "
            + (f"{rung['pass@k']['1']:.3f} | {100 * rung['format_rate']:.0f} |" if rung else "– | – |"))


CELLS = {  # a per-seed table's header and cells function, by plan.Part.cells
    "q6_cells": (["| seed | method | collapse step | zero-gradient steps | filtered % | entropy (trailing 10): first → "
                  "max → last | format % (trailing 10): first → min → last | accuracy % (last 10) | KL to the warm-up, "
                  "last checkpoint | ID pass@1 final |", "|---|---|---|---|---|---|---|---|---|---|"], q6_cells),
    "q7_cells": (["| seed | method | ID pass@1 final | ID format % | ID length | ID pass@1 best (step) | OOD pass@1 | "
                  "train format % (first 10 → last 10) | train accuracy % (first 10 → last 10) | entropy (trailing 10): "
                  "first → min → last | steps with no reward spread | zero-gradient steps | filtered % | KL to the "
                  "warm-up, step 200 | host |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"], q7_cells),
    "q11_cells": (["| seed | method | collapse step | ⟨H⟩_ini, filter | entropy (trailing 10): first → max → last | "
                   "format % (trailing 10): first → min → last | accuracy % (last 10) | pass@1 on the rung's task | "
                   "formatted % |", "|---|---|---|---|---|---|---|---|---|"], q11_cells)}
