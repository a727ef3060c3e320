"""The trainer hooks of :mod:`true_on_policy.verl_adapter.trainer_hooks`, on an in-memory stand-in
for the TransferQueue.

A real TransferQueue needs Ray (its controller and storage units are Ray actors): about 15-20 s to start
on the project's CPU machines, too slow for the fast suite, so the real one is exercised by the e2e
tests (tests/test_behaviour_log_probs_e2e.py). The stand-in reproduces what those hooks rely on, as
observed on TransferQueue 0.1.11: fields come back as jagged nested tensors of each sample's own length,
a requested field that is absent is silently left out of the result, and ``kv_batch_put`` returns a
meta whose ``fields`` lists every field now stored for the samples.
"""

import math
import types

import pytest
import torch
from tensordict import TensorDict

from true_on_policy import settings as settings_module
from true_on_policy.flashreinforce import entropy_filter
from true_on_policy.verl_adapter import flashreinforce_registration, trainer_hooks


def nested(rows):
    return torch.nested.as_nested_tensor(list(rows), layout=torch.jagged)


class FakeTransferQueue:
    def __init__(self):
        self.samples: dict[tuple[str, str], dict[str, torch.Tensor]] = {}

    def put_rows(self, keys, partition_id, **fields):
        for index, key in enumerate(keys):
            sample = self.samples.setdefault((partition_id, key), {})
            for name, rows in fields.items():
                sample[name] = rows[index].clone()

    def kv_batch_get(self, keys, partition_id, select_fields=None):
        samples = [self.samples[(partition_id, key)] for key in keys]
        names = select_fields if select_fields is not None else sorted(samples[0])
        present = [name for name in names if all(name in sample for sample in samples)]
        if not present:
            return TensorDict({}, batch_size=[0])
        fields = {name: nested(sample[name] for sample in samples) for name in present}
        return TensorDict(fields, batch_size=[len(keys)])

    def kv_batch_put(self, keys, partition_id, fields):
        assert fields.batch_size[0] == len(keys)
        for name in fields.keys():
            self.put_rows(keys, partition_id, **{name: fields[name].unbind(0)})
        stored = sorted(set().union(*(self.samples[(partition_id, key)] for key in keys)))
        return types.SimpleNamespace(keys=list(keys), partition_id=partition_id, fields=stored)

    def row(self, key, field, partition_id="train"):
        return self.samples[(partition_id, key)][field]


KEYS = ["u0_0_0", "u1_0_0", "u2_0_0", "u3_0_0", "pad_0_0"]
LENGTHS = [5, 3, 4, 1, 1]
RESPONSE_MASKS = [torch.ones(n, dtype=torch.int64) for n in LENGTHS[:-1]] + [torch.zeros(1, dtype=torch.int64)]
ENTROPIES = [
    torch.tensor([0.3, 0.9, 0.1, 0.9, 0.5]),
    torch.tensor([0.2, 0.4, 0.6]),
    torch.tensor([0.7, 0.7, 0.7, 0.7]),
    torch.tensor([1.5]),
    torch.tensor([0.0]),
]
# sequence rewards 0.0, 1.0, 0.25, 0.0 (and the padding sample's zeroed score), on the last token
REWARDS = [0.0, 1.0, 0.25, 0.0, 0.0]
SCORES = [torch.zeros(n).index_fill(0, torch.tensor([n - 1]), r) for n, r in zip(LENGTHS, REWARDS)]


def filled_queue():
    tq = FakeTransferQueue()
    tq.put_rows(
        KEYS,
        "train",
        response_mask=RESPONSE_MASKS,
        entropy=ENTROPIES,
        rm_scores=SCORES,
        rollout_log_probs=[-torch.arange(1, n + 1, dtype=torch.float32) / 10 for n in LENGTHS],
        old_log_probs=[torch.full((n,), -9.0) for n in LENGTHS],
    )
    return tq


def batch_meta(keys=KEYS):
    return types.SimpleNamespace(keys=list(keys), partition_id="train", fields=None)


# --- old_log_probs := rollout_log_probs -----------------------------------------------------------------


def test_old_log_probs_become_the_recorded_rollout_log_probs():
    tq = filled_queue()
    trainer_hooks.use_rollout_log_probs_as_old(batch_meta(), tq)
    for key in KEYS:
        assert torch.equal(tq.row(key, "old_log_probs"), tq.row(key, "rollout_log_probs"))


def test_missing_rollout_log_probs_are_an_error_naming_the_setting():
    tq = FakeTransferQueue()
    tq.put_rows(["a"], "train", old_log_probs=[torch.zeros(2)])
    with pytest.raises(ValueError, match="calculate_log_probs=true"):
        trainer_hooks.use_rollout_log_probs_as_old(batch_meta(["a"]), tq)


# --- the entropy filter's mask ----------------------------------------------------------------------------


@pytest.mark.parametrize("threshold", [0.0, 0.25, -1.0])
def test_the_mask_is_the_pure_filter_of_entropies_and_failures(threshold):
    tq = filled_queue()
    metrics = {}
    meta = trainer_hooks.write_entropy_filter_mask(batch_meta(), tq, 0.5, threshold, metrics)
    assert flashreinforce_registration.FILTER_MASK_FIELD in meta.fields

    failed = torch.tensor([reward <= threshold for reward in REWARDS])  # inclusive threshold
    width = max(LENGTHS)
    padded_mask = torch.zeros(len(KEYS), width, dtype=torch.bool)
    padded_entropies = torch.zeros(len(KEYS), width)
    for row, (mask, entropy) in enumerate(zip(RESPONSE_MASKS, ENTROPIES)):
        padded_mask[row, : len(mask)] = mask.bool()
        padded_entropies[row, : len(entropy)] = entropy
    expected = entropy_filter(padded_mask, padded_entropies, failed, 0.5)
    for row, key in enumerate(KEYS):
        stored = tq.row(key, "rollout_is_weights")
        assert stored.dtype == torch.float32 and stored.shape == (LENGTHS[row],)  # the response's own length
        assert torch.equal(stored, expected[row, : LENGTHS[row]].float())
    assert tq.row("pad_0_0", "rollout_is_weights").tolist() == [0.0]  # verl's padding sample keeps nothing
    trajectories = failed[:-1]
    assert metrics[trainer_hooks.FAILED_FRACTION_METRIC] == pytest.approx(trajectories.float().mean().item())


def test_the_mask_for_a_concrete_batch():
    tq = filled_queue()
    trainer_hooks.write_entropy_filter_mask(batch_meta(), tq, 0.5, 0.0)
    # u0 failed (T=5): its ceil(2.5)=3 highest entropies, the tie at 0.9 in order, then 0.5
    assert tq.row("u0_0_0", "rollout_is_weights").tolist() == [0.0, 1.0, 0.0, 1.0, 1.0]
    assert tq.row("u1_0_0", "rollout_is_weights").tolist() == [1.0, 1.0, 1.0]  # succeeded
    assert tq.row("u2_0_0", "rollout_is_weights").tolist() == [1.0, 1.0, 1.0, 1.0]  # 0.25 > 0.0: succeeded
    assert tq.row("u3_0_0", "rollout_is_weights").tolist() == [1.0]  # failed, ceil(0.5) = 1


def test_the_hook_refuses_to_overwrite_importance_weights_verl_wrote():
    tq = filled_queue()
    tq.put_rows(KEYS, "train", rollout_is_weights=[torch.ones(n) for n in LENGTHS])
    with pytest.raises(ValueError, match="rollout_is=null"):
        trainer_hooks.write_entropy_filter_mask(batch_meta(), tq, 0.5, 0.0)


@pytest.mark.parametrize("field", ["entropy", "rm_scores"])
def test_missing_filter_inputs_are_named(field):
    tq = filled_queue()
    del tq.samples[("train", KEYS[2])][field]
    with pytest.raises(ValueError, match=rf"missing: \['{field}'\]"):
        trainer_hooks.write_entropy_filter_mask(batch_meta(), tq, 0.5, 0.0)


def test_non_finite_entropies_at_response_tokens_are_refused():
    tq = filled_queue()
    tq.samples[("train", KEYS[0])]["entropy"][2] = math.nan
    with pytest.raises(ValueError, match="entropies must be finite"):
        trainer_hooks.write_entropy_filter_mask(batch_meta(), tq, 0.5, 0.0)


def test_the_field_names_agree_with_the_loss():
    assert trainer_hooks.FILTER_MASK_FIELD == flashreinforce_registration.FILTER_MASK_FIELD
    assert trainer_hooks.FAILED_FRACTION_METRIC.startswith(flashreinforce_registration.METRIC_PREFIX)


# --- the installed trainer wrappers -------------------------------------------------------------------


class FakeTrainer:
    """Stands in for verl's v1 PPOTrainer: the two steps the hooks wrap, each returning a meta."""

    def __init__(self, tq):
        self.tq = tq
        self.calls = []

    def _compute_old_log_prob(self, batch, metrics):
        self.calls.append("old_log_prob")
        return batch

    def _compute_advantage(self, batch, metrics):
        self.calls.append("advantage")
        metrics["verl"] = 1.0
        return batch


def installed_trainer(tq):
    cls = type("Trainer", (FakeTrainer,), {})
    trainer_hooks.install_on(cls, tq)
    return cls(tq)


@pytest.mark.parametrize(
    ("settings", "writes_mask"),
    [
        (None, False),
        (settings_module.Settings(), False),
        (settings_module.Settings(negative_token_fraction=0.5), True),
    ],
)
def test_the_wrapped_steps(monkeypatch, settings, writes_mask):
    if settings is None:
        monkeypatch.delenv(settings_module.ENV_VAR, raising=False)
    else:
        monkeypatch.setenv(settings_module.ENV_VAR, settings.to_json())
    tq = filled_queue()
    trainer = installed_trainer(tq)
    metrics = {}
    trainer._compute_old_log_prob(batch_meta(), metrics)
    result = trainer._compute_advantage(batch_meta(), metrics)
    assert trainer.calls == ["old_log_prob", "advantage"]  # verl's own steps still run, first
    assert torch.equal(tq.row(KEYS[0], "old_log_probs"), tq.row(KEYS[0], "rollout_log_probs"))
    assert metrics["verl"] == 1.0
    stored = "rollout_is_weights" in tq.samples[("train", KEYS[0])]
    assert stored is writes_mask
    assert (trainer_hooks.FAILED_FRACTION_METRIC in metrics) is writes_mask
    if writes_mask:
        assert "rollout_is_weights" in result.fields  # the actor update is handed the meta with the field
