"""What a newcomer reads (issue 31), from the user's side, without torchrun: the demo's first lines say
what it is about to show, a trial that ran to the end over the usable limit never reads plain ``ok``
(tune's log, ``autobalance trials``, the baseline-vs-best table), and the README's commands name the
demo's study."""

from __future__ import annotations

import io
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from rich.console import Console
from typer.testing import CliRunner

from autobalance.cli import app
from autobalance.cli._views import print_result
from autobalance.protocol import over_limit
from autobalance.tuner import TuneSettings
from autobalance.tuner._baseline import baseline_fit_note
from autobalance.tuner._reporter import RichReporter
from tests.synthetic_study import OVER_CAP_FASTER_2, build_study

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "studies" / "gpt-cpu.toml"


def _console() -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, width=400, force_terminal=False, color_system=None), out


def test_the_demos_first_three_lines_say_what_it_shows() -> None:
    """The demo's baseline runs out of memory by design; its first three lines say so (the cap, and
    the study TOML's ``about``), not only the TOML's comment."""
    settings = TuneSettings.merge(flags={}, toml_path=str(DEMO))
    console, out = _console()
    reporter = RichReporter(console=console)
    reporter.begin(settings, already=0)
    reporter.end()
    lines = out.getvalue().splitlines()
    assert "study gpt-cpu" in lines[0] and "2 ranks on cpu" in lines[0]
    assert lines[1] == ("Emulated memory cap: 14.8 MiB per rank (14.1 MiB usable with 5% headroom; ranks run "
                        "under it): a trial over it is infeasible.")
    assert lines[2].startswith("This demo: the script's own configuration") and "does not fit" in lines[2]


def test_about_is_one_line() -> None:
    from autobalance._errors import UsageError

    with pytest.raises(UsageError, match=r"--about=.*one line of at most 300 characters"):
        TuneSettings(script=str(REPO / "examples" / "gpt" / "train.py"), about="two\nlines")


def test_a_baseline_that_does_not_fit_is_explained_once_it_ran() -> None:
    oom = {"status": "oom", "failing_rank": 0, "peak_device_gib": [0.0146, 0.0103], "usable_gib": [0.0138, 0.0138],
           "feasible": False}
    assert baseline_fit_note(oom, global_batch=16) == (
        "The script's own configuration does not fit in 14.1 MiB usable per rank (rank 0 ran out of memory): the "
        "study looks for one that does, with the same global batch of 16; without a baseline step time there is no "
        "speed-up to report.")
    over = {**oom, "status": "ok", "peak_device_gib": [0.0140, 0.0103], "step_time_ms": 120.0}
    assert "(over the usable limit (rank 0: 14.3 MiB > 14.1 MiB usable))" in (baseline_fit_note(over, global_batch=16)
                                                                                 or "")
    assert baseline_fit_note({**over, "feasible": True, "peak_device_gib": [0.01, 0.01]}, global_batch=16) is None


def test_the_comparison_says_why_there_is_no_speed_up() -> None:
    baseline = SimpleNamespace(number=0, user_attrs={"status": "oom", "feasible": False, "peak_device_gib": [0.0146, 0.0103],
                                                     "usable_gib": [0.0138, 0.0138]})
    best = SimpleNamespace(number=3, user_attrs={"status": "ok", "feasible": True, "peak_device_gib": [0.0105, 0.0092],
                                                 "spread_gib": 0.0013, "step_time_ms": 136.2})
    result = SimpleNamespace(baseline=baseline, best=best, trials_run=4, wall_s=30.0, study_name="gpt-cpu",
                             storage="sqlite:///autobalance.db", notes=[], saved=True)
    console, out = _console()
    print_result(result, settings=SimpleNamespace(script="train.py"), console=console)
    lines = out.getvalue().splitlines()
    under = lines[next(i for i, line in enumerate(lines) if line.startswith("└")) + 1]
    assert under == ("The script's own configuration does not fit (oom); the best does, with the same global batch: "
                     "no baseline step time, no speed-up.")
    result.baseline = best  # a baseline that fits: no such line
    console, out = _console()
    print_result(result, settings=SimpleNamespace(script="train.py"), console=console)
    assert "does not fit" not in out.getvalue() and "speed-up" in out.getvalue()


@pytest.mark.parametrize(("peaks", "usable", "expected"), [
    ([0.014, 0.009], [0.0138, 0.0138], "over the usable limit (rank 0: 14.3 MiB > 14.1 MiB usable)"),
    ([0.01381, 0.009], [0.0138, 0.0138], "over the usable limit (rank 0: 14.14 MiB > 14.13 MiB usable)"),
    ([15.7, 14.0], [15.2, 15.2], "over the usable limit (rank 0: 15.7 GiB > 15.2 GiB usable)"),
    ([15.7], [15.2], "over the usable limit (15.7 GiB > 15.2 GiB usable)"),
    ([10.0, 9.0], [15.2, 15.2], "over the --max-spread-gib limit (memory spread)"),
])
def test_over_limit_names_the_rank_and_the_limit(peaks, usable, expected) -> None:
    attrs = {"status": "ok", "feasible": False, "peak_device_gib": peaks, "usable_gib": usable}
    assert over_limit(attrs) == expected
    assert over_limit({**attrs, "feasible": True}) is None
    assert over_limit({**attrs, "status": "oom"}) is None  # the status says it already


def test_tunes_trial_line_shows_an_infeasible_ok_trial_as_over_the_limit() -> None:
    console, out = _console()
    reporter = RichReporter(console=console)
    over = SimpleNamespace(number=6, user_attrs={"status": "ok", "feasible": False, "peak_device_gib": [0.014, 0.0056],
                                                 "usable_gib": [0.0138, 0.0138], "spread_gib": 0.0084,
                                                 "step_time_ms": 301.7})
    fits = SimpleNamespace(number=7, user_attrs={**over.user_attrs, "feasible": True, "peak_device_gib": [0.0104, 0.0056]})
    reporter.finish(over, None)  # type: ignore[arg-type]
    reporter.finish(fits, None)  # type: ignore[arg-type]
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("  trial 6 ok, over the usable limit (rank 0: 14.3 MiB > 14.1 MiB usable)  peaks")
    assert lines[1].startswith("  trial 7 ok  peaks")


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory: pytest.TempPathFactory) -> str:
    db = tmp_path_factory.mktemp("newcomer") / "s.db"
    build_study(db)
    return f"sqlite:///{db}"


def test_trials_has_a_feasible_column(synthetic: str) -> None:
    """The synthetic GPU study's trial 3 peaked at 16.65 GiB over 15.2 usable and reads `ok`: its row
    says `no: over the usable limit`; feasible ones say `yes`, an OOM one `no`."""
    result = CliRunner().invoke(app, ["trials", "--study-name", "synthetic", "--storage", synthetic],
                                env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    header = next(line for line in result.output.splitlines() if "status" in line and "feasible" in line)
    assert header.index("status") < header.index("feasible") < header.index("configuration")
    rows = {int(m[1]): line for line in result.output.splitlines() if (m := re.match(r"\W*(\d+)\b", line))}
    assert "no: over the usable limit (rank 0: 16.6 GiB > 15.2 GiB usable)" in rows[OVER_CAP_FASTER_2]
    assert re.search(r"\bok\b.*\byes\b", rows[1]) and re.search(r"\boom\b.*\bno\b", rows[0])
    json_out = CliRunner().invoke(app, ["trials", "--study-name", "synthetic", "--storage", synthetic, "--json"])
    assert '"over_limit": "over the usable limit (rank 0: 16.6 GiB > 15.2 GiB usable)"' in json_out.output


def test_readme_commands_name_the_demos_study() -> None:
    """Copied from the README (or the pages it sends a newcomer to for the other commands and
    production) after the demo, a command must find its study (`gpt-cpu`); `gpt` exits 2."""
    readme = "\n".join((REPO / page).read_text() for page in ("README.md", "docs/commands.md", "docs/production.md"))
    word = r"([\w.:@+-]+)"
    names = (re.findall(r"--study-name[ =]" + word, readme) + re.findall(r"AUTOBALANCE_STUDY=" + word, readme)
             + re.findall(r'study="([^"]*)"', readme))
    assert len(names) >= 8 and set(names) == {"gpt-cpu"}, sorted(set(names))


def test_one_configuration_reads_the_same_everywhere(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 31: tune's output said `mb=[...]` or `rank 0: 2,2,1; ...` and `ckpt=[3, 1]` (counts),
    `best` said `[[0, 1, 2], [0]]` (indices). One notation now, with the block indices, in tune's
    trial line, `trials`, `best`, `export` and a production job's line."""
    import optuna
    import torch

    from autobalance import BalanceConfig
    from autobalance.runtime._choice import choose_config
    from autobalance.store import ConfigStore, current_fingerprint

    config = BalanceConfig.any_split(rank_samples=[5, 11], accumulation=3, checkpoint=[[0, 1, 2], [0]], dtype="bf16",
                                     bucket_cap_mb=4.0)
    notation = "rank 0: 2,2,1 ckpt 0-2; rank 1: 4,4,3 ckpt 0 | bf16 bucket=4MB"
    url = f"sqlite:///{tmp_path / 'n.db'}"
    study = optuna.create_study(study_name="n", storage=url)
    study.add_trial(optuna.trial.create_trial(
        value=1.0, user_attrs={"status": "ok", "feasible": True, "config": config.to_dict(),
                               "peak_device_gib": [1.0, 1.1], "usable_gib": [2.0, 2.0], "spread_gib": 0.1,
                               "step_time_ms": 10.0},
        system_attrs={"constraints": [-0.5]}))
    with ConfigStore(url=url) as store:
        store.save(study_name="n", trial_number=0, config=config, figures={},
                   fingerprint=current_fingerprint(device_type="cpu", world_size=2, nnodes=1), saved_by="test")

    console, out = _console()
    RichReporter(console=console).start(1, config)
    assert out.getvalue().strip() == f"trial 1 {notation} ..."
    runner = CliRunner()
    trials = runner.invoke(app, ["trials", "--study-name", "n", "--storage", url], env={"COLUMNS": "400"})
    assert notation in trials.output, trials.output
    best = runner.invoke(app, ["best", "--study-name", "n", "--storage", url], env={"COLUMNS": "400"})
    assert "rank 0: 2,2,1 ckpt 0-2" in best.output and "rank 1: 4,4,3 ckpt 0" in best.output, best.output
    assert "[[0, 1, 2], [0]]" not in best.output and "bf16 bucket=4MB" in best.output
    export = runner.invoke(app, ["export", "--study-name", "n", "--storage", url, "-o", str(tmp_path / "b.json")])
    assert f"It applies: {notation}" in export.output, export.output
    for name in ("AUTOBALANCE_STUDY", "AUTOBALANCE_STORAGE", "AUTOBALANCE_CONFIG_FILE", "AUTOBALANCE_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    capsys.readouterr()
    chosen, _ = choose_config(in_trial=False, defaults=config, config=None, config_file=None, study="n", storage=url,
                              on_mismatch="warn", device=torch.device("cpu"), world_size=2, cap_bytes=None)
    assert chosen == config
    assert capsys.readouterr().err.strip() == f"autobalance: using study n, trial 0 ({url}): {notation}"
