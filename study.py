"""The CPU-scale study: GTPO vs GRPO vs SFT on the embedded SmolLM2-135M and the arithmetic task.
docs/study.md declares its questions, arms, metrics, tests, verdict rules and budget; this file
runs that plan and computes its report.

RUNS below is the main and long parts, one line per configuration. Each seed has one SFT warm-up
per start (WARMUPS: the main part's 4 steps; the long part's longer one, which brings <H>_ini below
ln 2); every run of that seed starts from it (train.py --init_from) with the same budget (COMMON).
The collapse part (LADDER, collapse_jobs) is a pilot ladder on a seed of its own, then the test at the
first rung where GRPO collapses (docs/study.md, part 3).
Each run's adapters are evaluated with eval.py on the sets its line names: `id`, the first 64
problems of the arithmetic test split; `ood`, the first 48 of the `reworded` split (the same sums in
sentences training never shows); `id-best`, the ID set on the checkpoint with the highest mean
training reward over the steps since the previous one (BEST_WINDOW); `kl`, a long run's KL to its
start at every checkpoint (drift). Same n, k and sampling seed for every model; each problem's
correct count is kept (eval.py's per_problem_correct).

Resumable at every level, any number of times: finished steps are skipped, an interrupted training
continues from its last checkpoint (train.py --resume), an interrupted evaluation from its last
whole problem (eval.py --resume). Ctrl-C (or SIGTERM) lets the running step finish and save.

    python study.py --shard 0/2 & python study.py --shard 1/2 & wait   # two workers, one thread each
    python study.py --shard 0/1 --threads 1 --only warmup-collapse,pilot   # the collapse pilot, one worker
    python study.py --list                            # the table and how far each run is
    python study.py --report                          # tables + plots from the committed files

Big files (checkpoints, adapters, eval samples, logs) stay in runs/study/. What the report reads is
copied to study/<run>/ and committed: config.json, metrics.jsonl, times.json, conflicts.json,
best.json and eval-<set>.json (eval.py's results.json). study/v1/ holds the first design's runs
(the same files; docs/study.md says why it was replaced), whose comparisons the report re-tests.
"""
import argparse
import math
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import time

import runs
from data import read_jsonl

HERE = os.path.dirname(os.path.abspath(__file__))
WORK = os.path.join(HERE, "runs", "study")             # big files, never committed
KEEP = os.path.join(HERE, "study")                     # small files, committed

# -----------------------------------------------------------------------------
# the run table

COMMON = ["--model", "smollm2-135m", "--dataset", "arithmetic", "--batch_size", "1", "--generation_size", "8",
          "--max_completion_length", "96", "--max_steps", "20", "--sft_warmup_steps", "0", "--save_steps", "5"]
SFT_START = ["--model", "smollm2-135m", "--dataset", "arithmetic", "--use_sft", "--batch_size", "8",
             "--sft_micro_batch_size", "4"]
WARMUPS = {"main": ("warmup", SFT_START + ["--max_steps", "4", "--save_steps", "4"], ("id", "ood")),
           "long": ("warmup-long", SFT_START + ["--max_steps", "32", "--save_steps", "32"], ())}
A6 = ["--adam_beta1", "0.999999", "--adam_beta2", "0.999999"]     # Listing 1's GTPO betas
A9 = ["--adam_beta1", "0.9", "--adam_beta2", "0.95"]               # Listing 1's GRPO / SFT betas
LONG = ["--max_steps", "200", "--save_steps", "25"]                # after COMMON: these win
BEST_WINDOW = 25                                                   # = the long runs' save_steps
EVALS = {"id": ["--dataset", "arithmetic", "--split", "test", "--limit", "64"],
         "ood": ["--dataset", "arithmetic", "--split", "reworded", "--limit", "48"]}
EVAL_COMMON = ["--n_samples", "8", "--batch_size", "64", "--seed", "0", "--max_completion_length", "96"]
N_SAMPLES = 8
KL_PROBE = (16, 2)                      # `kl`: ID problems and samples each at every checkpoint (drift below)

RUNS = [  # name        part    seeds      flags after COMMON              evaluations
    ("gtpo-a6",   "main", (1, 2, 3), ["--use_gtpo", *A6],             ("id", "ood")),   # the paper's GTPO
    ("gtpo-a9",   "main", (1, 2, 3), ["--use_gtpo", *A9],             ("id", "ood")),
    ("grpo-a6",   "main", (1, 2, 3), ["--use_grpo", *A6],             ("id", "ood")),
    ("grpo-a9",   "main", (1, 2, 3), ["--use_grpo", *A9],             ("id", "ood")),   # the paper's GRPO, beta 0
    ("grpo-kl6",  "main", (1, 2, 3), ["--use_grpo", "--beta", "1e-6", *A9], ("id", "ood")),  # Fig. 2's beta 1e-6
    ("sft",       "main", (1, 2, 3), ["--use_sft"],                   ("id", "ood")),   # Listing 1: 1 prompt/step
    ("gtpo-long", "long", (1, 2),    ["--use_gtpo", *A9, *LONG],      ("id", "id-best", "kl")),
    ("grpo-long", "long", (1, 2),    ["--use_grpo", *A9, *LONG],      ("id", "id-best", "kl")),
]
# the collapse part (docs/study.md, "Part 3"): a pilot ladder on a seed of its own finds where GRPO
# collapses; the test then runs GTPO and GRPO there on fresh seeds. Each rung: (name, dataset, lr).
COLLAPSE = ["--use_gtpo", *A9, "--max_steps", "100", "--save_steps", "25", "--lr_scheduler", "constant",
            "--max_grad_norm", "1.0"]                             # --use_gtpo: replaced per method below
LADDER = [("r1", "arithmetic", "5e-4"), ("r2", "arithmetic", "1e-3"), ("r3", "arithmetic-hard", "1e-3"),
          ("r4", "arithmetic-hard", "2e-3"), ("r5", "arithmetic-hard", "5e-3")]
PILOT_SEED, TEST_SEEDS = 11, (21, 22, 23, 24, 25)
COLLAPSE_WARMUP = ("warmup-collapse", WARMUPS["long"][1])          # the long part's 32-step warm-up


def rung_flags(method, dataset, lr):
    return COMMON + ["--use_" + method, *COLLAPSE[1:], "--dataset", dataset, "--lr", lr]


def chosen_rung():
    """The first rung (in LADDER's order) whose pilot GRPO run collapsed, by the committed files;
    None while no finished pilot GRPO run has."""
    for name, _, _ in LADDER:
        d = load(f"pilot-{name}-grpo-s{PILOT_SEED}")
        if d is not None and collapse_step(d["rl"], d.get("diverged.json")) is not None:
            return name
    return None


def collapse_jobs():
    """The collapse part's jobs: warm-ups, the pilot's rungs (GRPO and GTPO on PILOT_SEED), then --
    once chosen_rung() names a rung -- the test's runs on TEST_SEEDS."""
    w, flags = COLLAPSE_WARMUP
    out = [(f"{w}-s{PILOT_SEED}", flags, PILOT_SEED, None, ())]
    out += [(f"pilot-{name}-{m}-s{PILOT_SEED}", rung_flags(m, ds, lr), PILOT_SEED, f"{w}-s{PILOT_SEED}", ())
            for name, ds, lr in LADDER for m in ("grpo", "gtpo")]
    rung = chosen_rung()
    if rung is not None:
        _, ds, lr = next(r for r in LADDER if r[0] == rung)
        out += [(f"{w}-s{s}", flags, s, None, ()) for s in TEST_SEEDS]
        out += [(f"collapse-{m}-s{s}", rung_flags(m, ds, lr), s, f"{w}-s{s}", ("rung", "rung-precollapse"))
                for s in TEST_SEEDS for m in ("grpo", "gtpo")]
    return out


def pilot_skipped(run_id):
    """A pilot rung after the chosen one is not run (the ladder stops at the first collapse)."""
    rung = chosen_rung()
    if rung is None or not run_id.startswith("pilot-"):
        return False
    names = [name for name, _, _ in LADDER]
    return names.index(run_id.split("-")[1]) > names.index(rung)


NAMES = {"gtpo-a6": "GTPO, Adam β 0.999999", "gtpo-a9": "GTPO, Adam β (0.9, 0.95)",
         "grpo-a6": "GRPO β=0, Adam β 0.999999", "grpo-a9": "GRPO β=0, Adam β (0.9, 0.95)",
         "grpo-kl6": "GRPO β=1e-6, Adam β (0.9, 0.95)", "sft": "SFT",
         "gtpo-long": "GTPO, 200 steps", "grpo-long": "GRPO β=0, 200 steps", "warmup": "SFT warm-up (the start)"}
STYLE = {"gtpo-a6": ("tab:blue", "-"), "gtpo-a9": ("tab:blue", "--"), "grpo-a6": ("tab:orange", "-"),
         "grpo-a9": ("tab:orange", "--"), "grpo-kl6": ("tab:red", "--"), "sft": ("tab:green", "-"),
         "gtpo-long": ("tab:blue", "-"), "grpo-long": ("tab:orange", "-")}


def jobs():
    """(run id, flags, seed, warm-up run id or None, evaluations) in order: warm-ups, main, long,
    collapse (collapse_jobs)."""
    out = [(f"{w}-s{s}", flags, s, None, evals) for part, (w, flags, evals) in WARMUPS.items()
           for s in sorted({s for _, p, ss, _, _ in RUNS if p == part for s in ss})]
    for part in WARMUPS:
        seeds = sorted({s for _, p, ss, _, _ in RUNS if p == part for s in ss})
        out += [(f"{name}-s{s}", COMMON + flags, s, f"{WARMUPS[part][0]}-s{s}", evals)
                for s in seeds for name, p, ss, flags, evals in RUNS if p == part and s in ss]
    return out + collapse_jobs()


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
            child.send_signal(signal.SIGTERM)
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


def train(run_id, flags, seed, start, shard, threads):
    """Train one run to its final/ (resuming what is there); copy its small files to study/."""
    out = os.path.join(WORK, run_id)
    if not os.path.isdir(os.path.join(out, "final")):
        argv = [sys.executable, "train.py", *flags, "--seed", str(seed), "--output_dir", out]
        if start:
            argv += ["--init_from", wait_for(os.path.join(WORK, start, "final"))]
        if os.path.isfile(os.path.join(out, "config.json")):
            argv.append("--resume")
        os.makedirs(out, exist_ok=True)
        try:
            attempt(run_id, "train", argv, os.path.join(out, "train.log"), os.path.join(out, "final"), shard, threads)
        except SystemExit:
            if not diverged(run_id, out):
                raise
    keep = os.path.join(KEEP, run_id)
    os.makedirs(keep, exist_ok=True)
    if start is None:                                   # a warm-up: keep its fingerprint
        found, path = adapter_fingerprint(os.path.join(out, "final")), os.path.join(keep, "adapter_fingerprint.json")
        if not os.path.isfile(path):
            runs.write_json(path, {"fingerprint": found})
        elif runs.read_json(path)["fingerprint"] != found:
            print(f"warning: {run_id} was trained again and differs from the one the finished runs started "
                  f"from (another machine?); the committed results keep the first one's files", flush=True)
    for f in ("config.json", "metrics.jsonl", "conflicts.json"):
        if os.path.isfile(os.path.join(out, f)):
            shutil.copyfile(os.path.join(out, f), os.path.join(keep, f))
    return out


def diverged(run_id, out):
    """train.py stopped the run on consecutive non-finite losses (its exit 1, train.log's last error):
    record study/<run>/diverged.json with the last logged step -> whether it did."""
    with open(os.path.join(out, "train.log")) as f:
        tail = f.read()[-4000:]
    if "consecutive steps had a non-finite loss" not in tail:
        return False
    rows = [r for _, r in read_jsonl(os.path.join(out, "metrics.jsonl"))]
    os.makedirs(os.path.join(KEEP, run_id), exist_ok=True)
    runs.write_json(os.path.join(KEEP, run_id, "diverged.json"), {"step": rows[-1]["step"] if rows else 0})
    print(f"{run_id} diverged (non-finite losses) at step {rows[-1]['step'] if rows else 0}", flush=True)
    return True


def best_checkpoint(rows, steps):
    """The saved step with the highest mean training reward over the BEST_WINDOW RL steps up to it
    (the earliest on a tie) -> (step, mean reward)."""
    reward = {r["step"]: r["reward"] for r in rows if r.get("phase") == "rl" and "reward" in r}
    scored = [(statistics.fmean(w), -n) for n in steps
              for w in [[reward[k] for k in range(n - BEST_WINDOW + 1, n + 1) if k in reward]] if w]
    mean, neg = max(scored)
    return -neg, mean


def evaluate(run_id, out, evals, shard, threads):
    """eval.py on each of the run's sets (resuming what is there), or `kl`, its drift from the start;
    results to study/<run>/eval-<set>.json."""
    for name in evals:
        keep = os.path.join(KEEP, run_id, f"eval-{name}.json")
        if os.path.isfile(keep):
            continue
        adapter = os.path.join(out, "final")
        if name.startswith("rung"):                     # the collapse test: the rung's own test split
            adapter, same = rung_adapter(run_id, out, name)
            if same:                                    # the pre-collapse checkpoint is the final adapter
                shutil.copyfile(os.path.join(KEEP, run_id, f"eval-{same}.json"), keep)
                continue
        if name.endswith("-best"):
            rows = [r for _, r in read_jsonl(os.path.join(out, "metrics.jsonl"))]
            saved = [int(d.split("-")[1]) for d in os.listdir(out) if d.startswith("checkpoint-")]
            step, mean = best_checkpoint(rows, saved)
            runs.write_json(os.path.join(KEEP, run_id, "best.json"), {"step": step, "mean_reward": mean,
                                                                      "window": BEST_WINDOW})
            if step == max(saved):                      # the final adapter: its evaluation is the same one
                shutil.copyfile(os.path.join(KEEP, run_id, f"eval-{name[:-5]}.json"), keep)
                continue
            adapter = os.path.join(out, f"checkpoint-{step}")
        dest = os.path.join(out, f"eval-{name}")
        if name == "kl":
            argv = [sys.executable, "study.py", "--kl", run_id]
        elif name.startswith("rung"):
            ds = runs.read_json(os.path.join(out, "config.json"))["dataset"]
            argv = [sys.executable, "eval.py", "--adapter", adapter, "--dataset", ds, "--split", "test", "--limit",
                    "64", "--one_shot_from", ds, *EVAL_COMMON, "--output_dir", dest]
        else:
            argv = [sys.executable, "eval.py", "--adapter", adapter, *EVALS[name.split("-")[0]], *EVAL_COMMON,
                    "--output_dir", dest]
        if os.path.isfile(os.path.join(dest, "samples.jsonl")):
            argv.append("--resume")
        attempt(run_id, f"eval-{name}", argv, os.path.join(out, "eval.log"), os.path.join(dest, "results.json"),
                shard, threads)
        shutil.copyfile(os.path.join(dest, "results.json"), keep)


def rung_adapter(run_id, out, name):
    """The adapter a collapse-test evaluation reads -> (folder, None), or (None, "rung") when it is
    the one `rung` already evaluated. `rung`: final/ (a diverged run's last checkpoint);
    `rung-precollapse`: the last checkpoint saved before the collapse step (the warm-up if none)."""
    saved = sorted(int(d.split("-")[1]) for d in os.listdir(out) if d.startswith("checkpoint-"))
    last = os.path.join(out, "final") if os.path.isdir(os.path.join(out, "final")) else \
        os.path.join(out, f"checkpoint-{saved[-1]}")
    if name == "rung":
        return last, None
    d = load(run_id)
    step = collapse_step(d["rl"], d.get("diverged.json"))
    before = [n for n in saved if step is not None and n < step]
    runs.write_json(os.path.join(KEEP, run_id, "precollapse.json"), {"collapse_step": step,
                                                                     "checkpoint": before[-1] if before else None})
    if step is None:
        return None, "rung"
    return (os.path.join(out, f"checkpoint-{before[-1]}") if before else
            runs.read_json(os.path.join(out, "config.json"))["init_from"]), None


def drift(run_id):
    """`kl` for a long run: KL(pi_c || pi_start) at the start and at each checkpoint c, from the
    completions pi_c samples for the first KL_PROBE[0] ID problems (KL_PROBE[1] each, the same seed
    at every checkpoint); pi_start is the warm-up the run began from (train.py --init_from). Beta = 0
    runs compute no KL while training; this measures how far each moved.
    -> runs/study/<run>/eval-kl/results.json."""
    import torch
    from data import format_prompt, load_task, one_shot_example
    from eval import load_eval_model
    from gtpo import kl_k3, masked_mean
    from gtpo_logprobs import sequence_logprobs
    from rollout import rollout
    out = os.path.join(WORK, run_id)
    cfg = runs.read_json(os.path.join(out, "config.json"))
    n_problems, n_samples = KL_PROBE
    example = one_shot_example(load_task("arithmetic", "train")[0])          # eval.py's one-shot example
    start, tok = load_eval_model(cfg["model"], cfg["init_from"], "cpu", False)
    prompts = [format_prompt(tok, r["question"], example) for r in load_task("arithmetic", "test")[:n_problems]]
    saved = {int(d.split("-")[1]): os.path.join(out, d) for d in os.listdir(out) if d.startswith("checkpoint-")}
    points = []
    for step, adapter in sorted({0: cfg["init_from"], **saved}.items()):     # step 0, the start: 0 exactly
        policy, _ = load_eval_model(cfg["model"], adapter, "cpu", False)
        torch.manual_seed(0)
        ro = rollout(policy, tok, prompts, n_samples, cfg["max_completion_length"], temperature=1.0)
        batch = ro.prompt_ids, ro.prompt_mask, ro.completion_ids, ro.completion_mask
        with torch.no_grad():
            logp, _ = sequence_logprobs(policy, *batch, with_entropy=False)              # (N, L)
            start_logp, _ = sequence_logprobs(start, *batch, with_entropy=False)         # (N, L)
        kl = masked_mean(kl_k3(logp, start_logp), ro.completion_mask)                   # over real tokens
        points.append({"step": step, "kl": float(kl), "tokens": int(ro.completion_mask.sum())})
        print(f"{run_id} step {step}: KL to the start {points[-1]['kl']:.4f} over {points[-1]['tokens']} tokens",
              flush=True)
    dest = os.path.join(out, "eval-kl")
    os.makedirs(dest, exist_ok=True)
    runs.write_json(os.path.join(dest, "results.json"), {
        "points": points, "estimator": "k3, completions sampled from each checkpoint (temperature 1)",
        "problems": n_problems, "samples_per_problem": n_samples, "start": cfg["init_from"]})


def wait_for(path):
    """A warm-up another worker is training: wait for its final/ folder."""
    while not os.path.isdir(path):
        print(f"waiting for {path}", flush=True)
        time.sleep(30)
    return path


def finished(run_id, evals):
    """Trained and evaluated, by the committed files alone (so also on a machine without runs/study)."""
    d = os.path.join(KEEP, run_id)
    if os.path.isfile(os.path.join(d, "diverged.json")):
        return os.path.isfile(os.path.join(d, "metrics.jsonl"))
    return all(os.path.isfile(os.path.join(d, f)) for f in ("metrics.jsonl", *(f"eval-{s}.json" for s in evals)))


def adapter_fingerprint(folder):
    """runs.weights_fingerprint of the adapter's tensors in name order: is a retrained warm-up the same one?"""
    from safetensors.torch import load_file
    tensors = load_file(os.path.join(folder, "adapter_model.safetensors"))
    return list(runs.weights_fingerprint([tensors[k] for k in sorted(tensors)]))


def run_all(shard, only=(), threads=None):
    """This worker's jobs, in order; the table is read again after each job, since the collapse
    part's test joins it once the pilot has chosen its rung. only: run-id prefixes to run."""
    k, n = shard
    threads = threads or max(1, (os.cpu_count() or 1) // n)
    done = set()
    while True:
        todo = [job for i, job in enumerate(jobs()) if i % n == k and job[0] not in done
                and (not only or job[0].startswith(tuple(only)))]
        if not todo:
            return
        run_id, flags, seed, start, evals = todo[0]
        done.add(run_id)
        if (start and finished(run_id, evals)) or pilot_skipped(run_id):
            continue            # a warm-up's final/ is rebuilt when missing: later runs start from it
        out = train(run_id, flags, seed, start, shard, threads)
        evaluate(run_id, out, evals, shard, threads)


def status():
    for run_id, flags, seed, start, evals in jobs():
        keep, out = os.path.join(KEEP, run_id), os.path.join(WORK, run_id)
        ckpts = sorted(int(d.split("-")[1]) for d in os.listdir(out) if d.startswith("checkpoint-")) \
            if os.path.isdir(out) else []
        done = [s for s in evals if os.path.isfile(os.path.join(keep, f"eval-{s}.json"))]
        state = ("done (committed)" if start and finished(run_id, evals) else
                 "trained" if os.path.isdir(os.path.join(out, "final")) else
                 f"at checkpoint {ckpts[-1]}" if ckpts else "started" if os.path.isdir(out) else "to do")
        print(f"{run_id:20s} {state:18s} evaluated: {', '.join(done) or '-'}")


# -----------------------------------------------------------------------------
# the report: only from the committed files in study/

V1 = os.path.join(KEEP, "v1")          # the first design's runs: 16 problems per set, no per-problem counts
V1_RUNS = {"gtpo": (1, 2, 3), "grpo": (1, 2, 3), "grpo-kl": (1, 2, 3), "sft": (1, 2, 3), "gtpo-masks-only": (1, 2),
           "gtpo-delta": (1, 2), "gtpo-onlyneg": (1, 2), "grpo-entropy": (1, 2), "gtpo-hot": (1, 2),
           "grpo-hot": (1, 2), "grpo-kl-hot": (1, 2)}


def load(run_id, base=None):
    """A run's committed files: RL metric rows, evaluations by set, times, conflicts, best, config;
    None if it has not finished training."""
    d = os.path.join(base or KEEP, run_id)
    if not os.path.isfile(os.path.join(d, "metrics.jsonl")):
        return None
    rows = [r for _, r in read_jsonl(os.path.join(d, "metrics.jsonl"))]
    evals = {f[5:-5]: runs.read_json(os.path.join(d, f)) for f in sorted(os.listdir(d))
             if f.startswith("eval-") and f.endswith(".json")}
    files = {f: runs.read_json(os.path.join(d, f)) for f in ("times.json", "conflicts.json", "best.json", "config.json",
                                                      "diverged.json")
             if os.path.isfile(os.path.join(d, f))}
    return {"rl": [r for r in rows if r.get("phase") == "rl"], "evals": evals, **files}


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


# a question: (label, the paper's claim, contrasts (each: [(coefficient, config)], one unit per seed),
#              metric (a function of a run -> (value, per-problem counts or None)), sign, base, regime)
def _id(d):
    return pass1(d, "id")


def _train(d):
    return train_accuracy(d), None


def questions():
    ood = solvable([n for n, p, *_ in RUNS if p == "main"])
    _ood = lambda d: pass1(d, "ood", ood)                                           # noqa: E731
    g_vs_r = [[(1, "gtpo-a6"), (-1, "grpo-a6")], [(1, "gtpo-a9"), (-1, "grpo-a9")]]
    # seeds as the units: a seed's two Adam settings share its warm-up, prompts and first samples
    by_seed = [[(0.5, "gtpo-a6"), (-0.5, "grpo-a6"), (0.5, "gtpo-a9"), (-0.5, "grpo-a9")]]
    inter = [[(1, "gtpo-a6"), (-1, "grpo-a6"), (-1, "gtpo-a9"), (1, "grpo-a9")]]
    hot = "Fig. 1's collapse comes after hundreds of steps; these runs have 20"
    eq6 = "delta_i acts only when <H>_ini < ln 2 (Eq. 6); <H>_ini was 1.2-1.6 here"
    return [
        ("Q1", "GTPO above GRPO β=0 (Fig. 2)", g_vs_r, "ID pass@1", _id, 1, None, None),
        ("Q1", "GTPO above GRPO β=0 (Fig. 2)", g_vs_r, f"OOD pass@1, {len(ood)} solvable", _ood, 1, None, None),
        ("Q1", "GTPO above GRPO β=0 (Fig. 2)", g_vs_r, "training accuracy %", _train, 1, None, None),
        ("Q1", "GTPO above GRPO β=0 (Fig. 2), seeds as units", by_seed, "ID pass@1", _id, 1, None, None),
        ("Q1", "GTPO above GRPO β=0 (Fig. 2), seeds as units", by_seed, f"OOD pass@1, {len(ood)} solvable", _ood, 1,
         None, None),
        ("Q1", "GTPO above GRPO β=1e-6 (Fig. 2)", [[(1, "gtpo-a9"), (-1, "grpo-kl6")]], "ID pass@1", _id, 1, None,
         None),
        ("Q2", "(no claim) GTPO's edge the same under both Adam settings", inter, "ID pass@1", _id, 0, None, None),
        ("Q2", "(no claim) Adam β 0.999999 vs (0.9, 0.95), GTPO", [[(1, "gtpo-a6"), (-1, "gtpo-a9")]], "ID pass@1",
         _id, 0, None, None),
        ("Q2", "(no claim) Adam β 0.999999 vs (0.9, 0.95), GRPO", [[(1, "grpo-a6"), (-1, "grpo-a9")]], "ID pass@1",
         _id, 0, None, None),
        ("Q3", "GTPO above SFT (Fig. 2-3, Sec. 6)", [[(1, "gtpo-a6"), (-1, "sft")]], "ID pass@1", _id, 1, None, None),
        ("Q3", "GTPO above SFT (Fig. 2-3, Sec. 6)", [[(1, "gtpo-a6"), (-1, "sft")]], f"OOD pass@1, {len(ood)} solvable",
         _ood, 1, None, None),
        ("Q4", "GTPO above GRPO β=0 after 200 steps", [[(1, "gtpo-long"), (-1, "grpo-long")]], "ID pass@1, final",
         _id, 1, None, None),
        ("Q4", "GTPO above GRPO β=0, best checkpoints", [[(1, "gtpo-long"), (-1, "grpo-long")]], "ID pass@1, best",
         lambda d: pass1(d, "id-best"), 1, None, None),
        ("v1", "GTPO above GRPO β=0 (Fig. 2)", [[(1, "gtpo"), (-1, "grpo")]], "ID pass@1 (16)", _id, 1, V1, None),
        ("v1", "GTPO above GRPO β=0 (Fig. 2)", [[(1, "gtpo"), (-1, "grpo")]], "training accuracy %", _train, 1, V1,
         None),
        ("v1", "GTPO above GRPO β=0.04 (Fig. 2)", [[(1, "gtpo"), (-1, "grpo-kl")]], "training accuracy %", _train, 1,
         V1, None),
        ("v1", "GTPO above SFT OOD (Sec. 6)", [[(1, "gtpo"), (-1, "sft")]], "OOD pass@1 (16)", lambda d: pass1(d, "ood"),
         1, V1, None),
        ("v1", "GRPO β=0.04 above SFT OOD (Sec. 6: RL generalises)", [[(1, "grpo-kl"), (-1, "sft")]],
         "OOD pass@1 (16)", lambda d: pass1(d, "ood"), 1, V1, None),
        ("v1", "conflict masks alone above GRPO (Fig. 5)", [[(1, "gtpo-masks-only"), (-1, "grpo")]],
         "training accuracy %", _train, 1, V1, None),
        ("v1", "full GTPO above masks alone (Fig. 5)", [[(1, "gtpo"), (-1, "gtpo-masks-only")]],
         "training accuracy %", _train, 1, V1, None),
        ("v1", "filter on all above no filter (Fig. 4)", [[(1, "gtpo-delta"), (-1, "gtpo")]], "training accuracy %",
         _train, 1, V1, eq6),
        ("v1", "OnlyNeg below filter-on-all in accuracy (App. 13)", [[(1, "gtpo-onlyneg"), (-1, "gtpo-delta")]],
         "training accuracy %", _train, -1, V1, eq6),
        ("v1", "filter + γ improve GRPO (App. 14)", [[(1, "grpo-entropy"), (-1, "grpo")]], "training accuracy %",
         _train, 1, V1, None),
        ("v1", "GTPO above GRPO + filter + γ (App. 14)", [[(1, "gtpo"), (-1, "grpo-entropy")]],
         "training accuracy %", _train, 1, V1, None),
        ("v1", "GTPO above GRPO β=0 at lr 1e-3 (Fig. 1)", [[(1, "gtpo-hot"), (-1, "grpo-hot")]], "training accuracy %",
         _train, 1, V1, hot),
    ]


def seeds_of(name, base):
    return V1_RUNS[name] if base == V1 else next(ss for n, _, ss, _, _ in RUNS if n == name)


def test_question(contrasts, metric, base):
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
    for label, claim, contrasts, metric_name, metric, sign, base, regime in questions():
        units = test_question(contrasts, metric, base)
        if not units:
            out.append({"q": label, "claim": claim, "metric": metric_name, "units": 0})
            continue
        diffs = [v for _, v, _ in units]
        mean, p = statistics.fmean(diffs), sign_flip_p(diffs)
        ci = bootstrap_ci([c for *_, c in units]) if all(c is not None for *_, c in units) else None
        terms = " ".join(f"{'+' if c > 0 else '−'} {n}" for c, n in contrasts[0]).lstrip("+ ")
        if abs(contrasts[0][0][0]) != 1:                # a mean over terms: (gtpo-a6 − grpo-a6 + ...) / 2
            terms = f"({terms}) / {round(1 / abs(contrasts[0][0][0]))}"
        out.append({"q": label, "claim": claim, "contrast": terms + (" (both Adam settings)" if len(contrasts) > 1
                                                                    else ""),
                    "metric": metric_name, "units": len(units), "values": diffs, "mean": mean, "p": p, "ci": ci,
                    "min_p": 2 / 2 ** len(units), "verdict": verdict(sign, mean, p, ci, regime)})
    return out


def trailing(vals, n):
    """Trailing means over n steps (the first n - 1 over what there is)."""
    return [statistics.fmean(vals[max(0, i - n + 1):i + 1]) for i in range(len(vals))]


COLLAPSE_WINDOW, COLLAPSE_DROP = 10, 2.0      # steps; points of the 10-point formatting reward (= 20 %)


def collapse_step(rows, diverged=None):
    """The first RL step at which the trailing-10-step formatting reward is >= 2 points below its mean
    over the first 10 RL steps while the trailing-10-step entropy is above ln 2; None if never.
    diverged: {"step": n} of a run that train.py stopped on consecutive non-finite losses, which
    collapsed at step n unless the rule found an earlier step."""
    fmt, ent = [r["rewards/format"] for r in rows], [r["entropy"] for r in rows]
    if len(fmt) < 2 * COLLAPSE_WINDOW:
        return diverged and diverged["step"]
    start = statistics.fmean(fmt[:COLLAPSE_WINDOW])
    for r, f, h in zip(rows, trailing(fmt, COLLAPSE_WINDOW), trailing(ent, COLLAPSE_WINDOW)):
        if r["step"] - rows[0]["step"] >= COLLAPSE_WINDOW and f <= start - COLLAPSE_DROP and h > math.log(2):
            return r["step"]
    return diverged and diverged["step"]


def collapse_lines():
    """Q4: per long run, <H>_ini, first and last formatting / entropy, its collapse step and its
    KL to the start (drift)."""
    lines = ["| run | <H>_ini of its start | format % first 10 → last 10 | entropy first 10 → last 10 | "
             "collapse step | KL to the start at its last checkpoint |", "|---|---|---|---|---|---|"]
    found = {}
    h_ini = {s: load(f"gtpo-long-s{s}") for s in seeds_of("gtpo-long", None)}
    for name in ("gtpo-long", "grpo-long"):
        for s in seeds_of(name, None):
            d = load(f"{name}-s{s}")
            if d is None or len(d["rl"]) < 2 * COLLAPSE_WINDOW:
                continue
            rows, w = d["rl"], COLLAPSE_WINDOW
            fmt, ent = [10 * r["rewards/format"] for r in rows], [r["entropy"] for r in rows]
            found[(name, s)] = collapse_step(rows)
            h = h_ini[s] and h_ini[s]["config.json"].get("h_ini")
            lines.append(f"| {NAMES[name]}, seed {s} | {h:.3f} |" if h is not None else f"| {NAMES[name]}, seed {s} | – |")
            lines[-1] += (f" {statistics.fmean(fmt[:w]):.1f} → {statistics.fmean(fmt[-w:]):.1f} | "
                          f"{statistics.fmean(ent[:w]):.3f} → {statistics.fmean(ent[-w:]):.3f} | "
                          f"{found[(name, s)] or 'none'} |")
            kl = d["evals"].get("kl")
            lines[-1] += f" {kl['points'][-1]['kl']:.3f} (step {kl['points'][-1]['step']}) |" if kl else " – |"
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


def cost_hours(collapse=False):
    """Worker-hours spent on the runs and evaluations of the main and long parts, or with
    collapse=True of the collapse part (every attempt, worked())."""
    part = {run_id for run_id, *_ in collapse_jobs()}
    return sum(worked(t) for run_id, *_ in jobs() if (run_id in part) == collapse for d in [load(run_id)] if d
               for ts in d.get("times.json", {}).values() for t in ts) / 3600


def write_summary():
    rows = question_rows()
    q4, q4_rule = collapse_lines()
    q5, q5_rule = conflict_lines()
    lines = ["## Questions, tests, verdicts (docs/study.md declares them)", ""] + question_lines(rows) + [
        "", "run-level p: exact two-sided sign-flip test over the paired runs (its smallest possible value in "
        "brackets); problem-level CI: the problems resampled, the runs fixed.", "",
        f"## Q4: collapse over 200 steps — {q4_rule}", ""] + q4 + [
        "", f"## Q5: conflict tokens are mostly format tokens (Sec. 4.1) — {q5_rule}", ""] + q5 + [
        "", "## Configurations (mean ± sample std over the finished seeds)", ""] + summary_lines() + [
        "", f"Worker-hours (every attempt, both workers summed): main and long parts {cost_hours():.2f}; "
        f"collapse part so far {cost_hours(collapse=True):.2f}"]
    runs.write_text(os.path.join(KEEP, "summary.md"), "\n".join(lines) + "\n")
    runs.write_json(os.path.join(KEEP, "summary.json"), {"questions": rows, "collapse": q4_rule, "conflicts": q5_rule})
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


V1_LABELS = {"gtpo": "GTPO", "grpo": "GRPO β=0", "gtpo-masks-only": "conflict masks only (γ=0, no δ)",
             "gtpo-delta": "GTPO, δ_i on all", "gtpo-onlyneg": "GTPO, δ_i on negatives (OnlyNeg)",
             "grpo-entropy": "GRPO + δ_i + γ"}


def report():
    write_summary()
    plots = [("curves-main.png", lambda p: plot_curves([n for n, q, *_ in RUNS if q == "main" and n != "sft"],
                                                        "GTPO vs GRPO β=0 under both Adam settings", p, 5)),
             ("curves-long.png", lambda p: plot_curves(["gtpo-long", "grpo-long"], "200 steps from <H>_ini < ln 2",
                                                       p, 10, kl=True)),
             ("passk.png", plot_passk),
             ("v1/curves-ablation.png", lambda p: plot_curves(list(V1_LABELS), "First design's ablations", p, 5,
                                                              V1, V1_LABELS))]
    for name, plot in plots:
        done = plot(os.path.join(KEEP, name))
        print(f"{KEEP}/{name}: {'written' if done else 'not yet (no seed has every run of the figure)'}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shard", default="0/1", metavar="K/N", help="run jobs K, K+N, K+2N, ... (N workers)")
    p.add_argument("--list", action="store_true", help="the run table and the state of each run")
    p.add_argument("--only", default="", metavar="PREFIX,...", help="run only the jobs whose run id starts so "
                   "(e.g. warmup-collapse,pilot)")
    p.add_argument("--threads", type=int, default=None, help="threads per worker [default: cores / N]")
    p.add_argument("--report", action="store_true", help="only the tables and plots, from study/")
    p.add_argument("--kl", metavar="RUN", help="(a worker's job) a long run's KL to its start at each checkpoint")
    args = p.parse_args(argv)
    if args.kl:
        return drift(args.kl)
    try:
        k, n = (int(x) for x in args.shard.split("/"))
        assert 0 <= k < n
    except (ValueError, AssertionError):
        p.error(f"--shard {args.shard!r}: give K/N with 0 <= K < N, e.g. 0/2")
    if args.list:
        return status()
    if not args.report:
        try:
            run_all((k, n), [x for x in args.only.split(",") if x], args.threads)
        except Stop:
            print("stopped: the running step saved what it had; run the same command again to continue")
            return 0
        if n > 1:
            return 0                                    # the report once all workers are done: --report
    report()
    return 0


if __name__ == "__main__":
    sys.exit(main())
