"""Study TOMLs and flag precedence."""

from __future__ import annotations

from pathlib import Path

import pytest

from autobalance import UsageError
from autobalance.tuner import TuneSettings, load_toml

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "studies").glob("*.toml")))
def test_shipped_study_files_load(name):
    settings = TuneSettings.merge(flags={}, toml_path=str(REPO / "studies" / name))
    assert Path(settings.script).is_file()
    assert settings.trials >= 1


def test_the_one_gpu_compiled_search_study():
    """benchmarks/compiled_search.py's scenario: world size 1, global batch 32, compile search, 5 minutes."""
    s = TuneSettings.merge(flags={}, toml_path=str(REPO / "studies" / "gpt-1gpu.toml"))
    assert (s.world_size, s.global_batch, s.compile, s.time_budget_s, s.memory_cap_gib) == (1, 32, "search", 300.0, [16.0])
    args = s.script_args
    assert int(args[args.index("--micro-batch") + 1]) * int(args[args.index("--accumulation") + 1]) == 32


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


def test_measure_s_takes_seconds_zero_or_auto_from_flags_and_files(tmp_path):
    script = str(REPO / "examples" / "gpt" / "train.py")
    assert TuneSettings(script=script).measure_s == "auto"
    assert TuneSettings(script=script, measure_s="1.5").measure_s == 1.5  # a flag arrives as text
    assert TuneSettings(script=script, measure_s="0").measure_s == 0.0
    for value, words in (("soon", "not a number"), ("-1", "between 0 and 3600"), (float("nan"), "between 0")):
        with pytest.raises(UsageError, match=f"--measure-s=.*{words}") as info:
            TuneSettings(script=script, measure_s=value)
        assert "auto" in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(UsageError, match="--max-steps=2 is below --steps=3"):
        TuneSettings(script=script, max_steps=2)
    toml = tmp_path / "s.toml"
    toml.write_text(f'[tune]\nscript = "{script}"\nmeasure-s = "auto"\nmax-steps = 20\n')
    assert TuneSettings.merge(flags={}, toml_path=str(toml)).measure_s == "auto"
    toml.write_text(f'[tune]\nscript = "{script}"\nmeasure-s = 2\n')
    assert TuneSettings.merge(flags={}, toml_path=str(toml)).measure_s == 2.0
    toml.write_text(f'[tune]\nscript = "{script}"\nmeasure-s = "later"\n')
    with pytest.raises(UsageError, match=r'measure_s = .later., which is not a number or "auto"'):
        load_toml(str(toml))
