"""One training step under torchrun + DDP or under ``accelerate launch``: the README's recipes.

``python _launched_train.py {ddp,accelerate} OUT``, started by a launcher with 2 processes
(test_integrations_launchers runs it). Rank r feeds ``SIZES[r]`` samples shifted by ``10 * r``
(uneven local batches whose statistics differ) to a model whose first layer is a
``BatchNorm1d`` with a cumulative average, converted with syncbn. After one step every rank
checks that the layer's running statistics are those of the global batch (the concatenation of
all ranks' inputs, gathered) and that the ranks' weights agree (DDP averaged the gradients),
and writes ``OUT/ok{RANK}``; any failure raises.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import syncbn

__all__ = ["SIZES", "main"]

SIZES = (3, 2)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.BatchNorm1d(3, momentum=None), nn.Linear(3, 1)).double()


def _local_batch(rank: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(rank)
    return torch.randn(SIZES[rank], 3, generator=gen, dtype=torch.float64) + 10.0 * rank


def _with_ddp(x: torch.Tensor) -> nn.Module:
    dist.init_process_group("gloo")  # torchrun sets the environment
    model = _model()
    model = syncbn.convert_sync_batchnorm(model)  # every BatchNorm*d -> syncbn.SyncBatchNorm
    model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = model(x).square().mean()
    loss.backward()
    optimizer.step()
    return model.module


def _with_accelerate(x: torch.Tensor) -> nn.Module:
    from accelerate import Accelerator

    # joins the process group that accelerate launch set up; without cpu=True on a machine
    # without GPUs, accelerate runs each process alone (no DDP, gradients never averaged)
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    model = _model()
    model = syncbn.convert_sync_batchnorm(model)  # before prepare, which wraps it in DDP
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    assert isinstance(model, torch.nn.parallel.DistributedDataParallel), type(model)
    loss = model(x).square().mean()
    accelerator.backward(loss)
    optimizer.step()
    return accelerator.unwrap_model(model)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("launcher", choices=["ddp", "accelerate"])
    parser.add_argument("out")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    x = _local_batch(rank)
    model = _with_ddp(x) if args.launcher == "ddp" else _with_accelerate(x)
    assert dist.get_world_size() == len(SIZES), dist.get_world_size()
    batches: list[torch.Tensor | None] = [None] * len(SIZES)
    dist.all_gather_object(batches, x)
    global_batch = torch.cat([b for b in batches if b is not None])
    layer = model.get_submodule("0")
    assert type(layer) is syncbn.SyncBatchNorm, type(layer)
    state = layer.state_dict()
    torch.testing.assert_close(state["running_mean"], global_batch.mean(0))
    torch.testing.assert_close(state["running_var"], global_batch.var(0))
    assert not torch.allclose(state["running_mean"], x.mean(0), atol=1.0)  # not local ones
    # DDP averaged the gradients: every rank took the same step (the statistics alone do
    # not tell: syncbn synchronizes them over the process group, DDP or not)
    linear = model.get_submodule("1")
    assert isinstance(linear, nn.Linear), type(linear)
    weights: list[torch.Tensor | None] = [None] * len(SIZES)
    dist.all_gather_object(weights, linear.weight.detach())
    first = weights[0]
    assert first is not None
    for weight in weights[1:]:
        assert weight is not None and torch.equal(weight, first), weights
    (Path(args.out) / f"ok{rank}").write_text("ok")
    # gloo's worker threads release a finished collective's tensors after the collective
    # returns, taking the GIL: a rank that exits at once can be finalizing Python by then, and
    # aborts ("terminate called without an active exception"; seen once in CI, and in ~1 run
    # of 6 of examples/masked_sequences.py before it had a barrier). The barrier waits with
    # the GIL released, so that they are done first.
    dist.barrier()
    # torch < 2.8 can deadlock in this teardown (gloo, pytorch/pytorch#154976): leaving
    # through os._exit below needs none
    if torch.torch_version.TorchVersion(torch.__version__) >= "2.8":
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    status = main(sys.argv[1:])
    # the barrier above narrows that race but does not close it: the barrier's own work is
    # released by gloo's thread too (the abort hit test_accelerate_launch_recipe once more in
    # CI on 2026-11-25, 1 run in ~15). Everything this rank had to do is done and checked,
    # so it leaves without finalizing Python, which no thread can then race
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
