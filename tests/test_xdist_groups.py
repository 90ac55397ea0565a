"""The suite's pytest-xdist groups reach xdist: a pytest of its own, 2 workers, a test that
uses a pool fixture and one that does not (no torch in those processes: about 3 s)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("xdist")

_TESTS = Path(__file__).resolve().parent

_CONFTEST = """
import pytest
from _xdist_groups import pytest_collection_modifyitems

@pytest.fixture
def pool2():
    return 2
"""

_TESTS_FILE = """
def test_on_a_pool(pool2):
    assert pool2 == 2

def test_alone():
    pass
"""


def test_each_test_reaches_xdist_in_its_group(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(_CONFTEST)
    (tmp_path / "test_grouped.py").write_text(_TESTS_FILE)
    paths = [str(_TESTS), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = os.environ | {"PYTHONPATH": os.pathsep.join(paths)}
    command = [sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-v"]
    command += ["-p", "no:cacheprovider", "test_grouped.py"]
    result = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    # xdist's loadgroup names a grouped test "<node id>@<group>"
    assert "PASSED test_grouped.py::test_on_a_pool@pools" in result.stdout, result.stdout
    assert "PASSED test_grouped.py::test_alone@test_grouped.py" in result.stdout, result.stdout


def test_the_pool_fixtures_are_the_suites(pytestconfig: pytest.Config) -> None:
    """The names the hook groups by are the fixtures tests/conftest.py defines: a pool
    fixture renamed there would leave its tests out of the pools' worker."""
    from _xdist_groups import POOL_FIXTURES

    conftest = _TESTS / "conftest.py"
    modules = [
        plugin
        for plugin in pytestconfig.pluginmanager.get_plugins()
        if Path(getattr(plugin, "__file__", "") or "").resolve() == conftest
    ]
    assert len(modules) == 1, modules
    for name in POOL_FIXTURES:
        assert callable(getattr(modules[0], name, None)), name
