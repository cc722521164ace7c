"""Matmul family: ``matmul`` (out[M, N] = A @ B) and ``bmm`` (batched), written as an NKI author
would write them for TensorE.

Operand layout. TensorE contracts over the partition axis of both operands, so the kernel wants
``lhsT[K, M]`` and ``rhs[K, N]`` in SBUF (the NKI matmul tutorial's layout). With
``transpose_a`` A arrives as ``a[M, K]`` and with ``transpose_b`` B arrives as ``b[N, K]``; those
are loaded row-major and turned on chip with ``nc_transpose`` through PSUM (timed like any other
TensorE work), each element once: B as each column block is loaded, A during the first column
block, which also spills the transposed A to an HBM scratch for the later blocks. FP8 operands use the double-row mode (``[128, 2, M]`` tiles contracting 256 rows
per instruction) when the core has it; E4M3 and E5M2 run at the same rate and may be mixed
(datasheet §4.2, S9), so a kernel of mixed operands is the kernel of either.

Schedule (the tutorial's "blocked" kernel, made to stream without bubbles):

* the output is cut into column blocks of ``BN`` (<= 2 PSUM banks) and row blocks of ``BM``;
* the rhs block ``[K, BN]`` stays resident in SBUF for a whole column block. Its k-tiles live in a
  pool with one buffer per k-tile, and the next block's k-tile ``kt`` is loaded right after the
  last matmul that reads the current one, so the reload rolls along behind the compute instead
  of stalling it;
* lhsT row blocks ``[K, BM]`` stream through a double-buffered pool on the Sync queue;
* each [BM, BN] output block accumulates over K in PSUM accumulation groups (one bank per
  128x512 tile, two blocks' worth of banks so evacuation overlaps the next block), k-tile by
  k-tile, the stationary tile serving every bank of its row before it changes (so LoadStationary
  overlaps the previous multiply);
* PSUM is evacuated alternately by VectorE and ScalarE (casting to the output dtype) and stored
  by DMAs triggered from GpSimd on their own queue, so stores never queue behind loads.

Sizes are free: partial tiles cover ragged edges on partitions and free dims. When K is so long
that a block cannot stay resident, both operands stream a few k-tiles at a time instead (more
HBM traffic, same PSUM accumulation).

Building: consecutive row blocks of a resident column block emit the same instructions up to
their HBM views, so a block that starts in a state an earlier block started in is emitted by
replaying that block (``_Mm.block_or_replay``, :meth:`trnsim.kernel.Kernel.replay`): the same
instructions as running the loop, several times faster (``kernel.replays`` counts them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ..config import ChipConfig
from ..isa import DmaCopy, HbmAP, KernelError, TileAP
from ..builder.kernel import Kernel, Replay, TilePool, ViewCache, tile_view, checked_dtype as _pool_dtype, checked_shape as _pool_shape
from ..native.dtypes import Dtype, get_dtype
from .reference import round_to
from .registry import checked_dims, checked_dtype, register_kernel, split_dims

__all__ = ["build_matmul", "build_bmm", "plan_blocks"]

MATMUL_DTYPES = ("bf16", "fp16", "fp32", "fp8_e4m3", "fp8_e5m2")
MATMUL_PARAMS = {"transpose_a": False, "transpose_b": False, "out_dtype": "auto"}
_LHS_Q, _RHS_Q, _STORE_Q = 0, 1, 2  # DMA queue ids: loads of each operand and stores never share a queue
_GROUP = 4  # k-tiles per on-chip-transpose slab and per streaming step
_LHS_BUFS = 16 * _GROUP  # lhsT k-tiles in flight: loads run ahead of TensorE across DMA bursts


@dataclass
class _Plan:
    """Tile and block sizes of one matmul build (all in elements)."""

    tk: int          # contraction rows per instruction (256 for fp8 double-row)
    parts: int       # partitions a k-tile occupies (tk, or tk // 2 in double-row)
    rows: int        # 1, or 2 in double-row (the [P, 2, F] middle axis)
    tm: int          # stationary free size (output rows per tile)
    tn: int          # moving free size (output columns per PSUM bank)
    bm: int          # lhsT block columns (output rows per block)
    bn: int          # rhs block columns (output columns per block)
    resident: bool   # rhs block kept for all of K (else both operands stream, for very long K)
    lhs_bufs: int    # lhsT k-tiles in flight


@dataclass(frozen=True)
class _Job:
    """One output matrix ``out[M, N] = A @ B``.

    ``b`` is rhs ``[K, N]``, or ``[N, K]`` with ``tb`` (transposed on chip as each column block is
    loaded: every element once). ``a`` is lhsT ``[K, M]``; with ``a_rows`` (A as given, [M, K])
    A is transposed on chip during the first column block and spilled to ``a`` (an HBM scratch)
    for the later ones, so it too crosses the PE array once."""

    a: HbmAP | None
    b: HbmAP
    out: HbmAP
    m: int
    n: int
    a_rows: HbmAP | None = None
    tb: bool = False


def plan_blocks(m: int, k: int, n: int, dt: Dtype, cfg: ChipConfig, transpose_a: bool = False,
                transpose_b: bool = False) -> _Plan:
    """Block sizes: the widest rhs block that stays resident in SBUF, then as many row tiles as
    PSUM allows.

    PSUM: two blocks' accumulation groups (BM/128 x BN/512 banks each, so one block evacuates
    while the next accumulates) beside the transposes' two banks. SBUF per partition: the rhs
    block (k-tiles x BN), the lhsT k-tiles in flight, four result tiles and, when transposing,
    two groups of 128-row slabs. A wider BN means fewer re-reads of lhsT from HBM; it is capped
    at two banks so a block still has room for two row tiles (longer lhsT DMA runs).
    """
    t = cfg.core.tensor
    double = dt.name.startswith("float8") and t.fp8_double_row
    rows = 2 if double else 1
    parts = t.max_contraction
    tk = parts * rows
    tm = t.stationary_max_free
    tn = min(t.moving_max_free, cfg.core.psum.bank_bytes // 4)
    kt_n = -(-k // tk)
    isz = dt.itemsize * rows
    transposing = transpose_a or transpose_b
    banks = cfg.core.psum.banks - (2 if transposing else 0)
    budget = cfg.core.sbuf.partition_bytes * 15 // 16

    def need(bm: int, bn: int, resident: bool, lhs_bufs: int) -> int:
        rhs = (kt_n if resident else 2 * _GROUP) * bn * isz
        stage = 2 * -(-max(bm, bn) // parts) * _GROUP * tk * dt.itemsize if transposing else 0
        return rhs + lhs_bufs * bm * isz + 4 * bn * 4 + stage

    for resident in (True, False):
        lhs_bufs = min(_LHS_BUFS, 2 * kt_n) if resident else min(2 * _GROUP, 2 * kt_n)
        for bn in range(min(2 * tn, -(-n // tn) * tn), 0, -tn):
            bn = min(bn, n)
            for bm in range(min(max(1, banks // 2 // -(-bn // tn)) * tm, -(-m // tm) * tm), 0, -tm):
                bm = min(bm, m)
                if need(bm, bn, resident, lhs_bufs) <= budget:
                    return _Plan(tk=tk, parts=parts, rows=rows, tm=tm, tn=tn, bm=bm, bn=bn, resident=resident,
                                 lhs_bufs=lhs_bufs)
    raise KernelError(f"matmul: a {tm}x{tn} block does not fit in SBUF on {cfg.name} "
                      f"({cfg.core.sbuf.partition_bytes} bytes per partition)")


@dataclass
class _Mm:
    """One kernel's matmul machinery: pools shared by every (batch, block) it emits."""

    kern: Kernel
    plan: _Plan
    dt: Dtype
    odt: Dtype
    k: int
    lhs_pool: TilePool
    rhs_pool: TilePool
    res_pool: TilePool
    acc_pool: TilePool
    raw_pool: TilePool | None
    tr_pool: TilePool | None
    evacs: int = 0
    # views made before, by what they slice: the same block shapes recur over every block, and
    # a view is immutable (a reference build makes each afresh, as the kernel is written)
    views: ViewCache | None = None
    # replaces evacuation and store of each [ms, nw] row tile: (mm, job, first row, ms, n0, PSUM
    # tiles of the block's banks); a compiled region's ops run there (trnsim.kernels.fused)
    epilogue: Callable[..., None] | None = None
    # row blocks that may be replayed (see replay_block): their start state -> the template
    # block that started in it; None when this kernel's blocks are never replayed
    templates: dict[tuple[object, ...], "_Template"] | None = None
    krow_lists: dict[tuple[object, ...], list[HbmAP]] | None = None  # block_hbm's lhsT views per row block
    calls_of: dict[tuple[int, int, bool], list[tuple[TilePool, int, tuple[int, ...], Dtype]]] = \
        field(default_factory=dict)  # pool_calls by block size

    def evac_engine(self) -> str:
        """Alternate PSUM evacuation between VectorE and ScalarE so both drain in parallel."""
        self.evacs += 1
        return "vector" if self.evacs % 2 else "scalar"

    @property
    def kt_n(self) -> int:
        return -(-self.k // self.plan.tk)

    def ks(self, kt: int) -> int:
        return min(self.plan.tk, self.k - kt * self.plan.tk)

    def kp(self, kt: int) -> int:
        """Partitions holding k-tile ``kt`` (its row pairs in double-row mode)."""
        return -(-self.ks(kt) // self.plan.rows)

    def ktile(self, pool: TilePool, cols: int) -> TileAP:
        p = self.plan
        shape = (p.parts, p.rows, cols) if p.rows == 2 else (p.parts, cols)
        return pool.tile(shape, self.dt)

    def cols(self, tile: TileAP, kt: int, c0: int, c1: int) -> TileAP:
        """The operand view of columns [c0, c1) of a k-tile, as nc_matmul wants it."""
        kp = self.kp(kt)
        return self.view(tile, (kp, c0, c1), lambda: tile[:kp, :, c0:c1] if self.plan.rows == 2 else tile[:kp, c0:c1])

    def view(self, base: TileAP | HbmAP, where: tuple[int, ...], make: Callable[[], TileAP | HbmAP]) -> TileAP | HbmAP:
        """``make()``, a view of ``base`` at ``where``: made once per kernel (views are immutable;
        a tile is known by its allocation's uid, an HBM view by its tensor's), afresh in a
        reference build."""
        if self.views is None:
            self.views = ViewCache(self.kern)
        if type(base) is TileAP:
            key = (base.alloc.uid, base.offset, base.dims, base.dtype.name) + where
        else:
            key = (-base.tensor.uid, base.offset, base.dims) + where
        return self.views.get(key, make)  # type: ignore[no-any-return]

    def krows(self, view: HbmAP, kt: int, c0: int, c1: int) -> HbmAP:
        """``view[k rows of kt, c0:c1]`` (single-row mode), made once per kernel."""
        k0, ks = kt * self.plan.tk, self.ks(kt)
        return self.view(view, (k0, ks, c0, c1), lambda: view[k0:k0 + ks, c0:c1])  # type: ignore[return-value]

    def out_rows(self, out: HbmAP, r0: int, ms: int, n0: int, nw: int) -> HbmAP:
        """``out[r0:r0+ms, n0:n0+nw]``, where a row tile of a block is stored, made once per kernel."""
        return self.view(out, (r0, ms, n0, nw), lambda: out[r0:r0 + ms, n0:n0 + nw])  # type: ignore[return-value]

    # ---- filling k-tiles -------------------------------------------------------------------
    def move(self, tile: TileAP, view: HbmAP, kt: int, c0: int, c1: int, engine: str, queue: int,
             store: bool = False) -> None:
        """DMA between ``view[k rows of kt, c0:c1]`` (a [K, C] view) and ``tile[:, :c1-c0]``:
        a load, or with ``store`` the other way. In double-row mode partition p holds k rows
        2p and 2p+1; an odd last row's partner is zeroed on load so it multiplies as zero."""
        kern, p = self.kern, self.plan
        k0, ks, w = kt * p.tk, self.ks(kt), c1 - c0

        def copy(hbm: HbmAP, region: TileAP) -> None:
            if store:
                kern.dma_copy(hbm, region, engine=engine, queue=queue)
            else:
                kern.dma_copy(region, hbm, engine=engine, queue=queue)

        if p.rows == 1:
            copy(self.krows(view, kt, c0, c1), self.view(tile, (ks, w), lambda: tile[:ks, :w]))
            return
        (s0, _), (s1, _) = view.dims
        pairs = ks // 2
        if ks % 2 and not store:
            kern.memset(tile[:pairs + 1], 0.0)
        if pairs:
            copy(view.tensor.ap(view.offset + k0 * s0 + c0 * s1, [[2 * s0, pairs], [s0, 2], [s1, w]]),
                 tile[:pairs, :, :w])
        if ks % 2:
            copy(view[k0 + ks - 1:k0 + ks, c0:c1], tile[pairs:pairs + 1, 0:1, :w])

    def fill(self, pool: TilePool, src: HbmAP, off: int, width: int, trans: bool, g0: int, g1: int, engine: str,
             queue: int) -> list[TileAP]:
        """New k-tiles ``g0..g1-1`` holding columns ``off:off+width`` of the [K, C] operand: loaded
        from ``src[K, C]``, or (``trans``) from ``src[C, K]`` transposed on chip."""
        cols = self.plan.bm if pool is self.lhs_pool else self.plan.bn  # every buffer of a pool has one shape
        tiles = [self.ktile(pool, cols) for _ in range(g0, g1)]
        if trans:
            for t0 in range(g0, g1, _GROUP):
                t1 = min(g1, t0 + _GROUP)
                self.fill_transposed(tiles[t0 - g0:t1 - g0], src, off, width, t0, t1, engine, queue)
        else:
            for kt, tile in zip(range(g0, g1), tiles):
                self.move(tile, src, kt, off, off + width, engine, queue)
        return tiles

    def fill_transposed(self, tiles: list[TileAP], src: HbmAP, r0: int, nrows: int, g0: int, g1: int, engine: str,
                        queue: int) -> None:
        """Fill k-tiles ``g0..g1-1`` (at most ``_GROUP``) with ``src[r0:r0+nrows, k-range]ᵀ``:
        load 128-row slabs of the k-range, transpose 128x128 blocks on the PE array into one
        PSUM tile per bank of fp32 columns (512), evacuate each to its k-tile."""
        kern, p = self.kern, self.plan
        bank = kern.config.core.psum.bank_bytes // 4
        assert self.raw_pool is not None and self.tr_pool is not None
        tr_dt = "float32" if p.rows == 2 or self.dt.name == "float32" else self.dt.name
        pe = p.parts
        c0, c1 = g0 * p.tk, min(self.k, g1 * p.tk)
        raws = []
        for ri in range(0, nrows, pe):
            rs = min(pe, nrows - ri)
            raw = self.raw_pool.tile((pe, _GROUP * p.tk), self.dt)
            kern.dma_copy(raw[:rs, :c1 - c0], src[r0 + ri:r0 + ri + rs, c0:c1], engine=engine, queue=queue)
            raws.append(raw)
        for kt, tile in zip(range(g0, g1), tiles):
            ks, kp = self.ks(kt), self.kp(kt)
            base = (kt - g0) * p.tk
            if p.rows == 2 and ks % 2:
                kern.memset(tile[:kp], 0.0)
            for r in range(p.rows):
                cnt = (ks - r + p.rows - 1) // p.rows  # k rows of this parity
                if not cnt:
                    continue
                for cb in range(0, nrows, bank):
                    w = min(bank, nrows - cb)
                    ps = self.tr_pool.tile((pe, bank), tr_dt)
                    for ri in range(cb, cb + w, pe):
                        rs = min(pe, nrows - ri)
                        data = raws[ri // pe][:rs, base + r:base + ks:p.rows]
                        kern.nc_transpose(ps[:cnt, ri - cb:ri - cb + rs], data)
                    dst = tile[:cnt, r, cb:cb + w] if p.rows == 2 else tile[:cnt, cb:cb + w]
                    kern.tensor_copy(dst, ps[:cnt, :w], engine=self.evac_engine())

    # ---- output blocks ---------------------------------------------------------------------
    def emit(self, jobs: list[_Job]) -> None:
        """``out = A @ B`` for every job, column block by column block."""
        p = self.plan
        blocks = [(job, n0, min(p.bn, job.n - n0)) for job in jobs for n0 in range(0, job.n, p.bn)]
        if not p.resident:
            for job, n0, nw in blocks:
                for m0 in range(0, job.m, p.bm):
                    mw = min(p.bm, job.m - m0)
                    self.block(job, m0, mw, n0, nw, self.streamer(job, m0, mw, n0, nw, None), None)
            return
        if not self.kern.reference and p.rows == 1 and self.epilogue is None:
            self.templates, self.krow_lists = {}, {}
        pending: list[TileAP] = []
        for bi, (job, n0, nw) in enumerate(blocks):
            rhs = pending or self.fill(self.rhs_pool, job.b, n0, nw, job.tb, 0, self.kt_n, "gpsimd", _RHS_Q)
            nxt = blocks[bi + 1] if bi + 1 < len(blocks) else None
            pending = []
            # operand views are built once per block: slicing costs more than emitting a matmul
            mvs = [[self.cols(rhs[kt], kt, c0, min(nw, c0 + p.tn)) for c0 in range(0, nw, p.tn)]
                   for kt in range(self.kt_n)]
            replayable = self.templates is not None and job.a_rows is None and job.a is not None
            mv_ids = tuple(id(v) for row in mvs for v in row)
            for m0 in range(0, job.m, p.bm):
                mw = min(p.bm, job.m - m0)
                last = m0 + mw == job.m and nxt is not None
                if replayable and not (last and nxt[0].tb):  # type: ignore[index]
                    self.block_or_replay(job, m0, mw, n0, nw, mvs, mv_ids, nxt if last else None, pending)
                    continue

                def roll(kt: int) -> None:
                    """Load the next column block's rhs k-tile into the buffer just done with
                    (a group of them at a time when they come through on-chip transposes)."""
                    assert nxt is not None
                    g0 = kt - kt % _GROUP if nxt[0].tb else kt
                    if nxt[0].tb and kt + 1 < min(self.kt_n, g0 + _GROUP):
                        return
                    pending.extend(self.fill(self.rhs_pool, nxt[0].b, nxt[1], nxt[2], nxt[0].tb, g0, kt + 1, "gpsimd",
                                             _RHS_Q))

                last = m0 + mw == job.m and nxt is not None
                self.block(job, m0, mw, n0, nw, self.streamer(job, m0, mw, n0, nw, mvs), roll if last else None)

    def streamer(self, job: _Job, m0: int, mw: int, n0: int, nw: int, mvs: list[list[TileAP]] | None
                 ) -> Callable[[int], tuple[TileAP, list[TileAP]]]:
        """The operands of k-tile ``kt`` for one block: lhsT k-tiles (and rhs ones, unless the
        resident block's views ``mvs`` are given) load ``_GROUP`` at a time just before use, on
        the Sync engine's queues, which run ahead of TensorE as far as the rotating pools allow."""
        p = self.plan
        cache: dict[int, tuple[TileAP, list[TileAP]]] = {}

        def operands(kt: int) -> tuple[TileAP, list[TileAP]]:
            if kt not in cache:
                cache.clear()
                g1 = min(self.kt_n, kt + _GROUP)
                if job.a_rows is not None and (n0 == 0 or job.a is None):
                    lts = self.fill(self.lhs_pool, job.a_rows, m0, mw, True, kt, g1, "sync", _LHS_Q)
                    if job.a is not None:  # spill for the later column blocks
                        for j, lt in enumerate(lts):
                            self.move(lt, job.a, kt + j, m0, m0 + mw, "gpsimd", _STORE_Q, store=True)
                else:
                    assert job.a is not None
                    lts = self.fill(self.lhs_pool, job.a, m0, mw, False, kt, g1, "sync", _LHS_Q)
                if mvs is None:
                    rts = self.fill(self.rhs_pool, job.b, n0, nw, job.tb, kt, g1, "sync", _RHS_Q)
                    views = [[self.cols(rt, kt + j, c0, min(nw, c0 + p.tn)) for c0 in range(0, nw, p.tn)]
                             for j, rt in enumerate(rts)]
                else:
                    views = mvs[kt:g1]
                for j, (lt, mv) in enumerate(zip(lts, views)):
                    cache[kt + j] = (lt, mv)
            return cache[kt]

        return operands

    def block(self, job: _Job, m0: int, mw: int, n0: int, nw: int,
              operands: Callable[[int], tuple[TileAP, list[TileAP]]], roll: Callable[[int], None] | None) -> None:
        """Accumulate the [mw, nw] output block over K in PSUM, then evacuate and store it.

        k outer: each k-tile's stationary serves every bank of its row before it changes (no
        LoadStationary in between), and each rhs k-tile is done with once per row block, so
        ``roll(kt)`` can refill its buffer behind the compute."""
        kern, p = self.kern, self.plan
        mts = [(mi, min(p.tm, mw - mi)) for mi in range(0, mw, p.tm)]
        widths = [min(nw, c0 + p.tn) - c0 for c0 in range(0, nw, p.tn)]
        accs = [[self.acc_pool.tile((p.tm, p.tn), "float32") for _ in widths] for _ in mts]
        dsts = [[self.view(acc, (ms, w), lambda: acc[:ms, :w]) for acc, w in zip(row, widths)]
                for (_, ms), row in zip(mts, accs)]
        if roll is None and not kern.reference:
            # a group of _GROUP k-tiles at a time: operands(g0) loads the whole group (the later
            # k-tiles' calls load nothing), so its matmuls go to the builder in one call, in the
            # order the loop below would emit them
            for g0 in range(0, self.kt_n, _GROUP):
                ops = []
                for kt in range(g0, min(self.kt_n, g0 + _GROUP)):
                    lhs, mvs = operands(kt)
                    for (mi, ms), row in zip(mts, dsts):
                        st = self.cols(lhs, kt, mi, mi + ms)
                        ops.extend((dst, st, mv, kt > 0) for dst, mv in zip(row, mvs))
                kern.nc_matmul_many(ops)
        else:
            for kt in range(self.kt_n):
                lhs, mvs = operands(kt)
                for (mi, ms), row in zip(mts, dsts):
                    kern.nc_matmul_row(self.cols(lhs, kt, mi, mi + ms), list(zip(row, mvs)), accumulate=kt > 0)
                if roll is not None:
                    roll(kt)
        for (mi, ms), row in zip(mts, dsts):
            if self.epilogue is not None:
                self.epilogue(self, job, m0 + mi, ms, n0, row)
                continue
            res = self.res_pool.tile((p.tm, p.bn), self.odt)
            c0 = 0
            for dst in row:
                w = dst.free_size
                kern.tensor_copy(self.view(res, (ms, c0, w), lambda: res[:ms, c0:c0 + w]), dst,
                                 engine=self.evac_engine())
                c0 += w
            kern.dma_copy(self.out_rows(job.out, m0 + mi, ms, n0, nw), self.view(res, (ms, nw), lambda: res[:ms, :nw]),
                          engine="gpsimd", queue=_STORE_Q)


    # ---- replaying a repeated row block --------------------------------------------------
    # A resident column block's row blocks emit the same instructions up to the HBM views of
    # their DMAs (lhsT loads, output stores and, in the last row block, the next column block's
    # rhs loads) whenever block() would run from the same state: the same sizes and rhs views,
    # the same evacuation parity and the same buffer for each tile() call (pool position and
    # allocation: the view cache then hands out the same on-chip views; it only grows, and the
    # check caches only skip checks that passed). The loaded stationary matters only for the
    # block's first matmul, which Kernel.replay checks. So such a block replays an earlier one
    # (its template) through Kernel.replay, with its own HBM views and the dependency edges the
    # tracker computes from its accesses; the pools and the evacuation count move on as block()
    # would have moved them. The rest (transposed A, a last row block whose next column block
    # is transposed on chip, double-row fp8, an epilogue, the streaming plan, a state not seen
    # yet, any refusal) runs block() itself.

    def block_state(self, mw: int, nw: int, mv_ids: tuple[int, ...], nxt: tuple[_Job, int, int] | None,
                    parity: int, done: bool) -> tuple[object, ...] | None:
        """What decides a row block's instructions besides its HBM views and the loaded
        stationary (Kernel.replay checks that one): its sizes, the rhs views, the evacuation
        parity, with ``nxt`` (the next column block, whose rhs k-tiles this block loads behind
        its matmuls) that block's width, and the buffer each of its tile() calls reuses: the
        pool position and, per call, the allocation of the buffer -- as it is before the block,
        or (``done``) as the block just left it. None when a buffer is not allocated (tile()
        would allocate). A block that allocated its buffers is a template for the later blocks
        that reuse them: tile() hands out the same allocation either way."""
        st: list[object] = [mw, nw, mv_ids, parity, None if nxt is None else nxt[2]]
        for pool, count, _, _ in self.pool_calls(mw, nw, nxt is not None):
            slots, bufs = pool._slots, pool.bufs
            at = (pool._next - count) % bufs if done else pool._next
            st.append(at)
            for i in range(at, at + count):
                t = slots[i % bufs]
                if t is None:
                    return None
                st.append(t.alloc.uid)
        return tuple(st)

    def block_hbm(self, job: _Job, m0: int, mw: int, n0: int, nw: int, nxt: tuple[_Job, int, int] | None
                  ) -> list[HbmAP]:
        """The HBM sides of a row block's DMAs, in emission order: the lhsT loads of k-tiles
        ``_GROUP`` at a time, each followed (with ``nxt``) by the next column block's rhs loads
        of those k-tiles, one after each k-tile's matmuls; then each row tile's store."""
        a, out, p, lists = job.a, job.out, self.plan, self.krow_lists
        assert a is not None
        # the lhsT rows of a block recur in every column block: their krows() list, made once
        # (the same views krows() returns, which the view cache keeps)
        key = (-a.tensor.uid, a.offset, a.dims, m0, mw)
        got = lists.get(key)
        if got is None:
            got = lists[key] = [self.krows(a, kt, m0, m0 + mw) for kt in range(self.kt_n)]
        if nxt is not None:
            b, c0, c1 = nxt[0].b, nxt[1], nxt[1] + nxt[2]  # (once per column block)
            rhs = [self.krows(b, kt, c0, c1) for kt in range(self.kt_n)]
            got = [v for g0 in range(0, self.kt_n, _GROUP)
                   for v in got[g0:g0 + _GROUP] + rhs[g0:g0 + _GROUP]]
        return got + [self.out_rows(out, m0 + mi, min(p.tm, mw - mi), n0, nw) for mi in range(0, mw, p.tm)]

    def pool_calls(self, mw: int, nw: int, roll: bool) -> list[tuple[TilePool, int, tuple[int, ...], Dtype]]:
        """The tile() calls block() makes in each pool: (pool, count, shape, dtype); the rhs
        pool last, when the block rolls the next rhs in."""
        got = self.calls_of.get((mw, nw, roll))
        if got is None:
            got = self.calls_of[(mw, nw, roll)] = self.make_pool_calls(mw, nw, roll)
        return got

    def make_pool_calls(self, mw: int, nw: int, roll: bool) -> list[tuple[TilePool, int, tuple[int, ...], Dtype]]:
        p = self.plan
        n_mt, n_w = -(-mw // p.tm), -(-nw // p.tn)
        return [(self.lhs_pool, self.kt_n, _pool_shape((p.parts, p.bm), "lhsT"), self.dt),
                (self.acc_pool, n_mt * n_w, _pool_shape((p.tm, p.tn), "acc"), _pool_dtype("float32", "acc")),
                (self.res_pool, n_mt, _pool_shape((p.tm, p.bn), "res"), self.odt)] + \
            ([(self.rhs_pool, self.kt_n, _pool_shape((p.parts, p.bn), "rhs"), self.dt)] if roll else [])

    def block_or_replay(self, job: _Job, m0: int, mw: int, n0: int, nw: int, mvs: list[list[TileAP]],
                        mv_ids: tuple[int, ...], nxt: tuple[_Job, int, int] | None, pending: list[TileAP]) -> None:
        """One row block (with ``nxt``, the last of its column block: it loads the next column
        block's rhs k-tiles into ``pending``): replayed from a template when one started in this
        block's state, else block() (kept as a template when it is one)."""
        assert self.templates is not None
        kern = self.kern
        st = self.block_state(mw, nw, mv_ids, nxt, self.evacs & 1, False)
        tpl = self.templates.get(st) if st is not None else None
        if tpl is not None and self.replay_block(tpl, job, m0, mw, n0, nw, nxt, pending):
            return
        i0, ev, had = len(kern.instructions), self.evacs, len(pending)
        roll = None
        if nxt is not None:
            def roll(kt: int) -> None:  # emit()'s roll, for a next block without on-chip transposes
                pending.extend(self.fill(self.rhs_pool, nxt[0].b, nxt[1], nxt[2], False, kt, kt + 1, "gpsimd", _RHS_Q))
        self.block(job, m0, mw, n0, nw, self.streamer(job, m0, mw, n0, nw, mvs), roll)
        if len(self.templates) >= 8:
            return
        st = self.block_state(mw, nw, mv_ids, nxt, ev & 1, True)
        if st is None:
            return
        hbm = self.block_hbm(job, m0, mw, n0, nw, nxt)
        made = kern.instructions[i0:]
        pos = [j for j, x in enumerate(made) if type(x) is DmaCopy
               and (type(x.src) is HbmAP or type(x.dst) is HbmAP)]
        # the template's HBM sides are exactly the views block_hbm names, in that order (the
        # loads' sources, then the stores' destinations)
        n_loads = self.kt_n * (1 if nxt is None else 2)
        if len(pos) != len(hbm) or any(v is not (made[j].src if i < n_loads else made[j].dst)
                                       for i, (j, v) in enumerate(zip(pos, hbm))):
            return
        # each tile() call of the template, in order: (pool, buffer, its allocation, partitions)
        # -- block()'s calls reuse buffers whose allocation fits, so the template's calls made
        # views of these allocations
        slots = []
        calls = self.pool_calls(mw, nw, nxt is not None)
        for pool, count, shape, dt in calls:
            for i in range(count):
                t = pool._slots[(pool._next - count + i) % pool.bufs]
                if t is None:
                    return
                proto = tile_view(t.alloc, shape, dt)
                if (t.p_start, t.p_count, t.offset, t.dims, t.dtype) != \
                        (proto.p_start, proto.p_count, proto.offset, proto.dims, proto.dtype):
                    return
                slots.append((pool, (pool._next - count + i) % pool.bufs, t.alloc, shape[0]))
        rep = kern.replay_template(i0, pos)
        if rep is not None:
            self.templates[st] = _Template(rep, self.evacs - ev, calls, slots)

    def replay_block(self, tpl: "_Template", job: _Job, m0: int, mw: int, n0: int, nw: int,
                     nxt: tuple[_Job, int, int] | None, pending: list[TileAP]) -> bool:
        """Emit ``tpl`` again as the row block at ``m0`` (False, having changed nothing, when the
        kernel refuses: see Kernel.replay); the pools rotate as block()'s tile() calls would,
        the rhs pool's new buffers going to ``pending`` as roll's fill would put them."""
        for pool, j, alloc, parts in tpl.slots:
            old = pool._slots[j]
            if old is None or old.alloc is not alloc or old.p_count != parts:
                return False  # tile() would not reuse the buffer as the template's call did
        if not self.kern.replay(tpl.rep, self.block_hbm(job, m0, mw, n0, nw, nxt)):
            return False
        rhs = self.rhs_pool
        for pool, count, shape, dt in tpl.calls:  # block()'s own tile() calls: each reuses its buffer (checked above)
            for _ in range(count):
                t = pool.tile(shape, dt)
                if pool is rhs:
                    pending.append(t)
        self.evacs += tpl.evacs
        return True


@dataclass
class _Template:
    """A row block to replay: the instructions (:class:`Replay`), the evacuations it made, the
    tile() calls it made per pool (pool, count, shape, dtype: :meth:`_Mm.pool_calls`) and each
    call's buffer (pool, index, allocation, partitions)."""

    rep: Replay
    evacs: int
    calls: list[tuple[TilePool, int, tuple[int, ...], Dtype]]
    slots: list[tuple[TilePool, int, object, int]]


def matmul_out_dtype(name: str, dt: Dtype, out_dtype: str | None) -> Dtype:
    """bf16 out for 16-bit and fp8 inputs, fp32 for fp32 (PSUM holds fp32 either way)."""
    if out_dtype in (None, "", "auto"):
        return get_dtype("float32" if dt.name == "float32" else "bfloat16")
    try:
        return get_dtype(out_dtype)
    except ValueError as e:
        raise KernelError(f"{name}: out_dtype: {e}") from None


def _setup(name: str, m: int, k: int, n: int, dtype: str, config: ChipConfig | str, transpose_a: bool,
           transpose_b: bool, out_dtype: str | None) -> tuple[Kernel, _Mm]:
    for nm, flag in (("transpose_a", transpose_a), ("transpose_b", transpose_b)):
        if not isinstance(flag, (bool, np.bool_)):
            raise KernelError(f"{name}: {nm} must be true or false, got {flag!r}")
    kern = Kernel(name, config)
    cfg = kern.config
    dt = checked_dtype(name, dtype, MATMUL_DTYPES)
    odt = matmul_out_dtype(name, dt, out_dtype)
    plan = plan_blocks(m, k, n, dt, cfg, bool(transpose_a), bool(transpose_b))
    kt_n = -(-k // plan.tk)
    transposing = transpose_a or transpose_b
    mm = _Mm(
        kern=kern, plan=plan, dt=dt, odt=odt, k=k,
        lhs_pool=kern.tile_pool("lhsT", bufs=plan.lhs_bufs),
        rhs_pool=kern.tile_pool("rhs", bufs=kt_n if plan.resident else 2 * _GROUP),
        res_pool=kern.tile_pool("res", bufs=4),
        acc_pool=kern.tile_pool("acc", bufs=2 * (-(-plan.bn // plan.tn)) * (-(-plan.bm // plan.tm)), space="psum"),
        raw_pool=kern.tile_pool("raw", bufs=2 * (-(-max(plan.bm, plan.bn) // plan.parts)))
        if transposing else None,
        tr_pool=kern.tile_pool("tr", bufs=2, space="psum") if transposing else None,
    )
    return kern, mm


_check_dims = checked_dims


# ---- matmul ---------------------------------------------------------------------------------


def mm_inputs(shape, dtype, params, rng):
    m, k, n = shape[-3:]
    batch = tuple(shape[:-3])
    a = (m, k) if params.get("transpose_a") else (k, m)
    b = (n, k) if params.get("transpose_b") else (k, n)
    names = ("a" if params.get("transpose_a") else "lhsT", "b" if params.get("transpose_b") else "rhs")
    return {names[0]: rng.standard_normal(batch + a, dtype=np.float32),
            names[1]: rng.standard_normal(batch + b, dtype=np.float32)}


def mm_reference(inputs, shape, dtype, params):
    a = round_to(inputs["a"], dtype) if "a" in inputs else np.swapaxes(round_to(inputs["lhsT"], dtype), -1, -2)
    b = np.swapaxes(round_to(inputs["b"], dtype), -1, -2) if "b" in inputs else round_to(inputs["rhs"], dtype)
    return {"out": a @ b}


@register_kernel("matmul", dims="MxKxN", dtypes=MATMUL_DTYPES, default_shape=(4096, 4096, 4096),
                 summary="out[M,N] = A @ B from lhsT[K,M] (or a[M,K]) and rhs[K,N] (or b[N,K]); any sizes",
                 params=MATMUL_PARAMS, inputs=mm_inputs, reference=mm_reference,
                 split=lambda shape, params, n: split_dims(*((0, 2) if shape[0] >= shape[2] else (2, 0)))(shape, params, n))
def build_matmul(m: int, k: int, n: int, dtype: str = "bf16", config: ChipConfig | str = "trn2",
                 transpose_a: bool = False, transpose_b: bool = False, out_dtype: str | None = "auto",
                 name: str = "matmul") -> Kernel:
    """Inputs ``lhsT[K, M]`` (or ``a[M, K]`` with ``transpose_a``) and ``rhs[K, N]`` (or
    ``b[N, K]`` with ``transpose_b``); output ``out[M, N]`` in bf16 (fp32 for fp32 inputs)."""
    _check_dims(name, M=m, K=k, N=n)
    kern, mm = _setup(name, m, k, n, dtype, config, transpose_a, transpose_b, out_dtype)
    a_rows = kern.input("a", (m, k), mm.dt).full() if transpose_a else None
    spill = a_rows is None or n > mm.plan.bn
    a = (kern.scratch("lhsT", (k, m), mm.dt) if transpose_a else kern.input("lhsT", (k, m), mm.dt)).full() \
        if spill else None
    b = kern.input("b", (n, k), mm.dt) if transpose_b else kern.input("rhs", (k, n), mm.dt)
    out = kern.output("out", (m, n), mm.odt)
    mm.emit([_Job(a, b.full(), out.full(), m, n, a_rows, bool(transpose_b))])
    return kern


# ---- bmm ------------------------------------------------------------------------------------


@register_kernel("bmm", dims="BxMxKxN", dtypes=MATMUL_DTYPES, default_shape=(8, 1024, 1024, 1024),
                 summary="out[B,M,N] = A[b] @ B[b] per batch, same operand options as matmul",
                 params=MATMUL_PARAMS, inputs=mm_inputs, reference=mm_reference,
                 split=lambda shape, params, n: split_dims(*((0, 1, 3) if shape[1] >= shape[3] else (0, 3, 1)))(shape, params, n))
def build_bmm(batch: int, m: int, k: int, n: int, dtype: str = "bf16", config: ChipConfig | str = "trn2",
              transpose_a: bool = False, transpose_b: bool = False, out_dtype: str | None = "auto",
              name: str = "bmm") -> Kernel:
    """Batched matmul: inputs ``lhsT[B, K, M]`` (or ``a[B, M, K]``) and ``rhs[B, K, N]`` (or
    ``b[B, N, K]``); output ``out[B, M, N]``. Batches share the pools, so batch b+1's loads
    overlap batch b's compute."""
    _check_dims(name, B=batch, M=m, K=k, N=n)
    kern, mm = _setup(name, m, k, n, dtype, config, transpose_a, transpose_b, out_dtype)
    a_rows = kern.input("a", (batch, m, k), mm.dt) if transpose_a else None
    spill = a_rows is None or n > mm.plan.bn
    a = (kern.scratch("lhsT", (batch, k, m), mm.dt) if transpose_a else kern.input("lhsT", (batch, k, m), mm.dt)) \
        if spill else None
    b = kern.input("b", (batch, n, k), mm.dt) if transpose_b else kern.input("rhs", (batch, k, n), mm.dt)
    out = kern.output("out", (batch, m, n), mm.odt)
    mm.emit([_Job(None if a is None else a[i], b[i], out[i], m, n, None if a_rows is None else a_rows[i],
                  bool(transpose_b)) for i in range(batch)])
    return kern
