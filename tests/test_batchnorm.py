"""SyncBatchNorm on 2 and 3 gloo ranks equals torch's BatchNorm on the global batch."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch
from _gold import Case, compare, reference, run_rank
from _harness import WorkerPool
from torch import nn

from syncbn import _autograd, _protocol

# (world 2 sizes, world 3 sizes): uneven, and one rank empty
SIZES: dict[int, list[tuple[int, ...]]] = {2: [(3, 1), (0, 4)], 3: [(2, 0, 3), (1, 1, 1)]}

CASES = {
    "1d-NC": Case(sizes=(), tail=(5,)),
    "1d-NCL": Case(sizes=(), tail=(3, 7)),
    "2d": Case(sizes=(), tail=(3, 4, 5)),
    "3d": Case(sizes=(), tail=(2, 3, 2, 4)),
    "affine-false": Case(sizes=(), affine=False),
    "bias-false": Case(sizes=(), bias=False),
    "no-running-stats": Case(sizes=(), track_running_stats=False),
    "momentum-none": Case(sizes=(), momentum=None, steps=4),
    "channels-last-2d": Case(sizes=(), channels_last=True),
    "channels-last-3d": Case(sizes=(), tail=(2, 3, 2, 4), channels_last=True),
    "float32": Case(sizes=(), dtype="float32", tail=(4, 6, 6)),
    "float32-channels-last": Case(sizes=(), dtype="float32", tail=(4, 6, 6), channels_last=True),
    "bfloat16-float32-params": Case(
        sizes=(), dtype="bfloat16", param_dtype="float32", tail=(4, 6, 6)
    ),
    "float16-float32-params": Case(
        sizes=(), dtype="float16", param_dtype="float32", tail=(4, 6, 6)
    ),
    "offset-scale": Case(sizes=(), offset=3.0, scale=5.0, eps=1e-3),
}


#: torch < 2.2 has no CPU float16 batch_norm; test_errors checks what a call raises there
_NEEDS_CPU_FLOAT16 = pytest.mark.skipif(
    not _autograd._CPU_FLOAT16, reason="torch < 2.2 has no float16 batch_norm on the CPU"
)


#: the reference for bias=False: torch's layers take it from torch 2.13
_NEEDS_BIAS_ARGUMENT = pytest.mark.skipif(
    "bias" not in inspect.signature(nn.BatchNorm1d.__init__).parameters,
    reason="torch's BatchNorm takes bias=False from torch 2.13",
)


def _params(names: list[str]) -> list[object]:
    marks = {
        name: [_NEEDS_CPU_FLOAT16] * (CASES[name].dtype == "float16")
        + [_NEEDS_BIAS_ARGUMENT] * (not CASES[name].bias)
        for name in names
    }
    return [pytest.param(name, marks=marks[name]) for name in names]


@pytest.mark.parametrize("sizes_index", [0, 1], ids=["uneven", "with-empty"])
@pytest.mark.parametrize("name", _params(list(CASES)))
def test_gold_matches_batchnorm_on_global_batch(
    pool: WorkerPool, name: str, sizes_index: int
) -> None:
    sizes = SIZES[pool.world_size][sizes_index]
    case = dataclasses.replace(CASES[name], sizes=sizes)
    per_rank = pool.run(run_rank, case)
    compare(case, per_rank, reference(case))


# The deferred checks (the default on accelerators) keep the global count on the device and
# update running statistics with device-side factors: the same results, through other code.
DEFERRED = [
    "2d",
    "momentum-none",
    "no-running-stats",
    "float32-channels-last",
    "float16-float32-params",
]


@pytest.mark.parametrize("sizes_index", [0, 1], ids=["uneven", "with-empty"])
@pytest.mark.parametrize("name", _params(DEFERRED))
def test_gold_with_deferred_checks(pool: WorkerPool, name: str, sizes_index: int) -> None:
    sizes = SIZES[pool.world_size][sizes_index]
    case = dataclasses.replace(CASES[name], sizes=sizes, extra={"check_mode": "deferred"})
    per_rank = pool.run(run_rank, case)
    compare(case, per_rank, reference(case))


@_NEEDS_CPU_FLOAT16
@pytest.mark.parametrize("check_mode", ["immediate", "deferred"])
def test_a_cumulative_average_in_float16_keeps_moving_past_65504_batches(check_mode: str) -> None:
    """``momentum=None`` with float16 running statistics: the factor ``1 / (n + 1)`` is
    computed in float64 and rounded once. Rounded to float16 first, ``n + 1`` became inf
    past 65504 batches and the factor 0, with checks deferred (as on accelerators)."""
    options = _autograd.TrainOptions(
        _autograd.LocalReducer(),
        _autograd.LayerInfo("cumulative", 3, check_mode=check_mode),
        momentum=None,
    )
    x = torch.tensor([1.0, 3.0]).repeat(4, 3, 5).to(torch.float16)  # mean 2 per channel
    running_mean = torch.zeros(3, dtype=torch.float16)
    running_var = torch.ones(3, dtype=torch.float16)
    counted = torch.tensor(70000)
    _autograd.sync_batch_norm_train(
        x,
        None,
        None,
        options,
        running_mean=running_mean,
        running_var=running_var,
        num_batches_tracked=counted,
    )
    _protocol.raise_deferred(wait=True)
    assert int(counted) == 70001
    expected = torch.full((3,), 2.0 / 70001)
    torch.testing.assert_close(running_mean.float(), expected, rtol=1e-2, atol=0)
