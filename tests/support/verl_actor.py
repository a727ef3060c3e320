"""For the tests that call verl's FlashREINFORCE path directly (no trainer launch): verl's FSDP actor
config as the registered loss sees it, the registered advantage estimator, and the small linear
softmax policy those tests train."""

from __future__ import annotations

import torch

F64 = torch.float64
PROMPT_LENGTH = 2  # prompt tokens of every trajectory (all ones: the policy never sees them)


def flashreinforce_actor_config(rows: int, *, dp_size: int | None = None, global_batch_size: int | None = None):
    """One mini-batch of ``rows`` trajectories in micro-batches of 2; with ``dp_size``, verl's
    ``global_batch_info`` filled as its trainer fills it (the loss requires dp_size and the global
    batch size)."""
    from verl.workers.config import FSDPActorConfig, PolicyLossConfig

    config = FSDPActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_mini_batch_size=rows,
        ppo_micro_batch_size_per_gpu=2,
        loss_agg_mode="seq-mean-token-mean",
        policy_loss=PolicyLossConfig(loss_mode="flashreinforce"),
    )
    if dp_size is not None:
        config.global_batch_info.update(
            dp_size=dp_size, batch_num_tokens=None, global_batch_size=global_batch_size, loss_scale_factor=None
        )
    return config


def current_log_probs(features, weight, tokens):
    """The linear softmax policy's log-prob of each token: log_softmax(features @ weight)[token]."""
    return torch.log_softmax(features @ weight, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def verl_advantages(batch):
    """verl's registered ``flashreinforce`` advantage estimator on ``batch``'s rewards and mask."""
    from true_on_policy.verl_adapter import flashreinforce_registration  # noqa: F401  (registers)
    from verl.trainer.ppo.core_algos import get_adv_estimator_fn

    advantages, _ = get_adv_estimator_fn("flashreinforce")(
        token_level_rewards=batch["token_level_rewards"], response_mask=batch["mask"].long(), config=None
    )
    return advantages


def policy_batch(generator, response_lengths, *, response_length, hidden, vocab, drift):
    """A linear softmax policy and a batch it sampled: ``features`` ``[rows, response_length, hidden]``,
    ``weight``, ``tokens``, the response ``mask`` of ``response_lengths`` and ``behaviour`` log-probs
    that drift from the current policy by ``drift[row]`` (drawn from ``generator`` in that order)."""
    rows = len(response_lengths)
    features = torch.randn(rows, response_length, hidden, generator=generator, dtype=F64)
    weight = torch.randn(hidden, vocab, generator=generator, dtype=F64)
    tokens = torch.randint(vocab, (rows, response_length), generator=generator)
    mask = torch.arange(response_length) < response_lengths.unsqueeze(-1)
    drift = torch.tensor(drift, dtype=F64).unsqueeze(-1)
    with torch.no_grad():
        current = current_log_probs(features, weight, tokens)
        noise = drift * torch.randn(rows, response_length, generator=generator, dtype=F64)
        behaviour = torch.where(mask, (current + noise).clamp(max=-1e-6), torch.zeros((), dtype=F64))
    return dict(features=features, weight=weight, tokens=tokens, mask=mask, behaviour=behaviour)


def token_level_rewards(rewards, response_lengths, response_length):
    """One outcome reward per row, on its last response token (verl's ``token_level_rewards``)."""
    placed = torch.zeros(len(response_lengths), response_length, dtype=F64)
    placed[torch.arange(len(response_lengths)), response_lengths - 1] = rewards
    return placed


def ppo_loss_inputs(batch, weight, advantages, rows, *, dp_size, global_batch_size, fields=None):
    """The model output and TensorDict verl's ``ppo_loss`` receives for the micro-batch ``rows``
    (``fields``: more per-row fields, e.g. the trainer hook's ``rollout_is_weights``).

    log-probs come in verl's no-padding layout: one flat tensor over prompt+response tokens of all
    sequences, the log-prob of a token stored one position before it (the model's next-token output).
    """
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu

    rows = torch.tensor(rows)
    current = current_log_probs(batch["features"][rows], weight, batch["tokens"][rows])
    mask = batch["mask"][rows]
    pieces = []
    for row, length in enumerate(mask.sum(-1).tolist()):
        pieces += [torch.zeros(PROMPT_LENGTH - 1, dtype=F64), current[row, :length], torch.zeros(1, dtype=F64)]
    data = TensorDict(
        {
            "prompts": torch.ones(len(rows), PROMPT_LENGTH, dtype=torch.long),
            "responses": batch["tokens"][rows],
            "attention_mask": torch.cat([torch.ones(len(rows), PROMPT_LENGTH, dtype=torch.long), mask.long()], dim=1),
            "response_mask": mask.long(),
            "old_log_probs": batch["behaviour"][rows],
            "advantages": advantages[rows],
            **{name: value[rows] for name, value in (fields or {}).items()},
        },
        batch_size=[len(rows)],
    )
    tu.assign_non_tensor(
        data, dp_size=dp_size, batch_num_tokens=int(batch["mask"].sum()), global_batch_size=global_batch_size
    )
    return {"log_probs": torch.cat(pieces)}, data


def policy_loss_call(batch, index, *, mini_batch, weight, dp_size, global_batch_size, **overrides):
    """The registered ``flashreinforce`` loss called the way verl's ``ppo_loss`` calls it, on the rows
    ``index`` of ``batch`` in a mini-batch of ``mini_batch`` trajectories, with the policy's ``weight``.
    ``overrides`` replace keyword arguments (``rollout_is_weights`` is None unless given; given
    ``advantages`` are not recomputed)."""
    from true_on_policy.verl_adapter import flashreinforce_registration  # noqa: F401
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    config = flashreinforce_actor_config(mini_batch, dp_size=dp_size, global_batch_size=global_batch_size)
    arguments = dict(
        old_log_prob=batch["behaviour"][index],
        log_prob=current_log_probs(batch["features"][index], weight, batch["tokens"][index]),
        advantages=None if "advantages" in overrides else verl_advantages(batch)[index],
        response_mask=batch["mask"][index],
        loss_agg_mode="seq-mean-token-mean",
        config=config,
        rollout_is_weights=None,
    )
    arguments.update(overrides)
    return get_policy_loss_fn("flashreinforce")(**arguments)
