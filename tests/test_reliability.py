"""Misuse and faults become prompt, specific errors on every rank; state stays consistent."""

from __future__ import annotations

import datetime
import os
import time
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _harness import WorkerPool, outcome, run_isolated
from torch import nn

import syncbn

# --- layer-order check -------------------------------------------------------------------------


def _different_layers(rank: int, world_size: int, phase: str) -> tuple[str, str]:
    model = cast(
        nn.Sequential,
        syncbn.convert_sync_batchnorm(nn.Sequential(nn.BatchNorm1d(3), nn.BatchNorm1d(3))),
    )
    x = torch.randn(4, 3, requires_grad=True)
    assert outcome(model, x) == ("ok", "")  # both layers, in order, on every rank
    if phase == "forward":
        return outcome(model[rank % 2], x)  # rank 0 calls layer '0', rank 1 layer '1'
    out0, out1 = model[0](x), model[1](x)
    # backward reaches the layers in a different order on different ranks
    first, second = (out0, out1) if rank % 2 == 0 else (out1, out0)
    return outcome(lambda: (first.sum() * 1e-3 + second.sum().detach()).backward())


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_ranks_at_different_layers_raise_naming_their_own_layer(
    pool: WorkerPool, phase: str
) -> None:
    for rank, (kind, message) in enumerate(pool.run(_different_layers, phase)):
        assert kind == "RuntimeError", message
        assert f"SyncBatchNorm layer mismatch in {phase}" in message
        assert f"layer '{rank % 2}' (num_features=3, call 1)" in message
        assert "same number of times" in message and "check_layer_order = False" in message


def _skipped_backward(rank: int, world_size: int, check_mode: str) -> tuple[str, str]:
    """Rank 0 skips a step's backward (a loss it decided not to use) and goes on to the
    next forward: its forward collective meets the other ranks' backward one, of the same
    layer and channel count."""
    layer = syncbn.SyncBatchNorm(3)
    layer.check_mode = check_mode
    x = torch.randn(4, 3, requires_grad=True)

    def step() -> None:
        output = layer(x)
        if rank != 0:
            output.sum().backward()
        layer(x)
        syncbn.check_deferred()

    return outcome(step)


@pytest.mark.parametrize("check_mode", ["immediate", "deferred"])
def test_a_forward_meeting_a_backward_raises_on_every_rank(
    pool2: WorkerPool, check_mode: str
) -> None:
    """Forward and backward buffers once differed in length (2C+5 and 2C+4 values): gloo
    aborted a process (SIGABRT, "Received data size doesn't match expected size") and the
    other raised a backend error, or a mismatch naming the same layer on both sides. They
    now have one length and their own fingerprints."""
    (forward_kind, at_forward), (backward_kind, at_backward) = pool2.run(
        _skipped_backward, check_mode, timeout=60.0
    )
    assert forward_kind == backward_kind == "RuntimeError", (at_forward, at_backward)
    assert "SyncBatchNorm layer mismatch in forward" in at_forward
    assert "other ranks of the process group are at SyncBatchNorm layer" in at_forward
    assert "(num_features=3) in backward in the same collective" in at_forward
    assert "SyncBatchNorm layer mismatch in backward" in at_backward
    assert "(num_features=3) in forward in the same collective" in at_backward


def _check_disabled(rank: int, world_size: int) -> tuple[str, str]:
    model = cast(
        nn.Sequential,
        syncbn.convert_sync_batchnorm(
            nn.Sequential(nn.BatchNorm1d(3), nn.BatchNorm1d(3)), check_layer_order=False
        ),
    )
    return outcome(model[rank % 2], torch.randn(4, 3))


def test_layer_order_check_can_be_turned_off(pool2: WorkerPool) -> None:
    # same channel count: without the check the statistics of two layers mix silently
    assert pool2.run(_check_disabled) == [("ok", "")] * 2


def _check_disabled_on_rank_1(rank: int, world_size: int, check_mode: str) -> tuple[str, str]:
    layer = syncbn.SyncBatchNorm(3)
    layer.check_layer_order = rank != 1
    layer.check_mode = check_mode

    def call() -> None:
        layer(torch.randn(4, 3))
        syncbn.check_deferred()

    return outcome(call)


@pytest.mark.parametrize("check_mode", ["immediate", "deferred"])
def test_a_layer_order_check_off_on_one_rank_raises_on_every_rank(
    pool2: WorkerPool, check_mode: str
) -> None:
    """The checking rank raised that the other was at "a different layer" (the same one),
    and the rank without the check went on alone, to wait in its next collective."""
    (_, checking), (kind, unchecked) = pool2.run(_check_disabled_on_rank_1, check_mode)
    assert "other ranks of the process group are at a layer whose check_layer_order is False" in (
        checking
    ), checking
    assert kind == "RuntimeError", unchecked
    assert "with check_layer_order = False, but other ranks of the process group check" in (
        unchecked
    ), unchecked


def _different_channel_counts(rank: int, world_size: int) -> tuple[str, str]:
    bn = syncbn.SyncBatchNorm(3 if rank == 0 else 5)
    return outcome(bn, torch.randn(4, bn.num_features))


def test_different_channel_counts_never_pass_silently() -> None:
    """Payload lengths differ. gloo aborts the rank that receives more than it expects ("Received
    data size doesn't match expected size"); the other rank raises either the layer-mismatch
    error (the fingerprint trailer was not summed) or the wrapped backend error (peer gone)."""
    short_rank, long_rank = run_isolated(_different_channel_counts, 2, timeout=60.0)
    assert long_rank[0] == "ok", long_rank
    kind, message = long_rank[1]
    assert kind in ("RuntimeError", "DistBackendError"), message
    assert (
        "SyncBatchNorm layer mismatch in forward" in message and "num_features=5" in message
    ) or (
        "SyncBatchNorm all_reduce of 15 values" in message and "same number of times" in message
    ), message
    assert short_rank[0] == "dead" or "layer mismatch" in str(short_rank[1]), short_rank


# --- a rank that stops participating -------------------------------------------------------------


def _one_rank_skips(rank: int, world_size: int, timeout_s: float) -> dict[str, Any]:
    group = dist.new_group(timeout=datetime.timedelta(seconds=timeout_s))
    bn = syncbn.SyncBatchNorm(3, process_group=group)
    start = time.monotonic()
    result = ("skipped", "") if rank == world_size - 1 else outcome(bn, torch.randn(4, 3))
    return {"outcome": result, "seconds": time.monotonic() - start}


def test_rank_that_skips_a_layer_makes_the_others_fail_within_the_timeout(
    pool: WorkerPool,
) -> None:
    *waiting, skipper = pool.run(_one_rank_skips, 2.0, timeout=60.0)
    assert skipper["outcome"] == ("skipped", "")
    for result in waiting:
        kind, message = result["outcome"]
        assert kind in ("RuntimeError", "DistBackendError"), message
        assert "SyncBatchNorm all_reduce" in message and "same number of times" in message
        assert result["seconds"] < 30.0


def _killed_mid_step(rank: int, world_size: int) -> tuple[str, str, float]:
    model = syncbn.convert_sync_batchnorm(nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)))
    model(torch.randn(4, 3)).sum().backward()  # one full step together
    if rank == 1:
        os._exit(3)  # the process dies mid-step, before the next collective
    start = time.monotonic()
    kind, message = outcome(lambda: model(torch.randn(4, 3)).sum().backward())
    return kind, message, time.monotonic() - start


def test_killed_rank_makes_the_survivors_fail_in_bounded_time() -> None:
    survivor, killed = run_isolated(_killed_mid_step, 2, timeout=90.0, pg_timeout=5.0)
    assert killed == ("dead", 3)
    assert survivor[0] == "ok", survivor
    kind, message, seconds = survivor[1]
    assert kind in ("RuntimeError", "DistBackendError"), message
    assert "SyncBatchNorm all_reduce" in message
    assert seconds < 60.0


# --- non-finite input ---


#: where :func:`_non_finite` puts the value in channel 1 of rank 0's batch: its first value
#: (which the local sums were once shifted by: an inf there gave a NaN running mean where
#: BatchNorm's is inf), another, or the row that all 9 samples of a 4-row ``(N, C)`` batch's
#: shift read (an inf there was the shift: inf - inf made the sums NaN)
_NON_FINITE_AT = {"first": (0, 1, 0), "inner": (1, 1, 0), "sampled": (1, 1)}


def _non_finite_batches(at: str) -> list[torch.Tensor]:
    """A batch of each rank, then another (finite) for a second call."""
    x = torch.arange(24, dtype=torch.float64) / 7.0
    x = x[:12].reshape(4, 3) if at == "sampled" else x.reshape(4, 3, 2)
    return [x, x.flip(0) + 1.0]


#: the layers' momenta: a cumulative average's first factor is 1 (lerp made an infinite
#: target NaN with a factor of 0.5 or more)
_MOMENTA = (0.1, None)


def _non_finite_calls(
    layer: nn.modules.batchnorm._BatchNorm, first: torch.Tensor, second: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Two calls, the second finite; the output of the first, and the running statistics
    after each (torch's moves an infinite running mean towards a finite one to inf)."""
    result = {"output": layer(first).detach()}
    for suffix, batch in (("", None), (" 2", second)):
        if batch is not None:
            layer(batch)
        assert layer.running_mean is not None and layer.running_var is not None
        result[f"mean{suffix}"] = layer.running_mean.clone()
        result[f"var{suffix}"] = layer.running_var.clone()
    return result


def _non_finite(rank: int, world_size: int, value: float, at: str) -> list[dict[str, torch.Tensor]]:
    first, second = _non_finite_batches(at)
    if rank == 0:
        first[_NON_FINITE_AT[at]] = value
    layers = [syncbn.SyncBatchNorm(3, momentum=m, dtype=torch.float64) for m in _MOMENTA]
    return [_non_finite_calls(layer, first, second) for layer in layers]


@pytest.mark.parametrize("at", sorted(_NON_FINITE_AT))
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_input_gives_batchnorm_pattern_without_hang(
    pool2: WorkerPool, value: float, at: str
) -> None:
    """The NaN and inf of BatchNorm on the global batch, in the output and in the running
    statistics, after the call and after a finite one (on 2 ranks: 3 add nothing here, and
    the suite's time is near its bar)."""
    pool = pool2
    results = pool.run(_non_finite, value, at)
    batches = _non_finite_batches(at)
    first, second = (x.repeat((pool.world_size,) + (1,) * (x.dim() - 1)) for x in batches)
    first[_NON_FINITE_AT[at]] = value
    for index, momentum in enumerate(_MOMENTA):
        reference = nn.BatchNorm1d(3, momentum=momentum, dtype=torch.float64)
        expected = _non_finite_calls(reference, first, second)
        output = torch.cat([ranks[index]["output"] for ranks in results])
        assert torch.equal(output.isnan(), expected["output"].isnan())
        assert torch.equal(output.isinf(), expected["output"].isinf())
        finite = expected["output"].isfinite()
        torch.testing.assert_close(output[finite], expected["output"][finite])
        for ranks in results:
            for key in ("mean", "var", "mean 2", "var 2"):
                got, ref = ranks[index][key], expected[key]
                assert torch.equal(got.isnan(), ref.isnan()), (momentum, key, got, ref)
                number = ~ref.isnan()  # finite values, and infinities of the same sign
                torch.testing.assert_close(got[number], ref[number])


# --- consistency ---


def _many_steps(rank: int, world_size: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(100 + rank)  # every rank has different data and batch sizes
    model = syncbn.convert_sync_batchnorm(
        nn.Sequential(
            nn.Conv2d(3, 8, 3),
            nn.BatchNorm2d(8, momentum=None),
            nn.ReLU(),
            nn.Conv2d(8, 4, 1),
            nn.BatchNorm2d(4),
        )
    )
    outputs = []
    for step in range(30):
        x = torch.randn((step + rank) % 4, 3, 6, 6) * 3 + step
        if x.shape[0] == 0 and rank == 0:
            x = torch.randn(2, 3, 6, 6)
        y = model(x)
        y.square().mean().backward() if y.numel() else y.sum().backward()
        outputs.append(y.detach())
    state = {
        k: v.clone() for k, v in model.state_dict().items() if "running" in k or "tracked" in k
    }
    return {"state": state, "last": outputs[-1]}


def test_running_stats_bitwise_identical_across_ranks_and_runs(pool: WorkerPool) -> None:
    first = pool.run(_many_steps)
    for result in first[1:]:
        for key, value in first[0]["state"].items():
            assert torch.equal(result["state"][key], value), key
    second = pool.run(_many_steps)
    for a, b in zip(first, second):
        assert torch.equal(a["last"], b["last"])
        for key, value in a["state"].items():
            assert torch.equal(b["state"][key], value), key


# --- input validation as a user meets it ---------------------------------------------------------


def test_complex_input_is_refused() -> None:
    with pytest.raises(TypeError, match="floating point input, got input of dtype torch.complex64"):
        syncbn.SyncBatchNorm(2)(torch.randn(3, 2, dtype=torch.complex64))


def _device_mismatch(rank: int, world_size: int) -> tuple[str, str]:
    bn = syncbn.SyncBatchNorm(3)
    x = torch.randn(4, 3, device="meta" if rank == 0 else "cpu")
    return outcome(bn, x)


def test_input_on_another_device_than_the_parameters(pool2: WorkerPool) -> None:
    (kind0, message0), (kind1, message1) = pool2.run(_device_mismatch)
    assert kind0 == "RuntimeError" and "input on meta and parameters on cpu" in message0
    assert kind1 == "RuntimeError" and "1 other rank(s) failed" in message1


def _dtype_mismatch(rank: int, world_size: int) -> tuple[str, str]:
    bn = syncbn.SyncBatchNorm(3)  # float32 parameters and buffers
    x = torch.randn(4, 3, dtype=torch.float64 if rank == 0 else torch.float32)
    return outcome(bn, x)


def test_input_of_a_dtype_the_parameters_refuse(pool2: WorkerPool) -> None:
    """A float64 input into a float32 layer, on one rank: torch's batch norm refuses it,
    and so does every rank of the synchronized call (it computed, in training only, before)."""
    (kind0, message0), (kind1, message1) = pool2.run(_dtype_mismatch)
    assert kind0 == "RuntimeError" and "got input of dtype torch.float64 and a" in message0
    assert kind1 == "RuntimeError" and "1 other rank(s) failed" in message1


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("masked", [False, True], ids=["unmasked", "masked"])
@pytest.mark.parametrize(
    ("input_dtype", "layer_dtype", "accepted"),
    [
        (torch.float64, torch.float32, False),
        (torch.float32, torch.float64, False),
        (torch.bfloat16, torch.float64, False),
        (torch.bfloat16, torch.float32, True),  # torch's mixed precision: float32 parameters
        (torch.float64, torch.float64, True),
    ],
)
def test_parameter_dtypes_follow_torch_batch_norm_on_every_path(
    training: bool,
    masked: bool,
    input_dtype: torch.dtype,
    layer_dtype: torch.dtype,
    accepted: bool,
) -> None:
    """Without a process group the layer is torch's BatchNorm (unmasked) or syncbn's own
    kernels (masked): both take the dtypes that ``F.batch_norm`` takes, and no others."""
    bn = syncbn.SyncBatchNorm(3, dtype=layer_dtype).train(training)
    x = torch.randn(4, 3, 5).to(input_dtype)
    mask = torch.rand(4, 5) < 0.7 if masked else None
    try:
        F.batch_norm(x, bn.running_mean, bn.running_var, bn.weight, bn.bias, training=True)
        torch_accepts = True
    except RuntimeError:
        torch_accepts = False
    assert torch_accepts == accepted
    if accepted:
        assert bn(x, mask).dtype == input_dtype
    else:
        with pytest.raises(RuntimeError, match=f"got input of dtype {input_dtype} and a"):
            bn(x, mask)


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("masked", [False, True], ids=["unmasked", "masked"])
def test_parameters_and_buffers_of_mixed_dtypes_are_refused_as_torch_refuses_them(
    training: bool, masked: bool
) -> None:
    """A bfloat16 input with float32 parameters and bfloat16 running statistics: each is
    fine alone, torch's batch norm refuses the mix, and so does every path of the layer
    (the synchronized and masked ones accepted it, and the model failed in eval later)."""
    bn = syncbn.SyncBatchNorm(3).train(training)
    bn.running_mean = torch.zeros(3, dtype=torch.bfloat16)
    bn.running_var = torch.ones(3, dtype=torch.bfloat16)
    x = torch.randn(4, 3, 5).bfloat16()
    mask = torch.rand(4, 5) < 0.7 if masked else None
    with pytest.raises(RuntimeError):
        F.batch_norm(x, bn.running_mean, bn.running_var, bn.weight, bn.bias, training=training)
    with pytest.raises(RuntimeError, match="bfloat16 beside others of dtype torch.float32"):
        bn(x, mask)


def _training_without_grad(rank: int, world_size: int) -> dict[str, Any]:
    bn = syncbn.SyncBatchNorm(3, momentum=1.0)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3 * world_size, 3, generator=gen)
    with torch.no_grad():
        y = bn(x[3 * rank : 3 * rank + 3])
    assert bn.running_mean is not None
    return {"requires_grad": y.requires_grad, "mean": bn.running_mean.clone(), "x": x}


def test_training_mode_under_no_grad_still_syncs(pool: WorkerPool) -> None:
    for result in pool.run(_training_without_grad):
        assert not result["requires_grad"]
        torch.testing.assert_close(result["mean"], result["x"].mean(0))


def test_functional_without_process_group_is_batch_norm() -> None:
    x = torch.randn(4, 3, 5)
    mean, var = torch.zeros(3), torch.ones(3)
    expected = F.batch_norm(x, torch.zeros(3), torch.ones(3), training=True)
    assert torch.equal(syncbn.sync_batch_norm(x, mean, var, training=True), expected)
