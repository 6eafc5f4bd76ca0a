"""The study's warm pool serves its verification runs (no second start-up) only when it runs the
same job: what a request sets per run (configuration, steps, cap, directory) may differ, nothing else."""

from __future__ import annotations

import dataclasses

import pytest

from autobalance.launcher import TrialLaunch, WarmPool
from autobalance.verify import SharedRuns


def _trial(tmp_path, **changes) -> TrialLaunch:
    base = TrialLaunch(script="train.py", script_args=["--x", "1"], nproc_per_node=2, device="cpu",
                       config_json='{"micro_batches": [7, 9]}', steps=3, warmup=1, measure_s=2.0,
                       memory_cap_bytes=[2**24], trial_dir=str(tmp_path / "trial-0001"), timeout_s=60,
                       pg_timeout_s=30, env={"TORCHINDUCTOR_CACHE_DIR": "/c"})
    return dataclasses.replace(base, **changes)


@pytest.mark.parametrize("changes", [
    {"config_json": None, "global_batch": 16},
    {"steps": 1, "warmup": 0, "measure_s": 0.0, "max_steps": 1},
    {"memory_cap_bytes": None},
    {"trial_dir": "/elsewhere/verify-trial3/baseline", "timeout_s": 300.0, "trial_id": "other"},
], ids=["config", "steps", "no-cap", "directory"])
def test_a_pool_serves_a_run_that_differs_only_per_request(tmp_path, changes):
    pool = WarmPool(template=_trial(tmp_path), pool_dir=str(tmp_path / "pool"))
    assert pool.serves(_trial(tmp_path, **changes))


@pytest.mark.parametrize("changes", [
    {"script": "other.py"},
    {"script_args": ["--x", "2"]},
    {"nproc_per_node": 3},
    {"device": "cuda"},
    {"torchrun_args": ["--master-port", "1"]},
    {"env": {}},
    {"cpus": [0]},
    {"pg_timeout_s": 60},
], ids=["script", "args", "ranks", "device", "torchrun-args", "env", "cpus", "pg-timeout"])
def test_a_pool_never_serves_another_job(tmp_path, changes):
    pool = WarmPool(template=_trial(tmp_path), pool_dir=str(tmp_path / "pool"))
    assert not pool.serves(_trial(tmp_path, **changes))


class _CountedPool(WarmPool):
    closed = 0

    def close(self, *, graceful: bool = True) -> None:
        type(self).closed += 1
        super().close(graceful=graceful)


def test_verification_takes_the_offered_pool_when_it_serves_and_leaves_it_to_its_owner(tmp_path):
    notes: list[str] = []
    offered = _CountedPool(template=_trial(tmp_path), pool_dir=str(tmp_path / "study"))
    _CountedPool.closed = 0
    with SharedRuns(pool=offered) as shared:
        run = _trial(tmp_path, config_json=None, steps=1, warmup=0, memory_cap_bytes=None,
                     trial_dir=str(tmp_path / "verify" / "baseline"))
        assert shared.pool_for(run, pool_dir=str(tmp_path / "verify" / "pool"), note=notes.append) is offered
        assert shared.pool_for(run, pool_dir="unused", note=notes.append) is offered  # chosen once
    assert _CountedPool.closed == 0 and shared.pool is None  # the tuner that kept it closes it
    assert notes == ["verify: the runs use the study's warm workers (no new start-up)"]


def test_verification_starts_and_closes_its_own_pool_for_another_job(tmp_path, monkeypatch):
    notes: list[str] = []
    offered = WarmPool(template=_trial(tmp_path), pool_dir=str(tmp_path / "study"))
    closed: list[str] = []
    monkeypatch.setattr(WarmPool, "close", lambda self, graceful=True: closed.append(self.pool_dir))
    with SharedRuns(pool=offered) as shared:
        other = _trial(tmp_path, script_args=["--x", "2"], trial_dir=str(tmp_path / "verify" / "baseline"))
        own = shared.pool_for(other, pool_dir=str(tmp_path / "verify" / "pool"), note=notes.append)
        assert own is not offered and own.template is other
    assert closed == [str(tmp_path / "verify" / "pool")] and notes == []  # its own pool only
