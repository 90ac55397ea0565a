"""One Lightning training step on 2 CPU processes, run as a script by test_integrations_lightning.

``python _lightning_fit.py STRATEGY OUT [--no-plugin]``: fits a LightningModule with one
``BatchNorm1d`` for one step with ``Trainer(accelerator="cpu", devices=2, strategy=STRATEGY,
plugins=[SyncBatchNormPlugin()])``. Each rank writes what its layer held after the step to
``OUT/rank{R}.pt``; after ``fit`` each process that runs on (every rank with ``"ddp"``, which
launches this script again for rank 1; only the parent with ``"ddp_spawn"``) writes the layer's
class to ``OUT/after{R}.txt``. A script, not a test: ``"ddp"`` re-runs ``sys.argv``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from syncbn.integrations.lightning import SyncBatchNormPlugin

__all__ = ["BATCH_PER_RANK", "Net", "dataset", "main"]

BATCH_PER_RANK = 2


def dataset() -> TensorDataset:
    """8 samples of 3 features."""
    gen = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(8, 3, generator=gen, dtype=torch.float64))


class Net(L.LightningModule):
    """A BatchNorm1d with a cumulative average (after one step: the batch statistics)."""

    def __init__(self, out: str) -> None:
        super().__init__()
        self.out = Path(out)
        self.bn = nn.BatchNorm1d(3, momentum=None, dtype=torch.float64)
        self.head = nn.Linear(3, 1, dtype=torch.float64)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        # shifted by rank, so that local statistics (plain BatchNorm's) are far from global ones
        x = batch[0] + 10.0 * self.global_rank
        self.local_batch = x.detach().clone()
        return self.head(self.bn(x)).square().mean()

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        state = self.bn.state_dict()
        record = {
            "class": type(self.bn).__name__,
            "running_mean": state["running_mean"].clone(),
            "running_var": state["running_var"].clone(),
            "local_batch": self.local_batch,
        }
        torch.save(record, self.out / f"rank{self.global_rank}.pt")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("strategy", choices=["ddp", "ddp_spawn"])
    parser.add_argument("out")
    parser.add_argument("--no-plugin", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    model = Net(args.out)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=args.strategy,
        plugins=[] if args.no_plugin else [SyncBatchNormPlugin()],
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    loader = DataLoader(dataset(), batch_size=BATCH_PER_RANK, shuffle=False)
    trainer.fit(model, train_dataloaders=loader)
    (Path(args.out) / f"after{trainer.global_rank}.txt").write_text(type(model.bn).__name__)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
