"""The CPU decode step of a Llama-family decoder in plain tensor ops: what cpu_rollout's loop calls
for each sampled token when the model is one it describes (supports), in place of the model's forward.

At the few rows of a decode step the time goes to reading weights and to per-op overhead, so it
computes the same layers as transformers' Llama (RMSNorm, rotary, grouped-query attention, SwiGLU)
with fewer, larger matmuls -- q, k and v as one, gate and up as one -- over weights packed for
few-row products, each LoRA merged into its packed copy. The same outputs up to float summation order.
The packed copies live for one rollout: kept between rollouts they would add the weights' size to the
gradient pass's peak memory.

lora_factors(layer)  what a PEFT LoRA layer adds to its base weight (also merged_rollout's and cpu_rollout's)
supports(model)      a Llama/Qwen2-style model with plain float Linear layers on CPU and mergeable LoRA
Decoder(model)       packed copies of the model's current weights (one rollout's), and its decode step:
Decoder.step         (ids, positions, keep, cache) -> next-token logits
linear(x, w)         x times a weight packed as (out/16, in, 16) blocks
"""
import torch
import torch.nn.functional as F

BLOCK = 16                  # output features per block of a packed weight
MODEL_TYPES = ("llama", "qwen2")


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


def _base(model):
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _projections(layer):
    a, m = layer.self_attn, layer.mlp
    return [a.q_proj, a.k_proj, a.v_proj], [a.o_proj], [m.gate_proj, m.up_proj], [m.down_proj]


def _linear(module):
    """The nn.Linear a module computes with: a PEFT layer's base layer, or the module itself."""
    return getattr(module, "base_layer", module)


def supports(model):
    """Whether Decoder computes what `model` computes: a Llama or Qwen2 architecture (no sliding
    window, SiLU MLP) whose projections and head are plain float Linear layers on CPU, with LoRA
    adapters (if any) that lora_factors describes."""
    from peft.tuners.lora import LoraLayer
    base = _base(model)
    cfg, inner = base.config, getattr(base, "model", None)
    if cfg.model_type not in MODEL_TYPES or getattr(cfg, "use_sliding_window", False) or inner is None:
        return False
    if getattr(cfg, "hidden_act", "silu") != "silu" or not hasattr(inner, "rotary_emb"):
        return False
    modules = [base.get_output_embeddings()] + [m for layer in inner.layers for group in _projections(layer)
                                                for m in group]
    return all(type(_linear(m)) is torch.nn.Linear and _linear(m).weight.device.type == "cpu"
               and _linear(m).weight.is_floating_point()
               and (not isinstance(m, LoraLayer) or lora_factors(m) is not None) for m in modules)


class Packed:
    """The modules of one fused product (q, k, v; gate, up; ...) and their current weights, LoRA
    merged, stacked in one buffer: (out/16, in, 16) when every module's output size is a multiple
    of 16, else (out, in)."""

    def __init__(self, modules):
        ws = [_linear(m).weight for m in modules]
        self.modules, self.sizes = modules, [w.shape[0] for w in ws]
        out, d_in = sum(self.sizes), ws[0].shape[1]
        self.blocked = all(n % BLOCK == 0 for n in self.sizes)
        shape = (out // BLOCK, d_in, BLOCK) if self.blocked else (out, d_in)
        self.weight = torch.empty(shape, dtype=ws[0].dtype)
        biases = [_linear(m).bias for m in modules]
        self.bias = None if all(b is None for b in biases) else torch.cat(
            [b.detach() if b is not None else w.new_zeros(w.shape[0]) for b, w in zip(biases, ws)])
        self.write()

    @torch.no_grad()
    def write(self):
        """Write each module's W + sum scale * B A into its slice of the buffer."""
        start = 0
        for m, n in zip(self.modules, self.sizes):
            w = _linear(m).weight                                               # (n, in)
            factors = lora_factors(m) if hasattr(m, "lora_A") else []
            if self.blocked:
                dst = self.weight[start // BLOCK:(start + n) // BLOCK]          # (n/16, in, 16)
                dst.copy_(w.view(-1, BLOCK, w.shape[1]).transpose(1, 2))
                for B, A, scale in factors:                                     # (n, r), (r, in)
                    dst.baddbmm_(A.t().to(w.dtype).expand(dst.shape[0], *A.t().shape),
                                 B.to(w.dtype).view(-1, BLOCK, B.shape[1]).transpose(1, 2), alpha=scale)
            else:
                dst = self.weight[start:start + n]                              # (n, in)
                dst.copy_(w)
                for B, A, scale in factors:
                    dst.addmm_(B.to(w.dtype), A.to(w.dtype), alpha=scale)
            start += n

    def __call__(self, x):                                                      # (N, in) -> (N, out)
        return linear(x, self.weight, self.bias)


def linear(x, w, bias=None):
    """x (N, in) times w: (out/16, in, 16) blocks, one batched matmul (a few rows read each block
    in the layout that suits them), or a plain (out, in) weight -> (N, out), plus bias."""
    if w.dim() == 2:
        return F.linear(x, w, bias)
    y = torch.bmm(x.expand(w.shape[0], *x.shape), w)                            # (out/16, N, 16)
    y = y.transpose(0, 1).reshape(x.shape[0], -1)                               # (N, out)
    return y if bias is None else y + bias


def rms_norm(x, norm):
    """A Llama/Qwen2 RMSNorm module's output, as one op: x / rms(x) * weight."""
    return F.rms_norm(x, x.shape[-1:], norm.weight, norm.variance_epsilon)


def rotate(x, cos, sin):
    """Rotary embedding of x (N, heads, d) at each row's position: cos, sin (N, 1, d) as the model's
    rotary module gives them (Llama's rotate-half convention)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class Layer:
    """One decoder layer: its norms (the model's own modules) and its packed products."""

    def __init__(self, layer):
        self.ln1, self.ln2 = layer.input_layernorm, layer.post_attention_layernorm
        self.qkv, self.o, self.gate_up, self.down = (Packed(group) for group in _projections(layer))
        self.products = (self.qkv, self.o, self.gate_up, self.down)


class Decoder:
    """A model's decode step over packed copies of its current weights; embeddings, norms and rotary
    frequencies are the model's own modules."""

    def __init__(self, model):
        base = _base(model)
        cfg, inner = base.config, base.model
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.scale = self.head_dim ** -0.5
        self.embed, self.norm, self.rotary = inner.embed_tokens, inner.norm, inner.rotary_emb
        self.layers = [Layer(layer) for layer in inner.layers]
        self.head = Packed([base.get_output_embeddings()])

    def attention(self, x, layer, cache, cos, sin, keep):
        """x (N, D) normed; cache: the layer's cpu_rollout.FilledStaticLayer, written at its next
        position; keep (N, 1, 1, S) the positions each row attends to -> (N, D)."""
        N, H, Hkv, d = x.shape[0], self.heads, self.kv_heads, self.head_dim
        qk, v = layer.qkv(x).split([(H + Hkv) * d, Hkv * d], dim=-1)              # (N, (H + Hkv) d), (N, Hkv d)
        qk = rotate(qk.view(N, H + Hkv, d), cos, sin)                             # q and k heads at once
        q, k = qk[:, :H], qk[:, H:, None]                                          # (N, H, d), (N, Hkv, 1, d)
        t = cache.filled
        cache.keys[:, :, t:t + 1] = k                                               # (N, Hkv, max_len, d)
        cache.values[:, :, t:t + 1] = v.view(N, Hkv, 1, d)
        cache.filled = t + 1
        out = F.scaled_dot_product_attention(                                      # query heads grouped on
            q.reshape(N, Hkv, H // Hkv, d), cache.keys[:, :, :t + 1], cache.values[:, :, :t + 1],  # their K/V head
            attn_mask=keep, scale=self.scale)                                      # (N, Hkv, H / Hkv, d)
        return layer.o(out.reshape(N, H * d))

    @torch.no_grad()
    def step(self, ids, pos, keep, cache):
        """ids (N,) the last tokens, pos (N,) their positions, keep (N, S) bool over the cached
        positions and this one, cache: cpu_rollout.prefill_shared's -> logits (N, V)."""
        x = self.embed(ids)                                                        # (N, D)
        cos, sin = self.rotary(x[:, None], pos[:, None])                           # (N, 1, d)
        keep = keep[:, None, None, :]                                              # (N, 1, 1, S)
        for layer, layer_cache in zip(self.layers, cache.layers):
            x = x + self.attention(rms_norm(x, layer.ln1), layer, layer_cache, cos, sin, keep)
            gate, up = layer.gate_up(rms_norm(x, layer.ln2)).chunk(2, dim=-1)      # (N, I) x 2
            x = x + layer.down(F.silu(gate) * up)
        return self.head(rms_norm(x, self.norm))
