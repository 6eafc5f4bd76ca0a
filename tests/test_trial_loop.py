"""The trial loop's seams (issue 32): the :class:`TrialLoop` owns the loop's state and the
re-measure decision is a step of ``one_trial``; a trial's figures are built in recording only (once
per outcome); a script that cannot run warm makes the launcher cold, not the shared settings."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import optuna
import pytest

from autobalance.launcher import TrialOutcome
from autobalance.protocol import Status, StudyAttr, TrialAttr
from autobalance.tuner import Tuner, TuneSettings
from autobalance.tuner._launching import TrialLauncher
from tests.test_first_trials import baseline
from tests.tune_helpers import GPT


def _outcome(cfg: Any, times: list[float]) -> TrialOutcome:
    rep = {"status": "ok", "rank": 0, "config": cfg.to_dict(), "defaults": baseline().to_dict(),
           "model": {"num_blocks": 16}, "device": {"type": "cpu", "name": "simulated", "capacity_bytes": 64 * 2**30},
           "memory": {"peak_device": 2**30, "peak_allocated": 2**30, "peak_reserved": 2**30, "outside_pytorch": 0},
           "timing": {"startup_s": 0.5, "steps_s": sum(times)}, "torch_version": "simulated",
           "step_times_s": times, "step_time_s": sorted(times)[len(times) // 2], "measured_steps": len(times)}
    return TrialOutcome(status=Status.OK, reason="simulated", reports={0: rep}, returncode=0, wall_s=1.0, trial_dir="")


class Launcher(TrialLauncher):
    """Every first run of a trial spreads its steps (re-measured with ``--remeasure on``)."""

    runs: ClassVar[list[tuple[int, bool]]] = []

    def launch(self, study: optuna.Study, *, number: int, config: Any, trial: Any = None,
               again: bool = False) -> TrialOutcome:
        self.runs.append((number, again))
        self.trials_run += 1
        times = [0.1, 0.1, 0.1, 0.1] if again or config is None else [0.1, 0.2, 0.1, 0.2]
        return _outcome(config or baseline(), times)


def test_one_trial_remeasures_and_records_figures_built_in_recording(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch):
    import autobalance.tuner._launching as launching
    import autobalance.tuner._recording as recording

    built: list[int] = []
    real = recording.figures_from_outcome

    def counted(outcome: TrialOutcome, **kw: Any) -> Any:
        built.append(id(outcome))
        return real(outcome, **kw)

    monkeypatch.setattr(recording, "figures_from_outcome", counted)
    assert not hasattr(launching, "figures_from_outcome")  # the launcher builds no figures
    settings = TuneSettings(script=GPT, device="cpu", trials=3, nproc_per_node=1, remeasure="on", measure_s=0,
                            prune_factor=0, seed=0, storage=f"sqlite:///{tmp_path}/l.db", runs_dir=str(tmp_path / "runs"))
    tuner = Tuner(settings=settings)
    tuner.launcher = Launcher(settings=settings, storage=tuner.storage, reporter=tuner.reporter)
    Launcher.runs = []
    tuner.run()
    study = optuna.load_study(study_name=settings.study_name, storage=settings.storage)
    remeasured = [t for t in study.trials if t.user_attrs.get("remeasured")]
    launched = [n for n, again in Launcher.runs if not again]
    leaders = study.user_attrs.get(StudyAttr.LEADERS) or {}  # the leaders' runs come last, after the loop
    in_loop = Launcher.runs[:len(Launcher.runs) - int(leaders.get("runs") or 0) * len(leaders.get("order") or [])]
    assert remeasured and {t.number for t in remeasured} == {n for n, again in in_loop if again}
    for t in remeasured:
        assert t.user_attrs[TrialAttr.STEP_TIME_MS] == pytest.approx(100.0)  # the merged outcome's figures
    # once per outcome: the baseline, each trial's first run, each re-measured trial's merged outcome
    assert len(built) == len(launched) + len(remeasured)


def test_a_script_that_cannot_run_warm_makes_the_launcher_cold_not_the_settings(tmp_path: Path,
                                                                                monkeypatch: pytest.MonkeyPatch):
    import autobalance.tuner._launching as launching

    monkeypatch.setattr(launching, "cold_reason", lambda script: "it cannot run warm")
    settings = TuneSettings(script=GPT, device="cpu", storage=f"sqlite:///{tmp_path}/c.db",
                            runs_dir=str(tmp_path / "runs"))
    launcher = TrialLauncher(settings=settings, storage=optuna.storages.RDBStorage(settings.storage),
                             reporter=type("R", (), {"note": staticmethod(lambda text: None)})())
    assert launcher._pool(None) is None  # type: ignore[arg-type]
    assert launcher.cold and launcher.cold_note and not settings.cold
