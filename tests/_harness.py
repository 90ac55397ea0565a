"""A shared pool of gloo worker processes for multi-process tests.

Spawning a rank costs an interpreter and a torch import (seconds), so each pool is
started once per test session and runs many scenarios. A scenario is a top-level
function ``fn(rank, world_size, *args)``, pickled by reference; it runs on every
rank at once with the default process group initialized (gloo, ``file://``
rendezvous in a temporary directory, one thread per rank: the rank initialisation of
:mod:`syncbn._cli.launch`, the launcher of the demo and the benchmarks). Every wait is bounded:
a scenario that does not finish in time, or that raises on any rank, makes
:meth:`WorkerPool.run` raise with every rank's traceback, and the pool is rebuilt
so that the next scenario starts from fresh processes and a fresh process group.

Tests of processes of their own (launched commands, killed launchers) use :func:`alive`
and :func:`wait_until`.
"""

from __future__ import annotations

import os
import pickle
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from syncbn._cli.launch import exit_with_parent, init_rank, launch

__all__ = ["ScenarioError", "WorkerPool", "alive", "outcome", "run_isolated", "wait_until"]

#: Process-group timeout of the pool's ranks in seconds: a collective that waits longer fails.
PROCESS_GROUP_TIMEOUT = 30.0
STARTUP_TIMEOUT = 120.0


class ScenarioError(RuntimeError):
    """A scenario raised, or did not finish in time, on at least one rank."""


def _worker_main(
    rank: int, world_size: int, init_file: str, inbox: Any, outbox: Any, pg_timeout: float
) -> None:
    # a pytest killed outright leaves no worker behind, waiting for a task forever
    exit_with_parent()
    # a daemonic worker cannot start inductor's pool of compile processes (torch 2.3 starts
    # it when inductor is imported, torch.compile with any backend imports it)
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    # inductor's scalar C++ kernels: g++ builds a graph's in about half the time of its
    # vectorized ones (tests/test_compile.py cold 265 -> 174 s on 2 cores). The ranks'
    # scenarios test what syncbn hands inductor (the order of collectives, values across
    # ranks, fusion), which no instruction set changes; the inductor tests in the pytest
    # process (tests/test_masked.py: NaN at padded positions, channels_last, a broadcast
    # mask, the first valid sample) compile vectorized kernels, as users get them
    os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")
    init_rank(rank, world_size, init_file, timeout=pg_timeout)
    outbox.put((rank, "ready", None))
    while True:
        task = inbox.get()
        if task is None:
            break
        fn, args = task
        try:
            # pickle here (plain pickle copies tensor data) so that an unpicklable result
            # is reported as this scenario's error instead of dying in the queue's thread
            outbox.put((rank, "ok", pickle.dumps(fn(rank, world_size, *args))))
        except BaseException:  # report everything, including KeyboardInterrupt in a rank
            outbox.put((rank, "error", traceback.format_exc()))
    dist.destroy_process_group()


class WorkerPool:
    """``world_size`` gloo ranks in spawned processes that run scenarios on demand.

    Args:
        world_size: number of ranks.
        pg_timeout: the process group's timeout in seconds.
    """

    def __init__(self, world_size: int, pg_timeout: float = PROCESS_GROUP_TIMEOUT):
        self.world_size = world_size
        self.pg_timeout = pg_timeout
        self._context = mp.get_context("spawn")
        self._processes: list[Any] = []
        self._inboxes: list[Any] = []
        self._outbox: Any = None
        self._tmpdir: tempfile.TemporaryDirectory[str] | None = None
        self.restarts = 0

    def _start(self) -> None:
        self._tmpdir = tempfile.TemporaryDirectory(prefix="syncbn-pool-")
        init_file = os.path.join(self._tmpdir.name, "rendezvous")
        self._outbox = self._context.Queue()
        self._inboxes = [self._context.Queue() for _ in range(self.world_size)]
        self._processes = [
            self._context.Process(
                target=_worker_main,
                args=(rank, self.world_size, init_file, inbox, self._outbox, self.pg_timeout),
                daemon=True,
            )
            for rank, inbox in enumerate(self._inboxes)
        ]
        for process in self._processes:
            process.start()
        self._collect("ready", STARTUP_TIMEOUT)

    def _collect(self, expected: str, timeout: float) -> list[Any]:
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        while len(results) + len(errors) < self.world_size:
            remaining = deadline - time.monotonic()
            dead = [r for r, p in enumerate(self._processes) if not p.is_alive()]
            if remaining <= 0 or dead:
                self.close(graceful=False)
                missing = [
                    r for r in range(self.world_size) if r not in results and r not in errors
                ]
                raise ScenarioError(
                    f"ranks {missing} did not report within {timeout:.0f}s "
                    f"(dead processes: {dead}); errors from other ranks: {errors}"
                )
            try:
                rank, status, value = self._outbox.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                continue
            if status == "error":
                errors[rank] = value
            else:
                results[rank] = pickle.loads(value) if status == "ok" else value
        if errors:
            self.close(graceful=False)
            details = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
            raise ScenarioError(f"scenario failed on ranks {sorted(errors)}:\n{details}")
        return [results[rank] for rank in range(self.world_size)]

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 60.0) -> list[Any]:
        """Run ``fn(rank, world_size, *args)`` on every rank; return the results in rank order.

        Raises:
            ScenarioError: if any rank raised or the ranks did not all finish within
                ``timeout`` seconds; the pool is rebuilt before the next run.
        """
        if not self._processes:
            if self._tmpdir is not None:
                self.restarts += 1
            self._start()
        for inbox in self._inboxes:
            inbox.put((fn, args))
        try:
            return self._collect("ok", timeout)
        except BaseException:
            # interrupted from outside (pytest-timeout, Ctrl-C): this scenario's results may
            # still arrive, and the next scenario must not read them
            if self._processes:
                self.close(graceful=False)
            raise

    def close(self, graceful: bool = True) -> None:
        """Stop every worker (politely if ``graceful``, else at once) and forget the group."""
        for inbox in self._inboxes if graceful else []:
            try:
                inbox.put(None)
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + (5.0 if graceful else 0.0)
        for process in self._processes:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
        for process in self._processes:
            if process.is_alive():
                process.kill()
                process.join(timeout=5.0)
        self._processes = []
        self._inboxes = []
        if self._tmpdir is not None:
            self._tmpdir.cleanup()


def run_isolated(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 60.0,
    pg_timeout: float = 10.0,
) -> list[tuple[str, Any]]:
    """Run ``fn(rank, world_size, *args)`` once on fresh ranks, for scenarios that break ranks.

    Every rank runs to its own end (no rank is stopped because another failed), and
    leaves without the process group's teardown, which may wait for dead peers.

    Returns:
        Per rank, ``("ok", result)``, ``("error", traceback)``, ``("dead", exitcode)`` for
        a process that died without reporting, or ``("timeout", None)`` for one still
        running after ``timeout`` seconds (it is killed).
    """
    outcomes = launch(
        fn,
        world_size,
        *args,
        timeout=timeout,
        pg_timeout=pg_timeout,
        stop_on_error=False,
        teardown=False,
    )
    return [(outcome.status, outcome.value) for outcome in outcomes]


def outcome(fn: Callable[..., Any], *args: Any) -> tuple[str, str]:
    """``("ok", "")`` if ``fn(*args)`` returns, else the exception's type name and message.

    Scenarios return this instead of raising, so that a test can check what every rank saw.
    """
    try:
        fn(*args)
    except Exception as error:  # noqa: BLE001 - the scenario reports whatever was raised
        return type(error).__name__, str(error)
    return "ok", ""


def alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (Linux: reads ``/proc``)."""
    try:
        with open(f"/proc/{pid}/stat") as file:
            return file.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_until(condition: Callable[[], object], timeout: float, what: str) -> None:
    """Poll ``condition`` until it holds; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f}s waiting until {what}")
        time.sleep(0.1)
