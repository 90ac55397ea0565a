"""Run the syncbn benchmark suite and write results.md and results.json.

Usage (from the repository root)::

    python benchmarks/run.py            # everything, about 8 minutes on 2 CPU cores
    python benchmarks/run.py --quick    # smoke run, about a minute; writes results-quick.*

See benchmarks/README.md for what is measured and how to read the results.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import compute
import report
import suite

import syncbn
from syncbn._cli.launch import run_on_ranks
from syncbn._cli.measure import machine_info

__all__ = ["main"]

HERE = Path(__file__).resolve().parent
SECTIONS = ("layers", "blocks", "profiles", "memory", "model", "collectives", "compute")
# sections measured outside the ranks of the main suite
_OWN_PROCESSES = ("collectives", "compute")


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    backend = "nccl" if args.device == "cuda" else "gloo"
    if args.quick:
        cases = [
            {"shape": [2, 64, 56, 56], "dtype": "float32", "memory_format": "contiguous"},
            {"shape": [16, 1024], "dtype": "float32", "memory_format": "contiguous"},
            {"shape": [2, 64, 56, 56], "dtype": "bfloat16", "memory_format": "channels_last"},
        ]
        return {
            "device": args.device,
            "backend": backend,
            "world_size": 2,
            "sections": args.sections,
            "repeats": 5,
            "min_block_time": 0.005,
            "block_repeats": 3,
            "block_min_time": 0.005,
            "warmup": 2,
            "cases": cases,
            "block_cases": cases[:1],
            "profile_cases": cases[:1],
            "profile_iterations": 3,
            "memory_cases": cases,
            "model_batch": 8,
            "model_repeats": 5,
            "collective_cases": cases[1:2],
            "world_sizes": [2, 3],
        }
    cases = suite.cases()
    float32 = [case for case in cases if case["dtype"] == "float32"]
    return {
        "device": args.device,
        "backend": backend,
        "world_size": 2,
        "sections": args.sections,
        "repeats": 13,
        "min_block_time": 0.02,
        "block_repeats": 7,
        "block_min_time": 0.01,
        "warmup": 3,
        "cases": cases,
        "block_cases": float32,
        "profile_cases": cases,
        "profile_iterations": 10,
        "memory_cases": cases,
        "model_batch": 8,
        "model_repeats": 21,
        "collective_cases": [
            {"shape": [2, 64, 56, 56], "dtype": "float32", "memory_format": "contiguous"},
            {"shape": [16, 1024], "dtype": "float32", "memory_format": "contiguous"},
            {"shape": [2, 32, 8, 28, 28], "dtype": "bfloat16", "memory_format": "channels_last"},
        ],
        "world_sizes": [2, 3, 4],
    }


def _git_revision() -> str | None:
    try:
        revision = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=HERE,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "src"],
            cwd=HERE.parent,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return revision + (" + uncommitted changes in src/" if dirty else "")


def _log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a fast smoke run (few cases)")
    parser.add_argument(
        "--sections",
        nargs="+",
        choices=SECTIONS,
        default=list(SECTIONS),
        help="run only these sections (default: all)",
    )
    parser.add_argument(
        "--device", default="cpu", choices=["cpu", "cuda"], help="device (default: cpu)"
    )
    parser.add_argument(
        "--output-dir",
        type=Path,
        default=HERE,
        help="where results[-quick].md/.json go (default: benchmarks/)",
    )
    parser.add_argument(
        "--render",
        type=Path,
        metavar="JSON",
        help="measure nothing: re-derive and rewrite the markdown next to an existing results "
        "JSON (after changing report.py)",
    )
    args = parser.parse_args(argv)
    if args.render is not None:
        measured: dict[str, Any] = json.loads(args.render.read_text())
        derived = report.derive(measured)
        measured["derived"] = derived
        args.render.write_text(json.dumps(measured, indent=1) + "\n")
        markdown = args.render.with_suffix(".md")
        markdown.write_text(report.render_markdown(measured, derived))
        _log(f"rewrote {markdown} from {args.render}")
        return 0
    settings = _settings(args)
    started = time.perf_counter()
    results: dict[str, Any] = {
        "command": "python benchmarks/run.py " + " ".join(argv or sys.argv[1:]),
        "machine": machine_info(),
        "git": _git_revision(),
        "syncbn_path": str(Path(syncbn.__file__).resolve().parent),
        "settings": {k: v for k, v in settings.items() if not k.endswith("cases")},
    }
    _log(f"machine: {results['machine']}")
    rank_sections = [name for name in settings["sections"] if name not in _OWN_PROCESSES]
    if rank_sections:
        _log(f"{settings['world_size']} ranks: {', '.join(rank_sections)}")
        ranks = run_on_ranks(
            suite.main_rank,
            settings["world_size"],
            settings,
            backend=settings["backend"],
            timeout=1200.0,
        )
        results.update(ranks[0])
    if "collectives" in settings["sections"]:
        results["collectives"] = {}
        for world_size in settings["world_sizes"]:
            _log(f"collectives per layer call on {world_size} ranks")
            results["collectives"][str(world_size)] = run_on_ranks(
                suite.collectives_rank,
                world_size,
                settings,
                backend=settings["backend"],
                timeout=600.0,
            )
    if "compute" in settings["sections"] and not args.quick and args.device == "cpu":
        _log("compute without the transport, one process (compute.py -> compute.md)")
        compute.main()
    results["wall_s"] = time.perf_counter() - started
    results["load_average_end"] = [round(v, 2) for v in os.getloadavg()]
    derived = report.derive(results)
    results["derived"] = derived
    stem = "results-quick" if args.quick else "results"
    args.output_dir.mkdir(parents=True, exist_ok=True)
    json_path = args.output_dir / f"{stem}.json"
    md_path = args.output_dir / f"{stem}.md"
    json_path.write_text(json.dumps(results, indent=1) + "\n")
    md_path.write_text(report.render_markdown(results, derived))
    _log(f"wrote {md_path} and {json_path} in {results['wall_s']:.0f} s")
    for target in derived["targets"]:
        print(f"{target['verdict']:4}  {report.describe_target(target)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
