"""The transformers side: every change to transformers' internals is in :mod:`.patches` (checked).

The module code the patches install is :mod:`.forwards` (shared with the CPU rollout engine's
:mod:`true_on_policy.rollout.packed_forward`), its attention function :mod:`.training_attention`; a
model's TP / EP sharding :mod:`.sharding`. Which classes are patched comes from
:mod:`true_on_policy.kernels.architectures`.
"""
