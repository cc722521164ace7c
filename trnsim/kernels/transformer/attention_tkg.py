"""``attention_tkg``: attention for token generation over a KV cache - a few active queries per
sequence (``S_active`` <= 8, speculative decoding's draft length), grouped-query heads, an
in-kernel mask from each sequence's position, sliding window, learned attention sinks and an
optional KV-cache update (the NKI library's ``attention_tkg``, ``nkilib/core/attention/
attention_tkg.py`` and its design spec, commit d2ad3a57).

Layout, as the library's kernel has it: **keys on the partitions**. For one (batch, kv head)
"pair" the ``N = G x S_active`` queries of its ``G`` query heads are the moving operand of
``s = Kᵀ q`` (K stationary, 128 keys a matmul, 64 PE cycles), so the softmax runs over
``[128 keys, tiles, N]`` with ``N`` elements per partition per tile (decode's few queries would
leave 127 of 128 lanes idle with queries on the partitions); the max over keys is a reduction
over tiles, one PE transpose and a reduction over 128; the sum rides along with ``p·v`` as a
matmul with a ones vector; ``oᵀ = vᵀ p`` takes V stationary. Up to 128 query columns of several
pairs share each softmax instruction (a "group").

Keys are cut into chunks (a few thousand keys); each chunk's K and V are loaded once (key
``k0 + p*tiles + t`` at partition ``p``: every partition reads one contiguous run of V, and of K
when it is stored transposed, ``k_layout="bhds"``; ``"bhsd"`` K is loaded with a DMA transpose at
its 90% rate) and the running max, sum and ``oᵀ`` are rescaled as in flash attention. The active
tokens' keys are the last chunk (one tile of ``S_active`` partitions, causal among themselves);
with ``cache_update`` they are scattered into the cache rows at each sequence's position
(indirect DMA, GpSimd's descriptor generation). Chunks of successive groups are
software-pipelined: the loads and ``q kᵀ`` of the next chunk are issued before this chunk's
softmax.

Mask (from ``pos [B]``, the number of cached tokens of each sequence): cached key ``j`` is seen by
active query ``i`` when ``j < pos`` (and ``j > pos + i - window``); active key ``i'`` when
``i' <= i`` (and ``i - i' < window``). Sinks add ``exp(sink[h])`` to the softmax denominator
(gpt-oss's learned sinks).

Inputs ``q [B, NQ, SA, D]``, ``k``/``v [B, NKV, SA, D]`` (the active tokens, RoPE applied),
``k_cache [B, NKV, SP, D]`` (``bhsd``) or ``[B, NKV, D, SP]`` (``bhds``), ``v_cache [B, NKV, SP, D]``,
``pos [B]`` int32, ``sinks [NQ]`` fp32; output ``out [B, NQ, SA, D]`` (and the updated caches).
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

from ...config import ChipConfig
from ...isa import HbmTensor, KernelError, TileAP
from ...builder.kernel import Kernel
from ..reference import round_to
from ..registry import checked_dtype, register_kernel
from .common import BOUNDS, P, Bound, Pools, bcast, choice, online_max, online_rescale, flag, positive, shard_range, shards
from .projection import load_transposed

__all__ = ["build_attention_tkg", "attention_tkg_reference", "attention_tkg_bound"]

DTYPES = ("bf16", "fp16")
PARAMS = {"window": 0, "sinks": False, "k_layout": "bhsd", "cache_update": False, "scale": 0.0, "shard": "0/1"}
NEG = -30000.0  # a masked score: exp(scale * (NEG - max)) is 0 for any unmasked max
_SCORE_BANKS = 2  # PSUM banks of scores per chunk (two chunks in flight: 4 of the 8 banks)
_TR_GROUP = 8  # 128-key tiles of bf16 Kᵀ [D, 128] a 2 KiB PSUM bank holds (the PE-transpose path)


def _scale(scale: Any, d: int) -> float:
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale < 0:
        raise KernelError(f"attention_tkg: scale must be a positive number (0: 1/sqrt(D)), got {scale!r}")
    return float(scale) or 1.0 / math.sqrt(d)


class _Pair:
    """One (batch, kv head): its query columns ``[c0, c0 + n)`` of the group."""

    def __init__(self, b: int, kvh: int, c0: int, n: int):
        self.b, self.kvh, self.c0, self.n = b, kvh, c0, n


@register_kernel("attention_tkg", dims="BxNQxNKVxSAxSPxD", dtypes=DTYPES, default_shape=(4, 4, 1, 1, 2048, 128),
                 summary="decode attention over a KV cache: GQA, in-kernel position mask, sliding window, sinks, "
                         "KV-cache update",
                 params=PARAMS, inputs=lambda s, d, p, g: attention_tkg_inputs(s, d, p, g),
                 reference=lambda i, s, d, p: attention_tkg_reference(i, s, d, p),
                 split=lambda s, p, n: attention_tkg_split(s, p, n))
def build_attention_tkg(b: int, nq: int, nkv: int, sa: int, sp: int, d: int, dtype: str = "bf16",
                        config: ChipConfig | str = "trn2", window: int = 0, sinks: bool = False,
                        k_layout: str = "bhsd", cache_update: bool = False, scale: float = 0.0,
                        shard: str = "0/1", name: str = "attention_tkg") -> Kernel:
    """``shard="i/n"``: physical core ``i`` of an LNC=``n`` logical core attends over its share of
    the cached keys, and the cores combine their partial results (running max, sum, output) by
    one exchange (:func:`attention_tkg_split`; core 0 also takes the active keys, the cache
    update and the store). Values are checked unsharded."""
    positive("attention_tkg", B=b, NQ=nq, NKV=nkv, SA=sa, SP=sp, D=d)
    if nq % nkv:
        raise KernelError(f"attention_tkg: NQ={nq} must be a multiple of NKV={nkv} (grouped-query attention)")
    g = nq // nkv
    npair = g * sa
    if npair > P:
        raise KernelError(f"attention_tkg: {g} query heads per kv head x S_active={sa} = {npair} query columns; at "
                          f"most {P} (use attention_cte for longer active lengths)")
    if sa > P or d > P:
        raise KernelError(f"attention_tkg: S_active={sa} and D={d} must be at most {P}")
    if sp % P:
        raise KernelError(f"attention_tkg: S_prior={sp} must be a multiple of {P} (a cache bucket)")
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise KernelError(f"attention_tkg: window must be a non-negative integer (0: none), got {window!r}")
    sinks = flag("attention_tkg", "sinks", sinks)
    cache_update = flag("attention_tkg", "cache_update", cache_update)
    k_layout = choice("attention_tkg", "k_layout", k_layout, ("bhsd", "bhds"))
    if cache_update and k_layout != "bhsd":
        raise KernelError("attention_tkg: cache_update writes cache rows; it needs k_layout=bhsd")
    sc = _scale(scale, d)
    kern = Kernel(name, config)
    dt = checked_dtype("attention_tkg", dtype, DTYPES)
    cfg = kern.config
    n_sh = int(str(shard).split("/")[1]) if "/" in str(shard) else 1
    lo_t, hi_t = shard_range("attention_tkg", shard, sp // P)
    k_lo, k_hi = lo_t * P, hi_t * P
    first_core = lo_t == 0
    q = kern.input("q", (b, nq, sa, d), dt)
    k = kern.input("k", (b, nkv, sa, d), dt)
    v = kern.input("v", (b, nkv, sa, d), dt)
    kc = kern.input("k_cache", (b, nkv, sp, d) if k_layout == "bhsd" else (b, nkv, d, sp), dt)
    vc = kern.input("v_cache", (b, nkv, sp, d), dt)
    pos = kern.input("pos", (b,), "int32")
    sink_t = kern.input("sinks", (nq,), "fp32") if sinks else None
    out = kern.output("out", (b, nq, sa, d), dt)
    if cache_update:
        kc.kind = vc.kind = "inout"

    pools = Pools(kern)
    # bhsd K on a core without a DMA transpose (trn1): K is loaded as V is (one contiguous run
    # per partition, key k0 + p*tiles + t) and each 128-key tile is transposed on TensorE, eight
    # tiles into one PSUM bank and evacuated by one copy (the library's PE-transpose path); its
    # two transpose banks come out of the scores' (one bank of scores per chunk)
    pe_k = k_layout == "bhsd" and cfg.core.dma.transpose_rate_hbm <= 0
    score_banks = 1 if pe_k else _SCORE_BANKS
    w = _Tkg(kern, pools, dt=dt, b=b, nq=nq, nkv=nkv, g=g, sa=sa, sp=sp, d=d, window=window, scale=sc,
             q=q, k=k, v=v, kc=kc, vc=vc, pos=pos, sinks=sink_t, out=out, bhds=k_layout == "bhds", pe_k=pe_k,
             score_banks=score_banks)
    all_pairs = [(bi, h) for bi in range(b) for h in range(nkv)]
    # keys per chunk: up to 32 tiles of 128 (4096 keys; each chunk pays the softmax's chain of
    # dependent steps once, and a partition's run of V is >= 2 KiB from 8 tiles on); then as many
    # pairs per group (up to 128 query columns) as keep a chunk's K, V and scores within ~40 KiB
    # per partition (three chunks' loads in flight) and its scores within their PSUM banks
    n_tiles = max(1, hi_t - lo_t)
    tiles = min(n_tiles, 32)
    per_pair = tiles * (P + d) * dt.itemsize * 3 // 2 + tiles * npair * 10
    ppg = max(1, min(P // npair, len(all_pairs), 40 * 1024 // per_pair))
    n_tot = ppg * npair
    tiles = max(1, min(tiles, score_banks * (512 // n_tot)))
    groups = [all_pairs[i:i + ppg] for i in range(0, len(all_pairs), ppg)]
    chunks = [(c0, min(tiles * P, k_hi - c0)) for c0 in range(k_lo, k_hi, tiles * P)]
    items: list[tuple[int, Any]] = []
    for gi in range(len(groups)):
        items += [(gi, ck) for ck in chunks]
        if first_core:
            items.append((gi, "active"))
    states: dict[int, Any] = {}
    group_state: dict[int, Any] = {}
    loads: dict[int, Any] = {}

    def load(i: int) -> None:
        if i < len(items) and i not in loads:
            gi, ck = items[i]
            loads[i] = w.load(groups[gi], ck)

    def stage_a(i: int) -> None:
        gi, ck = items[i]
        if gi not in group_state:
            group_state[gi] = w.setup(groups[gi], npair)
        load(i)
        states[i] = w.scores(group_state[gi], ck, loads.pop(i))

    group_state[0] = w.setup(groups[0], npair)  # q and the positions ahead of the first chunks' K and V
    load(0)
    load(1)
    # the cache update's rows and indices (inputs only): loaded now, scattered after every read
    staged = w.stage_update() if cache_update and first_core else []
    stage_a(0)
    for i in range(len(items)):
        load(i + 2)  # K and V two chunks ahead of their scores (the pools hold three)
        if i + 1 < len(items):
            stage_a(i + 1)
        gi, _ = items[i]
        w.softmax_pv(group_state[gi], states.pop(i))
        if i + 1 == len(items) or items[i + 1][0] != gi:
            gs = group_state.pop(gi)
            if n_sh > 1:
                w.combine_peer(gs)
            if first_core:
                w.store(gs)
    # the active tokens' K and V into the cache after every group's reads: the scatter's rows are
    # known only when the kernel runs, so a write between two groups would hold the next group's
    # loads of the same cache behind it (the rows it writes, at and past pos, are masked anyway)
    for j, (idx, krows, vrows) in enumerate(staged):
        w.update_cache(idx, krows, vrows, queue=12 + j % 4)
    return kern


class _Group:
    """A group's query columns and running softmax state: ``m`` [N, 1] (raw-score units), ``l``
    [1, N], ``o`` [D, N] (fp32), and per column the sequence's position."""

    def __init__(self, pairs: list[_Pair], n: int):
        self.pairs, self.n = pairs, n
        self.qT: TileAP | None = None
        self.pos_f: TileAP | None = None      # [128, N] fp32: the column's pos
        self.lower: TileAP | None = None      # [128, N] fp32: the first key in the window (window only)
        self.m: TileAP | None = None
        self.l: TileAP | None = None
        self.o: TileAP | None = None
        self.iq: TileAP | None = None         # [128, N] fp32: the column's active index i


class _Tkg:
    """The instruction emitters of :func:`build_attention_tkg`."""

    def __init__(self, kern: Kernel, pools: Pools, **kw: Any):
        self.kern, self.pools = kern, pools
        self.__dict__.update(kw)
        kern_ = kern
        self.ones_col = kern_.sbuf((P, 1), self.dt, name="ones_col")      # sums p over the keys
        kern_.memset(self.ones_col, 1.0, engine="gpsimd")
        self.flip = 0
        self.evac = 0

    # ---- per group -------------------------------------------------------------------------
    def setup(self, pairs_bk: list[tuple[int, int]], npair: int) -> _Group:
        """qᵀ of the group's columns, their positions, the initial running state."""
        kern, pools, d, sa, g = self.kern, self.pools, self.d, self.sa, self.g
        pairs = [_Pair(bi, h, j * npair, npair) for j, (bi, h) in enumerate(pairs_bk)]
        n = len(pairs) * npair
        gs = _Group(pairs, n)
        # the group's query rows are consecutive rows of q [B*NQ*SA, D]
        r0 = (pairs[0].b * self.nq + pairs[0].kvh * g) * sa
        qr = pools("q_rows", 2).tile((P, d), self.dt)[:n]
        kern.dma_copy(qr, self.q.ap(r0 * d, [[d, n], [1, d]]), queue=8)
        ps = pools("tkg_tr", 1, "psum").tile((P, P), self.dt)[:d, :n]
        kern.nc_transpose(ps, qr)
        gs.qT = pools("qT", 2).tile((P, P), self.dt)[:d, :n]
        kern.tensor_copy(gs.qT, ps, engine="scalar")
        # each column's position (its sequence's cached length), broadcast to the partitions
        pi = pools("pos_i", 2).tile((P, P), "int32")[:, :n]
        for pr in pairs:
            kern.dma_copy(pi[:, pr.c0:pr.c0 + pr.n], self.pos.ap(pr.b, [[0, P], [0, pr.n]]), queue=9)
        gs.pos_f = pools("pos_f", 2).tile((P, P), "fp32")[:, :n]
        kern.tensor_copy(gs.pos_f, pi, engine="gpsimd")
        # the active index i of each column (columns are (pair, head, i))
        gs.iq = pools("iq", 2).tile((P, P), "fp32")[:, :n]
        kern.iota(TileAP(gs.iq.alloc, 0, P, gs.iq.offset, ((sa, n // sa), (1, sa)), gs.iq.dtype),
                  base=0, channel_multiplier=0, pattern=[0, 1])
        if self.window:
            # the first key in the window: pos + i - window + 1
            gs.lower = pools("lower", 2).tile((P, P), "fp32")[:, :n]
            kern.tensor_tensor(gs.lower, gs.pos_f, gs.iq, "add", engine="gpsimd")
            kern.tensor_scalar(gs.lower, gs.lower, "add", float(1 - self.window), engine="gpsimd")
        gs.m = pools("m", 3).tile((P, 1), "fp32")[:n]
        if self.sinks is not None:
            # the sink logit in raw-score units (m starts there and l at exp(0) = 1)
            for pr in pairs:
                for hh in range(g):
                    h = pr.kvh * g + hh
                    kern.dma_copy(gs.m[pr.c0 + hh * sa:pr.c0 + (hh + 1) * sa], self.sinks.ap(h, [[0, sa], [1, 1]]),
                                  queue=9)
            kern.tensor_scalar(gs.m, gs.m, "multiply", 1.0 / self.scale)
        else:
            kern.memset(gs.m, NEG)
        gs.l = pools("l", 3).tile((1, P), "fp32")[:, :n]
        kern.memset(gs.l, 1.0 if self.sinks is not None else 0.0)
        gs.o = pools("o", 3).tile((P, P), "fp32")[:d, :n]
        kern.memset(gs.o, 0.0)
        return gs

    # ---- stage A: loads, scores, mask, the max over tiles ----------------------------------
    def load(self, pairs_bk: list[tuple[int, int]], ck: Any) -> list[tuple[TileAP, TileAP, Any]]:
        """K (as kᵀ [D, keys]) and V ([128, tiles, D], key ``k0 + p*tiles + t`` at partition p) of
        a chunk, for each pair of a group."""
        kern, pools, d, dt = self.kern, self.pools, self.d, self.dt
        npr = 3 * len(pairs_bk)  # every pair's tiles, three chunks in flight
        kv = []
        for bi, kvh in pairs_bk:
            if ck == "active":
                # the active keys: kᵀ [D, SA] by a PE transpose of their rows, v rows [SA, D]
                kr = pools("ka_rows", npr).tile((P, d), dt)[:self.sa]
                kern.dma_copy(kr, self.k[bi, kvh, :, :], queue=10)
                vt = pools("v_act", npr).tile((P, d), dt)[:self.sa]
                kern.dma_copy(vt, self.v[bi, kvh, :, :], queue=11)
                kv.append((kr, vt.reshape(self.sa, 1, d), "active"))
                continue
            k0, nk = ck
            tiles = nk // P
            vt = pools("v", npr).tile((P, tiles, d), dt)
            base = ((bi * self.nkv + kvh) * self.sp + k0) * d
            if self.pe_k:
                # K rows as V's, in pieces of one transpose group's tiles (a run of 8 x D per
                # partition) so the transposes can start on the first piece
                kr = pools("k_rows", npr).tile((P, tiles, d), dt)
                for t0 in range(0, tiles, _TR_GROUP):
                    t1 = min(tiles, t0 + _TR_GROUP)
                    kern.dma_copy(kr[:, t0:t1, :], self.kc.ap(base + t0 * d, [[tiles * d, P], [d, t1 - t0], [1, d]]),
                                  queue=self._q())
                kern.dma_copy(vt, self.vc.ap(base, [[tiles * d, P], [d, tiles], [1, d]]), queue=self._q())
                kv.append((kr, vt, "rows"))
                continue
            kT = pools("kT", npr).tile((P, tiles * P), dt)[:d, :nk]
            # K in pieces of whole key partitions' runs (>= 1024 keys each) so the scores can start
            # on the first piece: keys k0 + p*tiles + t, so piece [p0, p1) of the partitions
            # covers a contiguous key range
            pieces = max(1, min(4, tiles // 8))
            for pc in range(pieces):
                p0, p1 = pc * P // pieces, (pc + 1) * P // pieces
                c0, c1 = p0 * tiles, p1 * tiles
                if self.bhds:
                    kern.dma_copy(kT[:, c0:c1], self.kc.ap(((bi * self.nkv + kvh) * d) * self.sp + k0 + c0,
                                                           [[self.sp, d], [1, c1 - c0]]), queue=self._q())
                else:
                    load_transposed(kern, pools, kT[:, c0:c1], self.kc[bi, kvh, k0 + c0:k0 + c1, :], self._q(),
                                    "tkg_tr")
            kern.dma_copy(vt, self.vc.ap(base, [[tiles * d, P], [d, tiles], [1, d]]), queue=self._q())
            kv.append((kT, vt, None))
        return kv

    def scores(self, gs: _Group, ck: Any, kv: list[tuple[TileAP, TileAP, Any]]) -> tuple[Any, ...]:
        kern, pools, d, dt = self.kern, self.pools, self.d, self.dt
        n = gs.n
        active = ck == "active"
        if active:
            np_, tiles, k0 = self.sa, 1, None
        else:
            k0, nk = ck
            np_, tiles = P, nk // P
        per_bank = max(1, 512 // n)
        n_banks = -(-tiles // per_bank)
        s_ps = [pools("s_ps", 2 * self.score_banks, "psum").tile((P, 512), "fp32") for _ in range(n_banks)]
        # PSUM: 4 banks of scores, 1 of bf16 transposes (q, active k), 1 of fp32 transposes,
        # 1 of broadcasts, 1 of p·v
        if active:
            npr = 2 * len(gs.pairs)
            for j, (kr, vt, _) in enumerate(kv):
                tp = pools("tkg_tr", 1, "psum").tile((P, P), dt)[:d, :self.sa]
                kern.nc_transpose(tp, kr)
                kT = pools("kT_act", npr).tile((P, P), dt)[:d, :self.sa]
                kern.tensor_copy(kT, tp, engine="scalar")
                kv[j] = (kT, vt, kr)
        # s[key, tile, column] = k · q: K stationary (128 keys, key k0 + p*tiles + t at partition p)
        for (kT, _, tag), pr in zip(kv, gs.pairs):
            qT = gs.qT[:, pr.c0:pr.c0 + pr.n]
            if tag == "rows":
                self._scores_pe_k(kT, tiles, per_bank, n, np_, pr, qT, s_ps)
                continue
            for t in range(tiles):
                bank, tl = divmod(t, per_bank)
                dst = s_ps[bank][:np_, tl * n + pr.c0:tl * n + pr.c0 + pr.n]
                st = kT if active else TileAP(kT.alloc, kT.p_start, d, kT.offset + t, ((tiles, P),), kT.dtype)
                kern.nc_matmul(dst, st, qT)
        # mask, out of PSUM into fp32 SBUF: s + NEG where the key is not seen
        s_sb = pools("s_sb", 2).tile((P, tiles * n), "fp32")[:np_]
        if active:
            # causal among the active keys: key i' (partition) for query column (.., i): i - i' >= 0,
            # and inside the window i - i' < window
            s3 = s_sb
            kern.tensor_copy(s3, s_ps[0][:np_, :n], engine="vector")
            pat = [[0, n // self.sa], [1, self.sa]]
            view = TileAP(s3.alloc, s3.p_start, np_, s3.offset, ((self.sa, n // self.sa), (1, self.sa)), s3.dtype)
            kern.affine_select(view, view, cmp="greater_equal", offset=0, channel_multiplier=-1,
                               pattern=[p[0] for p in pat], on_false=NEG)
            if self.window:
                kern.affine_select(view, view, cmp="greater", offset=self.window, channel_multiplier=1,
                                   pattern=[0, -1], on_false=NEG)
        else:
            kidx = pools("kidx", 2).tile((P, tiles), "fp32")
            kern.iota(kidx, base=k0, channel_multiplier=tiles, pattern=[1])
            kb = TileAP(kidx.alloc, kidx.p_start, P, kidx.offset, ((1, tiles), (0, n)), kidx.dtype)
            pb = TileAP(gs.pos_f.alloc, gs.pos_f.p_start, P, gs.pos_f.offset, ((0, tiles), (1, n)), gs.pos_f.dtype)
            bad = pools("bad", 2).tile((P, tiles * n), "fp32")
            bad3 = bad.reshape(P, tiles, n)
            kern.tensor_tensor(bad3, kb, pb, "greater_equal", engine="gpsimd")  # a key at or past pos
            if self.window:
                lb = TileAP(gs.lower.alloc, gs.lower.p_start, P, gs.lower.offset, ((0, tiles), (1, n)),
                            gs.lower.dtype)
                early = pools("early", 2).tile((P, tiles * n), "fp32").reshape(P, tiles, n)
                kern.tensor_tensor(early, kb, lb, "less", engine="gpsimd")  # before the window
                kern.tensor_tensor(bad3, bad3, early, "add", engine="gpsimd")
            for bank in range(n_banks):
                t0, t1 = bank * per_bank, min(tiles, (bank + 1) * per_bank)
                cols = slice(t0 * n, t1 * n)
                kern.scalar_tensor_tensor(s_sb[:, cols], bad[:, cols], "multiply", NEG, "add",
                                          s_ps[bank][:, :(t1 - t0) * n])
        # the max over this chunk's tiles, per (key partition, column)
        red = pools("red", 2).tile((P, P), "fp32")[:np_, :n]
        if tiles == 1:
            kern.tensor_copy(red, s_sb, engine="gpsimd")
        else:
            sv = TileAP(s_sb.alloc, s_sb.p_start, np_, s_sb.offset, ((1, n), (n, tiles)), s_sb.dtype)
            kern.tensor_reduce(red, "max", sv, axis=2)
        return (np_, tiles, s_sb, red, kv)

    def _scores_pe_k(self, kr: TileAP, tiles: int, per_bank: int, n: int, np_: int, pr: _Pair, qT: TileAP,
                     s_ps: list[TileAP]) -> None:
        """The scores of one pair's chunk from K rows ``kr [128, tiles, D]`` (key ``k0 + p*tiles +
        t`` at partition p): tile t's transpose is Kᵀ of keys ``k0 + p*tiles + t``, the stationary
        of score tile t as it is. A group of 8 tiles is transposed into one PSUM bank and
        evacuated by one copy (VectorE and ScalarE in turn); the transposes of group j + 1 are
        issued before the score matmuls of group j, so TensorE transposes while the copy runs."""
        kern, pools, d, dt = self.kern, self.pools, self.d, self.dt
        spans = [(t0, min(tiles, t0 + _TR_GROUP)) for t0 in range(0, tiles, _TR_GROUP)]
        kts: list[TileAP] = []

        def transpose(j: int) -> None:
            t0, t1 = spans[j]
            ps = pools("k_tr", 2, "psum").tile((P, _TR_GROUP * P), dt)[:d, :(t1 - t0) * P]
            kern.nc_transpose_many([(ps[:, (t - t0) * P:(t - t0 + 1) * P], kr[:, t, :]) for t in range(t0, t1)])
            kt = pools("kT_grp", 4).tile((P, _TR_GROUP * P), dt)[:d, :(t1 - t0) * P]
            self.evac += 1
            kern.tensor_copy(kt, ps, engine="vector" if self.evac % 2 else "scalar")
            kts.append(kt)

        transpose(0)
        for j, (t0, t1) in enumerate(spans):
            if j + 1 < len(spans):
                transpose(j + 1)
            for t in range(t0, t1):
                bank, tl = divmod(t, per_bank)
                kern.nc_matmul(s_ps[bank][:np_, tl * n + pr.c0:tl * n + pr.c0 + pr.n],
                               kts[j][:, (t - t0) * P:(t - t0 + 1) * P], qT)

    def _q(self) -> int:
        self.flip += 1
        return self.flip % 4

    # ---- stage B: the chunk's max, exp, p·v, and the running state -------------------------
    def softmax_pv(self, gs: _Group, st: tuple[Any, ...]) -> None:
        kern, pools, d, dt, n, sc = self.kern, self.pools, self.d, self.dt, gs.n, self.scale
        np_, tiles, s_sb, red, kv = st
        # the running max over the key partitions and alpha = exp(scale * (m_old - m_new)), the
        # rescale of what earlier chunks summed, broadcast over the partitions (keys; D)
        m_new, mb, ab = online_max(kern, pools, red, gs.m, n, np_, d, sc, tr_pool="tkg_tr32", m_bufs=3)
        gs.m = m_new
        # p = exp(scale * (s - m)) in the model dtype
        s3 = s_sb.reshape(np_, tiles, n)
        kern.tensor_tensor(s3, s3, TileAP(mb.alloc, mb.p_start, np_, mb.offset, ((0, tiles), (1, n)), mb.dtype),
                           "subtract")
        p = pools("p", 2).tile((P, tiles * n), dt)[:np_]
        kern.activation(p, "exp", s_sb, scale=sc)
        # oᵀ [D, N] += vᵀ p (V stationary) and l [1, N] += onesᵀ p, per pair, accumulated over tiles
        acc = pools("pv_ps", 1, "psum").tile((P, 2 * P), "fp32")
        o_ps, l_ps = acc[:d, :n], acc[:1, P:P + n]
        for (_, vt, _), pr in zip(kv, gs.pairs):
            for t in range(tiles):
                pv = p[:, t * n + pr.c0:t * n + pr.c0 + pr.n]
                kern.nc_matmul(o_ps[:, pr.c0:pr.c0 + pr.n], vt[:np_, t, :], pv, accumulate=t > 0)
            for t in range(tiles):
                pv = p[:, t * n + pr.c0:t * n + pr.c0 + pr.n]
                kern.nc_matmul(l_ps[:, pr.c0:pr.c0 + pr.n], self.ones_col[:np_], pv, accumulate=t > 0)
        # o = o * alpha + oᵀ(chunk), l = l * alpha + l(chunk)
        gs.l = online_rescale(kern, pools, gs.o, gs.l, ab, ab, o_ps, l_ps, n, l_bufs=3)

    # ---- the end of a group --------------------------------------------------------------------
    def combine_peer(self, gs: _Group) -> None:
        """LNC=2 sharing the keys: the peer's (m, l, o) arrive by one DMA (SBUF to SBUF, as
        ``sendrecv``; here this core's own, see :class:`~.common.Exchange`) and are merged:
        ``o = o1 e^(s(m1-m)) + o2 e^(s(m2-m))``, likewise ``l``."""
        kern, pools, n, d, sc = self.kern, self.pools, gs.n, self.d, self.scale
        mine = pools("x_mine", 1).tile((P, 2 * P), "fp32")
        kern.tensor_copy(mine[:d, :n], gs.o, engine="gpsimd")
        peer = pools("x_peer", 1).tile((P, 2 * P), "fp32")
        kern.dma_copy(peer[:d, :n], mine[:d, :n], engine="gpsimd", queue=12)
        pm = pools("x_pm", 1).tile((P, 1), "fp32")[:n]
        kern.dma_copy(pm, gs.m, engine="gpsimd", queue=13)
        # the peer's max equals ours here, so both factors are exp(0); the instructions are the merge's
        m = pools("m", 3).tile((P, 1), "fp32")[:n]
        kern.tensor_tensor(m, gs.m, pm, "max")
        nm = pools("nm", 2).tile((P, 1), "fp32")[:n]
        kern.tensor_scalar(nm, m, "multiply", -sc)
        f = pools("x_f", 1).tile((P, 2), "fp32")[:n]
        kern.activation(f[:, 0:1], "exp", gs.m, scale=sc, bias=nm)
        kern.activation(f[:, 1:2], "exp", pm, scale=sc, bias=nm)
        bc = pools("bcast", 1, "psum").tile((P, 2 * P), "fp32")
        kern.nc_transpose(bc[:d, :n], bcast(f[:, 0:1], d))
        kern.nc_transpose(bc[:d, P:P + n], bcast(f[:, 1:2], d))
        kern.tensor_tensor(gs.o, gs.o, bc[:d, :n], "multiply")
        kern.tensor_tensor(peer[:d, :n], peer[:d, :n], bc[:d, P:P + n], "multiply")
        kern.tensor_tensor(gs.o, gs.o, peer[:d, :n], "add")
        lr = pools("l", 3).tile((1, P), "fp32")[:, :n]
        lp = pools("l", 3).tile((1, P), "fp32")[:, :n]
        kern.tensor_tensor(lr, gs.l, bc[0:1, :n], "multiply")
        kern.tensor_tensor(lp, gs.l, bc[0:1, P:P + n], "multiply")  # the peer's l (here: ours)
        kern.tensor_tensor(lr, lr, lp, "add")
        gs.l, gs.m = lr, m

    def store(self, gs: _Group) -> None:
        """``out = oᵀ / l`` back to query rows, stored (the group's rows are consecutive)."""
        kern, pools, n, d = self.kern, self.pools, gs.n, self.d
        tp = pools("tkg_tr32", 1, "psum").tile((P, 2 * P), "fp32")
        kern.nc_transpose(tp[:n, :d], gs.o)
        kern.nc_transpose(tp[:n, P:P + 1], gs.l)
        rl = pools("rl", 2).tile((P, 1), "fp32")[:n]
        kern.tensor_copy(rl, tp[:n, P:P + 1], engine="vector")
        kern.reciprocal(rl, rl)
        res = pools("res", 2).tile((P, d), self.dt)[:n]
        kern.activation(res, "copy", tp[:n, :d], scale=rl)
        pr = gs.pairs[0]
        r0 = (pr.b * self.nq + pr.kvh * self.g) * self.sa
        kern.dma_copy(self.out.ap(r0 * d, [[d, n], [1, d]]), res, engine="gpsimd", queue=14)

    def stage_update(self) -> list[tuple[TileAP, TileAP, TileAP]]:
        """The cache update's operands, up to 128 rows a block (whole (batch, kv head) pairs):
        the active K and V rows ``[B*NKV*SA, D]`` as they lie in ``k``/``v`` (one load each) and
        each row's cache row ``((b*NKV + kvh)*SP + pos[b] + i``, from ``pos`` (a broadcast load
        per pair) plus an iota per pair."""
        kern, pools, sa, d = self.kern, self.pools, self.sa, self.d
        per = (P // sa) * sa
        total = self.b * self.nkv * sa
        n_blocks = -(-total // per)
        out = []
        for r0 in range(0, total, per):
            n = min(per, total - r0)
            idx = pools("upd_idx", n_blocks).tile((P, 1), "int32")[:n]
            base = pools("upd_base", n_blocks).tile((P, 1), "int32")[:n]
            for j in range(n // sa):
                pair = r0 // sa + j
                kern.dma_copy(idx[j * sa:(j + 1) * sa], self.pos.ap(pair // self.nkv, [[0, sa], [1, 1]]),
                              engine="gpsimd", queue=12 + j % 4)
            if sa == 1:  # row r0 + p is pair r0 + p: its cache row (r0 + p) * SP + pos
                kern.iota(base, base=r0 * self.sp, channel_multiplier=self.sp, pattern=[0])
            else:  # pair * SP + i for row pair * SA + i, a pair at a time (an iota starts at partition 0)
                for j in range(n // sa):
                    one = pools("upd_one", 2).tile((P, 1), "int32")[:sa]
                    kern.iota(one, base=(r0 // sa + j) * self.sp, channel_multiplier=1, pattern=[0])
                    kern.dma_copy(base[j * sa:(j + 1) * sa], one, engine="gpsimd", queue=12 + j % 4)
            kern.tensor_tensor(idx, idx, base, "add", engine="gpsimd")
            rows = []
            for src in (self.k, self.v):
                t = pools(f"upd_{src.name}", n_blocks).tile((P, d), self.dt)[:n]
                kern.dma_copy(t, src.ap(r0 * d, [[d, n], [1, d]]), engine="gpsimd", queue=12 + len(out) % 4)
                rows.append(t)
            out.append((idx, rows[0], rows[1]))
        return out

    def update_cache(self, idx: TileAP, krows: TileAP, vrows: TileAP, queue: int = 15) -> None:
        """The active keys and values into the cache rows ``pos .. pos + SA - 1`` of their sequence
        (indirect DMA: the rows are known when the kernel runs), a block of rows in one scatter
        per cache."""
        for rows, cache in ((krows, self.kc), (vrows, self.vc)):
            self.kern.dma_scatter(cache.reshape(self.b * self.nkv * self.sp, self.d), rows, idx, queue=queue)


def attention_tkg_split(shape: tuple[int, ...], params: Mapping[str, Any], n: int) -> list[Any] | None:
    """LNC=2: the physical cores take half the sequences (or half the kv heads) each; with one
    sequence and one kv head they share the cached keys (``shard``) and merge at the end, as the
    library's kernel shards ``s_prior``."""
    b, nq, nkv, sa, sp, d = shape
    if str(params.get("shard", "0/1")) != "0/1":
        return None
    if b >= n:
        return [(b // n + (1 if i < b % n else 0), nq, nkv, sa, sp, d) for i in range(n)]
    if nkv % n == 0:
        return [(b, nq // n, nkv // n, sa, sp, d)] * n
    if sp // P >= n:
        return [(shape, sh) for sh in shards(n)]
    return None


# ---------------------------------------------------------------------------------------------
# Inputs, reference, bound
# ---------------------------------------------------------------------------------------------


def attention_tkg_inputs(shape: tuple[int, ...], dtype: str, params: Mapping[str, Any], rng: np.random.Generator
                         ) -> dict[str, np.ndarray]:
    b, nq, nkv, sa, sp, d = shape
    p = {**PARAMS, **params}
    g = lambda *s: rng.standard_normal(s, dtype=np.float32)  # noqa: E731
    kc = g(b, nkv, sp, d)
    out = {"q": g(b, nq, sa, d), "k": g(b, nkv, sa, d), "v": g(b, nkv, sa, d),
           "k_cache": kc if p["k_layout"] == "bhsd" else np.ascontiguousarray(kc.transpose(0, 1, 3, 2)),
           "v_cache": g(b, nkv, sp, d),
           "pos": rng.integers(0, sp - sa + 1, size=b).astype(np.int32)}
    if p["sinks"]:
        out["sinks"] = rng.uniform(-1.0, 3.0, nq).astype(np.float32)
    return out


def attention_tkg_reference(inputs: Mapping[str, np.ndarray], shape: tuple[int, ...], dtype: str,
                            params: Mapping[str, Any]) -> dict[str, np.ndarray]:
    b, nq, nkv, sa, sp, d = shape
    p = {**PARAMS, **params}
    g = nq // nkv
    sc = float(p["scale"]) or 1.0 / math.sqrt(d)
    q, k, v = (round_to(inputs[nm], dtype) for nm in ("q", "k", "v"))
    kc = round_to(inputs["k_cache"], dtype)
    if p["k_layout"] == "bhds":
        kc = kc.transpose(0, 1, 3, 2)
    vc = round_to(inputs["v_cache"], dtype)
    pos = inputs["pos"].astype(np.int64)
    window = int(p["window"])
    out = np.zeros((b, nq, sa, d))
    for bi in range(b):
        ps = int(pos[bi])
        for h in range(nq):
            kvh = h // g
            keys = np.concatenate([kc[bi, kvh], k[bi, kvh]])      # [SP + SA, D]
            vals = np.concatenate([vc[bi, kvh], v[bi, kvh]])
            s = (q[bi, h] @ keys.T) * sc                          # [SA, SP + SA]
            j = np.arange(sp + sa)[None, :]
            i = np.arange(sa)[:, None]
            ok = np.where(j < sp, j < ps, (j - sp) <= i)
            if window:
                absk = np.where(j < sp, j, ps + j - sp)
                ok &= absk > ps + i - window
            s = np.where(ok, s, -np.inf)
            mx = s.max(axis=1, keepdims=True)
            if p["sinks"]:
                mx = np.maximum(mx, float(inputs["sinks"][h]))
            e = np.exp(s - mx)
            den = e.sum(axis=1, keepdims=True)
            if p["sinks"]:
                den += np.exp(float(inputs["sinks"][h]) - mx)
            out[bi, h] = (e / den) @ vals
    res = {"out": round_to(out, dtype)}
    if p["cache_update"]:
        kc_new, vc_new = kc.copy(), vc.copy()
        for bi in range(b):
            ps = int(pos[bi])
            if not 0 <= ps <= sp - sa:  # (the kernel's scatter would write into the next sequence's rows)
                raise KernelError(f"attention_tkg: cache_update: pos[{bi}] = {ps} leaves no room for {sa} active "
                                  f"rows in a cache of {sp}; expected 0 <= pos <= {sp - sa}")
            kc_new[bi, :, ps:ps + sa] = k[bi]
            vc_new[bi, :, ps:ps + sa] = v[bi]
        res["k_cache"], res["v_cache"] = kc_new, vc_new
    return res


def attention_tkg_bound(shape: tuple[int, ...], dtype: str, params: Mapping[str, Any]) -> Bound:
    """The cache read once (K and V), the active q/k/v and the output; q·k and p·v FLOPs."""
    b, nq, nkv, sa, sp, d = shape
    cache = 2 * b * nkv * sp * d * 2
    act = 2 * (b * nq * sa * d * 2 + 2 * b * nkv * sa * d)
    upd = 2 * 2 * b * nkv * sa * d if params.get("cache_update") else 0
    return Bound(cache + act + upd, 4 * b * nq * sa * (sp + sa) * d)


BOUNDS["attention_tkg"] = attention_tkg_bound
