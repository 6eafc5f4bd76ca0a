"""Issues 33 and 34, what the user sees: each rank's busy time and its wait for the other ranks (the imbalance of
time next to that of memory) and each rank's optimizer state (what moved where with zero1) in the
report and ``autobalance trials``; studies from before these were measured render as before.

A synthetic study written through the tuner's own recording (no torchrun): the baseline splits 16/16
and rank 1 is about twice as slow per sample, every rank keeping the whole optimizer state; the
other trial gives rank 1 fewer samples and rank 0 the smaller zero1 share.
"""

from __future__ import annotations

import html
import re
from pathlib import Path

import pytest

from autobalance.protocol import busy_wait_text, slow_rank
from autobalance.report import build_report
from tests.synthetic_study import Spec, build_study
from tests.tune_helpers import cli

SPECS = [
    Spec(status="ok", micro=[16, 16], acc=1, dtype="fp32", peaks_gib=[12.0, 10.0], step_ms=330.0,
         busy_ms=[150.0, 320.0], wait_ms=[175.0, 5.0], optimizer_mib=[24.0, 24.0]),
    Spec(status="ok", samples=[22, 10], acc=1, dtype="fp32", peaks_gib=[11.0, 11.1], step_ms=230.0,
         busy_ms=[215.0, 208.0], wait_ms=[9.0, 12.0], optimizer_mib=[4.8, 19.2], optimizer_shares=[0.2, 0.8]),
]


def _text(page: str) -> str:
    page = re.sub(r"<script.*?</script>", " ", page, flags=re.S)
    return re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", " ", page)))


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("rank_views")
    build_study(root / "s.db", specs=SPECS)
    return root, root / "s.db"


def test_slow_rank_rule_and_busy_wait_notation() -> None:
    slow = slow_rank([150.0, 320.0], [16, 16])
    assert slow is not None and (slow.rank, slow.fastest) == (1, 0) and slow.ratio == pytest.approx(320 / 150)
    assert slow.text() == "rank 1 is 2.13x slower per sample than rank 0 (busy 20 vs 9.38 ms per sample)"
    assert slow_rank([215.0, 208.0], [22, 10]) is not None  # per sample: rank 1 is 2.1x slower
    assert slow_rank([100.0, 115.0], [16, 16]) is None  # within 1.2x
    assert slow_rank([100.0, None], [16, 16]) is None
    assert busy_wait_text([150.0, 320.0], [175.0, 5.0]) == "150/175 320/5"
    assert busy_wait_text([], []) == "-"


def test_report_shows_time_and_optimizer_state_per_rank(mixed, tmp_path: Path) -> None:
    _root, db = mixed
    import optuna

    study = optuna.load_study(study_name="synthetic", storage=f"sqlite:///{db}")
    page = Path(build_report(study, output_html=str(tmp_path / "r.html")).html).read_text()
    text = _text(page)
    # the best trial's time per rank, the slow rank named with its figures
    assert ("Time per rank (busy / wait for the other ranks, ms per step): rank 0: 215 / 9, rank 1: 208 / 12. "
            "rank 1 is 2.13x slower per sample than rank 0 (busy 20.8 vs 9.77 ms per sample).") in text
    # baseline versus best: optimizer state as its own part of each rank's memory; what zero1 moved where
    assert "rank 0 optimizer state 24.0 MiB 4.80 MiB (zero1: its share)" in text
    assert "rank 1 optimizer state 24.0 MiB 19.2 MiB (zero1: its share)" in text
    assert "rank 0 busy / wait for the other ranks (ms) 150 / 175 215 / 9" in text
    assert "rank 1 busy / wait for the other ranks (ms) 320 / 5 208 / 12" in text
    # all trials: the two columns
    assert "optimizer state per rank" in text and "busy/wait ms per rank" in text
    assert "24.0 MiB 24.0 MiB" in text and "zero1: 4.80 MiB 19.2 MiB" in text
    assert "150/175 320/5" in text and "215/9 208/12" in text


def test_report_of_a_study_from_before_has_no_time_or_optimizer_rows(tmp_path: Path) -> None:
    study = build_study(tmp_path / "old.db")  # the synthetic GPU study: no busy times, no optimizer section
    text = _text(Path(build_report(study, output_html=str(tmp_path / "r.html")).html).read_text())
    for absent in ("optimizer state", "busy", "wait for the other ranks", "Time per rank"):
        assert absent not in text, absent
    assert "peak per rank" in text and "rank 0 peak" in text


def test_trials_shows_optimizer_state_and_busy_wait_per_rank(mixed) -> None:
    root, db = mixed
    proc = cli(["trials", "--study-name", "synthetic", "--storage", f"sqlite:///{db}"], cwd=root, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    for text in ("optimizer state per rank", "busy/wait ms per rank", "24.0 MiB 24.0 MiB", "zero1: 4.80 MiB 19.2 MiB",
                 "150/175 320/5", "215/9 208/12", "the rank that waits least is the slowest"):
        assert text in out, (text, out)


def test_trials_of_a_study_from_before_render_as_before(tmp_path: Path) -> None:
    build_study(tmp_path / "old.db")
    proc = cli(["trials", "--study-name", "synthetic", "--storage", f"sqlite:///{tmp_path / 'old.db'}"], cwd=tmp_path,
               timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "peak per rank" in proc.stdout
    for absent in ("optimizer state", "busy/wait", "all-reduce"):
        assert absent not in proc.stdout, absent
