"""syncbn: synchronized batch normalization for PyTorch.

Batch statistics of the global batch (every rank of a process group) in training,
on any device and any ``torch.distributed`` backend, with one collective per layer
call in forward and one in backward.

The public names are imported on first access (module ``__getattr__``), so that
``import syncbn`` alone, as the ``syncbn`` command does before it parses its
arguments, does not import torch. ``from syncbn import SyncBatchNorm`` and
``syncbn.SyncBatchNorm`` work as with eager imports.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from syncbn import batchnorm as batchnorm
    from syncbn import convert as convert
    from syncbn import distributed as distributed
    from syncbn import functional as functional
    from syncbn import precise as precise
    from syncbn._masking import masking
    from syncbn.batchnorm import SyncBatchNorm, check_deferred
    from syncbn.convert import (
        BatchNormNd,
        convert_sync_batchnorm,
        register_converter,
        revert_sync_batchnorm,
    )
    from syncbn.distributed import create_process_group
    from syncbn.functional import sync_batch_norm
    from syncbn.precise import recompute_statistics

__version__ = "0.1.0"

__all__ = [
    "BatchNormNd",
    "SyncBatchNorm",
    "__version__",
    "check_deferred",
    "convert_sync_batchnorm",
    "create_process_group",
    "masking",
    "recompute_statistics",
    "register_converter",
    "revert_sync_batchnorm",
    "sync_batch_norm",
]

# public name -> the module that defines it
_EXPORTS = {
    "BatchNormNd": "syncbn.convert",
    "SyncBatchNorm": "syncbn.batchnorm",
    "check_deferred": "syncbn.batchnorm",
    "convert_sync_batchnorm": "syncbn.convert",
    "create_process_group": "syncbn.distributed",
    "masking": "syncbn._masking",
    "recompute_statistics": "syncbn.precise",
    "register_converter": "syncbn.convert",
    "revert_sync_batchnorm": "syncbn.convert",
    "sync_batch_norm": "syncbn.functional",
}
# the submodules an eager ``import syncbn`` used to make attributes of the package
_SUBMODULES = ("batchnorm", "convert", "data_parallel", "distributed", "functional", "precise")


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"syncbn.{name}")
    else:
        raise AttributeError(f"module 'syncbn' has no attribute '{name}'")
    globals()[name] = value  # later accesses skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS, *_SUBMODULES})
