"""How a test script's hold that gave up fails: loudly (tests/scripts/faulty.py AB_HOLD_FIRST_LAUNCH,
tests/scripts/pinned.py AB_PINNED_OVERLAP). Imported by those scripts from their own directory."""

from __future__ import annotations

import os
import sys
from typing import NoReturn

HOLD_TIMED_OUT = "hold-timed-out.txt"
"""Written in the trial's directory by a hold that gave up (tests.tune_helpers.assert_no_hold_timed_out)."""
HOLD_EXIT_CODE = 3


def hold_timed_out(script: str, message: str) -> NoReturn:
    """A hold whose condition never came: the order the test relies on did not happen, so carrying
    on would let the test pass on luck. Say so in ``<trial dir>/hold-timed-out.txt`` (the tests
    check it first, naming the cause) and on stderr, and end this rank with exit code 3."""
    line = f"{script}: hold timed out: {message}"
    trial = os.environ.get("AUTOBALANCE_TRIAL_DIR")
    if trial:
        with open(os.path.join(trial, HOLD_TIMED_OUT), "a") as fh:
            fh.write(line + "\n")
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
    os._exit(HOLD_EXIT_CODE)  # not SystemExit: nothing (a warm worker's script runner) may swallow it
