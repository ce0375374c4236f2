"""Sampling G completions per prompt (Sec. 3) and scoring them under the policy.

rollout(...)         one `generate` call for all prompts x G, no grad
sequence_logprobs()  per-token log pi(o_t) (with grad) and entropy H_t (no grad), chunked
                     over positions so the (N, L, V) logits never exist (ChunkedLogprobs)
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gtpo import token_entropy, token_logprobs


@dataclass
class Rollout:
    prompt_ids: torch.Tensor        # (N, P) left-padded, N = prompts x G, groups consecutive
    prompt_mask: torch.Tensor       # (N, P)
    completion_ids: torch.Tensor    # (N, L) right-padded with pad_token_id
    completion_mask: torch.Tensor   # (N, L) 1 up to and including the first EOS
    truncated: torch.Tensor         # (N,) bool: no EOS within max_new_tokens
    texts: list                     # N decoded completions (special tokens dropped)


def eos_ids(model, tokenizer):
    """All ids that end a completion: the tokenizer's EOS and the generation config's."""
    ids = {tokenizer.eos_token_id}
    gen = getattr(model, "generation_config", None)
    extra = getattr(gen, "eos_token_id", None) if gen is not None else None
    ids |= set(extra if isinstance(extra, (list, tuple)) else [extra])
    return sorted(i for i in ids if i is not None)


def completion_mask(ids, eos):
    """(N, L) ids -> (mask (N, L) long, truncated (N,) bool): 1 up to and including the first EOS."""
    is_eos = torch.isin(ids, torch.tensor(eos, device=ids.device))
    seen_before = (is_eos.long().cumsum(dim=1) - is_eos.long()) > 0   # an EOS strictly earlier
    return (~seen_before).long(), ~is_eos.any(dim=1)


@torch.no_grad()
def rollout(model, tokenizer, prompts, group_size, max_new_tokens, temperature=1.0, top_p=1.0,
            min_new_tokens=0):
    """G samples per prompt text with a single `generate` call (KV cache on).

    prompts: list of B prompt strings (already chat-formatted) -> Rollout with N = B * G rows,
    the G completions of prompt b in rows b*G ... b*G+G-1.
    """
    device = next(model.parameters()).device
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
    eos = eos_ids(model, tokenizer)
    was_training = model.training
    model.eval()
    out = model.generate(
        **enc, do_sample=True, temperature=temperature, top_p=top_p, top_k=0,
        max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens, num_return_sequences=group_size,
        eos_token_id=eos, pad_token_id=tokenizer.pad_token_id, use_cache=True)
    model.train(was_training)
    P = enc["input_ids"].shape[1]
    comp = out[:, P:]                                                 # (N, L)
    mask, truncated = completion_mask(comp, eos)
    comp = comp.masked_fill(mask == 0, tokenizer.pad_token_id)
    texts = tokenizer.batch_decode(comp, skip_special_tokens=True)
    return Rollout(prompt_ids=enc["input_ids"].repeat_interleave(group_size, 0),
                   prompt_mask=enc["attention_mask"].repeat_interleave(group_size, 0),
                   completion_ids=comp, completion_mask=mask, truncated=truncated, texts=texts)


def _rows_logsumexp(z, rows=32):
    """logsumexp over the last dim, 32 rows at a time: the temporary exp(z - max) stays small."""
    return torch.cat([z[r:r + rows].logsumexp(dim=-1) for r in range(0, z.shape[0], rows)])


class ChunkedLogprobs(torch.autograd.Function):
    """log pi(target) and entropy from final hidden states through the LM head, `logprob_chunk`
    positions at a time, so no (T, V) logits tensor ever exists (paper scale: 12 x 1500 x 128256
    fp32 = 9 GB).

    forward:  hidden (T, D), weight (V, D), bias (V,) or None, targets (T,) long, logprob_chunk
              -> logp (T,) float32, entropy (T,) float32 (no gradient; Eq. 7's gamma acts
              through the advantage) -- both from each chunk's fp32 logits.
    backward: recomputes each chunk's logits and forms d logp / d z = onehot(target) - softmax(z)
              in place, so the peak extra memory is about one (logprob_chunk, V) fp32 block.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, logprob_chunk, with_entropy):
        T = hidden.shape[0]
        logp = torch.empty(T, dtype=torch.float32, device=hidden.device)
        ent = torch.zeros(T, dtype=torch.float32, device=hidden.device)
        c = logprob_chunk
        for s in range(0, T, c):
            z = F.linear(hidden[s:s + c], weight, bias).float()                      # (c, V)
            lse = _rows_logsumexp(z)                                                 # (c,)
            logp[s:s + c] = z.gather(1, targets[s:s + c, None]).squeeze(1) - lse
            if with_entropy:                                                         # H = -sum p log p
                z.sub_(lse[:, None]).clamp_(min=torch.finfo(z.dtype).min)            # log p, -inf -> min
                for r in range(0, z.shape[0], 32):                                   # small temporaries
                    zr = z[r:r + 32]
                    ent[s + r:s + r + zr.shape[0]] = -zr.exp().mul_(zr).sum(dim=-1)
            del z
        ctx.save_for_backward(hidden, weight, bias, targets)
        ctx.logprob_chunk = c
        ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        hidden, weight, bias, targets = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.zeros_like(hidden) if need_h else None
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if need_w else None
        grad_b = torch.zeros_like(bias, dtype=torch.float32) if need_b else None
        c = ctx.logprob_chunk
        for s in range(0, hidden.shape[0], c):
            h, t, g = hidden[s:s + c], targets[s:s + c], g_logp[s:s + c].float()
            z = F.linear(h, weight, bias).float()                                    # (c, V)
            z.sub_(_rows_logsumexp(z)[:, None]).exp_().mul_(-g[:, None])             # -g * softmax
            z[torch.arange(len(t), device=z.device), t] += g                         # + g * onehot
            dz = z.to(weight.dtype)
            if need_h:
                grad_h[s:s + c] = dz @ weight
            if need_w:
                grad_w.addmm_(dz.t().float(), h.float())
            if need_b:
                grad_b += z.sum(0)
            del z, dz
        return (grad_h, grad_w.to(weight.dtype) if need_w else None,
                grad_b.to(bias.dtype) if need_b else None, None, None, None)


def lm_head_of(model):
    """The output projection when logits are exactly head(hidden) (Llama, Qwen, SmolLM2, Mistral);
    None for models that rescale or soft-cap logits, which then take the unchunked path."""
    inner = getattr(model, "module", model)                           # DistributedDataParallel
    cfg = getattr(inner, "config", None)
    if cfg is None or any(getattr(cfg, k, None) not in (None, 1, 1.0)
                          for k in ("final_logit_softcapping", "logit_scale", "logits_scaling")):
        return None
    head = inner.get_output_embeddings()
    return head if isinstance(head, torch.nn.Linear) else None


def sequence_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask,
                      with_entropy=True, logprob_chunk=256):
    """log pi(o_{i,t} | q, o_{i,<t}) for every completion token, and its entropy H_{i,t}.

    One forward over prompt + completion. With logprob_chunk > 0 the model returns only its final
    hidden states (`logits_to_keep=1`), and the LM head runs over the real completion tokens in
    chunks (ChunkedLogprobs): memory O(logprob_chunk x V) instead of O(N x L x V); 0 keeps the
    full (N, L, V) logits (the reference path the tests compare against).
    Returns logprobs (N, L) float32 with grad (0 at padding in the chunked path) and entropy
    (N, L) float32 without grad, or None.
    """
    L = completion_ids.shape[1]
    ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attn = torch.cat([prompt_mask, completion_mask.to(prompt_mask.dtype)], dim=1)
    head = lm_head_of(model) if logprob_chunk > 0 else None
    if head is not None:
        out = model(input_ids=ids, attention_mask=attn, logits_to_keep=1, use_cache=False,
                    output_hidden_states=True)
        hidden = out.hidden_states[-1][:, -L - 1:-1]                      # (N, L, D): position t predicts o_t
        keep = completion_mask.bool()                                     # (N, L)
        logp, ent = ChunkedLogprobs.apply(hidden[keep], head.weight, head.bias, completion_ids[keep],
                                          logprob_chunk, with_entropy)
        zeros = torch.zeros(keep.shape, dtype=torch.float32, device=keep.device)
        return zeros.masked_scatter(keep, logp), (zeros.masked_scatter(keep, ent) if with_entropy else None)
    logits = model(input_ids=ids, attention_mask=attn, logits_to_keep=L + 1, use_cache=False).logits
    logits = logits[:, :-1]                                           # (N, L, V): position t predicts o_t
    logprobs = token_logprobs(logits, completion_ids)                 # (N, L)
    entropy = None
    if with_entropy:
        with torch.no_grad():
            flat = logits.detach().flatten(0, 1)
            entropy = torch.cat([token_entropy(c) for c in flat.split(512)]).view(logits.shape[:2])
    return logprobs, entropy
