"""``syncbn bench`` (syncbn._cli.bench, .measure) and the helpers of benchmarks/."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _harness import WorkerPool

import syncbn
from syncbn import _cli as cli
from syncbn import _compiled
from syncbn._cli import bench, launch, measure

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _load(name: str) -> ModuleType:
    """Import ``benchmarks/<name>.py`` by path (benchmarks/ is not a package)."""
    spec = importlib.util.spec_from_file_location(
        f"syncbn_benchmarks_{name}", BENCHMARKS / f"{name}.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # registered first, as importlib's recipe does: a dataclass looks its module up there
    # (benchmarks/compile.py's)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _run_bench(argv: list[str]) -> int:
    """``syncbn bench ARGV`` through the real command line."""
    return cli.main(["bench", *argv])


# --------------------------------------------------------------------------- syncbn bench


def test_bench_writes_sane_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bench.json"
    shapes = [(3, 4, 5, 5), (6, 7)]
    code = _run_bench(
        [
            "--shapes",
            "3x4x5x5",
            "6x7",
            "--repeats",
            "2",
            "--min-time",
            "0.0005",
            "--json",
            str(path),
        ]
    )
    assert code == 0
    assert "SyncBN" in capsys.readouterr().out
    record = json.loads(path.read_text())
    assert record["world_size"] == 2 and record["backend"] == "gloo"
    assert record["machine"]["torch"] == torch.__version__
    assert [tuple(row["shape"]) for row in record["results"]] == shapes
    for row in record["results"]:
        timed = ("batchnorm_s", "syncbn_s", "all_reduce_forward_s", "all_reduce_backward_s")
        for key in (*timed, "batchnorm_cpu_s", "syncbn_cpu_s"):
            assert math.isfinite(row[key]) and row[key] > 0, key
        latency = row["all_reduce_forward_s"] + row["all_reduce_backward_s"]
        assert row["syncbn_compute_s"] == pytest.approx(row["syncbn_s"] - latency)
        assert row["compute_vs_batchnorm"] == pytest.approx(
            row["syncbn_compute_s"] / row["batchnorm_s"]
        )
        # one collective each way, O(C) float64 payload, the same on every rank
        assert (row["collectives_forward"], row["collectives_backward"]) == (1, 1)
        channels = row["shape"][1]
        for phase in ("forward", "backward"):
            per_rank = row[f"bytes_{phase}_per_rank"]
            assert len(per_rank) == 2 and len(set(per_rank)) == 1
            assert per_rank[0] == row[f"bytes_{phase}"]
            assert per_rank[0] % 8 == 0 and 2 * channels * 8 < per_rank[0] <= (2 * channels + 8) * 8


@pytest.mark.parametrize("text", ["2", "2x0x3", "axb", ""])
def test_bench_rejects_bad_shapes(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="expected a shape like"):
        bench.parse_shape(text)


@pytest.mark.parametrize("text", ["1x4", "1x4x1x1"])
def test_bench_rejects_shapes_with_one_value_per_channel(text: str) -> None:
    """Before, they passed and the BatchNorm baseline then failed in a rank (a traceback)."""
    with pytest.raises(argparse.ArgumentTypeError, match="at least 2 values per channel"):
        bench.parse_shape(text)
    assert bench.parse_shape("1x4x2") == (1, 4, 2)


def test_bench_checks_json_before_measuring(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before, an unwritable --json failed with a traceback after the whole benchmark."""

    def no_ranks(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("measured before checking --json")

    monkeypatch.setattr(launch, "run_on_ranks", no_ranks)
    assert _run_bench(["--json", str(tmp_path)]) == 2
    assert "argument --json: " in capsys.readouterr().err
    assert _run_bench(["--json", str(tmp_path / "missing" / "out.json")]) == 2
    assert "is not a writable folder" in capsys.readouterr().err
    # a name the file system refuses (the folder is writable): was a traceback at the end
    assert _run_bench(["--json", str(tmp_path / ("a" * 300 + ".json"))]) == 2
    assert "cannot write" in capsys.readouterr().err
    # the check creates nothing, and leaves a file that exists as it was
    existing = tmp_path / "old.json"
    existing.write_text("kept")
    bench._check_writable(str(existing))
    bench._check_writable(str(tmp_path / "new.json"))
    # nor does it open a path: a named pipe's reader saw its end (and an open without a
    # reader blocks), a dangling link lost its target and left an empty file
    pipe, link = tmp_path / "pipe", tmp_path / "link.json"
    os.mkfifo(pipe)
    link.symlink_to(tmp_path / "target.json")

    def check_both() -> None:
        for path in (pipe, link):
            bench._check_writable(str(path))

    # (a daemon: a check blocked in open must not keep the test process alive at exit)
    checks = threading.Thread(target=check_both, daemon=True)
    checks.start()
    checks.join(timeout=10.0)
    assert not checks.is_alive(), "the check opened the named pipe"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["link.json", "old.json", "pipe"]
    assert link.is_symlink() and existing.read_text() == "kept"


def test_bench_stops_on_sigterm_as_on_ctrl_c(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGTERM (``timeout``, a job scheduler) ends ``syncbn bench`` as Ctrl-C does: 130,
    after the launcher stopped the ranks; it was killed by the signal (143), and each rank
    reported that its parent had ended."""

    def terminated(*args: Any, **kwargs: Any) -> Any:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(10)  # the handler raises KeyboardInterrupt here
        raise AssertionError("SIGTERM was not turned into KeyboardInterrupt")

    def unhandled(signum: int, frame: Any) -> None:  # (what bench's own handler replaces)
        raise AssertionError("syncbn bench left SIGTERM to the handler before it")

    monkeypatch.setattr(launch, "run_on_ranks", terminated)
    previous = signal.signal(signal.SIGTERM, unhandled)
    try:
        assert _run_bench(["--shapes", "2x2"]) == 130
        assert signal.getsignal(signal.SIGTERM) is unhandled  # restored
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert "interrupted" in capsys.readouterr().err


def test_bench_reports_a_failed_rank_in_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def failing(*args: Any, **kwargs: Any) -> Any:
        raise launch.RankError(1, launch.Outcome("error", "Traceback ...\nOSError: disk full"))

    monkeypatch.setattr(launch, "run_on_ranks", failing)
    assert _run_bench(["--shapes", "2x4"]) == 1
    err = capsys.readouterr().err
    assert err == "syncbn bench: error: rank 1 failed (OSError: disk full); stopped every rank\n"


@pytest.mark.parametrize(
    "option", [["--world-size", "1"], ["--repeats", "0"], ["--min-time", "-1"], ["--device", "tpu"]]
)
def test_bench_rejects_bad_options(option: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(option)
    assert exit_info.value.code == 2
    assert option[0] in capsys.readouterr().err


def test_measure_alone_agrees_with_call_counts() -> None:
    calls = {"a": 0, "b": 0}

    def call(name: str) -> Any:
        def fn() -> None:
            calls[name] += 1

        return fn

    timings = measure.measure(
        {"a": call("a"), "b": call("b")}, repeats=3, min_block_time=1e-4, warmup=2
    )
    for name, timing in timings.items():
        assert timing.median > 0 and timing.iqr >= 0 and timing.blocks == 3
        # warm-up + calibration blocks (doubling from 1) + the timed blocks
        assert calls[name] >= 2 + 3 * timing.calls_per_block
    with pytest.raises(ValueError, match="repeats must be positive"):
        measure.measure({"a": call("a")}, repeats=0)


def test_count_collectives_records_and_restores() -> None:
    original = dist.all_reduce
    with measure.count_collectives() as log:
        assert dist.all_reduce is not original
        with pytest.raises((RuntimeError, ValueError)):  # no process group in this process
            dist.all_reduce(torch.zeros(3, dtype=torch.float64))
        with pytest.raises((RuntimeError, ValueError)):
            dist.all_gather([torch.zeros(2), torch.zeros(2)], torch.zeros(2))
    assert dist.all_reduce is original
    assert log == [measure.Collective("all_reduce", 24), measure.Collective("all_gather", 8)]


# --------------------------------------------------------------------------- benchmarks/


def _reference_matches_syncbn(rank: int, world_size: int, path: str) -> float:
    spec = importlib.util.spec_from_file_location("syncbn_benchmarks_reference", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch.manual_seed(rank)
    x = (torch.randn(2 + rank, 3, 4, 4, dtype=torch.float64) * 2 + 1).requires_grad_()
    dy = torch.randn_like(x)
    reference = module.ReferenceSyncBatchNorm(3).double()
    ours = syncbn.SyncBatchNorm(3).double()
    with torch.no_grad():
        for layer in (reference, ours):
            layer.weight.copy_(torch.tensor([0.5, 1.0, 2.0]))
            layer.bias.copy_(torch.tensor([0.1, -0.2, 0.3]))
    results = []
    for layer in (reference, ours):
        y = layer(x)
        results.append((y, *torch.autograd.grad(y, [x, layer.weight, layer.bias], dy)))
    for got, expected in zip(*results):
        torch.testing.assert_close(got, expected)
    torch.testing.assert_close(reference.running_var, ours.running_var)
    return float(results[0][0].abs().max())


def test_reference_syncbn_equals_syncbn(pool2: WorkerPool) -> None:
    """The benchmark's baseline computes the same thing as syncbn (uneven batches)."""
    outputs = pool2.run(_reference_matches_syncbn, str(BENCHMARKS / "reference_syncbn.py"))
    assert all(value > 0 for value in outputs)


def test_floors_and_verdicts() -> None:
    report = _load("report")
    floors = report.floors(copy_s=2.0, nbytes=10)
    assert floors["bandwidth_gbps"] == pytest.approx(10e-9)
    # 3 tensor sizes forward, 5 backward, at 10 bytes/s
    assert (floors["forward_s"], floors["backward_s"]) == (pytest.approx(3.0), pytest.approx(5.0))
    assert floors["forward_backward_s"] == pytest.approx(8.0)
    assert report.verdict(0.5, 0.6) == "PASS" and report.verdict(0.7, 0.6) == "MISS"
    assert report.verdict(2.0, 1.5, at_least=True) == "PASS"
    assert report.verdict(1.0, 1.5, at_least=True) == "MISS"
    assert report.verdict(None, 1.0) == "n/a"
    assert report.miss_factor(3.0, 1.5) == pytest.approx(2.0)
    assert report.miss_factor(1.0, 1.5, at_least=True) == pytest.approx(1.5)


def _layer_case(dtype: str, memory_format: str, syncbn_s: float) -> dict[str, Any]:
    times = {
        "batchnorm.forward": 1.0,
        "batchnorm.forward_backward": 3.0,
        "syncbn.forward": 0.9,
        "syncbn.forward_backward": syncbn_s,
        "syncbn_unchecked.forward_backward": syncbn_s - 0.01,
        "reference.forward": 2.0,
        "reference.forward_backward": 6.0,
        "copy": 0.1,
        "all_reduce.forward": 0.2,
        "all_reduce.backward": 0.3,
    }
    return {
        "shape": [2, 4, 3, 3],
        "dtype": dtype,
        "memory_format": memory_format,
        "bytes": 288,
        "times_s": times,
    }


def test_derive_layer_ratios_and_targets() -> None:
    report = _load("report")
    row = report.derive_layer(_layer_case("float32", "contiguous", syncbn_s=2.0))
    assert row["syncbn_compute_s"] == pytest.approx(1.5)  # 2.0 - 0.2 - 0.3
    assert row["compute_vs_batchnorm"] == pytest.approx(0.5)
    assert (
        row["compute_vs_batchnorm_limit"] == 0.6 and row["compute_vs_batchnorm_verdict"] == "PASS"
    )
    assert row["traffic_floor_s"] == pytest.approx(0.4)  # 8 sizes at 2 sizes per 0.1 s
    assert (
        row["compute_vs_floor"] == pytest.approx(3.75) and row["compute_vs_floor_verdict"] == "MISS"
    )
    assert row["speedup_vs_reference"] == pytest.approx(3.0)
    assert "cpu" not in row  # no CPU times measured
    case = _layer_case("float32", "contiguous", syncbn_s=2.0)
    case["cpu_s"] = {**case["times_s"], "batchnorm.forward_backward": 1.5}
    cpu = report.derive_layer(case)["cpu"]
    assert cpu["collectives_s"] == pytest.approx(0.5)
    assert cpu["syncbn_compute_s"] == pytest.approx(1.5)
    assert cpu["compute_vs_batchnorm"] == pytest.approx(1.0)
    assert cpu["reference_vs_syncbn"] == pytest.approx(3.0)
    slow_bf16 = report.derive_layer(_layer_case("bfloat16", "channels_last", syncbn_s=3.8))
    assert slow_bf16["compute_vs_batchnorm_limit"] == 1.0
    assert slow_bf16["compute_vs_batchnorm_verdict"] == "MISS"
    assert slow_bf16["compute_vs_floor_verdict"] == "n/a"  # the floor target is float32 only


def _collective_rows(backward_bytes: int) -> list[dict[str, Any]]:
    return [
        {
            "shape": [2, 4],
            "dtype": "float32",
            "memory_format": "contiguous",
            "layer": "syncbn",
            "forward": [["all_reduce", 104]],
            "backward": [["all_reduce", backward_bytes]],
        }
    ]


def test_collective_summary_flags_bytes_that_change() -> None:
    report = _load("report")
    same = report.collective_summary(
        {"2": [_collective_rows(96)] * 2, "3": [_collective_rows(96)] * 3}
    )
    assert len(same) == 1 and same[0]["identical"]
    assert (same[0]["collectives_forward"], same[0]["bytes_backward"]) == (1, 96)
    grown = report.collective_summary(
        {"2": [_collective_rows(96)] * 2, "3": [_collective_rows(96)] * 2 + [_collective_rows(104)]}
    )
    assert not grown[0]["identical"]


def test_derive_and_render_whole_report() -> None:
    report = _load("report")
    results = {
        "command": "python benchmarks/run.py",
        "wall_s": 1.0,
        "machine": measure.machine_info(),
        "load_average_end": [0.1, 0.1, 0.1],
        "settings": {
            "world_size": 2,
            "backend": "gloo",
            "device": "cpu",
            "repeats": 3,
            "min_block_time": 0.01,
            "warmup": 1,
        },
        "layers": {
            "cases": [
                _layer_case("float32", "contiguous", 2.0),
                _layer_case("bfloat16", "contiguous", 4.0),
            ],
            "torch_syncbn": "skipped on cpu",
        },
        "model": {
            "model": "m",
            "input": [8, 3, 32, 32],
            "bn_layers": 1,
            "bn_channels": [4],
            "ddp": {},
            "syncbn_collectives_per_step": 2,
            "syncbn_collective_bytes": [104, 96],
            "times_s": {
                "batchnorm": 1.0,
                "syncbn": 1.5,
                "all_reduce.104": 0.2,
                "all_reduce.96": 0.2,
            },
        },
        "collectives": {"2": [_collective_rows(96)] * 2},
    }
    derived = report.derive(results)
    assert derived["model"]["latency_floor_s"] == pytest.approx(0.4)
    assert derived["model"]["syncbn"]["overhead_vs_floor"] == pytest.approx(1.25)
    verdicts = {(t["target"], t["limit"]): t["verdict"] for t in derived["targets"]}
    assert verdicts[("compute_vs_batchnorm", 1.0)] == "MISS"  # bfloat16: 3.5 / 3.0
    assert verdicts[("compute_vs_batchnorm", 0.6)] == "PASS"
    assert verdicts[("model_overhead_vs_latency_floor", 1.5)] == "PASS"
    text = report.render_markdown(results, derived)
    for heading in ("## Targets", "## Per layer", "## Whole model", "## Collectives", "## Misses"):
        assert heading in text
    assert "bfloat16" in text and "**MISS**" in text


def test_suite_cases_and_model(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    suite = _load("suite")
    cases = suite.cases()
    # 6 shapes x 2 dtypes, plus channels_last for the five 4-D/5-D shapes
    assert len(cases) == 22
    assert {case["memory_format"] for case in cases if len(case["shape"]) == 2} == {"contiguous"}
    model = _load("resnet").SmallResNet()
    batchnorms = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert len(batchnorms) >= 10
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def test_compute_case_times_both_variants_and_counts_faults(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """benchmarks/compute.py: one small case, with short timing blocks."""
    compute = _load("compute")
    monkeypatch.setattr(compute, "ROUNDS", 2)
    monkeypatch.setattr(compute, "_median_ms", _short_median_ms)
    row = compute._case((4, 3, 5, 5), torch.float32, channels_last=False)
    assert row["batchnorm_ms"] > 0 and row["syncbn_ms"] > 0 and row["floor_ms"] > 0
    assert row["syncbn_over_batchnorm"] == pytest.approx(row["syncbn_ms"] / row["batchnorm_ms"])
    assert row["syncbn_over_floor"] == pytest.approx(row["syncbn_ms"] / row["floor_ms"])
    assert row["batchnorm_faults_per_call"] >= 0 and row["syncbn_faults_per_call"] >= 0
    assert set(compute._MEASURED) <= set(row)


_EVERY_SCRIPTS_HELP = """
import contextlib, io, runpy, sys
from pathlib import Path
for script in sorted(Path(sys.argv[1]).glob("*.py")):
    if '__name__ == "__main__"' not in script.read_text():
        continue  # a module the scripts import
    sys.argv = [str(script), "--help"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            runpy.run_path(str(script), run_name="__main__")
            code = "no exit"
        except SystemExit as exit_:
            code = exit_.code
    print(script.name, code, "usage:" in out.getvalue())
"""


def test_every_benchmark_script_answers_help_without_measuring() -> None:
    """``--help`` prints usage and exits 0: compute.py had no parser, so ``--help`` started
    its 3-minute run and rewrote the committed results."""
    result = subprocess.run(
        [sys.executable, "-c", _EVERY_SCRIPTS_HELP, str(BENCHMARKS)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=BENCHMARKS,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(BENCHMARKS), *sys.path])},
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) >= 10 and "compute.py 0 True" in lines, lines
    assert all(line.endswith(" 0 True") for line in lines), lines


def _short_median_ms(fn: Any) -> float:
    from torch.utils.benchmark import Timer

    return float(Timer("fn()", globals={"fn": fn}).timeit(20).median * 1e3)


def test_compare_times_a_revision_against_the_working_tree(tmp_path: Path) -> None:
    """benchmarks/compare.py imports both versions and writes one row per shape, masked
    calls included.

    It runs in its own process: it swaps the ``syncbn`` modules in ``sys.modules``.
    """
    out = tmp_path / "compare.md"
    shapes = ["4x3x5x5", "4x3x5x5:masked"]
    command = [sys.executable, str(BENCHMARKS / "compare.py"), "HEAD", "--shapes", *shapes]
    subprocess.run(
        [*command, "--seconds", "0.2", "--out", str(out)], check=True, timeout=120, cwd=tmp_path
    )
    for shape in shapes:
        rows = [line for line in out.read_text().splitlines() if line.startswith(f"| {shape} |")]
        assert len(rows) == 1, shape
        ratio = float(rows[0].rstrip(" |").rsplit("|", 1)[-1].strip().rstrip("x"))
        assert ratio > 0


def test_compare_passes_a_masked_shapes_mask_to_every_revision(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A ``masked`` shape times masked calls: each revision's entry gets an ``(N, *)`` bool
    mask, 80 % valid; an unmasked shape passes no mask (revisions from before masks). A
    ``running`` shape passes running statistics, to BatchNorm as well."""
    from syncbn._autograd import LayerInfo, TrainOptions

    monkeypatch.syspath_prepend(str(BENCHMARKS))  # compare.py imports compute.py
    compare = _load("compare")
    calls: list[dict[str, Any]] = []

    def sync_batch_norm_train(
        x: torch.Tensor, weight: Any, bias: Any, options: Any, **kwargs: Any
    ) -> torch.Tensor:
        calls.append(kwargs)
        return x * weight.view(1, -1, 1) + bias.view(1, -1, 1)

    revision = SimpleNamespace(
        LayerInfo=LayerInfo, TrainOptions=TrainOptions, sync_batch_norm_train=sync_batch_norm_train
    )
    batch_norms: list[Any] = []
    batch_norm = compare.F.batch_norm

    def recorded_batch_norm(x: torch.Tensor, *args: Any) -> torch.Tensor:
        batch_norms.append(args[0])  # the running mean
        return batch_norm(x, *args)

    monkeypatch.setattr(compare.F, "batch_norm", recorded_batch_norm)
    for spec in ("64x3x50:masked", "64x3x50", "64x3x50:running"):
        variants = compare._variants(spec, {"revision": revision})
        assert sorted(variants) == ["BatchNorm", "revision"]
        variants["revision"]()
        variants["BatchNorm"]()
    masked, unmasked, running = calls
    assert sorted(masked) == ["mask"] and not unmasked
    mask = masked["mask"]
    assert mask.dtype == torch.bool and mask.shape == (64, 50)
    assert 0.7 < mask.float().mean().item() < 0.9
    assert sorted(running) == ["num_batches_tracked", "running_mean", "running_var"]
    assert running["running_mean"].shape == running["running_var"].shape == (3,)
    assert batch_norms[:2] == [None, None] and batch_norms[2] is not None  # running_mean
    assert batch_norms[2] is not running["running_mean"]  # each variant its own
    with pytest.raises(ValueError, match="unknown flags"):
        compare._parse("4x3x5x5:mask")


def test_compile_benchmark_names_the_file_it_wrote(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """benchmarks/compile.py's "Generated by" line gives the ``--out`` that wrote the file:
    none for the default, the path from the repository's root for a committed variant, and
    a file outside the repository as given (it read ``benchmarks/NAME`` for any file, a file
    that was never there)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # compile.py imports resnet.py
    compile_benchmark = _load("compile")
    assert compile_benchmark._out_option(BENCHMARKS / "compile.md") == ""
    variant = BENCHMARKS / "compile-world1-no-transport.md"
    assert compile_benchmark._out_option(variant) == (
        "--out benchmarks/compile-world1-no-transport.md"
    )
    assert compile_benchmark._out_option(tmp_path / "run.md") == f"--out {tmp_path / 'run.md'}"


def test_masked_benchmark_times_unmasked_and_masked_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    """benchmarks/masked.py's eager row: unmasked calls, and masked ones with an ``(N, *)``
    bool mask, in blocks of compare.py's timer, reported per variant."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # masked.py imports compare.py, compute.py
    masked = _load("masked")
    calls: list[tuple[int, ...] | None] = []

    def sync_batch_norm_train(
        x: torch.Tensor, weight: Any, bias: Any, options: Any, mask: Any = None
    ) -> Any:
        calls.append(None if mask is None else tuple(mask.shape))
        assert mask is None or mask.dtype == torch.bool
        return x * weight.view(1, -1, 1) + bias.view(1, -1, 1)

    monkeypatch.setattr(masked, "sync_batch_norm_train", sync_batch_norm_train)
    monkeypatch.setattr(masked, "SECONDS", 0.05)
    row = masked._eager((8, 3, 20))
    assert sorted(row) == ["masked_ms", "unmasked_ms"]
    assert all(0.0 < value < 1e3 for value in row.values())
    assert set(calls) == {None, (8, 20)}
    # both variants ran blocks of the same number of calls
    assert 0.5 < calls.count(None) / calls.count((8, 20)) < 2.0


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_host_overhead_names_the_check_mode_of_each_syncbn_row(device: str) -> None:
    """benchmarks/host_overhead.py's table: on each device one explicit check mode repeats
    the default's (``syncbn eager``), and the rows say which (the 2026-12-04 CUDA table,
    without this column, was read as "deferred against immediate" where both rows were
    deferred)."""
    host_overhead = _load("host_overhead")
    names = ["batchnorm eager", "batchnorm compiled", "syncbn eager", "syncbn compiled"]
    names += ["syncbn eager deferred", "syncbn eager immediate"]
    times = {name: 1.5 if name.startswith("batchnorm") else 3.0 for name in names}
    info = {"date": "now", "torch": "2.x", "cpu": "cpu", "load_average": [0.0], "cuda": "gpu"}
    table = host_overhead._markdown(times, info, device)
    rows = {
        cells[0]: cells[1:]
        for line in table.splitlines()
        if line.startswith("| ") and "---" not in line
        for cells in [[cell.strip() for cell in line.strip("|").split("|")]]
    }
    default = "immediate" if device == "cpu" else "deferred"
    assert rows["syncbn eager"][0] == rows["syncbn compiled"][0] == default
    assert rows["syncbn eager deferred"][0] == "deferred"
    assert rows["syncbn eager immediate"][0] == "immediate"
    assert rows["batchnorm eager"][0] == "-"
    # (3.0 - 1.5) ms / 15 layers, and 3.0 / 1.5
    assert rows["syncbn eager"][1:] == ["3.000", "200", "100", "2.00x"]
    assert rows["batchnorm compiled"][1:] == ["1.500", "100", "-", "-"]
    # the pinned pool's growth: a table of its own on CUDA, nothing on the CPU
    state = {name: {"pinned blocks": 0.0, "pinned us": 0.0, "pending": 1.0} for name in names}
    state["syncbn eager deferred"] = {"pinned blocks": 2.0, "pinned us": 450.0, "pending": 7.0}
    with_state = host_overhead._markdown(times, info, device, state)
    if device == "cpu":
        assert with_state == table
        assert host_overhead._pinned_pool(torch.device("cpu")) == (0.0, 0.0)
    else:
        assert "| syncbn eager deferred | 2.00 | 450.0 | 7 |" in with_state.splitlines()


def test_gpu_masked_part_times_both_kernel_sets_masked_and_not(tmp_path: Path) -> None:
    """benchmarks/gpu.py's masked part, run on the CPU with a wall-clock timer (the GPU
    session runs it with CUDA events): one row per shape and dtype, four timed variants,
    the candidate kernels switched off afterwards, a rendered table row per row, and each
    row written to the rows file as it is measured (what a part cut short keeps)."""
    from syncbn import _kernels

    gpu = _load("gpu")
    calls: list[int] = []

    def timer(call: Any) -> dict[str, float]:
        start = time.perf_counter()
        call()
        calls.append(1)
        return {"device_ms": (time.perf_counter() - start) * 1e3 + 1e-6, "host_ms": 0.0}

    shapes = [(4, 3, 5), (2, 3, 4, 4)]
    rows_file = tmp_path / "masked-rows.jsonl"
    rows = gpu._masked_rows(
        syncbn.SyncBatchNorm, torch.device("cpu"), shapes, timer, str(rows_file)
    )
    assert gpu._rows_so_far(rows_file) == rows
    assert [(row["shape"], row["dtype"]) for row in rows] == [
        (shape, dtype) for shape in ("4x3x5", "2x3x4x4") for dtype in gpu.MASKED_DTYPES
    ]
    variants = {f"{k} {m}" for k in gpu.MASKED_KERNELS for m in ("unmasked", "masked")}
    assert all(variants <= row.keys() for row in rows)
    # the Triton candidates (the per-channel maths with the generic masked passes, and
    # with the Triton ones) are timed where Triton imports; else their cells hold the error
    finalize_ran = all("error" not in row["syncbn-finalize masked"] for row in rows)
    assert len(calls) == (8 if finalize_ran else 4) * len(rows)
    assert _kernels.kernels_for(torch.device("cuda")) is _kernels.generic
    assert _kernels.fused_finalize_for(torch.device("cuda")) is None
    table = gpu._render_masked(rows)
    assert sum(line.startswith("| 4x3x5 |") for line in table) == len(gpu.MASKED_DTYPES)


def test_gpu_probe_calibrates_host_costs(monkeypatch: pytest.MonkeyPatch) -> None:
    """benchmarks/gpu_probe.py's calibration on the CPU (no Triton launches there; the
    all_reduce made local): a positive host time per unit of work, one line each."""
    probe = _load("gpu_probe")
    monkeypatch.setattr(probe.dist, "all_reduce", lambda buffer: buffer)
    lines: list[str] = []
    costs = probe.calibrate(torch.device("cpu"), lines.append)
    assert len(costs) == 6 and all(cost > 0 for cost in costs.values()), costs
    assert [line.endswith("us host per call") for line in lines] == [True] * 6, lines


def test_gpu_probe_times_the_phases_of_a_call_and_restores_them() -> None:
    """benchmarks/gpu_probe.py's phase timers on a CPU call (a process alone, masked: the
    synchronized path without a process group): each phase of a forward and backward
    counted as often as it runs, every inclusive time positive and within the call's, and
    every wrapped function (in every module that holds it) the original again afterwards."""
    from syncbn import _autograd, _kernels, _protocol, _stats

    probe = _load("gpu_probe")
    held = {
        (module, name): getattr(module, name)
        for module in (_autograd, _kernels.generic, _protocol, _stats, syncbn.distributed)
        for name in dir(module)
        if callable(getattr(module, name))
    }
    layer = syncbn.SyncBatchNorm(4)
    x = torch.randn(3, 4, 5, requires_grad=True)
    mask = torch.ones(3, 5, dtype=torch.bool)

    def call() -> None:
        layer(x, mask=mask).sum().backward()

    host_us, phases = probe.phase_times(call, 3, lambda: None)
    once = ["forward_train", "reduce_forward", "backward_train", "synchronize_grads"]
    for name in [f"_autograd.{name}" for name in once] + ["generic.local_moments"]:
        assert phases[name][0] == 1, (name, phases)
    assert phases["_autograd.resolve_mode"][0] == 2, phases  # forward and backward
    assert "distributed.all_reduce_sum_" not in phases, phases  # no process group
    assert all(0 < us <= host_us for _, us in phases.values()), (host_us, phases)
    assert all(getattr(module, name) is function for (module, name), function in held.items())


@pytest.mark.skipif(not _compiled.FULLGRAPH, reason="compiled layers need torch >= 2.4")
def test_gpu_probe_times_the_ops_of_a_compiled_call_without_recompiling() -> None:
    """benchmarks/gpu_probe.py's phases of a compiled call (aot_eager; a process alone,
    masked: syncbn's ops without a process group): the forward op's body and what the
    backward op's calls, once per call; no timer reaches a traced function (a second
    graph would have been compiled), and every wrapped function is restored."""
    from torch._dynamo.utils import counters

    probe = _load("gpu_probe")
    torch._dynamo.reset()
    layer = syncbn.SyncBatchNorm(4)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    x = torch.randn(3, 4, 5, requires_grad=True)
    mask = torch.ones(3, 5, dtype=torch.bool)

    def call() -> None:
        compiled(x, mask=mask).sum().backward()

    call()  # compiled before the timers, as the probe's warm-up does
    graphs = counters["stats"]["unique_graphs"]
    held = {
        (module, name): getattr(module, name)
        for module_name, names in probe.COMPILED_PHASES.items()
        for module in [sys.modules[module_name]]
        for name in names
    }
    host_us, phases = probe.phase_times(call, 3, lambda: None, probe.COMPILED_PHASES)
    assert counters["stats"]["unique_graphs"] == graphs  # no recompilation
    for name in [
        "_compiled._sync_moments",
        "_autograd.reduce_forward",
        "_autograd.synchronize_grads",
    ]:
        assert phases[name][0] == 1, (name, phases)
    assert phases["_compiled._options"][0] == 2, phases  # forward and backward op
    assert all(0 < us <= host_us for _, us in phases.values()), (host_us, phases)
    assert all(getattr(module, name) is function for (module, name), function in held.items())


def test_gpu_probe_replays_the_aten_calls_of_a_call_alone() -> None:
    """benchmarks/gpu_probe.py's replay on a CPU call (a process alone, masked: the
    synchronized path without a process group, so no collective): every aten call that
    the op budget's dispatch mode counts is replayed, nothing is left out, and the replay
    takes some time."""
    probe = _load("gpu_probe")
    layer = syncbn.SyncBatchNorm(4)
    x = torch.randn(3, 4, 5, requires_grad=True)
    mask = torch.ones(3, 5, dtype=torch.bool)

    def call() -> None:
        layer(x, mask=mask).sum().backward()

    call()  # first-call caches filled
    with probe._Ops() as counted:
        call()
    replayed_us, calls, others = probe.replay_us(counted, 3, lambda: None)
    assert calls == len(counted.names) > 0 and others == [], (calls, counted.names, others)
    assert replayed_us > 0


def test_a_gpu_part_cut_short_keeps_the_rows_it_measured(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """benchmarks/gpu.py's main: a part that runs past its time (run_on_ranks raises
    TimeoutError after killing the ranks) keeps the rows written before, up to a line cut
    mid-write, and says so in gpu.md and its exit status; a part that wrote none is an
    error; the rows files are gone afterwards."""
    gpu = _load("gpu")
    timing: dict[str, Any] = {"device_ms": 2.0, "host_ms": 0.5}
    row: dict[str, Any] = {"shape": "32x256x400", "dtype": "float32"} | {
        f"{k} {m}": timing for k in gpu.MASKED_KERNELS for m in ("unmasked", "masked")
    }

    def cut_short(part: str, quick: bool, timeout: float, rows_file: str) -> Any:
        if part == "masked":
            rows: list[dict[str, Any]] = []
            gpu._keep_row(rows, row, rows_file)
            gpu._keep_row(rows, row | {"dtype": "bfloat16"}, rows_file)
            with open(rows_file, "a") as file:
                file.write('{"shape": "32x64x1')  # the rank was killed while writing
        raise TimeoutError(f"ranks still running after {timeout:.0f} s")

    monkeypatch.setattr(gpu, "_run_part", cut_short)
    monkeypatch.setattr(gpu.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu, "machine_info", lambda: {"date": "d", "cuda": "c", "torch": "t"})
    masked, step = tmp_path / "masked", tmp_path / "step"
    assert gpu.main(["--parts", "masked", "--out", str(masked), "--timeout", "9"]) == 1
    results = json.loads((masked / "gpu.json").read_text())
    assert [r["dtype"] for r in results["masked"]] == ["float32", "bfloat16"]
    assert results["masked cut short"] == "TimeoutError: ranks still running after 9 s"
    text = (masked / "gpu.md").read_text()
    assert "## masked: cut short" in text
    assert sum(line.startswith("| 32x256x400 |") for line in text.splitlines()) == 2
    assert sorted(path.name for path in masked.iterdir()) == ["gpu.json", "gpu.md"]
    assert gpu.main(["--parts", "step", "--out", str(step), "--timeout", "9"]) == 1
    results = json.loads((step / "gpu.json").read_text())
    assert results["step"] == {"error": "TimeoutError: ranks still running after 9 s"}
    assert "## step: failed" in (step / "gpu.md").read_text()


def test_gpu_results_of_every_part_render() -> None:
    """benchmarks/gpu.py's tables from results shaped as its GPU parts return them (which
    no CPU run produces): every part's table is drawn, and a variant that failed is shown
    with its error instead of stopping the table."""
    gpu = _load("gpu")
    timing: dict[str, Any] = {"device_ms": 2.0, "host_ms": 0.5, "syncs": 0}
    layer_row: dict[str, Any] = {"shape": "32x64x56x56", "dtype": "float32", "channels_last": True}
    per_rank = [[layer_row | {k: timing for k in gpu.LAYER_KINDS[1:]}] for _ in range(2)]
    compiled: dict[str, Any] = {
        f"{kind} {mode}": timing | {"compile_s": 60.0}
        for kind in ("cudnn", "syncbn")
        for mode in gpu.COMPILE_MODES
    }
    compiled["syncbn reduce-overhead"] = {"error": "RuntimeError: boom"}
    masked_row: dict[str, Any] = {"shape": "32x256x400", "dtype": "bfloat16"} | {
        f"{k} {m}": timing for k in ("syncbn", "syncbn-fused") for m in ("unmasked", "masked")
    }
    results = {
        "machine": {"date": "2026-11-25", "cuda": "12.8", "torch": "2.11.0"},
        "layers": [layer_row | {k: timing for k in gpu.LAYER_KINDS}],
        "step": {
            "cudnn": {"eager": timing, "graph": timing},
            "torch-sync": {"eager": timing, "graph": {"error": "RuntimeError: capture"}},
            "syncbn": {"eager": timing, "graph": timing},
        },
        "ranks": per_rank,
        "compile": compiled,
        "masked": [masked_row],
    }
    text = gpu._render(results)
    for heading in (
        "## Per layer",
        "## resnet50 training step",
        "## 2 ranks",
        "torch.compile",
        "## Masked calls",
    ):
        assert heading in text, heading
    assert "| 32x64x56x56 | float32 | channels_last | 2.000 / 0.500 / 0 |" in text
    assert "RuntimeError: capture" in text and "RuntimeError: boom" in text
    assert "| syncbn | default | 2.00 | 0.50 | 0 | 60 | 1.00x |" in text
    failed = results | {"layers": [{"shape": "broken"}]}  # a row without its timings
    assert "Rendering failed (KeyError" in gpu._render_or_say_why(failed)


def test_accuracy_benchmark_measures_every_variant(tmp_path: Path) -> None:
    """benchmarks/accuracy.py --quick: every case's eager variants against float64
    BatchNorm, syncbn through its synchronized path, written as a table and as JSON.

    It runs in its own process: it initializes (and destroys) a one-rank gloo group.
    """
    out = tmp_path / "accuracy.md"
    command = [sys.executable, str(BENCHMARKS / "accuracy.py"), "--quick", "--out", str(out)]
    subprocess.run(command, check=True, timeout=120, cwd=tmp_path, capture_output=True)
    record = json.loads(out.with_suffix(".json").read_text())
    assert record["machine"]["torch"] == torch.__version__
    rows = record["rows"]
    cases = list(dict.fromkeys(row["case"] for row in rows))
    assert len(cases) >= 5 and "3-D volume" not in cases  # --quick: no 3-D volume
    for case in cases:
        variants = {row["variant"]: row for row in rows if row["case"] == case}
        assert sorted(variants) == ["syncbn eager", "torch eager"], case
        for row in variants.values():
            for key in ("output_err", "running_var_err", "grad_err"):
                assert math.isfinite(row[key]) and row[key] >= 0, (case, row["variant"], key)
        # syncbn synchronized (one collective each way); torch's layer never does
        assert variants["syncbn eager"]["collectives"] == 2, case
        assert variants["torch eager"]["collectives"] == 0, case
    large_mean = {row["variant"]: row for row in rows if row["case"] == "mean/std = 1e4"}
    syncbn_row = large_mean["syncbn eager"]
    assert syncbn_row["output_err"] < 1e-5 and syncbn_row["running_var_err"] < 1e-6
    assert syncbn_row["grad_err"] < 1e-4
    # the float32 shift: syncbn's output is closer than torch's, whose mean is rounded
    assert syncbn_row["output_err"] < large_mean["torch eager"]["output_err"] / 10
    table = [line for line in out.read_text().splitlines() if line.startswith("| ")]
    assert len(table) == len(rows) + 1  # the header and one line per row
    assert "`python benchmarks/accuracy.py --quick`" in out.read_text()
