"""Tests for rewards.py: hand-written tricky cases and acceptance checks on the real
datasets in $GTPO_DATA_DIR (../shared/data in CI; skipped with a reason if absent)."""
import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import ENV, HERE
from rewards import (answers_equal, extract_answer, format_reward, latex_equal, parse_number, score)

DATA = os.environ.get("GTPO_DATA_DIR")


def wrap(ans):
    return f"<reasoning>\nsteps\n</reasoning>\n<answer>\n{ans}\n</answer>"


# -----------------------------------------------------------------------------
# formatting and extraction

@pytest.mark.parametrize("text,expect", [
    ("<reasoning>a</reasoning><answer>5</answer>", 10.0),
    ("<reasoning>\na\n</reasoning>\n\n<answer>\n5\n</answer>\ntrailing", 10.0),
    ("<answer>5</answer><reasoning>a</reasoning>", 1.0),        # wrong order: only some structure
    ("<reasoning>a</reasoning> the answer is 5", 1.0),
    ("<answer>5</answer>", 1.0),
    ("<reasoning>a</reasoning><answer>5", 1.0),                  # unclosed answer
    ("The answer is 5.", 0.0),
    ("", 0.0),
    ("<reasoning>a</reasoning><answer></answer>", 10.0),         # format ok, correctness will be 0
])
def test_format_reward(text, expect):
    assert format_reward(text) == expect


def test_extract_answer_cases():
    assert extract_answer("<answer> 42 </answer>") == "42"
    assert extract_answer("<answer>1</answer> then <answer>2</answer>") == "2"   # the last one
    assert extract_answer("<answer><answer>7</answer></answer>") == "7"          # nested
    assert extract_answer("<answer>7") is None
    assert extract_answer("no tags") is None
    assert extract_answer("<answer>\n</answer>") == ""


# -----------------------------------------------------------------------------
# numeric answers

@pytest.mark.parametrize("pred,ref,ok", [
    ("18", "18", True), ("$18", "18", True), ("$18.00", "18", True), ("18 dollars", "18", True),
    ("1,234", "1234", True), ("$1,234,567.00", "1234567", True), ("\\boxed{25}", "25", True),
    ("025", "25", True), ("25", "025", True), ("-3", "-3", True), ("\u22123", "-3", True),
    ("18.0", "18", True), ("0.5", "1/2", True), ("\\frac{3}{4}", "0.75", True), ("x = 7", "7", True),
    ("The answer is 7.", "7", True), ("50%", "50", True), ("5 cm", "5", True),
    ("1", "10", False), ("10", "1", False), ("-5", "5", False), ("1,5", "15", False), ("", "0", False),
    ("7 apples and 3 pears", "7", False), ("18 or 19", "18", False), ("eighteen", "18", False),
    ("1/0", "0", False),
])
def test_numeric_equivalence(pred, ref, ok):
    assert answers_equal(pred, ref, "gsm8k") is ok


def test_parse_number_is_exact():
    assert parse_number("0.1") + parse_number("0.2") == parse_number("0.3")
    assert parse_number("not a number") is None and parse_number(None) is None


# -----------------------------------------------------------------------------
# LaTeX answers (math-verify)

LATEX_CASES = [
    ("\\dfrac{1}{2}", "\\frac12", True), ("0.5", "\\frac{1}{2}", True),
    ("(-\\infty, 3]", "(-\\infty,3]", True), ("[2,5)", "(2,5)", False),
    ("10\\text{ inches}", "10", True), ("(3,\\frac{\\pi}{2})", "\\left( 3, \\frac{\\pi}{2} \\right)", True),
    ("(\\frac{\\pi}{2},3)", "\\left( 3, \\frac{\\pi}{2} \\right)", False),   # ordered tuple
    ("\\sqrt{2}/2", "\\frac{\\sqrt2}{2}", True), ("2x+1", "1+2x", True),
    ("1", "10", False), ("x^2", "x^3", False), ("", "3", False),
]


@pytest.mark.parametrize("pred,ref,ok", LATEX_CASES)
def test_latex_equivalence(pred, ref, ok):
    assert latex_equal(pred, ref) is ok
    assert answers_equal(pred, ref, "math") is ok


@pytest.mark.slow
def test_verdicts_do_not_depend_on_load(monkeypatch):
    """Every case above gets its verdict from a fresh math-verify process while 6 busy-loop processes per core
    hold the machine (each ends itself after 2 minutes; the test ends them): the guard counts the child's CPU
    seconds, not the wall clock. A hostile input is still cut off: None once it has used its CPU seconds."""
    import time
    import rewards
    spin = "import time\nend = time.time() + 120\nwhile time.time() < end:\n    pass"
    busy = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(6 * (os.cpu_count() or 2))]
    monkeypatch.setattr(rewards, "_WORKER", rewards.LatexWorker())
    try:
        for pred, ref, ok in LATEX_CASES:
            assert latex_equal(pred, ref) is ok, (pred, ref)
        assert all(p.poll() is None for p in busy)                    # the load lasted through every verdict
        t = time.perf_counter()
        assert latex_equal("9^{9^{9^{9^{9}}}}", "5") is None
        assert time.perf_counter() - t < rewards.LATEX_WALL_BACKSTOP
    finally:
        for p in busy:
            p.kill()
            p.wait()
        rewards._WORKER.proc.kill()


def test_score_batch_api():
    comps = [wrap("18"), wrap("17"), "<answer>18</answer>", "18", wrap("$18.00")]
    total, fmt, cor = score(comps, ["18"] * 5, "gsm8k")
    assert fmt.tolist() == [10, 10, 1, 0, 10]
    assert cor.tolist() == [10, 0, 10, 0, 10]
    assert torch.equal(total, fmt + cor) and total.dtype == torch.float32
    with pytest.raises(ValueError):
        score(comps, ["18"], "gsm8k")


# -----------------------------------------------------------------------------
# acceptance on the real data

def _rows(name, split="test"):
    with open(os.path.join(DATA, name, f"{split}.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.needs_data
def test_math500_curated_answers_match_loader_reference():
    from machinery.data import load_task
    recs, raw = load_task("math500", "test"), _rows("math500")
    misses = [(r["answer"], rec["answer"]) for r, rec in zip(raw, recs)
              if score([wrap(r["answer"])], [rec["answer"]], "math500")[2].item() != 10]
    assert len(recs) == 500 and len(misses) <= 5, misses


@pytest.mark.needs_data
def test_gsm8k_answers_rewritten_as_a_person_would():
    from machinery.data import load_task
    recs = load_task("gsm8k", "test")
    variants, misses = 0, []
    for r in recs:
        n = parse_number(r["answer"])
        forms = [r["answer"], f"${r['answer']}", f"{r['answer']} dollars", f"\\boxed{{{r['answer']}}}"]
        if n.denominator == 1:
            n = int(n)
            forms += [f"{n:,}", f"${n:,}", f"{n}.00", f"${n:,}.00", f"{n:,} eggs", f"{n}.0"]
        variants += len(forms)
        misses += [(f, r["answer"]) for f in forms if not answers_equal(f, r["answer"], "gsm8k")]
    assert len(recs) == 1319 and len(misses) <= variants // 1000, misses[:20]


@pytest.mark.needs_data
@pytest.mark.parametrize("name", ["aime24", "aime25"])
def test_aime_references_are_integers_in_both_forms(name):
    """AIME 2024's answers are strings ("025"), AIME 2025's floats (70.0): both load as the integer's text and
    score a completion that writes it plainly, zero-padded or as upstream does."""
    from machinery.data import load_task
    recs, raw = load_task(name, "test"), _rows(name)
    assert len(recs) == 30
    for r, rec in zip(raw, recs):
        assert rec["answer"] == str(int(float(r["answer"])))
        for form in (str(r["answer"]), rec["answer"], rec["answer"].zfill(3)):
            assert score([wrap(form)], [rec["answer"]], name)[0].item() == 20


@pytest.mark.needs_data
@pytest.mark.parametrize("name", ["gsm8k", "math500", "aime24", "aime25", "amc23"])
def test_wrong_answers_score_format_only(name):
    # a wrong answer = the reference of the next item whose reference differs as text
    # (about 1% of GSM8K neighbours share the same number, which is rightly correct)
    from machinery.data import load_task
    recs = load_task(name, "test")
    n = len(recs)
    others = []
    for i in range(n):
        j = (i + 1) % n
        while recs[j]["answer"] == recs[i]["answer"]:
            j = (j + 1) % n
        others.append(recs[j]["answer"])
    total, fmt, cor = score([wrap(o) for o in others], [r["answer"] for r in recs], name)
    false_pos = [(o, r["answer"]) for o, r, t in zip(others, recs, total) if t != 10]
    assert (fmt == 10).all()
    assert len(false_pos) <= 0.01 * n, false_pos


# -----------------------------------------------------------------------------
# hostile completions: bounded time, no exception, the same verdicts where the old code had one

def _old_format(text):
    import re
    if re.search(r"<reasoning>.*?</reasoning>.*?<answer>.*?</answer>", text, re.DOTALL):
        return 10.0
    return 1.0 if any(t in text for t in ("<reasoning>", "</reasoning>", "<answer>", "</answer>")) else 0.0


def _old_extract(text):
    import re
    found = re.findall(r"<answer>(.*?)</answer>", text, re.DOTALL)
    return found[-1].rsplit("<answer>", 1)[-1].strip() if found else None


PIECES = ["<reasoning>", "</reasoning>", "<answer>", "</answer>", "<answer", "answer>", "5", "9" * 40,
          "\u0663\u0664", "^{", "}", "{", "!", "\\frac{1}{2}", "10^{10^{", "\x00", "\x1b[2J", " ", "\n", "x = 7",
          "$1,234", "(10^{6})!", "\\cdot 12345678901", "\u202e", "\ud800"]


def hostile(rng, n_pieces):
    """A seeded tag soup: tags (paired and not), digits (ASCII, Arabic-Indic, very long), exponent
    towers, factorials, braces, control characters, a lone surrogate, some pieces repeated hundreds
    of times."""
    out = []
    for _ in range(n_pieces):
        piece = rng.choice(PIECES)
        out.append(piece * (rng.choice([1, 1, 1, 3, 50, 400])))
    return "".join(out)


def test_format_and_extraction_equal_the_regex_definitions_on_tag_soup():
    import random
    rng = random.Random(0)
    for _ in range(2000):
        text = "".join(rng.choice(["<reasoning>", "</reasoning>", "<answer>", "</answer>", "a", "5", "\n"])
                       for _ in range(rng.randrange(0, 16)))
        assert format_reward(text) == _old_format(text), text
        assert extract_answer(text) == _old_extract(text), text


def test_repeated_tags_are_linear_time():
    import time
    for text in ("<reasoning></reasoning>" * 2000 + "<answer>" * 2000, "<reasoning>" * 3000 + "<answer>" * 3000):
        t = time.perf_counter()
        assert format_reward(text) == 1.0 and extract_answer(text) is None
        assert time.perf_counter() - t < 0.5


@pytest.mark.parametrize("answer", ["9" * 5000, "\u0663\u0664\u0665" * 3000, "1" * 401])
def test_oversized_answers_are_wrong_and_counted_not_a_crash(answer):
    counts = {}
    total, fmt, cor = score([wrap(answer)] * 2 + [wrap("7")], [answer[:5], "9", "7"], "gsm8k", counts)
    assert cor.tolist() == [0.0, 0.0, 10.0] and fmt.tolist() == [10.0] * 3 and counts == {"guarded": 2}
    assert parse_number("9" * 5000) is None and answers_equal("9" * 5000, "9", "math") is None


def _fuzz(n, task, seed):
    import random
    import time
    rng = random.Random(seed)
    texts = [hostile(rng, rng.randrange(1, 30)) for _ in range(n)]
    slowest = 0.0
    for i in range(0, n, 24):
        t = time.perf_counter()
        total, fmt, cor = score(texts[i:i + 24], ["5"] * len(texts[i:i + 24]), task, {})
        slowest = max(slowest, time.perf_counter() - t)
        assert total.shape == (len(texts[i:i + 24]),) and torch.isfinite(total).all()
    return slowest


def test_fuzz_numeric_fast_tier():
    assert _fuzz(96, "gsm8k", seed=1) < 2.0                          # per batch of 24


@pytest.mark.slow
def test_fuzz_1000_hostile_completions():
    """1,000 seeded hostile completions on the numeric reward and 120 on math-verify's: no exception,
    every batch of 24 within its bound (math: the batch budget + one timeout + a worker restart)."""
    import rewards
    assert _fuzz(1000, "gsm8k", seed=2) < 2.0
    bound = rewards.LATEX_BATCH_CPU_SECONDS + rewards.LATEX_CPU_SECONDS + 1 + 30     # + the restarted children's starts
    assert _fuzz(120, "math", seed=3) < bound


@pytest.mark.slow
def test_tower_from_a_worker_thread_returns_within_the_bound():
    """9^{9^{9^{9^{9}}}} scored off the main thread (as a TRL reward function might be): math-verify's
    signal timeout cannot act there, the worker process is killed instead."""
    import threading
    import time
    import rewards
    box = []
    t = time.perf_counter()
    th = threading.Thread(target=lambda: box.append(score([wrap("9^{9^{9^{9^{9}}}}")], ["5"], "math", {})),
                          daemon=True)
    th.start()
    th.join(rewards.LATEX_CPU_SECONDS + 60)
    assert not th.is_alive() and box[0][2].item() == 0.0
    assert time.perf_counter() - t < rewards.LATEX_CPU_SECONDS + 60


def test_the_math_verify_child_imports_no_torch():
    """A child ended past its CPU seconds is replaced at once, and the next answer waits for its start: the child
    runs rewards.py without torch, so that start is short. It answers "<verdict> <CPU seconds>" per line and
    serves until stdin closes, then says what it imported."""
    code = ("import runpy, sys; sys.argv = [sys.argv[1], '--serve-latex']; "
            "runpy.run_path(sys.argv[0], run_name='__main__'); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, os.path.join(HERE, "rewards.py")], input='["0.5", "1/2", 2.0]\n',
                         capture_output=True, text=True, env=ENV, timeout=120)
    ready, verdict, cpu, torch_imported = out.stdout.split()
    assert (ready, verdict, torch_imported) == ("ready", "1", "False") and 0 <= float(cpu) < 2.0, out.stdout + out.stderr


def slow_start_worker():
    """A LatexWorker whose child waits 9 s (past LATEX_CPU_SECONDS and LATEX_BATCH_CPU_SECONDS, had they been
    wall seconds) before importing math-verify, as a start may on a loaded machine."""
    import subprocess
    import sys
    import rewards

    class Slow(rewards.LatexWorker):
        def _spawn(self):
            code = ("import runpy, sys, time; time.sleep(9); sys.argv = [sys.argv[1], '--serve-latex']; "
                    "runpy.run_path(sys.argv[0], run_name='__main__')")
            self.proc = subprocess.Popen([sys.executable, "-c", code, rewards.__file__], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, bufsize=1)
            self.ready = False
    return Slow()


@pytest.mark.slow
def test_the_first_worker_start_counts_in_no_answers_time(monkeypatch):
    """A math-verify process's start is setup: one slower than the per-answer and per-batch bounds still scores
    the first answers (no `guarded`), and so does one restarted later."""
    import rewards
    worker = slow_start_worker()
    monkeypatch.setattr(rewards, "_WORKER", worker)
    counts = {}
    _, _, cor = score([wrap("\\dfrac{\\sqrt{3}}{2}")], ["\\frac{\\sqrt3}{2}"], "math", counts)
    assert cor.item() == 10.0 and counts == {"guarded": 0}
    worker.proc.kill()
    worker.proc.wait()
    assert rewards.latex_equal("\\sqrt{2}", "2^{1/2}", cpu_seconds=1.0) is True    # a restart: 9 s, not charged
    worker.proc.kill()


UNGUARDED = """
import sys, threading
sys.path.insert(0, {here!r})
print("top level runs", flush=True)
from rewards import score
def run():
    total, fmt, cor = score(["<reasoning>r</reasoning><answer>\\\\dfrac{{\\\\sqrt{{3}}}}{{2}}</answer>"],
                            ["\\\\frac{{\\\\sqrt3}}{{2}}"], "math")      # no number: math-verify decides
    print("reward", total.item(), flush=True)
{call}
"""
CALLS = {"plain": "run()", "thread": "t = threading.Thread(target=run); t.start(); t.join()"}


def _caller(argv):
    import subprocess
    import sys
    from conftest import ENV
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=ENV, timeout=300)


@pytest.mark.slow                                  # real runs in this process or a child: the slow tier
@pytest.mark.parametrize("call", list(CALLS))
def test_a_script_without_a_main_guard_scores_math_verify_answers(tmp_path, call):
    """The shape of most TRL training scripts: no `if __name__ == "__main__":`. The math-verify
    worker imports nothing of the caller's, so the top level runs once and the answer is right."""
    from conftest import HERE
    script = tmp_path / "train_script.py"
    script.write_text(UNGUARDED.format(here=HERE, call=CALLS[call]))
    r = _caller([str(script)])
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.count("top level runs") == 1 and "reward 20.0" in r.stdout


@pytest.mark.slow
@pytest.mark.parametrize("how", ["python -c", "exec"])
def test_python_c_and_a_notebook_like_exec_score_alike(how):
    from conftest import HERE
    code = UNGUARDED.format(here=HERE, call="run()")
    argv = ["-c", code] if how == "python -c" else ["-c", f"exec({code!r}, {{'__name__': 'notebook'}})"]
    r = _caller(argv)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.count("top level runs") == 1 and "reward 20.0" in r.stdout


@pytest.mark.parametrize("extra", [None, 0.5], ids=["as-reward-is", "plus-a-term"])
def test_a_term_added_to_reward_reaches_training_eval_and_trl(monkeypatch, tiny_model_dir, tiny_lm, extra):
    """docs/training.md "Changing the reward": whatever rewards.reward returns -- the paper's total, a term a user added
    there (the page's length penalty), or a term this test adds on top -- is what the RL step (its advantages
    and `reward` metric), eval.py's scoring and the TRL reward function see, counted once; the paper's two terms
    (format, correctness) stay score()'s."""
    import eval as evaluate
    import rewards
    import step
    from machinery.config import Config
    from gtpo import Objective
    from machinery.models import load_tokenizer
    from rollout import Rollout
    if extra is not None:
        inner = rewards.reward

        def with_a_term(completions, answers, task, counts=None):
            total, fmt, cor = inner(completions, answers, task, counts)
            return total + extra, fmt, cor
        monkeypatch.setattr(rewards, "reward", with_a_term)
    texts = ["<reasoning>1 + 1</reasoning><answer>2</answer>", "no tags at all: 3"]
    cfg = Config(dataset="arithmetic", generation_size=2, max_completion_length=6,
                 objective=Objective(entropy_filter="off"))
    total, fmt, cor = rewards.reward(texts, ["2", "2"], cfg.reward_task)
    _, paper_fmt, paper_cor = rewards.score(texts, ["2", "2"], cfg.reward_task)
    assert fmt.tolist() == paper_fmt.tolist() == [10.0, 0.0] and cor.tolist() == paper_cor.tolist() == [10.0, 0.0]
    want = total.tolist()
    assert rewards.trl_reward(cfg.reward_task)(texts, ["2", "2"]) == pytest.approx(want)             # TRL
    row = evaluate.rescore_rows([{"completion": texts[0], "reference": "2", "task": "gsm8k"}])[0]     # eval.py
    assert row["reward"] == pytest.approx(rewards.reward(texts[:1], ["2"], "gsm8k")[0].item())
    assert (row["format"], row["correct"]) == (10.0, 10.0)
    tok, model = load_tokenizer(tiny_model_dir), tiny_lm(lora=True)                                 # training
    ids = [tok(t, add_special_tokens=False)["input_ids"][:6] for t in texts]
    comp = torch.tensor([i + [tok.pad_token_id] * (6 - len(i)) for i in ids])
    mask = (comp != tok.pad_token_id).long()
    prompt = tok(["q"] * 2, return_tensors="pt")["input_ids"]
    ro = Rollout(prompt, torch.ones_like(prompt), comp, mask, torch.zeros(2, dtype=torch.bool), texts)
    monkeypatch.setattr(step, "rollout", lambda *a, **k: ro)
    m, _, scored = step.rl_step(model, model, tok, ["q"], ["2"], cfg)
    assert scored["rewards"].tolist() == pytest.approx(want) and m["reward"] == pytest.approx(sum(want) / 2)
    assert (m["rewards/format"], m["rewards/accuracy"]) == (5.0, 5.0)


@pytest.mark.slow
def test_the_pages_reward_edit_passes_the_test_it_names(tmp_path):
    """docs/training.md "Changing the reward", done as a user would: its block replaces rewards.reward in a copy of
    the clone; the length penalty is then in the total, and the test the page names passes there."""
    import shutil
    with open(os.path.join(HERE, "docs", "training.md")) as f:
        block = f.read().split("## Changing the reward", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    copy = tmp_path / "clone"
    shutil.copytree(HERE, copy, ignore=shutil.ignore_patterns(".git", "runs", "study", "docs", "figures", "bench",
                                                                "__pycache__", ".venv"))
    source = (copy / "rewards.py").read_text()
    start = source.index("def reward(")
    end = source.index("    return total, fmt, cor\n", start) + len("    return total, fmt, cor\n")
    (copy / "rewards.py").write_text(source[:start] + block + source[end:])
    check = ("import rewards; t = ['<reasoning>1</reasoning><answer>2</answer>']; "
             "print(rewards.reward(t, ['2'], 'numeric')[0].item(), rewards.score(t, ['2'], 'numeric')[0].item())")
    r = subprocess.run([sys.executable, "-c", check], cwd=copy, capture_output=True, text=True, env=ENV, timeout=120)
    total, paper = map(float, r.stdout.split())
    length = len("<reasoning>1</reasoning><answer>2</answer>")
    assert paper == 20.0 and total == pytest.approx(20.0 - 0.01 * length)                # the penalty is in effect
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_rewards.py", "-k",
                        "term_added"], cwd=copy, capture_output=True, text=True, env=ENV, timeout=600)
    assert r.returncode == 0 and "2 passed" in r.stdout, r.stdout[-3000:]
