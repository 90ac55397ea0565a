"""``syncbn demo`` end to end with tiny settings, and its shutdown on failure and Ctrl-C."""

from __future__ import annotations

import ctypes
import importlib.util
import json
import multiprocessing
import os
import re
import select
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from _harness import alive, wait_until

from syncbn import _cli as cli
from syncbn._cli.demo import (
    _DEMO_PACKAGES,
    PLOT_FILE,
    RESULTS_FILE,
    DemoConfig,
    DemoError,
    run_demo,
)

# the demo needs its extra (CI installs it with ".[test]"; a bare GPU machine may lack it)
_MISSING = [module for module in _DEMO_PACKAGES if importlib.util.find_spec(module) is None]
if _MISSING:
    pytest.skip(
        f"the demo extra is not installed (no {', '.join(_MISSING)}): pip install 'syncbn[demo]'",
        allow_module_level=True,
    )
import matplotlib.image  # noqa: E402 - after the check that it is installed
from PIL import Image  # noqa: E402

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _rank_processes(parent: int) -> list[int]:
    """The spawned (multiprocessing) children of ``parent``, without its resource tracker."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as file:
                ppid = int(file.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as file:
                cmdline = file.read()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if ppid == parent and b"spawn_main" in cmdline:
            pids.append(int(entry))
    return pids


def test_demo_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "demo"
    argv = ["demo", "--nproc", "2", "--batch-per-proc", "2", "--steps", "16", "--out", str(out)]
    exit_code = cli.main(argv)
    printed, errors = capsys.readouterr()
    assert exit_code == 0, errors

    results = json.loads((out / RESULTS_FILE).read_text())
    runs = results["runs"]
    assert list(runs) == ["plain_ddp", "syncbn_ddp", "single_process"]
    sync, plain, single = runs["syncbn_ddp"], runs["plain_ddp"], runs["single_process"]
    # (b) SyncBatchNorm under DDP equals (c) one process on the global batch (float64) ...
    sync_diff = sync["max_abs_diff_vs_single_process"]
    assert max(sync_diff["parameters"], sync_diff["buffers"]) < 1e-10
    assert sync["curve"]["step"] == single["curve"]["step"]
    assert sync["curve"]["train_loss"] == pytest.approx(single["curve"]["train_loss"], rel=1e-10)
    assert sync["curve"]["test_accuracy"] == single["curve"]["test_accuracy"]
    # ... and plain BatchNorm with per-rank statistics does not.
    plain_diff = plain["max_abs_diff_vs_single_process"]
    assert plain_diff["parameters"] > 1e-3 and plain_diff["buffers"] > 1e-3
    assert plain["curve"]["train_loss"] != pytest.approx(single["curve"]["train_loss"], rel=1e-3)
    assert results["config"]["steps"] == 16 and results["global_batch"] == 4

    for record in runs.values():
        assert record["label"] in printed
        assert f"{100 * record['test_accuracy']:.1f} %" in printed
    assert f"{max(plain_diff.values()):.1e}" in printed

    png = (out / PLOT_FILE).read_bytes()
    assert png.startswith(PNG_SIGNATURE)
    with Image.open(out / PLOT_FILE) as image:
        image.verify()
    pixels = matplotlib.image.imread(out / PLOT_FILE)
    assert pixels.ndim == 3 and pixels.shape[0] > 300 and pixels.shape[1] > 600
    assert pixels.std() > 0.05  # not a blank canvas


def test_failure_in_one_rank_stops_every_rank(tmp_path: Path) -> None:
    started: list[int] = []
    config = DemoConfig(nproc=2, batch_per_proc=2, steps=10_000, fail_rank=1, fail_step=3)
    with pytest.raises(DemoError, match=r"rank 1 failed \(RuntimeError: injected failure") as info:
        run_demo(config, str(tmp_path), on_start=started.extend)
    assert info.value.exit_code == 1
    assert len(started) == 2
    assert not [pid for pid in started if alive(pid)]
    assert not [p for p in multiprocessing.active_children() if p.pid in started]
    assert not (tmp_path / RESULTS_FILE).exists()


def _read(fd: int, output: bytearray, done: Callable[[bytearray], object], seconds: float) -> bool:
    """Append what ``fd`` yields to ``output`` until ``done(output)``, EOF or ``seconds``;
    whether it stopped before the time ran out."""
    deadline = time.monotonic() + seconds
    while not done(output):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        if select.select([fd], [], [], min(remaining, 0.5))[0]:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # EIO: every writer closed the terminal
                chunk = b""
            if not chunk:
                return True
            output += chunk
    return True


def _read_until(
    fd: int,
    output: bytearray,
    done: Callable[[bytearray], object],
    timeout: float,
    what: str,
    describe: Callable[[], str] | None = None,
) -> None:
    """:func:`_read`, failing the test at the timeout with the output's end, and with
    ``describe()`` (what the processes were doing) where given."""
    if not _read(fd, output, done, timeout):
        state = "" if describe is None else f"\n{describe()}"
        pytest.fail(
            f"timed out after {timeout:.0f}s waiting for {what}; "
            f"output ended with {bytes(output[-2000:])!r}; its lines other than "
            f"progress bars: {_not_progress(output)!r}{state}"
        )


def _not_progress(output: bytearray) -> list[bytes]:
    """The lines of a terminal's output that are not tqdm's progress bar (a message that
    scrolled by among thousands of its redraws: "Exception ignored in ...", say)."""
    lines = re.split(rb"[\r\n]+", bytes(output))
    return [line for line in lines if line.strip() and not re.search(rb"\d+/\d+ \[", line)]


_SIGNAL_FIELDS = ("State", "Threads", "SigPnd", "ShdPnd", "SigBlk", "SigIgn", "SigCgt")


def _signal_state(pids: list[int]) -> str:
    """Each process's state and signal masks, and each of its threads' name, state, blocked
    signals and kernel wait channel, from ``/proc`` (a failure's report)."""

    def status(path: str) -> dict[str, str]:
        with open(f"{path}/status") as file:
            return {
                k: v.strip() for k, v in (line.split(":", 1) for line in file.read().splitlines())
            }

    lines = []
    for pid in pids:
        try:
            fields = status(f"/proc/{pid}")
            lines.append(f"pid {pid}: " + ", ".join(f"{k} {fields[k]}" for k in _SIGNAL_FIELDS))
            for task in sorted(os.listdir(f"/proc/{pid}/task"), key=int):
                path = f"/proc/{pid}/task/{task}"
                with open(f"{path}/wchan") as file:
                    wchan = file.read()
                thread = status(path)
                lines.append(
                    f"  thread {task} {thread['Name']}: {thread['State']}, "
                    f"SigBlk {thread['SigBlk']}, wchan {wchan}"
                )
        except (FileNotFoundError, ProcessLookupError):
            lines.append(f"pid {pid}: gone")
    return "\n".join(lines)


def _killed_with_this_process() -> None:
    """``preexec_fn`` of a long run: Linux sends it SIGKILL when the process that started it
    ends (``PR_SET_PDEATHSIG``), so that a pytest killed outright (a run past its time) leaves
    no demo training its 1,000,000 steps behind; its ranks then end themselves
    (``syncbn._cli.launch.exit_with_parent``)."""
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses a pty and reads /proc")
def test_ctrl_c_stops_every_rank(tmp_path: Path) -> None:
    """SIGINT (Ctrl-C) to the parent process only: the parent must stop the ranks itself.

    (A terminal's Ctrl-C also signals the ranks, which then exit on their own; signalling
    only the parent checks that it does not rely on that.) stderr is a terminal (a pty),
    so rank 0 shows its progress bar; the signal is sent once the bar of run (a) shows
    that training has started.
    """
    import fcntl
    import pty
    import termios

    controller, terminal = pty.openpty()
    # a terminal 120 columns wide (a new pty has 0, and tqdm then draws an empty bar)
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    # `python -m syncbn demo`, with a dump of every thread's Python stack on SIGUSR1, which
    # the test sends if the demo outlives the Ctrl-C (what it waited on, in the failure)
    command = (
        "import faulthandler, signal, sys; from syncbn._cli import main; "
        "faulthandler.register(signal.SIGUSR1, all_threads=True); sys.exit(main())"
    )
    process = subprocess.Popen(
        [sys.executable, "-c", command, "demo", "--steps", "1000000", "--out", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=terminal,
        start_new_session=True,  # its own process group, so that cleanup can kill it whole
        preexec_fn=_killed_with_this_process,
    )
    os.close(terminal)
    err = bytearray()
    try:
        _read_until(
            controller,
            err,
            lambda text: (
                b"(a) BatchNorm, DDP 2 ranks x 2:" in text and re.search(rb"\d+/1000000", text)
            ),
            70,
            "the progress bar of run (a)",
        )
        ranks = _rank_processes(process.pid)
        assert len(ranks) == 2
        os.kill(process.pid, signal.SIGINT)

        def describe() -> str:
            state = _signal_state([process.pid, *ranks])
            dump = bytearray()
            if process.poll() is None:
                os.kill(process.pid, signal.SIGUSR1)
                _read(controller, dump, lambda text: b"Current thread" in text, 5.0)
                _read(controller, dump, lambda text: False, 1.0)  # the rest of the dump
            return f"{state}\nthe demo's threads:\n{dump.decode(errors='replace')}"

        _read_until(controller, err, lambda text: False, 25, "the end of the output", describe)
        process.wait(timeout=10)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        os.close(controller)
        if process.stdout is not None:
            process.stdout.close()
    text = err.decode(errors="replace")
    assert process.returncode == 130, text
    assert "syncbn demo: error: interrupted" in text
    assert "Traceback" not in text and "leaked" not in text, text
    wait_until(lambda: not [pid for pid in ranks if alive(pid)], 10, "every rank is gone")
