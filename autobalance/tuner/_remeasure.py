"""A second measurement of a trial whose step time is not to be trusted from one run.

A rank's step time is the median of its measured steps; a trial's is the slowest rank's. On one
H200 one configuration measured 177-239 ms across a warm study: more than most differences the
search ranks. The tuner runs a measured trial once more when

- its spread is high: the IQR of a rank's measured steps exceeds :data:`DISPERSION_LIMIT` of its
  median (something disturbed the steps: another process, a clock change, garbage collection), or
- it is about to become the best (``protocol.would_be_best``; a lucky measurement would otherwise
  steer the rest of the search and be what is saved).

The two runs are merged (:func:`merge_outcomes`): each rank's steps pooled, its step time their median;
memory figures the larger of the two (a configuration that needed more once can need it again). A
second run that fails (an OOM the first run escaped) is the trial's outcome.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from autobalance._config import BalanceConfig
from autobalance.launcher import TrialOutcome
from autobalance.protocol import (
    RankMemory,
    RankReport,
    Status,
    StudyAttr,
    TrialAttr,
    rank_trials,
    timed_steps,
    weighted_objective,
)
from autobalance.tuner.search import (
    DISPERSION_LIMIT,
    LEADER_MEDIAN_SE,
    LEADER_NOISE_FLOOR,
    LEADER_NOISE_SIGMAS,
    LEADER_RUNS,
    LEADERS_MAX,
    compile_times,
    from_cache_s,
    trial_s,
)

__all__ = ["STEP_TIMES_MS", "close_leaders", "dispersion", "leader_candidates", "leader_run_s", "leaders_line",
           "least_plan", "merge_outcomes", "noise_band", "one_per_config", "plan_leaders", "rank_steps",
           "remeasure_leaders", "remeasure_reason", "saved_spread", "spread_text"]

STEP_TIMES_MS = "step_times_ms"
"""Trial attribute: each rank's timed steps in ms (a trial measured twice: both runs')."""


def _iqr(times: list[float]) -> float | None:
    if len(times) < 2:
        return None
    q = statistics.quantiles(times, n=4, method="inclusive")
    return q[2] - q[0]


def _timed(times: list[float], samples: list[Any] | None, rep: RankReport) -> tuple[list[float], float | None]:
    """The steps a rank's step time stands for and their samples per step (``protocol.timed_steps``)."""
    global_batch = (rep.config or {}).get("global_batch")
    return timed_steps(times, samples, global_batch if isinstance(global_batch, int) else None)


def rank_steps(rep: RankReport) -> list[float]:
    """A rank report's timed steps in seconds."""
    return _timed([float(t) for t in rep.step_times_s or []], rep.step_samples, rep)[0]


def dispersion(outcome: TrialOutcome) -> float | None:
    """Largest IQR / median over the ranks' timed steps; None without measured steps."""
    worst: float | None = None
    for rep in outcome.reports.values():
        times = rank_steps(rep)
        iqr = _iqr(times)
        if iqr is not None and (median := statistics.median(times)) > 0:
            worst = max(worst or 0.0, iqr / median)
    return worst


def remeasure_reason(outcome: TrialOutcome, *, step_time_s: float | None, would_be_best: bool,
                     best_step_s: float | None = None) -> str | None:
    """Why ``outcome`` (already measured once) must be measured again, or None. ``would_be_best``:
    feasible and better than the study's best trial; ``best_step_s`` that trial's step time."""
    if outcome.status != Status.OK or step_time_s is None:
        return None
    spread = dispersion(outcome)
    if spread is not None and spread > DISPERSION_LIMIT:
        return (f"its measured steps' IQR is {100 * spread:.1f} % of their median "
                f"(> {100 * DISPERSION_LIMIT:.0f} %)")
    if would_be_best:
        was = f"; the best so far {1000 * best_step_s:.1f} ms" if best_step_s is not None else ""
        return f"it would become the best ({1000 * step_time_s:.1f} ms{was}): confirmed by a second run"
    return None


def _padded(samples: Any, count: int) -> list[Any]:
    """A report's ``step_samples`` for its ``count`` measured steps (``None``: unknown, a full step)."""
    known = list(samples) if isinstance(samples, list) else []
    return [*known[:count], *([None] * (count - len(known)))]


def _max_numbers(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = dict(a)
    for key, vb in b.items():
        va = a.get(key)
        if isinstance(va, dict) and isinstance(vb, dict):
            out[key] = _max_numbers(va, vb)
        elif isinstance(va, (int, float)) and isinstance(vb, (int, float)) and not isinstance(va, bool):
            out[key] = max(va, vb)
        elif va is None:
            out[key] = vb
    return out


def _memory(rep: RankReport | None) -> dict[str, Any]:
    return rep.memory.to_dict() if rep is not None and rep.memory is not None else {}


def merge_outcomes(first: TrialOutcome, second: TrialOutcome, *, reason: str) -> TrialOutcome:
    """One outcome from a trial measured twice (see the module docstring)."""
    runs = [_slowest(first), _slowest(second)]
    if second.status != Status.OK:
        merged = copy.copy(second)
        merged.reason = f"re-measured ({reason}); the second run: {second.reason}"
        return merged
    reports: dict[int, RankReport] = {}
    for rank, rep in first.reports.items():
        other = second.reports.get(rank)
        other_samples = other.step_samples if other else None
        own, theirs = list(rep.step_times_s or []), list((other.step_times_s if other else None) or [])
        times = [*own, *theirs]
        samples = [*_padded(rep.step_samples, len(own)), *_padded(other_samples, len(theirs))]
        timed, per_step = _timed(times, samples, rep)
        global_batch: Any = (rep.config or {}).get("global_batch")
        step_samples, partial_steps = rep.step_samples, rep.partial_steps
        if rep.step_samples is not None or other_samples is not None:
            step_samples = [global_batch if n is None else n for n in samples]
            partial_steps = sum(1 for n in samples if n is not None and isinstance(global_batch, int)
                                and n < global_batch)
        step_time = statistics.median(timed) if timed else rep.step_time_s
        per_step = per_step or rep.samples_per_step or global_batch
        reports[rank] = dataclasses.replace(
            rep, memory=RankMemory.from_dict(_max_numbers(_memory(rep), _memory(other))),
            step_times_s=times, measured_steps=len(times), step_samples=step_samples, partial_steps=partial_steps,
            step_time_s=step_time, step_time_iqr_s=_iqr(timed), samples_per_step=per_step,
            samples_per_s=(per_step / step_time) if per_step and step_time else None)
    merged = copy.copy(first)
    merged.reports = reports
    merged.wall_s = first.wall_s + second.wall_s
    merged.pool_start_s = first.pool_start_s + second.pool_start_s
    merged.recycled = second.recycled or first.recycled
    merged.remeasured = {"reason": reason, "step_time_s": runs, "wall_s": second.wall_s}
    return merged


def _slowest(outcome: TrialOutcome) -> float | None:
    times = [rep.step_time_s for rep in outcome.reports.values()]
    return max(float(t) for t in times if t is not None) if times and None not in times else None


# ---------------------------------------------------------------------- the leaders, before saving
# The best trial and those within its measured noise run again, interleaved, ranked by their pooled steps:
# what is saved is then the truly faster of two configurations a single run each could not tell apart.


@dataclass(kw_only=True)
class LeaderPlan:
    """The leader trials to re-measure (best first), ``runs`` of each (0: nothing), and why."""

    leaders: list[Any]
    runs: int
    reason: str

    def order(self) -> list[Any]:  # the launches, interleaved: A, B, C, A, B, C, ...
        return [t for _ in range(self.runs) for t in self.leaders]


def figure_noise(attrs: Mapping[str, Any]) -> float:
    """The standard error of a trial's step figure as a fraction of it, from its own steps' spread
    (``step_time_iqr_pct`` over ``measured_steps``; :data:`LEADER_MEDIAN_SE`); 0 when unknown."""
    iqr_pct, steps = attrs.get("step_time_iqr_pct"), attrs.get(TrialAttr.MEASURED_STEPS)
    if not isinstance(iqr_pct, (int, float)) or not isinstance(steps, int) or steps < 2:
        return 0.0
    return LEADER_MEDIAN_SE * float(iqr_pct) / 100 / math.sqrt(steps)


def noise_band(best: Mapping[str, Any], other: Mapping[str, Any]) -> float:
    """The largest relative step-time difference of two trials that their measurements cannot tell from
    noise: :data:`LEADER_NOISE_SIGMAS` standard errors of the difference, at least :data:`LEADER_NOISE_FLOOR`."""
    return max(LEADER_NOISE_FLOOR, LEADER_NOISE_SIGMAS * math.hypot(figure_noise(best), figure_noise(other)))


def _step_ms(t: Any) -> float | None:
    value = t.user_attrs.get(TrialAttr.STEP_TIME_MS)
    return float(value) if isinstance(value, (int, float)) and value > 0 else None


def close_leaders(ranked: Sequence[Any], *, limit: int = LEADERS_MAX) -> tuple[list[Any], str]:
    """The best of ``ranked`` and the next ones within the measured noise of its step time (:func:`noise_band`),
    at most ``limit``; and why (one line)."""
    best_ms = _step_ms(ranked[0]) if ranked else None
    if best_ms is None:
        return list(ranked[:1]), "no measured best trial"
    best = ranked[0]
    leaders, words, missed = [best], [], ""
    for t in ranked[1:]:
        ms = _step_ms(t)
        if ms is None:
            continue
        gap, band = (ms - best_ms) / best_ms, noise_band(best.user_attrs, t.user_attrs)
        if gap > band:
            missed = (f": the next, trial {t.number} ({ms:.1f} ms), is {100 * gap:+.1f} % from the "
                      f"best's {best_ms:.1f} ms, outside the measured noise ({100 * band:.1f} %)")
            break
        if len(leaders) >= limit:
            words.append(f"trial {t.number} within it too, left out (at most {limit} leaders)")
            break
        leaders.append(t)
        words.append(f"trial {t.number} {ms:.1f} ms ({100 * gap:+.1f} %, within {100 * band:.1f} %)")
    the_best = f"the measured noise of the best (trial {best.number}, {best_ms:.1f} ms)"
    if len(leaders) < 2:
        return leaders, f"no other feasible trial is within {the_best}{missed}"
    return leaders, f"within {the_best}: " + "; ".join(words)


def plan_leaders(leaders: Sequence[Any], *, run_s: Callable[[Any], float], time_left_s: float | None,
                 why: str) -> LeaderPlan:
    """How many of ``leaders`` to re-measure and how many more runs each (:data:`LEADER_RUNS`, the most
    first; at the same runs, the most leaders): the most that ``time_left_s`` (None: no budget) holds,
    each run priced by ``run_s``. When it holds fewer than all, the runs go to the leaders whose figures
    rest on the fewest runs: a leader measured once, whose single run may be the unlucky one, first."""
    if len(leaders) < 2:
        return LeaderPlan(leaders=list(leaders), runs=0, reason=f"Leaders not re-measured: {why}.")
    by_evidence = sorted(leaders, key=lambda t: (runs_so_far(t), leaders.index(t)))
    options = [(k, runs) for runs in LEADER_RUNS for k in range(len(leaders), 1, -1)]
    for k, runs in options:
        chosen = list(leaders[:k]) if k == len(leaders) else by_evidence[:k]
        cost = runs * sum(run_s(t) for t in chosen)
        if time_left_s is None or cost <= time_left_s:
            left = "" if time_left_s is None else f" of the {time_left_s:.0f} s left after verification's reserve"
            fewer = "" if (k, runs) == options[0] else " (the most the time left holds)"
            left_out = [t for t in leaders if t not in chosen]
            if left_out:
                fewer += ("; left out, their figures resting on more runs: "
                          + ", ".join(f"trial {t.number} ({runs_so_far(t)} runs)" for t in left_out))
            names = ", ".join(str(t.number) for t in chosen)
            return LeaderPlan(leaders=chosen, runs=runs, reason=(
                f"Leaders re-measured before saving: {why}. Trials {names} run {runs} more time(s) each, "
                f"interleaved in the same worker state, their steps pooled with their own{fewer}: about {cost:.0f} s"
                f"{left}."))
    least = LEADER_RUNS[-1] * sum(run_s(t) for t in leaders[:2])
    return LeaderPlan(leaders=list(leaders), runs=0, reason=(
        f"Leaders not re-measured: {why}; but the time left ({max(0.0, time_left_s or 0.0):.0f} s after "
        f"verification's reserve) does not hold {LEADER_RUNS[-1]} more run(s) of the first two (about {least:.0f} s)."))


def step_spread(per_rank: Sequence[Sequence[float]]) -> dict[str, Any] | None:
    """The slowest rank's ``step_time_ms`` (median), ``q1_ms``, ``q3_ms``, ``steps`` (or None)."""
    ranked = [(statistics.median(times), list(times)) for times in per_rank if times]
    if not ranked:
        return None
    median, times = max(ranked, key=lambda x: x[0])
    q = statistics.quantiles(times, n=4, method="inclusive") if len(times) >= 2 else [median, median, median]
    return {"step_time_ms": round(1000 * median, 3), "q1_ms": round(1000 * q[0], 3), "q3_ms": round(1000 * q[2], 3),
            "steps": len(times)}


def runs_so_far(trial: Any) -> int:
    """How many runs a trial's figure pools: 2 when it was re-measured in the loop, else 1."""
    return 2 if trial.user_attrs.get("remeasured") else 1


def own_steps(trial: Any) -> tuple[list[list[float]], int]:
    """A trial's own measured steps per rank (seconds, ``step_times_ms``) and the runs they pool."""
    kept = trial.user_attrs.get(STEP_TIMES_MS)
    if not isinstance(kept, list) or not any(isinstance(r, list) and r for r in kept):
        return [], 0
    return [[float(t) / 1000 for t in r] if isinstance(r, list) else [] for r in kept], runs_so_far(trial)


def spread_text(entry: Mapping[str, Any]) -> str:
    """``159.0 ms (IQR 152.0-166.0 ms over 24 steps, 3 runs)`` from :func:`saved_spread`'s keys."""
    if entry.get("q1_ms") is not None and entry.get("q3_ms") is not None:
        iqr = f"IQR {float(entry['q1_ms']):.1f}-{float(entry['q3_ms']):.1f} ms"
    elif entry.get("iqr_pct") is not None:
        iqr = f"IQR {float(entry['iqr_pct']):.1f} % of it"
    else:
        iqr = ""
    head = (iqr + (f" over {entry['steps']} steps" if entry.get("steps") else "")).strip()
    figure = f"{head}, " if head else ""
    runs = int(entry.get("runs") or 1)
    return f"{float(entry['step_time_ms']):.1f} ms ({figure}{runs} run{'s' if runs != 1 else ''})"


def pooled_value(trial: Any, step_time_ms: float, objective: Mapping[str, Any], reference_s: float | None) -> float:
    """``trial``'s objective value with its step time replaced by the pooled one: the weighted value
    plus the time weight x the step's change over the reference step."""
    value, own = weighted_objective(trial.values, dict(objective)), _step_ms(trial)
    if own is None or not reference_s:
        return value
    return value + float(objective.get("weight_time", 1.0)) * (step_time_ms - own) / 1000 / float(reference_s)


def remeasure_leaders(plan: LeaderPlan, *, launch: Callable[[Any], TrialOutcome], objective: Mapping[str, Any],
                      reference_s: float | None) -> dict[str, Any]:
    """Run ``plan``, pool each leader's steps (its own and every run's, rank by rank) and return the
    :data:`StudyAttr.LEADERS` record: each leader's pooled figures and value (or why a run failed)."""
    runs: dict[int, list[TrialOutcome]] = {t.number: [] for t in plan.leaders}
    failed: dict[int, str] = {}
    for trial in plan.order():
        if trial.number not in failed:
            outcome = launch(trial)
            if outcome.status == Status.OK:
                runs[trial.number].append(outcome)
            else:
                failed[trial.number] = f"a re-measure run ended {outcome.status}: {outcome.reason}"
    entries: dict[str, dict[str, Any]] = {}
    for trial in plan.leaders:
        if trial.number in failed:
            entries[str(trial.number)] = {"failed": failed[trial.number]}
            continue
        pooled, own_runs = own_steps(trial)
        for outcome in runs[trial.number]:  # each rank's steps of every run, pooled
            for rank, rep in outcome.reports.items():
                pooled.extend([] for _ in range(rank + 1 - len(pooled)))
                pooled[rank].extend(rank_steps(rep))
        spread = step_spread(pooled)
        if spread is None:
            entries[str(trial.number)] = {"failed": "no measured steps in its re-measure runs"}
            continue
        new, value = len(runs[trial.number]), pooled_value(trial, spread["step_time_ms"], objective, reference_s)
        entries[str(trial.number)] = {**spread, "runs": own_runs + new, "new_runs": new,
                                      "trial_ms": _step_ms(trial), "value": value}
    order = sorted(runs, key=lambda n: (entries[str(n)].get("value", math.inf), n))
    return {"reason": plan.reason, "order": order, "runs": plan.runs, "trials": entries}


def leaders_line(record: Mapping[str, Any], *, was: int | None, now: int | None = None) -> str:
    """One line on the leaders' pooled figures, best first, and which one is now the best (``now``, else the
    first re-measured leader)."""
    order = list(record.get("order") or [])
    parts = []
    for n in order:
        entry = (record.get("trials") or {}).get(str(n)) or {}
        if entry.get("failed"):
            parts.append(f"trial {n}: {entry['failed']}")
        else:
            one = f", measured before {entry['trial_ms']:.1f} ms" if entry.get("trial_ms") else ""
            parts.append(f"trial {n} {spread_text(entry)}{one}")
    first = now if now is not None else next(iter(order), None)
    verdict = (f"trial {first} stays the best" if first == was
               else f"trial {first} is now the best (was trial {was})")
    return "Leaders pooled (interleaved runs): " + "; ".join(parts) + f": {verdict}."


def one_per_config(trials: Iterable[Any]) -> list[Any]:
    """The first of ``trials`` with each configuration, in their order."""
    first: dict[str, Any] = {}
    for t in trials:
        first.setdefault(json.dumps(t.user_attrs.get(TrialAttr.CONFIG), sort_keys=True), t)
    return list(first.values())


def leader_candidates(study: Any) -> list[Any]:
    """The study's candidates for the best, one per configuration, as the trials measured them (no
    pooled figure) and without those that failed verification (never saved)."""

    def failed(t: Any) -> bool:
        verdict = study.user_attrs.get(f"{StudyAttr.VERIFY_PREFIX}{t.number}")
        return isinstance(verdict, dict) and not verdict.get("passed")

    ranked = rank_trials(study.get_trials(deepcopy=False), study.user_attrs.get(StudyAttr.OBJECTIVE, {}))
    return one_per_config(t for t in ranked if not failed(t))


def leader_run_s(trials: Sequence[Any], trial: Any, *, device: str) -> float:
    """One re-measure run of ``trial``: its own run's time split plus, compiled, a compile from the
    study's cache; without a time split, priced as the study's next trial (``search._timing``)."""
    config = BalanceConfig.from_dict(trial.user_attrs[TrialAttr.CONFIG])
    split = trial.user_attrs.get(TrialAttr.TIME_SPLIT)
    if not isinstance(split, dict):
        return trial_s(trials, config, device=device)
    own = sum(float(split.get(k) or 0.0) for k in ("startup", "steps", "other"))
    if config.compile == "off":
        return own
    _, cold = compile_times(trials, device=device, scope=config.compile_scope)
    return own + from_cache_s(trials, config, cold=cold)


def least_plan(study: Any, trials: Sequence[Any], *, device: str) -> tuple[list[Any], float]:
    """The least leaders' plan, which the time budget keeps free: the first two leaders and the time
    of the fewest :data:`LEADER_RUNS`; none and 0 when no trial is within the best's noise."""
    leaders, _ = close_leaders(leader_candidates(study))
    if len(leaders) < 2:
        return [], 0.0
    return leaders[:2], LEADER_RUNS[-1] * sum(leader_run_s(trials, t, device=device) for t in leaders[:2])


def saved_spread(study: Any, trial: Any) -> dict[str, Any] | None:
    """The step time a saved trial stands on, with its spread, ``runs`` and ``steps``: the leaders'
    pooled figures, else its own steps', else its median and IQR %; None without a step time."""
    record = study.user_attrs.get(StudyAttr.LEADERS) or {}
    entry = (record.get("trials") or {}).get(str(trial.number)) if isinstance(record, dict) else None
    if isinstance(entry, dict) and entry.get("step_time_ms") is not None:
        return {k: entry.get(k) for k in ("step_time_ms", "q1_ms", "q3_ms", "steps", "runs")} | {
            "source": "leaders re-measured before saving, interleaved"}
    steps, runs = own_steps(trial)
    spread = step_spread(steps)
    if spread is not None:
        return spread | {"runs": runs, "source": "the trial's own steps"}
    ms = _step_ms(trial)
    if ms is None:
        return None
    return {"step_time_ms": ms, "iqr_pct": trial.user_attrs.get("step_time_iqr_pct"),
            "steps": trial.user_attrs.get(TrialAttr.MEASURED_STEPS), "runs": runs_so_far(trial),
            "source": "the trial's own figures"}
