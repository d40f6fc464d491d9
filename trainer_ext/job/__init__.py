"""The ``train(args)`` job behind ``trainer-ext train``: arguments and flags, model and data, LoRA, the output folder and its lock."""
