"""Sampling G completions per prompt (Sec. 3) and scoring them under the policy.

rollout(...)         all prompts x G sampled as one batch, no grad; each prompt pre-filled once
                     into a pre-allocated KV cache shared by its G rows, then `decode`
PolicyPass           the forward that predicts every completion token; with `prompt_index` each
                     prompt is computed once and its G completions attend to it (gradient included)
sequence_logprobs()  per-token log pi(o_t) (with grad) and entropy H_t (no grad), chunked
                     over positions so the (N, L, V) logits never exist (ChunkedLogprobs)
"""
import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers.cache_utils import StaticCache, StaticLayer

from gtpo import token_entropy, token_logprobs


@dataclass
class Rollout:
    prompt_ids: torch.Tensor        # (N, P) left-padded, N = prompts x G, groups consecutive
    prompt_mask: torch.Tensor       # (N, P)
    completion_ids: torch.Tensor    # (N, L) right-padded with pad_token_id
    completion_mask: torch.Tensor   # (N, L) 1 up to and including the first EOS
    truncated: torch.Tensor         # (N,) bool: no EOS within max_new_tokens
    texts: list                     # N decoded completions (special tokens dropped)
    entropy: torch.Tensor = None    # (N, L) H_t of pi at each sampled position, if asked (with_entropy)


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


def positions(mask):
    """Position ids from an attention mask, as `generate` makes them: 0 at the first real token
    of a left-padded row, 0 at padding."""
    return (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)


def lora_factors(layer):
    """[(B (out, r), A (r, in), scale), ...] over the active adapters of a PEFT LoRA layer, whose
    output in eval mode is then x (W + sum scale * B A)^T + bias: [] when no adapter acts (none
    active, disabled, or already merged into W); None for layers this does not describe (DoRA and
    other variants, a LoRA bias), which are never merged."""
    if layer.merged or layer.disable_adapters:
        return []
    active = [a for a in layer.active_adapters if a in layer.lora_A]
    if any(a in layer.lora_variant or layer.lora_bias.get(a) for a in active):
        return None
    return [(layer.lora_B[a].weight, layer.lora_A[a].weight, layer.scaling[a]) for a in active]


@contextlib.contextmanager
def merged_lora(model):
    """Sample with each LoRA layer's W + scale * B A precomputed (one matmul per layer instead of
    three) and the adapters off. The merged weights are new tensors swapped in for the duration;
    the original base tensors are put back untouched, so no merge/unmerge arithmetic ever drifts
    them (the bit-exact resume test relies on it). Models without adapters, 4-bit layers, and
    models with any LoRA layer lora_factors does not describe are left as they are."""
    from peft.tuners.lora import LoraLayer
    layers = {m: lora_factors(m) for m in model.modules()
              if isinstance(m, LoraLayer) and type(m.get_base_layer()) is torch.nn.Linear}
    if any(factors is None for factors in layers.values()):
        layers = {}                                                   # one layer cannot merge: none do
    swaps = []
    for layer, factors in layers.items():
        w = layer.get_base_layer().weight                             # (out, in)
        merged = w.data
        for B, A, scale in factors:                                   # (out, r), (r, in)
            merged = torch.addmm(merged, B.to(w.dtype), A.to(w.dtype), alpha=scale)
        if factors:
            swaps.append((w, w.data))
            w.data = merged
    try:
        with model.disable_adapter() if swaps else contextlib.nullcontext():
            yield
    finally:
        for w, original in swaps:
            w.data = original


class Blocked(torch.nn.Module):
    """An nn.Linear computed 16 output features at a time: its weight viewed (no copy) as
    (out/16, 16, in) and x times every block's transpose in one batched matmul. At the few rows
    of a decode step this runs ~1.3x faster on CPU than x @ W.T (README, Performance); the same
    outputs up to float summation order. It reads the wrapped layer's weight at each call, so
    merged_lora's swapped weights apply, and shows it as its own (code that reads `.weight`, as
    PEFT's adapters do, still works)."""

    def __init__(self, linear):
        super().__init__()
        self.linear = linear

    weight = property(lambda self: self.linear.weight)
    bias = property(lambda self: self.linear.bias)

    def forward(self, x):                                             # (..., in) -> (..., out)
        rows = x.reshape(-1, x.shape[-1])                             # (R, in)
        w = self.linear.weight.view(-1, 16, rows.shape[1])            # (out/16, 16, in)
        y = torch.bmm(rows.expand(w.shape[0], *rows.shape), w.transpose(1, 2))     # (out/16, R, 16)
        y = y.transpose(0, 1).reshape(rows.shape[0], -1)              # (R, out)
        y = y if self.linear.bias is None else y + self.linear.bias
        return y.reshape(*x.shape[:-1], y.shape[-1])


@contextlib.contextmanager
def blocked(model):
    """Run every plain float nn.Linear of the model on CPU with a contiguous weight whose output
    size is a multiple of 16 (projections and LM head; not 4-bit layers) as Blocked while
    decoding; elsewhere the model is left as it is. The original modules are put back after."""
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if type(child) is torch.nn.Linear and child.weight.device.type == "cpu" and child.out_features % 16 == 0
             and child.weight.is_contiguous()]
    for parent, name, child in swaps:
        setattr(parent, name, Blocked(child))
    try:
        yield
    finally:
        for parent, name, child in swaps:
            setattr(parent, name, child)


class FilledStaticLayer(StaticLayer):
    """transformers' StaticLayer (keys/values pre-allocated and written in place) whose attention
    and mask span only the positions written so far, not the whole pre-allocated length: decoding
    token t attends over P + t positions, as with a growing cache, without re-copying it."""

    def __init__(self, max_cache_len, **kwargs):
        super().__init__(max_cache_len, **kwargs)
        self.filled = 0                                               # a Python int: no device sync

    def update(self, key_states, value_states, *args, **kwargs):
        keys, values = super().update(key_states, value_states, *args, **kwargs)   # (rows, heads, max_len, d)
        self.filled += key_states.shape[-2]
        return keys[:, :, :self.filled], values[:, :, :self.filled]

    def get_mask_sizes(self, query_length):
        return self.filled + query_length, 0


def prefill_shared(model, ids, attn, group_size, max_new_tokens):
    """Pre-fill the B prompts but their last token once, into a cache pre-allocated for the whole
    completion (no per-token `cat`; FilledStaticLayer where a layer attends to everything before,
    transformers' own layer for sliding-window ones), expanded to the B x G rows that decode
    (groups consecutive)."""
    size = ids.shape[1] + max_new_tokens
    cache = StaticCache(config=model.config, max_cache_len=size)
    cache.layers = [FilledStaticLayer(size) if type(layer) is StaticLayer else layer for layer in cache.layers]
    model(input_ids=ids[:, :-1], attention_mask=attn[:, :-1], position_ids=positions(attn[:, :-1]),
          past_key_values=cache, use_cache=True, logits_to_keep=1)
    for layer in cache.layers:                                        # (B, ...) -> (B*G, ...)
        layer.keys = layer.keys.repeat_interleave(group_size, 0)
        layer.values = layer.values.repeat_interleave(group_size, 0)
    return cache


def sample_next(logits, temperature=1.0, top_p=1.0):
    """One token per row from softmax(logits / temperature), restricted to the top_p nucleus as
    transformers' TopPLogitsWarper does (top_k = 0: no top-k cut). Drawn by inverting the
    cumulative distribution with one uniform per row: the same distribution as `generate`'s
    torch.multinomial, without its (rows, V) exponential draws (README, Performance).
    logits (N, V) -> (N,) long."""
    z = logits.float() / temperature                                  # (N, V)
    if top_p < 1.0:
        z_sorted, order = z.sort(dim=-1)                              # ascending
        drop = z_sorted.softmax(-1).cumsum(-1) <= 1 - top_p           # (N, V) the low tail
        drop[:, -1] = False                                           # keep at least one token
        z = z.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    cdf = z.softmax(-1).double().cumsum(-1)                           # (N, V) float64
    u = torch.rand(z.shape[0], 1, dtype=torch.float64, device=z.device) * cdf[:, -1:]   # (N, 1) in [0, total)
    return torch.searchsorted(cdf, u, right=True).squeeze(1).clamp_(max=z.shape[1] - 1)  # never a p = 0 token


def decode(model, cache, last_ids, attn, max_new_tokens, min_new_tokens, eos, pad_id, temperature=1.0,
           top_p=1.0, with_entropy=False):
    """Sample completions after a pre-filled cache, one token per row per forward, as
    `generate(do_sample=True, top_k=0)` does: EOS barred before min_new_tokens, rows that have
    emitted an EOS continue with pad_id, and it stops when every row has one.
    last_ids (N, 1): the prompts' last tokens (not in the cache); attn (N, P) -> (N, L) tokens,
    and with_entropy the entropy of pi (the untempered logits) at each step, (N, L), else None."""
    eos_t = torch.tensor(eos, device=last_ids.device)
    pos = positions(attn)[:, -1:]                                     # (N, 1)
    done = torch.zeros(last_ids.shape[0], dtype=torch.bool, device=last_ids.device)
    ids, out, ent = last_ids, [], []
    for t in range(max_new_tokens):
        logits = model(input_ids=ids, attention_mask=attn, position_ids=pos, past_key_values=cache, use_cache=True,
                       logits_to_keep=1).logits[:, -1]                # (N, V)
        if with_entropy:
            ent.append(token_entropy(logits))                         # (N,)
        if t < min_new_tokens:
            logits[:, eos_t] = float("-inf")
        nxt = sample_next(logits, temperature, top_p).masked_fill_(done, pad_id)    # (N,)
        out.append(nxt)
        done |= torch.isin(nxt, eos_t)
        if done.all():
            break
        ids, pos = nxt[:, None], pos + 1
        attn = torch.cat([attn, attn.new_ones(attn.shape[0], 1)], dim=1)           # (N, P + t + 1)
    return torch.stack(out, dim=1), (torch.stack(ent, dim=1) if with_entropy else None)   # (N, L), (N, L)


@torch.no_grad()
def rollout(model, tokenizer, prompts, group_size, max_new_tokens, temperature=1.0, top_p=1.0,
            min_new_tokens=0, share_prompt=True, merge_lora=True, with_entropy=False):
    """G samples per prompt text, all prompts x G rows decoded as one batch (KV cache on, LoRA
    merged: merged_lora).

    prompts: list of B prompt strings (already chat-formatted) -> Rollout with N = B * G rows,
    the G completions of prompt b in rows b*G ... b*G+G-1. share_prompt: pre-fill the B prompts
    once (B rows, not B x G) into a pre-allocated cache (prefill_shared) expanded to the B x G rows,
    which `decode` samples from with the linear layers as Blocked (`blocked`). share_prompt=False is plain
    `generate` over B x G copies, the path before these changes; both sample the same
    distribution (top_k = 0), from different random draws.
    merge_lora: sample with the LoRA weights merged into copies of the base weights (merged_lora).
    with_entropy: also return H_t of pi (untempered) at every sampled position, from the logits
    the sampling computes anyway (Rollout.entropy; what a policy pass would give, without one).
    """
    device = next(model.parameters()).device
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
    ids, attn = enc["input_ids"], enc["attention_mask"]                            # (B, P)
    ids_g, attn_g = ids.repeat_interleave(group_size, 0), attn.repeat_interleave(group_size, 0)   # (B*G, P)
    eos = eos_ids(model, tokenizer)
    was_training = model.training
    model.eval()
    fast = share_prompt and ids.shape[1] > 1
    with merged_lora(model) if merge_lora else contextlib.nullcontext():
        if fast:
            cache = prefill_shared(model, ids, attn, group_size, max_new_tokens)
            with blocked(model):
                comp, ent = decode(model, cache, ids_g[:, -1:], attn_g, max_new_tokens, min_new_tokens, eos,
                                   tokenizer.pad_token_id, temperature, top_p, with_entropy)   # (N, L)
        else:
            out = model.generate(
                input_ids=ids_g, attention_mask=attn_g, do_sample=True, temperature=temperature, top_p=top_p,
                top_k=0, max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens, eos_token_id=eos,
                pad_token_id=tokenizer.pad_token_id, use_cache=True, return_dict_in_generate=True,
                output_logits=with_entropy)
            comp = out.sequences[:, ids.shape[1]:]                                  # (N, L)
            ent = torch.stack([token_entropy(z) for z in out.logits], dim=1) if with_entropy else None
    model.train(was_training)
    mask, truncated = completion_mask(comp, eos)
    comp = comp.masked_fill(mask == 0, tokenizer.pad_token_id)
    texts = tokenizer.batch_decode(comp, skip_special_tokens=True)
    return Rollout(prompt_ids=ids_g, prompt_mask=attn_g, completion_ids=comp, completion_mask=mask, truncated=truncated,
                   texts=texts, entropy=ent)


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


def expand_rows(x, counts):
    """Row b of x repeated counts[b] times, as expand + cat: its backward sums each prompt's
    gradient over its completions in a fixed order (an index gather's scatter-add backward
    does not give bit-identical sums from one process to the next)."""
    return torch.cat([x[b:b + 1].expand(c, *x.shape[1:]) for b, c in enumerate(counts)])


class PolicyPass(torch.nn.Module):
    """The policy's pass over B prompts and n completions as ONE module call, so that DDP sees one
    forward per backward even when the prompts are computed apart from their completions.

    forward(prompt_ids, prompt_mask, completion_ids, completion_mask, prompt_index=None, logits=False)
      prompt_index None: prompt_ids/mask are (n, P), one row per completion; one joint forward.
      prompt_index (n,) long: prompt_ids/mask are (B, P), completion j continues prompt
        prompt_index[j] (sorted: each prompt's completions consecutive, as a rollout lays them
        out). Each prompt is run once with its KV cache kept (with grad); the cache is expanded to
        the n rows (expand_rows) and the completions attend to it, so the gradient reaches the
        prompt's computation summed over its completions, as through n copies.
      -> (n, L, D) final hidden states, or (n, L, V) logits, at the positions that predict o_t.
    Positions come from the attention masks, as in `generate`.
    """

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, prompt_ids, prompt_mask, completion_ids, completion_mask, prompt_index=None, logits=False):
        L = completion_ids.shape[1]
        out_kw = {"logits_to_keep": L + 1} if logits else {"logits_to_keep": 1, "output_hidden_states": True}
        pick = (lambda o: o.logits) if logits else (lambda o: o.hidden_states[-1])
        if prompt_index is None:
            ids = torch.cat([prompt_ids, completion_ids], dim=1)                    # (n, P + L)
            attn = torch.cat([prompt_mask, completion_mask.to(prompt_mask.dtype)], dim=1)
            out = self.model(input_ids=ids, attention_mask=attn, position_ids=positions(attn), use_cache=False,
                             **out_kw)
            return pick(out)[:, -L - 1:-1]                                           # position t predicts o_t
        values, counts = torch.unique_consecutive(prompt_index, return_counts=True)
        counts = counts.tolist()
        if values.tolist() != list(range(prompt_ids.shape[0])):
            raise ValueError("prompt_index must be 0, ..., B-1 in order, each prompt's completions consecutive")
        p_pos = positions(prompt_mask)                                               # (B, P)
        out = self.model(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=p_pos, use_cache=True,
                         **{**out_kw, "logits_to_keep": 1})
        first = expand_rows(pick(out)[:, -1:], counts)                               # (n, 1, .) predicts o_0
        if L == 1:
            return first
        cache = out.past_key_values
        for layer in cache.layers:                                                   # (B, ...) -> (n, ...)
            layer.keys, layer.values = expand_rows(layer.keys, counts), expand_rows(layer.values, counts)
        attn = torch.cat([prompt_mask[prompt_index], completion_mask[:, :-1].to(prompt_mask.dtype)], dim=1)
        c_pos = p_pos[prompt_index, -1:] + 1 + torch.arange(L - 1, device=p_pos.device)   # (n, L - 1)
        out = self.model(input_ids=completion_ids[:, :-1], attention_mask=attn, position_ids=c_pos,
                         past_key_values=cache, use_cache=True,
                         **{**out_kw, "logits_to_keep": L - 1 if logits else 1})   # hidden states: no logits
        return torch.cat([first, pick(out)[:, -(L - 1):]], dim=1)                   # o_1 ... o_{L-1}


def sequence_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask,
                      with_entropy=True, logprob_chunk=256, prompt_index=None):
    """log pi(o_{i,t} | q, o_{i,<t}) for every completion token, and its entropy H_{i,t}.

    model: a causal LM, or a PolicyPass (DDP-wrapped under torchrun). prompt_index: see PolicyPass
    (None: one row of prompt_ids per completion). With logprob_chunk > 0 the model returns only its
    final hidden states, and the LM head runs over the real completion tokens in chunks
    (ChunkedLogprobs): memory O(logprob_chunk x V) instead of O(N x L x V); 0 keeps the full
    (N, L, V) logits (the reference path the tests compare against).
    Returns logprobs (N, L) float32 with grad (0 at padding in the chunked path) and entropy
    (N, L) float32 without grad, or None.
    """
    runner = model if isinstance(getattr(model, "module", model), PolicyPass) else PolicyPass(model)
    head = lm_head_of(getattr(runner, "module", runner).model) if logprob_chunk > 0 else None
    if head is not None:
        hidden = runner(prompt_ids, prompt_mask, completion_ids, completion_mask, prompt_index)  # (N, L, D)
        keep = completion_mask.bool()                                     # (N, L)
        logp, ent = ChunkedLogprobs.apply(hidden[keep], head.weight, head.bias, completion_ids[keep],
                                          logprob_chunk, with_entropy)
        zeros = torch.zeros(keep.shape, dtype=torch.float32, device=keep.device)
        return zeros.masked_scatter(keep, logp), (zeros.masked_scatter(keep, ent) if with_entropy else None)
    logits = runner(prompt_ids, prompt_mask, completion_ids, completion_mask, prompt_index, logits=True)  # (N, L, V)
    logprobs = token_logprobs(logits, completion_ids)                 # (N, L)
    entropy = None
    if with_entropy:
        with torch.no_grad():
            flat = logits.detach().flatten(0, 1)
            entropy = torch.cat([token_entropy(c) for c in flat.split(512)]).view(logits.shape[:2])
    return logprobs, entropy
