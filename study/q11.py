"""Part 11 (Q11) of docs/study.md, one concern: does GTPO protect against collapse, on fresh seeds, every arm of a
seed from its one warm-up, one host kind. From study/plan.py's part q11 and the committed files: the declared power
calculation that fixed the number of seeds (power, seeds_needed), the declared rule for the project's default
(default_rule) and the answer a user reads (answer).
"""
import math

from study.plan import Q11_SEEDS, part

Q10_RATES = {"grpo": 6 / 8, "released": 2 / 8, "eq7": 1 / 8}  # Q10's observed collapse shares; eq7's 0 of 8 read as 1
SEED_CAP, TARGET_POWER, ALPHA = 16, 0.8, 0.05


def power(n, p_grpo, p_arm, alpha):
    """The paired exact test's power (verdicts.paired_exact_one_sided, GRPO's direction) over n seeds, each arm
    collapsing independently of the other given the seed at its rate: the chance the test rejects at `alpha`."""
    p10, p01 = p_grpo * (1 - p_arm), (1 - p_grpo) * p_arm          # GRPO only / the arm only
    q, pd, total = p10 / (p10 + p01), p10 + p01, 0.0
    for d in range(n + 1):
        p_d = math.comb(n, d) * pd ** d * (1 - pd) ** (n - d)
        for b in range(d // 2 + 1, d + 1):
            if sum(math.comb(d, x) for x in range(b, d + 1)) / 2 ** d <= alpha:
                total += p_d * math.comb(d, b) * q ** b * (1 - q) ** (d - b)
    return total


def seeds_needed(rates=Q10_RATES, cap=SEED_CAP):
    """The declared number of seeds: the fewest (from 8) at which the default's test, the harder of the two, reaches
    TARGET_POWER at Holm's first level (ALPHA / 2) for Q10's rates; the cap where none within it does."""
    return next((n for n in range(8, cap + 1) if power(n, rates["grpo"], rates["released"], ALPHA / 2)
                 >= TARGET_POWER), cap)


# docs/study.md part 11, "The default's rule": (γ 0.03 protects, the default protects) -> what the project does
RULE = {(True, False): "change",        # the default becomes Eq. 7 at γ 0.03
        (True, True): "keep, both",     # the default stays: it protects too
        (False, True): "keep, withdraw",  # the default stays; Q10's advice is withdrawn
        (False, False): "keep, unconfirmed"}  # the default stays; Q10's advice is not confirmed


def default_rule(eq7_protects, released_protects):
    """The declared rule's outcome for the project's default objective (RULE)."""
    return RULE[(bool(eq7_protects), bool(released_protects))]


def verdicts(p=None):
    """(Eq. 7 at γ 0.03's test row, the default's), Holm over the two; None until both have every seed."""
    from study.verdicts import test_rows
    p = p or part("q11")
    rows = test_rows(p, p.tests)
    if any("p" not in r or r["units"] < r["expected"] for r in rows):
        return None
    released, eq7 = rows                          # plan.q11_tests' order: the default, then γ 0.03
    return eq7, released


assert len(Q11_SEEDS) == seeds_needed(), "Q11_SEEDS must hold the declared power calculation's number of seeds"
