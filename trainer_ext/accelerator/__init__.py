"""accelerate's ``Accelerator`` for hand-written loops, on the same engine as the Trainer."""
