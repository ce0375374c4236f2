"""Figures from files a run already wrote, no model: pass@k / maj@k over k (an evaluation's results.json),
training curves (metrics.jsonl) and a logged GTPO group drawn like Fig. 9 (conflicts.render).

    python eval.py --plot runs/*/results.json         # passk.png
    python eval.py --curves runs/*/metrics.jsonl      # curves.png
    python eval.py --render runs/gtpo-x/samples.jsonl # group-step<N>.png and .html
"""
import math
import os

from analysis import conflicts
from machinery import runs
from machinery.data import DataError, read_jsonl


def model_label(res):
    """A legend label from results.json: "untrained <model>", or the run and which of its weights: "<run>, final"
    or "<run>, checkpoint-N (step N)" -- a checkpoint is named as one, not as the trained model."""
    if not res.get("adapter"):
        return f"untrained {os.path.basename(str(res.get('model', 'model')))}"
    adapter = os.path.abspath(res["adapter"])
    run, which = os.path.basename(os.path.dirname(adapter)), os.path.basename(adapter)
    step = which.removeprefix("checkpoint-")
    return f"{run}, {which} (step {step})" if step.isdigit() else f"{run}, {which}"


def passk_labels(results):
    """(title, one legend label per result): one problem set (dataset and problem count) -> its name, problem count
    and samples in the title; several -> each label names its own, and the title says to compare a curve only with
    curves of its set. A label that would repeat gets its results' place (#2, #3, ...)."""
    def where(r):
        return f"{r.get('dataset', '?')}, {r.get('n_problems', '?')} problems"
    sets, ns = {where(r) for _, r in results}, {r.get("n_samples", "?") for _, r in results}
    labels = []
    for label, r in results:
        label += f" ({where(r)})" if len(sets) > 1 else ""
        label += f", n={r.get('n_samples', '?')}" if len(ns) > 1 else ""
        labels.append(label)
    unique = [lab if not labels[:i].count(lab) else f"{lab} #{labels[:i].count(lab) + 1}" for i, lab in enumerate(labels)]
    if len(sets) > 1:
        return "different problem sets: compare a curve only with curves of its own set", unique
    n = f", n = {ns.pop()} samples a problem" if len(ns) == 1 else ""
    return f"{sets.pop()}{n}", unique


def plot_passk(results, out_png):
    """pass@k (solid) and maj@k (dashed) over k on a log-2 axis; results: [(label, results dict)]. The legend,
    beside the axes, has one colour per result and the two line styles once."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    title, labels = passk_labels(results)
    fig, ax = plt.subplots(figsize=(6, 4))
    top, handles = 0.0, []
    for i, ((_, res), label) in enumerate(zip(results, labels)):
        ks = sorted(int(k) for k in res["pass@k"])
        col = f"C{i % 10}"
        ax.plot(ks, [res["pass@k"][str(k)] for k in ks], "o-", color=col, ms=4)
        ax.plot(ks, [res["maj@k"][str(k)] for k in ks], "s--", color=col, ms=8, mfc="none")   # hollow: visible
        handles.append(Line2D([], [], color=col, lw=2, label=label))                          # where they coincide
        top = max(top, *res["pass@k"].values(), *res["maj@k"].values())
    handles += [Line2D([], [], color="k", marker="o", ms=4, label="pass@k"),
                Line2D([], [], color="k", ls="--", marker="s", ms=8, mfc="none", label="maj@k")]
    ax.set_xscale("log", base=2)
    ks = sorted({int(k) for _, res in results for k in res["pass@k"]})
    ax.set_xticks(ks, [str(k) for k in ks])                                   # 1 2 4 8, not 2^0 2^1 ...
    ax.minorticks_off()
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("k")
    ax.set_ylabel("fraction of problems solved")
    ax.set_ylim(0, min(1.0, 1.15 * top + 0.02))                  # low scores stay readable
    ax.grid(alpha=0.3)
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1), frameon=False)
    fig.savefig(out_png, dpi=120, bbox_inches="tight")          # the legend beside the axes, not over the curves
    plt.close(fig)


CURVE_KEYS = {"reward": "total reward (0-20)", "rewards/format": "formatting reward (0-10)",
              "rewards/accuracy": "correctness reward (0-10)", "entropy": "mean token entropy (nats)",
              "kl": "KL to reference", "gtpo/conflict_frac": "conflict tokens / tokens",
              "completions/mean_length": "completion length (tokens)", "loss": "loss"}


def trailing_mean(values, window):
    """Mean of each value and the window - 1 before it (fewer at the start): the curves' smoothing."""
    return [sum(values[max(0, j - window + 1):j + 1]) / len(values[max(0, j - window + 1):j + 1])
            for j in range(len(values))]


def held_out_axis(ax, held):
    """The held-out evaluations (machinery/heldout.py's rows) on their own right-hand axis of the reward panel: pass@1 at
    each evaluated step, a dashed line with markers per run, labelled with its problems and samples."""
    twin = ax.twinx()
    for i, rows in enumerate(held):
        if rows:
            twin.plot([r["step"] for r in rows], [r["eval/pass@1"] for r in rows], color=f"C{i % 10}", ls="--",
                      marker="o", ms=3, lw=1)
    sets = {(r["eval/problems"], r["eval/n"]) for rows in held for r in rows}
    what = ", ".join(f"{p} problems x {n}" for p, n in sorted(sets))
    twin.set_ylabel(f"held-out pass@1 (dashed; {what})", fontsize=8)
    twin.set_ylim(-0.02, 1.02)


def plot_curves(metric_files, out_png, smooth=5):
    """Training curves over steps (RL steps only), one line per metrics.jsonl: reward, format,
    accuracy, entropy, KL, conflict fraction, length, loss (the paper's Fig. 1, 2-top, 4, 5 view); beside the
    reward, on its own axis, the held-out pass@1 of the run's evaluations (train.py --eval_steps)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator
    rows_of = {f: [r for _, r in read_jsonl(f)] for f in metric_files}
    runs = [(os.path.basename(os.path.dirname(os.path.abspath(f))) or f,
             [r for r in rows_of[f] if r.get("phase", "rl") == "rl"]) for f in metric_files]
    held = [[r for r in rows_of[f] if r.get("phase") == "eval"] for f in metric_files]
    keys = [k for k in CURVE_KEYS if any(k in r for _, rows in runs for r in rows)]
    if not keys:
        raise DataError(f"no RL-step metrics ({', '.join(list(CURVE_KEYS)[:3])}, ...) in {', '.join(metric_files)}")
    cols = 2
    fig, axes = plt.subplots(math.ceil(len(keys) / cols), cols, figsize=(10, 2.6 * math.ceil(len(keys) / cols)),
                             squeeze=False)
    for ax, key in zip(axes.flat, keys):
        for i, (name, rows) in enumerate(runs):
            pts = [(r["step"], r[key]) for r in rows if key in r]
            if not pts:
                continue
            x, y = zip(*pts)
            col = f"C{i % 10}"
            ax.plot(x, y, color=col, alpha=0.3 if smooth > 1 else 1.0, lw=0.8)
            if smooth > 1:
                ax.plot(x, trailing_mean(y, smooth), color=col, lw=1.6, label=name)
            else:
                ax.lines[-1].set_label(name)
        ax.set_title(key, fontsize=9)
        ax.set_ylabel(CURVE_KEYS[key], fontsize=8)
        ax.set_xlabel("optimizer step", fontsize=8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))                # steps are whole: no 2.5
        ax.grid(alpha=0.3)
        if key == "entropy":
            ax.axhline(math.log(2), color="k", ls=":", lw=1)
        if key == "reward" and any(held):
            held_out_axis(ax, held)
    for ax in axes.flat[len(keys):]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(4, len(labels)), fontsize=8)
    smoothing = f"thin: each step, thick: trailing mean of the last {smooth} steps; " if smooth > 1 else ""
    fig.suptitle(f"RL steps; {smoothing}dotted: ln 2 (Eq. 6)", fontsize=9)
    fig.tight_layout(rect=(0, 0.06, 1, 0.97))
    fig.savefig(out_png, dpi=110)
    plt.close(fig)


def plot_main(args):
    """--plot / --curves / --render: figures from files already written, no model."""
    out = args.output_dir or (os.path.dirname(os.path.abspath(args.render)) if args.render else "runs")
    os.makedirs(out, exist_ok=True)
    for f in (args.plot or []) + (args.curves or []) + ([args.render] if args.render else []):
        if not os.path.isfile(f):
            raise DataError(f"{f!r} does not exist")
    if args.render:
        try:
            paths, note = conflicts.render(args.render, out, args.render_step)
            print("wrote " + " and ".join(paths) + (f"\nnote: {note}" if note else ""))
        except ValueError as e:
            raise DataError(f"--render {args.render}: {e}") from None
    if args.plot:
        plot_passk([(model_label(res), res) for res in map(runs.read_json, args.plot)], os.path.join(out, "passk.png"))
        print(f"wrote {os.path.join(out, 'passk.png')}")
    if args.curves:
        plot_curves(args.curves, os.path.join(out, "curves.png"), args.smooth)
        print(f"wrote {os.path.join(out, 'curves.png')}")
    return 0
