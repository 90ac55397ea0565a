"""DDP training with SyncBatchNorm equals single-process training on the global batch."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, cast

import pytest
import torch
import torch._dynamo
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils.checkpoint
from _harness import WorkerPool
from torch import nn

import syncbn
from syncbn import _compiled

STEPS = 3


class Block(nn.Module):
    def __init__(self, channels: int, checkpointing: str) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(channels)
        self.checkpointing = checkpointing

    def _body(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn(self.conv(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointing == "none":
            return self._body(x)
        reentrant = self.checkpointing == "reentrant"
        return torch.utils.checkpoint.checkpoint(self._body, x, use_reentrant=reentrant)


def _model(checkpointing: str = "none") -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        Block(4, checkpointing),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4, 6),
        nn.BatchNorm1d(6, momentum=None),
        nn.Linear(6, 3),
    ).double()


def _data(
    sizes: tuple[int, ...], steps: int, micro: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    n = sum(sizes)
    return [
        (
            torch.randn(n, 3, 5, 5, generator=gen, dtype=torch.float64),
            torch.randint(0, 3, (n,), generator=gen),
        )
        for _ in range(steps * micro)
    ]


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _scaled_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, scale: float) -> torch.Tensor:
    return F.cross_entropy(model(x), y, reduction="sum") * scale


def _train_ddp(
    rank: int, world_size: int, sizes: tuple[int, ...], options: dict[str, Any]
) -> dict[str, Any]:
    device = torch.device(options.get("device", "cpu"))  # "cuda": tests/test_cuda.py
    model = syncbn.convert_sync_batchnorm(_model(options.get("checkpointing", "none")))
    model.to(device)
    if "compile" not in options:
        ddp = nn.parallel.DistributedDataParallel(model, **options.get("ddp", {}))
        return _train_steps(rank, world_size, sizes, options, model, ddp)
    with _compile_settings(options):
        return _train_compiled(rank, world_size, sizes, options, model)


def _train_steps(
    rank: int,
    world_size: int,
    sizes: tuple[int, ...],
    options: dict[str, Any],
    model: nn.Module,
    ddp: nn.parallel.DistributedDataParallel,
    backward: Any = None,
) -> dict[str, Any]:
    """``_train_ddp``'s steps of ``ddp`` (wrapping ``model``), each step's backward through
    ``backward(x, y, scale)`` where given (a compiled scenario's); ``model``'s state."""
    micro = options.get("micro", 1)
    device = next(model.parameters()).device
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    start, total = sum(sizes[:rank]), sum(sizes)
    batches = _data(sizes, STEPS, micro)
    for step in range(STEPS):
        optimizer.zero_grad()
        for index in range(micro):
            x, y = batches[step * micro + index]
            local = slice(start, start + sizes[rank])
            x, y = x[local].to(device), y[local].to(device)
            if options.get("compile") == "inductor":
                from test_compile import _batch_dynamic

                x = _batch_dynamic(x)  # the ranks of both world sizes share its graphs
            # DDP averages gradients over ranks: scale so the average is the global-batch mean
            if backward is not None:
                backward(x, y, world_size / total)
            elif index < micro - 1:
                with ddp.no_sync():
                    _scaled_loss(ddp, x, y, world_size / total).backward()
            else:
                _scaled_loss(ddp, x, y, world_size / total).backward()
        optimizer.step()
    return {key: value.cpu() for key, value in _state(model).items()}


class _Whole(nn.Module):
    """A model's own top-level module, as a user's model has one: dynamo starts no frame
    in torch.nn's code (an ``nn.Sequential`` at the top under ``torch.compile(ddp)`` runs
    eagerly, with each user-defined submodule compiled as a frame of its own), so this
    forward is what makes the whole model one graph, the one DDPOptimizer splits."""

    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


@contextlib.contextmanager
def _compile_settings(options: dict[str, Any]) -> Iterator[None]:
    """Dynamo's settings and DDP's first bucket size that ``options`` ask for, set only
    while the scenario builds, compiles and runs its model, so that the pool process's
    later scenarios find torch's defaults: compiled autograd with DDP's
    ``python_reducer`` (DDP picks its reducer when it is built, torch.compile reads
    compiled_autograd when it wraps a function, each call reads both), and the first
    bucket's size, which DDP and DDPOptimizer read when they are built."""
    first_bucket = dist._DEFAULT_FIRST_BUCKET_BYTES
    try:
        dist._DEFAULT_FIRST_BUCKET_BYTES = options.get("first_bucket_bytes", first_bucket)
        if not options.get("compiled_autograd"):
            yield
            return
        with torch._dynamo.config.patch(compiled_autograd=True, optimize_ddp="python_reducer"):
            yield
    finally:
        dist._DEFAULT_FIRST_BUCKET_BYTES = first_bucket


def _train_compiled(
    rank: int, world_size: int, sizes: tuple[int, ...], options: dict[str, Any], model: nn.Module
) -> dict[str, Any]:
    """``_train_ddp``'s steps compiled as torch documents it for DDP.

    ``options["compile"]`` names the ``torch.compile`` backend. By default the DDP wrapper
    is compiled (``torch.compile(ddp)``: dynamo's DDPOptimizer splits the model's graph at
    DDP's bucket boundaries, several with ``options["bucket_bytes"]``), and backward runs
    eagerly, DDP's reducer all_reducing each bucket as its gradients are ready, between
    syncbn's all_reduces on the same process group. With ``options["inside_ddp"]``, DDP
    wraps the compiled model instead, backward eager alike. With
    ``options["compiled_autograd"]``, the whole step is one compiled function whose
    backward compiled autograd traces, with DDP's ``python_reducer`` (its bucket
    all_reduces in the traced backward graph). The state gains ``"compiled graphs"``:
    the graphs the backend compiled, and the backward graphs compiled autograd captured.
    """
    from test_compile import _CountingBackend
    from torch._dynamo.utils import counters

    torch._dynamo.reset()  # no graphs of an earlier scenario in this pool process
    counters.clear()
    backend = _CountingBackend(options["compile"])
    whole = _Whole(model)
    inside = options.get("inside_ddp", False)  # DDP over the compiled model (Lightning's)
    ddp = nn.parallel.DistributedDataParallel(
        cast(nn.Module, torch.compile(whole, backend=backend)) if inside else whole,
        bucket_cap_mb=options.get("bucket_bytes", 25 * 2**20) / 2**20,
    )
    compiled_step = options.get("compiled_autograd", False)
    run = ddp if inside or compiled_step else cast(nn.Module, torch.compile(ddp, backend=backend))

    def step(x: torch.Tensor, y: torch.Tensor, scale: float) -> None:
        _scaled_loss(run, x, y, scale).backward()

    backward = torch.compile(step, backend=backend) if compiled_step else step
    state = _train_steps(rank, world_size, sizes, options, model, ddp, backward)
    state["compiled graphs"] = {
        "backend compiles": backend.compiles,
        "compiled autograd captures": counters["compiled_autograd"]["captures"],
    }
    return state


def _train_reference(sizes: tuple[int, ...], options: dict[str, Any]) -> dict[str, torch.Tensor]:
    micro = options.get("micro", 1)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    batches = _data(sizes, STEPS, micro)
    for step in range(STEPS):
        optimizer.zero_grad()
        for index in range(micro):
            x, y = batches[step * micro + index]
            F.cross_entropy(model(x), y).backward()
        optimizer.step()
    return _state(model)


def _max_error(states: list[dict[str, torch.Tensor]], reference: dict[str, torch.Tensor]) -> float:
    worst = 0.0
    for state in states:
        assert state.keys() == reference.keys()
        for key, expected in reference.items():
            if key.endswith("num_batches_tracked"):
                assert torch.equal(state[key], expected), key
                continue
            torch.testing.assert_close(state[key], expected, rtol=1e-9, atol=1e-10, msg=key)
            worst = max(worst, (state[key] - expected).abs().max().item())
    return worst


def _assert_bitwise_equal_across_ranks(states: list[dict[str, torch.Tensor]]) -> None:
    for state in states[1:]:
        for key, value in states[0].items():
            assert torch.equal(state[key], value), key


SIZES: dict[int, list[tuple[int, ...]]] = {2: [(2, 2), (3, 1)], 3: [(2, 2, 2), (1, 0, 4)]}
#: uneven local batches for inductor: none empty (README: its convolution backward fails on
#: an empty batch) nor of 1, which dynamo specializes as it does 0: every rank of both world
#: sizes then runs the one graph that a batch size marked dynamic gives (_train_steps)
INDUCTOR_SIZES: dict[int, tuple[int, ...]] = {2: (3, 2), 3: (2, 3, 2)}


@pytest.mark.parametrize("sizes_index", [0, 1], ids=["even", "uneven"])
def test_ddp_training_matches_global_batch(pool: WorkerPool, sizes_index: int) -> None:
    sizes = SIZES[pool.world_size][sizes_index]
    states = pool.run(_train_ddp, sizes, {})
    _max_error(states, _train_reference(sizes, {}))
    _assert_bitwise_equal_across_ranks(states)


def _train_fsdp2(
    rank: int, world_size: int, sizes: tuple[int, ...], compiled: bool = False
) -> dict[str, Any]:
    """The DDP scenario's steps with the model sharded by FSDP2 (``fully_shard`` on each
    Linear layer and on the whole model): its parameters are DTensors between steps, and
    unsharded plain tensors in forward and backward, where SyncBatchNorm runs. ``compiled``:
    the sharded model under ``torch.compile`` (``aot_eager``; FSDP2's hooks break the graph
    where they must)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard  # public from torch 2.6; run from 2.8
    from torch.distributed.tensor import DTensor

    # on the CPU: FSDP2's default mesh is on the accelerator where one is visible (the
    # suite also runs on a GPU machine), and it would move the model there
    mesh = init_device_mesh("cpu", (world_size,))
    model = syncbn.convert_sync_batchnorm(_model())
    for module in model.modules():
        if isinstance(module, nn.Linear):
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    run = model
    if compiled:
        torch._dynamo.reset()  # no graphs of an earlier scenario in this pool process
        run = cast(nn.Module, torch.compile(model, backend="aot_eager"))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    start, total = sum(sizes[:rank]), sum(sizes)
    for x, y in _data(sizes, STEPS, 1):
        optimizer.zero_grad()
        x, y = x[start : start + sizes[rank]], y[start : start + sizes[rank]]
        # FSDP averages gradients over ranks, as DDP does: the same scaling
        _scaled_loss(run, x, y, world_size / total).backward()
        optimizer.step()
    return {
        key: value.full_tensor() if isinstance(value, DTensor) else value.detach().clone()
        for key, value in model.state_dict().items()
    }


#: FSDP2 was checked on the CPU with gloo on torch 2.8.0 and 2.13.0 (older torch: unchecked)
_FSDP2_ON_CPU = torch.torch_version.TorchVersion(torch.__version__) >= "2.8"


@pytest.mark.skipif(
    not _FSDP2_ON_CPU, reason="FSDP2 (fully_shard) on the CPU is checked from torch 2.8 on"
)
# compiled: uneven local batches on 3 ranks only, (1, 0, 4) with its empty rank, where even
# ones add no graph break nor collective of their own and 2 ranks' (3, 1) nothing that
# these do not (4-6 s each)
@pytest.mark.parametrize(
    ("pool", "sizes_index", "compiled"),
    [
        pytest.param(2, 0, False, id="world2-even-eager"),
        pytest.param(3, 0, False, id="world3-even-eager"),
        pytest.param(2, 1, False, id="world2-uneven-eager"),
        pytest.param(3, 1, False, id="world3-uneven-eager"),
        pytest.param(3, 1, True, id="world3-uneven-compiled"),
    ],
    indirect=["pool"],
)
def test_fsdp2_training_matches_global_batch(
    pool: WorkerPool, sizes_index: int, compiled: bool
) -> None:
    sizes = SIZES[pool.world_size][sizes_index]
    states = pool.run(_train_fsdp2, sizes, compiled)
    _max_error(states, _train_reference(sizes, {}))
    _assert_bitwise_equal_across_ranks(states)


_INDUCTOR = {"compile": "inductor"}
# 1 KiB buckets, the first 256 bytes: DDPOptimizer splits the graph in 3 or more
_INDUCTOR_SPLIT = {"compile": "inductor", "bucket_bytes": 1024, "first_bucket_bytes": 256}
_INDUCTOR_INSIDE_DDP = {"compile": "inductor", "inside_ddp": True}
_COMPILED_AUTOGRAD = {"compile": "aot_eager", "compiled_autograd": True}


# The split graph and compiled autograd on 3 ranks only (5-9 s each on 2): their uneven
# batches hold those of 2 ranks' case and, for compiled autograd, an empty rank (SIZES)
@pytest.mark.parametrize(
    ("pool", "options"),
    [
        pytest.param(2, _INDUCTOR, id="world2-inductor"),
        pytest.param(3, _INDUCTOR, id="world3-inductor"),
        pytest.param(3, _INDUCTOR_SPLIT, id="world3-inductor-split"),
        pytest.param(2, _INDUCTOR_INSIDE_DDP, id="world2-inductor-inside-ddp"),
        pytest.param(3, _INDUCTOR_INSIDE_DDP, id="world3-inductor-inside-ddp"),
        pytest.param(
            3,
            _COMPILED_AUTOGRAD,
            id="world3-compiled-autograd",
            marks=pytest.mark.skipif(
                not hasattr(torch._dynamo.config, "compiled_autograd"),
                reason="compiled autograd with DDP's python_reducer needs torch >= 2.4",
            ),
        ),
    ],
    indirect=["pool"],
)
@pytest.mark.timeout(300)  # the scenario's own bound plus the pool's start
def test_compiled_ddp_training_matches_global_batch(
    pool: WorkerPool, options: dict[str, Any]
) -> None:
    """``torch.compile`` of a DDP-wrapped model, the way compiled data-parallel training
    runs: DDP's gradient all_reduces and syncbn's share the process group, in the order
    that each rank's compiled backward gives them. Uneven local batches, and on 3 ranks
    an empty one where the backend allows (README: inductor's convolution backward fails
    its own stride assertion on an empty batch, with or without syncbn)."""
    inductor = options["compile"] == "inductor"
    sizes = INDUCTOR_SIZES[pool.world_size] if inductor else SIZES[pool.world_size][1]
    states = pool.run(_train_ddp, sizes, options, timeout=240)
    compiled = [state.pop("compiled graphs") for state in states]
    _max_error(states, _train_reference(sizes, {}))
    _assert_bitwise_equal_across_ranks(states)
    # DDPOptimizer's pieces of the model's graph, one per bucket: where syncbn's layers are
    # in the graph (torch >= 2.4); before, each layer breaks it, and the graphs between
    # them hold fewer buckets (2 graphs on torch 2.3.1, 2026-12-07)
    split = "bucket_bytes" in options and _compiled.FULLGRAPH
    for graphs in compiled:
        # one graph of the whole model, or DDPOptimizer's pieces of it (one per bucket)
        assert graphs["backend compiles"] >= (3 if split else 1), graphs
        # compiled autograd traced the backward, or was not used
        captures = graphs["compiled autograd captures"]
        assert captures >= 1 if options.get("compiled_autograd") else captures == 0, graphs


@pytest.mark.parametrize(
    "options",
    [
        {"ddp": {"broadcast_buffers": True}},  # DDP's default: buffers from rank 0 each step
        {"ddp": {"broadcast_buffers": False}},
        # static_graph: torch's DDP docs advise it with reentrant checkpointing
        {"ddp": {"static_graph": True}},
        {"ddp": {"static_graph": True}, "checkpointing": "reentrant"},
        {"ddp": {"find_unused_parameters": True}},
        {"ddp": {"gradient_as_bucket_view": True}},
        # not with static_graph: DDP's first backward under no_sync() fails torch's own
        # assert there, syncbn or not (pytorch/pytorch#143580; fix proposed in #187732)
        {"ddp": {"gradient_as_bucket_view": True}, "micro": 2},
    ],
    ids=[
        "broadcast-buffers",
        "no-broadcast-buffers",
        "static-graph",
        "static-graph-reentrant",
        "find-unused",
        "bucket-view",
        "bucket-view-no-sync",
    ],
)
def test_ddp_options_change_nothing(pool2: WorkerPool, options: dict[str, Any]) -> None:
    """DDP's options change what it does with buffers and when and from where its gradient
    all_reduces run (static_graph records the first step's order and replays it;
    gradient_as_bucket_view makes .grad a view of the bucket), never syncbn's collectives
    or results."""
    states = pool2.run(_train_ddp, (3, 1), options)
    _max_error(states, _train_reference((3, 1), options))
    _assert_bitwise_equal_across_ranks(states)
    assert states[0]["3.bn.num_batches_tracked"].item() == STEPS * options.get("micro", 1)


def test_gradient_accumulation_with_no_sync(pool2: WorkerPool) -> None:
    options = {"micro": 2}
    states = pool2.run(_train_ddp, (2, 3), options)
    _max_error(states, _train_reference((2, 3), options))


#: per step, each rank's batch size: rank 1's data runs out after two steps (an epoch of
#: uneven shards, an iterable dataset), rank 0's after four
_RUNS_OUT = ((3, 1), (2, 2), (3, 0), (2, 0))


def _train_until_every_rank_is_out(
    rank: int, world_size: int, schedule: tuple[tuple[int, ...], ...]
) -> dict[str, Any]:
    """README's recipe for ranks with different numbers of batches (DDP's ``join()`` does
    not shadow a model's own collectives): agree on the number of steps, then a rank that
    has run out steps with an empty batch; the loss is a sum over the global count (the
    mean of an empty batch is NaN)."""
    model = syncbn.convert_sync_batchnorm(_model())
    ddp = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    batches = _data(schedule[0], len(schedule), 1)  # each step's global batch, rank by rank
    mine = []  # this rank's loader: its share of each step while it has one
    for sizes, (x, y) in zip(schedule, batches):
        start = sum(sizes[:rank])
        if sizes[rank]:
            mine.append((x[start : start + sizes[rank]], y[start : start + sizes[rank]]))
    steps = torch.tensor(len(mine))
    dist.all_reduce(steps, op=dist.ReduceOp.MAX)
    empty = (mine[0][0][:0], mine[0][1][:0])
    for step in range(int(steps)):
        x, y = mine[step] if step < len(mine) else empty
        count = torch.tensor(len(x))
        dist.all_reduce(count)
        optimizer.zero_grad()
        _scaled_loss(ddp, x, y, world_size / int(count)).backward()
        optimizer.step()
    return _state(model)


def _train_steps_of(schedule: tuple[tuple[int, ...], ...]) -> dict[str, torch.Tensor]:
    """One process trained on each step's global batch: what the ranks still had."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for sizes, (x, y) in zip(schedule, _data(_RUNS_OUT[0], len(schedule), 1)):
        optimizer.zero_grad()
        n = sum(sizes)
        F.cross_entropy(model(x[:n]), y[:n]).backward()
        optimizer.step()
    return _state(model)


def test_a_rank_out_of_data_steps_with_an_empty_batch(pool2: WorkerPool) -> None:
    states = pool2.run(_train_until_every_rank_is_out, _RUNS_OUT)
    _max_error(states, _train_steps_of(_RUNS_OUT))
    _assert_bitwise_equal_across_ranks(states)
    assert states[1]["1.num_batches_tracked"].item() == len(_RUNS_OUT)


def _train_in_ddp_join(rank: int, world_size: int) -> tuple[str, dict[str, Any]]:
    """Each rank's own batches of ``_RUNS_OUT`` in DDP's ``join(throw_on_early_termination=
    True)``; the error that stopped it, and the model's state then."""
    model = syncbn.convert_sync_batchnorm(_model())
    ddp = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    total = sum(_RUNS_OUT[0])
    error = ""
    try:
        with ddp.join(throw_on_early_termination=True):
            for sizes, (x, y) in zip(_RUNS_OUT, _data(_RUNS_OUT[0], len(_RUNS_OUT), 1)):
                if not sizes[rank]:
                    break  # this rank's loader is exhausted
                start = sum(sizes[:rank])
                local = slice(start, start + sizes[rank])
                optimizer.zero_grad()
                _scaled_loss(ddp, x[local], y[local], world_size / total).backward()
                optimizer.step()
    except RuntimeError as stopped:
        error = str(stopped)
    return error, _state(model)


def test_ddp_join_stops_every_rank_when_one_runs_out(pool2: WorkerPool) -> None:
    """``join(throw_on_early_termination=True)``, which torch's DDP docs ask for with
    SyncBatchNorm layers: every rank raises at the step where one has run out, and the
    steps before it are the global batch's."""
    (error0, state0), (error1, state1) = pool2.run(_train_in_ddp_join)
    assert "Detected at least one rank that exhausted inputs" in error0, error0
    assert "Rank 1 exhausted all inputs" in error1, error1
    _max_error([state0, state1], _train_steps_of(_RUNS_OUT[:2]))  # both steps of 4 samples


@pytest.mark.parametrize("checkpointing", ["reentrant", "non-reentrant"])
def test_activation_checkpointing_updates_running_stats_once(
    pool2: WorkerPool, checkpointing: str
) -> None:
    options = {"checkpointing": checkpointing}
    states = pool2.run(_train_ddp, (2, 2), options)
    reference = _train_reference((2, 2), {})
    _max_error(states, reference)
    assert states[0]["3.bn.num_batches_tracked"].item() == STEPS


def test_checkpoint_loads_into_plain_model_and_back(pool2: WorkerPool) -> None:
    state = pool2.run(_train_ddp, (2, 2), {})[0]
    plain = _model()
    plain.load_state_dict(state)  # strict: same keys, same shapes
    converted = cast(nn.Sequential, syncbn.convert_sync_batchnorm(_model()))
    converted.load_state_dict(plain.state_dict())
    for key, value in state.items():
        assert torch.equal(converted.state_dict()[key], value), key
    assert isinstance(converted[1], syncbn.SyncBatchNorm)


@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_checkpointing_a_layer_alone_updates_running_stats_once(use_reentrant: bool) -> None:
    """Without a process group the layer is torch's BatchNorm, except that a recomputed
    forward moves nothing; it must still save what the forward saved (non-reentrant
    checkpointing raised "a different number of tensors was saved")."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 3, 1), syncbn.SyncBatchNorm(3), nn.ReLU()).double()
    reference = nn.Sequential(nn.Conv2d(3, 3, 1), nn.BatchNorm2d(3), nn.ReLU()).double()
    reference.load_state_dict(model.state_dict())
    for _ in range(2):
        x = torch.randn(4, 3, 5, 5, dtype=torch.float64, requires_grad=True)
        out = torch.utils.checkpoint.checkpoint(model, x, use_reentrant=use_reentrant)
        out.square().sum().backward()
        x_ref = x.detach().requires_grad_()
        expected = reference(x_ref)
        expected.square().sum().backward()
        torch.testing.assert_close(out, expected)
        torch.testing.assert_close(x.grad, x_ref.grad)
    torch.testing.assert_close(model.state_dict(), reference.state_dict())
    for mine, theirs in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(mine.grad, theirs.grad)


def test_a_forward_inside_a_backward_pass_is_taken_for_a_recomputation() -> None:
    """What README says of checkpointing: the engine running in the thread is all that tells
    a recomputation, so a training forward in a gradient hook moves no running statistics
    (torch's BatchNorm moves them), and normalizes with its batch's statistics."""
    layer, reference = syncbn.SyncBatchNorm(3), nn.BatchNorm1d(3)
    x = torch.randn(8, 3) + 5
    outputs = []
    weight = torch.ones(1, requires_grad=True)
    weight.register_hook(lambda grad: outputs.append(layer(x)))
    (weight * 2).sum().backward()
    torch.testing.assert_close(outputs[0], reference(x))
    counted, reference_counted = layer.num_batches_tracked, reference.num_batches_tracked
    assert counted is not None and reference_counted is not None
    assert layer.running_mean is not None
    assert int(counted) == 0 and int(reference_counted) == 1
    assert torch.equal(layer.running_mean, torch.zeros(3))
    layer(x)  # outside backward: an update, as torch's
    torch.testing.assert_close(layer.running_mean, reference.running_mean)


@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_checkpointing_the_functional_form_alone_updates_running_stats_once(
    use_reentrant: bool,
) -> None:
    mean, var = torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64)
    x = torch.randn(4, 3, 5, dtype=torch.float64, requires_grad=True)

    def call(x: torch.Tensor) -> torch.Tensor:
        return syncbn.sync_batch_norm(x, mean, var, training=True, momentum=0.5)

    torch.utils.checkpoint.checkpoint(call, x, use_reentrant=use_reentrant).sum().backward()
    reference = nn.BatchNorm1d(3, affine=False, momentum=0.5).double()
    reference(x.detach())
    torch.testing.assert_close(mean, reference.running_mean)
    torch.testing.assert_close(var, reference.running_var)
