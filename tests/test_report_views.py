"""The report on a synthetic study (written through the tuner's recording, no torchrun): why the
chosen trial won, step time versus peak memory, the settings' and compile's effect, predicted
trials drawn as predictions, single-rank studies without spread."""

from __future__ import annotations

import html
import re
from pathlib import Path

import pytest

from autobalance.report import build_report
from autobalance.report._figures import (
    compile_figure,
    factors_figure,
    memory_figure,
    time_memory_figure,
)
from autobalance.report._html import config_rows
from autobalance.report._rows import summarize
from tests.synthetic_study import BEST_1, BEST_2, OVER_CAP_FASTER_2, build_study


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("views2")
    return build_study(root / "s.db", verified=BEST_2), root


@pytest.fixture(scope="module")
def one(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("views1")
    return build_study(root / "s.db", world_size=1), root


def _text(page: str) -> str:
    """The page's visible text, roughly (scripts and tags removed)."""
    page = re.sub(r"<script.*?</script>", " ", page, flags=re.S)
    return html.unescape(re.sub(r"<[^>]+>", " ", page))


def test_the_over_cap_trial_is_faster_but_not_the_best(two) -> None:
    study, _ = two
    summary = summarize(study)
    assert summary.best is not None and summary.best.number == BEST_2
    over = summary.rows[OVER_CAP_FASTER_2]
    assert over.step_ms < summary.best.step_ms and not over.feasible and over.outcome == "over limit (rank 0)"
    assert summary.rows[0].outcome == "OOM (rank 0)" and summary.rows[6].outcome == "OOM (rank 1)"
    assert summary.rows[5].outcome == "predicted OOM (not run)" and summary.rows[5].predicted


def test_why_this_one_names_the_excluded_faster_trial_headroom_and_verdict(two, tmp_path) -> None:
    study, _ = two
    files = build_report(study, output_html=str(tmp_path / "r.html"), storage_url="sqlite:///x.db")
    page = Path(files.html).read_text()
    why = html.unescape(re.search(r"<p id='why'>(.*?)</p>", page, flags=re.S).group(1))  # type: ignore[union-attr]
    assert why.startswith(f"Trial #{BEST_2} won")
    assert f"Faster trials excluded: #{OVER_CAP_FASTER_2} (128.0 ms) peaked at 16.6 GiB on rank 0, over the usable 15.2 GiB" in why
    assert "Headroom: its highest peak is 14.0 GiB on rank 0, 1.20 GiB (7.9%) under the usable 15.2 GiB" in why
    assert "#0 rank 0, #6 rank 1" in why and "predicted to run out and never run (#5)" in why
    assert "Verified: losses match" in why
    # "Use it" is filled in, the configuration is a readable table (no JSON)
    assert "AUTOBALANCE_STORAGE=sqlite:///x.db torchrun" in page
    cfg = re.search(r"<table class='cfg' id='best-config'>(.*?)</table>", page, flags=re.S).group(1)  # type: ignore[union-attr]
    assert "rank 0: 16,16; rank 1: 16,16" in cfg and "bf16 autocast" in cfg and "0.4 on every rank" in cfg
    assert "[[" not in cfg and "&quot;" not in cfg and '"' not in html.unescape(cfg).replace("'", "")
    for div in ("time-memory-chart", "factors-chart", "compile-chart", "memory-chart", "tradeoff-chart"):
        assert f'id="{div}"' in page, div
    assert "time in steps s" in page and "steps_s" not in _text(page)


def test_unverified_best_says_how_to_verify(tmp_path) -> None:
    study = build_study(tmp_path / "u.db")
    files = build_report(study, output_html=str(tmp_path / "r.html"))
    why = _text(Path(files.html).read_text())
    assert f"Not verified yet: autobalance verify SCRIPT --study-name synthetic --trial {BEST_2}" in why


def test_time_memory_figure_draws_ranks_limits_and_predictions_apart(two) -> None:
    study, _ = two
    summary = summarize(study)
    fig = time_memory_figure(summary)
    by_name = {t.name: t for t in fig.data if t.name}
    # rank markers are measurements only: the predicted trial (#5) and the OOMs are not among them
    measured_points = sum(len(by_name[n].x) for n in ("rank 0", "rank 1", "rank 0 (trial over the limit)", "rank 1 (trial over the limit)"))
    assert measured_points == 2 * sum(r.step_ms is not None for r in summary.rows)
    assert list(by_name["rank 0 (trial over the limit)"].text) == [f"#{OVER_CAP_FASTER_2}"]
    predicted = by_name["predicted OOM (not run; predicted peak)"]
    assert list(predicted.text) == ["#5"] and predicted.marker.symbol == "triangle-up-open"
    assert sorted(by_name["OOM / no step time (peak is a lower bound)"].text) == ["#0", "#6"]
    assert by_name[f"chosen #{BEST_2}"].y == (139.0,)
    lines = {s.x0 for s in fig.layout.shapes}
    assert lines == {16.0, 15.2}  # the capacity and the usable limit


def test_memory_bars_of_a_predicted_trial_are_pale_and_hatched(two) -> None:
    summary = summarize(two[0])
    bars = next(t for t in memory_figure(summary).data if t.name == "rank 0")
    i = list(bars.x).index("#5")
    assert bars.marker.opacity[i] < 0.5 and bars.marker.pattern.shape[i] == "/"
    assert "prediction" in bars.customdata[i][0]


def test_memory_figure_draws_no_bar_for_a_rank_without_a_peak(two) -> None:
    """Fails if the memory chart draws a bar (an empty slot, or a zero) for a rank whose peak is None
    (the predicted trial #5's rank 1; in a real study, a rank killed before its report): its bars
    are then one more than the peaks reported, the chart off by one of issue 22 (``10 == 9``)."""
    study, _ = two
    bars = {t.name: t for t in memory_figure(summarize(study)).data if t.type == "bar"}
    assert sorted(bars) == ["rank 0", "rank 1"]
    assert "#5" in bars["rank 0"].x and "#5" not in bars["rank 1"].x
    assert all(y is not None and y > 0 for t in bars.values() for y in t.y)
    reported = sum(p is not None for t in study.get_trials() for p in t.user_attrs["peak_device_gib"])
    assert sum(len(t.x) for t in bars.values()) == reported == 15
    for t in bars.values():  # each bar's hatch, opacity and hover belong to its own trial
        assert len(t.y) == len(t.marker.opacity) == len(t.marker.pattern.shape) == len(t.customdata) == len(t.x)
        assert [c[0] for c in t.customdata][list(t.x).index("#3")] == "over limit (rank 0)"


def test_factors_and_compile_figures(two) -> None:
    summary = summarize(two[0])
    factors = factors_figure(summary)
    assert factors is not None
    titles = [a.text for a in factors.layout.annotations]
    assert {"dtype", "compile", "activation budget", "micro-batch"} <= set(titles)
    comp = compile_figure(summary)
    assert comp is not None
    xs = {x for t in comp.data for x in t.x}
    assert xs == {"#2", "#3", "#4"}
    assert "70 s over 3 compiled trial(s)" in comp.layout.title.text


def test_single_rank_study_has_no_spread(one, tmp_path) -> None:
    study, _ = one
    summary = summarize(study)
    assert summary.world_size == 1 and not summary.multi_rank and summary.best.number == BEST_1
    files = build_report(study, output_html=str(tmp_path / "r.html"), png_dir=str(tmp_path / "png"))
    page = Path(files.html).read_text()
    text = _text(page)
    assert 'id="tradeoff-chart"' not in page and 'id="time-memory-chart"' in page
    assert "spread" not in text.replace("spread_plus_time", "")
    assert "rank 0 peak" not in text and "peak" in text  # one rank: "peak", not "rank 0 peak"
    names = sorted(Path(p).name for p in files.pngs)
    assert "tradeoff.png" not in names and "time_memory.png" in names
    why = html.unescape(re.search(r"<p id='why'>(.*?)</p>", page, flags=re.S).group(1))  # type: ignore[union-attr]
    assert "the shortest step time" in why and "#2 (150.0 ms) peaked at 16.2 GiB, over the usable 15.2 GiB" in why


def test_pngs_of_the_report(two, tmp_path) -> None:
    files = build_report(two[0], output_html=str(tmp_path / "r.html"), png_dir=str(tmp_path / "png"))
    names = sorted(Path(p).name for p in files.pngs)
    assert {"memory.png", "time_memory.png", "factors.png", "compile.png", "tradeoff.png"} <= set(names)
    for p in files.pngs:
        assert Path(p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_config_rows_are_readable() -> None:
    rows = dict(config_rows({"micro_batches": [12, 20], "accumulation": 2, "global_batch": 64,
                             "checkpoint": [[0, 1], []], "dtype": "fp16", "bucket_cap_mb": 25.0,
                             "gradient_as_bucket_view": True, "compile": "off", "activation_budget": None}))
    assert rows["micro-batches per optimizer step"] == "rank 0: 12,12; rank 1: 20,20"  # the notation of every output
    assert rows["checkpointed blocks (indices)"] == "rank 0: 0-1, rank 1: none"
    assert rows["precision"] == "fp16 autocast with a GradScaler"
    assert rows["torch.compile"] == "off (eager)" and "activation memory budget" not in rows
    assert rows["DDP gradient_as_bucket_view"] == "yes"
