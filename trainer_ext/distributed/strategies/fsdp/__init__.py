"""The FSDP2 strategy: ``fully_shard`` wrapping, its plugin and config reader, its sharded checkpoints."""
