"""The run report: every method of every stage side by side, each against the data-parallel baseline
(Decoupled DiLoCo: Douillard et al., "Decoupled DiLoCo for Resilient Distributed Pre-training",
arXiv 2604.21428, 2026). ``build_report(run_dir)`` rebuilds ``RUN/report/`` from the run directory's
files alone; what the report contains and how each figure is computed: docs/report.md.
"""

from reports.build import build_report
from reports.read import ReportInputError

__all__ = ["ReportInputError", "build_report"]
