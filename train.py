r"""Train with GTPO, GRPO or SFT (arXiv 2508.03772). Reads top to bottom, as the paper's loop:

config (machinery/config.py) -> setup: model, data, optimizer, resume, <H>_ini (Sec. 6) -> for each step:
    step.rl_step: rollout (no grad) -> rewards -> advantages (Eq. 8) -> conflict weights (Eq. 5)
                  -> entropy filter and term (Eq. 6-7) -> loss -> backward
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

import step
from analysis.conflicts import ConflictLog, format_token_ids, group_rows
from machinery import heldout
from machinery.config import (BETAS, ConfigError, check_device, config_table, identity_keys, parse_args, record,
                              training_records, unrecorded)
from machinery.data import (DataError, epoch_steps, filter_by_prompt_length, format_prompt, load_task, one_shot_example,
                            step_records)
from machinery.models import ModelError, cuda_allocator_defaults, fp32_matmuls, heap_mmap_threshold, load_model, pick_dtype
from machinery.runs import (Dist, MetricsLog, SaveError, StopFlag, load_start_weights, prepare_output_dir,
                            release_aside, resume, rng_state, save_checkpoint, save_folder, save_weights, set_aside,
                            weights_fingerprint, write_config, write_json)
from speedups.logprobs import PolicyPass
from speedups.memory_plan import plan_sampling

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


@dataclasses.dataclass
class Run:
    """What setup gives the loop: the settings as decided, the model (it samples; `policy` is its gradient pass) and
    pi_ref, the data, the optimizer and schedule, the checkpoint's state, and what logs."""
    cfg: object
    model: object
    tok: object
    ref_model: object
    records: list
    example: object
    steps_per_epoch: int
    total: int
    params: list
    optimizer: object
    scheduler: object
    state: dict
    aside: object = None
    policy: object = None
    metrics: object = None
    evaluate: object = None
    conflict_log: object = None


def setup(cfg, dist, log):
    """Everything before step 1, in the order it must happen: the data checked before anything loads, the run
    folder, the model, the memory plan, the optimizer, --resume, <H>_ini (Sec. 6), config.json, the loggers."""
    parsed = record(cfg)
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
    run = Run(cfg, model, tok, ref_model, records, example, steps_per_epoch, total, params, optimizer, scheduler, state)
    run.aside = start_run_folder(cfg, total, dist, changes, state["step"], log, parsed)
    run.policy = dist.wrap(PolicyPass(model))           # the gradient pass (DDP sees one forward); `model` samples
    run.metrics = MetricsLog(cfg.output_dir, dist.main, cfg.report_to, record(cfg), state["step"])
    run.evaluate = heldout.HeldOut(cfg, held, dist, run.metrics, log) if held else (lambda *a: None)
    run.conflict_log = make_conflict_log(cfg, model, tok, state, dist)
    return run


# -----------------------------------------------------------------------------
# 2. the loop

def train(cfg, dist, stop):
    """setup, then for each step: SFT or GTPO / GRPO (step.py) -> clip -> optimizer step -> log -> held-out
    evaluation -> checkpoint. -> the exit code."""
    log = print if dist.main else (lambda *a, **k: None)
    run = setup(cfg, dist, log)
    cfg, bar, nonfinite_run = run.cfg, progress(run.state["step"], run.total, dist.main), 0
    run.model.train()
    try:
        run.evaluate(run.model, run.tok, run.state["step"], run.total)   # RL's start, or one a kill left unwritten
        for k in bar:
            warmup = k < cfg.warmup_steps
            if k == cfg.warmup_steps > 0:
                start_rl_phase(cfg, run.optimizer)
            bar.set_description("sft warm-up" if warmup else cfg.method, refresh=False)
            t0, clock = time.time(), step.Clock(dist.device)
            m = one_step(run, k, warmup, clock, dist)                   # gradients in the parameters; metrics
            finite = optimizer_step(cfg, m, run.params, run.optimizer, run.scheduler, dist)
            m["step_time"] = time.time() - t0
            run.metrics.write(m, k + 1)
            bar.set_postfix({short: round(m[key], 3) for key, short in BAR.items() if key in m})
            nonfinite_run = check_finite(cfg, k, 0 if finite else nonfinite_run + 1)
            stopping = any(dist.gather(stop.signal is not None))
            if not stopping:                            # else --resume evaluates the step first
                run.evaluate(run.model, run.tok, k + 1, run.total)
            warmup_end = warmup and k + 1 == cfg.sft_warmup_steps      # RL's start, for eval.py beside final/
            if (k + 1) % cfg.save_steps == 0 or k + 1 == run.total or stopping or warmup_end:
                checkpoint(cfg, k + 1, run, dist)
                run.aside = release_aside(run.aside, log)
            if stopping:
                return stopped(bar, k + 1, run.total, stop, cfg.output_dir, log)
    finally:
        run.metrics.close()
    save_final(cfg, run.model, run.tok, run.params, dist, log)
    return 0


def one_step(run, k, warmup, clock, dist):
    """Step k on this rank's batch (an SFT warm-up step takes an RL step's number of sequences): step.sft_step or
    step.rl_step leave the gradients in the parameters -> the step's metrics, its stages' times among them."""
    cfg = run.cfg
    n = cfg.batch_size * cfg.generation_size if warmup else cfg.batch_size
    batch, epoch = step_records(run.records, k, run.steps_per_epoch, n, dist, cfg.seed, wrap=warmup)
    if cfg.method == "sft" or warmup:
        m = step.sft_step(run.policy, run.tok, batch, run.example, cfg, dist.device, clock)
    else:
        m = run_rl_step(run, k, batch, clock, dist)
    return {"step": k + 1, "epoch": epoch, **m, **{f"time/{s}": v for s, v in clock.parts.items()}}


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
    Eq. 6's filter, the CPU threads (a CPU run repeats bit for bit only with as many). -> the folder set aside."""
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


def run_rl_step(run, k, batch, clock, dist):
    """One GTPO/GRPO step on this rank's prompts (step.rl_step); every --sample_every steps the first
    group's completions go to samples.jsonl."""
    cfg, tok = run.cfg, run.tok
    prompts = [format_prompt(tok, r["question"], run.example) for r in batch]
    m, ro, scored = step.rl_step(run.model, run.policy, tok, prompts, [r["answer"] for r in batch], cfg, run.ref_model,
                                 clock, conflict_log=run.conflict_log, ranks=dist)
    if cfg.sample_every and (k % cfg.sample_every == 0 or k == run.total - 1):
        run.metrics.samples(group_rows(tok, ro, scored, range(cfg.generation_size), k + 1, batch[0]["question"],
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
    """GTPO or GRPO, rank 0: which tokens fall in conflict spans (analysis/conflicts.py), continued from the
    checkpoint."""
    if cfg.method == "sft" or not dist.main:
        return None
    log = ConflictLog(model.get_input_embeddings().num_embeddings, format_token_ids(tok))
    if state.get("conflicts"):
        log.load_state_dict(state["conflicts"])
    return log


def checkpoint(cfg, n, run, dist):
    """checkpoint-n with every rank's RNG (rank 0 writes; the others wait); conflicts.json beside it."""
    rngs, conflict_log = dist.gather(rng_state(dist.device)), run.conflict_log
    if dist.main:
        save_checkpoint(os.path.join(cfg.output_dir, f"checkpoint-{n}"), run.model, run.tok, run.optimizer,
                        run.scheduler, {"step": n, "h_ini": run.state.get("h_ini"), "config": record(cfg),
                                        "rng": rngs if dist.world > 1 else rngs[0], "world_size": dist.world,
                                        "conflicts": conflict_log and conflict_log.state_dict()})
        if conflict_log is not None:
            write_json(os.path.join(cfg.output_dir, "conflicts.json"), conflict_log.summary(run.tok))
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
