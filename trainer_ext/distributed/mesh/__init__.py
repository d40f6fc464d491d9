"""The N-D device mesh: accelerate's ``ParallelismConfig`` (the size of each parallel dimension, checked up front)
and the ``DeviceMesh`` built from it, with accelerate's dimension order and flattened data-parallel views."""
