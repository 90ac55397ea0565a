"""Compile launches of syncbn's Triton kernels for NVIDIA GPUs, no GPU needed, in a process
where Triton's interpreter never ran.

``tests/test_kernels_finalize.py`` records the kernels' launches by running them through
Triton's interpreter, which patches ``triton.language`` when a kernel runs. Triton 3.4's
(torch 2.8) never undoes it, and a kernel compiled in that process afterwards fails inside
the patched code (``'ir.builder' object has no attribute 'get_uint8_ty'``), whatever the
kernel; Triton 3.6's and 3.8's restore it. So the test specializes each launch as
Triton's launcher does and hands the results to this script, run in a new process::

    python tests/_triton_compile.py SOURCES          # SOURCES: a pickled list of CompileJob
    python tests/_triton_compile.py --ttir SOURCES   # each job's Triton IR instead

It compiles each job with ptxas and prints a JSON list of the failures, one line each; or
with ``--ttir`` a JSON list of each job's Triton IR (to read what the compiler made of a
kernel's arithmetic).
"""

from __future__ import annotations

import importlib
import json
import pickle
import re
import sys
from typing import Any, NamedTuple

__all__ = ["CompileJob", "compile_jobs", "triton_ir"]


class CompileJob(NamedTuple):
    """One kernel specialization: what ``triton.compile`` takes, in plain values."""

    #: ``"<module>.<kernel>"`` within ``syncbn._kernels`` (``"finalize._forward_kernel"``)
    name: str
    #: the GPU's compute capability (80: A100, 90: H100 and H200)
    arch: int
    signature: dict[str, str]
    constexprs: dict[Any, Any]
    attrs: dict[Any, Any]
    options: dict[str, Any]


def compile_jobs(jobs: list[CompileJob]) -> list[str]:
    """The failures among ``jobs``: a job fails if Triton cannot compile it to machine code,
    or if its PTX holds an approximate float64 instruction. The interpreter computes
    float64 maths with numpy's correct rounding, so a GPU's approximation
    (``tl.math.rsqrt`` compiles to ``rsqrt.approx.f64``) would pass every interpreted test
    and lose the float64 statistics' exactness on a GPU."""
    failures = []
    for job in jobs:
        kernel = _kernel(job)
        try:
            binary = _compiled(kernel, job)
            if not binary.asm["cubin"]:
                raise RuntimeError("no machine code")
            approximate = re.findall(r"\b\w+\.approx(?:\.ftz)?\.f64\b", binary.asm["ptx"])
            if approximate:
                raise RuntimeError(f"approximate float64 maths: {sorted(set(approximate))}")
        except Exception as error:  # noqa: BLE001 - each failure is reported
            failures.append(f"{job.name} sm_{job.arch} {job.signature} {job.constexprs}: {error}")
    return failures


def triton_ir(jobs: list[CompileJob]) -> list[str]:
    """Each job's Triton IR (TTIR) as compiled for its GPU."""
    return [_compiled(_kernel(job), job).asm["ttir"] for job in jobs]


def _kernel(job: CompileJob) -> Any:
    """The Triton kernel that ``job`` names, from ``syncbn._kernels``."""
    module_name, kernel_name = job.name.split(".")
    return getattr(importlib.import_module(f"syncbn._kernels.{module_name}"), kernel_name)


def _compiled(kernel: Any, job: CompileJob) -> Any:
    """``kernel`` compiled as ``job`` specializes it, for ``job``'s GPU."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    source = ASTSource(kernel, job.signature, job.constexprs, job.attrs)
    return triton.compile(source, target=GPUTarget("cuda", job.arch, 32), options=job.options)


def main(argv: list[str]) -> int:
    ttir = argv[:1] == ["--ttir"]
    if len(argv) != 1 + ttir:
        print("usage: python tests/_triton_compile.py [--ttir] SOURCES", file=sys.stderr)
        return 2
    with open(argv[-1], "rb") as file:
        jobs = [CompileJob(*job) for job in pickle.load(file)]
    print(json.dumps(triton_ir(jobs) if ttir else compile_jobs(jobs)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
