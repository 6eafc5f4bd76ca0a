"""Which study a reading command (``trials``, ``best``, ``report``, ``export``) shows when ``--study-name``
is left out: the only one in the storage, or the most recently tuned one (said in one line on stderr);
with several and none tuned lately, one line listing them."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from autobalance._errors import UsageError

__all__ = ["RECENT_S", "StudyActivity", "choose_study", "resolve_study_name"]

RECENT_S = 24 * 3600.0
"""A study whose last trial (or saved configuration) is at most this old counts as recently tuned."""


@dataclass(frozen=True, kw_only=True)
class StudyActivity:
    """One study of a storage and when it was last tuned."""

    name: str
    """The study's name."""
    last: float | None
    """When its last trial started or ended, or its configuration was saved (Unix time; None: never)."""


def _ago(seconds: float) -> str:
    if seconds < 90:
        return f"{max(0, round(seconds))} s ago"
    if seconds < 90 * 60:
        return f"{round(seconds / 60)} min ago"
    if seconds < 36 * 3600:
        return f"{round(seconds / 3600)} h ago"
    return f"{round(seconds / 86400)} days ago"


def choose_study(studies: list[StudyActivity], *, where: str, now: float, saved: bool = False) -> tuple[str, str]:
    """``(name, the line that says why)`` of the study to show; a :class:`UsageError` (one line) when
    there is none, or several and none tuned in the last :data:`RECENT_S` seconds. ``saved``: the
    candidates are the studies with a saved configuration."""
    what = "study with a saved configuration" if saved else "study"
    many = "studies with a saved configuration" if saved else "studies"
    if not studies:
        raise UsageError(f"--study-name not given and {where} holds no {what}; run `autobalance tune SCRIPT` first "
                         "(or pass --storage with the database it wrote).")
    if len(studies) == 1:
        return studies[0].name, f"autobalance: study {studies[0].name} (the only {what} in {where})"
    ranked = sorted(studies, key=lambda s: (s.last is not None, s.last or 0.0), reverse=True)
    latest = ranked[0]
    if latest.last is None or now - latest.last > RECENT_S:
        listing = ", ".join(f"{s.name} ({'no trial yet' if s.last is None else _ago(now - s.last)})" for s in ranked)
        raise UsageError(f"--study-name not given and {where} holds {len(studies)} {many}, none tuned in the last "
                         f"{RECENT_S / 3600:.0f} hours: {listing}; pass --study-name NAME.")
    others = ", ".join(s.name for s in ranked[1:])
    return latest.name, (f"autobalance: study {latest.name}, the most recently tuned of {len(studies)} in {where} "
                         f"({_ago(now - latest.last)}; also {others}); --study-name picks another")


def _optuna_activity(url: str) -> dict[str, float | None]:
    """Each Optuna study of ``url`` and when its last trial started or ended."""
    import optuna

    from autobalance.store import list_studies, open_storage

    storage = open_storage(url, heartbeat=False)
    out: dict[str, float | None] = {}
    for name in list_studies(storage):
        stamps = [d.timestamp() for t in optuna.load_study(study_name=name, storage=storage).get_trials(deepcopy=False)
                  for d in (t.datetime_start, t.datetime_complete) if d is not None]  # Optuna's naive local time
        out[name] = max(stamps) if stamps else None
    return out


def resolve_study_name(study_name: str | None, url: str, *, saved: bool = False,
                       say: Callable[[str], None] | None = None, now: float | None = None) -> str:
    """``study_name``, or the study :func:`choose_study` picks in ``url`` (``saved``: among the studies
    with a saved configuration, for ``best`` and ``export``); ``say`` gets the line that says which."""
    if study_name:
        return study_name
    from autobalance.store import ConfigStore, mask_url

    activity = _optuna_activity(url)
    if saved:
        with ConfigStore(url=url) as store:
            names = store.list_saved()
            times = {name: store.load(name).created_at.timestamp() for name in names}
        studies = [StudyActivity(name=n, last=max(t for t in (activity.get(n), times[n]) if t is not None))
                   for n in names]
    else:
        studies = [StudyActivity(name=n, last=last) for n, last in activity.items()]
    name, line = choose_study(studies, where=mask_url(url), now=time.time() if now is None else now, saved=saved)
    if say is not None:
        say(line)
    return name
