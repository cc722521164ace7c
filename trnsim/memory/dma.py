"""DMA transfers: how a copy splits over a core's DMA engines, and what each engine spends.

Model (datasheet §6, §12.3):

* A core has ``dma.engines`` engines (16); a transfer is split across them by SBUF partition,
  engine ``e`` serving partitions ``[e*P/E, (e+1)*P/E)`` (8 partitions each on a 128-partition
  core). HBM-to-HBM copies split evenly.
* Each engine moves its share as contiguous chunks (descriptors). Its occupancy is
  ``bytes / engine_bandwidth + chunks * descriptor_overhead`` — small chunks are overhead-bound
  (<512 B per partition is inefficient, >=2-4 KiB near peak, §6). An element-strided HBM side
  moves each element as a whole HBM transaction (``hbm_access_bytes``): the engine and the HBM
  stack spend that per element, not the element's 2 or 4 bytes.
* A DMA transpose (NC-v3+) spreads like a copy of its destination, at a published fraction of
  the copy's throughput (``transpose_rate_hbm`` / ``transpose_rate_sbuf``).
* A transfer becomes ready ``start_latency`` (~1.3 us) after its trigger; that latency overlaps
  with other queued transfers. After the engines finish, ``transfer_latency`` (completion and
  the semaphore write on all engines) passes before dependents see the data.

Calibration (tests/sim/test_calibration.py): ``engine_bandwidth`` is the sustained per-engine rate of
the NKI DMA bandwidth guide (17/23/33 B/ns on Trn1/2/3, datasheet §6), which transfers of many
KiB per partition settle at; one engine moving 32 KiB HBM->SBUF as [4, 4096] bf16 then takes
1485 ns on Trn2 against the measured 1416 ns (datasheet V3, within 5%).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np

from .bandwidth import BandwidthPipe
from ..config import ChipConfig
from ..isa import AP, DmaGather, HbmAP, KernelError, TileAP

__all__ = ["DmaPlan", "plan_dma", "plan_transpose", "plan_indirect", "contiguous_run", "execute_dma", "execute_indirect_dma", "DmaSystem",
           "BandwidthPipe"]


@dataclass(frozen=True)
class DmaPlan:
    """Per-engine work of one transfer: ``engines[i] = (engine, bytes, chunks)``."""

    engines: tuple[tuple[int, int, int], ...]
    hbm_read_bytes: int
    hbm_write_bytes: int
    sbuf_read_bytes: int
    sbuf_write_bytes: int
    chunk_bytes: int  # bytes per descriptor (the efficiency driver)
    #: least bytes a descriptor occupies an engine and HBM for (``core.dma.hbm_access_bytes`` when
    #: an HBM side is element-strided: each element is a whole HBM transaction); 0: none
    min_chunk_bytes: int = 0
    #: throughput relative to a copy (a DMA transpose runs at 0.9 / 0.5 of it, datasheet §6)
    rate: Fraction = Fraction(1)

    @property
    def bytes(self) -> int:
        return sum(b for _, b, _ in self.engines)

    @property
    def hbm_bus_bytes(self) -> int:
        """The HBM bandwidth the transfer takes: its bytes, or whole transactions per element."""
        moved = self.hbm_read_bytes + self.hbm_write_bytes
        if not moved or self.min_chunk_bytes <= self.chunk_bytes:
            return moved
        return moved // self.chunk_bytes * self.min_chunk_bytes


def _squeeze(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(n for n in shape if n != 1)


def contiguous_run(dims: tuple[tuple[int, int], ...]) -> int:
    """Length in elements of the innermost contiguous run of an access pattern."""
    run = 1
    for stride, size in reversed(dims):
        if size == 1:
            continue
        if stride == run:
            run *= size
        else:
            break
    return run


def plan_dma(dst: AP, src: AP, config: ChipConfig) -> DmaPlan:
    if dst.space == "psum" or src.space == "psum":
        raise KernelError("dma_copy: DMA engines cannot access PSUM; evacuate PSUM with tensor_copy or activation first")
    n_src = src.size
    if _squeeze(src.shape) != _squeeze(dst.shape):
        raise KernelError(
            f"dma_copy: source {src!r} has shape {src.shape} but destination {dst!r} has shape {dst.shape}; "
            f"shapes must match (size-1 dims aside): reshape one side to the other"
        )
    itemsize = max(src.dtype.itemsize, dst.dtype.itemsize)
    run_src = contiguous_run(src.dims)
    run_dst = contiguous_run(dst.dims)
    # a tile's partition rows are never contiguous with each other
    tile = dst if isinstance(dst, TileAP) else src if isinstance(src, TileAP) else None
    if tile is not None:
        per_part = tile.free_size
        run_src = min(run_src, per_part)
        run_dst = min(run_dst, per_part)
    chunk = max(1, min(run_src, run_dst))
    n_eng = config.core.dma.engines
    engines: list[tuple[int, int, int]] = []
    if tile is not None:
        engines = _split_by_partition(tile, chunk, itemsize, config)
    else:
        # HBM to HBM: the transfer is split evenly over all engines (datasheet §6); each
        # engine's share is cut into descriptors at the contiguous-run boundaries
        total = n_src
        use = min(n_eng, total)
        for e in range(use):
            elems = total // use + (1 if e < total % use else 0)
            engines.append((e, elems * itemsize, -(-elems // chunk)))
    eng = _merge_engines(engines)
    src_bytes = src.nbytes
    dst_bytes = dst.nbytes
    hbm = isinstance(src, HbmAP) or isinstance(dst, HbmAP)
    return DmaPlan(
        engines=eng,
        hbm_read_bytes=src_bytes if isinstance(src, HbmAP) else 0,
        hbm_write_bytes=dst_bytes if isinstance(dst, HbmAP) else 0,
        sbuf_read_bytes=src_bytes if isinstance(src, TileAP) else 0,
        sbuf_write_bytes=dst_bytes if isinstance(dst, TileAP) else 0,
        chunk_bytes=chunk * itemsize,
        min_chunk_bytes=config.core.dma.hbm_access_bytes if hbm else 0,
    )


def plan_transpose(dst: TileAP, src: AP, config: ChipConfig) -> DmaPlan:
    """A DMA transpose ``dst[P, K] = src[K, P]ᵀ`` into SBUF (datasheet §6, S9): the 16 engines
    write the destination's partitions cooperatively, so each engine's share is its partitions
    of ``dst`` as in a copy of the same size, at ``transpose_rate_hbm`` (from HBM) or
    ``transpose_rate_sbuf`` (SBUF to SBUF) of the copy's throughput."""
    d = config.core.dma
    rate = d.transpose_rate_hbm if isinstance(src, HbmAP) else d.transpose_rate_sbuf
    itemsize = dst.dtype.itemsize
    engines = _merge_engines(_split_by_partition(dst, dst.free_size, itemsize, config))
    return DmaPlan(
        engines=engines,
        hbm_read_bytes=src.nbytes if isinstance(src, HbmAP) else 0,
        hbm_write_bytes=0,
        sbuf_read_bytes=src.nbytes if isinstance(src, TileAP) else 0,
        sbuf_write_bytes=dst.nbytes,
        chunk_bytes=dst.free_size * itemsize,
        rate=Fraction(rate).limit_denominator(1000),
    )


def _split_by_partition(tile: TileAP, chunk: int, itemsize: int, config: ChipConfig) -> list[tuple[int, int, int]]:
    """(engine, bytes, chunks) per run of partitions: engine ``e`` serves its block of SBUF
    partitions, each partition's ``tile.free_size`` elements cut into ``chunk``-element descriptors."""
    n_eng = config.core.dma.engines
    per_engine = max(1, config.core.sbuf.partitions // n_eng)
    per_part_elems = tile.free_size
    chunks_per_part = -(-per_part_elems // chunk)
    engines = []
    p = tile.p_start
    p_end = tile.p_start + tile.p_count
    while p < p_end:
        e = (p // per_engine) % n_eng
        q = min(p_end, (p // per_engine + 1) * per_engine)
        k = q - p
        engines.append((e, k * per_part_elems * itemsize, k * chunks_per_part))
        p = q
    return engines


def _merge_engines(engines: list[tuple[int, int, int]]) -> tuple[tuple[int, int, int], ...]:
    """Sum the work of an engine that appears more than once (a tile wider than the engine count wraps)."""
    merged: dict[int, list[int]] = {}
    for e, b, c in engines:
        m = merged.setdefault(e, [0, 0])
        m[0] += b
        m[1] += c
    return tuple((e, b, c) for e, (b, c) in sorted(merged.items()))


def plan_indirect(tile: TileAP, rows: HbmAP, gather: bool, config: ChipConfig) -> DmaPlan:
    """Per-engine work of a gather (``rows`` -> ``tile``) or scatter (``tile`` -> ``rows``).

    Every partition moves one row through its own descriptor(s): a row is contiguous in HBM
    only within itself, so even adjacent indices pay one descriptor each. The plan depends on
    the shapes alone, never on the index values, so timing-only runs need no values.
    """
    itemsize = max(tile.dtype.itemsize, rows.dtype.itemsize)
    chunk = max(1, min(contiguous_run(rows.dims[1:]), contiguous_run(tile.dims), tile.free_size))
    hbm_bytes = tile.p_count * tile.free_size * rows.dtype.itemsize
    return DmaPlan(
        engines=_merge_engines(_split_by_partition(tile, chunk, itemsize, config)),
        hbm_read_bytes=hbm_bytes if gather else 0,
        hbm_write_bytes=0 if gather else hbm_bytes,
        sbuf_read_bytes=0 if gather else tile.nbytes,
        sbuf_write_bytes=tile.nbytes if gather else 0,
        chunk_bytes=chunk * itemsize,
    )


def _cast(vals: Any, src: Any, dst: Any) -> Any:
    """``vals`` of dtype ``src`` converted to ``dst`` the way DMA casts: through fp32, RNE."""
    from ..native.cast import to_dtype

    if src == dst:
        return vals
    return to_dtype(np.asarray(vals) if not src.is_float else np.asarray(vals, dtype=np.float32), dst)


def execute_dma(ins: Any, mem: Any) -> None:
    """Copy the values (the functional half of a DmaCopy); casts round to nearest even."""
    src = mem.view(ins.src)
    dst = mem.view(ins.dst)
    vals = src.reshape(dst.shape) if src.shape != dst.shape else src
    dst[...] = _cast(vals, ins.src.dtype, ins.dst.dtype)


def execute_transpose(ins: Any, mem: Any) -> None:
    """The functional half of a DmaTranspose: ``dst[P, K] = src[K, P]ᵀ``, bits unchanged."""
    src = mem.view(ins.src)
    src = src.reshape(src.shape[0], -1) if src.ndim > 1 else src.reshape(1, -1)
    dst = mem.view(ins.dst)
    dst[...] = src.T.reshape(dst.shape)


def execute_indirect_dma(ins: Any, mem: Any) -> None:
    """The functional half of a DmaGather/DmaScatter: read the index tile now, check every index
    against the indexed tensor's rows (``oob_mode``), then move the rows."""
    gather = isinstance(ins, DmaGather)
    rows_ap, tile = (ins.src, ins.dst) if gather else (ins.dst, ins.src)
    n_rows = rows_ap.shape[0]
    idx = np.asarray(mem.view(ins.indices), dtype=np.int64).reshape(-1)
    ok = (idx >= 0) & (idx < n_rows)
    if ins.oob_mode == "error" and not ok.all():
        p = int(np.argmin(ok))
        raise KernelError(f"{ins.opcode} #{ins.index}: index {idx[p]} on partition {ins.indices.p_start + p} of "
                          f"'{ins.indices.name}' is outside rows 0..{n_rows - 1} of '{rows_ap.tensor.name}' "
                          f"(oob_mode='error'; 'skip' leaves such partitions alone)")
    sel = np.flatnonzero(ok)
    rows = mem.view(rows_ap)
    part = mem.view(tile)
    if gather:
        part[sel] = _cast(rows[idx[sel]], rows_ap.dtype, tile.dtype).reshape((len(sel),) + part.shape[1:])
        return
    uniq, counts = np.unique(idx[sel], return_counts=True)
    if (counts > 1).any():
        k = int(np.argmax(counts > 1))
        ps = ins.indices.p_start + sel[idx[sel] == uniq[k]]
        raise KernelError(f"{ins.opcode} #{ins.index}: row {uniq[k]} of '{rows_ap.tensor.name}' is named by partitions "
                          f"{ps[0]} and {ps[1]} of '{ins.indices.name}'; scatter indices must be unique (the order "
                          f"of two writes to one row is not defined)")
    rows[idx[sel]] = _cast(part[sel], tile.dtype, rows_ap.dtype).reshape((len(sel),) + rows.shape[1:])


#: id(plan) -> (the plan, the engine figures its ticks were worked out with (bandwidth, tick
#: rate, descriptor ticks, the engine_ticks method), its engines' ticks): DmaSystem.engine_ticks_of
_PLAN_TICKS: dict[int, tuple[DmaPlan, tuple[Any, ...], tuple[tuple[int, int], ...]]] = {}
_PLAN_TICKS_MAX = 8192  # entries (a few KB each: the plan is kept alive with them) before it starts again


class DmaSystem:
    """The timing half: a core's DMA engines and queues, plus the HBM stack it shares.

    Each queue is a simpy process that takes its transfers in program order. A transfer starts
    ``start_latency`` after its trigger (overlapping with transfers already in flight), reserves
    each DMA engine it uses first-come first-served, and the HBM stack's bandwidth pipe for its
    HBM bytes; it completes ``transfer_latency`` after the last of those, and never before the
    transfer ahead of it in the same queue.
    """

    def __init__(self, config: ChipConfig, hbm_pipe: "BandwidthPipe"):
        self.config = config
        dma = config.core.dma
        self.tick_hz = config.tick_hz
        self.engine_free = [0] * dma.engines
        #: while not None every engine is free at this tick and ``engine_free`` may be stale: a
        #: collective books all engines at once, thousands of times, so it keeps one number
        self._level: int | None = 0
        self._next = 0  # the engine a collective's next small transfer starts on (round robin)
        self.bw = dma.engine_bandwidth
        self.start_latency = config.ps_to_ticks(dma.start_latency)
        self.transfer_latency = config.ps_to_ticks(dma.transfer_latency)
        self.desc_ticks = config.ps_to_ticks(dma.descriptor_overhead)
        self.hbm = hbm_pipe
        #: id(plan) -> (plan, ((engine, ticks), ...), HBM bus bytes): a plan's costs, worked out once
        self._plan_ticks: dict[int, tuple[DmaPlan, tuple[tuple[int, int], ...], int]] = {}

    def engine_ticks(self, nbytes: int, chunks: int, plan: DmaPlan | None = None) -> int:
        """Ticks an engine spends on ``nbytes`` in ``chunks`` descriptors (of ``plan``: element
        granularity and transpose rate)."""
        if plan is not None and plan.min_chunk_bytes > plan.chunk_bytes:
            nbytes = max(nbytes, chunks * plan.min_chunk_bytes)
        ticks = -(-nbytes * self.tick_hz // self.bw) + chunks * self.desc_ticks
        if plan is not None and plan.rate != 1:
            ticks = -(-ticks * plan.rate.denominator // plan.rate.numerator)
        return ticks

    def engine_ticks_of(self, plan: DmaPlan) -> tuple[tuple[int, int], ...]:
        """``((engine, engine_ticks(bytes, chunks, plan)), ...)`` over the plan's engines, each
        distinct (bytes, chunks) worked out once (a copy's engines mostly move equal shares),
        and each plan once per process for the same engine figures (:data:`_PLAN_TICKS`: the
        kernels of a process share their plans, and every simulation of one reads them)."""
        params = (self.bw, self.tick_hz, self.desc_ticks, type(self).engine_ticks)
        got = _PLAN_TICKS.get(id(plan))
        if got is not None and got[0] is plan and got[1] == params:
            return got[2]
        memo: dict[tuple[int, int], int] = {}
        out = []
        for e, b, c in plan.engines:
            t = memo.get((b, c))
            if t is None:
                t = memo[(b, c)] = self.engine_ticks(b, c, plan)
            out.append((e, t))
        ticks = tuple(out)
        if len(_PLAN_TICKS) >= _PLAN_TICKS_MAX:  # (a DMA transpose or gather makes a plan per copy)
            _PLAN_TICKS.clear()
        _PLAN_TICKS[id(plan)] = (plan, params, ticks)  # (holding the plan keeps its id its own)
        return ticks

    def reserve(self, plan: DmaPlan, start: int) -> tuple[int, int]:
        """Book the engines and the HBM pipe from ``start``; return (when data starts moving,
        when the transfer is complete and visible)."""
        if self._level is not None:
            self.engine_free = [self._level] * len(self.engine_free)
            self._level = None
        fin = start
        first = None
        free = self.engine_free
        got = self._plan_ticks.get(id(plan))
        if got is None or got[0] is not plan:  # kernels share plans between copies of one geometry
            got = self._plan_ticks[id(plan)] = (plan, self.engine_ticks_of(plan), plan.hbm_bus_bytes)
        _, engine_ticks, hbm_bytes = got
        for e, ticks in engine_ticks:
            s = free[e] if free[e] > start else start
            if first is None or s < first:
                first = s
            f = s + ticks
            free[e] = f
            if f > fin:
                fin = f
        if hbm_bytes:
            fin = max(fin, self.hbm.reserve(hbm_bytes, start))
        return (start if first is None else first), fin + self.transfer_latency

    def reserve_spread(self, ticks: int, start: int) -> int:
        """Book every engine for ``ticks`` (see :meth:`engine_ticks`) from ``start`` and return
        when the last is done. A collective's DMA ring spreads its packets over all of a core's
        engines (datasheet §6, S21); the HBM side is the caller's to book, since a collective
        reads and writes different stacks."""
        lv = self._level
        if lv is not None:
            lv = self._level = (lv if lv > start else start) + ticks
            return lv
        free = self.engine_free = [(f if f > start else start) + ticks for f in self.engine_free]
        top = max(free)
        if min(free) == top:
            self._level = top
        return top

    def reserve_engines(self, engines: tuple[int, ...], ticks: int, start: int) -> int:
        """Book the listed engines for ``ticks`` each from ``start`` and return when the last is
        done: a collective's DMA rings, the engines the runtime assigned it on this core."""
        if self._level is not None:
            self.engine_free = [self._level] * len(self.engine_free)
            self._level = None
        free = self.engine_free
        top = start
        for e in engines:
            f = free[e] = (free[e] if free[e] > start else start) + ticks
            if f > top:
                top = f
        return top

    def reserve_some(self, engines: int, ticks: int, start: int) -> int:
        """Book ``engines`` engines (the next ones round robin) for ``ticks`` each from ``start``;
        a transfer smaller than a packet per engine uses fewer engines than a core has."""
        n = len(self.engine_free)
        if self._level is not None:
            self.engine_free = [self._level] * n
            self._level = None
        free = self.engine_free
        top = start
        e = self._next
        for _ in range(engines):
            f = free[e] = (free[e] if free[e] > start else start) + ticks
            if f > top:
                top = f
            e = e + 1 if e + 1 < n else 0
        self._next = e
        return top
