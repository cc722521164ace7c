"""mkdocs hooks (mkdocs.yml `hooks:`): the site is docs/ plus three pages that live elsewhere in the
repository, because that is where a reader of the repository looks for them: README.md (as
`readme.md`), benchmarks/README.md (`benchmarks.md`) and configs/README.md (`configs.md`).

Every page is written to be read on GitHub, so its links are relative to its place in the
repository (`../benchmarks/README.md` from docs/, `docs/torch.md` from the README). Before mkdocs
reads a page, its links are rewritten to the site's pages; a link to a repository file that is not
a page (an example script, a test) keeps its text and loses its target, as the site does not serve
those files. tests/test_readme.py checks that every such link leads to a file that exists.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parent.parent
# repository path -> site path, for the pages that live outside docs/
OUTSIDE = {"README.md": "readme.md", "benchmarks/README.md": "benchmarks.md", "configs/README.md": "configs.md"}
FENCE = re.compile(r"^```.*?^```[^\n]*$", re.S | re.M)
LINK = re.compile(r"\]\(([^)\s]+)\)")


def on_files(files: Files, config) -> Files:
    for repo_path, site_path in OUTSIDE.items():
        files.append(File.generated(config, site_path, abs_src_path=str(ROOT / repo_path)))
    return files


def _repo_path(site_path: str) -> str:
    """Where a site page's source lives in the repository."""
    inverse = {v: k for k, v in OUTSIDE.items()}
    return inverse.get(site_path, f"docs/{site_path}")


def _site_path(repo_path: str) -> str | None:
    """The site page a repository file is, or None when the site does not serve it."""
    if repo_path in OUTSIDE:
        return OUTSIDE[repo_path]
    if repo_path.startswith("docs/") and repo_path.endswith(".md"):
        return repo_path[len("docs/"):]
    return None


def on_page_markdown(markdown: str, page, config, files: Files) -> str:
    here = page.file.src_uri
    base = posixpath.dirname(_repo_path(here))

    def relink(match: re.Match) -> str:
        target = match.group(1)
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            return match.group(0)
        path, hash_, anchor = target.partition("#")
        site = _site_path(posixpath.normpath(posixpath.join(base, path)))
        if site is None:
            return f"]({_NO_TARGET})"
        rel = posixpath.relpath(site, posixpath.dirname(here) or ".")
        return f"]({rel}{hash_}{anchor})"

    parts, last = [], 0
    for fence in FENCE.finditer(markdown):  # links inside code blocks are code
        parts.append(LINK.sub(relink, markdown[last:fence.start()]))
        parts.append(fence.group(0))
        last = fence.end()
    parts.append(LINK.sub(relink, markdown[last:]))
    return _unlink("".join(parts))


_NO_TARGET = "\x00no-target\x00"


def _unlink(markdown: str) -> str:
    """[text](no target) -> text: the link's words stay, without a link the site cannot serve."""
    return re.sub(r"\[([^\]]*)\]\(" + re.escape(_NO_TARGET) + r"\)", r"\1", markdown)
