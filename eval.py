"""Evaluation: a model sampled on a problem set and scored, pass@k and maj@k at temperature 1.0 (Sec. 6; Fig. 2
bottom, Fig. 3), or a run's KL to its start (--drift); the figures are analysis/plots.py's, called from here.

    python eval.py                                    # embedded model, built-in task, offline
    python eval.py --model llama-8b --adapter runs/gtpo-llama-8b-gsm8k/final --dataset gsm8k \\
        --n_samples 32 --k 1 2 4 8 16 32
    python eval.py --model llama-8b --adapter ... --dataset aime24 --n_samples 64
    python eval.py --rescore runs/eval-x/samples.jsonl  # re-score saved completions, no sampling
    python eval.py --plot runs/*/results.json         # pass@k / maj@k curves overlaid (passk.png)
    python eval.py --curves runs/*/metrics.jsonl      # training curves overlaid (curves.png)
    python eval.py --drift runs/grpo-x --limit 16 --n_samples 2   # KL to the run's start, per checkpoint

Each problem gets n completions, scored by the training reward (rewards.reward: formatting and
correctness separately). pass@k is the unbiased estimator of Chen et al. 2021; maj@k is the
probability that the most frequent answer among k of the n samples is correct, with answers
grouped by the same equivalence used for correctness (so `0.5` and `\\frac12` are one vote).
"""
import argparse
import datetime
import itertools
import json
import math
import os
import sys

import torch

import rewards
from analysis.drift import drift_main
from analysis.plots import model_label, plot_main, plot_passk
from machinery import runs
from machinery.config import check_device
from machinery.data import DataError, format_prompt, load_task, one_shot_example, read_jsonl, task_name
from machinery.models import ModelError, load_eval_model, pick_dtype
from machinery.runs import ConfigError
from rewards import answers_equal, extract_answer
from speedups.memory import pick_sampler

EXACT_MAJ_SUBSETS = 5000        # maj@k is computed exactly when C(n, k) is at most this
STOPPED = 130                   # the exit code of a command ended by Ctrl-C (128 + SIGINT), as shells give it


# -----------------------------------------------------------------------------
# 1. estimators

def pass_at_k(n, c, k):
    """Unbiased pass@k of one problem with c correct out of n samples (Chen et al. 2021, Eq. 1):
    1 - C(n-c, k) / C(n, k), as a product so that no huge binomial is formed."""
    if not 1 <= k <= n:
        raise ValueError(f"pass@{k} needs 1 <= k <= n = {n} samples; raise --n_samples or lower --k")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def vote_classes(answers, reference, task):
    """Group equivalent answers into vote classes.

    answers: n extracted answers (None = no answer, casts no vote). Returns (cls, cls_correct):
    cls[j] is the class of sample j (-1 for None), classes numbered in order of first appearance;
    a sample joins the first class whose first member it equals under `answers_equal`, so a class
    is correct iff that first member is (equivalence on real answers is transitive; on odd
    LaTeX it may not be, and then the first member decides).
    """
    reps, cls = [], []
    for a in answers:
        if a is None or not a.strip():
            cls.append(-1)
            continue
        for c, r in enumerate(reps):
            if a == r or answers_equal(a, r, task):
                cls.append(c)
                break
        else:
            reps.append(a)
            cls.append(len(reps) - 1)
    return cls, [answers_equal(r, reference, task) for r in reps]


def maj_at_k(cls, cls_correct, k, n_subsets=2000, seed=0):
    """maj@k of one problem: over k-subsets of the n samples, the fraction whose majority answer is
    correct. Ties go to the class that appears first (lowest sample index) in the subset; a subset
    with no answer at all counts as wrong. Exact (all C(n, k) subsets) when there are at most
    EXACT_MAJ_SUBSETS, else the mean over `n_subsets` uniform random subsets from `seed`."""
    n = len(cls)
    if not 1 <= k <= n:
        raise ValueError(f"maj@{k} needs 1 <= k <= n = {n} samples; raise --n_samples or lower --k")
    C = len(cls_correct)
    if C == 0:
        return 0.0
    if math.comb(n, k) <= EXACT_MAJ_SUBSETS:
        subsets = torch.tensor(list(itertools.combinations(range(n), k)), dtype=torch.long)   # (S, k)
    else:
        g = torch.Generator().manual_seed(seed)
        subsets = torch.rand(n_subsets, n, generator=g).argsort(dim=1)[:, :k]             # (S, k)
    S = subsets.shape[0]
    c = torch.tensor(cls, dtype=torch.long)[subsets]                                       # (S, k)
    voted = c >= 0
    c_safe = c.clamp(min=0)
    counts = torch.zeros(S, C, dtype=torch.long).scatter_add_(1, c_safe, voted.long())      # (S, C)
    first = torch.full((S, C), n, dtype=torch.long).scatter_reduce_(
        1, c_safe, torch.where(voted, subsets, n), reduce="amin")                           # (S, C)
    winner = (counts * (n + 1) - first).argmax(dim=1)                                      # (S,)
    ok = torch.tensor(cls_correct)[winner] & voted.any(dim=1)
    return ok.sum().item() / S


def default_ks(n):
    """1, 2, 4, ... up to n, and n itself (the paper's x-axis)."""
    return sorted({2 ** i for i in range(int(math.log2(n)) + 1)} | {n})


def check_ks(ks, n):
    bad = [k for k in ks if not 1 <= k <= n]
    if bad:
        raise DataError(f"k = {bad} with n = {n} samples per problem: pass@k and maj@k need 1 <= k <= n; "
                        f"lower --k or raise --n_samples")


def compute_results(rows, ks, seed, maj_subsets=2000):
    """Per-sample rows (as written to samples.jsonl) -> pass@k, maj@k, formatting, length, and each
    problem's number of correct samples."""
    problems = {}
    for r in rows:
        problems.setdefault(r["problem"], []).append(r)
    ns = {len(v) for v in problems.values()}
    if len(ns) != 1:
        raise DataError(f"every problem needs the same number of samples; found {sorted(ns)}")
    n = ns.pop()
    check_ks(ks, n)
    passk = {k: 0.0 for k in ks}
    majk = {k: 0.0 for k in ks}
    correct = []
    for p, samples in sorted(problems.items()):
        samples = sorted(samples, key=lambda r: r["sample"])
        c = sum(r["correct"] > 0 for r in samples)
        correct.append(c)
        cls, cls_ok = vote_classes([r["answer"] for r in samples], samples[0]["reference"], samples[0]["task"])
        for k in ks:
            passk[k] += pass_at_k(n, c, k)
            majk[k] += maj_at_k(cls, cls_ok, k, maj_subsets, seed=seed * 100003 + p)
    P = len(problems)
    return {"n_problems": P, "n_samples": n,
            "pass@k": {str(k): v / P for k, v in passk.items()},
            "maj@k": {str(k): v / P for k, v in majk.items()},
            "accuracy": sum(r["correct"] > 0 for r in rows) / len(rows),
            "format_rate": sum(r["format"] == 10.0 for r in rows) / len(rows),
            "mean_format_reward": sum(r["format"] for r in rows) / len(rows),
            "mean_length": sum(r["length"] for r in rows) / len(rows),
            "truncated_frac": sum(bool(r["truncated"]) for r in rows) / len(rows),
            "per_problem_correct": correct}                 # in problem order: paired tests across models


def resumable_rows(path, records, n, per_call=1, log=print):
    """Rows of an evaluation that can be kept: whole problems, in order, whose question matches this dataset (a
    torn last line, left by a kill mid-write, is dropped with a notice); all of them when every problem is whole,
    else up to a multiple of per_call (problems per rollout call): an unfinished call is drawn again whole, so
    every later call batches what an uninterrupted evaluation would."""
    rows = [obj for _, obj in read_jsonl(path, log_torn=log)]
    by_problem = {}
    for r in rows:
        by_problem.setdefault(r["problem"], []).append(r)
    counts = {len(v) for p, v in by_problem.items() if p + 1 in by_problem}     # all but the last problem
    if counts and counts != {n}:
        raise DataError(f"--resume: {path} has {sorted(counts)} samples per problem, this run asks for "
                        f"--n_samples {n}; use the same flags or another --output_dir")
    keep = []
    for p in range(len(records)):
        got = by_problem.get(p, [])
        if len(got) != n:
            break
        if got[0]["question"] != records[p]["question"]:
            raise DataError(f"--resume: {path} problem {p} is a different question than --dataset gives; "
                            f"use the same --dataset/--split/--limit or another --output_dir")
        keep += sorted(got, key=lambda r: r["sample"])
    whole = len(keep) // n
    if whole < len(records):
        whole -= whole % per_call
    return keep[:whole * n]


def rescore_rows(rows):
    """Recompute extracted answer and rewards of saved completions with the current reward code."""
    for r in rows:
        total, fmt, cor = rewards.reward([r["completion"]], [r["reference"]], r["task"])
        r.update(answer=extract_answer(r["completion"]), reward=total.item(), format=fmt.item(), correct=cor.item())
    return rows


def summary(res):
    k0, kk = list(res["pass@k"])[0], list(res["pass@k"])[-1]
    return (f"{res['dataset']}: {res['n_problems']} problems x n={res['n_samples']} | pass@{k0} "
            f"{res['pass@k'][k0]:.3f}  pass@{kk} {res['pass@k'][kk]:.3f}  "
            f"maj@{kk} {res['maj@k'][kk]:.3f} | format {res['format_rate']:.2f} | mean length "
            f"{res['mean_length']:.1f} tokens, {round(res['truncated_frac'] * res['n_problems'] * res['n_samples'])} "
            f"of {res['n_problems'] * res['n_samples']} truncated at --max_completion_length")


def read_rows(path):
    """The JSON objects of a .jsonl file (data.read_jsonl: a malformed line names file:line)."""
    return [obj for _, obj in read_jsonl(path)]


# -----------------------------------------------------------------------------
# 2. sampling

def sample_problems(model, tok, records, task, args, example, out_f, rows=(), share=(0, 1), show=True):
    """n completions per record, `--batch_size` completions per rollout call; rows to out_f.
    `rows`: complete problems already sampled (--resume), which are skipped. share (rank, ranks): this process
    samples every ranks-th call from the rank-th; a call draws the same samples whichever process runs it."""
    from tqdm import tqdm
    from rollout import rollout
    n, B = args.n_samples, args.batch_size
    per_call = max(1, B // n)                               # whole problems per call, or
    chunk = min(n, B)                                       # one problem split over calls
    rows = list(rows)
    first = len(rows) // n
    bar = tqdm(total=len(records), initial=first, desc=f"eval {task}", dynamic_ncols=True, disable=not show)
    for s in range(first, len(records), per_call):
        if (s // per_call) % share[1] != share[0]:
            continue
        torch.manual_seed(args.seed + s)                    # a call's samples depend on seed and position only,
        group = list(enumerate(records[s:s + per_call], s))  # so --resume reproduces an uninterrupted run
        prompts = [format_prompt(tok, r["question"], example) for _, r in group]
        texts, lengths, trunc = [[] for _ in group], [[] for _ in group], [[] for _ in group]
        for done in range(0, n, chunk):
            m = min(chunk, n - done)
            ro = rollout(model, tok, prompts, m, args.max_completion_length, args.temperature, path=args.rollout)
            lens = ro.completion_mask.sum(1).tolist()
            for j in range(len(group)):
                texts[j] += ro.texts[j * m:(j + 1) * m]
                lengths[j] += lens[j * m:(j + 1) * m]
                trunc[j] += ro.truncated[j * m:(j + 1) * m].tolist()
        for j, (p, r) in enumerate(group):
            total, fmt, cor = rewards.reward(texts[j], [r["answer"]] * n, task)
            for i in range(n):
                row = {"problem": p, "sample": i, "task": task, "question": r["question"],
                       "reference": r["answer"], "completion": texts[j][i], "answer": extract_answer(texts[j][i]),
                       "reward": total[i].item(), "format": fmt[i].item(), "correct": cor[i].item(),
                       "length": lengths[j][i],
                       "truncated": trunc[j][i]}
                rows.append(row)
                out_f.write(json.dumps(row) + "\n")
            out_f.flush()
        bar.update(len(group))
        bar.set_postfix(acc=round(sum(r["correct"] > 0 for r in rows) / len(rows), 3),
                        fmt=round(sum(r["format"] == 10 for r in rows) / len(rows), 3))
    bar.close()
    return rows


# -----------------------------------------------------------------------------
# 3. main

def parse_args(argv=None):
    from gtpo import AT_LEAST_0
    from machinery.flags import AT_LEAST_1, POSITIVE, Parser, checked   # train.py's flag spelling, errors, ranges
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    count, at_least_1, positive = checked(int, AT_LEAST_0), checked(int, AT_LEAST_1), checked(float, POSITIVE)
    run = " [default: with --adapter a training run's folder, the run's own; else %s]"
    a("--model", default=None, help="alias (llama-8b, qwen2.5-3b, smollm2-135m), local folder or Hub id"
      + run % "smollm2-135m")
    a("--adapter", default=None, help="a training run's final/ or checkpoint-N/ folder (LoRA or full weights)")
    a("--dataset", default=None, help="gsm8k, math, math500, aime24, aime25, amc23, arithmetic, or a .jsonl path"
      + run.replace("own", "held-out set (its --eval_dataset)") % "arithmetic")
    a("--task", default=None, choices=["auto", "numeric", "latex"],
      help="how answers are compared (train.py's --task): auto = the dataset's own" + run % "auto")
    a("--split", default=None, help="dataset split" + run.replace("own", "--eval_split") % "test")
    a("--data_dir", default=None, help="folder with <dataset>/<split>.jsonl [default: the run's --data_dir, then "
      "$GTPO_DATA_DIR, then the Hub]")
    a("--limit", type=count, default=None, help="evaluate the first N problems only")
    a("--n_samples", type=at_least_1, default=8, help="completions per problem (paper: 32; 64 for AIME)")
    a("--k", type=at_least_1, nargs="+", default=None, help="k values (default: powers of 2 up to n_samples)")
    a("--temperature", type=positive, default=1.0, help="sampling temperature (paper: 1.0)")
    a("--max_completion_length", type=at_least_1, default=None, help="max new tokens (default 1500; 96 for smollm2-135m)")
    a("--batch_size", type=at_least_1, default=32, help="completions per rollout call (a problem's n samples may span calls)")
    a("--one_shot_from", default=None, metavar="DATASET",
      help="dataset whose first train record is shown as a worked example, or 'none' "
           "(default: arithmetic for smollm2-135m, as in its training demo; none otherwise)")
    a("--maj_subsets", type=at_least_1, default=2000, help="random k-subsets per problem for maj@k when exact is costly")
    a("--seed", type=int, default=0, help="sampling seed")
    a("--rollout", choices=["auto", "generate", "merged", "shared"], default="auto",
      help="sampler, as train.py's: auto = on CUDA the merged copy when it fits the device, else generate; on "
           "CPU the shared-prompt decode loop")
    a("--device", default=None, help="cuda, cuda:1 or cpu (default: cuda if available)")
    a("--load_in_4bit", action=argparse.BooleanOptionalAction, default=None,
      help="4-bit NF4 weights (slow on CPU)" + run % "off")
    a("--dtype", choices=["auto", "float32", "bfloat16"], default=None,
      help="weights dtype (auto = bf16 on a CUDA GPU that has it, else fp32)" + run % "auto")
    a("--output_dir", default=None, help="default runs/eval-<model>-<dataset>[-<adapter run>]")
    a("--overwrite", action="store_true", help="replace results already in --output_dir")
    a("--resume", action="store_true", help="finish an interrupted evaluation in --output_dir (same flags)")
    a("--rescore", default=None, metavar="SAMPLES_JSONL", help="re-score a saved samples.jsonl instead of sampling")
    a("--plot", nargs="+", default=None, metavar="RESULTS_JSON", help="overlay pass@k/maj@k of these results")
    a("--curves", nargs="+", default=None, metavar="METRICS_JSONL", help="plot training curves of these runs")
    a("--smooth", type=at_least_1, default=5, help="moving-average window for --curves")
    a("--render", default=None, metavar="SAMPLES_JSONL",
      help="draw a GTPO group logged in a training run's samples.jsonl like Fig. 9 (PNG + HTML)")
    a("--render_step", type=int, default=None, help="the step of the group to draw (default: the last with conflicts)")
    a("--drift", default=None, metavar="RUN_DIR", help="a training run's KL to its start (--init_from) at each "
      "checkpoint, on --limit problems x --n_samples completions (results.json)")
    a("--drift_steps", type=int, nargs="+", default=None, metavar="STEP",
      help="with --drift: only these checkpoints (0 = the start; default: the start and every scheduled one)")
    return with_run_defaults(p.parse_args(argv))


# a setting not given -> (the training run's config.json key it then reads, eval.py's own default)
RUN_DEFAULTS = {"model": ("model", "smollm2-135m"), "dataset": ("eval_dataset", "arithmetic"),
                "split": ("eval_split", "test"), "task": ("task", "auto"), "data_dir": ("data_dir", None),
                "load_in_4bit": ("load_in_4bit", False), "dtype": ("dtype", "auto")}


def with_run_defaults(args):
    """The settings not given: where --adapter is a training run's folder (the run, its final/ or a checkpoint-N/),
    the run's own -- its base model, 4-bit and dtype, and its held-out problems (train.py --eval_dataset,
    --eval_split; the training dataset where the run predates them) -- as train.py's in-run evaluation reads them;
    else eval.py's defaults."""
    where = args.adapter and next((d for d in (args.adapter, os.path.dirname(os.path.abspath(args.adapter)))
                                   if os.path.isfile(os.path.join(d, "config.json")) and runs.is_training_run(d)), None)
    cfg = runs.read_json(os.path.join(where, "config.json")) if where else {}
    if cfg.get("eval_dataset") is None:
        cfg.pop("eval_dataset", None)
    for name, (key, default) in RUN_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, cfg.get(key, cfg.get("dataset", default) if key == "eval_dataset" else default))
    return args


def rescored(args):
    """--rescore: the samples of an earlier eval run, scored again -> (rows, meta, ks, seed, out)."""
    if not os.path.isfile(args.rescore):
        raise DataError(f"--rescore {args.rescore!r} does not exist; give an eval run's samples.jsonl")
    rows = read_rows(args.rescore)
    if not rows:
        raise DataError(f"--rescore {args.rescore!r} holds no samples")
    if args.task != "auto":                                 # the comparison asked for, not the one sampled with
        rows = [{**r, "task": args.task} for r in rows]
    rows = rescore_rows(rows)
    old_path = os.path.join(os.path.dirname(args.rescore), "results.json")
    meta = {"dataset": "unknown (no results.json beside the samples)",
            **(runs.read_json(old_path) if os.path.isfile(old_path) else {}), "task": rows[0]["task"]}
    ks = args.k or meta.get("ks")
    seed = meta.get("seed", args.seed)
    args.maj_subsets = meta.get("maj_subsets", args.maj_subsets)
    out = args.output_dir or os.path.dirname(os.path.abspath(args.rescore))
    return rows, meta, ks, seed, out


def one_shot(args, model):
    """The worked example shown before each problem (--one_shot_from; default: arithmetic for the
    embedded model, as in its training demo, none otherwise) -> (dataset name or "none", example or None)."""
    name = args.one_shot_from or ("arithmetic" if model == "smollm2-135m" else "none")
    return name, None if name == "none" else one_shot_example(load_task(name, "train", args.data_dir)[0])


def adapter_folder(adapter, log=print):
    """--adapter as given, or a training run's final/ when the run's own folder is given (said once)."""
    if adapter and runs.is_training_run(adapter):
        final = os.path.join(adapter, "final")
        if not os.path.isdir(final):
            found = sorted(os.path.basename(c) for c in runs.saved_checkpoints(adapter).values()) or ["none yet"]
            raise ModelError(f"--adapter {adapter!r} is a training run's folder without final/ (checkpoints: "
                             f"{', '.join(found)}); give one of its checkpoint-N/ folders")
        log(f"--adapter {adapter} is a training run's folder: evaluating its final/ ({final})")
        return final
    return adapter


def default_output_dir(args):
    """runs/eval-<model>-<dataset>[-<run>-<final or checkpoint-N>]: each adapter of a run its own folder."""
    tag = ""
    if args.adapter:
        path = os.path.abspath(args.adapter)
        tag = f"-{os.path.basename(os.path.dirname(path))}-{os.path.basename(path)}"
    return os.path.join("runs", f"eval-{os.path.basename(args.model)}-{task_name(args.dataset)}{tag}")


EVAL_ARGS = ("model", "adapter", "dataset", "split", "task", "n_samples", "temperature", "max_completion_length",
             "one_shot_from", "seed", "load_in_4bit", "dtype")   # what makes the samples (--limit may grow)


def eval_args(args):
    """What made an evaluation's samples (EVAL_ARGS, the adapter as an absolute path): eval_args.json."""
    return {**{k: getattr(args, k) for k in EVAL_ARGS}, "adapter": args.adapter and os.path.abspath(args.adapter)}


def check_output_dir(args, out):
    """Refuse a training run's folder (whatever the flags), an evaluation of other settings on --resume
    (eval_args.json), and one that exists without --resume or --overwrite."""
    if runs.is_training_run(out):
        raise DataError(f"--output_dir {out!r} holds a training run (config.json, checkpoints or final/); an "
                        f"evaluation never writes there: give another --output_dir (the default names the adapter)")
    samples_path, args_path = os.path.join(out, "samples.jsonl"), os.path.join(out, "eval_args.json")
    if os.path.exists(samples_path) and args.resume:
        mine = eval_args(args)
        theirs = runs.read_json(args_path) if os.path.isfile(args_path) else None
        if theirs is None:
            raise DataError(f"--resume: {out} does not say which model and adapter made its samples (no "
                            f"eval_args.json); evaluate again with --overwrite or another --output_dir")
        diff = [f"{k}: {theirs.get(k)!r} there vs {v!r} now" for k, v in mine.items() if theirs.get(k) != v]
        if diff:
            raise DataError(f"--resume: {out}'s samples were made with other settings ({'; '.join(diff)}); use "
                            f"the same flags, or another --output_dir")
    elif os.path.exists(samples_path) and not args.overwrite:
        raise DataError(f"{out} already holds an evaluation: pass --resume to finish it, --overwrite to "
                        f"replace it, another --output_dir, or --rescore {samples_path}")


def sampled(args):
    """Sample --n_samples completions per problem (resumable) and score them -> (rows, meta, ks, seed, out)."""
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    check_device(device)
    if args.max_completion_length is None:
        args.max_completion_length = 96 if args.model == "smollm2-135m" else 1500
    args.adapter = adapter_folder(args.adapter)
    records = load_task(args.dataset, args.split, args.data_dir)[:args.limit]
    if not records:
        raise DataError(f"dataset {args.dataset!r} split {args.split!r} has no problems to evaluate")
    task = task_name(args.dataset) if args.task == "auto" else args.task
    args.one_shot_from, example = one_shot(args, args.model)
    ks = args.k or default_ks(args.n_samples)
    check_ks(ks, args.n_samples)                        # before any sampling time is spent
    seed = args.seed
    out = args.output_dir = args.output_dir or default_output_dir(args)
    check_output_dir(args, out)
    samples_path = os.path.join(out, "samples.jsonl")
    done = []
    if os.path.exists(samples_path) and args.resume:
        done = resumable_rows(samples_path, records, args.n_samples, max(1, args.batch_size // args.n_samples))
    os.makedirs(out, exist_ok=True)
    runs.write_json(os.path.join(out, "eval_args.json"), eval_args(args))
    results_path = os.path.join(out, "results.json")
    if len(done) == len(records) * args.n_samples and os.path.isfile(results_path):
        print(f"--resume: every problem of {out} is sampled; nothing to sample")
        args.rollout, rows = runs.read_json(results_path).get("rollout", args.rollout), done
    else:
        model, tok = load_eval_model(args.model, args.adapter, device, args.load_in_4bit,
                                     pick_dtype(args.dtype, device))
        args.rollout = pick_sampler(args, model, tok, records, example, device)
        with open(samples_path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in done)
            rows = sample_problems(model, tok, records, task, args, example, f, done)
    meta = {"model": args.model, "adapter": args.adapter, "rollout": args.rollout, "dataset": args.dataset,
            "split": args.split, "task": task,
            "temperature": args.temperature, "max_completion_length": args.max_completion_length,
            "one_shot_from": args.one_shot_from}
    return rows, meta, ks, seed, out


def main(argv=None):
    args = parse_args(argv)
    if args.plot or args.curves or args.render:
        return plot_main(args)
    if args.drift:
        return drift_main(args, one_shot)
    try:
        rows, meta, ks, seed, out = rescored(args) if args.rescore else sampled(args)
    except KeyboardInterrupt:
        print(f"stopped (Ctrl-C): every whole problem sampled is in {args.output_dir}/samples.jsonl; continue with "
              f"the same command plus --resume", file=sys.stderr)
        return STOPPED
    if runs.is_training_run(out):                   # --rescore's folder, as sampled() checks its own
        raise DataError(f"{out!r} holds a training run; an evaluation never writes there: give --output_dir")
    n = len({r["sample"] for r in rows})
    ks = ks or default_ks(n)
    res = {**{k: v for k, v in meta.items() if k not in ("pass@k", "maj@k", "date", "rescored_from")},
           **compute_results(rows, ks, seed, args.maj_subsets), "seed": seed, "ks": ks, "maj_subsets": args.maj_subsets,
           "date": datetime.datetime.now().isoformat(timespec="seconds"), **({"rescored_from": args.rescore}
                                                                             if args.rescore else {})}
    os.makedirs(out, exist_ok=True)
    runs.write_json(os.path.join(out, "results.json"), res)
    plot_passk([(model_label(res), res)], os.path.join(out, "passk.png"))
    print(summary(res))
    print(f"results in {os.path.join(out, 'results.json')}, plot {os.path.join(out, 'passk.png')}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (DataError, ModelError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
