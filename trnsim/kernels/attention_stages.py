"""The attention kernel's pipeline (:mod:`trnsim.kernels.attention`): its tile pools and the three
stages of a key tile (:class:`Work`), the query tiles, key blocks and steps they carry, the K/V
row loads, and the inputs a score function may read (:func:`parse_score_input`)."""

from __future__ import annotations

import math
from typing import Any, Iterator


from ..isa import HbmAP, HbmTensor, KernelError, TileAP
from ..builder.kernel import Kernel, TilePool, ViewCache
from ..native.dtypes import Dtype, get_dtype

Q_GROUP = 2  # query tiles that walk the keys together (measured best of 1-4 on trn2/trn3)
DEPTH = 3    # pipeline stages in flight, hence buffers per query tile
KV_SHARE = 2  # resident K/V blocks may use 1/2 of each SBUF partition; the rest is working tiles
SCHEDULE_MAX_KEYS = 512  # sequences this short are list-scheduled by default (see the module docstring)
_WORKING_BYTES = 40 * 1024  # SBUF per partition the per-step tiles take (measured: ~38 KiB at fp32, D = 128)


# A score function's inputs after the score (``score_inputs``): the query and key index of each
# score ("q_idx", "kv_idx"), the batch and head index ("b", "h"), and captured tensors read at
# those indices, "buf<i>[<axes>]": buffer i (``score_buffers[i]``: shape, dtype) indexed along
# each of its dims by one of b, h, q, kv (q before kv), e.g. "buf0[h]" (a per-head bias) or
# "buf1[q,kv]" (a bias table). Each is a tile program input of the kind its axes make it.
_INDEX_ROLES = {"q_idx": "full", "kv_idx": "full", "b": "scalar", "h": "scalar"}
_AXES = ("b", "h", "q", "kv")


def parse_score_input(role: Any, buffers: Any) -> tuple[str, int | None, tuple[str, ...]]:
    """(kind, buffer index or None, axes) of one ``score_inputs`` entry, or a KernelError."""
    if role in _INDEX_ROLES:
        return _INDEX_ROLES[role], None, ()
    text = str(role)
    if not (text.startswith("buf") and text.endswith("]") and "[" in text):
        raise KernelError(f"attention: score input {role!r}: expected q_idx, kv_idx, b, h or buf<i>[<axes>]")
    head, _, rest = text[3:-1].partition("[")
    if not head.isdigit() or int(head) >= len(buffers or ()):
        raise KernelError(f"attention: score input {role!r} names no buffer (score_buffers has {len(buffers or ())})")
    axes = tuple(a.strip() for a in rest.split(",") if a.strip())
    shape = buffers[int(head)][0]
    if any(a not in _AXES for a in axes) or len(set(axes)) != len(axes) or len(axes) != len(shape):
        raise KernelError(f"attention: score input {role!r}: one axis (b, h, q or kv) per dim of its "
                          f"{len(shape)}-d buffer, each once")
    if "q" in axes and "kv" in axes and axes.index("q") > axes.index("kv"):
        raise KernelError(f"attention: score input {role!r}: the query axis must come before the key axis")
    kind = "full" if "q" in axes and "kv" in axes else "col" if "q" in axes else "row" if "kv" in axes else "scalar"
    return kind, int(head), axes


def _buffer_strides(shape: Any) -> list[int]:
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * int(shape[i + 1])
    return strides


class KeyBlock:
    """Keys [k0, k0 + n) of one head in SBUF: ``kT`` [D, n] and ``v`` [128, chunks, D] (key
    ``k0 + 128·c + p`` at partition p of chunk c)."""

    def __init__(self, k0: int, n: int, kT: TileAP, v: TileAP):
        self.k0, self.n, self.kT, self.v = k0, n, kT, v


class QueryTile:
    """Queries [q0, q0 + qr) of head (bi, hi), with their running softmax state."""

    def __init__(self, bi: int, hi: int, q0: int, qr: int, qT: TileAP):
        self.bi, self.hi, self.q0, self.qr, self.qT = bi, hi, q0, qr, qT
        self.nm: TileAP | None = None  # -scale · running row max, fp32 [qr, 1]
        self.l: TileAP | None = None   # running sum of exp, fp32 [qr, 1]
        self.o: TileAP | None = None   # running unnormalised output, fp32 [qr, D]


class Step:
    """One (query tile, key tile) step as it moves through stages A, B, C."""

    def __init__(self, qt: QueryTile, kb: KeyBlock, j0: int, kw: int, last: bool):
        self.qt, self.kb, self.j0, self.kw, self.last = qt, kb, j0, kw, last
        self.p: TileAP | None = None
        self.pT: TileAP | None = None
        self.alpha: TileAP | None = None  # None on a query tile's first step


def emit_batches(w: "Work", k: HbmTensor, v: HbmTensor, bi: int, hi: int, blocks: dict[int, int],
                  plan: list[tuple[int, list[tuple[QueryTile, int, int, int]]]], resident_ok: bool
                  ) -> Iterator[list[Step]]:
    """The batches of ``plan`` as steps, loading each key block when the plan reaches it (once,
    and kept for the next groups, when the head has a single block: ``resident_ok``)."""
    last = {id(qt): (k0, j0) for _, batch in plan for qt, k0, j0, _ in batch}
    kb = None
    for k0, batch in plan:
        if not batch:
            continue
        if kb is None or kb.k0 != k0:
            if resident_ok:
                kb = w.resident if w.resident is not None and w.resident_of == (bi, hi) else None
                if kb is None:
                    kb = w.load_block(k, v, bi, hi, k0, blocks[k0])
                    w.resident, w.resident_of = kb, (bi, hi)
            else:
                kb = w.load_block(k, v, bi, hi, k0, blocks[k0])
        yield [Step(qt, kb, j0, kw, last[id(qt)] == (k0, j0)) for qt, _, j0, kw in batch]


def advance(w: "Work", inflight: list[list[Step]], out: HbmTensor) -> None:
    """Issue stage B of the batch after the newest and stage C (then the stores) of the one after."""
    if len(inflight) > 1:
        for st in inflight[1]:
            w.stage_b(st)
    if len(inflight) > 2:
        for st in inflight.pop():
            w.stage_c(st)
            if st.last:
                w.store(out, st.qt)


class Work:
    """The tile pools of one attention kernel and the stages that use them."""

    def __init__(self, kern: Kernel, dt: Dtype, d: int, scale: float, causal: bool):
        t = kern.config.core.tensor
        psum = kern.config.core.psum
        self.kern, self.dt, self.d, self.scale, self.causal = kern, dt, d, scale, causal
        self.tq = min(t.stationary_max_free, t.pe_cols)           # queries per tile: stationary free size
        self.tc = t.pe_rows                                      # keys per transpose and per p·v contraction
        self.tk = min(t.moving_max_free, psum.bank_bytes // 4)   # keys per score tile: one bank of fp32
        self.tk -= self.tk % self.tc
        self.group = psum.bank_bytes // (self.tc * dt.itemsize)  # PE transposes per PSUM bank
        sb = kern.tile_pool
        g, deep = Q_GROUP, Q_GROUP * DEPTH
        self.kT_pool, self.v_pool, self.kstage = sb("kT", DEPTH), sb("v", DEPTH), sb("kstage", 2)
        self.q_pool, self.qT_pool = sb("q", 2 * g), sb("qT", 2 * g)
        self.s_pool, self.red_pool = sb("s", 2 * g), sb("rowmax", 2 * g)
        self.p_pool, self.pT_pool, self.alpha_pool = sb("p", deep), sb("pT", deep), sb("alpha", deep)
        self.nm_pool, self.l_pool, self.sum_pool = sb("nm", deep), sb("l", deep), sb("rowsum", deep)
        self.nm_tile: list[Any] = []  # per query tile instead, when a head's tiles all stay resident
        self.l_tile: list[Any] = []
        self.o_pool, self.res_pool = sb("o", 2 * g), sb("res", 2 * g)
        self.resident: KeyBlock | None = None  # the single key block of a head, kept across groups
        self.resident_of: tuple[int, int] | None = None
        quarter = max(1, psum.banks // 4)  # one bank each: transposes in, scores, pᵀ, p·v
        self.tr_ps, self.s_ps = sb("tr_psum", quarter, space="psum"), sb("s_psum", quarter, space="psum")
        self.pT_ps, self.pv_ps = sb("pT_psum", quarter, space="psum"), sb("pv_psum", quarter, space="psum")
        self.evac = 0
        self.mod: Any = None
        self.dropout = 0.0  # attention dropout (set_dropout)
        # while a group is built to serve as a replay template (Groups): every tile() call as
        # (pool, position, shape, dtype, view), every HBM view of a DMA as (view, what, ...), the
        # key blocks loaded; None otherwise
        self.calls: list[tuple[Any, ...]] | None = None
        # pool views -> the equal view handed out instead (None: the pool's own, in a reference
        # build and with a score function, which do not replay)
        self.canon_of: dict[TileAP, TileAP] | None = None if kern.reference else {}
        self.canon: dict[tuple[Any, ...], TileAP] = {}
        # (a template's slice of its key block, another block's allocation) -> the same slice of it
        self.moved: dict[tuple[TileAP, Any], TileAP] = {}
        self.hbm: list[tuple[Any, ...]] | None = None
        self.new_blocks: list[KeyBlock] | None = None
        # operand slices by (base view, which slice, ints...), made once per kernel
        self.view = ViewCache(kern).get

    def set_dropout(self, p: Any, seed: Any, h: int, s: int) -> None:
        """Attention dropout with probability ``p`` (0: none), draws placed by ``seed`` and each
        score's position in the [B, H, S, S] scores."""
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p < 1.0:
            raise KernelError(f"attention: dropout_p must be a probability in [0, 1), got {p!r}")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise KernelError(f"attention: dropout_seed must be a whole number >= 0, got {seed!r}")
        self.dropout, self.seed, self.heads, self.seq = float(p), seed, h, s

    def set_score_mod(self, program: Any, roles: Any, buffers: Any, b: int, h: int, s: int) -> None:
        """FlexAttention's score function as a tile program: input 0 the score, then ``roles``
        (see ``parse_score_input``; default q_idx, kv_idx) over captured ``buffers``."""
        from .program import FULL, assign_engines, Emitter, step_class

        roles = tuple(roles) if roles is not None else ("q_idx", "kv_idx")
        buffers = tuple(buffers or ())
        kinds = program.kinds()
        parsed = [parse_score_input(r, buffers) for r in roles]
        want = [FULL] + [kd for kd, _, _ in parsed]
        if [k for k, _ in program.inputs] != want or len(program.outputs) != 1:
            raise KernelError(f"attention: score_mod must read the score and its score_inputs ({', '.join(want)}) and "
                              f"write one value")
        if not program.elementwise:
            raise KernelError("attention: score_mod must be elementwise")
        self.mod = program
        self.mod_roles, self.mod_inputs, self.mod_kinds = roles, parsed, kinds
        self.canon_of = None  # no replay (see Groups): the pools' own views
        self.mod_em = Emitter(self.kern, program, kinds, assign_engines([step_class(st, kinds, True) for st in program.steps],
                                                                  [1.0] * len(program.steps), self.kern.config))
        self.mod_bufs = []
        for i, (bshape, bdt) in enumerate(buffers):
            shape = tuple(int(x) for x in bshape)
            self.mod_bufs.append((self.kern.input(f"buf{i}", shape, get_dtype(bdt)), _buffer_strides(shape)))
        for kind, buf, axes in parsed:
            if buf is None:
                continue
            shape = self.mod_bufs[buf][0].shape
            for a, n in zip(axes, shape):
                need = {"b": b, "h": h, "q": s, "kv": s}[a]
                if n < need:
                    raise KernelError(f"attention: score buffer buf{buf} {tuple(shape)}: its {a} dim has {n}, "
                                      f"the kernel indexes {need}")
        used = {a for st in program.steps for a in (st[2:4] if st[0] == "tt" else (st[2],) if st[0] in ("act", "red")
                                                     else (st[1],))}
        self.mod_used = [i for i in range(1, len(program.inputs)) if i in used]
        self.mod_pool = self.kern.tile_pool("score_mod", bufs=3 * max(1, len(program.steps)))
        self.idx_pool = self.kern.tile_pool("score_idx", bufs=4 * max(1, len(self.mod_used)))

    def modified(self, s_ps: TileAP, qt: QueryTile, k0: int, qr: int, kw: int) -> TileAP:
        """``score_mod(scale * s, ...)`` for one [qr, kw] score tile of query tile ``qt``, in SBUF (fp32)."""
        kern, prog = self.kern, self.mod
        q0 = qt.q0
        tiles = {0: self.tile(self.mod_pool, (qr, kw), "fp32")}
        kern.tensor_scalar(tiles[0], s_ps, "multiply", self.scale)
        for i in self.mod_used:
            role, (kind, buf, axes) = self.mod_roles[i - 1], self.mod_inputs[i - 1]
            if role in ("q_idx", "kv_idx"):  # query index: q0 + partition; key index: k0 + column
                is_q = role == "q_idx"
                t = self.tile(self.idx_pool, (qr, kw), "fp32")
                kern.iota(t, base=q0 if is_q else k0, channel_multiplier=1 if is_q else 0, pattern=[0 if is_q else 1])
            elif buf is None:  # the head's batch or head index: the same for every score of the tile
                t = self.tile(self.idx_pool, (qr, 1), "fp32")
                kern.iota(t, base=qt.bi if role == "b" else qt.hi, channel_multiplier=0, pattern=[0])
            else:  # a captured tensor at this tile's indices (per-partition rows, key columns)
                src, strides = self.mod_bufs[buf]
                at = {"b": qt.bi, "h": qt.hi, "q": q0, "kv": k0}
                offset = sum(at[a] * st for a, st in zip(axes, strides))
                sq = strides[axes.index("q")] if "q" in axes else 0
                skv = strides[axes.index("kv")] if "kv" in axes else 1
                cols = kw if kind in ("full", "row") else 1
                t = self.tile(self.idx_pool, (qr, cols), src.dtype)
                kern.dma_copy(t, src.ap(offset, [[sq, qr], [skv, cols]]), queue=3)
            tiles[i] = t
        kinds = self.mod_kinds
        for j in range(len(prog.steps)):
            narrow = kinds[len(prog.inputs) + j] in ("col", "scalar")  # a per-row value: one column
            dst = self.tile(self.mod_pool, (qr, 1 if narrow else kw), "fp32")
            self.mod_em.step(j, dst, tiles, qr, 1, kw, 0)
            tiles[len(prog.inputs) + j] = dst
        return tiles[prog.outputs[0][0]]

    def query_state_fits(self, n_q: int, blk: int) -> bool:
        """Can the running state of ``n_q`` query tiles (qᵀ, o, the max and sum chains) stay in
        SBUF beside two key blocks (one computed on, the next loading) and the working tiles?"""
        per_tile = (self.tq * self.dt.itemsize + self.d * 4 + 3 * 2 * self.kern.config.core.sbuf.allocation_granule)
        block = blk * self.dt.itemsize + -(-blk // self.tc) * self.d * self.dt.itemsize
        working = _WORKING_BYTES
        if self.mod is not None:  # the score function's fp32 [q, key tile] tiles
            working += (3 * max(1, len(self.mod.steps)) + 4) * self.tk * 4
        return n_q * per_tile + 2 * block + working <= self.kern.config.core.sbuf.partition_bytes

    def hold_query_state(self, n_q: int) -> None:
        """Pools deep enough that every query tile of a head keeps its state while the key
        blocks go by (each walks every block before its state is stored); two key blocks."""
        g, deep = Q_GROUP, Q_GROUP * DEPTH
        sb = self.kern.tile_pool
        self.kT_pool, self.v_pool = sb("kT", 2), sb("v", 2)
        self.qT_pool, self.o_pool = sb("qT", n_q + 2 * g), sb("o", n_q + 2 * g)
        # the running max and sum: a pool per query tile. One shared rotating pool would have to
        # outlast every other tile's allocations between two visits of a tile, which is n_q x the
        # key tiles of a block, not n_q (10,048 causal keys reused a live max). nm is read by the
        # tile's next step only; l also by the store, at most DEPTH batches after its last step.
        self.nm_tile = [sb(f"nm{i}", 2) for i in range(n_q)]
        self.l_tile = [sb(f"l{i}", DEPTH + 1) for i in range(n_q)]
        self.sum_pool = sb("rowsum", deep)

    def tile(self, pool: TilePool, shape: tuple[int, ...], dtype: Any) -> TileAP:
        """``pool.tile(shape, dtype)``, as one view object per value (see ``canon``), noted in
        ``calls`` while a group is recorded."""
        canon_of = self.canon_of
        if canon_of is None:
            return pool.tile(shape, dtype)
        i = pool._next
        t = pool.tile(shape, dtype)
        c = canon_of.get(t)
        if c is None:
            c = self.canonical(t)
        if self.calls is not None:
            self.calls.append((pool, i, shape, dtype, c))
        return c

    def canonical(self, t: TileAP) -> TileAP:
        """The view object that stands for every view equal to ``t`` (same allocation, partitions,
        offset, dims, dtype): a pool whose buffer is asked for shapes in turn (PE transposes of
        queries, then of keys) makes a new, equal view at each change, and replaying a group
        needs the views it finds to be the template's objects."""
        key = (t.alloc, t.p_start, t.p_count, t.offset, t.dims, t.dtype.name)
        c = self.canon.get(key)
        if c is None:
            c = self.canon[key] = t
        self.canon_of[t] = c  # type: ignore[index]
        return c

    def _copy(self, dst: TileAP, src: TileAP) -> None:
        """PSUM evacuation, alternating VectorE and ScalarE."""
        self.kern.tensor_copy(dst, src, engine="vector" if self.evac % 2 == 0 else "scalar")
        self.evac += 1

    def load_block(self, k: HbmTensor, v: HbmTensor, bi: int, hi: int, k0: int, n: int) -> KeyBlock:
        """Keys [k0, k0+n) of head (bi, hi): kᵀ through PE transposes, v as 128-key chunks."""
        kern, tc, d, dt = self.kern, self.tc, self.d, self.dt
        chunks = -(-n // tc)
        kT = self.tile(self.kT_pool, (d, n), dt)
        vt = self.tile(self.v_pool, (tc, chunks, d), dt)
        _load_rows(kern, vt, v, bi, hi, k0, n, tc, queue=2, log=self.hbm)
        for c0 in range(0, chunks, self.group):
            g = min(self.group, chunks - c0)
            rows = min(g * tc, n - c0 * tc)
            stage = self.tile(self.kstage, (tc, g, d), dt)
            _load_rows(kern, stage, k, bi, hi, k0 + c0 * tc, rows, tc, queue=1, log=self.hbm)
            ps = self.tile(self.tr_ps, (d, g * tc), dt)
            # nc_transpose(dst, data) for each 128-key chunk, in order
            kern.nc_transpose_many(self.view((ps, stage, rows), lambda: [
                (ps[:, j * tc:j * tc + min(tc, rows - j * tc)], stage[:min(tc, rows - j * tc), j, :]) for j in range(g)]))
            view = self.view
            self._copy(view((kT, 0, c0, rows), lambda: kT[:, c0 * tc:c0 * tc + rows]),
                       view((ps, 2, rows), lambda: ps[:, :rows]))
        kb = KeyBlock(k0, n, kT, vt)
        if self.new_blocks is not None:
            self.new_blocks.append(kb)
        return kb

    def load_queries(self, q: HbmTensor, bi: int, hi: int, q0: int, qr: int) -> TileAP:
        """qᵀ [D, qr] of queries [q0, q0+qr): loaded as rows, transposed on the PE array."""
        rows = self.tile(self.q_pool, (qr, self.d), self.dt)
        src = q[bi, hi, q0:q0 + qr, :]
        if self.hbm is not None:
            self.hbm.append((src, "q", bi, hi, q0, qr))
        self.kern.dma_copy(rows, src, queue=0)
        ps = self.tile(self.tr_ps, (self.d, qr), self.dt)
        self.kern.nc_transpose(ps, rows)
        qT = self.tile(self.qT_pool, (self.d, qr), self.dt)
        self._copy(qT, ps)
        return qT

    def stage_a(self, st: Step) -> None:
        """Scores, running max, p = exp(scale·s + nm) with its row sum, alpha and l."""
        kern, qt, kw = self.kern, st.qt, st.kw
        qr = qt.qr
        kt0 = st.kb.k0 + st.j0
        s_ps = self.tile(self.s_ps, (qr, kw), "fp32")
        kT = st.kb.kT
        kern.nc_matmul(s_ps, qt.qT, self.view((kT, 4, st.j0, kw), lambda: kT[:, st.j0:st.j0 + kw]))
        scores = s_ps
        if self.mod is not None:
            scores = self.modified(s_ps, qt, kt0, qr, kw)
        if self.causal and kt0 + kw - 1 > qt.q0:
            # keep key kt0+i for query q0+p when q0 + p - kt0 - i >= 0; GpSimd reads SBUF only,
            # and only keys from q0 on can be masked
            if scores is s_ps:
                scores = self.tile(self.s_pool, (qr, kw), "fp32")
                kern.tensor_copy(scores, s_ps, engine="vector")
            c0 = max(0, qt.q0 - kt0)
            kern.affine_select(scores[:, c0:], scores[:, c0:], cmp="greater_equal", offset=qt.q0 - kt0 - c0,
                               channel_multiplier=1, pattern=[-1], on_false=-math.inf)
        sc = 1.0 if self.mod is not None else self.scale  # a score function's scores are scaled already
        slot = qt.q0 // self.tq
        nm_pool = self.nm_tile[slot] if self.nm_tile else self.nm_pool
        l_pool = self.l_tile[slot] if self.l_tile else self.l_pool
        nm = self.tile(nm_pool, (qr, 1), "fp32")
        if qt.nm is None:
            kern.tensor_reduce(nm, "max", scores, axis=1, negate=True)
            kern.tensor_scalar(nm, nm, "multiply", sc)
        else:
            neg_max = self.tile(self.red_pool, (qr, 1), "fp32")
            kern.tensor_reduce(neg_max, "max", scores, axis=1, negate=True)
            kern.tensor_scalar(nm, neg_max, "multiply", sc, op1="minimum", operand1=qt.nm)
        st.p = self.tile(self.p_pool, (qr, kw), self.dt)
        rowsum = self.tile(l_pool if qt.l is None else self.sum_pool, (qr, 1), "fp32")
        kern.activation(st.p, "exp", scores, scale=sc, bias=nm, reduce_op="add", reduce_res=rowsum)
        if self.dropout:  # after the row sum: the softmax's denominator counts every key
            s = self.seq
            kern.dropout(st.p, st.p, self.dropout, seed=self.seed,
                         offset=((qt.bi * self.heads + qt.hi) * s + qt.q0) * s + kt0, row_stride=s)
        if qt.nm is not None and qt.l is not None:
            st.alpha = self.tile(self.alpha_pool, (qr, 1), "fp32")
            kern.activation(st.alpha, "exp", qt.nm, scale=-1.0, bias=nm)
            l_new = self.tile(l_pool, (qr, 1), "fp32")
            kern.tensor_scalar(l_new, qt.l, "multiply", st.alpha, op1="add", operand1=rowsum, engine="gpsimd")
            rowsum = l_new
        qt.nm, qt.l = nm, rowsum

    def stage_b(self, st: Step) -> None:
        """pᵀ, 128 keys per PE transpose, copied to SBUF as [128 keys, chunks, qr]."""
        kern, tc, qr, kw = self.kern, self.tc, st.qt.qr, st.kw
        assert st.p is not None
        chunks, full = -(-kw // tc), kw // tc
        ps = self.tile(self.pT_ps, (tc, chunks, qr), self.dt)
        st.pT = pT = self.tile(self.pT_pool, (tc, chunks, qr), self.dt)
        p = st.p

        def operands() -> tuple[list[tuple[TileAP, TileAP]], list[tuple[TileAP, TileAP]]]:
            tr = [(ps[:min(tc, kw - j * tc), j, :], p[:, j * tc:j * tc + min(tc, kw - j * tc)]) for j in range(chunks)]
            copies = [(pT[:, :full, :], ps[:, :full, :])] if full else []
            if full < chunks:
                kc = kw - full * tc
                copies.append((pT[:kc, full, :], ps[:kc, full, :]))
            return tr, copies

        tr, copies = self.view((ps, p, pT, kw), operands)
        kern.nc_transpose_many(tr)  # nc_transpose(dst, data) for each, in order
        for dst, src in copies:
            self._copy(dst, src)

    def stage_c(self, st: Step) -> None:
        """p·v over the key chunks into one PSUM group, then o = o·alpha + p·v."""
        kern, tc, qt, kw = self.kern, self.tc, st.qt, st.kw
        assert st.pT is not None
        pv = self.tile(self.pv_ps, (qt.qr, self.d), "fp32")
        chunks, c0 = -(-kw // tc), st.j0 // tc
        pT, v = st.pT, st.kb.v
        # nc_matmul(pv, pT chunk j, v chunk c0 + j, accumulate=j > 0) for each chunk, in order
        kern.nc_matmul_many(self.view((pv, pT, v, c0, kw), lambda: [
            (pv, pT[:min(tc, kw - j * tc), j, :], v[:min(tc, kw - j * tc), c0 + j, :], j > 0) for j in range(chunks)]))
        if qt.o is None:
            qt.o = self.tile(self.o_pool, (qt.qr, self.d), "fp32")
            kern.tensor_copy(qt.o, pv, engine="vector")
            return
        assert st.alpha is not None
        kern.tensor_scalar(qt.o, qt.o, "multiply", st.alpha, engine="gpsimd")
        kern.tensor_tensor(qt.o, qt.o, pv, "add")

    def store_zeros(self, out: HbmTensor, bi: int, hi: int, q0: int, qr: int) -> None:
        """Zeros for query rows a block mask leaves no key (FlexAttention's output for them)."""
        res = self.tile(self.res_pool, (qr, self.d), self.dt)
        self.kern.memset(res, 0.0, engine="gpsimd")
        self.kern.dma_copy(out[bi, hi, q0:q0 + qr, :], res, engine="gpsimd")

    def store(self, out: HbmTensor, qt: QueryTile) -> None:
        """``out = o / l`` for one query tile, stored on GpSimd's DMA queue."""
        assert qt.o is not None and qt.l is not None
        res = self.tile(self.res_pool, (qt.qr, self.d), self.dt)
        if self.dropout:  # the kept probabilities scaled by 1 / (1 - p) in the same instruction
            self.kern.tensor_scalar(res, qt.o, "divide", qt.l, op1="multiply", operand1=1.0 / (1.0 - self.dropout))
        else:
            self.kern.tensor_scalar(res, qt.o, "divide", qt.l)
        dst = out[qt.bi, qt.hi, qt.q0:qt.q0 + qt.qr, :]
        if self.hbm is not None:
            self.hbm.append((dst, "out", qt))
        self.kern.dma_copy(dst, res, engine="gpsimd")


def row_views(src: HbmTensor, bi: int, hi: int, r0: int, n: int, tc: int) -> list[HbmAP | None]:
    """The HBM sides of :func:`_load_rows`: the whole chunks (or None), the ragged tail (or None)."""
    _, heads, s, d = src.shape
    full, tail = divmod(n, tc)
    base = ((bi * heads + hi) * s + r0) * d
    return [src.ap(base, [[d, tc], [tc * d, full], [1, d]]) if full else None,
            src[bi, hi, r0 + full * tc:r0 + n, :] if tail else None]


def _load_rows(kern: Kernel, dst: TileAP, src: HbmTensor, bi: int, hi: int, r0: int, n: int, tc: int,
               queue: int, log: list[tuple[Any, ...]] | None = None) -> None:
    """Rows [r0, r0+n) of ``src[bi, hi]`` into ``dst`` [tc, chunks, D], row r0 + tc·c + p at
    partition p of chunk c: one DMA for the whole chunks, one for a ragged tail (each HBM view
    noted in ``log`` as (view, "rows", tensor, bi, hi, r0, n, which))."""
    full, tail = divmod(n, tc)
    views = row_views(src, bi, hi, r0, n, tc)
    if views[0] is not None:
        if log is not None:
            log.append((views[0], "rows", src, bi, hi, r0, n, 0))
        kern.dma_copy(dst[:, :full, :], views[0], queue=queue)
    if views[1] is not None:
        if log is not None:
            log.append((views[1], "rows", src, bi, hi, r0, n, 1))
        kern.dma_copy(dst[:tail, full, :], views[1], queue=queue)
