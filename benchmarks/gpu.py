"""GPU benchmarks: syncbn against cuDNN BatchNorm and torch.nn.SyncBatchNorm, eager and graphed.

Needs a CUDA GPU (and torchvision for the resnet50 step). Writes ``gpu.md`` and ``gpu.json``
beside this file (or into ``--out``) after every part; a part that fails is recorded as an
error and the others still run (exit code 1 then). The ``layers`` and ``masked`` parts write
each row as they measure it, so that one cut short by ``--timeout`` (or a crash) keeps the
rows measured before, marked "cut short". Five parts, each in its own processes:

- ``layers``: forward+backward of one layer at the BatchNorm shapes of ResNet-50 at batch
  32, float32 / bfloat16 / float16 input (float32 parameters), NCHW and channels_last. Device
  time per call (CUDA events, median), host time per call (the launch, without waiting),
  and host synchronizations per call (``torch.cuda.set_sync_debug_mode("warn")`` warnings).
  syncbn runs three times: on its generic kernels, on ``syncbn._kernels.cuda`` (torch's fused
  SyncBatchNorm element kernels, float32 rows only), and with ``syncbn._kernels.finalize``
  (a deferred call's checks, per-channel maths and packing in Triton kernels), to decide
  what the CUDA path keeps.
- ``step``: a torchvision resnet50 training step (batch 32, bfloat16 autocast,
  channels_last, SGD), eager and captured whole in one CUDA graph, with host syncs per step;
  syncbn with and without ``syncbn._kernels.finalize``.
- ``ranks``: the per-layer comparison with 2 ranks sharing the GPU through gloo (CUDA
  tensors; nccl refuses two ranks on one GPU).
- ``compile``: the same resnet50 step under ``torch.compile(fullgraph=True)``, modes
  ``default`` and ``reduce-overhead``, syncbn against cuDNN BatchNorm (issue 20's target:
  at most 1.1x); torch.nn.SyncBatchNorm is left out (it breaks the graph).
- ``masked``: forward+backward of a masked call (80 % of the positions valid) against an
  unmasked one, eager, on syncbn's generic and fused kernels and with
  ``syncbn._kernels.finalize`` (the Triton candidate), float32 and bfloat16, at
  three ResNet-50 shapes and a Conformer-style ``(32, 256, 400)`` (issue 21's target: at
  most 1.3x).

The single-process parts use an nccl group of one rank, where both synchronized layers
would fall back to BatchNorm; their sync paths are forced (``SyncBatchNorm._sync_alone`` for
syncbn; torch's ``SyncBatchNorm`` autograd function called with ``world_size=1``), so that
what is timed is the synchronized code without the transport.

Usage::

    python benchmarks/gpu.py                     # all parts, ~5 min on an H100
    python benchmarks/gpu.py --parts layers step --quick
    python benchmarks/gpu.py --parts step --out gpu-results/step  # one part, its own folder
    bash .ci/gpu bench gpu-results                # every part, each into its own folder
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import syncbn
from syncbn import _kernels
from syncbn._cli.launch import run_on_ranks
from syncbn._cli.measure import count_host_syncs, machine_info

__all__ = ["main"]

HERE = Path(__file__).parent
# (channels, spatial size) of ResNet-50's BatchNorm layers at 224x224
RESNET50_SHAPES = [(64, 112), (64, 56), (256, 56), (128, 28), (512, 28), (256, 14), (1024, 14)]
RESNET50_SHAPES += [(512, 7), (2048, 7)]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class _TorchSyncPath(nn.SyncBatchNorm):
    """torch.nn.SyncBatchNorm with its synchronized path forced, whatever the world size."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        from torch.nn.modules._functions import SyncBatchNorm as TorchSyncFunction

        assert self.num_batches_tracked is not None
        self.num_batches_tracked.add_(1)
        factor = 0.0 if self.momentum is None else self.momentum
        group = self.process_group or dist.group.WORLD
        return TorchSyncFunction.apply(  # type: ignore[no-any-return]
            input,
            self.weight,
            self.bias,
            self.running_mean,
            self.running_var,
            self.eps,
            factor,
            group,
            dist.get_world_size(group),
        )


#: the layers timed per shape: cuDNN BatchNorm, torch.nn.SyncBatchNorm, syncbn on its generic
#: kernels, on its fused CUDA kernels, with its per-channel maths in Triton kernels
#: (syncbn._kernels.finalize) and the generic passes, and with Triton's passes too
LAYER_KINDS = (
    "cudnn",
    "torch-sync",
    "syncbn",
    "syncbn-fused",
    "syncbn-finalize-generic-passes",
    "syncbn-finalize",
)
#: the candidates compared with syncbn's generic kernels, per layer
CANDIDATES = LAYER_KINDS[3:]


def _layer(kind: str, channels: int, group: Any) -> nn.Module:
    if kind == "cudnn":
        return nn.BatchNorm2d(channels)
    if kind == "torch-sync":
        return _TorchSyncPath(channels, process_group=group)
    layer = syncbn.SyncBatchNorm(channels, process_group=group)
    layer._sync_alone = True
    return layer


def _convert(model: nn.Module, kind: str, group: Any) -> nn.Module:
    if kind == "cudnn":
        return model
    if kind == "torch-sync":
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model, group)
        for module in model.modules():
            if type(module) is nn.SyncBatchNorm:
                module.__class__ = _TorchSyncPath
        return model
    model = syncbn.convert_sync_batchnorm(model, group)
    for module in model.modules():
        if isinstance(module, syncbn.SyncBatchNorm):
            module._sync_alone = True
    return model


def _time(fn: Callable[[], object], iterations: int) -> dict[str, float]:
    """Median device time (CUDA events) and host time per call of ``fn``."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    device_ms, host_ms = [], []
    for _ in range(iterations):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        host_start = time.perf_counter()
        fn()
        host_ms.append((time.perf_counter() - host_start) * 1e3)
        end.record()
        end.synchronize()
        device_ms.append(start.elapsed_time(end))
    return {"device_ms": statistics.median(device_ms), "host_ms": statistics.median(host_ms)}


def captured(fn: Callable[[], object], calls: int = 1) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``calls`` calls of ``fn``, captured after 3 warm-up calls on a side
    stream (torch's recipe: what the calls allocate and initialize once happens outside
    the capture)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph


def _layer_cases(quick: bool) -> list[tuple[int, int, str, bool]]:
    shapes = RESNET50_SHAPES[::3] if quick else RESNET50_SHAPES
    return [
        (channels, size, dtype, channels_last)
        for channels, size in shapes
        for dtype in DTYPES
        for channels_last in (False, True)
    ]


def _keep_row(rows: list[dict[str, Any]], row: dict[str, Any], rows_file: str | None) -> None:
    """Append ``row`` to ``rows``, and as a line of JSON to ``rows_file`` where one is given:
    what a part cut short keeps (:func:`_rows_so_far`)."""
    rows.append(row)
    if rows_file is not None:
        with open(rows_file, "a") as file:
            file.write(json.dumps(row) + "\n")


def _rows_so_far(rows_file: Path) -> list[dict[str, Any]]:
    """The rows that :func:`_keep_row` wrote to ``rows_file``, up to a last line cut short
    (a rank killed while writing it)."""
    if not rows_file.exists():
        return []
    rows: list[dict[str, Any]] = []
    for line in rows_file.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return rows


def _layers_rank(
    rank: int, world_size: int, quick: bool, alone: bool, rows_file: str | None = None
) -> list[dict[str, Any]]:
    torch.cuda.set_device(0)
    group = dist.new_group([rank], backend="nccl") if alone else None
    if alone and world_size > 1:
        raise ValueError("the single-process part runs on one rank")
    rows: list[dict[str, Any]] = []
    for channels, size, dtype, channels_last in _layer_cases(quick):
        x = torch.randn(32, channels, size, size, device="cuda", dtype=DTYPES[dtype])
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        x.requires_grad_()
        dy = torch.randn_like(x)
        row: dict[str, Any] = {
            "shape": f"32x{channels}x{size}x{size}",
            "dtype": dtype,
            "channels_last": channels_last,
        }
        for kind in LAYER_KINDS:
            if kind == "cudnn" and not alone:
                continue  # the 2-rank part compares the synchronized layers
            layer = _layer(kind, channels, group).cuda()

            def call(layer: nn.Module = layer, x: torch.Tensor = x, dy: torch.Tensor = dy) -> None:
                torch.autograd.grad(layer(x), (x, *layer.parameters()), dy)

            def measure(call: Callable[[], None] = call) -> dict[str, Any]:
                return _time(call, 20 if quick else 50) | {"syncs": count_host_syncs(call)}

            row[kind] = _measured_with(kind, measure)
        _keep_row(rows, row, rows_file)
    return rows


def _measured_with(kind: str, measure: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``measure()`` with the kernels of ``kind`` on for CUDA, switched off after it.

    ``"syncbn-fused"``: syncbn._kernels.cuda (float32 rows; lower precision keeps the
    generic passes); ``"syncbn-finalize"``: syncbn._kernels.finalize (deferred calls:
    Triton kernels for the per-channel maths, and for the passes over the data:
    syncbn._kernels.triton_passes), ``"syncbn-finalize-generic-passes"`` the same with the
    generic kernels' passes; a Triton kind's failure (no Triton, a compilation) is a
    result, recorded as ``{"error": ...}``; candidates until measured faster. Any other
    kind: the generic kernels.
    """
    _kernels.use_device_kernels("cuda", enabled=kind == "syncbn-fused")
    triton_kind = kind.startswith("syncbn-finalize")
    try:
        passes = kind == "syncbn-finalize"
        _kernels.use_fused_finalize("cuda", enabled=triton_kind, triton_passes=passes)
        return measure()
    except Exception as error:  # noqa: BLE001 - the Triton candidate's failure is a result
        if not triton_kind:
            raise
        return {"error": f"{type(error).__name__}: {str(error)[:200]}"}
    finally:
        _kernels.use_device_kernels("cuda", enabled=False)
        _kernels.use_fused_finalize("cuda", enabled=False)


def _resnet50_batch() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """torchvision's resnet50 (seeded, on the CPU) and a channels_last batch of 32 on the GPU."""
    import torchvision

    torch.manual_seed(0)
    base = torchvision.models.resnet50()
    x = torch.randn(32, 3, 224, 224, device="cuda").contiguous(memory_format=torch.channels_last)
    return base, x, torch.randint(1000, (32,), device="cuda")


def _training_step(
    model: nn.Module,
    run: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    target: Any,
    set_to_none: bool = False,
) -> Callable[[], None]:
    """One SGD step of ``model`` (called as ``run``) under bfloat16 autocast.

    Its gradients are zeroed in place (a whole step captured in one CUDA graph needs them
    at fixed addresses), or with ``set_to_none`` dropped: a step compiled with
    ``mode="reduce-overhead"`` gets its gradients in CUDA graph trees' memory, which the
    next step's graphs overwrite, so that zeroing or adding to them there fails ("accessing
    tensor output of CUDAGraphs that has been overwritten", pytorch/pytorch#169545).
    """
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = nn.functional.cross_entropy(run(x), target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=set_to_none)

    return step


def _on_gpu(model: nn.Module, kind: str, group: Any) -> nn.Module:
    model = _convert(model, kind, group).cuda()
    return model.to(memory_format=torch.channels_last)  # type: ignore[call-overload,no-any-return]


def _step_rank(rank: int, world_size: int, quick: bool) -> dict[str, Any]:
    torch.cuda.set_device(0)
    group = dist.new_group([rank], backend="nccl")
    base, x, target = _resnet50_batch()
    results: dict[str, Any] = {}
    for kind in ("cudnn", "torch-sync", "syncbn", "syncbn-finalize"):
        model = _on_gpu(copy.deepcopy(base), kind, group)
        step = _training_step(model, model, x, target)
        try:
            # "syncbn-finalize": deferred calls with syncbn._kernels.finalize (a candidate)
            _kernels.use_fused_finalize("cuda", enabled=kind == "syncbn-finalize")
            eager = _time(step, 10 if quick else 30) | {"syncs": count_host_syncs(step)}
        except Exception as error:  # noqa: BLE001 - the Triton candidate's failure is a result
            if kind != "syncbn-finalize":
                raise
            message = f"{type(error).__name__}: {str(error)[:200]}"
            results[kind] = {"eager": {"error": message}, "graph": {"error": message}}
            continue
        graphed: dict[str, Any]
        try:
            graphed = _time(captured(step).replay, 10 if quick else 30)
        except Exception as error:  # noqa: BLE001 - recorded: torch's SyncBatchNorm cannot be captured
            graphed = {"error": f"{type(error).__name__}: {str(error)[:200]}"}
        results[kind] = {"eager": eager, "graph": graphed}
    _kernels.use_fused_finalize("cuda", enabled=False)
    return results


#: ``(N, C, *positions)`` of the masked part, and the share of valid positions in its masks
MASKED_SHAPES = [(32, 64, 112, 112), (32, 512, 28, 28), (32, 2048, 7, 7), (32, 256, 400)]
MASKED_VALID = 0.8
MASKED_DTYPES = ("float32", "bfloat16")
#: the masked part's kernel sets (see :func:`_masked_rows`)
MASKED_KERNELS = ("syncbn", "syncbn-fused", "syncbn-finalize-generic-passes", "syncbn-finalize")


def _masked_rows(
    make_layer: Callable[[int], nn.Module],
    device: torch.device,
    shapes: list[tuple[int, ...]],
    timer: Callable[[Callable[[], object]], dict[str, float]],
    rows_file: str | None = None,
) -> list[dict[str, Any]]:
    """Per shape and dtype, ``timer``'s numbers for an unmasked and a masked call of a
    synchronized layer, on the generic kernels (``syncbn``), the fused ones
    (``syncbn-fused``; they apply to CUDA tensors only) and with the Triton candidate
    (``syncbn-finalize``: deferred calls' per-channel maths and passes over the data;
    ``syncbn-finalize-generic-passes``: with the generic kernels' passes), whose failure
    (no Triton, a compilation) is recorded in its cells."""
    rows: list[dict[str, Any]] = []
    for shape in shapes:
        for dtype in MASKED_DTYPES:
            x = torch.randn(shape, device=device, dtype=DTYPES[dtype]).requires_grad_()
            dy = torch.randn_like(x)
            mask = torch.rand((shape[0], *shape[2:]), device=device) < MASKED_VALID
            row: dict[str, Any] = {"shape": "x".join(map(str, shape)), "dtype": dtype}
            for kernels in MASKED_KERNELS:
                layer = make_layer(shape[1]).to(device)
                for name, call_mask in (("unmasked", None), ("masked", mask)):

                    def call(
                        layer: nn.Module = layer,
                        call_mask: torch.Tensor | None = call_mask,
                        x: torch.Tensor = x,
                        dy: torch.Tensor = dy,
                    ) -> None:
                        y = layer(x, call_mask)
                        torch.autograd.grad(y, (x, *layer.parameters()), dy)

                    row[f"{kernels} {name}"] = _measured_with(kernels, lambda: timer(call))
            _keep_row(rows, row, rows_file)
    return rows


def _masked_rank(
    rank: int, world_size: int, quick: bool, rows_file: str | None = None
) -> list[dict[str, Any]]:
    torch.cuda.set_device(0)
    group = dist.new_group([rank], backend="nccl")
    shapes = MASKED_SHAPES[1:] if quick else MASKED_SHAPES
    iterations = 20 if quick else 50

    def timer(call: Callable[[], object]) -> dict[str, float]:
        return _time(call, iterations)

    return _masked_rows(
        lambda channels: _layer("syncbn", channels, group),
        torch.device("cuda"),
        shapes,
        timer,
        rows_file,
    )


COMPILE_MODES = ("default", "reduce-overhead")


def _compiled_step_rank(rank: int, world_size: int, quick: bool, kind: str, mode: str) -> Any:
    """The resnet50 step compiled (fullgraph) with ``kind`` layers in ``mode``, with its
    compile time."""
    torch.cuda.set_device(0)
    group = dist.new_group([rank], backend="nccl")
    base, x, target = _resnet50_batch()
    model = _on_gpu(base, kind, group)
    compiled = torch.compile(model, fullgraph=True, mode=mode)
    train_step = _training_step(model, compiled, x, target, set_to_none=True)

    def step() -> None:
        # each step a new generation of cudagraph trees, as torch advises for training
        # loops: without it, "reduce-overhead" failed for cuDNN BatchNorm and syncbn alike
        # on 2026-12-04 ("accessing tensor output of CUDAGraphs that has been overwritten")
        torch.compiler.cudagraph_mark_step_begin()
        train_step()

    start = time.perf_counter()
    step()
    torch.cuda.synchronize()
    first_s = time.perf_counter() - start
    entry = _time(step, 10 if quick else 30)
    # the first step, less what a compiled step takes on the device; and the host syncs of
    # one compiled step (its ops' bodies run per layer: a read back in one of them, a site
    # tensor read on the host say, would cost a wait per layer and direction)
    compile_s = first_s - entry["device_ms"] / 1e3
    return entry | {"compile_s": compile_s, "syncs": count_host_syncs(step)}


def _compiled_steps(quick: bool, timeout: float) -> dict[str, Any]:
    """Each (mode, kind) in its own process, mode by mode (so that what a cut-short part
    keeps compares both kinds), within ``timeout`` seconds in all."""
    deadline = time.monotonic() + timeout
    results: dict[str, Any] = {}
    for mode in COMPILE_MODES:
        for kind in ("cudnn", "syncbn"):
            left = deadline - time.monotonic()
            if left < 60:
                results[f"{kind} {mode}"] = {"error": "not run: the part's time was up"}
                continue
            try:
                results[f"{kind} {mode}"] = run_on_ranks(
                    _compiled_step_rank, 1, quick, kind, mode, timeout=left
                )[0]
            except Exception as error:  # noqa: BLE001 - recorded, the other variants still run
                results[f"{kind} {mode}"] = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
    return results


PARTS = ("layers", "step", "ranks", "compile", "masked")


def _render(results: dict[str, Any]) -> str:
    info = results["machine"]
    lines = [
        "# GPU: syncbn against cuDNN BatchNorm and torch.nn.SyncBatchNorm",
        "",
        f"Generated by `python benchmarks/gpu.py` on {info['date']}; {info['cuda']}; torch "
        f"{info['torch']}. Sync paths forced at nccl world size 1 (see the script).",
        "",
    ]
    for part in PARTS:
        if isinstance(results.get(part), dict) and "error" in results[part]:
            lines += [f"## {part}: failed", "", f"    {results[part]['error']}", ""]
        elif f"{part} cut short" in results:
            note = f"## {part}: cut short; the rows it measured before are in its table below"
            lines += [note, "", f"    {results[f'{part} cut short']}", ""]
    if "layers" in results and "error" not in results["layers"]:
        lines += [
            "## Per layer, forward+backward, batch 32 (device ms / host ms / syncs per call)",
            "",
            "| shape | dtype | layout | cuDNN BN | torch SyncBN | syncbn | syncbn fused | "
            "syncbn finalize, generic passes | syncbn finalize | syncbn / BN | syncbn / torch "
            "| fused / generic | finalize, generic passes / generic | finalize / generic |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for row in results["layers"]:
            # (results of runs before a kind existed show "-" for it)
            cells = [_layer_cell(row.get(k)) for k in LAYER_KINDS]
            ours = row["syncbn"]["device_ms"]
            ratios = [
                f"{ours / row['cudnn']['device_ms']:.2f}x",
                f"{ours / row['torch-sync']['device_ms']:.2f}x",
                *(
                    f"{row[k]['device_ms'] / ours:.2f}x" if "device_ms" in row.get(k, {}) else "-"
                    for k in CANDIDATES
                ),
            ]
            lines.append(
                f"| {row['shape']} | {row['dtype']} | "
                f"{'channels_last' if row['channels_last'] else 'NCHW'} | {' | '.join(cells)} | "
                f"{' | '.join(ratios)} |"
            )
        lines.append("")
    if "step" in results and "error" not in results["step"]:
        lines += [
            "## resnet50 training step (batch 32, bf16 autocast, channels_last, SGD)",
            "",
            "| layers | eager ms (device) | host syncs per step | CUDA graph ms |",
            "|---|---|---|---|",
        ]
        for kind, entry in results["step"].items():
            eager, graph = entry["eager"], entry["graph"]
            if "error" in eager:
                lines.append(f"| {kind} | {eager['error']} | | |")
                continue
            graph_text = graph["error"] if "error" in graph else f"{graph['device_ms']:.2f}"
            lines.append(f"| {kind} | {eager['device_ms']:.2f} | {eager['syncs']} | {graph_text} |")
        lines.append("")
    if "ranks" in results and "error" not in results["ranks"]:
        lines += [
            "## 2 ranks on one GPU through gloo (device ms per call, worst rank)",
            "",
            "| shape | dtype | layout | torch SyncBN | syncbn | syncbn fused | syncbn finalize, "
            "generic passes | syncbn finalize |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for row0, row1 in zip(*results["ranks"]):
            cells = [
                f"{max(row0[k]['device_ms'], row1[k]['device_ms']):.3f}"
                if "device_ms" in row0.get(k, {}) and "device_ms" in row1.get(k, {})
                else _layer_cell(row0.get(k))
                for k in LAYER_KINDS[1:]
            ]
            layout = "channels_last" if row0["channels_last"] else "NCHW"
            lines.append(f"| {row0['shape']} | {row0['dtype']} | {layout} | {' | '.join(cells)} |")
        lines.append("")
    if "compile" in results and "error" not in results["compile"]:
        lines += _render_compiled(results["compile"])
    if "masked" in results and "error" not in results["masked"]:
        lines += _render_masked(results["masked"])
    return "\n".join(lines) + "\n"


def _layer_cell(entry: dict[str, Any] | None) -> str:
    """One layer's ``device / host / syncs`` cell; its error, or "-" where a run before the
    kind existed has none."""
    if entry is None:
        return "-"
    if "error" in entry:
        return str(entry["error"])
    return f"{entry['device_ms']:.3f} / {entry['host_ms']:.3f} / {entry['syncs']}"


def _render_or_say_why(results: dict[str, Any]) -> str:
    """:func:`_render`, or why it failed: a table that cannot be drawn must not stop the
    parts still to run (their numbers are in gpu.json either way)."""
    try:
        return _render(results)
    except Exception as error:  # noqa: BLE001 - reported in place of the tables
        return (
            f"# GPU results\n\nRendering failed ({type(error).__name__}: {error}); see gpu.json.\n"
        )


def _render_masked(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        f"## Masked calls ({int(MASKED_VALID * 100)} % valid) against unmasked ones, "
        "forward+backward, eager (device ms per call; target: masked <= 1.3x unmasked)",
        "",
        "| shape | dtype | generic unmasked | generic masked | ratio | fused unmasked "
        "| fused masked | ratio | finalize, generic passes unmasked | masked | ratio "
        "| finalize, Triton passes unmasked | masked | ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        cells = []
        for kernels in MASKED_KERNELS:
            timed = row.get(f"{kernels} unmasked"), row.get(f"{kernels} masked")
            if any(t is None or "error" in t for t in timed):
                failure = next((t["error"] for t in timed if t and "error" in t), "not run")
                cells += ["-", "-", f"failed: {failure}"]
                continue
            unmasked, masked = (t["device_ms"] for t in timed)  # type: ignore[index]
            verdict = "met" if masked <= 1.3 * unmasked else "**missed**"
            cells += [f"{unmasked:.3f}", f"{masked:.3f}", f"{masked / unmasked:.2f}x {verdict}"]
        lines.append(f"| {row['shape']} | {row['dtype']} | {' | '.join(cells)} |")
    return [*lines, ""]


def _render_compiled(entries: dict[str, Any]) -> list[str]:
    lines = [
        "## resnet50 step under torch.compile(fullgraph=True) (bf16 autocast, channels_last)",
        "",
        "| layers | mode | device ms | host ms | host syncs per step | compile s "
        "| vs compiled BN (target <= 1.1x) |",
        "|---|---|---|---|---|---|---|",
    ]
    for mode in COMPILE_MODES:
        for kind in ("cudnn", "syncbn"):
            entry, reference = entries[f"{kind} {mode}"], entries[f"cudnn {mode}"]
            if "error" in entry:
                lines.append(f"| {kind} | {mode} | {entry['error']} | | | | |")
                continue
            ratio = (
                f"{entry['device_ms'] / reference['device_ms']:.2f}x"
                if "error" not in reference
                else "-"
            )
            lines.append(
                f"| {kind} | {mode} | {entry['device_ms']:.2f} | {entry['host_ms']:.2f} | "
                f"{entry.get('syncs', '-')} | {entry['compile_s']:.0f} | {ratio} |"
            )
    return [*lines, ""]


def _run_part(part: str, quick: bool, timeout: float, rows_file: str | None = None) -> Any:
    """One part's results; ``layers`` and ``masked`` also write each row to ``rows_file`` as
    they measure it (see :func:`_keep_row`)."""
    if part == "layers":
        return run_on_ranks(_layers_rank, 1, quick, True, rows_file, timeout=timeout)[0]
    if part == "step":
        return run_on_ranks(_step_rank, 1, quick, timeout=timeout)[0]
    if part == "compile":
        return _compiled_steps(quick, timeout)
    if part == "masked":
        return run_on_ranks(_masked_rank, 1, quick, rows_file, timeout=timeout)[0]
    return run_on_ranks(_layers_rank, 2, True, False, timeout=timeout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--parts", nargs="+", choices=PARTS, default=list(PARTS), help="what to measure"
    )
    parser.add_argument("--quick", action="store_true", help="fewer shapes and iterations")
    parser.add_argument(
        "--out", type=Path, default=HERE, help="folder for gpu.json and gpu.md (default: here)"
    )
    parser.add_argument(
        "--timeout", type=float, default=500.0, help="seconds per part (default: 500)"
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"machine": machine_info()}
    for part in args.parts:
        rows_file = args.out / f"{part}-rows.jsonl"
        rows_file.unlink(missing_ok=True)
        # one part's failure (a missing torchvision, a crash) keeps the others' numbers
        try:
            results[part] = _run_part(part, args.quick, args.timeout, str(rows_file))
        except Exception as error:  # noqa: BLE001 - recorded in the results and reported
            message = f"{type(error).__name__}: {str(error)[:500]}"
            rows = _rows_so_far(rows_file)
            if rows:  # cut short (its time was up, a crash): the rows measured before
                results[part] = rows
                results[f"{part} cut short"] = message
            else:
                results[part] = {"error": message}
        finally:
            rows_file.unlink(missing_ok=True)
        # written after every part, so that a run cut short keeps what it measured
        (args.out / "gpu.json").write_text(json.dumps(results, indent=1) + "\n")
        (args.out / "gpu.md").write_text(_render_or_say_why(results))
    print(_render_or_say_why(results))
    failed = [part for part in args.parts if "error" in results[part]]
    return 1 if failed or any(f"{part} cut short" in results for part in args.parts) else 0


if __name__ == "__main__":
    raise SystemExit(main())
