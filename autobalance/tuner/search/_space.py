"""The search space: per-rank shares of a fixed global batch, accumulation, per-rank
checkpointing, AMP dtype and DDP bucket settings - parameterised so samplers can learn.

With compile searched, ``compile`` is sampled first and the recomputation dimensions are
conditional on it: eager trials sample per-rank layer checkpointing (``ckpt_r{r}``), compiled
trials a per-rank activation-memory budget (``budget_r{r}``, on the :data:`BUDGET_STEP` grid) and
no checkpointing (:class:`BalanceConfig` rejects double recomputation)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import optuna
from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)

from autobalance._config import (
    CUDA_GRAPH_MODES,
    BalanceConfig,
    samples_within,
    split_at_least,
    split_evenly,
)
from autobalance.tuner.search._constants import (
    BUCKET_RANGE_MB,
    BUDGET_RANGE,
    BUDGET_STEP,
    OPTIMIZER_SHARE_RANGE,
    SHARE_RANGE,
)

if TYPE_CHECKING:
    from autobalance.tuner._settings import TuneSettings


KEEP_CHOICES: dict[str, list[str]] = {"none": [], "embeddings": ["embeddings"], "blocks": ["blocks"],
                                      "both": ["embeddings", "blocks"]}
"""The ``keep_gathered`` parameter's values and the groups each keeps gathered (the blocks only
where they are sharded)."""

REGIONAL_KEY = "@regional"


def compile_key(mode: str, scope: str = "whole") -> str:
    """The compiled models' key for a compile mode at a scope: the mode for ``whole``,
    ``<mode>@regional`` for ``regional`` (each scope has its own fits and graphs)."""
    return mode if scope == "whole" or mode == "off" else mode + REGIONAL_KEY


def config_compile_key(config: BalanceConfig | dict[str, Any]) -> str:
    """:func:`compile_key` of a configuration (or its stored dictionary)."""
    if isinstance(config, BalanceConfig):
        return compile_key(config.compile, config.compile_scope)
    return compile_key(str(config.get("compile", "off")), str(config.get("compile_scope", "whole")))


def normalised_shares(weights: list[float]) -> list[float]:
    """``zero1`` shares from per-rank weights: each over their sum, to 4 decimals, summing to 1 (the
    largest takes the rounding); all weights 0: even."""
    total = sum(weights)
    if total <= 0:
        weights, total = [1.0] * len(weights), float(len(weights))
    shares = [round(w / total, 4) for w in weights]
    top = shares.index(max(shares))
    shares[top] = round(1.0 - sum(q for r, q in enumerate(shares) if r != top), 4)
    return shares


@dataclass(kw_only=True)
class SearchSpace:
    """Dimensions derived from the job (world size, global batch, number of blocks)."""

    world_size: int
    global_batch: int
    """Samples per optimizer step, fixed for every trial."""
    num_layers: int
    """Blocks that can be checkpointed (0: checkpointing is not searched)."""
    dtypes: list[str]
    accumulations: list[int]
    """Accumulation counts with at least one sample per rank in every micro-step (that also divide
    the global batch without ``any_split``)."""
    compile_modes: list[str] = field(default_factory=lambda: ["off"])
    """``torch.compile`` modes searched; ``["off"]``: no ``compile`` parameter."""
    fixed_split: bool = False
    """The split stays the script's own (no ``share_r`` parameters): the model has batch-dependent layers whose
    train-mode step another split would change (``accumulations`` is then the script's own count only)."""
    kept_micro_batches: list[int] | None = None
    """With ``fixed_split``: the script's own micro-batch per rank (``None``, in studies from before
    it was kept: the even split of the global batch)."""
    kept_rank_samples: list[int] | None = None
    """With ``fixed_split``: the script's own samples per rank per step when its micro-batches
    differ within a rank; ``None``: equal micro-batches."""
    any_split: bool = False
    """The shares split the global batch itself, per rank in micro-steps that differ by at most one
    (a prime global batch still has many forms); False (studies from before): they split
    ``global_batch / accumulation``, which the accumulation must divide."""
    compile_scopes: list[str] = field(default_factory=lambda: ["whole"])
    """Compile scopes searched; more than one: a ``compile_scope`` parameter for compiled trials."""
    shardings: list[str] = field(default_factory=lambda: ["off"])
    """``optimizer_sharding`` values searched: ``["off", "zero1"]`` (then per-rank ``oshare_r{r}``
    weights for ``zero1``, :func:`normalised_shares`) when the script passes its optimizer through
    ``plan.optimizer`` on more than one rank; ``["off"]``: no parameter."""
    param_shardings: list[str] = field(default_factory=lambda: ["off"])
    """``param_sharding`` values searched (FSDP2, ``_sharding``; with more than ``"off"``, sharded trials also
    sample ``keep_gathered``: the groups that keep their gathered weights from forward to backward)."""

    @classmethod
    def build(cls, *, world_size: int, global_batch: int, num_layers: int, dtypes: list[str],
              max_accumulation: int, compile_modes: list[str] | None = None, any_split: bool = False,
              compile_scopes: list[str] | None = None) -> SearchSpace:
        accs = [a for a in range(1, max_accumulation + 1)
                if global_batch >= a * world_size and (any_split or global_batch % a == 0)]
        return cls(world_size=world_size, global_batch=global_batch, num_layers=num_layers, dtypes=list(dtypes),
                   accumulations=accs or [1], compile_modes=list(compile_modes or ["off"]), any_split=any_split,
                   compile_scopes=list(compile_scopes or ["whole"]))

    @property
    def compile_searched(self) -> bool:
        return self.compile_modes != ["off"]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SearchSpace:
        return cls(**data)

    def keep_split(self, own: BalanceConfig) -> None:
        """Keep ``own``'s (the script's) split and accumulation in every trial (``fixed_split``)."""
        self.fixed_split = True
        self.accumulations = [own.accumulation]
        self.kept_micro_batches = list(own.micro_batches)
        self.kept_rank_samples = None if own.rank_samples is None else list(own.rank_samples)

    def kept_split(self, accumulation: int) -> tuple[list[int], list[int] | None]:
        """A fixed split's micro-batches and samples per rank (None: equal micro-batches)."""
        if self.kept_micro_batches is None:  # a study from before the split was recorded: the even one
            return split_evenly(self.global_batch // accumulation, [1.0] * self.world_size), None
        return list(self.kept_micro_batches), (None if self.kept_rank_samples is None else list(self.kept_rank_samples))

    def distributions(self) -> dict[str, BaseDistribution]:
        d: dict[str, BaseDistribution] = {"accumulation": CategoricalDistribution(self.accumulations)}
        ranks = range(self.world_size)
        if self.world_size > 1 and not self.fixed_split:
            d.update({f"share_r{r}": FloatDistribution(*SHARE_RANGE) for r in ranks})
        if self.compile_searched:
            d["compile"] = CategoricalDistribution(self.compile_modes)
            if len(self.compile_scopes) > 1:
                d["compile_scope"] = CategoricalDistribution(self.compile_scopes)
        if self.num_layers > 0 and "off" in self.compile_modes:
            d.update({f"ckpt_r{r}": IntDistribution(0, self.num_layers) for r in ranks})
        if any(m != "off" for m in self.compile_modes):
            d.update({f"budget_r{r}": FloatDistribution(*BUDGET_RANGE, step=BUDGET_STEP) for r in ranks})
        if "zero1" in self.shardings:
            d["optimizer_sharding"] = CategoricalDistribution(self.shardings)
            d.update({f"oshare_r{r}": FloatDistribution(*OPTIMIZER_SHARE_RANGE) for r in ranks})
        if len(self.param_shardings) > 1:
            d["param_sharding"] = CategoricalDistribution(self.param_shardings)
            d["keep_gathered"] = CategoricalDistribution(list(KEEP_CHOICES))
        d["dtype"] = CategoricalDistribution(self.dtypes)
        d["bucket_cap_mb"] = FloatDistribution(*BUCKET_RANGE_MB, log=True)
        d["grad_as_bucket_view"] = CategoricalDistribution([False, True])
        return d

    def suggest(self, trial: optuna.Trial) -> BalanceConfig:
        params: dict[str, Any] = {}
        for name, dist in self.distributions().items():
            compiled = params.get("compile", "off") != "off"
            if (name.startswith("ckpt_r") and compiled) or (
                    (name.startswith("budget_r") or name == "compile_scope") and not compiled):
                continue  # conditional on compile: checkpointing for eager trials, budgets and scope for compiled ones
            if name == "compile_scope" and params.get("compile") in CUDA_GRAPH_MODES:
                continue  # CUDA graphs are captured for the whole model only
            if name.startswith("oshare_r") and params.get("optimizer_sharding", "off") != "zero1":
                continue  # conditional on sharding: shares only for zero1 trials
            if name == "keep_gathered" and params.get("param_sharding", "off") == "off":
                continue  # conditional on parameter sharding
            params[name] = _suggest(trial, name, dist)
        return self.config_from_params(params)

    def config_from_params(self, params: dict[str, Any]) -> BalanceConfig:
        acc = int(params["accumulation"])
        ranks = range(self.world_size)
        shares = [float(params.get(f"share_r{r}", 1.0)) for r in ranks]
        mode = str(params.get("compile", "off"))
        ckpt = [list(range(int(params.get(f"ckpt_r{r}", 0)))) if mode == "off" else [] for r in ranks]
        budget = None if mode == "off" else [round(float(params.get(f"budget_r{r}", 1.0)), 3) for r in ranks]
        rest: dict[str, Any] = dict(
            checkpoint=ckpt, dtype=str(params["dtype"]), bucket_cap_mb=round(float(params["bucket_cap_mb"]), 3),
            gradient_as_bucket_view=bool(params["grad_as_bucket_view"]), compile=mode, activation_budget=budget,
        )
        if mode != "off":  # CUDA graphs: the whole model only (BalanceConfig refuses them regional)
            rest["compile_scope"] = ("whole" if mode in CUDA_GRAPH_MODES
                                     else str(params.get("compile_scope", self.compile_scopes[0])))
        if params.get("optimizer_sharding", "off") == "zero1":
            rest["optimizer_sharding"] = "zero1"
            rest["optimizer_shares"] = normalised_shares([float(params.get(f"oshare_r{r}", 1.0)) for r in ranks])
        fsdp = str(params.get("param_sharding", "off"))
        # sharded trials are eager and not fp16 (the compiled models know no sharding; fp16 is refused): else unsharded
        if fsdp != "off" and mode == "off" and rest["dtype"] != "fp16":
            keep = KEEP_CHOICES.get(str(params.get("keep_gathered", "none")), [])
            rest.update(param_sharding=fsdp, keep_gathered=[g for g in keep if fsdp == "blocks" or g == "embeddings"],
                        optimizer_sharding="off", optimizer_shares=None)
        if self.fixed_split:  # the script's own split, as it is
            return self.config_for(self.kept_split(acc)[0], acc, **rest)
        if self.any_split:
            return BalanceConfig.any_split(
                rank_samples=split_at_least(self.global_batch, shares, acc), accumulation=acc, **rest)
        micro = split_evenly(self.global_batch // acc, shares)
        return BalanceConfig(micro_batches=micro, accumulation=acc, global_batch=self.global_batch, **rest)

    def config_for(self, micro_batches: list[int], accumulation: int, cost: list[float] | None = None,
                   **rest: Any) -> BalanceConfig:
        """The configuration whose largest micro-batch per rank is ``micro_batches`` (a solver's answer): with
        ``any_split`` the ranks give up the samples beyond the global batch (the highest ``samples * cost`` first).
        With a fixed split, only the kept micro-batches give a configuration :meth:`contains` accepts."""
        if self.fixed_split:
            micro, samples = self.kept_split(accumulation)
            if list(micro_batches) == micro:
                return BalanceConfig(micro_batches=micro, accumulation=accumulation, global_batch=self.global_batch,
                                     rank_samples=samples, **rest)
        if not self.any_split and (not self.fixed_split or sum(micro_batches) * accumulation == self.global_batch):
            return BalanceConfig(micro_batches=list(micro_batches), accumulation=accumulation,
                                 global_batch=self.global_batch, **rest)
        samples = samples_within(list(micro_batches), accumulation, self.global_batch, cost)
        return BalanceConfig.any_split(rank_samples=samples, accumulation=accumulation, **rest)

    def micro_total(self, accumulation: int) -> int:
        """The sum of the ranks' largest micro-batches that holds the global batch in
        ``accumulation`` micro-steps (what a solver splits over the ranks)."""
        if self.fixed_split and accumulation in self.accumulations:
            return sum(self.kept_split(accumulation)[0])
        if self.any_split:
            return -(-self.global_batch // accumulation)
        return self.global_batch // accumulation

    def params_from_config(self, config: BalanceConfig) -> dict[str, Any]:
        """Parameters that describe ``config`` (used to enqueue the baseline and solver proposals)."""
        samples = config.samples_per_rank
        top = max(samples)
        params: dict[str, Any] = {"accumulation": config.accumulation}
        if self.world_size > 1 and not self.fixed_split:
            params.update({f"share_r{r}": _clip(n / top, SHARE_RANGE) for r, n in enumerate(samples)})
        if self.compile_searched:
            params["compile"] = config.compile
            if len(self.compile_scopes) > 1 and config.compile != "off":
                params["compile_scope"] = config.compile_scope
        if config.compile != "off":
            budgets = config.activation_budget or [1.0] * self.world_size
            grid = [round(round(b / BUDGET_STEP) * BUDGET_STEP, 3) for b in budgets]  # on the budget grid
            params.update({f"budget_r{r}": _clip(grid[r], BUDGET_RANGE) for r in range(self.world_size)})
        elif self.num_layers > 0:
            params.update({f"ckpt_r{r}": min(self.num_layers, len(b)) for r, b in enumerate(config.checkpoint)})
        if "zero1" in self.shardings:
            params["optimizer_sharding"] = config.optimizer_sharding
            zero = config.sharding_shares() or []
            heaviest = max(zero, default=0.0) or 1.0
            params.update({f"oshare_r{r}": _clip(q / heaviest, OPTIMIZER_SHARE_RANGE) for r, q in enumerate(zero)})
        if len(self.param_shardings) > 1:
            params["param_sharding"] = config.param_sharding
            if config.param_sharding != "off":
                params["keep_gathered"] = next(k for k, v in KEEP_CHOICES.items() if v == config.keep_gathered)
        params["dtype"] = config.dtype
        params["bucket_cap_mb"] = _clip(config.bucket_cap_mb, BUCKET_RANGE_MB)
        params["grad_as_bucket_view"] = config.gradient_as_bucket_view
        return params

    def contains(self, config: BalanceConfig) -> bool:
        if self.fixed_split:
            micro, samples = self.kept_split(config.accumulation)
            if config.micro_batches != micro or config.rank_samples != samples:
                return False
        return (config.global_batch == self.global_batch and config.world_size == self.world_size
                and config.accumulation in self.accumulations and config.dtype in self.dtypes
                and config.compile in self.compile_modes and config.optimizer_sharding in self.shardings
                and config.param_sharding in self.param_shardings
                and (config.compile == "off" or config.compile_scope in self.compile_scopes)
                and (self.any_split or self.fixed_split or config.equal_micro_batches))


def _clip(value: float, bounds: tuple[float, float]) -> float:
    return min(bounds[1], max(bounds[0], value))


def _suggest(trial: optuna.Trial, name: str, dist: BaseDistribution) -> Any:
    if isinstance(dist, CategoricalDistribution):
        return trial.suggest_categorical(name, list(dist.choices))
    if isinstance(dist, IntDistribution):
        return trial.suggest_int(name, dist.low, dist.high, log=dist.log)
    assert isinstance(dist, FloatDistribution)
    return trial.suggest_float(name, dist.low, dist.high, step=dist.step, log=dist.log)


def space_problem(settings: TuneSettings, space: SearchSpace) -> str | None:
    """An explicit ``--compile``/``--compile-mode`` that would change a continued study's space."""
    if settings.compile is None or settings.compile_modes() == space.compile_modes:
        return None
    return (f"--compile={settings.compile} --compile-mode={settings.compile_mode} (the study searches compile modes "
            f"{','.join(space.compile_modes)})")
