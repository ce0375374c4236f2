"""Tests for rollout.py, machinery/config.py and train.py: masks on a tiny random-weight model, one optimizer
step per method, a 2-step run of the embedded model with a resume, and bad flags."""
import dataclasses
import json
import os

import pytest
import torch

import gtpo
import rewards
import step
import train
from speedups import memory_plan
from conftest import HERE, grads
from machinery import data
from machinery.models import load_tokenizer
from rollout import completion_mask, rollout


def test_completion_mask_stops_after_first_eos():
    ids = torch.tensor([[5, 6, 2, 7, 2], [5, 5, 5, 5, 5], [2, 9, 9, 9, 9]])
    mask, truncated = completion_mask(ids, [2])
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]
    assert truncated.tolist() == [False, True, False]
    mask, truncated = completion_mask(ids, [2, 7])                  # several EOS ids
    assert mask[0].tolist() == [1, 1, 1, 0, 0] and not truncated[0]


def test_rollout_on_tiny_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM
    tok = load_tokenizer(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    # make EOS likely so that some completions stop early and others are truncated
    with torch.no_grad():
        model.lm_head.weight[tok.eos_token_id] *= 0
        model.lm_head.bias = None
    torch.manual_seed(3)
    prompts = ["a short prompt", "a somewhat longer prompt with more words in it"]
    ro = rollout(model, tok, prompts, group_size=3, max_new_tokens=12)
    N, L = ro.completion_ids.shape
    assert N == 6 and L <= 12
    enc = tok(prompts, padding=True, return_tensors="pt", add_special_tokens=False)
    assert torch.equal(ro.prompt_ids, enc["input_ids"].repeat_interleave(3, 0))     # groups consecutive
    for i in range(N):
        row, m = ro.completion_ids[i].tolist(), ro.completion_mask[i].tolist()
        n = sum(m)
        assert m == [1] * n + [0] * (L - n)                           # right-padded
        if ro.truncated[i]:
            assert n == L and tok.eos_token_id not in row
        else:
            assert row[n - 1] == tok.eos_token_id and tok.eos_token_id not in row[:n - 1]
            assert all(t == tok.pad_token_id for t in row[n:])


def _run(tmp_path, tiny_args, monkeypatch, *extra):
    # a random model earns no reward; a fake reward that varies within each group makes the
    # advantages non-zero so that every method has a gradient to apply
    def fake_score(texts, answers, task, counts=None):
        r = torch.arange(len(texts), dtype=torch.float32) % 3
        return r, r, torch.zeros_like(r)
    monkeypatch.setattr(rewards, "reward", fake_score)
    out = str(tmp_path / "run")
    argv = tiny_args(out, max_steps=1, max_completion_length=8, lr=1e-2, optimizer="adamw_torch", adam_beta1=0.9,
                     adam_beta2=0.95, warmup_ratio=0) + list(extra)
    assert train.main(argv) == 0
    from safetensors.torch import load_file
    return out, load_file(os.path.join(out, "final", "adapter_model.safetensors"))


@pytest.mark.parametrize("method", [["--use_gtpo"], ["--use_grpo", "--beta", "0.04"], ["--use_sft"]])
def test_one_step_changes_lora_weights(tmp_path, tiny_args, monkeypatch, method):
    out, w = _run(tmp_path, tiny_args, monkeypatch, *method)
    lora_b = [v for k, v in w.items() if "lora_B" in k]
    assert lora_b and any(v.abs().sum() > 0 for v in lora_b)         # B starts at exactly 0
    rows = _rows(out)
    assert len(rows) == 1 and rows[0]["step"] == 1
    if method[0] != "--use_sft":
        for k in ("reward", "reward_std", "rewards/format", "rewards/accuracy", "frac_reward_zero_std",
                  "entropy", "completions/mean_length", "completions/clipped_ratio", "loss", "grad_norm", "lr"):
            assert k in rows[0], k
    if method[0] == "--use_grpo":
        assert rows[0]["kl"] == pytest.approx(0.0, abs=1e-6)          # policy == reference at step 1
    if method[0] == "--use_gtpo":
        assert {"gtpo/conflict_frac", "gtpo/filtered_frac", "gtpo/filtered_entropy"} <= rows[0].keys()


def test_grpo_reference_after_init_from_is_the_starting_adapter(tmp_path, tiny_args, monkeypatch):
    """pi_ref is the run's starting model: after --init_from with LoRA, the KL to it is 0 at step 1
    (the base model, adapters off, would not be), and what the run saves is its own adapter alone."""
    start, _ = _run(tmp_path / "sft", tiny_args, monkeypatch, "--use_sft", "--max_steps", "4")
    out, w = _run(tmp_path / "grpo", tiny_args, monkeypatch, "--use_grpo", "--beta", "0.04", "--init_from",
                  os.path.join(start, "final"))
    from safetensors.torch import load_file
    first = load_file(os.path.join(start, "final", "adapter_model.safetensors"))
    assert _rows(out)[0]["kl"] == pytest.approx(0.0, abs=1e-6)
    assert w.keys() == first.keys() and any(not torch.equal(w[k], first[k]) for k in w)      # trained, not ref
    assert not os.path.exists(os.path.join(out, "final", step.REFERENCE_ADAPTER))
    base, _ = _run(tmp_path / "base", tiny_args, monkeypatch, "--use_grpo", "--beta", "0.04")
    assert _rows(base)[0]["kl"] == pytest.approx(0.0, abs=1e-6)                 # no --init_from: the base


def _rows(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_measuring_h_ini_leaves_the_sampling_stream_alone(tmp_path, tiny_args, monkeypatch):
    """GTPO with Eq. 6's auto filter measures <H>_ini by sampling first; with its own draws, its
    step-1 completions are the same as GRPO's and as GTPO's without the measurement (same seed)."""
    texts = {}
    for name, extra in [("gtpo-auto", ["--use_gtpo", "--entropy_filter", "auto", "--ent_ini_prompts", "2"]),
                        ("gtpo-off", ["--use_gtpo"]), ("grpo", ["--use_grpo"])]:
        out, _ = _run(tmp_path / name, tiny_args, monkeypatch, *extra)
        with open(os.path.join(out, "samples.jsonl")) as f:
            texts[name] = [json.loads(line)["completion"] for line in f]
    assert len(texts["grpo"]) == 4 and texts["gtpo-auto"] == texts["gtpo-off"] == texts["grpo"]


@pytest.mark.parametrize("args,msg", [
    (["--generation_size", "1"], "need G >= 2"),
    (["--model", "no-such-model"], "unknown model 'no-such-model'"),
    (["--dataset", "gsm9k"], "unknown dataset 'gsm9k'"),
    (["--resume"], "no run in"),
    (["--data_dir", "/no/such/dir", "--dataset", "gsm8k"], "data folder '/no/such/dir'"),   # one that reads it
    (["--init_from", "/no/such/dir"], "--init_from '/no/such/dir' holds no adapter_model.safetensors"),
])
def test_bad_flags_fail_with_a_clear_message(tmp_path, capsys, args, msg):
    assert train.cli(["--output_dir", str(tmp_path / "x"), *args]) == 2
    err = capsys.readouterr().err
    assert msg in err and "Traceback" not in err


@pytest.mark.parametrize("argv,msg", [(["--use_gtpo", "--use_sft"], "not allowed with argument"),
                                      (["--learning_rate", "1e-6"], "unrecognized arguments: --learning_rate")])
def test_contradictory_or_misspelt_flags_are_refused(capsys, argv, msg):
    with pytest.raises(SystemExit) as e:
        train.cli(argv)
    assert e.value.code == 2 and msg in capsys.readouterr().err


def test_help_shows_the_real_defaults_grouped(capsys):
    from machinery.config import build_parser
    with pytest.raises(SystemExit) as e:
        train.cli(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "PROMPTS per optimizer step" in out
    text = " ".join(out.split())                                      # argparse wraps lines
    assert "learning rate [default 0.0003 with smollm2-135m (demo profile), else 1e-06 (paper)]" in text
    assert "math500" in text and "aime24" in text and "aime25" in text   # every dataset
    assert "torchrun --nproc_per_node 2 train.py" in text            # the docstring's examples
    groups = [(g.title, [a.dest for a in g._group_actions]) for g in build_parser()._action_groups]
    titles = [t for t, _ in groups]
    assert titles[2:4] == ["the paper's recipe (Listing 1)", "the objective (Eq. 1, 5-8)"]   # first after -h
    assert out.index("--lr") < out.index("--output_dir") < out.index("--merge_lora")


def test_every_flag_is_documented_in_docs_training():
    from machinery.config import build_parser
    with open(os.path.join(HERE, "docs", "training.md")) as f:
        doc = f.read()
    flags = [s for a in build_parser()._actions for s in a.option_strings if s.startswith("--") and s != "--help"]
    assert len(flags) > 40 and [s for s in flags if f"`{s}`" not in doc] == []


def test_config_defaults_profiles_and_unknown_fields():
    """One Config: paper defaults in its fields, the demo's in PROFILES, flags given win; an unknown
    field fails; "auto" filter resolved once (Config.filter_mode); the method decides Adam's betas."""
    from machinery.config import Config, parse_args
    demo, paper = parse_args([]), parse_args(["--model", "llama-8b", "--device", "cuda"])
    assert (demo.lr, demo.generation_size, demo.lora_rank, demo.one_shot) == (3e-4, 8, 32, True)
    assert (paper.lr, paper.generation_size, paper.lora_rank, paper.one_shot) == (1e-6, 12, 128, False)
    assert paper.load_in_4bit and paper.max_completion_length == 1500 and paper.rollout == "auto"
    assert parse_args(["--lr", "5e-4", "--no-one_shot"]).lr == 5e-4
    assert (paper.adam_beta1, parse_args(["--use_grpo"]).adam_beta1) == (0.999999, 0.9)
    with pytest.raises(TypeError, match="learning_rate"):
        Config(learning_rate=1e-6)
    assert Config(method="grpo").filter_mode == "off" and Config(h_ini=0.5).filter_mode == "all"
    assert Config(h_ini=0.9).filter_mode == "off"
    assert Config(method="grpo", objective=gtpo.Objective(entropy_filter="neg")).filter_mode == "neg"
    with pytest.raises(ValueError, match="needs <H>_ini"):
        Config().filter_mode


def test_released_code_selects_every_released_behaviour_and_given_flags_win():
    from machinery.config import parse_args
    default, rel = parse_args(["--model", "llama-8b"]).objective, parse_args(["--released_code"])
    assert (default.entropy_term, default.scale_rewards, default.conflict_norm, default.entropy_filter) == \
        ("released", True, False, "auto")      # the entropy term by docs/study.md part 7's rule; the rest Eq. 6-8
    assert parse_args([]).objective == gtpo.DEFAULT                     # the demo runs the default objective
    assert rel.objective == gtpo.Objective(**gtpo.RELEASED) and rel.released_code
    mixed = parse_args(["--released_code", "--entropy_term", "eq7", "--ent_threshold", "0.5"]).objective
    assert (mixed.entropy_term, mixed.ent_threshold, mixed.conflict_combine) == ("eq7", 0.5, "product")


def test_resume_reads_every_objective_setting_from_the_run(tmp_path):
    """For every setting of gtpo.Objective and each value off its default: --resume without its flag continues
    with the value the run's config.json records, whatever the default is now; a config.json without the
    setting is read as its declared unrecorded value; a flag asking for another value is refused like any
    other change of objective, recorded or not. An identity setting neither recorded nor declared is refused."""
    from conftest import flag_args, off_values
    from machinery.config import identity_keys, parse_args, record, unrecorded
    from machinery.runs import ConfigError, prepare_output_dir, write_json
    out = str(tmp_path)
    argv = ["--model", "llama-8b", "--output_dir", out]
    made = record(parse_args(argv))

    def resume(*flags):
        cfg = parse_args([*argv, "--resume", *flags])
        return cfg, (lambda: prepare_output_dir(out, record(cfg), True, False, identity_keys(), (), unrecorded()))
    for f in dataclasses.fields(gtpo.Objective):
        for v in off_values(f, f.default):
            write_json(str(tmp_path / "config.json"), {**made, f.name: v})
            cfg, check = resume()
            assert getattr(cfg.objective, f.name) == v and cfg.sources[f.name].startswith("resume"), f.name
            assert check() == {}
        old = dict(made)
        del old[f.name]
        write_json(str(tmp_path / "config.json"), old)
        cfg, check = resume()
        assert getattr(cfg.objective, f.name) == gtpo.UNRECORDED[f.name] and check() == {}
        other = off_values(f, gtpo.UNRECORDED[f.name])[0]
        cfg, check = resume(*flag_args(f.name, other))
        with pytest.raises(ConfigError, match=f"{f.name}: {gtpo.UNRECORDED[f.name]!r} there vs {other!r} now"):
            check()
    write_json(str(tmp_path / "config.json"), {k: v for k, v in made.items() if k != "weight_decay"})
    with pytest.raises(ConfigError, match="weight_decay: not recorded there vs 0.1 now"):
        resume()[1]()
    assert "weight_decay" not in unrecorded()


def test_resume_reads_every_recorded_setting_without_flags(tmp_path):
    """`--resume --output_dir RUN` alone continues a run made with non-default flags of every group: each setting
    but what one command says for itself is the run's config.json's, its source says so, and nothing differs;
    a flag given beside it is a change, refused unless --allow_changes names it."""
    from machinery.config import PER_INVOCATION, config_table, identity_keys, parse_args, record, unrecorded
    from machinery.runs import ConfigError, prepare_output_dir, write_json
    out = str(tmp_path)
    made = record(parse_args(["--use_grpo", "--beta", "0.04", "--sft_warmup_steps", "0", "--generation_size", "4",
                              "--max_completion_length", "8", "--lora_rank", "8", "--lr", "3e-5", "--max_steps", "5",
                              "--save_steps", "2", "--logprob_chunk", "64", "--no-share_prompt", "--output_dir", out,
                              "--entropy_filter", "neg", "--temperature", "0.7", "--sample_every", "3"]))
    write_json(str(tmp_path / "config.json"), made)
    cfg = parse_args(["--resume", "--output_dir", out])
    got = record(cfg)
    assert {k: v for k, v in got.items() if k not in PER_INVOCATION + ("sources",)} == \
        {k: v for k, v in made.items() if k not in PER_INVOCATION + ("sources",)}
    assert all(cfg.sources[k] == "resume (the run's config.json)" for k in cfg.sources if k not in PER_INVOCATION)
    assert prepare_output_dir(out, got, True, False, identity_keys(), (), unrecorded()) == {}
    changed = record(parse_args(["--resume", "--output_dir", out, "--max_steps", "7"]))
    with pytest.raises(ConfigError, match="max_steps: 5 there vs 7 now"):
        prepare_output_dir(out, changed, True, False, identity_keys(), (), unrecorded())
    assert prepare_output_dir(out, changed, True, False, identity_keys(), ("max_steps",), unrecorded()) == \
        {"max_steps": (5, 7)}
    table = config_table(parse_args(["--resume", "--output_dir", out, "--print_config"]))
    assert any(line.split()[:2] == ["lora_rank", "8"] and line.endswith("resume (the run's config.json)")
               for line in table.splitlines())


def test_auto_rollout_is_generate_on_cuda_and_shared_on_cpu():
    from rollout import resolve_path
    assert [resolve_path("auto", d) for d in ("cuda", "cuda:1", "cpu", torch.device("cpu"))] == \
        ["generate", "generate", "shared", "shared"]
    assert resolve_path("generate", "cpu") == "generate" and resolve_path("shared", "cuda") == "shared"
    with pytest.raises(ValueError, match="rollout path"):
        resolve_path("vllm", "cpu")


def test_both_rollout_paths_give_valid_equally_shaped_rollouts(tiny_model_dir, tiny_lm, monkeypatch):
    """On CPU, --rollout generate and shared: the same shapes, prompts and mask rules; and auto calls
    the sampler resolve_path names (generate when it says cuda)."""
    from speedups import cpu_rollout
    import rollout as rollout_mod
    model, tok = tiny_lm(lora=True), load_tokenizer(tiny_model_dir)
    prompts = ["a short prompt", "a somewhat longer prompt with more words in it"]
    out = {p: rollout(model, tok, prompts, 3, 7, min_new_tokens=7, path=p) for p in ("generate", "shared")}
    a, b = out["generate"], out["shared"]
    assert a.completion_ids.shape == b.completion_ids.shape == (6, 7)
    assert torch.equal(a.prompt_ids, b.prompt_ids) and torch.equal(a.completion_mask, b.completion_mask)
    assert len(a.texts) == len(b.texts) == 6
    calls = []
    monkeypatch.setattr(cpu_rollout, "sample", lambda *a, **k: calls.append("shared"))
    monkeypatch.setattr(rollout_mod, "resolve_path", lambda path, device: "generate")   # as on a CUDA device
    rollout_mod.rollout(model, tok, prompts, 2, 3)
    assert calls == []


def test_step_records_wrap_returns_n_records_at_the_epoch_end():
    """The SFT warm-up's B x G records read on cyclically: always n of them, the epoch's order."""
    from machinery.runs import Dist
    records = list(range(2000))
    dist = Dist("cpu")
    steps_per_epoch = 2000
    for k in range(0, 200):
        got, epoch = data.step_records(records, k, steps_per_epoch, 24, dist, seed=0, wrap=True)
        assert len(got) == 24 and len(set(got)) == 24 and epoch == 0
    order = torch.randperm(2000, generator=torch.Generator().manual_seed(0)).tolist()
    got, _ = data.step_records(records, 83, steps_per_epoch, 24, dist, seed=0, wrap=True)   # starts at 1992
    assert got == order[1992:] + order[:16]
    assert data.step_records(records, 1, steps_per_epoch, 2, dist, seed=0)[0] == order[2:4]


def test_unreachable_hub_fails_fast(monkeypatch):
    """No network: a Hub dataset or model fails in seconds with the fix, not after ~40 s of retries."""
    import time
    from machinery.data import DataError, load_task
    from machinery.models import ModelError, resolve
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HTTPS_PROXY", raising=False)
    monkeypatch.delenv("https_proxy", raising=False)
    monkeypatch.delenv("GTPO_DATA_DIR", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")           # a closed local port
    t0 = time.time()
    with pytest.raises(DataError, match="unreachable.*--data_dir DIR"):
        load_task("gsm8k", "train")
    with pytest.raises(ModelError, match="not in the local Hugging Face cache and the Hub cannot be reached"):
        resolve("no-org/no-such-model-xyz")
    assert time.time() - t0 < 10


def test_init_from_starts_from_another_runs_weights(tmp_path, tiny_lm):
    """--init_from (SFT, then RL): the adapter of another run is loaded exactly; a folder of another
    LoRA rank or without weights is refused with the fix."""
    from peft import LoraConfig, get_peft_model
    from machinery.runs import ConfigError, load_start_weights
    donor = tiny_lm(lora=True)
    donor.save_pretrained(tmp_path / "final")
    torch.manual_seed(1)
    model = tiny_lm(lora=True)                                        # other B matrices
    lora = lambda m: {n: p for n, p in m.named_parameters() if "lora_" in n}
    assert any(not torch.equal(p, lora(donor)[n]) for n, p in lora(model).items())
    load_start_weights(model, str(tmp_path / "final"))
    assert all(torch.equal(p, lora(donor)[n]) for n, p in lora(model).items())
    other = get_peft_model(tiny_lm(), LoraConfig(r=8, target_modules=["q_proj", "v_proj", "up_proj"]))
    with pytest.raises(ConfigError, match="does not fit this model"):
        load_start_weights(other, str(tmp_path / "final"))
    with pytest.raises(ConfigError, match="holds no adapter_model.safetensors"):
        load_start_weights(model, str(tmp_path))


# -----------------------------------------------------------------------------
# chunked log-probs / entropy (rollout.ChunkedLogprobs) against the full-logits path

@pytest.mark.parametrize("lora", [True, False])
def test_chunked_logprobs_match_full_logits(tiny_lm, lora):
    import gtpo
    from speedups.logprobs import lm_head_of, sequence_logprobs
    model = tiny_lm(lora)
    assert lm_head_of(model) is not None
    V = model.config.vocab_size
    N, P, L = 6, 5, 11
    p_ids = torch.randint(0, V, (N, P))
    p_mask = torch.ones(N, P, dtype=torch.long)
    p_mask[0, :2] = 0                                   # left padding
    c_ids = torch.randint(0, V, (N, L))
    lengths = torch.tensor([11, 3, 7, 1, 11, 5])
    c_mask = (torch.arange(L)[None] < lengths[:, None]).long()
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0])
    weights, _, _ = gtpo.conflict_weights(c_ids, c_mask, adv)
    out = {}
    for chunk in (0, 4, 256):                           # full logits; chunks smaller and larger than T
        model.zero_grad()
        logp, ent = sequence_logprobs(model, p_ids, p_mask, c_ids, c_mask, logprob_chunk=chunk)
        shaped = gtpo.released_advantages(adv, gtpo.masked_mean(ent, c_mask, 1), 0.7, 0.1)
        loss, _ = gtpo.gtpo_loss(logp, c_mask, gtpo.token_advantages(weights, None, shaped))
        loss.backward()
        out[chunk] = (logp.detach(), ent, loss.detach(), grads(model))
    ref_logp, ref_ent, ref_loss, ref_grads = out[0]
    m = c_mask.bool()
    assert len(ref_grads) > 0 and (any("lm_head" in n for n in ref_grads) != lora)   # head trains only without LoRA
    for chunk in (4, 256):
        logp, ent, loss, got = out[chunk]
        assert ent.requires_grad is False
        torch.testing.assert_close(logp[m], ref_logp[m], atol=1e-5, rtol=0)
        # entropies are ~10.8 nats (near-uniform over 49k tokens): both paths sum 49k fp32 terms
        # in different orders and sit ~8e-6 from a float64 reference, hence a relative 1e-5
        torch.testing.assert_close(ent[m], ref_ent[m], atol=1e-5, rtol=1e-5)
        assert (logp[~m] == 0).all()
        torch.testing.assert_close(loss, ref_loss, atol=1e-6, rtol=0)
        assert got.keys() == ref_grads.keys()
        for n in got:
            torch.testing.assert_close(got[n], ref_grads[n], atol=1e-5, rtol=1e-4, msg=n)


def test_chunked_function_gradcheck_float64():
    from speedups.logprobs import ChunkedLogprobs
    torch.manual_seed(0)
    T, D, V = 7, 5, 11
    h = torch.randn(T, D, dtype=torch.float64, requires_grad=True)
    w = torch.randn(V, D, dtype=torch.float64, requires_grad=True)
    b = torch.randn(V, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, V, (T,))
    # the forward returns float32 log-probs; check the float64 backward against finite differences
    # of an exact float64 reference instead
    logp, ent = ChunkedLogprobs.apply(h, w, b, t, 3, True)
    z = (h @ w.T + b)
    ref = z.log_softmax(-1).gather(1, t[:, None]).squeeze(1)
    ref_ent = -(z.softmax(-1) * z.log_softmax(-1)).sum(-1)
    torch.testing.assert_close(logp.double(), ref, atol=1e-6, rtol=0)
    torch.testing.assert_close(ent.double(), ref_ent, atol=1e-6, rtol=0)
    g = torch.randn(T, dtype=torch.float64)
    got = torch.autograd.grad((logp.double() * g).sum(), (h, w, b))
    want = torch.autograd.grad((ref * g).sum(), (h, w, b))
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_entropy_gradient_gradcheck(temperature):
    """Eq. 7's term through the chunked head: d(g . logp + g_H . H)/d(hidden, W, b), float64 finite
    differences (torch.autograd.gradcheck), chunks of 3 over 7 positions, temperature included."""
    from speedups.logprobs import ChunkedLogprobs
    g = torch.Generator().manual_seed(0)
    T, D, V = 7, 5, 11
    h, w, b = (torch.randn(*shape, generator=g, dtype=torch.float64, requires_grad=True)
               for shape in ((T, D), (V, D), (V,)))
    t = torch.randint(0, V, (T,), generator=g)
    assert torch.autograd.gradcheck(lambda h, w, b: ChunkedLogprobs.apply(h, w, b, t, 3, True, temperature, True),
                                    (h, w, b))
    lp, ent = ChunkedLogprobs.apply(h, w, b, t, 3, True, temperature, False)
    assert not ent.requires_grad                                       # without entropy_grad: a constant


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_entropy_gradient_matches_autograd_on_full_logits(tiny_lm, temperature):
    """sequence_logprobs(entropy_grad=True): the gradient of gamma * mean <H>_i (plus the log-prob term)
    through the chunked LM head equals autograd through the full (N, L, V) logits."""
    import gtpo
    from speedups.logprobs import sequence_logprobs
    model = tiny_lm(False)
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(3)
    p_ids, c_ids = torch.randint(0, V, (4, 5), generator=g), torch.randint(0, V, (4, 6), generator=g)
    p_mask = torch.ones_like(p_ids)
    c_mask = (torch.arange(6)[None] < torch.tensor([6, 2, 4, 1])[:, None]).long()
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    out = {}
    for chunk in (0, 4):
        model.zero_grad()
        logp, ent = sequence_logprobs(model, p_ids, p_mask, c_ids, c_mask, logprob_chunk=chunk,
                                      temperature=temperature, entropy_grad=True)
        h = gtpo.masked_mean(ent, c_mask, dim=1)
        loss, _ = gtpo.gtpo_loss(logp, c_mask, gtpo.token_advantages(c_mask.float(), None, adv), entropy=h)
        loss.backward()
        out[chunk] = loss.detach(), grads(model)
    (l0, g0), (l4, g4) = out[0], out[4]
    torch.testing.assert_close(l4, l0, atol=1e-6, rtol=0)
    assert g0.keys() == g4.keys() and any("lm_head" in n for n in g0)
    for n in g0:
        torch.testing.assert_close(g4[n], g0[n], atol=1e-6, rtol=1e-4, msg=n)


HEAP_PROBE = """
import sys, torch
from machinery.models import heap_mmap_threshold
def rss_mb():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS")) / 1024
was_set = heap_mmap_threshold(float(sys.argv[1]))
big = torch.ones(4 * 2**20); del big                 # a 16 MB block freed: glibc raises its threshold
blocks = [torch.ones(2**19) for _ in range(200)]     # 200 x 2 MB, like a step's activations
peak = rss_mb()
del blocks[::2]                                      # every other one freed: holes in a heap
print(was_set, peak - rss_mb())
"""


@pytest.mark.slow                                  # real runs in this process or a child: the slow tier
@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads Linux /proc")
def test_heap_mmap_threshold_returns_freed_tensors_to_the_os():
    """--heap_mmap_mb 1: freed 2 MB tensors leave the process at once; with 0 (the default,
    glibc's own behaviour) they stay in its heap. Each case in a fresh process."""
    import subprocess
    import sys
    out = {mb: subprocess.run([sys.executable, "-c", HEAP_PROBE, mb], capture_output=True, text=True, cwd=HERE,
                              check=True).stdout.split() for mb in ("1", "0")}
    assert out["1"][0] == "True" and float(out["1"][1]) > 150         # ~200 MB of 400 MB freed went back
    assert out["0"][0] == "False" and float(out["0"][1]) < 50
    assert train.parse_args([]).heap_mmap_mb == 0.0


def test_load_model_with_lora_is_quiet_but_hides_nothing_else(tiny_model_dir):
    """train.py's LoRA wrapping prints no deprecation noise from PEFT (models.quiet_peft), and
    quiet_peft filters exactly that one warning: any other still reaches the user."""
    import warnings
    from machinery.models import load_model, quiet_peft
    load_model(tiny_model_dir, lora_rank=4, log=lambda *a: None)     # import-time notices of libraries: once
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        model, _, info = load_model(tiny_model_dir, lora_rank=4, log=lambda *a: None)
        with quiet_peft():
            warnings.warn("`is_gradient_checkpointing` is deprecated", FutureWarning)
            warnings.warn("something else", UserWarning)
    assert [str(w.message) for w in seen] == ["something else"]
    assert info["lora_rank"] == 4 and any("lora_" in n for n, _ in model.named_parameters())


AUTHORS_COMMAND = ("python train.py --model llama-8b --dataset gsm8k --optimizer adam --lr 1e-6 --epochs 3 "
                   "--batch_size 2 --generation_size 12 --use_gtpo")      # their README, verbatim


def test_the_authors_readme_command_parses_as_listing_1():
    from machinery.config import parse_args
    argv = AUTHORS_COMMAND.split()[2:]
    cfg = parse_args(argv + ["--device", "cuda"])
    assert (cfg.optimizer, cfg.method, cfg.model, cfg.dataset) == ("adamw_8bit", "gtpo", "llama-8b", "gsm8k")
    assert (cfg.lr, cfg.epochs, cfg.batch_size, cfg.generation_size, cfg.lora_rank) == (1e-6, 3, 2, 12, 128)
    assert (cfg.adam_beta1, cfg.adam_beta2, cfg.max_grad_norm) == (0.999999, 0.999999, 0.1)
    assert parse_args(argv).optimizer == parse_args(argv[:4] + ["--optimizer", "adamw_8bit"] + argv[6:]).optimizer


@pytest.mark.slow                                  # real runs in this process or a child: the slow tier
@pytest.mark.needs_data
def test_the_authors_readme_command_runs_one_step_on_the_tiny_model(tmp_path, tiny_model_dir, train_here):
    out = tmp_path / "run"
    r = train_here(*AUTHORS_COMMAND.split()[2:], "--model", tiny_model_dir, "--max_steps", "1",
                   "--max_completion_length", "8", "--ent_ini_prompts", "2", "--output_dir", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    rows = _rows(str(out))
    rl = [r_ for r_ in rows if r_["phase"] == "rl"]
    assert [r_["step"] for r_ in rl] == [1] and rl[0]["completions/mean_length"] <= 8
    assert [r_["step"] for r_ in rows if r_["phase"] == "eval"] == [0, 1]      # held-out: RL's start and its end
    cfg = json.load(open(out / "config.json"))
    assert (cfg["optimizer"], cfg["batch_size"], cfg["generation_size"], cfg["dataset"]) == ("adamw_8bit", 2, 12, "gsm8k")
    assert cfg["cpu_threads"] == torch.get_num_threads()                  # a CPU run repeats only with as many


def test_plan_memory_picks_the_micro_batch_and_says_so(tiny_model_dir):
    """On CUDA train.py decides checkpointing and fits the micro-batch to the budget before step 1
    (memory.plan) in one line; with --memory_budget_gb given it needs no device query, so it runs here.
    A budget the tiny model fills only just: checkpointing goes on; a roomy one: off, share_prompt kept."""
    import dataclasses
    from speedups import memory
    from machinery.config import ConfigError, parse_args
    from machinery.models import load_model
    from transformers import AutoConfig
    argv = ["--model", tiny_model_dir, "--device", "cuda", "--no-load_in_4bit", "--lora_rank", "4",
            "--max_completion_length", "64", "--rollout", "generate"]          # the sampler: test_merged_rollout.py
    cfg = parse_args(argv)
    fixed = memory.estimate(AutoConfig.from_pretrained(tiny_model_dir), memory.Settings.from_config(cfg, 100, 4))
    tight = (fixed["card"] - fixed["peak"] + 1.0005 * fixed["h_ini"]) / 1e9     # <H>_ini's stage and a little
    cfg = parse_args(argv + ["--memory_budget_gb", str(tight)])
    assert cfg.micro_batch_size is None and cfg.gradient_checkpointing is None and cfg.share_prompt
    model, _, _ = load_model(tiny_model_dir, lora_rank=4)
    lines = []
    cfg = memory_plan.plan_memory(cfg, model, 100, "cuda", lines.append)
    s = dataclasses.replace(memory.Settings.from_config(cfg, 100, 4), micro_batch_size=cfg.micro_batch_size)
    assert cfg.gradient_checkpointing and not cfg.share_prompt and model.is_gradient_checkpointing
    assert 1 <= cfg.micro_batch_size < 12 and memory.estimate(model.config, s)["card"] <= tight * 1e9
    bigger = dataclasses.replace(s, micro_batch_size=cfg.micro_batch_size + 1)
    assert memory.estimate(model.config, bigger)["card"] > tight * 1e9
    assert len(lines) == 1 and lines[0].startswith("memory: estimated") and f"of a {tight:.1f} GB budget" in lines[0]
    assert f"micro-batches of {cfg.micro_batch_size} completions, checkpointing on" in lines[0]
    roomy = parse_args(argv + ["--memory_budget_gb", "2"])
    model, _, _ = load_model(tiny_model_dir, lora_rank=4)
    roomy = memory_plan.plan_memory(roomy, model, 100, "cuda", lines.append)
    assert (roomy.gradient_checkpointing, roomy.share_prompt, roomy.micro_batch_size) == (False, True, 12)
    assert not model.is_gradient_checkpointing and "checkpointing off" in lines[-1]
    cfg.micro_batch_size, cfg.memory_budget_gb = None, 1e-4
    with pytest.raises(ConfigError, match="does not fit"):
        memory_plan.plan_memory(cfg, model, 100, "cuda", lines.append)


@pytest.mark.parametrize("shard", [None, "100KB"])
def test_full_weights_load_from_one_file_or_shards(tmp_path, tiny_lm, shard):
    """runs.load_weights (--resume and --init_from of a full fine-tuning run): model.safetensors, or
    the shards its index lists."""
    from machinery.runs import load_weights
    src, dst = tiny_lm(), tiny_lm()
    with torch.no_grad():
        for p in src.parameters():
            p.add_(1.0)
    src.save_pretrained(tmp_path, **({"max_shard_size": shard} if shard else {}))
    assert os.path.exists(tmp_path / "model.safetensors.index.json") == bool(shard)
    load_weights(dst, str(tmp_path))
    assert all(torch.equal(a, b) for a, b in zip(src.state_dict().values(), dst.state_dict().values()))


_DDP_BUCKETS = """
import copy, os, sys, torch, torch.distributed as tdist
from machinery.runs import ddp
tdist.init_process_group("gloo", store=tdist.FileStore(sys.argv[1], 1), rank=0, world_size=1)
torch.manual_seed(0)
plain = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
wrapped = ddp(copy.deepcopy(plain), "cpu")
x = torch.randn(5, 8)
plain(x).square().sum().backward()
wrapped(x).square().sum().backward()
storages = {q.grad.untyped_storage().data_ptr() for q in wrapped.module.parameters()}
assert wrapped.gradient_as_bucket_view and len(storages) == 1, storages   # 4 gradients, one bucket's storage
for p, q in zip(plain.parameters(), wrapped.module.parameters()):
    torch.testing.assert_close(q.grad, p.grad)
sys.stdout.flush()                              # checked: leave without tearing the group down, whose gloo
os._exit(0)                                     # threads now and then abort at exit (terminate called ...)
"""


@pytest.mark.slow
def test_ddp_gradients_are_views_into_its_buckets(tmp_path):
    """runs.ddp: one gloo process; after a backward every gradient lives inside DDP's buckets (no second
    copy of the gradients), and the step's gradients equal the plain module's. The group lives in a child
    process: a gloo group torn down inside a pytest worker can block that worker in its destructor."""
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-c", _DDP_BUCKETS, str(tmp_path / "store")], capture_output=True, text=True,
                       cwd=HERE, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]


def test_every_torch_load_names_its_device():
    """A checkpoint read without map_location lands on the device that saved it (rank 0's GPU for every
    rank, and RNG states that torch.set_rng_state refuses): every call in the project maps."""
    import ast
    calls = []
    for dirpath, dirs, files in os.walk(HERE):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("runs", "build")]
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                with open(path) as fh:
                    tree = ast.parse(fh.read())
                calls += [(path, node) for node in ast.walk(tree) if isinstance(node, ast.Call)
                          and ast.unparse(node.func) == "torch.load"]
    assert len(calls) >= 2
    assert [f"{p}:{n.lineno}" for p, n in calls if "map_location" not in {k.arg for k in n.keywords}] == []


def test_tf32_is_set_for_cuda_runs_only():
    from machinery.models import fp32_matmuls
    before = torch.backends.cuda.matmul.fp32_precision
    try:
        fp32_matmuls("cpu", True)
        assert torch.backends.cuda.matmul.fp32_precision == before
        fp32_matmuls("cuda:1", True)
        assert torch.backends.cuda.matmul.fp32_precision == "tf32"
        fp32_matmuls("cuda", False)
        assert torch.backends.cuda.matmul.fp32_precision == "ieee"
    finally:
        torch.backends.cuda.matmul.fp32_precision = before


def test_bad_data_fails_before_the_model_loads_and_leaves_no_run_folder(tmp_path, monkeypatch, capsys):
    """A missing file, one's own file with the demo's one-shot default, a row without an answer: one line
    naming the fix, exit 2, no model loaded and no run folder made."""
    loaded = []
    monkeypatch.setattr(train, "setup_model", lambda *a, **k: loaded.append(1))
    out = tmp_path / "run"
    mine, broken = tmp_path / "mine.jsonl", tmp_path / "broken.jsonl"
    mine.write_text('{"question": "What is 1 + 1?", "answer": "2"}\n' * 3)
    broken.write_text('{"question": "What is 1 + 1?"}\n')
    cases = [(["--dataset", str(tmp_path / "missing.jsonl")], "does not exist"),
             (["--dataset", str(mine)], f"--one_shot_from {mine}"),
             (["--dataset", str(broken), "--no-one_shot"], "need a question"),
             (["--dataset", str(mine), "--one_shot_from", str(tmp_path / "nope.jsonl")], "does not exist")]
    for argv, says in cases:
        assert train.cli(argv + ["--output_dir", str(out)]) == 2
        assert says in capsys.readouterr().err
    assert not out.exists() and not loaded


def test_one_shot_from_names_the_example(tmp_path, tiny_model_dir):
    """--one_shot_from: the first train record of the named dataset; from the training file itself it is
    then not trained on."""
    from machinery.config import parse_args
    from machinery.models import load_tokenizer
    mine = tmp_path / "mine.jsonl"
    mine.write_text("".join(f'{{"question": "What is {i} + 1?", "answer": "{i + 1}"}}\n' for i in range(4)))
    tok, lines = load_tokenizer(tiny_model_dir), []
    for source, first, n in ((str(mine), "What is 0 + 1?", 3), ("arithmetic", None, 4)):
        cfg = parse_args(["--dataset", str(mine), "--one_shot_from", source])
        records, example = train.load_records(cfg, tok, train.load_task(str(mine)), lines.append)
        assert len(records) == n and example[0] == (first or train.load_task("arithmetic")[0]["question"])
    assert lines[0] == f"one-shot example: the first train record of {mine}"


@pytest.mark.slow
def test_the_pages_own_data_check_runs_offline_as_written(tmp_path):
    """docs/training.md "Your own data": its short test, copied from the page, on a file of one's own with the Hub
    unreachable (HF_HUB_OFFLINE=1), with fewer and shorter samples appended: two RL steps, and the example is the
    file's first record."""
    import subprocess
    import sys
    from conftest import ENV
    with open(os.path.join(HERE, "docs", "training.md")) as f:
        section = f.read().split("## Your own data", 1)[1].split("\n## ", 1)[0]
    command = " ".join(section.split("A short test, offline: `", 1)[1].split("`", 1)[0].split())
    assert command.startswith("python train.py --dataset mine.jsonl") and "gsm8k" not in command
    (tmp_path / "mine.jsonl").write_text("".join(json.dumps({"question": f"Ann has {i} apples and gets 2 more. How "
                                                                        f"many now?", "answer": str(i + 2),
                                                             "solution": f"{i} + 2 = {i + 2}"}) + "\n"
                                                 for i in range(6)))
    argv = [sys.executable, os.path.join(HERE, "train.py")] + command.split()[2:] + [
        "--generation_size", "2", "--max_completion_length", "16"]                  # less work, the same path
    r = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=900, env={**ENV, "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "one-shot example: the first train record of mine.jsonl" in r.stdout and "done:" in r.stdout
    rows = [json.loads(line) for line in (tmp_path / "runs" / "gtpo-smollm2-135m-mine" / "metrics.jsonl").open()]
    assert [r["step"] for r in rows] == [1, 2] and all(r["phase"] == "rl" for r in rows)


def test_print_config_says_where_each_value_came_from_without_loading(train_here, monkeypatch):
    """--print_config: the settings and their layer (flag, --released_code, profile, default, setup), printed in
    seconds: nothing loads (load_model would raise here)."""
    monkeypatch.setattr(train, "load_model", lambda *a, **k: (_ for _ in ()).throw(AssertionError("loaded")))
    r = train_here("--print_config", "--released_code", "--lr", "1e-4")
    rows = {line.split()[0]: line.split()[1:] for line in r.stdout.splitlines() if not line.startswith("#")}
    assert r.returncode == 0
    assert rows["ent_gamma"] == ["0.1", "--released_code"] and rows["lr"] == ["0.0001", "flag"]
    assert rows["max_steps"] == ["28", "profile", "(smollm2-135m)"] and rows["seed"] == ["3407", "default"]
    assert rows["device"][1:] == ["setup", "(device,", "model,", "method)"]


def test_config_json_records_each_settings_source(tmp_path, tiny_args):
    assert train.main(tiny_args(tmp_path / "run", max_steps=1)) == 0
    sources = json.load(open(tmp_path / "run" / "config.json"))["sources"]
    assert sources["lora_rank"] == "flag" and sources["lr"] == "default" and sources["method"] == "default"


def test_setup_decides_and_leaves_the_parsed_config_as_it_was(tmp_path, tiny_args, monkeypatch):
    """The model's LoRA rank, the memory plan and <H>_ini come back from setup as a new Config the loop reads;
    the one parse_args returned is not changed (config.json records what setup decided)."""
    from machinery.config import parse_args
    cfg = parse_args(tiny_args(tmp_path / "run", max_steps=1, entropy_filter="auto", ent_ini_prompts=2))
    parsed = dataclasses.asdict(cfg)
    monkeypatch.setattr(train, "parse_args", lambda *a, **k: cfg)
    assert train.main([]) == 0
    assert dataclasses.asdict(cfg) == parsed and cfg.h_ini is None
    assert json.load(open(tmp_path / "run" / "config.json"))["h_ini"] is not None
