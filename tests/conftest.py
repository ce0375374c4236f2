"""Shared fixtures: a tiny random-weight Llama with the embedded model's tokenizer, the flags that
run train.py on it, the train.py command line, and the `needs_data` marker for real-data tests.

torch and the project's modules are imported inside the functions that use them: `pytest -n 2`'s
controller process loads this file too, runs no test, and would otherwise import them before it starts
the workers."""
import gc
import os
import socket
import subprocess
import sys

import pytest

if os.environ.get("PYTEST_XDIST_WORKER"):      # `pytest -n 2`: a thread per worker (and per process it starts), or
    os.environ.setdefault("OMP_NUM_THREADS", "1")   # the two workers' threads contend for the cores and run slower
    import torch
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

if os.environ.get("GTPO_HIDE_TRL"):             # the fast tier as `pip install -r requirements.txt` leaves it (.ci/run)
    sys.modules["trl"] = None                   # `import trl` fails and find_spec("trl") is None, as without TRL

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))     # the repository root
DATA_DIR = os.environ.get("GTPO_DATA_DIR")
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore", "TOKENIZERS_PARALLELISM": "false"}


def pytest_collection_modifyitems(config, items):
    if DATA_DIR and os.path.isdir(DATA_DIR):
        return
    fix = "a folder of <dataset>/<split>.jsonl, which `python -m machinery.data --export DIR` writes where the Hub is reachable"
    why = (f"GTPO_DATA_DIR={DATA_DIR!r} is not a folder; point it at {fix}" if DATA_DIR else
           f"needs the real datasets: set GTPO_DATA_DIR to {fix}")
    skip = pytest.mark.skip(reason=why)
    for item in items:
        if "needs_data" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session):
    """What collection imported (torch, transformers, sympy) lives to the end, and every full garbage
    collection in the tests would walk all of it again: moved out of the collector's sight."""
    gc.freeze()


def free_port():
    """A TCP port free now, for a torchrun rendezvous: with `pytest -n 2` two tests may start ranks at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(autouse=True)
def _seeded():
    """Every test starts from the same global RNG state, whatever ran before it."""
    import torch
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A 2-layer random Llama with the embedded model's tokenizer, saved as a local folder."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from machinery.models import embedded_model_dir, load_tokenizer
    tok = load_tokenizer(embedded_model_dir())
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    d = tmp_path_factory.mktemp("tiny")
    LlamaForCausalLM(cfg).save_pretrained(d)
    tok.save_pretrained(d)
    return str(d)


@pytest.fixture
def tiny_lm(tiny_model_dir):
    """tiny_lm(lora) -> the tiny model in fp32; with LoRA (r 4 on q, v, up) its B matrices drawn
    non-zero, since B = 0 at init would hide gradient errors in A."""
    import torch
    from transformers import AutoModelForCausalLM

    def make(lora=False):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        if lora:
            from peft import LoraConfig, get_peft_model
            model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"]))
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    torch.nn.init.normal_(p, std=0.1)
        return model
    return make


@pytest.fixture
def small_vocab_lm():
    """A 2-layer random Llama with a 512-token vocabulary and LoRA (r 4 on q, v, up; B drawn non-zero), its
    LM head scaled by 40 so the next token is peaked: what the distribution tests sample thousands of rows
    from, where the embedded tokenizer's 49,152 entries would make every draw slow. Token 2 is EOS, 0 pad."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, eos_token_id=2, pad_token_id=0)
    model = get_peft_model(LlamaForCausalLM(cfg), LoraConfig(r=4, target_modules=["q_proj", "v_proj", "up_proj"]))
    for n, p in model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.1)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(40.0)
    return model.eval()


def assert_draws_match(model, ids, ours, theirs, top_p, logits_of=None):
    """Two samplers' draws (n, 6) after the prompt ids (1, P) at temperature 1 and top_p: the first token's
    frequencies of both within 5 binomial standard errors of the exact nucleus probabilities (from
    logits_of, default model), among the 5 most likely tokens; and the mean per-token log-prob of the
    draws under `model` equal within 5 standard errors."""
    import torch
    n = len(ours)
    with torch.no_grad():
        logits = (logits_of or model)(input_ids=ids).logits[0, -1].float()
    ascending, order = logits.sort()
    drop = ascending.softmax(-1).cumsum(-1) <= 1 - top_p
    drop[-1] = False
    p = logits.masked_fill(drop.scatter(0, order, drop), float("-inf")).softmax(-1)   # the nucleus, exact
    top = p.topk(5).indices
    top = top[p[top] > 0]
    assert p[top].sum() > 0.4                                                         # peaked enough to test
    for t in top:
        se = (p[t] * (1 - p[t]) / n).sqrt()
        f_ours, f_theirs = (ours[:, 0] == t).float().mean(), (theirs[:, 0] == t).float().mean()
        assert abs(f_ours - p[t]) < 5 * se and abs(f_theirs - p[t]) < 5 * se, (t, f_ours, f_theirs, p[t])

    def logprobs(comp):                                                               # (n,) mean over the tokens
        with torch.no_grad():
            lp = model(input_ids=torch.cat([ids.repeat(len(comp), 1), comp], 1)).logits[:, ids.shape[1] - 1:-1]
        return lp.float().log_softmax(-1).gather(-1, comp[..., None]).squeeze(-1).mean(1)
    a, b = logprobs(ours), logprobs(theirs)
    se = ((a.var() + b.var()) / n).sqrt()
    assert abs(a.mean() - b.mean()) < 5 * se, (a.mean(), b.mean(), se)


def grads(model):
    """{name: gradient} of the parameters that have one."""
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.fixture
def tiny_args(tiny_model_dir):
    """tiny_args(out, flag=value, ...) -> train.py argv for the tiny model: no one-shot example,
    entropy filter off, LoRA rank 4, G = 4, 6 new tokens, no held-out evaluation (tests/test_heldout.py's
    own); keyword flags override or add (True = a bare switch)."""
    def make(out, **flags):
        base = {"model": tiny_model_dir, "output_dir": str(out), "generation_size": 4, "max_completion_length": 6,
                "entropy_filter": "off", "lora_rank": 4, "no-one_shot": True, "eval_steps": 0}
        argv = []
        for k, v in {**base, **flags}.items():
            argv += [f"--{k}"] if v is True else [] if v is False else [f"--{k}", str(v)]
        return argv
    return make


def train_cmd(*args):
    return [sys.executable, os.path.join(HERE, "train.py"), *args]


@pytest.fixture
def train_cli():
    """train_cli(*args, timeout=900, env=None) -> CompletedProcess of `python train.py ARGS` (offline, text),
    env's variables added to ENV."""
    def run(*args, timeout=900, env=None):
        return subprocess.run(train_cmd(*args), cwd=HERE, capture_output=True, text=True, env={**ENV, **(env or {})},
                              timeout=timeout)
    return run


@pytest.fixture
def train_here():
    """train_here(*args) -> CompletedProcess of train.cli(ARGS) in this process: the exit code and the
    stdout/stderr text `python train.py ARGS` gives, without a fresh interpreter's imports. For runs
    that need a process of their own (a kill, a signal), train_cli."""
    import contextlib
    import io

    import train

    def run(*args):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = train.cli([str(a) for a in args])
            except SystemExit as e:                 # argparse's refusal of a flag, as the command line exits
                code = e.code
        return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())
    return run


def off_values(field, value):
    """Values of a gtpo.Objective setting other than `value`, from its declaration alone: the other choices, the
    other bool, or half and one and a half times a number (0.37 for 0)."""
    if field.type is bool:
        return [not value]
    if field.metadata["choices"]:
        return [c for c in field.metadata["choices"] if c != value]
    return [value * 0.5, value * 1.5] if value else [0.37]


def flag_args(name, value):
    """The train.py arguments that set setting `name` to `value` (a switch for a bool)."""
    if isinstance(value, bool):
        return [f"--{name}" if value else f"--no-{name}"]
    return [f"--{name}", str(value)]


def objective_cases(threshold):
    """[(label, gtpo.Objective)]: the paper's settings and the released code's (gtpo.RELEASED), each with
    ent_threshold `threshold`, then each with one setting moved off its value (off_values); combinations the
    declaration refuses are left out. Every setting comes from gtpo.Objective: a new one is covered unasked."""
    import dataclasses

    import gtpo
    bases = {"paper": gtpo.Objective(ent_threshold=threshold),
             "released": gtpo.Objective(**{**gtpo.RELEASED, "ent_threshold": threshold})}
    cases = list(bases.items())
    for label, base in bases.items():
        for f in dataclasses.fields(gtpo.Objective):
            for v in off_values(f, getattr(base, f.name)):
                try:
                    cases.append((f"{label}: {f.name}={v!r}", dataclasses.replace(base, **{f.name: v})))
                except ValueError:                  # e.g. sum_completions with another loss_type: refused
                    pass
    return cases
