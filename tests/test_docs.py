"""The docs hold together: every relative link resolves (file and heading), every
TENSORWIRE_* setting the code reads has its line in docs/configuration.md, and no other, the user
pages state current behaviour (history lives in docs/design/), and the API reference
(docs/reference/, Sphinx) covers every public name and builds without a warning.

File reading, except the reference's build: a moved page, a renamed heading or a docstring that
does not render fails here, not in a reader's browser."""

from __future__ import annotations

import re
import subprocess
import sys
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


@pytest.mark.timeout(30)
def test_the_settings_list_names_every_setting_read() -> None:
    """config.SETTINGS is what a TENSORWIRE_* variable is checked against (a misspelt one warns)."""
    from tensorwire.config import SETTINGS

    code = set().union(*(_settings(p.read_text(encoding="utf-8")) for p in (ROOT / "src").rglob("*.py")))
    assert set(SETTINGS) == code, (sorted(code - SETTINGS), sorted(SETTINGS - code))


# -- user pages: current behaviour only ----------------------------------------------------------

# The user pages; docs/design/ keeps the history and the measurements behind it.
DOCS = ROOT / "docs"
USER_PAGES = sorted({ROOT / "README.md", *DOCS.glob("*.md"), *(DOCS / "reference").glob("*.md"),
                     DOCS / "benchmarks" / "README.md"})
LAB_NOTE = re.compile(r"\b(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b"  # a commit hash
                      r"|\b[Ii]ssues? #?[0-9]+"                                    # an issue number
                      r"|\b20[0-9]{2}-[0-9]{2}-[0-9]{2}\b")                     # a date


@pytest.mark.timeout(30)
@pytest.mark.parametrize("page", USER_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_user_pages_carry_no_history(page: Path) -> None:
    """Commit hashes, issue numbers and dates belong to docs/design/history/: a user page says
    what is, and its results tables name their command and machine. Code blocks (sample output)
    and link targets (a design note's heading) are exempt."""
    lines = re.sub(r"\]\([^)\s]*\)", "]", _prose(page.read_text(encoding="utf-8"))).splitlines()
    notes = [f"line {i}: {line.strip()[:100]}" for i, line in enumerate(lines, 1) if LAB_NOTE.search(line)]
    assert not notes, f"{page.relative_to(ROOT)}: " + "; ".join(notes)


# -- the API reference ---------------------------------------------------------------------------

REFERENCE = ROOT / "docs" / "reference"
DOCUMENTED = re.compile(r"(?:auto(?!module)\w+|py:\w+)::\s+(tensorwire(?:\.torch)?)\.(\w+)")


def _documented() -> dict[str, set[str]]:
    out: dict[str, set[str]] = {"tensorwire": set(), "tensorwire.torch": set()}
    for page in REFERENCE.glob("*.md"):
        for module, name in DOCUMENTED.findall(page.read_text(encoding="utf-8")):
            out[module].add(name)
    return out


@pytest.mark.timeout(60)
def test_reference_covers_every_public_name() -> None:
    import inspect

    import tensorwire

    modules = [n for n in tensorwire.__all__ if inspect.ismodule(getattr(tensorwire, n))]
    assert not modules, f"`from tensorwire import *` would bring in submodules: {modules}"  # (it did: `log`)
    public = set(tensorwire.__all__)
    missing = sorted(public - _documented()["tensorwire"])
    assert not missing, f"public in tensorwire but in no page of docs/reference/: {missing}"
    unknown = sorted(n for n in _documented()["tensorwire"] if not hasattr(tensorwire, n))
    assert not unknown, f"docs/reference/ documents names tensorwire does not have: {unknown}"
    pytest.importorskip("torch", reason="torch is not installed: tensorwire.torch cannot be imported")
    import tensorwire.torch

    missing = sorted(set(tensorwire.torch.__all__) - _documented()["tensorwire.torch"])
    assert not missing, f"public in tensorwire.torch but in no page of docs/reference/: {missing}"


@pytest.mark.timeout(300)
def test_reference_builds_without_warnings(tmp_path: Path) -> None:
    """What `make docs` runs: Sphinx imports the package and renders every docstring the
    reference names; a missing name or a docstring that does not parse is an error."""
    for module, name in (("sphinx", "Sphinx"), ("myst_parser", "myst-parser")):
        pytest.importorskip(module, reason=f"{name} is not installed (the docs or test extra install it)")
    pytest.importorskip("torch", reason="torch is not installed: the reference documents tensorwire.torch")
    build = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-E", "-q", "-b", "html",
                            "-d", str(tmp_path / "doctrees"), str(REFERENCE), str(tmp_path / "html")],
                           capture_output=True, text=True, timeout=280)
    assert build.returncode == 0, f"sphinx-build failed:\n{build.stdout}{build.stderr}"
    assert (tmp_path / "html" / "index.html").exists()


def test_work_reference_covers_what_users_read_of_it() -> None:
    """Every public member of Work is in docs/reference/work.md, but what the library itself
    sets as it runs and ends the operation (what, rank, done, finish)."""
    import tensorwire

    work = tensorwire.Work("all_reduce", 0)
    public = {n for n in set(dir(tensorwire.Work)) | set(vars(work)) if not n.startswith("_")}
    page = (REFERENCE / "work.md").read_text(encoding="utf-8")
    documented = set(re.findall(r"auto(?:method|attribute)::\s+(\w+)", page))
    assert sorted(public - {"what", "rank", "done", "finish"} - documented) == []
