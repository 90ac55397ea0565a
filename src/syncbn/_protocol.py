"""The packed buffer that one synchronized layer call all-reduces, and the checks it carries.

Nothing here knows about processes or ``torch.distributed``: the collective that sums
buffers lives in :mod:`syncbn.distributed`, the maths in :mod:`syncbn._stats` and
:mod:`syncbn._kernels`.

Layout
------
Forward: ``[error, f, f**2, n, sum(x) (C), sum(x**2) (C), f]``, ``2 * C + 5`` float64
values whatever the world size. Backward: ``[error, b, b**2, 0, sum(dy) (C),
sum(dy * xhat) (C), b]``, as many values, where ``b`` is the layer's backward fingerprint
(:func:`backward_fingerprint`). Both directions have one length and their own
fingerprints, so that a rank in a layer's forward whose collective meets another rank's
backward (a rank that skipped its backward, or took a branch the others did not) fails
the checks on every rank; with lengths that differed, gloo aborted the processes. A
compiled backward (:data:`COMPILED_BACKWARD`) sums other quantities in the same layout,
the gradients of the global moments, and has a fingerprint of its own too: a rank whose
call ran eagerly (dynamo fell back on one rank only) meeting a compiled one fails the
checks instead of summing unlike numbers.

``error`` is 1 on a rank that failed before the collective (invalid input, or an
exception in its local computation): it joins the collective only so that no other rank
is left waiting. ``f`` is the layer's fingerprint: if all ranks reached the same layer,
the sums equal ``world_size * f`` and ``world_size * f**2`` for each rank's own ``f``,
and if any two ranks differ, the sums differ on every rank (equal mean and mean square
imply zero spread). A fingerprint is an integer under ``2**18`` (a layer's at most
``2**16``, of its identity, channel count, ``eps`` and ``momentum``; the backward ones
offset from it, and so is a forward's whose input needs no gradient, which joins no
backward collective: ranks that disagree on it fail the forward's check, where the others
would have waited in backward), so all sums are exact. The trailer catches
ranks whose buffers differ in length (different channel counts): a backend that reduces
only the shorter length leaves the longer buffer's last slot without the other ranks'
share. ``n`` is the rank's count per channel; its sum, the global count, stays on the
buffer's device.

When the checks run
-------------------
The header of the all-reduced buffer is read back to the host and checked either at once
(``"immediate"``: the default on CPU, where the read is free) or later
(``"deferred"``: the default on accelerators, where a read waits for the device). A
deferred check copies the header numbers (forward two rows of six, backward four) to
pinned host memory without waiting and inspects them at the start of a later synchronized
call, once the device has written them; it then raises naming the layer, the call and the direction
where it went wrong. Until then, the call that went wrong computed with the sums it
received, but it never moves running statistics: their update is masked on the device by
the same checks.
"""

from __future__ import annotations

import collections
import functools
import threading
import zlib
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol, TypeVar

import torch
from torch._subclasses import fake_tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

__all__ = [
    "CHECK_MODES",
    "COMPILED_BACKWARD",
    "COUNT_SLOT",
    "ConstantCache",
    "FORWARD_HEADER_VALUES",
    "Header",
    "HeaderCheck",
    "SUMS_SLOT",
    "backward_fingerprint",
    "backward_size",
    "backward_totals",
    "check_now",
    "constant_cache",
    "count_slot",
    "defer_check",
    "device_flags",
    "discard_pending",
    "faking",
    "fingerprint",
    "forward_moments",
    "forward_fingerprint",
    "forward_size",
    "forward_sums",
    "forward_totals",
    "header_values",
    "idle_fake_mode",
    "is_fake",
    "on_device",
    "pack_backward",
    "pack_backward_sums",
    "pack_forward",
    "pack_forward_moments",
    "raise_deferred",
    "read_header",
    "real_tensors",
    "recording",
    "refuse_during_capture",
    "register_layer",
    "resolve_check_mode",
]

_HEADER_SIZE = 3  # error, fingerprint, fingerprint**2
_COUNT_SLOT = _HEADER_SIZE  # forward buffers; 0 in backward buffers
#: the slot of a forward buffer's count, for kernels that read a buffer themselves
COUNT_SLOT = _COUNT_SLOT
#: the slot of the first sum, in both directions
SUMS_SLOT = _COUNT_SLOT + 1
#: what a backward fingerprint adds to the layer's (forward) fingerprint; a compiled
#: backward's adds twice as much
_BACKWARD_OFFSET = 1 << 16
#: what the forward fingerprint of a call whose input needs no gradient adds to the
#: layer's: such a call joins no backward collective, so ranks that disagree on it would
#: leave the others waiting in backward; they fail the forward's check instead
_NO_GRAD_OFFSET = 3 << 16
#: the phase of a compiled step's backward collective (``syncbn::sync_moments_backward``)
COMPILED_BACKWARD = "backward (compiled)"
#: how many numbers :func:`header_values` takes from a forward buffer (two rows of six)
FORWARD_HEADER_VALUES = 12
PACK_DTYPE = torch.float64

#: How a call checks its all-reduced header: ``"auto"`` is immediate on CPU, deferred elsewhere.
CHECK_MODES = ("auto", "immediate", "deferred")


def forward_size(num_features: int) -> int:
    """Length of a forward buffer: header, count, two sums per channel, trailer."""
    return _HEADER_SIZE + 1 + 2 * num_features + 1


def backward_size(num_features: int) -> int:
    """Length of a backward buffer: header, a zero, two sums per channel, trailer; a
    forward buffer's (see the module's docstring)."""
    return forward_size(num_features)


def backward_fingerprint(fingerprint: int, phase: str = "backward") -> int:
    """The fingerprint that a layer's backward buffers carry: its forward fingerprint plus
    ``2**16``, or ``2**17`` in a :data:`COMPILED_BACKWARD` (0, the order check off, stays
    0), so that no two of the three match. Under ``2**18``: the sums of the fingerprints'
    squares stay exact for up to ``2**17`` ranks."""
    if not fingerprint:
        return 0
    offset = 2 * _BACKWARD_OFFSET if phase == COMPILED_BACKWARD else _BACKWARD_OFFSET
    return fingerprint + offset


#: the layers of this process, ``'name' (num_features=C)``, by their fingerprints, to name
#: the layer that other ranks are at when the fingerprints of a collective disagree: the
#: ``_MAX_DESCRIBED`` registered last (a process that builds layers without end, a
#: hyper-parameter search, keeps no more: each ``"#k"`` layer built added its own for good)
_described: collections.OrderedDict[str, int] = collections.OrderedDict()
_MAX_DESCRIBED = 4096
_described_lock = threading.Lock()
#: the directions a backward fingerprint names, as :func:`_layers_with_fingerprint` says them
_BACKWARD_PHASES = (("backward", "in backward"), (COMPILED_BACKWARD, "in a compiled backward"))


def _active_mode(key: str, mode_class: Callable[[], type]) -> Callable[[], Any]:
    """A function returning the active dispatch mode that torch keeps under
    ``_TorchDispatchModeKey.<key>`` (one C call), or ``None``; on a torch that keeps no such
    key, one that searches the mode stack for a ``mode_class()``."""
    torch_key = getattr(getattr(torch._C, "_TorchDispatchModeKey", None), key, None)
    if torch_key is not None:
        return functools.partial(torch._C._get_dispatch_mode, torch_key)

    def in_stack() -> Any:
        cls = mode_class()
        for mode in _get_current_dispatch_mode_stack():
            if isinstance(mode, cls):
                return mode
        return None

    return in_stack


def _proxy_mode_class() -> type:
    from torch.fx.experimental import proxy_tensor  # (imported where it is asked for)

    return proxy_tensor.ProxyTorchDispatchMode


#: the active ``FakeTensorMode``, or ``None``
_active_fake_mode = _active_mode("FAKE", lambda: fake_tensor.FakeTensorMode)
#: the active ``ProxyTorchDispatchMode`` (``make_fx``), or ``None``
_active_proxy_mode = _active_mode("PROXY", _proxy_mode_class)


def recording() -> bool:
    """Whether ``make_fx`` records the ops of this call into a graph (a
    ``ProxyTorchDispatchMode`` is active, over fake or real tensors). A value read back to
    the host now would be a constant of the graph at every replay (the global count of the
    traced batch, say), so such a call reads nothing back: its checks are deferred."""
    return _active_proxy_mode() is not None


def faking() -> bool:
    """Whether a ``FakeTensorMode`` is active: the tensors of this call have shapes and no
    values (memory and runtime estimators run models so, as dynamo traces them).

    Such a call reads nothing back (its checks are deferred, and never recorded), keeps no
    constant (:func:`constant_cache`) and leaves the real calls' deferred checks queued.
    """
    return _active_fake_mode() is not None


def idle_fake_mode(tensor: Any) -> Any:
    """The ``FakeTensorMode`` of a fake ``tensor`` used where no fake mode is active (the
    backward of a forward that ran inside a ``with FakeTensorMode():`` block, run after
    it): a call entering it is then :func:`faking`, as torch's ops are, each of which a fake
    tensor runs in its mode. ``None`` otherwise (a real tensor, or a mode active already)."""
    return tensor.fake_mode if is_fake(tensor) and not faking() else None


def is_fake(tensor: Any) -> bool:
    """Whether ``tensor`` is a ``FakeTensor`` (shapes, no values)."""
    return type(tensor) is not torch.Tensor and isinstance(tensor, fake_tensor.FakeTensor)


def real_tensors() -> Any:
    """A context in which tensors are real although a ``FakeTensorMode`` is active: for a
    real layer's own state built inside the mode (a real model converted there)."""
    unset = getattr(fake_tensor, "unset_fake_temporarily", None)
    if unset is not None:
        return unset()
    return torch.utils._python_dispatch._disable_current_modes()  # torch < 2.2


_Built = TypeVar("_Built", covariant=True)


class ConstantCache(Protocol[_Built]):
    """A function decorated by :func:`constant_cache`."""

    def __call__(self, *args: Any) -> _Built: ...

    def cache_info(self) -> Any:
        """The real calls' cache statistics (``functools.lru_cache``'s)."""


def constant_cache(maxsize: int) -> Callable[[Callable[..., _Built]], ConstantCache[_Built]]:
    """``functools.lru_cache(maxsize)`` for a function that builds syncbn's constants with
    :func:`on_device`, bypassed while :func:`faking`.

    A constant built under ``FakeTensorMode`` is a fake tensor: cached, every later real
    call would read it (and fail), and a real cached constant is an input that a fake mode
    refuses. A fake call builds its own, kept by no one. The check costs ~0.1 µs a lookup
    (a deferred layer call makes ten).
    """

    def decorate(build: Callable[..., _Built]) -> ConstantCache[_Built]:
        cached = functools.lru_cache(maxsize)(build)

        @functools.wraps(build)
        def lookup(*args: Any) -> _Built:
            if _active_fake_mode() is not None:
                return build(*args)
            return cached(*args)

        lookup.cache_info = cached.cache_info  # type: ignore[attr-defined]
        return lookup  # type: ignore[return-value]

    return decorate


@functools.lru_cache(maxsize=4096)
def fingerprint(
    layer_name: str, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1
) -> int:
    """A layer's fingerprint: an integer in ``[1, 2**16]``, the same on every rank.

    It covers the layer's ``eps`` and ``momentum`` too: ranks whose layers differ there
    would each normalize with their own ``eps`` (outputs that are not the global batch's)
    or move their running statistics apart, with no error (a review, 2026-12-07).
    """
    key = f"{layer_name}|{num_features}|{eps!r}|{momentum!r}"
    value = zlib.crc32(key.encode()) % _BACKWARD_OFFSET + 1
    _describe(layer_name, num_features, value)
    return value


def forward_fingerprint(fingerprint: int, input_grad: bool) -> int:
    """What a forward buffer carries: the layer's fingerprint, plus ``3 * 2**16`` where the
    call's input needs no gradient (0, the order check off, stays 0). Under ``2**18``, as
    the backward fingerprints."""
    return fingerprint if input_grad or not fingerprint else fingerprint + _NO_GRAD_OFFSET


def _needs_no_grad(value: int) -> bool:
    """Whether a buffer's fingerprint ``value`` is the forward fingerprint of a call whose
    input needs no gradient (:func:`forward_fingerprint`)."""
    return value > _NO_GRAD_OFFSET


def register_layer(
    layer_name: str, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1
) -> None:
    """Make a layer of this process known by its fingerprint, for the mismatch errors of
    other layers (a layer is registered when built or renamed, before its first call)."""
    _describe(layer_name, num_features, fingerprint(layer_name, num_features, eps, momentum))


def _describe(layer_name: str, num_features: int, value: int) -> None:
    name = repr(layer_name) if layer_name else "<unnamed>"
    description = f"{name} (num_features={num_features})"
    with _described_lock:
        _described[description] = value
        _described.move_to_end(description)
        while len(_described) > _MAX_DESCRIBED:
            _described.popitem(last=False)


def _layers_with_fingerprint(value: int) -> list[str]:
    """The registered layers whose forward or backward buffers carry ``value``, described."""
    with _described_lock:
        described = list(_described.items())
    names = set()
    for description, forward in described:
        if forward == value:
            names.add(description)
        if forward_fingerprint(forward, input_grad=False) == value:
            names.add(f"{description} with an input that needs no gradient")
        for phase, where in _BACKWARD_PHASES:
            if backward_fingerprint(forward, phase) == value:
                names.add(f"{description} {where}")
    return sorted(names)


def _others_layer(header: Header, world_size: int, own: int, forward: bool) -> str:
    """Where the other ranks are, when they all agree and this process knows that layer
    (``forward``: whether this rank is in a forward; a backward rank names a forward)."""
    others = world_size - 1
    rest, square_rest = header.fingerprint_sum - own, header.fingerprint_square_sum - own * own
    if others >= 1 and rest == square_rest == 0:
        return "a layer whose check_layer_order is False (no fingerprint)"
    unknown = "a different layer (or this layer with another eps or momentum)"
    if others < 1 or rest % others or square_rest != others * (rest / others) ** 2:
        return unknown
    value = int(rest / others)
    names = _layers_with_fingerprint(value)
    if not names:
        return unknown
    in_forward = value <= _BACKWARD_OFFSET or _needs_no_grad(value)
    where = " in forward" if not forward and in_forward else ""
    return f"SyncBatchNorm layer {' or '.join(names)}{where}"


def _ranks_needing_grad(header: Header, world_size: int, own: int) -> int | None:
    """Where the fingerprints of a forward differ only in whether each rank's input needs a
    gradient (:func:`forward_fingerprint`): how many ranks' inputs do; else ``None``."""
    layer = own - _NO_GRAD_OFFSET if _needs_no_grad(own) else own
    without = layer + _NO_GRAD_OFFSET
    excess = header.fingerprint_sum - world_size * layer
    if excess % _NO_GRAD_OFFSET:
        return None
    no_grad = int(excess // _NO_GRAD_OFFSET)  # the ranks whose input needs no gradient
    needing = world_size - no_grad
    squares = needing * layer * layer + no_grad * without * without
    if not 0 < no_grad < world_size or header.fingerprint_square_sum != squares:
        return None
    return needing


@constant_cache(maxsize=1024)
def _buffer_ends(
    fingerprint: int, count: int | None, error: bool, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The head and trailer of a buffer: ``count`` is the forward count slot's value (0 in
    a backward buffer), or ``None`` where the caller concatenates it (a count on the device).

    They depend only on the layer and the local count, which usually repeat from step
    to step, so they are built once per combination; ``torch.cat`` never writes to them.
    On an accelerator they are copied from pinned memory without waiting for the device.
    """
    f = float(fingerprint)
    head = [float(error), f, f * f] + ([] if count is None else [float(count)])
    ends = on_device(head + [f], PACK_DTYPE, device)
    return ends[:-1], ends[-1:]


def pack_forward(
    count: int | torch.Tensor,
    total: torch.Tensor,
    square_total: torch.Tensor,
    fingerprint: int,
    error: bool = False,
) -> torch.Tensor:
    """Pack one rank's forward contribution into a float64 buffer of ``forward_size(C)``.

    The sums per channel equal ``n * mean`` and ``n * (var + mean**2)``. The count ``n``
    is a number, or a 0-dim tensor on the device (a masked batch counts its valid
    positions there, without a host read).

    On the CPU a number goes into the buffer's cached head (one per layer and count); on an
    accelerator it is filled into a tensor of its own on the device (one more small
    kernel), so that a new count costs no cached constant: each was a copy through pinned
    memory and a wait on the host, at every call where batches vary in size (detection's
    image sizes, say), and a stream of new counts crowded the layers' heads out of the cache.
    """
    if not isinstance(count, torch.Tensor) and total.device.type != "cpu":
        count = torch.full((), count, dtype=PACK_DTYPE, device=total.device)
    if isinstance(count, torch.Tensor):
        head, trailer = _buffer_ends(fingerprint, None, error, total.device)
        return torch.cat([head, count.to(PACK_DTYPE).view(1), total, square_total, trailer])
    head, trailer = _buffer_ends(fingerprint, count, error, total.device)
    return torch.cat([head, total, square_total, trailer])


def pack_forward_moments(
    moments: torch.Tensor, fingerprint: int, error: bool = False
) -> torch.Tensor:
    """Pack ``(2 * C + 1,)`` float64 moments ``[n, sum(x) (C), sum(x**2) (C)]`` into a forward
    buffer: the layout of :func:`pack_forward`, whose middle they are."""
    head, trailer = _buffer_ends(fingerprint, None, error, moments.device)
    return torch.cat([head, moments, trailer])


def pack_backward(
    sum_dy: torch.Tensor,
    sum_dy_xhat: torch.Tensor,
    fingerprint: int,
    error: bool = False,
    phase: str = "backward",
) -> torch.Tensor:
    """Pack one rank's backward sums into a float64 buffer of ``backward_size(C)``, with
    the :func:`backward_fingerprint` of the layer's ``fingerprint`` for ``phase``.

    The sums may be float32; ``torch.cat`` promotes them to the buffer's float64 (in one
    kernel on the CPU; CUDA's copies each input on its own when their dtypes differ).
    """
    head, trailer = _buffer_ends(backward_fingerprint(fingerprint, phase), 0, error, sum_dy.device)
    return torch.cat([head, sum_dy, sum_dy_xhat, trailer])


def pack_backward_sums(
    sums: torch.Tensor, fingerprint: int, phase: str = "backward"
) -> torch.Tensor:
    """Pack ``(2 * C,)`` float64 sums into a backward buffer (the layout of
    :func:`pack_backward`, whose middle they are): ``[sum(dy) (C), sum(dy * xhat) (C)]``, or
    in a :data:`COMPILED_BACKWARD` the gradients of ``[sum(x) (C), sum(x**2) (C)]``."""
    head, trailer = _buffer_ends(backward_fingerprint(fingerprint, phase), 0, False, sums.device)
    return torch.cat([head, sums, trailer])


def count_slot(buffer: torch.Tensor) -> torch.Tensor:
    """The global count per channel of an all-reduced forward buffer: a 0-dim float64 view."""
    return buffer[_COUNT_SLOT]


def forward_moments(buffer: torch.Tensor) -> torch.Tensor:
    """A copy of the ``[n, sum(x) (C), sum(x**2) (C)]`` middle of a forward buffer (one
    op: ``narrow_copy``, where a view and its ``clone`` are two)."""
    return buffer.narrow_copy(0, _COUNT_SLOT, buffer.numel() - _COUNT_SLOT - 1)


def forward_totals(buffer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A forward buffer's ``sum(x)`` and ``sum(x**2)``: two ``(C,)`` views, in one op."""
    num_channels = (buffer.numel() - _COUNT_SLOT - 2) // 2
    sizes = [_COUNT_SLOT + 1, num_channels, num_channels, 1]
    _, total, square_total, _ = buffer.split_with_sizes(sizes)
    return total, square_total


def forward_sums(buffer: torch.Tensor) -> torch.Tensor:
    """``(2, C)`` view of a forward buffer's sums: ``sum(x)`` and ``sum(x**2)``."""
    num_channels = (buffer.numel() - _COUNT_SLOT - 2) // 2
    return buffer.as_strided(
        (2, num_channels), (num_channels, 1), buffer.storage_offset() + _COUNT_SLOT + 1
    )


def backward_totals(buffer: torch.Tensor) -> torch.Tensor:
    """Global ``sum(dy)`` and ``sum(dy * xhat)`` from a backward buffer, as rows of ``(2, C)``."""
    num_channels = (buffer.numel() - SUMS_SLOT - 1) // 2
    return buffer.as_strided(
        (2, num_channels), (num_channels, 1), buffer.storage_offset() + SUMS_SLOT
    )


class Header(NamedTuple):
    """Header, trailer and count slots of an all-reduced buffer, read back on the host."""

    errors: int
    fingerprint_sum: float
    fingerprint_square_sum: float
    trailer_sum: float
    global_count: int  # forward buffers only: the global count per channel


def _is_capturing(device: torch.device) -> bool:
    """Whether ``device``'s current stream is capturing a CUDA graph (``device`` need not be
    the current device: a model on ``cuda:1`` without ``torch.cuda.set_device(1)``)."""
    if device.type != "cuda":
        return False
    if device.index is not None and device.index != torch.cuda.current_device():
        with torch.cuda.device(device):
            return torch.cuda.is_current_stream_capturing()
    return torch.cuda.is_current_stream_capturing()


def refuse_during_capture(device: torch.device) -> None:
    """Raise if a CUDA graph is being captured on ``device``: called where syncbn builds a
    constant tensor that it then caches for later calls.

    Built inside a capture, the constant would be filled only when the graph replays (and
    a copy would read a freed pinned buffer then), while eager calls read it at once.

    Raises:
        RuntimeError: asking for a warm-up step before the capture.
    """
    if _is_capturing(device):
        raise RuntimeError(
            f"SyncBatchNorm needs a small constant tensor on {device} that it builds at the "
            "first call with a new local batch size, layer, dtype or momentum and then "
            "caches, but a CUDA graph is being captured; run the same training step once "
            "before capturing it (a warm-up, as CUDA graph capture requires)"
        )


def on_device(values: list[Any], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small constant tensor on ``device``, for syncbn's caches of constants.

    Never during a CUDA graph capture (:func:`refuse_during_capture`). On CUDA it is built
    by :func:`_outside_graph_pools`: ready when this returns, and never in the memory pool
    of a CUDA graph being warmed up (``torch.compile(mode="reduce-overhead")``). Elsewhere
    a blocking copy, once per constant, which every device type has (pinned host memory
    needs an accelerator that provides it: on a machine without one, ``pin_memory()``
    raised for a layer on the meta device).
    """
    refuse_during_capture(device)
    tensor = torch.tensor(values, dtype=dtype)
    if device.type == "cpu":
        return tensor
    if device.type == "cuda":
        return _outside_graph_pools(tensor, device)
    return tensor.to(device)


def _outside_graph_pools(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` copied to the CUDA ``device`` by a short-lived thread, which waits for the
    copy.

    CUDA graph trees (``torch.compile(mode="reduce-overhead")``) run a graph's first calls
    eagerly with the calling thread's allocations routed to the graphs' private memory
    pool, and then raise on any block of that pool that is still alive and not an output
    ("Detected 1 tensor(s) in the cudagraph pool not tracked as outputs"); a replay
    could overwrite it. A cached constant outlives the call, so it is allocated from
    another thread (whose allocations are never routed: torch 2.8 routes the calling
    thread's, torch 2.3 the calling stream's, and the thread copies on a stream of its
    own). Not yet run on a GPU (the failure above is from the first GPU run). The thread
    waits for its copy on the host, once per constant, so that every stream may read the
    constant at once. The copy goes to a side stream from torch's pool, not behind the
    current stream's work; the pool's streams are shared (a process group's may be one),
    so it may still wait for other side work in flight.
    """
    index = device.index if device.index is not None else torch.cuda.current_device()
    copied: list[torch.Tensor] = []
    failed: list[BaseException] = []

    def copy() -> None:
        try:
            with torch.cuda.device(index):
                stream = torch.cuda.Stream()
                with torch.cuda.stream(stream):
                    copied.append(host.pin_memory().to(f"cuda:{index}", non_blocking=True))
                done = stream.record_event()
            done.synchronize()
        except BaseException as error:  # raised again in the calling thread
            failed.append(error)

    thread = threading.Thread(target=copy, name="syncbn-constant")
    thread.start()
    thread.join()
    if failed:
        raise failed[0]
    return copied[0]


@constant_cache(maxsize=256)
def _header_slots(length: int, forward: bool, device: torch.device) -> torch.Tensor:
    """Error, fingerprint sums, trailer; for a forward buffer then the count, and the same
    again with the count twice: two rows of six, which :func:`device_flags` compares."""
    slots = [0, 1, 2, length - 1]
    if not forward:
        return on_device(slots, torch.int64, device)
    # the first row's last slot repeats the error flag: both rows have six
    rows = slots + [_COUNT_SLOT, 0] + slots + [_COUNT_SLOT, _COUNT_SLOT]
    return on_device(rows, torch.int64, device)


@constant_cache(maxsize=1024)
def _expected_header(world_size: int, fingerprint: int, device: torch.device) -> torch.Tensor:
    """A passing forward header (:func:`_header_slots`): no error, every rank's
    fingerprint; then the counts that the count slots must *not* hold: 1 (an error), and
    in the second row also 0 (nothing to update)."""
    f = float(fingerprint)
    fingerprints = [world_size * f, world_size * f * f, world_size * f]
    rows = [0.0, *fingerprints, 1.0, 0.0] + [0.0, *fingerprints, 1.0, 0.0]
    return on_device(rows, PACK_DTYPE, device)


@constant_cache(maxsize=256)
def _passing_comparison(device: torch.device) -> torch.Tensor:
    """Which slots of a passing forward header equal :func:`_expected_header`'s."""
    rows = [True, True, True, True, False, True] + [True, True, True, True, False, False]
    return on_device(rows, torch.bool, device)


def header_values(buffer: torch.Tensor, forward: bool = True) -> torch.Tensor:
    """An all-reduced buffer's header, trailer and count slot, on its device (no read)."""
    return buffer.index_select(0, _header_slots(buffer.numel(), forward, buffer.device))


def _to_header(values: list[float]) -> Header:
    count = int(values[4]) if len(values) > 4 else 0
    return Header(int(values[0]), values[1], values[2], values[3], count)


def read_header(buffer: torch.Tensor, forward: bool = True) -> Header:
    """Copy an all-reduced buffer's header, trailer and count slot to the host (one read)."""
    return _to_header(header_values(buffer, forward).tolist())


def device_flags(values: torch.Tensor, world_size: int, own_fingerprint: int) -> torch.Tensor:
    """Two bool flags on the buffer's device, from a forward buffer's
    :func:`header_values`, without reading anything back.

    ``[0]``: the checks pass (no error flag, the same layer on every rank, a global count
    other than 1); the call counts a batch. ``[1]``: they pass and the global batch is not
    empty; the running statistics move. Used where the checks are deferred.
    """
    expected = _expected_header(world_size, own_fingerprint, values.device)
    passing = torch.eq(values, expected).eq(_passing_comparison(values.device))
    # one row per flag, reduced at once (three kernels: on a GPU each costs a launch on the
    # host, per layer call)
    return passing.view(2, -1).all(dim=1)


class LayerCall(Protocol):
    """The layer call a check belongs to, described only when a check fails."""

    def describe(self) -> str: ...


class HeaderCheck(NamedTuple):
    """What to compare an all-reduced header with, and how to describe the call in errors.

    A named tuple: one is built per synchronized call, on the hot path.

    Attributes:
        world_size: number of participants in the collective.
        participants: what they are called (``"ranks"``, ``"replicas"``).
        fingerprint: this rank's fingerprint of the layer (0 when the order check is off);
            a backward phase compares its :func:`backward_fingerprint`.
        check_fingerprint: compare the fingerprints (the layer-order check).
        layer: the layer call, e.g. described ``SyncBatchNorm layer 'bn1' (...)``.
        phase: ``"forward"``, ``"backward"``, :data:`COMPILED_BACKWARD`, or a double
            backward's phase.
        same_calls_rule: the rule a mismatch breaks, quoted in its error.
        input_size: the local input's size, for the "more than 1 value" error.
    """

    world_size: int
    participants: str
    fingerprint: int
    check_fingerprint: bool
    layer: LayerCall
    phase: str
    same_calls_rule: str
    input_size: tuple[int, ...] | None = None

    def problem(self, header: Header) -> Exception | None:
        """The error this header shows, or ``None``."""
        one = self.participants[:-1]  # "rank", "replica"
        if header.errors:
            return RuntimeError(
                f"{header.errors} other {one}(s) failed in their SyncBatchNorm call in "
                f"{self.phase} (invalid input or an error in the local computation) while this "
                f"{one} was at {self.layer.describe()}; see the error raised on that {one}"
            )
        own = self.fingerprint
        if self.phase != "forward":  # a backward buffer (a double backward's too)
            own = backward_fingerprint(own, self.phase)
        if not self.check_fingerprint and header.fingerprint_sum:
            # this rank sends no fingerprint, others do: the others raise the mismatch,
            # and this rank would go on alone to wait in its next collective
            return RuntimeError(
                f"SyncBatchNorm layer check differs between ranks in {self.phase}: this rank "
                f"is at {self.layer.describe()} with check_layer_order = False, but other "
                "ranks of the process group check the layer order; set check_layer_order "
                "alike on every rank"
            )
        if self.check_fingerprint and (
            header.fingerprint_sum != self.world_size * own
            or header.fingerprint_square_sum != self.world_size * own * own
            or header.trailer_sum != self.world_size * own
        ):
            needing = None
            if self.phase == "forward":
                needing = _ranks_needing_grad(header, self.world_size, own)
            if needing is not None:
                here = "does not need one" if _needs_no_grad(own) else "needs one"
                return RuntimeError(
                    f"SyncBatchNorm inputs disagree on requires_grad in forward: at "
                    f"{self.layer.describe()} the input of {needing} of {self.world_size} "
                    f"{self.participants} needs a gradient, and this {one}'s {here}. A "
                    "backward synchronizes only where the input needs a gradient, so the "
                    f"{self.participants} whose input does would wait in backward for the "
                    "others; give the input the same requires_grad on every "
                    f"{one} (an empty batch made with torch.empty or torch.zeros needs none: "
                    "call requires_grad_() on it, or make it from the model's activations)"
                )
            others = _others_layer(header, self.world_size, own, self.phase == "forward")
            return RuntimeError(
                f"SyncBatchNorm layer mismatch in {self.phase}: this rank is at "
                f"{self.layer.describe()}, "
                f"but other ranks of the process group are at {others} in the same "
                f"collective; {self.same_calls_rule}. To disable this check set "
                "`check_layer_order = False` on the layers (or pass check_layer_order=False to "
                "convert_sync_batchnorm)."
            )
        if self.phase == "forward" and header.global_count == 1:
            size = None if self.input_size is None else list(self.input_size)
            if self.world_size == 1:  # a process alone (a masked call, or the path forced)
                got = "1 value per channel" + ("" if size is None else f" (input size {size})")
            else:
                here = "" if size is None else f"input size {size} here and "
                got = f"{here}1 value per channel across all {self.world_size} {self.participants}"
            return ValueError(f"Expected more than 1 value per channel when training, got {got}")
        return None


def check_now(buffer: torch.Tensor, check: HeaderCheck) -> Header:
    """Read the header now and raise its problem, if any; return it otherwise."""
    header = read_header(buffer, forward=check.phase == "forward")
    problem = check.problem(header)
    if problem is not None:
        raise problem
    return header


class _PendingCheck(NamedTuple):
    values: torch.Tensor  # host copy of the header, being written
    ready: torch.cuda.Event | None  # recorded after the copy (None: ready at once)
    check: HeaderCheck
    #: whether the participants have dissolved since (a destroyed process group): the
    #: check is then dropped unread; ``None``: they cannot (replicas, a process alone)
    dissolved: Callable[[], bool] | None = None


_pending: collections.deque[_PendingCheck] = collections.deque()
#: held while :func:`raise_deferred` scans :data:`_pending`, while :func:`discard_pending`
#: rewrites it, and for each append: the replicas of :mod:`syncbn.data_parallel` call their
#: layers from one thread per device, and a scan between another's peek and pop would check
#: an entry twice and pop one unchecked (or pop from an empty queue; an event query lets
#: other threads run in between); an append between a rewrite's clear and extend would
#: land before older checks
_pending_lock = threading.Lock()


def defer_check(
    buffer: torch.Tensor,
    check: HeaderCheck,
    values: torch.Tensor | None = None,
    dissolved: Callable[[], bool] | None = None,
) -> None:
    """Start copying the header to the host without waiting; :func:`raise_deferred` checks it.

    Inside a CUDA graph capture nothing is recorded: the host is not there at replay; nor
    for a buffer on the meta device or under ``FakeTensorMode`` (:func:`faking`), which
    holds no values (shape inference).

    Args:
        values: the buffer's :func:`header_values`, if the caller has them already.
        dissolved: a test of whether the collective's participants have dissolved since
            (a destroyed process group), if they can: the check is then dropped unread,
            and never raises in the call of participants that met later.
    """
    if buffer.device.type == "meta" or faking() or _is_capturing(buffer.device):
        return
    if values is None:
        values = header_values(buffer, forward=check.phase == "forward")
    ready = None
    if buffer.device.type == "cuda":
        host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
        host.copy_(values, non_blocking=True)
        ready = torch.cuda.Event()
        # on the stream the copy went to: that of the buffer's device, which need not be
        # the current device (a bare record() would mark the current device's stream)
        ready.record(torch.cuda.current_stream(buffer.device))
        values = host
    with _pending_lock:  # not between discard_pending's clear and extend
        _pending.append(_PendingCheck(values, ready, check, dissolved))


def discard_pending(participants: str) -> None:
    """Forget the deferred checks of collectives among ``participants`` (``"replicas"``).

    For a step that failed and whose error has been raised: the headers its collectives
    deferred (error flags included) describe that failure, and raising them again at the
    next step would fail that step too, and the next.
    """
    with _pending_lock:
        kept = [pending for pending in _pending if pending.check.participants != participants]
        _pending.clear()
        _pending.extend(kept)


def raise_deferred(wait: bool = False, device: torch.device | None = None) -> None:
    """Raise the first problem among the deferred checks whose header has arrived.

    Checks are inspected in call order; one whose copy has not finished stops the scan
    (unless ``wait``, which waits for it). Inspected checks are forgotten, and so are,
    unread, those of a process group destroyed since. Under ``FakeTensorMode``
    (:func:`faking`) nothing is read: the pending checks, of real calls, wait for a real one.

    Args:
        device: the calling layer's device, whose stream may be capturing a CUDA graph
            while the current device's is not.
    """
    capturing = torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()
    if capturing or (device is not None and _is_capturing(device)):
        return  # querying an event would invalidate the capture; checked after it
    if faking():
        return
    with _pending_lock:
        problem = _first_arrived_problem(wait)
    if problem is not None:
        raise type(problem)(f"(deferred check) {problem}") from None


def _first_arrived_problem(wait: bool) -> Exception | None:
    """:func:`raise_deferred`'s scan (under :data:`_pending_lock`): the first problem among
    the checks whose header has arrived, if any; inspected checks are forgotten."""
    while _pending:
        values, ready, check, dissolved = _pending[0]
        if dissolved is not None and dissolved():
            _pending.popleft()  # its participants are gone, and so is its failure
            continue
        if ready is not None:
            if wait:
                ready.synchronize()
            elif not ready.query():
                return None
        _pending.popleft()
        problem = check.problem(_to_header(values.tolist()))
        if problem is not None:
            _pending.clear()  # later calls computed with the same broken collectives
            return problem
    return None


def resolve_check_mode(mode: str, device: torch.device) -> str:
    """``"immediate"`` or ``"deferred"`` for a layer's ``check_mode`` on ``device``."""
    if mode not in CHECK_MODES:
        raise ValueError(f"check_mode must be one of {CHECK_MODES}, got {mode!r}")
    if mode == "deferred" or (mode == "auto" and device.type != "cpu"):
        return "deferred"
    if device.type == "meta" or faking() or recording():  # no value to read back now
        return "deferred"
    return "immediate"
