"""The errors a model's fit (or a solver on its figures) can raise, and where the ones the search
survives are kept.

A fit that fails leaves the search with a fallback (no memory model yet, the proportional step-time
start, no proposal from that split). Only :data:`FIT_ERRORS` are caught, never a programming error
(``TypeError``, ``AttributeError``, ...); each is noted in a :class:`ModelErrors`, saved in the
study (:data:`StudyAttr.MODEL_ERRORS`) and said in the summary (:func:`model_errors_line`)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

import numpy as np

from autobalance._errors import UsageError
from autobalance.protocol import StudyAttr
from autobalance.tuner.search._constants import MAX_ERROR_TEXT, MAX_KEPT_ERRORS

__all__ = ["FIT_ERRORS", "MAX_KEPT_ERRORS", "ModelErrors", "attempt", "model_errors_line"]

FIT_ERRORS: tuple[type[Exception], ...] = (np.linalg.LinAlgError, ValueError, ArithmeticError, UsageError)
"""What a fit or a solver raises on data it cannot use: ``LinAlgError`` (an SVD or least squares
that does not converge), ``ValueError`` (scipy's ``least_squares`` on values that are not finite, an
empty or ill-shaped array), ``ArithmeticError`` (a division by a zero measurement, an overflow), and
autobalance's refusals of an observation, a limit or a configuration (``UsageError``,
``ConfigError``)."""

_T = TypeVar("_T")
_P = ParamSpec("_P")


class ModelErrors:
    """The fit errors the search caught since the last :meth:`save`; one per advisor."""

    def __init__(self) -> None:
        self.pending: list[dict[str, str]] = []

    def caught(self, where: str, exc: BaseException) -> None:
        """Note that ``where`` (``holdout``, ``step time``, ...) fell back after ``exc``."""
        self.pending.append({"where": where, "error": f"{type(exc).__name__}: {exc}"[:MAX_ERROR_TEXT]})

    def save(self, study: Any) -> None:
        """Add the pending errors to the study's (the last :data:`MAX_KEPT_ERRORS` kept)."""
        if not self.pending:
            return
        kept = list(study.user_attrs.get(StudyAttr.MODEL_ERRORS) or [])
        study.set_user_attr(StudyAttr.MODEL_ERRORS, [*kept, *self.pending][-MAX_KEPT_ERRORS:])
        self.pending = []


def attempt(errors: ModelErrors | None, where: str, fit: Callable[_P, _T], /,
            *args: _P.args, **kwargs: _P.kwargs) -> _T | None:
    """``fit(*args, **kwargs)``, or None after one of :data:`FIT_ERRORS` (noted in ``errors``, if any)."""
    try:
        return fit(*args, **kwargs)
    except FIT_ERRORS as exc:
        if errors is not None:
            errors.caught(where, exc)
        return None


def model_errors_line(entries: list[dict[str, Any]] | None) -> str | None:
    """One line for the summary: ``models: 2 fits failed (holdout: LinAlgError: SVD did not converge; ...)``
    (each place once, its latest error); None when no fit failed."""
    if not entries:
        return None
    latest = {str(entry.get("where")): str(entry.get("error")) for entry in entries}
    counts = Counter(str(entry.get("where")) for entry in entries)
    count = len(entries)
    more = f" (the last {MAX_KEPT_ERRORS} kept)" if count >= MAX_KEPT_ERRORS else ""
    places = "; ".join(f"{where}: {error}" + (f" ({counts[where]}x)" if counts[where] > 1 else "")
                       for where, error in latest.items())
    return f"models: {count} fit{'s' if count != 1 else ''} failed{more} ({places})."
