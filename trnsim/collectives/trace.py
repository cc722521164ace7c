"""Chrome trace-event JSON of a collective, for ui.perfetto.dev and chrome://tracing.

One process per chip. Its lanes: the CC DMA queue of each of its ranks ("rank 4 CC0": one bar per
transfer the rank's DMA engines ran, from data movement to completion) and one lane per link
direction leaving the chip ("link chip 0 -> chip 1 (x+)", "link chip 0 -> server switch": one bar
per chunk the link served). Overlapping transfers of one queue go to extra lanes ("rank 4 CC0
(2)"), as :mod:`trnsim.trace` does for kernel DMA queues.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Iterable

from ..config.files import AtomicOutput
from ..outputs.trace import spread_lanes
from .report import CollectiveReport

__all__ = ["collective_trace_events", "write_collective_trace"]

_CHIP = re.compile(r"chip (\d+)")


def chip_of_lane(lane: str, rpc: int) -> int:
    if lane.startswith("rank "):
        return int(lane.split()[1]) // rpc
    m = _CHIP.search(lane)
    if lane.startswith("link ") and "switch -> chip" in lane and m:  # a switch's down port: the receiving chip
        return int(lane.rsplit("chip ", 1)[1])
    return int(m.group(1)) if m else 0


def collective_trace_events(reports: Iterable[CollectiveReport], ranks_per_chip: int) -> list[dict[str, Any]]:
    """Trace events (metadata first) for the timelines of ``reports`` (simulated with
    ``trace=True``); ``ranks_per_chip`` places rank lanes on their chips."""
    reports = list(reports)
    hz = reports[0].tick_hz if reports else 1
    lanes: dict[tuple[int, str], list[tuple[int, int, str, int]]] = {}
    for n, rep in enumerate(reports):
        for lane, label, start, end in rep.timeline:
            lanes.setdefault((chip_of_lane(lane, ranks_per_chip), lane), []).append((start, end, label, n))
    meta: list[dict[str, Any]] = []
    events: list[dict[str, Any]] = []
    tids: dict[tuple[int, str], int] = {}
    for chip in sorted({c for c, _ in lanes}):
        meta.append({"ph": "M", "name": "process_name", "pid": chip, "tid": 0, "args": {"name": f"chip {chip}"}})
        meta.append({"ph": "M", "name": "process_sort_index", "pid": chip, "tid": 0, "args": {"sort_index": chip}})

    def order(key: tuple[int, str]) -> tuple[int, int, str]:
        return (key[0], 0 if key[1].startswith("rank") else 1, key[1])

    for (chip, lane), segs in sorted(lanes.items(), key=lambda kv: order(kv[0])):
        for k, part in enumerate(spread_lanes(segs)):
            name = lane if k == 0 else f"{lane} ({k + 1})"
            tid = tids.setdefault((chip, name), len(tids) + 1)
            meta.append({"ph": "M", "name": "thread_name", "pid": chip, "tid": tid, "args": {"name": name}})
            meta.append({"ph": "M", "name": "thread_sort_index", "pid": chip, "tid": tid, "args": {"sort_index": tid}})
            for start, end, label, n in part:
                events.append({"ph": "X", "name": label, "cat": "link" if lane.startswith("link") else "cc",
                               "pid": chip, "tid": tid, "ts": start * 1e6 / hz, "dur": (end - start) * 1e6 / hz,
                               "args": {"collective": reports[n].collective, "start_tick": start, "end_tick": end}})
    return meta + events


def write_collective_trace(path: str | os.PathLike[str] | AtomicOutput, reports: Iterable[CollectiveReport],
                           ranks_per_chip: int) -> Path:
    """Write the trace to ``path`` atomically (:func:`trnsim.config.files.write_atomic`: never half a
    trace, never over a FIFO or device); an :class:`AtomicOutput` is a path reserved before the
    run, so a bad one is refused before any simulating."""
    reps = list(reports)
    doc = {"traceEvents": collective_trace_events(reps, ranks_per_chip), "displayTimeUnit": "ns",
           "otherData": {"generator": "trnsim", "collectives": [r.collective for r in reps]}}
    out = path if isinstance(path, AtomicOutput) else AtomicOutput(path, "--trace")
    return out.commit(lambda f: json.dump(doc, f, separators=(",", ":")))
