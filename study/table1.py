"""The paper's Table 1 (its current version) for your adapters: out-of-distribution pass@k on AIME 2024, AIME 2025
and AMC 2023 and maj@k on AMC 2023 from n = 64 samples a problem at temperature 1, our rows beside the authors'
(their Table 1, transcribed in <data_dir>/authors/table1.json; quoted as theirs, never as ours). From the root:

    python -m study.table1 --model llama-8b --train_dataset gsm8k \\
        --run gtpo=runs/gtpo-llama-8b-gsm8k/final --run grpo=runs/grpo-llama-8b-gsm8k/final
    python -m study.table1 ... --limit 2 --n_samples 4 --pass_k 1 2 4 --maj_k 2 4     # a small check
    python -m study.table1 ... --dry_run                                               # the eval.py commands

Each (run, problem set) is one eval.py evaluation with --resume in <output_dir>/<label>/<set>/: run again, the
command samples nothing for a finished set and continues an interrupted one from its last whole problem (Ctrl-C
stops it with one line). An output folder belongs to one adapter per label. The table goes to
<output_dir>/table1.md and table1.json.
"""
import argparse
import gc
import os
import sys

import eval as evaluate
from machinery import runs
from machinery.data import DataError

SETS = ("aime24", "aime25", "amc23")
PASS_K, MAJ_K = (1, 8, 16, 32, 64), (4, 8, 16, 32, 64)          # the paper's columns (Table 1)
NAMES = {"aime24": "AIME24", "aime25": "AIME25", "amc23": "AMC23"}


def columns(pass_k, maj_k):
    """[(set, "pass" or "maj", k)]: pass@k on every set, maj@k on AMC 2023, as Table 1 lays them out."""
    return [(s, "pass", k) for s in SETS for k in pass_k] + [("amc23", "maj", k) for k in maj_k]


def eval_argv(args, adapter, problem_set, out):
    """eval.py's arguments for one (run, problem set)."""
    ks = sorted(set(args.pass_k) | set(args.maj_k))
    return ["--model", args.model, "--dataset", problem_set, "--n_samples", str(args.n_samples), "--k",
            *map(str, ks), "--output_dir", out, "--resume", *(["--adapter", adapter] if adapter != "none" else []),
            *(["--limit", str(args.limit)] if args.limit else []), *(["--data_dir", args.data_dir] if args.data_dir
                                                                    else []), *args.eval_flags.split()]


def ours(args, label, adapter, problem_set):
    """{(set, kind, k): percent} of one evaluation, sampled (or finished) by eval.py."""
    out = os.path.join(args.output_dir, label, problem_set)
    code = evaluate.main(eval_argv(args, adapter, problem_set, out))
    if code == evaluate.STOPPED:
        raise KeyboardInterrupt
    if code != 0:
        raise RuntimeError(f"eval.py failed for {label} on {problem_set}")
    gc.collect()                                        # the model of this evaluation, before the next loads
    res = runs.read_json(os.path.join(out, "results.json"))
    return {(problem_set, kind, int(k)): 100 * v for kind in ("pass", "maj") for k, v in res[f"{kind}@k"].items()}


def authors(data_dir, model, train_dataset):
    """{method: {(set, kind, k): percent}} of the authors' Table 1 rows for `model` trained on `train_dataset`
    ({} when the file is absent or holds neither), and the file's source line."""
    path = os.path.join(data_dir or os.environ.get("GTPO_DATA_DIR", ""), "authors", "table1.json")
    if not os.path.isfile(path):
        return {}, f"the authors' numbers: {path} not found"
    t = runs.read_json(path)
    rows = {}
    for r in t["rows"]:
        if (r["model"], r["train_dataset"]) == (model, train_dataset):
            rows[r["method"]] = {(s, kind, k): v for key, ks in t["k"].items() for s, kind in [key.split("_")]
                                 for k, v in zip(ks, r[key])}
    src = t["source"]
    return rows, f"the authors' numbers: their Table 1 ({src['repo']} at {src['commit'][:7]}, {src['file']})"


def table(rows, cols):
    """A markdown table: one row per (who, label), one column per (set, kind, k); '–' where a row has none."""
    head = "| | " + " | ".join(f"{NAMES[s]} {kind}@{k}" for s, kind, k in cols) + " |"
    lines = [head, "|" + "---|" * (len(cols) + 1)]
    for name, values in rows:
        cells = [f"{values[c]:.1f}" if c in values else "–" for c in cols]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="the base model of the runs (an alias, e.g. llama-8b, or a folder)")
    p.add_argument("--train_dataset", default="gsm8k", help="what the runs trained on (gsm8k or math): picks the "
                   "authors' rows")
    p.add_argument("--authors_model", default=None, help="whose rows of the authors' table to show beside ours, "
                   "whatever --model is (an alias, or a folder of the same weights): llama-8b or qwen2.5-3b "
                   "[default: --model]")
    p.add_argument("--run", action="append", required=True, metavar="LABEL=ADAPTER",
                   help="a run to evaluate: its label (gtpo, grpo, sft match the authors' rows) and its final/ "
                        "folder, or 'none' for the base model; repeat for several")
    p.add_argument("--n_samples", type=int, default=64, help="samples a problem (Table 1: 64)")
    p.add_argument("--pass_k", type=int, nargs="+", default=list(PASS_K))
    p.add_argument("--maj_k", type=int, nargs="+", default=list(MAJ_K))
    p.add_argument("--limit", type=int, default=None, help="the first N problems of each set (a check)")
    p.add_argument("--data_dir", default=None, help="folder with <set>/test.jsonl and authors/table1.json "
                   "[default: $GTPO_DATA_DIR]")
    p.add_argument("--eval_flags", default="", help="more eval.py flags, e.g. '--max_completion_length 1500'")
    p.add_argument("--output_dir", default="runs/table1")
    p.add_argument("--dry_run", action="store_true", help="print the eval.py commands, run nothing")
    args = p.parse_args(argv)
    if not all("=" in r for r in args.run):
        p.error("--run takes LABEL=ADAPTER, e.g. --run gtpo=runs/gtpo-llama-8b-gsm8k/final")
    plan = [tuple(r.split("=", 1)) for r in args.run]
    if args.dry_run:
        for label, adapter in plan:
            for s in SETS:
                print("python eval.py " + " ".join(eval_argv(args, adapter, s, os.path.join(args.output_dir, label, s))))
        return 0
    cols = columns(args.pass_k, args.maj_k)
    rows, done = [], 0
    try:
        for label, adapter in plan:
            values = {}
            for s in SETS:
                values.update(ours(args, label, adapter, s))
                done += 1
            rows.append((f"ours: {label}", values))
    except KeyboardInterrupt:
        print(f"stopped (Ctrl-C) after {done} of {len(plan) * len(SETS)} evaluations; the same command again samples "
              f"nothing for those and continues the next from its last whole problem", file=sys.stderr)
        return evaluate.STOPPED
    who = args.authors_model or args.model
    theirs, source = authors(args.data_dir, who, args.train_dataset)
    rows += [(f"authors: {method} ({who}, {args.train_dataset})", v) for method, v in theirs.items()]
    text = (f"{table(rows, cols)}\n\nPercent of problems; ours: n = {args.n_samples} samples a problem"
            f"{f', the first {args.limit} problems of each set' if args.limit else ''}; {source}.\n")
    runs.write_json(os.path.join(args.output_dir, "table1.json"),
                    {"columns": [list(c) for c in cols], "source": source, "n_samples": args.n_samples,
                     "limit": args.limit, "rows": [{"name": n, "values": [v.get(c) for c in cols]} for n, v in rows]})
    with open(os.path.join(args.output_dir, "table1.md"), "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except DataError as e:
        raise SystemExit(f"error: {e}")
