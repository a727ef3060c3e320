"""The vLLM backend of the plugin: vLLM's own model code (kernels/architectures.py) on the consistent ops.

Loaded by vLLM through the ``vllm.general_plugins`` entry point (:mod:`.plugin`) in every vLLM
process; inert unless the recipe's exported settings ask for it. Everything that touches vLLM's
internals is in :mod:`.patches` (signature-checked); the replacements it installs are
:mod:`.custom_ops` (norms, activation, RoPE), :mod:`.linear_layers` (linear method, LM head,
row-parallel linear, embedding, log-softmax; their packs in :mod:`.weight_packs`), :mod:`.moe_block`,
:mod:`.hybrid_layers` (Qwen3.5's gated attention and Gated DeltaNet) and :mod:`.attention_backends`.
"""
