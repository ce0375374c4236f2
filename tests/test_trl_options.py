"""GRPOConfig's options under GTPOTrainer, as gtpo_trl.config.OPTIONS declares them (skipped without TRL): each that
composes gives GRPOTrainer's losses and gradients with GTPO's own parts off, and other ones with them on; each
refused value raises naming the part of GTPO it would replace; no option is accepted and ignored. Then what a TRL
user passes beside the config: no args, a GRPOConfig, tool output, vLLM's importance sampling, a mixture of experts,
a hybrid Mamba model, one generation per prompt in evaluation, completions no reward function scores.

The runs are 2 optimizer steps of a tiny random model on a fixed rollout (TRL's rollout_func): 2 prompts x G = 4
completions a step, rewards from two functions. In the "distinct" rollout no token is shared at an aligned
position, so no completion has a conflict (lambda = 1): with entropy_filter "off" and gamma 0 GTPO's per-token
advantage is A_i. In the "shared" one every completion starts with the same two tokens: conflicts."""
import dataclasses
import functools
import logging
import os

import pytest
import torch

pytest.importorskip("trl", reason="needs TRL, an optional extra: pip install -r requirements-trl.txt")

from trl import GRPOConfig, GRPOTrainer                                # noqa: E402

import gtpo                                                            # noqa: E402
from gtpo_trl import config as gtpo_config                              # noqa: E402
from gtpo_trl import trainer as gtpo_trainer                            # noqa: E402
from gtpo_trl.config import OPTIONS, OUTSIDE_THE_LOSS, GTPOConfig              # noqa: E402
from gtpo_trl.trainer import GTPOTrainer                                       # noqa: E402
from machinery import models                                                          # noqa: E402

load_tokenizer = functools.lru_cache(models.load_tokenizer)            # one tokenizer for the many runs

G = 4
BASE = dict(num_generations=G, per_device_train_batch_size=2 * G, max_completion_length=8, max_steps=2,
            learning_rate=0.05, loss_type="grpo", logging_steps=1, bf16=False, use_cpu=True, report_to="none",
            save_strategy="no", disable_tqdm=True, seed=0)
OFF = dict(entropy_filter="off", ent_gamma=0.0)                       # GTPO's delta_i and gamma off
LENGTHS, FIRST = (6, 3, 5, 4), (2.0, 0.0, 1.0, 0.5)                   # by a completion's place j in its group


def _rollout(tok, kind, rewards, env_mask=False):
    """TRL's rollout_func: completion j of each group has LENGTHS[j] tokens and the first reward FIRST[j]; those
    with A_i > 0 (j = 0, 2) end with EOS, the others are truncated. "distinct": no token equals another
    completion's at an aligned position; "shared": all start with tokens 7, 8, and j = 1 ends with EOS too (a
    negative completion untruncated). env_mask: the tokens after the first and before the last of j = 0 and 1 are
    tool output (TRL's env_mask, which it makes its tool_mask)."""
    def rollout(prompts, trainer):
        g = trainer.num_generations if trainer.model.training else trainer.num_generations_eval
        out = {"prompt_ids": [tok(p)["input_ids"] for p in prompts], "completion_ids": [], "logprobs": None}
        masks = []
        for r in range(len(prompts)):
            j = r % g
            ids = [1000 + 97 * r + t for t in range(LENGTHS[j])]
            if kind == "shared":
                ids[:2] = [7, 8]
            if j in (0, 2) or kind == "shared" and j == 1:
                ids[-1] = tok.eos_token_id
            rewards[tuple(ids)] = FIRST[j]
            out["completion_ids"].append(ids)
            masks.append([0 if j < 2 and 0 < t < LENGTHS[j] - 1 else 1 for t in range(LENGTHS[j])])
        if env_mask:
            out["env_mask"] = masks
        return out
    return rollout


def _train(model_dir, method, kind="distinct", env_mask=False, rewards=None, eval_dataset=None, cls=None, **kw):
    """2 optimizer steps from the model folder -> ([logged loss per step], [{parameter: gradient} per step], the
    trainer). rewards: the reward functions (default: FIRST's, and 0.1 x length, whose signs agree in a group);
    cls: the trainer class (default: method's)."""
    from datasets import Dataset
    from transformers import TrainerCallback
    tok = load_tokenizer(model_dir)
    table, steps = {}, []

    class Grads(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **_):
            steps.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})

    def first(completion_ids, **_):
        return [table[tuple(ids)] for ids in completion_ids]

    def second(completion_ids, **_):
        return [0.1 * len(ids) for ids in completion_ids]
    config, trainer = {"grpo": (GRPOConfig, GRPOTrainer), "gtpo": (GTPOConfig, GTPOTrainer)}[method]
    args = config(output_dir=f"/tmp/gtpo-options-{method}", **{**BASE, **kw})
    torch.manual_seed(0)
    t = (cls or trainer)(model=model_dir, processing_class=tok, reward_funcs=rewards or [first, second], args=args,
                         callbacks=[Grads()], train_dataset=_dataset(), eval_dataset=eval_dataset,
                         rollout_func=_rollout(tok, kind, table, env_mask))
    t.train()
    return [row["loss"] for row in t.state.log_history if "loss" in row], steps, t


def _dataset():
    from datasets import Dataset
    return Dataset.from_list([{"prompt": f"question {i}"} for i in range(8)])


def _equal(a, b, what):
    assert len(a[0]) == len(b[0]) == 2 and len(a[1]) == len(b[1]) == 2, what
    assert a[0] == pytest.approx(b[0], rel=1e-5, abs=1e-7), what
    for ga, gb in zip(a[1], b[1]):
        assert ga.keys() == gb.keys() and ga, what
        for n in ga:
            torch.testing.assert_close(ga[n], gb[n], atol=1e-5, rtol=1e-5, msg=lambda m: f"{what} {n}: {m}")


def _moved(a, b):
    return a[0] != b[0] or any(not torch.equal(x[n], y[n]) for x, y in zip(a[1], b[1]) for n in x)


TRIALS = [(name, trial) for name, option in OPTIONS.items() if not isinstance(option.trials, str)
          for trial in option.trials]


@pytest.mark.parametrize("name,trial", TRIALS, ids=[f"{n}={t[n]}" for n, t in TRIALS])
def test_composing_option_gives_grpos_result_with_gtpos_parts_off(tiny_model_dir, name, trial):
    """With the option set: GTPOTrainer with lambda = 1 (no conflicts), delta_i off and gamma 0 gives GRPOTrainer's
    loss and gradients at each step (1e-5) and logs every metric it logs; with GTPO's defaults and conflicts it
    gives others; and the option moves GTPOTrainer's result against the same run without it (it is not accepted
    and ignored)."""
    off, grpo = _train(tiny_model_dir, "gtpo", **trial, **OFF), _train(tiny_model_dir, "grpo", **trial)
    _equal(off[:2], grpo[:2], name)
    logged = [set(r[2].state.log_history[0]) for r in (off, grpo)]
    assert logged[1] <= logged[0], logged[1] - logged[0]               # every metric TRL logs (clip ratios, ...)
    on = _train(tiny_model_dir, "gtpo", "shared", **trial)
    assert on[2].state.log_history[0]["gtpo/conflict_frac"] > 0
    assert _moved(on[:2], _train(tiny_model_dir, "grpo", "shared", **trial)[:2]), name
    without = {k: v for k, v in trial.items() if k != name}
    assert _moved(on[:2], _train(tiny_model_dir, "gtpo", "shared", **without)[:2]), f"{name} is ignored"


def test_every_option_touching_the_loss_is_declared_once():
    """Every field GRPOConfig adds to TrainingArguments is in OPTIONS or OUTSIDE_THE_LOSS, not both; an option has
    trials, or names the test here that covers it, or says why none runs here; a refused one names the part it
    replaces and the values that compose."""
    from transformers import TrainingArguments
    own = {f.name for f in dataclasses.fields(GRPOConfig)} - {f.name for f in dataclasses.fields(TrainingArguments)}
    assert own | {"use_liger_kernel"} == set(OPTIONS) | set(OUTSIDE_THE_LOSS)
    assert not set(OPTIONS) & set(OUTSIDE_THE_LOSS)
    for name, option in OPTIONS.items():
        if isinstance(option.trials, str) and "::" in option.trials:
            assert option.trials.split("::")[1] in globals(), name
        elif not isinstance(option.trials, str):
            assert option.trials or option.replaces, name
            assert all(name in trial for trial in option.trials), name
        assert (option.replaces is None) == (not option.allowed), name


REFUSED = [("loss_type", "cispo"), ("loss_type", "sapo"), ("loss_type", "vespo"),
           ("importance_sampling_level", "sequence"), ("entropy_coef", 0.01), ("use_adaptive_entropy", True),
           ("sapo_temperature_neg", 2.0), ("vespo_k_pos", 1.0), ("entropy_target", 0.5)]


@pytest.mark.parametrize("name,value", REFUSED)
def test_refused_option_names_the_part_it_replaces(tmp_path, name, value):
    part = OPTIONS[name].replaces
    assert part in (gtpo_config.SURROGATE, gtpo_config.ENTROPY)
    with pytest.raises(ValueError) as e:
        GTPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, **{name: value})
    assert str(e.value).startswith(f"GTPOConfig: {name}={value!r} replaces {part}, which GTPO defines; use ")
    GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, **{name: value})   # TRL itself takes it


def test_per_token_advantages_leave_tool_output_out_of_the_counts():
    """A tool's output inside completions aligns positions (a shared span runs through it) but is not the
    policy's: lambda is given on it (TRL's mask keeps it out of the loss) and the conflict count and
    conflict_frac leave it out. One group: 2 positive and 2 negative completions sharing their first 3 tokens,
    the second of which is tool output in every row."""
    ids = torch.tensor([[7, 8, 9, 10, 11], [7, 8, 9, 12, 13], [7, 8, 9, 14, 15], [7, 8, 9, 16, 17]])
    mask = torch.ones_like(ids)
    own = mask.clone()
    own[:, 1] = 0
    adv, h = torch.tensor([1.0, 1.0, -1.0, -1.0]), torch.zeros(4)
    objective = gtpo.Objective(conflict_norm=True, ent_gamma=0.0)
    per_token, m = gtpo_trainer.per_token_advantages(ids, mask, adv, h, 4,
                                                       objective, "off", own)
    # the span is tokens 0-2 whatever the tool output; 2 of them are the policy's: lambda A / 2 on them
    torch.testing.assert_close(per_token, torch.tensor([[1.0, 1.0, 1.0, 0.5, 0.5]] * 2 + [[0.0, 0.0, 0.0, -0.5, -0.5]] * 2))
    assert m["gtpo/conflict_frac"] == pytest.approx(8 / 16)             # 2 of each row's 4 own tokens
    _, all_tokens = gtpo_trainer.per_token_advantages(ids, mask, adv, h, 4, objective, "off")
    assert all_tokens["gtpo/conflict_frac"] == pytest.approx(12 / 20)


def test_tool_output_is_out_of_the_loss(tiny_model_dir):
    """Tool output (rollout_func's env_mask, TRL's tool_mask) with GTPO's parts off gives GRPOTrainer's result and
    moves it against the same run without tool output; with GTPO's defaults <H>_i is the mean over the policy's
    own tokens, as TRL's own forward gives it (the prompt-once pass checked against that forward, on the recorded
    batch, the head made peaked so that token entropies differ)."""
    _equal(_train(tiny_model_dir, "gtpo", env_mask=True, **OFF)[:2],
           _train(tiny_model_dir, "grpo", env_mask=True)[:2], "tool_mask")
    seen = {}

    class Recording(GTPOTrainer):
        def _mean_entropy(self, out, own=None):
            seen.setdefault("out", dict(out)), seen.setdefault("own", own)
            return super()._mean_entropy(out, own)
    with_tools = _train(tiny_model_dir, "gtpo", "shared", env_mask=True, cls=Recording)
    assert _moved(with_tools[:2], _train(tiny_model_dir, "gtpo", "shared")[:2])
    t, out, own = with_tools[2], seen["out"], seen["own"]
    assert (own < out["completion_mask"]).any()
    with torch.no_grad():
        t.model.get_output_embeddings().weight.mul_(30)                # a peaked head: entropies that differ
        _, ent, _ = t._get_per_token_logps_and_entropies(
            t.model, torch.cat([out["prompt_ids"], out["completion_ids"]], 1),
            torch.cat([out["prompt_mask"], out["completion_mask"]], 1), out["completion_ids"].shape[1],
            compute_entropy=True)
    mine = t._mean_entropy(out, own)
    torch.testing.assert_close(mine, gtpo.masked_mean(ent, own, dim=1), atol=1e-4, rtol=1e-4)
    assert not torch.allclose(mine, gtpo.masked_mean(ent, out["completion_mask"], dim=1), atol=1e-3)


def test_vllm_importance_sampling_multiplies_gtpos_terms(tiny_model_dir):
    """vLLM's importance-sampling correction (TRL multiplies each token's term by the ratio it computed at
    generation, whichever vllm_importance_sampling_mode and clip made it) reaches GTPO's loss as GRPO's: the same
    loss and gradients with GTPO's parts off, given the same batch and ratios, and another loss without it. No
    vLLM here: the trainers are told vLLM generated the batch."""
    tok = load_tokenizer(tiny_model_dir)
    g = torch.Generator().manual_seed(0)
    n, T = 2 * G, 6
    mask = (torch.arange(T)[None] < torch.tensor([6, 3, 5, 4] * 2)[:, None]).long()
    inputs = {"prompt_ids": torch.randint(5, 1000, (n, 4), generator=g), "prompt_mask": torch.ones(n, 4, dtype=torch.long),
              "completion_ids": torch.randint(5, 1000, (n, T), generator=g), "completion_mask": mask,
              "importance_sampling_ratio": torch.rand(n, T, generator=g) + 0.5, "num_items_in_batch": mask.sum()}
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5] * 2)
    results = {}
    for method, config, trainer in (("grpo", GRPOConfig, GRPOTrainer), ("gtpo", GTPOConfig, GTPOTrainer)):
        for correction in (True, False):
            args = config(output_dir="/tmp/gtpo-vllm", **{**BASE, **(OFF if method == "gtpo" else {})})
            t = trainer(model=tiny_model_dir, processing_class=tok, args=args, train_dataset=_dataset(),
                        reward_funcs=[lambda completions, **_: [0.0] * len(completions)])
            t.use_vllm, t.vllm_importance_sampling_correction = True, correction
            t.current_gradient_accumulation_steps = 1
            per_token = adv[:, None] * mask if method == "gtpo" else adv        # GTPO's A_{i,t}, lambda = 1
            loss = t._compute_loss(t.model, {**inputs, "advantages": per_token})
            loss.backward()
            results[method, correction] = loss.item(), {k: p.grad for k, p in t.model.named_parameters()
                                                        if p.grad is not None}
    for correction in (True, False):
        (a, ga), (b, gb) = results["gtpo", correction], results["grpo", correction]
        assert a == pytest.approx(b, rel=1e-6) and ga.keys() == gb.keys()
        for k in ga:
            torch.testing.assert_close(ga[k], gb[k], atol=1e-6, rtol=1e-5)
    assert results["gtpo", True][0] != pytest.approx(results["gtpo", False][0], rel=1e-3)


def _saved(model, tmp_path, name, tiny_model_dir):
    d = tmp_path / name
    model.save_pretrained(d)
    load_tokenizer(tiny_model_dir).save_pretrained(d)
    return str(d)


def test_moe_model_trains_with_its_router_loss(tiny_model_dir, tmp_path):
    """A tiny Qwen3-MoE (4 experts, router logits on): GTPOTrainer adds the router load-balancing loss and logs
    aux_loss as GRPOTrainer does (GTPO's parts off: the same losses and gradients), and router_aux_loss_coef moves
    GTPOTrainer's result."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig
    tok = load_tokenizer(tiny_model_dir)
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                         num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.01,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    moe = _saved(AutoModelForCausalLM.from_config(cfg), tmp_path, "moe", tiny_model_dir)
    off = _train(moe, "gtpo", **OFF)
    _equal(off[:2], _train(moe, "grpo")[:2], "moe")
    logged = [row for row in off[2].state.log_history if "loss" in row]
    assert all(row["aux_loss"] > 0 for row in logged)
    on = _train(moe, "gtpo", "shared")
    assert _moved(on[:2], _train(moe, "gtpo", "shared", router_aux_loss_coef=0.5)[:2])


def test_hybrid_mamba_model_trains(tiny_model_dir, tmp_path):
    """A tiny NemotronH (a Mamba layer and an attention layer): its cache holds recurrent state, so <H>_i comes from
    TRL's own forward (the prompt-once pass refuses it: UnsharedCache); 2 GTPO steps with conflicts train, and
    with GTPO's parts off they give GRPOTrainer's result."""
    from transformers import AutoModelForCausalLM, NemotronHConfig
    tok = load_tokenizer(tiny_model_dir)
    torch.manual_seed(0)
    cfg = NemotronHConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, hybrid_override_pattern="M*",
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, mamba_num_heads=4,
                          mamba_head_dim=8, ssm_state_size=8, n_groups=1, intermediate_size=32, mamba_chunk_size=8,
                          pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    hybrid = _saved(AutoModelForCausalLM.from_config(cfg), tmp_path, "hybrid", tiny_model_dir)
    on = _train(hybrid, "gtpo", "shared")
    assert on[2]._shared_prompt is False and on[2].state.log_history[0]["gtpo/conflict_frac"] > 0
    assert all(torch.isfinite(g).all() for step in on[1] for g in step.values())
    _equal(_train(hybrid, "gtpo", **OFF)[:2], _train(hybrid, "grpo")[:2], "hybrid")


def test_evaluation_with_one_generation_per_prompt(tiny_model_dir):
    """num_generations_eval=1: every completion is its own group (A_i = 0, no conflicts); evaluation runs and logs
    GTPO's metrics, and its loss is GRPOTrainer's with GTPO's parts off."""
    kw = dict(num_generations_eval=1, eval_strategy="steps", eval_steps=1, per_device_eval_batch_size=2)
    off, grpo = (_train(tiny_model_dir, m, eval_dataset=_dataset(), **kw, **(OFF if m == "gtpo" else {}))
                 for m in ("gtpo", "grpo"))
    evals = [[row for row in r[2].state.log_history if "eval_loss" in row] for r in (off, grpo)]
    assert len(evals[0]) == 2 and [r["eval_loss"] for r in evals[0]] == pytest.approx([r["eval_loss"] for r in evals[1]])
    assert all(r["eval_gtpo/conflict_frac"] == 0 for r in evals[0])


def test_completions_no_reward_scores_get_zero_advantage_and_are_counted(tiny_model_dir, caplog):
    """A completion every reward function scores None: TRL warns and gives it A_i = 0; GTPOTrainer trains on as
    GRPOTrainer does (GTPO's parts off: the same losses and gradients) and logs the share as gtpo/unscored_frac."""
    def some_none(completion_ids, **_):                                 # the j = 3 completions: None
        return [None if len(ids) == LENGTHS[3] else FIRST[LENGTHS.index(len(ids))] for ids in completion_ids]
    with caplog.at_level(logging.WARNING):
        off = _train(tiny_model_dir, "gtpo", rewards=[some_none], **OFF)
    assert "All reward functions returned None" in caplog.text
    _equal(off[:2], _train(tiny_model_dir, "grpo", rewards=[some_none])[:2], "unscored")
    assert off[2].state.log_history[0]["gtpo/unscored_frac"] == pytest.approx(0.25)


def test_no_args_and_a_grpoconfig(tiny_model_dir, tmp_path, monkeypatch, caplog):
    """GTPOTrainer(model, reward_funcs, train_dataset) without args takes GTPOConfig("<model>-GTPO") with GTPO's
    defaults; a GRPOConfig is converted field by field, its loss_type kept, in one logged line naming GTPO's
    settings; a GRPOConfig with a refused option is refused as GTPOConfig refuses it."""
    import transformers.training_args
    monkeypatch.chdir(tmp_path)
    tok = load_tokenizer(tiny_model_dir)
    reward = [lambda completions, **_: [0.0] * len(completions)]
    with pytest.raises(ValueError) as ours:                            # CPU: TRL's default bf16 refused, as
        GTPOTrainer(model=tiny_model_dir, reward_funcs=reward, train_dataset=_dataset(), processing_class=tok)
    with pytest.raises(ValueError) as trls:                            # GRPOTrainer refuses it
        GRPOTrainer(model=tiny_model_dir, reward_funcs=reward, train_dataset=_dataset(), processing_class=tok)
    assert str(ours.value) == str(trls.value) and "bf16" in str(ours.value)
    monkeypatch.setattr(transformers.training_args, "is_torch_bf16_gpu_available", lambda: True)   # as on a GPU
    t = GTPOTrainer(model=tiny_model_dir, reward_funcs=reward, train_dataset=_dataset(), processing_class=tok)
    assert isinstance(t.args, GTPOConfig) and os.path.basename(t.args.output_dir) == os.path.basename(
        tiny_model_dir) + "-GTPO" and t.objective == gtpo.DEFAULT
    assert t.args.bf16 and t.loss_type == "grpo"
    given = GRPOConfig(output_dir=str(tmp_path / "g"), num_generations=4, learning_rate=3e-5, steps_per_generation=2,
                       per_device_train_batch_size=4, epsilon_high=0.28, use_cpu=True, bf16=False, report_to="none")
    with caplog.at_level(logging.WARNING, logger="gtpo_trl"):
        t = GTPOTrainer(model=tiny_model_dir, reward_funcs=reward, train_dataset=_dataset(), processing_class=tok,
                        args=given)
    assert isinstance(t.args, GTPOConfig)
    for f in dataclasses.fields(GRPOConfig):
        if f.init and f.name not in ("generation_batch_size",):
            assert getattr(t.args, f.name) == getattr(given, f.name), f.name
    assert t.args.generation_batch_size == given.generation_batch_size and t.args.loss_type == "dapo"
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("gtpo_trl")]
    assert len(lines) == 1 and "loss_type='dapo'" in lines[0] and "conflict_weight=2.0" in lines[0]
    with pytest.raises(ValueError, match="GTPOConfig: entropy_coef=0.1 replaces the entropy term"):
        GTPOTrainer(model=tiny_model_dir, reward_funcs=reward, train_dataset=_dataset(), processing_class=tok,
                    args=GRPOConfig(output_dir=str(tmp_path / "h"), entropy_coef=0.1, use_cpu=True, bf16=False))


def test_disable_dropout_reaches_the_model(tiny_model_dir, tmp_path):
    """disable_dropout sets every torch.nn.Dropout of the policy to p = 0 (GRPOTrainer's own step, which GTPOTrainer
    keeps): a tiny GPT-2, whose dropouts are such modules (Llama's attention dropout is a number, not one)."""
    from transformers import AutoModelForCausalLM, GPT2Config
    tok = load_tokenizer(tiny_model_dir)
    cfg = GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=1, n_head=2, resid_pdrop=0.3, embd_pdrop=0.3,
                     attn_pdrop=0.3, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    gpt2 = _saved(AutoModelForCausalLM.from_config(cfg), tmp_path, "gpt2", tiny_model_dir)
    for disable in (False, True):
        args = GTPOConfig(output_dir=str(tmp_path / "out"), disable_dropout=disable, **BASE)
        t = GTPOTrainer(model=gpt2, processing_class=tok, train_dataset=_dataset(), args=args,
                        reward_funcs=[lambda completions, **_: [0.0] * len(completions)])
        p = {m.p for m in t.model.modules() if isinstance(m, torch.nn.Dropout)}
        assert p == ({0} if disable else {0.3}), disable


def options_table():
    """docs/trl.md's table of GRPOConfig's options, made from OPTIONS."""
    rows = ["| `GRPOConfig` option | with GTPO | acts on | what GTPOTrainer does with it |", "|---|---|---|---|"]
    for name, o in OPTIONS.items():
        if o.replaces is None:
            verdict, what = "composes", o.gtpo
        else:
            verdict = ("refused: " + ", ".join(f"`{v}`" for v in o.refused) if o.refused else
                       "refused unless " + " or ".join(f"`{v!r}`" for v in o.allowed))
            what = (o.gtpo + "; " if o.gtpo != "refused" and not o.gtpo.startswith("refused ") else "") + \
                f"would replace {o.replaces}"
        rows.append(f"| `{name}` | {verdict} | {o.part} | {what} |".replace("<H>", "⟨H⟩"))
    return "\n".join(rows)


def test_the_pages_table_is_the_declaration():
    """docs/trl.md's options table is OPTIONS, row for row (print(options_table()) writes it)."""
    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "trl.md")) as f:
        assert options_table() in f.read(), "docs/trl.md: replace the options table with tests/test_trl_options.options_table()"
