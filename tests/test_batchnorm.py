"""SyncBatchNorm on 2 and 3 gloo ranks equals torch's BatchNorm on the global batch."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch
from _gold import Case, compare, reference, run_rank
from _harness import WorkerPool
from torch import nn

import syncbn
from syncbn import _autograd, _protocol, _stats

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


#: inputs whose strides are not simply contiguous: what torch's batch norm makes of them is
#: its ``suggest_memory_format`` (contiguous unless the strides are channels last)
_LAYOUTS = {
    "NC-transposed": lambda dtype: torch.randn(3, 5, dtype=dtype).t(),
    "NLC-transposed": lambda dtype: torch.randn(4, 7, 3, dtype=dtype).transpose(1, 2),
    "HW-transposed": lambda dtype: torch.randn(2, 3, 5, 4, dtype=dtype).transpose(2, 3),
    "contiguous-sliced": lambda dtype: torch.randn(2, 3, 6, 5, dtype=dtype)[..., ::2],
    "channels-last": lambda dtype: torch.randn(2, 3, 6, 5, dtype=dtype).contiguous(
        memory_format=torch.channels_last
    ),
    "channels-last-sliced": lambda dtype: torch.randn(2, 3, 6, 5, dtype=dtype).contiguous(
        memory_format=torch.channels_last
    )[:, :, ::2],
    "channels-last-3d-sliced": lambda dtype: torch.randn(2, 3, 4, 3, 5, dtype=dtype).contiguous(
        memory_format=torch.channels_last_3d
    )[..., 1:],
}


@pytest.mark.parametrize("masked", [False, True], ids=["unmasked", "masked"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", sorted(_LAYOUTS))
def test_the_output_is_laid_out_as_batchnorm_lays_it_out(
    layout: str, dtype: torch.dtype, masked: bool
) -> None:
    """A synchronized call's output has torch's strides, so that ``.view`` works on it as on
    BatchNorm's: a transposed ``(N, L, C)`` batch (a Conformer's ``x.transpose(1, 2)``) gave
    an output in the transposed layout. A mask of all-valid positions changes nothing. So
    does the input gradient, whatever the output gradient's strides: a masked float32 call
    gave the contiguous layout of an output gradient (or of an expanded one, the gradient
    of ``output.sum()``) for a channels-last input."""
    torch.manual_seed(0)
    x = _LAYOUTS[layout](dtype).requires_grad_()
    channels = x.shape[1]
    param_dtype = torch.float32 if dtype == torch.bfloat16 else dtype
    reference = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}[
        x.dim()
    ](channels, dtype=param_dtype)
    reference.weight.data.uniform_(0.5, 2.0)
    reference.bias.data.normal_()
    expected = reference(x)
    options = _autograd.TrainOptions(
        _autograd.LocalReducer(), _autograd.LayerInfo("layout", channels)
    )
    mask = torch.ones(x.shape[:1] + x.shape[2:], dtype=torch.bool) if masked else None
    output = _autograd.sync_batch_norm_train(
        x, reference.weight, reference.bias, options, mask=mask
    )
    # the same strides: a view that works on BatchNorm's output works on this one
    assert output.stride() == expected.stride(), (output.stride(), expected.stride())
    torch.testing.assert_close(output, expected)
    for grad_output in (torch.randn(x.shape, dtype=dtype), torch.ones((), dtype=dtype)):
        grad_output = grad_output.expand(x.shape)  # (a no-op for the first)
        (grad,) = torch.autograd.grad(output, x, grad_output, retain_graph=True)
        (expected_grad,) = torch.autograd.grad(expected, x, grad_output, retain_graph=True)
        assert grad.stride() == expected_grad.stride(), (grad.stride(), expected_grad.stride())
        tolerance = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {}
        torch.testing.assert_close(grad, expected_grad, **tolerance)  # type: ignore[arg-type]


def test_a_layer_whose_tracking_was_switched_off_leaves_its_buffers_alone() -> None:
    """As torch's layers do, training passes no running statistics when tracking was switched
    off after the layer was built (it passed them with a factor of 0, which wrote 0 * NaN
    into them)."""
    layer, reference = syncbn.SyncBatchNorm(2), nn.BatchNorm1d(2)
    for bn in (layer, reference):
        bn.track_running_stats = False
    x = torch.tensor([[1.0, float("nan")], [3.0, 1.0], [2.0, 0.0]])
    torch.testing.assert_close(layer(x), reference(x), equal_nan=True)
    for bn in (layer, reference):
        assert bn.running_mean is not None and bn.running_var is not None
        assert bn.num_batches_tracked is not None
        assert bn.running_mean.tolist() == [0.0, 0.0] and bn.running_var.tolist() == [1.0, 1.0]
        assert int(bn.num_batches_tracked) == 0


@pytest.mark.parametrize("check_mode", ["auto", "immediate", "deferred"])
@pytest.mark.parametrize("path", ["layer", "layer-masked", "synchronized"])
def test_a_training_call_on_the_meta_device_infers_batchnorms_shapes(
    path: str, check_mode: str
) -> None:
    """Shape inference (a model built on the meta device, run before it is materialised):
    a training call gives BatchNorm's output and gradients' shapes, dtypes and strides. A
    masked or synchronized call used to fail there: it copied its cached constants through
    pinned memory, which needs an accelerator, and its checks read the header back. The
    meta tensors hold no values, so nothing is checked, and a later call on real tensors
    is not disturbed."""
    meta = torch.device("meta")
    x = torch.empty(4, 3, 5, 6, device=meta).to(memory_format=torch.channels_last)
    x.requires_grad_()
    reference = nn.BatchNorm2d(3, device=meta)
    layer = syncbn.SyncBatchNorm(3, device=meta)
    layer.check_mode = check_mode
    mask = torch.ones(4, 5, 6, dtype=torch.bool, device=meta) if path == "layer-masked" else None
    if path == "synchronized":
        info = _autograd.LayerInfo("meta", 3, check_mode=check_mode)
        options = _autograd.TrainOptions(_autograd.LocalReducer(), info)
        output = _autograd.sync_batch_norm_train(x, layer.weight, layer.bias, options)
    else:
        output = layer(x, mask)
    expected = reference(x)
    for actual, wanted in (
        (output, expected),
        *zip(
            torch.autograd.grad(output.sum(), (x, layer.weight, layer.bias)),
            torch.autograd.grad(expected.sum(), (x, reference.weight, reference.bias)),
        ),
    ):
        assert actual.device == meta
        assert (actual.shape, actual.dtype, actual.stride()) == (
            wanted.shape,
            wanted.dtype,
            wanted.stride(),
        )
    real = syncbn.SyncBatchNorm(3)
    real.check_mode = "deferred"
    for _ in range(2):  # the second call inspects the first's deferred checks
        real(torch.randn(4, 3, 5, 6), torch.rand(4, 5, 6) < 0.5).sum().backward()
    _protocol.raise_deferred(wait=True)


def _train_call(
    path: str, layer: syncbn.SyncBatchNorm, x: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """A training call of ``layer`` by ``path``: the layer alone with a mask (syncbn's own
    path; unmasked it is torch's BatchNorm), or the synchronized path in one process."""
    if path == "synchronized":
        info = _autograd.LayerInfo("fake", layer.num_features, check_mode=layer.check_mode)
        options = _autograd.TrainOptions(_autograd.LocalReducer(), info)
        return _autograd.sync_batch_norm_train(
            x,
            layer.weight,
            layer.bias,
            options,
            running_mean=layer.running_mean,
            running_var=layer.running_var,
            num_batches_tracked=layer.num_batches_tracked,
        )
    return layer(x, mask if path == "layer-masked" else None)  # type: ignore[no-any-return]


@pytest.mark.parametrize("check_mode", ["auto", "immediate", "deferred"])
@pytest.mark.parametrize("path", ["layer-masked", "synchronized"])
def test_a_training_call_under_fake_tensor_mode_leaves_real_calls_undisturbed(
    path: str, check_mode: str
) -> None:
    """Memory and runtime estimators run a model under ``FakeTensorMode`` (tensors with
    shapes and no values), often between real steps. A fake training call gives
    BatchNorm's shapes; before 2026-12-08 an immediate one raised (its checks read the
    header back), and a deferred one left fake tensors behind: its constants in syncbn's
    caches and its checks in the queue, which the next real call read and failed on
    (``DataDependentOutputException``). Neither is kept now, the real calls' pending checks
    wait for a real call, and real calls before and after give BatchNorm's numbers."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    def real_steps() -> None:
        torch.manual_seed(0)
        x = torch.randn(4, 3, 5, 6, dtype=torch.float64, requires_grad=True)
        mask = torch.ones(4, 5, 6, dtype=torch.bool)  # all valid: BatchNorm's numbers
        layer = syncbn.SyncBatchNorm(3, dtype=torch.float64)
        layer.check_mode = check_mode
        reference = nn.BatchNorm2d(3, dtype=torch.float64)
        for _ in range(2):  # the second call inspects the first's deferred checks
            output = _train_call(path, layer, x, mask)
            expected = reference(x)
            torch.testing.assert_close(output, expected)
            grads = torch.autograd.grad(output.sum() + (output**2).sum(), x)
            torch.testing.assert_close(
                grads, torch.autograd.grad(expected.sum() + (expected**2).sum(), x)
            )
        torch.testing.assert_close(layer.running_var, reference.running_var)

    real_steps()  # real constants in the caches, a real check pending where deferred
    with FakeTensorMode() as fake_mode:  # refuses real tensors: the model and batch are fake
        # found by its key, and by the search of a torch that has none (the same mode)
        in_stack = _protocol._active_mode("NO_SUCH_KEY", lambda: FakeTensorMode)
        assert _protocol.faking() and in_stack() is fake_mode
        x = torch.empty(4, 3, 5, 6).to(memory_format=torch.channels_last).requires_grad_()
        layer, reference = syncbn.SyncBatchNorm(3), nn.BatchNorm2d(3)
        layer.check_mode = check_mode
        output = _train_call(path, layer, x, torch.rand(4, 5, 6) < 0.5)
        expected = reference(x)
        grads = torch.autograd.grad(output.sum(), (x, layer.weight, layer.bias))
        expected_grads = torch.autograd.grad(expected.sum(), (x, reference.weight, reference.bias))
        for actual, wanted in ((output, expected), *zip(grads, expected_grads)):
            assert (actual.shape, actual.dtype, actual.stride()) == (
                wanted.shape,
                wanted.dtype,
                wanted.stride(),
            )
        syncbn.check_deferred()  # the real checks wait: their values are not fake
    assert all(type(pending.values) is torch.Tensor for pending in _protocol._pending)
    real_steps()
    _protocol.raise_deferred(wait=True)


@pytest.mark.parametrize("order", [(0, 3, 1, 2), (2, 0, 3, 1)])
def test_output_gradients_laid_out_otherwise_give_the_same_gradients(
    order: tuple[int, ...],
) -> None:
    """An output gradient whose strides differ from the input's, where a size-1 dimension
    makes the layouts hard to tell apart (``(2, 3, 1, 5)``, the gradient's memory in the
    order of a permutation): torch's CPU backward kernel gave sums 1.7-2 off, and so did
    syncbn's gradients, where the same gradient laid out as the input gave the right ones
    (a fuzzer, 2026-12-07; torch's BatchNorm is wrong there too)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 1, 5, generator=generator, dtype=torch.float64)
    dy = torch.randn(2, 3, 1, 5, generator=generator, dtype=torch.float64)
    inverse = [order.index(dim) for dim in range(4)]
    laid_out = dy.permute(order).contiguous().permute(inverse)
    assert laid_out.stride() != x.stride()
    weight = torch.rand(3, generator=generator, dtype=torch.float64).add(0.5).requires_grad_()
    options = _autograd.TrainOptions(_autograd.LocalReducer(), _autograd.LayerInfo("", 3))

    def gradients(grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        input = x.clone().requires_grad_()
        output = _autograd.sync_batch_norm_train(input, weight, None, options)
        return torch.autograd.grad(output, (input, weight), grad)

    for got, expected in zip(gradients(laid_out), gradients(dy)):
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def test_output_gradients_are_copied_only_where_torch_reads_them_wrong() -> None:
    """The copy above costs a pass over the gradient: none where the kernel reads the
    layout right (the same layout, strides of size-1 dimensions aside; an expanded
    gradient; an input without a size-1 dimension, as a transposed ``(N, L, C)`` batch)."""
    from syncbn._kernels.generic import _laid_out_like

    transposed = torch.randn(4, 7, 3).transpose(1, 2)
    unambiguous = torch.randn(4, 3, 7)
    assert _laid_out_like(unambiguous, transposed) is unambiguous
    x = torch.randn(2, 3, 1, 5)
    assert _laid_out_like(torch.ones(1).expand(2, 3, 1, 5), x).stride() == (0, 0, 0, 0)
    same = torch.randn(2, 3, 5).unsqueeze(2)  # strides (15, 5, 1, 1): only H's differs
    assert _laid_out_like(same, x) is same
    other = torch.randn(2, 5, 3).permute(0, 2, 1).unsqueeze(2)
    assert _laid_out_like(other, x).stride() == x.stride()


@pytest.mark.parametrize(
    ("shape", "layout"),
    [((1, 2, 2**19), "contiguous"), ((1, 2, 64, 64, 64), "channels_last"), ((2**19, 2), "rows")],
)
@pytest.mark.parametrize("masked", [False, True], ids=["unmasked", "masked"])
def test_float32_sums_of_many_values_per_channel_stay_accurate(
    shape: tuple[int, ...], layout: str, masked: bool
) -> None:
    """The CPU's batch-norm reductions accumulate float32 sequentially per channel (a plane
    in 16 vector lanes, rows in one): with 2**19 values per channel on a rank the output
    and input gradient were 5e-6 (a plane) to 1e-4 (rows) off, torch's BatchNorm (float64
    statistics) 2e-7 (a review of 3-D volumes, 2026-12-06). Split into chunks, summed in
    float64: within 1e-6, relative to the largest value."""
    generator = torch.Generator().manual_seed(0)
    exact = torch.randn(*shape, generator=generator, dtype=torch.float64) * 2 + 1
    grad = torch.randn(*shape, generator=generator, dtype=torch.float64)
    x = exact.float()
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last_3d)
    x.requires_grad_()
    options = _autograd.TrainOptions(_autograd.LocalReducer(), _autograd.LayerInfo("chunks", 2))
    running_var = torch.ones(2)
    mask = torch.ones((shape[0], *shape[2:]), dtype=torch.bool) if masked else None
    output = _autograd.sync_batch_norm_train(
        x, None, None, options, running_var=running_var, running_mean=torch.zeros(2), mask=mask
    )
    output.backward(grad.float())
    reference_layer = nn.BatchNorm3d(2) if len(shape) == 5 else nn.BatchNorm1d(2)
    reference_layer = reference_layer.double().requires_grad_(False)
    exact.requires_grad_()
    expected = reference_layer(exact)
    expected.backward(grad)

    def error(got: torch.Tensor, want: torch.Tensor | None) -> float:
        assert want is not None
        want = want.detach()
        return float((got.detach().double() - want).abs().max() / want.abs().max())

    assert x.grad is not None
    assert error(output, expected) < 1e-6
    assert error(x.grad, exact.grad) < 1e-6
    # the running variance moved by 0.1 of the batch's unbiased variance (about 4)
    assert error(running_var, reference_layer.running_var) < 1e-6


def _bfloat16_training_call(check_mode: str) -> list[torch.Tensor]:
    """One synchronized training call (one process) of a layer in bfloat16 throughout:
    the output, the input gradient and the running statistics."""
    torch.manual_seed(0)
    x = (torch.randn(6, 3, 5) * 2 + 1).bfloat16().requires_grad_()
    weight = torch.rand(3).bfloat16().requires_grad_()
    bias = torch.randn(3).bfloat16().requires_grad_()
    running_mean, running_var = torch.zeros(3).bfloat16(), torch.ones(3).bfloat16()
    layer = _autograd.LayerInfo("bf16", 3, check_mode=check_mode)
    options = _autograd.TrainOptions(_autograd.LocalReducer(), layer)
    y = _autograd.sync_batch_norm_train(
        x, weight, bias, options, running_mean=running_mean, running_var=running_var
    )
    y.float().square().sum().backward()
    syncbn.check_deferred()
    assert x.grad is not None
    return [y.detach(), x.grad, running_mean, running_var]


def test_a_bfloat16_layer_with_deferred_checks_moves_its_running_statistics() -> None:
    """A layer in bfloat16 throughout (float32 statistics, bfloat16 buffers) with deferred
    checks, whose factor is a tensor: torch 2.1's CPU ``addcmul`` failed an internal assert
    writing the float32 sums into the bfloat16 buffers with ``out=`` (2026-12-07). The
    deferred call writes what the immediate one does."""
    deferred = _bfloat16_training_call("deferred")
    immediate = _bfloat16_training_call("immediate")
    for got, want in zip(deferred, immediate):
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert not torch.equal(deferred[2], torch.zeros(3, dtype=torch.bfloat16))  # it moved


@pytest.mark.parametrize("factor", [0.3, 1.0, "on the device"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_the_traced_running_statistics_update_writes_what_the_eager_one_does(
    factor: float | str, dtype: torch.dtype
) -> None:
    """``_stats.update_running_stats(in_graph=True)``, compiled code's form (each sum copied
    into its buffer: torch 2.4's dynamo failed on ``out=`` in a checkpointed region), writes
    the buffers bit for bit as the eager form (``out=``) does, infinite values included."""
    mean = torch.tensor([1.0, -3.5, 1e4, 0.1], dtype=torch.float64)
    var = torch.tensor([2.0, 0.25, 7.0, float("inf")], dtype=torch.float64)
    written = []
    for in_graph in (False, True):
        buffers = (
            torch.tensor([0.5, float("inf"), -2.0, 3.0], dtype=dtype),
            torch.tensor([1.0, 4.0, 0.5, 9.0], dtype=dtype),
        )
        value = torch.tensor(0.3, dtype=torch.float64) if isinstance(factor, str) else factor
        _stats.update_running_stats(*buffers, (mean, var), value, in_graph=in_graph)
        written.append(buffers)
    for eager, traced in zip(*written):
        # (a factor of 1 makes an infinite running mean NaN, as torch's batch norm does)
        torch.testing.assert_close(traced, eager, rtol=0, atol=0, equal_nan=True)
        assert eager.dtype == dtype
    assert not torch.equal(written[0][0], torch.tensor([0.5, float("inf"), -2.0, 3.0], dtype=dtype))
