"""Converted models leave training through torch's deployment and functional tools.

A model trained with SyncBatchNorm layers is exported as it is, without reverting them
first: ``torch.export`` (eval mode, and train mode without a process group),
``torch.jit.trace`` (eval mode), and ``torch.func``'s ``functional_call`` and ``vmap``
(ONNX: ``test_integrations_onnx.py``). Each gives what the eager layer gives, which in eval
mode (and without a process group) is torch's BatchNorm.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

import syncbn
from syncbn import _compiled


class _Block(nn.Module):
    """Conv, BatchNorm (maybe masked), ReLU: a layer between the ops export sees most."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.conv = nn.Conv1d(3, 6, 3, padding=1)
        self.norm = norm

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        y = self.conv(x)
        return torch.relu(self.norm(y) if mask is None else self.norm(y, mask))


def _trained_pair() -> tuple[_Block, nn.Module]:
    """A block with BatchNorm1d and its converted copy, with running statistics moved."""
    torch.manual_seed(0)
    norm = nn.BatchNorm1d(6)
    reference = _Block(norm)
    for _ in range(3):
        reference(torch.randn(4, 3, 10) * 2 + 1)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        norm.bias.normal_()
    converted = syncbn.convert_sync_batchnorm(copy.deepcopy(reference))
    assert isinstance(converted.norm, syncbn.SyncBatchNorm)
    return reference, converted


def _inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(5, 3, 10, generator=generator)
    mask = torch.rand(5, 10, generator=generator) < 0.7
    return x, mask


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_torch_export_of_a_converted_model_equals_batchnorm(mode: str) -> None:
    reference, converted = _trained_pair()
    reference.train(mode == "train")
    converted.train(mode == "train")
    x, _ = _inputs(1)
    program = torch.export.export(converted, (x,))
    exported = program.module()
    other, _ = _inputs(2)  # the program holds no value of the traced input
    torch.testing.assert_close(exported(other), reference(other))
    if mode == "train":  # the exported program moves its own copy of the buffers
        state = exported.state_dict()
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            # the module path; torch 2.1's and 2.2's exports flattened it in their own ways
            spellings = (f"norm.{name}", f"L__self___norm_{name}", f"norm_{name}")
            key = next((key for key in spellings if key in state), spellings[0])
            torch.testing.assert_close(state[key], getattr(reference.norm, name))


# TorchScript is deprecated from torch 2.13 on (its calls warn so); a tracer warning is an
# error: the layer's shape checks compare channel counts without one (three warned that the
# trace might not generalize, where torch's BatchNorm traces silently)
@pytest.mark.filterwarnings("ignore::DeprecationWarning", "error::torch.jit.TracerWarning")
def test_torch_jit_trace_of_an_eval_model_equals_batchnorm() -> None:
    """TorchScript by tracing (TorchServe and C++ deployments load it): eval mode records
    BatchNorm's op, which holds for another batch size, and the trace saves and loads."""
    reference, converted = _trained_pair()
    reference.eval()
    converted.eval()
    x, _ = _inputs(1)
    traced = torch.jit.trace(converted, (x,))
    buffer = io.BytesIO()
    torch.jit.save(traced, buffer)
    buffer.seek(0)
    loaded = torch.jit.load(buffer)
    other = torch.randn(9, 3, 10) * 2 + 1
    for module in (traced, loaded):
        torch.testing.assert_close(module(other), reference(other))


def _masked_reference(block: nn.Module, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Eval mode: BatchNorm's output with running statistics, zero at padded positions."""
    return block(x) * mask.unsqueeze(1)


def test_torch_export_of_a_masked_call_in_eval_mode() -> None:
    reference, converted = _trained_pair()
    reference.eval()
    converted.eval()
    x, mask = _inputs(1)
    exported = torch.export.export(converted, (x, mask)).module()
    other, other_mask = _inputs(2)
    torch.testing.assert_close(
        exported(other, other_mask), _masked_reference(reference, other, other_mask)
    )


@pytest.mark.skipif(not _compiled.FULLGRAPH, reason="masked training traces need torch >= 2.4")
def test_torch_export_of_a_masked_call_in_train_mode() -> None:
    # without a process group: an exact masked BatchNorm, as in eager mode
    _, converted = _trained_pair()
    converted.train()
    eager = copy.deepcopy(converted)
    x, mask = _inputs(1)
    program = torch.export.export(converted, (x, mask))
    # a process alone has no collective to order: no global order token in the program
    # (torch 2.4-2.7's export refused one; later versions lifted it as a constant)
    assert list(program.constants) == ["norm._site"]
    exported = program.module()
    other, other_mask = _inputs(2)
    torch.testing.assert_close(exported(other, other_mask), eager(other, other_mask))
    state = exported.state_dict()
    for name in ("running_mean", "running_var"):
        torch.testing.assert_close(state[f"norm.{name}"], getattr(eager.norm, name))


def test_functional_call_uses_the_given_parameters_and_buffers() -> None:
    reference, converted = _trained_pair()
    reference.eval()
    converted.eval()
    swapped = {
        name: torch.rand_like(t) + 0.5 if t.is_floating_point() else t + 3
        for name, t in converted.state_dict().items()
    }
    x, _ = _inputs(3)
    actual = torch.func.functional_call(converted, swapped, (x,))
    reference.load_state_dict(swapped)
    torch.testing.assert_close(actual, reference(x))


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_vmap_over_models_equals_batchnorm(mode: str) -> None:
    # train mode: torch.func's recipe, which stops tracking running statistics
    reference, converted = _trained_pair()
    for block in (reference, converted):
        block.train(mode == "train")
        if mode == "train":
            torch.func.replace_all_batch_norm_modules_(block)
    xs = torch.randn(3, 5, 3, 10)
    torch.testing.assert_close(torch.vmap(converted)(xs), torch.vmap(reference)(xs))


def test_conv_bn_folding_takes_a_layer_directly_and_a_model_after_reverting() -> None:
    from torch.ao.quantization import fuse_modules
    from torch.fx.experimental.optimization import fuse
    from torch.nn.utils.fusion import fuse_conv_bn_eval

    # Conv, BatchNorm, ReLU as modules in a row: what the model-level folders match.
    reference_block, converted_block = _trained_pair()
    conv, layer = converted_block.get_submodule("conv"), converted_block.get_submodule("norm")
    assert isinstance(conv, nn.Conv1d) and isinstance(layer, syncbn.SyncBatchNorm)
    reference = nn.Sequential(reference_block.conv, reference_block.norm, nn.ReLU()).eval()
    converted = nn.Sequential(conv, layer, nn.ReLU()).eval()
    x, _ = _inputs(3)
    expected = converted(x)
    torch.testing.assert_close(expected, reference(x))
    # The function reads the layer's running statistics and affine parameters: it takes ours.
    folded_conv = fuse_conv_bn_eval(conv, layer)
    torch.testing.assert_close(torch.relu(folded_conv(x)), expected)
    # The model-level tools match each module's exact class (as for torch.nn.SyncBatchNorm):
    # fx's `fuse` leaves the layer unfolded, and quantization's `fuse_modules` refuses it.
    assert any(isinstance(m, syncbn.SyncBatchNorm) for m in fuse(converted).modules())
    with pytest.raises(AssertionError, match="did not find fuser method"):
        fuse_modules(copy.deepcopy(converted), [["0", "1", "2"]])
    # After revert_sync_batchnorm, both fold the layer away and keep its eval outputs.
    for folded in (
        fuse(syncbn.revert_sync_batchnorm(copy.deepcopy(converted))),
        fuse_modules(syncbn.revert_sync_batchnorm(copy.deepcopy(converted)), [["0", "1", "2"]]),
    ):
        assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in folded.modules())
        torch.testing.assert_close(folded(x), expected)
