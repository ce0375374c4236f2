"""Part 9 (--parts heldout): what the in-run held-out evaluation (train.py --eval_steps, machinery/heldout.py) adds to a run.

Each profile runs train.py in a fresh process on the embedded model with its evaluations on, and reads from the
run's own metrics.jsonl the seconds of every step and of every evaluation (eval/seconds): one run, both costs.
    demo     the demo as `python train.py` runs it (its profile: 8 SFT steps, 20 RL steps), evaluations as the
             demo profile sets them
    paper    the paper profile's evaluation (--eval_limit 64 --eval_n_samples 4, every --save_steps 500 steps)
             against RL steps of the paper's group size (G = 12) on the embedded model; its share is of a run of
             500 such steps per evaluation
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROFILES = {"demo": [],
            "paper": ["--sft_warmup_steps", "0", "--max_steps", "3", "--generation_size", "12", "--eval_steps", "3",
                      "--eval_limit", "64", "--eval_n_samples", "4", "--save_steps", "3"]}
PAPER_EVERY = 500                                   # Config.save_steps: the paper profile evaluates every 500 steps


def measure(flags, out):
    """train.py with flags into out -> (seconds of each step, of each evaluation, the evaluation rows)."""
    cmd = [sys.executable, os.path.join(HERE, "train.py"), *flags, "--output_dir", out]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=HERE, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if r.returncode:
        raise RuntimeError(f"train.py {' '.join(flags)} failed:\n{r.stderr[-2000:]}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    evals = [r for r in rows if r.get("phase") == "eval"]
    return [r for r in rows if "step_time" in r], evals


def report_heldout(args, res):
    res["heldout"] = {}
    print("\n9. held-out evaluation during a run (train.py --eval_steps), embedded model, one run per profile")
    for name, flags in PROFILES.items():
        with tempfile.TemporaryDirectory() as tmp:
            steps, evals = measure(flags, os.path.join(tmp, "run"))
        rl = [r["step_time"] for r in steps if r.get("phase") == "rl"]
        run_s, eval_s = sum(r["step_time"] for r in steps), [r["eval/seconds"] for r in evals]
        if name == "paper":                         # one evaluation per PAPER_EVERY RL steps of this size
            share = statistics.median(eval_s) / (statistics.median(eval_s) + PAPER_EVERY * statistics.median(rl))
        else:
            share = sum(eval_s) / (sum(eval_s) + run_s)
        res["heldout"][name] = {"flags": flags, "rl_step_seconds": rl, "run_step_seconds": run_s,
                                "eval_seconds": eval_s, "eval_steps": [r["step"] for r in evals],
                                "eval_problems": evals[0]["eval/problems"], "eval_n": evals[0]["eval/n"],
                                "share_of_run": share}
        print(f"   {name:5s}: {len(evals)} evaluations of {evals[0]['eval/problems']} problems x {evals[0]['eval/n']} "
              f"at steps {[r['step'] for r in evals]}: {', '.join(f'{s:.1f}' for s in eval_s)} s; RL step median "
              f"{statistics.median(rl):.1f} s, steps in all {run_s:.0f} s; evaluation's share of the run "
              f"{share:.1%}" + (f" (one evaluation per {PAPER_EVERY} steps)" if name == "paper" else ""))
