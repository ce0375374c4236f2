"""gtpo.Objective, the objective's one declaration, against its two sources and its readers.

Sources: its defaults are the paper's (PAPER, transcribed here from the paper) but for the one setting a
declared study rule chose; its released values are the authors' code's (the listings' constants). Readers: every
setting is a train.py flag and a GTPOConfig field made from its declaration, and every path that computes the
loss -- the loop's step (step.rl_step: micro-batches, a shared prompt), the plain step (step.reference_step) and
TRL's trainer (GTPOTrainer) -- reads every setting alike: moved off its value, a setting changes the loss or the
gradients identically in every path, or in none where its declaration says no method reads it. The settings and
their values come from the declaration (conftest.objective_cases): a new field is tested here unedited."""
import dataclasses
import importlib.util
import math

import pytest
import torch

import gtpo
import rewards
import step
from conftest import flag_args, grads, objective_cases, off_values
from machinery import config
from machinery.models import load_tokenizer
from released_listings import ENT_SCALE, ENT_THRESHOLD, W_RAW
from rollout import Rollout

FIELDS = dataclasses.fields(gtpo.Objective)
PAPER = {"scale_rewards": True,          # Eq. 8: (R_i - mean R) / std(R)
         "beta": 0.0,                    # Listing 1: 0.0 (0.04 and 1e-6 also run) for GRPO, none for GTPO
         "clip_eps": 0.2,                # Eq. 1's clip, Shao et al.'s 0.2; inactive at one iteration (Sec. 2)
         "conflict_weight": 2.0,         # Eq. 5
         "conflict_combine": "or",       # Sec. 5.1: M_i = M^fw v M^bw
         "conflict_norm": False,         # Eq. 7 divides by no conflict count
         "conflict_count": "union",      # App. 16's prose: |M^fw v M^bw|
         "entropy_filter": "auto",       # Eq. 6: delta_i only when <H>_ini < ln 2
         "ent_threshold": math.log(2),   # Eq. 6
         "ent_gamma": 0.1,               # Sec. 6, Fig. 4: gamma = 0.1
         "entropy_term": "eq7",          # Eq. 7: -gamma <H>_i, a term of its own
         "loss_type": "grpo",            # Eq. 7: (1/G) sum_i (1/|o_i|) sum_t
         "sum_completions": False}       # Eq. 7: 1/G
STUDY = {"entropy_term": "released"}     # docs/study.md Part 7's declared rule, applied to Q8's runs
LISTINGS = {"scale_rewards": False,                                   # Listing 3: R - mean R
            "conflict_weight": W_RAW, "conflict_combine": "product",  # Listing 2: mask_fwd * mask_bw
            "conflict_norm": True, "conflict_count": "longer",        # Listing 3 step 5; Listing 2 line 91
            "entropy_filter": "all", "ent_threshold": ENT_THRESHOLD,  # App. 12: always on, 0.7
            "ent_gamma": ENT_SCALE, "entropy_term": "released",       # A_i - 0.1 <H>_i, detached
            "sum_completions": True}                                  # Listing 3: no 1/G


def test_defaults_are_the_papers_but_the_one_a_declared_rule_chose():
    assert {f.name: f.default for f in FIELDS} == {**PAPER, **STUDY}
    assert gtpo.Objective() == gtpo.DEFAULT


def test_released_code_is_the_listings_values():
    assert gtpo.RELEASED == LISTINGS


def _bad_values(f):
    """Values the declaration refuses: a word outside the choices, or the numbers its range excludes."""
    if f.metadata["choices"]:
        return ["sometimes"]
    if f.metadata["check"]:
        return [v for v in (float("nan"), -1.0, float("inf")) if not f.metadata["check"][0](v)]
    return []


def test_every_setting_is_a_flag_made_from_its_declaration(capsys):
    """--help shows each setting's help; each value off the default reaches Config.objective (over the demo
    profile, which sets no objective setting); each value the declaration refuses is refused as parsed."""
    actions = {a.dest: a for a in config.build_parser()._actions}
    demo = config.parse_args([]).objective
    assert demo == gtpo.DEFAULT
    for f in FIELDS:
        assert actions[f.name].help.startswith(f.metadata["help"]) and actions[f.name].container.title.startswith(
            "the objective")
        for v in off_values(f, f.default):
            got = config.parse_args(flag_args(f.name, v))
            assert got.objective == dataclasses.replace(demo, **{f.name: v}), f.name
            assert got.sources[f.name] == "flag"
        for bad in _bad_values(f):
            with pytest.raises(SystemExit):
                config.parse_args([f"--{f.name}", str(bad)])
            assert f"--{f.name}" in capsys.readouterr().err


def test_released_code_flag_and_resume_come_from_the_declarations():
    cfg = config.parse_args(["--released_code"])
    assert cfg.objective == gtpo.Objective(**gtpo.RELEASED)
    assert {k: cfg.sources[k] for k in gtpo.RELEASED} == dict.fromkeys(gtpo.RELEASED, "--released_code")
    assert config.unrecorded().items() >= gtpo.UNRECORDED.items()
    assert set(gtpo.UNRECORDED) == {f.name for f in FIELDS} <= set(config.identity_keys())


@pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="needs TRL (pip install -r requirements-trl.txt)")
def test_gtpoconfig_takes_every_setting_gtpo_reads_as_train_py_does(tmp_path):
    """GTPOConfig's fields are the declaration's for every setting GTPO reads: the same names and defaults, each
    value off the default reaching .objective(), and each refusal in train.py's words."""
    from gtpo_trl import GTPOConfig
    base = dict(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none")
    assert GTPOConfig(**base).objective() == gtpo.DEFAULT
    own = {g.name: g.default for g in dataclasses.fields(GTPOConfig)}
    for f in FIELDS:
        if gtpo.GTPO not in f.metadata["reads"]:
            continue
        assert own[f.name] == f.default and f.metadata["help"] in GTPOConfig.__dataclass_fields__[f.name].metadata["help"]
        for v in off_values(f, f.default):
            assert GTPOConfig(**base, **{f.name: v}).objective() == gtpo.Objective(**{f.name: v})
        for bad in _bad_values(f):
            with pytest.raises(ValueError) as refused:
                gtpo.Objective(**{f.name: bad})
            with pytest.raises(ValueError, match=f"GTPOConfig: {refused.value}".replace("(", r"\(").replace(")", r"\)")):
                GTPOConfig(**base, **{f.name: bad})
    with pytest.raises(ValueError, match="GTPOConfig: sum_completions sums"):
        GTPOConfig(**base, sum_completions=True, loss_type="dapo")


# -----------------------------------------------------------------------------
# every path reads every setting alike

G, T, P = 4, 7, 5
REWARDS = torch.tensor([2.0, 0.0, 0.0, 1.0, 5.0, 3.0, 3.0, 0.5])     # mixed signs, two spreads


def _completions(tok, V):
    """2 prompts x G completions with shared leading and trailing spans (conflicts) and ragged lengths; the
    prompts unpadded, so that TRL's positions and ours agree."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, V, (2 * G, T), generator=g)
    ids[:, :2] = 7
    lengths = torch.tensor([7, 5, 6, 4, 7, 3, 5, 5])
    for i, n in enumerate(lengths.tolist()):
        ids[i, n - 2:n] = 9
    ids[6] = ids[7]                                                    # A > 0 and A < 0 alike: both spans whole
    mask = (torch.arange(T)[None] < lengths[:, None]).long()
    prompts = torch.randint(5, V, (2, P), generator=g).repeat_interleave(G, 0)
    return Rollout(prompt_ids=prompts, prompt_mask=torch.ones_like(prompts),
                   completion_ids=ids.masked_fill(mask == 0, tok.pad_token_id), completion_mask=mask,
                   truncated=torch.zeros(2 * G, dtype=torch.bool), texts=[f"t{i}" for i in range(2 * G)])


def _loop(model, tok, cfg):
    model.zero_grad()
    m, _, _ = step.rl_step(model, model, tok, ["p", "q"], ["1", "2"], cfg)
    return m["loss"], grads(model)


def _reference(model, tok, cfg):
    model.zero_grad()
    loss = step.reference_step(model, tok, ["p", "q"], ["1", "2"], cfg)
    return loss.item(), grads(model)


def _trl(trainer, model, ro, objective, h_ini):
    """GTPOTrainer's two halves on the same completions: per-token advantages from Eq. 8's and its own <H>_i
    pass, then its loss and gradients."""
    from gtpo_trl import per_token_advantages
    trainer.objective, trainer.loss_type = objective, objective.loss_type   # TRL's loss reads its own loss_type
    out = {"prompt_ids": ro.prompt_ids, "prompt_mask": ro.prompt_mask, "completion_ids": ro.completion_ids,
           "completion_mask": ro.completion_mask}
    h = trainer._mean_entropy(out)
    adv = gtpo.group_advantages(REWARDS, G, objective)                  # Eq. 8, as TRL's advantages give it
    advantages, _ = per_token_advantages(ro.completion_ids, ro.completion_mask, adv, h, G, objective,
                                         objective.filter_mode("gtpo", h_ini))
    model.train()
    model.zero_grad()
    loss = trainer._compute_loss(model, {**out, "advantages": advantages,
                                         "num_items_in_batch": ro.completion_mask.sum()})
    loss.backward()
    return loss.item(), grads(model)


def _same(a, b, atol, what):
    (loss_a, grad_a), (loss_b, grad_b) = a, b
    assert loss_a == pytest.approx(loss_b, rel=1e-4, abs=atol), what      # <H>_i: chunked vs whole head
    assert grad_a.keys() == grad_b.keys() and grad_a, what
    for n in grad_a:
        scale = grad_b[n].abs().max().item()                           # float32 rounding grows with the gradient
        torch.testing.assert_close(grad_a[n], grad_b[n], atol=max(atol, 1e-4 * scale), rtol=1e-4,
                                   msg=lambda m: f"{what} {n}: {m}")


def _moved(a, b):
    """Whether a setting changed the loss or any gradient (exactly equal otherwise)."""
    return a[0] != b[0] or any(not torch.equal(a[1][n], b[1][n]) for n in a[1])


def test_every_path_reads_every_setting_alike(tiny_model_dir, small_vocab_lm, monkeypatch, tmp_path):
    """For the paper's and the released code's settings, and each with one setting moved off its value, under
    GTPO and GRPO: the loop's step (micro-batches of 2, a shared prompt), the plain reference step and, for
    GTPO where TRL is installed, GTPOTrainer give the same loss and LoRA gradients. A setting the method does
    not read (its declaration's `reads`) leaves them bit for bit as they were; every other setting changes them
    in some case. <H>_ini = 0.9 > ln 2: "auto" leaves delta_i off, "all" and "neg" are the filtered cases."""
    from machinery.config import Config
    from speedups.logprobs import sequence_logprobs
    model, tok = small_vocab_lm, load_tokenizer(tiny_model_dir)        # 512 tokens, a peaked head; pad 2 < 512
    ro = _completions(tok, model.config.vocab_size)
    monkeypatch.setattr(step, "rollout", lambda *a, **k: ro)
    monkeypatch.setattr(rewards, "reward", lambda texts, refs, task, counts=None: (REWARDS, REWARDS, REWARDS * 0))
    trainer = None
    if importlib.util.find_spec("trl"):
        from datasets import Dataset
        from gtpo_trl import GTPOConfig, GTPOTrainer
        trainer = GTPOTrainer(model=model, processing_class=tok, reward_funcs=[lambda completions, **k: [0.0]],
                              args=GTPOConfig(output_dir=str(tmp_path), num_generations=G, max_completion_length=T,
                                              per_device_train_batch_size=2 * G, bf16=False, use_cpu=True,
                                              report_to="none"), train_dataset=Dataset.from_list([{"prompt": "x"}] * 8))
        trainer.current_gradient_accumulation_steps = 1
    with torch.no_grad():
        h = sequence_logprobs(model, ro.prompt_ids, ro.prompt_mask, ro.completion_ids, ro.completion_mask)[1]
    h = sorted(gtpo.masked_mean(h, ro.completion_mask, dim=1).tolist())
    threshold = (h[G - 1] + h[G]) / 2                                  # between the middle two <H>_i
    cases = objective_cases(threshold)
    thresholds = {objective.ent_threshold for _, objective in cases}
    assert min(abs(a - b) for a in h for b in thresholds) > 1e-3, (h, thresholds)   # no <H>_i on a threshold
    moved, base_results = set(), {}
    for method in ("gtpo", "grpo"):
        for label, objective in cases:
            cfg = Config(method=method, dataset="arithmetic", generation_size=G, max_completion_length=T,
                         logprob_chunk=4, micro_batch_size=2, h_ini=0.9, objective=objective)
            what = f"{method} {label}"
            loop = _loop(model, tok, cfg)
            _same(_reference(model, tok, cfg), loop, 1e-6, what)
            if trainer is not None and method == "gtpo":
                _same(_trl(trainer, model, ro, objective, 0.9), loop, 1e-5, what)
            if ":" not in label:
                base_results[(method, label)] = objective, loop
                continue
            base, base_loop = base_results[(method, label.split(":")[0])]
            name = label.split(": ")[1].split("=")[0]
            if name in base.unread(method) and name in objective.unread(method):
                assert not _moved(loop, base_loop), f"{what}: read by {method}, its declaration says not"
            elif _moved(loop, base_loop):
                moved.add(name)
    read = {f.name for f in FIELDS if f.metadata["reads"]}
    assert moved == read, f"no case moved {read - moved}"


def _table(text, header):
    """The cells of each row of the markdown table whose header line starts with `header`."""
    lines = text[text.index(header):].splitlines()[2:]
    rows = []
    for line in lines:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split(" | ")])
    return rows


def _shown(value):
    """The ways a page may write a default."""
    if isinstance(value, bool):
        return {"on", "True"} if value else {"off", "False"}
    if isinstance(value, float):
        return {repr(value), f"{value:g}"} | ({"ln 2"} if value == math.log(2) else set())
    return {value}


def test_the_pages_tables_state_the_declared_defaults():
    """docs/training.md's flag table and docs/trl.md's GTPOConfig table give each objective
    setting they name its declared default; docs/training.md's table and docs/trl.md's name every one train.py
    and GTPOConfig take; README's released-code table names every setting whose released value is not the
    paper's."""
    import re
    from conftest import HERE
    pages = {name: open(f"{HERE}/{name}").read() for name in ("README.md", "docs/training.md", "docs/trl.md")}
    declared = {f.name: f.default for f in FIELDS}
    tables = [("docs/training.md", "| flag | default | demo profile |", 0, 1),
              ("docs/trl.md", "| `GTPOConfig` field | default |", 0, 1)]
    named = {}
    for page, header, names_at, default_at in tables:
        text = pages[page]
        if page == "docs/training.md":
            text = text[text.index("### The objective"):]
        for row in _table(text, header):
            names = [n for n in re.findall(r"`(?:--)?([a-z_]+)`", row[names_at]) if n in declared]
            defaults = [d.strip().strip("`") for d in row[default_at].split(",")]
            for name, shown in zip(names, defaults if len(defaults) == len(names) else defaults[:1] * len(names)):
                assert shown in _shown(declared[name]), (page, name, shown, declared[name])
                named.setdefault(page, set()).add(name)
    assert named["docs/training.md"] == set(declared)
    assert named["docs/trl.md"] >= {f.name for f in FIELDS if gtpo.GTPO in f.metadata["reads"]} - {"scale_rewards"}
    released_table = pages["README.md"][pages["README.md"].index("## Equations vs released code"):]
    released_table = released_table[:released_table.index("\n## ")]
    for name, value in gtpo.RELEASED.items():
        if value != PAPER[name]:
            assert f"--{name}" in released_table or f"--no-{name}" in released_table, name
