"""Triton kernels for the small per-channel work of a deferred synchronized call around its
collectives: packing the local sums, checking the all-reduced header, and the per-channel
maths after it, in forward and in backward.

On a GPU an eager training call is bound by the host: the first GPU run (H100, 2026-11-28,
docs/performance.md, "On a GPU") measured ~2.2 ms of host time per forward+backward call of
one layer, whatever the shape, for 43 kernel launches, and ~130 µs of device time per call
inside a CUDA graph, where cuDNN's BatchNorm takes a few kernels. Of a deferred forward's 33
kernels, 24 are tiny ops between the collective and the output pass: the header's checks
(:func:`syncbn._protocol.device_flags`) and the factor of the running statistics' update,
the divisors of the global count, mean and variances, scale, the saved statistics, the
output's offset, the running statistics and the batch counter.
:func:`finalize_forward` does all of them in one kernel, with the same float64 maths (the
same formulas as :mod:`syncbn._protocol`, :mod:`syncbn._stats`,
:func:`syncbn._autograd.reduce_forward` and :func:`syncbn._kernels.generic.output_offset`;
compiled, a product and a sum may fuse into one rounding, and a float32 square root and
division are approximate, as torch's CUDA ``rsqrt`` is: an ulp or two apart from the torch
ops, which the interpreter's numpy maths do not show), and :func:`normalize` makes the
output pass one ``addcmul`` instead of the generic kernels' two. Before the collective,
:func:`pack_forward` adds the shift back to the local sums and packs the buffer in one
kernel (the generic code runs five). In the backward, :func:`pack_backward` packs the local
sums in one kernel (CUDA's ``torch.cat`` of mixed dtypes makes four) and
:func:`finalize_backward` reads the header and computes the input gradient's corrections in
one (the generic code runs three). A call then runs 12 torch kernels and these 4 instead of
49: the shift (a median of 9 values, 6 element-wise kernels), the shifted copy, its sums and
the output in forward, the sums, the correction pass and the gradient in backward; with
:mod:`syncbn._kernels.triton_passes` (below) 2 torch kernels and 9 Triton ones (the shift
one of them).

Deferred calls take them (an immediate call's count is a number on the host), masked ones
too: their count of valid positions is a tensor that the packing kernel reads on the
device. With these kernels, the four passes over the data are
:mod:`syncbn._kernels.triton_passes`' Triton kernels, masked or not (where
:func:`syncbn._kernels.takes_triton_passes`: a contiguous or channels-last input): they
read only the valid positions and save no shifted copy; other strides keep the generic
kernels' passes (and :func:`normalize` here).
They are a candidate, off unless :func:`syncbn._kernels.use_fused_finalize` turns them on
for a device type, until a GPU run measures them faster (``benchmarks/gpu.py``, variant
``syncbn-finalize``). This module imports Triton (which torch's CUDA builds install), so
syncbn imports it only then; on the CPU the tests run the kernels through Triton's
interpreter (``TRITON_INTERPRET=1``), where they compute the same functions, and compile
them for sm_80 and sm_90 with Triton's ptxas (the interpreter runs Python that the
compiler refuses).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from syncbn import _protocol
from syncbn._kernels import generic, triton_passes
from syncbn._kernels.generic import LocalMoments

__all__ = [
    "applies",
    "epsilon",
    "finalize_backward",
    "finalize_forward",
    "normalize",
    "pack_backward",
    "pack_forward",
    "triton_passes",
]

#: channels per block of the kernel's loop (one program does them all)
_BLOCK = 256


def applies(
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    *per_channel: torch.Tensor | None,
) -> bool:
    """Whether these kernels can take a call with these parameters and buffers: both
    running statistics or neither (of one dtype), every per-channel tensor contiguous."""
    if (running_mean is None) != (running_var is None):
        return False
    if running_mean is not None and running_var is not None:
        if running_mean.dtype != running_var.dtype:
            return False
    tensors = (running_mean, running_var, *per_channel)
    return all(t is None or t.is_contiguous() for t in tensors)


@_protocol.constant_cache(maxsize=64)
def epsilon(eps: float, device: torch.device) -> torch.Tensor:
    """``eps`` in float64 on ``device``: Triton would pass a Python float as float32."""
    return _protocol.on_device([eps], torch.float64, device)


def finalize_forward(
    buffer: torch.Tensor,
    shift: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    num_batches_tracked: torch.Tensor | None,
    counted_update: torch.Tensor | None,
    checks: tuple[int, int],
    eps: float,
    dtype: torch.dtype,
    update_buffers: bool,
    centered_mean: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A deferred call's checks and statistics from its all-reduced forward buffer: the
    saved statistics, the output's offset, the header values for the host; the running
    statistics and the batch counter moved in place where the checks pass.

    Args:
        buffer: the all-reduced forward buffer (float64, :mod:`syncbn._protocol`).
        shift: ``(C,)``, the local moments' shift (strided, or not), in the statistics
            dtype (:func:`pack_forward`'s) or float64 (the generic kernels').
        counted_update: :func:`syncbn._autograd.counted_update`, ``[1, momentum]`` in the
            running statistics' dtype; ``None`` for a cumulative average (``momentum=None``
            with a batch counter), whose factor is ``1 / (num_batches_tracked + 1)``.
        checks: the world size and this rank's fingerprint of the layer, which
            :func:`syncbn._protocol.device_flags` compares the header with.
        dtype: the statistics dtype of the call.
        update_buffers: false in a checkpointed recomputation, which moves nothing.
        centered_mean: save ``mean - shift``, the mean of the shifted copy that a masked
            call's backward takes as its input (:func:`syncbn._autograd.backward_input`),
            in the first row instead of the mean.

    Returns:
        ``saved``, the ``(4, C)`` rows ``[mean, var, scale, scale / -n]``, the ``(C,)``
        ``offset`` ``bias + (shift - mean) * scale``, both in ``dtype``, and the buffer's
        :func:`syncbn._protocol.header_values`, for :func:`syncbn._protocol.defer_check`.
    """
    num_channels = shift.numel()
    saved = torch.empty(4, num_channels, dtype=dtype, device=buffer.device)
    offset = torch.empty(num_channels, dtype=dtype, device=buffer.device)
    header = torch.empty(_protocol.FORWARD_HEADER_VALUES, dtype=buffer.dtype, device=buffer.device)
    running = running_mean is not None and update_buffers
    counted = num_batches_tracked is not None and update_buffers
    world_size, fingerprint = checks
    unused = buffer  # a pointer the kernel never reads (its flag is off)
    with triton_passes.on_device_of(buffer):
        _finalize_forward_kernel[(1,)](
            buffer,
            shift,
            unused if weight is None else weight,
            unused if bias is None else bias,
            running_mean if running else unused,
            running_var if running else unused,
            num_batches_tracked if num_batches_tracked is not None else unused,
            unused if counted_update is None else counted_update,
            epsilon(eps, buffer.device),
            saved,
            offset,
            header,
            num_channels,
            shift.stride(0),
            world_size,
            fingerprint,
            COUNT_SLOT=_protocol.COUNT_SLOT,
            HAS_WEIGHT=weight is not None,
            HAS_BIAS=bias is not None,
            UPDATE_RUNNING=running,
            WIDE_RUNNING=running_mean is not None and running_mean.dtype == torch.float64,
            COUNT_BATCH=counted,
            CUMULATIVE=counted_update is None,
            CENTERED_MEAN=centered_mean,
            BLOCK=_BLOCK,
        )
    return saved, offset, header


def normalize(centered: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """``centered * scale + offset`` per channel, written into ``centered``: the output of
    :func:`syncbn._kernels.generic.normalize` where it reuses the shifted copy (float32 and
    float64, a non-empty batch), as one ``addcmul`` where that makes two passes (on the
    CPU a broadcasting ``addcmul`` is several times slower than the two; on a GPU it is one
    launch and one read and write of the data)."""
    ndim = centered.dim()
    view = generic.channel_view
    return torch.addcmul(view(offset, ndim), centered, view(scale, ndim), out=centered)


def pack_forward(
    input: torch.Tensor,
    fingerprint: int,
    valid: torch.Tensor | None = None,
    triton_sums: bool = False,
) -> tuple[LocalMoments, torch.Tensor]:
    """:func:`syncbn._kernels.generic.local_moments` and :func:`syncbn._protocol.pack_forward`
    with the shift added back and the buffer packed in one kernel (the generic code runs
    five there).

    Args:
        valid: a masked call's valid positions (``(N, 1, *)`` bool), or ``None``; a masked
            batch's count is a 0-dim tensor, which the kernel reads on the device.
        triton_sums: the local sums are :func:`syncbn._kernels.triton_passes.shifted_sums`
            (where :func:`syncbn._kernels.takes_triton_passes`).

    Returns:
        The moments, whose ``total`` and ``square_total`` are views into the buffer (which
        the collective then sums in place) and whose ``shift`` is in the statistics dtype
        (:func:`syncbn._kernels.generic.sample_shift`), and the buffer. With
        ``triton_sums`` there is no shifted copy (``centered`` is ``None``).
    """
    num_channels = input.shape[1]
    if input.numel() == 0:  # nothing to sum: the generic code's zeros
        moments = generic.local_moments(input, valid)
        buffer = _protocol.pack_forward(0, moments.total, moments.square_total, fingerprint)
        return moments, buffer
    valid_count: int | torch.Tensor | None  # a tensor here: no host reads
    centered: torch.Tensor | None
    if triton_sums:
        valid_count = None if valid is None else valid.sum(dtype=torch.float64)
        shift = triton_passes.shift_of(input, valid)
        shifted_sum, shifted_square_sum = triton_passes.shifted_sums(input, valid, shift)
        centered = None
    else:
        shifted_sum, shifted_square_sum, shift, centered, valid_count = generic.shifted_sums(
            input, valid
        )
    count = input.numel() // num_channels  # (a masked batch's is valid_count)
    buffer = torch.empty(
        _protocol.forward_size(num_channels), dtype=torch.float64, device=shifted_sum.device
    )
    with triton_passes.on_device_of(buffer):
        _pack_forward_kernel[(1,)](
            shifted_sum,
            shifted_square_sum,
            shift,
            buffer,
            buffer if valid_count is None else valid_count,  # read only for a masked batch
            num_channels,
            shift.stride(0),
            count,
            fingerprint,
            COUNT_SLOT=_protocol.COUNT_SLOT,
            COUNT_IN_TENSOR=valid_count is not None,
            BLOCK=_BLOCK,
        )
    total, square_total = _protocol.forward_totals(buffer)
    local_count = count if valid_count is None else valid_count
    return LocalMoments(total, square_total, shift, centered, local_count), buffer


def pack_backward(
    sum_dy: torch.Tensor, sum_dy_xhat: torch.Tensor, fingerprint: int
) -> torch.Tensor:
    """:func:`syncbn._protocol.pack_backward` in one kernel (CUDA's ``torch.cat`` copies
    each input of another dtype on its own: four launches)."""
    num_channels = sum_dy.numel()
    buffer = torch.empty(
        _protocol.backward_size(num_channels), dtype=torch.float64, device=sum_dy.device
    )
    backward = _protocol.backward_fingerprint(fingerprint)
    with triton_passes.on_device_of(buffer):
        _pack_backward_kernel[(1,)](
            sum_dy,
            sum_dy_xhat,
            buffer,
            num_channels,
            backward,
            SUMS_SLOT=_protocol.SUMS_SLOT,
            BLOCK=_BLOCK,
        )
    return buffer


def finalize_backward(
    buffer: torch.Tensor, saved: torch.Tensor, eps: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The corrections of :func:`syncbn._kernels.generic.input_grad` from an all-reduced
    backward buffer, ``(2, C)`` in ``saved``'s dtype (the global ``sum(dy)`` and
    ``sum(dy * xhat)`` converted to it, times ``saved``'s last row), and the buffer's
    :func:`syncbn._protocol.header_values` for :func:`syncbn._protocol.defer_check`: one
    kernel where the generic code runs three.

    Args:
        eps: for an input gradient ``dy * scale + x * slope + offset`` (a masked call's
            in-place gradient, :func:`syncbn._kernels.generic.masked_input_grad`, and
            :func:`syncbn._kernels.triton_passes.input_grad`): then the rows are its
            ``slope`` and ``offset``, computed from the corrections as the generic code
            does (four kernels fewer); ``None``: the corrections.
    """
    num_channels = saved.shape[1]
    rows = torch.empty(2, num_channels, dtype=saved.dtype, device=buffer.device)
    header = torch.empty(4, dtype=buffer.dtype, device=buffer.device)
    masked = eps is not None
    with triton_passes.on_device_of(buffer):
        _finalize_backward_kernel[(1,)](
            buffer,
            saved,
            rows,
            header,
            epsilon(eps, buffer.device) if masked else buffer,  # (read only when masked)
            num_channels,
            SUMS_SLOT=_protocol.SUMS_SLOT,
            MASKED_ROWS=masked,
            BLOCK=_BLOCK,
        )
    return rows, header


@triton.jit
def _moved(start, end, factor, WIDE: tl.constexpr):  # type: ignore[no-untyped-def]
    """:func:`syncbn._stats.update_running_stats`: ``end * factor + start * (1 - factor)``
    in float64 for float64 buffers, else in float32 (torch's opmath; compiled, the product
    and the sum may fuse into one rounding), rounded to the buffer's dtype when stored; an
    infinite statistic stays infinite, as in torch's batch norm."""
    opmath = tl.float64 if WIDE else tl.float32
    factor = factor.to(opmath)
    return end.to(opmath) * factor + start.to(opmath) * (1.0 - factor)


@triton.jit(do_not_specialize=["num_channels", "shift_stride", "world_size", "fingerprint"])
def _finalize_forward_kernel(  # type: ignore[no-untyped-def]
    buffer,
    shift,
    weight,
    bias,
    running_mean,
    running_var,
    num_batches_tracked,
    counted_update,
    epsilon,
    saved,
    offset,
    header,
    num_channels,
    shift_stride,
    world_size,
    fingerprint,
    COUNT_SLOT: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    UPDATE_RUNNING: tl.constexpr,
    WIDE_RUNNING: tl.constexpr,
    COUNT_BATCH: tl.constexpr,
    CUMULATIVE: tl.constexpr,
    CENTERED_MEAN: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # syncbn._protocol.header_values and device_flags: no error flag, every rank's
    # fingerprint in the sums and the trailer, a global count other than 1 (passes: the
    # call counts a batch) and other than 0 (moves: the running statistics move)
    error = tl.load(buffer)
    fingerprint_sum = tl.load(buffer + 1)
    fingerprint_square_sum = tl.load(buffer + 2)
    trailer = tl.load(buffer + COUNT_SLOT + 1 + 2 * num_channels)
    n = tl.load(buffer + COUNT_SLOT)
    f = fingerprint.to(tl.float64)
    expected = world_size.to(tl.float64) * f
    same_layer = (
        (fingerprint_sum == expected)
        & (fingerprint_square_sum == expected * f)
        & (trailer == expected)
    )
    passes = (error == 0.0) & same_layer & (n != 1.0)
    moves = passes & (n != 0.0)
    # header_values' two rows of six, which the deferred check reads on the host
    tl.store(header, error)
    tl.store(header + 1, fingerprint_sum)
    tl.store(header + 2, fingerprint_square_sum)
    tl.store(header + 3, trailer)
    tl.store(header + 4, n)
    tl.store(header + 5, error)
    tl.store(header + 6, error)
    tl.store(header + 7, fingerprint_sum)
    tl.store(header + 8, fingerprint_square_sum)
    tl.store(header + 9, trailer)
    tl.store(header + 10, n)
    tl.store(header + 11, n)
    # the divisors of syncbn._autograd.count_divisors
    n_divisor = tl.maximum(n, 1.0)
    unbiased_divisor = tl.maximum(n - 1.0, 1.0)
    gradient_divisor = tl.minimum(-n, -1.0)
    # dtypes are compile-time values: set once here, never in the loop below (a variable
    # the loop assigns again is carried from iteration to iteration, which a dtype cannot be)
    stat_type = saved.dtype.element_ty
    running_type = running_mean.dtype.element_ty
    factor = 0.0
    if UPDATE_RUNNING:
        # syncbn._autograd.reduce_forward's factor, in the buffers' dtype (0 unless the
        # statistics move); read before the batch counter moves, at the end
        if CUMULATIVE:
            average = 1.0 / (tl.load(num_batches_tracked) + 1).to(tl.float64)
            if not WIDE_RUNNING:  # as torch converts a float64 to 16 bits: through float32
                average = average.to(tl.float32)
            factor = tl.where(moves, average, 0.0).to(running_type)
        else:
            factor = tl.where(moves, tl.load(counted_update + 1), 0.0).to(running_type)
        if WIDE_RUNNING:
            factor = factor.to(tl.float64)
        else:
            factor = factor.to(tl.float32)
    # one program for every channel (a loop over blocks): the per-channel work is tiny, and
    # a single program reads the batch counter before it moves it
    moments = buffer + COUNT_SLOT
    for first in range(0, num_channels, BLOCK):
        channel = first + tl.arange(0, BLOCK)
        inside = channel < num_channels
        total = tl.load(moments + 1 + channel, mask=inside, other=0.0)
        square_total = tl.load(moments + 1 + num_channels + channel, mask=inside, other=0.0)
        # syncbn._stats.moments_from_divisors; a NaN stays NaN (as clamp_ keeps it)
        mean = total / n_divisor
        deviations = square_total - total * mean
        deviations = tl.where(deviations < 0.0, 0.0, deviations)
        var = deviations / n_divisor
        unbiased_var = deviations / unbiased_divisor
        # syncbn._stats.scale, in float64
        scale = 1.0 / tl.sqrt(var + tl.load(epsilon))
        if HAS_WEIGHT:
            scale = scale * tl.load(weight + channel, mask=inside, other=1.0).to(tl.float64)
        # syncbn._kernels.generic.output_offset
        local_shift = tl.load(shift + channel * shift_stride, mask=inside, other=0.0)
        shifted_offset = (local_shift.to(tl.float64) - mean) * scale
        if HAS_BIAS:
            shifted_offset += tl.load(bias + channel, mask=inside, other=0.0).to(tl.float64)
        # a masked call's backward input may be the shifted copy (syncbn._autograd.forward_train)
        saved_mean = mean - local_shift.to(tl.float64) if CENTERED_MEAN else mean
        tl.store(saved + channel, saved_mean.to(stat_type), mask=inside)
        tl.store(saved + num_channels + channel, var.to(stat_type), mask=inside)
        tl.store(saved + 2 * num_channels + channel, scale.to(stat_type), mask=inside)
        row = (scale / gradient_divisor).to(stat_type)
        tl.store(saved + 3 * num_channels + channel, row, mask=inside)
        tl.store(offset + channel, shifted_offset.to(stat_type), mask=inside)
        if UPDATE_RUNNING:
            # syncbn._stats.update_running_stats: the targets in the statistics dtype
            start = tl.load(running_mean + channel, mask=inside, other=0.0)
            end = mean.to(stat_type)
            moved = _moved(start, end, factor, WIDE_RUNNING)
            tl.store(running_mean + channel, moved.to(running_type), mask=inside)
            start = tl.load(running_var + channel, mask=inside, other=0.0)
            end = unbiased_var.to(stat_type)
            moved = _moved(start, end, factor, WIDE_RUNNING)
            tl.store(running_var + channel, moved.to(running_type), mask=inside)
    if COUNT_BATCH:
        # every warp has read the counter (the factor's read above) before one thread moves
        # it: without the barrier a warp that starts late could read the moved counter
        tl.debug_barrier()
        tl.store(num_batches_tracked, tl.load(num_batches_tracked) + passes.to(tl.int64))


@triton.jit(do_not_specialize=["num_channels", "fingerprint"])
def _pack_backward_kernel(
    sum_dy,
    sum_dy_xhat,
    buffer,
    num_channels,
    fingerprint,
    SUMS_SLOT: tl.constexpr,
    BLOCK: tl.constexpr,
):  # type: ignore[no-untyped-def]
    # syncbn._protocol.pack_backward: [error (0), b, b**2, 0, sum(dy) (C), sum(dy * xhat) (C),
    # b], b the backward fingerprint
    f = fingerprint.to(tl.float64)
    tl.store(buffer, 0.0)
    tl.store(buffer + 1, f)
    tl.store(buffer + 2, f * f)
    tl.store(buffer + SUMS_SLOT - 1, 0.0)
    tl.store(buffer + SUMS_SLOT + 2 * num_channels, f)
    for first in range(0, num_channels, BLOCK):
        channel = first + tl.arange(0, BLOCK)
        inside = channel < num_channels
        values = tl.load(sum_dy + channel, mask=inside, other=0.0).to(tl.float64)
        tl.store(buffer + SUMS_SLOT + channel, values, mask=inside)
        values = tl.load(sum_dy_xhat + channel, mask=inside, other=0.0).to(tl.float64)
        tl.store(buffer + SUMS_SLOT + num_channels + channel, values, mask=inside)


@triton.jit(do_not_specialize=["num_channels"])
def _finalize_backward_kernel(
    buffer,
    saved,
    rows,
    header,
    epsilon,
    num_channels,
    SUMS_SLOT: tl.constexpr,
    MASKED_ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):  # type: ignore[no-untyped-def]
    # syncbn._protocol.header_values of a backward buffer: error, fingerprint sums, trailer
    tl.store(header, tl.load(buffer))
    tl.store(header + 1, tl.load(buffer + 1))
    tl.store(header + 2, tl.load(buffer + 2))
    tl.store(header + 3, tl.load(buffer + SUMS_SLOT + 2 * num_channels))
    # syncbn._kernels.generic.input_grad: totals.to(scale.dtype).mul_(correction_scale)
    stat_type = saved.dtype.element_ty
    for first in range(0, num_channels, BLOCK):
        channel = first + tl.arange(0, BLOCK)
        inside = channel < num_channels
        correction_scale = tl.load(saved + 3 * num_channels + channel, mask=inside, other=0.0)
        total = tl.load(buffer + SUMS_SLOT + channel, mask=inside, other=0.0)
        correction_bias = total.to(stat_type) * correction_scale
        total = tl.load(buffer + SUMS_SLOT + num_channels + channel, mask=inside, other=0.0)
        correction_weight = total.to(stat_type) * correction_scale
        if MASKED_ROWS:
            # syncbn._kernels.generic.corrected_input_grad's slope and offset, in the
            # statistics dtype: correction_weight * (var + eps).rsqrt(), then
            # correction_bias - slope * mean
            mean = tl.load(saved + channel, mask=inside, other=0.0)
            var = tl.load(saved + num_channels + channel, mask=inside, other=1.0)
            eps = tl.load(epsilon).to(stat_type)
            slope = correction_weight * (1.0 / tl.sqrt(var + eps)).to(stat_type)
            offset = correction_bias - slope * mean
            tl.store(rows + channel, slope, mask=inside)
            tl.store(rows + num_channels + channel, offset, mask=inside)
        else:
            tl.store(rows + channel, correction_bias, mask=inside)
            tl.store(rows + num_channels + channel, correction_weight, mask=inside)


@triton.jit(do_not_specialize=["num_channels", "shift_stride", "count", "fingerprint"])
def _pack_forward_kernel(  # type: ignore[no-untyped-def]
    shifted_sum,
    shifted_square_sum,
    shift,
    buffer,
    count_tensor,
    num_channels,
    shift_stride,
    count,
    fingerprint,
    COUNT_SLOT: tl.constexpr,
    COUNT_IN_TENSOR: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # syncbn._protocol.pack_forward: [error (0), f, f**2, n, sum(x) (C), sum(x**2) (C), f]
    f = fingerprint.to(tl.float64)
    # a masked batch's count of valid positions is a float64 tensor on the device
    n = tl.load(count_tensor) if COUNT_IN_TENSOR else count.to(tl.float64)
    tl.store(buffer, 0.0)
    tl.store(buffer + 1, f)
    tl.store(buffer + 2, f * f)
    tl.store(buffer + COUNT_SLOT, n)
    tl.store(buffer + COUNT_SLOT + 1 + 2 * num_channels, f)
    for first in range(0, num_channels, BLOCK):
        channel = first + tl.arange(0, BLOCK)
        inside = channel < num_channels
        # syncbn._stats.unshifted_sums, in float64
        local_shift = tl.load(shift + channel * shift_stride, mask=inside, other=0.0)
        local_shift = local_shift.to(tl.float64)
        total = tl.load(shifted_sum + channel, mask=inside, other=0.0).to(tl.float64)
        square_total = tl.load(shifted_square_sum + channel, mask=inside, other=0.0)
        unshifted = total + n * local_shift
        square_total = square_total.to(tl.float64) + local_shift * (total + unshifted)
        tl.store(buffer + COUNT_SLOT + 1 + channel, unshifted, mask=inside)
        tl.store(buffer + COUNT_SLOT + 1 + num_channels + channel, square_total, mask=inside)
