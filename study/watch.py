"""Watch RL teach (docs/study.md Part 8): one seed of Q8's released arm from nothing -- Q7's 32-step SFT warm-up,
then 200 GTPO steps with the released entropy term, both with the study's flags (study/plan.py) -- and the ID
evaluation (64 test problems, 8 samples) of the warm-up and of the final adapter. Each command is printed before
it runs; a step whose output is there is skipped, so running it again continues. From the repository root:

    python -m study.watch                 # seed 1, into runs/watch-s1/
    python -m study.watch --dry_run       # only print the four commands

The end prints pass@1 at the start and the end beside the study's committed values for the seed (study/runs/):
bit-equal only on the study's host and packages (host.json), the same recipe and seed everywhere else.
"""
import argparse
import os
import subprocess
import sys

from machinery import runs
from study.plan import EVAL_COMMON, EVALS, arm, load

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))     # the repository root
WARMUP, ARM = "warmup-q9", "q7-released"                              # the arm's warm-up, evaluated (part q9)


def commands(seed, out):
    """The four commands, in order: (argv, the file that marks it done)."""
    warm, rl = os.path.join(out, "warmup"), os.path.join(out, "rl")
    evaluation = [*EVALS["id"], *EVAL_COMMON]
    return [(["train.py", *arm(WARMUP).flags, "--seed", str(seed), "--output_dir", warm], os.path.join(warm, "final")),
            (["train.py", *arm(ARM).flags, "--seed", str(seed), "--init_from", os.path.join(warm, "final"),
              "--output_dir", rl], os.path.join(rl, "final")),
            *[(["eval.py", "--adapter", os.path.join(run, "final"), *evaluation, "--output_dir", dest],
               os.path.join(dest, "results.json"))
              for run, dest in ((warm, os.path.join(out, "eval-start")), (rl, os.path.join(out, "eval-end")))]]


def run(argv, done):
    """One step: skipped when done exists, resumed when it began (train.py / eval.py --resume)."""
    if os.path.exists(os.path.join(HERE, done)):
        print(f"done already: {done}", flush=True)
        return
    began = os.path.join(HERE, os.path.dirname(done), "config.json" if argv[0] == "train.py" else "samples.jsonl")
    if os.path.exists(began):
        argv = [*argv, "--resume"]
    print("$ python " + " ".join(argv), flush=True)
    subprocess.run([sys.executable, *argv], cwd=HERE, check=True)


def committed(run_id):
    """The committed run's ID pass@1 (study/runs/<run>/eval-id.json), None where there is none."""
    d = load(run_id)
    return d["evals"]["id"]["accuracy"] if d and "id" in d["evals"] else None


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed", type=int, default=1, help="the study's seed (1-8) [default: 1, the first]")
    p.add_argument("--output_dir", default=None, help="[default: runs/watch-s<seed>]")
    p.add_argument("--dry_run", action="store_true", help="print the commands, run nothing")
    args = p.parse_args(argv)
    out = args.output_dir or os.path.join("runs", f"watch-s{args.seed}")
    steps = commands(args.seed, out)
    if args.dry_run:
        for cmd, _ in steps:
            print("python " + " ".join(cmd))
        return
    for cmd, done in steps:
        run(cmd, done)
    for name, (_, done), study in (("start (warm-up)", steps[2], WARMUP), ("end (200 RL steps)", steps[3], ARM)):
        r = runs.read_json(os.path.join(HERE, done))
        seen = committed(f"{study}-s{args.seed}")
        print(f"{name}: ID pass@1 {r['accuracy']:.3f}, formatted {r['format_rate']:.0%}"
              + (f"   (study/runs/{study}-s{args.seed}: {seen:.3f})" if seen is not None else ""))


if __name__ == "__main__":
    main()
