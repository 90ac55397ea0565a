"""A converted model leaves training for ONNX as it is, without reverting its layers.

``torch.onnx.export`` of an eval-mode model holding SyncBatchNorm layers, through both of
torch's exporters (``dynamo=True``, built on ``torch.export``; the TorchScript one,
``dynamo=False``), runs in ONNX Runtime with the eager model's outputs, at the traced batch
size and at another one (a dynamic batch dimension). A masked call exports too: its mask is
a graph input, and padded positions stay zero. Needs onnx, onnxscript and onnxruntime
(``pip install -e ".[ecosystem]"``; ``.ci/ecosystem`` runs it).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import syncbn

onnxruntime = pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")
pytest.importorskip("onnxscript")


class _Net(nn.Module):
    """Conv, BatchNorm2d, ReLU, pooling, Linear, BatchNorm1d: both layer kinds a
    converted model holds, with running statistics moved by training."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.norm2d = nn.BatchNorm2d(8)
        self.linear = nn.Linear(8, 5)
        self.norm1d = nn.BatchNorm1d(5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.norm2d(self.conv(x)))
        return self.norm1d(self.linear(y.mean((2, 3))))


class _MaskedNet(nn.Module):
    """A Conformer-style convolution over padded sequences: the mask passed to the layer."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(4, 6, 3, padding=1)
        self.norm = nn.BatchNorm1d(6)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.norm(self.conv(x), mask)


def _trained(model: nn.Module, *inputs: torch.Tensor) -> nn.Module:
    """``model`` converted, trained for three steps without a process group (syncbn is
    BatchNorm there), its affine parameters moved off 1 and 0, then in eval mode."""
    converted = syncbn.convert_sync_batchnorm(model)
    layers = [m for m in converted.modules() if isinstance(m, syncbn.SyncBatchNorm)]
    assert len(layers) >= 1
    for _ in range(3):
        converted(*inputs)
    with torch.no_grad():
        for layer in layers:
            layer.weight.uniform_(0.5, 1.5)
            layer.bias.normal_()
            running_mean = layer.running_mean
            assert running_mean is not None
            assert not torch.equal(running_mean, torch.zeros_like(running_mean))
    return converted.eval()


def _export(
    model: nn.Module, inputs: tuple[torch.Tensor, ...], names: list[str], dynamo: bool, path: Path
) -> Path:
    """``model`` exported to ``path`` with a dynamic batch dimension on every input."""
    batch = {0: "batch"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exporters' deprecation and tracer notes
        if dynamo:
            dims = {name: {0: torch.export.Dim("batch", min=1, max=64)} for name in names}
            torch.onnx.export(model, inputs, path, input_names=names, dynamic_shapes=dims)
        else:
            axes = {name: batch for name in names}
            torch.onnx.export(
                model, inputs, path, input_names=names, dynamic_axes=axes, dynamo=False
            )
    return path


def _run(path: Path, names: list[str], inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feed = {name: tensor.numpy() for name, tensor in zip(names, inputs)}
    return torch.from_numpy(session.run(None, feed)[0])


@pytest.mark.parametrize("dynamo", [True, False], ids=["dynamo", "torchscript"])
def test_an_eval_model_exports_to_onnx_with_its_outputs(tmp_path: Path, dynamo: bool) -> None:
    torch.manual_seed(0)
    model = _trained(_Net(), torch.randn(6, 3, 10, 10) * 2 + 1)
    path = _export(model, (torch.randn(4, 3, 10, 10),), ["x"], dynamo, tmp_path / "net.onnx")
    for batch in (4, 7):  # the traced size, and another through the dynamic dimension
        x = torch.randn(batch, 3, 10, 10) * 2 + 1
        with torch.no_grad():
            expected = model(x)
        torch.testing.assert_close(_run(path, ["x"], (x,)), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dynamo", [True, False], ids=["dynamo", "torchscript"])
def test_a_masked_eval_model_exports_to_onnx(tmp_path: Path, dynamo: bool) -> None:
    torch.manual_seed(0)
    lengths = torch.tensor([12, 7, 3, 9])
    train_mask = torch.arange(12) < lengths[:, None]
    model = _trained(_MaskedNet(), torch.randn(4, 4, 12), train_mask)
    example = (torch.randn(3, 4, 12), torch.rand(3, 12) < 0.6)
    path = _export(model, example, ["x", "mask"], dynamo, tmp_path / "masked.onnx")
    for batch in (3, 5):
        x = torch.randn(batch, 4, 12)
        mask = torch.rand(batch, 12) < 0.6
        mask[0] = True  # one sequence with no padding, one with no valid position
        mask[1] = False
        with torch.no_grad():
            expected = model(x, mask)
        actual = _run(path, ["x", "mask"], (x, mask))
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
        assert bool((actual.permute(0, 2, 1)[~mask] == 0).all())  # padded positions stay zero
        assert bool((actual.permute(0, 2, 1)[mask] != 0).all())
