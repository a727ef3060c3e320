"""The recipe state verl's checkpoint does not hold: saved, restored, refused when missing (no Ray)."""

import pytest

from true_on_policy.rollout.prompt_ledger import PromptLedger
from true_on_policy.verl_adapter import resume

from test_async_sampler import _sampler


class _Trainer:
    def __init__(self, replay_buffer):
        self.replay_buffer = replay_buffer


def _ledger_mid_epoch():
    ledger = PromptLedger(prompts_per_epoch=3)
    for i, prompt in enumerate([10, 11, 12]):
        ledger.dispatched(f"u{i}", prompt, dispatch_step=1, now=0.0)
    ledger.completed("u0", 0, 0)
    ledger.completed("u1", 0, 0)
    ledger.take_batch(2, learner_step=1)
    return ledger


def test_the_ledger_survives_a_checkpoint_and_keeps_counting_the_epoch(tmp_path):
    sampler = _sampler()
    sampler.ledger = _ledger_mid_epoch()
    resume.save_sampler_state(_Trainer(sampler), str(tmp_path))
    restored = _sampler()
    resume.load_sampler_state(_Trainer(restored), str(tmp_path))
    ledger = restored.ledger
    assert ledger.delivery_log == sampler.ledger.delivery_log
    # The next fresh dispatch opens epoch 1 (3 prompts per epoch); prompt 10 again in epoch 0 would be an error.
    assert ledger.dispatched("u3", 10, dispatch_step=2, now=0.0).epoch == 1
    ledger.check_invariants()


def test_twin_a_fresh_ledger_after_a_resume_loses_the_epoch(tmp_path):
    # Without the saved state the resumed sampler starts a new ledger: prompt 10, delivered at step 1,
    # would be numbered epoch 0 again and a duplicate within epoch 0 could not be told apart.
    fresh = PromptLedger(prompts_per_epoch=3)
    assert fresh.dispatched("u3", 10, dispatch_step=2, now=0.0).epoch == 0
    assert fresh.delivery_log == []  # and the deliveries of steps before the resume are gone


def test_a_checkpoint_without_the_sampler_state_is_refused_by_name(tmp_path):
    with pytest.raises(FileNotFoundError, match=resume.SAMPLER_STATE_FILE):
        resume.load_sampler_state(_Trainer(_sampler()), str(tmp_path))


def test_replay_buffers_without_state_are_left_alone(tmp_path):
    assert resume.save_sampler_state(_Trainer(object()), str(tmp_path)) is None
    assert resume.load_sampler_state(_Trainer(object()), str(tmp_path)) is None


def test_the_patch_refuses_a_changed_verl_signature():
    class ChangedTrainer:
        def _save_checkpoint(self, tag):
            pass

        def _load_checkpoint(self):
            pass

    with pytest.raises(RuntimeError, match=r"_save_checkpoint.*\('self', 'tag'\)"):
        resume.patch_trainer_checkpoint_recipe_state(ChangedTrainer)


def test_the_patch_fits_verls_trainer():
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    class Trainer(PPOTrainer):
        pass

    resume.patch_trainer_checkpoint_recipe_state(Trainer)
    assert Trainer._save_checkpoint.__wrapped__ is PPOTrainer._save_checkpoint
