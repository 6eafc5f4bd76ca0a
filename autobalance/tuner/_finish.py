"""The end of ``tune``: verify the study's best trial and save it (or the next best that verifies)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from autobalance.tuner._settings import TuneSettings
from autobalance.tuner._study import TuneResult

__all__ = ["Saving", "save_best"]


@dataclass(kw_only=True)
class Saving:
    """What :func:`save_best` did."""

    trial: int | None = None
    """The trial saved as the study's best configuration (None: nothing saved)."""
    rejected: list[int] = field(default_factory=list)
    """Trials that failed verification (in this run or an earlier one): never saved."""

    @property
    def rejected_all(self) -> bool:
        """Nothing was saved because every candidate failed verification."""
        return self.trial is None and bool(self.rejected)


def save_best(*, settings: TuneSettings, result: TuneResult,
              note: Callable[[str], None] | None = None) -> Saving:
    """Verify ``result.best`` (unless ``settings.verify`` is off) and save it to the store; when it
    fails, the next best that passes is saved instead. Updates ``result`` (``best``, ``saved``,
    ``notes``) for the summary and returns what was saved and what was rejected."""
    from autobalance.tuner._promote import save_trial
    from autobalance.tuner._storage import load_study
    from autobalance.tuner._verify import ATTR_VERIFY_PREFIX, verify_for_saving

    if result.best is None:
        return Saving()
    study = load_study(study_name=settings.study_name, storage_url=settings.storage)
    chosen = result.best
    if settings.verify:  # a configuration that fails verification is never saved
        chosen = verify_for_saving(settings=settings, study=study, best=result.best, baseline=result.baseline,
                                   notes=result.notes, note=note)
    verdicts = study.user_attrs
    rejected = sorted(int(key[len(ATTR_VERIFY_PREFIX):]) for key, verdict in verdicts.items()
                      if key.startswith(ATTR_VERIFY_PREFIX) and isinstance(verdict, dict) and not verdict.get("passed"))
    if chosen is None:
        return Saving(rejected=rejected)
    if chosen.number != result.best.number:
        result.notes.append(f"Trial {chosen.number} is saved instead of trial {result.best.number}.")
        result.best = chosen
    save_trial(storage_url=settings.storage, study=study, trial_number=chosen.number, action="tune")
    result.saved = True
    result.notes.append(f"Saved trial {chosen.number} as the best configuration of '{settings.study_name}'.")
    return Saving(trial=chosen.number, rejected=rejected)
