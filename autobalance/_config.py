"""The balance configuration: one validated dataclass with a JSON round-trip."""

from __future__ import annotations

import json
import math
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any, Literal

from autobalance._errors import ConfigError
from autobalance._files import is_int, is_number

__all__ = [
    "COMPILE_MODES",
    "COMPILE_SCOPES",
    "CUDA_GRAPH_MODES",
    "DTYPES",
    "OPTIMIZER_SHARDINGS",
    "PARAM_GROUPS",
    "PARAM_SHARDINGS",
    "BalanceConfig",
    "block_ranges",
    "describe_config",
    "micro_step_sizes",
    "samples_within",
    "split_at_least",
    "split_evenly",
]

DTYPES = ("fp32", "bf16", "fp16")
COMPILE_MODES = ("off", "default", "max-autotune-no-cudagraphs", "reduce-overhead")
"""``torch.compile`` modes a configuration may ask for (``off``: eager). ``reduce-overhead`` (CUDA
graphs) runs at world size 1 only: in DDP the captured regions would have to exclude the gradient
all-reduce (``docs/compile.md``); it is asked for, never searched by default."""
COMPILE_SCOPES = ("whole", "regional")
"""What ``torch.compile`` compiles (``docs/compile.md``): ``whole``, the model inside DDP as one region;
``regional``, each repeated block on its own (identical blocks share one compile) plus, when
``plan.wrap(model, loss=...)`` owns the loss, the loss as one tail region."""
CUDA_GRAPH_MODES = ("reduce-overhead",)
"""Compile modes that capture CUDA graphs (the runtime keeps the gradients allocated for them)."""
OPTIMIZER_SHARDINGS = ("off", "zero1")
"""Where the optimizer state lives: on every rank (``off``) or split over the ranks (``zero1``)."""
PARAM_SHARDINGS = ("off", "embeddings", "blocks")
"""Which parameters FSDP2 (``fully_shard``) shards (``docs/zero.md``): none (``off``: DDP);
``embeddings``: the embedding-like modules (input embeddings, output heads), each its own unit, the
rest replicated through FSDP2; ``blocks``: those and every repeated block, each its own unit, plus
the root (what is left)."""
PARAM_GROUPS = ("embeddings", "blocks")
"""The groups of sharded units whose gathered weights a configuration may keep from forward to backward."""


@dataclass(kw_only=True)
class BalanceConfig:
    """How each rank of a data-parallel job trains; the unit the tuner searches over.

    Two forms. Equal micro-batches: rank ``r`` runs ``accumulation`` micro-steps of
    ``micro_batches[r]`` samples. Any split (``rank_samples`` set): rank ``r`` takes
    ``rank_samples[r]`` samples per optimizer step in ``accumulation`` micro-steps whose sizes differ
    by at most one, larger first (32 samples in 6 steps: 6,6,5,5,5,5); ``micro_batches[r]`` is then
    its largest micro-batch. Every rank runs the same number of micro-steps either way, so ``no_sync``
    and the one all-reduce per optimizer step are unchanged. A split that is equal is stored in the
    equal form (``rank_samples`` left out), so configurations from before any split load unchanged.
    """

    micro_batches: list[int] = field(default_factory=list)
    """Micro-batch size of each rank (index = global rank); ranks may differ. With ``rank_samples``
    set: each rank's largest micro-batch (derived from ``rank_samples`` when left empty)."""
    accumulation: int = 1
    """Micro-steps per optimizer step, the same on every rank; all but the last run under ``no_sync``."""
    global_batch: int
    """Samples per optimizer step over all ranks: ``sum(micro_batches) * accumulation``, or
    ``sum(rank_samples)`` with any split."""
    rank_samples: list[int] | None = None
    """Per rank, the samples it takes per optimizer step, split over the ``accumulation`` micro-steps
    as evenly as possible (at least one sample each); None: ``micro_batches[r] * accumulation``."""
    checkpoint: list[list[int]] = field(default_factory=list)
    """Per rank, the indices of the blocks that are activation-checkpointed ([] = none)."""
    dtype: str = "fp32"
    """Autocast dtype: ``fp32`` (no autocast), ``bf16`` or ``fp16`` (with a GradScaler)."""
    bucket_cap_mb: float = 25.0
    """DDP gradient bucket size in MiB."""
    gradient_as_bucket_view: bool = False
    """DDP ``gradient_as_bucket_view`` (gradients alias the buckets: saves one gradient copy)."""
    compile: str = "off"
    """``torch.compile`` of the DDP-wrapped model: ``off`` (eager), ``default`` or
    ``max-autotune-no-cudagraphs`` (Inductor modes)."""
    compile_scope: Literal["whole", "regional"] = "whole"
    """With ``compile`` on, what is compiled: ``whole`` (the model inside DDP, one region) or
    ``regional`` (each repeated block on its own with this rank's budget, identical blocks sharing one
    compile, and the loss that ``plan.wrap(loss=...)`` owns as a tail region). Under ``regional`` a
    block listed in ``checkpoint`` is checkpointed eagerly and not compiled."""
    activation_budget: list[float] | None = None
    """Per rank, ``torch._functorch.config.activation_memory_budget`` set before compiling: the
    fraction of activation memory the partitioner may keep (1.0: its default; lower: recompute
    more). Only with ``compile`` on, which excludes layer checkpointing (``checkpoint`` all empty) unless
    ``compile_scope`` is ``regional``."""
    optimizer_sharding: Literal["off", "zero1"] = "off"
    """``off``: every rank keeps the whole optimizer state (plain DDP); ``zero1``: each rank keeps the
    state of its share of the parameters only (``plan.optimizer(...)``; ZeRO stage 1, uneven)."""
    optimizer_shares: list[float] | None = None
    """With ``zero1``: per rank, the fraction of the parameter bytes whose optimizer state it keeps
    (they sum to 1; None: even). The partition is whole parameters in the optimizer's order
    (``runtime/_zero.partition``, a pure function of these shares and the parameter sizes), so a
    production job with the same model applies the same partition."""
    param_sharding: Literal["off", "embeddings", "blocks"] = "off"
    """Parameters, gradients and optimizer state sharded evenly over the ranks by FSDP2
    (``fully_shard``): ``off`` (DDP), ``embeddings`` (the embedding-like modules only, the rest
    replicated through FSDP2) or ``blocks`` (the embedding-like modules, every repeated block and the
    root). Every rank then runs the same number of micro-steps (each forward all-gathers)."""
    keep_gathered: list[Literal["embeddings", "blocks"]] = field(default_factory=list)
    """With ``param_sharding`` on: the groups of units whose all-gathered weights stay from forward to
    backward (``reshard_after_forward=False``: no second all-gather, more memory); the others are freed
    after forward and gathered again in backward (FSDP2's default)."""

    def __post_init__(self) -> None:
        self._check_types()
        if self.global_batch > _MAX_BATCH:
            raise ConfigError(f"global_batch={self.global_batch} is out of range; use at most {_MAX_BATCH} samples per step.")
        if self.accumulation < 1:
            raise ConfigError(f"accumulation={self.accumulation} is below 1; use 1 for no accumulation.")
        if self.rank_samples is not None:
            self._check_rank_samples()
        ranks = len(self.micro_batches)
        if ranks == 0:
            raise ConfigError("micro_batches=[] is empty; give one micro-batch size per rank (or rank_samples).")
        if any(b < 1 for b in self.micro_batches):
            raise ConfigError(
                f"micro_batches={self.micro_batches} has a size below 1; every rank needs at least one sample."
            )
        total = sum(self.micro_batches) * self.accumulation
        if self.rank_samples is None and total != self.global_batch:
            raise ConfigError(
                f"micro_batches={self.micro_batches} sums to {sum(self.micro_batches)} x accumulation "
                f"{self.accumulation} = {total}, not global_batch={self.global_batch}; "
                "make sum(micro_batches) x accumulation equal the global batch."
            )
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype={self.dtype!r} is unknown; use one of {', '.join(DTYPES)}.")
        if not self.checkpoint:
            self.checkpoint = [[] for _ in range(ranks)]
        if len(self.checkpoint) != ranks:
            raise ConfigError(
                f"checkpoint has {len(self.checkpoint)} entries for {ranks} ranks; give one list of block indices per rank."
            )
        for rank, blocks in enumerate(self.checkpoint):
            if any(i < 0 for i in blocks) or len(set(blocks)) != len(blocks):
                raise ConfigError(
                    f"checkpoint[{rank}]={blocks} has a negative or repeated block index; list each block once."
                )
            self.checkpoint[rank] = sorted(blocks)
        if not 0 < self.bucket_cap_mb <= 10_000:
            raise ConfigError(
                f"bucket_cap_mb={self.bucket_cap_mb} is out of range; use a size in (0, 10000] MiB (DDP's default is 25)."
            )
        self._check_compile(ranks)
        self._check_sharding(ranks)
        self._check_param_sharding()

    def _check_param_sharding(self) -> None:
        mode = self.param_sharding
        if mode not in PARAM_SHARDINGS:
            raise ConfigError(f"param_sharding={mode!r} is unknown; use one of {', '.join(PARAM_SHARDINGS)}.")
        keep = self.keep_gathered
        if mode == "off":
            if keep:
                raise ConfigError(f"keep_gathered={keep} needs param_sharding on; set param_sharding='embeddings' "
                                  "or 'blocks', or keep_gathered=[].")
            return
        groups = PARAM_GROUPS if mode == "blocks" else ("embeddings",)
        if any(g not in groups for g in keep) or len(set(keep)) != len(keep):
            raise ConfigError(f"keep_gathered={keep} names an unknown or repeated group for param_sharding={mode!r}; "
                              f"list each of {', '.join(groups)} at most once.")
        self.keep_gathered = [g for g in PARAM_GROUPS if g in keep]
        if self.optimizer_sharding != "off":
            raise ConfigError(f"optimizer_sharding={self.optimizer_sharding!r} with param_sharding={mode!r}: "
                              "fully_shard already shards the optimizer state of what it shards; use "
                              "optimizer_sharding='off'.")
        if self.dtype == "fp16":
            raise ConfigError(f"dtype='fp16' with param_sharding={mode!r}: the GradScaler's overflow check would "
                              "see only this rank's shard of each gradient; use dtype='bf16' or 'fp32'.")
        if self.compile != "off" and (mode != "embeddings" or self.compile_scope != "regional"):
            raise ConfigError(f"compile={self.compile!r} (compile_scope={self.compile_scope!r}) with "
                              f"param_sharding={mode!r}: only the blocks of an embeddings-sharded model are compiled "
                              "here (they are no FSDP2 unit); use param_sharding='embeddings' with "
                              "compile_scope='regional', or compile='off'.")

    def _check_sharding(self, ranks: int) -> None:
        if self.optimizer_sharding not in OPTIMIZER_SHARDINGS:
            raise ConfigError(
                f"optimizer_sharding={self.optimizer_sharding!r} is unknown; use one of {', '.join(OPTIMIZER_SHARDINGS)}."
            )
        shares = self.optimizer_shares
        if shares is None:
            return
        if self.optimizer_sharding == "off":
            raise ConfigError(
                f"optimizer_shares={shares} needs optimizer_sharding='zero1'; set it or optimizer_shares=null."
            )
        if len(shares) != ranks:
            raise ConfigError(
                f"optimizer_shares has {len(shares)} entries for {ranks} ranks; give one fraction per rank (or null: even)."
            )
        if any(s < 0 for s in shares) or abs(sum(shares) - 1.0) > 1e-6:
            raise ConfigError(
                f"optimizer_shares={shares} are not fractions >= 0 summing to 1; pass per-rank fractions that add up to 1."
            )

    def sharding_shares(self) -> list[float] | None:
        """Per rank, its fraction of the optimizer state (``zero1``; even when not given); None when off."""
        if self.optimizer_sharding == "off":
            return None
        return list(self.optimizer_shares) if self.optimizer_shares is not None else [1.0 / self.world_size] * self.world_size

    def _check_rank_samples(self) -> None:
        """Check the any-split form; derive ``micro_batches``; store an equal split in the equal form."""
        shares, acc = self.rank_samples or [], self.accumulation
        if not shares:
            raise ConfigError("rank_samples=[] is empty; give one sample count per rank (or null for equal micro-batches).")
        if any(s < acc for s in shares) and self.param_sharding != "off":
            rank = min(r for r, s in enumerate(shares) if s < acc)
            raise ConfigError(
                f"rank_samples={shares} leaves rank {rank} fewer micro-steps than accumulation={acc}, but "
                f"param_sharding={self.param_sharding!r} needs the same number of micro-steps on every rank (each "
                f"forward all-gathers the shards: the others would wait forever); give every rank at least {acc} "
                "samples, lower the accumulation or use param_sharding='off'."
            )
        if any(s < acc for s in shares):
            raise ConfigError(
                f"rank_samples={shares} gives a rank fewer samples than accumulation={acc} micro-steps; "
                f"give every rank at least {acc} samples (one per micro-step) or lower the accumulation."
            )
        if sum(shares) != self.global_batch:
            raise ConfigError(
                f"rank_samples={shares} sums to {sum(shares)}, not global_batch={self.global_batch}; "
                "make the per-rank samples add up to the global batch."
            )
        largest = [-(-s // acc) for s in shares]
        if not self.micro_batches:
            self.micro_batches = largest
        elif self.micro_batches != largest:
            raise ConfigError(
                f"micro_batches={self.micro_batches} does not match rank_samples={shares} in {acc} micro-steps "
                f"(largest micro-batches {largest}); leave micro_batches out or set it to {largest}."
            )
        if all(s == b * acc for s, b in zip(shares, largest, strict=True)):
            self.rank_samples = None  # an equal split: the equal form, as stored before any split existed

    def _check_compile(self, ranks: int) -> None:
        if self.compile not in COMPILE_MODES:
            raise ConfigError(f"compile={self.compile!r} is unknown; use one of {', '.join(COMPILE_MODES)}.")
        if self.compile_scope not in COMPILE_SCOPES:
            raise ConfigError(f"compile_scope={self.compile_scope!r} is unknown; use one of {', '.join(COMPILE_SCOPES)}.")
        if self.compile == "off":
            if self.compile_scope != "whole":
                raise ConfigError(
                    f"compile_scope={self.compile_scope!r} needs compile on; set compile='default' or "
                    "compile_scope='whole'."
                )
            if self.activation_budget is not None:
                raise ConfigError(
                    f"activation_budget={self.activation_budget} needs compile on; set compile='default' "
                    "or activation_budget=null."
                )
            return
        for rank, blocks in enumerate(self.checkpoint):
            if blocks and self.compile_scope == "whole":
                raise ConfigError(
                    f"checkpoint[{rank}]={blocks} with compile={self.compile!r}: layer checkpointing and the "
                    "compile activation budget would both recompute; use checkpoint=[] on every rank (lower "
                    "activation_budget instead), compile_scope='regional' (checkpointed blocks stay eager) or "
                    "compile='off'."
                )
        if self.compile_scope == "regional" and self.compile in CUDA_GRAPH_MODES:
            raise ConfigError(
                f"compile_scope='regional' with compile={self.compile!r}: CUDA graphs are captured for the whole "
                "model only (one graph tree per block would hold every block's activations apart); use "
                "compile_scope='whole' or compile='default'."
            )
        if self.compile in CUDA_GRAPH_MODES and ranks > 1:
            raise ConfigError(
                f"compile={self.compile!r} with {ranks} ranks: CUDA graphs run at world size 1 only (in DDP the "
                "captured regions would hold the gradient all-reduce); use compile='default' or one rank."
            )
        if self.bucket_cap_mb < 1.0:
            raise ConfigError(
                f"bucket_cap_mb={self.bucket_cap_mb} with compile={self.compile!r} is below 1 MiB, the first "
                "bucket of a compiled DDP model (its DDPOptimizer asserts it); use bucket_cap_mb >= 1 or compile='off'."
            )
        if self.activation_budget is None:
            return
        if len(self.activation_budget) != ranks:
            raise ConfigError(
                f"activation_budget has {len(self.activation_budget)} entries for {ranks} ranks; give one "
                "budget per rank (or null for the partitioner's default)."
            )
        for rank, budget in enumerate(self.activation_budget):
            if not 0.0 <= budget <= 1.0:
                raise ConfigError(
                    f"activation_budget[{rank}]={budget} is out of range; use a fraction in [0, 1] "
                    "(1.0 = the partitioner's default, lower = more recomputation)."
                )

    def _check_types(self) -> None:
        def bad(name: str, value: Any, expected: str) -> ConfigError:
            return ConfigError(f"{name}={value!r} is not {expected}; fix the configuration's {name}.")

        if not isinstance(self.micro_batches, list) or not all(is_int(b) for b in self.micro_batches):
            raise bad("micro_batches", self.micro_batches, "a list of integers")
        for name in ("accumulation", "global_batch"):
            if not is_int(getattr(self, name)):
                raise bad(name, getattr(self, name), "an integer")
        shares = self.rank_samples
        if shares is not None and (not isinstance(shares, list) or not all(is_int(s) for s in shares)):
            raise bad("rank_samples", shares, "null or a list of integers (samples per optimizer step, per rank)")
        if not isinstance(self.checkpoint, list) or not all(
            isinstance(c, list) and all(is_int(i) for i in c) for c in self.checkpoint
        ):
            raise bad("checkpoint", self.checkpoint, "a list (one per rank) of lists of block indices")
        if not isinstance(self.dtype, str):
            raise bad("dtype", self.dtype, "a string")
        if isinstance(self.bucket_cap_mb, bool) or not isinstance(self.bucket_cap_mb, (int, float)):
            raise bad("bucket_cap_mb", self.bucket_cap_mb, "a number")
        self.bucket_cap_mb = float(self.bucket_cap_mb)
        if not isinstance(self.gradient_as_bucket_view, bool):
            raise bad("gradient_as_bucket_view", self.gradient_as_bucket_view, "true or false")
        if not isinstance(self.compile, str):
            raise bad("compile", self.compile, "a string")
        if not isinstance(self.compile_scope, str):
            raise bad("compile_scope", self.compile_scope, "a string")
        budget = self.activation_budget
        if budget is not None:
            if not isinstance(budget, list) or not all(is_number(b) and math.isfinite(b) for b in budget):
                raise bad("activation_budget", budget, "null or a list of fractions (one per rank)")
            self.activation_budget = [float(b) for b in budget]
        if not isinstance(self.param_sharding, str):
            raise bad("param_sharding", self.param_sharding, "a string")
        if not isinstance(self.keep_gathered, list) or not all(isinstance(g, str) for g in self.keep_gathered):
            raise bad("keep_gathered", self.keep_gathered, "a list of group names (embeddings, blocks)")
        if not isinstance(self.optimizer_sharding, str):
            raise bad("optimizer_sharding", self.optimizer_sharding, "a string")
        fractions = self.optimizer_shares
        if fractions is not None:
            if not isinstance(fractions, list) or not all(is_number(v) and math.isfinite(v) for v in fractions):
                raise bad("optimizer_shares", fractions, "null or a list of fractions (one per rank)")
            self.optimizer_shares = [float(v) for v in fractions]

    @property
    def world_size(self) -> int:
        return len(self.micro_batches)

    @property
    def samples_per_rank(self) -> list[int]:
        """Per rank, the samples it takes per optimizer step (they sum to the global batch)."""
        if self.rank_samples is not None:
            return list(self.rank_samples)
        return [b * self.accumulation for b in self.micro_batches]

    def micro_step_sizes(self, rank: int) -> list[int]:
        """Sizes of ``rank``'s micro-batches in one optimizer step, larger first."""
        return micro_step_sizes(self.samples_per_rank[rank], self.accumulation)

    @property
    def equal_micro_batches(self) -> bool:
        """Whether every micro-step of a rank has the same size (the form from before any split)."""
        return self.rank_samples is None

    def split_lines(self) -> list[str]:
        """The split as people read it, one line per rank: ``rank 0: 6,6,5,5,5,5``."""
        return [f"rank {r}: {','.join(str(n) for n in self.micro_step_sizes(r))}" for r in range(self.world_size)]

    def split_text(self) -> str:
        """:meth:`split_lines` on one line, ranks separated by ``; ``."""
        return "; ".join(self.split_lines())

    def validate_for(self, *, world_size: int, num_layers: int | None = None) -> None:
        """Checks that depend on the job this configuration is applied to."""
        if self.world_size != world_size:
            raise ConfigError(
                f"micro_batches={self.micro_batches} has {self.world_size} entries but the job has "
                f"{world_size} ranks; give one micro-batch size per rank."
            )
        if num_layers is not None:
            for rank, blocks in enumerate(self.checkpoint):
                if blocks and blocks[-1] >= num_layers:
                    fix = (f"use indices 0..{num_layers - 1}, or name other blocks with plan.wrap(model, blocks=...)"
                           if num_layers else
                           "no repeated blocks were found: name them with plan.wrap(model, blocks=\"path.to.blocks\") "
                           "(a ModuleList or nn.Sequential of the model's blocks)")
                    raise ConfigError(
                        f"checkpoint[{rank}]={blocks} names block {blocks[-1]} but the model has "
                        f"{num_layers} blocks; {fix}."
                    )

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        if data["rank_samples"] is None:
            del data["rank_samples"]  # the equal form is stored as it was before any split existed
        if data["compile_scope"] == "whole":  # stored as before regional compilation existed
            del data["compile_scope"]
        if data["optimizer_sharding"] == "off":  # stored as before sharding existed
            del data["optimizer_sharding"], data["optimizer_shares"]
        if data["param_sharding"] == "off":  # stored as before parameter sharding existed
            del data["param_sharding"], data["keep_gathered"]
        return data

    @classmethod
    def from_dict(cls, data: Any) -> BalanceConfig:
        if not isinstance(data, dict):
            raise ConfigError(f"configuration={data!r} is not a JSON object; pass a mapping of fields.")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(
                f"configuration has unknown field(s) {unknown}; the known fields are {sorted(known)}."
            )
        required = {f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING}
        if data.get("rank_samples") is None:
            required.add("micro_batches")
        missing = sorted(required - set(data))
        if missing:
            raise ConfigError(f"configuration lacks required field(s) {missing}; add them.")
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> BalanceConfig:
        if not isinstance(text, str) or len(text) > _MAX_JSON_CHARS:
            raise ConfigError(f"configuration JSON is not a string of at most {_MAX_JSON_CHARS} characters; pass valid JSON.")
        try:
            data = json.loads(text, parse_constant=_reject_constant)
        except (ValueError, RecursionError) as exc:  # JSONDecodeError, NaN/Infinity, absurd nesting
            raise ConfigError(f"configuration JSON is malformed ({str(exc)[:200]}); pass valid JSON.") from None
        return cls.from_dict(data)

    @classmethod
    def uniform(
        cls,
        *,
        world_size: int,
        micro_batch: int,
        accumulation: int = 1,
        dtype: str = "fp32",
        checkpoint: list[int] | None = None,
        bucket_cap_mb: float = 25.0,
        gradient_as_bucket_view: bool = False,
    ) -> BalanceConfig:
        """The configuration a plain DDP script has: the same micro-batch on every rank."""
        return cls(
            micro_batches=[micro_batch] * world_size,
            accumulation=accumulation,
            global_batch=micro_batch * world_size * accumulation,
            checkpoint=[list(checkpoint or []) for _ in range(world_size)],
            dtype=dtype,
            bucket_cap_mb=bucket_cap_mb,
            gradient_as_bucket_view=gradient_as_bucket_view,
        )

    @classmethod
    def any_split(cls, *, rank_samples: list[int], accumulation: int = 1, **fields_: Any) -> BalanceConfig:
        """A configuration from per-rank samples per optimizer step and the number of micro-steps
        (``global_batch`` = their sum; the other fields as for the constructor)."""
        return cls(rank_samples=list(rank_samples), accumulation=accumulation,
                   global_batch=sum(rank_samples), **fields_)

    def permuted(self, order: list[int]) -> BalanceConfig:
        """This configuration with its ranks reordered: rank ``r`` of the result runs what rank
        ``order[r]`` ran here (micro-batches or samples, checkpointed blocks, activation budget,
        optimizer share: every per-rank field). The global batch, the accumulation and everything
        shared stay, and each sample's loss weight is ``1 / global_batch`` whichever rank holds it, so
        the update is the same. Used when production finds the tuned GPUs in another rank order."""
        if sorted(order) != list(range(self.world_size)):
            raise ConfigError(
                f"order={order} is not a permutation of the {self.world_size} ranks; give each rank 0..{self.world_size - 1} once."
            )
        data = self.to_dict()

        def pick(values: list[Any] | None) -> list[Any] | None:
            return None if values is None else [values[i] for i in order]

        for name in ("micro_batches", "rank_samples", "checkpoint", "activation_budget", "optimizer_shares"):
            if name in data:
                data[name] = pick(data[name])
        return BalanceConfig.from_dict(data)


_MAX_BATCH = 2**31 - 1
"""Sanity bound on the global batch (and so on every micro-batch and the accumulation)."""
_MAX_JSON_CHARS = 1_000_000
"""A configuration is a few hundred bytes; anything this large is not one."""


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a valid value")


def split_evenly(total: int, weights: list[float]) -> list[int]:
    """Integer parts proportional to ``weights`` that sum to ``total`` (largest remainder).

    Every part is at least 1 when ``total >= len(weights)``; parts exactly proportional to the
    weights come back unchanged (``split_evenly(16, [3/13, 1]) == [3, 13]``).
    """
    n = len(weights)
    if n == 0:
        raise ValueError("weights must not be empty")
    if any(w < 0 for w in weights):
        raise ValueError(f"weights={weights} has a negative entry")
    wsum = float(sum(weights))
    if wsum <= 0:
        weights, wsum = [1.0] * n, float(n)
    ideal = [total * w / wsum for w in weights]
    parts = [int(x + 1e-9) for x in ideal]
    order = sorted(range(n), key=lambda i: (ideal[i] - parts[i], weights[i]), reverse=True)
    for i in order[: max(0, total - sum(parts))]:
        parts[i] += 1
    while total >= n and min(parts) == 0:
        parts[parts.index(max(parts))] -= 1
        parts[parts.index(0)] += 1
    return parts


def micro_step_sizes(samples: int, steps: int) -> list[int]:
    """``samples`` split over ``steps`` micro-steps as evenly as possible, larger first
    (``micro_step_sizes(32, 6) == [6, 6, 5, 5, 5, 5]``)."""
    if steps < 1:
        raise ValueError(f"steps={steps} is below 1")
    base, extra = divmod(samples, steps)
    return [base + 1] * extra + [base] * (steps - extra)


def split_at_least(total: int, weights: list[float], minimum: int) -> list[int]:
    """:func:`split_evenly`, then samples moved from the largest parts until every part is at
    least ``minimum`` (needs ``total >= minimum * len(weights)``)."""
    if total < minimum * len(weights):
        raise ValueError(f"total={total} is below minimum={minimum} x {len(weights)} parts")
    parts = split_evenly(total, weights)
    while min(parts) < minimum:
        parts[parts.index(max(parts))] -= 1
        parts[parts.index(min(parts))] += 1
    return parts


def samples_within(
    largest: list[int], accumulation: int, global_batch: int, cost: list[float] | None = None
) -> list[int]:
    """Per-rank samples per step that sum to ``global_batch`` with each rank's micro-batches at most
    ``largest[r]`` (``accumulation`` micro-steps of at least one sample): from ``largest[r] *
    accumulation``, samples are taken one at a time from the rank whose ``samples * cost[r]`` is
    highest (its step ends last; ``cost`` defaults to 1). Needs ``accumulation * len(largest) <=
    global_batch <= sum(largest) * accumulation``."""
    world = len(largest)
    weights = cost or [1.0] * world
    samples = [b * accumulation for b in largest]
    if not accumulation * world <= global_batch <= sum(samples):
        raise ValueError(
            f"global_batch={global_batch} is outside [{accumulation * world}, {sum(samples)}] for "
            f"largest micro-batches {largest} in {accumulation} micro-steps"
        )
    for _ in range(sum(samples) - global_batch):
        r = max((r for r in range(world) if samples[r] > accumulation), key=lambda r: (samples[r] * weights[r], -r))
        samples[r] -= 1
    return samples


def describe_config(config: dict[str, Any] | BalanceConfig | None) -> str:
    """One line for a configuration (``None``: the script's own), the one notation every output uses:
    per rank its micro-batches of one optimizer step and its checkpointed blocks (indices, runs as
    ranges) or compile budget, then what all ranks share (dtype, compile mode, DDP bucket, ZeRO-1
    shares, FSDP2 sharding as ``fsdp=<which> [keep=<groups>]``):
    ``rank 0: 6,6,5,5 ckpt 0-3; rank 1: 4,4,4,4 | bf16 bucket=25MB view`` (the micro-batches as
    :meth:`BalanceConfig.split_text` writes them, one rank included)."""
    if config is None:
        return "script defaults"
    try:
        c = BalanceConfig.from_dict(config) if isinstance(config, dict) else config
    except ConfigError:  # not a configuration (a damaged attribute): shown as it is
        return str(config)
    mode = c.compile
    per_rank = []
    for r, line in enumerate(c.split_lines()):
        if mode != "off" and c.activation_budget:
            line += f" budget {c.activation_budget[r]:.2g}"
        if c.checkpoint[r]:
            line += f" ckpt {block_ranges(c.checkpoint[r])}"
        per_rank.append(line)
    shared = [c.dtype]
    if mode != "off":
        shared.append(f"compile={mode}" + (" regional" if c.compile_scope == "regional" else "")
                      + ("" if c.activation_budget else " (default budget)"))
    shared.append(f"bucket={c.bucket_cap_mb:.0f}MB" + (" view" if c.gradient_as_bucket_view else ""))
    zero = c.sharding_shares()
    if zero is not None:
        shared.append("zero1 " + "/".join(f"{100 * q:.0f}%" for q in zero))
    if c.param_sharding != "off":
        shared.append(f"fsdp={c.param_sharding}" + (f" keep={'+'.join(c.keep_gathered)}" if c.keep_gathered else ""))
    return "; ".join(per_rank) + " | " + " ".join(shared)


def block_ranges(blocks: list[int]) -> str:
    """Block indices as people read them: runs of consecutive indices as ranges
    (``[0, 1, 2, 5, 7, 8]`` -> ``0-2,5,7-8``); ``none`` for no block."""
    out: list[str] = []
    for i in sorted(set(blocks)):
        if out and out[-1].split("-")[-1] == str(i - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{i}"
        else:
            out.append(str(i))
    return ",".join(out) or "none"
