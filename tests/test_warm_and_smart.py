"""Warm worker pool versus cold trials, and the model-guided strategy, on CPU (real torchrun)."""

from __future__ import annotations

import json
import time

import optuna
import pytest

from autobalance import BalanceConfig
from autobalance.launcher import TrialLaunch, WarmPool, run_trial, trial_processes
from autobalance.tuner import SearchSpace
from autobalance.tuner.search import MemoryModel, observations_from_trials
from tests.tune_helpers import GPT, cli, load

pytestmark = pytest.mark.slow


def _peaks(outcome):
    return {r: (rep["memory"]["peak_allocated"], rep["memory"]["peak_device"]) for r, rep in outcome.reports.items()}


def test_warm_trials_measure_what_cold_trials_measure(tmp_path):
    configs = [None, BalanceConfig(micro_batches=[3, 13], global_batch=16),
               BalanceConfig(micro_batches=[4, 4], accumulation=2, global_batch=16, checkpoint=[[0, 1], []])]
    template = TrialLaunch(script=GPT, nproc_per_node=2, device="cpu", trial_dir=str(tmp_path), timeout_s=120)
    pool = WarmPool(template=template, pool_dir=str(tmp_path / "pool"))
    try:
        for i, cfg in enumerate(configs):
            fields = {**template.__dict__, "config_json": None if cfg is None else cfg.to_json()}
            cold = run_trial(TrialLaunch(**{**fields, "trial_dir": str(tmp_path / f"c{i}"), "trial_id": f"c{i}{time.time()}"}))
            warm = pool.run(TrialLaunch(**{**fields, "trial_dir": str(tmp_path / f"w{i}"), "trial_id": f"w{i}{time.time()}"}))
            assert cold.status == warm.status == "ok", (cold.reason, warm.reason)
            # live-tensor peaks on CPU are exact: warm must equal cold to the byte
            assert _peaks(warm) == _peaks(cold)
        assert pool.starts == 1
        pool_id = pool.pool_id
    finally:
        pool.close()
    assert trial_processes(pool_id) == []


def test_warm_study_is_faster_than_cold_and_records_the_same_memory(tmp_path):
    walls = {}
    for mode in ("cold", "warm"):
        db = tmp_path / f"{mode}.db"
        # verification (the same runs, warm or cold, after the trials) is not what is compared here
        args = ["tune", GPT, "--trials", "3", "--nproc-per-node", "2", "--device", "cpu", "--storage", f"sqlite:///{db}",
                "--study-name", "s", "--strategy", "optuna", "--sampler", "random", "--seed", "7", "--trial-timeout", "90",
                "--prune-factor", "0", "--no-verify"]
        if mode == "cold":
            args.append("--cold")
        start = time.monotonic()
        proc = cli(args, cwd=tmp_path)
        walls[mode] = time.monotonic() - start
        assert proc.returncode == 0, proc.stderr[-3000:]
    cold, warm = load(tmp_path / "cold.db").get_trials(), load(tmp_path / "warm.db").get_trials()
    assert len(cold) == len(warm) == 3
    for c, w in zip(cold, warm, strict=True):
        assert c.user_attrs["config"] == w.user_attrs["config"]  # same seed, same configurations
        assert c.user_attrs["status"] == w.user_attrs["status"] == "ok"
        assert c.user_attrs["peak_device_gib"] == w.user_attrs["peak_device_gib"]
    assert walls["warm"] < walls["cold"], walls


def test_model_strategy_skips_a_predicted_oom_without_launching(tmp_path):
    db = tmp_path / "a.db"
    base = ["tune", GPT, "--nproc-per-node", "2", "--device", "cpu", "--storage", f"sqlite:///{db}", "--study-name", "s",
            "--seed", "1", "--memory-cap-gib", "0.0145", "--dtypes", "fp32", "--trial-timeout", "90",
            "--no-verify"]  # what is saved is not the question here
    proc = cli([*base, "--trials", "6"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    study = load(db)
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
