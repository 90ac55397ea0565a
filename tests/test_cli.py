"""The ``syncbn`` command line: parsing, errors and dispatch (in-process and fast)."""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import math
import subprocess
import sys
import time
import types
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import torch

import syncbn
from syncbn import _cli as cli
from syncbn._cli.demo import _DEMO_PACKAGES

#: the demo's own tests need its extra (CI installs it with ".[test]"; a bare GPU machine
#: may lack it, where they would fail for a missing package, not for syncbn)
needs_demo_extra = pytest.mark.skipif(
    any(importlib.util.find_spec(module) is None for module in _DEMO_PACKAGES),
    reason="the demo extra is not installed (pip install 'syncbn[demo]')",
)


def _fake_bench(run_result: int | Exception) -> types.ModuleType:
    """A stand-in for syncbn._cli.bench with the subcommand interface, recording its calls."""
    module = types.ModuleType("syncbn._cli.bench")
    module.calls = []  # type: ignore[attr-defined]

    def add_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--repeat", type=int, default=1)

    def run(args: argparse.Namespace) -> int:
        module.calls.append(args)  # type: ignore[attr-defined]
        if isinstance(run_result, Exception):
            raise run_result
        return run_result

    module.add_arguments = add_arguments  # type: ignore[attr-defined]
    module.run = run  # type: ignore[attr-defined]
    return module


def test_console_script_points_to_main() -> None:
    found = entry_points()
    # Python 3.9 returns a dict of groups; 3.10+ selects by keyword
    group = (
        found.select(group="console_scripts")
        if hasattr(found, "select")
        else found["console_scripts"]
    )
    scripts = {entry.name: entry.value for entry in group}
    assert scripts.get("syncbn") == "syncbn._cli:main"


def test_help_lists_the_commands(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: syncbn")
    assert "demo" in out and "bench" in out


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"syncbn {syncbn.__version__}"


def test_a_command_is_required(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == 2
    assert "the following arguments are required: command" in capsys.readouterr().err


def test_unknown_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["train"]) == 2
    assert "invalid choice: 'train'" in capsys.readouterr().err


def test_demo_help_shows_every_option(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["demo", "--help"]) == 0
    out = capsys.readouterr().out
    for option in ("--nproc", "--batch-per-proc", "--steps", "--seed", "--out", "--device"):
        assert option in out
    assert "--dtype" in out and "(default: float64)" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--nproc", "0"], "argument --nproc: expected a positive integer, got 0"),
        (["--nproc", "two"], "argument --nproc: expected a positive integer, got 'two'"),
        (["--batch-per-proc", "0"], "argument --batch-per-proc: expected a positive integer"),
        (["--steps", "0"], "argument --steps: expected a positive integer, got 0"),
        (["--steps", "-5"], "argument --steps: expected a positive integer, got -5"),
        (["--seed", "-1"], "argument --seed: expected an integer in [0, 2**32), got -1"),
        (["--lr", "0"], "argument --lr: expected a positive finite number, got 0"),
        (["--lr", "nan"], "argument --lr: expected a positive finite number, got nan"),
        (["--dtype", "float16"], "argument --dtype: invalid choice: 'float16'"),
        (["--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
        (["--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_demo_rejects_bad_options(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["demo", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: syncbn")
    assert message in err


@needs_demo_extra
def test_demo_rejects_a_global_batch_larger_than_the_data(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    argv = ["demo", "--nproc", "3", "--batch-per-proc", "500", "--out", str(out)]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "usage: syncbn demo" in err
    assert "3 x 500 = 1500 is larger than the 1437 training images" in err
    assert not out.exists()  # nothing created for a run that cannot start


@needs_demo_extra
def test_demo_rejects_an_out_that_is_a_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "file.txt"
    out.write_text("not a folder")
    assert cli.main(["demo", "--out", str(out)]) == 2
    assert "argument --out:" in capsys.readouterr().err
    assert out.read_text() == "not a folder"


@needs_demo_extra
@pytest.mark.parametrize("blocked", ["results.json", "curves.png"])
def test_demo_rejects_an_out_whose_files_cannot_be_written_before_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], blocked: str
) -> None:
    """A folder where an output file is: the demo trained its three runs, then ended in
    an IsADirectoryError traceback."""
    (tmp_path / blocked).mkdir()
    start = time.monotonic()
    assert cli.main(["demo", "--out", str(tmp_path), "--steps", "2"]) == 2
    assert f"argument --out: '{tmp_path / blocked}' is a directory" in capsys.readouterr().err
    assert time.monotonic() - start < 20  # before any rank starts (the data set loads)


def test_the_demo_reports_a_diverged_run_as_nan_not_as_exact() -> None:
    """``max(0.0, nan)`` is 0.0: a run whose weights went NaN read "0.0e+00" (a review,
    with --lr 1e9)."""
    from syncbn._cli.demo import format_table
    from syncbn._cli.demo_train import _max_abs_difference

    nan = float("nan")
    reference = {"w": torch.zeros(2), "running_mean": torch.zeros(2)}
    state = {"w": torch.tensor([nan, 5.0]), "running_mean": torch.ones(2)}
    difference = _max_abs_difference(state, reference, {"w"})
    assert math.isnan(difference["parameters"]) and difference["buffers"] == 1.0
    record = {"train_loss": nan, "test_accuracy": 0.1, "train_seconds": 1.0}
    curve = {"curve": {"step": [1, 2]}}
    results = {
        "runs": {
            "ddp_batchnorm": {
                **record,
                **curve,
                "label": "(a)",
                "max_abs_diff_vs_single_process": difference,
            },
            "single_process": {
                **record,
                **curve,
                "label": "(c)",
                "max_abs_diff_vs_single_process": difference,
            },
        },
        "config": {"steps": 2, "nproc": 2, "batch_per_proc": 2, "dtype": "float64", "seed": 0},
        "train_size": 1,
        "test_size": 1,
        "global_batch": 4,
    }
    row = format_table(results).splitlines()[2]
    assert row.startswith("(a)") and row.endswith("nan"), row


@needs_demo_extra
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")
def test_demo_cuda_without_cuda_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["demo", "--device", "cuda", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "argument --device: cuda requested but CUDA is not available" in err


def test_bench_is_dispatched_to_its_module(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _fake_bench(run_result=7)
    monkeypatch.setitem(sys.modules, "syncbn._cli.bench", fake)
    assert cli.main(["bench", "--repeat", "3"]) == 7
    (args,) = fake.calls  # type: ignore[attr-defined]
    assert args.command == "bench" and args.repeat == 3


def test_argument_error_from_run_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    fake = _fake_bench(argparse.ArgumentError(None, "argument --repeat: too many for 2 ranks"))
    monkeypatch.setitem(sys.modules, "syncbn._cli.bench", fake)
    assert cli.main(["bench", "--repeat", "9"]) == 2
    err = capsys.readouterr().err
    assert "usage: syncbn bench" in err
    assert "syncbn bench: error: argument --repeat: too many for 2 ranks" in err


def test_missing_command_module_leaves_the_others_working(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "syncbn._cli.bench", None)  # import raises ModuleNotFoundError
    assert cli.main(["--help"]) == 0
    assert "not available" in capsys.readouterr().out
    assert cli.main(["bench"]) == 1
    assert "syncbn bench: error: this command is not available" in capsys.readouterr().err
    assert cli.main(["demo", "--nproc", "0"]) == 2


def test_python_dash_m_syncbn() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "syncbn", "demo", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: syncbn demo")


def test_help_imports_neither_torch_nor_the_library() -> None:
    """``syncbn --help`` is fast: torch and the core are imported only when a command runs."""
    code = (
        "import contextlib, io, json, sys\n"
        "from syncbn._cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    code = main(['--help'])\n"
        "print(json.dumps([code, sorted(m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'numpy', 'syncbn'))]))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    exit_code, modules = json.loads(result.stdout)
    assert exit_code == 0
    assert [m for m in modules if not m.startswith("syncbn._cli")] == ["syncbn"]


def _package_imports() -> dict[str, set[str]]:
    """Which modules of the ``syncbn`` package each of them imports, also inside functions."""
    root = Path(syncbn.__file__).parent
    names = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        names[path] = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    modules = set(names.values())
    graph: dict[str, set[str]] = {}
    for path, name in names.items():
        imported: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                submodules = {f"{node.module}.{alias.name}" for alias in node.names}
                # "from syncbn import _stats" imports the submodule, not the package's code
                imported.update(submodules & modules or {node.module})
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                # importlib.import_module("syncbn._cli.demo"); a bare "syncbn" is the op
                # library's namespace (torch.library.Library("syncbn", ...)), not an import
                if "." in node.value:
                    imported.add(node.value)
        graph[name] = (imported & modules) - {name}
    return graph


def test_the_package_has_no_import_cycle() -> None:
    graph = _package_imports()
    assert "syncbn._cli.demo" in graph["syncbn._cli"]  # the graph sees importlib's imports
    assert "syncbn.batchnorm" in graph["syncbn"]  # and the package's lazy exports
    demo_train = {m for m in graph["syncbn._cli.demo_train"] if m.startswith("syncbn._cli")}
    assert demo_train == {"syncbn._cli.demo_config"}  # the ranks' code imports no parent code

    def visit(module: str, path: list[str]) -> None:
        assert module not in path, f"import cycle: {' -> '.join([*path, module])}"
        for imported in graph[module]:
            visit(imported, [*path, module])

    for module in graph:
        visit(module, [])
