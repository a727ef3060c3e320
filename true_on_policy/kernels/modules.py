"""The torch modules on the consistent ops that a model's linears become, and the checks of a module's parts.

:class:`ConsistentLinear` (and :class:`ConsistentLMHead`, fp32 logits) is ``nn.Linear`` with the same
parameters, its forward :func:`ops.linear` while the flag is on, ``F.linear`` while it is off. The
checks raise :class:`~true_on_policy.kernels.architectures.UnsupportedFeatureError` naming what is
not covered. Pure torch; the adapters decide which modules of an engine's model become these.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from true_on_policy.kernels import ops
from true_on_policy.kernels.architectures import UnsupportedFeatureError

__all__ = ["ConsistentLinear", "ConsistentLMHead", "require_consistent_linears", "require_silu"]


class ConsistentLinear(nn.Linear):
    """``nn.Linear`` whose forward is :func:`ops.linear` while the flag is on."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if ops.enabled():
            return ops.linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


class ConsistentLMHead(ConsistentLinear):
    """The LM head: consistent linear with fp32 logits while the flag is on."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if ops.enabled():
            return ops.linear(x, self.weight, self.bias, out_dtype=torch.float32)
        return F.linear(x, self.weight, self.bias)


def require_consistent_linears(module: nn.Module, names) -> None:
    for name in names:
        child = getattr(module, name)
        if not isinstance(child, ConsistentLinear):
            raise UnsupportedFeatureError(
                f"true_on_policy: {type(module).__name__}.{name} is a {type(child).__name__}, not a "
                "ConsistentLinear: wrapped linears (e.g. LoRA adapters) are not covered; a model built "
                "before patch_transformers() is converted by its causal-LM forward or convert_model(model)"
            )


def require_silu(module) -> None:
    act = getattr(module.config, "hidden_act", None)
    if act != "silu":
        raise UnsupportedFeatureError(f"true_on_policy: activation {act!r} is not supported (only 'silu')")

