"""Double backward (``create_graph=True``) through synchronized layers: a gradient penalty
equals one process's on the global batch, and mismatched ranks raise."""

from __future__ import annotations

from typing import Any, cast

import pytest
import torch
from _gold import Tolerance
from _harness import WorkerPool, outcome
from torch import nn

import syncbn
from syncbn._cli.measure import Collective, count_collectives

#: per world size, each rank's batch size: uneven, and on 3 ranks an empty one
SIZES = {2: (3, 2), 3: (2, 0, 3)}
TOL: Tolerance = {"rtol": 1e-9, "atol": 1e-11}


def _model(head_trainable: bool, channels_last: bool = False) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1),
        nn.BatchNorm2d(3),
        nn.Tanh(),
        nn.Conv2d(3, 3, 1),
        # straight into the head: a frozen head's output gradient here is a constant
        nn.BatchNorm2d(3, affine=False),
        nn.Flatten(),
        nn.Linear(3 * 4 * 4, 1),
    ).double()
    model[6].requires_grad_(head_trainable)
    first = cast(nn.BatchNorm2d, model[1])
    with torch.no_grad():  # weights away from 1, so that their derivatives show
        first.weight.uniform_(0.5, 1.5)
        first.bias.uniform_(-0.5, 0.5)
    if channels_last:
        model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
    return model


def _batch(total: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(total, 2, 4, 4, generator=gen, dtype=torch.float64) * 2 + 3


def _share(rank: int, world_size: int) -> slice:
    """Rank ``rank``'s samples of the global batch of :data:`SIZES`."""
    sizes = SIZES[world_size]
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


def _penalized_step(model: nn.Module, x: torch.Tensor) -> dict[str, Any]:
    """WGAN-GP's step: the loss plus the squared input gradient, differentiated again."""
    x = x.clone().requires_grad_()
    out = model(x)
    (gradient,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    (out.sum() + gradient.pow(2).sum()).backward()
    return {
        "input gradient": gradient.detach(),
        "x.grad": x.grad,
        **{f"{name}.grad": p.grad for name, p in model.named_parameters() if p.grad is not None},
        **{name: buffer for name, buffer in model.named_buffers()},
    }


def penalized_ranks_step(
    rank: int, world_size: int, head_trainable: bool, variant: str, device: str = "cpu"
) -> dict[str, Any]:
    """One rank's :func:`_penalized_step` of its share of the batch (also for
    tests/test_cuda.py, on ``device``), what it returns on the CPU, and its collectives."""
    x = _batch(sum(SIZES[world_size]))[_share(rank, world_size)].to(device)
    channels_last = variant == "channels_last"
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    model = syncbn.convert_sync_batchnorm(_model(head_trainable, channels_last)).to(device)
    if variant == "deferred":  # the accelerators' checks, on the CPU
        for layer in model.modules():
            if isinstance(layer, syncbn.SyncBatchNorm):
                layer.check_mode = "deferred"
    with count_collectives() as log:
        result = {key: value.cpu() for key, value in _penalized_step(model, x).items()}
    result["collectives"] = list(log)
    return result


def assert_equals_the_global_batch(results: list[dict[str, Any]], head_trainable: bool) -> None:
    """``penalized_ranks_step``'s results against one process on the global batch."""
    expected = _penalized_step(_model(head_trainable), _batch(sum(SIZES[len(results)])))
    for rank, result in enumerate(results):
        local = _share(rank, len(results))
        for key in ("input gradient", "x.grad"):
            torch.testing.assert_close(result[key], expected[key][local], **TOL, msg=key)
        # per layer: forward 1; the input gradient's backward (create_graph) 1; the last
        # backward 1 for the loss and 2 for the penalty (the input gradient's sums, the
        # statistics' gradients); every collective of one size (2C+5 float64 values)
        assert result["collectives"] == [Collective("all_reduce", (2 * 3 + 5) * 8)] * 10, result[
            "collectives"
        ]
    for key, value in expected.items():
        if key.endswith(".grad") and key != "x.grad":
            total = sum(result[key] for result in results)
            torch.testing.assert_close(total, value, **TOL, msg=key)
        elif "running" in key or "num_batches" in key:
            for result in results:
                torch.testing.assert_close(result[key], value, **TOL, msg=key)


@pytest.mark.parametrize("variant", ["contiguous", "channels_last", "deferred"])
@pytest.mark.parametrize("head_trainable", [True, False], ids=["trainable", "frozen"])
def test_a_gradient_penalty_equals_the_global_batchs(
    pool: WorkerPool, head_trainable: bool, variant: str
) -> None:
    """Input gradients, the penalty's parameter gradients (summed over ranks, as DDP does)
    and running statistics of one process on the global batch; a frozen head leaves the
    last layer's output gradient without history, the case that once_differentiable got
    silently wrong."""
    results = pool.run(penalized_ranks_step, head_trainable, variant)
    assert_equals_the_global_batch(results, head_trainable)


def _hessian_vector_product(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """The product of the loss's Hessian in the parameters with a fixed vector: the weight
    gradients differentiated again (what sharpness measures and second-order methods do)."""
    parameters = [p for p in model.parameters() if p.requires_grad]
    gen = torch.Generator().manual_seed(2)
    vector = [torch.randn(p.shape, generator=gen, dtype=p.dtype) for p in parameters]
    loss = model(x).pow(2).sum()
    grads = torch.autograd.grad(loss, parameters, create_graph=True)
    dot = torch.stack([(g * v.to(g.device)).sum() for g, v in zip(grads, vector)]).sum()
    return [h.detach().cpu() for h in torch.autograd.grad(dot, parameters)]


def _ranks_hessian_vector_product(rank: int, world_size: int) -> list[torch.Tensor]:
    model = syncbn.convert_sync_batchnorm(_model(True))
    return _hessian_vector_product(model, _batch(sum(SIZES[world_size]))[_share(rank, world_size)])


def test_a_hessian_vector_product_in_the_parameters_equals_the_global_batchs(
    pool: WorkerPool,
) -> None:
    """Each rank's share (summed over ranks, as DDP sums gradients) of the product that one
    process computes on the global batch: the weight gradients' derivatives too."""
    results = pool.run(_ranks_hessian_vector_product)
    expected = _hessian_vector_product(_model(True), _batch(sum(SIZES[pool.world_size])))
    for index, value in enumerate(expected):
        total = sum(result[index] for result in results)
        torch.testing.assert_close(total, value, **TOL, msg=f"parameter {index}")


class _PlainBatchNorm(nn.Module):
    """Training-mode BatchNorm as plain torch ops, whose derivatives of every order are
    exact (torch's own kernel's third derivative is not), with ``layer``'s parameters."""

    def __init__(self, layer: nn.BatchNorm2d) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var, mean = torch.var_mean(x, dim=(0, 2, 3), correction=0, keepdim=True)
        y = (x - mean) * (var + self.layer.eps).rsqrt()
        if self.layer.weight is None or self.layer.bias is None:
            return y
        return y * self.layer.weight.view(1, -1, 1, 1) + self.layer.bias.view(1, -1, 1, 1)


def _third_order(model: nn.Module, x: torch.Tensor, vector: torch.Tensor) -> list[torch.Tensor]:
    """The gradient of ``<d/dx |d out.sum() / dx|², vector>``: third derivatives of the
    model in its input, and its parameters' derivatives of that."""
    x = x.clone().requires_grad_()
    (first,) = torch.autograd.grad(model(x).sum(), x, create_graph=True)
    (second,) = torch.autograd.grad(first.pow(2).sum(), x, create_graph=True)
    parameters = [p for p in model.parameters() if p.requires_grad]
    inputs = [x, *parameters]
    # the head's bias is not in the input gradient's graph: its derivative is zero
    grads = torch.autograd.grad((second * vector).sum(), inputs, allow_unused=True)
    return [torch.zeros_like(t) if g is None else g.detach() for g, t in zip(grads, inputs)]


def _third_order_vector(total: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(3)
    return torch.randn(total, 2, 4, 4, generator=gen, dtype=torch.float64)


#: per world size, each rank's batch size for third derivatives: uneven, none empty (with
#: an empty rank, torch's convolution returns no gradient of its double backward there, so
#: that rank's graph lacks nodes that the others run collectives in: README, Limitations)
THIRD_ORDER_SIZES = {2: (3, 2), 3: (2, 1, 3)}


def _ranks_third_order(rank: int, world_size: int) -> list[torch.Tensor]:
    model = syncbn.convert_sync_batchnorm(_model(True))
    sizes = THIRD_ORDER_SIZES[world_size]
    share = slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))
    total = sum(sizes)
    return _third_order(model, _batch(total)[share], _third_order_vector(total)[share])


def test_third_derivatives_equal_the_global_batchs(pool: WorkerPool) -> None:
    """Differentiated three times, a synchronized call is BatchNorm on the global batch:
    its statistics' first derivatives were exact and their second ones were not (the
    variance's deviation held the mean constant: off by 0.4 in the third derivative)."""
    results = pool.run(_ranks_third_order)
    model = cast(nn.Sequential, _model(True))
    for index in (1, 4):
        model[index] = _PlainBatchNorm(cast(nn.BatchNorm2d, model[index]))
    sizes = THIRD_ORDER_SIZES[pool.world_size]
    total = sum(sizes)
    expected = _third_order(model, _batch(total), _third_order_vector(total))
    for rank, result in enumerate(results):
        local = slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))
        torch.testing.assert_close(result[0], expected[0][local], **TOL, msg="input")
    for index, value in enumerate(expected[1:], start=1):
        total_grad = sum(result[index] for result in results)
        torch.testing.assert_close(total_grad, value, **TOL, msg=f"parameter {index}")


def _mismatched(rank: int, world_size: int, check_mode: str) -> tuple[str, str]:
    """Rank 0 differentiates its input gradient again; rank 1 only its loss."""
    model = syncbn.convert_sync_batchnorm(_model(True))
    for module in model.modules():
        if isinstance(module, syncbn.SyncBatchNorm):
            module.check_mode = check_mode
    x = _batch(4)[2 * rank : 2 * rank + 2].requires_grad_()
    out = model(x)

    def step() -> None:
        if rank == 0:
            (gradient,) = torch.autograd.grad(out.sum(), x, create_graph=True)
            gradient.pow(2).sum().backward()
        else:  # a second plain backward: collectives of the same size, another phase
            out.sum().backward(retain_graph=True)
            out.sum().backward()
        syncbn.check_deferred()  # the problem of a last call, deferred

    return outcome(step)


@pytest.mark.parametrize("check_mode", ["immediate", "deferred"])
def test_ranks_in_different_phases_raise(pool2: WorkerPool, check_mode: str) -> None:
    """Deferred too: the double backward's collectives raise a problem that an earlier
    collective found before they join (rank 1 raised it and left; rank 0 waited in its next
    collective for the process group's timeout, then failed with gloo's error)."""
    results = pool2.run(_mismatched, check_mode, timeout=30.0)
    for kind, message in results:
        assert kind == "RuntimeError", message
    assert "double backward" in results[0][1], results[0][1]
