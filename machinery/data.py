"""Datasets and the prompt (Sec. 6, App. 16.1).

load_task(name, split, data_dir=None) -> list of {"question", "answer", "solution"}
where `answer` is the reference final answer and `solution` the worked solution
(None where the dataset has none). Sources, in order:
  1. `<data_dir>/<name>/<split>.jsonl` (data_dir from the argument or $GTPO_DATA_DIR),
     with the upstream field names -- the layout `python -m machinery.data --export DIR` writes;
  2. the Hugging Face Hub;
  3. a path to any local *.jsonl file given as `name`.
`arithmetic` (and `arithmetic-hard`, its larger numbers) is generated here from a seed and needs
no file at all.

    python -m machinery.data --export DIR     # writes DIR/<name>/<split>.jsonl from the Hub, for GTPO_DATA_DIR=DIR
"""
import json
import os
import random
import re
import warnings

SYSTEM_PROMPT = (  # App. 16.1, verbatim
    "You are a helpful assistant for solving math problems.\n"
    "Given a question, first think step by step between <reasoning> and </reasoning>.\n"
    "Then, give the final answer between <answer> and </answer>."
)

# name -> (Hub id, config(s), split map). Only used when no local file exists.
HUB = {
    "gsm8k": ("openai/gsm8k", ["main"], {}),
    "math": ("EleutherAI/hendrycks_math", ["algebra", "counting_and_probability", "geometry",
             "intermediate_algebra", "number_theory", "prealgebra", "precalculus"], {}),
    "math500": ("HuggingFaceH4/MATH-500", [None], {}),
    "aime24": ("math-ai/aime24", [None], {}),
    "aime25": ("math-ai/aime25", [None], {}),
    "amc23": ("math-ai/amc23", [None], {}),
}
TASKS = sorted(HUB) + ["arithmetic", "arithmetic-hard"]
ARITHMETIC_SPLITS = {"arithmetic": ("train", "test", "hard", "hard-train", "reworded"),
                     "arithmetic-hard": ("train", "test", "hard", "hard-train", "reworded")}   # built in, generated


class DataError(ValueError):
    """A dataset that cannot be found or read; the message says how to fix it."""


class BadRecord(DataError):
    """A record whose fields have the wrong type (a number for the question, a list for the answer): the
    file is wrong, not one record incomplete, so the load stops at its file:line instead of skipping it."""


# -----------------------------------------------------------------------------
# answer extraction from upstream formats

def last_boxed(text):
    """Content of the last \\boxed{...} (or \\fbox{...}) in `text`, braces balanced; None if absent."""
    starts = [m.end() for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text)]
    if not starts:
        m = list(re.finditer(r"\\boxed (\S+)", text))               # "\boxed 5" (rare upstream form)
        return m[-1].group(1).rstrip("$.") if m else None
    i = start = starts[-1]
    depth = 1
    while i < len(text):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i].strip()
        i += 1
    return None                                                     # unbalanced


def split_gsm8k(answer_field):
    """GSM8K `answer` field -> (final answer without commas, solution without <<calc>> notes)."""
    if "####" not in answer_field:
        return None, None
    sol, final = answer_field.rsplit("####", 1)
    return final.strip().replace(",", ""), re.sub(r"<<[^>]*>>", "", sol).strip()


def answer_text(x, where="answer"):
    """A reference answer as text: 27.0 -> "27", 0.5 -> "0.5", " 025" -> "025"; a string or a number only
    (a list, an object or true/false is refused, naming `where`)."""
    if isinstance(x, bool) or not isinstance(x, (str, int, float)):
        raise DataError(f"{where}: an answer must be a string or a number, got {type(x).__name__} {str(x)[:60]}")
    if isinstance(x, float) and x.is_integer():
        return str(int(x))
    return str(x).strip()


def to_record(obj, where="record"):
    """Upstream JSON object -> {"question", "answer", "solution"} (fields detected)."""
    q = next((obj[k] for k in ("question", "problem", "Question", "Problem") if obj.get(k)), None)
    ans = next((obj[k] for k in ("answer", "Answer") if obj.get(k) is not None), None)
    sol = next((obj[k] for k in ("solution", "Solution") if obj.get(k)), None)
    for name, value in (("question", q), ("solution", sol)):
        if value is not None and not isinstance(value, str):
            raise BadRecord(f"{where}: the {name} must be a string, got {type(value).__name__} {str(value)[:60]}")
    if ans is not None:
        try:
            answer_text(ans, where)
        except DataError as e:
            raise BadRecord(str(e)) from None
    if isinstance(ans, str) and "####" in ans:                      # GSM8K layout
        ans, sol = split_gsm8k(ans)
    elif ans is None and isinstance(sol, str):                      # MATH layout
        ans = last_boxed(sol)
    if q is None or ans is None or answer_text(ans) == "":
        raise DataError(f"{where}: need a question ('question' or 'problem') and an answer ('answer', "
                        f"a GSM8K '#### N' answer, or a 'solution' with \\boxed{{}}); found fields {sorted(obj)}")
    return {"question": q, "answer": answer_text(ans), "solution": sol}


def read_jsonl(path, log_torn=None):
    """Rows of a JSONL file as (line number, object); a malformed line raises DataError naming
    file and line. log_torn: for append-only logs, a malformed LAST line -- what a kill or a full
    disk leaves mid-write -- is dropped instead and reported through log_torn(message)."""
    rows, lines = [], []
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{path}:{n}: not UTF-8 text (byte {e.start + 1} of the line is {raw[e.start]:#x}); "
                                f"save the file as UTF-8") from None
            if line.strip():
                lines.append((n, line))
    for k, (n, line) in enumerate(lines):
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            if log_torn and k == len(lines) - 1:
                log_torn(f"{path}: dropped a torn last line ({n}), left by an interrupted write")
                break
            raise DataError(f"{path}:{n}: malformed JSON line ({e.msg} at column {e.colno}); "
                            f"fix or delete that line") from None
        if not isinstance(obj, dict):
            raise DataError(f"{path}:{n}: expected a JSON object per line, got {type(obj).__name__}")
        rows.append((n, obj))
    return rows


def write_text(path, text):
    """Write a file atomically: a temporary file, fsync, rename. A kill leaves the old file or the new."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _records(rows, path, name):
    """Upstream rows -> records. Rows without a usable final answer (one MATH train item
    upstream has an empty \\boxed{}) are skipped with a warning giving the count;
    if no row is usable the first problem is raised."""
    if not rows:
        raise DataError(f"{path}: no records (the file is empty or holds only blank lines); one JSON object "
                        f"per line with 'question' and 'answer'")
    out, skipped = [], []
    for n, obj in rows:
        try:
            rec = to_record(obj, f"{path}:{n}")
        except BadRecord:
            raise
        except DataError as e:
            skipped.append(e)
            continue
        if name in ("math", "math500"):
            # the reference is the last \boxed{} of the solution (MATH-500's curated `answer`
            # agrees; tests/test_rewards.py measures it), so MATH and MATH-500 are scored alike
            rec["answer"] = last_boxed(obj["solution"]) or rec["answer"]
        if name in ("aime24", "aime25", "amc23"):
            rec["answer"] = str(int(float(rec["answer"])))          # "025" -> "25", 27.0 -> "27"
        out.append(rec)
    if skipped and not out:
        raise skipped[0]
    if skipped:
        warnings.warn(f"skipped {len(skipped)} of {len(rows)} records without a usable answer "
                      f"(first: {skipped[0]})", stacklevel=3)
    return out


# -----------------------------------------------------------------------------
# the built-in task: short arithmetic word problems with worked solutions

_NAMES = ["Ava", "Ben", "Cleo", "Dan", "Eli", "Fay", "Gus", "Hana", "Ivan", "Jo", "Kim", "Leo"]
_ITEMS = ["apples", "books", "coins", "marbles", "pencils", "stickers", "shells", "cards"]


def arithmetic_task(split="train", n=None, seed=0):
    """Deterministic word problems with small numbers, e.g. "Ava has 7 apples. She buys 5
    more and gives 3 away. How many apples does Ava have now?" -> "9", with a worked
    solution. train and test use disjoint seeds. Two out-of-distribution splits: "hard", the same
    four kinds with larger numbers (a 21-99, b 2-25 instead of 2-20 and 2-12), and "reworded", the
    same four kinds and numbers in sentences the train split never uses. "hard-train", the larger
    numbers for training (the `arithmetic-hard` task), never repeats a question of "hard"."""
    n = n if n is not None else {"train": 2000, "test": 200, "hard-train": 2000}.get(split, 200)
    rng = random.Random(f"arithmetic-{split}-{seed}")
    # other splits never repeat a question of the (default-size) train split
    exclude = set() if split == "train" else {r["question"] for r in arithmetic_task("train", seed=seed)}
    if split == "hard-train":
        exclude |= {r["question"] for r in arithmetic_task("hard", seed=seed)}
    (a_lo, a_hi), b_hi = ((21, 99), 25) if split.startswith("hard") else ((2, 20), 12)
    reworded = split == "reworded"
    out = []
    while len(out) < n:
        who, what = rng.choice(_NAMES), rng.choice(_ITEMS)
        kind = rng.randrange(4)
        a, b = rng.randint(a_lo, a_hi), rng.randint(2, b_hi)
        if kind == 0:
            c = rng.randint(1, a + b - 1)
            q = (f"After receiving {b} {what} as a gift, {who} lost {c} of them. {who} had {a} {what} before the gift. "
                 f"How many {what} are left?" if reworded else
                 f"{who} has {a} {what}. {who} gets {b} more and then gives {c} away. How many {what} does {who} have now?")
            s = f"{who} starts with {a} {what}. After getting {b} more: {a} + {b} = {a + b}. After giving {c} away: {a + b} - {c} = {a + b - c}."
            ans = a + b - c
        elif kind == 1:
            q = (f"A shelf holds {a} bags, and every bag contains {b} {what}. What is the total number of {what} on the shelf?"
                 if reworded else f"{who} buys {a} boxes of {what} with {b} {what} in each box. How many {what} does {who} buy?")
            s = f"There are {a} boxes with {b} {what} each, so {a} * {b} = {a * b} {what}."
            ans = a * b
        elif kind == 2:
            total = a * b
            q = (f"{total} {what} are split into {b} piles of the same size. How many {what} are in one pile?" if reworded
                 else f"{who} shares {total} {what} equally among {b} friends. How many {what} does each friend get?")
            s = f"{total} {what} shared among {b} friends is {total} / {b} = {a} each."
            ans = a
        else:
            c = rng.randint(2, 9)
            q = (f"Take {a} {what} and add {b}. Multiply the result by 2, then add {c} more {what}. How many {what} is that?"
                 if reworded else
                 f"{who} has {a} {what}, buys {b} more, and then doubles the collection and adds {c}. How many {what} does {who} have?")
            s = f"{a} + {b} = {a + b}. Doubling gives 2 * {a + b} = {2 * (a + b)}. Adding {c} gives {2 * (a + b)} + {c} = {2 * (a + b) + c}."
            ans = 2 * (a + b) + c
        if q not in exclude:
            out.append({"question": q, "answer": str(ans), "solution": s})
    return out


# -----------------------------------------------------------------------------
# loading

def _from_hub(name, split):
    from datasets import load_dataset                               # heavy import, only here
    repo, configs, _ = HUB[name]
    rows = []
    for cfg in configs:
        ds = load_dataset(repo, cfg, split=split)
        rows += [(i, dict(r)) for i, r in enumerate(ds, 1)]
    return rows


def hub_offline():
    """Whether HF_HUB_OFFLINE tells the Hugging Face libraries to use their cache alone."""
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


def hub_unreachable(timeout=3.0):
    """Why the Hugging Face Hub cannot be reached, or None. One plain TCP connection, so an offline
    machine fails in seconds instead of after ~40 s of retries. Not checked (None) when
    HF_HUB_OFFLINE is set (the libraries then use their cache at once) or behind an HTTPS proxy."""
    import socket
    from urllib.parse import urlparse
    if hub_offline() or os.environ.get("HTTPS_PROXY") or os.environ.get("https_proxy"):
        return None
    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout).close()
    except OSError as e:
        return f"{url.hostname}:{url.port or url.scheme} unreachable: {e}"
    return None


def check_data_dir(data_dir):
    """data_dir itself, or DataError when it is given but is no folder (a typo would fall back to the Hub)."""
    if data_dir and not os.path.isdir(data_dir):
        raise DataError(f"data folder {data_dir!r} (--data_dir or $GTPO_DATA_DIR) does not exist; give the folder "
                        f"that holds <dataset>/<split>.jsonl (the layout `python -m machinery.data --export DIR` writes)")
    return data_dir


def is_local(name):
    """A --dataset value that names a .jsonl file of the user's (not a built-in dataset)."""
    return name.endswith(".jsonl") or os.sep in name


def load_task(name, split="train", data_dir=None):
    """Records {"question", "answer", "solution"} of dataset `name` and `split`.

    name: one of TASKS or a path to a .jsonl file. data_dir: folder with
    <name>/<split>.jsonl (default $GTPO_DATA_DIR). Raises DataError with a fix.
    """
    if name in ARITHMETIC_SPLITS and split not in ARITHMETIC_SPLITS[name]:
        raise DataError(f"dataset {name!r} has no split {split!r}; its splits are {', '.join(ARITHMETIC_SPLITS[name])}")
    if name == "arithmetic":
        return arithmetic_task(split)
    if name == "arithmetic-hard":                       # train on larger numbers, test on the "hard" split
        return arithmetic_task({"train": "hard-train", "test": "hard"}.get(split, split))
    if is_local(name):
        if not os.path.isfile(name):
            raise DataError(f"dataset file {name!r} does not exist; give a path to a .jsonl file "
                            f"with 'question'/'problem' and 'answer'/'solution' fields, or one of {TASKS}")
        return _records(read_jsonl(name), name, "local")
    if name not in HUB:
        raise DataError(f"unknown dataset {name!r}: use one of {TASKS} or a path to a .jsonl file")
    data_dir = check_data_dir(data_dir or os.environ.get("GTPO_DATA_DIR"))
    if data_dir:
        path = os.path.join(data_dir, name, f"{split}.jsonl")
        if os.path.isfile(path):
            return _records(read_jsonl(path), path, name)
    try:
        why = hub_unreachable()
        if why:
            raise ConnectionError(why)
        rows = _from_hub(name, split)
    except Exception as e:  # offline, missing split, no `datasets` ...: one actionable message
        where = f"{os.path.join(data_dir, name, split + '.jsonl')} does not exist and " if data_dir else ""
        raise DataError(
            f"dataset {name!r} split {split!r} is not available: {where}loading {HUB[name][0]!r} from the "
            f"Hugging Face Hub failed ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}). "
            f"Put the file at <DIR>/{name}/{split}.jsonl (upstream field names, one JSON object per line) "
            f"and pass --data_dir DIR or set GTPO_DATA_DIR=DIR.") from None
    return _records(rows, f"hub:{HUB[name][0]}", name)


# -----------------------------------------------------------------------------
# prompts

def build_messages(question, example=None):
    """Chat messages: the paper's system prompt (App. 16.1), then the question.
    example: optional (question, completion) pair shown as an earlier turn (the one-shot example)."""
    msgs = [{"role": "system", "content": SYSTEM_PROMPT}]
    if example:
        msgs += [{"role": "user", "content": example[0]}, {"role": "assistant", "content": example[1]}]
    return msgs + [{"role": "user", "content": question}]


def format_prompt(tokenizer, question, example=None):
    """Prompt text through the tokenizer's chat template, ending where the answer begins."""
    return tokenizer.apply_chat_template(build_messages(question, example), tokenize=False,
                                         add_generation_prompt=True)


def tagged_solution(record):
    """The worked solution in the paper's tag format: the SFT target."""
    sol = record["solution"] or ""
    return f"<reasoning>\n{sol.strip()}\n</reasoning>\n<answer>\n{record['answer']}\n</answer>"


def one_shot_example(record):
    """(question, tagged solution) of `record`: the worked example shown before the question."""
    return record["question"], tagged_solution(record)


def task_split(task, split, one_shot=False, data_dir=None):
    """(records, example) of a task's split: with one_shot the example is the first training record, which the
    train split then leaves out (train.py --one_shot); else None."""
    train = load_task(task, "train", data_dir) if one_shot or split == "train" else None
    example = one_shot_example(train[0]) if one_shot else None
    if split == "train":
        return train[1:] if one_shot else train, example
    return load_task(task, split, data_dir), example


def task_name(dataset):
    """The reward's task name for a --dataset value: 'gsm8k', or 'mine' for 'data/mine.jsonl'."""
    return os.path.basename(dataset).removesuffix(".jsonl")


def prompt_lengths(tokenizer, records, example=None):
    """Tokens of each record's prompt, as format_prompt builds it: the prompts rendered one by one,
    tokenized in one batch."""
    texts = [format_prompt(tokenizer, r["question"], example) for r in records]
    return [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def longest_prompt(tokenizer, records, example=None):
    """Tokens of the longest prompt of `records` (what a memory estimate must allow for)."""
    return max(prompt_lengths(tokenizer, records, example))


def filter_by_prompt_length(records, tokenizer, max_prompt_length, example=None):
    """Drop records whose prompt is longer than max_prompt_length tokens.
    Returns (kept, n_dropped) so the caller reports the count."""
    kept = [r for r, n in zip(records, prompt_lengths(tokenizer, records, example)) if n <= max_prompt_length]
    return kept, len(records) - len(kept)


# -----------------------------------------------------------------------------
# the offline folder, written from the Hub

EXPORT = {"gsm8k": ("train", "test"), "math": ("train", "test"), "math500": ("test",), "aime24": ("test",),
          "aime25": ("test",), "amc23": ("test",)}


def export(out_dir, names=None, log=print):
    """Write <out_dir>/<name>/<split>.jsonl from the Hub, upstream fields, one object per line: the
    folder that --data_dir / $GTPO_DATA_DIR reads (run it where the Hub is reachable, copy the
    folder to the offline machine). Each file is written whole or not at all, then read back
    through load_task. Returns {(name, split): number of records}."""
    unknown = [n for n in names or EXPORT if n not in EXPORT]
    if unknown:
        raise DataError(f"--datasets: unknown {unknown}; choose from {', '.join(EXPORT)}")
    why = hub_unreachable()
    if why:
        raise DataError(f"the Hugging Face Hub is needed to export ({why}); run `python -m machinery.data --export DIR` on a "
                        f"machine that reaches it and copy DIR here")
    counts = {}
    for name in names or EXPORT:
        for split in EXPORT[name]:
            rows = [row for _, row in _from_hub(name, split)]
            path = os.path.join(out_dir, name, f"{split}.jsonl")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
            counts[(name, split)] = len(load_task(name, split, out_dir))
            log(f"{path}: {len(rows)} rows, {counts[(name, split)]} records")
    return counts


def main(argv=None):
    import argparse
    p = argparse.ArgumentParser(description="Write the offline data folder (<DIR>/<dataset>/<split>.jsonl) from the "
                                            "Hugging Face Hub, for --data_dir / GTPO_DATA_DIR.")
    p.add_argument("--export", metavar="DIR", required=True, help="folder to write (created if missing)")
    p.add_argument("--datasets", default=",".join(EXPORT), help=f"comma-separated subset of {','.join(EXPORT)}")
    a = p.parse_args(argv)
    try:
        export(a.export, a.datasets.split(","))
    except DataError as e:
        print(f"error: {e}")
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


def epoch_steps(n_records, batch_size, world, log):
    """Optimizer steps per epoch: whole steps of B prompts on each of W ranks. The remainder of an
    epoch is left out, as a DataLoader's drop_last does (each epoch draws a fresh order, so it is not
    always the same prompts); a step with no prompt on some rank could not run."""
    per_step = batch_size * world
    steps, left = divmod(n_records, per_step)
    if steps == 0:
        raise DataError(f"{n_records} training prompts cannot fill one step of {batch_size} prompt(s) on each of "
                        f"{world} rank(s); lower --batch_size or the number of ranks")
    if left:
        log(f"epoch: {steps} steps of {batch_size} prompt(s) x {world} rank(s); {left} of {n_records} prompts left "
            f"out of each epoch (a fresh order every epoch)")
    return steps


def step_records(records, k, steps_per_epoch, n, dist, seed, wrap=False):
    """This rank's n records for optimizer step k: epoch order from a seeded permutation, rank r
    takes slice r of each step's share. wrap: the SFT warm-up's n = B x G records, read on
    cyclically through the epoch's order (always n of them)."""
    import torch
    epoch, j = divmod(k, steps_per_epoch)
    order = torch.randperm(len(records), generator=torch.Generator().manual_seed(seed + epoch))
    part = j * dist.world + dist.rank
    if wrap:
        idx = order[(part * n + torch.arange(n)) % len(records)]
    else:
        idx = order[part * n:(part + 1) * n]
    return [records[i] for i in idx.tolist()], epoch
