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
from syncbn._kernels.generic import LocalMoments, backward_reduce, local_moments, zero_padded

__all__ = ["backward_reduce", "input_grad", "local_moments", "normalize", "zero_padded"]


def _dense_format(tensor: torch.Tensor) -> torch.memory_format | None:
    """The memory format ``tensor`` is contiguous in, or ``None`` (the fused kernels take
    contiguous and channels-last tensors; other strides take the generic path)."""
    if tensor.is_contiguous():
        return torch.contiguous_format
    for format, ndim in ((torch.channels_last, 4), (torch.channels_last_3d, 5)):
        if tensor.dim() == ndim and tensor.is_contiguous(memory_format=format):
            return format
    return None


def normalize(
    input: torch.Tensor,
    moments: LocalMoments,
    saved: torch.Tensor,
    mean: torch.Tensor,
    scale: torch.Tensor,
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
    if not fused or centered is None or _dense_format(centered) is None:
        return generic.normalize(input, moments, saved, mean, scale, weight, bias, eps, valid)
    offset = generic.output_offset(moments.shift, mean, scale, bias)
    zeros, _, _ = generic.constants(scale.numel(), dtype, scale.device)
    # saved[2]: the scale in the statistics dtype, converted once already
    return torch.batch_norm_elemt(centered, None, offset.to(dtype), zeros, saved[2], 0.0)


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
    memory_format = _dense_format(input)
    if grad_output.dtype != saved.dtype or input.numel() == 0 or memory_format is None:
        return generic.input_grad(grad_output, input, saved, eps, totals, count, valid)
    mean, var, scale = saved.unbind()
    inverse_std = (var + eps).rsqrt()
    sum_dy, sum_dy_xhat = totals.to(saved.dtype).unbind()
    if isinstance(count, torch.Tensor):
        counts = count.to(torch.int32).view(1)
    else:
        counts = torch.full((1,), count, dtype=torch.int32, device=input.device)  # no host copy
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
        counts,
    )
    return grad_input if valid is None else zero_padded(grad_input, valid, inplace=True)
