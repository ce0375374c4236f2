"""The pages' figures that live in committed files agree with those files (docs/*.json, study/runs/)."""
import json
import os

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def page(name):
    with open(os.path.join(HERE, name)) as f:
        return " ".join(f.read().split())


def test_released_count_figures_are_the_benchmarks():
    """docs/training.md, "The authors' code, checked", quotes docs/released-count.json (python -m bench.released)."""
    with open(os.path.join(HERE, "docs", "released-count.json")) as f:
        s = json.load(f)["summary"]
    text = page("docs/training.md")
    share = round(100 * s["count_differs"] / s["active"])
    assert (f"{s['count_differs']} of the {s['active']} completions with A ≠ 0 ({share} %)" in text
            and f"on {s['steps_count_differs']} of the {s['steps_with_active']} steps" in text
            and f"{s['norm_ratio_min']:.2f}–{s['norm_ratio_max']:.2f} × the union count's "
                f"(median {s['norm_ratio_median']:.2f})" in text)
