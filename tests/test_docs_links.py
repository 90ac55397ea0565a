"""The repository's Markdown links lead somewhere: every relative link of the documents a
reader follows names a file or directory that exists, and every ``#anchor`` names a heading
of its target.

README.md's measured detail moved to docs/performance.md (2026-12-07), and pointers into
README's sections ("On a GPU") had to follow it; this is what catches the next such move.
The changelog and benchmarks/HISTORY.md are left out: they quote older text as it was,
links included.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: the documents read as they are now (not the records of what they said before)
DOCUMENTS = (
    "README.md",
    "CONTRIBUTING.md",
    "DEVELOPERS.md",
    "benchmarks/README.md",
    "examples/README.md",
    *sorted(str(path.relative_to(ROOT)) for path in (ROOT / "docs").glob("*.md")),
)

#: ``[text](target)`` and ``![alt](target)``: the target up to a space or ``)``
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^(```|~~~)")


def _outside_code(text: str) -> str:
    """``text`` without its fenced code blocks and inline code spans."""
    lines, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(re.sub(r"`[^`]*`", "", line))
    return "\n".join(lines)


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading's text: lower case, spaces to hyphens, and punctuation
    other than hyphens and underscores dropped."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of a Markdown file's headings (outside code blocks)."""
    headings = re.findall(r"^#{1,6}\s+(.*?)\s*#*$", _outside_code(path.read_text()), re.M)
    return {anchor(heading) for heading in headings}


def links(path: Path) -> list[str]:
    """The relative link targets of a Markdown file (no URLs, no ``mailto:``)."""
    targets = _LINK.findall(_outside_code(path.read_text()))
    return [target for target in targets if not re.match(r"[a-z]+:", target)]


def test_anchor_follows_githubs_rule() -> None:
    assert anchor("On a GPU: the second run (H200, 2026-12-04)") == (
        "on-a-gpu-the-second-run-h200-2026-12-04"
    )
    assert anchor("Converting, reverting, process groups, precise BN") == (
        "converting-reverting-process-groups-precise-bn"
    )
    assert anchor("`check_mode` and_more") == "check_mode-and_more"


def test_a_missing_file_or_anchor_is_found(tmp_path: Path) -> None:
    """The checks themselves: a link to a file that is not there, and to a heading that is
    not there, are what :func:`broken` reports; a link inside a code block is not a link."""
    (tmp_path / "other.md").write_text("# Title\n\n## A section\n")
    doc = tmp_path / "doc.md"
    doc.write_text(
        "# Doc\n\n[ok](other.md) [ok](other.md#a-section) [ok](#doc) [url](https://x.y/z)\n"
        "[gone](missing.md) [no heading](other.md#nowhere) [no heading here](#nowhere)\n"
        "```\n[in code](also-missing.md)\n```\n"
    )
    assert broken(doc) == ["missing.md", "other.md#nowhere", "#nowhere"]


def broken(path: Path) -> list[str]:
    """The links of ``path`` whose file, or heading, does not exist."""
    found = []
    for target in links(path):
        file_part, _, fragment = target.partition("#")
        destination = (path.parent / file_part).resolve() if file_part else path
        if not destination.exists():
            found.append(target)
        elif fragment and destination.suffix == ".md" and fragment not in anchors(destination):
            found.append(target)
    return found


@pytest.mark.parametrize("document", DOCUMENTS)
def test_every_relative_link_leads_somewhere(document: str) -> None:
    path = ROOT / document
    assert links(path) or document != "README.md", "README.md has no links: the parser broke"
    assert broken(path) == []
