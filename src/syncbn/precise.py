"""Precise BatchNorm: recompute running statistics as exact population statistics across ranks."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from itertools import islice
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from syncbn import _stats, distributed

__all__ = ["recompute_statistics"]


def _moment_collecting_forward(
    layer: _BatchNorm, sums: dict[int, torch.Tensor]
) -> Callable[[torch.Tensor], torch.Tensor]:
    """A forward for ``layer`` that records its input's moments and normalizes it locally."""

    def forward(input: torch.Tensor) -> torch.Tensor:
        count = input.numel() // input.shape[1]
        packed = _stats.pack_forward(count, *_stats.local_sums(input), fingerprint=0)
        sums[id(layer)] = packed if id(layer) not in sums else sums[id(layer)] + packed
        # normalize with this batch's own statistics, as in training, without communicating
        return F.batch_norm(input, None, None, layer.weight, layer.bias, True, 0.0, layer.eps)

    return forward


@contextmanager
def _collecting_moments(layers: list[_BatchNorm]) -> Iterator[dict[int, torch.Tensor]]:
    """Temporarily give each layer a forward that accumulates packed moments of its input."""
    sums: dict[int, torch.Tensor] = {}
    for layer in layers:
        layer.forward = _moment_collecting_forward(layer, sums)  # type: ignore[method-assign,assignment]
    try:
        yield sums
    finally:
        for layer in layers:
            del layer.forward  # back to the class's forward


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
    its running statistics. Each layer's input moments are accumulated exactly
    (count-weighted, in float64), summed over all ranks of ``process_group`` in a
    single ``all_reduce`` at the end, and written to ``running_mean`` (the
    population mean) and ``running_var`` (the unbiased population variance) of
    every layer with ``track_running_stats=True``. Plain BatchNorm layers too end
    with identical statistics on every rank. Training mode, momentum and
    ``num_batches_tracked`` are left as they were.

    Ranks may pass different numbers of batches (or none); every rank of the group
    must call this function, since it ends with one collective. Pass the bare model,
    not a DistributedDataParallel wrapper (whose forward broadcasts buffers, a
    collective per batch). A layer that saw
    fewer than 2 values per channel in total keeps its statistics, with a warning.

    Args:
        model: the model whose BatchNorm layers to update.
        batches: inputs, each passed as ``model(batch)``; for a loader of
            ``(input, target)`` pairs pass ``(x for x, _ in loader)``.
        num_batches: use at most this many batches on this rank; all if ``None``.
            Default: ``None``
        process_group: ranks to pool statistics over; the default group if ``None``.
            Default: ``None``

    Examples::

        >>> syncbn.recompute_statistics(model, (x for x, _ in train_loader), num_batches=200)
        >>> model.eval()  # evaluate with the precise statistics
    """
    if num_batches is not None and num_batches < 0:
        raise ValueError(f"num_batches must be non-negative or None, got {num_batches}")
    layers = [m for m in model.modules() if isinstance(m, _BatchNorm) and m.track_running_stats]
    if not layers:
        return
    with _collecting_moments(layers) as sums:
        for batch in islice(batches, num_batches):
            model(batch)

    packed = []
    for layer in layers:
        assert layer.running_mean is not None  # track_running_stats=True
        local = sums.get(id(layer))
        if local is None:
            size = _stats.forward_size(layer.num_features)
            local = torch.zeros(size, dtype=torch.float64, device=layer.running_mean.device)
        packed.append(local.to(layers[0].running_mean.device))  # type: ignore[union-attr]
    buffer = torch.cat(packed)
    if distributed.get_world_size(process_group) > 1:
        distributed.all_reduce_sum_(buffer, process_group)

    for layer, layer_buffer in zip(layers, buffer.split([p.numel() for p in packed])):
        count = _stats.read_header(layer_buffer).global_count
        if count < 2:
            warnings.warn(
                f"recompute_statistics kept the running statistics of {type(layer).__name__}"
                f"({layer.num_features}): it saw {count} value(s) per channel in total",
                stacklevel=2,
            )
            continue
        mean, var = _stats.global_moments(layer_buffer, count)
        layer.running_mean.copy_(mean)  # type: ignore[union-attr]
        layer.running_var.copy_(var * (count / (count - 1)))  # type: ignore[union-attr]
