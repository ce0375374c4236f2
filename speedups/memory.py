"""Peak GPU memory of one training step by stage, known before the run: no GPU, no weights.

    python -m bench --parts memory --model llama-8b     # the table; train.py uses plan() on CUDA

estimate(config, Settings) -> {stage: bytes}, stages as the step runs them (step.rl_step):
  weights     the base model as loaded: every decoder Linear in NF4 4-bit (bitsandbytes, block 64,
              double quantization) or in the weights' dtype; embeddings, norms and LM head unquantized
  trainable   LoRA (or all) parameters in fp32 and the optimizer's state (8-bit AdamW: 2 bytes each)
  ranks       with several ranks, DDP's gradient buckets: the gradients themselves (bucket views), but
              allocated when the model is wrapped and held through every stage, sampling included
  sampler     with --rollout merged, the sampler's kept copy of the Linear layers (speedups/merged_rollout.py)
  h_ini       + <H>_ini's measurement (Sec. 6, step.initial_entropy): 8 prompts sampled once each,
              then a no-grad pass over them (every layer's hidden states, one LM-head chunk)
  sampling    + the KV cache of the B x G rows over prompt + completion, the prefill's widest
              temporaries, the decode step's fp32 logits
  gradient    + the trainable gradients (one rank) and one micro-batch's saved activations: every
              layer's, or with checkpointing only each layer's input plus one layer recomputed in
              backward; backward's in-flight gradients (one layer's worth); the LM head's chunk
              (speedups.logprobs.ChunkedLogprobs) and its fp32 copy of the head weight
  step        the larger of sampling and gradient: a training step's peak (what measured_peak measures)
pick_sampler(...) an evaluation's sampler on CUDA (eval.py, machinery/heldout.py): the merged copy where it fits
  first       with the merged sampler, what its first use adds once (at <H>_ini or step 1): one Linear's dense
              temporary while the copy is built (merged_rollout.merged_copy) and the compile and CUDA-graph
              capture of the decode step (FIRST_STEP_SHARE of the copy, from a GPU's measurement: on the CPU
              the decode step is not compiled, so this part cannot be counted there)
  peak        the largest stage, <H>_ini's included, plus first: the most tensor memory the run holds at once
  card        what the GPU must have: peak plus the allocator's slack (ALLOCATOR_SLACK of it) and
              the CUDA context (and NCCL's buffers with several ranks), which torch's allocator never
              sees (CONTEXT_BYTES, NCCL_BYTES: allowances to be replaced by a GPU's measurement,
              docs/performance.md)
Activation bytes per token come from one forward of a 1- and a 2-layer model of the same width on
fake tensors (FakeTensorMode: nothing allocated), counting what autograd saves for backward under
the run's precision (models.autocast); everything else is counted from the parameter shapes.
"""
import contextlib
import dataclasses
import functools
import json
from dataclasses import dataclass

import torch

GB = 1e9
# The paper's models (App. 16.2) and the 1B shape the GPU checks use, as their config.json has them.
SHAPES = {
    "llama-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                     num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False),
    "qwen2.5-3b": dict(model_type="qwen2", hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                       num_attention_heads=16, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "llama-1b": dict(model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                     num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True),
}
NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)       # 4 bits + int8 absmax per 64 + fp32 absmax per 256 blocks
OPTIMIZER_BYTES = {"adamw_8bit": 2 + 8 / 256, "adamw_torch": 8}    # state per trainable parameter
H_INI_ROWS = 8                                  # prompts per rollout call of step.initial_entropy
CONTEXT_BYTES = 0.6e9                           # CUDA context + cuBLAS workspace, outside torch's allocator
NCCL_BYTES = 0.5e9                              # NCCL's communicator buffers per rank
ALLOCATOR_SLACK = 0.05                          # fragmentation with expandable segments (train.py sets them)
FIRST_STEP_SHARE = 0.38                         # the merged sampler's first use above the estimate, per byte of
                                                # its copy: a GPU's measurement (docs/performance.md §8)
HEADROOM = 0.9                                  # merged only where its step, first use included, fits 90 % of it


@dataclass
class Settings:
    """What a step's memory depends on; from_config reads them off a train.py Config."""
    lora_rank: int = 128
    load_in_4bit: bool = True
    dtype_bytes: int = 2                # weights and activations: 2 = bf16 (CUDA), 4 = fp32 (CPU)
    autocast: bool = True               # models.autocast: bf16 LoRA matmuls and attention
    batch_size: int = 1                 # prompts per rank
    generation_size: int = 12
    prompt_tokens: int = 250
    completion_tokens: int = 1500
    micro_batch_size: int = 0           # 0 = all B x G completions at once
    gradient_checkpointing: bool = True
    share_prompt: bool = False
    logprob_chunk: int = 256
    optimizer: str = "adamw_8bit"
    sampler: str = "generate"           # "merged": a bf16 copy with LoRA merged (rollout.py)
    world_size: int = 1                 # ranks (torchrun --nproc_per_node), one GPU each

    @classmethod
    def from_config(cls, cfg, prompt_tokens, dtype_bytes, world_size=1):
        return cls(lora_rank=cfg.lora_rank, load_in_4bit=cfg.load_in_4bit, dtype_bytes=dtype_bytes,
                   autocast=dtype_bytes == 2, batch_size=cfg.batch_size, generation_size=cfg.generation_size,
                   prompt_tokens=prompt_tokens, completion_tokens=cfg.max_completion_length,
                   micro_batch_size=cfg.micro_batch_size or 0,
                   gradient_checkpointing=bool(cfg.gradient_checkpointing), share_prompt=cfg.share_prompt,
                   logprob_chunk=cfg.logprob_chunk, optimizer=cfg.optimizer,
                   sampler="merged" if cfg.rollout == "merged" else "generate", world_size=world_size)


def model_config(name):
    """transformers config of an alias in SHAPES, the embedded model, or a model folder (no weights)."""
    from transformers import AutoConfig
    if name in SHAPES:
        kw = dict(SHAPES[name])
        return AutoConfig.for_model(kw.pop("model_type"), **kw)
    if name == "smollm2-135m":
        from machinery.models import embedded_model_dir
        name = embedded_model_dir()
    return AutoConfig.from_pretrained(name)


def meta_model(config, layers=None, dtype=torch.bfloat16, lora_rank=0, device="meta"):
    """The model on the meta device (shapes only; or random weights on `device`), with `layers`
    decoder layers and LoRA as models.load_model puts it."""
    import copy
    from transformers import AutoModelForCausalLM
    config = copy.deepcopy(config)
    if layers is not None:
        config.num_hidden_layers = layers
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if lora_rank > 0:
        from peft import LoraConfig, get_peft_model
        from machinery.models import LORA_TARGETS, quiet_peft
        targets = [t for t in LORA_TARGETS if any(n.endswith(t) for n, _ in model.named_modules())]
        with quiet_peft():
            model = get_peft_model(model, LoraConfig(r=lora_rank, lora_alpha=lora_rank, target_modules=targets))
    return model


def _key(config):
    """The config as hashable JSON (for the caches), without what loading adds (quantization)."""
    d = config.to_dict()
    for k in ("quantization_config", "_name_or_path", "transformers_version", "torch_dtype", "dtype"):
        d.pop(k, None)
    return json.dumps(d, sort_keys=True, default=str)


def _config(key):
    from transformers import AutoConfig
    d = json.loads(key)
    return AutoConfig.for_model(d.pop("model_type"), **d)


@functools.lru_cache(maxsize=32)
def param_counts(key, lora_rank):
    """(decoder Linear weights, other base parameters, trainable parameters) in elements: counted on copies
    with one and two decoder layers, whose difference is one layer's, and extended to the model's layers
    (building all of an 8B model's layers, even on the meta device, takes seconds)."""
    config = _config(key)
    one, two = (_layer_counts(config, layers, lora_rank) for layers in (1, 2))
    return tuple(a + (config.num_hidden_layers - 1) * (b - a) for a, b in zip(one, two))


def _layer_counts(config, layers, lora_rank):
    model = meta_model(config, layers, lora_rank=lora_rank)
    head = model.get_output_embeddings()
    linear, seen = 0, set()
    for name, m in model.named_modules():
        w = getattr(m, "weight", None)
        if type(m) is torch.nn.Linear and m is not head and "lora_" not in name and id(w) not in seen:
            linear += w.numel()
            seen.add(id(w))
    total = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad) if lora_rank else total
    base = total - (trainable if lora_rank else 0)
    return linear, base - linear, trainable


def _fake_params(model):
    """Every parameter and buffer as a fake tensor of its shape and dtype (inside FakeTensorMode)."""
    for m in model.modules():
        for n, p in list(m._parameters.items()):
            if p is not None:
                m._parameters[n] = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype), p.requires_grad)
        for n, b in list(m._buffers.items()):
            if b is not None:
                m._buffers[n] = torch.ones(b.shape, dtype=b.dtype)


def _saved_bytes(config, layers, tokens, s):
    """Bytes autograd keeps for backward after one forward of `tokens` tokens (parameters excluded)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    dtype = torch.bfloat16 if s.dtype_bytes == 2 else torch.float32
    model = meta_model(config, layers, dtype, s.lora_rank)
    with FakeTensorMode():
        _fake_params(model)
        params = {p.untyped_storage()._cdata for p in model.parameters()}
        saved = {}

        def pack(t):
            st = t.untyped_storage()
            if st._cdata not in params:
                saved[st._cdata] = st.nbytes()
            return t
        ids = torch.zeros(1, tokens, dtype=torch.long)
        amp = torch.autocast("cpu", torch.bfloat16) if s.autocast else contextlib.nullcontext()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), amp:
            model(input_ids=ids, use_cache=False, output_hidden_states=True, logits_to_keep=1)
    return sum(saved.values())


@functools.lru_cache(maxsize=64)
def _rates(key, lora_rank, dtype_bytes, autocast):
    config = _config(key)
    s = Settings(lora_rank=lora_rank, dtype_bytes=dtype_bytes, autocast=autocast)
    t1, t2 = 64, 128                                    # two lengths: the slope drops per-call constants
    one = (_saved_bytes(config, 1, t2, s) - _saved_bytes(config, 1, t1, s)) / (t2 - t1)
    two = (_saved_bytes(config, 2, t2, s) - _saved_bytes(config, 2, t1, s)) / (t2 - t1)
    return two - one, one - (two - one)


def activation_rates(config, s):
    """(bytes saved per token per decoder layer, per token outside the layers) without checkpointing."""
    return _rates(_key(config), s.lora_rank, s.dtype_bytes, s.autocast)


def estimate(config, s):
    """{stage: bytes} of one step (module docstring) for `config` (a transformers config) and s."""
    linear, other, trainable = param_counts(_key(config), s.lora_rank)
    D, V, L = config.hidden_size, config.vocab_size, config.num_hidden_layers
    kv_dim = config.num_key_value_heads * (getattr(config, "head_dim", None) or D // config.num_attention_heads)
    b = s.dtype_bytes
    out = {"weights": linear * (NF4_BYTES if s.load_in_4bit else b) + other * b}
    out["trainable"] = trainable * (4 + OPTIMIZER_BYTES[s.optimizer])
    out["ranks"] = trainable * 4 if s.world_size > 1 else 0              # DDP's buckets = the gradients
    out["sampler"] = linear * 2 if s.sampler == "merged" else 0          # dense bf16 Linear layers, kept
    held = out["weights"] + out["trainable"] + out["ranks"] + out["sampler"]
    P, C = s.prompt_tokens, s.completion_tokens

    def sampling(rows, prompts):
        """KV cache of `rows` rows over P + C, the prefill's widest temporaries, the decode's logits."""
        kv = rows * (P + C) * L * 2 * kv_dim * b
        prefill = prompts * s.generation_size * P * (3 * config.intermediate_size + 4 * D) * b \
            if rows > H_INI_ROWS else rows * P * (3 * config.intermediate_size + 4 * D) * b
        return kv * (1 + (s.sampler != "merged") / L) + max(prefill, 3 * rows * V * 4)   # static cache: no growth
    # ---- <H>_ini: 8 rows sampled, then a no-grad pass keeping every layer's hidden states
    chunk_logits = (s.logprob_chunk + 32) * V * 4
    out["h_ini"] = held + max(sampling(H_INI_ROWS, H_INI_ROWS),
                              H_INI_ROWS * (P + C) * D * b * (L + 1) + chunk_logits)
    # ---- sampling: B*G rows decode over prompt + completion
    rows = s.batch_size * s.generation_size
    out["sampling"] = held + sampling(rows, s.batch_size)
    # ---- gradient pass: one micro-batch of m completions
    m = s.micro_batch_size or rows
    prompts = s.batch_size if s.share_prompt else m          # shared: the step's prompts, held for every micro-batch
    tokens = prompts * P + m * C
    per_layer, outside = activation_rates(config, s)
    kept = L * D * b if s.gradient_checkpointing else L * per_layer   # checkpointing: each layer's input
    chunk = min(s.logprob_chunk or m * C, m * C)
    head = (chunk + 32) * V * 4 + m * C * D * 2 * b + (V * D * 4 if b != 4 else 0)   # one chunk's logits
    layer = (2 if s.gradient_checkpointing else 1) * tokens * per_layer    # a layer's grads (+ its rebuild)
    grads = 0 if s.world_size > 1 else trainable * 4                       # in "ranks" with DDP
    out["gradient"] = held + grads + tokens * (kept + outside) + max(head, layer)
    out["step"] = max(out["sampling"], out["gradient"])                    # each training step's
    out["first"] = FIRST_STEP_SHARE * out["sampler"] + config.intermediate_size * D * b if s.sampler == "merged" else 0
    out["peak"] = max(out["h_ini"], out["step"]) + out["first"]
    out["card"] = out["peak"] * (1 + ALLOCATOR_SLACK) + CONTEXT_BYTES + (NCCL_BYTES if s.world_size > 1 else 0)
    return out


def fit(config, s, budget_bytes):
    """The largest micro-batch (completions per forward/backward) whose estimated card memory fits
    budget_bytes -> (micro_batch_size, estimate), or (None, the estimate at 1) when none does."""
    rows = s.batch_size * s.generation_size
    for m in range(rows, 0, -1):
        est = estimate(config, dataclasses.replace(s, micro_batch_size=m))
        if est["card"] <= budget_bytes:
            return m, est
    return None, est


def plan(config, s, budget_bytes):
    """Checkpointing and the micro-batch, decided by the estimate -> (checkpointing, micro_batch_size,
    estimate). Without checkpointing when a whole group of G completions (or every row) still fits
    in one micro-batch: it saves backward's recomputation and keeps each prompt computed once per
    group (share_prompt); otherwise with it, which fits the most completions per micro-batch.
    s.micro_batch_size > 0 is kept as given; micro_batch_size None: nothing fits."""
    rows = s.batch_size * s.generation_size
    given = s.micro_batch_size or None
    off = dataclasses.replace(s, gradient_checkpointing=False)
    if given:
        est = estimate(config, off)
        if est["card"] <= budget_bytes:
            return False, given, est
    else:
        m, est = fit(config, off, budget_bytes)
        if m is not None and m >= min(s.generation_size, rows):
            return False, m, est
    on = dataclasses.replace(s, gradient_checkpointing=True, share_prompt=False)
    if given:
        return True, given, estimate(config, on)
    m, est = fit(config, on, budget_bytes)
    return True, m, est


def decide(config, s, budget_bytes, checkpointing=None):
    """train.py's memory decisions on CUDA -> (checkpointing, micro_batch_size, estimate): plan() when
    checkpointing is not given; else s.micro_batch_size when given, or the largest that fits (fit)."""
    if checkpointing is None:
        return plan(config, s, budget_bytes)
    s = dataclasses.replace(s, gradient_checkpointing=checkpointing, share_prompt=s.share_prompt and not checkpointing)
    if s.micro_batch_size:
        return checkpointing, s.micro_batch_size, estimate(config, s)
    return (checkpointing, *fit(config, s, budget_bytes))


def choose_sampler(config, s, budget_bytes, checkpointing=None):
    """--rollout auto on CUDA: the kept merged copy (speedups/merged_rollout.py), which samples several times as fast
    as `generate` through 4-bit layers, when the step with the copy held, its first use included, fits
    HEADROOM of budget_bytes at the micro-batch then chosen (decide); else `generate` within the whole
    budget -> (sampler, checkpointing, micro_batch_size, estimate, why): why, one line saying what decided it."""
    budget = f"{HEADROOM * budget_bytes / GB:.1f} GB ({HEADROOM:.0%} of the {budget_bytes / GB:.1f} GB budget)"
    ckpt, m, est = decide(config, dataclasses.replace(s, sampler="merged"), HEADROOM * budget_bytes, checkpointing)
    if m is not None and est["card"] <= HEADROOM * budget_bytes:
        return "merged", ckpt, m, est, f"with its bf16 copy held the step needs {est['card'] / GB:.1f} GB of {budget}"
    why = (f"with the merged copy held the step would need {est['card'] / GB:.1f} GB of the {budget}" if m is not None
           else f"with the merged copy held not even one completion per micro-batch fits the {budget}")
    return ("generate", *decide(config, dataclasses.replace(s, sampler="generate"), budget_bytes, checkpointing), why)


def sampling_card(config, s):
    """What the card must hold to sample alone, as eval.py does: the sampling stage and the sampler's first use,
    the allocator's slack and the CUDA context (an upper bound: it counts trainable weights' optimizer state
    eval has not)."""
    est = estimate(config, s)
    return (est["sampling"] + est["first"]) * (1 + ALLOCATOR_SLACK) + CONTEXT_BYTES


def describe(est):
    """One line: each stage in GB (ranks and sampler only where they are not 0)."""
    return ", ".join(f"{k} {v / GB:.1f}" for k, v in est.items() if v or k not in ("ranks", "sampler", "first")) + " GB"


class _Tracker:
    """torch's MemTracker counting every tensor's memory as it lives and dies (its peak), without its
    per-module statistics, and skipping the gradient hooks of frozen parameters."""

    def __new__(cls):
        from torch.distributed._tools.mem_tracker import MemTracker

        class NoHook:
            def remove(self):
                pass

        class Tracker(MemTracker):
            def _track_module_params_and_buffers(self, module, install_grad_hooks=True):
                for p in module.parameters():
                    if not p.requires_grad:
                        self._param_to_grad_hook_handles.setdefault(p, (NoHook(), NoHook()))
                return super()._track_module_params_and_buffers(module, install_grad_hooks)

            def _pre_fw_hook(self, module, inputs):     # per-module statistics: not needed, and
                pass                                    # they refuse a module called twice (decode)

            def _post_fw_hook(self, module, inputs, outputs):
                pass

            def _pre_bw_hook(self, module, args):
                pass

            def _post_bw_hook(self, module, args):
                pass
        return Tracker()


def measured_peak(config, s, seed=0):
    """The peak tensor memory (estimate's "step") of two real steps on CPU (random weights, LoRA and checkpointing as
    load_model sets them; s.sampler "generate", lengths forced; s.load_in_4bit counts as off), by
    torch's MemTracker: what estimate() predicts, measured. Small shapes only: it allocates."""
    torch.manual_seed(seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)                            # many tiny ops: threads only wait on each other
    try:
        return _measure(config, s)
    finally:
        torch.set_num_threads(threads)


def _measure(config, s):
    import step
    from machinery.models import autocast, checkpoint_activations
    from speedups.logprobs import PolicyPass
    from rollout import Rollout, completion_mask, generate
    from machinery.config import Config
    dtype = torch.bfloat16 if s.dtype_bytes == 2 else torch.float32
    model = meta_model(config, dtype=dtype, lora_rank=s.lora_rank, device="cpu")
    if s.gradient_checkpointing:
        checkpoint_activations(model)
    B, G, P, C = s.batch_size, s.generation_size, s.prompt_tokens, s.completion_tokens
    cfg = Config(method="grpo", generation_size=G, micro_batch_size=s.micro_batch_size, share_prompt=s.share_prompt,
                 logprob_chunk=s.logprob_chunk, temperature=1.0, max_completion_length=C)    # the default objective
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    ids = torch.randint(0, config.vocab_size, (B, P))
    mt = _Tracker()
    mt.track_external(model, opt)
    with mt:
        for _ in range(2):
            with torch.no_grad(), autocast(model):
                model.eval()
                comp = generate(model, ids, torch.ones_like(ids), G, C, C, [config.vocab_size], 0)
                model.train()
            mask, truncated = completion_mask(comp, [config.vocab_size])
            ro = Rollout(ids.repeat_interleave(G, 0), torch.ones(B * G, P, dtype=torch.long), comp, mask,
                         truncated, [""] * (B * G))
            adv = torch.randn(B * G)
            step.policy_gradient(cfg, model, PolicyPass(model), None, ro, adv, None, None)
            opt.step()
            opt.zero_grad(set_to_none=True)
    return mt.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


# -----------------------------------------------------------------------------
# the table the benchmark prints (python -m bench --parts memory)

CPU_CHECKS = {   # three small widths and settings whose estimate is checked against measured_peak
    "llama, bf16, checkpointing, micro-batches of 2": (
        dict(model_type="llama", hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=4096),
        dict(lora_rank=16, generation_size=4, prompt_tokens=32, completion_tokens=32, micro_batch_size=2)),
    "qwen2 tied, fp32, no checkpointing, all at once": (
        dict(model_type="qwen2", hidden_size=96, intermediate_size=256, num_hidden_layers=3, num_attention_heads=6,
             num_key_value_heads=2, vocab_size=8192, tie_word_embeddings=True),
        dict(lora_rank=8, dtype_bytes=4, autocast=False, generation_size=6, prompt_tokens=24, completion_tokens=24,
             micro_batch_size=0, gradient_checkpointing=False)),
    "llama, bf16, shared prompt, micro-batches of 4": (
        dict(model_type="llama", hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=8, vocab_size=16384),
        dict(lora_rank=32, generation_size=4, prompt_tokens=40, completion_tokens=40, micro_batch_size=4,
             gradient_checkpointing=False, share_prompt=True)),
}


def cpu_check(name):
    """(config, Settings) of CPU_CHECKS[name], for estimate() and measured_peak()."""
    shape, settings = CPU_CHECKS[name]
    return _config(json.dumps(shape)), Settings(load_in_4bit=False, optimizer="adamw_torch", **settings)


def table(name, s, budget_bytes, micro_batches=(1, 2, 4, 6, 12)):
    """Lines: the estimated card memory (GB) by micro-batch with and without checkpointing, then what
    the defaults choose on one rank and on each of two: the sampler ('sampler: merged' or 'sampler: generate')
    and the plan with it (choose_sampler): '<name> defaults: N.N GB ...'."""
    config = model_config(name)
    lines = [f"{name}: B {s.batch_size} x G {s.generation_size}, prompt {s.prompt_tokens} + completion "
             f"{s.completion_tokens} tokens, LoRA {s.lora_rank}, {'NF4 ' if s.load_in_4bit else ''}"
             f"{'bf16' if s.dtype_bytes == 2 else 'fp32'}, {s.optimizer} (estimated GB on the card)",
             "| micro-batch | " + " | ".join(str(m) for m in micro_batches) + " |",
             "|---|" + "---|" * len(micro_batches)]
    for ckpt in (True, False):
        peaks = [estimate(config, dataclasses.replace(s, micro_batch_size=m, gradient_checkpointing=ckpt,
                                                      share_prompt=not ckpt))["card"] for m in micro_batches]
        lines.append(f"| checkpointing {'on' if ckpt else 'off'} | " + " | ".join(f"{p / GB:.1f}" for p in peaks) + " |")
    for world in (1, 2):
        sampler, ckpt, m, est, why = choose_sampler(config, dataclasses.replace(s, world_size=world), budget_bytes)
        who = f"{name} defaults" + (f", {world} ranks (per GPU)" if world > 1 else "")
        lines.append(f"sampler{'' if world == 1 else f', {world} ranks'}: {sampler} (--rollout auto on CUDA: {why})")
        lines.append(f"{who}: {est['card'] / GB:.1f} GB on the card ({describe(est)}) -- micro-batches of {m} of "
                     f"{s.batch_size * s.generation_size}, checkpointing {'on' if ckpt else 'off'}, budget "
                     f"{budget_bytes / GB:.1f} GB" if m else
                     f"{who}: does not fit {budget_bytes / GB:.1f} GB even one completion at a time ({describe(est)})")
    return lines


def pick_sampler(args, model, tok, records, example, device, log=print):
    """An evaluation's sampler (eval.py's args): --rollout auto on CUDA: the kept merged copy (speedups/merged_rollout.py)
    when sampling with it held fits the device (sampling_card at this evaluation's rows and longest prompt), else
    `generate`; elsewhere rollout.resolve_path's own auto. Said in one line. With the merged copy, its decode loop
    is sized once for the most rows of a call and the longest prompt: one compiled shape for the whole evaluation."""
    cuda_auto = args.rollout == "auto" and torch.device(device).type == "cuda"
    if not (cuda_auto or args.rollout == "merged"):
        return args.rollout
    from speedups import merged_rollout
    from machinery.data import longest_prompt
    longest = longest_prompt(tok, records, example)
    rows = min(max(1, args.batch_size // args.n_samples), len(records)) * min(args.n_samples, args.batch_size)
    sampler = args.rollout
    if cuda_auto:
        peft = getattr(model, "peft_config", {}).get("default")
        s = Settings(lora_rank=peft.r if peft else 0, load_in_4bit=args.load_in_4bit,
                            dtype_bytes=model.get_input_embeddings().weight.element_size(),
                            batch_size=max(1, args.batch_size // args.n_samples),
                            generation_size=min(args.n_samples, args.batch_size), prompt_tokens=longest,
                            completion_tokens=args.max_completion_length, sampler="merged")
        need = sampling_card(model.config, s)
        have = HEADROOM * torch.cuda.get_device_properties(device).total_memory
        sampler = "merged" if need <= have else "generate"
        log(f"sampler: {sampler} (--rollout auto: with the merged copy held sampling needs {need / 1e9:.1f} GB of "
            f"{have / 1e9:.1f}, {HEADROOM:.0%} of the card)")
    if sampler == "merged":
        merged_rollout.reserve(model, rows, longest, args.max_completion_length)
    return sampler
