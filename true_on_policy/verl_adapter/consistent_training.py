"""The project's model code on verl's training side (CPU platform; CUDA with ``kernels: project``).

The model half is :func:`true_on_policy.transformers_adapter.forwards.patch_transformers`: the same module code
the CPU rollout engine runs, registered as ``attn_implementation="consistent"``. On the CPU platform
it is installed whatever the flag, since the CPU configs name that attention; with the flag off it
runs the default kernels (SDPA, F.linear), with the flag on the consistent ones. Whether they run is
``Settings.consistent_kernels``, the one switch the vLLM plugin reads too.

Under Ulysses sequence parallelism the model code all-to-alls over verl's SP group
(:func:`use_ulysses_group`; :mod:`true_on_policy.kernels.sequence_parallel`).

The other half is the log-prob itself: verl's FSDP engine turns logits into token log-probs with
``verl.utils.torch_functional.logprobs_from_logits``, bound by name in
``verl.workers.engine.fsdp.transformer_impl``; with the flag on it becomes the project's fp32
full-vocabulary log-softmax, the one the rollout engine samples from (patched through
:mod:`true_on_policy.verl_adapter.patches`).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

# Set by the launch for rollout.name=vllm: len(tokenizer). verl's vLLM rollout sets the logits of
# ids >= len(tokenizer) to -inf before sampling; the training log-prob applies the same mask.
ROLLOUT_VOCAB_ENV = "TRUE_ON_POLICY_ROLLOUT_VOCAB"


def consistent_logprobs_from_logits(logits, labels, inplace_backward=True):
    """verl's ``logprobs_from_logits`` signature on the consistent log-softmax."""
    from true_on_policy.kernels import ops

    return ops.token_log_probs(logits, labels)


def mask_out_of_vocabulary(logprobs_from_logits, vocab: int):
    """``logprobs_from_logits`` on logits whose ids >= ``vocab`` are -inf (selected, not added)."""
    import torch

    @functools.wraps(logprobs_from_logits)
    def masked(logits, labels, inplace_backward=True):
        keep = torch.arange(logits.shape[-1], device=logits.device) < vocab
        return logprobs_from_logits(torch.where(keep, logits, float("-inf")), labels, inplace_backward)

    return masked


def activate(settings) -> None:
    """The training engine's kernels from the exported settings: the one switch is
    ``settings.consistent_kernels``; the CPU platform installs the model code with the flag off too."""
    if settings.platform.cpu_backend or settings.consistent_kernels:
        _activate(settings.consistent_kernels)
    # else kernels: engine (or kernels: project with the flag off) on a device: verl's own model code


def use_ulysses_group() -> None:
    """The training attention and Gated DeltaNet all-to-all over verl's Ulysses group (the one its FSDP
    engine sets around each forward; None at SP 1)."""
    from true_on_policy.kernels import sequence_parallel
    from true_on_policy.verl_adapter import patches

    sequence_parallel.set_group_source(patches.check_target("verl.utils.ulysses.get_ulysses_sequence_parallel_group"))


@functools.cache
def _activate(consistent: bool) -> None:
    from true_on_policy.transformers_adapter.forwards import patch_transformers
    from true_on_policy.kernels import ops
    from true_on_policy.verl_adapter import patches

    patch_transformers()
    use_ulysses_group()
    if consistent:
        ops.set_switches(consistent=True)
    vocab = os.environ.get(ROLLOUT_VOCAB_ENV)
    if consistent or vocab:
        # where verl's FSDP engine module is imported (the training workers), not in every process the plugin loads in
        vocab_size = int(vocab) if vocab else None
        patches.when_imported(patches.FSDP_ENGINE_MODULE, lambda _: patches.install_logprobs_from_logits(
            _logprobs_from_logits(consistent, vocab_size)))


def _logprobs_from_logits(consistent: bool, vocab: int | None) -> Callable:
    """The training engine's token log-probs: the consistent op with the flag on (verl's own off), masked to the
    rollout's vocabulary where it is smaller (flag on or off: the mask is part of what the rollout samples from)."""
    from true_on_policy.verl_adapter import patches

    base = (consistent_logprobs_from_logits if consistent
            else patches.check_target(f"{patches.FSDP_ENGINE_MODULE}.logprobs_from_logits"))
    return base if vocab is None else mask_out_of_vocabulary(base, vocab)
