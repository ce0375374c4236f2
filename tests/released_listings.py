"""The authors' GTPO loss, transcribed from the paper's Listings 2 and 3 (App. 16), as closely as runs.

What is not copied, and why:
  * the prints, wandb and `torch.compile` (no effect on the numbers);
  * the module constants PAD_ID, W_RAW, ENT_THRESHOLD and ENT_SCALE are arguments (the released trainer
    patches them into the module); their released values are the defaults;
  * Listing 2 lines 50-52 and 77-79 print `torch.ones(), device=device` as the "else" of a torch.where: read
    as the scalar 1.0 it must be (the mask's "1 elsewhere");
  * `std_reward`, a free name in Listing 3's compute_loss (line 120), is None here: gtpo_compute_loss keeps it
    "for API symmetry" and never reads it;
  * backward returns one gradient per forward input; the listing's `(None,) * 12` is refused by autograd;
  * `compute_completion_stats` is "a helper (not shown)": written from the released trainer's description, the
    completion's mean token entropy of the new logits with `log(p.clamp_min(1e-6))`, and the mean k3 KL.
tests/test_released_code.py holds the project's `--released_code` step equal to this.
"""
import torch

PAD_ID, W_RAW, ENT_THRESHOLD, ENT_SCALE = 0, 2.0, 0.7, 0.1      # the released values (App. 12, 16)


def build_conflict_mask(ids, mask, pos_flags, neg_flags, vocab_size, PAD_ID=PAD_ID, W_RAW=W_RAW):
    """Listing 2, line for line: (final_mask (G, L), total_conflict (G, L), n_conflict_seq (G,))."""
    G, L = ids.shape
    device = ids.device

    active_flags = pos_flags | neg_flags
    active_idx = active_flags.nonzero(as_tuple=True)[0]
    G_act = active_idx.numel()

    if G_act == 0:
        mask_default = mask.float()
        conflict_zero = torch.zeros_like(mask, dtype=torch.float)
        seq_count_zero = torch.zeros(G, dtype=torch.long, device=device)
        return mask_default, conflict_zero, seq_count_zero

    ids_use = ids[active_idx]
    mask_use = mask[active_idx]
    pos_use = pos_flags[active_idx]
    neg_use = neg_flags[active_idx]

    step_idx = torch.arange(L, device=device).unsqueeze(0)
    keys = (step_idx * vocab_size + ids_use).view(-1)

    rpt_pos = pos_use.repeat_interleave(L)
    rpt_neg = neg_use.repeat_interleave(L)

    freq_pos = torch.bincount(keys[rpt_pos], minlength=vocab_size * L).clamp_max(1)
    freq_neg = torch.bincount(keys[rpt_neg], minlength=vocab_size * L).clamp_max(1)

    conflict_raw = (freq_pos.bool() & freq_neg.bool())[keys].view(G_act, L)

    valid_mask = (ids_use != PAD_ID)
    initial_run = torch.cumprod(conflict_raw.to(torch.int), dim=1).bool()
    conflict_fwd = initial_run & valid_mask

    w_conf_fwd = torch.where(conflict_fwd,
                             torch.tensor(W_RAW, device=device),
                             torch.tensor(1.0, device=device))
    mask_fwd = torch.where(
        ~conflict_fwd,
        1.0,
        torch.where(pos_use.unsqueeze(1), w_conf_fwd, 0.0),
    ) * mask_use

    seq_len = mask_use.sum(-1)
    pad_len = L - seq_len

    ids_flip = ids_use.flip(-1)
    idx_shift = (step_idx + pad_len.unsqueeze(1)) % L
    ids_rev = ids_flip.gather(1, idx_shift)

    step_rev = torch.arange(L, device=device).flip(0).unsqueeze(0)
    keys_rev = (step_rev * vocab_size + ids_rev).view(-1)

    freq_pos_r = torch.bincount(keys_rev[rpt_pos], minlength=vocab_size * L).clamp_max(1)
    freq_neg_r = torch.bincount(keys_rev[rpt_neg], minlength=vocab_size * L).clamp_max(1)

    conflict_raw_rev = (freq_pos_r.bool() & freq_neg_r.bool())[keys_rev].view(G_act, L)

    initial_run_rev = torch.cumprod(conflict_raw_rev.to(torch.int), dim=1).bool()
    conflict_rev = initial_run_rev & valid_mask

    w_conf_rev = torch.where(conflict_rev,
                             torch.tensor(W_RAW, device=device),
                             torch.tensor(1.0, device=device))
    mask_bw_rev = torch.where(
        ~conflict_rev,
        1.0,
        torch.where(pos_use.unsqueeze(1), w_conf_rev, 0.0),
    )

    idx_unshift = (step_idx - pad_len.unsqueeze(1)) % L
    mask_bw_rot = mask_bw_rev.gather(1, idx_unshift)
    mask_bw_use = mask_bw_rot.flip(-1) * mask_use

    final_mask_use = mask_fwd * mask_bw_use
    total_conflict_use = (conflict_fwd | conflict_rev) & mask_use.bool()
    n_conflict_seq_use = total_conflict_use.sum(-1).long().clamp_min(1)

    final_mask = mask.float().clone()
    total_conflict = torch.zeros_like(mask, dtype=torch.float)
    n_conflict_seq = torch.zeros(G, dtype=torch.long, device=device)

    final_mask[active_idx] = final_mask_use
    total_conflict[active_idx] = total_conflict_use.float()
    n_conflict_seq[active_idx] = n_conflict_seq_use

    return final_mask, total_conflict, n_conflict_seq


def compute_completion_stats(old_logits, new_logits, ids, mask):
    """(mean token entropy of new_logits, mean k3 KL old -> new) over the completion's valid tokens."""
    mask_f = mask.float()
    n_tok = mask_f.sum().clamp(min=1.0)
    p = torch.softmax(new_logits, dim=-1)
    ent = -(p * torch.log(p.clamp_min(1e-6))).sum(-1)
    idx = ids.unsqueeze(-1)
    new_logp = new_logits.gather(-1, idx).squeeze(-1) - torch.logsumexp(new_logits, dim=-1)
    old_logp = old_logits.gather(-1, idx).squeeze(-1) - torch.logsumexp(old_logits, dim=-1)
    kl = torch.exp(old_logp - new_logp) - (old_logp - new_logp) - 1.0
    return (ent * mask_f).sum() / n_tok, (kl * mask_f).sum() / n_tok


def gtpo_compute_loss(old_logits, new_logits, input_ids, mask, delta, beta, advantages, rewards, std_reward,
                      conf_mask, n_conflict):
    """Listing 3, lines 1-33."""
    mask_f = mask.float(); n_tok = mask_f.sum().clamp(min=1.0)

    idx = input_ids.unsqueeze(-1)
    new_logp = new_logits.gather(-1, idx).squeeze(-1) - torch.logsumexp(new_logits, dim=-1)
    ratio = torch.exp(new_logp - new_logp.detach())  # value 1, carries grad

    adv = advantages.squeeze()
    loss_token = -(ratio * adv * delta)
    loss_disp = (loss_token * mask_f).sum() / n_tok

    with torch.no_grad():
        old_logp = old_logits.gather(-1, idx).squeeze(-1) - torch.logsumexp(old_logits, dim=-1)
        kl = torch.exp(old_logp - new_logp.detach()) - (old_logp - new_logp.detach()) - 1.0
        mean_kl = (kl * mask_f).sum() / n_tok

    loss = (loss_disp / n_conflict.clamp(min=1)).mean()
    return loss, n_tok, mean_kl


class UnslothEfficientGTPO(torch.autograd.Function):
    """Listing 3, lines 35-154: forward computes every completion's loss and its gradient w.r.t. the new
    hidden states (B, G, L + 1, H); backward hands that gradient back, whatever grad_out is."""

    @staticmethod
    def forward(ctx, _new_hidden_states, _old_hidden_states, lm_head, comp_ids, comp_mask, advantages, rewards,
                beta, scaler=None, n_chunks=1, PAD_ID=PAD_ID, W_RAW=W_RAW, ENT_THRESHOLD=ENT_THRESHOLD,
                ENT_SCALE=ENT_SCALE):
        device = _new_hidden_states.device
        B, G, Lfull, H = _new_hidden_states.shape
        L = Lfull - 1
        vocab_size = lm_head.size(0)
        lm_w = lm_head.t()
        std_reward = None

        if rewards.dim() == 1:
            rewards = rewards.unsqueeze(0).expand(B, -1)
        rewards = rewards.to(device)

        # Compute entropy and KL per completion
        entropies = torch.zeros((B, G), device=device)
        for b in range(B):
            for g in range(G):
                new_h = _new_hidden_states[b, g]
                old_h = _old_hidden_states[b, g]
                ids = comp_ids[b, g]
                msk = comp_mask[b, g]
                e, _ = compute_completion_stats(
                    torch.matmul(old_h, lm_w)[: -1], torch.matmul(new_h, lm_w)[: -1], ids,
                    msk
                )
                entropies[b, g] = e

        # Adjust advantages using entropy
        low_ent = entropies <= ENT_THRESHOLD

        # Build delta/conflict masks
        delta_masks = torch.zeros_like(comp_mask, dtype=torch.float32)
        conflict_masks = torch.zeros_like(comp_mask, dtype=torch.float32)
        n_conflict_seq = torch.zeros((B, G), dtype=torch.long, device=device)

        for b in range(B):
            pos_flags = advantages[b] > 0
            neg_flags = advantages[b] < 0  # exclude adv == 0

            delta_b, conf_b, nconf_b = build_conflict_mask(
                comp_ids[b], comp_mask[b], pos_flags, neg_flags, vocab_size, PAD_ID, W_RAW
            )

            delta_masks[b] = delta_b
            conflict_masks[b] = conf_b
            n_conflict_seq[b] = nconf_b

        advantages = torch.where(
            low_ent,
            advantages - ENT_SCALE * entropies,
            torch.zeros_like(advantages)
        )

        # Prepare for gradient accumulation
        grad_inputs = torch.empty_like(_new_hidden_states)
        scaling = scaler.get_scale() if scaler is not None else 1.0
        acc_loss = torch.zeros(1, device=device)
        acc_len = torch.zeros(1, device=device)
        acc_kl = torch.zeros(1, device=device)

        def compute_loss(new_h, old_h, ids, msk, dlt, adv, rew, c_mask, n_conf, scl):
            new_logits = torch.matmul(new_h, lm_w)[: -1]
            old_logits = torch.matmul(old_h, lm_w)[: -1]
            loss_, ln_, kl_ = gtpo_compute_loss(
                old_logits, new_logits, ids, msk, dlt, beta, adv, rew, std_reward, c_mask,
                n_conf
            )
            return loss_ * scl, (loss_.detach(), ln_, kl_)

        def accumulate(new_h, old_h, ids, msk, dlt, adv, rew, c_mask, n_conf, scl):
            (g,), (l, (raw, ln, kl)) = torch.func.grad_and_value(compute_loss, argnums=(0, ), has_aux=True)(
                new_h, old_h, ids, msk, dlt, adv, rew, c_mask, n_conf, scl)
            acc_loss.add_(raw); acc_len.add_(ln); acc_kl.add_(kl)
            return g

        for b in range(B):
            for g in range(G):
                grad_inputs[b, g] = accumulate(
                    _new_hidden_states[b, g], _old_hidden_states[b, g],
                    comp_ids[b, g], comp_mask[b, g], delta_masks[b, g],
                    advantages[b, g].unsqueeze(0), rewards[b, g].unsqueeze(0),
                    conflict_masks[b, g], n_conflict_seq[b, g].unsqueeze(0), scaling
                )

        ctx.save_for_backward(grad_inputs)
        return acc_loss, acc_len, acc_kl

    @staticmethod
    def backward(ctx, grad_out, dlen, dkl):
        (grad_input,) = ctx.saved_tensors
        return (grad_input,) + (None,) * 13
