"""SyncBatchNorm's training call as ordinary torch ops around one opaque collective.

The eager path (:mod:`syncbn._autograd`) runs fused kernels with a hand-written backward.
This module spells the same maths as plain, differentiable torch ops instead, so that
under ``torch.compile`` every pass over the big tensors is in the graph, where inductor
fuses the normalization with the elementwise ops after it (the ReLU, the residual add),
and autograd derives the backward reductions and the input gradient.
A mask of valid positions (padded batches) is a ``torch.where`` in those passes. It also
holds the mask helpers that both paths share.

Only the collective is opaque: an ``exchange`` callable takes one rank's packed moments
``[n, sum(x) (C), sum(x**2) (C)]`` (float64) and returns those of the global batch (the
custom op of :mod:`syncbn._compiled`: one collective, its checks, and the factor of the
running statistics' update; its backward is one collective of the gradients). The maths on
either side of it, per channel (global mean and variance, scale, running statistics) and
per element, is ordinary torch code that inductor fuses into a few kernels.

Every small tensor that meets the big ones (the scale and offset of the output, the
gradients of the local sums, a float copy of the mask) goes through :func:`computed_once`
first, so that inductor computes it once instead of once per element.

Exactness is that of the eager path: moments of data shifted by one of the rank's own
values per channel (the same :func:`syncbn._kernels.generic.sample_shift`; no
cancellation for inputs whose mean is large compared with their spread, nor for an
outlier), the shift added back in float64, the output as ``(x - shift) * scale + offset``
with ``offset = bias + (shift - mean) * scale`` in float64.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from syncbn import _stats
from syncbn._kernels.generic import (
    channel_view,
    first_valid_sample,
    output_offset,
    sample_shift,
)

__all__ = [
    "Exchange",
    "ShiftedMoments",
    "batch_norm_train",
    "batch_norm_valid",
    "computed_once",
    "keep_local",
    "keep_local_cumulative",
    "mask_problem",
    "normalize",
    "pack_moments",
    "shifted_moments",
    "valid_positions",
]

#: ``local moments -> (global moments, update)``: moments are ``(2 * C + 1,)`` float64
#: ``[n, sum(x) (C), sum(x**2) (C)]``; ``update`` is ``None`` (nothing to update) or a
#: ``(2,)`` float64 ``[increment, factor]``: what ``num_batches_tracked`` counts (0 or 1)
#: and the running statistics' momentum for this call (0 where they must not move: a
#: global batch of fewer than 2 values, a failed check)
Exchange = Callable[[torch.Tensor], tuple[torch.Tensor, "torch.Tensor | None"]]


class ShiftedMoments(NamedTuple):
    """One rank's local moments, and what normalization reuses."""

    #: 0-dim float64: the number of (valid) values per channel
    local_count: torch.Tensor
    #: ``(C,)`` statistics dtype: ``sum(x - shift)`` over the (valid) positions
    shifted_sum: torch.Tensor
    #: ``(C,)`` statistics dtype: ``sum((x - shift)**2)`` over the (valid) positions
    shifted_square_sum: torch.Tensor
    #: ``(C,)`` statistics dtype, no gradient: the shift, one (valid) value per channel
    shift: torch.Tensor
    #: ``x - shift`` in the statistics dtype, zero at padded positions
    centered: torch.Tensor
    #: ``(N, 1, *)`` bool, True at valid positions, or ``None`` without a mask
    valid: torch.Tensor | None


def computed_once(value: torch.Tensor) -> torch.Tensor:
    """``value``, a small tensor that scales a big one, stored once under ``torch.compile``.

    Inductor inlines a pointwise producer into each of its consumers: a per-channel value
    derived from the global moments (a float64 division, an inverse square root) would be
    recomputed for every element of the ``(N, C, *)`` tensor it scales, which costs more
    than the normalization itself on a CPU. An identity ``as_strided`` can only be lowered
    on a stored buffer, so inductor stores the value once; its backward stores the
    gradient the same way. Outside of compilation it is a free view.
    """
    return value.as_strided(value.shape, value.stride())


def mask_problem(mask: torch.Tensor, input: torch.Tensor) -> Exception | None:
    """The error a bad ``mask`` for an ``(N, C, *)`` ``input`` deserves, or ``None``."""
    if not isinstance(mask, torch.Tensor):
        return TypeError(f"expected mask to be a torch.Tensor, got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        return TypeError(f"expected mask of dtype torch.bool, got mask of dtype {mask.dtype}")
    positions = (input.shape[0], *input.shape[2:])
    trailing = positions[len(positions) - mask.dim() :] if mask.dim() <= len(positions) else ()
    # written out: dynamo traces ``m not in (1, p)`` for a symbolic ``p`` as True (a size
    # that changed between calls made a valid mask an error under torch.compile)
    if mask.dim() > len(positions) or any(m != 1 and m != p for m, p in zip(mask.shape, trailing)):
        return ValueError(
            f"expected mask of shape {tuple(positions)} (the input's shape without the channel "
            f"dimension) or broadcastable to it, got mask of shape {tuple(mask.shape)} for "
            f"input of shape {tuple(input.shape)}"
        )
    if mask.device != input.device:
        return RuntimeError(
            "Expected input and mask to be on the same device, got input on "
            f"{input.device} and mask on {mask.device}"
        )
    return None


def valid_positions(mask: torch.Tensor, input: torch.Tensor) -> torch.Tensor:
    """``mask`` as an ``(N, 1, *)`` bool view that broadcasts against ``input``'s ``(N, C, *)``."""
    return mask.expand((input.shape[0], *input.shape[2:])).unsqueeze(1)


def _tested_per_element(valid: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``valid`` (bool) as a comparison with 0 of a float copy of it, stored once.

    The same values; but inductor's CPU kernels load a bool per element about 5x slower
    than they compare a float with 0, so each pass over the big tensor tests the copy.
    """
    return computed_once(valid.to(dtype, memory_format=torch.contiguous_format)) > 0


def shifted_moments(input: torch.Tensor, mask: torch.Tensor | None = None) -> ShiftedMoments:
    """Per-channel count and shifted sums of a local ``(N, C, *)`` batch (valid positions only).

    The shift is :func:`syncbn._kernels.generic.sample_shift` over the (valid) positions,
    as in eager mode: zeros if there is none, so that a padded NaN never reaches the sums.
    """
    dtype = _stats.stat_dtype(input.dtype)
    x = input.to(dtype)
    ndim, num_channels = x.dim(), x.shape[1]
    detached = input.detach()  # the shift's 9 values, read where the input is
    # a comparison, not the size's truth value: dynamo 2.4-2.6 guards on the value of a
    # size taken as a bool (one graph per batch size), on a comparison's result only
    empty = x.numel() == 0
    valid = None
    if mask is None:
        count = x.new_full((), x.numel() // num_channels, dtype=torch.float64)
        if empty:
            shift = x.new_zeros(num_channels)
        else:
            shift = sample_shift(detached, in_graph=True).to(dtype).view(num_channels)
        centered = x - channel_view(shift, ndim)
    else:
        bool_valid = valid_positions(mask, x)
        count = bool_valid.sum(dtype=torch.float64)
        # the first valid value: over an int32 mask, not bool (see first_valid_sample)
        first = first_valid_sample(detached, bool_valid.to(torch.int32))
        valid = _tested_per_element(bool_valid, dtype)
        if empty:
            shift = first.to(dtype)
        else:
            first = channel_view(first, ndim)
            # the 9 positions' validity from the tested float copy, as every pass reads it:
            # gathered from the bool mask, inductor's partitioner saved the bool validity
            # for backward, whose passes then loaded a bool per element instead of testing
            # a float copy made once (a masked call 1.76-1.87x an unmasked one, now
            # 1.04-1.12x)
            shift = sample_shift(detached, valid, first, in_graph=True)
            shift = shift.to(dtype).view(num_channels)
        centered = torch.where(valid, x - channel_view(shift, ndim), 0.0)
    reduced = [0, *range(2, ndim)]
    # the sums are stored anyway; their gradients, expanded over every element, are not
    return ShiftedMoments(
        count,
        computed_once(centered.sum(reduced)),
        computed_once(centered.square().sum(reduced)),
        shift,
        centered,
        valid,
    )


def normalize(
    input: torch.Tensor,
    moments: ShiftedMoments,
    mean: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """``(x - mean) * scale + bias``, zero at padded positions.

    Computed as ``centered * scale + offset`` with ``offset = bias + (shift - mean) *
    scale`` in float64 (``mean`` and ``scale`` are float64), then one pass in the
    statistics dtype, in the input's dtype and memory format at the end.
    """
    offset = output_offset(moments.shift, mean, scale, bias)
    centered = moments.centered
    ndim, dtype = centered.dim(), centered.dtype
    scale, offset = computed_once(scale.to(dtype)), computed_once(offset.to(dtype))
    output = centered * channel_view(scale, ndim) + channel_view(offset, ndim)
    if moments.valid is not None:
        output = torch.where(moments.valid, output, 0.0)
    return output.to(input.dtype)


def pack_moments(moments: ShiftedMoments) -> torch.Tensor:
    """One rank's ``[n, sum(x) (C), sum(x**2) (C)]`` in float64, the shift added back."""
    total, square_total = _stats.unshifted_sums(
        moments.shifted_sum.to(torch.float64),
        moments.shifted_square_sum.to(torch.float64),
        moments.shift.to(torch.float64),
        moments.local_count,
    )
    return torch.cat([moments.local_count.view(1), total, square_total])


def keep_local(moments: torch.Tensor) -> tuple[torch.Tensor, None]:
    """The :data:`Exchange` of a process alone that updates nothing (eval mode without
    running statistics): the global moments are the local ones."""
    return moments, None


def keep_local_cumulative(num_batches_tracked: torch.Tensor) -> Exchange:
    """The :data:`Exchange` of a process alone whose running statistics are a cumulative
    average (``momentum=None``): factor ``1 / (num_batches_tracked + 1)``, on the device.

    Under ``torch.compile`` torch's own forward reads that factor on the host, which
    ``fullgraph=True`` refuses.
    """

    def exchange(moments: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        factor = num_batches_tracked.add(1).to(torch.float64).reciprocal()
        moves = moments[0] > 1  # an empty batch moves nothing
        return moments, torch.stack([torch.ones_like(factor), factor * moves])

    return exchange


def _update_running_stats(
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    num_batches_tracked: torch.Tensor | None,
    count: torch.Tensor,
    mean: torch.Tensor,
    var: torch.Tensor,
    update: torch.Tensor,
) -> None:
    increment, factor = update.unbind()
    with torch.no_grad():
        unbiased_var = _stats.unbiased(var.detach(), count.detach())
        targets = (mean.detach(), unbiased_var)
        _stats.update_running_stats(running_mean, running_var, targets, factor, in_graph=True)
        if num_batches_tracked is not None:
            num_batches_tracked.add_(increment.to(num_batches_tracked.dtype))


def batch_norm_train(
    input: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    mask: torch.Tensor | None,
    exchange: Exchange,
    *,
    eps: float,
    running_mean: torch.Tensor | None = None,
    running_var: torch.Tensor | None = None,
    num_batches_tracked: torch.Tensor | None = None,
) -> torch.Tensor:
    """A training call: local moments, ``exchange``, global statistics and running
    statistics, normalization (differentiable)."""
    moments = shifted_moments(input, mask)
    global_moments, update = exchange(pack_moments(moments))
    count, sums = global_moments[0], global_moments[1:].view(2, -1)
    mean, var = _stats.global_moments(sums, count)
    if update is not None:
        _update_running_stats(
            running_mean, running_var, num_batches_tracked, count, mean, var, update
        )
    scale = _stats.scale(var, eps, None if weight is None else weight.to(torch.float64))
    return normalize(input, moments, mean, scale, bias)


def batch_norm_valid(
    input: torch.Tensor,
    mask: torch.Tensor | None,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    training: bool,
    momentum: float,
    eps: float,
) -> torch.Tensor:
    """``torch.nn.functional.batch_norm`` with zeros at the padded positions of ``mask``
    (eval mode, or training without a mask).

    Zero in its input too, not only in its output: the weight gradient sums over every
    position, and ``0 * NaN`` at a padded position would make it NaN.
    """
    if mask is None:
        return F.batch_norm(input, running_mean, running_var, weight, bias, training, momentum, eps)
    valid = _tested_per_element(valid_positions(mask, input), input.dtype)
    zeroed = torch.where(valid, input, 0.0)
    output = F.batch_norm(zeroed, running_mean, running_var, weight, bias, training, momentum, eps)
    return torch.where(valid, output, 0.0)
