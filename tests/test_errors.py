"""Bad input and bad environments give clear errors, on every rank, without hangs."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _harness import WorkerPool, outcome
from torch.utils._python_dispatch import TorchDispatchMode

import syncbn
from syncbn import _autograd, _compiled, distributed
from syncbn._autograd import LayerInfo, ProcessGroupReducer, TrainOptions, sync_batch_norm_train


def test_local_errors_are_worded_like_torch() -> None:
    bn = syncbn.SyncBatchNorm(3)
    with pytest.raises(ValueError, match=r"^expected at least 2D input \(got 1D input\)$"):
        bn(torch.randn(3))
    with pytest.raises(ValueError, match=r"expected input with 3 channels.*with 4 channels"):
        bn(torch.randn(2, 4, 5))
    with pytest.raises(TypeError, match="floating point input, got input of dtype torch.int64"):
        bn(torch.ones(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="Expected more than 1 value per channel when training"):
        bn(torch.randn(1, 3))
    with pytest.raises(ValueError, match=r"expected at least 2D input \(got 0D input\)"):
        syncbn.sync_batch_norm(torch.tensor(1.0), None, None, training=True)
    with pytest.raises(TypeError, match="expected input to be a Tensor, got NoneType"):
        bn(None)  # type: ignore[arg-type]
    for layer in (syncbn.SyncBatchNorm(0), syncbn.SyncBatchNorm(0).eval()):
        with pytest.raises(ValueError, match="number of input channels should be non-zero"):
            layer(torch.randn(2, 0, 3))


def test_check_mode_is_validated_when_set() -> None:
    """Before, a bad value raised only inside a training call, locally, before the error flag
    could reach the other ranks."""
    bn = syncbn.SyncBatchNorm(3)
    with pytest.raises(ValueError, match=r"check_mode must be one of .*got 'later'"):
        bn.check_mode = "later"
    assert bn.check_mode == "auto"
    bn.check_mode = "deferred"
    assert pickle.loads(pickle.dumps(bn)).check_mode == "deferred"


def _functional_momentum_none(rank: int, world_size: int) -> tuple[str, str]:
    x = torch.randn(2 + rank, 3)
    momentum: Any = None
    return outcome(
        lambda: syncbn.sync_batch_norm(
            x, torch.zeros(3), torch.ones(3), training=True, momentum=momentum
        )
    )


def test_functional_momentum_none_raises_like_torch_at_any_world_size(pool2: WorkerPool) -> None:
    """Before, 2 ranks silently left the running statistics alone, 1 rank raised TypeError."""
    expected = ("TypeError", "sync_batch_norm(): argument 'momentum' must be float, not NoneType")
    assert pool2.run(_functional_momentum_none) == [expected] * 2
    x = torch.randn(2, 3)
    with pytest.raises(TypeError, match=r"argument 'momentum' must be float, not NoneType"):
        syncbn.sync_batch_norm(x, None, None, training=True, momentum=None)  # type: ignore[arg-type]


def _global_count_too_small(rank: int, world_size: int, shape: tuple[int, ...]) -> tuple[str, str]:
    bn = syncbn.SyncBatchNorm(3)
    local = shape if rank == 0 else (0, *shape[1:])
    return outcome(bn, torch.randn(local))


@pytest.mark.parametrize("shape", [(1, 3), (1, 3, 1)])
def test_global_count_of_one_raises_on_every_rank(pool: WorkerPool, shape) -> None:  # type: ignore[no-untyped-def]
    for kind, message in pool.run(_global_count_too_small, shape):
        assert kind == "ValueError"
        assert "Expected more than 1 value per channel when training" in message
        assert f"across all {pool.world_size} ranks" in message


def _global_count_two_is_fine(rank: int, world_size: int) -> tuple[str, str]:
    bn = syncbn.SyncBatchNorm(3)
    return outcome(bn, torch.randn(1 if rank < 2 else 0, 3))


def test_one_value_per_rank_is_enough_when_the_global_count_is_larger(pool: WorkerPool) -> None:
    assert pool.run(_global_count_two_is_fine) == [("ok", "")] * pool.world_size


def _one_rank_bad_input(rank: int, world_size: int, bad: str) -> tuple[str, str]:
    # a layer with no per-channel tensor: only the input told the device of the error
    # flag's buffer, and a non-tensor input raised before joining
    plain = bad == "not a tensor, plain layer"
    bn = syncbn.SyncBatchNorm(3, affine=not plain, track_running_stats=not plain)
    good = torch.randn(4, 3, 2)
    x: torch.Tensor | None = good
    if rank == world_size - 1:
        x = {
            "dims": torch.randn(3),
            "channels": torch.randn(4, 5, 2),
            "dtype": good.long(),
            "not a tensor": None,  # before, nothing checked it: that rank never joined
            "not a tensor, plain layer": None,
        }[bad]
    result = outcome(bn, x)
    # the group is still usable afterwards: a correct call on every rank works
    assert outcome(bn, torch.randn(2, 3, 2)) == ("ok", "")
    return result


@pytest.mark.parametrize(
    "bad", ["dims", "channels", "dtype", "not a tensor", "not a tensor, plain layer"]
)
def test_bad_input_on_one_rank_raises_on_every_rank(pool: WorkerPool, bad: str) -> None:
    *others, last = pool.run(_one_rank_bad_input, bad)
    assert last[0] == ("ValueError" if bad in ("dims", "channels") else "TypeError"), last
    for kind, message in others:
        assert kind == "RuntimeError"
        assert "other rank(s) failed in their SyncBatchNorm call in forward" in message
        assert "num_features=3" in message


def _one_rank_bad_settings(rank: int, world_size: int, bad: str) -> tuple[str, str]:
    """The functional form, whose per-channel tensors and eps the caller passes: the last
    rank passes what torch's batch norm refuses."""
    x = torch.randn(4, 3, 2)
    weight, bias, mean, var = torch.rand(3), torch.randn(3), torch.zeros(3), torch.ones(3)
    eps = 1e-5
    if rank == world_size - 1:
        if bad == "bias size":  # broadcast into every channel before
            bias = torch.zeros(1)
        elif bad == "weight shape":  # (C, 1): a stack error after the collective before
            weight = weight.view(3, 1)
        elif bad == "mixed dtypes":  # float32 parameters, bfloat16 running statistics
            x, mean, var = x.bfloat16(), mean.bfloat16(), var.bfloat16()
        else:
            eps = 0.0
    result = outcome(
        lambda: syncbn.sync_batch_norm(x, mean, var, weight, bias, training=True, eps=eps)
    )
    # the group is still usable afterwards
    good = (torch.randn(2, 3, 2), torch.zeros(3), torch.ones(3))
    assert outcome(lambda: syncbn.sync_batch_norm(*good, training=True)) == ("ok", "")
    return result


@pytest.mark.parametrize("bad", ["bias size", "weight shape", "mixed dtypes", "eps"])
def test_bad_settings_on_one_rank_raise_on_every_rank(pool: WorkerPool, bad: str) -> None:
    """Like torch's batch norm, a synchronized call refuses per-channel tensors of another
    size, parameters and buffers of mixed dtypes, and (torch >= 2.10) eps <= 0."""
    *others, last = pool.run(_one_rank_bad_settings, bad)
    if bad == "eps" and not _autograd._REFUSES_EPS:
        # torch takes eps <= 0; the ranks' calls differ in eps, which the layer-order check
        # compares: every rank raises (torch 2.4.1, 2026-12-07: the test expected no error)
        for kind, message in (last, *others):
            assert kind == "RuntimeError" and "layer mismatch in forward" in message, message
            assert "another eps or momentum" in message
        return
    expected = {
        "bias size": (
            "RuntimeError",
            "to have shape (3,), one value per channel; got one of shape (1,)",
        ),
        "weight shape": ("RuntimeError", "got one of shape (3, 1)"),
        "mixed dtypes": (
            "RuntimeError",
            "of dtype torch.bfloat16 beside others of dtype torch.float32",
        ),
        "eps": ("ValueError", "batch_norm eps must be positive during training, but got 0.0"),
    }[bad]
    assert last[0] == expected[0] and expected[1] in last[1], last
    for kind, message in others:
        assert kind == "RuntimeError"
        assert "other rank(s) failed in their SyncBatchNorm call in forward" in message


def test_zero_dim_parameters_of_one_channel_are_taken_as_torch_takes_them() -> None:
    """A 0-dim weight and bias hold the one value of a 1-channel input: torch's batch norm
    takes them, and so does a masked (syncbn-computed) call; other shapes of C elements
    are refused there."""
    x = torch.randn(4, 1, 5, dtype=torch.float64)
    mask = torch.ones(4, 5, dtype=torch.bool)
    weight, bias = torch.tensor(2.0, dtype=torch.float64), torch.tensor(0.5, dtype=torch.float64)
    expected = torch.nn.functional.batch_norm(x, None, None, weight, bias, training=True)
    output = syncbn.sync_batch_norm(x, None, None, weight, bias, training=True, mask=mask)
    torch.testing.assert_close(output, expected)
    with pytest.raises(RuntimeError, match=r"to have shape \(1,\).*got one of shape \(1, 1\)"):
        syncbn.sync_batch_norm(x, None, None, weight.view(1, 1), bias, training=True, mask=mask)


def _zero_dim_parameters_beside_an_empty_rank(rank: int, world_size: int) -> list[torch.Tensor]:
    """Rank 0's batch is empty; rank 1 holds the whole global batch of one channel."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(4, 1, 5, dtype=torch.float64, generator=generator)
    x = (x[:0] if rank == 0 else x).requires_grad_()
    weight = torch.tensor(2.0, dtype=torch.float64, requires_grad=True)
    bias = torch.tensor(0.5, dtype=torch.float64, requires_grad=True)
    output = syncbn.sync_batch_norm(x, None, None, weight, bias, training=True)
    (output * torch.arange(output.numel()).view_as(output)).sum().backward()
    follow_up = syncbn.sync_batch_norm(torch.randn(3, 2, 4), None, None, training=True)
    return [output.detach(), x.grad, weight.grad, bias.grad, follow_up]  # type: ignore[list-item]


def test_zero_dim_parameters_beside_an_empty_rank_equal_the_global_batch(
    pool2: WorkerPool,
) -> None:
    """The empty rank normalized its batch after the collective with torch's kernel, which
    refuses a 0-dim weight there: it raised, and the ranks' collectives went out of step
    (gloo aborted the processes at the next call)."""
    empty, full = pool2.run(_zero_dim_parameters_beside_an_empty_rank, timeout=60.0)
    x = torch.randn(4, 1, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    x.requires_grad_()
    weight = torch.tensor([2.0], dtype=torch.float64, requires_grad=True)
    bias = torch.tensor([0.5], dtype=torch.float64, requires_grad=True)
    output = torch.nn.functional.batch_norm(x, None, None, weight, bias, training=True)
    (output * torch.arange(output.numel()).view_as(output)).sum().backward()
    torch.testing.assert_close(full[0], output.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(full[1], x.grad, rtol=1e-12, atol=1e-12)
    assert empty[0].shape == empty[1].shape == (0, 1, 5)
    for rank in (empty, full):  # each rank's local parameter gradients; they sum to torch's
        assert rank[2].shape == rank[3].shape == ()
    assert weight.grad is not None and bias.grad is not None
    torch.testing.assert_close(empty[2] + full[2], weight.grad.view(()), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(empty[3] + full[3], bias.grad.view(()), rtol=1e-12, atol=1e-12)


def _float16_without_cpu_kernels(rank: int, world_size: int) -> tuple[str, str]:
    """As on torch < 2.2, whose CPU batch_norm has no float16 kernel; a rank's batch is empty."""
    bn = syncbn.SyncBatchNorm(3)
    x = torch.randn(0 if rank == 0 else 4, 3, 2).half()
    saved, _autograd._CPU_FLOAT16 = _autograd._CPU_FLOAT16, False
    try:
        result = outcome(bn, x)
    finally:
        _autograd._CPU_FLOAT16 = saved
    assert outcome(bn, torch.randn(2, 3, 2)) == ("ok", "")  # the group is still usable
    return result


def test_float16_on_the_cpu_before_torch_2_2_raises_on_every_rank(pool: WorkerPool) -> None:
    """Before the collective, on every rank (the empty one too): after it, the ranks with
    data failed in batch_norm while an empty rank went on and waited in backward."""
    for kind, message in pool.run(_float16_without_cpu_kernels):
        assert kind == "RuntimeError"
        assert "float16 input on the CPU needs torch >= 2.2" in message


def _gradcheck_alone(rank: int, world_size: int) -> bool:
    """gradcheck the autograd function through a real gloo group of one rank."""
    groups = [dist.new_group([r]) for r in range(world_size)]
    torch.manual_seed(rank)
    x = torch.randn(3, 2, 4, dtype=torch.float64, requires_grad=True)
    weight = torch.rand(2, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(2, dtype=torch.float64, requires_grad=True)
    options = TrainOptions(ProcessGroupReducer(groups[rank], 1), LayerInfo("gradcheck", 2))

    def fn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return sync_batch_norm_train(x, weight, bias, options)

    return torch.autograd.gradcheck(fn, (x, weight, bias))


def test_gradcheck_at_world_size_one(pool2: WorkerPool) -> None:
    assert pool2.run(_gradcheck_alone) == [True, True]


def _assert_in_step(bn: torch.nn.Module) -> None:
    """After a scenario's error: a float64 training step of ``bn`` on every rank passes
    (a rank left out of step would pair its collectives with the wrong calls)."""
    assert outcome(lambda: bn(torch.randn(2, 3, dtype=torch.float64)).sum().backward()) == (
        "ok",
        "",
    )


def _double_backward(rank: int, world_size: int, head_trainable: bool) -> tuple[str, str]:
    """A gradient penalty through a masked synchronized layer, whose output feeds a
    trainable or a frozen head (with a frozen one the output gradient needs no grad, and
    ``once_differentiable`` returned second derivatives that were silently wrong).
    Unmasked calls differentiate twice (tests/test_double_backward.py)."""
    torch.manual_seed(rank)
    bn = syncbn.SyncBatchNorm(3).double()
    head = torch.nn.Linear(3, 1).double().requires_grad_(head_trainable)
    x = torch.randn(4, 3, 5, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(4, 5) < 0.8

    def penalty() -> None:
        output = bn(x, mask).transpose(1, 2)
        (gradient,) = torch.autograd.grad(head(output).sum(), x, create_graph=True)
        gradient.pow(2).sum().backward()

    result = outcome(penalty)
    # every rank raised before the collective and joined it with the error flag
    _assert_in_step(bn)
    return result


@pytest.mark.parametrize("head_trainable", [True, False], ids=["trainable", "frozen"])
def test_masked_double_backward_raises_on_every_rank(
    pool2: WorkerPool, head_trainable: bool
) -> None:
    for kind, message in pool2.run(_double_backward, head_trainable):
        assert kind == "RuntimeError", message
        assert "trying to differentiate twice" in message and "create_graph=True" in message


@pytest.mark.parametrize("head_trainable", [True, False], ids=["trainable", "frozen"])
def test_double_backward_raises_for_a_masked_call_alone(head_trainable: bool) -> None:
    """Without a process group a masked call runs the same backward; an unmasked call is
    torch's BatchNorm, which differentiates twice (here against torch itself)."""
    torch.manual_seed(0)
    bn = syncbn.SyncBatchNorm(3).double()
    head = torch.nn.Linear(3, 1).double().requires_grad_(head_trainable)
    x = torch.randn(4, 3, 5, dtype=torch.float64, requires_grad=True)
    mask = torch.ones(4, 5, dtype=torch.bool)
    with pytest.raises(RuntimeError, match="trying to differentiate twice"):
        torch.autograd.grad(head(bn(x, mask).transpose(1, 2)).sum(), x, create_graph=True)
    penalties = []
    for layer in (bn, torch.nn.BatchNorm1d(3).double()):
        (gradient,) = torch.autograd.grad(
            head(layer(x).transpose(1, 2)).sum(), x, create_graph=True
        )
        penalties.append(torch.autograd.grad(gradient.pow(2).sum(), x)[0])
    torch.testing.assert_close(penalties[0], penalties[1])


class _FailOnce(TorchDispatchMode):
    """Raises at the first call of ``op``: a local error (out of memory, say) in the maths."""

    def __init__(self, op: Any) -> None:
        super().__init__()
        self.op, self.failed = op, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is self.op and not self.failed:
            self.failed = True
            raise RuntimeError("simulated out of memory")
        return func(*args, **(kwargs or {}))


def _one_rank_fails_in_backward(rank: int, world_size: int, where: str) -> tuple[str, str]:
    """The last rank fails in backward before the collective: reading the saved tensors (a
    ``saved_tensors_hooks`` unpack that raises, as ``save_on_cpu``'s copy back can), or in
    a differentiable backward's local maths (``create_graph=True``). Both ran outside the
    error flag's reach: the other ranks waited for the process group's timeout (a review,
    2026-12-07)."""
    bn = syncbn.SyncBatchNorm(3).double()
    x = torch.randn(4, 3, 5, dtype=torch.float64, requires_grad=True)
    failing = rank == world_size - 1

    def unpack(tensor: torch.Tensor) -> torch.Tensor:
        if failing:
            raise RuntimeError("simulated out of memory while unpacking a saved tensor")
        return tensor

    def step() -> None:
        if where == "unpack":
            with torch.autograd.graph.saved_tensors_hooks(lambda tensor: tensor, unpack):
                output = bn(x)
            output.sum().backward()
            return
        output = bn(x)
        mode = _FailOnce(torch.ops.aten.sub.Tensor if failing else None)
        with mode:
            (gradient,) = torch.autograd.grad(output.pow(2).sum(), x, create_graph=True)
        gradient.pow(2).sum().backward()

    result = outcome(step)
    _assert_in_step(bn)  # the failing rank joined the collective with the error flag
    return result


@pytest.mark.parametrize("where", ["unpack", "double backward"])
def test_a_failure_in_backward_before_the_collective_raises_on_every_rank(
    pool2: WorkerPool, where: str
) -> None:
    other, failed = pool2.run(_one_rank_fails_in_backward, where, timeout=120.0)
    assert failed[0] == "RuntimeError" and "simulated out of memory" in failed[1], failed
    assert other[0] == "RuntimeError", other
    assert "1 other rank(s) failed in their SyncBatchNorm call in backward" in other[1], other


def _ranks_disagree(rank: int, world_size: int, what: str, compiled: bool) -> tuple[str, str]:
    """The last rank's layer or input differs from the others' in ``what``: its ``eps`` or
    ``momentum`` (each rank then normalized with its own ``eps``, or moved its running
    statistics apart, silently), or whether its input needs a gradient (an empty batch
    made with ``torch.empty``: its backward joined no collective, and the other ranks
    waited there for the process group's timeout). A review, 2026-12-07."""
    torch._dynamo.reset()
    last = rank == world_size - 1
    if what == "functional eps":  # compiled: the op's fingerprint had the default eps
        mean = torch.zeros(3, dtype=torch.float64)

        def functional(input: torch.Tensor) -> torch.Tensor:
            return syncbn.functional.sync_batch_norm(
                input, mean, torch.ones(3, dtype=torch.float64), training=True,
                eps=10.0 if last else 1e-3,
            )  # fmt: skip

        run_functional = torch.compile(functional, fullgraph=True, backend="aot_eager")
        result = outcome(run_functional, torch.randn(4, 3, 5, dtype=torch.float64))
        assert not mean.any()  # a call whose checks fail moves nothing
        return result
    eps = 0.1 if last and what == "eps" else 1e-5
    momentum = None if last and what == "momentum" else 0.1
    bn = syncbn.SyncBatchNorm(3, eps=eps, momentum=momentum).double()
    run = torch.compile(bn, fullgraph=True, backend="aot_eager") if compiled else bn
    x = torch.randn(4, 3, 5, dtype=torch.float64, requires_grad=True)
    if last and what == "requires_grad":
        x = torch.empty(0, 3, 5, dtype=torch.float64)
    running_mean = bn.running_mean
    assert running_mean is not None
    before = running_mean.clone()
    result = outcome(lambda: run(x).sum().backward())
    assert torch.equal(running_mean, before)  # a call whose checks fail moves nothing
    # every rank raised in the same forward collective: the group is in step
    bn.eps, bn.momentum = 1e-5, 0.1
    y = torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True)
    assert outcome(lambda: run(y).sum().backward()) == ("ok", "")
    return result


#: a compiled case: its scenario compiles with ``fullgraph=True``, which needs torch >= 2.4
_FULLGRAPH = pytest.mark.skipif(
    not _compiled.FULLGRAPH, reason="fullgraph compile needs torch >= 2.4"
)


@pytest.mark.parametrize(
    ("what", "compiled"),
    [
        ("eps", False),
        ("momentum", False),
        ("requires_grad", False),
        pytest.param("requires_grad", True, marks=_FULLGRAPH),
        pytest.param("functional eps", True, marks=_FULLGRAPH),
    ],
    ids=["eps", "momentum", "requires_grad", "requires_grad-compiled", "functional-eps-compiled"],
)
def test_ranks_that_disagree_on_settings_or_requires_grad_raise_on_every_rank(
    pool2: WorkerPool, what: str, compiled: bool
) -> None:
    results = pool2.run(_ranks_disagree, what, compiled, timeout=120.0)
    for rank, (kind, message) in enumerate(results):
        assert kind == "RuntimeError", (rank, message)
        if what == "requires_grad":
            assert "inputs disagree on requires_grad in forward" in message, (rank, message)
            assert "the input of 1 of 2 ranks needs a gradient" in message, (rank, message)
            here = "does not need one" if rank == 1 else "needs one"
            assert f"this rank's {here}" in message, (rank, message)
        else:
            assert "layer mismatch in forward" in message, (rank, message)
            assert "another eps or momentum" in message, (rank, message)


def _settings_that_agree(rank: int, world_size: int, case: str) -> tuple[str, str]:
    """Calls that must not raise (a review of the checks above, 2026-12-07): a forward
    under ``torch.no_grad()`` where one rank's input requires grad (no backward can
    follow: the eager call said it would join one), and the functional form with an eps
    of its own, compiled on one rank and eager on the other (the compiled op's
    fingerprint had the default eps)."""
    torch._dynamo.reset()
    x = torch.randn(4, 3, 5, dtype=torch.float64, requires_grad=rank == 0)
    running_mean = torch.zeros(3, dtype=torch.float64)
    running_var = torch.ones(3, dtype=torch.float64)
    if case == "no_grad":
        bn = syncbn.SyncBatchNorm(3).double()
        with torch.no_grad():
            return outcome(bn, x)

    def functional(input: torch.Tensor) -> torch.Tensor:
        return syncbn.functional.sync_batch_norm(
            input, running_mean, running_var, training=True, eps=1e-3, momentum=0.2
        )

    run = torch.compile(functional, fullgraph=True, backend="aot_eager") if rank else functional
    return outcome(run, x.detach())


@pytest.mark.parametrize(
    "case", ["no_grad", pytest.param("functional eps, compiled and eager", marks=_FULLGRAPH)]
)
def test_ranks_that_agree_raise_nothing(pool2: WorkerPool, case: str) -> None:
    assert pool2.run(_settings_that_agree, case, timeout=120.0) == [("ok", "")] * 2


def _outside_group(rank: int, world_size: int) -> tuple[str, str]:
    group = dist.new_group([0])
    bn = syncbn.SyncBatchNorm(3, process_group=group)
    return outcome(bn, torch.randn(4, 3))


def test_process_group_without_this_rank(pool2: WorkerPool) -> None:
    inside, outside = pool2.run(_outside_group)
    assert inside == ("ok", "")  # a group of one: plain BatchNorm
    assert outside[0] == "RuntimeError" and "does not contain this rank" in outside[1]


def _device_not_supported(rank: int, world_size: int) -> tuple[str, str]:
    return outcome(distributed.check_device_backend, torch.device("meta"), None)


def test_device_unsupported_by_backend_names_both(pool2: WorkerPool) -> None:
    for kind, message in pool2.run(_device_not_supported):
        assert kind == "RuntimeError"
        assert "'meta'" in message and "'gloo'" in message


@pytest.mark.parametrize(
    ("backend", "device", "supported"),
    [
        ("nccl", "cpu", False),
        ("nccl", "cuda", True),
        ("gloo", "cpu", True),
        ("cpu:gloo,cuda:nccl", "cpu", True),
        ("cpu:gloo,cuda:nccl", "cuda", True),
        ("cpu:gloo,cuda:nccl", "xpu", False),
    ],
)
def test_backend_capability_table(backend: str, device: str, supported: bool) -> None:
    devices = distributed._supported_device_types(backend)
    assert devices is not None and (device in devices) == supported


def test_unknown_backend_is_left_to_the_collective() -> None:
    assert distributed._supported_device_types("my_custom_backend") is None


def test_create_process_group_needs_init() -> None:
    with pytest.raises(RuntimeError, match="init_process_group"):
        syncbn.create_process_group(1)


def test_a_layer_whose_group_was_destroyed_with_the_default_group_raises(
    tmp_path: Any,
) -> None:
    """After ``destroy_process_group()`` no default group is left, and a layer that still
    holds its explicit group trained as plain BatchNorm, silently (a review); it raises the
    destroyed group's error, and with ``process_group = None`` it is plain BatchNorm."""
    store = f"file://{tmp_path / 'store'}"
    dist.init_process_group("gloo", init_method=store, rank=0, world_size=1)
    try:
        layer = syncbn.SyncBatchNorm(3, process_group=dist.new_group([0]))
        layer(torch.randn(4, 3))
    finally:
        dist.destroy_process_group()
    with pytest.raises(RuntimeError, match="process group has been destroyed"):
        layer(torch.randn(4, 3))
    layer.process_group = None
    x = torch.randn(4, 3)
    plain = torch.nn.functional.batch_norm(x, None, None, training=True)
    torch.testing.assert_close(layer(x), plain)


def _blocks(rank: int, world_size: int, group_size: int) -> dict[str, object]:
    try:
        group = syncbn.create_process_group(group_size)
    except ValueError as error:
        return {"error": str(error)}
    bn = syncbn.SyncBatchNorm(2, momentum=1.0, process_group=group)
    x = torch.full((3, 2), float(rank))  # each rank's batch has its own mean
    bn(x)
    assert bn.running_mean is not None
    return {"size": dist.get_world_size(group), "mean": bn.running_mean.tolist()}


def test_create_process_group_syncs_within_blocks(pool2: WorkerPool) -> None:
    alone = pool2.run(_blocks, 1)
    assert [r["size"] for r in alone] == [1, 1]
    assert [r["mean"] for r in alone] == [[0.0, 0.0], [1.0, 1.0]]  # local statistics
    together = pool2.run(_blocks, 2)
    assert [r["mean"] for r in together] == [[0.5, 0.5], [0.5, 0.5]]  # global statistics


def test_create_process_group_needs_a_divisor(pool3: WorkerPool) -> None:
    for result in pool3.run(_blocks, 2):
        assert result == {
            "error": "group_size must be a positive divisor of the world size, got "
            "group_size=2 and world_size=3"
        }
