"""The README's "Use with" launches: torchrun + DDP and ``accelerate launch``, 2 CPU processes.

Each runs ``_launched_train.py`` (uneven local batches, one step, running statistics checked
against the global batch on every rank) under the real launcher in a subprocess on the loopback
interface, killed with its process group if it outlives ``LAUNCH_TIMEOUT``. The accelerate
case needs accelerate (``pip install -e ".[ecosystem]"``; ``.ci/ecosystem`` runs it).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from _launcher import free_port, loopback_env, run_launcher

SCRIPT = Path(__file__).resolve().with_name("_launched_train.py")
LAUNCH_TIMEOUT = 100.0  # seconds; below pytest-timeout's 120 so that the cleanup runs first


def _check_ranks(out: Path, output: str) -> None:
    assert sorted(p.name for p in out.glob("ok*")) == ["ok0", "ok1"], output


def test_torchrun_ddp_recipe(tmp_path: Path) -> None:
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--master_addr=127.0.0.1",
        f"--master_port={port}",
        str(SCRIPT),
        "ddp",
        str(tmp_path),
    ]
    _check_ranks(tmp_path, run_launcher(command, tmp_path, loopback_env(port), LAUNCH_TIMEOUT))


def test_accelerate_launch_recipe(tmp_path: Path) -> None:
    pytest.importorskip("accelerate", reason="accelerate is an optional dependency")
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",  # with no GPU: 2 CPU processes with gloo (without it: 1 process)
        "--num_processes=2",
        "--num_machines=1",
        "--mixed_precision=no",
        "--dynamo_backend=no",
        "--main_process_ip=127.0.0.1",
        f"--main_process_port={port}",
        str(SCRIPT),
        "accelerate",
        str(tmp_path),
    ]
    _check_ranks(tmp_path, run_launcher(command, tmp_path, loopback_env(port), LAUNCH_TIMEOUT))
