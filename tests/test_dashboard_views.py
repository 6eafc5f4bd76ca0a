"""What optuna-dashboard (and plain Optuna) read from a study the tuner recorded: the best trial is
autobalance's best, infeasible trials never win, numbers are plottable, notes say what happened
(synthetic study written through the tuner's recording; no browser, no torchrun)."""

from __future__ import annotations

import json
import urllib.request

import pytest
from optuna_dashboard._note import get_note_from_system_attrs, note_ver_key, save_note_with_version
from optuna_dashboard._pareto_front import get_pareto_front_trials

from autobalance.report import dashboard_app
from autobalance.report._artifacts import BAD, GOOD, PREDICTED, chart_verdict
from autobalance.tuner import best_trial, is_feasible
from autobalance.tuner._reporter import SIGNATURE, write_notes
from autobalance.tuner.search import penalised
from tests.report_helpers import WsgiServer
from tests.synthetic_study import BEST_2, OVER_CAP_FASTER_2, build_study


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("dash1")
    return build_study(root / "s.db", verified=BEST_2), root / "s.db"


def _note(study, number: int) -> str:
    system = study._storage.get_study_system_attrs(study._study_id)
    return get_note_from_system_attrs(system, study.trials[number]._trial_id)["body"]


def test_no_infeasible_trial_ranks_above_a_feasible_one(single) -> None:
    study, _ = single
    best = best_trial(study)
    assert best is not None and best.number == BEST_2
    assert study._storage.get_best_trial(study._study_id).number == BEST_2  # what optuna-dashboard shows
    assert study.best_trial.number == BEST_2
    worst_feasible = max(t.values[0] for t in study.trials if is_feasible(t))
    for t in study.trials:
        if not is_feasible(t):
            assert t.values[0] > worst_feasible, t.number
    # the over-cap trial measured a faster step: its value still carries the violation
    over = study.trials[OVER_CAP_FASTER_2]
    assert over.values[0] > 1.0 + 10.0 and over.system_attrs["constraints"][0] > 0


def test_optunas_history_best_line_is_the_feasible_best(single) -> None:
    """Optuna's own history plot: the best-value line never dips to an infeasible trial's value and the
    infeasible trials (OOM, over the limit, predicted) are drawn apart. Fails if an infeasible trial's
    value is its measured (faster) time: the line would drop to #3 as the dashboard's badge did."""
    import optuna

    study, _ = single
    fig = optuna.visualization.plot_optimization_history(study)
    traces = {t.name: t for t in fig.data}
    assert traces["Best Value"].y[-1] == min(traces["Best Value"].y) == study.trials[BEST_2].values[0]
    assert set(traces["Infeasible Trial"].x) == {0, OVER_CAP_FASTER_2, 5, 6}
    assert OVER_CAP_FASTER_2 not in set(traces["Objective Value"].x)


def test_per_trial_chart_colour_and_title_follow_feasibility(single) -> None:
    """The per-trial memory chart is coloured by whether the trial fit, not by its status: the
    over-cap trial ran fine ('ok' status) yet its chart says 'over limit' with rank 0 red. Fails if
    colour or title follow the status (the blue 'ok' chart of issue 17)."""
    study, _ = single
    verdict = {t.number: chart_verdict(t.user_attrs) for t in study.trials}
    assert study.trials[OVER_CAP_FASTER_2].user_attrs["status"] == "ok"
    assert verdict[OVER_CAP_FASTER_2] == ("over limit (rank 0)", [BAD, "#9ecae1"])  # rank 1 fit
    assert verdict[BEST_2] == ("ok", [GOOD, GOOD])
    assert verdict[0] == ("OOM (rank 0)", [BAD, "#9ecae1"]) and verdict[6] == ("OOM (rank 1)", ["#9ecae1", BAD])
    assert verdict[5] == ("predicted OOM (not run)", [PREDICTED, PREDICTED])


def test_pareto_front_of_a_two_objective_study_has_no_infeasible_trial(tmp_path) -> None:
    study = build_study(tmp_path / "m.db", multi_objective=True)
    front = get_pareto_front_trials(trials=study.get_trials(), directions=study.directions)  # optuna-dashboard's
    assert front and all(is_feasible(t) for t in front)
    assert BEST_2 in {t.number for t in front} and OVER_CAP_FASTER_2 not in {t.number for t in front}
    assert {t.number for t in study.best_trials} == {t.number for t in front}


def test_penalised_values() -> None:
    """Fails if an infeasible trial is not scored at least the worst measurement (spread 1 + time 10,
    literals here, not the implementation's INFEASIBLE_TIME) plus its violation."""
    kw = {"weight_spread": 1.0, "weight_time": 1.0, "multi_objective": False}
    assert penalised([0.7], [-0.1], feasible=True, **kw) == [0.7]
    assert penalised([0.7], [0.25], feasible=False, **kw) == [1.0 + 10.0 + 0.25]
    assert penalised([11.0], [1.5], feasible=False, **kw) == [12.5]  # an OOM: more over is worse
    assert penalised([0.1, 0.9], [0.2, -1.0], feasible=False, weight_spread=1.0, weight_time=1.0,
                     multi_objective=True) == [1.2, 10.0 + 0.2]


def test_dashboard_reads_plottable_numbers_and_outcomes(single) -> None:
    study, db = single
    with WsgiServer(dashboard_app(f"sqlite:///{db}")) as server, \
            urllib.request.urlopen(f"{server.url}/api/studies/{study._study_id}", timeout=30) as resp:
        detail = json.load(resp)
    sortable = {a["key"]: a["sortable"] for a in detail["union_user_attrs"]}
    for key in ("step_time_ms", "peak_max_gib", "peak_rank0_gib", "peak_rank1_gib", "compile_s", "spread_gib"):
        assert sortable.get(key) is True, key  # numbers only: optuna-dashboard can plot and sort them
    attrs = {t["number"]: {a["key"]: a["value"] for a in t["user_attrs"]} for t in detail["trials"]}
    assert "step_time_ms" not in attrs[0] and "peak_max_gib" not in attrs[0]  # OOM: absent, not null
    assert "peak_max_gib" not in attrs[5]  # a prediction is not plotted as a measurement
    assert float(attrs[OVER_CAP_FASTER_2]["peak_max_gib"]) == 16.65
    assert [attrs[n]["outcome"] for n in range(8)] == [
        "OOM (rank 0)", "ok", "ok", "over limit (rank 0)", "ok", "predicted OOM (not run)", "OOM (rank 1)", "ok"]


def test_notes_say_why_and_keep_a_persons_own(tmp_path) -> None:
    study = build_study(tmp_path / "n.db", verified=BEST_2)
    best = _note(study, BEST_2)
    assert best.startswith("**Best trial: why it won**") and "Verified: losses match" in best
    assert f"#{OVER_CAP_FASTER_2} (128.0 ms) peaked at 16.6 GiB on rank 0" in best
    assert _note(study, OVER_CAP_FASTER_2).startswith("**over limit (rank 0)**: peaked at 16.6 GiB")
    assert _note(study, 5).startswith("**predicted OOM (not run)**") and "predictions" in _note(study, 5)
    assert _note(study, 1) == ""  # fits, did not win: nothing to say
    assert write_notes(study) == 0  # nothing changed, nothing rewritten
    storage, trial_id = study._storage, study.trials[6]._trial_id
    system = storage.get_study_system_attrs(study._study_id)
    save_note_with_version(storage, study._study_id, trial_id, system.get(note_ver_key(trial_id), 0) + 1, "mine")
    study.set_user_attr("autobalance:verify:2", {"passed": False, "reason": "loss diverged"})
    assert write_notes(study) == 2  # the best's verdict changed (its note and the study's); the person's note stays
    assert _note(study, 6) == "mine"
    system = storage.get_study_system_attrs(study._study_id)
    assert get_note_from_system_attrs(system, None)["body"].startswith(f"**autobalance: trial {BEST_2} is the best**")
    assert "Verification FAILED: loss diverged" in _note(study, BEST_2) and _note(study, BEST_2).endswith(SIGNATURE)


def test_the_study_note_lists_every_trials_outcome(single) -> None:
    """optuna-dashboard badges every trial "Complete" (the samplers need COMPLETE): the study's own
    note tells OOM, over the limit and predicted apart, grouped, with the failing rank."""
    study, _ = single
    system = study._storage.get_study_system_attrs(study._study_id)
    note = get_note_from_system_attrs(system, None)["body"]
    assert note.startswith(f"**autobalance: trial {BEST_2} is the best**") and note.endswith(SIGNATURE)
    listed = note.split("**Trials by outcome** (8;", 1)[1]
    assert [line for line in listed.splitlines() if line.startswith("- ")] == [
        "- ok: #1, #2, #4, #7",
        f"- over limit (rank 0): #{OVER_CAP_FASTER_2}",
        "- OOM (rank 0): #0",
        "- OOM (rank 1): #6",
        "- predicted OOM (not run): #5",
    ]


def test_outcome_lines_stay_short_for_many_trials() -> None:
    from types import SimpleNamespace

    from autobalance.tuner._reporter import outcome_lines

    def row(number: int, outcome: str, reused_from: int | None = None) -> SimpleNamespace:
        return SimpleNamespace(number=number, outcome=outcome if reused_from is None else f"{outcome}, as #{reused_from}",
                               reused_from=reused_from)

    rows = [row(n, "ok") for n in range(60)]
    for n in (0, 4, 5, 6, 7):
        rows[n] = row(n, "OOM (rank 1)")
    rows[9] = row(9, "predicted OOM (not run)")
    rows[10] = row(10, "predicted OOM (not run)")
    rows[20] = row(20, "over limit (rank 0)")
    rows[30] = row(30, "timeout (rank 0)")
    rows[40] = row(40, "ok", reused_from=2)
    lines = outcome_lines(rows)
    assert lines == [
        "ok: #1–#3, #8, #11–#19, #21–#29, #31–#39, #41–#59, #40 (as #2)",
        "over limit (rank 0): #20",
        "OOM (rank 1): #0, #4–#7",
        "predicted OOM (not run): #9, #10",
        "timeout (rank 0): #30",
    ]
    assert sum(len(line) for line in lines) < 200  # 60 trials in a few short lines
