"""Pure statistics maths for synchronized batch normalization.

Nothing in this module knows about processes or ``torch.distributed``: it turns a
local batch into a packed buffer of moments, turns an all-reduced buffer back into
global statistics, and does the same for the backward reductions. The collective
that sums the buffers over ranks lives in :mod:`syncbn.distributed`.

Why this buffer layout
----------------------
Each rank contributes ``(n, n * mean, n * (var + mean**2))`` per channel in
float64, where ``mean`` and ``var`` are the rank's own (biased) moments. Summing
these over ranks gives the global count ``N``, ``N * mean_g`` and
``N * E_g[x**2]`` in one all_reduce of ``2 * C + 5`` numbers, whatever the world
size (``torch.nn.SyncBatchNorm`` all_gathers ``world_size * (2 * C + 1)``).

The global variance is then ``E_g[x**2] - mean_g**2``. In float32 that difference
cancels catastrophically for data whose mean is large compared with its standard
deviation; in float64 the relative error of the variance is about
``1e-16 * (mean / std)**2``, i.e. 1e-8 for ``|mean| / std = 1e4``. The local moments
themselves are computed on data shifted by one sample of each channel, so they do
not suffer from the same cancellation in float32.

Every buffer starts with a three-number header, ``(error, fingerprint,
fingerprint**2)``, and ends with a one-number trailer, ``fingerprint``. ``error`` is
1 on a rank that found its input invalid and joins the collective only so that no
other rank is left waiting. The fingerprint identifies the layer; if all ranks
reached the same layer, the sums equal ``world_size * f`` and ``world_size * f**2``
for each rank's own ``f``, and if any two ranks differ, the sums differ on every
rank (equal mean and mean square imply zero spread). The fingerprint is an integer
of at most ``2**16`` so all sums are exact. The trailer catches ranks whose buffers
differ in length (different channel counts): a backend that reduces only the
shorter length leaves the longer buffer's last slot without the other ranks'
share, so its sum is not ``world_size * f``.
"""

from __future__ import annotations

import functools
import zlib
from typing import NamedTuple

import torch

__all__ = [
    "BatchStatistics",
    "Header",
    "backward_sums",
    "backward_totals",
    "batch_statistics",
    "center",
    "fingerprint",
    "forward_size",
    "input_grad",
    "global_moments",
    "local_sums",
    "normalize_",
    "pack_backward",
    "pack_forward",
    "read_header",
    "shifted_sums",
    "stat_dtype",
]

_HEADER_SIZE = 3  # error, fingerprint, fingerprint**2
_COUNT_SLOT = _HEADER_SIZE  # forward buffers only
_PACK_DTYPE = torch.float64


def forward_size(num_features: int) -> int:
    """Length of a forward buffer: header, count, two sums per channel, trailer."""
    return _HEADER_SIZE + 1 + 2 * num_features + 1


class Header(NamedTuple):
    """Header, trailer and count slots of an all-reduced buffer, read back on the host."""

    errors: int
    fingerprint_sum: float
    fingerprint_square_sum: float
    trailer_sum: float
    global_count: int  # forward buffers only: the global count per channel


def stat_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype in which the statistics of an input of ``dtype`` are accumulated.

    float64 stays float64; every other floating dtype accumulates in float32.
    """
    return torch.float64 if dtype == torch.float64 else torch.float32


@functools.lru_cache(maxsize=4096)
def fingerprint(layer_name: str, num_features: int) -> int:
    """A layer's fingerprint: an integer in ``[1, 2**16]``, the same on every rank."""
    return zlib.crc32(f"{layer_name}|{num_features}".encode()) % (1 << 16) + 1


def _channel_view(vector: torch.Tensor, ndim: int) -> torch.Tensor:
    """View a ``(C,)`` vector so it broadcasts against an ``(N, C, *)`` tensor of ``ndim`` dims."""
    return vector.view([1, -1] + [1] * (ndim - 2))


@functools.lru_cache(maxsize=64)
def _zero_mean_unit_var(
    num_channels: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Constant statistics (mean 0, variance 1) that turn batch-norm kernels into plain sums."""
    zeros = torch.zeros(num_channels, dtype=dtype, device=device)
    return zeros, zeros + 1


def center(input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Shift a non-empty local batch by its first sample in each channel.

    Summing shifted data in float32 does not cancel for inputs whose mean is large
    compared with their spread. The shifted copy is in the statistics dtype and the
    input's memory format; for float32 and float64 inputs it later becomes the
    output (:func:`normalize_`), so forward allocates no more than BatchNorm does.

    Returns:
        ``(centered, shift)``: ``input - shift`` and the shift, a ``(1, C, 1, ...)``
        tensor that broadcasts against the input.
    """
    dtype = stat_dtype(input.dtype)
    ndim = input.dim()
    detached = input.detach()
    # a strided view of input[0, :, 0, ...] in the broadcast shape: one op instead of four
    shift = detached.as_strided(
        (1, input.shape[1]) + (1,) * (ndim - 2),
        (0, input.stride(1)) + (0,) * (ndim - 2),
        input.storage_offset(),
    )
    if input.dtype == dtype:
        return torch.sub(detached, shift), shift
    # low precision: convert, then subtract in place (a mixed-dtype subtraction is ~20x slower)
    shift = shift.to(dtype)
    return detached.to(dtype).sub_(shift), shift


def shifted_sums(
    centered: torch.Tensor, shift: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-channel sum and sum of squares of the unshifted batch, in float64.

    The sums of the shifted data come from one fused pass of
    ``native_batch_norm_backward`` (eval mode, the shifted data as both gradient and
    input, mean 0, variance 1, eps 0); the shift is added back exactly in float64.

    Returns:
        ``(sum, sum_of_squares, shift)``, three float64 tensors of shape ``(C,)``.
    """
    num_channels = centered.shape[1]
    count = centered.numel() // num_channels
    zeros, ones = _zero_mean_unit_var(num_channels, shift.dtype, shift.device)
    _, shifted_square_sum, shifted_sum = torch.ops.aten.native_batch_norm_backward(
        centered, centered, None, zeros, ones, None, None, False, 0.0, [False, True, True]
    )
    shift, shifted_sum, shifted_square_sum = (
        torch.stack([shift.view(num_channels), shifted_sum, shifted_square_sum])
        .to(_PACK_DTYPE)
        .unbind()
    )
    total = torch.add(shifted_sum, shift, alpha=count)  # sum(x) = sum(x - k) + n k
    # sum(x**2) = sum((x - k)**2) + k (2 sum(x - k) + n k) = ... + k (sum(x - k) + sum(x))
    square_total = torch.addcmul(shifted_square_sum, shift, shifted_sum + total)
    return total, square_total, shift


def local_sums(input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel sum and sum of squares of a local batch, in float64; zeros if empty.

    Args:
        input: tensor of shape ``(N, C, *)``.
    """
    if input.numel() == 0:
        zeros = input.new_zeros(input.shape[1], dtype=_PACK_DTYPE)
        return zeros, zeros.clone()
    total, square_total, _ = shifted_sums(*center(input))
    return total, square_total


class BatchStatistics(NamedTuple):
    """What a training forward derives from the global moments, in the statistics dtype."""

    #: ``(3, C)``: mean, biased variance and ``scale = weight / sqrt(var + eps)``: all that
    #: backward needs, in one storage (BatchNorm keeps weight, mean and inverse std).
    saved: torch.Tensor
    #: ``(C,)``: ``bias + (shift - mean) * scale``; the output is ``centered * scale + offset``.
    offset: torch.Tensor


def batch_statistics(
    buffer: torch.Tensor,
    count: int,
    eps: float,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    shift: torch.Tensor,
    dtype: torch.dtype,
) -> BatchStatistics:
    """Everything a training forward needs from an all-reduced forward buffer.

    Computed in float64, then cast to ``dtype``.

    Args:
        buffer: the all-reduced forward buffer.
        count: the global count per channel (at least 2), from :func:`read_header`.
        shift: the float64 ``(C,)`` shift of this rank's centered batch.
    """
    mean, var = global_moments(buffer, count)
    scale = (var + eps).rsqrt_()
    if weight is not None:
        scale = scale * weight
    # bias + (shift - mean) * scale
    offset = (
        (shift - mean).mul_(scale) if bias is None else torch.addcmul(bias, shift - mean, scale)
    )
    return BatchStatistics(torch.stack([mean, var, scale]).to(dtype), offset.to(dtype))


def normalize_(centered: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """Turn the shifted batch into the normalized output, in place (two fused passes).

    ``y = (x - mean) * a + b = centered * a + (b + (shift - mean) * a)`` with
    ``a = weight / sqrt(var + eps)`` (``scale``) and the bracket ``offset``, both ``(C,)``.
    (A single broadcasting ``addcmul`` is several times slower than ``mul_`` + ``add_``
    on contiguous NCHW input on CPU.)
    """
    ndim = centered.dim()
    return centered.mul_(_channel_view(scale, ndim)).add_(_channel_view(offset, ndim))


@functools.lru_cache(maxsize=1024)
def _buffer_ends(
    fingerprint: int, count: int | None, error: bool, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The head and trailer of a buffer (``count`` is ``None`` for backward buffers).

    They depend only on the layer and the local count, which usually repeat from step
    to step, so they are built once per combination; ``torch.cat`` never writes to them.
    """
    f = float(fingerprint)
    head = [float(error), f, f * f] + ([] if count is None else [float(count)])
    ends = torch.tensor(head + [f], dtype=_PACK_DTYPE, device=device)
    return ends[:-1], ends[-1:]


def pack_forward(
    count: int,
    total: torch.Tensor,
    square_total: torch.Tensor,
    fingerprint: int,
    error: bool = False,
) -> torch.Tensor:
    """Pack one rank's forward contribution into a float64 buffer of ``forward_size(C)``.

    Layout: ``[error, f, f**2, n, sum(x) (C), sum(x**2) (C), f]``; the sums per
    channel equal ``n * mean`` and ``n * (var + mean**2)``.
    """
    head, trailer = _buffer_ends(fingerprint, count, error, total.device)
    return torch.cat([head, total, square_total, trailer])


@functools.lru_cache(maxsize=256)
def _header_slots(length: int, device: torch.device) -> torch.Tensor:
    return torch.tensor([0, 1, 2, length - 1, _COUNT_SLOT], device=device)


def read_header(buffer: torch.Tensor) -> Header:
    """Copy an all-reduced buffer's header, trailer and count slot to the host (one read)."""
    values = buffer.index_select(0, _header_slots(buffer.numel(), buffer.device)).tolist()
    return Header(int(values[0]), values[1], values[2], values[3], int(values[4]))


def global_moments(buffer: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Global mean and biased variance (float64, shape ``(C,)``) from a forward buffer.

    Args:
        buffer: the all-reduced forward buffer.
        count: the global count per channel, from :func:`read_header`.
    """
    divisor = max(count, 1)  # an empty global batch gives zeros, not NaN
    num_channels = (buffer.numel() - _COUNT_SLOT - 2) // 2
    sums = buffer.as_strided(  # a (2, C) view of the sums: one op instead of two
        (2, num_channels), (num_channels, 1), buffer.storage_offset() + _COUNT_SLOT + 1
    )
    mean, square_mean = (sums / divisor).unbind()
    var = torch.addcmul(square_mean, mean, mean, value=-1).clamp_(min=0)
    return mean, var


def pack_backward(
    sum_dy: torch.Tensor, sum_dy_xhat: torch.Tensor, fingerprint: int
) -> torch.Tensor:
    """Pack one rank's backward sums: ``[0, f, f**2, sum_dy (C), sum_dy_xhat (C), f]``.

    The sums may be float32; ``torch.cat`` promotes them to the buffer's float64.
    """
    head, trailer = _buffer_ends(fingerprint, None, False, sum_dy.device)
    return torch.cat([head, sum_dy, sum_dy_xhat, trailer])


def backward_totals(buffer: torch.Tensor) -> torch.Tensor:
    """Global ``sum(dy)`` and ``sum(dy * xhat)`` from a backward buffer, as rows of ``(2, C)``."""
    return buffer[_HEADER_SIZE:-1].view(2, -1)


def backward_sums(
    grad_output: torch.Tensor,
    input: torch.Tensor,
    mean: torch.Tensor,
    var: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Local per-channel ``sum(dy)`` and ``sum(dy * xhat)``.

    Here ``xhat = (x - mean) / sqrt(var + eps)``.

    Both come from one fused pass of ``native_batch_norm_backward`` in eval mode,
    which returns exactly these sums as the bias and weight gradients.

    Returns:
        ``(sum_dy, sum_dy_xhat)`` in the statistics dtype, shape ``(C,)``.
    """
    if input.numel() == 0:
        zeros = mean.new_zeros(mean.shape)
        return zeros, zeros.clone()
    _, sum_dy_xhat, sum_dy = torch.ops.aten.native_batch_norm_backward(
        grad_output, input, None, mean, var, None, None, False, eps, [False, True, True]
    )
    return sum_dy, sum_dy_xhat


def input_grad(
    grad_output: torch.Tensor,
    input: torch.Tensor,
    mean: torch.Tensor,
    var: torch.Tensor,
    scale: torch.Tensor,
    eps: float,
    totals: torch.Tensor,
    count: int,
) -> torch.Tensor:
    r"""Input gradient of batch normalization given the *global* reductions.

    .. math::
        dx = \gamma \sigma^{-1} \left(dy - \overline{dy} - \hat{x}\,\overline{dy\,\hat{x}}\right),
        \qquad \hat{x} = (x - \mu)\,\sigma^{-1}, \quad \sigma = \sqrt{var + \epsilon}

    computed in two fused passes: an eval-mode ``batch_norm`` of ``x`` with weight
    :math:`-\gamma\sigma^{-1}\overline{dy\,\hat{x}}` and bias
    :math:`-\gamma\sigma^{-1}\overline{dy}` gives the last two terms, and one
    ``addcmul_`` adds :math:`\gamma\sigma^{-1} dy`. Keeps the input's memory format.

    Args:
        mean, var, scale: the forward's statistics (:attr:`BatchStatistics.saved`);
            ``scale`` is :math:`\gamma\sigma^{-1}`.
        totals: ``(2, C)``: the global ``sum(dy)`` and ``sum(dy * xhat)``.
        count: the global count per channel.
    """
    correction_bias, correction_weight = (
        totals.to(scale.dtype).mul_(scale).mul_(-1.0 / count).unbind()
    )
    correction = torch.batch_norm(
        input, correction_weight, correction_bias, mean, var, False, 0.0, eps, False
    )
    if scale.dtype != grad_output.dtype:
        # low precision: a mixed-dtype addcmul_ is ~25x slower than one in the gradient's dtype
        scale = scale.to(grad_output.dtype)
    return correction.addcmul_(grad_output, _channel_view(scale, input.dim()))
