"""syncbn.integrations.timm: SyncBatchNormAct2d, its converters, and timm models on 2 ranks.

Needs timm (``pip install -e ".[ecosystem]"``; ``.ci/ecosystem`` runs these tests); skipped
where timm is not installed. The gold test runs five timm models on the shared pool of 2 gloo
ranks with uneven local batches and compares them with the same model in one process on the
concatenated batch.
"""

from __future__ import annotations

import copy
import functools
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.fx
from _harness import WorkerPool
from _source_tree import run_without_metadata
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

timm = pytest.importorskip("timm", reason="timm is an optional dependency (syncbn[timm])")

import syncbn  # noqa: E402
from syncbn._conversion import converter_for  # noqa: E402
from syncbn.integrations.timm import SyncBatchNormAct2d, register_converters  # noqa: E402

BatchNormAct2d = timm.layers.BatchNormAct2d
SyncBatchNormAct = timm.layers.SyncBatchNormAct

#: the models of issue 14, and their number of BatchNorm layers in timm 1.0.29
MODELS = {
    "efficientnet_b0": 49,
    "mobilenetv3_large_100": 46,
    "regnety_016": 86,
    "cspdarknet53": 67,
    "resnet50d": 55,
}
SIZES = (3, 1)  # local batch sizes of the 2 ranks: uneven
IMAGE = 32  # the smallest input all five take (their last stage sees 1x1)
CLASSES = 5


def _create(name: str) -> nn.Module:
    torch.manual_seed(0)
    return timm.create_model(name, pretrained=False, num_classes=CLASSES)


def _classes(model: nn.Module) -> dict[str, type[nn.Module]]:
    return {path: type(module) for path, module in model.named_modules()}


def _convert_quietly(model: nn.Module) -> nn.Module:
    """Convert, failing on any warning (an unconverted layer warns)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return syncbn.convert_sync_batchnorm(model)


# ---------------------------------------------------------------- the layer, in one process


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"act_layer": "silu", "inplace": False},
        {"act_layer": nn.Hardswish, "momentum": None},
        {"apply_act": False, "affine": False},
        {"drop_layer": functools.partial(nn.Dropout, p=0.5), "act_layer": "gelu"},
        {
            "track_running_stats": False,
            "act_kwargs": {"negative_slope": 0.2},
            "act_layer": "leaky_relu",
        },
    ],
    ids=["relu", "silu", "hardswish-cma", "no-act", "dropout-gelu", "no-stats-leaky"],
)
def test_layer_computes_what_batchnorm_act_computes(options: dict[str, Any]) -> None:
    """Without a process group SyncBatchNormAct2d is BatchNormAct2d, in train and eval mode."""
    torch.manual_seed(0)
    reference = BatchNormAct2d(4, **options).double()
    layer = SyncBatchNormAct2d(4, **options).double()
    assert type(layer.act) is type(reference.act) and type(layer.drop) is type(reference.drop)
    assert layer.state_dict().keys() == reference.state_dict().keys()
    if reference.affine:
        with torch.no_grad():
            reference.weight.uniform_(0.5, 1.5)
            reference.bias.normal_()
    layer.load_state_dict(reference.state_dict())
    x = torch.randn(3, 4, 5, 5, dtype=torch.float64) * 2 + 1
    for mode in ("train", "train", "eval"):
        reference.train(mode == "train")
        layer.train(mode == "train")
        x_ref, x_sync = x.clone().requires_grad_(), x.clone().requires_grad_()
        torch.manual_seed(1)
        y_ref = reference(x_ref)
        torch.manual_seed(1)
        y_sync = layer(x_sync)
        torch.testing.assert_close(y_sync, y_ref)
        dy = torch.randn_like(y_ref)
        y_ref.backward(dy)
        y_sync.backward(dy)
        torch.testing.assert_close(x_sync.grad, x_ref.grad)
    for (name, ours), theirs in zip(layer.state_dict().items(), reference.state_dict().values()):
        torch.testing.assert_close(ours, theirs, msg=name)
    for (name, ours), theirs in zip(layer.named_parameters(), reference.parameters()):
        torch.testing.assert_close(ours.grad, theirs.grad, msg=name)


def test_layer_accepts_only_4d_input() -> None:
    layer = SyncBatchNormAct2d(3)
    with pytest.raises(ValueError, match=r"expected 4D input \(got 3D input\)"):
        layer(torch.randn(2, 3, 4))
    assert isinstance(layer, syncbn.SyncBatchNorm)


def test_register_converters_is_idempotent() -> None:
    register_converters()
    first = converter_for(BatchNormAct2d), converter_for(SyncBatchNormAct)
    register_converters()
    assert (converter_for(BatchNormAct2d), converter_for(SyncBatchNormAct)) == first
    assert all(c is not None and c.to_sync and c.to_plain for c in first)


def test_convert_and_revert_keep_act_and_drop_modules() -> None:
    model = nn.Sequential(
        nn.Conv2d(3, 4, 1),
        BatchNormAct2d(4, act_layer="silu", drop_layer=nn.Dropout),
        nn.Conv2d(4, 4, 1),
        nn.BatchNorm2d(4),
    )
    act, drop = model[1].act, model[1].drop
    params = {name: p for name, p in model.named_parameters()}
    buffers = {name: b for name, b in model.named_buffers()}
    keys = model.state_dict().keys()
    _convert_quietly(model)
    assert type(model[1]) is SyncBatchNormAct2d and type(model[3]) is syncbn.SyncBatchNorm
    assert model[1].act is act and model[1].drop is drop and model[1].layer_name == "1"
    assert model.state_dict().keys() == keys
    assert all(p is params[name] for name, p in model.named_parameters())
    assert all(b is buffers[name] for name, b in model.named_buffers())
    syncbn.revert_sync_batchnorm(model)  # never ran: the classes come from the conversion
    assert [type(m) for m in model] == [nn.Conv2d, BatchNormAct2d, nn.Conv2d, nn.BatchNorm2d]
    assert model[1].act is act and model[1].drop is drop
    assert all(p is params[name] for name, p in model.named_parameters())
    assert all(b is buffers[name] for name, b in model.named_buffers())


def test_timm_sync_batchnorm_act_converts_and_reverts_to_itself() -> None:
    """What timm's own convert_sync_batchnorm made (torch.nn.SyncBatchNorm: no CPU training).
    Its children, ``act`` before ``drop``, keep that order both ways: the constructors make
    ``drop`` first, and a round trip swapped them in the module tree (a review,
    2026-12-08)."""
    layer = BatchNormAct2d(4, act_layer="silu", drop_layer=nn.Dropout)
    model = timm.layers.convert_sync_batchnorm(nn.Sequential(layer))
    act = model[0].act
    assert type(model[0]) is SyncBatchNormAct
    order = list(model[0]._modules)
    assert order == ["act", "drop"], order  # timm's conversion's order (the premise)
    _convert_quietly(model)
    assert type(model[0]) is SyncBatchNormAct2d and model[0].act is act
    assert list(model[0]._modules) == order
    model(torch.randn(2, 4, 3, 3))  # trains on CPU
    syncbn.revert_sync_batchnorm(model)
    assert type(model[0]) is SyncBatchNormAct and model[0].act is act
    assert list(model[0]._modules) == order
    plain = nn.Sequential(BatchNormAct2d(4, act_layer="silu", drop_layer=nn.Dropout))
    syncbn.revert_sync_batchnorm(_convert_quietly(plain))
    assert list(plain[0]._modules) == ["drop", "act"]  # BatchNormAct2d's own order


class UserBatchNormAct2d(BatchNormAct2d):  # type: ignore[misc,valid-type]
    """A user's subclass of timm's layer that keeps its forward (and so its converter)."""


class UserSyncBatchNormAct(SyncBatchNormAct):  # type: ignore[misc,valid-type]
    """The same for timm's own synchronized layer."""


def test_subclasses_of_timm_layers_revert_to_themselves() -> None:
    """Revert gave back timm's base class, not the subclass the layer was converted from."""
    model = nn.Sequential(
        UserBatchNormAct2d(4, act_layer="silu"), UserSyncBatchNormAct(4), BatchNormAct2d(4)
    )
    act = model[0].act
    _convert_quietly(model)
    assert [type(m) for m in model] == [SyncBatchNormAct2d] * 3
    syncbn.revert_sync_batchnorm(model)
    assert [type(m) for m in model] == [UserBatchNormAct2d, UserSyncBatchNormAct, BatchNormAct2d]
    assert model[0].act is act


_FRESH_INTERPRETER = textwrap.dedent(
    """
    import sys, warnings
    from importlib import metadata
    import torch
    from torch import nn
    import syncbn
    from syncbn import _conversion
    syncbn.convert_sync_batchnorm(nn.Sequential(nn.BatchNorm2d(3)))
    assert "timm" not in sys.modules, "import syncbn or a conversion imported timm"
    import syncbn.integrations.timm as integration
    from timm.layers import BatchNormAct2d
    assert BatchNormAct2d not in _conversion._CONVERTERS, "importing the integration registered"
    # installed: syncbn's metadata offers the same converters as an entry point
    offered = {e.name: e.value for e in metadata.entry_points(group="syncbn.converters")}
    assert offered["timm"] == _conversion.BUILT_IN_CONVERTERS["timm"], offered
    calls = []
    register = integration.register_converters
    integration.register_converters = lambda: calls.append(1) or register()
    # a layer built directly reverts through the converter, loaded by syncbn itself
    layer = integration.SyncBatchNormAct2d(3, act_layer="silu")
    act = layer.act
    reverted = syncbn.revert_sync_batchnorm(layer)
    assert type(reverted) is BatchNormAct2d and reverted.act is act, reverted
    assert BatchNormAct2d in _conversion._CONVERTERS, "revert did not load the converters"
    # and the walk finds them
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        converted = syncbn.convert_sync_batchnorm(nn.Sequential(BatchNormAct2d(3)))
    assert type(converted[0]) is integration.SyncBatchNormAct2d, converted
    assert calls == [1], "registered more than once (built in and entry point)"
    print("ok")
    """
)


def test_loaded_once_by_syncbn_itself_and_import_has_no_side_effects() -> None:
    """In a fresh interpreter: nothing registers on import; the walk and revert load the
    converters once, although the installed entry point offers them too."""
    result = subprocess.run(
        [sys.executable, "-c", _FRESH_INTERPRETER],
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


_WITHOUT_METADATA = """
import warnings
import timm
import syncbn
from syncbn.integrations.timm import SyncBatchNormAct2d

model = timm.create_model("efficientnet_b0", pretrained=False, num_classes=5)
before = {path: type(module) for path, module in model.named_modules()}
acts = sum(type(m) is timm.layers.BatchNormAct2d for m in model.modules())
with warnings.catch_warnings():
    warnings.simplefilter("error")  # an unconverted layer warns
    syncbn.convert_sync_batchnorm(model)
synchronized = sum(type(m) is SyncBatchNormAct2d for m in model.modules())
assert synchronized == acts == 49, (synchronized, acts)
syncbn.revert_sync_batchnorm(model)
assert {path: type(module) for path, module in model.named_modules()} == before
print("ok")
"""


def test_timm_converts_with_syncbn_from_a_source_tree_without_metadata(tmp_path: Path) -> None:
    """syncbn on PYTHONPATH from a copy of src/syncbn, never installed (vendored, a monorepo):
    no entry point exists, and all 49 BatchNormAct2d of efficientnet_b0 still convert.
    Before syncbn loaded its own converters, they stayed plain (with a warning)."""
    assert run_without_metadata(_WITHOUT_METADATA, tmp_path, timeout=180).strip() == "ok"


@pytest.mark.parametrize("name", list(MODELS))
def test_revert_restores_every_class_of_an_unrun_model(name: str) -> None:
    model = _create(name)
    before = _classes(model)
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    keys = model.state_dict().keys()
    _convert_quietly(model)
    norms = [m for m in model.modules() if isinstance(m, _BatchNorm)]
    assert len(norms) == MODELS[name]
    assert all(isinstance(m, syncbn.SyncBatchNorm) for m in norms)
    assert model.state_dict().keys() == keys
    syncbn.revert_sync_batchnorm(model)
    assert _classes(model) == before
    assert model.state_dict().keys() == keys
    after = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    assert after.keys() == tensors.keys()
    assert all(after[path] is tensor for path, tensor in tensors.items())


# ---------------------------------------------------------------- gold: 2 ranks vs 1 process


def _gold_rank(rank: int, world_size: int, name: str) -> dict[str, Any]:
    """One training step of ``name`` converted, on this rank's slice, checked against the
    single-process model on the global batch (computed on every rank: nothing big travels)."""
    reference = _create(name).double()
    model = copy.deepcopy(reference)
    classes = _classes(model)
    norm_layers = sum(isinstance(m, _BatchNorm) for m in model.modules())
    _convert_quietly(model)
    synchronized = sum(isinstance(m, syncbn.SyncBatchNorm) for m in model.modules())
    assert model.state_dict().keys() == reference.state_dict().keys()

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(sum(SIZES), 3, IMAGE, IMAGE, generator=gen, dtype=torch.float64)
    dy = torch.randn(sum(SIZES), CLASSES, generator=gen, dtype=torch.float64)
    start = sum(SIZES[:rank])
    local = slice(start, start + SIZES[rank])

    x_ref = x.clone().requires_grad_()
    y_ref = reference(x_ref)
    y_ref.backward(dy)
    x_local = x[local].clone().requires_grad_()
    y = model(x_local)
    y.backward(dy[local])
    grads = [param.grad for param in model.parameters() if param.grad is not None]
    assert len(grads) == len(list(model.parameters()))
    flat = torch.cat([grad.flatten() for grad in grads])
    dist.all_reduce(flat)  # what DDP does to gradients, as a sum (DDP averages)
    for grad, summed in zip(grads, flat.split([grad.numel() for grad in grads])):
        grad.copy_(summed.view_as(grad))

    torch.testing.assert_close(y, y_ref[local])
    assert x_ref.grad is not None
    torch.testing.assert_close(x_local.grad, x_ref.grad[local])
    reference_params = dict(reference.named_parameters())
    for path, param in model.named_parameters():
        torch.testing.assert_close(param.grad, reference_params[path].grad, msg=path)
    reference_state = reference.state_dict()
    for path, value in model.state_dict().items():  # running stats and num_batches_tracked
        torch.testing.assert_close(value, reference_state[path], msg=path)
    model.eval()
    reference.eval()
    torch.testing.assert_close(model(x[local]), reference(x[local]))

    syncbn.revert_sync_batchnorm(model)
    assert _classes(model) == classes
    reverted = model.state_dict()
    assert reverted.keys() == reference_state.keys()
    for path, value in reference_state.items():
        torch.testing.assert_close(reverted[path], value, msg=path)
    return {"norm layers": norm_layers, "synchronized": synchronized}


@pytest.mark.parametrize("name", list(MODELS))
def test_gold_timm_models_on_two_uneven_ranks(pool2: WorkerPool, name: str) -> None:
    counts = pool2.run(_gold_rank, name, timeout=90)
    assert counts[0] == counts[1] == {"norm layers": MODELS[name], "synchronized": MODELS[name]}
    print(f"{name} | {counts[0]['norm layers']} | {counts[0]['synchronized']}")


def test_torch_fx_and_feature_extraction_keep_the_layers_as_leaves() -> None:
    """torchvision's create_feature_extractor traces with torch.fx; it failed on converted
    models while FX traced into the layers."""
    feature_extraction = pytest.importorskip("torchvision.models.feature_extraction")
    model = timm.create_model("mobilenetv3_small_050", pretrained=False).eval()
    syncbn.convert_sync_batchnorm(model)
    extractor = feature_extraction.create_feature_extractor(model, {"blocks.1": "features"})
    x = torch.randn(2, 3, 32, 32)
    expected = model.blocks[1](model.blocks[0](model.bn1(model.conv_stem(x))))
    torch.testing.assert_close(extractor(x)["features"], expected)
    layer = nn.Sequential(SyncBatchNormAct2d(3, act_layer="silu")).eval()
    traced = torch.fx.symbolic_trace(layer)
    assert [n.target for n in traced.graph.nodes if n.op == "call_module"] == ["0"]
    y = torch.randn(2, 3, 4, 4)
    torch.testing.assert_close(traced(y), layer(y))
