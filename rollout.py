"""Sampling G completions per prompt (Sec. 3) with `model.generate`.

rollout(...)      all prompts x G sampled as one batch, no grad -> Rollout (ids, masks, texts)
resolve_path()    which sampler runs: `generate` through the policy (this file), a merged bf16 copy with
                  its own decode loop (speedups/merged_rollout.py), or on CPU the shared-prompt decode loop
                  of speedups/cpu_rollout.py (same distribution, other random draws)
completion_mask   1 up to and including the first EOS
"""
from dataclasses import dataclass

import torch

from speedups import cpu_rollout, merged_rollout

PATHS = ("auto", "generate", "shared", "merged")


@dataclass
class Rollout:
    prompt_ids: torch.Tensor        # (N, P) left-padded, N = prompts x G, groups consecutive
    prompt_mask: torch.Tensor       # (N, P)
    completion_ids: torch.Tensor    # (N, L) right-padded with pad_token_id
    completion_mask: torch.Tensor   # (N, L) 1 up to and including the first EOS
    truncated: torch.Tensor         # (N,) bool: no EOS within max_new_tokens
    texts: list                     # N decoded completions (special tokens dropped)


def resolve_path(path, device):
    """--rollout: "auto" is the shared-prompt decode loop on CPU (speedups/cpu_rollout.py, where it is
    tested and pays) and `generate` on every other device; "generate" / "shared" / "merged" force one."""
    if path not in PATHS:
        raise ValueError(f"rollout path must be one of {PATHS}, got {path!r}")
    if path == "auto":
        return "shared" if torch.device(device).type == "cpu" else "generate"
    return path


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


def generate(model, ids, attn, group_size, max_new_tokens, min_new_tokens, eos, pad_id, temperature=1.0,
             top_p=1.0, **extra):
    """G samples per prompt with `model.generate` over B x G copies of the prompts (top_k = 0: the
    untruncated softmax). ids, attn (B, P) -> tokens (B*G, L). No per-step logits are kept (a
    paper-length completion's would be ~0.8 GB per row). extra: more `generate` arguments."""
    ids, attn = ids.repeat_interleave(group_size, 0), attn.repeat_interleave(group_size, 0)   # (B*G, P)
    out = model.generate(input_ids=ids, attention_mask=attn, do_sample=True, temperature=temperature,
                         top_p=top_p, top_k=0, max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens,
                         eos_token_id=eos, pad_token_id=pad_id, use_cache=True, return_dict_in_generate=True,
                         **extra)
    return out.sequences[:, ids.shape[1]:]                                       # (N, L)


@torch.no_grad()
def rollout(model, tokenizer, prompts, group_size, max_new_tokens, temperature=1.0, top_p=1.0,
            min_new_tokens=0, path="auto", merge_lora=True):
    """G samples per prompt text, all prompts x G rows as one batch, in eval mode.

    prompts: B chat-formatted strings -> Rollout with N = B * G rows, the G completions of prompt b
    in rows b*G ... b*G+G-1. path: see resolve_path; "shared" needs prompts of >= 2 tokens and
    otherwise uses `generate`; "merged" samples from merged_rollout.sample (prompts then
    left-padded to a multiple of PAD_MULTIPLE). merge_lora: the shared path's merged-LoRA sampling.
    """
    device = next(model.parameters()).device
    path = resolve_path(path, device)
    pad_to = merged_rollout.PAD_MULTIPLE if path == "merged" else None
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False,
                    pad_to_multiple_of=pad_to).to(device)
    ids, attn = enc["input_ids"], enc["attention_mask"]                            # (B, P)
    eos, pad = eos_ids(model, tokenizer), tokenizer.pad_token_id
    was_training = model.training
    model.eval()
    if path == "shared" and ids.shape[1] > 1:
        comp = cpu_rollout.sample(model, ids, attn, group_size, max_new_tokens, min_new_tokens, eos, pad,
                                  temperature, top_p, merge_lora)
    elif path == "merged":                      # the kept copy; `generate` through the policy if it runs out
        comp = merged_rollout.sample(model, generate, ids, attn, group_size, max_new_tokens, min_new_tokens, eos, pad,
                                     temperature, top_p)
    else:
        comp = generate(model, ids, attn, group_size, max_new_tokens, min_new_tokens, eos, pad, temperature, top_p)
    model.train(was_training)
    mask, truncated = completion_mask(comp, eos)                                   # (N, L)
    comp = comp.masked_fill(mask == 0, pad)
    return Rollout(prompt_ids=ids.repeat_interleave(group_size, 0), prompt_mask=attn.repeat_interleave(group_size, 0),
                   completion_ids=comp, completion_mask=mask, truncated=truncated,
                   texts=tokenizer.batch_decode(comp, skip_special_tokens=True))
