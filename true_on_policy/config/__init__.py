"""The `true_on_policy:` config section and the FlashREINFORCE config invariants (no verl import)."""
