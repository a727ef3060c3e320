"""The vLLM backend of the plugin: vLLM's own model code (kernels/architectures.py) on the consistent ops.

Loaded by vLLM through the ``vllm.general_plugins`` entry point (:mod:`.plugin`) in every vLLM
process; inert unless the recipe's exported settings ask for it. Everything that touches vLLM's
internals is in :mod:`.patches` (signature-checked); :mod:`.layers` holds the replacement
modules (out-of-tree custom ops, the attention backend, the linear method).
"""
