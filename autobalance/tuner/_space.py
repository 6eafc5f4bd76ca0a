"""The search space: per-rank shares of a fixed global batch, accumulation, per-rank
checkpointing, AMP dtype and DDP bucket settings - parameterised so samplers can learn."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import optuna

from autobalance._config import BalanceConfig, split_evenly

__all__ = ["SHARE_RANGE", "SearchSpace"]

SHARE_RANGE = (0.05, 1.0)
BUCKET_RANGE_MB = (1.0, 200.0)


@dataclass(kw_only=True)
class SearchSpace:
    """Dimensions derived from the job (world size, global batch, number of blocks)."""

    world_size: int
    """Ranks in a trial."""
    global_batch: int
    """Samples per optimizer step, fixed for every trial."""
    num_layers: int
    """Blocks that can be checkpointed (0: checkpointing is not searched)."""
    dtypes: list[str]
    """AMP dtypes searched."""
    accumulations: list[int]
    """Accumulation counts that divide the global batch with at least one sample per rank."""

    @classmethod
    def build(
        cls, *, world_size: int, global_batch: int, num_layers: int, dtypes: list[str], max_accumulation: int
    ) -> SearchSpace:
        accs = [a for a in range(1, max_accumulation + 1) if global_batch % a == 0 and global_batch // a >= world_size]
        return cls(world_size=world_size, global_batch=global_batch, num_layers=num_layers, dtypes=list(dtypes),
                   accumulations=accs or [1])

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SearchSpace:
        return cls(**data)

    def distributions(self) -> dict[str, optuna.distributions.BaseDistribution]:
        d: dict[str, optuna.distributions.BaseDistribution] = {
            "accumulation": optuna.distributions.CategoricalDistribution(self.accumulations),
        }
        if self.world_size > 1:
            for r in range(self.world_size):
                d[f"share_r{r}"] = optuna.distributions.FloatDistribution(*SHARE_RANGE)
        if self.num_layers > 0:
            for r in range(self.world_size):
                d[f"ckpt_r{r}"] = optuna.distributions.IntDistribution(0, self.num_layers)
        d["dtype"] = optuna.distributions.CategoricalDistribution(self.dtypes)
        d["bucket_cap_mb"] = optuna.distributions.FloatDistribution(*BUCKET_RANGE_MB, log=True)
        d["grad_as_bucket_view"] = optuna.distributions.CategoricalDistribution([False, True])
        return d

    def suggest(self, trial: optuna.Trial) -> BalanceConfig:
        params = {name: _suggest(trial, name, dist) for name, dist in self.distributions().items()}
        return self.config_from_params(params)

    def config_from_params(self, params: dict[str, Any]) -> BalanceConfig:
        acc = int(params["accumulation"])
        shares = [float(params.get(f"share_r{r}", 1.0)) for r in range(self.world_size)]
        micro = split_evenly(self.global_batch // acc, shares)
        ckpt = [list(range(int(params.get(f"ckpt_r{r}", 0)))) for r in range(self.world_size)]
        return BalanceConfig(
            micro_batches=micro, accumulation=acc, global_batch=self.global_batch, checkpoint=ckpt,
            dtype=str(params["dtype"]), bucket_cap_mb=round(float(params["bucket_cap_mb"]), 3),
            gradient_as_bucket_view=bool(params["grad_as_bucket_view"]),
        )

    def params_from_config(self, config: BalanceConfig) -> dict[str, Any]:
        """Parameters that describe ``config`` (used to enqueue the baseline and solver proposals)."""
        top = max(config.micro_batches)
        params: dict[str, Any] = {"accumulation": config.accumulation}
        if self.world_size > 1:
            for r, b in enumerate(config.micro_batches):
                params[f"share_r{r}"] = min(SHARE_RANGE[1], max(SHARE_RANGE[0], b / top))
        if self.num_layers > 0:
            for r, blocks in enumerate(config.checkpoint):
                params[f"ckpt_r{r}"] = min(self.num_layers, len(blocks))
        params["dtype"] = config.dtype
        params["bucket_cap_mb"] = min(BUCKET_RANGE_MB[1], max(BUCKET_RANGE_MB[0], config.bucket_cap_mb))
        params["grad_as_bucket_view"] = config.gradient_as_bucket_view
        return params

    def contains(self, config: BalanceConfig) -> bool:
        return (config.global_batch == self.global_batch and config.world_size == self.world_size
                and config.accumulation in self.accumulations and config.dtype in self.dtypes)


def _suggest(trial: optuna.Trial, name: str, dist: optuna.distributions.BaseDistribution) -> Any:
    if isinstance(dist, optuna.distributions.CategoricalDistribution):
        return trial.suggest_categorical(name, list(dist.choices))
    if isinstance(dist, optuna.distributions.IntDistribution):
        return trial.suggest_int(name, dist.low, dist.high, log=dist.log)
    assert isinstance(dist, optuna.distributions.FloatDistribution)
    return trial.suggest_float(name, dist.low, dist.high, log=dist.log)
