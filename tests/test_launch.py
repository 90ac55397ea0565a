"""syncbn._cli.launch: results in rank order, the first failure, the deadline."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

import pytest
import torch
import torch.distributed as dist
from _harness import alive, wait_until

from syncbn._cli.launch import RankError, launch, run_on_ranks


def _sum_of_ranks(rank: int, world_size: int, offset: int) -> tuple[int, int, int]:
    total = torch.tensor([rank + offset])
    dist.all_reduce(total)
    return rank, world_size, int(total)


def _rank_one_fails(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("rank 1 gives up")
    dist.barrier()  # waits for rank 1 until the parent stops this rank


def _sleeps(rank: int, world_size: int) -> int:
    time.sleep(60)
    return os.getpid()


#: parents of two processes that print their pids (after "pids:") and wait: ranks of
#: ``launch`` that sleep (this module's ``_sleeps``), and the tests' pool of workers
#: between two tasks
_PARENTS = {
    "launch": """
import sys
sys.path.insert(0, sys.argv[1])
from test_launch import _sleeps
from syncbn._cli.launch import launch
launch(_sleeps, 2, on_start=lambda pids: print("pids:", *pids, flush=True))
""",
    "test pool": """
import os, sys, time
sys.path.insert(0, sys.argv[1])
from _harness import WorkerPool
from test_launch import _pid
print("pids:", *WorkerPool(2).run(_pid), flush=True)
time.sleep(60)
""",
}


def _pid(rank: int, world_size: int) -> int:
    return os.getpid()


def _printed_pids(stdout: IO[str]) -> list[int]:
    """The pids a parent of :data:`_PARENTS` printed. Its ranks share its stdout, and on
    torch 2.8-2.10 gloo prints there when a rank connects ("[Gloo] Rank 0 is connected to
    1 peer ranks ..."), which came first (2026-12-07)."""
    for line in stdout:
        if line.startswith("pids:"):
            return [int(pid) for pid in line.split()[1:]]
    return []  # the parent ended without printing them


def test_results_come_back_in_rank_order() -> None:
    assert run_on_ranks(_sum_of_ranks, 2, 10) == [(0, 2, 21), (1, 2, 21)]


def test_the_failing_rank_is_reported_and_every_rank_stopped() -> None:
    pids: list[int] = []
    started = time.monotonic()
    with pytest.raises(RankError, match=r"rank 1 failed \(ValueError: rank 1 gives up\)") as info:
        run_on_ranks(_rank_one_fails, 2, pg_timeout=60.0, on_start=pids.extend)
    assert time.monotonic() - started < 30  # not the 60 s that rank 0's barrier would wait
    assert info.value.rank == 1
    assert info.value.traceback is not None and "_rank_one_fails" in info.value.traceback
    assert len(pids) == 2
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_ranks_past_the_deadline_are_stopped() -> None:
    started = time.monotonic()
    outcomes = launch(_sleeps, 2, timeout=1.0, stop_on_error=False, teardown=False)
    assert [outcome.status for outcome in outcomes] == ["timeout", "timeout"]
    assert time.monotonic() - started < 40
    with pytest.raises(TimeoutError, match="2 ranks did not finish within 1 s"):
        run_on_ranks(_sleeps, 2, timeout=1.0)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize(
    "parent, stderr_kind",
    [("launch", "file"), ("test pool", "file"), ("launch", "closed pipe")],
)
def test_ranks_end_when_their_launcher_is_killed(
    tmp_path: Path, parent: str, stderr_kind: str
) -> None:
    """A launcher killed outright cannot stop its ranks: they end themselves, within
    seconds, instead of sleeping out their 60 s (or a demo's 1,000,000 steps), and the
    pool's workers instead of waiting for a next task forever. Also where their stderr
    went with the launcher (``closed pipe``: writing the reason fails, as on a terminal
    that a killed pytest held)."""
    log = tmp_path / "ranks.log"
    with open(log, "w") as file:
        launcher = subprocess.Popen(
            [sys.executable, "-c", _PARENTS[parent], str(Path(__file__).parent)],
            stdout=subprocess.PIPE,
            stderr=file if stderr_kind == "file" else subprocess.PIPE,
            text=True,
            # where the killed launcher's rendezvous directory is left (it cannot remove it)
            env={**os.environ, "TMPDIR": str(tmp_path)},
        )
    pids: list[int] = []
    try:
        assert launcher.stdout is not None
        pids = _printed_pids(launcher.stdout)
        assert len(pids) == 2, log.read_text()
        if launcher.stderr is not None:
            launcher.stderr.close()
        launcher.kill()
        launcher.wait(timeout=10)
        # (30 s: the ranks may still be importing torch)
        wait_until(lambda: not any(map(alive, pids)), 30, "the ranks have ended")
    finally:
        launcher.kill()
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
    if stderr_kind == "file":
        reason = f"(pid {launcher.pid}) has ended"
        assert log.read_text().count(reason) == 2, log.read_text()
