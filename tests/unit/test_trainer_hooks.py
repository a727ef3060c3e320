"""The trainer hooks of :mod:`true_on_policy.verl_adapter.trainer_hooks`, against the real TransferQueue.

One local Ray (the TQ controller and its storage unit are Ray actors) and one ``transfer_queue.init``
per module, configured the way verl's ``TaskRunnerV1.run`` does it (``config.transfer_queue.enable =
True``; ``tq.init(config.transfer_queue)``) on the recipe's own composed config (``configs/cpu_tiny``:
verl's ``transfer_queue.yaml`` with one storage unit). Each test writes its own step's batch into a
partition of its own, in the shapes verl writes it:

* the agent loop's ``kv_batch_put`` (verl/trainer/ppo/v1/agent_loop_tq.py): per-sample tensors of
  each sample's own length through verl's ``list_of_dict_to_tensordict`` (jagged nested tensors),
  the ``uid`` as non-tensor data, keys ``{uid}_{session_id}_{index}``, the agent loop's tags;
* verl's synthetic padding sample, made by verl's own ``upsample_batch_to_divisible_size``;
* ``old_log_probs`` and ``entropy`` of every sample, response-length nested, as verl's
  ``_compute_old_log_prob`` writes them.

The ``batch`` handed to the hooks is the ``KVBatchMeta`` the real ``kv_batch_put`` returns.

What the real queue does that the hooks rely on (TransferQueue 0.1.11): fields come back as jagged
nested tensors; a requested field that some or all of the samples lack is silently left out of the
result (and when no requested field is present the result is an empty TensorDict); ``kv_batch_put``
returns a ``KVBatchMeta`` whose ``fields`` lists every field now stored for the samples.

The installed wrappers (``install_on``) run on a subclass of verl's real v1 trainer class (the one
``get_trainer_cls(config.trainer.v1.trainer_mode)`` returns), created with ``object.__new__`` and given
only the recipe's config, so only steps verl can run without workers are exercised:

* ``_compute_advantage``: runs as verl wrote it (the recipe's ``flashreinforce`` estimator, rollout
  correction in decoupled mode), then the filter hook; tested here.
* ``_compute_old_log_prob``: NOT tested here. In the recipe's decoupled mode verl's step calls the actor
  worker group (``actor_rollout_wg.compute_log_prob``); the only worker-free path, bypass mode, makes
  the very copy the hook makes, so a test could not tell the hook ran.
* ``_balance_batch`` (the canonical order under ``deterministic``): NOT tested here. verl's step reads
  the actor worker group's dispatch info (``actor_rollout_wg._query_dispatch_info``).

Both hook functions those wrappers add (``use_rollout_log_probs_as_old``, ``canonical_order``) are tested
directly below; the wrappers themselves run inside verl's real trainer in tests/e2e/test_behaviour_log_probs_e2e.py
and tests/e2e/test_e2e_cpu_trainer.py.
"""

import copy
import itertools
import math
import random
import re
from pathlib import Path

import pytest
import ray
import torch
import transfer_queue
from tensordict import TensorDict
from transfer_queue import KVBatchMeta
from verl.trainer.ppo.padding_utils import upsample_batch_to_divisible_size
from verl.utils.tensordict_utils import list_of_dict_to_tensordict

from true_on_policy.config.settings import ENV_VAR, Settings, SettingsNotExported
from true_on_policy.cli.check import compose_config
from true_on_policy.loss.flashreinforce import entropy_filter
from true_on_policy.verl_adapter import flashreinforce_registration, trainer_hooks

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
EOS = 2

# --- the module's Ray + TransferQueue ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def config():
    """The recipe's cpu_tiny config, composed and resolved the way hydra.main composes it for main_ppo."""
    return compose_config(str(CONFIGS), "cpu_tiny")


@pytest.fixture(scope="module")
def tq(config):
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        config.transfer_queue.enable = True  # as TaskRunnerV1.run
        transfer_queue.init(config.transfer_queue)
        try:
            yield transfer_queue
        finally:
            transfer_queue.close()
    finally:
        ray.shutdown()


_partitions = itertools.count()


def new_partition() -> str:
    return f"train{next(_partitions)}"


def nested(rows):
    return torch.nested.as_nested_tensor(list(rows), layout=torch.jagged)


def rows(tq, batch, field) -> dict[str, torch.Tensor]:
    """``field`` of every sample of ``batch``, read back from the queue, by key."""
    data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=[field])
    assert field in data.keys(), f"{field} is not stored for every sample"
    return dict(zip(batch.keys, data[field].unbind(0)))


def agent_loop_put(tq, partition, samples):
    """One ``kv_batch_put`` shaped as verl's agent loop makes it; ``samples``: (key, prompt, response, fields)."""
    keys, fields, tags = [], [], []
    for key, prompt, response, extra in samples:
        prompts = torch.tensor(prompt, dtype=torch.int64)
        responses = torch.tensor(response, dtype=torch.int64)
        input_ids = torch.cat([prompts, responses], dim=0)
        response_mask = torch.ones_like(responses)
        uid, session_id, _ = key.rsplit("_", 2)
        keys.append(key)
        fields.append(
            {
                "uid": uid,
                "session_id": int(session_id),
                "prompts": prompts,
                "responses": responses,
                "response_mask": response_mask,
                "loss_mask": response_mask,
                "input_ids": input_ids,
                "position_ids": torch.arange(input_ids.size(0)),
                **extra,
            }
        )
        tags.append(
            {
                "status": "success",
                "prompt_len": prompts.size(0),
                "response_len": responses.size(0),
                "seq_len": input_ids.size(0),
                "global_steps": 1,
                "min_global_steps": 1,
                "max_global_steps": 1,
            }
        )
    return tq.kv_batch_put(keys=keys, partition_id=partition, fields=list_of_dict_to_tensordict(fields), tags=tags)


# --- a step's batch: four trajectories and verl's padding sample -----------------------------------------

KEYS = ["p0_0_0", "p1_0_0", "p2_0_0", "p3_0_0"]
PROMPTS = [[5, 6], [5, 6, 7], [8], [5, 6]]
RESPONSES = [[11, 12, 13, 14, 15], [21, 22, 23], [31, 32, 33, 34], [41]]
LENGTHS = [len(response) for response in RESPONSES] + [1]  # verl's padding sample: one masked token
ENTROPIES = [
    torch.tensor([0.3, 0.9, 0.1, 0.9, 0.5]),
    torch.tensor([0.2, 0.4, 0.6]),
    torch.tensor([0.7, 0.7, 0.7, 0.7]),
    torch.tensor([1.5]),
    torch.tensor([2.0]),  # the padding sample: the highest entropy, and still kept nowhere
]
# sequence rewards 0.0, 1.0, 0.25, 0.0 on the last token (verl zeroes the padding sample's)
REWARDS = [0.0, 1.0, 0.25, 0.0, 0.0]
RESPONSE_MASKS = [torch.ones(n, dtype=torch.int64) for n in LENGTHS[:-1]] + [torch.zeros(1, dtype=torch.int64)]


def rollout_log_probs(n):
    return -torch.arange(1, n + 1, dtype=torch.float32) / 10


def step_batch(tq, *, with_rollout_log_probs=True, omit_field=None, omit_keys=None) -> KVBatchMeta:
    """The batch verl's v1 trainer holds after ``_compute_old_log_prob``; its KVBatchMeta.

    ``omit_field`` (``rm_scores`` or ``entropy``) is not written for the samples ``omit_keys``; None:
    for any sample (verl's padding writes its sample's ``rm_scores`` regardless).
    """

    def omitted(field, key):
        return omit_field == field and (omit_keys is None or key in omit_keys)

    partition = new_partition()
    samples = []
    for key, prompt, response, reward in zip(KEYS, PROMPTS, RESPONSES, REWARDS):
        extra = {"rm_scores": torch.zeros(len(response)).index_fill(0, torch.tensor([len(response) - 1]), reward)}
        if with_rollout_log_probs:
            extra["rollout_log_probs"] = rollout_log_probs(len(response))
        if omitted("rm_scores", key):
            del extra["rm_scores"]
        samples.append((key, prompt, response, extra))
    # the agent loop writes each trajectory as it completes; samples of equal fields go in one put here
    for _, group in itertools.groupby(samples, key=lambda sample: sorted(sample[3])):
        agent_loop_put(tq, partition, list(group))
    tags = tq.kv_list(partition)[partition]
    batch = KVBatchMeta(keys=list(KEYS), tags=[tags[key] for key in KEYS], partition_id=partition)
    # verl's _balance_batch pads the batch to a multiple of the data-parallel and mini-batch sizes
    batch = upsample_batch_to_divisible_size(batch, len(KEYS) + 1, EOS)
    assert len(batch) == len(LENGTHS) and batch.tags[-1]["is_padding"]
    # verl's _compute_old_log_prob writes the recomputed log-probs and entropies, response-length nested,
    # in one put whose KVBatchMeta is the batch from then on
    recomputed = {
        "old_log_probs": [torch.full((n,), -9.0) for n in LENGTHS],
        "entropy": [entropy.clone() for entropy in ENTROPIES],
    }
    if omit_field == "entropy":
        kept = [key for key in batch.keys if not omitted("entropy", key)]
        if kept:
            entropies = [recomputed["entropy"][batch.keys.index(key)] for key in kept]
            fields = TensorDict({"entropy": nested(entropies)}, batch_size=len(kept))
            tq.kv_batch_put(keys=kept, partition_id=partition, fields=fields)
        del recomputed["entropy"]
    fields = TensorDict({name: nested(values) for name, values in recomputed.items()}, batch_size=len(batch))
    return tq.kv_batch_put(keys=batch.keys, partition_id=partition, fields=fields)


def expected_mask(threshold, fraction=0.5):
    """The pure filter on the padded batch, rows in batch order."""
    failed = torch.tensor([reward <= threshold for reward in REWARDS])  # inclusive threshold
    width = max(LENGTHS)
    padded_mask = torch.zeros(len(LENGTHS), width, dtype=torch.bool)
    padded_entropies = torch.zeros(len(LENGTHS), width)
    for row, (mask, entropy) in enumerate(zip(RESPONSE_MASKS, ENTROPIES)):
        padded_mask[row, : len(mask)] = mask.bool()
        padded_entropies[row, : len(entropy)] = entropy
    keep = entropy_filter(padded_mask, padded_entropies, failed, fraction)
    return [keep[row, :n].float() for row, n in enumerate(LENGTHS)], failed


def test_the_batch_is_what_verl_writes(tq):
    batch = step_batch(tq)
    assert isinstance(batch, KVBatchMeta) and batch.keys[:4] == KEYS and batch.keys[4].startswith("pad")
    assert [tag["seq_len"] for tag in batch.tags[:4]] == [len(p) + len(r) for p, r in zip(PROMPTS, RESPONSES)]
    stored = {"uid", "input_ids", "response_mask", "rm_scores", "rollout_log_probs", "old_log_probs", "entropy"}
    assert stored <= set(batch.fields)
    data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=["response_mask", "uid"])
    assert data["response_mask"].is_nested and data["response_mask"].layout == torch.jagged
    assert [row.tolist() for row in data["response_mask"].unbind()] == [m.tolist() for m in RESPONSE_MASKS]
    assert list(data["uid"])[:4] == ["p0", "p1", "p2", "p3"]


# --- old_log_probs := rollout_log_probs -----------------------------------------------------------------


def test_old_log_probs_become_the_recorded_rollout_log_probs(tq):
    batch = step_batch(tq)
    assert all(row.eq(-9.0).all() for row in rows(tq, batch, "old_log_probs").values())
    trainer_hooks.use_rollout_log_probs_as_old(batch, tq)
    old, recorded = rows(tq, batch, "old_log_probs"), rows(tq, batch, "rollout_log_probs")
    for key, n in zip(batch.keys, LENGTHS):
        assert old[key].dtype == torch.float32 and old[key].shape == (n,)
        assert torch.equal(old[key], recorded[key])  # bit for bit
    assert torch.equal(old["p0_0_0"], rollout_log_probs(5))


def test_missing_rollout_log_probs_are_an_error_naming_the_setting(tq):
    batch = step_batch(tq, with_rollout_log_probs=False)  # the agent loop ran with calculate_log_probs=false
    with pytest.raises(ValueError, match="calculate_log_probs=true"):
        trainer_hooks.use_rollout_log_probs_as_old(batch, tq)
    assert all(row.eq(-9.0).all() for row in rows(tq, batch, "old_log_probs").values())  # nothing written


# --- the entropy filter's mask ----------------------------------------------------------------------------


@pytest.mark.parametrize("threshold", [0.0, 0.25, -1.0])
def test_the_mask_is_the_pure_filter_of_entropies_and_failures(tq, threshold):
    batch = step_batch(tq)
    metrics = {}
    meta = trainer_hooks.write_entropy_filter_mask(batch, tq, 0.5, threshold, metrics)
    assert isinstance(meta, KVBatchMeta) and meta.keys == batch.keys
    assert flashreinforce_registration.FILTER_MASK_FIELD in meta.fields

    expected, failed = expected_mask(threshold)
    stored = rows(tq, batch, "rollout_is_weights")
    for row, key in enumerate(batch.keys):
        assert stored[key].dtype == torch.float32 and stored[key].shape == (LENGTHS[row],)  # its own length
        assert torch.equal(stored[key], expected[row])
    assert stored[batch.keys[-1]].tolist() == [0.0]  # verl's padding sample keeps nothing
    trajectories = failed[:-1]
    assert metrics[trainer_hooks.FAILED_FRACTION_METRIC] == pytest.approx(trajectories.float().mean().item())


def test_the_mask_for_a_concrete_batch(tq):
    batch = step_batch(tq)
    trainer_hooks.write_entropy_filter_mask(batch, tq, 0.5, 0.0)
    stored = rows(tq, batch, "rollout_is_weights")
    # p0 failed (T=5): its ceil(2.5)=3 highest entropies, the tie at 0.9 in order, then 0.5
    assert stored["p0_0_0"].tolist() == [0.0, 1.0, 0.0, 1.0, 1.0]
    assert stored["p1_0_0"].tolist() == [1.0, 1.0, 1.0]  # succeeded
    assert stored["p2_0_0"].tolist() == [1.0, 1.0, 1.0, 1.0]  # 0.25 > 0.0: succeeded
    assert stored["p3_0_0"].tolist() == [1.0]  # failed, ceil(0.5) = 1


def test_the_hook_refuses_to_overwrite_importance_weights_verl_wrote(tq):
    batch = step_batch(tq)
    weights = nested(torch.full((n,), 1.25) for n in LENGTHS)
    tq.kv_batch_put(
        keys=batch.keys,
        partition_id=batch.partition_id,
        fields=TensorDict({"rollout_is_weights": weights}, batch_size=len(batch)),
    )
    with pytest.raises(ValueError, match="rollout_is=null"):
        trainer_hooks.write_entropy_filter_mask(batch, tq, 0.5, 0.0)
    assert all(row.eq(1.25).all() for row in rows(tq, batch, "rollout_is_weights").values())  # untouched


@pytest.mark.parametrize("field", ["entropy", "rm_scores"])
@pytest.mark.parametrize("lacking", ["one sample", "every sample"])
def test_missing_filter_inputs_are_named(tq, field, lacking):
    # every sample: no recompute (bypass mode) writes no entropy, no reward writes no rm_scores
    batch = step_batch(tq, omit_field=field, omit_keys=[KEYS[2]] if lacking == "one sample" else None)
    with pytest.raises(ValueError, match=rf"missing: \['{field}'\]"):
        trainer_hooks.write_entropy_filter_mask(batch, tq, 0.5, 0.0)
    data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=["rollout_is_weights"])
    assert "rollout_is_weights" not in data.keys()  # nothing written


def test_non_finite_entropies_at_response_tokens_are_refused(tq):
    batch = step_batch(tq)
    entropies = ENTROPIES[0].clone()
    entropies[2] = math.nan
    tq.kv_batch_put(
        keys=batch.keys[:1],
        partition_id=batch.partition_id,
        fields=TensorDict({"entropy": nested([entropies])}, batch_size=1),
    )
    with pytest.raises(ValueError, match="entropies must be finite"):
        trainer_hooks.write_entropy_filter_mask(batch, tq, 0.5, 0.0)


def test_the_mask_reaches_the_loss_under_the_field_verls_ppo_loss_forwards(tq):
    """The hook writes under the one field verl's ``ppo_loss`` hands the policy loss besides old log-probs and
    advantages (read from verl's source, so a rename on either side fails here), and the driver metric is
    the documented name."""
    import inspect

    from verl.workers.utils.losses import ppo_loss

    source = inspect.getsource(ppo_loss)
    forwarded = set(re.findall(r'data\.get\("(\w+)", None\)', source))
    assert "rollout_is_weights=rollout_is_weights" in source
    batch = step_batch(tq)
    metrics = {}
    meta = trainer_hooks.write_entropy_filter_mask(batch, tq, 0.5, 0.0, metrics)
    written = set(meta.fields) - set(batch.fields)
    assert written == forwarded == {"rollout_is_weights"}
    assert set(metrics) == {"actor/flashreinforce/failed_fraction"}  # as README's metric list names it


# --- the canonical batch order ----------------------------------------------------------------------------

# (key, prompt, response): distinct token sequences, among them one a prefix of another
DISTINCT = [
    ("q0_0_0", [7, 3], [9, 9, 2]),
    ("q1_0_0", [5, 6], [1]),
    ("q2_0_0", [5, 6], [1, 4]),  # q1's sequence is a prefix of q2's
    ("q3_0_0", [5], [8, 8, 8, 8]),
    ("q4_0_0", [7, 3], [0]),
    ("q5_0_0", [12], [3, 2]),
]
# sorted by the whole token sequence (prompt + response), lexicographically, shorter prefix first
CANONICAL = ["q1_0_0", "q2_0_0", "q3_0_0", "q4_0_0", "q0_0_0", "q5_0_0"]


def put_in_order(tq, samples) -> KVBatchMeta:
    partition = new_partition()
    return agent_loop_put(tq, partition, [(key, prompt, response, {}) for key, prompt, response in samples])


def test_canonical_order_sorts_by_token_sequence(tq):
    batch = put_in_order(tq, DISTINCT)
    order = trainer_hooks.canonical_order(batch, tq)
    assert [batch.keys[i] for i in order] == CANONICAL
    sequences = [tuple(row.tolist()) for row in rows(tq, batch, "input_ids").values()]
    assert order == sorted(range(len(sequences)), key=sequences.__getitem__)


def test_canonical_order_is_stable_for_equal_sequences(tq):
    # rollout.n = 2 sampled the same response twice: two keys, one token sequence
    twins = [("t0_0_0", [5, 6], [1, 4]), ("t0_1_0", [5, 6], [1, 4]), ("t1_0_0", [4], [4])]
    for samples in (twins, [twins[1], twins[0], twins[2]]):
        batch = put_in_order(tq, samples)
        order = trainer_hooks.canonical_order(batch, tq)
        twin_keys = [key for key, _, _ in samples if key != "t1_0_0"]
        assert [batch.keys[i] for i in order] == ["t1_0_0", *twin_keys]  # the twins keep the batch's order


@pytest.mark.parametrize("seed", [None, "reversed", 0, 1])
def test_the_reordered_batch_is_the_same_whatever_the_put_order(tq, seed):
    samples = list(DISTINCT) + [("q1_1_0", [5, 6], [1])]  # and a twin of q1
    if seed == "reversed":
        samples.reverse()
    elif seed is not None:
        random.Random(seed).shuffle(samples)
    batch = put_in_order(tq, samples)
    tags_by_key = dict(zip(batch.keys, batch.tags))
    batch.reorder(trainer_hooks.canonical_order(batch, tq))
    sequences = [row.tolist() for row in rows(tq, batch, "input_ids").values()]
    assert sequences == sorted(prompt + response for _, prompt, response in samples)
    distinct_keys = [key for key in batch.keys if key not in ("q1_0_0", "q1_1_0")]
    assert distinct_keys == [key for key in CANONICAL if key != "q1_0_0"]
    assert batch.tags == [tags_by_key[key] for key in batch.keys]  # the tags travel with their samples
    assert len(batch) == len(samples)


def test_twin_without_the_canonical_order_a_sum_over_the_batch_depends_on_the_completion_order(tq):
    """What the canonical order is for: the same trajectories put in other orders (completion order
    varies from run to run), reduced row by row as a gradient or a metric mean is. Without the
    reorder the bits depend on the order; after it they do not."""
    # per-row values whose float sum depends on the order of addition (cancellation around 1e16)
    value = dict(zip([key for key, _, _ in DISTINCT], [1e16, 1.0, -1e16, 3.0, 0.5, 2.0]))
    as_put, canonical = set(), set()
    for seed in range(8):
        samples = random.Random(seed).sample(DISTINCT, len(DISTINCT))
        batch = put_in_order(tq, samples)
        as_put.add(sum(value[key] for key in batch.keys))
        batch.reorder(trainer_hooks.canonical_order(batch, tq))
        canonical.add(sum(value[key] for key in batch.keys))
    assert len(as_put) > 1, f"every put order summed to the same bits {as_put}: the twin shows nothing"
    assert len(canonical) == 1, canonical


# --- the installed wrapper on verl's real trainer ----------------------------------------------------------


def hooked_trainer(tq, config):
    """An instance of a subclass of verl's real v1 trainer with the hooks installed, never ``__init__``-ed."""
    from verl.trainer.ppo.v1 import get_trainer_cls

    cls = type("HookedTrainer", (get_trainer_cls(config.trainer.v1.trainer_mode),), {})
    trainer_hooks.install_on(cls, tq)
    trainer = object.__new__(cls)
    trainer.config = config
    return trainer


@pytest.mark.parametrize(
    ("settings", "writes_mask"),
    [
        (None, False),
        (Settings(platform="cpu"), False),
        (Settings(platform="cpu", negative_token_fraction=0.5), True),
    ],
)
def test_the_wrapped_advantage_step(tq, config, monkeypatch, settings, writes_mask):
    if settings is None:
        monkeypatch.delenv(ENV_VAR, raising=False)
    else:
        monkeypatch.setenv(ENV_VAR, settings.to_json())
    batch = step_batch(tq)
    trainer_hooks.use_rollout_log_probs_as_old(batch, tq)
    trainer = hooked_trainer(tq, config)
    metrics = {}
    if settings is None:  # no launch exported settings: the hook refuses instead of assuming defaults
        with pytest.raises(SettingsNotExported, match="the entropy filter needs"):
            trainer._compute_advantage(batch, metrics)
        return
    result = trainer._compute_advantage(batch, metrics)

    # verl's own step ran first: the recipe's estimator wrote the advantages, its metrics are kept
    assert isinstance(result, KVBatchMeta) and result.keys == batch.keys
    assert {"advantages", "returns"} <= set(result.fields)
    advantages = rows(tq, batch, "advantages")
    assert [advantages[key].shape[0] for key in batch.keys] == LENGTHS
    assert advantages[batch.keys[-1]].tolist() == [0.0]  # the padding sample
    assert any(name.startswith("rollout_corr/") for name in metrics)  # verl's decoupled rollout correction

    data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=["rollout_is_weights"])
    assert ("rollout_is_weights" in data.keys()) is writes_mask
    assert ("rollout_is_weights" in result.fields) is writes_mask  # the actor update is handed the field
    assert (trainer_hooks.FAILED_FRACTION_METRIC in metrics) is writes_mask
    if writes_mask:
        expected, _ = expected_mask(0.0)
        assert [row.tolist() for row in data["rollout_is_weights"].unbind()] == [row.tolist() for row in expected]


def test_the_wrapped_step_refuses_the_weights_verl_computed(tq, config, monkeypatch):
    monkeypatch.setenv(ENV_VAR, Settings(platform="cpu", negative_token_fraction=0.5).to_json())
    config = copy.deepcopy(config)
    config.algorithm.rollout_correction.rollout_is = "token"  # verl computes importance weights
    batch = step_batch(tq)
    trainer_hooks.use_rollout_log_probs_as_old(batch, tq)  # as the wrapped _compute_old_log_prob leaves it
    trainer = hooked_trainer(tq, config)
    with pytest.raises(ValueError, match="rollout_is=null"):
        trainer._compute_advantage(batch, {})
    # verl's weights, left as verl wrote them: exp(old - rollout) = 1 everywhere, which the loss would
    # read as a mask that keeps every token (no row failed)
    weights = rows(tq, batch, "rollout_is_weights")
    assert [weights[key].tolist() for key in KEYS] == [[1.0] * n for n in LENGTHS[:4]]


def test_a_batch_missing_failed_rollouts_is_refused_by_name():
    from transfer_queue import KVBatchMeta

    keys = [f"uid{i}_0_0" for i in range(8)]
    full = KVBatchMeta(partition_id="train", keys=keys, tags=[{} for _ in keys])
    trainer_hooks.require_full_batch(full, 8)
    # Two prompts' rollouts failed: verl would pad the batch; the hook refuses it, naming the count and the key.
    short = KVBatchMeta(
        partition_id="train", keys=keys[:6] + ["pad_0_0"], tags=[{} for _ in keys[:6]] + [{"is_padding": True}]
    )
    with pytest.raises(trainer_hooks.ShortBatchError, match=r"6 prompts, expected 8.*re-queues a failed prompt"):
        trainer_hooks.require_full_batch(short, 8)


# --- the per-token agreement of the recompute and the recorded log-probs ---------------------------------


def test_one_flipped_ulp_is_one_mismatched_token():
    """Log space, by bits: one ulp at one response token is counted; a difference under the mask is not."""
    rollout = torch.tensor([[-0.5, -2.25, -120.0, 0.0], [-1.0, -3.0, -7.0, -9.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    training = rollout.clone()
    training[1, 3] = 5.0  # a padding position: not a response token
    same = trainer_hooks.logprob_agreement(training, rollout, mask)
    assert same == {trainer_hooks.MISMATCHED_TOKENS_METRIC: 0.0, trainer_hooks.LOGPROB_DIFF_METRIC: 0.0}
    training[0, 2] = torch.nextafter(rollout[0, 2], torch.tensor(0.0))
    flipped = trainer_hooks.logprob_agreement(training, rollout, mask)
    assert flipped[trainer_hooks.MISMATCHED_TOKENS_METRIC] == 1.0
    assert flipped[trainer_hooks.LOGPROB_DIFF_METRIC] == (training[0, 2] - rollout[0, 2]).abs().item() > 0
    training[0, 3] = -0.0  # the same value, other bits: counted
    assert trainer_hooks.logprob_agreement(training, rollout, mask)[trainer_hooks.MISMATCHED_TOKENS_METRIC] == 2.0


def test_twin_verls_probability_space_metric_does_not_see_that_ulp():
    """Why the recipe logs its own: verl's ``training/rollout_probs_diff_max`` compares exp(log-prob), and a
    log-prob of -120 has no fp32 exp above 0, so the flipped ulp above is a difference of 0.0 there."""
    from verl.utils.debug.metrics import calculate_log_prob_diff

    rollout = torch.tensor([[-120.0]])
    training = torch.nextafter(rollout, torch.tensor(0.0))
    mask = torch.ones_like(rollout, dtype=torch.bool)
    assert calculate_log_prob_diff(training.exp(), rollout.exp(), mask).max().item() == 0.0
    assert trainer_hooks.logprob_agreement(training, rollout, mask)[trainer_hooks.MISMATCHED_TOKENS_METRIC] == 1.0
