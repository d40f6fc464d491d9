"""Run reports: figures and a self-contained HTML page from run folders (``trainer-ext report``).

matplotlib is imported only when figures are drawn (``pip install 'matplotlib>=3.7'``, the ``report`` extra).
"""

from trainer_ext.report.build import write_report
from trainer_ext.report.run import RunData, load_run, load_runs

__all__ = ["RunData", "load_run", "load_runs", "write_report"]
