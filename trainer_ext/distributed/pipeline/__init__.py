"""Pipeline parallelism (ours): a transformers decoder split into stages, driven by torch.distributed.pipelining."""
