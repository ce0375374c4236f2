"""What a newcomer types and reads first: flags spelt either way and no abbreviations, a run that would take
no RL step refused before the model loads, records without a worked solution announced, --data_dir read
only where a dataset needs it, and the logged learning rate being the one the step used."""
import os
import subprocess
import sys

import pytest
import torch

import config
import eval as ev
import train
from config import parse_args
from conftest import ENV, HERE
from runs import ConfigError


def test_flags_take_hyphens_or_underscores_in_train_and_eval():
    cfg = parse_args(["--max-steps", "7", "--no-one-shot", "--use-grpo", "--entropy-term=eq7", "--sft_warmup_steps",
                      "0"])
    assert (cfg.max_steps, cfg.one_shot, cfg.method, cfg.entropy_term) == (7, False, "grpo", "eq7")
    assert parse_args(["--no_one_shot", "--max_steps", "7", "--sft-warmup-steps", "0"]).one_shot is False
    args = ev.parse_args(["--n-samples", "3", "--max-completion-length=5", "--no-load-in-4bit"])
    assert (args.n_samples, args.max_completion_length, args.load_in_4bit) == (3, 5, False)


@pytest.mark.parametrize("module, argv, closest", [
    (train, ["--max_step", "1"], "--max_steps"),          # a prefix is no longer taken for the flag
    (train, ["--max-stepz", "1"], "--max_steps"),
    (ev, ["--n_sample", "3"], "--n_samples"),
])
def test_a_misspelt_flag_is_one_line_naming_the_closest(module, argv, closest, capsys):
    parse = parse_args if module is train else ev.parse_args
    with pytest.raises(SystemExit) as e:
        parse(argv)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and "\n" not in err and f"did you mean {closest}?" in err and "usage" not in err


def test_a_run_without_an_rl_step_stops_before_the_model_loads(capsys):
    # the demo profile warms up with 4 SFT steps: --max_steps 2 would train SFT alone
    with pytest.raises(ConfigError, match="no GTPO step.*--sft_warmup_steps"):
        parse_args(["--max_steps", "2"])
    assert train.cli(["--max_steps", "4"]) == 2                         # the command line: one line, exit 2
    assert "--sft_warmup_steps" in capsys.readouterr().err
    assert parse_args(["--max_steps", "5"]).max_steps == 5                # 4 SFT + 1 GTPO step
    assert parse_args(["--max_steps", "2", "--sft_warmup_steps", "0"]).sft_warmup_steps == 0
    assert parse_args(["--max_steps", "2", "--use_sft"]).method == "sft"  # SFT steps are what was asked


def test_data_dir_is_checked_only_for_the_datasets_that_read_it():
    assert parse_args(["--data_dir", "/nonexistent"]).dataset == "arithmetic"        # generated, needs no folder
    with pytest.raises(Exception, match="does not exist") as e:
        parse_args(["--data_dir", "/nonexistent", "--dataset", "gsm8k"])
    assert "shared" not in str(e.value)


def test_no_message_names_the_folder_beside_this_checkout():
    """../shared/data exists only beside this repository's own checkout: no program's text may point there."""
    found = subprocess.run(["grep", "-rln", "shared/data", "--include=*.py", "."], cwd=HERE, capture_output=True,
                           text=True).stdout.split()
    assert [f for f in found if not f.startswith("./tests/") and not f.startswith("./runs/")] == []


def test_records_without_a_solution_are_announced_before_the_model_loads():
    said = []
    cfg = parse_args(["--dataset", "arithmetic"])                      # demo profile: SFT warm-up, one-shot
    bare = [{"question": f"q{i}", "answer": "1", "solution": None} for i in range(3)]
    config.check_solutions(cfg, bare, said.append)
    assert len(said) == 2 and "3 of 3 records" in said[0] and "`solution`" in said[0] and "--sft_warmup_steps 0" in said[0]
    assert "one-shot example" in said[1] and "--no-one_shot" in said[1]
    said.clear()
    config.check_solutions(parse_args(["--sft_warmup_steps", "0", "--no-one_shot"]), bare, said.append)
    assert said == []                                                  # nothing shows a solution: nothing to say
    worked = [dict(r, solution="1 = 1") for r in bare]
    config.check_solutions(cfg, worked, said.append)
    assert said == []


class _OneRank:
    def mean(self, values):
        return values


def test_the_logged_lr_is_the_rate_the_step_used():
    """A linear warm-up starts at 0 (transformers' schedules): the first step's row says 0, the second the
    rate after one warm-up step."""
    from transformers import get_cosine_schedule_with_warmup
    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=1.0)
    sched = get_cosine_schedule_with_warmup(opt, 2, 10)
    cfg = parse_args(["--max_grad_norm", "1.0"])
    rates = []
    for _ in range(3):
        before = w.detach().clone()
        w.grad = torch.ones(2)
        m = {"loss": 0.0}
        train.optimizer_step(cfg, m, [w], opt, sched, _OneRank())
        rates.append(m["lr"])
        moved = before - w.detach()                                    # SGD: lr x the clipped gradient (1 / sqrt 2 each)
        assert torch.allclose(moved, torch.full((2,), m["lr"] / 2 ** 0.5))
    assert rates[:2] == [0.0, 0.5]


@pytest.mark.slow
def test_the_command_line_refuses_an_abbreviation_and_takes_hyphens(tmp_path, tiny_args, train_here):
    """`python train.py --max_step 1` fails in one line (the whole process's stderr); `--max-steps 1`
    trains one step."""
    r = subprocess.run([sys.executable, "train.py", "--max_step", "1"], cwd=HERE, capture_output=True, text=True,
                       env=ENV, timeout=300)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "--max_steps" in r.stderr
    out = tmp_path / "run"
    r = train_here(*tiny_args(out), "--max-steps", "1")
    assert r.returncode == 0, r.stderr[-2000:]
    assert os.path.isdir(out / "final")
