"""``autobalance diagnose``: one short run at the script's own configuration, then a per-rank memory
breakdown and the likely causes of imbalance, each with what autobalance can do about it.

The causes come from the usual list (memory a rank holds before training, uneven inputs, AMP on
some ranks only, ``nn.DataParallel``, ``find_unused_parameters=True``, no checkpointing on a deep
model, optimizer state dominating) and a slow rank (its busy time per sample, the step less its wait
at the gradient all-reduce, :func:`~autobalance.protocol.slow_rank`). The figures come from the
runtime's per-rank report (``breakdown``: see :mod:`autobalance.runtime._breakdown`; ``optimizer``:
the optimizer state each rank keeps, its share under zero1; ``busy_time_s``, ``allreduce_wait_s``).
"""

from __future__ import annotations

import os
import shlex
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from autobalance import _env
from autobalance._config import BalanceConfig
from autobalance._errors import ConfigError, LaunchError, TrialScriptError, UsageError
from autobalance.protocol import (
    GIB,
    MIB,
    RankDevice,
    RankMemory,
    RankReport,
    Status,
    memory_text,
    slow_rank,
)

if TYPE_CHECKING:
    from autobalance.launcher import TrialOutcome

__all__ = ["Diagnosis", "Finding", "RankBreakdown", "analyse", "print_diagnosis", "run_diagnose"]

IMBALANCE_CAUSES = frozenset({"rank_extras", "uneven_inputs", "amp_some_ranks", "data_parallel", "slow_rank"})
"""Causes that make one rank need more than another; the others (no checkpointing, optimizer state,
allocator cache, find_unused_parameters) weigh on every rank alike and are listed after them."""


@dataclass(kw_only=True)
class Finding:
    """One likely cause of imbalance, with its size and the command that addresses it."""

    cause: str
    """Stable id: rank_extras, uneven_inputs, amp_some_ranks, data_parallel, slow_rank,
    find_unused_parameters, no_checkpointing, optimizer_state, allocator_cache, oom."""
    title: str
    size_bytes: int | None
    ranks: list[int]
    detail: str
    action: str
    command: str | None = None


@dataclass(kw_only=True)
class RankBreakdown:
    """One rank's figures, bytes (None: not measured on this device or before a failure)."""

    rank: int
    status: str
    micro_batch: int | None
    dtype: str | None
    autocast: str | None
    blocks: str | None
    peak_device: int | None
    capacity: int | None
    held_at_wrap: int | None
    parameters: int | None
    gradients: int | None
    optimizer_state: int | None
    activations_peak: int | None
    ddp_buckets: int | None
    held_outside_training: int | None
    allocator_cache: int | None
    outside_pytorch: int | None
    input_shape: list[int] | None = None
    flags: dict[str, Any] = field(default_factory=dict)
    optimizer_sharding: str | None = None
    """``off`` or ``zero1`` (``optimizer_state`` is then this rank's share); None: not reported."""
    samples_per_step: int | None = None
    """This rank's samples per optimizer step (its configuration)."""
    busy_time_s: float | None = None
    """Its own work per step, without its wait at the gradient all-reduce (median of the measured steps)."""
    allreduce_wait_s: float | None = None


@dataclass(kw_only=True)
class Diagnosis:
    script: str
    script_args: list[str]
    world_size: int
    device: str
    status: str
    reason: str
    trial_dir: str
    ranks: list[RankBreakdown]
    spread_bytes: int | None
    spread_pct_of_capacity: float | None
    findings: list[Finding]
    tune_command: str
    memtracker: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    """How the figures were taken where not as usual (the module rows of a model called twice per step)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ---------------------------------------------------------------------- analysis
def tune_command(*, script: str, script_args: list[str], nproc_per_node: int, device: str,
                 memory_cap: str | None) -> str:
    """The ``autobalance tune`` line for this script; ``memory_cap``: the cap as ``--memory-cap`` takes it
    (``20GiB``, ``A100-40GB``; None: no cap, the card's own memory)."""
    cmd = ["autobalance", "tune", script, "--nproc-per-node", str(nproc_per_node), "--device", device]
    if memory_cap:
        cmd += ["--memory-cap", memory_cap]
    if script_args:
        cmd += ["--", *script_args]
    return shlex.join(cmd)


def _get(d: dict[str, Any] | None, key: str) -> int | None:
    if not d or d.get(key) is None:
        return None
    return int(d[key])


def _int(value: float | None) -> int | None:
    return None if value is None else int(value)


def _float(value: float | None) -> float | None:
    return None if value is None else float(value)


def _samples_per_step(rank: int, config: dict[str, Any]) -> int | None:
    try:
        return BalanceConfig.from_dict(config).samples_per_rank[rank]
    except (ConfigError, IndexError, KeyError, TypeError, ValueError):
        return None


def _rank_row(rank: int, rep: RankReport | None) -> RankBreakdown:
    if rep is None:
        return RankBreakdown(rank=rank, status="no report", micro_batch=None, dtype=None, autocast=None, blocks=None,
                             peak_device=None, capacity=None, held_at_wrap=None, parameters=None, gradients=None,
                             optimizer_state=None, activations_peak=None, ddp_buckets=None,
                             held_outside_training=None, allocator_cache=None, outside_pytorch=None)
    mem = rep.memory or RankMemory()
    bd = rep.breakdown or {}
    b = bd.get("bytes") or {}
    flags = bd.get("flags") or {}
    dev = rep.device or RankDevice()
    cuda = dev.type == "cuda"
    cfg = rep.config or {}
    ac = flags.get("autocast") or {}
    autocast = None if ac.get("enabled") is None else (ac.get("dtype") if ac.get("enabled") else "off")
    blocks = None
    if flags.get("num_blocks") is not None:
        blocks = f"{flags.get('checkpointed_blocks', 0)}/{flags['num_blocks']} checkpointed"
    optimizer = rep.optimizer or {}
    opt = _get(optimizer, "state_bytes")  # measured by the plan's optimizer: under zero1, this rank's share
    if opt is None:
        opt = _get(b, "optimizer_state_tensors") or _get(b, "optimizer_state")
    cache = None
    if cuda and mem.peak_reserved is not None and mem.peak_allocated is not None:
        cache = int(mem.peak_reserved) - int(mem.peak_allocated)
    return RankBreakdown(
        rank=rank, status=str(rep.status), micro_batch=flags.get("micro_batch"),
        dtype=cfg.get("dtype"), autocast=autocast, blocks=blocks,
        peak_device=_int(mem.peak_device),
        capacity=_int(dev.cap_bytes) or _int(dev.capacity_bytes),
        held_at_wrap=_get(b, "held_at_wrap"), parameters=_get(b, "parameters"), gradients=_get(b, "gradients"),
        optimizer_state=opt, activations_peak=_get(b, "activations_peak"), ddp_buckets=_get(b, "ddp_buckets"),
        held_outside_training=_get(b, "held_outside_training"), allocator_cache=cache,
        outside_pytorch=_int(mem.outside_pytorch) if cuda else None,
        input_shape=flags.get("input_shape"),
        optimizer_sharding=optimizer.get("sharding"), samples_per_step=_samples_per_step(rank, cfg),
        busy_time_s=_float(rep.busy_time_s), allreduce_wait_s=_float(rep.allreduce_wait_s),
        flags={k: flags.get(k) for k in ("data_parallel", "find_unused_parameters", "num_blocks",
                                         "checkpointed_blocks", "input_numel", "output_dtype",
                                         "output_bytes", "loss_in_model")}
        | {"held_before_wrap_excluding_model": b.get("held_before_wrap_excluding_model")},
    )


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1000 * seconds:.1f} ms"


def fmt_bytes(n: float | None) -> str:
    """Bytes in the unit their size calls for (:func:`~autobalance.protocol.memory_text`)."""
    return memory_text(None if n is None else n / GIB)


def _spread(values: list[int | None]) -> tuple[int, int, int] | None:
    """(max - min, argmax, argmin) over ranks that measured the figure."""
    known = [(v, r) for r, v in enumerate(values) if v is not None]
    if len(known) < 2:
        return None
    hi, lo = max(known), min(known)
    return hi[0] - lo[0], hi[1], lo[1]


def _findings(rows: list[RankBreakdown], *, command: str, status: str, reason: str) -> list[Finding]:
    out: list[Finding] = []
    peaks = [r.peak_device for r in rows if r.peak_device]
    top_peak = max(peaks) if peaks else 0
    significant = max(MIB, int(0.02 * top_peak))

    if status == Status.OOM:
        oom = [r.rank for r in rows if r.status == Status.OOM]
        out.append(Finding(
            cause=Status.OOM, title=f"rank(s) {oom} ran out of memory at the script's own configuration",
            size_bytes=None, ranks=oom, detail=reason,
            action="autobalance searches configurations that fit: smaller micro-batches or more checkpointing "
                   "on the full rank, more on the others (same global batch)", command=command))

    extras = _spread([r.held_outside_training for r in rows])
    if extras is not None and extras[0] >= significant:
        size, hi, lo = extras
        early = rows[hi].flags.get("held_before_wrap_excluding_model") or 0
        low_early = rows[lo].flags.get("held_before_wrap_excluding_model") or 0
        detail = (f"after an optimizer step, rank {hi} holds {fmt_bytes(rows[hi].held_outside_training)} outside "
                  f"parameters, gradient buckets and optimizer state; rank {lo} holds "
                  f"{fmt_bytes(rows[lo].held_outside_training)}: memory a rank keeps for itself (an EMA copy, a "
                  "cached validation batch, metrics, a model or checkpoint loaded on one rank first).")
        if early - low_early >= significant:
            detail += f" {fmt_bytes(early - low_early)} of it was already held when plan.wrap() was entered."
        out.append(Finding(
            cause="rank_extras", title=f"rank {hi} holds {fmt_bytes(size)} more than rank {lo} outside training state "
                                       "(rank-0 extras / model loaded on one rank first)",
            size_bytes=size, ranks=[hi], detail=detail,
            action=f"autobalance gives rank {hi} fewer samples per micro-step (or checkpoints more of its blocks) "
                   "with the global batch unchanged, so every rank peaks at the same level", command=command))

    acts = _spread([r.activations_peak for r in rows])
    numels = [r.flags.get("input_numel") for r in rows]
    mbs = [r.micro_batch for r in rows]
    known = [n for n in numels if n]
    if len(known) >= 2 and max(known) > 1.05 * min(known):
        hi = max(range(len(rows)), key=lambda i: float(numels[i] or 0))
        lo = min(range(len(rows)), key=lambda i: float(numels[i] or float("inf")))
        uneven_mb = len({m for m in mbs if m is not None}) > 1
        out.append(Finding(
            cause="uneven_inputs",
            title=f"uneven inputs: rank {hi}'s first micro-batch has {max(known)} elements, rank {lo}'s {min(known)}",
            size_bytes=acts[0] if acts else None, ranks=[hi],
            detail=("micro-batch sizes differ across ranks" if uneven_mb else
                    "same micro-batch size but different input shapes "
                    f"({rows[hi].input_shape} vs {rows[lo].input_shape}): padding or sequence lengths differ per rank")
                   + "; the activation peak follows the input size.",
            action="load the data through plan.dataloader() so the ranks get the shards the configuration chooses; "
                   "autobalance then sizes each rank's micro-batch to its memory", command=command))

    ac = {r.rank: (r.autocast, r.flags.get("output_dtype")) for r in rows if r.autocast is not None}
    if len(set(ac.values())) > 1:
        described = ", ".join(f"rank {k}: autocast {a}, output {o}" for k, (a, o) in sorted(ac.items()))
        lowest = [k for k, (a, _o) in ac.items() if a == "off"] or sorted(ac)
        out.append(Finding(
            cause="amp_some_ranks", title="mixed precision is active on some ranks only",
            size_bytes=acts[0] if acts else None, ranks=lowest,
            detail=f"{described}. FP32 activations take up to 2x the memory of FP16/BF16 ones.",
            action="drop per-rank autocast and let the plan apply one dtype on every rank (plan.micro_step()); "
                   "autobalance searches the dtype with --dtypes", command=command + " --dtypes fp32,bf16"
            if " -- " not in command else command.replace(" -- ", " --dtypes fp32,bf16 -- ", 1)))

    slow = slow_rank([None if r.busy_time_s is None else 1000 * r.busy_time_s for r in rows],
                     [r.samples_per_step for r in rows])
    if slow is not None:
        fast = rows[slow.fastest]
        waits = [r for r in rows if r.allreduce_wait_s is not None and r.rank != slow.rank]
        waiting = max(waits, key=lambda r: r.allreduce_wait_s or 0.0) if waits else None
        detail = (f"{slow.text()}: per optimizer step rank {slow.rank} is busy {_ms(rows[slow.rank].busy_time_s)} for "
                  f"{rows[slow.rank].samples_per_step} samples, rank {fast.rank} {_ms(fast.busy_time_s)} for "
                  f"{fast.samples_per_step}")
        if waiting is not None:
            detail += (f"; rank {waiting.rank} waits {_ms(waiting.allreduce_wait_s)} for the other ranks each "
                       "step, rank " f"{slow.rank} {_ms(rows[slow.rank].allreduce_wait_s)}")
        detail += ". Every rank runs at the slowest one's pace (a slower GPU of a mixed machine, or a busier one)."
        out.append(Finding(
            cause="slow_rank", title=f"rank {slow.rank} is slow: {slow.ratio:.2f}x the busy time per sample of "
                                     f"rank {slow.fastest}",
            size_bytes=None, ranks=[slow.rank], detail=detail,
            action=f"autobalance tune measures each rank's speed and gives rank {slow.rank} fewer samples per step "
                   "(the global batch and the update unchanged), so the ranks finish together", command=command))

    dp = [r.rank for r in rows if r.flags.get("data_parallel")]
    if dp:
        out.append(Finding(
            cause="data_parallel", title="the model is wrapped in nn.DataParallel",
            size_bytes=None, ranks=dp,
            detail="DataParallel runs every replica from one process and gathers outputs and gradients on the "
                   "first GPU, which therefore needs far more memory than the others.",
            action="pass the bare model to plan.wrap() (one process per GPU under torchrun, DDP); "
                   "then tune it", command=command))

    fu = [r.rank for r in rows if r.flags.get("find_unused_parameters")]
    if fu:
        out.append(Finding(
            cause="find_unused_parameters", title="DDP runs with find_unused_parameters=True",
            size_bytes=None, ranks=fu,
            detail="DDP walks the autograd graph after every forward to find unused parameters: extra time each "
                   "step, and ranks that skip different branches hold different activations.",
            action="call plan.wrap(model) without find_unused_parameters unless some parameters really get no "
                   "gradient", command=command))

    deep = [r for r in rows if (r.flags.get("num_blocks") or 0) >= 8 and not r.flags.get("checkpointed_blocks")
            and r.activations_peak and r.peak_device and r.activations_peak >= 0.25 * r.peak_device]
    if deep:
        worst = max(deep, key=lambda r: r.activations_peak or 0)
        out.append(Finding(
            cause="no_checkpointing",
            title=f"no activation checkpointing on a {worst.flags.get('num_blocks')}-block model",
            size_bytes=worst.activations_peak, ranks=[r.rank for r in deep],
            detail=f"activations peak at {fmt_bytes(worst.activations_peak)} on rank {worst.rank} "
                   f"({100 * (worst.activations_peak or 0) / (worst.peak_device or 1):.0f}% of its peak) and grow "
                   "with depth.",
            action="autobalance chooses how many blocks each rank checkpoints (more on the fuller ranks)",
            command=command))

    heavy = [r for r in rows if r.optimizer_state and r.peak_device and r.optimizer_state >= 0.35 * r.peak_device]
    if heavy:
        worst = max(heavy, key=lambda r: r.optimizer_state or 0)
        out.append(Finding(
            cause="optimizer_state", title="optimizer state dominates the memory",
            size_bytes=worst.optimizer_state, ranks=[r.rank for r in heavy],
            detail=f"{fmt_bytes(worst.optimizer_state)} of optimizer state on rank {worst.rank} "
                   f"({100 * (worst.optimizer_state or 0) / (worst.peak_device or 1):.0f}% of its peak; Adam keeps "
                   "two moments per parameter).",
            action="sharding the optimizer state (ZeroRedundancyOptimizer, FSDP) is outside what autobalance "
                   "tunes; autobalance balances what remains", command=command))

    cache = [r for r in rows if r.allocator_cache and r.peak_device and r.allocator_cache >= 0.2 * r.peak_device]
    if cache:
        worst = max(cache, key=lambda r: r.allocator_cache or 0)
        out.append(Finding(
            cause="allocator_cache", title="the CUDA caching allocator holds much more than it uses",
            size_bytes=worst.allocator_cache, ranks=[r.rank for r in cache],
            detail=f"reserved minus allocated at the peak: {fmt_bytes(worst.allocator_cache)} on rank {worst.rank} "
                   "(cache and fragmentation).",
            action="try PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, then tune", command=command))

    outside = [r for r in rows if r.flags.get("loss_in_model") is False and (r.flags.get("output_bytes") or 0) >= significant]
    if outside:
        worst = max(outside, key=lambda r: r.flags.get("output_bytes") or 0)
        size = int(worst.flags.get("output_bytes") or 0)
        out.append(Finding(
            cause="loss_outside_model",
            title=f"the loss is computed outside the wrapped model: its input ({fmt_bytes(size)} per micro-batch "
                  f"on rank {worst.rank}) stays outside any compiled graph",
            size_bytes=size, ranks=[r.rank for r in outside],
            detail=f"the model's output ({worst.flags.get('output_dtype')}, {fmt_bytes(size)} at micro-batch "
                   f"{worst.micro_batch}) and any full-precision copy the loss makes of it (`logits.float()`) are "
                   "kept for the backward at full size; torch.compile cannot fuse or recompute them (a ~270M GPT "
                   "at micro-batch 16: 17.3 GiB allocated with the loss outside, 14.0 GiB inside, same step time).",
            action="pass the loss to the plan: `model = plan.wrap(model, loss=loss_fn)` and `loss = model(x, y)`, "
                   "so a compiled configuration compiles model and loss as one graph", command=command))

    # causes that make the ranks differ come before memory pressure that every rank shares
    out.sort(key=lambda f: (f.cause != Status.OOM, f.cause not in IMBALANCE_CAUSES, f.size_bytes is None,
                            -(f.size_bytes or 0)))
    return out


def analyse(outcome: TrialOutcome, *, script: str, script_args: list[str], world_size: int, device: str,
            nproc_per_node: int, memory_cap: str | None = None) -> Diagnosis:
    """From a finished diagnose run (a :class:`~autobalance.launcher.TrialOutcome`) to the diagnosis."""
    rows = [_rank_row(r, outcome.reports.get(r)) for r in range(world_size)]
    command = tune_command(script=script, script_args=script_args, nproc_per_node=nproc_per_node, device=device,
                           memory_cap=memory_cap)
    peaks = [r.peak_device for r in rows]
    spread = _spread(peaks)
    pct = None
    if spread is not None and all(r.peak_device and r.capacity for r in rows):
        fracs = [float(r.peak_device or 0) / float(r.capacity or 1) for r in rows]
        pct = round(100 * (max(fracs) - min(fracs)), 3)
    mt = {}
    noted: list[tuple[int, str]] = []
    for r in range(world_size):
        rep = outcome.reports.get(r)
        bd = (rep.breakdown if rep is not None else None) or {}
        if bd.get("memtracker_peak") or bd.get("error") or bd.get("note"):
            mt[str(r)] = {"peak_by_category": bd.get("memtracker_peak"), "error": bd.get("error"),
                          "note": bd.get("note"),
                          "modules": [{**m, "module": m["module"].replace("DistributedDataParallel.module.", "")}
                                      for m in bd.get("modules") or []]}
        if bd.get("note"):
            noted.append((r, str(bd["note"])))
    notes = [f"Module breakdown: {noted[0][1]} (rank(s) {', '.join(str(r) for r, _n in noted)})."] if noted else []
    return Diagnosis(
        script=script, script_args=list(script_args), world_size=world_size, device=device, status=outcome.status,
        reason=outcome.reason, trial_dir=outcome.trial_dir, ranks=rows,
        spread_bytes=spread[0] if spread else None, spread_pct_of_capacity=pct,
        findings=_findings(rows, command=command, status=outcome.status, reason=outcome.reason),
        tune_command=command, memtracker=mt, notes=notes,
    )


# ---------------------------------------------------------------------- running
def run_diagnose(*, script: str, script_args: list[str], nproc_per_node: int, device: str,
                 memory_cap_gib: list[float] | None, memory_cap_text: str | None, steps: int, warmup: int,
                 timeout_s: float, runs_dir: str) -> Diagnosis:
    """One short torchrun run of ``script`` at its own configuration, analysed."""
    from autobalance.launcher import TrialLaunch, run_trial

    if not os.path.isfile(script):
        raise UsageError(f"SCRIPT {script!r} does not exist; pass the path of a training script that uses autobalance.plan().")
    if nproc_per_node < 1:
        raise UsageError(f"--nproc-per-node={nproc_per_node} must be at least 1.")
    stem = os.path.splitext(os.path.basename(script))[0]
    trial_dir = os.path.abspath(os.path.join(runs_dir, "diagnose", f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"))
    caps = [int(c * GIB) for c in memory_cap_gib] if memory_cap_gib else None
    launch = TrialLaunch(
        script=script, script_args=list(script_args), nproc_per_node=nproc_per_node, device=device, config_json=None,
        steps=steps, warmup=warmup, memory_cap_bytes=caps, trial_dir=trial_dir, timeout_s=timeout_s,
        pg_timeout_s=int(max(30, min(300, timeout_s / 2))), env={_env.DIAGNOSE: "1"},
    )
    outcome = run_trial(launch)
    if outcome.status == Status.ERROR:
        raise TrialScriptError(f"the script failed at its own configuration: {outcome.reason}. Logs in {trial_dir}.",
                               traceback_text=outcome.traceback, rank=outcome.failing_rank)
    if not any(rep.breakdown for rep in outcome.reports.values()):
        raise LaunchError(
            f"the run ended with '{outcome.status}' ({outcome.reason}) before any rank measured its memory; logs in "
            f"{trial_dir}. " + ("Raise --trial-timeout." if outcome.status == Status.TIMEOUT else
                                "Check that the script calls plan.wrap() and trains through plan.steps().")
        )
    return analyse(outcome, script=script, script_args=list(script_args), world_size=nproc_per_node,
                   device=device, nproc_per_node=nproc_per_node, memory_cap=memory_cap_text)


# ---------------------------------------------------------------------- printing
_ROWS = [
    ("peak (device)", "peak_device"),
    ("capacity", "capacity"),
    ("held when wrap() entered", "held_at_wrap"),
    ("parameters", "parameters"),
    ("gradients (1st backward)", "gradients"),
    ("DDP gradient buckets", "ddp_buckets"),
    ("optimizer state", "optimizer_state"),
    ("activations (peak)", "activations_peak"),
    ("held outside training state", "held_outside_training"),
    ("allocator cache/fragmentation", "allocator_cache"),
    ("outside PyTorch (NVML)", "outside_pytorch"),
]


def print_diagnosis(diag: Diagnosis, *, console: Any = None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    table = Table(title=f"Per-rank memory of {os.path.basename(diag.script)} at its own configuration "
                        f"({diag.device}, {diag.world_size} ranks, run {diag.status})")
    table.add_column("")
    for r in diag.ranks:
        table.add_column(f"rank {r.rank}", justify="right")
    zero1 = any(r.optimizer_sharding == "zero1" for r in diag.ranks)
    for label, key in _ROWS:
        values = [getattr(r, key) for r in diag.ranks]
        if all(v is None for v in values):
            continue
        if key == "optimizer_state" and zero1:
            label = "optimizer state (zero1: its share)"
        table.add_row(label, *[fmt_bytes(v) for v in values])
    if any(r.busy_time_s is not None for r in diag.ranks):
        table.add_row("busy per step (own work)", *[_ms(r.busy_time_s) for r in diag.ranks])
        table.add_row("wait for the other ranks per step", *[_ms(r.allreduce_wait_s) for r in diag.ranks])
        table.add_row("samples per step", *["-" if r.samples_per_step is None else str(r.samples_per_step)
                                            for r in diag.ranks])
    table.add_row("micro-batch", *[str(r.micro_batch) if r.micro_batch is not None else "-" for r in diag.ranks])
    table.add_row("dtype / autocast", *[f"{r.dtype or '-'} / {r.autocast or '-'}" for r in diag.ranks])
    table.add_row("blocks", *[r.blocks or "-" for r in diag.ranks])
    table.add_row("status", *[r.status for r in diag.ranks])
    console.print(table)
    if diag.spread_bytes is not None:
        pct = f" ({diag.spread_pct_of_capacity:.2f}% of capacity)" if diag.spread_pct_of_capacity is not None else ""
        console.print(f"Spread of peaks across ranks: [bold]{fmt_bytes(diag.spread_bytes)}[/]{pct}.")
    from rich.markup import escape

    for note in diag.notes:
        console.print(f"[dim]{escape(note)}[/]")
    if not diag.findings:
        console.print("No likely cause of imbalance found. To make steps faster at the same memory: "
                      f"[bold]{diag.tune_command}[/]")
        return
    for rank, mt in sorted(diag.memtracker.items()):
        cats = mt.get("peak_by_category") or {}
        if cats:
            parts = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in cats.items() if v and k != "total")
            console.print(f"[dim]MemTracker, rank {rank} at its first-step peak: {escape(parts)}[/]")
    console.print("[bold]Likely causes, largest first (what makes the ranks differ, then what weighs on all)[/]")
    for i, f in enumerate(diag.findings, 1):
        size = f"size [bold]{fmt_bytes(f.size_bytes)}[/], " if f.size_bytes is not None else ""
        console.print(f"{i}. [bold]{escape(f.title)}[/]")
        console.print(f"   {size}rank(s) {', '.join(map(str, f.ranks))}. {escape(f.detail)}")
        console.print(f"   [green]What to do:[/] {escape(f.action)}")
        if f.command:
            console.print(f"   [green]Run:[/] {escape(f.command)}", soft_wrap=True)
    console.print(f"Reports and logs: {diag.trial_dir}")
