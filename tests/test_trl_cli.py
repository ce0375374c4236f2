"""`python -m gtpo_trl` as TRL's `trl grpo` (gtpo_trl/cli.py; skipped without TRL): the same flags and YAML recipe,
GTPO's own fields read from the recipe, a refused option failing before any model loads, and -- with GTPO's parts
off -- the losses TRL's command logs for the same recipe (slow: both commands train a tiny model offline)."""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("trl", reason="needs TRL, an optional extra: pip install -r requirements-trl.txt")

import gtpo_trl                                                         # noqa: E402
from conftest import ENV, HERE, free_port                               # noqa: E402
from gtpo_trl import cli as trl_cli                                                          # noqa: E402
from gtpo_trl import GTPOConfig                                         # noqa: E402

RECIPE = "configs/gtpo-llama8b-gsm8k.yaml"
REWARD = '''import os


def length_reward(completions, **_):
    """A reward that differs within a group: the completion's length in characters; each process that scores
    leaves a file named by its rank and process id."""
    open(f"scored-by-{os.environ.get('RANK')}-{os.getpid()}", "a").close()
    return [float(len(c)) for c in completions]
'''


def _recipe(tmp_path, model_dir, **extra):
    """A TRL YAML recipe: the tiny model, a local JSON dataset (train and test splits), a dotted-path reward, 2 steps
    of 2 prompts x 4 completions on CPU in fp32 with a KL term (beta: the second step's loss is not zero), each
    step's log kept in checkpoint-2's trainer_state.json."""
    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    for split, n in (("train", 8), ("test", 2)):
        rows = [{"prompt": f"Add {i} and {i + 3}.", "answer": str(2 * i + 3)} for i in range(n)]
        (data / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "cli_rewards.py").write_text(REWARD)
    recipe = {"model_name_or_path": model_dir, "dataset_name": str(data), "reward_funcs": ["cli_rewards.length_reward"],
              "num_generations": 4, "per_device_train_batch_size": 8, "max_completion_length": 8, "max_steps": 2,
              "learning_rate": 0.05, "loss_type": "grpo", "logging_steps": 1, "save_strategy": "steps",
              "save_steps": 2, "bf16": False, "use_cpu": True, "report_to": "none", "disable_tqdm": True,
              "temperature": 1.5, "beta": 0.04, "seed": 0, **extra}
    path = tmp_path / "recipe.yaml"
    path.write_text("".join(f"{k}: {json.dumps(v)}\n" for k, v in recipe.items()))    # JSON values are YAML
    return path


def test_recipe_reads_trls_fields_and_gtpos_own(tmp_path):
    """A YAML recipe fills TRL's dataclasses and GTPOConfig's own fields (conflict_weight); the command line
    overrides the recipe, as TRL's parser does."""
    recipe = _recipe(tmp_path, "some/model", conflict_weight=1.5, entropy_term="eq7")
    script, training, model, _ = trl_cli.parser(GTPOConfig).parse_args_and_config(
        ["--config", str(recipe), "--output_dir", str(tmp_path / "out"), "--ent_gamma", "0.01"])
    assert model.model_name_or_path == "some/model" and script.reward_funcs == ["cli_rewards.length_reward"]
    assert (training.num_generations, training.max_completion_length, training.loss_type) == (4, 8, "grpo")
    assert (training.conflict_weight, training.entropy_term, training.ent_gamma) == (1.5, "eq7", 0.01)
    objective = training.objective()
    assert (objective.conflict_weight, objective.entropy_term, objective.ent_gamma) == (1.5, "eq7", 0.01)


def test_the_papers_recipe_is_train_pys_paper_run(tmp_path):
    """configs/gtpo-llama8b-gsm8k.yaml holds what `python train.py --model llama-8b --dataset gsm8k --use_gtpo`
    runs on a GPU: the model, 4-bit, LoRA, the task and reward, G and one prompt a step, the optimizer's settings
    and the objective (gtpo.Objective, field by field)."""
    from machinery import config
    cfg = config.parse_args(["--model", "llama-8b", "--dataset", "gsm8k", "--use_gtpo", "--device", "cuda"])
    script, t, m, _ = trl_cli.parser(GTPOConfig).parse_args_and_config(    # use_cpu: bf16 is refused on a CPU otherwise
        ["--config", os.path.join(HERE, RECIPE), "--use_cpu", "true"])
    assert m.model_name_or_path == config.ALIASES[cfg.model][0] and m.load_in_4bit == cfg.load_in_4bit
    assert m.use_peft and m.lora_r == m.lora_alpha == cfg.lora_rank and m.lora_dropout == 0
    assert (script.task, script.one_shot, script.reward_funcs) == (cfg.dataset, cfg.one_shot, ["paper_reward"])
    assert t.per_device_train_batch_size * t.gradient_accumulation_steps == cfg.batch_size * cfg.generation_size
    ours = {"num_generations": cfg.generation_size, "max_completion_length": cfg.max_completion_length,
            "temperature": cfg.temperature, "num_train_epochs": cfg.epochs, "learning_rate": cfg.lr,
            "lr_scheduler_type": cfg.lr_scheduler, "warmup_steps": cfg.warmup_ratio, "adam_beta1": cfg.adam_beta1,
            "adam_beta2": cfg.adam_beta2, "weight_decay": cfg.weight_decay, "max_grad_norm": cfg.max_grad_norm,
            "optim": "paged_adamw_8bit", "seed": cfg.seed, "bf16": True}
    given = {k: getattr(getattr(t, k), "value", getattr(t, k)) for k in ours}     # TRL's enums as their values
    assert given == ours
    assert t.objective() == cfg.objective


def test_refused_option_fails_before_any_model_loads(tmp_path, capsys):
    """TRL's entropy bonus in the recipe is refused with GTPOConfig's text while the arguments are parsed, in one
    line and exit code 2: the model named does not exist, so any attempt to load it would fail otherwise."""
    recipe = _recipe(tmp_path, str(tmp_path / "no-such-model"), entropy_coef=0.01)
    assert gtpo_trl.main(["--config", str(recipe), "--output_dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: GTPOConfig: entropy_coef=0.01 replaces ")
    assert not (tmp_path / "out").exists()


def test_accelerates_flags_go_to_its_launcher_and_the_rest_to_the_script(tmp_path, tiny_model_dir, monkeypatch,
                                                                       capsys):
    """As `trl grpo`: accelerate's flags from the command line and a recipe key only accelerate knows go to
    `accelerate launch -m gtpo_trl` (this package, found through PYTHONPATH from any folder) with the other arguments
    in their order; a flag neither knows, a missing dataset or model, is refused before anything launches, in one
    line and exit code 2."""
    for name in ("RANK", "ACCELERATE_MIXED_PRECISION"):
        monkeypatch.delenv(name, raising=False)
    launched = []
    monkeypatch.setattr("accelerate.commands.launch.launch_command", launched.append)
    recipe = _recipe(tmp_path, tiny_model_dir, num_processes=2)
    gtpo_trl.main(["--config", str(recipe), "--multi_gpu", "--max_steps", "3", "--main_process_port", "29555",
                   "--ent_gamma", "0"])
    (args,) = launched
    assert args.num_processes == 2 and args.multi_gpu and args.main_process_port == 29555
    assert args.module and args.training_script == "gtpo_trl"
    here = os.path.dirname(os.path.dirname(os.path.abspath(gtpo_trl.__file__)))
    assert os.environ["PYTHONPATH"].split(os.pathsep)[0] == here
    assert args.training_script_args == ["--config", str(recipe), "--max_steps", "3", "--ent_gamma", "0"]
    with pytest.raises(SystemExit):
        gtpo_trl.main(["--config", str(recipe), "--no_such_flag", "1"])
    capsys.readouterr()
    for argv, said in ((["--model_name_or_path", tiny_model_dir, "--use_cpu"], "error: no dataset: give --dataset_name"),
                       (["--task", "gsm8k", "--use_cpu"], "error: no model: give --model_name_or_path")):
        assert gtpo_trl.main(argv + ["--output_dir", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(said), err
    assert len(launched) == 1


def test_a_cpus_first_tries_run_or_are_refused_in_one_line(tmp_path, monkeypatch, capsys):
    """What a new user types first on a CPU: no model at all, a model the machine cannot reach offline, a task whose
    file is missing -- each refused before anything launches, in one line naming what was looked for, exit code 2;
    the project's alias smollm2-135m resolves to the embedded model; GRPOConfig's bf16 default becomes float32 on a
    machine without a bf16 GPU, said in one line, unless bf16 is given; --help names --example."""
    for name in ("RANK", "ACCELERATE_MIXED_PRECISION"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("GTPO_DATA_DIR", str(tmp_path))                 # an empty data folder: gsm8k is not there
    launched = []
    monkeypatch.setattr("accelerate.commands.launch.launch_command", launched.append)
    out = ["--output_dir", str(tmp_path / "out")]
    for argv, said in ((["--max_steps", "1"], "error: no model: give --model_name_or_path"),
                       (["--model_name_or_path", "meta-llama/Llama-3.1-8B-Instruct", "--task", "arithmetic"],
                        "error: model 'meta-llama/Llama-3.1-8B-Instruct' is not in the local Hugging Face cache"),
                       (["--model_name_or_path", "smollm2-135m", "--task", "gsm8k"],
                        "error: dataset 'gsm8k' split 'train' is not available")):
        assert gtpo_trl.main(argv + out) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(said), err
    assert not launched
    assert gtpo_trl.main(["--model_name_or_path", "smollm2-135m", "--task", "arithmetic"] + out) == 0
    (args,) = launched
    from transformers.utils import is_torch_bf16_gpu_available
    if not is_torch_bf16_gpu_available():
        assert args.training_script_args[-2:] == ["--bf16", "false"]
        assert capsys.readouterr().err.strip().splitlines()[-1].startswith("note: no bf16 GPU here: --bf16 false")
        gtpo_trl.main(["--model_name_or_path", "smollm2-135m", "--task", "arithmetic", "--bf16", "false"] + out)
        assert launched[-1].training_script_args.count("--bf16") == 1                 # given: kept, none added
    with pytest.raises(SystemExit):
        gtpo_trl.main(["--help"])
    assert "python -m gtpo_trl --example" in " ".join(capsys.readouterr().out.split())


@pytest.mark.slow
def test_the_cpu_one_liner_of_docs_trl_md_runs_as_written(tmp_path):
    """docs/trl.md "From the command line": the CPU one-liner, run as written from a folder of its own (the clone on
    PYTHONPATH, as `pip install .[trl]` would put it): it launches, trains its steps and saves the adapter."""
    pytest.importorskip("peft")
    text = open(os.path.join(HERE, "docs", "trl.md")).read()
    block = text[text.index("On a CPU, offline"):].split("```bash\n", 1)[1].split("```", 1)[0]
    command = " ".join(block.replace("\\\n", " ").split("#")[0].split())
    assert command.startswith("python -m gtpo_trl --model_name_or_path smollm2-135m")
    r = subprocess.run(["bash", "-c", command.replace("python ", f"{sys.executable} ", 1)], cwd=tmp_path,
                       capture_output=True, text=True, timeout=1500,
                       env={**ENV, "PYTHONPATH": HERE, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    out = tmp_path / command.split("--output_dir ")[1].split()[0]
    assert (out / "adapter_config.json").is_file() and "done: model saved to" in r.stdout


def test_a_failed_run_gives_its_exit_code_without_a_second_traceback(tmp_path, tiny_model_dir, monkeypatch):
    for name in ("RANK", "ACCELERATE_MIXED_PRECISION"):
        monkeypatch.delenv(name, raising=False)

    def fails(args):
        raise subprocess.CalledProcessError(3, ["python", args.training_script])
    monkeypatch.setattr("accelerate.commands.launch.launch_command", fails)
    assert gtpo_trl.main(["--config", str(_recipe(tmp_path, tiny_model_dir))]) == 3


def test_task_is_train_pys_prompts_as_conversational_rows():
    """--task: each split's rows in the paper's messages, which TRL's chat template renders to train.py's prompt text
    (data.format_prompt); with --one_shot the first training record is the worked example and not a training row."""
    from machinery.data import format_prompt, load_task, one_shot_example
    from machinery.models import embedded_model_dir, load_tokenizer
    tok = load_tokenizer(embedded_model_dir())
    train, test = load_task("arithmetic", "train"), load_task("arithmetic", "test")
    for one_shot in (False, True):
        d = trl_cli.task_dataset("arithmetic", ["train", "test"], one_shot)
        example = one_shot_example(train[0]) if one_shot else None
        assert [r["answer"] for r in d["train"]] == [r["answer"] for r in train[1 if one_shot else 0:]]
        assert [r["answer"] for r in d["test"]] == [r["answer"] for r in test]
        for split, records in (("train", train[1 if one_shot else 0:]), ("test", test)):
            row, record = d[split][0], records[0]
            assert len(row["prompt"]) == (4 if one_shot else 2) and row["prompt"][-1]["content"] == record["question"]
            assert tok.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True) == \
                format_prompt(tok, record["question"], example)
    with pytest.raises(ValueError, match="--task 'nope': the dataset of a task is one of"):
        trl_cli.task_dataset("nope", ["train"])


def test_reward_functions_by_name_and_path(tmp_path, monkeypatch):
    """TRL's names, the paper's reward and its parts (which sum to it), a dotted path; an unknown name is named."""
    monkeypatch.chdir(tmp_path)
    _recipe(tmp_path, "m")
    args = trl_cli.GTPOScriptArguments(reward_funcs=["accuracy_reward", "paper_reward", "format_reward",
                                                     "gtpo_accuracy_reward", "cli_rewards.length_reward"])
    acc, paper, fmt, right, length = trl_cli.reward_functions(args)
    assert acc.__name__ == "accuracy_reward" and length.__name__ == "length_reward"
    completions = ["<reasoning>\n3 + 4\n</reasoning>\n<answer>\n7\n</answer>", "no answer",
                   "<reasoning>\n3 + 5\n</reasoning>\n<answer>\n8\n</answer>"]
    answers = ["7", "7", "7"]
    assert [p for p in paper(completions, answer=answers)] == [
        f + r for f, r in zip(fmt(completions, answer=answers), right(completions, answer=answers))]
    assert right(completions, answer=answers) == [10.0, 0.0, 0.0] and fmt(completions, answer=answers)[1] == 0
    with pytest.raises(ValueError, match="reward function 'nope': none of accuracy_reward"):
        trl_cli.reward_functions(trl_cli.GTPOScriptArguments(reward_funcs=["nope"]))


def test_help_shows_trls_arguments_and_gtpos():
    r = subprocess.run([sys.executable, "-m", "gtpo_trl", "--help"], cwd=HERE, env=ENV, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    for flag in ("--model_name_or_path", "--dataset_name", "--reward_funcs", "--use_peft",
                 "--num_generations", "--conflict_weight", "--entropy_term", "--task"):
        assert flag in r.stdout, flag


def _losses(out):
    """Each step's logged row, its timings left out."""
    with open(out / "checkpoint-2" / "trainer_state.json") as f:
        rows = [r for r in json.load(f)["log_history"] if "loss" in r]
    return [{k: v for k, v in r.items() if "time" not in k} for r in rows]


@pytest.mark.slow
def test_same_recipe_gives_trls_losses_with_gtpos_parts_off(tmp_path, tiny_model_dir):
    """One YAML recipe through `trl grpo`, `python -m gtpo_trl` (both launch through accelerate) and `accelerate
    launch -m gtpo_trl` with lambda = 1 (conflict_weight 1, and no conflicts sampled), delta_i off and gamma 0: the
    same logged losses, rewards, gradient norms, KL and entropies over 2 steps, bit for bit (the first step's loss
    is zero by Eq. 8's centring, the second's is the KL term after the first update)."""
    recipe = _recipe(tmp_path, tiny_model_dir)
    env = {**ENV, "HF_HUB_OFFLINE": "1", "PYTHONPATH": HERE}
    trl = [os.path.join(os.path.dirname(sys.executable), "trl"), "grpo"]
    off = ["--conflict_weight", "1", "--entropy_filter", "off", "--ent_gamma", "0"]
    runs = {"trl": trl + ["--output_dir", str(tmp_path / "trl")],
            "gtpo": [sys.executable, "-m", "gtpo_trl", "--output_dir", str(tmp_path / "gtpo"), *off],
            "accelerate": [os.path.join(os.path.dirname(sys.executable), "accelerate"), "launch", "--num_processes",
                           "1", "-m", "gtpo_trl", "--output_dir", str(tmp_path / "accelerate"), *off]}
    for name, command in runs.items():
        r = subprocess.run(command + ["--config", str(recipe)], cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=900)
        assert r.returncode == 0, f"{name}: {r.stderr[-3000:]}"
    trl_rows, gtpo_rows, launched = (_losses(tmp_path / name) for name in runs)
    assert len(trl_rows) == len(gtpo_rows) == len(launched) == 2
    assert all(r["gtpo/conflict_frac"] == 0 for r in gtpo_rows + launched)    # lambda = 1 on every token sampled
    assert all(r["reward_std"] > 0 for r in trl_rows)                   # a loss that is not zero by a flat group
    assert trl_rows[1]["loss"] > 1e-6 and all(r["grad_norm"] > 0 for r in trl_rows)
    for key in ("loss", "grad_norm", "kl", "entropy", "reward_std"):
        assert [r[key] for r in gtpo_rows] == [r[key] for r in trl_rows], key
        assert [r[key] for r in launched] == [r[key] for r in trl_rows], key


@pytest.mark.slow
def test_two_processes_give_trls_losses_with_gtpos_parts_off(tmp_path, tiny_model_dir):
    """`trl grpo` and `python -m gtpo_trl`, each with accelerate's `--multi_gpu --num_processes 2` (its launcher of
    one process per rank, gloo on CPU, one thread each; without --multi_gpu a CPU gets one process) over one recipe of 4 completions a process, GTPO's parts off: each process scores its own completions, and
    the two commands log the same losses, gradient norms, KL and entropies, bit for bit."""
    recipe = _recipe(tmp_path, tiny_model_dir, per_device_train_batch_size=4)
    env = {**ENV, "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join([HERE, str(tmp_path)]), "OMP_NUM_THREADS": "1"}
    off = ["--conflict_weight", "1", "--entropy_filter", "off", "--ent_gamma", "0"]
    runs = {"trl": [os.path.join(os.path.dirname(sys.executable), "trl"), "grpo"],
            "gtpo": [sys.executable, "-m", "gtpo_trl", *off]}
    for name, command in runs.items():
        (tmp_path / name).mkdir()
        r = subprocess.run(command + ["--multi_gpu", "--num_processes", "2", "--main_process_port", str(free_port()), "--config",
                                      str(recipe), "--output_dir", str(tmp_path / name)],
                           cwd=tmp_path / name, env=env, capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, f"{name}: {r.stderr[-3000:]}"
        assert len(list((tmp_path / name).glob("scored-by-*"))) == 2, (name, sorted((tmp_path / name).iterdir()))
    trl_rows, gtpo_rows = _losses(tmp_path / "trl"), _losses(tmp_path / "gtpo")
    assert len(trl_rows) == len(gtpo_rows) == 2 and all(r["gtpo/conflict_frac"] == 0 for r in gtpo_rows)
    assert all(r["reward_std"] > 0 for r in trl_rows) and trl_rows[1]["loss"] > 1e-6
    for key in ("loss", "grad_norm", "kl", "entropy", "reward_std"):
        assert [r[key] for r in gtpo_rows] == [r[key] for r in trl_rows], key
