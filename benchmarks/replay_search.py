"""Replay ``autobalance tune --time-budget`` on recorded H200 measurements, on CPU, for many seeds.

The machine is ``studies/gpt-1gpu.toml``'s scenario (the ~270M GPT, 16 blocks, global batch 32, one
H200 capped at 16 GiB with 3 GiB of rank-0 extras, 5 % headroom) as the product's own runtime measured
it (``benchmarks/2026-12-04-h200/grid-*.json``: regional and whole-model compiles, loss inside and
outside; ``benchmarks/2026-12-03-h200c/compiled_search_grid.json``: eager and whole-model points of the
loss-inside placement). A real :class:`~autobalance.tuner.Tuner` (the search policy, the memory and
step-time models, the vetoes, the time budget: the code ``autobalance tune`` runs) asks; every trial is
answered from the table instead of torchrun, with the table's compile, start-up and step times on a
simulated clock. After the loop, the best trial's verification runs are priced the same way
(``verification_runs``: each run a start-up, its compile, two steps) and added to the wall.

Points the grid did not measure are read off it (:class:`GridMachine`): a compiled configuration's
peak and step time by linear interpolation over the activation budget at each measured micro-batch, then
over the largest micro-batch (clamped outside the measured range, where the nearest point answers); fp16
as bf16 (same peaks, 2 % slower); fp32 six times slower with 1.5 x the activations (fp32 ran 1331-1340 ms
per step on the H200 where bf16 ran 170-230 ms: field notes 2026-12-03). Eager: the measured eager
points' fixed part and per-sample activations, and checkpointing's measured saving.

What the grids do not know, the replay states instead of guessing kindly:

- A compiled split with micro-steps of two sizes in a rank (5,5,5,5,4,4,4: the runtime marks the
  batch dimension dynamic) that the grids did not measure costs :data:`TWO_SIZE_FACTOR` (1.5) times the
  even splits' interpolation (its peak as interpolated); see the constant for where 1.5 comes from.
- Every answer names the recorded points it was read from and how (``measured``, ``interpolated``,
  ``extrapolated``; fp16 counts as interpolated, fp32 as extrapolated): per trial (``trial_points``) and
  for the saved configuration and the grid best, in the JSON rows and the printed line.
- ``--machines``: ``recorded`` (the grids), ``tilted`` (per seed, the recorded step times tilted
  smoothly as another model of the same kind would differ: :class:`Tilt`; every two-size compiled
  split at 1.5x; the grid best taken on the tilted machine) and ``second`` (a model family whose memory
  is mostly logits, derived from the recorded grids by :class:`Family` until a device records its grid
  with ``benchmarks/second_family_gpu.sh``; then ``--second-grids``).

The tuner's re-measure of its leaders before saving (the best trial and those within its measured noise,
run again interleaved) is answered like any trial, each run with a fresh noise draw; each study's row
says what it did (``leaders``: runs, the pooled step each leader ranked by, and its true one).

Printed per study: the machine, placement, budget and seed, the saved configuration, its true step over
the grid's best (the best feasible point of the same machine over every scope, split, budget and dtype
the search space holds), the wall with verification, and how the saved point was read; then per
machine, placement and budget the median and worst over the seeds.

    python benchmarks/replay_search.py --seeds 0-19 --placements inside,outside --budgets 5m,10m \\
        --out benchmarks/2026-12-04-cpu/replay_search.json
    python benchmarks/replay_search.py --machines recorded,tilted,second --seeds 0-19 \\
        --placements inside,outside --budgets 5m --out benchmarks/2026-12-05-cpu/replay_machines.json
"""

from __future__ import annotations

import argparse
import bisect
import datetime
import json
import os
import statistics
import sys
import tempfile
import types
from dataclasses import dataclass
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np
import optuna

from autobalance import BalanceConfig
from autobalance.launcher import TrialOutcome
from autobalance.protocol import Status

HERE = os.path.dirname(os.path.abspath(__file__))
GRIDS = {
    "inside": [os.path.join(HERE, "2026-12-04-h200", "grid-inside.json"),
               os.path.join(HERE, "2026-12-04-h200", "grid-inside-2.json"),
               os.path.join(HERE, "2026-12-03-h200c", "compiled_search_grid.json")],
    "outside": [os.path.join(HERE, "2026-12-04-h200", "grid-outside.json"),
                os.path.join(HERE, "2026-12-04-h200", "grid-outside-2.json")],
}
"""The recorded grids of each loss placement (later files do not override a point an earlier one has)."""
LAYERS = 16
GLOBAL_BATCH = 32
CAP_GIB = 16.0
HEADROOM = 0.05
USABLE_GIB = CAP_GIB * (1 - HEADROOM)
WORKER_START_S = 9.5
"""A fresh warm worker (after a compiled trial the pool recycles it): 8.5-10.1 s in the grids."""
TRIAL_OVERHEAD_S = 1.5
"""A warm eager trial's start-up and hand-over around its steps (the grids' eager walls less steps)."""
FROM_CACHE_SHARE = 0.4
"""A compile whose graphs the study compiled before costs this share of a cold one (issue 41's H200 study)."""
VERIFY_RUN_S = 5.0
"""A verification run's own start-up and hand-over beyond a trial's (issue 41's H200 study: 4 runs of a
verification took 33.5 s, 63-98 s for 4-7 runs in the 2026-12-04 studies)."""
VERIFY_COMPARE_S = 3.1
"""Saving, reading and comparing one verification run's tensors (~1.08 GB of parameters: issue 41's H200 study)."""
GRADIENTS_GIB = 1.08
"""fp32 gradients of the ~270M-parameter GPT."""
PARAMETER_GB = 1.08
"""Its fp32 parameters, as the runtime reports them (``model.parameter_bytes``, an integer): what
verification's tensor input/output and comparisons are priced by."""
STEP_NOISE = 0.03
"""Relative noise of a trial's measured step (one H200 study: the same configuration repeated within
+-15 % eager, compiled 8 x 4 steps within ~1.5 %: field notes)."""
PEAK_NOISE = 0.003
MEASURED_STEPS = 6
WARMUP_STEPS = 2
FP16_SLOWER = 1.02
FP32_SLOWER = 6.0
FP32_ACTIVATIONS = 1.5


def _split_name(m: int, acc: int) -> str:
    """A split as ``compiled_search.py --grid-points`` writes it: ``8`` (8 x 4) or ``a7`` (5,5,5,5,4,4,4)."""
    return str(m) if m * acc == GLOBAL_BATCH else f"a{acc}"


def _row_name(row: dict[str, Any]) -> str:
    """A recorded point as ``SCOPE/SPLIT/X`` (X: the activation budget, or eager's checkpointed blocks)."""
    split = _split_name(int(row["micro_batch"]), int(row["accumulation"]))
    if row["scope"] == "eager":
        return f"eager/{split}/{len(row['config']['checkpoint'][0])}"
    return f"{row['scope']}/{split}/{float(row['budget']):g}"


def _rows(paths: list[str]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    seen: set[str] = set()
    for path in paths:
        with open(path) as fh:
            for row in json.load(fh)["rows"]:
                cfg = row["config"]
                if row.get("status") != "ok" or row.get("step_ms") is None:
                    continue
                scope = ("whole" if cfg.get("compile", "off") != "off" and cfg.get("compile_scope", "whole") == "whole"
                         else cfg.get("compile_scope") if cfg.get("compile", "off") != "off" else "eager")
                if cfg.get("compile") not in ("off", "default"):
                    continue  # CUDA graphs: not searched by default
                if cfg.get("dtype", "bf16") != "bf16":
                    continue  # the replay's points are bf16; other dtypes are derived from them
                key = json.dumps([scope, row["micro_batch"], row.get("budget"), len(cfg["checkpoint"][0]),
                                  cfg.get("rank_samples")])
                if key in seen:
                    continue
                seen.add(key)
                rows.append({**row, "scope": scope})
                rows[-1]["point"] = _row_name(rows[-1])
    return rows


_HOW = ("measured", "interpolated", "extrapolated")
"""How a replayed answer was read off the recorded points, best first: the point itself was measured;
it lies between measured points; it lies beyond them (clamped or extended)."""


def _worst(*hows: str) -> str:
    return max(hows, key=_HOW.index)


def _traced(xs: list[float], ys: list[float], x: float) -> tuple[float, list[int], str]:
    """:func:`_interp` with the indices of the points it read and how (:data:`_HOW`)."""
    if x in xs:
        return ys[xs.index(x)], [xs.index(x)], "measured"
    if x < xs[0]:
        return ys[0], [0], "extrapolated"
    if x > xs[-1]:
        return ys[-1], [len(xs) - 1], "extrapolated"
    i = bisect.bisect_right(xs, x)
    return _interp(xs, ys, x), [i - 1, i], "interpolated"


def _interp(xs: list[float], ys: list[float], x: float) -> float:
    """Piecewise-linear through (xs, ys) (xs ascending), clamped outside."""
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    i = bisect.bisect_right(xs, x)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def _extend_traced(points: list[tuple[float, float]], x: float, *,
                   slope: tuple[float, float]) -> tuple[float, list[float], str]:
    """:func:`_extend` with the x of the points it read and how (:data:`_HOW`)."""
    merged: dict[float, list[float]] = {}
    for px, py in points:
        merged.setdefault(px, []).append(py)
    xs = sorted(merged)
    ys = [statistics.mean(merged[v]) for v in xs]
    lo, hi = slope
    if x in merged:
        return ys[xs.index(x)], [x], "measured"
    if len(xs) == 1:
        return ys[0] + hi * (x - xs[0]), xs, "extrapolated"
    if x < xs[0]:
        return ys[0] + min(hi, max(lo, (ys[1] - ys[0]) / (xs[1] - xs[0]))) * (x - xs[0]), xs[:2], "extrapolated"
    if x > xs[-1]:
        return ys[-1] + min(hi, max(lo, (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]))) * (x - xs[-1]), xs[-2:], "extrapolated"
    i = bisect.bisect_right(xs, x)
    return _interp(xs, ys, x), [xs[i - 1], xs[i]], "interpolated"


def _extend(points: list[tuple[float, float]], x: float, *, slope: tuple[float, float]) -> float:
    """Piecewise-linear through ``points`` (x ascending; repeated x averaged), extended linearly past
    the ends with the two nearest points' slope held within ``slope`` (low, high): more samples per
    micro-step or more micro-steps never cost less, and noise between two close points does not
    extrapolate far."""
    return _extend_traced(points, x, slope=slope)[0]


@dataclass
class Point:
    peak_gib: float
    step_ms: float
    compile_s: float | None
    how: str = "measured"
    """How the answer was read off the recorded points (:data:`_HOW`)."""
    basis: tuple[str, ...] = ()
    """The recorded points it was read from (``SCOPE/SPLIT/X``, as ``compiled_search.py`` names them)."""
    notes: tuple[str, ...] = ()
    """What was applied on top of the recorded points: ``two-size x1.5``, ``fp16 from bf16``, ``tilt x0.97``..."""


# ---------------------------------------------------------------------- what the replay assumes
TWO_SIZE_FACTOR = 1.5
"""An unmeasured compiled split with micro-steps of two sizes in a rank (5,5,5,5,4,4,4: the runtime
marks the batch dimension dynamic) costs this much the step time read off the even splits. From the
H200 study of 2026-12-05 (one configuration family: 7 micro-steps of 5 and 4 samples): regional at
budget 1.0 274.7 ms, whole-model at 1.0 183.4 ms, regional at 0.75 254.6 ms; their mean, 237.6 ms, is
1.49x the study's even 8 x 4 (regional, 0.55: 159.0 ms), and 1.41-1.48x the 180-185 ms the search's
own model of the even splits predicted for the two regional ones. The grids' one measured two-size
split (11,11,10, regional and whole at 0.85) keeps its measurement on the recorded machine."""
TILT_SCOPE = (0.85, 1.15)
"""A tilted machine's factor on each compile scope's step times (whole, regional), drawn uniformly."""
TILT_MICRO_EXPONENT = (-0.1, 0.1)
"""... its micro-batch tilt ``(m / 8) ** e`` (``m``: the rank's largest micro-step), ``e`` drawn uniformly ..."""
TILT_BUDGET_SLOPE = (-0.15, 0.15)
"""... and its activation-budget tilt ``1 + t * (1 - budget)`` on compiled steps, ``t`` drawn uniformly."""
TILT_STREAM = 48
"""The tilt's random stream, apart from the replay's measurement noise (same seed, other draws)."""


@dataclass(frozen=True)
class Tilt:
    """One seed's smooth tilt of the recorded machine's step times, as another model of the same kind
    would differ from it (memory, compile times and the noise stay): each compile scope by a factor, the
    micro-batch size by ``(m / 8) ** micro_exponent``, compiled steps by ``1 + budget_slope * (1 - budget)``.
    Eager steps take the micro-batch tilt only. Deterministic per seed (:meth:`from_seed`)."""

    seed: int
    scope: dict[str, float]
    micro_exponent: float
    budget_slope: float

    @classmethod
    def from_seed(cls, seed: int) -> Tilt:
        rng = np.random.default_rng([TILT_STREAM, seed])
        scope = {s: float(rng.uniform(*TILT_SCOPE)) for s in ("whole", "regional")}
        return cls(seed=seed, scope=scope, micro_exponent=float(rng.uniform(*TILT_MICRO_EXPONENT)),
                   budget_slope=float(rng.uniform(*TILT_BUDGET_SLOPE)))

    def factor(self, cfg: BalanceConfig, *, lowest_budget: float = 0.0) -> float:
        """The tilt of ``cfg``'s step time. Below ``lowest_budget`` (the lowest the grid measured in that
        scope, where the recorded machine holds its answer) the budget tilt holds its value there too:
        else a falling budget would get cheaper without end where nothing was measured."""
        f = (max(cfg.micro_batches) / 8) ** self.micro_exponent
        if cfg.compile != "off":
            b = max((cfg.activation_budget or [1.0])[0], lowest_budget)
            f *= self.scope.get(cfg.compile_scope, self.scope["whole"]) * (1 + self.budget_slope * (1 - b))
        return f

    def to_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "scope": {k: round(v, 4) for k, v in self.scope.items()},
                "micro_exponent": round(self.micro_exponent, 4), "budget_slope": round(self.budget_slope, 4)}


VOCAB = 32768
TOKENS = 1024
EMBED = 1024
LOGITS_KEPT_GIB = 2 * TOKENS * VOCAB / 2**30
"""Per sample, what a compiled model with the loss inside keeps of the logits for its backward: the bf16
logits (2 bytes each; 0.0625 GiB at 32k x 1024). An assumption: the grids do not separate it."""
LOGITS_MATERIALIZED_GIB = LOGITS_KEPT_GIB + 0.3125
"""Per sample, the logits' memory where they leave the compiled model (loss outside) or in eager: the
kept bf16 logits plus the measured outside-minus-inside difference of the recorded regional peaks
(0.305-0.3125 GiB per sample at budgets 1.0 and 0.85, micro-batches 8 and 16: the fp32 copy, the
log-softmax and the gradient, 10 bytes per logit). Eager's peaks are the same in both placements
(eager 4 x 8: 13.455 GiB each), so eager holds them too."""


@dataclass(frozen=True, kw_only=True)
class Family:
    """A second model family derived from the recorded GPT until a device records one: the same 16
    blocks x 1024 at 1024 tokens with ``vocab_factor`` times the vocabulary, so that most of a sample's
    memory is in its logits, which neither the activation budget nor checkpointing reduces.

    What is transformed, per configuration of the recorded machine:

    - held memory + the new embedding and head parameters (untied: ``2 * (k - 1) * 32768 * 1024``) at
      20 bytes each (fp32 weight, gradient, two AdamW moments, rank 0's EMA copy);
    - the peak + ``(k - 1)`` x the per-sample logits share x the micro-batch (:data:`LOGITS_KEPT_GIB`
      compiled with the loss inside, :data:`LOGITS_MATERIALIZED_GIB` compiled with it outside and eager),
      whatever the budget or checkpointing (the head and the loss are outside the blocks they act on);
    - every step time x the model's FLOPs per token (matmul parameters plus attention):
      ``(201.3M + k * 33.5M + 16.8M) / (201.3M + 33.5M + 16.8M)``;
    - the cap (``cap_gib``, 30 GiB for 16): the study's choice, not the model's; chosen so that this
      machine's best lies on a measured point in both placements and elsewhere than the recorded
      machine's (loss inside: regional 16 x 2 at budget 1.0, where the recorded best is whole-model
      8 x 4 at 1.0; loss outside: regional 8 x 4 at 0.85, where it is 8 x 4 at 0.65, interpolated).

    Why a fair stand-in: a 128k vocabulary (Llama 3's) on the same blocks is a real model's shape; the
    logits' bytes per sample are measured (the recorded placements differ by exactly them), only their
    part kept inside a compiled loss (2 bytes per logit) is assumed; and the budget and micro-batch
    trade-offs the search has to find are the recorded ones, met at other places by the memory.

    Compile times, the noise and the recorded budget and micro-batch trade-offs stay."""

    name: str = "second"
    vocab_factor: float = 4.0
    """The vocabulary over the recorded 32768."""
    cap_gib: float = 30.0
    """The study's memory cap (usable: 5 % less)."""

    def held_gib(self) -> float:
        return 2 * (self.vocab_factor - 1) * VOCAB * EMBED * 20 / 2**30

    def parameters(self) -> float:
        """The added parameters (fp32: 4 bytes each)."""
        return 2 * (self.vocab_factor - 1) * VOCAB * EMBED

    def logits_gib(self, cfg: BalanceConfig, placement: str) -> float:
        """The added per-sample activation of ``cfg``."""
        share = LOGITS_KEPT_GIB if cfg.compile != "off" and placement == "inside" else LOGITS_MATERIALIZED_GIB
        return (self.vocab_factor - 1) * share

    def time_factor(self) -> float:
        blocks, head, attention = 16 * 12 * EMBED**2, VOCAB * EMBED, 16 * TOKENS * EMBED
        return (blocks + self.vocab_factor * head + attention) / (blocks + head + attention)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "vocab": int(VOCAB * self.vocab_factor), "cap_gib": self.cap_gib,
                "held_gib": round(self.held_gib(), 3), "time_factor": round(self.time_factor(), 4)}


SECOND = Family()
"""The second machine of ``--machines second`` (see :class:`Family`)."""


class GridMachine:
    """One placement's recorded grid, answering any configuration of the search space (see the module
    doc): the recorded machine, or one tilted (``tilt``), or a second family derived from it (``family``).

    ``two_size_factor``: what an unmeasured compiled split of two micro-step sizes costs over the even
    splits' interpolation (:data:`TWO_SIZE_FACTOR`); ``measured_two_size``: whether a measured two-size
    split answers from its measurement (False: every two-size split is priced from the even ones)."""

    def __init__(self, placement: str, *, two_size_factor: float = TWO_SIZE_FACTOR, measured_two_size: bool = True,
                 tilt: Tilt | None = None, family: Family | None = None,
                 grids: dict[str, list[str]] | None = None) -> None:
        self.placement = placement
        self.grids = grids or GRIDS
        self.two_size_factor = two_size_factor
        self.measured_two_size = measured_two_size
        self.tilt = tilt
        self.family = family
        self.name = family.name if family else "tilted" if tilt else "recorded"
        self.cap_gib = family.cap_gib if family else CAP_GIB
        self.usable_gib = self.cap_gib * (1 - HEADROOM)
        self.layers = LAYERS
        self.gradients_gib = GRADIENTS_GIB + (family.parameters() * 4 / 2**30 if family else 0.0)
        self.parameter_gb = PARAMETER_GB + (family.parameters() * 4 / 1e9 if family else 0.0)
        self.rows = _rows(self.grids[placement])
        self.compiled: dict[str, dict[tuple[int, int], list[tuple[float, float, float, float, str]]]] = {}
        """Per scope, per measured (largest micro-batch, micro-steps): (budget, peak, step ms, compile s, point)."""
        for r in self.rows:
            if r["scope"] == "eager":
                continue
            group = self.compiled.setdefault(r["scope"], {}).setdefault((int(r["micro_batch"]), int(r["accumulation"])), [])
            group.append((float(r["budget"]), float(r["peak_device_gib"]), float(r["step_ms"]),
                          float(r["compile_s"] or 30.0), r["point"]))
        for by_split in self.compiled.values():
            for pts in by_split.values():
                pts.sort()
        eager = [r for r in self.rows if r["scope"] == "eager"]
        self._eager_fit(eager)
        self.compile_s = {scope: statistics.median(p[3] for pts in by_split.values() for p in pts)
                          for scope, by_split in self.compiled.items()}
        self.recorded_fixed = self.fixed
        if family:
            self.fixed += family.held_gib()
        self._best: tuple[float, BalanceConfig] | None = None

    def _eager_fit(self, rows: list[dict[str, Any]]) -> None:
        """Eager peak = fixed + m * act * (1 - saved * c / L); step = a + acc * (b + ck * c / L) + k * 32."""
        plain = sorted((int(r["micro_batch"]), float(r["peak_device_gib"]), float(r["step_ms"]), r["point"])
                       for r in rows if not r["config"]["checkpoint"][0])
        ck = [(int(r["micro_batch"]), len(r["config"]["checkpoint"][0]), float(r["peak_device_gib"]), float(r["step_ms"]),
               r["point"]) for r in rows if r["config"]["checkpoint"][0]]
        if len(plain) >= 2:
            (m0, p0, t0, n0), (m1, p1, t1, n1) = plain[0], plain[-1]
            self.act = (p1 - p0) / (m1 - m0)
            self.fixed = p0 - m0 * self.act
            # step = acc * per_micro + k * 32: two equations (acc = 32 / m)
            a0, a1 = GLOBAL_BATCH / m0, GLOBAL_BATCH / m1
            self.per_micro = (t0 - t1) / (a0 - a1)
            self.per_all = t0 - a0 * self.per_micro
            self.eager_basis = [n0, n1]
            self.eager_range = (m0, m1)
        else:  # one eager point (the loss-outside grid): the loss-inside grid's slopes, this grid's level
            other = GridMachine("inside", grids=self.grids) if self.placement != "inside" else None
            assert other is not None and plain, "an eager point is needed"
            m0, p0, t0, n0 = plain[0]
            self.act, self.per_micro = other.act, other.per_micro
            self.fixed = p0 - m0 * self.act
            self.per_all = t0 - (GLOBAL_BATCH / m0) * self.per_micro
            self.eager_basis = [n0] + [f"{other.placement}:{n}" for n in other.eager_basis]
            self.eager_range = other.eager_range
        m, c, p, t, name = ck[0]
        self.saved = (self.fixed + m * self.act - p) / (m * self.act * c / LAYERS)
        self.ck_ms = (t - self.eager_ms(m, GLOBAL_BATCH // m, 0)) / ((GLOBAL_BATCH // m) * c / LAYERS)
        self.eager_basis.append(name)
        self.eager_points = {(int(r["micro_batch"]), len(r["config"]["checkpoint"][0])): r["point"] for r in rows}
        self.eager_checkpoints = max(c for _, c, *_ in ck)

    def eager_ms(self, m: int, acc: int, c: int) -> float:
        return self.per_all + acc * self.per_micro + acc * getattr(self, "ck_ms", 0.0) * c / LAYERS

    def point(self, cfg: BalanceConfig) -> Point:
        """True peak (GiB, device) and step time (ms) of ``cfg``; ``compile_s`` cold (None: eager); how
        it was read off the recorded points, from which, and what was applied on top."""
        pt = self._recorded_point(cfg)
        notes = list(pt.notes)
        how = _worst(pt.how, {"bf16": "measured", "fp16": "interpolated", "fp32": "extrapolated"}[cfg.dtype])
        peak, ms = pt.peak_gib, pt.step_ms
        if self.family:
            peak += self.family.held_gib() + max(cfg.micro_batches) * self.family.logits_gib(cfg, self.placement)
            ms *= self.family.time_factor()
            notes.append(f"{self.family.name} family")
        if self.tilt:
            scope = cfg.compile_scope if cfg.compile_scope in self.compiled else next(iter(self.compiled))
            f = self.tilt.factor(cfg, lowest_budget=min(p[0] for pts in self.compiled[scope].values() for p in pts))
            ms *= f
            notes.append(f"tilt x{f:.3f}")
        return Point(peak, ms, pt.compile_s, how, pt.basis, tuple(notes))

    def _recorded_point(self, cfg: BalanceConfig) -> Point:
        m = max(cfg.micro_batches)
        acc = cfg.accumulation
        notes: list[str] = []
        if cfg.dtype != "bf16":
            notes.append(f"{cfg.dtype} from bf16")
        if cfg.compile == "off":
            c = len(cfg.checkpoint[0])
            peak = self.recorded_fixed + m * self.act * (1 - self.saved * c / LAYERS)
            ms = self.eager_ms(m, acc, c)
            extra_act = (FP32_ACTIVATIONS - 1) * m * self.act if cfg.dtype == "fp32" else 0.0
            even = m * acc == GLOBAL_BATCH
            name = self.eager_points.get((m, c)) if even else None
            how = ("measured" if name in self.eager_basis else
                   "interpolated" if self.eager_range[0] <= m <= self.eager_range[1] and c <= self.eager_checkpoints
                   else "extrapolated")
            if not even:
                notes.append("two-size eager as its largest micro-step")
            return Point(peak + extra_act, ms * self._dtype_factor(cfg.dtype), None, how,
                         tuple(self.eager_basis), tuple(notes))
        scope = cfg.compile_scope if cfg.compile_scope in self.compiled else next(iter(self.compiled))
        b = (cfg.activation_budget or [1.0])[0]
        by_split = self.compiled[scope]
        sizes = cfg.micro_step_sizes(0)
        two_size = len(set(sizes)) > 1
        even = {k: v for k, v in by_split.items() if k[0] * k[1] == GLOBAL_BATCH}
        rich = max(even.values() or by_split.values(), key=len)  # the split measured at the most budgets: the budget's shape
        rich_b = [p[0] for p in rich]

        def at(pts: list[tuple[float, float, float, float, str]]) -> tuple[float, float, list[str], str]:
            if len(pts) > 1:
                xs = [p[0] for p in pts]
                peak, used, how = _traced(xs, [p[1] for p in pts], b)
                return peak, _interp(xs, [p[2] for p in pts], b), [pts[i][4] for i in used], how
            b0, peak0, ms0, _, name = pts[0]  # one budget measured: the richest split's change from b0 to b
            if b == b0:
                return peak0, ms0, [name], "measured"
            d_peak = _interp(rich_b, [p[1] for p in rich], b) - _interp(rich_b, [p[1] for p in rich], b0)
            r_ms = _interp(rich_b, [p[2] for p in rich], b) / _interp(rich_b, [p[2] for p in rich], b0)
            used = sorted({i for x in (b, b0) for i in _traced(rich_b, rich_b, x)[1]})
            how = "interpolated" if rich_b[0] <= b <= rich_b[-1] else "extrapolated"
            return peak0 + d_peak, ms0 * r_ms, [name] + [rich[i][4] for i in used], how

        if not two_size:
            groups_from = by_split  # every measured split (a measured two-size one extends the even ones' reach)
        elif self.measured_two_size and (m, acc) in by_split:
            groups_from = {(m, acc): by_split[(m, acc)]}  # this very split was measured
        else:
            groups_from = even  # priced from the even splits (times two_size_factor below)
        # peaks from every measured split (the H200's two-size splits peaked as predicted: 13.8 GiB for 13.9)
        peak_from = by_split if two_size and (m, acc) not in groups_from else groups_from
        groups = {key: at(pts) for key, pts in {**peak_from, **groups_from}.items()}
        peak, m_used, m_how = _extend_traced(sorted((float(k[0]), groups[k][0]) for k in peak_from), float(m),
                                             slope=(0.3, self.act))
        ms, a_used, a_how = _extend_traced(sorted((float(k[1]), groups[k][1]) for k in groups_from), float(acc),
                                           slope=(5.0, self.per_micro))
        read = [k for k in peak_from if float(k[0]) in m_used] + [k for k in groups_from if float(k[1]) in a_used]
        basis = sorted({n for k in read for n in groups[k][2]})
        how = _worst(m_how, a_how, *(groups[k][3] for k in read))
        if two_size and (m, acc) not in groups_from:
            how = _worst(how, "interpolated")
            if self.two_size_factor != 1.0:
                ms *= self.two_size_factor
                notes.append(f"two-size x{self.two_size_factor:g}")
        if cfg.dtype == "fp32":
            peak += (FP32_ACTIVATIONS - 1) * m * self.act * 0.6
        return Point(peak, ms * self._dtype_factor(cfg.dtype), self.compile_s[scope], how, tuple(basis), tuple(notes))

    @staticmethod
    def _dtype_factor(dtype: str) -> float:
        return {"bf16": 1.0, "fp16": FP16_SLOWER, "fp32": FP32_SLOWER}[dtype]

    def space(self, scopes: tuple[str, ...] = ("whole", "regional")) -> list[BalanceConfig]:
        """Every configuration of the study's search space the replay judges against (bf16/fp16)."""
        out: list[BalanceConfig] = []
        for dtype in ("bf16", "fp16"):
            for acc in range(1, 9):
                out += [BalanceConfig.any_split(rank_samples=[GLOBAL_BATCH], accumulation=acc, dtype=dtype,
                                                checkpoint=[list(range(c))]) for c in range(LAYERS + 1)]
                out += [BalanceConfig.any_split(rank_samples=[GLOBAL_BATCH], accumulation=acc, dtype=dtype,
                                                compile="default", compile_scope=scope, activation_budget=[b / 20])
                        for scope in scopes if scope in self.compiled for b in range(1, 21)]
        return out

    def best(self) -> tuple[float, BalanceConfig]:
        """The grid best: the fastest feasible configuration of :meth:`space` on this machine."""
        if self._best is None:
            fits = [(pt.step_ms, c) for c in self.space() if (pt := self.point(c)).peak_gib <= self.usable_gib]
            self._best = min(fits, key=lambda x: x[0])
        return self._best


def label(cfg: BalanceConfig) -> str:
    """A configuration as one reads it: ``regional 8x4 b0.65 bf16``, ``whole 5,5,5,5,4,4,4 b1 bf16``,
    ``eager 4x8 ck8 fp16``."""
    sizes = cfg.micro_step_sizes(0)
    split = f"{sizes[0]}x{len(sizes)}" if len(set(sizes)) == 1 else ",".join(map(str, sizes))
    if cfg.compile == "off":
        return f"eager {split} ck{len(cfg.checkpoint[0])} {cfg.dtype}"
    return f"{cfg.compile_scope} {split} b{(cfg.activation_budget or [1.0])[0]:g} {cfg.dtype}"


def make_machine(kind: str, placement: str, *, seed: int = 0, two_size_factor: float = TWO_SIZE_FACTOR,
                 second_grids: str | None = None) -> GridMachine:
    """One of ``--machines``: ``recorded`` (the grids as measured), ``tilted`` (``seed``'s :class:`Tilt`,
    every two-size compiled split at ``two_size_factor``) or ``second`` (:data:`SECOND` derived from the
    recorded grids, or the grids under ``second_grids`` once a device has recorded them:
    ``benchmarks/second_family_gpu.sh``)."""
    if kind == "recorded":
        return GridMachine(placement, two_size_factor=two_size_factor)
    if kind == "tilted":
        return GridMachine(placement, two_size_factor=two_size_factor, measured_two_size=False,
                           tilt=Tilt.from_seed(seed))
    if kind == "second":
        if second_grids:
            grids = {p: [os.path.join(second_grids, f"second-grid-{p}.json")] for p in ("inside", "outside")}
            machine = GridMachine(placement, two_size_factor=two_size_factor, grids=grids)
            machine.name, machine.cap_gib = "second", SECOND.cap_gib  # measured: nothing derived but the cap
            machine.usable_gib = machine.cap_gib * (1 - HEADROOM)
            machine.gradients_gib = GRADIENTS_GIB + SECOND.parameters() * 4 / 2**30
            machine.parameter_gb = PARAMETER_GB + SECOND.parameters() * 4 / 1e9
            return machine
        return GridMachine(placement, two_size_factor=two_size_factor, family=SECOND)
    raise ValueError(f"machine {kind!r} is not one of {', '.join(MACHINES)}")


MACHINES = ("recorded", "tilted", "second")


def replay(machine: GridMachine, *, seed: int, budget: str, root: str) -> dict[str, Any]:
    """One ``tune --time-budget`` study on ``machine``; its saved configuration against the grid best."""
    from autobalance.tuner import Tuner, TuneSettings, _loop, _tuner
    from autobalance.tuner._launching import TrialLauncher
    from autobalance.tuner.search._timing import verification_runs

    clock = types.SimpleNamespace(now=1000.0)
    clock.monotonic = lambda: clock.now
    clock.time = lambda: clock.now
    clock.sleep = lambda s: setattr(clock, "now", clock.now + s)
    saved_time = (_tuner.time, _loop.time)
    _tuner.time, _loop.time = clock, clock  # type: ignore[assignment]
    compiled: set[str] = set()
    rng = np.random.default_rng(seed)
    worker = {"fresh": True, "trials": 0}
    read: list[dict[str, Any]] = []  # per launched trial: what the replay answered and from which points
    own = BalanceConfig(micro_batches=[8], accumulation=4, global_batch=GLOBAL_BATCH, dtype="fp32",
                        gradient_as_bucket_view=True)

    def run_s(cfg: BalanceConfig, steps: float) -> tuple[float, float | None, float]:
        """(wall, compile, worker start) of one run of ``steps`` steps; a compiled run recycles the
        worker after it, so the next run starts a fresh one."""
        pt = machine.point(cfg)
        start = WORKER_START_S if worker["fresh"] else 0.0
        worker["trials"] = 1 if worker["fresh"] else worker["trials"] + 1
        worker["fresh"] = cfg.compile != "off"
        compile_s = None
        if pt.compile_s is not None:
            key = json.dumps([cfg.compile_scope, cfg.dtype, cfg.micro_step_sizes(0), cfg.activation_budget])
            compile_s = pt.compile_s * (FROM_CACHE_SHARE if key in compiled else 1.0)
            compiled.add(key)
        return start + TRIAL_OVERHEAD_S + (compile_s or 0.0) + steps * pt.step_ms / 1000, compile_s, start

    class Launcher(TrialLauncher):
        def launch(self, study: optuna.Study, *, number: int, config: BalanceConfig | None,
                   trial: optuna.Trial | None = None, again: bool = False) -> TrialOutcome:
            cfg = config or own
            truth = machine.point(cfg)
            read.append({"trial": number, "again": again, "config": label(cfg), "true_ms": round(truth.step_ms, 2),
                         "peak_gib": round(truth.peak_gib, 3), "how": truth.how, "basis": list(truth.basis),
                         "notes": list(truth.notes)})
            wall, compile_s, start = run_s(cfg, MEASURED_STEPS + WARMUP_STEPS)
            started_at = clock.now
            clock.now += wall
            pt = machine.point(cfg)
            pt = Point(pt.peak_gib * (1 + PEAK_NOISE * rng.standard_normal()),
                       pt.step_ms * (1 + STEP_NOISE * rng.standard_normal()), pt.compile_s)  # what a run measures
            ok = pt.peak_gib <= machine.cap_gib  # the cap is the allocator's: judged against usable afterwards
            gib = 2**30
            rep: dict[str, Any] = {
                "status": "ok" if ok else "oom", "rank": 0, "config": cfg.to_dict(), "defaults": own.to_dict(),
                "model": {"num_blocks": LAYERS, "dropout_modules": 0, "parameter_bytes": int(machine.parameter_gb * 1e9),
                          "loss_in_model": machine.placement == "inside"},
                "device": {"type": "cuda", "name": "replayed H200", "capacity_bytes": 141 * gib},
                "memory": {"peak_device": pt.peak_gib * gib, "peak_allocated": pt.peak_gib * gib,
                           "peak_reserved": pt.peak_gib * gib, "outside_pytorch": 0},
                "timing": {"startup_s": wall - (compile_s or 0) - MEASURED_STEPS * pt.step_ms / 1000,
                           "steps_s": MEASURED_STEPS * pt.step_ms / 1000, "compile_s": compile_s, "wall_s": wall},
                "written_at": datetime.datetime.fromtimestamp(clock.now, datetime.UTC).isoformat(),
                # held apart from activations: live after the step (gradients set to None) + the gradients
                "breakdown": {"bytes": {"live_after_step": (machine.fixed - machine.gradients_gib) * gib,
                                        "gradients": machine.gradients_gib * gib}},
                "warm": {"pool_trial": worker["trials"], "fresh_outside": 0, "inherited_outside": 0},
                "torch_version": "replayed"}
            if ok:
                rep.update(step_times_s=[pt.step_ms / 1000] * MEASURED_STEPS, step_time_s=pt.step_ms / 1000,
                           measured_steps=MEASURED_STEPS)
            if cfg.compile != "off":
                cold = compile_s is not None and compile_s == pt.compile_s
                rep["compile"] = {"mode": cfg.compile, "scope": cfg.compile_scope,
                                  "cache": {"fx_graph_hits": int(not cold), "fx_graph_misses": int(cold)}}
                rep["activation_budget"] = (cfg.activation_budget or [1.0])[0]
            self.trials_run += 1
            outcome = TrialOutcome(status=Status.OK if ok else Status.OOM, reason="replayed", reports={0: rep},
                                returncode=0, wall_s=wall, trial_dir="", failing_rank=None if ok else 0,
                                pool_start_s=start,  # as the warm pool reports a run that started a worker
                                started_at=started_at)
            if cfg.compile != "off":  # the replay's workers do not outlive a compiled trial (``run_s``)
                outcome.recycled = "replayed: a compiled trial's worker is not reused"
            return outcome

    name = f"{machine.placement}-{budget}-{seed}"
    if machine.name != "recorded":
        name = f"{machine.name}-{name}"
    settings = TuneSettings(script=os.path.join(HERE, "..", "examples", "gpt", "train.py"), device="cuda", trials=500,
                            nproc_per_node=1, memory_cap_gib=[machine.cap_gib], headroom=HEADROOM, compile="search",
                            time_budget=budget, seed=seed, measure_s=0, prune_factor=0,  # remeasure: auto (on, on CUDA)
                            storage=f"sqlite:///{root}/{name}.db", study_name=name, runs_dir=os.path.join(root, "runs"))
    try:
        tuner = Tuner(settings=settings)
        tuner.launcher = Launcher(settings=settings, storage=tuner.storage, reporter=tuner.reporter)
        started = clock.now
        result = tuner.run()
        loop_s = clock.now - started
    finally:
        _tuner.time, _loop.time = saved_time  # type: ignore[assignment]
    grid_ms, grid_cfg = machine.best()
    grid_pt = machine.point(grid_cfg)
    head = {"machine": machine.name, "placement": machine.placement, "budget": budget, "seed": seed}
    if machine.tilt:
        head["tilt"] = machine.tilt.to_dict()
    if machine.family:
        head["family"] = machine.family.to_dict()
    grid = {"grid_best_ms": round(grid_ms, 2), "grid_best": grid_cfg.to_dict(), "grid_best_config": label(grid_cfg),
            "grid_best_how": grid_pt.how, "grid_best_basis": list(grid_pt.basis)}
    stored = optuna.load_study(study_name=name, storage=settings.storage)
    trials = stored.trials
    head["leaders"] = leaders_of(stored.user_attrs.get("autobalance:leaders"), read)
    by_number = {t.number: t for t in trials}
    for r in read:
        t = by_number.get(r["trial"])
        r["phase"] = t.user_attrs.get("proposed_by", "sampler") if t is not None else None
        r["reason"] = t.user_attrs.get("proposal_note") if t is not None else None  # why the phase proposed it
    if result.best is None:
        return {**head, "saved": None, "ratio": None, "wall_s": round(loop_s, 1), **grid, "trial_points": read,
                "log": trial_log(trials)}
    best = BalanceConfig.from_dict(result.best.user_attrs["config"])
    verify_s = 0.0
    for _, cfg, _ in verification_runs(own, best, dropout=False):  # through the warm pool, as tune verifies
        verify_s += run_s(cfg, 2)[0] + VERIFY_RUN_S + VERIFY_COMPARE_S
    saved = machine.point(best)
    true_ms = saved.step_ms
    phases = [t.user_attrs.get("proposed_by", "sampler") for t in trials]
    return {**head, "saved": best.to_dict(), "saved_config": label(best),
            "saved_ms": round(true_ms, 2), "saved_how": saved.how, "saved_basis": list(saved.basis),
            "saved_notes": list(saved.notes), **grid,
            "ratio": round(true_ms / grid_ms, 4), "loop_s": round(loop_s, 1), "verify_s": round(verify_s, 1),
            "wall_s": round(loop_s + verify_s, 1), "trials": len(trials), "phases": phases, "trial_points": read,
            "log": trial_log(trials)}


def leaders_of(record: Any, read: list[dict[str, Any]]) -> dict[str, Any] | None:
    """What the tuner's re-measure of its leaders before saving did (``tuner/_remeasure.py``): the runs
    of each leader, the pooled step it ranked by against its true one, best first; None when it made
    none (the tuner's reason is in its notes)."""
    if not isinstance(record, dict):
        return None
    true = {r["trial"]: r["true_ms"] for r in read}
    return {"runs": record.get("runs"), "order": record.get("order"),
            "pooled_ms": {n: (e.get("step_time_ms"), e.get("runs")) for n, e in (record.get("trials") or {}).items()},
            "true_ms": {str(n): true.get(n) for n in record.get("order") or []}}


def trial_log(trials: list[optuna.trial.FrozenTrial]) -> list[list[Any]]:
    """Each trial's (phase, configuration, state, values): what ``--dump`` writes to compare two versions
    of the search decision by decision."""
    return [[t.user_attrs.get("proposed_by", "sampler"), t.user_attrs.get("config"), t.state.name,
             t.values] for t in trials]


def _seeds(text: str) -> list[int]:
    if "-" in text:
        lo, hi = text.split("-")
        return list(range(int(lo), int(hi) + 1))
    return [int(s) for s in text.split(",")]


def summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    order = {m: i for i, m in enumerate(MACHINES)}
    keys = {(r.get("machine", "recorded"), r["placement"], r["budget"]) for r in rows}
    for key in sorted(keys, key=lambda k: (order.get(k[0], len(order)), k[0], k[1], k[2])):
        group = [r for r in rows if (r.get("machine", "recorded"), r["placement"], r["budget"]) == key]
        ratios = [r["ratio"] if r["ratio"] is not None else 9.0 for r in group]
        out.append({"machine": key[0], "placement": key[1], "budget": key[2], "studies": len(group),
                    "median_ratio": round(statistics.median(ratios), 4), "worst_ratio": round(max(ratios), 4),
                    "median_wall_s": round(statistics.median(r["wall_s"] for r in group), 1),
                    "worst_wall_s": max(r["wall_s"] for r in group)})
    return out


def _parse(p: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[list[str], list[str], list[str], list[int]]:
    """The lists of ``--machines``, ``--placements``, ``--budgets``, ``--seeds``; a one-line error otherwise."""
    machines = [m for m in args.machines.split(",") if m]
    bad = [m for m in machines if m not in MACHINES]
    if bad or not machines:
        p.error(f"--machines {args.machines!r}: unknown {', '.join(bad) or 'empty'}; use a comma-separated subset of "
                f"{','.join(MACHINES)}")
    placements = [x for x in args.placements.split(",") if x]
    if not placements or any(x not in GRIDS for x in placements):
        p.error(f"--placements {args.placements!r}: use a comma-separated subset of {','.join(GRIDS)}")
    budgets = [x for x in args.budgets.split(",") if x]
    if not budgets:
        p.error(f"--budgets {args.budgets!r}: give one or more time budgets, e.g. 5m,10m")
    try:
        seeds = _seeds(args.seeds)
    except ValueError:
        p.error(f"--seeds {args.seeds!r}: give a range (0-19) or a comma-separated list (0,3,7)")
    if not seeds:
        p.error(f"--seeds {args.seeds!r}: the range is empty; give LOW-HIGH with LOW <= HIGH")
    if args.two_size_factor <= 0:
        p.error(f"--two-size-factor {args.two_size_factor}: give a positive factor (1.5: the H200's; 1: as the even splits)")
    if args.second_grids and not all(os.path.exists(os.path.join(args.second_grids, f"second-grid-{x}.json"))
                                      for x in placements):
        p.error(f"--second-grids {args.second_grids!r}: holds no second-grid-PLACEMENT.json for {','.join(placements)}; "
                "give the $OUT of benchmarks/second_family_gpu.sh")
    if args.out and not os.path.isdir(os.path.dirname(os.path.abspath(args.out))):
        p.error(f"--out {args.out!r}: its folder does not exist; create it first or name a file in an existing one")
    return machines, placements, budgets, seeds


def _line(row: dict[str, Any]) -> str:
    """One study as printed: the figures, then what the saved configuration was read from."""
    keys = ("machine", "placement", "budget", "seed", "saved_config", "saved_ms", "ratio", "wall_s", "trials",
            "saved_how", "saved_basis", "saved_notes", "leaders")
    return json.dumps({k: row.get(k) for k in keys})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", default="0-19")
    p.add_argument("--placements", default="inside,outside")
    p.add_argument("--budgets", default="5m,10m")
    p.add_argument("--machines", default="recorded",
                   help=f"comma-separated, of {','.join(MACHINES)}: the grids as recorded; each seed's tilt of them "
                        "(the grid best taken on the tilted machine); the second family derived from them")
    p.add_argument("--two-size-factor", type=float, default=TWO_SIZE_FACTOR,
                   help="an unmeasured compiled split of two micro-step sizes over the even splits' interpolation "
                        "(default 1.5, the H200's; 1: priced as the even splits, the replay before)")
    p.add_argument("--second-grids", default=None,
                   help="a folder with second-grid-inside.json / -outside.json recorded by "
                        "benchmarks/second_family_gpu.sh: the second machine from them instead of derived")
    p.add_argument("--trial-points", action="store_true",
                   help="also print, per study, each trial's configuration, the recorded points it was read from, "
                        "and the phase that proposed it with its reason")
    p.add_argument("--out", default=None, help="write the rows and the summary as JSON here")
    p.add_argument("--dump", default=None, help="write each study's trials (phase, configuration, state, values) "
                   "and saved configuration as JSON here, to compare two versions of the search")
    p.add_argument("--compare", default=None, help="a --dump of an earlier version: say which studies decide "
                   "differently (the first trial that differs) and exit 1 if any does")
    args = p.parse_args()
    machines, placements, budgets, seeds = _parse(p, args)
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    import autobalance.report as report

    report.upload_trial_chart = lambda *a, **k: None  # type: ignore[assignment]  # no per-trial charts
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for kind in machines:
            for placement in placements:
                machine = make_machine(kind, placement, two_size_factor=args.two_size_factor,
                                       second_grids=args.second_grids)
                if kind != "tilted":
                    ms, cfg = machine.best()
                    print(f"{kind} {placement}: grid best {ms:.1f} ms {label(cfg)} ({machine.point(cfg).how}) "
                          f"{cfg.to_json()}", flush=True)
                for budget in budgets:
                    for seed in seeds:
                        if kind == "tilted":
                            machine = make_machine(kind, placement, seed=seed, two_size_factor=args.two_size_factor)
                        row = replay(machine, seed=seed, budget=budget, root=root)
                        rows.append(row)
                        print(_line(row), flush=True)
                        if args.trial_points:
                            for t in row["trial_points"]:
                                print("    " + json.dumps(t), flush=True)
    result = {"benchmark": "replay_search", "command": "python benchmarks/replay_search.py " + " ".join(sys.argv[1:]),
              "two_size_factor": args.two_size_factor, "second": SECOND.to_dict() if "second" in machines else None,
              "rows": rows, "summary": summary(rows)}
    for s in result["summary"]:
        print(json.dumps(s), flush=True)
    if args.out:
        tmp = args.out + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(result, fh, indent=1)
        os.replace(tmp, args.out)  # nothing half-written
    if args.dump:
        with open(args.dump, "w") as fh:
            json.dump([{k: r.get(k) for k in ("machine", "placement", "budget", "seed", "saved", "log")}
                       for r in rows], fh, indent=0)
    if args.compare and compare(rows, args.compare):
        sys.exit(1)


def _key(r: dict[str, Any]) -> tuple[str, str, str, int]:
    return (r.get("machine") or "recorded", r["placement"], r["budget"], r["seed"])


def compare(rows: list[dict[str, Any]], path: str) -> int:
    """How many of ``rows``' studies decide differently from the same studies in the dump at ``path``
    (each printed with its first differing trial); a study missing from the dump counts."""
    with open(path) as fh:
        before = {_key(r): r for r in json.load(fh)}
    differ = 0
    for r in rows:
        old = before.get(_key(r))
        if old is not None and old["log"] == r.get("log") and old["saved"] == r.get("saved"):
            continue
        differ += 1
        pairs = list(zip((old or {}).get("log") or [], r.get("log") or [], strict=False))
        first = next((i for i, (a, b) in enumerate(pairs) if a != b), len(pairs))
        print(f"differs: {_key(r)[0]} {r['placement']} {r['budget']} seed {r['seed']} from trial {first}", flush=True)
    print(f"{len(rows) - differ} of {len(rows)} studies decide as in {path}", flush=True)
    return differ


if __name__ == "__main__":
    main()
