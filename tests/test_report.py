"""`autobalance report`, the per-trial memory artifacts and `autobalance dashboard`, on a real CPU study."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request

import optuna
import pytest

from autobalance.report import artifact_dir_for, pareto_front
from autobalance.report._rows import TrialRow
from tests.report_helpers import STUDY, TRIALS, SmallStudy, make_small_study
from tests.tune_helpers import assert_saved_split_is_uneven_and_fits, cli

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def small_study(tmp_path_factory: pytest.TempPathFactory) -> SmallStudy:
    return make_small_study(tmp_path_factory)


def test_report_is_one_offline_html_file_with_the_charts_and_tables(small_study: SmallStudy) -> None:
    text = small_study.html.read_text()
    assert "Wrote" in small_study.report_stdout
    assert len(text) > 2_000_000  # plotly.js is embedded, not fetched
    assert re.findall(r"<script[^>]*\ssrc=", text) == []  # nothing loaded from elsewhere
    for marker in ('id="memory-chart"', 'id="tradeoff-chart"', "id='best-config'", "Baseline versus best",
                   "Chosen configuration", "id='trials'"):
        assert marker in text, marker
    assert '"name":"rank 0"' in text and '"name":"rank 1"' in text
    assert '"name":"OOM ' in text  # the capped baseline ran out of memory
    assert '"name":"Pareto front"' not in text  # one objective: no front of spread and time (issue 43)
    assert '"peak device memory (MiB)"' in text  # the demo-sized peaks read in the unit the text uses
    assert ('id="importance-chart"' in text) or ("id='importance-note'" in text)


def test_tune_verified_the_best_before_saving_it(small_study: SmallStudy) -> None:
    """The correct-runtime half of test_compile_verify.py::test_tune_never_saves_what_verify_rejects
    (the same capped study, made once here for the report): fails if the best is saved without a
    verification that ran and passed (not skipped), or if what is saved is not an uneven split that
    fits every rank's cap."""
    verdicts = {k: v for k, v in small_study.study().user_attrs.items() if k.startswith("autobalance:verify:")}
    assert verdicts and all(v["passed"] and not v["skipped"] for v in verdicts.values()), verdicts
    assert "Verified trial" in small_study.tune_stdout and "Saved trial" in small_study.tune_stdout
    best = cli(["best", "--study-name", STUDY, "--storage", small_study.url, "--format", "json"], cwd=small_study.dir)
    assert best.returncode == 0, best.stderr
    saved = json.loads(best.stdout)
    assert_saved_split_is_uneven_and_fits(saved)
    assert f"autobalance:verify:{saved['trial_number']}" in verdicts


def test_report_pngs_are_written(small_study: SmallStudy) -> None:
    for name in ("memory.png", "tradeoff.png"):
        path = small_study.png_dir / name
        data = path.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n", name
        assert len(data) > 5000, name


def test_study_records_readable_per_rank_attributes_and_constraint(small_study: SmallStudy) -> None:
    study = small_study.study()
    trials = study.get_trials()
    assert len(trials) == TRIALS
    assert study.metric_names == ["spread_plus_time"]
    statuses = [t.user_attrs["status"] for t in trials]
    assert statuses[0] == "oom" and "ok" in statuses
    for t in trials:
        a = t.user_attrs
        assert len(a["peak_device_gib"]) == 2 and len(a["capacity_gib"]) == 2
        assert "rank0" in a and "rank1" in a
        assert t.system_attrs["constraints"][0] == pytest.approx(a["memory_constraint"], abs=1e-4)


def test_every_measured_trial_carries_its_memory_chart_as_an_artifact(small_study: SmallStudy) -> None:
    study = small_study.study()
    store_dir = artifact_dir_for(small_study.url)
    assert store_dir == str(small_study.db) + ".artifacts"
    for t in study.get_trials():
        metas = optuna.artifacts.get_all_artifact_meta(t, storage=study._storage)
        assert len(metas) == 1, t.number
        meta = metas[0]
        assert meta.filename == f"memory-per-rank-trial{t.number:04d}.png"
        assert meta.mimetype == "image/png"
        with open(os.path.join(store_dir, meta.artifact_id), "rb") as fh:
            assert fh.read(8) == b"\x89PNG\r\n\x1a\n"


def test_artifact_dir_for_storage_urls(tmp_path, monkeypatch) -> None:
    assert artifact_dir_for("sqlite:////data/x.db") == "/data/x.db.artifacts"
    monkeypatch.chdir(tmp_path)
    assert artifact_dir_for("sqlite:///rel/y.db") == str(tmp_path / "rel" / "y.db.artifacts")
    assert artifact_dir_for("postgresql+psycopg://u:p@host/db") == str(tmp_path / "autobalance_artifacts")
    assert artifact_dir_for("sqlite:///:memory:") == str(tmp_path / "autobalance_artifacts")


def test_pareto_front_keeps_only_undominated_feasible_trials() -> None:
    def row(n: int, spread: float, step: float, feasible: bool = True) -> TrialRow:
        return TrialRow(number=n, state="COMPLETE", status="ok", baseline=False, feasible=feasible, config=None,
                        params={}, peaks_gib=[1.0, 1.0], capacity_gib=[2.0, 2.0], usable_gib=[1.9, 1.9],
                        spread_gib=spread, spread_pct=None, step_ms=step, values=[0.0])

    rows = [row(0, 0.1, 300), row(1, 0.2, 200), row(2, 0.3, 250), row(3, 0.05, 100, feasible=False), row(4, 0.1, 310)]
    assert [r.number for r in pareto_front(rows)] == [0, 1]


def test_report_for_an_unknown_study_says_which_exist(small_study: SmallStudy, tmp_path) -> None:
    proc = cli(["report", "--study-name", "nope", "--storage", small_study.url, "-o", str(tmp_path / "r.html")],
               cwd=tmp_path)
    assert proc.returncode != 0
    assert "not found" in proc.stderr and STUDY in proc.stderr
    assert not (tmp_path / "r.html").exists()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_dashboard_command_serves_the_study_on_localhost(small_study: SmallStudy, tmp_path) -> None:
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "autobalance", "dashboard", "--storage", small_study.url, "--port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert f"http://127.0.0.1:{port}/dashboard" in line, (line, proc.stderr.read() if proc.poll() else "")
        assert "artifacts" in line
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/studies", timeout=10) as resp:
                    studies = json.load(resp)["study_summaries"]
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.3)
        assert [s["study_name"] for s in studies] == [STUDY]
    finally:
        proc.terminate()
        proc.wait(timeout=20)
