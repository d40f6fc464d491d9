"""Drop-in parity for hand-written loops: the same scripts on ``accelerate.Accelerator`` and ``trainer_ext.Accelerator``."""
