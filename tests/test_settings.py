"""Study TOMLs and flag precedence."""

from __future__ import annotations

from pathlib import Path

import pytest

from autobalance import UsageError
from autobalance.tuner import TuneSettings, load_toml

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", ["gpt.toml", "gpt-cpu.toml", "mlp.toml"])
def test_shipped_study_files_load(name):
    settings = TuneSettings.merge(flags={}, toml_path=str(REPO / "studies" / name))
    assert Path(settings.script).is_file()
    assert settings.trials >= 1


def test_flags_override_the_file():
    path = str(REPO / "studies" / "gpt-cpu.toml")
    settings = TuneSettings.merge(flags={"trials": 3, "seed": 5}, toml_path=path)
    assert settings.trials == 3 and settings.seed == 5
    assert settings.memory_cap_gib == [0.0145]  # from the file
    assert settings.study_name == "gpt-cpu"


def test_malformed_toml_names_the_line(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[tune]\ntrials = 3\nseed = = 4\n")
    with pytest.raises(UsageError, match="line 3"):
        load_toml(str(bad))


def test_unknown_key_is_rejected(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[tune]\ntrails = 3\n")
    with pytest.raises(UsageError, match="unknown key 'trails'"):
        load_toml(str(bad))


def test_script_may_come_from_the_file_only():
    settings = TuneSettings.merge(flags={"script": None}, toml_path=str(REPO / "studies" / "mlp.toml"))
    assert settings.script.endswith("examples/mlp/train.py")
    with pytest.raises(UsageError, match="SCRIPT is missing"):
        TuneSettings.merge(flags={"script": None}, toml_path=None)
