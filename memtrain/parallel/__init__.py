"""DeepSpeed engine set-up and sharded checkpoints (later: the row-sharded memory bank)."""
