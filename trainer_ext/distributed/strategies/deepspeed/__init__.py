"""The DeepSpeed strategy: ``deepspeed.initialize``, its plugin and config reader, its checkpoint files."""
