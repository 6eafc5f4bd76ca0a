"""The search policy (``tuner/search/_policy.py``) against recorded H200 measurements, on CPU.

``benchmarks/replay_search.py`` answers every trial of a real ``Tuner`` from the grids the product's own
runtime measured on one H200 (``benchmarks/2026-12-04-h200``, ``2026-12-03-h200c``), with their compile,
start-up and step times on a simulated clock and the verification priced after the loop. These tests
run the real policy on it: where its first trials go, and how close a 5-minute study gets to the grid's
best. (The benchmark itself runs 20 seeds per placement; here three, to stay fast.)
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from autobalance import BalanceConfig
from autobalance.tuner.search import SearchSpace, TrialHistory, proposal_line
from autobalance.tuner.search._policy import (
    FIT_MARGIN,
    KEEP_AT_FULL_BUDGET,
    first_compiled_micro_batch,
    one_size,
)

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import replay_search  # noqa: E402  (benchmarks/ is not a package)


@pytest.fixture(autouse=True)
def _no_charts(monkeypatch: pytest.MonkeyPatch) -> None:
    import autobalance.report as report

    monkeypatch.setattr(report, "upload_trial_chart", lambda *a, **k: None)
    optuna.logging.set_verbosity(optuna.logging.ERROR)


def _trials(tmp_path: Path, placement: str, seed: int) -> tuple[dict, list[optuna.trial.FrozenTrial]]:
    row = replay_search.replay(replay_search.GridMachine(placement), seed=seed, budget="5m", root=str(tmp_path))
    name = f"{placement}-5m-{seed}"
    study = optuna.load_study(study_name=name, storage=f"sqlite:///{tmp_path}/{name}.db")
    return row, study.trials


@pytest.mark.parametrize("placement", ["inside", "outside"])
def test_a_five_minute_study_on_the_recorded_grid_saves_near_its_best(tmp_path: Path, placement: str) -> None:
    """Three seeds (the replay's measurement noise differs): each saves within 1.08 of the grid's best
    and the median within 1.03, each within the 5 minutes with verification (issue 41's goals). The
    policy before issue 41 saved 1.18 (inside) and 1.44-1.82 (outside) of the grid best on the same
    replay; before ``raise-budget`` the loss outside stopped at regional 8 x 4 budget 0.55 (1.038)."""
    rows = [_trials(tmp_path, placement, seed)[0] for seed in range(3)]
    ratios = [r["ratio"] for r in rows]
    assert all(r is not None and r <= 1.08 for r in ratios), rows
    assert statistics.median(ratios) <= 1.03, ratios
    assert all(r["wall_s"] <= 300.0 for r in rows), [r["wall_s"] for r in rows]


def test_on_a_gpu_the_first_trials_go_where_the_optimum_is(tmp_path: Path) -> None:
    """No eager fp32 or fully checkpointed trial before the first compiled one; one eager probe in half
    precision; the first compiled trial is regional, budget 1.0, at the largest micro-batch of a split of
    one micro-step size predicted to fit from that probe; every trial after the baseline names the phase that proposed it."""
    _, trials = _trials(tmp_path, "inside", 0)
    done = [t for t in trials if t.state == TrialState.COMPLETE and t.user_attrs.get("config")]
    first = next(i for i, t in enumerate(done) if t.user_attrs["config"]["compile"] != "off")
    for t in done[1:first]:  # after the baseline, before the first compiled trial
        cfg = BalanceConfig.from_dict(t.user_attrs["config"])
        assert cfg.dtype != "fp32" and len(cfg.checkpoint[0]) < replay_search.LAYERS, t.user_attrs
        assert t.user_attrs["proposed_by"] == "probe"
    assert first == 2  # the baseline, one probe, then the compiled start
    start = BalanceConfig.from_dict(done[first].user_attrs["config"])
    assert done[first].user_attrs["proposed_by"] == "compiled-start"
    assert start.compile_scope == "regional" and start.activation_budget == [1.0] and start.dtype == "bf16"
    probe = done[1].user_attrs
    held, peak, m = probe["held_gib"][0], probe["peak_device_gib"][0], probe["config"]["micro_batches"][0]
    space = SearchSpace.build(world_size=1, global_batch=32, num_layers=16, dtypes=["bf16"], max_accumulation=8,
                              any_split=True)
    # the splits of one micro-step size (two sizes compile a dynamic batch dimension: ``one_size``)
    largest = sorted({max(c.micro_batches) for c in (space.config_for([space.micro_total(a)], a)
                                                     for a in space.accumulations) if one_size(c)})
    usable = replay_search.USABLE_GIB
    expected = first_compiled_micro_batch(held_gib=held, act_gib=(peak - held) / m, usable_gib=usable,
                                          keep=KEEP_AT_FULL_BUDGET[True], candidates=largest)
    assert max(start.micro_batches) == expected
    bigger = [x for x in largest if x > expected]
    assert bigger and held + bigger[0] * (peak - held) / m * KEEP_AT_FULL_BUDGET[True] > usable * (1 - FIT_MARGIN)
    for t in done[1:]:
        assert t.user_attrs.get("proposed_by"), t.user_attrs  # every proposal carries its phase
    for t in done[first:]:  # and, from the first compiled trial on, what it predicted: a time and a peak
        if t.user_attrs["proposed_by"] not in ("sampler", "explore"):
            assert "proposal_step_ms" in t.user_attrs and "proposal_peak_gib" in t.user_attrs, t.user_attrs
    scopes = {t.user_attrs["config"].get("compile_scope", "whole") for t in done
              if t.user_attrs.get("status") == "ok" and t.user_attrs["config"]["compile"] != "off"}
    assert scopes == {"whole", "regional"}  # the study searched both compile scopes (issue 40)
    assert proposal_line(done[first].user_attrs).startswith("compiled-start: ")


def test_the_history_counts_another_workers_running_trial(tmp_path: Path) -> None:
    """A trial another worker is running has no recorded configuration yet: the history reads it from
    its parameters, so the policy never proposes what is being measured elsewhere."""
    space = SearchSpace.build(world_size=1, global_batch=32, num_layers=4, dtypes=["bf16"], max_accumulation=8,
                              compile_modes=["off", "default"], any_split=True, compile_scopes=["whole", "regional"])
    study = optuna.create_study(storage=f"sqlite:///{tmp_path}/h.db", study_name="h")
    cfg = space.config_for([8], 4, None, checkpoint=[[]], dtype="bf16", bucket_cap_mb=25.0,
                           gradient_as_bucket_view=True, compile="default", compile_scope="regional",
                           activation_budget=[1.0])
    study.enqueue_trial(space.params_from_config(cfg))
    running = study.ask()  # another worker's trial, being measured: no attributes yet
    space.suggest(running)
    history = TrialHistory.from_trials(study.get_trials(deepcopy=False), space=space, usable=[15.2 * 2**30])
    assert history.records[0].running and history.records[0].config == cfg
    assert cfg.to_json() in history.tried()
    assert history.compiled_tried() and history.compiled_tried()[0].config == cfg
