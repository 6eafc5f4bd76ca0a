"""Settings of one ``autobalance tune`` run: flags > study TOML > defaults.

**Preflight.** Before ``tune`` starts anything: the GPUs and memory caps against this host, the runs directory,
the storage. Each failure is a :class:`~autobalance._errors.UsageError` or
:class:`~autobalance._errors.StorageError` naming the flag to change, raised before any trial.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import inspect
import itertools
import math
import os
import re
import tempfile
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Literal, get_args, get_origin, get_type_hints

from autobalance._config import COMPILE_MODES, CUDA_GRAPH_MODES, DTYPES
from autobalance._errors import StorageError, UsageError
from autobalance._files import is_int, is_number

__all__ = ["CHOICES", "GPU_MEMORY_GIB", "SettingDoc", "TuneSettings", "check_caps", "check_gpus", "default_device",
           "load_toml", "memory_cap_text", "parse_memory_cap", "preflight", "setting_docs", "setting_types"]


@dataclass(kw_only=True)
class TuneSettings:
    """Everything ``autobalance tune`` needs; validated on construction."""

    script: str
    """The training script, which calls ``autobalance.plan`` (default: the ``script`` key of the study TOML)."""
    script_args: list[str] = field(default_factory=list)
    """Arguments for the script (default: none)."""
    trials: int = 20
    """Total trials of the study (a re-run continues up to this total)."""
    nproc_per_node: int = 2
    """Ranks per node."""
    nnodes: int = 1
    """Nodes per trial (multi-node trials use a c10d rendezvous)."""
    node_rank: int | None = None
    """This node's rank for a static multi-node launch (default: none, the rendezvous assigns it)."""
    rdzv_endpoint: str | None = None
    """``HOST:PORT`` of the rendezvous for multi-node trials (default: none)."""
    torchrun_args: list[str] = field(default_factory=list)
    """Extra torchrun options, passed through (default: none)."""
    device: Literal["cpu", "cuda", "auto"] = "auto"
    """``cpu``, ``cuda`` or ``auto`` (cuda when a GPU is visible, else cpu)."""
    global_batch: int | None = None
    """Samples per optimizer step (default: the script's own)."""
    steps: int = 3
    """Measured optimizer steps per trial."""
    warmup: int = 1
    """Warm-up optimizer steps per trial (not timed)."""
    measure_s: float | str = "auto"
    """Measure each trial for about this many seconds (at least ``steps``, at most ``max_steps`` measured steps);
    0: exactly ``steps``. ``auto``: on CUDA, 7/3 of the study's per-trial overhead so far (start-up and hand-over
    outside the steps: the steps then take >= 70 % of a trial), at most 2 s; on CPU, 0."""
    max_steps: int = 50
    """Upper bound on measured steps per trial when ``measure_s`` lengthens the measurement."""
    remeasure: Literal["auto", "on", "off"] = "auto"
    """Run a trial a second time (steps pooled) when its steps spread (IQR > 5 % of the median) or it
    would become the best: ``on``, ``off``, or ``auto`` (on CUDA on; on CPU off, where step times of a
    shared machine are noise and a second run only doubles the study)."""
    storage: str = "sqlite:///autobalance.db"
    """SQLAlchemy URL of the Optuna study and the saved configurations."""
    study_name: str = ""
    """Study name (default: derived from the script's path)."""
    trial_timeout: float = 300.0
    """Hard wall-clock limit per trial in seconds (start-up included)."""
    time_budget: float | str | None = None
    """Wall-clock budget of this run of the study, verification included: ``90s``, ``10m``, ``1.5h`` or seconds. A
    trial starts only while the time left holds the next trial (the median one so far) and the best trial's
    verification as predicted from the study's own trials; running trials finish (``trial_timeout`` still applies),
    then the best is verified and saved as usual (default: none, no limit)."""
    about: str | None = None
    """One line printed under the study's first lines: what the study is about to show, said by a
    study TOML for whoever runs it (default: none)."""
    memory_cap: list[str] | None = None
    """Emulated capacity per rank, in the units you think in: a size (``20GiB``, ``60MiB``; GB and MB are powers of
    ten) or a GPU model whose memory is known (``A100-40GB``, ``H100-80GB``, ``L4`` ...): one for every rank or one
    per rank. Leave it out on the card you will train on (default: the card's capacity; on CPU the host's memory)."""
    memory_cap_gib: list[float] | None = None
    """The same cap in plain GiB (``0.06`` is 61.4 MiB): one value for every rank or one per rank
    (default: the card's capacity; on CPU the host's memory)."""
    cap_mode: Literal["enforce", "judge"] = "enforce"
    """``enforce``: ranks run under the cap (allocator fraction / CPU budget) and really OOM;
    ``judge``: ranks run uncapped and a peak above the cap is judged infeasible (no OOM, no restarts)."""
    headroom: float = 0.05
    """Fraction of capacity that must stay free; more is infeasible."""
    weight_spread: float = 1.0
    """Objective weight of the memory spread (fraction of capacity)."""
    weight_time: float = 1.0
    """Objective weight of the step time (relative to the baseline's)."""
    max_spread_gib: float | None = None
    """Also infeasible: a spread of peak memory above this many GiB (default: none, the spread only
    counts in the objective)."""
    multi_objective: bool = False
    """Spread and step time as two objectives (a Pareto front) instead of a weighted sum."""
    strategy: Literal["model", "optuna"] = "model"
    """``model``: memory-model-guided search (balanced splits, predicted OOMs skipped); ``optuna``: the sampler alone."""
    sampler: Literal["tpe", "gp", "random", "nsga2"] = "tpe"
    """Optuna sampler: tpe, gp, random or nsga2."""
    seed: int | None = None
    """Sampler seed, for reproducible studies (default: none, a fresh seed each run)."""
    dtypes: list[str] | None = None
    """AMP dtypes to search (default: all the device supports)."""
    max_accumulation: int = 8
    """Largest gradient-accumulation count searched."""
    split: Literal["any", "equal"] = "any"
    """How a rank's samples of a step may be split over its micro-steps: ``any`` (any global batch
    and accumulation; micro-batches differ by at most one, e.g. 32 = 6,6,5,5,5,5) or ``equal``
    (equal micro-batches only: the accumulation divides the global batch)."""
    on_error: Literal["stop", "continue"] = "stop"
    """After successful trials, a script error: ``stop`` the study or ``continue`` (mark it failed)."""
    cold: bool = False
    """One torchrun job per trial instead of the warm worker pool (always cold for multi-node trials)."""
    prune_factor: float = 1.5
    """Stop a trial once its median measured step is this many times the best trial's step time (0: never)."""
    runs_dir: str = "autobalance_runs"
    """Where trial directories (reports, logs) are kept."""
    compile: Literal["off", "on", "search"] | None = None
    """``torch.compile`` in the search: ``off`` (eager only), ``on`` (every trial compiled, with a
    per-rank activation budget), ``search`` (both) (default: ``search`` on CUDA, ``off`` on CPU). On
    CPU a compile costs tens of seconds per configuration and rarely pays off."""
    compile_mode: str = "default"
    """The ``torch.compile`` mode of compiled trials: ``default``, ``max-autotune-no-cudagraphs``,
    ``reduce-overhead`` (CUDA graphs, world size 1), or ``auto``: ``default``, and on a GPU at world
    size 1 CUDA graphs too, measured once against the study's best default-mode trial and proposed
    further only where they pay (``tuner/search/_models.py``: ``graph_probe``; not the default until GPU studies
    show it pays, ``docs/compile.md``)."""
    compile_scope: Literal["search", "whole", "regional"] = "search"
    """What compiled trials compile: ``whole`` (the model as one region), ``regional`` (each repeated
    block on its own, identical blocks sharing one compile, plus the loss ``plan.wrap(loss=...)`` owns:
    about a third of the compile time) or ``search`` (both, when the model has repeated blocks;
    ``docs/compile.md`` says when each wins)."""
    verify: bool = True
    """Before the best configuration is saved, prove with ``autobalance verify`` that it computes the
    baseline's update (a failing configuration is never saved)."""
    allow_batch_dependent: bool = False
    """With batch-dependent layers (BatchNorm and its kind), search splits and accumulation anyway:
    they change those layers' train-mode step (batch statistics), so such configurations are verified
    in eval mode. Off: the split and accumulation stay the script's own."""
    gpus_per_trial: int | None = None
    """Run floor(visible GPUs / K) one-node trials at once, each on its own K GPUs (default: none,
    one trial at a time)."""
    cpus_per_trial: int | None = None
    """Run floor(usable cores / K) one-node trials at once, each pinned to its own K cores (default:
    none, one trial at a time)."""

    def __post_init__(self) -> None:
        if not self.script.endswith(".py"):
            raise UsageError(f"SCRIPT={self.script!r} is not a Python file; pass the training script, e.g. train.py.")
        if not os.path.isfile(self.script):
            raise UsageError(f"SCRIPT={self.script!r} does not exist; check the path.")
        if self.about is not None and (not isinstance(self.about, str) or "\n" in self.about or len(self.about) > 300):
            raise UsageError(f"--about={str(self.about)[:60]!r}... is not one line of at most 300 characters; shorten it.")
        self._positive("trials", "nproc_per_node", "nnodes", "steps")
        if isinstance(self.measure_s, str) and self.measure_s != "auto":
            try:
                self.measure_s = float(self.measure_s)
            except ValueError:
                raise UsageError(f"--measure-s={self.measure_s!r} is not a number of seconds; use e.g. 1.5, 0 (off) "
                                 "or auto.") from None
        if not isinstance(self.measure_s, str) and not (0 <= float(self.measure_s) < 3600):
            raise UsageError(f"--measure-s={self.measure_s!r} must be between 0 and 3600 seconds; use e.g. 1.5, 0 "
                             "(off) or auto.")
        self._positive("max_steps")
        self._check_choice("remeasure")
        if self.max_steps < self.steps:
            raise UsageError(f"--max-steps={self.max_steps} is below --steps={self.steps}; raise it to at least "
                             f"{self.steps}.")
        if self.warmup < 0:
            raise UsageError(f"--warmup={self.warmup} is negative; use 0 or more.")
        if self.device == "auto":
            self.device = default_device()  # type: ignore[assignment]
        self._check_choice("device")
        if self.global_batch is not None and self.global_batch < self.world_size:
            raise UsageError(f"--global-batch={self.global_batch} is smaller than the {self.world_size} ranks; "
                             f"use at least {self.world_size} (one sample per rank).")
        if self.trial_timeout <= 0:
            raise UsageError(f"--trial-timeout={self.trial_timeout:g} must be positive; e.g. 300.")
        self.time_budget = parse_duration("--time-budget", self.time_budget)
        if not 0 <= self.headroom < 1:
            raise UsageError(f"--headroom={self.headroom:g} is out of range; use a fraction in [0, 1), e.g. 0.05.")
        if self.weight_spread < 0 or self.weight_time < 0 or self.weight_spread + self.weight_time == 0:
            raise UsageError(f"--weight-spread={self.weight_spread:g} / --weight-time={self.weight_time:g} "
                             "must be >= 0 and not both 0.")
        self._check_choice("cap_mode")
        if self.max_spread_gib is not None and self.max_spread_gib < 0:
            raise UsageError(f"--max-spread-gib={self.max_spread_gib:g} is negative; use GiB >= 0.")
        self._check_choice("sampler", "strategy", "on_error")
        if self.dtypes is not None and (not self.dtypes or set(self.dtypes) - set(DTYPES)):
            raise UsageError(f"--dtypes={','.join(self.dtypes)!r} is invalid; choose from {', '.join(DTYPES)}.")
        self._positive("max_accumulation")
        self._check_choice("split", *(("compile",) if self.compile is not None else ()))
        if self.compile_mode not in (*COMPILE_MODES, "auto") or self.compile_mode == "off":
            raise UsageError(f"--compile-mode={self.compile_mode!r} is unknown; use one of auto, "
                             f"{', '.join(COMPILE_MODES[1:])} (turn compile off with --compile off).")
        if self.compile_mode in CUDA_GRAPH_MODES and self.world_size > 1 and self.compile != "off":
            raise UsageError(f"--compile-mode={self.compile_mode} with {self.world_size} ranks: CUDA graphs run at world "
                             "size 1 only (docs/compile.md); use --compile-mode default, or --nproc-per-node 1.")
        self._positive("gpus_per_trial", "cpus_per_trial")
        if self.prune_factor != 0 and self.prune_factor < 1:
            raise UsageError(f"--prune-factor={self.prune_factor:g} must be 0 (off) or at least 1; e.g. 1.5.")
        if self.memory_cap is not None:
            if self.memory_cap_gib is not None:
                raise UsageError(f"--memory-cap={','.join(self.memory_cap)} and --memory-cap-gib="
                                 f"{','.join(f'{c:g}' for c in self.memory_cap_gib)} both given; keep one of them.")
            self.memory_cap_gib = parse_memory_cap("--memory-cap", self.memory_cap)
        if self.memory_cap_gib is not None:
            if len(self.memory_cap_gib) not in (1, self.world_size):
                raise UsageError(f"--memory-cap-gib has {len(self.memory_cap_gib)} values for {self.world_size} ranks; "
                                 "give one value for all ranks or one per rank.")
            if any(c <= 0 for c in self.memory_cap_gib):
                raise UsageError(f"--memory-cap-gib={self.memory_cap_gib} has a non-positive value; use GiB > 0.")
        if not self.study_name:  # the script's directory and name
            path = os.path.abspath(self.script)
            parent = os.path.basename(os.path.dirname(path))
            stem = os.path.splitext(os.path.basename(path))[0]
            self.study_name = re.sub(r"[^A-Za-z0-9_.-]", "_", f"{parent}-{stem}" if parent else stem)
        if not re.fullmatch(r"[A-Za-z0-9_.:@+-]{1,200}", self.study_name):
            raise UsageError(f"--study-name={self.study_name!r} has unsupported characters; use letters, digits "
                             "and _ . - : @ +.")

    def _positive(self, *names: str) -> None:
        for name in names:  # None: not given
            value = getattr(self, name)
            if value is not None and value < 1:
                raise UsageError(f"{_flag(name)}={value} must be at least 1.")

    def _check_choice(self, *names: str) -> None:
        for name in names:
            value, choices = getattr(self, name), CHOICES[name]
            if value not in choices:
                words = ("one of " + ", ".join(choices) if name not in ("device", "remeasure", "cap_mode", "on_error")
                         else ", ".join(choices[:-1]) + " or " + choices[-1])
                raise UsageError(f"{_flag(name)}={value!r} is unknown; use {words}.")

    @property
    def time_budget_s(self) -> float | None:
        return None if self.time_budget is None else float(self.time_budget)

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    def compile_modes(self) -> list[str]:
        """The compile modes this run searches (see ``compile``): ``--compile-mode auto`` is
        ``default``, with ``reduce-overhead`` too on a GPU at world size 1 (CUDA graphs; in DDP they
        would capture the gradient all-reduce)."""
        modes = [self.compile_mode]
        if self.compile_mode == "auto":
            modes = ["default", *CUDA_GRAPH_MODES] if self.device == "cuda" and self.world_size == 1 else ["default"]
        resolved = self.compile or ("search" if self.device == "cuda" else "off")
        return {"off": ["off"], "on": modes, "search": ["off", *modes]}[resolved]

    def compile_scopes(self, num_blocks: int) -> list[str]:
        """The compile scopes this run searches for a model with ``num_blocks`` repeated blocks
        (``regional`` needs blocks to compile)."""
        if num_blocks == 0:
            return ["whole"]
        return ["whole", "regional"] if self.compile_scope == "search" else [self.compile_scope]

    def caps_bytes(self) -> list[int] | None:
        if self.memory_cap_gib is None:
            return None
        caps = self.memory_cap_gib * (self.world_size if len(self.memory_cap_gib) == 1 else 1)
        return [int(c * 2**30) for c in caps]

    @classmethod
    def merge(cls, *, flags: dict[str, Any], toml_path: str | None) -> TuneSettings:
        """Flags given on the command line win over the study TOML, which wins over defaults."""
        values = load_toml(toml_path) if toml_path else {}
        given = {k: v for k, v in flags.items() if v is not None}
        if given.keys() & {"memory_cap", "memory_cap_gib"}:  # a cap on the command line replaces the file's
            values.pop("memory_cap", None)
            values.pop("memory_cap_gib", None)
        values.update(given)
        if not values.get("script"):
            raise UsageError("SCRIPT is missing; pass the training script (autobalance tune train.py ...) or a study "
                             "TOML that names it (--config studies/NAME.toml with script = \"...\").")
        return cls(**values)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


CHOICES: dict[str, tuple[str, ...]] = {
    name: choices for name, hint in get_type_hints(TuneSettings).items()
    if (choices := next((get_args(a) for a in (hint, *get_args(hint)) if get_origin(a) is Literal), ()))
}
"""The choices of each choice setting, from its ``Literal`` type (alone or in a union with None):
what ``TuneSettings`` accepts and the command line shows (``None`` is not a choice there)."""


def setting_types() -> dict[str, str]:
    """Each field's annotation as text (``int``, ``float | None``, ``list[str]``, ...), a choice setting's
    ``Literal`` written as ``str`` (its values are :data:`CHOICES`): the form the study TOML and the
    command line read a value in."""
    return {f.name: str(f.type) if f.name not in CHOICES else ("str | None" if "| None" in str(f.type) else "str")
            for f in fields(TuneSettings)}


@dataclass(frozen=True, kw_only=True)
class SettingDoc:
    """What the command line says about one :class:`TuneSettings` field: ``help`` (its docstring as plain
    text, without the ``(default: ...)`` clause), ``text`` (the same with its ````code```` marks kept: a
    renderer may turn field names into flags), ``default`` as shown to a user (the docstring's ``(default:
    ...)`` text when the value alone says nothing) and ``value`` (the default itself; ``MISSING``: required)."""

    help: str
    text: str
    default: str
    value: Any


_DEFAULT_CLAUSE = re.compile(r"\s*\(default: ([^()]*)\)")


@functools.lru_cache(maxsize=1)
def setting_docs() -> dict[str, SettingDoc]:
    """Help and default of every :class:`TuneSettings` field, read from its docstring in this module's source, so
    flags, TOML keys and docs derive from one place; an empty default (None, "", []) must say ``(default: ...)``."""
    body = ast.parse(inspect.getsource(TuneSettings)).body[0].body  # type: ignore[attr-defined]
    docs = {stmt.target.id: " ".join(doc.value.value.split())
            for stmt, doc in itertools.pairwise(body)
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
            and isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)
            and isinstance(doc.value.value, str)}
    out: dict[str, SettingDoc] = {}
    for f in fields(TuneSettings):
        if (text := docs.get(f.name)) is None:
            raise AssertionError(f"TuneSettings.{f.name} has no docstring")
        value: Any = f.default if f.default is not MISSING else (
            f.default_factory() if f.default_factory is not MISSING else MISSING)
        clause, kept = _DEFAULT_CLAUSE.search(text), _DEFAULT_CLAUSE.sub("", text)
        if clause is not None:
            default = clause.group(1).replace("``", "")
        elif value is MISSING or value is None or value == "" or value == []:
            raise AssertionError(f"TuneSettings.{f.name}: say what its empty default means with (default: ...)")
        else:
            default = _show(value)
        out[f.name] = SettingDoc(help=kept.replace("``", ""), text=kept, default=default, value=value)
    return out


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, list):
        return ",".join(_show(v) for v in value)
    return str(value)


def default_device() -> str:
    """``cuda`` when a GPU is visible, else ``cpu`` (what ``device = "auto"`` means)."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


_DURATION = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(s|sec|m|min|h)?\s*", re.IGNORECASE)
_UNIT_S = {None: 1.0, "s": 1.0, "sec": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}


def parse_duration(name: str, value: float | str | None) -> float | None:
    """Seconds of a duration given as ``90s``, ``10m``, ``1.5h``, plain seconds (a number or its
    text), or ``off`` / ``none`` (None: no limit); a bad value is a :class:`UsageError` naming ``name``."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("off", "none")):
        return None
    seconds = math.nan
    if is_number(value):
        seconds = float(value)  # type: ignore[arg-type]
    elif isinstance(value, str) and (match := _DURATION.fullmatch(value)):
        seconds = float(match[1]) * _UNIT_S[match[2].lower() if match[2] else None]
    if not math.isfinite(seconds) or seconds <= 0:
        raise UsageError(f"{name}={value!r} is not a positive duration; use e.g. 90s, 10m, 1.5h or plain seconds "
                         "(off: no limit).")
    return seconds


_TOML_KINDS: dict[str, tuple[str, Callable[[Any], bool]]] = {
    # a duration: TuneSettings reads its text
    "float | str | None": ('a number of seconds or a duration such as "10m"',
                           lambda v: is_number(v) or isinstance(v, str)),
    "int": ("a whole number", is_int),
    "float": ("a number", is_number),
    "float | str": ('a number or "auto"', lambda v: is_number(v) or v == "auto"),
    "str": ("a string", lambda v: isinstance(v, str)),
    "bool": ("true or false", lambda v: isinstance(v, bool)),
    "list[str]": ("a list of strings", lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v)),
    "list[float]": ("a number or a list of numbers", lambda v: isinstance(v, list) and all(is_number(x) for x in v)),
}
"""What a study TOML's value must be, by the field's annotation (``| None`` dropped unless listed:
every annotation of :class:`TuneSettings` has its kind here)."""


def load_toml(path: str) -> dict[str, Any]:
    """Read ``[tune]`` (or top-level keys) of a study TOML; keys are flag names (dashes or underscores)."""
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError:
        raise UsageError(f"--config={path!r} does not exist; pass a study TOML such as studies/gpt.toml.") from None
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"--config={path!r} is malformed TOML: {exc}; fix that line.") from None
    section = data.get("tune", data)
    annotations = setting_types()
    for key in section:
        if key.replace("-", "_") not in annotations:
            raise UsageError(f"--config={path!r} has unknown key {key!r}; known keys: {', '.join(sorted(annotations))}.")
    values: dict[str, Any] = {key.replace("-", "_"): value for key, value in section.items()}
    for name in ("memory_cap_gib", "memory_cap"):
        if name in values and not isinstance(values[name], list):
            values[name] = [values[name]]
    for name, value in values.items():
        kind = annotations[name]
        expected, ok = _TOML_KINDS.get(kind) or _TOML_KINDS[kind.replace(" | None", "")]
        if not ok(value):
            raise UsageError(f"--config={path!r} has {name} = {value!r}, which is not {expected}; fix that key.")
        if kind.startswith("float") and is_number(value):
            values[name] = float(value)
        elif kind.startswith("list[float]"):
            values[name] = [float(v) for v in value]
    script = values.get("script")
    if script is not None and not os.path.isabs(script) and not os.path.exists(script):
        values["script"] = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(path)), script))
    return values


GPU_MEMORY_GIB: dict[str, float] = {
    "V100-16GB": 15.7, "V100-32GB": 31.7, "T4": 14.7, "A10": 21.9, "A10G": 21.9, "L4": 21.9,
    "RTX3090": 23.6, "RTX4090": 23.6, "RTX-A6000": 47.5, "L40S": 44.3, "A100-40GB": 39.3,
    "A100-80GB": 79.1, "H100-80GB": 79.1, "H100-94GB": 93.0, "H200": 139.8, "B200": 178.0,
}
"""GPUs ``--memory-cap`` knows by name: about the memory CUDA reports on each (``total_memory``, a little under the
size the card is sold by, rounded down), in GiB, so a cap named after the card you train on never exceeds it."""

_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([KMGT]i?B|[KMGT]|B)?\s*", re.IGNORECASE)
_UNIT_BYTES = {"b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
               "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
               "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


def _gpu_key(text: str) -> str:
    """``A100-40GB``, ``a100 40gb``, ``A100_40``: one key (letters and digits, no trailing GB)."""
    return re.sub(r"(?<=\d)gb$", "", re.sub(r"[^a-z0-9]", "", text.lower()))


_GPU_ALIASES = {"H100": "H100-80GB", "H200-141GB": "H200", "B200-180GB": "B200", "B200-192GB": "B200",
                "T4-16GB": "T4", "L4-24GB": "L4", "A10-24GB": "A10", "A10G-24GB": "A10G", "RTX3090-24GB": "RTX3090",
                "RTX4090-24GB": "RTX4090", "A6000": "RTX-A6000", "RTX-A6000-48GB": "RTX-A6000", "L40S-48GB": "L40S"}
"""Other names of the cards of :data:`GPU_MEMORY_GIB` (the size in the name, or a short form)."""

_GPU_KEYS = {_gpu_key(name): name for name in GPU_MEMORY_GIB} | {_gpu_key(a): n for a, n in _GPU_ALIASES.items()}


def parse_memory_cap(flag: str, items: list[str]) -> list[float]:
    """``--memory-cap`` values (sizes with a unit, or GPU names of :data:`GPU_MEMORY_GIB`) in GiB; a value
    that is neither is a :class:`UsageError` naming ``flag``, the value and the forms it takes."""
    caps = []
    for item in items:
        text = str(item).strip()
        match = _SIZE.fullmatch(text)
        if match is not None and match[2]:
            gib = float(match[1]) * _UNIT_BYTES[match[2].lower()] / 2**30
        elif _gpu_key(text) in _GPU_KEYS:
            gib = GPU_MEMORY_GIB[_GPU_KEYS[_gpu_key(text)]]
        elif match is not None:
            raise UsageError(f"{flag}={text!r} has no unit; write {text}GiB or {text}MiB (or plain GiB with "
                             f"--memory-cap-gib {text}).")
        else:
            family = [name for name in GPU_MEMORY_GIB if _gpu_key(name).startswith(_gpu_key(text))] if text else []
            known = ", ".join(family or GPU_MEMORY_GIB)
            raise UsageError(f"{flag}={text!r} is not a size or a GPU this table knows; use e.g. 20GiB, 60MiB or "
                             f"one of {known}.")
        if not (math.isfinite(gib) and gib > 0):
            raise UsageError(f"{flag}={text!r} is not a positive size; use e.g. 20GiB or 60MiB.")
        caps.append(gib)
    if not caps:
        raise UsageError(f"{flag} is empty; give a size such as 20GiB or a GPU such as A100-40GB.")
    return caps


def memory_cap_text(gib: float) -> str:
    """A cap as ``--memory-cap`` takes it, in the unit its size calls for: ``20GiB``, ``61.4MiB``, ``512KiB``
    (three significant digits, rounded up so the cap is never smaller than ``gib``)."""
    unit, scale = next(((u, s) for u, s in (("GiB", 1.0), ("MiB", 2.0**-10)) if gib >= s), ("KiB", 2.0**-20))
    value = gib / scale
    digits = max(0, 2 - math.floor(math.log10(value))) if value > 0 else 0
    step = 10.0 ** -digits
    rounded = math.ceil(value / step - 1e-9) * step
    return f"{rounded:.{digits}f}".rstrip("0").rstrip(".") + unit


# --------------------------------- preflight: the settings against this host, before anything runs
@contextlib.contextmanager
def preflight(settings: TuneSettings) -> Iterator[None]:
    """Check ``--nproc-per-node`` and ``--memory-cap-gib`` against this host's GPUs (or memory),
    create ``--runs-dir`` and prove it writable, check the storage (``settings.storage`` becomes the
    checked URL); on leaving, remove the directories created that are still empty (a study refused
    before any trial leaves nothing behind)."""
    from autobalance.store import check_storage, open_storage

    s = settings
    visible = 0
    if s.device == "cuda":
        import torch

        visible = torch.cuda.device_count()
    check_gpus(device=s.device, nproc_per_node=s.nproc_per_node, visible=visible)
    if s.caps_bytes():
        capacities = [os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")] * s.nproc_per_node
        if s.device == "cuda":
            capacities = [int(torch.cuda.get_device_properties(i).total_memory)
                          for i in range(min(s.nproc_per_node, visible))]
        check_caps(caps_bytes=s.caps_bytes(), capacities=capacities, device=s.device)
    target = os.path.abspath(s.runs_dir)
    missing, parent = [], target
    while not os.path.isdir(parent) and os.path.dirname(parent) != parent:
        missing.append(parent)
        parent = os.path.dirname(parent)
    created: list[str] = []
    try:
        try:
            for d in reversed(missing):
                os.mkdir(d)
                created.append(d)
            fd, probe = tempfile.mkstemp(prefix=".autobalance-probe-", dir=target)
            os.close(fd)
            os.unlink(probe)
        except OSError as exc:
            raise UsageError(f"--runs-dir={s.runs_dir!r} is not writable ({exc.strerror or exc}); pass a "
                             "writable directory for the trials' reports and logs.") from None
        try:
            s.storage = check_storage(s.storage)
            open_storage(s.storage)
        except StorageError as exc:
            message = str(exc) if str(exc).startswith("--storage") else f"--storage: {exc}"
            raise type(exc)(message) from None
        yield
    finally:
        for d in reversed(created):  # deepest first, those still empty only
            with contextlib.suppress(OSError):
                os.rmdir(d)


def check_gpus(*, device: str, nproc_per_node: int, visible: int) -> None:
    """``--nproc-per-node`` against the GPUs this host sees (one GPU per rank; CUDA only)."""
    if device != "cuda":
        return
    if visible == 0:
        raise UsageError("--device=cuda but no CUDA device is visible; use --device cpu.")
    if nproc_per_node > visible:
        raise UsageError(f"--nproc-per-node={nproc_per_node} is larger than the {visible} visible GPU(s); "
                         f"use at most {visible} or check CUDA_VISIBLE_DEVICES.")


def check_caps(*, caps_bytes: list[int] | None, capacities: list[int], device: str) -> None:
    """``--memory-cap-gib`` against each local rank's card (on CPU: the host's memory)."""
    for rank, (cap, capacity) in enumerate(zip(caps_bytes or [], capacities, strict=False)):
        if cap > capacity:
            card = "its card" if device == "cuda" else "this host's memory"
            raise UsageError(f"--memory-cap-gib={cap / 2**30:g} for rank {rank} is larger than {card} "
                             f"({capacity / 2**30:.1f} GiB); use at most {capacity / 2**30:.1f}.")
