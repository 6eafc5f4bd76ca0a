"""Parallel tuners never launch one configuration twice (issue 41): a worker's proposal that another
worker's trial is running waits for that trial and reuses its result; a dead worker's running trial
(failed as stale) is taken over; a configuration another worker measured is reused. Deterministic:
the other worker is played by the test, between this worker's polls (its ``time.sleep``)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import optuna
import pytest
from optuna.trial import TrialState

from autobalance import BalanceConfig
from autobalance.protocol import Status, TrialAttr
from autobalance.store import open_storage, trial_id
from autobalance.tuner._loop import TrialLoop
from autobalance.tuner._study import RunningClaim

CONFIG = BalanceConfig(micro_batches=[4], accumulation=2, global_batch=8, dtype="fp32", checkpoint=[[]])


class _Launcher:
    def __init__(self) -> None:
        self.stop = threading.Event()
        self.beats = 0

    def beat_now(self, trial: Any) -> None:
        self.beats += 1


class _Reporter:
    def __init__(self) -> None:
        self.notes: list[str] = []

    def note(self, text: str) -> None:
        self.notes.append(text)


def _loop(storage: optuna.storages.RDBStorage) -> TrialLoop:
    return TrialLoop(settings=None, storage=storage, launcher=_Launcher(), recorder=None,  # type: ignore[arg-type]
                     reporter=_Reporter(), advisor=None, budget=None)  # type: ignore[arg-type]


@pytest.fixture
def study(tmp_path: Path) -> optuna.Study:
    return optuna.create_study(study_name="s", storage=open_storage(f"sqlite:///{tmp_path}/p.db"))


def _rdb(study: optuna.Study) -> optuna.storages.RDBStorage:
    """The study's RDB storage (what the tuner's loop holds), under Optuna's cache."""
    storage = study._storage
    return getattr(storage, "_backend", storage)


def _claim(study: optuna.Study, config: BalanceConfig, trial: optuna.Trial) -> RunningClaim:
    return RunningClaim(_rdb(study), study._study_id, config_json=config.to_json(), trial_id=trial_id(trial))


def _other_worker_runs(study: optuna.Study, config: BalanceConfig) -> tuple[optuna.Trial, RunningClaim]:
    """Another worker's trial, launched under its claim (what its loop does before launching)."""
    other = study.ask()
    claim = _claim(study, config, other)
    assert claim.try_acquire() is None
    return other, claim


def _polls(monkeypatch: pytest.MonkeyPatch, then: Any) -> list[float]:
    """Replace the loop's sleep: the first poll runs ``then`` (the other worker's next step)."""
    import autobalance.tuner._loop as loop_module

    calls: list[float] = []

    class Clock:
        @staticmethod
        def sleep(seconds: float) -> None:
            calls.append(seconds)
            if len(calls) == 1:
                then()
            assert len(calls) < 5, "still waiting"

        monotonic = staticmethod(loop_module.time.monotonic)

    monkeypatch.setattr(loop_module, "time", Clock)
    return calls


def test_a_claim_is_atomic_and_held_by_one_trial(study: optuna.Study):
    a, b = study.ask(), study.ask()
    claims = [_claim(study, CONFIG, t) for t in (a, b)]
    assert claims[0].try_acquire() is None
    assert claims[1].try_acquire() == trial_id(a)  # the other trial holds it
    other = _claim(study, BalanceConfig(micro_batches=[8], accumulation=1, global_batch=8, dtype="fp32",
                                        checkpoint=[[]]), b)
    assert other.try_acquire() is None  # another configuration: its own claim
    claims[0].release()
    assert claims[1].try_acquire() is None


def test_another_workers_running_trial_is_waited_for_and_its_result_reused(study: optuna.Study,
                                                                         monkeypatch: pytest.MonkeyPatch):
    other, other_claim = _other_worker_runs(study, CONFIG)
    mine = study.ask()
    loop = _loop(_rdb(study))

    def other_finishes() -> None:  # the other worker records its trial, then releases its claim
        other.set_user_attr(TrialAttr.CONFIG, CONFIG.to_dict())
        other.set_user_attr(TrialAttr.STATUS, Status.OK)
        study.tell(other, 1.0)
        other_claim.release()

    polls = _polls(monkeypatch, other_finishes)
    claim, done = loop.claim(study, mine, CONFIG)
    assert polls and done is not None and done.number == other.number  # waited, then reuses its result
    assert loop.launcher.beats >= 1  # this trial kept its heartbeat while waiting  # type: ignore[attr-defined]
    assert f"another worker's trial {other.number} runs the same configuration" in loop.reporter.notes[0]  # type: ignore[attr-defined]
    claim.release()


def test_a_dead_workers_running_trial_does_not_block(study: optuna.Study, monkeypatch: pytest.MonkeyPatch):
    other, _ = _other_worker_runs(study, CONFIG)  # its tuner dies: the claim is never released
    mine = study.ask()
    loop = _loop(_rdb(study))

    def goes_stale() -> None:  # what fail_stale_trials does once its heartbeat stopped
        _rdb(study).set_trial_user_attr(trial_id(other), TrialAttr.STATUS, Status.STALE)
        _rdb(study).set_trial_state_values(trial_id(other), state=TrialState.FAIL)

    _polls(monkeypatch, goes_stale)
    claim, done = loop.claim(study, mine, CONFIG)
    assert done is None and claim.held  # nothing to reuse: this trial launches it, under the claim now
    third = study.ask()
    assert _claim(study, CONFIG, third).try_acquire() == trial_id(mine)


def test_a_configuration_another_worker_measured_is_reused_not_launched(study: optuna.Study,
                                                                          monkeypatch: pytest.MonkeyPatch):
    other = study.ask()
    other.set_user_attr(TrialAttr.CONFIG, CONFIG.to_dict())
    other.set_user_attr(TrialAttr.STATUS, Status.OOM)
    study.tell(other, 1.0)
    mine = study.ask()
    loop = _loop(_rdb(study))
    polls = _polls(monkeypatch, lambda: None)
    claim, done = loop.claim(study, mine, CONFIG)
    assert not polls and done is not None and done.number == other.number
    claim.release()
    # a trial that failed (crash) measured nothing: launched again
    crashed = BalanceConfig(micro_batches=[2], accumulation=4, global_batch=8, dtype="fp32", checkpoint=[[]])
    bad = study.ask()
    bad.set_user_attr(TrialAttr.CONFIG, crashed.to_dict())
    bad.set_user_attr(TrialAttr.STATUS, Status.CRASH)
    study.tell(bad, state=TrialState.FAIL)
    claim, done = loop.claim(study, study.ask(), crashed)
    assert done is None and claim.held
