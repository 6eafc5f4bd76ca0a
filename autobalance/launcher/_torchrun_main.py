"""torchrun as the launcher starts it: ``python -m torch.distributed.run``, without the teardown.

The same arguments, output and exit code: an exception (torchrun's ``ChildFailedError``, the
``SignalException`` it raises on SIGTERM) is printed as Python prints an uncaught one and the exit
code is 1 (130 for ``KeyboardInterrupt``). But once torchrun's own clean-up has run (its workers
gone, its log files closed) and its logging is flushed, the process ends with ``os._exit``: the
teardown of an interpreter that imported torch cost about 0.45 s of CPU and 0.6 s of wall time per
job on a 2-core machine (``benchmarks/2026-12-02-cpu/torchrun_teardown.txt``), which every trial paid
after its ranks had finished.
"""

from __future__ import annotations

import logging
import os
import sys
import traceback


def exit_code(value: object) -> int:
    """The exit status ``sys.exit(value)`` gives (a message is printed to stderr, status 1)."""
    if value is None:
        return 0
    if isinstance(value, int):
        return value
    sys.stderr.write(f"{value}\n")
    return 1


def main() -> None:
    code = 0
    try:
        from torch.distributed.run import main as torchrun

        torchrun()
    except SystemExit as exc:
        code = exit_code(exc.code)
    except KeyboardInterrupt:
        traceback.print_exc()
        code = 130
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    main()
