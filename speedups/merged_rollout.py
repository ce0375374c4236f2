"""The merged sampling path (--rollout merged): sample from a plain copy of the policy whose Linear
layers hold the LoRA merged into dequantized weights, through a decode loop of its own.

For GPUs, where `generate` through bitsandbytes 4-bit layers with LoRA beside them launches several
small kernels per projection and per token. One copy per policy is built at its first rollout and
kept: every later rollout writes the merged weights into it in place (NF4 dequantized once per step,
the current adapters merged in the sampling dtype), so its tensors keep their addresses (what the
compiled decode step and CUDA graphs were built on) and no second copy ever exists. speedups/memory.py counts
the copy in every stage, and its first use (build, compile, graph capture) in `first`. The decode loop
(Decoder) keeps one static KV cache and one shape for the run, samples on the device and checks for
the group's last EOS every CHECK_EVERY tokens, not every token as `generate` does; on CUDA its decode step
is compiled once with CUDA graphs. Same distribution as `generate` through the policy, up to the rounding
of the merged weights (PEFT: merging LoRA into quantized weights is lossy, so the copy is dense, never
re-quantized).

merged_copy(model)     the plain model, or None when a layer cannot be merged (DoRA, LoRA bias)
merged_sampler(model)  the policy's one persistent copy, refreshed in place with the current adapters
Decoder, reserve(...)  the decode loop, sized once to the run's most rows and longest prompt
sample(...)            G completions per prompt through the copy; on out-of-memory the copy is freed and this
                       rollout and every later one of the policy go through `generate` instead
PAD_MULTIPLE           prompts are left-padded to a multiple of this (the loop's prompt width rounds to it)
grouped_sdpa           the copy's attention: SDPA with one query token's heads grouped onto their K/V head
use_attention(model, n) the kept copy attends with another implementation from its next rollout
"""
import copy
import gc
import weakref

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from speedups.cpu_decoder import lora_factors

PAD_MULTIPLE = 64
ATTENTION = "gtpo_grouped_sdpa"     # the copy's attention implementation (grouped_sdpa), as transformers knows it


def dense_weight(layer, dtype):
    """(out, in) weight of a Linear or a bitsandbytes Linear4bit, as a new tensor in `dtype`."""
    w = layer.weight
    if hasattr(w, "quant_state"):                                     # NF4: dequantize once
        import bitsandbytes.functional as bnbf
        data, state = w.data, w.quant_state
        if getattr(state, "packing_format_for_cpu", False):         # an AVX-512 CPU's repacked layout;
            data, state = bnbf._convert_weight_packed_for_cpu_inverse(data, copy.copy(state))  # it edits the state
        return bnbf.dequantize_4bit(data, state).to(dtype)
    return w.detach().to(dtype, copy=True)


def merged_copy(model, dtype=None):
    """A plain transformers model (no PEFT, no 4-bit) for sampling: each LoRA layer's weight is
    dense(W) + sum scale * B A in `dtype` (default: the embeddings' dtype), other quantized layers are
    dequantized, and every other parameter (embeddings, norms, LM head) is the policy's own tensor,
    shared, not copied. None when some LoRA layer is of a kind lora_factors does not describe."""
    from peft.tuners.lora import LoraLayer
    from transformers import AutoModelForCausalLM
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    dtype = dtype or base.get_input_embeddings().weight.dtype
    state = {}
    for name, module in base.named_modules():
        if isinstance(module, LoraLayer):
            factors = lora_factors(module)
            if factors is None:
                return None
            layer = module.get_base_layer()
            w = dense_weight(layer, dtype)                                            # (out, in)
            for B, A, scale in factors:                                               # (out, r), (r, in)
                w.addmm_(B.to(dtype), A.to(dtype), alpha=scale)
            state[f"{name}.weight"] = w
            if layer.bias is not None:
                state[f"{name}.bias"] = layer.bias
        elif hasattr(getattr(module, "weight", None), "quant_state"):
            state[f"{name}.weight"] = dense_weight(module, dtype)
    for name, p in base.named_parameters():
        if "lora_" not in name:
            state.setdefault(name.replace(".base_layer.", "."), p.detach())
    config = copy.deepcopy(base.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=dtype)
    plain.load_state_dict(state, strict=False, assign=True)
    if getattr(config, "tie_word_embeddings", False):
        plain.tie_weights()
    own = dict(base.named_buffers())
    for name, buf in list(plain.named_buffers()):                     # rotary frequencies (not saved)
        module, _, key = name.rpartition(".")
        plain.get_submodule(module)._buffers[key] = own[name]
    missing = [n for n, p in plain.named_parameters() if p.is_meta]
    if missing:
        raise RuntimeError(f"merged copy: no weights for {missing[:3]}")
    plain.generation_config = base.generation_config
    if plain.config._attn_implementation == "sdpa":
        group_query_heads(plain)
    return plain.eval()


def grouped_sdpa(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
    """transformers' SDPA attention, but one query token's heads grouped onto their K/V head under torch.compile
    too: q (B, H, 1, D) -> (B, H_kv, H / H_kv, D) against K, V (B, H_kv, L, D) as they are. transformers does the
    same in eager mode; compiled with a mask (the decode step always passes one) it repeats K and V to H heads
    over the whole static cache at every token instead, H / H_kv times the cache's bytes read and written."""
    groups = getattr(module, "num_key_value_groups", 1)
    if query.shape[2] != 1 or groups == 1 or (attention_mask is not None and attention_mask.shape[1] != 1):
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kw)
    B, H, _, D = query.shape
    out = torch.nn.functional.scaled_dot_product_attention(
        query.reshape(B, H // groups, groups, D), key, value, attn_mask=attention_mask, dropout_p=dropout,
        scale=scaling)                                                              # (B, H_kv, groups, D)
    return out.reshape(B, H, 1, D).transpose(1, 2).contiguous(), None              # (B, 1, H, D)


def group_query_heads(plain, name=ATTENTION):
    """The copy attends with grouped_sdpa (registered with transformers under `name`, SDPA's masks)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    AttentionInterface.register(name, grouped_sdpa)
    AttentionMaskInterface.register(name, sdpa_mask)
    plain.set_attn_implementation(name)


def use_attention(model, name):
    """The policy's kept copy attends with `name` ("sdpa", ATTENTION, ...) from its next rollout: a new decode
    loop, since the compiled one holds the old attention."""
    merged_sampler(model).set_attn_implementation(name)
    _DECODERS.pop(model, None)


_SAMPLERS = weakref.WeakKeyDictionary()         # policy -> its merged copy (gone with the policy)
_FELL_BACK = weakref.WeakSet()                  # policies whose copy ran out of memory: `generate` from then on


def merged_sampler(model):
    """The policy's merged copy for this rollout: built once (merged_copy), then refreshed in place,
    each LoRA layer's weight overwritten with dense(W) + sum scale * B A of the current adapters.
    None when merged_copy is (a layer it cannot merge)."""
    from peft.tuners.lora import LoraLayer
    plain = _SAMPLERS.get(model)
    if plain is None:
        plain = merged_copy(model)
        if plain is not None:
            _SAMPLERS[model] = plain
        return plain
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    with torch.no_grad():
        for name, module in base.named_modules():
            if isinstance(module, LoraLayer):
                w = plain.get_submodule(name).weight                                  # (out, in), kept
                w.copy_(dense_weight(module.get_base_layer(), w.dtype))
                for B, A, scale in lora_factors(module):                              # (out, r), (r, in)
                    w.addmm_(B.to(w.dtype), A.to(w.dtype), alpha=scale)
    return plain


CHECK_EVERY = 16              # decode steps between checks for the group's last EOS: each check waits for the device
_DECODERS = weakref.WeakKeyDictionary()         # policy -> the Decoder its copy samples with


def compile_options(device):
    """torch.compile's arguments for the decode step: CUDA graphs on CUDA; None (eager) elsewhere."""
    return dict(mode="reduce-overhead", fullgraph=True) if torch.device(device).type == "cuda" else None


def pick(logits, temperature, top_p):
    """(R, V) fp32 logits -> (R,) tokens, on the device: the argmax when temperature is 0, else a draw from
    softmax(logits / temperature) restricted to the top-p nucleus (as transformers' TopPLogitsWarper keeps it),
    by the exponential race -- argmax_i p_i / E_i with E_i ~ Exp(1) is distributed as p -- which needs no host
    sync, unlike torch.multinomial."""
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_p < 1.0:
        ascending, order = logits.sort(-1)
        drop = ascending.softmax(-1).cumsum(-1) <= 1 - top_p
        drop[:, -1] = False                                                  # keep at least the top token
        logits = logits.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    probs = logits.softmax(-1)
    return (probs / torch.empty_like(probs).exponential_(1)).argmax(-1)


class Decoder:
    """The copy's own decode loop, in gpt-fast's manner: a static KV cache of `rows` rows over prompt_len +
    max_new positions, made once; every rollout's prompts left-padded to prompt_len and its rows padded to
    `rows` (the padding rows' output dropped), so the one decode step -- the forward of one token and its draw,
    on the device -- has one shape for the whole run and compiles once (compile_options)."""

    def __init__(self, plain, rows, prompt_len, max_new, options):
        from transformers import StaticCache
        self.rows, self.prompt_len, self.max_new = rows, prompt_len, max_new
        self.cache = StaticCache(config=plain.config, max_cache_len=prompt_len + max_new)
        self.step = torch.compile(self._step, **options) if options is not None else self._step
        self.compiles = 0

    def _step(self, plain, tokens, positions, mask, bias, temperature, top_p):
        out = plain(input_ids=tokens[:, None], attention_mask=mask, position_ids=positions[:, None], cache=self.cache,
                    use_cache=True)
        return pick(out.logits[:, -1].float() + bias, temperature, top_p)                 # (rows,)

    def fits(self, rows, prompt_len, max_new):
        return rows <= self.rows and prompt_len <= self.prompt_len and max_new <= self.max_new

    @torch.no_grad()
    def __call__(self, plain, ids, attn, group_size, max_new, min_new, eos, pad, temperature=1.0, top_p=1.0):
        """As rollout.generate: ids, attn (B, P) left-padded -> tokens (B*G, <= max_new), with every row's tokens
        up to its first EOS as `generate` would draw them (later tokens are the caller's to mask)."""
        from torch._dynamo.utils import counters
        n, dev = ids.shape[0] * group_size, ids.device
        R, P, V = self.rows, self.prompt_len, plain.config.vocab_size
        grid = torch.full((R, P), pad, dtype=ids.dtype, device=dev)                     # (R, P) left-padded
        grid[:n, P - ids.shape[1]:] = ids.repeat_interleave(group_size, 0)
        seen = torch.zeros(R, P + self.max_new, dtype=attn.dtype, device=dev)           # (R, P + max_new)
        seen[:n, P - ids.shape[1]:P] = attn.repeat_interleave(group_size, 0)
        seen[n:, P - 1] = 1                                                              # padding rows: one token
        seen[:, P:] = 1                                                                  # later: causal masking
        positions = (seen[:, :P].long().cumsum(-1) - 1).masked_fill(seen[:, :P] == 0, 1)  # as transformers'
        eos_t = torch.tensor(eos, device=dev)
        free, no_eos = torch.zeros(V, device=dev), torch.zeros(V, device=dev)
        no_eos[eos_t] = float("-inf")                                                    # before min_new tokens
        self.cache.reset()
        logits = plain(input_ids=grid, attention_mask=seen[:, :P], position_ids=positions, cache=self.cache,
                       use_cache=True, logits_to_keep=1).logits[:, -1].float()
        out = torch.full((R, max_new), pad, dtype=ids.dtype, device=dev)
        out[:, 0] = pick(logits + (no_eos if min_new > 0 else free), temperature, top_p)
        done, pos, before = torch.isin(out[:, 0], eos_t), positions[:, -1] + 1, counters["stats"]["unique_graphs"]
        for t in range(1, max_new):
            out[:, t] = self.step(plain, out[:, t - 1], pos, seen, no_eos if t < min_new else free, temperature,
                                  top_p)
            done |= torch.isin(out[:, t], eos_t)
            pos += 1
            if t % CHECK_EVERY == 0 and bool(done[:n].all()):                           # the group's last EOS
                out = out[:, :t + 1]
                break
        new = counters["stats"]["unique_graphs"] - before
        if new:
            self.compiles += new
            print(f"sampler: the decode step compiled ({self.compiles} in this run)", flush=True)
        return out[:n]


def decoder(model, plain, rows, prompt_len, max_new):
    """The policy's Decoder, made at its first use for at least this size (or by reserve()), and made again,
    larger, only when a rollout does not fit it."""
    d = _DECODERS.get(model)
    if d is None or not d.fits(rows, prompt_len, max_new):
        if d is not None:
            rows, prompt_len, max_new = max(rows, d.rows), max(prompt_len, d.prompt_len), max(max_new, d.max_new)
        d = _DECODERS[model] = Decoder(plain, rows, prompt_len, max_new,
                                       compile_options(plain.get_input_embeddings().weight.device))
    return d


def reserve(model, rows, prompt_tokens, max_new):
    """Size the policy's decode loop once, before the first rollout, to the run's most rows per rollout and its
    longest prompt (rounded up to PAD_MULTIPLE): one compiled shape for the whole run."""
    plain = merged_sampler(model)
    if plain is not None:
        decoder(model, plain, rows, -(-prompt_tokens // PAD_MULTIPLE) * PAD_MULTIPLE, max_new)


def sample(model, generate, ids, attn, group_size, *args, **kw):
    """G samples per prompt through the policy's merged copy and its Decoder (arguments as rollout.generate's
    after its model); when the copy runs out of memory (building, refreshing or sampling), it is freed, one line
    says so, and this rollout -- then every later one of the policy -- samples through `generate` and the policy
    itself: no step is lost."""
    if model not in _FELL_BACK:
        try:
            plain = merged_sampler(model)
            if plain is not None:
                max_new = args[0] if args else kw["max_new_tokens"]
                return decoder(model, plain, ids.shape[0] * group_size, ids.shape[1], max_new)(
                    plain, ids, attn, group_size, *args, **kw)
        except torch.OutOfMemoryError as e:
            why = str(e).splitlines()[0] if str(e) else "out of memory"
        else:
            why = None
        if why is not None:                             # out of the except block: its traceback holds the copy
            _SAMPLERS.pop(model, None)
            _DECODERS.pop(model, None)
            _FELL_BACK.add(model)
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            print(f"sampler: the merged copy ran out of memory ({why}); freed, this rollout and the rest of the run "
                  f"sample through generate", flush=True)
    return generate(model, ids, attn, group_size, *args, **kw)

