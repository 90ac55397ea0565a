"""syncbn._kernels.cuda's maths on the CPU, with torch's CUDA-only element kernels emulated.

``torch.batch_norm_elemt`` and ``torch.batch_norm_backward_elemt`` exist only for CUDA
tensors. Here they are replaced by the formulas torch.nn.SyncBatchNorm relies on, and CPU
tensors are routed to the CUDA kernel module, so that the gold comparison checks how syncbn
calls them: the shift folded into the offset, the weight and ``sum(dy * (x - mean))``
recovered from the saved statistics, the count tensor, dtypes and memory formats, and the
generic fallbacks. ``tests/test_cuda.py`` runs the same kernels for real on a GPU.
"""

from __future__ import annotations

import contextlib
import re
import sys
import types
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from _gold import Case, compare, reference, run_rank
from _harness import WorkerPool
from test_batchnorm import _NEEDS_CPU_FLOAT16
from test_collectives import _large_mean_statistics, assert_large_mean_accurate
from test_masked import MaskedCase, _assert_matches, _run_masked
from test_op_budget import _Ops

from syncbn import _autograd, _kernels, _protocol


def _channel(vector: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return vector.view([1, -1] + [1] * (like.dim() - 2))


def _elemt(
    input: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    mean: torch.Tensor,
    invstd: torch.Tensor,
    eps: float,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``(x - mean) * invstd * weight + bias`` (into ``out``, which may be ``input``)."""
    output = (input - _channel(mean, input)) * _channel(invstd, input)
    if weight is not None:
        output = output * _channel(weight, input)
    if bias is not None:
        output = output + _channel(bias, input)
    return output if out is None else out.copy_(output)


def _backward_elemt(
    grad_output: torch.Tensor,
    input: torch.Tensor,
    mean: torch.Tensor,
    invstd: torch.Tensor,
    weight: torch.Tensor | None,
    sum_dy: torch.Tensor,
    sum_dy_xmu: torch.Tensor,
    count: torch.Tensor,
) -> torch.Tensor:
    """``(dy - sum_dy / N - (x - mean) * invstd**2 * sum_dy_xmu / N) * invstd * weight``
    with ``N = count.sum()`` (an int32 tensor of per-rank counts)."""
    assert count.dtype == torch.int32, count.dtype
    assert grad_output.is_contiguous(memory_format=_format(input)), "layouts differ"
    total = count.sum().to(mean.dtype)
    factor = invstd * invstd * sum_dy_xmu / total
    scale = invstd if weight is None else invstd * weight
    centered = (input - _channel(mean, input)) * _channel(factor, input)
    return (grad_output - _channel(sum_dy / total, input) - centered) * _channel(scale, input)


def _format(tensor: torch.Tensor) -> torch.memory_format:
    for format in (torch.channels_last, torch.channels_last_3d):
        if not tensor.is_contiguous() and tensor.is_contiguous(memory_format=format):
            return format
    return torch.contiguous_format


@contextlib.contextmanager
def counted_cuda_ops(
    calls: Counter[str], elemt: Any = None, backward_elemt: Any = None
) -> Iterator[None]:
    """``torch.batch_norm_elemt`` and ``torch.batch_norm_backward_elemt`` counted in
    ``calls`` (and replaced by ``elemt`` and ``backward_elemt``, where given)."""
    saved = torch.batch_norm_elemt, torch.batch_norm_backward_elemt

    def counted(name: str, fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> torch.Tensor:
            calls[name] += 1
            return fn(*args, **kwargs)  # type: ignore[no-any-return]

        return call

    torch.batch_norm_elemt = counted("elemt", elemt or saved[0])  # type: ignore[assignment]
    torch.batch_norm_backward_elemt = counted(  # type: ignore[assignment]
        "backward_elemt", backward_elemt or saved[1]
    )
    try:
        yield
    finally:
        torch.batch_norm_elemt, torch.batch_norm_backward_elemt = saved  # type: ignore[assignment]


@contextlib.contextmanager
def _emulated_cuda_kernels(calls: Counter[str]) -> Iterator[None]:
    """CPU tensors use syncbn._kernels.cuda, its CUDA-only ops the formulas above."""
    with counted_cuda_ops(calls, _elemt, _backward_elemt):
        _kernels._BY_DEVICE_TYPE["cpu"] = _kernels.cuda
        try:
            yield
        finally:
            _kernels._BY_DEVICE_TYPE.pop("cpu")


def expected_calls(case: Case, rank: int, fused: bool) -> dict[str, int]:
    """The fused ops a rank calls over ``case``: one of each per step with a local batch."""
    if not fused or case.sizes[rank] == 0:  # an empty rank has nothing to normalize
        return {}
    return {"elemt": case.steps, "backward_elemt": case.steps}


def _run_rank_emulated(rank: int, world_size: int, case: Case) -> dict[str, Any]:
    calls: Counter[str] = Counter()
    with _emulated_cuda_kernels(calls):
        result = run_rank(rank, world_size, case)
    return result | {"calls": dict(calls)}


CASES = {
    "float64-uneven-empty": (Case(sizes=(3, 0, 2), tail=(3, 4, 5)), True),
    "float32": (Case(sizes=(2, 3, 1), dtype="float32", tail=(4, 6, 6)), True),
    "float32-channels-last": (
        Case(sizes=(1, 0, 4), dtype="float32", tail=(4, 6, 6), channels_last=True),
        True,
    ),
    "channels-last-3d": (Case(sizes=(2, 1, 1), tail=(2, 3, 2, 4), channels_last=True), True),
    "no-affine-momentum-none": (Case(sizes=(2, 2, 1), affine=False, momentum=None), True),
    # the GPU default: the global count stays a device tensor, the kernel's int32 count too
    "float32-deferred-checks": (
        Case(sizes=(2, 3, 1), dtype="float32", tail=(4, 6, 6), extra={"check_mode": "deferred"}),
        True,
    ),
    # low precision keeps the generic passes (the fused ones would compute in bfloat16)
    "bfloat16-float32-params": (
        Case(sizes=(3, 1, 2), dtype="bfloat16", param_dtype="float32", tail=(4, 6, 6)),
        False,
    ),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.timeout(120)  # the scenario's own bound plus the pool's start
def test_cuda_kernels_with_emulated_ops_match_batchnorm_on_the_global_batch(
    pool3: WorkerPool, name: str
) -> None:
    case, fused = CASES[name]
    per_rank = pool3.run(_run_rank_emulated, case, timeout=60.0)
    compare(case, per_rank, reference(case))
    for rank, result in enumerate(per_rank):
        assert result["calls"] == expected_calls(case, rank, fused), (rank, result["calls"])


def test_use_device_kernels_selects_and_deselects_the_candidate() -> None:
    device = torch.device("cuda")
    assert _kernels.kernels_for(device) is _kernels.generic  # type: ignore[comparison-overlap]
    _kernels.use_device_kernels("cuda")
    try:
        assert _kernels.kernels_for(device) is _kernels.cuda  # type: ignore[comparison-overlap]
    finally:
        _kernels.use_device_kernels("cuda", enabled=False)
    assert _kernels.kernels_for(device) is _kernels.generic  # type: ignore[comparison-overlap]
    with pytest.raises(ValueError, match="no device-specific kernels for device type 'mps'"):
        _kernels.use_device_kernels("mps")


@pytest.mark.parametrize("version", ["3.1.0", "3.0.0+git1c3ae6b", "2.3.1"])
def test_the_triton_kernels_refuse_a_triton_older_than_3_2(
    version: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # (a stand-in module: CI's torch has no Triton; the check reads only its version)
    monkeypatch.setitem(sys.modules, "triton", types.SimpleNamespace(__version__=version))
    expected = rf"need Triton >= 3\.2 \(torch >= 2\.6 .*but Triton {re.escape(version)} is"
    with pytest.raises(RuntimeError, match=expected):
        _kernels.use_fused_finalize("cuda")
    assert _kernels.fused_finalize_for(torch.device("cuda")) is None


def test_triton_versions_compare_as_numbers() -> None:
    assert _kernels._triton_version("3.2.0+git1c3ae6b") == (3, 2)
    assert _kernels._triton_version("3.10.1") > _kernels.MIN_TRITON > (3, 1)
    with pytest.raises(RuntimeError, match="cannot read Triton's version 'dev'"):
        _kernels._triton_version("dev")


def _large_mean_emulated(rank: int, world_size: int, sizes: tuple[int, ...]) -> dict[str, Any]:
    calls: Counter[str] = Counter()
    with _emulated_cuda_kernels(calls):
        result = _large_mean_statistics(rank, world_size, sizes, False)
    assert sizes[rank] == 0 or calls["elemt"] == 1, calls
    return result


@pytest.mark.timeout(120)  # the scenario's own bound plus the pool's start
def test_float32_mean_1e4_std_1_stays_accurate_through_the_fused_pass(pool3: WorkerPool) -> None:
    """The output pass takes the shifted copy and the offset computed in float64: float32
    data with |mean| / std = 1e4 normalizes to 1e-5, as on the generic path."""
    sizes = (2, 0, 6)
    assert_large_mean_accurate(sizes, pool3.run(_large_mean_emulated, sizes, timeout=60.0))


def _masked_emulated(rank: int, world_size: int, case: MaskedCase) -> dict[str, Any]:
    calls: Counter[str] = Counter()
    with _emulated_cuda_kernels(calls):
        result = _run_masked(rank, world_size, case)
    return result | {"calls": dict(calls)}


@pytest.mark.timeout(120)  # the scenario's own bound plus the pool's start
def test_masked_calls_fuse_the_input_gradient_only(pool3: WorkerPool) -> None:
    """A masked call's output pass stays generic (it zeroes padded positions), its input
    gradient is the fused pass (backward zeroes the padded positions of its inputs before
    and of its output after): the gathered-valid-positions reference still holds, NaN at
    padded positions included."""
    case = MaskedCase(sizes=(3, 0, 4), valid=(0.6, 0.5, 0.7), tail=(3, 4, 5))
    per_rank = pool3.run(_masked_emulated, case, timeout=60.0)
    _assert_matches(case, per_rank)
    for size, result in zip(case.sizes, per_rank):
        assert result["calls"] == ({"backward_elemt": case.steps} if size else {}), result


@pytest.mark.parametrize("count", [0, 1, 7, 2**31 - 1, 2**31, 2**31 + 1, 5_000_000_001])
def test_the_kernel_count_holds_counts_beyond_int32(count: int) -> None:
    """``batch_norm_backward_elemt`` sums an int32 count tensor: a global count above
    2**31 - 1 values per channel (many ranks of large volumes) is given in parts that
    each fit, and sum to it, whether the count is a number or a device tensor."""
    from syncbn._kernels.cuda import _kernel_count

    device = torch.device("cpu")
    for given in (count, torch.tensor(float(count), dtype=torch.float64)):
        parts = _kernel_count(given, device)
        assert parts.dtype == torch.int32, parts.dtype
        assert int(parts.sum(dtype=torch.int64)) == count, (given, parts)
        assert bool((parts >= 0).all()), parts


@pytest.mark.parametrize(
    "build",
    [
        lambda device: _kernels.generic.constants(3, torch.float32, device),
        # every constant of the buffer protocol (head, trailer, header slots) is built here
        lambda device: _protocol.on_device([1.0, 2.0], torch.float64, device),
        lambda device: _autograd.counted_update(0.123, device),
        lambda device: _kernels.cuda._part_offsets(device),
        lambda device: _autograd.count_divisors(torch.tensor(3.0, dtype=torch.float64), device),
    ],
    ids=[
        "kernel-constants",
        "protocol-constants",
        "counted-update",
        "count-parts",
        "divisor-terms",
    ],
)
def test_device_constants_are_never_built_during_a_graph_capture(
    build: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cached constant built inside a CUDA graph capture would be filled only at replay
    (eager calls would read garbage first): syncbn asks for a warm-up step instead. On
    the CPU the capture is simulated: a "cuda" device whose stream reports capturing, so
    that the check must come before anything touches the device."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="a CUDA graph is being captured.*warm-up"):
        build(torch.device("cuda"))


@pytest.mark.parametrize(
    ("device", "dtype"),
    [
        ("cpu", torch.bfloat16),
        pytest.param("cpu", torch.float16, marks=_NEEDS_CPU_FLOAT16),
        ("cpu", torch.float32),
        ("meta", torch.bfloat16),
        ("meta", torch.float16),
        ("meta", torch.float32),
    ],
)
def test_low_precision_backward_sums_are_taken_from_float32_off_the_cpu(
    device: str, dtype: torch.dtype
) -> None:
    """torch's CUDA ``native_batch_norm_backward`` accumulates float16 and bfloat16 data in
    their own dtype (both GPU leases' bfloat16 gold failures: a bias gradient of 0.1855
    against 0.1213; the second lease's probe found it exact from float32 copies,
    benchmarks/gpu_probe.py). The generic
    backward sums convert such data to float32 first off the CPU (here the meta device, for
    any device that is not the CPU), and pass it as it is to the CPU kernel, which is exact."""
    grad_output = torch.randn(4, 3, 2, 2).to(dtype).to(device)
    input = torch.randn(4, 3, 2, 2).to(dtype).to(device)
    mean, var = torch.zeros(3, device=device), torch.ones(3, device=device)
    with _Ops() as ops:
        sum_dy, sum_dy_xhat = _kernels.generic.backward_reduce(grad_output, input, mean, var, 1e-5)
    seen = [
        (args[0].dtype, args[1].dtype)
        for func, args, _ in ops.calls
        if func.overloadpacket.__name__ == "native_batch_norm_backward"
    ]
    converted = device != "cpu" and dtype != torch.float32
    expected = torch.float32 if converted else dtype
    assert seen == [(expected, expected)]
    assert sum_dy.dtype == sum_dy_xhat.dtype == torch.float32
    if device == "cpu":  # the sums themselves, against float64
        exact = grad_output.double().sum((0, 2, 3))
        torch.testing.assert_close(sum_dy.double(), exact, rtol=1e-6, atol=1e-6)
