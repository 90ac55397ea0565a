"""convert_sync_batchnorm / revert_sync_batchnorm: what is converted, shared and kept."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import syncbn


class BatchNormAct2d(nn.BatchNorm2d):
    """Like timm's: a BatchNorm subclass whose forward adds an activation."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return torch.relu(super().forward(input))


class RenamedBatchNorm2d(nn.BatchNorm2d):
    """A subclass that keeps BatchNorm's forward: safe to convert."""


def _model() -> nn.Module:
    lazy = nn.LazyBatchNorm2d()
    lazy(torch.randn(2, 4, 3, 3))  # materialise
    return nn.Sequential(
        nn.Conv2d(3, 4, 3),
        nn.BatchNorm2d(4),
        nn.Sequential(nn.BatchNorm1d(4, momentum=None), nn.BatchNorm3d(4, affine=False)),
        nn.SyncBatchNorm(4, eps=1e-3),
        lazy,
        nn.BatchNorm2d(4, track_running_stats=False),
        nn.BatchNorm2d(4, dtype=torch.float64),
        BatchNormAct2d(4),
        RenamedBatchNorm2d(4),
        nn.InstanceNorm2d(4),
        nn.GroupNorm(2, 4),
        nn.LayerNorm(4),
    )


def test_convert_replaces_every_plain_batchnorm_and_shares_state() -> None:
    model = _model()
    model[1].weight.requires_grad_(False)
    model[2][0].eval()
    before = dict(model.named_modules())
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    with pytest.warns(UserWarning, match=r"'7' \(BatchNormAct2d\) unconverted"):
        converted = syncbn.convert_sync_batchnorm(model)
    assert converted is model
    after = dict(converted.named_modules())
    for name in ["1", "2.0", "2.1", "3", "4", "5", "6", "8"]:
        old, new = before[name], after[name]
        assert type(new) is syncbn.SyncBatchNorm, name
        assert new.layer_name == name
        for attr in (
            "num_features",
            "eps",
            "momentum",
            "affine",
            "track_running_stats",
            "training",
        ):
            assert getattr(new, attr) == getattr(old, attr), (name, attr)
    for name in ["0", "7", "9", "10", "11"]:
        assert after[name] is before[name]
    # the very same Parameter and buffer objects: no copies
    for name, param in converted.named_parameters():
        assert param is params[name], name
    for name, buffer in converted.named_buffers():
        assert buffer is buffers[name], name
    assert params.keys() == dict(converted.named_parameters()).keys()
    assert not converted[1].weight.requires_grad
    assert converted[6].weight.dtype == torch.float64
    assert converted[3].eps == 1e-3


def test_convert_a_root_batchnorm_returns_the_new_layer() -> None:
    bn = nn.BatchNorm1d(3)
    converted = syncbn.convert_sync_batchnorm(bn)
    assert isinstance(converted, syncbn.SyncBatchNorm) and converted.weight is bn.weight
    assert syncbn.SyncBatchNorm.convert_sync_batchnorm(nn.BatchNorm2d(2)).num_features == 2


def test_unmaterialised_lazy_batchnorm_is_left_with_a_warning() -> None:
    model = nn.Sequential(nn.LazyBatchNorm2d())
    with pytest.warns(UserWarning, match="lazy layer '0'"):
        syncbn.convert_sync_batchnorm(model)
    assert isinstance(model[0], nn.LazyBatchNorm2d)


def test_converted_model_computes_what_the_original_did() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
    x = torch.randn(2, 3, 6, 6)
    expected = model(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        converted = syncbn.convert_sync_batchnorm(model)
    torch.testing.assert_close(converted(x), expected)


@pytest.mark.parametrize(
    ("shape", "expected"),
    [
        ((4, 3), nn.BatchNorm1d),
        ((4, 3, 5), nn.BatchNorm1d),
        ((4, 3, 5, 5), nn.BatchNorm2d),
        ((4, 3, 2, 5, 5), nn.BatchNorm3d),
        (None, syncbn.BatchNormNd),
    ],
)
def test_revert_picks_the_class_from_the_last_input(shape, expected) -> None:  # type: ignore[no-untyped-def]
    layer = syncbn.SyncBatchNorm(3, momentum=0.3, eps=1e-4)
    if shape is not None:
        layer(torch.randn(shape))
    layer.eval()
    reverted = syncbn.revert_sync_batchnorm(layer)
    assert type(reverted) is expected
    assert (reverted.momentum, reverted.eps, reverted.training) == (0.3, 1e-4, False)
    assert reverted.weight is layer.weight and reverted.running_var is layer.running_var


def test_round_trip_keeps_state_dict_identical() -> None:
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.BatchNorm1d(4))
    state = {k: v.clone() for k, v in plain.state_dict().items()}
    converted = syncbn.convert_sync_batchnorm(plain)
    converted[1](torch.randn(2, 4, 3, 3))
    converted[2](torch.randn(2, 4))
    trained = {k: v.clone() for k, v in converted.state_dict().items()}
    assert trained.keys() == state.keys()
    reverted = syncbn.revert_sync_batchnorm(converted)
    assert [type(m) for m in reverted] == [nn.Conv2d, nn.BatchNorm2d, nn.BatchNorm1d]
    after = reverted.state_dict()
    assert after.keys() == trained.keys()
    for key, value in trained.items():
        assert torch.equal(after[key], value), key
    assert not torch.equal(after["1.running_mean"], state["1.running_mean"])  # it did train


def test_state_dict_loads_both_ways() -> None:
    plain = nn.BatchNorm2d(5)
    plain(torch.randn(4, 5, 2, 2))
    sync = syncbn.SyncBatchNorm(5)
    sync.load_state_dict(plain.state_dict())
    back = nn.BatchNorm2d(5)
    back.load_state_dict(sync.state_dict())
    for key, value in plain.state_dict().items():
        assert torch.equal(back.state_dict()[key], value), key


def test_batchnorm_nd_accepts_any_rank() -> None:
    bn = syncbn.BatchNormNd(3)
    for shape in [(4, 3), (4, 3, 5), (4, 3, 2, 2), (4, 3, 2, 2, 2)]:
        assert bn(torch.randn(shape)).shape == shape
    with pytest.raises(ValueError, match=r"expected at least 2D input \(got 1D input\)"):
        bn(torch.randn(3))
