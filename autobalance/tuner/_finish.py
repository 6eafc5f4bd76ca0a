"""The end of ``tune``: verify the study's best trial and save it (or the next best that verifies)."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from autobalance.protocol import NOT_COUNTED, Status, StudyAttr, TrialAttr, best_trial
from autobalance.tuner._remeasure import saved_spread, spread_text
from autobalance.tuner._settings import TuneSettings
from autobalance.tuner._summary import TuneResult, baseline_won, record_time_spent

if TYPE_CHECKING:
    from autobalance.launcher import WarmPool

__all__ = ["Saving", "best_so_far", "nothing_feasible", "save_best"]


@dataclass(kw_only=True)
class Saving:
    """What :func:`save_best` did: the ``trial`` saved as the study's best configuration (None:
    nothing saved), the trials ``rejected`` by verification (in this run or an earlier one: never
    saved) and, when the study has no feasible trial, what its trials ran into and what to change."""

    trial: int | None = None
    rejected: list[int] = field(default_factory=list)
    nothing_feasible: str = ""

    def check(self) -> None:
        """Raise :class:`~autobalance._errors.VerificationError` when every candidate failed verification
        (nothing saved: ``tune`` is then not a success)."""
        if self.trial is not None or not self.rejected:
            return
        from autobalance._errors import VerificationError

        trials = ", ".join(str(n) for n in self.rejected)
        raise VerificationError(
            f"nothing was saved: every configuration tried failed verification (trial(s) {trials}; the reasons are "
            "above). Fix what they name in the script (most often a loss that is not a per-sample mean: a token "
            "mean needs plan.steps(loader, count=...), or the integration's count: Lightning's {'loss', 'count'}, "
            "Accelerate's balance.backward(loss, count=...); a sum must become a mean; README: Losses), then "
            "tune a new study (--study-name), or re-verify one of these trials with `autobalance verify SCRIPT "
            "--study-name NAME --trial N` and save it with `autobalance promote`; until then keep the script's "
            "own configuration."
        )


def save_best(*, settings: TuneSettings, result: TuneResult, note: Callable[[str], None] | None = None,
              pool: WarmPool | None = None) -> Saving:
    """Verify ``result.best`` (unless ``settings.verify`` is off) and save it to the store; when it fails, the
    next best that passes is saved instead. Updates ``result`` (``best``, ``saved``, ``notes``) for the summary
    and returns what was saved and what was rejected. ``pool``: the study's warm pool, kept by the tuner
    (:attr:`Tuner.kept_pool`; the caller closes it): the verification runs in its workers."""
    from autobalance.store import load_study
    from autobalance.tuner._verify import save_trial, verify_for_saving

    study = load_study(study_name=settings.study_name, storage_url=settings.storage)
    if result.best is None:
        return Saving(nothing_feasible=nothing_feasible(study))
    chosen = result.best
    if settings.verify:  # a configuration that fails verification is never saved
        started = time.monotonic()
        before = _verdicts(study)
        try:
            chosen = verify_for_saving(settings=settings, study=study, best=result.best, baseline=result.baseline,
                                       notes=result.notes, note=note, pool=pool)
        finally:
            if _verdicts(study) != before:  # a verdict kept from an earlier run is not this run's work
                record_time_spent(study, result, verify_s=time.monotonic() - started)
    rejected = sorted(int(key.removeprefix(StudyAttr.VERIFY_PREFIX)) for key, verdict in _verdicts(study).items()
                      if isinstance(verdict, dict) and not verdict.get("passed"))
    if chosen is None:
        return Saving(rejected=rejected)
    if chosen.number != result.best.number:
        result.notes.append(f"Trial {chosen.number} is saved instead of trial {result.best.number}.")
        result.best = chosen
    save_trial(storage_url=settings.storage, study=study, trial_number=chosen.number, action="tune")
    result.saved = True
    if result.baseline is not None and chosen.number == result.baseline.number:
        result.notes.append(baseline_won(study, baseline=chosen.number, study_name=settings.study_name))
    else:
        figure = f": {spread_text(spread)}" if (spread := saved_spread(study, chosen)) is not None else ""
        result.notes.append(f"Saved trial {chosen.number} as the best configuration of '{settings.study_name}'{figure}.")
    return Saving(trial=chosen.number, rejected=rejected)


def _verdicts(study: Any) -> dict[str, Any]:
    """The study's verification verdicts (study attributes), by trial."""
    return {k: v for k, v in study.user_attrs.items() if k.startswith(StudyAttr.VERIFY_PREFIX)}


def _why_infeasible(trial: Any) -> str:
    """The class of a trial that is not feasible (see :func:`nothing_feasible`)."""
    a = trial.user_attrs
    status = a.get(TrialAttr.STATUS)
    if status == Status.OK:
        peaks = a.get(TrialAttr.PEAK_DEVICE_GIB) or []
        capacity = a.get("capacity_gib") or []
        usable = a.get(TrialAttr.USABLE_GIB) or []
        if any(p is not None and c and p > c for p, c in zip(peaks, capacity, strict=False)):
            return "over"
        if any(p is not None and u and p > u for p, u in zip(peaks, usable, strict=False)):
            return "headroom"
        return "spread"
    if status in (Status.OOM, Status.PREDICTED_OOM):
        return "oom"
    if status == Status.PRUNED or trial.state.name == "PRUNED":
        return "pruned"
    return "failed"


def nothing_feasible(study: Any) -> str:
    """Why a study has no feasible trial, counted by cause, and what to change; e.g. "of 3 trials, 3
    ran but left less than the headroom free (...). Try --headroom 0 ..." """
    counted = [t for t in study.get_trials(deepcopy=False)
               if t.state.name in ("COMPLETE", "FAIL", "PRUNED")
               and t.user_attrs.get(TrialAttr.STATUS) not in NOT_COUNTED]
    if not counted:
        return "no trial finished. Run the command again to start the study."
    why = Counter(_why_infeasible(t) for t in counted)
    headroom = (study.user_attrs.get(StudyAttr.OBJECTIVE) or {}).get("headroom")
    shown = f" {headroom:g}" if isinstance(headroom, (int, float)) else ""
    words = {  # each cause: what its trials did, and what to change (None: nothing but more trials)
        "headroom": ("ran but left less than the headroom free (peak above capacity x (1 - "
                     f"--headroom{shown}))", "a smaller --headroom (e.g. 0)"),
        "over": ("ran but peaked above the memory cap (judged, not enforced)", "a larger --memory-cap-gib"),
        "spread": ("ran but their spread was above --max-spread-gib", "a larger --max-spread-gib"),
        "oom": ("ran out of memory (or were predicted to)", "a larger --memory-cap-gib"),
        "pruned": ("were stopped early as slower than the best", None),
        "failed": ("failed (timeout, crash or script error; see `autobalance trials`)",
                   "a look at the failed trials' reasons"),
    }
    parts = [f"{n} {words[k][0]}" for k, n in why.most_common()]
    fixes = [fix for k, _ in why.most_common() if (fix := words[k][1])]
    todo = [*dict.fromkeys(fixes), "more --trials"]
    advice = todo[0] if len(todo) == 1 else f"{', '.join(todo[:-1])} or {todo[-1]}"
    return f"of {len(counted)} trial(s), {'; '.join(parts)}. Try {advice}."


def best_so_far(*, study_name: str, storage_url: str) -> Any:
    """The study's best feasible trial now (None: none yet, or the study cannot be read)."""
    from autobalance.store import load_study

    try:
        return best_trial(load_study(study_name=study_name, storage_url=storage_url))
    except Exception:  # an interrupted run may not have created the study yet
        return None
