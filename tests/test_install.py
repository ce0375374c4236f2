"""`pip install .` gives a TRL user GTPOConfig/GTPOTrainer, the objective and the reward under names
that are clearly ours, importable from outside the clone (pyproject.toml)."""
import glob
import os
import shutil
import subprocess
import sys

from conftest import ENV, HERE

LIBRARY = {"gtpo.py", "gtpo_logprobs.py", "gtpo_rewards.py", "gtpo_trl.py"}

USER_SCRIPT = r"""
import gtpo, gtpo_rewards, gtpo_trl
from gtpo_trl import GTPOConfig, GTPOTrainer
print("from", {os.path.dirname(m.__file__) for m in (gtpo, gtpo_rewards, gtpo_trl)})
total, _, _ = gtpo_rewards.score(["<reasoning>r</reasoning><answer>\\dfrac{\\sqrt{3}}{2}</answer>"],
                                 ["\\frac{\\sqrt3}{2}"], "math")          # math-verify, in its worker
print("reward", total.item())
try:
    import data
except ModuleNotFoundError:
    print("no data module")
"""


def test_pip_install_gives_the_library_under_our_names_only(tmp_path):
    """Built from a copy of every top-level module (the build writes build/ beside its source), so
    the check also says that nothing but the library is installed."""
    src, target, elsewhere = tmp_path / "src", tmp_path / "site", tmp_path / "elsewhere"
    src.mkdir(), elsewhere.mkdir()
    for f in ["pyproject.toml", "README.md", *glob.glob(os.path.join(HERE, "*.py"))]:
        shutil.copy(os.path.join(HERE, f), src)
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                        "--target", str(target), str(src)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    top = {f for f in os.listdir(target) if not f.endswith((".dist-info", "__pycache__"))}
    assert top == LIBRARY
    env = {k: v for k, v in ENV.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(target)}
    script = "import os\n" + USER_SCRIPT
    r = subprocess.run([sys.executable, "-c", script], cwd=elsewhere, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"from {{{str(target)!r}}}" in r.stdout
    assert "reward 20.0" in r.stdout and "no data module" in r.stdout
