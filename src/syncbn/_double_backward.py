"""A synchronized backward that autograd can differentiate again (``create_graph=True``).

Gradient penalties (WGAN-GP, R1), input-gradient regularization and Hessian-vector
products differentiate a backward a second time. The eager backward of
:mod:`syncbn._autograd` computes its gradients once, with fused kernels and no graph. Run
with ``create_graph=True``, an unmasked call computes them here instead, as differentiable
torch ops of the input, the weight and the output gradient, so that their derivatives are
those of BatchNorm on the global batch.

Two autograd Functions carry what crosses ranks:

- :class:`GlobalSum` is the backward's one collective: the global per-channel
  ``[sum(dy), sum(dy * xhat)]``. Every rank's input gradient depends on every rank's local
  sums, so the backward of this sum is the same sum of the gradients that reach it (and
  is differentiable again).
- :class:`SumOfGradients` is the identity in value. Added to the statistics that forward
  computed, it makes them depend on this rank's input as the global batch's mean and
  variance do: their first derivatives are exact at the statistics' value, and the
  gradients that reach them are summed over the ranks.

The backward thus runs one collective, as without ``create_graph``, and differentiating
its result again runs two more per layer call (each ``2 * C + 5`` float64 values), whose
fingerprint names the phase: ranks that differentiate different things raise instead of
summing mismatched gradients. Nothing here changes a backward without ``create_graph``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from syncbn._kernels.generic import channel_view

__all__ = [
    "GRADIENT_SUMS_PHASE",
    "STATISTICS_PHASE",
    "GlobalSum",
    "Summation",
    "SumOfGradients",
    "differentiable_backward",
]

#: ``(local (2, C), phase) -> global (2, C)``: one checked collective of a layer call
#: (:func:`syncbn._autograd.sum_over_participants`, bound to the call's options)
Summation = Callable[[torch.Tensor, str], torch.Tensor]

#: the phases of a second backward's collectives, in messages and fingerprints
GRADIENT_SUMS_PHASE = "double backward"
STATISTICS_PHASE = "double backward (statistics)"


class GlobalSum(torch.autograd.Function):
    """The sum of a ``(2, C)`` tensor over the participants; differentiable any number of
    times (its backward is itself, applied to the gradients)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, local: torch.Tensor, summation: Summation, phase: str
    ) -> torch.Tensor:
        ctx.summation = summation
        return summation(local, phase)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:  # type: ignore[override]
        return GlobalSum.apply(grad, ctx.summation, GRADIENT_SUMS_PHASE), None, None


class SumOfGradients(torch.autograd.Function):
    """The identity on a ``(2, C)`` tensor, whose gradients are summed over the
    participants."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, summation: Summation) -> torch.Tensor:  # type: ignore[override]
        ctx.summation = summation
        return local.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None]:  # type: ignore[override]
        return GlobalSum.apply(grad, ctx.summation, STATISTICS_PHASE), None


def differentiable_backward(
    grad_output: torch.Tensor,
    input: torch.Tensor,
    weight: torch.Tensor | None,
    mean: torch.Tensor,
    var: torch.Tensor,
    count: int | torch.Tensor,
    eps: float,
    needs_grad: tuple[bool, bool, bool],
    summation: Summation,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The gradients of an unmasked synchronized training call as differentiable ops.

    The same values as :func:`syncbn._autograd.backward_train` (to rounding), and the
    same collective: one, where the input needs a gradient.

    Args:
        grad_output: the output gradient (it may require grad itself).
        input: the call's input, as the forward saved it (with its autograd history).
        weight: the call's weight, or ``None``.
        mean: ``(C,)`` the global mean that forward normalized with, statistics dtype.
        var: ``(C,)`` the global biased variance, statistics dtype.
        count: the global count per channel (a number, or a 0-dim tensor).
        eps: the layer's ``eps``.
        needs_grad: whether input, weight and bias need a gradient.
        summation: the layer call's collective (see :data:`Summation`).

    Returns:
        The gradients of input (in its dtype), weight and bias (in the statistics dtype;
        ``None`` where not needed).
    """
    need_input, need_weight, need_bias = needs_grad
    dtype, ndim = mean.dtype, input.dim()
    dims = [0, *range(2, ndim)]
    n = max(count, 1) if isinstance(count, int) else count.clamp(min=1)
    x = input.to(dtype)
    dy = grad_output.to(dtype)
    if need_input:
        # the statistics as functions of this rank's input, their values unchanged: the
        # moments of x about the (constant) mean, whose changes are zero in value, and
        # var = E[(x - c)²] - (E[x] - c)² as an identity, so that every derivative (the
        # variance's second one through the mean too) is the global batch's
        deviation = x - channel_view(mean, ndim)
        local = torch.stack([deviation.sum(dims), deviation.square().sum(dims)])
        change = SumOfGradients.apply(local - local.detach(), summation) / n
        mean = mean + change[0]
        var = var + change[1] - change[0].square()
    invstd = (var + eps).rsqrt()
    xhat = (x - channel_view(mean, ndim)) * channel_view(invstd, ndim)
    sum_dy, sum_dy_xhat = dy.sum(dims), (dy * xhat).sum(dims)
    grad_input = None
    if need_input:
        totals = GlobalSum.apply(torch.stack([sum_dy, sum_dy_xhat]), summation, "backward") / n
        scale = invstd if weight is None else weight.to(dtype) * invstd
        corrected = dy - channel_view(totals[0], ndim) - xhat * channel_view(totals[1], ndim)
        grad_input = (channel_view(scale, ndim) * corrected).to(input.dtype)
    return grad_input, sum_dy_xhat if need_weight else None, sum_dy if need_bias else None
