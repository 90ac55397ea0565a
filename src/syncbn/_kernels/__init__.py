"""Per-device statistics kernels behind one small interface.

A training call needs four big passes over the data, whatever the device:

- :meth:`Kernels.local_moments`: per-channel sum and sum of squares of the local batch;
- :meth:`Kernels.normalize`: the output, given the global statistics;
- :meth:`Kernels.backward_reduce`: per-channel ``sum(dy)`` and ``sum(dy * xhat)``;
- :meth:`Kernels.input_grad`: the input gradient, given the global reductions.

:func:`kernels_for` picks the implementation for a device. Today every device uses
:mod:`syncbn._kernels.generic`, a composition of torch ops that exist on every device;
a device with faster fused kernels (``cuda``, ``xpu``, ``mps``) adds one module that
provides the same four functions. :mod:`syncbn._kernels.cuda` (torch's fused SyncBatchNorm
element kernels) is a candidate, which :func:`use_device_kernels` selects, until a GPU run
shows it faster (the first one read 0.78-1.29x the generic kernels: docs/performance.md,
"On a GPU").

Around its collectives a deferred call (the accelerators' mode) runs ~35 tiny ops (the
packing, the checks, the per-channel maths); :mod:`syncbn._kernels.finalize` does them in
four Triton kernels, another candidate, which :func:`use_fused_finalize` selects. With it,
the four passes over the data are :mod:`syncbn._kernels.triton_passes`' Triton kernels,
which move the data as cuDNN's BatchNorm does, masked calls too (they read only the valid
positions, where the generic kernels zero the others in passes of their own).
"""

from __future__ import annotations

import re
from types import ModuleType
from typing import Protocol

import torch

from syncbn._kernels import cuda, generic
from syncbn._kernels.generic import LocalMoments

__all__ = [
    "Kernels",
    "LocalMoments",
    "fused_finalize_for",
    "kernels_for",
    "takes_triton_passes",
    "use_device_kernels",
    "use_fused_finalize",
]


class Kernels(Protocol):
    """The four passes of a synchronized training call (see :mod:`syncbn._kernels.generic`)."""

    def local_moments(
        self, input: torch.Tensor, valid: torch.Tensor | None = None, host_reads: bool = False
    ) -> LocalMoments: ...

    def normalize(
        self,
        input: torch.Tensor,
        moments: LocalMoments,
        saved: torch.Tensor,
        offset: torch.Tensor | None,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        eps: float,
        valid: torch.Tensor | None = None,
    ) -> torch.Tensor: ...

    def zero_padded(
        self,
        tensor: torch.Tensor,
        valid: torch.Tensor,
        inplace: bool = False,
        like: torch.Tensor | None = None,
    ) -> torch.Tensor: ...

    def backward_reduce(
        self,
        grad_output: torch.Tensor,
        input: torch.Tensor,
        mean: torch.Tensor,
        var: torch.Tensor,
        eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def input_grad(
        self,
        grad_output: torch.Tensor,
        input: torch.Tensor,
        saved: torch.Tensor,
        eps: float,
        totals: torch.Tensor,
        count: int | torch.Tensor,
        valid: torch.Tensor | None = None,
    ) -> torch.Tensor: ...


#: device type -> the module implementing :class:`Kernels` for it
_BY_DEVICE_TYPE: dict[str, ModuleType] = {}
#: device type -> a device-specific module not yet measured faster than the generic one
_CANDIDATES: dict[str, ModuleType] = {"cuda": cuda}


def use_device_kernels(device_type: str, enabled: bool = True) -> None:
    """Use (or stop using) the candidate kernels for ``device_type`` in this process.

    For the GPU tests and benchmarks that compare both kernel sets.

    Raises:
        ValueError: if ``device_type`` has no candidate kernels.
    """
    if device_type not in _CANDIDATES:
        raise ValueError(
            f"no device-specific kernels for device type {device_type!r}; "
            f"candidates: {sorted(_CANDIDATES)}"
        )
    if enabled:
        _BY_DEVICE_TYPE[device_type] = _CANDIDATES[device_type]
    else:
        _BY_DEVICE_TYPE.pop(device_type, None)


def kernels_for(device: torch.device) -> Kernels:
    """The kernels for tensors on ``device``: a device-specific module, else the generic one."""
    return _BY_DEVICE_TYPE.get(device.type, generic)  # type: ignore[return-value]


#: device types whose deferred calls use :mod:`syncbn._kernels.finalize` (a candidate),
#: and whether their passes over the data are :mod:`syncbn._kernels.triton_passes`'
_FUSED_FINALIZE: dict[str, bool] = {}

#: the oldest Triton that runs the Triton kernels: checked with 3.2 to 3.8 (torch 2.6 to
#: 2.14; interpreted on the CPU, and compiled for sm_80 and sm_90), while the interpreter of
#: Triton 3.0 and 3.1 (torch 2.4 and 2.5) refuses them ("arange's arguments must be of type
#: tl.constexpr" in a helper that takes a block size)
MIN_TRITON = (3, 2)


def _triton_version(version: str) -> tuple[int, int]:
    """``(major, minor)`` of a Triton version string (``"3.6.0"``, ``"3.2.0+git1c3ae6b"``)."""
    numbers = re.match(r"(\d+)\.(\d+)", version)
    if numbers is None:
        raise RuntimeError(f"cannot read Triton's version {version!r}")
    return int(numbers[1]), int(numbers[2])


def use_fused_finalize(device_type: str, enabled: bool = True, triton_passes: bool = True) -> None:
    """Use (or stop using) :mod:`syncbn._kernels.finalize`, Triton kernels for a deferred
    call's checks, per-channel maths and packing, for ``device_type`` in this process.

    For the tests (``"cpu"``, under Triton's interpreter) and the GPU benchmarks that
    compare it with the generic maths.

    Args:
        triton_passes: the passes over the data are then
            :mod:`syncbn._kernels.triton_passes`' Triton kernels too (``False``: the
            generic kernels', for the benchmarks that tell both apart).

    Raises:
        ImportError: if Triton is not installed.
        RuntimeError: if Triton is older than :data:`MIN_TRITON`.
    """
    if enabled:
        import triton

        if _triton_version(triton.__version__) < MIN_TRITON:
            oldest = ".".join(map(str, MIN_TRITON))
            raise RuntimeError(
                f"syncbn's Triton kernels need Triton >= {oldest} (torch >= 2.6 installs "
                f"it), but Triton {triton.__version__} is installed"
            )
        from syncbn._kernels import finalize  # noqa: F401  (imports Triton's language)

        _FUSED_FINALIZE[device_type] = triton_passes
    else:
        _FUSED_FINALIZE.pop(device_type, None)


def takes_triton_passes(input: torch.Tensor) -> bool:
    """Whether a deferred call's passes over the data are :mod:`syncbn._kernels.triton_passes`'
    Triton kernels: they are on for the input's device (:func:`use_fused_finalize`) and
    take its layout, a non-empty batch contiguous or channels last (the generic kernels take
    any strides). Its backward then reads the input itself, and the shift
    (:attr:`syncbn._autograd.ForwardResult.shift`)."""
    if not _FUSED_FINALIZE.get(input.device.type, False):
        return False
    return input.numel() > 0 and generic.dense_format(input) is not None


def fused_finalize_for(device: torch.device) -> ModuleType | None:
    """:mod:`syncbn._kernels.finalize` if it is on for ``device``'s type, else ``None``."""
    if device.type not in _FUSED_FINALIZE:
        return None
    from syncbn._kernels import finalize

    return finalize
