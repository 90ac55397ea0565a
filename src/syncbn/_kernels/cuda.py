"""Statistics kernels for CUDA tensors: torch's fused SyncBatchNorm element kernels.

The local moments and the backward reductions are those of :mod:`syncbn._kernels.generic`
(the shifted sums that keep float32 data with a large mean exact, and the reductions of
``native_batch_norm_backward``). What changes is the two element-wise passes, which on a
GPU cost memory traffic:

- :func:`normalize` writes the output in one pass of ``torch.batch_norm_elemt``
  (``(centered - 0) * scale + offset``), where the generic kernels transform the shifted
  copy in place in two (a multiply, then an add: each reads and writes the whole tensor);
- :func:`input_grad` is one pass of ``torch.batch_norm_backward_elemt``, where the generic
  kernels need an eval-mode ``batch_norm`` and an ``addcmul_``.

Both passes compute in the statistics dtype, as the generic ones do. Low-precision calls,
empty batches and tensors with other strides than contiguous or channels last take the
generic path; so does a masked call's output (it zeroes padded positions), while its input
gradient is the fused pass (over the output gradient zeroed at padded positions and the
forward's zeroed shifted copy; the gradient is zeroed there after). These ops exist only
for CUDA tensors; the four-function interface is that of :mod:`syncbn._kernels`.

Not used until measured: :func:`syncbn._kernels.use_device_kernels` selects it (issue 19:
keep it where a GPU run finds it faster than the generic kernels).
"""

from __future__ import annotations

import torch

from syncbn._kernels import generic
from syncbn._kernels.generic import (
    LocalMoments,
    backward_reduce,
    dense_format,
    local_moments,
    zero_padded,
)
from syncbn._protocol import constant_cache, on_device

__all__ = ["backward_reduce", "input_grad", "local_moments", "normalize", "zero_padded"]

_INT32_MAX = 2**31 - 1
#: how many int32 entries a count of more than :data:`_INT32_MAX` is split into
_COUNT_PARTS = 16


@constant_cache(maxsize=64)
def _part_offsets(device: torch.device) -> torch.Tensor:
    """``[0, 1, ..., _COUNT_PARTS - 1]`` in float64 on ``device``."""
    return on_device(list(range(_COUNT_PARTS)), torch.float64, device)


def _kernel_count(count: int | torch.Tensor, device: torch.device) -> torch.Tensor:
    """The global count per channel as the int32 tensor ``batch_norm_backward_elemt`` takes.

    The kernel sums the tensor's entries (in int64; torch.nn.SyncBatchNorm passes one per
    rank), so a count that int32 cannot hold is given in parts: ``floor((n + i) / k)`` for
    ``i < k`` sum to ``n``, each at most ``ceil(n / k)``. A device tensor count (never read
    by the host) is always split, up to ``k * (2**31 - 1)`` (3.4e10) values per channel; a
    number only when it has to be.
    """
    if not isinstance(count, torch.Tensor):
        if count <= _INT32_MAX:
            return torch.full((1,), count, dtype=torch.int32, device=device)  # no host copy
        count = torch.full((), count, dtype=torch.float64, device=device)
    parts = (count + _part_offsets(device)).div_(_COUNT_PARTS, rounding_mode="floor")
    return parts.to(torch.int32)


def normalize(
    input: torch.Tensor,
    moments: LocalMoments,
    saved: torch.Tensor,
    offset: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """The normalized output, as :func:`syncbn._kernels.generic.normalize` computes it,
    in one fused pass over the shifted copy (float32 and float64 input, no mask)."""
    centered = moments.centered
    dtype = saved.dtype
    fused = valid is None and dtype == input.dtype
    if not fused or centered is None or offset is None or dense_format(centered) is None:
        return generic.normalize(input, moments, saved, offset, weight, bias, eps, valid)
    _, _, scale, _ = saved.unbind()
    zeros, _, _ = generic.constants(scale.numel(), dtype, scale.device)
    # written into the shifted copy in place, as the generic passes do (each element is
    # read, then written)
    return torch.batch_norm_elemt(centered, None, offset, zeros, scale, 0.0, out=centered)


def input_grad(
    grad_output: torch.Tensor,
    input: torch.Tensor,
    saved: torch.Tensor,
    eps: float,
    totals: torch.Tensor,
    count: int | torch.Tensor,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """The input gradient, as :func:`syncbn._kernels.generic.input_grad` computes it, in
    one fused pass of ``torch.batch_norm_backward_elemt`` (float32 and float64 input;
    a masked call's result is zeroed at padded positions after it).

    The kernel takes ``sum(dy * (x - mean))`` rather than ``sum(dy * xhat)``, the weight
    rather than the scale, and the global count as an int32 tensor (on the device, so a
    deferred count is never read by the host).
    """
    memory_format = dense_format(input)
    if grad_output.dtype != saved.dtype or input.numel() == 0 or memory_format is None:
        return generic.input_grad(grad_output, input, saved, eps, totals, count, valid)
    mean, var, scale, _ = saved.unbind()
    inverse_std = (var + eps).rsqrt()
    sum_dy, sum_dy_xhat = totals.to(saved.dtype).unbind()
    # the kernel wants both gradients in the input's memory format
    grad_output = grad_output.contiguous(memory_format=memory_format)
    grad_input = torch.batch_norm_backward_elemt(
        grad_output,
        input,
        mean,
        inverse_std,
        scale / inverse_std,  # the weight (scale = weight / sqrt(var + eps))
        sum_dy,
        sum_dy_xhat / inverse_std,
        _kernel_count(count, input.device),
    )
    return grad_input if valid is None else zero_padded(grad_input, valid, inplace=True)
