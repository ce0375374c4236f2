"""The gradient pass: log pi(o_t) and H_t of every completion token under the policy (Sec. 3).

PolicyPass           the forward that predicts every completion token; with `prompt_index` each
                     prompt is computed once and its G completions attend to it (gradient included)
sequence_logprobs()  per-token log pi(o_t) (with grad) and entropy H_t (no grad), chunked
                     over positions so the (N, L, V) logits never exist (ChunkedLogprobs)
"""
import copy

import torch
import torch.nn.functional as F

from gtpo import token_entropy, token_logprobs


def positions(mask):
    """Position ids from an attention mask, as `generate` makes them: 0 at the first real token
    of a left-padded row, 0 at padding."""
    return (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)


def _rows_logsumexp(z, rows=32):
    """logsumexp over the last dim, 32 rows at a time: the temporary exp(z - max) stays small."""
    return torch.cat([z[r:r + rows].logsumexp(dim=-1) for r in range(0, z.shape[0], rows)])


def _fp32(t):
    """t in fp32 or wider (itself when it already is: the CPU path allocates nothing; float64 stays
    float64, so the function can be gradchecked)."""
    return t if t is None or t.dtype in (torch.float32, torch.float64) else t.float()


class ChunkedLogprobs(torch.autograd.Function):
    """log pi(target) and entropy from final hidden states through the LM head, `logprob_chunk`
    positions at a time, so no (T, V) logits tensor ever exists (paper scale: 12 x 1500 x 128256
    fp32 = 9 GB). The head runs in fp32 whatever the weights' dtype (autocast off, bf16 weights
    and hidden states upcast), so log-probs and entropy have fp32 precision.

    forward:  hidden (T, D), weight (V, D), bias (V,) or None, targets (T,) long, logprob_chunk,
              with_entropy, temperature, entropy_grad -> logp (T,) float32, entropy (T,) float32,
              both of softmax(logits / temperature), the distribution the completions were sampled
              from, from each chunk's fp32 logits. The entropy carries a gradient only with
              entropy_grad (Eq. 7's -gamma <H>_i term); otherwise it is a constant.
    backward: recomputes each chunk's logits z and forms, in place,
                  d logp_t / dz = onehot(target) - p,    d H_t / dz = -p * (log p + H_t)
              (both divided by the temperature), so the peak extra memory is about one
              (logprob_chunk, V) fp32 block.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, logprob_chunk, with_entropy, temperature=1.0, entropy_grad=False):
        T = hidden.shape[0]
        acc = torch.promote_types(hidden.dtype, torch.float32)                        # fp32 (fp64 in tests)
        logp = torch.empty(T, dtype=acc, device=hidden.device)
        ent = torch.zeros(T, dtype=acc, device=hidden.device)
        c = logprob_chunk
        w, b = _fp32(weight), _fp32(bias)                                            # (V, D), (V,)
        for s in range(0, T, c):
            with torch.autocast(hidden.device.type, enabled=False):
                z = F.linear(_fp32(hidden[s:s + c]), w, b)                           # (c, V) fp32
            if temperature != 1.0:
                z.div_(temperature)
            lse = _rows_logsumexp(z)                                                 # (c,)
            logp[s:s + c] = z.gather(1, targets[s:s + c, None]).squeeze(1) - lse
            if with_entropy:                                                         # H = -sum p log p
                z.sub_(lse[:, None]).clamp_(min=torch.finfo(z.dtype).min)            # log p, -inf -> min
                for r in range(0, z.shape[0], 32):                                   # small temporaries
                    zr = z[r:r + 32]
                    ent[s + r:s + r + zr.shape[0]] = -zr.exp().mul_(zr).sum(dim=-1)
            del z
        if entropy_grad and not with_entropy:
            raise ValueError("entropy_grad needs with_entropy")
        ctx.save_for_backward(hidden, weight, bias, targets, ent if entropy_grad else None)
        ctx.logprob_chunk, ctx.temperature, ctx.entropy_grad = c, temperature, entropy_grad
        if not entropy_grad:
            ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        hidden, weight, bias, targets, ent = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.zeros_like(hidden) if need_h else None
        acc = torch.promote_types(hidden.dtype, torch.float32)
        grad_w = torch.zeros_like(weight, dtype=acc) if need_w else None
        grad_b = torch.zeros_like(bias, dtype=acc) if need_b else None
        c = ctx.logprob_chunk
        w, b = _fp32(weight), _fp32(bias)
        for s in range(0, hidden.shape[0], c):
            h, t, g = _fp32(hidden[s:s + c]), targets[s:s + c], g_logp[s:s + c].to(acc)
            with torch.autocast(hidden.device.type, enabled=False):
                z = F.linear(h, w, b)                                                # (c, V) fp32
            if ctx.temperature != 1.0:
                z.div_(ctx.temperature)
                g = g / ctx.temperature                                              # d(z / T) / dz
            z.sub_(_rows_logsumexp(z)[:, None])                                      # log p
            if ctx.entropy_grad:                                                     # g * dlogp + g_H * dH
                g_h = g_ent[s:s + c].to(acc) / ctx.temperature
                z.clamp_(min=torch.finfo(z.dtype).min)
                for r in range(0, z.shape[0], 32):                                   # small temporaries
                    zr = z[r:r + 32]
                    rows = slice(s + r, s + r + zr.shape[0])
                    p = zr.exp()
                    zr.add_(ent[rows, None]).mul_(-g_h[r:r + 32, None]).sub_(g[r:r + 32, None]).mul_(p)
            else:
                z.exp_().mul_(-g[:, None])                                           # -g * softmax
            z[torch.arange(len(t), device=z.device), t] += g                         # + g * onehot
            if need_h:
                grad_h[s:s + c] = (z @ w).to(hidden.dtype)
            if need_w:
                grad_w.addmm_(z.t(), h)
            if need_b:
                grad_b += z.sum(0)
            del z
        return (grad_h, grad_w.to(weight.dtype) if need_w else None,
                grad_b.to(bias.dtype) if need_b else None, None, None, None, None, None)


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


class UnsharedCache(TypeError):
    """The model's cache holds more than keys and values (Mamba's or linear attention's recurrent state): a prompt's
    cache cannot be expanded to its completions, so each completion needs its prompt in its own forward."""


class Prompts:
    """B prompts run once with grad (PolicyPass without completions) for the completions of every
    micro-batch of a step. A micro-batch reads detached copies of the prompts' last output and KV
    cache, which gather its gradient; the last one (`last`) reads the originals, and backward(loss)
    sends the gathered gradient through the prompts' computation in the same backward as its loss:
    the prompts' gradient is the same as when each pass computed them again, and DDP averages the
    whole step's gradient in one backward."""

    def __init__(self, first, cache, mask, last=False):
        if not all(isinstance(getattr(layer, "keys", None), torch.Tensor) and not hasattr(layer, "conv_states")
                   for layer in cache.layers):
            raise UnsharedCache(f"a {type(cache).__name__} with {type(cache.layers[0]).__name__} layers is not a "
                                f"key/value cache: pass prompt_index=None (one row of prompt_ids per completion)")
        self.cache, self.mask, self.last = cache, mask, last                      # mask (B, P)
        self.originals = [first] + [t for layer in cache.layers for t in (layer.keys, layer.values)]
        self.copies = [t.detach().requires_grad_(t.requires_grad) for t in self.originals]

    def rows(self, index):
        """(first (n, 1, .), a cache (n, ...)) for completions of prompts `index` (n,): sorted, each
        prompt's completions consecutive, a run of prompts without gaps."""
        values, counts = torch.unique_consecutive(index, return_counts=True)
        lo, hi = int(values[0]), int(values[-1]) + 1
        if values.tolist() != list(range(lo, hi)):
            raise ValueError("prompt_index must be consecutive prompts in order, each prompt's completions together")
        src = [expand_rows(t[lo:hi], counts.tolist()) for t in (self.originals if self.last else self.copies)]
        cache = copy.copy(self.cache)                                              # the prompts' own stays as it is
        cache.layers = [copy.copy(layer) for layer in self.cache.layers]
        for i, layer in enumerate(cache.layers):
            layer.keys, layer.values = src[1 + 2 * i], src[2 + 2 * i]
        return src[0], cache

    def backward(self, loss):
        """loss.backward(), and the gradient the copies gathered through the prompts' computation."""
        held = [(t, c.grad) for t, c in zip(self.originals, self.copies) if c.grad is not None]
        torch.autograd.backward([loss, *(t for t, _ in held)], [None, *(g for _, g in held)])


class PolicyPass(torch.nn.Module):
    """The policy's pass over B prompts and n completions as one module call, so that DDP sees one
    forward per backward even when the prompts are computed apart from their completions.

    forward(prompt_ids, prompt_mask, completion_ids, completion_mask, prompt_index=None, logits=False, prompts=None)
      prompt_index None: prompt_ids/mask are (n, P), one row per completion; one joint forward.
      prompt_index (n,) long: prompt_ids/mask are (B, P), completion j continues prompt
        prompt_index[j] (sorted: each prompt's completions consecutive, as a rollout lays them
        out). Each prompt is run once with its KV cache kept (with grad); the cache is expanded to
        the n rows (expand_rows) and the completions attend to it, so the gradient reaches the
        prompt's computation summed over its completions, as through n copies. With `prompts`
        (Prompts) the prompts' pass is that one, made once for the step's micro-batches.
      -> (n, L, D) final hidden states, or (n, L, V) logits, at the positions that predict o_t.
    forward(prompt_ids, prompt_mask, logits=False): the prompts alone -> Prompts.
    Positions come from the attention masks, as in `generate`.
    """

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, prompt_ids, prompt_mask, completion_ids=None, completion_mask=None, prompt_index=None,
                logits=False, prompts=None):
        pick = (lambda o: o.logits) if logits else (lambda o: o.hidden_states[-1])
        if completion_ids is None or (prompt_index is not None and prompts is None):
            out = self.model(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=positions(prompt_mask),
                             use_cache=True, logits_to_keep=1, output_hidden_states=not logits)
            prompts = Prompts(pick(out)[:, -1:], out.cache, prompt_mask, last=completion_ids is not None)
            if completion_ids is None:
                return prompts
        L = completion_ids.shape[1]
        out_kw = {"logits_to_keep": L + 1} if logits else {"logits_to_keep": 1, "output_hidden_states": True}
        if prompt_index is None:
            ids = torch.cat([prompt_ids, completion_ids], dim=1)                    # (n, P + L)
            attn = torch.cat([prompt_mask, completion_mask.to(prompt_mask.dtype)], dim=1)
            out = self.model(input_ids=ids, attention_mask=attn, position_ids=positions(attn), use_cache=False,
                             **out_kw)
            return pick(out)[:, -L - 1:-1]                                           # position t predicts o_t
        first, cache = prompts.rows(prompt_index)                                    # (n, 1, .) predicts o_0
        if L == 1:
            return first
        p_mask = prompts.mask[prompt_index]                                          # (n, P)
        attn = torch.cat([p_mask, completion_mask[:, :-1].to(p_mask.dtype)], dim=1)
        c_pos = positions(p_mask)[:, -1:] + 1 + torch.arange(L - 1, device=p_mask.device)   # (n, L - 1)
        # a mixture of experts counts its router loss over the attention mask, which here also covers the cached
        # prompt: nothing reads that loss from this pass, so the router logits are not asked for
        moe = {"output_router_logits": False} if hasattr(self.model.config, "output_router_logits") else {}
        out = self.model(input_ids=completion_ids[:, :-1], attention_mask=attn, position_ids=c_pos,
                         cache=cache, use_cache=True, **moe,
                         **{**out_kw, "logits_to_keep": L - 1 if logits else 1})   # hidden states: no logits
        return torch.cat([first, pick(out)[:, -(L - 1):]], dim=1)                   # o_1 ... o_{L-1}


def _runner_and_head(model, logprob_chunk):
    """The PolicyPass to call (model itself when it is one, DDP-wrapped or not) and the LM head the
    chunked path runs (None: the model returns logits)."""
    runner = model if isinstance(getattr(model, "module", model), PolicyPass) else PolicyPass(model)
    return runner, lm_head_of(getattr(runner, "module", runner).model) if logprob_chunk > 0 else None


def prompt_pass(model, prompt_ids, prompt_mask, logprob_chunk=256):
    """The B prompts (B, P) once, with grad, for sequence_logprobs(..., prompts=) over a step's
    micro-batches -> Prompts (set `.last` before the last micro-batch, whose backward is Prompts.backward)."""
    runner, head = _runner_and_head(model, logprob_chunk)
    return runner(prompt_ids, prompt_mask, logits=head is None)


def sequence_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask,
                      with_entropy=True, logprob_chunk=256, prompt_index=None, temperature=1.0, entropy_grad=False,
                      prompts=None):
    """log pi(o_{i,t} | q, o_{i,<t}) for every completion token, and its entropy H_{i,t}, where pi is
    softmax(logits / temperature): the distribution the completions were sampled from (TRL's
    convention too; the paper's T = 1 makes it the model's own softmax).

    model: a causal LM, or a PolicyPass (DDP-wrapped under torchrun). prompt_index, prompts: see
    PolicyPass (None: one row of prompt_ids per completion; prompts: prompt_pass's, made once).
    With logprob_chunk > 0 the model returns only its final hidden states, and the LM head runs over
    the real completion tokens in chunks (ChunkedLogprobs): memory O(logprob_chunk x V) instead of
    O(N x L x V); 0 keeps the full (N, L, V) logits (the reference path the tests compare against).
    Returns logprobs (N, L) float32 with grad (0 at padding in the chunked path) and entropy
    (N, L) float32, or None; the entropy carries a gradient only with entropy_grad (Eq. 7's
    -gamma <H>_i term).
    """
    runner, head = _runner_and_head(model, logprob_chunk)
    if head is not None:
        hidden = runner(prompt_ids, prompt_mask, completion_ids, completion_mask, prompt_index,
                        prompts=prompts)                                  # (N, L, D)
        keep = completion_mask.bool()                                     # (N, L)
        logp, ent = ChunkedLogprobs.apply(hidden[keep], head.weight, head.bias, completion_ids[keep],
                                          logprob_chunk, with_entropy, temperature, entropy_grad)
        zeros = torch.zeros(keep.shape, dtype=torch.float32, device=keep.device)
        return zeros.masked_scatter(keep, logp), (zeros.masked_scatter(keep, ent) if with_entropy else None)
    logits = runner(prompt_ids, prompt_mask, completion_ids, completion_mask, prompt_index, logits=True,
                    prompts=prompts)                                      # (N, L, V)
    logits = logits / temperature if temperature != 1.0 else logits
    logprobs = token_logprobs(logits, completion_ids)                 # (N, L)
    entropy = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            flat = (logits if entropy_grad else logits.detach()).flatten(0, 1)
            entropy = torch.cat([token_entropy(c) for c in flat.split(512)]).view(logits.shape[:2])
    return logprobs, entropy
