"""Held-out evaluation during a run (train.py --eval_steps): how the policy does on problems it never trains on,
at RL's start, every --eval_steps steps and at the last step -- eval.py's own sampling and scoring, on the policy
in memory (no reload), with eval.py's defaults (temperature, seed, one-shot example, sampler, calls of its
--batch_size).

    row in metrics.jsonl   {"step": k, "phase": "eval", "eval/pass@1", "eval/pass@2", ..., "eval/format",
                            "eval/truncated", "eval/mean_length", "eval/seconds", "eval/problems", "eval/n"}
    eval_samples.jsonl     every sample of every evaluation, eval.py's samples.jsonl rows with their step
    best.json              the step with the highest held-out pass@1 (ties: the earlier); --save_best: best/

The row at step k is what `python eval.py --adapter RUN/checkpoint-k --limit M --n_samples n
--max_completion_length L` gives (docs/training.md says where that holds bit for bit). Under torchrun each rank
samples its share of eval.py's rollout calls and rank 0 scores them all together.
"""
import dataclasses
import json
import os
import time

import torch

import eval as evaluate
from machinery.data import DataError, is_local, load_task
from machinery.runs import read_json, save_folder, save_weights, write_json


def eval_args(cfg):
    """eval.py's settings for this run's evaluations: its flags as eval.py parses them (its defaults for the rest)."""
    argv = ["--model", cfg.model, "--dataset", cfg.eval_dataset, "--split", cfg.eval_split, "--task", cfg.task,
            "--limit", str(cfg.eval_limit), "--n_samples", str(cfg.eval_n_samples), "--max_completion_length",
            str(cfg.max_completion_length), "--dtype", cfg.dtype, "--device", cfg.device,
            "--load_in_4bit" if cfg.load_in_4bit else "--no-load_in_4bit"]
    return evaluate.parse_args(argv + (["--data_dir", cfg.data_dir] if cfg.data_dir else []))


def held_out_records(cfg, training):
    """The first --eval_limit problems of --eval_dataset's --eval_split, refused (DataError, before any model loads)
    where one of them is a training problem, or where there are none."""
    if is_local(cfg.eval_dataset) and cfg.eval_dataset == cfg.dataset:
        raise DataError(f"{cfg.dataset!r} is one file with no held-out split; give --eval_dataset HELD_OUT.jsonl "
                        f"(problems the run never trains on)")
    try:
        records = load_task(cfg.eval_dataset, cfg.eval_split, cfg.data_dir)[:cfg.eval_limit]
    except DataError as e:
        raise DataError(f"--eval_split {cfg.eval_split}: {e}") from None
    if not records:
        raise DataError(f"--eval_dataset {cfg.eval_dataset!r} split {cfg.eval_split!r} has no problems; give another "
                        f"--eval_split")
    seen = {r["question"] for r in training}
    shared = [i for i, r in enumerate(records) if r["question"] in seen]
    if shared:
        raise DataError(f"{len(shared)} of the {len(records)} held-out problems ({cfg.eval_dataset} {cfg.eval_split}, "
                        f"first at position {shared[0]}) are training problems of {cfg.dataset}: a held-out figure "
                        f"must come from problems the run never trains on; give another --eval_split or --eval_dataset")
    return records


def due(cfg, step, total):
    """Whether the policy after `step` optimizer steps is evaluated: RL's start (after the SFT warm-up), every
    --eval_steps steps after it, and the last step."""
    if not cfg.eval_steps or step < cfg.warmup_steps:
        return False
    return step == cfg.warmup_steps or step % cfg.eval_steps == 0 or step == total


class HeldOut:
    """The run's evaluations: due steps without a row in metrics.jsonl (a resumed run re-evaluates only what its
    kept rows lack) are evaluated, written, and best.json (and best/) kept up to date."""

    def __init__(self, cfg, records, dist, metrics, log=print):
        self.cfg, self.records, self.dist, self.metrics, self.log = cfg, records, dist, metrics, log
        self.args = eval_args(cfg)
        self.task = self.args.task if self.args.task != "auto" else evaluate.task_name(self.args.dataset)
        self.args.one_shot_from, self.example = evaluate.one_shot(self.args, self.args.model)
        self.ks = evaluate.default_ks(self.args.n_samples)
        path = os.path.join(cfg.output_dir, "metrics.jsonl")
        rows = [json.loads(line) for line in open(path)] if dist.main and os.path.isfile(path) else []
        self.done = {r["step"]: r for r in rows if r.get("phase") == "eval"}          # kept by --resume

    def __call__(self, model, tok, step, total):
        """Evaluate the policy after `step` steps if that is due and not done -> the row, or None."""
        if not due(self.cfg, step, total) or any(self.dist.gather(step in self.done)):
            return None
        t0 = time.time()
        cuda = [self.dist.device] if str(self.dist.device).startswith("cuda") else []
        with torch.random.fork_rng(devices=cuda):            # the run's own draws go on as without evaluation
            self.args.rollout = evaluate.pick_sampler(self.args, model, tok, self.records, self.example,
                                                      self.dist.device, log=lambda *a: None)
            with open(os.devnull, "w") as sink:
                mine = evaluate.sample_problems(model, tok, self.records, self.task, self.args, self.example, sink,
                                                share=(self.dist.rank, self.dist.world), show=False)
        rows = sorted((r for part in self.dist.gather(mine) for r in part), key=lambda r: (r["problem"], r["sample"]))
        if not self.dist.main:
            return None
        res = evaluate.compute_results(rows, self.ks, self.args.seed, self.args.maj_subsets)
        row = {"step": step, "phase": "eval", **{f"eval/pass@{k}": v for k, v in res["pass@k"].items()},
               "eval/format": res["format_rate"], "eval/truncated": res["truncated_frac"],
               "eval/mean_length": res["mean_length"], "eval/seconds": time.time() - t0,
               "eval/problems": res["n_problems"], "eval/n": res["n_samples"]}
        self.metrics.write(row, step)
        with open(os.path.join(self.cfg.output_dir, "eval_samples.jsonl"), "a") as f:
            f.writelines(json.dumps({"step": step, **r}) + "\n" for r in rows)
        self.done[step] = row
        self.keep_best(model, tok, step)
        self.log(f"held-out at step {step}: pass@1 {row['eval/pass@1']:.3f}, format {row['eval/format']:.2f} "
                 f"({res['n_problems']} {self.args.dataset} {self.args.split} problems x {res['n_samples']}, "
                 f"{row['eval/seconds']:.0f} s)")
        return row

    def keep_best(self, model, tok, step):
        """best.json names the evaluated step with the highest pass@1 (the earlier on a tie); with --save_best
        its adapter is written to best/ (atomically) when `step` becomes it."""
        best = max(self.done.values(), key=lambda r: (r["eval/pass@1"], -r["step"]))
        out = self.cfg.output_dir
        write_json(os.path.join(out, "best.json"), {"step": best["step"], **{k: v for k, v in best.items()
                                                                            if k.startswith("eval/")}})
        marker = os.path.join(out, "best", "best.json")
        if self.cfg.save_best and best["step"] == step and not (os.path.isfile(marker) and
                                                                read_json(marker)["step"] == step):
            def write(tmp):
                save_weights(model, tmp)
                tok.save_pretrained(tmp)
                write_json(os.path.join(tmp, "best.json"), {"step": step, "eval/pass@1": best["eval/pass@1"]})
            save_folder(os.path.join(out, "best"), write)


def plan(cfg, training, log=print):
    """The run's held-out problems, decided before any model loads -> (the config with --eval_dataset and
    --eval_steps as run, the records or None). --eval_steps not given: every --save_steps where the held-out
    problems can be read, else off, said in one line; given: refused with the fix where they cannot."""
    asked = cfg.eval_steps
    cfg = dataclasses.replace(cfg, eval_dataset=cfg.eval_dataset or (None if is_local(cfg.dataset) else cfg.dataset))
    if asked == 0:
        return dataclasses.replace(cfg, eval_steps=0), None
    try:
        if cfg.eval_dataset is None:
            raise DataError(f"{cfg.dataset!r} is one file with no held-out split; give --eval_dataset HELD_OUT.jsonl "
                            f"(problems the run never trains on)")
        records = held_out_records(cfg, training)
    except DataError as e:
        if asked is not None:
            raise DataError(f"--eval_steps {asked}: {e}; or --eval_steps 0") from None
        log(f"held-out evaluation: off ({e})")
        return dataclasses.replace(cfg, eval_steps=0), None
    cfg = dataclasses.replace(cfg, eval_steps=asked or cfg.save_steps)
    log(f"held-out evaluation: the first {len(records)} problems of {cfg.eval_dataset} {cfg.eval_split} x "
        f"{cfg.eval_n_samples} samples at step {cfg.warmup_steps} (RL's start), every {cfg.eval_steps} steps and at "
        f"the last step (eval.py's sampling and scoring)")
    return cfg, records
