"""Entry point of group ``vllm.general_plugins``: vLLM calls :func:`register` in each of its processes.

Inert unless this process carries the recipe's exported settings
(``TRUE_ON_POLICY_SETTINGS``, :mod:`true_on_policy.config.settings`) that select a patch set
(:func:`patch_set`):

* ``platform: cpu`` -- vLLM-CPU. ``deterministic: true``: the consistent kernels inside vLLM's model
  code (``patches.apply_consistent("cpu")``); ``deterministic: false``: only the compatibility fixes
  verl's weight sync and the tiny models need (unpacked linear weights, head sizes outside 32..512),
  stock numerics otherwise (:func:`true_on_policy.vllm_adapter.patches.apply_compatibility`).
* ``platform: cuda`` + ``kernels: project`` + ``deterministic: true`` -- the same consistent kernels
  on vLLM's GPU model runner (``patches.apply_consistent("cuda")``): written, not run on a device.

Anything else (``kernels: engine`` on Ascend / CUDA, where the determinism plan pins the vendors'
kernels): this plugin does nothing.
"""

from __future__ import annotations

import logging
import sys
import traceback

logger = logging.getLogger("true_on_policy")


def patch_set(recipe) -> str | None:
    """Which patch set the exported settings ask for: "cpu", "cuda", or None (inert).

    The same switch as the training side's: ``Settings.consistent_kernels`` (the CPU platform also
    needs the compatibility fixes with the flag off)."""
    if recipe is None:
        return None
    if recipe.platform.cpu_backend:
        return str(recipe.platform)
    if recipe.platform.cuda and recipe.consistent_kernels:
        return str(recipe.platform)
    return None


def register() -> None:
    from true_on_policy.config import settings

    recipe = settings.current()
    device = patch_set(recipe)
    if device is None:
        return
    try:
        from true_on_policy.vllm_adapter import patches

        if recipe.platform.cpu_backend:
            patches.apply_compatibility()
            if recipe.consistent_kernels:
                patches.apply_consistent("cpu")
        else:
            patches.apply_consistent(device)
    except Exception:
        # vLLM logs plugin failures at a level users miss; a half-applied backend must not run.
        sys.stderr.write("true_on_policy: the vLLM plugin failed to apply:\n" + traceback.format_exc())
        raise
