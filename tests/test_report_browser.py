"""The report file and optuna-dashboard loaded in headless Chromium: the DOM after JavaScript ran.

Needs Debian's chromium and chromium-driver (apt-get install -y chromium chromium-driver) and
selenium; skipped, naming what is missing, without them. Set AUTOBALANCE_UPDATE_SCREENSHOTS=1 to
refresh docs/report.png and docs/dashboard.png.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from autobalance.report import dashboard_app
from autobalance.tuner import best_trial
from tests.report_helpers import (
    STUDY,
    SmallStudy,
    WsgiServer,
    make_small_study,
    screenshot_path,
    start_chrome,
    wait_for,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def chrome() -> Iterator[Any]:
    with start_chrome() as driver:
        yield driver


@pytest.fixture(scope="module")
def small_study(tmp_path_factory: pytest.TempPathFactory) -> SmallStudy:
    return make_small_study(tmp_path_factory)

_CHART_STATS = """
return [...document.querySelectorAll('.js-plotly-plot')].map(el => ({
  id: el.id,
  traces: (el.data || []).length,
  bars: el.querySelectorAll('.barlayer .trace .point').length,
  markers: el.querySelectorAll('.scatterlayer .trace .point').length,
  lines: el.querySelectorAll('.scatterlayer .trace path.js-line').length,
  texts: [...el.querySelectorAll('text')].map(t => t.textContent),
}));
"""


def test_report_shows_its_charts_with_data(chrome, small_study: SmallStudy, tmp_path, repo) -> None:
    study = small_study.study()
    chrome.get(small_study.html.as_uri())
    wait_for(chrome, lambda d: d.execute_script(
        "return document.querySelectorAll('.js-plotly-plot .main-svg').length >= 4"))
    charts = {c["id"]: c for c in chrome.execute_script(_CHART_STATS)}
    assert {"memory-chart", "tradeoff-chart"} <= set(charts)

    # one bar per rank and trial that measured a peak (the OOM baseline's lower bound included)
    expected_bars = sum(p is not None for t in study.get_trials() for p in t.user_attrs["peak_device_gib"])
    memory = charts["memory-chart"]
    assert memory["bars"] == expected_bars > 0
    assert "OOM" in memory["texts"]  # the capped baseline is marked
    assert {"rank 0", "rank 1", "capacity"} <= set(memory["texts"])  # legend entries

    tradeoff = charts["tradeoff-chart"]
    measured = [t for t in study.get_trials() if t.user_attrs.get("status") == "ok"]
    assert tradeoff["markers"] >= len(measured) > 0
    assert "Pareto front" in tradeoff["texts"]
    assert any(t.startswith("chosen #") for t in tradeoff["texts"])  # the best configuration highlighted

    if "importance-chart" in charts:
        assert charts["importance-chart"]["bars"] > 0
    else:
        assert chrome.find_element("id", "importance-note").text.startswith("Parameter importances")

    body = chrome.find_element("tag name", "body").text
    assert "Baseline versus best" in body and "baseline #0 (baseline)" in body
    assert "micro_batches" in chrome.find_element("id", "best-config").text
    chrome.save_screenshot(str(screenshot_path(repo, "report.png", tmp_path)))


def test_dashboard_lists_the_study_and_shows_per_rank_attributes_and_the_artifact(
    chrome, small_study: SmallStudy, tmp_path, repo
) -> None:
    study = small_study.study()
    best = best_trial(study)
    assert best is not None
    with WsgiServer(dashboard_app(small_study.url)) as server:
        chrome.get(server.url + "/dashboard")
        link = wait_for(chrome, lambda d: next(
            (a for a in d.find_elements("tag name", "a")
             if STUDY in a.text and "/dashboard/studies/" in (a.get_attribute("href") or "")), None))
        href = link.get_attribute("href")
        assert href.rstrip("/").endswith(f"/dashboard/studies/{study._study_id}")

        chrome.get(f"{server.url}/dashboard/studies/{study._study_id}/trials?numbers={best.number}")
        artifact = f"memory-per-rank-trial{best.number:04d}.png"
        wait_for(chrome, lambda d: artifact in d.find_element("tag name", "body").text)
        body = chrome.find_element("tag name", "body").text
        for attr in ("peak_device_gib", "capacity_gib", "spread_gib", "step_time_ms", "memory_constraint"):
            assert attr in body, attr
        assert f"Trial {best.number}" in body
        # the artifact's image is shown and actually loaded
        img = wait_for(chrome, lambda d: next(
            (i for i in d.find_elements("tag name", "img") if "/artifacts/" in (i.get_attribute("src") or "")
             and d.execute_script("return arguments[0].complete && arguments[0].naturalWidth > 0", i)), None))
        with urllib.request.urlopen(img.get_attribute("src"), timeout=10) as resp:
            assert resp.read(8) == b"\x89PNG\r\n\x1a\n"
        chrome.save_screenshot(str(screenshot_path(repo, "dashboard.png", tmp_path)))
