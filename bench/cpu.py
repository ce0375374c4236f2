"""The training step on the host it runs on (parts 3 and 4): step.rl_step -- the function train.py's loop
calls -- timed per stage through its clock, methods alternating, medians after a warm-up round.
"""
import dataclasses
import statistics
import sys
import time

import torch

import gtpo
from bench.common import MB, bench_prompt, matmul_peak, memory_bandwidth, spread_rewards
from machinery.models import load_model, pick_dtype


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


def step_flops(model, policy_tokens, completion_tokens):
    """Matmul FLOPs of the gradient pass's forward and backward: every nn.Linear of the decoder (LoRA's
    included) over the tokens through the policy, the LM head over the completion tokens (the chunked head
    runs only there). Backward: each layer's input gradient, plus the weight gradient of the trainable ones.
    Attention scores and elementwise work are not counted, so the GFLOP/s it gives are a lower bound."""
    head = model.get_output_embeddings()
    fwd = bwd = 0
    for m in model.modules():
        if isinstance(m, torch.nn.Linear) and m is not head:
            flops = 2 * m.in_features * m.out_features * policy_tokens
            fwd += flops
            bwd += flops * (2 if m.weight.requires_grad else 1)
    head_flops = 2 * head.weight.shape[0] * head.weight.shape[1] * completion_tokens
    return fwd + head_flops, bwd + head_flops


def decode_products_time(model, rows, repeats=5):
    """Seconds of one decode step's matmuls alone, the best of `repeats`: every packed product of
    cpu_decoder.Decoder (q/k/v, o, gate/up, down per layer, then the LM head) over `rows` rows of
    random input, no other op. What the few-row kernels in reach allow the sampler, whatever its
    other work; None for a model cpu_decoder does not describe."""
    from speedups import cpu_decoder
    if not cpu_decoder.supports(model):
        return None
    dec = cpu_decoder.Decoder(model)
    products = [p for layer in dec.layers for p in layer.products] + [dec.head]
    inputs = [torch.randn(rows, p.weight.shape[-2] if p.blocked else p.weight.shape[1]) for p in products]
    best = float("inf")
    with torch.no_grad():
        for _ in range(repeats + 1):                                     # the first pass warms the kernels up
            t0 = time.perf_counter()
            for p, x in zip(products, inputs):
                p(x)                                                     # (rows, in) -> (rows, out)
            best = min(best, time.perf_counter() - t0)
    return best


def bench_step(args, G, new_tokens, rounds, names, prompt_tokens=0, micro_batch_size=0):
    """Medians over `rounds` (after one warm-up round) of step.rl_step's stages, methods alternating;
    micro_batch_size completions per forward/backward (0: all in one pass)."""
    import step as steps
    import train
    from machinery.config import parse_args
    flags = {"gtpo": [], "gtpo logged": [],                                  # logged: with a conflicts.ConflictLog
             "gtpo generate": ["--rollout", "generate"], "gtpo shared": ["--rollout", "shared"],
             "gtpo plain": ["--rollout", "generate", "--no-share_prompt"],
             "grpo b=0": ["--use_grpo"], "grpo b=0.04": ["--use_grpo", "--beta", "0.04"], "floor": ["--use_grpo"]}
    cfgs = {}
    for name in names:    # the model's flags and micro_batch_size; the entropy filter on, so its cost is counted
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
    from analysis.conflicts import ConflictLog, format_token_ids
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
    out = {}
    for name, rows in times.items():
        keys = sorted({k for p in rows for k in p})
        med = {k: statistics.median(p.get(k, 0.0) for p in rows) for k in keys}
        med["total"] = statistics.median(sum(p.values()) for p in rows)
        med["completion_tokens_per_s"] = G * new_tokens / med["generate"]
        shared = name != "floor" and cfgs[name].share_prompt                   # in the gradient pass
        med["policy_tokens"] = (P if shared else G * P) + G * new_tokens     # through the policy pass: shared, once a step
        med["forward_flops"], med["backward_flops"] = step_flops(model, med["policy_tokens"], G * new_tokens)
        if cuda:
            med["peak_gpu_gb"] = peaks[name] / 2 ** 30                          # torch.cuda.max_memory_allocated
        out[name] = med
    return out, {"prompt_tokens": P, "G": G, "new_tokens": new_tokens,
                 "weight_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
                 "decode_products_s": None if cuda else decode_products_time(model, G)}


def print_step_table(title, st):
    cols = ["generate", "reward", "masks", "reference", "forward", "backward", "optimizer", "total"]
    print(title)
    print("   " + f"{'':14s}" + "".join(f"{c:>10s}" for c in cols) + f"{'tok/s':>9s}{'policy tok':>11s}")
    for name, med in st.items():
        print("   " + f"{name:14s}" + "".join(f"{med.get(c, 0.0):10.4f}" for c in cols)
              + f"{med['completion_tokens_per_s']:9.1f}{med['policy_tokens']:11d}")


STEP_METHODS = ["gtpo", "gtpo logged", "gtpo generate", "gtpo plain", "grpo b=0", "grpo b=0.04", "floor"]


def limits(args, st, shape):
    """Each stage against the host's limits, both measured in this run: sampling in tokens/s against the
    weight-streaming bound (every decode step reads every weight once, for G rows), forward and backward in
    GFLOP/s against the fp32 matmul peak on the same threads."""
    bw, peak = memory_bandwidth(args.device), matmul_peak(args.device)
    bound = args.G * bw / shape["weight_bytes"]
    out = {"memory_bandwidth_gb_s": bw / 1e9, "matmul_peak_gflop_s": peak / 1e9, "weight_mb": shape["weight_bytes"] / MB,
           "bound_tokens_per_s": bound, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
           "threads": torch.get_num_threads(), **shape}
    if shape.get("decode_products_s"):                                  # the sampler's matmuls alone
        out["products_tokens_per_s"] = args.G / shape["decode_products_s"]
        out["products_fraction_of_bound"] = out["products_tokens_per_s"] / bound
    for name, med in st.items():
        med["fraction_of_bound"] = med["completion_tokens_per_s"] / bound
        for stage in ("forward", "backward"):
            if med.get(stage):
                med[f"{stage}_gflop_s"] = med[f"{stage}_flops"] / med[stage] / 1e9
                med[f"{stage}_fraction_of_peak"] = med[f"{stage}_flops"] / med[stage] / peak
    return out


def report_step(args, res):
    """Part 3: one training step per method, per stage; each stage against the host's limits."""
    names = args.methods.split(",") if args.methods else STEP_METHODS
    st, shape = bench_step(args, args.G, args.new_tokens, args.steps, names)
    res["step"] = st
    res["decode"] = lim = limits(args, st, shape)
    print_step_table(f"\n3. one step, embedded model, 1 prompt ({shape['prompt_tokens']} tokens) x G={args.G} x "
                     f"{args.new_tokens} tokens (median of {args.steps} after a warm-up, seconds)", st)
    print(f"   limits of this host ({lim['cpu_capability']}, {lim['threads']} threads), measured here: streaming read "
          f"{lim['memory_bandwidth_gb_s']:.1f} GB/s -> decoding bound {lim['bound_tokens_per_s']:.0f} tokens/s "
          f"(G x bandwidth / {lim['weight_mb']:.0f} MB of weights); fp32 matmul peak {lim['matmul_peak_gflop_s']:.0f} GFLOP/s")
    if "products_tokens_per_s" in lim:
        print(f"   a decode step's matmuls alone (cpu_decoder's packed products, {args.G} rows, nothing else): "
              f"{lim['decode_products_s'] * 1e3:.1f} ms -> {lim['products_tokens_per_s']:.0f} tokens/s, "
              f"{lim['products_fraction_of_bound']:.0%} of the bound")
    print(f"   {'':14s}{'sampling tok/s':>15s}{'of bound':>9s}{'fwd GFLOP/s':>12s}{'of peak':>8s}"
          f"{'bwd GFLOP/s':>12s}{'of peak':>8s}")
    for name, med in st.items():
        print(f"   {name:14s}{med['completion_tokens_per_s']:15.1f}{med['fraction_of_bound']:9.0%}"
              f"{med.get('forward_gflop_s', 0):12.1f}{med.get('forward_fraction_of_peak', 0):8.0%}"
              f"{med.get('backward_gflop_s', 0):12.1f}{med.get('backward_fraction_of_peak', 0):8.0%}")
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
