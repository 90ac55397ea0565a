"""``syncbn demo``: see SyncBatchNorm match big-batch training where plain BatchNorm does not.

The demo trains one small CNN on scikit-learn's bundled 8x8 digits three ways from
one seed: (a) plain BatchNorm under DistributedDataParallel on ``--nproc`` local
ranks (each normalizes with its own ``--batch-per-proc`` samples), (b) the same model
after :func:`syncbn.convert_sync_batchnorm` under DDP, and (c) plain BatchNorm in one
process on the whole global batch. (b) follows (c) to rounding error; (a) does not.
It prints a table, and writes ``curves.png`` and ``results.json`` to ``--out``.

This module is the parent process; each rank runs :mod:`syncbn._cli.demo_train`,
started by :mod:`syncbn._cli.launch` (spawn, ``file://`` rendezvous in a temporary
directory). If a rank fails, or on Ctrl-C, every rank is stopped before the command
returns. torch, numpy and scikit-learn are imported when the demo runs.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

from syncbn._cli.demo_config import RUNS, DemoConfig, DemoData
from syncbn._cli.output import new_file_refusal

__all__ = [
    "RUNS",
    "DemoConfig",
    "DemoData",
    "DemoError",
    "add_arguments",
    "format_table",
    "load_data",
    "run",
    "run_demo",
]

DEFAULT_OUT = "syncbn-demo"
PLOT_FILE = "curves.png"
RESULTS_FILE = "results.json"
# the data set, saved for the ranks in a temporary directory: small arguments keep the
# spawning of the ranks from waiting on each other
DATA_FILE = "data.npz"
#: How long a rank waits in a collective for its peers before failing, in seconds.
PROCESS_GROUP_TIMEOUT = 60.0
TEST_FRACTION = 0.2
EXIT_INTERRUPTED = 130
_DEMO_PACKAGES = {"sklearn": "scikit-learn", "matplotlib": "matplotlib", "tqdm": "tqdm"}


class DemoError(RuntimeError):
    """A rank failed or the demo was interrupted; every rank has been stopped."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got '{text}'") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got '{text}'") from None
    if not 0 <= value < 2**32:
        raise argparse.ArgumentTypeError(f"expected an integer in [0, 2**32), got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got '{text}'") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive finite number, got {text}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``syncbn demo`` to ``parser``."""
    defaults = DemoConfig()
    parser.description = (
        "Train a small CNN with BatchNorm on scikit-learn's digits three ways from one seed: "
        "(a) plain BatchNorm under DDP on --nproc local processes (per-process statistics), "
        "(b) syncbn.SyncBatchNorm under DDP, (c) plain BatchNorm in one process on the global "
        "batch. SyncBatchNorm (b) matches the big-batch run (c); plain BatchNorm (a) does not. "
        f"Prints a table and writes {PLOT_FILE} and {RESULTS_FILE} to --out."
    )
    parser.add_argument(
        "--nproc",
        type=_positive_int,
        default=defaults.nproc,
        help="number of local processes (ranks) for the DDP runs (default: %(default)s)",
    )
    parser.add_argument(
        "--batch-per-proc",
        type=_positive_int,
        default=defaults.batch_per_proc,
        metavar="B",
        help="samples per process and step; the global batch is nproc*B (default: %(default)s)",
    )
    parser.add_argument(
        "--steps",
        type=_positive_int,
        default=defaults.steps,
        help="optimizer steps of each run (default: %(default)s)",
    )
    parser.add_argument(
        "--seed",
        type=_seed,
        default=defaults.seed,
        help="seed of the data split, the weights and the batch order (default: %(default)s)",
    )
    parser.add_argument(
        "--lr",
        type=_positive_float,
        default=defaults.lr,
        help="initial SGD learning rate; momentum 0.9, cosine decay to 0 (default: %(default)s)",
    )
    parser.add_argument(
        "--out",
        default=DEFAULT_OUT,
        help=f"output folder for {PLOT_FILE} and {RESULTS_FILE} (default: ./%(default)s)",
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default=defaults.device,
        help="cpu with the gloo backend, or cuda (one GPU per process) with nccl "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--dtype",
        choices=("float64", "float32"),
        default=defaults.dtype,
        help="dtype of the model and data; float64 shows the (b)/(c) match to ~1e-12 "
        "(default: %(default)s)",
    )


def _usage_error(message: str) -> argparse.ArgumentError:
    return argparse.ArgumentError(None, message)


def _check_environment(device: str, nproc: int) -> None:
    missing = [
        pip for module, pip in _DEMO_PACKAGES.items() if not importlib.util.find_spec(module)
    ]
    if missing:
        raise DemoError(
            f"syncbn demo needs {', '.join(missing)}; install the demo extra: "
            "pip install 'syncbn[demo]'"
        )
    if device == "cuda":
        import torch
        import torch.distributed as dist

        if not torch.cuda.is_available():
            raise _usage_error(
                "argument --device: cuda requested but CUDA is not available "
                f"(torch {torch.__version__}, built with CUDA: {torch.version.cuda or 'no'}); "
                "use --device cpu"
            )
        if not dist.is_nccl_available():
            raise _usage_error("argument --device: cuda needs the nccl backend, not available")
        if torch.cuda.device_count() < nproc:
            raise _usage_error(
                f"argument --nproc: --device cuda uses one GPU per process, but --nproc is "
                f"{nproc} and only {torch.cuda.device_count()} GPU(s) are visible"
            )


def _check_out(out: str) -> str:
    out = os.path.abspath(out)
    if os.path.exists(out) and not os.path.isdir(out):
        raise _usage_error(f"argument --out: '{out}' exists and is not a directory")
    return out


def _make_out(out: str) -> None:
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as error:
        raise _usage_error(f"argument --out: cannot create '{out}': {error}") from None
    if not os.access(out, os.W_OK):
        raise _usage_error(f"argument --out: '{out}' is not writable")
    for name in (RESULTS_FILE, PLOT_FILE):  # written after training: refused before it
        path = os.path.join(out, name)
        if os.path.isdir(path):
            raise _usage_error(f"argument --out: '{path}' is a directory")
    refusal = new_file_refusal(out)
    if refusal is not None:
        raise _usage_error(f"argument --out: cannot write to '{out}': {refusal}")


def load_data(seed: int) -> DemoData:
    """Digits 8x8 images (``sklearn.datasets.load_digits``) split into train and test sets.

    Returns:
        A :class:`DemoData` of numpy arrays, the test set being a
        stratified fifth of the 1797 images.
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = (digits.images / 16.0).astype("float64")[:, None, :, :]
    train_x, test_x, train_y, test_y = train_test_split(
        images, digits.target, test_size=TEST_FRACTION, random_state=seed, stratify=digits.target
    )
    return DemoData(train_x, train_y.astype("int64"), test_x, test_y.astype("int64"))


def _train_on_ranks(
    config: DemoConfig, data: DemoData, workdir: str, on_start: Callable[[list[int]], None] | None
) -> dict[str, Any]:
    """Run :func:`syncbn._cli.demo_train.rank_main` on ``config.nproc`` spawned ranks.

    Returns rank 0's results once every rank has exited successfully. Otherwise (a
    rank failed, Ctrl-C, SIGTERM) every rank process still alive is terminated, then
    killed if needed, before :class:`DemoError` is raised.
    """
    import numpy as np

    from syncbn._cli.demo_train import rank_main
    from syncbn._cli.launch import RankError, run_on_ranks

    data_path = os.path.join(workdir, DATA_FILE)
    np.savez(data_path, **data._asdict())
    try:
        results = run_on_ranks(
            rank_main,
            config.nproc,
            config,
            data_path,
            backend="nccl" if config.device == "cuda" else "gloo",
            pg_timeout=PROCESS_GROUP_TIMEOUT,
            on_start=on_start,
        )
    except KeyboardInterrupt:
        raise DemoError("interrupted; every rank process is stopped", EXIT_INTERRUPTED) from None
    except RankError as error:
        if error.traceback is None:
            raise DemoError(f"{error}; stopped every rank") from None
        raise DemoError(
            f"{error}; stopped every rank. Traceback of rank {error.rank}:\n{error.traceback}"
        ) from None
    rank0: dict[str, Any] = results[0]
    return rank0


def run_demo(
    config: DemoConfig,
    out: str,
    on_start: Callable[[list[int]], None] | None = None,
) -> dict[str, Any]:
    """Run the demo: train the three runs, then write the plot and the JSON to ``out``.

    Args:
        config: the settings.
        out: output folder, created if needed.
        on_start: called with the rank processes' pids once they are started (a
            testing hook).

    Returns:
        The results, as written to ``results.json``.

    Raises:
        argparse.ArgumentError: for settings that cannot work (e.g. a global batch
            larger than the training set), before any process starts.
        DemoError: if a rank failed or the demo was interrupted; every rank process
            has been stopped.
    """
    from syncbn._cli.demo_plot import save_plot

    _check_environment(config.device, config.nproc)
    out = _check_out(out)
    data = load_data(config.seed)
    if config.global_batch > len(data.train_y):
        raise _usage_error(
            f"argument --batch-per-proc: the global batch --nproc x --batch-per-proc = "
            f"{config.nproc} x {config.batch_per_proc} = {config.global_batch} is larger than "
            f"the {len(data.train_y)} training images"
        )
    _make_out(out)
    from syncbn._cli.launch import sigterm_as_interrupt

    with tempfile.TemporaryDirectory(prefix="syncbn-demo-") as workdir:
        with sigterm_as_interrupt():
            ranks_results = _train_on_ranks(config, data, workdir, on_start)
    text = json.dumps(ranks_results)
    results: dict[str, Any] = json.loads(text)  # what results.json holds, JSON types
    try:
        with open(os.path.join(out, RESULTS_FILE), "w") as file:
            file.write(text)
        save_plot(results, os.path.join(out, PLOT_FILE))
    except OSError as error:  # the folder changed while the ranks trained
        raise DemoError(f"cannot write the results to '{out}': {error}") from None
    return results


def format_table(results: dict[str, Any]) -> str:
    """The summary table of a demo's results, as printed by ``syncbn demo``."""
    runs = results["runs"]
    header = ("run", "train loss", "test acc", "train time", "max |diff| vs (c)")
    rows = []
    for key, record in runs.items():
        difference = record["max_abs_diff_vs_single_process"]
        both = (difference["parameters"], difference["buffers"])
        largest = math.nan if any(math.isnan(value) for value in both) else max(both)
        rows.append(
            (
                record["label"],
                f"{record['train_loss']:.4f}",
                f"{100 * record['test_accuracy']:.1f} %",
                f"{record['train_seconds']:.1f} s",
                "(reference)" if key == "single_process" else f"{largest:.1e}",
            )
        )
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        first = cells[0].ljust(widths[0])
        rest = (cell.rjust(width) for cell, width in zip(cells[1:], widths[1:]))
        return "  ".join([first, *rest])

    rule = "  ".join("-" * width for width in widths)
    config = results["config"]
    steps = runs["single_process"]["curve"]["step"]
    window = steps[-1] - (steps[-2] if len(steps) > 1 else 0)
    notes = [
        f"{results['train_size']} training / {results['test_size']} test images, "
        f"{config['steps']} steps, global batch {results['global_batch']} "
        f"({config['nproc']} x {config['batch_per_proc']}), {config['dtype']}, "
        f"seed {config['seed']}.",
        f"train loss: mean over the global batches of the last {window} steps (training mode).",
        "test acc: the final model in eval mode (running statistics).",
        "train time: the optimizer steps, on rank 0.",
        "max |diff| vs (c): largest difference of any parameter or running statistic from (c).",
    ]
    return "\n".join([line(header), rule, *(line(row) for row in rows), "", *notes])


def run(args: argparse.Namespace) -> int:
    """Run ``syncbn demo`` with parsed options; return the exit code.

    Raises:
        argparse.ArgumentError: for options that cannot work together; the CLI
            reports it like a parsing error (exit code 2).
    """
    config = DemoConfig(
        nproc=args.nproc,
        batch_per_proc=args.batch_per_proc,
        steps=args.steps,
        seed=args.seed,
        lr=args.lr,
        device=args.device,
        dtype=args.dtype,
    )
    start = time.monotonic()
    try:
        results = run_demo(config, args.out)
    except DemoError as error:
        print(f"syncbn demo: error: {error}", file=sys.stderr)
        return error.exit_code
    out = os.path.abspath(args.out)
    print(format_table(results))
    print(
        f"\nwrote {os.path.join(out, PLOT_FILE)} and {os.path.join(out, RESULTS_FILE)} "
        f"({time.monotonic() - start:.0f} s)"
    )
    return 0
