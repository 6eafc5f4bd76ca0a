"""Uneven ZeRO-1: each rank keeps the optimizer state of its share of the parameters only.

:func:`partition` (pure) cuts the parameters, whole and in the optimizer's own order, into one
contiguous run per rank whose sizes are as close to the per-rank shares as the parameter sizes
allow. :class:`ShardedOptimizer` wraps any ``torch.optim`` optimizer (AdamW, SGD with momentum,
fused, foreach or not): the wrapped optimizer steps this rank's run only, so it allocates state for
those parameters only; after the step every owner broadcasts its updated parameters (flattened in
buckets), so every rank holds the same weights again.

What stays exact, and why:

- Gradients are full on every rank (DDP's all-reduce, as before): this is stage 1, not 2. The
  wrapper's ``param_groups`` list *every* parameter, so the fp16 GradScaler unscales every gradient
  and its inf check reads the same (all-reduced, identical) gradients on every rank: every rank skips
  the same steps. Clipping by global norm (``clip_grad_norm_`` over ``param_groups``) computes the
  same norm as the unsharded optimizer, bitwise, with no extra collective.
- An element-wise optimizer's update of a parameter depends on that parameter's gradient and state
  only, so stepping a subset computes bitwise what the full optimizer computes for that subset
  (foreach/fused kernels group tensors differently but apply the same per-element arithmetic).
- Hyperparameters (``lr`` set by a scheduler) are read from the wrapper's groups and copied into
  the wrapped optimizer's before each step.

``state_dict()`` is a collective (every rank must call it): it gathers the full state in the format
of the plain optimizer (parameter indices over all parameters), loadable with
``torch.optim.AdamW(...).load_state_dict``; ``load_state_dict`` takes such a full state on every rank
and keeps its own run's part (no communication).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from autobalance._errors import UsageError
from autobalance.runtime._fsdp import local_nbytes

__all__ = ["DEFAULT_EXCHANGE_BUCKET_BYTES", "OptimizerInfo", "ShardedOptimizer", "owner_ranges", "partition", "state_bytes"]

DEFAULT_EXCHANGE_BUCKET_BYTES = 64 * 2**20
"""At most this many bytes of parameters are flattened and broadcast at once (the transient buffer)."""


def partition(sizes: Sequence[int], shares: Sequence[float]) -> list[int]:
    """How many parameters each rank owns: ``sizes`` (bytes, in the optimizer's order) cut into one
    contiguous run per rank, rank 0 first, so that rank ``r``'s bytes are as close to
    ``shares[r] * sum(sizes)`` as whole parameters allow.

    Boundary ``r`` (after rank ``r``'s run) is put at the cumulative size closest to
    ``sum(shares[:r+1]) * total`` (ties: the earlier cut), never before the previous boundary. Each
    boundary is then within half a parameter of its target, so every rank's bytes are within one
    parameter's size (the largest one at its two boundaries) of its share. A share of 0 owns nothing.
    """
    if not shares or any(s < 0 for s in shares) or abs(sum(shares) - 1.0) > 1e-6:
        raise UsageError(f"shares={list(shares)} are not fractions >= 0 summing to 1; pass one share per rank.")
    if any(s < 0 for s in sizes):
        raise UsageError("sizes has a negative entry; pass each parameter's size in bytes.")
    cumulative = [0]
    for s in sizes:
        cumulative.append(cumulative[-1] + int(s))
    total = cumulative[-1]
    counts: list[int] = []
    start, acc = 0, 0.0
    for r, share in enumerate(shares):
        acc += share
        if r == len(shares) - 1:
            cut = len(sizes)
        else:
            target = acc * total
            cut = min(range(start, len(sizes) + 1), key=lambda i: (abs(cumulative[i] - target), i))
        counts.append(cut - start)
        start = cut
    return counts


def owner_ranges(counts: Sequence[int]) -> list[range]:
    """Per rank, the indices (in the optimizer's order) of the parameters it owns."""
    out, start = [], 0
    for c in counts:
        out.append(range(start, start + c))
        start += c
    return out


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensors ``optimizer`` keeps as state (moments, momentum buffers, step counters);
    for a :class:`ShardedOptimizer`, this rank's part only."""
    inner = optimizer.inner if isinstance(optimizer, ShardedOptimizer) else optimizer
    total = 0
    for state in inner.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                total += local_nbytes(value)
    return total


class ShardedOptimizer(torch.optim.Optimizer):
    """``optimizer`` sharded over the ranks of ``group`` by ``shares`` (ZeRO stage 1, uneven).

    Build it right after the plain optimizer (before its first step): ``opt =
    plan.optimizer(torch.optim.AdamW(model.parameters(), lr=...))``. ``param_groups`` hold every
    parameter (schedulers, clipping and the GradScaler see the whole model); the wrapped optimizer
    (:attr:`inner`) holds this rank's run only.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        shares: Sequence[float],
        group: Any = None,
        bucket_bytes: int = DEFAULT_EXCHANGE_BUCKET_BYTES,
        always_exchange: bool = False,
    ) -> None:
        if isinstance(optimizer, ShardedOptimizer):
            raise UsageError("optimizer is already sharded; pass the plain torch.optim optimizer once.")
        if any(len(s) for s in optimizer.state.values()):
            raise UsageError(
                "optimizer has state already (it stepped, or loaded a state_dict); shard it before its first step "
                "and load checkpoints into the sharded optimizer."
            )
        self.group = group
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        self.world_size = dist.get_world_size(group) if dist.is_initialized() else 1
        if len(shares) != self.world_size:
            raise UsageError(f"shares={list(shares)} has {len(shares)} entries for {self.world_size} ranks; give one per rank.")
        self.inner = optimizer
        self.bucket_bytes = bucket_bytes
        self.always_exchange = always_exchange
        """Flatten, broadcast and copy back even with one rank (to measure that path's cost)."""
        self.waiting: Callable[[], contextlib.AbstractContextManager[Any]] | None = None
        """What each broadcast of the exchange runs inside (the busy meter's wait timer in a trial)."""
        full_groups = [dict(g) for g in optimizer.param_groups]
        super().__init__(full_groups, optimizer.defaults)
        self.params = [p for g in self.param_groups for p in g["params"]]
        if len({id(p) for p in self.params}) != len(self.params):
            raise UsageError("optimizer lists a parameter twice; give each parameter to one group once.")
        self.shares = [float(s) for s in shares]
        """Per rank, the fraction of the parameter bytes whose state it keeps."""
        self.counts = partition([p.numel() * p.element_size() for p in self.params], self.shares)
        """Per rank, how many parameters (in the optimizer's order) it owns."""
        self.ranges = owner_ranges(self.counts)
        mine = {id(self.params[i]) for i in self.ranges[self.rank]}
        for g in optimizer.param_groups:
            g["params"] = [p for p in g["params"] if id(p) in mine]
        self._index = {id(p): i for i, p in enumerate(self.params)}

    # ------------------------------------------------------------------ step
    def _sync_hyperparameters(self) -> None:
        for full, own in zip(self.param_groups, self.inner.param_groups, strict=True):
            for key, value in full.items():
                if key != "params":
                    own[key] = value

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Step this rank's parameters, then every owner broadcasts its updated parameters."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._sync_hyperparameters()
        self.inner.step()
        if self.world_size > 1 or self.always_exchange:
            self._exchange()
        return loss

    def _exchange(self) -> None:
        for owner, run in enumerate(self.ranges):
            for bucket in self._buckets([self.params[i] for i in run]):
                flat = torch.cat([p.detach().reshape(-1) for p in bucket]) if owner == self.rank else torch.empty(
                    sum(p.numel() for p in bucket), dtype=bucket[0].dtype, device=bucket[0].device)
                if self.world_size > 1 or dist.is_initialized():
                    with self.waiting() if self.waiting is not None else contextlib.nullcontext():
                        dist.broadcast(flat, src=dist.get_global_rank(self.group, owner) if self.group else owner,
                                       group=self.group)
                if owner != self.rank or self.always_exchange:
                    offset = 0
                    for p in bucket:
                        p.detach().copy_(flat[offset:offset + p.numel()].view_as(p))
                        offset += p.numel()

    def _buckets(self, params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        """Consecutive parameters of one dtype and device, at most ``bucket_bytes`` each (one parameter
        larger than that is a bucket of its own)."""
        buckets: list[list[torch.Tensor]] = []
        size = 0
        for p in params:
            nbytes = p.numel() * p.element_size()
            last = buckets[-1] if buckets else None
            if (last is None or last[0].dtype != p.dtype or last[0].device != p.device
                    or size + nbytes > self.bucket_bytes):
                buckets.append([p])
                size = nbytes
            else:
                last.append(p)
                size += nbytes
        return buckets

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The full state, as the plain optimizer over every parameter would return it (a collective:
        call it on every rank; each gets the whole state)."""
        own = self.inner.state_dict()
        mine = list(self.ranges[self.rank])
        local = {mine[k]: v for k, v in own["state"].items()}  # inner indices -> global indices
        meta = {str(i): {key: ({"tensor": [list(v.shape), str(v.dtype).removeprefix("torch."), v.device.type]}
                               if isinstance(v, torch.Tensor) else {"value": v})
                         for key, v in s.items()} for i, s in local.items()}
        metas = _all_gather_json(meta, group=self.group, world_size=self.world_size)
        state: dict[int, dict[str, Any]] = {}
        for owner, owner_meta in enumerate(metas):
            for index in sorted(owner_meta, key=int):
                entry: dict[str, Any] = {}
                for key in sorted(owner_meta[index]):
                    desc = owner_meta[index][key]
                    if "value" in desc:
                        entry[key] = desc["value"]
                        continue
                    entry[key] = self._broadcast_state(local.get(int(index), {}).get(key), desc["tensor"], owner)
                state[int(index)] = entry
        groups = []
        start = 0
        for g in self.param_groups:
            n = len(g["params"])
            groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": list(range(start, start + n))})
            start += n
        return {"state": state, "param_groups": groups}

    def _broadcast_state(self, tensor: torch.Tensor | None, desc: list[Any], owner: int) -> torch.Tensor:
        shape, dtype_name, device_type = desc
        dtype = getattr(torch, dtype_name)
        home = self.params[0].device if device_type != "cpu" else torch.device("cpu")
        if self.world_size == 1:
            assert tensor is not None
            return tensor.detach().clone()
        comm = _comm_device(self.group, self.params[0].device)
        buffer = tensor.detach().to(comm).clone() if tensor is not None else torch.empty(shape, dtype=dtype, device=comm)
        dist.broadcast(buffer, src=dist.get_global_rank(self.group, owner) if self.group else owner, group=self.group)
        return buffer.to(home)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a full state (from :meth:`state_dict` or a plain optimizer over the same parameters);
        this rank keeps its own run's part. No communication."""
        groups = state_dict.get("param_groups", [])
        if len(groups) != len(self.param_groups) or any(
                len(a["params"]) != len(b["params"]) for a, b in zip(groups, self.param_groups, strict=True)):
            raise UsageError(
                "state_dict has param_groups of other sizes than this optimizer's; load a state saved from the "
                "same model and parameter groups."
            )
        order = [i for g in groups for i in g["params"]]  # saved ids, in parameter order
        full_state = state_dict.get("state", {})
        mine = list(self.ranges[self.rank])
        inner_groups = []
        position = 0
        for saved, own in zip(groups, self.inner.param_groups, strict=True):
            n_own = len(own["params"])
            inner_groups.append({**{k: v for k, v in saved.items() if k != "params"},
                                 "params": list(range(position, position + n_own))})
            position += n_own
        inner_state = {k: full_state[order[g]] for k, g in enumerate(mine) if order[g] in full_state}
        self.inner.load_state_dict({"state": inner_state, "param_groups": inner_groups})
        for saved, full in zip(groups, self.param_groups, strict=True):
            for key, value in saved.items():
                if key != "params":
                    full[key] = value


def _comm_device(group: Any, fallback: torch.device) -> torch.device:
    """Where a collective's tensors must live: CUDA for NCCL, the CPU for gloo."""
    backend = dist.get_backend(group)
    return fallback if backend == "nccl" else torch.device("cpu")


def _all_gather_json(obj: Any, *, group: Any, world_size: int) -> list[Any]:
    """Every rank's ``obj`` (JSON-serialisable), in rank order; JSON bytes, nothing unpickled."""
    if world_size == 1:
        return [obj]
    device = _comm_device(group, torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
                          else torch.device("cpu"))
    data = torch.tensor(list(json.dumps(obj).encode()), dtype=torch.uint8, device=device)
    sizes = [torch.zeros(1, dtype=torch.long, device=device) for _ in range(world_size)]
    dist.all_gather(sizes, torch.tensor([data.numel()], dtype=torch.long, device=device), group=group)
    longest = max(int(s.item()) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[:data.numel()] = data
    out = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(world_size)]
    dist.all_gather(out, padded, group=group)
    return [json.loads(bytes(t[:int(s.item())].tolist()).decode()) for t, s in zip(out, sizes, strict=True)]


@dataclass(kw_only=True)
class OptimizerInfo:
    """What a rank's report says of its optimizer (``RankReport.optimizer``)."""

    sharding: str = "off"
    """The configuration's ``optimizer_sharding``."""
    wrapped: bool = False
    """The script passes its optimizer through ``plan.optimizer(...)`` (so ``zero1`` can apply)."""
    sharded: ShardedOptimizer | None = None
    """The sharded optimizer ``plan.optimizer`` returned (None: not sharded)."""
    state_bytes: int | None = None
    """Bytes of optimizer state this rank holds, measured after its optimizer steps (None: no step yet)."""
    param_bytes: int | None = None
    """Bytes of the parameters whose state this rank keeps (all of them when not sharded)."""
    total_param_bytes: int | None = None
    """Bytes of all the optimizer's parameters."""
    warned: bool = False
    """The one-line note that a ``zero1`` configuration met an unwrapped optimizer was printed."""
    measured: int = 0
    """Steps seen."""

    def after_step(self, optimizer: torch.optim.Optimizer, *, rank: int) -> None:
        """Measure the state after a step (allocated by the first one): after the first two steps only,
        so a long run pays nothing for it."""
        self.measured += 1
        if self.measured > 2:
            return
        if self.sharding == "zero1" and self.sharded is None and not self.warned and rank == 0:
            self.warned = True
            print("autobalance: optimizer_sharding='zero1' needs opt = plan.optimizer(torch.optim....); "
                  "this optimizer steps unsharded", flush=True)
        self.state_bytes = state_bytes(optimizer)
        params = [p for g in optimizer.param_groups for p in g["params"]]
        self.total_param_bytes = sum(p.numel() * p.element_size() for p in params)  # whole, sharded or not
        if isinstance(optimizer, ShardedOptimizer):
            self.param_bytes = sum(params[i].numel() * params[i].element_size() for i in optimizer.ranges[optimizer.rank])
        else:
            self.param_bytes = sum(local_nbytes(p) for p in params)  # this rank's shards under FSDP2

    def to_dict(self) -> dict[str, Any]:
        return {"sharding": "zero1" if self.sharded is not None else "off", "wrapped": self.wrapped,
                "state_bytes": self.state_bytes, "param_bytes": self.param_bytes,
                "total_param_bytes": self.total_param_bytes,
                "shares": self.sharded.shares if self.sharded is not None else None,
                "params_owned": self.sharded.counts if self.sharded is not None else None}
