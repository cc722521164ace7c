"""The README's and the guides' Python examples run, and the README's test command is what CI runs.

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
