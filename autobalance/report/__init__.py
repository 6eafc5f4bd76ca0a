"""Seeing the imbalance: the HTML report of a study, per-trial memory charts as Optuna artifacts,
and the dashboard. It only reads studies (``diagnose``, which runs a trial, is its own package).

Plotting libraries and optuna-dashboard are imported inside the functions that need them.
"""

from __future__ import annotations

from autobalance.report._artifacts import artifact_dir_for, render_trial_chart, upload_trial_chart
from autobalance.report._dashboard import dashboard_app, serve_dashboard
from autobalance.report._html import ReportFiles, build_report
from autobalance.report._importance import param_importances
from autobalance.report._rows import StudySummary, TrialRow, outcome_label, pareto_front, summarize
from autobalance.report._why import excluded_reason, why_this_one

__all__ = [
    "ReportFiles",
    "StudySummary",
    "TrialRow",
    "artifact_dir_for",
    "build_report",
    "dashboard_app",
    "excluded_reason",
    "outcome_label",
    "param_importances",
    "pareto_front",
    "render_trial_chart",
    "serve_dashboard",
    "summarize",
    "upload_trial_chart",
    "why_this_one",
]
