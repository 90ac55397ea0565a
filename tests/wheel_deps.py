"""Link the installed dependencies of a wheel into one directory: run by ``.ci/wheel``.

``python wheel_deps.py WHEEL TARGET SITE [SITE ...]`` finds the distributions that the
wheel requires (its ``Requires-Dist`` without extras, and theirs, recursively, with their
environment markers) among those installed in the ``SITE`` directories, and links each file
and directory they installed there into ``TARGET``. A ``.pth`` line naming ``TARGET`` then
gives a fresh virtual environment exactly the wheel's dependencies, as ``pip install`` would
have downloaded them, without unpacking torch again (tens of seconds on a CI machine) and
without anything else of those directories: not syncbn's own install (an editable one puts
the source tree on ``sys.path``), not the test suite's tools, so an import the wheel does
not declare fails there.

Prints one line (what it linked); exits with a message if a requirement is not installed in
``SITE`` or its installed version does not satisfy it.
"""

from __future__ import annotations

import sys
import zipfile
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name


def _wheel_requirements(wheel: Path) -> list[str]:
    """The ``Requires-Dist`` values of the wheel's metadata."""
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        text = archive.read(name).decode()
    return [
        line.partition(":")[2].strip()
        for line in text.splitlines()
        if line.startswith("Requires-Dist:")
    ]


def _applies(requirement: Requirement, extras: frozenset[str]) -> bool:
    """Whether ``requirement`` applies here, for a requirer installed with ``extras``."""
    marker = requirement.marker
    return marker is None or any(marker.evaluate({"extra": extra}) for extra in extras | {""})


def dependencies(requirements: list[str], sites: list[str]) -> dict[str, metadata.Distribution]:
    """The installed distributions that ``requirements`` need, recursively, by name.

    Raises:
        SystemExit: a requirement is not installed in ``sites``, or at a version it excludes.
    """
    found: dict[str, metadata.Distribution] = {}
    pending = [(Requirement(text), frozenset[str]()) for text in requirements]
    while pending:
        requirement, extras = pending.pop()
        name = canonicalize_name(requirement.name)
        if name in found or not _applies(requirement, extras):
            continue
        distribution = next(iter(metadata.distributions(name=requirement.name, path=sites)), None)
        if distribution is None:
            raise SystemExit(f"wheel_deps: {requirement} is not installed in {sites}")
        if not requirement.specifier.contains(distribution.version, prereleases=True):
            raise SystemExit(
                f"wheel_deps: {requirement} excludes the installed version {distribution.version}"
            )
        found[name] = distribution
        wanted = frozenset(requirement.extras)
        pending += [(Requirement(text), wanted) for text in distribution.requires or []]
    return found


def link(distributions: dict[str, metadata.Distribution], target: Path) -> int:
    """Link the top-level files and directories that ``distributions`` installed; count them."""
    target.mkdir(parents=True, exist_ok=True)
    count = 0
    for distribution in distributions.values():
        tops = {file.parts[0] for file in distribution.files or [] if file.parts[0] != ".."}
        for top in sorted(tops):
            source = Path(str(distribution.locate_file(top)))
            if source.exists() and not (target / top).exists():
                (target / top).symlink_to(source)
                count += 1
    return count


def main(argv: list[str]) -> None:
    wheel, target, sites = Path(argv[0]), Path(argv[1]), argv[2:]
    requirements = _wheel_requirements(wheel)
    distributions = dependencies(requirements, sites)
    count = link(distributions, target)
    names = {canonicalize_name(Requirement(text).name) for text in requirements}
    direct = [f"{d.metadata['Name']} {d.version}" for n, d in distributions.items() if n in names]
    others = len(distributions) - len(direct)
    print(f"wheel deps: {', '.join(direct)} and {others} more linked ({count} entries)")


if __name__ == "__main__":
    main(sys.argv[1:])
