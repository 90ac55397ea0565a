"""SyncBatchNorm's compute per layer call without the transport, against BatchNorm and the floor.

    python benchmarks/compute.py            # writes benchmarks/compute.md and compute.json

On a 2-core machine the gloo all_reduce between two ranks costs 0.5-4 ms (p10-p90), so
"SyncBN time minus collective latency" in results.md is dominated by that noise. This
script measures the compute directly, in one process with one thread: everything
``syncbn.SyncBatchNorm`` does in a training forward+backward (local sums, packing,
header checks, global statistics, normalization, backward sums, input gradient, all
the Python and autograd overhead), with the collective replaced by what a 2-rank
all_reduce of identical data returns (the buffer doubled, in place). It compares with
``torch.nn.BatchNorm`` training forward+backward on the same tensor, and with the
memory-traffic floor: 8 tensor sizes (forward: read x twice, write y; backward: read x
and dy twice, write dx) at the bandwidth of copying a tensor of that size.

Both variants allocate the same large buffers per call (the output and the input
gradient). How often glibc hands such a buffer back to the kernel and faults its pages
in again depends on the allocator's state, and on this VM a fault costs several
microseconds, so the script also counts minor page faults per call, and repeats the
whole measurement in a child process with glibc's trimming and mmap thresholds raised
(``MALLOC_TRIM_THRESHOLD_`` / ``MALLOC_MMAP_THRESHOLD_``, for both variants alike): the
compute without the page-fault lottery. The targets are judged on the default
allocator; the no-trim columns are evidence.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.benchmark import Timer

from syncbn._autograd import LayerInfo, TrainOptions, sync_batch_norm_train

__all__ = ["json_without_trimming", "main"]

SHAPES = [
    (2, 64, 56, 56),
    (8, 256, 14, 14),
    (4, 64, 112, 112),
    (32, 512, 7, 7),
    (16, 1024),
    (2, 32, 8, 28, 28),
]
HERE = Path(__file__).parent


class _TwoIdenticalRanks:
    """The reducer of two ranks with identical data: the sum is the buffer doubled."""

    world_size = 2
    participants = "ranks"

    def all_reduce(self, buffer: torch.Tensor, phase: str) -> torch.Tensor:
        return buffer.mul_(2)

    def dissolved_test(self) -> None:
        return None


ROUNDS = 5


NO_TRIM_ENV = {"MALLOC_TRIM_THRESHOLD_": "4000000000", "MALLOC_MMAP_THRESHOLD_": "4000000000"}


def _median_ms(fn: Any) -> float:
    return Timer("fn()", globals={"fn": fn}).blocked_autorange(min_run_time=0.2).median * 1e3


def _faults_per_call(fn: Any, calls: int = 50) -> float:
    """Minor page faults of this process per call of ``fn`` (after a warm-up)."""
    for _ in range(5):
        fn()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(calls):
        fn()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / calls


def _case(shape: tuple[int, ...], dtype: torch.dtype, channels_last: bool) -> dict[str, Any]:
    x = torch.randn(shape).to(dtype)
    if channels_last:
        x = x.contiguous(
            memory_format=torch.channels_last if x.dim() == 4 else torch.channels_last_3d
        )
    x.requires_grad_()
    dy = torch.randn_like(x)
    channels = shape[1]
    weight = torch.rand(channels, requires_grad=True)
    bias = torch.zeros(channels, requires_grad=True)
    options = TrainOptions(_TwoIdenticalRanks(), LayerInfo("bench", channels))

    def syncbn() -> None:
        y = sync_batch_norm_train(x, weight, bias, options)
        torch.autograd.grad(y, (x, weight, bias), dy)

    def batchnorm() -> None:
        y = F.batch_norm(x, None, None, weight, bias, True)
        torch.autograd.grad(y, (x, weight, bias), dy)

    source = x.detach()
    copy_ms = min(_median_ms(lambda: source.clone()) for _ in range(ROUNDS))
    # Interleaved rounds, the best median of each variant: whether a fresh large buffer
    # faults its pages in again depends on the allocator's state, which changes between
    # rounds and disturbs both variants (by up to +-50% for the large float32 shapes here).
    rounds = [(_median_ms(batchnorm), _median_ms(syncbn)) for _ in range(ROUNDS)]
    times = {"batchnorm": min(r[0] for r in rounds), "syncbn": min(r[1] for r in rounds)}
    faults = {"batchnorm": _faults_per_call(batchnorm), "syncbn": _faults_per_call(syncbn)}
    floor_ms = 8 * copy_ms / 2  # a clone reads and writes one tensor size
    return {
        "shape": list(shape),
        "dtype": str(dtype).replace("torch.", ""),
        "channels_last": channels_last,
        "batchnorm_ms": times["batchnorm"],
        "syncbn_ms": times["syncbn"],
        "floor_ms": floor_ms,
        "syncbn_over_batchnorm": times["syncbn"] / times["batchnorm"],
        "syncbn_over_floor": times["syncbn"] / floor_ms,
        "batchnorm_faults_per_call": faults["batchnorm"],
        "syncbn_faults_per_call": faults["syncbn"],
    }


def _verdict(value: float, limit: float) -> str:
    return f"{value:.2f}x {'PASS' if value <= limit else 'MISS'} (<= {limit:g})"


_MEASURED = (
    "batchnorm_ms",
    "syncbn_ms",
    "floor_ms",
    "syncbn_over_batchnorm",
    "syncbn_over_floor",
    "batchnorm_faults_per_call",
    "syncbn_faults_per_call",
)


def _measure_all() -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    return [
        _case(shape, dtype, channels_last)
        for dtype in (torch.float32, torch.bfloat16)
        for shape in SHAPES
        for channels_last in ([False, True] if len(shape) >= 4 else [False])
    ]


def json_without_trimming(script: Path, *args: str) -> Any:
    """What ``python script *args`` prints as JSON, run in a child process whose glibc never
    trims or mmaps buffers (:data:`NO_TRIM_ENV`). Shared with masked.py."""
    child = subprocess.run(
        [sys.executable, str(script.resolve()), *args],
        env={**os.environ, **NO_TRIM_ENV},
        capture_output=True,
        text=True,
        check=True,
        timeout=1800,
    )
    return json.loads(child.stdout)


def _measure_without_trimming() -> list[dict[str, Any]]:
    """The same measurement in a child process whose glibc never trims or mmaps buffers."""
    rows: list[dict[str, Any]] = json_without_trimming(Path(__file__), "--child")
    return rows


def main(out: Path = HERE) -> None:
    """Measure, then write ``compute.md`` and ``compute.json`` into ``out``."""
    rows = _measure_all()
    for row, no_trim in zip(rows, _measure_without_trimming()):
        row["no_trim"] = {key: no_trim[key] for key in _MEASURED}
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} "
        f"thread, {platform.platform()}",
        "torch": torch.__version__,
        "no_trim_env": NO_TRIM_ENV,
    }
    (out / "compute.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [
        "# SyncBatchNorm compute per layer call (no transport)",
        "",
        f"Generated by `python benchmarks/compute.py` on {meta['date']}; torch {meta['torch']}; "
        f"{meta['machine']}. Per variant, the best of {ROUNDS} interleaved rounds, each the median "
        "of `torch.utils.benchmark` blocks (>= 0.2 s). See the script's docstring for what is "
        "measured. Verdicts use the default allocator; the last three columns repeat the "
        "measurement in a process whose glibc neither trims nor mmaps large buffers "
        f"(`{' '.join(f'{k}={v}' for k, v in NO_TRIM_ENV.items())}`, for BatchNorm and SyncBN "
        "alike), which removes the page faults counted in the *faults* column.",
        "",
        "| shape | dtype | format | BatchNorm ms | SyncBN compute ms | floor ms "
        "| compute / BatchNorm | compute / floor | faults per call BN / SyncBN "
        "| no-trim BatchNorm ms | no-trim SyncBN ms | no-trim compute / BatchNorm |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        float32_nchw = row["dtype"] == "float32" and not row["channels_last"]
        limit = 0.6 if float32_nchw else 1.0
        floor_cell = (
            _verdict(row["syncbn_over_floor"], 2.5)
            if row["dtype"] == "float32"
            else f"{row['syncbn_over_floor']:.2f}x"
        )
        no_trim = row["no_trim"]
        lines.append(
            f"| {'x'.join(map(str, row['shape']))} | {row['dtype']} "
            f"| {'channels_last' if row['channels_last'] else 'contiguous'} "
            f"| {row['batchnorm_ms']:.3f} | {row['syncbn_ms']:.3f} | {row['floor_ms']:.3f} "
            f"| {_verdict(row['syncbn_over_batchnorm'], limit)} | {floor_cell} "
            f"| {row['batchnorm_faults_per_call']:.0f} / {row['syncbn_faults_per_call']:.0f} "
            f"| {no_trim['batchnorm_ms']:.3f} | {no_trim['syncbn_ms']:.3f} "
            f"| {no_trim['syncbn_over_batchnorm']:.2f}x |"
        )
    (out / "compute.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=HERE,
        help="folder for compute.md and compute.json (default: benchmarks/, the committed files)",
    )
    # the no-trim control's child process: measure and print the rows as JSON
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_measure_all()))
    else:
        main(args.out)
