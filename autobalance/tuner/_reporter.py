"""Progress of a study on the terminal: one line per trial plus a live bar.

**Notes.** A trial's ``outcome`` in words, and optuna-dashboard notes on the study and its trials: the study's note
and the best trial's say why it won; a trial that ran out of memory, went over the limit or was predicted to says
so in one line at the top of its page. Notes are Markdown kept in the study's system attributes (optuna-dashboard's
format); a note a person wrote in the dashboard is never overwritten: autobalance only rewrites notes that carry
its own last line (:data:`SIGNATURE`).

**Roles.** What the trial loop needs of the parts it is handed: the console (:class:`Reporter`), the search's
advisor (:class:`Advisor`) and the multi-node coordinator (:class:`TrialCoordinator`). Each is a
``typing.Protocol``: ``RichReporter``, ``ModelAdvisor`` and ``launcher.Coordinator`` satisfy them without naming
them, and a test or another front end may hand in anything that has these methods.
"""

from __future__ import annotations

import itertools
import threading
import time
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from optuna.trial import FrozenTrial
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    TextColumn,
    TimeElapsedColumn,
)
from rich.text import Text

from autobalance._config import BalanceConfig, describe_config
from autobalance.protocol import Status, TrialAttr, memory_text, over_limit, trial_ranks
from autobalance.tuner._settings import TuneSettings
from autobalance.tuner._time_spent import describe_budget
from autobalance.tuner.search import REASON_CHARS

if TYPE_CHECKING:
    import optuna

    from autobalance.launcher import TrialLaunch, TrialOutcome
    from autobalance.tuner.search import Decision, TrialFigures

__all__ = ["REASON_CHARS", "SIGNATURE", "Advisor", "NullReporter", "Reporter", "RichReporter", "TrialCoordinator",
           "cap_line", "clip_words", "outcome_lines", "short_figures", "time_left_text", "trial_outcome",
           "write_notes"]

_STYLE = {Status.OK: "green", Status.OOM: "red", Status.TIMEOUT: "red", Status.ERROR: "bold red",
          Status.CRASH: "yellow", Status.PREDICTED_OOM: "magenta", Status.INTERRUPTED: "yellow"}


def clip_words(text: str, limit: int = REASON_CHARS) -> str:
    """``text`` on one line, whole when it fits in ``limit`` characters; else cut at the last word boundary
    before ``limit`` and ended with ``...`` (a single word longer than ``limit`` is kept whole)."""
    text = " ".join(str(text).split())
    if len(text) <= limit:
        return text
    cut = text.rfind(" ", 0, limit - 3)
    if cut <= 0:
        after = text.find(" ", limit - 3)
        return text if after < 0 else text[:after] + " ..."
    return text[:cut].rstrip(" ,;:([{") + " ..."


def short_figures(trial: FrozenTrial) -> str:
    """``peaks [r0=12.1 GiB r1=11.0 GiB]  spread 1.10 GiB  step 205.0 ms`` (each size in the unit its size
    calls for: ``r0=10.6 MiB``); one rank: no spread."""
    a = trial.user_attrs
    peaks = a.get(TrialAttr.PEAK_DEVICE_GIB) or []
    peak_txt = " ".join(f"r{r}={memory_text(p)}" for r, p in enumerate(peaks))
    parts = [f"peaks [{peak_txt}]"] if peaks else []
    if a.get(TrialAttr.SPREAD_GIB) is not None and trial_ranks(a) > 1:
        parts.append(f"spread {memory_text(a['spread_gib'])}")
    if a.get(TrialAttr.STEP_TIME_MS) is not None:
        parts.append(f"step {a['step_time_ms']:.1f} ms")
    if a.get(TrialAttr.COMPILE_S) is not None:
        parts.append(f"compile {a['compile_s']:.1f} s")
    return "  ".join(parts)


def cap_line(settings: TuneSettings) -> str | None:
    """The study's emulated memory cap in one line (None without one): what every trial must fit in."""
    caps = settings.memory_cap_gib
    if not caps:
        return None
    usable = [c * (1 - settings.headroom) for c in caps]
    if len(caps) == 1:
        what = f"{memory_text(caps[0])} per rank ({memory_text(usable[0])} usable"
    else:
        what = ", ".join(f"rank {r} {memory_text(c)}" for r, c in enumerate(caps)) + \
            f" ({', '.join(memory_text(u) for u in usable)} usable"
    mode = "ranks run under it" if settings.cap_mode == "enforce" else "peaks judged against it"
    named = [c for c in settings.memory_cap or [] if not any(ch.isdigit() for ch in c[:1])]  # a card's name
    card = f" ({', '.join(named)})" if named else ""
    return (f"Emulated memory cap{card}: {what} with {settings.headroom:.0%} headroom; {mode}): "
            "a trial over it is infeasible.")


class TimeLeftColumn(ProgressColumn):
    """What is left of the time budget, live (``12:30 left``; once spent: no new trials)."""

    def __init__(self, deadline: float) -> None:
        super().__init__()
        self.deadline = deadline

    def render(self, task: Any) -> Text:
        return Text(time_left_text(self.deadline - time.monotonic()), style="cyan")


def time_left_text(seconds: float) -> str:
    """``12:30 left``, ``1:02:03 left``; ``budget spent, finishing`` at or below zero."""
    if seconds <= 0:
        return "budget spent, finishing"
    hours, rest = divmod(int(seconds), 3600)
    minutes, secs = divmod(rest, 60)
    return (f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}") + " left"


class RichReporter:
    """Thread-safe: with parallel trials every slot reports through the same instance."""

    def __init__(self, *, console: Console | None = None) -> None:
        self.console = console or Console(stderr=True)
        self._progress: Progress | None = None
        self._task: Any = None
        self._best_text = "best: -"
        self._lock = threading.RLock()
        self._running: dict[int, float] = {}
        self._deadline: float | None = None
        self._study_name = ""
        self._clipped = False

    def begin(self, settings: TuneSettings, *, already: int, deadline: float | None = None) -> None:
        """``deadline``: when the time budget ends (``time.monotonic()``; None: no budget)."""
        self._deadline = deadline
        self._study_name = settings.study_name
        budget = "" if settings.time_budget_s is None else f"  time budget {describe_budget(settings.time_budget_s)}"
        self.console.print(
            f"[bold]autobalance tune[/] {settings.script}  study [cyan]{settings.study_name}[/]  "
            f"{settings.world_size} ranks on {settings.device}  {settings.trials} trials"
            + (f" (all {already} done before: nothing to run; --trials {already + 10} runs 10 more)"
               if already >= settings.trials else f" ({already} done before)" if already else "") + budget
        )
        if cap := cap_line(settings):
            self.console.print(escape(cap))
        if settings.about:
            self.console.print(f"[bold]{escape(settings.about)}[/]")
        columns: list[Any] = [TextColumn("[bold]trials"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
        if deadline is not None:
            columns.append(TimeLeftColumn(deadline))
        self._progress = Progress(*columns, TextColumn("{task.description}"), console=self.console, transient=True)
        self._progress.start()
        self._task = self._progress.add_task(self._best_text, total=settings.trials, completed=already)

    def start(self, number: int, config: BalanceConfig | None, *, baseline: bool = False, why: str = "") -> None:
        """``why``: who proposed the trial and what it predicted (``search.proposal_line``)."""
        label = "baseline (the script's own configuration)" if baseline else describe_config(config)
        left = "" if self._deadline is None else f"  [dim]({time_left_text(self._deadline - time.monotonic())})[/]"
        reason = rf"  [dim]\[{escape(why)}][/]" if why else ""
        with self._lock:
            self.console.print(f"[dim]trial {number}[/] {escape(label)} ...{reason}{left}")

    def tick(self, number: int, elapsed: float) -> None:
        with self._lock:
            self._running[number] = elapsed
            if self._progress is not None:
                running = ", ".join(f"trial {n}: {e:.0f}s" for n, e in sorted(self._running.items()))
                self._progress.update(self._task, description=f"{self._best_text}  [dim]({running})[/]")

    def finish(self, trial: FrozenTrial, best: FrozenTrial | None, *, reused: bool = False,
               predicted: bool = False) -> None:
        a = trial.user_attrs
        status = a.get(TrialAttr.STATUS, "?")
        extra = f" (same config as trial {a.get('reused_from')}, not re-run)" if reused else ""
        if predicted:
            extra = (f" (implied by trial {a.get('dominated_by')}, not launched)"
                     if a.get(TrialAttr.PREDICTED_BY) == "dominance"
                     else " (predicted by the memory model, not launched)")
        full = "" if status == Status.OK else " ".join(str(a.get("reason", "")).split())
        shown_reason = clip_words(full)
        reason = f"  [dim]{escape(shown_reason)}[/]" if shown_reason else ""
        over = over_limit(a)  # ran to the end, infeasible all the same: not a plain "ok"
        shown = f"[{_STYLE.get(status, 'white')}]{status}[/]" if over is None else f"[red]{status}, {escape(over)}[/]"
        with self._lock:
            self._running.pop(trial.number, None)
            self.console.print(f"  trial {trial.number} {shown}{escape(extra)}  {escape(short_figures(trial))}{reason}")
            if shown_reason != full and not self._clipped:  # once: where the whole reason is
                self._clipped = True
                name = f" --study-name {self._study_name}" if self._study_name else ""
                where = f"(a reason cut with ... reads whole in `autobalance trials{name}`)"
                self.console.print(f"  [dim]{escape(where)}[/]")
            if best is not None:
                b = best.user_attrs
                self._best_text = f"best #{best.number}: {b.get('step_time_ms', 0):.1f} ms" + (
                    f", spread {memory_text(b.get('spread_gib', 0))}" if trial_ranks(b) > 1 else "")
            if self._progress is not None and not predicted:
                self._progress.update(self._task, advance=0 if reused else 1, description=self._best_text)

    def note(self, text: str) -> None:
        with self._lock:
            self.console.print(f"[dim]{escape(text)}[/]")

    def end(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


# -------------------------------------------- each trial's outcome in words, and the study's notes
SIGNATURE = "_(note written by autobalance)_"


def trial_outcome(attrs: dict[str, Any]) -> str:
    """The ``outcome`` user attribute: what became of the trial in a few words (``ok``, ``over limit
    (rank 0)``, ``OOM (rank 1)``, ``predicted OOM (not run)``, ...), from its other attributes."""
    from autobalance.report import outcome_label

    peaks = attrs.get(TrialAttr.PEAK_DEVICE_GIB) or []
    usable = attrs.get(TrialAttr.USABLE_GIB) or []
    ratios = [(float(p) / float(u), r) for r, (p, u) in enumerate(zip(peaks, usable, strict=False)) if p is not None and u]
    many = len(peaks) > 1
    return outcome_label(status=str(attrs.get(TrialAttr.STATUS)), feasible=bool(attrs.get(TrialAttr.FEASIBLE)),
                         failing_rank=attrs.get(TrialAttr.FAILING_RANK) if many else None,
                         worst_rank=max(ratios)[1] if ratios and many else None,
                         predicted=bool(attrs.get(TrialAttr.PREDICTED)), reused_from=attrs.get(TrialAttr.REUSED_FROM))


_KIND_ORDER = ("ok", "over limit", "OOM", "predicted OOM")


def _numbers(numbers: list[int]) -> str:
    """``#1, #3–#7, #9``: runs of three or more consecutive trials as a range."""
    parts: list[str] = []
    for _, pairs in itertools.groupby(enumerate(sorted(set(numbers))), lambda p: p[1] - p[0]):
        run = [n for _, n in pairs]
        parts += [f"#{run[0]}–#{run[-1]}"] if len(run) >= 3 else [f"#{n}" for n in run]
    return ", ".join(parts)


def outcome_lines(rows: list[Any]) -> list[str]:
    """Every trial's outcome, grouped (optuna-dashboard badges every trial "Complete"): one line per outcome,
    ``ok`` first, then over the limit, OOM, predicted, then anything else (timeout, error, pruned, ...).
    ``OOM (rank 1): #4, #6``; a reused measurement counts as its outcome (``ok: #1, #9 (as #1)``)."""
    groups: dict[str, list[int]] = {}
    reused: dict[str, list[str]] = {}
    for row in rows:
        label = row.outcome
        if row.reused_from is not None:
            label = label.removesuffix(f", as #{row.reused_from}")
            reused.setdefault(label, []).append(f"#{row.number} (as #{row.reused_from})")
            groups.setdefault(label, [])
        else:
            groups.setdefault(label, []).append(row.number)

    def order(label: str) -> tuple[int, str]:
        kind = next((i for i, k in enumerate(_KIND_ORDER) if label == k or label.startswith(k + " ")), len(_KIND_ORDER))
        return kind, label

    return [f"{label}: " + ", ".join(p for p in (_numbers(groups[label]), *reused.get(label, [])) if p)
            for label in sorted(groups, key=order)]


def note_for(row: Any, summary: Any, why: list[str]) -> str:
    """The Markdown note of one trial ("" for a plain trial that fits and did not win)."""
    if summary.best is not None and row.number == summary.best.number:
        lines = ["**Best trial: why it won**", "", *[f"- {s}" for s in why]]
    elif row.predicted:
        lines = [f"**{row.outcome}**: {row.reason or 'judged out of memory without launching'}.",
                 "", "Its peaks are predictions (or a lower bound from another trial), not measurements."]
    elif row.status == Status.OK and row.feasible:
        return ""
    elif row.status == Status.OK:
        from autobalance.report import excluded_reason

        lines = [f"**{row.outcome}**: {excluded_reason(row, summary)}."]
    else:
        lines = [f"**{row.outcome}**: {row.reason or row.status}."]
        if row.status == Status.OOM:
            lines += ["", "Its peaks are lower bounds (the rank stopped when it ran out)."]
    return "\n".join([*lines, "", SIGNATURE])


def write_notes(study: Any) -> int:
    """(Re)write the autobalance notes of ``study`` that changed; returns how many were written.
    Without optuna-dashboard installed this does nothing; a failure only warns."""
    try:
        from autobalance.store import dashboard_notes

        get_note_from_system_attrs, note_ver_key, save_note_with_version = dashboard_notes()
    except ImportError:
        return 0
    try:
        from autobalance.report import summarize, why_this_one
        from autobalance.store import storage_of, study_id, trial_id

        summary = summarize(study)
        why = why_this_one(summary, script=summary.script or "SCRIPT")
        storage = storage_of(study)
        sid = study_id(study)
        system = storage.get_study_system_attrs(sid)
        trials = {t.number: t for t in study.get_trials(deepcopy=False)}
        wanted: list[tuple[int | None, str]] = [(trial_id(trials[row.number]), note_for(row, summary, why))
                                                for row in summary.rows]
        best = summary.best
        head = (f"**autobalance: trial {best.number} is the best**" if best is not None
                else "**autobalance: no configuration fits yet**")
        outcomes = [f"**Trials by outcome** ({len(summary.rows)}; optuna-dashboard marks them all Complete)", "",
                    *[f"- {line}" for line in outcome_lines(summary.rows)]]
        wanted.append((None, "\n".join([head, "", *[f"- {s}" for s in why], "", *outcomes, "", SIGNATURE])))  # the study's note
        written = 0
        for note_trial, body in wanted:
            current = get_note_from_system_attrs(system, note_trial)
            if current["body"] == body or (current["body"] and not current["body"].endswith(SIGNATURE)):
                continue  # unchanged, or a person's own note
            save_note_with_version(storage, sid, note_trial, int(system.get(note_ver_key(note_trial), 0)) + 1, body)
            written += 1
        return written
    except Exception as exc:  # notes are a courtesy: never fail a study over them
        warnings.warn(f"autobalance: the dashboard notes of {study.study_name!r} were not written ({exc})", stacklevel=2)
        return 0


# ------------------------------------------------------ the parts the loop is handed, as Protocols
class Reporter(Protocol):
    """The console of a ``tune`` run: told when the study begins, each trial starts, runs and ends
    (its methods do nothing: :class:`NullReporter` is this protocol as a class)."""

    def begin(self, settings: TuneSettings, *, already: int, deadline: float | None = None) -> None:
        return None

    def start(self, number: int, config: BalanceConfig | None, *, baseline: bool = False, why: str = "") -> None:
        return None

    def tick(self, number: int, elapsed: float) -> None:
        return None

    def note(self, text: str) -> None:
        return None

    def finish(self, trial: FrozenTrial, best: FrozenTrial | None, *, reused: bool = False,
               predicted: bool = False) -> None:
        return None


class NullReporter(Reporter):
    """A :class:`Reporter` that says nothing (a ``Tuner`` handed none)."""


class Advisor(Protocol):
    """The search's advisor (the ``model`` strategy): proposes before each ask, predicts a configuration
    that cannot fit, learns from each trial, and says how well its models held out."""

    def before_ask(self, study: optuna.Study, decision: Decision | None = None) -> None:
        """Enqueue the next trial, chosen over ``decision`` (the study read once, the models fitted
        once, the time budget)."""
    def predict_infeasible(self, study: optuna.Study,
                           config: BalanceConfig) -> tuple[TrialFigures, dict[str, Any]] | None: ...
    def after_trial(self, study: optuna.Study, trial: FrozenTrial) -> None: ...
    def holdout_error(self, study: optuna.Study) -> float | None: ...
    def compiled_holdout_error(self, study: optuna.Study) -> tuple[float, int] | None: ...


class TrialCoordinator(Protocol):
    """Runs one trial over several nodes (``launcher.Coordinator``): started once, closed at the end."""

    def start(self) -> None: ...
    def run(self, launch: TrialLaunch, *, on_poll: Callable[[float], bool | None] | None = None) -> TrialOutcome: ...
    def close(self) -> None: ...
