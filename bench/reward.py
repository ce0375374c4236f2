"""Part 5: the reward on hostile completions -- what a degenerating policy writes -- each case in a fresh
process, a batch of them, and one case scored from a worker thread."""
import json
import subprocess
import sys
import time

from bench.common import ROOT


def hostile_cases():
    """name -> (completion, reference answer, task): texts that once crashed or stalled a reward."""
    tag = lambda ans: f"<reasoning>r</reasoning><answer>{ans}</answer>"               # noqa: E731
    return {
        "5,000-digit answer": (tag("9" * 5000), "9", "gsm8k"),
        "3,000 Arabic-Indic digit groups": (tag("\u0663\u0664\u0665" * 3000), "345", "arithmetic"),
        "10^{10^{10^{10}}}": (tag("10^{10^{10^{10}}}"), "5", "math"),
        "(10^{6})!": (tag("(10^{6})!"), "5", "math"),
        "2,000 x 11-digit product": (tag("\\cdot ".join(["12345678901"] * 2000)), "5", "math"),
        "3,000 nested braces": (tag("{" * 3000 + "1" + "}" * 3000), "1", "math"),
        "9^{9^{9^{9^{9}}}}": (tag("9^{9^{9^{9^{9}}}}"), "5", "math"),
        "tags x150 (4,650 chars)": ("<reasoning></reasoning>" * 150 + "<answer>" * 150, "1", "gsm8k"),
        "tags x2000 (78k chars)": ("<reasoning></reasoning>" * 2000 + "<answer>" * 2000, "1", "gsm8k"),
        "<reasoning> x3000 + <answer> x3000": ("<reasoning>" * 3000 + "<answer>" * 3000, "1", "gsm8k"),
        "control chars and NULs": (tag("\x00\x01\x1b[2J\u202e5\x00"), "5", "math"),
        "correct, math": (tag("\\dfrac{1}{2}"), "\\frac12", "math"),
        "correct, gsm8k": (tag("$1,234"), "1234", "gsm8k"),
    }


def report_reward(args, res):
    """Part 5: rewards.score on each hostile case in a fresh process (time incl. the math-verify
    worker's start for MATH cases; killed after 60 s), then a batch of 24 hostile MATH completions
    of ~1,500 tokens in one process, and one case scored from a worker thread."""
    res["reward"] = {}
    print("\n5. reward on hostile completions            seconds   reward")
    for name, (text, ref, task) in hostile_cases().items():
        code = (f"import json, time, rewards; t = time.perf_counter(); "
                f"r = rewards.score([{text!r}], [{ref!r}], {task!r})[0].item(); "
                f"print(json.dumps([time.perf_counter() - t, r]))")
        try:
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                                 cwd=ROOT)
            sec, reward = json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else (None, "error")
            if out.returncode:
                reward = out.stderr.strip().splitlines()[-1][:80]
        except subprocess.TimeoutExpired:
            sec, reward = None, "timeout > 60 s"
        res["reward"][name] = {"seconds": sec, "reward": reward}
        print(f"   {name:38s} {sec if sec is None else round(sec, 2)!s:>8s}   {reward}")
    from rewards import score
    cases = [v for v in hostile_cases().values() if v[2] == "math"]
    texts = [(c[0] * (6000 // len(c[0]) + 1))[:6000] for c in cases]               # ~1,500 tokens each
    batch = [texts[i % len(texts)] + str(i) for i in range(24)]
    counts, t = {}, time.perf_counter()
    score(batch, ["5"] * 24, "math", counts)
    res["reward"]["batch of 24 x 6,000 chars"] = {"seconds": time.perf_counter() - t, **counts}
    print(f"   batch of 24 hostile MATH completions, 6,000 chars each: {time.perf_counter() - t:.1f} s, {counts}")
    import threading
    import rewards
    rewards._WORKER.cache.clear()                                      # a fresh verdict, not the batch's
    box, t = [], time.perf_counter()
    th = threading.Thread(target=lambda: box.append(score([cases[4][0] + " "], ["5"], "math")[0].item()),
                          daemon=True)
    th.start()
    th.join(120)
    res["reward"]["from a worker thread"] = {"seconds": time.perf_counter() - t, "returned": not th.is_alive()}
    print(f"   9^... tower scored from a worker thread: {time.perf_counter() - t:.1f} s, returned {not th.is_alive()}")
