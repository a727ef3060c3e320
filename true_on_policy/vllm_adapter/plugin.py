"""Entry point of group ``vllm.general_plugins``: vLLM calls :func:`register` in each of its processes.

Inert unless this process carries the recipe's exported settings
(``TRUE_ON_POLICY_SETTINGS``, :mod:`true_on_policy.config.settings`) with ``platform: cpu``:

* ``deterministic: true`` -- the consistent kernels inside vLLM's model code
  (:func:`true_on_policy.vllm_adapter.patches.apply_consistent`);
* ``deterministic: false`` -- only the compatibility fixes verl's weight sync and the tiny
  models need (unpacked linear weights, head sizes outside 32..512), stock numerics otherwise
  (:func:`true_on_policy.vllm_adapter.patches.apply_compatibility`).

On Ascend/CUDA the determinism plan pins the vendors' kernels; this plugin does nothing there.
"""

from __future__ import annotations

import logging
import sys
import traceback

logger = logging.getLogger("true_on_policy")


def register() -> None:
    from true_on_policy.config import settings

    recipe = settings.current()
    if recipe is None or recipe.platform != "cpu":
        return
    try:
        from true_on_policy.vllm_adapter import patches

        patches.apply_compatibility()
        if recipe.deterministic:
            patches.apply_consistent()
    except Exception:
        # vLLM logs plugin failures at a level users miss; a half-applied backend must not run.
        sys.stderr.write("true_on_policy: the vLLM plugin failed to apply:\n" + traceback.format_exc())
        raise
