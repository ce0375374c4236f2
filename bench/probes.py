"""The parts measured in a fresh process each (on CPU: a clean peak-RSS counter): conflict masks against a
vocabulary-indexed implementation (part 1), the loss's memory chunked against full logits (part 2), and TRL's
trainers (part 6). `python -m bench --probe NAME` is the child's entry point.
"""
import json
import os
import re
import statistics
import subprocess
import sys
import time

import torch

import gtpo
from bench.common import MB, ROOT


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
    from speedups.logprobs import ChunkedLogprobs
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
        a = gtpo.released_advantages(adv, gtpo.masked_mean(ent, mask, 1), 0.7, 0.1)
        loss, _ = gtpo.gtpo_loss(logp, mask, gtpo.token_advantages(w, None, a))
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
    """One gtpo_trl.example_trainer run in this process: the wall time between consecutive optimizer steps, and for
    GTPO, per step, the seconds it spends outside TRL's own forwards: `added` (a pass of its own for <H>_i, lambda,
    Eq. 6-7's shaping, their metrics) and, within it, `entropy_pass` (the pass of its own alone; 0 where <H>_i comes
    from TRL's forwards). Every completion is forced to full length, so both methods do the same work.
    cfg["num_iterations"]: TRL's, each generation trained that many optimizer steps."""
    from transformers import TrainerCallback

    from gtpo_trl import example_trainer, trainer
    added, current, depth = {"entropy_pass": [], "added": []}, {"entropy_pass": 0.0, "added": 0.0}, [0]

    def timed(fn, keys):
        def wrapper(*a, **kw):
            if depth[0]:                                    # inside another timed call: counted there
                return fn(*a, **kw)
            depth[0], t0 = 1, time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                depth[0] = 0
                for k in keys:
                    current[k] += time.perf_counter() - t0
        return wrapper
    trainer.GTPOTrainer._mean_entropy = timed(trainer.GTPOTrainer._mean_entropy, ("entropy_pass", "added"))
    trainer.GTPOTrainer._shape_in_loss = timed(trainer.GTPOTrainer._shape_in_loss, ("added",))
    for name in ("per_token_advantages", "conflict_weights"):
        setattr(trainer, name, timed(getattr(trainer, name), ("added",)))
    ends = []

    class StepEnds(TrainerCallback):
        def on_step_end(self, *a, **kw):
            ends.append(time.perf_counter())
            for k in added:
                added[k].append(current[k])
                current[k] = 0.0
    t = example_trainer(cfg["method"], cfg["steps"], cfg["out"], disable_tqdm=True,
                        generation_kwargs={"min_new_tokens": cfg["tokens"]}, max_completion_length=cfg["tokens"],
                        num_iterations=cfg.get("num_iterations", 1))
    t.add_callback(StepEnds())
    t.train()
    return {"step_s": [b - a for a, b in zip(ends, ends[1:])], "first_entropy_pass_s": added["entropy_pass"][0],
            **{k: v[1:] for k, v in added.items()}}


def probe_ours(cfg, device):
    """step.rl_step -- train.py's step with the embedded model's defaults -- on probe_trl's work: the arithmetic
    task's prompts in the same format, one prompt x 8 completions forced to cfg["tokens"] tokens, then clip and
    the optimizer step as train.py's loop does; the wall time of each step after the first."""
    import dataclasses

    import step
    import train
    from bench.common import spread_rewards
    from machinery.config import parse_args
    from machinery.data import format_prompt, load_task, one_shot_example
    from machinery.models import load_model
    a = parse_args(["--batch_size", "1", "--generation_size", "8", "--max_completion_length", str(cfg["tokens"]),
                    "--entropy_filter", "all", "--device", "cpu"])        # probe_trl's work, whatever the profile
    a = dataclasses.replace(a, min_new_tokens=cfg["tokens"])
    torch.manual_seed(a.seed)
    model, tok, _ = load_model(a.model, lora_rank=a.lora_rank, device="cpu", log=lambda *x: None)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer, _ = train.make_optimizer(a, params, 1000, log=lambda *x: None)
    records = load_task("arithmetic", "train")
    example, times = one_shot_example(records[0]), []
    for r in records[1:cfg["steps"] + 1]:
        t0 = time.perf_counter()
        with spread_rewards():
            step.rl_step(model, model, tok, [format_prompt(tok, r["question"], example)], [r["answer"]], a)
        torch.nn.utils.clip_grad_norm_(params, a.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return {"step_s": times[1:]}


PROBES = {"conflict": probe_conflict, "loss": probe_loss, "trl": probe_trl, "ours": probe_ours}


# -----------------------------------------------------------------------------
# their reports

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
            ours_w = gtpo.conflict_weights(ids, mask, adv, gtpo.Objective(conflict_combine="product"))[0]
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


def report_trl(args, res):
    """Part 6: steps of gtpo_trl.example_trainer, GTPOTrainer against TRL's GRPOTrainer with the same settings (and
    with num_iterations=2: gtpo2 / grpo2), and step.rl_step ("ours", train.py's step) on the same work; each run in a
    fresh process, the methods alternating (the order rotated every round). A run's figure is its mean step after
    its first (with num_iterations=2 steps alternate with and without a generation); the part's, the median over
    rounds with their range, and each round's GTPO / GRPO ratio."""
    import tempfile
    methods = args.trl_methods.split(",")
    step = {m: [] for m in methods}
    added = {m: {"entropy_pass": [], "added": [], "first_entropy_pass": []} for m in methods if m.startswith("gtpo")}
    for r in range(args.steps):
        for method in methods[r % len(methods):] + methods[:r % len(methods)]:
            with tempfile.TemporaryDirectory() as out:
                cfg = {"method": method.rstrip("2"), "steps": args.trl_steps, "tokens": args.new_tokens, "out": out,
                       "num_iterations": 2 if method.endswith("2") else 1}
                got = in_child("ours" if method == "ours" else "trl", cfg, "cpu")
            step[method].append(statistics.mean(got["step_s"]))
            for k in added.get(method, ()):
                added[method][k].append(got["first_entropy_pass_s"] if k == "first_entropy_pass"
                                        else statistics.mean(got[k]))
            print(f"  round {r} {method}: steps {' '.join(f'{x:.2f}' for x in got['step_s'])} s", file=sys.stderr)
    med = {m: statistics.median(v) for m, v in step.items()}
    part = {"median_step_s": med, "range_step_s": {m: [min(v), max(v)] for m, v in step.items()}, "rounds": args.steps,
            "cpu_capability": torch.backends.cpu.get_cpu_capability()}
    for m, parts in added.items():
        for k, v in parts.items():
            part[f"{m}_{k}_s"] = statistics.median(v)
        part[f"{m}_added_share"] = statistics.median(a / s_ for a, s_ in zip(parts["added"], step[m]))
    names = {"grpo": "GRPOTrainer", "gtpo": "GTPOTrainer", "ours": "step.rl_step", "grpo2": "GRPOTrainer "
             "num_iterations=2", "gtpo2": "GTPOTrainer num_iterations=2"}
    print(f"\n6. TRL, embedded model, 8 completions x {args.new_tokens} tokens per step ({args.steps} rounds of "
          f"{args.trl_steps}-step runs per method, each run's mean step after its first; median over rounds "
          f"[range], seconds; {part['cpu_capability']})")
    print("   " + "   ".join(f"{names[m]} {med[m]:.2f} [{min(step[m]):.2f}-{max(step[m]):.2f}]" for m in methods))
    for g in ("gtpo", "gtpo2"):
        b = "grpo" + g[4:]
        if g in step and b in step:
            ratios = [x / y for x, y in zip(step[g], step[b])]              # paired by round
            part[f"{g}_over_{b}"] = statistics.median(ratios)
            part[f"{g}_over_{b}_range"] = [min(ratios), max(ratios)]
            print(f"   {names[g]} / {names[b]} {part[f'{g}_over_{b}']:.3f} [{min(ratios):.3f}-{max(ratios):.3f}]; "
                  f"GTPO outside TRL's forwards {part[f'{g}_added_s']:.3f} s a step "
                  f"({100 * part[f'{g}_added_share']:.3f} % of it), of which a pass of its own for <H>_i "
                  f"{part[f'{g}_entropy_pass_s']:.3f} s; the first step's <H>_ini pass "
                  f"{part[f'{g}_first_entropy_pass_s']:.2f} s, once a run")
    if "gtpo" in step and "grpo" in step:
        part["overhead"] = part["gtpo_over_grpo"] - 1
    for m in ("grpo", "gtpo"):
        if m in med and m + "2" in med:
            part[f"{m}_iterations_2_over_1"] = med[m + "2"] / med[m]
            print(f"   {names[m]} num_iterations=2 / 1, mean step: {med[m + '2']:.2f} / {med[m]:.2f} s = "
                  f"{part[f'{m}_iterations_2_over_1']:.3f}")
    if "ours" in med and "grpo" in med:
        part["ours_over_grpo_trainer"] = med["ours"] / med["grpo"]
        print(f"   step.rl_step / GRPOTrainer {part['ours_over_grpo_trainer']:.3f}")
    res["trl"] = part
