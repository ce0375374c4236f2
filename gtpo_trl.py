"""GTPO for TRL users: GTPOConfig and GTPOTrainer on TRL's GRPOTrainer (pip install ".[trl]", docs/trl.md).

    from gtpo_trl import GTPOConfig, GTPOTrainer
    trainer = GTPOTrainer(model=model, processing_class=tok, reward_funcs=[reward],
                          args=GTPOConfig(output_dir="out", num_generations=8), train_dataset=ds)
    trainer.train()                       # launch with accelerate / DeepSpeed as for GRPOTrainer

What changes against GRPOTrainer, all computed with gtpo.py's functions:
  * after TRL scores a generation batch, every process's completions are gathered so that each
    group is whole (a group may straddle processes), and each completion gets per-token
    advantages  A_{i,t} = lambda_{i,t} * delta_i * A_i  (Eq. 5-6; divided by its conflict count with
    conflict_norm), delta_i from <H>_i of a no-grad pass of the current policy (each prompt computed
    once for its completions);
  * TRL's loss with loss_type="grpo" then gives Eq. 7's normalisation (mean over each completion's
    tokens, then over completions), and with ratio 1 (one iteration) GTPO's gradient, Eq. 22;
    "dapo" and "dr_grpo" aggregate as train.py's --loss_type does (gtpo.aggregate);
  * Eq. 7's -gamma <H>_i is folded into the advantage, A_{i,t} = lambda_{i,t} * delta_i * (A_i - gamma <H>_i),
    as the released code does (entropy_term="released", the default); entropy_term="eq7" instead adds
    +gamma <H>_i (as a loss) for every completion of the micro-batch, with its gradient through TRL's
    own entropies, as Eq. 7 is written, aggregated by gtpo.aggregate under TRL's normalisers.
Logs gtpo/conflict_frac, gtpo/filtered_frac, gtpo/filtered_entropy, gtpo/mean_weight (and gtpo/h_ini with "auto").

    python gtpo_trl.py            # 20 GTPO steps of the embedded model on the arithmetic task, CPU
    python gtpo_trl.py --method grpo --max_steps 5    # TRL's GRPOTrainer, same settings
    python -m gtpo_trl            # the same after `pip install ".[trl]"`, from any folder
"""
import json
import logging
import math
import os
import warnings
from dataclasses import dataclass, field

import torch

import gtpo
from data import format_prompt, load_task, one_shot_example
from gtpo_logprobs import sequence_logprobs
from models import embedded_model_dir

__all__ = ["GTPOConfig", "GTPOTrainer", "token_advantages", "embedded_model_dir", "example_dataset", "example_trainer"]

# TRL imports bitsandbytes, whose CPU backend announces an optional kernel package it works without
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
# TRL 1.16 calls transformers' gradient_checkpointing names, which transformers 5 renamed (FutureWarning each)
warnings.filterwarnings("ignore", message=r"`(is_)?gradient_checkpointing\w*` is deprecated", category=FutureWarning)

try:
    from trl import GRPOConfig, GRPOTrainer
except ImportError as e:                                           # TRL is optional for the rest of the project
    raise ImportError("gtpo_trl needs TRL: pip install 'gtpo[trl]' (in a clone: pip install -r requirements-trl.txt)") from e


@dataclass
class GTPOConfig(GRPOConfig):
    """GRPOConfig plus GTPO's settings, under train.py's names; TRL options that would change the
    method are refused."""
    loss_type: str = field(default="grpo", metadata={"help": "grpo = Eq. 7's normalisation (each completion's "
                           "token mean, then their mean); dapo = over all tokens; dr_grpo = a constant length"})
    conflict_weight: float = field(default=2.0, metadata={"help": "lambda on positive conflict tokens (Eq. 5)"})
    conflict_combine: str = field(default="or", metadata={"help": "or = Eq. 5; product = released code"})
    conflict_norm: bool = field(default=False, metadata={"help": "divide by the conflict count (released code)"})
    conflict_count: str = field(default="union", metadata={"help": "union = |M^fw v M^bw|; longer = the longer "
                                "span (released code, Listing 2 line 91)"})
    sum_completions: bool = field(default=False, metadata={"help": "sum the completions' terms instead of their "
                                  "mean (released code, Listing 3); with loss_type grpo"})
    entropy_filter: str = field(default="auto", metadata={"help": "auto (Eq. 6: filter iff <H>_ini < ln 2, "
                                                          "<H>_ini from the first batch), all, neg, off"})
    ent_threshold: float = field(default=math.log(2), metadata={"help": "threshold on <H>_i (Eq. 6)"})
    ent_gamma: float = field(default=0.1, metadata={"help": "gamma of -gamma <H>_i (Eq. 7)"})
    entropy_term: str = field(default="released", metadata={"help": "released = -gamma <H>_i folded into the "
                              "advantage, detached (train.py's default); eq7 = a term of its own, with its gradient "
                              "(Eq. 7 as written)"})

    def __post_init__(self):
        super().__post_init__()
        wrong = {
            "beta": (self.beta, 0.0, "GTPO has no KL term"),
            "top_entropy_quantile": (self.top_entropy_quantile, 1.0, "another token filter than Eq. 6"),
            "entropy_coef": (getattr(self, "entropy_coef", 0.0), 0.0, "an entropy bonus with gradient, not Eq. 7"),
            "importance_sampling_level": (self.importance_sampling_level, "token", "GTPO weighs tokens"),
            "off_policy_mask_threshold": (self.off_policy_mask_threshold, None, "masks tokens GTPO weighs"),
            "multi_objective_aggregation": (self.multi_objective_aggregation, "sum_then_normalize",
                                            "Eq. 8 normalises the summed reward per group"),
        }
        if self.loss_type not in gtpo.LOSS_TYPES:
            raise ValueError(f"GTPOConfig: loss_type={self.loss_type!r} is not supported (GTPO's per-token advantages "
                             f"are aggregated as {', '.join(gtpo.LOSS_TYPES)}, as train.py's --loss_type); use 'grpo' "
                             f"for Eq. 7's normalisation")
        for name, (value, want, why) in wrong.items():
            if value != want:
                raise ValueError(f"GTPOConfig: {name}={value!r} is not supported ({why}); use {want!r}")
        off_policy = {   # what would make a step's completions not the policy's own samples (Eq. 22: ratio 1)
            "num_iterations": (self.num_iterations != 1, "several updates per generation; GTPO's gradient (Eq. 22) "
                               "is the one-iteration case: use 1"),
            "steps_per_generation": (self.steps_per_generation > self.gradient_accumulation_steps,
                                     "one generation reused for several optimizer steps; use at most "
                                     "gradient_accumulation_steps"),
            "vllm_importance_sampling_correction": (self.use_vllm and self.vllm_importance_sampling_correction,
                                                    "reweights tokens by vLLM's sampling probabilities, which GTPO's "
                                                    "per-token weights do not include: set it False"),
        }
        for name, (bad, why) in off_policy.items():
            if bad:
                raise ValueError(f"GTPOConfig: {name}={getattr(self, name)!r} is not supported ({why})")
        if self.scale_rewards not in ("group", "none"):
            raise ValueError(f"GTPOConfig: scale_rewards={self.scale_rewards!r}; Eq. 8 is 'group' "
                             f"('none' = the released code)")
        if (self.conflict_combine not in ("or", "product") or self.entropy_filter not in ("auto", *gtpo.FILTER_MODES)
                or self.entropy_term not in gtpo.ENTROPY_TERMS or self.conflict_count not in gtpo.CONFLICT_COUNTS):
            raise ValueError(f"GTPOConfig: conflict_combine is 'or' or 'product'; entropy_filter is "
                             f"{', '.join(('auto', *gtpo.FILTER_MODES))}; entropy_term is "
                             f"{' or '.join(gtpo.ENTROPY_TERMS)}; conflict_count is {' or '.join(gtpo.CONFLICT_COUNTS)}")
        if self.sum_completions and self.loss_type != "grpo":
            raise ValueError(f"GTPOConfig: sum_completions sums Eq. 7's per-completion terms (loss_type 'grpo'); "
                             f"loss_type={self.loss_type!r} has no per-completion mean to replace")


def token_advantages(ids, mask, advantages, h, group_size, args, gate):
    """Per-token advantages of Eq. 5-6 (and, with entropy_term "released", Eq. 7's -gamma <H>_i) for
    whole groups, from gtpo.py's functions.

    ids, mask (N, T) right-padded completions, groups of `group_size` consecutive rows; advantages
    (N,) from TRL (Eq. 8); h (N,) = <H>_i; gate: "all", "neg" or "off".
    A group whose advantages are all equal (all rewards equal: TRL leaves ~1e-12 residues) gets 0.
    Returns (A (N, T) float32, metrics dict of floats).
    """
    a = advantages.float().view(-1, group_size)                                     # (B, G)
    flat = (a == a[:, :1]).all(dim=1, keepdim=True)
    a = torch.where(flat, torch.zeros_like(a), a).reshape(-1)                       # (N,)
    weights, conflict, n_conf = gtpo.batch_conflict_weights(ids, mask, a, group_size,
                                                            conflict_weight=args.conflict_weight,
                                                            combine=args.conflict_combine,
                                                            count=args.conflict_count)        # (N, T)
    shaped, _ = gtpo.shaped_advantages(a, h, args.entropy_term, gate, args.ent_threshold, args.ent_gamma)  # (N,)
    per_token = weights * shaped.unsqueeze(1)                                       # (N, T)
    if args.conflict_norm:
        per_token = per_token / n_conf.clamp(min=1).unsqueeze(1).to(per_token.dtype)
    valid = mask.bool()
    frac, h_dropped = gtpo.filtered_stats(a, shaped, h) if gate != "off" else (0.0, 0.0)
    metrics = {"gtpo/conflict_frac": (conflict & valid).sum().item() / max(valid.sum().item(), 1),
               "gtpo/filtered_frac": frac, "gtpo/filtered_entropy": h_dropped,
               "gtpo/mean_weight": gtpo.masked_mean(weights, valid).item()}
    return per_token, metrics


STATE_FILE = "gtpo_state.json"


class GTPOTrainer(GRPOTrainer):
    """GRPOTrainer whose advantages are GTPO's per-token ones (token_advantages), plus Eq. 7's entropy
    term in the loss (entropy_term "eq7"); nothing else changes."""

    _h_ini = None
    _entropies = None

    def _get_per_token_logps_and_entropies(self, *args, **kw):
        """TRL's pass; its entropies are kept for Eq. 7's term: _compute_loss's own call (with grad when
        training) is the last one before the loss reads them."""
        logps, entropies, aux = super()._get_per_token_logps_and_entropies(*args, **kw)
        self._entropies = entropies
        return logps, entropies, aux

    def _compute_loss(self, model, inputs):
        """TRL's loss + gamma <H>_i of each completion of the micro-batch (Eq. 7, entropy_term "eq7"),
        aggregated by gtpo.aggregate as TRL aggregates its loss_type, gradient accumulation included;
        with sum_completions, times the step's completions on this process (the sum, not the mean)."""
        loss = super()._compute_loss(model, inputs)
        if self.args.sum_completions:
            loss = loss * self._totals(inputs).completions
        if self.args.entropy_term != "eq7" or not self.args.ent_gamma:
            return loss
        mask = inputs["completion_mask"]
        h = gtpo.masked_mean(self._entropies, mask, dim=1)                            # (n,) <H>_i, with grad
        self._entropies = None
        totals = self._totals(inputs)
        if self.args.sum_completions:
            totals = totals._replace(completions=1.0)
        term = gtpo.aggregate(torch.zeros(mask.shape, dtype=h.dtype, device=h.device), mask, self.args.loss_type,
                              per_seq=self.args.ent_gamma * h, totals=totals)
        return loss + term

    def _totals(self, inputs):
        """TRL's normalisers for one micro-batch as gtpo.Totals: its completions times the accumulation
        steps, the generation batch's tokens over all processes per process and accumulation window
        (num_items_in_batch, "dapo"), and max_completion_length."""
        n, accumulation = len(inputs["completion_mask"]), 1.0
        tokens = float(inputs["completion_mask"].sum())
        if self.model.training:
            accumulation = self.current_gradient_accumulation_steps
        if "num_items_in_batch" in inputs:
            tokens = float(inputs["num_items_in_batch"]) / self.accelerator.num_processes
            tokens *= accumulation / self.args.steps_per_generation if self.model.training else 1.0
        return gtpo.Totals(n * accumulation, tokens, self.max_completion_length)

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        mode = "train" if self.model.training else "eval"
        G = self.num_generations if mode == "train" else self.num_generations_eval
        ids, mask = out["completion_ids"], out["completion_mask"]                   # (n, T) this process
        h = self._mean_entropy(out, mode)                                           # (n,) <H>_i, no grad
        acc = self.accelerator                                                      # whole groups, all processes
        pad = self.processing_class.pad_token_id
        all_ids = acc.gather(acc.pad_across_processes(ids, dim=1, pad_index=pad))
        all_mask = acc.gather(acc.pad_across_processes(mask, dim=1, pad_index=0))
        all_adv, all_h = acc.gather(out["advantages"]), acc.gather(h)
        gate = self._gate(all_h, mode)
        per_token, metrics = token_advantages(all_ids, all_mask, all_adv, all_h, G, self.args, gate)
        rows = slice(acc.process_index * len(ids), (acc.process_index + 1) * len(ids))
        out["advantages"] = per_token[rows, :ids.shape[1]].to(out["advantages"].dtype)   # (n, T)
        for k, v in metrics.items():
            self._metrics[mode][k].append(v)
        return out

    def _save_checkpoint(self, model, trial):
        """TRL's checkpoint, and <H>_ini beside it (gtpo_state.json): Eq. 6's decision survives a resume."""
        super()._save_checkpoint(model, trial)
        folder = os.path.join(self._get_output_dir(trial=trial), f"checkpoint-{self.state.global_step}")
        if self.args.should_save and os.path.isdir(folder):
            with open(os.path.join(folder, STATE_FILE), "w") as f:
                json.dump({"h_ini": self._h_ini}, f)

    def train(self, resume_from_checkpoint=None, **kw):
        """GRPOTrainer.train; resuming from a checkpoint also restores <H>_ini (_save_checkpoint)."""
        folder = resume_from_checkpoint
        if folder is True:
            from transformers.trainer_utils import get_last_checkpoint
            folder = get_last_checkpoint(self.args.output_dir)
        if isinstance(folder, str) and os.path.isfile(os.path.join(folder, STATE_FILE)):
            with open(os.path.join(folder, STATE_FILE)) as f:
                self._h_ini = json.load(f)["h_ini"]
        return super().train(resume_from_checkpoint=resume_from_checkpoint, **kw)

    def _gate(self, all_h, mode):
        """Eq. 6: "auto" filters iff <H>_ini < ln 2, <H>_ini = mean <H>_i of the first training batch
        (saved with each checkpoint and restored on resume)."""
        if self.args.entropy_filter != "auto":
            return self.args.entropy_filter
        if self._h_ini is None and mode == "train":
            self._h_ini = all_h.mean().item()
        if self._h_ini is not None:
            self._metrics[mode]["gtpo/h_ini"].append(self._h_ini)
        return "all" if self._h_ini is not None and self._h_ini < math.log(2) else "off"

    @torch.no_grad()
    def _mean_entropy(self, out, mode):
        """<H>_i (Sec. 4.2) of each completion under the current policy: mean token entropy, from one
        pass in which each prompt runs once for its consecutive completions (gtpo_logprobs.PolicyPass)."""
        p_ids, p_mask = out["prompt_ids"], out["prompt_mask"]                      # (n, P) left-padded
        new_prompt = torch.ones(len(p_ids), dtype=torch.bool, device=p_ids.device)
        new_prompt[1:] = ((p_ids[1:] != p_ids[:-1]) | (p_mask[1:] != p_mask[:-1])).any(dim=1)
        prompt_index = new_prompt.long().cumsum(0) - 1                              # (n,) 0, ..., B-1
        was_training = self.model.training
        self.model.eval()                       # the sampling policy (no dropout); keeps the KV cache the
        try:                                    # shared prompt needs when gradient checkpointing is on
            _, ent = sequence_logprobs(self.model, p_ids[new_prompt], p_mask[new_prompt], out["completion_ids"],
                                       out["completion_mask"], prompt_index=prompt_index,
                                       temperature=self.temperature)                 # (n, T), as TRL's logps
        finally:
            self.model.train(was_training)
        return gtpo.masked_mean(ent, out["completion_mask"], dim=1)                  # (n,)


def example_dataset(tok, task="arithmetic"):
    """A task's training records as a TRL dataset in the project's prompt format: `prompt` (App. 16.1's system
    prompt, the task's first record as the worked one-shot example, then not trained on) and `answer`."""
    from datasets import Dataset
    records = load_task(task, "train")
    example = one_shot_example(records[0])
    return Dataset.from_list([{"prompt": format_prompt(tok, r["question"], example), "answer": r["answer"]}
                              for r in records[1:]])


def example_trainer(method="gtpo", max_steps=20, output_dir="runs/gtpo-trl-smollm2-135m-arithmetic", **kw):
    """GTPOTrainer (or, with method="grpo", TRL's GRPOTrainer with the same settings) on the embedded
    model and the arithmetic task, offline on CPU, with the demo's recipe; kw overrides GRPOConfig fields."""
    from models import load_model
    from rewards import trl_reward
    torch.manual_seed(3407)
    model, tok, _ = load_model("smollm2-135m", lora_rank=32, device="cpu")
    settings = dict(output_dir=output_dir, max_steps=max_steps, learning_rate=2e-4, num_generations=8,
                    per_device_train_batch_size=8, max_completion_length=96, bf16=False, use_cpu=True,
                    logging_steps=1, report_to="none", save_strategy="no", adam_beta1=0.999999,
                    adam_beta2=0.999999, weight_decay=0.1, max_grad_norm=0.1, lr_scheduler_type="cosine",
                    warmup_steps=0, temperature=1.0, top_k=0, seed=3407)     # TRL's warm-up starts at lr 0
    config, trainer = {"gtpo": (GTPOConfig, GTPOTrainer), "grpo": (GRPOConfig, GRPOTrainer)}[method]
    return trainer(model=model, processing_class=tok, reward_funcs=[trl_reward("arithmetic")],
                   args=config(**{**settings, **kw}), train_dataset=example_dataset(tok))


def main(argv=None):
    import argparse
    p = argparse.ArgumentParser(description="GTPO through TRL's trainer on the embedded model (CPU, offline)",
                                allow_abbrev=False)
    p.add_argument("--max_steps", type=int, default=20)
    p.add_argument("--method", choices=("gtpo", "grpo"), default="gtpo",
                   help="grpo: TRL's GRPOTrainer with the same settings")
    p.add_argument("--output_dir", default="runs/gtpo-trl-smollm2-135m-arithmetic")
    p.add_argument("--max_completion_length", type=int, default=96)
    a = p.parse_args(argv)
    trainer = example_trainer(a.method, a.max_steps, a.output_dir, max_completion_length=a.max_completion_length)
    trainer.train()
    final, metrics = os.path.join(a.output_dir, "final"), os.path.join(a.output_dir, "metrics.jsonl")
    trainer.save_model(final)                                       # the LoRA adapter and the tokenizer
    with open(metrics, "w") as f:                                   # TRL's logged rows, one per step
        f.writelines(json.dumps(row) + "\n" for row in trainer.state.log_history)
    print(f"done: adapter in {final} (python eval.py --adapter {final}), metrics in {metrics}")


if __name__ == "__main__":
    main()
