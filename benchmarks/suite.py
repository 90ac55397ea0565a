"""What every benchmark rank runs; ``run.py`` spawns the ranks and writes the results.

Every function here named ``*_rank`` is called as ``fn(rank, world_size, settings)`` on
all ranks at once (see :func:`syncbn._cli.launch.run_on_ranks`) and returns plain Python
data (numbers, strings, lists, dicts) that ``run.py`` stores as JSON.
"""

from __future__ import annotations

import copy
import inspect
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from reference_syncbn import ReferenceSyncBatchNorm
from resnet import SmallResNet
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.parallel import DistributedDataParallel
from torch.profiler import ProfilerActivity, profile, record_function

import syncbn
from syncbn._cli.measure import (
    count_collectives,
    layer_callables,
    layer_collectives,
    measure,
    replay_callable,
    synchronize,
    torch_batchnorm,
)

__all__ = [
    "cases",
    "collectives_rank",
    "layers_rank",
    "memory_rank",
    "model_rank",
    "profile_rank",
]

SHAPES = ((2, 64, 56, 56), (8, 256, 14, 14), (4, 64, 112, 112), (32, 512, 7, 7), (16, 1024))
SHAPES_5D = ((2, 32, 8, 28, 28),)
DTYPES = ("float32", "bfloat16")

# What torch.nn.SyncBatchNorm accepts (torch 2.x raises a ValueError for other devices).
_TORCH_SYNCBN_DEVICES = ("cuda", "hpu", "xpu")


def cases(
    shapes: tuple[tuple[int, ...], ...] = SHAPES + SHAPES_5D, dtypes: tuple[str, ...] = DTYPES
) -> list[dict[str, Any]]:
    """Every (shape, dtype, memory format) case: channels_last only for 4-D and 5-D shapes."""
    result = []
    for dtype in dtypes:
        for shape in shapes:
            formats = ["contiguous"] + (["channels_last"] if len(shape) in (4, 5) else [])
            for fmt in formats:
                result.append({"shape": list(shape), "dtype": dtype, "memory_format": fmt})
    return result


def case_name(case: dict[str, Any]) -> str:
    """E.g. ``2x64x56x56 float32 channels_last``."""
    shape = "x".join(map(str, case["shape"]))
    return f"{shape} {case['dtype']} {case['memory_format']}"


def _log(rank: int, message: str) -> None:
    if rank == 0:
        print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _device(settings: dict[str, Any]) -> torch.device:
    if settings["device"] == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(settings["device"])


def _tensor(case: dict[str, Any], generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """A random input of the case's shape, dtype and memory format."""
    dtype = getattr(torch, case["dtype"])
    tensor = torch.randn(case["shape"], generator=generator).to(device=device, dtype=dtype)
    if case["memory_format"] == "channels_last":
        ndim = len(case["shape"])
        fmt = torch.channels_last if ndim == 4 else torch.channels_last_3d
        tensor = tensor.contiguous(memory_format=fmt)
    return tensor


def _layers(channels: int, ndim: int, device: torch.device) -> dict[str, nn.Module]:
    """The layers to compare, float32 parameters, in training mode."""
    layers: dict[str, nn.Module] = {
        "batchnorm": torch_batchnorm(channels, ndim, device=device),
        "syncbn": syncbn.SyncBatchNorm(channels, device=device),
        "reference": ReferenceSyncBatchNorm(channels, device=device),
    }
    if device.type in _TORCH_SYNCBN_DEVICES:
        layers["torch_syncbn"] = nn.SyncBatchNorm(channels, device=device)
    for layer in layers.values():
        with torch.no_grad():  # non-trivial affine parameters
            cast(torch.Tensor, layer.weight).uniform_(0.5, 1.5)
            cast(torch.Tensor, layer.bias).uniform_(-0.5, 0.5)
    return layers


def torch_syncbn_note(device: torch.device) -> str | None:
    """Why torch.nn.SyncBatchNorm is not measured on ``device`` (None if it is).

    The reason is torch's own error, obtained by calling it inside a process group.
    """
    if device.type in _TORCH_SYNCBN_DEVICES:
        return None
    layer = nn.SyncBatchNorm(4, device=device)
    try:
        layer(torch.randn(2, 4, 3, 3, device=device))
    except (ValueError, RuntimeError) as error:
        error_text = f"{type(error).__name__}: {error}"
        return f"skipped on {device.type}: torch.nn.SyncBatchNorm raises {error_text}"
    return f"skipped on {device.type}: not a device torch.nn.SyncBatchNorm documents"


def _max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


# --------------------------------------------------------------------------- per-layer times


def _layer_case(
    case: dict[str, Any], settings: dict[str, Any], rank: int, device: torch.device
) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(1000 + rank)
    x = _tensor(case, generator, device).requires_grad_()
    dy = _tensor(case, generator, device)
    channels, ndim = case["shape"][1], len(case["shape"])
    layers = _layers(channels, ndim, device)

    # syncbn and the reference compute the same thing: check before timing
    outputs = {}
    for name in ("syncbn", "reference"):
        y = layers[name](x)
        outputs[name] = (y, *torch.autograd.grad(y, [x], dy))
    check = {
        "output_max_abs_diff": _max_abs_diff(outputs["syncbn"][0], outputs["reference"][0]),
        "grad_input_max_abs_diff": _max_abs_diff(outputs["syncbn"][1], outputs["reference"][1]),
        "syncbn_keeps_memory_format": outputs["syncbn"][0].stride() == x.stride(),
    }
    del outputs

    unchecked: Any = copy.deepcopy(layers["syncbn"])
    unchecked.check_layer_order = False
    fns: dict[str, Callable[[], object]] = {}
    for name, layer in layers.items():
        forward, forward_backward = layer_callables(layer, x, dy)
        fns[f"{name}.forward"] = forward
        fns[f"{name}.forward_backward"] = forward_backward
    fns["syncbn_unchecked.forward_backward"] = layer_callables(unchecked, x, dy)[1]
    source = x.detach().clone()
    target = torch.empty_like(source)
    fns["copy"] = lambda: target.copy_(source)
    # the latency floor: syncbn's own collectives (as counted), replayed without the layer
    forward_log, backward_log = layer_collectives(layers["syncbn"], x, dy)
    fns["all_reduce.forward"] = replay_callable(forward_log, device)
    fns["all_reduce.backward"] = replay_callable(backward_log, device)
    timings = measure(
        fns,
        repeats=settings["repeats"],
        min_block_time=settings["min_block_time"],
        warmup=settings["warmup"],
        device=device,
    )
    return {
        **case,
        "bytes": x.numel() * x.element_size(),
        "check": check,
        "syncbn_collectives": {
            "forward": [[c.name, c.nbytes] for c in forward_log],
            "backward": [[c.name, c.nbytes] for c in backward_log],
        },
        "times_s": {name: t.median for name, t in timings.items()},
        "best_s": {name: t.best for name, t in timings.items()},
        "cpu_s": {name: t.cpu for name, t in timings.items()},
        "iqr_s": {name: t.iqr for name, t in timings.items()},
        "calls_per_block": {name: t.calls_per_block for name, t in timings.items()},
    }


def layers_rank(rank: int, world_size: int, settings: dict[str, Any]) -> dict[str, Any]:
    """Per-layer forward and forward+backward times of every case, with floors."""
    device = _device(settings)
    results = []
    for index, case in enumerate(settings["cases"]):
        _log(rank, f"layers {index + 1}/{len(settings['cases'])}: {case_name(case)}")
        results.append(_layer_case(case, settings, rank, device))
    return {"cases": results, "torch_syncbn": torch_syncbn_note(device)}


# --------------------------------------------------------------------------- building blocks


def _block_fns(case: dict[str, Any], rank: int, device: torch.device) -> dict[str, Any]:
    """Candidate ops a SyncBatchNorm can be composed of, on the case's input."""
    generator = torch.Generator().manual_seed(2000 + rank)
    x = _tensor(case, generator, device)
    dy = _tensor(case, generator, device)
    channels, ndim = case["shape"][1], len(case["shape"])
    dims = [0, *range(2, ndim)]
    view = [1, channels] + [1] * (ndim - 2)
    stat = torch.float32
    mean = torch.randn(channels, dtype=stat, device=device)
    var = torch.rand(channels, dtype=stat, device=device) + 0.5
    invstd = torch.rsqrt(var + 1e-5)
    weight = torch.ones(channels, dtype=stat, device=device)
    bias = torch.zeros(channels, dtype=stat, device=device)
    a, b, c = (torch.randn(channels, dtype=stat, device=device).view(view) for _ in range(3))
    backward = torch.ops.aten.native_batch_norm_backward
    fns: dict[str, Callable[[], object]] = {
        "copy": lambda: torch.empty_like(x).copy_(x),
        "sum": lambda: x.sum(dims, dtype=stat),
        "sum_float64": lambda: x.sum(dims, dtype=torch.float64),
        "sum_of_squares": lambda: x.square().sum(dims, dtype=stat),
        "var_mean": lambda: torch.var_mean(x, dims, correction=0),
        "batch_norm_train_forward": lambda: F.batch_norm(x, None, None, weight, bias, True),
        "batch_norm_eval_forward": lambda: F.batch_norm(x, mean, var, weight, bias, False),
        "bn_backward_sums_only": lambda: backward(
            dy, x, None, mean, var, None, None, False, 1e-5, [False, True, True]
        ),
        "bn_backward_train_full": lambda: backward(
            dy, x, weight, None, None, mean, invstd, True, 1e-5, [True, True, True]
        ),
        "two_addcmul": lambda: torch.addcmul(c, x, a).addcmul_(dy, b),
    }
    return fns


def blocks_rank(rank: int, world_size: int, settings: dict[str, Any]) -> dict[str, Any]:
    """Times of the candidate ops per case (rank-local, all ranks running at once)."""
    device = _device(settings)
    results = []
    for index, case in enumerate(settings["block_cases"]):
        _log(rank, f"building blocks {index + 1}/{len(settings['block_cases'])}: {case_name(case)}")
        timings = measure(
            _block_fns(case, rank, device),
            repeats=settings["block_repeats"],
            min_block_time=settings["block_min_time"],
            warmup=settings["warmup"],
            device=device,
        )
        results.append(
            {
                **case,
                "times_s": {name: t.median for name, t in timings.items()},
                "best_s": {name: t.best for name, t in timings.items()},
                "cpu_s": {name: t.cpu for name, t in timings.items()},
            }
        )
    return {"cases": results}


# --------------------------------------------------------------------------- profiles


def _op_table(prof: Any, iterations: int) -> dict[str, Any]:
    """Self time and calls per iteration of every op, slowest first."""
    events = [e for e in prof.key_averages() if not e.key.startswith("ProfilerStep")]
    events.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    return {
        "total_self_us": sum(e.self_cpu_time_total for e in events) / iterations,
        "ops": [
            {
                "name": e.key,
                "self_us": e.self_cpu_time_total / iterations,
                "calls": e.count / iterations,
            }
            for e in events
            if e.self_cpu_time_total > 0
        ],
    }


@contextmanager
def _labelled_all_reduce() -> Iterator[None]:
    """Name each dist.all_reduce call in profiles, so its wait is not counted as Python time.

    With gloo the op recorded inside only enqueues the work; the caller then waits
    outside any op, which the profiler would otherwise attribute to the caller's frame.
    """
    original = dist.all_reduce

    def labelled(*args: Any, **kwargs: Any) -> Any:
        with record_function("dist.all_reduce (call and wait)"):
            return original(*args, **kwargs)

    dist.all_reduce = labelled
    try:
        yield
    finally:
        dist.all_reduce = original


def profile_rank(rank: int, world_size: int, settings: dict[str, Any]) -> dict[str, Any]:
    """torch.profiler op tables of BatchNorm and SyncBatchNorm forward+backward per case."""
    device = _device(settings)
    iterations = settings["profile_iterations"]
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    results = []
    for index, case in enumerate(settings["profile_cases"]):
        _log(rank, f"profile {index + 1}/{len(settings['profile_cases'])}: {case_name(case)}")
        generator = torch.Generator().manual_seed(3000 + rank)
        x = _tensor(case, generator, device).requires_grad_()
        dy = _tensor(case, generator, device)
        layers = _layers(case["shape"][1], len(case["shape"]), device)
        tables = {}
        for name in ("batchnorm", "syncbn"):
            step = layer_callables(layers[name], x, dy)[1]
            for _ in range(settings["warmup"]):
                step()
            dist.barrier()
            with profile(activities=activities) as prof, _labelled_all_reduce():
                for _ in range(iterations):
                    step()
                synchronize(device)
            tables[name] = _op_table(prof, iterations)
        results.append({**case, "profiles": tables})
    return {"cases": results, "iterations": iterations}


# --------------------------------------------------------------------------- memory


def _saved_bytes(layer: nn.Module, x: torch.Tensor) -> tuple[int, int]:
    """Bytes and number of distinct storages that autograd saves for backward."""
    storages: dict[tuple[int, int], int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        storages[(storage.data_ptr(), storage.nbytes())] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        output = layer(x)
    del output
    return sum(storages.values()), len(storages)


def _peak_bytes(step: Callable[[], object], device: torch.device) -> int | None:
    """Peak of live allocations during ``step`` above what was live before it."""
    if device.type == "cuda":
        synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        baseline = torch.cuda.memory_allocated(device)
        step()
        synchronize(device)
        return torch.cuda.max_memory_allocated(device) - baseline
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    results = getattr(prof.profiler, "kineto_results", None)
    if results is None:
        return None
    live = peak = 0
    cpu = torch.autograd.DeviceType.CPU
    memory = [e for e in results.events() if e.name() == "[memory]" and e.device_type() == cpu]
    for event in sorted(memory, key=lambda e: e.start_ns()):
        live += event.nbytes()
        peak = max(peak, live)
    return peak


def memory_rank(rank: int, world_size: int, settings: dict[str, Any]) -> dict[str, Any]:
    """Bytes saved for backward and peak allocations of one forward+backward, per case."""
    device = _device(settings)
    results = []
    for case in settings["memory_cases"]:
        generator = torch.Generator().manual_seed(4000 + rank)
        x = _tensor(case, generator, device).requires_grad_()
        dy = _tensor(case, generator, device)
        layers = _layers(case["shape"][1], len(case["shape"]), device)
        row: dict[str, Any] = {**case, "input_bytes": x.numel() * x.element_size()}
        for name, layer in layers.items():
            step = layer_callables(layer, x, dy)[1]
            step()  # warm up: lazily created buffers are not the layer's cost
            saved, storages = _saved_bytes(layer, x)
            row[name] = {
                "saved_bytes": saved,
                "saved_storages": storages,
                "peak_bytes": _peak_bytes(step, device),
            }
        results.append(row)
    return {"cases": results}


# --------------------------------------------------------------------------- collectives


def collectives_rank(rank: int, world_size: int, settings: dict[str, Any]) -> list[dict[str, Any]]:
    """Collectives and bytes this rank sends per layer call, forward and backward."""
    device = _device(settings)
    rows = []
    for case in settings["collective_cases"]:
        generator = torch.Generator().manual_seed(5000 + rank)
        x = _tensor(case, generator, device).requires_grad_()
        dy = _tensor(case, generator, device)
        layers = _layers(case["shape"][1], len(case["shape"]), device)
        for name in ("syncbn", "reference", "torch_syncbn"):
            if name not in layers:
                continue
            layer = layers[name]
            with count_collectives() as forward_log:
                output = layer(x)
            with count_collectives() as backward_log:
                torch.autograd.grad(output, [x, *layer.parameters()], dy)
            rows.append(
                {
                    **case,
                    "layer": name,
                    "forward": [[c.name, c.nbytes] for c in forward_log],
                    "backward": [[c.name, c.nbytes] for c in backward_log],
                }
            )
    return rows


# --------------------------------------------------------------------------- whole model


def _bn_channels(model: nn.Module) -> list[int]:
    return [m.num_features for m in model.modules() if isinstance(m, _BatchNorm)]


def model_rank(rank: int, world_size: int, settings: dict[str, Any]) -> dict[str, Any]:
    """Training-step time of a small ResNet under DDP, BatchNorm vs SyncBatchNorm."""
    device = _device(settings)
    torch.manual_seed(0)
    base = SmallResNet().to(device)
    channels = _bn_channels(base)
    own_group = dist.new_group(list(range(world_size)))
    ddp: dict[str, Any] = {"device_ids": [device.index]} if device.type == "cuda" else {}
    # no buffer broadcast each forward (SyncBN's running stats are equal on all ranks anyway)
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters:
        ddp["forward_sync_buffers"] = False
    else:
        ddp["broadcast_buffers"] = False
    models = {
        "batchnorm": copy.deepcopy(base),
        "syncbn": syncbn.convert_sync_batchnorm(copy.deepcopy(base)),
        "syncbn_own_group": syncbn.convert_sync_batchnorm(copy.deepcopy(base), own_group),
    }
    generator = torch.Generator().manual_seed(6000 + rank)
    batch = settings["model_batch"]
    images = torch.randn(batch, 3, 32, 32, generator=generator).to(device)
    labels = torch.randint(0, 10, (batch,), generator=generator).to(device)

    def train_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> Callable[[], object]:
        def step() -> object:
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(images), labels)
            loss.backward()
            optimizer.step()
            return loss

        return step

    fns: dict[str, Callable[[], object]] = {}
    for name, model in models.items():
        wrapped = DistributedDataParallel(model, **ddp)
        optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.01, momentum=0.9)
        fns[name] = train_step(wrapped, optimizer)
    with count_collectives() as log:  # what SyncBN sends in one step (DDP's is not counted)
        fns["syncbn"]()
    for nbytes in sorted({c.nbytes for c in log}):
        fns[f"all_reduce.{nbytes}"] = replay_callable([c for c in log if c.nbytes == nbytes][:1])
    _log(rank, f"whole model: {len(channels)} BatchNorm layers, batch {batch} per rank")
    timings = measure(
        fns,
        repeats=settings["model_repeats"],
        min_block_time=settings["min_block_time"],
        warmup=settings["warmup"],
        device=device,
    )
    return {
        "model": "SmallResNet (CIFAR ResNet-14 style, widths 16/32/64)",
        "input": [batch, 3, 32, 32],
        "bn_layers": len(channels),
        "bn_channels": channels,
        "ddp": {k: v for k, v in ddp.items() if k != "device_ids"},
        "syncbn_collectives_per_step": len(log),
        "syncbn_collective_bytes": [c.nbytes for c in log],
        "times_s": {name: t.median for name, t in timings.items()},
        "best_s": {name: t.best for name, t in timings.items()},
        "cpu_s": {name: t.cpu for name, t in timings.items()},
        "iqr_s": {name: t.iqr for name, t in timings.items()},
    }


def _sections() -> Iterator[tuple[str, Callable[..., Any]]]:
    yield "layers", layers_rank
    yield "blocks", blocks_rank
    yield "profiles", profile_rank
    yield "memory", memory_rank
    yield "model", model_rank


def main_rank(rank: int, world_size: int, settings: dict[str, Any]) -> dict[str, Any]:
    """Run the selected 2-rank sections in one process group; rank 0's results are kept."""
    results: dict[str, Any] = {}
    for name, section in _sections():
        if name in settings["sections"]:
            started = time.perf_counter()
            results[name] = section(rank, world_size, settings)
            results[name]["wall_s"] = time.perf_counter() - started
    return results
