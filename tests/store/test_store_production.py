"""Export files and production loading: file first, default storage, compatibility policies."""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import GIB, full_config, make_fingerprint

from autobalance import (
    BalanceConfig,
    ConfigError,
    HardwareMismatchError,
    SchemaVersionError,
    StudyNotFoundError,
    UsageError,
)
from autobalance.store import (
    EXPORT_FORMAT,
    ConfigStore,
    HardwareMismatchWarning,
    SavedConfig,
    check_compatibility,
    export_file,
    load_saved_config,
    read_export_file,
    script_sha256,
)

SaveKwargs = Callable[..., dict[str, Any]]


@pytest.fixture
def saved(sqlite_url: str, save_kwargs: SaveKwargs) -> SavedConfig:
    with ConfigStore(url=sqlite_url) as store:
        return store.save(**save_kwargs())


def test_export_round_trip_every_field(saved: SavedConfig, tmp_path: Path) -> None:
    path = tmp_path / "best.json"
    assert export_file(saved, path) == str(path)
    data = json.loads(path.read_text())
    assert data == saved.to_dict()
    assert data["format"] == EXPORT_FORMAT
    assert data["format_version"] == 1
    loaded = read_export_file(path)
    assert loaded == saved
    for f in dataclasses.fields(BalanceConfig):
        assert getattr(loaded.config, f.name) == getattr(full_config(), f.name), f.name
    assert loaded.fingerprint == saved.fingerprint


def test_export_is_atomic_and_overwrites(saved: SavedConfig, tmp_path: Path) -> None:
    path = tmp_path / "best.json"
    path.write_text("old")
    export_file(saved, path)
    export_file(saved, str(path))
    assert [
        p for p in os.listdir(tmp_path) if p.startswith(".autobalance-")
    ] == []  # no temp file left
    assert read_export_file(path) == saved


def test_export_to_missing_directory(saved: SavedConfig, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        export_file(saved, tmp_path / "nope" / "best.json")


@pytest.mark.parametrize(
    ("mutate", "error", "expected"),
    [
        (lambda d: "not json {", ConfigError, "malformed"),
        (lambda d: [1, 2], ConfigError, "not a JSON object"),
        (lambda d: {**d, "format": "other"}, ConfigError, "autobalance export"),
        (lambda d: {**d, "format_version": 2}, SchemaVersionError, "upgrade autobalance"),
        (lambda d: {**d, "extra": 1}, ConfigError, "unknown field"),
        (lambda d: {k: v for k, v in d.items() if k != "config"}, ConfigError, "lacks field"),
        (
            lambda d: {**d, "config": {**d["config"], "global_batch": 1}},
            ConfigError,
            "global_batch=1",
        ),
        (
            lambda d: {**d, "fingerprint": {**d["fingerprint"], "world_size": "2"}},
            ConfigError,
            "world_size",
        ),
        (lambda d: {**d, "created_at": "yesterday"}, ConfigError, "ISO 8601"),
    ],
)
def test_export_file_is_validated(
    saved: SavedConfig,
    tmp_path: Path,
    mutate: Callable[[Any], Any],
    error: type[Exception],
    expected: str,
) -> None:
    path = tmp_path / "bad.json"
    data = mutate(saved.to_dict())
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    with pytest.raises(error, match=expected) as info:
        read_export_file(path)
    assert str(path) in str(info.value)
    assert "\n" not in str(info.value)


def test_missing_export_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="autobalance export"):
        load_saved_config(study=None, storage=None, config_file=str(tmp_path / "none.json"))


def test_load_file_first_without_database(saved: SavedConfig, tmp_path: Path) -> None:
    path = tmp_path / "best.json"
    export_file(saved, path)
    loaded = load_saved_config(
        study="other", storage="sqlite:////nonexistent/x.db", config_file=str(path)
    )
    assert loaded == saved


def test_load_from_storage(saved: SavedConfig, sqlite_url: str) -> None:
    assert load_saved_config(study="s", storage=sqlite_url, config_file=None) == saved
    with pytest.raises(StudyNotFoundError, match="'s'"):
        load_saved_config(study="t", storage=sqlite_url, config_file=None)


def test_load_default_storage(
    save_kwargs: SaveKwargs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with ConfigStore(url="sqlite:///autobalance.db") as store:
        saved = store.save(**save_kwargs())
    assert load_saved_config(study="s", storage=None, config_file=None) == saved


def test_load_needs_a_study() -> None:
    with pytest.raises(UsageError, match="AUTOBALANCE_STUDY"):
        load_saved_config(study=None, storage=None, config_file=None)


def _catch(fn: Callable[[], list[str]]) -> tuple[list[str], list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fn()
    assert all(issubclass(w.category, HardwareMismatchWarning) for w in caught)
    return result, [str(w.message) for w in caught]


def test_compatible_hardware_is_silent(saved: SavedConfig) -> None:
    result, messages = _catch(
        lambda: check_compatibility(
            saved, current=make_fingerprint(), script_path=None, policy="error"
        )
    )
    assert result == [] and messages == []


def test_mismatch_policy_error_names_all_differences(saved: SavedConfig) -> None:
    current = make_fingerprint(
        device_name="NVIDIA A100", capacity_bytes=[80 * GIB] * 3, cap_bytes=[]
    )
    with pytest.raises(HardwareMismatchError) as info:
        check_compatibility(saved, current=current, script_path=None, policy="error")
    message = str(info.value)
    assert "\n" not in message
    assert "GPU 'NVIDIA H200' (tuned) vs 'NVIDIA A100' (this job)" in message
    assert "rank 0 memory 140 GiB (tuned) vs 80.0 GiB (this job)" in message
    assert "rank 2 memory" in message
    assert "'warn'" in message and "autobalance tune" in message


def test_mismatch_policy_error_world_size(saved: SavedConfig) -> None:
    with pytest.raises(HardwareMismatchError, match=r"world size 3 \(tuned\) vs 4 \(this job\)"):
        check_compatibility(
            saved, current=make_fingerprint(world_size=4), script_path=None, policy="error"
        )


def test_mismatch_policy_warn(saved: SavedConfig) -> None:
    current = make_fingerprint(world_size=4, torch_version="2.7.0")
    result, messages = _catch(
        lambda: check_compatibility(saved, current=current, script_path=None, policy="warn")
    )
    assert result == [
        "world size 3 (tuned) vs 4 (this job)",
        "torch 2.6.0+cu124 (tuned) vs 2.7.0 (this job)",
    ]
    assert len(messages) == 2
    assert "world size 3 (tuned) vs 4 (this job)" in messages[0]
    assert all("\n" not in m for m in messages)


def test_versions_only_warn_even_with_policy_error(saved: SavedConfig) -> None:
    current = make_fingerprint(cuda_version="12.8")
    result, messages = _catch(
        lambda: check_compatibility(saved, current=current, script_path=None, policy="error")
    )
    assert result == ["CUDA 12.4 (tuned) vs 12.8 (this job)"]
    assert len(messages) == 1


def test_script_change_warns(sqlite_url: str, save_kwargs: SaveKwargs, tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("print('v1')\n")
    digest = script_sha256(script)
    assert len(digest) == 64
    with ConfigStore(url=sqlite_url) as store:
        saved = store.save(**save_kwargs(script_sha256=digest))
    result, messages = _catch(
        lambda: check_compatibility(
            saved, current=make_fingerprint(), script_path=script, policy="error"
        )
    )
    assert result == [] and messages == []
    script.write_text("print('v2')\n")
    result, messages = _catch(
        lambda: check_compatibility(
            saved, current=make_fingerprint(), script_path=str(script), policy="error"
        )
    )
    new = script_sha256(script)
    assert result == [f"training script changed since tuning (sha {digest[:12]} vs {new[:12]})"]
    assert len(messages) == 1 and "training script changed since tuning" in messages[0]


def test_unknown_policy(saved: SavedConfig) -> None:
    with pytest.raises(UsageError, match="policy='ignore'"):
        check_compatibility(saved, current=make_fingerprint(), script_path=None, policy="ignore")


def _any_split() -> BalanceConfig:
    return BalanceConfig.any_split(rank_samples=[32, 21, 7], accumulation=6, checkpoint=[[0], [], [1]],
                                   dtype="bf16", gradient_as_bucket_view=True)


def test_any_split_saves_exports_and_loads_and_shows_plainly(sqlite_url: str, save_kwargs: SaveKwargs,
                                                              tmp_path: Path) -> None:
    with ConfigStore(url=sqlite_url) as store:
        saved = store.save(**save_kwargs(config=_any_split()))
        assert store.load("s").config == _any_split()
    path = tmp_path / "best.json"
    export_file(saved, path)
    data = json.loads(path.read_text())
    assert data["split"] == ["rank 0: 6,6,5,5,5,5", "rank 1: 4,4,4,3,3,3", "rank 2: 2,1,1,1,1,1"]
    assert data["config"]["rank_samples"] == [32, 21, 7]
    assert read_export_file(path).config == _any_split()
    data["split"][0] = "rank 0: 8,8,8,8"  # display only: an edit there is refused, not silently ignored
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="split is display only") as info:
        read_export_file(path)
    assert "\n" not in str(info.value)


OLD_EXPORT = """{
  "format": "autobalance.saved_config", "format_version": 1, "study_name": "old", "trial_number": 3,
  "config": {"micro_batches": [3, 5], "accumulation": 2, "global_batch": 16, "checkpoint": [[0], []],
             "dtype": "bf16", "bucket_cap_mb": 25.0, "gradient_as_bucket_view": true, "compile": "off",
             "activation_budget": null},
  "figures": {}, "fingerprint": %s, "script_sha256": "", "created_at": "2026-11-30T10:00:00+00:00",
  "saved_by": "tune"
}"""


def test_old_export_files_and_rows_load_and_equal_splits_are_written_as_before(
    sqlite_url: str, save_kwargs: SaveKwargs, tmp_path: Path
) -> None:
    path = tmp_path / "old.json"
    path.write_text(OLD_EXPORT % json.dumps(make_fingerprint(world_size=2).to_dict()))
    loaded = read_export_file(path)
    assert loaded.config.samples_per_rank == [6, 10] and loaded.config.micro_step_sizes(0) == [3, 3]
    again = tmp_path / "again.json"
    export_file(loaded, again)
    assert "split" not in json.loads(again.read_text())
    assert json.loads(again.read_text())["config"] == json.loads(path.read_text())["config"]
    # an equal split given as per-rank samples is stored as the same old-form row
    with ConfigStore(url=sqlite_url) as store:
        store.save(**save_kwargs(config=BalanceConfig.any_split(rank_samples=[6, 10, 8], accumulation=2)))
        row = store.load("s")
    assert row.config == BalanceConfig(micro_batches=[3, 5, 4], accumulation=2, global_batch=24)
    import sqlite3

    with sqlite3.connect(sqlite_url.removeprefix("sqlite:///")) as db:
        (stored,) = db.execute("SELECT config_json FROM autobalance_saved_config").fetchone()
    # byte for byte what the code before any split wrote for this configuration
    assert stored == ('{"accumulation": 2, "activation_budget": null, "bucket_cap_mb": 25.0, "checkpoint": [[], [], []], '
                      '"compile": "off", "dtype": "fp32", "global_batch": 24, "gradient_as_bucket_view": false, '
                      '"micro_batches": [3, 5, 4]}')
