"""The rendezvous of DataParallel replicas: how the copies of one layer sum their buffers.

:mod:`syncbn.data_parallel` offers vacancy's API; this module is what its layers synchronize
through. ``torch.nn.DataParallel`` runs one replica of the model per device, each in a thread
of one process. The copies of one synchronized layer share one :class:`ReplicaRendezvous`
(through the replication callback's ``ctx``), and each copy reduces through a
:class:`ReplicaReducer`: the :class:`~syncbn._autograd.Reducer` that
:func:`~syncbn._autograd.sync_batch_norm_train` calls where the distributed path calls
``torch.distributed.all_reduce``. :class:`FailFast` releases the other replicas when one raises.
Like :mod:`syncbn.distributed`, this module knows nothing of BatchNorm: it sums buffers.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

__all__ = [
    "FailFast",
    "ReplicaReducer",
    "ReplicaReleased",
    "ReplicaRendezvous",
    "checked_timeout",
    "joined_rendezvous",
]

_SAME_CALLS_RULE = (
    "every replica must call each synchronized BatchNorm layer the same number of times in "
    "forward, and the same layers must receive gradients on every replica in backward"
)


class ReplicaReleased(RuntimeError):
    """What a replica raises when the rendezvous failed because of another replica (or a
    timeout): it is released, and names that failure, which is the step's root."""


class _Round:
    """One exchange: a buffer from every copy, then their sum on every copy's device."""

    def __init__(self) -> None:
        self.buffers: dict[int, torch.Tensor] = {}
        self.results: dict[int, torch.Tensor] | None = None
        self.collected = 0


class ReplicaRendezvous:
    """Sums one float64 buffer per replica, among the replicas of one layer, in one process.

    One rendezvous serves the copies of one layer for one DataParallel forward call (and
    the backward of that call). Rounds are keyed by ``(phase, call_index)``, so the
    ``k``-th call of the layer on one copy meets the ``k``-th call on every other copy.
    The master (the lowest copy id: 0 under DataParallel) waits for all buffers, sums
    them in copy order on its own device, and publishes the sum moved to each copy's
    device; the other copies wait for that result. Every wait ends by ``timeout``.

    Args:
        timeout: seconds any copy waits in one round before the rendezvous fails; ``None``
            to wait without a bound (:func:`checked_timeout`).
        layer: the layer's class name, for error messages.
    """

    def __init__(self, timeout: float | None, layer: str) -> None:
        self.timeout = timeout
        self.layer = layer
        self._copies: set[int] = set()
        self._rounds: dict[tuple[str, int], _Round] = {}
        self._failure: str | None = None
        #: the first exception that failed the rendezvous that is no replica's release
        #: (:class:`ReplicaReleased`), and the copy that raised it; read and forgotten by
        #: :func:`syncbn.data_parallel._apply_replicas` after the step
        self.root_failure: tuple[BaseException, int] | None = None
        self._cond = threading.Condition()

    def register(self, copy_id: int) -> None:
        """Record that replica ``copy_id`` takes part (called by the replication callback)."""
        with self._cond:
            self._copies.add(copy_id)

    @property
    def num_copies(self) -> int:
        return len(self._copies)

    def abort(self, copy_id: int, error: BaseException) -> None:
        """Fail the rendezvous: every copy waiting now or later raises, naming ``error``.

        Only the first failure is kept, so aborting again (as the released copies do) is
        harmless. The released copies' errors are not the root: a released copy may abort
        another layer's rendezvous before the copy that failed does (their threads race).
        """
        with self._cond:
            if self._failure is None:
                self._failure = f"replica {copy_id} raised {type(error).__name__}: {error}"
            if self.root_failure is None and not isinstance(error, ReplicaReleased):
                self.root_failure = (error, copy_id)
            self._cond.notify_all()

    def forget_root_failure(self) -> tuple[BaseException, int] | None:
        """The root failure, forgotten here: its traceback holds the failed replica's
        frames (its activations), which the rendezvous would keep alive."""
        with self._cond:
            root, self.root_failure = self.root_failure, None
        return root

    def _check_failure(self, copy_id: int, phase: str, call_index: int) -> None:
        if self._failure is not None:
            raise ReplicaReleased(
                f"{self.layer} replica {copy_id} stopped in {phase} (call {call_index}) "
                f"because {self._failure}"
            )

    def _wait(
        self, copy_id: int, ready: Callable[[], bool], key: tuple[str, int], deadline: float | None
    ) -> None:
        """Wait, holding the condition, until ``ready()``; raise on a failure or at the deadline.

        A round that is ready is delivered even if a copy failed meanwhile (the copy
        that failed may have done so after the round completed).
        """
        phase, call_index = key
        while not ready():
            self._check_failure(copy_id, phase, call_index)
            if deadline is None:  # no bound: woken by the round, or by a failure
                self._cond.wait()
                continue
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(self._copies - self._rounds[key].buffers.keys())
                waiting_for = f"replica(s) {missing}" if missing else "the master replica"
                # in backward, an error outside the synchronized layers (an out-of-memory
                # error in a convolution's backward) stops one device's autograd thread
                # without a word to the others, which then wait here until the timeout
                raised = (
                    " or one of them raised elsewhere in backward" if phase == "backward" else ""
                )
                self._failure = (
                    f"replica {copy_id} timed out after {self.timeout:g} s in {phase} (call "
                    f"{call_index}) waiting for {waiting_for}; {_SAME_CALLS_RULE}{raised}"
                )
                self._cond.notify_all()
                raise RuntimeError(f"{self.layer} {self._failure}")
            self._cond.wait(min(remaining, threading.TIMEOUT_MAX))

    def exchange(
        self, copy_id: int, phase: str, call_index: int, buffer: torch.Tensor
    ) -> torch.Tensor:
        """Contribute ``buffer`` to round ``(phase, call_index)``; return the sum over all copies.

        Returns:
            The elementwise sum of every copy's buffer, on ``buffer``'s device.

        Raises:
            RuntimeError: if a copy failed, or the round did not complete in time.
        """
        key = (phase, call_index)
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        with self._cond:
            self._check_failure(copy_id, phase, call_index)
            round_ = self._rounds.setdefault(key, _Round())
            round_.buffers[copy_id] = buffer
            self._cond.notify_all()
            is_master = copy_id == min(self._copies)
            if is_master:
                self._wait(copy_id, lambda: len(round_.buffers) == len(self._copies), key, deadline)
        if is_master:
            try:
                results = self._sum(copy_id, round_.buffers)
            except BaseException as error:
                self.abort(copy_id, error)  # the others wait for this sum: release them
                raise
            with self._cond:
                round_.results = results
                self._cond.notify_all()
        with self._cond:
            self._wait(copy_id, lambda: round_.results is not None, key, deadline)
            result = cast("dict[int, torch.Tensor]", round_.results)[copy_id]
            round_.collected += 1
            if round_.collected == len(self._copies):
                del self._rounds[key]
        return result

    @staticmethod
    def _sum(master_id: int, buffers: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """The master's sum of a round's buffers, in copy order (deterministic), on the
        master's device; then moved to every copy's device."""
        master = buffers[master_id]
        total = master.clone()
        for other_id in sorted(buffers):
            if other_id != master_id:
                total.add_(buffers[other_id].to(master.device))
        return {
            other_id: total if other_id == master_id else total.to(other.device, copy=True)
            for other_id, other in buffers.items()
        }


@dataclass(frozen=True)
class ReplicaReducer:
    """The :class:`~syncbn._autograd.Reducer` of one replica: an exchange through the rendezvous."""

    rendezvous: ReplicaRendezvous
    copy_id: int
    call_index: int
    participants: str = "replicas"

    @property
    def world_size(self) -> int:
        return self.rendezvous.num_copies

    def all_reduce(self, buffer: torch.Tensor, phase: str) -> torch.Tensor:
        return self.rendezvous.exchange(self.copy_id, phase, self.call_index, buffer)

    def dissolved_test(self) -> None:
        return None  # a failed step's checks are discarded (DataParallelWithCallback)

    def release_others(self, error: BaseException) -> None:
        """Fail the rendezvous for the other replicas: this one raises ``error`` before its
        collective (a deferred problem that it took from the queue they share; see
        :func:`syncbn._autograd.resolve_mode`)."""
        self.rendezvous.abort(self.copy_id, error)


def checked_timeout(timeout: Any, layer: str) -> float | None:
    """A layer's ``sync_timeout`` as a rendezvous takes it: seconds, or ``None`` for no bound
    (``None`` or ``math.inf``: vacancy's replicas wait without one).

    Raises:
        ValueError: neither a positive number nor ``None``.
    """
    if timeout is None:
        return None
    problem = ValueError(
        f"{layer}.sync_timeout must be a positive number of seconds, or None (or math.inf) "
        f"to wait without a bound, got {timeout!r}"
    )
    if isinstance(timeout, (bool, str, bytes)):
        raise problem
    try:
        seconds = float(timeout)  # numpy's numbers and 0-dim tensors too
    except (TypeError, ValueError, OverflowError):
        raise problem from None
    if not seconds > 0:  # (NaN is not > 0)
        raise problem
    return None if seconds == math.inf else seconds


def joined_rendezvous(ctx: Any, copy_id: int, timeout: Any, layer: str) -> ReplicaRendezvous:
    """Join, as ``copy_id``, the rendezvous that the copies of one layer keep on their ``ctx``.

    The first copy to arrive creates it with ``timeout`` (a layer's ``sync_timeout``,
    :func:`checked_timeout`) and ``layer`` (the class name, for error messages).
    """
    rendezvous = getattr(ctx, "syncbn_rendezvous", None)
    if rendezvous is None:
        rendezvous = ReplicaRendezvous(checked_timeout(timeout, layer), layer)
        ctx.syncbn_rendezvous = rendezvous
    rendezvous.register(copy_id)
    return cast(ReplicaRendezvous, rendezvous)


class FailFast(nn.Module):
    """Runs one replica; if it raises, releases the other replicas waiting in its layers."""

    def __init__(
        self, replica: nn.Module, copy_id: int, rendezvous: Sequence[ReplicaRendezvous]
    ) -> None:
        super().__init__()
        self.replica = replica
        self.copy_id = copy_id
        self.rendezvous = rendezvous

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self.replica(*args, **kwargs)
        except BaseException as error:
            for rendezvous in self.rendezvous:
                rendezvous.abort(self.copy_id, error)
            raise
