"""CUDA graphs (``torch.compile`` mode ``reduce-overhead``) in the search: measured against the
default mode once, at the best default-mode compiled configuration, before any model proposes them.

A micro-step costs about ``max(host launch time, GPU time)``: graphs cut the launch time, so they pay
where the host is the bottleneck and not where the GPU is busy (one H200, ``studies/gpt-1gpu.toml``:
8 x 4 137 -> 129 ms, 4 x 8 269 -> 152 ms; ``docs/compile.md``). Which one a study's script is cannot
be read from default-mode trials alone, and the step-time model's prior for graphs, borrowed from the
default mode, promised 53 ms at 8 x 4: so the first graph trial is a **probe**: once the models promise nothing better than the study's best
trial and that is a default-mode compiled one, the same configuration with graphs (one compile);
graphs are proposed further only when a probe ran at least :data:`GRAPH_GAIN` faster than its
default-mode twin.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal

from optuna.trial import FrozenTrial, TrialState

from autobalance._config import CUDA_GRAPH_MODES, BalanceConfig
from autobalance.protocol import Status, TrialAttr
from autobalance.tuner.search._constants import GRAPH_GAIN

__all__ = ["GRAPH_GAIN", "GraphVerdict", "graph_probe", "graphs_verdict"]


GraphVerdict = Literal["untried", "pays", "no-gain"]
"""``untried``: no graph trial has a measured default-mode twin yet; ``pays`` / ``no-gain``: the
probes' outcome."""


def _measured(trials: Sequence[FrozenTrial]) -> dict[str, tuple[BalanceConfig, float]]:
    """Measured (ok, not reused) trials' configurations by their JSON, with their step ms."""
    out: dict[str, tuple[BalanceConfig, float]] = {}
    for t in trials:
        a = t.user_attrs
        cfg, ms = a.get(TrialAttr.CONFIG), a.get(TrialAttr.STEP_TIME_MS)
        if (t.state == TrialState.COMPLETE and a.get(TrialAttr.STATUS) == Status.OK and cfg
                and isinstance(ms, (int, float)) and a.get(TrialAttr.REUSED_FROM) is None):
            config = BalanceConfig.from_dict(cfg)
            out[config.to_json()] = (config, float(ms))
    return out


def graphs_verdict(trials: Sequence[FrozenTrial], dtype: str) -> GraphVerdict:
    """Whether CUDA graphs paid in ``dtype``: a measured graph trial at least :data:`GRAPH_GAIN`
    faster than its measured default-mode twin (any such pair: ``pays``; pairs but none:
    ``no-gain``; no pair: ``untried``)."""
    measured = _measured(trials)
    verdict: GraphVerdict = "untried"
    for cfg, ms in measured.values():
        if cfg.compile not in CUDA_GRAPH_MODES or cfg.dtype != dtype:
            continue
        twin = measured.get(dataclasses.replace(cfg, compile="default").to_json())
        if twin is None:
            continue
        if ms <= (1.0 - GRAPH_GAIN) * twin[1]:
            return "pays"
        verdict = "no-gain"
    return verdict


def graph_probe(trials: Sequence[FrozenTrial], *, best: FrozenTrial, modes: Sequence[str],
                dtypes: Sequence[str]) -> BalanceConfig | None:
    """The probe: the study's ``best`` trial in the first CUDA-graph mode searched, when it is a
    feasible default-mode compiled trial of an allowed dtype whose graphs are ``untried``; None
    otherwise (graphs not searched, or the probe launched already)."""
    graph_modes = [m for m in modes if m in CUDA_GRAPH_MODES]
    cfg_dict = best.user_attrs.get(TrialAttr.CONFIG)
    if not graph_modes or "default" not in modes or not cfg_dict or not best.user_attrs.get(TrialAttr.FEASIBLE, True):
        return None
    cfg = BalanceConfig.from_dict(cfg_dict)
    if (cfg.compile != "default" or cfg.compile_scope != "whole" or cfg.dtype not in dtypes
            or graphs_verdict(trials, cfg.dtype) != "untried"):  # CUDA graphs: the whole model only
        return None
    probe = dataclasses.replace(cfg, compile=graph_modes[0])
    tried = {BalanceConfig.from_dict(t.user_attrs[TrialAttr.CONFIG]).to_json() for t in trials
             if t.user_attrs.get(TrialAttr.CONFIG)}
    return None if probe.to_json() in tried else probe
