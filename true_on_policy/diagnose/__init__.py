"""Residual-logdiff diagnosis: the first op where training and rollout diverge."""
