"""The GPU day-one kit: the steps ``benchmarks/gpu_check.py`` runs, each in its own time-boxed process.

Each step module has ``run(ctx)`` (records figures and problems on a :class:`~benchmarks.gpu_kit.kit.Context`) and
``summarize(figures)`` (lines for the readable summary); it imports torch and the frameworks inside ``run`` only.
"""
