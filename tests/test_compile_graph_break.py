"""torch.compile without custom ops (torch < 2.4): a synchronized call is a graph break.

There dynamo cannot put a synchronized call into its graph, so the layer and the functional
form call their eager path through ``syncbn._compiled.outside_graph`` (a graph break, as
torch's own SyncBatchNorm takes under ``torch.compile``). On a newer torch the scenarios
force that path by clearing ``syncbn._compiled.FULLGRAPH``; on torch < 2.4 it is the path.
Checked on 2 gloo ranks: compiled equals eager (outputs, gradients, running statistics)
with uneven and empty local batches, one graph break per synchronized call, and no error
logged by dynamo (traced into, the autograd Function made dynamo log an error per call).
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _harness import WorkerPool
from torch import nn

import syncbn
from syncbn import _compiled


class _Records(logging.Handler):
    def __init__(self, level: int) -> None:
        super().__init__(level)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextlib.contextmanager
def _without_custom_ops() -> Iterator[list[logging.LogRecord]]:
    """As on torch < 2.4; yields the records of errors that torch's loggers emit meanwhile."""
    torch._dynamo.reset()
    handler = _Records(logging.ERROR)
    # torch's loggers of these names do not propagate to their parents
    loggers = [logging.getLogger(name) for name in ("torch", "torch._dynamo", "torch._inductor")]
    for logger in loggers:
        logger.addHandler(handler)
    saved = _compiled.FULLGRAPH
    _compiled.FULLGRAPH = False
    try:
        yield handler.records
    finally:
        _compiled.FULLGRAPH = saved
        for logger in loggers:
            logger.removeHandler(handler)
        torch._dynamo.reset()


class _Net(nn.Module):
    """Straight-line code: dynamo resumes after each graph break (a loop, as in
    ``nn.Sequential``, makes it run the whole frame eagerly instead)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)
        self.conv2, self.bn2 = nn.Conv2d(4, 4, 3), nn.BatchNorm2d(4, momentum=None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn2(self.conv2(self.bn1(self.conv1(x)).relu())).tanh()


def _model() -> nn.Module:
    torch.manual_seed(0)
    return syncbn.convert_sync_batchnorm(_Net().double())


def _layers(rank: int, world_size: int) -> dict[str, Any]:
    sizes = [[3, 1], [0, 4], [5, 2]]  # uneven, then an empty rank
    with _without_custom_ops() as errors:
        eager = _model()
        compiled_model = copy.deepcopy(eager)
        compiled = torch.compile(compiled_model, backend="aot_eager")
        gen = torch.Generator().manual_seed(rank)
        steps: list[dict[str, list[torch.Tensor]]] = []
        for row in sizes:
            x = torch.randn(row[rank], 3, 8, 8, generator=gen, dtype=torch.float64)
            step: dict[str, list[torch.Tensor]] = {}
            for name, model, run in (
                ("eager", eager, eager),
                ("compiled", compiled_model, compiled),
            ):
                y = run(x)
                y.sin().sum().backward()
                grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
                step[name] = [y.detach(), *grads, *model.state_dict().values()]
                model.zero_grad()
            steps.append(step)
        explanation = torch._dynamo.explain(_model())(torch.randn(2, 3, 8, 8).double())
    return {
        "steps": steps,
        "break_reasons": [str(reason.reason) for reason in explanation.break_reasons],
        "errors": [record.getMessage() for record in errors],
    }


def test_layers_run_eagerly_across_graph_breaks(pool2: WorkerPool) -> None:
    for result in pool2.run(_layers, timeout=240.0):
        assert result["errors"] == []
        # dynamo breaks the graph at the layers' eager calls and nowhere else
        assert result["break_reasons"]
        assert all("_synchronized_train" in reason for reason in result["break_reasons"])
        for step in result["steps"]:
            # the output, 8 gradients, 14 state tensors (running statistics included)
            assert len(step["eager"]) == len(step["compiled"]) == 1 + 8 + 14
            for eager, compiled in zip(step["eager"], step["compiled"]):
                torch.testing.assert_close(compiled, eager, rtol=1e-10, atol=1e-12)


def _functional(rank: int, world_size: int) -> dict[str, Any]:
    group = dist.new_group(list(range(world_size)))

    def step(x: torch.Tensor, mean: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
        return syncbn.functional.sync_batch_norm(
            x.cos(), mean, var, training=True, momentum=0.3, process_group=group
        ).exp()

    x = torch.randn(2 + rank, 3, 5, generator=torch.Generator().manual_seed(rank)).double()
    results: dict[str, Any] = {}
    with _without_custom_ops() as errors:
        for name, fn in (("eager", step), ("compiled", torch.compile(step, backend="aot_eager"))):
            mean, var = torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64)
            x_grad = x.clone().requires_grad_()
            y = fn(x_grad, mean, var)
            y.square().sum().backward()
            results[name] = [y.detach(), x_grad.grad, mean, var]
        explanation = torch._dynamo.explain(step)(
            x, torch.zeros(3).double(), torch.ones(3).double()
        )
    results["break_reasons"] = [str(reason.reason) for reason in explanation.break_reasons]
    results["errors"] = [record.getMessage() for record in errors]
    return results


@pytest.mark.timeout(120)
def test_the_functional_form_runs_eagerly_across_a_graph_break(pool2: WorkerPool) -> None:
    for result in pool2.run(_functional, timeout=90.0):
        assert result["errors"] == []
        reasons = result["break_reasons"]
        assert reasons
        # at the eager call; torch 2.1's dynamo breaks before it, at the call that takes the
        # process group (it cannot pass one to a function it inlines)
        assert all("_train" in reason or "ProcessGroup" in reason for reason in reasons), reasons
        for eager, compiled in zip(result["eager"], result["compiled"]):
            torch.testing.assert_close(compiled, eager, rtol=1e-10, atol=1e-12)
