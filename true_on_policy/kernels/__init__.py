"""Order-fixed kernels (one switch), the covered architectures (one table) and transformers' models on them, and CPU TP/EP."""
