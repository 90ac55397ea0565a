"""Convert models to SyncBatchNorm and back, sharing parameters and buffers."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from syncbn._conversion import (
    batchnorm_twin,
    carry_parametrizations,
    computed_parameters,
    convert_modules,
    converter_for,
    describe_module,
    register_converter,
    replace_modules,
)
from syncbn.batchnorm import SyncBatchNorm

__all__ = [
    "BatchNormNd",
    "batchnorm_twin",
    "convert_sync_batchnorm",
    "register_converter",
    "revert_sync_batchnorm",
]


class BatchNormNd(_BatchNorm):
    r"""Plain batch normalization that accepts any :math:`(N, C, *)` input with at least 2 dims.

    :func:`revert_sync_batchnorm` returns this class for a SyncBatchNorm layer built
    directly (not converted) that never saw an input, because then the right choice
    among ``BatchNorm1d``/``2d``/``3d`` is unknown. Its parameters, buffers and
    ``state_dict`` keys are those of :class:`torch.nn.BatchNorm2d`, and its forward is
    identical to theirs.

    Args:
        num_features: number of channels :math:`C`.
        eps: value added to the variance for numerical stability. Default: 1e-5
        momentum: running statistics factor, or ``None`` for a cumulative average.
            Default: 0.1
        affine: learnable per-channel scale and shift. Default: ``True``
        track_running_stats: keep running statistics. Default: ``True``
        device: device of the parameters and buffers. Default: ``None``
        dtype: dtype of the parameters and buffers. Default: ``None``
        bias: (torch >= 2.13, keyword only) with ``affine``, learn the shift too.
            Default: ``True``

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


def convert_sync_batchnorm(
    module: nn.Module,
    process_group: dist.ProcessGroup | None = None,
    check_layer_order: bool | None = None,
) -> nn.Module:
    """Replace every BatchNorm layer in ``module`` with :class:`syncbn.SyncBatchNorm`.

    Converts ``BatchNorm1d``/``2d``/``3d``, materialised ``LazyBatchNorm*`` (by a
    forward or ``load_state_dict``), ``torch.nn.SyncBatchNorm`` and :class:`BatchNormNd`
    layers, recursively. A converted layer *shares* the original's Parameters and
    buffers (no copy), and keeps its ``requires_grad`` flags, training mode, device,
    dtype, ``eps``, ``momentum``, ``affine`` and ``track_running_stats``. Each
    SyncBatchNorm layer gets its module path as ``layer_name`` (for error messages and
    the layer-order check). Other norms (InstanceNorm, GroupNorm, LayerNorm) are left
    alone.

    A BatchNorm subclass that overrides ``forward`` is converted by the converter
    registered for it with :func:`register_converter`. syncbn registers timm's
    ``BatchNormAct2d`` (:class:`syncbn.integrations.timm.SyncBatchNormAct2d`) the first
    time a model holds one. A subclass with its own ``forward``, or with extra state
    (``get_extra_state``), and no converter is left unconverted, with one warning naming
    it: converting it would silently drop what its ``forward`` or that state adds.
    Unmaterialised lazy layers, and layers whose weight or bias is computed by hooks
    (the hook-based ``torch.nn.utils.weight_norm``: convert first), are left unconverted
    with a warning too; parametrizations (``torch.nn.utils.parametrize``) are carried
    over, both ways. A layer held in several places (one BatchNorm called twice) becomes
    one SyncBatchNorm in all of them. Each converted layer remembers the class it
    replaced, for :func:`revert_sync_batchnorm`. Hooks registered on a BatchNorm layer
    are not carried over, as with torch's conversion. Converting a converted model again
    keeps its layers, and their settings unless given here.

    Args:
        module: the model (or a single BatchNorm layer) to convert.
        process_group: group to synchronize over; the default group if ``None``.
            Default: ``None``
        check_layer_order: set each layer's ``check_layer_order``; ``None`` sets it to
            ``True`` on new layers and leaves layers synchronized already as they are.
            Default: ``None``

    Returns:
        The converted module: ``module`` itself, modified in place, unless ``module``
        is itself a BatchNorm layer, in which case the new SyncBatchNorm is returned.

    Examples::

        >>> model = torchvision.models.resnet18()
        >>> model = syncbn.convert_sync_batchnorm(model)
    """
    return convert_modules(module, SyncBatchNorm, process_group, check_layer_order)


def _batchnorm_class(input_dim: int | None) -> type[_BatchNorm]:
    if input_dim in (2, 3):
        return nn.BatchNorm1d
    if input_dim == 4:
        return nn.BatchNorm2d
    if input_dim == 5:
        return nn.BatchNorm3d
    return BatchNormNd


def _plain_twin(layer: SyncBatchNorm, path: str) -> nn.Module:
    """The plain layer that replaces ``layer`` in :func:`revert_sync_batchnorm`."""
    original: type[_BatchNorm] | None = layer._original_class
    if original is None:
        return batchnorm_twin(layer, _batchnorm_class(layer.last_input_dim))
    converter = converter_for(original)
    if converter is not None and converter.to_plain is not None:
        plain = converter.to_plain(layer)
        carry_parametrizations(layer, plain)
        return plain
    kwargs = (
        {"process_group": layer.process_group} if issubclass(original, nn.SyncBatchNorm) else {}
    )
    try:
        return batchnorm_twin(layer, original, **kwargs)
    except TypeError as error:
        raise TypeError(
            f"revert_sync_batchnorm cannot rebuild '{path or type(layer).__name__}' as "
            f"{original.__qualname__} from BatchNorm's arguments ({error}); register a "
            "converter for the class with syncbn.register_converter(cls, to_sync, to_plain)"
        ) from error


def _keeps_own_forward(layer: SyncBatchNorm) -> bool:
    """Built directly from a subclass whose ``forward`` adds to SyncBatchNorm's."""
    return layer._original_class is None and type(layer).forward is not SyncBatchNorm.forward


def _revert(module: nn.Module, path: str, kept: list[str], computed: list[str]) -> nn.Module:
    if not isinstance(module, SyncBatchNorm):
        return module
    if _keeps_own_forward(module):
        kept.append(describe_module(module, path))
        return module
    if computed_parameters(module):  # a twin would hold its constructor's meta tensor
        computed.append(describe_module(module, path))
        return module
    return _plain_twin(module, path)


def revert_sync_batchnorm(module: nn.Module) -> nn.Module:
    """Replace every :class:`syncbn.SyncBatchNorm` in ``module`` with plain BatchNorm.

    The inverse of :func:`convert_sync_batchnorm`: a converted layer becomes the class
    it replaced (``BatchNorm2d``, a ``torch.nn.SyncBatchNorm``, a registered subclass
    through its converter's ``to_plain``), whether or not it saw an input since. A
    SyncBatchNorm built directly becomes ``BatchNorm1d``, ``2d`` or ``3d`` according
    to the rank of the last input it ran on (2 or 3 dims, 4, 5), or :class:`BatchNormNd`
    if it never saw an input (or one of more dimensions); a subclass built directly whose
    ``forward`` adds to SyncBatchNorm's is left as it is, with a warning, and so is a
    layer whose weight or bias is computed by hooks (the hook-based ``weight_norm``). The
    new layer shares the Parameters and buffers, and the parametrizations
    (``torch.nn.utils.parametrize``), so ``state_dict`` is identical before and after;
    training mode and the other settings are kept.

    Args:
        module: the model (or a single SyncBatchNorm layer) to revert.

    Returns:
        The reverted module: ``module`` itself, modified in place, unless ``module``
        is itself a SyncBatchNorm, in which case the new BatchNorm is returned.

    Raises:
        TypeError: a converted layer's original class cannot be built from BatchNorm's
            arguments and has no registered ``to_plain``. Nothing is reverted then: the
            model is left as it was.

    Examples::

        >>> model = syncbn.revert_sync_batchnorm(model)  # e.g. before export
    """
    kept: list[str] = []
    computed: list[str] = []
    result = replace_modules(module, lambda current, path: _revert(current, path, kept, computed))
    if kept:
        warnings.warn(
            f"revert_sync_batchnorm left {len(kept)} layer(s) synchronized: {', '.join(kept)}. "
            "Their class overrides forward() and they were built directly, not converted, so "
            "no plain BatchNorm class is known that keeps what that forward adds.",
            stacklevel=2,
        )
    if computed:
        warnings.warn(
            f"revert_sync_batchnorm left {len(computed)} layer(s) synchronized: "
            f"{', '.join(computed)}. Their weight or bias is not a Parameter of the layer "
            "(computed by hooks, as the hook-based torch.nn.utils.weight_norm does, or set "
            "as a plain tensor), which a reverted layer would lose. "
            "Remove the hooks first (torch.nn.utils.remove_weight_norm), or use "
            "torch.nn.utils.parametrize (carried over).",
            stacklevel=2,
        )
    return result
