"""SyncBatchNorm's and BatchNorm's numerical error against a float64 BatchNorm, eager and compiled.

    python benchmarks/accuracy.py            # ~1.5 min on 2 CPU cores (inductor compiles 16
                                             # layers; ~15 s with inductor's cache in /tmp);
                                             # writes accuracy.md and accuracy.json
    python benchmarks/accuracy.py --quick    # eager only, without the two 3-D volumes (~5 s)
    python benchmarks/accuracy.py --device cuda --eager-only   # every case, eager only, on a
                                             # GPU (bash .ci/gpu bench OUT accuracy: seconds,
                                             # where compiling would take a lease's minutes)

One process; one training-mode forward and one backward (``torch.autograd.grad`` of the
input for a fixed random output gradient) per variant, each on a fresh layer (weight 1,
bias 0, default momentum 0.1). The data are drawn in float64 (a generator seeded 0 per
case, on the CPU, then moved to the device), cast to the case's dtype, and the reference is
``torch.nn.BatchNorm{1d,2d,3d}`` in float64 on that cast input (``x.double()``) and output
gradient, so that rounding the input to the test dtype is not counted as error. Per case
and variant: the maximum absolute error of the output, of ``running_var`` after the call,
and of the input gradient. Variants:

- ``torch eager``: ``torch.nn.BatchNorm{1d,2d,3d}`` in the test dtype (its parameters and
  buffers float32 for a bfloat16 input, float64 for a float64 one);
- ``torch compiled``: the same under ``torch.compile(fullgraph=True)`` (inductor);
- ``syncbn eager``: ``syncbn.SyncBatchNorm`` with its synchronized path forced on a one-rank
  gloo group (``_sync_alone``; without it a group of one runs plain batch norm), so the
  local sums, the float64 merge and the global statistics are those of a multi-rank call;
- ``syncbn compiled``: the same layer under ``torch.compile(fullgraph=True)``.

These measure the "Accuracy limits" of README.md (a review's throwaway scripts until
2026-12-06).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

import syncbn
from syncbn._cli.measure import count_collectives, machine_info, torch_batchnorm

__all__ = ["main"]

HERE = Path(__file__).parent
VARIANTS = ("torch eager", "torch compiled", "syncbn eager", "syncbn compiled")
#: what each row reports, in its order
ERRORS = ("output_err", "running_var_err", "grad_err")


@dataclass(frozen=True)
class Case:
    """One input: its shape, dtype, memory format and distribution."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    mean: float
    std: float = 1.0
    channels_last: bool = False
    #: left out of ``--quick``
    big: bool = False


CASES = [
    Case("3-D volume", (1, 2, 128, 128, 128), torch.float32, 3.0, big=True),
    Case(
        "3-D volume, channels_last_3d",
        (1, 2, 128, 128, 128),
        torch.float32,
        3.0,
        channels_last=True,
        big=True,
    ),
    Case("rows (BatchNorm1d)", (2**21, 2), torch.float32, 3.0),
    Case("ResNet stage", (2, 64, 56, 56), torch.float32, 0.0),
    Case("ResNet stage, channels_last", (2, 64, 56, 56), torch.float32, 0.0, channels_last=True),
    Case("rows, 1024 per channel", (1024, 64), torch.float32, 0.0),
    Case("mean/std = 1e4", (8, 16, 32, 32), torch.float32, 1e4),
    Case("mean/std = 1e6", (8, 16, 32, 32), torch.float32, 1e6),
    Case("float64, mean/std = 1e6", (8, 16, 32, 32), torch.float64, 1e6),
    Case("float64, mean/std = 1e8", (8, 16, 32, 32), torch.float64, 1e8),
    Case("bfloat16", (8, 64, 28, 28), torch.bfloat16, 0.0),
]


def _data(case: Case, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The input and output gradient in the case's dtype and memory format, drawn in float64."""
    # a generator per case: a case's data do not depend on which cases ran before it
    generator = torch.Generator().manual_seed(0)
    x64 = torch.randn(case.shape, dtype=torch.float64, generator=generator) * case.std + case.mean
    dy64 = torch.randn(case.shape, dtype=torch.float64, generator=generator)
    x, dy = (t.to(device=device, dtype=case.dtype) for t in (x64, dy64))
    if case.channels_last:
        memory_format = torch.channels_last if x.dim() == 4 else torch.channels_last_3d
        x, dy = (t.contiguous(memory_format=memory_format) for t in (x, dy))
    return x, dy


def _layer(variant: str, case: Case, device: str) -> nn.Module:
    """A fresh layer for ``variant``, compiled if the variant says so."""
    # float32 parameters for a half input (as under autocast); float64 ones for float64
    dtype = torch.float64 if case.dtype == torch.float64 else torch.float32
    channels = case.shape[1]
    layer: nn.Module
    if variant.startswith("syncbn"):
        layer = syncbn.SyncBatchNorm(channels, device=device, dtype=dtype)
        layer._sync_alone = True  # the synchronized path over the one-rank group
    else:
        layer = torch_batchnorm(channels, len(case.shape), device=device, dtype=dtype)
    if variant.endswith("compiled"):
        torch._dynamo.reset()  # each layer compiled for its own shape, no dynamic shapes
        return torch.compile(layer, fullgraph=True)  # type: ignore[return-value]
    return layer


def _run(
    layer: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, dy: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One training forward and backward: the output and the input gradient."""
    leaf = x.detach().requires_grad_()
    y = layer(leaf)
    (dx,) = torch.autograd.grad(y, leaf, dy)
    return y.detach(), dx


def _max_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    return float((value.double() - reference).abs().max().item())


def measure_case(case: Case, variants: tuple[str, ...], device: str) -> list[dict[str, Any]]:
    """The errors of each variant on ``case``, one row each, against float64 BatchNorm.

    The syncbn variants need a default process group (one rank) to synchronize over.
    """
    x, dy = _data(case, device)
    reference = torch_batchnorm(case.shape[1], len(case.shape), device=device, dtype=torch.float64)
    y_ref, dx_ref = _run(reference, x.double(), dy.double())
    var_ref = reference.running_var
    assert isinstance(var_ref, torch.Tensor)
    rows: list[dict[str, Any]] = []
    for variant in variants:
        layer = _layer(variant, case, device)
        start = time.perf_counter()
        with count_collectives() as collectives:
            y, dx = _run(layer, x, dy)
        if x.is_cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        running_var = layer.running_var
        assert isinstance(running_var, torch.Tensor)
        rows.append(
            {
                "case": case.name,
                "shape": list(case.shape),
                "dtype": str(case.dtype).removeprefix("torch."),
                "channels_last": case.channels_last,
                "mean": case.mean,
                "std": case.std,
                "variant": variant,
                "output_err": _max_error(y, y_ref),
                "running_var_err": _max_error(running_var, var_ref),
                "grad_err": _max_error(dx, dx_ref),
                # torch.distributed collectives called: syncbn's synchronized path ran
                "collectives": len(collectives),
                # the first call: for a compiled variant, mostly the compilation
                "first_call_s": seconds,
            }
        )
    return rows


def _measure(quick: bool, device: str, eager_only: bool = False) -> list[dict[str, Any]]:
    """Every case's rows (``quick``: eager variants only, no big case; ``eager_only``: eager
    variants only), over a one-rank gloo group that exists only during the measurement."""
    eager_only = eager_only or quick
    variants = tuple(v for v in VARIANTS if not (eager_only and v.endswith("compiled")))
    cases = [case for case in CASES if not (quick and case.big)]
    if not eager_only:
        import torch._inductor.config as inductor_config

        inductor_config.compile_threads = 1
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as directory:
        init = f"file://{os.path.join(directory, 'rendezvous')}"
        dist.init_process_group("gloo", init_method=init, rank=0, world_size=1)
        try:
            for case in cases:
                rows += measure_case(case, variants, device)
        finally:
            dist.destroy_process_group()
    return rows


def _shape(row: dict[str, Any]) -> str:
    text = "x".join(map(str, row["shape"]))
    return f"{text} channels_last" if row["channels_last"] else text


def _render(rows: list[dict[str, Any]], info: dict[str, Any], command: str) -> str:
    lines = [
        "# Accuracy of SyncBatchNorm and BatchNorm against a float64 BatchNorm",
        "",
        f"Generated by `{command}` on {info['date']}; torch {info['torch']}, syncbn "
        f"{info['syncbn']}; {info['cuda'] or info['cpu']}. One training forward and backward "
        "per variant on a fresh layer (weight 1, bias 0, momentum 0.1); data drawn in float64 "
        "(seed 0), cast to the dtype; the reference is `torch.nn.BatchNorm{1d,2d,3d}` in "
        "float64 on the cast input and output gradient (`.double()`), so rounding the input "
        "is not counted. Every case has std 1, so the absolute errors below are relative to "
        "the std (output, input gradient) or the variance (running_var) as well.",
        "",
        "- **output**: max |y - y_ref| of the training output, in the input's dtype (bfloat16 "
        "outputs carry their own rounding, ~4e-3 relative);",
        "- **running_var**: max |running_var - running_var_ref| after the one call; with "
        "momentum 0.1 it holds 0.9 + 0.1 x the batch's unbiased variance, so this is a tenth "
        "of the error of that variance;",
        "- **input grad**: max |dx - dx_ref| for a fixed random output gradient "
        "(`torch.autograd.grad`);",
        "- **torch** / **syncbn**: `torch.nn.BatchNorm{1d,2d,3d}` / `syncbn.SyncBatchNorm` "
        "with its synchronized path forced on a one-rank gloo group (`_sync_alone`); "
        "**compiled**: under `torch.compile(fullgraph=True)`;",
        "- **collectives**: `torch.distributed` collectives the forward and backward called "
        "(2 where syncbn's synchronized path ran).",
        "",
        "| case | shape | dtype | variant | output | running_var | input grad | collectives |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        errors = " | ".join(f"{row[key]:.2g}" for key in ERRORS)
        lines.append(
            f"| {row['case']} | {_shape(row)} | {row['dtype']} | {row['variant']} | {errors} "
            f"| {row['collectives']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="eager variants only, without the 3-D volumes"
    )
    parser.add_argument("--eager-only", action="store_true", help="eager variants only, every case")
    parser.add_argument("--device", default="cpu", help="where the layers run (default: cpu)")
    parser.add_argument(
        "--out", type=Path, default=HERE / "accuracy.md", help="the table; .json beside it"
    )
    args = parser.parse_args(argv)
    rows = _measure(args.quick, args.device, args.eager_only)
    info = machine_info()
    options = (
        (" --quick" if args.quick else "")
        + (" --eager-only" if args.eager_only else "")
        + (f" --device {args.device}" if args.device != "cpu" else "")
    )
    text = _render(rows, info, f"python benchmarks/accuracy.py{options}")
    args.out.write_text(text)
    args.out.with_suffix(".json").write_text(
        json.dumps({"machine": info, "rows": rows}, indent=1) + "\n"
    )
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
