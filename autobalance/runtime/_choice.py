"""Which balance configuration a rank applies, and where it came from.

First match wins: a trial's ``AUTOBALANCE_CONFIG`` (or the script's defaults for the baseline
trial); a ``config=``, ``config_file=`` or ``study=`` argument; ``AUTOBALANCE_CONFIG_FILE`` or
``AUTOBALANCE_STUDY`` (+ ``AUTOBALANCE_STORAGE``); the script's defaults. A stored configuration is
read and checked against this machine on rank 0 only and broadcast as JSON, so every rank applies
the same row and a failure is raised on every rank. Every rank's device identity is gathered first
(``device_identity``), so when the tuned devices come up in another rank order the configuration is
permuted to follow them (``store.rank_order``: a function of the names alone) and the job says so.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch
import torch.distributed as dist

from autobalance import _env
from autobalance._config import DTYPES, BalanceConfig, describe_config, split_evenly
from autobalance._errors import ConfigError
from autobalance.runtime._emulate import device_identity

__all__ = ["choose_config", "default_config"]


def default_config(
    *,
    world_size: int,
    micro_batch: int,
    accumulation: int,
    dtype: str,
    checkpoint: int | list[int] | None,
    bucket_cap_mb: float,
    gradient_as_bucket_view: bool,
    global_batch: int | None,
) -> BalanceConfig:
    """The script's own configuration: ``micro_batch`` on every rank, or ``global_batch`` split evenly."""
    blocks = list(range(checkpoint)) if isinstance(checkpoint, int) else list(checkpoint or [])
    if dtype not in DTYPES:
        raise ConfigError(f"dtype={dtype!r} is unknown; use one of {', '.join(DTYPES)}.")
    if global_batch is None:
        return BalanceConfig.uniform(
            world_size=world_size,
            micro_batch=micro_batch,
            accumulation=accumulation,
            dtype=dtype,
            checkpoint=blocks,
            bucket_cap_mb=bucket_cap_mb,
            gradient_as_bucket_view=gradient_as_bucket_view,
        )
    if global_batch % accumulation or global_batch // accumulation < world_size:
        accumulation = 1
    if global_batch < world_size:
        raise ConfigError(
            f"global_batch={global_batch} is smaller than the {world_size} ranks; use at least one sample per rank."
        )
    return BalanceConfig(
        micro_batches=split_evenly(global_batch // accumulation, [1.0] * world_size),
        accumulation=accumulation,
        global_batch=global_batch,
        checkpoint=[list(blocks) for _ in range(world_size)],
        dtype=dtype,
        bucket_cap_mb=bucket_cap_mb,
        gradient_as_bucket_view=gradient_as_bucket_view,
    )


def _broadcast_json(payload: str | None, *, device: torch.device) -> str:
    """Rank 0's JSON text to every rank (as bytes in a tensor: nothing is pickled)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        assert payload is not None
        return payload
    dev = device if device.type == "cuda" else torch.device("cpu")
    data = (payload or "").encode()
    size = torch.tensor([len(data)], dtype=torch.long, device=dev)
    dist.broadcast(size, src=0)
    buf = torch.zeros(int(size.item()), dtype=torch.uint8, device=dev)
    if dist.get_rank() == 0:
        buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    dist.broadcast(buf, src=0)
    return bytes(buf.cpu().tolist()).decode()


def _gather_text(text: str, *, device: torch.device) -> list[str]:
    """Every rank's ``text``, index = rank (bytes in padded tensors: nothing is pickled); called by
    every rank. Without a process group (or with one rank): ``[text]``."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [text]
    dev = device if device.type == "cuda" else torch.device("cpu")
    data = text.encode()
    size = torch.tensor([len(data)], dtype=torch.long, device=dev)
    sizes = [torch.zeros_like(size) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, size)
    longest = max(int(s.item()) for s in sizes)
    buf = torch.zeros(longest, dtype=torch.uint8, device=dev)
    if data:
        buf[: len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    bufs = [torch.zeros_like(buf) for _ in sizes]
    dist.all_gather(bufs, buf)
    return [bytes(b.cpu().tolist()[: int(n.item())]).decode() for b, n in zip(bufs, sizes, strict=True)]


def _say(line: str) -> None:
    """One plain line on stderr (rank 0 calls it): no warning machinery, so no echo of a source line."""
    print(line, file=sys.stderr, flush=True)


def _load_stored(
    *,
    study: str | None,
    storage: str | None,
    config_file: str | None,
    on_mismatch: str,
    device: torch.device,
    world_size: int,
    cap_bytes: int | None,
    defaults: BalanceConfig,
    trial: _env.TrialEnv | None = None,
) -> tuple[BalanceConfig, str]:
    """The saved best configuration, read on rank 0 and broadcast so all ranks apply the same row.

    One saved for another number of ranks cannot apply: under the ``warn`` policy the job falls back to
    the script's own configuration and says so in one line; under ``error`` it stops with one line."""
    from autobalance import store

    rank = dist.get_rank() if dist.is_initialized() else 0
    # every rank's device, gathered before rank 0 reads the store: the configuration follows the devices
    names = _gather_text(device_identity(device, rank, trial), device=device)
    text: str | None = None
    if rank == 0:
        try:
            saved = store.load_saved_config(study=study, storage=storage, config_file=config_file)
            where = (f"{config_file} (study {saved.study_name}, trial {saved.trial_number})" if config_file else
                     f"study {saved.study_name}, trial {saved.trial_number} "
                     f"({store.mask_url(storage or store.DEFAULT_STORAGE)})")
            nnodes = max(1, world_size // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", world_size))))
            current = store.current_fingerprint(
                device_type=device.type,
                world_size=world_size,
                nnodes=nnodes,
                cap_bytes=[cap_bytes] * world_size,
                device_names=names if len(names) == world_size else None,
            )
            other_ranks = store.ranks_differ(saved, world_size=world_size)
            if other_ranks and on_mismatch == "warn":
                _say(f"autobalance: {other_ranks}: using the script's own configuration instead (run the job with "
                     f"{saved.config.world_size} ranks to use the study's, or tune one with {world_size}): "
                     f"{describe_config(defaults)}")
                text = json.dumps({"config": defaults.to_dict(), "source": "defaults"})
            else:
                text = _checked(saved, store=store, current=current, on_mismatch=on_mismatch, where=where)
        except Exception as exc:
            text = json.dumps({"failure": str(exc), "kind": type(exc).__name__})
    shared = json.loads(_broadcast_json(text, device=device))
    if "failure" in shared:
        import autobalance._errors as errors

        kind = getattr(errors, shared["kind"], None)
        if shared["kind"] == "HardwareMismatchWarning":  # made an error by the script's warning filters
            kind = errors.HardwareMismatchError
        if not (isinstance(kind, type) and issubclass(kind, errors.AutobalanceError)):
            kind = errors.StorageError
        raise kind(shared["failure"])
    return BalanceConfig.from_dict(shared["config"]), shared["source"]


def _checked(saved: Any, *, store: Any, current: Any, on_mismatch: str, where: str) -> str:
    """Check ``saved`` against this job (raises under ``error``), say in one line where the job's
    configuration comes from and what it applies, and return it as JSON for the broadcast. The
    mismatch warnings become one plain line each (a ``HardwareMismatchWarning`` to Python's filters,
    without the echo of the line that raised it); an emulated cap this job runs without is no
    mismatch: the line says it."""
    import dataclasses
    import warnings

    script = sys.argv[0] if sys.argv and os.path.isfile(sys.argv[0]) else None
    order = store.rank_order(saved.fingerprint, current)
    if order is not None:  # the same devices in another rank order: each rank takes its device's configuration
        saved = dataclasses.replace(saved, config=saved.config.permuted(order),
                                    fingerprint=saved.fingerprint.permuted(order))
    with warnings.catch_warnings(record=True) as caught:
        store.check_compatibility(saved, current=current, script_path=script, policy=on_mismatch)
    lifted = store.cap_lifted_note(saved.fingerprint, current)
    _say(f"autobalance: using {where}" + (f", {lifted}" if lifted else "") + f": {describe_config(saved.config)}")
    if order is not None:
        _say(f"autobalance: {store.rank_order_line(order, current)}")
    for warning in caught:
        _say(str(warning.message))
    source = f"store:{saved.study_name}#{saved.trial_number}"
    return json.dumps({"config": saved.config.to_dict(), "source": source})


def choose_config(
    *,
    in_trial: bool,
    defaults: BalanceConfig,
    config: BalanceConfig | dict[str, Any] | str | None,
    config_file: str | None,
    study: str | None,
    storage: str | None,
    on_mismatch: str,
    device: torch.device,
    world_size: int,
    cap_bytes: int | None,
    trial_config: str | None = None,
    trial: _env.TrialEnv | None = None,
) -> tuple[BalanceConfig, str]:
    """The configuration this rank applies and its source (``trial``, ``argument``, ``store:...``, ``defaults``).
    Outside a trial, rank 0 prints one line naming a stored source or, when there is none, the script's
    own configuration. ``trial_config``: a trial's ``AUTOBALANCE_CONFIG`` (``TrialEnv.config_json``);
    ``trial``: the variables ``plan()`` read, which name this rank's device (None: this process's)."""
    if in_trial:
        return (BalanceConfig.from_json(trial_config), "trial") if trial_config else (defaults, "defaults")
    if config is not None:
        if isinstance(config, BalanceConfig):
            return config, "argument"
        if isinstance(config, str):
            return BalanceConfig.from_json(config), "argument"
        return BalanceConfig.from_dict(config), "argument"
    file_ = config_file or (None if study else os.environ.get(_env.CONFIG_FILE))
    study_ = study or (None if config_file else os.environ.get(_env.STUDY))
    if file_ or study_:
        return _load_stored(
            study=study_,
            storage=storage or os.environ.get(_env.STORAGE),
            config_file=file_,
            on_mismatch=on_mismatch,
            device=device,
            world_size=world_size,
            cap_bytes=cap_bytes,
            defaults=defaults,
            trial=trial,
        )
    if not dist.is_initialized() or dist.get_rank() == 0:  # one plain line on rank 0, as for a stored one
        _say("autobalance: using the script's own configuration (no stored configuration: set AUTOBALANCE_STUDY "
             "and AUTOBALANCE_STORAGE, or AUTOBALANCE_CONFIG_FILE, or pass study= to plan()): "
             f"{describe_config(defaults)}")
    return defaults, "defaults"
