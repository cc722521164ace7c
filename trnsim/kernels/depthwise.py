"""Depthwise 2-D convolution ``out[N, C, Ho, Wo] = dwconv(x[N, C, H, W], w[C, 1, R, R])`` on the
vector engines, the way an NKI author writes it (MobileNet/EfficientNet/ConvNeXt blocks).

A depthwise filter mixes no channels, so there is nothing to contract on the PE array: an im2col
matmul would contract only R·R rows per channel and run one matmul per channel (a 96-channel
layer was 96 batch items of a bmm). Instead every partition holds one channel - or one band of
output rows of it, so that layers with few channels still fill the 128 lanes - for a group of
images, and each of the R·R taps is one ``scalar_tensor_tensor`` over all of them:
``acc = x_window * w[c, tap] + acc`` (the tap's weight is the partition's scalar, shared by its
images; the window is a strided view of the padded input band, no copy), into an accumulator
the other engine zeroes meanwhile.

* channels x bands are cut into tiles of 128 partitions; a tile's bands are loaded with one DMA
  per run of channels in a band (images on the free axis; a zero-filled tile gives the padding),
  its weights with one DMA per run;
* taps accumulate in fp32; the store casts to the output dtype;
* the taps run on VectorE (``scalar_tensor_tensor`` is a VectorE instruction); the zero fills
  alternate between GpSimd and ScalarE, and the pools are double-buffered, so one tile's loads
  and fills overlap the other's taps.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..config import ChipConfig
from ..isa import KernelError
from ..builder.kernel import Kernel
from .conv import conv_padding
from .reference import round_to
from .registry import checked_dims, checked_dtype, register_kernel, split_dims

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
    before, after = conv_padding(params.get("padding", "valid"), r, stride)
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


def _runs(u0: int, u1: int, channels: int) -> list[tuple[int, int, int]]:
    """Units ``u0..u1-1`` (unit = band * channels + channel) as (band, first channel, count) runs."""
    out = []
    u = u0
    while u < u1:
        band, c0 = divmod(u, channels)
        count = min(u1 - u, channels - c0)
        out.append((band, c0, count))
        u += count
    return out


@register_kernel("dwconv2d", dims="NxCxHxWxR", dtypes=_DTYPES, default_shape=(8, 96, 56, 56, 3),
                 summary="NCHW depthwise conv2d, [C,1,R,R] weights: channels/bands on partitions, one "
                         "scalar_tensor_tensor per tap on VectorE",
                 params={"stride": 1, "padding": "valid"}, inputs=_inputs, reference=_reference,
                 split=split_dims(0, 1))
def build_depthwise_conv2d(n: int, c: int, h: int, w: int, r: int, dtype: str = "bf16",
                           config: ChipConfig | str = "trn2", stride: int = 1, padding: Any = "valid",
                           name: str = "dwconv2d") -> Kernel:
    checked_dims(name, N=n, C=c, H=h, W=w, R=r)
    if isinstance(stride, bool) or not isinstance(stride, (int, np.integer)) or stride < 1:
        raise KernelError(f"{name}: stride must be an integer >= 1, got {stride!r}")
    kern = Kernel(name, config)
    cfg = kern.config
    dt = checked_dtype(name, dtype, _DTYPES)
    before, after = conv_padding(padding, r, stride)
    hp, wp = h + before + after, w + before + after
    if r > hp or r > wp:
        raise KernelError(f"{name}: filter {r}x{r} is larger than the padded input {hp}x{wp}")
    ho, wo = (hp - r) // stride + 1, (wp - r) // stride + 1
    parts = cfg.core.sbuf.partitions
    # a partition holds one channel's band of output rows for a group of images (all sharing the
    # channel's weights, so one instruction per tap covers them); bands fill the partitions when
    # there are few channels, and bands and image groups shrink to fit the SBUF budget
    budget = cfg.core.sbuf.partition_bytes // _SBUF_SHARE // 2
    bands_wanted = max(1, parts // c) if c < parts else 1
    hb = max(1, -(-ho // bands_wanted))
    ni = n

    def need(rows: int, imgs: int) -> int:
        return imgs * (((rows - 1) * stride + r) * wp * dt.itemsize + rows * wo * 4)

    while need(hb, ni) > budget and (hb > 1 or ni > 1):
        if ni > 1:
            ni = -(-ni // 2)
        else:
            hb = -(-hb // 2)
    if need(hb, ni) > budget:
        raise KernelError(f"{name}: one output row ({wo} wide, {wp} padded input columns) does not fit SBUF")
    while ni * hb * wo > cfg.core.vector.max_free_sbuf and hb > 1:
        hb = -(-hb // 2)
    nb = -(-ho // hb)
    hin = (hb - 1) * stride + r
    taps = r * r

    x = kern.input("x", (n, c, h, w), dt)
    wts = kern.input("w", (c, 1, r, r), dt)
    out = kern.output("out", (n, c, ho, wo), dt)
    xin = kern.tile_pool("x", bufs=2)
    accs = kern.tile_pool("acc", bufs=2)
    wpool = kern.tile_pool("w", bufs=2)
    units = nb * c
    ti = 0
    for n0 in range(0, n, ni):
        g = min(ni, n - n0)
        for u0 in range(0, units, parts):
            u1 = min(units, u0 + parts)
            p = u1 - u0
            other = "gpsimd" if ti % 2 == 0 else "scalar"  # zero-fills off the vector engine
            ti += 1
            xt = xin.tile((parts, ni, hin, wp), dt)
            kern.memset(xt[:p, :g], 0.0, engine=other)  # the padding (and rows past the image)
            wt = wpool.tile((parts, taps), "float32")
            at = accs.tile((parts, ni, hb, wo), "float32")
            q = 0
            for band, c0, count in _runs(u0, u1, c):
                i0 = band * hb * stride - before  # the first padded-input row the band reads, in image rows
                lo, hi = max(0, i0), min(h, i0 + hin)
                if hi > lo:
                    src = x.ap((n0 * c + c0) * h * w + lo * w, [[h * w, count], [c * h * w, g], [w, hi - lo], [1, w]])
                    kern.dma_copy(xt[q:q + count, :g, lo - i0:hi - i0, before:before + w], src, engine="sync",
                                  queue=q % 2)
                kern.dma_copy(wt[q:q + count, :], wts.ap(c0 * taps, [[taps, count], [1, taps]]), engine="scalar",
                              queue=2)
                q += count
            acc = at[:p, :g]
            kern.memset(acc, 0.0, engine=other)
            for tap in range(taps):
                i, j = divmod(tap, r)
                win = xt[:p, :g, i:i + (hb - 1) * stride + 1:stride, j:j + (wo - 1) * stride + 1:stride]
                kern.scalar_tensor_tensor(acc, win, "multiply", wt[:p, tap:tap + 1], "add", acc)
            q = 0
            for band, c0, count in _runs(u0, u1, c):
                o0 = band * hb
                rows = min(hb, ho - o0)
                dst = out.ap((n0 * c + c0) * ho * wo + o0 * wo,
                             [[ho * wo, count], [c * ho * wo, g], [wo, rows], [1, wo]])
                kern.dma_copy(dst, at[q:q + count, :g, :rows, :], engine="gpsimd", queue=3)
                q += count
    return kern
