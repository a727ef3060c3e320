"""Order-fixed kernels (one switch), the transformers Qwen3 / Qwen3-MoE models on them, and CPU TP/EP."""
