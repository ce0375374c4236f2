"""Benchmarks: the cost of every stage, printed as a table and written to bench.json.

    python -m bench                     # all three parts on CPU (6.5 minutes on 2 cores), from the root
    python -m bench --parts step --steps 5   # the step train.py runs (step.rl_step), timed per stage
    python -m bench --device cuda       # CUDA timing (synchronised) and torch.cuda.max_memory_allocated
    python -m bench --parts memory      # a step's GPU memory, estimated without a GPU (speedups/memory.py)
    python -m bench --parts gpu --device cuda     # the paper's step, samplers, a 40 GB cap, TRL, on a GPU (bench/gpu.py)
    python -m bench --parts gpu --gpu_shape smollm2-135m     # its dry run on CPU

1. conflict   gtpo.conflict_weights against a vocabulary-indexed implementation in the style of the
              paper's Listing 2 (bincount over t * V + token keys), at the paper's scale
              (G=12, L=1500, V=128256) and the demo's (G=8, L=256, V=49152): time and peak extra memory.
2. loss       peak extra memory of log-probs + entropy + GTPO loss + backward through the LM head for
              N=12, L=1024 completion tokens and SmolLM2's head (V=49152, D=576), chunked
              (speedups.logprobs.ChunkedLogprobs) vs full (N, L, V) logits. The decoder's hidden states are the
              input, so the measurement isolates what chunking changes.
3. step       one training step of the embedded model (1 prompt, G=8, 64 new tokens forced with
              min_new_tokens): step.rl_step -- the very function train.py's loop calls, with the
              demo's flags (entropy filter on) -- timed per stage through its clock: generation, reward,
              conflict masks, reference pass, log-prob forward, backward, then clip + optimizer as
              in the loop; for GTPO, GRPO beta=0 and GRPO beta=0.04; GTPO also "generate"
              (--rollout generate) and "plain" (also --no-share_prompt: G copies of the prompt in
              the gradient pass); and the floor: one generate, one forward+backward of a plain
              policy-gradient loss, one optimizer step. Each stage beside the host's limits, measured in
              the same run: decode tokens/s against G x streaming-read bandwidth / bytes of weights (each
              token reads them all), forward and backward GFLOP/s (the matmuls of the linear layers and
              the LM head) against the fp32 matmul peak on the same threads.
4. paper      (only with --parts paper) one paper-shaped GTPO step, G=12, prompt ~250 tokens, 512
              forced tokens, micro-batches of 4, default against plain; one round after a warm-up.
              Methods alternate within each round; medians over --steps rounds after one warm-up.
5. reward     (only with --parts reward) rewards.score on hostile completions, each in a fresh
              process; a batch of 24 hostile MATH completions; a case scored from a worker thread.
6. trl        (only with --parts trl; needs TRL) gtpo_trl.GTPOTrainer against TRL's GRPOTrainer with the
              same settings (gtpo_trl.example_trainer, 8 completions forced to --new_tokens), and
              step.rl_step with the embedded model's defaults on the same work, a fresh process per run,
              alternating; each run's mean step after its first, the median over rounds with their range,
              GTPO / GRPO paired by round, and the seconds GTPO spends outside TRL's forwards
              (gtpo_added_s; within it gtpo_entropy_pass_s, a pass of its own for <H>_i, 0 where none runs);
              with gtpo2 / grpo2 in --trl_methods, the same at num_iterations=2.

9. heldout    (only with --parts heldout) what train.py's held-out evaluation adds: the demo as it runs, and
              the paper profile's evaluation against G = 12 steps (bench/heldout.py).

Peak memory on CPU: each measurement runs in a fresh process that resets the kernel's peak-RSS
counter (/proc/self/clear_refs) after its inputs exist and reads VmHWM afterwards.
"""
import argparse
import json

import torch

from bench.cpu import STEP_METHODS, report_paper_step, report_step
from bench.heldout import report_heldout
from bench.probes import CHILD_FLAGS, PROBES, report_conflict, report_loss, report_trl
from bench.reward import report_reward
from machinery.models import cuda_allocator_defaults, heap_mmap_threshold


def report_memory(args, res):
    """Part 7: the step's estimated peak GPU memory (speedups/memory.py) for the paper's models, or --model,
    by micro-batch and checkpointing, and what the defaults choose under --memory_budget_gb; beside
    it, the estimate against tensor memory measured on CPU for three small shapes."""
    from speedups import memory
    names = ["llama-8b", "qwen2.5-3b"] if args.model == "smollm2-135m" else [args.model]
    res["memory"] = {}
    for name in names:
        rank = {"llama-8b": 128}.get(name, 64)
        s = memory.Settings(lora_rank=rank, batch_size=args.memory_batch_size)
        lines = memory.table(name, s, args.memory_budget_gb * 1e9)
        print("\n7. " + "\n".join(lines))
        res["memory"][name] = lines
    print("\n   estimate vs measured on CPU (MemTracker, two real steps), GB")
    for check in memory.CPU_CHECKS:
        config, s = memory.cpu_check(check)
        est, measured = memory.estimate(config, s)["step"], memory.measured_peak(config, s)
        res["memory"][check] = {"estimate": est, "measured": measured}
        print(f"   {check}: estimate {est / 1e9:.4f}, measured {measured / 1e9:.4f} ({est / measured - 1:+.0%})")


def report_gpu(args, res):
    """Part 8: the paper's step on a GPU (bench/gpu.py); --gpu_shape tiny is its CPU dry run."""
    from bench import gpu
    gpu.run(args, res)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default="conflict,loss,step", help="comma-separated subset of conflict,loss,step,paper,reward,trl,memory,gpu,heldout (paper: 7 min, trl: 20 min on 2 cores)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--steps", type=int, default=3, help="timed rounds per method after one warm-up round")
    p.add_argument("--new_tokens", type=int, default=64)
    p.add_argument("--paper_tokens", type=int, default=512, help="forced completion length of the paper part")
    p.add_argument("--paper_micro_batch", type=int, default=4, help="completions per forward/backward, paper part")
    p.add_argument("--model", default="smollm2-135m", help="step and paper parts: alias or model folder")
    p.add_argument("--flags", default="", help="step and paper parts: more train.py flags, e.g. '--lora_rank 128'")
    p.add_argument("--G", type=int, default=8)
    p.add_argument("--trl_steps", type=int, default=5, help="trl part: optimizer steps per run (the first is not timed)")
    p.add_argument("--trl_methods", default="grpo,gtpo,ours", help="trl part: comma-separated subset of grpo "
                   "(TRL's GRPOTrainer), gtpo (GTPOTrainer), ours (step.rl_step, train.py's step), grpo2 and gtpo2 "
                   "(each trainer with num_iterations=2)")
    p.add_argument("--logprob_chunk", type=int, default=256, help="completion tokens per LM-head chunk")
    p.add_argument("--methods", default=None, help=f"step part: comma-separated subset of {','.join(STEP_METHODS)}")
    p.add_argument("--out", default="bench.json")
    p.add_argument("--heap_mmap_mb", type=float, default=0.0, help="as train.py's flag (default 0: glibc's)")
    p.add_argument("--memory_budget_gb", type=float, default=40.0, help="memory part: the budget (one A100 40GB; "
                   "the estimate adds the CUDA context and the allocator's slack itself)")
    p.add_argument("--memory_batch_size", type=int, default=1, help="memory part: prompts per step (the authors' command: 2)")
    p.add_argument("--gpu_shape", default="llama-8b", help="gpu part: llama-8b, qwen2.5-3b, llama-1b (random weights), tiny (a CPU dry run), or a model alias / folder")
    p.add_argument("--gpu_parts", default="all", help="gpu part: all (samplers,step,cap40,trl) or a comma-separated subset of samplers,step,cap40,trl,determinism,h_ini,gqa")
    p.add_argument("--gpu_sample_tokens", type=int, default=None, help="gpu part: forced tokens per sampler [default: 128 on CUDA, 8 on CPU]")
    p.add_argument("--gpu_step_tokens", type=int, default=None, help="gpu part: forced tokens of the paper step and cap40's [default: 1500 on CUDA, 16 on CPU]")
    p.add_argument("--gpu_trl_tokens", type=int, default=None, help="gpu part: forced tokens of the TRL comparison [default: 256 on CUDA, 8 on CPU]")
    p.add_argument("--gpu_det_tokens", type=int, default=None, help="gpu part: forced tokens of the determinism steps [default: 32 on CUDA, 4 on CPU]")
    p.add_argument("--gpu_out", default="bench-gpu.json", help="gpu part: its results, a key per part")
    p.add_argument("--gpu_cap_child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--probe", help=argparse.SUPPRESS)
    p.add_argument("--probe_cfg", help=argparse.SUPPRESS)
    args = p.parse_args()
    cuda_allocator_defaults()                           # the allocator train.py runs with, before any CUDA allocation
    heap_mmap_threshold(args.heap_mmap_mb)
    CHILD_FLAGS[:] = ["--heap_mmap_mb", str(args.heap_mmap_mb)]
    if args.probe:                                                            # child process
        print(json.dumps(PROBES[args.probe](json.loads(args.probe_cfg), args.device)))
        return
    res = {"device": torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else
           f"cpu ({torch.get_num_threads()} threads)", "torch": torch.__version__}

    reports = {"conflict": report_conflict, "loss": report_loss, "step": report_step, "paper": report_paper_step,
               "reward": report_reward, "trl": report_trl, "memory": report_memory, "gpu": report_gpu,
               "heldout": report_heldout}
    unknown = set(args.parts.split(",")) - set(reports)
    if unknown:
        p.error(f"--parts: unknown {sorted(unknown)}; choose from {','.join(reports)}")
    for part in args.parts.split(","):
        reports[part](args, res)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=2)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
