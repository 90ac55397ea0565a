"""convert_sync_batchnorm / revert_sync_batchnorm: what is converted, shared and kept."""

from __future__ import annotations

import copy
import gc
import importlib.util
import inspect
import pickle
import warnings
import weakref
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any, cast

import pytest
import torch
import torch.fx
from _harness import WorkerPool
from _source_tree import run_without_metadata
from torch import nn

import syncbn
from syncbn import _conversion
from syncbn.data_parallel import SynchronizedBatchNorm1d, SynchronizedBatchNorm2d, convert_model


class BatchNormAct2d(nn.BatchNorm2d):
    """Like timm's: a BatchNorm subclass whose forward adds an activation."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return torch.relu(super().forward(input))


class RenamedBatchNorm2d(nn.BatchNorm2d):
    """A subclass that keeps BatchNorm's forward: safe to convert."""


def _model() -> nn.Sequential:
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
    cast(nn.Sequential, model[2])[0].eval()
    before = dict(model.named_modules())
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    with pytest.warns(
        UserWarning, match=r"1 BatchNorm layer\(s\) unconverted: '7' \(BatchNormAct2d\)"
    ):
        converted = cast(nn.Sequential, syncbn.convert_sync_batchnorm(model))
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
    with pytest.warns(UserWarning, match=r"lazy layer\(s\) '0' \(LazyBatchNorm2d\)"):
        syncbn.convert_sync_batchnorm(model)
    assert isinstance(model[0], nn.LazyBatchNorm2d)


def test_convert_model_leaves_an_unmaterialised_lazy_batchnorm_with_a_warning() -> None:
    """The DataParallel API's converter too (it left the layer silently)."""
    model = nn.Sequential(nn.Linear(2, 3), nn.LazyBatchNorm1d())
    with pytest.warns(UserWarning, match=r"convert_model left '1' \(LazyBatchNorm1d\): it is lazy"):
        convert_model(model)
    assert isinstance(model[1], nn.LazyBatchNorm1d)


@pytest.mark.parametrize("forward_first", [False, True], ids=["loaded", "loaded-then-run"])
@pytest.mark.parametrize("converter", ["convert_sync_batchnorm", "convert_model"])
def test_a_lazy_batchnorm_materialised_by_load_state_dict_converts(
    converter: str, forward_first: bool
) -> None:
    """``load_state_dict`` materialises a lazy layer's tensors but keeps its lazy class (until
    its first forward) and ``num_features = 0`` (for good: torch sets it only where a forward
    materialises). Both converters left it lazy with a warning to run a forward (which then
    made it an unsynchronized BatchNorm2d), and a twin of one that had run took 0 channels
    and refused every input (a review, 2026-12-08). Now it converts, with the channel count
    of its tensors, and reverts to the BatchNorm2d its forward would have made it."""
    torch.manual_seed(0)
    trained = nn.Sequential(nn.Conv2d(3, 3, 1), nn.BatchNorm2d(3))
    trained(torch.randn(4, 3, 6, 6))  # running statistics that are not the defaults
    trained.eval()
    model = nn.Sequential(nn.LazyConv2d(3, 1), nn.LazyBatchNorm2d())
    model.load_state_dict(trained.state_dict())
    weight = model[1].weight
    x = torch.randn(4, 3, 6, 6)
    if forward_first:
        model.eval()(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "lazy layer left" warning
        converted = (
            syncbn.convert_sync_batchnorm(model)
            if converter == "convert_sync_batchnorm"
            else convert_model(model)
        )
    assert converted is model
    layer = model[1]
    assert isinstance(
        layer, SynchronizedBatchNorm2d if converter == "convert_model" else syncbn.SyncBatchNorm
    )
    assert layer.num_features == 3 and layer.weight is weight
    torch.testing.assert_close(model.eval()(x), trained(x))
    if converter == "convert_sync_batchnorm":
        syncbn.revert_sync_batchnorm(model)
        assert type(model[1]) is nn.BatchNorm2d


class _Floor(nn.Module):
    def forward(self, value: torch.Tensor) -> torch.Tensor:
        return value.clamp_min(1e-3)


def test_a_batchnorm_with_a_parametrized_buffer_converts_and_reverts() -> None:
    """A running statistic parametrized with ``torch.nn.utils.parametrize`` lives under
    ``parametrizations``, not among the layer's buffers: conversion deleted the twin's
    buffer of that name as one the layer did not have, and carrying the parametrization
    over then raised that the twin had no such buffer (a review, 2026-12-08; torch's
    converter takes it). It is carried over as a parametrized weight is; the numbers are
    those of the original (whose running statistics, computed, move as torch's do)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.BatchNorm2d(3))
    torch.nn.utils.parametrize.register_parametrization(model[0], "running_var", _Floor())
    original = copy.deepcopy(model)
    parametrizations = model[0].parametrizations
    syncbn.convert_sync_batchnorm(model)
    assert isinstance(model[0], syncbn.SyncBatchNorm)
    assert model[0].parametrizations is parametrizations
    x = torch.randn(4, 3, 5, 5)
    for mode in (True, False):
        torch.testing.assert_close(model.train(mode)(x), original.train(mode)(x))
    assert model.state_dict().keys() == original.state_dict().keys()
    syncbn.revert_sync_batchnorm(model)
    assert torch.nn.utils.parametrize.type_before_parametrizations(model[0]) is nn.BatchNorm2d
    assert model.state_dict().keys() == original.state_dict().keys()


class _CalibratedBatchNorm2d(nn.BatchNorm2d):
    """Keeps BatchNorm's forward, and state of its own in ``state_dict``."""

    def __init__(self, num_features: int) -> None:
        super().__init__(num_features)
        self.calibration = 0

    def get_extra_state(self) -> Any:
        return {"calibration": self.calibration}

    def set_extra_state(self, state: Any) -> None:
        self.calibration = state["calibration"]


def test_a_batchnorm_subclass_with_extra_state_is_left_with_a_warning() -> None:
    """A twin of another class drops what ``get_extra_state`` keeps: the converted model's
    ``state_dict`` lost the key, its checkpoints no longer loaded, and reverting gave back
    the class with its default state (a review, 2026-12-08; torch's converter drops it
    too). Like a class with its own forward, it is left unless a converter is registered."""
    layer = _CalibratedBatchNorm2d(3)
    layer.calibration = 42
    model = nn.Sequential(layer)
    with pytest.warns(UserWarning, match=r"'0' \(_CalibratedBatchNorm2d\).*get_extra_state"):
        syncbn.convert_sync_batchnorm(model)
    with pytest.warns(UserWarning, match=r"'0' \(_CalibratedBatchNorm2d\): it keeps extra state"):
        convert_model(model)
    assert model[0] is layer and layer.calibration == 42
    assert "0._extra_state" in model.state_dict()


def test_a_failed_conversion_leaves_synchronized_layers_as_they_were() -> None:
    """The layers synchronized already took their new names and settings while the model
    was walked, before a later layer's converter raised: the model was left half changed
    (a review, 2026-12-08). They are set once every replacement is built."""

    def to_sync(module: BatchNormAct2d) -> nn.Module:
        raise RuntimeError("this converter refuses")

    syncbn.register_converter(BatchNormAct2d, to_sync)
    first = syncbn.SyncBatchNorm(3)
    identity = first.layer_identity
    model = nn.Sequential(first, BatchNormAct2d(3))
    with pytest.raises(RuntimeError, match="this converter refuses"):
        syncbn.convert_sync_batchnorm(model, check_layer_order=False)
    assert (first.layer_name, first.layer_identity, first.check_layer_order) == ("", identity, True)


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
def test_revert_picks_the_class_from_the_last_input(
    shape: tuple[int, ...] | None, expected: type[nn.Module]
) -> None:
    layer = syncbn.SyncBatchNorm(3, momentum=0.3, eps=1e-4)
    if shape is not None:
        layer(torch.randn(shape))
    layer.eval()
    reverted = syncbn.revert_sync_batchnorm(layer)
    assert type(reverted) is expected
    assert (reverted.momentum, reverted.eps, reverted.training) == (0.3, 1e-4, False)
    assert reverted.weight is layer.weight and reverted.running_var is layer.running_var


@pytest.mark.parametrize("training", [True, False])
def test_revert_ignores_an_input_the_layer_refused(training: bool) -> None:
    """The class comes from the last input a call ran on: a refused 3-D call (5 channels
    for 4) after 4-D ones made a BatchNorm1d, which then refused the model's inputs."""
    layer = syncbn.SyncBatchNorm(4).train(training)
    layer(torch.randn(2, 4, 3, 3))
    with pytest.raises(ValueError, match="expected input with 4 channels"):
        layer(torch.randn(2, 5, 8))
    assert type(syncbn.revert_sync_batchnorm(layer)) is nn.BatchNorm2d


def test_round_trip_keeps_state_dict_identical() -> None:
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.BatchNorm1d(4))
    state = {k: v.clone() for k, v in plain.state_dict().items()}
    converted = cast(nn.Sequential, syncbn.convert_sync_batchnorm(plain))
    converted[1](torch.randn(2, 4, 3, 3))
    converted[2](torch.randn(2, 4))
    trained = {k: v.clone() for k, v in converted.state_dict().items()}
    assert trained.keys() == state.keys()
    reverted = cast(nn.Sequential, syncbn.revert_sync_batchnorm(converted))
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


@pytest.fixture(autouse=True)
def _fresh_registry() -> Iterator[None]:
    """Each test starts and ends with the registry it found."""
    converters = dict(_conversion._CONVERTERS)
    loaded = set(_conversion._LOADED_PACKAGES)
    yield
    _conversion._CONVERTERS.clear()
    _conversion._CONVERTERS.update(converters)
    _conversion._LOADED_PACKAGES.clear()
    _conversion._LOADED_PACKAGES.update(loaded)


def test_revert_restores_the_class_each_layer_replaced() -> None:
    model = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # '7' stays unconverted
        syncbn.convert_sync_batchnorm(model)
    model[5](torch.randn(2, 4, 3))  # a BatchNorm2d that saw a 3-D input stays a BatchNorm2d
    reverted = cast(nn.Sequential, syncbn.revert_sync_batchnorm(copy.deepcopy(model)))
    expected = [
        nn.Conv2d,
        nn.BatchNorm2d,  # never saw an input
        nn.Sequential,
        nn.SyncBatchNorm,
        nn.BatchNorm2d,  # LazyBatchNorm2d becomes BatchNorm2d when it materialises
        nn.BatchNorm2d,
        nn.BatchNorm2d,
        BatchNormAct2d,
        RenamedBatchNorm2d,
    ]
    assert [type(m) for m in list(reverted)[:9]] == expected
    reverted_inner = cast(nn.Sequential, reverted[2])
    assert [type(m) for m in reverted_inner] == [nn.BatchNorm1d, nn.BatchNorm3d]
    assert reverted[3].eps == 1e-3 and reverted_inner[0].momentum is None
    # the class is remembered through pickling too
    unpickled = pickle.loads(pickle.dumps(model))
    reverted_unpickled = cast(nn.Sequential, syncbn.revert_sync_batchnorm(unpickled))
    assert type(reverted_unpickled[8]) is RenamedBatchNorm2d


class ScaledBatchNorm2d(nn.BatchNorm2d):
    """A subclass whose constructor does not take BatchNorm's arguments."""

    def __init__(self, channels: int, scale: float) -> None:
        super().__init__(channels)
        self.scale = scale


def test_revert_names_a_class_it_cannot_rebuild() -> None:
    model = nn.Sequential(nn.BatchNorm2d(3), ScaledBatchNorm2d(3, 2.0), nn.BatchNorm2d(3))
    syncbn.convert_sync_batchnorm(model)  # in place
    converted = list(model)
    with pytest.raises(TypeError, match=r"cannot rebuild '1' as ScaledBatchNorm2d .*register"):
        syncbn.revert_sync_batchnorm(model)
    assert list(model) == converted  # nothing reverted: not the layer before it either
    syncbn.register_converter(
        ScaledBatchNorm2d,
        to_plain=lambda layer: _conversion.share_state(layer, ScaledBatchNorm2d(3, 2.0)),
    )
    reverted = cast(nn.Sequential, syncbn.revert_sync_batchnorm(model))
    types = [type(layer) for layer in reverted]
    assert types == [nn.BatchNorm2d, ScaledBatchNorm2d, nn.BatchNorm2d]


class DevicelessBatchNorm2d(nn.BatchNorm2d):
    """A subclass whose constructor takes BatchNorm's five settings, and no ``device``."""

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats)


def test_a_subclass_whose_constructor_takes_no_device_reverts() -> None:
    model = nn.Sequential(DevicelessBatchNorm2d(3, momentum=0.3))
    x = torch.randn(4, 3, 2, 2)
    model(x)  # running statistics of its own, which the round trip must keep
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    syncbn.convert_sync_batchnorm(model)
    weight = model[0].weight
    syncbn.revert_sync_batchnorm(model)
    assert type(model[0]) is DevicelessBatchNorm2d and model[0].momentum == 0.3
    assert model[0].weight is weight
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, state[name], rtol=0, atol=0)


def test_a_converter_that_raises_leaves_the_model_as_it_was() -> None:
    def to_sync(module: BatchNormAct2d) -> nn.Module:
        raise RuntimeError("this converter refuses")

    syncbn.register_converter(BatchNormAct2d, to_sync)
    model = nn.Sequential(nn.BatchNorm2d(4), nn.Sequential(BatchNormAct2d(4)))
    layers = list(model.modules())
    with pytest.raises(RuntimeError, match="this converter refuses"):
        syncbn.convert_sync_batchnorm(model)
    assert list(model.modules()) == layers  # the BatchNorm2d before it was not converted


class NaiveSyncBatchNorm(nn.BatchNorm2d):
    """Like detectron2's: its own forward, which computes what BatchNorm computes."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return super().forward(input)


class NaiveSyncBatchNormChild(NaiveSyncBatchNorm):
    """Inherits the registered class's forward."""


class NaiveSyncBatchNormAct(NaiveSyncBatchNorm):
    """Overrides the registered class's forward."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return torch.relu(super().forward(input))


def test_a_registered_class_converts_and_reverts_with_the_default_twins() -> None:
    model = nn.Sequential(
        NaiveSyncBatchNorm(3), NaiveSyncBatchNormChild(3), NaiveSyncBatchNormAct(3)
    )
    with pytest.warns(UserWarning, match=r"3 BatchNorm layer\(s\) unconverted: '0' .*'1' .*'2'"):
        syncbn.convert_sync_batchnorm(copy.deepcopy(model))
    syncbn.register_converter(NaiveSyncBatchNorm)
    weight = model[0].weight
    with pytest.warns(UserWarning, match=r"unconverted: '2' \(NaiveSyncBatchNormAct\)\.") as record:
        syncbn.convert_sync_batchnorm(model)
    assert len(record) == 1
    assert [type(m) for m in model] == [
        syncbn.SyncBatchNorm,
        syncbn.SyncBatchNorm,
        NaiveSyncBatchNormAct,
    ]
    assert model[0].weight is weight and model[1].layer_name == "1"
    syncbn.revert_sync_batchnorm(model)
    assert [type(m) for m in model] == [
        NaiveSyncBatchNorm,
        NaiveSyncBatchNormChild,
        NaiveSyncBatchNormAct,
    ]
    assert model[0].weight is weight


class SyncAct(syncbn.SyncBatchNorm):
    """The synchronized twin of BatchNormAct2d: BatchNorm over the global batch, then ReLU."""

    def forward(self, input: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return torch.relu(super().forward(input, mask))


def test_a_registered_converter_is_called_both_ways() -> None:
    calls = []

    def to_sync(module: BatchNormAct2d) -> SyncAct:
        calls.append("to_sync")
        return _conversion.batchnorm_twin(module, SyncAct)

    def to_plain(layer: SyncAct) -> BatchNormAct2d:
        calls.append("to_plain")
        return _conversion.batchnorm_twin(layer, BatchNormAct2d)

    syncbn.register_converter(BatchNormAct2d, to_sync, to_plain)
    model = nn.Sequential(nn.Conv2d(3, 4, 1), BatchNormAct2d(4, momentum=0.2))
    x = torch.randn(3, 3, 2, 2)
    expected = model(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        syncbn.SyncBatchNorm.convert_sync_batchnorm(model, process_group=None)
    assert type(model[1]) is SyncAct and model[1].momentum == 0.2 and model[1].layer_name == "1"
    torch.testing.assert_close(model(x), expected)
    syncbn.revert_sync_batchnorm(model)
    assert type(model[1]) is BatchNormAct2d and calls == ["to_sync", "to_plain"]


def test_register_converter_rejects_what_it_cannot_use() -> None:
    with pytest.raises(TypeError, match="expected a BatchNorm class"):
        syncbn.register_converter(nn.GroupNorm)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="expected to_plain to be callable or None"):
        syncbn.register_converter(BatchNormAct2d, None, "no")  # type: ignore[arg-type]
    syncbn.register_converter(BatchNormAct2d, lambda module: nn.Identity())
    with pytest.raises(
        TypeError, match="converter registered for BatchNormAct2d returned a Identity"
    ):
        syncbn.convert_sync_batchnorm(nn.Sequential(BatchNormAct2d(2)))


def _register_act_converter() -> None:
    _register_act_converter.calls += 1  # type: ignore[attr-defined]
    syncbn.register_converter(
        BatchNormAct2d,
        lambda module: _conversion.batchnorm_twin(module, SyncAct),
        lambda layer: _conversion.batchnorm_twin(layer, BatchNormAct2d),
    )


def test_entry_points_offer_converters_for_their_package(monkeypatch: pytest.MonkeyPatch) -> None:
    package = BatchNormAct2d.__module__.partition(".")[0]  # this test module's package
    offered = [
        metadata.EntryPoint("other", f"{__name__}:_missing", _conversion.ENTRY_POINT_GROUP),
        metadata.EntryPoint(
            package, f"{__name__}:_register_act_converter", _conversion.ENTRY_POINT_GROUP
        ),
    ]
    scans = []

    def entry_points() -> list[metadata.EntryPoint]:
        scans.append(_conversion.ENTRY_POINT_GROUP)
        return offered

    # syncbn's reader of its group (metadata.entry_points' signature differs on Python 3.9)
    monkeypatch.setattr(_conversion, "_entry_points", entry_points)
    _register_act_converter.calls = 0  # type: ignore[attr-defined]
    syncbn.convert_sync_batchnorm(nn.Sequential(nn.BatchNorm2d(2)))
    assert scans == []  # plain layers need no converter: nothing is looked up
    model = nn.Sequential(BatchNormAct2d(2), nn.Sequential(BatchNormAct2d(2)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        syncbn.convert_sync_batchnorm(model)
    assert [type(model[0]), type(cast(nn.Sequential, model[1])[0])] == [SyncAct, SyncAct]
    assert scans == [_conversion.ENTRY_POINT_GROUP]  # scanned once, loaded once
    assert _register_act_converter.calls == 1  # type: ignore[attr-defined]


def _register_other_converter() -> None:
    """A third party's entry point for the same package: only counted."""
    _register_other_converter.calls += 1  # type: ignore[attr-defined]


@pytest.mark.parametrize("installed", [False, True])
def test_built_in_converters_load_without_metadata_and_once(
    monkeypatch: pytest.MonkeyPatch, installed: bool
) -> None:
    """syncbn's own converters (timm's) come from its table, not from package metadata.

    ``installed``: syncbn's metadata offers the same converter as an entry point (not loaded
    again), beside a third party's entry point for the same package (loaded)."""
    package = BatchNormAct2d.__module__.partition(".")[0]
    own = f"{__name__}:_register_act_converter"
    other = f"{__name__}:_register_other_converter"
    monkeypatch.setitem(_conversion.BUILT_IN_CONVERTERS, package, own)
    group = _conversion.ENTRY_POINT_GROUP
    offered = (
        [metadata.EntryPoint(package, own, group), metadata.EntryPoint(package, other, group)]
        if installed
        else []
    )
    monkeypatch.setattr(_conversion, "_entry_points", lambda: offered)
    _register_act_converter.calls = 0  # type: ignore[attr-defined]
    _register_other_converter.calls = 0  # type: ignore[attr-defined]
    model = nn.Sequential(BatchNormAct2d(2), nn.Sequential(BatchNormAct2d(2)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        syncbn.convert_sync_batchnorm(model)
        syncbn.revert_sync_batchnorm(model)
        syncbn.convert_sync_batchnorm(model)
    assert [type(model[0]), type(cast(nn.Sequential, model[1])[0])] == [SyncAct, SyncAct]
    assert _register_act_converter.calls == 1  # type: ignore[attr-defined]
    assert _register_other_converter.calls == int(installed)  # type: ignore[attr-defined]


def test_timm_converters_are_built_in_and_offered_as_the_same_entry_point() -> None:
    value = _conversion.BUILT_IN_CONVERTERS["timm"]
    assert value == "syncbn.integrations.timm:register_converters"
    # the module is in the package (found without importing it: it imports timm)
    assert importlib.util.find_spec(value.partition(":")[0]) is not None
    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    section = pyproject.split('[project.entry-points."syncbn.converters"]\n')[1].split("\n[")[0]
    assert f'timm = "{value}"' in section.splitlines()


_WITHOUT_METADATA = """
import importlib.util, os, warnings
from torch import nn
import syncbn
from syncbn import _conversion
from syncbn.data_parallel import SynchronizedBatchNorm1d, SynchronizedBatchNorm2d, convert_model

for value in _conversion.BUILT_IN_CONVERTERS.values():  # their modules are in the tree
    origin = importlib.util.find_spec(value.partition(":")[0]).origin
    assert origin.startswith(os.path.dirname(syncbn.__file__)), origin

class BatchNormAct(nn.BatchNorm2d):  # of package __main__, which the table gets below
    def forward(self, input):
        return super().forward(input).relu()

class SyncBatchNormAct(syncbn.SyncBatchNorm):
    def forward(self, input):
        return super().forward(input).relu()

def register():
    syncbn.register_converter(
        BatchNormAct, lambda m: _conversion.batchnorm_twin(m, SyncBatchNormAct)
    )

_conversion.BUILT_IN_CONVERTERS["__main__"] = "__main__:register"
with warnings.catch_warnings():
    warnings.simplefilter("error")
    model = syncbn.convert_sync_batchnorm(nn.Sequential(BatchNormAct(3), nn.BatchNorm2d(3)))
assert [type(m) for m in model] == [SyncBatchNormAct, syncbn.SyncBatchNorm], model
print("ok")
"""


def test_built_in_converters_load_from_a_source_tree_without_metadata(tmp_path: Path) -> None:
    """syncbn on PYTHONPATH from a copy of src/syncbn, never installed: no entry point
    exists, and the built-in table still loads (timm's own: tests/test_integrations_timm.py)."""
    assert run_without_metadata(_WITHOUT_METADATA, tmp_path).strip() == "ok"


@pytest.mark.parametrize(
    "kwargs", [{"affine": False}, {"affine": False, "track_running_stats": False}]
)
def test_unmaterialised_lazy_batchnorm_without_parameters_is_left_too(
    kwargs: dict[str, bool],
) -> None:
    """Before the fix, a lazy layer with no Parameters passed the lazy check and became a
    SyncBatchNorm with 0 channels, which then refused every input."""
    model = nn.Sequential(nn.LazyBatchNorm2d(**kwargs))
    with pytest.warns(UserWarning, match=r"lazy layer\(s\) '0' \(LazyBatchNorm2d\)"):
        syncbn.convert_sync_batchnorm(model)
    assert isinstance(model[0], nn.LazyBatchNorm2d)
    if kwargs.get("track_running_stats", True):  # lazy buffers: their size comes from an input
        model(torch.randn(2, 4, 3, 3))  # materialises as BatchNorm2d, which then converts
        syncbn.convert_sync_batchnorm(model)
        assert isinstance(model[0], syncbn.SyncBatchNorm) and model[0].num_features == 4


class ConstructedBatchNorm2d(nn.BatchNorm2d):
    """Keeps BatchNorm's forward, but its constructor takes other arguments."""

    def __init__(self, channels: int) -> None:
        super().__init__(channels, eps=1e-3)


def test_a_registered_converter_is_used_for_a_class_with_batchnorm_forward() -> None:
    """Before the fix, such a class skipped its to_sync (converted by the default twin) but
    reverted through its to_plain."""
    calls = []

    def to_sync(module: ConstructedBatchNorm2d) -> syncbn.SyncBatchNorm:
        calls.append("to_sync")
        return _conversion.batchnorm_twin(module, syncbn.SyncBatchNorm)

    def to_plain(layer: syncbn.SyncBatchNorm) -> ConstructedBatchNorm2d:
        calls.append("to_plain")
        plain = ConstructedBatchNorm2d(layer.num_features)
        _conversion.share_state(layer, plain)
        return plain

    syncbn.register_converter(ConstructedBatchNorm2d, to_sync, to_plain)
    model = nn.Sequential(ConstructedBatchNorm2d(3))
    syncbn.convert_sync_batchnorm(model)
    assert type(model[0]) is syncbn.SyncBatchNorm and model[0].eps == 1e-3
    syncbn.revert_sync_batchnorm(model)
    assert type(model[0]) is ConstructedBatchNorm2d and calls == ["to_sync", "to_plain"]


def test_revert_leaves_a_directly_built_subclass_with_its_own_forward() -> None:
    """Before the fix, it became a BatchNorm2d and silently lost its ReLU."""
    model = nn.Sequential(SyncAct(3), syncbn.SyncBatchNorm(3))
    model(torch.randn(2, 3, 2, 2))
    with pytest.warns(UserWarning, match=r"left 1 layer\(s\) synchronized: '0' \(SyncAct\)"):
        syncbn.revert_sync_batchnorm(model)
    assert [type(m) for m in model] == [SyncAct, nn.BatchNorm2d]


def _fx_model() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.ReLU(), nn.BatchNorm2d(4))
    syncbn.convert_sync_batchnorm(model)
    return model


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_torch_fx_traces_a_converted_model_with_the_layers_as_leaves(mode: str) -> None:
    """Before, FX traced into the layers and failed on their shape checks (TraceError), so
    torchvision's create_feature_extractor failed on converted models."""
    model = getattr(_fx_model(), mode)()
    traced = torch.fx.symbolic_trace(copy.deepcopy(model))
    calls = [n.target for n in traced.graph.nodes if n.op == "call_module"]
    assert calls == ["0", "1", "2", "3"]  # one node per layer, as for torch.nn layers
    assert type(traced.get_submodule("1")) is syncbn.SyncBatchNorm
    assert traced.state_dict().keys() == model.state_dict().keys()
    x = torch.randn(2, 3, 4, 4)
    torch.testing.assert_close(traced(x), model(x))  # the mode of run time, not of tracing
    traced.train(mode == "eval")
    model.train(mode == "eval")
    torch.testing.assert_close(traced(x), model(x))
    torch.testing.assert_close(traced.state_dict(), model.state_dict())


def _fx_traced_training(rank: int, world_size: int) -> torch.Tensor:
    traced = torch.fx.symbolic_trace(_fx_model().train())
    traced(torch.full((1 + rank, 3, 2, 2), float(rank)))  # a leaf still synchronizes
    layer = traced.get_submodule("1")
    assert isinstance(layer, syncbn.SyncBatchNorm) and layer.running_mean is not None
    return layer.running_mean.clone()


def test_an_fx_traced_model_still_synchronizes(pool2: WorkerPool) -> None:
    eager = _fx_model().train()
    eager(torch.cat([torch.full((1 + r, 3, 2, 2), float(r)) for r in range(2)]))
    for running_mean in pool2.run(_fx_traced_training):
        torch.testing.assert_close(running_mean, eager[1].running_mean)


def _held_twice() -> nn.Sequential:
    shared = nn.BatchNorm2d(3)
    model = nn.Sequential(nn.Conv2d(3, 3, 1), shared, nn.Sequential(nn.ReLU(), shared))
    return model


def test_a_layer_held_in_several_places_becomes_one_layer_in_all() -> None:
    """A BatchNorm called twice (held in two places) is converted in both, as one layer
    (torch's conversion and the first walk converted only the first place; after ``.to()``
    the two then drifted apart); revert and DataParallel's conversion do the same."""
    model = _held_twice()
    weight = model[1].weight
    syncbn.convert_sync_batchnorm(model)
    inner = cast(nn.Sequential, model[2])
    assert type(model[1]) is syncbn.SyncBatchNorm and inner[1] is model[1]
    assert model[1].weight is weight and model[1].layer_name == "1"  # the first path
    syncbn.revert_sync_batchnorm(model)
    assert type(model[1]) is nn.BatchNorm2d and inner[1] is model[1]
    assert model[1].weight is weight
    model = _held_twice()
    convert_model(model)
    inner = cast(nn.Sequential, model[2])
    assert type(model[1]) is SynchronizedBatchNorm2d and inner[1] is model[1]


def test_a_module_held_in_several_places_is_walked_once() -> None:
    """A shared block's layers keep the name of its first path."""
    block = nn.Sequential(nn.BatchNorm1d(2))
    model = nn.Sequential(block, block)
    syncbn.convert_sync_batchnorm(model)
    assert cast(syncbn.SyncBatchNorm, block[0]).layer_name == "0.0"


class _Positive(nn.Module):
    """A parametrization: the tensor is ``|original| + 0.1``."""

    def forward(self, original: torch.Tensor) -> torch.Tensor:
        return original.abs() + 0.1


def _original(layer: Any, name: str) -> torch.Tensor:
    """The original tensor that ``layer``'s parametrized ``name`` is computed from."""
    return cast(torch.Tensor, getattr(layer.parametrizations, name).original)


def test_parametrizations_are_carried_over_both_ways() -> None:
    """A parametrized weight or bias (``torch.nn.utils.parametrize``) is computed from a
    child module, not a Parameter of the layer: converted layers were left as they were
    (with a warning), and a layer parametrized after its conversion (the order README
    advised) reverted to a BatchNorm whose weight was its constructor's meta tensor."""
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Conv1d(3, 3, 1), nn.BatchNorm1d(3), nn.BatchNorm1d(3))
    torch.nn.utils.parametrize.register_parametrization(reference[1], "weight", _Positive())
    model = copy.deepcopy(reference)
    original = _original(model[1], "weight")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        syncbn.convert_sync_batchnorm(model)
        # parametrized after the conversion
        torch.nn.utils.parametrize.register_parametrization(model[2], "bias", _Positive())
        torch.nn.utils.parametrize.register_parametrization(reference[2], "bias", _Positive())
    for index in (1, 2):
        assert isinstance(model[index], syncbn.SyncBatchNorm)
        assert torch.nn.utils.parametrize.is_parametrized(model[index])
    assert _original(model[1], "weight") is original  # shared, not copied
    assert model.state_dict().keys() == reference.state_dict().keys()
    x = torch.randn(4, 3, 5)
    expected = reference(x)
    torch.testing.assert_close(model(x), expected)
    # masked (all valid): the synchronized maths, whose gradient reaches the original
    masked = model[2](model[1](model[0](x), torch.ones(4, 5, dtype=torch.bool)))
    torch.testing.assert_close(masked, expected)
    originals = (
        _original(reference[1], "weight"),
        _original(reference[2], "bias"),
    )
    expected_grads = torch.autograd.grad(expected.pow(2).sum(), originals)
    grads = torch.autograd.grad(
        masked.pow(2).sum(),
        (original, _original(model[2], "bias")),
    )
    for grad, expected_grad in zip(grads, expected_grads):
        torch.testing.assert_close(grad, expected_grad)
    copied = copy.deepcopy(model)  # a parametrized class refuses __getstate__
    torch.testing.assert_close(copied(x), model(x))
    syncbn.revert_sync_batchnorm(model)
    for index in (1, 2):
        assert type(model[index]).__mro__[1] is nn.BatchNorm1d
        assert torch.nn.utils.parametrize.is_parametrized(model[index])
    assert _original(model[1], "weight") is original
    assert model.state_dict().keys() == reference.state_dict().keys()
    torch.testing.assert_close(model(x), reference(x))


def test_convert_model_carries_parametrizations_over() -> None:
    """The DataParallel API's conversion shares them too."""
    torch.manual_seed(0)
    reference = nn.Sequential(nn.BatchNorm1d(3))
    torch.nn.utils.parametrize.register_parametrization(reference[0], "weight", _Positive())
    model = copy.deepcopy(reference)
    original = _original(model[0], "weight")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        convert_model(model)
    assert type(model[0]).__mro__[1] is SynchronizedBatchNorm1d
    assert _original(model[0], "weight") is original
    x = torch.randn(4, 3)
    torch.testing.assert_close(model(x), reference(x))


def test_a_batchnorm_whose_weight_hooks_compute_is_left_with_a_warning() -> None:
    """The hook-based ``weight_norm`` takes the weight out of the layer's Parameters and
    computes it in a forward pre-hook, which a converted layer would not run."""
    model = nn.Sequential(nn.BatchNorm1d(3), nn.BatchNorm1d(3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch deprecates weight_norm
        torch.nn.utils.weight_norm(model[0])
    before = model.state_dict()
    with pytest.warns(UserWarning, match=r"1 BatchNorm layer\(s\) unconverted: '0' .*hooks"):
        syncbn.convert_sync_batchnorm(model)
    assert type(model[1]) is syncbn.SyncBatchNorm
    assert type(model[0]) is nn.BatchNorm1d  # left as it was
    assert model.state_dict().keys() == before.keys()
    model(torch.randn(4, 3))
    model = nn.Sequential(nn.BatchNorm1d(3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        torch.nn.utils.weight_norm(model[0], "bias")
    with pytest.warns(UserWarning, match=r"convert_model left '0' .*hooks"):
        convert_model(model)
    assert type(model[0]) is nn.BatchNorm1d


def test_a_layer_whose_weight_hooks_compute_is_not_reverted() -> None:
    """The same from the other side: weight_norm on a converted layer (its weight then
    computed by a hook that a plain twin would not run). Reverted, the layer held its
    constructor's meta-device weight and its forward failed."""
    model = nn.Sequential(nn.BatchNorm1d(3), nn.BatchNorm1d(3))
    syncbn.convert_sync_batchnorm(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        torch.nn.utils.weight_norm(model[0])
    x = torch.randn(4, 3)
    expected = model(x)
    with pytest.warns(UserWarning, match=r"left 1 layer\(s\) synchronized: '0' .*hooks"):
        syncbn.revert_sync_batchnorm(model)
    assert isinstance(model[0], syncbn.SyncBatchNorm)  # left as it was
    assert type(model[1]) is nn.BatchNorm1d
    torch.testing.assert_close(model(x), expected)


class CountingBatchNorm1d(nn.BatchNorm1d):
    """A subclass with BatchNorm's forward and buffers of its own."""

    def __init__(self, num_features: int, *args: Any, **kwargs: Any) -> None:
        super().__init__(num_features, *args, **kwargs)
        self.register_buffer("seen", torch.tensor(7, device=kwargs.get("device")))
        self.register_buffer(
            "scratch", torch.zeros(2, device=kwargs.get("device")), persistent=False
        )


def test_buffers_a_subclass_adds_are_kept_both_ways() -> None:
    """Its buffers stay registered (the conversion made them plain attributes: the
    state_dict lost their keys, and revert built new ones)."""
    model = nn.Sequential(CountingBatchNorm1d(3))
    seen, scratch = model[0].seen, model[0].scratch
    keys = model.state_dict().keys()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        syncbn.convert_sync_batchnorm(model)
    assert type(model[0]) is syncbn.SyncBatchNorm
    assert model.state_dict().keys() == keys and model[0].seen is seen
    assert dict(model[0].named_buffers())["scratch"] is scratch  # registered, not persistent
    checkpoint = nn.Sequential(CountingBatchNorm1d(3)).state_dict()
    checkpoint["0.seen"] = torch.tensor(9)
    model.load_state_dict(checkpoint)  # strict: every key, none unexpected
    syncbn.revert_sync_batchnorm(model)
    assert type(model[0]) is CountingBatchNorm1d and model.state_dict().keys() == keys
    assert model[0].seen is seen and int(seen) == 9 and model[0].scratch is scratch


def test_a_non_persistent_running_statistic_stays_out_of_the_state_dict_both_ways() -> None:
    layer = nn.BatchNorm2d(3)
    layer.register_buffer("running_mean", layer.running_mean, persistent=False)
    model = nn.Sequential(layer)
    keys = list(model.state_dict())
    assert "0.running_mean" not in keys
    checkpoint = model.state_dict()
    syncbn.convert_sync_batchnorm(model)
    assert type(model[0]) is syncbn.SyncBatchNorm and list(model.state_dict()) == keys
    model.load_state_dict(checkpoint)  # strict
    syncbn.revert_sync_batchnorm(model)
    assert type(model[0]) is nn.BatchNorm2d and list(model.state_dict()) == keys
    assert model[0].running_mean is layer.running_mean


@pytest.mark.parametrize("entries", [("running_mean", "running_var"), ("weight", "bias")])
def test_entries_set_to_none_stay_none_both_ways(entries: tuple[str, ...]) -> None:
    """A BatchNorm whose running statistics (batch statistics in eval too) or affine
    Parameters the model set to ``None`` converts to a layer without them, which computes
    what it did, and reverts to one without them (the twin kept meta-device placeholders)."""
    torch.manual_seed(0)
    bn = nn.BatchNorm2d(3)
    for name in entries:
        setattr(bn, name, None)
    reference = copy.deepcopy(bn)
    model = nn.Sequential(bn)
    syncbn.convert_sync_batchnorm(model)
    layer = model[0]
    assert type(layer) is syncbn.SyncBatchNorm
    assert all(getattr(layer, name) is None for name in entries)
    assert model.state_dict().keys() == nn.Sequential(reference).state_dict().keys()
    x = torch.randn(4, 3, 5, 5)
    for training in (True, False):
        model.train(training)
        reference.train(training)
        torch.testing.assert_close(model(x), reference(x))
    syncbn.revert_sync_batchnorm(model)
    assert type(model[0]) is nn.BatchNorm2d
    assert all(getattr(model[0], name) is None for name in entries)
    assert all(t.device.type == "cpu" for t in model.state_dict().values())


def test_converting_again_keeps_the_layers_settings() -> None:
    """A converted model converted again (a framework converting what the user converted)
    keeps ``check_layer_order`` unless it is given."""
    model = nn.Sequential(nn.BatchNorm1d(2))
    syncbn.convert_sync_batchnorm(model, check_layer_order=False)
    syncbn.convert_sync_batchnorm(model)
    syncbn.SyncBatchNorm.convert_sync_batchnorm(model)
    assert model[0].check_layer_order is False
    syncbn.convert_sync_batchnorm(model, check_layer_order=True)
    assert model[0].check_layer_order is True
    fresh = nn.Sequential(nn.BatchNorm1d(2))
    syncbn.convert_sync_batchnorm(fresh)
    assert fresh[0].check_layer_order is True


def test_a_subclass_elsewhere_finds_the_converters_of_its_base_class_package(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A user's subclass of a layer whose package offers converters (timm's BatchNormAct2d)
    is converted whether or not a layer of the base class came first."""
    package = BatchNormAct2d.__module__.partition(".")[0]
    group = _conversion.ENTRY_POINT_GROUP
    offered = [metadata.EntryPoint(package, f"{__name__}:_register_act_converter", group)]
    monkeypatch.setattr(_conversion, "_entry_points", lambda: offered)
    _register_act_converter.calls = 0  # type: ignore[attr-defined]
    user_class = type("UserAct", (BatchNormAct2d,), {"__module__": "user_code.layers"})
    model = nn.Sequential(user_class(2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        syncbn.convert_sync_batchnorm(model)
    assert type(model[0]) is SyncAct and _register_act_converter.calls == 1  # type: ignore[attr-defined]


@pytest.mark.skipif(
    "bias" not in inspect.signature(nn.BatchNorm2d.__init__).parameters,
    reason="torch's BatchNorm takes bias=False from torch 2.13",
)
def test_a_batchnorm_without_bias_converts_and_reverts() -> None:
    """torch 2.13's ``bias=False`` (a registered ``None`` bias) is not a computed bias: the
    layer converts (it was left with a wrong warning, and before that kept a meta bias)."""
    model = nn.Sequential(nn.BatchNorm2d(3, bias=False))
    reference = copy.deepcopy(model)
    keys = model.state_dict().keys()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        syncbn.convert_sync_batchnorm(model)
    assert type(model[0]) is syncbn.SyncBatchNorm and model[0].bias is None
    assert model.state_dict().keys() == keys
    x = torch.randn(4, 3, 2, 2)
    torch.testing.assert_close(model(x), reference(x))
    syncbn.revert_sync_batchnorm(model)
    assert type(model[0]) is nn.BatchNorm2d and model[0].bias is None
    assert "bias=False" in repr(model[0])


def test_a_layer_without_bias_resets_on_any_torch() -> None:
    """torch < 2.13's reset_parameters zeroes the bias unconditionally."""
    layer = syncbn.SyncBatchNorm(3, bias=False)
    with torch.no_grad():
        cast(torch.Tensor, layer.weight).fill_(2.0)
    layer.reset_parameters()
    assert layer.bias is None and bool((cast(torch.Tensor, layer.weight) == 1).all())


def test_a_model_built_on_the_meta_device_converts_and_materializes() -> None:
    """Large models are built without storage (``torch.device("meta")``), converted and
    sharded, then materialized with ``to_empty`` and initialized by ``reset_parameters``:
    the converted layers become torch's freshly initialized BatchNorm."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, momentum=0.3), nn.ReLU())
    converted = syncbn.convert_sync_batchnorm(model)
    layer = converted.get_submodule("1")
    assert isinstance(layer, syncbn.SyncBatchNorm)
    assert all(t.is_meta for t in layer.state_dict().values())
    converted.to_empty(device="cpu")
    torch.manual_seed(0)
    for module in converted.modules():
        if isinstance(module, (nn.Conv2d, nn.modules.batchnorm._BatchNorm)):
            module.reset_parameters()
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, momentum=0.3), nn.ReLU())
    torch.testing.assert_close(converted.state_dict(), reference.state_dict(), rtol=0, atol=0)
    x = torch.randn(5, 3, 6, 6)
    torch.testing.assert_close(converted(x), reference(x))
    torch.testing.assert_close(converted.state_dict(), reference.state_dict())


def test_a_process_group_that_is_not_one_is_refused_where_it_is_given() -> None:
    """torch's conversion stores anything as the process group; a number (the size meant
    for syncbn.create_process_group) then failed at the first call on every rank with "does
    not contain this rank", which sent the user after group membership."""
    with pytest.raises(TypeError, match=r"process_group must be a .*ProcessGroup or None, got int"):
        syncbn.convert_sync_batchnorm(nn.BatchNorm2d(3), process_group=8)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"process_group must be .* got str \('oops'\)"):
        syncbn.SyncBatchNorm(3, process_group="oops")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"check_layer_order must be a bool or None, got str"):
        syncbn.convert_sync_batchnorm(nn.BatchNorm1d(3), check_layer_order="yes")  # type: ignore[arg-type]
    # what torch.distributed.new_group gives the ranks outside the group: taken (the layer
    # raises when it would synchronize, tests/test_faults.py)
    outside = torch.distributed.GroupMember.NON_GROUP_MEMBER
    taken = syncbn.SyncBatchNorm(3, process_group=outside)  # type: ignore[arg-type]
    assert taken.process_group == outside
    layer = syncbn.SyncBatchNorm(3)
    layer.process_group = [0, 1]  # type: ignore[assignment]  # set past the constructor
    with pytest.raises(TypeError, match=r"got list \(\[0, 1\]\)"):
        layer(torch.randn(4, 3))


def test_a_deleted_running_statistic_stays_absent_both_ways() -> None:
    """A BatchNorm without ``num_batches_tracked`` (deleted, as a layer of a checkpoint of
    torch < 0.4.1 is rebuilt): its twin kept the constructor's meta-device buffer, and
    state_dict gained a meta tensor that no checkpoint loader takes."""
    layer = nn.BatchNorm2d(3)
    del layer.num_batches_tracked
    model = nn.Sequential(layer)
    keys = list(model.state_dict())
    syncbn.convert_sync_batchnorm(model)
    assert list(model.state_dict()) == keys
    assert "num_batches_tracked" not in model[0]._buffers
    syncbn.revert_sync_batchnorm(model)
    assert type(model[0]) is nn.BatchNorm2d and list(model.state_dict()) == keys
    assert all(t.device.type == "cpu" for t in model.state_dict().values())


@pytest.mark.parametrize(
    "convert",
    [syncbn.convert_sync_batchnorm, syncbn.revert_sync_batchnorm, convert_model],
    ids=["convert", "revert", "convert_model"],
)
def test_a_converted_model_is_freed_when_its_last_reference_goes(convert: Any) -> None:
    """No reference cycle holds the result or the original's modules (a recursive walk's
    closure did: deleted models then lived on until the cyclic collector ran, as GPU memory
    in a hyper-parameter search that builds and drops models; torch's converter frees them
    at once)."""
    original = nn.Sequential(nn.Linear(4, 4), syncbn.SyncBatchNorm(4), nn.BatchNorm1d(4))
    original.add_module("again", original[1])  # a module held twice
    gc.collect()
    gc.disable()
    try:
        converted = convert(original)
        alive = [weakref.ref(module) for module in (*original.modules(), *converted.modules())]
        del original, converted
        assert [ref() for ref in alive if ref() is not None] == []
    finally:
        gc.enable()
