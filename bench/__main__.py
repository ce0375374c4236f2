"""Benchmarks: the cost of every stage, printed as a table and written to bench.json.

    python -m bench                     # all three parts on CPU (6.5 minutes on 2 cores), from the root
    python -m bench --parts step --steps 5   # the step train.py runs (step.rl_step), timed per stage
    python -m bench --device cuda       # CUDA timing (synchronised) and torch.cuda.max_memory_allocated
    python -m bench --parts memory      # a step's GPU memory, estimated without a GPU (memory.py)
    python -m bench --parts gpu --device cuda     # the paper's step, samplers, a 40 GB cap, TRL, on a GPU (bench/gpu.py)
    python -m bench --parts gpu --gpu_shape smollm2-135m     # its dry run on CPU

1. conflict   gtpo.conflict_weights against a vocabulary-indexed implementation in the style of the
              paper's Listing 2 (bincount over t * V + token keys), at the paper's scale
              (G=12, L=1500, V=128256) and the demo's (G=8, L=256, V=49152): time and peak extra memory.
2. loss       peak extra memory of log-probs + entropy + GTPO loss + backward through the LM head for
              N=12, L=1024 completion tokens and SmolLM2's head (V=49152, D=576), chunked
              (gtpo_logprobs.ChunkedLogprobs) vs full (N, L, V) logits. The decoder's hidden states are the
              input, so the measurement isolates what chunking changes.
3. step       one training step of the embedded model (1 prompt, G=8, 64 new tokens forced with
              min_new_tokens): step.rl_step -- the very function train.py's loop calls, with the
              demo's flags (entropy gate on) -- timed per stage through its clock: generation, reward,
              conflict masks, reference pass, log-prob forward, backward, then clip + optimizer as
              in the loop; for GTPO, GRPO beta=0 and GRPO beta=0.04; GTPO also "generate"
              (--rollout generate) and "plain" (also --no-share_prompt: G copies of the prompt in
              the gradient pass); and the floor: one generate, one forward+backward of a plain
              policy-gradient loss, one optimizer step. Decode tokens/s is set beside a bound:
              G x measured streaming-read bandwidth / bytes of weights (each token reads them all).
4. paper      (only with --parts paper) one paper-shaped GTPO step, G=12, prompt ~250 tokens, 512
              forced tokens, micro-batches of 4, default against plain; one round after a warm-up.
              Methods alternate within each round; medians over --steps rounds after one warm-up.
5. reward     (only with --parts reward) rewards.score on hostile completions, each in a fresh
              process; a batch of 24 hostile MATH completions; a case scored from a worker thread.
6. trl        (only with --parts trl; needs TRL) gtpo_trl.GTPOTrainer against TRL's GRPOTrainer with the
              same settings (gtpo_trl.example_trainer, 8 completions forced to --new_tokens), a fresh
              process per run, alternating; median step time, GTPO's overhead and where it goes.

Peak memory on CPU: each measurement runs in a fresh process that resets the kernel's peak-RSS
counter (/proc/self/clear_refs) after its inputs exist and reads VmHWM afterwards.
"""
import argparse
import dataclasses
import json
import os
import re
import statistics
import subprocess
import sys
import time

import torch

import gtpo
from bench.common import bench_prompt, memory_bandwidth, spread_rewards
from models import heap_mmap_threshold, load_model, pick_dtype

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MB = 2 ** 20


# -----------------------------------------------------------------------------
# measuring

def _status_kb(field):
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+)", f.read()).group(1))


def measure(fn, device, repeats):
    """(median seconds, peak extra bytes) of fn() on `device`, peak over all repeats."""
    times, dev = [], torch.device(device)
    if device.startswith("cuda"):
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
    else:
        base = _status_kb("VmRSS") * 1024
        with open("/proc/self/clear_refs", "w") as f:              # reset VmHWM to the current RSS
            f.write("5")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize(dev)
        times.append(time.perf_counter() - t0)
    peak = (torch.cuda.max_memory_allocated(dev) if device.startswith("cuda") else _status_kb("VmHWM") * 1024) - base
    return statistics.median(times), peak


CHILD_FLAGS = []                                    # main's process-wide flags, passed on to each probe


def in_child(probe, cfg, device):
    """Run a probe in a fresh process on CPU (a clean peak-RSS counter); in-process on CUDA."""
    if device.startswith("cuda"):
        return PROBES[probe](cfg, device)
    r = subprocess.run([sys.executable, "-m", "bench", "--probe", probe, "--probe_cfg", json.dumps(cfg), *CHILD_FLAGS],
                       capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())})
    if r.returncode != 0:
        raise RuntimeError(f"probe {probe} {cfg} failed:\n{r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


# -----------------------------------------------------------------------------
# 1. conflict masks

def vocab_indexed_conflict(ids, mask, adv, vocab_size, conflict_weight=2.0):
    """Forward/backward conflict weights the way the paper's Listing 2 builds them (App. 16.3):
    presence maps over keys t * V + token from `bincount` (two L*V maps per direction), the first
    contiguous run by cumprod, the backward direction on flipped-and-shifted ids. Written here only
    to be measured against gtpo.conflict_weights."""
    G, L = ids.shape
    valid = mask.bool()
    pos, neg = adv > 0, adv < 0

    def one_direction(ids_, valid_):
        keys = torch.arange(L, device=ids.device)[None] * vocab_size + ids_              # (G, L)
        n = L * vocab_size
        pos_map = torch.bincount(keys[pos[:, None] & valid_], minlength=n).clamp_(max=1)  # (L*V,)
        neg_map = torch.bincount(keys[neg[:, None] & valid_], minlength=n).clamp_(max=1)
        raw = (pos_map[keys] & neg_map[keys]).bool() & valid_                             # (G, L)
        run = raw.long().cumprod(dim=1).bool()
        w = torch.ones(G, L, device=ids.device)
        w[run & pos[:, None]] = conflict_weight
        w[run & neg[:, None]] = 0.0
        return w, run

    w_fw, c_fw = one_direction(ids, valid)
    lengths = valid.sum(1)
    idx = (lengths[:, None] - 1 - torch.arange(L, device=ids.device)[None]) % L        # last valid token first
    valid_rev = torch.arange(L, device=ids.device)[None] < lengths[:, None]
    w_bw_rev, c_bw_rev = one_direction(ids.gather(1, idx), valid_rev)
    w_bw, c_bw = w_bw_rev.gather(1, idx), c_bw_rev.gather(1, idx)                       # the same map undoes it
    return w_fw * w_bw * valid, (c_fw | c_bw) & valid


def _conflict_inputs(G, L, V, seed=0):
    """A group with realistic structure: a shared opening, a shared closing span, random middles,
    unequal lengths, mixed-sign advantages."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (G, L), generator=g)
    ids[:, :40] = torch.randint(0, V, (40,), generator=g)                  # shared prefix
    lengths = torch.randint(L // 2, L + 1, (G,), generator=g)
    lengths[0] = L
    tail = torch.randint(0, V, (12,), generator=g)
    for i in range(G):
        ids[i, lengths[i] - 12:lengths[i]] = tail                           # shared suffix
    mask = (torch.arange(L)[None] < lengths[:, None]).long()
    adv = torch.randn(G, generator=g)
    return ids, mask, adv


def probe_conflict(cfg, device):
    ids, mask, adv = (t.to(device) for t in _conflict_inputs(cfg["G"], cfg["L"], cfg["V"]))
    if cfg["impl"] == "ours":
        fn = lambda: gtpo.conflict_weights(ids, mask, adv)                 # noqa: E731
    else:
        fn = lambda: vocab_indexed_conflict(ids, mask, adv, cfg["V"])      # noqa: E731
    fn()                                                                   # warm-up (not in the peak)
    sec, peak = measure(fn, device, cfg["repeats"])
    return {"seconds": sec, "peak_bytes": peak}


# -----------------------------------------------------------------------------
# 2. loss memory

def probe_loss(cfg, device):
    from gtpo_logprobs import ChunkedLogprobs
    N, L, V, D, chunk = cfg["N"], cfg["L"], cfg["V"], cfg["D"], cfg["logprob_chunk"]
    g = torch.Generator().manual_seed(0)
    weight = (torch.randn(V, D, generator=g) * 0.05).to(device)            # frozen LM head (LoRA)
    hidden = torch.randn(N, L, D, generator=g).to(device).requires_grad_()
    ids = torch.randint(0, V, (N, L), generator=g).to(device)
    mask = torch.ones(N, L, dtype=torch.long, device=device)
    adv = torch.randn(N, generator=g).to(device)
    w = torch.ones(N, L, device=device)

    def run():
        if chunk < 0:                       # the hidden-state part alone: gather, a loss, its gradient
            (hidden[mask.bool()] * adv.mean()).sum().backward()
            hidden.grad = None
            return
        if chunk:
            keep = mask.bool()
            lp, ent = ChunkedLogprobs.apply(hidden[keep], weight, None, ids[keep], chunk, True)
            logp, ent = lp.view(N, L), ent.view(N, L)
        else:
            logits = hidden @ weight.T                                      # (N, L, V)
            logp = gtpo.token_logprobs(logits, ids)
            with torch.no_grad():
                ent = torch.cat([gtpo.token_entropy(c) for c in logits.detach().flatten(0, 1).split(512)]).view(N, L)
        a = gtpo.entropy_gate(adv, gtpo.masked_mean(ent, mask, 1), 0.7, 0.1)
        loss, _ = gtpo.gtpo_loss(logp, mask, a, w)
        loss.backward()
        hidden.grad = None

    sec, peak = measure(run, device, 1)
    out = {"seconds": sec, "peak_bytes": peak}
    if cfg.get("tensor_peak") and not device.startswith("cuda"):
        # live-tensor peak from the profiler's memory timeline: no allocator or BLAS workspace
        from torch.profiler import ProfilerActivity, profile
        from torch.profiler._memory_profiler import MemoryProfileTimeline
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                     with_stack=True) as prof:
            run()
        _, sizes = MemoryProfileTimeline(prof._memory_profile())._coalesce_timeline(torch.device(device))
        totals = [sum(s) for s in sizes]
        out["tensor_peak_bytes"] = max(totals) - totals[0]
    return out


def probe_trl(cfg, device):
    """One gtpo_trl.example_trainer run in this process: the wall time between consecutive
    optimizer steps, and for GTPO the seconds in what it adds (the <H>_i pass, the per-token
    advantages). Every completion is forced to full length, so both methods do the same work."""
    import gtpo_trl
    from transformers import TrainerCallback
    added = {"entropy_pass": [], "advantages": []}

    def timed(fn, key):
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            out = fn(*a, **kw)
            added[key].append(time.perf_counter() - t0)
            return out
        return wrapper
    gtpo_trl.GTPOTrainer._mean_entropy = timed(gtpo_trl.GTPOTrainer._mean_entropy, "entropy_pass")
    gtpo_trl.token_advantages = timed(gtpo_trl.token_advantages, "advantages")
    ends = []

    class StepEnds(TrainerCallback):
        def on_step_end(self, *a, **kw):
            ends.append(time.perf_counter())
    t = gtpo_trl.example_trainer(cfg["method"], cfg["steps"], cfg["out"], disable_tqdm=True,
                                 generation_kwargs={"min_new_tokens": cfg["tokens"]}, max_completion_length=cfg["tokens"])
    t.add_callback(StepEnds())
    t.train()
    return {"step_s": [b - a for a, b in zip(ends, ends[1:])], **{k: v[1:] for k, v in added.items()}}


PROBES = {"conflict": probe_conflict, "loss": probe_loss, "trl": probe_trl}


# -----------------------------------------------------------------------------
# 3. one training step: step.rl_step, the function train.py's loop calls

def floor_step(model, tok, prompt, new_tokens, G, device, clock):
    """The least any implementation must do: one generate, one forward + backward of a plain
    policy-gradient loss over full logits. A measurement reference, not the project's step."""
    enc = tok([prompt], return_tensors="pt", add_special_tokens=False).to(device)
    model.eval()
    with torch.no_grad():
        out = model.generate(**enc, do_sample=True, temperature=1.0, top_k=0, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, num_return_sequences=G, pad_token_id=tok.pad_token_id)
    model.train()
    clock("generate")
    P = enc["input_ids"].shape[1]
    logits = model(input_ids=out, use_cache=False, logits_to_keep=new_tokens + 1).logits[:, :-1]
    logp = gtpo.token_logprobs(logits, out[:, P:])                          # (G, L)
    loss = -(logp.mean(1) * torch.linspace(-1, 1, G, device=logp.device)).mean()
    clock("forward")
    loss.backward()
    clock("backward")


def bench_step(args, G, new_tokens, rounds, names, prompt_tokens=0, micro_batch_size=0):
    """Medians over `rounds` (after one warm-up round) of step.rl_step's stages, methods alternating;
    micro_batch_size completions per forward/backward (0: all in one pass)."""
    import step as steps
    import train
    from config import parse_args
    flags = {"gtpo": [], "gtpo logged": [],                                  # logged: with a conflicts.ConflictLog
             "gtpo generate": ["--rollout", "generate"], "gtpo shared": ["--rollout", "shared"],
             "gtpo plain": ["--rollout", "generate", "--no-share_prompt"],
             "grpo b=0": ["--use_grpo"], "grpo b=0.04": ["--use_grpo", "--beta", "0.04"], "floor": ["--use_grpo"]}
    cfgs = {}
    for name in names:    # the model's flags and micro_batch_size; the entropy gate on, so its cost is counted
        a = parse_args(["--model", args.model, "--generation_size", str(G), "--max_completion_length", str(new_tokens),
                        "--logprob_chunk", str(args.logprob_chunk), "--device", args.device, "--entropy_filter", "all",
                        "--micro_batch_size", str(micro_batch_size)] + args.flags.split() + flags[name])
        cfgs[name] = dataclasses.replace(a, min_new_tokens=new_tokens)
    torch.manual_seed(0)
    model, tok, _ = load_model(args.model, lora_rank=a.lora_rank, load_in_4bit=a.load_in_4bit,
                               dtype=pick_dtype(a.dtype, args.device), device=args.device, log=lambda *x: None)
    params = [p for p in model.parameters() if p.requires_grad]
    opt, _ = train.make_optimizer(a, params, 1000, log=lambda *x: None)
    prompt, answer = bench_prompt(tok, prompt_tokens)
    P = len(tok(prompt, add_special_tokens=False)["input_ids"])
    from conflicts import ConflictLog, format_token_ids
    logs = {"gtpo logged": ConflictLog(model.get_input_embeddings().num_embeddings, format_token_ids(tok))}
    times, peaks, cuda = {name: [] for name in names}, {name: 0 for name in names}, args.device.startswith("cuda")
    for r in range(rounds + 1):                                              # round 0 is the warm-up
        for name in names:
            if cuda:
                torch.cuda.reset_peak_memory_stats(args.device)
            clock = steps.Clock(args.device)
            if name == "floor":
                floor_step(model, tok, prompt, new_tokens, G, args.device, clock)
            else:
                with spread_rewards():
                    steps.rl_step(model, model, tok, [prompt], [answer], cfgs[name], clock=clock,
                                  conflict_log=logs.get(name))
            torch.nn.utils.clip_grad_norm_(params, a.max_grad_norm)          # as train.py's loop
            opt.step()
            opt.zero_grad(set_to_none=True)
            clock("optimizer")
            if r > 0:
                times[name].append(clock.parts)
                peaks[name] = max(peaks[name], torch.cuda.max_memory_allocated(args.device) if cuda else 0)
            print(f"  round {r} {name:14s} {sum(clock.parts.values()):6.2f} s", file=sys.stderr)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    out = {}
    for name, rows in times.items():
        keys = sorted({k for p in rows for k in p})
        med = {k: statistics.median(p.get(k, 0.0) for p in rows) for k in keys}
        med["total"] = statistics.median(sum(p.values()) for p in rows)
        med["completion_tokens_per_s"] = G * new_tokens / med["generate"]
        shared = name != "floor" and cfgs[name].share_prompt                   # in the gradient pass
        passes = -(-G // micro_batch_size) if micro_batch_size else 1          # each pass computes its prompt once
        med["policy_tokens"] = (P * passes if shared else G * P) + G * new_tokens   # through the policy pass
        if cuda:
            med["peak_gpu_gb"] = peaks[name] / 2 ** 30                          # torch.cuda.max_memory_allocated
        out[name] = med
    return out, {"prompt_tokens": P, "G": G, "new_tokens": new_tokens, "weight_bytes": weight_bytes}


# -----------------------------------------------------------------------------
# 5. the reward on hostile completions (what a degenerating policy writes)

def hostile_cases():
    """name -> (completion, reference answer, task): texts that once crashed or stalled a reward."""
    tag = lambda ans: f"<reasoning>r</reasoning><answer>{ans}</answer>"               # noqa: E731
    return {
        "5,000-digit answer": (tag("9" * 5000), "9", "gsm8k"),
        "3,000 Arabic-Indic digit groups": (tag("\u0663\u0664\u0665" * 3000), "345", "arithmetic"),
        "10^{10^{10^{10}}}": (tag("10^{10^{10^{10}}}"), "5", "math"),
        "(10^{6})!": (tag("(10^{6})!"), "5", "math"),
        "2,000 x 11-digit product": (tag("\\cdot ".join(["12345678901"] * 2000)), "5", "math"),
        "3,000 nested braces": (tag("{" * 3000 + "1" + "}" * 3000), "1", "math"),
        "9^{9^{9^{9^{9}}}}": (tag("9^{9^{9^{9^{9}}}}"), "5", "math"),
        "tags x150 (4,650 chars)": ("<reasoning></reasoning>" * 150 + "<answer>" * 150, "1", "gsm8k"),
        "tags x2000 (78k chars)": ("<reasoning></reasoning>" * 2000 + "<answer>" * 2000, "1", "gsm8k"),
        "<reasoning> x3000 + <answer> x3000": ("<reasoning>" * 3000 + "<answer>" * 3000, "1", "gsm8k"),
        "control chars and NULs": (tag("\x00\x01\x1b[2J\u202e5\x00"), "5", "math"),
        "correct, math": (tag("\\dfrac{1}{2}"), "\\frac12", "math"),
        "correct, gsm8k": (tag("$1,234"), "1234", "gsm8k"),
    }


def report_reward(args, res):
    """Part 5: rewards.score on each hostile case in a fresh process (time incl. the math-verify
    worker's start for MATH cases; killed after 60 s), then a batch of 24 hostile MATH completions
    of ~1,500 tokens in one process, and one case scored from a worker thread."""
    res["reward"] = {}
    print("\n5. reward on hostile completions            seconds   reward")
    for name, (text, ref, task) in hostile_cases().items():
        code = (f"import json, time, rewards; t = time.perf_counter(); "
                f"r = rewards.score([{text!r}], [{ref!r}], {task!r})[0].item(); "
                f"print(json.dumps([time.perf_counter() - t, r]))")
        try:
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                                 cwd=ROOT)
            sec, reward = json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else (None, "error")
            if out.returncode:
                reward = out.stderr.strip().splitlines()[-1][:80]
        except subprocess.TimeoutExpired:
            sec, reward = None, "timeout > 60 s"
        res["reward"][name] = {"seconds": sec, "reward": reward}
        print(f"   {name:38s} {sec if sec is None else round(sec, 2)!s:>8s}   {reward}")
    from rewards import score
    cases = [v for v in hostile_cases().values() if v[2] == "math"]
    texts = [(c[0] * (6000 // len(c[0]) + 1))[:6000] for c in cases]               # ~1,500 tokens each
    batch = [texts[i % len(texts)] + str(i) for i in range(24)]
    counts, t = {}, time.perf_counter()
    score(batch, ["5"] * 24, "math", counts)
    res["reward"]["batch of 24 x 6,000 chars"] = {"seconds": time.perf_counter() - t, **counts}
    print(f"   batch of 24 hostile MATH completions, 6,000 chars each: {time.perf_counter() - t:.1f} s, {counts}")
    import threading
    import rewards
    rewards._WORKER.cache.clear()                                      # a fresh verdict, not the batch's
    box, t = [], time.perf_counter()
    th = threading.Thread(target=lambda: box.append(score([cases[4][0] + " "], ["5"], "math")[0].item()),
                          daemon=True)
    th.start()
    th.join(120)
    res["reward"]["from a worker thread"] = {"seconds": time.perf_counter() - t, "returned": not th.is_alive()}
    print(f"   9^... tower scored from a worker thread: {time.perf_counter() - t:.1f} s, returned {not th.is_alive()}")


# -----------------------------------------------------------------------------
# main

def report_conflict(args, res):
    """Part 1: conflict masks, ours against the vocabulary-indexed style."""
    res["conflict"] = []
    print("\n1. conflict mask                    ours: time    peak  | vocab-indexed: time    peak  | speed-up  memory")
    for G, L, V in [(12, 1500, 128256), (8, 256, 49152)]:
        ours = in_child("conflict", dict(G=G, L=L, V=V, impl="ours", repeats=20), args.device)
        ref = in_child("conflict", dict(G=G, L=L, V=V, impl="vocab", repeats=3), args.device)
        row = {"G": G, "L": L, "V": V, "ours_s": ours["seconds"], "ours_peak_mb": ours["peak_bytes"] / MB,
               "vocab_s": ref["seconds"], "vocab_peak_mb": ref["peak_bytes"] / MB,
               "speedup": ref["seconds"] / ours["seconds"],
               "memory_ratio_at_least": ref["peak_bytes"] / max(ours["peak_bytes"], 0.1 * MB)}
        if L <= 256:                        # small enough to compare the two outputs in this process
            ids, mask, adv = _conflict_inputs(G, L, V)
            ours_w = gtpo.conflict_weights(ids, mask, adv, combine="product")[0]
            row["same_weights_as_product_combine"] = torch.equal(ours_w, vocab_indexed_conflict(ids, mask, adv, V)[0])
        res["conflict"].append(row)
        print(f"   G={G:2d} L={L:4d} V={V:6d}        {row['ours_s'] * 1e3:8.1f} ms {row['ours_peak_mb']:6.1f} MB"
              f" | {row['vocab_s'] * 1e3:9.1f} ms {row['vocab_peak_mb']:7.1f} MB"
              f" | {row['speedup']:7.0f}x {'>=' if row['ours_peak_mb'] < 0.1 else '  '}{row['memory_ratio_at_least']:.0f}x")


def report_loss(args, res):
    """Part 2: peak memory of the loss + backward, chunked against full logits."""
    cfg = dict(N=12, L=1024, V=49152, D=576)
    chunk_mb = args.logprob_chunk * cfg["V"] * 4 / MB
    full = in_child("loss", {**cfg, "logprob_chunk": 0}, args.device)
    chunked = in_child("loss", {**cfg, "logprob_chunk": args.logprob_chunk, "tensor_peak": True}, args.device)
    hidden_only = in_child("loss", {**cfg, "logprob_chunk": -1, "tensor_peak": True}, args.device)
    res["loss_memory"] = {**cfg, "chunk": args.logprob_chunk, "one_chunk_logits_mb": chunk_mb,
                          "full_logits_mb": cfg["N"] * cfg["L"] * cfg["V"] * 4 / MB,
                          "full_peak_mb": full["peak_bytes"] / MB, "full_s": full["seconds"],
                          "chunked_peak_mb": chunked["peak_bytes"] / MB, "chunked_s": chunked["seconds"],
                          "chunked_peak_over_one_chunk": chunked["peak_bytes"] / MB / chunk_mb,
                          "hidden_states_part_mb": hidden_only["peak_bytes"] / MB,
                          **({"chunked_tensor_peak_mb": chunked["tensor_peak_bytes"] / MB,
                              "hidden_states_tensor_peak_mb": hidden_only["tensor_peak_bytes"] / MB,
                              "chunked_head_tensor_over_one_chunk":
                                  (chunked["tensor_peak_bytes"] - hidden_only["tensor_peak_bytes"]) / MB / chunk_mb}
                             if "tensor_peak_bytes" in chunked else {}),
                          "chunked_head_part_over_one_chunk":
                              (chunked["peak_bytes"] - hidden_only["peak_bytes"]) / MB / chunk_mb}
    lm = res["loss_memory"]
    print(f"\n2. loss + backward, N=12 L=1024 V=49152 (one fp32 (N,L,V) logits = {lm['full_logits_mb']:.0f} MB)")
    print(f"   full logits   peak extra {lm['full_peak_mb']:8.0f} MB   {lm['full_s']:6.2f} s")
    print(f"   chunk {args.logprob_chunk:4d}    peak extra {lm['chunked_peak_mb']:8.0f} MB   {lm['chunked_s']:6.2f} s"
          f"   = {lm['chunked_peak_over_one_chunk']:.2f} x one chunk's logits ({chunk_mb:.0f} MB)")
    print(f"   of which the (N, L, D) hidden-state gather and gradients alone take {lm['hidden_states_part_mb']:.0f} MB;"
          f" the LM-head part is {lm['chunked_head_part_over_one_chunk']:.2f} x one chunk's logits")
    if "chunked_tensor_peak_mb" in lm:
        print(f"   live tensors only (profiler): chunked peak extra {lm['chunked_tensor_peak_mb']:.0f} MB, hidden-state part "
              f"{lm['hidden_states_tensor_peak_mb']:.0f} MB, LM-head part "
              f"{lm['chunked_head_tensor_over_one_chunk']:.2f} x one chunk's logits")


def print_step_table(title, st):
    cols = ["generate", "reward", "masks", "reference", "forward", "backward", "optimizer", "total"]
    print(title)
    print("   " + f"{'':14s}" + "".join(f"{c:>10s}" for c in cols) + f"{'tok/s':>9s}{'policy tok':>11s}")
    for name, med in st.items():
        print("   " + f"{name:14s}" + "".join(f"{med.get(c, 0.0):10.4f}" for c in cols)
              + f"{med['completion_tokens_per_s']:9.1f}{med['policy_tokens']:11d}")


STEP_METHODS = ["gtpo", "gtpo logged", "gtpo generate", "gtpo plain", "grpo b=0", "grpo b=0.04", "floor"]


def report_step(args, res):
    """Part 3: one training step per method, per stage; decoding against the memory bound."""
    names = args.methods.split(",") if args.methods else STEP_METHODS
    st, shape = bench_step(args, args.G, args.new_tokens, args.steps, names)
    res["step"] = st
    bw = memory_bandwidth(args.device)
    bound = args.G * bw / shape["weight_bytes"]           # each decode step reads every weight once
    res["decode"] = {"memory_bandwidth_gb_s": bw / 1e9, "weight_mb": shape["weight_bytes"] / MB,
                     "bound_tokens_per_s": bound, "gtpo_tokens_per_s": st["gtpo"]["completion_tokens_per_s"],
                     "fraction_of_bound": st["gtpo"]["completion_tokens_per_s"] / bound, **shape}
    print_step_table(f"\n3. one step, embedded model, 1 prompt ({shape['prompt_tokens']} tokens) x G={args.G} x "
                     f"{args.new_tokens} tokens (median of {args.steps} after a warm-up, seconds)", st)
    print(f"   decoding: {st['gtpo']['completion_tokens_per_s']:.1f} tokens/s; bound {bound:.0f} tokens/s = "
          f"G x {bw / 1e9:.1f} GB/s measured read bandwidth / {shape['weight_bytes'] / MB:.0f} MB of weights "
          f"({res['decode']['fraction_of_bound']:.0%} of it)")
    ratios = {"gtpo_over_grpo_b0": ("gtpo", "grpo b=0"), "gtpo_over_floor": ("gtpo", "floor"),
              "grpo_b004_over_grpo_b0": ("grpo b=0.04", "grpo b=0"),
              "gtpo_over_generate": ("gtpo", "gtpo generate"), "gtpo_over_plain": ("gtpo", "gtpo plain"),
              "gtpo_logged_over_gtpo": ("gtpo logged", "gtpo")}
    res["ratios"] = {k: st[a]["total"] / st[b]["total"] for k, (a, b) in ratios.items() if a in st and b in st}
    if "gtpo logged" in st and "gtpo" in st:
        res["ratios"]["masks_logged_minus_gtpo_s"] = st["gtpo logged"]["masks"] - st["gtpo"]["masks"]
    print("   " + "   ".join(f"{k} {v:.3f}" for k, v in res["ratios"].items()))


def report_paper_step(args, res):
    """Part 4: a paper-shaped step (G=12, prompt ~250 tokens, --paper_tokens forced tokens): the
    default step against the plain one (`generate`, no prompt sharing in the gradient pass), or the
    --methods given, --paper_micro_batch completions per forward/backward (all 12 at once would keep
    ~2 MB of activations per token on the embedded model)."""
    names = args.methods.split(",") if args.methods else ["gtpo", "gtpo plain"]
    st, shape = bench_step(args, 12, args.paper_tokens, args.steps if args.methods else 1, names,
                           prompt_tokens=250, micro_batch_size=args.paper_micro_batch)
    res["paper_step"] = {**st, "shape": shape}
    print_step_table(f"\n4. paper-shaped step, {args.model}, 1 prompt ({shape['prompt_tokens']} tokens) x G=12 x "
                     f"{args.paper_tokens} tokens, micro-batches of {args.paper_micro_batch} (medians after a warm-up round, seconds)", st)
    for a in names[1:]:
        res["paper_step"][f"{names[0]}_over_{a}"] = st[names[0]]["total"] / st[a]["total"]
        print(f"   {names[0]} / {a} {res['paper_step'][f'{names[0]}_over_{a}']:.3f}")


# -----------------------------------------------------------------------------
# 6. TRL: GTPOTrainer against GRPOTrainer

def report_trl(args, res):
    """Part 6: steps of gtpo_trl.example_trainer, GTPO against TRL's GRPO with the same settings, each
    run in a fresh process, the methods alternating (order swapped every round); medians over all
    steps after each run's first."""
    import tempfile
    times = {"grpo": [], "gtpo": []}
    added = {"entropy_pass": [], "advantages": []}
    for r in range(args.steps):
        for method in (("grpo", "gtpo") if r % 2 == 0 else ("gtpo", "grpo")):
            with tempfile.TemporaryDirectory() as out:
                got = in_child("trl", {"method": method, "steps": args.trl_steps, "tokens": args.new_tokens,
                                       "out": out}, "cpu")
            times[method] += got["step_s"]
            if method == "gtpo":
                for k in added:
                    added[k] += got[k]
            print(f"  round {r} {method}: steps {' '.join(f'{x:.2f}' for x in got['step_s'])} s", file=sys.stderr)
    med = {m: statistics.median(v) for m, v in times.items()}
    part = {"median_step_s": med, "steps_timed": {m: len(v) for m, v in times.items()},
            "overhead": med["gtpo"] / med["grpo"] - 1,
            **{f"gtpo_{k}_s": statistics.median(v) for k, v in added.items() if v}}
    res["trl"] = part
    print(f"\n6. TRL, embedded model, 8 completions x {args.new_tokens} tokens per step ({args.steps} runs of "
          f"{args.trl_steps} steps per method, medians of {part['steps_timed']['gtpo']} steps, seconds)")
    print(f"   GRPOTrainer {med['grpo']:.2f}   GTPOTrainer {med['gtpo']:.2f}   overhead {part['overhead']:+.1%}")
    print("   in GTPO's step: " + ", ".join(f"{k} {part[f'gtpo_{k}_s']:.3f}" for k in added if f"gtpo_{k}_s" in part))


def report_memory(args, res):
    """Part 7: the step's estimated peak GPU memory (memory.py) for the paper's models, or --model,
    by micro-batch and checkpointing, and what the defaults choose under --memory_budget_gb; beside
    it, the estimate against tensor memory measured on CPU for three small shapes."""
    import memory
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
    p.add_argument("--parts", default="conflict,loss,step", help="comma-separated subset of conflict,loss,step,paper,reward,trl,memory,gpu (paper: 7 min, trl: 18 min on 2 cores)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--steps", type=int, default=3, help="timed rounds per method after one warm-up round")
    p.add_argument("--new_tokens", type=int, default=64)
    p.add_argument("--paper_tokens", type=int, default=512, help="forced completion length of the paper part")
    p.add_argument("--paper_micro_batch", type=int, default=4, help="completions per forward/backward, paper part")
    p.add_argument("--model", default="smollm2-135m", help="step and paper parts: alias or model folder")
    p.add_argument("--flags", default="", help="step and paper parts: more train.py flags, e.g. '--lora_rank 128'")
    p.add_argument("--G", type=int, default=8)
    p.add_argument("--trl_steps", type=int, default=5, help="trl part: optimizer steps per run (the first is not timed)")
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
    import train
    train.cuda_allocator_defaults()                     # the allocator train.py runs with, before any CUDA allocation
    heap_mmap_threshold(args.heap_mmap_mb)
    CHILD_FLAGS[:] = ["--heap_mmap_mb", str(args.heap_mmap_mb)]
    if args.probe:                                                            # child process
        print(json.dumps(PROBES[args.probe](json.loads(args.probe_cfg), args.device)))
        return
    res = {"device": torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else
           f"cpu ({torch.get_num_threads()} threads)", "torch": torch.__version__}

    reports = {"conflict": report_conflict, "loss": report_loss, "step": report_step, "paper": report_paper_step,
               "reward": report_reward, "trl": report_trl, "memory": report_memory, "gpu": report_gpu}
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
