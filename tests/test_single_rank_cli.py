"""A one-rank study has no spread (max - min over ranks is always 0): the CLI shows none, as the
report does (``test_single_rank_study_has_no_spread``); a two-rank study keeps it. Synthetic
studies (tests/synthetic_study.py), nothing runs."""

from __future__ import annotations

import io
from types import SimpleNamespace

import pytest
from rich.console import Console

from autobalance.cli._tune import interrupted_message
from autobalance.cli._views import comparison_table, print_saved, print_studies, print_trials
from autobalance.protocol import best_trial, memory_text, study_ranks
from autobalance.tuner import RichReporter
from autobalance.tuner._reporter import short_figures
from tests.synthetic_study import BEST_1, BEST_2, build_study


@pytest.fixture(scope="module")
def studies(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("ranks")
    one = build_study(root / "one.db", world_size=1, name="one")
    two = build_study(root / "two.db", world_size=2, name="two")
    return one, two, root


def _text(renderable) -> str:
    out = Console(file=io.StringIO(), width=300)
    out.print(renderable)
    return out.file.getvalue()  # type: ignore[attr-defined]


def _reporter_lines(study) -> str:
    buf = io.StringIO()
    reporter = RichReporter(console=Console(file=buf, width=300))
    best = best_trial(study)
    for t in study.trials:
        reporter.finish(t, best)
    return buf.getvalue() + reporter._best_text


def test_the_synthetic_studies_have_one_and_two_ranks(studies) -> None:
    one, two, _ = studies
    assert study_ranks(one) == 1 and study_ranks(two) == 2
    assert best_trial(one).number == BEST_1 and best_trial(two).number == BEST_2
    assert one.trials[BEST_1].user_attrs["spread_gib"] == 0  # recorded, but means nothing with one rank


def test_trials_table_of_one_rank_has_no_spread(studies, capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("COLUMNS", raising=False)  # output into a pipe (pytest-xdist's workers set COLUMNS=80)
    root = studies[2]
    print_trials(study_name="one", storage=f"sqlite:///{root / 'one.db'}", as_json=False)
    out = capsys.readouterr().out
    assert "spread" not in out and "peak" in out and "per rank" not in out
    print_trials(study_name="two", storage=f"sqlite:///{root / 'two.db'}", as_json=False)
    out = capsys.readouterr().out
    assert "spread" in out and "peak per rank" in out


def test_studies_table_shows_spread_only_for_a_study_of_several_ranks(studies, capsys) -> None:
    _, two, root = studies
    print_studies(f"sqlite:///{root / 'one.db'}")
    out = capsys.readouterr().out
    assert "one" in out and "spread" not in out
    # one storage holding both: the column is there, the one-rank study's cell is "-"
    import optuna

    both = f"sqlite:///{root / 'both.db'}"
    optuna.copy_study(from_study_name="one", from_storage=f"sqlite:///{root / 'one.db'}", to_storage=both)
    optuna.copy_study(from_study_name="two", from_storage=f"sqlite:///{root / 'two.db'}", to_storage=both)
    print_studies(both)
    lines = capsys.readouterr().out.splitlines()
    assert any("best spread" in line for line in lines)
    row_one = next(line for line in lines if line.strip("│ ").startswith("one "))
    assert row_one.rstrip(" │").endswith("-")
    row_two = next(line for line in lines if line.strip("│ ").startswith("two "))
    assert memory_text(two.trials[BEST_2].user_attrs['spread_gib']) in row_two


def test_baseline_vs_best_of_one_rank_has_no_spread(studies) -> None:
    one, two, _ = studies
    text = _text(comparison_table(one.trials[0], one.trials[BEST_1]))
    assert "spread" not in text and "rank 0 peak" not in text and "peak" in text and "speed-up" in text
    text = _text(comparison_table(two.trials[1], two.trials[BEST_2]))
    assert "spread" in text and "rank 1 peak" in text


def test_progress_lines_of_one_rank_have_no_spread(studies) -> None:
    one, two, _ = studies
    lines = _reporter_lines(one)
    assert "spread" not in lines and f"best #{BEST_1}: 180.0 ms" in lines
    assert "spread" not in short_figures(one.trials[BEST_1])
    assert "spread" in _reporter_lines(two) and "spread" in short_figures(two.trials[BEST_2])


def test_interrupt_message_of_one_rank_has_no_spread(studies) -> None:
    root = studies[2]
    message = interrupted_message(SimpleNamespace(study_name="one", storage=f"sqlite:///{root / 'one.db'}"))
    assert f"Best so far: trial {BEST_1}" in message and "spread" not in message
    message = interrupted_message(SimpleNamespace(study_name="two", storage=f"sqlite:///{root / 'two.db'}"))
    assert f"Best so far: trial {BEST_2}" in message and "spread" in message


def test_saved_best_of_one_rank_has_no_spread(capsys) -> None:
    from autobalance._config import BalanceConfig

    def saved(world: int) -> SimpleNamespace:
        config = BalanceConfig(micro_batches=[8] * world, accumulation=1, global_batch=8 * world)
        return SimpleNamespace(
            to_dict=dict, study_name="s", trial_number=1, config=config, created_at="now", saved_by="me",
            figures={"peak_device_gib": [1.0] * world, "spread_gib": 0.0 if world == 1 else 0.2, "step_time_ms": 5.0},
            fingerprint=SimpleNamespace(world_size=world, device_name="GPU", device_type="cuda"))

    print_saved(saved(1), fmt="table")
    assert "spread" not in capsys.readouterr().out
    print_saved(saved(2), fmt="table")
    assert "spread" in capsys.readouterr().out
