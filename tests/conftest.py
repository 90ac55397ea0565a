"""Session-wide setup: inductor's vector instruction set in the pytest process, the
fixtures of one pool of 2 gloo ranks and one of 3, shared by every test, and the groups
that keep them one under pytest-xdist (:mod:`_xdist_groups`)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from _harness import WorkerPool
from _xdist_groups import pytest_collection_modifyitems

import syncbn

__all__ = ["no_checks_left_pending", "pool", "pool2", "pool3", "pytest_collection_modifyitems"]


def pytest_configure(config: pytest.Config) -> None:
    """Inductor's vectorized kernels in the pytest process, for the instruction set that
    torch reports the CPU has, without its build-and-load probe of each (an ``avx512``
    machine probes four: 14 s of g++ the first time, 2 s of subprocesses in every
    process). The probe picks the same set here; ``TORCHINDUCTOR_VEC_ISA_OK`` set by
    the caller still decides. The pool's ranks and the launched examples compile
    scalar kernels (``tests/_harness.py``): spawned, they start from torch's defaults."""
    if "TORCHINDUCTOR_VEC_ISA_OK" not in os.environ:
        import torch._inductor.config as inductor_config

        inductor_config.cpp.vec_isa_ok = True


def _pool(world_size: int) -> Iterator[WorkerPool]:
    pool = WorkerPool(world_size)
    try:
        yield pool
    finally:
        # at once: no scenario is left to run, and a polite stop waited for each rank's
        # process group and interpreter teardown (4.6-7.5 s for both pools)
        pool.close(graceful=False)


@pytest.fixture(scope="session")
def pool2() -> Iterator[WorkerPool]:
    """Two gloo ranks."""
    yield from _pool(2)


@pytest.fixture(scope="session")
def pool3() -> Iterator[WorkerPool]:
    """Three gloo ranks."""
    yield from _pool(3)


@pytest.fixture(params=[2, 3], ids=["world2", "world3"])
def pool(request: pytest.FixtureRequest) -> WorkerPool:
    """Each of the two pools in turn."""
    return request.getfixturevalue(f"pool{request.param}")


@pytest.fixture
def no_checks_left_pending() -> Iterator[None]:
    """The test reads the deferred checks its calls left (raising any problem they found),
    so that none is pending for a later test of the same process: modules whose tests run
    deferred checks in the pytest process use it (``pytestmark``).
    ``test_faults.py::test_check_deferred_returns_at_once_with_nothing_pending`` failed
    when it ran after ``test_op_budget.py``, and on torch 2.10 (2026-12-07) after
    ``test_kernels_finalize.py``, whose Triton tests run where Triton is installed."""
    yield
    syncbn.check_deferred()
