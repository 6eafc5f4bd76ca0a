"""What a finished ``tune`` says: the result, and the notes under the table (predicted and pruned
trials, the steps' share of the wall time, compilation, the memory model's error)."""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from autobalance.protocol import Status, StudyAttr, TrialAttr, time_in_steps_s
from autobalance.tuner._measurement import measurement_summary
from autobalance.tuner._roles import Advisor
from autobalance.tuner._script_facts import summary_facts
from autobalance.tuner._time_spent import TIME_PARTS, per_trial_overhead_s, time_lines, time_spent
from autobalance.tuner.search import compile_notes, model_errors_line

__all__ = ["TuneResult", "baseline_won", "per_trial_overhead_s", "rerun_hint", "summarise", "what_was_tried"]


@dataclass(kw_only=True)
class TuneResult:
    """What a finished ``tune`` produced."""

    study_name: str
    storage: str
    """Masked storage URL."""
    trials_run: int
    """Trials launched by this invocation (reused or predicted trials not counted)."""
    baseline: FrozenTrial | None
    best: FrozenTrial | None
    wall_s: float
    saved: bool = False
    """Whether the best configuration was saved to the store."""
    notes: list[str] = field(default_factory=list)
    time_spent: dict[str, Any] = field(default_factory=dict)
    """How this run spent its wall time and its time budget (see :data:`StudyAttr.TIME_SPENT`)."""

    already: int = 0
    """Trials the study had counted before this run (``--trials`` is the study's total)."""
    of: int = 0
    """``--trials``: the study's total."""

    def time_lines(self) -> list[str]:
        """Where the run's time went, and whether its time budget stopped it; nothing when this run
        launched no trial and verified nothing (its time would read as the study's work)."""
        if _idle(self):
            return []
        return time_lines(self.time_spent)

    def rerun_hint(self) -> str | None:
        """The line for a run that had nothing to do (see :func:`rerun_hint`); None otherwise."""
        return rerun_hint(already=self.already, of=self.of) if self.trials_run == 0 else None


def _idle(result: TuneResult) -> bool:
    """This run launched no trial, verified nothing and was not stopped by its time budget: it had
    nothing to do (its few milliseconds are not the study's work)."""
    spent = result.time_spent
    return result.trials_run == 0 and not spent.get("verified") and not spent.get("stopped_by_budget")


def rerun_hint(*, already: int, of: int, more: int = 10) -> str | None:
    """The line for a run that had nothing to do: the study already counted ``of`` trials (``--trials``
    is the study's total, not this run's), and how to run ``more``. None when trials were left to run."""
    if of <= 0 or already < of:
        return None
    return (f"Nothing to run: the study already has {already} trial(s) and --trials {of} is the study's total, not "
            f"this run's; --trials {already + more} runs {more} more. The figures below are from its earlier runs.")


def what_was_tried(trials: list[FrozenTrial], *, baseline: int) -> str:
    """The other configurations a study measured, in words: how many, and what varied among them
    (splits, accumulation, checkpointing, dtypes, buckets, compile, optimizer sharding)."""
    configs = [t.user_attrs.get(TrialAttr.CONFIG) or {} for t in trials
               if t.number != baseline and t.user_attrs.get(TrialAttr.STATUS) not in (None, Status.STALE, Status.SURPLUS,
                                                                                       Status.INTERRUPTED)]
    if not configs:
        return "no other configuration measured"

    def values(key: str) -> list[Any]:
        return sorted({json.dumps(c.get(key), sort_keys=True) for c in configs if key in c})

    parts = []
    splits = {json.dumps(c.get("rank_samples") or c.get("micro_batches")) for c in configs}
    if len(splits) > 1:
        parts.append(f"{len(splits)} splits")
    acc = sorted({int(c["accumulation"]) for c in configs if isinstance(c.get("accumulation"), int)})
    if len(acc) > 1:
        parts.append(f"accumulation {acc[0]}-{acc[-1]}")
    if any(any(blocks) for c in configs for blocks in (c.get("checkpoint") or [])):
        parts.append("checkpointing")
    dtypes = [json.loads(v) for v in values("dtype")]
    if len(dtypes) > 1:
        parts.append("/".join(str(d) for d in dtypes))
    if len(values("bucket_cap_mb")) > 1:
        parts.append("DDP buckets")
    if any(c.get("compile", "off") != "off" for c in configs):
        parts.append("torch.compile")
    if any(c.get("optimizer_sharding") == "zero1" for c in configs):
        parts.append("ZeRO-1")
    return f"{len(configs)} other configuration(s)" + (f" ({', '.join(parts)})" if parts else "")


def baseline_won(study: optuna.Study, *, baseline: int, study_name: str) -> str:
    """The verdict when the best trial is the baseline: the script's own configuration was best, what
    else was tried, and what saving it means."""
    tried = what_was_tried(study.get_trials(deepcopy=False), baseline=baseline)
    return (f"The script's own configuration was the best: {tried} did not beat it. Saved trial {baseline} (the "
            f"script's own) as the best configuration of '{study_name}': a production run keeps the script's "
            "settings; more --trials may still find a better one.")


def summarise(study: optuna.Study, result: TuneResult, *, cold_note: str | None, advisor: Advisor | None,
              launched_here: set[int] | None = None) -> None:
    """Append the study's notes to ``result`` (and record the compile total, the memory model's error
    and where the time of this run went: the trials ``launched_here``)."""
    record_time_spent(study, result, launched_here=launched_here)
    result.notes.extend(summary_facts(study.user_attrs))
    trials = study.get_trials(deepcopy=False)
    predicted = [t for t in trials if t.user_attrs.get(TrialAttr.STATUS) == Status.PREDICTED_OOM]
    pruned = sum(t.state == TrialState.PRUNED for t in trials)
    if predicted:
        result.notes.append(f"{len(predicted)} configuration(s) predicted to run out of memory were recorded without "
                            "launching.")
    launched = [t for t in trials if t.user_attrs.get(TrialAttr.STATUS) == Status.OK
                and time_in_steps_s(t.user_attrs) is not None
                and t.user_attrs.get(TrialAttr.WALL_S) and t.user_attrs.get(TrialAttr.REUSED_FROM) is None]
    if len(launched) >= 2:
        # a warm pool's own start is paid once per (re)start, not per trial: reported apart
        starts = sum(float(t.user_attrs.get(TrialAttr.POOL_START_S) or 0.0) for t in launched)
        walls = sum(float(t.user_attrs[TrialAttr.WALL_S]) for t in launched) - starts
        in_steps = sum(time_in_steps_s(t.user_attrs) or 0.0 for t in launched)
        result.notes.append(
            f"Steps took {100 * in_steps / max(walls, 1e-9):.0f}% of the measured trials' wall time (median "
            f"overhead {per_trial_overhead_s(launched, last=len(launched)) or 0:.2f} s per trial: the script's "
            "set-up, hand-over" + (f"; plus {starts:.1f} s starting warm workers)." if starts else ")."))
    compiled_skipped = sum((t.user_attrs.get(TrialAttr.CONFIG) or {}).get("compile", "off") != "off" for t in predicted)
    compile_times = sorted(float(t.user_attrs[TrialAttr.COMPILE_S]) for t in trials
                           if t.user_attrs.get(TrialAttr.COMPILE_S))
    if compiled_skipped and compile_times:
        median = compile_times[len(compile_times) // 2]
        result.notes.append(f"{compiled_skipped} of them compiled: about {compiled_skipped * median:.0f} s of "
                            f"compilation saved (the study's median compile, {median:.1f} s, each).")
    if pruned:
        result.notes.append(f"{pruned} trial(s) were stopped early (pruned) as clearly slower than the best.")
    # what warm trials took from a fresh worker, the compiling step apart, the steps' spread (tuner/_measurement.py)
    result.notes.extend(measurement_summary([dict(t.user_attrs) for t in trials
                                             if t.user_attrs.get(TrialAttr.REUSED_FROM) is None]))
    if cold_note:
        result.notes.append(cold_note)
    compile_lines, compile_total = compile_notes(trials)
    if compile_lines:
        study.set_user_attr(StudyAttr.COMPILE_TOTAL, round(compile_total, 3))
        result.notes.extend(compile_lines)
    if advisor is not None:
        error = advisor.holdout_error(study)
        if error is not None:
            study.set_user_attr(StudyAttr.MEMORY_MODEL_ERROR, error)
            result.notes.append(f"Memory model: {100 * error:.1f}% mean error predicting held-out trials' per-rank peaks.")
        compiled = advisor.compiled_holdout_error(study)
        if compiled is not None:
            study.set_user_attr(StudyAttr.COMPILED_MODEL_ERROR, compiled[0])
            result.notes.append(f"Compiled model: {100 * compiled[0]:.1f}% mean error predicting held-out compiled "
                                f"trials' per-rank peaks ({compiled[1]} trial(s)).")
    failed_fits = model_errors_line(study.user_attrs.get(StudyAttr.MODEL_ERRORS))
    if failed_fits is not None:  # fits the search fell back from (tuner/search/_model_errors.py)
        result.notes.append(failed_fits)


def record_time_spent(study: optuna.Study, result: TuneResult, *, launched_here: set[int] | None = None,
                      verify_s: float | None = None) -> None:
    """Fill ``result.time_spent`` (the parts of the trials ``launched_here``, then verification's
    ``verify_s``) and record it as :data:`StudyAttr.TIME_SPENT`."""
    spent = result.time_spent
    if launched_here is not None:
        spent.update(time_spent(study.get_trials(deepcopy=False), launched_here))
        spent["remeasure"] = round(spent["remeasure"] + float(spent.get("leaders_s") or 0.0), 3)  # the leaders' runs
        spent.setdefault("verify", 0.0)
        spent.setdefault("verified", False)
    if verify_s is not None:
        spent["verify"], spent["verified"] = round(verify_s, 3), True
    spent["wall"] = round(result.wall_s + float(spent.get("verify") or 0.0), 3)
    spent["other"] = round(max(0.0, spent["wall"] - sum(float(spent.get(k) or 0.0) for k in TIME_PARTS)), 3)
    if _idle(result):
        return  # a run with nothing to do keeps the record of the study's last run that did
    with contextlib.suppress(Exception):  # a summary must not fail on a storage hiccup
        study.set_user_attr(StudyAttr.TIME_SPENT, dict(spent))
