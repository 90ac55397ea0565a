"""syncbn: synchronized batch normalization for PyTorch.

Batch statistics of the global batch (every rank of a process group) in training,
on any device and any ``torch.distributed`` backend, with one collective per layer
call in forward and one in backward.
"""

from syncbn.batchnorm import SyncBatchNorm
from syncbn.convert import BatchNormNd, convert_sync_batchnorm, revert_sync_batchnorm
from syncbn.distributed import create_process_group
from syncbn.functional import sync_batch_norm
from syncbn.precise import recompute_statistics

__version__ = "0.1.0"

__all__ = [
    "BatchNormNd",
    "SyncBatchNorm",
    "__version__",
    "convert_sync_batchnorm",
    "create_process_group",
    "recompute_statistics",
    "revert_sync_batchnorm",
    "sync_batch_norm",
]
