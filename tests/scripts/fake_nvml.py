"""A fake NVML for the CPU tests of the warm worker's carry-over bookkeeping.

It imitates what one H200 showed (see the field notes): a fresh process holds a context
(``CONTEXT``); the first step of any trial loads the eager kernels every trial uses (``EAGER``,
once per process, as CUDA's lazy loading does); a compiled trial loads its own kernels
(``COMPILED``), which stay loaded for the life of the process. A cold run of a configuration
therefore holds ``CONTEXT + EAGER (+ COMPILED if compiled)`` outside PyTorch.
"""

from __future__ import annotations

import torch

from autobalance.runtime._memory import DeviceProbe, DeviceReading

MIB = 2**20
CONTEXT = 500 * MIB
EAGER = 200 * MIB
COMPILED = 300 * MIB


def cold_outside(*, compiled: bool) -> int:
    return CONTEXT + EAGER + (COMPILED if compiled else 0)


class FakeNvml(DeviceProbe):
    """Process-wide fake: kernels accumulate across trials, as they do in a real warm worker."""

    def __init__(self) -> None:
        self.eager_loaded = False
        self.compiled_trials: set[str] = set()
        self.allocated = 0
        """Bytes the fake allocator holds (a test sets it to imitate tensors a script kept)."""

    def read(self) -> DeviceReading:
        from autobalance.runtime import _plan

        plan = _plan.CURRENT_PLAN
        if plan is not None and plan.trial_id:  # a trial is running: reads come after its steps
            self.eager_loaded = True
            if plan.config.compile != "off":
                self.compiled_trials.add(plan.trial_id)
        used = CONTEXT + (EAGER if self.eager_loaded else 0) + COMPILED * len(self.compiled_trials)
        return DeviceReading(used=used + self.allocated, reserved=self.allocated, allocated=self.allocated,
                             scope="fake")


FAKE = FakeNvml()


def install() -> None:
    from autobalance.runtime import _memory

    _memory.install_probe_factory(lambda device: FAKE if isinstance(device, torch.device) else None)
