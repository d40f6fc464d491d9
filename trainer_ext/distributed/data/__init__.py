"""Dataloaders across processes: sharded samplers and batches, dispatching, iterable datasets, resumable positions."""
