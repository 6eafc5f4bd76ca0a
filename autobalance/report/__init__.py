"""Seeing the imbalance: the HTML report of a study, per-trial memory charts as Optuna artifacts,
the dashboard, and ``diagnose`` (per-rank memory breakdown and likely causes).

Plotting libraries are imported inside the functions that need them.
"""

from __future__ import annotations

from autobalance.report._artifacts import artifact_dir_for, render_trial_chart, upload_trial_chart

__all__ = ["artifact_dir_for", "render_trial_chart", "upload_trial_chart"]
