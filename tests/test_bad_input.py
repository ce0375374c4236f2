"""Bad input never costs a run (docs/reliability.md, "Bad input"): every case of the table, each refused in one
line naming what was wrong, before anything loads, with nothing already written lost or mixed."""
import json
import os

import pytest
import torch

import eval as evaluate
import rewards
import step
import train
from machinery.data import DataError, load_task


def fake_run(out):
    """A finished training run's files, each with content to check afterwards."""
    (out / "checkpoint-2").mkdir(parents=True)
    (out / "final").mkdir()
    (out / "checkpoint-2" / "adapter_model.safetensors").write_text("old weights 2")
    (out / "final" / "adapter_model.safetensors").write_text("old final")
    (out / "config.json").write_text(json.dumps({"method": "gtpo", "lr": 3e-4}))
    (out / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    (out / "samples.jsonl").write_text('{"step": 2, "completion": "old"}\n')
    return snapshot(out)


def snapshot(folder):
    return {os.path.relpath(os.path.join(d, f), folder): open(os.path.join(d, f)).read()
            for d, _, files in os.walk(folder) for f in files}


# -----------------------------------------------------------------------------
# 1-3: nothing already written is lost

@pytest.mark.parametrize("bad", [["--lr", "-1"], ["--model", "/no/such/model"], ["--dataset", "/no/such.jsonl"],
                                 ["--save_steps", "0"]])
def test_overwrite_checks_everything_before_it_touches_the_old_run(tmp_path, train_here, bad):
    """Today's flags, data and model are checked before --overwrite moves anything: the old run stays whole."""
    out = tmp_path / "run"
    before = fake_run(out)
    r = train_here("--output_dir", out, "--overwrite", "--max_steps", "10", *bad)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert snapshot(out) == before and not os.path.exists(f"{out}.replaced")


def test_a_failed_overwrite_leaves_the_old_run_whole_and_no_mixed_folder(tmp_path, tiny_args, monkeypatch):
    """--overwrite that fails (or is stopped) before its first checkpoint: the old run is whole in
    <out>.replaced and the folder holds nothing of it (no old final/ beside the new config.json); a second
    overwrite keeps that copy and sets its own aside; the one that saves a checkpoint removes its own."""
    out = tmp_path / "run"
    before = fake_run(out)
    argv = tiny_args(out, max_steps=2, save_steps=2) + ["--overwrite"]

    def boom(*a, **k):
        raise RuntimeError("stopped before the first checkpoint")
    monkeypatch.setattr(step, "rl_step", boom)
    with pytest.raises(RuntimeError):
        train.main(argv)
    assert snapshot(f"{out}.replaced") == before
    assert not (out / "final").exists() and json.loads((out / "config.json").read_text())["lr"] != 3e-4
    monkeypatch.undo()
    assert train.main(argv) == 0
    assert snapshot(f"{out}.replaced") == before                       # the old run, not the failed new one
    assert not os.path.exists(f"{out}.replaced-2")                      # the failed run's folder, removed
    assert (out / "final").is_dir() and (out / "checkpoint-2").is_dir()


def test_evaluation_never_writes_into_a_training_run(tmp_path):
    out = tmp_path / "run"
    before = fake_run(out)
    for flags in ([], ["--overwrite"], ["--resume"]):
        with pytest.raises(DataError, match="holds a training run"):
            evaluate.main(["--output_dir", str(out), "--limit", "2", *flags])
    assert snapshot(out) == before


def test_resume_refuses_samples_of_another_adapter(tmp_path):
    out = tmp_path / "eval"
    out.mkdir()
    (out / "samples.jsonl").write_text('{"problem": 0, "sample": 0}\n')
    args = evaluate.parse_args(["--adapter", str(tmp_path / "a" / "final"), "--output_dir", str(out)])
    args.one_shot_from = "arithmetic"
    (out / "eval_args.json").write_text(json.dumps(evaluate.eval_args(args)))
    with pytest.raises(DataError, match="other settings.*adapter"):
        evaluate.main(["--adapter", str(tmp_path / "a" / "checkpoint-8"), "--output_dir", str(out), "--resume"])
    (out / "eval_args.json").unlink()
    with pytest.raises(DataError, match="does not say which model and adapter"):
        evaluate.main(["--adapter", str(tmp_path / "a" / "final"), "--output_dir", str(out), "--resume"])


def test_each_adapter_has_its_own_default_evaluation_folder(tmp_path):
    folders = {evaluate.default_output_dir(evaluate.parse_args(["--adapter", f"runs/gtpo-x/{c}"]))
               for c in ("final", "checkpoint-8")}
    assert folders == {os.path.join("runs", "eval-smollm2-135m-arithmetic-gtpo-x-final"),
                       os.path.join("runs", "eval-smollm2-135m-arithmetic-gtpo-x-checkpoint-8")}


def test_adapter_given_as_the_run_folder_means_its_final(tmp_path):
    out = tmp_path / "run"
    fake_run(out)
    said = []
    assert evaluate.adapter_folder(str(out), said.append) == str(out / "final") and "final/" in said[0]
    (out / "final" / "adapter_model.safetensors").unlink()
    (out / "final").rmdir()
    with pytest.raises(evaluate.ModelError, match="without final/.*checkpoint-2"):
        evaluate.adapter_folder(str(out))


# -----------------------------------------------------------------------------
# every flag's range, at parse time

@pytest.mark.parametrize("flag,value,words", [
    ("--temperature", "0", "> 0"), ("--temperature", "-1", "> 0"), ("--lr", "-1", "> 0"), ("--lr", "nan", "> 0"),
    ("--save_steps", "0", ">= 1"), ("--epochs", "0", ">= 1"), ("--max_completion_length", "0", ">= 1"),
    ("--lora_rank", "-1", ">= 0"), ("--beta", "-1", ">= 0"), ("--ent_gamma", "nan", "finite"),
    ("--ent_gamma", "inf", "finite"), ("--ent_threshold", "-5", ">= 0"), ("--adam_beta1", "1.5", "[0, 1)"),
    ("--adam_beta2", "1", "[0, 1)"), ("--max_steps", "0", "or -1"), ("--warmup_ratio", "2", "[0, 1]"),
    ("--max_grad_norm", "0", "> 0")])
def test_a_flag_out_of_range_is_one_line_before_anything_loads(flag, value, words, capsys):
    with pytest.raises(SystemExit) as e:
        train.main([flag, value])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and f"argument {flag}: must be" in err and words in err


@pytest.mark.parametrize("flag,value", [("--limit", "-3"), ("--n_samples", "0"), ("--temperature", "0"),
                                        ("--max_completion_length", "0"), ("--batch_size", "0")])
def test_eval_flags_out_of_range(flag, value, capsys):
    with pytest.raises(SystemExit) as e:
        evaluate.parse_args([flag, value])
    assert e.value.code == 2 and f"argument {flag}: must be" in capsys.readouterr().err


def test_cuda_asked_without_cuda_and_an_unwritable_folder_are_refused_before_loading(tmp_path, train_here):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here")
    r = train_here("--device", "cuda")
    assert r.returncode == 2 and "--device cuda" in r.stderr and "--device cpu" in r.stderr
    (tmp_path / "f").write_text("")
    r = train_here("--output_dir", tmp_path / "f" / "run")
    assert r.returncode == 2 and "is a file, not a folder" in r.stderr


def test_a_flag_the_method_never_reads_is_said_once(capsys):
    from machinery import config
    config.parse_args(["--use_grpo", "--entropy_term", "eq7"])
    config.parse_args(["--use_sft", "--loss_type", "dapo"])
    config.parse_args(["--use_grpo", "--entropy_filter", "all", "--entropy_term", "eq7"])   # App. 14: read
    assert capsys.readouterr().err.splitlines() == ["note: --entropy_term has no effect with --use_grpo",
                                                   "note: --loss_type has no effect with --use_sft"]


# -----------------------------------------------------------------------------
# data files and the reward

@pytest.mark.parametrize("content,words", [
    (b"", "no records"), (b"\n\n", "no records"), (b'{"question": 5, "answer": "3"}\n', ":1: the question must be"),
    (b'{"question": "q", "answer": {"a": 1}}\n', ":1: an answer must be a string or a number"),
    (b'{"question": "q", "answer": [1]}\n', ":1: an answer must be"),
    (b'{"question": "q", "answer": "1"}\n{"question": "caf\xe9", "answer": "3"}\n', ":2: not UTF-8")])
def test_bad_data_files_name_file_and_line(tmp_path, content, words):
    path = tmp_path / "mine.jsonl"
    path.write_bytes(content)
    with pytest.raises(DataError, match=words) as e:
        load_task(str(path))
    assert str(path) in str(e.value)


def test_number_answers_are_read_as_the_loader_reads_them(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text('{"question": "q", "answer": 27}\n{"question": "r", "answer": 2.5}\n')
    assert [r["answer"] for r in load_task(str(path))] == ["27", "2.5"]
    good = "<reasoning>x</reasoning><answer>27</answer>"
    total, _, cor = rewards.reward([good, good], [27, 27.0], "arithmetic")
    assert cor.tolist() == [10.0, 10.0] and total.tolist() == [20.0, 20.0]
    assert rewards.trl_reward("arithmetic")([good], answer=[27]) == [20.0]
    with pytest.raises(DataError, match="answers\\[0\\]: an answer must be"):
        rewards.reward([good], [{"x": 1}], "arithmetic")
