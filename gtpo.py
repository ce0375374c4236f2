"""The GTPO objective (arXiv 2508.03772) as pure tensor functions.

No model, tokenizer or I/O lives here: every function takes tensors and returns tensors, so each
one can be read next to its equation and tested on its own. Every setting of the objective is a
field of Objective, declared once, and every function that reads one takes the Objective.

What the objective does, and leaves out:
  1. One iteration per batch of samples (Sec. 3): ratio == 1, no clip, gradient Eq. 22 (several iterations with
     the clip, or a KL term: GTPOTrainer on TRL's loss). Here beta is GRPO's alone (Eq. 1).
  2. lambda (Eq. 5) comes from the raw advantages' signs; completions with A_i = 0 neither have nor cause
     conflicts. A group whose rewards are all equal gets exactly 0 advantage (not a residue, not NaN).
  3. delta_i (Eq. 6) drops a completion's advantage term when <H>_i is above the threshold; the entropy
     term is Eq. 7's own (with its gradient) or the released code's (folded into A_i, detached).
  4. The loss is aggregated in one place (aggregate), so micro-batches and ranks do not change it.
  5. Where the released code departs from the equations (App. 16), a setting selects it: the std
     division, the conflict count and its normalisation, lambda's product, the sum over completions.

    Objective          Eq. 1, 5-8      every setting: default, values, symbol, help, the released code's value
    group_advantages   Eq. 8           A_i = (R_i - mean R) / (std R + eps)
    conflict_spans     Sec. 5.1        forward and backward conflict spans of one group (and _loop: the same, plainly)
    conflict_weights   Sec. 5.1, Eq. 5 lambda_{i,t} in {0, 1, 2} from fwd/bwd conflict spans
    token_entropy      Sec. 4.2        H(p) = -sum_j p_j ln p_j
    filter_deltas      Eq. 6           delta_i in {0, 1}: 0 where <H>_i is above the threshold
    shaped_advantages  Eq. 6-7         delta_i A_i (eq7_advantages) or delta_i (A_i - gamma <H>_i) (released_advantages)
    token_advantages   Eq. 5, 20       lambda_{i,t} A_i, the factor of each token's ratio (what TRL's trainer takes)
    aggregate          Eq. 7           per-token terms -> the step's loss: the one place, exact under micro-batches
    gtpo_loss          Eq. 7, 20, 22   -(1/G) sum_i [(1/|o_i|) sum_t lambda_{i,t} A_i ratio_{i,t} - gamma <H>_i]
    grpo_loss          Eq. 1           PPO-clipped surrogate - beta * KL (kl_k3), the baseline
    policy_loss        Eq. 1, 6-7      GTPO's or GRPO's loss from log-probs: where the two methods differ

Shapes: N completions (N = prompts x G), L completion positions, V vocabulary.
"""
import dataclasses
import math
from typing import NamedTuple

import torch


# -----------------------------------------------------------------------------
# 0. the objective's settings, each declared once

FILTER_MODES = ("all", "neg", "off")      # delta_i of Eq. 6 on every completion, on A < 0 ones (App. 13), on none
LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "bnpo", "luspo")  # TRL's loss_type names for the same normalisations

# a setting's range, (test, words): a value outside it is refused by Objective, so by every flag and GTPOConfig
AT_LEAST_0 = (lambda v: v >= 0, ">= 0")                          # nan is refused too
FINITE = (math.isfinite, "a finite number")
FINITE_AT_LEAST_0 = (lambda v: math.isfinite(v) and v >= 0, "a finite number >= 0")

# which methods read a setting: GTPO, GRPO, GRPO only with a filter of its own (App. 14), or none (the clip)
GTPO, GRPO, GRPO_FILTERED = "gtpo", "grpo", "grpo with --entropy_filter all or neg"


def setting(default, help, symbol, where, reads, choices=None, check=None, released=None, unrecorded=None):
    """One field of Objective: its default (the equations'), one line of help, the paper's symbol and equation, the
    methods that read it, its choices or range (check), the authors' code's value (App. 16; None: not one that
    --released_code sets), and what a run whose config.json predates it ran (the default; a changed default's old
    value stays here)."""
    return dataclasses.field(default=default, metadata=dict(
        help=help, symbol=symbol, where=where, reads=reads, choices=choices, check=check, released=released,
        unrecorded=default if unrecorded is None else unrecorded))


@dataclasses.dataclass(frozen=True)
class Objective:
    """Every setting of the GTPO / GRPO objective. train.py's flags, --released_code, config.json, --resume and
    GTPOConfig are made from these declarations, and every function below that reads a setting takes the
    Objective: a new variant is one field here and one branch where it acts. The defaults are the equations',
    but for entropy_term, which the rule declared in docs/study.md Part 7 chose from Q8's runs."""
    # Eq. 8 and Eq. 1: the advantage, and GRPO's own terms
    scale_rewards: bool = setting(True, "divide advantages by the group std (Eq. 8); --no-scale_rewards = released "
                                  "code", "std(R)", "Eq. 8", (GTPO, GRPO), released=False)
    beta: float = setting(0.0, "GRPO KL weight (paper: 0, 1e-6, 0.04); reference = the run's start", "β", "Eq. 1",
                          (GRPO,), check=FINITE_AT_LEAST_0)
    clip_eps: float = setting(0.2, "GRPO PPO clip range; read by no method here: one iteration per batch makes the "
                              "ratio 1 and the clip inactive (Sec. 2)", "ε", "Eq. 1", (), check=FINITE_AT_LEAST_0)
    # Eq. 5: lambda on the conflict tokens
    conflict_weight: float = setting(2.0, "lambda on conflict tokens of positive completions (Eq. 5)", "λ", "Eq. 5",
                                     (GTPO,), check=FINITE_AT_LEAST_0, released=2.0)
    conflict_combine: str = setting("or", "or = Eq. 5 (2 in overlapping spans); product = released code (4)",
                                    "M^fw ∨ M^bw", "Eq. 5", (GTPO,), choices=("or", "product"), released="product")
    conflict_norm: bool = setting(False, "divide each completion's loss by its conflict count (released code)",
                                  "÷ n_i", "Listing 3", (GTPO,), released=True)
    conflict_count: str = setting("union", "the conflict count --conflict_norm divides by: union = |M^fw v M^bw| "
                                  "(App. 16's prose); longer = the longer of the two spans (released code, Listing 2 "
                                  "line 91)", "n_i", "App. 16", (GTPO,), choices=("union", "longer"), released="longer")
    # Eq. 6: the entropy filter delta_i
    entropy_filter: str = setting("auto", "auto = Eq. 6 (filter iff <H>_ini < ln 2); all = delta_i on each completion; "
                                  "neg = on A_i < 0 only (OnlyNeg, App. 13); off. GRPO: auto = off; all/neg add the "
                                  "filter and -gamma <H>_i (App. 14)", "δ_i", "Eq. 6", (GTPO, GRPO),
                                  choices=("auto", *FILTER_MODES), released="all")
    ent_threshold: float = setting(math.log(2), "entropy filter threshold on <H>_i (Eq. 6: ln 2)", "ln 2", "Eq. 6",
                                   (GTPO, GRPO_FILTERED), check=AT_LEAST_0, released=0.7)
    # Eq. 7: the entropy term and how the terms become the loss
    ent_gamma: float = setting(0.1, "gamma of the entropy penalty (Eq. 7)", "γ", "Eq. 7", (GTPO, GRPO_FILTERED),
                               check=FINITE, released=0.1)
    entropy_term: str = setting("released", "released = -gamma <H>_i folded into the advantage (A_i - gamma <H>_i), "
                                "detached, and zeroed by delta_i with it (released code); eq7 = a term of its own for "
                                "every completion, with its gradient, delta_i filtering the advantage only (Eq. 7 as "
                                "written)", "−γ⟨H⟩_i", "Eq. 7", (GTPO, GRPO_FILTERED),
                                choices=("released", "eq7"), released="released", unrecorded="released")
    loss_type: str = setting("grpo", "how per-token terms become the loss (TRL's names): grpo = each completion's "
                             "token mean, then the mean over completions (Eq. 7); dapo = the mean over all tokens of "
                             "the step, all ranks included; dr_grpo = the sum over tokens / (N x "
                             "max_completion_length); bnpo = the mean over this rank's tokens (TRL: its micro-batch's); "
                             "luspo = each completion's token sum, then the mean over completions", "1/|o_i|", "Eq. 7",
                             (GTPO, GRPO), choices=LOSS_TYPES)
    sum_completions: bool = setting(False, "GTPO's loss sums the completions' terms instead of averaging them "
                                    "(released code: Listing 3 adds every completion's loss, no 1/G); with "
                                    "--loss_type grpo", "1/G", "Eq. 7", (GTPO,), released=True)

    def __post_init__(self):
        """Refuse a value outside a setting's declaration (ValueError, naming the setting); ints become floats."""
        for f in dataclasses.fields(self):
            value, meta = getattr(self, f.name), f.metadata
            if f.type is float and type(value) is int:
                object.__setattr__(self, f.name, value := float(value))
            if not isinstance(value, f.type) or f.type is not bool and isinstance(value, bool):
                raise ValueError(f"{f.name} must be a {f.type.__name__}, got {value!r}")
            if meta["choices"] and value not in meta["choices"]:
                raise ValueError(f"{f.name} must be one of {', '.join(meta['choices'])}, got {value!r}")
            if meta["check"] and not meta["check"][0](value):
                raise ValueError(f"{f.name} must be {meta['check'][1]}, got {value!r}")
        if self.sum_completions and self.loss_type != "grpo":
            raise ValueError(f"sum_completions sums Eq. 7's per-completion terms (loss_type grpo); loss_type "
                             f"{self.loss_type!r} has no per-completion mean to replace: drop one of the two")

    def filter_mode(self, method, h_ini=None):
        """delta_i's mode as run, one of FILTER_MODES: "auto" is Eq. 6 for GTPO (<H>_ini < ln 2), off for GRPO."""
        if self.entropy_filter != "auto":
            return self.entropy_filter
        if method != "gtpo":
            return "off"
        if h_ini is None:
            raise ValueError("entropy_filter 'auto' needs <H>_ini (step.initial_entropy), or choose all, neg or off")
        return "all" if h_ini < math.log(2) else "off"

    def shapes(self, method):
        """Whether Eq. 6-7 shape `method`'s advantages: always GTPO's; GRPO's only with a filter of its own."""
        return method == "gtpo" or self.entropy_filter in ("all", "neg")

    def entropy_grad(self, method):
        """Whether <H>_i needs its gradient: Eq. 7's -gamma <H>_i is a term of the objective (the loss adds it)."""
        return self.entropy_term == "eq7" and self.ent_gamma != 0 and self.shapes(method)

    def unread(self, method):
        """The settings `method` never reads (all of them for "sft")."""
        reads = {GTPO} if method == "gtpo" else {GRPO} | ({GRPO_FILTERED} if self.shapes(method) else set())
        return [f.name for f in dataclasses.fields(self) if method == "sft" or not reads & set(f.metadata["reads"])]


# --released_code: the authors' code where it departs from the equations, and its constants, whatever the profile
RELEASED = {f.name: f.metadata["released"] for f in dataclasses.fields(Objective) if f.metadata["released"] is not None}
# what a run whose config.json lacks a setting ran (--resume)
UNRECORDED = {f.name: f.metadata["unrecorded"] for f in dataclasses.fields(Objective)}
DEFAULT = Objective()


# -----------------------------------------------------------------------------
# helpers

def masked_mean(x, mask, dim=None):
    """Mean of `x` over positions where `mask` is true; 0 (not NaN) where nothing is. x, mask: same shape
    (mask bool/int/float); dim=None averages everything."""
    mask = mask.to(x.dtype)
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def token_logprobs(logits, ids):
    """log pi(ids | context) from logits: gather - logsumexp, in float32. logits (..., V), ids (...) long ->
    (...). Never materialises log_softmax of the full vocabulary in the logits' dtype (bf16 loses digits)."""
    logits = logits.float()
    chosen = logits.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    return chosen - torch.logsumexp(logits, dim=-1)


# -----------------------------------------------------------------------------
# 1. group-relative advantages (Eq. 8)

def group_advantages(rewards, group_size, objective=DEFAULT, eps=1e-4):
    """A_i = R_i - mean(group), divided by std(group) + eps when objective.scale_rewards (Eq. 8; off: the released code).

    rewards (N,) with N = n_groups * group_size, each group `group_size` consecutive completions of one
    prompt -> (N,) float32. std is the unbiased sample std, as in TRL's GRPOTrainer. A group whose rewards
    are all equal gets exactly 0 (not a rounding residue, not NaN).
    """
    rewards = torch.as_tensor(rewards, dtype=torch.float32)
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2 for group-relative advantages, got {group_size}")
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards must be 1-D with a length divisible by group_size={group_size}, "
                         f"got shape {tuple(rewards.shape)}")
    r = rewards.view(-1, group_size)                                # (B, G)
    adv = r - r.mean(dim=1, keepdim=True)
    if objective.scale_rewards:
        adv = adv / (r.std(dim=1, keepdim=True) + eps)
    flat = (r == r[:, :1]).all(dim=1, keepdim=True)                 # (B, 1) all-equal groups
    adv = torch.where(flat, torch.zeros_like(adv), adv)
    return adv.reshape(-1)


# -----------------------------------------------------------------------------
# 2. conflict tokens and lambda (Sec. 5.1, Eq. 5; App. 11 Eq. 21; App. 16 Listing 2)

def _aligned_conflicts(ids, valid, pos, neg):
    """Positions whose token is shared, at that same aligned position, with >= 1 positive and >= 1 negative
    completion; then the first contiguous run only. ids (G, L) long, valid (G, L) bool, pos/neg (G,) bool ->
    (G, L) bool. Pairwise (G, G, L) instead of Listing 2's vocabulary-indexed bincount: memory independent of V."""
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


def conflict_weights(ids, mask, advantages, objective=DEFAULT, counted=None):
    """Token weights lambda_{i,t} for ONE group (Eq. 5, Eq. 21). ids (G, L) long, right-padded; mask (G, L),
    true on real tokens; advantages (G,); counted (G, L): the policy's own tokens (not a tool's output), which
    conflict and n_conflict count (None: all) -> weights (G, L) float32, conflict (G, L) bool, n_conflict (G,) long.

    * forward conflict at position p of completion i: the token ids[i, p] is at position p in some completion
      with A > 0 and in some with A < 0; backward: positions counted from each completion's own last token;
      the first contiguous span from the start (end) counts; conflict = fwd OR bwd (M^fw v M^bw, Sec. 5.1);
    * lambda = objective.conflict_weight on conflict tokens of A > 0 completions, 0 on those of A < 0 completions,
      1 elsewhere, 0 on padding. A = 0 completions neither have nor cause conflicts; conflict_combine
      "product" (Listing 2, `mask_fwd * mask_bw`) gives a token in BOTH spans conflict_weight**2 (= 4);
    * n_conflict[i]: conflict_count "union", |M^fw v M^bw| as App. 16's prose says; "longer", max(|fw span|,
      |bw span|), what Listing 2 line 91 computes (it ORs the forward span with the backward one still in
      reversed coordinates: two prefixes, so their OR is the longer).
    """
    fwd, bwd = conflict_spans(ids, mask, advantages)                # (G, L) each
    valid, pos = mask.bool(), (advantages > 0).unsqueeze(1)         # (G, L), (G, 1)
    conflict = fwd | bwd                                            # (G, L)
    on_conflict = torch.where(pos, objective.conflict_weight, 0.0)          # (G, 1): lambda on a conflict token
    if objective.conflict_combine == "or":                                  # Eq. 5
        weights = torch.where(~valid, 0.0, torch.where(conflict, on_conflict, 1.0))
    else:                                                           # Listing 2: mask_fwd * mask_bw
        weights = torch.where(~valid, 0.0, torch.where(fwd, on_conflict, 1.0) * torch.where(bwd, on_conflict, 1.0))
    if counted is not None:
        fwd, bwd, conflict = (c & counted.bool() for c in (fwd, bwd, conflict))
    n_conflict = (conflict.sum(dim=1) if objective.conflict_count == "union"
                  else torch.maximum(fwd.sum(dim=1), bwd.sum(dim=1)))                         # (G,)
    return weights.float(), conflict, n_conflict


def conflict_spans_loop(ids, mask, advantages):
    """Sec. 5.1 read one token at a time; conflict_spans computes the same (tested equal). Token r of completion
    i is a forward conflict when some completion with A > 0 and some with A < 0 have the same token at position
    r (i itself counts), and tokens 0 ... r-1 of i are conflicts too. Backward: the same with positions counted
    from each completion's own last token. A = 0 completions have none. ids, mask (G, L) right-padded,
    advantages (G,) -> (fwd, bwd), each (G, L) bool."""
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


def batch_conflict_weights(ids, mask, advantages, group_size, objective=DEFAULT, counted=None):
    """conflict_weights over consecutive groups of `group_size` rows: ids, mask, counted (N, L); advantages (N,)
    -> weights (N, L), conflict (N, L), n_conflict (N,)."""
    counted = mask if counted is None else counted
    out = [conflict_weights(i, m, a, objective, c) for i, m, a, c in zip(
        ids.split(group_size), mask.split(group_size), advantages.split(group_size), counted.split(group_size))]
    return tuple(torch.cat(parts) for parts in zip(*out))


# -----------------------------------------------------------------------------
# 3. entropy (Sec. 4.2), the filter delta_i (Eq. 6) and the entropy term (Eq. 7)

def token_entropy(logits):
    """Shannon entropy in nats of softmax(logits): (..., V) -> (...), float32. From log-softmax, with
    p ln p := 0 where p = 0, so -inf logits (masked vocabulary entries) give no NaN."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    p = logp.exp()
    return -torch.where(p > 0, p * logp, torch.zeros_like(p)).sum(dim=-1)


def filter_deltas(advantages, entropy, threshold, mode):
    """delta_i of Eq. 6, one 0/1 value per completion: 0 where <H>_i is above the threshold, else 1. mode "all":
    every completion (Eq. 6 with <H>_ini < ln 2); "neg": only A_i < 0 ones (GTPO-OnlyNeg, App. 13); "off": none is
    dropped (Eq. 6 with <H>_ini >= ln 2). <H>_i == threshold is kept. advantages (N,); entropy (N,) = <H>_i, read as
    a constant -> (N,) in advantages' dtype."""
    if mode not in FILTER_MODES:
        raise ValueError(f"entropy filter mode must be one of {', '.join(FILTER_MODES)}, got {mode!r}")
    drop = (entropy.detach() > threshold) & (mode != "off")        # (N,)
    return (~(drop & (advantages < 0) if mode == "neg" else drop)).to(advantages.dtype)


def eq7_advantages(advantages, entropy, threshold, mode="all"):
    """delta_i A_i, Eq. 6-7 as written: Eq. 7's -gamma <H>_i stays outside delta_i (gtpo_loss's `entropy`).
    advantages (N,), entropy (N,) = <H>_i; modes as filter_deltas -> (N,)."""
    delta = filter_deltas(advantages, entropy, threshold, mode)     # (N,)
    return torch.where(delta > 0, advantages, torch.zeros_like(advantages))


def released_advantages(advantages, entropy, threshold, gamma, mode="all"):
    """delta_i (A_i - gamma <H>_i): Eq. 6-7 as the released code realises them (App. 16, Listing 3 step 2): the
    penalty folded into the advantage, <H>_i detached (gamma acts through d log pi, not dH/dtheta), lost with the
    advantage when filtered. advantages (N,), entropy (N,) = <H>_i; modes as filter_deltas. lambda comes from the
    raw A_i: one turned negative here keeps lambda = 2, as in the released code."""
    entropy = entropy.detach().to(advantages.dtype)
    shaped = advantages - gamma * entropy                           # (N,)
    delta = filter_deltas(advantages, entropy, threshold, mode)
    return shaped if mode == "off" else torch.where(delta > 0, shaped, torch.zeros_like(shaped))


def shaped_advantages(advantages, entropy, objective, mode):
    """Eq. 6-7 in one place: what multiplies each completion's log-prob gradient.
    advantages (N,) from Eq. 8; entropy (N,) = <H>_i (read as a constant here); mode: delta_i's, one of
    FILTER_MODES (Objective.filter_mode); the threshold, gamma and term are the objective's. -> (N,).
        entropy_term  mode       advantage                      Eq. 7's own term (policy_loss)
        eq7           off        A_i                            loss + gamma <H>_i, with its gradient
        eq7           all / neg  delta_i A_i                    loss + gamma <H>_i, every completion's
        released      off        A_i - gamma <H>_i (detached)   none
        released      all / neg  delta_i (A_i - gamma <H>_i)    none
    delta_i = 0 where <H>_i > threshold ("neg": and A_i < 0), else 1 (filter_deltas).
    """
    if objective.entropy_term == "eq7":
        return eq7_advantages(advantages, entropy, objective.ent_threshold, mode)
    return released_advantages(advantages, entropy, objective.ent_threshold, objective.ent_gamma, mode)


def token_advantages(weights, n_conflict, advantages, objective=DEFAULT):
    """A_{i,t} = lambda_{i,t} A_i (Eq. 5's weights on Eq. 6-7's advantage, the factor of ratio_{i,t} in Eq. 20),
    divided by max(n_conflict_i, 1) with conflict_norm (the released code's normalisation, Listing 3 step 5).
    weights (N, L), n_conflict (N,), advantages (N,) -> (N, L): what gtpo_loss and TRL's trainer weigh tokens by."""
    per_token = weights * advantages.unsqueeze(1)                   # (N, L)
    if objective.conflict_norm:
        per_token = per_token / n_conflict.clamp(min=1).to(per_token.dtype).unsqueeze(1)
    return per_token


def filtered_stats(advantages, delta, entropy, objective=DEFAULT):
    """What Eq. 6's filter removed: (sum_i (1 - delta_i) / N over completions whose unfiltered advantage is not 0;
    their mean <H>_i, or 0.0). advantages (N,) from Eq. 8, delta (N,), entropy (N,) <H>_i, objective: the one
    that shaped."""
    unfiltered = shaped_advantages(advantages, entropy, objective, "off")                 # (N,)
    removed = (1 - delta) * ((advantages != 0) & (unfiltered != 0))                      # (N,) 1 - delta_i
    total = removed.sum().item()
    return removed.float().mean().item(), (entropy.float() * removed).sum().item() / total if total > 0 else 0.0


# -----------------------------------------------------------------------------
# 4. aggregation: how per-token terms become the loss

class Totals(NamedTuple):
    """What aggregate divides a micro-batch's terms by: completions N (this rank's in the step, as many on every
    rank); tokens, the step's ("dapo": all ranks' / ranks; else this rank's); max_length, L_max."""
    completions: float
    tokens: float
    max_length: float


def aggregate(per_token, mask, loss_type="grpo", per_seq=None, totals=None):
    """The loss from per-token terms l_{i,t}: the one place where they are summed and normalised.
    per_token (n, L); mask (n, L); per_seq (n,) or None: a completion's own term s_i (Eq. 7's gamma <H>_i),
    aggregated as the value s_i on each of its |o_i| tokens; totals: the step this micro-batch is part of
    (Totals; None = this micro-batch alone).
        grpo     (1/N) sum_i [(1/|o_i|) sum_t l_{i,t} + s_i]       Eq. 7: token mean, then completions' mean
        dapo     (1/T) sum_i [sum_t l_{i,t} + |o_i| s_i]           token-level (DAPO); bnpo: T this rank's tokens
        dr_grpo  (1/(N L_max)) sum_i [sum_t l_{i,t} + |o_i| s_i]   a constant length (Dr. GRPO)
        luspo    (1/N) sum_i [sum_t l_{i,t} + |o_i| s_i]           each completion's token sum (LUSPO)
    Returns this micro-batch's share of the step's loss: the micro-batches' shares add up to the step's, and,
    as DDP averages gradients and Totals.tokens is the ranks' mean count for "dapo", the ranks' shares average to
    it (for "bnpo", to the mean of each rank's own token mean).
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
    norm = {"dapo": max(totals.tokens, 1.0), "bnpo": max(totals.tokens, 1.0), "luspo": totals.completions,
            "dr_grpo": totals.completions * totals.max_length}[loss_type]
    return sums.sum() / norm


# -----------------------------------------------------------------------------
# 5. losses

def gtpo_loss(logprobs, mask, advantages, objective=DEFAULT, entropy=None, totals=None):
    """GTPO loss (Eq. 7 / Eq. 20), one-iteration case (Sec. 3): the gradient is Eq. 22.
    logprobs (N, L) log pi(o_{i,t}) of the sampled tokens, with grad; mask (N, L); advantages (N, L) =
    lambda_{i,t} A_i (token_advantages, after Eq. 6's filter); entropy (N,) = <H>_i with its gradient, or None.
        loss = -(1/N) sum_i [(1/|o_i|) sum_t lambda_{i,t} A_i ratio_{i,t} - gamma <H>_i],
        ratio = exp(logp - logp.detach())  (value 1, carries the gradient).
    The entropy term is every completion's, filtered or not (Eq. 7); entropy=None leaves it out (the released form).
    objective.loss_type, totals: the aggregation; objective.sum_completions sums the completions' terms (Listing 3: no 1/G).
    Returns (loss, metrics)."""
    mask = mask.to(logprobs.dtype)
    ratio = torch.exp(logprobs - logprobs.detach())                 # (N, L) == 1
    per_token = -ratio * advantages                                 # (N, L)
    if objective.sum_completions:
        totals = (totals or Totals(len(mask), mask.sum().item(), mask.shape[1]))._replace(completions=1)
    per_seq = None if entropy is None else objective.ent_gamma * entropy    # (N,) gamma <H>_i: the objective
    # subtracts it, so the loss (its negative) adds it
    loss = aggregate(per_token, mask, objective.loss_type, per_seq, totals)
    return loss, {"loss": loss.detach()}


def kl_k3(logprobs, ref_logprobs):
    """KL(pi || pi_ref) per token, Eq. 1's k3 estimate exp(d) - d - 1, d = ref - logp (joschu.net/blog/kl-approx.html):
    unbiased and >= 0 on tokens sampled from pi itself. logprobs, ref_logprobs (N, L) -> (N, L)."""
    d = ref_logprobs - logprobs                                     # (N, L)
    return torch.exp(d) - d - 1


def grpo_loss(logprobs, old_logprobs, ref_logprobs, mask, advantages, objective=DEFAULT, entropy=None, totals=None):
    """GRPO loss, Eq. 1 (Shao et al. 2024), the baseline. Per token: -[min(r A, clip(r, 1-eps, 1+eps) A) -
    beta * KL_k3], eps = objective.clip_eps, beta = objective.beta, r = exp(logp - old_logp), aggregated as
    objective.loss_type says.
    old_logprobs=None: one iteration (r == 1); ref_logprobs=None or beta=0: no KL term; entropy (N,) = <H>_i adds
    +gamma <H>_i per completion (GRPO + filtering + gamma, App. 14). logprobs, old_logprobs, ref_logprobs, mask
    (N, L); advantages (N,). Returns (loss, metrics): "kl" (with a reference), "clip_ratio/region_mean"."""
    mask = mask.to(logprobs.dtype)
    old = logprobs.detach() if old_logprobs is None else old_logprobs
    ratio = torch.exp(logprobs - old)                               # (N, L)
    adv = advantages.unsqueeze(1)                                   # (N, 1)
    clipped = torch.clamp(ratio, 1 - objective.clip_eps, 1 + objective.clip_eps)
    per_token = -torch.min(ratio * adv, clipped * adv)              # (N, L)
    metrics = {}
    if ref_logprobs is not None:
        kl = kl_k3(logprobs, ref_logprobs)                          # (N, L)
        metrics["kl"] = masked_mean(kl.detach(), mask)
        if objective.beta:
            per_token = per_token + objective.beta * kl
    per_seq = None if entropy is None else objective.ent_gamma * entropy    # (N,)
    loss = aggregate(per_token, mask, objective.loss_type, per_seq, totals)
    is_clipped = (ratio * adv > clipped * adv).to(mask.dtype)       # the min took the clipped arm
    metrics["clip_ratio/region_mean"] = masked_mean(is_clipped.detach(), mask)   # TRL's name
    metrics["loss"] = loss.detach()
    return loss, metrics


def policy_loss(objective, method, mode, logp, mask, adv, h, weights=None, n_conflict=None, ref=None, totals=None):
    """The one place where GTPO and GRPO differ, given completions' log-probs: GTPO's loss (Eq. 7 with Eq. 5's
    weights) or GRPO's (Eq. 1), after Eq. 6-7 (shaped_advantages; GRPO only with a filter of its own, App. 14,
    Fig. 10c: GRPO + filtering + gamma; by default it is the plain baseline).
    objective: the Objective; method "gtpo" or "grpo"; mode: delta_i's (Objective.filter_mode); logp (n, L) with
    grad; mask (n, L); adv (n,) from Eq. 8; h (n,) = <H>_i, with its gradient where objective.entropy_grad(method);
    weights (n, L) and n_conflict (n,) from conflict_weights (GTPO); ref (n, L) reference log-probs (GRPO,
    beta > 0); totals: the step these completions are part of (None = these alone).
    Returns (loss, metrics, delta_i (n,) or None where the method's advantages are not shaped).
    """
    shapes = objective.shapes(method)
    shaped = shaped_advantages(adv, h, objective, mode) if shapes else adv                      # (n,) Eq. 6-7
    entropy = h if objective.entropy_grad(method) else None                                     # Eq. 7's own term
    delta = filter_deltas(adv, h, objective.ent_threshold, mode) if shapes else None
    if method == "gtpo":
        loss, m = gtpo_loss(logp, mask, token_advantages(weights, n_conflict, shaped, objective), objective, entropy,
                            totals)
        m["gtpo/mean_weight"] = masked_mean(weights.detach(), mask.to(logp.dtype))
        return loss, m, delta
    loss, m = grpo_loss(logp, None, ref, mask, shaped, objective, entropy, totals)
    return loss, m, delta
