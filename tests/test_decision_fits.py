"""Each model is fitted at most once per decision (``search.Decision``): counted in one replayed
study (``benchmarks/replay_search.py``: a real ``Tuner`` answered from the recorded H200 grids, on a
simulated clock). A decision runs from the loop's stop check to its trial's launch (or its settling
without a launch): the verification forecast the stop rule reads, the policy's phases, the veto and
the budget check of the configuration asked. Before ``Decision`` one 11-trial study fitted the
step-time models up to five times per decision and the compiled memory model up to five."""

from __future__ import annotations

import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import optuna
import pytest

from autobalance.tuner._loop import TrialLoop
from autobalance.tuner._recording import Recorder
from autobalance.tuner.search._compiled_model import CompiledMemoryModel
from autobalance.tuner.search._memory_model import MemoryModel
from autobalance.tuner.search._timing import CompiledTimeModel, StepTimeModel

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import replay_search  # noqa: E402  (benchmarks/ is not a package)

MODELS = {"step time": StepTimeModel, "compiled step time": CompiledTimeModel, "memory": MemoryModel,
          "compiled memory": CompiledMemoryModel}


def test_each_model_is_fitted_at_most_once_per_decision(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import autobalance.report as report

    monkeypatch.setattr(report, "upload_trial_chart", lambda *a, **k: None)
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    state = {"deciding": False, "decision": 0}
    fits: dict[int, Counter[str]] = defaultdict(Counter)

    for name, cls in MODELS.items():
        def counted(owner: type, *args: Any, _fit: Any = cls.fit.__func__, _name: str = name, **kwargs: Any) -> Any:
            if state["deciding"]:
                fits[state["decision"]][_name] += 1
            return _fit(owner, *args, **kwargs)
        monkeypatch.setattr(cls, "fit", classmethod(counted))

    more_trials = TrialLoop.more_trials

    def deciding(self: TrialLoop, study: optuna.Study) -> bool:
        state["decision"] += 1
        state["deciding"] = True
        more = more_trials(self, study)
        state["deciding"] = more  # the study's end (summary, hold-out errors) is no decision
        return more

    monkeypatch.setattr(TrialLoop, "more_trials", deciding)
    for method in ("figures", "reuse", "predicted", "not_started"):  # the decision ends: launched or settled
        def ended(self: Recorder, *args: Any, _method: Any = getattr(Recorder, method), **kwargs: Any) -> Any:
            state["deciding"] = False
            return _method(self, *args, **kwargs)
        monkeypatch.setattr(Recorder, method, ended)

    row = replay_search.replay(replay_search.GridMachine("outside"), seed=19, budget="5m", root=str(tmp_path))

    assert row["trials"] >= 8 and any(p not in ("sampler", "probe") for p in row["phases"]), row
    assert len(fits) >= row["trials"] - 2  # the counter saw the decisions
    assert sum(c["compiled memory"] for c in fits.values()) >= 3  # and the compiled phases' fits
    twice = {d: {m: n for m, n in c.items() if n > 1} for d, c in fits.items() if any(n > 1 for n in c.values())}
    assert twice == {}, f"models fitted more than once in a decision: {twice}"


def test_a_decision_is_kept_until_a_trial_finishes(tmp_path: Path) -> None:
    """The loop keeps one decision (its fits) while no trial finished - a trial asked and running
    changes nothing the models read - and takes a new one once a trial is told."""
    import threading
    import types

    from autobalance.tuner import TuneSettings
    from autobalance.tuner.search import TimeBudget

    (tmp_path / "train.py").write_text("")
    settings = TuneSettings(script=str(tmp_path / "train.py"), device="cpu")
    loop = TrialLoop(settings=settings, storage=None, launcher=types.SimpleNamespace(stop=threading.Event()),  # type: ignore[arg-type]
                     recorder=None, reporter=None, advisor=None, budget=TimeBudget(budget_s=None, started=0.0))  # type: ignore[arg-type]
    study = optuna.create_study()
    study.tell(study.ask(), 1.0)
    first = loop.decision(study)
    assert first.step_time is first.step_time  # fitted once, kept
    running = study.ask()
    assert loop.decision(study) is first and first.current(study)
    study.tell(running, 2.0)
    second = loop.decision(study)
    assert second is not first and len(second.trials) == 2 and not first.current(study)
