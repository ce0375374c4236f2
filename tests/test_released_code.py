"""`--released_code` is the authors' code: the loop's own step (step.rl_step, sampling and reward replaced by a
fixed group) gives the loss and gradient of the paper's Listings 2-3 (tests/released_listings.py) on seeded
random groups; and a hand-computed group for each place where that code departs from its own prose
(the conflict count of Listing 2 line 91; the sum over completions of Listing 3)."""
import pytest
import torch

import gtpo
import rewards
import step
from machinery import config
from released_listings import UnslothEfficientGTPO, build_conflict_mask
from rollout import Rollout

V, PAD, P, G = 12, 0, 3, 8          # a small vocabulary, so that aligned tokens are shared often
REWARDS = (0.0, 1.0, 10.0, 11.0, 20.0)
CASES = 60                          # x 2 groups = 120 groups


@pytest.fixture(scope="module")
def model():
    """A 2-layer random Llama, V tokens; LM head frozen (the listing's gradient stops at the hidden states) and
    scaled so that the completions' <H>_i straddle the 0.7 threshold."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, pad_token_id=PAD)
    m = LlamaForCausalLM(cfg).float()
    with torch.no_grad():
        m.lm_head.weight.mul_(40.0)
    m.lm_head.weight.requires_grad_(False)
    return m


def random_groups(seed, B=2):
    """B groups of G completions, right-padded with PAD: shared leading and trailing spans of random length
    among random subsets, some completions copied whole (all-conflict), some lengths 1; rewards drawn from
    the paper's 0/1/10/11/20, one group in four all equal (A = 0). -> (Rollout, rewards (B G,))."""
    g = torch.Generator().manual_seed(seed)
    L = int(torch.randint(3, 11, (1,), generator=g))
    lengths = torch.randint(1, L + 1, (B * G,), generator=g)
    lengths[0] = L
    ids = torch.randint(1, V, (B * G, L), generator=g)
    for b in range(B):
        rows = torch.arange(b * G, (b + 1) * G)
        head, tail = (int(torch.randint(0, L + 1, (1,), generator=g)) for _ in range(2))
        share = rows[torch.rand(G, generator=g) < 0.6]
        ids[share, :head] = torch.randint(1, V, (1, head), generator=g)
        suffix = torch.randint(1, V, (tail,), generator=g)
        for i in rows[torch.rand(G, generator=g) < 0.6].tolist():
            k = min(tail, int(lengths[i]))
            ids[i, lengths[i] - k:lengths[i]] = suffix[tail - k:]
        if torch.rand(1, generator=g) < 0.5:                                 # a copy: all its tokens conflict
            i, j = rows[torch.randperm(G, generator=g)[:2]].tolist()
            ids[j], lengths[j] = ids[i], lengths[i]
    mask = (torch.arange(L)[None] < lengths[:, None]).long()
    ids = ids.masked_fill(mask == 0, PAD)
    r = torch.tensor(REWARDS)[torch.randint(0, len(REWARDS), (B * G,), generator=g)]
    if seed % 4 == 0:
        r[:G] = r[0]
    prompts = torch.randint(1, V, (B, P), generator=g).repeat_interleave(G, 0)           # (B G, P)
    ro = Rollout(prompts, torch.ones_like(prompts), ids, mask, torch.zeros(B * G, dtype=torch.bool),
                 ["x"] * (B * G))
    return ro, r


def released_cfg(B, L):
    """The loop's config under --released_code on the default model (its demo profile underneath)."""
    return config.parse_args(["--released_code", "--batch_size", str(B), "--generation_size", str(G),
                              "--max_completion_length", str(L), "--micro_batch_size", "3"])


def project_step(model, ro, r, cfg, monkeypatch):
    """step.rl_step as the loop calls it, sampling and reward replaced: (loss, {name: grad}, entropies (N,))."""
    monkeypatch.setattr(step, "rollout", lambda *a, **k: ro)
    monkeypatch.setattr(rewards, "reward", lambda texts, refs, task, counts=None: (r, r, r))
    model.zero_grad()
    m, _, _ = step.rl_step(model, model, None, ["p"] * cfg.batch_size, ["a"] * cfg.batch_size, cfg)
    return m["loss"], {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, m


def listing_step(model, ro, r, B):
    """Listing 3 on the same completions: the policy's final hidden states from the last prompt token on,
    (B, G, L + 1, H), through UnslothEfficientGTPO, its gradient pushed into the model.
    -> (loss, {name: grad}, the largest change the listing's clamp log(max(p, 1e-6)) makes to a <H>_i)."""
    model.zero_grad()
    full = torch.cat([ro.prompt_ids, ro.completion_ids], 1)                                  # (N, P + L)
    hidden = model.model(input_ids=full).last_hidden_state[:, P - 1:]                        # (N, L + 1, H)
    adv = (r.view(B, G) - r.view(B, G).mean(1, keepdim=True))                                # R - mean
    L = ro.completion_ids.shape[1]
    h = hidden.reshape(B, G, L + 1, -1)
    loss, _, _ = UnslothEfficientGTPO.apply(h, h.detach(), model.lm_head.weight, ro.completion_ids.view(B, G, L),
                                            ro.completion_mask.view(B, G, L), adv, r.view(B, G), 0.0)
    loss.backward()
    with torch.no_grad():
        p = torch.softmax(model.lm_head(hidden[:, :-1]), -1)                                  # (N, L, V)
        clamp = -(p * (p.clamp_min(1e-6).log() - p.log())).sum(-1)                           # (N, L)
        clamp = (gtpo.masked_mean(clamp, ro.completion_mask, dim=1)).abs().max().item()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, clamp


def rel_diff(a, b):
    """|a - b| / |b| over the whole gradient (or a loss), 0 where both are 0."""
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        a, b = torch.cat([a[k].flatten() for k in sorted(a)]), torch.cat([b[k].flatten() for k in sorted(b)])
        num, den = (a - b).norm().item(), b.norm().item()
    else:
        num, den = abs(a - b), abs(b)
    return 0.0 if num == 0 else num / max(den, 1e-30)


def test_released_code_is_listings_2_and_3_on_random_groups(model, monkeypatch):
    """On 120 random groups (60 steps of 2 prompts x 8), the loss and the gradient of every parameter below the
    LM head agree with the transcription within 1e-5 relative. The listing's entropy clamp (log of p >= 1e-6)
    is kept in the transcription, not in the project: it moves no <H>_i by 1e-6 here (checked), so no shaped
    advantage A_i - 0.1 <H>_i by 1e-7, far inside the tolerance (and a filter decision only at <H>_i that close
    to 0.7)."""
    seen = {"filtered": 0, "kept": 0, "all_conflict": 0, "no_conflict": 0, "zero_adv": 0, "count_differs": 0}
    worst = 0.0
    for seed in range(CASES):
        ro, r = random_groups(seed)
        B, L = 2, ro.completion_ids.shape[1]
        cfg = released_cfg(B, L)
        loss, grad, m = project_step(model, ro, r, cfg, monkeypatch)
        ref_loss, ref_grad, clamp = listing_step(model, ro, r, B)
        assert clamp < 1e-6
        err = max(rel_diff(loss, ref_loss), rel_diff(grad, ref_grad))
        assert err < 1e-5, (seed, loss, ref_loss, err)
        worst = max(worst, err)
        # what the groups covered
        adv = r.view(B, G) - r.view(B, G).mean(1, keepdim=True)
        for b in range(B):
            rows = slice(b * G, (b + 1) * G)
            pos, neg = adv[b] > 0, adv[b] < 0
            _, conflict, n = build_conflict_mask(ro.completion_ids[rows], ro.completion_mask[rows], pos, neg, V, PAD)
            active = pos | neg
            seen["zero_adv"] += int((~active).sum())
            seen["all_conflict"] += int(((n == ro.completion_mask[rows].sum(1)) & active).sum())
            seen["no_conflict"] += int(((conflict.sum(1) == 0) & active).sum())
            _, union, _ = gtpo.conflict_weights(ro.completion_ids[rows], ro.completion_mask[rows], adv[b])
            seen["count_differs"] += int(((union.sum(1).clamp(min=1) != n) & active).sum())
        seen["filtered"] += round(m["gtpo/filtered_frac"] * B * G)
        seen["kept"] += B * G - round(m["gtpo/filtered_frac"] * B * G)
    assert all(v > 0 for v in seen.values()), seen


def test_released_code_sets_the_listings_constants_on_every_model():
    """gamma 0.1 (ENT_SCALE), threshold 0.7 always on, lambda 2 combined by product, R - mean, the count of
    line 91 and the sum over completions (tests/test_objective.py holds gtpo.RELEASED to the listings), whatever
    the model's profile says; flags given beside it win."""
    for model in ("smollm2-135m", "llama-8b", "qwen2.5-3b"):
        assert config.parse_args(["--released_code", "--model", model]).objective == gtpo.Objective(**gtpo.RELEASED)
    assert config.parse_args(["--released_code", "--ent_gamma", "0.3"]).objective.ent_gamma == 0.3
    demo = config.parse_args([]).objective
    assert (demo.conflict_count, demo.sum_completions) == ("union", False)          # the defaults: the prose


def spans_group():
    """3 completions of one group: a positive one and a negative one that share their first 3 tokens and their
    last 2, and a second positive one sharing only the first 3. A = (+1, -2, +1)."""
    ids = torch.tensor([[5, 6, 7, 1, 2, 8, 9],
                        [5, 6, 7, 3, 8, 9, PAD],
                        [5, 6, 7, 4, 4, 4, 4]])
    mask = (ids != PAD).long()
    return ids, mask, torch.tensor([1.0, -2.0, 1.0])


def test_conflict_count_longer_is_the_longer_span_by_hand():
    """Listing 2 line 91 ORs the forward span with the backward span still in reversed coordinates: two
    prefixes, so the count is the longer span, 3, where the spans' union (Sec. 5.1's M^fw v M^bw) holds 5."""
    ids, mask, adv = spans_group()
    _, conflict, union = gtpo.conflict_weights(ids, mask, adv)
    _, _, longer = gtpo.conflict_weights(ids, mask, adv, gtpo.Objective(conflict_count="longer"))
    assert union.tolist() == [5, 5, 3] and longer.tolist() == [3, 3, 3]
    _, _, listing = build_conflict_mask(ids, mask, adv > 0, adv < 0, 10, PAD)
    assert listing.tolist() == longer.tolist()
    assert conflict[0].tolist() == [True, True, True, False, False, True, True]


def test_sum_completions_is_g_times_the_mean_by_hand():
    """Listing 3 adds every completion's loss with no 1/G: on 3 completions with all logp = 0 (ratio 1), the
    loss is -sum_i (1/|o_i|) sum_t lambda A_i = 3 x the mean's."""
    ids, mask, adv = spans_group()
    weights, _, _ = gtpo.conflict_weights(ids, mask, adv)
    logp = torch.zeros(ids.shape, requires_grad=True)
    mean, _ = gtpo.gtpo_loss(logp, mask, gtpo.token_advantages(weights, None, adv))
    total, _ = gtpo.gtpo_loss(logp, mask, gtpo.token_advantages(weights, None, adv), gtpo.Objective(sum_completions=True))
    # by hand: row 0 weights (2,2,2,1,1,2,2) / 7 * 1; row 1: (0,0,0,1,0,0) / 6 * -2; row 2: (2,2,2,1,1,1,1) / 7
    by_hand = -(12 / 7 - 2 / 6 + 10 / 7)
    assert total.item() == pytest.approx(by_hand) and mean.item() == pytest.approx(by_hand / 3)
    assert config.parse_args(["--sum_completions"]).objective.sum_completions
