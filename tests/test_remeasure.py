"""Re-measuring a trial whose step times spread or that would become the best (pure, no torchrun)."""

from __future__ import annotations

import pytest

from autobalance.launcher import TrialOutcome
from autobalance.tuner._remeasure import (
    DISPERSION_LIMIT,
    dispersion,
    merge_outcomes,
    remeasure_reason,
)


def _outcome(times_by_rank, *, status="ok", peak=10.0, compile_peak=None):
    reports = {}
    for r, times in enumerate(times_by_rank):
        mem = {"peak_device": peak + r, "peak_reserved": peak - 1, "outside_pytorch": 1.0}
        if compile_peak is not None:
            mem["compile_step"] = {"peak_device": compile_peak}
        reports[r] = {"status": status, "step_times_s": list(times), "config": {"global_batch": 32},
                      "device": {"type": "cpu"},
                      "step_time_s": sorted(times)[len(times) // 2] if times else None, "memory": mem}
    return TrialOutcome(status=status, reason="x", reports=reports, wall_s=5.0)


def test_dispersion_is_the_worst_rank_iqr_over_median():
    steady = [0.100, 0.101, 0.099, 0.100, 0.100]
    noisy = [0.100, 0.140, 0.090, 0.120, 0.100]
    assert dispersion(_outcome([steady])) < 0.02
    assert dispersion(_outcome([steady, noisy])) > DISPERSION_LIMIT
    assert dispersion(_outcome([[0.1]])) is None


def test_reasons_high_spread_and_would_be_best_only_for_measured_trials():
    steady = _outcome([[0.100, 0.101, 0.099, 0.100]])
    noisy = _outcome([[0.100, 0.160, 0.090, 0.130]])
    assert "IQR" in remeasure_reason(noisy, step_time_s=0.1, would_be_best=False)
    assert remeasure_reason(steady, step_time_s=0.1, would_be_best=False) is None
    assert "would become the best" in remeasure_reason(steady, step_time_s=0.1, would_be_best=True, best_step_s=0.2)
    oom = _outcome([[0.1, 0.3]], status="oom")
    assert remeasure_reason(oom, step_time_s=None, would_be_best=True) is None


def test_merge_pools_steps_and_keeps_the_larger_memory():
    a = _outcome([[0.10, 0.20, 0.30]], peak=10.0, compile_peak=11.0)
    b = _outcome([[0.11, 0.12, 0.13]], peak=12.0, compile_peak=9.0)
    m = merge_outcomes(a, b, reason="r")
    rep = m.reports[0]
    assert rep.measured_steps == 6 and rep.step_times_s == [0.10, 0.20, 0.30, 0.11, 0.12, 0.13]
    assert abs(rep.step_time_s - 0.125) < 1e-12
    assert rep.memory.peak_device == 12.0 and rep.memory.compile_step["peak_device"] == 11.0
    assert m.remeasured == {"reason": "r", "step_time_s": [0.2, 0.12], "wall_s": b.wall_s}
    assert m.wall_s == 10.0 and abs(rep.samples_per_s - 32 / 0.125) < 1e-9
    assert a.reports[0].step_times_s == [0.10, 0.20, 0.30]  # the inputs are left alone


def test_a_second_run_that_fails_is_the_outcome():
    a = _outcome([[0.10, 0.11]])
    b = _outcome([[]], status="oom")
    b.reason = "rank 0 ran out of memory"
    m = merge_outcomes(a, b, reason="r")
    assert m.status == "oom" and "re-measured (r)" in m.reason and "ran out of memory" in m.reason


def test_measurement_attrs_and_summary_say_what_a_warm_trial_took_and_how_it_was_measured():
    from autobalance.tuner._summary import measurement_attrs, measurement_summary

    gib = 2**30
    a = _outcome([[0.10, 0.11, 0.12, 0.10], [0.10, 0.10, 0.10, 0.10]], peak=10 * gib, compile_peak=12 * gib)
    for r, rep in a.reports.items():
        rep.memory.steady = {"peak_device": 10 * gib + r}
        rep.step_time_iqr_s = 0.0125 if r == 0 else 0.0
        rep.warm = {"pool_trial": 2, "fresh_outside": 1.25 * gib, "inherited_outside": 32 * 2**20}
    a.recycled = "a compiled trial left 300 MiB outside PyTorch"
    attrs = measurement_attrs(a, world_size=2)
    assert attrs["compile_peak_gib"] == [12.0, 12.0] and attrs["steady_peak_gib"][0] == 10.0
    assert attrs["step_time_iqr_pct"] == round(100 * 0.0125 / 0.105, 2)
    assert attrs["warm_pool_trial"] == 2 and attrs["warm_fresh_outside_gib"] == [1.25, 1.25]
    assert attrs["warm_inherited_outside_gib"] == [0.0312, 0.0312] and "300 MiB" in attrs["warm_recycled"]
    cold = measurement_attrs(_outcome([[0.1, 0.1]]), world_size=1)
    assert "compile_peak_gib" not in cold and "warm_pool_trial" not in cold
    lines = measurement_summary([attrs, cold])
    assert any("nothing discounted" in line and "recycled after 1 trial" in line and "31.9 MiB" in line for line in lines)
    assert any("compiling step was the higher in 1" in line for line in lines)
    assert measurement_summary([]) == []


@pytest.mark.slow
def test_tune_remeasures_exactly_the_trials_the_rule_names(tmp_path):
    """A real CPU study: a trial measured twice has both runs' steps and says why; one measured once
    had a small spread and was not about to become the best; the summary reports the spread."""
    from autobalance.protocol import is_feasible
    from tests.tune_helpers import GPT, cli, load, tune_args

    db = tmp_path / "s.db"
    proc = cli(tune_args(GPT, db, "--steps", "4", "--warmup", "1", "--measure-s", "0", "--no-verify",
                         "--prune-factor", "0", "--remeasure", "on", trials=3), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Step times: spread (IQR)" in proc.stdout
    trials = sorted(load(db).get_trials(), key=lambda t: t.number)
    best_ms = None
    for t in trials:
        a = t.user_attrs
        if a.get("status") != "ok" or a.get("reused_from") is not None:
            continue
        if a.get("remeasured"):
            assert a["measured_steps"] == 8 and len(a["remeasured"]["step_time_ms"]) == 2
            assert "IQR" in a["remeasured"]["reason"] or "would become the best" in a["remeasured"]["reason"]
        else:
            assert a["measured_steps"] == 4
            if not a.get("baseline"):  # the baseline is measured once (it sets the reference)
                assert a["step_time_iqr_pct"] <= 100 * DISPERSION_LIMIT
                assert not (is_feasible(t) and best_ms is not None and a["step_time_ms"] < best_ms)
        if is_feasible(t):
            best_ms = a["step_time_ms"] if best_ms is None else min(best_ms, a["step_time_ms"])


def test_a_trial_over_the_spread_limit_is_not_remeasured_as_the_next_best(tmp_path):
    """"Would become the best" is what the recorder will tell: within memory and, with
    ``--max-spread-gib``, within the spread limit (the loop once judged memory only, and re-measured a
    trial that was then recorded infeasible)."""
    import threading
    import types

    import optuna

    from autobalance.protocol import CONSTRAINTS_KEY, Status, StudyAttr, TrialAttr
    from autobalance.tuner import TuneSettings
    from autobalance.tuner._loop import TrialLoop
    from autobalance.tuner._recording import constraints, feasible
    from autobalance.tuner.search import TrialFigures

    gib = 2.0**30
    figures = TrialFigures(status=Status.OK, peak_device=[4 * gib, 9 * gib], peak_allocated=[None, None],
                           peak_reserved=[None, None], outside_pytorch=[None, None], capacity=[16 * gib, 16 * gib],
                           step_time_s=0.1, samples_per_s=320.0, startup_s=1.0, measured_steps=4)
    study = optuna.create_study()
    study.set_user_attr(StudyAttr.REFERENCE, 0.2)  # the objective's time: step / 200 ms
    fast = study.ask()
    fast.set_user_attr(TrialAttr.STATUS, Status.OK)
    fast.set_user_attr(TrialAttr.STEP_TIME_MS, 200.0)
    study._storage.set_trial_system_attr(fast._trial_id, CONSTRAINTS_KEY, [-0.5])
    study.tell(fast, 1.0)
    outcome = _outcome([[0.100, 0.101, 0.099, 0.100], [0.100, 0.101, 0.099, 0.100]])
    reasons = {}
    (tmp_path / "train.py").write_text("")
    for limit in (None, 2.0):
        settings = TuneSettings(script=str(tmp_path / "train.py"), device="cuda", remeasure="on", max_spread_gib=limit)
        loop = TrialLoop(settings=settings, storage=None, launcher=types.SimpleNamespace(stop=threading.Event()),
                         recorder=None, reporter=None, advisor=None, budget=None)  # type: ignore[arg-type]
        assert feasible(figures, settings, Status.OK) == all(c <= 0 for c in constraints(figures, settings))
        reasons[limit] = loop.remeasure_reason(study, outcome, figures)
    assert reasons[None] is not None and "would become the best" in reasons[None]  # fits, faster than 200 ms
    assert reasons[2.0] is None  # 5 GiB of spread > 2 GiB: infeasible, never the best
