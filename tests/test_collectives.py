"""Communication: one collective per call in forward and backward, none in eval or alone,
payload independent of world size; numerical stability of the cross-rank merge."""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, TypeVar

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _harness import WorkerPool
from torch.nn.modules.batchnorm import _BatchNorm

import syncbn
from syncbn._cli.measure import Collective, count_collectives


def _count_collectives(rank: int, world_size: int, channels: int) -> dict[str, Any]:
    singleton_groups = [dist.new_group([r]) for r in range(world_size)]
    bn = syncbn.SyncBatchNorm(channels)
    x = torch.randn(2 + rank, channels, 4, 4, requires_grad=True)
    result: dict[str, Any] = {}
    with count_collectives() as log:
        y = bn(x)
        result["forward"] = list(log)
        log.clear()
        y.sum().backward()
        result["backward"] = list(log)
        log.clear()
        y = bn(x.detach())
        result["forward_no_input_grad"] = list(log)
        log.clear()
        bn.eval()
        bn(x).sum().backward()
        result["eval"] = list(log)
        log.clear()
        bn_alone = syncbn.SyncBatchNorm(channels, process_group=singleton_groups[rank])
        bn_alone(x).sum().backward()
        result["group_of_one"] = list(log)
    return result


@pytest.mark.parametrize("channels", [1, 16])
def test_one_collective_each_way_with_payload_independent_of_world_size(
    pool2: WorkerPool, pool3: WorkerPool, channels: int
) -> None:
    forward_bytes = (2 * channels + 5) * 8
    backward_bytes = forward_bytes  # one length both ways: a forward meeting a backward fails
    results = pool2.run(_count_collectives, channels) + pool3.run(_count_collectives, channels)
    for result in results:
        assert result["forward"] == [Collective("all_reduce", forward_bytes)]
        assert result["backward"] == [Collective("all_reduce", backward_bytes)]
        # input needs no gradient: statistics still sync, backward needs no collective
        assert result["forward_no_input_grad"] == [Collective("all_reduce", forward_bytes)]
        assert result["eval"] == []
        assert result["group_of_one"] == []


#: each rank's share of the 4 samples of the no-autograd test
_SHARES = (slice(0, 3), slice(3, 4))


def _no_autograd_batch() -> torch.Tensor:
    """The global batch of the no-autograd test, float64."""
    gen = torch.Generator().manual_seed(5)
    return torch.randn(4, 3, 4, 4, generator=gen, dtype=torch.float64) * 3 + 2


def _forward_without_autograd(rank: int, world_size: int, context: str) -> dict[str, Any]:
    """A training-mode forward under ``torch.no_grad()`` or ``torch.inference_mode()``
    (statistics recomputed for evaluation, a teacher model in train mode): rank ``rank``'s
    output, running statistics and collectives."""
    x = _no_autograd_batch()
    bn = syncbn.SyncBatchNorm(3, momentum=0.5).double()
    guard = torch.no_grad() if context == "no_grad" else torch.inference_mode()
    with count_collectives() as log, guard:
        output = bn(x[_SHARES[rank]])
    return {
        "output": output.clone(),
        "running_mean": bn.running_mean,
        "running_var": bn.running_var,
        "collectives": list(log),
    }


@pytest.mark.parametrize("context", ["no_grad", "inference_mode"])
def test_a_training_forward_without_autograd_synchronizes(pool2: WorkerPool, context: str) -> None:
    """One collective, the global batch's statistics, nothing for a backward to wait for."""
    reference = torch.nn.BatchNorm2d(3, momentum=0.5).double()
    expected = reference(_no_autograd_batch()).detach()
    for rank, result in enumerate(pool2.run(_forward_without_autograd, context)):
        assert result["collectives"] == [Collective("all_reduce", (2 * 3 + 5) * 8)]
        torch.testing.assert_close(
            result["output"], expected[_SHARES[rank]], rtol=1e-10, atol=1e-12
        )
        for key in ("running_mean", "running_var"):
            torch.testing.assert_close(result[key], getattr(reference, key), rtol=1e-12, atol=0)


def _output_grad() -> torch.Tensor:
    """The output gradient of the hooks test, over the global batch."""
    return torch.randn(4, 3, 4, 4, generator=torch.Generator().manual_seed(6), dtype=torch.float64)


def _hooked_step(rank: int, world_size: int, anomaly: bool) -> dict[str, Any]:
    """A training step of a layer with module backward hooks (what gradient-inspection and
    pruning tools register), under autograd's anomaly mode or not: what the hooks saw, the
    gradients and the collectives."""
    x = _no_autograd_batch()[_SHARES[rank]].requires_grad_()
    dy = _output_grad()[_SHARES[rank]]
    bn = syncbn.SyncBatchNorm(3).double()
    seen: dict[str, torch.Tensor] = {}

    def before(_: Any, grad_output: Any) -> None:
        seen["pre"] = grad_output[0].clone()

    def after(_: Any, grad_input: Any, grad_output: Any) -> None:
        seen.update(input=grad_input[0].clone(), output=grad_output[0].clone())

    bn.register_full_backward_pre_hook(before)
    bn.register_full_backward_hook(after)
    mode = torch.autograd.detect_anomaly() if anomaly else contextlib.nullcontext()
    with mode, count_collectives() as log:
        (bn(x) * dy).sum().backward()
    assert x.grad is not None and bn.weight.grad is not None and bn.bias.grad is not None
    return {
        "seen": seen,
        "dy": dy,
        "x_grad": x.grad,
        "weight_grad": bn.weight.grad,
        "bias_grad": bn.bias.grad,
        "collectives": list(log),
    }


@pytest.mark.parametrize("anomaly", [False, True], ids=["hooks", "hooks-anomaly-mode"])
def test_module_backward_hooks_see_the_synchronized_gradients(
    pool2: WorkerPool, anomaly: bool
) -> None:
    x = _no_autograd_batch().requires_grad_()
    reference = torch.nn.BatchNorm2d(3).double()
    (reference(x) * _output_grad()).sum().backward()
    assert x.grad is not None and reference.weight.grad is not None
    results = pool2.run(_hooked_step, anomaly)
    for rank, result in enumerate(results):
        assert result["collectives"] == [Collective("all_reduce", (2 * 3 + 5) * 8)] * 2
        torch.testing.assert_close(result["x_grad"], x.grad[_SHARES[rank]], rtol=1e-10, atol=1e-12)
        assert torch.equal(result["seen"]["input"], result["x_grad"])
        assert torch.equal(result["seen"]["output"], result["dy"])
        assert torch.equal(result["seen"]["pre"], result["dy"])
    # each rank's parameter gradients are its share of the global batch's (DDP sums them)
    for name, expected in (
        ("weight_grad", reference.weight.grad),
        ("bias_grad", reference.bias.grad),
    ):
        total = sum(result[name] for result in results)
        torch.testing.assert_close(total, expected, rtol=1e-10, atol=1e-12)


def test_no_process_group_is_exactly_batchnorm() -> None:
    assert not dist.is_initialized()
    torch.manual_seed(0)
    sync_bn, plain_bn = (
        syncbn.SyncBatchNorm(4, momentum=None),
        torch.nn.BatchNorm2d(4, momentum=None),
    )
    plain_bn.load_state_dict(sync_bn.state_dict())
    with count_collectives() as log:
        for step in range(3):
            x = torch.randn(3, 4, 5, 5, requires_grad=True)
            x_ref = x.detach().clone().requires_grad_()
            y, y_ref = sync_bn(x), plain_bn(x_ref)
            y.square().sum().backward()
            y_ref.square().sum().backward()
            assert x.grad is not None and x_ref.grad is not None
            assert torch.equal(y, y_ref) and torch.equal(x.grad, x_ref.grad), step
        sync_bn.eval(), plain_bn.eval()
        x = torch.randn(2, 4, 5, 5)
        assert torch.equal(sync_bn(x), plain_bn(x))
    assert log == []
    assert sync_bn.weight.grad is not None and plain_bn.weight.grad is not None
    assert torch.equal(sync_bn.weight.grad, plain_bn.weight.grad)
    for key, value in plain_bn.state_dict().items():
        assert torch.equal(sync_bn.state_dict()[key], value), key


def _eval_is_local(rank: int, world_size: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(rank)
    x = torch.randn(3, 4, 5, 5) * (rank + 1)
    tracked = syncbn.SyncBatchNorm(4).eval()
    untracked = syncbn.SyncBatchNorm(4, track_running_stats=False).eval()
    assert tracked.running_mean is not None and tracked.running_var is not None
    with torch.no_grad():
        tracked.running_mean.fill_(0.5)
        tracked.running_var.fill_(2.0)
    with count_collectives() as log, torch.no_grad():
        out_tracked, out_untracked = tracked(x), untracked(x)
    assert log == []
    expected_tracked = (x - 0.5) / torch.sqrt(torch.tensor(2.0 + 1e-5))
    expected_untracked = F.batch_norm(x, None, None, training=True)
    return {
        "tracked": (out_tracked - expected_tracked).abs().max(),
        "untracked": (out_untracked - expected_untracked).abs().max(),
    }


def test_eval_uses_running_stats_or_local_batch(pool2: WorkerPool) -> None:
    for result in pool2.run(_eval_is_local):
        assert result["tracked"] < 1e-5
        assert result["untracked"] < 1e-5


#: a scenario run eagerly and under ``torch.compile(fullgraph=True)``
_EAGER_AND_COMPILED = pytest.mark.parametrize(
    "compiled",
    [
        False,
        pytest.param(
            True,
            marks=pytest.mark.skipif(
                not hasattr(torch.library, "custom_op"),
                reason="fullgraph compile needs torch >= 2.4",
            ),
        ),
    ],
    ids=["eager", "compiled"],
)


def _large_mean_statistics(
    rank: int, world_size: int, sizes: tuple[int, ...], compiled: bool
) -> dict[str, torch.Tensor]:
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(sum(sizes), 4, 16, 16, generator=gen, dtype=torch.float64) + 1e4).float()
    start = sum(sizes[:rank])
    bn = syncbn.SyncBatchNorm(4, momentum=1.0)  # running stats = this batch's statistics
    run = torch.compile(bn, fullgraph=True, backend="aot_eager") if compiled else bn
    output = run(x[start : start + sizes[rank]])
    assert bn.running_mean is not None and bn.running_var is not None
    return {
        "stats": torch.stack([bn.running_mean, bn.running_var]).double(),
        "output": output.detach().double(),
    }


@_EAGER_AND_COMPILED
@pytest.mark.timeout(180)  # the compiled scenario's bound plus the pools' start
def test_float32_mean_1e4_std_1_is_accurate(
    pool2: WorkerPool, pool3: WorkerPool, compiled: bool
) -> None:
    """float32 data with |mean| / std = 1e4: statistics to 1e-4 relative, and the normalized
    output to float32 rounding of the shifted data, 1e-5 (the compiled composite ops too)."""
    for pool, sizes in ((pool2, (3, 5)), (pool3, (2, 0, 6))):
        assert_large_mean_accurate(sizes, pool.run(_large_mean_statistics, sizes, compiled))


def assert_large_mean_accurate(sizes: tuple[int, ...], per_rank: list[dict[str, Any]]) -> None:
    """Check :func:`_large_mean_statistics`' results against float64 statistics of the
    same float32 data."""
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(sum(sizes), 4, 16, 16, generator=gen, dtype=torch.float64) + 1e4).float()
    var, mean = torch.var_mean(x.double(), dim=(0, 2, 3), correction=1)
    biased = var * (x.numel() / 4 - 1) / (x.numel() / 4)
    expected = (x.double() - mean.view(1, -1, 1, 1)) / (biased.view(1, -1, 1, 1) + 1e-5).sqrt()
    for rank, result in enumerate(per_rank):
        stats = result["stats"]
        assert ((stats[0] - mean).abs() / mean.abs()).max() < 1e-4
        assert ((stats[1] - var).abs() / var).max() < 1e-4
        start = sum(sizes[:rank])
        local = expected[start : start + sizes[rank]]
        assert result["output"].shape == local.shape
        # ~1e-6 measured; subtracting a float32 mean of 1e4 (rounded by ~5e-4) would miss
        assert bool(((result["output"] - local).abs() < 1e-5).all())


#: an outlier's value in :func:`outlier_statistics`: about 70 standard deviations of the
#: local batch it sits in (one value among ~5000 of N(0, 1))
_OUTLIER = 1e4


def _outlier_batch(sizes: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``(N, 4, 32, 32)`` data from N(0, 1), each rank's first value per channel an
    outlier (``_OUTLIER``), and a mask with a rank's first positions valid, 3 in 4 others."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(sum(sizes), 4, 32, 32, generator=gen, dtype=torch.float64).float()
    mask = torch.rand(sum(sizes), 32, 32, generator=gen) < 0.75
    for rank, size in enumerate(sizes):
        if size:
            start = sum(sizes[:rank])
            x[start, :, 0, 0] = _OUTLIER
            mask[start, 0, 0] = True
    return x, mask


def outlier_statistics(
    rank: int,
    world_size: int,
    sizes: tuple[int, ...],
    compiled: bool,
    masked: bool,
    device: str = "cpu",
    backend: str = "aot_eager",
) -> dict[str, torch.Tensor]:
    """One rank's share of :func:`_outlier_batch` through a synchronized layer (also for
    tests/test_cuda.py, on ``device``, compiled with ``backend``): running statistics and
    output, on the CPU."""
    torch._dynamo.reset()
    x, mask = _outlier_batch(sizes)
    start, stop = sum(sizes[:rank]), sum(sizes[: rank + 1])
    bn = syncbn.SyncBatchNorm(4, momentum=1.0, affine=False, device=device)  # the batch's
    run = torch.compile(bn, fullgraph=True, backend=backend) if compiled else bn
    local_mask = mask[start:stop].to(device) if masked else None
    output = run(x[start:stop].to(device), local_mask)
    assert bn.running_mean is not None and bn.running_var is not None
    return {
        "stats": torch.stack([bn.running_mean, bn.running_var]).double().cpu(),
        "output": output.detach().double().cpu(),
    }


@pytest.mark.parametrize("masked", [False, True], ids=["unmasked", "masked"])
@_EAGER_AND_COMPILED
@pytest.mark.timeout(180)  # the compiled scenario's bound plus the pools' start
def test_an_outlier_at_a_ranks_first_value_stays_accurate(
    pool2: WorkerPool, pool3: WorkerPool, compiled: bool, masked: bool
) -> None:
    """float32 data whose first value on each rank is ~70 standard deviations out: the
    statistics and the output as float64 BatchNorm's on the same data, to float32's
    rounding. When each rank shifted its sums by its first value, the statistics were off by
    up to 1e-3 and the output by 5e-4 (relative); below 1e-6 with the sampled shift."""
    for pool, sizes in ((pool2, (3, 5)), (pool3, (2, 0, 6))):
        results = pool.run(outlier_statistics, sizes, compiled, masked)
        assert_outlier_accurate(sizes, masked, results)


def assert_outlier_accurate(
    sizes: tuple[int, ...], masked: bool, per_rank: list[dict[str, torch.Tensor]]
) -> None:
    """:func:`outlier_statistics`' results against float64 statistics of the same float32
    data (its valid positions): relative 1e-5."""
    x, mask = _outlier_batch(sizes)
    valid = mask if masked else torch.ones_like(mask)
    values = x.double().permute(0, 2, 3, 1)[valid]  # (M, C): the valid positions
    var, mean = torch.var_mean(values, dim=0, correction=1)
    biased = var * (values.shape[0] - 1) / values.shape[0]
    expected = (x.double() - mean.view(1, -1, 1, 1)) / (biased.view(1, -1, 1, 1) + 1e-5).sqrt()
    expected = expected * valid.unsqueeze(1)  # padded positions are zero
    for rank, result in enumerate(per_rank):
        stats = result["stats"]
        assert ((stats[0] - mean).abs() / mean.abs()).max() < 1e-5
        assert ((stats[1] - var).abs() / var).max() < 1e-5
        local = expected[sum(sizes[:rank]) : sum(sizes[: rank + 1])]
        assert result["output"].shape == local.shape
        assert bool(((result["output"] - local).abs() <= 1e-5 * (1 + local.abs())).all())


#: ``momentum`` and ``eps`` in the forms torch's argument parser takes for a float
_FLOAT_ARGUMENTS: dict[str, tuple[Any, Any]] = {
    "float": (0.3, 1e-5),
    "numpy": (np.float32(0.3), np.float64(1e-3)),
    "tensor": (torch.tensor(0.3, dtype=torch.float64), torch.tensor(1e-3)),
    "int": (1, 1),
}


def _functional_matches(rank: int, world_size: int, arguments: str) -> dict[str, torch.Tensor]:
    momentum, eps = _FLOAT_ARGUMENTS[arguments]
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 3, 7, generator=gen, dtype=torch.float64)
    weight, bias = torch.rand(3, dtype=torch.float64), torch.randn(3, dtype=torch.float64)
    sizes = [2, 3, 0] if world_size == 3 else [1, 4]
    start = sum(sizes[:rank])
    mean, var = torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64)
    local = x[start : start + sizes[rank]]
    out = syncbn.sync_batch_norm(local, mean, var, weight, bias, True, momentum, eps)
    ref_mean, ref_var = torch.zeros_like(mean), torch.ones_like(var)
    ref = F.batch_norm(x, ref_mean, ref_var, weight, bias, True, momentum, eps)
    return {
        "output": torch.cat([(out - ref[start : start + sizes[rank]]).flatten(), torch.zeros(1)])
        .abs()
        .max(),
        "mean": (mean - ref_mean).abs().max(),
        "var": (var - ref_var).abs().max(),
    }


@pytest.mark.parametrize("arguments", list(_FLOAT_ARGUMENTS))
def test_functional_form_matches_batch_norm(pool: WorkerPool, arguments: str) -> None:
    """Also with ``momentum`` and ``eps`` given as F.batch_norm takes them: NumPy scalars,
    0-dim tensors, integers (before, a float or an int momentum only)."""
    for result in pool.run(_functional_matches, arguments):
        for key, error in result.items():
            assert error < 1e-12, key


def _saved_bytes(rank: int, world_size: int, layer_class: str) -> int:
    """Bytes of the distinct storages autograd keeps for one layer's backward."""
    torch.manual_seed(0)
    layer = syncbn.SyncBatchNorm(8) if layer_class == "sync" else torch.nn.BatchNorm2d(8)
    x = torch.randn(3, 8, 5, 5, requires_grad=True)
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        y = layer(x)
    y.sum().backward()  # the saved tensors are the ones backward needs
    return sum(storages.values())


def test_saves_no_more_for_backward_than_batchnorm(pool2: WorkerPool) -> None:
    """Every tensor backward needs goes through save_for_backward, and no more than BatchNorm's."""
    synced = pool2.run(_saved_bytes, "sync")
    plain = pool2.run(_saved_bytes, "plain")
    input_bytes = 3 * 8 * 5 * 5 * 4
    for sync_bytes, plain_bytes in zip(synced, plain):
        assert input_bytes < sync_bytes <= plain_bytes


_Layer = TypeVar("_Layer", bound=_BatchNorm)
#: the process groups of the subgroup test: ranks 0 and 2 together, rank 1 alone
_SUBGROUPS = [[0, 2], [1]]
#: each rank's local batch size in the subgroup test (uneven within the group [0, 2])
_SUBGROUP_SIZES = (3, 2, 5)


def _subgroup_batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s input and output gradient in the subgroup test, float64."""
    gen = torch.Generator().manual_seed(10 + rank)
    shape = (_SUBGROUP_SIZES[rank], 3, 4, 4)
    x = torch.randn(shape, generator=gen, dtype=torch.float64) * (rank + 1) + rank
    return x, torch.randn(shape, generator=gen, dtype=torch.float64)


def _with_subgroup_affine(bn: _Layer) -> _Layer:
    """``bn`` in float64 with the subgroup test's weight and bias."""
    gen = torch.Generator().manual_seed(0)
    bn.double()
    with torch.no_grad():
        bn.weight.copy_(torch.rand(3, generator=gen, dtype=torch.float64) + 0.5)
        bn.bias.copy_(torch.randn(3, generator=gen, dtype=torch.float64))
    return bn


def _in_subgroup(rank: int, world_size: int, compiled: bool) -> dict[str, Any]:
    """One training step of a SyncBatchNorm on the subgroup of ``rank``; its results, and
    the collectives of the eager step."""
    torch._dynamo.reset()
    group, _ = dist.new_subgroups_by_enumeration(_SUBGROUPS)
    bn = _with_subgroup_affine(syncbn.SyncBatchNorm(3, momentum=0.3, process_group=group))
    run = torch.compile(bn, fullgraph=True, backend="aot_eager") if compiled else bn
    x, dy = _subgroup_batch(rank)
    x.requires_grad_()
    with count_collectives() as log:
        y = run(x)
        y.backward(dy)
    assert x.grad is not None and bn.weight.grad is not None and bn.bias.grad is not None
    return {
        "output": y.detach(),
        "input grad": x.grad,
        "weight grad": bn.weight.grad,
        "bias grad": bn.bias.grad,
        "running_mean": bn.running_mean,
        "running_var": bn.running_var,
        "collectives": len(log),
    }


def _subgroup_reference(rank: int) -> dict[str, Any]:
    """BatchNorm on the concatenated batches of ``rank``'s subgroup; ``rank``'s share.

    The parameter gradients are each rank's share of the group batch's (its own
    positions' terms), which DDP's all_reduce then sums, as torch's SyncBatchNorm does."""
    members = next(ranks for ranks in _SUBGROUPS if rank in ranks)
    batches = [_subgroup_batch(member) for member in members]
    x = torch.cat([x for x, _ in batches]).requires_grad_()
    dy = torch.cat([dy for _, dy in batches])
    reference = _with_subgroup_affine(torch.nn.BatchNorm2d(3, momentum=0.3))
    y = reference(x)
    y.backward(dy)
    assert x.grad is not None and reference.weight.grad is not None
    start = sum(_SUBGROUP_SIZES[m] for m in members[: members.index(rank)])
    local = slice(start, start + _SUBGROUP_SIZES[rank])
    weight, bias = (
        parameter.detach().view(-1, 1, 1) for parameter in (reference.weight, reference.bias)
    )
    normalized = (y.detach()[local] - bias) / weight
    return {
        "output": y.detach()[local],
        "input grad": x.grad[local],
        "weight grad": (dy[local] * normalized).sum((0, 2, 3)),
        "bias grad": dy[local].sum((0, 2, 3)),
        "running_mean": reference.running_mean,
        "running_var": reference.running_var,
    }


@_EAGER_AND_COMPILED
@pytest.mark.timeout(180)  # the compiled scenario's bound plus the pool's start
def test_a_subgroup_synchronizes_its_own_ranks_only(pool3: WorkerPool, compiled: bool) -> None:
    """Process groups that are proper subsets of the world (ranks 0 and 2, and rank 1
    alone): each rank gets BatchNorm of its own group's batch, one collective each way
    within a group of two, none alone. Compiled graphs find their group by name."""
    results = pool3.run(_in_subgroup, compiled, timeout=120.0)
    for rank, result in enumerate(results):
        collectives = result.pop("collectives")
        if not compiled:
            assert collectives == (0 if rank == 1 else 2), (rank, collectives)
        expected = _subgroup_reference(rank)
        assert result.keys() == expected.keys()
        for key, value in expected.items():
            torch.testing.assert_close(result[key], value, rtol=1e-10, atol=1e-12, msg=key)
    # within the group, the same running statistics bitwise; rank 1's are its own
    for key in ("running_mean", "running_var"):
        assert torch.equal(results[0][key], results[2][key]), key
        assert not torch.allclose(results[0][key], results[1][key]), key


def _replica_of(bn: syncbn.SyncBatchNorm) -> syncbn.SyncBatchNorm:
    """``bn`` copied as ``torch.nn.DataParallel`` copies it for each of several devices
    (``torch.nn.parallel.replicate`` calls this per module; its parameters plain tensors)."""
    replica = bn._replicate_for_data_parallel()
    for name, parameter in bn.named_parameters():
        setattr(replica, name, parameter * 1)
    return replica


def _data_parallel_replica(rank: int, world_size: int) -> dict[str, Any]:
    """A layer copied as ``torch.nn.DataParallel`` copies it for each of several devices
    (``torch.nn.parallel.replicate`` calls this per module), trained over a process group
    of 2 ranks; then in eval mode, and the original layer."""
    bn = syncbn.SyncBatchNorm(3)
    replica = _replica_of(bn)
    x = torch.randn(2, 3, 4, 4)
    with count_collectives() as log:
        outcome: dict[str, Any] = {}
        try:
            replica(x)
        except RuntimeError as error:
            outcome["train"] = str(error)
        outcome["train collectives"] = len(log)
        replica.eval()
        outcome["eval"] = torch.equal(replica(x), bn.eval()(x))
        bn.train()(x)
        outcome["original collectives"] = len(log)
    return outcome


def test_a_data_parallel_replica_refuses_to_synchronize(pool2: WorkerPool) -> None:
    """Replicas of one process would all call the group's collectives at once from their
    threads: summing the wrong partners' statistics, or hanging. Each raises before any
    collective (on every rank alike), and eval mode, which never communicates, works."""
    for result in pool2.run(_data_parallel_replica):
        assert "torch.nn.DataParallel replica" in result["train"], result
        assert "DistributedDataParallel with one process per device" in result["train"]
        assert result["train collectives"] == 0
        assert result["eval"] is True
        assert result["original collectives"] == 1


def test_a_data_parallel_replica_without_a_group_warns_that_it_is_local() -> None:
    """Without a group of several ranks a replica normalizes its own device's slice, as
    torch.nn.SyncBatchNorm's would: a model converted to SyncBatchNorm and run in
    nn.DataParallel is warned, once, that its replicas do not synchronize."""
    bn = syncbn.SyncBatchNorm(3).double()
    replica = _replica_of(bn)
    x = torch.randn(2, 3, 4, 4, dtype=torch.float64)
    with pytest.warns(UserWarning, match="DataParallel replica, and there is no process group"):
        output = replica(x)
    torch.testing.assert_close(output, F.batch_norm(x, None, None, training=True), rtol=0, atol=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        bn(x)  # the layer itself, alone: plain BatchNorm, no warning
        replica.eval()(x)  # eval mode: running statistics, as everywhere
