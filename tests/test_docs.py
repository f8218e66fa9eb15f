"""The docs hold together: every relative link resolves (file and heading), and every
TENSORWIRE_* setting the code reads has its line in docs/configuration.md, and no other.

Pure file reading, no processes: a moved page or a renamed heading fails here, not in a reader's
browser."""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")


def _prose(text: str) -> str:
    """The text outside fenced code blocks and inline code, where links and headings live."""
    out, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        if not fenced and not line.startswith("    "):
            out.append(re.sub(r"`[^`]*`", "", line))
        elif not fenced:
            out.append("")
    return "\n".join(out)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


@cache
def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    fenced = False
    for line in page.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line.lstrip()):
            fenced = not fenced
        m = None if fenced else re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def _links(page: Path) -> list[str]:
    return LINK.findall(_prose(page.read_text(encoding="utf-8")))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for link in _links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", link):  # http:, https:, mailto:
            continue
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            broken.append(f"{link}: no {target.relative_to(ROOT) if target.is_relative_to(ROOT) else target}")
        elif anchor and target.suffix == ".md" and anchor not in anchors(target):
            broken.append(f"{link}: no heading #{anchor} in {target.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def _settings(text: str) -> set[str]:
    # A name followed by `{` or ending in `_` is the prefix of an f-string, not a setting.
    return {m.group(0) for m in re.finditer(r"TENSORWIRE_[A-Z0-9_]*[A-Z0-9](?![A-Z0-9_{])", text)}


@pytest.mark.timeout(30)
def test_every_setting_has_its_line_in_configuration_md() -> None:
    code = set().union(*(_settings(p.read_text(encoding="utf-8")) for p in (ROOT / "src").rglob("*.py")))
    documented = _settings((ROOT / "docs" / "configuration.md").read_text(encoding="utf-8"))
    undocumented, unknown = sorted(code - documented), sorted(documented - code)
    assert not undocumented, f"read in src/ but not in docs/configuration.md: {undocumented}"
    assert not unknown, f"in docs/configuration.md but read nowhere in src/: {unknown}"
