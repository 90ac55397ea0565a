"""SyncBatchNormPlugin (syncbn.integrations.lightning) in a real Lightning Trainer, 2 CPU ranks.

Needs lightning (``pip install -e ".[ecosystem]"``; ``.ci/ecosystem`` runs these tests); skipped
where it is not installed. Each fit runs ``_lightning_fit.py`` in a subprocess (the ``"ddp"``
strategy launches the script again for rank 1), bound to the loopback interface, and is killed
with its whole process group if it outlives ``FIT_TIMEOUT``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from _launcher import free_port, loopback_env, run_launcher
from torch import nn

pytest.importorskip("lightning", reason="lightning is an optional dependency (syncbn[lightning])")

from lightning.pytorch.plugins import LayerSync  # noqa: E402

import syncbn  # noqa: E402
from syncbn.integrations.lightning import SyncBatchNormPlugin  # noqa: E402

SCRIPT = Path(__file__).resolve().with_name("_lightning_fit.py")
FIT_TIMEOUT = 100.0  # seconds; below pytest-timeout's 120 so that the cleanup runs first


def _fit(tmp_path: Path, strategy: str, *options: str) -> list[dict[str, Any]]:
    """Run the script; return each rank's record of its layer after the step."""
    command = [sys.executable, str(SCRIPT), strategy, str(tmp_path), *options]
    run_launcher(command, tmp_path, loopback_env(free_port()), FIT_TIMEOUT)
    return [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]


def _global_statistics(records: list[dict[str, Any]]) -> tuple[torch.Tensor, torch.Tensor]:
    batch = torch.cat([record["local_batch"] for record in records])
    return batch.mean(0), batch.var(0)  # running_var: the unbiased variance


@pytest.mark.parametrize("strategy", ["ddp_spawn", "ddp"])
def test_one_step_gives_the_global_batch_statistics(tmp_path: Path, strategy: str) -> None:
    records = _fit(tmp_path, strategy)
    mean, var = _global_statistics(records)
    for rank, record in enumerate(records):
        assert record["class"] == "SyncBatchNorm", rank
        torch.testing.assert_close(record["running_mean"], mean)
        torch.testing.assert_close(record["running_var"], var)
        local = record["local_batch"]
        # the local statistics (what plain BatchNorm gives) are far from the global ones
        assert not torch.allclose(local.mean(0), mean, atol=1.0)
    if strategy == "ddp":  # the fitting processes run on: the strategy's teardown reverted
        for rank in range(2):
            assert (tmp_path / f"after{rank}.txt").read_text() == "BatchNorm1d"


def test_without_the_plugin_each_rank_keeps_local_statistics(tmp_path: Path) -> None:
    """The control: the same fit with plain BatchNorm gives each rank its own statistics."""
    records = _fit(tmp_path, "ddp", "--no-plugin")
    mean, _ = _global_statistics(records)
    for record in records:
        assert record["class"] == "BatchNorm1d"
        local = record["local_batch"]
        torch.testing.assert_close(record["running_mean"], local.mean(0))
        torch.testing.assert_close(record["running_var"], local.var(0))
        assert not torch.allclose(record["running_mean"], mean, atol=1.0)


def test_apply_converts_and_revert_restores_in_one_process() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.Flatten(), nn.BatchNorm1d(4))
    plugin = SyncBatchNormPlugin(check_layer_order=False)
    assert isinstance(plugin, LayerSync)
    params = dict(model.named_parameters())
    converted = plugin.apply(model)
    assert converted is model
    sync = syncbn.SyncBatchNorm
    assert [type(m) for m in model] == [nn.Conv2d, sync, nn.Flatten, sync]
    assert not model[1].check_layer_order and model[3].layer_name == "3"
    assert plugin.revert(model) is model
    assert [type(m) for m in model] == [nn.Conv2d, nn.BatchNorm2d, nn.Flatten, nn.BatchNorm1d]
    assert all(p is params[name] for name, p in model.named_parameters())
