r"""Train with GTPO, GRPO or SFT (arXiv 2508.03772). Reads top to bottom, as the paper's loop:

config (config.py) -> setup: model, data, optimizer, resume, <H>_ini (Sec. 6) -> for each step:
    step.rl_step: rollout (no grad) -> rewards -> advantages (Eq. 8) -> conflict weights (Eq. 5)
                  -> entropy gate (Eq. 6-7) -> loss -> backward
    -> clip -> optimizer step -> log -> checkpoint

    python train.py                                  # offline demo: GTPO, SmolLM2-135M, arithmetic
    python train.py --model llama-8b --dataset gsm8k --use_gtpo     # the paper's run (Listing 1's defaults)
    torchrun --nproc_per_node 2 train.py --model llama-8b --dataset gsm8k --use_gtpo   # on two GPUs
"""
import dataclasses
import math
import os
import random
import sys
import time

import torch

import heldout
import merged_rollout
import step
from config import (BETAS, ConfigError, check_device, config_table, identity_keys, parse_args, record,
                    training_records, unrecorded)
from conflicts import ConflictLog, format_token_ids, group_rows
from data import (DataError, epoch_steps, filter_by_prompt_length, format_prompt, load_task, longest_prompt,
                  one_shot_example, step_records)
from gtpo_logprobs import PolicyPass
from models import ModelError, cuda_allocator_defaults, fp32_matmuls, heap_mmap_threshold, load_model, pick_dtype
from runs import (Dist, MetricsLog, SaveError, StopFlag, load_start_weights, prepare_output_dir, release_aside,
                  resume, rng_state, save_checkpoint, save_folder, save_weights, set_aside, weights_fingerprint,
                  write_config, write_json)

BAR = {"reward": "reward", "rewards/format": "format", "rewards/accuracy": "acc", "entropy": "H", "loss": "loss"}


# -----------------------------------------------------------------------------
# 1. setup

def setup_model(cfg, dist, log):
    """Model (LoRA, 4-bit where asked) and tokenizer -> (model, tok, the config with the LoRA rank and 4-bit
    actually used); cfg itself is left as parsed."""
    fp32_matmuls(dist.device, cfg.tf32)
    model, tok, info = load_model(cfg.model, lora_rank=cfg.lora_rank, load_in_4bit=cfg.load_in_4bit,
                                  dtype=pick_dtype(cfg.dtype, dist.device), device=dist.device,
                                  gradient_checkpointing=cfg.gradient_checkpointing, log=log)
    cfg = dataclasses.replace(cfg, lora_rank=info["lora_rank"], load_in_4bit=info["quantized_4bit"])
    log(f"model {cfg.model} ({info['path']}): {info['trainable_params']:,} trainable parameters, "
        f"LoRA rank {cfg.lora_rank}, 4-bit {info['quantized_4bit']}, {info['dtype']} on {dist.device}"
        + (f", {dist.world} ranks" if dist.world > 1 else ""))
    if cfg.init_from:                                   # before resume: a checkpoint's weights win
        load_start_weights(model, cfg.init_from)
        log(f"weights from {cfg.init_from}")
    return model, tok, cfg


def load_records(cfg, tok, records, log):
    """The training records after --max_prompt_length, and the one-shot example (or None): the first
    train record of --one_shot_from, which is then not trained on when it is the training set."""
    example = None
    if cfg.one_shot:
        source = cfg.one_shot_from or cfg.dataset
        if source == cfg.dataset:
            example, records = one_shot_example(records[0]), records[1:]
        else:
            example = one_shot_example(load_task(source, "train", cfg.data_dir)[0])
        log(f"one-shot example: the first train record of {source}")
    records, dropped = filter_by_prompt_length(records, tok, cfg.max_prompt_length, example)
    log(f"dataset {cfg.dataset}: {len(records)} training prompts"
        + (f" ({dropped} dropped: prompt longer than {cfg.max_prompt_length} tokens)" if dropped else ""))
    if not records:
        raise DataError(f"no training prompts left in {cfg.dataset!r} after dropping prompts longer than "
                        f"--max_prompt_length {cfg.max_prompt_length}; raise it")
    return records, example


def on_cuda(device):
    """Whether the run's device is a CUDA GPU: where the memory plan, and with it --rollout auto's choice, is made."""
    return str(device).startswith("cuda")


def plan_memory(cfg, model, prompt_tokens, device, log, world=1):
    """On CUDA, before the first step: the sampler (with --rollout auto), checkpointing (unless given) and
    the micro-batch (the largest that fits, unless given), decided by the estimated memory (memory.py),
    and a line saying so -> the config with what it decided (cfg itself is left as parsed)."""
    if not on_cuda(device):
        return cfg
    import memory
    from models import checkpoint_activations
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


def make_optimizer(cfg, params, total_steps, log=print):
    """bitsandbytes 8-bit AdamW (Listing 1; paged on CUDA) or torch AdamW, with the betas of the run's first
    phase (an SFT warm-up's, else the method's), and its learning-rate schedule (lr_schedule)."""
    betas = BETAS["sft"] if cfg.warmup_steps else (cfg.adam_beta1, cfg.adam_beta2)
    kw = dict(lr=cfg.lr, betas=betas, weight_decay=cfg.weight_decay)
    if cfg.optimizer == "adamw_8bit":
        import bitsandbytes as bnb
        paged = cfg.device.startswith("cuda")           # paging moves optimizer state to CPU RAM: CUDA only
        optimizer = (bnb.optim.PagedAdamW8bit if paged else bnb.optim.AdamW8bit)(params, **kw)
        if not paged:
            log("optimizer: bitsandbytes AdamW8bit, not paged (paging is for CUDA memory; same update)")
    else:
        optimizer = torch.optim.AdamW(params, **kw)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_schedule(cfg, total_steps))


def lr_schedule(cfg, total_steps):
    """Step k's learning rate as a multiple of --lr: an SFT warm-up's W steps at --sft_warmup_lr, constant; then
    the method's own schedule over the remaining steps: a linear warm-up over --warmup_ratio of them, then
    cosine decay to 0 (Listing 1) or a constant rate -- as an SFT run, then an RL run from its weights."""
    w = cfg.warmup_steps
    sft = (cfg.sft_warmup_lr if cfg.sft_warmup_lr is not None else cfg.lr) / cfg.lr if cfg.lr else 0.0
    steps = total_steps - w
    ramp = math.ceil(cfg.warmup_ratio * steps)

    def rate(k):
        if k < w:
            return sft
        j = k - w
        if j < ramp:
            return j / max(1, ramp)
        if cfg.lr_scheduler == "constant":
            return 1.0
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * (j - ramp) / max(1, steps - ramp))))
    return rate


def start_rl_phase(cfg, optimizer):
    """The first RL step after an SFT warm-up starts Adam afresh with the method's betas, as an RL run from the
    warm-up's weights (--init_from) would: with GTPO's betas near 1, Adam's first moment would otherwise keep
    averaging the warm-up's gradients into every RL step."""
    optimizer.state.clear()
    for group in optimizer.param_groups:
        group["betas"] = (cfg.adam_beta1, cfg.adam_beta2)


def measure_h_ini(cfg, state, model, tok, records, example, dist, log):
    """<H>_ini (Sec. 6) on the first --ent_ini_prompts training prompts, once per run (kept in the
    checkpoint); only GTPO with --entropy_filter auto reads it (Eq. 6, Config.filter_mode). -> the config with h_ini."""
    if cfg.method != "gtpo" or cfg.objective.entropy_filter != "auto":
        return cfg
    recs = records[:cfg.ent_ini_prompts]
    if state.get("h_ini") is None:
        mine = recs[dist.rank::dist.world]                # each rank its share of the prompts
        prompts = [format_prompt(tok, r["question"], example) for r in mine]
        cuda = [dist.device] if str(dist.device).startswith("cuda") else []
        with torch.random.fork_rng(devices=cuda):       # its own draws: the training stream is left as it was,
            h = step.initial_entropy(model, tok, prompts, cfg)    # so every method samples alike from step 1
        total = dist.mean({"sum": h.sum().item(), "n": len(h)})  # ranks' means of sums and counts: their ratio
        state["h_ini"] = total["sum"] / total["n"]
    cfg = dataclasses.replace(cfg, h_ini=state["h_ini"])
    log(f"<H>_ini = {cfg.h_ini:.3f} over {len(recs)} prompts {'<' if cfg.filter_mode == 'all' else '>='} ln 2 "
        f"-> entropy filter {cfg.filter_mode} (Eq. 6)")
    return cfg


# -----------------------------------------------------------------------------
# 2. the loop

def train(cfg, dist, stop):
    log, parsed = print if dist.main else (lambda *a, **k: None), record(cfg)
    heap_mmap_threshold(cfg.heap_mmap_mb)               # before any tensor (cpu group of flags)
    records = training_records(cfg, log)                # a bad data file fails before anything loads
    cfg, held = heldout.plan(cfg, records, log)         # so do held-out problems that cannot be read
    changes = prepare_output_dir(cfg.output_dir, parsed, cfg.resume, cfg.overwrite, identity_keys(),
                                 cfg.allow_changes.split(","), unrecorded()) if dist.main else {}
    dist.barrier()
    random.seed(cfg.seed + dist.rank)
    torch.manual_seed(cfg.seed)                         # same LoRA init on every rank (DDP also broadcasts it)
    model, tok, cfg = setup_model(cfg, dist, log)
    records, example = load_records(cfg, tok, records, log)
    cfg = plan_sampling(cfg, model, tok, records, example, dist, log)
    steps_per_epoch = epoch_steps(len(records), cfg.batch_size, dist.world, log)
    total = cfg.max_steps if cfg.max_steps > 0 else cfg.epochs * steps_per_epoch
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer, scheduler = make_optimizer(cfg, params, total, log)
    ref_model = step.reference_model(cfg, model)        # pi_ref is the starting model: before resume
    state = resume(cfg.output_dir, model, optimizer, scheduler, dist, log) if cfg.resume else {"step": 0}
    if not state.get("checkpoint"):
        torch.manual_seed(cfg.seed + dist.rank)         # different samples on each rank
    cfg = measure_h_ini(cfg, state, model, tok, records, example, dist, log)
    aside = start_run_folder(cfg, total, dist, changes, state["step"], log, parsed)
    policy = dist.wrap(PolicyPass(model))               # the gradient pass (DDP sees one forward); `model` samples
    metrics = MetricsLog(cfg.output_dir, dist.main, cfg.report_to, record(cfg), state["step"])
    evaluate = heldout.HeldOut(cfg, held, dist, metrics, log) if held else (lambda *a: None)
    conflict_log = make_conflict_log(cfg, model, tok, state, dist)
    bar = progress(state["step"], total, dist.main)
    nonfinite_run = 0
    model.train()
    try:
        evaluate(model, tok, state["step"], total)      # RL's start, or a due evaluation a kill left unwritten
        for k in bar:
            warmup = k < cfg.warmup_steps
            if k == cfg.warmup_steps > 0:
                start_rl_phase(cfg, optimizer)
            bar.set_description("sft warm-up" if warmup else cfg.method, refresh=False)
            t0, clock = time.time(), step.Clock(dist.device)
            n = cfg.batch_size * cfg.generation_size if warmup else cfg.batch_size   # warm-up: an RL step's sequences
            batch, epoch = step_records(records, k, steps_per_epoch, n, dist, cfg.seed, wrap=warmup)
            if cfg.method == "sft" or warmup:
                m = step.sft_step(policy, tok, batch, example, cfg, dist.device, clock)
            else:
                m = run_rl_step(cfg, k, total, batch, example, model, policy, ref_model, tok, clock, metrics,
                                conflict_log, dist)
            m = {"step": k + 1, "epoch": epoch, **m, **{f"time/{s}": v for s, v in clock.parts.items()}}
            finite = optimizer_step(cfg, m, params, optimizer, scheduler, dist)
            m["step_time"] = time.time() - t0
            metrics.write(m, k + 1)
            bar.set_postfix({short: round(m[key], 3) for key, short in BAR.items() if key in m})
            nonfinite_run = check_finite(cfg, k, 0 if finite else nonfinite_run + 1)
            stopping = any(dist.gather(stop.signal is not None))
            if not stopping:                            # else --resume evaluates the step first
                evaluate(model, tok, k + 1, total)
            warmup_end = warmup and k + 1 == cfg.sft_warmup_steps      # RL's start, for eval.py beside final/
            if (k + 1) % cfg.save_steps == 0 or k + 1 == total or stopping or warmup_end:
                checkpoint(cfg, k + 1, model, tok, optimizer, scheduler, state, dist, conflict_log)
                aside = release_aside(aside, log)
            if stopping:
                return stopped(bar, k + 1, total, stop, cfg.output_dir, log)
    finally:
        metrics.close()
    save_final(cfg, model, tok, params, dist, log)
    return 0


def stopped(bar, n, total, stop, out, log):
    """The loop's end on Ctrl-C or SIGTERM (any rank's), checkpoint-n saved: said, exit code 0."""
    bar.update(n - bar.n)                               # the bar counts step n, as the line below does
    bar.close()
    log(f"stopped after step {n} of {total} ({stop.signal or 'signal on another rank'}); "
        f"checkpoint-{n} saved. Continue with: python train.py --resume --output_dir {out}")
    return 0


def progress(first, total, main):
    """The loop's steps first ... total-1 as a progress bar, shown on the main rank."""
    from tqdm import tqdm
    return tqdm(range(first, total), initial=first, total=total, dynamic_ncols=True, disable=not main)


def start_run_folder(cfg, total_steps, dist, changes, step, log, parsed):
    """Just before the run writes anything: --overwrite's old run set aside whole (runs.set_aside), then
    config.json: every setting as used, where each came from ("setup" where setup changed it from `parsed`),
    Eq. 6's gate, the CPU threads (a CPU run repeats bit for bit only with as many). -> the folder set aside."""
    if not dist.main:
        return None
    aside = set_aside(cfg.output_dir) if cfg.overwrite and not cfg.resume else None
    if aside:
        log(f"--overwrite: the run in {cfg.output_dir} is kept in {aside} until this one saves its first checkpoint")
    now = record(cfg)
    sources = {k: "setup (the model, memory plan or <H>_ini)" if now[k] != parsed[k] else v
               for k, v in (cfg.sources or {}).items()}
    write_config(cfg.output_dir, {**now, "sources": sources, "entropy_filter_applied": cfg.filter_mode,
                                  "total_steps": total_steps, "world_size": dist.world,
                                  "cpu_threads": torch.get_num_threads()}, cfg.resume, changes, step)
    return aside


def check_finite(cfg, k, nonfinite_run):
    """Stop with a clear error after 5 consecutive skipped steps; returns the count."""
    if nonfinite_run >= 5:
        raise FloatingPointError(f"{nonfinite_run} consecutive steps had a non-finite loss or gradient "
                                 f"(last at step {k + 1}); lower --lr or check the data. "
                                 f"Checkpoints in {cfg.output_dir} are intact.")
    return nonfinite_run


def run_rl_step(cfg, k, total, batch, example, model, policy, ref_model, tok, clock, metrics, conflict_log, dist):
    """One GTPO/GRPO step on this rank's prompts (step.rl_step); every --sample_every steps the first
    group's completions go to samples.jsonl."""
    prompts = [format_prompt(tok, r["question"], example) for r in batch]
    m, ro, scored = step.rl_step(model, policy, tok, prompts, [r["answer"] for r in batch], cfg, ref_model, clock,
                                 conflict_log=conflict_log, ranks=dist)
    if cfg.sample_every and (k % cfg.sample_every == 0 or k == total - 1):
        metrics.samples(group_rows(tok, ro, scored, range(cfg.generation_size), k + 1, batch[0]["question"],
                                   batch[0]["answer"]))
    return m


def optimizer_step(cfg, m, params, optimizer, scheduler, dist):
    """Clip, average the metrics over ranks, step (skipped, and counted, on a non-finite loss or
    gradient), advance the schedule. Adds grad_norm and lr (the step's own rate) to m; returns whether
    it stepped."""
    grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)      # grads already averaged
    m.update(dist.mean({k: v for k, v in m.items() if k not in ("step", "epoch", "phase")}))
    finite = math.isfinite(m["loss"]) and bool(torch.isfinite(grad_norm))
    if finite:
        optimizer.step()
    else:
        m["skipped_nonfinite"] = 1
    optimizer.zero_grad(set_to_none=True)
    m.update(grad_norm=grad_norm.item(), lr=scheduler.get_last_lr()[0])         # the rate this step used
    scheduler.step()
    return finite


def make_conflict_log(cfg, model, tok, state, dist):
    """GTPO or GRPO, rank 0: which tokens fall in conflict spans (conflicts.py), continued from the
    checkpoint."""
    if cfg.method == "sft" or not dist.main:
        return None
    log = ConflictLog(model.get_input_embeddings().num_embeddings, format_token_ids(tok))
    if state.get("conflicts"):
        log.load_state_dict(state["conflicts"])
    return log


def checkpoint(cfg, n, model, tok, optimizer, scheduler, state, dist, conflict_log=None):
    """checkpoint-n with every rank's RNG (rank 0 writes; the others wait); conflicts.json beside it."""
    rngs = dist.gather(rng_state(dist.device))
    if dist.main:
        save_checkpoint(os.path.join(cfg.output_dir, f"checkpoint-{n}"), model, tok, optimizer, scheduler,
                        {"step": n, "h_ini": state.get("h_ini"), "config": record(cfg),
                         "rng": rngs if dist.world > 1 else rngs[0], "world_size": dist.world,
                         "conflicts": conflict_log and conflict_log.state_dict()})
        if conflict_log is not None:
            write_json(os.path.join(cfg.output_dir, "conflicts.json"), conflict_log.summary(tok))
    dist.barrier()


def save_final(cfg, model, tok, params, dist, log):
    """Check that DDP ranks agree bit for bit, then save final/."""
    if dist.world > 1:
        prints = dist.gather(weights_fingerprint(params))
        if any(p != prints[0] for p in prints):
            raise RuntimeError(f"DDP ranks ended with different weights: {prints}")
        log(f"ddp: trainable weights bit-identical on all {dist.world} ranks")
    if dist.main:
        save_folder(os.path.join(cfg.output_dir, "final"), lambda tmp: (save_weights(model, tmp),
                                                                        tok.save_pretrained(tmp)))
    log(f"done: adapter/model in {os.path.join(cfg.output_dir, 'final')}, "
        f"metrics in {os.path.join(cfg.output_dir, 'metrics.jsonl')}")


def main(argv=None):
    cuda_allocator_defaults()
    cfg = parse_args(argv, __doc__)
    if cfg.print_config:
        print(config_table(cfg))
        return 0
    check_device(cfg.device)
    stop, dist = StopFlag(), Dist(cfg.device)
    try:
        return train(cfg, dist, stop)
    finally:
        stop.restore()
        dist.close()


def cli(argv=None):
    """main() as the command line runs it: a bad flag, data file or model is one line on stderr and
    exit code 2; a failed save or a run of non-finite steps, exit code 1."""
    try:
        return main(argv)
    except (ConfigError, DataError, ModelError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (FloatingPointError, SaveError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(cli())
