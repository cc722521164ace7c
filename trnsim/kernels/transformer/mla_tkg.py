"""``mla_tkg``: DeepSeek's multi-head latent attention (MLA) for token generation, in the absorbed
form NxD Inference and the MLA decode kernels use (DeepSeek-V2 paper sec. 2.1.2; vLLM's
``attention/backends/mla/common.py`` "data-movement friendly" path): the KV cache holds one
compressed latent ``c_kv [R]`` (``kv_lora_rank``) and one shared rope key ``k_pe [DR]`` per token
- no per-head K or V - and the up-projections are absorbed into the query and the output:

* ``q_lat[h] = q_nope[h] @ W_uk[h]``                      (``[D] -> [R]``, per head)
* ``s[h, j] = (q_lat[h] . c_kv[j] + q_pe[h] . k_pe[j]) * scale``  over the cached tokens ``j``
* ``o_lat[h] = softmax(s[h]) @ c_kv``                     (``[R]``: the latents are the values)
* ``out[h] = o_lat[h] @ W_uv[h]``                         (``[R] -> [D]``)

so decode is multi-query attention with a ``R + DR`` = 576-wide key and a ``R``-wide value over one
latent "head" shared by the rank's query heads.

Layout (one logical core; sequences in blocks of up to 128):

* the absorption runs for the block at once: ``q_nopeᵀ [D, B]`` per head (a strided DMA) is the
  moving operand against ``W_uk[h]``'s 128-column chunks (stationary), giving ``q_latᵀ`` with the
  latent on the partitions ``[128, R/128, NQ, B]`` (rounded to the model dtype);
* per sequence, the cache streams in chunks of up to four 128-key tiles ``[128 keys, tiles, R+DR]``
  (key ``k0 + 128 t + p`` at partition ``p``: one contiguous row per partition per tile), read
  once from HBM: each tile is PE-transposed to ``[R+DR, 128 keys]`` (the scores' stationary: keys on
  the output partitions, as ``attention_tkg``), and the same rows untransposed are the stationary of
  ``o_latᵀ [128, R/128, NQ] += c_kvᵀ p``; the softmax runs online over chunks (running max, sum,
  rescale), as ``attention_tkg``'s;
* the output projection runs for the block at once: ``o_latᵀ`` (stationary, the block's sequences
  as rows) against ``W_uv[h]``'s chunks, one store of ``out [B, NQ, D]`` per block.

Mask: key ``j`` is seen when ``j <= pos[b]``: the active token's latent is already in the cache at
its position (the projection that made it stores it; NxD Inference's KV-cache manager).

Inputs ``q_nope [B, NQ, D]``, ``q_pe [B, NQ, DR]`` (RoPE applied), ``w_uk [NQ, D, R]``,
``w_uv [NQ, R, D]``, ``cache [B, SP, R+DR]`` (latent then rope key), ``pos [B]`` int32; output
``out [B, NQ, D]``.
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
from .common import BOUNDS, P, Bound, Pools, online_max, online_rescale, positive

__all__ = ["build_mla_tkg", "mla_tkg_reference", "mla_tkg_bound"]

DTYPES = ("bf16", "fp16")
PARAMS = {"scale": 0.0}
NEG = -30000.0
CHUNK = 16  # 128-key tiles per chunk at most: its scores (tiles x NQ fp32 columns) fit one PSUM bank


def _scale(scale: Any, d: int) -> float:
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale < 0:
        raise KernelError(f"mla_tkg: scale must be a positive number (0: 1/sqrt(D + DR)), got {scale!r}")
    return float(scale) or 1.0 / math.sqrt(d)


def _view(t: TileAP, p_count: int, offset: int, dims: tuple[tuple[int, int], ...]) -> TileAP:
    return TileAP(t.alloc, t.p_start, p_count, t.offset + offset, dims, t.dtype)


@register_kernel("mla_tkg", dims="BxNQxSPxRxDRxD", dtypes=DTYPES, default_shape=(4, 2, 1024, 512, 64, 128),
                 summary="DeepSeek MLA decode: absorbed W_uk/W_uv, scores and values over the compressed latent "
                         "+ rope-key cache",
                 params=PARAMS, inputs=lambda s, d, p, g: mla_tkg_inputs(s, d, p, g),
                 reference=lambda i, s, d, p: mla_tkg_reference(i, s, d, p),
                 split=lambda s, p, n: mla_tkg_split(s, p, n))
def build_mla_tkg(b: int, nq: int, sp: int, r: int, dr: int, d: int, dtype: str = "bf16",
                  config: ChipConfig | str = "trn2", scale: float = 0.0, name: str = "mla_tkg") -> Kernel:
    positive("mla_tkg", B=b, NQ=nq, SP=sp, R=r, DR=dr, D=d)
    if r % P:
        raise KernelError(f"mla_tkg: R={r} (kv_lora_rank) must be a multiple of {P}")
    if d > P or dr > P:
        raise KernelError(f"mla_tkg: D={d} and DR={dr} must be at most {P}")
    if sp % P:
        raise KernelError(f"mla_tkg: SP={sp} must be a multiple of {P} (a cache bucket)")
    if nq > P:
        raise KernelError(f"mla_tkg: NQ={nq} query heads per rank; at most {P}")
    ct = max(1, min(CHUNK, 512 // nq))
    rc = r // P
    if nq * r * 2 * 2 > 96 * 1024:
        raise KernelError(f"mla_tkg: NQ={nq} x R={r}: the absorbed weights do not fit SBUF (at most "
                          f"{96 * 1024 // (4 * r)} heads per rank at this R)")
    sc = _scale(scale, d + dr)
    kern = Kernel(name, config)
    dt = checked_dtype("mla_tkg", dtype, DTYPES)
    lat = r + dr
    q_nope = kern.input("q_nope", (b, nq, d), dt)
    q_pe = kern.input("q_pe", (b, nq, dr), dt)
    w_uk = kern.input("w_uk", (nq, d, r), dt)
    w_uv = kern.input("w_uv", (nq, r, d), dt)
    cache = kern.input("cache", (b, sp, lat), dt)
    pos = kern.input("pos", (b,), "int32")
    out = kern.output("out", (b, nq, d), dt)
    pools = Pools(kern)

    # the absorbed weights, resident: W_uk [D, NQ, R] (D on the partitions), W_uv [128, NQ, RC, D]
    wuk = kern.sbuf((d, nq, r), dt, name="w_uk_sb")
    kern.dma_copy(wuk, w_uk.ap(0, [[r, d], [d * r, nq], [1, r]]), queue=0)
    wuv = kern.sbuf((P, nq, rc, d), dt, name="w_uv_sb")
    kern.dma_copy(wuv, w_uv.ap(0, [[d, P], [r * d, nq], [P * d, rc], [1, d]]), queue=1)
    ones_col = kern.sbuf((P, 1), dt, name="ones_col")
    kern.memset(ones_col, 1.0, engine="gpsimd")
    ones_row = kern.sbuf((1, P), "fp32", name="ones_row")
    kern.memset(ones_row, 1.0, engine="gpsimd")
    tiles_total = sp // P
    chunks = [(t0, min(ct, tiles_total - t0)) for t0 in range(0, tiles_total, ct)]
    flip = [0]

    def q_() -> int:
        flip[0] += 1
        return 2 + flip[0] % 4

    for b0 in range(0, b, P):
        bb = min(P, b - b0)
        # q_nopeᵀ [D, NQ, bb] and q_peᵀ [DR, NQ, bb]: element (b, h, x) at partition x
        qnT = pools("qnT", 2).tile((P, nq, P), dt)[:d, :, :bb]
        kern.dma_copy(qnT, q_nope.ap(b0 * nq * d, [[1, d], [d, nq], [nq * d, bb]]), queue=6)
        qpT = pools("qpT", 2).tile((P, nq, P), dt)[:dr, :, :bb]
        kern.dma_copy(qpT, q_pe.ap(b0 * nq * dr, [[1, dr], [dr, nq], [nq * dr, bb]]), queue=7)
        pos_i = pools("pos_i", 2).tile((P, P), "int32")[:, :bb]
        kern.dma_copy(pos_i, pos.ap(b0, [[0, P], [1, bb]]), queue=7)
        pos_f = pools("pos_f", 2).tile((P, P), "fp32")[:, :bb]
        kern.tensor_copy(pos_f, pos_i, engine="gpsimd")
        # q_latᵀ [128, RC, NQ, bb] = W_uk[h][:, chunk]ᵀ q_nope[h]ᵀ
        qlat = pools("qlat", 2).tile((P, rc, nq, P), dt)[:, :, :, :bb]
        for h in range(nq):
            for c in range(rc):
                ps = pools("blk_ps", 1, "psum").tile((P, P), "fp32")[:, :bb]
                kern.nc_matmul(ps, wuk[:, h, c * P:(c + 1) * P], qnT[:, h, :])
                kern.tensor_copy(qlat[:, c, h, :], ps, engine="vector" if (h * rc + c) % 2 else "scalar")
        olat = pools("olat", 2).tile((P, rc, nq, P), dt)[:, :, :, :bb]
        w = _Mla(kern, pools, cache=cache, sp=sp, r=r, dr=dr, rc=rc, nq=nq, sc=sc, dt=dt, chunks=chunks, qlat=qlat,
                 qpT=qpT, pos_f=pos_f, olat=olat, ones_col=ones_col, ones_row=ones_row, q_=q_)
        # software-pipelined over the block's (sequence, chunk) items: scores of item i + 1, then the
        # softmax and values of item i
        pending: tuple[_Seq, int, Any] | None = None
        for bi in range(bb):
            st = w.start(b0 + bi, bi)
            for ci, ch in enumerate(chunks):
                a = w.scores(st, ch)
                if pending is not None:
                    ps_, pci, pa = pending
                    w.softmax_pv(ps_, pa)
                    if pci == ps_.last:
                        w.finish(ps_)
                pending = (st, ci, a)
        assert pending is not None
        w.softmax_pv(pending[0], pending[2])
        w.finish(pending[0])
        # out [bb, NQ, D] = o_lat[h] W_uv[h], the block's sequences as rows
        res = pools("res", 2).tile((P, nq, d), dt)[:bb]
        for h in range(nq):
            ps = pools("blk_ps", 1, "psum").tile((P, P), "fp32")[:bb, :d]
            for c in range(rc):
                kern.nc_matmul(ps, olat[:, c, h, :], wuv[:, h, c, :], accumulate=c > 0)
            kern.tensor_copy(res[:, h, :], ps, engine="vector" if h % 2 else "scalar")
        kern.dma_copy(out.ap(b0 * nq * d, [[nq * d, bb], [d, nq], [1, d]]), res, engine="gpsimd", queue=1)
    return kern


class _Seq:
    """One sequence's running softmax state: ``m`` [NQ, 1], ``l`` [1, NQ], ``o`` [128, RC, NQ] (fp32)."""

    def __init__(self, b: int, bi: int, last: int):
        self.b, self.bi, self.last = b, bi, last
        self.m: Any = None
        self.l: Any = None
        self.o: Any = None


class _Mla:
    """The instruction emitters of :func:`build_mla_tkg` for one block of sequences: a chunk's
    loads, scores, mask and max (:meth:`scores`) are issued before the previous chunk's softmax
    and values (:meth:`softmax_pv`), so TensorE transposes the next keys while the chain runs."""

    def __init__(self, kern: Kernel, pools: Pools, **kw: Any):
        self.kern, self.pools = kern, pools
        self.__dict__.update(kw)
        self.ct = max(n for _, n in self.chunks)

    def start(self, b: int, bi: int) -> _Seq:
        kern, pools, nq, rc = self.kern, self.pools, self.nq, self.rc
        st = _Seq(b, bi, len(self.chunks) - 1)
        st.m = pools("m", 5).tile((P, 1), "fp32")[:nq]
        kern.memset(st.m, NEG)
        st.l = pools("l", 5).tile((1, P), "fp32")[:, :nq]
        kern.memset(st.l, 0.0)
        st.o = pools("o", 3).tile((P, rc, nq), "fp32")
        kern.memset(st.o, 0.0)
        return st

    def scores(self, st: _Seq, chunk: tuple[int, int]) -> tuple[Any, ...]:
        kern, pools, nq, rc, r, dr, dt, ct = self.kern, self.pools, self.nq, self.rc, self.r, self.dr, self.dt, self.ct
        lat = r + dr
        t0, nt = chunk
        k0 = t0 * P
        bi = st.bi
        # this sequence's queries: [128, RC, NQ] latent part, [DR, NQ] rope part (columns of the block's tiles)
        ql = _view(self.qlat, P, bi, tuple(self.qlat.dims[:-1]))
        qp = _view(self.qpT, dr, bi, tuple(self.qpT.dims[:-1]))
        pos_b = _view(self.pos_f, P, bi, ())
        rows = pools("rows", 3).tile((P, ct, lat), dt)[:, :nt, :]
        kern.dma_copy(rows, self.cache.ap((st.b * self.sp + k0) * lat, [[lat, P], [P * lat, nt], [1, lat]]),
                      queue=self.q_())
        s_ps = pools("s_ps", 2, "psum").tile((P, ct * nq), "fp32")[:, :nt * nq]
        kTs: list[TileAP] = []
        for t in range(nt + 1):
            if t < nt:
                # the tile's keys transposed: [R + DR, 128 keys] in 128-row pieces (a tile ahead of
                # its scores, so TensorE is not waiting on the evacuation)
                tp = pools("kT_ps", 2, "psum").tile((P, rc + 1, P), dt)
                pairs = [(tp[:, c, :], rows[:, t, c * P:(c + 1) * P]) for c in range(rc)]
                pairs.append((tp[:dr, rc, :], rows[:, t, r:lat]))
                kern.nc_transpose_many(pairs)
                kT = pools("kT", 3).tile((P, rc + 1, P), dt)
                kern.tensor_copy(kT[:, :rc, :], tp[:, :rc, :], engine="vector" if t % 2 else "scalar")
                kern.tensor_copy(kT[:dr, rc, :], tp[:dr, rc, :], engine="scalar" if t % 2 else "vector")
                kTs.append(kT)
            if t >= 1:
                kT, dst = kTs[t - 1], s_ps[:, (t - 1) * nq:t * nq]
                for c in range(rc):
                    kern.nc_matmul(dst, kT[:, c, :], ql[:, c, :], accumulate=c > 0)
                kern.nc_matmul(dst, kT[:dr, rc, :], qp, accumulate=True)
        # mask keys past pos, out of PSUM into fp32 SBUF
        kidx = pools("kidx", 2).tile((P, ct), "fp32")[:, :nt]
        kern.iota(kidx, base=k0, channel_multiplier=1, pattern=[P])
        bad = pools("bad", 2).tile((P, ct, nq), "fp32")[:, :nt, :]
        kern.tensor_tensor(bad, _view(kidx, P, 0, ((1, nt), (0, nq))), _view(pos_b, P, 0, ((0, nt), (0, nq))),
                           "greater", engine="gpsimd")
        s_sb = pools("s_sb", 3).tile((P, ct * nq), "fp32")[:, :nt * nq]
        kern.scalar_tensor_tensor(s_sb, bad.reshape(P, nt * nq), "multiply", NEG, "add", s_ps)
        # the max over the chunk's tiles, per (key partition, head)
        red = pools("red", 3).tile((P, nq), "fp32")
        if nt == 1:
            kern.tensor_copy(red, s_sb, engine="gpsimd")
        else:
            kern.tensor_reduce(red, "max", _view(s_sb, P, 0, ((1, nq), (nq, nt))), axis=2)
        return nt, rows, s_sb, red

    def softmax_pv(self, st: _Seq, a: tuple[Any, ...]) -> None:
        kern, pools, nq, rc, sc, dt, ct = self.kern, self.pools, self.nq, self.rc, self.sc, self.dt, self.ct
        nt, rows, s_sb, red = a
        # the max over the partitions (a transpose), the running max and the rescale factor
        m_new, mb, ab = online_max(kern, pools, red, st.m, nq, P, P, sc, tr_pool="tr32", m_bufs=5)
        st.m = m_new
        s3 = s_sb.reshape(P, nt, nq)
        kern.tensor_tensor(s3, s3, _view(mb, P, 0, ((0, nt), (1, nq))), "subtract")
        p = pools("p", 2).tile((P, ct * nq), dt)[:, :nt * nq]
        kern.activation(p, "exp", s_sb, scale=sc)
        # o_latᵀ [128, RC, NQ] += c_kv rows (stationary) x p; l [1, NQ] += onesᵀ p
        acc = pools("pv_ps", 1, "psum").tile((P, rc * nq + P), "fp32")
        o_ps, l_ps = acc[:, :rc * nq].reshape(P, rc, nq), acc[:1, rc * nq:rc * nq + nq]
        for c in range(rc):
            for t in range(nt):
                kern.nc_matmul(o_ps[:, c, :], rows[:, t, c * P:(c + 1) * P], p[:, t * nq:(t + 1) * nq],
                               accumulate=t > 0)
        for t in range(nt):
            kern.nc_matmul(l_ps, self.ones_col, p[:, t * nq:(t + 1) * nq], accumulate=t > 0)
        st.l = online_rescale(kern, pools, st.o, st.l, _view(ab, P, 0, ((0, rc), (1, nq))), ab, o_ps, l_ps, nq,
                              l_bufs=5)

    def finish(self, st: _Seq) -> None:
        """``o_lat = o / l`` into column ``bi`` of ``olat``: 1/l broadcast to the partitions by a
        matmul with a ones row."""
        kern, pools, nq, rc = self.kern, self.pools, self.nq, self.rc
        rl = pools("rl", 2).tile((1, P), "fp32")[:, :nq]
        kern.reciprocal(rl, st.l)
        rb = pools("tr32", 1, "psum").tile((P, 2 * P), "fp32")[:, :nq]
        kern.nc_matmul(rb, self.ones_row, rl)
        olat = self.olat
        kern.tensor_tensor(_view(olat, P, st.bi, tuple(olat.dims[:-1])), st.o, _view(rb, P, 0, ((0, rc), (1, nq))),
                           "multiply")


def mla_tkg_split(shape: tuple[int, ...], params: Mapping[str, Any], n: int) -> list[Any] | None:
    """LNC=2: the physical cores take half the sequences each (each reads its own sequences'
    caches and both the rank's absorbed weights)."""
    b = shape[0]
    if b >= n:
        return [(b // n + (1 if i < b % n else 0),) + tuple(shape[1:]) for i in range(n)]
    return None


# ---------------------------------------------------------------------------------------------
# Inputs, reference, bound
# ---------------------------------------------------------------------------------------------


def mla_tkg_inputs(shape: tuple[int, ...], dtype: str, params: Mapping[str, Any], rng: np.random.Generator
                   ) -> dict[str, np.ndarray]:
    b, nq, sp, r, dr, d = shape
    g = lambda *s: rng.standard_normal(s, dtype=np.float32)  # noqa: E731
    return {"q_nope": g(b, nq, d), "q_pe": g(b, nq, dr),
            "w_uk": g(nq, d, r) / np.float32(math.sqrt(d)), "w_uv": g(nq, r, d) / np.float32(math.sqrt(r)),
            "cache": g(b, sp, r + dr), "pos": rng.integers(0, sp, size=b).astype(np.int32)}


def mla_tkg_reference(inputs: Mapping[str, np.ndarray], shape: tuple[int, ...], dtype: str,
                      params: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """The absorbed MLA decode in float64 with the kernel's roundings (``q_lat`` and ``o_lat`` in
    the model dtype, as they are matmul operands)."""
    b, nq, sp, r, dr, d = shape
    sc = float({**PARAMS, **params}["scale"]) or 1.0 / math.sqrt(d + dr)
    qn, qp, wuk, wuv, cache = (round_to(inputs[k], dtype).astype(np.float64)
                               for k in ("q_nope", "q_pe", "w_uk", "w_uv", "cache"))
    pos = inputs["pos"].astype(np.int64)
    out = np.zeros((b, nq, d))
    for bi in range(b):
        n = int(pos[bi]) + 1
        ckv, kpe = cache[bi, :n, :r], cache[bi, :n, r:]
        for h in range(nq):
            ql = round_to(qn[bi, h] @ wuk[h], dtype).astype(np.float64)
            s = (ckv @ ql + kpe @ qp[bi, h]) * sc
            e = np.exp(s - s.max())
            ol = round_to((e / e.sum()) @ ckv, dtype).astype(np.float64)
            out[bi, h] = ol @ wuv[h]
    return {"out": round_to(out, dtype)}


def mla_tkg_bound(shape: tuple[int, ...], dtype: str, params: Mapping[str, Any]) -> Bound:
    """The latent cache read once, the absorbed weights, q and the output; the absorption, scores,
    values and output FLOPs."""
    b, nq, sp, r, dr, d = shape
    hbm = 2 * (b * sp * (r + dr) + 2 * nq * d * r + b * nq * (2 * d + dr))
    flops = 2 * b * nq * (2 * d * r + sp * (r + dr) + sp * r)
    return Bound(hbm, flops)


BOUNDS["mla_tkg"] = mla_tkg_bound
