"""Residual-logdiff diagnosis: the first op where training and rollout diverge.

``first_divergence`` runs both paths and finds the op (:func:`diagnose`); ``capture`` records every
op's inputs and outputs per token; ``compare`` measures and classifies differences; ``report`` holds
the result, its table, JSON and plot; ``faults`` plants known faults for demos and tests.
"""

from true_on_policy.diagnose.faults import FAULTS, NEEDS_CONSISTENT_KERNELS, inject_fault, make_router_ties
from true_on_policy.diagnose.first_divergence import diagnose
from true_on_policy.diagnose.report import CATEGORIES, RULES, Divergence, OpRecord, Report

__all__ = [
    "CATEGORIES",
    "RULES",
    "FAULTS",
    "NEEDS_CONSISTENT_KERNELS",
    "Divergence",
    "OpRecord",
    "Report",
    "diagnose",
    "inject_fault",
    "make_router_ties",
]
