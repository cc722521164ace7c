"""Every private torch API the bridge uses is fenced in torch_bridge._torch, pinned to one torch
version; a missing one fails with a message naming it and that version."""

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


def test_the_bridge_uses_no_private_api_outside_the_fence():
    """Only _torch.py may reach into torch's private names (torch._X, ._op, ._schema)."""
    import pathlib
    import re

    root = pathlib.Path(_torch.__file__).parent
    private = re.compile(r"\btorch\._[A-Za-z]|\._op\b|\._schema\b|_is_zerotensor")
    offenders = [f"{p.relative_to(root)}:{i}" for p in sorted(root.rglob("*.py")) if p.name != "_torch.py"
                 for i, line in enumerate(p.read_text().splitlines(), 1) if private.search(line)]
    assert offenders == []
