"""SyncBatchNorm on CUDA: gold parity, no host sync, graph capture, autocast, compile, DataParallel.

Every test here needs a CUDA GPU and is skipped without one (CI has none). Two ranks share
one GPU through gloo with CUDA tensors (nccl refuses two ranks per GPU); nccl is covered
with a group of one rank per process and the sync path forced (``_sync_alone``), where the
module would otherwise fall back to plain BatchNorm.
"""

from __future__ import annotations

import copy
import dataclasses
from collections import Counter
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _gold import Case, compare, reference, run_rank
from _harness import WorkerPool
from test_collectives import assert_outlier_accurate, outlier_statistics
from test_data_parallel import one_device_matches_batchnorm
from test_ddp import _max_error, _train_ddp, _train_reference
from test_double_backward import assert_equals_the_global_batch, penalized_ranks_step
from test_kernels_cuda import counted_cuda_ops, expected_calls
from test_masked import MaskedCase, _assert_matches, _run_masked
from test_masking import _run_in_block
from torch import nn

import syncbn
from syncbn import _compiled, _kernels, _protocol
from syncbn._cli.measure import count_host_syncs

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

GOLD = {
    "float64": Case(sizes=(3, 0), tail=(3, 4, 5)),
    "float32": Case(sizes=(2, 3), dtype="float32", tail=(4, 6, 6)),
    "float32-channels-last": Case(
        sizes=(0, 5), dtype="float32", tail=(4, 6, 6), channels_last=True
    ),
    "channels-last-3d": Case(sizes=(2, 1), tail=(2, 3, 2, 4), channels_last=True),
    "bfloat16-float32-params": Case(
        sizes=(3, 1), dtype="bfloat16", param_dtype="float32", tail=(4, 6, 6)
    ),
    "float16-float32-params": Case(
        sizes=(1, 3), dtype="float16", param_dtype="float32", tail=(4, 6, 6)
    ),
    "momentum-none": Case(sizes=(2, 2), momentum=None, steps=4),
}


@pytest.mark.parametrize("check_mode", ["auto", "immediate"])
@pytest.mark.parametrize("name", list(GOLD))
@pytest.mark.timeout(180)  # the scenario's own bound plus the pool's start
def test_gold_on_cuda_two_ranks_through_gloo(pool2: WorkerPool, name: str, check_mode: str) -> None:
    case = dataclasses.replace(GOLD[name], extra={"device": "cuda", "check_mode": check_mode})
    compare(case, pool2.run(run_rank, case, timeout=120.0), reference(case))


def _no_tf32() -> None:
    """Full float32 convolutions and matmuls (H100 defaults cuDNN convolutions to TF32), so
    that comparisons between two computations at rtol 1e-4 measure syncbn, not TF32."""
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False


#: world size -> the groups of :func:`_alone_groups` in this pool process
_alone: dict[int, list[dist.ProcessGroup]] = {}


def _alone_groups(world_size: int) -> list[dist.ProcessGroup]:
    """One nccl group of one rank per process (every rank creates every group).

    Created by the first scenario that needs them and then kept: a pool's processes run
    the session's scenarios in the same order (so every rank creates them in the same
    call), and communicators created per scenario would pile up on the one GPU.
    """
    if world_size not in _alone:
        _alone[world_size] = [dist.new_group([r], backend="nccl") for r in range(world_size)]
    return _alone[world_size]


def _grads(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    grads = [(name, p.grad) for name, p in model.named_parameters()]
    assert all(g is not None for _, g in grads), "a parameter got no gradient"
    return [(name, g.clone()) for name, g in grads if g is not None]


def _small_model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.BatchNorm2d(8, momentum=None),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 4),
    )


def _synced(model: nn.Module, group: dist.ProcessGroup) -> nn.Module:
    model = syncbn.convert_sync_batchnorm(model, group)
    for module in model.modules():
        if isinstance(module, syncbn.SyncBatchNorm):
            module._sync_alone = True
    return model


def _resnet_or_small() -> nn.Module:
    try:
        import torchvision
    except ImportError:
        return _small_model()
    return torchvision.models.resnet18(num_classes=10)


def _one_step_each(plain: nn.Module, synced: nn.Module, x: torch.Tensor) -> dict[str, Any]:
    """One backward step of each model on ``x``: their states and gradients, on the CPU."""
    results = {}
    for name, model in (("plain", plain), ("synced", synced)):
        model(x).square().sum().backward()
        results[name] = {k: v.detach().cpu() for k, v in model.state_dict().items()} | {
            f"grad.{k}": g.cpu() for k, g in _grads(model)
        }
    return results


def _nccl_alone(rank: int, world_size: int) -> dict[str, Any]:
    _no_tf32()
    group = _alone_groups(world_size)[rank]
    torch.manual_seed(rank)
    plain = _small_model().cuda()
    synced = _synced(copy.deepcopy(plain), group)
    x = torch.randn(5, 3, 8, 8, device="cuda").contiguous(memory_format=torch.channels_last)
    return _one_step_each(plain, synced, x)


@pytest.mark.timeout(180)  # the scenario's own bound plus the pool's start
def test_nccl_group_of_one_with_the_sync_path_equals_batchnorm(pool2: WorkerPool) -> None:
    for result in pool2.run(_nccl_alone, timeout=120.0):
        for key, value in result["plain"].items():
            torch.testing.assert_close(result["synced"][key], value, rtol=1e-4, atol=1e-5)


def _timm_alone(rank: int, world_size: int) -> dict[str, Any]:
    """timm's efficientnet_b0 (49 BatchNormAct2d layers, converted by syncbn's timm
    converter) on CUDA in float64, synchronized through an nccl group of one rank."""
    import timm

    group = _alone_groups(world_size)[rank]
    torch.manual_seed(rank)
    plain = timm.create_model("efficientnet_b0", num_classes=10).cuda().double()
    synced = _synced(copy.deepcopy(plain), group)
    x = torch.randn(4, 3, 64, 64, device="cuda", dtype=torch.float64)
    converted = sum(isinstance(m, syncbn.SyncBatchNorm) for m in synced.modules())
    return _one_step_each(plain, synced, x) | {"converted": converted}


@pytest.mark.timeout(240)  # the scenario's own bound plus the pool's start
def test_a_timm_model_on_cuda_equals_its_batchnorm_original(pool2: WorkerPool) -> None:
    pytest.importorskip("timm")
    for result in pool2.run(_timm_alone, timeout=180.0):
        assert result["converted"] == 49
        for key, value in result["plain"].items():
            torch.testing.assert_close(result["synced"][key], value, rtol=1e-9, atol=1e-10)


def test_data_parallel_api_on_one_gpu_equals_batchnorm() -> None:
    """vacancy's DataParallel API with one GPU (one replica: torch's BatchNorm on cuda:0)."""
    one_device_matches_batchnorm(torch.device("cuda", 0))


def _no_host_sync(rank: int, world_size: int, autocast: bool = True) -> dict[str, Any]:
    group = _alone_groups(world_size)[rank]
    model = _synced(_resnet_or_small(), group).cuda()
    model = model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(8, 3, 64, 64, device="cuda").contiguous(memory_format=torch.channels_last)

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            loss = model(x).float().square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(3):  # warm-up: caches of constant tensors, cuDNN plans
        step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        outcome = "ok"
        for _ in range(2):
            step()
    except RuntimeError as error:
        outcome = str(error)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    _protocol.raise_deferred(wait=True)
    return {"outcome": outcome}


@pytest.mark.timeout(240)  # the scenario's own bound plus the pool's start
def test_training_step_makes_no_host_sync(pool2: WorkerPool) -> None:
    for result in pool2.run(_no_host_sync, timeout=180.0):
        assert result["outcome"] == "ok"


def _compiled_host_syncs(rank: int, world_size: int) -> dict[str, int]:
    """Host syncs of two compiled training steps (fullgraph, default mode: inductor's Triton
    kernels around syncbn's ops) after three that compile, counted by torch's sync debug
    mode: syncbn's, and torch's BatchNorm's as the control."""
    group = _alone_groups(world_size)[rank]
    x = torch.randn(8, 3, 8, 8, device="cuda")
    counts = {}
    for name in ("batchnorm", "syncbn"):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = _small_model()
        for module in model.modules():  # torch's cumulative average reads a count on the host
            if isinstance(module, nn.BatchNorm2d):
                module.momentum = 0.1
        if name == "syncbn":
            model = _synced(model, group)
        model = model.cuda()
        compiled = torch.compile(model, fullgraph=True)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

        def step(compiled: Any = compiled, optimizer: Any = optimizer) -> None:
            compiled(x).square().sum().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        for _ in range(3):  # compiles, and fills the caches of constant tensors
            step()

        def two_steps(step: Any = step) -> None:
            step()
            step()

        counts[name] = count_host_syncs(two_steps)
    _protocol.raise_deferred(wait=True)
    return counts


@pytest.mark.timeout(360)  # the scenario's own bound plus the pool's start
def test_a_compiled_training_step_makes_no_host_sync_of_its_own(pool2: WorkerPool) -> None:
    """The compiled step's syncbn ops (run once per layer and direction) add no host sync
    to those of torch's BatchNorm step compiled the same way (the control): a read in one
    of them (a site tensor read on the host, an immediate check) would make
    the host wait for the device at every layer. The second GPU run measured a compiled
    resnet50 step at 3.4x compiled BatchNorm's, ~0.8 ms of host time per op call."""
    for counts in pool2.run(_compiled_host_syncs, timeout=300.0):
        assert counts["syncbn"] <= counts["batchnorm"], counts


def _graph_capture(rank: int, world_size: int, batch: int) -> dict[str, Any]:
    _no_tf32()
    group = _alone_groups(world_size)[rank]
    torch.manual_seed(0)
    eager_model = _synced(_small_model(), group).cuda()
    graph_model = copy.deepcopy(eager_model)
    x = torch.randn(batch, 3, 8, 8, device="cuda")
    results = {}
    for name, model in (("eager", eager_model), ("graph", graph_model)):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

        def step(model: nn.Module = model, optimizer: Any = optimizer) -> None:
            model(x).square().sum().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)

        if name == "eager":
            for _ in range(5):
                step()
        else:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):  # warm-up, also counted below
                    step()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            graph.replay()
            graph.replay()
        torch.cuda.synchronize()
        results[name] = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    return results


@pytest.mark.parametrize("batch", [4, 0], ids=["batch4", "empty"])
@pytest.mark.timeout(180)  # the scenario's own bound plus the pool's start
def test_cuda_graph_of_a_training_step_equals_eager(pool2: WorkerPool, batch: int) -> None:
    for result in pool2.run(_graph_capture, batch, timeout=120.0):
        for key, value in result["eager"].items():
            if key.endswith("num_batches_tracked"):
                # replays do not run Python: the counter moves on the device like the rest
                assert torch.equal(result["graph"][key], value), key
            else:
                torch.testing.assert_close(result["graph"][key], value, rtol=1e-4, atol=1e-5)


def _with_fused_kernels(rank: int, world_size: int, scenario: Any, *args: Any) -> Any:
    """``scenario`` with syncbn._kernels.cuda (torch's fused SyncBatchNorm element kernels)
    instead of the generic kernels: a candidate until a GPU run measures it faster."""
    _kernels.use_device_kernels("cuda")
    try:
        return scenario(rank, world_size, *args)
    finally:
        _kernels.use_device_kernels("cuda", enabled=False)


def _gold_with_fused_kernels(rank: int, world_size: int, case: Case) -> dict[str, Any]:
    calls: Counter[str] = Counter()
    with counted_cuda_ops(calls):
        result = _with_fused_kernels(rank, world_size, run_rank, case)
    return result | {"calls": dict(calls)}  # type: ignore[no-any-return]


@pytest.mark.parametrize("check_mode", ["auto", "immediate"])
@pytest.mark.parametrize("name", list(GOLD))
@pytest.mark.timeout(180)  # the scenario's own bound plus the pool's start
def test_fused_kernels_gold_on_cuda_two_ranks_through_gloo(
    pool2: WorkerPool, name: str, check_mode: str
) -> None:
    """The gold cases on syncbn._kernels.cuda; float32 and float64 calls with a local batch
    run the fused ops (counted), half precision keeps the generic passes."""
    case = dataclasses.replace(GOLD[name], extra={"device": "cuda", "check_mode": check_mode})
    per_rank = pool2.run(_gold_with_fused_kernels, case, timeout=120.0)
    compare(case, per_rank, reference(case))
    fused = case.dtype in ("float32", "float64")
    for rank, result in enumerate(per_rank):
        assert result["calls"] == expected_calls(case, rank, fused), (rank, result["calls"])


@pytest.mark.timeout(240)  # the scenario's own bound plus the pool's start
def test_fused_kernels_float32_step_makes_no_host_sync(pool2: WorkerPool) -> None:
    for result in pool2.run(_with_fused_kernels, _no_host_sync, False, timeout=180.0):
        assert result["outcome"] == "ok"


@pytest.mark.timeout(180)  # the scenario's own bound plus the pool's start
def test_fused_kernels_in_a_cuda_graph_equal_eager(pool2: WorkerPool) -> None:
    for result in pool2.run(_with_fused_kernels, _graph_capture, 4, timeout=120.0):
        for key, value in result["eager"].items():
            torch.testing.assert_close(result["graph"][key], value, rtol=1e-4, atol=1e-5)


def _autocast(rank: int, world_size: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, 3, 8, 8, generator=gen)
    torch.manual_seed(0)
    model = syncbn.convert_sync_batchnorm(_small_model()).cuda()
    local = x[:2] if rank == 0 else x[2:]
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = model(local.cuda())
    out.float().sum().backward()
    return {
        "output": out.float().cpu(),
        "state": {k: v.cpu() for k, v in model.state_dict().items()},
        "x": x,
    }


@pytest.mark.timeout(180)  # the scenario's own bound plus the pool's start
def test_autocast_bfloat16_equals_batchnorm_on_the_global_batch(pool2: WorkerPool) -> None:
    results = pool2.run(_autocast, timeout=120.0)
    torch.manual_seed(0)
    model = _small_model().cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        expected = model(results[0]["x"].cuda())
    torch.testing.assert_close(
        torch.cat([r["output"] for r in results]), expected.float().cpu(), rtol=5e-2, atol=5e-2
    )
    for result in results:
        for key, value in model.state_dict().items():
            torch.testing.assert_close(result["state"][key], value.cpu(), rtol=1e-2, atol=1e-2)


def _compiled_cuda(rank: int, world_size: int, mode: str) -> dict[str, Any]:
    _no_tf32()
    group = _alone_groups(world_size)[rank]
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = _synced(_small_model(), group).cuda()
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(compiled_model, fullgraph=True, mode=mode)
    results = {}
    for name, run, model in (("eager", eager, eager), ("compiled", compiled, compiled_model)):
        gen = torch.Generator().manual_seed(5)
        # each size at least 3 times: cudagraph trees warm up on the first calls of a
        # shape and record from a later one, so "reduce-overhead" replays graphs here
        for size in (4, 4, 4, 3, 3, 3, 4):
            x = torch.randn(size, 3, 8, 8, generator=gen).cuda()
            if run is compiled and mode == "reduce-overhead":
                # each step a new generation of cudagraph trees, as torch advises: without
                # it the 2026-12-04 lease's backward read a replayed graph's overwritten
                # output ("accessing tensor output of CUDAGraphs that has been overwritten"),
                # and so did cuDNN BatchNorm's step in benchmarks/gpu.py
                torch.compiler.cudagraph_mark_step_begin()
            # each step's gradients alone, dropped before the next: a compiled step's are in
            # CUDA graph trees' memory, which the next step's graphs overwrite, so adding to
            # them there failed the same way (pytorch/pytorch#169545; a review, 2026-12-08)
            model.zero_grad(set_to_none=True)
            run(x).square().sum().backward()
        results[name] = {k: v.detach().cpu() for k, v in model.state_dict().items()}
        # the last step's gradients: the compiled backward (syncbn's backward op) checked too
        for key, parameter in model.named_parameters():
            assert parameter.grad is not None, key
            results[name][f"{key}.grad"] = parameter.grad.detach().cpu()
    return results


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
@pytest.mark.timeout(360)  # the scenario's own bound plus the pool's start
def test_fullgraph_compile_on_cuda_equals_eager(pool2: WorkerPool, mode: str) -> None:
    for result in pool2.run(_compiled_cuda, mode, timeout=300.0):
        for key, value in result["eager"].items():
            torch.testing.assert_close(result["compiled"][key], value, rtol=1e-4, atol=1e-5)


@pytest.mark.timeout(360)  # the scenario's own bound plus the pool's start
def test_compiled_ddp_on_cuda_through_gloo_equals_the_global_batch(pool2: WorkerPool) -> None:
    """``torch.compile`` (inductor: Triton kernels) of a DDP-wrapped float64 model on the
    GPU, two ranks through gloo with CUDA tensors, uneven local batches: DDP's bucket
    all_reduces between syncbn's, the model state that of one process on the global batch
    (tests/test_ddp.py's scenario and reference, on the CPU)."""
    options = {"compile": "inductor", "device": "cuda"}
    states = pool2.run(_train_ddp, (3, 1), options, timeout=300.0)
    for state in states:
        state.pop("compiled graphs")  # what test_ddp.py's compiled scenarios count
    _max_error(states, _train_reference((3, 1), {}))


MASKED = {
    "eager": MaskedCase(sizes=(4, 0), valid=(0.6, 0.7), device="cuda"),
    "eager-immediate": MaskedCase(
        sizes=(3, 2), valid=(0.6, 0.0), device="cuda", check_mode="immediate"
    ),
    "channels-last": MaskedCase(
        sizes=(2, 3), valid=(0.7, 0.5), tail=(3, 4, 5), channels_last=True, device="cuda"
    ),
    "aot_eager": MaskedCase(sizes=(4, 0), valid=(0.6, 0.7), device="cuda", mode="aot_eager"),
    "inductor": MaskedCase(sizes=(3, 2), valid=(0.6, 0.8), device="cuda", mode="inductor"),
}


@pytest.mark.parametrize("name", list(MASKED))
@pytest.mark.timeout(300)  # the scenario's own bound plus the pool's start
def test_masked_calls_on_cuda_match_the_gathered_reference(pool2: WorkerPool, name: str) -> None:
    """Masked calls on CUDA (generic kernels, deferred checks; compiled: the composite ops)
    equal torch.nn.BatchNorm1d on the valid positions of both ranks, in float64."""
    case = MASKED[name]
    _assert_matches(case, pool2.run(_run_masked, case, timeout=240.0))


@pytest.mark.parametrize("name", ["eager", "channels-last"])
@pytest.mark.timeout(300)  # the scenario's own bound plus the pool's start
def test_fused_kernels_masked_calls_match_the_gathered_reference(
    pool2: WorkerPool, name: str
) -> None:
    """The same masked calls on syncbn._kernels.cuda (its fused input-gradient pass)."""
    case = MASKED[name]
    _assert_matches(case, pool2.run(_with_fused_kernels, _run_masked, case, timeout=240.0))


@pytest.mark.timeout(300)  # the scenario's own bound plus the pool's start
@pytest.mark.parametrize("checkpoint", [False, True], ids=["plain", "checkpointed"])
def test_a_masking_block_on_cuda_matches_the_gathered_reference(
    pool2: WorkerPool, checkpoint: bool
) -> None:
    """syncbn.masking's mask reaches a layer in an nn.Sequential on CUDA (deferred checks),
    as the gold reference has it. Eager only: compiled blocks are device-independent code
    (tests/test_masking.py), and compiled masked calls on CUDA are MASKED["inductor"]'s.
    Checkpointed: autograd recomputes the forward in its CUDA device thread, which has no
    block (a review found it raising there; emulated on the CPU by
    test_masking.py's test_checkpointing_recomputes_with_the_blocks_mask[other-thread])."""
    case = MaskedCase(sizes=(4, 3), valid=(0.6, 0.8), device="cuda")
    _assert_matches(case, pool2.run(_run_in_block, case, "", checkpoint, timeout=240.0))


@pytest.mark.timeout(180)
def test_a_gradient_penalty_on_cuda_two_ranks_through_gloo(pool2: WorkerPool) -> None:
    """Double backward (create_graph=True) on CUDA, the checks deferred (CUDA's default),
    against one process on the global batch on the CPU, as tests/test_double_backward.py."""
    results = pool2.run(penalized_ranks_step, True, "contiguous", "cuda", timeout=120.0)
    assert_equals_the_global_batch(results, True)


@pytest.mark.skipif(not _compiled.FULLGRAPH, reason="the ops are registered from torch 2.4")
def test_the_compiled_forward_op_calls_its_implementation_directly_on_cuda() -> None:
    """The forward op's shortcut (:func:`syncbn._compiled._autograd_kernel`) on CUDA
    tensors, as a compiled forward graph calls it: their key set below autograd is the
    backend's alone, so the op's implementation is called without a redispatch through
    Python (the op's dispatch 13 -> 8 us per call on the CPU machine)."""
    from test_compile import forward_op_calls

    assert forward_op_calls(torch.device("cuda")) == ["direct"]


def test_a_layer_without_per_channel_tensors_built_on_cuda_has_its_site_there() -> None:
    """Its site tensor, an input of every compiled graph of the layer, on the GPU: on the
    CPU, CUDA graph trees (``mode="reduce-overhead"``) skip graphs with a CPU input."""
    layer = syncbn.SyncBatchNorm(3, affine=False, track_running_stats=False, device="cuda")
    assert layer._site.device == torch.device("cuda", torch.cuda.current_device())
    with torch.device("cuda"):
        assert syncbn.SyncBatchNorm(3, affine=False, track_running_stats=False)._site.is_cuda


def test_check_deferred_waits_for_the_headers_copy_on_cuda() -> None:
    """``syncbn.check_deferred()`` after a run's last call: it waits for the header's copy
    to pinned memory (CUDA's event) and raises that call's problem, here a masked call of a
    process alone with one valid position (a global count of one); once."""
    layer = syncbn.SyncBatchNorm(3).cuda()  # deferred checks: CUDA's default
    x = torch.randn(4, 3, 5, device="cuda")
    mask = torch.zeros(4, 5, dtype=torch.bool, device="cuda")
    mask[0, 0] = True
    layer(x, mask=mask)  # returns without reading anything back
    with pytest.raises(ValueError, match=r"^\(deferred check\) Expected more than 1 value"):
        syncbn.check_deferred()
    syncbn.check_deferred()  # forgotten once raised
    layer(x, mask=mask.logical_not())
    syncbn.check_deferred()  # a good call checks clean


@pytest.mark.parametrize("masked", [False, True], ids=["unmasked", "masked"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "inductor"])
@pytest.mark.timeout(330)  # the two runs' limits, and the pool's start
def test_an_outlier_at_a_ranks_first_value_stays_accurate_on_cuda(
    pool2: WorkerPool, compiled: bool, masked: bool
) -> None:
    """tests/test_collectives.py's outlier case on CUDA through gloo (deferred checks;
    compiled: inductor's Triton kernels), with the generic kernels and with the fused
    Triton candidates (``triton_passes.shift_of``'s median of 9)."""
    sizes = (3, 5)
    # an inductor case compiles in each rank, cold, and the fused one its Triton kernels
    # (the pool's 60 s default was short for the first)
    arguments = (sizes, compiled, masked, "cuda", "inductor")
    results = pool2.run(outlier_statistics, *arguments, timeout=180.0)
    assert_outlier_accurate(sizes, masked, results)
    if not compiled:
        fused = pool2.run(
            _with_fused_finalize, outlier_statistics, sizes, False, masked, "cuda", timeout=120.0
        )
        assert_outlier_accurate(sizes, masked, fused)


def _with_fused_finalize(rank: int, world_size: int, scenario: Any, *args: Any) -> Any:
    """``scenario`` with syncbn._kernels.finalize and its Triton passes on for CUDA."""
    _kernels.use_fused_finalize("cuda")
    try:
        return scenario(rank, world_size, *args)
    finally:
        _kernels.use_fused_finalize("cuda", enabled=False)
