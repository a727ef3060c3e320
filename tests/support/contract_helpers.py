"""Shapes the tests build a plan, a contract or an invariant check from (not the package's API:
the package reads a config once, through ``true_on_policy.config.launch.read_launch``)."""

from __future__ import annotations

import dataclasses
import importlib

from true_on_policy.config.invariants import check_invariants
from true_on_policy.config.launch import ROW_PARALLEL_NONE, ROW_PARALLEL_RS_AG, read_algorithm, read_sides
from true_on_policy.config.settings import Settings
from true_on_policy.contract import consistency, determinism_plan
from true_on_policy.contract.stack_versions import Versions, resolve_versions
from true_on_policy.kernels.architectures import inspect_checkpoint


def versions_for(settings, detected=None):
    return resolve_versions(settings.platform, declared=dict(settings.stack_versions), detected=detected)


def plan_for_config(config, settings, *, detected=None, importer=importlib.import_module):
    """The plan of a resolved config and its parsed section; ``detected``: installed versions."""
    return determinism_plan.plan(settings, read_sides(config), versions_for(settings, detected), importer=importer)


def contract_for_config(config, settings, *, plan=None, detected=None):
    """The contract of a resolved config and of its model's config.json; the plan computed unless given."""
    sides = read_sides(config)
    if plan is None:
        plan = determinism_plan.plan(settings, sides, versions_for(settings, detected))
    return consistency.build_contract(settings, sides, plan, checkpoint=inspect_checkpoint(sides.training.model_path))


def plan_of(deterministic, platform, *, training_strategy, rollout_name, versions=None, row_parallel=None,
            moe_router_dtype=None, moe_dispatcher=None, kernels=None, importer=importlib.import_module):
    """The plan for two engines named by hand: the settings and the views of a config with just them."""
    settings = Settings(deterministic=deterministic, platform=platform, kernels=kernels,
                        moe_router_dtype=moe_router_dtype, moe_dispatcher=moe_dispatcher)
    actor = {"strategy": training_strategy}
    if row_parallel not in (None, ROW_PARALLEL_NONE):
        assert training_strategy == "megatron", "a row-parallel reduction needs a TP>1 Megatron training side"
        sequence_parallel = row_parallel == ROW_PARALLEL_RS_AG
        actor["megatron"] = {"tensor_model_parallel_size": 2, "sequence_parallel": sequence_parallel}
    config = {
        "actor_rollout_ref": {"actor": actor, "rollout": {"name": rollout_name, "tensor_model_parallel_size": 1},
                              "model": {"path": "model"}},
        "trainer": {"nnodes": 1, "n_gpus_per_node": 1},
    }
    if not isinstance(versions, Versions):
        versions = resolve_versions(platform, detected=dict(versions) if versions is not None else None)
    return determinism_plan.plan(settings, read_sides(config), versions, importer=importer)


def enforce_invariants(config, relax=()):
    """Raise one ValueError listing every violation, each with its key, expectation and relax hint."""
    violations = check_invariants(read_algorithm(config).found, relax)
    if violations:
        lines = "\n".join(f"  - {violation}" for violation in violations)
        raise ValueError(f"the config breaks {len(violations)} FlashREINFORCE invariant(s):\n{lines}")


def apply_in_process(plan):
    """Run the plan's in-process calls in this process; what was done."""
    if not plan.deterministic:
        return []
    return determinism_plan.run_in_process_calls(plan.platform, plan.in_process)


def replace_row(contract, field, **changes):
    """A copy of ``contract`` with one row changed and judged again (``training=``/``rollout=`` may be plain values)."""
    rows = []
    for row in contract.rows:
        if row.field == field:
            for side in ("training", "rollout"):
                if side in changes and not isinstance(changes[side], consistency.Side):
                    changes[side] = consistency.Side(changes[side], getattr(row, side).source)
            row = consistency.judged(dataclasses.replace(row, **changes), contract.deterministic)
        rows.append(row)
    return dataclasses.replace(contract, rows=tuple(rows))
