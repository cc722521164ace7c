"""``attention_cte``: attention for context encoding (prefill) - flash-style, causal, sliding
window, learned sinks, native grouped-query heads (the NKI library's ``attention_cte``,
``nkilib/core/attention/attention_cte.py``, commit d2ad3a57).

Per (batch, kv head) K and V stay in SBUF (``Kᵀ [D, S]`` by DMA transposes, V as 128-key
chunks) while every query tile of the group's ``G`` query heads goes by, so a kv head's K and V
are read once for all its query heads. A query tile (128 queries on the partitions) walks its
keys - those before it (causal), from ``window`` back (sliding window) - in sections of 2048,
with the flash rescaling of its running max, sum and output between sections:

1. **scores**: TensorE ``s = q kᵀ`` a PSUM bank (512 keys) at a time; each bank leaves PSUM on
   ScalarE with the row max fused (``activation(copy, reduce max)``) or on VectorE (copy, then
   the max), alternately; tiles cut by the diagonal or the window are masked on GpSimd
   (``affine_select``) first;
2. **softmax**: ScalarE ``p = exp(scale·s - scale·m)`` over the section with the row sum fused;
3. **p·v**: ``pᵀ`` by PE transposes (eight to a PSUM bank, evacuated by VectorE), then ``p v``
   accumulated in one PSUM bank over the section's 128-key chunks; ``o = o·alpha + p v``.

Units of (query tile, section) are software-pipelined three deep in program order (the scores
of unit ``i+2``, the softmax of ``i+1``, the p·v of ``i``), as the library's kernel overlaps its
query groups. TensorE does ``3 x keys`` cycles per query tile (q kᵀ, the transposes, p v) for
``2 x keys`` cycles of FLOPs at D = 128, so the kernel's ceiling is ~2/3 of the TensorE peak.

Inputs ``q [B, NQ, S, D]``, ``k``/``v [B, NKV, S, D]``, ``sinks [NQ]`` fp32; output ``out [B, NQ, S, D]``.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

from ...config import ChipConfig
from ...isa import KernelError, TileAP
from ...builder.kernel import Kernel
from ..reference import round_to
from ..registry import checked_dtype, register_kernel
from .common import BOUNDS, P, Bound, Pools, flag, positive, shards
from .projection import load_transposed

__all__ = ["build_attention_cte", "attention_cte_reference", "attention_cte_bound"]

DTYPES = ("bf16", "fp16")
PARAMS = {"causal": True, "window": 0, "sinks": False, "scale": 0.0, "prior": 0, "shard": "0/1"}
SECTION = 2048   # keys a query tile takes per step (scores fp32 8 KiB per partition)
DEPTH = 4        # steps in flight (scores of i+3, softmax of i+2 .., p·v of i)
KT = 512         # keys per q kᵀ matmul (one PSUM bank of fp32)
NEG = -30000.0


@register_kernel("attention_cte", dims="BxNQxNKVxSxD", dtypes=DTYPES, default_shape=(1, 4, 1, 2048, 128),
                 summary="prefill flash attention: causal, sliding window, sinks, native GQA (K/V read once per kv head)",
                 params=PARAMS, inputs=lambda s, d, p, g: attention_cte_inputs(s, d, p, g),
                 reference=lambda i, s, d, p: attention_cte_reference(i, s, d, p),
                 split=lambda s, p, n: attention_cte_split(s, p, n))
def build_attention_cte(b: int, nq: int, nkv: int, s: int, d: int, dtype: str = "bf16",
                        config: ChipConfig | str = "trn2", causal: bool = True, window: int = 0,
                        sinks: bool = False, scale: float = 0.0, prior: int = 0, shard: str = "0/1",
                        name: str = "attention_cte") -> Kernel:
    """``shard="i/n"``: physical core ``i`` of an LNC=``n`` logical core takes query tiles
    ``i, i+n, i+2n, ...`` (interleaved, so causal work is shared evenly; :func:`attention_cte_split`).
    ``prior``: keys already cached before the ``S`` new tokens (a chunked prefill's earlier chunks,
    a cached prefix): K and V hold ``prior + S`` keys and query ``i`` sits at position ``prior + i``
    (the library kernel's prefix-cache mode)."""
    positive("attention_cte", B=b, NQ=nq, NKV=nkv, S=s, D=d)
    if nq % nkv:
        raise KernelError(f"attention_cte: NQ={nq} must be a multiple of NKV={nkv} (grouped-query attention)")
    if d > P:
        raise KernelError(f"attention_cte: head dim D={d} must be at most {P}")
    causal, sinks = flag("attention_cte", "causal", causal), flag("attention_cte", "sinks", sinks)
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise KernelError(f"attention_cte: window must be a non-negative integer (0: none), got {window!r}")
    if window and not causal:
        raise KernelError("attention_cte: a sliding window needs causal=true (as the library's kernel)")
    if isinstance(prior, bool) or not isinstance(prior, int) or prior < 0:
        raise KernelError(f"attention_cte: prior must be a non-negative integer (keys cached before the S new "
                          f"tokens), got {prior!r}")
    if prior and not causal:
        raise KernelError("attention_cte: prior keys need causal=true (the new tokens follow them)")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale < 0:
        raise KernelError(f"attention_cte: scale must be a positive number (0: 1/sqrt(D)), got {scale!r}")
    sc = float(scale) or 1.0 / math.sqrt(d)
    try:
        i_sh, n_sh = (int(x) for x in str(shard).split("/"))
        assert 0 <= i_sh < n_sh
    except (ValueError, AssertionError):
        raise KernelError(f"attention_cte: shard must be 'i/n' with 0 <= i < n, got {shard!r}") from None
    kern = Kernel(name, config)
    dt = checked_dtype("attention_cte", dtype, DTYPES)
    cfg = kern.config
    g = nq // nkv
    keys = prior + s
    chunks = -(-keys // P)
    kv_bytes = (keys + chunks * d) * dt.itemsize  # Kᵀ and V per partition, one kv head
    work = DEPTH * SECTION * (4 + 2 + 2) + 24 * 1024
    cap = cfg.core.sbuf.partition_bytes
    if kv_bytes + work > cap:
        smax = (cap - work) // ((1 + d / P) * dt.itemsize)
        raise KernelError(f"attention_cte: {keys} keys of K and V do not fit SBUF on {cfg.name} beside the "
                          f"working tiles; prior + S must be at most {int(smax)}")
    kv_bufs = 2 if 2 * kv_bytes + work <= cap else 1
    q = kern.input("q", (b, nq, s, d), dt)
    k = kern.input("k", (b, nkv, keys, d), dt)
    v = kern.input("v", (b, nkv, keys, d), dt)
    sink_t = kern.input("sinks", (nq,), "fp32") if sinks else None
    out = kern.output("out", (b, nq, s, d), dt)
    pools = Pools(kern)
    w = _Cte(kern, pools, dt=dt, s=keys, d=d, g=g, nkv=nkv, scale=sc, causal=causal, window=window, q=q, out=out,
             sinks=sink_t, kv_bufs=kv_bufs, prior=prior)

    # the units: per (batch, kv head): its K and V, then per query head and query tile, per section
    units: list[tuple[Any, ...]] = []
    for bi in range(b):
        for kvh in range(nkv):
            kv_key = (bi, kvh)
            for hh in range(g):
                h = kvh * g + hh
                for qt in range(i_sh, -(-s // P), n_sh):  # the query tiles
                    q0, qr = qt * P, min(P, s - qt * P)
                    hi = prior + q0 + qr if causal else keys
                    lo = max(0, prior + q0 - window + 1) // P * P if window else 0
                    secs = [(k0, min(SECTION, hi - k0)) for k0 in range(lo, hi, SECTION)]
                    item = _Item(bi, h, q0, qr)
                    for si, sec in enumerate(secs):
                        units.append((kv_key, item, sec, si == 0, si == len(secs) - 1))
    loaded: dict[tuple[int, int], Any] = {}
    st: dict[int, Any] = {}
    last_unit = {u[0]: i for i, u in enumerate(units)}  # each pair's K and V are read up to its last unit's p·v
    held: list[tuple[int, int]] = []  # the pairs in the K/V buffers, oldest first (kv_bufs of them)
    done = [0, 0]  # units whose softmax / p·v have been emitted

    def s1(i: int) -> None:
        kv_key, item, sec, first, last = units[i]
        if kv_key not in loaded:
            if len(held) == w.kv_bufs:
                # the load takes the buffers of the oldest pair held: its last units' softmax and
                # p·v go first, or they would read this pair's K and V (a pair of fewer units than
                # the pipeline is deep, or one buffer of each: found by a values hunt, errors up to
                # 1.9x the largest output)
                drain(last_unit[held.pop(0)])
            loaded.clear()
            loaded[kv_key] = w.load_kv(k, v, *kv_key)
            held.append(kv_key)
        st[i] = w.scores(loaded[kv_key], item, sec, first)

    def s2(i: int) -> None:
        st[i] = w.softmax(units[i][1], st[i])

    def s3(i: int) -> None:
        kv_key, item, sec, first, last = units[i]
        w.pv(loaded.get(kv_key) or w.kv_of[kv_key], item, st.pop(i), first, last)

    n = len(units)

    def advance(soft: int, pv: int) -> None:
        """Emit, in order, the softmax of every unit up to ``soft`` and then the p·v of every unit
        up to ``pv`` not emitted yet."""
        while done[0] <= min(soft, n - 1):
            s2(done[0])
            done[0] += 1
        while done[1] <= min(pv, n - 1):
            s3(done[1])
            done[1] += 1

    def drain(upto: int) -> None:
        advance(upto, upto)

    for step in range(n + DEPTH - 1):  # scores DEPTH-1 steps ahead of p·v, the softmax in between
        if step < n:
            s1(step)
        advance(step - (DEPTH - 2), step - (DEPTH - 1))
    return kern


class _Item:
    """A query tile of one head: ``qr`` queries from ``q0``; its running state across sections."""

    def __init__(self, b: int, h: int, q0: int, qr: int):
        self.b, self.h, self.q0, self.qr = b, h, q0, qr
        self.qT: TileAP | None = None
        self.m: TileAP | None = None   # running max (raw scores) [qr, 1]
        self.l: TileAP | None = None   # running sum [qr, 1]
        self.o: TileAP | None = None   # running output [qr, D] fp32


class _Cte:
    def __init__(self, kern: Kernel, pools: Pools, **kw: Any):
        self.kern, self.pools = kern, pools
        self.__dict__.update(kw)
        self.kv_of: dict[tuple[int, int], Any] = {}
        self.flip = 0

    def load_kv(self, k: Any, v: Any, bi: int, kvh: int) -> tuple[TileAP, TileAP]:
        """Kᵀ [D, S] (DMA transposes, 1024 keys each) and V [128, chunks, D] (key c*128 + p)."""
        kern, pools, s, d, dt = self.kern, self.pools, self.s, self.d, self.dt
        chunks = -(-s // P)
        kT = pools("kT", self.kv_bufs).tile((P, s), dt)[:d]
        for c0 in range(0, s, 1024):
            c1 = min(s, c0 + 1024)
            load_transposed(kern, pools, kT[:, c0:c1], k[bi, kvh, c0:c1, :], (c0 // 1024) % 2, "q_tr")
        vt = pools("v", self.kv_bufs).tile((P, chunks, d), dt)
        full = s // P
        if full:
            kern.dma_copy(vt[:, :full, :], v.ap((bi * self.nkv + kvh) * s * d, [[d, P], [P * d, full], [1, d]]),
                          queue=2)
        if s % P:
            kern.dma_copy(vt[:s % P, full, :], v[bi, kvh, full * P:s, :], queue=2)
        self.kv_of[(bi, kvh)] = (kT, vt)
        return kT, vt

    # ---- 1: scores, masked, with their row max --------------------------------------------
    def scores(self, kv: tuple[TileAP, TileAP], it: _Item, sec: tuple[int, int], first: bool) -> tuple[Any, ...]:
        kern, pools, d, dt = self.kern, self.pools, self.d, self.dt
        kT, _ = kv
        qr = it.qr
        if first:  # qᵀ [D, qr]: the rows, transposed on TensorE
            rows = pools("q_rows", DEPTH).tile((P, d), dt)[:qr]
            kern.dma_copy(rows, self.q[it.b, it.h, it.q0:it.q0 + qr, :], queue=3)
            tp = pools("q_tr", 1, "psum").tile((P, P), dt)[:d, :qr]
            kern.nc_transpose(tp, rows)
            it.qT = pools("qT", DEPTH + 1).tile((P, P), dt)[:d, :qr]
            kern.tensor_copy(it.qT, tp, engine="vector")
        k0, nk = sec
        nt = -(-nk // KT)
        parts = pools("mx_parts", DEPTH).tile((P, SECTION // KT), "fp32")[:qr, :nt]
        s_sb = pools("s_sb", DEPTH).tile((P, SECTION), "fp32")[:qr, :nk]
        for j in range(nt):
            c0, c1 = j * KT, min(nk, (j + 1) * KT)
            ps = pools("s_ps", 4, "psum").tile((P, KT), "fp32")[:qr, :c1 - c0]
            kern.nc_matmul(ps, it.qT, kT[:, k0 + c0:k0 + c1])
            dst = s_sb[:, c0:c1]
            kf, kl = k0 + c0, k0 + c1 - 1  # first and last key of the tile
            qf, ql = self.prior + it.q0, self.prior + it.q0 + qr - 1  # the queries' positions
            diag = self.causal and kl > qf                 # some key after some query
            edge = self.window and kf <= ql - self.window  # some key before some query's window
            if diag or edge:
                # out of PSUM on VectorE, masked on GpSimd (which reads SBUF only), then the max
                kern.tensor_copy(dst, ps, engine="vector")
                if diag:  # keep key <= query: (q0 + p) - (kf + i) >= 0
                    kern.affine_select(dst, dst, cmp="greater_equal", offset=qf - kf, channel_multiplier=1,
                                       pattern=[-1], on_false=NEG)
                if edge:  # keep key > query - window: (kf + i) - (q0 + p) + window > 0
                    kern.affine_select(dst, dst, cmp="greater", offset=kf - qf + self.window, channel_multiplier=-1,
                                       pattern=[1], on_false=NEG)
                kern.tensor_reduce(parts[:, j:j + 1], "max", dst, axis=1)
            else:  # ScalarE: out of PSUM with the row max fused
                kern.activation(dst, "copy", ps, reduce_op="max", reduce_res=parts[:, j:j + 1])
        return (s_sb, parts, k0, nk)

    # ---- 2: the section's softmax -------------------------------------------------------------
    def softmax(self, it: _Item, st: tuple[Any, ...]) -> tuple[Any, ...]:
        kern, pools, sc, qr = self.kern, self.pools, self.scale, it.qr
        s_sb, parts, k0, nk = st
        m_new = pools("m", 3 * DEPTH).tile((P, 1), "fp32")[:qr]
        kern.tensor_reduce(m_new, "max", parts, axis=1)
        if it.m is None and self.sinks is not None:
            # the sink logit (raw units) is where the running max starts
            m0 = pools("m0", 3 * DEPTH).tile((P, 1), "fp32")[:qr]
            kern.dma_copy(m0, self.sinks.ap(it.h, [[0, qr], [1, 1]]), queue=3)
            kern.tensor_scalar(m0, m0, "multiply", 1.0 / sc)
            it.m = m0
        if it.m is not None:
            kern.tensor_tensor(m_new, m_new, it.m, "max")
        nm = pools("nm", 3 * DEPTH).tile((P, 1), "fp32")[:qr]
        kern.tensor_scalar(nm, m_new, "multiply", -sc)
        alpha = None
        if it.m is not None:
            alpha = pools("alpha", 3 * DEPTH).tile((P, 1), "fp32")[:qr]
            kern.activation(alpha, "exp", it.m, scale=sc, bias=nm)
        p = pools("p", DEPTH).tile((P, SECTION), self.dt)[:qr, :nk]
        rs = pools("rowsum", 3 * DEPTH).tile((P, 1), "fp32")[:qr]
        kern.activation(p, "exp", s_sb, scale=sc, bias=nm, reduce_op="add", reduce_res=rs)
        it.m = m_new
        return (p, rs, alpha, k0)

    # ---- 3: pᵀ, p·v, the running output ----------------------------------------------------
    def pv(self, kv: tuple[TileAP, TileAP], it: _Item, st: tuple[Any, ...], first: bool, last: bool) -> None:
        kern, pools, d, dt, qr = self.kern, self.pools, self.d, self.dt, it.qr
        _, vt = kv
        p, rs, alpha, k0 = st
        nk = p.free_size
        chunks = -(-nk // P)
        pT = pools("pT", DEPTH).tile((P, SECTION // P, P), dt)
        for c0 in range(0, chunks, 8):  # eight 128 x 128 transposes to a PSUM bank
            cn = min(8, chunks - c0)
            tp = pools("p_tr", 2, "psum").tile((P, 8, P), dt)
            pairs = []
            for c in range(c0, c0 + cn):
                kw = min(P, nk - c * P)
                pairs.append((tp[:kw, c - c0, :qr], p[:, c * P:c * P + kw]))
            kern.nc_transpose_many(pairs)
            full = sum(1 for c in range(c0, c0 + cn) if min(P, nk - c * P) == P)
            eng = "vector"  # ScalarE has the scores' evacuations and the exps
            if full:
                kern.tensor_copy(pT[:, c0:c0 + full, :qr], tp[:, :full, :qr], engine=eng)
            for c in range(c0 + full, c0 + cn):
                kw = nk - c * P
                kern.tensor_copy(pT[:kw, c, :qr], tp[:kw, c - c0, :qr], engine=eng)
        o_ps = pools("o_ps", 1, "psum").tile((P, P), "fp32")[:qr, :d]
        for c in range(chunks):
            kw = min(P, nk - c * P)
            key = k0 + c * P  # the section's chunk c (sections start at multiples of 128)
            kern.nc_matmul(o_ps, pT[:kw, c, :qr], vt[:kw, key // P, :], accumulate=c > 0)
        if first:
            it.o = pools("o", DEPTH + 1).tile((P, d), "fp32")[:qr]
            it.l = pools("l", 2 * DEPTH).tile((P, 1), "fp32")[:qr]
            if alpha is None:
                kern.tensor_copy(it.o, o_ps, engine="vector")
                kern.tensor_copy(it.l, rs, engine="gpsimd")
            else:  # sinks: l starts at exp(sink - m) (alpha), o at 0
                kern.tensor_copy(it.o, o_ps, engine="vector")
                kern.tensor_tensor(it.l, alpha, rs, "add", engine="gpsimd")
        else:
            kern.scalar_tensor_tensor(it.o, it.o, "multiply", alpha, "add", o_ps)
            kern.tensor_scalar(it.l, it.l, "multiply", alpha, op1="add", operand1=rs, engine="gpsimd")
        if last:
            res = pools("res", 3).tile((P, d), dt)[:qr]
            kern.tensor_scalar(res, it.o, "divide", it.l)
            kern.dma_copy(self.out[it.b, it.h, it.q0:it.q0 + qr, :], res, engine="gpsimd", queue=4)


def attention_cte_split(shape: tuple[int, ...], params: Mapping[str, Any], n: int) -> list[Any] | None:
    """LNC=2: the physical cores take half the sequences, or half the kv heads, or else every
    other query tile (interleaved, so the causal work is even), each loading the kv head's K and V."""
    b, nq, nkv, s, d = shape
    if str(params.get("shard", "0/1")) != "0/1":
        return None
    if b >= n:
        return [(b // n + (1 if i < b % n else 0), nq, nkv, s, d) for i in range(n)]
    if nkv % n == 0:
        return [(b, nq // n, nkv // n, s, d)] * n
    if -(-s // P) >= n:
        return [(shape, sh) for sh in shards(n)]
    return None


def attention_cte_inputs(shape: tuple[int, ...], dtype: str, params: Mapping[str, Any], rng: np.random.Generator
                         ) -> dict[str, np.ndarray]:
    b, nq, nkv, s, d = shape
    keys = int(params.get("prior", 0)) + s
    out = {"q": rng.standard_normal((b, nq, s, d), dtype=np.float32),
           "k": rng.standard_normal((b, nkv, keys, d), dtype=np.float32),
           "v": rng.standard_normal((b, nkv, keys, d), dtype=np.float32)}
    if params.get("sinks"):
        out["sinks"] = rng.uniform(-1.0, 3.0, nq).astype(np.float32)
    return out


def attention_cte_reference(inputs: Mapping[str, np.ndarray], shape: tuple[int, ...], dtype: str,
                            params: Mapping[str, Any]) -> dict[str, np.ndarray]:
    b, nq, nkv, s, d = shape
    p = {**PARAMS, **params}
    g = nq // nkv
    sc = float(p["scale"]) or 1.0 / math.sqrt(d)
    q, k, v = (round_to(inputs[nm], dtype) for nm in ("q", "k", "v"))
    prior = int(p["prior"])
    i = np.arange(s)[:, None] + prior  # the queries' positions
    j = np.arange(prior + s)[None, :]
    ok = np.ones((s, prior + s), dtype=bool)
    if p["causal"]:
        ok &= j <= i
    if p["window"]:
        ok &= j > i - int(p["window"])
    out = np.zeros((b, nq, s, d))
    for bi in range(b):
        for h in range(nq):
            sc_ = (q[bi, h] @ k[bi, h // g].T) * sc
            sc_ = np.where(ok, sc_, -np.inf)
            mx = sc_.max(axis=1, keepdims=True)
            if p["sinks"]:
                mx = np.maximum(mx, float(inputs["sinks"][h]))
            e = np.exp(sc_ - mx)
            den = e.sum(axis=1, keepdims=True)
            if p["sinks"]:
                den += np.exp(float(inputs["sinks"][h]) - mx)
            out[bi, h] = (e / den) @ v[bi, h // g]
    return {"out": round_to(out, dtype)}


def attention_cte_bound(shape: tuple[int, ...], dtype: str, params: Mapping[str, Any]) -> Bound:
    """q, k, v and out once; the FLOPs of the keys each query attends to (q kᵀ and p v)."""
    b, nq, nkv, s, d = shape
    p = {**PARAMS, **params}
    w, prior = int(p["window"]), int(p["prior"])
    if p["causal"]:
        pairs = sum(min(prior + i + 1, w) if w else prior + i + 1 for i in range(s))
    else:
        pairs = s * s
    return Bound(2 * (2 * b * nq * s * d + 2 * b * nkv * (prior + s) * d), 4 * b * nq * pairs * d)


BOUNDS["attention_cte"] = attention_cte_bound
