"""torch.compile(fullgraph=True) of a converted model against compiled BatchNorm, per training step.

Runs on 2 gloo ranks (CPU) by default; ``--device cuda`` runs one rank per GPU with nccl.
Each rank builds the same :class:`resnet.SmallResNet` (15 BatchNorm layers) and times
four variants of one training step (forward, backward, SGD step; no DDP, so that the
gradient all-reduce, identical for all four, does not hide the difference):

- ``batchnorm eager`` / ``syncbn eager``: the model as it is, and after
  ``syncbn.convert_sync_batchnorm``;
- ``batchnorm compiled`` / ``syncbn compiled``: the same under ``torch.compile(fullgraph=True)``
  with the inductor backend.

On more than one rank it also times a control, ``batchnorm compiled + all_reduces``: compiled
BatchNorm with the same 30 all_reduces in place (after each BatchNorm layer, an opaque op
all-reduces a buffer of the size syncbn's forward sends there, and its backward one of the
backward's size), i.e. about the least that any synchronized BatchNorm sending those
payloads at those points can cost (within the run's noise), and the two syncbn steps again
with the collectives taken
out (``no transport``: syncbn's all_reduce returns its buffer times the world size, what
identical ranks would sum, so that every check passes): the same compiled code, each rank
computing alone. The difference between a step and its no-transport twin is what the 30
all_reduces cost *in place*, waits for the slower rank included, which the report sets
against the same all_reduces back to back (the floor below).

For the compiled variants it reports the compile time (the first step, minus a compiled
step) and the number of graphs compiled over a run whose local batch sizes change
(8, 7, 8, 5, 6 on rank 0; 8, 8, 6, 8, 7 on rank 1), i.e. the recompiles that dynamic
shapes cost. No empty local batch here: inductor on CPU fails to run a ``Conv2d`` backward
for a batch of 0 (a stride assert on ``aten.convolution_backward``'s weight gradient; a bare
``nn.Conv2d`` reproduces it, no syncbn involved). ``tests/test_compile.py`` covers empty
batches with the ``aot_eager`` backend.

Each rank also times the floor of syncbn's communication per step: the all_reduces of
exactly the payloads its 15 layers send (``2 * C + 5`` float64 values per layer, forward
and backward), back to back. ``--world-size 1 --sync-alone`` forces the
synchronized path on one rank (a one-rank gloo group: the collectives cost microseconds),
which measures syncbn's compute, plus a one-rank gloo all_reduce per layer call and
direction (about 0.1-0.2 ms each on the 2-core CPU machine: a hand-off to gloo's worker
thread). ``--no-transport`` (with ``--sync-alone``) takes that hand-off out as well: the
all_reduce returns its buffer as it is (what a one-rank sum is), while everything else, the
custom ops, packing, checks and running statistics, runs as before.

Usage::

    python benchmarks/compile.py            # ~3-4 min on 2 CPU cores; writes compile.md/json
    python benchmarks/compile.py --world-size 1 --sync-alone --batch 16 \
        --out benchmarks/compile-world1.md  # compute and one-rank gloo collectives
    python benchmarks/compile.py --world-size 1 --sync-alone --no-transport --batch 16 \
        --out benchmarks/compile-world1-no-transport.md  # compute only
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
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
from syncbn import _protocol
from syncbn._cli.launch import run_on_ranks
from syncbn._cli.measure import machine_info

__all__ = ["main"]

HERE = Path(__file__).parent
BATCH = 8
ROUNDS = 3
SIZES = [[8, 7, 8, 5, 6], [8, 8, 6, 8, 7]]
#: glibc's allocator settings that a results file names when they are set
MALLOC_KEYS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_")


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


@dataclasses.dataclass(frozen=True)
class Settings:
    """What each rank measures."""

    steps: int
    device_type: str
    cache_dir: str
    batch: int
    sync_alone: bool
    no_transport: bool = False


def _collectives_floor_ms(model: nn.Module, device: torch.device, repeats: int = 50) -> float:
    """Median time of one step's all_reduces of syncbn's payloads (every layer, both ways)."""
    import torch.distributed as dist

    sizes = []
    for module in model.modules():
        if isinstance(module, syncbn.SyncBatchNorm):
            sizes += [
                _protocol.forward_size(module.num_features),
                _protocol.backward_size(module.num_features),
            ]
    buffers = [torch.zeros(size, dtype=torch.float64, device=device) for size in sizes]
    times = []
    for _ in range(repeats + 5):
        _sync(device)
        start = time.perf_counter()
        for buffer in buffers:
            dist.all_reduce(buffer)
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[5:]) * 1e3


@dataclasses.dataclass
class _Variant:
    """One of the four timed steps, and what was measured of it."""

    step: Any
    counter: _CountingInductor
    first_s: float
    rounds: list[list[float]] = dataclasses.field(default_factory=list)


def _no_transport(buffer: torch.Tensor, group: Any = None) -> torch.Tensor:
    return buffer


def _identical_ranks(buffer: torch.Tensor, group: Any = None) -> torch.Tensor:
    """What an all_reduce over identical ranks would return, without the transport."""
    import torch.distributed as dist

    return buffer.mul_(dist.get_world_size(group))


def _without_transport(step: Any) -> Any:
    """``step`` with syncbn's all_reduce replaced by :func:`_identical_ranks` while it runs
    (the compiled custom ops look the function up at run time: no recompilation)."""

    def run(x: torch.Tensor) -> None:
        reduce = syncbn.distributed.all_reduce_sum_
        syncbn.distributed.all_reduce_sum_ = _identical_ranks
        try:
            step(x)
        finally:
            syncbn.distributed.all_reduce_sum_ = reduce

    return run


_point_library: torch.library.Library | None = None


def _define_point_ops() -> None:
    """``syncbn_bench::forward_point(x, forward_size, backward_size, index)``: all-reduce a
    float64 buffer of ``forward_size`` and return a 0-dim zero; its backward all-reduces one
    of ``backward_size`` (``syncbn_bench::backward_point``). ``index`` tells the layers
    apart: two backward points with equal arguments (the gradients of a residual sum's two
    branches) would be merged into one by the compiler's common-subexpression elimination.
    Defined like syncbn's ops (``torch.library.Library``, one implementation for every
    device), once per process."""
    global _point_library
    if _point_library is not None:
        return
    import torch.distributed as dist

    library = torch.library.Library("syncbn_bench", "DEF")
    library.define(
        "forward_point(Tensor x, int forward_size, int backward_size, int index) -> Tensor"
    )
    library.define("backward_point(Tensor grad, int size, int index) -> Tensor")

    def all_reduce_zeros(like: torch.Tensor, size: int) -> torch.Tensor:
        dist.all_reduce(torch.zeros(size, dtype=torch.float64, device=like.device))
        return like.new_zeros(())

    def forward_point(
        x: torch.Tensor, forward_size: int, backward_size: int, index: int
    ) -> torch.Tensor:
        return all_reduce_zeros(x, forward_size)

    def backward_point(grad: torch.Tensor, size: int, index: int) -> torch.Tensor:
        return all_reduce_zeros(grad, size)

    def fake(x: torch.Tensor, *sizes: int) -> torch.Tensor:
        return x.new_empty(())

    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        x, _, ctx.backward_size, ctx.index = inputs
        ctx.shape = x.shape

    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        zero = torch.ops.syncbn_bench.backward_point(grad, ctx.backward_size, ctx.index)
        return zero.expand(ctx.shape), None, None, None

    library.impl("forward_point", forward_point, "CompositeExplicitAutograd")
    library.impl("backward_point", backward_point, "CompositeExplicitAutograd")
    for name in ("forward_point", "backward_point"):
        torch.library.register_fake(f"syncbn_bench::{name}", fake, lib=library)
    torch.library.register_autograd(
        "syncbn_bench::forward_point", backward, setup_context=setup_context, lib=library
    )
    _point_library = library


class _CollectivePoint(nn.Module):
    """Adds to its input the 0-dim zero of ``syncbn_bench::forward_point`` with the sizes of
    syncbn's payloads for ``num_features`` channels (inductor fuses the addition)."""

    def __init__(self, num_features: int, index: int) -> None:
        super().__init__()
        self.arguments = (
            _protocol.forward_size(num_features),
            _protocol.backward_size(num_features),
            index,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.ops.syncbn_bench.forward_point(x, *self.arguments)


def _with_collective_points(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with a :class:`_CollectivePoint` after every BatchNorm layer."""
    _define_point_ops()
    model = copy.deepcopy(model)
    layers = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.BatchNorm2d)
    ]
    for index, (parent, name, child) in enumerate(layers):
        setattr(parent, name, nn.Sequential(child, _CollectivePoint(child.num_features, index)))
    return model


def _rank(rank: int, world_size: int, settings: Settings) -> dict[str, Any]:
    steps, device_type, cache_dir = settings.steps, settings.device_type, settings.cache_dir
    # a fresh cache: no compiled code and no remembered dynamic dimensions from earlier runs
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache_dir, f"rank{rank}")
    torch.set_num_threads(1)
    if settings.no_transport:
        # a one-rank sum is the buffer itself: skip the hand-off to gloo, keep the rest
        syncbn.distributed.all_reduce_sum_ = _no_transport
    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    torch.manual_seed(0)
    plain = SmallResNet().to(device)
    synced = syncbn.convert_sync_batchnorm(copy.deepcopy(plain))
    for module in synced.modules():
        if isinstance(module, syncbn.SyncBatchNorm):
            module._sync_alone = settings.sync_alone
    generator = torch.Generator().manual_seed(rank)

    def batch(size: int = settings.batch) -> torch.Tensor:
        return torch.randn(size, 3, 32, 32, generator=generator).to(device)

    variants: dict[str, _Variant] = {}
    sources: list[tuple[str, nn.Module, tuple[str, ...]]] = [
        ("batchnorm", plain, ("eager", "compiled")),
        ("syncbn", synced, ("eager", "compiled")),
    ]
    if world_size > 1 and not settings.no_transport:
        control = _with_collective_points(plain)
        sources.append(("batchnorm", control, ("compiled + all_reduces",)))
    for name, source, modes in sources:
        for mode in modes:
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
            variants[f"{name} {mode}"] = _Variant(step, counter, first)
    if world_size > 1 and not settings.no_transport:
        for mode in ("eager", "compiled"):
            variant = variants[f"syncbn {mode}"]
            step = _without_transport(variant.step)
            for _ in range(3):
                step(batch())
            variants[f"syncbn {mode}, no transport"] = _Variant(step, variant.counter, 0.0)
    # the variants take turns, ROUNDS times: a slow spell of the machine then hits
    # them all, and the best round of each is kept
    for _ in range(ROUNDS):
        for variant in variants.values():
            times = []
            for _ in range(steps):
                x = batch()
                _sync(device)
                start = time.perf_counter()
                variant.step(x)
                _sync(device)
                times.append(time.perf_counter() - start)
            variant.rounds.append(times)
    results: dict[str, Any] = {}
    for key, variant in variants.items():
        times = min(variant.rounds, key=statistics.median)
        median = statistics.median(times)
        entry = {"median_ms": median * 1e3, "p10_ms": _quantile(times, 0.1) * 1e3}
        if key.endswith("compiled"):  # (not its no-transport twin: the same code)
            entry["compile_s"] = variant.first_s - median
            graphs_before = variant.counter.graphs
            for size in SIZES[rank % 2]:
                variant.step(batch(size))
            entry["graphs_first_shape"] = graphs_before
            entry["graphs_varying_batch"] = variant.counter.graphs
        results[key] = entry
    results["collectives floor"] = {"median_ms": _collectives_floor_ms(synced, device)}
    return results


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _slowest(results: list[dict[str, Any]], key: str) -> dict[str, Any]:
    """The entry ``key`` of the rank whose median step was the slowest."""
    entries = [result[key] for result in results]
    return max(entries, key=lambda entry: float(entry["median_ms"]))


def _targets(worst: dict[str, dict[str, Any]], args: argparse.Namespace) -> list[str]:
    """The targets of issue 20 that this run measures, each with its verdict."""
    compiled = worst["syncbn compiled"]["median_ms"]
    eager = worst["syncbn eager"]["median_ms"]
    plain = worst["batchnorm compiled"]["median_ms"]
    floor = worst["collectives floor"]["median_ms"]

    def verdict(ok: bool) -> str:
        return "met" if ok else "**missed**"

    if args.world_size == 1:
        rows = [
            (
                "compiled syncbn <= 1.15x compiled BatchNorm",
                f"{compiled / plain:.2f}x",
                compiled <= 1.15 * plain,
            ),
            (
                "compiled syncbn <= 0.85x eager syncbn",
                f"{compiled / eager:.2f}x",
                compiled <= 0.85 * eager,
            ),
        ]
    else:
        bound = plain + 1.2 * floor
        rows = [
            (
                "compiled syncbn <= compiled BatchNorm + 1.2 x collectives floor",
                f"{compiled:.1f} ms vs {plain:.1f} + 1.2 x {floor:.1f} = {bound:.1f} ms",
                compiled <= bound,
            ),
            (
                "compiled syncbn never slower than eager syncbn",
                f"{compiled:.1f} ms vs {eager:.1f} ms",
                compiled <= eager,
            ),
        ]
    lines = ["", "| target | measured | verdict |", "|---|---|---|"]
    lines += [f"| {name} | {value} | {verdict(ok)} |" for name, value, ok in rows]
    return lines


def _in_place(worst: dict[str, dict[str, Any]], floor: float) -> list[str]:
    """What the collectives cost in place: in the control (compiled BatchNorm with the same
    all_reduces), and in each syncbn step against its no-transport twin."""
    lines = []
    control = worst.get("batchnorm compiled + all_reduces")
    if control is not None:
        cost = control["median_ms"] - worst["batchnorm compiled"]["median_ms"]
        ratio = worst["syncbn compiled"]["median_ms"] / control["median_ms"]
        lines.append(
            f"Compiled BatchNorm with the same 30 all_reduces in place takes "
            f"{control['median_ms']:.1f} ms: in place they add {cost:.1f} ms "
            f"({cost / floor:.2f}x the floor), with no synchronized BatchNorm's maths; "
            f"compiled syncbn takes {ratio:.2f}x this control."
        )
    for mode in ("compiled", "eager"):
        twin = worst.get(f"syncbn {mode}, no transport")
        if twin is None:
            continue
        cost = worst[f"syncbn {mode}"]["median_ms"] - twin["median_ms"]
        lines.append(
            f"In place, the 30 all_reduces add {cost:.1f} ms to the {mode} syncbn step "
            f"({cost / floor:.2f}x the floor), its no-transport twin {twin['median_ms']:.1f} ms "
            f"being {twin['median_ms'] - worst[f'batchnorm {mode}']['median_ms']:.1f} ms over "
            f"{mode} BatchNorm."
        )
    return ["", " ".join(lines)] if lines else []


def _out_option(out: Path) -> str:
    """The ``--out`` option that wrote ``out``, for the results' "Generated by" line: none
    for the default file, a path from the repository's root for a file inside it (the
    committed variants), else the path as given. (It used to read ``benchmarks/NAME``
    whatever the path: for a file elsewhere, a file that was never written.)"""
    resolved = out.resolve()
    if resolved == (HERE / "compile.md").resolve():
        return ""
    root = HERE.resolve().parent
    shown = resolved.relative_to(root) if root in resolved.parents else out
    return f"--out {shown}"


def _render(results: list[dict[str, Any]], info: dict[str, Any], args: argparse.Namespace) -> str:
    options = []
    if args.device == "cuda":
        options.append("--device cuda")
    if args.world_size != 2:
        options.append(f"--world-size {args.world_size}")
    if args.sync_alone:
        options.append("--sync-alone")
    if args.no_transport:
        options.append("--no-transport")
    if args.batch != BATCH:
        options.append(f"--batch {args.batch}")
    out_option = _out_option(args.out)
    if out_option:
        options.append(out_option)
    command_options = "".join(f" {option}" for option in options)
    # glibc's allocator settings change this VM's page faults, and so the timings
    allocator = [f"{key}={os.environ[key]}" for key in MALLOC_KEYS if key in os.environ]
    command_prefix = "".join(f"{setting} " for setting in allocator)
    sync = " with the synchronized path forced (`_sync_alone`)" if args.sync_alone else ""
    if args.no_transport:
        sync += ", syncbn's all_reduce returning its buffer (no transport)"
    lines = [
        "# torch.compile(fullgraph=True): SyncBatchNorm against BatchNorm, per training step",
        "",
        f"Generated by `{command_prefix}python benchmarks/compile.py{command_options}`"
        f" on {info['date']}; torch {info['torch']}; {info['cuda'] or info['cpu']}; "
        f"{args.world_size} rank(s) ({'nccl' if args.device == 'cuda' else 'gloo'}){sync}, "
        f"one thread each; SmallResNet (15 BatchNorm2d), batch {args.batch} per rank, 32x32, "
        f"float32, SGD; no DDP. Median (p10) over {args.steps} steps after 3 warm-up steps, "
        f"the best of {ROUNDS} rounds in which the variants take turns, worst rank. "
        "Each rank compiles into an empty inductor cache. Load average at the end: "
        f"{info.get('load_average', '?')}.",
        "",
        "| variant | step ms, median (p10) | vs batchnorm of the same mode | compile s | "
        "graphs: first shape / after 5 more batch sizes |",
        "|---|---|---|---|---|",
    ]
    worst = {key: _slowest(results, key) for key in results[0]}
    for key, entry in worst.items():
        if key == "collectives floor":
            continue
        mode = "compiled" if "compiled" in key else "eager"
        ratio = entry["median_ms"] / worst[f"batchnorm {mode}"]["median_ms"]
        compile_s = "-"
        if "compile_s" in entry:
            compile_s = f"{max(r[key]['compile_s'] for r in results):.1f}"
        graphs = "-"
        if "graphs_first_shape" in entry:
            varying = max(r[key]["graphs_varying_batch"] for r in results)
            graphs = f"{entry['graphs_first_shape']} / {varying}"
        lines.append(
            f"| {key} | {entry['median_ms']:.1f} ({entry['p10_ms']:.1f}) | {ratio:.2f}x | "
            f"{compile_s} | {graphs} |"
        )
    floor = worst["collectives floor"]["median_ms"]
    lines.append(
        f"\nCollectives floor (the all_reduces of syncbn's 30 payloads per step, back to back, "
        f"worst rank): {floor:.2f} ms."
    )
    lines += _in_place(worst, floor)
    lines += _targets(worst, args)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--batch", type=int, default=BATCH, help="local batch size")
    parser.add_argument(
        "--sync-alone",
        action="store_true",
        help="force the synchronized path at world size 1 (syncbn's compute alone)",
    )
    parser.add_argument(
        "--no-transport",
        action="store_true",
        help="with --sync-alone at world size 1: syncbn's all_reduce returns its buffer",
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--out", type=Path, default=HERE / "compile.md")
    args = parser.parse_args(argv)
    if args.no_transport and not (args.sync_alone and args.world_size == 1):
        parser.error("--no-transport needs --sync-alone and --world-size 1")
    backend = "nccl" if args.device == "cuda" else "gloo"
    with tempfile.TemporaryDirectory(prefix="syncbn-compile-cache-") as cache_dir:
        settings = Settings(
            args.steps, args.device, cache_dir, args.batch, args.sync_alone, args.no_transport
        )
        # each rank recompiles for a new batch size at its own step (SIZES differ by rank)
        # while the other waits for it in a collective: a compile can outlast the default
        # 60 s process-group timeout on 2 cores (it did once)
        results = run_on_ranks(
            _rank, args.world_size, settings, backend=backend, timeout=1200, pg_timeout=900
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
