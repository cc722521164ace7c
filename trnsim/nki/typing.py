"""``nki.typing``: annotations only (``t: nt.tensor[128, 512] = nl.load(x)``); trnsim reads none."""

from __future__ import annotations

from typing import Any

__all__ = ["tensor"]


class _TensorType:
    def __getitem__(self, shape: Any) -> "_TensorType":
        return self

    def __call__(self, *args: Any, **kwargs: Any) -> "_TensorType":
        return self

    def __repr__(self) -> str:
        return "nki.typing.tensor"


tensor = _TensorType()
