"""The search's catches are narrow (issue 32): a fit that fails on its data (numpy's LinAlgError,
scipy's ValueError, ...) still falls back, and is now recorded in the study
(``StudyAttr.MODEL_ERRORS``) and shown in the tune summary in one line; a programming error
(TypeError) is no longer swallowed."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import scipy.optimize

import autobalance.tuner.search._models as holdout  # the held-out fits live with the models
from autobalance.protocol import StudyAttr
from autobalance.tuner import TuneResult
from autobalance.tuner._summary import summarise
from autobalance.tuner.search import ModelErrors, StepTimeModel, model_errors_line
from autobalance.tuner.search._model_errors import MAX_KEPT_ERRORS
from tests.test_compiled_model import EAGER, LAYERS, _advisor, _study, trial


def _failing_fit(exc: Exception) -> type:
    class Failing:
        @classmethod
        def fit(cls, *args: Any, **kwargs: Any) -> Any:
            raise exc

    return Failing


def test_a_failed_fit_is_recorded_in_the_study_and_shown_in_the_summary(tmp_path, monkeypatch: pytest.MonkeyPatch):
    advisor = _advisor(tmp_path, modes=["off"])
    study = _study([trial(c) for c in EAGER])
    assert advisor.holdout_error(study) is not None and StudyAttr.MODEL_ERRORS not in study.user_attrs
    monkeypatch.setattr(holdout, "MemoryModel", _failing_fit(np.linalg.LinAlgError("SVD did not converge")))
    assert advisor.holdout_error(study) is None  # each held-out fit failed: no error to report, as before
    recorded = study.user_attrs[StudyAttr.MODEL_ERRORS]
    assert recorded == [{"where": "holdout", "error": "LinAlgError: SVD did not converge"}] * len(EAGER)
    result = TuneResult(study_name="s", storage="", trials_run=0, baseline=None, best=None, wall_s=1.0)
    summarise(study, result, cold_note=None, advisor=advisor)
    lines = [n for n in result.notes if n.startswith("models:")]
    twice = 2 * len(EAGER)  # the summary's own holdout failed the same way
    assert lines == [f"models: {twice} fits failed (holdout: LinAlgError: SVD did not converge ({twice}x))."]


def test_a_programming_error_in_a_fit_is_not_swallowed(tmp_path, monkeypatch: pytest.MonkeyPatch):
    advisor = _advisor(tmp_path, modes=["off"])
    study = _study([trial(c) for c in EAGER])
    monkeypatch.setattr(holdout, "MemoryModel", _failing_fit(TypeError("fit() got an unexpected keyword")))
    with pytest.raises(TypeError):
        advisor.holdout_error(study)
    assert StudyAttr.MODEL_ERRORS not in study.user_attrs


def test_the_step_time_fit_falls_back_on_a_scipy_error_and_raises_a_programming_error(monkeypatch: pytest.MonkeyPatch):
    trials = [trial(c) for c in EAGER]
    expected = StepTimeModel.fit(trials, num_layers=LAYERS, device="cuda")

    def raising(exc: Exception) -> Any:
        def least_squares(*args: Any, **kwargs: Any) -> Any:
            raise exc
        return least_squares

    monkeypatch.setattr(scipy.optimize, "least_squares", raising(ValueError("Residuals are not finite")))
    errors = ModelErrors()
    fallback = StepTimeModel.fit(trials, num_layers=LAYERS, device="cuda", errors=errors)
    assert fallback.k and fallback.k != expected.k  # the proportional start, as before
    assert errors.pending == [{"where": "step time", "error": "ValueError: Residuals are not finite"}]
    monkeypatch.setattr(scipy.optimize, "least_squares", raising(TypeError("bad argument")))
    with pytest.raises(TypeError):
        StepTimeModel.fit(trials, num_layers=LAYERS, device="cuda")


def test_the_study_keeps_the_last_errors_and_the_line_names_each_place():
    class Study:
        def __init__(self) -> None:
            self.user_attrs: dict[str, Any] = {}

        def set_user_attr(self, key: str, value: Any) -> None:
            self.user_attrs = {**self.user_attrs, key: value}

    study, errors = Study(), ModelErrors()
    errors.save(study)  # nothing caught: nothing written
    assert study.user_attrs == {}
    for i in range(MAX_KEPT_ERRORS + 5):
        errors.caught("step time", ValueError(f"x{i}"))
    errors.caught("holdout", np.linalg.LinAlgError("singular"))
    errors.save(study)
    kept = study.user_attrs[StudyAttr.MODEL_ERRORS]
    assert len(kept) == MAX_KEPT_ERRORS and kept[-1] == {"where": "holdout", "error": "LinAlgError: singular"}
    assert errors.pending == []
    assert model_errors_line(kept) == (f"models: {MAX_KEPT_ERRORS} fits failed (the last {MAX_KEPT_ERRORS} kept) (step time: "
                                       f"ValueError: x{MAX_KEPT_ERRORS + 4} ({MAX_KEPT_ERRORS - 1}x); holdout: LinAlgError: singular).")
    assert model_errors_line(None) is None and model_errors_line([]) is None
