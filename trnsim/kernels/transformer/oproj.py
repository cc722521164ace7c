"""``oproj``: the attention output projection, ``out[T, H] = attn @ W_o (+ bias)``, reading the
attention kernels' ``[B, heads, S, D]`` output directly (the NKI library's
``output_projection_tkg`` / ``output_projection_cte``, ``nkilib/core/output_projection/``, commit
d2ad3a57).

The attention rows ``[tb, heads x D]`` are gathered per token block (one DMA per batch the block
touches; a decode block of ``S = 1`` rows is contiguous), transposed on TensorE and multiplied
with the weights streaming (decode) or resident (prefill) as in :class:`~.common.Projection`;
the evacuation adds the bias and stores the token rows. At LNC=2 the physical cores share
``H`` (each reads its columns of ``W_o`` and writes its columns of ``out``; NKI's "H sharded
across the LNC"), with no exchange. The output is this rank's partial sum; the TP all-reduce
that follows is not part of the kernel.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from ...config import ChipConfig
from ...isa import KernelError, TileAP
from ...builder.kernel import Kernel
from ..reference import round_to
from ..registry import checked_dtype, register_kernel
from .common import BANK, BOUNDS, P, Bound, Pools, RowPrologue, flag, k_tiles, positive, row_vector, shard_range, shards
from .projection import Projection, Seg

__all__ = ["build_oproj", "oproj_reference", "oproj_bound"]

DTYPES = ("bf16", "fp16")
PARAMS = {"bias": False, "shard": "0/1"}


@register_kernel("oproj", dims="BxSxNQxDxH", dtypes=DTYPES, default_shape=(4, 1, 4, 128, 4096),
                 summary="attention output projection attn [B, heads, S, D] @ W_o [heads*D, H] (+ bias) -> [B*S, H]",
                 params=PARAMS, inputs=lambda s, d, p, g: oproj_inputs(s, d, p, g),
                 reference=lambda i, s, d, p: oproj_reference(i, s, d, p), split=lambda s, p, n: oproj_split(s, p, n))
def build_oproj(b: int, s: int, nq: int, d: int, h: int, dtype: str = "bf16", config: ChipConfig | str = "trn2",
                bias: bool = False, shard: str = "0/1", name: str = "oproj") -> Kernel:
    """``shard="i/n"``: physical core ``i`` of an LNC=``n`` logical core computes its share of the
    output columns (:func:`oproj_split`)."""
    positive("oproj", B=b, S=s, NQ=nq, D=d, H=h)
    bias = flag("oproj", "bias", bias)
    kern = Kernel(name, config)
    dt = checked_dtype("oproj", dtype, DTYPES)
    cfg = kern.config
    t, k = b * s, nq * d
    kp, k1 = k_tiles("oproj", "NQ*D", k)
    _, h1 = k_tiles("oproj", "H", h)
    lo, hi = shard_range("oproj", shard, h1)
    hp = h // h1
    c_lo, c_n = lo * hp, (hi - lo) * hp
    attn = kern.input("attn", (b, nq, s, d), dt)
    w = kern.input("w_o", (k, h), dt)
    bias_t = kern.input("bias", (h,), dt) if bias else None
    out = kern.output("out", (t, h), dt)
    pools = Pools(kern)
    tbw = min(P, t)
    bias_b = None
    if bias_t is not None:
        bias_b = kern.sbuf((tbw, c_n), dt, name="bias_b")
        row_vector(kern, bias_b, bias_t[c_lo:c_lo + c_n], queue=7)

    def rows_of(t0: int, tb: int) -> TileAP:
        """Token rows [t0, t0+tb) of the attention output as [tb, heads x D]."""
        r = pools("attn_rows", 2).tile((P, k), dt)[:tb]
        if s == 1:
            kern.dma_copy(r, attn.ap(t0 * k, [[k, tb], [1, k]]), queue=4)
            return r
        tt = t0
        while tt < t0 + tb:
            bi, si = divmod(tt, s)
            m = min(s - si, t0 + tb - tt)
            dst = TileAP(r.alloc, r.p_start + tt - t0, m, r.offset, ((d, nq), (1, d)), r.dtype)
            kern.dma_copy(dst, attn.ap((bi * nq * s + si) * d, [[d, m], [s * d, nq], [1, d]]), queue=4)
            tt += m
        return r

    pro = RowPrologue(kern, pools, k=k, dt=dt, x=None, norm=False, tokens=t, tag="attn", rows_of=rows_of)
    fixed = (2 * k * dt.itemsize if t > 32 else 0) + c_n * dt.itemsize * bias + 24 * 1024

    def passes(width: int) -> list[list[Seg]]:
        return [[Seg(w, 0, h, c_lo + c, min(width, c_n - c))] for c in range(0, c_n, width)]

    proj = Projection(kern, pools, k1=k1, tokens=t, prologue=pro, isz=dt.itemsize, make_passes=passes,
                      max_width=c_n, unit=min(c_n, P), budget=cfg.core.sbuf.partition_bytes - fixed, tag="o")
    flip = [0]

    def evac(pi: int, t0: int, tb: int, accs: list[list[TileAP]]) -> None:
        sg = proj.passes[pi][0]
        for j, acc in enumerate(accs[0]):
            c, wd = sg.c0 + j * BANK, min(BANK, sg.cw - j * BANK)
            o = pools("o", 3).tile((P, BANK), dt)[:tb, :wd]
            if bias_b is not None:
                kern.tensor_tensor(o, acc[:, :wd], bias_b[:tb, c - c_lo:c - c_lo + wd], "add")
            else:
                kern.tensor_copy(o, acc[:, :wd], engine="scalar" if flip[0] % 2 else "vector")
            flip[0] += 1
            kern.dma_copy(out[t0:t0 + tb, c:c + wd], o, engine="gpsimd", queue=2 + flip[0] % 2)

    proj.run(evac)
    return kern


def oproj_split(shape: tuple[int, ...], params: Mapping[str, Any], n: int) -> list[Any] | None:
    """LNC=2: the physical cores share the output columns (each reads its columns of W_o once)."""
    b, s, nq, d, h = shape
    if str(params.get("shard", "0/1")) != "0/1" or k_tiles("oproj", "H", h)[1] < n:
        return None
    return [(shape, sh) for sh in shards(n)]


def oproj_inputs(shape: tuple[int, ...], dtype: str, params: Mapping[str, Any], rng: np.random.Generator
                 ) -> dict[str, np.ndarray]:
    b, s, nq, d, h = shape
    out = {"attn": rng.standard_normal((b, nq, s, d), dtype=np.float32),
           "w_o": (rng.standard_normal((nq * d, h)) / np.sqrt(nq * d)).astype(np.float32)}
    if params.get("bias"):
        out["bias"] = (0.1 * rng.standard_normal(h)).astype(np.float32)
    return out


def oproj_reference(inputs: Mapping[str, np.ndarray], shape: tuple[int, ...], dtype: str,
                    params: Mapping[str, Any]) -> dict[str, np.ndarray]:
    b, s, nq, d, h = shape
    a = round_to(inputs["attn"], dtype).transpose(0, 2, 1, 3).reshape(b * s, nq * d)
    y = a @ round_to(inputs["w_o"], dtype)
    if params.get("bias"):
        y = y + round_to(inputs["bias"], dtype)
    return {"out": round_to(y, dtype)}


def oproj_bound(shape: tuple[int, ...], dtype: str, params: Mapping[str, Any]) -> Bound:
    b, s, nq, d, h = shape
    t, k = b * s, nq * d
    return Bound(2 * (t * k + k * h + t * h + (h if params.get("bias") else 0)), 2 * t * k * h)


BOUNDS["oproj"] = oproj_bound
