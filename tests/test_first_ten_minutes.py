"""Issue 43: what a newcomer meets in the first ten minutes, fixed and checked from the user's side.

- ``autobalance best`` labels its rows in words (``rank 0 peak``, ``spread``, ``step time``), each value in
  the unit it is written in: no ``peak_device_gib`` next to ``10.0 MiB``;
- a framework script is told to name its blocks with its integration's ``blocks=``, not ``plan.wrap``;
- when the script's own configuration is the best, ``tune`` says so and what else it tried;
- a re-run of a finished study says that ``--trials`` is the study's total and how to run more, and does
  not print its few milliseconds as "Time: ... in all";
- a ``tune`` whose baseline fails before recording a trial leaves no empty study behind.
"""

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

import autobalance as ab
from autobalance import BalanceConfig
from autobalance.cli import app
from autobalance.cli._views import print_result
from autobalance.protocol import StudyAttr, best_trial
from autobalance.runtime._external import FrameworkLoop
from autobalance.store import ConfigStore, current_fingerprint
from autobalance.tuner import TuneSettings
from autobalance.tuner._finish import save_best
from autobalance.tuner._reporter import RichReporter
from autobalance.tuner._summary import TuneResult, record_time_spent, script_facts
from tests.synthetic_study import Spec, build_study
from tests.tune_helpers import GPT, cli

REPO = Path(__file__).resolve().parents[1]


def _console() -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, width=400, force_terminal=False, color_system=None), out


@pytest.fixture
def no_stored_config(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("AUTOBALANCE_STUDY", "AUTOBALANCE_STORAGE", "AUTOBALANCE_CONFIG_FILE", "AUTOBALANCE_CONFIG",
                 "AUTOBALANCE_TRIAL_DIR"):
        monkeypatch.delenv(name, raising=False)


def test_best_labels_its_rows_in_words_and_units(tmp_path: Path) -> None:
    """Issue 43 (5): the rows read ``peak_device_gib`` and ``spread_gib`` next to ``11.6 MiB`` and ``210 KiB``."""
    url = f"sqlite:///{tmp_path / 'b.db'}"
    config = BalanceConfig.any_split(rank_samples=[5, 11], accumulation=1)
    optuna.create_study(study_name="b", storage=url)
    figures = {"peak_device_gib": [0.01134, 0.0098], "spread_gib": 0.0002, "step_time_ms": 68.513,
               "step_time_iqr_pct": 1.0, "speedup_vs_baseline": 2.0,
               "baseline": {"step_time_ms": 137.0, "step_time_iqr_pct": 1.0}}
    with ConfigStore(url=url) as store:
        store.save(study_name="b", trial_number=0, config=config, figures=figures,
                   fingerprint=current_fingerprint(device_type="cpu", world_size=2, nnodes=1), saved_by="test")
    out = CliRunner().invoke(app, ["best", "--study-name", "b", "--storage", url], env={"COLUMNS": "200"}).output
    rows = {line.split("│")[1].strip(): line.split("│")[2].strip() for line in out.splitlines()
            if line.startswith("│") and line.split("│")[1].strip()}
    assert rows["rank 0 peak"] == "11.6 MiB" and rows["rank 1 peak"] == "10.0 MiB", out
    assert rows["spread"] == "210 KiB" and rows["step time"] == "68.5 ms", out
    assert rows["speed-up vs baseline"].startswith("2.00x"), out
    assert "_gib" not in out and "_ms" not in out, out
    json_out = CliRunner().invoke(app, ["best", "--study-name", "b", "--storage", url, "--format", "json"]).output
    assert '"peak_device_gib"' in json_out  # the stored fields keep their names (and GiB) in JSON


@pytest.mark.parametrize(("framework", "call"), [
    ("lightning", "BalanceStrategy(..., blocks=...)"),
    ("hf", "BalanceTrainer(..., blocks=...)"),
    ("accelerate", "balance.prepare(accelerator, model, optimizer, dataset, blocks=...)"),
    (None, "plan.wrap(model, blocks=...)"),
])
def test_the_blocks_line_names_the_call_the_script_makes(framework: str | None, call: str,
                                                         no_stored_config: None) -> None:
    """Issue 43 (6): HF and Lightning studies said ``(name others with plan.wrap(model, blocks=...))``;
    their scripts never call it. The rank report's model facts, as an integration's loop or
    ``plan.wrap`` writes them, name the framework; the line names that integration's ``blocks=``."""
    model = torch_blocks()
    plan = ab.plan(micro_batch=4)
    if framework is None:
        plan.wrap(model)
    else:
        FrameworkLoop(plan, framework=framework).prepare_model(model)
    report: Any = SimpleNamespace(model=plan.model_info, data={})
    lines = script_facts(report, kept_split=False, allow=False, split="4")
    assert lines[0] == f"Blocks: 3 at '(the model)' (name others with {call}).", lines
    none: Any = SimpleNamespace(model={**plan.model_info, "num_blocks": 0}, data={})
    assert call.replace("blocks=...", 'blocks="path.to.blocks"') in script_facts(none, kept_split=False, allow=False, split="4")[0]


def torch_blocks() -> Any:
    from torch import nn

    return nn.Sequential(*[nn.Linear(4, 4) for _ in range(3)])


def _baseline_best_study(tmp_path: Path) -> optuna.Study:
    """A study whose baseline (trial 0, the script's own 8+8 in bf16) is faster and as even as anything tried."""
    specs = [
        Spec(status="ok", micro=[8, 8], acc=4, peaks_gib=[12.0, 12.0], step_ms=100.0),
        Spec(status="ok", samples=[40, 24], acc=4, peaks_gib=[13.0, 10.0], step_ms=120.0),
        Spec(status="ok", micro=[16, 16], acc=2, dtype="fp16", ckpt=2, peaks_gib=[14.0, 13.0], step_ms=150.0),
    ]
    return build_study(tmp_path / "w.db", specs=specs, name="won")


def test_the_scripts_own_configuration_winning_is_said_plainly(tmp_path: Path) -> None:
    """Issue 43 (7): the study ended "Saved trial 0 as the best configuration"; now it says the script's own
    configuration was best, and what else was tried."""
    study = _baseline_best_study(tmp_path)
    best = best_trial(study)
    assert best is not None and best.number == study.user_attrs[StudyAttr.BASELINE] == 0
    url = f"sqlite:///{tmp_path / 'w.db'}"
    settings = TuneSettings(script=GPT, storage=url, study_name="won", verify=False, nproc_per_node=2)
    result = TuneResult(study_name="won", storage=url, trials_run=3, baseline=study.trials[0], best=best, wall_s=1.0)
    saving = save_best(settings=settings, result=result)
    assert saving.trial == 0 and result.saved
    verdict = result.notes[-1]
    assert verdict.startswith("The script's own configuration was the best: 2 other configuration(s) ("), verdict
    assert all(word in verdict for word in ("2 splits", "accumulation 2-4", "checkpointing", "bf16/fp16")), verdict
    assert "did not beat it. Saved trial 0 (the script's own) as the best configuration of 'won'" in verdict
    # another best keeps the plain line
    result = TuneResult(study_name="won", storage=url, trials_run=3, baseline=study.trials[1], best=best, wall_s=1.0)
    save_best(settings=settings, result=result)
    assert result.notes[-1] == "Saved trial 0 as the best configuration of 'won': 100.0 ms (over 5 steps, 1 run)."


def test_a_rerun_of_a_finished_study_says_how_to_run_more(tmp_path: Path) -> None:
    """Issue 43 (8): a re-run printed "10 trials (10 done before)", then "Time: 0.1 s in all" beside the
    earlier run's figures, and no word that --trials is the study's total."""
    settings = TuneSettings(script=GPT, trials=10, nproc_per_node=2, device="cpu")
    console, out = _console()
    reporter = RichReporter(console=console)
    reporter.begin(settings, already=10)
    reporter.end()
    assert out.getvalue().splitlines()[0].endswith("10 trials (all 10 done before: nothing to run; --trials 20 "
                                                   "runs 10 more)")
    console, out = _console()
    reporter = RichReporter(console=console)
    reporter.begin(settings, already=4)
    reporter.end()
    assert out.getvalue().splitlines()[0].endswith("10 trials (4 done before)")

    study = _baseline_best_study(tmp_path)
    earlier = {"wall": 30.0, "steps": 10.0, "verified": True}
    study.set_user_attr(StudyAttr.TIME_SPENT, earlier)
    result = TuneResult(study_name="won", storage="sqlite:///x.db", trials_run=0, baseline=study.trials[0],
                        best=study.trials[0], wall_s=0.05, already=10, of=10, saved=True)
    record_time_spent(study, result, launched_here=set())
    assert result.time_lines() == []  # nothing ran: no "Time: 0.1 s in all"
    assert study.user_attrs[StudyAttr.TIME_SPENT] == earlier  # the study keeps its last real run's record
    console, out = _console()
    print_result(result, settings=SimpleNamespace(script="train.py"), console=console)
    text = out.getvalue()
    assert text.splitlines()[0] == ("Nothing to run: the study already has 10 trial(s) and --trials 10 is the study's "
                                    "total, not this run's; --trials 20 runs 10 more. The figures below are from "
                                    "its earlier runs.")
    assert "Time:" not in text
    result.trials_run, result.already = 3, 7  # a run that ran trials: its time, no hint
    record_time_spent(study, result, launched_here=set())
    assert result.time_lines() and result.time_lines()[0].startswith("Time: ")
    console, out = _console()
    print_result(result, settings=SimpleNamespace(script="train.py"), console=console)
    assert "Nothing to run" not in out.getvalue()


@pytest.mark.slow
def test_a_baseline_that_fails_leaves_no_empty_study(tmp_path: Path) -> None:
    """Issue 43 (9): `autobalance studies` listed the study of a tune whose baseline failed, with 0 trials."""
    bad = tmp_path / "bad.py"
    bad.write_text('raise SystemExit("the script fails before it trains")\n')
    db = tmp_path / "ab.db"
    proc = cli(["tune", str(bad), "--trials", "2", "--nproc-per-node", "2", "--device", "cpu",
                "--storage", f"sqlite:///{db}", "--study-name", "bad", "--trial-timeout", "60"],
               cwd=tmp_path, timeout=300)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "autobalance: error: the baseline trial" in proc.stderr, proc.stderr[-2000:]
    assert db.exists()  # the study was created, then removed
    assert optuna.get_all_study_names(storage=f"sqlite:///{db}") == []
    # a study with trials is never removed: an existing study whose baseline fails again stays
    optuna.create_study(study_name="kept", storage=f"sqlite:///{db}").add_trial(
        optuna.trial.create_trial(value=1.0))
    proc = cli(["tune", str(bad), "--trials", "2", "--nproc-per-node", "2", "--device", "cpu",
                "--storage", f"sqlite:///{db}", "--study-name", "kept", "--trial-timeout", "60"],
               cwd=tmp_path, timeout=300)
    assert proc.returncode != 0
    assert optuna.get_all_study_names(storage=f"sqlite:///{db}") == ["kept"]


def test_the_dashboard_scales_its_history_to_the_feasible_trials(tmp_path: Path) -> None:
    """Issue 43 (10): the infeasible baseline's penalty (12 and more) stretched the History chart and
    flattened every other trial. The dashboard now reads infeasible trials' values just above the worst
    feasible one (their order kept, their stored value in a user attribute), its best trial unchanged;
    Optuna's warnings about importances' regimes stay out of the terminal."""
    import json
    import urllib.request
    import warnings

    from autobalance.protocol import is_feasible
    from autobalance.report import dashboard_app
    from autobalance.report._dashboard import SHOWN_ABOVE, STORED_VALUE_ATTR
    from tests.report_helpers import WsgiServer
    from tests.synthetic_study import BEST_2

    study = build_study(tmp_path / "s.db")
    stored = {t.number: t.values[0] for t in study.trials if t.values}
    feasible = [stored[t.number] for t in study.trials if is_feasible(t) and t.values]
    infeasible = sorted((stored[t.number], t.number) for t in study.trials if not is_feasible(t) and t.values)
    worst, span = max(feasible), max(feasible) - min(feasible)
    assert infeasible and min(v for v, _ in infeasible) > worst + span  # stored: far above (the stretch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        app = dashboard_app(f"sqlite:///{tmp_path / 's.db'}")
        with WsgiServer(app) as server:
            with urllib.request.urlopen(f"{server.url}/api/studies/{study._study_id}", timeout=60) as resp:
                detail = json.load(resp)
            with urllib.request.urlopen(f"{server.url}/api/studies/{study._study_id}/param_importances",
                                        timeout=60) as resp:
                assert json.load(resp)["param_importances"]
    shown = {t["number"]: t["values"][0] for t in detail["trials"] if t.get("values")}
    attrs = {t["number"]: {a["key"]: a["value"] for a in t["user_attrs"]} for t in detail["trials"]}
    for number, value in stored.items():
        if any(number == n for _, n in infeasible):
            assert worst < shown[number] <= worst + SHOWN_ABOVE[1] * span + 1e-9, (number, shown[number], worst)
            assert float(attrs[number][STORED_VALUE_ATTR]) == pytest.approx(value)
        else:
            assert shown[number] == pytest.approx(value) and STORED_VALUE_ATTR not in attrs[number]
    order = [n for _, n in infeasible]
    assert [shown[n] for n in order] == sorted(shown[n] for n in order)  # the penalties' order kept
    assert [t["number"] for t in detail["best_trials"]] == [BEST_2]
    said = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    assert not [m for m in said if "regimes" in m or "quantiles" in m], said


def test_capacity_bytes_is_said_next_to_the_cap() -> None:
    """Issue 43 (10): the dashboard's study attributes showed ``capacity_bytes`` of the host's RAM next to a
    14.8 MiB cap, unexplained; the study now also records both in words, with units."""
    from autobalance.tuner._baseline import capacity_in_words

    host = [25276071936.0, 25276071936.0]
    assert capacity_in_words(host, caps=[15569256, 15569256], headroom=0.05) == (
        "capacity_bytes is each device's own memory (23.5 GiB per rank); trials are judged against the emulated "
        "cap: 14.8 MiB per rank (14.1 MiB per rank usable with 5% headroom).")
    assert capacity_in_words(host, caps=None, headroom=0.05) == (
        "capacity_bytes is each device's memory (23.5 GiB per rank); trials are judged against it: "
        "22.4 GiB per rank usable with 5% headroom.")


def _mib_specs() -> list[Spec]:
    """The synthetic GPU study's trials at the demo's scale: peaks of 10-16 MiB, spreads of KiB to MiB."""
    from tests.synthetic_study import SPECS_2

    return [Spec(**{**spec.__dict__, "peaks_gib": [None if p is None else p / 1024 for p in spec.peaks_gib]})
            for spec in SPECS_2]


@pytest.mark.parametrize("multi_objective", [False, True])
def test_the_reports_charts_read_in_the_texts_unit_with_readable_names(tmp_path: Path, multi_objective: bool) -> None:
    """Issue 43 (11): the report's axes were in GiB (0.004-0.014) where its text says MiB, the importance
    chart said ``oshare_r0`` and ``share_r0``, and a single-objective study had a "Pareto front"."""
    from autobalance.report import build_report

    study = build_study(tmp_path / "r.db", specs=_mib_specs(), multi_objective=multi_objective)
    html = tmp_path / "r.html"
    build_report(study, output_html=str(html), png_dir=str(tmp_path / "png"))
    text = html.read_text()
    assert "14.0 MiB" in text  # the text's unit (the best's highest peak)
    for title in ('"peak device memory (MiB)"', '"spread of peaks across ranks (MiB)"'):
        assert title in text, title
    assert "(GiB)" not in text and '"text":"GiB"' not in text
    assert ('"name":"Pareto front"' in text) == multi_objective
    importance = text[text.index('id="importance-chart"'):]
    assert "rank 0's share of the batch" in importance and "accumulation steps" in importance
    assert not re.search(r'"(o?share|ckpt|budget)_r\d"', importance)


def test_param_words() -> None:
    from autobalance.report._figures import memory_unit, param_words

    assert param_words("oshare_r0") == "rank 0's share of the optimizer state"
    assert param_words("share_r12") == "rank 12's share of the batch"
    assert param_words("ckpt_r1") == "rank 1's checkpointed blocks"
    assert param_words("grad_as_bucket_view") == "gradient_as_bucket_view"
    assert param_words("share_rx") == "share_rx" and param_words("new_param") == "new_param"
    assert memory_unit(0.0146) == ("MiB", 1024.0) and memory_unit(15.7) == ("GiB", 1.0)
    assert memory_unit(0.0002) == ("KiB", 1024.0**2)
