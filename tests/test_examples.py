"""examples/train_ddp.py: its argument checks, and the torchrun launches of examples/README.md.

Each launch runs the real script with tiny settings under ``python -m torch.distributed.run``
(torchrun), on CPU with gloo, bound to the loopback interface, and is killed (with its
whole process group) if it outlives ``LAUNCH_TIMEOUT``.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest
import torch
from _launcher import free_port

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_ddp.py"
TINY = ["--epochs", "2", "--steps", "2", "--batch-size", "4", "--timeout", "60"]
LAUNCH_TIMEOUT = 90.0  # seconds; below pytest-timeout's 120 so that cleanup runs first


def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("train_ddp", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # inductor's scalar C++ kernels, as in the tests' pool of ranks (tests/_harness.py):
    # what is tested here is the launch, which no instruction set changes, and g++ builds
    # them in about half the time (the compiled launch, cache cold: 29.9 -> 16.8 s)
    env.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")
    loopback = [name for _, name in socket.if_nameindex() if name.startswith("lo")]
    if loopback:  # gloo binds this interface instead of the one the hostname resolves to
        env["GLOO_SOCKET_IFNAME"] = loopback[0]
    return env


def _torchrun(tmp_path: Path, *options: str) -> list[str]:
    # --log_dir: the agent's folder for each launch in the test's own, which pytest removes
    # (else a torchelastic_* folder left behind in /tmp). Not TMPDIR, which would move
    # inductor's precompiled header too: built again at each launch (4-5 s)
    log_dir = str(tmp_path / "torchelastic")
    command = [sys.executable, "-m", "torch.distributed.run", f"--log_dir={log_dir}", *options]
    return command + [str(SCRIPT)]


def _launch(tmp_path: Path, *commands: list[str]) -> str:
    """Run the commands concurrently; return their joined output, or fail with it.

    Stops early if one exits with an error, and kills every process group at the end.
    """
    logs = [tmp_path / f"launch{i}.log" for i in range(len(commands))]
    procs: list[subprocess.Popen[bytes]] = []
    deadline = time.monotonic() + LAUNCH_TIMEOUT
    try:
        for command, log in zip(commands, logs):
            with log.open("w") as out:
                procs.append(
                    subprocess.Popen(
                        command,
                        cwd=ROOT,
                        env=_env(),
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,  # its own process group, to kill the workers too
                    )
                )
        codes = [proc.poll() for proc in procs]
        while None in codes and not any(codes) and time.monotonic() < deadline:
            time.sleep(0.2)
            codes = [proc.poll() for proc in procs]
    finally:
        for proc in procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    output = "\n".join(log.read_text() for log in logs)
    assert not any(codes), f"exit codes {codes} (None: killed by the test):\n{output}"
    assert None not in codes, f"killed after {LAUNCH_TIMEOUT} s:\n{output}"
    return output


def _running_stats(out: Path, world_size: int) -> list[dict[str, torch.Tensor]]:
    stats = [torch.load(out / f"rank{rank}.pt") for rank in range(world_size)]
    assert sorted(stats[0]) == [
        "1.running_mean",
        "1.running_var",
        "5.running_mean",
        "5.running_var",
    ]
    return stats


def _identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a)


def test_requires_torchrun_environment(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    example = _example()
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit) as exit_info:
        example.parse_args([])
    assert exit_info.value.code == 2
    assert "launch this script with torchrun" in capsys.readouterr().err


@pytest.mark.parametrize("option", [["--batch-size", "0"], ["--epochs", "0"], ["--steps", "-1"]])
def test_rejects_non_positive_sizes(
    option: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    example = _example()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(SystemExit):
        example.parse_args(option)
    assert "must be positive" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("options", "backend"),
    [
        ([], None),
        (["--compile"], "inductor"),
        (["--compile", "aot_eager", "--steps", "2"], "aot_eager"),
    ],
)
def test_compile_takes_an_optional_backend(
    options: list[str], backend: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    example = _example()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert example.parse_args(options).compile == backend


def test_one_node_compiled(tmp_path: Path) -> None:
    """``--standalone``, compiled. The eager script runs in the two-node launch below
    (every rank's statistics equal): a one-node eager launch (7 s) showed nothing more.
    ``aot_eager``: the script's compile path in half the time of its default, inductor
    (14.4 s cold), whose work under DDP tests/test_ddp.py's compiled scenarios check."""
    out = tmp_path / "out"
    options = TINY + ["--out", str(out), "--compile", "aot_eager"]
    output = _launch(tmp_path, _torchrun(tmp_path, "--standalone", "--nproc_per_node=2") + options)

    norm = "syncbn.SyncBatchNorm, compiled (aot_eager),"
    assert output.count(f"2 processes on cpu (gloo), {norm}") == 1, output
    assert output.count("epoch 2: train loss") == 1, output  # logged by rank 0 only
    stats = _running_stats(out, world_size=2)
    assert _identical(stats[0], stats[1])
    # The checkpoint has plain BatchNorm's keys: it loads into the unconverted model.
    model = _example().make_model()
    model.load_state_dict(torch.load(out / "model.pt"))
    assert torch.equal(model[1].running_var, stats[0]["1.running_var"])


def test_without_sync_each_rank_keeps_its_own_running_stats(tmp_path: Path) -> None:
    """The control of the launches above: ``--no-sync`` (plain BatchNorm) gives each rank
    the statistics of its own data, so that their equality there is syncbn's doing. One
    node: the number of nodes does not change what this shows (a two-node launch costs
    10 s, this one 6)."""
    out = tmp_path / "out"
    options = TINY + ["--out", str(out), "--no-sync"]
    output = _launch(tmp_path, _torchrun(tmp_path, "--standalone", "--nproc_per_node=2") + options)

    assert output.count("2 processes on cpu (gloo), plain BatchNorm") == 1, output
    stats = _running_stats(out, world_size=2)
    assert not _identical(stats[0], stats[1])


def test_two_nodes_on_loopback(tmp_path: Path) -> None:
    out = tmp_path / "out"
    agent = _torchrun(
        tmp_path,
        "--nnodes=2",
        "--nproc_per_node=2",
        "--rdzv_backend=c10d",
        f"--rdzv_endpoint=127.0.0.1:{free_port()}",
        f"--rdzv_id={tmp_path.name}",
        "--local_addr=127.0.0.1",
    )
    options = TINY + ["--out", str(out)]
    output = _launch(tmp_path, agent + options, agent + options)

    assert output.count("4 processes on cpu (gloo), syncbn.SyncBatchNorm") == 1, output
    stats = _running_stats(out, world_size=4)
    for rank in (1, 2, 3):
        assert _identical(stats[0], stats[rank]), f"rank {rank}"


def test_fewer_gpus_than_local_processes(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """One GPU, two local processes: CPU with a one-line note, or a usage error with the fix."""
    example = _example()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert example.choose_device(None, 0, 2) == "cpu"
    assert "2 processes on this node but 1 GPU(s): training on CPU" in capsys.readouterr().err
    assert example.choose_device(None, 1, 2) == "cpu"
    assert capsys.readouterr().err == ""  # said once per node
    with pytest.raises(SystemExit, match="pass --nproc_per_node=1 to torchrun, or --device cpu"):
        example.choose_device("cuda", 1, 2)
    assert example.choose_device(None, 0, 1) == "cuda"
    assert example.choose_device("cpu", 0, 1) == "cpu"
