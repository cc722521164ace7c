"""Depthwise 2-D convolution ``out[N, C, Ho, Wo] = dwconv(x[N, C, H, W], w[C, 1, R, R])`` on the
vector engines, the way an NKI author writes it (MobileNet/EfficientNet/ConvNeXt blocks).

A depthwise filter mixes no channels, so there is nothing to contract on the PE array: an im2col
matmul would contract only R·R rows per channel and run one matmul per channel (a 96-channel
layer was 96 batch items of a bmm). Instead every partition holds one image plane (n, c) - or
one band of output rows of it, so that small layers still fill the 128 lanes - and each of the
R·R taps is one ``scalar_tensor_tensor`` over the band: ``acc = x_window * w[c, tap] + acc``
(the tap's weight is a per-partition scalar; the window is a strided view of the padded input
band, no copy), into an accumulator the other engine zeroes meanwhile.

* planes x bands are cut into tiles of 128 partitions; a tile's bands are loaded with one DMA
  per run of planes in a band (a zero-filled tile gives the padding), its weights with one DMA
  per run of channels;
* taps accumulate in fp32; the store casts to the output dtype;
* tiles alternate between VectorE and GpSimd (both run ``scalar_tensor_tensor``), and the pools
  are double-buffered, so one tile's loads overlap the other's taps.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..config import ChipConfig
from ..isa import KernelError
from ..kernel import Kernel
from ..native.dtypes import get_dtype
from .conv import _padding
from .reference import round_to
from .registry import register_kernel, split_dims

__all__ = ["build_depthwise_conv2d"]

_DTYPES = ("bf16", "fp16", "fp32")
_SBUF_SHARE = 2  # the double-buffered input and accumulator tiles may use half of each partition


def _inputs(shape, dtype, params, rng):
    n, c, h, w, r = shape
    return {"x": rng.standard_normal((n, c, h, w), dtype=np.float32),
            "w": rng.standard_normal((c, 1, r, r), dtype=np.float32)}


def _reference(inputs, shape, dtype, params):
    n, c, h, w, r = shape
    stride = int(params.get("stride", 1))
    before, after = _padding(params.get("padding", "valid"), r, stride)
    x = np.pad(round_to(inputs["x"], dtype), ((0, 0), (0, 0), (before, after), (before, after)))
    wt = round_to(inputs["w"], dtype)[:, 0]
    ho = (h + before + after - r) // stride + 1
    wo = (w + before + after - r) // stride + 1
    out = np.zeros((n, c, ho, wo))
    for i in range(r):
        for j in range(r):
            win = x[:, :, i:i + (ho - 1) * stride + 1:stride, j:j + (wo - 1) * stride + 1:stride]
            out += win * wt[None, :, i, j, None, None]
    return {"out": out}


def _runs(u0: int, u1: int, planes: int) -> list[tuple[int, int, int]]:
    """Units ``u0..u1-1`` (unit = band * planes + plane) as (band, first plane, count) runs."""
    out = []
    u = u0
    while u < u1:
        band, j = divmod(u, planes)
        count = min(u1 - u, planes - j)
        out.append((band, j, count))
        u += count
    return out


@register_kernel("dwconv2d", dims="NxCxHxWxR", dtypes=_DTYPES, default_shape=(8, 96, 56, 56, 3),
                 summary="NCHW depthwise conv2d, [C,1,R,R] weights: planes/bands on partitions, one "
                         "scalar_tensor_tensor per tap on VectorE/GpSimd",
                 params={"stride": 1, "padding": "valid"}, inputs=_inputs, reference=_reference,
                 split=split_dims(0, 1))
def build_depthwise_conv2d(n: int, c: int, h: int, w: int, r: int, dtype: str = "bf16",
                           config: ChipConfig | str = "trn2", stride: int = 1, padding: Any = "valid",
                           name: str = "dwconv2d") -> Kernel:
    for nm, v in (("N", n), ("C", c), ("H", h), ("W", w), ("R", r)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise KernelError(f"{name}: {nm} must be a positive integer, got {v!r}")
    if isinstance(stride, bool) or not isinstance(stride, (int, np.integer)) or stride < 1:
        raise KernelError(f"{name}: stride must be an integer >= 1, got {stride!r}")
    kern = Kernel(name, config)
    cfg = kern.config
    try:
        dt = get_dtype(dtype)
    except ValueError as e:
        raise KernelError(f"{name}: {e}") from None
    if dt.short not in _DTYPES:
        raise KernelError(f"{name}: dtype {dt.short} not supported; expected one of {', '.join(_DTYPES)}")
    before, after = _padding(padding, r, stride)
    hp, wp = h + before + after, w + before + after
    if r > hp or r > wp:
        raise KernelError(f"{name}: filter {r}x{r} is larger than the padded input {hp}x{wp}")
    ho, wo = (hp - r) // stride + 1, (wp - r) // stride + 1
    parts = cfg.core.sbuf.partitions
    planes = n * c
    # output rows per band: fill the partitions when there are few planes, fit the SBUF budget
    budget = cfg.core.sbuf.partition_bytes // _SBUF_SHARE // 2
    bands_wanted = max(1, -(-parts // planes))
    hb = max(1, -(-ho // bands_wanted))

    def need(rows: int) -> int:
        return ((rows - 1) * stride + r) * wp * dt.itemsize + rows * wo * 4

    while hb > 1 and need(hb) > budget:
        hb = -(-hb // 2)
    if need(hb) > budget:
        raise KernelError(f"{name}: one output row ({wo} wide, {wp} padded input columns) does not fit SBUF")
    hb = min(hb, max(1, cfg.core.vector.max_free_sbuf // wo))
    nb = -(-ho // hb)
    hin = (hb - 1) * stride + r
    taps = r * r

    x = kern.input("x", (n, c, h, w), dt)
    wts = kern.input("w", (c, 1, r, r), dt)
    out = kern.output("out", (n, c, ho, wo), dt)
    xin = kern.tile_pool("x", bufs=2)
    accs = kern.tile_pool("acc", bufs=2)
    wpool = kern.tile_pool("w", bufs=2)
    units = nb * planes
    for ti, u0 in enumerate(range(0, units, parts)):
        u1 = min(units, u0 + parts)
        p = u1 - u0
        engine = "vector" if ti % 2 == 0 else "gpsimd"
        xt = xin.tile((parts, hin, wp), dt)
        kern.memset(xt[:p], 0.0, engine=engine)  # the padding (and rows past the image)
        wt = wpool.tile((parts, taps), "float32")
        at = accs.tile((parts, hb, wo), "float32")
        q = 0
        for band, j0, count in _runs(u0, u1, planes):
            o0 = band * hb  # first output row of the band
            i0 = o0 * stride - before  # first padded-input row it reads, in image rows
            lo, hi = max(0, i0), min(h, i0 + hin)
            if hi > lo:
                src = x.ap((j0 * h + lo) * w, [[h * w, count], [w, hi - lo], [1, w]])
                kern.dma_copy(xt[q:q + count, lo - i0:hi - i0, before:before + w], src, engine="sync", queue=q % 2)
            # the run's channels: plane j is channel j % c
            k = 0
            while k < count:
                ch = (j0 + k) % c
                m = min(count - k, c - ch)
                kern.dma_copy(wt[q + k:q + k + m, :], wts.ap(ch * taps, [[taps, m], [1, taps]]), engine="scalar",
                              queue=2)
                k += m
            q += count
        kern.memset(at[:p], 0.0, engine="gpsimd" if engine == "vector" else "vector")
        for tap in range(taps):
            i, j = divmod(tap, r)
            win = xt[:p, i:i + (hb - 1) * stride + 1:stride, j:j + (wo - 1) * stride + 1:stride]
            kern.scalar_tensor_tensor(at[:p], win, "multiply", wt[:p, tap:tap + 1], "add", at[:p], engine=engine)
        q = 0
        for band, j0, count in _runs(u0, u1, planes):
            o0 = band * hb
            rows = min(hb, ho - o0)
            dst = out.ap((j0 * ho + o0) * wo, [[ho * wo, count], [wo, rows], [1, wo]])
            kern.dma_copy(dst, at[q:q + count, :rows, :], engine="gpsimd", queue=3)
            q += count
    return kern
