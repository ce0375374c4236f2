"""GTPO for TRL users: GTPOConfig and GTPOTrainer on TRL's GRPOTrainer (pip install ".[trl]", docs/trl.md).

    from gtpo_trl import GTPOConfig, GTPOTrainer, trl_reward
    trainer = GTPOTrainer(model=model, processing_class=tok, reward_funcs=[trl_reward("gsm8k")],
                          args=GTPOConfig(output_dir="out", num_generations=8), train_dataset=ds)
    trainer.train()                       # launch with accelerate / DeepSpeed as for GRPOTrainer

    config.py     GTPOConfig, and what GTPO does with every GRPOConfig option that touches the loss (OPTIONS)
    trainer.py    GTPOTrainer: what GTPO keeps from GRPOTrainer and what it replaces
    cli.py        python -m gtpo_trl: TRL's `trl grpo` command line with GTPOTrainer
    example.py    python -m gtpo_trl --example: the embedded model through TRL; example_dataset
"""
from machinery.models import embedded_model_dir     # first: it quiets bitsandbytes' import-time notes before TRL loads it
from gtpo_trl.cli import main                       # noqa: E402, I001
from gtpo_trl.config import OPTIONS, GTPOConfig
from gtpo_trl.example import example_dataset, example_trainer
from gtpo_trl.trainer import GTPOTrainer, per_token_advantages
from rewards import trl_reward, trl_rewards

__all__ = ["GTPOConfig", "GTPOTrainer", "OPTIONS", "per_token_advantages", "trl_reward", "trl_rewards",
           "embedded_model_dir", "example_dataset", "example_trainer", "main"]
