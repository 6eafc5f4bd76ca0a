"""The warm worker's carry-over bookkeeping (issue: warm trials measured as cold ones).

Unit tests drive :class:`CarryoverLedger` with scripted readings; the pool tests run real torchrun
warm pools on CPU whose workers read a fake NVML that grows between trials as a GPU worker's does
(``tests/scripts/fake_nvml.py``), with a compiled trial (``aot_eager_decomp_partition``) between
eager ones.
"""

from __future__ import annotations

import time

import pytest

from autobalance import BalanceConfig
from autobalance.launcher import TrialLaunch, WarmPool, trial_processes
from autobalance.runtime._carryover import (
    RECYCLE_MARGIN_BYTES,
    CarryoverLedger,
    clean_between_trials,
)
from autobalance.runtime._memory import DeviceProbe, DeviceReading
from tests.tune_helpers import GPT, REPO

MIB = 2**20
FAKE_WORKER = str(REPO / "tests" / "scripts" / "fake_nvml_worker.py")


class Scripted(DeviceProbe):
    def __init__(self) -> None:
        self.used = 0
        self.reserved = 0
        self.allocated = 0

    def read(self) -> DeviceReading:
        return DeviceReading(used=self.used, reserved=self.reserved, allocated=self.allocated, scope="fake")


def test_first_eager_trial_sets_the_reference_and_a_compiled_trial_that_leaves_kernels_recycles():
    probe = Scripted()
    probe.used = 500 * MIB
    ledger = CarryoverLedger(probe=probe)
    ledger.pool_started()
    warm = ledger.trial_starting()
    assert warm["pool_trial"] == 1 and warm["fresh_outside"] == 500 * MIB and warm["inherited_outside"] == 0
    probe.used = 700 * MIB  # the eager trial loaded kernels every trial loads: not a leftover
    after = ledger.trial_finished(compiled=False)
    assert after["recycle"] is None and ledger.settled_outside == 700 * MIB
    warm = ledger.trial_starting()
    assert warm["reference_outside"] == 700 * MIB and warm["inherited_outside"] == 0
    probe.used = 1000 * MIB  # the compiled trial's kernels stay loaded
    after = ledger.trial_finished(compiled=True)
    assert after["recycle"] is not None and "compiled trial left 300 MiB" in after["recycle"]
    assert after["after_outside"] == 1000 * MIB


def test_small_growth_is_kept_and_growth_past_the_margin_recycles():
    probe = Scripted()
    probe.used = 500 * MIB
    ledger = CarryoverLedger(probe=probe)
    ledger.pool_started()
    ledger.trial_starting()
    probe.used = 700 * MIB
    ledger.trial_finished(compiled=False)
    ledger.trial_starting()
    probe.used = 700 * MIB + RECYCLE_MARGIN_BYTES  # exactly the margin: kept
    assert ledger.trial_finished(compiled=True)["recycle"] is None
    warm = ledger.trial_starting()
    assert warm["inherited_outside"] == RECYCLE_MARGIN_BYTES and warm["start_outside"] == 700 * MIB + RECYCLE_MARGIN_BYTES
    probe.used += 1  # one byte more, by an eager trial: recycled too
    assert "trials left" in (ledger.trial_finished(compiled=False)["recycle"] or "")


def test_a_compiled_first_trial_is_judged_against_the_fresh_worker():
    probe = Scripted()
    probe.used = 500 * MIB
    ledger = CarryoverLedger(probe=probe)
    ledger.pool_started()
    ledger.trial_starting()
    probe.used = 900 * MIB
    after = ledger.trial_finished(compiled=True)
    assert "over a fresh worker" in after["recycle"] and ledger.settled_outside is None


def test_tensors_or_segments_left_in_the_allocator_recycle():
    probe = Scripted()
    probe.used = 500 * MIB
    ledger = CarryoverLedger(probe=probe)
    ledger.pool_started()
    ledger.trial_starting()
    probe.allocated = probe.reserved = 200 * MIB  # a module-level cache the script kept
    probe.used = 700 * MIB + 200 * MIB
    after = ledger.trial_finished(compiled=False)
    assert "200 MiB of tensors outlived the trial" in after["recycle"]
    assert "reserved" not in after["recycle"]  # the segments hold those tensors: said once
    ledger2 = CarryoverLedger(probe=probe)
    probe.allocated, probe.reserved, probe.used = 0, 0, 500 * MIB
    ledger2.pool_started()
    ledger2.trial_starting()
    probe.reserved, probe.used = 100 * MIB, 800 * MIB
    assert "kept 100 MiB reserved" in ledger2.trial_finished(compiled=False)["recycle"]


def test_without_a_probe_nothing_is_decided_and_nothing_is_claimed():
    ledger = CarryoverLedger(probe=None)
    ledger.pool_started()
    warm = ledger.trial_starting()
    assert warm["fresh_outside"] is None and warm["inherited_outside"] is None
    assert ledger.trial_finished(compiled=True)["recycle"] is None


def test_clean_between_trials_drops_a_cycle_holding_tensors_on_cpu():
    import gc
    import weakref

    import torch

    class Holder:
        pass

    a, b = Holder(), Holder()
    a.other, b.other = b, a  # a cycle: only the collector frees it
    a.tensor = torch.ones(1000)
    ref = weakref.ref(a.tensor)
    gc.disable()
    try:
        del a, b
        assert ref() is not None
        clean_between_trials("cpu")
        assert ref() is None
    finally:
        gc.enable()


# ----------------------------------------------------------------------------- warm pools on CPU
EAGER = BalanceConfig(micro_batches=[4, 4], global_batch=8)
COMPILED = BalanceConfig(micro_batches=[4, 4], global_batch=8, compile="default", activation_budget=[0.5, 0.5])
FAST_COMPILE = {"AUTOBALANCE_COMPILE_BACKEND": "aot_eager_decomp_partition"}


def _sequence(tmp_path, pool: WarmPool, template: TrialLaunch, configs):
    outcomes = []
    for i, cfg in enumerate(configs):
        fields = {**template.__dict__, "config_json": cfg.to_json()}
        outcome = pool.run(TrialLaunch(**{**fields, "trial_dir": str(tmp_path / f"t{i}"), "trial_id": f"t{i}-{time.time()}"}))
        assert outcome.status == "ok", outcome.reason
        outcomes.append(outcome)
    return outcomes


@pytest.mark.slow
@pytest.mark.parametrize("margin_recycles", [True, False])
def test_warm_pool_charges_each_trial_what_a_cold_run_holds(tmp_path, margin_recycles):
    """eager, compiled, eager in one pool with a fake NVML: the pool restarts after the compiled
    trial, so the eager trial after it is charged what a cold run holds; a worker that is not
    recycled (margin too large to trigger) would charge it the compiled trial's kernels."""
    import tests.scripts.fake_nvml as fake

    template = TrialLaunch(script=GPT, nproc_per_node=2, device="cpu", trial_dir=str(tmp_path), timeout_s=240,
                           steps=2, warmup=1, env=dict(FAST_COMPILE))
    worker = (FAKE_WORKER,) if margin_recycles else (FAKE_WORKER, "--no-recycle")
    pool = WarmPool(template=template, pool_dir=str(tmp_path / "pool"), worker=worker)
    try:
        outcomes = _sequence(tmp_path, pool, template, [EAGER, COMPILED, EAGER])
        pool_id = pool.pool_id
    finally:
        pool.close()
    assert trial_processes(pool_id) == []
    for outcome in outcomes:
        assert set(outcome.reports) == {0, 1}
    outside = [[rep.memory.outside_pytorch for rep in o.reports.values()] for o in outcomes]
    warm = [o.reports[0].warm for o in outcomes]
    assert [w["pool_trial"] for w in warm] == ([1, 2, 1] if margin_recycles else [1, 2, 3])
    assert outside[0] == [fake.cold_outside(compiled=False)] * 2
    assert outside[1] == [fake.cold_outside(compiled=True)] * 2
    assert warm[1]["compiled"] is True and warm[0]["compiled"] is False
    for o in outcomes:  # every trial records its measured steps and their spread
        for rep in o.reports.values():
            assert rep.measured_steps == 2 and len(rep.step_times_s) == 2
            assert rep.step_time_iqr_s is not None and rep.step_time_iqr_s >= 0
    # the compiled trial's compiling step is reported apart from its steady state; the trial's peak
    # (what the constraint judges) is the larger of the two
    for rep in outcomes[1].reports.values():
        mem = rep.memory
        first, steady = mem.compile_step, mem.steady
        assert first is not None and steady is not None
        assert mem.peak_device == max(first["peak_reserved"], steady["peak_reserved"]) + max(
            first["outside_pytorch"], steady["outside_pytorch"])
        assert first["outside_pytorch"] == steady["outside_pytorch"] == fake.cold_outside(compiled=True)
    assert all(rep.memory.compile_step is None for o in (outcomes[0], outcomes[2]) for rep in o.reports.values())
    if margin_recycles:
        assert pool.starts == 2 and outcomes[1].recycled is not None
        assert "compiled trial left 300 MiB" in outcomes[1].recycled
        assert outside[2] == [fake.cold_outside(compiled=False)] * 2  # what a cold run holds
        assert warm[2]["inherited_outside"] == 0
    else:
        assert pool.starts == 1 and outcomes[1].recycled is None
        # the bug this guards against: an eager trial charged the compiled trial's kernels
        assert outside[2] == [fake.cold_outside(compiled=False) + fake.COMPILED] * 2
        assert warm[2]["inherited_outside"] == fake.COMPILED
