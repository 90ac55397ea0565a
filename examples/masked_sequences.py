r"""Padded sequences: plain BatchNorm against masked syncbn.SyncBatchNorm, on 2 ranks.

A small Conformer-style convolution block (pointwise conv + GLU, depthwise conv,
BatchNorm1d, SiLU, pointwise conv, residual; a linear head on the masked mean over time)
classifies synthetic sequences of different lengths. Each rank pads its batch to the
length of its longest sequence and zeroes the padded steps before the depthwise conv, so
that padding does not leak into the valid steps. Three copies of the block start from the
same weights and see the same batches, in float64:

- **BatchNorm, padded**: the block after ``syncbn.convert_sync_batchnorm``, with its
  layer called *without* a mask: the global batch's statistics, padded steps included
  (what ``torch.nn.BatchNorm1d`` computes on the padded global batch);
- **syncbn, masked**: the same, with ``self.bn(h, mask)``: statistics of the valid steps of
  all ranks;
- **reference**: the unconverted block in one process (every rank runs it on its own) on
  all ranks' sequences *without padding*: the convolutions run on each sequence alone, and
  ``torch.nn.BatchNorm1d`` normalizes the valid steps of all of them, concatenated.

It prints how far the padded BatchNorm drifts from the statistics of the valid steps,
and that the masked layer equals the reference to rounding. Launch with torchrun::

    torchrun --standalone --nproc_per_node=2 examples/masked_sequences.py

Only torch and syncbn are needed; the data is generated from ``--seed``.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import math
import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import syncbn

__all__ = [
    "Batch",
    "ConvBlock",
    "Results",
    "main",
    "make_batch",
    "pad",
    "parse_args",
    "reference_forward",
    "report",
    "run",
]

#: torch < 2.8 can deadlock in ``destroy_process_group`` with gloo: the group's destructor
#: waits for gloo's worker threads while holding the GIL, which one of them needs to release
#: a finished collective's tensors (pytorch/pytorch#154976). Run as a script, it leaves
#: through ``os._exit``, which needs no teardown, so :func:`main` skips that call there.
TEARDOWN_CAN_HANG = torch.torch_version.TorchVersion(torch.__version__) < "2.8"

NUM_CLASSES = 4
DTYPE = torch.float64  # so that the masked layer's parity with the reference is unmistakable


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="training steps (default 40)")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per rank (default 8)")
    parser.add_argument("--channels", type=int, default=16, help="channels (default 16)")
    parser.add_argument("--kernel-size", type=int, default=15, help="depthwise kernel (default 15)")
    parser.add_argument("--min-length", type=int, default=8, help="shortest sequence (default 8)")
    parser.add_argument("--max-length", type=int, default=96, help="longest sequence (default 96)")
    parser.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (default 0.05)")
    parser.add_argument("--eval-batches", type=int, default=4, help="held-out batches (default 4)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the data and the weights")
    parser.add_argument(
        "--timeout", type=float, default=300.0, help="seconds a collective may wait"
    )
    args = parser.parse_args(argv)
    sizes = (args.steps, args.batch_size, args.channels, args.min_length, args.eval_batches)
    if min(sizes) < 1:
        parser.error("--steps, --batch-size, --channels, --min-length, --eval-batches must be >= 1")
    if args.max_length < args.min_length:
        parser.error("--max-length must be at least --min-length")
    if args.kernel_size < 1 or args.kernel_size % 2 == 0:
        parser.error("--kernel-size must be odd and positive")
    if not {"RANK", "WORLD_SIZE"} <= os.environ.keys():
        parser.error(
            "RANK and WORLD_SIZE are not set: launch this script with torchrun, e.g. "
            "torchrun --standalone --nproc_per_node=2 examples/masked_sequences.py"
        )
    return args


# ----------------------------------------------------------------------------- the model


class ConvBlock(nn.Module):
    """A Conformer-style convolution module with a classifier head, on ``(N, C, T)`` input.

    ``forward(x, mask)`` takes a padded batch and its ``(N, T)`` mask (True at valid steps).
    ``use_mask`` says whether the BatchNorm layer gets the mask (it must be a
    ``syncbn.SyncBatchNorm`` then, i.e. the block converted).
    """

    def __init__(self, channels: int, kernel_size: int, use_mask: bool = True) -> None:
        super().__init__()
        self.pointwise_in = nn.Conv1d(channels, 2 * channels, 1)
        self.depthwise = nn.Conv1d(
            channels, channels, kernel_size, padding=kernel_size // 2, groups=channels, bias=False
        )
        self.bn: nn.Module = nn.BatchNorm1d(channels)
        self.pointwise_out = nn.Conv1d(channels, channels, 1)
        self.head = nn.Linear(channels, NUM_CLASSES)
        self.use_mask = use_mask

    def pre_norm(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """The BatchNorm layer's input; padded steps are zeroed before the depthwise conv."""
        h = F.glu(self.pointwise_in(x), dim=1)
        if mask is not None:  # so that the conv sees zeros past each sequence's end
            h = h.masked_fill(~mask.unsqueeze(1), 0.0)
        return self.depthwise(h)

    def post_norm(self, x: torch.Tensor, normed: torch.Tensor) -> torch.Tensor:
        return x + self.pointwise_out(F.silu(normed))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns the block's output ``(N, C, T)`` and the logits ``(N, NUM_CLASSES)``."""
        h = self.pre_norm(x, mask)
        h = self.bn(h, mask) if self.use_mask else self.bn(h)
        y = self.post_norm(x, h)
        valid = mask.unsqueeze(1).to(y.dtype)
        pooled = (y * valid).sum(dim=2) / valid.sum(dim=2)  # the mean over valid steps
        return y, self.head(pooled)


def reference_forward(
    block: ConvBlock, sequences: Sequence[torch.Tensor]
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The unpadded reference: each ``(C, L_i)`` sequence alone, one BatchNorm over all steps.

    ``block.bn`` must be a ``torch.nn.BatchNorm1d``. It normalizes the steps of all sequences
    concatenated along time into one ``(1, C, M)`` batch, the same as an ``(M, C)`` one.
    Returns the outputs ``(C, L_i)`` and the logits ``(len(sequences), NUM_CLASSES)``.
    """
    pre = torch.cat([block.pre_norm(seq.unsqueeze(0)) for seq in sequences], dim=2)
    normed = block.bn(pre)
    lengths = [seq.shape[1] for seq in sequences]
    outputs = [
        block.post_norm(seq, part[0]) for seq, part in zip(sequences, normed.split(lengths, dim=2))
    ]
    logits = block.head(torch.stack([out.mean(dim=1) for out in outputs]))
    return outputs, logits


# ----------------------------------------------------------------------------- the data


@dataclass
class Batch:
    """A global batch: every rank's sequences, rank after rank."""

    sequences: list[torch.Tensor]  # (C, L_i)
    labels: torch.Tensor  # (world_size * batch_size,)

    def share(self, rank: int, world_size: int) -> tuple[list[torch.Tensor], torch.Tensor]:
        size = len(self.sequences) // world_size
        part = slice(rank * size, (rank + 1) * size)
        return self.sequences[part], self.labels[part]


def make_batch(args: argparse.Namespace, world_size: int, index: int) -> Batch:
    """Global batch ``index`` (training: 0, 1, ...; held out: negative), the same on every rank.

    A sequence of class k is a sine of frequency 0.25 (k + 1) and random phase, with a
    per-channel amplitude of class k, on an offset of 1, plus noise.
    """
    amplitudes = torch.randn(
        NUM_CLASSES, args.channels, 1, generator=torch.Generator().manual_seed(args.seed)
    )
    generator = torch.Generator().manual_seed(1_000_003 * args.seed + index)
    count = world_size * args.batch_size
    labels = torch.randint(NUM_CLASSES, (count,), generator=generator)
    lengths = torch.randint(args.min_length, args.max_length + 1, (count,), generator=generator)
    sequences = []
    for label, length in zip(labels.tolist(), lengths.tolist()):
        phase = 2 * math.pi * torch.rand((), generator=generator)
        wave = torch.sin(0.25 * (label + 1) * torch.arange(length) + phase)
        noise = torch.randn(args.channels, length, generator=generator)
        sequences.append((1.0 + amplitudes[label] * wave + 0.5 * noise).to(DTYPE))
    return Batch(sequences, labels)


def pad(
    sequences: Sequence[torch.Tensor], length: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero-pad ``(C, L_i)`` sequences to ``(N, C, T)``; returns it and the ``(N, T)`` mask."""
    length = length or max(seq.shape[1] for seq in sequences)
    x = torch.zeros(len(sequences), sequences[0].shape[0], length, dtype=sequences[0].dtype)
    mask = torch.zeros(len(sequences), length, dtype=torch.bool)
    for i, seq in enumerate(sequences):
        x[i, :, : seq.shape[1]] = seq
        mask[i, : seq.shape[1]] = True
    return x, mask


# ----------------------------------------------------------------------------- helpers


def _all_reduce(values: list[float], op: dist.ReduceOp.RedOpType) -> list[float]:
    tensor = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(tensor, op=op)
    return tensor.tolist()


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item() if a.numel() else 0.0


@contextmanager
def _stats_restored(module: nn.Module) -> Iterator[None]:
    """Train-mode calls inside leave the running statistics as they were."""
    saved = copy.deepcopy(module.state_dict())
    try:
        yield
    finally:
        module.load_state_dict(saved)


def _converted(block: ConvBlock) -> ConvBlock:
    """A copy of ``block`` whose BatchNorm1d is a ``syncbn.SyncBatchNorm``."""
    return cast(ConvBlock, syncbn.convert_sync_batchnorm(copy.deepcopy(block)))


def _plain_copy(module: ConvBlock, args: argparse.Namespace) -> ConvBlock:
    """An unconverted block (torch.nn.BatchNorm1d) with the weights and statistics of ``module``."""
    block = ConvBlock(args.channels, args.kernel_size, use_mask=False).to(DTYPE)
    block.load_state_dict(module.state_dict())  # the same state_dict keys after conversion
    return block


class _Parity:
    """Largest |masked - reference| and largest |reference| per quantity, over all steps."""

    def __init__(self) -> None:
        self.diff: dict[str, float] = {}
        self.scale: dict[str, float] = {}

    def add(self, name: str, got: torch.Tensor, expected: torch.Tensor) -> None:
        self.diff[name] = max(self.diff.get(name, 0.0), _max_abs(got, expected))
        scale = expected.abs().max().item() if expected.numel() else 0.0
        self.scale[name] = max(self.scale.get(name, 0.0), scale)

    def reduced(self) -> dict[str, tuple[float, float]]:
        """``{quantity: (max |diff|, max |value|)}`` over all ranks."""
        names = list(self.diff)
        diffs = _all_reduce([self.diff[n] for n in names], dist.ReduceOp.MAX)
        scales = _all_reduce([self.scale[n] for n in names], dist.ReduceOp.MAX)
        return {name: (d, s) for name, d, s in zip(names, diffs, scales)}


@dataclass
class Results:
    """What the tables print; the same on every rank."""

    padded_fraction: float  # of the steps of the training batches
    losses: tuple[float, float]  # the reference's loss at the first and the last step
    #: (a): quantity -> (BatchNorm padded, syncbn masked)
    padding: dict[str, tuple[float, float]]
    #: (b): quantity -> (max |masked - reference|, max |reference|)
    parity: dict[str, tuple[float, float]]


# ----------------------------------------------------------------------------- the run


def run(args: argparse.Namespace, rank: int, world_size: int) -> Results:
    """Train the three blocks in lockstep and measure them."""
    torch.manual_seed(args.seed)
    initial = ConvBlock(args.channels, args.kernel_size).to(DTYPE)
    reference = copy.deepcopy(initial)
    reference.use_mask = False  # its torch.nn.BatchNorm1d sees only valid steps anyway
    models = {"padded": _converted(initial), "masked": _converted(initial)}
    models["padded"].use_mask = False
    ddp = {name: DistributedDataParallel(model) for name, model in models.items()}
    for wrapper in ddp.values():
        wrapper.broadcast_buffers = False  # SyncBatchNorm keeps them equal on every rank
    optimizers = [
        torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
        for model in [*models.values(), reference]
    ]
    # decaying to 0 lets the running statistics catch up with the last weights
    schedules = [torch.optim.lr_scheduler.CosineAnnealingLR(o, args.steps) for o in optimizers]
    # The statistics of the valid steps for the padded block: a BatchNorm1d without weights
    # fed that block's BatchNorm input at the valid steps of all ranks, unpadded.
    valid_stats = nn.BatchNorm1d(args.channels, affine=False).to(DTYPE)
    parity = _Parity()
    reference_losses = []
    padded_fraction = 0.0
    mine = slice(rank * args.batch_size, (rank + 1) * args.batch_size)  # this rank's share

    for step in range(args.steps):
        batch = make_batch(args, world_size, step)
        sequences, labels = batch.share(rank, world_size)
        x, mask = pad(sequences)
        padded_fraction += 1 - mask.double().mean().item()
        for optimizer in optimizers:
            optimizer.zero_grad(set_to_none=True)
        outputs = {}
        for name, wrapper in ddp.items():
            outputs[name] = wrapper(x, mask)
            F.cross_entropy(outputs[name][1], labels).backward()  # DDP averages over ranks
        ref_outputs, ref_logits = reference_forward(reference, batch.sequences)
        loss = F.cross_entropy(ref_logits, batch.labels)  # the mean over the global batch
        loss.backward()
        reference_losses.append(loss.item())
        with torch.no_grad():
            pre = [models["padded"].pre_norm(seq.unsqueeze(0)) for seq in batch.sequences]
            valid_stats(torch.cat(pre, dim=2))

        # the masked block against the reference: outputs of this rank's sequences, gradients
        y, logits = (t.detach() for t in outputs["masked"])
        for i, out in enumerate(ref_outputs[mine]):
            parity.add("block output (valid steps)", y[i, :, : out.shape[1]], out)
        parity.add("logits", logits, ref_logits[mine])
        ref_params = dict(reference.named_parameters())
        for name, param in models["masked"].named_parameters():
            got, expected = param.grad, ref_params[name].grad
            assert got is not None and expected is not None
            parity.add("parameter gradients", got, expected)
        for optimizer, schedule in zip(optimizers, schedules):
            optimizer.step()
            schedule.step()
        for key in ("running_mean", "running_var"):
            parity.add(key, getattr(models["masked"].bn, key), getattr(reference.bn, key))
    ref_params = dict(reference.named_parameters())
    for name, param in models["masked"].named_parameters():
        parity.add("weights after training", param, ref_params[name])

    truths = {"padded": valid_stats, "masked": cast(nn.BatchNorm1d, reference.bn)}
    padding: dict[str, list[float]] = {
        "running_mean error (std units, max)": [],
        "running_var error (relative, max)": [],
    }
    for name, model in models.items():
        mean, var = (truths[name].get_buffer(key) for key in ("running_mean", "running_var"))
        got_mean, got_var = (model.bn.get_buffer(key) for key in ("running_mean", "running_var"))
        padding["running_mean error (std units, max)"].append(
            ((got_mean - mean).abs() / var.sqrt()).max().item()
        )
        padding["running_var error (relative, max)"].append((got_var / var - 1).abs().max().item())
    padding.update(_held_out(args, rank, world_size, models, truths))
    return Results(
        padded_fraction=padded_fraction / args.steps,
        losses=(reference_losses[0], reference_losses[-1]),
        padding={label: (values[0], values[1]) for label, values in padding.items()},
        parity=parity.reduced(),
    )


@torch.no_grad()
def _held_out(
    args: argparse.Namespace,
    rank: int,
    world_size: int,
    models: dict[str, ConvBlock],
    truths: dict[str, nn.BatchNorm1d],
) -> dict[str, list[float]]:
    """Each block's outputs on held-out batches against what they should be.

    Relative RMS over the valid steps of all ranks, ``rms(y - expected) / rms(expected)``,
    per block in the order of ``models``. ``truths[name]`` holds the running statistics of
    the valid steps for ``models[name]``.
    """
    labels = [
        "train output vs unpadded (rel. RMS)",
        "train output, padded 2x longer (rel. change)",
        "eval output vs valid statistics (rel. RMS)",
    ]
    sums = {name: [0.0] * (2 * len(labels)) for name in models}  # (error, scale) per label
    mine = slice(rank * args.batch_size, (rank + 1) * args.batch_size)
    for index in range(args.eval_batches):
        batch = make_batch(args, world_size, -1 - index)  # not a training batch
        sequences, _ = batch.share(rank, world_size)
        x, mask = pad(sequences)
        longer, longer_mask = pad(sequences, 2 * x.shape[2])
        valid = mask.unsqueeze(1).expand_as(x)
        for name, model in models.items():
            with _stats_restored(model):  # train mode, normalized with the batch's statistics
                y_train, _ = model(x, mask)
                y_longer, _ = model(longer, longer_mask)
            model.eval()
            y_eval, _ = model(x, mask)
            model.train()
            # the same block, unpadded: each sequence alone, BatchNorm1d over all valid steps
            plain = _plain_copy(model, args)
            unpadded, _ = reference_forward(plain, batch.sequences)
            y_unpadded, _ = pad(unpadded[mine], x.shape[2])
            # and in eval mode with the running statistics of the valid steps
            plain.bn.load_state_dict(truths[name].state_dict(), strict=False)
            y_eval_valid, _ = plain.eval()(x, mask)
            pairs = [
                (y_train, y_unpadded),
                (y_longer[:, :, : x.shape[2]], y_train),
                (y_eval, y_eval_valid),
            ]
            for i, (got, expected) in enumerate(pairs):
                sums[name][2 * i] += (got[valid] - expected[valid]).square().sum().item()
                sums[name][2 * i + 1] += expected[valid].square().sum().item()
    result: dict[str, list[float]] = {label: [] for label in labels}
    for name in models:
        totals = _all_reduce(sums[name], dist.ReduceOp.SUM)
        for i, label in enumerate(labels):
            result[label].append(math.sqrt(totals[2 * i] / totals[2 * i + 1]))
    return result


def report(args: argparse.Namespace, world_size: int, results: Results) -> str:
    """The tables rank 0 prints."""
    lines = [
        f"{world_size} ranks (gloo) x {args.batch_size} sequences of length {args.min_length}-"
        f"{args.max_length}, each rank padding to its longest ({100 * results.padded_fraction:.0f}"
        f" % of the steps are padding); {args.steps} steps, float64",
        "",
        f"{'(a) against the valid steps':<46}{'BatchNorm, padded':>19}{'syncbn, masked':>16}",
        "-" * 81,
    ]
    for label, (padded, masked) in results.padding.items():
        lines.append(f"{label:<46}{padded:>19.2e}{masked:>16.2e}")
    first, last = results.losses
    lines += [
        "",
        f"(b) syncbn, masked vs the unpadded one-process reference (loss {first:.3f} -> "
        f"{last:.3f})",
        f"{'quantity':<46}{'max |diff|':>19}{'max |value|':>16}",
        "-" * 81,
    ]
    for label, (diff, scale) in results.parity.items():
        lines.append(f"{label:<46}{diff:>19.1e}{scale:>16.1e}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method="env://", timeout=datetime.timedelta(seconds=args.timeout)
    )
    try:
        rank, world_size = dist.get_rank(), dist.get_world_size()
        results = run(args, rank, world_size)
        if rank == 0:
            print(report(args, world_size, results), flush=True)
        # gloo's worker threads release a finished collective's tensors after the
        # collective returns, and take the GIL to do it: a rank that exits right after its
        # last collective can be finalizing Python by then, and aborts ("terminate called
        # without an active exception", in ~1 run of 6 of this script on 2 CPU cores). The
        # barrier waits with the GIL released, so that they are done first.
        dist.barrier()
    finally:
        if not TEARDOWN_CAN_HANG:
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    status = main()
    # the barrier in main() narrows gloo's teardown race, it does not close it (its own
    # work is released by a gloo thread too; ~1 run in 20 still aborted on 2 CPU cores):
    # everything is written, so leave without finalizing Python, which nothing can race
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
