"""SyncBatchNorm's training call as custom ops, so that ``torch.compile(fullgraph=True)`` works.

Dynamo cannot trace a collective whose result is read on the host, nor the autograd
engine's state that the checkpointing guard reads, nor a Python call counter. Under
``torch.compile`` a synchronized layer therefore calls two custom ops,
``syncbn::batch_norm_train`` and ``syncbn::batch_norm_train_backward``, which the graph
keeps opaque and which run :func:`syncbn._autograd.forward_train` /
:func:`~syncbn._autograd.backward_train` at run time: the same code as eager mode, with
the same single collective per direction, the same checks (raised from inside the
compiled graph), the same guard against a second running-statistics update in a
recomputed forward. The forward op is functional (custom ops that mutate their inputs
cannot have an autograd formula): it returns the new running statistics and
``num_batches_tracked``, which the traced module copies into its buffers.

The ops receive the calling layer as an integer key into a registry of weak references
(a graph can hold no Python object); at run time the layer supplies its process group,
identity, call count and settings, so that changing them needs no recompilation.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import weakref
from collections.abc import Sequence
from typing import Any, Protocol

import torch
import torch.fx

from syncbn._autograd import TrainOptions, backward_train, first_given, forward_train
from syncbn._stats import stat_dtype

__all__ = [
    "SyncSite",
    "is_compiling",
    "leaf_call_when_fx_traced",
    "register_site",
    "sync_batch_norm_train",
]


class SyncSite(Protocol):
    """A synchronized layer as the compiled ops see it."""

    def next_train_options(self) -> TrainOptions:
        """The options of the layer's next synchronized call (counts the call)."""
        ...

    def last_train_options(self) -> TrainOptions:
        """The options of the layer's latest call, without a call index, for a backward."""
        ...


_sites: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
_keys = itertools.count(1)


def register_site(site: SyncSite) -> int:
    """Register ``site`` for the compiled ops; returns its key (alive as long as the site).

    Also defines the ops, once per process, so that tracing finds them defined.
    """
    _define_ops()
    key = next(_keys)
    _sites[key] = site
    return key


def _site(key: int) -> SyncSite:
    site = _sites.get(key)
    if site is None:
        raise RuntimeError(f"syncbn: the SyncBatchNorm layer of compiled call {key} was deleted")
    return site  # type: ignore[no-any-return]


def is_compiling() -> bool:
    """True while dynamo traces (the check itself is traceable)."""
    check = getattr(torch.compiler, "is_compiling", None)
    return bool(check()) if check is not None else False


def leaf_call_when_fx_traced(module: torch.nn.Module, input: Any) -> Any:
    """Under ``torch.fx`` symbolic tracing, the call of ``module`` as one graph node; else None.

    torch.fx keeps ``torch.nn`` layers as single ``call_module`` nodes (leaves) and traces
    into every other module. Traced into, a synchronized layer's Python branches on the
    input's shape and mode fail on proxies, and whatever mode the layer was traced in would
    be baked into the graph. So the layer records itself as one ``call_module`` node, as
    ``torch.nn.BatchNorm2d`` is recorded: the traced graph calls the real layer at run time
    (``torchvision``'s feature extraction and FX quantization trace models this way).
    """
    if not isinstance(input, torch.fx.Proxy) or not isinstance(input.tracer, torch.fx.Tracer):
        return None
    tracer = input.tracer
    return tracer.create_proxy("call_module", tracer.path_of_module(module), (input,), {})


def _forward(
    input: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    num_batches_tracked: torch.Tensor | None,
    site_key: int,
) -> tuple[torch.Tensor, ...]:
    options = _site(site_key).next_train_options()
    # the op is functional: it updates copies of the state and returns them
    mean, var, tracked = (
        None if t is None else t.clone() for t in (running_mean, running_var, num_batches_tracked)
    )
    output, saved, count = forward_train(input, weight, bias, mean, var, tracked, options)
    if isinstance(count, torch.Tensor):
        count = count.clone()  # a view of the collective's buffer: outputs must not alias
    else:
        count = saved.new_tensor(float(count), dtype=torch.float64)
    empty = saved.new_empty(0)
    new_state = [empty.clone() if t is None else t for t in (mean, var, tracked)]
    return (_strided_like(output, input), saved, count, *new_state)


def _strided_like(tensor: torch.Tensor, input: torch.Tensor) -> torch.Tensor:
    """``tensor`` with the strides of ``torch.empty_like(input)``, which the fake ops promise.

    The kernels keep the input's memory format, but for ambiguous shapes (a size-1 or
    empty dimension) their strides can differ from ``empty_like``'s, and compiled code
    checks them; then one copy fixes it.
    """
    expected = torch.empty_like(input, device="meta").stride()
    if tensor.stride() == expected:
        return tensor
    return torch.empty_like(input).copy_(tensor)


def _forward_fake(
    input: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    num_batches_tracked: torch.Tensor | None,
    site_key: int,
) -> tuple[torch.Tensor, ...]:
    # the layer's channel count, not the input's: an input with the wrong count must trace,
    # so that the real op joins the collective with the error flag before it raises
    per_channel = first_given(weight, bias, running_mean, running_var)
    num_channels = input.shape[1] if per_channel is None else per_channel.numel()
    saved = input.new_empty((3, num_channels), dtype=stat_dtype(input.dtype))
    new_state = [
        saved.new_empty(0) if t is None else torch.empty_like(t)
        for t in (running_mean, running_var, num_batches_tracked)
    ]
    return (torch.empty_like(input), saved, input.new_empty((), dtype=torch.float64), *new_state)


def _backward(
    grad_output: torch.Tensor,
    input: torch.Tensor,
    saved: torch.Tensor,
    count: torch.Tensor,
    site_key: int,
    needs_grad: Sequence[bool],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    options = _site(site_key).last_train_options()
    need = (bool(needs_grad[0]), bool(needs_grad[1]), bool(needs_grad[2]))
    # the count stays a tensor unless this call checks at once (a free read on CPU)
    host_count = options.layer.check_mode == "immediate" or count.device.type == "cpu"
    grads = backward_train(
        grad_output, input, saved, int(count) if host_count else count, need, options
    )
    grad_input, grad_weight, grad_bias = grads
    empty = saved.new_empty(0)
    return (
        empty if grad_input is None else _strided_like(grad_input, input),
        empty.clone() if grad_weight is None else grad_weight,
        empty.clone() if grad_bias is None else grad_bias,
    )


def _backward_fake(
    grad_output: torch.Tensor,
    input: torch.Tensor,
    saved: torch.Tensor,
    count: torch.Tensor,
    site_key: int,
    needs_grad: Sequence[bool],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    num_channels = saved.shape[1]
    return (
        torch.empty_like(input) if needs_grad[0] else saved.new_empty(0),
        saved.new_empty(num_channels) if needs_grad[1] else saved.new_empty(0),
        saved.new_empty(num_channels) if needs_grad[2] else saved.new_empty(0),
    )


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    input, weight, bias, _, _, _, site_key = inputs
    _, saved, count, *new_state = output
    ctx.mark_non_differentiable(saved, count, *new_state)
    ctx.save_for_backward(input, saved, count)
    ctx.site_key = site_key
    ctx.param_dtypes = (
        None if weight is None else weight.dtype,
        None if bias is None else bias.dtype,
    )


def _autograd_backward(
    ctx: Any, grad_output: torch.Tensor, *_grad_other_outputs: Any
) -> tuple[torch.Tensor | None, ...]:
    input, saved, count = ctx.saved_tensors
    needs = [bool(n) for n in ctx.needs_input_grad[:3]]
    grads = torch.ops.syncbn.batch_norm_train_backward(
        grad_output.contiguous(memory_format=_memory_format(input)),
        input,
        saved,
        count,
        ctx.site_key,
        needs,
    )
    grad_input, grad_weight, grad_bias = (g if n else None for g, n in zip(grads, needs))
    weight_dtype, bias_dtype = ctx.param_dtypes
    if grad_weight is not None and weight_dtype is not None:
        grad_weight = grad_weight.to(weight_dtype)
    if grad_bias is not None and bias_dtype is not None:
        grad_bias = grad_bias.to(bias_dtype)
    return grad_input, grad_weight, grad_bias, None, None, None, None


def _memory_format(tensor: torch.Tensor) -> torch.memory_format:
    if tensor.dim() == 4 and tensor.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    if tensor.dim() == 5 and tensor.is_contiguous(memory_format=torch.channels_last_3d):
        return torch.channels_last_3d
    return torch.contiguous_format


def _layout_tags() -> dict[str, Any]:
    """Ask inductor to pass the ops inputs with the strides they were traced with.

    Otherwise inductor may pick another layout for a convolution's output (channels_last on
    CPU), and the ops' outputs, which follow their input's layout, no longer have the
    strides the fake ops promised.
    """
    tag = getattr(torch.Tag, "needs_exact_strides", None) or getattr(
        torch.Tag, "needs_fixed_stride_order", None
    )
    accepts_tags = "tags" in inspect.signature(torch.library.custom_op).parameters
    return {"tags": (tag,)} if tag is not None and accepts_tags else {}


@functools.cache
def _define_ops() -> None:
    """Register the two custom ops (once; torch < 2.4 has no custom ops and no fullgraph)."""
    if not hasattr(torch.library, "custom_op"):
        return
    tags = _layout_tags()
    forward_op = torch.library.custom_op(
        "syncbn::batch_norm_train",
        _forward,
        mutates_args=(),
        schema="(Tensor input, Tensor? weight, Tensor? bias, Tensor? running_mean, "
        "Tensor? running_var, Tensor? num_batches_tracked, int site_key) "
        "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
        **tags,
    )
    forward_op.register_fake(_forward_fake)
    backward_op = torch.library.custom_op(
        "syncbn::batch_norm_train_backward",
        _backward,
        mutates_args=(),
        schema="(Tensor grad_output, Tensor input, Tensor saved, Tensor count, int site_key, "
        "bool[] needs_grad) -> (Tensor, Tensor, Tensor)",
        **tags,
    )
    backward_op.register_fake(_backward_fake)
    forward_op.register_autograd(_autograd_backward, setup_context=_setup_context)


def sync_batch_norm_train(
    input: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    num_batches_tracked: torch.Tensor | None,
    site_key: int,
) -> torch.Tensor:
    """The compiled twin of :func:`syncbn._autograd.sync_batch_norm_train` for a layer."""
    output, _, _, new_mean, new_var, new_tracked = torch.ops.syncbn.batch_norm_train(
        input, weight, bias, running_mean, running_var, num_batches_tracked, site_key
    )
    with torch.no_grad():
        for state, new in zip(
            (running_mean, running_var, num_batches_tracked), (new_mean, new_var, new_tracked)
        ):
            if state is not None:
                state.copy_(new)
    return output  # type: ignore[no-any-return]
