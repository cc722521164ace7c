"""Every private torch API the bridge uses is fenced in torch_bridge._torch, pinned to one torch
version; a missing one fails with a message naming it and that version."""

import pathlib
import re
import tokenize

import pytest
import torch

from torch_bridge import _torch


def test_every_private_api_resolves_on_the_pinned_torch():
    assert torch.__version__.split("+")[0] == _torch.PINNED
    for path in _torch.REQUIRED:
        assert _torch.resolve(path) is not None, path
    for path in _torch.DIST_REQUIRED:  # resolved when the distributed backend first needs them
        assert _torch.dist_api(path) is not None, path


def test_a_missing_api_names_itself_and_the_pinned_version():
    with pytest.raises(_torch.PrivateAPIError, match=r"^torch_bridge needs torch\._C\._no_such_api \(a private torch "
                       r"API\), which torch \S+ lacks; the neuron device is written against torch 2\.13\.0: "
                       r"pip install 'torch==2\.13\.0'$"):
        _torch.resolve("torch._C._no_such_api")


#: a private torch name: torch._X, torch.utils._X (any dotted path with a private part), an op's
#: ._op / ._schema, the zerotensor check
PRIVATE = re.compile(r"\btorch(\.[A-Za-z]\w*)*\._[A-Za-z]|\._op\b|\._schema\b|_is_zerotensor")


def private_uses(path: pathlib.Path) -> list[int]:
    """Lines of ``path`` whose code or string literals name a private torch API (a module path in a
    string is a use: importlib and after_import take them); docstrings and comments name APIs to
    explain them (``torch.cuda.memory._record_memory_history`` is what torch.neuron mirrors) and
    are blanked out first."""
    lines = [list(line) for line in path.read_text().splitlines()]
    prev = tokenize.NEWLINE
    with tokenize.open(path) as f:
        for tok in tokenize.generate_tokens(f.readline):
            docstring = tok.type == tokenize.STRING and prev in (tokenize.NEWLINE, tokenize.INDENT,
                                                                 tokenize.DEDENT)
            if tok.type == tokenize.COMMENT or docstring:
                (r0, c0), (r1, c1) = tok.start, tok.end
                for r in range(r0, r1 + 1):
                    a = c0 if r == r0 else 0
                    b = c1 if r == r1 else len(lines[r - 1])
                    lines[r - 1][a:b] = " " * (b - a)
            if tok.type != tokenize.COMMENT:
                prev = tok.type
    return [i for i, chars in enumerate(lines, 1) if PRIVATE.search("".join(chars))]


def test_the_bridge_uses_no_private_api_outside_the_fence():
    """Only _torch.py may reach into torch's private names (torch._X, torch.utils._X, ._op, ._schema),
    in every folder of the bridge, compile/ included."""
    root = pathlib.Path(_torch.__file__).parent
    offenders = [f"{p.relative_to(root)}:{i}" for p in sorted(root.rglob("*.py")) if p.name != "_torch.py"
                 for i in private_uses(p)]
    assert offenders == []


def test_the_fence_sees_a_private_name_in_code_and_strings(tmp_path):
    p = tmp_path / "m.py"
    p.write_text('"""A docstring may name torch.cuda.memory._record_memory_history."""\n'
                 "from torch.utils._python_dispatch import TorchDispatchMode  # torch._C in a comment\n"
                 "x = torch._C.foo\n"
                 "M = 'torch.distributed.fsdp._fully_shard._fsdp_param_group'\n"
                 "y = torch.ops.aten.add.Tensor._op\n"
                 "z = torch.nn.functional.relu\n")
    assert private_uses(p) == [2, 3, 4, 5]
