"""GTPOConfig: GRPOConfig plus the objective's settings GTPO reads, made from gtpo.Objective's declarations (train.py's
names, defaults, help and refusals); and OPTIONS, what GTPO does with every GRPOConfig field that touches the loss:
it composes where it acts on a part GTPO keeps from GRPO; where it would replace a part GTPO defines, GTPOConfig
refuses it naming that part."""
import dataclasses
import logging
import warnings
from typing import NamedTuple

import gtpo

logger = logging.getLogger(__name__)

# TRL 1.16 calls transformers' gradient_checkpointing names, which transformers 5 renamed (FutureWarning each)
warnings.filterwarnings("ignore", message=r"`(is_)?gradient_checkpointing\w*` is deprecated", category=FutureWarning)

try:
    from trl import GRPOConfig
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


