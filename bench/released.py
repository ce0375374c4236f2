"""How much the released code's conflict count matters (README "equations vs released code"): the demo's run
under --released_code (train.main, its own trajectory untouched), and at each RL step, on that step's group,

  * the share of its completions whose count differs: Listing 2 line 91's (the longer span, what the run
    uses) against the prose's |M^fw v M^bw| (both clamped to >= 1, as the loss divides by them);
  * the gradient norm with each count, on the same completions (the union's from a second backward, the
    run's own restored before its optimizer step).

    python -m bench.released                 # about 6 min on 2 cores; writes docs/released-count.json
    python -m bench.released --max_steps 10 --out /tmp/x.json
"""
import argparse
import dataclasses
import json
import os
import statistics

import torch

import gtpo
import step
import train

OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "released-count.json")


def measure(argv):
    """train.main(argv) with step.rl_step wrapped; -> one row per RL step."""
    rows, original = [], step.rl_step

    def rl_step(model, policy, tok, prompts, answers, cfg, ref_model=None, clock=step._no_clock, **kw):
        m, ro, scored = original(model, policy, tok, prompts, answers, cfg, ref_model, clock, **kw)
        params = [p for p in policy.parameters() if p.grad is not None]
        longer = [p.grad.clone() for p in params]                                   # the run's own gradient
        ids, mask, adv, G = ro.completion_ids, ro.completion_mask, scored["advantages"], cfg.generation_size
        union_cfg = dataclasses.replace(cfg, objective=dataclasses.replace(cfg.objective, conflict_count="union"))
        weights, _, n_longer = gtpo.batch_conflict_weights(ids, mask, adv, G, cfg.objective)
        _, _, n_union = gtpo.batch_conflict_weights(ids, mask, adv, G, union_cfg.objective)
        for p in params:
            p.grad = None
        step.policy_gradient(union_cfg, model, policy, ref_model, ro, adv, weights, n_union)
        union = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in params]
        for p, g in zip(params, longer):
            p.grad = g
        active = adv != 0
        differs = (n_longer.clamp(min=1) != n_union.clamp(min=1)) & active                  # (N,)
        rows.append({"step": len(rows) + 1, "completions": len(adv), "active": int(active.sum()),
                     "count_differs": int(differs.sum()),
                     "grad_norm_longer": torch.cat([g.flatten() for g in longer]).norm().item(),
                     "grad_norm_union": torch.cat([g.flatten() for g in union]).norm().item()})
        return m, ro, scored

    step.rl_step = rl_step
    try:
        train.main(argv)
    finally:
        step.rl_step = original
    return rows


def summary(rows):
    """The figures docs/training.md quotes: counts over the run, and the gradient-norm ratio longer / union on
    the steps where some count differs (elsewhere the two gradients are the same)."""
    ratios = [r["grad_norm_longer"] / r["grad_norm_union"] for r in rows if r["count_differs"]]
    return {"steps": len(rows), "completions": sum(r["completions"] for r in rows),
            "active": sum(r["active"] for r in rows), "count_differs": sum(r["count_differs"] for r in rows),
            "steps_with_active": sum(r["active"] > 0 for r in rows), "steps_count_differs": len(ratios),
            "norm_ratio_median": statistics.median(ratios) if ratios else None,
            "norm_ratio_min": min(ratios, default=None), "norm_ratio_max": max(ratios, default=None)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--max_steps", type=int, default=28, help="train.py's --max_steps (the demo: 8 SFT + 20 RL)")
    p.add_argument("--output_dir", default="runs/bench-released-count")
    p.add_argument("--out", default=OUT)
    a = p.parse_args(argv)
    rows = measure(["--released_code", "--max_steps", str(a.max_steps), "--output_dir", a.output_dir, "--overwrite"])
    res = {"command": f"python -m bench.released --max_steps {a.max_steps}", "host": torch.backends.cpu.get_cpu_capability(),
           "summary": summary(rows), "steps": rows}
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print("step  active  count differs  |g| longer  |g| union  ratio")
    for r in rows:
        ratio = r["grad_norm_longer"] / r["grad_norm_union"] if r["grad_norm_union"] else float("nan")
        print(f"{r['step']:4d}  {r['active']:6d}  {r['count_differs']:13d}  {r['grad_norm_longer']:10.4g}  "
              f"{r['grad_norm_union']:9.4g}  {ratio:5.3f}")
    print(json.dumps(res["summary"]))


if __name__ == "__main__":
    main()
