"""Print the largest absolute error of every gold comparison (not a test; run it by hand).

    python tests/report_gold_errors.py

Runs the cases of ``test_batchnorm.py`` on 2 and 3 gloo ranks, with the same
comparison and tolerances, and prints the worst |syncbn - torch BatchNorm| over
outputs, input gradients, summed weight/bias gradients and running statistics.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _gold import compare, reference, run_rank  # noqa: E402
from _harness import WorkerPool  # noqa: E402
from test_batchnorm import CASES, SIZES  # noqa: E402


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
        finally:
            pool.close()


if __name__ == "__main__":
    main()
