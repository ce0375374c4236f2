"""The GTPO objective (arXiv 2508.03772) as pure tensor functions.

No model, tokenizer or I/O lives here: every function takes tensors and returns
tensors, so each one can be read next to its equation and tested on its own.

What the objective does, and leaves out:
  1. One iteration per batch of samples (Sec. 3): the ratio is exp(logp - logp.detach()) == 1, so there
     is no PPO clip in GTPO and its gradient is Eq. 22.
  2. No KL term in GTPO (beta is GRPO's alone, Eq. 1).
  3. lambda (Eq. 5) comes from the raw advantages' signs; completions with A_i = 0 neither have nor
     cause conflicts.
  4. A group whose rewards are all equal gets exactly 0 advantage (not a rounding residue, not NaN).
  5. delta_i (Eq. 6) drops a completion's advantage term when <H>_i is above the threshold; the entropy
     term is Eq. 7's own (with its gradient) or the released code's (folded into A_i, detached).
  6. The loss is aggregated in one place (aggregate), so micro-batches and ranks do not change it.
  7. Where the released code departs from the equations (App. 16), an argument selects it: the std
     division, the conflict count and its normalisation, lambda's product, the sum over completions.

    group_advantages   Eq. 8           A_i = (R_i - mean R) / (std R + eps)
    conflict_spans     Sec. 5.1        forward and backward conflict spans of one group
                                       (conflict_spans_loop: the same, one token at a time)
    conflict_weights   Sec. 5.1, Eq. 5 lambda_{i,t} in {0, 1, 2} from fwd/bwd conflict spans
    token_entropy      Sec. 4.2        H(p) = -sum_j p_j ln p_j
    entropy_filter     Eq. 6           delta_i * A_i: the advantage of a completion above the threshold -> 0
    entropy_gate       Eq. 6-7         delta_i * (A_i - gamma <H>_i), detached: the released code's form
    shaped_advantages  Eq. 6-7         the two above by --entropy_term: (advantage, Eq. 7's penalty or None)
    aggregate          Eq. 7           per-token terms -> the step's loss (grpo = Eq. 7's normalisation, dapo,
                                       dr_grpo): the one place, exact under micro-batches and ranks
    gtpo_loss          Eq. 7, 20, 22   -(1/G) sum_i [(1/|o_i|) sum_t lambda_{i,t} A_i ratio_{i,t} - gamma <H>_i]
    kl_k3              Eq. 1           exp(ref - logp) - (ref - logp) - 1, per token
    grpo_loss          Eq. 1           PPO-clipped surrogate - beta * KL (k3), the baseline

Shapes: N completions (N = prompts x G), L completion positions, V vocabulary.
"""
from typing import NamedTuple

import torch

__all__ = [
    "masked_mean", "token_logprobs", "group_advantages", "conflict_spans", "conflict_spans_loop", "CONFLICT_COUNTS",
    "conflict_weights",
    "batch_conflict_weights", "token_entropy", "FILTER_MODES", "ENTROPY_TERMS", "entropy_filter", "entropy_gate",
    "shaped_advantages", "filtered_stats", "LOSS_TYPES", "Totals",
    "aggregate", "gtpo_loss", "kl_k3", "grpo_loss",
]


# -----------------------------------------------------------------------------
# 0. helpers

def masked_mean(x, mask, dim=None):
    """Mean of `x` over positions where `mask` is true; 0 (not NaN) where nothing is.

    x, mask: same shape (mask bool/int/float). dim=None averages everything.
    """
    mask = mask.to(x.dtype)
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def token_logprobs(logits, ids):
    """log pi(ids | context) from logits: gather - logsumexp, in float32.

    logits (..., V), ids (...) long -> (...). Never materialises log_softmax of the
    full vocabulary in the logits' dtype (bf16 log-softmax loses ~2 decimal digits).
    """
    logits = logits.float()
    chosen = logits.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    return chosen - torch.logsumexp(logits, dim=-1)


# -----------------------------------------------------------------------------
# 1. group-relative advantages (Eq. 8)

def group_advantages(rewards, group_size, scale=True, eps=1e-4):
    """A_i = R_i - mean(group), divided by std(group) + eps when `scale` (Eq. 8).

    rewards (N,) with N = n_groups * group_size, each group `group_size` consecutive
    completions of one prompt -> (N,) float32. std is the unbiased sample std, as in
    TRL's GRPOTrainer. A group whose rewards are all equal gets exactly 0 (not a
    rounding residue, not NaN). `scale=False` is the released code's behaviour (it
    subtracts the mean only; README "equations vs released code").
    """
    rewards = torch.as_tensor(rewards, dtype=torch.float32)
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2 for group-relative advantages, got {group_size}")
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards must be 1-D with a length divisible by group_size={group_size}, "
                         f"got shape {tuple(rewards.shape)}")
    r = rewards.view(-1, group_size)                                # (B, G)
    adv = r - r.mean(dim=1, keepdim=True)
    if scale:
        adv = adv / (r.std(dim=1, keepdim=True) + eps)
    flat = (r == r[:, :1]).all(dim=1, keepdim=True)                 # (B, 1) all-equal groups
    adv = torch.where(flat, torch.zeros_like(adv), adv)
    return adv.reshape(-1)


# -----------------------------------------------------------------------------
# 2. conflict tokens and lambda (Sec. 5.1, Eq. 5; App. 11 Eq. 21; App. 16 Listing 2)

def _aligned_conflicts(ids, valid, pos, neg):
    """Positions whose token is shared, at that same aligned position, with >= 1
    positive and >= 1 negative completion; then the first contiguous run only.

    ids (G, L) long, valid (G, L) bool, pos/neg (G,) bool -> (G, L) bool.
    Pairwise comparison (G, G, L) instead of the vocabulary-indexed bincount of
    Listing 2: memory O(G^2 L), independent of V.
    """
    same = (ids.unsqueeze(1) == ids.unsqueeze(0))                   # (G, G, L): same[i, j, p]
    same &= valid.unsqueeze(1) & valid.unsqueeze(0)
    in_pos = (same & pos.view(1, -1, 1)).any(dim=1)                 # (G, L) some j in G+ matches
    in_neg = (same & neg.view(1, -1, 1)).any(dim=1)                 # (G, L) some j in G- matches
    raw = in_pos & in_neg & valid & (pos | neg).unsqueeze(1)
    return raw.long().cumprod(dim=1).bool()                         # first contiguous span from t=0


def conflict_spans(ids, mask, advantages):
    """The forward and backward conflict spans of ONE group (Sec. 5.1): (fwd, bwd), each (G, L)
    bool. ids (G, L) long, right-padded; mask (G, L) true on real tokens; advantages (G,)."""
    if ids.dim() != 2 or mask.shape != ids.shape:
        raise ValueError(f"ids and mask must both be (G, L), got {tuple(ids.shape)} and {tuple(mask.shape)}")
    G, L = ids.shape
    if advantages.shape != (G,):
        raise ValueError(f"advantages must be (G,) = ({G},) for one group, got {tuple(advantages.shape)}")
    valid = mask.bool()
    lengths = valid.sum(dim=1)                                      # (G,)
    steps = torch.arange(L, device=ids.device)
    if not torch.equal(valid, steps.unsqueeze(0) < lengths.unsqueeze(1)):
        raise ValueError("mask must be right-padded (real tokens first, then padding) in every row")
    pos, neg = advantages > 0, advantages < 0                       # (G,)

    fwd = _aligned_conflicts(ids, valid, pos, neg)                  # (G, L)

    # Backward: re-index each row so that r = 0 is its own last real token.
    rev_idx = (lengths.unsqueeze(1) - 1 - steps.unsqueeze(0)).clamp(min=0)  # (G, L); r -> p
    ids_rev = ids.gather(1, rev_idx)                                # valid where r < length
    bwd_rev = _aligned_conflicts(ids_rev, valid, pos, neg)          # (G, L) in r coordinates
    bwd = bwd_rev.gather(1, rev_idx) & valid                        # p -> r = len-1-p (involution)
    return fwd, bwd


# what n_conflict counts (the released code's normalisation divides by it; README "equations vs released code")
CONFLICT_COUNTS = ("union", "longer")


def conflict_weights(ids, mask, advantages, conflict_weight=2.0, combine="or", count="union"):
    """Token weights lambda_{i,t} for ONE group (Eq. 5, Eq. 21).

    ids (G, L) long, right-padded; mask (G, L) bool/int/float, true on real tokens;
    advantages (G,) of this group.
    Returns weights (G, L) float32, conflict (G, L) bool, n_conflict (G,) long.

    * forward conflict at position p of completion i: the token ids[i, p] appears at
      position p in some completion with A > 0 and in some completion with A < 0;
    * backward conflict: the same with positions counted from each completion's own
      last real token (true lengths, not the padded length);
    * only the first contiguous span from the start (forward) and from the end
      (backward) counts; conflict = fwd-span OR bwd-span (M_i = M^fw v M^bw, Sec. 5.1);
    * lambda = conflict_weight on conflict tokens of A > 0 completions, 0 on those of
      A < 0 completions, 1 elsewhere, 0 on padding. A = 0 completions neither have nor
      cause conflicts.
    * n_conflict[i] = number of conflict positions of completion i (0 when none): count="union",
      |M^fw v M^bw| as App. 16's prose says; count="longer", max(|fw span|, |bw span|), what Listing 2
      line 91 computes (it ORs the forward span with the backward one still in reversed coordinates,
      two prefixes, so their OR is the longer).

    combine="product" reproduces the released code (Listing 2, `mask_fwd * mask_bw`):
    a positive completion's token that lies in BOTH spans gets conflict_weight**2 (= 4)
    instead of Eq. 5's 2. Garbage in padded positions is ignored.
    """
    if combine not in ("or", "product"):
        raise ValueError(f"combine must be 'or' (Eq. 5) or 'product' (released code), got {combine!r}")
    if count not in CONFLICT_COUNTS:
        raise ValueError(f"count must be one of {', '.join(CONFLICT_COUNTS)}, got {count!r}")
    fwd, bwd = conflict_spans(ids, mask, advantages)                # (G, L) each
    valid, pos = mask.bool(), (advantages > 0).unsqueeze(1)         # (G, L), (G, 1)
    conflict = fwd | bwd                                            # (G, L)
    on_conflict = torch.where(pos, conflict_weight, 0.0)            # (G, 1): lambda on a conflict token
    if combine == "or":                                             # Eq. 5
        weights = torch.where(~valid, 0.0, torch.where(conflict, on_conflict, 1.0))
    else:                                                           # Listing 2: mask_fwd * mask_bw
        weights = torch.where(~valid, 0.0, torch.where(fwd, on_conflict, 1.0) * torch.where(bwd, on_conflict, 1.0))
    n_conflict = conflict.sum(dim=1) if count == "union" else torch.maximum(fwd.sum(dim=1), bwd.sum(dim=1))  # (G,)
    return weights.float(), conflict, n_conflict


def conflict_spans_loop(ids, mask, advantages):
    """Sec. 5.1 read one token at a time; conflict_spans computes the same (tested equal).

    Counting positions from the start, token r of completion i is a forward conflict when some
    completion with A > 0 and some with A < 0 have the same token at position r (i itself counts),
    and tokens 0 ... r-1 of i are all conflicts too: the first shared span. Backward: the same with
    positions counted from each completion's own last token. A = 0 completions have none.
    ids (G, L), mask (G, L) right-padded, advantages (G,) -> (fwd, bwd), each (G, L) bool.
    """
    G = ids.shape[0]
    n = mask.bool().sum(dim=1).tolist()                             # true lengths
    pos, neg = (advantages > 0).tolist(), (advantages < 0).tolist()
    fwd, bwd = torch.zeros(ids.shape, dtype=torch.bool), torch.zeros(ids.shape, dtype=torch.bool)
    for spans, at in ((fwd, lambda j, r: r), (bwd, lambda j, r: n[j] - 1 - r)):   # r -> position in row j
        for i in range(G):
            if not (pos[i] or neg[i]):
                continue
            for r in range(n[i]):
                same = [j for j in range(G) if r < n[j] and ids[j, at(j, r)] == ids[i, at(i, r)]]
                if not (any(pos[j] for j in same) and any(neg[j] for j in same)):
                    break                                           # the span ends at the first miss
                spans[i, at(i, r)] = True
    return fwd, bwd


def batch_conflict_weights(ids, mask, advantages, group_size, **kw):
    """conflict_weights over consecutive groups of `group_size` rows.

    ids, mask (N, L); advantages (N,) -> weights (N, L), conflict (N, L), n_conflict (N,).
    """
    out = [conflict_weights(i, m, a, **kw) for i, m, a in zip(
        ids.split(group_size), mask.split(group_size), advantages.split(group_size))]
    return tuple(torch.cat(parts) for parts in zip(*out))


# -----------------------------------------------------------------------------
# 3. entropy (Sec. 4.2) and the entropy gate (Eq. 6-7)

def token_entropy(logits):
    """Shannon entropy in nats of softmax(logits): (..., V) -> (...), float32.

    From log-softmax, with p ln p := 0 where p = 0, so -inf logits (masked
    vocabulary entries) give no NaN.
    """
    logp = torch.log_softmax(logits.float(), dim=-1)
    p = logp.exp()
    return -torch.where(p > 0, p * logp, torch.zeros_like(p)).sum(dim=-1)


FILTER_MODES = ("all", "neg", "off")      # delta_i of Eq. 6 on every completion, on A < 0 ones (App. 13), on none
ENTROPY_TERMS = ("released", "eq7")       # -gamma <H>_i folded into the advantage (released code), or Eq. 7's own


def _filtered(advantages, entropy, threshold, mode):
    """(N,) bool: the completions Eq. 6's delta_i sets to 0 under `mode` (see entropy_filter)."""
    if mode not in FILTER_MODES:
        raise ValueError(f"entropy gate mode must be one of {', '.join(FILTER_MODES)}, got {mode!r}")
    if mode == "off":
        return torch.zeros_like(advantages, dtype=torch.bool)
    drop = entropy > threshold
    return drop & (advantages < 0) if mode == "neg" else drop


def entropy_filter(advantages, entropy, threshold, mode="all"):
    """delta_i * A_i of Eq. 6-7 as written: the advantage term of a completion whose <H>_i is above
    the threshold is dropped; Eq. 7's -gamma <H>_i stays outside delta_i (gtpo_loss's `entropy`).

    advantages (N,), entropy (N,) = <H>_i (read as a constant here) -> (N,).
    mode "all": completions with <H>_i > threshold get 0 (Eq. 6 with <H>_ini < ln 2);
         "neg": only A < 0 completions are filtered (GTPO-OnlyNeg, App. 13);
         "off": delta_i = 1 for all (Eq. 6 with <H>_ini > ln 2).
    <H>_i == threshold is kept (delta_i = 1 iff <H>_i <= threshold).
    """
    drop = _filtered(advantages, entropy.detach(), threshold, mode)
    return torch.where(drop, torch.zeros_like(advantages), advantages)


def entropy_gate(advantages, entropy, threshold, gamma, mode="all"):
    """Shaped advantage delta_i * (A_i - gamma <H>_i): Eq. 6-7 as the released code realises them
    (App. 16, Listing 3 step 2; `--entropy_term released`). The entropy penalty is folded into the
    advantage, the entropy is detached (gamma acts through d log pi, not through dH/dtheta), and a
    filtered completion loses the penalty with its advantage, so a step whose completions are all
    filtered has no gradient at all. Eq. 7 as written is entropy_filter + gtpo_loss(entropy=...).

    advantages (N,), entropy (N,) = <H>_i; modes as entropy_filter.
    Note: conflict weights are built from the raw advantages; a small positive A_i can turn
    negative here and still carry lambda = 2 on its conflict tokens, exactly as in the released code.
    """
    entropy = entropy.detach().to(advantages.dtype)
    shaped = advantages - gamma * entropy
    drop = _filtered(advantages, entropy, threshold, mode)
    return shaped if mode == "off" else torch.where(drop, torch.zeros_like(shaped), shaped)


def shaped_advantages(advantages, entropy, term, gate, threshold, gamma):
    """Eq. 6-7 in one place: what multiplies each completion's log-prob gradient, and the entropy term the loss
    adds for each completion on its own.

    advantages (N,) from Eq. 8; entropy (N,) = <H>_i (with its gradient where the term needs it);
    term in ENTROPY_TERMS; gate in FILTER_MODES (delta_i: "all", "neg" or "off"); threshold: Eq. 6's ln 2 or
    a constant. -> (advantage (N,), penalty (N,) or None), penalty read by gtpo_loss as +gamma * penalty.
        term      gate       advantage                      penalty
        eq7       off        A_i                            <H>_i, with its gradient (None when gamma = 0)
        eq7       all / neg  delta_i A_i                    <H>_i, every completion's, filtered or not
        released  off        A_i - gamma <H>_i (detached)   None
        released  all / neg  delta_i (A_i - gamma <H>_i)    None
    delta_i = 0 where <H>_i > threshold ("neg": and A_i < 0), else 1.
    """
    if term not in ENTROPY_TERMS:
        raise ValueError(f"entropy term must be one of {', '.join(ENTROPY_TERMS)}, got {term!r}")
    if term == "eq7":
        return entropy_filter(advantages, entropy, threshold, gate), (entropy if gamma else None)
    return entropy_gate(advantages, entropy, threshold, gamma, gate), None


def filtered_stats(advantages, shaped, entropy):
    """What delta_i removed (Eq. 6): (the fraction of the N completions whose nonzero advantage the
    gate zeroed, their mean <H>_i in nats -- 0.0 when none was). advantages: (N,) before the gate;
    shaped: (N,) entropy_filter's or entropy_gate's output; entropy: (N,) <H>_i. A completion whose
    advantage was already 0 (an all-equal group) is not counted: delta_i had nothing to remove."""
    dropped = (shaped == 0) & (advantages != 0)                                      # (N,)
    n = int(dropped.sum())
    return dropped.float().mean().item(), (entropy.float() * dropped).sum().item() / max(n, 1)


# -----------------------------------------------------------------------------
# 4. aggregation: how per-token terms become the loss

LOSS_TYPES = ("grpo", "dapo", "dr_grpo")       # TRL's loss_type names for the same three normalisations


class Totals(NamedTuple):
    """The whole step a micro-batch belongs to, which aggregate divides by.

    completions: N, this rank's completions in the step (every rank has as many); 1 for the released
        code's sum over completions (Listing 3 adds every completion's loss with no 1/G);
    tokens: real completion tokens of the step summed over all ranks, divided by the number of ranks;
    max_length: L_max, Dr. GRPO's constant length (the run's max_completion_length).
    """
    completions: float
    tokens: float
    max_length: float


def aggregate(per_token, mask, loss_type="grpo", per_seq=None, totals=None):
    """The loss from per-token terms l_{i,t}: the one place where they are summed and normalised.

    per_token (n, L); mask (n, L); per_seq (n,) or None: a completion's own term s_i (Eq. 7's
    gamma <H>_i), read as the value s_i on each of its |o_i| tokens, so that it is aggregated as the
    tokens are. totals: the step this micro-batch is part of (Totals); None = this micro-batch alone.
        grpo     (1/N) sum_i [(1/|o_i|) sum_t l_{i,t} + s_i]       Eq. 7: each completion's token mean,
                                                                  then the mean over completions
        dapo     (1/T) sum_i [sum_t l_{i,t} + |o_i| s_i]           token-level (DAPO): every token alike
        dr_grpo  (1/(N L_max)) sum_i [sum_t l_{i,t} + |o_i| s_i]   a constant length (Dr. GRPO)
    Returns this micro-batch's share of the step's loss: the shares of a step's micro-batches add up to
    its loss, and, since DDP averages gradients over ranks and Totals.tokens is the ranks' mean token
    count, the ranks' shares average to the loss of the whole batch over all ranks.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {', '.join(LOSS_TYPES)}, got {loss_type!r}")
    mask = mask.to(per_token.dtype)
    if totals is None:
        totals = Totals(len(per_token), mask.sum().item(), mask.shape[1])
    sums = (per_token * mask).sum(dim=1)                            # (n,)
    lengths = mask.sum(dim=1)                                       # (n,) |o_i|
    if loss_type == "grpo":
        seq = sums / lengths.clamp(min=1)                           # (n,) each completion's token mean
        if per_seq is not None:
            seq = seq + per_seq.to(seq.dtype)
        return seq.sum() / totals.completions
    if per_seq is not None:
        sums = sums + lengths * per_seq.to(sums.dtype)              # s_i on each of its tokens
    norm = max(totals.tokens, 1.0) if loss_type == "dapo" else totals.completions * totals.max_length
    return sums.sum() / norm


# -----------------------------------------------------------------------------
# 5. losses

def gtpo_loss(logprobs, mask, advantages, weights, n_conflict=None, entropy=None, gamma=0.0, loss_type="grpo",
              totals=None):
    """GTPO loss (Eq. 7 / Eq. 20), one-iteration case (Sec. 3): the gradient is Eq. 22.

    logprobs (N, L) log pi(o_{i,t}) of the sampled tokens, with grad; mask (N, L);
    advantages (N,) after Eq. 6's filter (entropy_filter, or entropy_gate for the released form);
    weights (N, L) = lambda_{i,t}; entropy (N,) = <H>_i with its gradient, or None.
        loss = -(1/N) sum_i [(1/|o_i|) sum_t lambda_{i,t} A_i ratio_{i,t} - gamma <H>_i],
        ratio = exp(logp - logp.detach())  (value 1, carries the gradient).
    The entropy term is every completion's, filtered or not: delta_i multiplies the advantage term
    only (Eq. 7). entropy=None leaves it out (the released form, where gamma is in the advantage).
    n_conflict (N,): divide each completion's advantage terms by max(n_conflict_i, 1) -- the
    released code's normalisation (Listing 3, step 5), not in the equations.
    loss_type, totals: how the terms are aggregated (aggregate; "grpo" is the formula above).
    Returns (loss, metrics).
    """
    mask = mask.to(logprobs.dtype)
    ratio = torch.exp(logprobs - logprobs.detach())                 # (N, L) == 1
    per_token = -ratio * advantages.unsqueeze(1) * weights          # (N, L)
    if n_conflict is not None:
        per_token = per_token / n_conflict.clamp(min=1).to(per_token.dtype).unsqueeze(1)
    metrics = {"gtpo/mean_weight": masked_mean(weights.detach(), mask)}
    per_seq = None if entropy is None else gamma * entropy          # (N,) the -gamma <H>_i of Eq. 7
    loss = aggregate(per_token, mask, loss_type, per_seq, totals)
    metrics["loss"] = loss.detach()
    return loss, metrics


def kl_k3(logprobs, ref_logprobs):
    """KL(pi || pi_ref) per token, the k3 estimate of Eq. 1's KL term: exp(d) - d - 1 with
    d = ref - logp (http://joschu.net/blog/kl-approx.html); unbiased, and >= 0 token by token, on
    tokens sampled from pi itself. logprobs, ref_logprobs (N, L) -> (N, L)."""
    d = ref_logprobs - logprobs                                     # (N, L)
    return torch.exp(d) - d - 1


def grpo_loss(logprobs, old_logprobs, ref_logprobs, mask, advantages, beta=0.0, clip_eps=0.2, entropy=None,
              gamma=0.0, loss_type="grpo", totals=None):
    """GRPO loss, Eq. 1 (Shao et al. 2024), the baseline.

    Per token: -[min(r A, clip(r, 1-eps, 1+eps) A) - beta * KL_k3], with
    r = exp(logp - old_logp) and KL_k3 = kl_k3(logp, ref); mean over each completion's real
    tokens, then over completions (loss_type "grpo"; aggregate gives the others). old_logprobs=None
    is the one-iteration case (old = logp.detach(), r == 1). ref_logprobs=None or beta=0 drops the KL
    term. entropy (N,) = <H>_i adds +gamma <H>_i per completion (GRPO + filtering + gamma, App. 14).
    logprobs, old_logprobs, ref_logprobs, mask (N, L); advantages (N,).
    Returns (loss, metrics) with metrics "kl" (when a reference is given) and "clip_ratio/region_mean"
    (the share of tokens where the clipped arm is the minimum).
    """
    mask = mask.to(logprobs.dtype)
    old = logprobs.detach() if old_logprobs is None else old_logprobs
    ratio = torch.exp(logprobs - old)                               # (N, L)
    adv = advantages.unsqueeze(1)                                   # (N, 1)
    clipped = torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps)
    per_token = -torch.min(ratio * adv, clipped * adv)              # (N, L)
    metrics = {}
    if ref_logprobs is not None:
        kl = kl_k3(logprobs, ref_logprobs)                          # (N, L)
        metrics["kl"] = masked_mean(kl.detach(), mask)
        if beta:
            per_token = per_token + beta * kl
    per_seq = None if entropy is None else gamma * entropy          # (N,)
    loss = aggregate(per_token, mask, loss_type, per_seq, totals)
    is_clipped = (ratio * adv > clipped * adv).to(mask.dtype)       # the min took the clipped arm
    metrics["clip_ratio/region_mean"] = masked_mean(is_clipped.detach(), mask)   # TRL's name
    metrics["loss"] = loss.detach()
    return loss, metrics
