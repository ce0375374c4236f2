r"""Train with GTPO, GRPO or SFT (arXiv 2508.03772). Reads top to bottom:

config -> setup (model, data, optimizer, resume, <H>_ini) -> loop:
    step.rl_step: rollout (no grad) -> rewards -> advantages -> conflict weights -> entropy gate
                  -> loss -> backward
    -> clip -> optimizer step -> log -> checkpoint

    python train.py                                  # offline demo: GTPO, SmolLM2-135M, arithmetic
    python train.py --model llama-8b --dataset gsm8k --optimizer adam --lr 1e-6 --epochs 3 \
        --batch_size 2 --generation_size 12 --use_gtpo
"""
import argparse
import math
import os
import random
import sys
import time

import torch

import step as steps
from conflicts import ConflictLog, format_token_ids, group_rows
from data import (TASKS, DataError, check_data_dir, filter_by_prompt_length, format_prompt, load_task, one_shot_example,
                  task_name)
from models import ALIASES, ModelError, heap_mmap_threshold, load_model, pick_dtype
from rollout import PolicyPass
from runs import (ConfigError, Dist, MetricsLog, SaveError, StopFlag, load_start_weights, prepare_output_dir,
                  resume, rng_state, save_checkpoint, save_folder, weights_fingerprint, write_json)

# -----------------------------------------------------------------------------
# 1. config: the paper's Listing 1 are the defaults; the embedded model has a demo profile

PAPER = dict(lr=1e-6, generation_size=12, max_prompt_length=4000, max_completion_length=1500,
             warmup_ratio=0.005, save_steps=500, ent_ini_prompts=100, sft_warmup_steps=0,
             one_shot=False, max_steps=-1, micro_batch_size=0, sft_micro_batch_size=0)
# SmolLM2-135M is not in the paper. It never writes the tag format on its own, so the demo
# shows it one worked example in the prompt (one_shot) and uses a LoRA-sized learning rate.
PROFILES = {"smollm2-135m": dict(lr=2e-4, generation_size=8, max_prompt_length=512,
                                 max_completion_length=96, warmup_ratio=0.05, save_steps=20,
                                 ent_ini_prompts=16, one_shot=True, sft_warmup_steps=4, max_steps=36,
                                 micro_batch_size=4, sft_micro_batch_size=2)}   # peak RSS < 3 GB (README)
BAR = {"reward": "reward", "rewards/format": "format", "rewards/accuracy": "acc", "entropy": "H", "loss": "loss"}
BETAS = {"gtpo": (0.999999, 0.999999), "grpo": (0.9, 0.95), "sft": (0.9, 0.95)}   # Listing 1


def default_help(key):
    """The default of a flag that PAPER / PROFILES set, as --help shows it."""
    demo = PROFILES["smollm2-135m"].get(key, PAPER[key])
    if demo == PAPER[key]:
        return f" [default {PAPER[key]}, paper]"
    return f" [default {demo} with smollm2-135m (demo profile), else {PAPER[key]} (paper)]"


def objective_flags(a):
    """The flags of the loss itself: GRPO's (Eq. 1) and GTPO's (Eq. 5-8)."""
    d = default_help
    # GRPO
    a("--beta", type=float, default=0.0, help="GRPO KL weight (paper: 0, 1e-6, 0.04); reference = adapters off")
    a("--clip_eps", type=float, default=0.2, help="GRPO PPO clip range")
    # GTPO
    a("--conflict_weight", type=float, default=2.0, help="lambda on conflict tokens of positive completions (Eq. 5)")
    a("--conflict_combine", choices=["or", "product"], default="or",
      help="or = Eq. 5 (2 in overlapping spans); product = released code (4)")
    a("--conflict_norm", action="store_true", help="divide each completion's loss by its conflict count (released code)")
    a("--ent_threshold", type=float, default=math.log(2), help="entropy filter threshold on <H>_i (Eq. 6: ln 2)")
    a("--ent_gamma", type=float, default=0.1, help="gamma of the entropy penalty (Eq. 7)")
    a("--entropy_filter", choices=["auto", "all", "neg", "off"], default="auto",
      help="auto = Eq. 6 (filter iff <H>_ini < ln 2); all; neg (OnlyNeg, App. 13); off. GRPO: auto = off; "
           "all/neg add the filter and -gamma <H>_i to GRPO (App. 14)")
    a("--ent_ini_prompts", type=int, default=None,
      help="training prompts used to measure <H>_ini" + d("ent_ini_prompts"))
    a("--scale_rewards", action=argparse.BooleanOptionalAction, default=True,
      help="divide advantages by the group std (Eq. 8); --no-scale_rewards = released code")


def build_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a, d = p.add_argument, default_help
    m = p.add_mutually_exclusive_group()
    m.add_argument("--use_gtpo", action="store_true", help="train with GTPO (default)")
    m.add_argument("--use_grpo", action="store_true", help="train with the GRPO baseline (Eq. 1)")
    m.add_argument("--use_sft", action="store_true", help="supervised fine-tuning on the worked solutions")
    a("--model", default="smollm2-135m", help="alias (llama-8b, qwen2.5-3b, smollm2-135m), local folder or Hub id")
    a("--dataset", default="arithmetic", help=f"{', '.join(TASKS)} (built-in), or a .jsonl path")
    a("--data_dir", default=None, help="folder with <dataset>/<split>.jsonl (default $GTPO_DATA_DIR, then the Hub)")
    a("--output_dir", default=None, help="where metrics, samples and checkpoints go (default runs/<method>-<model>-<dataset>)")
    a("--overwrite", action="store_true", help="reuse an output_dir that holds another run (its files are replaced)")
    a("--resume", action="store_true", help="continue from the last checkpoint in output_dir")
    a("--init_from", default=None, metavar="DIR",
      help="start from another run's final/ or checkpoint-N/ weights (e.g. SFT, then RL); same --lora_rank")
    a("--seed", type=int, default=3407, help="random seed (Listing 1: 3407)")
    a("--device", default=None, help="cuda, cuda:1 or cpu (default: cuda if available)")
    # data and sampling
    a("--batch_size", type=int, default=1, help="PROMPTS per optimizer step; each gets --generation_size completions")
    a("--generation_size", type=int, default=None, help="G, completions per prompt" + d("generation_size"))
    a("--micro_batch_size", type=int, default=None,
      help="completions per forward/backward, 0 = all" + d("micro_batch_size"))
    a("--sft_micro_batch_size", type=int, default=None,
      help="worked solutions per forward/backward in SFT steps, 0 = as --micro_batch_size" + d("sft_micro_batch_size"))
    a("--logprob_chunk", type=int, default=256,
      help="completion tokens per LM-head chunk for log-probs/entropy (0 = full (N, L, V) logits)")
    on = dict(action=argparse.BooleanOptionalAction, default=True)
    a("--share_prompt", **on, help="each prompt computed once per group (rollout, policy pass); off with checkpointing")
    a("--merge_lora", **on, help="sample with LoRA merged into copies of the base weights (base untouched)")
    a("--epochs", type=int, default=1, help="passes over the training prompts (Listing 1: 1)")
    a("--max_steps", type=int, default=None, help="optimizer steps, -1 = --epochs decide" + d("max_steps"))
    a("--max_prompt_length", type=int, default=None,
      help="longer prompts are dropped (and counted)" + d("max_prompt_length"))
    a("--max_completion_length", type=int, default=None,
      help="max new tokens per completion" + d("max_completion_length"))
    a("--temperature", type=float, default=1.0, help="sampling temperature (paper: 1.0)")
    a("--one_shot", action=argparse.BooleanOptionalAction, default=None,
      help="show one worked example (tag format) before the question" + d("one_shot"))
    # optimisation
    a("--optimizer", choices=["adam", "adamw_torch"], default="adam",
      help="adam = bitsandbytes 8-bit AdamW, paged on CUDA (Listing 1); adamw_torch = torch.optim.AdamW")
    a("--lr", type=float, default=None, help="learning rate" + d("lr"))
    a("--adam_beta1", type=float, default=None, help="Adam beta1 (GTPO 0.999999; GRPO/SFT 0.9)")
    a("--adam_beta2", type=float, default=None, help="Adam beta2 (GTPO 0.999999; GRPO/SFT 0.95)")
    a("--weight_decay", type=float, default=0.1, help="AdamW weight decay (Listing 1: 0.1)")
    a("--warmup_ratio", type=float, default=None,
      help="linear warm-up fraction of a cosine schedule" + d("warmup_ratio"))
    a("--max_grad_norm", type=float, default=0.1, help="gradient clipping norm (Listing 1: 0.1)")
    a("--lora_rank", type=int, default=None, help="LoRA rank on q,k,v,o,gate,up,down (Llama 128, Qwen 64); 0 = full fine-tuning")
    a("--load_in_4bit", action=argparse.BooleanOptionalAction, default=None,
      help="4-bit NF4 base weights (Listing 1) [default: on with CUDA; off on CPU, where it works but is slow]")
    a("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
      help="weights and 4-bit compute dtype (auto = bf16 on a CUDA GPU that has it, else fp32)")
    a("--gradient_checkpointing", action="store_true", help="trade compute for activation memory")
    a("--heap_mmap_mb", type=float, default=0.0,
      help="freed blocks above this size (MB) go back to the OS at once (glibc): 1 cuts an SFT step's peak RSS "
           "4.5 -> 2.6 GB, steps ~20%% slower; 0 = glibc's default")
    a("--sft_warmup_steps", type=int, default=None,
      help="SFT steps (batch_size x G worked solutions each) before RL" + d("sft_warmup_steps"))
    objective_flags(a)
    # logging
    a("--save_steps", type=int, default=None, help="checkpoint every N steps" + d("save_steps"))
    a("--sample_every", type=int, default=10, help="write a few completions to samples.jsonl every N steps")
    a("--report_to", choices=["none", "wandb"], default="none", help="also log to Weights & Biases")
    return p


def parse_args(argv=None):
    args = build_parser().parse_args(argv)
    args.method = "sft" if args.use_sft else "grpo" if args.use_grpo else "gtpo"
    profile = PROFILES.get(args.model, {})
    for k, v in PAPER.items():
        if getattr(args, k) is None:
            setattr(args, k, profile.get(k, v))
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.load_in_4bit is None:                       # Listing 1 on a GPU; on CPU only when asked
        args.load_in_4bit = args.device.startswith("cuda")
    if args.lora_rank is None:                          # Listing 1: 128 for LLaMA, 64 for Qwen
        args.lora_rank = ALIASES.get(args.model, (None, 64))[1]
    b1, b2 = BETAS[args.method]
    args.adam_beta1 = b1 if args.adam_beta1 is None else args.adam_beta1
    args.adam_beta2 = b2 if args.adam_beta2 is None else args.adam_beta2
    if args.method != "sft" and args.generation_size < 2:
        raise ConfigError(f"--generation_size {args.generation_size}: GRPO and GTPO compare completions within "
                          f"a group and need G >= 2 (the paper uses 8 or 12); for one sample per prompt use --use_sft")
    if args.batch_size < 1:
        raise ConfigError("--batch_size must be >= 1 (prompts per optimizer step)")
    check_data_dir(args.data_dir)                       # before the model loads
    if args.max_steps == 0 or args.max_steps < -1:
        raise ConfigError(f"--max_steps {args.max_steps}: give a number of optimizer steps >= 1, "
                          f"or -1 to let --epochs decide")
    args.use_gtpo, args.use_grpo, args.use_sft = (args.method == m for m in ("gtpo", "grpo", "sft"))  # what runs
    if args.gradient_checkpointing and args.share_prompt:
        args.share_prompt = False                       # checkpointed layers cannot keep a KV cache
    if args.output_dir is None:
        args.output_dir = os.path.join("runs", f"{args.method}-{os.path.basename(args.model)}-{task_name(args.dataset)}")
    return args


def step_config(args, entropy_filter):
    """The frozen subset of the flags that one step reads (step.StepConfig)."""
    fields = steps.StepConfig.__dataclass_fields__
    kw = {k: getattr(args, k) for k in fields if hasattr(args, k)}
    return steps.StepConfig(**{**kw, "task": task_name(args.dataset), "entropy_filter": entropy_filter})


# -----------------------------------------------------------------------------
# 2. setup

def setup_model(args, dist, log):
    """Model (LoRA, 4-bit where asked) and tokenizer; records the LoRA rank actually used."""
    model, tok, info = load_model(args.model, lora_rank=args.lora_rank, load_in_4bit=args.load_in_4bit,
                                  dtype=pick_dtype(args.dtype, dist.device),
                                  device=dist.device, gradient_checkpointing=args.gradient_checkpointing, log=log)
    args.lora_rank, args.load_in_4bit = info["lora_rank"], info["quantized_4bit"]     # what actually loaded
    log(f"model {args.model} ({info['path']}): {info['trainable_params']:,} trainable parameters, "
        f"LoRA rank {args.lora_rank}, 4-bit {info['quantized_4bit']}, {info['dtype']} on {dist.device}"
        + (f", {dist.world} ranks" if dist.world > 1 else ""))
    return model, tok


def load_records(args, tok, log):
    """Training records after --max_prompt_length, and the one-shot example (or None)."""
    records = load_task(args.dataset, "train", args.data_dir)
    example = None
    if args.one_shot:                                   # the first record is the example, not trained on
        example, records = one_shot_example(records[0]), records[1:]
    records, dropped = filter_by_prompt_length(records, tok, args.max_prompt_length, example)
    log(f"dataset {args.dataset}: {len(records)} training prompts"
        + (f" ({dropped} dropped: prompt longer than {args.max_prompt_length} tokens)" if dropped else ""))
    if not records:
        raise DataError(f"no training prompts left in {args.dataset!r} after dropping prompts longer than "
                        f"--max_prompt_length {args.max_prompt_length}; raise it")
    return records, example


def make_optimizer(args, params, total_steps, device, log=print):
    """bitsandbytes 8-bit AdamW (Listing 1; paged on CUDA) or torch AdamW, cosine with warm-up."""
    from transformers import get_cosine_schedule_with_warmup
    kw = dict(lr=args.lr, betas=(args.adam_beta1, args.adam_beta2), weight_decay=args.weight_decay)
    if args.optimizer == "adam":
        import bitsandbytes as bnb
        paged = str(device).startswith("cuda")          # paging moves optimizer state to CPU RAM: CUDA only
        optimizer = (bnb.optim.PagedAdamW8bit if paged else bnb.optim.AdamW8bit)(params, **kw)
        if not paged:
            log("optimizer: bitsandbytes AdamW8bit, not paged (paging is for CUDA memory; same update)")
    else:
        optimizer = torch.optim.AdamW(params, **kw)
    return optimizer, get_cosine_schedule_with_warmup(optimizer, math.ceil(args.warmup_ratio * total_steps),
                                                      total_steps)


def entropy_filter_mode(args, state, model, tok, records, example, dist, log):
    """Eq. 6: with --entropy_filter auto, filter only if <H>_ini < ln 2 (measured once on the
    first --ent_ini_prompts training prompts, kept in the checkpoint)."""
    if args.method == "grpo" and args.entropy_filter == "auto":
        return "off"                                    # the baseline; all / neg add the gate (App. 14)
    if args.method != "gtpo" or args.entropy_filter != "auto":
        return args.entropy_filter
    recs = records[:args.ent_ini_prompts]
    if state.get("h_ini") is None:
        prompts = [format_prompt(tok, r["question"], example) for r in recs]
        state["h_ini"] = dist.mean({"h": steps.initial_entropy(model, tok, prompts, step_config(args, "off"))})["h"]
    mode = "all" if state["h_ini"] < math.log(2) else "off"
    log(f"<H>_ini = {state['h_ini']:.3f} over {len(recs)} prompts "
        f"{'<' if mode == 'all' else '>='} ln 2 -> entropy filter {mode} (Eq. 6)")
    return mode


def write_config(args, dist, total_steps, **decided):
    """config.json: every flag as the run uses it, and what setup decided (<H>_ini, Eq. 6's filter)."""
    if dist.main:
        write_json(os.path.join(args.output_dir, "config.json"),
                   {**vars(args), "total_steps": total_steps, "world_size": dist.world, **decided})


def make_conflict_log(cfg, model, tok, state, dist):
    """GTPO, rank 0: which tokens fall in conflict spans (conflicts.py), continued from the checkpoint."""
    if cfg.method != "gtpo" or not dist.main:
        return None
    log = ConflictLog(model.get_input_embeddings().num_embeddings, format_token_ids(tok))
    if state.get("conflicts"):
        log.load_state_dict(state["conflicts"])
    return log


def step_records(records, step, steps_per_epoch, n, dist, seed, wrap=False):
    """This rank's n records for optimizer step `step`: epoch order from a seeded permutation,
    rank r takes slice r of each step's share. wrap: the SFT warm-up's n = B x G records."""
    epoch, k = divmod(step, steps_per_epoch)
    order = torch.randperm(len(records), generator=torch.Generator().manual_seed(seed + epoch))
    part = k * dist.world + dist.rank
    idx = order[(part * n) % len(records):][:n] if wrap else order[part * n:(part + 1) * n]
    return [records[i] for i in idx.tolist()], epoch


# -----------------------------------------------------------------------------
# 3. the loop

def main(argv=None):
    args = parse_args(argv)
    stop = StopFlag()
    dist = Dist(args.device)
    try:
        return train(args, dist, stop)
    finally:
        stop.restore()
        dist.close()


def train(args, dist, stop):
    log = print if dist.main else (lambda *a, **k: None)
    heap_mmap_threshold(args.heap_mmap_mb)              # before any tensor (README, Performance: memory)
    if dist.main:
        prepare_output_dir(args.output_dir, vars(args), args.resume, args.overwrite)
    dist.barrier()
    random.seed(args.seed + dist.rank)
    torch.manual_seed(args.seed)                        # same LoRA init on every rank (DDP also broadcasts it)
    model, tok = setup_model(args, dist, log)
    if args.init_from:                                  # before resume: a checkpoint's weights win
        load_start_weights(model, args.init_from)
        log(f"weights from {args.init_from}")
    records, example = load_records(args, tok, log)
    steps_per_epoch = math.ceil(len(records) / (args.batch_size * dist.world))   # B prompts x W ranks a step
    total_steps = args.max_steps if args.max_steps > 0 else args.epochs * steps_per_epoch
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer, scheduler = make_optimizer(args, params, total_steps, dist.device, log)
    state = resume(args.output_dir, model, optimizer, scheduler, dist, log) if args.resume else {"step": 0}
    if state.get("checkpoint"):
        log(f"resumed from {state['checkpoint']} at step {state['step']}")
    else:
        torch.manual_seed(args.seed + dist.rank)        # different samples on each rank
    write_config(args, dist, total_steps)
    cfg = step_config(args, entropy_filter_mode(args, state, model, tok, records, example, dist, log))
    write_config(args, dist, total_steps, h_ini=state.get("h_ini"), entropy_filter_applied=cfg.entropy_filter)
    ref_model = None
    if cfg.method == "grpo" and cfg.beta > 0 and args.lora_rank == 0:   # no adapters to switch off
        import copy
        ref_model = copy.deepcopy(model).eval().requires_grad_(False)
    policy = dist.wrap(PolicyPass(model))               # the gradient pass (DDP sees one forward); `model` samples
    wandb = __import__("wandb") if args.report_to == "wandb" and dist.main else None
    if wandb:
        wandb.init(project="gtpo", config=vars(args), resume="allow")

    from tqdm import tqdm
    bar = tqdm(range(state["step"], total_steps), initial=state["step"], total=total_steps, desc=args.method,
               dynamic_ncols=True, disable=not dist.main)
    metrics, nonfinite_run = MetricsLog(args.output_dir, dist.main), 0
    conflict_log = make_conflict_log(cfg, model, tok, state, dist)
    model.train()
    try:
        for step in bar:
            bar.set_description("sft warm-up" if args.method != "sft" and step < args.sft_warmup_steps else args.method,
                                refresh=False)
            t0, clock = time.time(), steps.Clock(dist.device)
            m = run_step(args, cfg, step, steps_per_epoch, records, example, model, policy, ref_model, tok,
                         dist, clock, metrics, total_steps, conflict_log)
            # ---- clip, optimizer step (non-finite loss or gradient: skip the step, count it)
            grad_norm = torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm)   # grads already averaged
            m.update({f"time/{k}": v for k, v in clock.parts.items()})
            m.update(dist.mean({k: v for k, v in m.items() if k not in ("step", "epoch", "phase")}))
            finite = math.isfinite(m["loss"]) and torch.isfinite(grad_norm)
            if finite:
                optimizer.step()
            nonfinite_run = 0 if finite else nonfinite_run + 1
            m.update({} if finite else {"skipped_nonfinite": 1})
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            m.update(grad_norm=grad_norm.item(), lr=scheduler.get_last_lr()[0], step_time=time.time() - t0)
            # ---- log, checkpoint
            metrics.write(m)
            if wandb:
                wandb.log(m, step=step + 1)
            bar.set_postfix({short: round(m[k], 3) for k, short in BAR.items() if k in m})
            if nonfinite_run >= 5:
                raise FloatingPointError(f"{nonfinite_run} consecutive steps had a non-finite loss or gradient "
                                         f"(last at step {step + 1}); lower --lr or check the data. "
                                         f"Checkpoints in {args.output_dir} are intact.")
            stopping = any(dist.gather(stop.signal is not None))
            if (step + 1) % args.save_steps == 0 or step + 1 == total_steps or stopping:
                checkpoint(args, step + 1, model, tok, optimizer, scheduler, state, dist, conflict_log)
            if stopping:
                bar.close()
                log(f"stopped after step {step + 1} of {total_steps} ({stop.signal or 'signal on another rank'}); "
                    f"checkpoint-{step + 1} saved. Continue with the same command plus --resume")
                return 0
    finally:
        metrics.close()
    finish(args, model, tok, params, dist, log)
    return 0


def run_step(args, cfg, step, steps_per_epoch, records, example, model, policy, ref_model, tok, dist, clock,
             metrics, total_steps, conflict_log):
    """One optimizer step's forward and backward: SFT (method or warm-up) or RL; its metrics row."""
    G, B = args.generation_size, args.batch_size
    if args.method != "sft" and step < args.sft_warmup_steps:      # warm-up: as many sequences as an RL step
        batch, epoch = step_records(records, step, steps_per_epoch, B * G, dist, args.seed, wrap=True)
    else:
        batch, epoch = step_records(records, step, steps_per_epoch, B, dist, args.seed)
    head = {"step": step + 1, "epoch": epoch}
    if args.method == "sft" or step < args.sft_warmup_steps:
        return {**head, **steps.sft_step(policy, tok, batch, example, cfg, dist.device, clock)}
    prompts = [format_prompt(tok, r["question"], example) for r in batch]
    m, ro, scored = steps.rl_step(model, policy, tok, prompts, [r["answer"] for r in batch], cfg, ref_model, clock,
                                  conflict_log=conflict_log)
    if args.sample_every and (step % args.sample_every == 0 or step == total_steps - 1):   # the first group, whole
        metrics.samples(group_rows(tok, ro, scored, range(G), step + 1, batch[0]["question"], batch[0]["answer"]))
    return {**head, **m}


def checkpoint(args, n, model, tok, optimizer, scheduler, state, dist, conflict_log=None):
    """checkpoint-n with every rank's RNG (rank 0 writes; the others wait); conflicts.json beside it."""
    rngs = dist.gather(rng_state(dist.device))
    if dist.main:
        save_checkpoint(os.path.join(args.output_dir, f"checkpoint-{n}"), model, tok, optimizer, scheduler,
                        {"step": n, "h_ini": state.get("h_ini"), "config": vars(args),
                         "rng": rngs if dist.world > 1 else rngs[0], "world_size": dist.world,
                         "conflicts": conflict_log and conflict_log.state_dict()})
        if conflict_log is not None:
            write_json(os.path.join(args.output_dir, "conflicts.json"), conflict_log.summary(tok))
    dist.barrier()


def finish(args, model, tok, params, dist, log):
    """Check that DDP ranks agree bit for bit, then save final/."""
    if dist.world > 1:
        prints = dist.gather(weights_fingerprint(params))
        if any(p != prints[0] for p in prints):
            raise RuntimeError(f"DDP ranks ended with different weights: {prints}")
        log(f"ddp: trainable weights bit-identical on all {dist.world} ranks")
    if dist.main:
        save_folder(os.path.join(args.output_dir, "final"), lambda tmp: (model.save_pretrained(tmp),
                                                                         tok.save_pretrained(tmp)))
    log(f"done: adapter/model in {os.path.join(args.output_dir, 'final')}, "
        f"metrics in {os.path.join(args.output_dir, 'metrics.jsonl')}")


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (ConfigError, DataError, ModelError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except (FloatingPointError, SaveError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
