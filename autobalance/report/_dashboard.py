"""optuna-dashboard over a study database, with the artifact store that holds the per-trial charts.

The charts live in a folder beside a SQLite file (see :func:`artifact_dir_for`). When a study
database was copied without that folder, each missing chart is re-rendered on demand from the
trial's own figures (its user attributes) into a temporary folder, and the dashboard says so when
it starts.
"""

from __future__ import annotations

import io
import json
import os
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, BinaryIO

from autobalance.report._artifacts import artifact_dir_for, render_trial_chart

__all__ = ["STORED_VALUE_ATTR", "ChartStore", "dashboard_app", "quiet_importance_warnings", "serve_dashboard", "shown_storage",
           "shown_values"]

_ARTIFACT_KEY = "artifacts:"  # optuna.artifacts' trial system attribute prefix


@dataclass(kw_only=True)
class _Missing:
    number: int
    filename: str
    attrs: dict[str, Any]


class ChartStore:
    """Optuna's artifact store protocol over the artifact folder, re-rendering a trial's chart from
    its figures when its file is missing."""

    def __init__(self, base_dir: str, missing: dict[str, _Missing]) -> None:
        from optuna.artifacts import FileSystemArtifactStore

        self.base_dir = base_dir
        self.missing = missing
        self._files = FileSystemArtifactStore(base_dir) if os.path.isdir(base_dir) else None
        self._rendered: dict[str, bytes] = {}
        self._lock = threading.Lock()
        self._tmp: str | None = None

    def open_reader(self, artifact_id: str) -> BinaryIO:
        from optuna.artifacts.exceptions import ArtifactNotFound

        if artifact_id in self.missing:
            return io.BytesIO(self._render(artifact_id))
        if self._files is None:
            raise ArtifactNotFound(f"no artifact folder {self.base_dir}")
        return self._files.open_reader(artifact_id)

    def write(self, artifact_id: str, content_body: BinaryIO) -> None:
        from optuna.artifacts import FileSystemArtifactStore

        os.makedirs(self.base_dir, exist_ok=True)
        self._files = self._files or FileSystemArtifactStore(self.base_dir)
        self._files.write(artifact_id, content_body)
        self.missing.pop(artifact_id, None)

    def remove(self, artifact_id: str) -> None:
        self.missing.pop(artifact_id, None)
        if self._files is not None:
            self._files.remove(artifact_id)

    def _render(self, artifact_id: str) -> bytes:
        from optuna.artifacts.exceptions import ArtifactNotFound

        with self._lock:  # matplotlib is not thread-safe; the server may be
            if artifact_id in self._rendered:
                return self._rendered[artifact_id]
            item = self.missing[artifact_id]
            self._tmp = self._tmp or tempfile.mkdtemp(prefix="autobalance-charts-")
            stem = os.path.join(self._tmp, os.path.splitext(item.filename)[0])
            path = render_trial_chart(item.attrs, number=item.number, path_stem=stem)
            if path is None or os.path.splitext(path)[1] != os.path.splitext(item.filename)[1]:
                raise ArtifactNotFound(f"trial {item.number}'s chart {item.filename} cannot be re-rendered here")
            with open(path, "rb") as fh:
                data = fh.read()
            os.unlink(path)
            self._rendered[artifact_id] = data
            return data


def missing_charts(storage: Any, base_dir: str) -> dict[str, _Missing]:
    """Artifact id -> the trial whose chart file is not in ``base_dir``, over every study."""
    from autobalance.store import study_id

    missing: dict[str, _Missing] = {}
    for study in storage.get_all_studies():
        for trial in storage.get_all_trials(study_id(study, storage), deepcopy=False):
            for key, value in trial.system_attrs.items():
                if not key.startswith(_ARTIFACT_KEY):
                    continue
                try:
                    meta = json.loads(value)
                except (TypeError, ValueError):
                    continue
                artifact_id = str(meta.get("artifact_id") or key[len(_ARTIFACT_KEY):])
                if not os.path.isfile(os.path.join(base_dir, artifact_id)):
                    missing[artifact_id] = _Missing(number=trial.number, filename=str(meta.get("filename") or ""),
                                                    attrs=dict(trial.user_attrs))
    return missing


SHOWN_ABOVE = (0.05, 0.15)
"""Where the dashboard draws infeasible trials: between 5 % and 15 % of the feasible trials' range of
values above the worst of them (see :func:`shown_values`)."""
STORED_VALUE_ATTR = "penalty_value (stored)"
"""The user attribute the dashboard shows on an infeasible trial: the value the study stores for it."""


def _violated(trial: Any) -> bool:
    constraints = trial.system_attrs.get("constraints")
    return bool(constraints) and any(float(c) > 0 for c in constraints)


def shown_values(trials: list[Any], *, maximize: list[bool]) -> dict[int, list[float]]:
    """Trial id -> the values the dashboard shows for each infeasible complete trial.

    The study stores an infeasible trial's objective as a penalty (at least that of a trial with no
    measurement, ``12`` for the demo, plus how far over it went), so that no view ranking by value
    ever puts it above a feasible one. Plotted as such, one penalty stretches the History chart and
    flattens every feasible trial. Shown here instead: just above the worst feasible value
    (:data:`SHOWN_ABOVE` of the feasible range, at least 1e-3), in the penalties' order, so the
    dashboard's best trial, Pareto front and order are unchanged and the chart is scaled to the
    feasible trials; the stored value stays in the trial's attributes (:data:`STORED_VALUE_ATTR`).
    Empty when the study has no feasible or no infeasible complete trial."""
    complete = [t for t in trials if t.state.name == "COMPLETE" and t.values is not None]
    feasible = [t for t in complete if not _violated(t)]
    infeasible = [t for t in complete if _violated(t)]
    if not feasible or not infeasible:
        return {}
    shown: dict[int, list[float]] = {t.number: list(t.values) for t in infeasible}
    for k, up in enumerate(maximize):
        sign = -1.0 if up else 1.0  # in "worse is larger" terms
        good = [sign * float(t.values[k]) for t in feasible]
        worst, span = max(good), max(good) - min(good)
        span = span if span > 0 else max(abs(worst) * 0.1, 1e-3)
        ranks = sorted({sign * float(t.values[k]) for t in infeasible})
        low, high = SHOWN_ABOVE
        for t in infeasible:
            rank = ranks.index(sign * float(t.values[k]))
            frac = low + (high - low) * (rank / max(len(ranks) - 1, 1))
            shown[t.number][k] = sign * (worst + frac * span)
    return shown


def _forwarded(name: str) -> Any:
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        return getattr(self._inner, name)(*args, **kwargs)

    method.__name__ = name
    return method


def shown_storage(inner: Any) -> Any:
    """``inner`` (an Optuna storage) as the dashboard reads it: every call passed through, but the
    trials it returns show infeasible trials' values by :func:`shown_values` (their stored value in
    :data:`STORED_VALUE_ATTR`), and the best trial is the best of those."""
    import copy

    from optuna.storages import BaseStorage
    from optuna.trial import TrialState

    names = [n for n in dir(BaseStorage) if not n.startswith("_") and callable(getattr(BaseStorage, n))]
    namespace: dict[str, Any] = {n: _forwarded(n) for n in names}

    def __init__(self: Any, storage: Any) -> None:
        self._inner = storage

    def __getattr__(self: Any, name: str) -> Any:  # anything else of the storage (its engine, ...)
        return getattr(self.__dict__["_inner"], name)

    def get_all_trials(self: Any, study_id: int, deepcopy: bool = True, states: Any = None) -> list[Any]:
        trials = self._inner.get_all_trials(study_id, deepcopy=False)
        maximize = [d.name == "MAXIMIZE" for d in self._inner.get_study_directions(study_id)]
        shown = shown_values(trials, maximize=maximize)
        out = []
        for t in trials:
            if states is not None and t.state not in states:
                continue
            if t.number in shown:
                t = copy.copy(t)
                t.user_attrs = {**t.user_attrs, STORED_VALUE_ATTR: t.values[0] if len(t.values) == 1 else list(t.values)}
                t.values = shown[t.number]
            elif deepcopy:
                t = copy.deepcopy(t)
            out.append(t)
        return out

    def get_best_trial(self: Any, study_id: int) -> Any:
        """The study's best trial (``protocol.rank_trials``: one meaning of best), as shown; before
        any is feasible, the trial shown best (the least over its limits)."""
        from autobalance.protocol import StudyAttr, rank_trials

        trials = get_all_trials(self, study_id, deepcopy=False, states=(TrialState.COMPLETE,))
        if not trials:
            raise ValueError("No trials are completed yet.")
        objective = self._inner.get_study_user_attrs(study_id).get(StudyAttr.OBJECTIVE, {})
        ranked = rank_trials(self._inner.get_all_trials(study_id, deepcopy=False), objective)
        if ranked:
            return next(t for t in trials if t.number == ranked[0].number)
        up = self._inner.get_study_directions(study_id)[0].name == "MAXIMIZE"
        return (max if up else min)(trials, key=lambda t: t.values[0])

    namespace.update(__init__=__init__, __getattr__=__getattr__, get_all_trials=get_all_trials,
                     get_best_trial=get_best_trial)
    cls = type("ShownStorage", (BaseStorage,), namespace)
    return cls(inner)


def quiet_importance_warnings() -> None:
    """The dashboard computes parameter importances (PED-ANOVA) on every refresh; with a handful of
    trials Optuna warns each time that a parameter's regimes have fewer than 2 trials, or that the
    quantiles select the same trials. Those warnings say the chart is rough, which the dashboard's
    own chart shows; they are not the user's to act on, so they stay out of the terminal."""
    import warnings

    for message in (r"Some regimes for parameter", r"Target and region quantiles select the same set",
                    r"The number of trials is too small to compute importances"):
        warnings.filterwarnings("ignore", message=message, category=UserWarning)


def dashboard_app(storage_url: str, *, warn: Callable[[str], None] | None = None) -> Any:
    """optuna-dashboard's WSGI application for ``storage_url`` and its artifact directory.
    ``warn`` hears one line when charts are missing from the artifact folder (re-rendered on demand)."""
    try:
        import optuna_dashboard
    except ImportError:
        from autobalance._errors import UsageError

        raise UsageError("the dashboard needs optuna-dashboard; install it with pip install -e '.[report]' in the autobalance clone (or pip install optuna-dashboard).") from None

    from autobalance.store import open_storage

    storage = open_storage(storage_url, heartbeat=False)
    art_dir = artifact_dir_for(storage_url)
    missing = missing_charts(storage, art_dir)
    if missing and warn is not None:
        where = "is missing" if not os.path.isdir(art_dir) else f"lacks {len(missing)} of them"
        warn(f"warning: the per-trial charts' folder {art_dir} {where} (was the database copied without it?); "
             f"{len(missing)} chart(s) will be re-rendered from the trials' figures when opened.")
    quiet_importance_warnings()
    return optuna_dashboard.wsgi(shown_storage(storage), artifact_store=ChartStore(art_dir, missing))


def serve_dashboard(storage_url: str, *, host: str = "127.0.0.1", port: int = 8080,
                    echo: Callable[[str], None] = print, warn: Callable[[str], None] | None = None) -> None:
    """Serve the dashboard until interrupted (wsgiref, as ``optuna_dashboard.run_server`` does).
    ``warn`` (default: stderr) hears about charts missing from the artifact folder."""
    import sys
    from wsgiref.simple_server import WSGIRequestHandler, make_server

    from autobalance._errors import UsageError
    from autobalance.store import mask_url

    app = dashboard_app(storage_url, warn=warn or (lambda text: print(text, file=sys.stderr)))

    class _Quiet(WSGIRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass

    try:
        server = make_server(host, port, app, handler_class=_Quiet)
    except OSError as exc:
        raise UsageError(f"cannot listen on {host}:{port} ({exc.strerror or exc}); pick another --port.") from None
    shown = f"[{host}]" if ":" in host else host
    echo(f"optuna-dashboard for {mask_url(storage_url)} at http://{shown}:{server.server_port}/dashboard "
         f"(artifacts in {artifact_dir_for(storage_url)}). Ctrl-C to stop.")
    # requests are served on a thread; the main thread only waits, so Ctrl-C (delivered to the main
    # thread) never lands inside a request's database calls, where it could leave a lock held and the
    # exit hanging (seen once under load: the quick start's dashboard did not end within 60 s of SIGINT)
    serving = threading.Thread(target=server.serve_forever, name="autobalance-dashboard", daemon=True)
    serving.start()
    try:
        while serving.is_alive():
            serving.join(timeout=0.5)
    except KeyboardInterrupt:
        pass
    finally:
        server.shutdown()  # the request in progress ends first
        server.server_close()
