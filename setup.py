"""`pip install .` (or `pip install "gtpo[trl] @ git+<repo URL>"`): the library a TRL user imports, each
module under a name that is ours, so that nothing generic lands on the user's path and a user's own
rewards.py or data.py neither shadows ours nor is shadowed. The training loop and the study run from a clone."""
import re

from setuptools import setup
from setuptools.command.build_py import build_py

# installed module -> its file in the clone: the objective, the gradient pass, the reward, the trainer and its
# command line (`gtpo-trl`), and what the trainer's example reads (the prompt format and built-in tasks, the
# embedded model)
LIBRARY = {"gtpo": "gtpo.py", "gtpo_logprobs": "gtpo_logprobs.py", "gtpo_rewards": "rewards.py",
           "gtpo_trl": "gtpo_trl.py", "gtpo_trl_cli": "trl_cli.py", "gtpo_data": "data.py", "gtpo_models": "models.py"}
RENAMED = {file[:-3]: module for module, file in LIBRARY.items() if file[:-3] != module}   # rewards -> gtpo_rewards
IMPORT = re.compile(r"^(\s*)(from|import) (" + "|".join(RENAMED) + r")\b", re.M)


class BuildLibrary(build_py):
    def find_modules(self):
        """(package, module, file) of each installed module: its file may bear another name."""
        return [("", module, LIBRARY[module])                               # relative to setup.py
                for module in self.py_modules]

    def build_module(self, module, module_file, package):
        """Copy the module, its imports of the clone's names (`from data import ...`) turned into ours."""
        out = super().build_module(module, module_file, package)
        with open(out[0]) as f:
            text = f.read()
        with open(out[0], "w") as f:
            f.write(IMPORT.sub(lambda m: f"{m[1]}{m[2]} {RENAMED[m[3]]}", text))
        return out


setup(py_modules=list(LIBRARY), cmdclass={"build_py": BuildLibrary})
