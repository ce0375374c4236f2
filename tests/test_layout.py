"""The house's shape, read from the files themselves: no import circle among the project's modules (from
their own import statements, in functions too), and no code file past 500 lines (tests aside)."""
import ast
import glob
import os

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CODE = ["*.py", "bench/*.py", "study/*.py"]


def modules():
    """{module name: its file} of the project's code: the root's files, bench's and study's."""
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
    assert len(graph) > 30 and graph["step"] >= {"gtpo", "rollout"}    # the graph is the project's
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
