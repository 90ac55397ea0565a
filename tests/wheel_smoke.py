"""Smoke test of an installed syncbn wheel: run by ``.ci/wheel``, not by pytest.

``.ci/wheel`` builds the sdist and the wheel, installs the wheel into a fresh virtual
environment (no system site-packages) and runs this file with that environment's Python,
from a directory outside the clone, as ``python wheel_smoke.py SOURCE`` where ``SOURCE`` is
the clone's ``src/syncbn``. It checks what an editable install cannot show:

- syncbn is imported from the environment (not from the clone, and no other copy is
  visible), at the version of its metadata, and the wheel holds every module of ``SOURCE``
  (no module left out) and ``py.typed``; the environment holds only the wheel's dependencies
  (no test tools);
- a training step of SyncBatchNorm on 2 gloo ranks (syncbn's own launcher) equals
  ``torch.nn.BatchNorm2d`` on the concatenated batch: output, input gradient, weight and bias
  gradients, running statistics;
- the ``syncbn`` console script runs (``--version``, ``--help``);
- each ``syncbn.converters`` entry point (``syncbn``, ``timm``) names a function that the
  installed module defines (read from its source: importing timm's would import timm, which
  is not installed here), the same as syncbn's built-in table.

It prints one line when everything holds, and exits with an ``AssertionError`` otherwise.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.resources
import importlib.util
import subprocess
import sys
from pathlib import Path

import torch
from torch import nn

import syncbn
from syncbn import _conversion
from syncbn._cli.launch import run_on_ranks

#: local batch sizes of the 2 ranks (uneven), channels, spatial size
SIZES = (3, 2)
CHANNELS = 4
SPATIAL = 5


def _parameter_grads(module: nn.Module) -> torch.Tensor:
    grads = [param.grad for param in module.parameters()]
    assert grads and all(grad is not None for grad in grads), "a parameter has no gradient"
    return torch.cat([grad for grad in grads if grad is not None])


def _step_rank(rank: int, world_size: int) -> float:
    """One SyncBatchNorm training step on this rank's slice, checked against BatchNorm2d on
    the whole batch (computed on every rank); returns the largest difference."""
    import torch.distributed as dist

    generator = torch.Generator().manual_seed(0)
    shape = (sum(SIZES), CHANNELS, SPATIAL, SPATIAL)
    x = torch.randn(shape, generator=generator, dtype=torch.float64)
    dy = torch.randn(shape, generator=generator, dtype=torch.float64)
    reference = nn.BatchNorm2d(CHANNELS, dtype=torch.float64)
    layer = syncbn.convert_sync_batchnorm(nn.BatchNorm2d(CHANNELS, dtype=torch.float64))
    assert isinstance(layer, syncbn.SyncBatchNorm), type(layer)

    x_ref = x.clone().requires_grad_()
    y_ref = reference(x_ref)
    y_ref.backward(dy)
    local = slice(sum(SIZES[:rank]), sum(SIZES[: rank + 1]))
    x_local = x[local].clone().requires_grad_()
    y = layer(x_local)
    y.backward(dy[local])
    grads = _parameter_grads(layer)
    dist.all_reduce(grads)  # each rank's share of the parameter gradients, summed (as DDP)

    assert x_ref.grad is not None and x_local.grad is not None
    checks = [
        (y.detach(), y_ref[local].detach()),
        (x_local.grad, x_ref.grad[local]),
        (grads, _parameter_grads(reference)),
        (layer.running_mean, reference.running_mean),
        (layer.running_var, reference.running_var),
    ]
    for ours, theirs in checks:
        torch.testing.assert_close(ours, theirs)
    return max(float((ours - theirs).abs().max()) for ours, theirs in checks)


def _installed_files() -> set[str]:
    """The files of the installed package, relative to it (from the wheel's RECORD)."""
    files = importlib.metadata.files("syncbn") or []
    return {
        str(Path(*file.parts[1:]))
        for file in files
        if file.parts[0] == "syncbn" and "__pycache__" not in file.parts
    }


def _defines(module: str, function: str) -> bool:
    """Whether ``module``'s source (found, not imported) defines a top-level ``function``."""
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None, f"{module} is not installed"
    tree = ast.parse(Path(spec.origin).read_text())
    return any(isinstance(node, ast.FunctionDef) and node.name == function for node in tree.body)


def main(source: Path) -> None:
    environment = Path(sys.prefix).resolve()
    package = Path(syncbn.__file__).resolve().parent
    assert sys.prefix != sys.base_prefix, "not run in a virtual environment"
    assert package.is_relative_to(environment), f"syncbn imported from {package}, not the venv"
    others = [entry for entry in sys.path[1:] if (Path(entry) / "syncbn").exists()]
    assert others == [str(package.parent)], f"syncbn importable from {others}"
    names = [d.metadata["Name"] for d in importlib.metadata.distributions()]
    assert names.count("syncbn") == 1, "more than one syncbn distribution is visible"
    assert importlib.util.find_spec("pytest") is None, "the environment sees the system's tools"
    assert importlib.metadata.version("syncbn") == syncbn.__version__
    assert importlib.resources.files("syncbn").joinpath("py.typed").is_file(), "no py.typed"
    expected = {
        str(path.relative_to(source))
        for path in source.rglob("*")
        if path.is_file() and path.suffix in (".py", ".typed") and "__pycache__" not in path.parts
    }
    missing = expected - _installed_files()
    assert not missing, f"modules of the source tree missing from the wheel: {sorted(missing)}"

    differences = run_on_ranks(_step_rank, len(SIZES), timeout=120)

    script = Path(sys.executable).parent / "syncbn"
    version = subprocess.run([script, "--version"], capture_output=True, text=True, check=True)
    assert version.stdout.strip() == f"syncbn {syncbn.__version__}", version.stdout
    usage = subprocess.run([script, "--help"], capture_output=True, text=True, check=True)
    assert usage.stdout.startswith("usage: syncbn") and "demo" in usage.stdout, usage.stdout

    offered = {
        entry.name: entry
        for entry in importlib.metadata.entry_points(group=_conversion.ENTRY_POINT_GROUP)
    }
    for name, value in _conversion.BUILT_IN_CONVERTERS.items():
        entry = offered.get(name)
        assert entry is not None, f"no {name} entry point in {sorted(offered)}"
        assert entry.value == value, entry.value
        assert _defines(entry.module, entry.attr), f"{entry.value} does not name a function"
    assert "timm" not in sys.modules  # read, not imported

    print(
        f"wheel smoke: ok (syncbn {syncbn.__version__} from {package}; 2 gloo ranks vs "
        f"BatchNorm2d, max |diff| {max(differences):.1e}; console script, py.typed, "
        f"{len(expected)} files, entry points {', '.join(sorted(_conversion.BUILT_IN_CONVERTERS))})"
    )


if __name__ == "__main__":
    main(Path(sys.argv[1]).resolve())
