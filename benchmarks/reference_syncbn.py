"""A straightforward synchronized BatchNorm, the baseline that syncbn must beat.

This is the approach of detectron2's ``NaiveSyncBatchNorm`` and fairscale's
``SyncBatchNorm`` (written here from scratch): the per-channel sum and sum of squares
are all-reduced through an autograd-aware collective, and autograd differentiates
through plain tensor ops. The collective's backward all-reduces the gradient of those
sums, so there is one collective per direction, like syncbn, but every elementwise
step is a separate pass over memory and autograd keeps its intermediates.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = ["ReferenceSyncBatchNorm"]


class _AllReduceSum(torch.autograd.Function):
    """Sum a tensor over a process group; the gradient is summed over the group too."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, tensor: torch.Tensor, group: dist.ProcessGroup | None
    ) -> torch.Tensor:
        ctx.group = group
        reduced = tensor.clone()
        dist.all_reduce(reduced, group=group)
        return reduced

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        reduced = grad.contiguous().clone()
        dist.all_reduce(reduced, group=ctx.group)
        return reduced, None


class ReferenceSyncBatchNorm(_BatchNorm):
    r"""Synchronized BatchNorm by autograd through an all_reduce of sum and sum of squares.

    In training, ``mean = S1 / n`` and ``var = S2 / n - mean**2`` with the global count
    ``n``, sum ``S1`` and sum of squares ``S2`` (one all_reduce of ``2 * C + 1`` values),
    then ``y = x * scale + shift``. Eval mode is plain ``F.batch_norm``. Statistics and
    normalization run in float32 (float64 for float64 input); half and bfloat16 inputs
    are cast back at the end.

    Args:
        num_features: number of channels :math:`C`.
        eps: added to the variance. Default: 1e-5
        momentum: running statistics factor. Default: 0.1
        process_group: ranks to synchronize over; the default group if ``None``.

    Shape:
        - Input: :math:`(N, C, *)`
        - Output: same shape (and memory format) as the input.

    Examples::

        >>> layer = ReferenceSyncBatchNorm(64)  # after init_process_group on every rank
        >>> y = layer(torch.randn(2, 64, 8, 8))
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float = 0.1,
        process_group: dist.ProcessGroup | None = None,
        device: Any = None,
    ) -> None:
        super().__init__(num_features, eps, momentum, device=device)
        self.process_group = process_group

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return F.batch_norm(
                input, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0,
                self.eps,
            )  # fmt: skip
        channels = input.shape[1]
        dims = [0, *range(2, input.dim())]
        x = input if input.dtype == torch.float64 else input.float()
        local_count = torch.full((1,), input.numel() // channels, dtype=x.dtype, device=x.device)
        sums = torch.cat([x.sum(dims), (x * x).sum(dims), local_count])
        sums = _AllReduceSum.apply(sums, self.process_group)
        count = sums[-1]
        mean = sums[:channels] / count
        var = (sums[channels : 2 * channels] / count - mean * mean).clamp(min=0)
        scale = self.weight * torch.rsqrt(var + self.eps)
        shift = self.bias - mean * scale
        view = [1, channels] + [1] * (input.dim() - 2)
        output = x * scale.view(view) + shift.view(view)
        if self.running_mean is not None and self.running_var is not None:
            with torch.no_grad():
                unbiased = var * (count / (count - 1))
                momentum = self.momentum or 0.0
                self.running_mean.lerp_(mean.to(self.running_mean.dtype), momentum)
                self.running_var.lerp_(unbiased.to(self.running_var.dtype), momentum)
        if self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
        return output.to(input.dtype)
