"""Property-based parity: random shapes, splits (empty ones too) and options, float64.

Each example runs on the shared pool (2 or 3 ranks) and is compared with torch's BatchNorm
on the global batch by the same gold comparison as the hand-picked cases. Examples are
derandomized (the same ones every run) and bounded in number.
"""

from __future__ import annotations

import math

from _gold import Case, compare, reference, run_rank
from _harness import WorkerPool
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

_SETTINGS = settings(
    max_examples=25,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@st.composite
def cases(draw: st.DrawFn, world_size: int) -> Case:
    ndim = draw(st.integers(2, 5))
    channels = draw(st.integers(1, 4))
    spatial = tuple(draw(st.lists(st.integers(1, 3), min_size=ndim - 2, max_size=ndim - 2)))
    sizes = tuple(draw(st.lists(st.integers(0, 3), min_size=world_size, max_size=world_size)))
    assume(sum(sizes) * math.prod(spatial) >= 2)  # training needs more than 1 value per channel
    return Case(
        sizes=sizes,
        tail=(channels, *spatial),
        affine=draw(st.booleans()),
        track_running_stats=draw(st.booleans()),
        momentum=draw(st.sampled_from([None, 0.1, 0.5, 1.0])),
        eps=draw(st.sampled_from([1e-5, 1e-3])),
        channels_last=ndim in (4, 5) and draw(st.booleans()),
        steps=2,
        seed=draw(st.integers(0, 2**16)),
        offset=draw(st.sampled_from([0.0, 3.0, -50.0])),
        scale=draw(st.sampled_from([1.0, 0.1, 7.0])),
    )


def _check(pool: WorkerPool, case: Case) -> None:
    compare(case, pool.run(run_rank, case), reference(case))


@_SETTINGS
@given(data=st.data())
def test_random_cases_match_batchnorm_on_two_ranks(pool2: WorkerPool, data: st.DataObject) -> None:
    _check(pool2, data.draw(cases(2)))


@_SETTINGS
@given(data=st.data())
def test_random_cases_match_batchnorm_on_three_ranks(
    pool3: WorkerPool, data: st.DataObject
) -> None:
    _check(pool3, data.draw(cases(3)))
