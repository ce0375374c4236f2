"""The embedded example of GTPO through TRL: `python -m gtpo_trl --example` trains the offline SmolLM2-135M on the
arithmetic task with GTPOTrainer (or, --method grpo, TRL's GRPOTrainer with the same settings) and saves the adapter
that eval.py reads. example_dataset gives any built-in task as a TRL dataset in the paper's prompt."""
import json
import os

import torch
from trl import GRPOConfig, GRPOTrainer

from gtpo_trl.config import GTPOConfig
from gtpo_trl.trainer import GTPOTrainer
from machinery.data import format_prompt, task_split


def example_dataset(tok, task="arithmetic", split="train"):
    """A task's records of a split as a TRL dataset in the project's prompt format: `prompt` (App. 16.1's system
    prompt, the task's first training record as the worked one-shot example, then not trained on) and `answer`."""
    from datasets import Dataset
    records, example = task_split(task, split, one_shot=True)
    return Dataset.from_list([{"prompt": format_prompt(tok, r["question"], example), "answer": r["answer"]}
                              for r in records])


def example_trainer(method="gtpo", max_steps=20, output_dir="runs/gtpo-trl-smollm2-135m-arithmetic", **kw):
    """GTPOTrainer (or, with method="grpo", TRL's GRPOTrainer with the same settings) on the embedded
    model and the arithmetic task, offline on CPU, with the demo's recipe; kw overrides GRPOConfig fields."""
    from machinery.models import load_model
    from rewards import trl_reward
    torch.manual_seed(3407)
    model, tok, _ = load_model("smollm2-135m", lora_rank=32, device="cpu")
    settings = dict(output_dir=output_dir, max_steps=max_steps, learning_rate=2e-4, num_generations=8,
                    per_device_train_batch_size=8, max_completion_length=96, bf16=False, use_cpu=True,
                    logging_steps=1, report_to="none", save_strategy="no", adam_beta1=0.999999,
                    adam_beta2=0.999999, weight_decay=0.1, max_grad_norm=0.1, lr_scheduler_type="cosine",
                    warmup_steps=0, temperature=1.0, top_k=0, seed=3407)     # TRL's warm-up starts at lr 0
    config, trainer = {"gtpo": (GTPOConfig, GTPOTrainer), "grpo": (GRPOConfig, GRPOTrainer)}[method]
    return trainer(model=model, processing_class=tok, reward_funcs=[trl_reward("arithmetic")],
                   args=config(**{**settings, **kw}), train_dataset=example_dataset(tok))


def example_main(argv=None):
    """`python -m gtpo_trl --example`: the embedded example (example_trainer), trained and saved."""
    import argparse
    p = argparse.ArgumentParser(prog="python -m gtpo_trl --example", allow_abbrev=False,
                                description="GTPO through TRL's trainer on the embedded model (CPU, offline)")
    p.add_argument("--max_steps", type=int, default=20)
    p.add_argument("--method", choices=("gtpo", "grpo"), default="gtpo",
                   help="grpo: TRL's GRPOTrainer with the same settings")
    p.add_argument("--output_dir", default="runs/gtpo-trl-smollm2-135m-arithmetic")
    p.add_argument("--max_completion_length", type=int, default=96)
    a = p.parse_args(argv)
    trainer = example_trainer(a.method, a.max_steps, a.output_dir, max_completion_length=a.max_completion_length)
    trainer.train()
    final, metrics = os.path.join(a.output_dir, "final"), os.path.join(a.output_dir, "metrics.jsonl")
    trainer.save_model(final)                                       # the LoRA adapter and the tokenizer
    with open(metrics, "w") as f:                                   # TRL's logged rows, one per step
        f.writelines(json.dumps(row) + "\n" for row in trainer.state.log_history)
    print(f"done: adapter in {final} (python eval.py --adapter {final}), metrics in {metrics}")
