"""The verification reserve replayed on the recorded H200 studies (issue 41): what the forecast
reserved at the moment the study stopped, against what the verification that followed launched and
took (the study attribute ``autobalance:verify:<trial>``: each launched run's wall time, ``run``, and
the read of its tensors here, ``read``; ``wall_s``: the whole verification, comparisons included).

The trials of 2026-12-03 were recorded before two facts the tuner now records; they are filled in as
today's recorder would have recorded them, and asserted, not assumed:

- ``dropout_modules``: 0, the GPT example at ``--dropout 0.0`` (the study's launch arguments; the
  runtime's count is tested on that model below);
- ``parameter_bytes`` of ``h200b``: ``h200c``'s, the same script with the same arguments.

What the recorded verifications did that no forecast should predict is left out, by name: ``h200b``'s
``tuned`` run recompiled (the precision flags changed the FX graph cache key, fixed after that run in
``runtime/_worker.py``), and its ``tuned-fp32`` run was launched where verification now reuses the
baseline's (the same fp32 step); ``h200c`` trial 4's ``tuned-fp32`` run started a fresh worker after
trial 10's ``tuned`` run failed and took the pool with it.
"""

from __future__ import annotations

import re
import shutil
import statistics
from pathlib import Path

import optuna
import pytest
from optuna.trial import FrozenTrial

from autobalance import BalanceConfig
from autobalance.protocol import StudyAttr, TrialAttr, best_trial
from autobalance.tuner.search._timing import RESERVE_MARGIN, forecast_verification

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
H200B = BENCH / "2026-12-03-h200b" / "tune_gpt-1gpu.db"
H200C = BENCH / "2026-12-03-h200c" / "tune_gpt-1gpu.db"
TOLERANCE = 0.25
"""How far a replayed forecast may be from what verification took (either way): the eager runs of
one kind spread by ~20 % within one recorded verification."""


def _study(db: Path, tmp_path: Path) -> optuna.Study:
    copy = tmp_path / db.parent.name / db.name  # never the recorded file itself
    copy.parent.mkdir(parents=True)
    shutil.copy(db, copy)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna.load_study(study_name="gpt-1gpu", storage=f"sqlite:///{copy}")


def _replayed(study: optuna.Study, *, parameter_bytes: int | None = None) -> list[FrozenTrial]:
    """The study's trials as today's recorder records them (module doc)."""
    launch = study.user_attrs[StudyAttr.LAUNCH]
    assert launch["script_args"][launch["script_args"].index("--dropout") + 1] == "0.0"
    trials = study.get_trials(deepcopy=True)
    for t in trials:
        if TrialAttr.TIME_SPLIT in t.user_attrs:
            t.user_attrs[TrialAttr.DROPOUT_MODULES] = 0
            if parameter_bytes is not None:
                t.user_attrs.setdefault(TrialAttr.PARAMETER_BYTES, parameter_bytes)
    return trials


def _forecast(study: optuna.Study, trials: list[FrozenTrial], number: int):
    base_no = study.user_attrs[StudyAttr.BASELINE]
    own = BalanceConfig.from_dict(next(t.user_attrs[TrialAttr.CONFIG] for t in trials if t.number == base_no))
    space = study.user_attrs[StudyAttr.SPACE]
    best = next(t for t in trials if t.number == number)
    return forecast_verification(trials, baseline=own, best=best, num_layers=int(space["num_layers"]), device="cuda")


def _took(record: dict, name: str) -> float:
    """A launched run's recorded seconds: launch to exit, and reading its tensors here."""
    return record["seconds"][name]["run"] + record["seconds"][name]["read"]


def _compare_s(record: dict, runs: int) -> float:
    """A finished verification's seconds outside its runs (its comparisons), per comparison."""
    return (record["wall_s"] - sum(_took(record, n) for n in record["seconds"])) / runs


def test_h200c_the_reserve_that_stopped_the_study_is_what_its_verification_took(tmp_path: Path):
    """``h200c``: 94 s left at the stop, kept for 134 s of verification (7 runs); trial 10's
    verification launched 5 runs, no fresh worker, and would have taken ~67 s."""
    study = _study(H200C, tmp_path)
    spent = study.user_attrs[StudyAttr.TIME_SPENT]
    assert spent["verify_reserved"] == 133.9 and spent["verify_reserved_runs"] == 7  # what the study reserved
    trials = _replayed(study)
    assert best_trial(study).number == 10
    v10 = study.user_attrs[f"{StudyAttr.VERIFY_PREFIX}10"]
    v4 = study.user_attrs[f"{StudyAttr.VERIFY_PREFIX}4"]
    assert v10["failure"] == "run" and "tuned" not in v10["seconds"]  # its tuned run failed before its step
    forecast = _forecast(study, trials, 10)
    # the runs verification launched (trial 10's four that finished, and the tuned run that failed)
    assert forecast.runs == [*v10["seconds"], "tuned"] == ["baseline", "floor", "tuned-fp32", "baseline-fp16", "tuned"]
    for name in v10["seconds"]:  # each eager run in the study's running worker
        assert forecast.per_run[name] == pytest.approx(_took(v10, name), rel=TOLERANCE), name
    # the tuned run compiled from the study's cache in a running worker, as trial 4's did (36.9 s cold)
    four = _forecast(study, trials, 4)
    assert four.per_run["tuned"] == pytest.approx(_took(v4, "tuned"), rel=TOLERANCE)
    assert four.per_run["baseline-bf16"] == pytest.approx(_took(v4, "baseline-bf16"), rel=TOLERANCE)
    # its comparisons (floor, equivalence, noise, dtype) as trial 4's verification spent them
    per_compare = _compare_s(v4, 4)
    assert forecast.compare_s == pytest.approx(4 * per_compare, rel=TOLERANCE)
    # in all: trial 10's finished runs, a from-cache tuned run like trial 4's, four comparisons
    actual = sum(_took(v10, n) for n in v10["seconds"]) + _took(v4, "tuned") + 4 * per_compare
    assert 63 < actual < 70
    assert forecast.seconds == pytest.approx(actual, rel=TOLERANCE)
    assert actual <= forecast.reserve_s <= RESERVE_MARGIN * (1 + TOLERANCE) * actual
    assert forecast.reserve_s < 0.65 * spent["verify_reserved"]  # 134 s reserved before


def test_h200b_the_fresh_worker_after_a_recycled_pool_is_priced_once(tmp_path: Path):
    """``h200b``: trial 8 (compiled, the latest) recycled its worker, so verification's first run
    started a fresh one (23.9 s against 5.7-6.7 s for the runs after it)."""
    same = _study(H200C, tmp_path)
    parameter_bytes = same.trials[1].user_attrs[TrialAttr.PARAMETER_BYTES]
    study = _study(H200B, tmp_path)
    assert study.user_attrs[StudyAttr.LAUNCH]["script_args"] == same.user_attrs[StudyAttr.LAUNCH]["script_args"]
    trials = _replayed(study, parameter_bytes=parameter_bytes)
    assert best_trial(study).number == 5
    v5 = study.user_attrs[f"{StudyAttr.VERIFY_PREFIX}5"]
    forecast = _forecast(study, trials, 5)
    # tuned-fp32 (8,8,8,8 fp32 eager) is the baseline's step: reused now, launched at that commit
    assert forecast.runs == ["baseline", "floor", "baseline-bf16", "tuned"]
    assert [n for n in v5["seconds"] if n not in forecast.runs] == ["tuned-fp32"]
    for name in ("baseline", "floor", "baseline-bf16"):
        assert forecast.per_run[name] == pytest.approx(_took(v5, name), rel=TOLERANCE), name
    assert forecast.per_run["baseline"] > 3 * forecast.per_run["floor"]  # the fresh worker, in the first run only
    # its tuned run recompiled (the fixed precision-flag bug): the forecast prices it from the cache
    cold = statistics.median(t.user_attrs[TrialAttr.COMPILE_S] for t in trials if TrialAttr.COMPILE_S in t.user_attrs)
    assert forecast.per_run["tuned"] < 0.6 * cold < _took(v5, "tuned")
    assert forecast.compare_s == pytest.approx(_compare_s(v5, 4) * 4, rel=TOLERANCE)


def test_the_gpt_example_reports_its_dropout_layers_as_the_replay_assumes():
    """``dropout_modules``: the layers with ``p > 0`` (0 at ``--dropout 0.0``, as the replayed studies ran)."""
    import importlib.util

    from autobalance.runtime._wrapping import model_facts

    spec = importlib.util.spec_from_file_location("gpt_train", BENCH.parent / "examples" / "gpt" / "train.py")
    assert spec is not None and spec.loader is not None
    gpt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpt)

    def facts(dropout: float) -> dict:
        model = gpt.GPT(vocab=64, block_size=8, n_layer=2, n_embd=16, n_head=2, dropout=dropout)
        return model_facts(model, blocks_path="blocks", num_blocks=2, compile="off", find_unused_parameters=False,
                           loss_in_model=False)

    assert facts(0.0)["dropout_modules"] == 0
    assert facts(0.1)["dropout_modules"] == 2 * 1 + 1  # each block's MLP dropout and the embedding's


def test_a_trial_starts_only_when_the_reserve_still_holds_after_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """On ``h200c``'s recorded trials (no dropout facts: the dropout runs reserved): with the reserve
    plus 20 s left an eager proposal (8 s) starts; a proposal that compiles new graphs (the study's
    median cold compile, 41 s, then its verification should it become the best) does not; with
    enough time left it does."""
    import types

    import autobalance.tuner._loop as loop_module
    from autobalance.tuner._loop import TrialLoop
    from autobalance.tuner.search import TimeBudget

    study = _study(H200C, tmp_path)
    now = 1000.0
    monkeypatch.setattr(loop_module, "time", types.SimpleNamespace(monotonic=lambda: now))
    budget = TimeBudget(budget_s=300.0, started=now - 300.0)
    loop = TrialLoop(settings=types.SimpleNamespace(verify=True, nnodes=1, device="cuda", remeasure="auto"),  # type: ignore[arg-type]
                     storage=None, launcher=types.SimpleNamespace(stop=None), recorder=None,  # type: ignore[arg-type]
                     reporter=None, advisor=None, budget=budget)  # type: ignore[arg-type]
    budget.refresh(loop.decision(study), now)
    assert budget.leaders_s > 0  # h200c's two best are within the measured noise: their re-measure is kept free too
    left = round(budget.reserve_s + budget.leaders_s) + 20
    budget.started += left
    eager = BalanceConfig.from_dict(study.trials[5].user_attrs[TrialAttr.CONFIG])  # 5,5,5,5,4,4,4 bf16
    assert loop.over_budget(study, eager) is None
    new = BalanceConfig.any_split(rank_samples=[32], accumulation=2, dtype="bf16", checkpoint=[[]],
                                  compile="default", activation_budget=[1.0])
    reason = loop.over_budget(study, new)
    assert reason is not None and reason.startswith(f"the time budget no longer holds it: {left} s left"), reason
    took, after = (float(x) for x in re.findall(r"about (\d+) s and verification after it (\d+) s", reason)[0])
    assert 41 + 7 <= took <= 41 + 9 and after >= budget.reserve_s
    budget.started += took + after - left + 1  # just enough left: it starts
    assert loop.over_budget(study, new) is None
