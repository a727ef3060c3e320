"""No host sync on the hot path: the registered FlashREINFORCE loss (per micro-batch) and advantage
read no tensor value on the host.

They run here on PyTorch's ``meta`` device: tensors with shapes and dtypes but no data, on which every
host read fails -- ``.item()``, ``bool(tensor)``, ``.tolist()``, ``torch.nonzero`` and boolean
indexing (a data-dependent shape) -- exactly the operations that stall an NPU/GPU step. The twin runs
the validating reference loss (what the verl loss called per micro-batch before) on the same tensors
and is stopped by its first host read. Values are checked on CPU elsewhere
(tests/unit/test_flashreinforce_in_verl.py, tests/unit/test_entropy_filter_in_verl.py).
"""

from __future__ import annotations

import pytest
import torch

from true_on_policy.config.settings import ENV_VAR, Settings
from true_on_policy.loss.flashreinforce import flashreinforce_loss_from_advantages
from verl_actor import flashreinforce_actor_config

ROWS, LENGTH = 6, 5



def meta_inputs(device="meta"):
    mask = torch.empty(ROWS, LENGTH, dtype=torch.bool, device=device)
    log_prob = torch.empty(ROWS, LENGTH, dtype=torch.float32, device=device, requires_grad=True)
    return dict(
        old_log_prob=torch.empty(ROWS, LENGTH, dtype=torch.float32, device=device),
        log_prob=log_prob,
        advantages=torch.empty(ROWS, LENGTH, dtype=torch.float32, device=device),
        response_mask=mask,
    )


@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_the_registered_loss_reads_nothing_on_the_host(monkeypatch, fraction):
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    from true_on_policy.verl_adapter import flashreinforce_registration  # noqa: F401 (registers)

    settings = Settings(platform="cpu", negative_token_fraction=fraction)
    monkeypatch.setenv(ENV_VAR, settings.to_json())
    inputs = meta_inputs()
    carrier = torch.empty(ROWS, LENGTH, dtype=torch.float32, device="meta") if fraction < 1.0 else None
    config = flashreinforce_actor_config(ROWS, dp_size=2, global_batch_size=ROWS)
    loss, metrics = get_policy_loss_fn("flashreinforce")(
        **inputs, loss_agg_mode="seq-mean-token-mean", config=config, rollout_is_weights=carrier
    )
    loss.backward()
    assert loss.device.type == "meta" and inputs["log_prob"].grad.shape == (ROWS, LENGTH)
    assert set(metrics) == set(flashreinforce_registration.METRIC_NAMES)
    assert all(isinstance(value, torch.Tensor) and value.device.type == "meta" for value in metrics.values())


def test_the_registered_advantage_reads_nothing_on_the_host(monkeypatch):
    from verl.trainer.ppo.core_algos import get_adv_estimator_fn

    from true_on_policy.verl_adapter import flashreinforce_registration  # noqa: F401 (registers)

    monkeypatch.setenv(ENV_VAR, Settings(platform="cpu").to_json())
    rewards = torch.empty(ROWS, LENGTH, dtype=torch.float32, device="meta")
    mask = torch.empty(ROWS, LENGTH, dtype=torch.int64, device="meta")
    advantages, returns = get_adv_estimator_fn("flashreinforce")(token_level_rewards=rewards, response_mask=mask)
    assert advantages.device.type == "meta" and advantages.shape == (ROWS, LENGTH) and returns is advantages


def test_twin_the_validating_reference_reads_the_host_and_is_stopped():
    inputs = meta_inputs()
    with pytest.raises((RuntimeError, NotImplementedError), match="meta"):
        flashreinforce_loss_from_advantages(
            inputs["log_prob"],
            inputs["old_log_prob"],
            torch.empty(ROWS, dtype=torch.float32, device="meta"),
            inputs["response_mask"],
            batch_size=ROWS,
        )
