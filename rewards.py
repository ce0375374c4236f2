"""The paper's reward (App. 16.1): formatting (10 / 1 / 0) + correctness (10).

    formatting   10 if <reasoning>...</reasoning> is followed by <answer>...</answer>,
                 1 if only some of the four tags are present, 0 if none.
    correctness  10 if the text inside the last <answer>...</answer> equals the reference.
                 GSM8K / AIME / AMC / arithmetic: numbers compared after normalising
                 (commas, $, unit words, trailing .0, \\boxed{}); MATH: LaTeX equivalence
                 with math-verify. Never a substring test: the released code's
                 `str(true) in str(pred)` marks "1" correct for "10".

reward(completions, answers, task)  the one entry point: train.py's step, eval.py and GTPOTrainer
                                    (trl_reward) all call it; a term added to its total reaches all
                                    three (README "Changing the reward")
score(completions, answers, task)   the paper's two terms -> (total, formatting, correctness)
trl_reward(task)                    reward() as a TRL reward function (reward_funcs=[trl_reward("gsm8k")])

task: a dataset name ("gsm8k", "math", ...; a local file's name) or the comparison itself, "numeric"
or "latex" (train.py --task). Installed with `pip install .`, this file is the module gtpo_rewards.
No printing, no logging.

The completions are the policy's own output, so the reward bounds its cost on any text: the format
check and answer extraction are linear-time scans; an answer longer than MAX_ANSWER_CHARS is
wrong without being parsed; math-verify runs in a child process (LatexWorker) that the kernel ends
when one comparison has used LATEX_CPU_SECONDS of CPU, and a batch stops calling it once its
comparisons have used LATEX_BATCH_CPU_SECONDS. Both bound the work a check does, not the time the
machine takes to give it: a verdict is the same on a busy machine as on an idle one. Every answer
refused so is scored wrong and counted (score's `counts`: "guarded"). A child's start (importing
math-verify, up to START_SECONDS) is setup and counts in neither bound.
"""
import json
import logging
import math
import os
import re
import select
import subprocess
import sys
import threading
import time
from fractions import Fraction

from machinery.data import answer_text

SERVING_LATEX = __name__ == "__main__" and sys.argv[1:] == ["--serve-latex"]
if not SERVING_LATEX:    # the math-verify child (LatexWorker) runs this file: without torch it is ready sooner
    import torch

FORMAT_FULL, FORMAT_PARTIAL, CORRECT = 10.0, 1.0, 10.0
TAGS = ("<reasoning>", "</reasoning>", "<answer>", "</answer>")
NUMERIC_TASKS = {"gsm8k", "aime24", "aime25", "amc23", "arithmetic", "arithmetic-hard"}
LATEX_TASKS = {"math", "math500"}
MAX_ANSWER_CHARS = 400          # longer answers are wrong unparsed (the longest MATH reference is 159)
LATEX_CPU_SECONDS = 2.0         # CPU seconds one math-verify comparison may use (RLIMIT_CPU: whole seconds above it)
LATEX_BATCH_CPU_SECONDS = 8.0   # math-verify CPU seconds per score() call; later answers are not compared
# a safety net only against a child that gets no CPU at all: RLIMIT_CPU lets a comparison use up to one CPU second
# more than its budget, so one with more than 1/30 of a core reaches its CPU limit first
LATEX_WALL_BACKSTOP = 30 * (LATEX_CPU_SECONDS + 1)
START_SECONDS = 120.0           # waiting for a math-verify process to import it: setup, in no bound


def format_reward(completion):
    """10 / 1 / 0 formatting reward (App. 16.1): 10 when <reasoning>, </reasoning>, <answer>,
    </answer> occur in this order. Taking each tag's first occurrence after the previous one
    decides it in one left-to-right scan (the regex `<reasoning>.*?</reasoning>.*?<answer>.*?
    </answer>` searched from every start is quadratic or worse on repeated tags)."""
    at = 0
    for tag in TAGS:
        at = completion.find(tag, at)
        if at < 0:
            return FORMAT_PARTIAL if any(t in completion for t in TAGS) else 0.0
        at += len(tag)
    return FORMAT_FULL


def extract_answer(completion):
    """Text inside the last complete <answer>...</answer>, stripped; None if there is none.
    Pairs are taken left to right, each <answer> with the first </answer> after it (as a regex
    findall of `<answer>(.*?)</answer>`); inside the last pair the innermost opening tag counts
    ("<answer><answer>5</answer>" -> "5"). One linear scan."""
    last, at = None, 0
    while True:
        i = completion.find("<answer>", at)
        j = completion.find("</answer>", i + 8) if i >= 0 else -1
        if j < 0:
            break
        last, at = (i + 8, j), j + 9
    if last is None:
        return None
    return completion[last[0]:last[1]].rsplit("<answer>", 1)[-1].strip()


# -----------------------------------------------------------------------------
# numeric answers (GSM8K, AIME, AMC, arithmetic)

_UNWRAP = re.compile(r"\\(?:boxed|fbox|text|textbf|mathrm|mbox)\s*\{([^{}]*)\}")
_NUM = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)"
_NUMERIC = re.compile(
    r"^(?:[a-z][a-z\s]*?(?:is|=|:)\s*)?"                 # an optional lead-in: "x =", "the answer is"
    rf"(?P<num>{_NUM})(?:\s*/\s*(?P<den>\d+))?"           # 42, -3.50, .5, 3/4
    r"(?:\s*(?:%|[a-z][a-z\s\-']*))?\.?$")                # an optional unit: "dollars", "%", "cm"


def parse_number(text):
    """A number written as a person would -> Fraction, or None when `text` is not one number.

    Handles "1,234", "$1,234.00", "18 dollars", "\\boxed{25}", "025", "−5", "3/4",
    "\\frac{3}{4}", "x = 7", "50%". Exact (Fraction), so 0.1 + 0.2 style noise cannot matter.
    """
    if text is None or len(text) > MAX_ANSWER_CHARS:
        return None
    t = text.strip().lower().replace("\u2212", "-").replace("$", "").replace("\\!", "")
    t = re.sub(r"\\[dt]?frac\s*\{\s*(-?\d+)\s*\}\s*\{\s*(\d+)\s*\}", r"\1/\2", t)
    for _ in range(3):                                   # \boxed{\text{5}} ...
        t = _UNWRAP.sub(r"\1", t)
    t = t.replace("\\%", "%").replace("\\", "").strip()
    t = re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", t)        # thousands separators only
    m = _NUMERIC.match(t.strip())
    if not m:
        return None
    num = Fraction(m.group("num"))
    if m.group("den"):
        if int(m.group("den")) == 0:
            return None
        num /= int(m.group("den"))
    return num


def numbers_equal(pred, ref):
    a, b = parse_number(pred), parse_number(ref)
    return a is not None and b is not None and a == b


# -----------------------------------------------------------------------------
# LaTeX answers (MATH) with math-verify

def _serve():
    """The child process (`python rewards.py --serve-latex`): one JSON [pred, ref, cpu_seconds] per stdin line,
    one line "<1 or 0> <CPU seconds used>" back, with math-verify, until stdin closes. Past cpu_seconds of CPU
    in one comparison the kernel ends the process (RLIMIT_CPU's SIGXCPU, whatever sympy holds); math-verify's
    own timeouts, wall-clock alarms that a busy machine would trip, are off."""
    import resource
    logging.disable(logging.CRITICAL)              # math-verify warns that its timeouts are off
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
    cfg = (LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig())
    hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))   # SIGXCPU dumps core by default: none in the caller's folder
    print("ready", flush=True)
    for line in sys.stdin:
        pred, ref, budget = json.loads(line)
        start = time.process_time()                # user + system time, as RLIMIT_CPU counts it
        limit = math.ceil(start + budget)
        resource.setrlimit(resource.RLIMIT_CPU, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))
        try:   # bare LaTeX ("\frac{1}{2}", "(3, \pi/2)"): boxed so that it is read whole
            gold = parse(f"\\boxed{{{ref}}}", extraction_config=cfg, parsing_timeout=None)
            target = parse(f"\\boxed{{{pred}}}", extraction_config=cfg, parsing_timeout=None)
            same = (pred.strip() == ref.strip()) if not gold or not target else \
                bool(verify(gold, target, timeout_seconds=None))
        except Exception:                          # sympy errors
            same = False
        print(f"{int(same)} {time.process_time() - start:.6f}", flush=True)


class LatexWorker:
    """math-verify in a child process, one per process that scores: compare() returns the verdict and
    the CPU seconds it took, or None when the comparison passed its CPU seconds (the kernel ends the
    child, which is restarted at once). A child, not a thread: big-integer arithmetic in sympy holds
    the GIL and ignores Python's signal handlers, so only a process can be stopped, on any thread of
    the caller, and only a process has a CPU clock of its own. A plain subprocess running this
    file, not multiprocessing: nothing of the caller's program is imported again in it, so a script
    without a __main__ guard, `python -c`, a notebook or a TRL training script all score alike."""

    def __init__(self, cache_size=65536):
        self.proc, self.ready, self.lock = None, False, threading.Lock()
        self.cache, self.cache_size = {}, cache_size                 # (pred, ref) -> verdict; timeouts not kept

    def _spawn(self):
        """Start a child; it says "ready" once math-verify is imported (_wait_ready)."""
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve-latex"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True, bufsize=1)
        self.ready = False

    def _line(self, timeout):
        """The child's next line ("" if it died), or None when none came within `timeout` seconds."""
        got, _, _ = select.select([self.proc.stdout], [], [], max(timeout, 0.0))
        return self.proc.stdout.readline().strip() if got else None

    def _wait_ready(self, timeout):
        if not self.ready:
            line = self._line(timeout)
            if line == "":                                           # it died while starting
                self._restart()
            self.ready = line == "ready"
        return self.ready

    def _restart(self):
        """Kill the child and start the next one at once, so that its start overlaps the caller's work."""
        self.proc.kill()
        self.proc.wait()
        self.proc.stdin.close()
        self.proc.stdout.close()
        self._spawn()

    def start(self):
        """The first child of this program, once: setup, so it waits up to START_SECONDS and counts in
        no answer's time."""
        with self.lock:
            if self.proc is None:
                self._spawn()
                if not self._wait_ready(START_SECONDS):
                    raise RuntimeError("the math-verify worker process did not start")

    def compare(self, pred, ref, cpu_seconds):
        """(the verdict, the CPU seconds charged). None past `cpu_seconds` of the child's CPU (charged whole),
        or past LATEX_WALL_BACKSTOP seconds of waiting on a child that gets no CPU; the child is then restarted.
        A restarted child's start is waited for (START_SECONDS) and charged nothing."""
        self.start()
        with self.lock:
            if (pred, ref) in self.cache:
                return self.cache[pred, ref], 0.0
            if self.proc.poll() is not None:
                self._restart()
            if not self._wait_ready(START_SECONDS):
                return None, 0.0
            try:
                self.proc.stdin.write(json.dumps([pred, ref, cpu_seconds]) + "\n")
                self.proc.stdin.flush()
            except OSError:                                           # it ended since poll()
                self._restart()
                return None, 0.0
            got = (self._line(LATEX_WALL_BACKSTOP) or "").split()
            if len(got) != 2 or got[0] not in ("0", "1"):             # ended by its CPU limit, or the backstop
                self._restart()
                return None, cpu_seconds
            if len(self.cache) >= self.cache_size:
                self.cache.clear()
            self.cache[pred, ref] = got[0] == "1"
            return self.cache[pred, ref], float(got[1])


_WORKER = LatexWorker()


def latex_equal(pred, ref, cpu_seconds=LATEX_CPU_SECONDS):
    """LaTeX-aware equivalence (fractions, \\dfrac, 0.5 vs \\frac12, intervals, \\text{} units,
    ordered tuples) with math-verify, bounded by `cpu_seconds` of its CPU. Returns True / False, or None
    when math-verify ran out of them: the caller counts it as wrong."""
    return judge(pred, ref, "latex", cpu_seconds)[0]


def comparison(task, ref):
    """How an answer to `ref` is compared: "numeric" or "latex". A built-in dataset's own; "numeric" /
    "latex" as given; a local dataset's by its reference: numbers when it parses as one, else LaTeX."""
    if task in ("numeric", "latex"):
        return task
    if task in NUMERIC_TASKS:
        return "numeric"
    if task in LATEX_TASKS:
        return "latex"
    return "numeric" if parse_number(ref) is not None else "latex"


def answers_equal(pred, ref, task, cpu_seconds=LATEX_CPU_SECONDS):
    """Correctness test for one extracted answer (comparison(task, ref)): True / False, or None when
    the answer was refused unparsed (longer than MAX_ANSWER_CHARS, or math-verify out of CPU seconds)."""
    return judge(pred, ref, task, cpu_seconds)[0]


def judge(pred, ref, task, cpu_seconds=LATEX_CPU_SECONDS):
    """answers_equal's verdict and the math-verify CPU seconds it took (0.0 without math-verify)."""
    if pred is None:
        return False, 0.0
    if len(pred) > MAX_ANSWER_CHARS:
        return None, 0.0
    if comparison(task, ref) == "numeric":
        return numbers_equal(pred, ref), 0.0
    if not pred.strip():
        return False, 0.0
    if numbers_equal(pred, ref):                         # fast path, also covers "1,000" vs "1000"
        return True, 0.0
    if cpu_seconds <= 0:
        return None, 0.0
    return _WORKER.compare(pred, ref, cpu_seconds)


def score(completions, answers, task, counts=None):
    """The paper's reward (App. 16.1) on a batch: (total, formatting, correctness), each a float32
    tensor (N,), total = formatting + correctness.

    completions: list of N strings; answers: list of N reference answers (repeat each
    prompt's answer G times); task: see the module docstring.
    counts: a dict that gets "guarded" += the answers scored wrong unparsed (too long, or
    math-verify out of CPU seconds, its own or the batch's LATEX_BATCH_CPU_SECONDS).
    """
    if len(completions) != len(answers):
        raise ValueError(f"{len(completions)} completions but {len(answers)} answers")
    answers = [a if isinstance(a, str) else answer_text(a, f"answers[{i}]") for i, a in enumerate(answers)]
    fmt = torch.tensor([format_reward(c) for c in completions], dtype=torch.float32)
    if any(comparison(task, a) == "latex" for a in answers):
        _WORKER.start()                                  # setup: in no answer's CPU seconds
    spent, verdicts = 0.0, []
    for c, a in zip(completions, answers):
        verdict, cpu = judge(extract_answer(c), a, task, min(LATEX_CPU_SECONDS, LATEX_BATCH_CPU_SECONDS - spent))
        spent += cpu
        verdicts.append(verdict)
    if counts is not None:
        counts["guarded"] = counts.get("guarded", 0) + sum(v is None for v in verdicts)
    cor = torch.tensor([CORRECT if v else 0.0 for v in verdicts], dtype=torch.float32)
    return fmt + cor, fmt, cor


def reward(completions, answers, task, counts=None):
    """The reward every caller uses -- train.py's step (Eq. 8's R_i), eval.py and GTPOTrainer
    (trl_reward): (total, formatting, correctness), each a float32 tensor (N,). The paper's total is
    formatting + correctness (score); add a term to `total` here and training, evaluation and TRL all
    see it (eval.py's pass@k still counts correctness alone). Arguments as score's."""
    total, fmt, cor = score(completions, answers, task, counts)
    return total, fmt, cor


def completion_texts(completions):
    """TRL's completions as texts: strings, or a conversation's last message."""
    return [c if isinstance(c, str) else c[-1]["content"] for c in completions]


def trl_reward(task):
    """reward() as a TRL reward function, for GRPOTrainer / GTPOTrainer's reward_funcs: the dataset's
    `answer` column is the reference (TRL passes a dataset's extra columns by name)."""
    def paper_reward(completions, answer, **_):
        return reward(completion_texts(completions), answer, task)[0].tolist()
    return paper_reward


def trl_rewards(task):
    """The paper's reward split in two TRL reward functions, [format_reward, accuracy_reward], each on its 10 points.
    While reward()'s total is formatting + correctness their sum is trl_reward(task)'s (TRL sums reward_funcs,
    weights 1): the same A_i and loss, and TRL logs formatting and correctness apart -- in evaluation
    `eval_rewards/accuracy_reward/mean`, ten times the held-out share of correct answers."""
    def format_reward(completions, answer, **_):
        return reward(completion_texts(completions), answer, task)[1].tolist()

    def accuracy_reward(completions, answer, **_):
        return reward(completion_texts(completions), answer, task)[2].tolist()
    return [format_reward, accuracy_reward]


if SERVING_LATEX:
    _serve()
