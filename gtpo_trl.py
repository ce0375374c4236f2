"""GTPO for TRL users: GTPOConfig and GTPOTrainer on TRL's GRPOTrainer (pip install ".[trl]", docs/trl.md).

    from gtpo_trl import GTPOConfig, GTPOTrainer
    trainer = GTPOTrainer(model=model, processing_class=tok, reward_funcs=[reward],
                          args=GTPOConfig(output_dir="out", num_generations=8), train_dataset=ds)
    trainer.train()                       # launch with accelerate / DeepSpeed as for GRPOTrainer

GTPOConfig is GRPOConfig plus the objective's settings GTPO reads, made from gtpo.Objective's declarations:
train.py's names, defaults, help and refusals. What changes against GRPOTrainer, all computed with gtpo.py's
functions, as train.py's loop computes it:
  * after TRL scores a generation batch (every process's rewards), each completion gets Eq. 8's advantage from
    its whole group (a group may straddle processes), then per-token advantages
    A_{i,t} = lambda_{i,t} * delta_i * A_i (Eq. 5-6; divided by its conflict count with conflict_norm), delta_i
    from <H>_i of a no-grad pass of the current policy (each prompt once; TRL's own forward under ZeRO-3 / FSDP);
  * the loss is gtpo.gtpo_loss on TRL's log-probs: Eq. 7's normalisation with loss_type="grpo", and with
    ratio 1 (one iteration) GTPO's gradient, Eq. 22; "dapo" and "dr_grpo" aggregate as train.py's
    --loss_type does, under TRL's normalisers (gradient accumulation included);
  * Eq. 7's -gamma <H>_i is folded into the advantage, A_{i,t} = lambda_{i,t} * delta_i * (A_i - gamma <H>_i),
    as the released code does (entropy_term="released", the default); entropy_term="eq7" instead adds
    +gamma <H>_i for every completion, with its gradient through TRL's own entropies, as Eq. 7 is written.
Every process makes the same model calls whatever its completions, so DeepSpeed ZeRO and FSDP see matching
collectives. Logs gtpo/conflict_frac, gtpo/filtered_frac, gtpo/filtered_entropy, gtpo/mean_weight (and
gtpo/h_ini with "auto").

    python gtpo_trl.py            # 20 GTPO steps of the embedded model on the arithmetic task, CPU
    python gtpo_trl.py --method grpo --max_steps 5    # TRL's GRPOTrainer, same settings
    python -m gtpo_trl            # the same after `pip install ".[trl]"`, from any folder
"""
import dataclasses
import json
import os
import warnings

import torch

import gtpo
from data import format_prompt, load_task, one_shot_example
from gtpo_logprobs import sequence_logprobs
from models import embedded_model_dir

__all__ = ["GTPOConfig", "GTPOTrainer", "per_token_advantages", "embedded_model_dir", "example_dataset",
           "example_trainer"]

# TRL 1.16 calls transformers' gradient_checkpointing names, which transformers 5 renamed (FutureWarning each)
warnings.filterwarnings("ignore", message=r"`(is_)?gradient_checkpointing\w*` is deprecated", category=FutureWarning)

try:
    from trl import GRPOConfig, GRPOTrainer
    from trl.models.utils import disable_gradient_checkpointing
except ImportError as e:                                           # TRL is optional for the rest of the project
    raise ImportError("gtpo_trl needs TRL: pip install 'gtpo[trl]' (in a clone: pip install -r requirements-trl.txt)") from e

# the objective's settings GTPO reads: GTPOConfig's own fields (scale_rewards and loss_type replace TRL's)
SETTINGS = [f for f in dataclasses.fields(gtpo.Objective) if gtpo.GTPO in f.metadata["reads"]]
SCALE = {"group": True, "none": False}              # TRL's scale_rewards (it turns True / False into these)


class _Checks:
    """GTPOConfig's refusals and its gtpo.Objective; TRL options that would change the method are refused."""

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
            "use_liger_kernel": (self.use_liger_kernel, False, "Liger's fused loss is GRPO's, not GTPO's"),
        }
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
        if self.scale_rewards not in SCALE:
            raise ValueError(f"GTPOConfig: scale_rewards={self.scale_rewards!r}; Eq. 8 is True ('group'), False "
                             f"('none') the released code")
        try:
            self.objective()
        except ValueError as e:
            raise ValueError(f"GTPOConfig: {e}") from None

    def objective(self):
        """The gtpo.Objective these settings give (GRPO's own, beta and clip, at their defaults: GTPO reads neither)."""
        values = {f.name: getattr(self, f.name) for f in SETTINGS}
        return gtpo.Objective(**{**values, "scale_rewards": SCALE[self.scale_rewards]})


GTPOConfig = dataclasses.make_dataclass("GTPOConfig", [
    (f.name, f.type, dataclasses.field(default=f.default, metadata={"help": f"{f.metadata['help']} "
                                                                            f"({f.metadata['where']})"}))
    for f in SETTINGS], bases=(_Checks, GRPOConfig))
GTPOConfig.__module__ = __name__                   # TRL pickles its arguments beside each checkpoint
GTPOConfig.__doc__ = ("GRPOConfig plus the objective's settings GTPO reads (gtpo.Objective), under train.py's names, "
                      "defaults and checks; TRL options that would change the method are refused.")


def per_token_advantages(ids, mask, rewards, h, group_size, o, gate):
    """Eq. 8, Eq. 5 and Eq. 6-7 for whole groups, from gtpo.py's functions, as train.py's loop computes them:
    rewards -> per-token advantages A_{i,t} = lambda_{i,t} * shaped A_i (/ the conflict count with conflict_norm).

    ids, mask (N, T) right-padded completions, groups of `group_size` consecutive rows; rewards (N,); h (N,) =
    <H>_i; o: the gtpo.Objective; gate: "all", "neg" or "off".
    Returns (A (N, T) float32, metrics dict of floats).
    """
    adv = gtpo.group_advantages(rewards, group_size, o)                             # (N,) Eq. 8
    weights, conflict, n_conf = gtpo.batch_conflict_weights(ids, mask, adv, group_size, o)   # (N, T) Eq. 5
    shaped = gtpo.shaped_advantages(adv, h, o, gate)                                # (N,) Eq. 6-7
    valid = mask.bool()
    frac, h_dropped = gtpo.filtered_stats(adv, shaped, h) if gate != "off" else (0.0, 0.0)
    metrics = {"gtpo/conflict_frac": (conflict & valid).sum().item() / max(valid.sum().item(), 1),
               "gtpo/filtered_frac": frac, "gtpo/filtered_entropy": h_dropped,
               "gtpo/mean_weight": gtpo.masked_mean(weights, valid).item()}
    return gtpo.token_advantages(weights, n_conf, shaped, o), metrics


STATE_FILE = "gtpo_state.json"


class GTPOTrainer(GRPOTrainer):
    """GRPOTrainer whose advantages are GTPO's per-token ones (per_token_advantages) and whose loss is
    gtpo.gtpo_loss; nothing else changes."""

    _h_ini = None
    _rewards = None

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        if not isinstance(self.args, GTPOConfig):
            raise TypeError(f"GTPOTrainer needs args=GTPOConfig(...), got {type(self.args).__name__}")
        self.objective = self.args.objective()

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        """TRL's rewards of every process's completions (rows in process order), kept for Eq. 8."""
        self._rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        return self._rewards

    def _compute_loss(self, model, inputs):
        """gtpo.gtpo_loss of the micro-batch on TRL's log-probs and entropies (its own forward): the per-token
        advantages of _generate_and_score_completions, Eq. 7's +gamma <H>_i with its gradient where
        entropy_term is "eq7", aggregated with TRL's normalisers (_totals)."""
        mask = inputs["completion_mask"]
        logp, entropy, _ = self._get_per_token_logps_and_entropies(
            model, torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1),
            torch.cat([inputs["prompt_mask"], mask], 1), mask.shape[1], compute_entropy=True)   # (n, T)
        h = gtpo.masked_mean(entropy, mask, dim=1)                                   # (n,) <H>_i, with grad
        loss, _ = gtpo.gtpo_loss(logp, mask, inputs["advantages"], self.objective,
                                 h if self.objective.entropy_grad("gtpo") else None, self._totals(inputs))
        token_sums = torch.stack([(entropy.detach() * mask).sum(), mask.sum().to(entropy.dtype)])
        total = self.accelerator.reduce(token_sums, reduction="sum")                 # TRL's "entropy", all ranks
        self._metrics["train" if self.model.training else "eval"]["entropy"].append(
            (total[0] / total[1].clamp(min=1)).item())
        return loss

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
        scored = self._rewards.isnan().all(dim=1)                                   # every function said None
        if scored.any():
            raise ValueError(f"GTPOTrainer: {int(scored.sum())} completion(s) got no reward from any reward function "
                             f"(all returned None); Eq. 8 needs a reward for every completion of a group")
        rewards = (self._rewards * self.reward_weights.to(self._rewards.device).unsqueeze(0)).nansum(dim=1)   # (N,)
        h = self._mean_entropy(out)                                                 # (n,) <H>_i, no grad
        acc = self.accelerator                                                      # whole groups, all processes
        pad = self.processing_class.pad_token_id
        all_ids = acc.gather(acc.pad_across_processes(ids, dim=1, pad_index=pad))
        all_mask = acc.gather(acc.pad_across_processes(mask, dim=1, pad_index=0))
        all_h = acc.gather(h)
        gate = self._gate(all_h, mode)
        per_token, metrics = per_token_advantages(all_ids, all_mask, rewards, all_h, G, self.objective, gate)
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
        """Eq. 6 (gtpo.Objective.gate): "auto" filters iff <H>_ini < ln 2, <H>_ini = mean <H>_i of the first
        training batch (saved with each checkpoint and restored on resume)."""
        if self.objective.entropy_filter != "auto":
            return self.objective.entropy_filter
        if self._h_ini is None and mode == "train":
            self._h_ini = all_h.mean().item()
        if self._h_ini is not None:
            self._metrics[mode]["gtpo/h_ini"].append(self._h_ini)
        return "off" if self._h_ini is None else self.objective.gate("gtpo", self._h_ini)

    def _shards_parameters(self):
        """Whether the engine holds the parameters in pieces (DeepSpeed ZeRO-3, FSDP): then only the model's own
        forward, called as often on every process, sees them whole."""
        plugin = getattr(self.accelerator.state, "deepspeed_plugin", None)
        return self.is_fsdp_enabled or plugin is not None and plugin.zero_stage == 3

    @torch.no_grad()
    def _mean_entropy(self, out):
        """<H>_i (Sec. 4.2) of each completion under the current policy, the mean token entropy. Where every process
        holds whole parameters, the loop's pass: each prompt once for its consecutive completions, the LM head in
        chunks (gtpo_logprobs.sequence_logprobs). Where an engine shards them (_shards_parameters), TRL's own
        no-grad forward in chunks of per_device_train_batch_size rows: it gathers them the engine's way, and every
        process calls the model as often whatever its completions' lengths."""
        mask = out["completion_mask"]
        if self._shards_parameters():
            ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
            with disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
                _, entropy, _ = self._get_per_token_logps_and_entropies(
                    self.model, ids, torch.cat([out["prompt_mask"], mask], 1), mask.shape[1],
                    batch_size=self.args.per_device_train_batch_size, compute_entropy=True)    # (n, T)
            return gtpo.masked_mean(entropy, mask, dim=1)                            # (n,)
        p_ids, p_mask = out["prompt_ids"], out["prompt_mask"]                      # (n, P) left-padded
        new_prompt = torch.ones(len(p_ids), dtype=torch.bool, device=p_ids.device)
        new_prompt[1:] = ((p_ids[1:] != p_ids[:-1]) | (p_mask[1:] != p_mask[:-1])).any(dim=1)
        prompt_index = new_prompt.long().cumsum(0) - 1                              # (n,) 0, ..., B-1
        was_training = self.model.training
        self.model.eval()                       # the sampling policy (no dropout); keeps the KV cache the
        try:                                    # shared prompt needs when gradient checkpointing is on
            _, entropy = sequence_logprobs(self.model, p_ids[new_prompt], p_mask[new_prompt], out["completion_ids"],
                                           mask, prompt_index=prompt_index, temperature=self.temperature)   # (n, T)
        finally:
            self.model.train(was_training)
        return gtpo.masked_mean(entropy, mask, dim=1)                               # (n,)


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
