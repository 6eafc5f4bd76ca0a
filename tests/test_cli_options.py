"""`autobalance tune`'s flags are derived from `TuneSettings`: every field has a flag and a TOML key,
the help is the field's docstring and shows the field's default, docs/tuning.md's table names every flag,
and a flag overrides the study TOML only when it is given."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from autobalance._errors import UsageError
from autobalance.cli import app
from autobalance.cli._options import ARGUMENT, EXTRA, flag_of
from autobalance.tuner import CHOICES, TuneSettings, load_toml, setting_docs, setting_types

REPO = Path(__file__).resolve().parents[1]
GPT = str(REPO / "examples" / "gpt" / "train.py")
SAMPLE = {"int": 3, "float": 0.5, "str": "x", "float | str": 1.5, "bool": True, "list[str]": ["a"], "list[float]": [1.0]}


def _letters(text: str) -> str:
    return re.sub(r"[^a-z0-9]", "", text.lower())


def _tune_params() -> dict[str, Any]:
    command = typer.main.get_command(app).commands["tune"]  # type: ignore[attr-defined]
    return {p.name: p for p in command.params}


def _help() -> str:
    """`autobalance tune --help` as a user reading it through a pipe sees it (COLUMNS unset)."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    proc = subprocess.run([sys.executable, "-m", "autobalance", "tune", "--help"], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_every_field_has_a_flag_with_its_docstring_and_default() -> None:
    params = _tune_params()
    docs = setting_docs()
    assert set(docs) == {f.name for f in fields(TuneSettings)}
    for name, doc in docs.items():
        if name == EXTRA:
            continue  # the script's own arguments: everything after `--`
        param = params[name]
        if name == ARGUMENT:
            assert param.param_type_name == "argument"
        else:
            assert flag_of(name) in param.opts, (name, param.opts)
        assert _letters(doc.help) in _letters(param.help), name  # the docstring (field names shown as flags)
        if param.show_default is True:  # the field's own default value, shown by typer
            assert param.default == doc.value, name
        else:  # None / "" / []: the docstring's (default: ...) text
            assert param.default is None and param.show_default == doc.default, name
            assert doc.value is MISSING or doc.value in (None, "", []), name


def test_help_through_a_pipe_shows_every_default() -> None:
    text = " ".join(_help().replace("│", " ").split())
    assert "[default: 20]" in text  # --trials: not eaten as markup any more
    assert "[default: (derived from the script's path)]" in text  # --study-name
    for name in setting_docs():
        if name not in (ARGUMENT, EXTRA):
            assert flag_of(name) in text, name
    for shown in ("[default: 0.05]", "[default: sqlite:///autobalance.db]", "[default: verify]",
                  "[default: (none, one trial at a time)]", "[default: auto]"):
        assert shown in text, shown


@pytest.mark.parametrize("name", [f.name for f in fields(TuneSettings)])
def test_every_field_is_a_toml_key(tmp_path: Path, name: str) -> None:
    annotation = setting_types()[name].replace(" | None", "")  # a choice setting's Literal read as str
    value = setting_docs()[name].value
    value = SAMPLE[annotation] if value is MISSING or value in (None, "", []) else value
    if name == "script":
        value = GPT
    literal = repr(value).replace("True", "true").replace("False", "false").replace("'", '"')
    for key in (name, name.replace("_", "-")):
        toml = tmp_path / "s.toml"
        toml.write_text(f"[tune]\n{key} = {literal}\n")
        assert name in load_toml(str(toml)), key


def test_the_tuning_pages_table_names_every_flag() -> None:
    """The flag table moved from the README to docs/tuning.md (issue 43); the README links to it."""
    assert "](docs/tuning.md)" in (REPO / "README.md").read_text()
    readme = (REPO / "docs" / "tuning.md").read_text()
    table = readme[readme.index("| flag | default |"):readme.index("\n\n", readme.index("| flag | default |"))]
    for name in setting_docs():
        if name not in (ARGUMENT, EXTRA):
            assert f"`{flag_of(name)}" in table, name


def test_a_flag_wins_over_the_toml_only_when_given(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}

    def fake_run_tune(*, flags: dict[str, Any], config_path: str | None) -> None:
        seen["settings"] = TuneSettings.merge(flags=flags, toml_path=config_path)

    monkeypatch.setattr("autobalance.cli._tune.run_tune", fake_run_tune)
    toml = tmp_path / "s.toml"
    toml.write_text(f'[tune]\nscript = "{GPT}"\ntrials = 7\nheadroom = 0.2\ncold = true\nmemory-cap-gib = 0.5\n')
    runner = CliRunner()
    result = runner.invoke(app, ["tune", GPT, "--config", str(toml), "--headroom", "0.1", "--dtypes", "fp32,bf16",
                                 "--", "--n-layer", "2"])
    assert result.exit_code == 0, result.output
    s = seen["settings"]
    assert (s.trials, s.headroom, s.cold, s.memory_cap_gib) == (7, 0.1, True, [0.5])  # defaults did not override
    assert s.dtypes == ["fp32", "bf16"] and s.script_args == ["--n-layer", "2"]
    result = runner.invoke(app, ["tune", "--config", str(toml), "--no-cold", "--memory-cap-gib", "1,2"])
    assert result.exit_code == 0, result.output
    assert seen["settings"].cold is False and seen["settings"].memory_cap_gib == [1.0, 2.0]
    # the script from the TOML, its own arguments after --
    result = runner.invoke(app, ["tune", "--config", str(toml), "--", "--n-layer", "2"])
    assert result.exit_code == 0, result.output
    assert seen["settings"].script == GPT and seen["settings"].script_args == ["--n-layer", "2"]
    result = runner.invoke(app, ["tune", "--config", str(toml), "--memory-cap-gib", "a,b"])
    assert result.exit_code == 2 and "--memory-cap-gib='a,b' is not a number" in result.output


def test_the_command_line_is_built_without_heavy_imports() -> None:
    """`autobalance --help` stays instant: deriving tune's flags imports the settings, not the tuner."""
    code = ("import sys, typer; from autobalance.cli import app; typer.main.get_command(app); "
            "print(sorted(m for m in ('optuna', 'torch', 'sqlalchemy', 'numpy') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_choice_settings_are_literals_and_the_command_line_shows_their_choices() -> None:
    """One source for both: a choice setting's ``Literal`` is what TuneSettings accepts and the flag's metavar."""
    assert set(CHOICES) == {"device", "remeasure", "cap_mode", "strategy", "sampler", "split", "on_error", "compile",
                            "compile_scope"}
    params = _tune_params()
    for name, choices in CHOICES.items():
        assert params[name].metavar == "|".join(choices), name
        assert setting_types()[name] in ("str", "str | None"), name
    settings = TuneSettings(script=GPT, device="cpu", sampler="random")
    assert settings.sampler == "random"
    with pytest.raises(UsageError, match=r"--sampler='bogus' is unknown; use one of tpe, gp, random, nsga2\."):
        TuneSettings(script=GPT, device="cpu", sampler="bogus")  # type: ignore[arg-type]
    with pytest.raises(UsageError, match=r"--on-error='x' is unknown; use stop or continue\."):
        TuneSettings(script=GPT, device="cpu", on_error="x")  # type: ignore[arg-type]
    with pytest.raises(UsageError, match=r"--compile='x' is unknown; use one of off, on, search\."):
        TuneSettings(script=GPT, device="cpu", compile="x")  # type: ignore[arg-type]
