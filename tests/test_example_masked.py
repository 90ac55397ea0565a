"""examples/masked_sequences.py: launched for real with torchrun, its printed numbers checked.

The launch runs the script with tiny settings under ``python -m torch.distributed.run
--standalone`` on 2 CPU ranks (gloo), through ``_launch`` of tests/test_examples.py: bound
to the loopback interface and killed with its whole process group if it outlives
``LAUNCH_TIMEOUT``.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest
from test_examples import ROOT, _launch

__all__: list[str] = []

SCRIPT = ROOT / "examples" / "masked_sequences.py"
TINY = ["--steps", "8", "--batch-size", "4", "--max-length", "48", "--eval-batches", "1"]
TINY += ["--timeout", "60"]
ROW = re.compile(r"^(\S.*?)\s{2,}(\S+)\s{2,}(\S+)$")  # a label and two numbers


def _example(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    spec = importlib.util.spec_from_file_location("masked_sequences", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look it up there
    spec.loader.exec_module(module)
    return module


def _rows(output: str) -> dict[str, tuple[float, float]]:
    """The table rows of the output: label -> the two numbers."""
    rows = {}
    for line in output.splitlines():
        match = ROW.match(line)
        if match:
            try:
                rows[match[1]] = (float(match[2]), float(match[3]))
            except ValueError:  # a header line
                continue
    return rows


def test_masked_matches_the_reference_and_padded_batchnorm_drifts(tmp_path: Path) -> None:
    # --log_dir in the test's folder, as test_examples.py's launches: else torchrun leaves
    # a torchelastic_* folder in /tmp at every run
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += [f"--log_dir={tmp_path / 'torchelastic'}", "--nproc_per_node=2"]
    command += [str(SCRIPT), *TINY]
    output = _launch(tmp_path, command)

    assert output.count("2 ranks (gloo) x 4 sequences") == 1, output  # rank 0 prints
    rows = _rows(output)
    drift = [
        "running_mean error (std units, max)",
        "running_var error (relative, max)",
        "train output vs unpadded (rel. RMS)",
        "train output, padded 2x longer (rel. change)",
        "eval output vs valid statistics (rel. RMS)",
    ]
    parity = [
        "block output (valid steps)",
        "logits",
        "parameter gradients",
        "running_mean",
        "running_var",
        "weights after training",
    ]
    assert set(drift + parity) <= rows.keys(), output
    for label in drift:
        padded, masked = rows[label]
        assert masked < 1e-12, f"{label}: masked {masked}\n{output}"
        assert padded > 1e-3, f"{label}: padded {padded}\n{output}"
    # padding moves the outputs of training by percents: 4.7 % and 14 % at these settings
    assert rows["train output vs unpadded (rel. RMS)"][0] > 0.01, output
    assert rows["train output, padded 2x longer (rel. change)"][0] > 0.05, output
    for label in parity:
        diff, scale = rows[label]
        assert diff <= 1e-12 * max(scale, 1.0), f"{label}: max |diff| {diff}\n{output}"


def test_requires_torchrun_environment(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    example = _example(monkeypatch)
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit) as exit_info:
        example.parse_args([])
    assert exit_info.value.code == 2
    assert "launch this script with torchrun" in capsys.readouterr().err
