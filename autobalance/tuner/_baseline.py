"""The baseline trial: the script's own configuration, run once per study (other workers wait for
it); its report defines the search space and the devices' capacity."""

from __future__ import annotations

import contextlib
import functools
import time
from typing import Any

import optuna

from autobalance._config import BalanceConfig, split_evenly
from autobalance._errors import ConfigError, LaunchError, TrialScriptError, UsageError
from autobalance._files import script_sha256
from autobalance.launcher import TrialOutcome
from autobalance.protocol import (
    RankDevice,
    RankReport,
    Status,
    StudyAttr,
    TrialAttr,
    best_trial,
    exchange_rate_text,
    memory_text,
    over_limit,
)
from autobalance.store import heartbeat_interval_s, study_id
from autobalance.tuner._launching import TrialLauncher, beating
from autobalance.tuner._recording import Recorder
from autobalance.tuner._reporter import Reporter
from autobalance.tuner._settings import TuneSettings
from autobalance.tuner._study import BaselineClaim, counted_trials, worker_id
from autobalance.tuner._summary import keep_split, script_facts
from autobalance.tuner.search import SearchSpace, ShardingFacts, fix_exchange_rate, rate_fixed

__all__ = ["baseline_done", "baseline_fit_note", "baseline_once", "reference_configs"]


def baseline_once(study: optuna.Study, *, settings: TuneSettings, storage: optuna.storages.RDBStorage,
                  launcher: TrialLauncher, recorder: Recorder, reporter: Reporter) -> SearchSpace:
    """Run the baseline, or wait while another worker on this study runs it."""
    claim = BaselineClaim(storage, study_id(study, storage), owner=worker_id(), stale_after_s=3 * heartbeat_interval_s())
    waiting = False
    while True:
        attrs = study.user_attrs
        if baseline_done(attrs):
            return SearchSpace.from_dict(attrs[StudyAttr.SPACE])
        if claim.try_acquire():
            break
        if not waiting:
            holder = claim.holder() or {}
            reporter.note(f"Waiting for the baseline trial that {holder.get('owner', 'another worker')} runs.")
            waiting = True
        time.sleep(1.0)
    try:
        with beating(claim.refresh, at_once=False):  # the claim kept fresh while it is held
            attrs = study.user_attrs  # recorded by another worker while this one took the claim?
            if baseline_done(attrs):
                return SearchSpace.from_dict(attrs[StudyAttr.SPACE])
            fix = functools.partial(_fix_reference, study, settings=settings, launcher=launcher,
                                    recorder=recorder, reporter=reporter)
            if StudyAttr.BASELINE in attrs and StudyAttr.SPACE in attrs:  # no reference run yet
                space = SearchSpace.from_dict(attrs[StudyAttr.SPACE])
                own = study.trials[int(attrs[StudyAttr.BASELINE])].user_attrs.get(TrialAttr.CONFIG)
                if own:
                    fix(space, BalanceConfig.from_dict(own))
                return space
            number = len(study.get_trials(deepcopy=False))
            reporter.start(number, None, baseline=True)
            outcome = launcher.launch(study, number=number, config=None)
            space, defaults = _space_from_baseline(study, outcome, settings)
            for line in study.user_attrs.get(StudyAttr.SCRIPT_FACTS) or []:
                reporter.note(line)  # the study's first lines: what shapes the search
            study.enqueue_trial(space.params_from_config(defaults), user_attrs={TrialAttr.BASELINE: True})
            frozen = recorder.record(study, study.ask(), defaults, outcome, baseline=True)
            study.set_user_attr(StudyAttr.BASELINE, frozen.number)
            reporter.finish(frozen, best_trial(study))
            if note := baseline_fit_note(frozen.user_attrs, global_batch=defaults.global_batch):
                reporter.note(note)
            fix(space, defaults)
            return space
    finally:
        claim.release()


def baseline_done(attrs: dict[str, Any]) -> bool:
    """Whether the study's baseline ran and its exchange rate is fixed: the search may start."""
    return StudyAttr.BASELINE in attrs and StudyAttr.SPACE in attrs and rate_fixed(attrs)


def reference_configs(space: SearchSpace, own: BalanceConfig) -> list[BalanceConfig]:
    """The reference runs' configurations, tried in order until one gives a step time: the script's
    own configuration (its dtype, buckets, sharding, eager) split evenly with every block
    checkpointed at its own number of micro-steps, then at the most the space allows."""
    if "off" not in space.compile_modes:
        return []
    world = space.world_size
    out: list[BalanceConfig] = []
    sharding: dict[str, Any] = ({"optimizer_sharding": "zero1"} if own.optimizer_sharding == "zero1"
                                and "zero1" in space.shardings else {})  # even shares, as the script's own
    for acc in dict.fromkeys([own.accumulation, max(space.accumulations)]):
        if acc not in space.accumulations or space.micro_total(acc) < world:
            continue
        try:
            cfg = space.config_for(split_evenly(space.micro_total(acc), [1.0] * world), acc, None,
                                   checkpoint=[list(range(space.num_layers)) for _ in range(world)], dtype=own.dtype,
                                   bucket_cap_mb=own.bucket_cap_mb, gradient_as_bucket_view=own.gradient_as_bucket_view,
                                   **sharding)
        except (ConfigError, UsageError, ValueError):  # a split this space cannot hold
            continue
        if space.contains(cfg) and cfg.to_json() not in {c.to_json() for c in out}:
            out.append(cfg)
    return out


def _fix_reference(study: optuna.Study, space: SearchSpace, own: BalanceConfig, *, settings: TuneSettings,
                   launcher: TrialLauncher, recorder: Recorder, reporter: Reporter) -> None:
    """Fix the objective's exchange rate before the search and print it: the baseline's step; else,
    on several ranks, the first reference run's (:func:`reference_configs`) that gives one within
    ``--trials``; else the first trial's that will."""
    s = settings
    if study.user_attrs.get(StudyAttr.REFERENCE) is None and s.world_size > 1:
        for cfg in reference_configs(space, own):
            if counted_trials(study) >= s.trials:  # --trials holds no more
                break
            _reference_run(study, space, cfg, launcher=launcher, recorder=recorder, reporter=reporter)
            if study.user_attrs.get(StudyAttr.REFERENCE) is not None:
                break
    if study.user_attrs.get(StudyAttr.REFERENCE) is None:
        fix_exchange_rate(study, reference_step_s=None, source="first-measured", trial=None,
                          weight_spread=s.weight_spread, weight_time=s.weight_time, world_size=s.world_size)
        reporter.note("Exchange rate: nothing gave a step time before the search; the first trial that does "
                      "fixes the reference step every step time is divided by.")
        return
    if text := exchange_rate_text(study.user_attrs):
        reporter.note(text)


def _reference_run(study: optuna.Study, space: SearchSpace, config: BalanceConfig, *, launcher: TrialLauncher,
                   recorder: Recorder, reporter: Reporter) -> None:
    """One reference run: an ordinary trial of the study (it counts, and the models learn from it)."""
    study.enqueue_trial(space.params_from_config(config), user_attrs={TrialAttr.REFERENCE_RUN: True})
    trial = study.ask()
    try:
        config = space.suggest(trial)
        reporter.start(trial.number, config, why="reference run: fixes the step time the objective divides by")
        outcome = launcher.launch(study, number=trial.number, config=config, trial=trial)
        frozen = recorder.record(study, trial, config, outcome)
    except BaseException as exc:
        with contextlib.suppress(Exception):
            recorder.unfinished(study, trial, exc)  # never leave it RUNNING
        raise
    reporter.finish(frozen, best_trial(study))


def baseline_fit_note(attrs: dict[str, Any], *, global_batch: int) -> str | None:
    """One line after a baseline that does not fit (out of memory, over the usable limit, or timed
    out): what that means for the study. None when it fits."""
    status, rank, over = attrs.get(TrialAttr.STATUS), attrs.get(TrialAttr.FAILING_RANK), over_limit(attrs)
    if status == Status.OOM:
        why = f"rank {rank} ran out of memory" if rank is not None else "a rank ran out of memory"
    elif over is not None:
        why = over
    elif status == Status.TIMEOUT:
        why = "it timed out (--trial-timeout)"
    else:
        return None
    usable = attrs.get(TrialAttr.USABLE_GIB) or []
    within = f" in {memory_text(min(usable))} usable per rank" if usable and None not in usable else ""
    return (f"The script's own configuration does not fit{within} ({why}): the study looks for one that does, "
            f"with the same global batch of {global_batch}"
            + ("." if status == Status.OK else "; without a baseline step time there is no speed-up to report."))


def _device(rep: RankReport) -> RankDevice:
    """A rank's device; a report without one fails here, as it did when reports were read as JSON."""
    if rep.device is None:
        raise KeyError("device")
    return rep.device


def _capacity(rep: RankReport) -> float:  # bytes
    capacity = _device(rep).capacity_bytes
    if capacity is None:
        raise TypeError("a rank's report without its device's capacity")
    return float(capacity)


def _space_from_baseline(study: optuna.Study, outcome: TrialOutcome,
                         s: TuneSettings) -> tuple[SearchSpace, BalanceConfig]:
    """The search space around the script's own configuration; the study attributes the baseline sets."""
    rep = next((r for _, r in sorted(outcome.reports.items()) if r.defaults and r.model), None)
    if outcome.status == Status.ERROR:
        raise TrialScriptError(
            f"the baseline trial (the script's own configuration) failed: {outcome.reason}. "
            f"Fix the script; logs in {outcome.trial_dir}.", traceback_text=outcome.traceback,
            rank=outcome.failing_rank)
    if rep is None:
        advice = ("Raise --trial-timeout." if outcome.status == Status.TIMEOUT else
                  "A trial measures a script that calls autobalance.plan() and trains through plan.wrap() and "
                  "plan.steps() (README, 'Adopt it').")
        raise LaunchError(f"the baseline trial (the script's own configuration) measured nothing: "
                          f"{outcome.reason}; logs in {outcome.trial_dir}. {advice}")
    defaults = BalanceConfig.from_dict(rep.defaults)
    device = _device(rep)
    dtypes = s.dtypes or (["fp32", "bf16", "fp16"] if device.type == "cuda" else ["fp32", "bf16"])
    if defaults.dtype not in dtypes:
        dtypes = [defaults.dtype, *dtypes]
    blocks = int((rep.model or {}).get("num_blocks", 0))
    space = SearchSpace.build(world_size=s.world_size, global_batch=defaults.global_batch, num_layers=blocks,
                              dtypes=dtypes, max_accumulation=max(s.max_accumulation, defaults.accumulation),
                              compile_modes=s.compile_modes(), any_split=s.split == "any",
                              compile_scopes=s.compile_scopes(blocks))
    if defaults.accumulation not in space.accumulations:
        space.accumulations = sorted({*space.accumulations, defaults.accumulation})
    if s.world_size > 1 and any((r.optimizer or {}).get("wrapped") for r in outcome.reports.values()):
        # the script shards through plan.optimizer: search where the state lives (any rank's report says
        # so: a baseline that ran out of memory may have lost the other ranks' reports)
        space.shardings = ["off", "zero1"]
    kept = keep_split(space, report=rep, own=defaults, allow=s.allow_batch_dependent)
    facts = script_facts(rep, kept_split=kept, allow=s.allow_batch_dependent, split=defaults.split_text())
    capacity = [_capacity(outcome.reports.get(r) or rep) for r in range(s.world_size)]
    sharding = ShardingFacts.from_model(rep.model, s.world_size)
    if sharding is not None and sharding.searched(min(s.caps_bytes() or capacity) * (1 - s.headroom)):
        space.param_shardings = ["off", "embeddings", "blocks"]  # large embedding-like modules: FSDP2 may pay
    caps = s.caps_bytes() if s.device == "cuda" else None
    too_big = [(r, c) for r, c in enumerate(caps or []) if c > capacity[r]]
    if too_big:
        r, c = too_big[0]
        raise UsageError(f"--memory-cap-gib={c / 2**30:g} for rank {r} is larger than its card "
                         f"({capacity[r] / 2**30:.1f} GiB); use a smaller cap.")
    study.set_user_attr(StudyAttr.SPACE, space.to_dict())
    study.set_user_attr(StudyAttr.SCRIPT_FACTS, facts)
    study.set_user_attr(StudyAttr.ALLOW_BATCH_DEPENDENT, s.allow_batch_dependent)
    study.set_user_attr(StudyAttr.CAPACITY, capacity)
    study.set_user_attr(StudyAttr.CAPACITY_IN_WORDS, capacity_in_words(capacity, caps=s.caps_bytes(),
                                                                      headroom=s.headroom))
    study.set_user_attr(StudyAttr.DEVICE, device.as_read())  # the baseline's device as it reported it
    study.set_user_attr(StudyAttr.MODEL, dict(rep.model or {}))
    reports = [outcome.reports.get(r) for r in range(s.world_size)]  # production knows a rank by its identity
    study.set_user_attr(StudyAttr.DEVICE_NAMES, [r.device.identity if r and r.device else None for r in reports])
    study.set_user_attr(StudyAttr.SCRIPT_SHA, script_sha256(s.script))
    study.set_user_attr(StudyAttr.TORCH_VERSION, rep.torch_version)
    study.set_user_attr(StudyAttr.CUDA_VERSION, rep.cuda_version)
    return space, defaults


def capacity_in_words(capacity: list[float], *, caps: list[int] | None, headroom: float) -> str:
    """The study attribute :data:`StudyAttr.CAPACITY_IN_WORDS`: ``capacity_bytes`` (the devices' own
    memory, e.g. the host's RAM on CPU) beside the limit the trials are judged against, with units."""

    def per_rank(values: list[float]) -> str:
        texts = [memory_text(v / 2**30) for v in values]
        return f"{texts[0]} per rank" if len(set(texts)) == 1 else ", ".join(f"rank {r} {t}" for r, t in enumerate(texts))

    own = per_rank(capacity)
    if caps:
        return (f"capacity_bytes is each device's own memory ({own}); trials are judged against the emulated cap: "
                f"{per_rank([float(c) for c in caps])} ({per_rank([c * (1 - headroom) for c in caps])} usable "
                f"with {headroom:.0%} headroom).")
    return (f"capacity_bytes is each device's memory ({own}); trials are judged against it: "
            f"{per_rank([c * (1 - headroom) for c in capacity])} usable with {headroom:.0%} headroom.")
