"""The CPU-scale study: GTPO vs GRPO vs SFT and the paper's ablations (Sec. 4-5, Fig. 1, 2, 4, 5;
App. 13, 14), on the embedded SmolLM2-135M and the built-in arithmetic task.

RUNS below is the whole experiment, one line per configuration. Every seed first gets one SFT
warm-up (WARMUP: the demo's 4 steps of 8 worked solutions); every run of that seed starts from it
(train.py --init_from) with the same budget (COMMON: steps, prompts per step, G, tokens). Each
finished run's final adapter is evaluated with eval.py on the arithmetic test split (in
distribution) and the `reworded` split (the same sums in sentences training never shows: out of
distribution, the role AIME plays in the paper), with the same n, k and sampling seed for all.
The `hard` split (larger numbers) was the first OOD set: every model scored <= 1 of 128 samples
there, so it says nothing; the runs evaluated on it keep that result as eval-hard.json.

Resumable at every level, any number of times: finished steps are skipped, an interrupted training
continues from its last checkpoint (train.py --resume), an interrupted evaluation from its last
whole problem (eval.py --resume). Ctrl-C (or SIGTERM) lets the running step finish and save.

    python study.py                                   # run or continue everything, then report
    python study.py --shard 0/2 & python study.py --shard 1/2 & wait; python study.py --report
                                                      # two workers, one thread each (1.5x throughput here)
    python study.py --list                            # the table and how far each run is
    python study.py --report                          # plots + summary from what has finished

Big files (checkpoints, adapters, eval samples, logs) stay in runs/study/. What the summary is
computed from is copied to study/<run>/ and committed: config.json, metrics.jsonl, times.json and
eval-<set>.json (eval.py's results.json). The report reads only those.
"""
import argparse
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time

import runs
from data import read_jsonl
from eval import trailing_mean

HERE = os.path.dirname(os.path.abspath(__file__))
WORK = os.path.join(HERE, "runs", "study")             # big files, never committed
KEEP = os.path.join(HERE, "study")                     # small files, committed

# -----------------------------------------------------------------------------
# the run table

COMMON = ["--model", "smollm2-135m", "--dataset", "arithmetic", "--batch_size", "1", "--generation_size", "8",
          "--max_completion_length", "96", "--max_steps", "20", "--sft_warmup_steps", "0", "--save_steps", "5"]
WARMUP = ["--model", "smollm2-135m", "--dataset", "arithmetic", "--use_sft", "--batch_size", "8",
          "--max_steps", "4", "--save_steps", "4",
          "--sft_micro_batch_size", "4"]                # as the committed warm-ups ran (same sums, same weights)
HOT = ["--lr", "1e-3"]                                  # the collapse setting: 5x the demo's learning rate
EVALS = {"id": ["--dataset", "arithmetic", "--split", "test"],
         "ood": ["--dataset", "arithmetic", "--split", "reworded"]}
RETIRED = "hard"                                        # the first OOD set, kept where it was run (see above)
EVAL_COMMON = ["--limit", "16", "--n_samples", "8", "--batch_size", "64", "--seed", "0",
               "--max_completion_length", "96"]

RUNS = [  # name              part        seeds      flags after COMMON        what it stands for
    ("gtpo",            "main",     (1, 2, 3), ["--use_gtpo"]),                        # Eq. 5-8, paper defaults
    ("grpo",            "main",     (1, 2, 3), ["--use_grpo"]),                        # Eq. 1, beta = 0
    ("grpo-kl",         "main",     (1, 2, 3), ["--use_grpo", "--beta", "0.04"]),      # beta = 0.04
    ("sft",             "main",     (1, 2, 3), ["--use_sft"]),                         # Listing 1: 1 prompt/step
    ("gtpo-masks-only", "ablation", (1, 2),    ["--use_gtpo", "--entropy_filter", "off",
                                                "--ent_gamma", "0"]),                  # Fig. 5 "No <H>_i - No delta_i"
    ("gtpo-delta",      "ablation", (1, 2),    ["--use_gtpo", "--entropy_filter", "all"]),   # Fig. 4: delta_i on
    # Fig. 4's other arm, "gamma 0.1, No delta_i", is "gtpo" itself here: after the warm-up <H>_ini
    # = 1.61 > ln 2 (measured by gtpo-s1), so Eq. 6 sets delta_i = 1 and the paper default runs unfiltered.
    ("gtpo-onlyneg",    "ablation", (1, 2),    ["--use_gtpo", "--entropy_filter", "neg"]),   # App. 13
    ("grpo-entropy",    "ablation", (1, 2),    ["--use_grpo", "--entropy_filter", "all",
                                                "--ent_threshold", "1.05"]),           # App. 14, Fig. 10c
    ("gtpo-hot",        "collapse", (1, 2),    ["--use_gtpo", *HOT]),                  # Sec. 4.2, Fig. 1
    ("grpo-hot",        "collapse", (1, 2),    ["--use_grpo", *HOT]),
    ("grpo-kl-hot",     "collapse", (1, 2),    ["--use_grpo", "--beta", "0.04", *HOT]),
]
SEEDS = tuple(sorted({s for *_, ss, _ in RUNS for s in ss}))     # each gets one warm-up
LAST_N = 5                                              # the table's training columns: mean of the last N RL steps


def jobs():
    """(run id, flags, seed) in execution order: warm-ups first, then seed by seed, main part first."""
    out = [(f"warmup-s{s}", WARMUP, s) for s in SEEDS]
    for part in ("main", "ablation", "collapse"):
        for s in SEEDS:
            out += [(f"{name}-s{s}", COMMON + flags, s) for name, p, ss, flags in RUNS if p == part and s in ss]
    return out


# -----------------------------------------------------------------------------
# running: one subprocess at a time per worker, each resumable

class Stop(Exception):
    pass


def call(cmd, log_path, threads):
    """Run cmd (its output appended to log_path) -> (exit code, seconds, stopped). A Ctrl-C or
    SIGTERM to the study is passed on once, as SIGTERM (a shell's background jobs ignore SIGINT):
    train.py finishes its step and saves; eval.py stops and later resumes from its samples."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    stopped = []
    with open(log_path, "a") as log:
        log.write(f"\n$ {' '.join(cmd)}\n")
        log.flush()
        t0 = time.time()
        child = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=HERE,
                                 start_new_session=True)        # our Ctrl-C reaches it once, through us
        def forward(signum, frame):
            stopped.append(signum)
            child.send_signal(signal.SIGTERM)           # train.py saves; eval.py resumes from its samples
        old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            rc = child.wait()
        finally:
            for s, h in old.items():
                signal.signal(s, h)
    return rc, time.time() - t0, bool(stopped)


def attempt(run_id, what, argv, log_path, done_path, shard, threads):
    """One attempt at a training ("train") or an evaluation ("eval-<set>"): run it, record its time,
    then Stop if the study was stopped, or fail when done_path did not appear."""
    print(f"[{shard[0]}/{shard[1]}] {what} {run_id}", flush=True)
    rc, sec, stopped = call(argv, log_path, threads)
    done = rc == 0 and os.path.exists(done_path)
    record_time(run_id, what, sec, done, shard)
    if stopped:
        raise Stop()
    if not done:
        raise SystemExit(f"{what} of {run_id} failed (exit {rc}); see {log_path}")


def record_time(run_id, what, seconds, finished, shard):
    """Append one attempt's wall time to study/<run>/times.json."""
    os.makedirs(os.path.join(KEEP, run_id), exist_ok=True)
    path = os.path.join(KEEP, run_id, "times.json")
    times = runs.read_json(path) if os.path.isfile(path) else {}
    times.setdefault(what, []).append({"seconds": round(seconds, 1), "finished": finished, "workers": shard[1],
                                       "date": time.strftime("%Y-%m-%dT%H:%M:%S")})
    runs.write_json(path, times)


def train(run_id, flags, seed, shard, threads):
    """Train one run to its final/ (resuming what is there); copy its small files to study/."""
    out = os.path.join(WORK, run_id)
    if not os.path.isdir(os.path.join(out, "final")):
        argv = [sys.executable, "train.py", *flags, "--seed", str(seed), "--output_dir", out]
        if not run_id.startswith("warmup"):
            argv += ["--init_from", wait_for(os.path.join(WORK, f"warmup-s{seed}", "final"))]
        if os.path.isfile(os.path.join(out, "config.json")):
            argv.append("--resume")
        os.makedirs(out, exist_ok=True)
        attempt(run_id, "train", argv, os.path.join(out, "train.log"), os.path.join(out, "final"), shard, threads)
    keep = os.path.join(KEEP, run_id)
    os.makedirs(keep, exist_ok=True)
    if run_id.startswith("warmup"):                     # the start of every run of this seed: keep its fingerprint
        found, path = adapter_fingerprint(os.path.join(out, "final")), os.path.join(keep, "adapter_fingerprint.json")
        if not os.path.isfile(path):
            runs.write_json(path, {"fingerprint": found})
        elif runs.read_json(path)["fingerprint"] != found:
            print(f"warning: {run_id} was trained again and differs from the one the finished runs started "
                  f"from (another machine?); the committed results keep the first one's files", flush=True)
    for f in ("config.json", "metrics.jsonl"):
        if not os.path.isfile(os.path.join(keep, f)) or not finished(run_id):
            shutil.copyfile(os.path.join(out, f), os.path.join(keep, f))
    return out


def evaluate(run_id, out, shard, threads):
    """eval.py on each set of EVALS (resuming what is there); results to study/<run>/eval-<set>.json."""
    for name, flags in EVALS.items():
        keep = os.path.join(KEEP, run_id, f"eval-{name}.json")
        if os.path.isfile(keep):
            continue
        dest = os.path.join(out, f"eval-{name}")
        argv = [sys.executable, "eval.py", "--adapter", os.path.join(out, "final"), *flags, *EVAL_COMMON,
                "--output_dir", dest]
        if os.path.isfile(os.path.join(dest, "samples.jsonl")):
            argv.append("--resume")
        attempt(run_id, f"eval-{name}", argv, os.path.join(out, "eval.log"), os.path.join(dest, "results.json"),
                shard, threads)
        shutil.copyfile(os.path.join(dest, "results.json"), keep)


def wait_for(path):
    """A warm-up another worker is training: wait for its final/ folder."""
    while not os.path.isdir(path):
        print(f"waiting for {path}", flush=True)
        time.sleep(30)
    return path


def finished(run_id):
    """Trained and evaluated, by the committed files alone (so also on a machine without runs/study)."""
    d = os.path.join(KEEP, run_id)
    return all(os.path.isfile(os.path.join(d, f)) for f in ("metrics.jsonl", *(f"eval-{s}.json" for s in EVALS)))


def adapter_fingerprint(folder):
    """runs.weights_fingerprint of the adapter's tensors in name order: is a retrained warm-up the same one?"""
    from safetensors.torch import load_file
    tensors = load_file(os.path.join(folder, "adapter_model.safetensors"))
    return list(runs.weights_fingerprint([tensors[k] for k in sorted(tensors)]))


def run_all(shard):
    k, n = shard
    threads = max(1, (os.cpu_count() or 1) // n)
    mine = [j for i, j in enumerate(jobs()) if i % n == k]
    for run_id, flags, seed in mine:
        if finished(run_id) and not run_id.startswith("warmup"):
            continue            # a warm-up's final/ is rebuilt when missing: later runs start from it
        out = train(run_id, flags, seed, shard, threads)
        evaluate(run_id, out, shard, threads)


def status():
    for run_id, flags, seed in jobs():
        keep, out = os.path.join(KEEP, run_id), os.path.join(WORK, run_id)
        ckpts = sorted(int(d.split("-")[1]) for d in os.listdir(out) if d.startswith("checkpoint-")) \
            if os.path.isdir(out) else []
        evals = [s for s in EVALS if os.path.isfile(os.path.join(keep, f"eval-{s}.json"))]
        state = ("done (committed)" if finished(run_id) else
                 "trained" if os.path.isdir(os.path.join(out, "final")) else
                 f"at checkpoint {ckpts[-1]}" if ckpts else "started" if os.path.isdir(out) else "to do")
        print(f"{run_id:22s} {state:18s} evaluated: {', '.join(evals) or '-'}")


# -----------------------------------------------------------------------------
# the report: only from the committed files in study/

def load(run_id):
    """metrics rows (RL steps), eval results by set, times of one run; None if it has not finished."""
    d = os.path.join(KEEP, run_id)
    if not os.path.isfile(os.path.join(d, "metrics.jsonl")):
        return None
    rows = [r for _, r in read_jsonl(os.path.join(d, "metrics.jsonl"))]
    evals = {s: runs.read_json(os.path.join(d, f"eval-{s}.json")) for s in (*EVALS, RETIRED)
             if os.path.isfile(os.path.join(d, f"eval-{s}.json"))}
    times = runs.read_json(os.path.join(d, "times.json")) if os.path.isfile(os.path.join(d, "times.json")) else {}
    return {"rl": [r for r in rows if r.get("phase") == "rl"], "all": rows, "evals": evals, "times": times}


def mean_std(xs):
    """(mean, sample std over seeds, n) of the values present."""
    xs = [x for x in xs if x is not None]
    if not xs:
        return None
    return statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0, len(xs)


def last_n(rows, key, scale=1.0):
    vals = [r[key] for r in rows[-LAST_N:] if key in r]
    return scale * statistics.fmean(vals) if vals else None


COLUMNS = [  # label, function of one run's data -> number or None
    ("format % (last 5)", lambda d: last_n(d["rl"], "rewards/format", 10.0)),
    ("accuracy % (last 5)", lambda d: last_n(d["rl"], "rewards/accuracy", 10.0)),
    ("entropy (last 5)", lambda d: last_n(d["rl"], "entropy")),
    ("ID pass@1", lambda d: d["evals"].get("id", {}).get("pass@k", {}).get("1")),
    ("ID pass@8", lambda d: d["evals"].get("id", {}).get("pass@k", {}).get("8")),
    ("ID maj@8", lambda d: d["evals"].get("id", {}).get("maj@k", {}).get("8")),
    ("OOD pass@1", lambda d: d["evals"].get("ood", {}).get("pass@k", {}).get("1")),
    ("OOD pass@8", lambda d: d["evals"].get("ood", {}).get("pass@k", {}).get("8")),
    ("OOD maj@8", lambda d: d["evals"].get("ood", {}).get("maj@k", {}).get("8")),
    ("entropy max", lambda d: max((r["entropy"] for r in d["rl"] if "entropy" in r), default=None)),
    ("KL max", lambda d: max((r["kl"] for r in d["rl"] if "kl" in r), default=None)),
    ("train min/run", lambda d: sum(t["seconds"] for t in d["times"].get("train", [])) / 60 or None),
]
PAIRS = [  # the paper's comparisons: A - B seed by seed (the runs of one seed share warm-up and prompts)
    ("Fig. 2", "gtpo", "grpo"), ("Fig. 2", "gtpo", "grpo-kl"), ("Fig. 2-3", "gtpo", "sft"),
    ("Fig. 4 (delta_i = 1 in gtpo here)", "gtpo-delta", "gtpo"),
    ("Fig. 5", "gtpo-masks-only", "gtpo"), ("Fig. 5", "gtpo-masks-only", "grpo"),
    ("App. 13", "gtpo-onlyneg", "gtpo"), ("App. 14", "grpo-entropy", "grpo"), ("App. 14", "gtpo", "grpo-entropy"),
    ("Fig. 1, lr 1e-3", "gtpo-hot", "grpo-hot"), ("Fig. 1, lr 1e-3", "gtpo-hot", "grpo-kl-hot"),
]
PAIR_COLUMNS = ["accuracy % (last 5)", "entropy (last 5)", "entropy max", "ID pass@1", "ID pass@8", "OOD pass@1"]


def configs():
    """(name, part, seeds) of the warm-up and every configuration of RUNS."""
    return [("warmup", "start", SEEDS)] + [(name, part, ss) for name, part, ss, _ in RUNS]


def summarize():
    """One row per configuration: mean, std and n over its finished seeds for every COLUMN."""
    table = []
    for name, part, seeds in configs():
        data = [d for d in (load(f"{name}-s{s}") for s in seeds) if d is not None]
        cells = {label: mean_std([f(d) for d in data]) for label, f in COLUMNS}
        table.append({"config": name, "part": part, "seeds_done": len(data), "seeds": len(seeds), **cells})
    return table


def paired(a, b):
    """{column: [(seed, A - B), ...]} over the seeds where both runs have finished and the column exists."""
    cols = dict(COLUMNS)
    both = [(s, load(f"{a}-s{s}"), load(f"{b}-s{s}")) for s in SEEDS]
    out = {}
    for label in PAIR_COLUMNS:
        vals = [(s, cols[label](da), cols[label](db)) for s, da, db in both if da and db]
        out[label] = [(s, va - vb) for s, va, vb in vals if va is not None and vb is not None]
    return out


def pair_lines():
    """The paired table of summary.md: each seed's difference, and in how many seeds A is above B."""
    head = ["paper", "A - B", "seeds"] + PAIR_COLUMNS
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for claim, a, b in PAIRS:
        diffs = paired(a, b)
        n = max(len(d) for d in diffs.values())
        if n == 0:
            continue
        cells = []
        for label in PAIR_COLUMNS:
            d = [x for _, x in diffs[label]]
            digits = 1 if "%" in label else 3
            signs = f" ({sum(x > 0 for x in d)}+ {sum(x < 0 for x in d)}-)"
            cells.append(" ".join(f"{x:+.{digits}f}" for x in d) + signs if d else "–")
        lines.append("| " + " | ".join([claim, f"{a} - {b}", str(n)] + cells) + " |")
    return lines


def write_summary(table):
    def cell(v, digits, seeds):
        if v is None:
            return "–"
        text = f"{v[0]:.{digits}f} ± {v[1]:.{digits}f}" if v[2] > 1 else f"{v[0]:.{digits}f}"
        return text if v[2] == seeds else f"{text} (n={v[2]})"
    digits = {"format": 1, "accuracy": 1, "entropy": 3, "train": 1}
    head = ["config", "part", "seeds"] + [label for label, _ in COLUMNS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in table:
        lines.append("| " + " | ".join([r["config"], r["part"], f"{r['seeds_done']}/{r['seeds']}"] +
                                      [cell(r[label], digits.get(label.split()[0], 3), r["seeds_done"])
                                       for label, _ in COLUMNS]) + " |")
    total = sum(t["seconds"] for name, _, seeds in configs() for s in seeds
                for d in [load(f"{name}-s{s}")] if d for ts in d["times"].values() for t in ts)
    lines.append(f"\nmean ± sample std over the finished seeds; training columns: mean of the last {LAST_N} RL steps "
                 f"(format and accuracy as % of their 10 points); time spent by the workers on all runs and "
                 f"evaluations so far: {total / 3600:.2f} h, summed over workers (with 2 workers the wall time is "
                 f"about half; each run's times.json has every attempt).")
    lines += [f"\nPaired by seed: A - B for each seed both have finished, in seed order; (k+ m-) counts the "
              f"seeds where A is above / below B.\n"] + pair_lines()
    hard = [d["evals"][RETIRED] for name, _, seeds in configs() for s in seeds
            for d in [load(f"{name}-s{s}")] if d and RETIRED in d["evals"]]
    if hard:
        lines.append(f"\nThe first OOD set, the `{RETIRED}` split, was evaluated for {len(hard)} runs before it was "
                     f"retired: pass@1 <= {max(r['pass@k']['1'] for r in hard):.3f} and pass@8 <= "
                     f"{max(r['pass@k']['8'] for r in hard):.3f} for every one of them (eval-{RETIRED}.json).")
    runs.write_text(os.path.join(KEEP, "summary.md"), "\n".join(lines) + "\n")
    runs.write_json(os.path.join(KEEP, "summary.json"), table)
    print("\n".join(lines))


def band(ax, runs_rows, key, scale, color, label, smooth=5):
    """Mean over seeds (trailing moving average of `smooth` steps) and the min-max band of the seeds."""
    curves = []
    for rows in runs_rows:
        y = [(r["step"], scale * r[key]) for r in rows if key in r]
        if y:
            steps, vals = zip(*y)
            curves.append((steps, trailing_mean(vals, smooth)))
    if not curves:
        return
    n = min(len(c[1]) for c in curves)
    x = curves[0][0][:n]
    per_step = list(zip(*[c[1][:n] for c in curves]))
    ax.plot(x, [statistics.fmean(v) for v in per_step], color=color, lw=1.6,
            label=f"{label} ({len(curves)} seed{'s' * (len(curves) > 1)})")
    if len(curves) > 1:
        ax.fill_between(x, [min(v) for v in per_step], [max(v) for v in per_step], color=color, alpha=0.15, lw=0)


PANELS = [("rewards/format", 10.0, "formatting (% of 10)"), ("rewards/accuracy", 10.0, "accuracy (% of 10)"),
          ("entropy", 1.0, "mean token entropy <H> (nats)"), ("gtpo/conflict_frac", 1.0, "conflict tokens / tokens"),
          ("kl", 1.0, "KL to reference")]


def plot_curves(names, title, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, grid = plt.subplots(2, 3, figsize=(13, 7))
    axes, legend_ax = grid.flat[:len(PANELS)], grid.flat[-1]
    for i, name in enumerate(names):
        seeds = next(ss for n, _, ss in configs() if n == name)
        rows = [d["rl"] for d in (load(f"{name}-s{s}") for s in seeds) if d is not None]
        for ax, (key, scale, _) in zip(axes, PANELS):
            band(ax, rows, key, scale, f"C{i}", name)
    for ax, (key, _, ylabel) in zip(axes, PANELS):
        ax.set_xlabel("optimizer step (after the shared SFT warm-up)", fontsize=8)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.grid(alpha=0.3)
        if key == "entropy":
            ax.axhline(math.log(2), color="k", ls=":", lw=1, label="ln 2 (Eq. 6)")
        if not ax.lines:
            ax.text(0.5, 0.5, "not logged by these runs", ha="center", va="center", transform=ax.transAxes)
    legend_ax.axis("off")
    handles, labels = axes[2].get_legend_handles_labels()              # the entropy panel has every run + ln 2
    if handles:
        legend_ax.legend(handles, labels, loc="center", fontsize=9)
    fig.suptitle(f"{title}: mean of seeds (5-step trailing average), band = min-max over seeds", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_passk(path):
    """pass@k (solid, circles) and maj@k (dashed, squares), mean over seeds with the min-max band."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(EVALS), figsize=(6 * len(EVALS), 4))
    for ax, (set_name, flags) in zip(axes, EVALS.items()):
        for i, (name, _, seeds) in enumerate(c for c in configs() if c[1] in ("start", "main")):
            res = [d["evals"][set_name] for d in (load(f"{name}-s{s}") for s in seeds) if d and set_name in d["evals"]]
            if not res:
                continue
            ks = sorted(int(k) for k in res[0]["pass@k"])
            for key, style, ms, fill in (("pass@k", "o-", 4, None), ("maj@k", "s--", 8, "none")):
                vals = [[r[key][str(k)] for r in res] for k in ks]
                ax.plot(ks, [statistics.fmean(v) for v in vals], style, color=f"C{i}", ms=ms, mfc=fill,
                        label=f"{name} {key.split('@')[0]}@k ({len(res)} seed{'s' * (len(res) > 1)})")
                if len(res) > 1:
                    ax.fill_between(ks, [min(v) for v in vals], [max(v) for v in vals], color=f"C{i}", alpha=0.1, lw=0)
        ax.set_xscale("log", base=2)
        ax.set_xticks(ks, [str(k) for k in ks])
        ax.minorticks_off()
        ax.set_xlabel("k")
        ax.set_ylabel("fraction of problems")
        ax.set_title(f"{set_name}: arithmetic {flags[-1]} split, n = {EVAL_COMMON[3]} samples per problem", fontsize=9)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report():
    table = summarize()
    write_summary(table)
    parts = {p: [n for n, q, _ in configs() if q == p] for p in ("main", "ablation", "collapse")}
    plot_curves([n for n in parts["main"] if n != "sft"], "Main comparison (SFT has no sampled rewards)",
                os.path.join(KEEP, "curves-main.png"))
    plot_curves(["gtpo"] + parts["ablation"], "Ablations (GTPO paper defaults for reference)",
                os.path.join(KEEP, "curves-ablation.png"))
    plot_curves(parts["collapse"], "Collapse setting: learning rate 1e-3", os.path.join(KEEP, "curves-collapse.png"))
    plot_passk(os.path.join(KEEP, "passk.png"))
    print(f"wrote {KEEP}/: summary.md, summary.json, curves-main.png, curves-ablation.png, curves-collapse.png, "
          f"passk.png")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shard", default="0/1", metavar="K/N", help="run jobs K, K+N, K+2N, ... (N workers)")
    p.add_argument("--list", action="store_true", help="the run table and the state of each run")
    p.add_argument("--report", action="store_true", help="only the plots and summary, from study/")
    args = p.parse_args(argv)
    try:
        k, n = (int(x) for x in args.shard.split("/"))
        assert 0 <= k < n
    except (ValueError, AssertionError):
        p.error(f"--shard {args.shard!r}: give K/N with 0 <= K < N, e.g. 0/2")
    if args.list:
        return status()
    if not args.report:
        try:
            run_all((k, n))
        except Stop:
            print("stopped: the running step saved what it had; run the same command again to continue")
            return 0
        if n > 1:
            return 0                                    # the report once all workers are done: --report
    report()
    return 0


if __name__ == "__main__":
    sys.exit(main())
