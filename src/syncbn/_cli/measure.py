"""Measuring tools of ``syncbn bench``, also used by ``benchmarks/`` and the tests.

- :func:`measure` times several callables on all ranks at once, interleaved, with the
  same number of calls on every rank (calls may be collectives), a barrier before
  every timed block, warm-up, many repeats and medians;
- :func:`count_collectives` records every ``torch.distributed`` collective issued
  inside it, with its payload in bytes; :func:`count_host_syncs` counts the times a call
  makes the host wait for a CUDA device;
- :func:`layer_callables`, :func:`layer_collectives` and :func:`replay_callable` turn
  a normalization layer into the callables to time, and its collectives into a
  callable that replays them without the layer;
- :func:`machine_info` describes the machine for benchmark records.

Ranks are started by :mod:`syncbn._cli.launch`. This module imports torch: the
command line imports it only when a command runs.
"""

from __future__ import annotations

import datetime
import gc
import math
import os
import platform
import statistics
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "Collective",
    "Timing",
    "count_collectives",
    "count_host_syncs",
    "layer_callables",
    "layer_collectives",
    "machine_info",
    "measure",
    "replay_callable",
    "synchronize",
    "torch_batchnorm",
]

# The collectives that count_collectives records, and the position and keyword of the
# tensor (or list of tensors) each one sends.
_COLLECTIVE_INPUT: dict[str, tuple[int, str] | None] = {
    "all_reduce": (0, "tensor"),
    "all_reduce_coalesced": (0, "tensors"),
    "all_gather": (1, "tensor"),
    "all_gather_into_tensor": (1, "input_tensor"),
    "all_to_all": (1, "input_tensor_list"),
    "all_to_all_single": (1, "input"),
    "barrier": None,
    "broadcast": (0, "tensor"),
    "gather": (0, "tensor"),
    "reduce": (0, "tensor"),
    "reduce_scatter": (1, "input_list"),
    "reduce_scatter_tensor": (1, "input"),
    "scatter": (1, "scatter_list"),
}


# --------------------------------------------------------------------------- timing


def synchronize(device: torch.device) -> None:
    """Wait for all work queued on ``device`` (nothing to wait for on CPU)."""
    if device.type == "cpu":
        return
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    else:
        torch.accelerator.synchronize(device)


@dataclass(frozen=True)
class Timing:
    """Timing of one callable on all ranks.

    Attributes:
        median: seconds per call: every rank's median over blocks, then the maximum
            over ranks.
        iqr: interquartile range of the per-call times over blocks (maximum over ranks).
        best: per-call time of every rank's fastest block, then the maximum over ranks
            (less sensitive than the median to other load on the machine).
        cpu: median per-call CPU time of the calling thread (maximum over ranks): the
            work of the calling thread, without time spent waiting for other ranks, for
            collectives (gloo waits without spinning) or for the CPU when others use it.
        calls_per_block: calls in each timed block (the same on every rank).
        blocks: number of timed blocks.
    """

    median: float
    iqr: float
    best: float
    cpu: float
    calls_per_block: int
    blocks: int


def _is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _max_over_ranks(values: list[float], group: dist.ProcessGroup | None) -> list[float]:
    if not _is_distributed():
        return values
    tensor = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return tensor.tolist()


def _barrier(group: dist.ProcessGroup | None) -> None:
    if _is_distributed():
        dist.barrier(group=group)


def _time_block(fn: Callable[[], object], calls: int, device: torch.device) -> tuple[float, float]:
    """Wall-clock and calling-thread CPU seconds of ``calls`` calls of ``fn``."""
    gc_enabled = gc.isenabled()
    gc.disable()
    try:
        start, start_cpu = time.perf_counter(), time.thread_time()
        for _ in range(calls):
            fn()
        synchronize(device)
        return time.perf_counter() - start, time.thread_time() - start_cpu
    finally:
        if gc_enabled:
            gc.enable()


def _quartiles(samples: Sequence[float]) -> tuple[float, float]:
    if len(samples) < 2:
        return samples[0], samples[0]
    q1, _, q3 = statistics.quantiles(samples, n=4, method="inclusive")
    return q1, q3


def measure(
    fns: Mapping[str, Callable[[], object]],
    *,
    repeats: int = 20,
    min_block_time: float = 0.02,
    warmup: int = 3,
    max_calls: int = 10_000,
    device: torch.device | str = "cpu",
    group: dist.ProcessGroup | None = None,
) -> dict[str, Timing]:
    """Time each callable on all ranks of ``group`` at once, interleaved.

    Every rank must call this with the same keys in the same order. Each callable is
    warmed up, then calibrated: the number of calls per block doubles until a block
    lasts ``min_block_time`` on the slowest rank (the ranks agree on it, so callables
    may issue collectives). Then ``repeats`` rounds time one block of each callable in
    turn, each after a barrier, so slow drifts of a shared machine hit all callables
    alike. Without an initialized process group it times the calling process alone.

    Args:
        fns: callables to time, by name.
        repeats: timed blocks per callable. Default: 20
        min_block_time: shortest block, in seconds. Default: 0.02
        warmup: untimed calls before calibration. Default: 3
        max_calls: most calls per block. Default: 10000
        device: device whose queued work each block waits for. Default: ``"cpu"``
        group: the ranks that time together; the default group if ``None``.

    Returns:
        A :class:`Timing` per name.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be positive, got {repeats}")
    device = torch.device(device)
    calls: dict[str, int] = {}
    for name, fn in fns.items():
        for _ in range(warmup):
            fn()
        synchronize(device)
        count = 1
        while True:
            _barrier(group)
            (elapsed,) = _max_over_ranks([_time_block(fn, count, device)[0]], group)
            if elapsed >= min_block_time or count >= max_calls:
                break
            wanted = math.ceil(count * 1.2 * min_block_time / max(elapsed, 1e-9))
            count = min(max_calls, max(2 * count, wanted))
        calls[name] = count
    samples: dict[str, list[float]] = {name: [] for name in fns}
    cpu_samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            _barrier(group)
            wall, cpu = _time_block(fn, calls[name], device)
            samples[name].append(wall / calls[name])
            cpu_samples[name].append(cpu / calls[name])
    local: list[float] = []
    for name in fns:
        q1, q3 = _quartiles(samples[name])
        local += [
            statistics.median(samples[name]),
            q3 - q1,
            min(samples[name]),
            statistics.median(cpu_samples[name]),
        ]
    merged = _max_over_ranks(local, group)
    return {
        name: Timing(
            median=merged[4 * i],
            iqr=merged[4 * i + 1],
            best=merged[4 * i + 2],
            cpu=merged[4 * i + 3],
            calls_per_block=calls[name],
            blocks=repeats,
        )
        for i, name in enumerate(fns)
    }


# --------------------------------------------------------------------------- collectives


@dataclass(frozen=True)
class Collective:
    """One recorded collective: its name and the bytes this rank sent into it."""

    name: str
    nbytes: int


def _sent_bytes(name: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> int:
    sent = _COLLECTIVE_INPUT.get(name)
    if sent is None:
        return 0
    position, keyword = sent
    value = args[position] if len(args) > position else kwargs.get(keyword)
    tensors = value if isinstance(value, (list, tuple)) else [value]
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


@contextmanager
def count_collectives() -> Iterator[list[Collective]]:
    """Record every ``torch.distributed`` collective called (by name) inside the block.

    The module-level functions of ``torch.distributed`` are wrapped for the duration of
    the block and restored afterwards; the recorded list is yielded.

    Examples::

        >>> with count_collectives() as log:
        ...     dist.all_reduce(torch.zeros(3))
        >>> log
        [Collective(name='all_reduce', nbytes=12)]
    """
    log: list[Collective] = []
    originals = {name: getattr(dist, name) for name in _COLLECTIVE_INPUT if hasattr(dist, name)}

    def wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def recorded(*args: Any, **kwargs: Any) -> Any:
            log.append(Collective(name, _sent_bytes(name, args, kwargs)))
            return fn(*args, **kwargs)

        return recorded

    for name, fn in originals.items():
        setattr(dist, name, wrap(name, fn))
    try:
        yield log
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def count_host_syncs(fn: Callable[[], object]) -> int:
    """How many times ``fn()`` makes the host wait for the current CUDA device (a value read
    back, a blocking copy), as torch's sync debug mode reports them; needs CUDA.

    Examples::

        >>> x = torch.ones(3, device="cuda")
        >>> count_host_syncs(lambda: x.sum().item())
        1
    """
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return sum("synchroniz" in str(warning.message) for warning in caught)


# --------------------------------------------------------------------------- machine


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as file:
            for line in file:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    try:
        with open("/proc/meminfo") as file:
            for line in file:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def machine_info() -> dict[str, Any]:
    """Machine, software versions and the current date, for benchmark records."""
    from syncbn import __version__

    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "memory_gib": _memory_gib(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "syncbn": __version__,
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "load_average": None if load is None else [round(v, 2) for v in load],
    }


def torch_batchnorm(num_features: int, ndim: int, **kwargs: Any) -> nn.Module:
    """torch's own BatchNorm1d/2d/3d for inputs of ``ndim`` dims (``BatchNormNd`` beyond 5)."""
    if ndim <= 3:
        return nn.BatchNorm1d(num_features, **kwargs)
    if ndim == 4:
        return nn.BatchNorm2d(num_features, **kwargs)
    if ndim == 5:
        return nn.BatchNorm3d(num_features, **kwargs)
    from syncbn.convert import BatchNormNd

    return BatchNormNd(num_features, **kwargs)


def layer_callables(
    layer: nn.Module, x: torch.Tensor, dy: torch.Tensor
) -> tuple[Callable[[], object], Callable[[], object]]:
    """Forward and forward+backward callables of ``layer`` on input ``x``.

    The backward returns the gradients of ``x`` and of the layer's parameters through
    :func:`torch.autograd.grad`, so no ``.grad`` accumulates between calls.
    """
    inputs = [x, *layer.parameters()]

    def forward() -> object:
        return layer(x)

    def forward_backward() -> object:
        return torch.autograd.grad(layer(x), inputs, dy)

    return forward, forward_backward


def layer_collectives(
    layer: nn.Module, x: torch.Tensor, dy: torch.Tensor
) -> tuple[list[Collective], list[Collective]]:
    """The collectives one forward and one backward of ``layer`` issue on this rank."""
    with count_collectives() as forward_log:
        output = layer(x)
    with count_collectives() as backward_log:
        torch.autograd.grad(output, [x, *layer.parameters()], dy)
    return forward_log, backward_log


def replay_callable(
    collectives: Sequence[Collective], device: torch.device | str = "cpu"
) -> Callable[[], object]:
    """A callable that all-reduces buffers of the recorded collectives' sizes, in turn.

    It isolates the latency of a layer's collectives: the same number of bytes in the
    same number of calls, without the layer's computation (float64 buffers when the
    size allows, so a float64 payload is summed like the original).
    """
    buffers = []
    for collective in collectives:
        dtype = torch.float64 if collective.nbytes % 8 == 0 else torch.uint8
        count = collective.nbytes // (8 if dtype == torch.float64 else 1)
        buffers.append(torch.zeros(count, dtype=dtype, device=device))

    def replay() -> object:
        for buffer in buffers:
            dist.all_reduce(buffer)
        return None

    return replay
