"""The ``syncbn`` command line (also ``python -m syncbn``): ``main(argv) -> int``.

Subcommands:

- ``syncbn demo``: train a small CNN three ways (plain BatchNorm under DDP,
  SyncBatchNorm under DDP, one process on the global batch) and compare them.
- ``syncbn bench``: time BatchNorm against SyncBatchNorm on local gloo ranks.

The package holds the library's applications, apart from the library (which never
imports it):

- ``demo.py`` (the command and its parent process), ``demo_config.py`` (what the
  parent and the ranks share), ``demo_train.py`` (what each rank runs),
  ``demo_plot.py`` (the figure);
- ``bench.py`` (the command) and ``measure.py`` (timing and collective counting, also
  used by ``benchmarks/`` and the tests);
- ``launch.py``: the multi-process launcher of the demo, the benchmarks and the tests;
- ``output.py``: whether the commands' output paths take files, checked before the work.

Importing this package, or a subcommand's module, imports neither torch nor the
library's core: they are imported when a command runs, so ``syncbn --help`` is fast.
Each subcommand's module is imported only when the parser is built, and provides two
functions:

- ``add_arguments(parser: argparse.ArgumentParser) -> None`` adds its options;
- ``run(args: argparse.Namespace) -> int`` runs it and returns the exit code. It may
  raise ``argparse.ArgumentError`` for options that are invalid together (found after
  parsing); the command line then reports it like a parsing error, with exit code 2.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
from collections.abc import Sequence
from types import ModuleType

__all__ = ["build_parser", "main"]

#: subcommand -> (module implementing it, one-line help)
COMMANDS = {
    "demo": (
        "syncbn._cli.demo",
        "train a small CNN with plain BatchNorm and with SyncBatchNorm under DDP on local "
        "processes, and with one big batch; compare them (table, plot)",
    ),
    "bench": (
        "syncbn._cli.bench",
        "time forward+backward of BatchNorm vs SyncBatchNorm layers on local gloo ranks",
    ),
}

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


def _import_command(module_name: str) -> ModuleType | None:
    """The subcommand's module, or ``None`` if that module is not installed."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name != module_name:
            raise  # the module exists but something it imports does not: a real error
        return None


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The ``syncbn`` parser, and the subparser of each subcommand by name.

    Each parsed namespace has ``command``, the subcommand's name. The subcommands'
    modules are imported here, not when this module is imported.
    """
    from syncbn import __version__

    parser = argparse.ArgumentParser(
        prog="syncbn",
        description="Synchronized batch normalization for PyTorch: demo and benchmark.",
        epilog="Run 'syncbn <command> --help' for the options of a command.",
    )
    parser.add_argument("--version", action="version", version=f"syncbn {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="command", required=True)
    commands: dict[str, argparse.ArgumentParser] = {}
    for name, (module_name, help_text) in COMMANDS.items():
        module = _import_command(module_name)
        if module is None:
            help_text = f"(not available: module {module_name} is not installed)"
        subparser = subparsers.add_parser(name, help=help_text, description=help_text)
        if module is not None:
            module.add_arguments(subparser)
        commands[name] = subparser
    return parser, commands


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``syncbn`` command line with ``argv`` (``sys.argv[1:]`` if ``None``).

    Returns:
        The exit code: 0 on success, 2 for invalid options, 130 when interrupted,
        and 1 for other failures.
    """
    try:
        parser, commands = build_parser()
        args = parser.parse_args(argv)
        module_name = COMMANDS[args.command][0]
        module = _import_command(module_name)
        if module is None:
            print(
                f"syncbn {args.command}: error: this command is not available "
                f"(module {module_name} is not installed)",
                file=sys.stderr,
            )
            return 1
        try:
            return int(module.run(args))
        except argparse.ArgumentError as error:
            commands[args.command].error(str(error))  # usage + message, SystemExit(2)
    except SystemExit as exit_:
        return _exit_code(exit_.code)
    except KeyboardInterrupt:
        print("syncbn: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # the reader of stdout went away (e.g. `syncbn demo | head`): no traceback, and no
        # second error when Python flushes stdout at exit
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    return EXIT_USAGE  # not reached: error() exits
