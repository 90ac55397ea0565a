"""Run Python code with syncbn imported from a copy of its source and no package metadata.

What a vendored copy, a monorepo that does not pip-install its parts, or ``PYTHONPATH=src``
gives: syncbn's modules are importable, but ``importlib.metadata`` knows no syncbn
distribution, so no ``syncbn.converters`` entry point exists. The package directory
``src/syncbn`` is copied alone (``src/`` may hold the ``syncbn.egg-info`` of an editable
install, which is metadata). The interpreter runs with ``-S`` (no site-packages, no ``.pth``
files) and a ``PYTHONPATH`` of that copy and one directory of links to everything in this
interpreter's site-packages except syncbn's own install (its ``dist-info``, an editable
install's ``.pth`` and finder, an installed copy): torch and the other dependencies stay
importable.
"""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

__all__ = ["PACKAGE", "run_without_metadata"]

#: the source tree's package directory, which is copied
PACKAGE = Path(__file__).resolve().parents[1] / "src" / "syncbn"

#: an interpreter check run before the caller's code: syncbn comes from the copy, no metadata
_PRELUDE = """
import importlib.metadata, os, sys
import syncbn
assert os.path.dirname(os.path.dirname(syncbn.__file__)) == {source!r}, syncbn.__file__
from syncbn._conversion import _entry_points
assert _entry_points() == [], "entry points"
try:
    importlib.metadata.distribution("syncbn")
except importlib.metadata.PackageNotFoundError:
    pass
else:
    raise AssertionError("syncbn's package metadata is visible")
"""


def _is_syncbn_install(name: str) -> bool:
    lowered = name.lower()
    return lowered.startswith("syncbn") or (
        lowered.startswith("__editable__") and "syncbn" in lowered
    )


def _site_without_syncbn(directory: Path) -> Path:
    """A directory of links to the site-packages entries of this interpreter but syncbn's."""
    directory.mkdir(parents=True, exist_ok=True)
    roots = [*site.getsitepackages(), site.getusersitepackages()]
    for root in filter(os.path.isdir, roots):
        for name in os.listdir(root):
            link = directory / name
            if not _is_syncbn_install(name) and not link.exists():
                link.symlink_to(os.path.join(root, name))
    return directory


def run_without_metadata(code: str, workdir: Path, timeout: float = 120.0) -> str:
    """Run ``code`` in a fresh interpreter that imports syncbn from a copy of its source only.

    The copy is ``workdir / "src" / "syncbn"``. The interpreter first checks that ``syncbn``
    comes from there and that neither its distribution nor any ``syncbn.converters`` entry
    point is visible.

    Args:
        code: the Python source to run (after those checks).
        workdir: an empty directory for the copy and the links; also the working directory.
        timeout: seconds before the interpreter is stopped.

    Returns:
        What the code printed (stdout).

    Raises:
        AssertionError: if the interpreter exits with an error (its stderr is the message).
    """
    source = workdir / "src"
    shutil.copytree(PACKAGE, source / "syncbn", ignore=shutil.ignore_patterns("__pycache__"))
    site_dir = _site_without_syncbn(workdir / "site-packages")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(source), str(site_dir)])}
    env.pop("PYTHONHOME", None)
    result = subprocess.run(
        [sys.executable, "-S", "-c", _PRELUDE.format(source=str(source)) + code],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout
