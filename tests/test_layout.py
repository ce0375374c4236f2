"""The house's shape, read from the files themselves: the root is the reading path (the card's files and at most two
more), everything else in folders named for what they hold; no import circle among the project's modules (from
their own import statements, in functions too); no code file past 500 lines (tests aside); every path the pages
name exists."""
import ast
import glob
import os

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FOLDERS = ["speedups", "machinery", "analysis", "gtpo_trl", "bench", "study"]
CODE = ["*.py"] + [f"{d}/*.py" for d in FOLDERS]
CARD = {"gtpo.py", "rewards.py", "rollout.py", "train.py", "eval.py", "test_gtpo.py"}    # the reading path's files


def modules():
    """{module name: its file} of the project's code: the root's files and the folders' (FOLDERS)."""
    files = [f for pattern in CODE for f in glob.glob(os.path.join(HERE, pattern))]
    names = {}
    for f in files:
        rel = os.path.relpath(f, HERE)[:-3].replace(os.sep, ".")
        names[rel[:-len(".__init__")] if rel.endswith(".__init__") else rel] = f
    return names


def imports(path, known):
    """The project modules that `path` imports anywhere in it (top level or inside a function)."""
    found = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}      # `from study import report`
    return {m for m in found if m in known}


def circles(graph):
    """Every import circle of a {module: imported modules} graph, each once, as [a, b, ..., a]."""
    found, seen = [], set()

    def walk(path):
        for nxt in sorted(graph[path[-1]]):
            if nxt == path[0]:
                cycle = path + [nxt]
                key = frozenset(cycle)
                if key not in seen:
                    seen.add(key)
                    found.append(cycle)
            elif nxt not in path and nxt > path[0]:                       # each circle from its least module
                walk(path + [nxt])
    for start in sorted(graph):
        walk([start])
    return found


def test_circles_finds_a_planted_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert sorted(map(tuple, circles(graph))) == [("a", "b", "c", "a"), ("e", "e")]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_among_the_projects_modules():
    known = modules()
    graph = {m: imports(f, known) - {m} for m, f in known.items()}
    assert len(graph) > 30 and graph["step"] >= {"gtpo", "rollout", "speedups.logprobs"}   # the graph is the project's
    assert circles(graph) == []


def test_no_code_file_over_500_lines():
    long = {os.path.relpath(f, HERE): n for f in modules().values()
            if not os.path.basename(f).startswith("test_") and (n := sum(1 for _ in open(f))) > 500}
    assert long == {}


def test_gitignore_hides_what_the_project_writes_not_a_users_data():
    """runs/ and the benchmarks' outputs are ignored; a user's own .jsonl data file, anywhere, is not."""
    import shutil
    import subprocess
    import pytest
    if shutil.which("git") is None or not os.path.isdir(os.path.join(HERE, ".git")) and \
            not os.path.isfile(os.path.join(HERE, ".git")):
        pytest.skip("not a git checkout")

    def ignored(path):
        return subprocess.run(["git", "check-ignore", "-q", "--no-index", path], cwd=HERE).returncode == 0
    assert ignored("runs/gtpo-x/metrics.jsonl") and ignored("runs/eval-x/samples.jsonl") and ignored("bench.json")
    assert not ignored("mine.jsonl") and not ignored("my_data/train.jsonl") and not ignored("study/runs/x/metrics.jsonl")


def test_the_root_is_the_reading_path():
    """`ls *.py`: the card's files, at most two more that README's reading order names, and setup.py; every other
    module lives in a folder with an __init__.py that says what the folder holds."""
    import re
    root = {os.path.basename(f) for f in glob.glob(os.path.join(HERE, "*.py"))}
    more = root - CARD - {"setup.py"}
    assert CARD <= root and len(more) <= 2, more
    readme = open(os.path.join(HERE, "README.md")).read()
    order = readme[readme.index("## Reading order"):].split("\n## ", 1)[0]
    assert all(f in order for f in more), more
    for d in FOLDERS[:4]:
        doc = ast.get_docstring(ast.parse(open(os.path.join(HERE, d, "__init__.py")).read()))
        files = {os.path.basename(f) for f in glob.glob(os.path.join(HERE, d, "*.py"))} - {"__init__.py", "__main__.py"}
        assert doc and files and all(re.search(rf"\b{re.escape(f)}\b", doc) for f in files), d


def named_paths(text):
    """The repository paths a page names: `folder/file.ext` or a root file `name.py`, in or out of backticks, outside
    runs/ (what a run writes) and placeholders (<...>, *, ~, $)."""
    import re
    found = set(re.findall(r"(?<![\w./~<$-])((?:[\w.-]+/)+[\w.-]+\.(?:py|md|json|png|yaml|txt|html|jsonl)|[\w-]+\.py)\b",
                           text))
    return {p for p in found if not p.startswith(("runs/", "runs-")) and "/runs/" not in p}


def test_every_path_the_pages_name_exists():
    """README and docs/ name files of the tree (machinery/config.py, study/q10.png, ...): each exists, relative to the
    root or, for a page in docs/, to docs/. A user's own file the pages name as an example is listed here."""
    examples = {"mine.py", "recipe.yaml", "my_reward.py", "train.jsonl", "mine.jsonl", "my_script.py"}
    pages = ["README.md"] + [os.path.join("docs", f) for f in os.listdir(os.path.join(HERE, "docs")) if f.endswith(".md")]
    missing = []
    for page in pages:
        text = open(os.path.join(HERE, page)).read()
        for p in sorted(named_paths(text)):
            if os.path.basename(p) in examples or p.split("/")[0].isupper() or p.startswith(("study/runs/", "../", "path/to/")):
                continue
            if not (os.path.exists(os.path.join(HERE, p)) or os.path.exists(os.path.join(HERE, "docs", p))):
                missing.append(f"{page}: {p}")
    assert not missing, missing


def test_readme_opens_with_the_objective_and_the_reading_order():
    """README is a learner's first: at most 10,000 characters, and its first 80 lines hold the objective's equations
    (Eq. 1, 5-8), each beside the function that computes it, then the reading order."""
    text = open(os.path.join(HERE, "README.md")).read()
    first = "\n".join(text.splitlines()[:80])
    assert len(text) <= 10_000, len(text)
    for eq, function in (("Eq. 1", "gtpo.grpo_loss"), ("Eq. 8", "gtpo.group_advantages"), ("Eq. 5", "gtpo.conflict_weights"),
                         ("Eq. 6", "gtpo.filter_deltas"), ("Eq. 7", "gtpo.gtpo_loss"), ("Eq. 7", "gtpo.released_advantages")):
        assert eq in first and function in first, (eq, function)
    assert "## Reading order" in first and first.index("## The objective") < first.index("## Reading order")


def test_the_loop_and_the_settings_read_in_one_pass():
    """train.py at most 400 lines with no function over 50 (the loop reads top to bottom); machinery/config.py at
    most 450 lines."""
    tree = ast.parse(open(os.path.join(HERE, "train.py")).read())
    long = {n.name: n.end_lineno - n.lineno + 1 for n in ast.walk(tree)
            if isinstance(n, ast.FunctionDef) and n.end_lineno - n.lineno + 1 > 50}
    assert sum(1 for _ in open(os.path.join(HERE, "train.py"))) <= 400 and long == {}
    assert sum(1 for _ in open(os.path.join(HERE, "machinery", "config.py"))) <= 450
