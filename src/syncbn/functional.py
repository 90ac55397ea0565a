"""Functional synchronized batch normalization, ordered like ``torch.nn.functional.batch_norm``."""

from __future__ import annotations

import numbers

import torch
import torch.distributed as dist

from syncbn import _compiled, _composite, distributed
from syncbn._autograd import (
    LayerInfo,
    TrainOptions,
    first_given,
    input_problem,
    is_recomputing,
    reducer_for,
    sync_batch_norm_train,
)

__all__ = ["sync_batch_norm"]


def sync_batch_norm(
    input: torch.Tensor,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    training: bool = False,
    momentum: float = 0.1,
    eps: float = 1e-5,
    process_group: dist.ProcessGroup | None = None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    r"""Batch normalization whose training statistics cover every rank of a process group.

    The arguments are those of :func:`torch.nn.functional.batch_norm`, plus
    ``process_group``. With ``training=True`` and a process group of more than one
    rank, the mean and variance are those of the *global* batch (the concatenation
    of every rank's local batch, local sizes may differ and may be 0), the input
    gradient flows through the global statistics, and ``running_mean`` /
    ``running_var`` (if given) are updated in place with the global mean and
    unbiased variance. Otherwise, without a mask, this is
    :func:`torch.nn.functional.batch_norm` (except that a forward recomputed by
    activation checkpointing updates no running statistics).

    With a ``mask`` (True at valid positions), the statistics are those of the valid
    positions of all ranks, the running variance uses their global count, and padded
    positions of the output, and their input gradients, are zero; nothing at a padded
    position influences any output, gradient or statistic. Without a process group this
    is an exact masked batch normalization. In eval mode (``training=False``) the running
    statistics normalize the valid positions and padded outputs are zero.

    .. note::
        Synchronization happens only with ``training=True``. Every rank of the group
        must make the same calls, in the same order, with the same channel count. An
        invalid input joins the collective with the error flag, so that every rank
        raises; but with neither weight, bias nor running statistics, an input of fewer
        than 2 dims tells no channel count, and raises on its rank alone (the others
        then fail at the process group's timeout).

    Args:
        input: tensor of shape :math:`(N, C, *)`.
        running_mean: running mean of shape :math:`(C,)`, or ``None``.
        running_var: running variance of shape :math:`(C,)`, or ``None``.
        weight: scale :math:`\gamma` of shape :math:`(C,)`, or ``None``. Default: ``None``
        bias: shift :math:`\beta` of shape :math:`(C,)`, or ``None``. Default: ``None``
        training: use (and synchronize) batch statistics. Default: ``False``
        momentum: factor of the running statistics update. Default: 0.1
        eps: added to the variance for numerical stability. Default: 1e-5
        process_group: group to synchronize over; the default group if ``None``.
            Default: ``None``
        mask: bool tensor, True at valid positions, of the input's shape without the
            channel dimension (or broadcastable to it), or ``None``. Default: ``None``

    Shape:
        - Input: :math:`(N, C, *)`
        - Mask: :math:`(N, *)`, or broadcastable to it
        - Output: :math:`(N, C, *)`, same shape and memory format as the input.

    Examples::

        >>> x = torch.randn(4, 3, 8, 8)
        >>> mean, var = torch.zeros(3), torch.ones(3)
        >>> y = sync_batch_norm(x, mean, var, training=True)
    """
    if (running_mean is None) != (running_var is None):
        # torch's checks, which the synchronized and masked paths would not reach
        if not training:
            missing = "running_mean" if running_mean is None else "running_var"
            raise RuntimeError(f"{missing} must be defined in evaluation mode")
        raise ValueError("running_mean and running_var must either both be None or neither be None")
    if not isinstance(momentum, float):
        momentum = _float_argument("momentum", momentum)
    if not isinstance(eps, float):
        eps = _float_argument("eps", eps)
    world_size = distributed.get_world_size(process_group) if training else 1
    per_channel = first_given(weight, bias, running_mean, running_var)
    channels = None if per_channel is None else per_channel.numel()
    if world_size <= 1 and isinstance(input, torch.Tensor) and input.dim() > 1:
        # no collective: the input tells the channel count, so that a per-channel tensor of
        # another size is named as such (torch: "weight should contain 3 elements not 4");
        # ranks that synchronize take it from the tensors, which every rank's call agrees on
        channels = input.shape[1]
    if world_size <= 1 and (mask is None or not training):
        problem = input_problem(
            input,
            channels,
            None if per_channel is None else per_channel.device,
            parameters=(weight, bias, running_mean, running_var),
        )
        if problem is None and mask is not None:
            problem = _composite.mask_problem(mask, input)
        if problem is not None:
            raise problem
        # (compiled: not asked, dynamo cannot trace it; a compiled recomputation replays no
        # buffer mutation)
        if training and not _compiled.is_compiling() and is_recomputing():
            # already updated by the original forward: a factor of 0 keeps them, and the
            # call saves what the original saved (non-reentrant checkpointing checks that)
            momentum = 0.0
        return _composite.batch_norm_valid(
            input, mask, running_mean, running_var, weight, bias, training, momentum, eps
        )
    if per_channel is None and input.dim() < 2:
        # nothing tells the channel count, so the other ranks cannot be told either
        raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")
    num_features = input.shape[1] if channels is None else channels
    compiling = _compiled.is_compiling()
    if compiling and _compiled.FULLGRAPH:
        return _compiled.sync_batch_norm_train(
            input,
            weight,
            bias,
            mask,
            running_mean,
            running_var,
            None,
            num_features=num_features,
            eps=eps,
            momentum=momentum,
            site=None,
            group_name=distributed.compiled_group_name(process_group),
            ordered=world_size > 1,
        )
    train = _train_outside_graph if compiling else _train  # compiling: torch < 2.4
    return train(
        input,
        weight,
        bias,
        running_mean,
        running_var,
        mask,
        process_group,
        num_features,
        eps,
        momentum,
    )


def _float_argument(name: str, value: object) -> float:
    """``value`` as a ``float``, where torch's argument parser takes it for one: an integer,
    a NumPy scalar, a 0-dim real tensor. A ``momentum`` of ``None`` (a cumulative average)
    is refused, as by ``F.batch_norm``: it needs ``num_batches_tracked``, the module's."""
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.is_complex():
        return float(value)
    raise TypeError(
        f"sync_batch_norm(): argument '{name}' must be float, not {type(value).__name__}"
    )


def _train(
    input: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    mask: torch.Tensor | None,
    process_group: dist.ProcessGroup | None,
    num_features: int,
    eps: float,
    momentum: float | None,
) -> torch.Tensor:
    """A synchronized (or masked) functional training call in eager mode."""
    options = TrainOptions(reducer_for(process_group), LayerInfo("", num_features), eps, momentum)
    return sync_batch_norm_train(
        input,
        weight,
        bias,
        options,
        running_mean=running_mean,
        running_var=running_var,
        mask=mask,
    )


#: the eager call that compiled code makes across a graph break on torch < 2.4
_train_outside_graph = _compiled.outside_graph(_train)
