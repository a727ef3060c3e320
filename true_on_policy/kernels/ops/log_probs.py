"""Log-probabilities over the full vocabulary, fp32, with a fixed-order sum.

:func:`log_softmax` and :func:`token_log_probs` share their elementwise ops, so a sampler reading the
distribution and a trainer scoring the token get the same bits for a row, whatever the batch around it.
"""

from __future__ import annotations

import torch

from true_on_policy.kernels.ops.elementwise import fixed_sum

def _shifted_and_lse(logits: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    x = logits.to(torch.float32) / temperature
    shifted = x - x.amax(dim=-1, keepdim=True)
    return shifted, torch.log(fixed_sum(torch.exp(shifted)))


def log_softmax(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """fp32 full-vocabulary ``log_softmax(logits / temperature)`` over the last dim.

    Invariant: per row, fp32 divide, exact max, fp32 exp, :func:`fixed_sum` over the whole
    vocabulary and fp32 log -- the same bits for a row whatever the batch around it. Entry
    ``[..., t]`` is bitwise :func:`token_log_probs` at label ``t`` (the same elementwise ops), so
    a sampler reading its distribution and a trainer scoring the token agree.
    Bits: rest on vml_exp and vml_log.
    """
    shifted, lse = _shifted_and_lse(logits, temperature)
    return shifted - lse


def token_log_probs(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """:func:`log_softmax` gathered at ``labels``: ``logits`` [..., V], ``labels`` [...] -> fp32 [...].

    Invariant: as :func:`log_softmax` (fp32, fixed-order full-vocabulary sum), without
    materialising the [..., V] result.
    Bits: rest on vml_exp and vml_log.
    """
    shifted, lse = _shifted_and_lse(logits, temperature)
    picked = torch.gather(shifted, -1, labels.long().unsqueeze(-1))
    return (picked - lse).squeeze(-1)
