"""Views of a run, for reading what GTPO did; nothing here changes training.

    analysis/conflicts.py  which tokens fall in conflict spans (counted while training), a group drawn like Fig. 9
    analysis/plots.py      eval.py's figures: pass@k curves, training curves, --render of a logged group
    analysis/drift.py      a run's KL to its start at each checkpoint (eval.py --drift)
"""
