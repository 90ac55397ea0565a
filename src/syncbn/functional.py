"""Functional synchronized batch normalization, ordered like ``torch.nn.functional.batch_norm``."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from syncbn import distributed
from syncbn._autograd import (
    LayerInfo,
    ProcessGroupReducer,
    is_recomputing,
    report_invalid_input,
    sync_batch_norm_train,
)

__all__ = ["sync_batch_norm"]


def _input_problem(
    input: torch.Tensor,
    num_features: int | None,
    param_device: torch.device | None = None,
    layer_kind: str = "SyncBatchNorm",
) -> Exception | None:
    """The error a bad ``input`` deserves, or ``None`` if it is a valid ``(N, C, *)`` batch."""
    if input.dim() < 2:
        return ValueError(f"expected at least 2D input (got {input.dim()}D input)")
    if num_features is not None and input.shape[1] != num_features:
        return ValueError(
            f"expected input with {num_features} channels (num_features={num_features}), "
            f"got input of shape {tuple(input.shape)} with {input.shape[1]} channels"
        )
    if not input.is_floating_point():
        return TypeError(
            f"{layer_kind} expects a floating point input, got input of dtype {input.dtype}"
        )
    if param_device is not None and input.device != param_device:
        return RuntimeError(
            "Expected input and the layer's parameters and buffers to be on the same device, "
            f"got input on {input.device} and parameters on {param_device}"
        )
    return None


def _first_given(*tensors: torch.Tensor | None) -> torch.Tensor | None:
    """The first per-channel tensor that is not ``None``, if any."""
    return next((tensor for tensor in tensors if tensor is not None), None)


def _validate(
    input: torch.Tensor,
    layer: LayerInfo | None,
    syncing: bool,
    group: dist.ProcessGroup | None,
    param_device: torch.device | None,
) -> None:
    """Raise the input's error; when syncing, first tell the other ranks so none is left waiting."""
    problem = _input_problem(input, None if layer is None else layer.num_features, param_device)
    if problem is None:
        return
    if syncing and layer is not None:
        # the other ranks' buffers live where the parameters do
        report_invalid_input(layer, param_device or input.device, group)
    raise problem


def _sync_batch_norm(
    input: torch.Tensor,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    training: bool,
    momentum: float,
    eps: float,
    process_group: dist.ProcessGroup | None,
    layer: LayerInfo | None,
) -> torch.Tensor:
    """:func:`sync_batch_norm` with the calling layer's identity, for SyncBatchNorm modules."""
    world_size = distributed.get_world_size(process_group) if training else 1
    syncing = world_size > 1
    per_channel = _first_given(weight, bias, running_mean, running_var)
    if layer is None and per_channel is not None:
        layer = LayerInfo("", per_channel.numel())
    _validate(
        input, layer, syncing, process_group, None if per_channel is None else per_channel.device
    )
    if training and is_recomputing():
        running_mean = running_var = None  # already updated by the original forward
    if not syncing:
        return F.batch_norm(input, running_mean, running_var, weight, bias, training, momentum, eps)
    if layer is None:
        layer = LayerInfo("", input.shape[1])

    distributed.check_device_backend(input.device, process_group)
    reducer = ProcessGroupReducer(process_group, world_size)
    return sync_batch_norm_train(
        input, weight, bias, eps, reducer, layer, running_mean, running_var, momentum
    )


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
) -> torch.Tensor:
    r"""Batch normalization whose training statistics cover every rank of a process group.

    The arguments are those of :func:`torch.nn.functional.batch_norm`, plus
    ``process_group``. With ``training=True`` and a process group of more than one
    rank, the mean and variance are those of the *global* batch (the concatenation
    of every rank's local batch, local sizes may differ and may be 0), the input
    gradient flows through the global statistics, and ``running_mean`` /
    ``running_var`` (if given) are updated in place with the global mean and
    unbiased variance. Otherwise this is exactly
    :func:`torch.nn.functional.batch_norm`.

    .. note::
        Synchronization happens only with ``training=True``. Every rank of the group
        must make the same calls, in the same order, with the same channel count.

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

    Shape:
        - Input: :math:`(N, C, *)`
        - Output: :math:`(N, C, *)`, same shape and memory format as the input.

    Examples::

        >>> x = torch.randn(4, 3, 8, 8)
        >>> mean, var = torch.zeros(3), torch.ones(3)
        >>> y = sync_batch_norm(x, mean, var, training=True)
    """
    return _sync_batch_norm(
        input, running_mean, running_var, weight, bias, training, momentum, eps, process_group, None
    )
