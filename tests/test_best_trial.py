"""One meaning of "best": the trial the views, verification and the saved configuration call the best
is the one the loop re-measures as "would become the best" and prunes against (pure, no torchrun).

On 2 ranks the objective weighs the memory spread with the step time, so the fastest feasible trial
need not be the best. The loop once judged "would become the best" and pruning by the fastest feasible
step time, while ``best_trial`` ranked by the objective: a trial that became the best unconfirmed, a
trial re-measured as the next best that was not, and a pruning yardstick from another trial."""

from __future__ import annotations

import threading
import types

import optuna
import pytest

from autobalance.launcher import TrialOutcome
from autobalance.protocol import CONSTRAINTS_KEY, Status, StudyAttr, TrialAttr, best_trial
from autobalance.tuner import TuneSettings
from autobalance.tuner._launching import best_step_s
from autobalance.tuner._loop import TrialLoop
from autobalance.tuner._recording import constraints, feasible
from autobalance.tuner._verify import ranked_candidates
from autobalance.tuner.search import TrialFigures

GIB = 2.0**30
CAP = 16 * GIB


def _figures(step_s: float, peaks_gib: tuple[float, float]) -> TrialFigures:
    return TrialFigures(status=Status.OK, peak_device=[p * GIB for p in peaks_gib], peak_allocated=[None, None],
                        peak_reserved=[None, None], outside_pytorch=[None, None], capacity=[CAP, CAP],
                        step_time_s=step_s, samples_per_s=32 / step_s, startup_s=1.0, measured_steps=4)


def _outcome(step_s: float) -> TrialOutcome:
    steady = [step_s, step_s * 1.001, step_s * 0.999, step_s]  # steady steps: no re-measure for their spread
    reports = {r: {"status": "ok", "step_times_s": steady, "step_time_s": step_s, "config": {"global_batch": 32},
                   "device": {"type": "cuda"}, "memory": {"peak_device": 1.0}} for r in range(2)}
    return TrialOutcome(status=Status.OK, reason="x", reports=reports, wall_s=5.0)


def _tell(study: optuna.Study, settings: TuneSettings, figures: TrialFigures, config: dict | None = None,
          reused_from: int | None = None) -> optuna.trial.FrozenTrial:
    """Told as the recorder tells a measured trial: its constraints and objective values."""
    trial = study.ask()
    met = constraints(figures, settings)
    trial.set_user_attr(TrialAttr.STATUS, Status.OK)
    trial.set_user_attr(TrialAttr.FEASIBLE, feasible(figures, settings, Status.OK))
    trial.set_user_attr(TrialAttr.STEP_TIME_MS, 1000 * float(figures.step_time_s))  # type: ignore[arg-type]
    trial.set_user_attr(TrialAttr.CONFIG, config or {"trial": trial.number})
    if reused_from is not None:
        trial.set_user_attr(TrialAttr.REUSED_FROM, reused_from)
    study._storage.set_trial_system_attr(trial._trial_id, CONSTRAINTS_KEY, met)
    values = figures.values(reference_step_s=study.user_attrs[StudyAttr.REFERENCE], weight_spread=settings.weight_spread,
                            weight_time=settings.weight_time, multi_objective=settings.multi_objective)
    return study.tell(trial, values)


@pytest.fixture
def study_and_loop(tmp_path):
    (tmp_path / "train.py").write_text("")
    settings = TuneSettings(script=str(tmp_path / "train.py"), device="cuda", remeasure="on")
    loop = TrialLoop(settings=settings, storage=None, launcher=types.SimpleNamespace(stop=threading.Event()),
                     recorder=None, reporter=None, advisor=None, budget=None)  # type: ignore[arg-type]
    study = optuna.create_study()
    study.set_user_attr(StudyAttr.REFERENCE, 0.2)  # time in the objective: step / 200 ms
    study.set_user_attr(StudyAttr.OBJECTIVE, {"weight_spread": 1.0, "weight_time": 1.0, "world_size": 2})
    balanced = _tell(study, settings, _figures(0.200, (8.0, 8.0)))  # objective 0 + 1.0 = 1.0: the best
    fast = _tell(study, settings, _figures(0.100, (2.0, 14.0)))  # 0.75 + 0.5 = 1.25: the fastest, not the best
    assert best_trial(study).number == balanced.number
    assert fast.values[0] > balanced.values[0]
    return study, loop, settings


def test_the_trial_that_becomes_the_best_is_the_one_remeasured(study_and_loop):
    study, loop, settings = study_and_loop
    better = _figures(0.150, (8.0, 8.0))  # 0 + 0.75: becomes the best, slower than the fastest (100 ms)
    worse = _figures(0.090, (1.5, 14.0))  # 0.78 + 0.45 = 1.23: faster than any, never the best
    reasons = {name: loop.remeasure_reason(study, _outcome(f.step_time_s), f) for name, f in
               (("better", better), ("worse", worse))}
    assert reasons["worse"] is None  # not the best once recorded: no second run as "the next best"
    assert reasons["better"] is not None and "would become the best" in reasons["better"]
    told = _tell(study, settings, better)
    assert best_trial(study).number == told.number  # what the loop confirmed is what is called the best


def test_pruning_verification_and_views_read_the_same_best(study_and_loop):
    study, _loop, settings = study_and_loop
    best = best_trial(study)
    assert best_step_s(study) == pytest.approx(best.user_attrs[TrialAttr.STEP_TIME_MS] / 1000)  # 200 ms, not 100
    assert ranked_candidates(study)[0].number == best.number
    copy = _tell(study, settings, _figures(0.200, (8.0, 8.0)), config=best.user_attrs[TrialAttr.CONFIG],
                 reused_from=best.number)  # a reused result is its source's copy, never a candidate of its own
    assert best_trial(study).number == best.number
    assert copy.number not in [t.number for t in ranked_candidates(study)]


def test_over_the_spread_limit_is_neither_the_best_nor_remeasured_as_it(tmp_path):
    (tmp_path / "train.py").write_text("")
    settings = TuneSettings(script=str(tmp_path / "train.py"), device="cuda", remeasure="on", max_spread_gib=2.0)
    loop = TrialLoop(settings=settings, storage=None, launcher=types.SimpleNamespace(stop=threading.Event()),
                     recorder=None, reporter=None, advisor=None, budget=None)  # type: ignore[arg-type]
    study = optuna.create_study()
    study.set_user_attr(StudyAttr.REFERENCE, 0.2)
    balanced = _tell(study, settings, _figures(0.200, (8.0, 8.0)))
    spread = _figures(0.050, (4.0, 9.0))  # 5 GiB of spread > 2 GiB; fits in memory; far faster
    assert loop.remeasure_reason(study, _outcome(0.050), spread) is None
    over = _tell(study, settings, spread)
    assert best_trial(study).number == balanced.number and best_step_s(study) == pytest.approx(0.2)
    assert over.number not in [t.number for t in ranked_candidates(study)]
