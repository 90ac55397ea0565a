"""``syncbn bench``: a quick benchmark of SyncBatchNorm against torch's BatchNorm.

The ranks are started by :mod:`syncbn._cli.launch` and measured with
:mod:`syncbn._cli.measure` (the tools that the full suite in ``benchmarks/`` builds
on). torch and the library are imported when the command runs, not with this module.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from syncbn._cli.output import new_file_refusal

if TYPE_CHECKING:
    import torch

__all__ = ["DEFAULT_SHAPES", "add_arguments", "parse_shape", "run"]

#: Shapes of the quick subset run by ``syncbn bench``.
DEFAULT_SHAPES = ((2, 64, 56, 56), (8, 256, 14, 14), (16, 1024))
#: Seconds after which the ranks of ``syncbn bench`` are stopped.
TIMEOUT = 600.0


def parse_shape(text: str) -> tuple[int, ...]:
    """Parse an input shape written like ``2x64x56x56``.

    Raises:
        argparse.ArgumentTypeError: unless it has at least 2 positive dimensions and at
            least 2 values per channel.
    """
    try:
        shape = tuple(int(part) for part in text.lower().split("x"))
    except ValueError:
        shape = ()
    if len(shape) < 2 or min(shape) < 1:
        raise argparse.ArgumentTypeError(
            f"expected a shape like 2x64x56x56 with at least 2 positive dims, got {text!r}"
        )
    values_per_channel = shape[0] * math.prod(shape[2:])
    if values_per_channel < 2:  # the BatchNorm baseline cannot train on one value
        raise argparse.ArgumentTypeError(
            f"expected at least 2 values per channel (N times the spatial size), got {text!r}"
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


def _device(device_type: str) -> torch.device:
    import torch

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
    import torch

    from syncbn import SyncBatchNorm
    from syncbn._cli.measure import (
        layer_callables,
        layer_collectives,
        measure,
        replay_callable,
        torch_batchnorm,
    )

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


def _check_writable(path: str) -> None:
    """Raise a usage error unless a file can be written at ``path``, without touching it
    (a named pipe's reader would see its end; a dangling link would lose its target): the
    folder must be writable, the name short enough for the file system, and, for a new
    file, the folder must take one (``/proc`` passes ``os.access``). A name too long or
    ``/proc`` failed with a traceback after the whole measurement."""
    if os.path.isdir(path):
        raise argparse.ArgumentError(None, f"argument --json: '{path}' is a directory")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise argparse.ArgumentError(
            None, f"argument --json: cannot write '{path}': '{folder}' is not a writable folder"
        )
    try:
        name_max = os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError):  # (no limit known)
        name_max = None
    if name_max is not None and len(os.fsencode(os.path.basename(path))) > name_max:
        raise argparse.ArgumentError(
            None, f"argument --json: cannot write '{path}': its name is longer than {name_max}"
        )
    if os.path.lexists(path):
        if not os.access(path, os.W_OK) and os.path.exists(path):
            raise argparse.ArgumentError(None, f"argument --json: '{path}' is not writable")
        return
    refusal = new_file_refusal(folder)  # a new file: the folder must take one
    if refusal is not None:
        raise argparse.ArgumentError(
            None, f"argument --json: cannot write '{path}': {refusal.strerror or refusal}"
        )


def _fmt_ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}"


def run(args: argparse.Namespace) -> int:
    """Run ``syncbn bench``: print a table and optionally write ``--json``; return 0.

    Raises:
        argparse.ArgumentError: for ``--device cuda`` without a GPU per rank.
    """
    import torch

    from syncbn._cli.launch import RankError, run_on_ranks, sigterm_as_interrupt
    from syncbn._cli.measure import machine_info

    device_type = args.device
    if device_type == "cuda" and torch.cuda.device_count() < args.world_size:
        raise argparse.ArgumentError(
            None,
            f"--device cuda needs one GPU per rank (nccl refuses two ranks on one GPU): "
            f"{args.world_size} ranks but {torch.cuda.device_count()} GPU(s) visible; use "
            "--device cpu, or as many GPUs as --world-size",
        )
    if args.json:
        _check_writable(args.json)  # before minutes of measuring, not after
    backend = "nccl" if device_type == "cuda" else "gloo"
    shapes = [tuple(shape) for shape in args.shapes]
    info = machine_info()
    print(
        f"syncbn bench: {args.world_size} {backend} ranks on {device_type}, one thread each, "
        f"torch {info['torch']}, forward+backward, float32, medians in ms"
    )
    try:
        with sigterm_as_interrupt():  # stopped as by Ctrl-C: exit code 130
            results = run_on_ranks(
                _bench_rank,
                args.world_size,
                shapes,
                args.repeats,
                args.min_time,
                device_type,
                backend=backend,
                timeout=TIMEOUT,
            )
    except RankError as error:
        print(f"syncbn bench: error: {error}; stopped every rank", file=sys.stderr)
        return 1
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
        try:
            with open(args.json, "w") as file:
                json.dump(record, file, indent=2)
                file.write("\n")
        except OSError as error:  # the path changed while the ranks measured
            print(f"syncbn bench: error: cannot write '{args.json}': {error}", file=sys.stderr)
            return 1
        print(f"wrote {args.json}")
    return 0
