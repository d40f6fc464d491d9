"""Big-model inference: spread a model's layers over GPUs, CPU and disk, and run it as if on one device.

    infer_auto_device_map(model, max_memory)          -> {"model.layers.0": 0, ..., "lm_head": "cpu"}
    dispatch_model(model, device_map="auto")          a loaded model: place, offload, hook
    load_checkpoint_and_dispatch(cls, "ckpt/", ...)   build on meta, read each weight to its device

Nothing here imports accelerate; device maps use the same values as transformers' ``hf_device_map``.
"""

from trainer_ext.inference.device_map import infer_auto_device_map
from trainer_ext.inference.devices import normalize_device, parse_size
from trainer_ext.inference.dispatch import dispatch_model
from trainer_ext.inference.hooks import remove_hooks, send_to_device
from trainer_ext.inference.loading import init_empty_weights, load_checkpoint_and_dispatch
from trainer_ext.inference.summary import dispatch_summary

__all__ = [
    "dispatch_model",
    "dispatch_summary",
    "infer_auto_device_map",
    "init_empty_weights",
    "load_checkpoint_and_dispatch",
    "normalize_device",
    "parse_size",
    "remove_hooks",
    "send_to_device",
]
