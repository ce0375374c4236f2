"""GTPOTrainer on TRL's GRPOTrainer (pip install ".[trl]", docs/trl.md), with GTPOConfig (gtpo_trl/config.py).

    from gtpo_trl import GTPOConfig, GTPOTrainer
    trainer = GTPOTrainer(model=model, processing_class=tok, reward_funcs=[reward],
                          args=GTPOConfig(output_dir="out", num_generations=8), train_dataset=ds)
    trainer.train()                       # launch with accelerate / DeepSpeed as for GRPOTrainer

GTPOTrainer keeps what GTPO takes from GRPO and replaces what GTPO defines, with gtpo.py's functions, as train.py's
loop calls them:
  * TRL generates, scores and computes Eq. 8's A_i, with every option that acts on it (reward weights, their
    aggregation, scale_rewards; a completion no reward function scored gets A_i = 0); a group whose rewards are
    all equal gets exactly 0;
  * each token then gets A_{i,t} = lambda_{i,t} * delta_i * A_i, lambda over its whole group, every process's
    completions (Eq. 5-6; divided by its conflict count with conflict_norm), delta_i from <H>_i over the tokens the
    policy wrote (tool output out), taken from a forward TRL makes anyway: its old-log-probability forward where it
    makes one, else the loss forward itself; with entropy_term="released" (the default) Eq. 7's -gamma <H>_i is
    folded in, A_{i,t} = lambda_{i,t} * delta_i * (A_i - gamma <H>_i), as the released code does;
  * the loss is TRL's on those advantages: the clipped surrogate min(r A_{i,t}, clip(r) A_{i,t}) -- Eq. 7, whose
    one iteration (r = 1, the paper's) gives GTPO's gradient, Eq. 22 -- with TRL's KL term, token masks,
    importance sampling, normalisation (loss_type) and MoE router loss; entropy_term="eq7" adds +gamma <H>_i for
    every completion with its gradient through TRL's entropies, as Eq. 7 is written.
gtpo_trl.config.OPTIONS says, for every GRPOConfig field that touches the loss, what GTPO does with it.
Every process makes the same model calls whatever its completions, so DeepSpeed ZeRO and FSDP see matching
collectives. Logs gtpo/conflict_frac, gtpo/filtered_frac, gtpo/filtered_entropy, gtpo/mean_weight,
gtpo/unscored_frac (and gtpo/h_ini with "auto") beside TRL's metrics.

    python -m gtpo_trl --example                   # 20 GTPO steps of the embedded model on the arithmetic task, CPU
    python -m gtpo_trl --example --method grpo --max_steps 5    # TRL's GRPOTrainer, same settings
    python -m gtpo_trl --config recipe.yaml        # TRL's `trl grpo` command line (gtpo_trl/cli.py)
"""
import json
import math
import os

import torch

import gtpo
from gtpo_trl.config import gtpo_config
from speedups.logprobs import UnsharedCache, sequence_logprobs

try:
    from trl import GRPOTrainer
    from trl.models.utils import disable_gradient_checkpointing
except ImportError as e:                                           # TRL is optional for the rest of the project
    raise ImportError("gtpo_trl needs TRL: pip install 'gtpo[trl]' (in a clone: pip install -r requirements-trl.txt)") from e


def per_token_advantages(ids, mask, advantages, h, group_size, objective, mode, own=None):
    """Eq. 5 and Eq. 6-7 for whole groups, from gtpo.py's functions, as train.py's loop computes them: Eq. 8's
    advantages -> per-token advantages A_{i,t} = lambda_{i,t} * shaped A_i (/ the conflict count with conflict_norm).

    ids, mask (N, T) right-padded completions, groups of `group_size` consecutive rows; advantages (N,) A_i; h (N,)
    = <H>_i; objective: the gtpo.Objective; mode: delta_i's, "all", "neg" or "off"; own (N, T) or None: the tokens
    the policy wrote
    (mask without tool output), which the conflict counts and metrics count (None: every real token).
    Returns (A (N, T) float32, metrics dict of floats).
    """
    weights, n_conf, metrics = conflict_weights(ids, mask, advantages, group_size, objective, own)
    shaped = gtpo.shaped_advantages(advantages, h, objective, mode)                 # (N,) Eq. 6-7
    metrics.update(filtered_metrics(advantages, h, objective, mode))
    return gtpo.token_advantages(weights, n_conf, shaped, objective), metrics


def conflict_weights(ids, mask, advantages, group_size, objective, own=None):
    """Eq. 5 for whole groups: lambda_{i,t} (N, T) and the conflict counts (N,), with their metrics; own as
    per_token_advantages."""
    own = mask if own is None else own
    weights, conflict, n_conf = gtpo.batch_conflict_weights(ids, mask, advantages, group_size, objective, own)  # Eq. 5
    ours = own.bool()
    return weights, n_conf, {"gtpo/conflict_frac": conflict.sum().item() / max(ours.sum().item(), 1),
                             "gtpo/mean_weight": gtpo.masked_mean(weights, ours).item()}


def filtered_metrics(advantages, h, objective, mode):
    """What Eq. 6's filter removes from A_i (N,) with <H>_i (N,) under `mode`: gtpo/filtered_frac and its mean <H>_i."""
    if mode == "off":
        return {"gtpo/filtered_frac": 0.0, "gtpo/filtered_entropy": 0.0}
    delta = gtpo.filter_deltas(advantages, h, objective.ent_threshold, mode)       # (N,) Eq. 6
    frac, h_dropped = gtpo.filtered_stats(advantages, delta, h, objective)
    return {"gtpo/filtered_frac": frac, "gtpo/filtered_entropy": h_dropped}


def flat_groups_to_zero(advantages, rewards, group_size):
    """A group whose scored rewards are all equal gets A_i = 0 exactly (TRL's mean can leave a residue whose sign
    would make conflicts). advantages (N,); rewards (N, F) per reward function, NaN where unscored -> (N,)."""
    summed = rewards.nan_to_num(0.0).sum(dim=1).view(-1, group_size)               # (B, G)
    scored = ~rewards.isnan().all(dim=1).view(-1, group_size)
    flat = summed.masked_fill(~scored, -math.inf).amax(1) <= summed.masked_fill(~scored, math.inf).amin(1)   # (B,)
    return advantages.masked_fill(flat.repeat_interleave(group_size), 0.0)


def own_tokens(batch):
    """(n, T) the completion tokens the policy wrote: TRL's completion_mask without a tool's output (tool_mask)."""
    mask = batch["completion_mask"]
    return mask if "tool_mask" not in batch else mask * batch["tool_mask"]


STATE_FILE = "gtpo_state.json"
# what TRL's loss forward passes a vision-language model beside the tokens (GRPOTrainer._compute_loss)
MULTIMODAL = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes", "num_tiles",
              "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids")


class GTPOTrainer(GRPOTrainer):
    """GRPOTrainer whose advantages are GTPO's per-token ones, and whose loss is TRL's on them plus Eq. 7's entropy
    term where it has a gradient; args: a GTPOConfig (None or a GRPOConfig: gtpo_config). <H>_i comes from a forward
    TRL makes anyway (_generate_and_score_completions says which)."""

    _h_ini = None
    _rewards = None
    _entropies = None
    _shared_prompt = True          # the <H>_i pass runs each prompt once (a key/value cache) until a model refuses
    _keep_scoring = False          # the next forward is TRL's old-log-probability one: keep its entropies
    _scored = None                 # those entropies (n, T)
    _in_loss = None                # (the loss's inputs, the raw ones, own tokens, scale) while TRL's loss forward runs

    def __init__(self, model, reward_funcs=None, args=None, *rest, **kw):
        super().__init__(model, reward_funcs, gtpo_config(args, model), *rest, **kw)
        self.objective = self.args.objective()
        self._modes = {}           # "train" / "eval" -> delta_i's mode for the generation batch in use

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        """TRL's rewards of every process's completions (rows in process order), kept for the flat groups."""
        self._rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        return self._rewards

    def _get_per_token_logps_and_entropies(self, *args, compute_entropy=False, **kw):
        """TRL's forward. The old-log-probability one of _generate_and_score_completions also returns its entropies
        (the fused LM head computes them anyway) for <H>_i; the loss forward's are kept for Eq. 7's term and, where the
        advantages wait for <H>_i, shape them before TRL's loss reads them (_shape_in_loss)."""
        scoring, self._keep_scoring = self._keep_scoring, False
        logps, entropies, aux = super()._get_per_token_logps_and_entropies(
            *args, compute_entropy=compute_entropy or scoring, **kw)
        if scoring:
            self._scored = entropies
            return logps, None, aux
        if self._in_loss is not None:
            self._entropies = entropies
            if "gtpo_weights" in self._in_loss[1]:
                self._shape_in_loss(entropies)
        return logps, entropies, aux

    def _compute_loss(self, model, inputs):
        """TRL's loss on the per-token advantages (its clip, KL, masks, normalisation, MoE loss and metrics), plus
        Eq. 7's +gamma <H>_i with its gradient through TRL's entropies where entropy_term is "eq7", aggregated as
        the loss type says (_totals); sum_completions (loss_type "grpo") sums the completions' terms."""
        objective, own = self.objective, own_tokens(inputs)                         # own (n, T)
        totals = self._totals(inputs, own)
        scale = totals.completions if objective.sum_completions else 1.0          # Listing 3: no 1/G
        given = {**inputs, "advantages": inputs["advantages"] * scale}
        self._in_loss = (given, inputs, own, scale)
        try:
            loss = super()._compute_loss(model, given)
        finally:
            self._in_loss = None
        entropy, self._entropies = self._entropies, None
        if objective.entropy_grad("gtpo"):
            h = gtpo.masked_mean(entropy, own, dim=1)                               # (n,) <H>_i, with grad
            term = gtpo.aggregate(torch.zeros_like(entropy), own, objective.loss_type, objective.ent_gamma * h, totals)
            mode = "train" if self.model.training else "eval"
            undivided = totals.completions / len(own)                               # TRL logs per micro-batch
            self._metrics[mode]["policy_loss"].append(self.accelerator.gather(loss.detach() * undivided).mean().item())
            loss = loss + scale * term
        return loss

    def _shape_in_loss(self, entropies):
        """Eq. 6-7 on this micro-batch's A_i with <H>_i from the loss forward's entropies (read as constants), times
        lambda (computed over whole groups at generation): the per-token advantages TRL's loss reads next."""
        given, inputs, own, scale = self._in_loss
        mode = "train" if self.model.training else "eval"
        adv = inputs["advantages"]                                                  # (n,) A_i
        h = gtpo.masked_mean(entropies.detach().float(), own, dim=1)               # (n,) <H>_i
        shaped = gtpo.shaped_advantages(adv, h, self.objective, self._modes[mode])   # (n,) Eq. 6-7
        per_token = gtpo.token_advantages(inputs["gtpo_weights"], inputs["gtpo_n_conflict"], shaped, self.objective)
        given["advantages"] = per_token.to(adv.dtype) * scale                       # (n, T)
        acc = self.accelerator                                                      # the metrics over every process
        metrics = filtered_metrics(acc.gather(adv), acc.gather(h), self.objective, self._modes[mode])
        for k, v in metrics.items():
            self._metrics[mode][k].append(v)

    def _totals(self, inputs, own):
        """TRL's normalisers for one micro-batch as gtpo.Totals: its completions times the accumulation steps, the
        tokens ("dapo": the generation batch's over all processes per process and accumulation window; "bnpo": the
        micro-batch's times the accumulation steps) and max_completion_length."""
        n, accumulation = len(own), 1.0
        if self.model.training:
            accumulation = self.current_gradient_accumulation_steps
        tokens = float(own.sum()) * accumulation
        if self.loss_type == "dapo":
            tokens = float(inputs["num_items_in_batch"]) / self.accelerator.num_processes
            tokens *= accumulation / self.args.steps_per_generation if self.model.training else 1.0
        return gtpo.Totals(n * accumulation, tokens, self.max_completion_length)

    def _makes_old_logps(self):
        """Whether TRL's _generate_and_score_completions makes a no-grad forward of the completions for their old
        log-probabilities (its own condition: several iterations or misaligned accumulation, or vLLM's importance
        sampling)."""
        every = self.args.steps_per_generation * self.num_iterations
        return self.args.gradient_accumulation_steps % every != 0 or bool(
            self.use_vllm and self.vllm_importance_sampling_correction)

    def _generate_and_score_completions(self, inputs):
        """TRL's generation, rewards and Eq. 8 advantages, then GTPO's over whole groups: lambda (Eq. 5) here, and
        Eq. 6-7 with <H>_i from a forward TRL makes anyway -- its old-log-probability forward where it makes one
        (the sampling policy), else the loss forward (_shape_in_loss: at one iteration the same policy). Only the
        first training batch under entropy_filter "auto" with neither needs a pass of its own (_mean_entropy):
        <H>_ini decides delta_i before any loss."""
        mode = "train" if self.model.training else "eval"
        self._keep_scoring = self._makes_old_logps()
        try:
            out = super()._generate_and_score_completions(inputs)
        finally:
            self._keep_scoring = False
        scored, self._scored = self._scored, None
        G = self.num_generations if mode == "train" else self.num_generations_eval
        ids, mask, own = out["completion_ids"], out["completion_mask"], own_tokens(out)   # (n, T) this process
        acc, pad = self.accelerator, self._tokenizer.pad_token_id                   # whole groups, all processes
        all_ids = acc.gather(acc.pad_across_processes(ids, dim=1, pad_index=pad))
        all_mask, all_own = (acc.gather(acc.pad_across_processes(m, dim=1, pad_index=0)) for m in (mask, own))
        adv = acc.gather(out["advantages"])                                         # (N,)
        if self.multi_objective_aggregation == "sum_then_normalize":               # A_i centred on its group
            adv = flat_groups_to_zero(adv, self._rewards, G)
        rows = slice(acc.process_index * len(ids), (acc.process_index + 1) * len(ids))
        needs_h_ini = self.objective.entropy_filter == "auto" and self._h_ini is None and mode == "train"
        if scored is None and not needs_h_ini:                                      # <H>_i from the loss forward
            weights, n_conf, metrics = conflict_weights(all_ids, all_mask, adv, G, self.objective, all_own)
            self._modes[mode] = self._filter_mode(None, mode)
            out["advantages"] = adv[rows]                                           # (n,) A_i, shaped in the loss
            out["gtpo_weights"], out["gtpo_n_conflict"] = weights[rows, :ids.shape[1]], n_conf[rows]
        else:
            h = gtpo.masked_mean(scored.float(), own, dim=1) if scored is not None else self._mean_entropy(out, own)
            all_h = acc.gather(h)                                                   # (N,) <H>_i, no grad
            per_token, metrics = per_token_advantages(all_ids, all_mask, adv, all_h, G, self.objective,
                                                      self._filter_mode(all_h, mode), all_own)
            out["advantages"] = per_token[rows, :ids.shape[1]].to(out["advantages"].dtype)   # (n, T)
        metrics["gtpo/unscored_frac"] = self._rewards.isnan().all(dim=1).float().mean().item()   # TRL: A_i = 0
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

    def _filter_mode(self, all_h, mode):
        """delta_i's mode (Eq. 6, gtpo.Objective.filter_mode): "auto" filters iff <H>_ini < ln 2, <H>_ini = mean
        <H>_i of the first training batch, all_h (saved with each checkpoint and restored on resume; None once
        known)."""
        if self.objective.entropy_filter != "auto":
            return self.objective.entropy_filter
        if self._h_ini is None and mode == "train":
            self._h_ini = all_h.mean().item()
        if self._h_ini is not None:
            self._metrics[mode]["gtpo/h_ini"].append(self._h_ini)
        return "off" if self._h_ini is None else self.objective.filter_mode("gtpo", self._h_ini)

    def _shards_parameters(self):
        """Whether the engine holds the parameters in pieces (DeepSpeed ZeRO-3, FSDP): then only the model's own
        forward, called as often on every process, sees them whole."""
        plugin = getattr(self.accelerator.state, "deepspeed_plugin", None)
        return self.is_fsdp_enabled or plugin is not None and plugin.zero_stage == 3

    @torch.no_grad()
    def _mean_entropy(self, out, own=None):
        """<H>_i (Sec. 4.2) of each completion under the current policy: the mean entropy of the tokens it wrote
        (own (n, T); None: every completion token). Where every process holds whole parameters, the model's cache is
        a key/value one and the prompts are text alone, the loop's pass: each prompt once for its consecutive
        completions, the LM head in chunks (speedups.logprobs.sequence_logprobs). Otherwise -- an engine that shards
        them (_shards_parameters), a model whose cache holds recurrent state (Mamba, linear attention), or prompts
        with images (MULTIMODAL: a vision-language model) -- TRL's own no-grad forward in chunks of
        per_device_train_batch_size rows, with what its loss forward sees: it gathers sharded parameters the
        engine's way, every process calls the model as often whatever its completions' lengths, and the images
        reach the model as they do in the loss."""
        own = out["completion_mask"] if own is None else own
        images = {k: out[k] for k in MULTIMODAL if k in out}
        if self._shared_prompt and not images and not self._shards_parameters():
            try:
                return gtpo.masked_mean(self._prompt_once_entropy(out), own, dim=1)   # (n,)
            except UnsharedCache:
                self._shared_prompt = False
        ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
        with disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
            _, entropy, _ = self._get_per_token_logps_and_entropies(
                self.model, ids, torch.cat([out["prompt_mask"], out["completion_mask"]], 1),
                out["completion_ids"].shape[1], batch_size=self.args.per_device_train_batch_size,
                compute_entropy=True, **images)                                     # (n, T)
        return gtpo.masked_mean(entropy, own, dim=1)                                # (n,)

    def _prompt_once_entropy(self, out):
        """Per-token entropies (n, T) from the loop's pass, each prompt once (the sampling policy: no dropout)."""
        p_ids, p_mask = out["prompt_ids"], out["prompt_mask"]                      # (n, P) left-padded
        new_prompt = torch.ones(len(p_ids), dtype=torch.bool, device=p_ids.device)
        new_prompt[1:] = ((p_ids[1:] != p_ids[:-1]) | (p_mask[1:] != p_mask[:-1])).any(dim=1)
        prompt_index = new_prompt.long().cumsum(0) - 1                              # (n,) 0, ..., B-1
        was_training = self.model.training
        self.model.eval()                       # keeps the KV cache the shared prompt needs under gradient checkpointing
        try:
            return sequence_logprobs(self.model, p_ids[new_prompt], p_mask[new_prompt], out["completion_ids"],
                                     out["completion_mask"], prompt_index=prompt_index, temperature=self.temperature)[1]
        finally:
            self.model.train(was_training)
