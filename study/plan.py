"""The study's plan, one concern: what docs/study.md declares, as records. Each part is one Part -- its runs (arms x
seeds, the warm-up each starts from, flags, evaluations) and its tests (the contrast, metric, test and verdict
words); each question's row of docs/results.md's opening table is one Answer (study/answers.py). study/run.py
trains and evaluates the jobs these records give (jobs()); study/report.py computes every table, verdict and
figure from the same records and the committed files in study/runs/.

Adding a question: write its part in docs/study.md and commit it before its first run; append a Part to PARTS
with its arms and tests, and an Answer to study/answers.py's ANSWERS; add a cells function to study/report.py only
where its table has columns of its own.
"""
import math
import os
import statistics
from dataclasses import dataclass, field

from machinery import runs
from machinery.data import read_jsonl

STUDY = os.path.dirname(os.path.abspath(__file__))     # the code, summary.md/.json and the figures
KEEP = os.path.join(STUDY, "runs")                     # each run's small files, committed: study/runs/<run>/

# the demo profile's values the study ran with, given as flags: the demo's profile may change, the study's runs not
PINNED = ["--lr", "2e-4", "--warmup_ratio", "0.05", "--ent_ini_prompts", "16", "--entropy_term", "released",
          "--ent_gamma", "0.1", "--lr_scheduler", "cosine", "--micro_batch_size", "4", "--sft_micro_batch_size", "2"]
EQ7_RECORDED = ["--entropy_term", "eq7"]     # the profile's when Q6-Q9's GRPO runs and warm-ups were made; neither reads it
SFT_PINNED = ["--lr", "2e-4", "--warmup_ratio", "0.05", "--lr_scheduler", "cosine", "--micro_batch_size", "4",
              "--generation_size", "8", "--sft_warmup_steps", "4", "--ent_gamma", "0.1",
              "--ent_ini_prompts", "16", *EQ7_RECORDED]   # recorded; SFT reads few
COMMON = ["--model", "smollm2-135m", "--dataset", "arithmetic", "--batch_size", "1", "--generation_size", "8",
          "--max_completion_length", "96", "--max_steps", "20", "--sft_warmup_steps", "0", "--save_steps", "5", *PINNED]
SFT_START = ["--model", "smollm2-135m", "--dataset", "arithmetic", "--use_sft", "--batch_size", "8",
             "--sft_micro_batch_size", "4", *SFT_PINNED]
WARMUP = SFT_START + ["--max_steps", "4", "--save_steps", "4"]             # the main part's start
WARMUP_LONG = SFT_START + ["--max_steps", "32", "--save_steps", "32"]      # <H>_ini below ln 2
A6 = ["--adam_beta1", "0.999999", "--adam_beta2", "0.999999"]     # Listing 1's GTPO betas
A9 = ["--adam_beta1", "0.9", "--adam_beta2", "0.95"]               # Listing 1's GRPO / SFT betas
LONG = ["--max_steps", "200", "--save_steps", "25"]                # after COMMON: these win
BEST_WINDOW = 25                                                   # = the long runs' save_steps
EVALS = {"id": ["--dataset", "arithmetic", "--split", "test", "--limit", "64"],
         "ood": ["--dataset", "arithmetic", "--split", "reworded", "--limit", "48"]}
EVAL_COMMON = ["--n_samples", "8", "--batch_size", "64", "--seed", "0", "--max_completion_length", "96"]
N_SAMPLES = 8
KL_PROBE = (16, 2)                      # `kl`: ID problems and samples each at every checkpoint (eval.py --drift)
COLLAPSE_WINDOW, COLLAPSE_DROP = 10, 2.0      # steps; points of the 10-point formatting reward (= 20 %)


@dataclass
class Arm:
    """One configuration's runs, <name>-s<seed>. flags: train.py's whole command line, None for runs this part
    reads but another part (or the first design) trained; start: the warm-up arm its runs start from, None for a
    warm-up; passes: the evaluations of each job, one job per pass; reuse: seed -> another part's run read in
    this arm's place (not trained here); when: the outcome of its part's declared next-step rule under which it
    runs (study/q10.py's next_step), None for an arm that always runs."""
    name: str
    label: str
    flags: list = None
    seeds: tuple = ()
    start: str = None
    passes: tuple = ((),)
    reuse: dict = field(default_factory=dict)
    when: str = None

    def run_id(self, seed):
        return self.reuse.get(seed, f"{self.name}-s{seed}")


@dataclass
class Test:
    """One verdict on A - B, with seeds as units: contrasts, each [(coefficient, arm name)], give one unit per
    contrast and seed where every term's run has the metric (study.report.METRICS). test: "sign-flip" (two-sided,
    with the problem-level interval where counts exist), "sign-flip one-sided" (the observed direction's p) or
    "fisher" (one-sided, on the metric's 0/1 counts). sign: +1 / -1 where the paper says A above / below B, 0 for
    no claim; regime: why the claim is not testable here; holm: tests sharing a name are Holm-adjusted together;
    names: A and B in the verdict's sentence."""
    label: str
    claim: str
    contrasts: list
    metric: str
    sign: int = 1
    test: str = "sign-flip"
    regime: str = None
    holm: str = None
    names: tuple = ("A", "B")


@dataclass
class Part:
    """One part of docs/study.md. arms: what it trains (warm-ups first) and reads; questions: its rows of the
    summary's questions table; tests: the verdicts of its own section; section: the study.report function that
    draws that section (None: no section); cells: the study.report cells function of a per-seed table; figures:
    (file, study.report plot function, its arguments); order: "seed" trains each seed's warm-up and runs back to
    back, "pass" every warm-up, then each pass over every run; cost: its name in the cost line (parts with one
    name are summed); since: attempts of the warm-ups it starts from but another part trained count here from
    this date on (it trained them again); base: the folder of its committed runs under study/runs/, if any;
    one_host: the part trains on the host kind of its committed runs only (study.run refuses another)."""
    key: str
    title: str = None
    arms: object = ()                 # a list, or a function that gives one (the collapse part's ladder)
    questions: list = ()
    tests: list = ()
    section: str = None
    cells: str = None
    figures: list = ()
    order: str = "pass"
    cost: str = None
    since: str = None
    base: str = ""
    one_host: bool = False            # every run and warm-up on one host kind (study.run.host()); others refused

    def arm_list(self):
        return self.arms() if callable(self.arms) else list(self.arms)


def rung_flags(method, dataset, lr):
    """A collapse-part run: 100 steps at a constant learning rate, clip norm 1.0, on the rung's task."""
    return COMMON + ["--use_" + method, *A9, "--max_steps", "100", "--save_steps", "25", "--lr_scheduler", "constant",
                     "--max_grad_norm", "1.0", "--dataset", dataset, "--lr", lr]


LADDER = [("r1", "arithmetic", "5e-4"), ("r2", "arithmetic", "1e-3"), ("r3", "arithmetic-hard", "1e-3"),
          ("r4", "arithmetic-hard", "2e-3"), ("r5", "arithmetic-hard", "5e-3")]        # (rung, task, lr)
PILOT_SEED, TEST_SEEDS = 11, (21, 22, 23, 24, 25)
METHODS = {"grpo": "GRPO β=0", "gtpo": "GTPO"}


def collapse_arms():
    """Part 3: the pilot ladder on PILOT_SEED, then -- once chosen_rung() names a rung -- the test at that rung on
    TEST_SEEDS, its KL drift a pass after every run the verdict needs."""
    w = Arm("warmup-collapse", "SFT warm-up, 32 steps", WARMUP_LONG, (PILOT_SEED,))
    pilot = [Arm(f"pilot-{name}-{m}", f"{name} ({task}, lr {lr}) {METHODS[m]}", rung_flags(m, task, lr), (PILOT_SEED,),
                 "warmup-collapse") for name, task, lr in LADDER for m in ("grpo", "gtpo")]
    rung = chosen_rung()
    if rung is None:
        return [w] + pilot
    _, task, lr = next(r for r in LADDER if r[0] == rung)
    w.seeds += TEST_SEEDS
    return [w] + pilot + [Arm(f"collapse-{m}", METHODS[m], rung_flags(m, task, lr), TEST_SEEDS, "warmup-collapse",
                              (("rung", "rung-precollapse"), ("kl",))) for m in ("grpo", "gtpo")]


Q6_SEEDS, Q6_NEW_SEEDS, Q6_RUNG = (21, 22, 23, 24, 25, 26, 27, 28), (26, 27, 28), "r4"
Q6_FLAGS = {m: rung_flags(m, *next(r[1:] for r in LADDER if r[0] == Q6_RUNG)) for m in ("grpo", "gtpo")}
Q7_SEEDS = (1, 2, 3, 4, 5, 6, 7, 8)
Q7_EVALS = (("id", "id-best", "ood", "kl200"),)  # primary first; kl200: the KL to the warm-up at step 200 only
Q7_GTPO = COMMON + ["--use_gtpo", *A9, *LONG, "--entropy_term", "eq7", "--entropy_filter", "auto"]  # the term named
Q7_GRPO = COMMON + ["--use_grpo", *A9, *LONG, *EQ7_RECORDED]
Q8_HOST_SEEDS = (1, 2)                       # GRPO trained again on these seeds where the warm-up is not Q7's


def warmup_differs(seed):
    """Whether Q8's warm-up of the seed has a committed fingerprint other than Q7's (another host's numerics);
    None while either is not committed."""
    paths = [os.path.join(KEEP, f"warmup-{q}-s{seed}", "adapter_fingerprint.json") for q in ("q7", "q8")]
    if not all(os.path.isfile(p) for p in paths):
        return None
    return runs.read_json(paths[0])["fingerprint"] != runs.read_json(paths[1])["fingerprint"]


def q8_arms():
    """Part 7: each seed's own run of Q7's warm-up command, the two new GTPO forms, GRPO again on Q8_HOST_SEEDS
    once their warm-up is known to differ from Q7's; Q7's two arms read beside them."""
    again = tuple(s for s in Q8_HOST_SEEDS if warmup_differs(s))
    return [Arm("warmup-q8", "SFT warm-up, 32 steps", WARMUP_LONG, Q7_SEEDS),
            Arm("q7-grpo", "GRPO β=0"), Arm("q7-gtpo", "GTPO, Eq. 7"),
            Arm("q7-released", "GTPO, released term", [*Q7_GTPO[:-4], "--entropy_term", "released", "--entropy_filter",
                                                        "auto"], Q7_SEEDS, "warmup-q8", Q7_EVALS),
            Arm("q8-nogamma", "GTPO, γ = 0", Q7_GTPO + ["--ent_gamma", "0"], Q7_SEEDS, "warmup-q8", Q7_EVALS),
            Arm("q8-grpo", "GRPO β=0, again from this warm-up", Q7_GRPO, again, "warmup-q8", Q7_EVALS)]


# Q10: Eq. 7's gamma in Q6's collapse setting and Q7's learning setting, the default beside (part q10)
Q10_COLLAPSE_SEEDS = Q6_SEEDS
Q10_NEXT = {"0.001": "cost", "0.03": "no protection"}      # the next step's gamma -> the gamma 0.01 outcome it follows


def q10_arms():
    """Part 10: each seed's own warm-up in each setting; the default and Eq. 7 at gamma 0.01 where GRPO collapses,
    Eq. 7 at gamma 0.01 and GRPO again (for pairs from one warm-up) where the model learns; the next step's gamma
    in both settings (`when`: study/q10.py's next_step must name it); the runs read beside them."""
    collapse, learn = Q6_FLAGS["gtpo"] + ["--entropy_term", "eq7"], Q7_GTPO
    # the host that trains the collapse setting's gamma 0.03 cannot rebuild its seeds' warm-ups: it trains its own
    # (docs/study.md, the amendment to part 10)
    warmup = {"0.001": "warmup-q10-collapse", "0.03": "warmup-q10h-collapse"}
    step = [Arm("warmup-q10h-collapse", "SFT warm-up, 32 steps, on the host that trains γ 0.03", WARMUP_LONG,
                Q10_COLLAPSE_SEEDS, when="0.03")] + [a for g in Q10_NEXT for a in (
        Arm(f"q10-collapse-g{g}", f"GTPO, Eq. 7, γ {g}", collapse + ["--ent_gamma", g], Q10_COLLAPSE_SEEDS,
            warmup[g], (("rung",),), when=g),
        Arm(f"q10-learn-g{g}", f"GTPO, Eq. 7, γ {g}", learn + ["--ent_gamma", g], Q7_SEEDS, "warmup-q10-learn",
            Q7_EVALS, when=g))]
    return [Arm("warmup-q10-learn", "SFT warm-up, 32 steps", WARMUP_LONG, Q7_SEEDS),
            Arm("warmup-q10-collapse", "SFT warm-up, 32 steps", WARMUP_LONG, Q10_COLLAPSE_SEEDS),
            Arm("q10-learn-grpo", "GRPO β=0, from this warm-up", Q7_GRPO, Q7_SEEDS, "warmup-q10-learn", Q7_EVALS),
            Arm("q10-learn-g0.01", "GTPO, Eq. 7, γ 0.01", learn + ["--ent_gamma", "0.01"], Q7_SEEDS,
                "warmup-q10-learn", Q7_EVALS),
            Arm("q10-collapse-released", "GTPO, released term, γ 0.1 (the default)",
                Q6_FLAGS["gtpo"] + ["--entropy_term", "released"], Q10_COLLAPSE_SEEDS, "warmup-q10-collapse",
                (("rung",),)),
            Arm("q10-collapse-g0.01", "GTPO, Eq. 7, γ 0.01", collapse + ["--ent_gamma", "0.01"], Q10_COLLAPSE_SEEDS,
                "warmup-q10-collapse", (("rung",),)),
            *step, Arm("q6-grpo", "GRPO β=0"), Arm("q6-gtpo", "GTPO, Eq. 7, γ 0.1"), Arm("q7-grpo", "GRPO β=0 (Q7)"),
            Arm("q7-gtpo", "GTPO, Eq. 7, γ 0.1"), Arm("q8-nogamma", "GTPO, γ 0"),
            Arm("q7-released", "GTPO, released term, γ 0.1 (the default)")]


def q10_tests():
    """Part 10's family, Holm-adjusted together over the tests that have run: each gamma's protection (Q6's test
    against Q6's GRPO) and cost (Q7's test against GRPO from the same warm-ups); the default's protection."""
    def protects(name, label):
        return Test("Q10", f"GRPO collapses more often than {label}", vs("q6-grpo", name), "collapsed",
                    test="fisher", holm="q10", names=("GRPO", label))

    def costs(name, label):
        return Test("Q10", f"{label} above GRPO", vs(name, "q10-learn-grpo"), "id", test="sign-flip one-sided",
                    holm="q10", names=(label, "GRPO"))
    return [protects("q10-collapse-released", "the default (released, γ 0.1)"),
            *(t for g in ("0.01", *Q10_NEXT) for t in (protects(f"q10-collapse-g{g}", f"Eq. 7 γ {g}"),
                                                       costs(f"q10-learn-g{g}", f"Eq. 7 γ {g}"))),
            Test("Q10", "host alone: GRPO here − GRPO in Q7", vs("q10-learn-grpo", "q7-grpo"), "id", sign=0,
                 names=("GRPO here", "GRPO in Q7"))]


# Q11: Q10's answer confirmed on fresh seeds, every arm of a seed from its one warm-up, one host kind (part q11)
Q11_SEEDS = tuple(range(31, 47))          # 16 fresh seeds: the declared power calculation's number (study.q11.power)
Q11_ARMS = [("q11-grpo", "GRPO β=0", Q6_FLAGS["grpo"] + EQ7_RECORDED),                     # as q6-grpo
            ("q11-released", "the default (released, γ 0.1)", Q6_FLAGS["gtpo"] + ["--entropy_term", "released"]),
            ("q11-eq7", "Eq. 7, γ 0.03", Q6_FLAGS["gtpo"] + ["--entropy_term", "eq7", "--ent_gamma", "0.03"])]


def q11_tests():
    """Part 11's family, Holm over its two tests: each GTPO arm against GRPO on Q6's collapse rule, paired by seed."""
    return [Test("Q11", f"GRPO collapses more often than {label}", vs("q11-grpo", name), "collapsed",
                 test="paired exact", holm="q11", names=("GRPO", label)) for name, label, _ in Q11_ARMS[1:]]


# Q9's arms, each paired with its seed's warm-up evaluated (part q9)
Q9_ARMS = (("q7-grpo", "GRPO"), ("q7-gtpo", "Eq. 7"), ("q7-released", "released"), ("q8-nogamma", "γ = 0"))


def vs(a, b):
    """The contrast A - B of two arms."""
    return [[(1, a), (-1, b)]]


FIG2, ACC = "GTPO above GRPO β=0 (Fig. 2)", "train"
G_VS_R = vs("gtpo-a6", "grpo-a6") + vs("gtpo-a9", "grpo-a9")
# seeds as the units: a seed's two Adam settings share its warm-up, prompts and first samples
BY_SEED = [[(0.5, "gtpo-a6"), (-0.5, "grpo-a6"), (0.5, "gtpo-a9"), (-0.5, "grpo-a9")]]
HOT = "Fig. 1's collapse comes after hundreds of steps; these runs have 20"
EQ6 = "delta_i acts only when <H>_ini < ln 2 (Eq. 6); <H>_ini was 1.2-1.6 here"
MAIN_SEEDS = (1, 2, 3)
V1_SEEDS = {"gtpo": (1, 2, 3), "grpo": (1, 2, 3), "grpo-kl": (1, 2, 3), "sft": (1, 2, 3), "gtpo-masks-only": (1, 2),
            "gtpo-delta": (1, 2), "gtpo-onlyneg": (1, 2), "grpo-entropy": (1, 2), "gtpo-hot": (1, 2),
            "grpo-hot": (1, 2), "grpo-kl-hot": (1, 2)}
V1_LABELS = {"gtpo": "GTPO", "grpo": "GRPO β=0", "gtpo-masks-only": "conflict masks only (γ=0, no δ)",
             "gtpo-delta": "GTPO, δ_i on all", "gtpo-onlyneg": "GTPO, δ_i on negatives (OnlyNeg)",
             "grpo-entropy": "GRPO + δ_i + γ"}
MAIN_RUNS = [("gtpo-a6", "GTPO, Adam β 0.999999", ["--use_gtpo", *A6]),   # the paper's GTPO
             ("gtpo-a9", "GTPO, Adam β (0.9, 0.95)", ["--use_gtpo", *A9]),
             ("grpo-a6", "GRPO β=0, Adam β 0.999999", ["--use_grpo", *A6]),
             ("grpo-a9", "GRPO β=0, Adam β (0.9, 0.95)", ["--use_grpo", *A9]),   # the paper's GRPO, beta 0
             ("grpo-kl6", "GRPO β=1e-6, Adam β (0.9, 0.95)", ["--use_grpo", "--beta", "1e-6", *A9]),  # Fig. 2's 1e-6
             ("sft", "SFT", ["--use_sft"])]                                      # Listing 1: 1 prompt a step

PARTS = [
    Part("main", cost="main and long parts", arms=[
        Arm("warmup", "SFT warm-up (the start)", WARMUP, MAIN_SEEDS, passes=(("id", "ood"),)),
        *(Arm(n, label, COMMON + f, MAIN_SEEDS, "warmup", (("id", "ood"),)) for n, label, f in MAIN_RUNS)],
        questions=[
            Test("Q1", FIG2, G_VS_R, "id"), Test("Q1", FIG2, G_VS_R, "ood-solvable"), Test("Q1", FIG2, G_VS_R, ACC),
            Test("Q1", FIG2 + ", seeds as units", BY_SEED, "id"),
            Test("Q1", FIG2 + ", seeds as units", BY_SEED, "ood-solvable"),
            Test("Q1", "GTPO above GRPO β=1e-6 (Fig. 2)", vs("gtpo-a9", "grpo-kl6"), "id"),
            Test("Q2", "(no claim) GTPO's edge the same under both Adam settings",
               [[(1, "gtpo-a6"), (-1, "grpo-a6"), (-1, "gtpo-a9"), (1, "grpo-a9")]], "id", sign=0),
            Test("Q2", "(no claim) Adam β 0.999999 vs (0.9, 0.95), GTPO", vs("gtpo-a6", "gtpo-a9"), "id", sign=0),
            Test("Q2", "(no claim) Adam β 0.999999 vs (0.9, 0.95), GRPO", vs("grpo-a6", "grpo-a9"), "id", sign=0),
            Test("Q3", "GTPO above SFT (Fig. 2-3, Sec. 6)", vs("gtpo-a6", "sft"), "id"),
            Test("Q3", "GTPO above SFT (Fig. 2-3, Sec. 6)", vs("gtpo-a6", "sft"), "ood-solvable")],
        figures=[("curves-main.png", "plot_curves", dict(names=[n for n, *_ in MAIN_RUNS if n != "sft"], smooth=5,
                                                          title="GTPO vs GRPO β=0 under both Adam settings")),
                 ("passk.png", "plot_passk", {})]),
    Part("long", "Q4: collapse over 200 steps", cost="main and long parts", section="collapse_lines", arms=[
        Arm("warmup-long", "SFT warm-up, 32 steps", WARMUP_LONG, (1, 2)),
        Arm("gtpo-long", "GTPO, 200 steps", COMMON + ["--use_gtpo", *A9, *LONG], (1, 2), "warmup-long",
            (("id", "id-best", "kl"),)),
        Arm("grpo-long", "GRPO β=0, 200 steps", COMMON + ["--use_grpo", *A9, *LONG], (1, 2), "warmup-long",
            (("id", "id-best", "kl"),))],
        questions=[Test("Q4", "GTPO above GRPO β=0 after 200 steps", vs("gtpo-long", "grpo-long"), "id-final"),
                   Test("Q4", "GTPO above GRPO β=0, best checkpoints", vs("gtpo-long", "grpo-long"),
                      "id-best")],
        figures=[("curves-long.png", "plot_curves", dict(names=["gtpo-long", "grpo-long"], smooth=10, kl=True,
                                                          title="200 steps from <H>_ini < ln 2"))]),
    Part("v1", base="v1", arms=[Arm(n, V1_LABELS.get(n, n), seeds=s) for n, s in V1_SEEDS.items()],
         questions=[
             Test("v1", FIG2, vs("gtpo", "grpo"), "id16"), Test("v1", FIG2, vs("gtpo", "grpo"), ACC),
             Test("v1", "GTPO above GRPO β=0.04 (Fig. 2)", vs("gtpo", "grpo-kl"), ACC),
             Test("v1", "GTPO above SFT OOD (Sec. 6)", vs("gtpo", "sft"), "ood16"),
             Test("v1", "GRPO β=0.04 above SFT OOD (Sec. 6: RL generalises)", vs("grpo-kl", "sft"), "ood16"),
             Test("v1", "conflict masks alone above GRPO (Fig. 5)", vs("gtpo-masks-only", "grpo"), ACC),
             Test("v1", "full GTPO above masks alone (Fig. 5)", vs("gtpo", "gtpo-masks-only"), ACC),
             Test("v1", "filter on all above no filter (Fig. 4)", vs("gtpo-delta", "gtpo"), ACC, regime=EQ6),
             Test("v1", "OnlyNeg below filter-on-all in accuracy (App. 13)", vs("gtpo-onlyneg", "gtpo-delta"),
                ACC, sign=-1, regime=EQ6),
             Test("v1", "filter + γ improve GRPO (App. 14)", vs("grpo-entropy", "grpo"), ACC),
             Test("v1", "GTPO above GRPO + filter + γ (App. 14)", vs("gtpo", "grpo-entropy"), ACC),
             Test("v1", "GTPO above GRPO β=0 at lr 1e-3 (Fig. 1)", vs("gtpo-hot", "grpo-hot"), ACC, regime=HOT)],
         figures=[("curves-v1-ablation.png", "plot_curves", dict(names=list(V1_LABELS), smooth=5,
                                                                 title="First design's ablations"))]),
    Part("collapse", cost="collapse part", arms=collapse_arms, section="collapse_part_lines",
         tests=[Test("Part 3", "GRPO collapses more often than GTPO", vs("collapse-grpo", "collapse-gtpo"),
                   "collapsed", test="fisher", names=("GRPO", "GTPO"))],
         figures=[("collapse-ladder.png", "plot_runs", dict(rows="ladder_plot_rows")),
                  ("collapse-test.png", "plot_runs", dict(rows="test_plot_rows"))]),
    Part("q6", "Q6: with Eq. 7's entropy term as written, does GTPO collapse less than GRPO?", cost="Q6",
         since="2026-11-25T14:25", section="per_seed_lines", cells="q6_cells", arms=[
             Arm("warmup-collapse", "SFT warm-up, 32 steps", WARMUP_LONG, Q6_NEW_SEEDS),
             Arm("q6-grpo", "GRPO β=0", Q6_FLAGS["grpo"] + EQ7_RECORDED, Q6_SEEDS, "warmup-collapse",
                 ((), ("rung",), ("kl",)),
                 reuse={s: f"collapse-grpo-s{s}" for s in TEST_SEEDS}),
             Arm("q6-gtpo", "GTPO, Eq. 7", Q6_FLAGS["gtpo"] + ["--entropy_term", "eq7"], Q6_SEEDS, "warmup-collapse",
                 ((), ("rung",), ("kl",)))],
         tests=[Test("Q6", "GRPO collapses more often than GTPO with Eq. 7", vs("q6-grpo", "q6-gtpo"),
                   "collapsed", test="fisher", names=("GRPO", "GTPO (Eq. 7)"))]),
    Part("q7", "Q7: does GTPO with Eq. 7 as written reach a higher ID pass@1 than GRPO β = 0 after 200 "
         "steps?", cost="Q7", order="seed", section="per_seed_lines", cells="q7_cells", arms=[
             Arm("warmup-q7", "SFT warm-up, 32 steps", WARMUP_LONG, Q7_SEEDS),
             Arm("q7-grpo", "GRPO β=0", Q7_GRPO, Q7_SEEDS, "warmup-q7", Q7_EVALS),
             Arm("q7-gtpo", "GTPO, Eq. 7", Q7_GTPO, Q7_SEEDS, "warmup-q7", Q7_EVALS)],
         tests=[Test("Q7", "GTPO above GRPO", vs("q7-gtpo", "q7-grpo"), "id",
                   test="sign-flip one-sided", names=("GTPO", "GRPO"))],
         figures=[("curves-q7.png", "plot_curves", dict(names=["q7-gtpo", "q7-grpo"], smooth=10,
                                                        title="Q7: GTPO with Eq. 7 as written against GRPO, 200 steps"))]),
    Part("q8", "Q8: which part of GTPO helps where the model learns?", cost="Q8", order="seed",
         section="q8_lines", cells="q7_cells", arms=q8_arms,
         tests=[Test("Q8", "released − GRPO", vs("q7-released", "q7-grpo"), "id",
                   test="sign-flip one-sided", holm="primary", names=("released", "GRPO")),
                Test("Q8", "γ = 0 − GRPO", vs("q8-nogamma", "q7-grpo"), "id",
                   test="sign-flip one-sided", holm="primary", names=("γ = 0", "GRPO")),
                Test("Q8", "released − Eq. 7", vs("q7-released", "q7-gtpo"), "id", sign=0,
                   names=("released", "Eq. 7")),
                Test("Q8", "γ = 0 − Eq. 7", vs("q8-nogamma", "q7-gtpo"), "id", sign=0,
                   names=("γ = 0", "Eq. 7")),
                Test("Q8", "host alone: GRPO here − GRPO in Q7", vs("q8-grpo", "q7-grpo"), "id", sign=0,
                   names=("GRPO here", "GRPO in Q7"))],
         figures=[("q8.png", "plot_q8", {})]),
    Part("q9", "Q9: what do 200 RL steps add to the warm-up they start from?", cost="Q9", order="seed",
         section="q9_lines", figures=[("q9.png", "plot_q9", {})], arms=[
             Arm("warmup-q9", "SFT warm-up, 32 steps (evaluated)", WARMUP_LONG, Q7_SEEDS, passes=(("id", "ood"),)),
             Arm("q7-grpo", "GRPO β=0"), Arm("q7-gtpo", "GTPO, Eq. 7"), Arm("q7-released", "GTPO, released term"),
             Arm("q8-nogamma", "GTPO, γ = 0")],
         tests=[Test("Q9", f"{label} − warm-up", vs(name, "warmup-q9"), metric, test="sign-flip one-sided",
                     holm=metric, names=(label, "warm-up"))
                for metric in ("id", "ood") for name, label in Q9_ARMS]),
    Part("q10", "Q10: which γ to use — Eq. 7's γ where GRPO collapses and where the model learns, and the default",
         cost="Q10", order="seed", section="q10_lines", arms=q10_arms, tests=q10_tests(),
         figures=[("q10.png", "plot_q10", {})]),
    Part("q11", "Q11: does GTPO protect against collapse? Q10's answer on fresh seeds, paired, one host kind",
         cost="Q11", order="seed", one_host=True, tests=q11_tests(), section="q11_lines", cells="q11_cells",
         figures=[("q11.png", "plot_q11", {})], arms=[
             Arm("warmup-q11", "SFT warm-up, 32 steps (one per seed, every arm's start)", WARMUP_LONG, Q11_SEEDS),
             *(Arm(name, label, flags, Q11_SEEDS, "warmup-q11", (("rung",),)) for name, label, flags in Q11_ARMS)]),
    Part("q5", "Q5: conflict tokens are mostly format tokens (Sec. 4.1)", section="conflict_lines"),
]


def part(key):
    return next(p for p in PARTS if p.key == key)


def arm(name, within=None):
    """The arm of that name: the part's own where it names seeds (the first design's), else the one that trains
    it."""
    mine = [a for a in (within.arm_list() if within else []) if a.name == name and a.seeds]
    return next(iter(mine + [a for p in PARTS for a in p.arm_list() if a.name == name and a.flags is not None]), None)


def part_jobs(p):
    """(run id, flags, seed, warm-up run id or None, evaluations) of the part, in its order (Part.order)."""
    arms = [a for a in p.arm_list() if a.flags is not None]
    warm, warm_later = ([(a.run_id(s), a.flags, s, None, a.passes[0]) for a in arms
                         if a.start is None and bool(a.when) == later for s in a.seeds]
                        for later in (False, True))           # a next step's own warm-ups go with its runs
    runs_ = [a for a in arms if a.start is not None]
    seeds = sorted({s for a in arms for s in a.seeds})

    def of(seed, k, arms_=tuple(a for a in runs_ if a.when is None)):
        return [(a.run_id(seed), a.flags, seed, f"{a.start}-s{seed}", a.passes[k]) for a in arms_
                if seed in a.seeds and seed not in a.reuse and k < len(a.passes)]
    later = tuple(a for a in runs_ if a.when is not None)         # a declared next step: after every first run
    if p.order == "seed":
        return [job for s in seeds for job in [w for w in warm if w[2] == s] + of(s, 0)] + \
            [job for s in seeds for job in [w for w in warm_later if w[2] == s] + of(s, 0, later)]
    return warm + warm_later + [job for k in range(max((len(a.passes) for a in runs_), default=0)) for s in seeds
                   for job in of(s, k)]


def jobs():
    """Every part's jobs, in PARTS' order."""
    return [job for p in PARTS for job in part_jobs(p)]


# -----------------------------------------------------------------------------
# the committed files, and the rules the runner and the report apply to them

def load(run_id, base=""):
    """A run's committed files (study/runs/<base>/<run_id>/): RL metric rows, evaluations by set, times,
    conflicts, best, config; None if it has not finished training."""
    d = os.path.join(KEEP, base, run_id)
    if not os.path.isfile(os.path.join(d, "metrics.jsonl")):
        return None
    rows = [r for _, r in read_jsonl(os.path.join(d, "metrics.jsonl"))]
    evals = {f[5:-5]: runs.read_json(os.path.join(d, f)) for f in sorted(os.listdir(d))
             if f.startswith("eval-") and f.endswith(".json")}
    files = {f: runs.read_json(os.path.join(d, f)) for f in ("times.json", "conflicts.json", "best.json", "config.json",
                                                             "diverged.json", "host.json")
             if os.path.isfile(os.path.join(d, f))}
    return {"rl": [r for r in rows if r.get("phase") == "rl"], "evals": evals, **files}


def trailing(vals, n):
    """Trailing means over n steps (the first n - 1 over what there is)."""
    return [statistics.fmean(vals[max(0, i - n + 1):i + 1]) for i in range(len(vals))]


def collapse_step(rows, diverged=None):
    """The first RL step at which the trailing-10-step formatting reward is >= 2 points below its mean
    over the first 10 RL steps while the trailing-10-step entropy is above ln 2; None if never.
    diverged: {"step": n} of a run that train.py stopped on consecutive non-finite losses, which
    collapsed at step n unless the rule found an earlier step."""
    fmt, ent = [r["rewards/format"] for r in rows], [r["entropy"] for r in rows]
    if len(fmt) < 2 * COLLAPSE_WINDOW:
        return diverged and diverged["step"]
    start = statistics.fmean(fmt[:COLLAPSE_WINDOW])
    for r, f, h in zip(rows, trailing(fmt, COLLAPSE_WINDOW), trailing(ent, COLLAPSE_WINDOW)):
        if r["step"] - rows[0]["step"] >= COLLAPSE_WINDOW and f <= start - COLLAPSE_DROP and h > math.log(2):
            return r["step"]
    return diverged and diverged["step"]


def chosen_rung():
    """The first rung (in LADDER's order) whose pilot GRPO run collapsed, by the committed files;
    None while no finished pilot GRPO run has."""
    for name, _, _ in LADDER:
        d = load(f"pilot-{name}-grpo-s{PILOT_SEED}")
        if d is not None and collapse_step(d["rl"], d.get("diverged.json")) is not None:
            return name
    return None


def pilot_skipped(run_id):
    """A pilot rung after the chosen one is not run (the ladder stops at the first collapse)."""
    rung = chosen_rung()
    if rung is None or not run_id.startswith("pilot-"):
        return False
    names = [name for name, _, _ in LADDER]
    return names.index(run_id.split("-")[1]) > names.index(rung)


def earlier_rungs_pending(run_id):
    """A pilot run of a rung whose earlier rungs' GRPO runs have not all finished: whether it runs at
    all (pilot_skipped) is not known yet."""
    if not run_id.startswith("pilot-"):
        return False
    names = [name for name, _, _ in LADDER]
    return any(load(f"pilot-{name}-grpo-s{PILOT_SEED}") is None for name in names[:names.index(run_id.split("-")[1])])
