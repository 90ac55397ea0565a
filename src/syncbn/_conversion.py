"""The model walk behind ``convert_sync_batchnorm``, and the registry of BatchNorm converters.

This module imports nothing from syncbn but :mod:`syncbn.distributed` (which imports
nothing from syncbn): the synchronized class is passed in, so that both
:func:`syncbn.convert_sync_batchnorm` and ``SyncBatchNorm.convert_sync_batchnorm`` (in
:mod:`syncbn.batchnorm`) use one walk without importing each other.
"""

from __future__ import annotations

import inspect
import sys
import warnings
from collections.abc import Callable
from importlib import metadata
from typing import Any, NamedTuple, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.lazy import LazyModuleMixin
from torch.nn.parameter import is_lazy
from torch.nn.utils import parametrize

from syncbn._compiled import device_built_for
from syncbn._protocol import faking
from syncbn.distributed import check_process_group

__all__ = [
    "BUILT_IN_CONVERTERS",
    "Converter",
    "ENTRY_POINT_GROUP",
    "batchnorm_twin",
    "carry_parametrizations",
    "channels",
    "computed_parameters",
    "convert_modules",
    "converted_class",
    "converter_for",
    "describe_module",
    "keeps_extra_state",
    "register_converter",
    "replace_modules",
    "share_state",
    "unmaterialised",
]

_BatchNormT = TypeVar("_BatchNormT", bound=_BatchNorm)

#: the entry-point group through which installed packages offer converters: an entry point
#: named after a top-level package (``timm``) whose object is a function of no arguments that
#: calls :func:`register_converter`; it is loaded the first time a model holds a BatchNorm
#: subclass from that package that no converter covers yet
ENTRY_POINT_GROUP = "syncbn.converters"

#: syncbn's own converters, loaded as the entry points are (a top-level package -> the
#: ``module:function`` that registers its converters) but without package metadata, so that
#: they work also from a source tree on ``sys.path``. pyproject.toml offers the same values as
#: entry points (for tools that list them); an entry point whose value is listed here is not
#: loaded a second time.
BUILT_IN_CONVERTERS: dict[str, str] = {
    "syncbn": "syncbn.data_parallel:register_converters",  # vacancy's API's layers
    "timm": "syncbn.integrations.timm:register_converters",
}


class Converter(NamedTuple):
    """How one BatchNorm subclass becomes synchronized and back (``None``: the default twin)."""

    to_sync: Callable[[Any], nn.Module] | None
    to_plain: Callable[[Any], nn.Module] | None


# BatchNorm class -> its converter; filled by register_converter
_CONVERTERS: dict[type[_BatchNorm], Converter] = {}
# top-level packages whose converters (built in or entry points) were already loaded
_LOADED_PACKAGES: set[str] = set()


#: the buffers every ``_BatchNorm`` constructor registers (``None`` where not tracked)
_BATCHNORM_BUFFERS = ("running_mean", "running_var", "num_batches_tracked")


def share_state(source: nn.Module, target: nn.Module) -> nn.Module:
    """Make ``target`` use ``source``'s very Parameters and buffers, and its training mode.

    An entry that ``source`` holds as ``None`` is ``None`` on ``target`` too: torch's
    ``bias=False``, or running statistics (or an affine weight) that the model set to
    ``None``. Every buffer is persistent or not as on ``source`` (a ``running_mean`` made
    non-persistent, one a BatchNorm subclass adds), so that ``state_dict`` keeps its keys.
    """
    # _parameters and _buffers, not named_parameters(): those skip the None entries
    for name, param in source._parameters.items():
        target.register_parameter(name, param)
    for name, buffer in source._buffers.items():
        persistent = name not in source._non_persistent_buffers_set
        target.register_buffer(name, buffer, persistent=persistent)
    # a running statistic that ``source`` no longer has at all (deleted: a checkpoint of
    # torch < 0.4.1 had no num_batches_tracked) is absent from ``target`` too, not the
    # meta-device tensor of its constructor; a parametrized one is carried over with its
    # parametrization (carry_parametrizations)
    for name in _BATCHNORM_BUFFERS:
        absent = name not in source._buffers and not parametrize.is_parametrized(source, name)
        if absent and name in target._buffers:
            delattr(target, name)
    target.train(source.training)
    if hasattr(source, "qconfig"):
        target.qconfig = source.qconfig
    return target


def batchnorm_twin(source: _BatchNorm, cls: type[_BatchNormT], **kwargs: Any) -> _BatchNormT:
    """A ``cls`` layer with ``source``'s settings that shares its Parameters, buffers and mode.

    Built on the meta device where ``cls``'s constructor takes a ``device``, so that nothing
    is allocated before the state is shared; under ``FakeTensorMode`` (a model converted
    inside it, as memory estimators build models), where nothing is allocated either, and a
    meta tensor would be a real one, which the mode refuses. ``kwargs`` go to ``cls``'s
    constructor after the five BatchNorm settings.
    """
    settings = (
        channels(source),
        source.eps,
        source.momentum,
        source.affine,
        source.track_running_stats,
    )
    if faking():
        twin = cls(*settings, **kwargs)  # fake tensors, replaced at once
    elif _takes_device(cls):
        twin = cls(*settings, device="meta", **kwargs)
    else:  # a subclass whose constructor predates torch's device argument
        twin = cls(*settings, **kwargs)  # a few per-channel tensors, replaced at once
    share_state(source, twin)  # None entries too (torch >= 2.13's bias=False)
    carry_parametrizations(source, twin)
    # a SyncBatchNorm built on the meta device now holds tensors on another device; one
    # without per-channel tensors puts its site where a layer built without a device would
    prepare = getattr(twin, "_prepare_compiled_state", None)
    if prepare is not None:
        prepare(lambda: device_built_for(None))
    return twin


def channels(layer: _BatchNorm) -> int:
    """``layer``'s channel count: its ``num_features``, or where that is 0, the size of its
    per-channel tensors. A lazy layer materialised by ``load_state_dict`` (not by a forward)
    keeps ``num_features = 0``, also once a forward has made it a ``BatchNorm*d``: torch
    sets it only where a forward materialises the tensors."""
    if layer.num_features:
        return layer.num_features
    for name in ("weight", "bias", "running_mean", "running_var"):
        tensor = getattr(layer, name, None)
        if isinstance(tensor, torch.Tensor) and not is_lazy(tensor):
            return tensor.shape[0]
    return 0


def unmaterialised(module: _BatchNorm) -> bool:
    """Whether ``module`` is a lazy BatchNorm whose channel count is not known yet (no
    forward, no ``load_state_dict``): its twin would have none. One materialised by
    ``load_state_dict`` keeps its lazy class until its first forward, and converts."""
    if not isinstance(module, LazyModuleMixin):
        return False
    return module.has_uninitialized_params() or channels(module) == 0


def converted_class(module: _BatchNorm) -> type[nn.Module]:
    """The class a converted ``module`` stands for, which reverting gives back: the class
    the user chose (a parametrized layer's class is one that torch derived), or for a
    materialised lazy layer the class that its first forward would make it."""
    cls = parametrize.type_before_parametrizations(module)
    if isinstance(module, LazyModuleMixin):
        return getattr(module, "cls_to_become", None) or cls
    return cls


def _takes_device(cls: type[nn.Module]) -> bool:
    """Whether ``cls``'s constructor takes a ``device`` argument (by name, or ``**kwargs``)."""
    try:
        parameters = inspect.signature(cls).parameters.values()
    except (TypeError, ValueError):  # no signature to read: assume torch's
        return True
    return any(p.name == "device" or p.kind is p.VAR_KEYWORD for p in parameters)


def carry_parametrizations(source: nn.Module, target: nn.Module) -> None:
    """Give ``target`` the parametrizations (``torch.nn.utils.parametrize``) of ``source``'s
    tensors, sharing them: the same parametrization modules and original tensors.

    A parametrized tensor is computed from ``source.parametrizations``, a child module,
    and is not among ``source``'s Parameters, which :func:`share_state` shares; a twin
    kept the meta-device tensor of its constructor there. Registering a parametrization
    makes ``target``'s class compute that tensor: an identity, which evaluates nothing,
    and then ``source``'s list of parametrizations in its place.
    """
    if not parametrize.is_parametrized(source) or target is source:
        return
    for name in source.parametrizations:  # type: ignore[union-attr]
        if not parametrize.is_parametrized(target, name):
            parametrize.register_parametrization(target, name, nn.Identity(), unsafe=True)
    target.parametrizations = source.parametrizations


def register_converter(
    bn_class: type[_BatchNorm],
    to_sync: Callable[[Any], nn.Module] | None = None,
    to_plain: Callable[[Any], nn.Module] | None = None,
) -> None:
    r"""Teach :func:`syncbn.convert_sync_batchnorm` to convert a BatchNorm subclass.

    :func:`~syncbn.convert_sync_batchnorm` converts plain ``BatchNorm1d``/``2d``/``3d``
    layers by itself. A subclass with its own ``forward`` (timm's ``BatchNormAct2d``,
    detectron2's ``NaiveSyncBatchNorm``, your own) is left unconverted with a warning
    until a converter for it is registered here. Subclasses of ``bn_class`` that do
    not override its ``forward`` use the same converter.

    Args:
        bn_class: the BatchNorm subclass (a subclass of ``torch.nn.modules.batchnorm._BatchNorm``).
        to_sync: called with a ``bn_class`` layer, returns the :class:`syncbn.SyncBatchNorm`
            (or a subclass of it) that replaces it, sharing its Parameters and buffers
            (:func:`syncbn.convert.batchnorm_twin` does that). The conversion then sets
            ``layer_name``, ``check_layer_order`` and ``process_group`` on it. ``None``
            gives a plain :class:`syncbn.SyncBatchNorm`: right for a class whose forward
            computes what BatchNorm computes (detectron2's ``NaiveSyncBatchNorm``).
            Default: ``None``
        to_plain: the inverse, used by :func:`syncbn.revert_sync_batchnorm`: called with
            the layer that ``to_sync`` returned, returns a ``bn_class`` layer sharing its
            state. ``None`` builds ``bn_class`` with the layer's settings (its constructor
            must take BatchNorm's arguments). Default: ``None``

    Registering a class again replaces its converter.

    Examples::

        >>> from detectron2.layers import NaiveSyncBatchNorm
        >>> syncbn.register_converter(NaiveSyncBatchNorm)
        >>> model = syncbn.convert_sync_batchnorm(model)  # converts NaiveSyncBatchNorm too
    """
    if not (isinstance(bn_class, type) and issubclass(bn_class, _BatchNorm)):
        raise TypeError(
            f"register_converter expected a BatchNorm class (a subclass of _BatchNorm), "
            f"but got {bn_class!r}"
        )
    for name, function in (("to_sync", to_sync), ("to_plain", to_plain)):
        if function is not None and not callable(function):
            raise TypeError(f"register_converter expected {name} to be callable or None")
    _CONVERTERS[bn_class] = Converter(to_sync, to_plain)


def _entry_points() -> list[metadata.EntryPoint]:
    """The installed entry points of :data:`ENTRY_POINT_GROUP`."""
    if sys.version_info >= (3, 10):
        return list(metadata.entry_points(group=ENTRY_POINT_GROUP))
    return list(metadata.entry_points().get(ENTRY_POINT_GROUP, ()))  # Python 3.9: a dict


def _load_converters(package: str) -> None:
    """Load the converters for ``package``, once: syncbn's own, then installed distributions'.

    syncbn's own (:data:`BUILT_IN_CONVERTERS`) need no package metadata; an entry point with
    the same value (syncbn's, when it is installed) is skipped, so nothing registers twice.
    """
    if package in _LOADED_PACKAGES:
        return
    _LOADED_PACKAGES.add(package)
    built_in = BUILT_IN_CONVERTERS.get(package)
    if built_in is not None:  # loaded as an entry point is, without the metadata
        metadata.EntryPoint(package, built_in, ENTRY_POINT_GROUP).load()()
    for entry_point in _entry_points():
        if entry_point.name == package and entry_point.value != built_in:
            entry_point.load()()


def _registered_converter(cls: type[nn.Module]) -> Converter | None:
    """The converter registered for ``cls`` or for the class whose ``forward`` it inherits."""
    for base in cls.__mro__:
        if base in _CONVERTERS:
            return _CONVERTERS[base] if base.forward is cls.forward else None  # type: ignore[index]
    return None


def converter_for(cls: type[nn.Module]) -> Converter | None:
    """The converter for ``cls``: registered, or loaded (built in, entry point) for the
    package of ``cls`` or of one of its bases (a subclass of timm's layer in user code)."""
    converter = _registered_converter(cls)
    if converter is not None:
        return converter
    for base in cls.__mro__:
        package = base.__module__.partition(".")[0]
        if package in sys.modules and package not in _LOADED_PACKAGES:
            _load_converters(package)
            converter = _registered_converter(cls)
            if converter is not None:
                return converter
    return None


def replace_modules(module: nn.Module, replace: Callable[[nn.Module, str], nn.Module]) -> nn.Module:
    """``module`` with each module ``m`` of its tree (itself included) replaced by
    ``replace(m, path)``, top down; the children of ``m`` are added to what replaces it.

    A module held in several places (one BatchNorm called twice) is replaced once, at
    its first path in ``named_modules`` order, and its replacement takes every place.

    Returns:
        What replaces ``module``.
    """
    # id -> (the module, its replacement): the module is kept alive, so that its id is not
    # reused by a module built during the walk
    done: dict[int, tuple[nn.Module, nn.Module]] = {}
    # a walk in named_modules' order (depth first, children in order) with a stack of its
    # own: a recursive closure would hold ``done`` in a reference cycle, which kept the
    # original and converted models alive after ``del`` until the cyclic collector ran
    pending: list[tuple[nn.Module, str]] = [(module, "")]
    while pending:
        current, path = pending.pop()
        if id(current) in done:
            continue
        done[id(current)] = (current, replace(current, path))
        children = [(name, sub) for name, sub in current._modules.items() if sub is not None]
        pending += [(sub, f"{path}.{name}" if path else name) for name, sub in reversed(children)]
    # the tree changes only once every replacement is built: one that raises (a class that
    # cannot be rebuilt, a converter's error) leaves the model as it was, not half converted
    for current, result in done.values():
        for name, child in list(current._modules.items()):
            if child is not None:
                result.add_module(name, done[id(child)][1])
    return done[id(module)][1]


def keeps_extra_state(module: nn.Module) -> bool:
    """Whether ``module``'s class keeps state of its own in ``state_dict``
    (``get_extra_state``), which a twin of another class would drop."""
    return type(module).get_extra_state is not nn.Module.get_extra_state


def _is_plain_batchnorm(module: nn.Module, sync_class: type[Any]) -> bool:
    plain_forwards = (_BatchNorm.forward, nn.SyncBatchNorm.forward, sync_class.forward)
    return (
        isinstance(module, _BatchNorm)
        and type(module).forward in plain_forwards
        and not keeps_extra_state(module)
    )


def describe_module(module: nn.Module, path: str) -> str:
    """``'path' (ClassName)`` for warnings that list modules (the class name for the root)."""
    return f"'{path or type(module).__name__}' ({type(module).__qualname__})"


def computed_parameters(module: nn.Module) -> bool:
    """Whether an affine BatchNorm's weight or bias is computed by hooks, not a Parameter of
    its own (the hook-based ``torch.nn.utils.weight_norm`` takes it out of the module's
    Parameters): a converted layer would lose that. A tensor parametrized by
    ``torch.nn.utils.parametrize`` is carried over (:func:`carry_parametrizations`)."""
    return bool(getattr(module, "affine", False)) and any(
        name not in module._parameters and not parametrize.is_parametrized(module, name)
        for name in ("weight", "bias")
    )


class _Walk(NamedTuple):
    sync_class: type[Any]  # syncbn.SyncBatchNorm, which this module does not import
    process_group: dist.ProcessGroup | None
    #: ``None``: true for new layers, unchanged for layers synchronized already
    check_layer_order: bool | None
    unconverted: list[str]
    lazy: list[str]
    computed: list[str]
    #: the synchronized layers reached, their paths, and whether they were synchronized
    #: already (:func:`_name` sets their names and settings)
    named: list[tuple[Any, str, bool]]


def _synchronized(module: nn.Module, path: str, walk: _Walk) -> nn.Module:
    """What replaces ``module`` (which is not a ``walk.sync_class`` already)."""
    described = describe_module(module, path)
    if not isinstance(module, _BatchNorm):
        return module
    if unmaterialised(module):
        walk.lazy.append(described)
        return module
    if computed_parameters(module):
        walk.computed.append(described)
        return module
    group = walk.process_group
    if group is None:
        group = getattr(module, "process_group", None)
    cls = converted_class(module)
    # a registered converter wins, also for a class with BatchNorm's own forward
    converter = _registered_converter(cls)
    if converter is None and not _is_plain_batchnorm(module, walk.sync_class):
        converter = converter_for(cls)  # may load an entry point
        if converter is None:
            walk.unconverted.append(described)
            return module
    if converter is None or converter.to_sync is None:
        result = batchnorm_twin(module, walk.sync_class)
    else:
        result = converter.to_sync(module)
        carry_parametrizations(module, result)
    if not isinstance(result, walk.sync_class):
        raise TypeError(
            f"the converter registered for {cls.__qualname__} returned a "
            f"{type(result).__qualname__}, expected a {walk.sync_class.__qualname__}"
        )
    result.process_group = group
    result._original_class = cls
    return result


def _convert(module: nn.Module, path: str, walk: _Walk) -> nn.Module:
    if isinstance(module, walk.sync_class):
        walk.named.append((module, path, True))
        return module
    result = _synchronized(module, path, walk)
    if isinstance(result, walk.sync_class):
        walk.named.append((result, path, False))
    return result


def _name(layer: Any, path: str, synchronized_already: bool, walk: _Walk) -> None:
    """Set a synchronized layer's ``layer_name`` and check settings (and a layer
    synchronized already its process group, if one is given), once the whole model has
    converted: a conversion that raises leaves the layers it reached as they were."""
    if synchronized_already:
        if walk.process_group is not None:
            layer.process_group = walk.process_group
        if walk.check_layer_order is not None:
            layer.check_layer_order = walk.check_layer_order
    else:
        layer.check_layer_order = walk.check_layer_order is not False
    layer.layer_name = path


def _listed(names: list[str], limit: int = 5) -> str:
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def convert_modules(
    module: nn.Module,
    sync_class: type[Any],
    process_group: dist.ProcessGroup | None,
    check_layer_order: bool | None,
) -> nn.Module:
    """Replace the BatchNorm layers of ``module`` with ``sync_class`` layers (see convert.py).

    Warns, once per call, about the layers it had to leave unconverted.

    Raises:
        TypeError: ``process_group`` is not a process group, or ``check_layer_order`` is
            neither a bool nor ``None``.
    """
    check_process_group(process_group)
    if check_layer_order is not None and not isinstance(check_layer_order, bool):
        raise TypeError(
            "check_layer_order must be a bool or None, got "
            f"{type(check_layer_order).__name__} ({check_layer_order!r})"
        )
    walk = _Walk(sync_class, process_group, check_layer_order, [], [], [], [])
    result = replace_modules(module, lambda current, path: _convert(current, path, walk))
    for layer, path, synchronized_already in walk.named:
        _name(layer, path, synchronized_already, walk)
    if walk.unconverted:
        warnings.warn(
            f"convert_sync_batchnorm left {len(walk.unconverted)} BatchNorm layer(s) "
            f"unconverted: {_listed(walk.unconverted)}. Their class overrides forward() "
            "or keeps extra state (get_extra_state), and converting it would drop what those "
            "add, so they keep local (per-rank) statistics. Register a converter for the "
            "class with "
            "syncbn.register_converter(cls, to_sync, to_plain) to synchronize them.",
            stacklevel=3,
        )
    if walk.computed:
        warnings.warn(
            f"convert_sync_batchnorm left {len(walk.computed)} BatchNorm layer(s) "
            f"unconverted: {_listed(walk.computed)}. Their weight or bias is not a "
            "Parameter of the layer (computed by hooks, as the hook-based "
            "torch.nn.utils.weight_norm does, or set as a plain tensor), which a converted "
            "layer would lose, so they keep local (per-rank) statistics. Convert first, or "
            "use torch.nn.utils.parametrize (carried over).",
            stacklevel=3,
        )
    if walk.lazy:
        warnings.warn(
            f"convert_sync_batchnorm left lazy layer(s) {_listed(walk.lazy)} unconverted: "
            "run one forward pass first so that their parameters are materialised",
            stacklevel=3,
        )
    return result
