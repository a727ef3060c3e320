"""FlashREINFORCE inside verl 0.9.1: the advantage estimator, and the policy loss as verl calls it
(``verl.workers.utils.losses.ppo_loss``), split into micro-batches and data-parallel ranks, against one
call of the pure reference loss on the whole batch (the entry point, in a fresh interpreter:
tests/engine/test_flashreinforce_in_verl_engine.py).

verl imports stay inside the tests: the data-parallel workers are spawned processes that import this
module, and they should not pay for (or depend on) more of verl than they use.
"""

import math
import os

import pytest
import torch

from ports import free_port
from true_on_policy.config.settings import ENV_VAR, Settings, SettingsNotExported
from true_on_policy.loss.flashreinforce import flashreinforce_loss
from verl_actor import (
    current_log_probs,
    flashreinforce_actor_config,
    policy_batch,
    policy_loss_call,
    ppo_loss_inputs,
    token_level_rewards,
    verl_advantages,
)

F64 = torch.float64
ROWS, RESPONSE_LENGTH, HIDDEN, VOCAB = 6, 5, 4, 7
RESPONSE_LENGTHS = torch.tensor([5, 3, 4, 1, 5, 2])
DELTA = 0.01
METRIC_NAMES = (
    "actor/flashreinforce/acceptance_rate",
    "actor/flashreinforce/sequence_kl_mean",
    "actor/flashreinforce/retained_token_fraction",
    "actor/flashreinforce/ratio_deviation_mean",
)


# --- a small real policy and one batch it sampled -----------------------------------------------------


def make_batch():
    """A linear softmax policy over VOCAB tokens, a batch of responses of varied length, behaviour
    log-probs that drift from the current policy by a per-row amount (so the gate admits some rows
    and rejects others), and one outcome reward per row placed on its last response token."""
    generator = torch.Generator().manual_seed(1234)
    drift = [0.0, 0.02, 0.5, 0.05, 0.8, 0.01]
    batch = policy_batch(
        generator, RESPONSE_LENGTHS, response_length=RESPONSE_LENGTH, hidden=HIDDEN, vocab=VOCAB, drift=drift
    )
    rewards = torch.tensor([1.0, 0.0, 0.5, 1.0, 0.0, 0.25], dtype=F64)
    placed = token_level_rewards(rewards, RESPONSE_LENGTHS, RESPONSE_LENGTH)
    return dict(**batch, rewards=rewards, token_level_rewards=placed)


def reference_gradient(batch):
    """One call of the pure loss on the whole batch: the gradient every split must reproduce."""
    weight = batch["weight"].clone().requires_grad_(True)
    current = current_log_probs(batch["features"], weight, batch["tokens"])
    loss, stats = flashreinforce_loss(current, batch["behaviour"], batch["rewards"], batch["mask"], delta=DELTA)
    loss.backward()
    return loss.detach(), weight.grad, stats


def relative_error(actual, expected):
    return ((actual - expected).norm() / expected.norm()).item()


@pytest.fixture
def flashreinforce_settings(monkeypatch):
    monkeypatch.setenv(ENV_VAR, Settings(platform="cpu", delta=DELTA).to_json())


# --- (a) the advantage estimator -----------------------------------------------------------------------


def test_advantage_estimator_is_reward_minus_batch_mean_times_mask(flashreinforce_settings):
    batch = make_batch()
    advantages = verl_advantages(batch)
    mean = batch["rewards"].mean()
    expected = (batch["rewards"] - mean).unsqueeze(-1) * batch["mask"].to(F64)
    assert torch.equal(advantages, expected)


def test_advantage_estimator_through_verls_compute_advantage(flashreinforce_settings):
    import numpy as np
    from verl import DataProto
    from verl.trainer.config import AlgoConfig
    from verl.trainer.ppo.ray_trainer import compute_advantage

    from true_on_policy.verl_adapter import flashreinforce_registration  # noqa: F401

    batch = make_batch()
    data = DataProto.from_dict(
        tensors={"token_level_rewards": batch["token_level_rewards"], "response_mask": batch["mask"].long()},
        non_tensors={"uid": np.array([str(i) for i in range(ROWS)], dtype=object)},
    )
    data = compute_advantage(data, adv_estimator="flashreinforce", config=AlgoConfig(adv_estimator="flashreinforce"))
    expected = (batch["rewards"] - batch["rewards"].mean()).unsqueeze(-1) * batch["mask"].to(F64)
    assert torch.equal(data.batch["advantages"], expected)
    assert torch.equal(data.batch["returns"], expected)


def test_advantage_estimator_leaves_verls_padding_rows_out_of_the_mean(flashreinforce_settings):
    batch = make_batch()
    rewards = torch.cat([batch["token_level_rewards"], torch.zeros(2, RESPONSE_LENGTH, dtype=F64)])
    mask = torch.cat([batch["mask"], torch.zeros(2, RESPONSE_LENGTH, dtype=torch.bool)])
    advantages = verl_advantages(dict(batch, token_level_rewards=rewards, mask=mask))
    expected = (batch["rewards"] - batch["rewards"].mean()).unsqueeze(-1) * batch["mask"].to(F64)
    assert torch.equal(advantages[:ROWS], expected)
    assert advantages[ROWS:].eq(0).all()


# --- (b) micro-batches and data-parallel ranks sum to the whole-batch loss ------------------------------


def gradient_through_ppo_loss(batch, micro_batches):
    from verl.workers.utils.losses import ppo_loss

    config = flashreinforce_actor_config(ROWS)
    advantages = verl_advantages(batch)
    weight = batch["weight"].clone().requires_grad_(True)
    metrics = []
    for rows in micro_batches:
        model_output, data = ppo_loss_inputs(batch, weight, advantages, rows, dp_size=1, global_batch_size=ROWS)
        loss, micro_metrics = ppo_loss(config, model_output, data)
        loss.backward()  # verl's engine: one backward per micro-batch, gradients accumulate
        metrics.append(micro_metrics)
    return weight.grad, metrics


@pytest.mark.parametrize("micro_batches", [[[0, 1, 2, 3, 4, 5]], [[0, 1], [2, 3, 4], [5]], [[3], [0, 5], [1], [2, 4]]])
def test_micro_batches_through_verls_ppo_loss_match_the_whole_batch(flashreinforce_settings, micro_batches):
    batch = make_batch()
    _, expected, stats = reference_gradient(batch)
    assert 0 < int(stats["admitted"].sum()) < ROWS  # the gate decides something in this batch

    actual, _ = gradient_through_ppo_loss(batch, micro_batches)
    assert relative_error(actual, expected) <= 1e-6


def _data_parallel_worker(rank, world_size, port, settings_json, micro_batches_per_rank, result_path):
    """One FSDP-like data-parallel rank: its own rows, verl's global_batch_info, gradient averaging."""
    os.environ["VERL_USE_EXTERNAL_PLUGINS"] = "none"  # load only what this worker needs
    os.environ[ENV_VAR] = settings_json
    torch.set_num_threads(1)
    import torch.distributed as dist

    from true_on_policy.verl_adapter import flashreinforce_registration  # noqa: F401
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        batch = make_batch()
        advantages = verl_advantages(batch)
        config = flashreinforce_actor_config(ROWS)
        policy_loss = get_policy_loss_fn("flashreinforce")
        weight = batch["weight"].clone().requires_grad_(True)
        for rows in micro_batches_per_rank[rank]:
            rows = torch.tensor(rows)
            # exactly what verl's ppo_loss writes before calling the policy loss
            config.global_batch_info["dp_size"] = world_size
            config.global_batch_info["batch_num_tokens"] = int(batch["mask"].sum())
            config.global_batch_info["global_batch_size"] = ROWS
            config.global_batch_info["loss_scale_factor"] = config.loss_scale_factor
            loss, _ = policy_loss(
                old_log_prob=batch["behaviour"][rows],
                log_prob=current_log_probs(batch["features"][rows], weight, batch["tokens"][rows]),
                advantages=advantages[rows],
                response_mask=batch["mask"][rows],
                loss_agg_mode=config.loss_agg_mode,
                config=config,
                rollout_is_weights=None,
            )
            loss.backward()
        # FSDP/DDP reduce: the mean of the ranks' gradients
        dist.all_reduce(weight.grad, op=dist.ReduceOp.SUM)
        weight.grad /= world_size
        if rank == 0:
            torch.save(weight.grad, result_path)
    finally:
        dist.destroy_process_group()


def test_two_data_parallel_ranks_match_the_whole_batch(flashreinforce_settings, tmp_path):
    import torch.multiprocessing as mp

    batch = make_batch()
    _, expected, _ = reference_gradient(batch)
    micro_batches_per_rank = [[[0, 1], [2]], [[3], [4, 5]]]  # rank 0: rows 0-2, rank 1: rows 3-5
    result_path = tmp_path / "gradient.pt"
    mp.spawn(
        _data_parallel_worker,
        args=(2, free_port(), os.environ[ENV_VAR], micro_batches_per_rank, str(result_path)),
        nprocs=2,
        join=True,
    )
    actual = torch.load(result_path)
    assert relative_error(actual, expected) <= 1e-6


# --- (c) metrics, and what the verl loss refuses ----------------------------------------------------------


def test_metrics_are_named_for_flashreinforce_and_match_the_reference(flashreinforce_settings):
    from verl.utils.metric import Metric

    batch = make_batch()
    _, _, stats = reference_gradient(batch)
    _, metrics = gradient_through_ppo_loss(batch, [list(range(ROWS))])
    (micro_metrics,) = metrics
    for name in METRIC_NAMES:
        assert "flashreinforce" in name
        assert isinstance(micro_metrics[name], Metric)
    values = {name: micro_metrics[name].aggregate() for name in METRIC_NAMES}
    assert values["actor/flashreinforce/acceptance_rate"] == pytest.approx(stats["acceptance_rate"].item())
    assert values["actor/flashreinforce/sequence_kl_mean"] == pytest.approx(stats["sequence_kl"].mean().item())
    retained = stats["retained_tokens"].sum() / stats["policy_tokens"].sum()
    assert values["actor/flashreinforce/retained_token_fraction"] == pytest.approx(retained.item())
    assert values["actor/flashreinforce/ratio_deviation_mean"] == pytest.approx(stats["ratio_deviation"].item())


def call_policy_loss(batch, *, rows=None, global_batch_size=ROWS, dp_size=1, **overrides):
    """The registered loss called the way ppo_loss calls it, on ``rows`` of the batch."""
    index = torch.arange(ROWS) if rows is None else torch.tensor(rows)
    return policy_loss_call(
        batch, index, mini_batch=ROWS, weight=batch["weight"], dp_size=dp_size, global_batch_size=global_batch_size,
        **overrides,
    )


def test_without_exported_settings_the_loss_and_the_advantage_refuse(monkeypatch):
    batch = make_batch()
    monkeypatch.setenv(ENV_VAR, Settings(platform="cpu").to_json())
    advantages = verl_advantages(batch)
    _, metrics = call_policy_loss(batch, advantages=advantages)  # the twin: with the launch's settings it runs
    assert metrics["actor/flashreinforce/acceptance_rate"] > 0

    monkeypatch.delenv(ENV_VAR)  # no launch hook ran in this process
    with pytest.raises(SettingsNotExported, match="adv_estimator=flashreinforce needs"):
        verl_advantages(batch)
    with pytest.raises(SettingsNotExported, match="loss_mode=flashreinforce needs"):
        call_policy_loss(batch, advantages=advantages)


def test_verls_padding_rows_contribute_nothing(flashreinforce_settings):
    batch = make_batch()
    padded = {key: value for key, value in batch.items()}
    for key in ("features", "tokens", "behaviour", "token_level_rewards"):
        padded[key] = torch.cat([batch[key], batch[key][:1]])
    padded["mask"] = torch.cat([batch["mask"], torch.zeros(1, RESPONSE_LENGTH, dtype=torch.bool)])
    padded["rewards"] = torch.cat([batch["rewards"], torch.zeros(1, dtype=F64)])

    loss_without, _ = call_policy_loss(batch)
    loss_with, _ = call_policy_loss(padded, rows=list(range(ROWS + 1)))
    assert loss_with.item() == loss_without.item()

    # a micro-batch of padding rows only: zero loss that still backpropagates
    weight = batch["weight"].clone().requires_grad_(True)
    only_padding, metrics = call_policy_loss(
        padded,
        rows=[ROWS],
        log_prob=current_log_probs(padded["features"][ROWS:], weight, padded["tokens"][ROWS:]),
    )
    only_padding.backward()
    assert only_padding.item() == 0.0 and weight.grad.eq(0).all()
    assert set(metrics) == set(METRIC_NAMES)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(loss_agg_mode="token-mean"), "loss_agg_mode='seq-mean-token-mean'"),
        (dict(rollout_is_weights=torch.ones(ROWS, RESPONSE_LENGTH, dtype=F64)), "rollout_is=null"),
        (dict(config=None), "needs verl's actor config"),
        (dict(global_batch_size=None), "global_batch_size"),
        (dict(dp_size=None), "dp_size"),
    ],
)
def test_policy_loss_refuses_what_flashreinforce_cannot_honour(flashreinforce_settings, overrides, message):
    with pytest.raises(ValueError, match=message):
        call_policy_loss(make_batch(), **overrides)


def _driver_check(batch, **changes):
    from true_on_policy.verl_adapter import trainer_hooks

    inputs = dict(mask=batch["mask"], behaviour=batch["behaviour"], advantages=verl_advantages(batch))
    inputs.update(changes)
    trainer_hooks.check_flashreinforce_batch(inputs["mask"], inputs["behaviour"], inputs["advantages"], None, 1.0)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (lambda b: dict(advantages=torch.rand(ROWS, RESPONSE_LENGTH, dtype=F64)), "varies .* within rows"),
        (lambda b: dict(advantages=verl_advantages(b).index_fill(1, torch.tensor([0]), math.nan)), "not finite"),
        (lambda b: dict(behaviour=b["behaviour"].index_fill(1, torch.tensor([0]), 0.5)), "finite and <= 0"),
        (lambda b: dict(behaviour=b["behaviour"].index_fill(1, torch.tensor([0]), -math.inf)), "finite and <= 0"),
        (lambda b: dict(mask=torch.zeros_like(b["mask"])), "no row with a response token"),
    ],
)
def test_the_driver_refuses_a_batch_the_loss_cannot_honour(flashreinforce_settings, changes, message):
    """Checked once per batch in the driver: the per-micro-batch loss reads no value on the host."""
    batch = make_batch()
    _driver_check(batch)  # the twin: the batch as verl's estimator and the rollout leave it
    with pytest.raises(ValueError, match=message):
        _driver_check(batch, **changes(batch))


def test_the_gate_uses_the_exported_delta(monkeypatch):
    batch = make_batch()
    monkeypatch.setenv(ENV_VAR, Settings(platform="cpu", delta=math.inf).to_json())
    _, open_gate = call_policy_loss(batch)
    monkeypatch.setenv(ENV_VAR, Settings(platform="cpu", delta=0.0).to_json())
    _, closed_gate = call_policy_loss(batch)
    assert open_gate["actor/flashreinforce/acceptance_rate"] == 1.0
    # only row 0 has behaviour == current exactly (no drift), so only it passes delta = 0
    assert closed_gate["actor/flashreinforce/acceptance_rate"] == pytest.approx(1 / ROWS)


def test_padding_rows_anywhere_change_no_bit_of_the_loss(flashreinforce_settings):
    """verl's padding rows (no response token) are masked, not selected away (a data-dependent shape
    is a host sync on a device): the loss adds per row, then over rows in order, so zero rows in the
    middle of a micro-batch change no bit of the loss, and none of its gradient (with respect to the
    log-probs: what the weights' gradient adds up after it is torch's GEMM, whose blocking over rows is
    the CPU's, not the loss's)."""
    batch = make_batch()
    order = [0, None, 1, 2, None, None, 3, 4, 5]  # None: a padding row (row 0's data, no response)
    padded = {"weight": batch["weight"]}
    for key in ("features", "tokens", "behaviour", "token_level_rewards"):
        padded[key] = torch.stack([batch[key][row if row is not None else 0] for row in order])
    padded["mask"] = torch.stack(
        [batch["mask"][row] if row is not None else torch.zeros(RESPONSE_LENGTH, dtype=torch.bool) for row in order]
    )
    losses, gradients = [], []
    for data, rows in ((batch, None), (padded, list(range(len(order))))):
        index = torch.arange(ROWS) if rows is None else torch.tensor(rows)
        log_prob = current_log_probs(data["features"][index], batch["weight"], data["tokens"][index]).requires_grad_(True)
        loss, _ = call_policy_loss(data, rows=rows, advantages=verl_advantages(data)[index], log_prob=log_prob)
        loss.backward()
        losses.append(loss.detach())
        gradients.append(log_prob.grad)
    index = torch.tensor([row for row, source in enumerate(order) if source is not None])
    assert torch.equal(losses[0], losses[1]) and torch.equal(gradients[0], gradients[1][index])
    assert not gradients[1][[row for row, source in enumerate(order) if source is None]].any()
    assert torch.equal(verl_advantages(padded)[index], verl_advantages(batch))  # the batch mean too
    # twin: one flat sum over the padded [rows, T] layout (what the loss added before) is another number
    terms = torch.randn(ROWS, RESPONSE_LENGTH, dtype=F64, generator=torch.Generator().manual_seed(3)) * batch["mask"]
    padded_terms = torch.stack([terms[row] if row is not None else torch.zeros(RESPONSE_LENGTH, dtype=F64) for row in order])
    assert not torch.equal(terms.sum(), padded_terms.sum())
    assert torch.equal(torch.cumsum(terms.sum(-1), 0)[-1], torch.cumsum(padded_terms.sum(-1), 0)[-1])
