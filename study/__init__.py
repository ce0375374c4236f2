"""The CPU-scale study (docs/study.md): run.py runs the plan, report.py computes the report; the
folders beside them hold each run's committed files."""
