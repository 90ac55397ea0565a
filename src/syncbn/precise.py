"""Precise BatchNorm: recompute running statistics as exact population statistics across ranks."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, nullcontext
from itertools import islice
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.lazy import LazyModuleMixin
from torch.overrides import TorchFunctionMode

from syncbn import _composite, _masking, _protocol, _stats, distributed
from syncbn._kernels import kernels_for
from syncbn.batchnorm import SyncBatchNorm
from syncbn.data_parallel import _SynchronizedBatchNorm

__all__ = ["recompute_statistics"]

#: the layers that take a syncbn.masking block's mask when they are passed none
_TAKE_BLOCK_MASKS = (SyncBatchNorm, _SynchronizedBatchNorm)


class _LayerState(NamedTuple):
    """What :func:`_collecting_moments` changes on a layer, to put back afterwards."""

    training: bool
    running_mean: torch.Tensor | None
    running_var: torch.Tensor | None


def _record_moments(
    layer: _BatchNorm, sums: dict[int, torch.Tensor], given: dict[int, torch.Tensor]
) -> Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], None]:
    """A forward pre-hook that adds the moments of ``layer``'s input to ``sums`` and loads the
    batch's own mean and variance into its running statistics, which the layer, in eval mode,
    then normalizes with: the output of training mode, without communicating and without
    updating anything. A batch of one sample per channel (or none) is valid here, since only
    the moments summed over all batches and ranks matter. A synchronized layer called with a
    mask, or in a :class:`syncbn.masking` block, counts its valid positions only.
    """

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        input = args[0] if args else kwargs["input"]
        given[id(layer)] = input
        layer._check_input_dim(input)
        if input.dim() < 2 or input.shape[1] != layer.num_features:
            raise ValueError(
                f"recompute_statistics: {type(layer).__qualname__}(num_features="
                f"{layer.num_features}) was given an input of shape {tuple(input.shape)}, "
                "whose dimension 1 is not its channels; a forward that transposes its input "
                "before normalizing it is not supported"
            )
        # a synchronized layer's mask of valid positions (padded batches), if the model gives
        # one, or its syncbn.masking block's (torch's own layers ignore a block)
        mask = args[1] if len(args) > 1 else kwargs.get("mask")
        if mask is None and isinstance(layer, _TAKE_BLOCK_MASKS):
            mask = _masking.block_mask(input)
        valid = None
        count = input.numel() // input.shape[1]
        if mask is not None:
            problem = _composite.mask_problem(mask, input)
            if problem is not None:
                raise problem
            valid = _composite.valid_positions(mask, input)
            count = int(valid.sum()) if input.numel() else 0
        moments = kernels_for(input.device).local_moments(input, valid)
        packed = _protocol.pack_forward(count, moments.total, moments.square_total, 0)
        sums[id(layer)] = packed if id(layer) not in sums else sums[id(layer)] + packed
        local_sums = torch.stack([moments.total, moments.square_total])
        mean, var = _stats.global_moments(local_sums, count)
        layer.running_mean.copy_(mean)  # type: ignore[union-attr]
        layer.running_var.copy_(var)  # type: ignore[union-attr]

    return hook


class _NormalizedInputs(TorchFunctionMode):
    """Watches the batch-norm calls of layers whose class overrides ``forward``: each call
    with a layer's running mean must normalize the very tensor the layer's ``forward`` was
    given, whose moments the pre-hook recorded (timm's ``BatchNormAct2d`` does). A
    ``forward`` that changes its input first (a transpose, a scale) is listed in
    :attr:`transformed`: its recorded statistics would be those of another tensor.
    """

    def __init__(self, layers: list[_BatchNorm]) -> None:
        super().__init__()
        self.by_buffer = {id(layer.running_mean): layer for layer in layers}
        self.given: dict[int, torch.Tensor] = {}  # id(layer) -> its forward's input
        self.transformed: list[_BatchNorm] = []

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if func in (F.batch_norm, torch.batch_norm):
            running_mean = args[1] if len(args) > 1 else kwargs.get("running_mean")
            layer = self.by_buffer.get(id(running_mean))
            input = args[0] if args else kwargs.get("input")
            if layer is not None and input is not self.given.get(id(layer)):
                if layer not in self.transformed:
                    self.transformed.append(layer)
        return func(*args, **kwargs)


def _overrides_forward(layer: _BatchNorm) -> bool:
    """Whether ``layer``'s class has a ``forward`` of its own: other than BatchNorm's, or for
    a :class:`syncbn.SyncBatchNorm`, other than its class's (a subclass's may transform the
    input too)."""
    known = SyncBatchNorm.forward if isinstance(layer, SyncBatchNorm) else _BatchNorm.forward
    return type(layer).forward is not known


@contextmanager
def _collecting_moments(
    layers: list[_BatchNorm], tracked: list[_BatchNorm]
) -> Iterator[dict[int, torch.Tensor]]:
    """Hold every BatchNorm layer of ``layers`` in eval mode, where none communicates, and
    record the input moments of the ``tracked`` ones; put everything back afterwards.

    The layers keep their own ``forward``: a subclass that adds to it (timm's
    ``BatchNormAct2d`` applies an activation) still does.
    """
    sums: dict[int, torch.Tensor] = {}
    saved = {
        id(layer): _LayerState(
            layer.training,
            None if layer.running_mean is None else layer.running_mean.clone(),
            None if layer.running_var is None else layer.running_var.clone(),
        )
        for layer in layers
    }
    watch = _NormalizedInputs([layer for layer in tracked if _overrides_forward(layer)])
    hooks = [
        layer.register_forward_pre_hook(_record_moments(layer, sums, watch.given), with_kwargs=True)
        for layer in tracked
    ]
    # a layer that tracks no running statistics but still holds them (tracking switched
    # off after it was built) normalizes with the batch's statistics in training, and in
    # eval with its buffers: it runs without them here, as batch statistics
    hidden = {
        id(layer): (layer.running_mean, layer.running_var)
        for layer in layers
        if not layer.track_running_stats
    }
    for layer in layers:
        layer.training = False  # the layer alone: its children (act, drop) keep their mode
        if id(layer) in hidden:
            layer.running_mean = layer.running_var = None
    try:
        # (only where a layer's forward is its class's own: the mode sees every torch call)
        with watch if watch.by_buffer else nullcontext():
            yield sums
        if watch.transformed:
            described = ", ".join(type(layer).__qualname__ for layer in watch.transformed)
            raise ValueError(
                f"recompute_statistics: the forward of {described} normalizes another tensor "
                "than the one it is given (a transpose, a scale), whose statistics cannot be "
                "recorded; recompute them by running the model in training mode with "
                "momentum=None instead"
            )
    finally:
        for hook in hooks:
            hook.remove()
        for layer in layers:
            state = saved[id(layer)]
            layer.training = state.training
            if id(layer) in hidden:
                layer.running_mean, layer.running_var = hidden[id(layer)]
            for buffer, value in (
                (layer.running_mean, state.running_mean),
                (layer.running_var, state.running_var),
            ):
                if buffer is not None and value is not None:
                    buffer.copy_(value)


def _describe(layer: _BatchNorm, names: dict[int, str]) -> str:
    return f"{type(layer).__name__} layer '{names.get(id(layer), '?')}'"


def _holds_statistics(layer: _BatchNorm) -> bool:
    return layer.running_mean is not None and layer.running_var is not None


@torch.no_grad()
def recompute_statistics(
    model: nn.Module,
    batches: Iterable[Any],
    num_batches: int | None = None,
    process_group: dist.ProcessGroup | None = None,
) -> None:
    r"""Recompute every BatchNorm layer's running statistics over many batches ("precise BN").

    Runs ``model(batch)`` for each batch (at most ``num_batches`` of them on this
    rank) under ``torch.no_grad()``, with every BatchNorm layer (plain or
    :class:`syncbn.SyncBatchNorm`) normalizing each batch with that batch's own
    statistics, as in training, but without communicating and without touching
    its running statistics (each layer runs in eval mode with the batch's own mean and
    variance loaded, so its class's own ``forward`` still runs: timm's ``BatchNormAct2d``
    still applies its activation; layers with ``track_running_stats=False`` use the
    batch's statistics and do not communicate either). Each layer's input moments are
    accumulated exactly
    (count-weighted, in float64), summed over all ranks of ``process_group`` in a
    single ``all_reduce`` at the end, and written to ``running_mean`` (the
    population mean) and ``running_var`` (the unbiased population variance) of
    every layer with ``track_running_stats=True`` that holds them. Plain BatchNorm layers too end
    with identical statistics on every rank. Training mode, momentum and
    ``num_batches_tracked`` are left as they were.

    Ranks may pass different numbers of batches (or none); every rank of the group
    must call this function, since it ends with one collective. Pass the bare model,
    not a DistributedDataParallel wrapper (whose forward broadcasts buffers, a
    collective per batch). A layer that saw
    fewer than 2 values per channel in total keeps its statistics, with a warning. A
    batch of one sample (or none) is valid on any rank, unless the model also has a layer
    that tracks no running statistics: that one normalizes each batch with its own
    statistics, here as in training and eval, and refuses one value per channel as torch's
    layers do.

    An exception on one rank while it runs its batches joins the final collective with
    an error flag and is re-raised; the other ranks then raise a ``RuntimeError`` once
    they finish their own batches, instead of waiting for the process group's timeout.
    Non-finite inputs raise a ``ValueError`` on every rank. In both cases no running
    statistics change.

    Args:
        model: the model whose BatchNorm layers to update.
        batches: inputs, each passed as ``model(batch)``; for a loader of
            ``(input, target)`` pairs pass ``(x for x, _ in loader)``.
        num_batches: use at most this many batches on this rank; all if ``None``.
            Default: ``None``
        process_group: ranks to pool statistics over; the default group if ``None``.
            Default: ``None``

    Raises:
        ValueError: ``num_batches`` is negative, a lazy layer with running statistics
            is not materialised yet (run one forward pass first), or a BatchNorm
            subclass's ``forward`` normalizes another tensor than its input (a transpose,
            a scale first), whose statistics this cannot record. On every rank.

    Examples::

        >>> syncbn.recompute_statistics(model, (x for x, _ in train_loader), num_batches=200)
        >>> model.eval()  # evaluate with the precise statistics
    """
    all_layers = [m for m in model.modules() if isinstance(m, _BatchNorm)]
    # the layers with running statistics to write (a layer may track them and hold none:
    # its buffers set to None, which torch's BatchNorm then runs without, on batch statistics)
    layers = [m for m in all_layers if m.track_running_stats and _holds_statistics(m)]
    names = {id(module): name for name, module in model.named_modules()}
    world_size = distributed.get_world_size(process_group)
    sums: dict[int, torch.Tensor] = {}
    device = layers[0].running_mean.device if layers else None  # type: ignore[union-attr]
    try:
        # in here, so that a rank that refuses its arguments joins the collective too
        if num_batches is not None and num_batches < 0:
            raise ValueError(f"num_batches must be non-negative or None, got {num_batches}")
        lazy = [names[id(m)] for m in layers if isinstance(m, LazyModuleMixin)]
        if lazy:
            raise ValueError(
                f"recompute_statistics: lazy layer(s) {lazy} are not materialised yet; run "
                "one forward pass of the model first"
            )
        if not layers:
            return
        with _collecting_moments(all_layers, layers) as sums:
            for batch in islice(batches, num_batches):
                model(batch)
    except Exception:
        # join the one collective with an error flag, so that no other rank waits for it
        if world_size > 1 and device is not None:
            error = _packed(layers, {}, device)
            error[0] = 1.0
            try:
                distributed.all_reduce_sum_(error, process_group)
            except Exception:  # noqa: BLE001 - the original exception is the one to report
                pass
        raise

    assert device is not None  # layers exist past the return above
    buffer = _packed(layers, sums, device)
    if world_size > 1:
        distributed.all_reduce_sum_(buffer, process_group)
    sizes = [_protocol.forward_size(layer.num_features) for layer in layers]
    layer_buffers = buffer.split(sizes)
    failed = int(_protocol.read_header(layer_buffers[0]).errors)
    if failed:
        raise RuntimeError(
            f"recompute_statistics: {failed} other rank(s) of the process group failed while "
            "running their batches; see the error raised on that rank"
        )
    for layer, layer_buffer in zip(layers, layer_buffers):
        if not bool(torch.isfinite(layer_buffer).all()):
            raise ValueError(
                f"recompute_statistics: the inputs of {_describe(layer, names)} contain "
                "non-finite values (inf or nan) on at least one rank; no running statistics "
                "were changed"
            )
    for layer, layer_buffer in zip(layers, layer_buffers):
        count = _protocol.read_header(layer_buffer).global_count
        if count < 2:
            warnings.warn(
                f"recompute_statistics kept the running statistics of {_describe(layer, names)} "
                f"({layer.num_features} channels): it saw {count} value(s) per channel in total",
                stacklevel=2,
            )
            continue
        mean, var = _stats.global_moments(_protocol.forward_sums(layer_buffer), count)
        layer.running_mean.copy_(mean)  # type: ignore[union-attr]
        layer.running_var.copy_(_stats.unbiased(var, count))  # type: ignore[union-attr]


def _packed(
    layers: list[_BatchNorm], sums: dict[int, torch.Tensor], device: torch.device
) -> torch.Tensor:
    """Every layer's accumulated forward buffer (zeros where it saw nothing), concatenated."""
    packed = []
    for layer in layers:
        local = sums.get(id(layer))
        if local is None:
            local = torch.zeros(
                _protocol.forward_size(layer.num_features), dtype=torch.float64, device=device
            )
        packed.append(local.to(device))
    return torch.cat(packed)
