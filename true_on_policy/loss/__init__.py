"""The FlashREINFORCE objective as a pure function (no verl import)."""
