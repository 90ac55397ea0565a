"""SyncBatchNorm's compute per call at another git revision against the working tree.

    python benchmarks/compare.py 2134f00            # prints a table, writes compare.md
    MALLOC_TRIM_THRESHOLD_=4000000000 MALLOC_MMAP_THRESHOLD_=4000000000 \\
        python benchmarks/compare.py 2134f00        # the same without page faults
    python benchmarks/compare.py 2134f00 --shapes 16x1024:masked 2x32x8x28x28:masked

Both versions of ``syncbn`` are imported into one process (the revision's ``src/``
from ``git archive``, then the working tree's), and their autograd functions are timed
on the same tensors in interleaved blocks of about 5 ms (each after one of BatchNorm's:
see ``_interleaved_ms``), with the collective replaced as in compute.py (two ranks with
identical data). Interleaving in one process is what makes a 10% difference visible on a
machine whose speed drifts by more than that between runs. Reported: the 20th percentile
and the median of the per-call times of each version over all blocks, and BatchNorm's for
scale.

A shape's flags, after colons: ``cl`` (channels last), ``bf16`` (bfloat16 input), ``masked``
(a masked call, 80 % of the positions valid, as in ``masked.py``; BatchNorm's column stays
the unmasked BatchNorm; a revision older than masks cannot take it), ``running`` (running
statistics tracked, as a layer's are by default, BatchNorm's too; each variant its own).
"""

from __future__ import annotations

import argparse
import datetime
import io
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Callable

import torch
import torch.nn.functional as F
from compute import _TwoIdenticalRanks

__all__ = ["main"]

HERE = Path(__file__).parent
REPO = HERE.parent
SHAPES = ["16x1024", "8x64x8x8", "2x64x56x56", "2x64x56x56:cl", "8x256x14x14", "32x512x7x7"]
SHAPES += ["2x64x56x56:bf16"]


def _import_autograd(source_dir: Path | None) -> ModuleType:
    """``syncbn._autograd`` from ``source_dir`` (a ``src/`` tree), or from the installed tree."""
    for name in [m for m in sys.modules if m == "syncbn" or m.startswith("syncbn.")]:
        del sys.modules[name]
    if source_dir is not None:
        sys.path.insert(0, str(source_dir))
    try:
        import syncbn._autograd as autograd
    finally:
        if source_dir is not None:
            sys.path.remove(str(source_dir))
    return autograd


def _extract_source(revision: str, into: Path) -> Path:
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", revision, "src/syncbn"],
        capture_output=True,
        check=True,
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into / "src"


#: the share of valid positions in a ``masked`` shape's mask (as benchmarks/masked.py)
VALID = 0.8


def _parse(spec: str) -> tuple[tuple[int, ...], torch.dtype, bool, bool, bool]:
    """A ``--shapes`` entry: the shape, the input dtype, channels last, masked, running."""
    shape, *flags = spec.split(":")
    unknown = set(flags) - {"bf16", "cl", "masked", "running"}
    if unknown:
        raise ValueError(f"unknown flags {sorted(unknown)} in shape {spec!r}")
    dtype = torch.bfloat16 if "bf16" in flags else torch.float32
    size = tuple(int(size) for size in shape.split("x"))
    return size, dtype, "cl" in flags, "masked" in flags, "running" in flags


def _running_statistics(channels: int) -> dict[str, torch.Tensor]:
    """A fresh set of a layer's running statistics, as keyword arguments."""
    return {
        "running_mean": torch.zeros(channels),
        "running_var": torch.ones(channels),
        "num_batches_tracked": torch.zeros((), dtype=torch.long),
    }


def _variants(spec: str, modules: dict[str, ModuleType]) -> dict[str, Callable[[], object]]:
    shape, dtype, channels_last, masked, running = _parse(spec)
    x = torch.randn(shape).to(dtype)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    x.requires_grad_()
    dy = torch.randn_like(x)
    # passed only where given: revisions from before masks take no mask argument
    mask_argument = {"mask": torch.rand((shape[0], *shape[2:])) < VALID} if masked else {}
    weight = torch.rand(shape[1], requires_grad=True)
    bias = torch.zeros(shape[1], requires_grad=True)
    reducer = _TwoIdenticalRanks()

    def syncbn(module: ModuleType) -> Callable[[], object]:
        layer = module.LayerInfo("compare", shape[1])
        # the internal entry took (x, weight, bias, eps, reducer, layer) before TrainOptions
        options = getattr(module, "TrainOptions", None)
        arguments = (1e-5, reducer, layer) if options is None else (options(reducer, layer),)

        buffers = _running_statistics(shape[1]) if running else {}

        def step() -> object:
            output = module.sync_batch_norm_train(
                x, weight, bias, *arguments, **mask_argument, **buffers
            )
            output = output[0] if isinstance(output, tuple) else output  # older revisions
            return torch.autograd.grad(output, (x, weight, bias), dy)

        return step

    statistics = _running_statistics(shape[1]) if running else {}

    def batchnorm() -> object:
        mean, var = statistics.get("running_mean"), statistics.get("running_var")
        output = F.batch_norm(x, mean, var, weight, bias, True)
        return torch.autograd.grad(output, (x, weight, bias), dy)

    return {"BatchNorm": batchnorm, **{name: syncbn(m) for name, m in modules.items()}}


def _interleaved_ms(fns: dict[str, Callable[[], object]], seconds: float) -> dict[str, list[float]]:
    """Per variant, the per-call times (ms) of its blocks of ~5 ms, in turns until
    ``seconds`` have passed.

    The first variant (BatchNorm) is timed before each of the others' blocks, so that no
    syncbn version ever runs right after the other: a block that follows one of the same
    maths on the same tensors starts on warm caches and a freed buffer of the right size,
    and read 5-10 % faster (an A/A run, the same revision in both columns, read 0.90-0.95x
    when the turns were BatchNorm, revision, working tree).
    """
    for fn in fns.values():
        for _ in range(3):
            fn()
    start = time.perf_counter()
    next(iter(fns.values()))()
    calls = max(1, int(0.005 / max(time.perf_counter() - start, 1e-6)))
    times: dict[str, list[float]] = {name: [] for name in fns}
    (first, first_fn), *others = fns.items()

    def block(name: str, fn: Callable[[], object]) -> None:
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times[name].append((time.perf_counter() - start) / calls * 1e3)

    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        for name, fn in others:
            block(first, first_fn)
            block(name, fn)
    return times


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[int(q * (len(ordered) - 1))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("revision", help="git revision to compare the working tree with")
    parser.add_argument("--shapes", nargs="+", default=SHAPES, help="e.g. 2x64x56x56:cl:bf16")
    parser.add_argument("--seconds", type=float, default=5.0, help="per shape (default 5)")
    parser.add_argument("--out", type=Path, default=HERE / "compare.md", help="markdown output")
    args = parser.parse_args(argv)
    command = " ".join(sys.argv[1:] if argv is None else argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        base = _import_autograd(_extract_source(args.revision, Path(tmp)))
        if not str(base.__file__).startswith(tmp):
            raise RuntimeError(f"expected syncbn from {tmp}, imported {base.__file__}")
        current = _import_autograd(None)
    modules = {args.revision: base, "working tree": current}
    rows = []
    for spec in args.shapes:
        times = _interleaved_ms(_variants(spec, modules), args.seconds)
        rows.append(
            (spec, {name: (_quantile(t, 0.2), _quantile(t, 0.5)) for name, t in times.items()})
        )
    names = ["BatchNorm", *modules]
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    malloc = [f"{k}={os.environ[k]}" for k in sorted(os.environ) if k.startswith("MALLOC_")]
    lines = [
        f"# SyncBatchNorm compute: {args.revision} against the working tree",
        "",
        f"Generated by `python benchmarks/compare.py {command}` on {date}; torch "
        f"{torch.__version__}; 1 thread; {args.seconds:g} s of interleaved ~5 ms blocks per "
        "shape. ms per forward+backward call, 20th percentile / median over the blocks. "
        f"Allocator: glibc, {' '.join(malloc) if malloc else 'default settings'}. "
        "See the script's docstring.",
        "",
        "| shape | " + " | ".join(names) + " | working tree / revision (p20) |",
        "|---|" + "---|" * (len(names) + 1),
    ]
    for spec, result in rows:
        cells = " | ".join(f"{result[n][0]:.3f} / {result[n][1]:.3f}" for n in names)
        change = result["working tree"][0] / result[args.revision][0]
        lines.append(f"| {spec} | {cells} | {change:.2f}x |")
    text = "\n".join(lines) + "\n"
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
