"""The paper's reward (App. 16.1): formatting (10 / 1 / 0) + correctness (10).

    formatting   10 if <reasoning>...</reasoning> is followed by <answer>...</answer>,
                 1 if only some of the four tags are present, 0 if none.
    correctness  10 if the text inside the last <answer>...</answer> equals the reference.
                 GSM8K / AIME / AMC / arithmetic: numbers compared after normalising
                 (commas, $, unit words, trailing .0, \\boxed{}); MATH: LaTeX equivalence
                 with math-verify. Never a substring test: the released code's
                 `str(true) in str(pred)` marks "1" correct for "10".

score(completions, answers, task) -> (total, formatting, correctness) float tensors.
Pure: no printing, no logging.
"""
import functools
import re
import threading
from fractions import Fraction

import torch

FORMAT_FULL, FORMAT_PARTIAL, CORRECT = 10.0, 1.0, 10.0
TAGS = ("<reasoning>", "</reasoning>", "<answer>", "</answer>")
NUMERIC_TASKS = {"gsm8k", "aime24", "amc23", "arithmetic"}
LATEX_TASKS = {"math", "math500"}
_FULL_FORMAT = re.compile(r"<reasoning>.*?</reasoning>.*?<answer>.*?</answer>", re.DOTALL)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def format_reward(completion):
    """10 / 1 / 0 formatting reward (App. 16.1)."""
    if _FULL_FORMAT.search(completion):
        return FORMAT_FULL
    return FORMAT_PARTIAL if any(t in completion for t in TAGS) else 0.0


def extract_answer(completion):
    """Text inside the last complete <answer>...</answer>, stripped; None if there is none.
    For nested tags ("<answer><answer>5</answer>") the innermost opening tag counts."""
    found = _ANSWER.findall(completion)
    if not found:
        return None
    return found[-1].rsplit("<answer>", 1)[-1].strip()


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
    if text is None:
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

def _timeout():
    # math-verify's timeouts use signal.alarm, which exists only in the main thread
    return 1 if threading.current_thread() is threading.main_thread() else None


@functools.lru_cache(maxsize=65536)
def _parse_latex(text):
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse
    cfg = (LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig())
    # the answer is bare LaTeX ("\frac{1}{2}", "(3, \pi/2)"): box it so it is read whole
    parsed = parse(f"\\boxed{{{text}}}", extraction_config=cfg, parsing_timeout=_timeout())
    return tuple(parsed)


def latex_equal(pred, ref):
    """LaTeX-aware equivalence (fractions, \\dfrac, 0.5 vs \\frac12, intervals, \\text{} units,
    ordered tuples) with math-verify; a 1 s timeout guards against pathological input."""
    if pred is None or not pred.strip():
        return False
    if numbers_equal(pred, ref):                         # fast path, also covers "1,000" vs "1000"
        return True
    from math_verify import verify
    gold, target = _parse_latex(ref), _parse_latex(pred)
    if not gold or not target:
        return pred.strip() == ref.strip()
    try:
        return bool(verify(list(gold), list(target), timeout_seconds=_timeout()))
    except Exception:                                    # math-verify's own timeout / sympy errors
        return False


def answers_equal(pred, ref, task):
    """Correctness test for one extracted answer, selected by task name."""
    if pred is None:
        return False
    if task in NUMERIC_TASKS:
        return numbers_equal(pred, ref)
    if task in LATEX_TASKS:
        return latex_equal(pred, ref)
    # a local dataset: numbers when the reference is a number, LaTeX otherwise
    return numbers_equal(pred, ref) if parse_number(ref) is not None else latex_equal(pred, ref)


def correctness_reward(completion, answer, task):
    return CORRECT if answers_equal(extract_answer(completion), answer, task) else 0.0


def score(completions, answers, task):
    """Batch reward: (total, formatting, correctness), each a float32 tensor (N,).

    completions: list of N strings; answers: list of N reference answers (repeat each
    prompt's answer G times); task: dataset name ("gsm8k", "math", "aime24", ...).
    """
    if len(completions) != len(answers):
        raise ValueError(f"{len(completions)} completions but {len(answers)} answers")
    fmt = torch.tensor([format_reward(c) for c in completions], dtype=torch.float32)
    cor = torch.tensor([correctness_reward(c, a, task) for c, a in zip(completions, answers)],
                       dtype=torch.float32)
    return fmt + cor, fmt, cor
