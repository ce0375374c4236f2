"""The merged sampling path (--rollout merged): sample from a plain copy of the policy whose Linear
layers hold the LoRA merged into dequantized weights, with a static KV cache.

For GPUs, where `generate` through bitsandbytes 4-bit layers with LoRA beside them launches several
small kernels per projection and per token. One copy per policy is built at its first rollout and
kept: every later rollout writes the merged weights into it in place (NF4 dequantized once per step,
the current adapters merged in the sampling dtype), so its tensors keep their addresses (what the
compiled decode step and CUDA graphs were built on) and no second copy ever exists -- a copy made
anew each step would outlive the step, since transformers' compiled call holds a reference cycle
through the model that only the cycle collector breaks. memory.py counts the copy in every stage.
On CUDA transformers compiles the decode step of a model with a static cache (torch.compile);
elsewhere it runs eagerly. Same distribution as `generate` through the policy, up to the rounding of the merged
weights (PEFT: merging LoRA into quantized weights is lossy, so the copy is dense, never re-quantized).

merged_copy(model)     the plain model, or None when a layer cannot be merged (DoRA, LoRA bias)
merged_sampler(model)  the policy's one persistent copy, refreshed in place with the current adapters
sample(...)            G completions per prompt through the copy; on out-of-memory the copy is freed and this
                       rollout and every later one of the policy go through `generate` instead
generate_kwargs(...)   what `model.generate` is given for this path
PAD_MULTIPLE           prompts are left-padded to a multiple of this, so the static cache (and the
                       compiled step) see few distinct lengths
"""
import copy
import gc
import weakref

import torch

from cpu_rollout import lora_factors

PAD_MULTIPLE = 64


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
    return plain.eval()


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


def generate_kwargs(device):
    """A static KV cache; transformers compiles the decode step on CUDA and not elsewhere."""
    return {"cache_implementation": "static", "disable_compile": torch.device(device).type != "cuda"}


def sample(model, generate, ids, attn, group_size, *args, **kw):
    """`generate` (rollout.generate's signature after its model) through the policy's merged copy; when the copy
    runs out of memory (building, refreshing or sampling), it is freed, one line says so, and this rollout --
    then every later one of the policy -- samples through the policy itself: no step is lost."""
    if model not in _FELL_BACK:
        try:
            plain = merged_sampler(model)
            if plain is not None:
                return generate(plain, ids, attn, group_size, *args, **kw, **generate_kwargs(ids.device))
        except torch.OutOfMemoryError as e:
            why = str(e).splitlines()[0] if str(e) else "out of memory"
        else:
            why = None
        if why is not None:                             # out of the except block: its traceback holds the copy
            _SAMPLERS.pop(model, None)
            _FELL_BACK.add(model)
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            print(f"sampler: the merged copy ran out of memory ({why}); freed, this rollout and the rest of the run "
                  f"sample through generate", flush=True)
    return generate(model, ids, attn, group_size, *args, **kw)

