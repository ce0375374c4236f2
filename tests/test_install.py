"""`pip install .` gives the library under names that are ours alone (setup.py): the objective, the
reward (rewards.py, installed as gtpo_rewards), the gradient pass, with TRL GTPOTrainer, and what its example
reads (machinery/data.py and machinery/models.py as gtpo_data and gtpo_models, their imports of each other renamed with them) --
and a user's own rewards.py beside their script neither shadows it nor is shadowed."""
import glob
import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import ENV, HERE

LIBRARY = {"gtpo.py", "gtpo_logprobs.py", "gtpo_rewards.py", "gtpo_trl", "gtpo_data.py", "gtpo_models.py"}


def _source(tmp_path):
    """A copy of what `pip install .` reads: every top-level file of the clone and its code folders (the build
    writes build/ beside its source, so it is a copy), so the check also says that nothing else is installed."""
    src = tmp_path / "src"
    src.mkdir()
    for f in ["pyproject.toml", "README.md", *glob.glob(os.path.join(HERE, "*.py"))]:
        shutil.copy(os.path.join(HERE, f), src)
    for d in ("speedups", "machinery", "analysis", "gtpo_trl"):
        shutil.copytree(os.path.join(HERE, d), src / d, ignore=shutil.ignore_patterns("__pycache__"))
    return src


def _clean_env(**extra):
    return {k: v for k, v in ENV.items() if k != "PYTHONPATH"} | extra


@pytest.mark.slow                                  # real runs in this process or a child: the slow tier
def test_pip_install_gives_the_library_under_our_names_only(tmp_path):
    target, elsewhere = tmp_path / "site", tmp_path / "elsewhere"
    elsewhere.mkdir()
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                        "--target", str(target), str(_source(tmp_path))], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert {f for f in os.listdir(target) if not f.endswith((".dist-info", "__pycache__", "bin"))} == LIBRARY
    assert os.listdir(target / "bin") == ["gtpo-trl"]                   # the command line, pyproject's [project.scripts]
    script = r"""
import os, gtpo, gtpo_rewards, gtpo_data, gtpo_models
print("from", {os.path.dirname(m.__file__) for m in (gtpo, gtpo_rewards, gtpo_data, gtpo_models)})
assert gtpo_models.hub_unreachable is gtpo_data.hub_unreachable          # machinery/models.py's `from data import`, renamed
total, _, _ = gtpo_rewards.reward(["<reasoning>r</reasoning><answer>\\dfrac{\\sqrt{3}}{2}</answer>"],
                                  ["\\frac{\\sqrt3}{2}"], "math")          # math-verify, in its worker
print("reward", total.item())
for generic in ("rewards", "data", "config", "models", "step", "runs", "machinery", "speedups", "analysis"):
    try:
        __import__(generic)
        print("found", generic)
    except ModuleNotFoundError:
        pass
"""
    r = subprocess.run([sys.executable, "-c", script], cwd=elsewhere, env=_clean_env(PYTHONPATH=str(target)),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"from {{{str(target)!r}}}" in r.stdout and "reward 20.0" in r.stdout and "found" not in r.stdout


USERS_REWARDS = """
import torch
MINE = True
def brevity(completions, **_):              # the user's own reward term, in their own rewards.py
    return [-0.01 * len(c) for c in completions]
"""

USERS_SCRIPT = """
import sys, torch
import rewards                              # the user's own
import gtpo_rewards, gtpo_trl
from datasets import Dataset
from gtpo_trl import GTPOConfig, GTPOTrainer
from transformers import AutoModelForCausalLM, AutoTokenizer
assert rewards.MINE and gtpo_rewards.__file__ != rewards.__file__ and not hasattr(gtpo_rewards, "MINE")
model, tok = AutoModelForCausalLM.from_pretrained(sys.argv[1]), AutoTokenizer.from_pretrained(sys.argv[1])
ds = Dataset.from_list([{"prompt": "What is 1 + 1?", "answer": "2"}] * 8)
args = GTPOConfig(output_dir=sys.argv[2], num_generations=4, per_device_train_batch_size=4, max_completion_length=8,
                  max_steps=1, bf16=False, use_cpu=True, report_to="none", save_strategy="no", logging_steps=1)
trainer = GTPOTrainer(model=model, processing_class=tok, args=args, train_dataset=ds,
                      reward_funcs=[gtpo_rewards.trl_reward("gsm8k"), rewards.brevity])
trainer.train()
print("steps", trainer.state.global_step, "rewards", sorted(k for k in trainer.state.log_history[0] if "rewards/" in k))
"""


@pytest.mark.slow
def test_a_fresh_venv_runs_gtpotrainer_beside_the_users_own_rewards_py(tmp_path, tiny_model_dir):
    """A new venv (the machine's packages visible, nothing of the clone), `pip install .`, then a
    GTPOTrainer step from a folder that holds the user's own rewards.py, with both rewards; then the command line,
    as `gtpo-trl` and as `python -m gtpo_trl`."""
    pytest.importorskip("trl")
    venv, user = tmp_path / "venv", tmp_path / "user"
    # without a pip of its own, so that the build uses the machine's setuptools (offline: no isolation)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(venv)], check=True,
                   timeout=120)
    py = str(venv / "bin" / "python")
    r = subprocess.run([sys.executable, "-m", "pip", "--python", py, "install", "-q", "--no-deps",
                        "--no-build-isolation", str(_source(tmp_path))], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    user.mkdir()
    (user / "rewards.py").write_text(USERS_REWARDS)
    r = subprocess.run([py, "-c", USERS_SCRIPT, tiny_model_dir, str(tmp_path / "out")], cwd=user, env=_clean_env(),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "steps 1 rewards" in r.stdout and "rewards/paper_reward/mean" in r.stdout and "rewards/brevity/mean" in r.stdout
    for command in ([str(venv / "bin" / "gtpo-trl")], [py, "-m", "gtpo_trl"]):       # the script, and -m as from the tree
        r = subprocess.run(command + ["--help"], cwd=user, env=_clean_env(), capture_output=True, text=True, timeout=300)
        assert r.returncode == 0 and "--reward_funcs" in r.stdout and "--conflict_weight" in r.stdout, r.stderr[-2000:]


def _trl_snippet():
    """The Python block of docs/trl.md's "In a script of your own", as written."""
    with open(os.path.join(HERE, "docs", "trl.md")) as f:
        section = f.read().split("## In a script of your own", 1)[1].split("\n## ", 1)[0]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


@pytest.mark.slow
def test_the_trl_snippet_and_the_example_run_as_written(tmp_path, capsys):
    """docs/trl.md "In a script of your own": after `pip install .` the snippet runs as written from a folder outside the clone
    (nothing of the clone on the path), earns rewards that differ within a group (so a gradient flows) and
    writes under runs/; `python -m gtpo_trl --example --max_steps 1` leaves an adapter and metrics that eval.py reads;
    the [trl] extra names what they import."""
    pytest.importorskip("trl")
    import tomllib

    import gtpo_trl
    from eval import main as eval_main
    with open(os.path.join(HERE, "pyproject.toml"), "rb") as f:
        extra = tomllib.load(f)["project"]["optional-dependencies"]["trl"]
    assert {d.split(">")[0].split("=")[0].split("<")[0] for d in extra} >= {"trl", "transformers", "peft", "datasets",
                                                                            "gguf"}
    target, user = tmp_path / "site", tmp_path / "user"
    user.mkdir()
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                        "--target", str(target), str(_source(tmp_path))], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    snippet = _trl_snippet()
    assert "max_steps=1" in snippet and snippet.count("\n") <= 13
    r = subprocess.run([sys.executable, "-c", snippet], cwd=user, capture_output=True, text=True, timeout=900,
                       env=_clean_env(PYTHONPATH=str(target), PYTHONWARNINGS="default"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "FutureWarning" not in r.stderr                             # TRL's renamed-name warnings, silenced
    with open(user / "runs" / "gtpo-trl-snippet" / "checkpoint-1" / "trainer_state.json") as f:
        steps = [row for row in json.load(f)["log_history"] if "reward" in row]
    assert len(steps) == 1 and steps[0]["reward_std"] > 0 and steps[0]["grad_norm"] > 0   # rewards earned, spread
    out = tmp_path / "example"                                        # `python -m gtpo_trl ...`, in this process
    gtpo_trl.main(["--example", "--max_steps", "1", "--max_completion_length", "16", "--output_dir", str(out)])
    assert f"done: adapter in {out / 'final'}" in capsys.readouterr().out
    assert (out / "final" / "adapter_config.json").is_file()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["learning_rate"] > 0 and "train_runtime" in rows[-1]      # the one step moved the weights
    assert eval_main(["--adapter", str(out / "final"), "--limit", "1", "--n_samples", "1",
                      "--max_completion_length", "16", "--output_dir", str(tmp_path / "eval")]) == 0
    assert (tmp_path / "eval" / "results.json").is_file()
