"""Any split shown plainly where people look (issue 21): the trial attribute optuna-dashboard
shows, the dashboard's own API, and the report's best-configuration table, comparison and trials
table all read ``rank 0: 6,6,5,5,5,5; rank 1: 4,4,4,3,3,3`` (a synthetic two-rank study with a
prime global batch of 53, written through the tuner's recording; no torchrun, no browser)."""

from __future__ import annotations

import html
import json
import re
import urllib.request
from pathlib import Path

import pytest

from autobalance.report import build_report, dashboard_app
from autobalance.report._html import config_rows
from tests.report_helpers import WsgiServer
from tests.synthetic_study import Spec, build_study

SPLIT = "rank 0: 6,6,5,5,5,5; rank 1: 4,4,4,3,3,3"  # 32 + 21 = 53 samples in 6 micro-steps
SPECS = [
    Spec(status="oom", micro=[27, 26], acc=1, dtype="fp32", peaks_gib=[15.9, 15.2], failing_rank=0),
    Spec(status="ok", samples=[32, 21], acc=6, peaks_gib=[14.0, 13.8], step_ms=180.0),  # the best
    Spec(status="ok", samples=[27, 26], acc=4, peaks_gib=[16.4, 16.1], step_ms=170.0),  # over the limit
    Spec(status="predicted_oom", samples=[30, 23], acc=3, peaks_gib=[16.9, None], dominated_by=2),
    Spec(status="ok", micro=[27, 26], acc=1, ckpt=8, peaks_gib=[10.0, 9.9], step_ms=250.0),
]
BEST = 1


@pytest.fixture(scope="module")
def study_db(tmp_path_factory: pytest.TempPathFactory):
    db = tmp_path_factory.mktemp("anysplit") / "s.db"
    return build_study(db, specs=SPECS, verified=BEST), db


def test_trial_attribute_and_dashboard_show_the_split_as_one_plain_string(study_db) -> None:
    """Fails if the tuner stops recording the split, or records it as a list (the dashboard then
    shows JSON: ["rank 0: ...", ...])."""
    study, db = study_db
    assert study.trials[BEST].user_attrs["split"] == SPLIT
    assert study.trials[3].user_attrs["split"] == "rank 0: 10,10,10; rank 1: 8,8,7"  # predicted, never run
    assert study.trials[4].user_attrs["split"] == "rank 0: 27; rank 1: 26"  # the equal form reads the same way
    with WsgiServer(dashboard_app(f"sqlite:///{db}")) as server, \
            urllib.request.urlopen(f"{server.url}/api/studies/{study._study_id}", timeout=30) as resp:
        detail = json.load(resp)
    shown = {t["number"]: {a["key"]: a["value"] for a in t["user_attrs"]} for t in detail["trials"]}
    assert shown[BEST]["split"] == SPLIT and shown[2]["split"] == "rank 0: 7,7,7,6; rank 1: 7,7,6,6"


def test_report_shows_each_ranks_micro_steps(study_db, tmp_path) -> None:
    """Fails if the best-configuration table shows only the largest micro-batch (6 and 4, as
    'samples per micro-step') or the raw rank_samples list, or the other tables lose the split."""
    study, db = study_db
    page = Path(build_report(study, output_html=str(tmp_path / "r.html"),
                             storage_url=f"sqlite:///{db}").html).read_text()
    cfg = html.unescape(re.search(r"<table class='cfg' id='best-config'>(.*?)</table>", page,  # type: ignore[union-attr]
                                  flags=re.S).group(1))
    assert f"<td>{SPLIT}</td>" in cfg and "rank samples" not in cfg and "[32, 21]" not in cfg
    assert "samples per micro-step" not in cfg and "<td>6</td>" in cfg  # 6 micro-steps per optimizer step
    text = html.unescape(page)
    assert text.count(SPLIT) >= 3  # the table above, the baseline/best comparison, the trials table
    assert "rank 0: 27 ckpt 0-7; rank 1: 26 ckpt 0-7" in text  # an equal-form trial: the same notation


def test_config_rows_of_both_forms() -> None:
    rows = dict(config_rows({"rank_samples": [31], "micro_batches": [6], "accumulation": 6, "global_batch": 31,
                             "checkpoint": [[]], "dtype": "bf16", "bucket_cap_mb": 25.0,
                             "gradient_as_bucket_view": False, "compile": "off", "activation_budget": None}))
    assert rows["micro-batches per optimizer step (sizes differ by at most one)"] == "rank 0: 6,5,5,5,5,5"
    assert "micro-batch (samples per micro-step)" not in rows and "rank samples" not in rows
    old = dict(config_rows({"micro_batches": [4], "accumulation": 8, "global_batch": 32}))
    assert old["micro-batches per optimizer step"] == "rank 0: 4,4,4,4,4,4,4,4"  # one notation for both forms
    two = dict(config_rows({"micro_batches": [8, 8], "accumulation": 1, "global_batch": 16,
                            "checkpoint": [[0, 1, 2, 3], []]}))
    assert two["micro-batches per optimizer step"] == "rank 0: 8; rank 1: 8"
    assert two["checkpointed blocks (indices)"] == "rank 0: 0-3, rank 1: none"  # as `ckpt 0-3` elsewhere


def test_best_and_export_print_each_ranks_micro_steps(tmp_path) -> None:
    """``autobalance best`` (table) and ``autobalance export`` print the split as it runs; fails if
    either shows only the largest micro-batch per rank."""
    from typer.testing import CliRunner

    from autobalance import BalanceConfig
    from autobalance.cli import app
    from autobalance.store import ConfigStore, current_fingerprint

    url = f"sqlite:///{tmp_path / 'b.db'}"
    config = BalanceConfig.any_split(rank_samples=[32, 21], accumulation=6, checkpoint=[[0], []], dtype="bf16")
    with ConfigStore(url=url) as store:
        store.save(study_name="s", trial_number=3, config=config, figures={"step_time_ms": 180.0},
                   fingerprint=current_fingerprint(device_type="cpu", world_size=2, nnodes=1), saved_by="test")
    runner = CliRunner()
    best = runner.invoke(app, ["best", "--study-name", "s", "--storage", url], env={"COLUMNS": "200"})
    assert best.exit_code == 0, best.output
    assert "rank 0: 6,6,5,5,5,5 ckpt 0" in best.output and "rank 1: 4,4,4,3,3,3" in best.output
    assert "[[0], []]" not in best.output  # one notation: no raw lists of indices beside it
    out = tmp_path / "best.json"
    export = runner.invoke(app, ["export", "--study-name", "s", "--storage", url, "-o", str(out)])
    assert export.exit_code == 0, export.output
    assert "It applies: rank 0: 6,6,5,5,5,5 ckpt 0; rank 1: 4,4,4,3,3,3 | bf16 bucket=25MB" in export.output
    assert json.loads(out.read_text())["split"] == SPLIT.split("; ")
