"""The CPU reference rollout engine and the async sampler's exactly-once prompt ledger (no verl import)."""
