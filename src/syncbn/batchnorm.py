"""SyncBatchNorm: the module users put in their models."""

from __future__ import annotations

import copy
import warnings
from contextlib import nullcontext
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from syncbn import _compiled, _composite, _conversion, _masking, _protocol, distributed
from syncbn._autograd import (
    LocalReducer,
    collective_device,
    first_given,
    input_problem,
    is_recomputing,
    join_with_error,
    sync_batch_norm_train,
)
from syncbn._layer_identity import LayerIdentity

__all__ = ["SyncBatchNorm", "check_deferred", "reset_without_bias"]


def _data_parallel_replica_error() -> RuntimeError:
    """What a synchronized training call of a ``torch.nn.DataParallel`` replica raises,
    before any collective: the replicas of one process would each call the process
    group's collectives at once, from their own threads, and sum the wrong partners'
    statistics, or hang."""
    return RuntimeError(
        "SyncBatchNorm: this layer is a torch.nn.DataParallel replica (one of the copies "
        "that DataParallel runs in threads, one per device) and cannot synchronize over a "
        "process group: every replica would call the group's collectives at once. Use "
        "DistributedDataParallel with one process per device, or, to synchronize "
        "DataParallel's replicas, syncbn.data_parallel's layers "
        "(syncbn.data_parallel.convert_model(model))"
    )


def _warn_unsynchronized_replica() -> None:
    """Warns, once per process (Python's default filter), that a ``torch.nn.DataParallel``
    replica trains without a group of several ranks: each replica then normalizes its own
    device's slice with that slice's statistics (as ``torch.nn.SyncBatchNorm`` does), which
    is rarely what a model converted to SyncBatchNorm wants."""
    warnings.warn(
        "SyncBatchNorm: this layer is a torch.nn.DataParallel replica, and there is no "
        "process group of several ranks: each replica normalizes its own device's slice "
        "with that slice's statistics, not the whole batch's. To synchronize DataParallel's "
        "replicas, use syncbn.data_parallel.convert_model(model) (on the model, not a "
        "replica); or DistributedDataParallel with one process per device",
        UserWarning,
        stacklevel=2,
    )


def check_deferred() -> None:
    r"""Raise the first problem that deferred checks found, waiting for those in flight.

    With deferred checks (``check_mode="deferred"``, and ``"auto"`` on accelerators) a
    synchronized call's problem (another rank's error, layers called in another order, a
    global count of one) is raised at this process's next synchronized call. The last
    calls of a run have no next call: call this after the final step (before saving a
    checkpoint or evaluating, say), and a problem of their collectives is raised instead
    of lost. Every rank of the collective received the same flags, so every rank raises,
    except one whose own call failed and raised at once (and one that skipped the
    collective: a backward run on the other ranks only, which wait for it).

    It waits for the pending checks' headers (on a GPU, for the device to reach them) and
    forgets the checks it inspected; with immediate checks nothing is pending and it
    returns at once. Inside a CUDA graph capture it does nothing (the checks run after
    the capture), nor under ``FakeTensorMode`` (a fake call records no check, and the real
    calls' checks wait for a real call). Checks of a process group destroyed since are
    dropped unread.

    Raises:
        RuntimeError, ValueError: the problem, its message starting with
            ``"(deferred check)"`` and naming the layer, its call and direction.

    Examples::

        >>> for x, y in loader:  # layers with deferred checks, on every rank
        ...     loss_fn(model(x), y).backward()
        ...     optimizer.step()
        ...     optimizer.zero_grad()
        >>> syncbn.check_deferred()  # the last step's backward checks, too
        >>> torch.save(model.state_dict(), "checkpoint.pt")
    """
    _protocol.raise_deferred(wait=True)


def reset_without_bias(layer: _BatchNorm) -> bool:
    """Reset the parameters of a layer built with ``bias=False``: running statistics, and a
    weight of ones. torch < 2.13 does not know ``bias=False``, and its reset zeroes the
    bias. Returns whether it did (``False``, and nothing done, for any other layer)."""
    if not (layer.affine and layer.bias is None):
        return False
    layer.reset_running_stats()
    torch.nn.init.ones_(layer.weight)
    return True


class SyncBatchNorm(LayerIdentity, _BatchNorm):
    r"""Batch normalization over the global batch of all ranks of a process group.

    Applies Batch Normalization over an :math:`(N, C, *)` input, like
    :class:`torch.nn.BatchNorm1d`/``2d``/``3d``:

    .. math::
        y = \frac{x - \mathrm{E}[x]}{\sqrt{\mathrm{Var}[x] + \epsilon}} * \gamma + \beta

    In training, with a process group of more than one rank, the mean and the
    (biased) variance are computed per channel over the *global* batch: the
    concatenation of every rank's local batch. Local batch sizes may differ between
    ranks and may be 0 on some of them. Outputs, input gradients and running
    statistics then equal those of ``torch.nn.BatchNorm*`` run in one process on the
    global batch; weight and bias gradients are each rank's share, and sum over
    ranks (as DistributedDataParallel does) to the single-process gradients.
    ``running_var`` is updated with the unbiased global variance, and
    ``momentum=None`` gives a cumulative moving average, as in torch.

    Each training call costs one ``all_reduce`` of ``2 * C + 5`` float64 values in
    forward and one of as many in backward, whatever the world size, on any
    device and any backend that supports ``all_reduce`` (gloo on CPU, nccl on CUDA).

    .. note::
        Statistics are synchronized only in training mode. In eval mode the layer
        never communicates: it uses the running statistics, or with
        ``track_running_stats=False`` the local batch's statistics. Without an
        initialized process group, or with a group of one rank, it is exactly
        :class:`torch.nn.BatchNorm2d` (for any input rank).

    .. note::
        Every rank of the process group must call every SyncBatchNorm layer the same
        number of times, in the same order, in forward and in backward. A rank with
        nothing to process still calls the layer with an empty batch. When ranks
        reach different layers, each rank raises a ``RuntimeError`` naming its layer
        (set ``check_layer_order = False`` to skip the check).

    Args:
        num_features: number of channels :math:`C` of an :math:`(N, C, *)` input.
        eps: value added to the variance for numerical stability. Default: 1e-5
        momentum: factor of the running statistics update, or ``None`` for a
            cumulative moving average. Default: 0.1
        affine: learnable per-channel scale and shift. Default: ``True``
        track_running_stats: keep running mean and variance for eval mode.
            Default: ``True``
        process_group: ranks to synchronize over; the default group if ``None``.
            Default: ``None``
        device: device of the parameters and buffers. Default: ``None``
        dtype: dtype of the parameters and buffers. Default: ``None``
        bias: with ``affine``, learn the shift :math:`\beta` too (``False``: a scale
            only, as torch >= 2.13's ``bias=False``). Default: ``True``

    Attributes:
        layer_name: the layer's module path, used in error messages and in the
            layer-order check; set by :func:`syncbn.convert_sync_batchnorm`.
        layer_identity: ``layer_name``, or for a layer built directly ``"#k"``, its
            construction order in the process (read-only).
        check_layer_order: verify after each collective that all ranks reached
            the same layer. Default: ``True``
        check_mode: when the checks carried by each collective (error flag, layer
            order, a global count of 1) run: ``"immediate"``, ``"deferred"`` (at a later
            call, without waiting for the device) or ``"auto"`` (immediate on CPU,
            deferred elsewhere). Default: ``"auto"``

    .. note::
        A synchronized training step reads nothing back from an accelerator (the global
        count and the running-statistics update stay on the device), so it can be captured
        in a CUDA graph, and ``torch.compile(model, fullgraph=True)`` traces the layer
        without a graph break. When every rank's batch is empty the output is empty, as in
        torch. (CUDA: run on an H200 on 2026-12-04, no host sync per layer call;
        docs/performance.md, "On a GPU".) With deferred checks, call
        :func:`syncbn.check_deferred` after the last step, so that a problem of its
        collectives is raised rather than lost. An unmasked layer that runs alone (no process
        group of more than one rank) in eager mode is torch's BatchNorm: with
        ``momentum=None`` it reads its batch counter back, as torch's does.

    Shape:
        - Input: :math:`(N, C, *)`, at least 2 dimensions, contiguous or channels_last.
        - Mask (optional, ``layer(input, mask)``): :math:`(N, *)` bool, True at valid
          positions, or broadcastable to it (see :meth:`forward`).
        - Output: :math:`(N, C, *)`, same shape and memory format as the input.

    Examples::

        >>> # after torch.distributed.init_process_group(...) on every rank
        >>> bn = syncbn.SyncBatchNorm(64)
        >>> x = torch.randn(2, 64, 28, 28)
        >>> y = bn(x)  # normalized with the statistics of all ranks' batches
        >>> # or convert an existing model
        >>> model = syncbn.convert_sync_batchnorm(torchvision.models.resnet50())
    """

    #: names the layer to the compiled ops (:func:`syncbn._compiled.site_tensor`)
    _site: torch.Tensor
    #: true on the copies that ``torch.nn.DataParallel`` runs (torch's replicate sets it on
    #: each); a class attribute, so that the check is a plain lookup, which dynamo traces
    #: on every torch (``self.__dict__`` broke the graph on torch 2.1)
    _is_replica: bool = False

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: dist.ProcessGroup | None = None,
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
        distributed.check_process_group(process_group)
        self.process_group = process_group
        self._init_identity()  # layer_name, layer_identity, check settings, call count
        self.last_input_dim: int | None = None
        # the class this layer replaced in convert_sync_batchnorm (revert gives it back)
        self._original_class: type[_BatchNorm] | None = None
        # tests and benchmarks only: synchronize through the process group even when it has
        # one rank (where the layer is otherwise plain BatchNorm), to measure the sync path
        self._sync_alone = False
        # the layer's site tensor (_site) and order token; without per-channel tensors, on
        # the device the layer is built for (a CPU site in a CUDA model made CUDA graphs
        # skip its compiled graphs)
        self._prepare_compiled_state(lambda: _compiled.device_built_for(device))

    def reset_parameters(self) -> None:
        if not reset_without_bias(self):
            super().reset_parameters()

    def _apply(self, fn: Any, *args: Any, **kwargs: Any) -> SyncBatchNorm:
        # .to(), .cuda(), .to_empty(): the compiled ops' state on the new device
        moved = super()._apply(fn, *args, **kwargs)
        # a layer without per-channel tensors: where fn moves a tensor
        self._prepare_compiled_state(lambda: fn(self._site).device)
        return moved

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        # load_state_dict(assign=True) replaces the tensors, maybe onto another device (a
        # layer built on the meta device)
        super()._load_from_state_dict(*args, **kwargs)
        self._prepare_compiled_state()

    def _prepare_compiled_state(
        self, device_without_tensors: Callable[[], torch.device] | None = None
    ) -> None:
        """Before dynamo first traces a call: on the device of the layer's per-channel
        tensors, the layer's site tensor (:func:`syncbn._compiled.site_tensor`, a new one
        if it is elsewhere) and the device's order token (:func:`syncbn._compiled.order_token`;
        a graph that created it would recompile). A layer without per-channel tensors keeps
        its site tensor on ``device_without_tensors()``, else where it is. Fake per-channel
        tensors get a fake site tensor, real ones a real one, also where a real layer's
        twin is built inside a ``FakeTensorMode`` (a real model converted there).
        """
        site = self.__dict__.get("_site")  # none yet in __init__ and __setstate__
        per_channel = first_given(self.weight, self.bias, self.running_mean, self.running_var)
        if per_channel is not None:
            device = per_channel.device
        elif device_without_tensors is not None:
            device = device_without_tensors()
        else:
            device = _compiled.device_built_for(None) if site is None else site.device
        real = per_channel is not None and not _protocol.is_fake(per_channel)
        # a real layer's state stays real where it is built inside a FakeTensorMode
        built = _protocol.real_tensors() if real and _protocol.faking() else nullcontext()
        with built:
            if site is None or site.device != device or (real and _protocol.is_fake(site)):
                key = None if site is None else _compiled.site_key(site)
                self._site = _compiled.site_tensor(self, device, key)
            if device.type != "meta" and _compiled.FULLGRAPH:
                _compiled.prepare_order_token(device)

    def __deepcopy__(self, memo: dict[int, Any]) -> SyncBatchNorm:
        """The default deep copy, except that the copy shares the process group.

        A process group cannot be copied (torch.nn.SyncBatchNorm's deep copy raises there);
        the copy synchronizes over the same ranks, as a copy of a model should. The state is
        ``torch.nn.Module``'s: a parametrized layer's class (``torch.nn.utils.parametrize``)
        refuses ``__getstate__``, which guards pickling, not copies.
        """
        if self.process_group is not None:
            memo[id(self.process_group)] = self.process_group
        copied = type(self).__new__(type(self))
        memo[id(self)] = copied
        module_state = getattr(torch.nn.Module, "__getstate__", None)  # (torch >= 2.1)
        state = dict(self.__dict__) if module_state is None else module_state(self)
        copied.__setstate__(copy.deepcopy(state, memo))
        return copied

    def __setstate__(self, state: dict[str, Any]) -> None:
        # copy.deepcopy and unpickling: a new object needs its own site tensor for the
        # compiled ops, on the device of the one it copies (the construction index is kept:
        # it is the same layer of the same model code)
        state = self._upgrade_identity_state(state)
        state.setdefault("_sync_alone", False)
        state.setdefault("_original_class", None)
        site = state.pop("_site", None)
        state.pop("_site_key", None)  # pickled before site tensors: an integer key
        super().__setstate__(state)
        # a new site tensor, where the copied layer's was
        self._prepare_compiled_state(None if site is None else lambda: site.device)

    def _check_input_dim(
        self, input: torch.Tensor, parameters: tuple[torch.Tensor | None, ...] | None = None
    ) -> None:
        """Raise what an invalid ``input`` deserves.

        Args:
            parameters: the layer's weight, bias and running statistics, where the caller
                has read them already (each read goes through ``torch.nn.Module.__getattr__``:
                a microsecond or so of host time per call saved on small layers).
        """
        if parameters is None:
            parameters = (self.weight, self.bias, self.running_mean, self.running_var)
        problem = input_problem(input, self.num_features, parameters=parameters)
        if problem is not None:
            raise problem

    def forward(self, input: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Normalize ``input``: in training with the statistics of the global batch (all
        ranks of the process group), in eval mode with the running statistics.

        Args:
            input: :math:`(N, C, *)`.
            mask: bool, True at valid positions, of the input's shape without the channel
                dimension (``(N, L)`` for ``(N, C, L)``) or broadcastable to it; or
                ``None`` (every position valid, or the mask of an enclosing
                :class:`syncbn.masking` block). With a mask the statistics are those of
                the valid positions of all ranks, and padded positions of the output (and
                of the input gradient) are zero. Default: ``None``

        Returns:
            The normalized input, of its shape and memory format.
        """
        traced = _compiled.leaf_call_when_fx_traced(self, input, mask=mask)
        if traced is not None:  # torch.fx.symbolic_trace: one node, like torch.nn's layers
            return traced  # type: ignore[no-any-return]
        compiling = _compiled.is_compiling()
        if mask is None:  # the mask of an enclosing syncbn.masking block, if any
            try:
                mask = _masking.layer_mask(self, input, compiling)
            except RuntimeError:
                self._join_forward_with_error(input, compiling)
                raise
        output = self._forward(input, mask, compiling)
        if not compiling:
            # the rank of an input the layer ran on (one it refused raised above: a revert
            # picked BatchNorm1d for a 4-D model after a refused 3-D call); a side effect
            # dynamo refuses inside checkpointing; a plain attribute, set past
            # torch.nn.Module.__setattr__ (microseconds per call, looking for a parameter,
            # buffer or module of that name)
            self.__dict__["last_input_dim"] = input.dim()
        return output

    def _forward(
        self, input: torch.Tensor, mask: torch.Tensor | None, compiling: bool
    ) -> torch.Tensor:
        """:meth:`forward` past the block's mask: eval, local or synchronized training."""
        if not self.training:
            return self._eval_forward(input, mask)
        synchronized = self._synchronizes()
        if self._is_replica:
            if synchronized:
                raise _data_parallel_replica_error()
            if not compiling:
                _warn_unsynchronized_replica()
        # compiled, a layer given a process group calls the synchronizing op even where the
        # group has one rank: the op finds the layer's group at run time, so a group of more
        # ranks assigned later is used (dynamo does not guard on which group a layer holds:
        # a graph traced on the local path stayed local, silently)
        by_op = synchronized or (compiling and self.process_group is not None)
        if not by_op and mask is None:
            return self._local_training_forward(input)
        tracking = self.track_running_stats
        running_mean = self.running_mean if tracking else None
        running_var = self.running_var if tracking else None
        num_batches_tracked = self.num_batches_tracked if tracking else None
        if not compiling:
            return _synchronized_train(
                self, input, mask, running_mean, running_var, num_batches_tracked
            )
        if not _compiled.FULLGRAPH:  # torch < 2.4: eager, across a graph break
            return _synchronized_train_outside_graph(
                self, input, mask, running_mean, running_var, num_batches_tracked
            )
        return _compiled.sync_batch_norm_train(
            input,
            self.weight,
            self.bias,
            mask,
            running_mean,
            running_var,
            num_batches_tracked,
            num_features=self.num_features,
            eps=self.eps,
            momentum=self.momentum,
            site=self._site,
            ordered=by_op,
        )

    def _synchronizes(self) -> bool:
        """Whether a training call takes the synchronized path: a process group of more
        than one rank, or the sync path forced for a group of one."""
        return distributed.get_world_size(self.process_group) > 1 or self._sync_alone

    def _join_forward_with_error(self, input: torch.Tensor, compiling: bool) -> None:
        """A synchronized training call that fails before it reaches its collective (its
        block's mask refused) joins the collective with the error flag, so that the other
        ranks raise too instead of waiting, as for an invalid input."""
        if compiling or not self.training or not self._synchronizes():
            return
        parameters = (self.weight, self.bias, self.running_mean, self.running_var)
        device = collective_device(input, *parameters)
        join_with_error(self.next_train_options(), "forward", device)

    def _eval_forward(self, input: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Eval never communicates: exactly torch's BatchNorm (padded positions zero)."""
        # each read of a parameter or buffer goes through torch.nn.Module.__getattr__: read
        # once (ten reads were ~2 of the ~4 µs a call added to BatchNorm's on the host)
        weight, bias = self.weight, self.bias
        running_mean, running_var = self.running_mean, self.running_var
        self._check_input_dim(input, (weight, bias, running_mean, running_var))
        problem = None if mask is None else _composite.mask_problem(mask, input)
        if problem is not None:
            raise problem
        if running_mean is None and running_var is None:
            # no running statistics: those of the local batch, as torch's layers do
            if mask is not None:
                if not _compiled.is_compiling():
                    # the eager training call of a process alone: its checks raise torch's
                    # error for a single valid position, as torch's layers do for one value
                    options = self._train_options(self._layer_info(None))
                    alone = options._replace(reducer=LocalReducer())
                    return sync_batch_norm_train(input, weight, bias, alone, mask=mask)
                # compiled: no check of the valid count (README)
                return _composite.batch_norm_train(
                    input, weight, bias, mask, _composite.keep_local, eps=self.eps
                )
            bn_training = True
        else:
            bn_training = False
        return _composite.batch_norm_valid(
            input,
            mask,
            running_mean,
            running_var,
            weight,
            bias,
            bn_training,
            0.0,
            self.eps,
        )

    def _local_training_forward(self, input: torch.Tensor) -> torch.Tensor:
        """Training without a group of several ranks: exactly torch's BatchNorm.

        Except that a forward recomputed by activation checkpointing updates no running
        statistics (torch's BatchNorm updates them twice). Under ``torch.compile`` the
        recomputation cannot be detected, and torch's own forward runs; or for a
        cumulative average (``momentum=None``), whose factor torch's forward reads on the
        host, the composite maths with the factor on the device.
        """
        if _compiled.is_compiling():
            counted = self.num_batches_tracked
            if self.momentum is not None or not self.track_running_stats or counted is None:
                return super().forward(input)
            self._check_input_dim(input)
            if input.numel() == input.shape[1]:  # torch's check, which its forward makes
                raise ValueError(
                    "Expected more than 1 value per channel when training, got input size "
                    f"{input.size()}"
                )
            return _composite.batch_norm_train(
                input,
                self.weight,
                self.bias,
                None,
                _composite.keep_local_cumulative(counted),
                eps=self.eps,
                running_mean=self.running_mean,
                running_var=self.running_var,
                num_batches_tracked=counted,
            )
        # each read of a parameter or buffer goes through torch.nn.Module.__getattr__: once
        weight, bias = self.weight, self.bias
        running_mean, running_var = self.running_mean, self.running_var
        self._check_input_dim(input, (weight, bias, running_mean, running_var))
        tracking = self.track_running_stats
        update = tracking and not is_recomputing()
        factor = 0.0 if self.momentum is None else self.momentum
        counted = self.num_batches_tracked
        if update and counted is not None:
            counted.add_(1)
            if self.momentum is None:
                factor = 1.0 / float(counted)
        # a recomputation passes the running statistics too, with a factor of 0 (they stay as
        # they are): non-reentrant checkpointing requires it to save what the forward saved.
        # A layer whose tracking was switched off after it was built passes none, as torch's
        # layers do: a factor of 0 would still write 0 * NaN into them
        return F.batch_norm(
            input,
            running_mean if tracking else None,
            running_var if tracking else None,
            weight,
            bias,
            True,
            factor if update else 0.0,
            self.eps,
        )

    @classmethod
    def convert_sync_batchnorm(
        cls, module: torch.nn.Module, process_group: dist.ProcessGroup | None = None
    ) -> torch.nn.Module:
        """Replace every BatchNorm layer of ``module`` with :class:`SyncBatchNorm`.

        An alias of :func:`syncbn.convert_sync_batchnorm`, for code written for
        ``torch.nn.SyncBatchNorm.convert_sync_batchnorm``. Like torch's, it builds
        :class:`SyncBatchNorm` layers whichever subclass it is called on.
        """
        return _conversion.convert_modules(module, SyncBatchNorm, process_group, None)


def _synchronized_train(
    layer: SyncBatchNorm,
    input: torch.Tensor,
    mask: torch.Tensor | None,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    num_batches_tracked: torch.Tensor | None,
) -> torch.Tensor:
    """A synchronized (or masked) training call of ``layer`` in eager mode."""
    return sync_batch_norm_train(
        input,
        layer.weight,
        layer.bias,
        layer.next_train_options(),
        running_mean=running_mean,
        running_var=running_var,
        num_batches_tracked=num_batches_tracked,
        mask=mask,
    )


#: the eager call that compiled code makes across a graph break on torch < 2.4
_synchronized_train_outside_graph = _compiled.outside_graph(_synchronized_train)
