"""Each neuron device's default ``torch.Generator``, made once by the native extension (its state
lives there: seed + Philox offset). The device module (``torch.neuron.default_generator``) and the
fallback's random ops (:mod:`torch_bridge.values`) both read them here."""

from __future__ import annotations

import torch

__all__ = ["device_generator"]

_generators: list[torch.Generator] = []


def device_generator(index: int) -> torch.Generator:
    """The default generator of ``neuron:index`` (an index already checked)."""
    while len(_generators) <= index:
        _generators.append(torch.ops.trnsim.default_generator(len(_generators)))
    return _generators[index]
