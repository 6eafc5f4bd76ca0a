"""What the memory models are fitted from, and how well they predict: each measured trial predicted
from all the others (leave-one-trial-out), as the summary and the study's attributes report it."""

from __future__ import annotations

import optuna
from optuna.trial import FrozenTrial, TrialState

from autobalance._config import BalanceConfig
from autobalance._errors import ConfigError
from autobalance.protocol import Status, TrialAttr
from autobalance.tuner.search._compiled_model import CompiledMemoryModel, compiled_observations
from autobalance.tuner.search._memory_model import MemoryModel, MemoryObservation
from autobalance.tuner.search._model_errors import FIT_ERRORS, ModelErrors, caught
from autobalance.tuner.search._sharding import SavingModel
from autobalance.tuner.search._space import SearchSpace

__all__ = ["compiled_holdout_error", "eager_holdout_error", "observations_from_trials"]

GIB = 2**30


def observations_from_trials(trials: list[FrozenTrial], *, num_layers: int,
                             savings: SavingModel | None = None) -> list[MemoryObservation]:
    """One observation per rank of every measured (ok) or OOMed trial (OOM peaks are lower bounds).
    A trial that sharded parameters is left out, or with ``savings`` taken as the unsharded peaks it
    implies: its peaks (and held memory) plus what it saved on each rank, holding the whole state."""
    obs: list[MemoryObservation] = []
    for t in trials:
        status = t.user_attrs.get(TrialAttr.STATUS)
        if t.state != TrialState.COMPLETE or status not in (Status.OK, Status.OOM) or t.user_attrs.get(TrialAttr.REUSED_FROM) is not None:
            continue
        cfg = t.user_attrs.get(TrialAttr.CONFIG)
        peaks = t.user_attrs.get(TrialAttr.PEAK_DEVICE_GIB) or []
        if not cfg or len(peaks) != len(cfg["micro_batches"]) or cfg.get("compile", "off") != "off":
            continue  # the model is of eager memory; compiled trials follow their budget instead
        lift = [0.0] * len(peaks)
        if cfg.get("param_sharding", "off") != "off":
            if savings is None:
                continue  # the model is of unsharded memory: what sharding saves is _sharding's term
            try:
                sharded = BalanceConfig.from_dict(cfg)
            except ConfigError:  # a damaged attribute
                continue
            lift = [savings.saving(sharded, r) for r in range(len(peaks))]
        state = t.user_attrs.get(TrialAttr.OPTIMIZER_STATE_BYTES) or []
        if savings is not None and cfg.get("param_sharding", "off") != "off":  # unsharded: the whole state on each rank
            state = [] if savings.state_total is None else [savings.state_total] * len(peaks)
        measured = len(state) == len(peaks) and all(isinstance(v, (int, float)) for v in state)
        # the whole state: summed over the ranks when sharded, on every rank when not
        whole = (sum(state) if cfg.get("optimizer_sharding", "off") == "zero1" else max(state)) if measured else None
        held = t.user_attrs.get(TrialAttr.HELD_GIB) or []
        params = t.user_attrs.get(TrialAttr.PARAMETER_BYTES)
        params = float(params) if isinstance(params, (int, float)) and not isinstance(params, bool) else None
        for rank, peak in enumerate(peaks):
            if peak is None or peak <= 0:
                continue
            if status == Status.OK and rank < len(held) and isinstance(held[rank], (int, float)) and 0 < held[rank] < peak:
                # what the rank holds apart from activations: the model's fixed part, measured (zero samples)
                obs.append(MemoryObservation(
                    rank=rank, micro_batch=0, checkpointed=0, num_layers=max(1, num_layers), dtype=cfg["dtype"],
                    peak_bytes=float(held[rank]) * GIB + lift[rank], ok=True, held=True,
                    optimizer_bytes=float(state[rank]) if measured else None,
                    optimizer_total=None if whole is None else float(whole), parameter_bytes=params))
            obs.append(MemoryObservation(
                rank=rank, micro_batch=int(cfg["micro_batches"][rank]), checkpointed=len(cfg["checkpoint"][rank]),
                num_layers=max(1, num_layers), dtype=cfg["dtype"], peak_bytes=float(peak) * GIB + lift[rank],
                ok=status == Status.OK,
                optimizer_bytes=float(state[rank]) if measured else None,
                optimizer_total=None if whole is None else float(whole), parameter_bytes=params,
            ))
    return obs


def eager_holdout_error(study: optuna.Study, *, space: SearchSpace, errors: ModelErrors | None = None) -> float | None:
    """Leave-one-trial-out mean relative error of the peak prediction over measured trials (a fit
    that fails leaves its trial out, noted in ``errors``)."""
    trials = [t for t in study.get_trials(deepcopy=False) if t.user_attrs.get(TrialAttr.STATUS) == Status.OK
              and t.user_attrs.get(TrialAttr.REUSED_FROM) is None]
    held_out: list[float] = []
    for i, held in enumerate(trials):
        train = observations_from_trials(trials[:i] + trials[i + 1:], num_layers=space.num_layers)
        test = observations_from_trials([held], num_layers=space.num_layers)
        if not train or not test:
            continue
        try:
            model = MemoryModel.fit(train, world_size=space.world_size)
        except FIT_ERRORS as exc:
            caught(errors, "holdout", exc)
            continue
        if not all(model.is_confident(rank=o.rank, micro_batch=o.micro_batch, checkpointed=o.checkpointed,
                                      num_layers=o.num_layers, dtype=o.dtype) for o in test):
            continue
        held_out.append(model.holdout_error(test))
    return sum(held_out) / len(held_out) if held_out else None


def compiled_holdout_error(study: optuna.Study, *, space: SearchSpace,
                           errors: ModelErrors | None = None) -> tuple[float, int] | None:
    """Leave-one-trial-out mean relative error of the compiled model's per-rank peaks over the
    measured compiled trials (each predicted from the others), and how many were predicted."""
    if not space.compile_searched:
        return None
    trials = study.get_trials(deepcopy=False)
    obs = observations_from_trials(trials, num_layers=space.num_layers)
    if not any(o.ok for o in obs):
        return None
    try:
        eager = MemoryModel.fit(obs, world_size=space.world_size)
    except FIT_ERRORS as exc:
        caught(errors, "compiled holdout", exc)
        return None
    compiled = compiled_observations(trials)
    held_numbers = sorted({o.trial for o in compiled if o.ok})
    held_out: list[float] = []
    for number in held_numbers:
        train = [o for o in compiled if o.trial != number]
        test = [o for o in compiled if o.trial == number and o.ok]
        if not train or not test:
            continue
        model = CompiledMemoryModel.fit(train, eager=eager, num_layers=space.num_layers)
        if not all(model.can_predict(o.dtype) for o in test):
            continue
        held_out.append(model.holdout_error(test))
    return (sum(held_out) / len(held_out), len(held_out)) if held_out else None
