"""Optional extras (pyarrow, matplotlib, Ray): imported only where a feature needs one, with a
one-line error naming the extra to install when it is missing."""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["MissingExtra", "require"]


class MissingExtra(ImportError):
    """A feature needs an optional package that is not installed. The message is one line."""


def require(module: str, extra: str, what: str) -> Any:
    """``import module`` for ``what`` (e.g. ``"--metrics"``), or :class:`MissingExtra` naming the
    extra that installs it (as the README installs extras: from the checkout)."""
    try:
        return importlib.import_module(module)
    except ImportError:
        top = module.split(".")[0]
        raise MissingExtra(f"{what} needs {top} (the '{extra}' extra), which is not installed: "
                           f"python3 -m pip install -e '.[{extra}]'") from None
