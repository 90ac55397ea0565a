"""GPU diagnostics for what the GPU runs left unexplained (issue 19), in one command.

1. ``bf16`` (with ``--bf16`` only: the second run, 2026-12-04, answered it: torch's CUDA
   eval-mode ``native_batch_norm_backward`` sums float16/bfloat16 data in their own dtype,
   and syncbn's ``backward_reduce`` now sums float32 copies there): the CUDA gold tests with
   bfloat16 input and float32 parameters failed on the bias gradient (step 1, channel 0:
   0.1855 against 0.1213, identical on the generic and fused kernels, immediate and deferred
   checks; float16 passed). For each rank's slice of that case it prints the error of the
   per-channel ``sum(dy)`` computed four ways against the exact sum:
   ``native_batch_norm_backward`` in eval mode (what syncbn's ``backward_reduce`` calls) on
   the CPU and on CUDA, a plain ``sum`` on each, the bias gradient of a syncbn layer (one
   rank, sync path forced) per slice and check mode, and then each rank's bias gradient in
   the failing test itself (2 gloo ranks, CUDA tensors) against the exact sum of its own
   output gradient: as the tests run, with ``CUDA_LAUNCH_BLOCKING=1``, and with the
   all_reduce through a host copy (a race between streams would show as errors in the first
   only).
2. ``profile``: where an eager call's host time goes on CUDA. The first run measured ~2.2 ms
   of host time per forward+backward call of one layer at every shape (the device waited on
   the host), where the CPU machines measure ~0.13 ms. cProfile of 50 calls, the 30 most
   expensive functions by own time and the 80 first by cumulative time (``prof-*.txt``),
   ``torch.profiler``'s table of 20 calls, host time per aten op and CUDA runtime call with
   counts (``ops-*.txt``), the host time of the call's aten calls replayed alone through
   ``torch.ops`` (:func:`replay_us`: the rest is Python, bindings and collectives), and the
   inclusive host time of each phase of a call (:data:`PHASES`: checks, local moments,
   packing, collectives, per-channel maths, element passes, deferred checks) timed without a
   profiler (the second run could not place ~1.9 of its 2.6 ms per call from the profiles,
   whose own overhead inflates every Python frame), per dtype, layout and check mode, and
   with ``syncbn._kernels.finalize`` (``-fused``: with ``syncbn._kernels.triton_passes``;
   ``-fused-generic-passes``: without); last, a call of the layer under
   ``torch.compile(fullgraph=True)`` (``-compiled``: the second run, on an H200, measured
   1.7 ms of host time per compiled layer over compiled BatchNorm, against 0.14 ms on the
   CPU machines), whose phases are the bodies of syncbn's ops and what they call (no
   replay: a dispatch mode sees none of the compiled kernels).
3. ``calibrate``: what one unit of that host time costs on the lent machine, to split the
   ~2.2 ms into its causes: host time per aten op (a small in-place add), per nccl
   ``all_reduce`` of a forward buffer at world size 1, per Triton launch (a kernel of one
   argument, and one of 24 like the finalize kernels'), and a cuDNN BatchNorm call; and
   per profiled variant, the aten calls and kernels one call issues (counted by
   ``tests/test_op_budget.py``'s dispatch mode) with the host time they predict.

4. ``passes`` (its own command, ``--passes``): the device time of each of
   :mod:`syncbn._kernels.triton_passes`' four passes over the data, at shapes of resnet50's
   largest and smallest activations and of a speech batch, with its effective bandwidth
   (bytes read and written over time), for the default tiles (16 channels x 64 positions,
   ~512 programs per reduction) and the alternatives a GPU may prefer: tiles wide in
   channels for channel-contiguous layouts, and more programs per reduction (at 512 a
   132-SM H200 runs ~4 per SM, predicted to keep fewer bytes in flight than its memory
   needs, by Little's law: this sweep checks it); masked too, at the default. Against
   cuDNN BatchNorm's forward+backward on the same tensors, which moves the same 8 tensors.
   Each measurement replays a CUDA graph of the calls (device time, not the host's
   launches).

Usage::

    python benchmarks/gpu_probe.py OUT          # OUT/probe.txt, OUT/prof-*.txt, OUT/ops-*.txt
    python benchmarks/gpu_probe.py OUT --bf16   # the same, after the bf16 diagnostics
    python benchmarks/gpu_probe.py OUT --passes # OUT/probe.txt: the passes' sweep only
    python benchmarks/gpu_probe.py OUT --device cpu   # the same code on the CPU (a dry run)
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import dataclasses
import io
import os
import pstats
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import syncbn
from syncbn import _kernels
from syncbn._cli.launch import run_on_ranks
from syncbn._compiled import is_compiling
from syncbn._stats import stat_dtype

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _gold  # noqa: E402  (the gold case's data, from the tests)
from gpu import captured  # noqa: E402  (benchmarks/gpu.py's CUDA graph capture)
from test_op_budget import _Ops  # noqa: E402  (the op budget's record of aten calls)

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
            if device.type == "cuda":
                cells += _other_cuda_sums(dy.to(device), x.to(device), mean, var, exact)
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


def _other_cuda_sums(
    dy: torch.Tensor, x: torch.Tensor, mean: torch.Tensor, var: torch.Tensor, exact: torch.Tensor
) -> list[str]:
    """The errors of the local ``sum(dy)`` of the two other CUDA kernels syncbn may take:
    torch's ``batch_norm_backward_reduce`` and Triton's backward pass
    (syncbn._kernels.triton_passes, which accumulates in float32); and of the eval-mode
    backward that syncbn calls, given float32 copies of ``dy`` and ``x``. Summing
    the case's bfloat16 output gradients in bfloat16 gives errors of the failing size
    (0.05-0.1 on step 1's channel 0, by simulation on the CPU; float16's ~0.01 pass the
    tolerance), so a kernel that accumulates in the input's dtype would show here."""
    mean, var = mean.to(x.device), var.to(x.device)
    ones = torch.ones_like(mean)

    def reduce() -> torch.Tensor:
        invstd = (var + 1e-5).rsqrt()
        return torch.batch_norm_backward_reduce(dy, x, mean, invstd, ones, True, True, True)[3]

    def triton() -> torch.Tensor:  # its sum(dy) reads no per-channel row
        from syncbn._kernels import triton_passes

        return _pass_calls(triton_passes, x, dy, None)["backward_reduce"]()[0]  # type: ignore[index,no-any-return]

    def float32_eval_backward() -> torch.Tensor:  # the fix, should eval-backward be the cause
        empty = torch.empty(0, device=x.device)
        return torch.ops.aten.native_batch_norm_backward(
            dy.float(), x.float(), ones, mean, var, empty, empty, False, 1e-5, [False, True, True]
        )[2]

    cells = []
    candidates = (
        ("backward_reduce", reduce),
        ("triton", triton),
        ("eval-backward of float32 copies", float32_eval_backward),
    )
    for name, sum_dy in candidates:
        try:
            cells.append(f"cuda {name} {_error(sum_dy(), exact)}")
        except Exception as error:  # noqa: BLE001 - reported; the other cells still count
            cells.append(f"cuda {name} failed: {type(error).__name__}: {str(error)[:120]}")
    return cells


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


#: the functions whose inclusive host time per layer call :func:`phase_times` measures, by
#: module: a call's phases (checks, local moments, packing, collectives, per-channel maths,
#: the element passes, the deferred checks' transfers), so that a machine whose host time
#: per call is unexplained (the GPU runs: ~2.6 ms, of which the aten calls predict 0.7)
#: shows where it goes without a profiler's own overhead
PHASES: dict[str, tuple[str, ...]] = {
    "syncbn._autograd": (
        "forward_train",
        "resolve_mode",
        "input_problem",
        "reduce_forward",
        "count_divisors",
        "_converted",
        "backward_train",
        "synchronize_grads",
        "_forward_on_fused_kernel",
    ),
    "syncbn._kernels.generic": ("local_moments", "normalize", "backward_reduce", "input_grad"),
    "syncbn._stats": ("moments_from_divisors", "scale", "update_running_stats"),
    "syncbn._protocol": (
        "pack_forward",
        "pack_backward",
        "check_now",
        "defer_check",
        "raise_deferred",
        "header_values",
        "device_flags",
    ),
    "syncbn.distributed": ("all_reduce_sum_", "check_alive", "check_device_backend"),
    # the candidates' (Triton), where imported
    "syncbn._kernels.finalize": (
        "pack_forward",
        "finalize_forward",
        "normalize",
        "pack_backward",
        "finalize_backward",
    ),
    "syncbn._kernels.triton_passes": ("shifted_sums", "normalize", "backward_reduce", "input_grad"),
}


#: the phases of a compiled call: what runs inside syncbn's ops when the graphs run. The
#: functions that dynamo traces (``input_problem``, say) are left out: dynamo guards on
#: which function a global name holds, so a timer there would recompile the graph. The
#: forward op's body is timed itself; the backward op's is called by the dispatcher,
#: which holds the function itself, and is timed through what it calls
COMPILED_PHASES: dict[str, tuple[str, ...]] = {
    "syncbn._compiled": ("_sync_moments", "_options"),
    "syncbn._autograd": ("resolve_mode", "reduce_forward", "synchronize_grads"),
    "syncbn._protocol": (
        "pack_forward_moments",
        "pack_backward_sums",
        "check_now",
        "defer_check",
        "raise_deferred",
        "header_values",
        "device_flags",
    ),
    "syncbn.distributed": ("all_reduce_sum_",),
}


@contextlib.contextmanager
def _phase_timers(
    phases: dict[str, tuple[str, ...]] = PHASES,
) -> Iterator[dict[str, list[float]]]:
    """Wrap each function of ``phases`` with a timer, wherever a syncbn module holds it
    (its own module, and those that imported it by name); yields ``{"module.function":
    [calls, seconds]}`` (the module's last name), inclusive of what each calls; restores
    every function on exit. A module not imported (Triton's, without Triton) is left out.
    While dynamo traces, a timer calls its function untimed (it cannot trace the clock)."""
    totals: dict[str, list[float]] = {}
    patched: list[tuple[Any, str, Any]] = []

    def timed(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        total = totals.setdefault(name, [0, 0.0])

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if is_compiling():  # dynamo traces (syncbn's check, for every torch)
                return function(*args, **kwargs)
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                total[0] += 1
                total[1] += time.perf_counter() - start

        return wrapper

    modules = [module for name, module in sys.modules.items() if name.startswith("syncbn")]
    try:
        for module_name, names in phases.items():
            if module_name not in sys.modules:
                continue
            for name in names:
                original = getattr(sys.modules[module_name], name)
                wrapper = timed(f"{module_name.rsplit('.', 1)[-1]}.{name}", original)
                for module in modules:
                    if getattr(module, name, None) is original:
                        patched.append((module, name, original))
                        setattr(module, name, wrapper)
        yield totals
    finally:  # last in, first out: a function wrapped twice gets its original back
        for module, name, original in reversed(patched):
            setattr(module, name, original)


def phase_times(
    call: Callable[[], object],
    calls: int,
    synchronize: Callable[[], None],
    phases: dict[str, tuple[str, ...]] = PHASES,
) -> tuple[float, dict[str, tuple[float, float]]]:
    """Host microseconds per ``call`` over ``calls`` calls, and per phase of ``phases``
    (:data:`PHASES`, or :data:`COMPILED_PHASES` for a compiled call) that ran: ``(calls
    per call, inclusive host microseconds per call)``. The timers' own cost (two clock
    reads and a Python call per phase call, ~1 us on a slow host) is in the numbers."""
    call()  # first-call caches filled
    synchronize()
    with _phase_timers(phases) as totals:
        start = time.perf_counter()
        for _ in range(calls):
            call()
        host = (time.perf_counter() - start) / calls
    synchronize()
    timed = {
        name: (count / calls, seconds / calls * 1e6)
        for name, (count, seconds) in totals.items()
        if count
    }
    return host * 1e6, timed


def replay_us(
    recorded: _Ops, calls: int, synchronize: Callable[[], None]
) -> tuple[float, int, list[str]]:
    """Host microseconds of the aten calls of one recorded call run alone: replayed back to
    back through ``torch.ops`` ``calls`` times (in-place ones write their targets again:
    denormals flushed, where the CPU can, so that values drifting towards zero cost nothing
    extra). What the call's host time has beyond it is its Python, torch's Python bindings,
    and what dispatches elsewhere (collectives). Also returns the number of aten calls, and
    the other namespaces seen (left out of the replay).

    Args:
        recorded: the dispatch mode that recorded the call (``with _Ops() as recorded:``).
    """
    kept = [entry for entry in recorded.calls if entry[0].namespace == "aten"]
    others = sorted({entry[0].namespace for entry in recorded.calls} - {"aten"})

    def replay() -> None:
        for func, args, kwargs in kept:
            func(*args, **kwargs)

    torch.set_flush_denormal(True)
    try:
        host = _host_us(replay, calls, synchronize)
    finally:
        torch.set_flush_denormal(False)
    return host, len(kept), others


def _empty(*args: Any) -> None:
    return None


class _Identity(torch.autograd.Function):
    """The cheapest Python autograd Function: its cost is autograd's and the interpreter's."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return grad


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
    # the interpreter's speed, which every Python line of a call scales with
    units["Python call of an empty function of 8 arguments"] = lambda: _empty(*range(8))
    # what autograd adds to a call whose backward is Python (syncbn's and torch.nn.SyncBatchNorm's,
    # ~2.3 and ~1.2 ms of host time per call over cuDNN BatchNorm's on the second GPU run): on
    # CUDA the engine runs it in its device thread, which takes the GIL from the calling thread
    leaf = torch.zeros(256, device=device, requires_grad=True)
    ones = torch.ones_like(leaf)
    grad = torch.autograd.grad
    units["autograd forward+backward, a C++ op (mul by 1)"] = lambda: grad(
        leaf.mul(1.0), leaf, ones
    )
    units["autograd forward+backward, a Python Function"] = lambda: grad(
        _Identity.apply(leaf), leaf, ones
    )
    if device.type == "cuda":  # what a deferred check adds per collective (_protocol)
        header = torch.zeros(4, dtype=torch.float64, device=device)

        def deferred_transfer() -> None:
            host = torch.empty(header.shape, dtype=header.dtype, pin_memory=True)
            host.copy_(header, non_blocking=True)
            torch.cuda.Event().record(torch.cuda.current_stream(device))

        units["deferred check's transfer (pinned buffer, copy, event)"] = deferred_transfer
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
    # "compiled": the layer under torch.compile(fullgraph=True), last (its compile takes the
    # longest: a lease's cap that cuts it keeps the eager rows)
    for dtype, channels_last, mode, fused in (
        (torch.float32, False, "deferred", ""),
        (torch.float32, False, "deferred", "fused"),
        (torch.float32, False, "deferred", "fused-generic-passes"),
        (torch.float32, False, "immediate", ""),
        (torch.bfloat16, True, "deferred", ""),
        (torch.bfloat16, True, "deferred", "fused"),
        (torch.float32, False, "deferred", "compiled"),
    ):
        layout = "cl" if channels_last else "nchw"
        name = "-".join(filter(None, (str(dtype).removeprefix("torch."), layout, mode, fused)))
        compiled = fused == "compiled"
        try:
            passes = fused == "fused"
            enabled = fused.startswith("fused")
            _kernels.use_fused_finalize(device.type, enabled=enabled, triton_passes=passes)
            _profile(device, dtype, channels_last, mode, out / name, say, costs, compiled)
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
    compiled: bool = False,
) -> None:
    """One variant of :func:`profile_calls`: ``compiled``, the layer under
    ``torch.compile(fullgraph=True)`` (inductor), whose graphs call syncbn's two ops per
    call (their bodies: the ``_compiled`` phases)."""
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    layer = syncbn.SyncBatchNorm(256).to(device)
    layer._sync_alone = True
    layer.check_mode = mode
    module = torch.compile(layer, fullgraph=True) if compiled else layer
    x = torch.randn(32, 256, 14, 14, device=device, dtype=dtype)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    x.requires_grad_()
    dy = torch.randn_like(x)

    def call() -> None:
        torch.autograd.grad(module(x), (x, *layer.parameters()), dy)

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
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(30)
    by_own_time = text.getvalue()
    stats.sort_stats("cumulative").print_stats(80)  # every phase, with what it calls
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
    if compiled:
        # a dispatch mode would not see the compiled kernels (and dynamo would recompile
        # under it): the ops' bodies and what they call are timed as phases instead
        phases = COMPILED_PHASES
    else:
        with _Ops() as counted:
            call()
        synchronize()
        calls, kernels = len(counted.names), len(counted.kernels)
        per_op = costs.get("aten op (in-place add of 256 values)")
        predicted = "" if per_op is None else f", {calls * per_op / 1e3:.3f} ms at its cost"
        say(f"  aten calls per call {calls}, kernels {kernels}{predicted}")
        replayed, aten_calls, others = replay_us(counted, 50, synchronize)
        left_out = f" ({', '.join(others)} left out)" if others else ""
        say(f"  its {aten_calls} aten calls replayed alone: {replayed:.0f} us per call{left_out}")
        phases = PHASES
    host_us, timed = phase_times(call, 50, synchronize, phases)
    say(f"  phases (inclusive host us per call; {host_us:.0f} us per call with the timers):")
    for phase, (count, us) in timed.items():
        say(f"    {phase}: {us:.1f} us in {count:g} calls")
    say("\n".join(line for line in by_own_time.splitlines()[:40] if line.strip()))


#: the passes' sweep: ``(N, C, *positions)``, dtype, channels last; resnet50's largest and
#: smallest activations of a batch of 32 (bfloat16 channels last, as autocast trains it),
#: a float32 NCHW block, and a speech batch ``(N, C, T)``
PASS_SHAPES: list[tuple[tuple[int, ...], torch.dtype, bool]] = [
    ((32, 64, 112, 112), torch.bfloat16, True),
    ((32, 256, 56, 56), torch.float32, False),
    ((32, 2048, 7, 7), torch.bfloat16, True),
    ((32, 256, 400), torch.float32, False),
]
#: ``(channels per tile, positions per tile, programs per reduction)``; the first is the
#: library's default
PASS_CONFIGS: list[tuple[int, int, int]] = [
    (16, 64, 512),
    (16, 64, 2048),
    (64, 16, 512),
    (64, 16, 2048),
    (32, 32, 1024),
]
#: the share of valid positions of the masked row
PASS_VALID = 0.8
#: whole-tensor reads and writes of each pass, unmasked (the mask adds 1/C of a tensor)
PASS_MOVES = {"sums": 1, "normalize": 2, "backward_reduce": 2, "input_grad": 3}


@contextlib.contextmanager
def _tiling(passes: Any, block_c: int, block_l: int, programs: int) -> Iterator[None]:
    """``syncbn._kernels.triton_passes`` with other tiles and programs per reduction (module
    constants that each launch reads)."""
    saved = passes._BLOCK_C, passes._BLOCK_L, passes._REDUCTION_PROGRAMS
    passes._BLOCK_C, passes._BLOCK_L, passes._REDUCTION_PROGRAMS = block_c, block_l, programs
    try:
        yield
    finally:
        passes._BLOCK_C, passes._BLOCK_L, passes._REDUCTION_PROGRAMS = saved


def _device_us(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    """Device microseconds per call of ``fn``: on CUDA, the replay of a CUDA graph of
    ``repeats`` calls between two events (the host's launches out of the timing); on the
    CPU (a dry run), wall time."""
    fn()  # compiles the kernels of this signature
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - start) / repeats * 1e6
    graph = captured(fn, repeats)
    graph.replay()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    graph.replay()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) * 1e3 / repeats


def _pass_calls(
    passes: Any, x: torch.Tensor, dy: torch.Tensor, valid: torch.Tensor | None
) -> dict[str, Callable[[], object]]:
    """The four passes of one deferred call on ``x`` and ``dy``, with per-channel rows of
    the right dtypes and finite values (the timing does not depend on them)."""
    from syncbn._kernels import finalize

    num_channels = x.shape[1]
    shift = passes.shift_of(x, valid)
    rows = torch.rand(4, num_channels, dtype=shift.dtype, device=x.device) + 0.5
    scale, offset, slope = rows[0], rows[1] - 1.0, rows[2] - 1.0
    saved = rows.clone()  # [mean - shift, var, scale, scale / -n]
    epsilon = finalize.epsilon(1e-5, x.device)
    return {
        "sums": lambda: passes.shifted_sums(x, valid, shift),
        "normalize": lambda: passes.normalize(x, valid, shift, scale, offset),
        "backward_reduce": lambda: passes.backward_reduce(dy, x, valid, shift, saved, epsilon),
        "input_grad": lambda: passes.input_grad(dy, x, valid, shift, scale, slope, offset),
    }


def _cudnn_us(x: torch.Tensor, dy: torch.Tensor, repeats: int, device: torch.device) -> float:
    """Device microseconds of torch's BatchNorm forward+backward in training (cuDNN's on
    CUDA) on ``x`` and ``dy``, with parameters in the statistics dtype (float32, or float64
    for a float64 input), as a converted model's."""
    source = x.detach().requires_grad_()
    dtype = stat_dtype(x.dtype)
    weight = torch.ones(x.shape[1], dtype=dtype, device=device, requires_grad=True)
    bias = torch.zeros(x.shape[1], dtype=dtype, device=device, requires_grad=True)

    def call() -> None:
        output = torch.nn.functional.batch_norm(source, None, None, weight, bias, training=True)
        torch.autograd.grad(output, (source, weight, bias), dy)

    return _device_us(call, repeats, device)


def probe_passes(
    device: torch.device,
    say: Callable[[str], None],
    shapes: list[tuple[tuple[int, ...], torch.dtype, bool]] = PASS_SHAPES,
    configs: list[tuple[int, int, int]] = PASS_CONFIGS,
    repeats: int = 20,
    seconds: float = 50.0,
) -> None:
    """Device time and bandwidth of Triton's four passes per shape, tiling and mask (see the
    module's docstring), against cuDNN BatchNorm's; stops starting shapes after
    ``seconds``. On the CPU, Triton's interpreter must be on (a dry run of the code)."""
    from syncbn._kernels import triton_passes as passes

    deadline = time.monotonic() + seconds
    for shape, dtype, channels_last in shapes:
        if time.monotonic() > deadline:
            say(f"passes: stopped after {seconds:.0f} s, before {shape}")
            return
        layout = "channels_last" if channels_last else "contiguous"
        name = f"passes {'x'.join(map(str, shape))} {str(dtype)[6:]} {layout}"
        try:
            x = torch.randn(shape, device=device, dtype=dtype)
            if channels_last:
                x = x.contiguous(memory_format=torch.channels_last)
            dy = torch.randn_like(x)
            size = x.numel() * x.element_size()
            bn_us = _cudnn_us(x, dy, repeats, device)
            bandwidth = 8 * size / bn_us / 1e3
            say(f"{name}: cuDNN BN forward+backward {bn_us:.1f} us ({bandwidth:.0f} GB/s, 8 moves)")
            valid = torch.rand((shape[0], 1, *shape[2:]), device=device) < PASS_VALID
            rows = [(config, None) for config in configs] + [(configs[0], valid)]
            unmasked_us = 0.0
            for (block_c, block_l, programs), mask in rows:
                with _tiling(passes, block_c, block_l, programs):
                    calls = _pass_calls(passes, x, dy, mask)
                    times = {key: _device_us(call, repeats, device) for key, call in calls.items()}
                total = sum(times.values())
                cells = [
                    f"{key} {us:.1f} us ({PASS_MOVES[key] * size / us / 1e3:.0f} GB/s)"
                    for key, us in times.items()
                ]
                label = f"tiles {block_c}x{block_l}, {programs} programs"
                verdict = f"{total / bn_us:.2f}x cuDNN BN"
                if mask is None:
                    unmasked_us = unmasked_us or total  # the first row: the default tiling
                else:
                    label += f", masked ({PASS_VALID:.0%} valid)"
                    verdict += f", {total / unmasked_us:.2f}x unmasked"
                say(f"{name}, {label}: {', '.join(cells)}; 4 passes {total:.1f} us = {verdict}")
        except Exception as error:  # noqa: BLE001 - reported, and the next shape runs
            say(f"{name}: failed: {type(error).__name__}: {str(error)[:300]}")
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="folder for probe.txt and prof-*.txt")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (a dry run)")
    parser.add_argument(
        "--passes", action="store_true", help="only the sweep of Triton's passes (no ranks)"
    )
    parser.add_argument(
        "--bf16", action="store_true", help="the bf16 diagnostics first (answered: see 1.)"
    )
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    args.out.mkdir(parents=True, exist_ok=True)
    lines: list[str] = []

    def say(line: str) -> None:
        print(line, flush=True)
        lines.append(line)
        (args.out / "probe.txt").write_text("\n".join(lines) + "\n")

    if args.passes:
        probe_passes(device, say)
        return 0
    backend = "nccl" if device.type == "cuda" else "gloo"
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group(backend, init_method=f"file://{tmp}/r", rank=0, world_size=1)
        try:
            if args.bf16:
                probe_bf16(device, say)
                probe_bf16_on_ranks(device, say)  # the failing tests' transport: gloo, CUDA
            costs = calibrate(device, say)
            profile_calls(device, args.out, say, costs)
        finally:
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
