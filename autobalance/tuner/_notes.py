"""A trial's ``outcome`` in words, and optuna-dashboard notes on the study and its trials: the study's note and the best trial's say
why it won (faster trials excluded and why, headroom, verification); a trial that ran out of
memory, went over the limit or was predicted to says so in one line at the top of its page.

Notes are Markdown kept in the study's system attributes (optuna-dashboard's format). A note a
person wrote in the dashboard is never overwritten: autobalance only rewrites notes that carry
its own last line (:data:`SIGNATURE`).
"""

from __future__ import annotations

import warnings
from typing import Any

from autobalance.protocol import Status, TrialAttr

__all__ = ["SIGNATURE", "note_for", "outcome_lines", "trial_outcome", "write_notes"]

SIGNATURE = "_(note written by autobalance)_"


def trial_outcome(attrs: dict[str, Any]) -> str:
    """The ``outcome`` user attribute: what became of the trial in a few words (``ok``, ``over limit
    (rank 0)``, ``OOM (rank 1)``, ``predicted OOM (not run)``, ...), from its other attributes."""
    from autobalance.report import outcome_label

    peaks = attrs.get(TrialAttr.PEAK_DEVICE_GIB) or []
    usable = attrs.get(TrialAttr.USABLE_GIB) or []
    ratios = [(float(p) / float(u), r) for r, (p, u) in enumerate(zip(peaks, usable, strict=False)) if p is not None and u]
    many = len(peaks) > 1
    return outcome_label(status=str(attrs.get(TrialAttr.STATUS)), feasible=bool(attrs.get(TrialAttr.FEASIBLE)),
                         failing_rank=attrs.get(TrialAttr.FAILING_RANK) if many else None,
                         worst_rank=max(ratios)[1] if ratios and many else None,
                         predicted=bool(attrs.get(TrialAttr.PREDICTED)), reused_from=attrs.get(TrialAttr.REUSED_FROM))


_KIND_ORDER = ("ok", "over limit", "OOM", "predicted OOM")


def _numbers(numbers: list[int]) -> str:
    """``#1, #3–#7, #9``: runs of three or more consecutive trials as a range."""
    numbers = sorted(set(numbers))
    parts: list[str] = []
    i = 0
    while i < len(numbers):
        j = i
        while j + 1 < len(numbers) and numbers[j + 1] == numbers[j] + 1:
            j += 1
        if j - i >= 2:
            parts.append(f"#{numbers[i]}–#{numbers[j]}")
        else:
            parts.extend(f"#{n}" for n in numbers[i:j + 1])
        i = j + 1
    return ", ".join(parts)


def outcome_lines(rows: list[Any]) -> list[str]:
    """Every trial's outcome, grouped (optuna-dashboard badges every trial "Complete"): one line per
    outcome, ``ok`` first, then over the limit, OOM and predicted, each with the failing rank, then
    anything else (timeout, error, pruned, ...). ``OOM (rank 1): #4, #6``; a reused measurement counts
    as its outcome (``ok: #1, #9 (as #1)``). Short for 50+ trials: consecutive numbers make a range."""
    groups: dict[str, list[int]] = {}
    reused: dict[str, list[str]] = {}
    for row in rows:
        label = row.outcome
        if row.reused_from is not None:
            label = label.removesuffix(f", as #{row.reused_from}")
            reused.setdefault(label, []).append(f"#{row.number} (as #{row.reused_from})")
            groups.setdefault(label, [])
        else:
            groups.setdefault(label, []).append(row.number)

    def order(label: str) -> tuple[int, str]:
        kind = next((i for i, k in enumerate(_KIND_ORDER) if label == k or label.startswith(k + " ")), len(_KIND_ORDER))
        return kind, label

    return [f"{label}: " + ", ".join(p for p in (_numbers(groups[label]), *reused.get(label, [])) if p)
            for label in sorted(groups, key=order)]


def note_for(row: Any, summary: Any, why: list[str]) -> str:
    """The Markdown note of one trial ("" for a plain trial that fits and did not win)."""
    if summary.best is not None and row.number == summary.best.number:
        lines = ["**Best trial: why it won**", "", *[f"- {s}" for s in why]]
    elif row.predicted:
        lines = [f"**{row.outcome}**: {row.reason or 'judged out of memory without launching'}.",
                 "", "Its peaks are predictions (or a lower bound from another trial), not measurements."]
    elif row.status == Status.OK and row.feasible:
        return ""
    elif row.status == Status.OK:
        from autobalance.report import excluded_reason

        lines = [f"**{row.outcome}**: {excluded_reason(row, summary)}."]
    else:
        lines = [f"**{row.outcome}**: {row.reason or row.status}."]
        if row.status == Status.OOM:
            lines += ["", "Its peaks are lower bounds (the rank stopped when it ran out)."]
    return "\n".join([*lines, "", SIGNATURE])


def write_notes(study: Any) -> int:
    """(Re)write the autobalance notes of ``study`` that changed; returns how many were written.
    Without optuna-dashboard installed this does nothing; a failure only warns."""
    try:
        from autobalance.store import dashboard_notes

        get_note_from_system_attrs, note_ver_key, save_note_with_version = dashboard_notes()
    except ImportError:
        return 0
    try:
        from autobalance.report import summarize, why_this_one
        from autobalance.store import storage_of, study_id, trial_id

        summary = summarize(study)
        why = why_this_one(summary, script=summary.script or "SCRIPT")
        storage = storage_of(study)
        sid = study_id(study)
        system = storage.get_study_system_attrs(sid)
        trials = {t.number: t for t in study.get_trials(deepcopy=False)}
        wanted: list[tuple[int | None, str]] = [(trial_id(trials[row.number]), note_for(row, summary, why))
                                                for row in summary.rows]
        best = summary.best
        head = (f"**autobalance: trial {best.number} is the best**" if best is not None
                else "**autobalance: no configuration fits yet**")
        outcomes = [f"**Trials by outcome** ({len(summary.rows)}; optuna-dashboard marks them all Complete)", "",
                    *[f"- {line}" for line in outcome_lines(summary.rows)]]
        wanted.append((None, "\n".join([head, "", *[f"- {s}" for s in why], "", *outcomes, "", SIGNATURE])))  # the study's note
        written = 0
        for note_trial, body in wanted:
            current = get_note_from_system_attrs(system, note_trial)
            if current["body"] == body or (current["body"] and not current["body"].endswith(SIGNATURE)):
                continue  # unchanged, or a person's own note
            save_note_with_version(storage, sid, note_trial, int(system.get(note_ver_key(note_trial), 0)) + 1,
                                   body)
            written += 1
        return written
    except Exception as exc:  # notes are a courtesy: never fail a study over them
        warnings.warn(f"autobalance: the dashboard notes of {study.study_name!r} were not written ({exc})", stacklevel=2)
        return 0
