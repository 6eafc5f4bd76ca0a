"""The leaders re-measured before saving (``tuner/_remeasure.py``): which trials are within the measured
noise of the best, the interleaved runs that pool their steps and re-rank them, the plan the time left
holds (or the stated reason for none), and the saved figure's spread. No launches: outcomes are made
here, deterministically."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from autobalance import BalanceConfig
from autobalance.cli._views import saved_figure_rows
from autobalance.launcher import TrialOutcome
from autobalance.protocol import Status, StudyAttr, best_trial
from autobalance.store import SavedConfig
from autobalance.tuner._remeasure import (
    close_leaders,
    leader_candidates,
    leaders_line,
    noise_band,
    plan_leaders,
    remeasure_leaders,
    saved_spread,
    spread_text,
)
from autobalance.tuner._verify import figures_of_trial
from autobalance.tuner.search._constants import LEADER_NOISE_FLOOR, LEADER_RUNS
from tests.synthetic_study import Spec, build_study


def _trial(number: int, ms: float, *, iqr_pct: float | None = None, steps: int = 8) -> Any:
    attrs: dict[str, Any] = {"step_time_ms": ms, "measured_steps": steps}
    if iqr_pct is not None:
        attrs["step_time_iqr_pct"] = iqr_pct
    return SimpleNamespace(number=number, user_attrs=attrs)


def test_leaders_are_the_trials_within_the_measured_noise_of_the_best() -> None:
    # 100 ms and 103 ms: 3 % apart, inside the floor (two medians of ~9 steps of +-15 % single steps)
    leaders, why = close_leaders([_trial(4, 100.0), _trial(3, 103.0), _trial(7, 120.0)])
    assert [t.number for t in leaders] == [4, 3], why
    assert "trial 3 103.0 ms (+3.0 %, within 5.0 %)" in why
    # separated: the next is 12 % slower with tight steps; nothing to re-measure, and the line says why
    leaders, why = close_leaders([_trial(4, 100.0, iqr_pct=1.0), _trial(3, 112.0, iqr_pct=1.0)])
    assert [t.number for t in leaders] == [4]
    assert why.startswith("no other feasible trial is within the measured noise") and "+12.0 %" in why
    # the same 12 % is within the noise of trials whose own steps spread widely (IQR 40 % over 8 steps)
    assert noise_band({"step_time_iqr_pct": 40.0, "measured_steps": 8},
                      {"step_time_iqr_pct": 40.0, "measured_steps": 8}) > 0.12 > LEADER_NOISE_FLOOR
    leaders, _ = close_leaders([_trial(4, 100.0, iqr_pct=40.0), _trial(3, 112.0, iqr_pct=40.0)])
    assert [t.number for t in leaders] == [4, 3]
    # at most three leaders, the fourth within noise named as left out
    leaders, why = close_leaders([_trial(n, 100.0 + n / 10) for n in range(5)])
    assert len(leaders) == 3 and "trial 3 within it too, left out (at most 3 leaders)" in why


def test_the_plan_is_what_the_time_left_holds_and_says_why_or_why_not() -> None:
    a, b, c = _trial(1, 100.0), _trial(2, 101.0), _trial(3, 102.0)
    plan = plan_leaders([a, b, c], run_s=lambda t: 10.0, time_left_s=None, why="close")
    assert (len(plan.leaders), plan.runs) == (3, LEADER_RUNS[0])
    assert [t.number for t in plan.order()] == [1, 2, 3] * LEADER_RUNS[0]  # interleaved: A, B, C, A, B, C, ...
    plan = plan_leaders([a, b, c], run_s=lambda t: 10.0, time_left_s=65.0, why="close")  # more runs, then leaders
    assert (len(plan.leaders), plan.runs) == (2, 3) and "(the most the time left holds)" in plan.reason
    assert "about 60 s of the 65 s left after verification's reserve" in plan.reason
    plan = plan_leaders([a, b, c], run_s=lambda t: 10.0, time_left_s=59.0, why="close")
    assert (len(plan.leaders), plan.runs) == (2, 2)
    plan = plan_leaders([a, b], run_s=lambda t: 10.0, time_left_s=25.0, why="close")
    assert (len(plan.leaders), plan.runs) == (2, 1)
    # too little time: skipped, and the reason says how much was left and what the least plan needs
    plan = plan_leaders([a, b], run_s=lambda t: 20.0, time_left_s=30.0, why="close")
    assert plan.runs == 0 and plan.order() == []
    assert plan.reason == ("Leaders not re-measured: close; but the time left (30 s after verification's reserve) "
                           "does not hold 1 more run(s) of the first two (about 40 s).")
    # one leader: nothing to compare
    plan = plan_leaders([a], run_s=lambda t: 1.0, time_left_s=None, why="nothing close")
    assert plan.runs == 0 and plan.reason == "Leaders not re-measured: nothing close."


def test_when_the_time_holds_fewer_leaders_the_runs_go_to_the_figures_on_the_fewest_runs() -> None:
    """The best was re-measured in the loop (two runs pooled); two contenders within its noise rest on one
    run each and the time holds one more run of two leaders: the contenders run, the best's figure stands."""
    best, c1, c2 = _trial(3, 136.6), _trial(5, 139.4), _trial(4, 140.5)
    best.user_attrs["remeasured"] = {"reason": "would become the best"}
    plan = plan_leaders([best, c1, c2], run_s=lambda t: 10.0, time_left_s=25.0, why="close")
    assert ([t.number for t in plan.leaders], plan.runs) == ([5, 4], 1)
    assert "left out, their figures resting on more runs: trial 3 (2 runs)" in plan.reason
    # all of them fit: every leader runs, the best first
    plan = plan_leaders([best, c1, c2], run_s=lambda t: 10.0, time_left_s=35.0, why="close")
    assert [t.number for t in plan.leaders] == [3, 5, 4] and "left out" not in plan.reason
    # equal evidence: rank order, as before
    plan = plan_leaders([_trial(3, 136.6), c1, c2], run_s=lambda t: 10.0, time_left_s=25.0, why="close")
    assert [t.number for t in plan.leaders] == [3, 5]


def _outcome(steps_ms: list[float]) -> TrialOutcome:
    rep = {"status": "ok", "rank": 0, "config": {"global_batch": 32}, "step_times_s": [t / 1000 for t in steps_ms],
           "step_time_s": sorted(steps_ms)[len(steps_ms) // 2] / 1000, "measured_steps": len(steps_ms),
           "memory": {"peak_device": 12 * 2**30, "peak_allocated": 12 * 2**30, "peak_reserved": 12 * 2**30,
                      "outside_pytorch": 0},
           "device": {"type": "cuda", "name": "made here", "capacity_bytes": 141 * 2**30},
           "timing": {"startup_s": 0.5, "steps_s": sum(steps_ms) / 1000}, "torch_version": "made here"}
    return TrialOutcome(status=Status.OK, reason="made here", reports={0: rep}, returncode=0, wall_s=2.0, trial_dir="")


def _close_pair_study(tmp_path: Path) -> Any:
    """Trial 1 is truly 100 ms but measured 104 ms once; trial 2 is truly 103 ms, measured 101 ms once."""
    specs = [Spec(status="ok", micro=[8], acc=4, dtype="fp32", peaks_gib=[11.0], step_ms=300.0),
             Spec(status="ok", micro=[16], acc=2, peaks_gib=[12.0], step_ms=104.0),
             Spec(status="ok", micro=[32], acc=1, peaks_gib=[13.0], step_ms=101.0)]
    return build_study(tmp_path / "p.db", world_size=1, name="pair", specs=specs)


def test_interleaved_runs_pick_the_truly_faster_of_two_close_configurations(tmp_path: Path) -> None:
    study = _close_pair_study(tmp_path)
    assert best_trial(study).number == 2  # one measurement each: the truly slower one leads
    leaders, why = close_leaders(leader_candidates(study))
    assert [t.number for t in leaders] == [2, 1], why
    # each run drifts as a whole (the first runs mislead as the single measurements did), steps spread within
    drift = {1: iter([3.0, -1.0, 0.5]), 2: iter([-2.0, 1.0, 0.5])}
    truth = {1: 100.0, 2: 103.0}
    launched: list[int] = []

    def launch(trial: Any) -> TrialOutcome:
        launched.append(trial.number)
        centre = truth[trial.number] + next(drift[trial.number])
        return _outcome([centre - 1.0, centre, centre + 1.0, centre - 0.5, centre + 0.5, centre])

    first = {n: truth[n] + d for n, d in ((1, 3.0), (2, -2.0))}
    assert first[2] < first[1]  # a single run in the same worker state would also have picked trial 2
    plan = plan_leaders(leaders, run_s=lambda t: 10.0, time_left_s=None, why=why)
    record = remeasure_leaders(plan, launch=launch, objective=study.user_attrs[StudyAttr.OBJECTIVE],
                               reference_s=study.user_attrs.get(StudyAttr.REFERENCE))
    assert launched == [2, 1, 2, 1, 2, 1]  # interleaved
    assert record["order"] == [1, 2]
    one, two = record["trials"]["1"], record["trials"]["2"]
    assert one["step_time_ms"] == pytest.approx(100.5) and two["step_time_ms"] == pytest.approx(103.25)
    assert (one["runs"], one["steps"]) == (3, 18)
    assert one["value"] < two["value"]
    study.set_user_attr(StudyAttr.LEADERS, record)
    assert best_trial(study).number == 1  # every reader of "best" now ranks by the pooled figure
    assert leaders_line(record, was=2).endswith("trial 1 is now the best (was trial 2).")


def test_a_leader_whose_run_fails_ranks_behind_the_others(tmp_path: Path) -> None:
    study = _close_pair_study(tmp_path)
    leaders, why = close_leaders(leader_candidates(study))

    def launch(trial: Any) -> TrialOutcome:
        if trial.number == 2:
            return TrialOutcome(status=Status.OOM, reason="rank 0 ran out of memory", reports={}, returncode=1,
                                wall_s=1.0, trial_dir="")
        return _outcome([104.0] * 6)

    record = remeasure_leaders(plan_leaders(leaders, run_s=lambda t: 1.0, time_left_s=None, why=why), launch=launch,
                               objective=study.user_attrs[StudyAttr.OBJECTIVE], reference_s=None)
    assert record["order"] == [1, 2] and "oom" in record["trials"]["2"]["failed"]
    study.set_user_attr(StudyAttr.LEADERS, record)
    assert best_trial(study).number == 1


def test_the_saved_figure_says_its_spread_and_old_records_still_load(tmp_path: Path) -> None:
    entry = {"step_time_ms": 159.0, "q1_ms": 152.0, "q3_ms": 166.0, "steps": 24, "runs": 3}
    assert spread_text(entry) == "159.0 ms (IQR 152.0-166.0 ms over 24 steps, 3 runs)"
    assert spread_text({"step_time_ms": 100.0, "iqr_pct": 4.0, "steps": 5, "runs": 1}) == \
        "100.0 ms (IQR 4.0 % of it over 5 steps, 1 run)"
    study = _close_pair_study(tmp_path)
    study.set_user_attr(StudyAttr.LEADERS, {"order": [2, 1], "runs": 3, "trials": {
        "2": {**entry, "value": 0.1}, "1": {**entry, "step_time_ms": 170.0, "value": 0.2}}})
    trial = study.trials[2]
    assert saved_spread(study, trial)["source"].startswith("leaders re-measured")
    figures = figures_of_trial(study, trial)
    assert figures["step_time_spread"]["q1_ms"] == 152.0
    saved = SavedConfig(study_name="pair", trial_number=2, config=BalanceConfig.from_dict(trial.user_attrs["config"]),
                        figures=figures, fingerprint=_fingerprint(),
                        created_at=_now())
    again = SavedConfig.from_dict(saved.to_dict())
    assert again.figures["step_time_spread"] == figures["step_time_spread"]
    assert ("step time", "159.0 ms (IQR 152.0-166.0 ms over 24 steps, 3 runs)") in saved_figure_rows(
        again.figures, world_size=1)
    old = {k: v for k, v in saved.to_dict().items()}
    old["figures"] = {k: v for k, v in old["figures"].items() if k != "step_time_spread"}
    loaded = SavedConfig.from_dict(old)  # a record saved before the spread was kept
    assert ("step time", f"{loaded.figures['step_time_ms']:.1f} ms") in saved_figure_rows(loaded.figures, world_size=1)


def _fingerprint() -> Any:
    from autobalance.store import HardwareFingerprint

    return HardwareFingerprint(device_names=[], ms_per_sample=[], device_type="cuda", device_name="synthetic GPU",
                               capacity_bytes=[141 * 2**30], cap_bytes=[16 * 2**30], world_size=1, nnodes=1)


def _now() -> Any:
    from datetime import UTC, datetime

    return datetime.now(UTC)


def test_the_loop_skips_the_leaders_with_its_reason_when_time_is_short_and_runs_them_when_not(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    import autobalance.tuner._loop as loop_module
    from autobalance.tuner._loop import TrialLoop
    from autobalance.tuner.search import TimeBudget

    study = _close_pair_study(tmp_path)
    now = 1000.0
    monkeypatch.setattr(loop_module, "time", SimpleNamespace(monotonic=lambda: now))
    budget = TimeBudget(budget_s=300.0, started=now - 295.0)  # 5 s left
    notes: list[str] = []
    launched: list[int] = []

    def launch(study: Any, *, number: int, config: Any, again: bool) -> TrialOutcome:
        assert again
        launched.append(number)
        return _outcome([100.0 if number == 1 else 103.0] * 6)

    launcher = SimpleNamespace(stop=threading.Event(), launch=launch)
    loop = TrialLoop(settings=SimpleNamespace(verify=True, nnodes=1, device="cuda", remeasure="auto"),  # type: ignore[arg-type]
                     storage=None, launcher=launcher, recorder=None,  # type: ignore[arg-type]
                     reporter=SimpleNamespace(note=notes.append), advisor=None, budget=budget)  # type: ignore[arg-type]
    loop.remeasure_leaders(study)
    assert launched == [] and StudyAttr.LEADERS not in study.user_attrs
    assert len(notes) == 1 and notes[0].startswith("Leaders not re-measured: within the measured noise of the best "
                                                   "(trial 2, 101.0 ms): trial 1 104.0 ms (+3.0 %"), notes
    assert "does not hold 1 more run(s) of the first two" in notes[0]
    budget.started = now  # the whole budget left: the most runs, interleaved, and the pooled figure decides
    notes.clear()
    loop.remeasure_leaders(study)
    assert launched == [2, 1] * LEADER_RUNS[0], notes
    assert "Trials 2, 1 run 3 more time(s) each" in notes[0] and "trial 1 is now the best (was trial 2)" in notes[1]
    assert best_trial(study).number == 1
