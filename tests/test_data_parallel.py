"""syncbn.data_parallel: vacancy's DataParallel API, with statistics shared by replica threads.

On CPU, DataParallel never replicates, so the cross-replica mechanism is driven here the
way DataParallel drives it on GPUs: copies made like ``torch.nn.parallel.replicate``
makes them (parameters as non-leaf aliases, copy 0 holding the original buffers), the
replication callbacks, then one thread per replica running forward and backward on its
slice of the batch. The results must equal torch's BatchNorm on the whole batch.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
import inspect
import io
import math
import re
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any, TypedDict, cast

import numpy as np
import pytest
import torch
import torch.fx
import torch.utils.checkpoint
from _gold import Case, Tolerance, reference
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

import syncbn
from syncbn.data_parallel import (
    DataParallelWithCallback,
    SynchronizedBatchNorm1d,
    SynchronizedBatchNorm2d,
    SynchronizedBatchNorm3d,
    SynchronizedBatchNormNd,
    _fail_fast,
    _present_devices,
    _rendezvous_of,
    convert_model,
    execute_replication_callbacks,
    patch_replication_callback,
)

SYNC_CLASSES: dict[int, type[_BatchNorm]] = {2: SynchronizedBatchNorm1d, 3: SynchronizedBatchNorm1d}
SYNC_CLASSES.update({4: SynchronizedBatchNorm2d, 5: SynchronizedBatchNorm3d})
TOL: Tolerance = {"rtol": 1e-9, "atol": 1e-10}
THREAD_JOIN_SECONDS = 60.0


def copies_like_replicate(module: nn.Module, num_copies: int) -> list[nn.Module]:
    """Copies of ``module`` made as ``torch.nn.parallel.replicate`` makes them, but on CPU.

    Parameters become non-leaf aliases (gradients flow back into, and sum in, the
    original Parameters); copy 0 holds the original buffers and the other copies hold
    clones. No replication callback is run.
    """
    modules = list(module.modules())
    index = {m: i for i, m in enumerate(modules)}
    copies = [[m._replicate_for_data_parallel() for m in modules] for _ in range(num_copies)]
    for i, original in enumerate(modules):
        for copy_id in range(num_copies):
            replica = copies[copy_id][i]
            for key, child in original._modules.items():
                setattr(replica, key, None if child is None else copies[copy_id][index[child]])
            for key, param in original._parameters.items():
                if param is None:
                    replica._parameters[key] = None
                else:
                    setattr(replica, key, param.view_as(param))
            for key, buffer in original._buffers.items():
                if buffer is not None and copy_id > 0:
                    buffer = buffer.clone()
                setattr(replica, key, buffer)
    return [c[0] for c in copies]


def replicate(module: nn.Module, num_copies: int) -> list[nn.Module]:
    """Copies of ``module`` as DataParallelWithCallback makes them: replicate, then callbacks."""
    replicas = copies_like_replicate(module, num_copies)
    execute_replication_callbacks(replicas)
    return replicas


def in_threads(work: Callable[[int], Any], num_copies: int) -> tuple[list[Any], list[Any]]:
    """Run ``work(copy_id)`` in one thread per copy; return the results and the exceptions."""
    results: list[Any] = [None] * num_copies
    errors: list[BaseException | None] = [None] * num_copies

    def run(copy_id: int) -> None:
        try:
            results[copy_id] = work(copy_id)
        except BaseException as error:  # noqa: BLE001 - reported to the test
            errors[copy_id] = error

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(num_copies)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(THREAD_JOIN_SECONDS)
    assert not any(t.is_alive() for t in threads), "a replica thread is still waiting"
    return results, errors


def parallel_apply_in_threads(
    self: nn.DataParallel, replicas: Sequence[nn.Module], inputs: Sequence[Any], kwargs: Any
) -> list[Any]:
    """``torch.nn.DataParallel.parallel_apply`` on CPU threads (torch's runs one thread per
    replica on its device); raises the first replica's error."""

    def work(copy_id: int) -> Any:
        return replicas[copy_id](*inputs[copy_id], **(kwargs[copy_id] if kwargs else {}))

    results, errors = in_threads(work, len(replicas))
    for error in errors:
        if error is not None:
            raise error
    return results


def forward_backward(
    replicas: Sequence[nn.Module], xs: Sequence[torch.Tensor], dys: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each replica's forward and backward in its own thread; the outputs and input grads."""
    leaves = [x.detach().clone().requires_grad_() for x in xs]

    def work(copy_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        output = replicas[copy_id](leaves[copy_id])
        output.backward(dys[copy_id])
        grad_input = leaves[copy_id].grad
        assert grad_input is not None
        return output.detach(), grad_input

    results, errors = in_threads(work, len(replicas))
    for error in errors:
        if error is not None:
            raise error
    return torch.cat([r[0] for r in results]), torch.cat([r[1] for r in results])


def split(tensor: torch.Tensor, sizes: Sequence[int]) -> list[torch.Tensor]:
    return list(tensor.split(list(sizes)))


def _prefixed(prefix: str) -> Callable[[str], str]:
    """An ``assert_close`` message callback that puts ``prefix`` before torch's message."""
    return lambda message: f"{prefix}: {message}"


# sizes: one slice per replica, uneven, some empty
CASES = {
    "1d-NC": Case(sizes=(3, 0, 4), tail=(5,)),
    "1d-NCL": Case(sizes=(2, 3), tail=(3, 7)),
    "2d": Case(sizes=(1, 0, 2), tail=(3, 4, 5)),
    "3d": Case(sizes=(2, 1), tail=(2, 3, 2, 4)),
    "momentum-none-affine-false": Case(sizes=(0, 3, 2), momentum=None, affine=False),
    "no-running-stats-eps": Case(sizes=(2, 2), track_running_stats=False, eps=1e-2),
    "bias-false": Case(sizes=(2, 1, 3), bias=False),
}


#: the reference for bias=False: torch's layers take it from torch 2.13
_NEEDS_BIAS_ARGUMENT = pytest.mark.skipif(
    "bias" not in inspect.signature(nn.BatchNorm1d.__init__).parameters,
    reason="torch's BatchNorm takes bias=False from torch 2.13",
)


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(name, marks=[_NEEDS_BIAS_ARGUMENT] * (not case.bias))
        for name, case in CASES.items()
    ],
)
def test_replicas_match_batchnorm_on_whole_batch(name: str) -> None:
    case = CASES[name]
    expected = reference(case)
    xs, dys, weight, bias = case.data()
    cls = SYNC_CLASSES[len(case.tail) + 1]
    module = cls(
        case.num_features,
        eps=case.eps,
        momentum=case.momentum,
        affine=case.affine,
        track_running_stats=case.track_running_stats,
        dtype=torch.float64,
        bias=case.bias,
    )
    if case.affine:
        with torch.no_grad():
            module.weight.copy_(weight)
            if case.bias:
                module.bias.copy_(bias)

    for step, (x, dy) in enumerate(zip(xs, dys)):
        replicas = replicate(module, len(case.sizes))  # DataParallel replicates every step
        output, grad_input = forward_backward(replicas, split(x, case.sizes), split(dy, case.sizes))
        ref = expected["steps"][step]
        torch.testing.assert_close(output, ref["output"], **TOL)
        torch.testing.assert_close(grad_input, ref["grad_input"], **TOL)
        if case.affine:
            # each replica's share, summed by autograd into the original Parameters
            torch.testing.assert_close(module.weight.grad, ref["grad_weight"], **TOL)
            if case.bias:
                torch.testing.assert_close(module.bias.grad, ref["grad_bias"], **TOL)
            module.zero_grad(set_to_none=True)
        for replica in replicas[1:]:  # every copy computed the same global statistics
            for ours, theirs in zip(replica.buffers(), replicas[0].buffers()):
                torch.testing.assert_close(ours, theirs, rtol=0, atol=0)

    state = module.state_dict()
    assert state.keys() == expected["state"].keys()
    for key, value in expected["state"].items():
        torch.testing.assert_close(state[key], value, **TOL, msg=_prefixed(key))


class _Checkpointed(nn.Module):
    """A Linear and a BatchNorm under activation checkpointing (or not: the reference)."""

    def __init__(self, batchnorm: type[nn.Module], use_reentrant: bool | None = None) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 4, dtype=torch.float64)
        self.bn = batchnorm(4, dtype=torch.float64)
        self.use_reentrant = use_reentrant

    def body(self, x: torch.Tensor) -> torch.Tensor:
        return cast(torch.Tensor, self.bn(self.linear(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_reentrant is None:
            return self.body(x)
        return cast(
            torch.Tensor,
            torch.utils.checkpoint.checkpoint(self.body, x, use_reentrant=self.use_reentrant),
        )


@pytest.mark.parametrize(
    ("use_reentrant", "early_stop"),
    [(True, True), (False, False), (False, True)],
    ids=["reentrant", "non-reentrant", "non-reentrant-early-stop"],
)
def test_activation_checkpointing_matches_batchnorm_on_whole_batch(
    use_reentrant: bool, early_stop: bool
) -> None:
    """Non-reentrant checkpointing stops a recomputation early by raising from the layer's
    ``save_for_backward``, after the replicas' exchange: that signal aborted the rendezvous
    as a replica failure (torch's default, early stop on, always failed)."""
    torch.manual_seed(0)
    expected_model = _Checkpointed(nn.BatchNorm1d)
    model = _Checkpointed(SynchronizedBatchNorm1d, use_reentrant)
    model.load_state_dict(expected_model.state_dict())
    x, dy = torch.randn(5, 3, dtype=torch.float64), torch.randn(5, 4, dtype=torch.float64)
    leaf = x.clone().requires_grad_()
    expected = expected_model(leaf)
    expected.backward(dy)
    with torch.utils.checkpoint.set_checkpoint_early_stop(early_stop):
        output, grad_input = forward_backward(
            replicate(model, 2), split(x, (2, 3)), split(dy, (2, 3))
        )
    torch.testing.assert_close(output, expected.detach(), **TOL)
    torch.testing.assert_close(grad_input, leaf.grad, **TOL)
    for key, value in expected_model.state_dict().items():  # running statistics moved once
        torch.testing.assert_close(model.state_dict()[key], value, **TOL, msg=_prefixed(key))


class TwoLayers(nn.Module):
    """Calls ``bn`` twice per forward and ``bn2`` once, with a Linear in between."""

    def __init__(self, bn: type[nn.Module]) -> None:
        super().__init__()
        self.bn = bn(4, dtype=torch.float64)
        self.linear = nn.Linear(4, 3, dtype=torch.float64)
        self.bn2 = bn(3, momentum=None, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn2(self.linear(self.bn(x) + self.bn(x.square())))


def test_repeated_calls_and_several_layers_pair_up_by_call_order() -> None:
    torch.manual_seed(0)
    expected_model = TwoLayers(nn.BatchNorm1d)
    model = TwoLayers(SynchronizedBatchNorm1d)
    model.load_state_dict(expected_model.state_dict())
    sizes = (3, 1, 2)
    for _ in range(2):
        x = torch.randn(sum(sizes), 4, dtype=torch.float64)
        dy = torch.randn(sum(sizes), 3, dtype=torch.float64)
        leaf = x.clone().requires_grad_()
        expected = expected_model(leaf)
        expected.backward(dy)
        output, grad_input = forward_backward(
            replicate(model, len(sizes)), split(x, sizes), split(dy, sizes)
        )
        torch.testing.assert_close(output, expected.detach(), **TOL)
        torch.testing.assert_close(grad_input, leaf.grad, **TOL)
        for (key, param), ref in zip(model.named_parameters(), expected_model.parameters()):
            torch.testing.assert_close(param.grad, ref.grad, **TOL, msg=key)
        model.zero_grad()
        expected_model.zero_grad()
    for key, value in expected_model.state_dict().items():
        torch.testing.assert_close(model.state_dict()[key], value, **TOL, msg=key)


@pytest.mark.parametrize("absent", [1, 0], ids=["other-absent", "master-absent"])
def test_replica_that_never_calls_gives_a_clear_timeout_error(absent: int) -> None:
    bn = SynchronizedBatchNorm2d(3)
    bn.sync_timeout = 0.2
    replicas = replicate(bn, 2)
    present = 1 - absent

    def work(copy_id: int) -> None:
        if copy_id == present:
            replicas[copy_id](torch.randn(2, 3, 4, 4))

    _, errors = in_threads(work, 2)
    assert isinstance(errors[present], RuntimeError)
    message = str(errors[present])
    assert f"replica {present} timed out after 0.2 s in forward (call 0)" in message
    assert f"waiting for replica(s) [{absent}]" in message
    assert "same number of times" in message
    assert errors[absent] is None


def test_backward_timeout_names_the_missing_replica() -> None:
    replicas = replicate(SynchronizedBatchNorm1d(3), 2)
    barrier = threading.Barrier(2, timeout=THREAD_JOIN_SECONDS)

    def work(copy_id: int) -> None:
        output = replicas[copy_id](torch.randn(2, 3, requires_grad=True))
        barrier.wait()  # both forwards done (default timeout); only copy 0 runs backward
        if copy_id == 0:
            replicas[0]._replica_sync.timeout = 0.2  # type: ignore[union-attr]
            output.sum().backward()

    _, errors = in_threads(work, 2)
    assert errors[1] is None
    assert isinstance(errors[0], RuntimeError)
    assert "in backward (call 0) waiting for replica(s) [1]" in str(errors[0])


def test_invalid_input_on_one_replica_releases_the_others_with_its_error() -> None:
    replicas = replicate(SynchronizedBatchNorm2d(3), 3)  # default timeout: no wait expected
    channels = [3, 5, 3]

    def work(copy_id: int) -> None:
        replicas[copy_id](torch.randn(2, channels[copy_id], 4, 4))

    _, errors = in_threads(work, 3)
    assert isinstance(errors[1], ValueError)
    assert "expected input with 3 channels" in str(errors[1])
    for copy_id in (0, 2):
        assert isinstance(errors[copy_id], RuntimeError)
        assert "because replica 1 raised ValueError: expected input with 3" in str(errors[copy_id])


class FailOnBatchOfThree(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 3:
            raise OSError("simulated failure outside the BatchNorm layer")
        return x


def test_failure_outside_the_layer_releases_the_others() -> None:
    model = nn.Sequential(FailOnBatchOfThree(), SynchronizedBatchNorm1d(2))
    copies = replicate(model, 2)
    replicas = _fail_fast(copies, _rendezvous_of(copies))  # what DataParallelWithCallback runs
    sizes = [2, 3]

    def work(copy_id: int) -> None:
        replicas[copy_id](torch.randn(sizes[copy_id], 2))

    _, errors = in_threads(work, 2)
    assert isinstance(errors[1], OSError)
    assert isinstance(errors[0], RuntimeError)
    assert "because replica 1 raised OSError: simulated failure" in str(errors[0])


@pytest.mark.parametrize("kind", ["with-callback", "patched"])
def test_a_failure_outside_the_layer_releases_the_others_through_parallel_apply(
    monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """DataParallelWithCallback's ``parallel_apply``, and a DataParallel patched with
    ``patch_replication_callback``, release the waiting replica at once (not after
    ``sync_timeout``) when another raises outside the layer; the step raises that
    replica's own error, as a model without synchronized layers would: replica 0's
    ``RuntimeError`` (which named it) came first, and a handler of the root's type
    (``except torch.OutOfMemoryError``) never saw it (a review, 2026-12-08)."""
    monkeypatch.setattr(nn.DataParallel, "parallel_apply", parallel_apply_in_threads)
    layer = SynchronizedBatchNorm1d(2)
    layer.sync_timeout = 30.0  # the bound should the release not come
    model = nn.Sequential(FailOnBatchOfThree(), layer)
    inputs = [(torch.randn(2, 2),), (torch.randn(3, 2),)]
    started = time.monotonic()
    with pytest.raises(OSError, match="simulated failure outside the BatchNorm layer"):
        _wrapped(kind, model).parallel_apply(replicate(model, 2), inputs, None)
    assert time.monotonic() - started < 10.0


class _WidenOnBatchOfThree(nn.Module):
    """Gives the next layer one channel too many on the replica of batch 3, which that
    layer refuses (a ValueError of its own input check), after an earlier layer's call."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, x[:, :1]], 1) if x.shape[0] == 3 else x


class _Wrapped(nn.Module):
    """A wrapper (a logging or timing module, say) whose exit takes a moment on the
    replica of batch 3: the other replica's thread runs meanwhile."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        try:
            return cast(torch.Tensor, self.module(x))
        finally:
            if x.shape[0] == 3:
                time.sleep(0)


def parallel_apply_like_torch(
    self: nn.DataParallel, replicas: Sequence[nn.Module], inputs: Sequence[Any], kwargs: Any
) -> list[Any]:
    """``torch.nn.DataParallel.parallel_apply`` on CPU threads, as torch raises a replica's
    error: the first in replica order, wrapped (``ExceptionWrapper``: its type, and its
    traceback as text)."""
    from torch._utils import ExceptionWrapper

    results: list[Any] = [None] * len(replicas)

    def work(copy_id: int) -> None:
        try:
            results[copy_id] = replicas[copy_id](*inputs[copy_id])
        except Exception:
            results[copy_id] = ExceptionWrapper(where=f"in replica {copy_id}")

    in_threads(work, len(replicas))
    for result in results:
        if isinstance(result, ExceptionWrapper):
            result.reraise()
    return results


def test_the_step_raises_the_failed_replicas_error_whichever_thread_is_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Replica 1 fails in the second synchronized layer; replica 0, released there, then
    aborts the first layer's rendezvous too, racing replica 1's own abort of it: the
    released replica's RuntimeError became the root in 12 of 20 steps (38 of 50 with a
    short switch interval), and the step raised it (a review, 2026-12-08)."""
    monkeypatch.setattr(nn.DataParallel, "parallel_apply", parallel_apply_like_torch)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads interleave at every chance
    try:
        raised = []
        for _ in range(20):
            failing = nn.Sequential(_WidenOnBatchOfThree(), SynchronizedBatchNorm1d(2))
            model = nn.Sequential(SynchronizedBatchNorm1d(2), _Wrapped(failing))
            inputs = [(torch.randn(2, 2),), (torch.randn(3, 2),)]
            with pytest.raises(Exception) as caught:
                DataParallelWithCallback(model).parallel_apply(replicate(model, 2), inputs, None)
            raised.append(type(caught.value).__name__)
    finally:
        sys.setswitchinterval(interval)
    assert raised == ["ValueError"] * 20


class _HoldsActivations(nn.Module):
    """An activation per call, watched through weak references; fails on batch 3."""

    def __init__(self) -> None:
        super().__init__()
        self.activations: list[weakref.ref[torch.Tensor]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        activation = torch.empty(1_000_000)
        self.activations.append(weakref.ref(activation))
        if x.shape[0] == 3:
            raise OSError("simulated out of memory")
        return x


def test_a_handled_failed_step_keeps_no_activation_alive(monkeypatch: pytest.MonkeyPatch) -> None:
    """Raised again as it was raised in its replica, the root error kept that replica's
    frames (its activations) alive in reference cycles, through the rendezvous that kept
    it, until the cyclic collector ran: ``except torch.OutOfMemoryError: empty_cache()``
    could not free them (a review, 2026-12-08). It is raised as torch raises a replica's
    error, its traceback as text, and forgotten by the rendezvous."""
    monkeypatch.setattr(nn.DataParallel, "parallel_apply", parallel_apply_like_torch)
    holder = _HoldsActivations()
    model = nn.Sequential(SynchronizedBatchNorm1d(2), holder, SynchronizedBatchNorm1d(2))
    data_parallel = DataParallelWithCallback(model)
    gc.disable()
    try:
        for _ in range(3):
            inputs = [(torch.randn(2, 2),), (torch.randn(3, 2),)]
            with pytest.raises(OSError, match="simulated out of memory"):
                data_parallel.parallel_apply(replicate(model, 2), inputs, None)
        alive = [ref for ref in holder.activations if ref() is not None]
    finally:
        gc.enable()
    assert len(holder.activations) == 6 and alive == []


@pytest.mark.parametrize(
    "timeout", [None, math.inf, 1e10, np.int64(60), torch.tensor(60.0)], ids=str
)
def test_a_sync_timeout_of_none_or_inf_waits_without_a_bound(timeout: Any) -> None:
    """Vacancy's replicas wait for each other without a bound, and a user moving from it
    sets ``None`` or ``math.inf``: the wait raised ``TypeError`` or ``OverflowError``
    (``Condition.wait`` takes at most ``threading.TIMEOUT_MAX``; a review, 2026-12-08).
    Numbers of other types (numpy's, a 0-dim tensor) are seconds too."""
    layer = SynchronizedBatchNorm1d(3, dtype=torch.float64)
    layer.sync_timeout = timeout
    replicas = replicate(layer, 2)
    x = torch.randn(5, 3, dtype=torch.float64)
    chunks = (x[:2], x[2:])

    def work(copy_id: int) -> torch.Tensor:
        if copy_id == 1:
            time.sleep(0.3)  # replica 0 waits for this one
        return cast(torch.Tensor, replicas[copy_id](chunks[copy_id]))

    results, errors = in_threads(work, 2)
    assert errors == [None, None]
    expected = nn.BatchNorm1d(3, dtype=torch.float64)(x)
    torch.testing.assert_close(torch.cat(results), expected)


@pytest.mark.parametrize("timeout", [0, -1.0, float("nan"), "60", True, 10**400])
def test_a_sync_timeout_that_is_no_positive_number_is_refused_at_replication(
    timeout: Any,
) -> None:
    """It was read only when a replica had to wait: a wrong value failed some steps and not
    others, with ``TypeError`` or "timed out after -1 s"."""
    layer = SynchronizedBatchNorm1d(3)
    layer.sync_timeout = timeout
    with pytest.raises(ValueError, match=r"sync_timeout must be a positive number of seconds"):
        replicate(layer, 2)


def test_a_replica_of_a_plain_data_parallel_warns_that_it_trains_alone() -> None:
    """A plain ``torch.nn.DataParallel`` runs no replication callback: its replicas each
    normalized their own slice, silently (as vacancy's do), where syncbn.SyncBatchNorm
    warns in the same place."""
    replicas = copies_like_replicate(SynchronizedBatchNorm1d(3), 2)
    with pytest.warns(UserWarning, match="runs no replication callback"):
        replicas[0](torch.randn(4, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        replicate(SynchronizedBatchNorm1d(3), 1)[0](torch.randn(4, 3))  # joined: no warning
        SynchronizedBatchNorm1d(3)(torch.randn(4, 3))  # no replica at all


class _ArrivesNextStep:
    """A deferred header copy that lands only after the step that made it (a GPU's copies
    land after the host has queued the whole forward)."""

    def __init__(self, steps: list[int]) -> None:
        self.steps, self.made_at = steps, steps[0]

    def query(self) -> bool:
        return self.steps[0] > self.made_at

    def synchronize(self) -> None:
        pass


def test_a_failed_step_does_not_fail_the_steps_after_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A user who catches one step's error (an out-of-memory error on one GPU) goes on
    training: the checks that the failed step deferred (the GPU default), error flags
    included, are not raised again by the next step, which would then fail the step after
    it too, and so on. The replicas run in CPU threads, with the GPU's deferred checks."""
    from syncbn import _protocol
    from syncbn._kernels import generic

    steps = [0]

    def defer_check(
        buffer: torch.Tensor, check: Any, values: Any = None, dissolved: Any = None
    ) -> None:
        values = _protocol.header_values(buffer, forward=check.phase == "forward")
        _protocol._pending.append(
            _protocol._PendingCheck(values.clone(), _ArrivesNextStep(steps), check)  # type: ignore[arg-type]
        )

    local_moments = generic.local_moments

    def out_of_memory_on_replica_1_at_step_1(input: torch.Tensor, *args: Any) -> Any:
        if steps[0] == 1 and input.shape[0] == 3:
            raise MemoryError("simulated: out of memory on replica 1")
        return local_moments(input, *args)

    monkeypatch.setattr(_protocol, "resolve_check_mode", lambda mode, device: "deferred")
    monkeypatch.setattr(_protocol, "defer_check", defer_check)
    monkeypatch.setattr(_protocol, "_pending", _protocol.collections.deque())
    monkeypatch.setattr(generic, "local_moments", out_of_memory_on_replica_1_at_step_1)
    monkeypatch.setattr(nn.DataParallel, "parallel_apply", parallel_apply_in_threads)
    model = nn.Sequential(SynchronizedBatchNorm1d(4), nn.ReLU(), SynchronizedBatchNorm1d(4))
    data_parallel = DataParallelWithCallback(model)
    failed = []
    for step in range(4):
        steps[0] = step
        inputs = [(torch.randn(2, 4),), (torch.randn(3, 4),)]
        try:
            data_parallel.parallel_apply(replicate(model, 2), inputs, [{}, {}])
        except (MemoryError, RuntimeError, ValueError):
            failed.append(step)
    assert failed == [1]  # before: [1, 2, 3], each step raising the last one's checks


def test_a_deferred_problem_raised_in_backward_releases_the_other_replicas(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With deferred checks (the GPU default) the replicas share the process's queue of
    checks, and the first replica to read a problem takes it from the others. Read in
    backward (a global batch of one value per channel, checked after its forward), it
    left the other replica waiting in its backward exchange for the layer's timeout (a
    review, 2026-12-08, on CPU threads); that replica now raises at once, naming the
    problem. The replicas run in CPU threads, with the GPU's deferred checks."""
    from syncbn import _protocol

    monkeypatch.setattr(_protocol, "resolve_check_mode", lambda mode, device: "deferred")
    monkeypatch.setattr(_protocol, "_pending", _protocol.collections.deque())
    layer = SynchronizedBatchNorm1d(4)
    layer.sync_timeout = 30.0
    replicas = replicate(layer, 2)
    inputs = [torch.randn(1, 4, requires_grad=True), torch.randn(0, 4, requires_grad=True)]
    outputs, errors = in_threads(lambda i: replicas[i](inputs[i]), 2)
    assert errors == [None, None]  # checked later: deferred
    _, errors = in_threads(lambda i: outputs[i].sum().backward(), 2)
    # which replica reads the problem first varies; the other is released by it
    problems = [error for error in errors if isinstance(error, ValueError)]
    released = [error for error in errors if not isinstance(error, ValueError)]
    assert len(problems) == 1 and len(released) == 1, errors
    assert "Expected more than 1 value per channel when training" in str(problems[0])
    message = str(released[0])
    assert isinstance(released[0], RuntimeError), released[0]
    assert "stopped in backward" in message and "raised ValueError" in message, message


def test_a_failure_of_the_masters_sum_releases_the_others() -> None:
    """The master replica sums the round's buffers; if that raises (out of memory, a buffer
    it cannot read), the replicas waiting for the sum raise at once instead of waiting
    for the rendezvous' timeout."""
    from syncbn._replicas import ReplicaRendezvous

    rendezvous = ReplicaRendezvous(timeout=20.0, layer="SynchronizedBatchNorm1d")
    for copy_id in range(2):
        rendezvous.register(copy_id)
    finished: list[float] = [0.0, 0.0]

    def exchange(copy_id: int) -> torch.Tensor:
        start = time.monotonic()
        # replica 1's buffer is one the master cannot copy from (a meta tensor has no data)
        buffer = torch.zeros(5, dtype=torch.float64, device="meta" if copy_id else "cpu")
        try:
            return rendezvous.exchange(copy_id, "backward", 0, buffer)
        finally:
            finished[copy_id] = time.monotonic() - start

    _, errors = in_threads(exchange, 2)
    assert errors[0] is not None and errors[1] is not None
    assert "because replica 0 raised" in str(errors[1])
    assert max(finished) < 10.0, finished  # not the 20 s timeout


def test_a_gradient_penalty_through_replicas_equals_batchnorms() -> None:
    """Double backward (``create_graph=True``, WGAN-GP's penalty) through the replicas:
    the input gradient and the penalty's gradients of BatchNorm on the whole batch."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), SynchronizedBatchNorm1d(4), nn.Tanh(), nn.Linear(4, 1))
    model = model.double()
    reference = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 1))
    reference = reference.double()
    reference.load_state_dict(model.state_dict())
    x = torch.randn(5, 3, dtype=torch.float64) * 2 + 1
    leaves = [part.clone().requires_grad_() for part in split(x, [3, 2])]
    replicas = replicate(model, 2)

    def penalized(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        out = module(x)
        (gradient,) = torch.autograd.grad(out.sum(), x, create_graph=True)
        (out.sum() + gradient.pow(2).sum()).backward()
        return gradient.detach()

    gradients, errors = in_threads(lambda i: penalized(replicas[i], leaves[i]), 2)
    assert errors == [None, None]
    whole = x.clone().requires_grad_()
    expected = penalized(reference, whole)
    torch.testing.assert_close(torch.cat(gradients), expected, **TOL)
    torch.testing.assert_close(
        torch.cat([cast(torch.Tensor, leaf.grad) for leaf in leaves]), whole.grad, **TOL
    )
    for ours, theirs in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(ours.grad, theirs.grad, **TOL)


def test_global_batch_of_one_value_raises_like_torch_on_every_replica() -> None:
    replicas = replicate(SynchronizedBatchNorm1d(3), 2)
    sizes = [1, 0]
    _, errors = in_threads(lambda i: replicas[i](torch.randn(sizes[i], 3)), 2)
    for error in errors:
        assert isinstance(error, ValueError)
        assert "Expected more than 1 value per channel when training" in str(error)


def test_without_several_replicas_the_layer_is_plain_batchnorm() -> None:
    torch.manual_seed(0)
    x = torch.randn(6, 3, 4, 4)
    expected, sync = nn.BatchNorm2d(3), SynchronizedBatchNorm2d(3)
    # outside DataParallel, and as the only replica
    for module in (sync, replicate(sync, 1)[0]):
        torch.testing.assert_close(module(x), expected(x), rtol=0, atol=0)
    torch.testing.assert_close(sync.state_dict(), expected.state_dict(), rtol=0, atol=0)
    # a replica among several, in eval mode: runs alone, never waits
    lonely = replicate(sync.eval(), 2)[1]
    torch.testing.assert_close(lonely(x), expected.eval()(x), rtol=0, atol=0)


class _Options(TypedDict):
    """Keyword arguments of the BatchNorm constructors."""

    eps: float
    momentum: float | None
    affine: bool
    track_running_stats: bool


def test_constructor_dim_checks_and_state_dict_match_torch() -> None:
    pairs = [
        (
            SynchronizedBatchNorm1d,
            nn.BatchNorm1d,
            (4, 2, 2),
            "expected 2D or 3D input (got 4D input)",
        ),
        (SynchronizedBatchNorm2d, nn.BatchNorm2d, (4, 2), "expected 4D input (got 3D input)"),
        (SynchronizedBatchNorm3d, nn.BatchNorm3d, (4, 2), "expected 5D input (got 3D input)"),
    ]
    for sync_cls, torch_cls, tail, message in pairs:
        kwargs = _Options(eps=1e-3, momentum=0.3, affine=False, track_running_stats=True)
        ours, theirs = sync_cls(4, **kwargs), torch_cls(4, **kwargs)
        assert ours.state_dict().keys() == theirs.state_dict().keys()
        assert repr(ours).split("(", 1)[1] == repr(theirs).split("(", 1)[1]
        ours.load_state_dict(nn.BatchNorm2d(4, affine=False).state_dict())
        with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
            ours(torch.randn(2, *tail))
    with pytest.raises(ValueError, match=r"expected 4D input \(got 3D input\)"):
        replicate(SynchronizedBatchNorm2d(4), 2)[0](torch.randn(2, 4, 2))  # fails before waiting


class ActBatchNorm2d(nn.BatchNorm2d):
    """A BatchNorm2d subclass that overrides forward (like timm's BatchNormAct2d)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return torch.relu(super().forward(input))


def small_resnet() -> nn.Sequential:
    """A stand-in for torchvision's resnet18 (not installed): convs and BatchNorm layers."""
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Sequential(nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8, eps=1e-3)),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 4),
        nn.BatchNorm1d(4, momentum=None),
    )


class Mixed(nn.Module):
    """A model with BatchNorm layers of every kind, and layers convert_model must leave alone."""

    def __init__(self) -> None:
        super().__init__()
        self.body = small_resnet()
        self.act = ActBatchNorm2d(4)
        self.group = nn.GroupNorm(2, 4)
        self.bn3d = nn.BatchNorm3d(2, track_running_stats=False).eval()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = self.group(self.body(x))
        return self.act(features[:, :, None, None]).flatten(1) + self.bn3d(
            features.view(-1, 2, 2, 1, 1)
        ).view(features.shape)


@pytest.fixture
def without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hide any GPU: these tests check conversion and callbacks with DataParallel on CPU, where
    it calls the module itself (with a GPU visible it would want the module on cuda:0, and
    ``device_ids=[0, 1]`` would name a missing device on a 1-GPU machine)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


@pytest.mark.usefixtures("without_cuda")
def test_convert_model_shares_state_and_keeps_behaviour() -> None:
    torch.manual_seed(0)
    model = Mixed()
    reference_model = copy.deepcopy(model)
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())

    with pytest.warns(UserWarning, match=r"left 'act' \(ActBatchNorm2d\): it overrides forward"):
        converted = convert_model(nn.DataParallel(model))

    assert isinstance(converted, DataParallelWithCallback)
    assert converted.module is model  # converted in place
    body = model.body
    assert type(body[1]) is SynchronizedBatchNorm2d and type(body[7]) is SynchronizedBatchNorm1d
    assert type(body[3][1]) is SynchronizedBatchNorm2d and body[3][1].eps == 1e-3
    assert body[7].momentum is None
    assert type(model.bn3d) is SynchronizedBatchNorm3d and not model.bn3d.training
    assert model.bn3d.running_mean is None
    assert type(model.act) is ActBatchNorm2d and type(model.group) is nn.GroupNorm
    assert all(p is params[k] for k, p in model.named_parameters())
    assert all(b is buffers[k] for k, b in model.named_buffers())

    x = torch.randn(5, 3, 6, 6)
    out = converted(x)  # on CPU, DataParallel calls the module: plain BatchNorm
    torch.testing.assert_close(out, reference_model(x), rtol=0, atol=0)
    torch.testing.assert_close(model.state_dict(), reference_model.state_dict(), rtol=0, atol=0)

    single = convert_model(nn.BatchNorm3d(2))
    assert type(single) is SynchronizedBatchNorm3d


@pytest.mark.usefixtures("without_cuda")
def test_convert_model_keeps_data_parallel_settings() -> None:
    wrapped = nn.DataParallel(nn.Sequential(nn.BatchNorm1d(3)), device_ids=[0, 1], dim=0)
    converted = convert_model(wrapped)
    assert isinstance(converted, DataParallelWithCallback)
    assert converted.device_ids == wrapped.device_ids
    assert getattr(converted, "output_device", None) == getattr(wrapped, "output_device", None)
    assert converted.training
    inner = nn.BatchNorm1d(3)
    evaluated = convert_model(nn.DataParallel(nn.Sequential(inner)).eval())
    assert not evaluated.training  # was: a training wrapper around modules in eval mode
    assert not cast(nn.Sequential, cast(nn.DataParallel, evaluated).module)[0].training


class _DictDataParallel(nn.DataParallel):
    """A subclass with a forward of its own, as training code writes them."""

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        return {"out": super().forward(*inputs, **kwargs)}


@pytest.mark.usefixtures("without_cuda")
def test_convert_model_keeps_a_data_parallel_subclass_and_patches_it() -> None:
    """vacancy's convert_model replaces any DataParallel with a DataParallelWithCallback,
    which dropped a subclass's own forward (here, its dict output) without a word."""
    layer = nn.BatchNorm1d(3)
    wrapped = _DictDataParallel(nn.Sequential(layer)).eval()
    converted = convert_model(wrapped)
    assert converted is wrapped and not converted.training
    twin = cast(nn.Sequential, wrapped.module)[0]
    assert type(twin) is SynchronizedBatchNorm1d and twin.weight is layer.weight
    assert isinstance(wrapped.__dict__["replicate"], functools.partial)  # patched
    assert set(converted(torch.randn(4, 3))) == {"out"}
    nested = nn.Sequential(_DictDataParallel(nn.BatchNorm1d(3)))
    assert convert_model(nested) is nested and type(nested[0]) is _DictDataParallel


def test_convert_model_converts_syncbn_layers_that_ran_only_in_replicas() -> None:
    """The recipe of the replica's warning: a SyncBatchNorm that ran only in DataParallel's
    replicas (copies) never saw an input itself. Before, convert_model left it (and the
    BatchNormNd that revert made of it) as it was, with no warning: replicas unsynchronized."""
    torch.manual_seed(0)
    layer = syncbn.SyncBatchNorm(3, dtype=torch.float64)
    x = torch.randn(6, 3, 4, dtype=torch.float64)
    with pytest.warns(UserWarning, match="DataParallel replica, and there is no process group"):
        forward_backward(copies_like_replicate(layer, 2), split(x, [3, 3]), split(x, [3, 3]))
    assert layer.last_input_dim is None  # the replicas saw the inputs
    reference = nn.BatchNorm1d(3, dtype=torch.float64)
    reference.load_state_dict(layer.state_dict())
    converted = convert_model(layer)
    assert type(converted) is SynchronizedBatchNormNd and converted.weight is layer.weight
    reverted = convert_model(syncbn.revert_sync_batchnorm(syncbn.SyncBatchNorm(3)))
    assert type(reverted) is SynchronizedBatchNormNd  # the README's older recipe, too
    dy = torch.randn_like(x)
    output, grad_input = forward_backward(
        replicate(converted, 2), split(x, [2, 4]), split(dy, [2, 4])
    )
    x_ref = x.clone().requires_grad_()
    expected = reference(x_ref)
    expected.backward(dy)
    torch.testing.assert_close(output, expected, **TOL)
    torch.testing.assert_close(grad_input, x_ref.grad, **TOL)
    torch.testing.assert_close(converted.running_var, reference.running_var, **TOL)
    seen = syncbn.SyncBatchNorm(3)
    seen(torch.randn(2, 3, 4, 4))  # the rank it saw decides
    assert type(convert_model(seen)) is SynchronizedBatchNorm2d


def test_convert_model_gives_a_converted_layer_the_twin_of_the_class_it_replaced() -> None:
    """As revert_sync_batchnorm does: a layer that convert_sync_batchnorm made of a
    BatchNorm2d becomes a SynchronizedBatchNorm2d, not the Nd twin of a layer that saw no
    input (which lost the rank check and ``isinstance`` tests); one made of a
    SynchronizedBatchNorm2d keeps its ``sync_timeout``; torch.nn.SyncBatchNorm, which
    synchronizes processes and not replicas (and was left as it was, unsynchronized in
    the replicas), becomes the Nd twin."""
    plain = nn.Sequential(nn.BatchNorm1d(3), nn.BatchNorm2d(3), nn.BatchNorm3d(3))
    converted = cast(nn.Sequential, convert_model(syncbn.convert_sync_batchnorm(plain)))
    assert [type(layer) for layer in converted] == [
        SynchronizedBatchNorm1d,
        SynchronizedBatchNorm2d,
        SynchronizedBatchNorm3d,
    ]
    patient = SynchronizedBatchNorm2d(3)
    patient.sync_timeout = 600.0
    twin = convert_model(syncbn.convert_sync_batchnorm(patient))
    assert type(twin) is SynchronizedBatchNorm2d and twin.sync_timeout == 600.0
    torchs = nn.SyncBatchNorm(3, momentum=0.2)
    assert type(convert_model(torchs)) is SynchronizedBatchNormNd
    assert convert_model(torchs).momentum == 0.2


class _NestedDataParallel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.DataParallel(nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3)))
        self.head = nn.Linear(3, 1)


@pytest.mark.usefixtures("without_cuda")
def test_convert_model_gives_a_nested_data_parallel_its_callbacks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As vacancy's convert_model: a DataParallel at any depth becomes one that runs the
    callbacks (before, only the root did, and the nested one's replicas never met)."""
    monkeypatch.setattr(
        nn.DataParallel,
        "replicate",
        lambda self, module, ids: _replicas_without_callbacks(module, ids),
    )
    model = _NestedDataParallel()
    inner = model.backbone.module
    converted = convert_model(model)
    assert converted is model and isinstance(model.backbone, DataParallelWithCallback)
    assert model.backbone.module is inner and type(inner[1]) is SynchronizedBatchNorm1d
    copies = [m for r in model.backbone.replicate(inner, [0, 1]) for m in r.modules()]
    layers = [m for m in copies if isinstance(m, SynchronizedBatchNorm1d)]
    assert [m._replica_sync.num_copies for m in layers if m._replica_sync] == [2, 2]


def test_convert_sync_batchnorm_converts_the_data_parallel_layers_both_ways() -> None:
    """A model written for vacancy's API moves to DDP (before: left with a warning)."""
    model = nn.Sequential(SynchronizedBatchNorm2d(3, momentum=0.3), SynchronizedBatchNormNd(3))
    weight = model[0].weight
    keys = list(model.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        syncbn.convert_sync_batchnorm(model)
    assert [type(layer) for layer in model] == [syncbn.SyncBatchNorm] * 2
    assert model[0].weight is weight and model[0].momentum == 0.3
    assert list(model.state_dict()) == keys
    syncbn.revert_sync_batchnorm(model)
    assert [type(layer) for layer in model] == [SynchronizedBatchNorm2d, SynchronizedBatchNormNd]
    assert model[0].weight is weight
    cast(SynchronizedBatchNorm2d, model[0]).sync_timeout = 600.0  # kept there and back
    syncbn.revert_sync_batchnorm(syncbn.convert_sync_batchnorm(model))
    assert model[0].sync_timeout == 600.0
    assert model[1].sync_timeout == syncbn.data_parallel.DEFAULT_SYNC_TIMEOUT


def _replicas_without_callbacks(
    module: nn.Module, device_ids: Sequence[int | torch.device]
) -> list[nn.Module]:
    return copies_like_replicate(module, len(device_ids))


def _synced_copies(replicas: Sequence[nn.Module]) -> list[int]:
    # the replicas are copies of one SynchronizedBatchNorm1d: their only module is the layer
    layers = [cast(SynchronizedBatchNorm1d, m) for r in replicas for m in r.modules()]
    return [m._replica_sync.num_copies for m in layers if m._replica_sync]


@pytest.mark.usefixtures("without_cuda")
def test_patch_replication_callback_runs_the_callbacks_after_replicate() -> None:
    data_parallel: nn.DataParallel[nn.Module]
    data_parallel = nn.DataParallel(SynchronizedBatchNorm1d(3), device_ids=[0, 1])
    data_parallel.replicate = _replicas_without_callbacks  # type: ignore[method-assign]
    assert _synced_copies(data_parallel.replicate(data_parallel.module, [0, 1])) == []
    patch_replication_callback(data_parallel)
    patch_replication_callback(data_parallel)  # twice is harmless
    assert _synced_copies(data_parallel.replicate(data_parallel.module, [0, 1])) == [2, 2]
    with pytest.raises(TypeError, match="expects a torch.nn.DataParallel, got Sequential"):
        patch_replication_callback(nn.Sequential())  # type: ignore[arg-type]


class _CopyingDataParallel(nn.DataParallel):
    """A DataParallel class of a user's own, patched rather than replaced; it replicates
    by copies (torch's replicate needs CUDA devices)."""

    def replicate(self, module: nn.Module, device_ids: Sequence[int | torch.device]) -> Any:
        return copies_like_replicate(module, len(device_ids))


@pytest.mark.usefixtures("without_cuda")
def test_a_patched_data_parallel_pickles_and_copies_with_its_patch() -> None:
    """``torch.save(model)`` of a patched DataParallel works, and the loaded model, like a
    deep copy, replicates with callbacks through its own class's ``replicate``."""
    data_parallel = _CopyingDataParallel(SynchronizedBatchNorm1d(3), device_ids=[0, 1])
    patch_replication_callback(data_parallel)
    saved = io.BytesIO()
    torch.save(data_parallel, saved)
    saved.seek(0)
    loaded = torch.load(saved, weights_only=False)
    for other in (loaded, copy.deepcopy(data_parallel)):
        for name in ("replicate", "parallel_apply"):
            assert getattr(other, name).args[0] is other, name  # the copy's, not the original's
        assert _synced_copies(other.replicate(other.module, [0, 1])) == [2, 2]


def test_data_parallel_with_callback_runs_the_callbacks_after_replicate(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(
        nn.DataParallel,
        "replicate",
        lambda self, module, ids: _replicas_without_callbacks(module, ids),
    )
    data_parallel = DataParallelWithCallback(SynchronizedBatchNorm1d(3), device_ids=[0, 1])
    replicas = data_parallel.replicate(data_parallel.module, [0, 1, 2])
    assert _synced_copies(replicas) == [3, 3, 3]


def test_missing_cuda_devices_are_dropped_with_a_warning() -> None:
    with pytest.warns(UserWarning, match=r"device_ids \[0, 1\] name devices .* running on \[0\]"):
        assert _present_devices([0, 1], 1, device_count=1) == ([0], None)
    with pytest.warns(UserWarning):
        kept = _present_devices([torch.device("cuda:0"), "cuda:1"], None, device_count=1)
    assert kept == ([torch.device("cuda:0")], None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _present_devices([0, 1], 1, device_count=2) == ([0, 1], 1)
        assert _present_devices(None, None, device_count=1) == (None, None)
        # nothing present: left to torch, which raises its own error
        assert _present_devices([3], None, device_count=1) == ([3], None)


def test_vacancy_readme_usage_runs() -> None:
    """The three snippets of vacancy's README (torchvision's resnet18 replaced by a stand-in)."""
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    x = torch.randn(16, 10, device=device)
    expected = nn.BatchNorm1d(10, eps=1e-5, affine=False).to(device)(x)

    sync_bn: nn.Module = SynchronizedBatchNorm1d(10, eps=1e-5, affine=False).to(device)
    sync_bn = DataParallelWithCallback(sync_bn, device_ids=[0, 1])
    torch.testing.assert_close(sync_bn(x), expected, rtol=1e-5, atol=1e-5)

    if torch.cuda.device_count() != 1:  # torch's DataParallel rejects [0, 1] on one GPU
        sync_bn = SynchronizedBatchNorm1d(10, eps=1e-5, affine=False).to(device)
        sync_bn = nn.DataParallel(sync_bn, device_ids=[0, 1])
        patch_replication_callback(sync_bn)  # monkey-patching
        torch.testing.assert_close(sync_bn(x), expected, rtol=1e-5, atol=1e-5)

    m: nn.Module = small_resnet().to(device)
    m = nn.DataParallel(m)
    m = convert_model(m)
    assert sum(isinstance(layer, SynchronizedBatchNorm2d) for layer in m.modules()) == 2
    m(torch.randn(4, 3, 8, 8, device=device)).square().sum().backward()


def _small_model(device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.BatchNorm2d(4)
    ).to(device, torch.float64)


def _assert_trains_like(model: nn.DataParallel, reference: nn.Module, device: torch.device) -> None:
    """Two training steps of ``model`` (converted, in a DataParallel wrapper) and of its
    BatchNorm ``reference`` on the same batches of 5 (3 + 2 on two devices): outputs, input
    and parameter gradients, then the state."""
    for _ in range(2):
        x = torch.randn(5, 3, 6, 6, device=device, dtype=torch.float64)
        dy = torch.randn(5, 4, 6, 6, device=device, dtype=torch.float64)
        x_ref, x_dp = x.clone().requires_grad_(), x.clone().requires_grad_()
        expected = reference(x_ref)
        expected.backward(dy)
        output = model(x_dp)
        output.backward(dy)
        torch.testing.assert_close(output, expected, **TOL)
        torch.testing.assert_close(x_dp.grad, x_ref.grad, **TOL)
        for param, ref in zip(model.module.parameters(), reference.parameters()):
            torch.testing.assert_close(param.grad, ref.grad, **TOL)
        model.zero_grad()
        reference.zero_grad()
    torch.testing.assert_close(model.module.state_dict(), reference.state_dict(), **TOL)


def one_device_matches_batchnorm(device: torch.device) -> None:
    """vacancy's API on one device: a model converted by ``convert_model`` inside
    ``DataParallelWithCallback`` (``device_ids=[0]`` where a GPU is: one replica, so the
    layers are torch's BatchNorm), and inside ``nn.DataParallel`` with the replication
    callback patched in, each trained like the original BatchNorm model; then an eval
    output."""
    device_ids = [0] if device.type == "cuda" else None
    for wrap in (DataParallelWithCallback, nn.DataParallel):
        reference = _small_model(device)
        model = wrap(convert_model(copy.deepcopy(reference)), device_ids)
        if wrap is nn.DataParallel:
            patch_replication_callback(model)
        assert sum(isinstance(m, SynchronizedBatchNorm2d) for m in model.modules()) == 2
        _assert_trains_like(model, reference, device)
        x = torch.randn(3, 3, 6, 6, device=device, dtype=torch.float64)
        torch.testing.assert_close(model.eval()(x), reference.eval()(x), **TOL)


@pytest.mark.usefixtures("without_cuda")
def test_one_device_matches_batchnorm() -> None:
    """On the CPU (tests/test_cuda.py runs the same on one GPU)."""
    one_device_matches_batchnorm(torch.device("cpu"))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_two_cuda_devices_match_batchnorm_on_whole_batch() -> None:
    device = torch.device("cuda", 0)
    reference = _small_model(device)
    model = DataParallelWithCallback(convert_model(copy.deepcopy(reference)), [0, 1])
    _assert_trains_like(model, reference, device)


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_torch_fx_keeps_the_layers_as_leaves(mode: str) -> None:
    torch.manual_seed(0)
    model = getattr(nn.Sequential(nn.Conv2d(3, 4, 1), SynchronizedBatchNorm2d(4)), mode)()
    traced = torch.fx.symbolic_trace(copy.deepcopy(model))
    assert [n.target for n in traced.graph.nodes if n.op == "call_module"] == ["0", "1"]
    x = torch.randn(2, 3, 4, 4)
    torch.testing.assert_close(traced(x), model(x))
    torch.testing.assert_close(traced.state_dict(), model.state_dict())


def _masked_data(
    sizes: Sequence[int], valid: Sequence[float], seed: int = 0
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """Per replica: an (N, 3, 6) float64 input, a mask and an output gradient, both NaN at
    the padded positions (nothing there may reach an output, gradient or statistic)."""
    gen = torch.Generator().manual_seed(seed)
    xs, masks, dys = [], [], []
    for size, fraction in zip(sizes, valid):
        x = torch.randn(size, 3, 6, generator=gen, dtype=torch.float64) * 2 + 5
        mask = torch.rand(size, 6, generator=gen) < fraction
        dy = torch.randn(size, 3, 6, generator=gen, dtype=torch.float64)
        padded = (~mask).unsqueeze(1).expand_as(x)
        xs.append(x.masked_fill(padded, float("nan")))
        dys.append(dy.masked_fill(padded, float("nan")))
        masks.append(mask)
    return xs, masks, dys


def _gathered(tensors: Sequence[torch.Tensor], masks: Sequence[torch.Tensor]) -> torch.Tensor:
    """The valid positions of every replica's (N, C, L) slice as one (M, C) batch."""
    return torch.cat([t.transpose(1, 2)[m] for t, m in zip(tensors, masks)])


def test_masked_replicas_match_batchnorm_on_the_gathered_valid_positions() -> None:
    # uneven slices, one replica with every position padded
    sizes, valid = (2, 3, 2), (0.7, 0.5, 0.0)
    layer = SynchronizedBatchNorm1d(3, momentum=None).double()
    with torch.no_grad():
        layer.weight.uniform_(0.5, 1.5)
        layer.bias.uniform_(-1.0, 1.0)
    reference_layer = nn.BatchNorm1d(3, momentum=None).double()
    reference_layer.load_state_dict(layer.state_dict())
    xs, masks, dys = _masked_data(sizes, valid)
    replicas = replicate(layer, len(sizes))
    leaves = [x.clone().requires_grad_() for x in xs]

    def work(copy_id: int) -> torch.Tensor:
        output = replicas[copy_id](leaves[copy_id], mask=masks[copy_id])
        output.backward(dys[copy_id])
        return output.detach()

    outputs, errors = in_threads(work, len(sizes))
    assert errors == [None] * len(sizes)

    x_valid = _gathered(xs, masks).requires_grad_()
    expected = reference_layer(x_valid)
    expected.backward(_gathered(dys, masks))
    assert x_valid.grad is not None and reference_layer.weight.grad is not None
    grads = [leaf.grad for leaf in leaves]
    assert all(grad is not None for grad in grads)
    torch.testing.assert_close(_gathered(outputs, masks), expected.detach(), **TOL)
    torch.testing.assert_close(_gathered(grads, masks), x_valid.grad, **TOL)  # type: ignore[arg-type]
    for output, grad, mask in zip(outputs, grads, masks):
        padded = (~mask).unsqueeze(1).expand_as(output)
        assert (output[padded] == 0).all() and (grad[padded] == 0).all()  # type: ignore[index]
    torch.testing.assert_close(layer.weight.grad, reference_layer.weight.grad, **TOL)
    torch.testing.assert_close(layer.bias.grad, reference_layer.bias.grad, **TOL)
    torch.testing.assert_close(layer.running_mean, reference_layer.running_mean, **TOL)
    torch.testing.assert_close(layer.running_var, reference_layer.running_var, **TOL)
    assert layer.num_batches_tracked is not None and int(layer.num_batches_tracked) == 1


def _masked_block_model() -> nn.Sequential:
    """A synchronized layer where a model cannot pass it a mask: inside an nn.Sequential."""
    torch.manual_seed(0)
    layer = SynchronizedBatchNorm1d(3, momentum=None).double()
    with torch.no_grad():
        layer.weight.uniform_(0.5, 1.5)
        layer.bias.uniform_(-1.0, 1.0)
    return nn.Sequential(layer, nn.SiLU())


def _wrapped(kind: str, model: nn.Module) -> nn.DataParallel:
    """``model`` in DataParallelWithCallback, or in a DataParallel patched with
    ``patch_replication_callback`` (vacancy's two ways)."""
    if kind == "with-callback":
        return DataParallelWithCallback(model)
    patched = nn.DataParallel(model)
    patch_replication_callback(patched)
    return patched


def _step_in_a_block(
    model: nn.Module,
    block: torch.Tensor,
    xs: Sequence[torch.Tensor],
    dys: Sequence[torch.Tensor],
    kind: str = "with-callback",
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One step of ``model``'s replicas (in the wrapper ``kind`` of :func:`_wrapped`), on CPU
    threads, inside ``masking(block)``; the replicas' backward in threads of their own after
    the block (as on the devices, where their exchanges meet too). The outputs and the input
    gradients, per replica."""
    leaves = [x.clone().requires_grad_() for x in xs]
    with syncbn.masking(block):
        outputs = _wrapped(kind, model).parallel_apply(
            replicate(model, len(xs)), [(leaf,) for leaf in leaves], None
        )
    _, errors = in_threads(lambda i: outputs[i].backward(dys[i]), len(xs))
    assert errors == [None] * len(xs)
    grads = [cast(torch.Tensor, leaf.grad) for leaf in leaves]
    return [output.detach() for output in outputs], grads


@pytest.mark.parametrize("kind", ["with-callback", "patched"])
@pytest.mark.parametrize("broadcast", [False, True], ids=["per-sample-mask", "broadcast-mask"])
def test_replicas_take_their_share_of_the_callers_masking_block(
    monkeypatch: pytest.MonkeyPatch, broadcast: bool, kind: str
) -> None:
    """DataParallel runs its replicas in threads, which do not see the block of the thread
    that calls the model: DataParallelWithCallback (and a patched DataParallel) opens one
    in each replica's thread with that replica's chunk of the mask along dim 0 (as it
    chunks the inputs: 3 and 2 of a batch of 5), or the whole mask where it is broadcast
    over the batch. The replicas run in CPU threads here (torch's replicate needs CUDA
    devices)."""
    monkeypatch.setattr(nn.DataParallel, "parallel_apply", parallel_apply_in_threads)
    sizes = (3, 2)
    xs, masks, dys = _masked_data(sizes, (0.7, 0.5))
    if broadcast:  # one (1, L) mask for every sample: NaN at its padded positions
        shared = torch.tensor([[True, True, False, True, True, False]])
        masks = [shared.expand(size, 6) for size in sizes]
        for x, dy in zip(xs, dys):
            x.nan_to_num_(5.0).masked_fill_(~shared.unsqueeze(1).expand_as(x), float("nan"))
            dy.nan_to_num_(1.0).masked_fill_(~shared.unsqueeze(1).expand_as(dy), float("nan"))
        block = shared
    else:
        block = torch.cat(masks)
    model = _masked_block_model()
    reference = nn.Sequential(nn.BatchNorm1d(3, momentum=None), nn.SiLU()).double()
    reference.load_state_dict(model.state_dict())
    outputs, grads = _step_in_a_block(model, block, xs, dys, kind)

    x_valid = _gathered(xs, masks).requires_grad_()
    expected = reference(x_valid)
    expected.backward(_gathered(dys, masks))
    torch.testing.assert_close(_gathered(outputs, masks), expected.detach(), **TOL)
    torch.testing.assert_close(_gathered(grads, masks), x_valid.grad, **TOL)
    for output, grad, mask in zip(outputs, grads, masks):
        padded = (~mask).unsqueeze(1).expand_as(output)
        assert (output[padded] == 0).all() and (grad[padded] == 0).all()
    for ours, theirs in zip(model.state_dict().values(), reference.state_dict().values()):
        torch.testing.assert_close(ours, theirs, **TOL)
    torch.testing.assert_close(model[0].weight.grad, reference[0].weight.grad, **TOL)


class _CheckpointedBlock(nn.Module):
    """``_masked_block_model``'s layers under non-reentrant activation checkpointing."""

    def __init__(self) -> None:
        super().__init__()
        self.body = _masked_block_model()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cast(
            torch.Tensor, torch.utils.checkpoint.checkpoint(self.body, x, use_reentrant=False)
        )


def test_checkpointed_replicas_recompute_with_their_share_of_the_block(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A replica's backward runs in a thread of its own (an autograd device thread on
    GPUs), without the replica's block: the recomputed forward takes the share that the
    forward took, after the block has closed, and the running statistics move once."""
    monkeypatch.setattr(nn.DataParallel, "parallel_apply", parallel_apply_in_threads)
    xs, masks, dys = _masked_data((3, 2), (0.7, 0.5))
    model = _CheckpointedBlock()
    plain = _masked_block_model()  # the same layers without checkpointing
    expected = _step_in_a_block(plain, torch.cat(masks), xs, dys)
    for ours, theirs in zip(_step_in_a_block(model, torch.cat(masks), xs, dys), expected):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    torch.testing.assert_close(model.body.state_dict(), plain.state_dict(), rtol=0, atol=0)
    assert model.body.state_dict()["0.num_batches_tracked"].item() == 1


def test_replicas_under_masking_none_run_unmasked_and_another_scatter_dim_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``masking(None)`` reaches the replicas as it is (no error, no mask); a mask split
    along dim 0 cannot follow inputs that DataParallel scatters along another dim."""
    monkeypatch.setattr(nn.DataParallel, "parallel_apply", parallel_apply_in_threads)
    model = _masked_block_model()
    xs = [torch.randn(size, 3, 6, dtype=torch.float64) for size in (3, 2)]

    def forward(block: syncbn.masking | None) -> list[torch.Tensor]:
        inputs = [(x,) for x in xs]
        with block if block is not None else contextlib.nullcontext():
            return DataParallelWithCallback(model).parallel_apply(replicate(model, 2), inputs, None)

    unmasked = forward(None)
    for ours, theirs in zip(forward(syncbn.masking(None)), unmasked):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    for kind in ("with-callback", "patched"):
        scattering_dim_1 = _wrapped(kind, model)
        scattering_dim_1.dim = 1  # what DataParallel(dim=1) sets where CUDA is available
        with pytest.raises(ValueError, match="along dim=1"), syncbn.masking(torch.ones(5, 6) > 0):
            scattering_dim_1.parallel_apply(replicate(model, 2), [(x,) for x in xs], None)


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("track_running_stats", [True, False])
def test_a_masked_call_without_replicas_normalizes_the_valid_positions(
    training: bool, track_running_stats: bool
) -> None:
    layer = SynchronizedBatchNorm1d(3, track_running_stats=track_running_stats).double()
    reference_layer = nn.BatchNorm1d(3, track_running_stats=track_running_stats).double()
    if track_running_stats:  # eval mode reads them
        for module in (layer, reference_layer):
            module.running_mean.fill_(4.0)  # type: ignore[union-attr]
            module.running_var.fill_(3.0)  # type: ignore[union-attr]
    layer.train(training)
    reference_layer.train(training)
    (x,), (mask,), (dy,) = _masked_data((4,), (0.6,), seed=1)
    leaf = x.clone().requires_grad_()
    output = layer(leaf, mask=mask)
    output.backward(dy)

    x_valid = _gathered([x], [mask]).requires_grad_()
    expected = reference_layer(x_valid)
    expected.backward(_gathered([dy], [mask]))
    assert leaf.grad is not None and x_valid.grad is not None
    torch.testing.assert_close(_gathered([output.detach()], [mask]), expected.detach(), **TOL)
    torch.testing.assert_close(_gathered([leaf.grad], [mask]), x_valid.grad, **TOL)
    padded = (~mask).unsqueeze(1).expand_as(output)
    assert (output[padded] == 0).all() and (leaf.grad[padded] == 0).all()
    torch.testing.assert_close(layer.weight.grad, reference_layer.weight.grad, **TOL)
    if track_running_stats:
        torch.testing.assert_close(layer.running_mean, reference_layer.running_mean, **TOL)
        torch.testing.assert_close(layer.running_var, reference_layer.running_var, **TOL)
        counted, reference_counted = layer.num_batches_tracked, reference_layer.num_batches_tracked
        assert counted is not None and reference_counted is not None
        assert int(counted) == int(reference_counted)


def test_an_invalid_mask_on_one_replica_releases_the_others_with_its_error() -> None:
    replicas = replicate(SynchronizedBatchNorm1d(3), 3)  # default timeout: no wait expected
    mask_lengths = [6, 5, 6]

    def work(copy_id: int) -> None:
        mask = torch.ones(2, mask_lengths[copy_id], dtype=torch.bool)
        replicas[copy_id](torch.randn(2, 3, 6), mask=mask)

    _, errors = in_threads(work, 3)
    assert isinstance(errors[1], ValueError), errors[1]
    for copy_id in (0, 2):
        assert isinstance(errors[copy_id], RuntimeError), errors[copy_id]
        assert "because replica 1 raised ValueError" in str(errors[copy_id])
