"""Host time per SyncBatchNorm layer call: a training step of tiny layers, where the data
costs nothing and what is left is each call's fixed cost (Python, dispatch, small ops).

    python benchmarks/host_overhead.py                # ~1 min on 2 CPU cores; writes .md/.json
    python benchmarks/host_overhead.py --device cuda  # one GPU: launches and host time

One process, one thread, a one-rank gloo group with the synchronized path forced
(``_sync_alone``) and syncbn's all_reduce returning its buffer (what a one-rank sum is),
so that every check, pack and op of a synchronized call runs but no transport. The model
is 15 blocks of ``Conv2d(16, 16, 1)``, BatchNorm and ReLU on a ``2x16x4x4`` input;
forward and backward. Variants: BatchNorm and syncbn, eager and under
``torch.compile(fullgraph=True)`` (inductor), and syncbn eager in each check mode
(``check_mode="deferred"``, the default on accelerators, and ``"immediate"``, the CPU's),
whatever the device here: one of these two runs the same code as ``syncbn eager`` (the
device's default), so that the spread between rows of one mode shows the run's noise.
The per-layer figure is the step's time divided by 15; ``syncbn - batchnorm`` is what a
synchronized layer call adds on the host, and ``syncbn / batchnorm`` the ratio of the two
steps (of the same mode), which compares machines whose hosts differ in speed: the H200's
host of 2026-12-04 took 265 µs per BatchNorm layer, this CPU VM 43-74.
Per variant the best of 5 blocks of 50 steps, the variants in turns over 3 rounds.

This is where issue 19 (host time per call on a GPU) and issue 20 (compiled steps,
whose syncbn ops run once per layer and direction) are decided for small layers.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import syncbn
from syncbn import _protocol
from syncbn._cli.measure import machine_info

__all__ = ["main"]

HERE = Path(__file__).parent
LAYERS = 15
ROUNDS = 3
#: untimed steps before each variant's timed blocks, in every round
WARMUP_STEPS = 5


def _no_transport(buffer: torch.Tensor, group: Any = None) -> torch.Tensor:
    return buffer


def _model(synchronized: bool, device: torch.device, check_mode: str = "auto") -> nn.Module:
    blocks = [
        layer
        for _ in range(LAYERS)
        for layer in (nn.Conv2d(16, 16, 1), nn.BatchNorm2d(16), nn.ReLU())
    ]
    model: nn.Module = nn.Sequential(*blocks).to(device)
    if not synchronized:
        return model
    model = syncbn.convert_sync_batchnorm(model)
    for module in model.modules():
        if isinstance(module, syncbn.SyncBatchNorm):
            module._sync_alone = True  # the synchronized path over the one-rank group
            module.check_mode = check_mode
    return model


def _step_ms(model: Any, x: torch.Tensor, steps: int = 50, blocks: int = 5) -> float:
    def step() -> None:
        model(x).sum().backward()

    for _ in range(WARMUP_STEPS):
        step()
    best = float("inf")
    for _ in range(blocks):
        if x.is_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            step()
        if x.is_cuda:
            torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - start) / steps * 1e3)
    return best


def _block_sizes(device_type: str) -> tuple[int, int]:
    """Steps per timed block, and blocks per variant and round: on a GPU a synchronized
    eager step of 15 layers took ~33 ms (2026-11-28, H100), so fewer steps there keep the
    script within the lease's two minutes for it."""
    return (20, 3) if device_type == "cuda" else (50, 5)


def _pinned_pool(device: torch.device) -> tuple[float, float]:
    """Blocks the CUDA pinned-memory pool has created so far, and the microseconds spent in
    CUDA creating them; zeros off CUDA (or before torch's ``host_memory_stats``).

    A deferred check copies its header into pinned memory at each call. The pool caches
    the blocks; a growth per step would be a CUDA host allocation per call (a suspect for
    the 2026-12-04 run, where two rows of the same code read 1302 and 2218 µs per layer).
    """
    if device.type != "cuda" or not hasattr(torch.cuda, "host_memory_stats"):
        return 0.0, 0.0
    stats = torch.cuda.host_memory_stats()
    return float(stats.get("num_host_alloc", 0)), float(stats.get("host_alloc_time.total", 0))


def measure(device: torch.device) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """Step time (ms) per variant, the best over the rounds; and per variant the pinned
    pool's growth per step (:func:`_pinned_pool`) and the most deferred checks pending
    after its steps."""
    x = torch.randn(2, 16, 4, 4, device=device)
    variants: dict[str, Any] = {}
    for name, synchronized in (("batchnorm", False), ("syncbn", True)):
        torch.manual_seed(0)
        model = _model(synchronized, device)
        variants[f"{name} eager"] = model
        variants[f"{name} compiled"] = torch.compile(model, fullgraph=True)
    # each check mode, whatever the device: one repeats "syncbn eager" (see the docstring)
    for mode in ("deferred", "immediate"):
        torch.manual_seed(0)
        variants[f"syncbn eager {mode}"] = _model(True, device, check_mode=mode)
    steps, blocks = _block_sizes(device.type)
    best = {name: float("inf") for name in variants}
    state = {name: {"pinned blocks": 0.0, "pinned us": 0.0, "pending": 0.0} for name in variants}
    run = ROUNDS * (WARMUP_STEPS + steps * blocks)  # a variant's steps in all rounds
    for _ in range(ROUNDS):
        for name, model in variants.items():
            blocks_before, us_before = _pinned_pool(device)
            best[name] = min(best[name], _step_ms(model, x, steps, blocks))
            blocks_after, us_after = _pinned_pool(device)
            state[name]["pinned blocks"] += (blocks_after - blocks_before) / run
            state[name]["pinned us"] += (us_after - us_before) / run
            pending = float(len(_protocol._pending))
            state[name]["pending"] = max(state[name]["pending"], pending)
    return best, state


def _markdown(
    times: dict[str, float],
    info: dict[str, Any],
    device: str,
    state: dict[str, dict[str, float]] | None = None,
) -> str:
    steps, blocks = _block_sizes(torch.device(device).type)
    gpu = f"; {info['cuda']}" if torch.device(device).type == "cuda" else ""
    lines = [
        "# Host time per SyncBatchNorm layer call",
        "",
        f"Generated by `python benchmarks/host_overhead.py --device {device}` on {info['date']}; "
        f"torch {info['torch']}; {info['cpu']}{gpu}; one process, one thread, one-rank gloo "
        "group with the synchronized path forced and no transport; 15 x (Conv2d(16, 16, 1), "
        f"BatchNorm, ReLU) on 2x16x4x4, forward+backward. Best of {blocks} blocks of {steps} "
        f"steps, {ROUNDS} rounds in turns. Load average at the end: {info['load_average']}. "
        "`checks`: the check mode each syncbn row resolves to on this device (`deferred`: "
        "checks and running statistics on the device, read back later, the default on "
        "accelerators; `immediate`: read at once, the CPU's). Rows of one mode run the same "
        "code: their spread is this run's noise.",
        "",
        "| variant | checks | step ms | per layer µs | syncbn - batchnorm per layer µs "
        "| syncbn / batchnorm |",
        "|---|---|---|---|---|---|",
    ]
    for name, ms in times.items():
        kind, mode, *check_mode = name.split()
        extra = ratio = checks = "-"
        if kind == "syncbn":
            batchnorm = times[f"batchnorm {mode}"]
            extra = f"{(ms - batchnorm) / LAYERS * 1e3:.0f}"
            ratio = f"{ms / batchnorm:.2f}x"
            # compiled: the ops' checks, in the default mode as eager
            checks = _protocol.resolve_check_mode(
                check_mode[0] if check_mode else "auto", torch.device(device)
            )
        lines.append(
            f"| {name} | {checks} | {ms:.3f} | {ms / LAYERS * 1e3:.0f} | {extra} | {ratio} |"
        )
    if state is not None and torch.device(device).type == "cuda":
        lines += [
            "",
            "Per variant, over all its steps: the blocks CUDA's pinned-memory pool created "
            "(a CUDA host allocation each) and the time spent creating them, per step; and the "
            "most deferred checks pending after its steps, whichever variant left them (a "
            "deferred call reads those of earlier calls: 1, the last backward's, is the "
            "steady state; more would mean that they pile up).",
            "",
            "| variant | pinned blocks per step | pinned allocation µs per step | pending |",
            "|---|---|---|---|",
        ]
        for name, row in state.items():
            lines.append(
                f"| {name} | {row['pinned blocks']:.2f} | {row['pinned us']:.1f} "
                f"| {row['pending']:.0f} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--out", type=Path, default=HERE / "host_overhead.md")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    torch.set_num_threads(1)
    syncbn.distributed.all_reduce_sum_ = _no_transport  # type: ignore[assignment]
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group(
            "gloo", init_method=f"file://{tmp}/rendezvous", rank=0, world_size=1
        )
        try:
            times, state = measure(device)
        finally:
            dist.destroy_process_group()
    info = machine_info()
    args.out.write_text(_markdown(times, info, args.device, state))
    record = {
        "machine": info,
        "device": args.device,
        "step_ms": times,
        "state": state,
        "layers": LAYERS,
    }
    args.out.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
    print(args.out.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
