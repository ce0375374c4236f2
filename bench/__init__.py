"""Benchmarks, run from the repository root: `python -m bench --parts ...` (bench/__main__.py, the command
line). The parts: the training step on CPU (bench/cpu.py), the probes run in a fresh process each -- conflict
masks, the loss's memory, TRL (bench/probes.py) -- the reward on hostile text (bench/reward.py) and the GPU
part (bench/gpu.py); what they share is bench/common.py."""
