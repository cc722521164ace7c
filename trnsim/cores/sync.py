"""The Sync engine: a sequencer with no datapath. It exists to trigger DMAs without disturbing
the compute engines' instruction order (datasheet §3); the trigger cost lives in the base
class, shared by every engine that can trigger a DMA."""

from __future__ import annotations

from .base import Engine, register_engine


@register_engine
class SyncEngine(Engine):
    name = "Sync"
