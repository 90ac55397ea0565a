"""Run a launcher command (torchrun, accelerate launch, a Lightning script) with bounded waits.

Shared by the ecosystem tests: the command runs in its own session on the loopback interface
(``MASTER_ADDR=127.0.0.1``, a free port, ``GLOO_SOCKET_IFNAME``), and is killed with its whole
process group if it outlives ``timeout``, or when it ends (ranks it left behind).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from pathlib import Path

__all__ = ["free_port", "loopback_env", "run_launcher"]


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def loopback_env(port: int) -> dict[str, str]:
    """This process's environment, with the rendezvous and gloo on the loopback interface."""
    env = dict(
        os.environ,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
        PYTHONWARNINGS="ignore::DeprecationWarning",
    )
    loopback = [name for _, name in socket.if_nameindex() if name.startswith("lo")]
    if loopback:  # gloo binds this interface instead of the one the hostname resolves to
        env["GLOO_SOCKET_IFNAME"] = loopback[0]
    return env


def run_launcher(command: list[str], cwd: Path, env: dict[str, str], timeout: float) -> str:
    """Run ``command``; return its output (stdout and stderr).

    Raises:
        AssertionError: if it exits with an error or does not finish within ``timeout``
            seconds (it is killed then), with its output.
    """
    with subprocess.Popen(
        command,
        cwd=cwd,
        # the launchers' temporary folders (torchrun's torchelastic_*, which it leaves
        # behind) in the test's own folder, which pytest removes
        env=dict(env, TMPDIR=str(cwd)),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group: the ranks are killed with it
    ) as proc:
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
            raise AssertionError(f"did not finish in {timeout:.0f}s: {command}\n{output}") from None
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # any rank left behind
            except ProcessLookupError:
                pass
    assert proc.returncode == 0, f"exit code {proc.returncode}: {command}\n{output}"
    return output
