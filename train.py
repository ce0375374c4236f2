"""Train with GTPO, GRPO or SFT (arXiv 2508.03772). Reads top to bottom:

config -> model -> data -> optimizer -> [entropy <H>_ini] -> loop:
    rollout (no grad) -> rewards -> advantages -> conflict weights -> entropy gate
    -> loss -> backward -> clip -> step -> log -> checkpoint

    python train.py                                  # offline demo: GTPO, SmolLM2-135M, arithmetic
    python train.py --model llama-8b --dataset gsm8k --optimizer adam --lr 1e-6 --epochs 3 \
        --batch_size 2 --generation_size 12 --use_gtpo
"""
import argparse
import contextlib
import glob
import json
import math
import os
import random
import shutil
import sys
import time

import torch

import gtpo
from data import DataError, filter_by_prompt_length, format_prompt, load_task, tagged_solution
from models import ALIASES, ModelError, load_model
from rewards import score
from rollout import rollout, sequence_logprobs

# -----------------------------------------------------------------------------
# 1. config: the paper's Listing 1 are the defaults; the embedded model has a demo profile

PAPER = dict(lr=1e-6, generation_size=12, max_prompt_length=4000, max_completion_length=1500,
             warmup_ratio=0.005, save_steps=500, ent_ini_prompts=100, sft_warmup_steps=0,
             one_shot=False, max_steps=-1, load_in_4bit=True)
# SmolLM2-135M is not in the paper. It never writes the tag format on its own, so the demo
# shows it one worked example in the prompt (one_shot) and uses a LoRA-sized learning rate.
PROFILES = {"smollm2-135m": dict(lr=2e-4, generation_size=8, max_prompt_length=512,
                                 max_completion_length=96, warmup_ratio=0.05, save_steps=20,
                                 ent_ini_prompts=16, one_shot=True, sft_warmup_steps=4, max_steps=36)}
BETAS = {"gtpo": (0.999999, 0.999999), "grpo": (0.9, 0.95), "sft": (0.9, 0.95)}   # Listing 1


class ConfigError(ValueError):
    pass


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    m = p.add_mutually_exclusive_group()
    m.add_argument("--use_gtpo", action="store_true", help="train with GTPO (default)")
    m.add_argument("--use_grpo", action="store_true", help="train with the GRPO baseline (Eq. 1)")
    m.add_argument("--use_sft", action="store_true", help="supervised fine-tuning on the worked solutions")
    a("--model", default="smollm2-135m", help="alias (llama-8b, qwen2.5-3b, smollm2-135m), local folder or Hub id")
    a("--dataset", default="arithmetic", help="gsm8k, math, arithmetic (built-in), or a .jsonl path")
    a("--data_dir", default=None, help="folder with <dataset>/<split>.jsonl (default $GTPO_DATA_DIR, then the Hub)")
    a("--output_dir", default=None, help="where metrics, samples and checkpoints go (default runs/<method>-<model>-<dataset>)")
    a("--overwrite", action="store_true", help="reuse an output_dir that holds another run (its files are replaced)")
    a("--resume", action="store_true", help="continue from the last checkpoint in output_dir")
    a("--seed", type=int, default=3407, help="random seed (Listing 1: 3407)")
    a("--device", default=None, help="cuda, cuda:1 or cpu (default: cuda if available)")
    # data and sampling
    a("--batch_size", type=int, default=1, help="PROMPTS per optimizer step; each gets --generation_size completions")
    a("--generation_size", type=int, default=None, help="G, completions per prompt (paper: 8 or 12)")
    a("--micro_batch_size", type=int, default=0, help="completions per forward/backward (0 = all at once)")
    a("--logprob_chunk", type=int, default=256,
      help="completion tokens per LM-head chunk for log-probs/entropy (0 = full (N, L, V) logits)")
    a("--epochs", type=int, default=1, help="passes over the training prompts (Listing 1: 1)")
    a("--max_steps", type=int, default=None, help="stop after this many optimizer steps (-1 = epochs decide)")
    a("--max_prompt_length", type=int, default=None, help="longer prompts are dropped (and counted)")
    a("--max_completion_length", type=int, default=None, help="max new tokens per completion")
    a("--temperature", type=float, default=1.0, help="sampling temperature (paper: 1.0)")
    a("--one_shot", action=argparse.BooleanOptionalAction, default=None,
      help="show one worked example (in the tag format) before the question")
    # optimisation
    a("--optimizer", choices=["adam", "adamw_torch"], default="adam",
      help="adam = bitsandbytes PagedAdamW8bit (Listing 1); adamw_torch = torch.optim.AdamW")
    a("--lr", type=float, default=None, help="learning rate (paper: 1e-6)")
    a("--adam_beta1", type=float, default=None, help="Adam beta1 (GTPO 0.999999; GRPO/SFT 0.9)")
    a("--adam_beta2", type=float, default=None, help="Adam beta2 (GTPO 0.999999; GRPO/SFT 0.95)")
    a("--weight_decay", type=float, default=0.1, help="AdamW weight decay (Listing 1: 0.1)")
    a("--warmup_ratio", type=float, default=None, help="linear warm-up fraction of a cosine schedule (paper: 0.005)")
    a("--max_grad_norm", type=float, default=0.1, help="gradient clipping norm (Listing 1: 0.1)")
    a("--lora_rank", type=int, default=None, help="LoRA rank on q,k,v,o,gate,up,down (Llama 128, Qwen 64); 0 = full fine-tuning")
    a("--load_in_4bit", action=argparse.BooleanOptionalAction, default=None, help="4-bit NF4 weights (CUDA only)")
    a("--gradient_checkpointing", action="store_true", help="trade compute for activation memory")
    a("--sft_warmup_steps", type=int, default=None,
      help="SFT steps (batch_size x G worked solutions each) before RL (0 = none)")
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
      help="auto = Eq. 6 (filter iff <H>_ini < ln 2); all; neg (OnlyNeg, App. 13); off")
    a("--ent_ini_prompts", type=int, default=None, help="training prompts used to measure <H>_ini (paper: 100)")
    a("--scale_rewards", action=argparse.BooleanOptionalAction, default=True,
      help="divide advantages by the group std (Eq. 8); --no-scale_rewards = released code")
    # logging
    a("--save_steps", type=int, default=None, help="checkpoint every N steps (Listing 1: 500)")
    a("--sample_every", type=int, default=10, help="write a few completions to samples.jsonl every N steps")
    a("--report_to", choices=["none", "wandb"], default="none", help="also log to Weights & Biases")
    args = p.parse_args(argv)

    args.method = "sft" if args.use_sft else "grpo" if args.use_grpo else "gtpo"
    profile = PROFILES.get(args.model, {})
    for k, v in PAPER.items():
        if getattr(args, k) is None:
            setattr(args, k, profile.get(k, v))
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
    if args.output_dir is None:
        name = os.path.basename(args.dataset).removesuffix(".jsonl")
        args.output_dir = os.path.join("runs", f"{args.method}-{os.path.basename(args.model)}-{name}")
    return args


# -----------------------------------------------------------------------------
# 2. helpers: run directory, checkpoints

RUN_KEYS = ("method", "model", "dataset", "lora_rank", "generation_size", "batch_size", "seed")


def prepare_output_dir(args):
    """Refuse to mix two runs in one folder; on --resume check the checkpoint fits this config."""
    cfg_path = os.path.join(args.output_dir, "config.json")
    if os.path.exists(cfg_path):
        old = json.load(open(cfg_path))
        if args.resume:
            diff = {k: (old.get(k), getattr(args, k)) for k in RUN_KEYS if old.get(k) != getattr(args, k)}
            if diff:
                raise ConfigError(f"--resume: {args.output_dir} holds a run with a different config "
                                  + ", ".join(f"{k}: {a!r} there vs {b!r} now" for k, (a, b) in diff.items())
                                  + "; use the same flags or another --output_dir")
        elif not args.overwrite:
            raise ConfigError(f"{args.output_dir} already holds a run: pass --resume to continue it, "
                              f"--overwrite to replace it, or another --output_dir")
        else:
            for f in ("metrics.jsonl", "samples.jsonl"):
                if os.path.exists(os.path.join(args.output_dir, f)):
                    os.remove(os.path.join(args.output_dir, f))
            for d in glob.glob(os.path.join(args.output_dir, "checkpoint-*")):
                shutil.rmtree(d)
    elif args.resume:
        raise ConfigError(f"--resume: no run in {args.output_dir} (no config.json); start without --resume")
    os.makedirs(args.output_dir, exist_ok=True)


def last_checkpoint(out):
    ckpts = [d for d in glob.glob(os.path.join(out, "checkpoint-*")) if d.rsplit("-", 1)[-1].isdigit()]
    return max(ckpts, key=lambda d: int(d.rsplit("-", 1)[-1]), default=None)


def save_checkpoint(path, model, tokenizer, optimizer, scheduler, state):
    """Adapter (PEFT format) or full model + optimizer, scheduler and `state` (step, RNG of every
    rank, config, <H>_ini) in trainer_state.pt.
    Written to a temporary folder and renamed, so a kill mid-save leaves the old one intact."""
    tmp = path + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), **state},
               os.path.join(tmp, "trainer_state.pt"))
    shutil.rmtree(path, ignore_errors=True)
    os.rename(tmp, path)


def load_weights(model, path):
    from safetensors.torch import load_file
    if hasattr(model, "peft_config"):
        from peft import set_peft_model_state_dict
        set_peft_model_state_dict(model, load_file(os.path.join(path, "adapter_model.safetensors")))
    else:
        from transformers.modeling_utils import load_sharded_checkpoint
        if os.path.exists(os.path.join(path, "model.safetensors")):
            model.load_state_dict(load_file(os.path.join(path, "model.safetensors")), strict=False)
        else:
            load_sharded_checkpoint(model, path)


def truncate_metrics(path, step):
    """Drop rows logged after the checkpoint we resume from, so no step appears twice."""
    if not os.path.exists(path):
        return
    rows = [line for line in open(path) if line.strip() and json.loads(line).get("step", 0) <= step]
    with open(path + ".tmp", "w") as f:
        f.writelines(rows)
    os.replace(path + ".tmp", path)


def make_optimizer(args, params):
    kw = dict(lr=args.lr, betas=(args.adam_beta1, args.adam_beta2), weight_decay=args.weight_decay)
    if args.optimizer == "adam":
        import bitsandbytes as bnb
        return bnb.optim.PagedAdamW8bit(params, **kw)       # paged on CUDA, plain 8-bit states on CPU
    return torch.optim.AdamW(params, **kw)


def sft_batch(tokenizer, records, one_shot, device):
    """Prompt + worked solution in the tag format + EOS, as (prompt, completion) tensors."""
    prompts = [format_prompt(tokenizer, r["question"], one_shot) for r in records]
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    targets = [tokenizer(tagged_solution(r) + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
               for r in records]
    L = max(len(t) for t in targets)
    ids = torch.full((len(records), L), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(records), L, dtype=torch.long)
    for i, t in enumerate(targets):
        ids[i, :len(t)] = torch.tensor(t)
        mask[i, :len(t)] = 1
    return enc["input_ids"].to(device), enc["attention_mask"].to(device), ids.to(device), mask.to(device)


def measure_initial_entropy(model, tokenizer, records, args, one_shot):
    """<H>_ini (Sec. 5.2, Eq. 6): mean completion entropy of the untrained policy on the first
    `ent_ini_prompts` training prompts, one sample each."""
    vals = []
    recs = records[:args.ent_ini_prompts]
    for i in range(0, len(recs), 8):
        prompts = [format_prompt(tokenizer, r["question"], one_shot) for r in recs[i:i + 8]]
        ro = rollout(model, tokenizer, prompts, 1, args.max_completion_length, args.temperature)
        with torch.no_grad():
            _, ent = sequence_logprobs(model, ro.prompt_ids, ro.prompt_mask, ro.completion_ids, ro.completion_mask,
                                       chunk_size=args.logprob_chunk)
        vals.append(gtpo.masked_mean(ent, ro.completion_mask, dim=1))
    return torch.cat(vals).mean().item()


# -----------------------------------------------------------------------------
# 3. main

class Dist:
    """torch.distributed for `torchrun --nproc_per_node K train.py ...` (NCCL on GPUs, gloo on CPU);
    a no-op with one process. Each rank rolls out its own prompts; DDP averages the gradients."""

    def __init__(self, device):
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.device = device
        if self.world > 1:
            import torch.distributed as dist
            local = int(os.environ.get("LOCAL_RANK", "0"))
            if device.startswith("cuda"):
                self.device = f"cuda:{local}"
                torch.cuda.set_device(self.device)
            dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
            self.dist = dist

    @property
    def main(self):
        return self.rank == 0

    def wrap(self, model):
        if self.world == 1:
            return model
        from torch.nn.parallel import DistributedDataParallel
        return DistributedDataParallel(model, device_ids=[self.device] if self.device.startswith("cuda") else None)

    def mean(self, values):
        """Average a dict of floats over ranks (same keys on every rank)."""
        if self.world == 1:
            return values
        keys = sorted(values)
        t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=self.device)
        self.dist.all_reduce(t)
        return dict(zip(keys, (t / self.world).tolist()))

    def gather(self, obj):
        if self.world == 1:
            return [obj]
        out = [None] * self.world
        self.dist.all_gather_object(out, obj)
        return out

    def barrier(self):
        if self.world > 1:
            self.dist.barrier()

    def close(self):
        if self.world > 1:
            self.dist.destroy_process_group()


def weights_fingerprint(params):
    """Two exact integer checksums of the raw bits of the trainable weights (ranks must agree)."""
    total, mixed = 0, 0
    for j, p in enumerate(params):
        bits = p.detach().contiguous().view(torch.int16 if p.element_size() == 2 else torch.int32).flatten().long()
        total += bits.sum().item()
        mixed += (bits * (torch.arange(bits.numel(), device=bits.device) % 8191 + j)).sum().item()
    return total, mixed


class StopFlag:
    """SIGTERM / first Ctrl-C: finish the current step, save a checkpoint, exit 0."""

    def __init__(self):
        import signal
        import threading
        self.signal, self.old = None, {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self.old[sig] = signal.signal(sig, self._handler)

    def restore(self):
        import signal
        for sig, handler in self.old.items():
            signal.signal(sig, handler)

    def _handler(self, signum, frame):
        import signal
        if self.signal is not None:                 # a second Ctrl-C stops at once
            raise KeyboardInterrupt
        self.signal = signal.Signals(signum).name
        print(f"\n{self.signal}: finishing this step, then saving a checkpoint (send it again to stop now)",
              file=sys.stderr)


def main(argv=None):
    stop = StopFlag()
    try:
        return run(argv, stop)
    finally:
        stop.restore()


def run(argv, stop):
    args = parse_args(argv)
    dist = Dist(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    device, W, rank = dist.device, dist.world, dist.rank
    if dist.main:
        prepare_output_dir(args)
    dist.barrier()
    log = print if dist.main else (lambda *a, **k: None)
    random.seed(args.seed + rank)
    torch.manual_seed(args.seed)                        # same LoRA init on every rank (DDP also broadcasts it)

    model, tok, info = load_model(args.model, lora_rank=args.lora_rank, load_in_4bit=args.load_in_4bit,
                                  device=device, gradient_checkpointing=args.gradient_checkpointing, log=log)
    args.lora_rank = info["lora_rank"]
    log(f"model {args.model} ({info['path']}): {info['trainable_params']:,} trainable parameters, "
        f"LoRA rank {args.lora_rank}, 4-bit {info['quantized_4bit']}, {info['dtype']} on {device}"
        + (f", {W} ranks" if W > 1 else ""))

    records = load_task(args.dataset, "train", args.data_dir)
    task = os.path.basename(args.dataset).removesuffix(".jsonl")
    one_shot = None
    if args.one_shot:                                   # the first record is the example, not trained on
        one_shot = (records[0]["question"], tagged_solution(records[0]))
        records = records[1:]
    records, dropped = filter_by_prompt_length(records, tok, args.max_prompt_length, one_shot)
    log(f"dataset {args.dataset}: {len(records)} training prompts"
        + (f" ({dropped} dropped: prompt longer than {args.max_prompt_length} tokens)" if dropped else ""))
    if not records:
        raise DataError(f"no training prompts left in {args.dataset!r} after dropping prompts longer than "
                        f"--max_prompt_length {args.max_prompt_length}; raise it")

    # one optimizer step = batch_size prompts x G completions on each of the W ranks
    steps_per_epoch = math.ceil(len(records) / (args.batch_size * W))
    total_steps = args.max_steps if args.max_steps > 0 else args.epochs * steps_per_epoch
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_optimizer(args, params)
    from transformers import get_cosine_schedule_with_warmup
    scheduler = get_cosine_schedule_with_warmup(optimizer, math.ceil(args.warmup_ratio * total_steps), total_steps)

    start, state = 0, {}
    metrics_path = os.path.join(args.output_dir, "metrics.jsonl")
    if args.resume:
        ckpt = last_checkpoint(args.output_dir)
        if ckpt is None:
            raise ConfigError(f"--resume: {args.output_dir} has no checkpoint-* folder yet; start without --resume")
        load_weights(model, ckpt)
        state = torch.load(os.path.join(ckpt, "trainer_state.pt"), weights_only=False)
        if state.get("world_size", 1) != W:
            raise ConfigError(f"--resume: {ckpt} was written by {state.get('world_size', 1)} processes, this run "
                              f"has {W}; resume with the same --nproc_per_node")
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        rng = state["rng"][rank] if isinstance(state["rng"], list) else state["rng"]
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        if "cuda" in rng and device.startswith("cuda"):
            torch.cuda.set_rng_state(rng["cuda"], device)
        start = state["step"]
        if dist.main:
            truncate_metrics(metrics_path, start)
        log(f"resumed from {ckpt} at step {start}")
    else:
        torch.manual_seed(args.seed + rank)             # different samples on each rank
    if dist.main:
        json.dump({**vars(args), "total_steps": total_steps, "world_size": W},
                  open(os.path.join(args.output_dir, "config.json"), "w"), indent=2)

    # Eq. 6: filter completions only for models whose initial entropy is below ln 2
    filter_mode = args.entropy_filter
    if args.method == "gtpo" and filter_mode == "auto":
        if state.get("h_ini") is None:
            state["h_ini"] = dist.mean({"h": measure_initial_entropy(model, tok, records, args, one_shot)})["h"]
        filter_mode = "all" if state["h_ini"] < math.log(2) else "off"
        log(f"<H>_ini = {state['h_ini']:.3f} over {min(args.ent_ini_prompts, len(records))} prompts "
            f"{'<' if filter_mode == 'all' else '>='} ln 2 -> entropy filter {filter_mode} (Eq. 6)")

    wandb = None
    if args.report_to == "wandb" and dist.main:
        import wandb
        wandb.init(project="gtpo", config=vars(args), resume="allow")
    use_ref = args.method == "grpo" and args.beta > 0
    ref_model = None
    if use_ref and args.lora_rank == 0:                 # no adapters to switch off: keep a frozen copy
        import copy
        ref_model = copy.deepcopy(model).eval().requires_grad_(False)
    policy = dist.wrap(model)                           # DDP for the gradient pass; `model` generates

    from tqdm import tqdm
    bar = tqdm(range(start, total_steps), initial=start, total=total_steps, desc=args.method, dynamic_ncols=True,
               disable=not dist.main)
    metrics_f = open(metrics_path, "a") if dist.main else None
    nonfinite_run = 0
    model.train()
    for step in bar:
        t0 = time.time()
        epoch, k = divmod(step, steps_per_epoch)
        order = torch.randperm(len(records), generator=torch.Generator().manual_seed(args.seed + epoch))
        part = k * W + rank                             # this rank's slice of the epoch's order
        batch = [records[i] for i in order[part * args.batch_size:(part + 1) * args.batch_size].tolist()]
        m = {"step": step + 1, "epoch": epoch}
        sft_phase = args.method == "sft" or step < args.sft_warmup_steps

        if sft_phase:
            # ---- SFT: token NLL of the worked solution in the tag format
            if args.method != "sft":                    # warm-up: as many sequences as an RL step
                n = args.batch_size * args.generation_size
                batch = [records[i] for i in order[(part * n) % len(records):][:n].tolist()]
            p_ids, p_mask, c_ids, c_mask = sft_batch(tok, batch, one_shot, device)
            logp, _ = sequence_logprobs(policy, p_ids, p_mask, c_ids, c_mask, with_entropy=False,
                                        chunk_size=args.logprob_chunk)
            loss = -gtpo.masked_mean(logp, c_mask)
            loss.backward()
            m.update(phase="sft", loss=loss.item())
        else:
            # ---- 1. rollout (no grad): G completions per prompt, one generate call
            G = args.generation_size
            prompts = [format_prompt(tok, r["question"], one_shot) for r in batch]
            ro = rollout(model, tok, prompts, G, args.max_completion_length, args.temperature)
            mask = ro.completion_mask
            t_gen = time.time()
            # ---- 2. rewards -> group advantages (Eq. 8)
            total, fmt, cor = score(ro.texts, [r["answer"] for r in batch for _ in range(G)], task)
            adv = gtpo.group_advantages(total, G, scale=args.scale_rewards).to(device)
            t_score = time.time()
            # ---- 3. conflict weights lambda_{i,t} (Eq. 5), per group
            if args.method == "gtpo":
                weights, conflict, n_conf = gtpo.batch_conflict_weights(
                    ro.completion_ids, mask, adv, G, pos_weight=args.conflict_weight, combine=args.conflict_combine)
            # ---- 4. loss over micro-batches of completions, backward (DDP syncs on the last one)
            N = len(ro.texts)
            mb = args.micro_batch_size or N
            ent_i, gated, kls, loss_sum = [], [], [], 0.0
            for s in range(0, N, mb):
                sl = slice(s, s + mb)
                sync = s + mb >= N or W == 1
                with contextlib.nullcontext() if sync else policy.no_sync():
                    logp, ent = sequence_logprobs(policy, ro.prompt_ids[sl], ro.prompt_mask[sl],
                                                  ro.completion_ids[sl], mask[sl], chunk_size=args.logprob_chunk)
                    h = gtpo.masked_mean(ent, mask[sl], dim=1)                       # <H>_i
                    ent_i.append(h)
                    if args.method == "gtpo":
                        a = gtpo.entropy_gate(adv[sl], h, args.ent_threshold, args.ent_gamma, filter_mode)  # Eq. 6-7
                        gated.append(a)
                        loss, lm = gtpo.gtpo_loss(logp, mask[sl], a, weights[sl],
                                                  n_conf[sl] if args.conflict_norm else None)
                    else:
                        ref = None
                        if use_ref:                 # reference = adapters off, or the frozen copy
                            ctx = contextlib.nullcontext() if ref_model is not None else model.disable_adapter()
                            with torch.no_grad(), ctx:
                                ref, _ = sequence_logprobs(model if ref_model is None else ref_model,
                                                           ro.prompt_ids[sl], ro.prompt_mask[sl], ro.completion_ids[sl],
                                                           mask[sl], with_entropy=False, chunk_size=args.logprob_chunk)
                        loss, lm = gtpo.grpo_loss(logp, None, ref, mask[sl], adv[sl], beta=args.beta,
                                                  clip_eps=args.clip_eps)
                    n_mb = min(s + mb, N) - s
                    if "kl" in lm:
                        kls.append(lm["kl"] * n_mb)
                    part_loss = loss * n_mb / N                                      # mean over all N completions
                    part_loss.backward()          # always (DDP ranks must agree); a NaN is caught at the step
                loss_sum += part_loss.item()
            m.update({"time/generate": t_gen - t0, "time/reward": t_score - t_gen, "time/loss": time.time() - t_score})
            h_all = torch.cat(ent_i)
            lengths = mask.sum(1).float()
            std = total.view(-1, G).std(dim=1)
            m.update(phase="rl", loss=loss_sum, reward=total.mean().item(),
                     reward_std=std.mean().item(), **{"rewards/format": fmt.mean().item(),
                     "rewards/accuracy": cor.mean().item()},
                     frac_reward_zero_std=(std == 0).float().mean().item(), entropy=h_all.mean().item(),
                     **{"completions/mean_length": lengths.mean().item(),
                        "completions/clipped_ratio": ro.truncated.float().mean().item()})
            if args.method == "gtpo":
                g = torch.cat(gated)
                m.update({"gtpo/filtered_frac": ((g == 0) & (adv != 0)).float().mean().item()
                          if filter_mode != "off" else 0.0,
                          "gtpo/conflict_frac": (conflict.sum() / mask.sum().clamp(min=1)).item(),
                          "gtpo/mean_conflict_tokens": n_conf.float().mean().item()})
            if kls:
                m["kl"] = (sum(kls) / N).item()
            if dist.main and args.sample_every and (step % args.sample_every == 0 or step == total_steps - 1):
                with open(os.path.join(args.output_dir, "samples.jsonl"), "a") as f:
                    for i in range(min(G, 4)):
                        f.write(json.dumps({"step": step + 1, "question": batch[0]["question"],
                                            "answer": batch[0]["answer"], "completion": ro.texts[i],
                                            "reward": total[i].item()}) + "\n")

        # ---- 5. clip, step (non-finite loss or gradient: skip the step, count it)
        grad_norm = torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm)   # grads are already averaged
        m.update(dist.mean({k: v for k, v in m.items() if k not in ("step", "epoch", "phase")}))
        if math.isfinite(m["loss"]) and torch.isfinite(grad_norm):
            optimizer.step()
            nonfinite_run = 0
        else:
            nonfinite_run += 1
            m["skipped_nonfinite"] = 1
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        m.update(grad_norm=grad_norm.item(), lr=scheduler.get_last_lr()[0], step_time=time.time() - t0)

        # ---- 6. log, checkpoint
        if dist.main:
            metrics_f.write(json.dumps(m) + "\n")
            metrics_f.flush()
            if wandb:
                wandb.log(m, step=step + 1)
        bar.set_postfix({k: round(m[k], 3) for k in ("reward", "rewards/format", "entropy", "loss") if k in m})
        if nonfinite_run >= 5:
            raise FloatingPointError(f"{nonfinite_run} consecutive steps had a non-finite loss or gradient "
                                     f"(last at step {step + 1}); lower --lr or check the data. "
                                     f"Checkpoints in {args.output_dir} are intact.")
        stopping = any(dist.gather(stop.signal is not None))
        if (step + 1) % args.save_steps == 0 or step + 1 == total_steps or stopping:
            rngs = dist.gather({"torch": torch.get_rng_state(), "python": random.getstate(),
                                **({"cuda": torch.cuda.get_rng_state(device)} if device.startswith("cuda") else {})})
            if dist.main:
                save_checkpoint(os.path.join(args.output_dir, f"checkpoint-{step + 1}"), model, tok, optimizer,
                                scheduler, {"step": step + 1, "h_ini": state.get("h_ini"), "config": vars(args),
                                            "rng": rngs if W > 1 else rngs[0], "world_size": W})
            dist.barrier()
        if stopping:
            bar.close()
            log(f"stopped after step {step + 1} of {total_steps} ({stop.signal or 'signal on another rank'}); "
                f"checkpoint-{step + 1} saved. Continue with the same command plus --resume")
            dist.close()
            return 0
    if metrics_f:
        metrics_f.close()
    if W > 1:
        prints = dist.gather(weights_fingerprint(params))
        if any(p != prints[0] for p in prints):
            raise RuntimeError(f"DDP ranks ended with different weights: {prints}")
        log(f"ddp: trainable weights bit-identical on all {W} ranks")
    if dist.main:
        final = os.path.join(args.output_dir, "final")
        shutil.rmtree(final, ignore_errors=True)
        model.save_pretrained(final)
        tok.save_pretrained(final)
    log(f"done: {total_steps} steps; adapter/model in {os.path.join(args.output_dir, 'final')}, metrics in {metrics_path}")
    dist.close()
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (ConfigError, DataError, ModelError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except FloatingPointError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
