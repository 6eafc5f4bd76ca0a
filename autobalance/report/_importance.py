"""Parameter importances of a study, when there are enough complete trials to say anything."""

from __future__ import annotations

import warnings
from typing import Any

from autobalance.protocol import StudyAttr, weighted_objective

__all__ = ["MIN_TRIALS_FOR_IMPORTANCE", "param_importances"]

MIN_TRIALS_FOR_IMPORTANCE = 5


def param_importances(study: Any, *, min_trials: int = MIN_TRIALS_FOR_IMPORTANCE) -> tuple[dict[str, float] | None, str]:
    """``(importances, note)``: importances is None (and note says why) when they cannot be computed."""
    import optuna
    from optuna.trial import TrialState

    complete = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)) if t.values]
    if len(complete) < min_trials:
        return None, f"needs at least {min_trials} complete trials ({len(complete)} so far)"
    varying = {name for name in {k for t in complete for k in t.params}
               if len({repr(t.params.get(name)) for t in complete}) > 1}
    if not varying:
        return None, "no parameter varied across the complete trials"
    target = None
    target_name = "objective"
    if len(study.directions) > 1:
        obj = study.user_attrs.get(StudyAttr.OBJECTIVE) or {}

        def target(t: Any) -> float:
            return weighted_objective(t.values, obj)

        target_name = "weighted spread + time"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = optuna.importance.get_param_importances(study, target=target)
    except Exception as exc:
        return None, f"could not be computed ({type(exc).__name__}: {str(exc)[:200]})"
    result = {k: float(v) for k, v in result.items()}
    if not result:
        return None, "no parameter importances (no parameter varied)"
    return result, f"importance for the {target_name}, from {len(complete)} complete trials"
