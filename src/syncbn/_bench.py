"""``syncbn bench``: a quick benchmark of SyncBatchNorm against torch's BatchNorm.

This module also holds the measuring tools that the full benchmark suite in
``benchmarks/`` builds on (the suite imports this module, never the reverse):

- :func:`run_on_ranks` runs a function on ``world_size`` freshly spawned ranks
  (``torch.multiprocessing``, ``file://`` rendezvous in a temporary directory, one
  thread per rank) and returns every rank's result;
- :func:`measure` times several callables on all ranks at once, interleaved, with the
  same number of calls on every rank (calls may be collectives), a barrier before
  every timed block, warm-up, many repeats and medians;
- :func:`count_collectives` records every ``torch.distributed`` collective issued
  inside it, with its payload in bytes.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import pickle
import platform
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

__all__ = [
    "Collective",
    "Timing",
    "add_arguments",
    "count_collectives",
    "layer_callables",
    "layer_collectives",
    "machine_info",
    "measure",
    "parse_shape",
    "replay_callable",
    "run",
    "run_on_ranks",
    "synchronize",
    "torch_batchnorm",
]

#: Shapes of the quick subset run by ``syncbn bench``.
DEFAULT_SHAPES = ((2, 64, 56, 56), (8, 256, 14, 14), (16, 1024))

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


# --------------------------------------------------------------------------- ranks


def _rank_main(
    rank: int,
    fn: Callable[..., Any],
    world_size: int,
    workdir: str,
    backend: str,
    pg_timeout: float,
    args: tuple[Any, ...],
) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo binds the loopback interface only
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(
        backend,
        init_method=f"file://{os.path.join(workdir, 'rendezvous')}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=pg_timeout),
    )
    try:
        result = fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()
    with open(os.path.join(workdir, f"result-{rank}.pkl"), "wb") as file:
        pickle.dump(result, file)


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout: float = 600.0,
    pg_timeout: float = 60.0,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` new ranks; return their results.

    Every rank is a process started by ``torch.multiprocessing`` with the ``spawn``
    method, runs with one intra-op thread, and has the default process group
    initialized (``file://`` rendezvous in a temporary directory). ``fn`` must be a
    top-level function and its result picklable.

    Args:
        fn: the function every rank runs.
        world_size: number of ranks.
        *args: further arguments of ``fn`` (picklable).
        backend: the process group's backend. Default: ``"gloo"``
        timeout: seconds after which the ranks are killed. Default: 600
        pg_timeout: the process group's timeout in seconds. Default: 60

    Returns:
        The ranks' results, in rank order.

    Raises:
        TimeoutError: if the ranks did not all finish within ``timeout``.
        torch.multiprocessing.ProcessRaisedException: if ``fn`` raised on a rank.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be positive, got {world_size}")
    with tempfile.TemporaryDirectory(prefix="syncbn-bench-") as workdir:
        context = mp.start_processes(
            _rank_main,
            args=(fn, world_size, workdir, backend, pg_timeout, args),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout
        try:
            while not context.join(timeout=1.0):
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"{world_size} benchmark ranks did not finish within {timeout:.0f}s"
                    )
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
                    process.join(timeout=5.0)
        results = []
        for rank in range(world_size):
            with open(os.path.join(workdir, f"result-{rank}.pkl"), "rb") as file:
                results.append(pickle.load(file))
    return results


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


# --------------------------------------------------------------------------- syncbn bench


def parse_shape(text: str) -> tuple[int, ...]:
    """Parse an input shape written like ``2x64x56x56``.

    Raises:
        argparse.ArgumentTypeError: unless it has at least 2 positive dimensions.
    """
    try:
        shape = tuple(int(part) for part in text.lower().split("x"))
    except ValueError:
        shape = ()
    if len(shape) < 2 or min(shape) < 1:
        raise argparse.ArgumentTypeError(
            f"expected a shape like 2x64x56x56 with at least 2 positive dims, got {text!r}"
        )
    return shape


def _int_at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}")
        return value

    return parse


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0 or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``syncbn bench`` to ``parser``."""
    parser.add_argument(
        "--shapes",
        type=parse_shape,
        nargs="+",
        default=list(DEFAULT_SHAPES),
        metavar="NxCx...",
        help="input shapes per rank (default: 2x64x56x56 8x256x14x14 16x1024)",
    )
    parser.add_argument(
        "--world-size", type=_int_at_least(2), default=2, help="number of ranks (default: 2)"
    )
    parser.add_argument(
        "--repeats",
        type=_int_at_least(1),
        default=15,
        help="timed blocks per measurement (default: 15)",
    )
    parser.add_argument(
        "--min-time",
        type=_positive_float,
        default=0.01,
        help="shortest timed block in seconds (default: 0.01)",
    )
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="cpu (gloo ranks) or cuda (nccl, one GPU per rank) (default: cpu)",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the numbers to this JSON file")


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


def _device(device_type: str) -> torch.device:
    if device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device_type)


def _bench_rank(
    rank: int,
    world_size: int,
    shapes: list[tuple[int, ...]],
    repeats: int,
    min_time: float,
    device_type: str,
) -> list[dict[str, Any]]:
    from syncbn import SyncBatchNorm

    device = _device(device_type)
    generator = torch.Generator().manual_seed(rank)
    rows = []
    for shape in shapes:
        channels = shape[1]
        x = torch.randn(shape, generator=generator).to(device).requires_grad_()
        dy = torch.randn(shape, generator=generator).to(device)
        plain = torch_batchnorm(channels, len(shape), device=device)
        sync = SyncBatchNorm(channels, device=device)
        forward_log, backward_log = layer_collectives(sync, x, dy)
        timings = measure(
            {
                "batchnorm": layer_callables(plain, x, dy)[1],
                "syncbn": layer_callables(sync, x, dy)[1],
                "all_reduce_forward": replay_callable(forward_log, device),
                "all_reduce_backward": replay_callable(backward_log, device),
            },
            repeats=repeats,
            min_block_time=min_time,
            device=device,
        )
        latency = timings["all_reduce_forward"].median + timings["all_reduce_backward"].median
        compute = timings["syncbn"].median - latency
        rows.append(
            {
                "shape": list(shape),
                "dtype": "float32",
                "memory_format": "contiguous",
                "batchnorm_s": timings["batchnorm"].median,
                "syncbn_s": timings["syncbn"].median,
                "all_reduce_forward_s": timings["all_reduce_forward"].median,
                "all_reduce_backward_s": timings["all_reduce_backward"].median,
                "syncbn_compute_s": compute,
                "compute_vs_batchnorm": compute / timings["batchnorm"].median,
                "batchnorm_cpu_s": timings["batchnorm"].cpu,
                "syncbn_cpu_s": timings["syncbn"].cpu,
                "collectives_forward": len(forward_log),
                "collectives_backward": len(backward_log),
                "bytes_forward": sum(c.nbytes for c in forward_log),
                "bytes_backward": sum(c.nbytes for c in backward_log),
            }
        )
    return rows


def _fmt_ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}"


def run(args: argparse.Namespace) -> int:
    """Run ``syncbn bench``: print a table and optionally write ``--json``; return 0.

    Raises:
        argparse.ArgumentError: for ``--device cuda`` without a GPU per rank.
    """
    device_type = args.device
    if device_type == "cuda" and torch.cuda.device_count() < args.world_size:
        raise argparse.ArgumentError(
            None,
            f"--device cuda needs one GPU per rank: {args.world_size} ranks but "
            f"{torch.cuda.device_count()} GPU(s) visible",
        )
    backend = "nccl" if device_type == "cuda" else "gloo"
    shapes = [tuple(shape) for shape in args.shapes]
    info = machine_info()
    print(
        f"syncbn bench: {args.world_size} {backend} ranks on {device_type}, one thread each, "
        f"torch {info['torch']}, forward+backward, float32, medians in ms"
    )
    results = run_on_ranks(
        _bench_rank,
        args.world_size,
        shapes,
        args.repeats,
        args.min_time,
        device_type,
        backend=backend,
    )
    rows = results[0]
    for index, row in enumerate(rows):  # every rank counted the bytes it sent itself
        for phase in ("forward", "backward"):
            row[f"bytes_{phase}_per_rank"] = [ranks[index][f"bytes_{phase}"] for ranks in results]
    header = (
        f"{'shape':>16} {'BatchNorm':>10} {'SyncBN':>10} {'all_reduce':>11} {'compute':>10} "
        f"{'compute/BN':>10} {'collectives':>11} {'bytes':>11}"
    )
    print(header)
    for row in rows:
        latency = row["all_reduce_forward_s"] + row["all_reduce_backward_s"]
        print(
            f"{'x'.join(map(str, row['shape'])):>16} {_fmt_ms(row['batchnorm_s']):>10} "
            f"{_fmt_ms(row['syncbn_s']):>10} {_fmt_ms(latency):>11} "
            f"{_fmt_ms(row['syncbn_compute_s']):>10} {row['compute_vs_batchnorm']:>9.2f}x "
            f"{row['collectives_forward']:>5}+{row['collectives_backward']:<5} "
            f"{row['bytes_forward']:>5}+{row['bytes_backward']:<5}"
        )
    print(
        "compute = SyncBN minus the latency of its two all_reduces (measured alone); "
        "bytes = sent per rank per call, forward+backward"
    )
    if args.json:
        record = {
            "machine": info,
            "world_size": args.world_size,
            "backend": backend,
            "device": device_type,
            "threads_per_rank": 1,
            "repeats": args.repeats,
            "min_block_time_s": args.min_time,
            "results": rows,
        }
        with open(args.json, "w") as file:
            json.dump(record, file, indent=2)
            file.write("\n")
        print(f"wrote {args.json}")
    return 0
