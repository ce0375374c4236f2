"""The CPU-scale study's runner: trains and evaluates the jobs of study/plan.py's parts (docs/study.md declares
them), one subprocess at a time per worker, and copies each run's small files to study/runs/<run>/.

Each run starts from its seed's warm-up (train.py --init_from) and is evaluated with eval.py on the sets its
arm names: `id`, the first 64 problems of the arithmetic test split; `ood`, the first 48 of the `reworded`
split; `id-best`, the ID set on the checkpoint with the highest mean training reward over the BEST_WINDOW steps
up to it; `kl` / `kl<N>`, the KL to the start at every checkpoint / at step N (eval.py --drift); `rung`,
`rung-precollapse`, the collapse part's. Same n, k and sampling seed for every model; each problem's correct
count is kept.

Resumable at every level, any number of times: finished steps are skipped, an interrupted training continues
from its last checkpoint (train.py --resume) on the host that began it, an interrupted evaluation from its last
whole problem (eval.py --resume); a run is evaluated on the host that trained it. Ctrl-C (or SIGTERM) lets the
running step finish and save. From the repository root:

    python -m study.run --shard 0/2 & python -m study.run --shard 1/2 & wait   # two workers, one thread each
    python -m study.run --threads 1 --only q7-released,q8- --seeds 1 &         # one part, one worker per seed
    python -m study.run --part q10                    # one part: two one-thread workers, then the report
    python -m study.run --list                        # the table and how far each run is
    python -m study.run --report                      # tables + plots from the committed files (study/report.py)

Big files (checkpoints, adapters, eval samples, logs) stay in runs/study/; config.json, metrics.jsonl,
times.json, conflicts.json, best.json, host.json and eval-<set>.json are committed. So a fresh checkout has no
weights: an evaluation still to run trains its run again first, which must log what the committed
metrics.jsonl holds, timings aside, or the worker stops (first_difference); a retrained warm-up must match its
committed fingerprint.
"""
import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time

import torch

from machinery import runs
from machinery.data import read_jsonl
from study.plan import (BEST_WINDOW, EVAL_COMMON, EVALS, KEEP, KL_PROBE, PARTS, STUDY, arm, collapse_step,
                        earlier_rungs_pending, jobs, load, part, part_jobs, pilot_skipped)

HERE = os.path.dirname(STUDY)                          # the repository root, where train.py runs
WORK = os.path.join(HERE, "runs", "study")             # big files, never committed

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


def part_hosts(p):
    """The hosts (host()) that trained or began any run of part p, by its committed host.json and times.json."""
    found = set()
    for a in p.arm_list():
        for s in (a.seeds if a.flags else ()):
            keep = os.path.join(KEEP, a.run_id(s))
            if os.path.isfile(os.path.join(keep, "host.json")):
                found |= set(runs.read_json(os.path.join(keep, "host.json")).get("hosts", []))
            if os.path.isfile(os.path.join(keep, "times.json")):
                found |= {t["host"] for ts in runs.read_json(os.path.join(keep, "times.json")).values() for t in ts}
    return found


def check_part_host(run_id):
    """A part declared on one host kind (plan.Part.one_host) trains nothing on another: stop, naming both."""
    name = run_id.rsplit("-s", 1)[0]
    for p in PARTS:
        if p.one_host and any(a.name == name and a.flags for a in p.arm_list()):
            kinds, here = part_hosts(p), host()
            if kinds and here not in kinds:
                raise SystemExit(f"part {p.key} runs on one host kind ({'; '.join(sorted(kinds))}) and this host is "
                                 f"{here}: {run_id} is not trained here (docs/study.md, part {p.key}, says what "
                                 f"happens on another kind){packages_to_install(kinds, here)}")


def packages_to_install(kinds, here):
    """Where only the package versions differ from a kind's, the pip install that makes host `here` that kind."""
    chip, _, mine = here.partition("; ")
    for their_chip, _, theirs in (kind.partition("; ") for kind in sorted(kinds)):
        if their_chip == chip:
            want, have = (dict(zip(v.split()[::2], v.split()[1::2])) for v in (theirs, mine))
            pins = [f"{name}=={v.split('+')[0]}" for name, v in want.items() if have.get(name) != v]
            return f". This processor is the part's: pip install {' '.join(pins)}, then run again" if pins else ""
    return ""


def train(run_id, flags, seed, start, shard, threads):
    """Train one run to its final/ (resuming what is there); copy its small files to study/."""
    out = os.path.join(WORK, run_id)
    if training_elsewhere(out):                         # another worker trains it (its evaluation came up here)
        wait_for(os.path.join(out, "final"))
    if not os.path.isdir(os.path.join(out, "final")):
        check_part_host(run_id)
        kinds = committed_cpus(run_id)                  # host.json exists only beside committed metrics
        if kinds and cpu() not in kinds:
            raise SystemExit(f"{run_id}'s committed metrics come from a {'/'.join(sorted(kinds))} host and this one "
                             f"is {cpu()}: trained again here it would be another run. Train it on such a host, "
                             f"or remove study/runs/{run_id}/ to replace the run")
        argv = [sys.executable, "train.py", *flags, "--seed", str(seed), "--output_dir", out]
        if start:
            argv += ["--init_from", wait_for(os.path.join(WORK, start, "final"))]
        if os.path.isfile(os.path.join(out, "config.json")):
            check_same_host(run_id, out)
            argv.append("--resume")
        os.makedirs(out, exist_ok=True)
        runs.write_text(os.path.join(out, "host.txt"), host())
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
    timings and held-out evaluations (machinery/heldout.py's rows) aside; None when none does. A metric the committed run
    did not log yet is not compared; a missing row is a difference. `lr` is not compared: config.json fixes the schedule,
    and rows logged before train.py logged each step's own rate hold the next step's."""
    old = [r for _, r in read_jsonl(committed) if r.get("phase") != "eval"]      # held-out rows: not training's
    new = [r for _, r in read_jsonl(trained) if r.get("phase") != "eval"] if os.path.isfile(trained) else []
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
        check_same_host(run_id, out, evaluating=True)
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


def check_same_host(run_id, out, evaluating=False):
    """An interrupted training resumes, and a run is evaluated, only on the host that began its training
    (runs/study/<run>/host.txt): elsewhere its later steps, or its samples, would take other numerics, and no
    committed file would show the seam."""
    path = os.path.join(out, "host.txt")
    began = open(path).read() if os.path.isfile(path) else None
    if began is not None and began != host():
        what, there = ("trained", "Evaluate it there") if evaluating else ("interrupted", "Resume it there")
        raise SystemExit(f"{run_id} was {what} on another host ({began}); this one is {host()}. {there}, or "
                         f"remove runs/study/{run_id}/ to train it from the start here")


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
        if not_chosen(run_id):
            continue
        while earlier_rungs_pending(run_id) and not pilot_skipped(run_id):      # the other worker's
            print(f"{run_id} waits for the earlier rungs' GRPO runs", flush=True)
            time.sleep(30)
        if (start and finished(run_id, evals)) or pilot_skipped(run_id):
            continue            # a warm-up's final/ is rebuilt when missing: later runs start from it
        out = train(run_id, flags, seed, start, shard, threads)
        evaluate(run_id, out, evals, shard, threads)


def not_chosen(run_id):
    """A next-step arm (plan.Arm.when) runs only once its part's declared rule has chosen it (study.q10.next_step);
    until then, and when the rule chose otherwise, its jobs are not run."""
    from study.q10 import next_step
    a = arm(run_id.rsplit("-s", 1)[0])
    return bool(a and a.when) and next_step() != a.when


def run_part(key, workers):
    """One part, resumable: its first runs on `workers` one-thread workers, each taking every workers-th seed of the
    part's order (a seed's warm-up and runs back to back in one worker); then the runs its declared next step
    chose (plan.Arm.when), the same way; then the report. Ctrl-C stops every worker after its running step."""
    p = part(key)
    seeds = list(dict.fromkeys(job[2] for job in part_jobs(p)))
    trained = [a for a in p.arm_list() if a.flags and a.start]
    for step in ("first", "next"):
        names = [a.name for a in trained if (a.when is None) == (step == "first") and not not_chosen(f"{a.name}-s0")]
        if not names:
            continue
        procs = [subprocess.Popen([sys.executable, "-m", "study.run", "--threads", "1", "--only", ",".join(names),
                                   "--seeds", ",".join(map(str, seeds[k::workers]))], cwd=HERE)
                 for k in range(workers)]                 # Ctrl-C reaches each worker too: it saves and stops
        try:
            failed = [proc.wait() for proc in procs]
        except KeyboardInterrupt:
            for proc in procs:
                proc.wait()
            print("stopped: each worker saved what it had; run the same command again to continue")
            return 130
        if any(failed):
            return 1
    return subprocess.call([sys.executable, "-m", "study.report"], cwd=HERE)


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
    p.add_argument("--part", default="", metavar="KEY", help="run one part of study/plan.py on --workers one-thread "
                   "workers (its declared next step after its first runs), then the report (e.g. q10)")
    p.add_argument("--workers", type=int, default=2, help="workers for --part [default: 2]")
    args = p.parse_args(argv)
    try:
        k, n = (int(x) for x in args.shard.split("/"))
        assert 0 <= k < n
    except (ValueError, AssertionError):
        p.error(f"--shard {args.shard!r}: give K/N with 0 <= K < N, e.g. 0/2")
    if args.list:
        return status()
    if args.part:
        if args.part not in {q.key for q in PARTS}:
            p.error(f"--part {args.part!r}: study/plan.py has {', '.join(q.key for q in PARTS)}")
        return run_part(args.part, max(1, args.workers))
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
