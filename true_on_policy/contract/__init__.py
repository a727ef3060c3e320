"""The training/rollout consistency contract and the per-platform determinism plan (no verl import)."""
