"""The paper's entropy ablations (its current version's Figure 4; v1-v3's Fig. 4 and App. 12-14) as train.py
commands at the paper's shape, LLaMA-8B on MATH: each panel a base run and arms that change exactly the settings
the panel ablates. Not run by the CPU study; docs/study.md, Part 9 lists them. From the root:

    python -m study.fig4                  # every panel's commands
    python -m study.fig4 --panel gamma    # one panel's

    gamma      gamma in {0.1 without delta_i, 0.1, 0.01, 0.001, 1e-6} (Fig. 4), the default objective otherwise
    threshold  the <H>_i threshold in {ln 2, 0.7, 1.05, 2.0}, delta_i on every completion (App. 12)
    onlyneg    GTPO-OnlyNeg (delta_i on A < 0 only) at each threshold, against GRPO with beta 0 and 1e-6 (App. 13)
    grpo       GRPO with the filter (< 1.05) and gamma 0.1 against plain GRPO and GTPO with the same (App. 14)
"""
import argparse
import os

BASE = ["python", "train.py", "--model", "llama-8b", "--dataset", "math"]
GTPO, GRPO = ["--use_gtpo"], ["--use_grpo"]
THRESHOLDS = ("0.7", "1.05", "2.0")
BETAS = {"adam_beta1", "adam_beta2"}          # each method's own (Listing 1): they change with it

# panel -> [(run, its flags, the settings they change against the panel's first run, the base)]
PANELS = {
    "gamma": [("base", GTPO, set()), ("gamma-0.1-no-delta", GTPO + ["--entropy_filter", "off"], {"entropy_filter"})]
             + [(f"gamma-{g}", GTPO + ["--ent_gamma", g], {"ent_gamma"}) for g in ("0.01", "0.001", "1e-6")],
    "threshold": [("base", GTPO + ["--entropy_filter", "all"], set())]
                 + [(f"threshold-{t}", GTPO + ["--entropy_filter", "all", "--ent_threshold", t], {"ent_threshold"})
                    for t in THRESHOLDS],
    "onlyneg": [("grpo-beta-0", GRPO, set()), ("grpo-beta-1e-6", GRPO + ["--beta", "1e-6"], {"beta"})]
               + [(f"onlyneg-{t}", GTPO + ["--entropy_filter", "neg", "--ent_threshold", t],
                   {"method", "entropy_filter", "ent_threshold", *BETAS}) for t in THRESHOLDS],
    "grpo": [("grpo", GRPO, set()),
             ("grpo-filter-1.05", GRPO + ["--entropy_filter", "all", "--ent_threshold", "1.05"],
              {"entropy_filter", "ent_threshold"}),
             ("gtpo-filter-1.05", GTPO + ["--entropy_filter", "all", "--ent_threshold", "1.05"],
              {"method", "entropy_filter", "ent_threshold", *BETAS})],
}


def commands(panel, out="runs/fig4"):
    """[(run, argv)] of a panel, its base first; each run into <out>/<panel>/<run>."""
    return [(run, BASE + flags + ["--output_dir", os.path.join(out, panel, run)]) for run, flags, _ in PANELS[panel]]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--panel", choices=list(PANELS), nargs="+", default=list(PANELS))
    p.add_argument("--output_dir", default="runs/fig4")
    args = p.parse_args(argv)
    for panel in args.panel:
        print(f"# {panel}")
        for _, argv_ in commands(panel, args.output_dir):
            print(" ".join(argv_))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
