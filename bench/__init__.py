"""Benchmarks, run from the repository root: `python -m bench --parts ...` (bench/__main__.py); the
GPU part is bench/gpu.py, what both use bench/common.py."""
