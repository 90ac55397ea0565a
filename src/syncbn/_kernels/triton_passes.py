"""Triton kernels for a deferred call's four passes over the data, masked or not: the GPU
path's counterpart of :mod:`syncbn._kernels.generic`'s passes.

Counting a read or a write of the whole tensor as one, the generic kernels move 5 tensors
in an unmasked forward (a shifted copy, its sums, the output written into it by
finalize's one-pass ``addcmul``; 7 with their own two passes) and 7 in its backward (the
sums, an eval-mode ``batch_norm``, an ``addcmul_``); a masked call moves 9 and 11,
because padded positions may hold anything (NaN included, which a multiplication by zero
keeps): the shifted copy is zeroed there and saved for backward, the output's offset is
added where valid only, the output gradient is zeroed before its sums. These kernels read
the data only where it is valid (a masked load never reads a padded position) and move 3
in forward (the input twice, the output once) and 5 in backward (the output gradient and
the input twice each, the input gradient once), masked or not, as
cuDNN's BatchNorm does; there is no shifted copy, and backward reads the input itself:

- :func:`shift_of`: the shift, the median of 9 values per channel as
  :func:`syncbn._kernels.generic.sample_shift` takes it, in one small kernel;
- :func:`shifted_sums`: per channel, the sums of ``x - shift`` and of its squares over
  the valid positions, in the statistics dtype (partial sums per share of the tiles, then
  their sum), as :func:`syncbn._kernels.generic.shifted_sums` takes them;
- :func:`normalize`: ``(x - shift) * scale + offset`` where valid, 0 elsewhere;
- :func:`backward_reduce`: ``sum(dy)`` and ``sum(dy * xhat)`` over the valid positions,
  with ``xhat = (x - shift - centered_mean) / sqrt(var + eps)`` (the centered mean
  ``mean - shift`` is small, so a float32 input whose mean is large against its spread
  loses nothing);
- :func:`input_grad`: ``dy * scale + (x - shift) * slope + offset`` where valid, 0
  elsewhere, with the slope and offset rows of
  :func:`syncbn._kernels.finalize.finalize_backward`.

Every value is computed in the statistics dtype (float32, or float64 for a float64 input)
and stored in the input's. They take a non-empty input that is contiguous or channels
last (:func:`syncbn._kernels.takes_triton_passes`); :mod:`syncbn._autograd` gives the
others to the generic kernels.
Like :mod:`syncbn._kernels.finalize`, whose calls they join, they are a candidate until a
GPU run measures them; on the CPU the tests run them through Triton's interpreter.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from syncbn._kernels.generic import (
    dense_format,
    first_valid_sample,
    lattice_offsets,
    shift_lattice,
)
from syncbn._stats import stat_dtype

__all__ = [
    "backward_reduce",
    "input_grad",
    "normalize",
    "on_device_of",
    "shift_of",
    "shifted_sums",
]

#: channels and positions of one program's tile
_BLOCK_C = 16
_BLOCK_L = 64
#: about how many programs share a reduction (a few per multiprocessor of a large GPU)
_REDUCTION_PROGRAMS = 512
#: channels of one program of :func:`shift_of`'s kernel
_SHIFT_BLOCK_C = 128


class _Layout(NamedTuple):
    """An ``(N, C, *)`` batch seen as ``(samples, C, positions)``: the kernels' indexing."""

    samples: int
    channels: int
    positions: int
    channel_stride: int
    position_stride: int
    format: torch.memory_format


def _layout(input: torch.Tensor) -> _Layout:
    """``input`` as ``(samples, C, L)`` with its positions flattened, in its memory format.

    The strides are the format's own (those of a tensor that ``is_contiguous`` in it, for
    every dimension longer than 1; a dimension of length 1 is only ever indexed at 0). A
    ``(N, C)`` batch is one sample of ``N`` positions whose channels are adjacent: its
    tiles then span samples, not one sample each.
    """
    format = dense_format(input)
    assert format is not None, "syncbn._kernels.takes_triton_passes() is the caller's test"
    num_samples, num_channels = input.shape[:2]
    if input.dim() == 2:
        return _Layout(1, num_channels, num_samples, 1, num_channels, format)
    length = math.prod(input.shape[2:])
    if format == torch.contiguous_format:
        return _Layout(num_samples, num_channels, length, length, 1, format)
    return _Layout(num_samples, num_channels, length, 1, num_channels, format)


def _positions(valid: torch.Tensor | None, input: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """``valid`` (``(N, 1, *)`` bool, maybe expanded) as ``(N * L,)`` bytes, 1 where valid,
    and whether the call is masked; unmasked, a pointer that the kernels never read."""
    if valid is None:
        return input, False
    return valid.reshape(-1).contiguous().view(torch.uint8), True


def _ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` for the grids (``triton.cdiv`` costs microseconds per call on the host
    in Triton 3.8, a function that kernels may call too)."""
    return -(-a // b)


def on_device_of(tensor: torch.Tensor) -> Any:
    """Triton launches on the current device, which need not be the tensors' (a model on
    cuda:1 without ``torch.cuda.set_device(1)``; torch's own ops guard the device): this
    context makes it ``tensor``'s, for the kernels here and in
    :mod:`syncbn._kernels.finalize`."""
    return torch.cuda.device(tensor.device) if tensor.is_cuda else contextlib.nullcontext()


def _reduced(
    kernel: Any,
    input: torch.Tensor,
    layout: _Layout,
    masked: bool,
    dtype: torch.dtype,
    *leading: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A reduction kernel's two ``(C,)`` rows of sums: each program sums a block of
    channels over a share of the tiles (a sample's block of positions) into ``partials``,
    then torch sums the shares.

    Args:
        leading: the kernel's arguments before ``partials`` (the layout's follow it).
    """
    num_samples, num_channels, length, channel_stride, position_stride, _ = layout
    channel_blocks = _ceil_div(num_channels, _BLOCK_C)
    position_blocks = _ceil_div(length, _BLOCK_L)
    tiles = num_samples * position_blocks
    shares = max(1, min(tiles, _REDUCTION_PROGRAMS // channel_blocks))
    tiles_per_share = _ceil_div(tiles, shares)
    partials = torch.empty(shares, 2, num_channels, dtype=dtype, device=input.device)
    with on_device_of(input):
        kernel[(channel_blocks, shares)](
            *leading,
            partials,
            tiles,
            num_channels,
            length,
            channel_stride,
            position_stride,
            position_blocks,
            tiles_per_share,
            MASKED=masked,
            BLOCK_C=_BLOCK_C,
            BLOCK_L=_BLOCK_L,
        )
    first, second = partials.sum(0).unbind()
    return first, second


def _mapped(
    kernel: Any, input: torch.Tensor, layout: _Layout, masked: bool, *leading: Any
) -> torch.Tensor:
    """An element-wise kernel's result: a new tensor of ``input``'s shape, dtype and memory
    format, one program per sample, block of positions and block of channels.

    Args:
        leading: the kernel's arguments before the result (the layout's follow it).
    """
    num_samples, num_channels, length, channel_stride, position_stride, format = layout
    result = torch.empty(input.shape, dtype=input.dtype, device=input.device, memory_format=format)
    position_blocks = _ceil_div(length, _BLOCK_L)
    grid = (num_samples * position_blocks, _ceil_div(num_channels, _BLOCK_C))
    with on_device_of(input):
        kernel[grid](
            *leading,
            result,
            num_channels,
            length,
            channel_stride,
            position_stride,
            position_blocks,
            MASKED=masked,
            BLOCK_C=_BLOCK_C,
            BLOCK_L=_BLOCK_L,
        )
    return result


def shift_of(input: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """A call's shift: ``(C,)`` in the statistics dtype, contiguous: the
    :func:`syncbn._kernels.generic.sample_shift` of a non-empty batch (over its valid
    positions; zeros where none is valid, so that a padded NaN never becomes a shift), in
    one Triton kernel where the generic code launches 6 (7 masked, after the 6 that find
    the first valid value)."""
    num_channels = input.shape[1]
    detached = input.detach()
    lattice = shift_lattice(input.shape)
    masked = valid is not None
    # unmasked, pointers that the kernel never reads
    bits, fallback = detached, detached
    valid_offsets = (0, 0, 0)
    if valid is not None:
        fallback = first_valid_sample(detached, valid)
        bits = valid.view(torch.uint8)  # (a bool is a byte; any strides, expanded too)
        valid_offsets = lattice_offsets(valid, lattice)
    shift = torch.empty(num_channels, dtype=stat_dtype(input.dtype), device=input.device)
    with on_device_of(input):
        _shift_kernel[(_ceil_div(num_channels, _SHIFT_BLOCK_C),)](
            detached,
            bits,
            fallback,
            shift,
            num_channels,
            input.stride(1),
            *lattice_offsets(input, lattice),
            *valid_offsets,
            MASKED=masked,
            BLOCK_C=_SHIFT_BLOCK_C,
        )
    return shift


def shifted_sums(
    input: torch.Tensor, valid: torch.Tensor | None, shift: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per channel, ``sum(x - shift)`` and ``sum((x - shift) ** 2)`` over the valid positions
    (all where ``valid`` is ``None``), ``(C,)`` each in the statistics dtype."""
    positions, masked = _positions(valid, input)
    dtype = stat_dtype(input.dtype)
    layout = _layout(input)
    return _reduced(_shifted_sums_kernel, input, layout, masked, dtype, input, positions, shift)


def normalize(
    input: torch.Tensor,
    valid: torch.Tensor | None,
    shift: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor,
) -> torch.Tensor:
    """The output ``(x - shift) * scale + offset`` where valid (everywhere unmasked), 0
    elsewhere, in the input's dtype and memory format (``scale`` and ``offset``: ``(C,)``
    in the statistics dtype, from :func:`syncbn._kernels.finalize.finalize_forward`)."""
    positions, masked = _positions(valid, input)
    leading = (input, positions, shift, scale, offset)
    return _mapped(_normalize_kernel, input, _layout(input), masked, *leading)


def backward_reduce(
    grad_output: torch.Tensor,
    input: torch.Tensor,
    valid: torch.Tensor | None,
    shift: torch.Tensor,
    saved: torch.Tensor,
    epsilon: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per channel, ``sum(dy)`` and ``sum(dy * xhat)`` over the valid positions, ``(C,)``
    each in the statistics dtype.

    Args:
        saved: the forward's ``(4, C)`` saved statistics, whose mean row is ``mean - shift``
            (:func:`syncbn._kernels.finalize.finalize_forward` with ``centered_mean``).
        epsilon: ``eps`` in float64 on the device (:func:`syncbn._kernels.finalize.epsilon`).
    """
    layout = _layout(input)
    grad_output = grad_output.contiguous(memory_format=layout.format)  # the input's strides
    positions, masked = _positions(valid, input)
    leading = (grad_output, input, positions, shift, saved, epsilon)
    return _reduced(_backward_reduce_kernel, input, layout, masked, saved.dtype, *leading)


def input_grad(
    grad_output: torch.Tensor,
    input: torch.Tensor,
    valid: torch.Tensor | None,
    shift: torch.Tensor,
    scale: torch.Tensor,
    slope: torch.Tensor,
    offset: torch.Tensor,
) -> torch.Tensor:
    """The input gradient ``dy * scale + (x - shift) * slope + offset`` where valid
    (everywhere unmasked), 0 elsewhere, in the input's dtype and memory format (``slope``
    and ``offset``: the slope and offset rows of
    :func:`syncbn._kernels.finalize.finalize_backward`)."""
    layout = _layout(input)
    grad_output = grad_output.contiguous(memory_format=layout.format)
    positions, masked = _positions(valid, input)
    leading = (grad_output, input, positions, shift, scale, slope, offset)
    return _mapped(_input_grad_kernel, input, layout, masked, *leading)


#: the combination of ``tl.sum``, whose reductions Triton's interpreter runs as one numpy sum
#: (any other combination it calls element by element: ~20x slower tests); the kernels use
#: only Triton's core (``tl.reduce``), because ``tl.sum``, ``tl.zeros`` and the rest of its
#: standard library are compiled kernels' functions unless Triton was imported with
#: ``TRITON_INTERPRET`` set, which the tests set later
_SUM = tl.standard._sum_combine


@triton.jit
def _row_sums(tile):  # type: ignore[no-untyped-def]
    """The sums of a tile's rows."""
    return tl.reduce(tile, 1, _SUM)


@triton.jit
def _tile(sample, first_position, channel, num_channels, length, channel_stride,
          position_stride, positions, BLOCK_L: tl.constexpr, MASKED: tl.constexpr):  # type: ignore[no-untyped-def]  # fmt: skip
    """Offsets of a ``(channels, positions)`` tile of one sample in the ``(N, C, L)`` view,
    which of its elements are valid (inside the tensor, and at a valid position of a
    masked call), and which are inside the tensor."""
    sample = tl.cast(sample, tl.int64)  # (a loop's index: a number when interpreted)
    position = first_position + tl.arange(0, BLOCK_L)
    inside = position < length
    element = (
        sample * num_channels * length
        + channel[:, None].to(tl.int64) * channel_stride
        + position[None, :].to(tl.int64) * position_stride
    )
    in_tensor = (channel < num_channels)[:, None] & inside[None, :]
    if MASKED:
        is_valid = tl.load(positions + sample * length + position, mask=inside, other=0) != 0
        valid = (channel < num_channels)[:, None] & is_valid[None, :]
    else:
        valid = in_tensor
    return element, valid, in_tensor


@triton.jit
def _element_tile(positions, num_channels, length, channel_stride, position_stride,
                  position_blocks, BLOCK_C: tl.constexpr, BLOCK_L: tl.constexpr,
                  MASKED: tl.constexpr):  # type: ignore[no-untyped-def]  # fmt: skip
    """An element-wise kernel's tile: its channels (and which exist), then :func:`_tile`'s
    offsets and masks; program 0 counts samples times blocks of positions."""
    sample = tl.program_id(0) // position_blocks
    # in 64 bits: a plane of 2**31 positions or more would wrap the first position negative
    first_position = tl.cast(tl.program_id(0) % position_blocks, tl.int64) * BLOCK_L
    channel = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    element, valid, in_tensor = _tile(
        sample, first_position, channel, num_channels, length, channel_stride,
        position_stride, positions, BLOCK_L, MASKED,
    )  # fmt: skip
    return channel, channel < num_channels, element, valid, in_tensor


@triton.jit
def _reduction_tile(tile, channel, num_channels, length, channel_stride, position_stride,
                    position_blocks, positions, BLOCK_L: tl.constexpr,
                    MASKED: tl.constexpr):  # type: ignore[no-untyped-def]  # fmt: skip
    """A reduction kernel's ``tile`` (tiles count a sample's blocks of positions, sample
    after sample; :func:`_reduced` shares them out): :func:`_tile`'s offsets and which
    elements are valid."""
    first_position = tl.cast(tile % position_blocks, tl.int64) * BLOCK_L  # (as _element_tile)
    element, valid, _ = _tile(
        tile // position_blocks, first_position, channel, num_channels, length, channel_stride,
        position_stride, positions, BLOCK_L, MASKED,
    )  # fmt: skip
    return element, valid


@triton.jit
def _store_share(partials, share, channel, num_channels, first, second):  # type: ignore[no-untyped-def]
    """A share's two ``(C,)`` rows of sums, for its block of channels, into ``partials``
    (``(shares, 2, C)``, which :func:`_reduced` sums over the shares)."""
    row = partials + share * 2 * num_channels
    inside = channel < num_channels
    tl.store(row + channel, first, mask=inside)
    tl.store(row + num_channels + channel, second, mask=inside)


@triton.jit
def _column(per_channel, channel, inside):  # type: ignore[no-untyped-def]
    """A ``(C,)`` tensor's values for a tile's channels, as a column."""
    return tl.load(per_channel + channel, mask=inside, other=0.0)[:, None]


@triton.jit(do_not_specialize=["tiles", "tiles_per_share"])
def _shifted_sums_kernel(  # type: ignore[no-untyped-def]
    input,
    positions,
    shift,
    partials,
    tiles,
    num_channels,
    length,
    channel_stride,
    position_stride,
    position_blocks,
    tiles_per_share,
    MASKED: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_L: tl.constexpr,
):
    stat_type = partials.dtype.element_ty
    channel = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    share = tl.program_id(1)
    local_shift = _column(shift, channel, channel < num_channels)
    total = tl.full([BLOCK_C, BLOCK_L], 0.0, stat_type)
    square_total = tl.full([BLOCK_C, BLOCK_L], 0.0, stat_type)
    first_tile = share * tiles_per_share
    for tile in range(first_tile, tl.minimum(first_tile + tiles_per_share, tiles)):
        element, valid = _reduction_tile(
            tile, channel, num_channels, length, channel_stride, position_stride,
            position_blocks, positions, BLOCK_L, MASKED,
        )  # fmt: skip
        x = tl.load(input + element, mask=valid, other=0.0).to(stat_type)
        shifted = tl.where(valid, x - local_shift, 0.0)
        total += shifted
        square_total += shifted * shifted
    _store_share(partials, share, channel, num_channels, _row_sums(total), _row_sums(square_total))


@triton.jit
def _normalize_kernel(  # type: ignore[no-untyped-def]
    input,
    positions,
    shift,
    scale,
    offset,
    output,
    num_channels,
    length,
    channel_stride,
    position_stride,
    position_blocks,
    MASKED: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_L: tl.constexpr,
):
    stat_type = scale.dtype.element_ty
    channel, inside, element, valid, in_tensor = _element_tile(
        positions, num_channels, length, channel_stride, position_stride, position_blocks,
        BLOCK_C, BLOCK_L, MASKED,
    )  # fmt: skip
    x = tl.load(input + element, mask=valid, other=0.0).to(stat_type)
    y = (x - _column(shift, channel, inside)) * _column(scale, channel, inside)
    y = tl.where(valid, y + _column(offset, channel, inside), 0.0)
    tl.store(output + element, y.to(output.dtype.element_ty), mask=in_tensor)


@triton.jit(do_not_specialize=["tiles", "tiles_per_share"])
def _backward_reduce_kernel(  # type: ignore[no-untyped-def]
    grad_output,
    input,
    positions,
    shift,
    saved,
    epsilon,
    partials,
    tiles,
    num_channels,
    length,
    channel_stride,
    position_stride,
    position_blocks,
    tiles_per_share,
    MASKED: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_L: tl.constexpr,
):
    stat_type = partials.dtype.element_ty
    channel = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    share = tl.program_id(1)
    inside = channel < num_channels
    local_shift = _column(shift, channel, inside)
    centered_mean = _column(saved, channel, inside)
    var = tl.load(saved + num_channels + channel, mask=inside, other=1.0)
    # 1 / sqrt(var + eps) in the statistics dtype, as finalize_backward's slope rows
    inverse_std = 1.0 / tl.sqrt(var + tl.load(epsilon).to(stat_type))
    total = tl.full([BLOCK_C, BLOCK_L], 0.0, stat_type)
    product_total = tl.full([BLOCK_C, BLOCK_L], 0.0, stat_type)
    first_tile = share * tiles_per_share
    for tile in range(first_tile, tl.minimum(first_tile + tiles_per_share, tiles)):
        element, valid = _reduction_tile(
            tile, channel, num_channels, length, channel_stride, position_stride,
            position_blocks, positions, BLOCK_L, MASKED,
        )  # fmt: skip
        dy = tl.load(grad_output + element, mask=valid, other=0.0).to(stat_type)
        x = tl.load(input + element, mask=valid, other=0.0).to(stat_type)
        dy = tl.where(valid, dy, 0.0)
        total += dy
        product_total += dy * tl.where(valid, x - local_shift - centered_mean, 0.0)
    product = _row_sums(product_total) * inverse_std
    _store_share(partials, share, channel, num_channels, _row_sums(total), product)


@triton.jit
def _input_grad_kernel(  # type: ignore[no-untyped-def]
    grad_output,
    input,
    positions,
    shift,
    scale,
    slope,
    offset,
    grad_input,
    num_channels,
    length,
    channel_stride,
    position_stride,
    position_blocks,
    MASKED: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_L: tl.constexpr,
):
    stat_type = scale.dtype.element_ty
    channel, inside, element, valid, in_tensor = _element_tile(
        positions, num_channels, length, channel_stride, position_stride, position_blocks,
        BLOCK_C, BLOCK_L, MASKED,
    )  # fmt: skip
    dy = tl.load(grad_output + element, mask=valid, other=0.0).to(stat_type)
    x = tl.load(input + element, mask=valid, other=0.0).to(stat_type)
    shifted = x - _column(shift, channel, inside)
    dx = dy * _column(scale, channel, inside) + shifted * _column(slope, channel, inside)
    dx = dx + _column(offset, channel, inside)
    tl.store(grad_input + element, tl.where(valid, dx, 0.0).to(grad_input.dtype.element_ty),
             mask=in_tensor)  # fmt: skip


@triton.jit
def _median_of_3(a, b, c):  # type: ignore[no-untyped-def]
    """The median of 3, as :func:`syncbn._kernels.generic.ninther` takes it (``c`` clamped
    between the min and max of the others); a NaN gives NaN, as torch's ops do."""
    low = tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)
    high = tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)
    clamped = tl.maximum(c, low, propagate_nan=tl.PropagateNan.ALL)
    return tl.minimum(clamped, high, propagate_nan=tl.PropagateNan.ALL)


# fmt: off
@triton.jit
def _lattice_value(input, valid, replacement, channel, inside, channel_stride, offset,
                   valid_offset, MASKED: tl.constexpr):  # type: ignore[no-untyped-def]
    """One of the shift's 9 values for a block of channels; masked, ``replacement`` (the
    first valid value) where its position is padded."""
    value = tl.load(input + offset + channel.to(tl.int64) * channel_stride, mask=inside,
                    other=0.0)
    if MASKED:
        value = tl.where(tl.load(valid + valid_offset) != 0, value, replacement)
    return value


@triton.jit
def _median_of_group(input, valid, replacement, channel, inside, channel_stride, offset,
                     step, valid_offset, valid_step, MASKED: tl.constexpr):  # type: ignore[no-untyped-def]
    """The median of a group's 3 values, ``step`` apart (``valid_step`` in the mask)."""
    first = _lattice_value(input, valid, replacement, channel, inside, channel_stride,
                           offset, valid_offset, MASKED)
    second = _lattice_value(input, valid, replacement, channel, inside, channel_stride,
                            offset + step, valid_offset + valid_step, MASKED)
    third = _lattice_value(input, valid, replacement, channel, inside, channel_stride,
                           offset + 2 * step, valid_offset + 2 * valid_step, MASKED)
    return _median_of_3(first, second, third)


@triton.jit
def _shift_kernel(input, valid, fallback, shift, num_channels, channel_stride, offset,
                  group_step, member_step, valid_offset, valid_group_step,
                  valid_member_step, MASKED: tl.constexpr, BLOCK_C: tl.constexpr):  # type: ignore[no-untyped-def]
    """:func:`shift_of`: per channel, the median of the medians of 3 of the lattice's 3
    groups of 3 values (:func:`syncbn._kernels.generic.shift_lattice`), stored in the
    statistics dtype."""
    channel = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    inside = channel < num_channels
    replacement = tl.load(fallback + channel, mask=inside, other=0.0) if MASKED else 0.0
    # offsets in 64 bits: Triton passes an integer under 2**31 as 32 bits, and the sums
    # below (offset + 2 * group_step: past 2**31 in a tensor of a few billion values)
    # would wrap to addresses before the tensor
    offset, group_step = tl.cast(offset, tl.int64), tl.cast(group_step, tl.int64)
    member_step, valid_offset = tl.cast(member_step, tl.int64), tl.cast(valid_offset, tl.int64)
    valid_group_step = tl.cast(valid_group_step, tl.int64)
    valid_member_step = tl.cast(valid_member_step, tl.int64)
    first = _median_of_group(input, valid, replacement, channel, inside, channel_stride,
                             offset, member_step, valid_offset, valid_member_step, MASKED)
    second = _median_of_group(input, valid, replacement, channel, inside, channel_stride,
                              offset + group_step, member_step,
                              valid_offset + valid_group_step, valid_member_step, MASKED)
    third = _median_of_group(input, valid, replacement, channel, inside, channel_stride,
                             offset + 2 * group_step, member_step,
                             valid_offset + 2 * valid_group_step, valid_member_step, MASKED)
    median = _median_of_3(first, second, third)
    # 0 where it is not finite (inf - inf is NaN), as syncbn._kernels.generic.sample_shift
    median = tl.where(median - median == 0.0, median, 0.0)
    tl.store(shift + channel, median.to(shift.dtype.element_ty), mask=inside)
# fmt: on
