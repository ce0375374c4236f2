"""Tests for machinery/data.py: upstream formats, the built-in task, and the error messages."""
import json
import os
import re

import pytest

from machinery.data import (SYSTEM_PROMPT, DataError, arithmetic_task, build_messages, last_boxed, load_task,
                            split_gsm8k, tagged_solution, to_record)
from rewards import score

DATA = os.environ.get("GTPO_DATA_DIR")


def test_split_gsm8k_drops_calculator_notes_and_commas():
    ans, sol = split_gsm8k("She pays 2*600 = <<2*600=1200>>1200.\nTotal 1,200+34=<<1200+34=1234>>1,234\n#### 1,234")
    assert ans == "1234"
    assert "<<" not in sol and sol.endswith("Total 1,200+34=1,234")


def test_last_boxed():
    assert last_boxed(r"so $\boxed{\frac{1}{2}}$ and \boxed{x^{2}+1}.") == "x^{2}+1"
    assert last_boxed(r"\fbox{7}") == "7"
    assert last_boxed(r"\boxed 5$.") == "5"
    assert last_boxed("no box") is None
    assert last_boxed(r"\boxed{\frac{1}{2}") is None                   # unbalanced


def test_to_record_detects_fields():
    assert to_record({"problem": "p", "solution": r"so \boxed{3}"}) == {"question": "p", "answer": "3",
                                                                          "solution": r"so \boxed{3}"}
    assert to_record({"question": "q", "answer": 27.0})["answer"] == "27"
    with pytest.raises(DataError, match="found fields"):
        to_record({"text": "q"})


def test_local_jsonl_and_malformed_line(tmp_path):
    good = tmp_path / "mine.jsonl"
    good.write_text(json.dumps({"question": "1+1?", "answer": "2"}) + "\n\n" +
                    json.dumps({"problem": "p", "solution": r"\boxed{4}"}) + "\n")
    recs = load_task(str(good))
    assert [r["answer"] for r in recs] == ["2", "4"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "q", "answer": "1"}) + "\n{not json\n")
    with pytest.raises(DataError, match=re.escape(f"{bad}:2: malformed JSON")):
        load_task(str(bad))
    with pytest.raises(DataError, match="does not exist"):
        load_task(str(tmp_path / "missing.jsonl"))


def test_unknown_and_unreachable_datasets_say_how_to_fix(tmp_path, monkeypatch):
    with pytest.raises(DataError, match="unknown dataset 'gsm9k'"):
        load_task("gsm9k")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    for name in ("aime24", "aime25"):
        with pytest.raises(DataError) as e:
            load_task(name, "test", data_dir=str(tmp_path))
        msg = str(e.value)
        assert "--data_dir" in msg and "GTPO_DATA_DIR" in msg and f"{name}/test.jsonl" in msg


def test_arithmetic_task_is_deterministic_and_correct():
    a, b = arithmetic_task("train", 300), arithmetic_task("train", 300)
    assert a == b
    train, test = arithmetic_task("train"), arithmetic_task("test")
    assert len(train) == 2000 and len(test) == 200
    assert not {r["question"] for r in train} & {r["question"] for r in test}
    for r in a:
        # the worked solution ends with the answer, and its arithmetic is right
        last = re.findall(r"(\d+) ([-+*/]) (\d+) = (\d+)", r["solution"])[-1]
        x, op, y, z = last
        assert eval(f"{x}{op}{y}") == int(z) and z == r["answer"]


def test_hard_arithmetic_split_has_larger_numbers():
    hard, train = arithmetic_task("hard"), arithmetic_task("train")
    assert hard == arithmetic_task("hard") and len(hard) == 200
    assert not {r["question"] for r in hard} & {r["question"] for r in train}
    first = [int(re.findall(r"\d+", r["question"])[0]) for r in hard]   # a, or a * b in the sharing kind
    assert min(first) > 20 and max(int(r["answer"]) for r in hard) > max(int(r["answer"]) for r in train)
    for r in hard:
        x, op, y, z = re.findall(r"(\d+) ([-+*/]) (\d+) = (\d+)", r["solution"])[-1]
        assert eval(f"{x}{op}{y}") == int(z) and z == r["answer"]


def test_missing_data_dir_is_refused(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_task("gsm8k", "train", data_dir=str(tmp_path / "typo"))


def test_prompt_and_sft_target_format():
    assert SYSTEM_PROMPT.startswith("You are a helpful assistant for solving math problems.")
    msgs = build_messages("What is 2+2?")
    assert [m["role"] for m in msgs] == ["system", "user"] and msgs[0]["content"] == SYSTEM_PROMPT
    rec = arithmetic_task("train", 1)[0]
    target = tagged_solution(rec)
    total, fmt, cor = score([target], [rec["answer"]], "arithmetic")
    assert fmt.item() == 10 and cor.item() == 10


@pytest.mark.needs_data
def test_real_datasets_load_with_expected_sizes():
    sizes = {("gsm8k", "train"): 7473, ("gsm8k", "test"): 1319, ("math", "test"): 5000,
             ("math500", "test"): 500, ("aime24", "test"): 30, ("aime25", "test"): 30, ("amc23", "test"): 40}
    for (name, split), n in sizes.items():
        recs = load_task(name, split)
        assert len(recs) == n, name
        assert all(r["question"] and r["answer"] for r in recs)
    with pytest.warns(UserWarning, match="skipped 2 of 7500"):       # two upstream items have \boxed{}
        assert len(load_task("math", "train")) == 7498
    first = load_task("gsm8k", "test")[0]
    assert first["answer"] == "18" and "<<" not in first["solution"]


@pytest.mark.needs_data
def test_prompt_lengths_are_each_prompt_tokenized_alone_and_the_filter_keeps_those_that_fit():
    """The batched count equals tokenizing each format_prompt on its own (GSM8K's first 300 train
    questions after the one-shot example), and --max_prompt_length keeps exactly the prompts at or under it."""
    from machinery.data import filter_by_prompt_length, format_prompt, longest_prompt, one_shot_example, prompt_lengths
    from machinery.models import embedded_model_dir, load_tokenizer
    tok = load_tokenizer(embedded_model_dir())
    records = load_task("gsm8k", "train")[:301]
    example, records = one_shot_example(records[0]), records[1:]
    alone = [len(tok(format_prompt(tok, r["question"], example), add_special_tokens=False)["input_ids"])
             for r in records]
    assert prompt_lengths(tok, records, example) == alone
    assert longest_prompt(tok, records, example) == max(alone)
    limit = sorted(alone)[len(alone) // 2]                             # about half the prompts fit
    kept, dropped = filter_by_prompt_length(records, tok, limit, example)
    assert kept == [r for r, n in zip(records, alone) if n <= limit] and dropped == len(records) - len(kept) > 0


def test_reworded_arithmetic_split_keeps_numbers_changes_sentences():
    reworded, train = arithmetic_task("reworded"), arithmetic_task("train")
    assert reworded == arithmetic_task("reworded") and len(reworded) == 200
    openings = {" ".join(r["question"].split()[:2]) for r in train}
    assert not any(" ".join(r["question"].split()[:2]) in openings for r in reworded)   # no train sentence
    assert max(int(r["answer"]) for r in reworded) <= max(int(r["answer"]) for r in train)
    for r in reworded:
        x, op, y, z = re.findall(r"(\d+) ([-+*/]) (\d+) = (\d+)", r["solution"])[-1]
        assert eval(f"{x}{op}{y}") == int(z) and z == r["answer"]


@pytest.mark.needs_data
def test_export_writes_the_folder_load_task_reads(tmp_path, monkeypatch):
    """machinery/data.py --export with the Hub loader stubbed by the offline files: every file comes back with
    the same rows, and load_task reads the new folder as it reads the original."""
    from machinery import data
    src = os.environ["GTPO_DATA_DIR"]
    monkeypatch.setattr(data, "hub_unreachable", lambda: None)
    monkeypatch.setattr(data, "_from_hub", lambda name, split: data.read_jsonl(os.path.join(src, name, f"{split}.jsonl")))
    assert data.main(["--export", str(tmp_path / "out")]) == 0
    for name, splits in data.EXPORT.items():
        for split in splits:
            new, old = (os.path.join(d, name, f"{split}.jsonl") for d in (tmp_path / "out", src))
            assert [r for _, r in data.read_jsonl(new)] == [r for _, r in data.read_jsonl(old)]
            assert load_task(name, split, str(tmp_path / "out")) == load_task(name, split, src)


def test_export_without_the_hub_says_what_to_do(tmp_path, monkeypatch, capsys):
    from machinery import data
    monkeypatch.setattr(data, "hub_unreachable", lambda: "huggingface.co:https unreachable: timed out")
    assert data.main(["--export", str(tmp_path), "--datasets", "gsm8k"]) == 2
    assert "machine that reaches it" in capsys.readouterr().out and not os.listdir(tmp_path)
    monkeypatch.setattr(data, "hub_unreachable", lambda: None)
    assert data.main(["--export", str(tmp_path), "--datasets", "gsm8"]) == 2
    assert "unknown ['gsm8']" in capsys.readouterr().out
