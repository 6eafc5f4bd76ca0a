"""What a finished ``tune`` says: the result, and the notes under the table (predicted and pruned trials, the
steps' share of the wall time, compilation, the memory model's error).

**How each trial was measured** (``docs/warm.md``), as trial attributes and as lines of the study summary: the
compiling step's and the steady peaks (``compile_peak_gib``, ``steady_peak_gib``), the steps' spread
(``step_time_iqr_pct``; ``remeasured``), and a warm trial's carry-over (:mod:`autobalance.runtime._carryover`):
``warm_pool_trial`` (1 = a fresh worker), ``warm_fresh_outside_gib`` (what a fresh worker held outside PyTorch, per
rank), ``warm_inherited_outside_gib`` (what this trial's worker held over its reference: charged to the trial,
never discounted), ``warm_recycled`` (why the pool was restarted after it).

**The script's facts**: what the baseline's report says about the script that shapes the study, in words: its
repeated blocks (none found: checkpointing is not searched), batch-dependent layers (the split stays the script's
own), a dataset smaller than one global batch (every step is a partial step). The study prints these lines first,
before any other trial runs.
"""

from __future__ import annotations

import contextlib
import json
import statistics
from dataclasses import dataclass, field
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from autobalance._config import BalanceConfig
from autobalance.launcher import TrialOutcome
from autobalance.protocol import (
    GIB,
    NOT_COUNTED,
    RankMemory,
    RankReport,
    Status,
    StudyAttr,
    TrialAttr,
    memory_text,
    time_in_steps_s,
)
from autobalance.tuner._remeasure import STEP_TIMES_MS, rank_steps
from autobalance.tuner._reporter import Advisor
from autobalance.tuner._time_spent import TIME_PARTS, time_lines, time_spent
from autobalance.tuner.search import (
    SearchSpace,
    compile_notes,
    model_errors_line,
    per_trial_overhead_s,
    typical_compile_s,
)

__all__ = ["TuneResult", "baseline_won", "keep_split", "measurement_attrs", "measurement_summary",
           "record_time_spent", "script_facts", "summarise", "summary_facts"]


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
        return [] if _idle(self) else time_lines(self.time_spent)

    def rerun_hint(self) -> str | None:
        """The line for a run that had nothing to do: the study already counted ``of`` trials
        (``--trials`` is the study's total, not this run's), and how to run more; None otherwise."""
        if self.trials_run != 0 or self.of <= 0 or self.already < self.of:
            return None
        more = self.already + 10
        return (f"Nothing to run: the study already has {self.already} trial(s) and --trials "
                f"{self.of} is the study's total, not this run's; --trials {more} runs 10 more. "
                "The figures below are from its earlier runs.")


def _idle(result: TuneResult) -> bool:
    """This run had nothing to do: no trial launched, nothing verified, not stopped by its time budget."""
    spent = result.time_spent
    return result.trials_run == 0 and not spent.get("verified") and not spent.get("stopped_by_budget")


def what_was_tried(trials: list[FrozenTrial], *, baseline: int) -> str:
    """The other configurations a study measured, in words: how many, and what varied among them
    (splits, accumulation, checkpointing, dtypes, buckets, compile, optimizer sharding)."""
    configs = [t.user_attrs.get(TrialAttr.CONFIG) or {} for t in trials
               if t.number != baseline and t.user_attrs.get(TrialAttr.STATUS) not in NOT_COUNTED]
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
    median = typical_compile_s(trials)
    if compiled_skipped and median is not None:
        result.notes.append(f"{compiled_skipped} of them compiled: about {compiled_skipped * median:.0f} s of "
                            f"compilation saved (the study's median compile, {median:.1f} s, each).")
    if pruned:
        result.notes.append(f"{pruned} trial(s) were stopped early (pruned) as clearly slower than the best.")
    # what warm trials took from a fresh worker, the compiling step apart, the steps' spread (below: how each trial was measured)
    result.notes.extend(measurement_summary([dict(t.user_attrs) for t in trials
                                             if t.user_attrs.get(TrialAttr.REUSED_FROM) is None]))
    if cold_note:
        result.notes.append(cold_note)
    compile_lines, compile_total = compile_notes(trials)
    if compile_lines:
        study.set_user_attr(StudyAttr.COMPILE_TOTAL, round(compile_total, 3))
        result.notes.extend(compile_lines)
    if advisor is not None:
        if (error := advisor.holdout_error(study)) is not None:
            study.set_user_attr(StudyAttr.MEMORY_MODEL_ERROR, error)
            result.notes.append(f"Memory model: {100 * error:.1f}% mean error predicting held-out trials' per-rank peaks.")
        if (compiled := advisor.compiled_holdout_error(study)) is not None:
            study.set_user_attr(StudyAttr.COMPILED_MODEL_ERROR, compiled[0])
            result.notes.append(f"Compiled model: {100 * compiled[0]:.1f}% mean error predicting held-out compiled "
                                f"trials' per-rank peaks ({compiled[1]} trial(s)).")
    if (failed_fits := model_errors_line(study.user_attrs.get(StudyAttr.MODEL_ERRORS))) is not None:
        result.notes.append(failed_fits)  # fits the search fell back from (tuner/search/_model_errors.py)


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


# --------------------------------------------------------------------- how each trial was measured


def _gib(value: Any) -> float | None:
    return None if value is None else round(float(value) / GIB, 4)


def measurement_attrs(outcome: TrialOutcome, *, world_size: int) -> dict[str, Any]:
    reports = [outcome.reports.get(r) for r in range(world_size)]
    memory = [rep.memory if rep is not None and rep.memory is not None else RankMemory() for rep in reports]
    attrs: dict[str, Any] = {}
    first = [(mem.compile_step or {}).get("peak_device") for mem in memory]
    steady = [(mem.steady or {}).get("peak_device") for mem in memory]
    if any(v is not None for v in first):
        attrs["compile_peak_gib"] = [_gib(v) for v in first]
        attrs["steady_peak_gib"] = [_gib(v) for v in steady]
    medians = [(float(rep.step_time_iqr_s), statistics.median(float(t) for t in rep.step_times_s))
               for rep in reports if rep is not None and rep.step_time_iqr_s is not None and rep.step_times_s]
    spreads = [100 * iqr / median for iqr, median in medians if median > 0]
    if spreads and len(spreads) == world_size:
        attrs["step_time_iqr_pct"] = round(max(spreads), 2)
    steps = [rank_steps(rep) if rep is not None else [] for rep in reports]
    if any(steps):  # each rank's timed steps: what the leaders' re-measure pools (tuner/_remeasure.py)
        attrs[STEP_TIMES_MS] = [[round(1000 * t, 3) for t in times] for times in steps]
    if outcome.remeasured:
        attrs["remeasured"] = {"reason": outcome.remeasured.get("reason"),
                               "step_time_ms": [None if t is None else round(1000 * t, 3)
                                                for t in outcome.remeasured.get("step_time_s") or []]}
    warm = [rep.warm if rep is not None else None for rep in reports]
    if any(warm):
        attrs["warm_pool_trial"] = max(int(w.get("pool_trial") or 0) for w in warm if w)
        attrs["warm_fresh_outside_gib"] = [_gib((w or {}).get("fresh_outside")) for w in warm]
        attrs["warm_inherited_outside_gib"] = [_gib((w or {}).get("inherited_outside")) for w in warm]
        if outcome.recycled:
            attrs[TrialAttr.WARM_RECYCLED] = outcome.recycled
    return attrs


def measurement_summary(attrs: list[dict[str, Any]]) -> list[str]:
    """Lines for the study summary from the launched trials' attributes (empty when none apply)."""
    lines: list[str] = []
    warm = [a for a in attrs if a.get("warm_pool_trial")]
    if warm:
        fresh = [g for a in warm for g in (a.get("warm_fresh_outside_gib") or []) if g is not None]
        inherited = [g for a in warm for g in (a.get("warm_inherited_outside_gib") or []) if g is not None]
        recycled = [a[TrialAttr.WARM_RECYCLED] for a in warm if a.get(TrialAttr.WARM_RECYCLED)]
        text = (f"Warm trials ({len(warm)}): each trial's memory was measured in its own worker, nothing discounted; "
                "the allocator was emptied between trials")
        if fresh:
            text += f"; a fresh worker held {memory_text(min(fresh))}-{memory_text(max(fresh))} outside PyTorch"
        if inherited:
            text += f"; a trial inherited at most {memory_text(max(inherited))} over it (charged to it)"
        text += (f"; workers recycled after {len(recycled)} trial(s) (first: {recycled[0]})." if recycled
                 else "; no worker needed recycling.")
        lines.append(text)
    compiled = [a for a in attrs if a.get("compile_peak_gib")]
    if compiled:
        higher = sum(1 for a in compiled
                     if max(v or 0 for v in a["compile_peak_gib"]) > max(v or 0 for v in a.get("steady_peak_gib") or [0]))
        lines.append(f"Compiled trials ({len(compiled)}): the compiling step's peak and the steady peak both "
                     f"judged (the larger counts); the compiling step was the higher in {higher}.")
    again = [a for a in attrs if a.get("remeasured")]
    spreads = [a["step_time_iqr_pct"] for a in attrs if a.get("step_time_iqr_pct") is not None]
    if spreads:
        lines.append(f"Step times: spread (IQR) of measured steps {min(spreads):.1f}-{max(spreads):.1f} % of the "
                     f"median; {len(again)} trial(s) measured twice (high spread, or about to become the best).")
    return lines


# -------------------------------------------------- the script's facts, from the baseline's report
def batch_dependent_layers(report: RankReport) -> list[str]:
    """``"path (Type)"`` of the batch-dependent layers the baseline found (BatchNorm and its kind,
    modules whose forward wrote their buffers)."""
    return [str(x) for x in (report.model or {}).get("batch_dependent") or []]


def _shown(layers: list[str]) -> str:
    return ", ".join(layers[:3]) + (f" and {len(layers) - 3} more" if len(layers) > 3 else "")


def keep_split(space: SearchSpace, *, report: RankReport, own: BalanceConfig, allow: bool) -> bool:
    """Restrict ``space`` to the split and accumulation of ``own`` (the script's own configuration:
    its micro-batch per rank, even or not) when the model has batch-dependent layers and changing
    their step is not allowed; returns whether it did."""
    if allow or not batch_dependent_layers(report):
        return False
    space.keep_split(own)
    return True


_NAME_BLOCKS = {
    "lightning": "BalanceStrategy(..., blocks={})",
    "hf": "BalanceTrainer(..., blocks={})",
    "accelerate": "balance.prepare(accelerator, model, optimizer, dataset, blocks={})",
}
"""How a script of each integration names its blocks (``model_info["framework"]`` in the rank report)."""


def name_blocks(model: dict[str, Any], path: str) -> str:
    """The call that names the blocks at ``path`` in this script: ``plan.wrap(model, blocks=...)``, or
    the integration's own ``blocks=`` when a framework owns the loop (it never calls ``plan.wrap``)."""
    return _NAME_BLOCKS.get(str(model.get("framework") or ""), "plan.wrap(model, blocks={})").format(path)


def script_facts(report: RankReport, *, kept_split: bool, allow: bool, split: str) -> list[str]:
    """One line per fact (see the module doc); ``split``: the script's split in words."""
    lines = []
    model = report.model or {}
    if int(model.get("num_blocks") or 0) == 0:
        lines.append("No repeated blocks found in the model (no ModuleList or nn.Sequential of same-type blocks): "
                     "activation checkpointing is not searched. Name the blocks with "
                     + name_blocks(model, '"path.to.blocks"') + " to search it.")
    else:
        lines.append(f"Blocks: {model.get('num_blocks')} at '{model.get('blocks_path') or '(the model)'}' "
                     f"(name others with {name_blocks(model, '...')}).")
    layers = batch_dependent_layers(report)
    if layers and kept_split:
        lines.append(f"Batch-dependent layers ({_shown(layers)}): their train-mode step depends on which samples "
                     f"share a micro-batch, so the split and accumulation stay the script's own ({split}); "
                     "checkpointing, dtype, buckets and compile are searched. Pass --allow-batch-dependent to "
                     "search splits anyway (verified in eval mode).")
    elif layers and allow:
        lines.append(f"Batch-dependent layers ({_shown(layers)}): splits are searched (--allow-batch-dependent) and "
                     "verified in eval mode; their batch statistics change with the split.")
    data = report.data or {}
    samples, global_batch = data.get("samples"), data.get("global_batch")
    if isinstance(samples, int) and isinstance(global_batch, int) and samples < global_batch:
        lines.append(f"The dataset has {samples} samples, fewer than one global batch ({global_batch}): every step "
                     f"is a partial step of at most {samples} samples, and samples/s counts the samples really "
                     "used. Give the script more data (or a smaller --global-batch) to tune full steps.")
    return lines


def summary_facts(study_attrs: dict[str, Any]) -> list[str]:
    """The script's facts the study's summary repeats: all but the ``Blocks:`` line, said once at the start."""
    facts = study_attrs.get(StudyAttr.SCRIPT_FACTS) or []
    return [str(line) for line in facts if not str(line).startswith("Blocks: ")]
