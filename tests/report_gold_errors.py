"""Print the measured errors behind the tests (not a test; run it by hand).

    python tests/report_gold_errors.py

On 2 and 3 gloo ranks, with the tests' own scenarios and tolerances: the worst
|syncbn - torch BatchNorm| of every gold case of ``test_batchnorm.py`` (outputs, input
gradients, summed weight/bias gradients, running statistics); the worst parameter or
buffer difference of the DDP runs of ``test_ddp.py`` from one process on the global
batch; and the relative error of the float32 mean-1e4 case of ``test_collectives.py``.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
from _gold import compare, reference, run_rank  # noqa: E402
from _harness import WorkerPool  # noqa: E402
from test_batchnorm import CASES, SIZES  # noqa: E402
from test_collectives import _large_mean_statistics  # noqa: E402
from test_ddp import SIZES as DDP_SIZES  # noqa: E402
from test_ddp import _max_error, _train_ddp, _train_reference  # noqa: E402

_DDP_OPTIONS: list[dict[str, Any]] = [
    {},
    {"micro": 2},
    {"checkpointing": "reentrant"},
    {"checkpointing": "non-reentrant"},
    {"ddp": {"broadcast_buffers": False}},
]


def _ddp_errors(pool: WorkerPool) -> None:
    for sizes in DDP_SIZES[pool.world_size]:
        for options in _DDP_OPTIONS:
            states = pool.run(_train_ddp, sizes, options)
            reference = _train_reference(sizes, {k: v for k, v in options.items() if k == "micro"})
            worst = _max_error(states, reference)
            print(f"ddp {str(options):32s} {pool.world_size:5d} {str(sizes):>10s} {worst:14.3e}")


def _large_mean_errors(pool: WorkerPool) -> None:
    sizes = (3, 5) if pool.world_size == 2 else (2, 0, 6)
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(sum(sizes), 4, 16, 16, generator=gen, dtype=torch.float64) + 1e4).float()
    var, mean = torch.var_mean(x.double(), dim=(0, 2, 3), correction=1)
    stats = pool.run(_large_mean_statistics, sizes)[0]
    mean_error = ((stats[0] - mean).abs() / mean.abs()).max().item()
    var_error = ((stats[1] - var).abs() / var).max().item()
    print(f"mean 1e4, std 1 (float32), relative error: mean {mean_error:.2e}, var {var_error:.2e}")


def main() -> None:
    print(f"{'case':28s} {'world':>5s} {'sizes':>10s} {'max abs error':>14s}")
    for world_size in (2, 3):
        pool = WorkerPool(world_size)
        try:
            for name, base in CASES.items():
                for sizes in SIZES[world_size]:
                    case = dataclasses.replace(base, sizes=sizes)
                    worst = compare(case, pool.run(run_rank, case), reference(case))
                    print(f"{name:28s} {world_size:5d} {str(sizes):>10s} {worst:14.3e}")
            _ddp_errors(pool)
            _large_mean_errors(pool)
        finally:
            pool.close()


if __name__ == "__main__":
    main()
