"""The autograd function behind SyncBatchNorm in training.

One collective in forward, one in backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from syncbn import _stats, distributed

__all__ = [
    "LayerInfo",
    "ProcessGroupReducer",
    "Reducer",
    "is_recomputing",
    "report_invalid_input",
    "sync_batch_norm_train",
]

_SAME_CALLS_RULE = (
    "every rank must call every SyncBatchNorm layer the same number of times, in the same "
    "order, with the same number of channels (also in backward: the same layers must receive "
    "gradients on every rank)"
)


def is_recomputing() -> bool:
    """True when a forward runs inside a backward pass, as activation checkpointing recomputes it.

    Such a forward must not update running statistics a second time. Detected with the
    autograd engine's current graph task (-1 outside backward), which is what
    ``torch.utils.checkpoint`` itself relies on; on a torch without it, never true.
    """
    current_graph_task_id = getattr(torch._C, "_current_graph_task_id", None)
    return current_graph_task_id is not None and current_graph_task_id() != -1


class Reducer(Protocol):
    """Sums a float64 buffer over all participants of one synchronized layer call.

    :class:`ProcessGroupReducer` does it with one ``all_reduce`` over a process group;
    :mod:`syncbn.data_parallel` does it between the replicas of one process.
    """

    @property
    def world_size(self) -> int:
        """Number of participants."""
        ...

    @property
    def participants(self) -> str:
        """What the participants are called in messages (``"ranks"``, ``"replicas"``)."""
        ...

    def all_reduce(self, buffer: torch.Tensor, phase: str) -> torch.Tensor:
        """Return the elementwise sum of every participant's ``buffer`` (``phase``:
        ``"forward"`` or ``"backward"``)."""
        ...


@dataclass(frozen=True)
class ProcessGroupReducer:
    """The :class:`Reducer` of a process group: one in-place ``all_reduce``."""

    group: dist.ProcessGroup | None
    world_size: int
    participants: str = "ranks"

    def all_reduce(self, buffer: torch.Tensor, phase: str) -> torch.Tensor:
        return distributed.all_reduce_sum_(buffer, self.group)


@dataclass(frozen=True)
class LayerInfo:
    """What identifies one call of a SyncBatchNorm layer in error messages and fingerprints.

    Attributes:
        name: the layer's module path (set by ``convert_sync_batchnorm``), or ``""``.
        num_features: the layer's channel count.
        call_index: how many synchronized calls this layer had made before this one.
        check_layer_order: whether the fingerprint is checked after each collective.
    """

    name: str
    num_features: int
    call_index: int = 0
    check_layer_order: bool = True

    @property
    def fingerprint(self) -> int:
        return _stats.fingerprint(self.name, self.num_features) if self.check_layer_order else 0

    def describe(self) -> str:
        name = repr(self.name) if self.name else "<unnamed>"
        return (
            f"SyncBatchNorm layer {name} (num_features={self.num_features}, call {self.call_index})"
        )


def _check_header(header: _stats.Header, world_size: int, layer: LayerInfo, phase: str) -> None:
    """Raise on every rank if a rank reported invalid input or ranks reached different layers."""
    if header.errors:
        raise RuntimeError(
            f"{header.errors} other rank(s) reported invalid input to their SyncBatchNorm layer in "
            f"{phase} while this rank was at {layer.describe()}; see the error raised on that rank"
        )
    own = layer.fingerprint
    if (
        header.fingerprint_sum != world_size * own
        or header.fingerprint_square_sum != world_size * own * own
        or header.trailer_sum != world_size * own
    ):
        raise RuntimeError(
            f"SyncBatchNorm layer mismatch in {phase}: this rank is at {layer.describe()}, but "
            f"other ranks of the process group are at a different layer in the same collective; "
            f"{_SAME_CALLS_RULE}. To disable this check set `check_layer_order = False` on the "
            "layers (or pass check_layer_order=False to convert_sync_batchnorm)."
        )


def report_invalid_input(
    layer: LayerInfo, device: torch.device, group: dist.ProcessGroup | None
) -> None:
    """Join the forward collective with an error flag, so that other ranks raise, not wait."""
    zeros = torch.zeros(layer.num_features, dtype=torch.float64, device=device)
    buffer = _stats.pack_forward(0, zeros, zeros, layer.fingerprint, error=True)
    distributed.all_reduce_sum_(buffer, group)


class _SyncBatchNormFunction(torch.autograd.Function):
    """Batch normalization with statistics and input gradients reduced over a process group."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        input: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        eps: float,
        reducer: Reducer,
        layer: LayerInfo,
        running_mean: torch.Tensor | None,
        running_var: torch.Tensor | None,
        momentum: float,
    ) -> torch.Tensor:
        num_channels = input.shape[1]
        local_count = input.numel() // num_channels
        dtype = _stats.stat_dtype(input.dtype)
        if local_count:
            centered, shift = _stats.center(input)
            total, square_total, shift64 = _stats.shifted_sums(centered, shift)
        else:  # an empty local batch still joins the collective, with zeros
            total, square_total = _stats.local_sums(input)
            shift64 = total  # any shift: it only enters the offset, unused for an empty batch
        buffer = _stats.pack_forward(local_count, total, square_total, layer.fingerprint)
        buffer = reducer.all_reduce(buffer, "forward")

        # One small host read serves both checks; on CPU it is free, on accelerators it waits
        # for the collective that the normalization below needs anyway.
        header = _stats.read_header(buffer)
        _check_header(header, reducer.world_size, layer, "forward")
        count = header.global_count
        if count <= 1:
            raise ValueError(
                "Expected more than 1 value per channel when training, got input size "
                f"{input.size()} here and {count} value(s) per channel across all "
                f"{reducer.world_size} {reducer.participants}"
            )

        stats = _stats.batch_statistics(buffer, count, eps, weight, bias, shift64, dtype)
        mean, var, scale = stats.saved.unbind()
        if local_count and dtype == input.dtype:
            # float32/float64: the shifted copy becomes the output, no second allocation
            output = _stats.normalize_(centered, scale, stats.offset)
        else:  # low-precision input (float32 statistics) or an empty batch
            output = torch.batch_norm(
                input,
                None if weight is None else weight.to(dtype),
                None if bias is None else bias.to(dtype),
                mean,
                var,
                False,
                0.0,
                eps,
                False,
            )
        if running_mean is not None:
            running_mean.lerp_(mean.to(running_mean.dtype), momentum)
        if running_var is not None:
            unbiased_var = var * (count / (count - 1))
            running_var.lerp_(unbiased_var.to(running_var.dtype), momentum)
        ctx.save_for_backward(input, stats.saved)
        ctx.count = count
        ctx.eps = eps
        ctx.reducer = reducer
        ctx.layer = layer
        ctx.weight_dtype = None if weight is None else weight.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        return output

    @staticmethod
    @once_differentiable
    def backward(  # type: ignore[override]
        ctx: Any, grad_output: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        input, saved = ctx.saved_tensors
        mean, var, scale = saved.unbind()
        need_input, need_weight, need_bias = ctx.needs_input_grad[:3]
        sum_dy, sum_dy_xhat = _stats.backward_sums(grad_output, input, mean, var, ctx.eps)

        grad_input: torch.Tensor | None = None
        if need_input:
            buffer = _stats.pack_backward(sum_dy, sum_dy_xhat, ctx.layer.fingerprint)
            buffer = ctx.reducer.all_reduce(buffer, "backward")
            if ctx.layer.check_layer_order:
                _check_header(
                    _stats.read_header(buffer), ctx.reducer.world_size, ctx.layer, "backward"
                )
            totals = _stats.backward_totals(buffer)
            grad_input = _stats.input_grad(
                grad_output, input, mean, var, scale, ctx.eps, totals, ctx.count
            )
        grad_weight = _cast(sum_dy_xhat, ctx.weight_dtype) if need_weight else None
        grad_bias = _cast(sum_dy, ctx.bias_dtype) if need_bias else None
        return grad_input, grad_weight, grad_bias, None, None, None, None, None, None


def _cast(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return tensor if tensor.dtype == dtype else tensor.to(dtype)


def sync_batch_norm_train(
    input: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    reducer: Reducer,
    layer: LayerInfo,
    running_mean: torch.Tensor | None = None,
    running_var: torch.Tensor | None = None,
    momentum: float = 0.0,
) -> torch.Tensor:
    """Normalize ``input`` with statistics of the global batch of ``reducer``'s participants.

    ``running_mean`` and ``running_var``, those given, move towards the global mean
    and unbiased variance by ``momentum``, in place.

    Returns:
        The normalized output (differentiable with respect to input, weight and bias).
    """
    output: torch.Tensor = _SyncBatchNormFunction.apply(
        input, weight, bias, eps, reducer, layer, running_mean, running_var, momentum
    )
    return output
