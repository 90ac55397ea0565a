"""recompute_statistics: exact population statistics over all batches on all ranks."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _harness import WorkerPool, outcome
from torch import nn

import syncbn


def _model(sync: bool) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.BatchNorm2d(4, momentum=0.3),
        nn.ReLU(),
        nn.Conv2d(4, 5, 3),
        nn.BatchNorm2d(5, momentum=None),
        nn.Dropout(0.5),
    ).double()
    if sync:
        model[1] = syncbn.convert_sync_batchnorm(model[1])  # one SyncBatchNorm, one plain
    return model


def _batches(rank: int) -> list[torch.Tensor]:
    """Rank r passes r + 2 batches of different sizes, one of them empty; offset data."""
    gen = torch.Generator().manual_seed(10 + rank)
    sizes = [3, 0, 2, 5, 1][: rank + 2]
    return [torch.randn(n, 3, 6, 6, generator=gen, dtype=torch.float64) * 2 + 5 for n in sizes]


def _recompute(rank: int, world_size: int) -> dict[str, Any]:
    model = _model(sync=True).eval()
    model[4].train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    syncbn.recompute_statistics(model, iter(_batches(rank)))
    return {
        "state": {k: v.clone() for k, v in model.state_dict().items()},
        "before": before,
        "modes": [m.training for m in model],
        "momenta": [model[1].momentum, model[4].momentum],
        "forward_restored": "forward" not in vars(model[1]) and "forward" not in vars(model[4]),
    }


def _reference(world_size: int) -> dict[str, torch.Tensor]:
    """Inputs of each BN layer over every batch of every rank, each batch normalized by its own
    statistics (BatchNorm in training mode), pooled: population mean, unbiased variance."""
    model = _model(sync=False).train()
    model[5].eval()  # dropout as in the ranks' model (eval there)
    return _population(model, [b for rank in range(world_size) for b in _batches(rank)])


def test_recompute_statistics_is_the_population_over_all_ranks(pool: WorkerPool) -> None:
    results = pool.run(_recompute)
    expected = _reference(pool.world_size)
    for result in results:
        for key, value in expected.items():
            torch.testing.assert_close(result["state"][key], value, rtol=1e-10, atol=1e-12)
        for key in ("1.num_batches_tracked", "4.num_batches_tracked"):
            assert torch.equal(result["state"][key], result["before"][key])
        assert result["modes"] == [False, False, False, False, True, False]
        assert result["momenta"] == [0.3, None]
        assert result["forward_restored"]
    for result in results[1:]:  # plain BatchNorm too: identical on every rank
        for key, value in results[0]["state"].items():
            assert torch.equal(result["state"][key], value), key


def test_recompute_statistics_without_process_group() -> None:
    model = nn.Sequential(nn.BatchNorm2d(3, dtype=torch.float64))
    batches = _batches(0) + _batches(1)
    syncbn.recompute_statistics(model, batches, num_batches=3)
    var, mean = torch.var_mean(torch.cat(batches[:3]), dim=(0, 2, 3), correction=1)
    torch.testing.assert_close(model[0].running_mean, mean, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(model[0].running_var, var, rtol=1e-12, atol=1e-12)


def test_an_unmaterialised_lazy_layer_is_a_clear_error() -> None:
    model = nn.Sequential(nn.Conv2d(3, 3, 1), nn.LazyBatchNorm2d())
    with pytest.raises(ValueError, match=r"lazy layer\(s\) \['1'\] are not materialised"):
        syncbn.recompute_statistics(model, [torch.randn(2, 3, 4, 4)])
    model(torch.randn(2, 3, 4, 4))  # materialised: a BatchNorm2d now
    syncbn.recompute_statistics(model, [torch.randn(2, 3, 4, 4)])


class _OneBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used, self.unused = nn.BatchNorm1d(2), nn.BatchNorm1d(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def test_layers_that_saw_too_little_keep_their_statistics() -> None:
    model = _OneBranch()
    kept = r"kept the running statistics of BatchNorm1d layer 'unused' \(2 channels\).*saw 0"
    with pytest.warns(UserWarning, match=kept):
        syncbn.recompute_statistics(model, [torch.randn(3, 2), torch.randn(4, 2)])
    assert model.unused.running_var is not None and model.used.running_var is not None
    assert torch.equal(model.unused.running_var, torch.ones(2))
    assert not torch.equal(model.used.running_var, torch.ones(2))
    with pytest.raises(ValueError, match="num_batches must be non-negative"):
        syncbn.recompute_statistics(model, [], num_batches=-1)


def test_batches_of_one_sample_and_an_untracked_layer() -> None:
    """A batch of one sample (or none) adds to a tracked layer's moments; a layer that
    tracks no running statistics normalizes each batch with its own, as in training and
    eval, and refuses one value per channel with torch's error (README says so)."""
    batches = [torch.randn(4, 3), torch.randn(1, 3), torch.randn(0, 3)]
    tracked = nn.BatchNorm1d(3)
    syncbn.recompute_statistics(nn.Sequential(tracked), batches)
    data = torch.cat(batches)
    assert tracked.running_mean is not None and tracked.running_var is not None
    torch.testing.assert_close(tracked.running_mean, data.mean(0))
    torch.testing.assert_close(tracked.running_var, data.var(0))
    untracked = nn.Sequential(nn.BatchNorm1d(3), nn.BatchNorm1d(3, track_running_stats=False))
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        syncbn.recompute_statistics(untracked, batches)


class _BatchNormReLU(nn.BatchNorm2d):
    """Like timm's BatchNormAct2d: a BatchNorm subclass whose forward adds an activation."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return torch.relu(super().forward(input))


class _SyncBatchNormReLU(syncbn.SyncBatchNorm):
    """The same on top of SyncBatchNorm (like syncbn.integrations.timm.SyncBatchNormAct2d)."""

    def forward(self, input: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return torch.relu(super().forward(input, mask))


def _layers_model(untracked: bool) -> nn.Sequential:
    torch.manual_seed(1)
    first: nn.Module = _BatchNormReLU(3)
    if untracked:  # a layer without running statistics: normalizes each batch, never syncs
        first = syncbn.SyncBatchNorm(3, track_running_stats=False)
    return nn.Sequential(
        first, nn.Conv2d(3, 3, 1), _SyncBatchNormReLU(3), nn.BatchNorm2d(3, momentum=None)
    ).double()


def _population(model: nn.Sequential, batches: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """What precise BN must give: each tracked layer's inputs over all batches, each batch run
    through ``model`` as it is (training mode: plain BatchNorm semantics, no process group)."""
    inputs: dict[int, list[torch.Tensor]] = {}
    for index, layer in enumerate(model):
        if isinstance(layer, nn.modules.batchnorm._BatchNorm) and layer.track_running_stats:
            inputs[index] = []
            layer.register_forward_pre_hook(
                lambda module, args, index=index: inputs[index].append(args[0])
            )
    with torch.no_grad():
        for batch in batches:
            if len(batch):  # BatchNorm in training mode cannot run an empty batch
                model(batch)
    stats = {}
    for index, seen in inputs.items():
        var, mean = torch.var_mean(torch.cat(seen), dim=(0, 2, 3), correction=1)
        stats[f"{index}.running_mean"], stats[f"{index}.running_var"] = mean, var
    return stats


def _offset_batches(rank: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(20 + rank)
    sizes = [2, 1, 3][: rank + 2]  # rank r passes r + 2 batches
    return [torch.randn(n, 3, 4, 4, generator=gen, dtype=torch.float64) + 3 for n in sizes]


def test_subclasses_with_their_own_forward_keep_it() -> None:
    """Before the fix, precise BN replaced every layer's forward: the ReLU of the first two
    layers was lost, and every later layer recorded the moments of the wrong inputs."""
    batches = _offset_batches(0) + _offset_batches(1)
    model = _layers_model(untracked=False).eval()
    syncbn.recompute_statistics(model, batches)
    expected = _population(_layers_model(untracked=False).train(), batches)
    assert expected.keys() == {f"{i}.running_{s}" for i in (0, 2, 3) for s in ("mean", "var")}
    for key, value in expected.items():
        torch.testing.assert_close(model.state_dict()[key], value, rtol=1e-10, atol=1e-12)
    assert not model.training and not any(m.training for m in model)


def _untracked_sync_layer(rank: int, world_size: int) -> dict[str, torch.Tensor]:
    model = _layers_model(untracked=True).train()
    syncbn.recompute_statistics(model, _offset_batches(rank))
    assert all(m.training for m in model)  # the model's mode is restored
    return model.state_dict()


def test_a_layer_without_running_statistics_does_not_communicate(pool2: WorkerPool) -> None:
    """Before the fix, a SyncBatchNorm with track_running_stats=False synchronized every batch,
    so ranks passing different numbers of batches crashed in a mismatched collective."""
    batches = [b for rank in range(pool2.world_size) for b in _offset_batches(rank)]
    # the untracked layer normalizes each batch with that batch's local statistics
    expected = _population(_layers_model(untracked=True).train(), batches)
    for state in pool2.run(_untracked_sync_layer):
        for key, value in expected.items():
            torch.testing.assert_close(state[key], value, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("layer_class", [nn.BatchNorm1d, syncbn.SyncBatchNorm])
def test_a_layer_whose_tracking_was_switched_off_normalizes_with_batch_statistics(
    layer_class: type[nn.Module],
) -> None:
    """Tracking switched off after the layer was built: it keeps its buffers, and training
    normalizes with each batch's statistics; recomputing put it in eval mode, where it
    normalized with those stale buffers, and the next layer got statistics of activations
    that training never makes. Its buffers are left as they were."""
    torch.manual_seed(0)
    first: Any = layer_class(3).double()
    second = nn.BatchNorm1d(3, dtype=torch.float64)
    model = nn.Sequential(first, second)
    first.track_running_stats = False
    with torch.no_grad():
        first.running_mean.fill_(10.0)
        first.running_var.fill_(4.0)
    batches = [torch.randn(8, 3, dtype=torch.float64) * 2 + 1 for _ in range(4)]
    with torch.no_grad():
        seen = torch.cat([first.train()(batch) for batch in batches])
    var, mean = torch.var_mean(seen, dim=0)
    model.eval()
    syncbn.recompute_statistics(model, batches)
    torch.testing.assert_close(second.running_mean, mean, rtol=0, atol=1e-12)
    torch.testing.assert_close(second.running_var, var, rtol=1e-12, atol=0)
    assert first.running_mean.tolist() == [10.0] * 3
    assert first.running_var.tolist() == [4.0] * 3
    assert not first.training


@pytest.mark.parametrize("layer_class", [nn.BatchNorm1d, syncbn.SyncBatchNorm])
def test_a_tracking_layer_without_running_statistics_normalizes_with_batch_statistics(
    layer_class: type[nn.Module],
) -> None:
    """A layer whose running statistics were set to None (it still tracks): torch's
    BatchNorm runs it on batch statistics in training and eval alike. Recomputing read
    its missing buffers' device and raised AttributeError (a review, 2026-12-07); it now
    has nothing to write there, and the next layer gets the statistics of what it gives."""
    torch.manual_seed(0)
    first: Any = layer_class(3).double()
    second = nn.BatchNorm1d(3, dtype=torch.float64)
    model = nn.Sequential(first, second)
    first.running_mean = first.running_var = None
    batches = [torch.randn(8, 3, dtype=torch.float64) * 2 + 1 for _ in range(4)]
    with torch.no_grad():
        seen = torch.cat([first(batch) for batch in batches])
    var, mean = torch.var_mean(seen, dim=0)
    syncbn.recompute_statistics(model, batches)
    torch.testing.assert_close(second.running_mean, mean, rtol=0, atol=1e-12)
    torch.testing.assert_close(second.running_var, var, rtol=1e-12, atol=0)
    assert first.running_mean is None and first.running_var is None


class _GradModeRecorder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 1, dtype=torch.float64)
        self.bn = syncbn.SyncBatchNorm(3).double()
        self.grad_modes: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.grad_modes.append(torch.is_grad_enabled())
        return self.bn(self.conv(x))


def test_the_forwards_run_without_gradients() -> None:
    """As the docstring says (``torch.no_grad()``): a change of 2026-12-07 moved the
    decorator onto a helper by mistake (a review), and the forwards recorded graphs,
    saving activations for a backward that never comes (memory of a training step)."""
    model = _GradModeRecorder()
    syncbn.recompute_statistics(model, _batches(0))
    assert model.grad_modes and not any(model.grad_modes)


class _KeywordCall(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(3, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(input=x)


def test_a_layer_called_with_a_keyword_input() -> None:
    model = _KeywordCall()
    batches = [torch.randn(4, 3, dtype=torch.float64) + 2 for _ in range(3)]
    syncbn.recompute_statistics(model, batches)
    var, mean = torch.var_mean(torch.cat(batches), dim=0, correction=1)
    torch.testing.assert_close(model.bn.running_mean, mean, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(model.bn.running_var, var, rtol=1e-12, atol=1e-12)


class _TimeMajor(nn.BatchNorm1d):
    """(N, L, C) input, transposed before normalizing (speech and sequence models)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return super().forward(input.transpose(1, 2)).transpose(1, 2)


class _Scaled(nn.BatchNorm1d):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return super().forward(input * 10)


class _ScaledSync(syncbn.SyncBatchNorm):
    def forward(self, input: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return super().forward(input * 10, mask)


class _ActivatedSync(syncbn.SyncBatchNorm):
    """Normalizes the tensor it is given, then adds to it (as timm's BatchNormAct2d)."""

    def forward(self, input: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return torch.relu(super().forward(input, mask))


@pytest.mark.parametrize(
    ("layer", "shape", "match"),
    [
        (_TimeMajor(4), (8, 4, 4), "normalizes another tensor than the one it is given"),
        (_TimeMajor(4), (8, 6, 4), r"input of shape \(8, 6, 4\), whose dimension 1"),
        (_Scaled(4), (8, 4), "normalizes another tensor than the one it is given"),
        (_ScaledSync(4), (8, 4), "normalizes another tensor than the one it is given"),
    ],
    ids=["transposed-square", "transposed", "scaled", "scaled-syncbn-subclass"],
)
def test_a_forward_that_changes_its_input_first_is_refused(
    layer: nn.BatchNorm1d, shape: tuple[int, ...], match: str
) -> None:
    """Its statistics are those of another tensor than the recorded one: they came out
    silently wrong (or a size mismatch was raised), and now nothing changes. A subclass of
    syncbn.SyncBatchNorm was taken as SyncBatchNorm itself, unwatched (a review found its
    statistics 10x those of the batches)."""
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    with pytest.raises(ValueError, match=match):
        syncbn.recompute_statistics(layer, [torch.randn(*shape) + 3 for _ in range(2)])
    for key, value in layer.state_dict().items():
        torch.testing.assert_close(value, before[key], rtol=0, atol=0)


def test_a_syncbn_subclass_that_normalizes_its_input_is_taken() -> None:
    layer = _ActivatedSync(3).double()
    batches = [torch.randn(4, 3, dtype=torch.float64) + 2 for _ in range(3)]
    syncbn.recompute_statistics(layer, batches)
    var, mean = torch.var_mean(torch.cat(batches), dim=0, correction=1)
    torch.testing.assert_close(layer.running_mean, mean, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(layer.running_var, var, rtol=1e-12, atol=1e-12)


def _negative_num_batches_on_rank_0(rank: int, world_size: int) -> tuple[str, str]:
    model = nn.Sequential(syncbn.SyncBatchNorm(3)).double()
    return outcome(
        lambda: syncbn.recompute_statistics(
            model, _batches(rank), num_batches=-1 if rank == 0 else None
        )
    )


def test_refused_arguments_on_one_rank_raise_on_every_rank(pool2: WorkerPool) -> None:
    """The rank that refuses them joins the collective with the error flag (the others
    waited for the process group's timeout)."""
    refused, other = pool2.run(_negative_num_batches_on_rank_0, timeout=30.0)
    assert refused[0] == "ValueError" and "num_batches must be non-negative" in refused[1]
    assert other[0] == "RuntimeError" and "other rank(s)" in other[1], other


def _swa_batches(rank: int, world_size: int) -> list[torch.Tensor]:
    """Rank ``rank``'s share of 3 global batches (one rank's share empty at one step)."""
    gen = torch.Generator().manual_seed(20)
    sizes = [(2, 3, 1), (0, 4, 2), (3, 1, 3)]
    batches = []
    for step_sizes in sizes:
        global_batch = torch.randn(sum(step_sizes[:world_size]), 3, 6, 6, generator=gen)
        start = sum(step_sizes[:rank])
        batches.append(global_batch.double()[start : start + step_sizes[rank]] * 2 + 5)
    return batches


def _swa_update_bn(rank: int, world_size: int) -> dict[str, torch.Tensor]:
    from torch.optim.swa_utils import AveragedModel, update_bn

    averaged = AveragedModel(syncbn.convert_sync_batchnorm(_model(sync=False)))
    update_bn(_swa_batches(rank, world_size), averaged)
    return {k: v.clone() for k, v in averaged.module.state_dict().items()}


def test_swa_update_bn_averages_the_global_batches(pool: WorkerPool) -> None:
    """``torch.optim.swa_utils.update_bn`` (SWA's last step: a cumulative average over a
    loader, momentum None, in train mode) on a converted model: each forward synchronizes,
    so every rank gets the average of the global batches' statistics, as one process
    that sees the global batches."""
    from torch.optim.swa_utils import AveragedModel, update_bn

    world_size = pool.world_size
    reference = AveragedModel(_model(sync=False))
    global_batches = [
        torch.cat(shares)
        for shares in zip(*(_swa_batches(rank, world_size) for rank in range(world_size)))
    ]
    update_bn(global_batches, reference)
    expected = reference.module.state_dict()
    for state in pool.run(_swa_update_bn):
        assert state.keys() == expected.keys()
        for key, value in expected.items():
            torch.testing.assert_close(state[key], value, rtol=1e-10, atol=1e-12, msg=key)
