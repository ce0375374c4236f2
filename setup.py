"""`pip install .` (or `pip install "gtpo[trl] @ git+<repo URL>"`): the library a TRL user imports, each
module under a name that is ours, so that nothing generic lands on the user's path and a user's own
rewards.py neither shadows ours nor is shadowed. The training loop and the study run from a clone."""
from setuptools import setup
from setuptools.command.build_py import build_py

# installed module -> its file in the clone: the objective, the gradient pass, the reward, the trainer
LIBRARY = {"gtpo": "gtpo.py", "gtpo_logprobs": "gtpo_logprobs.py", "gtpo_rewards": "rewards.py",
           "gtpo_trl": "gtpo_trl.py"}


class BuildLibrary(build_py):
    def find_modules(self):
        """(package, module, file) of each installed module: its file may bear another name."""
        return [("", module, LIBRARY[module])                               # relative to setup.py
                for module in self.py_modules]


setup(py_modules=list(LIBRARY), cmdclass={"build_py": BuildLibrary})
