"""The README's and the guides' Python examples run, their links lead somewhere, and the README's
test command is what CI runs.

The guides moved out of the README into docs/ (and benchmarks/README.md, configs/README.md); every
```python block of every one of those pages still runs here, in page order, so moving text drops
no check."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
# every page whose examples run and whose links are checked: the README, the guides, the two READMEs
# of the folders whose reference they are
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md")),
         ROOT / "benchmarks" / "README.md", ROOT / "configs" / "README.md"]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _examples() -> list[tuple[str, int, str]]:
    """(page, 1-based index of the page's python block, code) for every ```python block."""
    out = []
    for page in PAGES:
        if not page.exists():
            continue
        blocks = [code for lang, code in FENCE.findall(page.read_text()) if lang == "python"]
        out += [(_rel(page), i, code) for i, code in enumerate(blocks, 1)]
    return out


EXAMPLES = _examples()


def test_the_examples_were_found():
    # 12 blocks lived in the 1,880-line README; the guides keep all 12 and the README adds its own
    # short ones. A page that loses its blocks (a broken fence, a renamed file) shows up here.
    assert sum(page != "README.md" for page, _, _ in EXAMPLES) >= 12
    assert sum(page == "README.md" for page, _, _ in EXAMPLES) >= 2


@pytest.mark.parametrize("page,index,code", EXAMPLES, ids=[f"{p}:{i}" for p, i, _ in EXAMPLES])
def test_python_example_runs(page, index, code):
    import linecache

    name = f"<{page} example {index}>"  # its source where inspect looks (torch.compile reads it)
    linecache.cache[name] = (len(code), None, code.splitlines(True), name)
    module = re.sub(r"\W", "_", page)
    exec(compile(code, name, "exec"), {"__name__": f"example_{module}_{index}"})


def test_ci_runs_the_readme_test_command():
    sh_blocks = [code for lang, code in FENCE.findall(README) if lang == "sh"]
    test_cmd = sh_blocks[1].strip()
    assert "pytest" in test_cmd
    assert test_cmd in (ROOT / ".ci" / "run").read_text()


def _slug(heading: str) -> str:
    """A heading's anchor as GitHub (and mkdocs' default toc) makes it: markup dropped, lower case,
    punctuation other than - and _ dropped, spaces to -."""
    text = re.sub(r"[`*]|\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    return {_slug(h) for h in re.findall(r"^#{1,6} (.+?)\s*$", text, re.M)}


def _links(page: Path) -> list[str]:
    text = FENCE.sub("", page.read_text())   # code blocks hold no links
    text = re.sub(r"`[^`\n]*`", "", text)    # nor do code spans
    return re.findall(r"\]\(([^)\s]+)\)", text)


@pytest.mark.parametrize("page", [p for p in PAGES if p.exists()], ids=_rel)
def test_relative_links_lead_to_files_and_headings(page):
    broken = []
    for target in _links(page):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:: not ours to check offline
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif not dest.is_relative_to(ROOT):
            broken.append(f"{target}: outside the repository")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: {_rel(dest)} has no heading with the anchor '{anchor}'")
    assert not broken, f"{_rel(page)}: " + "; ".join(broken)


def test_every_guide_is_listed_in_the_index():
    index = (ROOT / "docs" / "index.md").read_text()
    listed = {(ROOT / "docs" / link.partition("#")[0]).resolve() for link in _links(ROOT / "docs" / "index.md")}
    missing = [_rel(p) for p in sorted((ROOT / "docs").glob("**/*.md"))
               if p.name != "index.md" and p.resolve() not in listed]
    assert index and not missing, f"docs/index.md does not link to {missing}"
    assert "docs/index.md" in README


def test_docs_site_builds_strict(tmp_path):
    """mkdocs.yml builds the site from the repository alone, and --strict turns every broken link,
    missing anchor or page left out of the nav into a failure. Runs where the `docs` extra is
    installed."""
    import os
    import subprocess
    import sys

    pytest.importorskip("mkdocs", reason="the docs extra is not installed")
    pytest.importorskip("material", reason="the docs extra is not installed")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stdout + done.stderr
    pages = {p.parent.name for p in (tmp_path / "site").glob("*/index.html")}
    assert {"torch", "benchmarks", "configs", "readme"} <= pages
