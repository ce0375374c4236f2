"""The memory plan a run on CUDA makes before its first step: the sampler (--rollout auto), activation
checkpointing and the micro-batch, decided by the estimated memory (speedups/memory.py) and said in one line each;
with the merged sampler, its decode loop sized once for the run. On CPU nothing is decided here (config.finish's
defaults stand)."""
import dataclasses

import torch

from machinery.data import longest_prompt
from machinery.models import checkpoint_activations
from machinery.runs import ConfigError
from speedups import merged_rollout


def on_cuda(device):
    """Whether the run's device is a CUDA GPU: where the memory plan, and with it --rollout auto's choice, is made."""
    return str(device).startswith("cuda")


def plan_memory(cfg, model, prompt_tokens, device, log, world=1):
    """On CUDA, before the first step: the sampler (with --rollout auto), checkpointing (unless given) and
    the micro-batch (the largest that fits, unless given), decided by the estimated memory (speedups/memory.py),
    and a line saying so -> the config with what it decided (cfg itself is left as parsed)."""
    if not on_cuda(device):
        return cfg
    from speedups import memory                         # the estimator: only where a plan is made
    budget = (cfg.memory_budget_gb * 1e9 if cfg.memory_budget_gb else
              torch.cuda.get_device_properties(device).total_memory)
    s = memory.Settings.from_config(cfg, prompt_tokens, model.get_input_embeddings().weight.element_size(), world)
    if cfg.micro_batch_size == 0:                       # "all at once", given
        s = dataclasses.replace(s, micro_batch_size=s.batch_size * s.generation_size)
    if cfg.rollout == "auto":
        rollout, ckpt, m, est, why = memory.choose_sampler(model.config, s, budget, cfg.gradient_checkpointing)
        cfg = dataclasses.replace(cfg, rollout=rollout)
        log(f"sampler: {cfg.rollout} (--rollout auto: {why})")
    else:
        ckpt, m, est = memory.decide(model.config, s, budget, cfg.gradient_checkpointing)
    if cfg.gradient_checkpointing is None:
        # checkpointed layers cannot keep a KV cache: no shared prompt with them
        cfg = dataclasses.replace(cfg, gradient_checkpointing=ckpt, share_prompt=cfg.share_prompt and not ckpt)
        if ckpt:
            checkpoint_activations(model.get_base_model() if hasattr(model, "get_base_model") else model)
    if m is None:
        raise ConfigError(f"the step does not fit {budget / 1e9:.1f} GB even one completion at a time "
                          f"(estimate {memory.describe(est)}): lower --max_completion_length or "
                          f"--generation_size, keep --gradient_checkpointing, or raise --memory_budget_gb")
    cfg = dataclasses.replace(cfg, micro_batch_size=m)
    s = dataclasses.replace(s, micro_batch_size=m, gradient_checkpointing=cfg.gradient_checkpointing,
                            share_prompt=cfg.share_prompt, sampler="merged" if cfg.rollout == "merged" else "generate")
    est = memory.estimate(model.config, s)
    log(f"memory: estimated {est['card'] / 1e9:.1f} GB of a {budget / 1e9:.1f} GB budget -- micro-batches of "
        f"{m or s.batch_size * s.generation_size} completions, checkpointing "
        f"{'on' if cfg.gradient_checkpointing else 'off'}, longest prompt {prompt_tokens} tokens ({memory.describe(est)})")
    return cfg


def plan_sampling(cfg, model, tok, records, example, dist, log):
    """On CUDA the memory plan (the sampler, checkpointing, micro-batch); with the merged sampler its decode loop
    sized once for the run: the longest prompt, and <H>_ini's 8 rows or B x G (one compiled shape).
    -> the config with the plan's decisions."""
    if not (on_cuda(dist.device) or cfg.rollout == "merged"):
        return cfg
    longest = longest_prompt(tok, records, example)
    cfg = plan_memory(cfg, model, longest, dist.device, log, dist.world)
    if cfg.rollout == "merged":
        merged_rollout.reserve(model, max(cfg.batch_size * cfg.generation_size, 8), longest, cfg.max_completion_length)
    return cfg
