"""benchmarks/scale.py: byte counting, the alpha-beta models, and parity of both designs.

Pure functions are checked on small inputs by hand; the multi-rank tests check that the
collectives counted in real layer calls are the ones the model prices, and that both
designs match BatchNorm on the global batch in float64, at 2 and 3 ranks. No timing.

World size 8 is checked by ``python benchmarks/scale.py`` (scale.md, parity table), not
here: a pool of 8 ranks cost 26-70 s on the 2-core CI machine (8 interpreters importing
torch, then their teardown), more than the suite's budget allows.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from _harness import WorkerPool

from syncbn import _protocol
from syncbn._cli.measure import Collective, count_collectives

SCALE = Path(__file__).resolve().parents[1] / "benchmarks" / "scale.py"


def _load() -> ModuleType:
    """Import ``benchmarks/scale.py`` by path (benchmarks/ is not a package)."""
    spec = importlib.util.spec_from_file_location("syncbn_benchmarks_scale", SCALE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module


# loaded again in every rank that imports this file to run a scenario
scale = _load()


# --------------------------------------------------------------------------- bytes


def test_resnet50_has_53_batchnorm_layers() -> None:
    channels = scale.resnet50_bn_channels()
    assert len(channels) == 53
    assert channels[:5] == [64, 64, 64, 256, 256]  # stem, then layer1.0: bn1, bn2, bn3, downsample
    assert sum(channels) == 26560
    assert {c: channels.count(c) for c in sorted(set(channels))} == {
        64: 7,
        128: 8,
        256: 16,
        512: 11,
        1024: 7,
        2048: 4,
    }


def test_design_payloads_match_the_protocol_and_torch() -> None:
    c = 16
    assert scale.design_collectives("syncbn", c) == [
        Collective("all_reduce", _protocol.forward_size(c) * 8),
        Collective("all_reduce", _protocol.backward_size(c) * 8),
    ]
    assert scale.design_collectives("allgather", c) == [
        Collective("all_gather", 33 * 4),
        Collective("all_reduce", 32 * 4),
    ]
    assert [x.nbytes for x in scale.design_collectives("syncbn_fp32", c)] == [37 * 4, 37 * 4]
    with pytest.raises(ValueError, match="unknown design"):
        scale.design_collectives("nccl", c)


def test_received_and_ring_bytes() -> None:
    gather, reduce = Collective("all_gather", 12), Collective("all_reduce", 16)
    assert scale.received_bytes(gather, 4) == 48
    assert scale.received_bytes(reduce, 4) == 16
    assert scale.ring_wire_bytes(gather, 4) == 36
    assert scale.ring_wire_bytes(reduce, 4) == 24
    assert scale.ring_steps("all_gather", 4) == 3
    assert scale.ring_steps("all_reduce", 4) == 6
    with pytest.raises(ValueError):
        scale.received_bytes(Collective("broadcast", 4), 2)


def test_bytes_crossover_on_a_ring_is_six_ranks() -> None:
    """syncbn moves fewer ring bytes than the all_gather design above 6 ranks, more below."""

    def wire(design: str, w: int) -> float:
        return sum(scale.ring_wire_bytes(x, w) for x in scale.design_collectives(design, 512))

    assert wire("syncbn", 4) > wire("allgather", 4)
    assert wire("syncbn", 8) < wire("allgather", 8)


# --------------------------------------------------------------------------- models


def test_fit_recovers_exact_constants() -> None:
    c, alpha, beta = 50e-6, 20e-6, 1e-9
    points = [
        (steps, nbytes, c + alpha * steps + beta * nbytes)
        for steps in (1, 2, 6, 14)
        for nbytes in (64.0, 4096.0, 1e6)
    ]
    fit = scale.fit_alpha_beta(points)
    assert fit["c"] == pytest.approx(c, rel=1e-6)
    assert fit["alpha"] == pytest.approx(alpha, rel=1e-6)
    assert fit["beta"] == pytest.approx(beta, rel=1e-6)
    assert scale.gloo_time(Collective("all_reduce", 1000), 4, fit) == pytest.approx(
        c + 6 * alpha + 1500 * beta
    )
    with pytest.raises(ValueError):
        scale.fit_alpha_beta(points[:2])


def test_collective_time_by_hand() -> None:
    fabric = scale.Fabric("test", 8, nvlink_busbw=100e9, net_busbw=10e9)
    assert scale.collective_time("all_reduce", 800, 1, fabric) == (0.0, "none")
    # one node: a ring all_gather of 8 x 1000 bytes, 7 NVLink steps
    t, algorithm = scale.collective_time("all_gather", 1000, 8, fabric)
    assert algorithm == "ring"
    assert t == pytest.approx(3.6e-6 + 7 * 0.47e-6 + 7000 / 100e9)
    # 16 nodes: the tree's 2 x (7 intra + 4 inter) hops beat the ring's 254 steps
    t, algorithm = scale.collective_time("all_reduce", 1000, 128, fabric)
    assert algorithm == "tree"
    assert t == pytest.approx(4.4e-6 + 2 * (7 * 0.52e-6 * 1.8 + 4 * 5.0e-6) + 2000 / 10e9)
    ring = 3.6e-6 + (254 - 30) * 0.47e-6 * 1.8 + 30 * 2.7e-6 + 2 * 127 / 128 * 1000 / 10e9
    assert t < ring


def test_step_time_sums_the_layers() -> None:
    fabric = scale.FABRICS[0]
    channels = [64, 2048]
    expected = sum(
        scale.collective_time(x.name, x.nbytes, 64, fabric)[0]
        for c in channels
        for x in scale.design_collectives("syncbn", c)
    )
    assert scale.step_time("syncbn", 64, fabric, channels) == pytest.approx(expected)
    # torch's all_gather grows with W; syncbn's all_reduce grows with log(nodes)
    at_1024 = scale.step_time("syncbn", 1024, fabric) / scale.step_time("allgather", 1024, fabric)
    assert at_1024 < 1
    crossing = scale.crossover(fabric, list(range(8, 1025, 8)))
    assert crossing is not None and 8 < crossing < 1024
    assert math.isfinite(at_1024)


# --------------------------------------------------------------------------- on ranks


def _counted(rank: int, world_size: int, channels: int) -> list[list[Any]]:
    x = torch.randn(2 + rank, channels, 3, 3, requires_grad=True)
    logs = []
    for design in ("syncbn", "allgather"):
        layer = scale._layer(design, channels)
        with count_collectives() as log:
            y = layer(x)
            torch.autograd.grad(y, [x, *layer.parameters()], torch.randn_like(y))
        logs.append([[c.name, c.nbytes] for c in log])
    return logs


def test_counted_collectives_are_the_modelled_ones(pool: WorkerPool) -> None:
    for rank_logs in pool.run(_counted, 5):
        for design, log in zip(("syncbn", "allgather"), rank_logs):
            expected = [[c.name, c.nbytes] for c in scale.design_collectives(design, 5)]
            assert log == expected


def _parity(rank: int, world_size: int) -> dict[str, dict[str, float]]:
    return {d: scale.parity_rank(rank, world_size, d) for d in ("syncbn", "allgather")}


def _check_parity(results: list[dict[str, dict[str, float]]]) -> None:
    for result in results:
        for design, diffs in result.items():
            scale_of_output = diffs.pop("scale")
            assert scale_of_output > 1
            for key, value in diffs.items():
                assert value < 1e-12, (design, key, value)


def test_parity_with_batchnorm(pool: WorkerPool) -> None:
    _check_parity(pool.run(_parity))
