"""tests/_harness.py itself: a scenario interrupted from outside cannot leak into the next."""

from __future__ import annotations

import os
import signal
import time
from types import FrameType

import pytest
from _harness import WorkerPool


class _Interrupted(Exception):
    """What pytest-timeout's signal method raises, in effect."""


def _slow_pid(rank: int, world_size: int, seconds: float) -> tuple[str, int]:
    time.sleep(seconds)
    return "slow", os.getpid()


def _fast_pid(rank: int, world_size: int) -> tuple[str, int]:
    return "fast", os.getpid()


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="needs signal.setitimer")
def test_an_interrupted_scenario_does_not_leak_into_the_next() -> None:
    """Before, the pool stayed up after an interruption (pytest-timeout) and the next
    scenario read the interrupted one's results."""

    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise _Interrupted

    pool = WorkerPool(1)
    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        assert pool.run(_fast_pid)[0][0] == "fast"  # started
        signal.setitimer(signal.ITIMER_REAL, 0.5)
        with pytest.raises(_Interrupted):
            pool.run(_slow_pid, 2.0, timeout=30.0)
        signal.setitimer(signal.ITIMER_REAL, 0)
        [(kind, _)] = pool.run(_fast_pid, timeout=60.0)
        assert kind == "fast"
        assert pool.restarts == 1
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        pool.close()
