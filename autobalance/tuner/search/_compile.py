"""Compile in the study: the trials' Inductor cache, the space check, compile-time figures (compile
times per scope: ``_timing.compile_times``)."""

from __future__ import annotations

import os
import statistics
from typing import Any

from optuna.trial import FrozenTrial

from autobalance.protocol import RankReport, TrialAttr
from autobalance.tuner._settings import TuneSettings
from autobalance.tuner.search._constants import (
    CACHE_HIT_PRIOR_S,
    COMPILE_PRIOR_S,
    REGIONAL_COMPILE_SHARE,
)
from autobalance.tuner.search._space import SearchSpace
from autobalance.tuner.search._timing import compile_times

__all__ = ["CACHE_HIT_PRIOR_S", "COMPILE_PRIOR_S", "REGIONAL_COMPILE_SHARE", "cache_dir", "compile_env", "compile_figures", "compile_notes",
           "compile_times", "space_problem"]

CACHE_SUBDIR = "inductor-cache"


def cache_dir(runs_dir: str, study_name: str) -> str:
    """``<runs_dir>/<study>/inductor-cache``: one persistent Inductor cache per study."""
    return os.path.abspath(os.path.join(runs_dir, study_name, CACHE_SUBDIR))


def compile_env(settings: TuneSettings) -> dict[str, str]:
    """Environment for the study's trials: a per-study Inductor cache with the FX graph and
    AOTAutograd caches on (a cache directory the user set is kept). Empty when nothing compiles."""
    if settings.compile_modes() == ["off"]:
        return {}
    env = {"TORCHINDUCTOR_FX_GRAPH_CACHE": "1", "TORCHINDUCTOR_AUTOGRAD_CACHE": "1"}
    if not os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        env["TORCHINDUCTOR_CACHE_DIR"] = cache_dir(settings.runs_dir, settings.study_name)
        # made here, not by the first compile: a backend that writes nothing (aot_eager) still gets it,
        # and ranks of several trials never race to create it
        os.makedirs(env["TORCHINDUCTOR_CACHE_DIR"], exist_ok=True)
    return env


def space_problem(settings: TuneSettings, space: SearchSpace) -> str | None:
    """An explicit ``--compile``/``--compile-mode`` that would change a continued study's space."""
    if settings.compile is None:
        return None
    wanted = settings.compile_modes()
    if wanted == space.compile_modes:
        return None
    return (f"--compile={settings.compile} --compile-mode={settings.compile_mode} (the study searches compile modes "
            f"{','.join(space.compile_modes)})")


def compile_figures(reports: dict[int, RankReport]) -> dict[str, Any]:
    """Trial attributes from the ranks' reports: the slowest rank's compile time, each rank's
    budget as it reported it, and the Inductor cache hits and misses summed over ranks."""
    compiled = [r for r in reports.values() if (r.compile or {}).get("mode", "off") != "off"]
    if not compiled:
        return {}
    times = [float(r.timing.compile_s) for r in compiled if r.timing is not None and r.timing.compile_s is not None]
    cache: dict[str, int] = {}
    for r in compiled:
        for key, value in ((r.compile or {}).get("cache") or {}).items():
            if isinstance(value, int) and not isinstance(value, bool):
                cache[key] = cache.get(key, 0) + value
    ranks = sorted(reports)
    return {
        "compile_s": round(max(times), 3) if times else None,
        "activation_budget_used": [reports[r].activation_budget for r in ranks],
        "compile_cache": cache,
    }


def compile_notes(trials: list[FrozenTrial]) -> tuple[list[str], float]:
    """Summary lines on compile time (total, and per trial with a cold or warm cache), and the total."""
    launched = [t for t in trials if t.user_attrs.get(TrialAttr.COMPILE_S) is not None
                and t.user_attrs.get(TrialAttr.REUSED_FROM) is None]
    if not launched:
        return [], 0.0
    times = [float(t.user_attrs[TrialAttr.COMPILE_S]) for t in launched]
    total = sum(times)
    lines = [f"Compile: {len(launched)} compiled trial(s) spent {total:.1f} s compiling in total "
             f"(median {statistics.median(times):.1f} s); the objective uses step time only, production runs "
             "compile once."]
    proposed = sum(t.user_attrs.get("proposed_by") == "compiled-model" for t in launched)
    if proposed:
        lines.append(f"The compiled model proposed {proposed} of them (each rank's largest budget predicted to fit).")
    warm = [float(t.user_attrs[TrialAttr.COMPILE_S]) for t in launched
            if (t.user_attrs.get(TrialAttr.COMPILE_CACHE) or {}).get("fx_graph_hits", 0) > 0
            and (t.user_attrs.get(TrialAttr.COMPILE_CACHE) or {}).get("fx_graph_misses", 0) == 0]
    cold = [float(t.user_attrs[TrialAttr.COMPILE_S]) for t in launched
            if (t.user_attrs.get(TrialAttr.COMPILE_CACHE) or {}).get("fx_graph_misses", 0) > 0]
    hits = sum((t.user_attrs.get(TrialAttr.COMPILE_CACHE) or {}).get("fx_graph_hits", 0) for t in launched)
    misses = sum((t.user_attrs.get(TrialAttr.COMPILE_CACHE) or {}).get("fx_graph_misses", 0) for t in launched)
    if hits or misses:
        text = f"Inductor FX graph cache: {hits} hit(s), {misses} miss(es)"
        if warm and cold:
            saved = statistics.median(cold) - statistics.median(warm)
            text += (f"; median compile {statistics.median(cold):.1f} s with misses vs {statistics.median(warm):.1f} s "
                     f"from the cache (about {saved * len(warm):.0f} s saved over {len(warm)} cached trial(s))")
        lines.append(text + ".")
    return lines, total
