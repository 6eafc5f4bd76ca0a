"""Which trials of a study count as feasible, and which one is the best: shared by the tuner, the
report, the CLI views and production loading (optuna is imported by the caller)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from autobalance.protocol._attrs import CONSTRAINTS_KEY, StudyAttr, TrialAttr
from autobalance.protocol._status import Status
from autobalance.protocol._units import memory_pair

if TYPE_CHECKING:
    import optuna
    from optuna.trial import FrozenTrial

__all__ = ["best_trial", "best_value", "is_feasible", "objective_value", "over_limit", "pooled_values", "rank_trials",
           "ranked_trials", "study_ranks",
           "time_in_steps_s", "trial_ranks", "weighted_objective", "would_be_best"]


def is_feasible(trial: FrozenTrial) -> bool:
    """Complete, measured (status ok) and within every constraint (memory, spread)."""
    from optuna.trial import TrialState

    cons = trial.system_attrs.get(CONSTRAINTS_KEY)
    return bool(trial.state == TrialState.COMPLETE and cons is not None and all(c <= 0 for c in cons)
                and trial.user_attrs.get(TrialAttr.STATUS) == Status.OK)


def over_limit(user_attrs: Mapping[str, Any]) -> str | None:
    """Why a trial that ran to the end (status ``ok``) is infeasible all the same, in words: ``over
    the usable limit (rank 0: 14.3 MiB > 14.1 MiB usable)``, or a spread over ``--max-spread-gib``;
    None for a feasible trial and for one whose status already says it (``oom``, ``predicted_oom``, ...)."""
    if user_attrs.get(TrialAttr.STATUS) != Status.OK or user_attrs.get(TrialAttr.FEASIBLE) is not False:
        return None
    peaks = user_attrs.get(TrialAttr.PEAK_DEVICE_GIB) or []
    usable = user_attrs.get(TrialAttr.USABLE_GIB) or []
    pairs = [(r, float(p), float(u)) for r, (p, u) in enumerate(zip(peaks, usable, strict=False)) if p is not None and u]
    over = [(r, p, u) for r, p, u in pairs if p > u]
    if not over and pairs and float(user_attrs.get("memory_constraint") or 0.0) > 0:
        over = [max(pairs, key=lambda x: x[1] / x[2])]  # over by less than the attributes' rounding
    if not over:
        return "over the --max-spread-gib limit (memory spread)"
    many = len(peaks) > 1
    parts = []
    for r, p, u in over:  # in one unit, with as many digits as tell the two apart
        peak, limit = memory_pair(p, u)
        parts.append(f"{f'rank {r}: ' if many else ''}{peak} > {limit} usable")
    return f"over the usable limit ({'; '.join(parts)})"


def objective_value(spread: float, time_norm: float, *, weight_spread: float, weight_time: float) -> float:
    """The single objective: ``weight_spread`` x the memory spread (fraction of capacity) +
    ``weight_time`` x the step time normalised by the study's reference step time."""
    return float(weight_spread * spread + weight_time * time_norm)


def weighted_objective(values: list[float] | tuple[float, ...], objective: dict[str, Any]) -> float:
    """One number for a trial's objective values: the value itself, or on a Pareto front (spread,
    time) :func:`objective_value` with the study's weights."""
    if len(values) == 1:
        return float(values[0])
    return objective_value(values[0], values[1], weight_spread=objective.get("weight_spread", 1.0),
                           weight_time=objective.get("weight_time", 1.0))


def ranked_trials(study: optuna.Study) -> list[FrozenTrial]:
    """The study's candidates for its best trial, best first: the one meaning of "best" that the
    loop (re-measure, pruning), the recorder, verification and the views all read
    (:func:`rank_trials` over the study's trials and objective)."""
    return rank_trials(study.get_trials(deepcopy=False), study.user_attrs.get(StudyAttr.OBJECTIVE, {}),
                       pooled=pooled_values(study.user_attrs.get(StudyAttr.LEADERS)))


def pooled_values(record: Any) -> dict[int, float]:
    """Each re-measured leader's pooled objective value from a :data:`StudyAttr.LEADERS` record (a leader
    whose re-run failed: infinity, behind every other candidate); empty without a record."""
    out: dict[int, float] = {}
    trials = record.get("trials") if isinstance(record, dict) else None
    for key, entry in (trials or {}).items():
        if not isinstance(entry, dict) or not str(key).isdigit():
            continue
        value = entry.get("value")
        if entry.get("failed"):
            out[int(key)] = float("inf")
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[int(key)] = float(value)
    return out


def rank_trials(trials: Iterable[FrozenTrial], objective: Mapping[str, Any],
                pooled: Mapping[int, float] | None = None) -> list[FrozenTrial]:
    """``trials``' candidates for the best, best first. A candidate is feasible (:func:`is_feasible`:
    measured to the end, within the usable memory and, with ``--max-spread-gib``, the spread limit)
    and measured by the trial itself (a trial that reused another's result is that trial's copy,
    never a candidate of its own). Ranked by the objective value (on a Pareto front the weighted sum
    with ``objective``'s weights, :func:`weighted_objective`; a leader re-measured before saving by its
    pooled value, ``pooled``: :func:`pooled_values`); ties: the earlier trial."""
    feasible = [t for t in trials if is_feasible(t) and t.user_attrs.get(TrialAttr.REUSED_FROM) is None]
    pooled = pooled or {}

    def value(t: FrozenTrial) -> float:
        return pooled[t.number] if t.number in pooled else weighted_objective(t.values, dict(objective))

    return sorted(feasible, key=lambda t: (value(t), t.number))


def best_trial(study: optuna.Study) -> FrozenTrial | None:
    """The best trial (the first of :func:`ranked_trials`); None before any is feasible."""
    ranked = ranked_trials(study)
    return ranked[0] if ranked else None


def best_value(study: optuna.Study) -> float | None:
    """:func:`best_trial`'s objective value (weighted on a Pareto front); None before one."""
    best = best_trial(study)
    if best is None or not best.values:
        return None
    pooled = pooled_values(study.user_attrs.get(StudyAttr.LEADERS))
    if best.number in pooled:  # re-measured before saving: its pooled value
        return pooled[best.number]
    return weighted_objective(best.values, study.user_attrs.get(StudyAttr.OBJECTIVE, {}))


def would_be_best(study: optuna.Study, values: list[float] | tuple[float, ...]) -> bool:
    """Whether a feasible trial with these objective values would become the best: lower than
    :func:`best_value` (a tie keeps the earlier trial). False before any trial is feasible: there is
    no best to beat yet."""
    best = best_value(study)
    return best is not None and weighted_objective(values, study.user_attrs.get(StudyAttr.OBJECTIVE, {})) < best


def time_in_steps_s(user_attrs: Mapping[str, Any]) -> float | None:
    """A trial's seconds in warm-up and measured steps (``TrialAttr.TIME_IN_STEPS_S``, or in a study
    stored before the rename ``TrialAttr.STEPS_S_BEFORE``); None when it has neither."""
    for name in (TrialAttr.TIME_IN_STEPS_S, TrialAttr.STEPS_S_BEFORE):
        value = user_attrs.get(name)
        if value is not None:
            return float(value)
    return None


def trial_ranks(user_attrs: Mapping[str, Any]) -> int:
    """How many ranks a trial ran (or would have) on, from its per-rank lists; 0 when it has none."""
    lists = (user_attrs.get(TrialAttr.PEAK_DEVICE_GIB), user_attrs.get(TrialAttr.USABLE_GIB))
    return max((len(v) for v in lists if isinstance(v, list)), default=0)


def study_ranks(study: optuna.Study) -> int:
    """The study's world size (its objective settings), else the most ranks of any trial (at least 1).
    Spread (max - min over ranks) means something only when this is 2 or more."""
    world = (study.user_attrs.get(StudyAttr.OBJECTIVE) or {}).get("world_size")
    if world:
        return int(world)
    return max((trial_ranks(t.user_attrs) for t in study.get_trials(deepcopy=False)), default=1) or 1
