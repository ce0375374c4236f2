"""study.py: the run table gives every run the same budget, and the report recomputes from the
committed small files alone."""
import json
import os
import statistics

import pytest

import study


def test_run_table_same_budget_independent_seeds():
    jobs = study.jobs()
    ids = [run_id for run_id, _, _ in jobs]
    assert len(ids) == len(set(ids))
    seeds = {name: ss for name, _, ss, _ in study.RUNS}
    parts = {name: part for name, part, _, _ in study.RUNS}
    assert all(len(seeds[n]) >= (3 if parts[n] == "main" else 2) for n in seeds)
    assert [p for p in parts.values()].count("main") == 4
    for run_id, flags, seed in jobs:
        assert run_id.endswith(f"-s{seed}")
        if run_id.startswith("warmup"):
            continue
        assert flags[:len(study.COMMON)] == study.COMMON              # same steps, prompts, G, tokens
        extra = flags[len(study.COMMON):]
        budget = {"--max_steps", "--batch_size", "--generation_size", "--max_completion_length", "--sft_warmup_steps"}
        assert not budget & set(extra)


def _write_run(keep, run_id, formats, pass1):
    d = keep / run_id
    d.mkdir(parents=True)
    rows = [{"step": i + 1, "phase": "rl", "rewards/format": f, "rewards/accuracy": 1.0, "entropy": 0.5}
            for i, f in enumerate(formats)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = {"dataset": "arithmetic", "n_samples": 8, "pass@k": {"1": pass1, "8": 0.5}, "maj@k": {"1": pass1, "8": 0.25}}
    (d / "eval-id.json").write_text(json.dumps(res))
    (d / "times.json").write_text(json.dumps({"train": [{"seconds": 600.0, "finished": True, "workers": 2}]}))


def test_summary_recomputes_from_committed_files(tmp_path, monkeypatch):
    monkeypatch.setattr(study, "KEEP", str(tmp_path))
    _write_run(tmp_path, "gtpo-s1", [0, 0, 2, 4, 6, 8, 10], 0.10)      # last 5 steps: mean 6 -> 60 %
    _write_run(tmp_path, "gtpo-s2", [0, 0, 4, 4, 4, 4, 4], 0.20)      # 40 %
    row = next(r for r in study.summarize() if r["config"] == "gtpo")
    assert row["seeds_done"] == 2 and row["seeds"] == 3
    assert row["format % (last 5)"] == (50.0, statistics.stdev([60.0, 40.0]), 2)
    assert row["ID pass@1"][0] == pytest.approx(0.15) and row["OOD pass@1"] is None
    assert row["train min/run"][0] == 10.0
    study.report()
    for f in ("summary.md", "summary.json", "curves-main.png", "curves-ablation.png", "passk.png"):
        assert os.path.getsize(tmp_path / f) > 0
    assert "| gtpo | main | 2/3 | 50.0 ± 14.1 |" in (tmp_path / "summary.md").read_text()


def test_paired_differences_use_only_seeds_both_runs_finished(tmp_path, monkeypatch):
    monkeypatch.setattr(study, "KEEP", str(tmp_path))
    _write_run(tmp_path, "gtpo-s1", [0, 0, 2, 4, 6, 8, 10], 0.10)
    _write_run(tmp_path, "gtpo-s2", [0, 0, 4, 4, 4, 4, 4], 0.20)
    _write_run(tmp_path, "grpo-s1", [0, 0, 0, 0, 0, 0, 0], 0.25)     # seed 2 of grpo has not finished
    d = study.paired("gtpo", "grpo")
    assert [s for s, _ in d["ID pass@1"]] == [1]
    assert d["ID pass@1"][0][1] == pytest.approx(-0.15) and d["accuracy % (last 5)"] == [(1, 0.0)]
    assert d["OOD pass@1"] == []
    row = next(line for line in study.pair_lines() if "| gtpo - grpo |" in line)
    assert "| -0.150 (0+ 1-) |" in row and row.endswith("| – |")
