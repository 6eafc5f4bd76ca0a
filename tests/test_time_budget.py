"""`--time-budget`: parsing, where a trial's and a run's time went, the budget stopping the trial
loop, and one short CPU study that the budget ends early."""

from __future__ import annotations

import datetime
import re
from pathlib import Path

import optuna
import pytest

from autobalance import UsageError
from autobalance.launcher import TrialOutcome
from autobalance.protocol import Status, StudyAttr, TrialAttr
from autobalance.tuner import TuneSettings, load_toml
from autobalance.tuner._reporter import time_left_text
from autobalance.tuner._settings import parse_duration
from autobalance.tuner._time_spent import describe_budget, time_lines, time_spent, trial_time_split
from tests.tune_helpers import GPT, cli, load, tune_args


@pytest.mark.parametrize(("text", "seconds"), [
    ("90s", 90.0), ("10m", 600.0), ("1.5h", 5400.0), ("45", 45.0), (" 2 min ", 120.0), ("0.5s", 0.5), (30, 30.0),
    (12.5, 12.5), ("10M", 600.0), (".5h", 1800.0),
])
def test_durations_in_seconds_minutes_hours_or_plain_seconds(text, seconds):
    assert parse_duration("--time-budget", text) == seconds


@pytest.mark.parametrize("text", [None, "off", "none", "OFF"])
def test_no_budget(text):
    assert parse_duration("--time-budget", text) is None


@pytest.mark.parametrize("text", ["10x", "m", "", "-5m", "0", "0s", "1h30m", "ten minutes", True, float("inf"), [3]])
def test_a_bad_duration_is_one_line_that_names_the_flag_and_the_fix(text):
    with pytest.raises(UsageError) as info:
        TuneSettings(script=GPT, time_budget=text)
    message = str(info.value)
    assert message.startswith(f"--time-budget={text!r} is not a positive duration") and "\n" not in message
    assert "10m" in message and "1.5h" in message


def test_the_budget_comes_from_flags_or_the_study_file(tmp_path: Path):
    assert TuneSettings(script=GPT).time_budget is None  # default: no limit
    assert TuneSettings(script=GPT, time_budget="10m").time_budget_s == 600.0
    toml = tmp_path / "s.toml"
    toml.write_text(f'[tune]\nscript = "{GPT}"\ntime-budget = "5m"\n')
    assert TuneSettings.merge(flags={}, toml_path=str(toml)).time_budget_s == 300.0
    assert TuneSettings.merge(flags={"time_budget": "off"}, toml_path=str(toml)).time_budget is None
    toml.write_text(f'[tune]\nscript = "{GPT}"\ntime_budget = 90\n')
    assert TuneSettings.merge(flags={}, toml_path=str(toml)).time_budget_s == 90.0
    toml.write_text(f'[tune]\nscript = "{GPT}"\ntime_budget = true\n')
    with pytest.raises(UsageError, match="time_budget = True, which is not a number of seconds"):
        load_toml(str(toml))


def test_the_flag_reaches_the_settings_and_a_bad_value_exits_2(tmp_path: Path):
    proc = cli(["tune", GPT, "--device", "cpu", "--time-budget", "soon", "--storage", f"sqlite:///{tmp_path}/x.db"],
               cwd=tmp_path, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "autobalance: error: --time-budget='soon' is not a positive duration" in proc.stderr
    assert not (tmp_path / "x.db").exists()


def test_budget_words():
    assert [describe_budget(s) for s in (90, 600, 5400, 45.5, 3600)] == ["90s", "10m", "1.5h", "45.5s", "1h"]
    assert time_left_text(754.2) == "12:34 left"
    assert time_left_text(3723) == "1:02:03 left"
    assert time_left_text(0) == "budget spent, finishing"


def _report(*, written: float, wall: float, startup: float | None, compile_s: float | None, steps: float | None):
    at = datetime.datetime.fromtimestamp(written, datetime.UTC).isoformat()
    return {"status": "error", "written_at": at, "timing": {"wall_s": wall, "startup_s": startup, "compile_s": compile_s, "steps_s": steps}}


def test_a_trials_time_split_runs_from_launch_to_first_step_then_compile_steps_and_the_rest():
    t0 = 1_000_000.0
    # launched at t0; rank plans began at t0+3 / t0+4, their first steps at t0+5 / t0+6 (the slower
    # rank gates the first collective step), 4 s compiling, 2 s of steps, reports at t0+12.5
    reports = {0: _report(written=t0 + 12.5, wall=9.5, startup=2.0, compile_s=4.0, steps=2.0),
               1: _report(written=t0 + 12.5, wall=8.5, startup=2.0, compile_s=3.5, steps=1.8)}
    outcome = TrialOutcome(status=Status.OK, reason="", reports=reports, wall_s=13.0, started_at=t0)
    split = trial_time_split(outcome)
    assert split == {"startup": 6.0, "compile": 4.0, "steps": 2.0, "remeasure": 0.0, "other": 1.0}
    assert sum(split.values()) == pytest.approx(outcome.wall_s)
    # measured twice: the second run is apart, the parts still sum to the wall time
    outcome.wall_s, outcome.remeasured = 20.0, {"reason": "r", "wall_s": 7.0}
    split = trial_time_split(outcome)
    assert split["remeasure"] == 7.0 and split["startup"] == 6.0 and sum(split.values()) == pytest.approx(20.0)
    # no rank reached a step (an OOM while building the model): all start-up
    failed = TrialOutcome(status=Status.OOM, reason="", wall_s=8.0, started_at=t0,
                          reports={0: _report(written=t0 + 7, wall=4.0, startup=None, compile_s=None, steps=None)})
    assert trial_time_split(failed) == {"startup": 8.0, "compile": 0.0, "steps": 0.0, "remeasure": 0.0, "other": 0.0}
    # a clock that disagrees (another host) never makes a part negative or the sum larger than the wall
    skewed = TrialOutcome(status=Status.OK, reason="", wall_s=5.0, started_at=t0 + 100,
                          reports={0: _report(written=t0, wall=3.0, startup=1.0, compile_s=None, steps=1.0)})
    split = trial_time_split(skewed)
    assert min(split.values()) >= 0 and sum(split.values()) == pytest.approx(5.0)


def _trial(number: int, split: dict[str, float] | None, **attrs) -> optuna.trial.FrozenTrial:
    user = dict(attrs)
    if split is not None:
        user[TrialAttr.TIME_SPLIT] = split
    trial = optuna.trial.create_trial(value=1.0, user_attrs=user)
    trial.number = number
    return trial


def test_a_runs_time_sums_its_own_launched_trials_and_says_where_it_went():
    split = {"startup": 2.0, "compile": 10.0, "steps": 3.0, "remeasure": 0.0, "other": 0.5}
    trials = [_trial(0, split), _trial(1, split), _trial(2, split, **{TrialAttr.REUSED_FROM: 1}), _trial(3, None)]
    total = time_spent(trials, {1, 2, 3})  # trial 0 ran in an earlier run; 2 reused 1's result
    assert total == {"compile": 10.0, "startup": 2.0, "steps": 3.0, "remeasure": 0.0, "handover": 0.5}
    record = {**total, "wall": 40.0, "verify": 5.0, "verified": True, "slots": 1, "budget_s": 30.0,
              "stopped_by_budget": True, "trials": 4, "of": 50}
    lines = time_lines(record)
    assert lines[0].startswith("Time: 40.0 s in all: compiling 10.0 s (25%), start-up (launch to first step) 2.0 s (5%), "
                               "steps 3.0 s (8%), verification 5.0 s (12%), other 20.0 s (50%")
    assert lines[1].startswith("Stopped by the time budget (30s) after 4 of 50 trials")
    assert "verification ran after the budget (5.0 s)" in lines[1]
    record.update(verified=False, verify=0.0)
    assert "nothing was verified" in time_lines(record)[1]
    record.update(stopped_by_budget=False, trials=50)
    assert time_lines(record)[1] == "Time budget 30s: not reached (50 of 50 trials ran within it)."
    record.update(slots=2, budget_s=None)
    (line,) = time_lines(record)
    assert "2 trials at a time; summed over the slots: compiling 10.0 s" in line and "other" not in line


def test_no_trial_is_asked_once_the_budget_is_spent(tmp_path: Path):
    from autobalance.tuner import Tuner

    notes: list[str] = []

    class Notes:
        def note(self, text: str) -> None:
            notes.append(text)

    settings = TuneSettings(script=GPT, device="cpu", trials=5, time_budget="1h",
                            storage=f"sqlite:///{tmp_path}/b.db", runs_dir=str(tmp_path / "runs"))
    tuner = Tuner(settings=settings, reporter=Notes())
    study = optuna.create_study(study_name=settings.study_name, storage=tuner.storage)
    loop = tuner.trial_loop()
    try:
        assert loop.more_trials(study) and not tuner.budget.stopped  # an hour left
        tuner.budget.started -= 3600  # the hour is over
        assert not loop.more_trials(study) and not loop.more_trials(study)
        assert tuner.budget.stopped
        assert notes == ["Time budget (1h) spent after 0 of 5 trials: no new trial starts; running ones finish, "
                         "then the best is verified and saved."]
    finally:
        tuner.close()


@pytest.mark.slow
def test_a_tiny_budget_stops_the_study_early_and_still_verifies_and_saves(tmp_path: Path):
    """The baseline alone outlasts a 1 s budget: no trial starts after it, the best is still verified
    and saved (or the summary says why not), and the summary says where the time went."""
    db = tmp_path / "t.db"
    proc = cli(tune_args(GPT, db, "--memory-cap-gib", "0.5", "--time-budget", "1s", trials=50), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    study = load(db)
    assert 1 <= len(study.trials) < 50
    assert "time budget 1s" in proc.stderr and "Time budget (1s) spent after" in proc.stderr
    # the time left when a trial starts (a loaded machine may have spent the second already)
    assert re.search(r"trial 0 baseline \(the script's own configuration\) \.\.\.  \((0:0\d left|budget spent, "
                     r"finishing)\)", proc.stderr), proc.stderr[-2000:]
    out = " ".join(proc.stdout.split())
    assert "Time: " in out and "compiling " in out and "start-up (launch to first step) " in out and "steps " in out
    assert f"Stopped by the time budget (1s) after {len(study.trials)} of 50 trials" in out
    spent = study.user_attrs[StudyAttr.TIME_SPENT]
    assert spent["stopped_by_budget"] is True and spent["budget_s"] == 1.0 and spent["of"] == 50
    if "Saved trial" in out:
        assert spent["verified"] is True and "verification ran after the budget" in out
    else:
        assert "No feasible configuration yet" in out or "nothing was verified" in out
    base = study.trials[0]
    split = base.user_attrs[TrialAttr.TIME_SPLIT]
    assert split["startup"] > 0 and split["steps"] > 0
    assert sum(split.values()) == pytest.approx(base.user_attrs[TrialAttr.WALL_S], abs=0.01)
    assert spent["startup"] >= split["startup"] - 1e-6 and spent["steps"] >= split["steps"] - 1e-6


# ------------------------------------------------------------------ the budget includes verification (issue 30)


def test_the_reserved_runs_are_the_ones_verification_launches():
    from autobalance import BalanceConfig
    from autobalance.tuner.search._timing import verification_runs

    own = BalanceConfig(micro_batches=[8], accumulation=4, global_batch=32, dtype="fp32", checkpoint=[[]])
    assert verification_runs(own, own) == []  # the script's own configuration needs no proof
    tuned = BalanceConfig.any_split(rank_samples=[32], accumulation=6, dtype="bf16", checkpoint=[[0, 1]])
    runs = verification_runs(own, tuned)
    assert [name for name, _, _ in runs] == ["baseline", "floor", "tuned-fp32", "baseline-bf16", "tuned",
                                             "tuned-dropout", "tuned-dropout-no-recompute"]
    assert [cfg.dtype for _, cfg, _ in runs] == ["fp32", "fp32", "fp32", "bf16", "bf16", "bf16", "bf16"]
    assert [dropout for _, _, dropout in runs] == [False] * 5 + [True, True]
    assert runs[-1][1].checkpoint == [[]]
    plain = BalanceConfig(micro_batches=[16], accumulation=2, global_batch=32, dtype="fp32", checkpoint=[[]])
    assert [name for name, _, _ in verification_runs(own, plain)] == ["baseline", "floor", "tuned"]
    bf16_own = BalanceConfig(micro_batches=[8], accumulation=4, global_batch=32, dtype="bf16", checkpoint=[[]])
    compiled = BalanceConfig(micro_batches=[16], accumulation=2, global_batch=32, dtype="bf16", checkpoint=[[]],
                             compile="default", activation_budget=[1.0])
    runs = verification_runs(bf16_own, compiled)
    assert [name for name, _, _ in runs] == ["baseline", "baseline-fp32", "floor", "tuned-fp32", "tuned"]
    assert runs[3][1].compile == "off" and runs[4][1].compile == "default"  # part 1 runs a compiled bf16 one eager
    # a candidate whose fp32 arrangement is the script's own: its part-1 run is the baseline's, reused
    same_split = BalanceConfig(micro_batches=[8], accumulation=4, global_batch=32, dtype="bf16", checkpoint=[[]],
                               compile="default", activation_budget=[1.0])
    assert [name for name, _, _ in verification_runs(own, same_split)] == ["baseline", "floor", "baseline-bf16", "tuned"]
    # ... and with a bf16 script, its baseline-fp32 run
    assert [name for name, _, _ in verification_runs(bf16_own, same_split)] == ["baseline", "baseline-fp32", "floor",
                                                                                "tuned"]


def test_the_verification_forecast_comes_from_the_studys_own_trials():
    from autobalance import BalanceConfig
    from autobalance.tuner.search._timing import (
        FIRST_STEP_FACTOR,
        forecast_verification,
        next_trial_s,
    )

    def ran(number: int, cfg: BalanceConfig, ms: float, split: dict[str, float], **attrs) -> optuna.trial.FrozenTrial:
        t = _trial(number, split, status="ok", config=cfg.to_dict(), step_time_ms=ms, **attrs)
        return t

    own = BalanceConfig(micro_batches=[8], accumulation=4, global_batch=32, dtype="fp32", checkpoint=[[]])
    eager = BalanceConfig(micro_batches=[16], accumulation=2, global_batch=32, dtype="bf16", checkpoint=[[]])
    comp = BalanceConfig(micro_batches=[16], accumulation=2, global_batch=32, dtype="bf16", checkpoint=[[]],
                         compile="default", activation_budget=[0.5])
    split = {"startup": 1.0, "compile": 0.0, "steps": 2.0, "remeasure": 0.0, "other": 0.5}
    trials = [ran(0, own, 1300.0, {**split, "startup": 12.0}, baseline=True), ran(1, eager, 150.0, split),
              ran(2, comp, 120.0, {**split, "startup": 3.0, "compile": 40.0}, compile_s=40.0,
                  compile_cache={"fx_graph_misses": 2})]
    # start-up and hand-over per run: the mean of the trials after the baseline (its pool start is paid once)
    per_run = ((1.0 + 0.5) + (3.0 + 0.5)) / 2
    got = forecast_verification(trials, baseline=own, best=trials[1], num_layers=16, device="cuda")
    assert got.runs == ["baseline", "floor", "tuned-fp32", "baseline-bf16", "tuned"]
    assert got.trial == 1 and got.seconds > 5 * per_run + FIRST_STEP_FACTOR * (1.3 + 1.3 + 0.15)
    # a compiled candidate: its bf16 run at the measured budget comes from the cache, its fp32 one compiles anew
    compiled = forecast_verification(trials, baseline=own, best=trials[2], num_layers=16, device="cuda")
    assert compiled.runs[-2:] == ["tuned-dropout", "tuned-dropout-no-recompute"]
    # tuned-fp32 runs eager; the budget-1.0 run without recomputation misses the cache (40 s); tuned and
    # tuned-dropout (bf16, budget 0.5, compiled by trial 2) hit it (no hit measured yet: FROM_CACHE_SHARE of
    # trial 2's 40 s cold compile, was 10 % before issue 41: a from-cache compile on the H200 took 40 %)
    from autobalance.tuner.search._timing import FROM_CACHE_SHARE

    assert FROM_CACHE_SHARE == 0.4
    assert 40.0 + 2 * 16.0 < compiled.seconds - got.seconds < 2 * 40.0 + 2 * 16.0
    assert forecast_verification(trials, baseline=own, best=trials[0], num_layers=16, device="cuda").seconds == 0.0
    assert forecast_verification(trials, baseline=own, best=None, num_layers=16, device="cuda").seconds == 0.0
    assert next_trial_s(trials) == pytest.approx((3.5 + 5.5) / 2)  # the baseline apart, compiling apart
    # the runs' tensor input and output: IO_S_PER_GB per GB of the model's parameters, in every run, and
    # the four comparisons (floor, equivalence, noise, dtype): COMPARE_S_PER_GB each (issue 41)
    from autobalance.tuner.search._timing import COMPARE_S_PER_GB, IO_S_PER_GB

    big = [ran(0, own, 1300.0, {**split, "startup": 12.0}, baseline=True, parameter_bytes=2_000_000_000),
           *trials[1:]]
    heavier = forecast_verification(big, baseline=own, best=big[1], num_layers=16, device="cuda")
    assert heavier.seconds - got.seconds == pytest.approx(5 * IO_S_PER_GB * 2.0 + 4 * COMPARE_S_PER_GB * 2.0)
    # fresh workers: trial 2 (compiled, the latest) started a pool (18 s of its 21 s start-up) and its
    # worker was recycled after it, so the first run starts one; a compiled candidate's compiled runs
    # but the last each make the next run start one too, in the share of compiled trials that recycled
    # (here all); the per-run start-up leaves the pool start out. A fresh worker costs the whole
    # start-up of a trial that started one (21 s: was the pool's 18 s alone, with the script's set-up
    # in the new worker averaged into every run's start-up instead: issue 41)
    from autobalance.tuner.search._timing import run_prices, worker_start_s

    recycled = {TrialAttr.WARM_RECYCLED: "a compiled trial left 468 MiB outside PyTorch"}
    pooled = [*trials[:2], ran(2, comp, 120.0, {**split, "startup": 21.0, "compile": 40.0}, compile_s=40.0,
                               compile_cache={"fx_graph_misses": 2}, pool_start_s=18.0, **recycled)]
    assert worker_start_s(pooled) == 21.0 and worker_start_s(trials) == 0.0
    assert run_prices(pooled).first_fresh and run_prices(pooled).recycle_share == 1.0
    assert run_prices(pooled[:2]).fresh_s == 0.0 and not run_prices(pooled[:2]).first_fresh  # the latest ran eager
    again = forecast_verification(pooled, baseline=own, best=pooled[1], num_layers=16, device="cuda")
    assert again.seconds - got.seconds == pytest.approx(21.0)  # 21.5 - 18 = 3.5: the per-run start-up as before
    # a compiled trial whose worker went on (h200c's trials 4 and 10): no fresh worker (was 1 + 2: issue 41)
    kept = [*trials[:2], ran(2, comp, 120.0, {**split, "startup": 21.0, "compile": 40.0}, compile_s=40.0,
                             compile_cache={"fx_graph_misses": 2}, pool_start_s=18.0)]
    assert not run_prices(kept).first_fresh and run_prices(kept).recycle_share == 0.0
    # the dropout runs: not launched for a model the trials reported without dropout
    none = [ran(t.number, BalanceConfig.from_dict(t.user_attrs["config"]), t.user_attrs["step_time_ms"],
                t.user_attrs[TrialAttr.TIME_SPLIT], **{TrialAttr.DROPOUT_MODULES: 0}) for t in trials]
    assert forecast_verification(none, baseline=own, best=none[2], num_layers=16, device="cuda").runs[-1] == "tuned"


@pytest.mark.parametrize("graphs", [None, "pay", "no-gain"])
def test_a_five_minute_budget_ends_within_it_verification_included(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   graphs: str | None):
    """A real Tuner on a simulated GPU and a simulated clock (no torchrun): the trial loop stops so
    that the loop plus the best trial's verification end within the budget, and the summary says
    what was reserved. ``graphs``: ``--compile-mode auto`` (CUDA graphs probed) on a machine where
    they cut a compiled micro-step's fixed cost to 0.18 (``pay``, the H200's 5.8 / 33 ms; on this
    additive machine that gains far more than the H200's 5 % at 8 x 4: the mechanism is what is
    tested) or not at all (``no-gain``); None: the default mode only."""
    import statistics
    import types

    from autobalance import BalanceConfig
    from autobalance.tuner import Tuner
    from autobalance.tuner._launching import TrialLauncher
    from autobalance.tuner.search._timing import verification_runs
    from tests.test_first_trials import ACT, FIXED, baseline, true_ms, true_peak

    clock = types.SimpleNamespace(now=1000.0)
    clock.monotonic = lambda: clock.now
    clock.sleep = lambda s: setattr(clock, "now", clock.now + s)
    monkeypatch.setattr("autobalance.tuner._tuner.time", clock)
    monkeypatch.setattr("autobalance.tuner._loop.time", clock)
    # a compile from the cache: FROM_CACHE_SHARE of a cold one, as on the H200 (was 2.0 s, the FX graph
    # cache's own hit; the run around it traces and loads again: issue 41)
    # cold compiles per scope as on the H200: regional about a quarter of whole-model (issue 40: 0.22-0.30)
    startup, handover = 1.5, 0.5
    cold_s = {"whole": 45.0, "regional": 12.0}
    compiled_graphs: set[tuple] = set()
    usable = 16.0 * 0.95

    def step_ms(cfg: BalanceConfig) -> float:
        # compiled micro-steps of two sizes in a rank compile a dynamic batch dimension: 1.5x, as the H200
        # charged 5,5,5,5,4,4,4 (255-275 ms where 8 x 4 ran 159) and as benchmarks/replay_search.py charges
        dynamic = 1.5 if cfg.compile != "off" and len(set(cfg.micro_step_sizes(0))) > 1 else 1.0
        if cfg.compile == "reduce-overhead" and graphs == "pay":  # the micro-steps' fixed 30 ms at 0.18
            plain = BalanceConfig.from_dict({**cfg.to_dict(), "compile": "default"})
            return dynamic * (true_ms(plain) - 0.85 * cfg.accumulation * 30 * (1 - 0.18) * (
                1 + (1 - (cfg.activation_budget or [1.0])[0]) / 3))
        return dynamic * true_ms(cfg)

    def run_s(cfg: BalanceConfig, steps: float) -> tuple[float, float]:
        """(wall, compile) of a run of ``steps`` steps."""
        compile_s = 0.0
        if cfg.compile != "off":
            key = (cfg.dtype, cfg.compile, cfg.compile_scope, tuple(cfg.micro_batches), tuple(cfg.activation_budget or []))
            compile_s = cold_s[cfg.compile_scope] * (0.4 if key in compiled_graphs else 1.0)
            compiled_graphs.add(key)
        return startup + compile_s + steps * step_ms(cfg) / 1000 + handover, compile_s

    class Launcher(TrialLauncher):
        def launch(self, study, *, number, config, trial=None):
            cfg = config or baseline()
            wall, compile_s = run_s(cfg, 6)
            clock.now += wall
            peak = true_peak(cfg)
            ok = peak <= usable
            rep = {"status": "ok" if ok else "oom", "rank": 0, "config": cfg.to_dict(), "defaults": baseline().to_dict(),
                   "model": {"num_blocks": 16, "dropout_modules": 0}, "device": {"type": "cuda", "name": "simulated", "capacity_bytes": 141 * 2**30},
                   "memory": {"peak_device": peak * 2**30, "peak_allocated": peak * 2**30, "peak_reserved": peak * 2**30,
                              "outside_pytorch": 0},
                   "timing": {"startup_s": startup, "steps_s": 6 * step_ms(cfg) / 1000, "compile_s": compile_s or None},
                   "torch_version": "simulated"}
            if ok:
                rep.update(step_times_s=[step_ms(cfg) / 1000] * 5, step_time_s=step_ms(cfg) / 1000, measured_steps=5)
            if cfg.compile != "off":
                cold = compile_s == cold_s[cfg.compile_scope]
                rep["compile"] = {"mode": cfg.compile, "scope": cfg.compile_scope,
                                  "cache": {"fx_graph_hits": int(not cold), "fx_graph_misses": int(cold)}}
                rep["activation_budget"] = (cfg.activation_budget or [1.0])[0]
            self.trials_run += 1
            return TrialOutcome(status=Status.OK if ok else Status.OOM, reason="simulated", reports={0: rep},
                                returncode=0, wall_s=wall, trial_dir="", failing_rank=None if ok else 0)

    settings = TuneSettings(script=GPT, device="cuda", trials=200, nproc_per_node=1, memory_cap_gib=[16.0],
                            headroom=0.05, compile="search", time_budget="5m", seed=0, remeasure="off", measure_s=0,
                            prune_factor=0, storage=f"sqlite:///{tmp_path}/sim.db", study_name="sim",
                            runs_dir=str(tmp_path / "runs"), compile_mode="auto" if graphs else "default")
    tuner = Tuner(settings=settings)
    tuner.launcher = Launcher(settings=settings, storage=tuner.storage, reporter=tuner.reporter)
    started = clock.now
    result = tuner.run()
    loop_end = clock.now - started
    assert result.best is not None and tuner.budget.stopped
    best = BalanceConfig.from_dict(result.best.user_attrs["config"])
    runs = verification_runs(baseline(), best, dropout=False)  # the simulated model has no dropout
    verify = sum(run_s(cfg, 1.5)[0] for _, cfg, _ in runs)
    spent = result.time_spent
    assert spent["verify_reserved"] > 0 and spent["verify_reserved_runs"] == len(runs)
    assert loop_end + verify <= 330.0, (loop_end, verify, spent)  # 5 min 30 s at most, verification included
    walls = [sum(t.user_attrs["time_split_s"].values()) for t in optuna.load_study(
        study_name="sim", storage=settings.storage).trials if "time_split_s" in t.user_attrs]
    assert loop_end >= 300.0 - spent["verify_reserved"] - 2 * max(walls)  # and it did not stop needlessly early
    assert len(walls) >= 5 and statistics.median(walls) < 60
    assert FIXED > 0 and ACT  # the simulated machine is the one of tests/test_first_trials.py
    lines = " ".join(result.time_lines())
    assert "no longer held the next trial" in lines and "one-step runs" in lines
    # and the time went where the optimum is: the best found within 10 % of the simulated machine's best
    grid = [BalanceConfig.any_split(rank_samples=[32], accumulation=acc, dtype=dtype, checkpoint=[list(range(c))])
            for dtype in ("bf16", "fp16") for acc in range(1, 9) for c in range(17)]
    grid += [BalanceConfig.any_split(rank_samples=[32], accumulation=acc, dtype=dtype, checkpoint=[[]],
                                     compile="default", activation_budget=[b / 20])
             for dtype in ("bf16", "fp16") for acc in range(1, 9) for b in range(1, 21)]
    if graphs:
        grid += [BalanceConfig.from_dict({**c.to_dict(), "compile": "reduce-overhead"}) for c in grid
                 if c.compile == "default"]
    # the optimum the policy may reach: budgets below LOW_BUDGET only where a higher one was measured at that
    # micro-batch (memory is not monotone in low budgets on the H200: tuner/search/_policy.py), so not blind
    from autobalance.tuner.search._policy import LOW_BUDGET

    optimum = min(step_ms(cfg) for cfg in grid if true_peak(cfg) <= usable
                  and (cfg.compile == "off" or min(cfg.activation_budget or [1.0]) >= LOW_BUDGET))
    ran = [t.user_attrs["config"] for t in optuna.load_study(study_name="sim", storage=settings.storage).trials
           if t.user_attrs.get("status") == "ok" and t.user_attrs.get("config")]
    graph_trials = [c for c in ran if c["compile"] == "reduce-overhead"]
    best_cfg = result.best.user_attrs["config"]
    if graphs == "no-gain":  # the probe's price, paid once: one compile (here 45 s of the 300), never a second
        assert len(graph_trials) == 1, graph_trials
        return
    story = [(t.user_attrs.get("proposed_by"), t.user_attrs.get("status"), t.user_attrs.get("step_time_ms"),
              t.user_attrs.get("config")) for t in optuna.load_study(study_name="sim", storage=settings.storage).trials]
    assert result.best.user_attrs["step_time_ms"] <= 1.10 * optimum, "\n".join(map(str, [
        result.best.user_attrs["step_time_ms"], optimum, *story]))
    if graphs == "pay":
        assert best_cfg["compile"] == "reduce-overhead", best_cfg
    else:
        assert not graph_trials
