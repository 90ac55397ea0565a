"""The autograd function behind SyncBatchNorm in training: one collective each way.

Each direction is local maths (:mod:`syncbn._kernels`), one collective of a packed buffer
(:mod:`syncbn._protocol`, summed by a :class:`Reducer`), then global maths
(:mod:`syncbn._stats`). :func:`forward_train` and :func:`backward_train` hold that
sequence once for the autograd Function here; the custom ops that ``torch.compile``
traces (:mod:`syncbn._compiled`) share its collectives and checks
(:func:`reduce_forward`, :func:`synchronize_grads`).

A training call reads nothing back from the device unless its checks run at once
(``"immediate"``, the default on CPU): the global count stays a tensor on the device,
and the running statistics are updated with device-side factors.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any, NamedTuple, Protocol

import torch
import torch.distributed as dist

from syncbn import _protocol, _stats, distributed
from syncbn._composite import mask_problem, valid_positions
from syncbn._double_backward import differentiable_backward
from syncbn._kernels import LocalMoments, fused_finalize_for, kernels_for, takes_triton_passes
from syncbn._kernels.generic import (
    corrected_input_grad,
    in_place_masked,
    masked_input_grad,
    output_offset,
    reuses_shifted_copy,
)

__all__ = [
    "HostDivisors",
    "LayerInfo",
    "LocalReducer",
    "ProcessGroupReducer",
    "ReducedForward",
    "Reducer",
    "TrainOptions",
    "backward_input",
    "backward_train",
    "collective_device",
    "count_divisors",
    "counted_update",
    "double_backward_error",
    "first_given",
    "forward_train",
    "input_problem",
    "is_recomputing",
    "is_tracing",
    "join_on_error",
    "join_with_error",
    "mismatched_parameter",
    "reduce_forward",
    "reducer_for",
    "resolve_mode",
    "sync_batch_norm_train",
    "sum_over_participants",
    "synchronize_grads",
]

_SAME_CALLS_RULE = (
    "every rank must call every SyncBatchNorm layer the same number of times, in the same "
    "order, with the same number of channels, eps and momentum (also in backward: the same "
    "layers must receive gradients on every rank, so their inputs must agree on requires_grad)"
)


#: torch >= 2.2 has float16 batch-norm kernels on the CPU (pytorch/pytorch#102070); before
#: it torch.nn.BatchNorm raises for float16 CPU input, and so does a synchronized call, on
#: every rank before the collective
_CPU_FLOAT16 = torch.torch_version.TorchVersion(torch.__version__) >= "2.2"


def is_recomputing() -> bool:
    """True when a forward runs inside a backward pass, as activation checkpointing recomputes it.

    Such a forward must not update running statistics a second time. Detected with the
    autograd engine's current graph task (-1 outside backward), which is what
    ``torch.utils.checkpoint`` itself relies on; on a torch without it, never true.
    """
    current_graph_task_id = getattr(torch._C, "_current_graph_task_id", None)
    return current_graph_task_id is not None and current_graph_task_id() != -1


#: input dtypes that torch's batch norm also takes with float32 parameters and buffers
_REDUCED_PRECISION = (torch.float16, torch.bfloat16)


#: torch >= 2.10's batch norm refuses an eps that is not positive in training
#: (pytorch/pytorch#166756); synchronized and masked calls then refuse it too
_REFUSES_EPS = torch.torch_version.TorchVersion(torch.__version__) >= "2.10"


def mismatched_parameter(input: torch.Tensor, *tensors: torch.Tensor | None) -> torch.Tensor | None:
    """The first of a layer's per-channel tensors whose dtype torch's batch norm rejects for
    ``input``: not the input's dtype, nor float32 for a float16 or bfloat16 input; nor a
    dtype other than that of the tensors before it (torch takes them all in the input's
    dtype, or all float32, not a mix)."""
    dtype = input.dtype
    accepted = None
    for tensor in tensors:  # a loop: dynamo < 2.4 cannot trace next() with a default
        if tensor is None:
            continue
        if accepted is None:
            accepted = tensor.dtype
            if accepted != dtype and not (
                dtype in _REDUCED_PRECISION and accepted == torch.float32
            ):
                return tensor
        elif tensor.dtype != accepted:
            return tensor
    return None


def input_problem(
    input: torch.Tensor,
    num_features: int | None,
    param_device: torch.device | None = None,
    layer_kind: str = "SyncBatchNorm",
    parameters: tuple[torch.Tensor | None, ...] = (),
    eps: float | None = None,
) -> Exception | None:
    """The error a bad ``input`` deserves, or ``None`` if it is a valid ``(N, C, *)`` batch.

    Args:
        parameters: the layer's weight, bias and running statistics (``None`` where it has
            none), whose dtypes must be what torch's batch norm accepts with the input's,
            and which must have ``num_features`` elements each.
        eps: a training call's ``eps`` (one that syncbn computes itself: synchronized or
            masked), refused where torch's batch norm refuses it, and whose per-channel
            tensors must then be ``(C,)`` vectors; or ``None``, not checked.
    """
    if not is_tracing() and torch.jit.is_tracing():  # (dynamo's check first: traceable)
        # torch.jit.trace records sizes as tensors, and comparing them warns that the trace
        # might not generalize; these checks compare channel counts, which a trace fixes
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", torch.jit.TracerWarning)
            return _input_problem(input, num_features, param_device, layer_kind, parameters, eps)
    return _input_problem(input, num_features, param_device, layer_kind, parameters, eps)


def _input_problem(
    input: torch.Tensor,
    num_features: int | None,
    param_device: torch.device | None,
    layer_kind: str,
    parameters: tuple[torch.Tensor | None, ...],
    eps: float | None,
) -> Exception | None:
    """:func:`input_problem`'s checks."""
    if not isinstance(input, torch.Tensor):
        return TypeError(f"{layer_kind}: expected input to be a Tensor, got {type(input).__name__}")
    if input.dim() < 2:
        return ValueError(f"expected at least 2D input (got {input.dim()}D input)")
    if input.shape[1] == 0:  # torch.nn.SyncBatchNorm's words
        return ValueError(f"{layer_kind} number of input channels should be non-zero")
    if num_features is not None and input.shape[1] != num_features:
        return ValueError(
            f"expected input with {num_features} channels (num_features={num_features}), "
            f"got input of shape {tuple(input.shape)} with {input.shape[1]} channels"
        )
    if not input.is_floating_point():
        return TypeError(
            f"{layer_kind} expects a floating point input, got input of dtype {input.dtype}"
        )
    if input.dtype == torch.float16 and input.device.type == "cpu" and not _CPU_FLOAT16:
        return RuntimeError(
            f"{layer_kind}: float16 input on the CPU needs torch >= 2.2 (torch "
            f"{torch.__version__} has no CPU float16 batch_norm kernel); use bfloat16 or float32"
        )
    if param_device is not None and input.device != param_device:
        return RuntimeError(
            "Expected input and the layer's parameters and buffers to be on the same device, "
            f"got input on {input.device} and parameters on {param_device}"
        )
    mismatched = mismatched_parameter(input, *parameters)
    if mismatched is not None:
        others = sorted(
            {str(t.dtype) for t in parameters if t is not None} - {str(mismatched.dtype)}
        )
        return RuntimeError(
            f"{layer_kind}: expected the layer's parameters and buffers to have the input's "
            f"dtype, or all float32 for a float16 or bfloat16 input (as torch's batch norm "
            f"does); got input of dtype {input.dtype} and a parameter or buffer of dtype "
            f"{mismatched.dtype}"
            + (f" beside others of dtype {', '.join(others)}" if others else "")
            + ". Convert the layer (layer.to(dtype)) or the input"
        )
    vector = (num_features,)
    for tensor in parameters:
        # torch's batch norm takes any shape of C elements; a training call's own maths
        # (eps given) takes (C,) vectors, or a 0-dim tensor for one channel
        if (
            tensor is not None
            and num_features is not None
            and tensor.shape != vector
            and (tensor.numel() != num_features or (eps is not None and tensor.dim() > 1))
        ):
            return RuntimeError(
                f"{layer_kind}: expected the per-channel parameters and buffers (weight, bias, "
                f"running_mean, running_var) to have shape ({num_features},), one value per "
                f"channel; got one of shape {tuple(tensor.shape)}"
            )
    if eps is not None and eps <= 0.0 and _REFUSES_EPS:  # torch's words
        # while dynamo traces, eps may be symbolic, which no string can hold: the message is
        # written again, with the value, at run time (syncbn::fail_forward)
        value = "a value that is not positive" if is_tracing() else str(eps)
        return ValueError(f"batch_norm eps must be positive during training, but got {value}")
    return None


#: dynamo's own check, which it traces as a constant: ``torch.compiler.is_compiling`` from
#: torch 2.3, before it ``torch._utils.is_compiling``. Chosen here, not in each call: torch
#: 2.2's dynamo cannot trace the ``getattr`` of a module attribute with a default, and broke
#: the graph there ("hasattr PythonModuleVariable is_compiling"), which ``torch.export``
#: refuses (a compatibility run, 2026-12-07)
_dynamo_is_compiling: Callable[[], bool] = (
    getattr(torch.compiler, "is_compiling", None) or torch._utils.is_compiling
)


def is_tracing() -> bool:
    """True while dynamo traces (the check itself is traceable)."""
    return bool(_dynamo_is_compiling())


class Reducer(Protocol):
    """Sums a float64 buffer over all participants of one synchronized layer call.

    :class:`ProcessGroupReducer` does it with one ``all_reduce`` over a process group;
    :mod:`syncbn.data_parallel` does it between the replicas of one process, whose reducer
    also has ``release_others(error)`` (see :func:`resolve_mode`).
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

    def dissolved_test(self) -> Callable[[], bool] | None:
        """A test of whether these participants have dissolved since (a destroyed process
        group), kept by deferred checks; ``None`` if they cannot."""
        ...


class ProcessGroupReducer(NamedTuple):
    """The :class:`Reducer` of a process group: one in-place ``all_reduce``."""

    group: dist.ProcessGroup | None
    world_size: int
    participants: str = "ranks"

    def all_reduce(self, buffer: torch.Tensor, phase: str) -> torch.Tensor:
        distributed.check_collective(buffer.device, self.group)
        return distributed.all_reduce_sum_(buffer, self.group)

    def dissolved_test(self) -> Callable[[], bool]:
        return distributed.destroyed_test(self.group)


class LocalReducer(NamedTuple):
    """The :class:`Reducer` of a process alone (no process group): the sum is the buffer.

    Masked calls without a process group use it, so that one code path, checks included,
    serves one process and many.
    """

    world_size: int = 1
    participants: str = "ranks"

    def all_reduce(self, buffer: torch.Tensor, phase: str) -> torch.Tensor:
        return buffer

    def dissolved_test(self) -> None:
        return None


def reducer_for(group: dist.ProcessGroup | None, force: bool = False) -> Reducer:
    """The reducer of a layer call over ``group``: local when the group has one rank (or
    there is none), unless ``force`` (tests and benchmarks of the synchronized path)."""
    world_size = distributed.group_world_size(group)
    if world_size <= 1 and not force:
        return LocalReducer()
    return ProcessGroupReducer(group, world_size)


class LayerInfo(NamedTuple):
    """What identifies one call of a SyncBatchNorm layer in error messages and fingerprints.

    Attributes:
        name: the layer's identity: its module path (set by ``convert_sync_batchnorm``),
            ``"#k"`` for the k-th SyncBatchNorm built in this process, or ``""``.
        num_features: the layer's channel count.
        call_index: how many synchronized calls this layer had made before this one, or
            ``None`` where unknown.
        check_layer_order: whether the fingerprint is checked after each collective.
        check_mode: ``"auto"``, ``"immediate"`` or ``"deferred"`` (see :mod:`syncbn._protocol`).
    """

    name: str
    num_features: int
    call_index: int | None = 0
    check_layer_order: bool = True
    check_mode: str = "auto"

    def describe(self) -> str:
        name = repr(self.name) if self.name else "<unnamed>"
        call = "" if self.call_index is None else f", call {self.call_index}"
        return f"SyncBatchNorm layer {name} (num_features={self.num_features}{call})"


class TrainOptions(NamedTuple):
    """Everything about one synchronized training call that is not a tensor.

    Attributes:
        reducer: sums the packed buffers over the participants.
        layer: the calling layer's identity and check settings.
        eps: added to the variance.
        momentum: the running statistics' factor, or ``None`` for a cumulative average
            (``1 / (num_batches_tracked + 1)``).
        input_grad: whether the call's input needs a gradient (its backward then joins a
            collective); the forward's fingerprint says it (:attr:`forward_fingerprint`).
    """

    reducer: Reducer
    layer: LayerInfo
    eps: float = 1e-5
    momentum: float | None = 0.1
    input_grad: bool = True

    @property
    def fingerprint(self) -> int:
        """The layer's fingerprint (its identity, channel count, ``eps`` and ``momentum``),
        which its backward buffers carry offset; 0 where the order check is off."""
        layer = self.layer
        if not layer.check_layer_order:
            return 0
        return _protocol.fingerprint(layer.name, layer.num_features, self.eps, self.momentum)

    @property
    def forward_fingerprint(self) -> int:
        """What this call's forward buffer carries (``_protocol.forward_fingerprint``)."""
        return _protocol.forward_fingerprint(self.fingerprint, self.input_grad)

    def header_check(
        self, phase: str, input_size: tuple[int, ...] | None = None
    ) -> _protocol.HeaderCheck:
        return _protocol.HeaderCheck(
            world_size=self.reducer.world_size,
            participants=self.reducer.participants,
            fingerprint=self.forward_fingerprint if phase == "forward" else self.fingerprint,
            check_fingerprint=self.layer.check_layer_order,
            layer=self.layer,
            phase=phase,
            same_calls_rule=_SAME_CALLS_RULE,
            input_size=input_size,
        )


def join_with_error(options: TrainOptions, phase: str, device: torch.device) -> None:
    """Join ``phase``'s collective with the error flag set, so that no other rank waits.

    Called while an exception is propagating; a failure of the collective itself (peers
    gone) must not replace that exception, so it is dropped.
    """
    zeros = torch.zeros(options.layer.num_features, dtype=_protocol.PACK_DTYPE, device=device)
    if phase == "forward":
        buffer = _protocol.pack_forward(0, zeros, zeros, options.forward_fingerprint, error=True)
    else:
        fingerprint = options.fingerprint
        buffer = _protocol.pack_backward(zeros, zeros, fingerprint, error=True, phase=phase)
    try:
        options.reducer.all_reduce(buffer, phase)
    except Exception:  # noqa: BLE001 - the original exception is the one to report
        pass


class join_on_error:  # noqa: N801 - used like a function: `with join_on_error(...):`
    """Run the local part of a call; on an exception, join ``phase``'s collective with the
    error flag (so that the other ranks raise promptly instead of waiting for the process
    group's timeout) and re-raise it.

    A class rather than a ``contextlib.contextmanager`` generator: it is entered on every
    training call, and costs a fraction of a generator's setup. ``enabled=False`` makes it
    do nothing (a backward that joins no collective).
    """

    __slots__ = ("device", "enabled", "options", "phase")

    def __init__(
        self, options: TrainOptions, phase: str, device: torch.device, enabled: bool = True
    ) -> None:
        self.options, self.phase, self.device, self.enabled = options, phase, device, enabled

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, error: Any, traceback: Any) -> None:
        if self.enabled and kind is not None and issubclass(kind, Exception):
            join_with_error(self.options, self.phase, self.device)
        # returning None re-raises the exception


class ForwardResult(NamedTuple):
    """What a training forward returns, and what its backward needs."""

    output: torch.Tensor
    #: ``(4, C)`` in the statistics dtype, by row: the mean of :attr:`backward_input`, the
    #: biased variance, the scale ``weight / sqrt(var + eps)``, and ``-scale / n`` for the
    #: global count ``n``, which turns the global backward sums into the input gradient's
    #: corrections
    saved: torch.Tensor
    #: the global count per channel: a host number, or a 0-dim float64 tensor on the device
    global_count: int | torch.Tensor
    #: what backward takes as the input: the input itself, or for a masked call a tensor
    #: that is zero at padded positions (see :func:`backward_input`)
    backward_input: torch.Tensor
    #: ``(N, 1, *)`` bool, True at the valid positions of a masked call; ``None`` unmasked
    valid: torch.Tensor | None = None
    #: a call whose passes are :mod:`syncbn._kernels.triton_passes`' (Triton): its ``(C,)``
    #: shift, which backward subtracts from :attr:`backward_input`, the input itself (the
    #: kernels read only its valid positions); ``None`` for the other calls
    shift: torch.Tensor | None = None


def first_given(*tensors: torch.Tensor | None) -> torch.Tensor | None:
    """The first of a layer's per-channel tensors that is not ``None``, if any."""
    for tensor in tensors:  # a loop: dynamo < 2.4 cannot trace next() with a default
        if tensor is not None:
            return tensor
    return None


def collective_device(input: Any, *per_channel: torch.Tensor | None) -> torch.device:
    """The device of a call's collective buffers: where the layer's per-channel tensors
    live (and so the other ranks' buffers), else the input's, else, where no tensor tells,
    the CPU (gloo's), so that the error flag still joins."""
    tensor = first_given(*per_channel)
    if tensor is not None:
        return tensor.device
    return input.device if isinstance(input, torch.Tensor) else torch.device("cpu")


def resolve_mode(options: TrainOptions, device: torch.device) -> str:
    """This call's check mode; first raises a deferred problem of an earlier call, if any.

    Called before a call's collective and outside :class:`join_on_error`: the problem is
    that of an earlier collective, which the other ranks saw too (or whose rank that
    failed has left the step already), so they stop by themselves. Joining this call's
    collective with the error flag would meet no one there, and pair this rank's later
    collectives with the wrong calls of the others (after a caught error, training
    would never recover, or a size mismatch would abort the processes). Replicas of one
    process are the exception: they share its deferred checks, and the first to read a
    problem takes it from the others, so a reducer with ``release_others``
    (:class:`syncbn._replicas.ReplicaReducer`) releases them to raise too.
    """
    mode = _protocol.resolve_check_mode(options.layer.check_mode, device)
    if mode == "deferred":
        try:
            _protocol.raise_deferred(device=device)  # a problem of an earlier call, now arrived
        except Exception as error:
            # (the other replicas would wait for this one until the layer's timeout)
            release = getattr(options.reducer, "release_others", None)
            if release is not None:
                release(error)
            raise
    return mode


class ReducedForward(NamedTuple):
    """A forward buffer summed over the participants and checked."""

    #: the all-reduced :func:`syncbn._protocol.pack_forward` buffer
    buffer: torch.Tensor
    #: the global count per channel: a host number, or a 0-dim float64 tensor on the device
    global_count: int | torch.Tensor
    #: the running statistics' factor for this call: 0 where they must not move (a global
    #: batch of fewer than 2 values, a deferred check that fails)
    factor: float | torch.Tensor
    #: deferred checks: what ``num_batches_tracked`` counts, a 0-dim bool tensor (false
    #: where they fail); ``None`` when immediate (the call counts, or it raised)
    increment: torch.Tensor | None
    #: deferred checks: ``[increment, factor]`` on the device, in float64 or the dtype
    #: :func:`reduce_forward` was given (:attr:`factor` is a view of its last value);
    #: ``None`` when immediate
    update: torch.Tensor | None = None
    #: deferred checks, where :func:`reduce_forward` was asked for it: ``1 - factor`` on the
    #: device, made in the factor's kernel (see :func:`syncbn._stats.update_running_stats`)
    keep: torch.Tensor | None = None


@_protocol.constant_cache(maxsize=256)
def counted_update(
    factor: float, device: torch.device, dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    """``[1, factor]`` in ``dtype`` on ``device``, built once per factor (a momentum repeats
    from call to call): the batch count's increment and the running statistics' factor."""
    return _protocol.on_device([1.0, factor], dtype, device)


@_protocol.constant_cache(maxsize=256)
def _moving_terms(
    factor: float, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Base and steps of a deferred call's ``[[increment, factor], [0, 1 - factor]]``, one
    ``addcmul`` of theirs with its two flags (:func:`syncbn._protocol.device_flags`, which
    broadcast along the rows): ``[[0, 0], [0, 1]]`` and ``[[1, factor], [0, -factor]]``,
    built once per factor."""
    terms = _protocol.on_device([0.0, 0.0, 0.0, 1.0, 1.0, factor, 0.0, -factor], dtype, device)
    base, steps = terms.view(2, 2, 2).unbind()
    return base, steps


@_protocol.constant_cache(maxsize=256)
def _divisor_terms(device: torch.device) -> tuple[torch.Tensor, ...]:
    """Four ``(3, 1)`` float64 columns: offsets, signs, lower and upper bounds of
    :func:`count_divisors`, built (and unbound) once per device."""
    inf = float("inf")
    terms = [[0.0, -1.0, 0.0], [1.0, 1.0, -1.0], [1.0, 1.0, -inf], [inf, inf, -1.0]]
    return _protocol.on_device(terms, torch.float64, device).unsqueeze(-1).unbind()


#: ``(n, n - 1, -n)`` of a global count known on the host (see :func:`count_divisors`)
HostDivisors = tuple[float, float, float]


def count_divisors(count: int | torch.Tensor, device: torch.device) -> torch.Tensor | HostDivisors:
    """``[n, n - 1, -n]`` for the global count ``n`` per channel, each at least 1 in
    magnitude: the divisors of the mean and biased variance, of the unbiased variance, and
    of the input gradient's corrections.

    For a count on the device, a ``(3, 1)`` float64 column there (its rows broadcast
    against ``(C,)`` vectors, its first two against ``(2, C)``), in two kernels and with
    nothing read back; for a count known on the host, numbers.
    """
    if not isinstance(count, torch.Tensor):
        n = float(max(count, 1))
        return n, float(max(count - 1, 1)), -n
    offsets, signs, lower, upper = _divisor_terms(device)
    return torch.addcmul(offsets, signs, count).clamp_(lower, upper)


def reduce_forward(
    buffer: torch.Tensor,
    mode: str,
    num_batches_tracked: torch.Tensor | None,
    options: TrainOptions,
    input_size: tuple[int, ...] | None = None,
    update_dtype: torch.dtype = torch.float64,
    keep: bool = False,
) -> ReducedForward:
    """All-reduce a packed forward buffer and check it (at once, or deferred).

    Args:
        buffer: this rank's :func:`syncbn._protocol.pack_forward` buffer.
        mode: ``"immediate"`` or ``"deferred"`` (from :func:`resolve_mode`).
        num_batches_tracked: read for a cumulative average (``momentum=None``).
        input_size: the local input's size, quoted by the "more than 1 value" error.
        update_dtype: the dtype of a deferred call's :attr:`ReducedForward.update`: that
            of the running statistics, which then need no conversion of the factor.
        keep: a deferred call's :attr:`ReducedForward.keep` with a momentum (the kernel
            that makes the factor makes ``1 - factor`` too), in place of
            :attr:`ReducedForward.update`.
    """
    buffer = options.reducer.all_reduce(buffer, "forward")
    check = options.header_check("forward", input_size)
    momentum = options.momentum
    if mode == "immediate":
        global_count = _protocol.check_now(buffer, check).global_count
        factor = 0.0 if momentum is None else momentum
        if momentum is None and num_batches_tracked is not None:  # a cumulative average
            factor = 1.0 / (float(num_batches_tracked) + 1.0)
        # an empty global batch moves nothing (a count of 1 has raised)
        return ReducedForward(buffer, global_count, factor if global_count > 1 else 0.0, None)
    header = _protocol.header_values(buffer)
    _protocol.defer_check(buffer, check, header, options.reducer.dissolved_test())
    count = _protocol.count_slot(buffer)
    # [the checks pass, and the global batch is not empty]: a call whose checks fail
    # counts no batch and moves no running statistics
    flags = _protocol.device_flags(header, options.reducer.world_size, options.forward_fingerprint)
    if momentum is None and num_batches_tracked is not None:  # a cumulative average
        # in float64, then rounded once: float16 cannot even hold a count above 65504
        average = num_batches_tracked.add(1).to(torch.float64).reciprocal_()
        update = torch.stack([torch.ones_like(average), average]).mul_(flags).to(update_dtype)
    else:
        factor = 0.0 if momentum is None else momentum
        if keep:  # one kernel
            base, steps = _moving_terms(factor, buffer.device, update_dtype)
            # the second column: [factor, 1 - factor], zeros and one where the checks fail
            moved, kept = torch.addcmul(base, flags, steps)[:, 1].unbind()
            return ReducedForward(buffer, count, moved, flags[0], keep=kept)
        # one kernel: bool times a float tensor is a float tensor
        update = torch.mul(flags, counted_update(factor, buffer.device, update_dtype))
    return ReducedForward(buffer, count, update[1], flags[0], update)


def synchronize_grads(
    buffer: torch.Tensor, options: TrainOptions, device: torch.device, phase: str = "backward"
) -> torch.Tensor:
    """All-reduce a packed backward buffer and check it; the ``(2, C)`` global sums.

    ``phase`` names the collective (a second backward's: :mod:`syncbn._double_backward`).
    """
    buffer = options.reducer.all_reduce(buffer, phase)
    check = options.header_check(phase)
    if _protocol.resolve_check_mode(options.layer.check_mode, device) == "immediate":
        _protocol.check_now(buffer, check)
    else:
        _protocol.defer_check(buffer, check, dissolved=options.reducer.dissolved_test())
    return _protocol.backward_totals(buffer)


def sum_over_participants(local: torch.Tensor, phase: str, options: TrainOptions) -> torch.Tensor:
    """A ``(2, C)`` tensor summed over the participants in one checked collective of the
    backward's layout: a differentiable backward's (:mod:`syncbn._double_backward`).

    Outside the first backward (``phase`` ``"backward"``), the fingerprint names the phase
    too, so that ranks in different phases fail the check instead of summing each other's
    gradients.
    """
    if phase != "backward":
        layer = options.layer
        options = options._replace(layer=layer._replace(name=f"{layer.name} [{phase}]"))
    device = local.device
    # a deferred problem of an earlier collective first, as before every other collective:
    # the other ranks raised it already and will not join this one
    resolve_mode(options, device)
    with join_on_error(options, phase, device):
        flat = local.detach().reshape(-1).to(_protocol.PACK_DTYPE)
        buffer = _protocol.pack_backward_sums(flat, options.fingerprint)
    return synchronize_grads(buffer, options, device, phase).to(local.dtype, copy=True)


def forward_train(
    input: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    num_batches_tracked: torch.Tensor | None,
    options: TrainOptions,
    mask: torch.Tensor | None = None,
) -> ForwardResult:
    """Normalize ``input`` with the global batch's statistics; update the running statistics.

    Any exception before the collective (invalid input or mask, an error in the local
    maths) joins the collective with the error flag and is re-raised, so that the other
    ranks raise promptly instead of waiting for the process group's timeout. A deferred
    problem of an earlier call is raised before that, without joining (see
    :func:`resolve_mode`).

    A deferred call on a device for which :func:`syncbn._kernels.use_fused_finalize` is on
    (a candidate, off by default) finishes in :func:`_forward_on_fused_kernel`.

    Args:
        mask: bool, True at the valid positions (the input's shape without the channel
            dimension, or broadcastable to it), or ``None``. See :attr:`ForwardResult.valid`.
    """
    device = collective_device(input, weight, bias, running_mean, running_var)
    num_channels = options.layer.num_features
    valid = None
    # outside join_on_error: see resolve_mode
    mode = resolve_mode(options, device)
    fused = None  # syncbn._kernels.finalize, a candidate: off by default
    triton_passes = False  # with it, syncbn._kernels.triton_passes' passes over the data
    if mode == "deferred":
        fused = fused_finalize_for(device)
        if fused is not None and not fused.applies(running_mean, running_var, weight, bias):
            fused = None
    with join_on_error(options, "forward", device):
        # nothing reads the input before this check: an input that is not even a tensor
        # joins the collective with the error flag too
        parameters = (weight, bias, running_mean, running_var)
        problem = input_problem(input, num_channels, device, parameters=parameters, eps=options.eps)
        if problem is None and mask is not None:
            problem = mask_problem(mask, input)
        if problem is not None:
            raise problem
        kernels = kernels_for(input.device)
        if mask is not None:
            valid = valid_positions(mask, input)
        if fused is not None:
            triton_passes = takes_triton_passes(input)
            fingerprint = options.forward_fingerprint
            moments, buffer = fused.pack_forward(input, fingerprint, valid, triton_passes)
        else:
            # a CPU call whose checks are immediate reads its buffer back anyway: a masked
            # one may read its valid count and first valid position too (fewer ops)
            host_reads = mode == "immediate" and input.device.type == "cpu"
            moments = kernels.local_moments(input, valid, host_reads)
            buffer = _protocol.pack_forward(
                moments.local_count,
                moments.total,
                moments.square_total,
                options.forward_fingerprint,
            )
    running = first_given(running_mean, running_var)
    update_dtype = torch.float64 if running is None else running.dtype
    if fused is not None:
        buffers = (running_mean, running_var, num_batches_tracked)
        return _forward_on_fused_kernel(
            fused, buffer, input, moments, weight, bias, *buffers, options, update_dtype, valid,
            triton_passes,
        )  # fmt: skip
    reduced = reduce_forward(
        buffer, mode, num_batches_tracked, options, tuple(input.shape), update_dtype, keep=True
    )
    count = reduced.global_count
    divisors = count_divisors(count, buffer.device)
    sums = _protocol.forward_totals(reduced.buffer)
    mean, var, unbiased_var = _stats.moments_from_divisors(
        sums, divisors, unbiased=running_var is not None
    )
    scale = _stats.scale(var, options.eps, weight)
    saved_input, saved_mean = input, mean
    if valid is not None:
        saved_input, centered = backward_input(input, moments, valid)
        if centered:  # the shifted copy's mean
            saved_mean = mean - moments.shift
    # what backward saves (see ForwardResult.saved), converted to the statistics dtype in a
    # tensor of its own (backward keeps it alive); then, in one more conversion, the output's
    # offset, where the output is written into the shifted copy (low precision takes an
    # eval-mode batch_norm, which needs none), and the running statistics' targets, if there
    # are running statistics (the variance's unread without a running variance)
    dtype = _stats.stat_dtype(input.dtype)
    saved = torch.stack([saved_mean, var, scale, scale / divisors[2]]).to(dtype)
    rows = []
    with_offset = reuses_shifted_copy(input, moments)
    if with_offset:
        rows.append(output_offset(moments.shift, mean, scale, bias))
    tracked = running_mean is not None or running_var is not None
    if tracked:
        rows += [mean, var if unbiased_var is None else unbiased_var]
    converted = _converted(rows, dtype)
    offset = None if converted is None or not with_offset else converted[0]
    recomputing = is_recomputing()  # a checkpointed forward already updated the buffers
    if converted is not None and tracked and not recomputing:
        # its last two rows: the mean and the variance
        _stats.update_running_stats(
            running_mean, running_var, converted, reduced.factor, reduced.keep
        )
    if num_batches_tracked is not None and not recomputing:
        # a deferred check that fails counts no batch (its increment is 0)
        increment = reduced.increment
        num_batches_tracked.add_(1 if increment is None else increment)
    output = kernels.normalize(input, moments, saved, offset, weight, bias, options.eps, valid)
    return ForwardResult(output, saved, count, saved_input, valid)


def _converted(rows: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor | None:
    """``(C,)`` vectors as the rows of one tensor in ``dtype``, in one conversion: a copy
    of one, a stack of more; ``None`` for no rows."""
    if len(rows) == 1:
        return rows[0].to(dtype).unsqueeze(0)
    return torch.stack(rows).to(dtype) if rows else None


def _forward_on_fused_kernel(
    fused: ModuleType,
    buffer: torch.Tensor,
    input: torch.Tensor,
    moments: LocalMoments,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    num_batches_tracked: torch.Tensor | None,
    options: TrainOptions,
    update_dtype: torch.dtype,
    valid: torch.Tensor | None = None,
    triton_passes: bool = False,
) -> ForwardResult:
    """The rest of a deferred :func:`forward_train` from its packed ``buffer``, with
    :mod:`syncbn._kernels.finalize` (``fused``, a candidate): the collective, then one
    kernel for the checks and the per-channel maths that :func:`reduce_forward`,
    :func:`count_divisors`, :mod:`syncbn._stats` and :func:`output_offset` do otherwise,
    then the output pass: :mod:`syncbn._kernels.triton_passes`' (``triton_passes``: the
    local sums were theirs too), else one ``addcmul`` where the generic kernels make two
    passes, or for a masked call the generic kernels' pass, zero at padded positions.

    Args:
        update_dtype: as :func:`reduce_forward`'s: the running statistics' dtype.
        valid: a masked call's valid positions (see :attr:`ForwardResult.valid`).
        triton_passes: :func:`syncbn._kernels.takes_triton_passes` (the local sums in
            ``moments`` were those of :mod:`syncbn._kernels.triton_passes`).
    """
    buffer = options.reducer.all_reduce(buffer, "forward")
    counted = None  # a cumulative average: the kernel divides by the batch counter
    if options.momentum is not None or num_batches_tracked is None:
        factor = 0.0 if options.momentum is None else options.momentum
        counted = counted_update(factor, buffer.device, update_dtype)
    saved_input, centered_mean, shift = input, False, None
    if triton_passes:
        # backward reads the input itself, and the shift (saved[0] is then mean - shift)
        centered_mean, shift = True, moments.shift
    elif valid is not None:
        saved_input, centered_mean = backward_input(input, moments, valid)
    saved, offset, header = fused.finalize_forward(
        buffer,
        moments.shift,
        weight,
        bias,
        running_mean,
        running_var,
        num_batches_tracked,
        counted,
        (options.reducer.world_size, options.forward_fingerprint),
        options.eps,
        _stats.stat_dtype(input.dtype),
        update_buffers=not is_recomputing(),  # a checkpointed forward already moved them
        centered_mean=centered_mean,
    )
    check = options.header_check("forward", tuple(input.shape))
    _protocol.defer_check(buffer, check, header, options.reducer.dissolved_test())
    centered = moments.centered
    if shift is not None:
        output = fused.triton_passes.normalize(input, valid, shift, saved[2], offset)
    elif valid is None and centered is not None and input.dtype == saved.dtype:
        output = fused.normalize(centered, saved[2], offset)  # float32, float64 input
    else:  # masked, low precision (the generic kernels' batch_norm), or an empty batch
        kernels = kernels_for(input.device)
        output = kernels.normalize(input, moments, saved, offset, weight, bias, options.eps, valid)
    count = _protocol.count_slot(buffer)
    return ForwardResult(output, saved, count, saved_input, valid, shift)


def backward_input(
    input: torch.Tensor, moments: LocalMoments, valid: torch.Tensor
) -> tuple[torch.Tensor, bool]:
    """What a masked call's backward takes as its input, and whether it is the shifted copy
    (whose mean is the global mean minus the shift; else the input's mean).

    It is zero at padded positions, so that nothing the input holds there (NaN included)
    reaches a gradient: the local moments' shifted copy, which a masked
    :meth:`~syncbn._kernels.Kernels.normalize` leaves intact, or, where that copy is in
    another dtype than the input (low precision: float32, twice the input's size), a zeroed
    copy of the input.
    """
    centered = moments.centered
    if centered is not None and centered.dtype == input.dtype:
        return centered, True
    return kernels_for(input.device).zero_padded(input, valid), False


def backward_train(
    grad_output: torch.Tensor,
    input: torch.Tensor,
    saved: torch.Tensor,
    count: int | torch.Tensor,
    needs_grad: tuple[bool, bool, bool],
    options: TrainOptions,
    valid: torch.Tensor | None = None,
    create_graph: bool = False,
    shift: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Gradients of input, weight and bias (``None`` where ``needs_grad`` is false).

    The collective happens only when the input needs a gradient, which is the same on
    every rank. An exception before it joins it with the error flag, as in forward: so
    does a masked backward asked for a differentiable result (``create_graph``), which this
    one cannot give (:func:`double_backward_error`; an unmasked one is
    :func:`syncbn._double_backward.differentiable_backward`).
    A masked call (``valid``) zeroes the output gradient at padded positions first
    (whatever it holds there, it then adds nothing to the sums; ``input`` is the forward's
    :attr:`ForwardResult.backward_input`, already zero there); the kernels' input gradient
    is zero there too, and may be computed in that zeroed copy.

    Args:
        saved: :attr:`ForwardResult.saved`: its mean is that of ``input``.
        shift: :attr:`ForwardResult.shift`: a call whose forward took
            :mod:`syncbn._kernels.triton_passes`, and so does its backward (with
            :mod:`syncbn._kernels.finalize`, whatever is switched on since).
    """
    need_input, need_weight, need_bias = needs_grad
    mean, var = saved[0], saved[1]
    kernels = kernels_for(input.device)
    fused = None
    if need_input:  # before the collective, as in forward (see resolve_mode)
        if resolve_mode(options, saved.device) == "deferred":
            fused = fused_finalize_for(saved.device)  # a candidate, off by default
    passes = epsilon = None  # syncbn._kernels.triton_passes, where the forward took them
    if shift is not None:
        from syncbn._kernels import finalize  # (Triton: imported by the forward already)

        passes, epsilon = finalize.triton_passes, finalize.epsilon(options.eps, saved.device)
        fused = finalize if need_input else None
    with join_on_error(options, "backward", saved.device, enabled=need_input):
        if create_graph:
            raise double_backward_error()
        if shift is None and input.device.type != "cpu" and input.dtype != saved.dtype:
            # low precision off the CPU: the local sums and the input gradient both compute
            # on a float32 copy of the input (see the kernels' backward_reduce), made once
            # here rather than once by each (one pass less over the input); the backward's
            # largest allocation, so inside the block that tells the other ranks if it fails
            input = input.to(saved.dtype)
        if passes is not None and shift is not None:
            sum_dy, sum_dy_xhat = passes.backward_reduce(
                grad_output, input, valid, shift, saved, epsilon
            )
        else:
            if valid is not None:
                grad_output = kernels.zero_padded(grad_output, valid, like=input)
            sum_dy, sum_dy_xhat = kernels.backward_reduce(
                grad_output, input, mean, var, options.eps
            )
        if need_input:
            pack = _protocol.pack_backward if fused is None else fused.pack_backward
            buffer = pack(sum_dy, sum_dy_xhat, options.fingerprint)
    grad_input = None
    if need_input and fused is not None:
        # one kernel for the header values and the corrections (the generic code runs
        # three), or a masked call's slope and offset (seven)
        buffer = options.reducer.all_reduce(buffer, "backward")
        if passes is not None and shift is not None:
            (slope, offset), header = fused.finalize_backward(buffer, saved, options.eps)
            grad_input = passes.input_grad(
                grad_output, input, valid, shift, saved[2], slope, offset
            )
        elif valid is not None and in_place_masked(grad_output, input, saved):
            (slope, offset), header = fused.finalize_backward(buffer, saved, options.eps)
            grad_input = masked_input_grad(grad_output, input, saved[2], slope, offset, valid)
        else:
            corrections, header = fused.finalize_backward(buffer, saved)
            grad_input = corrected_input_grad(
                grad_output, input, saved, options.eps, corrections, valid
            )
        check = options.header_check("backward")
        _protocol.defer_check(buffer, check, header, options.reducer.dissolved_test())
    elif need_input:
        totals = synchronize_grads(buffer, options, saved.device)
        grad_input = kernels.input_grad(
            grad_output, input, saved, options.eps, totals, count, valid
        )
    return grad_input, sum_dy_xhat if need_weight else None, sum_dy if need_bias else None


def double_backward_error() -> RuntimeError:
    """The error of a masked backward run with ``create_graph=True``.

    Its gradients are computed once, with no graph, from a copy of the input that is zero
    at padded positions and has no autograd history: differentiating them again (a
    gradient penalty through the layer) would treat them as constants.
    ``once_differentiable`` raises only when the output gradient itself requires grad, and
    returns silently wrong second derivatives when it does not (a frozen head after the
    layer); this raises in both cases. An unmasked call differentiates twice
    (:mod:`syncbn._double_backward`).
    """
    return RuntimeError(
        "SyncBatchNorm: trying to differentiate twice: a masked call's backward is "
        "differentiable once, and backward was called with create_graph=True (double "
        "backward, as a gradient penalty through the layer needs, is supported for "
        "unmasked calls only)"
    )


class _SyncBatchNormFunction(torch.autograd.Function):
    """Batch normalization with statistics and input gradients reduced over a process group."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        input: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        running_mean: torch.Tensor | None,
        running_var: torch.Tensor | None,
        num_batches_tracked: torch.Tensor | None,
        options: TrainOptions,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        fake_mode = _protocol.idle_fake_mode(input)
        if fake_mode is not None:  # fake tensors outside their mode's block: run in it
            with fake_mode:
                arguments = (running_mean, running_var, num_batches_tracked, options, mask)
                return _SyncBatchNormFunction.forward(ctx, input, weight, bias, *arguments)
        result = forward_train(
            input, weight, bias, running_mean, running_var, num_batches_tracked, options, mask
        )
        # the weight too, for a backward with create_graph=True (its gradients depend on it)
        saved = (result.backward_input, result.saved, result.valid, result.shift, weight)
        ctx.save_for_backward(*saved)
        ctx.count = result.global_count
        ctx.options = options
        ctx.device = result.saved.device  # the collective's (a failed unpack joins it there)
        ctx.param_dtypes = (
            None if weight is None else weight.dtype,
            None if bias is None else bias.dtype,
        )
        return result.output

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad_output: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        fake_mode = _protocol.idle_fake_mode(grad_output)
        if fake_mode is not None:  # a fake forward's backward, run after its mode's block
            with fake_mode:
                return _SyncBatchNormFunction.backward(ctx, grad_output)
        # grad mode is on in backward exactly when it runs with create_graph=True
        create_graph = torch.is_grad_enabled()
        needs_grad = tuple(ctx.needs_input_grad[:3])
        options = ctx.options
        # until the call reaches its collective (where the input needs a gradient), an
        # exception joins it with the error flag: reading the saved tensors runs the
        # unpack hooks of torch.autograd.graph.saved_tensors_hooks (save_on_cpu's copy
        # back to the device, which can run out of memory), and autograd's check that no
        # saved tensor was modified in place
        local_part = join_on_error(options, "backward", ctx.device, enabled=needs_grad[0])
        with local_part:
            input, saved, valid, shift, weight = ctx.saved_tensors
        if create_graph and valid is None:  # a differentiable backward: a gradient penalty

            def summation(local: torch.Tensor, phase: str) -> torch.Tensor:
                # the collective reached: from here on its own checks and error flag
                # (sum_over_participants) tell the other ranks
                local_part.enabled = False
                return sum_over_participants(local, phase, options)

            with local_part:
                # with Triton's passes, the saved mean is that of the input minus the shift
                mean = saved[0] if shift is None else saved[0] + shift.to(saved.dtype)
                grad_input, grad_weight, grad_bias = differentiable_backward(
                    grad_output,
                    input,
                    weight,
                    mean,
                    saved[1],
                    ctx.count,
                    options.eps,
                    needs_grad,
                    summation,
                )
        else:
            with torch.no_grad():
                grad_input, grad_weight, grad_bias = backward_train(
                    grad_output,
                    input,
                    saved,
                    ctx.count,
                    needs_grad,
                    ctx.options,
                    valid,
                    create_graph,
                    shift,
                )
        weight_dtype, bias_dtype = ctx.param_dtypes
        return (
            grad_input,
            _cast(grad_weight, weight_dtype),
            _cast(grad_bias, bias_dtype),
            None,
            None,
            None,
            None,
            None,
        )


def _cast(tensor: torch.Tensor | None, dtype: torch.dtype | None) -> torch.Tensor | None:
    if tensor is None or dtype is None or tensor.dtype == dtype:
        return tensor
    return tensor.to(dtype)


def sync_batch_norm_train(
    input: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    options: TrainOptions,
    *,
    running_mean: torch.Tensor | None = None,
    running_var: torch.Tensor | None = None,
    num_batches_tracked: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Normalize ``input`` with the statistics of the global batch of ``options.reducer``.

    ``running_mean`` and ``running_var``, those given, move towards the global mean and
    unbiased variance by ``options.momentum`` in place, and ``num_batches_tracked`` counts
    the call, except in a forward recomputed by activation checkpointing. With a ``mask``,
    the statistics are those of the valid positions, and padded positions of the output
    and of the input gradient are zero.

    Returns:
        The normalized output (differentiable with respect to input, weight and bias).
    """
    # (a non-tensor input is refused in forward_train, after joining with the error flag)
    if not (getattr(input, "requires_grad", False) and torch.is_grad_enabled()):
        # no backward collective will follow: the forward's fingerprint tells the other
        # ranks (read here: inside the Function's forward, grad mode is off, and
        # ctx.needs_input_grad says requires_grad even under torch.no_grad())
        options = options._replace(input_grad=False)
    output: torch.Tensor = _SyncBatchNormFunction.apply(
        input, weight, bias, running_mean, running_var, num_batches_tracked, options, mask
    )
    return output
