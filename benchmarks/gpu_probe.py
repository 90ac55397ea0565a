"""GPU diagnostics for what the first GPU run left unexplained (issue 19), in one command.

1. ``bf16``: the CUDA gold tests with bfloat16 input and float32 parameters failed on the
   bias gradient (step 1, channel 0: 0.1855 against 0.1213, identical on the generic and
   fused kernels, immediate and deferred checks; float16 passed). For each rank's slice of
   that case it prints the error of the per-channel ``sum(dy)`` computed four ways against
   the exact sum: ``native_batch_norm_backward`` in eval mode (what syncbn's
   ``backward_reduce`` calls) on the CPU and on CUDA, a plain ``sum`` on each, the bias
   gradient of a syncbn layer (one rank, sync path forced) per slice and check mode, and
   then each rank's bias gradient in the failing test itself (2 gloo ranks, CUDA tensors)
   against the exact sum of its own output gradient: as the tests run, with
   ``CUDA_LAUNCH_BLOCKING=1``, and with the all_reduce through a host copy (a race between
   streams would show as errors in the first only).
2. ``profile``: where an eager call's host time goes on CUDA. The first run measured ~2.2
   ms of host time per forward+backward call of one layer at every shape (the device
   waited on the host), where the CPU machines measure ~0.13 ms. cProfile of 50 calls, the
   30 most expensive functions by own time (``prof-*.txt``), and ``torch.profiler``'s table
   of 20 calls, host time per aten op and CUDA runtime call with counts (``ops-*.txt``),
   per dtype, layout and check mode, and with ``syncbn._kernels.finalize`` (``-fused``: with
   ``syncbn._kernels.triton_passes``; ``-fused-generic-passes``: without).
3. ``calibrate``: what one unit of that host time costs on the lent machine, to split the
   ~2.2 ms into its causes: host time per aten op (a small in-place add), per nccl
   ``all_reduce`` of a forward buffer at world size 1, per Triton launch (a kernel of one
   argument, and one of 24 like the finalize kernels'), and a cuDNN BatchNorm call; and
   per profiled variant, the aten calls and kernels one call issues (counted by
   ``tests/test_op_budget.py``'s dispatch mode) with the host time they predict.

Usage::

    python benchmarks/gpu_probe.py OUT          # OUT/probe.txt, OUT/prof-*.txt, OUT/ops-*.txt
    python benchmarks/gpu_probe.py OUT --device cpu   # the same code on the CPU (a dry run)
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import os
import pstats
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

import syncbn
from syncbn import _kernels
from syncbn._cli.launch import run_on_ranks

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import _gold  # noqa: E402  (the gold case's data, from the tests)
from test_op_budget import _Ops  # noqa: E402  (the op budget's count of aten calls)

__all__ = ["main"]

#: the CUDA gold case that failed (tests/test_cuda.py GOLD["bfloat16-float32-params"])
BF16_CASE = _gold.Case(sizes=(3, 1), dtype="bfloat16", param_dtype="float32", tail=(4, 6, 6))


def _error(actual: torch.Tensor, exact: torch.Tensor) -> str:
    return f"{(actual.double().cpu() - exact).abs().max().item():.2e}"


def probe_bf16(device: torch.device, say: Callable[[str], None]) -> None:
    """Errors of the local ``sum(dy)`` per rank slice of the failing bf16 gold case."""
    case = BF16_CASE
    xs, dys, weight, bias = case.data()
    slices = [(0, 3), (3, 4), (0, 4)]
    for step in range(case.steps):
        for start, stop in slices:
            x, dy = case.prepare(xs[step][start:stop]), case.prepare(dys[step][start:stop])
            exact = dy.double().sum((0, 2, 3))
            mean, var = x.float().mean((0, 2, 3)), x.float().var((0, 2, 3))
            cells = [f"step {step} samples {start}:{stop}"]
            for where in ("cpu", device.type):
                d = torch.device(where)
                ones, empty = torch.ones(4, device=d), torch.empty(0, device=d)
                sums = torch.ops.aten.native_batch_norm_backward(
                    dy.to(d), x.to(d), ones, mean.to(d), var.to(d), empty, empty,
                    False, 1e-5, [False, True, True],
                )  # fmt: skip
                cells.append(f"{where} eval-backward {_error(sums[2], exact)}")
                cells.append(f"{where} sum {_error(dy.to(d).float().sum((0, 2, 3)), exact)}")
            say(" | ".join(cells))
    for start, stop in slices:
        for mode in ("immediate", "deferred"):
            layer = syncbn.SyncBatchNorm(4, dtype=torch.float32).to(device)
            layer._sync_alone = True
            layer.check_mode = mode
            with torch.no_grad():
                layer.weight.copy_(weight)
                layer.bias.copy_(bias)
            errors = []
            for step in range(case.steps):
                x = case.prepare(xs[step][start:stop]).to(device).requires_grad_()
                dy = case.prepare(dys[step][start:stop])
                layer(x).backward(dy.to(device))
                assert layer.bias.grad is not None
                errors.append(_error(layer.bias.grad, dy.double().sum((0, 2, 3))))
                layer.weight.grad = layer.bias.grad = None
            say(f"layer samples {start}:{stop} {mode}: bias gradient error per step {errors}")


def _all_reduce_through_host() -> None:
    """syncbn's all_reduce of a CUDA buffer made through a CPU copy, taken and copied back
    on the calling stream: gloo's own handling of CUDA tensors (its streams and pinned
    copies) out of the picture, syncbn's code unchanged."""
    from syncbn import distributed

    original = distributed.all_reduce_sum_

    def through_host(buffer: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
        host = buffer.cpu()
        original(host, group)
        return buffer.copy_(host)

    distributed.all_reduce_sum_ = through_host


def _gold_rank_errors(
    rank: int, world_size: int, device: str, through_host: bool = False
) -> list[str]:
    """The failing test itself, on 2 gloo ranks with CUDA tensors: per check mode and step,
    this rank's bias gradient against the exact sum of its own output gradient."""
    if through_host:
        _all_reduce_through_host()
    errors = []
    for mode in ("auto", "immediate"):
        case = dataclasses.replace(BF16_CASE, extra={"device": device, "check_mode": mode})
        _, dys, _, _ = case.data()
        start = sum(case.sizes[:rank])
        stop = start + case.sizes[rank]
        result = _gold.run_rank(rank, world_size, case)
        for step, record in enumerate(result["steps"]):
            exact = case.prepare(dys[step][start:stop]).double().sum((0, 2, 3))
            errors.append(f"{mode} step {step}: {_error(record['grad_bias'], exact)}")
    return errors


def probe_bf16_on_ranks(device: torch.device, say: Callable[[str], None]) -> None:
    """:func:`_gold_rank_errors` on 2 gloo ranks (the failing tests' transport), as the
    tests run; then with every kernel launch waited for (``CUDA_LAUNCH_BLOCKING=1``, set
    before the ranks start) and with the all_reduce through a host copy. Errors as the
    tests run only (they were at step 1, not step 0) would point at the order of work
    between streams, not at the arithmetic."""
    variants: list[tuple[str, dict[str, str], bool]] = [
        ("as the tests run", {}, False),
        ("launch blocking", {"CUDA_LAUNCH_BLOCKING": "1"}, False),
        ("all_reduce through a host copy", {}, True),
    ]
    for name, environment, through_host in variants:
        saved = {key: os.environ.get(key) for key in environment}
        os.environ.update(environment)
        try:
            per_rank = run_on_ranks(_gold_rank_errors, 2, device.type, through_host, timeout=120)
        except Exception as error:  # noqa: BLE001 - reported, and the next variant runs
            say(f"gloo ranks, {name}: failed: {type(error).__name__}: {error}")
            continue
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        for rank, errors in enumerate(per_rank):
            say(f"gloo rank {rank}, {name}: bias gradient error {errors}")


def _host_us(fn: Callable[[], object], calls: int, synchronize: Callable[[], None]) -> float:
    """Host time per call of ``fn`` in microseconds: ``calls`` calls without waiting (after
    as many to warm up), then one wait for the device outside the timing."""
    for _ in range(calls):
        fn()
    synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - start) / calls
    synchronize()
    return host * 1e6


def _triton_launchers(device: torch.device) -> dict[str, Callable[[], object]] | None:
    """Launches of two trivial Triton kernels (1 and 24 arguments, the finalize kernels'
    order of magnitude), or ``None`` where Triton or a GPU is missing."""
    if device.type != "cuda":
        return None
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def one_argument(x_ptr):  # type: ignore[no-untyped-def]
        tl.store(x_ptr, tl.load(x_ptr) + 1.0)

    @triton.jit
    def many_arguments(  # type: ignore[no-untyped-def]
        x_ptr, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15, a16,
        n1, n2, n3, n4, n5, n6, BLOCK: tl.constexpr,
    ):  # fmt: skip
        tl.store(x_ptr, tl.load(x_ptr) + 1.0)

    x = torch.zeros(8, device=device)
    pointers = [torch.zeros(8, device=device) for _ in range(16)]
    numbers = [3, 5, 7, 11, 13, 17]
    return {
        "triton launch, 1 argument": lambda: one_argument[(1,)](x),
        "triton launch, 24 arguments": lambda: many_arguments[(1,)](
            x, *pointers, *numbers, BLOCK=16
        ),
    }


def calibrate(device: torch.device, say: Callable[[str], None]) -> dict[str, float]:
    """Host microseconds per unit of work on this machine (see the module's docstring)."""
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    small = torch.zeros(256, device=device)
    buffer = torch.zeros(2 * 256 + 6, dtype=torch.float64, device=device)
    bn = torch.nn.BatchNorm2d(256).to(device)
    x = torch.randn(32, 256, 14, 14, device=device, requires_grad=True)
    dy = torch.randn_like(x)
    units: dict[str, Callable[[], object]] = {
        "aten op (in-place add of 256 values)": lambda: small.add_(1.0),
        "all_reduce of a forward buffer (518 float64)": lambda: dist.all_reduce(buffer),
        "torch BatchNorm2d forward+backward (cuDNN on CUDA), 32x256x14x14": lambda: (
            torch.autograd.grad(bn(x), (x, *bn.parameters()), dy)
        ),
    }
    try:
        units.update(_triton_launchers(device) or {})
    except Exception as error:  # noqa: BLE001 - reported; the other units still count
        say(f"calibrate: triton launchers failed: {type(error).__name__}: {error}")
    costs = {}
    for name, fn in units.items():
        try:
            costs[name] = _host_us(fn, 200, synchronize)
            say(f"calibrate: {name}: {costs[name]:.1f} us host per call")
        except Exception as error:  # noqa: BLE001 - reported; the other units still count
            say(f"calibrate: {name}: failed: {type(error).__name__}: {error}")
    return costs


def profile_calls(
    device: torch.device, out: Path, say: Callable[[str], None], costs: dict[str, float]
) -> None:
    """Host time of eager forward+backward calls, and cProfile's view of it; a variant that
    fails (the fused kernel's first compilation, say) is reported and the others still run."""
    # fused: syncbn._kernels.finalize (Triton kernels around the collectives) with
    # syncbn._kernels.triton_passes ("fused") or the generic passes ("fused-generic-passes")
    for dtype, channels_last, mode, fused in (
        (torch.float32, False, "deferred", ""),
        (torch.float32, False, "deferred", "fused"),
        (torch.float32, False, "deferred", "fused-generic-passes"),
        (torch.float32, False, "immediate", ""),
        (torch.bfloat16, True, "deferred", ""),
        (torch.bfloat16, True, "deferred", "fused"),
    ):
        layout = "cl" if channels_last else "nchw"
        name = "-".join(filter(None, (str(dtype).removeprefix("torch."), layout, mode, fused)))
        try:
            passes = fused == "fused"
            _kernels.use_fused_finalize(device.type, enabled=bool(fused), triton_passes=passes)
            _profile(device, dtype, channels_last, mode, out / name, say, costs)
        except Exception as error:  # noqa: BLE001 - reported, and the next variant runs
            say(f"32x256x14x14 {name}: failed: {type(error).__name__}: {error}")
        finally:
            _kernels.use_fused_finalize(device.type, enabled=False)


def _profile(
    device: torch.device,
    dtype: torch.dtype,
    channels_last: bool,
    mode: str,
    stem: Path,
    say: Callable[[str], None],
    costs: dict[str, float],
) -> None:
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    layer = syncbn.SyncBatchNorm(256).to(device)
    layer._sync_alone = True
    layer.check_mode = mode
    x = torch.randn(32, 256, 14, 14, device=device, dtype=dtype)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    x.requires_grad_()
    dy = torch.randn_like(x)

    def call() -> None:
        torch.autograd.grad(layer(x), (x, *layer.parameters()), dy)

    for _ in range(20):
        call()
    synchronize()
    start = time.perf_counter()
    for _ in range(50):
        call()
    host = (time.perf_counter() - start) / 50
    synchronize()
    total = (time.perf_counter() - start) / 50
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(50):
        call()
    profiler.disable()
    synchronize()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
    stem.with_name(f"prof-{stem.name}.txt").write_text(text.getvalue())
    # torch's view of the same calls: host time per aten op and per CUDA runtime call
    # (cudaLaunchKernel, cudaMemcpyAsync, cudaEventRecord ...), and their counts
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as ops:
        for _ in range(20):
            call()
        synchronize()
    table = ops.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)
    stem.with_name(f"ops-{stem.name}.txt").write_text(table)
    say(f"32x256x14x14 {stem.name}: host {host * 1e3:.3f} ms per call, {total * 1e3:.3f} in all")
    with _Ops() as counted:
        call()
    synchronize()
    calls, kernels = len(counted.names), len(counted.kernels)
    per_op = costs.get("aten op (in-place add of 256 values)")
    predicted = "" if per_op is None else f", {calls * per_op / 1e3:.3f} ms at its cost"
    say(f"  aten calls per call {calls}, kernels {kernels}{predicted}")
    say("\n".join(line for line in text.getvalue().splitlines()[:40] if line.strip()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="folder for probe.txt and prof-*.txt")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (a dry run)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    args.out.mkdir(parents=True, exist_ok=True)
    lines: list[str] = []

    def say(line: str) -> None:
        print(line, flush=True)
        lines.append(line)
        (args.out / "probe.txt").write_text("\n".join(lines) + "\n")

    backend = "nccl" if device.type == "cuda" else "gloo"
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group(backend, init_method=f"file://{tmp}/r", rank=0, world_size=1)
        try:
            probe_bf16(device, say)
            probe_bf16_on_ranks(device, say)  # the failing tests' transport: gloo, CUDA tensors
            costs = calibrate(device, say)
            profile_calls(device, args.out, say, costs)
        finally:
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
