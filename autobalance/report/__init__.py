"""Seeing the imbalance: the HTML report of a study, per-trial memory charts as Optuna artifacts,
the dashboard, and ``diagnose`` (per-rank memory breakdown and likely causes).

Plotting libraries, optuna-dashboard and the launcher are imported inside the functions that need them.
"""

from __future__ import annotations

from autobalance.report._artifacts import artifact_dir_for, render_trial_chart, upload_trial_chart
from autobalance.report._dashboard import dashboard_app, serve_dashboard
from autobalance.report._diagnose import (
    Diagnosis,
    Finding,
    RankBreakdown,
    analyse,
    print_diagnosis,
    run_diagnose,
    tune_command,
)
from autobalance.report._html import ReportFiles, build_report
from autobalance.report._importance import param_importances
from autobalance.report._rows import StudySummary, TrialRow, pareto_front, summarize

__all__ = [
    "Diagnosis",
    "Finding",
    "RankBreakdown",
    "ReportFiles",
    "StudySummary",
    "TrialRow",
    "analyse",
    "artifact_dir_for",
    "build_report",
    "dashboard_app",
    "param_importances",
    "pareto_front",
    "print_diagnosis",
    "render_trial_chart",
    "run_diagnose",
    "serve_dashboard",
    "summarize",
    "tune_command",
    "upload_trial_chart",
]
