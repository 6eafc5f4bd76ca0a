"""What a newcomer reads in the figures (issue 31, items 7, 8, 10), from the user's side and without
torchrun: a speed-up is claimed only beyond the steps' variation (tune's summary, the report), tiny
memory figures read in MiB/KiB and never ``0.000 GiB`` (tune's log, ``trials``, the summary, the
report), and a study whose best was not saved says so and gives no "Use it" line (tune's summary,
``autobalance report`` and its HTML)."""

from __future__ import annotations

import io
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import optuna
import pytest
from rich.console import Console
from typer.testing import CliRunner

from autobalance.cli import app
from autobalance.cli._views import comparison_table, print_result
from autobalance.protocol import StudyAttr, memory_text, speed_up
from autobalance.tuner._reporter import RichReporter

CONFIG = {"micro_batches": [4, 3], "accumulation": 1, "global_batch": 7, "dtype": "fp32",
          "checkpoint": [[], []], "bucket_cap_mb": 25.0, "gradient_as_bucket_view": False}
SWAPPED = {**CONFIG, "micro_batches": [3, 4]}
KIB = 1 / 1024**2


def _attrs(*, step_ms: float, iqr_pct: float | None, config: dict[str, Any], baseline: bool = False) -> dict[str, Any]:
    """A measured, feasible trial of the MLP example: peaks of a few hundred KiB."""
    attrs = {"status": "ok", "feasible": True, "config": config, "peak_device_gib": [310 * KIB, 280 * KIB],
             "usable_gib": [15.2, 15.2], "capacity_gib": [16.0, 16.0], "spread_gib": 30 * KIB,
             "step_time_ms": step_ms, "measured_steps": 3, "baseline": baseline}
    if iqr_pct is not None:
        attrs["step_time_iqr_pct"] = iqr_pct
    return attrs


def _console() -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, width=400, force_terminal=False, color_system=None), out


def _table_text(baseline: Any, best: Any, **kw: Any) -> str:
    console, out = _console()
    console.print(comparison_table(baseline, best, **kw))
    return out.getvalue()


# item 7: a speed-up claimed from noise


def test_the_rule_claims_a_speed_up_only_when_the_intervals_separate() -> None:
    """Each step time +- its IQR; a speed-up only when the baseline's interval lies above the best's."""
    noisy = speed_up(baseline_ms=433.0, baseline_iqr_pct=40.0, best_ms=100.0, best_iqr_pct=570.0)
    assert not noisy.supported and noisy.text().startswith("within noise (4.33x measured, ")
    clear = speed_up(baseline_ms=150.0, baseline_iqr_pct=2.0, best_ms=100.0, best_iqr_pct=3.0)
    assert clear.supported and clear.text() == "1.50x (1.43-1.58x)"  # 147/103 to 153/97
    touching = speed_up(baseline_ms=120.0, baseline_iqr_pct=10.0, best_ms=100.0, best_iqr_pct=10.0)
    assert not touching.supported  # 108-132 ms vs 90-110 ms overlap
    unknown = speed_up(baseline_ms=150.0, baseline_iqr_pct=None, best_ms=100.0, best_iqr_pct=3.0)
    assert not unknown.known and unknown.text() == "1.50x (step-to-step variation not recorded)"


def test_tunes_summary_says_within_noise_for_the_mlp_swap() -> None:
    """Issue 31: swapping [4,3] to [3,4] read "4.33x" with steps spread 40-570 % of the median."""
    baseline = SimpleNamespace(number=0, user_attrs=_attrs(step_ms=433.0, iqr_pct=40.0, config=CONFIG, baseline=True))
    best = SimpleNamespace(number=4, user_attrs=_attrs(step_ms=100.0, iqr_pct=570.0, config=SWAPPED))
    row = next(line for line in _table_text(baseline, best).splitlines() if "speed-up" in line)
    assert "within noise (4.33x measured" in row and "4.33x (" not in row
    best.user_attrs["step_time_iqr_pct"] = 1.0
    baseline.user_attrs["step_time_iqr_pct"] = 1.0
    row = next(line for line in _table_text(baseline, best).splitlines() if "speed-up" in line)
    assert "4.33x (4.24-4.42x)" in row and "noise" not in row


# item 8: tiny peaks print as 0.000 GiB


@pytest.mark.parametrize(("gib", "text"), [
    (15.7, "15.7 GiB"), (139.8, "140 GiB"), (0.0145, "14.8 MiB"), (0.0138, "14.1 MiB"), (310 * KIB, "310 KiB"),
    (1000 / 1024, "1000 MiB"), (5e-7, "537 B"), (None, "-"),
])
def test_memory_text_chooses_the_unit_by_size(gib: float | None, text: str) -> None:
    assert memory_text(gib) == text


def test_tiny_peaks_never_read_zero_gib(tmp_path: Path) -> None:
    """The MLP example's peaks (a few hundred KiB) in tune's trial line, the summary and ``trials``."""
    console, out = _console()
    trial = SimpleNamespace(number=1, user_attrs=_attrs(step_ms=10.0, iqr_pct=1.0, config=CONFIG))
    RichReporter(console=console).finish(trial, None)  # type: ignore[arg-type]
    line = out.getvalue()
    assert "peaks [r0=310 KiB r1=280 KiB]  spread 30.0 KiB" in line, line
    baseline = SimpleNamespace(number=0, user_attrs=_attrs(step_ms=12.0, iqr_pct=1.0, config=CONFIG, baseline=True))
    table = _table_text(baseline, trial)
    assert "310 KiB" in table and "30.0 KiB" in table and "0.000" not in table
    url = _study(tmp_path, verdict=None)
    trials = CliRunner().invoke(app, ["trials", "--study-name", "s", "--storage", url], env={"COLUMNS": "400"})
    assert trials.exit_code == 0, trials.output
    assert "310 KiB 280 KiB" in trials.output and "0.000" not in trials.output and " 0 GiB" not in trials.output


# item 10: a study that saved nothing


def _study(tmp_path: Path, *, verdict: dict[str, Any] | None) -> str:
    """Baseline #0 and a faster #1 (the best), as tune records them; ``verdict``: #1's verification."""
    url = f"sqlite:///{tmp_path / 's.db'}"
    study = optuna.create_study(study_name="s", storage=url)
    for number, (value, attrs) in enumerate([
        (1.2, _attrs(step_ms=433.0, iqr_pct=40.0, config=CONFIG, baseline=True)),
        (1.0, _attrs(step_ms=100.0, iqr_pct=570.0, config=SWAPPED)),
    ]):
        study.add_trial(optuna.trial.create_trial(value=value, user_attrs=attrs, system_attrs={"constraints": [-0.5]}))
        assert study.trials[-1].number == number
    study.set_user_attr(StudyAttr.BASELINE, 0)
    if verdict is not None:
        study.set_user_attr(f"{StudyAttr.VERIFY_PREFIX}1", verdict)
    return url


def test_tunes_summary_of_a_best_that_failed_verification_has_no_use_it_line() -> None:
    baseline = SimpleNamespace(number=0, user_attrs=_attrs(step_ms=433.0, iqr_pct=40.0, config=CONFIG, baseline=True))
    best = SimpleNamespace(number=1, user_attrs=_attrs(step_ms=100.0, iqr_pct=570.0, config=SWAPPED))
    result = SimpleNamespace(baseline=baseline, best=best, trials_run=2, wall_s=5.0, study_name="s",
                             storage="sqlite:///autobalance.db", notes=[], saved=False)
    console, out = _console()
    print_result(result, settings=SimpleNamespace(script="train.py"), console=console, rejected=[1])
    text = out.getvalue()
    assert "best measured (not saved: failed verification) #1" in text
    assert "Best measured (not saved: failed verification): trial 1" in text
    assert "Use it" not in text and "AUTOBALANCE_STUDY" not in text


def test_the_report_of_a_study_that_saved_nothing(tmp_path: Path) -> None:
    """``autobalance report``: its line and the HTML say "Best measured (not saved: failed verification)";
    no "Use it:" line (loading it in production would run the script's own configuration)."""
    url = _study(tmp_path, verdict={"passed": False, "reason": "gradients differ by 3.1e-1"})
    out = tmp_path / "r.html"
    result = CliRunner().invoke(app, ["report", "--study-name", "s", "--storage", url, "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert "Best measured: trial 1 (not saved: failed verification)" in result.output
    page = out.read_text()
    assert "<h2 id='best-heading'>Best measured (not saved: failed verification)</h2>" in page
    assert "Use it:" not in page and "Chosen configuration" not in page
    assert "within noise (4.33x measured" in re.sub(r"\s+", " ", page)


def test_the_report_of_a_saved_best_keeps_its_use_it_line(tmp_path: Path) -> None:
    import torch  # noqa: F401  (the store's fingerprint reads the device)

    from autobalance import BalanceConfig
    from autobalance.store import ConfigStore, current_fingerprint

    url = _study(tmp_path, verdict={"passed": True, "reason": "within the bound"})
    with ConfigStore(url=url) as store:
        store.save(study_name="s", trial_number=1, config=BalanceConfig.from_dict(SWAPPED), figures={},
                   fingerprint=current_fingerprint(device_type="cpu", world_size=2, nnodes=1), saved_by="test")
    out = tmp_path / "r.html"
    result = CliRunner().invoke(app, ["report", "--study-name", "s", "--storage", url, "-o", str(out)])
    assert result.exit_code == 0 and "not saved" not in result.output, result.output
    page = out.read_text()
    assert "Chosen configuration" in page and "Use it:" in page and "not saved" not in page


def test_best_shows_the_saved_speed_up_and_peaks_as_the_summary_does(tmp_path: Path) -> None:
    """``autobalance best`` printed the stored ratio (4.3333) and peaks as GiB floats."""
    from autobalance import BalanceConfig
    from autobalance.store import ConfigStore, current_fingerprint
    from autobalance.tuner._verify import figures_of_trial

    url = _study(tmp_path, verdict={"passed": True, "reason": "within the bound"})
    study = optuna.load_study(study_name="s", storage=url)
    with ConfigStore(url=url) as store:
        store.save(study_name="s", trial_number=1, config=BalanceConfig.from_dict(SWAPPED),
                   figures=figures_of_trial(study, study.trials[1]),
                   fingerprint=current_fingerprint(device_type="cpu", world_size=2, nnodes=1), saved_by="test")
    best = CliRunner().invoke(app, ["best", "--study-name", "s", "--storage", url], env={"COLUMNS": "400"})
    assert best.exit_code == 0, best.output
    assert "within noise (4.33x measured" in best.output and "4.3333" not in best.output
    rows = {line.split("│")[1].strip(): line.split("│")[2].strip() for line in best.output.splitlines()
            if line.startswith("│") and line.split("│")[1].strip()}
    assert rows["rank 0 peak"] == "310 KiB" and rows["rank 1 peak"] == "280 KiB" and rows["spread"] == "30.0 KiB"
