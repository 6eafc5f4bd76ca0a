"""The objective's exchange rate between memory spread and step time is fixed before the search:
the same two measured trials get the same objective values, ranked the same way, whichever trial
the search happened to measure first; it is printed in the study's first lines, stored with the
study, shown in the report; a study stored before it was recorded keeps loading."""

from __future__ import annotations

import html
import warnings
from pathlib import Path
from typing import Any

import optuna
import pytest

from autobalance import BalanceConfig
from autobalance.launcher import TrialOutcome
from autobalance.protocol import StudyAttr, TrialAttr, exchange_rate, exchange_rate_text
from autobalance.report import build_report, summarize
from autobalance.store import dashboard_notes, open_storage
from autobalance.tuner import SearchSpace, TuneSettings
from autobalance.tuner._baseline import baseline_done, baseline_once
from autobalance.tuner._recording import Recorder
from autobalance.tuner._reporter import NullReporter
from autobalance.tuner._study import open_study
from tests.synthetic_study import CAP_GIB, GIB, HEADROOM, SCRIPT, Spec, _report

LAYERS = 4
OWN = BalanceConfig(micro_batches=[16, 16], accumulation=1, global_batch=32, dtype="fp32", bucket_cap_mb=25.0,
                    gradient_as_bucket_view=True, checkpoint=[[], []])
REFERENCE_MS = 200.0
"""The reference run's step: the script's own configuration with every block checkpointed."""


def _config(micro: list[int], acc: int, dtype: str = "bf16", ckpt: int = 0) -> BalanceConfig:
    return BalanceConfig(micro_batches=micro, accumulation=acc, global_batch=32, dtype=dtype, bucket_cap_mb=25.0,
                         gradient_as_bucket_view=True, checkpoint=[list(range(ckpt))] * len(micro))


def _outcome(spec: Spec, config: BalanceConfig, *, own: bool = False) -> TrialOutcome:
    reports = {r: _report(spec, r, config) for r in range(config.world_size)}
    if own:  # what the baseline's report says about the script
        for rep in reports.values():
            rep.update(defaults=config.to_dict(), model={"num_blocks": LAYERS})
    return TrialOutcome(status=spec.status, reason="all ranks finished" if spec.status == "ok" else
                        f"rank {spec.failing_rank} ran out of memory (torch.OutOfMemoryError)", reports=reports,
                        returncode=0 if spec.status == "ok" else 1, wall_s=5.0, failing_rank=spec.failing_rank)


class _Launcher:
    """Answers the baseline (``config`` None) and the reference runs from fixed outcomes."""

    def __init__(self, *, baseline: Spec, reference: Spec | None, own: BalanceConfig = OWN) -> None:
        self.baseline, self.reference, self.own = baseline, reference, own
        self.launched: list[BalanceConfig | None] = []

    def launch(self, study: Any, *, number: int, config: BalanceConfig | None, trial: Any = None,
               again: bool = False) -> TrialOutcome:
        self.launched.append(config)
        if config is None:
            return _outcome(self.baseline, self.own, own=True)
        assert self.reference is not None and all(len(c) == LAYERS for c in config.checkpoint), config
        return _outcome(self.reference, config)


class _Notes(NullReporter):
    def __init__(self) -> None:
        self.lines: list[str] = []

    def note(self, text: str) -> None:
        self.lines.append(text)


def _settings(tmp_path: Path, name: str, world: int = 2, trials: int = 20) -> TuneSettings:
    return TuneSettings(script=SCRIPT, storage=f"sqlite:///{tmp_path / 'studies.db'}", study_name=name,
                        nproc_per_node=world, device="cuda", memory_cap_gib=[CAP_GIB] * world, headroom=HEADROOM,
                        runs_dir=str(tmp_path / "runs"), trials=trials)


def _start(tmp_path: Path, name: str, *, baseline: Spec, reference: Spec | None, world: int = 2,
           trials: int = 20) -> tuple[optuna.Study, SearchSpace, Recorder, _Launcher, _Notes]:
    settings = _settings(tmp_path, name, world, trials)
    storage = open_storage(settings.storage)
    study = open_study(settings, storage)
    own = OWN if world == 2 else BalanceConfig(micro_batches=[32], accumulation=1, global_batch=32, checkpoint=[[]],
                                               gradient_as_bucket_view=True)
    recorder, launcher, notes = Recorder(settings=settings, storage=storage), _Launcher(
        baseline=baseline, reference=reference, own=own), _Notes()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        space = baseline_once(study, settings=settings, storage=storage, launcher=launcher,  # type: ignore[arg-type]
                              recorder=recorder, reporter=notes)
    return study, space, recorder, launcher, notes


def _measure(study: optuna.Study, space: SearchSpace, recorder: Recorder, config: BalanceConfig,
             spec: Spec) -> optuna.trial.FrozenTrial:
    """One search trial recorded as the loop records it."""
    study.enqueue_trial(space.params_from_config(config), skip_if_exists=False)
    trial = study.ask()
    space.suggest(trial)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return recorder.record(study, trial, config, _outcome(spec, config))


OOM_OWN = Spec(status="oom", micro=[16, 16], acc=1, dtype="fp32", peaks_gib=[15.9, 14.2], failing_rank=0)
REFERENCE_RUN = Spec(status="ok", micro=[16, 16], acc=1, dtype="fp32", ckpt=LAYERS, peaks_gib=[10.0, 9.0],
                     step_ms=REFERENCE_MS)
SLOW = (_config([4, 4], 4, ckpt=2), Spec(status="ok", micro=[4, 4], acc=4, peaks_gib=[6.0, 6.0], step_ms=548.0))
FAST = (_config([16, 16], 1), Spec(status="ok", micro=[16, 16], acc=1, peaks_gib=[14.9, 13.0], step_ms=50.0))
# the pair: "twice as fast" with 5.9 GiB of spread against "balanced"
UNEVEN = (_config([8, 8], 2), Spec(status="ok", micro=[8, 8], acc=2, peaks_gib=[14.8, 8.86], step_ms=65.9))
BALANCED = (_config([8, 8], 2, ckpt=1), Spec(status="ok", micro=[8, 8], acc=2, peaks_gib=[12.0, 12.0], step_ms=129.7))


def test_the_same_pair_gets_the_same_values_whichever_trial_was_measured_first(tmp_path):
    """The script's own configuration runs out of memory in both studies; one study's search then
    measures a slow configuration first (548 ms), the other's a fast one (50 ms). The pair after
    them gets the same values in both, in the same order. Before the rate was fixed the first
    measured trial became the reference: the uneven trial lost against 548 ms and won against 50 ms."""
    values: dict[str, tuple[float, float]] = {}
    for name, first in (("slow-first", SLOW), ("fast-first", FAST)):
        study, space, recorder, launcher, notes = _start(tmp_path, name, baseline=OOM_OWN, reference=REFERENCE_RUN)
        rate = study.user_attrs[StudyAttr.EXCHANGE_RATE]
        assert rate["reference_step_s"] == pytest.approx(REFERENCE_MS / 1000) and rate["source"] == "reference"
        assert len(launcher.launched) == 2 and rate["trial"] == 1  # the baseline, then one reference run
        assert study.trials[1].user_attrs[TrialAttr.REFERENCE_RUN] is True
        assert any(line.startswith("Exchange rate: 1 point of memory spread (1 % of capacity, 164 MiB of 16.0 GiB) is "
                                   "worth 2.00 ms of step time (1 % of the reference step, 200.0 ms: trial 1, ")
                   for line in notes.lines), notes.lines  # printed before the first search trial
        _measure(study, space, recorder, *first)
        uneven = _measure(study, space, recorder, *UNEVEN)
        balanced = _measure(study, space, recorder, *BALANCED)
        values[name] = (uneven.values[0], balanced.values[0])
        # the sentence a user checks against the trial table: spread % / 100 + step ms / reference ms
        for t in (uneven, balanced):
            expected = t.user_attrs["spread_pct_of_capacity"] / 100 + t.user_attrs["step_time_ms"] / REFERENCE_MS
            assert t.values[0] == pytest.approx(expected, rel=1e-4)
    assert values["slow-first"] == pytest.approx(values["fast-first"], rel=1e-12)
    uneven_value, balanced_value = values["slow-first"]
    assert balanced_value < uneven_value  # 0 + 129.7 / 200 < 37.1 % + 65.9 / 200


def test_a_baseline_that_runs_is_the_reference_and_nothing_else_is_launched(tmp_path):
    own = Spec(status="ok", micro=[16, 16], acc=1, dtype="fp32", peaks_gib=[14.0, 12.0], step_ms=120.0)
    study, _, _, launcher, notes = _start(tmp_path, "runs", baseline=own, reference=None)
    assert launcher.launched == [None]
    assert exchange_rate(study.user_attrs) == {"reference_step_s": pytest.approx(0.12), "source": "baseline",
                                               "trial": 0, "weight_spread": 1.0, "weight_time": 1.0, "world_size": 2,
                                               "capacity_bytes": [CAP_GIB * GIB] * 2}
    assert notes.lines[-1] == exchange_rate_text(study.user_attrs)
    assert ("(1 % of capacity, 164 MiB of 16.0 GiB) is worth 1.20 ms of step time (1 % of the reference step, "
            "120.0 ms: trial 0, the script's own configuration)") in notes.lines[-1]
    assert baseline_done(study.user_attrs)
    assert summarize(study).exchange_rate == notes.lines[-1]
    # the report and optuna-dashboard's study note say it in the same words
    page = Path(build_report(study, output_html=str(tmp_path / "r.html")).html).read_text()
    assert f'<p class="meta" id="exchange-rate">{html.escape(notes.lines[-1])}</p>' in page
    get_note, _, _ = dashboard_notes()
    system = study._storage.get_study_system_attrs(study._study_id)
    assert f"- {notes.lines[-1]}" in get_note(system, None)["body"].splitlines()


def test_one_rank_launches_no_reference_run_and_the_first_step_fixes_it(tmp_path):
    own = Spec(status="oom", micro=[32], acc=1, dtype="fp32", peaks_gib=[15.9], failing_rank=0)
    study, space, recorder, launcher, notes = _start(tmp_path, "one", baseline=own, reference=None, world=1)
    assert launcher.launched == [None] and baseline_done(study.user_attrs)
    assert exchange_rate(study.user_attrs) is None and "the first trial that does fixes" in notes.lines[-1]
    cfg = BalanceConfig(micro_batches=[8], accumulation=4, global_batch=32, dtype="bf16", checkpoint=[[]],
                        gradient_as_bucket_view=True)
    t = _measure(study, space, recorder, cfg, Spec(status="ok", micro=[8], acc=4, peaks_gib=[9.0], step_ms=300.0))
    rate = exchange_rate(study.user_attrs)
    assert rate is not None and rate["source"] == "first-measured" and rate["trial"] == t.number
    assert "one rank, nothing to trade; trials rank by step time" in (exchange_rate_text(study.user_attrs) or "")


def test_no_reference_run_beyond_trials(tmp_path):
    study, _, _, launcher, notes = _start(tmp_path, "one-trial", baseline=OOM_OWN, reference=REFERENCE_RUN, trials=1)
    assert launcher.launched == [None] and baseline_done(study.user_attrs)
    assert study.user_attrs[StudyAttr.EXCHANGE_RATE]["reference_step_s"] is None
    assert "the first trial that does fixes" in notes.lines[-1]


def test_a_study_stored_before_the_rate_keeps_loading(tmp_path):
    """A study recorded the old way: its reference step (the first measured trial's) and weights, no
    exchange rate. It continues without a reference run, its trials keep their values, and the
    report and the console say its rate in the same words."""
    settings = _settings(tmp_path, "old")
    storage = open_storage(settings.storage)
    study = open_study(settings, storage)
    space = SearchSpace.build(world_size=2, global_batch=32, num_layers=LAYERS, dtypes=["fp32", "bf16"],
                              max_accumulation=8)
    study.set_user_attr(StudyAttr.SPACE, space.to_dict())
    study.set_user_attr(StudyAttr.CAPACITY, [141 * GIB] * 2)
    recorder = Recorder(settings=settings, storage=storage)
    study.enqueue_trial(space.params_from_config(OWN), user_attrs={TrialAttr.BASELINE: True})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        recorder.record(study, study.ask(), OWN, _outcome(OOM_OWN, OWN, own=True), baseline=True)
    study.set_user_attr(StudyAttr.BASELINE, 0)
    study.set_user_attr(StudyAttr.REFERENCE, 0.548)  # as the old code stored it: the first measured trial's
    assert StudyAttr.EXCHANGE_RATE not in study.user_attrs
    reloaded = optuna.load_study(study_name="old", storage=settings.storage)
    assert baseline_done(reloaded.user_attrs)  # no baseline again, no reference run
    launcher = _Launcher(baseline=OOM_OWN, reference=None)
    baseline_once(reloaded, settings=settings, storage=storage, launcher=launcher,  # type: ignore[arg-type]
                  recorder=recorder, reporter=NullReporter())
    assert launcher.launched == []
    text = exchange_rate_text(reloaded.user_attrs)
    assert text is not None and "548.0 ms: the first trial that gave a step time, in a study stored before" in text
    balanced = _measure(reloaded, space, recorder, *BALANCED)
    assert balanced.values[0] == pytest.approx(129.7 / 548.0, rel=1e-4)  # against the reference it stored
    assert summarize(reloaded).exchange_rate == text
