"""verl's patched internals: one list for verl 0.9.1, each target checked when its patch is installed,
a changed or missing target refused by name (in a fresh Python and next to vLLM:
tests/engine/test_patches_engine.py; a run whose launch hook did not run fails at start:
tests/e2e/test_patches_e2e.py)."""

from __future__ import annotations

import importlib.metadata
import sys
import types
from pathlib import Path

import pytest

from true_on_policy import patching
from true_on_policy.config.settings import ENV_VAR, Settings, SettingsNotExported
from true_on_policy.patching import Patch, PatchTargetChanged, Target
from true_on_policy.verl_adapter import launch, patches

REPO = Path(__file__).resolve().parents[2]

# Every verl symbol true_on_policy patches or reaches into, for verl 0.9.1 (written out here, not
# read from patches.py, so adding a patch without listing it fails this test).
PATCHED_IN_VERL_0_9_1 = {
    "verl.utils.device.auto_set_device",
    "verl.trainer.ppo.v1.trainer_base.PPOTrainer.__init__",
    "verl.trainer.ppo.v1.trainer_base.PPOTrainer._balance_batch",
    "verl.trainer.ppo.v1.trainer_base.PPOTrainer._compute_old_log_prob",
    "verl.trainer.ppo.v1.trainer_base.PPOTrainer._compute_advantage",
    "verl.trainer.ppo.v1.trainer_base.PPOTrainer._add_prompts_to_generate",
    "verl.trainer.ppo.v1.trainer_base.PPOTrainer._save_checkpoint",
    "verl.trainer.ppo.v1.trainer_base.PPOTrainer._load_checkpoint",
    "verl.utils.distributed.initialize_global_process_group_ray",
    "verl.workers.engine.fsdp.transformer_impl.logprobs_from_logits",
    "verl.utils.ulysses.get_ulysses_sequence_parallel_group",
    "verl.workers.rollout.base.get_rollout_class",
    "verl.workers.rollout.base._ROLLOUT_REGISTRY",
    "verl.workers.rollout.vllm_rollout.vllm_rollout.ServerAdapter.__init__",
    "verl.workers.rollout.vllm_rollout.utils.vLLMColocateWorkerExtension._get_zmq_handle",
}
# Their modules import vLLM (seconds): checked in the vllm-marked test of tests/engine/test_patches_engine.py.
VLLM_WEIGHT_SYNC_TARGETS = {
    "verl.workers.rollout.vllm_rollout.vllm_rollout.ServerAdapter.__init__",
    "verl.workers.rollout.vllm_rollout.utils.vLLMColocateWorkerExtension._get_zmq_handle",
}


def test_every_patched_verl_symbol_is_listed_and_matches_verl_0_9_1():
    assert importlib.metadata.version("verl") == patches.VERL_VERSION == "0.9.1"
    assert set(patches.TARGETS) == PATCHED_IN_VERL_0_9_1
    for target in sorted(PATCHED_IN_VERL_0_9_1 - VLLM_WEIGHT_SYNC_TARGETS):
        patches.check_target(target)  # exists, and its parameters are the ones the patch was written for


def test_no_module_outside_patches_reassigns_a_verl_attribute():
    """The patch sites live in patches.py: elsewhere no ``<verl module>.<name> = ...`` and no registry write."""
    offenders = []
    for path in sorted((REPO / "true_on_policy").rglob("*.py")):
        if path.name == "patches.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#")[0]
            if "_ROLLOUT_REGISTRY[" in code or "._engines" in code or ".__self__" in code:
                offenders.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
            for name in ("auto_set_device", "initialize_global_process_group_ray", "logprobs_from_logits"):
                if f".{name} =" in code:
                    offenders.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert offenders == []


def test_a_changed_signature_is_refused_naming_target_and_change():
    def auto_set_device(config, device_hint):  # what a verl upgrade could do
        return None

    with pytest.raises(PatchTargetChanged) as refused:
        patches.check_target("verl.utils.device.auto_set_device", auto_set_device)
    message = str(refused.value)
    assert "verl.utils.device.auto_set_device" in message
    assert "('config',)" in message and "('config', 'device_hint')" in message


def _library(monkeypatch) -> types.ModuleType:
    """A stand-in for another library's module: a function, a class with a method and a staticmethod."""
    library = types.ModuleType("stand_in_library")

    def scale(x, factor):
        return x * factor

    class Layer:
        def forward(self, x):
            return x + 1

        @staticmethod
        def norm(x):
            return x

    library.scale, library.Layer = scale, Layer
    monkeypatch.setitem(sys.modules, library.__name__, library)
    return library


def test_a_set_with_one_changed_target_applies_nothing(monkeypatch):
    library = _library(monkeypatch)
    scale, forward = library.scale, library.Layer.forward
    unchanged = Target(library.__name__, "scale", ("x", "factor"), written_for="stand-in 1.0")
    changed = Target(library.__name__, "Layer.forward", ("self", "x", "mask"), written_for="stand-in 1.0")
    with pytest.raises(PatchTargetChanged) as refused:
        patching.apply([Patch(unchanged, lambda x, factor: 0), Patch(changed, lambda self, x, mask: 0)])
    message = str(refused.value)
    assert "stand_in_library.Layer.forward" in message and "stand-in 1.0" in message
    assert "('self', 'x', 'mask')" in message and "('self', 'x')" in message  # expected and found
    assert library.scale is scale and library.Layer.forward is forward  # the first target too is left alone
    missing = Target(library.__name__, "Layer.backward", ("self", "x"))
    with pytest.raises(PatchTargetChanged, match=r"stand_in_library\.Layer\.backward: .*Layer has no attribute 'backward'"):
        patching.apply([Patch(unchanged, lambda x, factor: 0), Patch(missing, lambda self, x: 0)])
    assert library.scale is scale
    # the twin: both targets as written, both applied
    with patching.apply([Patch(unchanged, lambda x, factor: 0), Patch(Target(library.__name__, "Layer.forward",
                                                                            ("self", "x")), lambda self, x: 0)]):
        assert library.scale(3, 2) == 0 and library.Layer().forward(3) == 0


def test_revert_puts_back_what_was_there(monkeypatch):
    library = _library(monkeypatch)
    scale, forward, norm = library.scale, library.Layer.forward, library.Layer.__dict__["norm"]
    subclass = type("SubLayer", (library.Layer,), {})

    def doubling(original):
        def scale(x, factor):
            return 2 * original(x, factor)

        return scale

    applied = patching.apply([
        Patch(Target(library.__name__, "scale", ("x", "factor")), make=doubling),
        Patch(Target(library.__name__, "Layer.norm", ("x",)), lambda x: -x),
        Patch(Target(library.__name__, "Layer.forward", ("self", "x")), lambda self, x: x - 1, owner=subclass),
    ])
    assert library.scale(3, 2) == 12 and library.Layer.norm(5) == -5 and library.Layer().norm(5) == -5
    assert subclass().forward(3) == 2 and library.Layer().forward(3) == 4  # installed on the subclass only
    assert patching.is_replacement(library.scale) and library.scale.__wrapped__ is scale
    assert patching.original_of(library.scale) is scale and not patching.is_replacement(scale)
    # a patched target is checked through what it replaced; a second layer reverts to the first
    with patching.apply([Patch(Target(library.__name__, "scale", ("x", "factor")), make=doubling)]):
        assert library.scale(3, 2) == 24
    assert library.scale(3, 2) == 12
    applied.revert()
    assert library.scale is scale and library.Layer.__dict__["norm"] is norm and library.Layer.forward is forward
    assert "forward" not in vars(subclass)  # inherited again, not a copy of the original
    applied.revert()  # a second revert changes nothing
    assert library.scale is scale


def _passing_through(original):
    def wrapper(self, batch, metrics):
        return original(self, batch, metrics)

    return wrapper


def test_a_changed_trainer_method_is_refused_and_left_alone():
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    def _compute_advantage(self, batch, metrics, timing_raw):  # a parameter more than in verl 0.9.1
        return batch

    twin = type("ChangedTrainer", (PPOTrainer,), {"_compute_advantage": _compute_advantage})
    with pytest.raises(PatchTargetChanged, match=r"PPOTrainer\._compute_advantage: its parameters changed"):
        patches.wrap_trainer_method(twin, "_compute_advantage", _passing_through)
    assert twin._compute_advantage is _compute_advantage
    # the twin of the twin: verl's own method is accepted
    accepted = type("SameTrainer", (PPOTrainer,), {})
    patches.wrap_trainer_method(accepted, "_compute_advantage", _passing_through)
    assert patching.is_replacement(accepted._compute_advantage)


def test_a_missing_launch_hook_target_is_refused_by_name():
    renamed = types.ModuleType("verl.utils.device")
    renamed.auto_set_device_for = lambda config: None  # verl renamed the function
    with pytest.raises(PatchTargetChanged, match="verl.utils.device has no attribute 'auto_set_device'"):
        patches.install_launch_hook(lambda config: None, device_module=renamed)

    present = types.ModuleType("verl.utils.device")
    calls = []
    present.auto_set_device = lambda config: calls.append(("verl", config))
    patches.install_launch_hook(lambda config: calls.append(("hook", config)), device_module=present)
    present.auto_set_device("cfg")
    assert calls == [("hook", "cfg"), ("verl", "cfg")]


def test_the_trainer_start_check_refuses_a_recipe_config_without_exported_settings(monkeypatch):
    from omegaconf import OmegaConf

    config = OmegaConf.create({"true_on_policy": {"delta": 0.01}, "algorithm": {"adv_estimator": "gae"}})
    monkeypatch.delenv(ENV_VAR, raising=False)
    with pytest.raises(SettingsNotExported, match="launch hook did not run"):
        launch.trainer_start_check(config)
    # a loss named without the section is the recipe too
    named = OmegaConf.create({"actor_rollout_ref": {"actor": {"policy_loss": {"loss_mode": "flashreinforce"}}}})
    with pytest.raises(SettingsNotExported):
        launch.trainer_start_check(named)
    # the twins: a plain verl config is none of our business; exported settings pass
    launch.trainer_start_check(OmegaConf.create({"algorithm": {"adv_estimator": "gae"}}))
    monkeypatch.setenv(ENV_VAR, Settings(platform="cpu").to_json())
    launch.trainer_start_check(config)


# ------------------------------------------------------------------ the vLLM weight-sync socket
def _verl_0_9_1_address(job_id: str) -> str:
    """verl 0.9.1's weight-sync address of replica 0, rank 0 (vllm_rollout.py:141, utils.py:431)."""
    return f"ipc:///tmp/rl-colocate-zmq-{job_id}-replica-0-rank-0.sock"


def test_a_weight_sync_address_without_the_launch_name_or_in_another_form_is_refused(monkeypatch):
    monkeypatch.delenv(patches.WEIGHT_SYNC_RUN_ENV, raising=False)
    with pytest.raises(RuntimeError, match=f"{patches.WEIGHT_SYNC_RUN_ENV} is not set"):
        patches.launch_socket(_verl_0_9_1_address("01000000"))
    monkeypatch.setenv(patches.WEIGHT_SYNC_RUN_ENV, "123-abc")
    with pytest.raises(PatchTargetChanged, match="'tcp://127.0.0.1:5555', not ipc:///tmp/rl-colocate-zmq-"):
        patches.launch_socket("tcp://127.0.0.1:5555")
    assert patches.launch_socket(_verl_0_9_1_address("01000000")) == (
        "ipc:///tmp/rl-colocate-zmq-123-abc-01000000-replica-0-rank-0.sock")
