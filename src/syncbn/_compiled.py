"""SyncBatchNorm's per-channel synchronizing step as custom ops, for ``torch.compile``.

Under ``torch.compile`` a synchronized training call is :mod:`syncbn._composite`: ordinary
torch ops for every pass over the big tensors, which inductor fuses with their neighbours,
around one opaque step per direction:

- ``syncbn::sync_moments`` takes one rank's count and shifted per-channel sums and returns
  the global mean and variance. At run time it does what eager mode does
  (:func:`syncbn._autograd.sync_moments`): the checks, one collective, the running
  statistics, and the guard against a second update in a recomputed (checkpointed)
  forward. It is functional (custom ops that mutate their inputs cannot have an autograd
  formula): it returns the new running statistics and ``num_batches_tracked``, which the
  traced code copies into the buffers.
- ``syncbn::sync_moments_backward``, its autograd formula, sums the gradients of the
  global mean and variance over the ranks (one collective) and returns those of the
  rank's sums; autograd derives the rest.
- ``syncbn::fail_forward`` stands for a call whose input dynamo already knows to be
  invalid (wrong shape, dtype, device, mask): at run time it joins the collective with
  the error flag and raises, so that every rank raises instead of waiting.

Dynamo cannot trace a collective whose result is read on the host, nor the autograd
engine's state that the checkpointing guard reads, nor a Python call counter: hence the
ops. They receive the calling layer as an integer key into a registry of weak references
(a graph can hold no Python object); at run time the layer supplies its process group,
identity, call count and settings, so that changing them needs no recompilation. The
functional form has no layer (key 0): its ops name the process group by its
``group_name`` and take the momentum.
"""

from __future__ import annotations

import functools
import itertools
import weakref
from typing import Any, Protocol

import torch
import torch.fx

from syncbn import _composite, _stats, distributed
from syncbn._autograd import (
    LayerInfo,
    TrainOptions,
    first_given,
    input_problem,
    join_on_error,
    reducer_for,
    sync_moments,
    sync_moments_backward,
)
from syncbn._composite import mask_problem

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


def leaf_call_when_fx_traced(module: torch.nn.Module, input: Any, **kwargs: Any) -> Any:
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
    # keyword arguments given as None (mask=None) are left out, as the call's defaults
    given = {name: value for name, value in kwargs.items() if value is not None}
    return tracer.create_proxy("call_module", tracer.path_of_module(module), (input,), given)


def _options(
    site_key: int,
    group_name: str,
    num_features: int,
    eps: float,
    momentum: float | None,
    backward: bool,
) -> TrainOptions:
    """The options of a call: from its layer (``site_key > 0``), else of a functional call."""
    if site_key:
        site = _site(site_key)
        return site.last_train_options() if backward else site.next_train_options()
    reducer = reducer_for(distributed.group_from_name(group_name))
    return TrainOptions(reducer, LayerInfo("", num_features), eps, momentum)


def _sync_moments(
    count: torch.Tensor,
    shifted_sum: torch.Tensor,
    shifted_square_sum: torch.Tensor,
    shift: torch.Tensor,
    weight: torch.Tensor | None,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    num_batches_tracked: torch.Tensor | None,
    site_key: int,
    group_name: str,
    eps: float,
    momentum: float | None,
) -> tuple[torch.Tensor, ...]:
    options = _options(site_key, group_name, shifted_sum.numel(), eps, momentum, backward=False)
    # the op is functional: it updates copies of the state and returns them
    new_mean, new_var, tracked = (
        None if t is None else t.clone() for t in (running_mean, running_var, num_batches_tracked)
    )
    mean, var, global_count = sync_moments(
        count, shifted_sum, shifted_square_sum, shift, new_mean, new_var, tracked, options
    )
    if isinstance(global_count, torch.Tensor):
        global_count = global_count.clone()  # a view of the collective's buffer
    else:
        global_count = mean.new_tensor(float(global_count))
    inverse_std = _stats.scale(var, options.eps, None)
    scale = inverse_std if weight is None else inverse_std * weight
    empty = mean.new_empty(0)
    new_state = [empty.clone() if t is None else t for t in (new_mean, new_var, tracked)]
    # outputs may alias neither inputs nor each other (mean is a view of the sums)
    return (mean.clone(), scale.clone(), inverse_std, global_count, *new_state)


def _sync_moments_fake(
    count: torch.Tensor,
    shifted_sum: torch.Tensor,
    shifted_square_sum: torch.Tensor,
    shift: torch.Tensor,
    weight: torch.Tensor | None,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    num_batches_tracked: torch.Tensor | None,
    site_key: int,
    group_name: str,
    eps: float,
    momentum: float | None,
) -> tuple[torch.Tensor, ...]:
    mean = shifted_sum.new_empty(shifted_sum.shape, dtype=torch.float64)
    new_state = [
        mean.new_empty(0) if t is None else torch.empty_like(t)
        for t in (running_mean, running_var, num_batches_tracked)
    ]
    per_channel = [torch.empty_like(mean) for _ in range(3)]  # mean, scale, inverse_std
    return (*per_channel, mean.new_empty(()), *new_state)


def _sync_moments_backward(
    grad_mean: torch.Tensor,
    grad_scale: torch.Tensor,
    mean: torch.Tensor,
    inverse_std: torch.Tensor,
    shift: torch.Tensor,
    weight: torch.Tensor | None,
    global_count: torch.Tensor,
    site_key: int,
    group_name: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    options = _options(site_key, group_name, mean.numel(), 0.0, None, backward=True)
    # the count stays a tensor unless this call checks at once (a free read on CPU)
    host_count = options.layer.check_mode == "immediate" or global_count.device.type == "cpu"
    count = int(global_count) if host_count else global_count
    grad_sum, grad_square_sum, grad_weight = sync_moments_backward(
        grad_mean, grad_scale, mean, inverse_std, shift, weight, count, options
    )
    return grad_sum, grad_square_sum, mean.new_empty(0) if grad_weight is None else grad_weight


def _sync_moments_backward_fake(
    grad_mean: torch.Tensor,
    grad_scale: torch.Tensor,
    mean: torch.Tensor,
    inverse_std: torch.Tensor,
    shift: torch.Tensor,
    weight: torch.Tensor | None,
    global_count: torch.Tensor,
    site_key: int,
    group_name: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    grad_weight = mean.new_empty(0) if weight is None else torch.empty_like(mean)
    return torch.empty_like(mean), torch.empty_like(mean), grad_weight


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    _, shifted_sum, _, shift, weight, *_, site_key, group_name, _, _ = inputs
    mean, _, inverse_std, global_count, *new_state = output
    ctx.mark_non_differentiable(inverse_std, global_count, *new_state)
    ctx.save_for_backward(mean, inverse_std, shift, weight, global_count)
    ctx.site_key = site_key
    ctx.group_name = group_name
    ctx.sum_dtype = shifted_sum.dtype


def _autograd_backward(
    ctx: Any, grad_mean: torch.Tensor | None, grad_scale: torch.Tensor | None, *_: Any
) -> tuple[torch.Tensor | None, ...]:
    mean, inverse_std, shift, weight, global_count = ctx.saved_tensors
    grad_sum, grad_square_sum, grad_weight = torch.ops.syncbn.sync_moments_backward(
        torch.zeros_like(mean) if grad_mean is None else grad_mean,
        torch.zeros_like(mean) if grad_scale is None else grad_scale,
        mean,
        inverse_std,
        shift,
        weight,
        global_count,
        ctx.site_key,
        ctx.group_name,
    )
    return (
        None,
        grad_sum.to(ctx.sum_dtype),
        grad_square_sum.to(ctx.sum_dtype),
        None,
        None if weight is None else grad_weight.to(weight.dtype),
    ) + (None,) * 7


def _fail_forward(
    input: torch.Tensor,
    anchor: torch.Tensor,
    mask: torch.Tensor | None,
    site_key: int,
    group_name: str,
    num_features: int,
) -> torch.Tensor:
    # the problem that tracing found, found again on the real tensors (a graph cannot
    # carry the message: dynamo does not trace str() of an exception)
    problem = input_problem(input, num_features, anchor.device)
    if problem is None and mask is not None:
        problem = mask_problem(mask, input)
    if problem is None:  # pragma: no cover - tracing and run time see the same metadata
        problem = RuntimeError("syncbn: a call traced as invalid is valid at run time")
    options = _options(site_key, group_name, num_features, 0.0, None, backward=False)
    with join_on_error(options, "forward", anchor.device):
        raise problem
    raise AssertionError("unreachable")  # pragma: no cover - the context re-raises


def _fail_forward_fake(
    input: torch.Tensor,
    anchor: torch.Tensor,
    mask: torch.Tensor | None,
    site_key: int,
    group_name: str,
    num_features: int,
) -> torch.Tensor:
    return torch.empty_like(input)


@functools.cache
def _define_ops() -> None:
    """Register the custom ops (once; torch < 2.4 has no custom ops and no fullgraph)."""
    if not hasattr(torch.library, "custom_op"):
        return
    forward_op = torch.library.custom_op(
        "syncbn::sync_moments",
        _sync_moments,
        mutates_args=(),
        schema="(Tensor count, Tensor shifted_sum, Tensor shifted_square_sum, Tensor shift, "
        "Tensor? weight, Tensor? running_mean, Tensor? running_var, "
        "Tensor? num_batches_tracked, int site_key, str group_name, float eps, "
        "float? momentum) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
    )
    forward_op.register_fake(_sync_moments_fake)
    backward_op = torch.library.custom_op(
        "syncbn::sync_moments_backward",
        _sync_moments_backward,
        mutates_args=(),
        schema="(Tensor grad_mean, Tensor grad_scale, Tensor mean, Tensor inverse_std, "
        "Tensor shift, Tensor? weight, Tensor global_count, int site_key, str group_name) "
        "-> (Tensor, Tensor, Tensor)",
    )
    backward_op.register_fake(_sync_moments_backward_fake)
    forward_op.register_autograd(_autograd_backward, setup_context=_setup_context)
    fail_op = torch.library.custom_op(
        "syncbn::fail_forward",
        _fail_forward,
        mutates_args=(),
        schema="(Tensor input, Tensor anchor, Tensor? mask, int site_key, str group_name, "
        "int num_features) -> Tensor",
    )
    fail_op.register_fake(_fail_forward_fake)
    for name in ("sync_moments", "sync_moments_backward", "fail_forward"):
        _keep_in_graph(getattr(torch.ops.syncbn, name).default)


def _keep_in_graph(op: torch._ops.OpOverload) -> None:
    """Tell the compiler that ``op`` has side effects (a collective), so that it is never
    eliminated as dead code.

    A rank whose local batch is empty computes an empty input gradient, which needs none
    of the backward op's outputs: inductor would drop the op there, and that rank would
    skip a collective that the others wait in.
    """
    keep = getattr(torch.fx.node, "has_side_effect", None)
    if keep is not None:
        keep(op)


def _synchronizer(
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    num_batches_tracked: torch.Tensor | None,
    site_key: int,
    group_name: str,
    eps: float,
    momentum: float | None,
) -> _composite.Synchronize:
    """The ``synchronize`` step of :func:`syncbn._composite.batch_norm_train` in a compiled
    graph: the ``syncbn::sync_moments`` op, whose new running statistics are copied into
    the buffers."""

    def synchronize(
        count: torch.Tensor,
        shifted_sum: torch.Tensor,
        shifted_square_sum: torch.Tensor,
        shift: torch.Tensor,
        weight: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        mean, scale, _, _, *new_state = torch.ops.syncbn.sync_moments(
            count,
            shifted_sum,
            shifted_square_sum,
            shift,
            weight,
            running_mean,
            running_var,
            num_batches_tracked,
            site_key,
            group_name,
            eps,
            momentum,
        )
        with torch.no_grad():
            for state, new in zip((running_mean, running_var, num_batches_tracked), new_state):
                if state is not None:
                    state.copy_(new)
        return mean, scale

    return synchronize


def sync_batch_norm_train(
    input: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    mask: torch.Tensor | None,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    num_batches_tracked: torch.Tensor | None,
    *,
    num_features: int,
    eps: float,
    momentum: float | None,
    site_key: int,
    group_name: str = "",
) -> torch.Tensor:
    """A synchronized (or masked) training call while dynamo traces: :mod:`syncbn._composite`
    around the ``syncbn::sync_moments`` op.

    An input (or mask) that tracing finds invalid compiles to ``syncbn::fail_forward``:
    at run time it joins the collective with the error flag and raises, on every rank.

    Args:
        num_features: the layer's channel count (an input with another count is invalid).
        site_key: the layer's key (:func:`register_site`), or 0 for a functional call,
            whose ops name its process group by ``group_name`` (``""``: the default group)
            and take ``eps`` and ``momentum``.
    """
    per_channel = first_given(weight, bias, running_mean, running_var)
    anchor = input if per_channel is None else per_channel  # where the buffers live
    problem = input_problem(input, num_features, anchor.device)
    if problem is None and mask is not None:
        problem = mask_problem(mask, input)
    if problem is not None:
        if mask is not None and not isinstance(mask, torch.Tensor):
            raise problem  # not a tensor: a programming error, the same on every rank
        output: torch.Tensor = torch.ops.syncbn.fail_forward(
            input.detach(),
            anchor.detach(),
            None if mask is None else mask.detach(),
            site_key,
            group_name,
            num_features,
        )
        return output
    synchronize = _synchronizer(
        running_mean, running_var, num_batches_tracked, site_key, group_name, eps, momentum
    )
    return _composite.batch_norm_train(input, weight, bias, mask, synchronize)
