"""torch.compile(fullgraph=True) through SyncBatchNorm in training, on 2 and 3 gloo ranks.

Most scenarios compile with the ``aot_eager`` backend: it runs dynamo and AOTAutograd
(the tracing that graph breaks, fake kernels and the autograd formula of syncbn's custom
ops are about) without inductor's C++ code generation, which costs ~30 s per rank on
this 2-core machine. One scenario compiles with inductor, the default backend, for one
training step.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.utils.checkpoint
from _harness import WorkerPool, outcome
from torch import nn

import syncbn

pytestmark = pytest.mark.skipif(
    not hasattr(torch.library, "custom_op"), reason="fullgraph compile needs torch >= 2.4"
)


def _grads(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    grads = [(name, p.grad) for name, p in model.named_parameters()]
    assert all(g is not None for _, g in grads), "a parameter got no gradient"
    return [(name, g.clone()) for name, g in grads if g is not None]


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Conv2d(4, 4, 3),
        nn.BatchNorm2d(4, momentum=None),
        nn.Flatten(),
        nn.Linear(4 * 4 * 4, 2),
    ).double()
    return syncbn.convert_sync_batchnorm(model)


class _CountingBackend:
    """A ``torch.compile`` backend that counts the graphs it compiles (first compile included)."""

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self.compiles = 0

    def __call__(self, graph: torch.fx.GraphModule, inputs: list[Any]) -> Any:
        self.compiles += 1
        from torch._dynamo.backends.registry import lookup_backend

        return lookup_backend(self.backend)(graph, inputs)


def _local_sizes(rank: int, world_size: int) -> list[int]:
    """Per step: uneven local batches, an empty rank, then the sizes change again."""
    table = [[3, 1, 2], [0, 4, 2], [2, 2, 0], [5, 3, 1], [4, 0, 2]]
    return [row[rank] for row in table]


def _steps(
    model: nn.Module, rank: int, world_size: int, run: Any = None
) -> list[dict[str, torch.Tensor]]:
    """Train ``model`` (through ``run``, its compiled wrapper, if given) on this rank's steps."""
    run = model if run is None else run
    gen = torch.Generator().manual_seed(1000 + rank)
    records = []
    for size in _local_sizes(rank, world_size):
        x = torch.randn(size, 3, 8, 8, generator=gen, dtype=torch.float64)
        y = run(x)
        y.square().sum().backward()
        records.append({"output": y.detach().clone()} | {f"grad.{k}": g for k, g in _grads(model)})
        model.zero_grad()
    return records


def _compiled_vs_eager(rank: int, world_size: int, backend: str) -> dict[str, Any]:
    torch._dynamo.reset()
    eager = _model()
    compiled_model = copy.deepcopy(eager)
    counter = _CountingBackend(backend)
    compiled = torch.compile(compiled_model, fullgraph=True, backend=counter)
    result = {
        "eager": _steps(eager, rank, world_size),
        "compiled": _steps(compiled_model, rank, world_size, run=compiled),
        "eager_state": eager.state_dict(),
        "compiled_state": compiled_model.state_dict(),
        "compiles": counter.compiles,
    }
    explanation = torch._dynamo.explain(_model())(torch.randn(2, 3, 8, 8).double())
    result["explain"] = (explanation.graph_count, explanation.graph_break_count)
    return result


# world 2 through AOTAutograd (fake kernels, the autograd formula, the backward op); world 3
# through dynamo only, running the captured graph eagerly: a third of the time
@pytest.mark.parametrize("pool", [2, 3], ids=["world2-aot_eager", "world3-eager"], indirect=True)
@pytest.mark.timeout(300)  # the scenario's own bound plus the pool's start
def test_compiled_training_equals_eager(pool: WorkerPool) -> None:
    backend = "aot_eager" if pool.world_size == 2 else "eager"
    for result in pool.run(_compiled_vs_eager, backend, timeout=240.0):
        assert result["explain"] == (1, 0)  # one graph, no graph break
        for eager, compiled in zip(result["eager"], result["compiled"]):
            assert eager.keys() == compiled.keys()
            for key, value in eager.items():
                torch.testing.assert_close(compiled[key], value, rtol=1e-10, atol=1e-12)
        for key, value in result["eager_state"].items():
            torch.testing.assert_close(result["compiled_state"][key], value, rtol=0, atol=1e-12)
        # a first graph, one recompile for dynamic batch sizes, one for the empty batch (dynamo
        # specializes sizes 0 and 1); the other sizes reuse the dynamic graph
        assert result["compiles"] <= 3, result["compiles"]


def _inductor_vs_eager(rank: int, world_size: int) -> dict[str, Any]:
    torch._dynamo.reset()
    torch.manual_seed(0)
    # small, so that inductor's C++ compilation stays within seconds: one fused ReLU kernel
    # around the custom ops, forward and backward
    eager = syncbn.convert_sync_batchnorm(nn.Sequential(nn.BatchNorm2d(3), nn.ReLU()).double())
    compiled_model = copy.deepcopy(eager)
    # compile in this process: a pool of compile workers costs more to start than it saves here
    import torch._inductor.config as inductor_config

    inductor_config.compile_threads = 1
    compiled = torch.compile(compiled_model, fullgraph=True)  # inductor: generated C++ kernels
    x = torch.randn(3 + 2 * rank, 3, 4, 4, dtype=torch.float64)  # 3 and 5: uneven batches
    outputs = []
    for model, run in ((eager, eager), (compiled_model, compiled)):
        y = run(x)
        y.square().sum().backward()
        outputs.append({"output": y.detach()} | dict(_grads(model)) | model.state_dict())
    return {"eager": outputs[0], "compiled": outputs[1]}


@pytest.mark.timeout(300)  # the scenario's own bound plus the pool's start
def test_inductor_training_step_equals_eager(pool2: WorkerPool) -> None:
    """The default backend: inductor compiles the graph around syncbn's custom ops, which keep
    the strides their fake kernels promise (needs_exact_strides)."""
    for result in pool2.run(_inductor_vs_eager, timeout=240.0):
        eager, compiled = result["eager"], result["compiled"]
        assert eager.keys() == compiled.keys()
        for key, value in eager.items():
            torch.testing.assert_close(compiled[key], value, rtol=1e-10, atol=1e-12, msg=key)


def _with_explicit_group(rank: int, world_size: int) -> dict[str, Any]:
    torch._dynamo.reset()
    group = dist.new_group(list(range(world_size)))
    eager = _model()
    syncbn.convert_sync_batchnorm(eager, group)
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(compiled_model, fullgraph=True, backend="aot_eager")
    x = torch.randn(2 + rank, 3, 8, 8, dtype=torch.float64)
    outputs = [run(x) for run in (eager, compiled)]
    return {"outputs": outputs, "states": [eager.state_dict(), compiled_model.state_dict()]}


def test_a_layer_with_an_explicit_process_group_compiles(pool2: WorkerPool) -> None:
    """Before, dynamo could not evaluate the group's isinstance check against a tuple and
    raised 'process_group does not contain this rank' while tracing."""
    for result in pool2.run(_with_explicit_group, timeout=120.0):
        eager, compiled = result["outputs"]
        torch.testing.assert_close(compiled, eager, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(result["states"][1], result["states"][0], rtol=0, atol=1e-12)


class _CheckpointedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = _model()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)


def _checkpointed(rank: int, world_size: int) -> dict[str, Any]:
    torch._dynamo.reset()
    model = _CheckpointedBlock()
    reference = copy.deepcopy(model.block)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    x = torch.randn(3 + rank, 3, 8, 8, dtype=torch.float64)
    compiled(x).sum().backward()
    reference(x).sum().backward()  # eager, no checkpointing: one update per layer
    return {"compiled": model.block.state_dict(), "reference": reference.state_dict()}


@pytest.mark.timeout(180)  # the scenario's own bound plus the pool's start
def test_checkpointed_recomputation_updates_running_stats_once(pool2: WorkerPool) -> None:
    for result in pool2.run(_checkpointed, timeout=120.0):
        for key, value in result["reference"].items():
            torch.testing.assert_close(result["compiled"][key], value, rtol=1e-10, atol=1e-12)
        assert int(result["compiled"]["1.num_batches_tracked"]) == 1


def _errors_under_compile(rank: int, world_size: int) -> dict[str, tuple[str, str]]:
    torch._dynamo.reset()
    outcomes = {}
    bn = syncbn.SyncBatchNorm(3, dtype=torch.float64)
    compiled = torch.compile(bn, fullgraph=True, backend="aot_eager")
    good = torch.randn(4, 3, 5, dtype=torch.float64)
    bad = torch.randn(4, 3, 5, dtype=torch.float64) if rank else torch.randn(1, 3, 0).double()
    compiled(good)  # compiled once, together
    # rank 0's local batch holds no value: with the other ranks' it is still fine...
    outcomes["uneven"] = outcome(lambda: compiled(bad))
    # ...and one rank's invalid input (wrong channel count) raises on every rank
    wrong = torch.randn(4, 2 if rank == 0 else 3, 5, dtype=torch.float64)
    outcomes["invalid"] = outcome(lambda: compiled(wrong))
    # two compiled layers called in different orders
    first, second = syncbn.SyncBatchNorm(3).double(), syncbn.SyncBatchNorm(3).double()
    layers = [torch.compile(m, fullgraph=True, backend="aot_eager") for m in (first, second)]
    if rank == 1:
        layers.reverse()
    outcomes["order"] = outcome(lambda: layers[0](good))
    return outcomes


@pytest.mark.timeout(180)  # the scenario's own bound plus the pool's start
def test_errors_still_raise_on_every_rank_under_compile(pool2: WorkerPool) -> None:
    results = pool2.run(_errors_under_compile, timeout=120.0)
    for rank, outcomes in enumerate(results):
        assert outcomes["uneven"] == ("ok", "")
        kind, message = outcomes["invalid"]
        if rank == 0:
            assert kind == "ValueError" and "expected input with 3 channels" in message
        else:
            assert kind == "RuntimeError" and "1 other rank(s) failed" in message
        kind, message = outcomes["order"]
        assert kind == "RuntimeError" and "SyncBatchNorm layer mismatch in forward" in message
