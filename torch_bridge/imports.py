"""Run a function right after a module is imported, without importing it.

The bridge adapts a few modules that are slow to import (FlexAttention, transformers' models):
importing them eagerly from ``import torch`` would add seconds to every program that never uses
them, so :func:`after_import` runs the adaptation when the program imports the module itself.
"""

from __future__ import annotations

import importlib.machinery
import sys
from typing import Any, Callable

__all__ = ["after_import", "run_pending"]


class _AfterImport:
    """A meta-path finder that runs each of ``fns`` on module ``name`` once it has executed, in
    the order they were asked for."""

    def __init__(self, name: str, fn: Callable[[Any], None]):
        self.name = name
        self.fns = [fn]

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        exec_module = loader.exec_module
        fns = self.fns

        def run(module: Any) -> None:
            exec_module(module)
            for fn in fns:
                fn(module)

        loader.exec_module = run  # type: ignore[method-assign]
        return spec


def _initializing(module: Any) -> bool:
    """True while ``module``'s code is still running (it is in sys.modules from its first line)."""
    return bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


class _Pending:
    """A meta-path finder that finds nothing: at each import after a module that was still
    running when :func:`after_import` was asked for it, it runs that module's functions once
    the module has finished (:func:`run_pending`)."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        run_pending()
        return None


_pending: list[tuple[str, Callable[[Any], None]]] = []
_finder = _Pending()


def run_pending() -> None:
    """Run the functions of :func:`after_import` whose module was still running when asked and
    has finished since (also called when the device starts: a program may import nothing more)."""
    done = [(n, fn) for n, fn in _pending if n in sys.modules and not _initializing(sys.modules[n])]
    if not done:
        return
    for item in done:
        _pending.remove(item)
    if not _pending and _finder in sys.meta_path:
        sys.meta_path.remove(_finder)
    for name, fn in done:
        fn(sys.modules[name])


def after_import(name: str, fn: Callable[[Any], None]) -> None:
    """``fn(module)`` now if module ``name`` is imported, else right after it is (once).

    A module that is in sys.modules but still running its code (it imported torch, which loaded
    the bridge, which asked for it: ``import transformers.models.mixtral.modeling_mixtral``
    before torch) is not finished: ``fn`` runs once it is, at the next import or when the device
    starts (:func:`run_pending`)."""
    module = sys.modules.get(name)
    if module is not None and not _initializing(module):
        fn(module)
    elif module is not None:
        if (name, fn) not in _pending:
            _pending.append((name, fn))
        if _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)
    else:
        finder = next((f for f in sys.meta_path if isinstance(f, _AfterImport) and f.name == name), None)
        if finder is None:
            sys.meta_path.insert(0, _AfterImport(name, fn))
        elif fn not in finder.fns:  # another function for the same module: it runs too, after the first
            finder.fns.append(fn)
