"""Run a function right after a module is imported, without importing it.

The bridge adapts a few modules that are slow to import (FlexAttention, transformers' models):
importing them eagerly from ``import torch`` would add seconds to every program that never uses
them, so :func:`after_import` runs the adaptation when the program imports the module itself.
"""

from __future__ import annotations

import importlib.machinery
import sys
from typing import Any, Callable

__all__ = ["after_import"]


class _AfterImport:
    """A meta-path finder that runs ``fn(module)`` once module ``name`` has executed."""

    def __init__(self, name: str, fn: Callable[[Any], None]):
        self.name = name
        self.fn = fn

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        exec_module = loader.exec_module
        fn = self.fn

        def run(module: Any) -> None:
            exec_module(module)
            fn(module)

        loader.exec_module = run  # type: ignore[method-assign]
        return spec


def after_import(name: str, fn: Callable[[Any], None]) -> None:
    """``fn(module)`` now if module ``name`` is imported, else right after it is (once)."""
    if name in sys.modules:
        fn(sys.modules[name])
    elif not any(isinstance(f, _AfterImport) and f.name == name for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(name, fn))
