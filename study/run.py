"""The CPU-scale study: GTPO vs GRPO vs SFT on the embedded SmolLM2-135M and the arithmetic task.
docs/study.md declares its questions, arms, metrics, tests, verdict rules and budget; this file
holds its run table and runs it; study/report.py computes the report from the committed files.

RUNS below is the main and long parts, one line per configuration. Each seed has one SFT warm-up
per start (WARMUPS: the main part's 4 steps; the long part's longer one, which brings <H>_ini below
ln 2); every run of that seed starts from it (train.py --init_from) with the same budget (COMMON).
The collapse part (LADDER, collapse_jobs) is a pilot ladder on a seed of its own, then the test at the
first rung where GRPO collapses (docs/study.md, part 3).
Each run's adapters are evaluated with eval.py on the sets its line names: `id`, the first 64
problems of the arithmetic test split; `ood`, the first 48 of the `reworded` split (the same sums in
sentences training never shows); `id-best`, the ID set on the checkpoint with the highest mean
training reward over the steps since the previous one (BEST_WINDOW); `kl`, a long run's KL to its
start at every checkpoint (eval.py --drift). Same n, k and sampling seed for every model; each problem's
correct count is kept (eval.py's per_problem_correct).

Resumable at every level, any number of times: finished steps are skipped, an interrupted training
continues from its last checkpoint (train.py --resume), an interrupted evaluation from its last
whole problem (eval.py --resume). Ctrl-C (or SIGTERM) lets the running step finish and save.

From the repository root:

    python -m study.run --shard 0/2 & python -m study.run --shard 1/2 & wait   # two workers, one thread each
    python -m study.run --shard 0/2 --threads 1 --only q6 &     # one part (Q6) and the warm-ups it starts from ...
    python -m study.run --shard 1/2 --threads 1 --only q6 &     # ... on two workers
    python -m study.run --threads 1 --only q7-gtpo,q7-grpo --seeds 1,3,5,7 &    # Q7: one worker per seed,
    python -m study.run --threads 1 --only q7-gtpo,q7-grpo --seeds 2,4,6,8 &    # its warm-up and both runs
    python -m study.run --threads 1 --only warmup-q8,q7-released,q8- --seeds 1 &    # Q8: one worker per seed
    python -m study.run --list                        # the table and how far each run is
    python -m study.run --report                      # tables + plots from the committed files (study/report.py)

Big files (checkpoints, adapters, eval samples, logs) stay in runs/study/. What the report reads is
copied to study/runs/<run>/ and committed: config.json, metrics.jsonl, times.json, conflicts.json,
best.json and eval-<set>.json (eval.py's results.json). So a fresh checkout has no weights: an evaluation
still to run trains its run again first, which must log what the committed metrics.jsonl holds, timings
aside, or the worker stops (first_difference); a warm-up's adapter is also checked against its committed
fingerprint. study/runs/v1/ holds the first design's runs
(the same files; docs/study.md says why it was replaced), whose comparisons the report re-tests.
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

import torch

import runs
from data import read_jsonl

STUDY = os.path.dirname(os.path.abspath(__file__))     # the code, summary.md/.json and the figures
KEEP = os.path.join(STUDY, "runs")                     # each run's small files, committed: study/runs/<run>/
HERE = os.path.dirname(STUDY)                          # the repository root, where train.py runs
WORK = os.path.join(HERE, "runs", "study")             # big files, never committed

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
KL_PROBE = (16, 2)                      # `kl`: ID problems and samples each at every checkpoint (eval.py --drift)

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
    once chosen_rung() names a rung -- the test's runs on TEST_SEEDS, and last their KL drift."""
    w, flags = COLLAPSE_WARMUP
    out = [(f"{w}-s{PILOT_SEED}", flags, PILOT_SEED, None, ())]
    out += [(f"pilot-{name}-{m}-s{PILOT_SEED}", rung_flags(m, ds, lr), PILOT_SEED, f"{w}-s{PILOT_SEED}", ())
            for name, ds, lr in LADDER for m in ("grpo", "gtpo")]
    rung = chosen_rung()
    if rung is not None:
        _, ds, lr = next(r for r in LADDER if r[0] == rung)
        out += [(f"{w}-s{s}", flags, s, None, ()) for s in TEST_SEEDS]
        test = [(f"collapse-{m}-s{s}", rung_flags(m, ds, lr), s, f"{w}-s{s}")
                for s in TEST_SEEDS for m in ("grpo", "gtpo")]
        out += [(*job, ("rung", "rung-precollapse")) for job in test]
        out += [(*job, ("kl",)) for job in test]        # reporting only: after every run the verdict needs
    return out


Q6_SEEDS, Q6_NEW_SEEDS, Q6_RUNG = (21, 22, 23, 24, 25, 26, 27, 28), (26, 27, 28), "r4"
Q6_START = "2026-11-25T14:25"          # Q6's first run: later attempts of the reused warm-ups are Q6's cost


def q6_pair(seed):
    """(GRPO beta = 0 run id, GTPO with Eq. 7's entropy term run id) of a Q6 seed: seeds 21-25 reuse part 3's
    GRPO runs."""
    return (f"collapse-grpo-s{seed}" if seed not in Q6_NEW_SEEDS else f"q6-grpo-s{seed}"), f"q6-gtpo-s{seed}"


def q6_jobs():
    """Q6 (docs/study.md, part 4): GTPO with Eq. 7's entropy term as written on seeds 21-28 and GRPO beta = 0
    on the new seeds 26-28 (21-25 are part 3's collapse-grpo runs), at rung r4 from each seed's
    warm-up-collapse warm-up. Ordered so that what the verdict needs comes first: the new warm-ups, the
    training runs, then their `rung` evaluations, then their `kl` drift."""
    w, flags = COLLAPSE_WARMUP
    _, ds, lr = next(r for r in LADDER if r[0] == Q6_RUNG)
    out = [(f"{w}-s{s}", flags, s, None, ()) for s in Q6_NEW_SEEDS]
    runs_ = [(f"q6-{m}-s{s}", rung_flags(m, ds, lr) + (["--entropy_term", "eq7"] if m == "gtpo" else []), s,
              f"{w}-s{s}") for s in Q6_SEEDS for m in ("gtpo", "grpo") if m == "gtpo" or s in Q6_NEW_SEEDS]
    return out + [(*job, evals) for evals in ((), ("rung",), ("kl",)) for job in runs_]


Q7_SEEDS, Q7_REUSED = (1, 2, 3, 4, 5, 6, 7, 8), ()     # () since the amendment (docs/study.md, part 6)
Q7_WARMUP = "warmup-q7"                                  # the long part's warm-up command, Q7's own runs of it
Q7_EVALS = ("id", "id-best", "ood", "kl200")   # primary first; kl200: the KL to the warm-up at step 200 only
Q7_GTPO = ["--use_gtpo", *A9, *LONG, "--entropy_term", "eq7", "--entropy_filter", "auto"]     # the defaults, named


def q7_pair(seed):
    """(GRPO beta = 0 run id, GTPO run id) of a Q7 seed: seeds 1-2 reuse the long part's GRPO runs."""
    return (f"grpo-long-s{seed}" if seed in Q7_REUSED else f"q7-grpo-s{seed}"), f"q7-gtpo-s{seed}"


def q7_jobs():
    """Q7 (docs/study.md, part 6): GTPO with the default objective against GRPO beta = 0 over the long part's 200
    steps, seeds 1-8, each seed's two runs from its own run of the long part's warm-up command (Q7_WARMUP),
    seed by seed (two workers: --seeds 1,3,5,7 and 2,4,6,8). Each run is evaluated in the job that trains it
    (Q7_EVALS), so no cell needs its weights trained again. A reused GRPO run (Q7_REUSED) would be trained
    again for its OOD evaluation, which checks at every step that it logs the committed values. The
    optional released-form arm is Q8's (q8_jobs)."""
    w, flags = Q7_WARMUP, WARMUPS["long"][1]
    grpo, out = COMMON + ["--use_grpo", *A9, *LONG], []
    for s in Q7_SEEDS:
        out += [(f"{w}-s{s}", flags, s, None, ())]
        out += [(q7_pair(s)[1], COMMON + Q7_GTPO, s, f"{w}-s{s}", Q7_EVALS),
                (q7_pair(s)[0], grpo, s, f"{w}-s{s}", ("ood",) if s in Q7_REUSED else Q7_EVALS)]
    return out


Q8_WARMUP, Q8_HOST_SEEDS = "warmup-q8", (1, 2)     # GRPO trained again on these seeds where the warm-up is not Q7's
Q8_RELEASED = [*Q7_GTPO[:-4], "--entropy_term", "released", "--entropy_filter", "auto"]
Q8_NOGAMMA = [*Q7_GTPO, "--ent_gamma", "0"]                          # the conflict masks and delta_i alone


def warmup_differs(seed):
    """Whether Q8's warm-up of the seed has a committed fingerprint other than Q7's (another host's numerics);
    None while either is not committed."""
    paths = [os.path.join(KEEP, f"{w}-s{seed}", "adapter_fingerprint.json") for w in (Q7_WARMUP, Q8_WARMUP)]
    if not all(os.path.isfile(p) for p in paths):
        return None
    return runs.read_json(paths[0])["fingerprint"] != runs.read_json(paths[1])["fingerprint"]


def q8_jobs():
    """Q8 (docs/study.md, part 7): on Q7's seeds, GTPO with the released entropy term (q7-released, Q7's declared
    optional arm) and with gamma = 0 (q8-nogamma), each from the seed's Q8 run of Q7's warm-up command, whose
    fingerprint decides the pairing; GRPO again on Q8_HOST_SEEDS where it differs from Q7's. One worker per
    seed, each run evaluated in the job that trains it (Q7_EVALS)."""
    grpo, out = COMMON + ["--use_grpo", *A9, *LONG], []
    for s in Q7_SEEDS:
        w = f"{Q8_WARMUP}-s{s}"
        out += [(w, WARMUPS["long"][1], s, None, ()),
                (f"q7-released-s{s}", COMMON + Q8_RELEASED, s, w, Q7_EVALS),
                (f"q8-nogamma-s{s}", COMMON + Q8_NOGAMMA, s, w, Q7_EVALS)]
        if s in Q8_HOST_SEEDS and warmup_differs(s):
            out += [(f"q8-grpo-s{s}", grpo, s, w, Q7_EVALS)]
    return out


def pilot_skipped(run_id):
    """A pilot rung after the chosen one is not run (the ladder stops at the first collapse)."""
    rung = chosen_rung()
    if rung is None or not run_id.startswith("pilot-"):
        return False
    names = [name for name, _, _ in LADDER]
    return names.index(run_id.split("-")[1]) > names.index(rung)


def earlier_rungs_pending(run_id):
    """A pilot run of a rung whose earlier rungs' GRPO runs have not all finished: whether it runs at
    all (pilot_skipped) is not known yet."""
    if not run_id.startswith("pilot-"):
        return False
    names = [name for name, _, _ in LADDER]
    return any(load(f"pilot-{name}-grpo-s{PILOT_SEED}") is None for name in names[:names.index(run_id.split("-")[1])])


def jobs():
    """(run id, flags, seed, warm-up run id or None, evaluations) in order: warm-ups, main, long,
    collapse (collapse_jobs)."""
    out = [(f"{w}-s{s}", flags, s, None, evals) for part, (w, flags, evals) in WARMUPS.items()
           for s in sorted({s for _, p, ss, _, _ in RUNS if p == part for s in ss})]
    for part in WARMUPS:
        seeds = sorted({s for _, p, ss, _, _ in RUNS if p == part for s in ss})
        out += [(f"{name}-s{s}", COMMON + flags, s, f"{WARMUPS[part][0]}-s{s}", evals)
                for s in seeds for name, p, ss, flags, evals in RUNS if p == part and s in ss]
    return out + collapse_jobs() + q6_jobs() + q7_jobs() + q8_jobs()


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
    """Append one attempt's wall time to study/runs/<run>/times.json."""
    os.makedirs(os.path.join(KEEP, run_id), exist_ok=True)
    path = os.path.join(KEEP, run_id, "times.json")
    times = runs.read_json(path) if os.path.isfile(path) else {}
    times.setdefault(what, []).append({"seconds": round(seconds, 1), "finished": finished, "workers": shard[1],
                                       "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "cpu": cpu(), "host": host()})
    runs.write_json(path, times)


def cpu():
    """The kernels torch picks on this host (AVX512, AVX2, ...): float results differ between them in
    the last bits, so a committed run trains again bit for bit only on the kind it was trained on."""
    return torch.backends.cpu.get_cpu_capability()


def host():
    """The processor model and the packages that compute a run: a seed's values repeat bit for bit only where
    all of them are the same, not merely the kind of kernels (cpu())."""
    import importlib.metadata as meta
    fields = {}
    with open("/proc/cpuinfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    packages = " ".join(f"{p} {meta.version(p)}" for p in ("torch", "transformers", "peft", "bitsandbytes"))
    return (f"{fields.get('model name', '?')} family {fields.get('cpu family', '?')} model {fields.get('model', '?')}; "
            f"{packages}")


def committed_cpus(run_id):
    """The kinds of host (cpu()) whose training logged the run's committed metrics (study/runs/<run>/host.json;
    empty for runs committed before it was kept)."""
    path = os.path.join(KEEP, run_id, "host.json")
    return set(runs.read_json(path)["cpu"]) if os.path.isfile(path) else set()


def train(run_id, flags, seed, start, shard, threads):
    """Train one run to its final/ (resuming what is there); copy its small files to study/."""
    out = os.path.join(WORK, run_id)
    if training_elsewhere(out):                         # another worker trains it (its evaluation came up here)
        wait_for(os.path.join(out, "final"))
    if not os.path.isdir(os.path.join(out, "final")):
        kinds = committed_cpus(run_id)                  # host.json exists only beside committed metrics
        if kinds and cpu() not in kinds:
            raise SystemExit(f"{run_id}'s committed metrics come from a {'/'.join(sorted(kinds))} host and this one "
                             f"is {cpu()}: trained again here it would be another run. Train it on such a host, "
                             f"or remove study/runs/{run_id}/ to replace the run")
        argv = [sys.executable, "train.py", *flags, "--seed", str(seed), "--output_dir", out]
        if start:
            argv += ["--init_from", wait_for(os.path.join(WORK, start, "final"))]
        if os.path.isfile(os.path.join(out, "config.json")):
            argv.append("--resume")
        os.makedirs(out, exist_ok=True)
        lock = os.path.join(out, "training.pid")
        runs.write_text(lock, str(os.getpid()))
        try:
            attempt(run_id, "train", argv, os.path.join(out, "train.log"), os.path.join(out, "final"), shard, threads)
        except SystemExit:
            if not diverged(run_id, out):
                raise
        finally:
            os.remove(lock)
    keep = os.path.join(KEEP, run_id)
    os.makedirs(keep, exist_ok=True)
    if start is None:                                   # a warm-up: keep its fingerprint
        found, path = adapter_fingerprint(os.path.join(out, "final")), os.path.join(keep, "adapter_fingerprint.json")
        if not os.path.isfile(path):
            runs.write_json(path, {"fingerprint": found})
        elif runs.read_json(path)["fingerprint"] != found:
            raise SystemExit(f"{run_id} was trained again and differs from the committed one (another host's "
                             f"numerics: {host()}; study/runs/{run_id}/host.json names its own), so runs started from "
                             f"it would start elsewhere. Train on such a host, or remove study/runs/{run_id}/ and "
                             f"the runs started from it to replace them all")
    if os.path.isfile(os.path.join(keep, "metrics.jsonl")):        # trained again: the same run, or stop
        step = first_difference(os.path.join(keep, "metrics.jsonl"), os.path.join(out, "metrics.jsonl"))
        if step is not None:
            raise SystemExit(f"{run_id} was trained again and its metrics differ from the committed ones from step "
                             f"{step} (another host's numerics?): its evaluations would describe another run. "
                             f"study/runs/{run_id}/ is left as it was; compare the two metrics.jsonl, then remove "
                             f"study/runs/{run_id}/ to replace the run, or runs/study/{run_id}/ to train it again")
    for f in ("config.json", "metrics.jsonl", "conflicts.json"):
        if os.path.isfile(os.path.join(out, f)):
            shutil.copyfile(os.path.join(out, f), os.path.join(keep, f))
    hosts = runs.read_json(os.path.join(keep, "host.json")).get("hosts", []) if committed_cpus(run_id) else []
    runs.write_json(os.path.join(keep, "host.json"), {"cpu": sorted(committed_cpus(run_id) | {cpu()}),
                                                      "hosts": sorted(set(hosts) | {host()})})
    return out


def first_difference(committed, trained):
    """The first step whose row in `trained` differs from `committed` in a value the committed row logs,
    timings aside (time/*, step_time); None when none does. A metric the committed run did not log yet
    is not compared; a missing row is a difference. `lr` is not compared: config.json fixes the schedule,
    and rows logged before train.py logged each step's own rate hold the next step's."""
    old = [r for _, r in read_jsonl(committed)]
    new = [r for _, r in read_jsonl(trained)] if os.path.isfile(trained) else []
    for k, row in enumerate(old):
        logged = {key for key in row if not key.startswith("time/") and key not in ("step_time", "lr")}
        if k >= len(new) or any(new[k].get(key) != row[key] for key in logged):
            return row.get("step", k + 1)
    return None


def training_elsewhere(out):
    """Whether another live worker process is training the run in `out` (its training.pid): a run's
    evaluation jobs may fall to the other worker while the run itself is still training."""
    try:
        with open(os.path.join(out, "training.pid")) as f:
            pid = int(f.read())
        os.kill(pid, 0)                                 # raises when no such process
    except (OSError, ValueError):
        return False
    return pid != os.getpid()


def diverged(run_id, out):
    """train.py stopped the run on consecutive non-finite losses (its exit 1, train.log's last error):
    record study/runs/<run>/diverged.json with the last logged step -> whether it did."""
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
    results to study/runs/<run>/eval-<set>.json."""
    config = runs.read_json(os.path.join(out, "config.json"))
    for name in evals:
        keep = os.path.join(KEEP, run_id, f"eval-{name}.json")
        if os.path.isfile(keep):
            continue
        adapter, same = os.path.join(out, "final"), None
        if name.startswith("rung"):                     # the collapse test: the rung's own test split
            adapter, same = rung_adapter(run_id, out, name)
            if same and os.path.isfile(same):           # this evaluation is done already
                shutil.copyfile(same, keep)
                continue
        if name.endswith("-best"):
            rows = [r for _, r in read_jsonl(os.path.join(out, "metrics.jsonl"))]
            saved = list(runs.saved_checkpoints(out, config))
            step, mean = best_checkpoint(rows, saved)
            runs.write_json(os.path.join(KEEP, run_id, "best.json"), {"step": step, "mean_reward": mean,
                                                                      "window": BEST_WINDOW})
            if step == max(saved):                      # the final adapter: its evaluation is the same one
                shutil.copyfile(os.path.join(KEEP, run_id, f"eval-{name[:-5]}.json"), keep)
                continue
            adapter = os.path.join(out, f"checkpoint-{step}")
        dest = os.path.join(out, f"eval-{name}")
        ds = config["dataset"]                                                      # the run's own task
        if name.startswith("kl"):                      # kl: every checkpoint; kl<N>: step N alone
            argv = [sys.executable, "eval.py", "--drift", out, "--dataset", ds, "--one_shot_from", ds, "--limit",
                    str(KL_PROBE[0]), "--n_samples", str(KL_PROBE[1]), "--seed", "0", "--output_dir", dest]
            argv += ["--drift_steps", name[2:]] if name[2:] else []
        elif name.startswith("rung"):
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
        if same:                                        # the warm-up's: the seed's other run reads it there
            shutil.copyfile(os.path.join(dest, "results.json"), same)


def rung_adapter(run_id, out, name):
    """The adapter a collapse-test evaluation reads -> (folder, None), or (folder, the committed file
    that holds or will hold the same evaluation). `rung`: final/ (a diverged run's last checkpoint);
    `rung-precollapse`: the last scheduled checkpoint before the collapse step -- the final adapter when
    the run never collapsed (the file: its eval-rung.json), the warm-up when none was saved (the file:
    the warm-up's eval-rung.json, which both of the seed's runs read)."""
    config = runs.read_json(os.path.join(out, "config.json"))
    saved = list(runs.saved_checkpoints(out, config))
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
        return last, os.path.join(KEEP, run_id, "eval-rung.json")
    if before:
        return os.path.join(out, f"checkpoint-{before[-1]}"), None
    start = config["init_from"]                                                          # <warm-up>/final
    return start, os.path.join(KEEP, os.path.basename(os.path.dirname(start)), "eval-rung.json")


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


def run_all(shard, only=(), threads=None, seeds=()):
    """This worker's jobs, in order; the table is read again after each job, since the collapse
    part's test joins it once the pilot has chosen its rung. only: run-id prefixes to run, with the
    warm-ups those of them still to finish start from; seeds: only these seeds' jobs."""
    k, n = shard
    threads = threads or max(1, (os.cpu_count() or 1) // n)
    done = set()
    while True:
        table = jobs()
        table = [job for job in table if not seeds or job[2] in seeds]
        chosen = {job[0] for job in table if not only or job[0].startswith(tuple(only))}
        chosen |= {job[3] for job in table if job[0] in chosen and job[3] and not finished(job[0], job[4])}
        todo = [job for i, job in enumerate(table) if i % n == k and (job[0], job[4]) not in done and job[0] in chosen]
        if not todo:
            return
        run_id, flags, seed, start, evals = todo[0]
        done.add((run_id, evals))
        while earlier_rungs_pending(run_id) and not pilot_skipped(run_id):      # the other worker's
            print(f"{run_id} waits for the earlier rungs' GRPO runs", flush=True)
            time.sleep(30)
        if (start and finished(run_id, evals)) or pilot_skipped(run_id):
            continue            # a warm-up's final/ is rebuilt when missing: later runs start from it
        out = train(run_id, flags, seed, start, shard, threads)
        evaluate(run_id, out, evals, shard, threads)


def status():
    """The run table, a line per job. Weights live in runs/study/ only, so a fresh checkout has none: a run
    whose metrics are committed but whose evaluations are not trains again first ("train again")."""
    for run_id, flags, seed, start, evals in jobs():
        keep, out = os.path.join(KEEP, run_id), os.path.join(WORK, run_id)
        ckpts = sorted(int(d.split("-")[1]) for d in os.listdir(out) if d.startswith("checkpoint-")) \
            if os.path.isdir(out) else []
        done = [s for s in evals if os.path.isfile(os.path.join(keep, f"eval-{s}.json"))]
        state = ("done (committed)" if start and finished(run_id, evals) else
                 "trained" if os.path.isdir(os.path.join(out, "final")) else
                 f"at checkpoint {ckpts[-1]}" if ckpts else "started" if os.path.isdir(out) else
                 "train again" if os.path.isfile(os.path.join(keep, "metrics.jsonl")) else "to do")
        last = last_training_seconds(run_id) if state in ("train again", "to do") else None
        kinds = committed_cpus(run_id) if state == "train again" else set()
        print(f"{run_id:20s} {state:18s} evaluated: {', '.join(done) or '-'}"
              + (f"  (its last finished training attempt: {last:.0f} s)" if last else "")
              + (f"  (trained on {'/'.join(sorted(kinds))}; this host: {cpu()})" if kinds else ""))


def last_training_seconds(run_id):
    """Seconds of the run's last finished training attempt in its committed times.json, or None."""
    path = os.path.join(KEEP, run_id, "times.json")
    tried = runs.read_json(path).get("train", []) if os.path.isfile(path) else []
    return next((t["seconds"] for t in reversed(tried) if t["finished"]), None)
# -----------------------------------------------------------------------------
# the committed files, and the collapse rule the runner applies to them

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
                                                      "diverged.json", "host.json")
             if os.path.isfile(os.path.join(d, f))}
    return {"rl": [r for r in rows if r.get("phase") == "rl"], "evals": evals, **files}


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


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shard", default="0/1", metavar="K/N", help="run jobs K, K+N, K+2N, ... (N workers)")
    p.add_argument("--list", action="store_true", help="the run table and the state of each run")
    p.add_argument("--only", default="", metavar="PREFIX,...", help="run only the jobs whose run id starts so "
                   "(e.g. warmup-collapse,pilot)")
    p.add_argument("--seeds", default="", metavar="S,...", help="run only these seeds' jobs (e.g. 1,3,5,7: one "
                   "worker takes a seed's warm-up and every run that starts from it)")
    p.add_argument("--threads", type=int, default=None, help="threads per worker [default: cores / N]")
    p.add_argument("--report", action="store_true", help="only the tables and plots, from study/")
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
            run_all((k, n), [x for x in args.only.split(",") if x], args.threads,
                    [int(x) for x in args.seeds.split(",") if x])
        except Stop:
            print("stopped: the running step saved what it had; run the same command again to continue")
            return 0
        if n > 1:
            return 0                                    # the report once all workers are done: --report
    return subprocess.call([sys.executable, "-m", "study.report"], cwd=HERE)      # it imports this file


if __name__ == "__main__":
    sys.exit(main())
