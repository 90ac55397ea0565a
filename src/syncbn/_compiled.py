"""SyncBatchNorm's collectives as custom ops, for ``torch.compile``.

Under ``torch.compile`` a synchronized training call is :mod:`syncbn._composite`: ordinary
torch ops for all the maths, per element and per channel, which inductor fuses with their
neighbours, around one opaque op per direction:

- ``syncbn::sync_moments`` takes one rank's packed moments ``[n, sum(x), sum(x**2)]``
  (float64) and returns the global batch's, with the factor of the running statistics'
  update: the checks and the collective of eager mode (:func:`syncbn._autograd.reduce_forward`),
  and the guard against a second update in a recomputed (checkpointed) forward. The traced
  code computes the statistics and updates the buffers with that factor.
- ``syncbn::sync_moments_backward``, its autograd formula: every rank's moments feed every
  rank's global moments, so the gradient of a rank's moments is the sum over the ranks of
  the global moments' gradients (one collective, checked like the forward one); autograd
  derives the rest.
- ``syncbn::fail_forward`` stands for a call whose input dynamo already knows to be
  invalid (wrong shape, dtype, device, mask): at run time it joins the collective with
  the error flag and raises, so that every rank raises instead of waiting.

Dynamo cannot trace a collective whose result is read on the host, nor the autograd
engine's state that the checkpointing guard reads, nor a Python call counter: hence the
ops, which hold only that. They receive the calling layer as its site tensor
(:func:`site_tensor`): a one-element tensor of the layer's, which dynamo passes to the
graph as an input (a graph can hold no Python object), and which names the layer in a
registry of weak references. At run time the layer supplies its process group, identity,
call count and settings, so that changing them needs no recompilation; and layers that
differ in nothing else share one compiled graph (regional compilation: each repeated block
compiled on its own, as torch recommends for large models; an integer key was a constant
that dynamo guarded, one recompilation per layer). The functional form has no layer (no
site tensor): its ops name the process group by its ``group_name`` and take the momentum.

Ranks must run their collectives in the same order, and a compiled graph may run ops in
any order that its data dependencies allow: on a rank whose local batch is empty there
are none between two layers' ops. So the ops are chained: each forward op reads the
device's order token (:func:`order_token`) and returns its next value, written back in
place; each backward op reads the gradient written by the backward op traced before it
(:func:`_previous_backward_output`).

torch < 2.4 cannot register an op's autograd formula and tracing implementation from
Python (:data:`FULLGRAPH` is false): there a synchronized call runs eagerly across a graph
break (:func:`outside_graph`), as torch's own SyncBatchNorm does under ``torch.compile``,
and ``fullgraph=True`` is refused by dynamo.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import weakref
from pathlib import Path
from typing import Any, Callable, Protocol, TypeVar

import torch
import torch.fx
import torch.utils.checkpoint
from torch._subclasses import fake_tensor
from torch.fx.experimental import proxy_tensor

from syncbn import _composite, _protocol, distributed
from syncbn._autograd import (
    LayerInfo,
    ReducedForward,
    TrainOptions,
    first_given,
    input_problem,
    is_recomputing,
    is_tracing,
    join_on_error,
    reduce_forward,
    reducer_for,
    resolve_mode,
    synchronize_grads,
)
from syncbn._composite import mask_problem
from syncbn._kernels.generic import constants

__all__ = [
    "FULLGRAPH",
    "SyncSite",
    "device_built_for",
    "is_compiling",
    "leaf_call_when_fx_traced",
    "outside_graph",
    "site_tensor",
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
#: each live site tensor by its device and the address of its one element (see :func:`_site`)
_site_tensors: weakref.WeakValueDictionary[tuple[torch.device, int], torch.Tensor] = (
    weakref.WeakValueDictionary()
)
_keys = itertools.count(1)


def site_tensor(site: SyncSite, device: torch.device, key: int | None = None) -> torch.Tensor:
    """A new one-element tensor on ``device`` that names ``site`` to the compiled ops.

    ``key``: the key of the site's tensor on another device, for a layer that moves (one key
    per layer for its life: a new key per move left one more entry in the registry each
    time); ``None`` for a new layer or a copy, which take a new key.

    The layer keeps it as a plain attribute (not a buffer: no ``state_dict`` entry) and
    passes it to the ops, which find the layer from it at run time (:func:`_site`): dynamo
    passes such a tensor to the graph as an input, the same object at every call, with no
    guard on which tensor it is. Its ``_syncbn_site_key`` attribute names the site in a
    registry of weak references, so that a deleted layer is not kept alive; its value is
    that key too, read (on the host) only from a copy that lost the attribute
    (``torch.library.opcheck`` clones the arguments); an alias without the attribute (what
    torch 2.4's compiled graphs pass) is found by its address. Like the order token, it is
    marked as a static input (its address never changes: CUDA graphs use it in place) and
    is never an inference tensor.
    """
    if key is None:
        key = next(_keys)
    _sites[key] = site
    with torch.inference_mode(False):
        tensor = torch.full((1,), key, dtype=torch.int64, device=device)
    tensor._syncbn_site_key = key  # type: ignore[attr-defined]
    tensor._dynamo_static_input_type = "unguarded"  # type: ignore[attr-defined]
    # a meta tensor (no storage, never run) or a fake one (built under FakeTensorMode, as
    # memory estimators do: its address is not one, and reading it warns) has no address
    if device.type != "meta" and type(tensor) is torch.Tensor:
        _site_tensors[tensor.device, tensor.data_ptr()] = tensor
    return tensor


def device_built_for(device: Any) -> torch.device:
    """Where a layer built with ``device`` (a factory argument, maybe ``None``) would put its
    tensors: that device, or torch's default one (``torch.set_default_device``, a ``with
    torch.device(...)`` block), with an index for an accelerator. A layer without
    per-channel tensors puts its site tensor there."""
    return torch.empty(0, device=device).device


def site_key(tensor: torch.Tensor) -> int:
    """The key that a layer's own site tensor (from :func:`site_tensor`) names it by."""
    return int(tensor._syncbn_site_key)  # type: ignore[attr-defined]


def _known_key(tensor: torch.Tensor) -> int | None:
    """The key of the site that ``tensor`` names, found without reading its value: the
    site tensor itself, or an alias of it (which shares its element: while the site tensor
    lives, no other tensor has that address); ``None`` for a copy."""
    key = getattr(tensor, "_syncbn_site_key", None)
    if key is None:
        aliased = _site_tensors.get((tensor.device, tensor.data_ptr()))
        key = None if aliased is None else aliased._syncbn_site_key  # type: ignore[attr-defined]
    return key


def _site(tensor: torch.Tensor) -> SyncSite:
    """The layer that ``tensor`` (from :func:`site_tensor`) names."""
    key = _known_key(tensor)
    if key is None:  # a copy: its value (a host read)
        key = int(tensor.item())
    site = _sites.get(key)
    if site is None:
        raise RuntimeError(
            "syncbn: the SyncBatchNorm layer of a compiled call was deleted, or the call "
            "received a tensor that names no layer"
        )
    return site  # type: ignore[no-any-return]


def _revision() -> str:
    """A digest of this module's source, for :data:`REVISION`."""
    try:
        source = Path(__file__).read_bytes()
    except OSError:  # pragma: no cover - not installed as files (a zip archive)
        return "unknown"
    return hashlib.sha256(source).hexdigest()[:16]


#: the revision of the ops' code, an argument of every ``syncbn::sync_moments`` call, so
#: that compiled graphs cached by torch (inductor's and AOTAutograd's caches on disk) are
#: found again only for the same code: their keys hash the traced graph, in which the
#: backward formula (:func:`_autograd_backward`) and the backward op's schema do not
#: appear; a cached graph of other code then called the op with other arguments
#: (``Expected a value of type 'Tensor' for argument 'out' but instead found type 'int'``)
REVISION = _revision()

#: whether dynamo can trace a synchronized call into its graph: it needs custom ops with an
#: autograd formula and a fake (tracing) implementation registered from Python
#: (``torch.library.register_autograd`` and ``register_fake``, torch >= 2.4)
FULLGRAPH = hasattr(torch.library, "register_autograd") and hasattr(torch.library, "register_fake")

_Function = TypeVar("_Function", bound=Callable[..., Any])

#: the tracing (proxy) dispatch mode in force, or None: ``get_proxy_mode`` from torch 2.5,
#: ``get_innermost_proxy_mode`` (the same mode) on torch 2.4
_proxy_mode: Callable[[], Any] = (
    proxy_tensor.get_proxy_mode
    if hasattr(proxy_tensor, "get_proxy_mode")
    else proxy_tensor.get_innermost_proxy_mode
)

#: the activation-checkpointing policy that torch's partitioner reads from a node's
#: ``recompute`` meta, or None where syncbn leaves its op to be recomputed. Used from torch
#: 2.9: before it the partitioner also replays a checkpointed region's buffer mutations in
#: the backward graph (the in-place updates of the running statistics, from the saved
#: update), so with the op's outputs saved the running statistics moved twice per step
#: (measured on torch 2.5-2.8, as README and CHANGELOG say; 2.4 is gated with them); a
#: recomputed op returns an update of zeros instead
_MUST_SAVE = (
    getattr(getattr(torch.utils.checkpoint, "CheckpointPolicy", None), "MUST_SAVE", None)
    if torch.torch_version.TorchVersion(torch.__version__) >= "2.9"
    else None
)


def is_compiling() -> bool:
    """True while dynamo traces (the check itself is traceable)."""
    return is_tracing()


def outside_graph(function: _Function) -> _Function:
    """``function``, which a compiled caller calls eagerly across a graph break.

    For torch < 2.4 (no :data:`FULLGRAPH`). ``torch._disable_dynamo`` is the lazy form of
    ``torch.compiler.disable``: it imports dynamo at its first call, not when syncbn is
    imported. Traced into instead, the autograd Function's non-tensor arguments make
    dynamo log errors at every call before it falls back to eager.
    """
    disable = getattr(torch, "_disable_dynamo", None)
    return function if disable is None else disable(function)  # type: ignore[no-any-return]


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
    site: torch.Tensor | None,
    group_name: str,
    num_features: int,
    momentum: float | None,
    backward: bool,
    eps: float = 1e-5,
) -> TrainOptions:
    """The options of a call: from its layer (named by its ``site`` tensor), else of a
    functional call (whose ``eps`` and ``momentum`` its fingerprint covers, as an eager
    call's: a compiled rank's forward meets an eager one's where dynamo fell back)."""
    if site is not None:
        layer = _site(site)
        return layer.last_train_options() if backward else layer.next_train_options()
    reducer = reducer_for(distributed.group_from_name(group_name))
    return TrainOptions(reducer, LayerInfo("", num_features), eps, momentum)


def _update(reduced: ReducedForward, like: torch.Tensor) -> torch.Tensor:
    """``[increment, factor]`` of the running statistics' update, float64 on ``like``'s device.

    Zeros in a forward recomputed by activation checkpointing (the original forward
    already updated them); a deferred check that fails gives zeros too (its flags are 0).
    """
    if is_recomputing():
        return like.new_zeros(2)
    if reduced.update is None:  # immediate: the factor is a host number
        # not from counted_update's cache: a cumulative average's factor, 1 / (n + 1), is
        # new at every call, and each would add a constant there (on CUDA a thread and a
        # copy through pinned memory) and evict those that other calls read, a captured
        # CUDA graph's by address; this call has read its buffer back already
        return torch.tensor([1.0, float(reduced.factor)], dtype=torch.float64).to(like.device)
    # deferred: computed on the device, zeros where the checks fail
    return reduced.update


def _sync_moments(
    moments: torch.Tensor,
    order: torch.Tensor,
    num_batches_tracked: torch.Tensor | None,
    site: torch.Tensor | None,
    group_name: str,
    momentum: float | None,
    eps: float,
    input_grad: bool,
    revision: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    num_features = (moments.numel() - 1) // 2
    options = _options(site, group_name, num_features, momentum, backward=False, eps=eps)
    if not input_grad:  # no backward collective: the forward's fingerprint tells so
        options = options._replace(input_grad=False)
    device = moments.device
    mode = resolve_mode(options, device)  # outside join_on_error: see there
    with join_on_error(options, "forward", device):
        expected = options.layer.num_features
        if num_features != expected:
            raise ValueError(
                f"expected input with {expected} channels (num_features={expected}), "
                f"got input with {num_features} channels"
            )
        buffer = _protocol.pack_forward_moments(moments, options.forward_fingerprint)
    reduced = reduce_forward(buffer, mode, num_batches_tracked, options)
    # outputs may not alias the inputs: the buffer is the collective's own
    global_moments = _protocol.forward_moments(reduced.buffer)
    return global_moments, _update(reduced, moments), order.clone()


def _sync_moments_fake(
    moments: torch.Tensor,
    order: torch.Tensor,
    num_batches_tracked: torch.Tensor | None,
    site: torch.Tensor | None,
    group_name: str,
    momentum: float | None,
    eps: float,
    input_grad: bool,
    revision: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.empty_like(moments), moments.new_empty(2), torch.empty_like(order)


def _sync_moments_backward(
    grad_moments: torch.Tensor,
    after: torch.Tensor,
    out: torch.Tensor,
    site: torch.Tensor | None,
    group_name: str,
) -> None:
    num_features = (grad_moments.numel() - 1) // 2
    options = _options(site, group_name, num_features, None, backward=True)
    device = grad_moments.device
    resolve_mode(options, device)  # a deferred problem, before the collective (see there)
    phase = _protocol.COMPILED_BACKWARD  # not an eager backward's sums: its own fingerprint
    with join_on_error(options, phase, device):
        # [sum(x) (C), sum(x**2) (C)]'s gradients, in the order of a backward buffer
        buffer = _protocol.pack_backward_sums(grad_moments[1:], options.fingerprint, phase)
    totals = synchronize_grads(buffer, options, device, phase)
    # the count is no function of the input: no gradient (one op, where a copy into a
    # slice and the zeroing of another were four; the cached zero is never written)
    zero, _, _ = constants(1, out.dtype, device)
    torch.cat((zero, totals.view(-1)), out=out)


def _sync_moments_backward_fake(
    grad_moments: torch.Tensor,
    after: torch.Tensor,
    out: torch.Tensor,
    site: torch.Tensor | None,
    group_name: str,
) -> None:
    return None


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    _, _, _, site, group_name, _, _, _, _ = inputs
    _save_rather_than_recompute()
    ctx.mark_non_differentiable(output[1], output[2])
    # an attribute, not saved for backward: the backward op only needs to find the layer
    # (the same tensor object: tested), and saved tensors' version checks have no use here
    ctx.site = site
    ctx.group_name = group_name


def _save_rather_than_recompute(tracing: Any = None) -> None:
    """Keep the ``syncbn::sync_moments`` call just traced out of recomputation in backward.

    Inside an activation-checkpointed region, torch.compile tags every op to be
    recomputed in the backward graph, collectives included (``torch.utils.checkpoint``'s
    default policy). A recomputed collective runs where the backward graph's data
    dependencies allow, and on a rank whose local batch is empty it has none: inductor
    ran it at another place in the backward than the other ranks did (gloo aborted on the
    payload sizes). So the call's outputs are saved for backward instead (``2C + 3``
    numbers), as torch's partitioner saves its own collectives' outside checkpointed
    regions and effectful ops' everywhere: the backward has one collective fewer, and
    the recomputed maths use the forward's global moments. The op's tuple node and its
    ``getitem`` outputs are tagged (``recompute`` meta), which is what the partitioner
    reads, after whatever tagged them while the op was traced, right after the op, when
    it is the latest ``sync_moments`` node of the graph: by :func:`_tag_after` under the
    tracing dispatch mode (where plain checkpointing's tag is copied into the new node:
    torch 2.11) and under checkpointing's own dispatch mode (which tags the new nodes
    after tracing them: selective checkpointing, and plain checkpointing on torch 2.13),
    whether or not an input requires grad; and by the op's ``setup_context`` (when one
    does), in case a torch traces with another mode. Outside of an AOTAutograd trace
    there is no graph, and nothing to do. ``tracing``: the tracing mode, when the caller
    runs under it (which takes it off the mode stack meanwhile).
    """
    mode = _proxy_mode() if tracing is None else tracing
    if mode is None or _MUST_SAVE is None:
        return
    op = torch.ops.syncbn.sync_moments.default
    for node in reversed(mode.tracer.graph.nodes):
        if node.target is op:
            node.meta["recompute"] = _MUST_SAVE
            for user in node.users:  # the getitem of each output
                user.meta["recompute"] = _MUST_SAVE
            return


def _tag_after(mode: Any, *args: Any, **kwargs: Any) -> Any:
    """``syncbn::sync_moments`` under a dispatch mode that tags the nodes it traces
    (registered for AOTAutograd's tracing mode and checkpointing's caching mode): the
    mode's own handling, then :func:`_save_rather_than_recompute`. The op's
    ``setup_context`` alone runs only when an input requires grad: a checkpointed layer
    fed by a frozen stem (its input needs no grad, its weight does) was recomputed in
    backward."""
    op = torch.ops.syncbn.sync_moments.default
    output = mode.__torch_dispatch__(op, (), args, kwargs)
    tracing = isinstance(mode, proxy_tensor.ProxyTorchDispatchMode)
    _save_rather_than_recompute(mode if tracing else None)
    return output


def _autograd_backward(
    ctx: Any, grad_moments: torch.Tensor, _grad_update: Any, _grad_order: Any
) -> tuple[torch.Tensor | None, ...]:
    # every rank's moments feed every rank's global moments: the gradient of this
    # rank's moments is the sum over the ranks of the global moments' gradients
    grad = torch.empty_like(grad_moments)
    after = _previous_backward_output(grad, first=grad_moments)
    torch.ops.syncbn.sync_moments_backward(grad_moments, after, grad, ctx.site, ctx.group_name)
    return grad, None, None, None, None, None, None, None, None


class _SyncMoments(torch.autograd.Function):
    """``syncbn::sync_moments`` where autograd records it (an input requires grad):
    below autograd, then :func:`_setup_context`; backward :func:`_autograd_backward`.

    What ``torch.library.register_autograd`` builds, written out so that
    :func:`_autograd_kernel` can skip it where nothing records (see there).
    """

    @staticmethod
    def forward(ctx: Any, below: torch.DispatchKeySet, *inputs: Any) -> Any:
        output = _redispatch(below, *inputs)
        _setup_context(ctx, inputs, output)
        return output

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> tuple[torch.Tensor | None, ...]:
        return (None, *_autograd_backward(ctx, *grads))


#: per device type, the dispatch key set that reaches ``syncbn::sync_moments``'s
#: implementation directly (:func:`_autograd_kernel`): the dense backend's key alone
_PLAIN_KEYSETS = tuple(
    torch._C.DispatchKeySet(key) for key in (torch._C.DispatchKey.CPU, torch._C.DispatchKey.CUDA)
)
_PLAIN_NAMES = frozenset(map(repr, _PLAIN_KEYSETS))


def _plain_by_value(below: torch.DispatchKeySet) -> bool:
    return below == _PLAIN_KEYSETS[0] or below == _PLAIN_KEYSETS[1]


def _plain_by_name(below: torch.DispatchKeySet) -> bool:
    return repr(below) in _PLAIN_NAMES


#: whether a key set below autograd is one of :data:`_PLAIN_KEYSETS`: compared by value, or
#: where key sets have no ``==`` (torch 2.4 compares them as objects, so that the shortcut of
#: :func:`_autograd_kernel` was never taken) by their text
_is_plain: Callable[[torch.DispatchKeySet], bool] = (
    _plain_by_value
    if torch._C.DispatchKeySet(torch._C.DispatchKey.CPU) == _PLAIN_KEYSETS[0]
    else _plain_by_name
)


def _requires_grad(*inputs: Any) -> bool:
    """Whether any of ``inputs`` is a tensor that requires grad (torch 2.4, which has no
    ``torch._C._any_requires_grad``)."""
    return any(isinstance(input, torch.Tensor) and input.requires_grad for input in inputs)


#: :func:`_requires_grad`, in C++ where torch has it
_any_requires_grad: Callable[..., bool] = getattr(torch._C, "_any_requires_grad", _requires_grad)


def _autograd_kernel(keyset: torch.DispatchKeySet, *inputs: Any) -> Any:
    """``syncbn::sync_moments``'s autograd kernel.

    Where autograd records the call, :class:`_SyncMoments`. Where it does not (a compiled
    forward graph runs without grad), the implementation itself when nothing but the
    tensors' backend (CPU or CUDA) remains below autograd, else the rest of the dispatch
    (tracing modes, fake tensors, functionalization). ``register_autograd``'s kernel takes
    that rest every time, through Python (measured on the 2-core CPU machine, a toy op of
    the same schema per call: 15 µs with it, 7 µs this way, 5 µs with no autograd kernel).
    """
    below = keyset & torch._C._after_autograd_keyset
    if torch.is_grad_enabled() and _any_requires_grad(*inputs):
        return _SyncMoments.apply(below, *inputs)
    if _is_plain(below):
        return _sync_moments(*inputs)
    return _redispatch(below, *inputs)


def _redispatch(below: torch.DispatchKeySet, *inputs: Any) -> Any:
    """``syncbn::sync_moments`` dispatched on from ``below`` autograd (``below``: the
    call's key set without the autograd keys)."""
    with torch._C._AutoDispatchBelowAutograd():
        return torch.ops.syncbn.sync_moments.default.redispatch(below, *inputs)


def _fail_forward(
    input: torch.Tensor,
    anchor: torch.Tensor,
    parameters: list[torch.Tensor | None],
    mask: torch.Tensor | None,
    order: torch.Tensor,
    site: torch.Tensor | None,
    group_name: str,
    num_features: int,
    eps: float,
) -> torch.Tensor:
    # the problem that tracing found, found again on the real tensors (a graph cannot
    # carry the message: dynamo does not trace str() of an exception)
    problem = input_problem(
        input, num_features, anchor.device, parameters=tuple(parameters), eps=eps
    )
    if problem is None and mask is not None:
        problem = mask_problem(mask, input)
    if problem is None:  # pragma: no cover - tracing and run time see the same metadata
        problem = RuntimeError("syncbn: a call traced as invalid is valid at run time")
    options = _options(site, group_name, num_features, None, backward=False)
    with join_on_error(options, "forward", anchor.device):
        raise problem
    raise AssertionError("unreachable")  # pragma: no cover - the context re-raises


def _fail_forward_fake(
    input: torch.Tensor,
    anchor: torch.Tensor,
    parameters: list[torch.Tensor | None],
    mask: torch.Tensor | None,
    order: torch.Tensor,
    site: torch.Tensor | None,
    group_name: str,
    num_features: int,
    eps: float,
) -> torch.Tensor:
    """The op while tracing (fake tensors), or on the meta device.

    Real tensors reach this kernel too, where some of them are on the meta device (a mask
    there for a layer on the CPU, or a layer there given a CPU input): the dispatcher then
    picks the Meta kernel, which this is. Those must raise as the implementation does,
    on every rank, not return an uninitialized output. Only where every tensor is on the
    meta device is this shape propagation.
    """
    tensors = [input, anchor, mask, *parameters]
    if fake_tensor.is_fake(input) or all(
        tensor is None or tensor.device.type == "meta" for tensor in tensors
    ):
        return torch.empty_like(input)
    return _fail_forward(
        input, anchor, parameters, mask, order, site, group_name, num_features, eps
    )


#: the ops' schemas, and their run-time and tracing (fake) implementations
_OPS: dict[str, tuple[str, Callable[..., Any], Callable[..., Any]]] = {
    "sync_moments": (
        "(Tensor moments, Tensor order, Tensor? num_batches_tracked, Tensor? site, "
        "str group_name, float? momentum, float eps, bool input_grad, str revision) "
        "-> (Tensor, Tensor, Tensor)",
        _sync_moments,
        _sync_moments_fake,
    ),
    "sync_moments_backward": (
        "(Tensor grad_moments, Tensor after, Tensor(a!) out, Tensor? site, str group_name) -> ()",
        _sync_moments_backward,
        _sync_moments_backward_fake,
    ),
    "fail_forward": (
        "(Tensor input, Tensor anchor, Tensor?[] parameters, Tensor? mask, Tensor order, "
        "Tensor? site, str group_name, int num_features, float eps) -> Tensor",
        _fail_forward,
        _fail_forward_fake,
    ),
}

#: the ``syncbn`` op library; its registrations last as long as this object
_library: torch.library.Library | None = None


@functools.cache
def _define_ops() -> None:
    """Register the ops (once; torch < 2.4 has no fullgraph, see :data:`FULLGRAPH`).

    Defined with ``torch.library.Library`` and one implementation for every device
    (``CompositeExplicitAutograd``), not with ``torch.library.custom_op``: a compiled
    graph calls each op once per layer and step, and the wrappers of ``custom_op``
    (autograd, version counter, dynamo guard and aliasing checks, each a Python call)
    cost more than the ops' bodies (measured on the 2-core CPU machine, per call:
    forward 92 -> 79 us, backward 121 -> 68 us; ``benchmarks/host_overhead.py``). For
    the same reason the forward op's autograd kernel is :func:`_autograd_kernel`, not
    ``torch.library.register_autograd``'s, which runs through Python where no autograd
    records, as in every call of a compiled forward graph. The backward op needs no
    autograd kernel; its mutated ``out`` is a fresh buffer of the formula, whose version
    counter nothing reads.
    """
    global _library
    if not FULLGRAPH:
        return
    _library = torch.library.Library("syncbn", "FRAGMENT")
    for name, (schema, implementation, fake) in _OPS.items():
        # pt2_compliant: torch.library.opcheck passes (tests/test_compile.py), as custom_op
        # tags its ops
        _library.define(name + schema, tags=(torch.Tag.pt2_compliant_tag,))
        _library.impl(name, implementation, "CompositeExplicitAutograd")
        torch.library.register_fake(f"syncbn::{name}", fake, lib=_library)
        _keep_in_graph(getattr(torch.ops.syncbn, name).default)
    _library.impl("sync_moments", _autograd_kernel, "Autograd", with_keyset=True)
    caching_mode = getattr(torch.utils.checkpoint, "_CachingTorchDispatchMode", None)
    for mode in (proxy_tensor.ProxyTorchDispatchMode, caching_mode):
        if mode is not None:  # (caching mode: torch >= 2.4, as FULLGRAPH)
            torch.ops.syncbn.sync_moments.default.py_impl(mode)(_tag_after)


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


#: per device, the tensor that orders the synchronizing ops of compiled forward graphs
_order_tokens: dict[str, torch.Tensor] = {}


def order_token(device: torch.device) -> torch.Tensor:
    """The tensor that chains the synchronizing ops of compiled forward graphs on
    ``device`` in the order of the calls.

    Ranks must run their collectives in the same order. A compiled graph runs its ops in
    any order that respects their data dependencies, and on a rank whose local batch is
    empty two layers' ops have none (the size-0 graph's moments are constants): inductor
    did run the second layer's collective first there. So each op reads the token and
    returns a new value for it, written back in place (:func:`_advance`): the next op
    reads what the previous one wrote. The token is a global tensor, which dynamo passes
    to the graphs as an input whose identity never changes (no recompilation); a layer
    creates the token of its device when it is built or moved
    (:func:`prepare_order_token`), so that the first graph already finds it.
    """
    token = _order_tokens.get(str(device))
    if token is None:  # eagerly from prepare_order_token, or traced for a new device
        if is_compiling():
            token = torch.zeros(1, device=device)
        else:
            # never an inference tensor (a layer built under torch.inference_mode): those
            # cannot be advanced in place outside inference mode, by any later training call
            with torch.inference_mode(False):
                token = torch.zeros(1, device=device)
            if type(token) is not torch.Tensor:
                # a fake one (a layer built under FakeTensorMode, as memory estimators build
                # models): not kept, or every later real graph on the device would read it
                return token
        _order_tokens[str(device)] = token
    return token


def prepare_order_token(device: torch.device) -> None:
    """Create the order token of ``device`` eagerly, before a graph reads it."""
    # what torch._dynamo.mark_static_address sets (without importing dynamo): the token's
    # address never changes, so CUDA graphs use it in place
    order_token(device)._dynamo_static_input_type = "unguarded"  # type: ignore[attr-defined]


def _advance(token: torch.Tensor, advanced: torch.Tensor) -> None:
    """Write an op's ``advanced`` token into ``token``: every later reader of ``token``
    depends on that op."""
    with torch.no_grad():
        token.copy_(advanced)


#: per graph being traced (its tracer's dispatch mode), the output of its latest backward op
_backward_outputs: weakref.WeakKeyDictionary[Any, torch.Tensor] = weakref.WeakKeyDictionary()


def _previous_backward_output(output: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    """What the backward op about to write ``output`` reads so that it runs after the
    backward op traced before it in the same graph: that op's output (the autograd
    engine traces them in the order of eager mode, the same on every rank); ``first``
    for the first one.

    A backward formula runs as real Python while AOTAutograd traces the joint graph, so
    the chain is kept per trace (keyed by its proxy mode) rather than in a global tensor,
    which the backward graph could not write since its forward graph writes it. The op
    writes its gradient into ``output`` (a mutation) rather than returning it: inductor
    keeps it even when nothing reads the gradient (an empty local batch), also on torch
    2.8, which drops unused ops that mutate nothing. Outside of tracing (dynamo's
    ``"eager"`` backend runs the op itself) the autograd engine orders the calls.
    """
    mode = _proxy_mode()
    if mode is None:
        return first
    previous = _backward_outputs.get(mode, first)
    _backward_outputs[mode] = output
    return previous


def _exchange(
    num_batches_tracked: torch.Tensor | None,
    site: torch.Tensor | None,
    group_name: str,
    momentum: float | None,
    eps: float,
    ordered: bool,
) -> _composite.Exchange:
    """The ``exchange`` of :func:`syncbn._composite.batch_norm_train` in a compiled graph:
    the ``syncbn::sync_moments`` op; ``ordered``: chained by the device's order token (see
    :func:`sync_batch_norm_train`)."""

    def exchange(moments: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # a process alone has no collective to order: a token of its own
        order = order_token(moments.device) if ordered else moments.new_zeros(1)
        # whether the input needs a gradient, as tracing sees it (a constant of the graph)
        input_grad = moments.requires_grad and torch.is_grad_enabled()
        global_moments, update, advanced = torch.ops.syncbn.sync_moments(
            moments,
            order,
            num_batches_tracked,
            site,
            group_name,
            momentum,
            eps,
            input_grad,
            REVISION,
        )
        if ordered:
            _advance(order, advanced)
        return global_moments, update

    return exchange


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
    site: torch.Tensor | None,
    group_name: str = "",
    ordered: bool = True,
) -> torch.Tensor:
    """A synchronized (or masked) training call while dynamo traces: :mod:`syncbn._composite`
    around the ``syncbn::sync_moments`` op.

    An input (or mask) that tracing finds invalid compiles to ``syncbn::fail_forward``:
    at run time it joins the collective with the error flag and raises, on every rank.

    Args:
        num_features: the layer's channel count (an input with another count is invalid).
        site: the layer's site tensor (:func:`site_tensor`), or None for a functional
            call, whose ops name its process group by ``group_name`` (``""``: the default
            group) and take ``eps`` and ``momentum``.
        ordered: whether the call synchronizes, so that its op reads and advances the
            device's order token (:func:`order_token`). A masked call of a process alone
            makes no collective: its op reads a token of its own, and the graph refers to
            no global tensor, which ``torch.export`` on torch 2.4-2.7 refuses ("Cannot
            export model which references tensors that are neither buffers/parameters/
            constants nor are direct inputs").
    """
    per_channel = first_given(weight, bias, running_mean, running_var)
    anchor = input if per_channel is None else per_channel  # where the buffers live
    parameters = (weight, bias, running_mean, running_var)
    problem = input_problem(input, num_features, anchor.device, parameters=parameters, eps=eps)
    if problem is None and mask is not None:
        problem = mask_problem(mask, input)
    if problem is not None:
        if mask is not None and not isinstance(mask, torch.Tensor):
            raise problem  # not a tensor: a programming error, the same on every rank
        # the op finds the problem again from the same tensors and settings; a layer on
        # the meta device (which prepares no order token) given a real input takes the
        # input's token: its trace then creates none, which torch 2.4's dynamo fails on
        # where the process holds another device's token already
        ordered_on = input.device if anchor.device.type == "meta" else anchor.device
        output: torch.Tensor = torch.ops.syncbn.fail_forward(
            input.detach(),
            anchor.detach(),
            [None if tensor is None else tensor.detach() for tensor in parameters],
            None if mask is None else mask.detach(),
            order_token(ordered_on),
            site,
            group_name,
            num_features,
            eps,
        )
        return output
    return _composite.batch_norm_train(
        input,
        weight,
        bias,
        mask,
        _exchange(num_batches_tracked, site, group_name, momentum, eps, ordered),
        eps=eps,
        running_mean=running_mean,
        running_var=running_var,
        num_batches_tracked=num_batches_tracked,
    )


# defined when syncbn is imported (~5 ms), as torch libraries define their custom ops: dynamo
# must find them defined when it first traces a call, which for the functional form can be
# the first call in a process that built no SyncBatchNorm layer
_define_ops()
