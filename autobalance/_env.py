"""The environment contract between the launcher (parent) and the runtime (training process).

Both sides import only this module, so the runtime never imports the tuner or the launcher.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from autobalance._errors import UsageError

__all__ = [
    "CONFIG",
    "CONFIG_FILE",
    "DEVICE",
    "DIAGNOSE",
    "EMULATE_MS_PER_SAMPLE",
    "EMULATE_SMS",
    "GLOBAL_BATCH",
    "MAX_STEPS",
    "MEASURE_S",
    "MEMORY_CAP_BYTES",
    "PG_TIMEOUT_S",
    "STEPS",
    "STORAGE",
    "STUDY",
    "TRIAL_DIR",
    "TRIAL_ID",
    "WARMUP",
    "TrialEnv",
    "in_trial",
    "parse_int",
]

TRIAL_DIR = "AUTOBALANCE_TRIAL_DIR"
"""Directory where each rank writes ``rank<R>.json``; its presence means "this is a trial"."""
TRIAL_ID = "AUTOBALANCE_TRIAL_ID"
"""Unique id of the trial; also marks every process of the trial (see the launcher's reaper)."""
CONFIG = "AUTOBALANCE_CONFIG"
"""The configuration to apply, as JSON. Absent in a trial: run the script's own defaults."""
CONFIG_FILE = "AUTOBALANCE_CONFIG_FILE"
"""A JSON file written by ``autobalance export`` (production use without a database)."""
STUDY = "AUTOBALANCE_STUDY"
"""Study whose saved best configuration production jobs load."""
STORAGE = "AUTOBALANCE_STORAGE"
"""SQLAlchemy URL of the store (default ``sqlite:///autobalance.db``)."""
GLOBAL_BATCH = "AUTOBALANCE_GLOBAL_BATCH"
"""Override of the script's global batch for the baseline trial."""
STEPS = "AUTOBALANCE_STEPS"
"""Measured optimizer steps in a trial."""
WARMUP = "AUTOBALANCE_WARMUP"
"""Warm-up optimizer steps in a trial (not timed)."""
MEASURE_S = "AUTOBALANCE_MEASURE_S"
"""Measure for about this many seconds: after the first measured step, the ranks agree on the number
of measured steps (at least STEPS, at most MAX_STEPS). Absent or 0: exactly STEPS."""
MAX_STEPS = "AUTOBALANCE_MAX_STEPS"
"""Upper bound on measured steps when MEASURE_S is set (default 50)."""
MEMORY_CAP_BYTES = "AUTOBALANCE_MEMORY_CAP_BYTES"
"""Per-rank memory cap in bytes: one integer, or a comma-separated list indexed by rank."""
PG_TIMEOUT_S = "AUTOBALANCE_PG_TIMEOUT_S"
"""Process-group timeout in seconds (short in trials so a lost peer cannot hang a rank)."""

DEVICE = "AUTOBALANCE_DEVICE"
"""``cpu`` or ``cuda``: the device the trial runs on (default: cuda when available)."""
DIAGNOSE = "AUTOBALANCE_DIAGNOSE"
"""``1`` in a run started by ``autobalance diagnose``: the runtime adds MemTracker's module breakdown."""

WARM = "AUTOBALANCE_WARM"
"""Set to ``1`` in the processes of a warm worker pool: the script runs once per trial in one process."""
POOL_DIR = "AUTOBALANCE_POOL_DIR"
"""Directory through which the launcher hands trial requests to a warm pool."""

EMULATE_MS_PER_SAMPLE = "AUTOBALANCE_EMULATE_MS_PER_SAMPLE"
"""Emulated slow ranks (CPU tests, planning a mixed machine): milliseconds each micro-step sleeps per
sample, one number or one per rank (``runtime/_emulate.py``). A sleep: the update is unchanged."""
EMULATE_SMS = "AUTOBALANCE_EMULATE_SMS"
"""Emulated smaller GPUs (planning a mixed machine on one kind of GPU): the streaming multiprocessors
each rank may use, one number or one per rank, 0 for all (``runtime/_emulate.py``: a CUDA green
context). Where the kernels run, not what they compute: the update is unchanged."""
COMPILE_BACKEND = "AUTOBALANCE_COMPILE_BACKEND"
"""``torch.compile`` backend for compiled configurations (default ``inductor``); tests use
``aot_eager_decomp_partition`` (the same partitioner and activation budget, no C++ compile)."""

OOM_EXIT_CODE = 75
"""Exit code of a rank that ran out of memory (after writing its report)."""
ERROR_EXIT_CODE = 76
"""Exit code of a rank that raised another error (after writing its report)."""
REPORT_FAILED_EXIT_CODE = 77
"""Exit code of a rank that could not write its report (disk full, directory gone or read-only)."""
NO_PLAN_EXIT_CODE = 78
"""Exit code of a warm worker's rank whose script ran to its end without calling ``autobalance.plan()``."""
REPORT_FAILED_MARKER = "autobalance: report not written:"
"""Start of the stderr line in which such a rank says why; the launcher turns it into the trial's reason."""


def in_trial() -> bool:
    return bool(os.environ.get(TRIAL_DIR))


@dataclass(frozen=True, kw_only=True)
class TrialEnv:
    """The trial's and the job's ``AUTOBALANCE_*`` variables, typed. Those of :attr:`NAMES` a trial sets
    for itself alone: what the launcher adds to a cold trial's environment, and all a warm pool's
    request carries (the pool's own environment has none of them, so one pool runs trials of
    different lengths and caps). Those of :attr:`JOB_NAMES` belong to the job's processes rather
    than to one trial (set once for a cold trial's job or a warm pool, by ``autobalance diagnose``,
    or by the user). :meth:`to_env` and :meth:`from_env` are each other's inverse, as
    ``BalanceConfig.to_json`` and ``from_json``; the runtime reads them with the lenient :meth:`read`
    once per :func:`autobalance.plan` call, and where no plan is at hand (the warm worker's loop, a
    rank's start and exit, the device before the process group exists) with :meth:`read_job`."""

    NAMES: ClassVar[tuple[str, ...]] = (TRIAL_DIR, CONFIG, GLOBAL_BATCH, MEASURE_S, STEPS, WARMUP, MAX_STEPS,
                                         MEMORY_CAP_BYTES)
    """The per-trial variables: every one :meth:`to_env` may set from the trial's fields (those it
    leaves out are unset for the trial); the launcher drops them from the parent's environment."""
    JOB_NAMES: ClassVar[tuple[str, ...]] = (TRIAL_ID, DEVICE, WARM, POOL_DIR, DIAGNOSE, EMULATE_MS_PER_SAMPLE,
                                             EMULATE_SMS, COMPILE_BACKEND)
    """The job's variables (the fields from ``trial_id`` on): :meth:`read_job` reads exactly these,
    :meth:`read` these and :attr:`NAMES`; :meth:`to_env` writes one only when its field is set."""

    trial_dir: str
    config_json: str | None = None
    """The configuration as JSON (None: the script's own defaults, i.e. the baseline)."""
    global_batch: int | None = None
    """The global batch the baseline must use (None: the script's)."""
    steps: int = 3
    warmup: int = 1
    measure_s: float = 0.0
    """Measure for about this long; 0: exactly ``steps`` (the variable is then unset)."""
    max_steps: int = 50
    memory_cap_bytes: tuple[int, ...] | None = None
    """Per-rank memory caps (one entry: every rank); None or empty: no cap."""
    trial_id: str = ""
    """``AUTOBALANCE_TRIAL_ID``: marks every process of the trial, or of a warm pool (its reports and
    its orphan check carry it); "": unset."""
    device: str | None = None
    """``AUTOBALANCE_DEVICE`` as set (``cpu`` or ``cuda``, checked where it is used); None: unset (a
    script's ``device=`` argument wins, then this, then cuda when available)."""
    warm: bool = False
    """``AUTOBALANCE_WARM=1``: this process is a warm pool's worker, which outlives its trials."""
    pool_dir: str | None = None
    """``AUTOBALANCE_POOL_DIR``: where a warm worker takes its trial requests (None: unset)."""
    diagnose: bool = False
    """``AUTOBALANCE_DIAGNOSE=1``: a run of ``autobalance diagnose``; the plan adds MemTracker's module
    breakdown."""
    emulate_ms_per_sample: str | None = None
    """``AUTOBALANCE_EMULATE_MS_PER_SAMPLE`` as set (None: unset), parsed per rank by
    ``runtime/_emulate.emulated_ms_per_sample``, whose errors name the rank."""
    emulate_sms: str | None = None
    """``AUTOBALANCE_EMULATE_SMS`` as set (None: unset), parsed per rank by ``runtime/_emulate.emulated_sms``."""
    compile_backend: str | None = None
    """``AUTOBALANCE_COMPILE_BACKEND`` as set: the ``torch.compile`` backend of a compiled configuration
    (None or empty: ``inductor``)."""

    def to_env(self) -> dict[str, str]:
        """The variables, as the trial's processes see them."""
        env = {TRIAL_DIR: self.trial_dir, STEPS: str(self.steps), WARMUP: str(self.warmup),
               MAX_STEPS: str(self.max_steps)}
        if self.measure_s > 0:
            env[MEASURE_S] = f"{self.measure_s:.6g}"
        if self.config_json is not None:
            env[CONFIG] = self.config_json
        if self.global_batch is not None:
            env[GLOBAL_BATCH] = str(self.global_batch)
        if self.memory_cap_bytes:
            env[MEMORY_CAP_BYTES] = ",".join(str(b) for b in self.memory_cap_bytes)
        if self.trial_id:
            env[TRIAL_ID] = self.trial_id
        if self.warm:
            env[WARM] = "1"
        if self.diagnose:
            env[DIAGNOSE] = "1"
        for name, value in ((DEVICE, self.device), (POOL_DIR, self.pool_dir),
                            (EMULATE_MS_PER_SAMPLE, self.emulate_ms_per_sample), (EMULATE_SMS, self.emulate_sms),
                            (COMPILE_BACKEND, self.compile_backend)):
            if value is not None:
                env[name] = value
        return env

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> TrialEnv:
        """What :meth:`to_env` wrote (``ValueError`` or ``KeyError`` on anything else)."""
        caps = env.get(MEMORY_CAP_BYTES)
        batch = env.get(GLOBAL_BATCH)
        return cls(trial_dir=env[TRIAL_DIR], config_json=env.get(CONFIG),
                   global_batch=None if batch is None else int(batch), steps=int(env[STEPS]),
                   warmup=int(env[WARMUP]), measure_s=float(env.get(MEASURE_S, "0")), max_steps=int(env[MAX_STEPS]),
                   memory_cap_bytes=tuple(int(c) for c in caps.split(",")) if caps else None,
                   **_job_fields(env))

    @classmethod
    def read(cls, environ: Mapping[str, str], *, rank: int) -> TrialEnv:
        """The runtime's one read of these variables, once per :func:`autobalance.plan` call (a warm
        worker's environment changes per trial). Lenient where :meth:`from_env` is strict: an absent
        or empty variable takes its default, and outside a trial (no ``TRIAL_DIR``: a production job)
        ``trial_dir`` is ``""`` and the configuration and global batch are not read, while the steps
        and the memory cap are. A malformed value is a ``UsageError`` naming it (a global batch that
        is not an integer: ``ValueError``); ``rank`` is this process's, whose cap must exist. The
        job's variables are read as :meth:`read_job` reads them."""
        trial_dir = environ.get(TRIAL_DIR) or ""
        caps = _caps(environ.get(MEMORY_CAP_BYTES), rank)
        batch = environ.get(GLOBAL_BATCH) if trial_dir else None
        return cls(trial_dir=trial_dir, config_json=(environ.get(CONFIG) or None) if trial_dir else None,
                   global_batch=int(batch) if batch else None,
                   warmup=_int(environ, WARMUP, 1), steps=_int(environ, STEPS, 3),
                   measure_s=_seconds(environ, MEASURE_S, 0.0), max_steps=_int(environ, MAX_STEPS, 50),
                   memory_cap_bytes=caps, **_job_fields(environ))

    @classmethod
    def read_job(cls, environ: Mapping[str, str]) -> TrialEnv:
        """The job's variables alone (:attr:`JOB_NAMES`), where the runtime has no plan's
        :class:`TrialEnv` at hand: the warm worker's loop, a rank's orphan check at start and exit,
        the device before the process group exists. The per-trial fields keep their defaults
        (``trial_dir`` ``""``). Never raises: each value is kept as set, checked where it is used."""
        return cls(trial_dir="", **_job_fields(environ))

    def cap_for(self, rank: int) -> int | None:
        """This rank's memory cap in bytes (one entry: every rank's), or None."""
        if not self.memory_cap_bytes:
            return None
        return self.memory_cap_bytes[0] if len(self.memory_cap_bytes) == 1 else self.memory_cap_bytes[rank]


def _job_fields(environ: Mapping[str, str]) -> dict[str, Any]:
    """:attr:`TrialEnv.JOB_NAMES` as fields, each as set (the two flags: whether it is ``1``)."""
    return {"trial_id": environ.get(TRIAL_ID, ""), "device": environ.get(DEVICE), "warm": environ.get(WARM) == "1",
            "pool_dir": environ.get(POOL_DIR), "diagnose": environ.get(DIAGNOSE) == "1",
            "emulate_ms_per_sample": environ.get(EMULATE_MS_PER_SAMPLE), "emulate_sms": environ.get(EMULATE_SMS),
            "compile_backend": environ.get(COMPILE_BACKEND)}


def _int(environ: Mapping[str, str], name: str, default: int) -> int:
    """An integer variable (absent or empty: ``default``)."""
    return parse_int(environ.get(name), name, default)


def parse_int(raw: str | None, name: str, default: int) -> int:
    """Variable ``name``'s value ``raw`` as an integer (absent or empty: ``default``)."""
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise UsageError(f"{name}={raw!r} is not an integer; set it to a whole number.") from None


def _seconds(environ: Mapping[str, str], name: str, default: float) -> float:
    """A finite number of seconds >= 0 (absent or empty: ``default``)."""
    raw = environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise UsageError(f"{name}={raw!r} is not a number; set it to seconds, e.g. 1.5.") from None
    if not math.isfinite(value) or value < 0:
        raise UsageError(f"{name}={raw!r} must be a finite number >= 0; set it to seconds, e.g. 1.5.")
    return value


def _caps(raw: str | None, rank: int) -> tuple[int, ...] | None:
    """``MEMORY_CAP_BYTES``: one byte count, or one per rank (then this rank's must be there)."""
    if not raw:
        return None
    parts = [p.strip() for p in raw.split(",") if p.strip()]
    try:
        values = tuple(int(float(p)) for p in parts)
    except ValueError:
        raise UsageError(f"{MEMORY_CAP_BYTES}={raw!r} is not a byte count or a comma-separated list of them.") from None
    if len(values) != 1 and rank >= len(values):
        raise UsageError(f"{MEMORY_CAP_BYTES}={raw!r} has {len(values)} entries but this is rank {rank}; "
                         "give one cap per rank.")
    return values

VERIFY_FILE = "verify.json"
"""A file of that name in the trial directory makes the trial a verification run (``autobalance
verify``): JSON with ``dropout`` (``off``: the model runs in eval mode so every sample's computation
is independent of the split; ``on``: train mode, the global RNG seeded per rank at the first step)
and optionally ``init`` (a ``.pt`` of the starting weights to load). After the first optimizer step
rank 0 writes ``verify-step.pt`` (gradients and updated parameters, tensors only), ``verify-init.pt``
(the starting weights) and ``verify-step.json`` (the step's sample indices), then the trial ends.
It is a file, not a variable, so it reaches warm workers (which take only per-trial variables)."""
