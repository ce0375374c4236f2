"""Runs that survive: kill -9 and --resume (bit-exact), SIGTERM, bad input with clear messages,
degenerate and non-finite steps, and two-process data-parallel training (torchrun, gloo)."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

import gtpo
import rewards
import step
import train
from conftest import ENV, HERE, free_port, train_cmd as _cmd

pytestmark = pytest.mark.slow                         # subprocess runs: the slow tier


def _rows(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _adapter(path):
    return load_file(os.path.join(path, "adapter_model.safetensors"))


def _wait_for(pred, proc, timeout=600):
    t0 = time.time()
    while not pred():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.time() - t0 < timeout
        time.sleep(0.05)


# -----------------------------------------------------------------------------
# crash safety

def test_kill9_then_resume_is_bit_exact(tmp_path, train_cli, train_here):
    """The demo's shape on the embedded model (its rewards vary, so GTPO really updates): 1 SFT warm-up step
    then 2 GTPO steps, held-out evaluations at RL's start and steps 2 and 3. Run a goes straight through: the
    warm-up's end is checkpoint-1, --save_steps 2 adds checkpoint-2, the Eq. 6 decision is logged. Run b is SIGKILLed after checkpoint-2 (its first GTPO step) is
    written; the same command again is refused, `--resume --output_dir b` alone continues with the recipe its
    config.json records (none of the flags retyped). Same final adapter, bit for bit. Each
    process has its own PYTHONHASHSEED, so the run is also one that no iteration order over strings
    (sets of names, dict keys from hashing) can steer."""
    common = ["--max_steps", "3", "--save_steps", "2", "--generation_size", "4", "--max_completion_length", "16",
              "--sft_warmup_steps", "1", "--ent_ini_prompts", "2", "--seed", "5", "--eval_steps", "2",
              "--eval_limit", "2", "--eval_n_samples", "2"]
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    r = train_cli("--output_dir", a, *common, env={"PYTHONHASHSEED": "0"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "entropy filter" in r.stdout                               # the Eq. 6 decision is logged
    assert os.path.isfile(os.path.join(a, "checkpoint-1", "adapter_model.safetensors"))   # the warm-up's end
    assert os.path.getsize(os.path.join(a, "samples.jsonl")) > 0

    p = subprocess.Popen(_cmd("--output_dir", b, *common), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env={**ENV, "PYTHONHASHSEED": "1"})
    _wait_for(lambda: os.path.isdir(os.path.join(b, "checkpoint-2")), p)
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert not os.path.exists(os.path.join(b, "final"))
    # a kill in the middle of the next save leaves a .tmp folder: it is ignored, checkpoint-2 is used
    os.makedirs(os.path.join(b, "checkpoint-3.tmp"))
    with open(os.path.join(b, "checkpoint-3.tmp", "adapter_model.safetensors"), "w") as f:
        f.write("partial")
    r = train_here("--output_dir", b, *common)
    assert r.returncode == 2 and "--resume" in r.stderr                # a run is there: resume it or move it
    r = train_cli("--output_dir", b, "--resume", env={"PYTHONHASHSEED": "2"})     # no flag retyped: config.json's
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stdout and "checkpoint-2" in r.stdout

    rows_a, rows_b = _rows(a), _rows(b)
    assert [(x["step"], x["phase"]) for x in rows_b] == [(1, "sft"), (1, "eval"), (2, "rl"), (2, "eval"), (3, "rl"),
                                                         (3, "eval")]     # none missing, none twice
    held = [{k: v for k, v in x.items() if k != "eval/seconds"} for x in rows_a + rows_b if x["phase"] == "eval"]
    assert held[:3] == held[3:]                                           # the held-out rows, evaluated again too
    for x, y in zip(rows_a, rows_b):                                      # same data, samples, schedule
        for k in ("loss", "reward", "lr", "grad_norm", "entropy"):
            assert x.get(k) == y.get(k), (x["step"], k)
    wa, wb = _adapter(os.path.join(a, "final")), _adapter(os.path.join(b, "final"))
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert any(v.abs().sum() > 0 for k, v in wb.items() if "lora_B" in k)
    state = torch.load(os.path.join(b, "checkpoint-3", "trainer_state.pt"), map_location="cpu", weights_only=False)
    assert state["step"] == 3


def test_sigterm_finishes_the_step_saves_and_exits_0(tmp_path, tiny_args, train_here):
    out = str(tmp_path / "run")
    common = tiny_args(out, generation_size=2, max_completion_length=8, save_steps=1000)
    p = subprocess.Popen(_cmd("--max_steps", "10000", *common), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=ENV)
    metrics = os.path.join(out, "metrics.jsonl")
    _wait_for(lambda: os.path.exists(metrics) and os.path.getsize(metrics) > 0, p)
    p.send_signal(signal.SIGTERM)
    stdout, stderr = p.communicate(timeout=300)
    assert p.returncode == 0, stderr[-3000:]
    last = _rows(out)[-1]["step"]
    assert f"stopped after step {last} of 10000" in stdout and "--resume" in stdout
    assert os.path.isfile(os.path.join(out, f"checkpoint-{last}", "trainer_state.pt"))
    r = train_here("--max_steps", str(last + 1), "--resume", "--allow_changes", "max_steps", *common)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [x["step"] for x in _rows(out)] == list(range(1, last + 2))


def test_torn_last_line_is_dropped_but_a_torn_middle_line_is_an_error(tmp_path, tiny_args, train_here):
    out = str(tmp_path / "run")
    flags = tiny_args(out, save_steps=1, max_completion_length=4)
    assert train_here(*flags, "--max_steps", "2").returncode == 0
    metrics = os.path.join(out, "metrics.jsonl")
    good = _bytes(metrics)
    with open(metrics, "ab") as f:
        f.write(b'{"step": 3, "loss": 0.1, "rew')                          # what kill -9 mid-write leaves
    r = train_here(*flags, "--max_steps", "3", "--resume", "--allow_changes", "max_steps")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "metrics.jsonl: dropped a torn last line (3)" in r.stdout
    assert [x["step"] for x in _rows(out)] == [1, 2, 3]
    # a malformed line before the last is corruption: file:line, exit 2, nothing rewritten
    with open(metrics, "wb") as f:
        f.write(good.replace(b'"step": 1,', b'"step": 1,,'))
    broken = _bytes(metrics)
    r = train_here(*flags, "--max_steps", "4", "--resume", "--allow_changes", "max_steps")
    assert r.returncode == 2 and "metrics.jsonl:1: malformed JSON line" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and _bytes(metrics) == broken


def test_unreadable_config_is_a_clear_error(tmp_path, tiny_args, train_here):
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.json").write_text('{"method": "gtpo", "mod')
    r = train_here(*tiny_args(out, max_steps=1), "--resume")
    assert r.returncode == 2 and "config.json is unreadable" in r.stderr and "Traceback" not in r.stderr


def test_full_disk_while_saving_keeps_the_previous_checkpoint(tmp_path, tiny_args, monkeypatch):
    import errno
    from machinery import runs
    real = torch.save

    def save(obj, path, *a, **k):
        if "checkpoint-4" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(obj, path, *a, **k)
    monkeypatch.setattr(runs.torch, "save", save)
    out = tmp_path / "run"
    with pytest.raises(runs.SaveError, match="No space left on device.*checkpoint-2 is intact: free space, then rerun"):
        train.main(tiny_args(out, max_steps=4, save_steps=2))
    assert sorted(os.listdir(out)) == ["checkpoint-2", "config.json", "conflicts.json", "metrics.jsonl",
                                       "samples.jsonl"]                                  # no .tmp
    assert os.path.isfile(out / "checkpoint-2" / "trainer_state.pt")
    assert [x["step"] for x in _rows(str(out))] == [1, 2, 3, 4]
    monkeypatch.setattr(runs.torch, "save", real)
    assert train.main(tiny_args(out, max_steps=4, save_steps=2) + ["--resume"]) == 0   # space freed: it goes on
    assert [x["step"] for x in _rows(str(out))] == [1, 2, 3, 4]


# -----------------------------------------------------------------------------
# kill -9 at random moments, again and again (GTPO_CRASH_KILLS sets how many; CI runs a few)

def _train_state(out, log):
    """Where a kill landed in a training run, read off what this attempt printed and wrote."""
    if "trainable parameters" not in _text(log):
        return "startup/model load"
    if not os.path.isdir(out):                  # the model is loaded; train.py makes the folder later
        return "setup, before the run folder"
    tmp = [d for d in os.listdir(out) if d.endswith(".tmp")]
    if tmp:
        return "final save" if tmp == ["final.tmp"] else "checkpoint save"
    n = len(_rows(out)) if os.path.exists(os.path.join(out, "metrics.jsonl")) else 0
    return f"step {n + 1} (rollout, loss, backward or metrics write)" if n < 8 else "final save or exit"


def _eval_state(out, log):
    path = os.path.join(out, "samples.jsonl")
    if "eval " not in _text(log) or not os.path.exists(path):
        return "startup/model load"
    with open(path) as f:
        done = sum(1 for _ in f) // 2
    return f"sampling problem {done + 1}" if done < 12 else "results.json / plot write or exit"


def _crash_loop(start, kills, rng, window, where, logs):
    """Start the command, SIGKILL it after a random delay, start it again (with --resume once it
    has written something), until it finishes or `kills` kills are spent. Returns where each
    kill landed."""
    landed = []
    for k in range(kills + 1):
        log = os.path.join(logs, f"attempt{k}.log")
        t0, p = time.time(), start(log)
        try:
            p.wait(timeout=600 if k == kills else rng.uniform(*window))
        except subprocess.TimeoutExpired:
            p.send_signal(signal.SIGKILL)
            p.wait()
            landed.append(where(log))
            continue
        assert p.returncode == 0, _text(log)[-3000:]
        if k == 0:                  # a whole run, unkilled: later kills are drawn within its length
            window[1] = min(window[1], max(window[0] * 1.5, time.time() - t0))
        break
    return landed


def _timed_reference(cmd, log, ready):
    """Run the uninterrupted reference; the kill window runs from half the time it took to print
    `ready` (startup, mostly imports and model load) to its whole duration."""
    t0 = time.time()
    p = _popen(cmd, log)
    t_ready = None
    while p.poll() is None:
        if t_ready is None and ready in _text(log):
            t_ready = time.time() - t0
        time.sleep(0.02)
    assert p.returncode == 0, _text(log)[-3000:]
    return [0.5 * (t_ready or 0.3), time.time() - t0]


def _crash_runs(kills, rng, window, start_in, where, check, tmp_path):
    """Kill runs at random moments until `kills` kills are spent; each run that finishes is
    checked against the reference, and a new one begins. Returns where the kills landed. A kill
    drawn after a run has already ended does not land. The window is timed on one run and shortened
    to the length of any run that ends unkilled (load changes while the test runs); up to 3 x kills
    runs are allowed, each one checked."""
    landed = []
    for n in range(3 * kills):
        out = str(tmp_path / f"crash{n}")
        logs = tmp_path / f"logs{n}"
        logs.mkdir()
        got = _crash_loop(lambda log: start_in(out, log), kills - len(landed), rng, window,
                          lambda log: where(out, log), str(logs))
        landed += got
        check(out)
        if len(landed) >= kills:
            return landed
    return landed


def _text(path):
    with open(path) as f:
        return f.read()


def _popen(cmd, log):
    with open(log, "w") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, text=True,
                                env={**ENV, "PYTHONUNBUFFERED": "1"})      # the log shows how far it got


def test_random_kill9_during_training_then_resume_is_bit_exact(tmp_path, tiny_args):
    import random
    kills, seed = int(os.environ.get("GTPO_CRASH_KILLS", "3")), int(os.environ.get("GTPO_CRASH_SEED", "0"))
    rng = random.Random(seed)                                   # GTPO_CRASH_SEED replays a failure
    flags = lambda out: tiny_args(out, max_steps=8, save_steps=1, max_completion_length=16)   # noqa: E731
    a = str(tmp_path / "a")
    window = _timed_reference(_cmd(*flags(a)), str(tmp_path / "a.log"), "trainable parameters")
    wa = _adapter(os.path.join(a, "final"))

    def start_in(out, log):
        resume = ["--resume"] if os.path.exists(os.path.join(out, "config.json")) else []
        return _popen(_cmd(*flags(out), *resume), log)

    def check(out):
        assert [x["step"] for x in _rows(out)] == list(range(1, 9))      # each step exactly once
        for x, y in zip(_rows(a), _rows(out)):
            assert all(x.get(k) == y.get(k) for k in ("loss", "reward", "entropy", "grad_norm", "lr")), x["step"]
        wb = _adapter(os.path.join(out, "final"))
        assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    landed = _crash_runs(kills, rng, window, start_in, _train_state, check, tmp_path)
    print(f"train kills (seed {seed}, {len(landed)}): {landed}")
    assert len(landed) == kills


def test_random_kill9_during_eval_then_resume_gives_the_same_results(tmp_path, tiny_model_dir):
    import random
    kills, seed = int(os.environ.get("GTPO_CRASH_KILLS", "3")), int(os.environ.get("GTPO_CRASH_SEED", "0"))
    rng = random.Random(seed + 1)

    def cmd(out, resume=False):
        return [sys.executable, os.path.join(HERE, "eval.py"), "--model", tiny_model_dir, "--limit", "12",
                "--n_samples", "2", "--batch_size", "2", "--max_completion_length", "16", "--one_shot_from", "none",
                "--output_dir", out] + (["--resume"] if resume else [])
    a = str(tmp_path / "a")
    window = _timed_reference(cmd(a), str(tmp_path / "a.log"), "eval ")
    with open(os.path.join(a, "samples.jsonl")) as f:
        samples = f.read()
    with open(os.path.join(a, "results.json")) as f:
        ra = json.load(f)
    ra.pop("date")

    def start_in(out, log):
        return _popen(cmd(out, os.path.exists(os.path.join(out, "samples.jsonl"))), log)

    def check(out):
        with open(os.path.join(out, "samples.jsonl")) as f:
            assert f.read() == samples                                   # the same completions, in order
        with open(os.path.join(out, "results.json")) as f:
            rb = json.load(f)
        assert rb.pop("date") and rb == ra and ra["n_problems"] == 12
    landed = _crash_runs(kills, rng, window, start_in, _eval_state, check, tmp_path)
    print(f"eval kills (seed {seed}, {len(landed)}): {landed}")
    assert len(landed) == kills


# -----------------------------------------------------------------------------
# bad input: one clear message, exit code 2, nothing lost

def test_bad_inputs_fail_clearly(tmp_path, tiny_model_dir, train_here):
    bad_jsonl = tmp_path / "bad.jsonl"
    bad_jsonl.write_text('{"question": "1+1?", "answer": "2"}\n{"question": "2+2?", "answer": \n')
    no_cfg = tmp_path / "not_a_model"
    no_cfg.mkdir()
    cases = [
        (["--model", "/no/such/folder"], "unknown model '/no/such/folder'"),
        (["--model", str(no_cfg)], "has no config.json"),
        (["--dataset", str(tmp_path / "missing.jsonl")], "does not exist"),
        (["--model", tiny_model_dir, "--dataset", str(bad_jsonl)], "bad.jsonl:2"),
        (["--model", tiny_model_dir, "--max_prompt_length", "5"], "no training prompts left"),
        (["--generation_size", "1"], "need G >= 2"),
    ]
    for args, msg in cases:
        r = train_here("--output_dir", str(tmp_path / "x"), *args)
        assert r.returncode == 2, (args, r.stderr[-2000:])
        assert msg in r.stderr and "Traceback" not in r.stderr, (args, r.stderr[-2000:])


def _bytes(path):
    with open(path, "rb") as f:
        return f.read()


def test_resume_refusals_keep_the_run_intact(tmp_path, tiny_args, train_here):
    out = str(tmp_path / "run")

    def args(**over):
        return tiny_args(**{"out": out, "generation_size": 2, "max_completion_length": 4, "max_steps": 1, **over})
    assert train_here(*args()).returncode == 0
    before = {f: _bytes(os.path.join(out, f)) for f in ("metrics.jsonl", "config.json")}
    w_before = _adapter(os.path.join(out, "checkpoint-1"))
    for argv, msg in [(args(lora_rank="8") + ["--resume"], "lora_rank: 4 there vs 8 now"),
                      (args(generation_size="3") + ["--resume"], "generation_size: 2 there vs 3 now"),
                      (args(), "already holds a run")]:
        r = train_here(*argv)
        assert r.returncode == 2 and msg in r.stderr and "Traceback" not in r.stderr, (argv, r.stderr[-2000:])
        assert {f: _bytes(os.path.join(out, f)) for f in before} == before
        w = _adapter(os.path.join(out, "checkpoint-1"))
        assert all(torch.equal(w[k], w_before[k]) for k in w)
    # a run killed before its first checkpoint: --resume starts it again from step 0, and ends
    # exactly where an uninterrupted run ends
    empty = str(tmp_path / "empty")
    os.makedirs(empty)
    with open(os.path.join(empty, "config.json"), "wb") as f:
        f.write(before["config.json"])
    with open(os.path.join(empty, "metrics.jsonl"), "w") as f:
        f.write('{"step": 1, "loss": 0.5}\n{"step": 2, "lo')              # rows of the lost steps, torn
    r = train_here(*args(out=empty), "--resume")
    assert r.returncode == 0 and "has no checkpoint yet; starting from step 0" in r.stdout, r.stderr[-2000:]
    assert "dropped a torn last line (2)" in r.stdout
    assert [x["step"] for x in _rows(empty)] == [1] and _rows(empty)[0]["loss"] == _rows(out)[0]["loss"]
    w, w_before = _adapter(os.path.join(empty, "final")), _adapter(os.path.join(out, "final"))
    assert all(torch.equal(w[k], w_before[k]) for k in w)


def test_resume_refuses_a_changed_objective_or_schedule_unless_allowed(tmp_path, tiny_args, capsys):
    """The recipe and objective settings are the run's identity: --resume with another value stops
    with exit 2 and names the flag to allow it; --allow_changes continues and config.json records it."""
    out = str(tmp_path / "run")

    def args(*extra, **over):
        return tiny_args(**{"out": out, "generation_size": 2, "max_completion_length": 4, "max_steps": 1,
                            **over}) + list(extra)
    assert train.cli(args()) == 0
    before = _bytes(os.path.join(out, "config.json"))
    for over, key in [({"lr": "3e-4"}, "lr"), ({"beta": "0.04"}, "beta"), ({"entropy_filter": "all"}, "entropy_filter"),
                      ({"ent_gamma": "0.5"}, "ent_gamma"), ({"max_steps": "2"}, "max_steps"),
                      ({"temperature": "0.7"}, "temperature")]:
        assert train.cli(args("--resume", **over)) == 2
        err = capsys.readouterr().err
        assert f"{key}: " in err and f"--allow_changes {key}" in err, err
        assert _bytes(os.path.join(out, "config.json")) == before
    assert train.cli(args("--resume", "--allow_changes", "max_steps,lr", max_steps="2", lr="3e-4")) == 0
    cfg = json.loads(_bytes(os.path.join(out, "config.json")))
    assert cfg["max_steps"] == 2 and cfg["changes_on_resume"] == [
        {"at_step": 1, "lr": {"was": 1e-06, "now": 0.0003}, "max_steps": {"was": 1, "now": 2}}]
    assert [x["step"] for x in _rows(out)] == [1, 2]
    assert train.cli(args("--resume", "--allow_changes", "save_steps", max_steps="2")) == 2
    assert "not among the run's identity" in capsys.readouterr().err


def test_resumed_grpo_keeps_the_starting_model_as_reference(tmp_path, tiny_args, tiny_model_dir, monkeypatch):
    """Full fine-tuning with beta > 0 keeps a frozen copy as pi_ref: on --resume it is the model the
    run started from, not the checkpoint's weights."""
    from safetensors.torch import load_file
    refs, make = [], step.reference_model
    monkeypatch.setattr(step, "reference_model", lambda cfg, model: refs.append(make(cfg, model)) or refs[-1])
    out = str(tmp_path / "run")
    argv = tiny_args(out, lora_rank=0, max_steps=1, generation_size=2, max_completion_length=4, optimizer="adamw_torch",
                     lr=1e-2, warmup_ratio=0) + ["--use_grpo", "--beta", "0.04"]
    assert train.main(argv) == 0
    assert train.main(argv + ["--resume", "--allow_changes", "max_steps", "--max_steps", "2"]) == 0
    start = load_file(os.path.join(tiny_model_dir, "model.safetensors"))
    ckpt = load_file(os.path.join(out, "checkpoint-1", "model.safetensors"))
    ref = refs[-1].state_dict()
    name = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(ref[name], start[name]) and not torch.equal(ckpt[name], start[name])


# -----------------------------------------------------------------------------
# numerical degenerate cases (in-process, tiny model)

def _tiny(tmp_path, tiny_args, *extra):
    argv = tiny_args(tmp_path / "run", optimizer="adamw_torch", lr=1e-2, warmup_ratio=0, weight_decay=0)
    return train.main(argv + list(extra))


def test_all_equal_rewards_give_zero_gradient_not_nan(tmp_path, tiny_args, monkeypatch):
    """docs/reliability.md's row for a step whose groups all have equal rewards, objective by objective."""
    monkeypatch.setattr(rewards, "reward", lambda texts, answers, task, counts=None: (torch.full((len(texts),), 10.0),) * 2
                        + (torch.zeros(len(texts)),))
    # GRPO: zero advantages, so the step applies a zero gradient
    assert _tiny(tmp_path, tiny_args, "--max_steps", "2", "--use_grpo") == 0
    for r in _rows(str(tmp_path / "run")):
        assert r["frac_reward_zero_std"] == 1.0 and r["loss"] == 0.0 and r["grad_norm"] == 0.0
        assert "skipped_nonfinite" not in r
    w = _adapter(str(tmp_path / "run" / "final"))
    assert all(v.abs().sum() == 0 for k, v in w.items() if "lora_B" in k)    # no update at all
    # GTPO, both entropy terms: only the term acts -- the default (released) as -gamma <H>_i on the advantage,
    # eq7 as +gamma <H>_i with its own gradient -- so the loss is gamma <H> and the gradient is not zero
    grads = {}
    for term in ("released", "eq7"):
        assert _tiny(tmp_path, tiny_args, "--max_steps", "1", "--overwrite", "--entropy_term", term) == 0
        (r,) = _rows(str(tmp_path / "run"))
        assert r["frac_reward_zero_std"] == 1.0 and "skipped_nonfinite" not in r
        assert r["loss"] == pytest.approx(0.1 * r["entropy"], rel=1e-4) and 0 < r["grad_norm"] < float("inf")
        grads[term] = r["grad_norm"]
    assert grads["released"] != grads["eq7"]                          # two terms, two gradients
    # GTPO with gamma = 0 (either term): nothing acts, as GRPO
    assert _tiny(tmp_path, tiny_args, "--max_steps", "1", "--overwrite", "--ent_gamma", "0") == 0
    (r,) = _rows(str(tmp_path / "run"))
    assert r["frac_reward_zero_std"] == 1.0 and r["loss"] == 0.0 and r["grad_norm"] == 0.0


def test_nonfinite_loss_skips_the_step_then_stops_after_5(tmp_path, tiny_args, monkeypatch):
    monkeypatch.setattr(rewards, "reward", lambda texts, answers, task, counts=None: (torch.arange(len(texts)) % 2 * 10.0,) * 2
                        + (torch.zeros(len(texts)),))
    real = gtpo.gtpo_loss
    calls = {"n": 0}

    def nan_on_first_step(*a, **k):
        loss, m = real(*a, **k)
        calls["n"] += 1
        return (loss * float("nan") if calls["n"] == 1 else loss), m
    monkeypatch.setattr(gtpo, "gtpo_loss", nan_on_first_step)
    assert _tiny(tmp_path, tiny_args, "--max_steps", "2") == 0
    rows = _rows(str(tmp_path / "run"))
    assert rows[0]["skipped_nonfinite"] == 1 and "skipped_nonfinite" not in rows[1]
    assert all(torch.isfinite(v).all() for v in _adapter(str(tmp_path / "run" / "final")).values())

    monkeypatch.setattr(gtpo, "gtpo_loss", lambda *a, **k: (real(*a, **k)[0] * float("nan"), {}))
    out = tmp_path / "nan"
    with pytest.raises(FloatingPointError, match="5 consecutive steps"):
        train.main(tiny_args(out, max_steps=20, save_steps=2))
    assert [r["step"] for r in _rows(str(out))] == [1, 2, 3, 4, 5]
    assert os.path.isfile(out / "checkpoint-4" / "adapter_model.safetensors")    # what was written stays


# -----------------------------------------------------------------------------
# two processes, data-parallel (torchrun, gloo on CPU)

DDP_HELPER = '''
import os, sys, torch
sys.path.insert(0, {here!r})
import rewards, step, train
rank = int(os.environ["RANK"])
def fake_score(texts, answers, task, counts=None):          # rank 0 rewards 0,1,2,0 ; rank 1 the same + 10
    r = (torch.arange(len(texts)) % 3).float() + 10 * rank
    return r, r, torch.zeros_like(r)
rewards.reward = fake_score
sys.exit(train.main(sys.argv[1:]))
'''


DDP_METHODS_HELPER = '''
import json, os, sys, torch
sys.path.insert(0, {here!r})
import rewards, step, train
from machinery import runs
rank = int(os.environ["RANK"])
def fake_score(texts, answers, task, counts=None):          # spread within each group on both ranks
    r = (torch.arange(len(texts)) % 3).float() + rank
    return r, r, torch.zeros_like(r)
rewards.reward = fake_score
keys, mean = [], runs.Dist.mean
def record(self, values):                                   # the metric keys each rank averages
    keys.append(sorted(values))
    return mean(self, values)
runs.Dist.mean = record
stops, Flag = [], train.StopFlag
class Stop(Flag):                                           # STOP_AFTER: a SIGTERM after that many steps
    def __init__(self):
        super().__init__()
        stops.append(self)
train.StopFlag = Stop
step_, calls = train.optimizer_step, [0]
def counted(*a, **k):
    out = step_(*a, **k)
    calls[0] += 1
    if calls[0] == int(os.environ.get("STOP_AFTER", "0")):
        stops[0].signal = "SIGTERM"
    return out
train.optimizer_step = counted
code = train.main(sys.argv[1:])
with open(os.path.join(os.environ["KEYS_DIR"], f"keys-{{rank}}.json"), "w") as f:
    json.dump(keys, f)
sys.exit(code)
'''


def _torchrun(helper, argv, **env):
    run = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(helper)]
    return subprocess.run(run + argv, capture_output=True, text=True, env={**ENV, **env}, timeout=600)


@pytest.mark.parametrize("method", [["--use_gtpo"], ["--use_grpo"], ["--use_grpo", "--beta", "0.04"], ["--use_sft"]])
def test_two_ranks_every_method_same_metric_keys_and_weights(tmp_path, tiny_args, method):
    """Each method trains 2 steps on 2 ranks (gloo): every rank averages the same metric keys at
    every step, and the ranks end bit-identical (train.save_final checks and says so)."""
    helper = tmp_path / "ddp_methods.py"
    helper.write_text(DDP_METHODS_HELPER.format(here=HERE))
    out = tmp_path / "run"
    r = _torchrun(helper, tiny_args(out, max_steps=2, generation_size=2, max_completion_length=4,
                                    optimizer="adamw_torch", lr=1e-2, warmup_ratio=0) + method,
                  KEYS_DIR=str(tmp_path))
    assert r.returncode == 0, r.stderr[-4000:]
    assert "trainable weights bit-identical on all 2 ranks" in r.stdout
    k0, k1 = (json.loads((tmp_path / f"keys-{rank}.json").read_text()) for rank in (0, 1))
    assert len(k0) == 2 and k0 == k1
    assert [x["step"] for x in _rows(str(out))] == [1, 2]


def test_two_ranks_grpo_with_the_starting_adapter_as_reference(tmp_path, tiny_args):
    """GRPO beta > 0 after --init_from on 2 ranks: switching to the frozen reference adapter and back
    between the gradient passes leaves the ranks bit-identical and the KL 0 at step 1."""
    import train
    start = tmp_path / "sft"
    assert train.main(tiny_args(start, use_sft=True, max_steps=2, optimizer="adamw_torch", lr=1e-2,
                                warmup_ratio=0)) == 0
    helper = tmp_path / "ddp_methods.py"
    helper.write_text(DDP_METHODS_HELPER.format(here=HERE))
    out = tmp_path / "run"
    r = _torchrun(helper, tiny_args(out, use_grpo=True, beta=0.04, init_from=start / "final", max_steps=2,
                                    generation_size=2, max_completion_length=4, optimizer="adamw_torch", lr=1e-2,
                                    warmup_ratio=0), KEYS_DIR=str(tmp_path))
    assert r.returncode == 0, r.stderr[-4000:]
    assert "trainable weights bit-identical on all 2 ranks" in r.stdout
    assert _rows(str(out))[0]["kl"] == pytest.approx(0.0, abs=1e-6)


def test_two_ranks_finish_an_uneven_epoch_and_resume_across_ranks(tmp_path, tiny_args):
    """5 prompts on 2 ranks at batch 1: 2 steps an epoch, one prompt left out of each (logged);
    stopped after step 1 (SIGTERM on both ranks), then --resume: the epoch ends and final/ is written."""
    data = tmp_path / "five.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {i} + 1?", "answer": str(i + 1)}) + "\n"
                            for i in range(5)))
    helper = tmp_path / "ddp_methods.py"
    helper.write_text(DDP_METHODS_HELPER.format(here=HERE))
    out = tmp_path / "run"
    argv = tiny_args(out, dataset=str(data), epochs=2, max_steps=-1, save_steps=1, generation_size=2,
                     max_completion_length=4, optimizer="adamw_torch", lr=1e-2, warmup_ratio=0)
    r = _torchrun(helper, argv, KEYS_DIR=str(tmp_path), STOP_AFTER="1")
    assert r.returncode == 0, r.stderr[-4000:]
    assert "2 steps of 1 prompt(s) x 2 rank(s); 1 of 5 prompts left out of each epoch" in r.stdout
    assert "stopped after step 1 of 4" in r.stdout and not (out / "final").exists()
    r = _torchrun(helper, argv + ["--resume"], KEYS_DIR=str(tmp_path))
    assert r.returncode == 0, r.stderr[-4000:]
    assert "resumed from" in r.stdout and "trainable weights bit-identical on all 2 ranks" in r.stdout
    assert [x["step"] for x in _rows(str(out))] == [1, 2, 3, 4] and [x["epoch"] for x in _rows(str(out))] == [0, 0, 1, 1]
    assert (out / "final" / "adapter_model.safetensors").is_file()


def test_torchrun_two_processes(tmp_path, tiny_args):
    helper = tmp_path / "ddp_train.py"
    helper.write_text(DDP_HELPER.format(here=HERE))
    out = str(tmp_path / "ddp")
    common = tiny_args(out, save_steps=2, optimizer="adamw_torch", lr=1e-2, warmup_ratio=0)
    r = _torchrun(helper, common + ["--max_steps", "2"])
    assert r.returncode == 0, r.stderr[-4000:]
    assert "trainable weights bit-identical on all 2 ranks" in r.stdout
    rows = _rows(out)
    assert [x["step"] for x in rows] == [1, 2]                             # one writer
    # each rank's mean reward is 0.75 and 10.75: the logged value is their mean
    assert all(x["reward"] == pytest.approx(5.75) for x in rows)
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["world_size"] == 2
    w = _adapter(os.path.join(out, "final"))
    assert any(v.abs().sum() > 0 for k, v in w.items() if "lora_B" in k)
    r = _torchrun(helper, common + ["--max_steps", "3", "--resume", "--allow_changes", "max_steps"])
    assert r.returncode == 0, r.stderr[-4000:]
    assert "resumed from" in r.stdout and [x["step"] for x in _rows(out)] == [1, 2, 3]


DDP_LOSS_HELPER = '''
import dataclasses, json, os, sys, torch
sys.path.insert(0, {here!r})
sys.path.insert(0, os.path.join({here!r}, "tests"))
import rewards, step
from machinery import runs
from machinery.config import Config
from gtpo import Objective
from speedups.logprobs import PolicyPass
from machinery.models import load_tokenizer
from rollout import Rollout
from test_step import _fixed_rollout
from transformers import AutoConfig, AutoModelForCausalLM
from peft import LoraConfig, get_peft_model
model_dir, out, loss_types = sys.argv[1], sys.argv[2], sys.argv[3:]
rank, dist = int(os.environ["RANK"]), runs.Dist("cpu")

def tiny():                                     # conftest.tiny_lm(lora=True), the same weights on every call
    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"]))
    for n, p in model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.1)
    return model

tok = load_tokenizer(model_dir)
ro = _fixed_rollout(tok, AutoConfig.from_pretrained(model_dir).vocab_size, 2, 3, P=6, L=5)   # 2 prompts x 3, ragged
by_text = dict(zip(ro.texts, [0., 1, 2, 2, 0, 1]))
def reward(texts, answers, task, counts=None):
    r = torch.tensor([float(by_text[t]) for t in texts])
    return r, r, torch.zeros(len(texts))
rewards.reward = reward
mine = Rollout(**{{f.name: getattr(ro, f.name)[rank * 3:(rank + 1) * 3] for f in dataclasses.fields(ro)}})
results = {{}}
for loss_type in loss_types:
    cfg = Config(dataset="arithmetic", generation_size=3, max_completion_length=5, logprob_chunk=4,
                 objective=Objective(entropy_filter="off", loss_type=loss_type))
    model = tiny()
    step.rollout = lambda *a, **k: mine
    m, _, _ = step.rl_step(model, dist.wrap(PolicyPass(model)), tok, [["p", "q"][rank]], [["1", "2"][rank]], cfg,
                           ranks=dist)                                  # DDP averages the two ranks' gradients
    loss = dist.mean({{"loss": m["loss"]}})["loss"]
    if rank == 0:
        one = tiny()                                                    # one process, both prompts
        step.rollout = lambda *a, **k: ro
        m1, _, _ = step.rl_step(one, one, tok, ["p", "q"], ["1", "2"], cfg)
        got = {{n: p.grad for n, p in model.named_parameters() if p.grad is not None}}
        want = {{n: p.grad for n, p in one.named_parameters() if p.grad is not None}}
        results[loss_type] = {{"names": sorted(got) == sorted(want) and len(got) > 0, "loss_two": loss,
                              "loss_one": m1["loss"],
                              "max_diff": max((got[n] - want[n]).abs().max().item() for n in want),
                              "max_grad": max(want[n].abs().max().item() for n in want)}}
if rank == 0:
    with open(out, "w") as f:
        json.dump(results, f)
dist.close()
'''


def test_two_ranks_give_the_update_of_one_for_every_loss_type(tmp_path, tiny_model_dir):
    """Under torchrun (gloo), 2 ranks of one prompt each -- their completions 12 and 10 tokens long -- leave the
    gradients one process leaves with both prompts, for every loss type: dapo divides by the token count over
    all ranks (step.step_totals), not by each rank's own."""
    loss_types = ["grpo", "dapo", "dr_grpo", "luspo"]        # bnpo is each rank's own token mean
    helper, out = tmp_path / "ddp_loss.py", tmp_path / "losses.json"
    helper.write_text(DDP_LOSS_HELPER.format(here=HERE))
    r = _torchrun(helper, [tiny_model_dir, str(out), *loss_types])
    assert r.returncode == 0, r.stderr[-4000:]
    results = json.loads(out.read_text())
    assert sorted(results) == sorted(loss_types)
    for loss_type, res in results.items():
        assert res["names"] and res["max_grad"] > 1e-3, loss_type
        assert res["max_diff"] <= 1e-6 + 1e-4 * res["max_grad"], (loss_type, res)
        assert res["loss_two"] == pytest.approx(res["loss_one"], abs=1e-6), (loss_type, res)
