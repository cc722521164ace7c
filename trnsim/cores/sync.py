"""The Sync engine: a sequencer with no datapath. It exists to trigger DMAs without disturbing
the compute engines' instruction order (datasheet §3); the trigger cost lives in the base
class, shared by every engine that can trigger a DMA."""

from __future__ import annotations

from ..isa import DmaTranspose
from .base import Engine, register_engine


@register_engine
class SyncEngine(Engine):
    name = "Sync"
    runs = Engine.runs | {DmaTranspose}
    aliases = ("sp",)
    column, title = 4, "Sync engine"
    datapath = False  # triggers DMAs only: never what bounds a kernel
