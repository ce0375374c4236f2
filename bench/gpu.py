"""`python -m bench --parts gpu`: the paper's step measured on a lent GPU, in one command.

On a random-weight model of the paper's shape (--gpu_shape llama-8b: 4-bit NF4, LoRA 128, bf16),
train.py's CUDA defaults (the memory plan and --rollout auto's sampler included), one ~250-token prompt
and G = 12 completions. --gpu_parts all is samplers,step,cap40,trl; each
part's results also go to --gpu_out, one JSON with a key per part:
1. samplers     each sampler, --gpu_sample_tokens forced tokens, its second call timed: seconds,
                tokens/s per sequence and in all, the weight-streaming bound (sampling weights' bytes
                / measured bandwidth per decode step), peak memory. Samplers: generate (4-bit,
                eager), merged (the policy's kept bf16 copy with LoRA merged, refreshed in place,
                through transformers' generate with a static cache, eager) and merged+compile (CUDA),
                and merged loop (the copy's own decode loop, merged_rollout.Decoder: compiled on CUDA)
2. step         two step.rl_step at --gpu_step_tokens forced tokens (1,500: the paper's length): the
                first's seconds, then the second's (no compile in it) per stage and the step; peak memory
                per stage (torch.cuda.max_memory_allocated) and the card's peak (reserved + managed)
                beside memory.estimate's
3. cap40        in a fresh process capped at 40 GB (torch.cuda.set_per_process_memory_fraction), the
                paper's A100 40GB: the memory plan for a 40 GB budget, then 2 steps at --gpu_step_tokens;
                whether it ran out of memory, its seconds and peaks
4. trl          TRL's GRPOTrainer (no vLLM: `generate` through the same 4-bit policy with LoRA) on the same
                model, G and --gpu_trl_tokens forced tokens, against step.rl_step at that length:
                median seconds per step after the first, and the ratio
5. determinism  the same 3 steps twice from one seed (--gpu_det_tokens): the metrics that differ (from
                which step, by how much) and the weights; where some do, the pair again under
                torch.use_deterministic_algorithms (strict: an operation without a deterministic
                kernel stops it and is named)
6. h_ini        train.py's <H>_ini pass before step 1 at --gpu_step_tokens forced tokens: seconds,
                peak memory beside memory.estimate's
7. gqa          the merged decode loop at --gpu_step_tokens forced tokens as samplers times it: its attention
                (merged_rollout.grouped_sdpa, query heads grouped onto their K/V heads) against transformers'
                SDPA, which compiled repeats K and V to every query head over the whole static cache
--device cpu runs the same code with G = 4 and a few tokens per part (token flags left unset): --gpu_shape tiny,
a 2-layer model, in seconds; --gpu_shape smollm2-135m (or any model alias or folder), that model's own
weights, the dry run of --gpu_parts all.
"""
import copy
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

import step as steps
from machinery.models import autocast
from speedups import memory, memory_plan, merged_rollout

TINY = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, tie_word_embeddings=False)
PARTS = ("samplers", "step", "cap40", "trl", "determinism", "h_ini", "gqa")
ALL = ("samplers", "step", "cap40", "trl")
# forced tokens per part when not given: (CUDA, CPU dry run)
TOKENS = {"gpu_sample_tokens": (128, 8), "gpu_step_tokens": (1500, 16), "gpu_trl_tokens": (256, 8),
          "gpu_det_tokens": (32, 4)}
CAP_GB = 40
SAMPLERS = {"generate": ("generate", {}),                     # transformers' generate: the policy, then the copy
            "merged": ("merged", {"cache_implementation": "static", "disable_compile": True}),
            "merged+compile": ("merged", {"cache_implementation": "static"}),
            "merged loop": ("loop", {})}                   # merged_rollout.Decoder: compiled on CUDA, eager elsewhere
GQA = {"merged loop": ("loop", {"attention": merged_rollout.ATTENTION}),   # the copy's: grouped_sdpa
       "merged loop, K/V repeated": ("loop", {"attention": "sdpa"})}      # transformers' SDPA


def _gb(clock, stage):
    """A stage's measured peak in GB, or "–" off CUDA (not measured there)."""
    return f"{clock.peaks[stage] / 1e9:.2f}" if stage in clock.peaks else "–"


def managed_bytes(optimizer):
    """Bytes of a paged bitsandbytes optimizer's state: CUDA managed memory, which torch's allocator
    (and so max_memory_reserved) never sees."""
    return sum(v.numel() * v.element_size() for st in getattr(optimizer, "state", {}).values()
               for v in st.values() if torch.is_tensor(v) and getattr(v, "is_paged", False))


class PeakClock(steps.Clock):
    """step.Clock that also keeps each stage's peak CUDA memory on its device (bytes; none elsewhere):
    `peaks` allocated, `reserved` what the allocator held plus the optimizer's managed memory -- what
    the card must have, to compare with memory.estimate."""

    def __init__(self, device, optimizer=None):
        super().__init__(device)
        self.peaks, self.reserved, self.optimizer = {}, {}, optimizer
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def __call__(self, stage):
        super().__call__(stage)
        if self.cuda:
            held = torch.cuda.max_memory_reserved(self.device) + managed_bytes(self.optimizer)
            self.peaks[stage] = max(self.peaks.get(stage, 0), torch.cuda.max_memory_allocated(self.device))
            self.reserved[stage] = max(self.reserved.get(stage, 0), held)
            torch.cuda.reset_peak_memory_stats(self.device)


def random_model_dir(shape, device):
    """A folder with random bf16 weights of `shape` (an alias of memory.SHAPES, or "tiny") and the
    embedded tokenizer, so the model loads through models.load_model as train.py loads one."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from machinery.models import embedded_model_dir, load_tokenizer
    tok = load_tokenizer(embedded_model_dir())
    kw = dict(memory.SHAPES[shape]) if shape in memory.SHAPES else dict(TINY, vocab_size=len(tok))
    config = AutoConfig.for_model(kw.pop("model_type"), **kw, bos_token_id=tok.bos_token_id,
                                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    d = tempfile.mkdtemp(prefix=f"gtpo-{shape}-")
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(d)
    tok.save_pretrained(d)
    del model
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()                        # the next parts (a capped child process first) need it
    return d


def setup(args, folder, extra=()):
    """(cfg, model, tok, optimizer, params) as train.py builds them for the bench's step."""
    import train
    from machinery.config import parse_args
    from machinery.models import load_model, pick_dtype
    G = "12" if args.device.startswith("cuda") else "4"                     # the paper's G; a CPU dry run's
    cfg = parse_args(["--model", folder, "--dataset", "gsm8k", "--generation_size", G, "--device", args.device,
                      "--max_completion_length", str(args.gpu_step_tokens),
                      "--lora_rank", "128" if args.gpu_shape == "llama-8b" else "64", "--entropy_filter", "all",
                      "--load_in_4bit", "--dtype", "bfloat16", *extra])
    model, tok, _ = load_model(folder, lora_rank=cfg.lora_rank, load_in_4bit=True, device=args.device,
                               dtype=pick_dtype(cfg.dtype, args.device), log=lambda *a: None,
                               gradient_checkpointing=cfg.gradient_checkpointing)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer, _ = train.make_optimizer(cfg, params, 1000, log=lambda *a: None)
    return cfg, model, tok, optimizer, params


def one_step(cfg, model, tok, optimizer, params, prompt, answer, tokens):
    """step.rl_step + clip + optimizer step, `tokens` forced -> (metrics, PeakClock)."""
    from bench.common import spread_rewards
    cfg = dataclasses.replace(cfg, max_completion_length=tokens, min_new_tokens=tokens)
    clock = PeakClock(cfg.device, optimizer)
    with spread_rewards():
        m, _, _ = steps.rl_step(model, model, tok, [prompt], [answer], cfg, clock=clock)
    m["grad_norm"] = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm).item()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    clock("optimizer")
    return m, clock


def sampling(args, cfg, model, tok, prompt, res, part="samplers", samplers=SAMPLERS, tokens=None):
    """Part 1 (samplers): each sampler's seconds, tokens/s and peak for G rows of --gpu_sample_tokens forced
    tokens, each called twice and the second call timed: for the merged samplers that is the policy's
    one kept copy refreshed in place and sampled from (merged_rollout.merged_sampler), what a training
    step pays; the first call builds it (and compiles). Part 7 (gqa): the same for GQA's samplers at
    `tokens`, a new decode loop for each attention."""
    import gc
    from bench.common import memory_bandwidth
    from rollout import eos_ids, generate
    L, G = tokens or args.gpu_sample_tokens, cfg.generation_size
    bandwidth = memory_bandwidth(args.device)
    enc = tok([prompt], return_tensors="pt", add_special_tokens=False,
              pad_to_multiple_of=merged_rollout.PAD_MULTIPLE).to(args.device)
    eos, pad = eos_ids(model, tok), tok.pad_token_id
    print(f"\n{PARTS.index(part) + 1}. {part}: G {G} x {L} forced tokens, prompt {enc['input_ids'].shape[1]} "
          f"tokens; bandwidth {bandwidth / 1e9:.0f} GB/s")
    print("| sampler | first call s | seconds | tok/s per sequence | tok/s in all | bound tok/s per sequence | "
          "of bound | peak GB |")
    print("|---|---|---|---|---|---|---|---|")
    res[part] = {}
    model.eval()
    for name, (path, extra) in samplers.items():
        if name == "merged+compile" and not args.device.startswith("cuda"):
            continue                                            # transformers compiles on CUDA only
        if "attention" in extra:
            merged_rollout.use_attention(model, extra["attention"])
        if path == "loop":                                      # sized to this part's rows and prompt: one shape
            merged_rollout.reserve(model, G, enc["input_ids"].shape[1], L)
        calls = []
        for _ in range(2):
            gc.collect()                                        # what earlier calls left is not this one's peak
            clock = PeakClock(args.device)
            with torch.no_grad(), autocast(model):
                sampler = model if path == "generate" else merged_rollout.merged_sampler(model)
                draw = merged_rollout.decoder(model, sampler, G, enc["input_ids"].shape[1], L) if path == "loop" \
                    else lambda *a: generate(*a, **extra)
                draw(sampler, enc["input_ids"], enc["attention_mask"], G, L, L, eos, pad)
            clock("generate")
            calls.append(clock.parts["generate"])
        sec = calls[-1]
        weights = sum(p.numel() * p.element_size() for p in sampler.parameters())  # NF4 + LoRA, or the dense copy
        bound = bandwidth / weights                             # decode steps/s if weights stream once a step
        row = {"first_call_seconds": calls[0], "seconds": sec, "tokens_per_s_per_sequence": L / sec,
               "tokens_per_s": G * L / sec, "bound_per_sequence": bound, "share_of_bound": L / sec / bound,
               "peak_gb": clock.peaks.get("generate", 0) / 1e9}
        res[part][name] = row
        print(f"| {name} | {calls[0]:.2f} | {sec:.2f} | {L / sec:.1f} | {G * L / sec:.0f} | {bound:.0f} | "
              f"{L / sec / bound:.0%} | {_gb(clock, 'generate')} |")
        del sampler
    if part == "gqa":                                           # the copy as training samples with it
        merged_rollout.use_attention(model, merged_rollout.ATTENTION)
    model.train()


def estimate(cfg, model, tok, prompt, tokens):
    """memory.estimate's stages (bytes) for the bench's prompt and `tokens` completion tokens, in bf16."""
    P = len(tok(prompt, add_special_tokens=False)["input_ids"])
    s = dataclasses.replace(memory.Settings.from_config(cfg, P, 2), completion_tokens=tokens)
    return memory.estimate(model.config, s)


def paper_step(args, cfg, model, tok, optimizer, params, prompt, answer, res):
    """Part 2: two steps at --gpu_step_tokens (after a warm-up of 8 tokens, the merged sampler sized once for the
    full length): the first's seconds beside the second's, whose sampling no compile is in; seconds per stage
    and measured vs estimated peak of the second."""
    est = estimate(cfg, model, tok, prompt, args.gpu_step_tokens)
    if cfg.rollout == "merged":
        merged_rollout.reserve(model, cfg.generation_size, len(tok(prompt, add_special_tokens=False)["input_ids"]),
                               args.gpu_step_tokens)
    one_step(cfg, model, tok, optimizer, params, prompt, answer, 8)                    # warm-up
    _, first = one_step(cfg, model, tok, optimizer, params, prompt, answer, args.gpu_step_tokens)
    m, clock = one_step(cfg, model, tok, optimizer, params, prompt, answer, args.gpu_step_tokens)
    print(f"\n2. first step at full length {sum(first.parts.values()):.1f} s (sampling "
          f"{first.parts.get('generate', 0):.1f} s); the second, below:")
    total = sum(clock.parts.values())
    from rollout import resolve_path
    print(f"\n2. step: G {cfg.generation_size} x {args.gpu_step_tokens} forced tokens, micro-batches of "
          f"{cfg.micro_batch_size or 'all'}, checkpointing {'on' if cfg.gradient_checkpointing else 'off'}, rollout "
          f"{resolve_path(cfg.rollout, cfg.device)}: {total:.1f} s")
    print("| stage | seconds | peak GB allocated | peak GB reserved + managed | peak GB estimated |")
    print("|---|---|---|---|---|")
    stage_est = {"generate": est["sampling"], "forward": est["gradient"], "backward": est["gradient"]}
    for stage, sec in clock.parts.items():
        e, held = stage_est.get(stage), clock.reserved.get(stage)
        print(f"| {stage} | {sec:.2f} | {_gb(clock, stage)} | {'–' if held is None else f'{held / 1e9:.2f}'} | "
              f"{'' if e is None else f'{e / 1e9:.2f}'} |")
    card = max(clock.reserved.values(), default=None)
    if card is not None:
        print(f"card: reserved + managed peak {card / 1e9:.2f} GB, estimated {est['card'] / 1e9:.2f} GB "
              f"({card / est['card'] - 1:+.0%})")
    res["step"] = {"first": {"seconds": first.parts, "peaks": first.peaks}, "seconds": clock.parts, "total": total,
                   "peaks": clock.peaks, "reserved_plus_managed": clock.reserved,
                   "card": card, "estimate": est, "micro_batch_size": cfg.micro_batch_size, "rollout": cfg.rollout,
                   "gradient_checkpointing": cfg.gradient_checkpointing, "tokens": args.gpu_step_tokens}


def initial_entropy(args, cfg, model, tok, prompt, res):
    """Part 4: train.py's <H>_ini pass before step 1 (step.initial_entropy: memory.H_INI_ROWS prompts
    sampled once each at --gpu_step_tokens forced tokens, then a no-grad pass): seconds and peak
    beside memory.estimate's h_ini."""
    T = args.gpu_step_tokens
    c = dataclasses.replace(cfg, max_completion_length=T, min_new_tokens=T)
    est = estimate(cfg, model, tok, prompt, T)["h_ini"]
    clock = PeakClock(cfg.device)
    h = steps.initial_entropy(model, tok, [prompt] * memory.H_INI_ROWS, c)               # (8,)
    clock("h_ini")
    sec, held = clock.parts["h_ini"], clock.reserved.get("h_ini")
    print(f"\n4. <H>_ini: {memory.H_INI_ROWS} prompts x {T} forced tokens, rollout {cfg.rollout}: {sec:.1f} s; "
          f"peak GB allocated {_gb(clock, 'h_ini')}, reserved + managed {'–' if held is None else f'{held / 1e9:.2f}'}, "
          f"estimated {est / 1e9:.2f}; mean <H> {h.mean().item():.3f}")
    res["h_ini"] = {"seconds": sec, "peak": clock.peaks.get("h_ini"), "reserved_plus_managed": held,
                    "estimate": est, "mean": h.mean().item()}


def differences(a, b):
    """Two runs' (metric rows, weights fingerprint) -> {metric: {"step": the first step (1-based) it
    differs at, "rel": its largest |x - y| / max(|x|, |y|)}}, plus "weights": {} when the
    fingerprints differ; {} when the runs are identical (a metric NaN in both is the same)."""
    (ra, wa), (rb, wb) = a, b
    out = {}
    for step_no, (x, y) in enumerate(zip(ra, rb), 1):
        for k, v in x.items():
            if isinstance(v, float) and v != y[k] and not (math.isnan(v) and math.isnan(y[k])):
                seen = out.setdefault(k, {"step": step_no, "rel": 0.0})
                seen["rel"] = max(seen["rel"], abs(v - y[k]) / max(abs(v), abs(y[k])))
    return {**out, **({"weights": {}} if wa != wb else {})}


def determinism(args, cfg, model, tok, optimizer, params, prompt, answer, res):
    """Part 3: the same 3 steps twice from one seed: each metric that differs, with the first step it
    differs at and its largest relative difference, and whether the weights do. Where some differ, the
    pair again under torch.use_deterministic_algorithms (strict: operations with a deterministic
    algorithm use it, e.g. cuDNN attention's backward, and one that has none stops the pair, named)."""
    from machinery.runs import weights_fingerprint
    start = {id(p): p.detach().clone() for p in params}
    opt_state = copy.deepcopy(optimizer.state_dict())

    def run():
        for p in params:
            p.data.copy_(start[id(p)])
        optimizer.load_state_dict(opt_state)
        torch.manual_seed(0)
        rows = [one_step(cfg, model, tok, optimizer, params, prompt, answer, args.gpu_det_tokens)[0]
                for _ in range(3)]
        return rows, weights_fingerprint(params)

    def say(found):
        return ", ".join(f"{k} (from step {v['step']}, up to {v['rel']:.1e})" if v else k for k, v in found.items())

    print(f"\n3. determinism: 3 steps of {args.gpu_det_tokens} tokens, twice from seed 0")
    first = differences(run(), run())
    res["determinism"] = {"differ": first}
    print(f"   {'identical: every metric and the weights bit for bit' if not first else 'differ: ' + say(first)}")
    if first:
        torch.use_deterministic_algorithms(True)
        try:
            second = differences(run(), run())
            res["determinism"]["deterministic_algorithms"] = second
            print(f"   with torch.use_deterministic_algorithms: "
                  f"{'identical' if not second else 'differ: ' + say(second)}")
        except RuntimeError as e:                       # an operation without a deterministic algorithm
            res["determinism"]["deterministic_algorithms_stopped"] = str(e).splitlines()[0]
            print(f"   with torch.use_deterministic_algorithms: stopped by {str(e).splitlines()[0]}")
        finally:
            torch.use_deterministic_algorithms(False)


def cap40(args, folder, res):
    """Part 3: the same defaults in a fresh process capped at CAP_GB (--gpu_cap_child), so that nothing this
    process holds counts against the cap; its results come back as JSON."""
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "cap.json")
        cmd = [sys.executable, "-m", "bench", "--parts", "gpu", "--gpu_parts", "cap40", "--gpu_cap_child", folder,
               "--device", args.device, "--gpu_shape", args.gpu_shape, "--gpu_step_tokens", str(args.gpu_step_tokens),
               f"--flags={args.flags}", "--out", os.path.join(d, "bench.json"), "--gpu_out", out]
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=os.path.dirname(os.path.dirname(__file__)))
        print(r.stdout[r.stdout.find("\n3. cap40"):] if "\n3. cap40" in r.stdout else "", end="")
        if r.returncode != 0 or not os.path.isfile(out):
            res["cap40"] = {"error": (r.stderr.strip().splitlines() or ["no output"])[-1], "exit": r.returncode}
            print(f"3. cap40: the child failed (exit {r.returncode}): {res['cap40']['error']}")
            return
        res["cap40"] = json.load(open(out))["cap40"]


def cap_process(device, gb):
    """Cap this process's CUDA allocations at `gb` GB on `device` -> the fraction of the card set."""
    index = torch.device(device).index
    if index is None:                                   # the setter refuses a bare "cuda": it wants an index
        index = torch.cuda.current_device()
    fraction = min(1.0, gb * 1e9 / torch.cuda.get_device_properties(index).total_memory)
    torch.cuda.set_per_process_memory_fraction(fraction, index)
    return fraction


def cap40_child(args, folder, res):
    """Part 3, in the child: cap the process at CAP_GB before any CUDA allocation (on CPU nothing caps), plan
    for that budget as train.py does, then 2 steps at --gpu_step_tokens."""
    import train
    from bench.common import bench_prompt
    cuda = args.device.startswith("cuda")
    if cuda:
        cap_process(args.device, CAP_GB)
    cfg, model, tok, optimizer, params = setup(args, folder, [*args.flags.split(), "--memory_budget_gb", str(CAP_GB)])
    prompt, answer = bench_prompt(tok, 250)
    said = []
    cfg = memory_plan.plan_memory(cfg, model, len(tok(prompt, add_special_tokens=False)["input_ids"]), args.device,
                                  said.append)
    row = {"budget_gb": CAP_GB, "plan": said, "rollout": cfg.rollout, "micro_batch_size": cfg.micro_batch_size,
           "gradient_checkpointing": cfg.gradient_checkpointing, "steps": [], "out_of_memory": False}
    print(f"\n3. cap40: {CAP_GB} GB for this process; " + (" / ".join(said) if cuda else "CPU: no cap and no plan"))
    try:
        for _ in range(2):
            m, clock = one_step(cfg, model, tok, optimizer, params, prompt, answer, args.gpu_step_tokens)
            row["steps"].append({"seconds": sum(clock.parts.values()), "peak": max(clock.peaks.values(), default=None),
                                 "reserved_plus_managed": max(clock.reserved.values(), default=None),
                                 "stage_peaks": clock.peaks, "stage_reserved_plus_managed": clock.reserved,
                                 "stage_seconds": clock.parts})
    except torch.cuda.OutOfMemoryError as e:
        row["out_of_memory"] = str(e).splitlines()[0]
    print(f"   {len(row['steps'])} steps: " + ", ".join(capped_step(x) for x in row["steps"])
          + (f"; out of memory: {row['out_of_memory']}" if row["out_of_memory"] else "; no out-of-memory"))
    res["cap40"] = row


def capped_step(x):
    """One of part 3's steps in words: its seconds and, on CUDA, its allocated peak with the stage it was in
    and what the card held."""
    if not x["reserved_plus_managed"]:
        return f"{x['seconds']:.1f} s"
    stage = max(x["stage_peaks"], key=x["stage_peaks"].get)
    return (f"{x['seconds']:.1f} s (peak {x['peak'] / 1e9:.1f} GB allocated, in {stage}; "
            f"{x['reserved_plus_managed'] / 1e9:.1f} GB reserved + managed)")


def trl_against(args, cfg, model, tok, optimizer, params, prompt, answer, res):
    """Part 4: TRL's GRPOTrainer on this model (its LoRA adapters trained by TRL's own optimizer), G and
    --gpu_trl_tokens forced tokens, GRPO beta 0, checkpointing as this run's; then step.rl_step at that
    length, run first. Medians over the steps after each one's first (TRL: between consecutive step ends)."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    T, G, steps = args.gpu_trl_tokens, cfg.generation_size, 3
    ends = []

    class StepEnds(TrainerCallback):
        def on_step_end(self, *a, **kw):
            ends.append(time.perf_counter())

    def spread(completions, **_):                       # rewards with a spread, as bench.common.spread_rewards
        return [float(i % 2) for i in range(len(completions))]
    mine = [sum(one_step(cfg, model, tok, optimizer, params, prompt, answer, T)[1].parts.values())
            for _ in range(steps)]                          # first: TRL's trainer may change the model's settings
    ours = statistics.median(mine[1:])
    cuda = args.device.startswith("cuda")
    with tempfile.TemporaryDirectory() as d:
        targs = GRPOConfig(output_dir=d, per_device_train_batch_size=G, num_generations=G, max_completion_length=T,
                           generation_kwargs={"min_new_tokens": T}, max_steps=steps, learning_rate=cfg.lr, beta=0.0,
                           temperature=1.0, top_k=0, bf16=cuda, use_cpu=not cuda, report_to="none",
                           save_strategy="no", logging_steps=1, disable_tqdm=True,
                           gradient_checkpointing=bool(cfg.gradient_checkpointing))
        trainer = GRPOTrainer(model=model, processing_class=tok, reward_funcs=[spread], args=targs,
                              train_dataset=Dataset.from_list([{"prompt": prompt}] * (G * steps)),
                              callbacks=[StepEnds()])
        trainer.train()
    theirs = statistics.median(b - a for a, b in zip(ends, ends[1:]))
    print(f"\n4. trl: G {G} x {T} forced tokens, medians after the first step: GRPOTrainer {theirs:.2f} s, "
          f"step.rl_step (rollout {cfg.rollout}) {ours:.2f} s: TRL / ours {theirs / ours:.2f}")
    res["trl"] = {"tokens": T, "grpo_trainer_s": theirs, "ours_s": ours, "trl_over_ours": theirs / ours,
                  "rollout": cfg.rollout, "trl_step_ends": len(ends)}


def run(args, res):
    """The benchmark's `gpu` part (module docstring)."""
    import train
    from bench.common import bench_prompt
    parts = list(ALL) if args.gpu_parts == "all" else args.gpu_parts.split(",")
    unknown = set(parts) - set(PARTS)
    if unknown:
        raise SystemExit(f"--gpu_parts: unknown {sorted(unknown)}; choose from all or {','.join(PARTS)}")
    cuda = args.device.startswith("cuda")
    for flag, (on_gpu, on_cpu) in TOKENS.items():
        if getattr(args, flag) is None:
            setattr(args, flag, on_gpu if cuda else on_cpu)
    if cuda:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")     # lets part 5 try deterministic cuBLAS
    res["gpu"] = gpu = {}
    if args.gpu_cap_child:                              # part 3's fresh process
        cap40_child(args, args.gpu_cap_child, gpu)
        return write(args, gpu, ["cap40"])
    t0 = time.time()
    if args.gpu_shape in memory.SHAPES or args.gpu_shape == "tiny":
        folder = random_model_dir(args.gpu_shape, args.device)
    else:                                               # a real model: alias or folder (models.resolve)
        from machinery.models import resolve
        folder = resolve(args.gpu_shape)[0]
    if "cap40" in parts:                                # first: before this process holds any GPU memory
        cap40(args, folder, gpu)
    cfg, model, tok, optimizer, params = setup(args, folder, args.flags.split())
    prompt, answer = bench_prompt(tok, 250)
    cfg = memory_plan.plan_memory(cfg, model, len(tok(prompt, add_special_tokens=False)["input_ids"]), args.device, print)
    print(f"\n{args.gpu_shape} ({'random' if folder.startswith(tempfile.gettempdir()) else 'its own'} weights), "
          f"4-bit NF4, LoRA {cfg.lora_rank}, on {res['device']}: set up in {time.time() - t0:.0f} s")
    for part in parts:
        t = time.time()
        {"samplers": lambda: sampling(args, cfg, model, tok, prompt, gpu),
         "step": lambda: paper_step(args, cfg, model, tok, optimizer, params, prompt, answer, gpu),
         "cap40": lambda: None,                                                   # ran above
         "trl": lambda: trl_against(args, cfg, model, tok, optimizer, params, prompt, answer, gpu),
         "determinism": lambda: determinism(args, cfg, model, tok, optimizer, params, prompt, answer, gpu),
         "h_ini": lambda: initial_entropy(args, cfg, model, tok, prompt, gpu),
         "gqa": lambda: sampling(args, cfg, model, tok, prompt, gpu, "gqa", GQA, args.gpu_step_tokens),
         }[part]()
        if part != "cap40":
            gpu[part]["meta"] = {"seconds": time.time() - t}
        sys.stdout.flush()
    for part in parts:
        gpu[part].setdefault("meta", {}).update(shape=args.gpu_shape, device=res["device"])
    print(f"\ngpu part: {time.time() - t0:.0f} s")
    write(args, gpu, parts)


def write(args, gpu, parts):
    """--gpu_out: one JSON object, a key per part run."""
    with open(args.gpu_out, "w") as f:
        json.dump({part: gpu[part] for part in parts}, f, indent=2)
    print(f"wrote {args.gpu_out}")
