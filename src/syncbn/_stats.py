"""Per-channel statistics maths: global moments from summed buffers, running statistics.

Nothing here knows about processes, buffers' layout or devices' kernels: it works on
``(C,)`` vectors and on the global count, which is either a host number (checked at once)
or a 0-dim tensor on the device (checks deferred, no host read).

Why the merge is exact enough
-----------------------------
Each rank contributes ``(n, n * mean, n * (var + mean**2))`` per channel in float64,
where ``mean`` and ``var`` are the rank's own moments (taken on shifted data, see
:mod:`syncbn._kernels.generic`). Summed over ranks these are the global count ``N``,
``N * mean_g`` and ``N * E_g[x**2]``. The global variance ``E_g[x**2] - mean_g**2`` has
in float64 a relative error of about ``1e-16 * (mean / std)**2``, i.e. 1e-8 for
``|mean| / std = 1e4``.
"""

from __future__ import annotations

import torch

from syncbn._protocol import recording

__all__ = [
    "global_moments",
    "moments_from_divisors",
    "scale",
    "stat_dtype",
    "unbiased",
    "unshifted_sums",
    "update_running_stats",
]

#: whether ``torch.addcmul`` on the CPU writes an ``out=`` of another dtype than its result's:
#: torch 2.1's CPU kernel fails an internal assert instead (``needs_dynamic_casting``),
#: which a model in bfloat16 throughout (float32 statistics, bfloat16 buffers) met in the
#: running statistics' update of a deferred call (a compatibility run, 2026-12-07)
_ADDCMUL_CASTS_OUT = torch.torch_version.TorchVersion(torch.__version__) >= "2.2"


def stat_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype in which the statistics of an input of ``dtype`` are accumulated.

    float64 stays float64; every other floating dtype accumulates in float32.
    """
    return torch.float64 if dtype == torch.float64 else torch.float32


def unshifted_sums(
    shifted_sum: torch.Tensor,
    shifted_square_sum: torch.Tensor,
    shift: torch.Tensor,
    count: int | torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``sum(x)`` and ``sum(x**2)`` in float64 from sums of shifted data ``x - shift``.

    The shift is added back exactly in float64: ``sum(x) = sum(x - k) + n k`` and
    ``sum(x**2) = sum((x - k)**2) + k (sum(x - k) + sum(x))``.

    Args:
        shifted_sum, shifted_square_sum: ``(C,)`` sums of ``x - shift`` and its square, in
            float64 or a narrower dtype (type promotion computes in float64 then).
        shift: ``(C,)`` float64, the per-channel shift ``k``.
        count: the number of values summed per channel ``n``, a number or a 0-dim tensor.
    """
    if isinstance(count, torch.Tensor):
        total = torch.addcmul(shifted_sum, shift, count.to(torch.float64))
    else:
        total = torch.add(shifted_sum, shift, alpha=count)
    square_total = torch.addcmul(shifted_square_sum, shift, shifted_sum + total)
    return total, square_total


def global_moments(
    sums: torch.Tensor, count: int | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Global mean and biased variance, in float64.

    Args:
        sums: ``(2, C)`` float64: the global ``sum(x)`` and ``sum(x**2)``.
        count: the global count per channel; an empty global batch gives zeros, not NaN.
    """
    divisor = count.clamp(min=1) if isinstance(count, torch.Tensor) else max(count, 1)
    mean, square_mean = (sums / divisor).unbind()
    # not in place: torch.compile differentiates this (syncbn._composite)
    var = torch.addcmul(square_mean, mean, mean, value=-1).clamp(min=0)
    return mean, var


def scale(var: torch.Tensor, eps: float, weight: torch.Tensor | None) -> torch.Tensor:
    """``weight / sqrt(var + eps)`` (``1 / sqrt(var + eps)`` without a weight)."""
    inverse_std = (var + eps).rsqrt_()
    return inverse_std if weight is None else inverse_std * weight


def moments_from_divisors(
    sums: tuple[torch.Tensor, torch.Tensor],
    divisors: torch.Tensor | tuple[float, float, float],
    unbiased: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Global mean, biased and unbiased variances, in float64: the forms of
    :func:`global_moments` that an eager training call uses (four kernels for a count on
    the device).

    Args:
        sums: ``(C,)`` float64 each: the global ``sum(x)`` and ``sum(x**2)``.
        divisors: ``n`` and ``n - 1`` (at least 1 each) for the global count ``n`` per
            channel, then the divisor of the input gradient's corrections (``-n``, unused
            here): a ``(3, 1)`` float64 tensor, or numbers for a count known on the host.
        unbiased: whether the unbiased variance is wanted (a running variance to update);
            ``None`` in its place otherwise.
    """
    total, square_total = sums
    mean = total / divisors[0]
    # n times the biased variance: sum(x**2) - n * mean**2, at least 0
    deviations = torch.addcmul(square_total, total, mean, value=-1).clamp_(min=0)
    if not unbiased:
        return mean, deviations / divisors[0], None
    if isinstance(divisors, torch.Tensor):
        var, unbiased_var = (deviations / divisors[:2]).unbind()
        return mean, var, unbiased_var
    return mean, deviations / divisors[0], deviations / divisors[1]


def update_running_stats(
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    targets: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    factor: float | torch.Tensor,
    keep: torch.Tensor | None = None,
    in_graph: bool = False,
) -> None:
    """Move the running statistics towards the global mean and unbiased variance, in place.

    As torch's batch norm moves them: ``target * factor + running * (1 - factor)``,
    computed in the targets' dtype and rounded once into the buffer. ``lerp``, used before,
    made an infinite statistic NaN (``running + factor * (target - running)``, or for a
    factor of 0.5 or more ``target - (1 - factor) * (target - running)``): an infinite
    running mean moved towards a finite one, or a finite one towards an infinite one with a
    factor of 0.5 or more (a cumulative average's first batch has factor 1); torch's stays
    infinite.

    Args:
        targets: the mean and the unbiased variance, in the statistics dtype (or the
            buffers'): the last two rows of an ``(R, C)`` tensor (one kernel multiplies
            every row by the factor; the rows before them are left unread, which costs less
            than one more op to slice them off), or two ``(C,)`` vectors.
        factor: the momentum of this update, a number or a 0-dim tensor; 0 where nothing
            may move (a global batch of fewer than 2 values per channel, a call whose
            deferred checks failed), which the caller has decided.
        keep: ``1 - factor`` for a factor on the device, if the caller has it already
            (:func:`syncbn._autograd.reduce_forward` makes it in the kernel of the factor);
            else one kernel here.
        in_graph: code that ``torch.compile`` traces: each sum is copied into its buffer
            (inductor fuses the copy) rather than written with ``out=``, which torch 2.4's
            dynamo fails on inside an activation-checkpointed region (``grapharg``). Eager
            calls copy too where torch 2.1 cannot write a device factor's sum into a
            buffer of another dtype (:data:`_ADDCMUL_CASTS_OUT`).
    """
    if not isinstance(factor, torch.Tensor) and factor == 0.0:
        return  # known on the host: nothing moves
    if not in_graph and recording():
        # make_fx records these ops, and its graph runs them with autograd on: a target that
        # depends on the weight (a row stacked with the output's offset) would then need a
        # gradient, which the out= writes below refuse
        targets = (
            targets.detach()
            if isinstance(targets, torch.Tensor)
            else (targets[0].detach(), targets[1].detach())
        )
    runnings = (running_mean, running_var)
    if isinstance(targets, torch.Tensor):
        products = (targets * factor).unbind()[-2:]  # one kernel for every row
        updates = [(running, p) for running, p in zip(runnings, products) if running is not None]
    else:
        updates = [
            (running, t * factor) for running, t in zip(runnings, targets) if running is not None
        ]
    # each sum written (and rounded) into its buffer
    if not isinstance(factor, torch.Tensor):
        for running, product in updates:
            if in_graph:
                running.copy_(torch.add(product, running, alpha=1.0 - factor))
            else:
                torch.add(product, running, alpha=1.0 - factor, out=running)
        return
    if keep is None:
        keep = torch.rsub(factor, 1.0)  # on the device, in one kernel for both buffers
    for running, product in updates:
        if in_graph or (product.dtype != running.dtype and not _ADDCMUL_CASTS_OUT):
            running.copy_(torch.addcmul(product, running, keep))
        else:
            torch.addcmul(product, running, keep, out=running)


def unbiased(var: torch.Tensor, count: int | torch.Tensor) -> torch.Tensor:
    """The unbiased variance of ``count`` values per channel whose biased one is ``var``
    (``var`` itself for fewer than 2 values)."""
    if isinstance(count, torch.Tensor):
        return var * (count / (count - 1).clamp(min=1))
    return var * (count / (count - 1)) if count > 1 else var
