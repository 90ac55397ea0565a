"""syncbn._cli.launch: results in rank order, the first failure, the deadline."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

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
