"""The study's figures (study/*.png), drawn from the parts of study/plan.py and the committed files: each Part's
`figures` names a function here and its arguments. Paired seeds only (those every configuration of a figure has
finished), words in legends.
"""
import math
import statistics

from study.plan import COLLAPSE_WINDOW, EVALS, LADDER, METHODS, N_SAMPLES, PILOT_SEED, TEST_SEEDS, arm, collapse_step, \
    load, trailing
from study.q10 import plot_q10                  # noqa: F401 -- drawn by name (Part.figures), beside its rule
from study.q11 import plot_q11                  # noqa: F401 -- drawn by name (Part.figures), beside its rule
from study.verdicts import pass1

STYLE = {"gtpo-a6": ("tab:blue", "-"), "gtpo-a9": ("tab:blue", "--"), "grpo-a6": ("tab:orange", "-"),
         "grpo-a9": ("tab:orange", "--"), "grpo-kl6": ("tab:red", "--"), "sft": ("tab:green", "-"),
         "gtpo-long": ("tab:blue", "-"), "grpo-long": ("tab:orange", "-"), "q7-grpo": ("tab:orange", "-"),
         "q7-gtpo": ("tab:blue", "-"), "q7-released": ("tab:purple", "--"), "q8-nogamma": ("tab:green", "--")}



def paired_seeds(names, p):
    arms = [arm(n, p) for n in names]
    return [s for s in sorted(set.intersection(*(set(a.seeds) for a in arms)))
            if all(load(a.run_id(s), p.base) for a in arms)]


PANELS = [("rewards/format", 10.0, "formatting (% of 10 points)"), ("rewards/accuracy", 10.0, "accuracy (% of 10)"),
          ("entropy", 1.0, "mean token entropy <H> (nats)"),
          ("gtpo/conflict_frac", 1.0, "conflict tokens / tokens (logged by GTPO only)")]


def pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_curves(path, p, names, title, smooth, kl=False):
    """PANELS per RL step for each of the part's arms in names, the mean over paired seeds; kl: one more panel,
    the drift from the start at each checkpoint (the `kl` evaluation)."""
    plt = pyplot()
    seeds = paired_seeds(names, p)
    runs_ = {n: [load(arm(n, p).run_id(s), p.base) for s in seeds] for n in names}
    if kl:
        seeds = [s for k, s in enumerate(seeds) if all(runs_[n][k]["evals"].get("kl") for n in names)]
        runs_ = {n: [load(arm(n, p).run_id(s), p.base) for s in seeds] for n in names}
    if not seeds:
        return False
    fig, axes = plt.subplots(1, len(PANELS) + kl, figsize=(4.2 * (len(PANELS) + kl), 3.8))
    for i, name in enumerate(names):
        color, ls = STYLE.get(name, (f"C{i}", "-"))
        rows = [d["rl"] for d in runs_[name]]
        for ax, (key, scale, _) in zip(axes, PANELS):
            curves = [[scale * r[key] for r in rr if key in r] for rr in rows]
            if not all(curves):
                continue
            n = min(map(len, curves))
            steps = [r["step"] for r in rows[0] if key in r][:n]
            per_step = [statistics.fmean(c[j] for c in curves) for j in range(n)]
            ax.plot(steps, trailing(per_step, smooth), color=color, ls=ls, lw=1.6, label=arm(name, p).label)
        if kl:
            points = [d["evals"]["kl"]["points"] for d in runs_[name]]
            axes[-1].plot([q["step"] for q in points[0]], [statistics.fmean(q[j]["kl"] for q in points)
                                                           for j in range(len(points[0]))],
                          color=color, ls=ls, lw=1.6, marker="o", ms=3)
    if kl:
        probe = runs_[names[0]][0]["evals"]["kl"]
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


def plot_passk(path, p):
    """pass@k and maj@k, k = 1, 2, 4, 8, on both sets: the main part's configurations, paired seeds."""
    plt = pyplot()
    names = [a.name for a in p.arm_list() if a.start]
    seeds = [s for s in paired_seeds(names, p) if all(load(f"{n}-s{s}")["evals"].get(e) for n in names for e in EVALS)]
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
                        color=color, ls=ls, label=arm(name, p).label)
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


def plot_q8(path, p):
    """Q8: each seed's final ID pass@1 under the four arms, joined by a line; the four arms' entropy (trailing
    10-step mean over the seeds that have all four runs)."""
    plt = pyplot()
    names = ["q7-grpo", "q7-gtpo", "q7-released", "q8-nogamma"]
    got = {s: [load(arm(n, p).run_id(s)) for n in names] for s in sorted(arm("q7-released", p).seeds)}
    got = {s: ds for s, ds in got.items() if all(d and "id" in d["evals"] for d in ds)}
    if not got:
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for s, ds in got.items():
        left.plot(range(len(names)), [pass1(d, "id")[0] for d in ds], marker="o", ms=4, lw=1, alpha=0.7,
                  label=f"seed {s}")
    left.set_xticks(range(len(names)), [arm(n, p).label for n in names], fontsize=8, rotation=10)
    left.set_ylabel("ID pass@1, final adapter", fontsize=9)
    left.legend(fontsize=7, ncol=2)
    for k, n in enumerate(names):
        curves = [[r["entropy"] for r in ds[k]["rl"]] for ds in got.values()]
        m = min(map(len, curves))
        color, ls = STYLE[n]
        right.plot(range(1, m + 1), trailing([statistics.fmean(c[j] for c in curves) for j in range(m)], 10),
                   color=color, ls=ls, lw=1.6, label=arm(n, p).label)
    right.axhline(math.log(2), color="k", ls=":", lw=1, label="ln 2 (Eq. 6)")
    right.set_xlabel("RL step", fontsize=9)
    right.set_title("mean token entropy <H> (nats), trailing 10 steps", fontsize=9)
    right.legend(fontsize=8)
    for ax in (left, right):
        ax.grid(alpha=0.3)
    fig.suptitle(f"Q8: seeds {', '.join(map(str, got))}, every arm from the seed's warm-up", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_q9(path, p):
    """Q9: per seed, ID pass@1 at the warm-up (step 0), at the best checkpoint (its step) and at step 200, for
    the released term and GRPO; start and end marked."""
    plt = pyplot()
    names = ["q7-released", "q7-grpo"]
    seeds = [s for s in arm("warmup-q9", p).seeds if (w := load(f"warmup-q9-s{s}")) and "id" in w["evals"]
             and all((d := load(arm(n, p).run_id(s))) and "id" in d["evals"] for n in names)]
    if not seeds:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, n in zip(axes, names):
        for s in seeds:
            w, d = load(f"warmup-q9-s{s}"), load(arm(n, p).run_id(s))
            xs, ys = [0], [pass1(w, "id")[0]]
            if "id-best" in d["evals"] and d.get("best.json", {}).get("step", 200) < 200:
                xs.append(d["best.json"]["step"])
                ys.append(pass1(d, "id-best")[0])
            xs.append(200)
            ys.append(pass1(d, "id")[0])
            ax.plot(xs, ys, color="0.6", lw=1, marker=".", ms=5)
            ax.plot([0], ys[:1], "o", color="tab:green", ms=5)
            ax.plot([200], ys[-1:], "s", color=STYLE[n][0], ms=5)
        ax.plot([], [], "o", color="tab:green", label="start: the SFT warm-up (step 0)")
        ax.plot([], [], "s", color=STYLE[n][0], label="end: step 200")
        ax.plot([], [], ".", color="0.6", label="best checkpoint (by training reward)")
        ax.set_title(arm(n, p).label, fontsize=9)
        ax.set_xlabel("RL step", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("ID pass@1 (64 held-out problems x 8)", fontsize=9)
    fig.suptitle(f"Q9: RL's own gain, seeds {', '.join(map(str, seeds))}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


RUN_PANELS = [("entropy", 1.0, "mean token entropy (nats), trailing 10 steps"),
              ("rewards/format", 10.0, "formatting (% of 10 points), trailing 10 steps"),
              ("rewards/accuracy", 10.0, "accuracy (% of 10 points), trailing 10 steps")]


def plot_runs(path, p, rows):
    """Entropy, formatting and accuracy (trailing COLLAPSE_WINDOW-step means) per RL step of single runs,
    and their KL to the start at each checkpoint where the `kl` evaluation is there; one row of panels
    per list of lines that globals()[rows]() gives, each line (run id, label, color, line style); a collapse
    step is marked."""
    plt = pyplot()
    title, rows = globals()[rows]()
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
    return (f"The collapse pilot (seed {PILOT_SEED}): GRPO solid, GTPO dashed",
            [[(f"pilot-{name}-{m}-s{PILOT_SEED}", f"{name} ({task}, lr {lr}) {METHODS[m]}", colors[name],
               "-" if m == "grpo" else "--") for name, task, lr in LADDER for m in ("grpo", "gtpo")]])


def test_plot_rows():
    """One row per seed: its GRPO and GTPO runs."""
    return ("The collapse test at the chosen rung, a row per seed",
            [[(f"collapse-{m}-s{s}", f"{METHODS[m]}, seed {s}", STYLE[f"{m}-long"][0], "-" if m == "grpo" else "--")
              for m in ("grpo", "gtpo")] for s in TEST_SEEDS])
