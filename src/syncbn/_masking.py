"""``syncbn.masking``: a mask of valid positions for the layers called inside a ``with`` block.

A model whose BatchNorm layers sit in an ``nn.Sequential``, or behind a ``forward`` that
takes no mask (torchaudio's and most Conformer convolution modules), cannot pass
``layer(input, mask)`` to them. Inside ``with syncbn.masking(mask):`` every syncbn layer
called *without* a mask takes this one, exactly as if it had been passed.

The block's mask is thread-local, like ``torch.autocast``'s state: it reaches the layers
that the entering thread calls. A layer called in another thread while a block is open
somewhere (``torch.nn.DataParallel`` runs its replicas in threads) raises rather than
run unmasked; :class:`syncbn.data_parallel.DataParallelWithCallback` (and a DataParallel
patched by :func:`syncbn.data_parallel.patch_replication_callback`) opens a block in each
replica's thread with that replica's share of the mask (:func:`replica_blocks`). A forward
that activation checkpointing recomputes in backward must find a block (with a mask of the
same shape) where its first run found one, and none where it found none: ``backward``
inside the block, or a clear error.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

from syncbn._autograd import is_recomputing, is_tracing

__all__ = ["block_mask", "layer_mask", "masking", "replica_blocks"]

#: the mask of the innermost open block of each thread (a tensor, or ``None`` for a
#: ``masking(None)`` block); unset, or ``_UNSET``, in a thread with no block open
_state = threading.local()
#: per thread with a block open (outside compiled code), the mask of its innermost one:
#: empty where no block is open in any thread; read by other threads (a layer called in
#: one without a block, a recomputation in autograd's: :meth:`_Remembered.in_autograd_thread`)
_innermost: dict[int, Any] = {}
_innermost_lock = threading.Lock()
_UNSET: Any = object()
#: the attribute of a layer that remembers the block mask of its latest eager call
_REMEMBERED = "_syncbn_block_mask"


class masking:  # noqa: N801 - used like a function: `with syncbn.masking(mask):`
    r"""A mask of valid positions for every syncbn layer called inside the ``with`` block.

    ``SyncBatchNorm`` (and :mod:`syncbn.data_parallel`'s layers) called without a mask
    inside the block take ``mask``, as ``layer(input, mask)`` would: the statistics of the
    valid positions of all ranks, zeros at padded positions. A mask passed to a layer
    wins over the block's. Blocks nest (the innermost one applies), and
    ``masking(None)`` opens a block in which layers run without a mask.

    For models that cannot pass a mask to their layers: BatchNorm in an
    ``nn.Sequential``, or behind a ``forward(x)`` of someone else's module. The layers
    must be syncbn's (convert the model first); torch's BatchNorm ignores the block.

    .. note::
        The block belongs to the thread that opens it, like ``torch.autocast``. A syncbn
        layer called in another thread while a block is open (``torch.nn.DataParallel``
        runs its replicas in threads) raises a ``RuntimeError`` instead of running
        unmasked: pass the mask to such layers, or open a block (``masking(None)`` for no
        mask) in the thread that calls them.
        :class:`syncbn.data_parallel.DataParallelWithCallback` (or a patched
        DataParallel) does the latter for its replicas: each replica's thread opens a
        block with the replica's chunk of the mask along dim 0, as DataParallel chunks
        the inputs (a mask broadcast over the batch, ``(1, L)`` or ``(L,)``, whole).

    .. note::
        With activation checkpointing (eager mode), a forward recomputed in backward
        takes the mask of the block open then: call ``backward`` inside the block (or
        open it inside the checkpointed function). Where autograd recomputes it in a
        thread of its own (on CUDA, each device's backward runs in one), that thread has
        no block: the forward's mask is taken while its block is still the innermost one
        of the forward's thread and the layer has not been called in another block since
        (else it raises). A recomputation that finds no block
        where the layer's latest forward had one, a block where it had none, or a mask
        of another shape or device, raises a ``RuntimeError``; a mask of the same shape
        is taken as the forward's (its values are not read back from the device).
        Under ``torch.compile``, the mask is read while tracing and becomes an input of
        the graph (a new mask each step recompiles nothing); recomputation inside the
        graph reuses it. A block may be opened inside the compiled function with torch
        >= 2.6 (torch 2.4's dynamo refuses a user-defined ``with``). ``torch.export``
        (``strict=False``) refuses a block's mask, which it would keep in the program as
        a constant.

    Args:
        mask: bool, True at valid positions, of a layer input's shape without the channel
            dimension (``(N, L)`` for ``(N, C, L)``) or broadcastable to it; or ``None``.
            Every layer called in the block gets it, so their inputs must share that
            shape; the mask is checked at each layer, as a passed one is.

    Examples::

        >>> block = nn.Sequential(nn.Conv1d(8, 8, 3, padding=1), nn.BatchNorm1d(8), nn.SiLU())
        >>> block = syncbn.convert_sync_batchnorm(block)
        >>> x = torch.randn(4, 8, 50)  # (N, C, T), padded
        >>> lengths = torch.tensor([50, 42, 17, 33])
        >>> valid = torch.arange(50) < lengths[:, None]  # (N, T)
        >>> with syncbn.masking(valid):
        ...     y = block(x)
        ...     y.sum().backward()
    """

    __slots__ = ("_mask", "_previous")

    def __init__(self, mask: torch.Tensor | None) -> None:
        if mask is not None and not isinstance(mask, torch.Tensor):
            raise TypeError(
                f"syncbn.masking: expected mask to be a torch.Tensor or None, "
                f"got {type(mask).__name__}"
            )
        self._mask: torch.Tensor | _ReplicaShare | None = mask
        # what each open block of this instance replaced, innermost last: an instance
        # entered again inside its own block restores the outer state when both close
        self._previous: list[Any] = []

    def __enter__(self) -> masking:
        self._previous.append(getattr(_state, "mask", _UNSET))
        _state.mask = self._mask
        if not is_tracing():  # a block opened in compiled code counts for its own thread only
            _note_innermost(self._mask)
        return self

    def __exit__(self, *exc_info: object) -> None:
        previous = self._previous.pop()
        _state.mask = previous  # not `del`: dynamo traces an assignment only
        if not is_tracing():
            _note_innermost(previous)


def _note_innermost(innermost: Any) -> None:
    """Record this thread's innermost block's mask after a block opened or closed
    (``_UNSET`` where none is left open)."""
    thread = threading.get_ident()
    with _innermost_lock:
        if innermost is _UNSET:
            _innermost.pop(thread, None)
        else:
            _innermost[thread] = innermost


def block_mask(input: torch.Tensor) -> torch.Tensor | None:
    """The mask of this thread's innermost block for a layer's ``input``; ``None`` in a
    ``masking(None)`` block or where no block is open anywhere. Raises where a block is
    open in another thread only. In a DataParallel replica's block, the replica's share of
    the mask (:class:`_ReplicaShare`)."""
    mask = getattr(_state, "mask", _UNSET)
    if isinstance(mask, _ReplicaShare):
        return mask.of(input)
    if mask is not _UNSET:
        return mask  # type: ignore[no-any-return]
    if _innermost:  # a block open in another thread
        raise RuntimeError(
            "a syncbn.masking block is open in another thread, and this SyncBatchNorm layer, "
            "called without a mask in a thread with no block of its own, would run unmasked "
            "(torch.nn.DataParallel runs its replicas in threads that do not see the block): "
            "pass the mask to the layer, or open a syncbn.masking block in this thread "
            "(masking(None) for no mask)"
        )
    return None


def _is_exporting() -> bool:
    """True while torch.export traces without dynamo (``strict=False``, the default of recent
    torch), which runs this code with fake tensors. Under dynamo, torch 2.8-2.11 answer
    ``is_exporting()`` with True for ``torch.compile`` too, so strict export is not told
    apart from it; a torch without these functions never exports here."""
    exporting = getattr(torch.compiler, "is_exporting", None)
    dynamo_compiling = getattr(torch.compiler, "is_dynamo_compiling", None)
    if exporting is None or dynamo_compiling is None or dynamo_compiling():
        return False
    return bool(exporting())


def layer_mask(layer: torch.nn.Module, input: torch.Tensor, compiling: bool) -> torch.Tensor | None:
    """The mask of a layer call that was passed none: its thread's block's, or ``None``.

    Eager calls remember the block's mask (weakly, on the layer), so that a forward that
    activation checkpointing recomputes in backward can tell whether it found the block
    that the layer's latest forward found (see :class:`masking`). Where no block is open
    and the layer's latest call had none, this is two reads.

    Args:
        input: the layer's input (a DataParallel replica's block resolves its share of
            the mask against it).
        compiling: dynamo is tracing (the mask becomes a graph input; nothing remembered).
    """
    if compiling:
        mask = block_mask(input)
        if mask is not None and _is_exporting():
            raise RuntimeError(
                "syncbn.masking: torch.export would keep the block's mask in the exported "
                "program as a constant, applied to every input; export a model that passes "
                "the mask to its layers (layer(input, mask)), which makes it an input"
            )
        return mask
    remembered = layer.__dict__.get(_REMEMBERED)
    if not _innermost and remembered is None:
        return None
    if remembered is not None and is_recomputing():
        if remembered.share is not None:
            # a DataParallel replica's forward, recomputed in an autograd thread, which has
            # no block of its own: the share that the replica's block gave the forward
            return remembered.share
        forward_mask = remembered.in_autograd_thread()
        if forward_mask is not None:
            return forward_mask
    mask = block_mask(input)
    if is_recomputing():
        if remembered is not None and mask is not None:
            if remembered.matches(mask):
                return mask
            found = "the open block's mask has another shape than its first forward's"
        elif remembered is not None:
            found = "no syncbn.masking block is open, but its first forward ran in one"
        elif mask is not None:
            found = "a syncbn.masking block is open, but its first forward ran in none"
        else:
            return None
        raise RuntimeError(
            f"{type(layer).__name__}: activation checkpointing recomputes this layer's "
            f"forward in backward, where {found}: call backward inside the block of the "
            "forward, or pass the mask to the layer"
        )
    # a plain attribute, past torch.nn.Module.__setattr__ (as last_input_dim)
    layer.__dict__[_REMEMBERED] = None if mask is None else _Remembered(mask, _in_replica())
    return mask


def _in_replica() -> bool:
    """Whether this thread's innermost block is a DataParallel replica's."""
    return isinstance(getattr(_state, "mask", _UNSET), _ReplicaShare)


class _Remembered:
    """The block mask of a layer's latest call: a weak reference, and its shape and device
    (a mask that a checkpointed function builds again is another tensor of the same
    values). A pickled or deep-copied layer forgets it (a weak reference cannot be
    pickled: ``torch.save(model)``).

    A DataParallel replica's layer keeps its share itself (``share``): the replica's
    backward, where checkpointing recomputes its forward, runs in an autograd thread that
    has no block, and the replica, a copy made for one forward, goes with its step.
    """

    __slots__ = ("_reference", "_shape", "_device", "_thread", "share")

    def __init__(self, mask: torch.Tensor, replica: bool = False) -> None:
        self._reference = weakref.ref(mask)
        self._shape, self._device = mask.shape, mask.device
        self._thread = threading.get_ident()
        self.share = mask if replica else None

    def in_autograd_thread(self) -> torch.Tensor | None:
        """The remembered mask, for a recomputation in another thread than the forward's,
        which has no block of its own, where the forward's thread still has that mask's
        block innermost; else ``None`` (the recomputation then raises, as before).

        On CUDA, autograd runs a backward, and the forwards that checkpointing recomputes
        in it, in a thread of its own per device: the block that the forward's thread
        holds open around ``backward()`` is not that thread's (on the CPU the calling
        thread runs the backward, and finds the block itself). The recomputation takes
        the block that the forward's thread has open, as the CPU's takes the calling
        thread's, but only where it is the block of the layer's latest call: a layer called
        again in another block since has forgotten which mask this forward took.
        """
        if self._thread == threading.get_ident():
            return None
        if getattr(_state, "mask", _UNSET) is not _UNSET:
            return None  # the thread has a block of its own: checked as any recomputation
        mask = self._reference()
        with _innermost_lock:
            open_there = _innermost.get(self._thread, _UNSET)
        return mask if mask is not None and open_there is mask else None

    def matches(self, mask: torch.Tensor) -> bool:
        """Whether ``mask`` is the remembered one, or one of its shape on its device (its
        values are not compared: that would read them back from an accelerator)."""
        if self._reference() is mask:
            return True
        return mask.shape == self._shape and mask.device == self._device

    def __reduce__(self) -> tuple[Callable[[], None], tuple[()]]:
        return _forgotten, ()


def _forgotten() -> None:
    """What an unpickled :class:`_Remembered` is."""
    return None


class _ReplicaShare:
    """A DataParallel replica's part of the block mask of the thread that runs DataParallel:
    chunk ``index`` of ``chunks`` along the batch dimension, as ``torch.nn.DataParallel``
    scatters the inputs (``chunk`` along dim 0, which for the same batch size gives the same
    pieces whether it is asked for one chunk per device or per replica), on the layer's
    device.

    Which dimension is the batch's depends on the layer's input: a mask with one
    dimension per position of the input (``(N, L)`` for ``(N, C, L)``) whose first size is
    not 1 is split; one broadcast over the batch (``(1, L)``, ``(L,)``) is whole in every
    replica. Each layer's mask is then checked as a passed one is.
    """

    __slots__ = ("_mask", "_index", "_chunks", "_resolved")

    def __init__(self, mask: torch.Tensor, index: int, chunks: int) -> None:
        self._mask, self._index, self._chunks = mask, index, chunks
        #: per (split or whole, device): the share, built once per replica and forward
        self._resolved: dict[tuple[bool, torch.device], torch.Tensor] = {}

    def of(self, input: torch.Tensor) -> torch.Tensor:
        """This replica's share of the mask for a layer's ``input`` (the whole mask for an
        input that is no tensor, which the layer then refuses)."""
        mask = self._mask
        if not isinstance(input, torch.Tensor):
            return mask
        split = mask.dim() == input.dim() - 1 and mask.shape[0] > 1
        key = (split, input.device)
        share = self._resolved.get(key)
        if share is None:
            if split:
                pieces = mask.chunk(self._chunks, 0)
                # fewer pieces than replicas: a mask of another batch size than the input's,
                # which the layer's check refuses (an empty share has the wrong size)
                mask = pieces[self._index] if self._index < len(pieces) else mask[:0]
            share = mask.to(input.device)
            self._resolved[key] = share
        return share


def replica_blocks(replicas: int) -> list[masking] | None:
    """The blocks that ``replicas`` DataParallel replica threads open, one each, for the
    block open in this thread (the one that runs DataParallel): each replica's share of its
    mask (see :class:`_ReplicaShare`), or ``masking(None)`` blocks for a ``masking(None)``
    block; ``None`` where this thread has no block open (replica threads then raise where
    a block is open elsewhere, as any other thread does)."""
    mask = getattr(_state, "mask", _UNSET)
    if mask is _UNSET or isinstance(mask, _ReplicaShare):  # (a DataParallel in a replica)
        return None
    blocks = [masking(None) for _ in range(replicas)]
    if mask is not None:
        for index, block in enumerate(blocks):
            block._mask = _ReplicaShare(mask, index, replicas)
    return blocks
