"""The DataParallel API of vacancy's Synchronized-BatchNorm-PyTorch, with torch's maths.

``torch.nn.DataParallel`` runs one *replica* of the model per device, each in its own
thread of one process. The layers of this module let the replicas of one BatchNorm
layer pool their statistics, so that the layer normalizes with the mean and variance
of the whole batch that DataParallel scattered. Code written for vacancy's
``sync_batchnorm`` package keeps working with only its import changed::

    from syncbn.data_parallel import SynchronizedBatchNorm2d, DataParallelWithCallback

How the replicas meet (the replication-callback design)
-------------------------------------------------------
DataParallel copies the model for every forward call. :class:`DataParallelWithCallback`
(or a DataParallel patched by :func:`patch_replication_callback`) then calls
``__data_parallel_replicate__(ctx, copy_id)`` on every submodule of every copy that has
it, where ``ctx`` is one object shared by the copies of the same submodule. The copies
of a synchronized layer use it to share one rendezvous (:mod:`syncbn._replicas`, which
knows nothing of BatchNorm; this module is the API around it). In training, each copy packs
its local moments into a small float64 buffer (the same buffer as the distributed
path, built by :mod:`syncbn._protocol`); copy 0 sums the buffers of all copies in copy
order on its device and hands every copy the sum on that copy's device. Backward
exchanges the per-channel ``sum(dy)`` and ``sum(dy * xhat)`` the same way, so input
gradients flow through the global statistics. The only difference from
:class:`syncbn.SyncBatchNorm` is the collective: an in-process rendezvous between
replica threads instead of a ``torch.distributed`` all_reduce.

Every wait is bounded by the layer's ``sync_timeout`` (seconds; ``None`` for no bound,
as vacancy's replicas wait); a replica that fails
(in the layer or, under :class:`DataParallelWithCallback` or a patched DataParallel,
anywhere in its forward) releases the other replicas at once with an error naming the
failure.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn
from torch._utils import ExceptionWrapper
from torch.nn.modules.batchnorm import _BatchNorm

from syncbn import _masking, _protocol
from syncbn._autograd import (
    LayerInfo,
    LocalReducer,
    TrainOptions,
    input_problem,
    sync_batch_norm_train,
)
from syncbn._compiled import is_compiling, leaf_call_when_fx_traced
from syncbn._composite import batch_norm_valid, mask_problem
from syncbn._conversion import (
    batchnorm_twin,
    computed_parameters,
    converted_class,
    describe_module,
    keeps_extra_state,
    register_converter,
    replace_modules,
    unmaterialised,
)
from syncbn._replicas import (
    FailFast,
    ReplicaReducer,
    ReplicaReleased,
    ReplicaRendezvous,
    joined_rendezvous,
)
from syncbn.batchnorm import SyncBatchNorm, reset_without_bias
from syncbn.convert import BatchNormNd, _batchnorm_class

__all__ = [
    "DEFAULT_SYNC_TIMEOUT",
    "DataParallelWithCallback",
    "SynchronizedBatchNorm1d",
    "SynchronizedBatchNorm2d",
    "SynchronizedBatchNorm3d",
    "SynchronizedBatchNormNd",
    "convert_model",
    "execute_replication_callbacks",
    "patch_replication_callback",
    "register_converters",
]

#: Seconds a replica waits for the other replicas of its layer before raising.
DEFAULT_SYNC_TIMEOUT = 120.0

#: what non-reentrant activation checkpointing raises to end a recomputation once it has
#: what backward needs: from the layer's ``save_for_backward``, after the replicas' exchange
_STOP_RECOMPUTATION: tuple[type[Exception], ...] = tuple(
    error
    for error in (getattr(torch.utils.checkpoint, "_StopRecomputationError", None),)
    if error is not None
)


class _SynchronizedBatchNorm(_BatchNorm):
    """Shared implementation of the ``SynchronizedBatchNorm{1,2,3}d`` layers."""

    #: true on the copies that ``torch.nn.DataParallel`` runs (torch's replicate sets it
    #: on each): a plain lookup where a copy no replication callback joined warns
    _is_replica: bool = False

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        device: Any = None,
        dtype: torch.dtype | None = None,
        *,
        bias: bool = True,
    ) -> None:
        super().__init__(
            num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype
        )
        if affine and not bias:  # as torch >= 2.13's layers take it (on any torch here)
            self.register_parameter("bias", None)
        self.sync_timeout: float | None = DEFAULT_SYNC_TIMEOUT
        # Set on replicas only, by __data_parallel_replicate__.
        self._replica_sync: ReplicaRendezvous | None = None
        self._replica_copy_id = 0
        self._replica_calls = 0

    def reset_parameters(self) -> None:
        if not reset_without_bias(self):
            super().reset_parameters()

    def __data_parallel_replicate__(self, ctx: Any, copy_id: int) -> None:
        """Join the rendezvous shared (through ``ctx``) by the copies of this layer.

        Called on each replica by :func:`execute_replication_callbacks`; ``ctx`` is the
        same object for every copy of this layer within one replication.
        """
        self._replica_sync = joined_rendezvous(ctx, copy_id, self.sync_timeout, type(self).__name__)
        self._replica_copy_id = copy_id
        self._replica_calls = 0

    def _input_problem(self, input: torch.Tensor) -> Exception | None:
        try:
            self._check_input_dim(input)  # BatchNorm1d/2d/3d's own dims check
        except ValueError as error:
            return error
        parameters = (self.weight, self.bias, self.running_mean, self.running_var)
        return input_problem(
            input, self.num_features, layer_kind=type(self).__name__, parameters=parameters
        )

    def forward(self, input: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        traced = leaf_call_when_fx_traced(self, input, mask=mask)
        if traced is not None:  # torch.fx.symbolic_trace: one node, like torch.nn's layers
            return traced  # type: ignore[no-any-return]
        if mask is None:  # the mask of an enclosing syncbn.masking block, if any
            mask = _masking.layer_mask(self, input, is_compiling())
        rendezvous = self._replica_sync
        if self._is_replica and rendezvous is None and self.training:
            _warn_unjoined_replica(type(self).__name__)
        if not self.training or rendezvous is None or rendezvous.num_copies <= 1:
            # Not a replica among several, or not training: exactly torch's BatchNorm (with
            # a mask, that of the valid positions).
            if mask is None:
                return super().forward(input)
            return self._masked_without_replicas(input, mask)

        problem = self._input_problem(input)
        if problem is None and mask is not None:
            problem = mask_problem(mask, input)
        if problem is not None:
            rendezvous.abort(self._replica_copy_id, problem)
            raise problem
        tracking = self.track_running_stats
        try:
            reducer = ReplicaReducer(rendezvous, self._replica_copy_id, self._replica_calls)
            layer = LayerInfo(type(self).__name__, self.num_features, self._replica_calls, False)
            return sync_batch_norm_train(
                input,
                self.weight,
                self.bias,
                TrainOptions(reducer, layer, self.eps, self.momentum),
                running_mean=self.running_mean if tracking else None,
                running_var=self.running_var if tracking else None,
                num_batches_tracked=self.num_batches_tracked if tracking else None,
                mask=mask,
            )
        except _STOP_RECOMPUTATION:
            raise  # checkpointing's signal, after the exchange: not a failure of this replica
        except Exception as error:
            rendezvous.abort(self._replica_copy_id, error)
            raise
        finally:
            self._replica_calls += 1

    def _masked_without_replicas(self, input: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """A masked call that no other replica joins: in eval mode torch's BatchNorm with
        zeros at the padded positions; in training (or in eval without running statistics)
        the statistics of this call's valid positions, as :class:`syncbn.SyncBatchNorm`
        computes them in a process alone."""
        problem = self._input_problem(input)
        if problem is None:
            problem = mask_problem(mask, input)
        if problem is not None:
            raise problem
        tracking = self.track_running_stats
        running_mean = self.running_mean if tracking else None
        running_var = self.running_var if tracking else None
        if not self.training and running_mean is not None and running_var is not None:
            return batch_norm_valid(
                input, mask, running_mean, running_var, self.weight, self.bias, False, 0.0, self.eps
            )
        update = self.training  # eval without running statistics updates nothing
        layer = LayerInfo(type(self).__name__, self.num_features, None, False)
        return sync_batch_norm_train(
            input,
            self.weight,
            self.bias,
            TrainOptions(LocalReducer(), layer, self.eps, self.momentum),
            running_mean=running_mean if update else None,
            running_var=running_var if update else None,
            num_batches_tracked=self.num_batches_tracked if update and tracking else None,
            mask=mask,
        )


_CLASS_DOC = r"""Batch normalization over all DataParallel replicas' slices, for {dims} input.

    The drop-in replacement for :class:`torch.nn.{torch_name}` in models run by
    :class:`DataParallelWithCallback` (vacancy's ``sync_batchnorm`` API):

    .. math::
        y = \frac{{x - \mathrm{{E}}[x]}}{{\sqrt{{\mathrm{{Var}}[x] + \epsilon}}}} * \gamma + \beta

    In training, when DataParallel has replicated the model on several devices,
    the mean and (biased) variance are taken per channel over the whole batch that
    DataParallel scattered: all replicas' slices together. Outputs, input gradients
    and running statistics then equal those of :class:`torch.nn.{torch_name}` run on
    the whole batch on one device, and the weight and bias gradients, which
    DataParallel sums over replicas, equal its gradients. ``running_var`` is updated
    with the unbiased variance of the whole batch and ``momentum=None`` gives a
    cumulative moving average, as in torch; :math:`\epsilon` is added to the
    variance (torch's semantics, not vacancy's ``sqrt(max(var, eps))``).

    .. note::
        Without replication (CPU only, a single device, or outside DataParallel) and
        in eval mode a call without a mask is exactly :class:`torch.nn.{torch_name}`'s,
        and no call starts threads or waits.

    ``layer(input, mask)`` takes a bool ``mask``, True at the valid positions of a padded
    batch (the input's shape without the channel dimension, or broadcastable to it), as
    :class:`syncbn.SyncBatchNorm` does (vacancy's layers take none): in training the
    statistics are those of the valid positions of all replicas' slices, and padded
    positions of the output and of the input gradient are zero; in eval mode the running
    statistics normalize, and padded positions are zero.

    .. note::
        Every replica must call the layer the same number of times in each forward,
        and the same layers must receive gradients on every replica in backward: the
        ``k``-th call on one device is pooled with the ``k``-th call on every other
        device. A replica that waits longer than ``sync_timeout`` seconds for the
        others raises a ``RuntimeError`` saying which replicas are missing.

    Args:
        num_features: number of channels :math:`C` of the input.
        eps: value added to the variance for numerical stability. Default: 1e-5
        momentum: factor of the running statistics update, or ``None`` for a
            cumulative moving average. Default: 0.1
        affine: learnable per-channel scale and shift. Default: ``True``
        track_running_stats: keep running mean and variance for eval mode.
            Default: ``True``
        device: device of the parameters and buffers. Default: ``None``
        dtype: dtype of the parameters and buffers. Default: ``None``
        bias: with ``affine``, learn the shift :math:`\beta` too (``False``: a scale only,
            as torch >= 2.13's ``bias=False``; keyword only). Default: ``True``

    Attributes:
        sync_timeout: seconds a replica waits for the others in one exchange, or ``None``
            (or ``math.inf``) to wait without a bound, as vacancy's replicas do; read
            (and refused with a ``ValueError`` unless positive) when DataParallel
            replicates the layer. Default: ``DEFAULT_SYNC_TIMEOUT`` (120)

    Shape:
        - Input: {shape}
        - Mask (optional): the input's shape without dimension 1, or broadcastable to it
        - Output: {shape} (same shape as input)

    Examples::

        >>> bn = {name}(10, eps=1e-5, affine=False)
        >>> model = DataParallelWithCallback(bn, device_ids=[0, 1])
        >>> y = model(torch.randn({example}))
    """


class SynchronizedBatchNorm1d(_SynchronizedBatchNorm):
    _check_input_dim = nn.BatchNorm1d._check_input_dim


class SynchronizedBatchNorm2d(_SynchronizedBatchNorm):
    _check_input_dim = nn.BatchNorm2d._check_input_dim


class SynchronizedBatchNorm3d(_SynchronizedBatchNorm):
    _check_input_dim = nn.BatchNorm3d._check_input_dim


class SynchronizedBatchNormNd(_SynchronizedBatchNorm):
    r"""The layers above for input of any rank, :math:`(N, C, *)` with at least 2 dims: the
    synchronized twin of :class:`syncbn.BatchNormNd` (not in vacancy's API).

    :func:`convert_model` gives one for a :class:`syncbn.SyncBatchNorm` whose input rank it
    cannot tell: a layer built directly that ran only in DataParallel's replicas, which
    are copies (the layer itself never saw an input), and for a :class:`syncbn.BatchNormNd`.
    Its arguments, state and behaviour are those of :class:`SynchronizedBatchNorm2d`.

    Shape:
        - Input: :math:`(N, C, *)`
        - Output: :math:`(N, C, *)` (same shape as input)

    Examples::

        >>> bn = SynchronizedBatchNormNd(10)
        >>> bn(torch.randn(16, 10, 50)).shape, bn(torch.randn(16, 10, 8, 8)).shape
        (torch.Size([16, 10, 50]), torch.Size([16, 10, 8, 8]))
    """

    _check_input_dim = BatchNormNd._check_input_dim


SynchronizedBatchNorm1d.__doc__ = _CLASS_DOC.format(
    dims="2D or 3D",
    torch_name="BatchNorm1d",
    shape=r":math:`(N, C)` or :math:`(N, C, L)`",
    name="SynchronizedBatchNorm1d",
    example="16, 10",
)
SynchronizedBatchNorm2d.__doc__ = _CLASS_DOC.format(
    dims="4D",
    torch_name="BatchNorm2d",
    shape=r":math:`(N, C, H, W)`",
    name="SynchronizedBatchNorm2d",
    example="16, 10, 8, 8",
)
SynchronizedBatchNorm3d.__doc__ = _CLASS_DOC.format(
    dims="5D",
    torch_name="BatchNorm3d",
    shape=r":math:`(N, C, D, H, W)`",
    name="SynchronizedBatchNorm3d",
    example="16, 10, 4, 8, 8",
)


class _CallbackContext:
    """State shared by the copies of one submodule during one replication."""


def execute_replication_callbacks(replicas: Sequence[nn.Module]) -> None:
    """Call ``__data_parallel_replicate__(ctx, copy_id)`` on every submodule that has it.

    ``replicas`` are the copies that ``torch.nn.parallel.replicate`` made of one
    module, copy ``i`` for device ``i``. The submodules at the same position in every
    copy receive one shared ``ctx`` object, and copy ``i`` receives ``copy_id=i``.
    :class:`DataParallelWithCallback` and :func:`patch_replication_callback` call
    this after every replication; call it yourself from a custom DataParallel.

    Args:
        replicas: the copies of one module, in device order.
    """
    if not replicas:
        return
    contexts = [_CallbackContext() for _ in replicas[0].modules()]
    for copy_id, replica in enumerate(replicas):
        for ctx, submodule in zip(contexts, replica.modules()):
            callback = getattr(submodule, "__data_parallel_replicate__", None)
            if callback is not None:
                callback(ctx, copy_id)


def _warn_unjoined_replica(layer: str) -> None:
    """Warns, once per process (Python's default filter), that a replica of a plain
    ``torch.nn.DataParallel`` trains unsynchronized: no replication callback joined its
    copies, so each normalizes its device's slice alone (as vacancy's layers do there)."""
    warnings.warn(
        f"{layer}: this layer is a replica of a torch.nn.DataParallel that runs no "
        "replication callback, so each replica normalizes its own device's slice with that "
        "slice's statistics (the whole batch's only where the batch made one replica). "
        "Wrap the model in DataParallelWithCallback, or call "
        "patch_replication_callback(data_parallel)",
        UserWarning,
        stacklevel=3,
    )


def _rendezvous_of(replicas: Sequence[nn.Module]) -> list[ReplicaRendezvous]:
    """The rendezvous of the synchronized layers of ``replicas`` (shared by all of them)."""
    if not replicas:
        return []
    return [
        m._replica_sync
        for m in replicas[0].modules()
        if isinstance(m, _SynchronizedBatchNorm) and m._replica_sync is not None
    ]


def _fail_fast(
    replicas: Sequence[nn.Module], rendezvous: list[ReplicaRendezvous]
) -> list[nn.Module]:
    """Wrap replicas so that one replica's exception releases the others at once."""
    if not rendezvous:
        return list(replicas)
    return [FailFast(replica, i, rendezvous) for i, replica in enumerate(replicas)]


def _root_failure(rendezvous: list[ReplicaRendezvous]) -> ExceptionWrapper | None:
    """The exception that stopped the replicas, if one did, wrapped as ``parallel_apply``
    wraps a replica's (its type, and its traceback as text); forgotten by every
    rendezvous.

    A released replica's error (:class:`~syncbn._replicas.ReplicaReleased`, which names the
    root) is what ``parallel_apply`` raises where that replica comes first, and a handler
    of the root's type (``except torch.OutOfMemoryError``: skip the batch) would not see
    it. The root itself is not raised again: its traceback holds the failed replica's
    frames, whose activations a handler that frees memory (``empty_cache``) wants gone.
    """
    roots = [root for each in rendezvous if (root := each.forget_root_failure()) is not None]
    if not roots:
        return None
    error, copy_id = roots[0]  # each rendezvous keeps that step's one root, or none
    if not isinstance(error, Exception):
        return None
    return ExceptionWrapper((type(error), error, error.__traceback__), f"in replica {copy_id}")


class _InBlock(nn.Module):
    """Runs one replica inside a :class:`syncbn.masking` block of its own (see
    :func:`syncbn._masking.replica_blocks`): its thread does not see the caller's block."""

    def __init__(self, replica: nn.Module, block: _masking.masking) -> None:
        super().__init__()
        self.replica = replica
        self.block = block

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with self.block:
            return self.replica(*args, **kwargs)


def _device_index(device: int | str | torch.device) -> int | None:
    return device if isinstance(device, int) else torch.device(device).index


def _present_devices(
    device_ids: Sequence[int | str | torch.device] | None,
    output_device: int | str | torch.device | None,
    device_count: int,
) -> tuple[list[int | str | torch.device] | None, int | str | torch.device | None]:
    """Drop the device ids (and output device) that this machine does not have.

    Returns:
        ``(device_ids, output_device)``; unchanged when every id exists or none does.
    """
    if device_ids is None:
        return None, output_device

    def present(device: int | str | torch.device) -> bool:
        index = _device_index(device)
        return index is None or index < device_count

    kept = [device for device in device_ids if present(device)]
    if not kept or len(kept) == len(device_ids):
        return list(device_ids), output_device
    warnings.warn(
        f"DataParallelWithCallback: device_ids {list(device_ids)} name devices this machine "
        f"does not have ({device_count} CUDA device(s)); running on {kept}",
        stacklevel=3,
    )
    if output_device is not None and not present(output_device):
        output_device = None
    return kept, output_device


class DataParallelWithCallback(nn.DataParallel):
    r"""``torch.nn.DataParallel`` that lets synchronized layers of the replicas find each other.

    After DataParallel copies the module for a forward call, this wrapper calls
    ``__data_parallel_replicate__(ctx, copy_id)`` on every submodule of every copy
    that defines it (see :func:`execute_replication_callbacks`), which is how the
    :class:`SynchronizedBatchNorm2d` (1d, 3d) layers of the copies pool their
    statistics. If a replica raises, the other replicas waiting for it in a
    synchronized layer are released at once with an error that names the failure.
    Called inside a :class:`syncbn.masking` block, it opens a block in each replica's
    thread with that replica's chunk of the mask along dim 0, as it chunks the inputs
    (the whole mask where it is broadcast over the batch); the inputs must then be
    scattered along ``dim=0``.

    On a machine without several CUDA devices the wrapper runs as the plain module:
    without CUDA, ``torch.nn.DataParallel`` ignores ``device_ids`` and calls the
    module directly; with CUDA, ``device_ids`` (and ``output_device``) that name
    devices the machine does not have are dropped with a warning, so the documented
    ``device_ids=[0, 1]`` runs on one GPU.

    Args:
        module: the module to parallelize.
        device_ids: CUDA devices to use. Default: all devices
        output_device: device of the output. Default: ``device_ids[0]``
        dim: dimension along which the inputs are scattered. Default: 0

    Examples::

        >>> sync_bn = SynchronizedBatchNorm1d(10, eps=1e-5, affine=False)
        >>> sync_bn = DataParallelWithCallback(sync_bn, device_ids=[0, 1])
        >>> y = sync_bn(torch.randn(16, 10))
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: Sequence[int | torch.device] | None = None,
        output_device: int | torch.device | None = None,
        dim: int = 0,
    ) -> None:
        if torch.cuda.is_available():
            device_ids, output_device = _present_devices(  # type: ignore[assignment]
                device_ids, output_device, torch.cuda.device_count()
            )
        super().__init__(module, device_ids, output_device, dim)

    def replicate(self, module: nn.Module, device_ids: Sequence[int | torch.device]) -> Any:
        replicas = super().replicate(module, device_ids)
        execute_replication_callbacks(replicas)
        return replicas

    def parallel_apply(
        self, replicas: Sequence[nn.Module], inputs: Sequence[Any], kwargs: Any
    ) -> list[Any]:
        return _apply_replicas(self, super().parallel_apply, replicas, inputs, kwargs)


def _apply_replicas(
    data_parallel: nn.DataParallel,
    apply: Callable[..., Any],
    replicas: Sequence[nn.Module],
    inputs: Sequence[Any],
    kwargs: Any,
) -> list[Any]:
    """``apply(replicas, inputs, kwargs)`` (DataParallel's ``parallel_apply``) with the
    replicas released at once when one raises, each in the caller's ``syncbn.masking``
    block, its own share of it, where one is open."""
    blocks = _masking.replica_blocks(len(replicas))
    dim = getattr(data_parallel, "dim", 0)  # (unset by DataParallel on a machine without CUDA)
    if blocks is not None and dim != 0:
        raise ValueError(
            f"{type(data_parallel).__name__}: a syncbn.masking block's mask is split among the "
            "replicas along the batch dimension, dim 0, but this DataParallel scatters "
            f"its inputs along dim={dim}; pass the mask to the layers instead"
        )
    rendezvous = _rendezvous_of(replicas)
    replicas = _fail_fast(replicas, rendezvous)
    if blocks is not None:  # each replica's thread opens a block of its own share
        replicas = [_InBlock(replica, block) for replica, block in zip(replicas, blocks)]
    try:
        return list(apply(replicas, inputs, kwargs))
    except BaseException as error:
        # every replica has stopped, and the step's error is raised: the checks that
        # its exchanges deferred (on GPUs) would fail the next step again, and the next
        _protocol.discard_pending("replicas")
        root = _root_failure(rendezvous)
        if root is None or not isinstance(error, ReplicaReleased):
            raise
    # outside the handler, so that it is not chained to the released replica's error
    root.reraise()
    raise AssertionError("ExceptionWrapper.reraise() returned")


def _replicate_with_callbacks(
    data_parallel: nn.DataParallel,
    own: Callable[..., Any] | None,
    module: nn.Module,
    device_ids: Sequence[int | torch.device],
) -> Any:
    """A patched instance's ``replicate`` (:func:`patch_replication_callback`): its class's,
    or the instance's ``own`` one that the patch found, then the callbacks."""
    replicate = own or functools.partial(type(data_parallel).replicate, data_parallel)
    replicas = replicate(module, device_ids)
    execute_replication_callbacks(replicas)
    return replicas


def _parallel_apply_with_callbacks(
    data_parallel: nn.DataParallel,
    own: Callable[..., Any] | None,
    replicas: Sequence[nn.Module],
    inputs: Sequence[Any],
    kwargs: Any,
) -> list[Any]:
    """A patched instance's ``parallel_apply`` (:func:`patch_replication_callback`): its
    class's, or the instance's ``own`` one, as :class:`DataParallelWithCallback` runs it."""
    apply = own or functools.partial(type(data_parallel).parallel_apply, data_parallel)
    return _apply_replicas(data_parallel, apply, replicas, inputs, kwargs)


def patch_replication_callback(data_parallel: nn.DataParallel) -> None:
    """Make one ``torch.nn.DataParallel`` instance run the replication callbacks.

    Patches ``data_parallel.replicate`` and ``data_parallel.parallel_apply`` (of this
    instance only, for code that uses its own DataParallel class) so that it does what
    :class:`DataParallelWithCallback` does: every replication is followed by
    :func:`execute_replication_callbacks`, a replica that raises releases the others at
    once, and the replicas take their share of a :class:`syncbn.masking` block. The patched
    instance still pickles (``torch.save(model)``) and copies (``copy.deepcopy``). Patching
    twice is harmless.

    Args:
        data_parallel: the wrapper to patch.

    Raises:
        TypeError: if ``data_parallel`` is not a ``torch.nn.DataParallel``.

    Examples::

        >>> sync_bn = SynchronizedBatchNorm1d(10, eps=1e-5, affine=False)
        >>> sync_bn = torch.nn.DataParallel(sync_bn, device_ids=[0, 1])
        >>> patch_replication_callback(sync_bn)  # monkey-patching
    """
    if not isinstance(data_parallel, nn.DataParallel):
        raise TypeError(
            "patch_replication_callback expects a torch.nn.DataParallel, got "
            f"{type(data_parallel).__name__}"
        )
    if isinstance(data_parallel, DataParallelWithCallback):
        return
    patches: dict[str, Callable[..., Any]] = {
        "replicate": _replicate_with_callbacks,
        "parallel_apply": _parallel_apply_with_callbacks,
    }
    for name, patch in patches.items():
        own = data_parallel.__dict__.get(name)  # the instance's own, if it has one
        if isinstance(own, functools.partial) and own.func is patch:
            continue  # patched before
        # a partial of a module-level function, not a closure: it pickles, and a deep
        # copy's partial takes the copy (pickle and copy.deepcopy keep the reference cycle)
        setattr(data_parallel, name, functools.partial(patch, data_parallel, own))


_CONVERSIONS: tuple[tuple[type[_BatchNorm], type[_SynchronizedBatchNorm]], ...] = (
    (nn.BatchNorm1d, SynchronizedBatchNorm1d),
    (nn.BatchNorm2d, SynchronizedBatchNorm2d),
    (nn.BatchNorm3d, SynchronizedBatchNorm3d),
    (BatchNormNd, SynchronizedBatchNormNd),
)
#: the forwards of the layers convert_model converts (a subclass with its own is left)
_CONVERTIBLE_FORWARDS = (_BatchNorm.forward, SyncBatchNorm.forward, nn.SyncBatchNorm.forward)


def _synchronized_class(module: _BatchNorm) -> type[_SynchronizedBatchNorm] | None:
    """The class of ``module``'s twin, or ``None`` for a module that convert_model keeps."""
    converted = converted_class(module)  # a materialised lazy layer's BatchNorm*d
    for plain_class, sync_class in _CONVERSIONS:
        if issubclass(converted, plain_class):
            return sync_class
    if isinstance(module, SyncBatchNorm):
        # the twin of the class revert_sync_batchnorm gives it: the class it replaced, or by
        # the rank of the last input it ran on (BatchNormNd for none: one that ran only in
        # replicas)
        original = module._original_class
        for plain_class, sync_class in _CONVERSIONS:
            if original is not None and issubclass(original, (plain_class, sync_class)):
                return sync_class
        plain_class = _batchnorm_class(module.last_input_dim)
        return next(sync for plain, sync in _CONVERSIONS if plain is plain_class)
    if isinstance(module, nn.SyncBatchNorm):  # any input rank, as torch's layer takes
        return SynchronizedBatchNormNd
    return None


def _synchronized(module: nn.Module, path: str, skipped: list[str]) -> nn.Module:
    """What replaces ``module``: the synchronized twin of a BatchNorm layer, sharing its
    state; a :class:`DataParallelWithCallback` for a ``torch.nn.DataParallel`` (whose module
    is converted in turn); else the module itself."""
    if isinstance(module, nn.DataParallel) and not isinstance(module, DataParallelWithCallback):
        # nested, as vacancy's convert_model converts it: else its replicas would never meet
        return _with_callback(module, module.module)  # (the walk converts its module)
    if not isinstance(module, _BatchNorm):
        return module
    if unmaterialised(module):
        skipped.append(
            f"{describe_module(module, path)}: it is lazy; run one forward pass first so "
            "that its parameters are materialised"
        )
        return module
    sync_class = _synchronized_class(module)
    if sync_class is None:
        return module
    described = describe_module(module, path)
    if type(module).forward not in _CONVERTIBLE_FORWARDS:
        skipped.append(
            f"{described}: it overrides forward(), and converting it would drop that behaviour"
        )
        return module
    if keeps_extra_state(module):
        skipped.append(
            f"{described}: it keeps extra state (get_extra_state), which a converted layer "
            "would drop"
        )
        return module
    if computed_parameters(module):
        skipped.append(
            f"{described}: its weight or bias is not a Parameter of the layer (computed "
            "by hooks, as the hook-based torch.nn.utils.weight_norm does, or set as a plain "
            "tensor), which a converted layer would lose"
        )
        return module
    twin = batchnorm_twin(module, sync_class)
    if isinstance(module, SyncBatchNorm):
        twin.sync_timeout = _kept_sync_timeout(module)
    return twin


def convert_model(module: nn.Module) -> nn.Module:
    """Replace every ``BatchNorm1d``/``2d``/``3d`` in ``module`` with its synchronized twin.

    Each layer becomes :class:`SynchronizedBatchNorm1d` (``2d``, ``3d``) *sharing* its
    Parameters and buffers (so optimizers and ``state_dict`` keys are unaffected) and
    keeping its training mode, device, dtype, ``eps``, ``momentum``, ``affine`` and
    ``track_running_stats``. A :class:`syncbn.SyncBatchNorm` becomes the twin of the class
    it was converted from (its ``sync_timeout`` too, for a SynchronizedBatchNorm), else of
    the rank of the last input it ran on, or :class:`SynchronizedBatchNormNd` where it saw
    none (one that ran only in DataParallel's replicas), as a :class:`syncbn.BatchNormNd`
    does. A
    subclass that overrides ``forward`` or keeps extra state (``get_extra_state``), a
    layer whose weight or bias is computed by hooks (the hook-based ``weight_norm``), or a
    lazy layer not yet materialised (by a forward or ``load_state_dict``) is left
    unconverted with a warning naming it; parametrizations (``torch.nn.utils.parametrize``)
    are carried over, shared. A layer held in several places becomes one synchronized
    layer in all of them. Every ``torch.nn.DataParallel`` in ``module`` (``module`` itself
    too) becomes a :class:`DataParallelWithCallback` of its converted inner module with the
    same ``device_ids``, ``output_device``, ``dim`` and training mode, as in vacancy's
    library: a plain DataParallel would never let its replicas meet. A subclass of
    ``torch.nn.DataParallel`` is kept instead (vacancy's replaced it, dropping what it
    adds), patched with :func:`patch_replication_callback`. A ``torch.nn.SyncBatchNorm``
    (which synchronizes across processes, not replicas) becomes
    :class:`SynchronizedBatchNormNd`.

    Args:
        module: the model, a single BatchNorm layer, or a DataParallel wrapper.

    Returns:
        The converted module: ``module`` itself modified in place, unless it is a
        BatchNorm layer (its twin is returned) or a ``torch.nn.DataParallel`` (a new
        :class:`DataParallelWithCallback` is returned; a subclass is patched and returned).
        Nothing is changed where a layer raises while it is converted.

    Examples::

        >>> m = torchvision.models.resnet18()
        >>> m = torch.nn.DataParallel(m)
        >>> m = convert_model(m)  # a DataParallelWithCallback with SyncBN inside
    """
    skipped: list[str] = []
    # the layers of a DataParallel given are named by their path in its module, as the
    # user's model names them
    inner = module.module if isinstance(module, nn.DataParallel) else module
    converted = replace_modules(inner, lambda current, path: _synchronized(current, path, skipped))
    for description in skipped:
        warnings.warn(
            f"convert_model left {description}; it keeps per-replica statistics",
            stacklevel=2,
        )
    if isinstance(module, nn.DataParallel):
        return _with_callback(module, converted)
    return converted


def _with_callback(data_parallel: nn.DataParallel, module: nn.Module) -> nn.DataParallel:
    """A :class:`DataParallelWithCallback` of ``module`` with ``data_parallel``'s settings
    and training mode; or a subclass of ``torch.nn.DataParallel`` itself, holding
    ``module`` and patched (:func:`patch_replication_callback`), so that what the subclass
    adds (its own ``forward``, say) is kept."""
    if type(data_parallel) is not nn.DataParallel:
        data_parallel.module = module
        patch_replication_callback(data_parallel)
        return data_parallel
    wrapper = DataParallelWithCallback(
        module,
        device_ids=data_parallel.device_ids or None,
        output_device=getattr(data_parallel, "output_device", None),
        dim=getattr(data_parallel, "dim", 0),
    )
    wrapper.training = data_parallel.training  # (train() would set the module's too)
    return wrapper


def register_converters() -> None:
    """Teach :func:`syncbn.convert_sync_batchnorm` this module's layers: each converts to a
    :class:`syncbn.SyncBatchNorm` sharing its state (what moving a model written for
    vacancy's API to DistributedDataParallel needs), and reverts to its own class. syncbn
    calls this itself (its table of built-in converters) the first time a conversion meets
    one; calling it again changes nothing.

    Examples::

        >>> syncbn.data_parallel.register_converters()  # not needed: done on demand
    """
    register_converter(_SynchronizedBatchNorm, _to_sync, _to_plain)


#: where a SyncBatchNorm converted from one of this module's layers keeps that layer's
#: ``sync_timeout``, for the way back (revert_sync_batchnorm, convert_model)
_SYNC_TIMEOUT_KEPT = "_data_parallel_sync_timeout"


def _to_sync(layer: _SynchronizedBatchNorm) -> SyncBatchNorm:
    twin = batchnorm_twin(layer, SyncBatchNorm)
    twin.__dict__[_SYNC_TIMEOUT_KEPT] = layer.sync_timeout  # not a torch.nn.Module attribute
    return twin


def _to_plain(layer: SyncBatchNorm) -> _SynchronizedBatchNorm:
    original = layer._original_class
    if original is None or not issubclass(original, _SynchronizedBatchNorm):
        raise TypeError(f"expected a layer converted from a SynchronizedBatchNorm, got {layer}")
    twin = batchnorm_twin(layer, original)
    twin.sync_timeout = _kept_sync_timeout(layer)
    return twin


def _kept_sync_timeout(layer: SyncBatchNorm) -> float | None:
    """The ``sync_timeout`` of the layer that ``layer`` was converted from, or the default."""
    kept = layer.__dict__.get(_SYNC_TIMEOUT_KEPT, DEFAULT_SYNC_TIMEOUT)
    return None if kept is None else float(kept)
