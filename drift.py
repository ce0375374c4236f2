"""A training run's KL to its start at each checkpoint (eval.py --drift): how far a run moved, beta = 0 included."""
import os

import torch

import runs
from data import DataError, format_prompt
from gtpo import kl_k3, masked_mean
from gtpo_logprobs import sequence_logprobs
from models import load_eval_model
from rollout import rollout


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
