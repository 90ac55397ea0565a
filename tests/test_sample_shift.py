"""The shift of the local sums (``syncbn._kernels.generic.sample_shift``): a median of 9
values spread over the batch, the same in eager mode (a strided view) and in compiled code
(indexing), never a single outlier and never a padded value."""

from __future__ import annotations

import itertools

import pytest
import torch

from syncbn._kernels.generic import channel_view, first_valid_sample, ninther, sample_shift

#: (N, C, *) shapes: tiny and large batches, one sample, 2-D to 5-D
_SHAPES = [(1, 3), (2, 3), (13, 3), (100, 3), (1, 3, 1), (2, 3, 7), (5, 3, 4, 6), (4, 3, 2, 3, 5)]


def _layouts(shape: tuple[int, ...]) -> list[torch.Tensor]:
    """A batch of ``shape`` with distinct values, contiguous and in other strides: channels
    last, an ``(N, L, C)`` batch transposed, a slice of a larger batch."""
    x = torch.randperm(2 * torch.Size(shape).numel()).double()[: torch.Size(shape).numel()]
    x = x.view(shape)
    layouts = [x, torch.cat([x, x]).narrow(0, x.shape[0], x.shape[0])]
    if x.dim() == 3:
        layouts.append(x.transpose(1, 2).contiguous().transpose(1, 2))
    if x.dim() in (4, 5):
        format = torch.channels_last if x.dim() == 4 else torch.channels_last_3d
        layouts.append(x.contiguous(memory_format=format))
    return layouts


@pytest.mark.parametrize("shape", _SHAPES, ids=str)
def test_eager_and_compiled_code_read_the_same_values(shape: tuple[int, ...]) -> None:
    for x in _layouts(shape):
        eager = sample_shift(x)
        assert eager.shape == (1, shape[1]) + (1,) * (len(shape) - 2)
        torch.testing.assert_close(sample_shift(x, in_graph=True), eager, rtol=0, atol=0)
        # one of the batch's own values per channel
        per_channel = x.transpose(0, 1).reshape(shape[1], -1)
        assert bool((per_channel == eager.view(-1, 1)).any(1).all())


@pytest.mark.parametrize("shape", [(40, 2), (6, 2, 50), (5, 2, 4, 6)], ids=str)
def test_one_outlier_anywhere_never_becomes_the_shift(shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    x = torch.randn(shape)
    positions = (shape[0], *shape[2:])
    # every position in order (itertools, not torch.unravel_index, which torch 2.1 lacks)
    for position in itertools.product(*map(range, positions)):
        outlier = x.clone()
        index: list[int | slice] = list(position)
        index.insert(1, slice(None))
        outlier[tuple(index)] = 1e6
        shift = sample_shift(outlier).view(-1)
        assert bool((shift.abs() < 10).all()), (position, shift)


def test_four_outliers_among_the_nine_values_can_move_it() -> None:
    """The ninther's guarantee is 3 outliers: to be one, it needs two groups with two
    each. 4 outliers in the right places make it one of them."""
    values = torch.zeros(3, 3, 1)
    values[0, 0] = values[0, 1] = values[1, 0] = values[1, 1] = 1e6
    assert ninther(values).item() == 1e6
    values[1, 1] = 0.0  # three
    assert ninther(values).item() == 0.0


def test_the_ninther_is_the_median_of_the_medians_of_three() -> None:
    torch.manual_seed(0)
    values = torch.randn(3, 3, 50)
    expected = values.median(1).values.median(0).values
    torch.testing.assert_close(ninther(values), expected, rtol=0, atol=0)
    values[0, 0, 0] = float("nan")
    assert ninther(values)[0].isnan()  # NaN data give NaN statistics anyway


@pytest.mark.parametrize("in_graph", [False, True], ids=["eager", "in_graph"])
def test_padded_values_never_become_the_shift(in_graph: bool) -> None:
    torch.manual_seed(0)
    x = torch.randn(6, 3, 20)
    valid = torch.rand(6, 1, 20) < 0.5
    valid[0, 0, :3] = True
    padded = x.masked_fill(~valid, float("nan"))
    first = channel_view(first_valid_sample(padded, valid), 3)
    shift = sample_shift(padded, valid, first, in_graph=in_graph)
    assert bool(shift.isfinite().all())
    per_channel = padded.transpose(0, 1)[valid.expand(6, 3, 20).transpose(0, 1)].view(3, -1)
    assert bool((per_channel == shift.view(-1, 1)).any(1).all())  # a valid value
    # no valid position at all: the fallback, zeros
    nothing = torch.zeros_like(valid)
    zeros = channel_view(first_valid_sample(padded, nothing), 3)
    assert torch.equal(sample_shift(padded, nothing, zeros, in_graph=in_graph), zeros)


def test_a_mask_needs_a_fallback() -> None:
    x = torch.randn(2, 3, 4)
    with pytest.raises(ValueError, match="fallback"):
        sample_shift(x, torch.ones(2, 1, 4, dtype=torch.bool))


@pytest.mark.skipif(not hasattr(torch.library, "custom_op"), reason="needs torch >= 2.4")
def test_compiled_shift_recompiles_for_no_batch_size() -> None:
    """The positions are computed from symbolic sizes in the graph: one graph for every
    batch size after the first change (dynamo's automatic dynamic shapes). Batch 1 is left
    out: dynamo specializes sizes 0 and 1 whatever the code (README: one more recompile)."""
    graphs = []

    def counting(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> object:
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(
        lambda x: sample_shift(x, in_graph=True), fullgraph=True, backend=counting
    )
    for size in (5, 3, 7, 2, 9, 30):
        x = torch.randn(size, 3, 6)
        torch.testing.assert_close(compiled(x), sample_shift(x), rtol=0, atol=0)
    assert len(graphs) <= 2, len(graphs)
