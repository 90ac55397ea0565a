"""Masked SyncBatchNorm: statistics over the valid positions of padded batches.

The gold reference gathers the valid positions of every rank into one ``(M, C)`` batch
and runs ``torch.nn.BatchNorm1d`` on it in float64. Padded positions hold NaN in the
input, and the output gradient is arbitrary (large, or NaN) there: nothing at a padded
position may reach an output, a gradient or a statistic.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any, cast

import pytest
import torch
import torch.utils.checkpoint
from _harness import WorkerPool, outcome
from torch import nn

import syncbn
from syncbn import _autograd
from syncbn.functional import sync_batch_norm

_COMPILE = hasattr(torch.library, "custom_op")  # fullgraph compile needs torch >= 2.4


@dataclass(frozen=True)
class MaskedCase:
    """Per-rank local batch sizes and how much of each rank's batch is padded."""

    sizes: tuple[int, ...]
    #: per rank, the probability that a position is valid (0: all padded)
    valid: tuple[float, ...]
    tail: tuple[int, ...] = (3, 7)  # (C, *spatial)
    steps: int = 2
    seed: int = 0
    offset: float = 0.0
    dtype: torch.dtype = torch.float64
    channels_last: bool = False
    #: "eager", or a torch.compile backend ("aot_eager", "inductor")
    mode: str = "eager"
    #: a mask broadcast over the first spatial dimension (shape (N, 1, W) for (N, C, H, W))
    broadcast: bool = False
    #: where the layer runs (tests/test_cuda.py runs these cases on "cuda")
    device: str = "cpu"
    #: the layer's check_mode ("auto": immediate on CPU, deferred on accelerators)
    check_mode: str = "auto"
    #: ranks that call the layer without a mask (give them a valid fraction of 1: every
    #: position of theirs counts), beside ranks that pass one
    unmasked_ranks: tuple[int, ...] = ()

    def data(self, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's input, mask and output gradient at ``step`` (NaN where padded)."""
        gen = torch.Generator().manual_seed(self.seed * 1000 + step * 10 + rank)
        shape = (self.sizes[rank], *self.tail)
        x = torch.randn(shape, generator=gen, dtype=torch.float64) * 2 + self.offset
        positions = (shape[0], *shape[2:])
        mask_shape = (shape[0], 1, *shape[3:]) if self.broadcast else positions
        mask = torch.rand(mask_shape, generator=gen) < self.valid[rank]
        grad = torch.randn(shape, generator=gen, dtype=torch.float64)
        padded = ~mask.expand(positions).unsqueeze(1).expand(shape)
        x = x.masked_fill(padded, float("nan"))
        grad = grad.masked_fill(padded, float("nan"))
        return x, mask, grad


class _Masked(nn.Module):
    """SyncBatchNorm taking a mask, as a model would call it."""

    def __init__(self, num_features: int) -> None:
        super().__init__()
        self.bn = syncbn.SyncBatchNorm(num_features, momentum=None)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        return self.bn(x, mask)


def _layer(case: MaskedCase) -> _Masked:
    torch.manual_seed(case.seed)
    model = _Masked(case.tail[0]).double()
    with torch.no_grad():
        model.bn.weight.uniform_(0.5, 1.5)
        model.bn.bias.uniform_(-0.5, 0.5)
    return model


def _run_masked(rank: int, world_size: int, case: MaskedCase) -> dict[str, Any]:
    """SyncBatchNorm on this rank's padded batches; returns what the gold test compares."""
    torch._dynamo.reset()
    # float64 parameters for float64 input, float32 otherwise (as torch's batch norm takes)
    param_dtype = torch.float64 if case.dtype == torch.float64 else torch.float32
    model = _layer(case).to(case.device, param_dtype)
    model.bn.check_mode = case.check_mode
    run: Any = model
    if case.mode != "eager":
        run = torch.compile(model, fullgraph=True, backend=case.mode)
    records = []
    for step in range(case.steps):
        x, mask, grad = (t.to(case.device) for t in case.data(rank, step))
        x = x.to(case.dtype)
        if case.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        x.requires_grad_()
        y = run(x, None if rank in case.unmasked_ranks else mask)
        y.backward(grad.to(case.dtype))
        records.append(
            {
                "output": y.detach().double().cpu(),
                "grad_input": x.grad.double().cpu(),  # type: ignore[union-attr]
                "grad_weight": model.bn.weight.grad.double().cpu(),  # type: ignore[union-attr]
                "grad_bias": model.bn.bias.grad.double().cpu(),  # type: ignore[union-attr]
                "channels_last": y.is_contiguous(memory_format=torch.channels_last),
            }
        )
        model.zero_grad()
    if case.check_mode != "immediate":
        syncbn._protocol.raise_deferred(wait=True)  # a deferred problem fails the scenario
    state = {
        k: (v.double() if v.is_floating_point() else v).cpu()
        for k, v in model.bn.state_dict().items()
    }
    return {"steps": records, "state": state}


def _valid_rows(tensor: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The ``(M, C)`` rows of an ``(N, C, *)`` tensor at the valid positions of ``mask``."""
    positions = (tensor.shape[0], *tensor.shape[2:])
    return tensor.movedim(1, -1)[mask.expand(positions)]


def _reference(case: MaskedCase, world_size: int) -> dict[str, Any]:
    """torch.nn.BatchNorm1d on the valid positions of all ranks, gathered, in float64."""
    reference = nn.BatchNorm1d(case.tail[0], momentum=None).double()
    reference.load_state_dict(_layer(case).bn.state_dict())
    records = []
    for step in range(case.steps):
        data = [case.data(rank, step) for rank in range(world_size)]
        rows = torch.cat([_valid_rows(x, mask) for x, mask, _ in data]).requires_grad_()
        grads = torch.cat([_valid_rows(grad, mask) for _, mask, grad in data])
        outputs = reference(rows) if rows.shape[0] else rows * 0  # an empty global batch
        outputs.backward(grads)
        records.append(
            {
                "output": outputs.detach(),
                "grad_input": rows.grad,
                "grad_weight": reference.weight.grad.clone(),  # type: ignore[union-attr]
                "grad_bias": reference.bias.grad.clone(),  # type: ignore[union-attr]
                "counts": [int(_valid_rows(x, m).shape[0]) for x, m, _ in data],
            }
        )
        reference.zero_grad()
    return {"steps": records, "state": reference.state_dict()}


def _assert_matches(
    case: MaskedCase, per_rank: list[dict[str, Any]], rtol: float = 1e-10, atol: float = 1e-10
) -> None:
    ref = _reference(case, len(per_rank))
    for step, expected in enumerate(ref["steps"]):
        start = 0
        for rank, result in enumerate(per_rank):
            got = result["steps"][step]
            _, mask, _ = case.data(rank, step)
            stop = start + expected["counts"][rank]
            for key in ("output", "grad_input"):
                valid = _valid_rows(got[key], mask)
                torch.testing.assert_close(
                    valid, expected[key][start:stop], rtol=rtol, atol=atol, msg=key
                )
                padded = _valid_rows(got[key], ~mask.expand(mask.shape))
                assert bool((padded == 0).all()), f"{key} is not zero at padded positions"
            start = stop
        for key in ("grad_weight", "grad_bias"):
            total = sum(result["steps"][step][key] for result in per_rank)
            torch.testing.assert_close(total, expected[key], rtol=rtol, atol=atol, msg=key)
    for result in per_rank:
        for key, value in ref["state"].items():
            torch.testing.assert_close(result["state"][key], value, rtol=rtol, atol=atol, msg=key)


# ---------------------------------------------------------------- one process, no group


@pytest.mark.parametrize(
    "case",
    [
        MaskedCase(sizes=(5,), valid=(0.6,)),
        MaskedCase(sizes=(4,), valid=(0.7,), tail=(3, 4, 5)),
        MaskedCase(sizes=(4,), valid=(0.7,), tail=(3, 4, 5), broadcast=True),
        MaskedCase(sizes=(4,), valid=(0.7,), tail=(3, 4, 5), channels_last=True),
        MaskedCase(sizes=(3,), valid=(0.7,), tail=(2, 3, 4, 5)),
        MaskedCase(sizes=(6,), valid=(0.8,), tail=(4,)),  # (N, C) input, (N,) mask
    ],
    ids=["NCL", "NCHW", "broadcast-mask", "channels_last", "NCDHW", "NC"],
)
def test_without_a_process_group_it_is_an_exact_masked_batchnorm(case: MaskedCase) -> None:
    result = _run_masked(0, 1, case)
    _assert_matches(case, [result])
    if case.channels_last:
        assert all(step["channels_last"] for step in result["steps"])


def test_a_mask_with_every_position_valid_equals_batchnorm() -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 3, 5, 6, dtype=torch.float64)
    masked, plain = syncbn.SyncBatchNorm(3).double(), nn.BatchNorm2d(3).double()
    y = masked(x, torch.ones(4, 5, 6, dtype=torch.bool))
    torch.testing.assert_close(y, plain(x), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(masked.running_var, plain.running_var, rtol=1e-12, atol=1e-12)


def test_float32_with_a_large_mean_stays_accurate() -> None:
    """|mean| / std = 1e4 in float32: the shift is a valid sample, not a padded one."""
    case = MaskedCase(sizes=(8,), valid=(0.6,), tail=(3, 50), offset=2e4, dtype=torch.float32)
    result = _run_masked(0, 1, case)
    # float32 data, float64 reference: the normalized output is off by float32 rounding only
    _assert_matches(case, [result], rtol=1e-3, atol=2e-3)


#: the low-precision input dtypes, with float32 parameters
_LOW_PRECISION = [
    torch.bfloat16,
    pytest.param(
        torch.float16,
        marks=pytest.mark.skipif(
            not _autograd._CPU_FLOAT16, reason="torch < 2.2 has no float16 batch_norm on the CPU"
        ),
    ),
]


@pytest.mark.parametrize("dtype", _LOW_PRECISION)
def test_low_precision_input_with_float32_parameters(dtype: torch.dtype) -> None:
    """Low precision takes its own backward input (a zeroed copy of the input, not the
    float32 shifted copy): NaN at padded positions and a gradient there reach nothing."""
    torch.manual_seed(0)
    x = torch.randn(6, 3, 20).to(dtype)
    mask = torch.rand(6, 20) < 0.7
    x[~mask.unsqueeze(1).expand_as(x)] = float("nan")
    x.requires_grad_()
    grad = torch.randn(6, 3, 20).to(dtype)  # non-zero at padded positions too
    layer = syncbn.SyncBatchNorm(3)
    y = layer(x, mask)
    assert y.dtype == dtype and layer.weight.dtype == torch.float32
    y.backward(grad)
    rows = _valid_rows(x.detach().float(), mask).requires_grad_()
    reference = nn.BatchNorm1d(3)
    expected = reference(rows)
    expected.backward(_valid_rows(grad.float(), mask))
    torch.testing.assert_close(_valid_rows(y.float(), mask), expected, rtol=0.02, atol=0.02)
    assert bool((_valid_rows(y, ~mask) == 0).all())
    assert x.grad is not None and x.grad.dtype == dtype
    torch.testing.assert_close(_valid_rows(x.grad.float(), mask), rows.grad, rtol=0.05, atol=0.05)
    assert bool((_valid_rows(x.grad, ~mask) == 0).all())
    for mine, theirs in ((layer.weight, reference.weight), (layer.bias, reference.bias)):
        assert mine.grad is not None and theirs.grad is not None
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=0.02, atol=0.05)


@pytest.mark.parametrize("dtype", _LOW_PRECISION)
@pytest.mark.parametrize("masked", [False, True], ids=["unmasked", "masked"])
def test_a_low_precision_input_gradient_is_as_accurate_as_torchs(
    dtype: torch.dtype, masked: bool
) -> None:
    """An output gradient nearly in the span of ``1`` and ``xhat`` (its two corrections
    cancel most of ``dy * scale``): the correction was rounded to the input's dtype before
    the sum, and the input gradient came out 25 % off (bfloat16) where torch's BatchNorm,
    which rounds once, is 0.2 % off (a review). syncbn computes the masked and unmasked
    gradients itself without a process group, so a mask of all positions takes its kernels."""
    torch.manual_seed(0)
    x = (torch.randn(16, 3, 64, dtype=torch.float64) * 3 + 2).to(dtype)
    rounded = x.double()
    xhat = (rounded - rounded.mean((0, 2), keepdim=True)) / rounded.std((0, 2), keepdim=True)
    grad = (0.7 * xhat + 0.3 + 1e-2 * torch.randn_like(xhat)).to(dtype)
    mask = torch.ones(16, 64, dtype=torch.bool)
    if masked:
        mask[:, 50:] = False  # padded positions hold ordinary values and gradients
    layer = syncbn.SyncBatchNorm(3)
    data = x.clone().requires_grad_()
    layer(data, mask).backward(grad)
    assert data.grad is not None
    gradients = [_valid_rows(data.grad.double(), mask)]
    # torch's BatchNorm on the valid positions, in the input's dtype and in float64
    for reference_dtype in (dtype, torch.float64):
        rows = _valid_rows(x, mask).to(reference_dtype).requires_grad_()
        reference = nn.BatchNorm1d(
            3, dtype=torch.float64 if reference_dtype == torch.float64 else None
        )
        reference(rows).backward(_valid_rows(grad, mask).to(reference_dtype))
        assert rows.grad is not None
        gradients.append(rows.grad.double())
    mine, torchs, exact = gradients
    scale = exact.abs().max()
    assert (mine - exact).abs().max() <= 2 * (torchs - exact).abs().max() + 1e-3 * scale


def _eval_layer_and_batch() -> tuple[syncbn.SyncBatchNorm, torch.Tensor, torch.Tensor]:
    """A layer in eval mode whose running statistics moved once, an input and its mask."""
    torch.manual_seed(0)
    layer = syncbn.SyncBatchNorm(3).double()
    layer(torch.randn(8, 3, 5, dtype=torch.float64))
    layer.eval()
    x = torch.randn(4, 3, 5, dtype=torch.float64)
    return layer, x, torch.rand(4, 5) < 0.5


def test_eval_uses_the_running_statistics_and_zeroes_padded_positions() -> None:
    layer, x, mask = _eval_layer_and_batch()
    y = layer(x, mask)
    plain = nn.functional.batch_norm(
        x, layer.running_mean, layer.running_var, layer.weight, layer.bias, False, 0.0, layer.eps
    )
    torch.testing.assert_close(_valid_rows(y, mask), _valid_rows(plain, mask))
    assert bool((_valid_rows(y, ~mask) == 0).all())


@pytest.mark.parametrize(
    "form",
    [
        "module",
        "functional",
        pytest.param(
            "compiled",
            marks=pytest.mark.skipif(not _COMPILE, reason="fullgraph compile needs torch >= 2.4"),
        ),
    ],
)
def test_eval_gradients_ignore_whatever_padded_positions_hold(form: str) -> None:
    """In eval mode too nothing at a padded position reaches a gradient: batch norm's weight
    gradient sums ``dy * xhat`` over every position, and a NaN or inf there made it NaN
    (``0 * NaN``) when only the output was zeroed."""
    layer, x, mask = _eval_layer_and_batch()
    weight = cast(torch.Tensor, layer.weight)
    padded = ~mask.unsqueeze(1)
    grad = torch.randn_like(x).masked_fill(padded, float("nan"))
    gradients = []
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    for fill in (0.0, float("nan"), float("inf")):
        held = x.masked_fill(padded, fill).requires_grad_()
        if form != "functional":
            y = (compiled if form == "compiled" else layer)(held, mask)
        else:
            y = sync_batch_norm(
                held, layer.running_mean, layer.running_var, weight, layer.bias, mask=mask
            )
        assert bool((_valid_rows(y, ~mask) == 0).all())
        gradients.append(torch.autograd.grad(y, (held, weight, layer.bias), grad))
    for other in gradients[1:]:
        for first, got in zip(gradients[0], other):
            assert bool(got.isfinite().all())
            torch.testing.assert_close(got, first, rtol=0, atol=0)
    rows = _valid_rows(x, mask).requires_grad_()
    plain = nn.functional.batch_norm(
        rows, layer.running_mean, layer.running_var, weight, layer.bias, False, 0.0, layer.eps
    )
    expected = torch.autograd.grad(plain, (rows, weight, layer.bias), _valid_rows(grad, mask))
    torch.testing.assert_close(_valid_rows(gradients[0][0], mask), expected[0])
    torch.testing.assert_close(gradients[0][1:], expected[1:])


def test_the_functional_form_refuses_a_running_variance_without_a_mean() -> None:
    """torch's check, on every path (a masked call took one alone and updated it)."""
    x, mask = torch.randn(4, 3, 5), torch.rand(4, 5) < 0.5
    for running_mean, running_var in ((None, torch.ones(3)), (torch.zeros(3), None)):
        with pytest.raises(ValueError, match="must either both be None or neither be None"):
            sync_batch_norm(x, running_mean, running_var, training=True, mask=mask)
        # eval: torch's error of that mode (was the training one's ValueError)
        missing = "running_mean" if running_mean is None else "running_var"
        for given in (mask, None):
            with pytest.raises(RuntimeError, match=f"^{missing} must be defined in evaluation"):
                sync_batch_norm(x, running_mean, running_var, training=False, mask=given)
            with pytest.raises(RuntimeError, match=f"^{missing} must be defined in evaluation"):
                nn.functional.batch_norm(x, running_mean, running_var, training=False)


def test_eval_without_running_statistics_uses_the_valid_positions() -> None:
    torch.manual_seed(0)
    layer = syncbn.SyncBatchNorm(3, track_running_stats=False).double().eval()
    x = torch.randn(4, 3, 5, dtype=torch.float64)
    mask = torch.rand(4, 5) < 0.5
    x = x.masked_fill(~mask.unsqueeze(1).expand_as(x), float("nan")).requires_grad_()
    rows = _valid_rows(x.detach(), mask).requires_grad_()
    expected = nn.BatchNorm1d(3, track_running_stats=False).double()(rows)
    y = layer(x, mask)
    torch.testing.assert_close(_valid_rows(y, mask), expected)
    assert bool((_valid_rows(y, ~mask) == 0).all())
    grad = torch.randn_like(x)
    (grad_x,) = torch.autograd.grad(y, x, grad)
    (grad_rows,) = torch.autograd.grad(expected, rows, _valid_rows(grad, mask))
    torch.testing.assert_close(_valid_rows(grad_x, mask), grad_rows)
    assert bool((_valid_rows(grad_x, ~mask) == 0).all())


def test_eval_without_running_statistics_refuses_a_single_valid_position() -> None:
    """torch's layer refuses one value per channel there (batch statistics); so does a
    masked call with one valid position, and for an unmasked one it is torch's own error."""
    layer = syncbn.SyncBatchNorm(3, track_running_stats=False).eval()
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        nn.BatchNorm1d(3, track_running_stats=False).eval()(torch.randn(1, 3, 1))
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        layer(torch.randn(1, 3, 1))
    mask = torch.zeros(2, 4, dtype=torch.bool)
    mask[1, 2] = True
    # a process alone: no "across all 1 ranks"
    alone = r"Expected more than 1 value per channel when training, got 1 value per channel "
    with pytest.raises(ValueError, match=alone + r"\(input size \[2, 3, 4\]\)$"):
        layer(torch.randn(2, 3, 4), mask)
    mask[0, 0] = True  # two valid positions: fine
    assert layer(torch.randn(2, 3, 4), mask).shape == (2, 3, 4)


def test_the_functional_form_takes_a_mask() -> None:
    torch.manual_seed(0)
    x = torch.randn(5, 3, 6, dtype=torch.float64)
    mask = torch.rand(5, 6) < 0.6
    mean, var = torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64)
    y = sync_batch_norm(x, mean, var, training=True, momentum=0.5, mask=mask)
    reference = nn.BatchNorm1d(3, affine=False, momentum=0.5).double()
    torch.testing.assert_close(_valid_rows(y, mask), reference(_valid_rows(x, mask)))
    torch.testing.assert_close(mean, reference.running_mean)
    torch.testing.assert_close(var, reference.running_var)


def test_checkpointed_recomputation_updates_running_statistics_once() -> None:
    torch.manual_seed(0)
    x = torch.randn(5, 3, 6, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(5, 6) < 0.6
    layer, reference = syncbn.SyncBatchNorm(3).double(), syncbn.SyncBatchNorm(3).double()
    torch.utils.checkpoint.checkpoint(layer, x, mask, use_reentrant=False).sum().backward()
    reference(x, mask).sum().backward()
    torch.testing.assert_close(layer.state_dict(), reference.state_dict())
    assert layer.state_dict()["num_batches_tracked"].item() == 1


@pytest.mark.parametrize(
    ("mask", "error", "message"),
    [
        (torch.ones(4, 5, dtype=torch.uint8), TypeError, "expected mask of dtype torch.bool"),
        (torch.ones(4, 6, dtype=torch.bool), ValueError, "expected mask of shape (4, 5)"),
        (torch.ones(4, 3, 5, dtype=torch.bool), ValueError, "expected mask of shape (4, 5)"),
        (torch.ones(4, 5, dtype=torch.bool, device="meta"), RuntimeError, "same device"),
    ],
    ids=["dtype", "shape", "with-channels", "device"],
)
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_an_invalid_mask_is_a_clear_error(
    mask: torch.Tensor, error: type[Exception], message: str, training: bool
) -> None:
    layer = syncbn.SyncBatchNorm(3).train(training)
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        layer(torch.randn(4, 3, 5), mask)


def test_a_global_valid_count_of_one_raises_like_batchnorm() -> None:
    mask = torch.zeros(2, 5, dtype=torch.bool)
    mask[1, 3] = True
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        syncbn.SyncBatchNorm(3)(torch.randn(2, 3, 5), mask)


# ---------------------------------------------------------------- several ranks

_RANK_CASES = {
    # the second rank passes no mask: its whole batch counts beside the others' valid positions
    "uneven": MaskedCase(sizes=(3, 5, 2), valid=(0.6, 1.0, 0.8), unmasked_ranks=(1,)),
    "empty-rank": MaskedCase(sizes=(4, 0, 3), valid=(0.6, 0.5, 0.7)),
    "all-padded-rank": MaskedCase(sizes=(3, 4, 2), valid=(0.0, 0.6, 0.7)),
    "4d-channels_last": MaskedCase(
        sizes=(2, 3, 1), valid=(0.7, 0.5, 0.9), tail=(3, 4, 5), channels_last=True
    ),
}


@pytest.mark.parametrize("case", list(_RANK_CASES.values()), ids=list(_RANK_CASES))
def test_global_statistics_over_the_valid_positions_of_all_ranks(
    pool: WorkerPool, case: MaskedCase
) -> None:
    per_rank = pool.run(_run_masked, case, timeout=60.0)
    _assert_matches(case, per_rank)


def test_every_position_padded_on_every_rank(pool2: WorkerPool) -> None:
    """Like an all-empty global batch: zero outputs and gradients, running statistics kept."""
    case = MaskedCase(sizes=(3, 2), valid=(0.0, 0.0))
    for result in pool2.run(_run_masked, case, timeout=60.0):
        for step in result["steps"]:
            for key in ("output", "grad_input", "grad_weight", "grad_bias"):
                assert bool((step[key] == 0).all()), key
        assert bool((result["state"]["running_mean"] == 0).all())
        assert bool((result["state"]["running_var"] == 1).all())


def _count_of_one(rank: int, world_size: int) -> tuple[str, str]:
    mask = torch.zeros(2, 5, dtype=torch.bool)
    if rank == 0:
        mask[0, 2] = True
    layer = syncbn.SyncBatchNorm(3)
    return outcome(layer, torch.randn(2, 3, 5), mask)


def test_a_global_valid_count_of_one_raises_on_every_rank(pool2: WorkerPool) -> None:
    for kind, message in pool2.run(_count_of_one, timeout=60.0):
        assert kind == "ValueError" and "Expected more than 1 value per channel" in message


#: rank 0's invalid mask (shape, device), and the error and message it raises there
_INVALID_MASKS: dict[str, tuple[tuple[int, int], str, str, str]] = {
    "shape": ((2, 4), "cpu", "ValueError", "expected mask of shape (2, 5)"),
    # on the meta device: a compiled call's op then dispatched to its meta kernel, which
    # returned an uninitialized output where it should raise (found by a review)
    "device": ((2, 5), "meta", "RuntimeError", "same device"),
}


def _invalid_mask_on_one_rank(
    rank: int, world_size: int, compiled: bool, problem: str
) -> tuple[str, str]:
    torch._dynamo.reset()
    layer: Any = syncbn.SyncBatchNorm(3)
    if compiled:
        layer = torch.compile(layer, fullgraph=True, backend="aot_eager")
    mask = torch.ones(2, 5, dtype=torch.bool)
    if rank == 0:
        size, device, _, _ = _INVALID_MASKS[problem]
        mask = torch.ones(size, dtype=torch.bool, device=device)
    return outcome(layer, torch.randn(2, 3, 5), mask)


@pytest.mark.parametrize("problem", list(_INVALID_MASKS))
@pytest.mark.parametrize(
    "compiled",
    [False, pytest.param(True, marks=pytest.mark.skipif(not _COMPILE, reason="torch < 2.4"))],
    ids=["eager", "compiled"],
)
def test_an_invalid_mask_on_one_rank_raises_on_every_rank(
    pool2: WorkerPool, compiled: bool, problem: str
) -> None:
    results = pool2.run(_invalid_mask_on_one_rank, compiled, problem, timeout=120.0)
    _, _, error, message = _INVALID_MASKS[problem]
    assert results[0][0] == error and message in results[0][1], results[0]
    assert results[1][0] == "RuntimeError" and "1 other rank(s) failed" in results[1][1]


def _ddp_step(rank: int, world_size: int, backend: str | None = None) -> dict[str, Any]:
    """One masked step under DDP; with ``backend``, of ``torch.compile(ddp)`` (DDPOptimizer)."""
    model = _layer(MaskedCase(sizes=(3, 4), valid=(0.5, 0.6)))
    ddp = nn.parallel.DistributedDataParallel(model)
    run: nn.Module = ddp
    if backend is not None:
        torch._dynamo.reset()  # no graphs of an earlier scenario in this pool process
        run = cast(nn.Module, torch.compile(ddp, backend=backend))
    x, mask, grad = MaskedCase(sizes=(3, 4), valid=(0.5, 0.6)).data(rank, 0)
    x.requires_grad_()
    run(x, mask).backward(grad)
    return {"grad_weight": model.bn.weight.grad, "state": model.bn.state_dict()}


@pytest.mark.parametrize(
    "backend",
    [None, pytest.param("inductor", marks=pytest.mark.skipif(not _COMPILE, reason="torch < 2.4"))],
    ids=["eager", "inductor"],
)
@pytest.mark.timeout(240)  # an inductor compile per rank, on two cores
def test_under_ddp_the_gradients_are_those_of_the_gathered_batch(
    pool2: WorkerPool, backend: str | None
) -> None:
    case = MaskedCase(sizes=(3, 4), valid=(0.5, 0.6), steps=1)
    expected = _reference(case, 2)
    for result in pool2.run(_ddp_step, backend, timeout=180.0):
        # DDP averages the gradients over the 2 ranks: the gathered batch's gradient / 2
        torch.testing.assert_close(result["grad_weight"] * 2, expected["steps"][0]["grad_weight"])
        torch.testing.assert_close(result["state"]["running_var"], expected["state"]["running_var"])


@pytest.mark.skipif(not _COMPILE, reason="fullgraph compile needs torch >= 2.4")
@pytest.mark.parametrize("pool", [2, 3], ids=["world2", "world3"], indirect=True)
@pytest.mark.timeout(300)  # the scenario's own bound plus the pool's start
def test_compiled_masked_calls_match_the_gathered_reference(pool: WorkerPool) -> None:
    """aot_eager: dynamo and AOTAutograd around the custom op, as inductor sees them. On 3
    ranks the third passes no mask (its graph takes the unmasked path) beside masked ones."""
    case = dataclasses.replace(
        _RANK_CASES["empty-rank"], mode="aot_eager", valid=(0.6, 0.5, 1.0), unmasked_ranks=(2,)
    )
    _assert_matches(case, pool.run(_run_masked, case, timeout=240.0))


@pytest.mark.skipif(not _COMPILE, reason="fullgraph compile needs torch >= 2.4")
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "case",
    [
        MaskedCase(sizes=(4,), valid=(0.7,), tail=(3, 4, 5), mode="inductor"),
        MaskedCase(
            sizes=(5,),
            valid=(0.6,),
            tail=(3, 4, 5),
            broadcast=True,
            channels_last=True,
            mode="inductor",
        ),
    ],
    ids=["NCHW", "broadcast-mask-channels_last"],
)
def test_inductor_kernels_match_the_gathered_reference(case: MaskedCase) -> None:
    """inductor's generated kernels, NaN at the padded positions of input and gradient: the
    mask tested through a stored float copy and the per-channel values stored once give
    the reference's numbers."""
    result = _run_masked(0, 1, case)
    _assert_matches(case, [result])
    if case.channels_last:
        assert all(step["channels_last"] for step in result["steps"])


@pytest.mark.skipif(not _COMPILE, reason="fullgraph compile needs torch >= 2.4")
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_compiled_masked_calls_take_sizes_that_change(training: bool) -> None:
    """Once dynamo has seen the layers' forward at two sizes (any layer's: they share its
    code), it traces the input's sizes as symbols, and the mask's shape check wrongly
    failed (``m not in (1, p)`` traced True for a symbolic ``p``): valid masks raised.
    Sizes marked dynamic by the user work when the mask's are marked too."""
    torch.manual_seed(0)
    other, layer = (syncbn.SyncBatchNorm(3).double().train(training) for _ in range(2))
    reference = copy.deepcopy(layer)
    torch._dynamo.reset()
    for n in (4, 6):  # another layer, unmasked, at two batch sizes
        torch.compile(other, fullgraph=True, backend="aot_eager")(
            torch.randn(n, 3, n + 1, dtype=torch.float64)
        )
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    for n, length, mark in ((4, 5, False), (6, 7, False), (3, 8, True)):
        x = torch.randn(n, 3, length, dtype=torch.float64)
        mask = torch.rand(n, length) < 0.7
        if mark:
            for tensor in (x, mask):
                torch._dynamo.mark_dynamic(tensor, 0)
        torch.testing.assert_close(compiled(x, mask), reference(x, mask), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(layer.running_var, reference.running_var, rtol=1e-12, atol=0)


@pytest.mark.skipif(not _COMPILE, reason="fullgraph compile needs torch >= 2.4")
@pytest.mark.timeout(240)
def test_inductor_eval_zeroes_padded_positions_whatever_they_hold() -> None:
    layer, x, mask = _eval_layer_and_batch()
    x = x.masked_fill(~mask.unsqueeze(1), float("nan"))
    torch._dynamo.reset()
    y = torch.compile(layer, fullgraph=True)(x, mask)
    torch.testing.assert_close(y, layer(x, mask), rtol=1e-12, atol=1e-12)
    assert bool((_valid_rows(y, ~mask) == 0).all())


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
def test_zero_padded_equals_where_whatever_the_padded_values(dtype: torch.dtype) -> None:
    from syncbn._kernels.generic import zero_padded

    x = torch.randn(3, 4, 5).to(dtype)
    x[0, 1, 2], x[1, 2, 3], x[2, 0, 0] = float("nan"), float("inf"), -float("inf")
    valid = (torch.rand(3, 1, 5) < 0.5).expand(3, 1, 5)
    valid[0, 0, 2] = valid[1, 0, 3] = valid[2, 0, 0] = False
    expected = torch.where(valid, x, 0.0)
    got = zero_padded(x, valid)
    assert torch.equal(got, expected) and got.dtype == dtype
    assert not bool(torch.signbit(got[~valid.expand_as(x)]).any())  # +0.0, not -0.0
    assert torch.equal(zero_padded(x.clone(), valid, inplace=True), expected)


@pytest.mark.parametrize(
    "x",
    [
        torch.randn(3, 4, 5, 6),
        torch.randn(3, 4, 5, 6).contiguous(memory_format=torch.channels_last),
        torch.randn(3, 4, 5, 12)[:, :, :, ::2],  # strides of no memory format
        torch.randn(2, 4, 3, 5, 6),
        torch.randn(7, 4),
    ],
    ids=["NCHW", "channels_last", "strided", "NCDHW", "NC"],
)
def test_the_shift_is_the_first_valid_sample(x: torch.Tensor) -> None:
    from syncbn._kernels.generic import first_valid_sample

    positions = (x.shape[0], 1, *x.shape[2:])
    valid = torch.rand(positions) < 0.2
    valid.view(-1)[:5] = False
    valid.view(-1)[-1] = True  # at least one
    x = x.clone()
    x[~valid.expand_as(x)] = float("nan")  # padded values never become the shift
    first = x.movedim(1, -1)[valid.squeeze(1)][0]  # the valid positions in flat order
    assert torch.equal(first_valid_sample(x, valid), first)
    assert torch.equal(first_valid_sample(x, valid.to(torch.int32)), first)  # compiled code's
    nothing_valid = first_valid_sample(x, torch.zeros(positions, dtype=torch.bool))
    assert torch.equal(nothing_valid, torch.zeros(x.shape[1]))


#: layouts of a local batch for the shift's host-read form: made per test, as the test
#: writes NaN into them
_HOST_READ_LAYOUTS = {
    "NCHW": lambda: torch.randn(3, 4, 5, 6),
    "channels_last": lambda: torch.randn(3, 4, 5, 6).contiguous(memory_format=torch.channels_last),
    "strided": lambda: torch.randn(3, 4, 5, 12)[:, :, :, ::2],
    "offset": lambda: torch.randn(4, 4, 5, 6)[1:],  # a view that starts inside its storage
    "NCDHW": lambda: torch.randn(2, 4, 3, 5, 6),
    "NCL_bfloat16": lambda: torch.randn(3, 4, 20).to(torch.bfloat16),
    "NC": lambda: torch.randn(7, 4),
}


@pytest.mark.parametrize("layout", sorted(_HOST_READ_LAYOUTS))
@pytest.mark.parametrize("valid", ["none", "later", "first", "all"])
def test_host_reads_give_the_moments_of_the_device_path(layout: str, valid: str) -> None:
    """A CPU call whose checks are immediate reads its valid count and first valid position
    back (7 ops fewer); its count, shift, shifted copy and sums are the device path's, bit
    for bit, whatever the padded positions hold: no position valid, the first valid one
    further in, the very first valid (which needs no search), every position valid."""
    from syncbn._kernels.generic import shifted_sums

    x = _HOST_READ_LAYOUTS[layout]()
    positions = (x.shape[0], 1, *x.shape[2:])
    share = {"none": 0.0, "later": 0.2, "first": 0.5, "all": 1.0}[valid]
    mask = torch.rand(positions) < share
    if valid == "later":
        mask.view(-1)[:5] = False
        mask.view(-1)[-1] = True
    if valid == "first":
        mask.view(-1)[0], mask.view(-1)[1] = True, False
    x[~mask.expand_as(x)] = float("nan")
    on_device = shifted_sums(x, mask)
    read_back = shifted_sums(x, mask, host_reads=True)
    assert isinstance(read_back[4], int) and read_back[4] == int(mask.sum())
    assert read_back[4] == cast(torch.Tensor, on_device[4]).item()
    for name, index in (("sum", 0), ("square sum", 1), ("shift", 2), ("shifted copy", 3)):
        got, expected = cast(torch.Tensor, read_back[index]), cast(torch.Tensor, on_device[index])
        assert torch.equal(got, expected) and got.dtype == expected.dtype, name
    assert read_back[3].stride() == on_device[3].stride()  # the output's memory format


@pytest.mark.skipif(not _COMPILE, reason="fullgraph compile needs torch >= 2.4")
@pytest.mark.timeout(120)
def test_inductor_finds_the_first_valid_sample() -> None:
    """The shift's position under inductor too, with the int32 mask that compiled code
    passes (a max over a uint8 view of the mask once gave index 0 there, a padded NaN as
    the shift; over bool, inductor's indices are wrong on CUDA before torch's 2026 fix)."""
    from syncbn._kernels.generic import first_valid_sample

    x = torch.randn(3, 4, 5, 6, dtype=torch.float64)
    valid = torch.rand(3, 1, 5, 6) < 0.3
    valid.view(-1)[:7] = False
    valid.view(-1)[-1] = True
    x[~valid.expand_as(x)] = float("nan")
    torch._dynamo.reset()
    compiled = torch.compile(first_valid_sample, fullgraph=True, dynamic=False)
    expected = first_valid_sample(x, valid)
    assert torch.equal(compiled(x, valid.to(torch.int32)), expected)
    assert not bool(expected.isnan().any())
    nothing_valid = torch.zeros_like(valid, dtype=torch.int32)
    assert torch.equal(compiled(x, nothing_valid), torch.zeros(4, dtype=x.dtype))


class _MaskedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bn = syncbn.SyncBatchNorm(3)

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, mask = batch
        return self.bn(x, mask)


def test_precise_statistics_count_the_valid_positions_only() -> None:
    """recompute_statistics sees the mask the model passes: padding (NaN here) is left out."""
    case = MaskedCase(sizes=(4,), valid=(0.6,), tail=(3, 9), steps=3)
    batches = [case.data(0, step)[:2] for step in range(case.steps)]
    model = _MaskedBlock().double()
    syncbn.recompute_statistics(model, batches)
    rows = torch.cat([_valid_rows(x, mask) for x, mask in batches])
    torch.testing.assert_close(model.bn.running_mean, rows.mean(0))
    torch.testing.assert_close(model.bn.running_var, rows.var(0))  # unbiased, as torch's
