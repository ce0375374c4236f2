"""A training run's KL to its start at each checkpoint (eval.py --drift): how far a run moved, beta = 0 included."""
import os

import torch

from gtpo import kl_k3, masked_mean
from machinery import runs
from machinery.data import DataError, format_prompt, load_task
from machinery.models import load_eval_model
from rollout import rollout
from speedups.logprobs import sequence_logprobs


def drift(run_dir, records, example, n_samples, max_new_tokens, seed, device="cpu", steps=None):
    """KL(pi_c || pi_start) at the start and at each scheduled checkpoint c of a training run
    (runs.saved_checkpoints): k3 (Eq. 1's KL estimator) averaged over the tokens pi_c samples for
    `records` (n_samples each, the same seed at every checkpoint); pi_start is what the run began
    from (its --init_from). A beta = 0 run computes no KL while training; this measures how far it
    moved. steps: only these (0 = the start); default all. -> a list of {step, kl, tokens}."""
    cfg = runs.read_json(os.path.join(run_dir, "config.json"))
    if not cfg.get("init_from"):
        raise DataError(f"--drift {run_dir}: the run has no --init_from to measure the drift from")
    start, tok = load_eval_model(cfg["model"], cfg["init_from"], device, False)
    prompts = [format_prompt(tok, r["question"], example) for r in records]
    at = {0: cfg["init_from"], **runs.saved_checkpoints(run_dir, cfg)}     # step 0, the start: 0 exactly
    missing = sorted(set(steps or ()) - set(at))
    if missing:
        raise DataError(f"--drift_steps {missing}: {run_dir} has no scheduled checkpoint there (it has {sorted(at)})")
    points = []
    for step, adapter in sorted((n, a) for n, a in at.items() if steps is None or n in steps):
        policy, _ = load_eval_model(cfg["model"], adapter, device, False)
        torch.manual_seed(seed)
        ro = rollout(policy, tok, prompts, n_samples, max_new_tokens, temperature=1.0)
        batch = ro.prompt_ids, ro.prompt_mask, ro.completion_ids, ro.completion_mask
        with torch.no_grad():
            logp, _ = sequence_logprobs(policy, *batch, with_entropy=False)              # (N, L)
            start_logp, _ = sequence_logprobs(start, *batch, with_entropy=False)         # (N, L)
        kl = masked_mean(kl_k3(logp, start_logp), ro.completion_mask)                   # over real tokens
        points.append({"step": step, "kl": float(kl), "tokens": int(ro.completion_mask.sum())})
        print(f"step {step}: KL to the start {points[-1]['kl']:.4f} over {points[-1]['tokens']} tokens", flush=True)
    return points


def drift_main(args, one_shot):
    """eval.py --drift: the KL of each checkpoint to the run's start -> results.json in --output_dir. one_shot:
    eval.py's rule for the worked example the prompts show."""
    if not os.path.isfile(os.path.join(args.drift, "config.json")):
        raise DataError(f"--drift {args.drift!r}: not a training run's folder (no config.json)")
    cfg = runs.read_json(os.path.join(args.drift, "config.json"))
    records = load_task(args.dataset, args.split, args.data_dir)[:args.limit]
    _, example = one_shot(args, cfg["model"])
    points = drift(args.drift, records, example, args.n_samples, args.max_completion_length or
                   cfg["max_completion_length"], args.seed, args.device or "cpu", args.drift_steps)
    out = args.output_dir or os.path.join(args.drift, "eval-kl")
    os.makedirs(out, exist_ok=True)
    runs.write_json(os.path.join(out, "results.json"), {
        "points": points, "estimator": "k3, completions sampled from each checkpoint (temperature 1)",
        "problems": len(records), "samples_per_problem": args.n_samples, "start": cfg["init_from"]})
    print(f"results in {os.path.join(out, 'results.json')}")
    return 0
