"""One training step of GTPO, GRPO or SFT (arXiv 2508.03772): what the loop calls, and what
the benchmarks (bench/) time.

reference_step  the paper's path in one screen, for reading: generate -> reward -> Eq. 8 -> one forward ->
           delta_i (Eq. 6), gamma <H>_i (Eq. 7), lambda_i,t (Eq. 5) -> loss -> backward; rl_step computes the
           same gradient
rl_step    rollout (no grad) -> rewards -> advantages (Eq. 8) -> conflict weights (Eq. 5)
           -> entropy filter and term (Eq. 6-7) -> micro-batched loss + backward -> the step's metrics
sft_step   token NLL of the worked solution in the tag format, backward
micro_batches  which completions each forward/backward takes: longest first within a group, each micro-batch
           as wide as its longest completion
step_totals  what gtpo.aggregate divides every micro-batch's terms by: the step's completions and tokens
           (over all ranks), so that the micro-batches' losses add up to the step's (--loss_type)
initial_entropy   <H>_ini of Sec. 6, which decides Eq. 6's filter

Each step reads a config.Config and leaves gradients in the parameters; the caller clips, steps the
optimizer and logs.
`clock(stage)` is called at the end of each stage (generate, reward, masks, reference, forward,
backward); the loop and the benchmarks pass a Clock to time the same code.
"""
import contextlib
import time

import torch

import gtpo
import rewards
from machinery.data import format_prompt, tagged_solution
from machinery.models import autocast
from rollout import rollout
from speedups.logprobs import positions, prompt_pass, sequence_logprobs


class Clock:
    """Seconds per stage: clock("generate") adds the time since the last call to that stage."""

    def __init__(self, device="cpu"):
        self.device = torch.device(device)
        self.cuda, self.t, self.parts = self.device.type == "cuda", time.perf_counter(), {}

    def __call__(self, stage):
        if self.cuda:
            torch.cuda.synchronize(self.device)             # this run's GPU, not the current one
        now = time.perf_counter()
        self.parts[stage] = self.parts.get(stage, 0.0) + now - self.t
        self.t = now


def _no_clock(stage):
    pass


def _sync_if(policy, last):
    """DDP averages gradients on the last micro-batch's backward only (no_sync before it)."""
    return contextlib.nullcontext() if last or not hasattr(policy, "no_sync") else policy.no_sync()


def step_totals(cfg, mask, ranks=None):
    """What gtpo.aggregate divides each micro-batch's terms by: this rank's N completions, the step's real
    completion tokens averaged over ranks (ranks: runs.Dist under torchrun; only "dapo" reads it), and L_max =
    max_completion_length; with GTPO's sum_completions, 1 completion (the terms added, not averaged).
    mask (N, L) -> gtpo.Totals."""
    tokens = float(mask.sum())
    if cfg.objective.loss_type == "dapo" and ranks is not None:
        tokens = ranks.mean({"tokens": tokens})["tokens"]
    summed = cfg.method == "gtpo" and cfg.objective.sum_completions            # Listing 3: no 1/G
    return gtpo.Totals(1 if summed else len(mask), tokens, cfg.max_completion_length)


def micro_batches(mask, G, size):
    """The rows and columns of each micro-batch of `size` completions: [(rows (n,) long, width), ...].
    Below one pass, each group's completions go longest first, so a micro-batch holds completions
    of similar length, and its columns end at its longest completion: what lies past it is padding,
    which no real token attends to. mask (N, L), groups of G consecutive rows, right-padded."""
    N, lengths = len(mask), mask.sum(dim=1)                                          # (N,)
    if size >= N:
        return [(torch.arange(N, device=mask.device), mask.shape[1])]
    group = torch.arange(N, device=mask.device) // G
    order = torch.argsort(group * (mask.shape[1] + 1) - lengths, stable=True)     # by group, then longest first
    return [(rows, max(int(lengths[rows].max()), 1)) for rows in order.split(size)]


def prompt_rows(ro, rows, G, share):
    """Prompt inputs for the completions `rows` (n,) (each group's rows together, groups in order):
    (prompt_ids, prompt_mask, prompt_index). Shared: one row per prompt and the index of each
    completion's prompt (PolicyPass); else one row per completion and None."""
    if not share:
        return ro.prompt_ids[rows], ro.prompt_mask[rows], None
    owner = rows // G                                                                # (n,) prompt of each row
    first, last = int(owner[0]), int(owner[-1])
    prompts = slice(first * G, (last + 1) * G, G)                                    # groups are consecutive
    return ro.prompt_ids[prompts], ro.prompt_mask[prompts], owner - first


REFERENCE_ADAPTER = "reference"      # --init_from's adapter, frozen, beside the trained "default"


@contextlib.contextmanager
def reference_adapter(model):
    """The LoRA model computing with the frozen starting adapter instead of the trained one."""
    model.set_adapter(REFERENCE_ADAPTER, inference_mode=True)
    try:
        yield
    finally:
        model.set_adapter("default")                    # trainable again, as before


def reference_model(cfg, model):
    """GRPO's pi_ref for the KL term (Eq. 1) is the run's starting model. Without LoRA: a frozen copy.
    With LoRA: None -- step.reference_logprobs then reads the same model with its adapters off, or,
    after --init_from, with the starting adapter, loaded beside the trained one as a frozen "reference"."""
    if cfg.method != "grpo" or cfg.objective.beta <= 0:
        return None
    if cfg.lora_rank == 0:
        import copy
        return copy.deepcopy(model).eval().requires_grad_(False)
    if cfg.init_from:
        model.load_adapter(cfg.init_from, adapter_name=REFERENCE_ADAPTER, is_trainable=False)
        model.set_adapter("default")                    # loading may switch the active adapter
    return None


def reference_logprobs(model, ref_model, prompt, completion_ids, completion_mask, cfg):
    """log pi_ref of GRPO's KL term (no grad): the frozen copy, or the same LoRA model with its
    starting adapter (after --init_from) or with its adapters switched off (no second copy in memory)."""
    ctx = (contextlib.nullcontext() if ref_model is not None else
           reference_adapter(model) if REFERENCE_ADAPTER in getattr(model, "peft_config", {}) else
           model.disable_adapter())
    with torch.no_grad(), ctx, autocast(model):
        ref, _ = sequence_logprobs(ref_model if ref_model is not None else model, prompt[0], prompt[1],
                                   completion_ids, completion_mask, with_entropy=False,
                                   logprob_chunk=cfg.logprob_chunk, prompt_index=prompt[2],
                                   temperature=cfg.temperature)
    return ref


# -----------------------------------------------------------------------------
# RL step: the paper's path in one screen (reference_step), then the one the loop runs (rl_step)

def reference_step(model, tok, prompts, answers, cfg):
    """One GTPO or GRPO step as the paper writes it, for reading: each term of the objective a named value.
    rl_step computes the same loss and gradient from the same samples (tests/test_objective.py,
    test_every_path_reads_every_setting_alike) and is what train.py runs; this one leaves out micro-batches, the
    shared prompt, DDP and metrics. One iteration per batch of samples (Sec. 3): the ratio is 1 and carries
    grad log pi, so GRPO's clip is inactive. -> the loss, after its backward."""
    G, objective = cfg.generation_size, cfg.objective
    # 1. G completions o_i per prompt (no grad), their rewards R_i (App. 16.1) and group advantages A_i (Eq. 8)
    ro = rollout(model, tok, prompts, G, cfg.max_completion_length, cfg.temperature, path="generate")
    ids, mask = ro.completion_ids, ro.completion_mask                                # (N, L), N = B x G
    R, _, _ = rewards.reward(ro.texts, [a for a in answers for _ in range(G)], cfg.reward_task)   # (N,)
    A = gtpo.group_advantages(R, G, objective)                                       # (N,) Eq. 8
    # 2. one forward of the policy over prompt + completion: log pi(o_i,t) and the token entropies H_i,t
    inputs, attention = torch.cat([ro.prompt_ids, ids], 1), torch.cat([ro.prompt_mask, mask], 1)   # (N, P + L)
    logits = model(input_ids=inputs, attention_mask=attention, position_ids=positions(attention)).logits
    logits = logits[:, ro.prompt_ids.shape[1] - 1:-1].float() / cfg.temperature     # (N, L, V): predicts ids
    logp = gtpo.token_logprobs(logits, ids)                                          # (N, L) log pi(o_i,t)
    H_i = gtpo.masked_mean(gtpo.token_entropy(logits), mask, dim=1)                 # (N,) <H>_i, Sec. 4.2
    ratio = torch.exp(logp - logp.detach())                                          # (N, L) == 1, Sec. 3
    # 3. what GTPO changes in GRPO's advantage: delta_i (Eq. 6), gamma <H>_i (Eq. 7), lambda_i,t (Eq. 5)
    delta = gtpo.filter_deltas(A, H_i, objective.ent_threshold, cfg.filter_mode)    # (N,) 0 or 1, Eq. 6
    gamma_H = objective.ent_gamma * H_i                                              # (N,) gamma <H>_i, Eq. 7
    if not objective.shapes(cfg.method):        # GRPO as Eq. 1 writes it (App. 14 adds delta_i and gamma to it)
        A_hat, entropy_term = A, None
    elif objective.entropy_term == "eq7":       # Eq. 7 as written: -gamma <H>_i, a term of its own, with its grad
        A_hat, entropy_term = delta * A, gamma_H
    else:                                       # the released code: folded into the advantage, detached
        A_hat, entropy_term = delta * (A - gamma_H.detach()), None
    if cfg.method == "gtpo":
        lam, _, n_conflict = gtpo.batch_conflict_weights(ids, mask, A, G, objective)   # (N, L) lambda_i,t, Eq. 5
        A_it = gtpo.token_advantages(lam, n_conflict, A_hat, objective)              # (N, L) lambda_i,t A_hat_i
    else:
        A_it = A_hat.unsqueeze(1)                                                    # (N, 1) every token's
    # 4. the loss: minus GRPO's surrogate ratio x advantage per token (Eq. 1, 20), + beta KL for GRPO, then Eq. 7's
    #    -(1/G) sum_i [(1/|o_i|) sum_t ... - gamma <H>_i]: the loss adds gamma <H>_i (gtpo.aggregate's per_seq)
    per_token = -ratio * A_it                                                        # (N, L)
    if cfg.method == "grpo" and objective.beta > 0:
        ref = reference_logprobs(model, None, (ro.prompt_ids, ro.prompt_mask, None), ids, mask, cfg)   # (N, L)
        per_token = per_token + objective.beta * gtpo.kl_k3(logp, ref)              # Eq. 1's KL term
    loss = gtpo.aggregate(per_token, mask, objective.loss_type, entropy_term, step_totals(cfg, mask))
    loss.backward()
    return loss


def rl_step(model, policy, tok, prompts, answers, cfg, ref_model=None, clock=_no_clock, conflict_log=None,
            ranks=None):
    """One GTPO/GRPO step on B prompts: leaves gradients of the step's loss over its B x G completions.

    model: the policy (generates; reference with adapters off); policy: the same model for the
    gradient pass, a DDP-wrapped speedups.logprobs.PolicyPass under torchrun. prompts: B chat-formatted
    strings; answers: B references. conflict_log: a conflicts.ConflictLog to count the step's
    conflict tokens into (GTPO or GRPO). ranks: runs.Dist under torchrun (step_totals).
    Returns (metrics, rollout, scored) with scored = {"rewards" (N,), "advantages" (N,),
    "weights" (N, L) lambda or None, "correctness" (N,), the reward's correctness term}.
    """
    G, device = cfg.generation_size, next(model.parameters()).device
    # ---- 1. rollout (no grad): G completions per prompt, all decoded as one batch
    with autocast(model):
        sampled = rollout(model, tok, prompts, G, cfg.max_completion_length, cfg.temperature,
                          min_new_tokens=cfg.min_new_tokens, path=cfg.rollout, merge_lora=cfg.merge_lora)
    mask = sampled.completion_mask                                                        # (N, L)
    clock("generate")
    # ---- 2. rewards -> group advantages (Eq. 8)
    refs, counts = [answer for answer in answers for _ in range(G)], {}
    total, formatting, correctness = rewards.reward(sampled.texts, refs, cfg.reward_task, counts)   # the one reward
    adv = gtpo.group_advantages(total, G, cfg.objective).to(device)                 # (N,)
    clock("reward")
    # ---- 3. conflict weights lambda_{i,t} (Eq. 5), per group
    weights = conflict = n_conflict = None
    if cfg.method == "gtpo":
        weights, conflict, n_conflict = gtpo.batch_conflict_weights(sampled.completion_ids, mask, adv, G,
                                                                    cfg.objective)
    if conflict_log is not None:
        conflict_log.add(sampled.completion_ids, mask, adv, G)                            # which tokens (Fig. 9)
    clock("masks")                                  # on every rank: ranks average the same metric keys
    # ---- 4. entropy filter and term (Eq. 6-7) and loss over micro-batches of completions, backward
    mean_entropy, deltas, metrics = policy_gradient(cfg, model, policy, ref_model, sampled, adv, weights, n_conflict,
                                                    clock, ranks)
    metrics.update(rl_metrics(cfg, sampled, total, formatting, correctness, mean_entropy, metrics.pop("loss")))
    metrics["rewards/guarded"] = counts.get("guarded", 0)               # answers scored wrong unparsed (rewards.py)
    if deltas is not None:
        frac, dropped_entropy = (gtpo.filtered_stats(adv, deltas, mean_entropy, cfg.objective)
                                 if cfg.filter_mode != "off" else (0.0, 0.0))
        metrics.update({"gtpo/filtered_frac": frac, "gtpo/filtered_entropy": dropped_entropy})
    if cfg.method == "gtpo":
        metrics.update({"gtpo/conflict_frac": (conflict.sum() / mask.sum().clamp(min=1)).item(),
                        "gtpo/mean_conflict_tokens": n_conflict.float().mean().item()})
    return metrics, sampled, {"rewards": total, "advantages": adv, "weights": weights, "correctness": correctness}


def policy_gradient(cfg, model, policy, ref_model, sampled, adv, weights, n_conflict, clock=_no_clock, ranks=None):
    """Backward of the step's loss over the N completions, cfg.micro_batch_size at a time (DDP syncs
    on the last); each micro-batch's loss is its share of the step's (gtpo.aggregate with step_totals),
    so the micro-batch size does not change the gradient. With --share_prompt each prompt runs once
    for all the micro-batches (speedups.logprobs.Prompts), its gradient carried by the last one's backward.
    Returns (<H>_i (N,), delta_i (N,) or None where the method's advantages are not shaped, {"loss": float, and
    the token means of the losses' own metrics: "kl", "clip_ratio/region_mean", "gtpo/mean_weight"})."""
    G, mask, N, objective = cfg.generation_size, sampled.completion_mask, len(sampled.texts), cfg.objective
    totals, batches = step_totals(cfg, mask, ranks), micro_batches(mask, G, cfg.micro_batch_size or N)
    all_entropy, deltas, token_sums, loss_sum = adv.new_zeros(N), None, {}, 0.0    # (N,) in rollout order
    prompts = None
    if cfg.share_prompt and len(batches) > 1:                    # each prompt once for all the micro-batches
        with _sync_if(policy, False), autocast(model):
            prompts = prompt_pass(policy, sampled.prompt_ids[::G], sampled.prompt_mask[::G], cfg.logprob_chunk)
        clock("forward")
    for i, (rows, width) in enumerate(batches):
        last = i == len(batches) - 1
        prompt = prompt_rows(sampled, rows, G, cfg.share_prompt)
        ids, mb_mask = sampled.completion_ids[rows, :width], mask[rows, :width]             # (n, width)
        if prompts is not None:
            prompts.last = last
        with _sync_if(policy, last):
            ref = None
            if cfg.method == "grpo" and objective.beta > 0:                          # KL term of Eq. 1
                ref = reference_logprobs(model, ref_model, prompt, ids, mb_mask, cfg)
                clock("reference")
            with autocast(model):
                logp, token_entropy = sequence_logprobs(policy, *prompt[:2], ids, mb_mask,
                                                        logprob_chunk=cfg.logprob_chunk,
                                                        prompt_index=prompt[2] if prompts is None else rows // G,
                                                        temperature=cfg.temperature,     # of what was sampled
                                                        entropy_grad=objective.entropy_grad(cfg.method),
                                                        prompts=prompts)
                mean_entropy = gtpo.masked_mean(token_entropy, mb_mask, dim=1)                # (n,) <H>_i
                loss, loss_metrics, delta = gtpo.policy_loss(objective, cfg.method, cfg.filter_mode, logp, mb_mask,
                                                             adv[rows], mean_entropy,
                                                             None if weights is None else weights[rows, :width],
                                                             None if n_conflict is None else n_conflict[rows], ref,
                                                             totals)
            clock("forward")
            if prompts is not None and last:    # and the gradient the prompts gathered, in the same backward
                prompts.backward(loss)
            else:
                loss.backward()             # always (DDP ranks must agree); a NaN is caught at the step
            clock("backward")
        all_entropy[rows] = mean_entropy.detach()
        if delta is not None:
            deltas = adv.new_zeros(N) if deltas is None else deltas
            deltas[rows] = delta
        for key in ("kl", "clip_ratio/region_mean", "gtpo/mean_weight"):             # token-weighted
            if key in loss_metrics:
                token_sums.setdefault(key, []).append(loss_metrics[key] * mb_mask.sum())
        loss_sum += loss.item()
    metrics = {key: (sum(sums) / mask.sum().clamp(min=1)).item() for key, sums in token_sums.items()}
    return all_entropy, deltas, {"loss": loss_sum, **metrics}


def rl_metrics(cfg, sampled, total, formatting, correctness, mean_entropy, loss):
    """The step's metrics under TRL's names (docs/training.md, "Reading metrics.jsonl")."""
    G = cfg.generation_size
    std = total.view(-1, G).std(dim=1)                                               # (B,)
    lengths = sampled.completion_mask.sum(1).float()
    return {"phase": "rl", "loss": loss, "reward": total.mean().item(), "reward_std": std.mean().item(),
            "rewards/format": formatting.mean().item(), "rewards/accuracy": correctness.mean().item(),
            "frac_reward_zero_std": (std == 0).float().mean().item(), "entropy": mean_entropy.mean().item(),
            "completions/mean_length": lengths.mean().item(),
            "completions/clipped_ratio": sampled.truncated.float().mean().item()}


# -----------------------------------------------------------------------------
# SFT step and <H>_ini

def _right_padded(rows, pad_id, device):
    """Token lists as right-padded (N, L) ids and their (N, L) mask."""
    L = max(len(r) for r in rows)
    ids = torch.full((len(rows), L), pad_id, dtype=torch.long)                        # (N, L)
    mask = torch.zeros(len(rows), L, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r, dtype=torch.long)
        mask[i, :len(r)] = 1
    return ids.to(device), mask.to(device)


def sft_batch(tokenizer, records, example, device, share=True):
    """Prompt + worked solution in the tag format + EOS, laid out for PolicyPass.
    -> (prompt_ids, prompt_mask, ids, mask, target_mask, prompt_index).
    Shared (share, and prompts that open alike: the chat template's system prompt and the one-shot
    example): their common opening is one prompt row (1, K), each row of ids is the rest of its prompt
    then its solution, prompt_index zeros, so the opening runs once per pass. Else the prompts
    left-padded (N, P), ids the solutions, prompt_index None. target_mask marks the solution tokens."""
    prompts = [tokenizer(format_prompt(tokenizer, r["question"], example), add_special_tokens=False)["input_ids"]
               for r in records]
    targets = [tokenizer(tagged_solution(r) + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
               for r in records]
    K = 0
    while share and K < min(map(len, prompts)) and len({p[K] for p in prompts}) == 1:
        K += 1                                                                        # the common opening
    pad = tokenizer.pad_token_id
    if K == 0:
        enc = tokenizer.pad({"input_ids": prompts}, return_tensors="pt")              # left-padded (N, P)
        ids, mask = _right_padded(targets, pad, device)
        return enc["input_ids"].to(device), enc["attention_mask"].to(device), ids, mask, mask, None
    ids, mask = _right_padded([p[K:] + t for p, t in zip(prompts, targets)], pad, device)   # (N, L)
    target = torch.zeros_like(mask)
    for i, (p, t) in enumerate(zip(prompts, targets)):
        target[i, len(p) - K:len(p) - K + len(t)] = 1
    opening = torch.tensor([prompts[0][:K]], dtype=torch.long, device=device)         # (1, K)
    index = torch.zeros(len(records), dtype=torch.long, device=device)                # (N,) all rows continue it
    return opening, torch.ones_like(opening), ids, mask, target, index


def sft_step(policy, tok, records, example, cfg, device, clock=_no_clock):
    """Mean token NLL of the records' worked solutions (SFT, or the warm-up before RL), over
    micro-batches of cfg.sft_micro_batch_size (else cfg.micro_batch_size) records; backward.
    The prompts' common opening runs once per micro-batch (sft_batch) unless --no-share_prompt."""
    p_ids, p_mask, ids, mask, target, index = sft_batch(tok, records, example, device, cfg.share_prompt)
    N = len(records)
    mb, totals = cfg.sft_micro_batch_size or cfg.micro_batch_size or N, gtpo.Totals(N, float(target.sum()), 0)
    batches, loss_sum = micro_batches(mask, N, mb), 0.0                               # the records as one group
    for i, (rows, width) in enumerate(batches):
        prompt = (p_ids[rows], p_mask[rows], None) if index is None else (p_ids, p_mask, index[rows])
        with _sync_if(policy, i == len(batches) - 1):
            with autocast(policy):
                logp, _ = sequence_logprobs(policy, prompt[0], prompt[1], ids[rows, :width], mask[rows, :width],
                                            with_entropy=False, logprob_chunk=cfg.logprob_chunk,
                                            prompt_index=prompt[2])
                loss = gtpo.aggregate(-logp, target[rows, :width], "dapo", totals=totals)   # token mean over all N
            clock("forward")
            loss.backward()
            clock("backward")
        loss_sum += loss.item()
    return {"phase": "sft", "loss": loss_sum}


def initial_entropy(model, tok, prompts, cfg):
    """<H>_i of the untrained policy (Sec. 6, Eq. 6's <H>_ini is their mean): one sample per prompt,
    8 prompts per rollout call, then a no-grad pass of the chunked LM head over those samples (the
    gradient pass's own function), so no step's full logits are ever kept. -> (n,) float32."""
    vals = []
    for i in range(0, len(prompts), 8):
        with autocast(model):
            ro = rollout(model, tok, prompts[i:i + 8], 1, cfg.max_completion_length, cfg.temperature,
                         min_new_tokens=cfg.min_new_tokens, path=cfg.rollout, merge_lora=cfg.merge_lora)
            with torch.no_grad():
                _, ent = sequence_logprobs(model, ro.prompt_ids, ro.prompt_mask, ro.completion_ids,
                                           ro.completion_mask, logprob_chunk=cfg.logprob_chunk,
                                           temperature=cfg.temperature)             # (8, L)
        vals.append(gtpo.masked_mean(ent, ro.completion_mask, dim=1))
    return torch.cat(vals) if vals else torch.zeros(0)
