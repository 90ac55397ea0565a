"""torch.compile(fullgraph=True) of a converted model against compiled BatchNorm, per training step.

Runs on 2 gloo ranks (CPU) by default; ``--device cuda`` runs one rank per GPU with nccl.
Each rank builds the same :class:`resnet.SmallResNet` (15 BatchNorm layers) and times
four variants of one training step (forward, backward, SGD step; no DDP, so that the
gradient all-reduce, identical for all four, does not hide the difference):

- ``batchnorm eager`` / ``syncbn eager``: the model as it is, and after
  ``syncbn.convert_sync_batchnorm``;
- ``batchnorm compiled`` / ``syncbn compiled``: the same under ``torch.compile(fullgraph=True)``
  with the inductor backend.

For the compiled variants it reports the compile time (the first step, minus a compiled
step) and the number of graphs compiled over a run whose local batch sizes change
(8, 7, 8, 5, 6 on rank 0; 8, 8, 6, 8, 7 on rank 1), i.e. the recompiles that dynamic
shapes cost. No empty local batch here: inductor on CPU fails to run a ``Conv2d`` backward
for a batch of 0 (a stride assert on ``aten.convolution_backward``'s weight gradient; a bare
``nn.Conv2d`` reproduces it, no syncbn involved). ``tests/test_compile.py`` covers empty
batches with the ``aot_eager`` backend.

Usage::

    python benchmarks/compile.py            # ~3-4 min on 2 CPU cores; writes compile.md/json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from resnet import SmallResNet
from torch import nn

import syncbn
from syncbn._cli.launch import run_on_ranks
from syncbn._cli.measure import machine_info

__all__ = ["main"]

HERE = Path(__file__).parent
BATCH = 8
SIZES = [[8, 7, 8, 5, 6], [8, 8, 6, 8, 7]]


class _CountingInductor:
    """The inductor backend, counting the graphs it compiles."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, graph: torch.fx.GraphModule, inputs: list[Any]) -> Any:
        from torch._dynamo.backends.registry import lookup_backend

        self.graphs += 1
        return lookup_backend("inductor")(graph, inputs)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _step_fn(model: nn.Module, run: Any, device: torch.device) -> Any:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step(x: torch.Tensor) -> None:
        run(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def _rank(
    rank: int, world_size: int, steps: int, device_type: str, cache_dir: str
) -> dict[str, Any]:
    # a fresh cache: no compiled code and no remembered dynamic dimensions from earlier runs
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache_dir, f"rank{rank}")
    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    torch.manual_seed(0)
    plain = SmallResNet().to(device)
    synced = syncbn.convert_sync_batchnorm(copy.deepcopy(plain))
    generator = torch.Generator().manual_seed(rank)

    def batch(size: int = BATCH) -> torch.Tensor:
        return torch.randn(size, 3, 32, 32, generator=generator).to(device)

    results: dict[str, Any] = {}
    for name, source in (("batchnorm", plain), ("syncbn", synced)):
        for mode in ("eager", "compiled"):
            model = copy.deepcopy(source)
            counter = _CountingInductor()
            run = (
                model if mode == "eager" else torch.compile(model, fullgraph=True, backend=counter)
            )
            step = _step_fn(model, run, device)
            _sync(device)
            start = time.perf_counter()
            step(batch())
            _sync(device)
            first = time.perf_counter() - start
            for _ in range(3):
                step(batch())
            times = []
            for _ in range(steps):
                x = batch()
                _sync(device)
                start = time.perf_counter()
                step(x)
                _sync(device)
                times.append(time.perf_counter() - start)
            median = statistics.median(times)
            entry = {"median_ms": median * 1e3, "p10_ms": _quantile(times, 0.1) * 1e3}
            if mode == "compiled":
                entry["compile_s"] = first - median
                graphs_before = counter.graphs
                for size in SIZES[rank % 2]:
                    step(batch(size))
                entry["graphs_first_shape"] = graphs_before
                entry["graphs_varying_batch"] = counter.graphs
            results[f"{name} {mode}"] = entry
    return results


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _slowest(results: list[dict[str, Any]], key: str) -> dict[str, Any]:
    """The entry ``key`` of the rank whose median step was the slowest."""
    entries = [result[key] for result in results]
    return max(entries, key=lambda entry: float(entry["median_ms"]))


def _render(results: list[dict[str, Any]], info: dict[str, Any], args: argparse.Namespace) -> str:
    command_options = " --device cuda" if args.device == "cuda" else ""
    lines = [
        "# torch.compile(fullgraph=True): SyncBatchNorm against BatchNorm, per training step",
        "",
        f"Generated by `python benchmarks/compile.py{command_options}`"
        f" on {info['date']}; torch {info['torch']}; {info['cuda'] or info['cpu']}; "
        f"{args.world_size} ranks ({'nccl' if args.device == 'cuda' else 'gloo'}), one thread "
        f"each; SmallResNet (15 BatchNorm2d), batch {BATCH} per rank, 32x32, float32, SGD; "
        f"no DDP. Median (p10) over {args.steps} steps after 3 warm-up steps, worst rank. "
        "Each rank compiles into an empty inductor cache.",
        "",
        "| variant | step ms, median (p10) | vs batchnorm of the same mode | compile s | "
        "graphs: first shape / after 5 more batch sizes |",
        "|---|---|---|---|---|",
    ]
    worst = {key: _slowest(results, key) for key in results[0]}
    for key, entry in worst.items():
        mode = key.split()[1]
        ratio = entry["median_ms"] / worst[f"batchnorm {mode}"]["median_ms"]
        compile_s = f"{max(r[key].get('compile_s', 0.0) for r in results):.1f}"
        graphs = "-"
        if "graphs_first_shape" in entry:
            varying = max(r[key]["graphs_varying_batch"] for r in results)
            graphs = f"{entry['graphs_first_shape']} / {varying}"
        lines.append(
            f"| {key} | {entry['median_ms']:.1f} ({entry['p10_ms']:.1f}) | {ratio:.2f}x | "
            f"{compile_s if mode == 'compiled' else '-'} | {graphs} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--out", type=Path, default=HERE / "compile.md")
    args = parser.parse_args(argv)
    backend = "nccl" if args.device == "cuda" else "gloo"
    with tempfile.TemporaryDirectory(prefix="syncbn-compile-cache-") as cache_dir:
        results = run_on_ranks(
            _rank,
            args.world_size,
            args.steps,
            args.device,
            cache_dir,
            backend=backend,
            timeout=1200,
        )
    info = machine_info()
    text = _render(results, info, args)
    args.out.write_text(text)
    args.out.with_suffix(".json").write_text(
        json.dumps({"machine": info, "ranks": results}, indent=1) + "\n"
    )
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
