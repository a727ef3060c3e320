"""The transformers side: every change to transformers' internals is in :mod:`.patches` (checked).

The module code the patches install is :mod:`true_on_policy.kernels.model` (shared with the CPU
rollout engine); which classes are patched comes from :mod:`true_on_policy.kernels.architectures`.
"""
