"""Small pieces shared by the rooms: a trial's launch as the nodes of a multi-node trial share it,
the torchrun command, atomic writes and the script's digest."""

from __future__ import annotations

import hashlib
import json
import os
import sys

from autobalance._files import script_sha256, write_json_atomic
from autobalance.launcher import TrialLaunch, build_command


def test_joining_node_gets_the_shared_fields_and_keeps_its_own(tmp_path):
    coordinator = TrialLaunch(script="a.py", nproc_per_node=2, nnodes=2, device="cuda", config_json='{"x": 1}',
                              global_batch=None, steps=5, warmup=2, measure_s=1.5, max_steps=40,
                              memory_cap_bytes=[7, 8], trial_dir=str(tmp_path), timeout_s=99.0, pg_timeout_s=45)
    sent = json.loads(json.dumps(coordinator.shared()))  # as it crosses the shared directory
    node = TrialLaunch.joining(sent, script="b.py", nproc_per_node=2, nnodes=2, trial_dir=str(tmp_path / "t"),
                               timeout_s=sent["timeout_s"] + 60)
    assert node.shared() == {**coordinator.shared(), "timeout_s": 159.0}
    assert (node.script, node.trial_dir) == ("b.py", str(tmp_path / "t"))
    bare = TrialLaunch.joining({}, script="b.py", nproc_per_node=1, trial_dir=str(tmp_path))
    assert bare.shared() == TrialLaunch(script="b.py", nproc_per_node=1, trial_dir=str(tmp_path)).shared()


def test_torchrun_command_standalone_and_rendezvous(tmp_path):
    one = TrialLaunch(script="-m", script_args=["pkg.mod", "x.py"], nproc_per_node=2, trial_dir=str(tmp_path),
                      torchrun_args=["--master-port", "1"])
    assert build_command(one) == [sys.executable, "-m", "autobalance.launcher._torchrun_main", "--nproc-per-node", "2",
                                  "--max-restarts", "0", "--log-dir", os.path.join(str(tmp_path), "logs"),
                                  "--redirects", "3", "--standalone", "--master-port", "1", "-m", "pkg.mod", "x.py"]
    two = TrialLaunch(script="x.py", nproc_per_node=1, nnodes=2, rdzv_endpoint="h:1", rdzv_id="r", node_rank=1,
                      trial_dir=str(tmp_path))
    assert build_command(two)[11:] == ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1",
                                       "--rdzv-id", "r", "--node-rank", "1", "x.py"]


def test_atomic_json_write_leaves_only_the_file(tmp_path):
    path = str(tmp_path / "rank0.json")
    write_json_atomic(path, {"status": "ok", "n": 1})
    write_json_atomic(path, {"status": "oom"}, indent=1, fsync=False)
    assert json.loads(open(path).read()) == {"status": "oom"}
    assert os.listdir(tmp_path) == ["rank0.json"]


def test_script_digest(tmp_path):
    script = tmp_path / "train.py"
    script.write_bytes(b"print(1)\n" * 200_000)  # more than one read chunk
    assert script_sha256(script) == hashlib.sha256(script.read_bytes()).hexdigest()


def test_the_trial_environment_is_typed_and_round_trips(tmp_path, monkeypatch):
    """A trial's own variables are one TrialEnv: from_env reads back what to_env wrote; the cold
    environment carries them (the parent's stale ones removed) and a warm request carries only them."""
    from autobalance import _env
    from autobalance.launcher import trial_environment

    full = _env.TrialEnv(trial_dir=str(tmp_path), config_json='{"global_batch": 8}', global_batch=8, steps=4,
                         warmup=2, measure_s=1.5, max_steps=20, memory_cap_bytes=(1024, 2048))
    bare = _env.TrialEnv(trial_dir=str(tmp_path))
    for trial in (full, bare):
        assert _env.TrialEnv.from_env(trial.to_env()) == trial
        assert set(trial.to_env()) <= set(_env.TrialEnv.NAMES)
    assert set(bare.to_env()) == {_env.TRIAL_DIR, _env.STEPS, _env.WARMUP, _env.MAX_STEPS}
    monkeypatch.setenv(_env.MEASURE_S, "9")  # a parent's value never leaks into a trial that sets none
    monkeypatch.setenv(_env.STORAGE, "sqlite:///secret.db")
    launch = TrialLaunch(script="train.py", nproc_per_node=2, trial_dir=str(tmp_path), steps=4, warmup=2,
                         config_json='{"global_batch": 8}', memory_cap_bytes=[1024, 2048])
    env = trial_environment(launch)
    assert _env.MEASURE_S not in env and _env.STORAGE not in env
    assert {k: env[k] for k in _env.TrialEnv.NAMES if k in env} == launch.trial_env().to_env()
    assert env[_env.MEMORY_CAP_BYTES] == "1024,2048" and env[_env.TRIAL_ID] == launch.trial_id
