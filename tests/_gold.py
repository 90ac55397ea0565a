"""The gold comparison: SyncBatchNorm on W ranks versus torch's BatchNorm on the global batch.

Both sides build the same data from a seed; each rank takes its slice of the global
batch (local sizes may differ and may be 0), runs several training steps, and
returns what it saw. The reference runs ``torch.nn.BatchNorm{1,2,3}d`` in one
process on the concatenation. Shared by the core tests and the property tests.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, TypedDict

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

import syncbn

__all__ = ["Case", "Tolerance", "compare", "reference", "run_rank"]

_DTYPES = {
    "float64": torch.float64,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
_REFERENCE_CLASSES = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}


@dataclass(frozen=True)
class Case:
    """One gold comparison: shapes, local batch sizes, module options, dtypes, steps."""

    sizes: tuple[int, ...]
    tail: tuple[int, ...] = (3, 4, 5)  # (C, *spatial)
    dtype: str = "float64"
    param_dtype: str | None = None  # None: same as dtype
    affine: bool = True
    bias: bool = True  # False: torch >= 2.13's bias=False (a scale only)
    track_running_stats: bool = True
    momentum: float | None = 0.1
    eps: float = 1e-5
    channels_last: bool = False
    steps: int = 3
    seed: int = 0
    offset: float = 0.0
    scale: float = 1.0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def num_features(self) -> int:
        return self.tail[0]

    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    def torch_param_dtype(self) -> torch.dtype:
        return _DTYPES[self.param_dtype or self.dtype]

    def data(self) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor, torch.Tensor]:
        """Global inputs and output gradients per step, and the initial weight and bias."""
        gen = torch.Generator().manual_seed(self.seed)
        n = sum(self.sizes)
        xs = [
            torch.randn(n, *self.tail, generator=gen, dtype=torch.float64) * self.scale
            + self.offset
            for _ in range(self.steps)
        ]
        dys = [torch.randn(n, *self.tail, generator=gen, dtype=torch.float64) for _ in xs]
        weight = torch.rand(self.num_features, generator=gen, dtype=torch.float64) + 0.5
        bias = torch.randn(self.num_features, generator=gen, dtype=torch.float64)
        return xs, dys, weight, bias

    def prepare(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.to(self.torch_dtype())
        if self.channels_last:
            memory_format = torch.channels_last if tensor.dim() == 4 else torch.channels_last_3d
            tensor = tensor.contiguous(memory_format=memory_format)
        return tensor

    def memory_format(self) -> torch.memory_format:
        if not self.channels_last:
            return torch.contiguous_format
        return torch.channels_last if len(self.tail) == 3 else torch.channels_last_3d


def _init(module: _BatchNorm, case: Case, weight: torch.Tensor, bias: torch.Tensor) -> None:
    if case.affine:
        with torch.no_grad():
            module.weight.copy_(weight)
            if module.bias is not None:
                module.bias.copy_(bias)


def _step_record(module: _BatchNorm, x: torch.Tensor, dy: torch.Tensor) -> dict[str, Any]:
    x = x.detach().requires_grad_()
    y = module(x)
    y.backward(dy)
    record = {
        "output": y.detach(),
        "grad_input": x.grad,
        "output_keeps_format": y.is_contiguous(memory_format=torch.channels_last)
        if y.dim() == 4
        else y.is_contiguous(memory_format=torch.channels_last_3d)
        if y.dim() == 5
        else True,
    }
    for name, parameter in (("grad_weight", module.weight), ("grad_bias", module.bias)):
        if parameter is not None:
            assert parameter.grad is not None
            record[name] = parameter.grad.detach().clone()
            parameter.grad = None
    return record


def _state(module: nn.Module) -> dict[str, Any]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _module_kwargs(case: Case) -> dict[str, Any]:
    return dict(
        eps=case.eps,
        momentum=case.momentum,
        affine=case.affine,
        track_running_stats=case.track_running_stats,
        dtype=case.torch_param_dtype(),
        **({} if case.bias else {"bias": False}),
    )


def _cpu(record: dict[str, Any]) -> dict[str, Any]:
    return {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in record.items()}


def run_rank(rank: int, world_size: int, case: Case) -> dict[str, Any]:
    """Scenario: this rank's share of the case, through syncbn.SyncBatchNorm.

    ``case.extra`` may set ``check_mode`` and ``device`` (results come back on the CPU).
    """
    xs, dys, weight, bias = case.data()
    device = torch.device(case.extra.get("device", "cpu"))
    module = syncbn.SyncBatchNorm(case.num_features, **_module_kwargs(case)).to(device)
    module.check_mode = case.extra.get("check_mode", module.check_mode)
    _init(module, case, weight, bias)
    start = sum(case.sizes[:rank])
    stop = start + case.sizes[rank]
    steps = [
        _cpu(
            _step_record(
                module,
                case.prepare(x[start:stop]).to(device),
                case.prepare(dy[start:stop]).to(device),
            )
        )
        for x, dy in zip(xs, dys)
    ]
    return {"steps": steps, "state": _cpu(_state(module))}


def reference(case: Case) -> dict[str, Any]:
    """The same steps through torch.nn.BatchNorm*d on the global batch, in one process."""
    xs, dys, weight, bias = case.data()
    cls = _REFERENCE_CLASSES[len(case.tail) + 1]
    module = cls(case.num_features, **_module_kwargs(case))
    _init(module, case, weight, bias)
    steps = [_step_record(module, case.prepare(x), case.prepare(dy)) for x, dy in zip(xs, dys)]
    return {"steps": steps, "state": _state(module)}


class Tolerance(TypedDict):
    """Keyword arguments of ``torch.testing.assert_close``."""

    rtol: float
    atol: float


def _tolerances(case: Case) -> Tolerance:
    if case.dtype == "float64":
        return {"rtol": 1e-9, "atol": 1e-10}
    if case.dtype == "float32":
        return {"rtol": 1e-4, "atol": 1e-5}
    return {"rtol": 2e-2, "atol": 2e-2}


def compare(case: Case, per_rank: list[dict[str, Any]], ref: dict[str, Any]) -> float:
    """Assert that the ranks' results equal the reference; return the largest absolute error."""
    tol = _tolerances(case)
    worst = 0.0

    def check(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
        nonlocal worst
        torch.testing.assert_close(actual, expected, **tol, msg=lambda m: f"{what}: {m}")
        if actual.numel():
            worst = max(worst, (actual.double() - expected.double()).abs().max().item())

    for step, expected in enumerate(ref["steps"]):
        ranks = [result["steps"][step] for result in per_rank]
        for key in ("output", "grad_input"):
            actual = torch.cat([r[key] for r in ranks])
            check(actual, expected[key], f"step {step} {key}")
        if case.channels_last:
            for r in ranks:
                assert r["output_keeps_format"], "output lost the channels_last memory format"
                assert r["grad_input"].is_contiguous(memory_format=case.memory_format()), (
                    "input gradient lost the channels_last memory format"
                )
        for key in ("grad_weight", "grad_bias"):
            if key in expected:
                summed = torch.stack([r[key] for r in ranks]).sum(0)
                check(summed, expected[key], f"step {step} {key} summed over ranks")
    for result in per_rank:
        assert result["state"].keys() == ref["state"].keys()
        for key, value in ref["state"].items():
            if key == "num_batches_tracked":
                assert torch.equal(result["state"][key], value), key
            else:
                check(result["state"][key], value, f"state_dict {key}")
    return worst
