"""Which balance configuration a rank applies, and where it came from.

First match wins: a trial's ``AUTOBALANCE_CONFIG`` (or the script's defaults for the baseline
trial); a ``config=``, ``config_file=`` or ``study=`` argument; ``AUTOBALANCE_CONFIG_FILE`` or
``AUTOBALANCE_STUDY`` (+ ``AUTOBALANCE_STORAGE``); the script's defaults. A stored configuration is
read and checked against this machine on rank 0 only and broadcast as JSON, so every rank applies
the same row and a failure is raised on every rank.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch
import torch.distributed as dist

from autobalance import _env
from autobalance._config import DTYPES, BalanceConfig, split_evenly
from autobalance._errors import ConfigError

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


def _load_stored(
    *,
    study: str | None,
    storage: str | None,
    config_file: str | None,
    on_mismatch: str,
    device: torch.device,
    world_size: int,
    cap_bytes: int | None,
) -> tuple[BalanceConfig, str]:
    """The saved best configuration, read on rank 0 and broadcast so all ranks apply the same row."""
    from autobalance import store

    text: str | None = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            saved = store.load_saved_config(study=study, storage=storage, config_file=config_file)
            nnodes = max(1, world_size // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", world_size))))
            current = store.current_fingerprint(
                device_type=device.type,
                world_size=world_size,
                nnodes=nnodes,
                cap_bytes=[cap_bytes] * world_size,
            )
            script = sys.argv[0] if sys.argv and os.path.isfile(sys.argv[0]) else None
            store.check_compatibility(saved, current=current, script_path=script, policy=on_mismatch)
            source = f"store:{saved.study_name}#{saved.trial_number}"
            text = json.dumps({"config": saved.config.to_dict(), "source": source})
            # one plain line on rank 0: where this job's configuration comes from and what it applies
            # (micro-batches per optimizer step; rank 0: 6,6,5,5,5,5; rank 1: ...)
            where = (f"{config_file} (study {saved.study_name}, trial {saved.trial_number})" if config_file else
                     f"study {saved.study_name}, trial {saved.trial_number} "
                     f"({store.mask_url(storage or store.DEFAULT_STORAGE)})")
            print(f"autobalance: using {where}: micro-batches per optimizer step {saved.config.split_text()}",
                  file=sys.stderr, flush=True)
        except Exception as exc:
            text = json.dumps({"failure": str(exc), "kind": type(exc).__name__})
    shared = json.loads(_broadcast_json(text, device=device))
    if "failure" in shared:
        import autobalance._errors as errors

        kind = getattr(errors, shared["kind"], None)
        if not (isinstance(kind, type) and issubclass(kind, errors.AutobalanceError)):
            kind = errors.StorageError
        raise kind(shared["failure"])
    return BalanceConfig.from_dict(shared["config"]), shared["source"]


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
) -> tuple[BalanceConfig, str]:
    """The configuration this rank applies and its source (``trial``, ``argument``, ``store:...``, ``defaults``).
    Outside a trial, rank 0 prints one line naming a stored source or, when there is none, the script's
    own configuration."""
    if in_trial:
        raw = os.environ.get(_env.CONFIG)
        return (BalanceConfig.from_json(raw), "trial") if raw else (defaults, "defaults")
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
        )
    if not dist.is_initialized() or dist.get_rank() == 0:  # one plain line on rank 0, as for a stored one
        print("autobalance: using the script's own configuration (no stored configuration: set AUTOBALANCE_STUDY "
              "and AUTOBALANCE_STORAGE, or AUTOBALANCE_CONFIG_FILE, or pass study= to plan()): micro-batches per "
              f"optimizer step {defaults.split_text()}", file=sys.stderr, flush=True)
    return defaults, "defaults"
