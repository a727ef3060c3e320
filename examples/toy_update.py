"""FlashREINFORCE in a plain optimizer step, on CPU, in seconds: no verl, no Ray, no model hub.

    python examples/toy_update.py [--steps 40] [--batch 64] [--json]

A toy policy (one table of logits per prompt and position) samples ONE response per prompt and
records the log-probs it sampled with; the reward is the fraction of positions holding the prompt's
target token. Each batch makes one optimizer step on :func:`true_on_policy.loss.flashreinforce_loss`:
advantage ``R_i - mean(R)`` over the batch, the token ratio against the recorded log-probs, the
Sequence Trust Region gate, the sample mean. The mean reward rises from chance (1/VOCAB) towards 1.
"""

from __future__ import annotations

import argparse
import json

import torch

from true_on_policy.loss.flashreinforce import flashreinforce_loss

PROMPTS, LENGTH, VOCAB = 16, 6, 8


def targets() -> torch.Tensor:
    """[PROMPTS, LENGTH]: the token each prompt wants at each position."""
    return (torch.arange(PROMPTS)[:, None] + torch.arange(LENGTH)[None, :]) % VOCAB


def sample(logits: torch.Tensor, prompts: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """One rollout per prompt: the tokens and the log-probs the sampler recorded (no gradient)."""
    with torch.no_grad():
        log_probs = torch.log_softmax(logits[prompts], dim=-1)
        tokens = torch.multinomial(log_probs.exp().reshape(-1, VOCAB), 1, generator=generator).reshape(len(prompts), LENGTH)
        return tokens, log_probs.gather(-1, tokens[..., None]).squeeze(-1)


def train(steps: int, batch: int, seed: int = 0) -> list[dict[str, float]]:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.zeros(PROMPTS, LENGTH, VOCAB, requires_grad=True)
    optimizer = torch.optim.Adam([logits], lr=0.1)
    goal, history = targets(), []
    for step in range(steps):
        prompts = torch.randint(PROMPTS, (batch,), generator=generator)
        tokens, behaviour_log_probs = sample(logits, prompts, generator)
        rewards = (tokens == goal[prompts]).float().mean(dim=1)
        log_probs = torch.log_softmax(logits[prompts], dim=-1).gather(-1, tokens[..., None]).squeeze(-1)
        mask = torch.ones_like(tokens, dtype=torch.bool)
        loss, stats = flashreinforce_loss(log_probs, behaviour_log_probs, rewards, mask, delta=3e-3)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()  # one optimizer step per batch
        history.append({"step": step, "reward": rewards.mean().item(), "acceptance_rate": stats["acceptance_rate"].item()})
    return history


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--json", action="store_true", help="print the per-step history as JSON alone on stdout")
    args = parser.parse_args()
    history = train(args.steps, args.batch)
    if args.json:
        print(json.dumps(history))
        return
    for record in history[:: max(1, args.steps // 8)] + history[-1:]:
        print(f"step {record['step']:3d}  reward {record['reward']:.3f}  acceptance {record['acceptance_rate']:.2f}")


if __name__ == "__main__":
    main()
