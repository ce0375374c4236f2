"""machinery/heldout.py: the in-run held-out evaluation -- eval.py's rows and samples on the same checkpoint, the training it
leaves alone, problems it never trains on, best.json and best/, resume, two ranks, the loggers, the curves."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from conftest import ENV, HERE, free_port

EVAL = {"eval_steps": 2, "eval_limit": 3, "eval_n_samples": 2}


def _rows(out, phase=None):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return [r for r in rows if phase is None or r.get("phase") == phase]


def _timeless(rows):
    return [{k: v for k, v in r.items() if not k.startswith("time/") and k not in ("step_time", "eval/seconds")}
            for r in rows]


def _samples(path, step=None):
    with open(path) as f:
        rows = [json.loads(line) for line in f]
    return [{k: v for k, v in r.items() if k != "step"} for r in rows if step is None or r["step"] == step]


def _eval_py(adapter, out, limit=3, n=2):
    """eval.py on a checkpoint with the flags the issue names and no other -> (results, samples)."""
    import eval as evaluate
    assert evaluate.main(["--adapter", adapter, "--limit", str(limit), "--n_samples", str(n),
                          "--max_completion_length", "6", "--output_dir", str(out)]) == 0
    with open(os.path.join(out, "results.json")) as f:
        return json.load(f), _samples(os.path.join(out, "samples.jsonl"))


def test_the_row_at_step_k_is_eval_py_on_checkpoint_k_and_training_goes_on_as_without_it(
        tmp_path, tiny_args, train_here):
    """Evaluations at step 0, 2 and 4 (the last); eval.py --adapter RUN/checkpoint-k --limit M --n_samples n
    --max_completion_length L (the run's model and held-out set read from the run) gives the same samples, bit for
    bit, and the same pass@k, format, length; the training rows and the final adapter are those of the same run
    without evaluation (its random draws are its own)."""
    a, b = tmp_path / "with", tmp_path / "without"
    common = dict(max_steps=4, save_steps=2, lr=1e-2, warmup_ratio=0, optimizer="adamw_torch")
    assert train_here(*tiny_args(a, **common, **EVAL)).returncode == 0
    assert train_here(*tiny_args(b, **common)).returncode == 0
    assert _timeless(_rows(a, "rl")) == _timeless(_rows(b, "rl")) and not _rows(b, "eval")
    wa, wb = (load_file(os.path.join(d, "final", "adapter_model.safetensors")) for d in (a, b))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    rows = _rows(a, "eval")
    assert [r["step"] for r in rows] == [0, 2, 4] and all(r["eval/problems"] == 3 and r["eval/n"] == 2 for r in rows)
    assert [r["step"] for r in _rows(a)] == [0, 1, 2, 2, 3, 4, 4]                 # each evaluation after its step
    for row in rows[1:]:
        k = row["step"]
        res, samples = _eval_py(str(a / f"checkpoint-{k}"), tmp_path / f"eval-{k}")
        assert samples == _samples(a / "eval_samples.jsonl", k)
        assert res["dataset"] == "arithmetic" and res["split"] == "test"
        assert {f"eval/pass@{k_}": v for k_, v in res["pass@k"].items()} == {x: row[x] for x in row if "pass@" in x}
        assert (res["format_rate"], res["truncated_frac"], res["mean_length"]) == \
            (row["eval/format"], row["eval/truncated"], row["eval/mean_length"])
    best = json.loads((a / "best.json").read_text())
    top = max(r["eval/pass@1"] for r in rows)
    assert best["step"] == min(r["step"] for r in rows if r["eval/pass@1"] == top)


def test_held_out_problems_are_never_training_problems(tmp_path, tiny_args, train_here):
    """Every built-in dataset's held-out split the run would read shares no question with its training split (the
    real datasets where GTPO_DATA_DIR has them); a planted overlap is refused before any model loads, naming the
    fix; a .jsonl training file without --eval_dataset is not evaluated unless asked, and then refused."""
    from machinery import heldout
    from machinery.config import parse_args
    from machinery.data import DataError, load_task
    data_dir = os.environ.get("GTPO_DATA_DIR")
    for dataset in ["arithmetic", "arithmetic-hard"] + [d for d in ("gsm8k", "math") if data_dir and
                                                       os.path.isfile(os.path.join(data_dir, d, "test.jsonl"))]:
        cfg = parse_args(["--model", "x", "--dataset", dataset, "--eval_limit", "100000", "--output_dir",
                          str(tmp_path / "x")])
        train = load_task(dataset, "train", data_dir)
        cfg, held = heldout.plan(cfg, train, log=lambda *a: None)
        assert held and not {r["question"] for r in held} & {r["question"] for r in train}, dataset
        assert cfg.eval_steps == cfg.save_steps
    train_file, held_file = tmp_path / "train.jsonl", tmp_path / "held.jsonl"
    train_file.write_text("".join(json.dumps({"question": f"What is {i} + 1?", "answer": str(i + 1)}) + "\n"
                                  for i in range(6)))
    held_file.write_text(json.dumps({"question": "What is 9 + 9?", "answer": "18"}) + "\n" +
                         json.dumps({"question": "What is 3 + 1?", "answer": "4"}) + "\n")
    r = train_here(*tiny_args(tmp_path / "a", dataset=train_file, eval_dataset=held_file, eval_steps=1))
    assert r.returncode == 2 and "1 of the 2 held-out problems" in r.stderr and "first at position 1" in r.stderr
    assert "--eval_dataset" in r.stderr and "model" not in r.stdout          # refused before the model loads
    r = train_here(*tiny_args(tmp_path / "b", dataset=train_file, eval_steps=2))
    assert r.returncode == 2 and "one file with no held-out split; give --eval_dataset" in r.stderr
    r = train_here(*tiny_args(tmp_path / "c", dataset=train_file, eval_dataset="arithmetic", eval_split="nope",
                              eval_steps=2))
    assert r.returncode == 2 and "--eval_split nope: dataset 'arithmetic' has no split 'nope'" in r.stderr
    cfg = parse_args(["--model", "x", "--dataset", str(train_file), "--output_dir", str(tmp_path / "d")])
    said = []
    cfg, held = heldout.plan(cfg, load_task(str(train_file)), log=said.append)
    assert held is None and cfg.eval_steps == 0 and said[0].startswith("held-out evaluation: off (")
    with pytest.raises(DataError, match="--eval_steps 3: .*one file"):
        heldout.plan(parse_args(["--model", "x", "--dataset", str(train_file), "--eval_steps", "3"]), [], log=said.append)


def test_due_steps_are_rl_start_every_n_and_the_last():
    from machinery import heldout
    from machinery.config import parse_args
    cfg = parse_args(["--sft_warmup_steps", "3", "--max_steps", "11", "--eval_steps", "4"])
    assert [k for k in range(12) if heldout.due(cfg, k, 11)] == [3, 4, 8, 11]
    cfg = parse_args(["--model", "x", "--max_steps", "5", "--eval_steps", "0"])
    assert not any(heldout.due(cfg, k, 5) for k in range(6))


@pytest.mark.slow
def test_save_best_keeps_the_best_steps_adapter_and_a_resume_keeps_every_row_once(tmp_path, tiny_args, train_here):
    """--save_best: best/ holds the adapter of best.json's step. A run stopped after an evaluation was written but
    before the next checkpoint (its rows past checkpoint-2 left in place) resumes to the same rows, the evaluations
    included, none twice, and the same samples file."""
    a = tmp_path / "a"
    args = dict(max_steps=4, save_steps=2, lr=1e-2, warmup_ratio=0, optimizer="adamw_torch", save_best=True, **EVAL)
    assert train_here(*tiny_args(a, **args)).returncode == 0
    best = json.loads((a / "best.json").read_text())
    marker = json.loads((a / "best" / "best.json").read_text())
    assert marker["step"] == best["step"]
    kept = load_file(str(a / "best" / "adapter_model.safetensors"))
    source = a / (f"checkpoint-{best['step']}" if best["step"] else "final")
    if best["step"]:
        ref = load_file(str(source / "adapter_model.safetensors"))
        assert all(torch.equal(kept[k], ref[k]) for k in ref)
    b = tmp_path / "b"                                   # as if killed after step 4's evaluation, before its save
    shutil.copytree(a, b)
    for d in ("final", "checkpoint-4"):
        shutil.rmtree(b / d)
    r = train_here(*tiny_args(b, **args), "--resume")
    assert r.returncode == 0 and "resumed from" in r.stdout, r.stderr[-2000:]
    assert _timeless(_rows(b)) == _timeless(_rows(a))
    assert [r_["step"] for r_ in _rows(b, "eval")] == [0, 2, 4]
    assert _samples(b / "eval_samples.jsonl") == _samples(a / "eval_samples.jsonl")


@pytest.mark.slow
def test_two_ranks_evaluate_their_shares_and_the_row_is_one_process_eval_py(tmp_path, tiny_args):
    """Under torchrun (gloo) each rank samples every other rollout call of the evaluation (16 samples a problem:
    eval.py's 32-completion calls take 2 problems, so 5 problems are 3 calls, 2 on rank 0 and 1 on rank 1); the
    row and the samples equal eval.py's in one process on the same checkpoint."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           os.path.join(HERE, "train.py"), *tiny_args(out, max_steps=2, save_steps=2, optimizer="adamw_torch",
                                                      lr=1e-2, warmup_ratio=0, generation_size=2, eval_steps=2,
                                                      eval_limit=5, eval_n_samples=16), "--device", "cpu"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "trainable weights bit-identical on all 2 ranks" in r.stdout
    row = _rows(out, "eval")[-1]
    assert row["step"] == 2 and row["eval/problems"] == 5 and row["eval/n"] == 16
    res, samples = _eval_py(str(out / "checkpoint-2"), tmp_path / "e", limit=5, n=16)
    assert samples == _samples(out / "eval_samples.jsonl", 2) and len(samples) == 80
    assert {f"eval/pass@{k}": v for k, v in res["pass@k"].items()} == {x: row[x] for x in row if "pass@" in x}


@pytest.mark.slow
def test_report_to_tensorboard_and_trackio_hold_the_training_and_held_out_rows(tmp_path, tiny_args, train_cli):
    """--report_to tensorboard,trackio (optional packages, offline): the event files in <run>/runs and Trackio's
    local store hold every training and held-out row at its step."""
    pytest.importorskip("tensorboard", reason="an optional logger: pip install tensorboard")
    pytest.importorskip("trackio", reason="an optional logger: pip install trackio")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    out, store = tmp_path / "run", tmp_path / "trackio"
    r = train_cli(*tiny_args(out, max_steps=2, save_steps=2, report_to="tensorboard,trackio", **EVAL),
                  env={"TRACKIO_DIR": str(store)})
    assert r.returncode == 0, r.stderr[-3000:]
    events = EventAccumulator(str(out / "runs")).Reload()
    assert [e.step for e in events.Scalars("loss")] == [1, 2]
    assert [e.step for e in events.Scalars("eval/pass@1")] == [0, 2]
    assert [e.value for e in events.Scalars("eval/mean_length")] == \
        pytest.approx([r_["eval/mean_length"] for r_ in _rows(out, "eval")])
    read = ("import json, trackio; print(json.dumps(trackio.SQLiteStorage.get_logs('gtpo', 'run')))")
    logged = json.loads(subprocess.run([sys.executable, "-c", read], capture_output=True, text=True, timeout=120,
                                       env={**ENV, "TRACKIO_DIR": str(store)}).stdout)
    assert [x["step"] for x in logged if "loss" in x] == [1, 2]
    assert [x["step"] for x in logged if "eval/pass@1" in x] == [0, 2]


def test_report_to_names_a_missing_or_unknown_logger_before_anything_loads(train_here, tiny_args, tmp_path,
                                                                           monkeypatch):
    import importlib.util
    r = train_here(*tiny_args(tmp_path / "a", report_to="wandb,mlflow"))
    assert r.returncode == 2 and "'mlflow' is none of wandb, tensorboard, trackio" in r.stderr
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "trackio" else real(name, *a))
    r = train_here(*tiny_args(tmp_path / "b", report_to="trackio"))
    assert r.returncode == 2 and "pip install trackio" in r.stderr


def test_curves_draw_the_held_out_pass1_on_its_own_axis_beside_the_reward():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from analysis import plots
    fig, ax = plt.subplots()
    held = [[{"step": 0, "eval/pass@1": 0.1, "eval/problems": 64, "eval/n": 4},
             {"step": 20, "eval/pass@1": 0.3, "eval/problems": 64, "eval/n": 4}], []]
    plots.held_out_axis(ax, held)
    twin = [a for a in fig.axes if a is not ax][0]
    assert twin.get_ylabel() == "held-out pass@1 (dashed; 64 problems x 4)"
    assert [list(line.get_xdata()) for line in twin.lines] == [[0, 20]]
    plt.close(fig)
