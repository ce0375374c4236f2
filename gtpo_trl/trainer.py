"""GTPO for TRL users: GTPOConfig and GTPOTrainer on TRL's GRPOTrainer (pip install ".[trl]", docs/trl.md).

    from gtpo_trl import GTPOConfig, GTPOTrainer
    trainer = GTPOTrainer(model=model, processing_class=tok, reward_funcs=[reward],
                          args=GTPOConfig(output_dir="out", num_generations=8), train_dataset=ds)
    trainer.train()                       # launch with accelerate / DeepSpeed as for GRPOTrainer

GTPOConfig is GRPOConfig plus the objective's settings GTPO reads, made from gtpo.Objective's declarations:
train.py's names, defaults, help and refusals. GTPOTrainer keeps what GTPO takes from GRPO and replaces what GTPO
defines, with gtpo.py's functions, as train.py's loop calls them:
  * TRL generates, scores and computes Eq. 8's A_i, with every option that acts on it (reward weights, their
    aggregation, scale_rewards; a completion no reward function scored gets A_i = 0); a group whose rewards are
    all equal gets exactly 0;
  * each token then gets A_{i,t} = lambda_{i,t} * delta_i * A_i over its whole group, every process's completions
    (Eq. 5-6; divided by its conflict count with conflict_norm), delta_i from <H>_i of a no-grad pass of the
    current policy over the tokens it wrote (tool output out); with entropy_term="released" (the default) Eq. 7's
    -gamma <H>_i is folded in, A_{i,t} = lambda_{i,t} * delta_i * (A_i - gamma <H>_i), as the released code does;
  * the loss is TRL's on those advantages: the clipped surrogate min(r A_{i,t}, clip(r) A_{i,t}) -- Eq. 7, whose
    one iteration (r = 1, the paper's) gives GTPO's gradient, Eq. 22 -- with TRL's KL term, token masks,
    importance sampling, normalisation (loss_type) and MoE router loss; entropy_term="eq7" adds +gamma <H>_i for
    every completion with its gradient through TRL's entropies, as Eq. 7 is written.
OPTIONS says, for every GRPOConfig field that touches the loss, what GTPO does with it: it composes where it acts on
a part GTPO keeps from GRPO; where it would replace a part GTPO defines, GTPOConfig refuses it naming that part.
Every process makes the same model calls whatever its completions, so DeepSpeed ZeRO and FSDP see matching
collectives. Logs gtpo/conflict_frac, gtpo/filtered_frac, gtpo/filtered_entropy, gtpo/mean_weight,
gtpo/unscored_frac (and gtpo/h_ini with "auto") beside TRL's metrics.

    python -m gtpo_trl --example                   # 20 GTPO steps of the embedded model on the arithmetic task, CPU
    python -m gtpo_trl --example --method grpo --max_steps 5    # TRL's GRPOTrainer, same settings
    python -m gtpo_trl --config recipe.yaml        # TRL's `trl grpo` command line (gtpo_trl/cli.py)
"""
import dataclasses
import json
import logging
import math
import os
import warnings
from typing import NamedTuple

import torch

import gtpo
from speedups.logprobs import UnsharedCache, sequence_logprobs

logger = logging.getLogger(__name__)

# TRL 1.16 calls transformers' gradient_checkpointing names, which transformers 5 renamed (FutureWarning each)
warnings.filterwarnings("ignore", message=r"`(is_)?gradient_checkpointing\w*` is deprecated", category=FutureWarning)

try:
    from trl import GRPOConfig, GRPOTrainer
    from trl.models.utils import disable_gradient_checkpointing
except ImportError as e:                                           # TRL is optional for the rest of the project
    raise ImportError("gtpo_trl needs TRL: pip install 'gtpo[trl]' (in a clone: pip install -r requirements-trl.txt)") from e

# -----------------------------------------------------------------------------
# every GRPOConfig field that touches the loss: composes with GTPO, or (some values) refused

SURROGATE = ("the per-token surrogate min(r A_{i,t}, clip(r) A_{i,t}) that weighs each token by its own advantage "
             "(Eq. 7)")
ENTROPY = "the entropy term -gamma <H>_i (Eq. 7)"
CLIP, KL = "the PPO ratio and clip (Eq. 1)", "the KL term beta KL (Eq. 1)"
ADVANTAGE, MASKS = "the reward and its advantage (Eq. 8)", "which tokens reach the loss, and their weight"
FORWARD = "the policy's forward"


class Option(NamedTuple):
    """A GRPOConfig field that touches the loss. part: what of GRPO's objective it acts on; gtpo: what GTPOTrainer
    does with it; replaces: the part of GTPO its refused values would replace (None: every value composes), allowed:
    the values that compose then, refused: the values refused (None: every other one); trials: values that make it
    act, each with the options it needs (the tests run GRPOTrainer and GTPOTrainer on each), or the test that
    covers it where a trial cannot run there."""
    part: str
    gtpo: str
    replaces: str = None
    allowed: tuple = ()
    trials: object = ()
    refused: tuple = None

    def refuses(self, value):
        return self.replaces is not None and (value in self.refused if self.refused else value not in self.allowed)


def _refused_unless_default(part, replaces):
    """An option read only by a refused one (SAPO's and VESPO's constants, the adaptive entropy's bounds)."""
    return lambda name: Option(part, "refused off its default", replaces,
                               (GRPOConfig.__dataclass_fields__[name].default,))


_sapo = _refused_unless_default("SAPO's surrogate", SURROGATE)
_vespo = _refused_unless_default("VESPO's surrogate", SURROGATE)
_adaptive = _refused_unless_default("TRL's adaptive entropy bonus", ENTROPY)
_two = {"num_iterations": 2}                      # a second pass over a generation: r != 1, so the clip can act
_sync = {"beta": 0.5, "sync_ref_model": True, "ref_model_sync_steps": 1}     # the reference moves after step 1
OPTIONS = {
    "num_iterations": Option(CLIP, "each generation is trained num_iterations times; the clip acts on every token's "
                             "lambda-weighted advantage (one iteration, the paper's, makes r = 1: Eq. 22)",
                             trials=(_two,)),
    "steps_per_generation": Option(CLIP, "a generation spread over several optimizer steps; r != 1 after the first",
                                   trials=({"per_device_train_batch_size": 4, "steps_per_generation": 2},)),
    "generation_batch_size": Option(CLIP, "as steps_per_generation",
                                    trials=({"per_device_train_batch_size": 4, "generation_batch_size": 8},)),
    "epsilon": Option(CLIP, "the clip's range, on every token whatever its lambda",
                      trials=({**_two, "epsilon": 0.01},)),
    "epsilon_high": Option(CLIP, "the clip's upper range (A_{i,t} > 0)", trials=({**_two, "epsilon_high": 0.01},)),
    "delta": Option(CLIP, "caps r from above (two-sided clip)", trials=({**_two, "delta": 1.01},)),
    "beta": Option(KL, "added to GTPO's per-token terms (the paper's GTPO has none: 0, the default)",
                   trials=({"beta": 0.5},)),
    "use_bias_correction_kl": Option(KL, "as in GRPO",
                                     trials=({**_two, "beta": 0.5, "use_bias_correction_kl": False},)),
    "sync_ref_model": Option(KL, "as in GRPO", trials=({**_sync},)),
    "ref_model_sync_steps": Option(KL, "as in GRPO", trials=({**_sync},)),
    "ref_model_mixup_alpha": Option(KL, "as in GRPO", trials=({**_sync, "ref_model_mixup_alpha": 0.1},)),
    "num_generations": Option(ADVANTAGE, "G, the group GTPO compares completions in (Eq. 5)",
                              trials=({"num_generations": 2},)),
    "num_generations_eval": Option(ADVANTAGE, "G in evaluation; 1 gives every completion A_i = 0: no conflicts",
                                   trials="tests/test_trl_options.py::test_evaluation_with_one_generation_per_prompt"),
    "reward_weights": Option(ADVANTAGE, "A_i from the weighted rewards; lambda from its sign",
                             trials=({"reward_weights": [1.0, 0.25]},)),
    "multi_objective_aggregation": Option(ADVANTAGE, "A_i as TRL aggregates it; lambda from its sign",
                                          trials=({"multi_objective_aggregation": "normalize_then_sum"},)),
    "scale_rewards": Option(ADVANTAGE, "A_i as TRL scales it (group = Eq. 8, none = the released code, batch)",
                            trials=({"scale_rewards": "batch"},)),
    "loss_type": Option("how per-token terms become the loss", "grpo = Eq. 7's normalisation (the default), dapo, "
                        "dr_grpo, bnpo, luspo normalise GTPO's terms (gtpo.aggregate); cispo, sapo and vespo are "
                        "surrogates of their own", SURROGATE, gtpo.LOSS_TYPES,
                        tuple({"loss_type": t} for t in gtpo.LOSS_TYPES if t != "grpo"), ("cispo", "sapo", "vespo")),
    "max_completion_length": Option("dr_grpo's constant length", "as in GRPO",
                                    trials=({"loss_type": "dr_grpo", "max_completion_length": 64},)),
    "importance_sampling_level": Option(CLIP, "sequence (GSPO) is one ratio per completion", SURROGATE, ("token",)),
    "mask_truncated_completions": Option(MASKS, "a truncated completion has no tokens: no advantage, no conflicts",
                                         trials=({"mask_truncated_completions": True},)),
    "top_entropy_quantile": Option(MASKS, "masks TRL's low-entropy tokens out of GTPO's terms; <H>_i stays every "
                                   "token's mean", trials=({"top_entropy_quantile": 0.5},)),
    "off_policy_mask_threshold": Option(MASKS, "masks completions with A_{i,t} < 0 that drifted",
                                        trials=({**_two, "off_policy_mask_threshold": 1e-4},)),
    "max_tool_calling_iterations": Option(MASKS, "tool output (tool_mask) aligns positions for the conflict spans but "
                                          "is out of the loss, <H>_i and the conflict counts",
                                          trials="tests/test_trl_options.py::test_tool_output_is_out_of_the_loss"),
    **{name: Option(MASKS, "vLLM's importance-sampling correction multiplies GTPO's per-token terms as GRPO's",
                    trials="tests/test_trl_options.py::test_vllm_importance_sampling_multiplies_gtpos_terms")
       for name in ("vllm_importance_sampling_correction", "vllm_importance_sampling_mode",
                    "vllm_importance_sampling_clip_max", "vllm_importance_sampling_clip_min",
                    "vllm_importance_sampling_cap")},
    "temperature": Option(FORWARD, "log-probs and <H>_i of softmax(logits / T), the distribution sampled",
                          trials=({"temperature": 0.7},)),
    "router_aux_loss_coef": Option(FORWARD, "a mixture of experts' router loss, added and logged (aux_loss)",
                                   trials="tests/test_trl_options.py::test_moe_model_trains_with_its_router_loss"),
    "cast_lm_head_to_fp32": Option(FORWARD, "as in GRPO (<H>_i's own pass runs the head in fp32 always)",
                                   trials=({"model_init_kwargs": {"dtype": "bfloat16"}, "cast_lm_head_to_fp32": True},)),
    "disable_dropout": Option(FORWARD, "as in GRPO (<H>_i's own pass runs without dropout always)",
                              trials="tests/test_trl_options.py::test_disable_dropout_reaches_the_model"),
    "use_liger_kernel": Option(FORWARD, "Liger's layer kernels, as in GRPO (TRL 1.16 applies no fused loss)",
                               trials="not run here: it needs the liger-kernel package and a GPU"),
    "sapo_temperature_neg": _sapo("sapo_temperature_neg"), "sapo_temperature_pos": _sapo("sapo_temperature_pos"),
    **{name: _vespo(name) for name in ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg")},
    "entropy_coef": Option("TRL's entropy bonus", "refused", ENTROPY, (0.0,)),
    "use_adaptive_entropy": Option("TRL's adaptive entropy bonus", "refused", ENTROPY, (False,)),
    **{name: _adaptive(name) for name in ("entropy_coef_min", "entropy_coef_max", "entropy_coef_delta",
                                          "entropy_target")},
}
# the rest of GRPOConfig acts before GTPO sees a completion (sampling, vLLM, the data) or beside it (logging)
OUTSIDE_THE_LOSS = (
    "model_init_kwargs", "trust_remote_code", "ds3_gather_for_generation", "shuffle_dataset", "pad_to_multiple_of",
    "top_p", "top_k", "min_p", "generation_kwargs", "chat_template_kwargs", "repetition_penalty", "cache_implementation",
    "use_vllm", "vllm_mode", "vllm_model_impl", "vllm_enable_sleep_mode", "vllm_structured_outputs_regex",
    "vllm_server_base_url", "vllm_server_host", "vllm_server_port", "vllm_server_timeout", "vllm_group_port",
    "vllm_gpu_memory_utilization", "vllm_max_model_length", "vllm_tensor_parallel_size", "log_completions",
    "log_multimodal", "num_completions_to_print", "log_unique_prompts", "log_completions_hub_repo",
    "use_transformers_continuous_batching", "transformers_continuous_batching_config", "use_transformers_paged")

# the objective's settings GTPO reads: GTPOConfig's own fields (scale_rewards and loss_type replace TRL's)
SETTINGS = [f for f in dataclasses.fields(gtpo.Objective) if gtpo.GTPO in f.metadata["reads"]]
SCALE = {"group": True, "batch": True, "none": False}   # TRL's scale_rewards (it turns True / False into these)


class _Checks:
    """GTPOConfig's refusals (OPTIONS' refused values, then gtpo.Objective's) and its gtpo.Objective."""

    def __post_init__(self):
        super().__post_init__()
        for name, option in OPTIONS.items():
            value = getattr(self, name)
            if option.refuses(value):
                raise ValueError(f"GTPOConfig: {name}={value!r} replaces {option.replaces}, which GTPO defines; "
                                 f"use {' or '.join(map(repr, option.allowed))}")
        try:
            self.objective()
        except ValueError as e:
            raise ValueError(f"GTPOConfig: {e}") from None

    def objective(self):
        """The gtpo.Objective these settings give. Its scale_rewards records whether A_i is divided by a std (TRL
        computes A_i: "batch" divides by the batch's); beta and the clip are TRL's own fields, read by TRL's loss."""
        values = {f.name: getattr(self, f.name) for f in SETTINGS}
        return gtpo.Objective(**{**values, "scale_rewards": SCALE[self.scale_rewards]})


GTPOConfig = dataclasses.make_dataclass("GTPOConfig", [
    (f.name, f.type, dataclasses.field(default=f.default, metadata={"help": f"{f.metadata['help']} "
                                                                            f"({f.metadata['where']})"}))
    for f in SETTINGS], bases=(_Checks, GRPOConfig))
GTPOConfig.__module__ = "gtpo_trl"                 # TRL pickles its arguments beside each checkpoint: the name users import
GTPOConfig.__doc__ = ("GRPOConfig plus the objective's settings GTPO reads (gtpo.Objective), under train.py's names, "
                      "defaults and checks; a GRPOConfig option that would replace a part of GTPO is refused (OPTIONS).")


def gtpo_config(args, model):
    """GTPOTrainer's args: a GTPOConfig as given; None -> GTPOConfig("<model>-GTPO") (GRPOTrainer's default, named
    for GTPO); a GRPOConfig -> the GTPOConfig with every field it holds and GTPO's settings at their defaults, said
    in one logged line (its loss_type is kept: TRL's default "dapo" is not Eq. 7's "grpo")."""
    if isinstance(args, GTPOConfig):
        return args
    if args is None:
        name = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "") or "model"
        return GTPOConfig(f"{name.rstrip('/').split('/')[-1]}-GTPO")
    if not isinstance(args, GRPOConfig):
        raise TypeError(f"GTPOTrainer: args must be a GTPOConfig (or a GRPOConfig to convert), got "
                        f"{type(args).__name__}")
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(GRPOConfig) if f.init}
    given["generation_batch_size"] = None          # derived again from steps_per_generation, as GRPOConfig did
    converted = GTPOConfig(**given)
    added = ", ".join(f"{f.name}={getattr(converted, f.name)!r}" for f in SETTINGS if f.name not in given)
    logger.warning(f"GTPOTrainer: args is a GRPOConfig; running it as a GTPOConfig with its every field, loss_type="
                   f"{converted.loss_type!r} included, and GTPO's settings {added}")
    return converted


def per_token_advantages(ids, mask, advantages, h, group_size, objective, mode, own=None):
    """Eq. 5 and Eq. 6-7 for whole groups, from gtpo.py's functions, as train.py's loop computes them: Eq. 8's
    advantages -> per-token advantages A_{i,t} = lambda_{i,t} * shaped A_i (/ the conflict count with conflict_norm).

    ids, mask (N, T) right-padded completions, groups of `group_size` consecutive rows; advantages (N,) A_i; h (N,)
    = <H>_i; objective: the gtpo.Objective; mode: delta_i's, "all", "neg" or "off"; own (N, T) or None: the tokens
    the policy wrote
    (mask without tool output), which the conflict counts and metrics count (None: every real token).
    Returns (A (N, T) float32, metrics dict of floats).
    """
    own = mask if own is None else own
    weights, conflict, n_conf = gtpo.batch_conflict_weights(ids, mask, advantages, group_size, objective, own)  # Eq. 5
    shaped = gtpo.shaped_advantages(advantages, h, objective, mode)                 # (N,) Eq. 6-7
    delta = gtpo.filter_deltas(advantages, h, objective.ent_threshold, mode)       # (N,) Eq. 6
    frac, h_dropped = gtpo.filtered_stats(advantages, delta, h, objective) if mode != "off" else (0.0, 0.0)
    ours = own.bool()
    metrics = {"gtpo/conflict_frac": conflict.sum().item() / max(ours.sum().item(), 1),
               "gtpo/filtered_frac": frac, "gtpo/filtered_entropy": h_dropped,
               "gtpo/mean_weight": gtpo.masked_mean(weights, ours).item()}
    return gtpo.token_advantages(weights, n_conf, shaped, objective), metrics


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
    """GRPOTrainer whose advantages are GTPO's per-token ones (per_token_advantages), and whose loss is TRL's on
    them plus Eq. 7's entropy term where it has a gradient; args: a GTPOConfig (None or a GRPOConfig: gtpo_config)."""

    _h_ini = None
    _rewards = None
    _entropies = None
    _shared_prompt = True          # the <H>_i pass runs each prompt once (a key/value cache) until a model refuses

    def __init__(self, model, reward_funcs=None, args=None, *rest, **kw):
        super().__init__(model, reward_funcs, gtpo_config(args, model), *rest, **kw)
        self.objective = self.args.objective()

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        """TRL's rewards of every process's completions (rows in process order), kept for the flat groups."""
        self._rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        return self._rewards

    def _get_per_token_logps_and_entropies(self, *args, **kw):
        """TRL's forward; its entropies are kept for _compute_loss, which reads those of its own call."""
        logps, self._entropies, aux = super()._get_per_token_logps_and_entropies(*args, **kw)
        return logps, self._entropies, aux

    def _compute_loss(self, model, inputs):
        """TRL's loss on the per-token advantages (its clip, KL, masks, normalisation, MoE loss and metrics), plus
        Eq. 7's +gamma <H>_i with its gradient through TRL's entropies where entropy_term is "eq7", aggregated as
        the loss type says (_totals); sum_completions (loss_type "grpo") sums the completions' terms."""
        o, own = self.objective, own_tokens(inputs)                                 # (n, T)
        totals = self._totals(inputs, own)
        scale = totals.completions if o.sum_completions else 1.0                  # Listing 3: no 1/G
        loss = super()._compute_loss(model, {**inputs, "advantages": inputs["advantages"] * scale})
        entropy, self._entropies = self._entropies, None
        if o.entropy_grad("gtpo"):
            h = gtpo.masked_mean(entropy, own, dim=1)                               # (n,) <H>_i, with grad
            term = gtpo.aggregate(torch.zeros_like(entropy), own, o.loss_type, o.ent_gamma * h, totals)
            mode = "train" if self.model.training else "eval"
            undivided = totals.completions / len(own)                               # TRL logs per micro-batch
            self._metrics[mode]["policy_loss"].append(self.accelerator.gather(loss.detach() * undivided).mean().item())
            loss = loss + scale * term
        return loss

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

    def _generate_and_score_completions(self, inputs):
        """TRL's generation, rewards and Eq. 8 advantages, then GTPO's per-token advantages over whole groups."""
        out = super()._generate_and_score_completions(inputs)
        mode = "train" if self.model.training else "eval"
        G = self.num_generations if mode == "train" else self.num_generations_eval
        ids, mask, own = out["completion_ids"], out["completion_mask"], own_tokens(out)   # (n, T) this process
        h = self._mean_entropy(out, own)                                            # (n,) <H>_i, no grad
        acc, pad = self.accelerator, self._tokenizer.pad_token_id                   # whole groups, all processes
        all_ids = acc.gather(acc.pad_across_processes(ids, dim=1, pad_index=pad))
        all_mask, all_own = (acc.gather(acc.pad_across_processes(m, dim=1, pad_index=0)) for m in (mask, own))
        all_h, adv = acc.gather(h), acc.gather(out["advantages"])                   # (N,) each
        if self.multi_objective_aggregation == "sum_then_normalize":               # A_i centred on its group
            adv = flat_groups_to_zero(adv, self._rewards, G)
        per_token, metrics = per_token_advantages(all_ids, all_mask, adv, all_h, G, self.objective,
                                                  self._filter_mode(all_h, mode), all_own)
        rows = slice(acc.process_index * len(ids), (acc.process_index + 1) * len(ids))
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
        """delta_i's mode (Eq. 6, gtpo.Objective.filter_mode): "auto" filters iff <H>_ini < ln 2, <H>_ini = mean <H>_i of the first
        training batch (saved with each checkpoint and restored on resume)."""
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
