"""The worker side of ``syncbn demo``: the model, the batches and the three training runs.

Each rank started by :mod:`syncbn._cli.launch` runs :func:`rank_main`: (a) the CNN
with plain BatchNorm under DistributedDataParallel (per-rank statistics), then (b) the
same CNN converted with :func:`syncbn.convert_sync_batchnorm` under DDP. Rank 0 then
runs (c), the plain CNN in one process on the whole global batch, compares the final
states of (a) and (b) with it, and returns everything (what ``results.json`` holds).

This module imports only torch and syncbn (no scikit-learn, matplotlib or tqdm at
import time), so that spawned ranks start fast.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import syncbn
from syncbn._cli.demo_config import RUNS, DemoConfig, DemoData

__all__ = ["DemoNet", "global_batches", "rank_main"]


class DemoNet(nn.Sequential):
    """A small CNN for 8x8 digits with three BatchNorm2d layers."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__(
            nn.Conv2d(1, 8, 3, padding=1, bias=False),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.Conv2d(8, 16, 3, padding=1, bias=False),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1, bias=False),
            nn.BatchNorm2d(32),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(32, num_classes),
        )


def global_batches(
    num_samples: int, global_batch: int, steps: int, seed: int
) -> Iterator[torch.Tensor]:
    """Yield ``steps`` index tensors of ``global_batch`` training samples each.

    Epochs are reshuffled from one generator seeded with ``seed``, and an epoch's last
    incomplete batch is dropped, so every rank (and the single-process run) draws the
    same sequence of global batches.
    """
    generator = torch.Generator().manual_seed(seed)
    per_epoch = num_samples // global_batch
    step = 0
    while True:
        order = torch.randperm(num_samples, generator=generator)
        for start in range(0, per_epoch * global_batch, global_batch):
            if step == steps:
                return
            yield order[start : start + global_batch]
            step += 1


class _Tensors(NamedTuple):
    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor


@torch.no_grad()
def _accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Accuracy of ``model`` in eval mode (running statistics, no communication)."""
    model.eval()
    predictions = model(x).argmax(dim=1)
    model.train()
    return (predictions == y).double().mean().item()


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _train(
    run: str, config: DemoConfig, rank: int, tensors: _Tensors, device: torch.device
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Train one run; return its record (meaningful on rank 0) and its final state."""
    distributed = run != "single_process"
    world_size = config.nproc if distributed else 1
    local_batch = config.batch_per_proc if distributed else config.global_batch
    first = rank * local_batch if distributed else 0

    torch.manual_seed(config.seed)  # the same initial weights for every run
    model: nn.Module = DemoNet().to(device=device, dtype=getattr(torch, config.dtype))
    if run == "syncbn_ddp":
        model = syncbn.convert_sync_batchnorm(model)
    net: nn.Module = model
    if distributed:
        net = DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(net.parameters(), lr=config.lr, momentum=0.9)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=config.steps)

    report = rank == 0
    progress = None
    if report:
        from tqdm import tqdm

        # One writer per process: a thread lock, not tqdm's default multiprocessing lock,
        # whose semaphore would be reported as leaked when the parent stops this rank.
        tqdm.set_lock(threading.RLock())
        # disable=None: a bar on a terminal, nothing in logs and pipes
        progress = tqdm(total=config.steps, desc=config.label(run), unit="step", disable=None)
    curve: dict[str, list[float]] = {"step": [], "train_loss": [], "test_accuracy": []}
    seconds = 0.0
    # this rank's summed per-sample losses since the last evaluation, and how many steps
    window = torch.zeros((), dtype=torch.float64, device=device)
    window_steps = 0
    batches = global_batches(len(tensors.train_y), config.global_batch, config.steps, config.seed)
    for step, indices in enumerate(batches, start=1):
        if run == RUNS[0] and rank == config.fail_rank and step == config.fail_step:
            raise RuntimeError(f"injected failure on rank {rank} at step {step} (testing hook)")
        start = time.perf_counter()
        local = indices[first : first + local_batch].to(device)
        logits = net(tensors.train_x[local])
        # Sum of this rank's per-sample losses * world_size / global batch: DDP averages
        # the gradients over the ranks, which gives the mean gradient of the global batch.
        loss_sum = F.cross_entropy(logits, tensors.train_y[local], reduction="sum")
        optimizer.zero_grad(set_to_none=True)
        (loss_sum * (world_size / config.global_batch)).backward()
        optimizer.step()
        schedule.step()
        _synchronize(device)
        seconds += time.perf_counter() - start
        window += loss_sum.detach()
        window_steps += 1
        if progress is not None:
            progress.update()
        if step % config.log_every == 0 or step == config.steps:
            if distributed:
                dist.all_reduce(window)  # every rank: the global batches' summed losses
            train_loss = window.item() / (window_steps * config.global_batch)
            window.zero_()
            window_steps = 0
            if report:
                test_accuracy = _accuracy(model, tensors.test_x, tensors.test_y)
                curve["step"].append(step)
                curve["train_loss"].append(train_loss)
                curve["test_accuracy"].append(test_accuracy)
                if progress is not None:
                    progress.set_postfix(loss=f"{train_loss:.3f}", acc=f"{test_accuracy:.3f}")
    if progress is not None:
        progress.close()
    record = {
        "label": config.label(run),
        "train_loss": curve["train_loss"][-1] if curve["train_loss"] else None,
        "test_accuracy": curve["test_accuracy"][-1] if curve["test_accuracy"] else None,
        "train_seconds": seconds,
        "curve": curve,
    }
    state = {name: value.detach().cpu().clone() for name, value in model.state_dict().items()}
    return record, state


def _max_abs_difference(
    state: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], parameters: set[str]
) -> dict[str, float]:
    """Largest elementwise |state - reference| over parameters, and over float buffers."""
    result = {"parameters": 0.0, "buffers": 0.0}
    for name, value in reference.items():
        if not value.is_floating_point():
            continue  # num_batches_tracked: the same step count in every run
        difference = (state[name] - value).abs().max().item()
        kind = "parameters" if name in parameters else "buffers"
        # a NaN (a run that diverged) wins: max(0.0, nan) is 0.0, which reads as exact
        if math.isnan(difference) or math.isnan(result[kind]):
            result[kind] = math.nan
        else:
            result[kind] = max(result[kind], difference)
    return result


def rank_main(
    rank: int, world_size: int, config: DemoConfig, data_path: str
) -> dict[str, Any] | None:
    """Train on one rank; return the demo's results on rank 0, ``None`` on the others.

    Runs in a rank started by :func:`syncbn._cli.launch.run_on_ranks` (default process
    group initialized, one thread). The data set is read from ``data_path`` (an
    ``.npz`` file of :class:`~syncbn._cli.demo_config.DemoData`).
    """
    with np.load(data_path) as arrays:
        data = DemoData(**{name: arrays[name] for name in DemoData._fields})
    dtype = getattr(torch, config.dtype)
    if config.device == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
    else:
        device = torch.device("cpu")
    tensors = _Tensors(
        torch.as_tensor(data.train_x, dtype=dtype, device=device),
        torch.as_tensor(data.train_y, dtype=torch.long, device=device),
        torch.as_tensor(data.test_x, dtype=dtype, device=device),
        torch.as_tensor(data.test_y, dtype=torch.long, device=device),
    )
    records: dict[str, dict[str, Any]] = {}
    states: dict[str, dict[str, torch.Tensor]] = {}
    for run in RUNS[:2]:
        records[run], states[run] = _train(run, config, rank, tensors, device)
    # The process group stays until the launcher tears it down, after this rank's report:
    # destroying it here could deadlock with gloo's worker threads on torch < 2.8 (README,
    # Troubleshooting; 3-4 demos in 16 hung on torch 2.3.1), and the launcher bounds that.
    if rank != 0:
        return None

    # (c) runs here, on rank 0 alone, after the other ranks are done: one process with one
    # thread, like each DDP rank, and no competition for the cores while it is timed (the
    # idle process group runs nothing).
    records["single_process"], reference = _train("single_process", config, 0, tensors, device)
    parameters = {name for name, _ in DemoNet().named_parameters()}
    for run in RUNS:
        records[run]["max_abs_diff_vs_single_process"] = _max_abs_difference(
            states.get(run, reference), reference, parameters
        )
    return {
        "config": dataclasses.asdict(config),
        "global_batch": config.global_batch,
        "train_size": len(data.train_y),
        "test_size": len(data.test_y),
        "torch_version": torch.__version__,
        "runs": records,
    }
