"""Code run in spawned processes by the concurrency tests (importable, no pytest)."""

from __future__ import annotations

import traceback
from typing import Any

SAVES_PER_WORKER = 8
SHARED_TRIAL = 999


def save_many(url: str, study_name: str, worker: int, barrier: Any, results: Any) -> None:
    """Save ``SAVES_PER_WORKER`` distinct trials and one trial every worker saves; report errors."""
    try:
        from autobalance import BalanceConfig
        from autobalance.store import ConfigStore, HardwareFingerprint

        fingerprint = HardwareFingerprint(
            device_type="cpu",
            device_name="test cpu",
            capacity_bytes=[1 << 30] * 2,
            cap_bytes=[1 << 28, 1 << 28],
            world_size=2,
        )
        shared = BalanceConfig.uniform(world_size=2, micro_batch=4)
        with ConfigStore(url=url) as store:
            barrier.wait(timeout=60)
            for i in range(SAVES_PER_WORKER):
                config = BalanceConfig(
                    micro_batches=[1 + worker, 1 + i], global_batch=2 + worker + i
                )
                store.save(
                    study_name=study_name,
                    trial_number=worker * 100 + i,
                    config=config,
                    figures={"worker": worker, "i": i},
                    fingerprint=fingerprint,
                    script_sha256="",
                    saved_by=f"worker{worker} (tune)",
                )
                if i == SAVES_PER_WORKER // 2:
                    store.save(
                        study_name=study_name,
                        trial_number=SHARED_TRIAL,
                        config=shared,
                        figures={},
                        fingerprint=fingerprint,
                        saved_by=f"worker{worker} (promote)",
                    )
                store.load(study_name)
        results.put((worker, None))
    except BaseException:
        results.put((worker, traceback.format_exc()))


def run_concurrent_saves(url: str, study_name: str, workers: int = 4) -> list[str]:
    """Run ``workers`` spawned processes of :func:`save_many`; returns their error tracebacks."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(workers)
    results = ctx.Queue()
    procs = [
        ctx.Process(target=save_many, args=(url, study_name, w, barrier, results))
        for w in range(workers)
    ]
    for p in procs:
        p.start()
    outcomes = [results.get(timeout=240) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    errors = [f"worker {w}:\n{tb}" for w, tb in outcomes if tb]
    errors += [f"worker exit code {p.exitcode}" for p in procs if p.exitcode != 0]
    return errors
