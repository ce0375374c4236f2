"""Sampling G completions per prompt (Sec. 3) and scoring them under the policy.

rollout(...)         one `generate` call for all prompts x G, no grad
sequence_logprobs()  per-token log pi(o_t) (with grad) and entropy H_t (no grad)
"""
from dataclasses import dataclass

import torch

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


def sequence_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask,
                      with_entropy=True, entropy_chunk=64):
    """log pi(o_{i,t} | q, o_{i,<t}) for every completion token, and its entropy H_{i,t}.

    One forward over prompt + completion; logits are kept for the completion positions only
    (`logits_to_keep`). Returns logprobs (N, L) float32 with grad and entropy (N, L) float32
    without grad (gamma acts through the advantage, Eq. 7), or None.
    """
    L = completion_ids.shape[1]
    ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attn = torch.cat([prompt_mask, completion_mask.to(prompt_mask.dtype)], dim=1)
    logits = model(input_ids=ids, attention_mask=attn, logits_to_keep=L + 1, use_cache=False).logits
    logits = logits[:, :-1]                                           # (N, L, V): position t predicts o_t
    logprobs = token_logprobs(logits, completion_ids)                 # (N, L)
    entropy = None
    if with_entropy:
        with torch.no_grad():
            flat = logits.detach().flatten(0, 1)
            entropy = torch.cat([token_entropy(c) for c in flat.split(entropy_chunk * 8)]).view(logits.shape[:2])
    return logprobs, entropy
