"""Convert models to SyncBatchNorm and back, sharing parameters and buffers."""

from __future__ import annotations

import warnings
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.parameter import is_lazy

from syncbn.batchnorm import SyncBatchNorm

__all__ = [
    "BatchNormNd",
    "batchnorm_twin",
    "convert_sync_batchnorm",
    "revert_sync_batchnorm",
]

_BatchNormT = TypeVar("_BatchNormT", bound=_BatchNorm)

# forward implementations that a converted layer reproduces exactly
_PLAIN_FORWARDS = (_BatchNorm.forward, nn.SyncBatchNorm.forward, SyncBatchNorm.forward)


class BatchNormNd(_BatchNorm):
    r"""Plain batch normalization that accepts any :math:`(N, C, *)` input with at least 2 dims.

    :func:`revert_sync_batchnorm` returns this class for a SyncBatchNorm layer that never
    saw an input, because then the right choice among ``BatchNorm1d``/``2d``/``3d`` is
    unknown. Its parameters, buffers and ``state_dict`` keys are those of
    :class:`torch.nn.BatchNorm2d`, and its forward is identical to theirs.

    Args:
        num_features: number of channels :math:`C`.
        eps: value added to the variance for numerical stability. Default: 1e-5
        momentum: running statistics factor, or ``None`` for a cumulative average.
            Default: 0.1
        affine: learnable per-channel scale and shift. Default: ``True``
        track_running_stats: keep running statistics. Default: ``True``

    Shape:
        - Input: :math:`(N, C, *)`
        - Output: same shape as the input.

    Examples::

        >>> bn = BatchNormNd(3)
        >>> bn(torch.randn(4, 3)).shape, bn(torch.randn(4, 3, 8, 8)).shape
        (torch.Size([4, 3]), torch.Size([4, 3, 8, 8]))
    """

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")


def _share_state(source: nn.Module, target: nn.Module) -> nn.Module:
    """Make ``target`` use ``source``'s very Parameters and buffers, and its training mode."""
    for name, param in source.named_parameters(recurse=False):
        setattr(target, name, param)
    for name, buffer in source.named_buffers(recurse=False):
        setattr(target, name, buffer)
    target.train(source.training)
    if hasattr(source, "qconfig"):
        target.qconfig = source.qconfig
    return target


def batchnorm_twin(source: _BatchNorm, cls: type[_BatchNormT], **kwargs: Any) -> _BatchNormT:
    """A ``cls`` layer with ``source``'s settings that shares its Parameters, buffers and mode.

    Built on the meta device, so nothing is allocated before the state is shared.
    """
    twin = cls(
        source.num_features,
        source.eps,
        source.momentum,
        source.affine,
        source.track_running_stats,
        device="meta",
        **kwargs,
    )
    _share_state(source, twin)
    return twin


def _is_plain_batchnorm(module: nn.Module) -> bool:
    return isinstance(module, _BatchNorm) and type(module).forward in _PLAIN_FORWARDS


def _convert(
    module: nn.Module, process_group: dist.ProcessGroup | None, check_layer_order: bool, path: str
) -> nn.Module:
    result = module
    if isinstance(module, SyncBatchNorm):
        if process_group is not None:
            module.process_group = process_group
        module.layer_name = path
        module.check_layer_order = check_layer_order
    elif isinstance(module, _BatchNorm) and not _is_plain_batchnorm(module):
        warnings.warn(
            f"convert_sync_batchnorm left '{path or type(module).__name__}' "
            f"({type(module).__qualname__}) unconverted: it subclasses BatchNorm but overrides "
            "forward(), and converting it would drop that behaviour. It keeps local (per-rank) "
            "statistics.",
            stacklevel=3,
        )
    elif isinstance(module, _BatchNorm) and any(is_lazy(p) for p in module.parameters()):
        warnings.warn(
            f"convert_sync_batchnorm left lazy layer '{path or type(module).__name__}' "
            "unconverted: run one forward pass first so that its parameters are materialised",
            stacklevel=3,
        )
    elif isinstance(module, _BatchNorm):
        group = (
            process_group if process_group is not None else getattr(module, "process_group", None)
        )
        result = batchnorm_twin(module, SyncBatchNorm, process_group=group)
        result.layer_name = path
        result.check_layer_order = check_layer_order
    for name, child in module.named_children():
        result.add_module(
            name,
            _convert(child, process_group, check_layer_order, f"{path}.{name}" if path else name),
        )
    return result


def convert_sync_batchnorm(
    module: nn.Module,
    process_group: dist.ProcessGroup | None = None,
    check_layer_order: bool = True,
) -> nn.Module:
    """Replace every BatchNorm layer in ``module`` with :class:`syncbn.SyncBatchNorm`.

    Converts ``BatchNorm1d``/``2d``/``3d``, materialised ``LazyBatchNorm*``,
    ``torch.nn.SyncBatchNorm`` and :class:`BatchNormNd` layers, recursively. A
    converted layer *shares* the original's Parameters and buffers (no copy), and
    keeps its ``requires_grad`` flags, training mode, device, dtype, ``eps``,
    ``momentum``, ``affine`` and ``track_running_stats``. Each SyncBatchNorm layer
    gets its module path as ``layer_name`` (for error messages and the layer-order
    check). Other norms (InstanceNorm, GroupNorm, LayerNorm) are left alone.

    A BatchNorm subclass that overrides ``forward`` (such as timm's
    ``BatchNormAct2d``) is left unconverted, with a warning naming it: converting
    it would silently drop what its ``forward`` adds. Unmaterialised lazy layers are
    left unconverted with a warning too.

    Args:
        module: the model (or a single BatchNorm layer) to convert.
        process_group: group to synchronize over; the default group if ``None``.
            Default: ``None``
        check_layer_order: set each layer's ``check_layer_order``. Default: ``True``

    Returns:
        The converted module: ``module`` itself, modified in place, unless ``module``
        is itself a BatchNorm layer, in which case the new SyncBatchNorm is returned.

    Examples::

        >>> model = torchvision.models.resnet18()
        >>> model = syncbn.convert_sync_batchnorm(model)
    """
    return _convert(module, process_group, check_layer_order, "")


def _batchnorm_class(input_dim: int | None) -> type[_BatchNorm]:
    if input_dim in (2, 3):
        return nn.BatchNorm1d
    if input_dim == 4:
        return nn.BatchNorm2d
    if input_dim == 5:
        return nn.BatchNorm3d
    return BatchNormNd


def revert_sync_batchnorm(module: nn.Module) -> nn.Module:
    """Replace every :class:`syncbn.SyncBatchNorm` in ``module`` with plain BatchNorm.

    The inverse of :func:`convert_sync_batchnorm`: each layer becomes
    ``BatchNorm1d``, ``2d`` or ``3d`` according to the rank of the last input it saw
    (2 or 3 dims, 4, 5), or :class:`BatchNormNd` if it never saw an input. The new
    layer shares the Parameters and buffers, so ``state_dict`` is identical before
    and after; training mode and the other settings are kept.

    Args:
        module: the model (or a single SyncBatchNorm layer) to revert.

    Returns:
        The reverted module: ``module`` itself, modified in place, unless ``module``
        is itself a SyncBatchNorm, in which case the new BatchNorm is returned.

    Examples::

        >>> model = syncbn.revert_sync_batchnorm(model)  # e.g. before export
    """
    result = module
    if isinstance(module, SyncBatchNorm):
        result = batchnorm_twin(module, _batchnorm_class(module.last_input_dim))
    for name, child in module.named_children():
        result.add_module(name, revert_sync_batchnorm(child))
    return result
