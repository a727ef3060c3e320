"""The `python -m true_on_policy` commands: check, logdiff, diagnose."""
