"""Warm worker pool versus cold trials, and the model-guided strategy, on CPU (real torchrun)."""

from __future__ import annotations

import json
from pathlib import Path

import optuna
import pytest

from autobalance import BalanceConfig
from autobalance.tuner import SearchSpace
from autobalance.tuner.search import MemoryModel, observations_from_trials
from tests.tune_helpers import GPT, cli, load, processes_with

pytestmark = pytest.mark.slow


def _rank_peaks(trial) -> dict[str, tuple[int, int]]:
    """The bytes each rank of a trial reported (its ``rank<N>.json``): (peak allocated, peak device)."""
    reports = sorted(Path(trial.user_attrs["trial_dir"]).glob("rank*.json"))
    assert len(reports) == 2, reports
    return {r.name: (m["peak_allocated"], m["peak_device"]) for r in reports
            for m in [json.loads(r.read_text())["memory"]]}


def test_warm_study_starts_one_pool_and_measures_the_same_bytes_as_cold(tmp_path):
    """The same seeded study twice, in cold trials (a torchrun per trial) and in one warm pool: the
    same configurations (the script's own among them), the same live-tensor peaks on CPU to the byte
    on every rank (warm trials are charged nothing the pool held), all in one pool start. Fails if a
    warm trial inherits memory or the pool restarts between good trials. (What the pool saves in
    time is measured in ``benchmarks/warm_vs_cold.py``, not asserted here: a wall-clock race between
    two studies is at the mercy of a busy machine.)"""
    for mode in ("cold", "warm"):
        db = tmp_path / f"{mode}.db"
        # verification (the same runs, warm or cold, after the trials) is not what is compared here
        args = ["tune", GPT, "--trials", "3", "--nproc-per-node", "2", "--device", "cpu", "--storage", f"sqlite:///{db}",
                "--study-name", "s", "--strategy", "optuna", "--sampler", "random", "--seed", "7", "--trial-timeout", "90",
                "--prune-factor", "0", "--no-verify", "--runs-dir", str(tmp_path / mode)]
        if mode == "cold":
            args.append("--cold")
        proc = cli(args, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
    cold, warm = load(tmp_path / "cold.db").get_trials(), load(tmp_path / "warm.db").get_trials()
    assert len(cold) == len(warm) == 3
    assert cold[0].user_attrs["baseline"] and len({json.dumps(t.user_attrs["config"]) for t in warm}) == 3
    for c, w in zip(cold, warm, strict=True):
        assert c.user_attrs["config"] == w.user_attrs["config"]  # same seed, same configurations
        assert c.user_attrs["status"] == w.user_attrs["status"] == "ok"
        assert c.user_attrs["peak_device_gib"] == w.user_attrs["peak_device_gib"]
        assert _rank_peaks(c) == _rank_peaks(w)  # live-tensor peaks on CPU are exact: to the byte
    assert len(list((tmp_path / "warm" / "s").glob("pool-*"))) == 1  # one pool start for the three
    assert not list((tmp_path / "cold" / "s").glob("pool-*"))
    assert processes_with(str(tmp_path)) == []


def test_an_oom_trial_is_infeasible_and_the_model_strategy_skips_a_predicted_oom_without_launching(tmp_path):
    """Under a cap the script's own (8, 8) exceeds on rank 0, the baseline runs out of memory: it is
    recorded as a complete, infeasible trial (the sampler sees it) and the study goes on. The memory
    model fitted to the trials then rules out a hopeless configuration without launching it."""
    db = tmp_path / "a.db"
    # the baseline (8, 8) needs ~16 MiB on rank 0 (EMA + cached batch); the cap is 14.8 MiB
    base = ["tune", GPT, "--nproc-per-node", "2", "--device", "cpu", "--storage", f"sqlite:///{db}", "--study-name", "s",
            "--seed", "1", "--memory-cap-gib", "0.0145", "--dtypes", "fp32", "--trial-timeout", "90",
            "--no-verify"]  # what is saved is not the question here
    proc = cli([*base, "--trials", "6"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    study = load(db)
    trials = study.get_trials()
    assert trials[0].user_attrs["baseline"] is True
    oom = trials[0]
    assert oom.user_attrs["status"] == "oom"
    assert oom.state == optuna.trial.TrialState.COMPLETE  # visible to the sampler
    assert oom.system_attrs["constraints"][0] > 0
    assert oom.user_attrs["feasible"] is False
    assert "out of memory" in oom.user_attrs["reason"]
    assert any(t.user_attrs["status"] == "ok" for t in trials[1:])  # the study went on
    space = SearchSpace.from_dict(study.user_attrs["autobalance:space"])
    # the memory model fitted to these real CPU trials predicts them within a few per cent
    obs = observations_from_trials(study.get_trials(), num_layers=space.num_layers)
    model = MemoryModel.fit(obs, world_size=2)
    assert model.holdout_error([o for o in obs if o.ok]) < 0.05
    # enqueue a configuration that cannot fit (rank 0 takes 15 of 16 samples) and continue the study
    hopeless = BalanceConfig(micro_batches=[15, 1], global_batch=16, dtype="fp32")
    study.enqueue_trial(space.params_from_config(hopeless))
    proc = cli([*base, "--trials", "7"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    trials = load(db).get_trials()
    predicted = [t for t in trials if t.user_attrs.get("status") == "predicted_oom"]
    hopeless_trials = [t for t in predicted if t.user_attrs["config"]["micro_batches"] == [15, 1]]
    assert hopeless_trials, [(t.user_attrs.get("status"), t.user_attrs.get("config")) for t in trials]
    t = hopeless_trials[0]
    assert t.state == optuna.trial.TrialState.COMPLETE
    assert t.system_attrs["constraints"][0] > 0
    assert t.user_attrs["predicted"] is True
    assert "not launched" in t.user_attrs["reason"]
    assert "trial_dir" not in t.user_attrs  # nothing ran
    assert json.dumps(t.user_attrs["config"])
