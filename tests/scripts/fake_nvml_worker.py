"""The warm worker with a fake NVML installed first (CPU tests of the carry-over bookkeeping):

    torchrun ... tests/scripts/fake_nvml_worker.py [--no-recycle] SCRIPT [ARGS...]
"""

from __future__ import annotations

import sys

import fake_nvml  # this script's directory is on sys.path

from autobalance.runtime import _carryover, _worker

if __name__ == "__main__":
    fake_nvml.install()
    args = sys.argv[1:]
    if args[:1] == ["--no-recycle"]:  # a worker that is never recycled: shows what recycling prevents
        _carryover.RECYCLE_MARGIN_BYTES = 2**62
        args = args[1:]
    _worker.main(args)
