"""Run a function on local ranks: the one launcher of the demo, the benchmarks and the tests.

``syncbn demo``, ``syncbn bench``, ``benchmarks/run.py`` and the tests' harness all
start their ranks the same way:

- every rank is a process of the ``spawn`` start method (nothing inherited from the
  parent's state; safe with CUDA), with one intra-op thread;
- it joins the default process group through a ``file://`` rendezvous in a temporary
  directory (no port to choose, nothing reachable from outside the machine): gloo bound
  to the loopback interface, or nccl with one GPU per rank;
- results and tracebacks come back to the parent through a queue, stamped with the
  time they happened, so that the rank that failed first can be told from the ranks
  that failed because a peer disappeared;
- every wait of the parent is bounded, and every rank process still alive when
  :func:`launch` returns or raises (also on Ctrl-C) is terminated, then killed; a parent
  killed outright (``kill -9``, the out-of-memory killer) cannot do that, so each rank
  also ends itself when its parent process ends (:func:`exit_with_parent`).

torch is imported inside the functions, so importing this module is cheap (the
``syncbn`` command imports it before it knows whether a command will run).
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing
import os
import pickle
import queue
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "Outcome",
    "RankError",
    "exit_with_parent",
    "init_rank",
    "launch",
    "loopback_interface",
    "run_on_ranks",
    "sigterm_as_interrupt",
    "stop",
]

#: Seconds the parent gives ranks that reported to tear down before they are stopped.
TEARDOWN_GRACE = 10.0
# how often the parent looks at the ranks while it waits for their reports
_POLL = 0.2


@dataclass(frozen=True)
class Outcome:
    """How one rank ended.

    Attributes:
        status: ``"ok"`` (``value`` is the function's result), ``"error"`` (``value``
            is the traceback text), ``"dead"`` (``value`` is the exit code of a process
            that ended without reporting), ``"timeout"`` (still running at the
            deadline) or ``"stopped"`` (stopped after another rank failed); ``value``
            is ``None`` for the last two.
        value: see ``status``.
        time: when the rank reported (``time.time()``), ``None`` if it did not.
    """

    status: str
    value: Any = None
    time: float | None = None


class RankError(RuntimeError):
    """A rank raised or died; every rank process has been stopped.

    Attributes:
        rank: the rank that failed first.
        outcome: its :class:`Outcome`.
    """

    def __init__(self, rank: int, outcome: Outcome) -> None:
        if outcome.status == "error":
            cause = str(outcome.value).strip().splitlines()[-1]
            message = f"rank {rank} failed ({cause})"
        else:
            message = f"rank {rank} exited with code {outcome.value} without reporting"
        super().__init__(message)
        self.rank = rank
        self.outcome = outcome

    @property
    def traceback(self) -> str | None:
        """The failed rank's traceback, or ``None`` if it died without one."""
        return str(self.outcome.value) if self.outcome.status == "error" else None


def loopback_interface() -> str | None:
    """The name of the loopback network interface (``lo`` or ``lo0``), if there is one."""
    try:
        names = {name for _, name in socket.if_nameindex()}
    except (AttributeError, OSError):
        return None
    return next((name for name in ("lo", "lo0") if name in names), None)


def init_rank(
    rank: int, world_size: int, init_file: str, *, backend: str = "gloo", timeout: float = 60.0
) -> None:
    """Make this process rank ``rank`` of a default process group of ``world_size`` ranks.

    One intra-op thread; with gloo, the loopback interface (unless
    ``GLOO_SOCKET_IFNAME`` is set); with nccl, GPU ``rank % device_count``.

    Args:
        rank: this process's rank.
        world_size: number of ranks.
        init_file: the rendezvous file (``file://`` init method), the same on every rank.
        backend: ``"gloo"`` or ``"nccl"``. Default: ``"gloo"``
        timeout: the process group's timeout in seconds. Default: 60
    """
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    else:
        loopback = loopback_interface()
        if loopback is not None:  # local ranks only: keep gloo on the loopback interface
            os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback)
    dist.init_process_group(
        backend,
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout),
    )


def exit_with_parent() -> None:
    """End this process as soon as the process that started it ends.

    For a process started by :mod:`multiprocessing` (a rank of :func:`launch`, a worker of
    the tests' pool): its parent stops it when the parent returns, raises or is
    interrupted, but a parent killed outright (``kill -9``, the out-of-memory killer, a job
    manager that signals only the top process) cannot, and the process would run on,
    orphaned, to the end of its work (the 1,000,000 steps of a demo, a worker waiting
    for its next task). A daemon thread waits on the parent's sentinel, which reads as
    closed once the parent has ended, then ends this process with exit status 1 at once
    (``os._exit``: nothing waits on peers that may be gone). Does nothing in a process
    that :mod:`multiprocessing` did not start.
    """
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def wait_for_parent() -> None:
        try:
            parent.join()
            sys.stderr.write(
                f"syncbn: process {os.getpid()} exits: the process that started it "
                f"(pid {parent.pid}) has ended\n"
            )
            sys.stderr.flush()
        finally:  # also where stderr went with the parent (a terminal it held: EIO)
            os._exit(1)

    threading.Thread(target=wait_for_parent, name="syncbn-exit-with-parent", daemon=True).start()


def _rank_main(
    rank: int,
    world_size: int,
    init_file: str,
    backend: str,
    pg_timeout: float,
    teardown: bool,
    outbox: Any,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
) -> None:
    """Entry point of a spawned rank: join the group, run ``fn``, report, leave."""
    exit_with_parent()
    report: tuple[str, float, bytes | str]
    try:
        init_rank(rank, world_size, init_file, backend=backend, timeout=pg_timeout)
        # pickled here (plain pickle copies tensor data), so that an unpicklable result
        # is reported as this rank's error instead of dying in the queue's thread
        report = ("ok", time.time(), pickle.dumps(fn(rank, world_size, *args)))
    except BaseException:  # also KeyboardInterrupt and SystemExit in the rank
        report = ("error", time.time(), traceback.format_exc())
    outbox.put((rank, *report))
    # the report is in the pipe before any teardown: gloo can abort a process at exit (a
    # worker thread that releases a collective's tensors while Python finalizes), which
    # would otherwise lose a report still in the queue's feeder thread
    outbox.close()
    outbox.join_thread()
    if teardown:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    # finalize nothing (without teardown, that also skips the process group's, which may
    # wait for dead peers): gloo can abort a process whose worker thread releases a
    # collective's tensors while Python finalizes, printing "terminate called without an
    # active exception" (README, Troubleshooting); the report is sent already
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def stop(processes: Sequence[Any], grace: float = 0.0) -> None:
    """Wait up to ``grace`` seconds for ``processes`` to exit, then terminate and kill them.

    Every process is reaped before this returns.
    """
    deadline = time.monotonic() + grace
    for process in processes:
        process.join(timeout=max(0.0, deadline - time.monotonic()))
    alive = [process for process in processes if process.is_alive()]
    for process in alive:
        process.terminate()
    for process in alive:
        process.join(timeout=5.0)
    for process in alive:
        if process.is_alive():
            process.kill()
            process.join(timeout=5.0)


def _receive(outbox: Any, outcomes: dict[int, Outcome], wait: float) -> Outcome | None:
    """Store the next report (waiting up to ``wait`` seconds) in ``outcomes``; return it."""
    try:
        rank, status, stamp, value = outbox.get(timeout=wait)
    except queue.Empty:
        return None
    outcome = Outcome(status, pickle.loads(value) if status == "ok" else value, stamp)
    outcomes[rank] = outcome
    return outcome


def _collect(
    processes: Sequence[Any], outbox: Any, timeout: float | None, stop_on_error: bool
) -> dict[int, Outcome]:
    """The ranks' reports, until all have reported, one failed, or the deadline."""
    outcomes: dict[int, Outcome] = {}
    deadline = None if timeout is None else time.monotonic() + timeout
    while len(outcomes) < len(processes):
        wait = _POLL if deadline is None else min(_POLL, deadline - time.monotonic())
        if wait <= 0:
            break
        outcome = _receive(outbox, outcomes, wait)
        if outcome is None:  # a rank that reported exits with 0: anything else died before
            for rank, process in enumerate(processes):
                if rank not in outcomes and process.exitcode not in (None, 0):
                    outcomes[rank] = outcome = Outcome("dead", process.exitcode)
        if stop_on_error and outcome is not None and outcome.status != "ok":
            break
    return outcomes


def launch(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout: float | None = None,
    pg_timeout: float = 60.0,
    stop_on_error: bool = True,
    teardown: bool = True,
    on_start: Callable[[list[int]], None] | None = None,
) -> list[Outcome]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` new ranks; return how each ended.

    ``fn`` must be a top-level function (pickled by reference), and its arguments and
    result picklable. It runs with the default process group initialized (see
    :func:`init_rank`) and may destroy the group itself before it returns.

    Args:
        fn: the function every rank runs.
        world_size: number of ranks.
        *args: further arguments of ``fn``.
        backend: the process group's backend. Default: ``"gloo"``
        timeout: seconds after which the ranks still running are stopped; ``None``
            waits as long as they run. Default: ``None``
        pg_timeout: the process group's timeout in seconds. Default: 60
        stop_on_error: stop every rank as soon as one raises or dies (the others would
            wait for it until ``pg_timeout``); otherwise wait for every rank's outcome.
            Default: ``True``
        teardown: destroy the process group on every rank after ``fn``; ``False``
            leaves at once (for ranks whose peers were killed on purpose). Default: ``True``
        on_start: called with the ranks' process ids once they are all started.

    Returns:
        One :class:`Outcome` per rank, in rank order. A rank that reported an error
        and was then stopped keeps its ``"error"`` outcome.

    Raises:
        KeyboardInterrupt: on Ctrl-C, after every rank process is stopped.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be positive, got {world_size}")
    context = multiprocessing.get_context("spawn")
    outbox = context.Queue()
    processes: list[Any] = []
    earlier = set(multiprocessing.active_children())
    with tempfile.TemporaryDirectory(prefix="syncbn-ranks-") as workdir:
        init_file = os.path.join(workdir, "rendezvous")
        outcomes: dict[int, Outcome] = {}
        grace = 0.0
        try:
            for rank in range(world_size):
                process = context.Process(
                    target=_rank_main,
                    args=(rank, world_size, init_file, backend, pg_timeout, teardown, outbox)
                    + (fn, args),
                    daemon=True,
                )
                process.start()
                processes.append(process)
            if on_start is not None:
                on_start([process.pid for process in processes])
            outcomes = _collect(processes, outbox, timeout, stop_on_error)
            if len(outcomes) == world_size and all(o.status == "ok" for o in outcomes.values()):
                grace = TEARDOWN_GRACE
        finally:
            # also a rank whose start was interrupted before it was listed
            started = [p for p in multiprocessing.active_children() if p not in earlier]
            stop([*processes, *(p for p in started if p not in processes)], grace)
        # reports that arrived while the ranks were being stopped (e.g. the peers' errors)
        while _receive(outbox, outcomes, 0.05) is not None:
            pass
    failed = any(outcome.status != "ok" for outcome in outcomes.values())
    missing = "stopped" if stop_on_error and failed else "timeout"
    return [outcomes.get(rank, Outcome(missing)) for rank in range(world_size)]


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout: float | None = None,
    pg_timeout: float = 60.0,
    on_start: Callable[[list[int]], None] | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` new ranks; return their results.

    See :func:`launch` for the arguments. As soon as one rank fails, every rank is
    stopped.

    Returns:
        The ranks' results, in rank order.

    Raises:
        RankError: if a rank raised or died (the one that failed first).
        TimeoutError: if the ranks did not all finish within ``timeout`` seconds.
        KeyboardInterrupt: on Ctrl-C, after every rank process is stopped.
    """
    outcomes = launch(
        fn,
        world_size,
        *args,
        backend=backend,
        timeout=timeout,
        pg_timeout=pg_timeout,
        on_start=on_start,
    )
    errors = [(o.time or 0.0, rank) for rank, o in enumerate(outcomes) if o.status == "error"]
    if errors:
        rank = min(errors)[1]
        raise RankError(rank, outcomes[rank])
    for rank, outcome in enumerate(outcomes):
        if outcome.status == "dead":
            raise RankError(rank, outcome)
    if any(outcome.status != "ok" for outcome in outcomes):
        raise TimeoutError(f"{world_size} ranks did not finish within {timeout or 0:.0f} s")
    return [outcome.value for outcome in outcomes]


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Turn SIGTERM into KeyboardInterrupt while the ranks run (main thread only), so that
    ``timeout``, a job scheduler or ``kill`` stop the ranks and end the command as Ctrl-C
    does (exit code 130), with nothing left running."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
