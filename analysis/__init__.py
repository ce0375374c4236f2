"""Views of a run, for reading what GTPO did; nothing here changes training.

    conflicts.py  which tokens fall in conflict spans (counted while training), a group drawn like Fig. 9
    plots.py      eval.py's figures: pass@k curves, training curves, --render of a logged group
    drift.py      a run's KL to its start at each checkpoint (eval.py --drift)
"""
