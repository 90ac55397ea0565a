"""Training calls under torch's tracing and estimation tools: ``FakeTensorMode`` (memory
and runtime estimators), ``make_fx`` (graphs replayed later) and vectorized transforms.

A review of 2026-12-08 found each case here failing, or worse: a ``make_fx`` graph of a
synchronized call that gave other numbers than BatchNorm on the global batch, silently.
The fake-mode calls between real steps: ``tests/test_batchnorm.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _harness import WorkerPool
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import syncbn
from syncbn import _autograd, _compiled

#: every test reads the deferred checks its calls left (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("no_checks_left_pending")


def _model() -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.ReLU())


def test_a_model_converts_and_reverts_inside_fake_tensor_mode() -> None:
    """Memory estimators build models inside ``FakeTensorMode``. The twin of a converted
    layer was built on the meta device, whose tensors are real ones that the mode refuses
    ("Please convert all Tensors to FakeTensors first"); torch's own conversion worked."""
    with FakeTensorMode():
        model = _model()
        syncbn.convert_sync_batchnorm(model)
        layer = model[1]
        assert isinstance(layer, syncbn.SyncBatchNorm)
        assert all(isinstance(t, FakeTensor) for t in (layer.weight, layer.running_var))
        model(torch.randn(2, 3, 5, 5)).sum().backward()
        syncbn.revert_sync_batchnorm(model)
        assert type(model[1]) is nn.BatchNorm2d and model[1].weight is layer.weight


def test_a_real_model_converted_inside_fake_tensor_mode_stays_real() -> None:
    """A real model converted inside the mode (an estimator that converts the user's
    model in its block): the twin shares the real tensors, but kept the fake site tensor
    it was built with, and its first compiled call failed ("Please convert all Tensors to
    FakeTensors first"; a review, 2026-12-08)."""
    model = _model()
    with FakeTensorMode():
        syncbn.convert_sync_batchnorm(model)
    layer = model[1]
    assert isinstance(layer, syncbn.SyncBatchNorm)
    assert type(layer.weight.data) is torch.Tensor and type(layer._site) is torch.Tensor
    if not _compiled.FULLGRAPH:
        return  # (torch < 2.4 compiles the layer's calls across a graph break, eagerly)
    x, mask = torch.randn(2, 3, 5, 5), torch.rand(2, 5, 5) < 0.7
    compiled = torch.compile(
        lambda x, m: layer(model[0](x), m), fullgraph=True, backend="aot_eager"
    )
    torch.testing.assert_close(compiled(x, mask), layer(model[0](x), mask))


def _local_call(path: str) -> Any:
    """A layer call by ``path`` on ``(4, 4, 5, 5)`` inputs: masked (no process group:
    syncbn's own path), or synchronized (one process, the reducer that sums nothing)."""
    layer = syncbn.SyncBatchNorm(4)
    if path == "masked":
        mask = torch.rand(4, 5, 5) < 0.7
        return lambda x: layer(x, mask)
    options = _autograd.TrainOptions(_autograd.LocalReducer(), _autograd.LayerInfo("fake", 4))
    return lambda x: _autograd.sync_batch_norm_train(x, layer.weight, layer.bias, options)


@pytest.mark.parametrize("path", ["masked", "synchronized"])
def test_fake_tensors_run_after_their_modes_block(path: str) -> None:
    """A fake forward's backward run after the ``with FakeTensorMode():`` block, and a
    forward there of a layer built inside it: fake tensors run each torch op in their mode,
    so torch's BatchNorm works there; syncbn's calls saw no active mode and mixed in real
    constants, or read a fake value back (the CPU's immediate checks)."""
    with FakeTensorMode():
        call = _local_call(path)
        x = torch.randn(4, 4, 5, 5, requires_grad=True)
        output = call(x)
    (grad,) = torch.autograd.grad(output.sum(), x)
    again = call(x)
    for tensor in (output, grad, again):
        assert isinstance(tensor, FakeTensor) and tensor.shape == x.shape


def test_make_fx_of_a_masked_call_replays_like_eager() -> None:
    """A masked CPU call with immediate checks reads its valid count back, which ``make_fx``
    cannot record ("trying to get value out of a tracing tensor"); while it records, the
    checks are deferred, and the graph replays with autograd on (its running statistics'
    ``out=`` writes refused targets that needed a gradient)."""
    torch.manual_seed(0)
    traced_layer, eager_layer = syncbn.SyncBatchNorm(3), syncbn.SyncBatchNorm(3)
    graph = make_fx(lambda x, m: traced_layer(x, m), tracing_mode="real")(
        torch.randn(4, 3, 5), torch.rand(4, 5) < 0.7
    )
    eager_layer(torch.randn(4, 3, 5), torch.rand(4, 5) < 0.7)  # the same state moves
    eager_layer.load_state_dict(traced_layer.state_dict())
    x, mask = torch.randn(4, 3, 5, requires_grad=True), torch.rand(4, 5) < 0.5
    torch.testing.assert_close(graph(x, mask), eager_layer(x, mask))
    torch.testing.assert_close(traced_layer.running_var, eager_layer.running_var)


def _replayed_graph(rank: int, world_size: int) -> dict[str, float]:
    """Rank 0 records a synchronized training call with ``make_fx`` and replays the graph
    on another batch; rank 1 calls its layer eagerly, with batches of other sizes (the
    global count changes between the two calls). The errors of rank 0's replay against
    BatchNorm on the global batch."""
    torch.manual_seed(0)
    sizes = {0: (4, 4), 1: (2, 6)}  # per rank, the recorded call's batch and the replay's
    batches = {r: [torch.randn(n, 3, dtype=torch.float64) for n in sizes[r]] for r in sizes}
    layer = syncbn.SyncBatchNorm(3, dtype=torch.float64)
    if rank == 1:
        for x in batches[1]:
            layer(x)
        return {}
    graph = make_fx(lambda x: layer(x), tracing_mode="real")(batches[0][0])
    x = batches[0][1].clone().requires_grad_()  # replayed with autograd on
    output = graph(x)
    syncbn.check_deferred()  # the recorded call's checks (deferred while recording)
    reference = nn.BatchNorm1d(3, dtype=torch.float64)
    reference(torch.cat([batches[0][0], batches[1][0]]))
    expected = reference(torch.cat([batches[0][1], batches[1][1]]))[: len(x)]
    assert layer.running_var is not None and reference.running_var is not None
    return {
        "output": (output - expected).abs().max().item(),
        "running_var": (layer.running_var - reference.running_var).abs().max().item(),
    }


def test_make_fx_of_a_synchronized_call_replays_with_the_global_statistics(
    pool2: WorkerPool,
) -> None:
    """The recorded graph read the global count of the traced call back (immediate checks)
    and kept it as a constant, and recorded ``dist.all_reduce`` without its wait (gloo
    sums on a thread of its own): its replay normalized with another batch's statistics,
    0.4-1.0 off, and different at each run, with no error. While ``make_fx`` records, the
    checks are deferred (the count stays a tensor) and the sum goes through torch's
    functional collectives, which it records with their wait."""
    errors, _ = pool2.run(_replayed_graph, timeout=60.0)
    assert errors["output"] < 1e-12 and errors["running_var"] < 1e-12, errors


def _vectorized_jacobian(rank: int, world_size: int) -> str:
    layer = syncbn.SyncBatchNorm(3, dtype=torch.float64)
    x = torch.randn(4, 3, dtype=torch.float64)
    try:
        torch.autograd.functional.jacobian(layer, x, vectorize=True)
    except RuntimeError as error:
        return str(error)
    return "no error"


def test_a_vectorized_jacobian_of_a_synchronized_call_says_why_it_fails(
    pool2: WorkerPool,
) -> None:
    """vmap has no batching rule for a collective. The error blamed the other ranks (check
    that every rank calls every layer in the same order); it names the transform now."""
    for message in pool2.run(_vectorized_jacobian, timeout=60.0):
        assert message.startswith(
            "SyncBatchNorm: a synchronized training call cannot run under a torch.func transform"
        ), message
