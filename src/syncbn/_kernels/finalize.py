"""A synchronized forward's per-channel maths after its collective, as one Triton kernel.

On a GPU an eager training call is bound by the host: the first GPU run (H100, 2026-11-28,
README "On a GPU") measured ~2.2 ms of host time per forward+backward call of one layer,
whatever the shape, for 43 kernel launches, and ~130 µs of device time per call inside a
CUDA graph, where cuDNN's BatchNorm takes a few kernels. Of a deferred forward's 33 kernels,
19 are tiny per-channel ops between the collective and the output pass: the divisors of
the global count, mean and variances, scale, the saved statistics, the output's offset, the
running statistics and the batch counter. :func:`finalize_forward` does all of them in one
kernel, with the same float64 maths (the same formulas and rounding steps as
:mod:`syncbn._stats` and :func:`syncbn._kernels.generic.output_offset`).

Only deferred, unmasked calls take it (a masked call's backward needs the mean in float64,
and an immediate call's count is a number on the host). It is a candidate, off unless
:func:`syncbn._kernels.use_fused_finalize` turns it on for a device type, until a GPU run
measures it faster (``benchmarks/gpu.py``, variant ``syncbn-finalize``). This module imports
Triton (which torch's CUDA builds install), so syncbn imports it only then; on the CPU the
tests run the kernel through Triton's interpreter (``TRITON_INTERPRET=1``), where it
computes the same function.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from syncbn import _protocol

__all__ = ["applies", "finalize_forward"]

#: channels per program
_BLOCK = 256


def applies(
    shift: torch.Tensor,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    *per_channel: torch.Tensor | None,
) -> bool:
    """Whether :func:`finalize_forward` can take a call: both running statistics or neither
    (of one dtype), every per-channel tensor contiguous."""
    if (running_mean is None) != (running_var is None):
        return False
    if running_mean is not None and running_var is not None:
        if running_mean.dtype != running_var.dtype:
            return False
    tensors = (shift, running_mean, running_var, *per_channel)
    return all(t is None or t.is_contiguous() for t in tensors)


@functools.lru_cache(maxsize=64)
def _epsilon(eps: float, device: torch.device) -> torch.Tensor:
    """``eps`` in float64 on ``device``: Triton would pass a Python float as float32."""
    return _protocol.on_device([eps], torch.float64, device)


def finalize_forward(
    buffer: torch.Tensor,
    shift: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    update: torch.Tensor,
    num_batches_tracked: torch.Tensor | None,
    eps: float,
    dtype: torch.dtype,
    update_buffers: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The saved statistics and the output's offset of a deferred call, from its all-reduced
    buffer; the running statistics and the batch counter moved in place.

    Args:
        buffer: the all-reduced forward buffer (float64, :mod:`syncbn._protocol`).
        shift: ``(C,)`` float64, the local moments' shift.
        update: ``[increment, factor]`` of :func:`syncbn._autograd.reduce_forward` (zeros
            where the checks failed or the global batch is empty), in the running
            statistics' dtype.
        dtype: the statistics dtype of the call.
        update_buffers: false in a checkpointed recomputation, which moves nothing.

    Returns:
        ``saved``, the ``(4, C)`` rows ``[mean, var, scale, scale / -n]``, and the ``(C,)``
        ``offset`` ``bias + (shift - mean) * scale``, both in ``dtype``.
    """
    num_channels = shift.numel()
    saved = torch.empty(4, num_channels, dtype=dtype, device=buffer.device)
    offset = torch.empty(num_channels, dtype=dtype, device=buffer.device)
    running = running_mean is not None and update_buffers
    counted = num_batches_tracked is not None and update_buffers
    unused = buffer  # a pointer the kernel never reads (its flag is off)
    _finalize_forward_kernel[(triton.cdiv(num_channels, _BLOCK),)](
        _protocol.forward_moments(buffer),
        shift,
        unused if weight is None else weight,
        unused if bias is None else bias,
        running_mean if running else unused,
        running_var if running else unused,
        update,
        num_batches_tracked if counted else unused,
        _epsilon(eps, buffer.device),
        saved,
        offset,
        num_channels,
        HAS_WEIGHT=weight is not None,
        HAS_BIAS=bias is not None,
        UPDATE_RUNNING=running,
        WIDE_RUNNING=running and update.dtype == torch.float64,
        COUNT_BATCH=counted,
        BLOCK=_BLOCK,
    )
    return saved, offset


@triton.jit
def _moved(start, end, factor, WIDE: tl.constexpr):  # type: ignore[no-untyped-def]
    """torch's ``lerp``: in float64 for float64 buffers, else in float32 (its opmath)."""
    if WIDE:
        start, end = start.to(tl.float64), end.to(tl.float64)
    else:
        start, end = start.to(tl.float32), end.to(tl.float32)
    step = end - start
    return tl.where(tl.abs(factor) < 0.5, start + factor * step, end - step * (1.0 - factor))


@triton.jit
def _finalize_forward_kernel(  # type: ignore[no-untyped-def]
    moments,
    shift,
    weight,
    bias,
    running_mean,
    running_var,
    update,
    num_batches_tracked,
    epsilon,
    saved,
    offset,
    num_channels,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    UPDATE_RUNNING: tl.constexpr,
    WIDE_RUNNING: tl.constexpr,
    COUNT_BATCH: tl.constexpr,
    BLOCK: tl.constexpr,
):
    channel = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = channel < num_channels
    # the global count, and the divisors of syncbn._autograd.count_divisors
    n = tl.load(moments)
    n_divisor = tl.maximum(n, 1.0)
    unbiased_divisor = tl.maximum(n - 1.0, 1.0)
    gradient_divisor = tl.minimum(-n, -1.0)
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
    shifted_offset = (tl.load(shift + channel, mask=inside, other=0.0) - mean) * scale
    if HAS_BIAS:
        shifted_offset += tl.load(bias + channel, mask=inside, other=0.0).to(tl.float64)
    stat_type = saved.dtype.element_ty
    tl.store(saved + channel, mean.to(stat_type), mask=inside)
    tl.store(saved + num_channels + channel, var.to(stat_type), mask=inside)
    tl.store(saved + 2 * num_channels + channel, scale.to(stat_type), mask=inside)
    row = (scale / gradient_divisor).to(stat_type)
    tl.store(saved + 3 * num_channels + channel, row, mask=inside)
    tl.store(offset + channel, shifted_offset.to(stat_type), mask=inside)
    if UPDATE_RUNNING:
        # syncbn._stats.update_running_stats: the targets in the statistics dtype, then in
        # the buffers' dtype, moved by the factor in the buffers' dtype
        running_type = running_mean.dtype.element_ty
        if WIDE_RUNNING:
            factor = tl.load(update + 1).to(tl.float64)
        else:
            factor = tl.load(update + 1).to(tl.float32)
        start = tl.load(running_mean + channel, mask=inside, other=0.0)
        end = mean.to(stat_type).to(running_type)
        moved = _moved(start, end, factor, WIDE_RUNNING)
        tl.store(running_mean + channel, moved.to(running_type), mask=inside)
        start = tl.load(running_var + channel, mask=inside, other=0.0)
        end = unbiased_var.to(stat_type).to(running_type)
        moved = _moved(start, end, factor, WIDE_RUNNING)
        tl.store(running_var + channel, moved.to(running_type), mask=inside)
    if COUNT_BATCH:
        if tl.program_id(0) == 0:
            increment = tl.load(update).to(tl.int64)
            tl.store(num_batches_tracked, tl.load(num_batches_tracked) + increment)
