"""What a newcomer types and reads first: flags spelt either way and no abbreviations, a run that would take
no RL step refused before the model loads, records without a worked solution announced, --data_dir read
only where a dataset needs it, the logged learning rate being the one the step used, and an SFT warm-up run as an
SFT run followed by an RL run from its weights (its own rate and betas, then a fresh optimizer and schedule)."""
import os
import subprocess
import sys

import pytest
import torch

import eval as ev
import train
from conftest import ENV, HERE
from machinery import config
from machinery.config import parse_args
from machinery.runs import ConfigError


def test_flags_take_hyphens_or_underscores_in_train_and_eval():
    cfg = parse_args(["--max-steps", "7", "--no-one-shot", "--use-grpo", "--entropy-term=eq7", "--sft_warmup_steps",
                      "0"])
    assert (cfg.max_steps, cfg.one_shot, cfg.method, cfg.objective.entropy_term) == (7, False, "grpo", "eq7")
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
    # the demo profile warms up with 8 SFT steps: --max_steps 2 would train SFT alone
    with pytest.raises(ConfigError, match="no GTPO step.*--sft_warmup_steps"):
        parse_args(["--max_steps", "2"])
    assert train.cli(["--max_steps", "8"]) == 2                         # the command line: one line, exit 2
    assert "--sft_warmup_steps" in capsys.readouterr().err
    assert parse_args(["--max_steps", "9"]).max_steps == 9                # 8 SFT + 1 GTPO step
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


@pytest.mark.parametrize("scheduler", ["cosine", "constant"])
def test_lr_schedule_is_transformers_without_a_warm_up_and_starts_afresh_after_one(scheduler):
    """No SFT warm-up: the rates of transformers' schedules (Listing 1's). With W warm-up steps: W steps at
    --sft_warmup_lr, then the same schedule as a run of the remaining steps alone."""
    from transformers import get_constant_schedule_with_warmup, get_cosine_schedule_with_warmup
    make = get_cosine_schedule_with_warmup if scheduler == "cosine" else get_constant_schedule_with_warmup
    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1.0)
    kw = {"num_training_steps": 17} if scheduler == "cosine" else {}
    reference = make(opt, 1, **kw).lr_lambdas[0]                        # 17 steps, ceil(0.05 x 17) = 1 ramp step
    plain = train.lr_schedule(parse_args(["--lr_scheduler", scheduler, "--sft_warmup_steps", "0", "--warmup_ratio", "0.05"]),
                              17)
    assert [plain(k) for k in range(17)] == pytest.approx([reference(k) for k in range(17)], abs=1e-12)
    cfg = parse_args(["--lr_scheduler", scheduler, "--sft_warmup_steps", "3", "--lr", "2e-4", "--sft_warmup_lr", "1e-3",
                      "--warmup_ratio", "0.05"])
    warm = train.lr_schedule(cfg, 20)
    assert [warm(k) for k in range(3)] == pytest.approx([5.0] * 3)      # 1e-3 / 2e-4, constant
    assert [warm(k) for k in range(3, 20)] == pytest.approx([reference(k) for k in range(17)], abs=1e-12)
    same = train.lr_schedule(parse_args(["--model", "llama-8b", "--sft_warmup_steps", "3"]), 20)
    assert [same(k) for k in range(3)] == [1.0] * 3                     # default: the warm-up at --lr


def test_rl_phase_starts_a_fresh_optimizer_with_the_methods_betas():
    """After an SFT warm-up (SFT's betas), the first RL step moves the weights exactly as a new optimizer with the
    method's betas would from the same weights: nothing of the warm-up's moments carries over."""
    cfg = parse_args(["--sft_warmup_steps", "2", "--optimizer", "adamw_torch", "--adam_beta1", "0.999999",
                      "--adam_beta2", "0.999999"])                       # GTPO's (Listing 1)
    w = torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0]))
    opt, _ = train.make_optimizer(cfg, [w], 10, log=lambda *a: None)
    assert opt.param_groups[0]["betas"] == config.BETAS["sft"]
    for g in ([1.0, 2.0, 3.0], [0.5, -1.0, 2.0]):                       # two warm-up steps
        w.grad = torch.tensor(g)
        opt.step()
    train.start_rl_phase(cfg, opt)
    fresh_w = torch.nn.Parameter(w.detach().clone())
    fresh = torch.optim.AdamW([fresh_w], lr=opt.param_groups[0]["lr"], betas=(cfg.adam_beta1, cfg.adam_beta2),
                              weight_decay=cfg.weight_decay)
    for p in (w, fresh_w):
        p.grad = torch.tensor([-0.3, 0.2, 0.1])
    opt.step()
    fresh.step()
    assert opt.param_groups[0]["betas"] == (0.999999, 0.999999)
    assert torch.equal(w, fresh_w)
