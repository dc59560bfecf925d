"""The documents stand on their own and cover every knob.

Users see docs/ and the README, never the workspace the project was started from: no document (nor
a docstring or comment in the package, tests, benchmarks or recipes, which point readers at docs/)
may send them to `../shared/`, its DESIGN.md / STYLE.md / LAYOUT.md / COLLECTIVES-GROUND.md, or "the
shared design". Every knob of `shardpar/config.py` has a row in docs/knobs.md (the two SMDDP buffer
knobs under their environment names, which is how users set them) and is named in docs/design.md;
docs/design.md's table of contents points at headings that exist.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from shardpar.config import describe_knobs

ROOT = Path(__file__).resolve().parents[2]
DOCS = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
SOURCES = [p for top in ("shardpar", "tests", "benchmarks", "recipes") for p in sorted((ROOT / top).rglob("*.py"))]

# The workspace's files, by path or by name; "docs/design.md" (lower case) is ours and does not match.
SHARED = re.compile(
    r"\.\./shared|shared/(?:reference|hooks|DESIGN|STYLE|LAYOUT|COLLECTIVES)|\bDESIGN\.md|\bSTYLE\.md|"
    r"\bLAYOUT\.md|COLLECTIVES-GROUND|shared design"
)
ENV_NAMED = {"smddp_ag_scratch_buffer_size_bytes", "smddp_ag_sort_buffer_size_bytes"}


def _hits(paths: list[Path]) -> list[str]:
    found = []
    for path in paths:
        if path == Path(__file__).resolve():
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if SHARED.search(line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    return found


def test_the_pattern_catches_every_kind_of_reference() -> None:
    for text in (
        "see ../shared/DESIGN.md",
        "`shared/DESIGN.md`",
        "DESIGN.md section 1",
        "(STYLE.md)",
        "COLLECTIVES-GROUND.md measured",
        "LAYOUT.md",
        "fills in the shared design",
    ):
        assert SHARED.search(text), text
    for text in ("docs/design.md section 9", "design.md", "shared-memory transport", "shared by several runs"):
        assert not SHARED.search(text), text


@pytest.mark.parametrize("where", ["docs", "sources"])
def test_nothing_points_at_the_shared_workspace(where: str) -> None:
    hits = _hits(DOCS if where == "docs" else SOURCES)
    assert hits == [], "fold what these need into docs/ and point there instead:\n" + "\n".join(hits)


def test_every_knob_has_a_row_in_knobs_md_and_is_named_in_design_md() -> None:
    knobs_md = (ROOT / "docs" / "knobs.md").read_text(encoding="utf-8")
    design_md = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    rows = {m.group(1) for m in re.finditer(r"(?m)^\| `([A-Za-z0-9_]+)`", knobs_md)}
    missing_rows, missing_design = [], []
    for name, _default, _doc in describe_knobs():
        if (name.upper() if name in ENV_NAMED else name) not in rows:
            missing_rows.append(name)
        if not re.search(rf"\b{name}\b", design_md):
            missing_design.append(name)
    assert missing_rows == [], f"knobs with no row in docs/knobs.md: {missing_rows}"
    assert missing_design == [], f"knobs docs/design.md never names: {missing_design}"


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to dashes."""
    return re.sub(r"[^a-z0-9 _-]", "", heading.strip().lower()).replace(" ", "-")


def test_design_md_contents_link_to_its_headings() -> None:
    text = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    anchors = {_anchor(h) for h in re.findall(r"(?m)^#{2,3} (.+)$", text)}
    links = re.findall(r"\]\(#([^)]+)\)", text)
    assert len(links) >= 20, links
    assert [link for link in links if link not in anchors] == []
