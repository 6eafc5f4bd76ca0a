"""Production jobs load the saved best configuration through plan(): every rank the same row."""

from __future__ import annotations

import json

import pytest

from autobalance import BalanceConfig
from autobalance.store import ConfigStore, current_fingerprint, export_file
from tests.conftest import torchrun

pytestmark = pytest.mark.slow

SHOW = "tests/scripts/show_plan.py"


def _using(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("autobalance: using")]


def plans(out_dir) -> dict[int, dict]:
    found = {}
    for path in sorted(out_dir.glob("rank*.json")):
        data = json.loads(path.read_text())
        found[data["rank"]] = data
    return found


def show(tmp_path, env):
    out = tmp_path / "plans"
    out.mkdir(exist_ok=True)
    proc = torchrun([SHOW], env={"AUTOBALANCE_DEVICE": "cpu", "SHOW_PLAN_DIR": str(out), **env})
    return proc, plans(out)


@pytest.fixture
def saved(tmp_path):
    url = f"sqlite:///{tmp_path / 'best.db'}"
    config = BalanceConfig(micro_batches=[3, 5], accumulation=2, global_batch=16, checkpoint=[[0], []],
                           dtype="bf16", bucket_cap_mb=12.5, gradient_as_bucket_view=True)
    with ConfigStore(url=url) as store:
        row = store.save(study_name="prod", trial_number=7, config=config, figures={"step_time_ms": 1.0},
                         fingerprint=current_fingerprint(device_type="cpu", world_size=2, nnodes=1),
                         saved_by="test")
    return url, row


def test_study_in_environment_loads_the_same_row_on_every_rank(saved, tmp_path):
    """Rank 0 reads the store once and broadcasts: fails if every rank opens the database (a
    thousand ranks would hammer it), if rank 0 does not read it, or if rank 1 ends up with
    anything but rank 0's row."""
    url, row = saved
    proc, found = show(tmp_path, {"AUTOBALANCE_STUDY": "prod", "AUTOBALANCE_STORAGE": url,
                                  "SHOW_PLAN_WATCH": str(tmp_path / "best.db")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert set(found) == {0, 1}
    for data in found.values():
        assert data["config"] == row.config.to_dict()
        assert data["source"] == "store:prod#7"
    # one line (rank 0) names the source of the configuration; the same machine is no mismatch
    assert _using(proc.stderr) == [f"autobalance: using study prod, trial 7 ({url}): rank 0: 3,3 ckpt 0; "
                                   "rank 1: 5,5 | bf16 bucket=12MB view"]
    assert "(tuned) vs" not in proc.stderr
    assert any(t.startswith("sqlite3.connect") for t in found[0]["touched"]), found[0]
    assert found[1]["touched"] == []


def test_export_file_loads_without_a_database(saved, tmp_path):
    """Fails if every rank reads the export file instead of rank 0 reading and broadcasting it, or if
    a rank applies anything but the exported configuration."""
    _url, row = saved
    path = export_file(row, str(tmp_path / "best.json"))
    proc, found = show(tmp_path, {"AUTOBALANCE_CONFIG_FILE": path, "SHOW_PLAN_WATCH": path})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert set(found) == {0, 1}
    assert all(d["config"] == row.config.to_dict() for d in found.values())
    assert _using(proc.stderr) == [f"autobalance: using {path} (study prod, trial 7): rank 0: 3,3 ckpt 0; "
                                   "rank 1: 5,5 | bf16 bucket=12MB view"]
    # read by rank 0 only (fails if every rank reads the file)
    assert found[0]["touched"] == [f"open {path}"] and found[1]["touched"] == []


def test_an_any_split_export_loads_on_every_rank_and_is_shown_once(tmp_path):
    config = BalanceConfig.any_split(rank_samples=[32, 21], accumulation=6, checkpoint=[[0], []], dtype="bf16")
    with ConfigStore(url=f"sqlite:///{tmp_path / 'any.db'}") as store:
        row = store.save(study_name="prod", trial_number=3, config=config, figures={},
                         fingerprint=current_fingerprint(device_type="cpu", world_size=2, nnodes=1), saved_by="test")
    path = export_file(row, str(tmp_path / "any.json"))
    proc, found = show(tmp_path, {"AUTOBALANCE_CONFIG_FILE": path})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert set(found) == {0, 1}
    assert all(BalanceConfig.from_dict(d["config"]) == config for d in found.values())
    shown = _using(proc.stderr)
    assert len(shown) == 1 and shown[0].endswith("rank 0: 6,6,5,5,5,5 ckpt 0; rank 1: 4,4,4,3,3,3 | bf16 bucket=25MB"), \
        proc.stderr[-2000:]


def test_no_environment_means_the_script_defaults(tmp_path):
    proc, found = show(tmp_path, {})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert set(found) == {0, 1}
    for data in found.values():
        assert data["source"] == "defaults"
        assert data["config"]["micro_batches"] == [4, 4]
    # one line (rank 0) says no stored configuration was found and what the job applies instead
    assert _using(proc.stderr) == ["autobalance: using the script's own configuration (no stored configuration: set "
                                   "AUTOBALANCE_STUDY and AUTOBALANCE_STORAGE, or AUTOBALANCE_CONFIG_FILE, or pass "
                                   "study= to plan()): rank 0: 4; rank 1: 4 | fp32 bucket=25MB"]


def test_hardware_mismatch_is_named_and_fails_under_policy_error(tmp_path):
    url = f"sqlite:///{tmp_path / 'best.db'}"
    config = BalanceConfig(micro_batches=[2, 2, 2, 2], global_batch=8)
    with ConfigStore(url=url) as store:
        store.save(study_name="four", trial_number=1, config=config, figures={},
                   fingerprint=current_fingerprint(device_type="cpu", world_size=4, nnodes=1), saved_by="test")
    proc, found = show(tmp_path, {"AUTOBALANCE_STUDY": "four", "AUTOBALANCE_STORAGE": url, "SHOW_PLAN_POLICY": "error"})
    assert proc.returncode != 0
    assert "world size" in proc.stderr + proc.stdout
    assert found == {}
