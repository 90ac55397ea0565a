"""What the parent process of ``syncbn demo`` and its ranks share: the settings and the data.

Imported by both sides (``demo.py`` in the parent, ``demo_train.py`` in the ranks),
it imports neither of them, nor torch.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import numpy as np

__all__ = ["RUNS", "DemoConfig", "DemoData"]

#: Keys of the three runs, in the order they are trained.
RUNS = ("plain_ddp", "syncbn_ddp", "single_process")


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    """Settings of one demo, shared by every rank.

    ``fail_rank`` and ``fail_step`` are a testing hook, not exposed on the command
    line: when ``fail_rank`` is set, that rank raises at step ``fail_step`` of run (a).
    """

    nproc: int = 2
    batch_per_proc: int = 2
    steps: int = 300
    seed: int = 0
    lr: float = 0.05
    device: str = "cpu"
    dtype: str = "float64"
    evaluations: int = 20
    fail_rank: int | None = None
    fail_step: int = 1

    def __post_init__(self) -> None:
        for name in ("nproc", "batch_per_proc", "steps", "evaluations"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got '{self.device}'")
        if self.dtype not in ("float64", "float32"):
            raise ValueError(f"dtype must be 'float64' or 'float32', got '{self.dtype}'")

    @property
    def global_batch(self) -> int:
        return self.nproc * self.batch_per_proc

    @property
    def log_every(self) -> int:
        """Steps between two evaluations of the curves."""
        return max(1, self.steps // self.evaluations)

    def label(self, run: str) -> str:
        """The run's name in the table and the plot."""
        n, b = self.nproc, self.batch_per_proc
        ranks = f"{n} rank{'s' if n > 1 else ''}"
        return {
            "plain_ddp": f"(a) BatchNorm, DDP {ranks} x {b}",
            "syncbn_ddp": f"(b) syncbn.SyncBatchNorm, DDP {ranks} x {b}",
            "single_process": f"(c) BatchNorm, 1 process x {n * b}",
        }[run]


class DemoData(NamedTuple):
    """Images of shape ``(n, 1, 8, 8)`` scaled to [0, 1] and labels 0-9, as numpy arrays."""

    train_x: np.ndarray
    train_y: np.ndarray
    test_x: np.ndarray
    test_y: np.ndarray
