"""A trial's console line never cuts its reason inside a word (it ends with ``...`` at a word boundary,
said once where the whole text is), and ``autobalance trials`` prints every reason whole."""

from __future__ import annotations

import random
import re
from pathlib import Path

import optuna
import pytest
from rich.console import Console
from typer.testing import CliRunner

from autobalance.cli import app
from autobalance.tuner import RichReporter
from autobalance.tuner._reporter import REASON_CHARS, clip_words

REASON = ("not launched: rank 0 would run out of memory: trial 14 exceeded rank 0's usable memory (14.3 MiB > 14.1 MiB "
          "usable) and this configuration needs at least as much there (same dtype, no fewer samples and no more "
          "recomputation on that rank)")


def test_the_reason_is_long_enough_that_a_plain_cut_lands_inside_a_word() -> None:
    assert len(REASON) > REASON_CHARS
    assert REASON[REASON_CHARS - 1].isalnum() and REASON[REASON_CHARS].isalnum()  # text[:160] cut "muc|h"


@pytest.mark.parametrize("seed", range(20))
def test_clip_words_never_cuts_a_word(seed: int) -> None:
    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefgh") for _ in range(rng.randint(1, 14))) for _ in range(rng.randint(1, 60))]
    text = " ".join(words)
    limit = rng.randint(10, 120)
    clipped = clip_words(text, limit)
    if len(text) <= limit:
        assert clipped == text
        return
    assert clipped.endswith(" ...")
    kept = clipped[:-4].split(" ")
    assert kept == words[:len(kept)]  # whole words, in order
    if len(words[0]) <= limit - 4:
        assert len(clipped) <= limit


def _trial(reason: str) -> optuna.trial.FrozenTrial:
    return optuna.trial.create_trial(value=1.0, user_attrs={"status": "predicted_oom", "reason": reason,
                                                            "peak_device_gib": [0.014, 0.012]})


def test_the_console_line_ends_at_a_word_and_says_where_the_rest_is() -> None:
    out = Console(record=True, width=1000, force_terminal=False)
    reporter = RichReporter(console=out)
    reporter._study_name = "work-adopted"
    reporter.finish(_trial(REASON), None, predicted=True)
    reporter.finish(_trial(REASON + " again"), None, predicted=True)
    lines = out.export_text().splitlines()
    first = lines[0]
    shown = first[first.index("  not launched:") + 2:]
    assert shown.endswith(" ...") and REASON.startswith(shown[:-4])
    assert REASON[len(shown) - 4] == " "  # the cut is at a space: the word before it is whole
    notes = [line for line in lines if "reads whole in" in line]
    assert notes == ["  (a reason cut with ... reads whole in `autobalance trials --study-name work-adopted`)"]


def test_trials_prints_each_reason_whole(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'ab.db'}"
    study = optuna.create_study(study_name="s", storage=url)
    study.add_trial(_trial(REASON))
    study.add_trial(optuna.trial.create_trial(value=0.5, user_attrs={"status": "ok", "reason": "all ranks finished"}))
    result = CliRunner().invoke(app, ["trials", "--study-name", "s", "--storage", url], env={"COLUMNS": "100"})
    assert result.exit_code == 0, result.output
    text = " ".join(result.stdout.split())
    assert f"trial 0 (predicted_oom): {REASON}" in text
    assert not re.search(r"trial 1 \(ok\)", text)
