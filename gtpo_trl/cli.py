"""GTPO from TRL's command line: `python -m gtpo_trl` (after `pip install ".[trl]"`, also `gtpo-trl`) takes what
`trl grpo` takes -- TRL's parser (TrlParser) over the script's dataset and reward arguments, GTPOConfig (every
GRPOConfig field, and GTPO's settings under train.py's names), ModelConfig (the model, its dtype, PEFT) and
DatasetMixtureConfig, a `--config recipe.yaml`, accelerate's launch flags -- and, as `trl grpo` does, launches the
run through `accelerate launch`, which runs GTPOTrainer where TRL's script runs GRPOTrainer (gtpo_trl.cli.main gives
the config and trainer classes). A refused option fails as GTPOConfig is made, before any model loads.

    python -m gtpo_trl --config recipe.yaml                     # docs/trl.md, "From the command line"
    python -m gtpo_trl --config recipe.yaml --num_processes 2   # accelerate's flags, as trl grpo takes them
    accelerate launch --num_processes 2 -m gtpo_trl --config recipe.yaml
    python -m gtpo_trl --example [--max_steps N]                # the embedded example (gtpo_trl.example_trainer)

The dataset: --dataset_name or the recipe's `datasets:` as in TRL, or --task, a built-in task in the paper's
prompt (`--task gsm8k`: GSM8K as train.py trains on it). Reward functions by name: TRL's (accuracy_reward,
reasoning_accuracy_reward, think_format_reward, get_soft_overlong_punishment), the paper's (paper_reward;
format_reward and gtpo_accuracy_reward, its two parts, whose sum it is; they compare answers as --task's), or a
dotted import path.
"""
import importlib
import os
import subprocess
import sys
from dataclasses import dataclass, field

from trl import ScriptArguments


@dataclass
class GTPOScriptArguments(ScriptArguments):
    """TRL's GRPO script arguments (the dataset's name, config and splits, a reward model, reward functions), and
    the task: a built-in dataset in the paper's prompt, and how the paper's reward compares answers."""
    reward_model_name_or_path: str = field(default=None, metadata={"help": "a reward model's Hub id or folder"})
    reward_funcs: list[str] = field(default=None, metadata={
        "help": "reward functions: TRL's (accuracy_reward, reasoning_accuracy_reward, think_format_reward, "
                "get_soft_overlong_punishment), the paper's (paper_reward; format_reward and gtpo_accuracy_reward, "
                "its two parts) or a dotted import path"})
    task: str = field(default=None, metadata={
        "help": "a built-in task (gsm8k, math, arithmetic, ...; data.TASKS): without --dataset_name or "
                "`datasets:`, the dataset is its train and test splits in the paper's prompt "
                "(App. 16.1) with an `answer` column; the paper's reward compares answers as the task does "
                "(default: numbers as numbers, other answers as LaTeX)"})
    one_shot: bool = field(default=False, metadata={
        "help": "with --task: show the task's first training record as a worked example before each question "
                "(then not trained on), as train.py --one_shot"})


def paper_rewards(task):
    """The paper's reward (rewards.trl_reward) and its two parts (rewards.trl_rewards), by their names here."""
    from machinery.data import task_name
    from rewards import trl_reward, trl_rewards
    task = task_name(task) if task else "local"                  # "local": each answer by its reference
    fmt, accuracy = trl_rewards(task)
    return {"paper_reward": trl_reward(task), "format_reward": fmt, "gtpo_accuracy_reward": accuracy}


def reward_functions(args):
    """The reward model and functions the script's arguments name, in order (TRL's script's rule, with ours)."""
    from trl.rewards import accuracy_reward, get_soft_overlong_punishment, reasoning_accuracy_reward, think_format_reward
    named = {"accuracy_reward": accuracy_reward, "reasoning_accuracy_reward": reasoning_accuracy_reward,
             "think_format_reward": think_format_reward,
             "get_soft_overlong_punishment": get_soft_overlong_punishment(max_completion_len=1280,
                                                                          soft_punish_cache=256),
             **paper_rewards(args.task)}
    funcs = [args.reward_model_name_or_path] if args.reward_model_name_or_path else []
    for name in args.reward_funcs or []:
        if name in named:
            funcs.append(named[name])
        elif "." in name:
            module, attr = name.rsplit(".", 1)
            sys.path.insert(0, os.getcwd())
            funcs.append(getattr(importlib.import_module(module), attr))
        else:
            raise ValueError(f"reward function {name!r}: none of {', '.join(named)}, and not a dotted import path")
    return funcs


def task_dataset(task, splits, one_shot=False):
    """A built-in task's splits as TRL conversational rows, as train.py prompts them: `prompt` the paper's messages
    (App. 16.1's system prompt; with one_shot the first training record as a worked example, then not trained on)
    and `answer`."""
    from datasets import Dataset, DatasetDict

    from machinery.data import TASKS, build_messages, task_split
    if task not in TASKS:
        raise ValueError(f"--task {task!r}: the dataset of a task is one of {', '.join(TASKS)}; give a file of "
                         f"your own as TRL does (`datasets:` in the recipe, or --dataset_name)")
    parts = {split: task_split(task, split, one_shot) for split in splits}
    return DatasetDict({split: Dataset.from_list([{"prompt": build_messages(r["question"], example),
                                                   "answer": r["answer"]} for r in records])
                        for split, (records, example) in parts.items()})


def check(script_args, model_args, dataset_args):
    """A model that resolves and a dataset are named, or a ValueError (machinery.models.ModelError) says how to name
    them. The model: an alias of train.py's (smollm2-135m, the embedded model, offline; llama-8b, ...), a folder, or a
    Hub id, found in the local cache when the Hub cannot be reached; model_args then names what was found."""
    from machinery.models import resolve
    if not model_args.model_name_or_path:
        raise ValueError("no model: give --model_name_or_path (an alias such as smollm2-135m, a Hub id or a folder), "
                         "or `model_name_or_path:` in the --config recipe")
    if not (dataset_args.datasets or script_args.dataset_name or script_args.task):
        raise ValueError("no dataset: give --dataset_name, `datasets:` in the --config recipe, or --task (a built-in "
                         "task in the paper's prompt, e.g. --task gsm8k)")
    model_args.model_name_or_path = resolve(model_args.model_name_or_path, flag="--model_name_or_path")[0]
    if script_args.task and not (dataset_args.datasets or script_args.dataset_name):
        task_dataset(script_args.task, [script_args.dataset_train_split])        # its file, read now (a DataError)


def run(script_args, training_args, model_args, dataset_args, trainer_cls):
    """TRL's GRPO script with trainer_cls (gtpo_trl.GTPOTrainer) where it has GRPOTrainer: the dataset (a mixture,
    --dataset_name, or --task's), the model by name with ModelConfig's settings, its quantization and PEFT, then
    train and save."""
    from datasets import load_dataset
    from trl import get_dataset, get_peft_config, get_quantization_config

    check(script_args, model_args, dataset_args)
    evaluate = training_args.eval_strategy != "no"
    training_args.model_init_kwargs = {"revision": model_args.model_revision, "dtype": model_args.dtype,
                                       "trust_remote_code": training_args.trust_remote_code,
                                       "attn_implementation": model_args.attn_implementation,
                                       **(training_args.model_init_kwargs or {})}
    if dataset_args.datasets:
        dataset = get_dataset(dataset_args)
    elif script_args.dataset_name:
        dataset = load_dataset(script_args.dataset_name, name=script_args.dataset_config,
                               streaming=script_args.dataset_streaming)
    else:
        splits = [script_args.dataset_train_split] + ([script_args.dataset_test_split] if evaluate else [])
        dataset = task_dataset(script_args.task, splits, script_args.one_shot)
    trainer = trainer_cls(model=model_args.model_name_or_path, reward_funcs=reward_functions(script_args),
                          args=training_args, train_dataset=dataset[script_args.dataset_train_split],
                          eval_dataset=dataset[script_args.dataset_test_split] if evaluate else None,
                          quantization_config=get_quantization_config(model_args),
                          peft_config=get_peft_config(model_args))
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model(training_args.output_dir)
    trainer.accelerator.print(f"done: model saved to {training_args.output_dir}")
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)
    trainer.end()


def launched():
    """Whether a launcher started this process: accelerate launch sets ACCELERATE_MIXED_PRECISION in each process it
    starts, torchrun RANK."""
    return "ACCELERATE_MIXED_PRECISION" in os.environ or "RANK" in os.environ


def command(argv, config_cls, trainer_cls):
    """`trl grpo`'s two halves. Here: the arguments read (--help, or a refused option, ends it before anything
    loads), then `accelerate launch -m gtpo_trl` with accelerate's flags (--num_processes, --multi_gpu,
    --config_file, TRL's --accelerate_config, or a recipe's key that only accelerate knows) and the script's own.
    In a launched process: the run (a recipe's keys for accelerate left aside, as TRL's script does).
    Returns the exit code."""
    args = parser(config_cls)
    if launched():
        run(*args.parse_args_and_config(argv, fail_with_unknown_args=False), trainer_cls=trainer_cls)
        return 0
    argv, note = float32_without_bf16(argv)
    from accelerate.commands.launch import launch_command, launch_command_parser
    from trl.cli.accelerate_config import resolve_accelerate_config_argument
    script_args, _, model_args, dataset_args, from_recipe, from_argv = args.parse_args_and_config(
        argv, return_remaining_strings=True, separate_remaining_strings=True)
    check(script_args, model_args, dataset_args)
    if note:
        print(note, file=sys.stderr)
    rest = iter(from_argv)
    wanted = next(rest, None)
    own = []                                            # argv less accelerate's flags, each in its place
    for a in argv:
        if a == wanted:
            wanted = next(rest, None)
        else:
            own.append(a)
    launch = resolve_accelerate_config_argument(from_recipe + from_argv)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))     # where `import gtpo_trl` finds this one
    os.environ["PYTHONPATH"] = os.pathsep.join([here] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                                         if p])              # for the launched processes
    try:
        launch_command(launch_command_parser().parse_args(launch + ["-m", "gtpo_trl"] + own))
    except subprocess.CalledProcessError as e:        # the run's own error is printed above: its code, no 2nd trace
        return e.returncode
    return 0


def float32_without_bf16(argv):
    """(argv, a line to say or None): `--bf16 false` added where neither argv nor its recipe sets bf16 and the machine
    has no bf16 GPU: GRPOConfig defaults bf16 on, which transformers refuses there; float32 is what train.py runs on a
    CPU."""
    from transformers.utils import is_torch_bf16_gpu_available
    recipe = {}
    if "--config" in argv and argv.index("--config") + 1 < len(argv):
        import yaml
        with open(argv[argv.index("--config") + 1]) as f:
            recipe = yaml.safe_load(f) or {}
    given = any(a == "--bf16" or a.startswith("--bf16=") for a in argv) or "bf16" in recipe
    if given or is_torch_bf16_gpu_available():
        return argv, None
    return argv + ["--bf16", "false"], "note: no bf16 GPU here: --bf16 false (float32, as train.py on a CPU)"


def parser(config_cls):
    """TRL's GRPO script's parser with config_cls (gtpo_trl.GTPOConfig) where it has GRPOConfig."""
    from trl import DatasetMixtureConfig, ModelConfig, TrlParser
    return TrlParser((GTPOScriptArguments, config_cls, ModelConfig, DatasetMixtureConfig), prog="python -m gtpo_trl",
                     description=__doc__.split("\n\n")[0], epilog=EXAMPLE)


EXAMPLE = ("python -m gtpo_trl --example [--max_steps N] [--method grpo] [--output_dir DIR]: the embedded SmolLM2-135M "
           "through GTPOTrainer (or TRL's GRPOTrainer) on the arithmetic task, offline on a CPU, 20 steps; its adapter "
           "is what eval.py --adapter reads (docs/trl.md)")


def main(argv=None):
    """`python -m gtpo_trl` (and `gtpo-trl`): TRL's `trl grpo` command line with GTPOConfig and GTPOTrainer, launched
    through accelerate as TRL's is; a refused option fails as the arguments are read. --example: the embedded
    example (gtpo_trl.example.example_main)."""
    from gtpo_trl.config import GTPOConfig
    from gtpo_trl.trainer import GTPOTrainer
    from machinery.data import DataError
    from machinery.models import ModelError
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--example" in argv:
        from gtpo_trl.example import example_main
        return example_main([a for a in argv if a != "--example"])
    if launched():                                      # the run's own errors: its traceback, its exit code
        return command(argv, GTPOConfig, GTPOTrainer)
    try:
        return command(argv, GTPOConfig, GTPOTrainer)
    except (ValueError, ModelError, DataError, OSError) as e:   # refused before anything launched: one line, exit 2
        print(f"error: {e}", file=sys.stderr)
        return 2
