"""Parameter sharding (FSDP2) in the search: when the dimension is searched, what each sharding is
predicted to save on a rank, what the trials say it saves, and the proposal where a rank's fixed part
(parameters, gradients, optimizer state) is large.

What a sharding saves on rank ``r`` (``W`` ranks; ``P_s`` the bytes of the parameters it shards out of
``P``; ``S`` the whole optimizer state; ``U`` the largest unit, gathered whole while it computes)::

    saved = (1 - 1/W) * (P_s + G_s + S * P_s / P) - U - (1 - 1/W) * K

``G_s = P_s`` with one micro-step (the gradients are reduce-scattered as they are made); with more,
the unsharded gradients accumulate until the last micro-step, so ``G_s = 0``. ``K``: the bytes of
the groups whose gathered weights are kept from forward to backward (``keep_gathered``). Measured on
CPU (``tests/test_fsdp.py``): live-tensor peaks fall by this within 10 %.

Once a sharded trial ran and the (unsharded) eager memory model predicts its split, the saving is
learned (:class:`SavingModel`: per rank, the median of the prediction minus the measured peak), and
sharded trials join that model's fit as the unsharded peaks they imply (``_models``).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from optuna.trial import FrozenTrial, TrialState

from autobalance._config import BalanceConfig
from autobalance.protocol import GIB, Status, TrialAttr
from autobalance.tuner.search._constants import EMBEDDING_SHARE, FIT_FRACTION, FIXED_SHARE, LEVELS

__all__ = ["SavingModel", "ShardingFacts", "sharding_level", "sharding_proposal",
           "sharding_proposal_config", "study_savings"]


def sharding_level(mode: str) -> int:
    """How much a ``param_sharding`` value shards: off < embeddings < blocks (each shards what the one
    before does, and more)."""
    return LEVELS.get(mode, 0)


@dataclass(kw_only=True)
class ShardingFacts:
    """What the baseline's report says of the model's parameters (``StudyAttr.MODEL``), in bytes:
    all of them, the embedding-like modules' (``runtime._fsdp.find_embeddings``), the largest of
    those, and the largest repeated block's."""

    world_size: int
    param_bytes: float
    embedding_bytes: float
    largest_embedding: float
    block_bytes: float
    num_blocks: int

    @classmethod
    def from_model(cls, facts: Mapping[str, Any] | None, world_size: int) -> ShardingFacts | None:
        """From the report's ``model`` (None: a report from before these figures, or no parameters)."""
        facts = facts or {}
        try:
            out = cls(world_size=world_size, param_bytes=float(facts["parameter_bytes"]),
                      embedding_bytes=float(facts["embedding_bytes"]),
                      largest_embedding=float(facts["largest_embedding_bytes"]),
                      block_bytes=float(facts["largest_block_bytes"]), num_blocks=int(facts.get("num_blocks", 0)))
        except (KeyError, TypeError, ValueError):
            return None
        return out if out.param_bytes > 0 else None

    def searched(self, usable: float) -> bool:
        """Whether sharding may pay here (:data:`EMBEDDING_SHARE` of a rank's ``usable`` bytes)."""
        return (self.world_size > 1 and self.embedding_bytes > 0
                and 4 * self.embedding_bytes >= EMBEDDING_SHARE * usable)

    def sharded_bytes(self, mode: str) -> float:
        return {"embeddings": self.embedding_bytes, "blocks": self.param_bytes}.get(mode, 0.0)

    def largest_unit(self, mode: str) -> float:
        if mode == "embeddings":
            return self.largest_embedding
        if mode == "blocks":
            root = max(0.0, self.param_bytes - self.embedding_bytes - self.num_blocks * self.block_bytes)
            return max(self.largest_embedding, self.block_bytes, root)
        return 0.0

    def predicted_saving(self, config: BalanceConfig, *, state_total: float | None) -> float:
        """What ``config``'s sharding saves on each rank by the formula of the module docstring
        (``state_total`` None: AdamW's two fp32 moments, twice the parameters)."""
        mode = config.param_sharding
        if mode == "off":
            return 0.0
        shard = self.sharded_bytes(mode)
        frac = 1.0 - 1.0 / self.world_size
        state = (2.0 * self.param_bytes if state_total is None else state_total) * shard / self.param_bytes
        grads = shard if config.accumulation == 1 else 0.0
        keep = config.keep_gathered
        kept = ((self.embedding_bytes if "embeddings" in keep else 0.0)
                + (self.num_blocks * self.block_bytes if "blocks" in keep else 0.0))
        return frac * (shard + grads + state) - self.largest_unit(mode) - frac * kept


def _sharding_key(config: BalanceConfig) -> str:
    return config.param_sharding + ("+" + "+".join(config.keep_gathered) if config.keep_gathered else "")


@dataclass(kw_only=True)
class SavingModel:
    """Per sharding (and kept groups), per rank, what it saves: learned from its trials where the
    unsharded model predicts their split, else the formula (:meth:`ShardingFacts.predicted_saving`)."""

    facts: ShardingFacts
    state_total: float | None = None
    learned: dict[str, list[float]] = field(default_factory=dict)
    """Per sharding key (``embeddings``, ``blocks+embeddings+blocks``, ...), per rank."""

    @classmethod
    def fit(cls, trials: Sequence[FrozenTrial], *, facts: ShardingFacts, unsharded: Any | None = None,
            num_layers: int = 1, state_total: float | None = None) -> SavingModel:
        """``unsharded``: the eager memory model (``MemoryModel``, fitted on unsharded trials), or None."""
        model = cls(facts=facts, state_total=state_total)
        if unsharded is None:
            return model
        seen: dict[str, list[list[float]]] = {}
        for t in trials:
            a = t.user_attrs
            raw = a.get(TrialAttr.CONFIG)
            if t.state != TrialState.COMPLETE or a.get(TrialAttr.STATUS) != Status.OK or not raw:
                continue
            try:
                cfg = BalanceConfig.from_dict(raw)
            except Exception:  # a damaged attribute
                continue
            peaks = a.get(TrialAttr.PEAK_DEVICE_GIB) or []
            if (cfg.param_sharding == "off" or cfg.compile != "off" or len(peaks) != cfg.world_size
                    or not unsharded.can_predict(cfg.dtype)):
                continue
            per_rank = seen.setdefault(_sharding_key(cfg), [[] for _ in range(cfg.world_size)])
            for r, peak in enumerate(peaks):
                if peak is None:
                    continue
                predicted = unsharded.predict(rank=r, micro_batch=cfg.micro_batches[r],
                                              checkpointed=len(cfg.checkpoint[r]),
                                              num_layers=max(1, num_layers), dtype=cfg.dtype)
                per_rank[r].append(predicted - float(peak) * GIB)
        model.learned = {k: [statistics.median(v) if v else float("nan") for v in ranks]
                         for k, ranks in seen.items()}
        return model

    def saving(self, config: BalanceConfig, rank: int) -> float:
        """What ``config``'s sharding saves on ``rank``: learned from its trials, else predicted."""
        learned = self.learned.get(_sharding_key(config))
        if learned is not None and rank < len(learned) and learned[rank] == learned[rank]:  # not NaN
            return learned[rank]
        return self.facts.predicted_saving(config, state_total=self.state_total)

    def source(self, config: BalanceConfig) -> str:
        learned = _sharding_key(config) in self.learned
        return "learned from its trials" if learned else "predicted from the parameters"


def sharding_proposal_config(*, space_shardings: Sequence[str], baseline: BalanceConfig,
                             usable: Sequence[float], fixed: Sequence[float], any_fits: bool,
                             tried: set[str], savings: SavingModel) -> tuple[BalanceConfig, str] | None:
    """The sharded configuration to try where ``fixed`` (per rank, what it holds apart from
    activations, unsharded) is large, and why; None when a trial fits, the fixed part is small or
    the proposal was tried. The least sharding leaving below :data:`FIT_FRACTION` of every rank's
    usable memory, on the baseline's split (fp16 and compile, which sharding refuses, as fp32 and
    eager)."""
    if any_fits or len(space_shardings) < 2:
        return None
    tight = min(range(len(usable)), key=lambda r: usable[r] - fixed[r])
    if fixed[tight] < FIXED_SHARE * usable[tight]:
        return None
    base = replace(baseline, optimizer_sharding="off", optimizer_shares=None, compile="off", compile_scope="whole",
                   activation_budget=None, dtype="fp32" if baseline.dtype == "fp16" else baseline.dtype,
                   keep_gathered=[])
    modes = [m for m in ("embeddings", "blocks") if m in space_shardings]
    for i, mode in enumerate(modes):
        cfg = BalanceConfig.from_dict({**base.to_dict(), "param_sharding": mode})
        left = [f - savings.saving(cfg, r) for r, f in enumerate(fixed)]
        fits = all(left[r] <= FIT_FRACTION * usable[r] for r in range(len(usable)))
        if (fits or i == len(modes) - 1) and cfg.to_json() not in tried:
            why = (f"nothing unsharded fits and rank {tight}'s parameters, gradients and optimizer state "
                   f"({fixed[tight] / GIB * 1024:.1f} MiB) fill {100 * fixed[tight] / usable[tight]:.0f}% of its usable "
                   f"memory: {mode} sharding leaves {max(left) / GIB * 1024:.1f} MiB ({savings.source(cfg)})")
            return cfg, why
    return None


def state_total_of(trials: Sequence[FrozenTrial]) -> float | None:
    """The whole optimizer state the trials measured (the largest: an unsharded rank holds all of it;
    a sharded trial's ranks their shards, summed), None before any step measured it."""
    totals = []
    for t in trials:
        state = t.user_attrs.get(TrialAttr.OPTIMIZER_STATE_BYTES) or []
        raw = t.user_attrs.get(TrialAttr.CONFIG) or {}
        values = [float(v) for v in state if isinstance(v, (int, float))]
        if not values:
            continue
        sharded = raw.get("optimizer_sharding", "off") != "off" or raw.get("param_sharding", "off") != "off"
        totals.append(sum(values) if sharded else max(values))
    return max(totals) if totals else None


def sharding_proposal(trials: Sequence[FrozenTrial], *, space_shardings: Sequence[str],
                      model_facts: Mapping[str, Any] | None, world_size: int, usable: Sequence[float] | None,
                      unsharded: Any | None, tried: set[str], num_layers: int) -> tuple[BalanceConfig, str, float] | None:
    """:func:`sharding_proposal_config` from the study's trials: ``(configuration, reason, predicted
    largest peak in bytes)``, or None."""
    facts = ShardingFacts.from_model(model_facts, world_size)
    if facts is None or usable is None:
        return None
    done = [t for t in trials if t.state == TrialState.COMPLETE and t.user_attrs.get(TrialAttr.CONFIG)]
    baseline = next((t for t in done if t.user_attrs.get(TrialAttr.BASELINE)), None)
    if baseline is None:
        return None
    try:
        base = BalanceConfig.from_dict(baseline.user_attrs[TrialAttr.CONFIG])
    except Exception:  # a damaged attribute
        return None
    any_fits = any(t.user_attrs.get(TrialAttr.FEASIBLE) is True for t in done)
    state = state_total_of(done)
    if unsharded is not None and unsharded.can_predict(base.dtype):
        fixed = [float(unsharded.fixed_bytes(r, base.dtype)) for r in range(world_size)]
    else:  # weights, gradients and state, each whole on every rank
        fixed = [2.0 * facts.param_bytes + (2.0 * facts.param_bytes if state is None else state)] * world_size
    savings = SavingModel.fit(done, facts=facts, unsharded=unsharded, num_layers=num_layers, state_total=state)
    found = sharding_proposal_config(space_shardings=space_shardings, baseline=base, usable=usable, fixed=fixed,
                                     any_fits=any_fits, tried=tried, savings=savings)
    if found is None:
        return None
    cfg, why = found
    return cfg, why, max(f - savings.saving(cfg, r) for r, f in enumerate(fixed))


def study_savings(trials: Sequence[FrozenTrial], *, model_facts: Mapping[str, Any] | None, world_size: int,
                  num_layers: int, unsharded: Any | None) -> SavingModel | None:
    """The study's :class:`SavingModel`; None without the baseline's figures."""
    facts = ShardingFacts.from_model(model_facts, world_size)
    if facts is None:
        return None
    done = [t for t in trials if t.state == TrialState.COMPLETE]
    return SavingModel.fit(done, facts=facts, unsharded=unsharded, num_layers=num_layers,
                           state_total=state_total_of(done))
