"""The CPU sampling path: each prompt pre-filled once for its G rows, then our own decode loop.

A speed-up for CPUs, where it is tested and chosen by default (rollout.resolve_path); it draws
from the same distribution as `model.generate(do_sample=True, top_k=0)` with other random draws.
On any device `--rollout generate` bypasses all of it.

sample()         merged LoRA -> shared pre-fill -> decode with cpu_decoder's packed layers (Llama, Qwen2)
                 or the model's own with Blocked linear layers
merged_lora      sample with W + scale * B A swapped in for each LoRA layer (base weights untouched)
Blocked/blocked  nn.Linear as one batched matmul over 16-feature blocks of the weight (few rows)
FilledStaticLayer, prefill_shared   a pre-allocated KV cache filled once per prompt, shared by G rows
sample_next, decode                 inverse-CDF sampling, one token per row per forward
"""
import contextlib

import torch
from transformers.cache_utils import StaticCache, StaticLayer

from speedups import cpu_decoder
from speedups.cpu_decoder import lora_factors
from speedups.logprobs import positions


def sample(model, ids, attn, group_size, max_new_tokens, min_new_tokens, eos, pad_id, temperature=1.0,
           top_p=1.0, merge_lora=True):
    """G completions per prompt: ids, attn (B, P) left-padded prompts, P >= 2 -> tokens (B*G, L),
    rows b*G ... b*G+G-1 continuing prompt b. The model is in eval
    mode and no gradient is recorded (rollout.rollout sees to both). With merge_lora, a model
    cpu_decoder describes decodes through its packed layers (LoRA merged into them); any other
    through its own forward with Blocked linear layers (LoRA merged by merged_lora, or not)."""
    last, attn_g = ids.repeat_interleave(group_size, 0)[:, -1:], attn.repeat_interleave(group_size, 0)
    args = (max_new_tokens, min_new_tokens, eos, pad_id, temperature, top_p)
    if merge_lora and cpu_decoder.supports(model):
        dec = cpu_decoder.Decoder(model)
        cache = prefill_shared(model, ids, attn, group_size, max_new_tokens)
        return decode(lambda x, pos, seen: dec.step(x[:, 0], pos[:, 0], seen.bool(), cache), last, attn_g, *args)
    with merged_lora(model) if merge_lora else contextlib.nullcontext():
        cache = prefill_shared(model, ids, attn, group_size, max_new_tokens)
        with blocked(model):
            return decode(lambda x, pos, seen: model(input_ids=x, attention_mask=seen, position_ids=pos, cache=cache,
                                                     use_cache=True, logits_to_keep=1).logits[:, -1],
                          last, attn_g, *args)


@contextlib.contextmanager
def merged_lora(model):
    """Sample with each LoRA layer's W + scale * B A precomputed (one matmul per layer instead of
    three) and the adapters off. The merged weights are new tensors swapped in for the duration and
    the original base tensors put back untouched: no merge/unmerge arithmetic drifts them, so a
    resumed run continues bit for bit. Models without adapters, 4-bit layers, and models with any
    LoRA layer lora_factors does not describe are left as they are."""
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
    (out/16, 16, in) and x times every block's transpose in one batched matmul. At the few rows of
    a decode step this keeps CPU matmul kernels busier than one x @ W.T (docs/performance.md); the
    same outputs up to float summation order. It reads the wrapped layer's weight at each call, so
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
          cache=cache, use_cache=True, logits_to_keep=1)
    for layer in cache.layers:                                        # (B, ...) -> (B*G, ...)
        layer.keys = layer.keys.repeat_interleave(group_size, 0)
        layer.values = layer.values.repeat_interleave(group_size, 0)
    return cache


def sample_next(logits, temperature=1.0, top_p=1.0):
    """One token per row from softmax(logits / temperature), restricted to the top_p nucleus as
    transformers' TopPLogitsWarper does (top_k = 0: no top-k cut). Drawn by inverting the
    cumulative distribution with one uniform per row: the same distribution as `generate`'s
    torch.multinomial, without its (rows, V) exponential draws.
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


def decode(forward, last_ids, attn, max_new_tokens, min_new_tokens, eos, pad_id, temperature=1.0, top_p=1.0):
    """Sample completions after a pre-filled cache, one token per row per forward, as
    `generate(do_sample=True, top_k=0)` does: EOS barred before min_new_tokens, rows that have
    emitted an EOS continue with pad_id, and it stops when every row has one.
    forward(ids (N, 1), positions (N, 1), attention mask (N, S)) -> next-token logits (N, V), the
    cache's own update included; last_ids (N, 1): the prompts' last tokens (not in the cache);
    attn (N, P) -> (N, L) tokens."""
    eos_t = torch.tensor(eos, device=last_ids.device)
    pos = positions(attn)[:, -1:]                                     # (N, 1)
    done = torch.zeros(last_ids.shape[0], dtype=torch.bool, device=last_ids.device)
    ids, out = last_ids, []
    for t in range(max_new_tokens):
        logits = forward(ids, pos, attn)                              # (N, V)
        if t < min_new_tokens:
            logits[:, eos_t] = float("-inf")
        nxt = sample_next(logits, temperature, top_p).masked_fill_(done, pad_id)    # (N,)
        out.append(nxt)
        done |= torch.isin(nxt, eos_t)
        if done.all():
            break
        ids, pos = nxt[:, None], pos + 1
        attn = torch.cat([attn, attn.new_ones(attn.shape[0], 1)], dim=1)           # (N, P + t + 1)
    return torch.stack(out, dim=1)                                    # (N, L)
