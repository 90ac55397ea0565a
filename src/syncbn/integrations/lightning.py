"""A Lightning plugin that synchronizes BatchNorm with syncbn, on CPUs as on GPUs.

Lightning's ``Trainer(sync_batchnorm=True)`` converts to ``torch.nn.SyncBatchNorm``, which
refuses CPU tensors. :class:`SyncBatchNormPlugin` converts to :class:`syncbn.SyncBatchNorm`
instead: any device, any backend (gloo on CPU), and every BatchNorm subclass that syncbn knows
(timm's ``BatchNormAct2d`` among them).

Importing this module imports ``lightning`` and registers nothing.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.nn import Module

try:
    from lightning.pytorch.plugins import LayerSync
except ImportError as error:  # pragma: no cover - only without lightning
    raise ImportError(
        "syncbn.integrations.lightning needs lightning; install it with: "
        "pip install 'syncbn[lightning]'"
    ) from error

from syncbn.convert import convert_sync_batchnorm, revert_sync_batchnorm

__all__ = ["SyncBatchNormPlugin"]


class SyncBatchNormPlugin(LayerSync):
    r"""Lightning ``LayerSync`` plugin: BatchNorm layers become :class:`syncbn.SyncBatchNorm`.

    The strategy (tested: ``"ddp"``, ``"ddp_spawn"``) calls :meth:`apply` on the
    ``LightningModule`` when fitting starts, after the process group exists, and
    :meth:`revert` when fitting ends, so converted layers leave ``Trainer.fit`` with the
    BatchNorm classes they came with. :meth:`revert` reverts every SyncBatchNorm layer,
    also one that the module itself built (as Lightning's own plugin does with
    ``torch.nn.SyncBatchNorm``). Use it instead of ``sync_batchnorm=True`` (Lightning
    refuses both at once). With one process it changes nothing that the layers compute.

    Args:
        process_group: ranks to synchronize over; the default group (looked up at each call)
            if ``None``. Default: ``None``
        check_layer_order: set each layer's ``check_layer_order``. Default: ``True``

    Examples::

        >>> from syncbn.integrations.lightning import SyncBatchNormPlugin
        >>> trainer = lightning.pytorch.Trainer(
        ...     accelerator="cpu", devices=2, strategy="ddp", plugins=[SyncBatchNormPlugin()]
        ... )
        >>> trainer.fit(model, train_dataloaders=loader)
    """

    def __init__(
        self, process_group: dist.ProcessGroup | None = None, check_layer_order: bool = True
    ) -> None:
        self.process_group = process_group
        self.check_layer_order = check_layer_order

    def apply(self, model: Module) -> Module:
        """Convert every BatchNorm layer of ``model`` (see :func:`syncbn.convert_sync_batchnorm`).

        Args:
            model: the ``LightningModule`` (or any module).

        Returns:
            ``model``, converted in place (a new layer if ``model`` is itself a BatchNorm).
        """
        return convert_sync_batchnorm(model, self.process_group, self.check_layer_order)

    def revert(self, model: Module) -> Module:
        """Undo :meth:`apply` (see :func:`syncbn.revert_sync_batchnorm`).

        Args:
            model: the ``LightningModule`` (or any module).

        Returns:
            ``model``, reverted in place (a new layer if ``model`` is itself a SyncBatchNorm).
        """
        return revert_sync_batchnorm(model)
