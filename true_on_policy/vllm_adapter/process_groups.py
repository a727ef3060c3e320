"""vLLM's tensor- and expert-parallel groups, and the all-gather over them that the shared forwards
take (:mod:`true_on_policy.kernels.row_parallel`, :mod:`true_on_policy.kernels.moe`): no arithmetic, so
every rank reads every rank's bits."""

from __future__ import annotations

import torch


def tp_group():
    from vllm.distributed import get_tp_group

    return get_tp_group()


def ep_group():
    from vllm.distributed import get_ep_group

    return get_ep_group()


def gather_list(group, x: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's ``x`` of vLLM's group ``group``, in rank order (an all-gather: no arithmetic)."""
    if group.world_size == 1:
        return [x]
    return list(group.all_gather(x.unsqueeze(0).contiguous(), dim=0).unbind(0))


def gather(get_group):
    """The all-gather the shared forwards take (:mod:`true_on_policy.kernels.row_parallel`, :mod:`...moe`),
    over the group ``get_group()`` returns when it runs."""
    return lambda x: gather_list(get_group(), x)
