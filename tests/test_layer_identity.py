"""Layers built directly (no module path) are told apart by the layer-order check.

A directly built ``SyncBatchNorm`` is identified by its construction order in the process
(``"#k"``): the same on every rank that runs the same model code, different for every
layer. These tests cover the out-of-order calls that used to pass silently, and the
usual ways of building, copying and restoring models that must not raise.
"""

from __future__ import annotations

import copy
import pickle
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.utils.checkpoint
from _harness import WorkerPool, outcome
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import syncbn
from syncbn import _compiled


class _TwoDirectLayers(nn.Module):
    """Two directly built SyncBatchNorm layers with the same channel count."""

    def __init__(self) -> None:
        super().__init__()
        self.first = syncbn.SyncBatchNorm(3)
        self.second = syncbn.SyncBatchNorm(3)
        self.linear = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor, swap: bool = False) -> torch.Tensor:
        a, b = (self.second, self.first) if swap else (self.first, self.second)
        return b(self.linear(a(x)))


def _out_of_order(rank: int, world_size: int, phase: str) -> dict[str, Any]:
    model = _TwoDirectLayers()
    identities = [model.first.layer_identity, model.second.layer_identity]
    x = torch.randn(4, 3, requires_grad=True)
    assert outcome(lambda: model(x).sum().backward()) == ("ok", "")  # in order: fine
    if phase == "forward":
        return {"outcome": outcome(lambda: model(x, swap=rank % 2 == 1)), "ids": identities}
    # forward in order, but backward reaches the layers in a different order per rank
    first, second = model.first(x), model.second(x)
    if rank % 2:
        first, second = second, first
    loss = first.sum() * 1e-3 + second.sum().detach()
    return {"outcome": outcome(lambda: loss.backward()), "ids": identities}


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_directly_built_layers_called_out_of_order_raise_naming_both(
    pool: WorkerPool, phase: str
) -> None:
    results = pool.run(_out_of_order, phase)
    first, second = results[0]["ids"]
    assert first != second and first.startswith("#") and second.startswith("#")
    for rank, result in enumerate(results):
        assert result["ids"] == [first, second]  # the same identities on every rank
        kind, message = result["outcome"]
        assert kind == "RuntimeError", message
        assert f"SyncBatchNorm layer mismatch in {phase}" in message
        own, other = (first, second) if rank % 2 == 0 else (second, first)
        assert f"this rank is at SyncBatchNorm layer '{own}' (num_features=3" in message
        if pool.world_size == 2:  # all other ranks agree: the message names their layer too
            assert f"other ranks of the process group are at SyncBatchNorm layer '{other}'" in (
                message
            )


# --- no false positives ------------------------------------------------------------------------


def _train(model: nn.Module, steps: int = 2, **kwargs: Any) -> None:
    for step in range(steps):
        x = torch.randn(3 + step, 3, requires_grad=True)
        model(x, **kwargs).sum().backward()


def _train_each(*models: nn.Module) -> None:
    for model in models:
        _train(model)


class _Checkpointed(_TwoDirectLayers):
    def forward(self, x: torch.Tensor, swap: bool = False) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(super().forward, x, use_reentrant=False)


class _UnusedBranch(_TwoDirectLayers):
    def __init__(self) -> None:
        super().__init__()
        self.unused = syncbn.SyncBatchNorm(3)

    def forward(self, x: torch.Tensor, swap: bool = False) -> torch.Tensor:
        return super().forward(x) if x.shape[0] != 1000 else self.unused(x)


def _usual_workflows(rank: int, world_size: int, workflow: str) -> tuple[str, str]:
    if workflow == "same-model":
        model: nn.Module = _TwoDirectLayers()
        return outcome(lambda: _train(model))
    if workflow == "ddp-find-unused":
        ddp = DistributedDataParallel(_UnusedBranch(), find_unused_parameters=True)
        return outcome(lambda: _train(ddp))
    if workflow == "checkpointing":
        return outcome(lambda: _train(_Checkpointed()))
    if workflow == "after-deleting-layers":
        old = _TwoDirectLayers()
        _train(old)
        del old
        return outcome(lambda: _train(_TwoDirectLayers()))
    if workflow == "deepcopy":
        original = _TwoDirectLayers()
        copied = copy.deepcopy(original)
        return outcome(lambda: _train_each(copied, original))
    if workflow == "load-state-dict":
        trained = _TwoDirectLayers()
        _train(trained)
        restored = _TwoDirectLayers()
        restored.load_state_dict(trained.state_dict())
        return outcome(lambda: _train(restored))
    raise ValueError(workflow)


@pytest.mark.parametrize(
    "workflow",
    [
        "same-model",
        "ddp-find-unused",
        "checkpointing",
        "after-deleting-layers",
        "deepcopy",
        "load-state-dict",
    ],
)
def test_usual_workflows_pass_the_order_check(pool2: WorkerPool, workflow: str) -> None:
    assert pool2.run(_usual_workflows, workflow) == [("ok", "")] * 2


def test_identity_is_construction_order_and_survives_copies() -> None:
    first, second = syncbn.SyncBatchNorm(3), syncbn.SyncBatchNorm(3)
    index = int(first.layer_identity[1:])
    assert second.layer_identity == f"#{index + 1}"
    assert copy.deepcopy(first).layer_identity == first.layer_identity
    named: Any = syncbn.convert_sync_batchnorm(nn.Sequential(nn.BatchNorm1d(3)))
    assert named[0].layer_identity == "0"  # converted layers are named by their module path


def test_layers_pickled_by_version_0_1_load() -> None:
    layer = syncbn.SyncBatchNorm(3)
    state = dict(vars(layer))
    # 0.1 kept layer_name as a plain attribute and had no check_mode, construction index or
    # record of the class a converted layer replaced
    state["layer_name"] = state.pop("_layer_name")
    for key in ("_check_mode", "_construction_index", "_sync_alone", "_original_class"):
        del state[key]
    state["layer_name"] = "block.bn"
    state["_site_key"] = state.pop("_site").__dict__["_syncbn_site_key"]  # an integer then
    old = syncbn.SyncBatchNorm.__new__(syncbn.SyncBatchNorm)
    old.__setstate__(state)
    assert old.layer_name == "block.bn" and old.layer_identity == "block.bn"
    assert old.check_mode == "auto" and old._site is not layer._site
    assert type(syncbn.revert_sync_batchnorm(old)) is syncbn.BatchNormNd
    torch.testing.assert_close(old(torch.randn(4, 3)).mean(0), torch.zeros(3), atol=1e-6, rtol=0)


def test_layers_pickled_with_check_mode_as_a_plain_attribute_load() -> None:
    state = dict(vars(syncbn.SyncBatchNorm(3)))
    state["check_mode"] = state.pop("_check_mode")  # before check_mode was validated
    state["check_mode"] = "deferred"
    old = syncbn.SyncBatchNorm.__new__(syncbn.SyncBatchNorm)
    old.__setstate__(state)
    assert old.check_mode == "deferred" and "check_mode" not in vars(old)


def _deepcopy_with_group(rank: int, world_size: int) -> dict[str, Any]:
    group = dist.new_group(list(range(world_size)))
    model = nn.Sequential(nn.BatchNorm1d(3))
    syncbn.convert_sync_batchnorm(model, group)
    copied = copy.deepcopy(model)  # torch.nn.SyncBatchNorm raises: a group cannot be pickled
    layer = copied[0]
    assert isinstance(layer, syncbn.SyncBatchNorm)
    x = torch.full((2, 3), float(rank))  # global mean 0.5, local means 0 and 1
    copied(x)
    assert layer.running_mean is not None
    return {"shared": layer.process_group is group, "mean": layer.running_mean.clone()}


def test_a_deep_copy_shares_the_process_group(pool2: WorkerPool) -> None:
    for result in pool2.run(_deepcopy_with_group):
        assert result["shared"]
        torch.testing.assert_close(result["mean"], torch.full((3,), 0.05))  # momentum 0.1


def test_each_layer_copy_and_move_has_its_own_site_tensor_on_its_device() -> None:
    """The compiled ops find their layer from its site tensor (``syncbn._compiled``): a
    copy needs its own, and a move (also of a layer without per-channel tensors, which
    torch.nn would not move) one on the new device."""
    layer = syncbn.SyncBatchNorm(3)
    bare = syncbn.SyncBatchNorm(3, affine=False, track_running_stats=False)
    copies = [copy.deepcopy(layer), pickle.loads(pickle.dumps(layer)), copy.deepcopy(bare)]
    sites = [layer._site, bare._site] + [copied._site for copied in copies]
    assert len({id(site) for site in sites}) == len(sites)
    assert len({int(site) for site in sites}) == len(sites)  # each names its own layer
    for module in (layer, bare):
        module.to("meta")
        assert module._site.device.type == "meta"
    state = syncbn.SyncBatchNorm(3).state_dict()
    layer.load_state_dict(state, assign=True)
    assert layer._site.device.type == "cpu"
    # a move keeps the layer's key: the registry does not grow with each move (it did, by
    # one entry per move for the layer's life: a model offloaded at every step)
    key, registered = int(layer._site), len(_compiled._sites)
    for _ in range(10):
        layer.to("meta")
        layer.to_empty(device="cpu")
    assert int(layer._site) == key and len(_compiled._sites) == registered
    assert _compiled._site(layer._site) is layer


def test_the_layers_known_by_fingerprint_are_the_latest_few(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The registry that names another rank's layer in a mismatch error keeps the layers
    registered last: every layer built had added its description for good (~0.7 KB each,
    a review: 60-90 MB over a hyper-parameter search of 1000 models of 100 layers)."""
    from syncbn import _protocol

    monkeypatch.setattr(_protocol, "_MAX_DESCRIBED", 8)
    layers = [syncbn.SyncBatchNorm(5) for _ in range(20)]
    assert len(_protocol._described) == 8
    first, last = (layer.next_train_options() for layer in (layers[0], layers[-1]))
    assert f"{layers[0].layer_identity!r} (num_features=5)" not in (
        _protocol._layers_with_fingerprint(first.fingerprint)
    )
    named = f"{layers[-1].layer_identity!r} (num_features=5)"
    assert named in _protocol._layers_with_fingerprint(last.fingerprint)
    backward = _protocol.backward_fingerprint(last.fingerprint)
    assert f"{named} in backward" in _protocol._layers_with_fingerprint(backward)
