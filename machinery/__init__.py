"""The run machinery around the method: what train.py and eval.py read, save and check.

    config.py     every setting of a run once: Config (the objective's: gtpo.Objective), the demo profile, flags
    flags.py      the command line's parser: hyphens or underscores, no abbreviations, one-line errors, ranges
    data.py       GSM8K, MATH, MATH-500, AIME 2024/2025, AMC 2023, the built-in arithmetic tasks, the prompt
    models.py     model aliases, the embedded offline model, dtype, 4-bit, LoRA
    runs.py       run folders, metrics.jsonl, checkpoints, --resume, torchrun ranks, Ctrl-C
    heldout.py    held-out pass@1 while a run trains, through eval.py's own sampling and scoring
"""
