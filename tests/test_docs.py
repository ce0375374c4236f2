"""The pages' figures that live in committed files agree with those files (docs/*.json, study/runs/)."""
import json
import os

import pytest

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def page(name):
    with open(os.path.join(HERE, name)) as f:
        return " ".join(f.read().split())


def test_released_count_figures_are_the_benchmarks():
    """docs/training.md, "The authors' code, checked", quotes docs/released-count.json (python -m bench.released)."""
    with open(os.path.join(HERE, "docs", "released-count.json")) as f:
        s = json.load(f)["summary"]
    text = page("docs/training.md")
    share = round(100 * s["count_differs"] / s["active"])
    assert (f"{s['count_differs']} of the {s['active']} completions with A ≠ 0 ({share} %)" in text
            and f"on {s['steps_count_differs']} of the {s['steps_with_active']} steps" in text
            and f"{s['norm_ratio_min']:.2f}–{s['norm_ratio_max']:.2f} × the union count's "
                f"(median {s['norm_ratio_median']:.2f})" in text)


def bash_commands(text, program):
    """The `python <program> ...` commands of a page's ```bash blocks, continuation lines joined, as argv lists."""
    import shlex
    blocks = [b.split("```", 1)[0] for b in text.split("```bash\n")[1:]]
    lines = " ".join(b.replace("\\\n", " ") for b in blocks).replace("\n", " ; ")
    return [shlex.split(c.strip().split("#")[0])[2:] for c in lines.split(" ; ")
            if c.strip().startswith(f"python {program}")]


def test_part5_replicate_commands_give_the_committed_configs():
    """docs/results.md's Part 5 commands, parsed as train.py parses them, set every setting the committed
    config.json records (the folder's run), except settings those runs predate (absent there) and init_from's
    absolute path."""
    from machinery import config
    with open(os.path.join(HERE, "docs", "results.md")) as f:
        text = f.read()
    cmds = bash_commands(text[text.index("GRPO seed 28's commands"):], "train.py")
    assert len(cmds) == 2
    for argv in cmds:
        cfg = config.parse_args(argv)
        run = os.path.basename(cfg.output_dir)
        with open(os.path.join(HERE, "study", "runs", "replicate", run, "config.json")) as f:
            old = json.load(f)
        keys = [k for k in config.identity_keys() if k in old and k != "init_from" and old[k] is not None]
        assert {k: config.record(cfg)[k] for k in keys} == {k: old[k] for k in keys}, run
        assert (cfg.init_from or "").endswith(old["init_from"].split("/runs/", 1)[-1] if old["init_from"] else "")


# Size overrides appended to each line: fewer and shorter samples and fewer steps, the same code path. The bare
# `python train.py` keeps its completion length, which README's printed <H>_ini line depends on.
QUICK_OVERRIDES = {"train.py": ["--generation_size", "2"],                   # SFT's and RL's samples per prompt
                   "eval.py --adapter": ["--limit", "2", "--n_samples", "2"], "eval.py --limit": ["--limit", "2", "--n_samples", "2"]}
SHORT = ["--max_completion_length", "16"]


@pytest.mark.slow
def test_the_quick_start_runs_as_written_in_order(tmp_path):
    """README's Quick start, its `python` lines top to bottom in a fresh folder, each with size overrides appended
    (QUICK_OVERRIDES) and nothing else changed: every line exits 0, the demo prints README's lines, and the two
    adapters' evaluations land in two folders (one would refuse the other's)."""
    import subprocess
    import sys
    with open(os.path.join(HERE, "README.md")) as f:
        text = f.read()
    block = text[text.index("## Quick start"):].split("```bash\n", 1)[1].split("```", 1)[0]
    lines = [ln.split("#")[0].strip() for ln in block.splitlines() if ln.startswith("python ")]
    assert len(lines) == 7
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore", "TOKENIZERS_PARALLELISM": "false"}
    for line in lines:
        script, rest = line.split()[1], line.split(" ", 2)[2] if len(line.split()) > 2 else ""
        extra = next((v for k, v in QUICK_OVERRIDES.items() if (script + " " + rest).startswith(k)), [])
        if "--plot" in rest or "--curves" in rest:
            extra = []                                                      # plots: no samples
        elif line == "python train.py":
            extra = extra + ["--max_steps", "9"]                            # the 8 SFT steps (checkpoint-8), 1 RL step
        else:
            extra = extra + SHORT                                           # no printed line depends on them
        cmd = f"{sys.executable} {os.path.join(HERE, script)} {rest} {' '.join(extra)}"
        r = subprocess.run(["bash", "-c", cmd], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1200)
        assert r.returncode == 0, (line, r.stderr[-3000:])
        if line == "python train.py":                                       # README's block is what it prints
            printed = text[text.index("What it prints"):].split("```\n", 1)[1].split("```", 1)[0].splitlines()
            said = [ln for ln in printed if "|" not in ln and not ln.startswith("model ")]   # bars, cache path
            assert len(said) == 5 and all(ln in r.stdout.splitlines() for ln in said), (said, r.stdout)
            assert "trainable parameters, LoRA rank 32" in r.stdout
    evals = sorted(p.name for p in (tmp_path / "runs").glob("eval-*"))
    assert len(evals) == 3 and any(e.endswith("-final") for e in evals) and any(e.endswith("-checkpoint-8")
                                                                                for e in evals), evals
    assert (tmp_path / "runs" / "plots" / "passk.png").is_file() and (tmp_path / "runs" / "try" / "final").is_dir()


def test_results_what_to_run_is_the_studys_committed_verdicts():
    """docs/results.md's "What to run" quotes Q6-Q8's tests as study.verdicts computes them from study/runs/."""
    from study import plan, verdicts

    def row(key, claim):
        p = plan.part(key)
        return next(r for t, r in zip(p.tests, verdicts.test_rows(p, p.tests)) if t.claim == claim)
    text = page("docs/results.md")
    q7, q8_eq7, q8_grpo = row("q7", "GTPO above GRPO"), row("q8", "released − Eq. 7"), row("q8", "released − GRPO")
    q6 = row("q6", "GRPO collapses more often than GTPO with Eq. 7")
    assert f"({q7['mean']:+.3f}, p = {q7['p']:.3f})".replace("-", "−") in text
    assert f"above Eq. 7 ({q8_eq7['mean']:+.3f}, p = {q8_eq7['p']:.3f})" in text
    assert f"level with GRPO ({q8_grpo['mean']:+.3f}, within noise)" in text and "within noise" in q8_grpo["verdict"]
    assert f"collapsed in {q6['counts'][1]} of 8 seeds (GRPO {q6['counts'][0]}, p = {q6['p']:.3f})" in text


def test_results_q9_sentence_is_the_studys():
    """docs/results.md's Q9 sentence: the warm-ups' and arms' mean ID (OOD) pass@1 as study.report computes them."""
    from study import answers, plan, report
    a = next(x for x in answers.ANSWERS if x.q == "Q9")
    outcome, text = report.gain_outcome(a), page("docs/results.md")
    warm = outcome.split("warm-up ")[1].split(" →")[0]                              # "0.227 (0.137)"
    assert f"ID (OOD) pass@1 {warm} after the 32-step SFT" in text
    for label, words in (("GTPO, released term", "with the released term"), ("GRPO β=0", "with GRPO"),
                         ("GTPO, Eq. 7", "with Eq. 7")):
        assert f"{outcome.split(label + ' ')[1].split(';')[0]} {words}" in text


PAGES = ["README.md"] + sorted(os.path.join("docs", f) for f in os.listdir(os.path.join(HERE, "docs")) if f.endswith(".md"))
OTHER_TOOLS = {"index_url", "no_deps", "nproc_per_node", "num_processes", "config_file", "help", "nnodes",
               "rdzv_backend", "rdzv_endpoint", "rdzv_id", "node_rank", "num_machines", "machine_rank",
               "main_process_ip", "main_process_port", "mixed_precision", "multi_gpu", "accelerate_config",
               "per_device_train_batch_size", "eval_strategy", "logging_steps",   # GRPOConfig's (python -m gtpo_trl)
               "lora_target_modules",                                            # TRL's ModelConfig
               "max_step"}          # pip's, torchrun's, accelerate's, TRL's; --max_step: training.md's refused abbreviation


def names(module):
    """The names a module of ours defines at its top level (functions, classes, assignments, imports; a class's
    methods as Class.method's last part too), read from its source: no import, so optional packages (TRL) need not
    be installed."""
    import ast
    tree = ast.parse(open(os.path.join(HERE, module.replace(".", "/") + ".py")).read())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            found.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            found |= {t.id for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                      if isinstance(t, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            found |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return found


def test_every_flag_and_function_the_pages_name_exists():
    """Each `--flag` on a page is one our scripts declare (or pip's, torchrun's, accelerate's, TRL's), each `module.name`
    in backticks is an attribute of that module of ours, and each test_* named is a test that exists."""
    import glob
    import re
    from machinery import config
    sources = [p for p in glob.glob(os.path.join(HERE, "**", "*.py"), recursive=True) if "/runs/" not in p]
    declared = {name for name, _, _ in config.settings()} | OTHER_TOOLS
    code = {p: open(p).read() for p in sources}
    for text in code.values():
        declared |= {m.replace("-", "_") for m in re.findall(r'"--([A-Za-z][\w-]*)', text)}
    modules = {os.path.relpath(p, HERE)[:-3].replace("/", ".") for p in sources}
    tests = {m for p, text in code.items() if "/tests/" in p or p.endswith("test_gtpo.py")
             for m in re.findall(r"^def (test_\w+)", text, re.M)}
    wrong = []
    for name in PAGES:
        with open(os.path.join(HERE, name)) as f:
            text = f.read()
        for flag in re.findall(r"(?<![\w-])--([A-Za-z][\w-]*)", text):
            key = flag.replace("-", "_")
            if key not in declared and key.removeprefix("no_") not in declared:
                wrong.append(f"{name}: --{flag}")
        for span in re.findall(r"`([^`\n]+)`", text.replace("```", "\n")):       # inline code, line by line
            for mod, attr in re.findall(r"\b([a-z_]+(?:\.[a-z_]+)?)\.([A-Za-z_]\w*)", span):
                if mod in modules and attr not in ("py", "json", "md", "png", "jsonl") and attr not in names(mod):
                    wrong.append(f"{name}: {mod}.{attr}")
        wrong += [f"{name}: {t}" for t in set(re.findall(r"(?<![.\w])test_[a-z0-9_]+\b", text)) - tests
                  if t not in {m.rsplit(".", 1)[-1] for m in modules}]             # a test file's name
    assert not wrong, wrong


HISTORY = ("earlier session", "previous session", "last session", "this session", "last turn", "previous turn",
           "earlier version of this page", "used to be", "no longer", "was changed")


def test_pages_speak_in_the_present_not_of_their_history():
    """Docs are present tense and current: history lives in `git log`, not in the pages."""
    import re
    found = []
    for name in PAGES:
        text = " ".join(open(os.path.join(HERE, name)).read().split()).lower()
        found += [f"{name}: ...{text[max(0, m.start() - 40):m.end() + 20]}..." for phrase in HISTORY
                  for m in re.finditer(re.escape(phrase), text)]
    assert not found, found
