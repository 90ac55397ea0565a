r"""Train a small CNN with syncbn.SyncBatchNorm under DistributedDataParallel.

A torchrun-ready script to copy into your own project. It follows the usual recipe:
one process per device, ``init_process_group`` from the environment torchrun sets,
``syncbn.convert_sync_batchnorm``, DDP, a ``DistributedSampler`` with ``set_epoch``,
and logging from rank 0 only. It runs on CPU with gloo and on GPUs with nccl (chosen
automatically). The data is synthetic and generated from ``--seed``: no downloads.

One node, two processes::

    torchrun --standalone --nproc_per_node=2 examples/train_ddp.py

Two nodes (the same command on each; NODE0_ADDR is an address of node 0 that node 1
can reach, THIS_NODE_ADDR the address of the node that runs the command)::

    torchrun --nnodes=2 --nproc_per_node=2 \
        --rdzv_backend=c10d --rdzv_endpoint=NODE0_ADDR:29400 --rdzv_id=my-job \
        --local_addr=THIS_NODE_ADDR \
        examples/train_ddp.py

See examples/README.md for more (a two-node run simulated on one machine, network
interfaces, the options).
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import syncbn

__all__ = ["accuracy", "main", "make_datasets", "make_model", "parse_args", "train"]

#: torch < 2.8 can deadlock in ``destroy_process_group`` with gloo: the group's destructor
#: waits for gloo's worker threads while holding the GIL, which one of them needs to release
#: a finished collective's tensors (pytorch/pytorch#154976). Run as a script, it leaves
#: through ``os._exit``, which needs no teardown, so :func:`main` skips that call there.
TEARDOWN_CAN_HANG = torch.torch_version.TorchVersion(torch.__version__) < "2.8"

NUM_CLASSES = 4
IMAGE_SIZE = 16

log = logging.getLogger("train_ddp")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=3, help="passes over the data (default 3)")
    parser.add_argument("--steps", type=int, default=None, help="stop each epoch after N steps")
    parser.add_argument("--batch-size", type=int, default=16, help="per process (default 16)")
    parser.add_argument("--lr", type=float, default=0.1, help="peak SGD learning rate")
    parser.add_argument("--seed", type=int, default=0, help="seeds the data and the model")
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default=None,
        help="default: cuda if available, else cpu",
    )
    parser.add_argument("--backend", default=None, help="default: nccl on cuda, gloo on cpu")
    parser.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        help="seconds a collective may wait for the other ranks",
    )
    parser.add_argument(
        "--no-sync",
        action="store_true",
        help="keep plain BatchNorm (per-process statistics), to compare",
    )
    parser.add_argument(
        "--compile",
        nargs="?",
        const="inductor",
        default=None,
        metavar="BACKEND",
        help="torch.compile the model with BACKEND (default: inductor), then wrap it in DDP",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="write rank{RANK}.pt (BatchNorm running stats) and model.pt here",
    )
    args = parser.parse_args(argv)
    if args.epochs < 1 or args.batch_size < 1 or (args.steps is not None and args.steps < 1):
        parser.error("--epochs, --batch-size and --steps must be positive")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    if not {"RANK", "LOCAL_RANK", "WORLD_SIZE"} <= os.environ.keys():
        parser.error(
            "RANK, LOCAL_RANK and WORLD_SIZE are not set: launch this script with torchrun, "
            "e.g. torchrun --standalone --nproc_per_node=2 examples/train_ddp.py"
        )
    return args


def make_datasets(
    seed: int, train_size: int = 2048, test_size: int = 512
) -> tuple[TensorDataset, TensorDataset]:
    """Noisy images of NUM_CLASSES random patterns; the same on every rank for the same seed."""
    generator = torch.Generator().manual_seed(seed)
    patterns = torch.randn(NUM_CLASSES, 1, IMAGE_SIZE, IMAGE_SIZE, generator=generator)

    def sample(size: int) -> TensorDataset:
        labels = torch.randint(NUM_CLASSES, (size,), generator=generator)
        gain = 1 + torch.rand(size, 1, 1, 1, generator=generator)
        noise = 2 * torch.randn(size, 1, IMAGE_SIZE, IMAGE_SIZE, generator=generator)
        return TensorDataset(gain * patterns[labels] + noise, labels)

    return sample(train_size), sample(test_size)


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1, bias=False),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1, bias=False),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, NUM_CLASSES),
    )


@torch.no_grad()
def accuracy(model: nn.Module, dataset: TensorDataset, device: torch.device) -> float:
    model.eval()  # eval mode uses the running statistics and never communicates
    images, labels = (tensor.to(device) for tensor in dataset.tensors)
    return (model(images).argmax(dim=1) == labels).float().mean().item()


def choose_device(requested: str | None, local_rank: int, local_world_size: int) -> str:
    """``"cuda"`` (one GPU per local process) or ``"cpu"``; a clear exit where neither fits.

    Without ``--device``: cuda when every local process can have its own GPU, else cpu
    with one line saying why. ``--device cuda`` with fewer GPUs than local processes is a
    usage error naming the fix (nccl refuses two processes on one GPU).
    """
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if requested == "cpu" or (requested is None and gpus == 0):
        return "cpu"
    if gpus >= local_world_size and local_rank < gpus:
        return "cuda"
    if requested == "cuda":
        raise SystemExit(
            f"train_ddp.py: error: --device cuda needs one GPU per process, but this node runs "
            f"{local_world_size} processes and sees {gpus} GPU(s); pass --nproc_per_node={gpus} "
            "to torchrun, or --device cpu"
        )
    if local_rank == 0:
        print(
            f"train_ddp.py: {local_world_size} processes on this node but {gpus} GPU(s): "
            "training on CPU with gloo (pass --nproc_per_node to use the GPUs)",
            file=sys.stderr,
        )
    return "cpu"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    # torchrun sets these, plus MASTER_ADDR and MASTER_PORT for init_method="env://".
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])

    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank {rank}] %(message)s",
    )
    device_type = choose_device(args.device, local_rank, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    backend = args.backend or ("nccl" if device_type == "cuda" else "gloo")
    dist.init_process_group(
        backend,
        init_method="env://",
        timeout=datetime.timedelta(seconds=args.timeout),
    )
    try:
        train(args, rank, world_size, device)
        # gloo's worker threads release a finished collective's tensors after the
        # collective returns, and take the GIL to do it: a rank that exits right after its
        # last collective can be finalizing Python by then, and aborts ("terminate called
        # without an active exception"; ~1 run of 6 of examples/masked_sequences.py on 2
        # CPU cores, before it had this barrier). The barrier waits with the GIL released,
        # so that they are done first.
        dist.barrier()
    finally:
        if not TEARDOWN_CAN_HANG:
            dist.destroy_process_group()
    return 0


def train(args: argparse.Namespace, rank: int, world_size: int, device: torch.device) -> None:
    train_set, test_set = make_datasets(args.seed)
    torch.manual_seed(args.seed)  # the same initial weights everywhere (DDP also broadcasts them)
    model = make_model()
    if not args.no_sync:
        model = syncbn.convert_sync_batchnorm(model)
    model = model.to(device)
    # compiled inside DDP: this model's top module is an nn.Sequential, and dynamo starts no
    # frame in torch.nn's code, so torch.compile(ddp_model) would leave its layers eager
    trained = torch.compile(model, backend=args.compile) if args.compile else model
    ddp_model = DistributedDataParallel(
        trained, device_ids=[device.index] if device.type == "cuda" else None
    )
    # SyncBatchNorm keeps the running statistics identical on every rank by itself, so DDP
    # need not broadcast rank 0's buffers before every forward (with --no-sync, each rank
    # keeps its own). An attribute, because torch 2.13 renamed the constructor argument.
    ddp_model.broadcast_buffers = False

    # Each rank reads its own 1/world_size of the data; drop_last keeps every rank at
    # the same number of equal batches (every rank must call each BatchNorm layer alike).
    sampler: DistributedSampler[int] = DistributedSampler(train_set, shuffle=True, seed=args.seed)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    if len(loader) == 0:
        raise ValueError(
            f"--batch-size {args.batch_size} is larger than each rank's share of the data "
            f"({len(sampler)} samples)"
        )
    steps_per_epoch = min(len(loader), args.steps or len(loader))
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=args.lr, momentum=0.9)
    # decaying to 0 lets the running statistics catch up with the last weights
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, args.epochs * steps_per_epoch)
    norm = "plain BatchNorm (per-process statistics)" if args.no_sync else "syncbn.SyncBatchNorm"
    log.info(
        "%d processes on %s (%s), %s%s, batch %d per process = %d in all",
        world_size,
        device.type,
        dist.get_backend(),
        norm,
        f", compiled ({args.compile})" if args.compile else "",
        args.batch_size,
        args.batch_size * world_size,
    )

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # a new shuffle every epoch, the same split on every rank
        ddp_model.train()
        totals = torch.zeros(2, dtype=torch.float64, device=device)  # loss sum, samples
        for step, (images, labels) in enumerate(loader):
            if step == steps_per_epoch:
                break
            images, labels = images.to(device), labels.to(device)
            loss = F.cross_entropy(ddp_model(images), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
            totals[0] += loss.detach() * len(labels)
            totals[1] += len(labels)
        dist.all_reduce(totals)  # the loss over all ranks, for the log
        # on GPUs the layers' checks are deferred to later calls: raise what the epoch's
        # last calls found (nothing is pending on the CPU, where they run at once)
        syncbn.check_deferred()
        log.info("epoch %d: train loss %.4f", epoch + 1, (totals[0] / totals[1]).item())

    if rank == 0:  # rank 0's copy of the model (the others hold the same weights)
        log.info("test accuracy %.3f", accuracy(model, test_set, device))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        state = model.state_dict()  # same keys as with plain BatchNorm
        stats = {
            k: v.cpu() for k, v in state.items() if k.endswith(("running_mean", "running_var"))
        }
        torch.save(stats, args.out / f"rank{rank}.pt")
        if rank == 0:
            torch.save(state, args.out / "model.pt")
            log.info("wrote %s", args.out)


if __name__ == "__main__":
    status = main()
    # the barrier in main() narrows gloo's teardown race, it does not close it (its own
    # work is released by a gloo thread too; ~1 run in 20 still aborted on 2 CPU cores):
    # everything is written, so leave without finalizing Python, which nothing can race
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
