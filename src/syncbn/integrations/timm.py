"""timm's norm + activation layers, synchronized.

timm builds most of its convolutional models (EfficientNet, MobileNetV3, RegNet, CSPNet, ...)
with ``timm.layers.BatchNormAct2d``: a ``BatchNorm2d`` subclass whose ``forward`` applies a
dropout-like ``drop`` module and an activation ``act`` after the normalization. Converting it
to a plain SyncBatchNorm would drop both, so :func:`syncbn.convert_sync_batchnorm` converts it
to :class:`SyncBatchNormAct2d` instead, through the converters that :func:`register_converters`
registers. syncbn calls that function itself the first time a conversion (or a revert) meets
a timm BatchNorm class (``syncbn._conversion.BUILT_IN_CONVERTERS``; no package metadata needed,
so also from a source tree on ``sys.path``): nothing needs to be imported or called by hand.
pyproject.toml offers it as the ``syncbn.converters`` entry point ``timm`` as well, for tools
that list entry points; syncbn does not load it a second time.

Importing this module imports timm and registers nothing.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

try:
    from timm.layers import BatchNormAct2d, SyncBatchNormAct, create_act_layer
except ImportError as error:  # pragma: no cover - only without timm
    raise ImportError(
        "syncbn.integrations.timm needs timm; install it with: pip install 'syncbn[timm]'"
    ) from error

import syncbn
from syncbn._compiled import leaf_call_when_fx_traced
from syncbn.batchnorm import SyncBatchNorm
from syncbn.convert import batchnorm_twin

__all__ = ["SyncBatchNormAct2d", "register_converters"]


class SyncBatchNormAct2d(SyncBatchNorm):
    r"""Synchronized twin of timm's ``BatchNormAct2d``: SyncBatchNorm, then ``drop``, then ``act``.

    .. math::
        y = \mathrm{act}\left(\mathrm{drop}\left(
            \frac{x - \mathrm{E}[x]}{\sqrt{\mathrm{Var}[x] + \epsilon}} * \gamma + \beta
        \right)\right)

    The normalization is :class:`syncbn.SyncBatchNorm`'s (statistics of the global batch in
    training); ``drop`` and ``act`` are applied to its output exactly as
    ``timm.layers.BatchNormAct2d.forward`` applies them. Parameters, buffers and ``state_dict``
    keys are those of ``BatchNormAct2d`` (``weight``, ``bias``, ``running_mean``,
    ``running_var``, ``num_batches_tracked``, and any of ``act``'s or ``drop``'s), so
    checkpoints load both ways. :func:`syncbn.convert_sync_batchnorm` builds this layer from a
    ``BatchNormAct2d`` that it replaces, sharing its Parameters, buffers and its very ``act``
    and ``drop`` modules; :func:`syncbn.revert_sync_batchnorm` gives back a ``BatchNormAct2d``
    with them, also for a layer built directly.

    Args:
        num_features: number of channels :math:`C` of an :math:`(N, C, H, W)` input.
        eps: value added to the variance for numerical stability. Default: 1e-5
        momentum: factor of the running statistics update, or ``None`` for a cumulative
            moving average. Default: 0.1
        affine: learnable per-channel scale and shift. Default: ``True``
        track_running_stats: keep running mean and variance for eval mode. Default: ``True``
        apply_act: build ``act`` from ``act_layer``; if ``False``, ``act`` is the identity.
            Default: ``True``
        act_layer: the activation: a module class, or a name that timm's ``create_act_layer``
            knows (``"relu"``, ``"silu"``, ...). Default: :class:`torch.nn.ReLU`
        act_kwargs: keyword arguments of the activation. Default: ``None``
        inplace: build the activation in place (unless ``act_kwargs`` says otherwise).
            Default: ``True``
        drop_layer: a module class to build ``drop`` from, or ``None`` for the identity.
            Default: ``None``
        process_group: ranks to synchronize over; the default group if ``None``.
            Default: ``None``
        device: device of the parameters and buffers. Default: ``None``
        dtype: dtype of the parameters and buffers. Default: ``None``

    Shape:
        - Input: :math:`(N, C, H, W)`
        - Output: :math:`(N, C, H, W)`, same shape as the input.

    Examples::

        >>> # usually built by conversion:
        >>> model = syncbn.convert_sync_batchnorm(timm.create_model("efficientnet_b0"))
        >>> # or directly, like timm.layers.BatchNormAct2d:
        >>> layer = SyncBatchNormAct2d(32, act_layer="silu")
        >>> layer(torch.randn(2, 32, 8, 8)).shape
        torch.Size([2, 32, 8, 8])
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        apply_act: bool = True,
        act_layer: Any = nn.ReLU,
        act_kwargs: dict[str, Any] | None = None,
        inplace: bool = True,
        drop_layer: type[nn.Module] | None = None,
        process_group: dist.ProcessGroup | None = None,
        device: Any = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(
            num_features,
            eps,
            momentum,
            affine,
            track_running_stats,
            process_group=process_group,
            device=device,
            dtype=dtype,
        )
        # what revert_sync_batchnorm gives back for a layer built directly (conversion sets
        # the class it replaced: BatchNormAct2d, or timm's SyncBatchNormAct)
        self._original_class = BatchNormAct2d
        self.drop: nn.Module = drop_layer() if drop_layer is not None else nn.Identity()
        act: nn.Module | None = None
        if apply_act:
            # as timm's BatchNormAct2d builds it (without changing the caller's act_kwargs)
            act = create_act_layer(act_layer, **{"inplace": inplace, **(act_kwargs or {})})
        self.act: nn.Module = nn.Identity() if act is None else act

    def forward(self, input: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        traced = leaf_call_when_fx_traced(self, input, mask=mask)
        if traced is not None:  # torch.fx.symbolic_trace: one node, as timm's layer is
            return traced  # type: ignore[no-any-return]
        if input.dim() != 4:
            raise ValueError(f"expected 4D input (got {input.dim()}D input)")
        # (a mask zeroes padded positions before the activation, as SyncBatchNorm's does)
        return self.act(self.drop(super().forward(input, mask)))


def _norm_act_to_sync(module: _BatchNorm) -> SyncBatchNormAct2d:
    """A SyncBatchNormAct2d sharing ``module``'s state and its ``act`` and ``drop`` modules.

    For ``BatchNormAct2d``, and for timm's own ``SyncBatchNormAct`` (where ``act`` and
    ``drop`` may be missing: its forward skips them then).
    """
    group = getattr(module, "process_group", None)
    layer = batchnorm_twin(module, SyncBatchNormAct2d, apply_act=False, process_group=group)
    for name in ("drop", "act"):
        if isinstance(getattr(module, name, None), nn.Module):
            setattr(layer, name, getattr(module, name))
    _in_order_of(layer, module)
    return layer


def _in_order_of(target: nn.Module, source: nn.Module) -> None:
    """Put the children ``target`` shares with ``source`` in ``source``'s order: timm's
    ``SyncBatchNormAct`` (made by timm's conversion) holds ``act`` before ``drop``, where
    ``BatchNormAct2d``'s constructor, and this module's, make ``drop`` first; a round trip
    kept the module tree (``named_modules``, the repr) in the constructor's order."""
    for name in [name for name in source._modules if name in target._modules]:
        target._modules[name] = target._modules.pop(name)  # to the end, in source's order


def _original_class(layer: SyncBatchNormAct2d, registered: type[_BatchNorm]) -> type[_BatchNorm]:
    """The class ``layer`` was converted from, if it is ``registered`` or a subclass of it
    (one that keeps its forward, and so its converter); else ``registered``."""
    original = layer._original_class
    return original if original is not None and issubclass(original, registered) else registered


def _to_batchnorm_act(layer: SyncBatchNormAct2d) -> nn.Module:
    """The inverse of :func:`_norm_act_to_sync` for ``BatchNormAct2d`` (and subclasses)."""
    module = batchnorm_twin(layer, _original_class(layer, BatchNormAct2d), apply_act=False)
    module.drop = layer.drop
    module.act = layer.act
    _in_order_of(module, layer)
    return module


def _to_timm_sync_batchnorm_act(layer: SyncBatchNormAct2d) -> nn.Module:
    """The inverse of :func:`_norm_act_to_sync` for timm's ``SyncBatchNormAct`` (and subclasses)."""
    original = _original_class(layer, SyncBatchNormAct)
    module = batchnorm_twin(layer, original, process_group=layer.process_group)
    module.drop = layer.drop
    module.act = layer.act
    _in_order_of(module, layer)
    return module


def register_converters() -> None:
    """Register the converters of timm's BatchNorm subclasses that have their own forward.

    ``timm.layers.BatchNormAct2d`` and ``timm.layers.SyncBatchNormAct`` (what timm's own
    ``convert_sync_batchnorm`` makes) both convert to :class:`SyncBatchNormAct2d`, and revert
    to their own class. syncbn calls this itself (its table of built-in converters) the
    first time a conversion meets a timm class; calling it again changes nothing.

    Examples::

        >>> syncbn.integrations.timm.register_converters()  # not needed: done on demand
    """
    syncbn.register_converter(BatchNormAct2d, _norm_act_to_sync, _to_batchnorm_act)
    syncbn.register_converter(SyncBatchNormAct, _norm_act_to_sync, _to_timm_sync_batchnorm_act)
