"""pytest-xdist's groups for the suite (``--dist loadgroup``, README's test command).

The tests that run on the shared pools of ranks go to one worker, which starts the pools
once: each xdist worker is a pytest session of its own, and two would each start pools and
compile the same graphs at the same time (293-334 s for the suite, cold, against 272 s).
Every other test goes with its file, so that a module's fixtures start once too. No torch
import here: ``tests/test_xdist_groups.py`` runs this hook in a pytest of its own.
"""

from __future__ import annotations

import pytest

__all__ = ["POOL_FIXTURES", "pytest_collection_modifyitems"]

#: the fixtures of the session's pools of ranks (tests/conftest.py)
POOL_FIXTURES = frozenset({"pool", "pool2", "pool3"})


# first: pytest-xdist's own hook turns the marks into node id suffixes; run after it, the
# groups were never read (and nothing said so)
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark each test with its xdist group: ``"pools"``, or its file."""
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        uses_pools = bool(POOL_FIXTURES & set(getattr(item, "fixturenames", ())))
        group = "pools" if uses_pools else item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(group))
