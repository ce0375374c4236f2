"""Tests for gtpo.py: hand-computed cases, a brute-force reference of the conflict
definitions (Sec. 5.1), and value + gradient checks against Eq. 1, 20 and 22."""
import math
import random

import pytest
import torch

import gtpo
from gtpo import (Objective, batch_conflict_weights, conflict_weights, eq7_advantages, group_advantages, grpo_loss,
                  gtpo_loss, kl_k3, masked_mean, released_advantages, token_advantages, token_entropy, token_logprobs)


def pad(rows, fill=0):
    """List of token lists -> right-padded ids (G, L) and mask (G, L)."""
    L = max(len(r) for r in rows)
    ids = torch.full((len(rows), L), fill, dtype=torch.long)
    mask = torch.zeros(len(rows), L, dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r, dtype=torch.long)
        mask[i, :len(r)] = True
    return ids, mask


# -----------------------------------------------------------------------------
# group advantages (Eq. 8)

def test_group_advantages_hand_computed():
    r = torch.tensor([0.0, 10.0, 20.0, 20.0, 1.0, 1.0, 1.0, 5.0])
    a = group_advantages(r, 4, Objective(scale_rewards=False))
    assert torch.allclose(a, torch.tensor([-12.5, -2.5, 7.5, 7.5, -1.0, -1.0, -1.0, 3.0]))
    a = group_advantages(r, 4, Objective(scale_rewards=True), eps=0.0)
    std0 = math.sqrt((12.5**2 + 2.5**2 + 7.5**2 * 2) / 3)            # unbiased
    std1 = math.sqrt((3 * 1.0 + 9.0) / 3)
    expect = [-12.5 / std0, -2.5 / std0, 7.5 / std0, 7.5 / std0, -1 / std1, -1 / std1, -1 / std1, 3 / std1]
    assert torch.allclose(a, torch.tensor(expect), atol=1e-6)
    a = group_advantages(r, 4)                                       # default eps 1e-4
    assert torch.allclose(a[:4], torch.tensor([-12.5, -2.5, 7.5, 7.5]) / (std0 + 1e-4), atol=1e-6)


def test_group_advantages_all_equal_is_exact_zero():
    # 0.1 * 3 / 3 != 0.1 in float32 arithmetic: the zero must not be a rounding residue
    r = torch.tensor([0.1, 0.1, 0.1, 0.7, 0.7, 0.7, 3.0, 4.0, 6.0])
    for scale in (True, False):
        a = group_advantages(r, 3, Objective(scale_rewards=scale))
        assert torch.isfinite(a).all()
        assert (a[:6] == 0).all()
        assert (a[6:] != 0).all()
    assert (group_advantages(torch.zeros(12), 12, eps=0.0) == 0).all()   # no 0/0 even with eps=0


def test_group_advantages_bad_shapes():
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(torch.zeros(4), 1)
    with pytest.raises(ValueError, match="divisible"):
        group_advantages(torch.zeros(5), 2)


# -----------------------------------------------------------------------------
# conflict weights (Sec. 5.1, Eq. 5; App. 10 Figure 9)

def brute_conflicts(rows, adv):
    """Literal transcription of the definitions in Sec. 5.1, one Python loop each."""
    G = len(rows)
    pos = [a > 0 for a in adv]
    neg = [a < 0 for a in adv]

    def fwd_token_conflict(i, p):
        v = rows[i][p]
        return (any(pos[j] and len(rows[j]) > p and rows[j][p] == v for j in range(G))
                and any(neg[j] and len(rows[j]) > p and rows[j][p] == v for j in range(G)))

    def bwd_token_conflict(i, r):                                   # r-th from the end, r = 0 last
        v = rows[i][len(rows[i]) - 1 - r]
        return (any(pos[j] and len(rows[j]) > r and rows[j][len(rows[j]) - 1 - r] == v for j in range(G))
                and any(neg[j] and len(rows[j]) > r and rows[j][len(rows[j]) - 1 - r] == v for j in range(G)))

    out = []
    for i, row in enumerate(rows):
        n = len(row)
        m = [False] * n
        if pos[i] or neg[i]:
            for p in range(n):                                      # first span from the left
                if not fwd_token_conflict(i, p):
                    break
                m[p] = True
            for r in range(n):                                      # first span from the right
                if not bwd_token_conflict(i, r):
                    break
                m[n - 1 - r] = True
        out.append(m)
    return out


def brute_weights(rows, adv, conflict_weight=2.0):
    conf = brute_conflicts(rows, adv)
    L = max(len(r) for r in rows)
    w = torch.zeros(len(rows), L)
    for i, m in enumerate(conf):
        for p, c in enumerate(m):
            w[i, p] = 1.0 if not c else (conflict_weight if adv[i] > 0 else 0.0)
    return w, conf


def test_figure9_example():
    # App. 10 / Figure 9: "What is 2 + 2?". Tokens: 1=<reasoning> (split as 1,2 like
    # "<reason" "ing>"), 3=</reasoning>, 4=<answer>, 5=</answer>, digits 40=4, 30=3,
    # words 7..9. Shared <reasoning> prefix and </answer> suffix, differing middle.
    R, ING, ER, A, EA = 1, 2, 3, 4, 5
    rows = [
        [R, ING, 7, 8, ER, A, 40, EA],          # + correct
        [R, ING, 9, ER, A, 30, EA],             # - wrong "3"
        [R, ING, 7, 9, 8, ER, A, 40, EA],       # + correct, longer
        [R, ING, 8, ER, A, 30, EA],             # - wrong
    ]
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    ids, mask = pad(rows)
    w, conflict, n = conflict_weights(ids, mask, adv)
    # forward span: <reason ing> (2 tokens) in every row. Backward: </answer> always;
    # one before it, "4" vs "3" differ -> span stops at 1. (7 at fwd position 2 is in two
    # positive rows only -> not a conflict.)
    expect = torch.tensor([
        [2, 2, 1, 1, 1, 1, 1, 2, 0],
        [0, 0, 1, 1, 1, 1, 0, 0, 0],
        [2, 2, 1, 1, 1, 1, 1, 1, 2],
        [0, 0, 1, 1, 1, 1, 0, 0, 0],
    ], dtype=torch.float32)
    assert torch.equal(w, expect)
    assert n.tolist() == [3, 3, 3, 3]
    assert conflict.dtype == torch.bool and torch.equal(conflict, (expect == 2) | (expect == 0) & mask)


def test_backward_uses_true_lengths_and_middle_conflicts_are_ignored():
    # Same suffix [8, 9] at different absolute positions; token 5 is shared at position 2
    # by both rows but sits after a non-conflict position 1, so it is no part of a span.
    rows = [[1, 2, 5, 8, 9], [1, 3, 5, 6, 7, 8, 9]]
    ids, mask = pad(rows, fill=9)                                   # padding with a real-looking id
    w, conflict, n = conflict_weights(ids, mask, torch.tensor([0.5, -0.5]))
    assert w.tolist() == [[2, 1, 1, 2, 2, 0, 0], [0, 1, 1, 1, 1, 0, 0]]
    assert n.tolist() == [3, 3]


def test_overlapping_spans_get_two_not_four_and_product_option():
    rows = [[1, 2, 3], [1, 2, 3], [1, 2, 3, 3]]                     # row 0/1 fully in both spans
    ids, mask = pad(rows)
    adv = torch.tensor([1.0, -1.0, -1.0])
    w, conflict, n = conflict_weights(ids, mask, adv)
    assert w[0].tolist() == [2, 2, 2, 0] and w[1].tolist() == [0, 0, 0, 0]
    assert n.tolist() == [3, 3, 4]
    wp, cp, npr = conflict_weights(ids, mask, adv, Objective(conflict_combine="product"))
    # released code (Listing 2): mask_fwd * mask_bw -> 2 * 2 = 4 where both spans cover
    assert wp[0].tolist() == [4, 4, 4, 0]
    assert torch.equal(cp, conflict) and torch.equal(npr, n)
    # row 2 = [1,2,3,3]: fwd span 1,2,3 (pos 0..2); bwd span from the end 3,2,1?  its last
    # three from the end are 3,3,2 vs row0's 3,2,1 -> only the last 3 matches.
    assert w[2].tolist() == [0, 0, 0, 0]


def test_zero_advantage_rows_neither_have_nor_cause_conflicts():
    rows = [[1, 2, 3], [1, 2, 3], [1, 9, 9]]
    ids, mask = pad(rows)
    # row 1 has A = 0: it shares everything with the positive row but is inactive
    w, conflict, n = conflict_weights(ids, mask, torch.tensor([1.0, 0.0, -1.0]))
    assert w.tolist() == [[2, 1, 1], [1, 1, 1], [0, 1, 1]]
    assert n.tolist() == [1, 0, 1]
    # a zero row identical to the negative row does not make the positive row conflict
    rows = [[1, 2, 3], [4, 5, 6], [1, 2, 3]]
    ids, mask = pad(rows)
    w, _, n = conflict_weights(ids, mask, torch.tensor([1.0, -1.0, 0.0]))
    assert torch.equal(w, mask.float()) and n.tolist() == [0, 0, 0]


def test_same_sign_groups_have_no_conflicts():
    rows = [[1, 2, 3], [1, 2], [1, 2, 3, 4]]
    ids, mask = pad(rows)
    for adv in ([1.0, 2.0, 0.5], [-1.0, -1.0, -3.0], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0]):
        w, conflict, n = conflict_weights(ids, mask, torch.tensor(adv))
        assert torch.equal(w, mask.float()) and not conflict.any() and n.sum() == 0


def test_padding_garbage_and_mask_dtypes_do_not_matter():
    rows = [[1, 2, 3, 4], [1, 2], [1, 5, 4]]
    ids, mask = pad(rows)
    adv = torch.tensor([1.0, -1.0, -0.5])
    ref = conflict_weights(ids, mask, adv)
    noisy = ids.clone()
    noisy[~mask] = torch.randint(0, 6, (int((~mask).sum()),))
    for m in (mask, mask.long(), mask.float(), mask.int()):
        out = conflict_weights(noisy, m, adv)
        assert all(torch.equal(a, b) for a, b in zip(ref, out))
    assert (ref[0][~mask] == 0).all()


def test_non_right_padded_mask_is_rejected():
    ids = torch.tensor([[1, 2, 3], [1, 2, 3]])
    mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    with pytest.raises(ValueError, match="right-padded"):
        conflict_weights(ids, mask, torch.tensor([1.0, -1.0]))


@pytest.mark.parametrize("vocab", [2, 3, 5])
def test_conflict_weights_match_brute_force(vocab):
    rng = random.Random(vocab)
    for trial in range(150):
        G = rng.randint(2, 7)
        prefix = [rng.randrange(vocab) for _ in range(rng.randint(0, 3))]
        suffix = [rng.randrange(vocab) for _ in range(rng.randint(0, 3))]
        rows = [prefix + [rng.randrange(vocab) for _ in range(rng.randint(0, 6))] + suffix for _ in range(G)]
        rows = [r if r else [rng.randrange(vocab)] for r in rows]
        adv = [rng.choice([-1.5, -0.2, 0.0, 0.3, 1.0]) for _ in range(G)]
        pw = rng.choice([2.0, 3.0])
        ids, mask = pad(rows, fill=rng.randrange(vocab))
        w, conflict, n = conflict_weights(ids, mask, torch.tensor(adv), Objective(conflict_weight=pw))
        bw, bconf = brute_weights(rows, adv, conflict_weight=pw)
        assert torch.equal(w, bw), (rows, adv)
        for i, m in enumerate(bconf):
            assert conflict[i, :len(m)].tolist() == m and not conflict[i, len(m):].any()
            assert n[i].item() == sum(m)


def test_batch_conflict_weights_is_per_group():
    rows = [[1, 2], [1, 3], [1, 2], [1, 3]]
    ids, mask = pad(rows)
    adv = torch.tensor([1.0, -1.0, 1.0, 0.0])                        # group 2 has no negative
    w, conflict, n = batch_conflict_weights(ids, mask, adv, 2)
    assert w.tolist() == [[2, 1], [0, 1], [1, 1], [1, 1]]
    assert n.tolist() == [1, 1, 0, 0]


# -----------------------------------------------------------------------------
# entropy, the filter delta_i and the entropy term (Sec. 4.2, Eq. 6-7)

def test_token_entropy_against_float64():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 7, 1000, generator=g) * 6
    h = token_entropy(logits)
    p = torch.softmax(logits.double(), -1)
    ref = -(p * torch.log(p)).sum(-1)
    assert h.dtype == torch.float32 and h.shape == (3, 7)
    assert (h.double() - ref).abs().max() < 1e-4
    # bf16 input is handled in float32
    hb = token_entropy(logits.bfloat16())
    pb = torch.softmax(logits.bfloat16().double(), -1)
    assert (hb.double() + (pb * torch.log(pb)).sum(-1)).abs().max() < 1e-4


def test_token_entropy_edge_cases():
    V = 50
    assert torch.allclose(token_entropy(torch.zeros(V)), torch.tensor(math.log(V)))
    onehot = torch.full((V,), float("-inf"))
    onehot[3] = 0.0
    assert token_entropy(onehot).item() == 0.0                       # -inf logits: no NaN
    two = torch.full((V,), float("-inf"))
    two[[1, 2]] = 5.0
    assert abs(token_entropy(two).item() - math.log(2)) < 1e-6
    huge = torch.tensor([1e4, 1e4 - 1.0, -1e4])
    p = torch.softmax(huge.double(), 0)
    ref = -(p[:2] * p[:2].log()).sum()
    assert abs(token_entropy(huge).item() - ref.item()) < 1e-5


def test_released_advantages_modes():
    A = torch.tensor([1.0, -1.0, 0.5, -0.5, 0.0])
    H = torch.tensor([0.2, 0.9, 1.5, 0.3, 0.8])
    thr, gam = math.log(2), 0.1
    shaped = A - gam * H
    out = released_advantages(A, H, thr, gam, "all")
    assert torch.allclose(out, torch.tensor([shaped[0], 0.0, 0.0, shaped[3], 0.0]))
    out = released_advantages(A, H, thr, gam, "neg")                        # only A<0 rows are filtered
    assert torch.allclose(out, torch.tensor([shaped[0], 0.0, shaped[2], shaped[3], shaped[4]]))
    assert torch.allclose(released_advantages(A, H, thr, gam, "off"), shaped)
    # <H>_i == threshold is kept (delta_i = 1 iff <H>_i <= ln 2, Eq. 6)
    assert released_advantages(torch.tensor([1.0]), torch.tensor([thr]), thr, 0.0, "all").item() == 1.0
    with pytest.raises(ValueError):
        released_advantages(A, H, thr, gam, "sometimes")


def test_filter_deltas_are_eq6s_zeros_and_ones():
    """delta_i = 0 where <H>_i is above the threshold ("neg": and A_i < 0), 1 elsewhere and == the threshold;
    "off" keeps every completion; an unknown mode is refused."""
    A = torch.tensor([1.0, -1.0, 0.5, -0.5, 0.0])
    H = torch.tensor([0.2, 0.9, 1.5, math.log(2), 0.8])
    assert gtpo.filter_deltas(A, H, math.log(2), "all").tolist() == [1.0, 0.0, 0.0, 1.0, 0.0]
    assert gtpo.filter_deltas(A, H, math.log(2), "neg").tolist() == [1.0, 0.0, 1.0, 1.0, 1.0]
    assert gtpo.filter_deltas(A, H, math.log(2), "off").tolist() == [1.0] * 5
    with pytest.raises(ValueError, match="entropy filter mode"):
        gtpo.filter_deltas(A, H, 0.7, "sometimes")


def test_filtered_stats_counts_only_what_the_filter_removed():
    A = torch.tensor([1.0, -1.0, 0.5, -0.5, 0.0])
    H = torch.tensor([0.2, 0.9, 1.5, 0.3, 0.8])
    objective = Objective(entropy_term="released", ent_gamma=0.1)
    # "all": rows 1 and 2 lose their advantage; row 4 (A = 0, H > ln 2) had nothing to lose
    frac, h = gtpo.filtered_stats(A, gtpo.filter_deltas(A, H, math.log(2), "all"), H, objective)
    assert frac == pytest.approx(2 / 5) and h == pytest.approx((0.9 + 1.5) / 2)
    frac, h = gtpo.filtered_stats(A, gtpo.filter_deltas(A, H, math.log(2), "neg"), H, objective)
    assert frac == pytest.approx(1 / 5) and h == pytest.approx(0.9)
    assert gtpo.filtered_stats(A, gtpo.filter_deltas(A, H, 2.0, "all"), H, objective) == (0.0, 0.0)


def test_filtered_frac_and_entropy_count_a_scaling_deltas_share():
    """A delta_i that scales (a variant's soft filter) instead of zeroing: filtered_frac is the sum of 1 - delta_i
    over completions with A_i != 0, over N; filtered_entropy their <H>_i weighted by it. Hand-computed, for the
    eq7 form (delta_i A_i) and the released one (delta_i (A_i - gamma <H>_i)); Eq. 6's 0/1 delta_i gives the count."""
    A = torch.tensor([1.0, -1.0, 2.0, 0.0, -0.5])
    H = torch.tensor([0.2, 0.9, 1.5, 0.8, 0.4])
    delta = torch.tensor([0.5, 1.0, 0.0, 0.25, 0.75])                  # row 3 has A = 0: nothing to remove
    for objective in (Objective(entropy_term="eq7"), Objective(entropy_term="released", ent_gamma=0.1)):
        frac, h = gtpo.filtered_stats(A, delta, H, objective)
        assert frac == pytest.approx((0.5 + 0.0 + 1.0 + 0.25) / 5)
        assert h == pytest.approx((0.5 * 0.2 + 1.0 * 1.5 + 0.25 * 0.4) / 1.75)
        hard = (delta > 0.6).float()                                    # rows 0 and 2 zeroed (3 has A = 0)
        assert gtpo.filtered_stats(A, hard, H, objective) == pytest.approx((2 / 5, (0.2 + 1.5) / 2))


def test_eq7_advantages_modes_drop_the_advantage_only():
    """Eq. 6 as written: delta_i * A_i; gamma does not enter the advantage (Eq. 7's term is the loss's)."""
    A = torch.tensor([1.0, -1.0, 0.5, -0.5, 0.0])
    H = torch.tensor([0.2, 0.9, 1.5, 0.3, 0.8], requires_grad=True)
    assert torch.equal(eq7_advantages(A, H, math.log(2), "all"), torch.tensor([1.0, 0.0, 0.0, -0.5, 0.0]))
    assert torch.equal(eq7_advantages(A, H, math.log(2), "neg"), torch.tensor([1.0, 0.0, 0.5, -0.5, 0.0]))
    assert torch.equal(eq7_advantages(A, H, math.log(2), "off"), A)
    assert eq7_advantages(torch.tensor([1.0]), torch.tensor([0.7]), 0.7, "all").item() == 1.0   # == is kept
    assert not eq7_advantages(A, H, math.log(2), "all").requires_grad
    with pytest.raises(ValueError):
        eq7_advantages(A, H, 0.7, "sometimes")


def test_gtpo_loss_entropy_term_of_every_completion_with_its_gradient():
    """Eq. 7: loss = -(1/N) sum_i [delta_i A_i (1/|o_i|) sum_t lambda ratio - gamma <H>_i]; the entropy term
    stays for a filtered completion, and d loss / d <H>_i = gamma / N."""
    logp, mask, adv, w, lengths = _fixture()
    H = torch.tensor([0.2, 0.9, 1.5, 0.3], requires_grad=True)
    a = eq7_advantages(adv, H, 0.7, "all")                          # rows 1 and 2 filtered
    loss, _ = gtpo_loss(logp, mask, token_advantages(w, None, a), Objective(ent_gamma=0.1), entropy=H)
    N = len(adv)
    adv_term = -sum((w[i, :lengths[i]] * a[i]).sum() / lengths[i] for i in range(N)) / N
    assert loss.item() == pytest.approx((adv_term + 0.1 * H.sum() / N).item(), abs=1e-6)
    loss.backward()
    torch.testing.assert_close(H.grad, torch.full((N,), 0.1 / N))
    assert logp.grad[1].abs().sum() == 0 and logp.grad[0].abs().sum() > 0     # filtered rows: no log-prob term


def test_released_form_gives_no_gradient_when_all_are_filtered_eq7_does():
    """Every completion above the threshold: the released form zeroes the penalty with the advantage (no
    gradient at all); Eq. 7 keeps gamma <H>_i for each."""
    logp, mask, adv, w, _ = _fixture()
    H = torch.tensor([1.2, 0.9, 1.5, 0.8], requires_grad=True)
    released, _ = gtpo_loss(logp, mask, token_advantages(w, None, released_advantages(adv, H, 0.0, 0.1, "all")))
    released.backward()
    assert released.item() == 0 and logp.grad.abs().sum() == 0 and H.grad is None
    logp.grad = None
    eq7, _ = gtpo_loss(logp, mask, token_advantages(w, None, eq7_advantages(adv, H, 0.0, "all")),
                       Objective(ent_gamma=0.1), entropy=H)
    eq7.backward()
    assert logp.grad.abs().sum() == 0 and (H.grad > 0).all()
    assert eq7.item() == pytest.approx(0.1 * H.mean().item())


def test_gamma_zero_and_no_filter_make_both_forms_the_same():
    logp, mask, adv, w, _ = _fixture()
    H = torch.tensor([1.2, 0.9, 1.5, 0.8])
    a, b = released_advantages(adv, H, 0.7, 0.0, "off"), eq7_advantages(adv, H, 0.7, "off")
    assert torch.equal(a, b)
    assert torch.equal(gtpo_loss(logp, mask, token_advantages(w, None, a))[0],
                       gtpo_loss(logp, mask, token_advantages(w, None, b), Objective(ent_gamma=0.0), entropy=H)[0])


def test_entropy_gate_does_not_backprop_through_entropy():
    H = torch.tensor([0.2, 0.3], requires_grad=True)
    out = released_advantages(torch.tensor([1.0, -1.0]), H, 0.7, 0.1, "all")
    assert not out.requires_grad


# -----------------------------------------------------------------------------
# GTPO loss (Eq. 20, 22)

def _fixture(N=4, L=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(N, L, generator=g) * 3).requires_grad_()
    lengths = torch.tensor([6, 3, 5, 1])[:N]
    mask = torch.arange(L).unsqueeze(0) < lengths.unsqueeze(1)
    adv = torch.tensor([1.2, -0.7, 0.4, -0.9])[:N]
    weights = torch.tensor([[2, 2, 1, 1, 1, 2], [0, 1, 1, 0, 0, 0], [2, 1, 1, 1, 1, 0], [1, 0, 0, 0, 0, 0]],
                           dtype=torch.float32)[:N]
    return logp, mask, adv, weights, lengths


def test_gtpo_loss_value_and_gradient_eq22():
    logp, mask, adv, w, lengths = _fixture()
    loss, metrics = gtpo_loss(logp, mask, token_advantages(w, None, adv))
    N = len(adv)
    expect = -sum((w[i, :lengths[i]] * adv[i]).sum() / lengths[i] for i in range(N)) / N
    assert torch.allclose(loss, expect)
    loss.backward()
    # Eq. 22: d/dlogp_{i,t} of -J* = -(1/G) A_i lambda_{i,t} / |o_i| on real tokens, 0 on padding
    grad = -(adv.unsqueeze(1) * w * mask) / lengths.unsqueeze(1) / N
    assert torch.allclose(logp.grad, grad)
    assert metrics["loss"].item() == pytest.approx(loss.item())


def test_gtpo_gradient_through_logits_matches_eq22_sum_of_g():
    # tiny "policy": free logits (N, L, V); g_{i,t} = grad of log pi(o_{i,t}) w.r.t. the logits
    torch.manual_seed(1)
    N, L, V = 3, 4, 5
    logits = torch.randn(N, L, V, requires_grad=True)
    ids = torch.randint(0, V, (N, L))
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]], dtype=torch.bool)
    adv = torch.tensor([0.8, -1.1, 0.3])
    w = torch.tensor([[2, 1, 1, 2], [0, 1, 0, 0], [2, 1, 1, 0]], dtype=torch.float32)
    loss, _ = gtpo_loss(token_logprobs(logits, ids), mask, token_advantages(w, None, adv))
    (grad,) = torch.autograd.grad(loss, logits)
    expect = torch.zeros_like(logits)
    for i in range(N):
        n_i = int(mask[i].sum())
        for t in range(n_i):
            (g_it,) = torch.autograd.grad(token_logprobs(logits[i, t], ids[i, t]), logits)
            expect -= adv[i] * w[i, t] / n_i * g_it / N              # minus: the loss is -J*
    assert torch.allclose(grad, expect, atol=1e-6)


def test_gtpo_loss_conflict_count_normalisation():
    logp, mask, adv, w, lengths = _fixture()
    n_conf = torch.tensor([3, 0, 1, 2])
    loss, _ = gtpo_loss(logp, mask, token_advantages(w, n_conf, adv, Objective(conflict_norm=True)))
    per = [-(w[i, :lengths[i]] * adv[i]).sum() / lengths[i] / max(int(n_conf[i]), 1) for i in range(4)]
    assert torch.allclose(loss, torch.stack(per).mean())


def test_gtpo_with_unit_weights_equals_grpo_beta0():
    logp, mask, adv, _, _ = _fixture()
    ones = mask.float()
    l1, _ = gtpo_loss(logp, mask, token_advantages(ones, None, adv))
    (g1,) = torch.autograd.grad(l1, logp)
    l2, _ = grpo_loss(logp, None, None, mask, adv, Objective(beta=0.0))
    (g2,) = torch.autograd.grad(l2, logp)
    assert torch.allclose(l1, l2) and torch.allclose(g1, g2)


def test_gtpo_degenerate_inputs_no_nan():
    logp = torch.zeros(3, 4, requires_grad=True)
    mask = torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0], [1, 0, 0, 0]])  # one empty completion
    adv = group_advantages(torch.tensor([5.0, 5.0, 5.0]), 3)         # all-equal rewards
    loss, _ = gtpo_loss(logp, mask, token_advantages(mask.float(), None, adv))
    loss.backward()
    assert loss.item() == 0.0 and torch.isfinite(logp.grad).all() and (logp.grad == 0).all()


# -----------------------------------------------------------------------------
# GRPO loss (Eq. 1)

def test_grpo_clip_active_and_inactive():
    eps = 0.2
    logp = torch.log(torch.tensor([[1.5, 0.7, 1.1]])).requires_grad_()   # old = 0 -> ratio 1.5, .7, 1.1
    old = torch.zeros(1, 3)
    mask = torch.ones(1, 3)
    # A > 0: ratio 1.5 clipped to 1.2 (active, no grad); 0.7 (the lower clip never binds
    # for A > 0) and 1.1 unclipped
    loss, m = grpo_loss(logp, old, None, mask, torch.tensor([2.0]), Objective(clip_eps=eps))
    assert loss.item() == pytest.approx(-(1.2 * 2 + 0.7 * 2 + 1.1 * 2) / 3)
    (g,) = torch.autograd.grad(loss, logp)
    # d(-r A)/dlogp = -r A / 3 where unclipped, 0 where clipped
    assert torch.allclose(g, torch.tensor([[0.0, -0.7 * 2 / 3, -1.1 * 2 / 3]]))
    assert m["clip_ratio/region_mean"].item() == pytest.approx(1 / 3)
    # A < 0: min(r A, clip(r) A): 1.5 stays (-3 < -2.4), 0.7 clipped to 0.8 (no grad), 1.1 inside
    loss, m = grpo_loss(logp, old, None, mask, torch.tensor([-2.0]), Objective(clip_eps=eps))
    assert loss.item() == pytest.approx(-(-1.5 * 2 - 0.8 * 2 - 1.1 * 2) / 3)
    (g,) = torch.autograd.grad(loss, logp)
    assert torch.allclose(g, torch.tensor([[1.5 * 2 / 3, 0.0, 1.1 * 2 / 3]]))
    assert m["clip_ratio/region_mean"].item() == pytest.approx(1 / 3)


def test_grpo_kl_k3_value_and_gradient():
    logp = torch.tensor([[-1.0, -2.0, -0.5, -9.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0, -0.5, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    beta = 0.04
    loss, m = grpo_loss(logp, None, ref, mask, torch.tensor([0.0]), Objective(beta=beta))
    d = (ref - logp.detach())[0, :3]
    kl = torch.exp(d) - d - 1
    assert m["kl"].item() == pytest.approx(kl.mean().item())
    assert loss.item() == pytest.approx(beta * kl.mean().item())
    (g,) = torch.autograd.grad(loss, logp)
    # d/dlogp [exp(ref-logp) - (ref-logp) - 1] = 1 - exp(ref - logp)
    expect = torch.zeros(1, 4)
    expect[0, :3] = beta * (1 - torch.exp(d)) / 3
    assert torch.allclose(g, expect, atol=1e-7)
    # beta = 0 keeps the KL for monitoring but not in the loss
    loss0, m0 = grpo_loss(logp, None, ref, mask, torch.tensor([0.0]), Objective(beta=0.0))
    assert loss0.item() == 0.0 and m0["kl"].item() == pytest.approx(m["kl"].item())


def test_grpo_per_sequence_then_batch_mean():
    logp = torch.zeros(2, 3, requires_grad=True)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    loss, _ = grpo_loss(logp, None, None, mask, torch.tensor([1.0, -1.0]))
    (g,) = torch.autograd.grad(loss, logp)
    assert loss.item() == 0.0
    assert torch.allclose(g, torch.tensor([[-1 / 6, -1 / 6, -1 / 6], [0.5, 0.0, 0.0]]))


def test_masked_mean_and_token_logprobs():
    x = torch.tensor([[1.0, 2.0, 100.0], [3.0, 5.0, 7.0]])
    m = torch.tensor([[1, 1, 0], [0, 0, 0]])
    assert masked_mean(x, m).item() == 1.5
    assert masked_mean(x, m, dim=1).tolist() == [1.5, 0.0]
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 11, generator=g)
    ids = torch.randint(0, 11, (2, 3), generator=g)
    ref = torch.log_softmax(logits.double(), -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(token_logprobs(logits, ids).double(), ref, atol=1e-6)


def test_vectorised_conflict_spans_equal_the_token_by_token_definition():
    """conflict_spans (pairwise, vectorised) == conflict_spans_loop (Sec. 5.1 one token at a time)
    on 300 random groups: small vocabularies so spans are long, ragged lengths, empty rows, A = 0."""
    g = torch.Generator().manual_seed(5)
    hits = 0
    for _ in range(300):
        G, L = int(torch.randint(2, 7, (1,), generator=g)), int(torch.randint(1, 10, (1,), generator=g))
        ids = torch.randint(0, 3, (G, L), generator=g)
        n = torch.randint(0, L + 1, (G,), generator=g)
        mask = (torch.arange(L)[None] < n[:, None]).long()
        adv = torch.randint(-1, 2, (G,), generator=g).float()
        fast, slow = gtpo.conflict_spans(ids, mask, adv), gtpo.conflict_spans_loop(ids, mask, adv)
        assert torch.equal(fast[0], slow[0]) and torch.equal(fast[1], slow[1]), (ids, mask, adv)
        hits += int(slow[0].any() or slow[1].any())
    assert hits > 100                                               # the cases are not all empty


def test_kl_k3_on_the_policys_own_samples_estimates_kl_to_the_reference_not_the_reverse():
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([0.97, 0.01, 0.01, 0.01])                         # the policy, peaked
    q = torch.tensor([0.25, 0.25, 0.25, 0.25])                         # the reference
    tokens = torch.multinomial(p, 200_000, replacement=True, generator=g).view(400, 500)   # (N, L) from p
    mask = torch.ones(tokens.shape)
    mask[:, 450:] = 0                                                  # padding is left out
    got = float(masked_mean(kl_k3(p.log()[tokens], q.log()[tokens]), mask))
    kl_pq, kl_qp = float((p * (p / q).log()).sum()), float((q * (q / p).log()).sum())
    assert abs(got - kl_pq) < 0.03 and kl_qp - kl_pq > 0.8             # 1.22 vs 2.08 nats
    assert float(masked_mean(kl_k3(p.log()[tokens], p.log()[tokens]), mask)) == 0.0


# -----------------------------------------------------------------------------
# aggregation: how per-token terms become the loss (grpo = Eq. 7's normalisation, dapo, dr_grpo, bnpo, luspo)

def _terms():
    """Two completions of 3 and 1 real tokens (padding carries garbage), per-token terms and own terms."""
    per_token = torch.tensor([[1.0, 2.0, 3.0, 99.0], [4.0, 99.0, 99.0, 99.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    return per_token, mask, torch.tensor([0.5, -1.0])


def test_aggregate_hand_computed_for_each_loss_type():
    per_token, mask, s = _terms()
    T = gtpo.Totals(completions=2, tokens=4, max_length=4)
    assert gtpo.aggregate(per_token, mask, "grpo").item() == pytest.approx((6 / 3 + 4 / 1) / 2)
    assert gtpo.aggregate(per_token, mask, "dapo").item() == pytest.approx(10 / 4)
    assert gtpo.aggregate(per_token, mask, "dr_grpo", totals=T).item() == pytest.approx(10 / (2 * 4))
    assert gtpo.aggregate(per_token, mask, "bnpo").item() == pytest.approx(10 / 4)
    assert gtpo.aggregate(per_token, mask, "luspo").item() == pytest.approx((6 + 4) / 2)
    # s_i is the value s_i on each of the completion's tokens: once per completion in grpo, |o_i| times otherwise
    assert gtpo.aggregate(per_token, mask, "grpo", s).item() == pytest.approx((6 / 3 + 0.5 + 4 / 1 - 1.0) / 2)
    assert gtpo.aggregate(per_token, mask, "dapo", s).item() == pytest.approx((10 + 3 * 0.5 - 1.0) / 4)
    assert gtpo.aggregate(per_token, mask, "luspo", s).item() == pytest.approx((6 + 3 * 0.5 + 4 - 1.0) / 2)
    for loss_type in gtpo.LOSS_TYPES:
        spread = gtpo.aggregate(per_token + s.unsqueeze(1), mask, loss_type, totals=T)
        assert gtpo.aggregate(per_token, mask, loss_type, s, totals=T).item() == pytest.approx(spread.item())
    with pytest.raises(ValueError, match="loss_type must be one of grpo, dapo, dr_grpo, bnpo, luspo"):
        gtpo.aggregate(per_token, mask, "cispo")


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo", "luspo"])
def test_aggregate_shares_add_up_over_micro_batches_and_average_over_ranks(loss_type):
    """Cut into micro-batches with the step's totals, the shares add up to the whole batch's loss and
    gradient; cut into 2 ranks (tokens = the ranks' mean count), DDP's average of the ranks' gradients is
    the whole batch's. Without the totals, token-level micro-batches would give another loss."""
    g = torch.Generator().manual_seed(0)
    logp = torch.randn(6, 5, generator=g, requires_grad=True)
    mask = (torch.arange(5)[None] < torch.tensor([5, 1, 3, 2, 5, 4])[:, None]).long()
    s = torch.randn(6, generator=g)

    def loss(rows, totals):
        return gtpo.aggregate(logp[rows] ** 2, mask[rows], loss_type, s[rows], totals)

    whole = loss(slice(0, 6), gtpo.Totals(6, float(mask.sum()), 5))
    (g_whole,) = torch.autograd.grad(whole, logp)
    steps = gtpo.Totals(6, float(mask.sum()), 5)
    parts = [loss(slice(a, a + 2), steps) for a in (0, 2, 4)]
    (g_parts,) = torch.autograd.grad(sum(parts), logp)
    assert sum(parts).item() == pytest.approx(whole.item(), rel=1e-6)
    torch.testing.assert_close(g_parts, g_whole)
    ranks = gtpo.Totals(3, float(mask.sum()) / 2, 5)                    # each rank's N; tokens averaged
    per_rank = [loss(slice(a, a + 3), ranks) for a in (0, 3)]
    (g_ranks,) = torch.autograd.grad(sum(per_rank) / 2, logp)            # DDP: the mean of the ranks' gradients
    torch.testing.assert_close(g_ranks, g_whole)
    if loss_type == "dapo":                                             # each micro-batch's own token count
        alone = sum(loss(slice(a, a + 2), None) * 2 / 6 for a in (0, 2, 4))
        assert alone.item() != pytest.approx(whole.item(), rel=1e-3)


def test_losses_aggregate_through_the_one_function():
    """gtpo_loss and grpo_loss with a loss type equal aggregate of their per-token terms: the conflict count
    divides each token's term, +gamma <H>_i is a completion's own term."""
    logp, mask, adv, w, lengths = _fixture()
    n_conf, h = torch.tensor([3, 0, 1, 2]), torch.tensor([0.3, 0.6, 0.1, 0.9])
    per_token = -adv.unsqueeze(1) * w / n_conf.clamp(min=1).unsqueeze(1)
    T = gtpo.Totals(4, float(mask.sum()), 8)
    for loss_type in gtpo.LOSS_TYPES:
        objective = Objective(conflict_norm=True, ent_gamma=0.1, loss_type=loss_type)
        loss, _ = gtpo_loss(logp, mask, token_advantages(w, n_conf, adv, objective), objective, entropy=h, totals=T)
        want = gtpo.aggregate(per_token, mask, loss_type, 0.1 * h, T)
        assert loss.item() == pytest.approx(want.item(), rel=1e-6)
        loss, _ = grpo_loss(logp, None, None, mask, adv, objective, entropy=h, totals=T)
        want = gtpo.aggregate(-adv.unsqueeze(1).expand_as(logp), mask, loss_type, 0.1 * h, T)
        assert loss.item() == pytest.approx(want.item(), rel=1e-6)
