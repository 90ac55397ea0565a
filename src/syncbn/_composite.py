"""SyncBatchNorm's training call as ordinary torch ops around one per-channel synchronizing step.

The eager path (:mod:`syncbn._autograd`) runs fused kernels with a hand-written backward.
This module spells the same maths as plain, differentiable torch ops instead, so that
under ``torch.compile`` every pass over the big tensors is in the graph, where inductor
fuses the normalization with the elementwise ops after it (the ReLU, the residual add),
and autograd derives the backward reductions and the input gradient.
A mask of valid positions (padded batches) is a ``torch.where`` in those passes. It also
holds the mask helpers that both paths share.

Only the per-channel step is opaque: a ``synchronize`` callable takes one rank's count
and shifted sums, and the weight, and returns the global mean and
``scale = weight / sqrt(var + eps)`` (one collective in forward, one in backward, the
checks and the running statistics: :func:`syncbn._autograd.sync_moments`, which the custom
op of :mod:`syncbn._compiled` runs). The weight goes through the step (its gradient needs
the step's backward) and the ops are registered as having side effects, so that a compiler
keeps the backward collective on a rank whose local batch is empty, where the input's
gradient is empty and needs nothing.

Exactness is that of the eager path: moments of data shifted by one of the rank's own
values per channel (no cancellation for inputs whose mean is large compared with their
spread), the shift added back in float64, the output as ``(x - shift) * scale + offset``
with ``offset = bias + (shift - mean) * scale`` in float64.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from syncbn import _stats
from syncbn._kernels.generic import channel_view, first_valid_sample

__all__ = [
    "ShiftedMoments",
    "Synchronize",
    "batch_norm_train",
    "local_statistics",
    "mask_problem",
    "normalize",
    "shifted_moments",
    "valid_positions",
    "zero_padded",
]

#: ``(count, shifted_sum, shifted_square_sum, shift, weight) -> (mean, scale)``: the global
#: mean and ``scale = weight / sqrt(var + eps)`` (``1 / sqrt(var + eps)`` without a weight)
Synchronize = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None"],
    tuple[torch.Tensor, torch.Tensor],
]


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


def mask_problem(mask: torch.Tensor, input: torch.Tensor) -> Exception | None:
    """The error a bad ``mask`` for an ``(N, C, *)`` ``input`` deserves, or ``None``."""
    if not isinstance(mask, torch.Tensor):
        return TypeError(f"expected mask to be a torch.Tensor, got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        return TypeError(f"expected mask of dtype torch.bool, got mask of dtype {mask.dtype}")
    positions = (input.shape[0], *input.shape[2:])
    trailing = positions[len(positions) - mask.dim() :] if mask.dim() <= len(positions) else ()
    if mask.dim() > len(positions) or any(m not in (1, p) for m, p in zip(mask.shape, trailing)):
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


def shifted_moments(input: torch.Tensor, mask: torch.Tensor | None = None) -> ShiftedMoments:
    """Per-channel count and shifted sums of a local ``(N, C, *)`` batch (valid positions only).

    The shift is the batch's first (valid) sample: zeros if there is none, so that a padded
    NaN never reaches the sums.
    """
    dtype = _stats.stat_dtype(input.dtype)
    x = input.to(dtype)
    ndim, num_channels = x.dim(), x.shape[1]
    detached = x.detach()
    valid = None
    if mask is None:
        count = x.new_full((), x.numel() // num_channels, dtype=torch.float64)
        first = (0, slice(None)) + (0,) * (ndim - 2)
        shift = detached[first] if x.numel() else x.new_zeros(num_channels)
        centered = x - channel_view(shift, ndim)
    else:
        valid = valid_positions(mask, x)
        count = valid.sum(dtype=torch.float64)
        shift = first_valid_sample(detached, valid)
        centered = torch.where(valid, x - channel_view(shift, ndim), 0.0)
    reduced = [0, *range(2, ndim)]
    return ShiftedMoments(
        count,
        centered.sum(reduced),
        centered.square().sum(reduced),
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
    offset = (moments.shift.to(torch.float64) - mean) * scale
    if bias is not None:
        offset = offset + bias.to(torch.float64)
    centered = moments.centered
    ndim, dtype = centered.dim(), centered.dtype
    output = centered * channel_view(scale.to(dtype), ndim) + channel_view(offset.to(dtype), ndim)
    if moments.valid is not None:
        output = torch.where(moments.valid, output, 0.0)
    return output.to(input.dtype)


def batch_norm_train(
    input: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    mask: torch.Tensor | None,
    synchronize: Synchronize,
) -> torch.Tensor:
    """A training call: local moments, ``synchronize``, normalization (differentiable)."""
    moments = shifted_moments(input, mask)
    mean, scale = synchronize(*moments[:4], weight)
    return normalize(input, moments, mean, scale, bias)


def local_statistics(
    count: torch.Tensor,
    shifted_sum: torch.Tensor,
    shifted_square_sum: torch.Tensor,
    shift: torch.Tensor,
    weight: torch.Tensor | None,
    *,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A :data:`Synchronize` step of one process that updates nothing: the local mean and
    scale (eval mode without running statistics; bind ``eps`` with functools.partial)."""
    sums, square_sums, shifts = torch.stack([shifted_sum, shifted_square_sum, shift]).double()
    total, square_total = _stats.unshifted_sums(sums, square_sums, shifts, count)
    mean, var = _stats.global_moments(torch.stack([total, square_total]), count)
    return mean, _stats.scale(var, eps, None if weight is None else weight.to(torch.float64))


def zero_padded(output: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """``output`` with zeros at the padded positions of ``mask`` (eval mode)."""
    if mask is None:
        return output
    return torch.where(valid_positions(mask, output), output, 0.0)
