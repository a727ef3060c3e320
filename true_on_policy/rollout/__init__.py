"""The CPU reference rollout engine, its packed forward over per-request KV caches, and the async sampler's
exactly-once prompt ledger (no verl import)."""
