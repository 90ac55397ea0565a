"""syncbn._kernels.finalize: Triton kernels for a deferred call's small work around its
collectives (the packing, the header's checks, the per-channel maths, the backward's
corrections), and a one-pass output; with it, syncbn._kernels.triton_passes: the passes
over the data, masked or not.

It must compute what the generic code computes: the saved statistics, the output, the
running statistics and the batch counter, and the header values of the deferred check, in
every dtype, with uneven and empty ranks, a cumulative average, masked calls (NaN at
padded positions, all padded, a single valid position), failing checks that move nothing,
and a checkpointed recomputation that moves nothing. Triton comes with torch's
CUDA builds, not with CI's CPU build: CI runs this file in the environment of the optional
integrations (``.ci/ecosystem``, torch's CUDA build, no GPU), where the kernel runs on CPU
tensors through Triton's interpreter; on a GPU machine it runs compiled, on CUDA tensors.
Since the interpreter runs what Triton's compiler may refuse, every signature that the
tests launch is also compiled for A100 and H100 GPUs (sm_80, sm_90) with ptxas, no GPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import itertools
import json
import os
import pickle
import re
import subprocess
import sys
import tempfile
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import torch.utils.checkpoint
from _gold import Case, Tolerance, compare, reference, run_rank
from _harness import WorkerPool
from _triton_compile import CompileJob
from test_faults import (
    _caught_failure_then_training,
    _deferred_problems,
    assert_deferred_problem_surfaced,
    assert_recovered_after_step_1,
)
from test_masked import MaskedCase, _assert_matches, _run_masked
from test_op_budget import _Ops, train_call

import syncbn
from syncbn import _kernels
from syncbn._autograd import LayerInfo, LocalReducer, TrainOptions

triton = pytest.importorskip(
    "triton",
    minversion=".".join(map(str, _kernels.MIN_TRITON)),
    reason="needs Triton >= 3.2 (torch >= 2.6's CUDA builds install it)",
)

#: on a GPU machine the kernel runs compiled on CUDA tensors, elsewhere interpreted on the CPU
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
#: there, it is one of the GPU checks (``bash .ci/gpu tests``: ``-m cuda``)
#: every test reads the deferred checks its calls left (tests/conftest.py)
pytestmark = [pytest.mark.usefixtures("no_checks_left_pending")]
if DEVICE == "cuda":
    pytestmark.append(pytest.mark.cuda)


#: the module's functions that syncbn._autograd calls, counted by :func:`fused_finalize`
FUSED_CALLS = ("pack_forward", "finalize_forward", "pack_backward", "finalize_backward")


def _import_interpreted() -> None:
    """With ``TRITON_INTERPRET`` set: the modules of :data:`KERNELS` imported again where an
    earlier test imported them without it (their kernels compiled, which cannot launch on
    CPU tensors: tests/test_bench.py runs benchmarks/gpu.py's masked part on the CPU,
    whose candidate variants then fail as they should, but left this whole file failing
    in a suite run where Triton is installed)."""
    from triton.runtime.jit import JITFunction  # (the interpreter's kernels are not one)

    for short in ("triton_passes", "finalize"):  # finalize imports triton_passes
        module = sys.modules.get(f"syncbn._kernels.{short}")
        # (a test may have replaced the kernel, recorded_launches: then it is no JITFunction)
        if module is not None and isinstance(getattr(module, KERNELS[short][0]), JITFunction):
            importlib.reload(module)


@contextlib.contextmanager
def fused_finalize(triton_passes: bool = True) -> Iterator[Counter[str]]:
    """The fused kernels on for :data:`DEVICE` (on the CPU through Triton's interpreter,
    which Triton reads when a kernel is defined: at the module's first import), with the
    passes over the data of syncbn._kernels.triton_passes or (``triton_passes=False``) the
    generic kernels; yields how many times each of :data:`FUSED_CALLS` ran, so that a test
    knows it took that path."""
    interpret = DEVICE == "cpu" and "TRITON_INTERPRET" not in os.environ
    if interpret:
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        if DEVICE == "cpu":
            _import_interpreted()
        _kernels.use_fused_finalize(DEVICE, triton_passes=triton_passes)
    finally:
        if interpret:
            del os.environ["TRITON_INTERPRET"]
    from syncbn._kernels import finalize

    calls: Counter[str] = Counter()
    originals = {name: getattr(finalize, name) for name in FUSED_CALLS}

    def counted(name: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return originals[name](*args, **kwargs)

        return call

    replacements: dict[str, Any] = {name: counted(name) for name in FUSED_CALLS}
    try:
        with mock.patch.multiple(finalize, **replacements):
            yield calls
    finally:
        _kernels.use_fused_finalize(DEVICE, enabled=False)


def _steps(
    fused: bool, dtype: torch.dtype, param_dtype: torch.dtype | None, case: dict[str, Any]
) -> Any:
    """Two deferred training calls of one process (the one-process reducer) and what they
    leave: outputs, gradients, running statistics, batch counter; or the error raised and
    the buffers that the failing calls left."""
    torch.manual_seed(0)
    n, momentum, running = case["n"], case["momentum"], case["running"]
    x = torch.randn(n, 8, 3, 3, dtype=torch.float64) * 3 + 5
    dy = torch.randn(n, 8, 3, 3, dtype=torch.float64)
    mask = _mask(n, case.get("valid"))
    if mask is not None:  # NaN where padded: nothing there may reach a result
        x, dy = (t.masked_fill(~mask.unsqueeze(1), float("nan")) for t in (x, dy))
        mask = mask.to(DEVICE)
    x, dy = x.to(DEVICE, dtype), dy.to(DEVICE, dtype)
    param_dtype = param_dtype or dtype
    weight = bias = running_mean = running_var = num_batches_tracked = None
    if case["affine"]:
        weight = (torch.rand(8, dtype=torch.float64) + 0.5).to(DEVICE, param_dtype)
        bias = torch.randn(8, dtype=torch.float64).to(DEVICE, param_dtype)
    if running:
        running_mean = torch.randn(8, dtype=torch.float64).to(DEVICE, param_dtype)
        running_var = (torch.rand(8, dtype=torch.float64) + 1).to(DEVICE, param_dtype)
        num_batches_tracked = torch.tensor(3, device=DEVICE)
    layer = LayerInfo("finalize", 8, check_mode="deferred")
    options = TrainOptions(LocalReducer(), layer, eps=1e-5, momentum=momentum)
    leaves = [t.requires_grad_() for t in (x, weight, bias) if t is not None]
    results: list[torch.Tensor] = []
    passes = case.get("passes", "triton") == "triton"
    with fused_finalize(passes) if fused else contextlib.nullcontext() as calls:
        for _ in range(2):
            try:
                y = train_call(
                    x, weight, bias, options, running_mean, running_var, num_batches_tracked, mask
                )
                results += [y, *torch.autograd.grad(y, leaves, dy)]
            except (RuntimeError, ValueError) as error:  # and what the failing calls left
                buffers = (running_mean, running_var, num_batches_tracked)
                return [str(error)] + [b.cpu() for b in buffers if b is not None]
            if calls is not None:  # the fused path ran, forward and backward
                _assert_fused(calls)
    buffers = (running_mean, running_var, num_batches_tracked)
    return [t.detach().cpu() for t in results + [b for b in buffers if b is not None]]


def _mask(n: int, valid: float | str | None) -> torch.Tensor | None:
    """A mask of ``(n, 3, 3)`` positions: each valid with probability ``valid``, or
    exactly one valid position (``"one"``, a global count of 1); ``None``: no mask."""
    if valid is None:
        return None
    generator = torch.Generator().manual_seed(1)
    fraction = 0.0 if valid == "one" else float(valid)
    mask = torch.rand(n, 3, 3, generator=generator) < fraction
    if valid == "one":
        mask.view(-1)[4] = True
    return mask


def _assert_fused(calls: Counter[str]) -> None:
    """Every call took the fused kernels, forward and backward."""
    assert len(set(calls.values())) == 1 and calls["pack_forward"] > 0, calls


def _prefixed(prefix: str) -> Callable[[str], str]:
    return lambda message: f"{prefix}: {message}"


#: (input dtype, parameter dtype): float32 parameters for low-precision input, as torch's
LAYER_DTYPES = [
    (torch.float64, None),
    (torch.float32, None),
    (torch.float32, torch.float64),
    (torch.bfloat16, torch.float32),
    (torch.float16, torch.float32),
    (torch.bfloat16, None),
]


def _assert_same_as_generic(dtypes: tuple[torch.dtype, Any], cases: list[dict[str, Any]]) -> None:
    """Each case's deferred training calls (:func:`_steps`) give the same results and the
    same errors with the fused kernels as with the generic maths."""
    compared = 0
    for case in cases:
        generic, fused = _steps(False, *dtypes, case), _steps(True, *dtypes, case)
        if isinstance(generic[0], str) or isinstance(fused[0], str):
            assert fused[0] == generic[0], case
            generic, fused = generic[1:], fused[1:]
        assert len(fused) == len(generic), case
        for actual, expected in zip(fused, generic):
            tolerance: Tolerance
            if expected.dtype == torch.bfloat16:
                # Triton's interpreter rounds a conversion to bfloat16 towards zero, where
                # a GPU rounds to nearest, as torch does: a running statistic converts
                # twice (its target, its new value), one unit in the last place each
                tolerance = {"rtol": 2**-6, "atol": 2**-6}
            elif expected.dtype == torch.float16:
                tolerance = {"rtol": 1e-3, "atol": 1e-3}
            elif expected.dtype == torch.float32:
                tolerance = {"rtol": 1e-6, "atol": 1e-6}
            else:
                tolerance = {"rtol": 1e-12, "atol": 1e-12}
            torch.testing.assert_close(actual, expected, **tolerance, msg=_prefixed(str(case)))
            compared += 1
    assert compared > 0


def _cases(batches: list[int], valid: list[Any]) -> list[dict[str, Any]]:
    """Every combination of affine, running statistics, momentum (or a cumulative
    average), local batch size and mask (``valid``, see :func:`_mask`)."""
    combinations = itertools.product([True, False], [True, False], [0.1, None], batches, valid)
    return [
        dict(affine=affine, running=running, momentum=momentum, n=n, valid=fraction)
        for affine, running, momentum, n, fraction in combinations
    ]


@pytest.mark.parametrize("dtypes", LAYER_DTYPES, ids=lambda d: "-".join(str(t)[6:] for t in d if t))
def test_one_process_equals_the_generic_maths(dtypes: tuple[torch.dtype, Any]) -> None:
    """Local batches of 4, 1 and 0 (an empty batch), without a mask."""
    _assert_same_as_generic(dtypes, _cases([4, 1, 0], [None]))


@pytest.mark.parametrize("dtypes", LAYER_DTYPES, ids=lambda d: "-".join(str(t)[6:] for t in d if t))
def test_masked_calls_equal_the_generic_maths(dtypes: tuple[torch.dtype, Any]) -> None:
    """Masked calls (NaN at padded positions): 60 % of the positions valid, none (an empty
    global batch: nothing moves), and a single one (the count of 1 raises, and moves
    nothing)."""
    _assert_same_as_generic(dtypes, _cases([4], [0.6, 0.0, "one"]))


@pytest.mark.parametrize(
    "dtypes", LAYER_DTYPES[1::2], ids=lambda d: "-".join(str(t)[6:] for t in d if t)
)
def test_the_fused_maths_with_the_generic_passes_equal_the_generic_maths(
    dtypes: tuple[torch.dtype, Any],
) -> None:
    """The fused kernels with the generic kernels' passes over the data (the benchmarks'
    ``syncbn-finalize-generic-passes``, and every input whose strides Triton's passes do
    not take): local batches of 4 and 0, unmasked and masked."""
    cases = [case | {"passes": "generic"} for case in _cases([4, 0], [None, 0.6])]
    _assert_same_as_generic(dtypes, cases)


def _layer_call(
    fused: bool,
    x: torch.Tensor,
    mask: torch.Tensor | None,
    make_grad: Callable[[torch.Tensor], torch.Tensor],
) -> list[torch.Tensor]:
    """One deferred training call of a ``(N, C, *)`` float64 batch (one process), masked or
    not: the output, the input, weight and bias gradients, the running statistics."""
    channels = x.shape[1]
    generator = torch.Generator().manual_seed(2)
    weight = torch.rand(channels, generator=generator, dtype=x.dtype) + 0.5
    bias = torch.randn(channels, generator=generator, dtype=x.dtype)
    x, weight, bias = (t.to(DEVICE).requires_grad_() for t in (x, weight, bias))
    running_mean = torch.zeros(channels, dtype=x.dtype, device=DEVICE)
    running_var = torch.ones(channels, dtype=x.dtype, device=DEVICE)
    num_batches_tracked = torch.tensor(0, device=DEVICE)
    buffers = (running_mean, running_var, num_batches_tracked)
    options = TrainOptions(LocalReducer(), LayerInfo("passes", channels, check_mode="deferred"))
    on_device = None if mask is None else mask.to(DEVICE)
    with fused_finalize() if fused else contextlib.nullcontext() as calls:
        y = train_call(x, weight, bias, options, *buffers, on_device)
        gradients = torch.autograd.grad(y, (x, weight, bias), make_grad(y))
        if calls is not None:
            _assert_fused(calls)
    return [t.detach().cpu() for t in (y, *gradients, running_mean, running_var)]


#: (input shape, mask shape, layout): several blocks of channels and of positions, masks
#: that broadcast over samples or positions, a (N, C) batch, channels last in 4-D and 5-D
PASSES_CASES = [
    ((5, 37, 9, 11), (5, 9, 11), "contiguous"),
    ((5, 37, 9, 11), (5, 9, 11), "channels_last"),
    ((3, 20, 2, 5, 7), (3, 1, 1, 7), "channels_last"),
    ((6, 19, 70), (70,), "contiguous"),
    ((40, 33), (40,), "contiguous"),
]


@pytest.mark.parametrize(
    "shares, masked",
    [(None, True), (2, True), (None, False)],
    ids=["masked-many-programs", "masked-two-programs", "unmasked"],
)
@pytest.mark.parametrize("case", PASSES_CASES, ids=lambda case: f"{case[2]}-{len(case[0])}d")
def test_triton_passes_equal_the_generic_passes(
    case: tuple[tuple[int, ...], tuple[int, ...], str], shares: int | None, masked: bool
) -> None:
    """The Triton passes of syncbn._kernels.triton_passes against the generic kernels'
    passes, in float64 (1e-10), masked (NaN and inf at padded positions of the input and
    the output gradient) and not; with an output gradient of other strides (the expanded
    gradient of a sum); with a reduction spread over many programs, and over 2 (many tiles
    each)."""
    _assert_passes_equal_the_generic_ones(case, shares, masked)


@pytest.mark.parametrize("masked", [False, True], ids=["unmasked", "masked"])
@pytest.mark.parametrize("case", PASSES_CASES, ids=lambda case: f"{case[2]}-{len(case[0])}d")
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=str)
def test_the_shift_kernel_equals_the_generic_shift(
    case: tuple[tuple[int, ...], tuple[int, ...], str], masked: bool, dtype: torch.dtype
) -> None:
    """triton_passes.shift_of's one kernel against the generic code's median of 9
    (sample_shift): bitwise, in every layout, masked with NaN at padded positions, with an
    outlier at one of its 9 positions, and with every position padded (zeros)."""
    with fused_finalize():  # the first import of the kernels: interpreted on the CPU
        from syncbn._kernels import triton_passes
    from syncbn._kernels.generic import channel_view, first_valid_sample, sample_shift

    shape, mask_shape, layout = case
    generator = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=generator, dtype=torch.float64) * 4 + 100).to(dtype)
    lattice = triton_passes.shift_lattice(x.shape)
    outlier: list[int | slice] = list(lattice.start)
    outlier[1] = slice(None)
    x[tuple(outlier)] = 1e4
    if layout == "channels_last":
        x = x.contiguous(
            memory_format=torch.channels_last if x.dim() == 4 else torch.channels_last_3d
        )
    x = x.to(DEVICE)
    masks: list[torch.Tensor | None] = [None]
    if masked:
        some = torch.rand(mask_shape, generator=generator) < 0.5
        masks = [some, torch.zeros(mask_shape, dtype=torch.bool)]
    for mask in masks:
        valid = None
        expected_input = x
        if mask is not None:
            valid = mask.to(DEVICE).expand(shape[0], *shape[2:]).unsqueeze(1)
            expected_input = x.masked_fill(~valid, float("nan"))
        fallback = None
        if valid is not None:
            first = first_valid_sample(expected_input, valid)
            fallback = channel_view(first, x.dim())
        expected = sample_shift(expected_input, valid, fallback).view(-1)
        actual = triton_passes.shift_of(expected_input, valid)
        assert actual.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
        torch.testing.assert_close(actual, expected.to(actual.dtype), rtol=0, atol=0)
        assert bool(actual.isfinite().all())
        assert bool((actual != 1e4).all())  # the outlier is never the shift
        if mask is not None and not bool(mask.any()):
            assert bool((actual == 0).all())


#: tiles other than the default, ``(channels, positions)``, which benchmarks/gpu_probe.py
#: times on a GPU: wide in channels, square, and small (many blocks of both)
OTHER_TILES = [(64, 16), (32, 32), (8, 16)]


@pytest.mark.parametrize("tiles", OTHER_TILES, ids=lambda tiles: "x".join(map(str, tiles)))
@pytest.mark.parametrize("case", PASSES_CASES[1:4], ids=lambda case: f"{case[2]}-{len(case[0])}d")
def test_other_tiles_give_the_same_passes(
    case: tuple[tuple[int, ...], tuple[int, ...], str], tiles: tuple[int, int]
) -> None:
    """The passes with the other tiles that the GPU probe times (so that a GPU run may make
    one of them the default) equal the generic kernels' passes too, masked, over 3
    programs per reduction."""
    _assert_passes_equal_the_generic_ones(case, 3, True, tiles)


def _assert_passes_equal_the_generic_ones(
    case: tuple[tuple[int, ...], tuple[int, ...], str],
    shares: int | None,
    masked: bool,
    tiles: tuple[int, int] | None = None,
) -> None:
    """:func:`test_triton_passes_equal_the_generic_passes`' check, with ``shares``
    programs per reduction (``None``: the default) and ``tiles`` (``(channels,
    positions)``; ``None``: the default)."""
    with fused_finalize():  # the first import of the kernels: interpreted on the CPU
        from syncbn._kernels import triton_passes

    block_c, block_l = tiles or (triton_passes._BLOCK_C, triton_passes._BLOCK_L)

    shape, mask_shape, layout = case
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=generator, dtype=torch.float64) * 4 + 100
    dy = torch.randn(shape, generator=generator, dtype=torch.float64)
    mask = None
    if masked:
        mask = torch.rand(mask_shape, generator=generator) < 0.7
        padded = ~mask.expand(shape[0], *shape[2:]).unsqueeze(1)
        x, dy = x.masked_fill(padded, float("nan")), dy.masked_fill(padded, float("inf"))
    if layout == "channels_last":
        x = x.contiguous(
            memory_format=torch.channels_last if x.dim() == 4 else torch.channels_last_3d
        )
    for make_grad in (
        lambda y: dy.to(y.device),
        lambda y: torch.ones((), device=y.device).expand_as(y),
    ):
        expected = _layer_call(False, x, mask, make_grad)
        programs = shares or triton_passes._REDUCTION_PROGRAMS
        passes = [
            mock.patch.object(triton_passes, name, wraps=getattr(triton_passes, name))
            for name in ("shifted_sums", "normalize", "backward_reduce", "input_grad")
        ]
        with contextlib.ExitStack() as patched:
            patched.enter_context(mock.patch.object(triton_passes, "_REDUCTION_PROGRAMS", programs))
            patched.enter_context(mock.patch.object(triton_passes, "_BLOCK_C", block_c))
            patched.enter_context(mock.patch.object(triton_passes, "_BLOCK_L", block_l))
            sums, output, reduce, grad = (patched.enter_context(p) for p in passes)
            actual = _layer_call(True, x, mask, make_grad)
        assert [f.call_count for f in (sums, output, reduce, grad)] == [1, 1, 1, 1]
        for name, got, want in zip(
            ["output", "grad input", "grad weight", "grad bias", "running mean", "running var"],
            actual,
            expected,
        ):
            # (a weight gradient of a gradient of ones sums 400 values to ~0: its error is
            # the sum's rounding, ~1e-12, not relative to the result)
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10, msg=_prefixed(name))
        assert actual[0].stride() == expected[0].stride(), "the output's memory format"
        assert actual[1].stride() == x.stride(), "the input gradient's memory format"


@pytest.mark.parametrize("masked", [False, True], ids=["unmasked", "masked"])
def test_an_input_without_gradient_still_gives_the_parameters_theirs(masked: bool) -> None:
    """A first layer's input needs no gradient: backward then makes no collective and no
    input gradient, and the Triton passes' sums still give the weight and bias gradients
    (and the output its values) of the generic kernels, in float64."""

    def call(fused: bool) -> list[torch.Tensor]:
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(4, 8, 3, 3, generator=generator, dtype=torch.float64)
        mask = torch.rand(4, 3, 3, generator=generator) < 0.6 if masked else None
        weight = torch.rand(8, generator=generator, dtype=torch.float64) + 0.5
        bias = torch.randn(8, generator=generator, dtype=torch.float64)
        x, weight, bias = x.to(DEVICE), weight.to(DEVICE), bias.to(DEVICE)
        weight.requires_grad_(), bias.requires_grad_()
        options = TrainOptions(LocalReducer(), LayerInfo("first", 8, check_mode="deferred"))
        on_device = None if mask is None else mask.to(DEVICE)
        with fused_finalize() if fused else contextlib.nullcontext():
            y = train_call(x, weight, bias, options, None, None, None, on_device)
            gradients = torch.autograd.grad(y.square().sum(), (weight, bias))
        return [t.detach().cpu() for t in (y, *gradients)]

    for actual, expected in zip(call(True), call(False)):
        torch.testing.assert_close(actual, expected, rtol=1e-10, atol=1e-10)


#: the Triton kernels of syncbn._kernels.finalize and of syncbn._kernels.triton_passes
#: (which a masked call's passes take), by module, as the modules name them
KERNELS = {
    "finalize": (
        "_pack_forward_kernel",
        "_finalize_forward_kernel",
        "_pack_backward_kernel",
        "_finalize_backward_kernel",
    ),
    "triton_passes": (
        "_shift_kernel",
        "_shifted_sums_kernel",
        "_normalize_kernel",
        "_backward_reduce_kernel",
        "_input_grad_kernel",
    ),
}


#: a recorded launch: the module and kernel's name, its arguments, its compile-time constants
Launch = tuple[str, tuple[Any, ...], dict[str, Any]]


@contextlib.contextmanager
def recorded_launches(run: bool = True) -> Iterator[list[Launch]]:
    """Inside :func:`fused_finalize`: records each launch of :data:`KERNELS` (the module
    and kernel's name, its arguments and its compile-time constants), then runs it (or,
    ``run=False``, not: the kernels' outputs stay as allocated)."""
    from syncbn._kernels import finalize, triton_passes

    modules = {"finalize": finalize, "triton_passes": triton_passes}
    launches: list[Launch] = []

    class Recording:
        def __init__(self, module: str, name: str) -> None:
            self.module, self.name = module, name
            self.original = getattr(modules[module], name)

        def __getitem__(self, grid: Any) -> Callable[..., Any]:
            def launch(*args: Any, **constants: Any) -> Any:
                launches.append((f"{self.module}.{self.name}", args, constants))
                return self.original[grid](*args, **constants) if run else None

            return launch

    with contextlib.ExitStack() as patches:
        for module, names in KERNELS.items():
            replacements: dict[str, Any] = {name: Recording(module, name) for name in names}
            patches.enter_context(mock.patch.multiple(modules[module], **replacements))
        yield launches


def _specialized(
    kernel: Any, name: str, args: tuple[Any, ...], constants: dict[str, Any], arch: int
) -> CompileJob:
    """What a launch of ``kernel`` (``name``) with ``args`` compiles for ``sm_<arch>``:
    Triton's launcher specializes the arguments (an integer equal to 1 becomes a constant,
    one divisible by 16 and a pointer aligned to 16 bytes are marked so, an integer beyond
    32 bits is an i64), through its own binder (Triton 3.2 to 3.8's internals: by 3.6 the
    steps after the binder had moved into ``JITFunction._pack_args``; in 3.3 and 3.4
    ``run`` takes them, as :func:`_packed_before_3_6` does; 3.2's binder returns five
    values, and its attributes are an ``AttrsDescriptor``: :func:`_packed_before_3_3`)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(GPUTarget("cuda", arch, 32))
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    binding = binder(*args, **constants)
    if len(binding) == 5:
        return _packed_before_3_3(kernel, name, arch, backend, constants, *binding[:2])
    bound, specialization, options = binding
    if hasattr(kernel, "_pack_args"):
        options, signature, constexprs, attrs = kernel._pack_args(
            backend, constants, bound, specialization, options
        )
    else:
        options, signature, constexprs, attrs = _packed_before_3_6(
            kernel, backend, constants, bound, specialization
        )
    return CompileJob(name, arch, signature, constexprs, attrs, dict(options.__dict__))


def _packed_before_3_6(
    kernel: Any, backend: Any, constants: dict[str, Any], bound: Any, specialization: Any
) -> tuple[Any, Any, Any, Any]:
    """:func:`_specialized`'s options, signature, constant values and attributes as
    Triton 3.3 and 3.4 (torch 2.7 and 2.8) compute them in ``JITFunction.run``."""
    from triton.runtime.jit import find_paths_if, get_iterable_path

    options = backend.parse_options(constants)
    types = [value[0] for value in specialization]
    signature = dict(zip([param.name for param in kernel.params], types))
    constant_paths = find_paths_if(types, lambda _, kind: kind == "constexpr")
    values = list(bound.values())
    constexprs = {path: get_iterable_path(values, path) for path in constant_paths}
    hints = [value[1] for value in specialization]
    hint_paths = find_paths_if(hints, lambda _, hint: isinstance(hint, str))
    attrs = {path: backend.parse_attr(get_iterable_path(hints, path)) for path in hint_paths}
    return options, signature, constexprs, attrs


def _packed_before_3_3(
    kernel: Any,
    name: str,
    arch: int,
    backend: Any,
    constants: dict[str, Any],
    bound: Any,
    types: Any,
) -> CompileJob:
    """:func:`_specialized` as Triton 3.2 (torch 2.6) specializes a launch in
    ``JITFunction.run``: ``types`` are the binder's types and specializations, the
    non-constant parameters' first."""
    values = tuple(bound.values())
    names = [param.name for param in kernel.params if not param.is_constexpr]
    signature = {
        key: "*i8" if kind == "none" else kind for key, kind in zip(names, types[: len(names)])
    }
    attrs = backend.get_attrs_descriptor(kernel.params, values)
    constant_numbers = attrs.get_constants()
    constexprs = {
        param.name: value
        for value, param in zip(values, kernel.params)
        if param.is_constexpr or param.num in constant_numbers or value is None
    }
    options = backend.parse_options(constants)
    return CompileJob(name, arch, signature, constexprs, attrs, dict(options.__dict__))


def _benchmark_pass_launches() -> list[Launch]:
    """The launches of Triton's passes at the shapes, dtypes and layouts of the GPU
    benchmarks (benchmarks/gpu.py's layers and masked calls, benchmarks/gpu_probe.py's
    sweep), masked and not, recorded without running them: their integers specialize
    as the tests' small shapes do not (lengths divisible by 16, one block of positions)."""
    from test_bench import _load

    gpu, probe = _load("gpu"), _load("gpu_probe")
    shapes = [
        ((32, channels, size, size), dtype)
        for channels, size in gpu.RESNET50_SHAPES
        for dtype in gpu.DTYPES.values()
    ]
    shapes += [
        (shape, gpu.DTYPES[name]) for shape in gpu.MASKED_SHAPES for name in gpu.MASKED_DTYPES
    ]
    shapes += [(shape, dtype) for shape, dtype, _ in probe.PASS_SHAPES]
    with fused_finalize():
        from syncbn._kernels import triton_passes
    with recorded_launches(run=False) as launches:
        for shape, dtype in shapes:
            layouts = [torch.contiguous_format] + ([torch.channels_last] if len(shape) == 4 else [])
            for layout, masked in itertools.product(layouts, (False, True)):
                x = torch.empty(shape, dtype=dtype, memory_format=layout)
                x[(0, slice(None)) + (0,) * (len(shape) - 2)] = 0.0  # the shift's values
                valid = torch.ones((shape[0], 1, *shape[2:]), dtype=torch.bool) if masked else None
                for call in probe._pass_calls(triton_passes, x, x, valid).values():
                    call()  # (the four passes as the probe times them)
    return launches


def _compiled_kernels() -> dict[str, Any]:
    """Second copies of the modules of :data:`KERNELS`, whose kernels Triton compiles (where
    the tests interpret the first ones on the CPU): ``triton.jit`` reads
    ``TRITON_INTERPRET`` when it decorates a function."""
    from syncbn._kernels import finalize, triton_passes

    interpret = os.environ.pop("TRITON_INTERPRET", None)
    copies = {}
    try:
        for name, original in (("finalize", finalize), ("triton_passes", triton_passes)):
            spec = importlib.util.spec_from_file_location(f"{name}_compiled", original.__file__)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            copies[name] = module
    finally:
        if interpret is not None:
            os.environ["TRITON_INTERPRET"] = interpret
    return copies


def _ptxas() -> Path | None:
    """The ptxas of Triton's NVIDIA backend (its wheel ships it), if executable."""
    try:
        import triton.backends.nvidia as nvidia
    except ImportError:
        return None
    ptxas = Path(nvidia.__file__).parent / "bin" / "ptxas"
    return ptxas if os.access(ptxas, os.X_OK) else None


@pytest.mark.skipif(_ptxas() is None, reason="needs Triton's NVIDIA backend and its ptxas")
@pytest.mark.skipif(DEVICE == "cuda", reason="on a GPU every test here compiles its kernels")
def test_every_launch_compiles_for_a100_and_h100_gpus() -> None:
    """Each kernel, specialized as Triton's launcher specializes every launch of the parity
    tests (masked calls too), compiles to machine code for sm_80 (A100) and sm_90 (H100,
    H200), with ptxas and no GPU; and so does each of Triton's passes as the GPU
    benchmarks launch it (sm_90).

    Triton's interpreter runs the kernels as Python, and accepts what its compiler
    refuses: before this test, every forward kernel that moves running statistics
    assigned a dtype inside its channel loop ("Loop carried variable running_type is not
    a triton value" in Triton 3.6 to 3.9), which only a GPU run would have found. The
    compiles run in a new process (``tests/_triton_compile.py``): Triton 3.4's interpreter
    leaves ``triton.language`` patched, and every compile after it failed."""
    with fused_finalize(), recorded_launches() as launches:
        for dtypes in LAYER_DTYPES:
            for case in _cases([4, 0], [None]) + _cases([4], [0.6]):
                _steps(True, *dtypes, case)
    compiled = _compiled_kernels()
    expected = {f"{module}.{name}" for module, names in KERNELS.items() for name in names}
    assert {name for name, _, _ in launches} == expected
    # the tests' launches for both GPUs (every dtype); the benchmarks' for the lent
    # machines' (sm_90), one dtype per specialization of the integers and pointers (~10 s
    # where every dtype takes ~30)
    to_compile = [(launch, arch, False) for launch in launches for arch in (80, 90)]
    to_compile += [(launch, 90, True) for launch in _benchmark_pass_launches()]
    jobs: dict[tuple[Any, ...], CompileJob] = {}
    for (name, args, constants), arch, any_dtype in to_compile:
        module, kernel_name = name.split(".")
        job = _specialized(getattr(compiled[module], kernel_name), name, args, constants, arch)
        types = "any" if any_dtype else repr(job.signature)
        jobs.setdefault((name, arch, types, repr(job.constexprs), repr(job.attrs)), job)
    failures = _compile_in_a_new_process(list(jobs.values()))
    assert not failures, "\n".join(failures)


def _compile_in_a_new_process(jobs: list[CompileJob], ttir: bool = False) -> list[str]:
    """:func:`_triton_compile.compile_jobs` (or with ``ttir`` :func:`_triton_compile.triton_ir`)
    in a new Python process, where the interpreter that recorded the launches has patched
    nothing (see ``tests/_triton_compile.py``)."""
    environment = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "jobs.pickle"
        path.write_bytes(pickle.dumps([tuple(job) for job in jobs]))
        script = Path(__file__).with_name("_triton_compile.py")
        done = subprocess.run(
            [sys.executable, str(script), *(["--ttir"] if ttir else []), str(path)],
            env=environment,
            capture_output=True,
            text=True,
            timeout=240,
            check=False,
        )
    assert done.returncode == 0, done.stderr[-4000:]
    results: list[str] = json.loads(done.stdout)
    return results


@pytest.mark.skipif(_ptxas() is None, reason="needs Triton's NVIDIA backend and its ptxas")
@pytest.mark.skipif(DEVICE == "cuda", reason="on a GPU every test here compiles its kernels")
def test_the_shift_kernel_adds_its_offsets_in_64_bits() -> None:
    """The shift's kernel reads its 9 values at offsets that Triton passes as 32-bit
    integers (each under 2**31), and sums of them (``offset + 2 * group_step``) pass 2**31 in
    a tensor of a few billion values: in 32 bits they wrapped to addresses before the
    tensor (a review, 2026-12-08, read it in the IR). No test can allocate such a tensor,
    so the compiled IR is read: every address of the input and the mask is a 64-bit offset.
    """
    kernel = _compiled_kernels()["triton_passes"]._shift_kernel
    data, bits, shift = (
        torch.zeros(16, dtype=torch.bfloat16),
        torch.zeros(16, dtype=torch.uint8),
        torch.zeros(16),
    )
    near = 2**30 + 3  # a 32-bit argument, whose double is not
    jobs = [
        _specialized(
            kernel,
            "triton_passes._shift_kernel",
            (data, bits, data, shift, 16, 3, near, near, 3, near, near, 3),
            {"MASKED": masked, "BLOCK_C": 128},
            90,
        )
        for masked in (False, True)
    ]
    for masked, ir in zip((False, True), _compile_in_a_new_process(jobs, ttir=True)):
        # the kernel's first two parameters: the input's and the mask's pointers
        header = re.search(r"tt\.func public @_shift_kernel\((.*)", ir)
        assert header is not None, ir[:2000]
        input_name, mask_name = re.findall(r"(%[\w.]+): !tt\.ptr", header.group(1))[:2]
        names = [input_name] + ([mask_name] if masked else [])
        offsets = {
            name: re.findall(rf"tt\.addptr {re.escape(name)}, \S+ : !tt\.ptr<\w+>, (\w+)", ir)
            for name in names
        }
        for name, widths in offsets.items():
            assert len(widths) == 9, (masked, name, widths)  # the 9 values of each channel
            assert set(widths) == {"i64"}, (masked, name, widths)


def _fused_rank(rank: int, world_size: int, case: Case) -> dict[str, Any]:
    with fused_finalize() as calls:
        result = run_rank(rank, world_size, case)
    return result | {"fused_calls": dict(calls)}  # type: ignore[no-any-return]


#: the gold cases of tests/test_batchnorm.py that deferred calls take, and more dtypes
GOLD = {
    "2d": Case(sizes=()),
    "1d-NC": Case(sizes=(), tail=(5,)),
    "momentum-none": Case(sizes=(), momentum=None, steps=4),
    "no-running-stats": Case(sizes=(), track_running_stats=False),
    "affine-false": Case(sizes=(), affine=False),
    "offset-scale": Case(sizes=(), offset=3.0, scale=5.0, eps=1e-3),
    "float32-channels-last": Case(sizes=(), dtype="float32", tail=(4, 6, 6), channels_last=True),
    "bfloat16-float32-params": Case(
        sizes=(), dtype="bfloat16", param_dtype="float32", tail=(4, 6, 6)
    ),
}
SIZES: dict[int, list[tuple[int, ...]]] = {2: [(3, 1), (0, 4)], 3: [(2, 0, 3), (1, 1, 1)]}


@pytest.mark.parametrize("sizes_index", [0, 1], ids=["uneven", "with-empty"])
@pytest.mark.parametrize("name", list(GOLD))
def test_gold_on_ranks_equals_batchnorm_on_the_global_batch(
    pool: WorkerPool, name: str, sizes_index: int
) -> None:
    sizes = SIZES[pool.world_size][sizes_index]
    extra = {"check_mode": "deferred", "device": DEVICE}
    case = dataclasses.replace(GOLD[name], sizes=sizes, extra=extra)
    per_rank = pool.run(_fused_rank, case)
    compare(case, per_rank, reference(case))
    for result in per_rank:  # every call took the fused path, forward and backward
        assert result["fused_calls"] == dict.fromkeys(FUSED_CALLS, case.steps), result


def _fused_masked_rank(rank: int, world_size: int, case: MaskedCase) -> dict[str, Any]:
    with fused_finalize() as calls:
        result = _run_masked(rank, world_size, case)
    return result | {"fused_calls": dict(calls)}  # type: ignore[no-any-return]


#: tests/test_masked.py's cases on 2 ranks, NaN at padded positions, deferred checks
MASKED = {
    "uneven": MaskedCase(sizes=(3, 5), valid=(0.6, 0.5)),
    "empty-rank": MaskedCase(sizes=(0, 4), valid=(0.5, 0.6)),
    "all-padded-rank": MaskedCase(sizes=(3, 4), valid=(0.0, 0.7)),
    "channels-last": MaskedCase(sizes=(2, 3), valid=(0.7, 0.5), tail=(3, 4, 5), channels_last=True),
    "2d": MaskedCase(sizes=(6, 4), valid=(0.8, 0.5), tail=(4,)),  # (N, C) input, (N,) mask
}


@pytest.mark.parametrize("name", list(MASKED))
def test_masked_gold_on_ranks_equals_batchnorm_on_the_gathered_valid_positions(
    pool2: WorkerPool, name: str
) -> None:
    """Masked calls with the fused kernels equal torch.nn.BatchNorm1d on the valid
    positions of both ranks gathered into one batch, in float64."""
    case = dataclasses.replace(MASKED[name], check_mode="deferred", device=DEVICE)
    per_rank = pool2.run(_fused_masked_rank, case, timeout=60.0)
    _assert_matches(case, per_rank)
    for result in per_rank:  # every call took the fused kernels, forward and backward
        assert result["fused_calls"] == dict.fromkeys(FUSED_CALLS, case.steps), result


def _checkpointed(rank: int, world_size: int, use_reentrant: bool) -> tuple[Any, Any]:
    torch.manual_seed(0)
    layer = syncbn.SyncBatchNorm(4).to(DEVICE)
    layer.check_mode = "deferred"
    with fused_finalize() as calls:
        for step in range(3):
            x = torch.randn(2, 4, 3, 3, generator=torch.Generator().manual_seed(rank + 10 * step))
            x = x.to(DEVICE).requires_grad_()
            y = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=use_reentrant)
            y.square().sum().backward()
    return {k: v.detach().cpu() for k, v in layer.state_dict().items()}, dict(calls)


def _plain(rank: int, world_size: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    layer = syncbn.SyncBatchNorm(4).to(DEVICE)
    layer.check_mode = "deferred"
    for step in range(3):
        x = torch.randn(2, 4, 3, 3, generator=torch.Generator().manual_seed(rank + 10 * step))
        layer(x.to(DEVICE).requires_grad_()).square().sum().backward()
    return {k: v.detach().cpu() for k, v in layer.state_dict().items()}


@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_a_checkpointed_recomputation_moves_the_running_statistics_once(
    pool2: WorkerPool, use_reentrant: bool
) -> None:
    expected = pool2.run(_plain)[0]
    state, calls = pool2.run(_checkpointed, use_reentrant)[0]
    assert calls["finalize_forward"] == 6  # 3 forwards and their 3 recomputations
    assert state["num_batches_tracked"].item() == 3
    for key, value in expected.items():
        torch.testing.assert_close(state[key], value, rtol=1e-6, atol=1e-6, msg=key)


#: the folder of Triton's package, whose interpreter runs torch ops for a kernel's body
_TRITON_PACKAGE = os.path.dirname(triton.__file__) + os.sep


class _TorchKernels(_Ops):
    """Leaves out what Triton's interpreter runs on the CPU for the kernel itself."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if any(_TRITON_PACKAGE in frame.filename for frame in traceback.extract_stack()):
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


def _call_kernels(fused: bool, masked: bool) -> tuple[list[str], list[str]]:
    """The torch kernels of one deferred training call, forward and backward (after a first
    call has filled the caches of constants)."""
    torch.manual_seed(0)
    x = torch.randn(4, 8, 3, 3, device=DEVICE, requires_grad=True)
    weight = torch.rand(8, device=DEVICE, requires_grad=True)
    bias = torch.zeros(8, device=DEVICE, requires_grad=True)
    running_mean, running_var = torch.zeros(8, device=DEVICE), torch.ones(8, device=DEVICE)
    num_batches_tracked = torch.zeros((), dtype=torch.long, device=DEVICE)
    options = TrainOptions(LocalReducer(), LayerInfo("budget", 8, check_mode="deferred"))
    mask = (torch.rand(4, 3, 3) < 0.7).to(DEVICE) if masked else None
    buffers = (running_mean, running_var, num_batches_tracked, mask)
    dy = torch.randn_like(x)
    with fused_finalize() if fused else contextlib.nullcontext():
        y = train_call(x, weight, bias, options, *buffers)
        torch.autograd.grad(y, (x, weight, bias), dy)
        with _TorchKernels() as forward:
            y = train_call(x, weight, bias, options, *buffers)
        with _TorchKernels() as backward:
            torch.autograd.grad(y, (x, weight, bias), dy)
    return forward.kernels, backward.kernels


def test_a_deferred_call_runs_2_torch_kernels_and_9_triton_ones() -> None:
    """The torch kernels of a deferred call with the fused kernels on: forward 1 (the sum of
    the local sums' partial sums; and 5 Triton kernels: the shift, the local sums, the
    packing, the per-channel maths, the output), backward 1 (the sum of the partial sums;
    and 4: the sums, the packing, the corrections, the input gradient), against the 39 and
    10 of tests/test_op_budget.py's generic count; on a GPU each direction also copies its
    header to the host, as before. On a GPU each is a launch (the first GPU run:
    host-bound, ~2.2 ms per call). Before the shift was a median of 9 values, forward ran
    the first value made contiguous instead of the shift's kernel."""
    forward, backward = _call_kernels(fused=True, masked=False)
    # on CUDA the deferred check's copy of the header to pinned host memory is one more
    # (with the generic maths too)
    copy = int(DEVICE == "cuda")
    assert len(forward) <= 1 + copy, forward
    assert len(backward) <= 1 + copy, backward
    # no pass over the data is torch's: the local sums are Triton's
    assert "native_batch_norm_backward" not in forward + backward, (forward, backward)


def test_a_masked_deferred_call_runs_9_torch_kernels_and_9_triton_ones() -> None:
    """A masked call's passes over the data are syncbn._kernels.triton_passes' Triton
    kernels too, around the fused packing and per-channel maths. Counted with torch 2.14
    on the CPU, against the generic maths' forward 49 and backward 16: forward 8 (the valid
    count, the first valid sample's 6, which replaces padded values among the shift's 9,
    the sum of the partial sums; and 5 Triton kernels), backward 1 (the sum of the partial
    sums; and 4); on a GPU each direction also copies its header to the host."""
    generic_forward, generic_backward = _call_kernels(fused=False, masked=True)
    forward, backward = _call_kernels(fused=True, masked=True)
    copy = int(DEVICE == "cuda")
    assert len(forward) <= 8 + copy < len(generic_forward), (forward, generic_forward)
    assert len(backward) <= 1 + copy < len(generic_backward), (backward, generic_backward)
    assert "native_batch_norm_backward" not in forward + backward, (forward, backward)


def _fused(rank: int, world_size: int, scenario: Any, *args: Any) -> tuple[Any, Any]:
    """``scenario``'s result with the fused kernels on, and how often they ran."""
    with fused_finalize() as calls:
        return scenario(rank, world_size, *args), dict(calls)


#: tests/test_faults.py's deferred-check scenarios, whose tensors are on the CPU
_CPU_SCENARIOS = pytest.mark.skipif(
    DEVICE != "cpu", reason="tests/test_faults.py's scenarios use CPU tensors"
)


@_CPU_SCENARIOS
@pytest.mark.parametrize("problem", ["order", "count"])
def test_a_failed_check_moves_nothing_and_raises_at_the_next_call(
    pool2: WorkerPool, problem: str
) -> None:
    """Ranks calling different layers, or a global count of one: the fused kernel's flags
    keep the running statistics and the batch counter, and the next call raises."""
    for result, calls in pool2.run(_fused, _deferred_problems, problem):
        assert calls["finalize_forward"] >= 3, calls  # the good step, the failing call
        assert_deferred_problem_surfaced(result, problem)


@_CPU_SCENARIOS
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_training_recovers_after_a_caught_failure(pool2: WorkerPool, where: str) -> None:
    for rank, (ended, calls) in enumerate(
        pool2.run(_fused, _caught_failure_then_training, where, timeout=60.0)
    ):
        assert calls["finalize_forward"] > 0 and calls["finalize_backward"] > 0, calls
        assert_recovered_after_step_1(rank, ended)
