"""`pip install .` (or `pip install "gtpo[trl] @ git+<repo URL>"`): the library a TRL user imports. The training
loop and the study run from a clone.

One rule names what it installs: a file keeps its name, prefixed gtpo_ and without its folder (rewards.py ->
gtpo_rewards, speedups/logprobs.py -> gtpo_logprobs, machinery/data.py -> gtpo_data); gtpo.py and the package
gtpo_trl/ bear the prefix already. Each import of the clone's names is renamed with it, so nothing generic (rewards,
data, config) lands on a user's path, and a user's own rewards.py neither shadows ours nor is shadowed."""
import os
import re

from setuptools import setup
from setuptools.command.build_py import build_py

# the objective, the reward, the gradient pass, and what GTPOTrainer's example reads (the prompt format and
# built-in tasks, the embedded model); with the package gtpo_trl/ (the trainer, its command line, the example)
LIBRARY = ["gtpo.py", "rewards.py", "speedups/logprobs.py", "machinery/data.py", "machinery/models.py"]
PACKAGE = "gtpo_trl"


def installed(path):
    """The rule: the name a file of the clone is installed under."""
    name = os.path.basename(path)[:-3]
    return name if name.startswith("gtpo") else f"gtpo_{name}"


FOLDER_IMPORT = re.compile(r"^(\s*)from (speedups|machinery|analysis)\.(\w+) import", re.M)    # from machinery.data import
FOLDER_MODULE = re.compile(r"^(\s*)from (speedups|machinery|analysis) import (\w+)$", re.M)     # from machinery import data
ROOT_IMPORT = re.compile(r"^(\s*)(from|import) (rewards)\b", re.M)                              # import rewards


def renamed(text):
    """A file's imports of the clone's names turned into the installed ones; one the library does not hold fails."""
    held = {installed(p) for p in LIBRARY}

    def name(folder, module):
        if f"gtpo_{module}" not in held:
            raise ValueError(f"the library imports {folder}.{module}, which setup.LIBRARY does not install")
        return f"gtpo_{module}"
    text = FOLDER_IMPORT.sub(lambda m: f"{m[1]}from {name(m[2], m[3])} import", text)
    text = FOLDER_MODULE.sub(lambda m: f"{m[1]}import {name(m[2], m[3])} as {m[3]}", text)
    return ROOT_IMPORT.sub(lambda m: f"{m[1]}{m[2]} gtpo_rewards" + (" as rewards" if m[2] == "import" else ""), text)


class BuildLibrary(build_py):
    def find_modules(self):
        """(package, module, file) of each installed module: its file bears another name, in its folder."""
        return [("", installed(path), path) for path in LIBRARY]

    def build_module(self, module, module_file, package):
        """Copy the module with its imports renamed (renamed)."""
        out = super().build_module(module, module_file, package)
        with open(out[0]) as f:
            text = f.read()
        with open(out[0], "w") as f:
            f.write(renamed(text))
        return out


setup(py_modules=[installed(p) for p in LIBRARY], packages=[PACKAGE], cmdclass={"build_py": BuildLibrary})
