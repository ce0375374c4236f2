"""The rows of docs/results.md's opening table, one concern: each question's claim and the setting it was tested in,
written here; where its verdict and outcome come from (a Test of study/plan.py's part, or the part's section rule,
and a study/report.py function). study/report.py computes the rest from the committed runs."""
from dataclasses import dataclass

from study.plan import FIG2


@dataclass
class Answer:
    """A row of docs/results.md's opening table (study.report.answer_lines): the question, the paper's claim and
    the setting it was tested in, written here; the verdict and what a user sees, computed. verdict: (label,
    claim, metric) of a Test of `part` -- its row, Holm included -- or a str, the key of the part's section
    rule; outcome: the study.report function that describes `arms` on the evaluation set `evals`."""
    q: str
    claim: str
    setting: str
    part: str
    verdict: object
    arms: tuple = ()
    evals: str = "id"
    outcome: str = "pass1_outcome"
    names: tuple = None               # A and B in the verdict, where the test itself calls them "A" and "B"


MAIN_SETTING = "20 RL steps after a 4-step SFT warm-up; ⟨H⟩_ini 1.3–1.6 > ln 2, so no filter; 3 seeds"
LONG_SETTING = "200 steps after a 32-step warm-up; ⟨H⟩_ini < ln 2, filter on; 8 seeds"
RUNG_SETTING = "100 steps at a constant lr 2e-3 on arithmetic-hard (where GRPO collapses)"
ANSWERS = [
    Answer("Q1", FIG2, MAIN_SETTING + " × 2 Adam settings", "main", ("Q1", FIG2 + ", seeds as units", "id"),
           ("gtpo-a6", "grpo-a6"), names=("GTPO", "GRPO")),
    Answer("Q2", "(no claim) GTPO's edge the same under both Adam settings", MAIN_SETTING, "main",
           ("Q2", "(no claim) GTPO's edge the same under both Adam settings", "id"), ("gtpo-a6", "gtpo-a9"),
           names=("edge at β 0.999999", "edge at (0.9, 0.95)")),
    Answer("Q3", "GTPO above SFT (Fig. 2-3, Sec. 6)", MAIN_SETTING, "main", ("Q3", "GTPO above SFT (Fig. 2-3, Sec. 6)",
                                                                            "id"), ("gtpo-a6", "sft"),
           names=("GTPO", "SFT")),
    Answer("Q4", "GRPO collapses over a long horizon, GTPO does not (Fig. 1)", LONG_SETTING.replace("8 seeds", "2 seeds"),
           "long", "collapse", ("gtpo-long", "grpo-long")),
    Answer("Part 3", "GRPO collapses more often than GTPO (Fig. 1)", RUNG_SETTING + "; 5 seeds", "collapse",
           ("Part 3", "GRPO collapses more often than GTPO", "collapsed"), ("collapse-gtpo", "collapse-grpo"), "rung"),
    Answer("Q5", "conflict tokens are mostly format tokens (Sec. 4.1)", "the main part's 12 GTPO and GRPO β=0 runs",
           "q5", "conflicts", outcome="conflict_outcome"),
    Answer("Q6", "GRPO collapses more often than GTPO with Eq. 7 as written", RUNG_SETTING + "; 8 seeds", "q6",
           ("Q6", "GRPO collapses more often than GTPO with Eq. 7", "collapsed"), ("q6-gtpo", "q6-grpo"), "rung"),
    Answer("Q7", "GTPO (Eq. 7 as written) above GRPO β=0 where the model learns (Fig. 2)", LONG_SETTING, "q7",
           ("Q7", "GTPO above GRPO", "id"), ("q7-gtpo", "q7-grpo")),
    Answer("Q8", "GTPO above GRPO β=0: the released entropy term, or γ = 0", LONG_SETTING + " (Q7's runs beside)", "q8",
           ("Q8", "released − GRPO", "id"), ("q7-released", "q8-nogamma", "q7-grpo", "q7-gtpo")),
    Answer("Q9", "RL raises pass@1 above the SFT warm-up it starts from (RL fine-tuning's premise)",
           LONG_SETTING + "; the warm-ups evaluated", "q9", "q9",
           ("warmup-q9", "q7-released", "q7-grpo", "q7-gtpo", "q8-nogamma"), outcome="gain_outcome"),
    Answer("Q10", "(no claim on γ at this scale; Fig. 4 sweeps it) a γ for Eq. 7 that protects as in Q6 and costs "
           "nothing as in Q7; does the default protect", RUNG_SETTING + " and " + LONG_SETTING + "; γ 0.01, then one "
           "declared step", "q10", "q10", outcome="q10_outcome"),
    Answer("Q11", "GRPO collapses more often than GTPO (Fig. 1): the default, and Eq. 7 at γ 0.03, on fresh seeds",
           RUNG_SETTING + "; 16 fresh seeds, one warm-up per seed shared by the three arms, one host kind", "q11",
           "q11", outcome="q11_outcome"),
]
