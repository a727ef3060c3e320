"""What verl 0.9.1's checkpoint does not hold, saved and restored with it.

verl's ``global_step_N/`` holds the model, optimizer, scheduler, workers' RNG, the dataloader
position and (async) TransferQueue. Rollout seeds and the canonical batch order are functions of
the policy version, the prompt and the tokens: nothing to save. The async sampler's prompt ledger
is saved here as ``global_step_N/true_on_policy_sampler.pt`` (any replay buffer with
``state_dict()`` / ``load_state_dict``), written *before* verl writes
``latest_checkpointed_iteration.txt`` and read right after verl's ``_load_checkpoint``.
"""

from __future__ import annotations

import functools
import logging
import os

import torch

logger = logging.getLogger(__name__)

SAMPLER_STATE_FILE = "true_on_policy_sampler.pt"


def step_folder(trainer) -> str:
    """The ``global_step_N`` folder verl's ``_save_checkpoint`` writes for the current step."""
    return os.path.join(trainer.config.trainer.default_local_dir, f"global_step_{trainer.global_steps}")


def resumed_folder(trainer) -> str | None:
    """The ``global_step_N`` folder verl's ``_load_checkpoint`` just loaded, or None (a fresh start)."""
    from verl.utils.checkpoint.checkpoint_manager import find_latest_ckpt_path

    if trainer.global_steps == 0:
        return None
    config = trainer.config.trainer
    if config.resume_mode == "resume_path":
        folder = config.resume_from_path
    else:
        folder = find_latest_ckpt_path(os.path.abspath(config.default_local_dir))
    return folder if os.path.isabs(folder) else os.path.join(os.getcwd(), folder)


def save_sampler_state(trainer, folder: str) -> str | None:
    sampler = trainer.replay_buffer
    if not hasattr(sampler, "state_dict"):
        return None
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, SAMPLER_STATE_FILE)
    torch.save(sampler.state_dict(), path + ".tmp")
    os.replace(path + ".tmp", path)  # a SIGTERM leaves the old file or the new one, never half of one
    return path


def load_sampler_state(trainer, folder: str) -> str | None:
    sampler = trainer.replay_buffer
    if not hasattr(sampler, "load_state_dict"):
        return None
    path = os.path.join(folder, SAMPLER_STATE_FILE)
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"resuming from {folder} with {type(sampler).__name__}, but the checkpoint has no {SAMPLER_STATE_FILE}: "
            "without the prompt ledger the sampler cannot keep every prompt exactly once per epoch across the "
            "resume. The checkpoint was written without the true_on_policy plugin; start from scratch "
            "(trainer.resume_mode=disable) or from a checkpoint that has the file."
        )
    sampler.load_state_dict(torch.load(path, weights_only=False))
    return path


def patch_trainer_checkpoint_recipe_state(trainer_cls) -> None:
    """Wrap verl's ``PPOTrainer._save_checkpoint`` / ``_load_checkpoint`` to carry the recipe's state.

    A verl-internal patch, through :mod:`.patches` (which checks both originals' signatures).
    """
    from true_on_policy.verl_adapter import patches

    def saving(save):
        def save_checkpoint_with_recipe_state(self):
            path = save_sampler_state(self, step_folder(self))
            if path is not None:
                logger.info("saved the sampler's prompt ledger to %s", path)
            return save(self)

        return save_checkpoint_with_recipe_state

    def loading(load):
        def load_checkpoint_with_recipe_state(self):
            result = load(self)
            folder = resumed_folder(self)
            if folder is not None:
                path = load_sampler_state(self, folder)
                if path is not None:
                    logger.info("restored the sampler's prompt ledger from %s", path)
            return result

        return load_checkpoint_with_recipe_state

    patches.wrap_trainer_method(trainer_cls, "_save_checkpoint", saving)
    patches.wrap_trainer_method(trainer_cls, "_load_checkpoint", loading)


@functools.cache
def install() -> None:
    """:func:`patch_trainer_checkpoint_recipe_state` on verl's PPOTrainer when its module is imported (only the
    process that runs the trainer imports it)."""
    from true_on_policy.verl_adapter import patches

    patches.when_imported(patches.TRAINER_MODULE,
                          lambda module: patch_trainer_checkpoint_recipe_state(module.PPOTrainer))
