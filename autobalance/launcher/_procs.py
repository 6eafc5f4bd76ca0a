"""Process-tree bookkeeping: find every process of a trial and make sure none outlives it.

torchrun starts each worker in its own session, so killing torchrun's process group misses the
workers. Every process of a trial carries ``AUTOBALANCE_TRIAL_ID=<id>`` in its environment; the
reaper finds them by that marker (and by parentage), and the tuner is a child subreaper so that
orphaned workers are re-parented to it rather than to init.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from autobalance import _env

__all__ = ["become_subreaper", "interrupts_deferred", "kill_trial_processes", "parent_death_signal",
           "trial_processes"]

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


@functools.cache
def _libc() -> Any:
    """libc, loaded once in the parent: a child must not dlopen between fork and exec (another
    thread of the tuner may hold the loader's lock at the fork)."""
    import ctypes

    try:
        return ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return None


def _prctl(option: int, value: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    libc = _libc()
    return libc is not None and libc.prctl(option, value, 0, 0, 0) == 0


def become_subreaper() -> bool:
    """Orphaned descendants are re-parented to this process (Linux only)."""
    return _prctl(_PR_SET_CHILD_SUBREAPER, 1)


def parent_death_signal(sig: int = signal.SIGTERM) -> None:
    """For ``preexec_fn``: the child gets ``sig`` when its parent (the tuner) dies."""
    _prctl(_PR_SET_PDEATHSIG, sig)


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[None]:
    """Hold back SIGINT and SIGTERM while a trial's processes are being killed; one that arrived
    meanwhile is raised as KeyboardInterrupt afterwards (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    signals = (signal.SIGINT, signal.SIGTERM)
    previous = {sig: signal.signal(sig, lambda signum, _frame: held.append(signum)) for sig in signals}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if held and sys.exc_info()[0] is None:
        raise KeyboardInterrupt


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except OSError:
        return b""


def _state_and_ppid(pid: int) -> tuple[str, int]:
    stat = _read(f"/proc/{pid}/stat").decode(errors="replace")
    if not stat:
        return "", -1
    rest = stat[stat.rfind(")") + 2 :].split()
    return rest[0], int(rest[1])


def _all_pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def trial_processes(trial_id: str, *, roots: tuple[int, ...] = (), include_zombies: bool = False) -> list[int]:
    """Live processes of a trial: those whose environment carries its marker, plus descendants of ``roots``."""
    marker = f"{_env.TRIAL_ID}={trial_id}".encode()
    me = os.getpid()
    found: set[int] = set()
    parents: dict[int, int] = {}
    for pid in _all_pids():
        if pid == me:
            continue
        state, ppid = _state_and_ppid(pid)
        if not state or (state == "Z" and not include_zombies):
            continue
        parents[pid] = ppid
        if marker in _read(f"/proc/{pid}/environ").split(b"\0"):
            found.add(pid)
    frontier = set(roots) & set(parents)
    found |= frontier
    while frontier:
        frontier = {pid for pid, ppid in parents.items() if ppid in frontier and pid not in found}
        found |= frontier
    return sorted(found)


def _reap(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, os.WNOHANG)


def kill_trial_processes(trial_id: str, *, roots: tuple[int, ...] = (), grace_s: float = 5.0) -> list[int]:
    """SIGTERM the roots (torchrun forwards it to its workers), wait ``grace_s``, then SIGKILL
    everything of the trial that is left; returns the pids that had to be SIGKILLed."""
    for pid in roots:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        _reap(list(roots))
        if not trial_processes(trial_id, roots=roots):
            return []
        time.sleep(0.1)
    killed: list[int] = []
    for _ in range(50):
        left = trial_processes(trial_id, roots=roots)
        if not left:
            break
        for pid in left:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
        time.sleep(0.1)
        _reap(left)
    _reap(list(roots))
    return sorted(set(killed))
