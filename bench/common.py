"""What the CPU benchmarks (bench/cpu.py, bench/probes.py) and the GPU part (bench/gpu.py) share: the timed prompt,
the reward that keeps every timed step's work the same, and the host's two limits: the memory bandwidth that
bounds decoding and the matmul peak that bounds the gradient pass."""
import contextlib
import os
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))       # the repository: benchmarks run from it
MB = 2 ** 20


@contextlib.contextmanager
def spread_rewards():
    """Within it, rewards.reward (what step.rl_step calls) is the real one with a fixed spread added to a
    batch whose rewards are all equal, so that every timed step does the same work (a zero advantage
    would skip nothing, but keeps it honest)."""
    import rewards
    real = rewards.reward

    def spread(texts, answers, task, counts=None):
        total, fmt, cor = real(texts, answers, task, counts)
        if total.std() == 0:
            total = total + torch.linspace(0, 1, len(total))
        return total, fmt, cor
    rewards.reward = spread
    try:
        yield
    finally:
        rewards.reward = real


def memory_bandwidth(device, gb=1.0, repeats=5):
    """Bytes per second of a streaming read (a sum over `gb` GB of fp32): the ceiling for decoding,
    which reads every weight once per generated token."""
    x = torch.ones(int(gb * 2 ** 30 / 4), device=device)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum().item()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best


def matmul_peak(device, n=2048, repeats=5):
    """FLOP/s of one large fp32 matmul (n x n times n x n, the best of `repeats`) on the threads this process
    has: the ceiling for the gradient pass, whose time goes to matmuls of the same kind."""
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    best = float("inf")
    for _ in range(repeats + 1):                                     # the first call warms the kernel up
        t0 = time.perf_counter()
        (a @ b).sum().item()
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best


def bench_prompt(tok, prompt_tokens):
    """The demo's one-shot prompt; with prompt_tokens, its question lengthened to about that many
    tokens (cost depends on shapes, not on words)."""
    from machinery.data import arithmetic_task, format_prompt, one_shot_example
    recs = arithmetic_task("train")
    q = recs[1]["question"]
    make = lambda q: format_prompt(tok, q, one_shot_example(recs[0]))          # noqa: E731
    while prompt_tokens and len(tok(make(q), add_special_tokens=False)["input_ids"]) < prompt_tokens:
        q = "Recall that a number plus zero is the same number. " + q
    return make(q), recs[1]["answer"]
