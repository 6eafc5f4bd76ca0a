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

Printed per placement and budget: each seed's saved configuration, its true step over the grid's best
(the best feasible point of the same interpolated machine over every scope, split, budget and dtype the
search space holds), the wall with verification, and the median and worst over the seeds.

    python benchmarks/replay_search.py --seeds 0-19 --placements inside,outside --budgets 5m,10m \\
        --out benchmarks/2026-12-04-cpu/replay_search.json
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
                key = json.dumps([scope, row["micro_batch"], row.get("budget"), len(cfg["checkpoint"][0]),
                                  cfg.get("rank_samples")])
                if key in seen:
                    continue
                seen.add(key)
                rows.append({**row, "scope": scope})
    return rows


def _interp(xs: list[float], ys: list[float], x: float) -> float:
    """Piecewise-linear through (xs, ys) (xs ascending), clamped outside."""
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    i = bisect.bisect_right(xs, x)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def _extend(points: list[tuple[float, float]], x: float, *, slope: tuple[float, float]) -> float:
    """Piecewise-linear through ``points`` (x ascending; repeated x averaged), extended linearly past
    the ends with the two nearest points' slope held within ``slope`` (low, high): more samples per
    micro-step or more micro-steps never cost less, and noise between two close points does not
    extrapolate far."""
    merged: dict[float, list[float]] = {}
    for px, py in points:
        merged.setdefault(px, []).append(py)
    xs = sorted(merged)
    ys = [statistics.mean(merged[v]) for v in xs]
    lo, hi = slope
    if len(xs) == 1:
        return ys[0] + hi * (x - xs[0])
    if x < xs[0]:
        return ys[0] + min(hi, max(lo, (ys[1] - ys[0]) / (xs[1] - xs[0]))) * (x - xs[0])
    if x > xs[-1]:
        return ys[-1] + min(hi, max(lo, (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]))) * (x - xs[-1])
    return _interp(xs, ys, x)


@dataclass
class Point:
    peak_gib: float
    step_ms: float
    compile_s: float | None


class GridMachine:
    """One placement's recorded grid, answering any configuration of the search space (see the module doc)."""

    def __init__(self, placement: str) -> None:
        self.placement = placement
        self.rows = _rows(GRIDS[placement])
        self.compiled: dict[str, dict[tuple[int, int], list[tuple[float, float, float, float]]]] = {}
        """Per scope, per measured (largest micro-batch, micro-steps): (budget, peak, step ms, compile s)."""
        for r in self.rows:
            if r["scope"] == "eager":
                continue
            group = self.compiled.setdefault(r["scope"], {}).setdefault((int(r["micro_batch"]), int(r["accumulation"])), [])
            group.append((float(r["budget"]), float(r["peak_device_gib"]), float(r["step_ms"]),
                          float(r["compile_s"] or 30.0)))
        for by_split in self.compiled.values():
            for pts in by_split.values():
                pts.sort()
        eager = [r for r in self.rows if r["scope"] == "eager"]
        self._eager_fit(eager)
        self.compile_s = {scope: statistics.median(p[3] for pts in by_split.values() for p in pts)
                          for scope, by_split in self.compiled.items()}

    def _eager_fit(self, rows: list[dict[str, Any]]) -> None:
        """Eager peak = fixed + m * act * (1 - saved * c / L); step = a + acc * (b + ck * c / L) + k * 32."""
        plain = sorted((int(r["micro_batch"]), float(r["peak_device_gib"]), float(r["step_ms"]))
                       for r in rows if not r["config"]["checkpoint"][0])
        ck = [(int(r["micro_batch"]), len(r["config"]["checkpoint"][0]), float(r["peak_device_gib"]), float(r["step_ms"]))
              for r in rows if r["config"]["checkpoint"][0]]
        if len(plain) >= 2:
            (m0, p0, t0), (m1, p1, t1) = plain[0], plain[-1]
            self.act = (p1 - p0) / (m1 - m0)
            self.fixed = p0 - m0 * self.act
            # step = acc * per_micro + k * 32: two equations (acc = 32 / m)
            a0, a1 = GLOBAL_BATCH / m0, GLOBAL_BATCH / m1
            self.per_micro = (t0 - t1) / (a0 - a1)
            self.per_all = t0 - a0 * self.per_micro
        else:  # one eager point (the loss-outside grid): the loss-inside grid's slopes, this grid's level
            other = GridMachine("inside") if self.placement != "inside" else None
            assert other is not None and plain, "an eager point is needed"
            m0, p0, t0 = plain[0]
            self.act, self.per_micro = other.act, other.per_micro
            self.fixed = p0 - m0 * self.act
            self.per_all = t0 - (GLOBAL_BATCH / m0) * self.per_micro
        m, c, p, t = ck[0]
        self.saved = (self.fixed + m * self.act - p) / (m * self.act * c / LAYERS)
        self.ck_ms = (t - self.eager_ms(m, GLOBAL_BATCH // m, 0)) / ((GLOBAL_BATCH // m) * c / LAYERS)

    def eager_ms(self, m: int, acc: int, c: int) -> float:
        return self.per_all + acc * self.per_micro + acc * getattr(self, "ck_ms", 0.0) * c / LAYERS

    def point(self, cfg: BalanceConfig) -> Point:
        """True peak (GiB, device) and step time (ms) of ``cfg``; ``compile_s`` cold (None: eager)."""
        m = max(cfg.micro_batches)
        acc = cfg.accumulation
        if cfg.compile == "off":
            c = len(cfg.checkpoint[0])
            peak = self.fixed + m * self.act * (1 - self.saved * c / LAYERS)
            ms = self.eager_ms(m, acc, c)
            extra_act = (FP32_ACTIVATIONS - 1) * m * self.act if cfg.dtype == "fp32" else 0.0
            return Point(peak + extra_act, ms * self._dtype_factor(cfg.dtype), None)
        scope = cfg.compile_scope if cfg.compile_scope in self.compiled else next(iter(self.compiled))
        b = (cfg.activation_budget or [1.0])[0]
        by_split = self.compiled[scope]
        rich = max(by_split.values(), key=len)  # the split measured at the most budgets: the budget's shape
        rich_b = [p[0] for p in rich]

        def at(pts: list[tuple[float, float, float, float]]) -> tuple[float, float]:
            if len(pts) > 1:
                return _interp([p[0] for p in pts], [p[1] for p in pts], b), _interp([p[0] for p in pts], [p[2] for p in pts], b)
            b0, peak0, ms0, _ = pts[0]  # one budget measured: the richest split's change from b0 to b
            d_peak = _interp(rich_b, [p[1] for p in rich], b) - _interp(rich_b, [p[1] for p in rich], b0)
            r_ms = _interp(rich_b, [p[2] for p in rich], b) / _interp(rich_b, [p[2] for p in rich], b0)
            return peak0 + d_peak, ms0 * r_ms

        groups = {key: at(pts) for key, pts in by_split.items()}
        peak = _extend(sorted((float(k[0]), v[0]) for k, v in groups.items()), float(m), slope=(0.3, self.act))
        ms = _extend(sorted((float(k[1]), v[1]) for k, v in groups.items()), float(acc), slope=(5.0, self.per_micro))
        if cfg.dtype == "fp32":
            peak += (FP32_ACTIVATIONS - 1) * m * self.act * 0.6
        return Point(peak, ms * self._dtype_factor(cfg.dtype), self.compile_s[scope])

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
        """The grid best: the fastest feasible configuration of :meth:`space`."""
        fits = [(self.point(c).step_ms, c) for c in self.space() if self.point(c).peak_gib <= USABLE_GIB]
        return min(fits, key=lambda x: x[0])


def replay(machine: GridMachine, *, seed: int, budget: str, root: str) -> dict[str, Any]:
    """One ``tune --time-budget`` study on ``machine``; its saved configuration against the grid best."""
    from autobalance.tuner import Tuner, TuneSettings, _loop, _tuner
    from autobalance.tuner._launching import TrialLauncher
    from autobalance.tuner._verify_time import verification_runs

    clock = types.SimpleNamespace(now=1000.0)
    clock.monotonic = lambda: clock.now
    clock.time = lambda: clock.now
    clock.sleep = lambda s: setattr(clock, "now", clock.now + s)
    saved_time = (_tuner.time, _loop.time)
    _tuner.time, _loop.time = clock, clock  # type: ignore[assignment]
    compiled: set[str] = set()
    rng = np.random.default_rng(seed)
    worker = {"fresh": True, "trials": 0}
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
            wall, compile_s, start = run_s(cfg, MEASURED_STEPS + WARMUP_STEPS)
            started_at = clock.now
            clock.now += wall
            pt = machine.point(cfg)
            pt = Point(pt.peak_gib * (1 + PEAK_NOISE * rng.standard_normal()),
                       pt.step_ms * (1 + STEP_NOISE * rng.standard_normal()), pt.compile_s)  # what a run measures
            ok = pt.peak_gib <= CAP_GIB  # the cap is the allocator's: judged against usable afterwards
            gib = 2**30
            rep: dict[str, Any] = {
                "status": "ok" if ok else "oom", "rank": 0, "config": cfg.to_dict(), "defaults": own.to_dict(),
                "model": {"num_blocks": LAYERS, "dropout_modules": 0, "parameter_bytes": int(PARAMETER_GB * 1e9),
                          "loss_in_model": machine.placement == "inside"},
                "device": {"type": "cuda", "name": "replayed H200", "capacity_bytes": 141 * gib},
                "memory": {"peak_device": pt.peak_gib * gib, "peak_allocated": pt.peak_gib * gib,
                           "peak_reserved": pt.peak_gib * gib, "outside_pytorch": 0},
                "timing": {"startup_s": wall - (compile_s or 0) - MEASURED_STEPS * pt.step_ms / 1000,
                           "steps_s": MEASURED_STEPS * pt.step_ms / 1000, "compile_s": compile_s, "wall_s": wall},
                "written_at": datetime.datetime.fromtimestamp(clock.now, datetime.UTC).isoformat(),
                # held apart from activations: live after the step (gradients set to None) + the gradients
                "breakdown": {"bytes": {"live_after_step": (machine.fixed - GRADIENTS_GIB) * gib,
                                        "gradients": GRADIENTS_GIB * gib}},
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
    settings = TuneSettings(script=os.path.join(HERE, "..", "examples", "gpt", "train.py"), device="cuda", trials=500,
                            nproc_per_node=1, memory_cap_gib=[CAP_GIB], headroom=HEADROOM, compile="search",
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
    if result.best is None:
        return {"placement": machine.placement, "budget": budget, "seed": seed, "saved": None, "ratio": None,
                "wall_s": round(loop_s, 1), "grid_best_ms": round(grid_ms, 2),
                "log": trial_log(optuna.load_study(study_name=name, storage=settings.storage).trials)}
    best = BalanceConfig.from_dict(result.best.user_attrs["config"])
    verify_s = 0.0
    for _, cfg, _ in verification_runs(own, best, dropout=False):  # through the warm pool, as tune verifies
        verify_s += run_s(cfg, 2)[0] + VERIFY_RUN_S + VERIFY_COMPARE_S
    true_ms = machine.point(best).step_ms
    trials = optuna.load_study(study_name=name, storage=settings.storage).trials
    phases = [t.user_attrs.get("proposed_by", "sampler") for t in trials]
    log = trial_log(trials)
    return {"placement": machine.placement, "budget": budget, "seed": seed, "saved": best.to_dict(),
            "saved_ms": round(true_ms, 2), "grid_best_ms": round(grid_ms, 2), "grid_best": grid_cfg.to_dict(),
            "ratio": round(true_ms / grid_ms, 4), "loop_s": round(loop_s, 1), "verify_s": round(verify_s, 1),
            "wall_s": round(loop_s + verify_s, 1), "trials": len(trials), "phases": phases, "log": log}


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
    for key in sorted({(r["placement"], r["budget"]) for r in rows}):
        group = [r for r in rows if (r["placement"], r["budget"]) == key]
        ratios = [r["ratio"] if r["ratio"] is not None else 9.0 for r in group]
        out.append({"placement": key[0], "budget": key[1], "studies": len(group),
                    "median_ratio": round(statistics.median(ratios), 4), "worst_ratio": round(max(ratios), 4),
                    "median_wall_s": round(statistics.median(r["wall_s"] for r in group), 1),
                    "worst_wall_s": max(r["wall_s"] for r in group)})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", default="0-19")
    p.add_argument("--placements", default="inside,outside")
    p.add_argument("--budgets", default="5m,10m")
    p.add_argument("--out", default=None, help="write the rows and the summary as JSON here")
    p.add_argument("--dump", default=None, help="write each study's trials (phase, configuration, state, values) "
                   "and saved configuration as JSON here, to compare two versions of the search")
    p.add_argument("--compare", default=None, help="a --dump of an earlier version: say which studies decide "
                   "differently (the first trial that differs) and exit 1 if any does")
    args = p.parse_args()
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    import autobalance.report as report

    report.upload_trial_chart = lambda *a, **k: None  # type: ignore[assignment]  # no per-trial charts
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for placement in args.placements.split(","):
            machine = GridMachine(placement)
            ms, cfg = machine.best()
            print(f"{placement}: grid best {ms:.1f} ms {cfg.to_json()}", flush=True)
            for budget in args.budgets.split(","):
                for seed in _seeds(args.seeds):
                    row = replay(machine, seed=seed, budget=budget, root=root)
                    rows.append(row)
                    print(json.dumps({k: row.get(k) for k in ("placement", "budget", "seed", "saved_ms", "ratio",
                                                             "wall_s", "trials")}), flush=True)
    result = {"benchmark": "replay_search", "rows": rows, "summary": summary(rows)}
    for s in result["summary"]:
        print(json.dumps(s), flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)
    if args.dump:
        with open(args.dump, "w") as fh:
            json.dump([{k: r.get(k) for k in ("placement", "budget", "seed", "saved", "log")} for r in rows], fh, indent=0)
    if args.compare and compare(rows, args.compare):
        sys.exit(1)


def compare(rows: list[dict[str, Any]], path: str) -> int:
    """How many of ``rows``' studies decide differently from the same studies in the dump at ``path``
    (each printed with its first differing trial); a study missing from the dump counts."""
    with open(path) as fh:
        before = {(r["placement"], r["budget"], r["seed"]): r for r in json.load(fh)}
    differ = 0
    for r in rows:
        old = before.get((r["placement"], r["budget"], r["seed"]))
        if old is not None and old["log"] == r.get("log") and old["saved"] == r.get("saved"):
            continue
        differ += 1
        pairs = list(zip((old or {}).get("log") or [], r.get("log") or [], strict=False))
        first = next((i for i, (a, b) in enumerate(pairs) if a != b), len(pairs))
        print(f"differs: {r['placement']} {r['budget']} seed {r['seed']} from trial {first}", flush=True)
    print(f"{len(rows) - differ} of {len(rows)} studies decide as in {path}", flush=True)
    return differ


if __name__ == "__main__":
    main()
