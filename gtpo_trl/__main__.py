"""`python -m gtpo_trl`: TRL's `trl grpo` command line with GTPOTrainer (gtpo_trl/cli.py); --example: the embedded
example (gtpo_trl/example.py)."""
import sys

from gtpo_trl.cli import main

sys.exit(main())
