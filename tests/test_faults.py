"""One rank's problem becomes a prompt error on every rank; an empty global batch is no error.

Regression tests of the correctness issue: an exception in one rank's local computation
(forward or backward) and one rank's failure in precise BN reach the other ranks well
inside the process group's timeout; a global count of 0 behaves like torch.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from _harness import PROCESS_GROUP_TIMEOUT, WorkerPool, outcome
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import syncbn
from syncbn import _compiled, _protocol, distributed
from syncbn._kernels import generic

#: the pool's process-group timeout: a rank left waiting fails only after it
PG_TIMEOUT = PROCESS_GROUP_TIMEOUT


def _timed(fn: Any) -> dict[str, Any]:
    start = time.monotonic()
    kind, message = outcome(fn)
    return {"kind": kind, "message": message, "seconds": time.monotonic() - start}


# --- an exception in one rank's local part -----------------------------------------------------


class _SimulatedOutOfMemory(RuntimeError):
    pass


def _simulated_out_of_memory(*args: Any) -> Any:
    raise _SimulatedOutOfMemory("CUDA out of memory (simulated)")


def _local_exception(rank: int, world_size: int, phase: str) -> dict[str, Any]:
    """Rank 0's local maths raises in ``phase`` (the kernel is patched for this call only)."""
    bn = syncbn.convert_sync_batchnorm(nn.Sequential(nn.BatchNorm2d(3)))
    x = torch.randn(2 + rank, 3, 4, 4, requires_grad=True)
    kernel = "local_moments" if phase == "forward" else "backward_reduce"
    original = getattr(generic, kernel)
    y = bn(x) if phase == "backward" else None
    if rank == 0:
        setattr(generic, kernel, _simulated_out_of_memory)
    try:
        result = _timed(lambda: bn(x) if y is None else y.sum().backward())
    finally:
        setattr(generic, kernel, original)
    # the group still works afterwards
    result["after"] = outcome(lambda: bn(torch.randn(2, 3, 4, 4)).sum().backward())
    return result


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_exception_in_local_maths_reaches_every_rank_promptly(pool: WorkerPool, phase: str) -> None:
    """Before the fix the other ranks waited for the process-group timeout (30 s in the pool);
    the scenario's own bound (20 s) would then fail this test."""
    failing, *others = pool.run(_local_exception, phase, timeout=20.0)
    assert failing["kind"] == "_SimulatedOutOfMemory", failing
    for other in others:
        assert other["kind"] == "RuntimeError", other
        assert f"1 other rank(s) failed in their SyncBatchNorm call in {phase}" in other["message"]
        assert "SyncBatchNorm layer '0' (num_features=3" in other["message"]
        assert other["seconds"] < PG_TIMEOUT / 2
    for result in [failing, *others]:
        assert result["after"] == ("ok", "")


# --- an empty global batch ---------------------------------------------------------------------


def _with_running_stats(bn: Any) -> Any:
    with torch.no_grad():
        bn.running_mean.fill_(0.25)
        bn.running_var.fill_(2.0)
    return bn


def _all_empty(rank: int, world_size: int) -> dict[str, Any]:
    bn = _with_running_stats(syncbn.SyncBatchNorm(3, momentum=None, dtype=torch.float64))
    x = torch.randn(0, 3, 4, 5, dtype=torch.float64).contiguous(memory_format=torch.channels_last)
    x.requires_grad_()
    y = bn(x)
    y.sum().backward()
    assert x.grad is not None
    # then a normal call: the cumulative average counts the empty call, as BatchNorm does
    z = torch.randn(2, 3, 4, 5, dtype=torch.float64)
    bn(z)
    return {
        "shape": tuple(y.shape),
        "dtype": y.dtype,
        "channels_last": y.is_contiguous(memory_format=torch.channels_last),
        "grads": (x.grad.shape, bn.weight.grad.clone(), bn.bias.grad.clone()),
        "state": {k: v.clone() for k, v in bn.state_dict().items()},
        "z": z,
    }


def test_empty_global_batch_behaves_like_batchnorm(pool: WorkerPool) -> None:
    results = pool.run(_all_empty)
    reference = _with_running_stats(nn.BatchNorm2d(3, momentum=None, dtype=torch.float64))
    x = torch.randn(0, 3, 4, 5, dtype=torch.float64).contiguous(memory_format=torch.channels_last)
    x.requires_grad_()
    y = reference(x)
    y.sum().backward()
    reference(torch.cat([r["z"] for r in results]))
    for result in results:
        assert result["shape"] == (0, 3, 4, 5) and result["dtype"] == torch.float64
        assert result["channels_last"]
        grad_shape, grad_weight, grad_bias = result["grads"]
        assert grad_shape == (0, 3, 4, 5)
        assert torch.equal(grad_weight, torch.zeros(3, dtype=torch.float64))
        assert torch.equal(grad_bias, torch.zeros(3, dtype=torch.float64))
        for key, value in reference.state_dict().items():
            torch.testing.assert_close(result["state"][key], value, rtol=1e-12, atol=1e-12)
    assert int(results[0]["state"]["num_batches_tracked"]) == 2


# Ports of PyTorch's c10d tests test_sync_batch_norm_only_empty_input and
# test_sync_batch_norm_empty_input (test/distributed/test_c10d_nccl.py, which run on 2 GPUs with
# torch.nn.SyncBatchNorm), rewritten for CPU ranks and syncbn: a model whose only layer is a
# converted BatchNorm2d, wrapped in DDP; first rank 0 alone gets an empty batch, then every rank
# does; with and without an input that requires grad. Outputs and parameter gradients must hold
# no NaN, and with all ranks empty the output is empty.
def _c10d_empty_inputs(rank: int, world_size: int, wrap_first: bool) -> list[dict[str, Any]]:
    model: nn.Module = nn.Sequential(nn.BatchNorm2d(2))
    if wrap_first:  # as in the c10d test: DDP first, then convert the wrapped model
        model = syncbn.convert_sync_batchnorm(DistributedDataParallel(model))
    else:
        model = DistributedDataParallel(syncbn.convert_sync_batchnorm(model))
    model.train()
    records = []
    for shape in [(1 if rank != 0 else 0, 2, 11, 13), (0, 2, 11, 13)]:
        for requires_grad in (True, False):
            x = torch.zeros(shape, requires_grad=requires_grad)
            y = model(x)
            y.sum().backward()
            records.append(
                {
                    "shape": tuple(y.shape),
                    "output_nan": bool(y.isnan().any()),
                    "grad_nan": any(
                        p.grad is not None and bool(p.grad.isnan().any())
                        for p in model.parameters()
                    ),
                }
            )
            model.zero_grad()
    return records


@pytest.mark.parametrize("wrap_first", [True, False], ids=["ddp-then-convert", "convert-then-ddp"])
def test_c10d_empty_input_ports(pool2: WorkerPool, wrap_first: bool) -> None:
    for rank, records in enumerate(pool2.run(_c10d_empty_inputs, wrap_first)):
        for index, record in enumerate(records):
            assert not record["output_nan"] and not record["grad_nan"], (rank, index, record)
            all_empty = index >= 2
            expected_batch = 0 if all_empty or rank == 0 else 1
            assert record["shape"] == (expected_batch, 2, 11, 13)


def _count_one(rank: int, world_size: int) -> tuple[str, str]:
    bn = syncbn.SyncBatchNorm(3)
    return outcome(bn, torch.randn(1 if rank == 0 else 0, 3))


def test_global_count_of_exactly_one_still_raises_on_every_rank(pool: WorkerPool) -> None:
    for kind, message in pool.run(_count_one):
        assert kind == "ValueError"
        assert message.startswith("Expected more than 1 value per channel when training")


# --- precise BN: small local batches and failures -------------------------------------------------


def _precise_model() -> Any:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.ReLU(), nn.BatchNorm1d(3)).double()


def _precise_batches(rank: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(rank)
    sizes = [[1, 1, 3], [1], [0, 1, 2, 1]][rank]  # batches of one sample, one rank with one batch
    return [torch.randn(n, 4, generator=gen, dtype=torch.float64) * 3 + 2 for n in sizes]


def _precise_small_batches(rank: int, world_size: int) -> dict[str, torch.Tensor]:
    model = syncbn.convert_sync_batchnorm(_precise_model())
    syncbn.recompute_statistics(model, _precise_batches(rank))
    return {k: v.clone() for k, v in model.state_dict().items() if "running" in k}


def test_precise_bn_accepts_batches_of_one_sample(pool3: WorkerPool) -> None:
    results = pool3.run(_precise_small_batches)
    model = _precise_model()
    batches = [b for rank in range(3) for b in _precise_batches(rank)]
    syncbn.recompute_statistics(model, batches)  # one process, every batch
    # and by hand: the first layer's inputs are the linear layer's outputs over all samples
    with torch.no_grad():
        first = model[0](torch.cat(batches))
    var, mean = torch.var_mean(first, dim=0, correction=1)
    torch.testing.assert_close(model[1].running_mean, mean, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(model[1].running_var, var, rtol=1e-12, atol=1e-12)
    for result in results:
        for key, value in model.state_dict().items():
            if "running" in key:
                torch.testing.assert_close(result[key], value, rtol=1e-12, atol=1e-12)


def _loader_that_raises(rank: int) -> Any:
    yield torch.randn(4, 4, dtype=torch.float64)
    raise OSError("corrupt record (simulated)")


def _precise_failure(rank: int, world_size: int, fault: str) -> dict[str, Any]:
    model = syncbn.convert_sync_batchnorm(_precise_model())
    batches: Any = [torch.randn(3, 4, dtype=torch.float64) for _ in range(3)]
    if rank == 0:
        if fault == "shape":
            batches[1] = torch.randn(3, 5, dtype=torch.float64)
        elif fault == "non-finite":
            batches[2][1, 0] = float("inf")
        elif fault == "loader":
            batches = _loader_that_raises(rank)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = _timed(lambda: syncbn.recompute_statistics(model, batches))
    result["unchanged"] = all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    return result


@pytest.mark.parametrize("fault", ["shape", "non-finite", "loader"])
def test_precise_bn_failure_on_one_rank_reaches_every_rank(pool2: WorkerPool, fault: str) -> None:
    failing, other = pool2.run(_precise_failure, fault, timeout=20.0)
    assert failing["unchanged"] and other["unchanged"]
    if fault == "non-finite":  # found in the summed moments: the same error on every rank
        for result in (failing, other):
            assert result["kind"] == "ValueError"
            assert "layer '1' contain non-finite values" in result["message"]
    else:
        assert failing["kind"] == ("RuntimeError" if fault == "shape" else "OSError"), failing
        assert other["kind"] == "RuntimeError", other
        assert "1 other rank(s) of the process group failed" in other["message"]
    assert other["seconds"] < PG_TIMEOUT / 2


def _precise_uneven_loaders(rank: int, world_size: int) -> dict[str, torch.Tensor]:
    model = _precise_model()  # plain BatchNorm: precise BN still pools over ranks
    gen = torch.Generator().manual_seed(rank)
    batches = [torch.randn(3, 4, generator=gen, dtype=torch.float64) for _ in range(rank * 3)]
    syncbn.recompute_statistics(model, iter(batches))
    inputs = torch.cat([torch.empty(0, 4, dtype=torch.float64), *batches])
    return {"mean": model[1].running_mean.clone(), "batches": inputs}


def test_precise_bn_loaders_of_different_lengths(pool2: WorkerPool) -> None:
    results = pool2.run(_precise_uneven_loaders)
    model = _precise_model()
    with torch.no_grad():
        first = model[0](torch.cat([r["batches"] for r in results]))
    for result in results:
        torch.testing.assert_close(result["mean"], first.mean(0), rtol=1e-12, atol=1e-12)


# --- deferred checks (the default on accelerators), exercised on CPU ----------------------------


def _deferred_problems(rank: int, world_size: int, problem: str) -> dict[str, Any]:
    first, second = syncbn.SyncBatchNorm(3), syncbn.SyncBatchNorm(3)
    for layer in (first, second):
        layer.check_mode = "deferred"
    x = torch.randn(4, 3)
    first(x), second(x)  # a good step
    model = nn.ModuleDict({"first": first, "second": second})
    before = {k: v.clone() for k, v in model.state_dict().items()}
    if problem == "order":
        bad = outcome(lambda: (second if rank % 2 else first)(x))
    else:  # a global count of one
        bad = outcome(lambda: first(torch.randn(1 if rank == 0 else 0, 3)))
    # running statistics and num_batches_tracked (which moved before the fix) of both layers
    moved = {k: not torch.equal(v, before[k]) for k, v in model.state_dict().items()}
    later = outcome(lambda: first(x))  # the next call surfaces it, on every rank
    return {"bad": bad, "moved": moved, "later": later}


def assert_deferred_problem_surfaced(result: dict[str, Any], problem: str) -> None:
    """What :func:`_deferred_problems` must return on every rank (also for
    tests/test_kernels_finalize.py)."""
    assert result["bad"] == ("ok", "")  # deferred: the call itself does not read back
    assert not any(result["moved"].values()), result["moved"]  # masked on the device
    kind, message = result["later"]
    assert message.startswith("(deferred check) ")
    if problem == "order":
        assert kind == "RuntimeError" and "layer mismatch in forward" in message
        assert "(num_features=3, call 1)" in message  # the call where it went wrong
    else:
        assert kind == "ValueError" and "Expected more than 1 value per channel" in message


@pytest.mark.parametrize("problem", ["order", "count"])
def test_deferred_check_surfaces_at_the_next_call(pool2: WorkerPool, problem: str) -> None:
    for result in pool2.run(_deferred_problems, problem):
        assert_deferred_problem_surfaced(result, problem)


@contextlib.contextmanager
def _backward_sums_fail(when: Callable[[], bool]) -> Iterator[None]:
    """The local backward sums raise ``MemoryError`` while ``when()``: the generic
    kernels', and Triton's where tests/test_kernels_finalize.py has turned them on (and so
    imported them)."""
    with contextlib.ExitStack() as patches:
        for name in ("syncbn._kernels.generic", "syncbn._kernels.triton_passes"):
            if name in sys.modules:
                module = sys.modules[name]

                def reduce(*args: Any, _original: Any = module.backward_reduce) -> Any:
                    if when():
                        raise MemoryError("simulated: out of memory in backward")
                    return _original(*args)

                patches.enter_context(mock.patch.object(module, "backward_reduce", reduce))
        yield


def _problem_of_the_last_call(
    rank: int, world_size: int, problem: str, compiled: bool = False
) -> dict[str, Any]:
    """:func:`_deferred_problems`' bad call is the run's last synchronized call: no later
    call raises it, :func:`syncbn.check_deferred` does. Then nothing is left to raise, and
    good calls check clean. ``compiled``: the layers under ``torch.compile`` (aot_eager),
    whose ``syncbn::`` ops defer their checks alike."""
    torch._dynamo.reset()
    first: Any = syncbn.SyncBatchNorm(3)
    second: Any = syncbn.SyncBatchNorm(3)
    for layer in (first, second):
        layer.check_mode = "deferred"
    if compiled:
        first, second = (
            torch.compile(m, fullgraph=True, backend="aot_eager") for m in (first, second)
        )
    x = torch.randn(4, 3)
    first(x), second(x)  # a good step
    if problem == "order":
        bad = outcome(lambda: (second if rank % 2 else first)(x))
    elif problem == "count":
        bad = outcome(lambda: first(torch.randn(1 if rank == 0 else 0, 3)))
    else:  # rank 1 runs out of memory in the final backward; the others finish theirs
        leaf = x.clone().requires_grad_()  # an input gradient: backward's collective
        with _backward_sums_fail(lambda: rank == 1):
            bad = outcome(lambda: first(leaf).square().sum().backward())
    checked = outcome(syncbn.check_deferred)
    again = outcome(syncbn.check_deferred)  # the inspected checks are forgotten
    first(x).sum().backward()
    clean = outcome(syncbn.check_deferred)
    return {"bad": bad, "checked": checked, "again": again, "clean": clean}


#: a compiled case: its scenario compiles with ``fullgraph=True``, which needs torch >= 2.4
_FULLGRAPH = pytest.mark.skipif(
    not _compiled.FULLGRAPH, reason="fullgraph compile needs torch >= 2.4"
)


@pytest.mark.parametrize(
    ("problem", "compiled"),
    [
        ("order", False),
        ("count", False),
        ("backward", False),
        pytest.param("order", True, marks=_FULLGRAPH),
        pytest.param("count", True, marks=_FULLGRAPH),
    ],
    ids=["order", "count", "backward", "order-compiled", "count-compiled"],
)
def test_check_deferred_raises_the_last_calls_problem(
    pool2: WorkerPool, problem: str, compiled: bool
) -> None:
    """After the last step, ``syncbn.check_deferred()`` raises on every rank what that
    step's deferred checks found (a rank whose own call failed raised there, and has
    nothing pending), once; good calls then check clean."""
    for rank, result in enumerate(pool2.run(_problem_of_the_last_call, problem, compiled)):
        assert result["again"] == result["clean"] == ("ok", ""), (rank, result)
        if problem == "backward" and rank == 1:
            assert result["bad"][0] == "MemoryError", result
            assert result["checked"] == ("ok", ""), result
            continue
        assert result["bad"] == ("ok", ""), (rank, result)  # deferred: not read at the call
        kind, message = result["checked"]
        assert message.startswith("(deferred check) "), (rank, message)
        if problem == "order":
            assert kind == "RuntimeError" and "layer mismatch in forward" in message
        elif problem == "count":
            assert kind == "ValueError" and "Expected more than 1 value per channel" in message
        else:
            assert kind == "RuntimeError", message
            assert "1 other rank(s) failed in their SyncBatchNorm call in backward" in message


def test_check_deferred_returns_at_once_with_nothing_pending(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Immediate checks (the CPU's default) leave nothing pending, even for a call that
    raised at once: the function has nothing to wait for or raise. (From an empty queue:
    what tests before it in the process left is not this test's subject.)"""
    monkeypatch.setattr(_protocol, "_pending", collections.deque())
    layer = syncbn.SyncBatchNorm(3)
    mask = torch.tensor([[True, False], [False, False]])
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        layer(torch.randn(2, 3, 2), mask=mask)  # one valid position: raised at the call
    layer(torch.randn(4, 3, 2), mask=torch.ones(4, 2, dtype=torch.bool)).sum().backward()
    assert not _protocol._pending
    syncbn.check_deferred()


def _caught_failure_then_training(rank: int, world_size: int, where: str) -> list[str]:
    """Four steps of three deferred-check layers; at step 1 rank 1 fails (an input the
    second layer refuses, or out of memory in the last layer's backward) and both ranks
    catch it. What each step ended with."""
    converted = syncbn.convert_sync_batchnorm(nn.Sequential(*[nn.BatchNorm1d(4) for _ in range(3)]))
    layers = list(converted.children())
    for layer in layers:
        assert isinstance(layer, syncbn.SyncBatchNorm)
        layer.check_mode = "deferred"
    step = 0
    ended = []
    with _backward_sums_fail(lambda: where == "backward" and step == 1 and rank == 1):
        for step in range(4):
            x = torch.randn(5, 4)
            try:
                hidden = layers[0](x)
                if where == "forward" and step == 1 and rank == 1:
                    hidden = hidden.double()  # the next layer refuses it
                layers[2](layers[1](hidden)).square().sum().backward()
                ended.append("ok")
            except (MemoryError, RuntimeError) as error:
                ended.append(type(error).__name__)
    return ended


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_deferred_checks_recover_after_a_caught_failure(pool2: WorkerPool, where: str) -> None:
    """A rank that learns of another rank's failure from a deferred check raises before its
    next collective, without joining it: the failing rank has left the step already, and
    joining would pair every later collective with the wrong call (the step after a caught
    error then never succeeded, or mismatched sizes aborted both processes)."""
    for rank, ended in enumerate(pool2.run(_caught_failure_then_training, where, timeout=60.0)):
        assert_recovered_after_step_1(rank, ended)


def assert_recovered_after_step_1(rank: int, ended: list[str]) -> None:
    """What :func:`_caught_failure_then_training` must return on every rank: step 1 failed,
    the others succeeded (also for tests/test_kernels_finalize.py)."""
    assert ended[0] == "ok" and ended[2:] == ["ok", "ok"], (rank, ended)
    assert ended[1] != "ok", (rank, ended)


#: the scenarios' destroyed process groups, kept alive until the worker process ends: on
#: torch < 2.8 freeing a gloo group right after a collective can deadlock (its destructor
#: joins a worker thread while holding the GIL, which that thread needs to release the
#: collective's tensors; README, Troubleshooting): rank 0 or 1 hung in about 1 run of 3 of
#: this module on torch 2.3.1
_DESTROYED_GROUPS: list[dist.ProcessGroup] = []


def _failure_then_new_group(rank: int, world_size: int) -> dict[str, Any]:
    """Rank 0 fails at the last synchronized call on one group, which is then destroyed;
    then a layer on a new group of the same ranks trains. What each call ended with."""
    timeout = datetime.timedelta(seconds=PROCESS_GROUP_TIMEOUT)
    ranks = list(range(world_size))
    old_group = dist.new_group(ranks, timeout=timeout)
    first, second = syncbn.SyncBatchNorm(3, process_group=old_group), syncbn.SyncBatchNorm(3)
    second.process_group = old_group
    for layer in (first, second):
        layer.check_mode = "deferred"
    x = torch.randn(4, 3)

    def last_call_fails_on_rank_0() -> None:
        hidden = first(x)
        second(hidden.double() if rank == 0 else hidden)  # rank 0's input is refused

    failed = outcome(last_call_fails_on_rank_0)  # the others' deferred check holds the flag
    dist.destroy_process_group(old_group)  # the layers still hold the group object
    new_group = dist.new_group(ranks, timeout=timeout)
    fresh = syncbn.SyncBatchNorm(3, process_group=new_group)
    fresh.check_mode = "deferred"
    trained = outcome(lambda: fresh(x).sum().backward())
    dist.destroy_process_group(new_group)
    _DESTROYED_GROUPS.extend([old_group, new_group])
    tests = [distributed.destroyed_test(group) for group in (old_group, new_group, None)]
    return {"failed": failed, "trained": trained, "destroyed": [test() for test in tests]}


def test_deferred_checks_of_a_destroyed_group_do_not_reach_a_new_one(pool2: WorkerPool) -> None:
    """A failure that a deferred check has not raised when its process group is destroyed
    is never raised in a later group's call (before, that rank alone raised there, and the
    other waited in the new group's collective until the timeout)."""
    failed, other = pool2.run(_failure_then_new_group, timeout=60.0)
    assert failed["failed"][0] == "RuntimeError", failed  # the refused dtype, raised at once
    assert other["failed"] == ("ok", ""), other  # deferred: not raised before the destroy
    assert failed["trained"] == other["trained"] == ("ok", ""), (failed, other)
    assert failed["destroyed"] == other["destroyed"] == [True, True, False]


def _call_on_a_destroyed_group(rank: int, world_size: int, check_mode: str) -> dict[str, Any]:
    """A layer that still holds its process group after ``destroy_process_group``."""
    group = dist.new_group(list(range(world_size)))
    layer = syncbn.SyncBatchNorm(3, process_group=group)
    layer.check_mode = check_mode
    layer(torch.randn(4, 3))  # one call while the group lives
    dist.destroy_process_group(group)
    _DESTROYED_GROUPS.append(group)
    called = outcome(lambda: layer(torch.randn(4, 3)))
    assert layer.num_batches_tracked is not None
    return {"called": called, "counted": int(layer.num_batches_tracked)}


@pytest.mark.parametrize("check_mode", ["immediate", "deferred"])
def test_a_layer_whose_group_was_destroyed_raises_and_updates_nothing(
    pool2: WorkerPool, check_mode: str
) -> None:
    """A destroyed group is refused before the collective, in syncbn's words on every torch
    (torch's own vary: a ValueError on 2.13, a TypeError "Invariant encountered" on 2.3, an
    AssertionError on 2.1; a cache of the device check once skipped the refusal: the call
    ran on the destroyed gloo group and moved the running statistics)."""
    for result in pool2.run(_call_on_a_destroyed_group, check_mode, timeout=60.0):
        kind, message = result["called"]
        assert kind == "RuntimeError" and "process group has been destroyed" in message, result
        assert result["counted"] == 1, result


def _group_facts_scenario(rank: int, world_size: int) -> dict[str, Any]:
    """What each call reads of its process group once per group
    (``distributed.group_world_size``, ``check_collective``), against torch's own queries:
    a live group's, a destroyed one's, a group without this rank."""
    ranks = list(range(world_size))
    group = dist.new_group(ranks)
    sizes = [distributed.group_world_size(group), distributed.group_world_size(None)]
    remembered = distributed._live_facts(group) is not None
    wrong_device = [
        outcome(lambda: distributed.check_collective(torch.device("meta"), group)),
        outcome(lambda: distributed.check_device_backend(torch.device("meta"), group)),
    ]
    dist.destroy_process_group(group)
    _DESTROYED_GROUPS.append(group)
    forgotten = distributed._live_facts(group) is None
    destroyed = outcome(lambda: distributed.check_collective(torch.device("cpu"), group))
    alone = dist.new_group([0])  # rank 1 receives no group: NON_GROUP_MEMBER
    not_member = outcome(lambda: distributed.group_world_size(alone))
    return {
        "sizes": sizes,
        "remembered": remembered,
        "wrong_device": wrong_device,
        "forgotten": forgotten,
        "destroyed": destroyed,
        "not_member": not_member,
    }


def test_group_facts_are_read_once_per_live_group(pool2: WorkerPool) -> None:
    """A group's world size and backend, read at every call through several
    ``torch.distributed`` queries before, are remembered per live group: the same answers
    and refusals as torch's queries, and a destroyed group is read (and refused) again."""
    for rank, result in enumerate(pool2.run(_group_facts_scenario, timeout=60.0)):
        assert result["sizes"] == [2, 2] and result["remembered"], result
        remembered_check, torch_check = result["wrong_device"]
        assert remembered_check == torch_check, result
        assert remembered_check[0] == "RuntimeError" and "device type 'meta'" in remembered_check[1]
        assert result["forgotten"], result
        kind, message = result["destroyed"]
        assert kind == "RuntimeError" and "process group has been destroyed" in message, result
        if rank == 0:
            assert result["not_member"] == ("ok", ""), result
        else:
            kind, message = result["not_member"]
            assert kind == "RuntimeError" and "does not contain this rank" in message, result


class _EventThatMustNotBeQueried:
    def query(self) -> bool:
        raise AssertionError("a CUDA event was queried")


def test_deferred_checks_wait_while_a_cuda_graph_is_captured(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Querying an event during a capture invalidates it; the checks wait until after."""
    pending = _protocol._PendingCheck(torch.zeros(5), _EventThatMustNotBeQueried(), None)  # type: ignore[arg-type]
    monkeypatch.setattr(_protocol, "_pending", _protocol.collections.deque([pending]))
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    _protocol.raise_deferred()  # capturing: nothing is inspected
    assert list(_protocol._pending) == [pending]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    with pytest.raises(AssertionError, match="a CUDA event was queried"):
        _protocol.raise_deferred()  # after the capture it is


class _SlowArrivedEvent:
    """An event whose copy has arrived, queried slowly: the querying thread lets others
    run meanwhile, as a CUDA event query releases the GIL."""

    def query(self) -> bool:
        time.sleep(0.002)
        return True


class _CountingCheck:
    def __init__(self, seen: collections.Counter[int], index: int) -> None:
        self.seen, self.index = seen, index

    def problem(self, header: _protocol.Header) -> Exception | None:
        self.seen[self.index] += 1
        return None


def test_deferred_checks_are_each_inspected_once_by_concurrent_threads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """DataParallel's replicas call their layers from one thread per device, each
    scanning the deferred checks: every check is inspected exactly once, and no thread
    fails (a scan between another's peek and pop inspected checks twice, popped others
    unchecked, or popped from an empty queue)."""
    seen: collections.Counter[int] = collections.Counter()
    pending = [
        _protocol._PendingCheck(torch.zeros(5), _SlowArrivedEvent(), _CountingCheck(seen, i))  # type: ignore[arg-type]
        for i in range(40)
    ]
    monkeypatch.setattr(_protocol, "_pending", collections.deque(pending))
    errors: list[BaseException] = []

    def scan() -> None:
        try:
            _protocol.raise_deferred()
        except BaseException as error:  # noqa: BLE001 - collected, asserted below
            errors.append(error)

    threads = [threading.Thread(target=scan) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not errors, errors
    assert seen == collections.Counter(range(40)), seen
    assert not _protocol._pending


def test_an_accelerators_forward_count_is_no_cached_constant() -> None:
    """Off the CPU (the meta device stands in for an accelerator here) a forward buffer
    takes its count as a tensor filled on the device, and the cached heads are the layer's
    alone: a head per count cost a copy through pinned memory and a host wait on CUDA at
    each new count (batches of varying size), and crowded the heads out of the cache. On
    the CPU the count stays in the cached head (no extra op)."""
    sums = torch.zeros(3, dtype=torch.float64, device="meta")
    fingerprint = _protocol.fingerprint("counts", 3)
    _protocol.pack_forward(7, sums, sums, fingerprint)  # the layer's count-free head
    cached = _protocol._buffer_ends.cache_info().currsize
    for count in range(100, 150):
        buffer = _protocol.pack_forward(count, sums, sums, fingerprint)
        assert buffer.shape == (_protocol.forward_size(3),) and buffer.device.type == "meta"
    assert _protocol._buffer_ends.cache_info().currsize == cached
    cpu = torch.arange(3, dtype=torch.float64)
    assert _protocol.count_slot(_protocol.pack_forward(9, cpu, cpu, fingerprint)).item() == 9
    assert _protocol._buffer_ends.cache_info().currsize == cached + 1
