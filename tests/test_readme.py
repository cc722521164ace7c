"""The README's Python examples run, and its test command is what CI runs."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def test_python_examples_run():
    import linecache

    blocks = re.findall(r"```python\n(.*?)```", README, re.S)
    assert len(blocks) >= 2
    for i, code in enumerate(blocks):
        name = f"<README.md example {i + 1}>"  # its source where inspect looks (torch.compile reads it)
        linecache.cache[name] = (len(code), None, code.splitlines(True), name)
        exec(compile(code, name, "exec"), {"__name__": f"readme_example_{i + 1}"})


def test_ci_runs_the_readme_test_command():
    sh_blocks = re.findall(r"```sh\n(.*?)```", README, re.S)
    test_cmd = sh_blocks[1].strip()
    assert "pytest" in test_cmd
    assert test_cmd in (ROOT / ".ci" / "run").read_text()
