"""The helpers of benchmarks/ that launch Triton kernels: benchmarks/gpu_probe.py's sweep of
syncbn._kernels.triton_passes. Like tests/test_kernels_finalize.py (whose interpreter
switch it uses), it runs where Triton is installed (``.ci/ecosystem``), through Triton's
interpreter on the CPU: a dry run of what a lent GPU runs in ``bash .ci/gpu lease``."""

from __future__ import annotations

import re

import pytest
import torch

from syncbn import _kernels

pytest.importorskip(
    "triton",
    minversion=".".join(map(str, _kernels.MIN_TRITON)),
    reason="needs Triton >= 3.2 (torch >= 2.6's CUDA builds install it)",
)

from test_bench import _load  # noqa: E402  (after the skip: these import Triton's kernels)
from test_kernels_finalize import DEVICE, fused_finalize  # noqa: E402


def test_the_gpu_probe_times_each_pass_with_every_tiling() -> None:
    """Per shape: a cuDNN (here: torch's CPU) BatchNorm line, then one line per tiling and
    one masked, each with the four passes' times and bandwidths and their total against
    BatchNorm's; the library's tiling is restored after each row."""
    probe = _load("gpu_probe")
    lines: list[str] = []
    shapes = [((3, 5, 4, 2), torch.float32, True), ((2, 6, 7), torch.float64, False)]
    configs = [(16, 64, 512), (4, 8, 3)]
    with fused_finalize():  # the kernels imported with the interpreter on (on the CPU)
        from syncbn._kernels import triton_passes

        default = triton_passes._BLOCK_C, triton_passes._BLOCK_L, triton_passes._REDUCTION_PROGRAMS
        probe.probe_passes(torch.device(DEVICE), lines.append, shapes, configs, repeats=1)
        assert (
            triton_passes._BLOCK_C,
            triton_passes._BLOCK_L,
            triton_passes._REDUCTION_PROGRAMS,
        ) == default
    assert len(lines) == len(shapes) * (1 + len(configs) + 1), lines
    number = r"\d+\.\d"
    bn_line = rf"cuDNN BN forward\+backward {number} us \(\d+ GB/s, 8 moves\)$"
    cell = rf"(sums|normalize|backward_reduce|input_grad) {number} us \(\d+ GB/s\)"
    unmasked_end = rf"4 passes {number} us = {number}\dx cuDNN BN$"
    masked_end = rf"masked \(80% valid\).*x cuDNN BN, {number}\dx unmasked$"
    for index, line in enumerate(lines):
        row = index % (1 + len(configs) + 1)
        if row == 0:
            assert re.search(bn_line, line), line
            continue
        cells = re.findall(cell, line)
        assert cells == ["sums", "normalize", "backward_reduce", "input_grad"], line
        tiles = "16x64, 512" if row == 1 or row == 3 else "4x8, 3"
        assert f"tiles {tiles} programs" in line, line
        if row == 3:
            assert re.search(masked_end, line), line
        else:
            assert re.search(unmasked_end, line), line


def test_the_gpu_probe_sums_the_bf16_case_with_triton_in_float32() -> None:
    """The bfloat16 probe's extra cells (on a GPU beside torch's CUDA kernels' cells): the
    local ``sum(dy)`` of the failing gold case's slices through Triton's backward pass, and
    through the eval-mode backward of float32 copies, accumulate in float32, so their error
    is float32 rounding, far under the ~0.06 of the failure; torch's
    ``batch_norm_backward_reduce`` has no CPU kernel, and its cell says so instead of
    stopping the probe."""
    probe = _load("gpu_probe")
    case = probe.BF16_CASE
    xs, dys, _, _ = case.data()
    with fused_finalize():  # the kernels imported with the interpreter on (on the CPU)
        for step in range(case.steps):
            for start, stop in [(0, 3), (3, 4)]:
                x, dy = case.prepare(xs[step][start:stop]), case.prepare(dys[step][start:stop])
                mean, var = x.float().mean((0, 2, 3)), x.float().var((0, 2, 3))
                exact = dy.double().sum((0, 2, 3))
                cells = probe._other_cuda_sums(dy, x, mean, var, exact)
                for cell, expected in zip(cells[1:], ("triton", "eval-backward of float32 copies")):
                    name, error = cell.rsplit(" ", 1)
                    assert name == f"cuda {expected}" and float(error) < 1e-5, cells
                if DEVICE == "cpu":
                    assert cells[0].startswith("cuda backward_reduce failed: NotImplementedError")
