"""What a synchronized layer tells its collectives about itself: identity, call count, settings.

The layer-order check compares a fingerprint of each layer across ranks, so every layer
needs an identity that is the same on every rank: its module path (``layer_name``, set by
:func:`syncbn.convert_sync_batchnorm`), or for a layer built directly its construction
order in the process. :class:`LayerIdentity` keeps that identity, the layer's check
settings and its count of synchronized calls, and turns them into the
:class:`~syncbn._autograd.TrainOptions` of each call (eager mode and the compiled ops
alike). :class:`syncbn.SyncBatchNorm` inherits it; nothing here normalizes anything.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch.distributed as dist

from syncbn._autograd import LayerInfo, TrainOptions, reducer_for
from syncbn._protocol import CHECK_MODES, register_layer

__all__ = ["LayerIdentity"]

#: numbers synchronized layers in construction order, per process: the identity of a layer
#: that has no module path (``layer_name``) in the layer-order check
_construction_order = itertools.count()


class LayerIdentity:
    """The identity and check settings of a synchronized layer (a mixin of SyncBatchNorm).

    The host class provides ``num_features``, ``eps``, ``momentum``, ``process_group`` and
    ``_sync_alone``, and calls :meth:`_init_identity` in its ``__init__`` and
    :meth:`_upgrade_identity_state` on a state it unpickles.
    """

    num_features: int
    eps: float
    momentum: float | None
    process_group: dist.ProcessGroup | None
    _sync_alone: bool
    _construction_index: int
    _layer_name: str
    _check_mode: str

    def _init_identity(self) -> None:
        self._construction_index = next(_construction_order)
        self.layer_name = ""
        self.check_layer_order = True
        self.check_mode = "auto"
        self._sync_calls = 0

    @staticmethod
    def _upgrade_identity_state(state: dict[str, Any]) -> dict[str, Any]:
        """A pickled layer's state with today's identity attributes (a new dict).

        The construction index is kept when present: it is the same layer of the same model
        code. A state without one (pickled by syncbn 0.1) gets the next in this process.
        """
        state = dict(state)
        if "layer_name" in state:  # pickled by syncbn 0.1, where it was a plain attribute
            state["_layer_name"] = state.pop("layer_name")
        state.setdefault("_layer_name", "")
        if "check_mode" in state:  # a plain attribute before it was validated
            state["_check_mode"] = state.pop("check_mode")
        state.setdefault("_check_mode", "auto")
        if "_construction_index" not in state:
            state["_construction_index"] = next(_construction_order)
        return state

    @property
    def check_mode(self) -> str:
        """When the checks carried by each collective run (see SyncBatchNorm's docstring)."""
        return self._check_mode

    @check_mode.setter
    def check_mode(self, mode: str) -> None:
        if mode not in CHECK_MODES:
            raise ValueError(f"check_mode must be one of {CHECK_MODES}, got {mode!r}")
        self._check_mode = mode

    @property
    def layer_name(self) -> str:
        """The layer's module path, set by :func:`syncbn.convert_sync_batchnorm` (or ``""``)."""
        return self._layer_name

    @layer_name.setter
    def layer_name(self, name: str) -> None:
        self._layer_name = name
        # known to this process from now on: a mismatch error can name it as the other side
        register_layer(self.layer_identity, self.num_features, self.eps, self.momentum)

    @property
    def layer_identity(self) -> str:
        """The name that identifies this layer in the layer-order check, the same on every rank.

        Its module path (``layer_name``, set by :func:`syncbn.convert_sync_batchnorm`), or for
        a layer built directly ``"#k"``: the k-th SyncBatchNorm constructed in this process.
        """
        return self.layer_name or f"#{self._construction_index}"

    def _layer_info(self, call_index: int | None) -> LayerInfo:
        return LayerInfo(
            self.layer_identity,
            self.num_features,
            call_index,
            self.check_layer_order,
            self.check_mode,
        )

    def _train_options(self, layer: LayerInfo) -> TrainOptions:
        reducer = reducer_for(self.process_group, force=self._sync_alone)
        return TrainOptions(reducer, layer, self.eps, self.momentum)

    def next_train_options(self) -> TrainOptions:
        """The options of this layer's next synchronized call; counts the call."""
        layer = self._layer_info(self._sync_calls)
        # a plain attribute: set past torch.nn.Module.__setattr__, which costs microseconds
        # per call looking for a parameter, buffer or module of that name
        self.__dict__["_sync_calls"] = self._sync_calls + 1
        return self._train_options(layer)

    def last_train_options(self) -> TrainOptions:
        """The options of this layer's calls, without a call index (for a compiled backward)."""
        return self._train_options(self._layer_info(None))
