"""MX quantisation: a bf16/fp32 operand cast to MXFP8 in the layout :mod:`.matmul_mx` reads
(OCP MX v1.0 as torchao's ``to_mx`` does it, floor scaling, saturating).

``x`` is ``[R, K]`` (``layout="rows"``: each row's K values contiguous, a linear's input or its
output gradient along the features) or ``[K, R]`` (``layout="cols"``: a weight ``[in, out]``
along ``in``, or an activation along the tokens for a weight gradient). Each run of 32
consecutive K values of a row gets one E8M0 scale::

    s = max(exponent(max |x|) - emax, 0)           (biased exponents; emax 8 for e4m3, 15 for e5m2)
    q = clamp(x * 2**(127 - s), -max, max) rounded to fp8    (x ~ q * 2**(s - 127))

Outputs are what ``matmul_mx`` takes as ``lhsT``/``rhs`` and their scales: ``q`` ``[K/4, R]``
quad-packed (row ``k4`` of column ``r`` holds ``x[r, 4 k4 .. 4 k4 + 3]``, byte ``j`` the value
``4 k4 + j``) and ``scale`` ``[K/32, R]`` uint8. In matmul_mx's terms K value ``512 t + 4 p + j``
sits at partition ``p``, byte ``j`` of k-tile ``t``: a scale group's 32 values are its 8
partitions x 4 bytes, as the instruction reads them; both operands of a matmul quantised here
pair up value for value.

Schedule, per 128 rows and chunk of four k-tiles (2048 values): the chunk is loaded
rows-on-partitions (a DMA transpose per k-tile from a ``cols`` operand), ScalarE takes ``|x|``, VectorE the group maxima, the scale
exponents from the maxima's bits (integer shifts on the same bytes), ``x`` times each group's
power of two, and ScalarE clamps and rounds to fp8; the fp8 bytes, read as packed words,
are DMA-transposed to words-on-partitions a k-tile at a time and stored. The row tile's scales are transposed and
stored once it is done.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..builder.kernel import Kernel
from ..config import ChipConfig
from ..isa import KernelError
from ..native.dtypes import get_dtype
from .reference import round_to
from .registry import checked_dims, checked_dtype, register_kernel, split_dims

__all__ = ["build_mx_quantize", "mx_quantize_reference", "FORMATS"]

#: the MXFP8 formats: (quad-packed dtype, element dtype, emax (the largest normal's exponent), largest finite)
FORMATS = {"mxfp8_e4m3fn": ("float8_e4m3fn_x4", "float8_e4m3fn", 8, 448.0),
           "mxfp8_e5m2": ("float8_e5m2_x4", "float8_e5m2", 15, 57344.0)}
_K_TILE = 512  # values per k-tile of matmul_mx (128 partitions x 4)
_GROUP = 32  # values per E8M0 scale
_CHUNK = 4 * _K_TILE  # values per row an instruction takes


def _format(fmt: Any, name: str) -> tuple[str, str, int, float]:
    if not isinstance(fmt, str) or fmt not in FORMATS:
        raise KernelError(f"{name}: fmt {fmt!r}: expected one of {', '.join(FORMATS)}")
    return FORMATS[fmt]


def mx_quantize_reference(x: np.ndarray, fmt: str = "mxfp8_e4m3fn") -> tuple[np.ndarray, np.ndarray]:
    """(packed ``[K/4, R]`` uint32, scales ``[K/32, R]`` uint8) of an ``[R, K]`` fp32 array, by the
    rule of the module docstring."""
    import ml_dtypes

    _, elem, emax, fmax = FORMATS[fmt]
    r, k = x.shape
    g = np.asarray(x, dtype=np.float32).reshape(r, k // _GROUP, _GROUP)
    amax = np.abs(g).max(axis=-1)
    s = np.maximum((amax.view(np.int32) >> 23) - emax, 0)
    inv = ((254 - s) << 23).astype(np.int32).view(np.float32)
    y = np.clip(g * inv[..., None], -fmax, fmax).reshape(r, k)
    q = np.ascontiguousarray(y.astype(getattr(ml_dtypes, elem))).view(np.uint8)
    packed = q.reshape(r, k // 4, 4).copy().view(np.uint32)[..., 0]
    return np.ascontiguousarray(packed.T), np.ascontiguousarray(s.astype(np.uint8).T)


def _inputs(shape: tuple[int, ...], dtype: str, params: Any, rng: np.random.Generator) -> dict[str, np.ndarray]:
    r, k = shape
    # groups of very different magnitudes (the scales differ), some all-zero, some with a
    # largest value that rounds past the format's maximum before it is clamped
    mag = np.exp2(rng.integers(-20, 20, (r, k // _GROUP, 1))).astype(np.float32)
    x = (rng.standard_normal((r, k // _GROUP, _GROUP)) * mag).astype(np.float32)
    x[rng.random((r, k // _GROUP)) < 0.05] = 0.0
    x = x.reshape(r, k)
    return {"x": x if params.get("layout", "rows") == "rows" else np.ascontiguousarray(x.T)}


def _reference(inputs: dict[str, np.ndarray], shape: tuple[int, ...], dtype: str, params: Any) -> dict[str, np.ndarray]:
    x = round_to(inputs["x"], dtype).astype(np.float32)
    if params.get("layout", "rows") != "rows":
        x = x.T
    q, s = mx_quantize_reference(x, params.get("fmt", "mxfp8_e4m3fn"))
    return {"q": q, "scale": s}


@register_kernel("mx_quantize", dims="RxK", dtypes=("bf16", "fp32"), default_shape=(4096, 4096),
                 summary="MXFP8 quantisation (E8M0 scale per 32 values along K, floor scaling, saturating) into "
                         "matmul_mx's quad-packed [K/4, R] operand and [K/32, R] scales; layout rows: x [R, K], "
                         "cols: x [K, R]",
                 params={"fmt": "mxfp8_e4m3fn", "layout": "rows"}, inputs=_inputs, reference=_reference,
                 tolerance=lambda d: (0.0, 0.0), split=split_dims(0))
def build_mx_quantize(r: int, k: int, dtype: str = "bf16", config: ChipConfig | str = "trn3",
                      fmt: str = "mxfp8_e4m3fn", layout: str = "rows", name: str = "mx_quantize") -> Kernel:
    """``q`` and ``scale`` of ``x`` (module docstring)."""
    checked_dims(name, R=r, K=k)
    if k % 128:
        raise KernelError(f"{name}: K={k} must be a multiple of 128 (matmul_mx's whole scale quadrants)")
    if layout not in ("rows", "cols"):
        raise KernelError(f"{name}: layout {layout!r}: expected rows ([R, K]) or cols ([K, R])")
    packed, elem, emax, fmax = _format(fmt, name)
    kern = Kernel(name, config)
    dt = checked_dtype(name, dtype, ("bf16", "fp32"))
    d = kern.config.core.dma
    if d.transpose_rate_sbuf <= 0 or (layout == "cols" and d.transpose_rate_hbm <= 0):
        raise KernelError(f"{name}: {kern.config.name} has no DMA transpose (core.dma.transpose_rate_"
                          f"{'sbuf' if d.transpose_rate_sbuf <= 0 else 'hbm'} is 0; it needs NeuronCore-v3)")
    x = kern.input("x", (r, k) if layout == "rows" else (k, r), dt)
    q = kern.output("q", (k // 4, r), packed)
    scale = kern.output("scale", (k // _GROUP, r), "uint8")
    groups = k // _GROUP
    # x's exponent field: bf16 (and its int16 bits) keeps fp32's 8 exponent bits above 7 mantissa bits
    ints, shift = ("int16", 7) if dt.itemsize == 2 else ("int32", 23)
    io = kern.tile_pool("x", bufs=3)
    absp = kern.tile_pool("abs", bufs=2)
    yp = kern.tile_pool("y", bufs=3)
    qp = kern.tile_pool("q", bufs=3)
    qtp = kern.tile_pool("qT", bufs=8)
    small = kern.tile_pool("small", bufs=6)
    sp = kern.tile_pool("scales", bufs=2)
    stp = kern.tile_pool("scalesT", bufs=2)
    for r0 in range(0, r, 128):
        rp = min(128, r - r0)
        s_all = sp.tile((128, groups), "int32")[:rp]  # the row tile's scales, transposed at its end
        for k0 in range(0, k, _CHUNK):  # each instruction over up to four k-tiles
            kw = min(_CHUNK, k - k0)
            g0, gw = k0 // _GROUP, kw // _GROUP
            xt = io.tile((128, _CHUNK), dt)[:rp, :kw]
            if layout == "rows":
                kern.dma_copy(xt, x[r0:r0 + rp, k0:k0 + kw], queue=0)
            else:
                for t0 in range(0, kw, _K_TILE):  # one [<=512, <=128] block each
                    tw = min(_K_TILE, kw - t0)
                    kern.dma_transpose(xt[:, t0:t0 + tw], x[k0 + t0:k0 + t0 + tw, r0:r0 + rp], queue=0)
            ax = absp.tile((128, _CHUNK), dt)[:rp, :kw]
            kern.activation(ax, "abs", xt)
            amax = small.tile((128, _CHUNK // _GROUP), dt)[:rp, :gw]  # one of the |x|: exact in x's dtype
            kern.tensor_reduce(amax, "max", ax.reshape(rp, gw, _GROUP), axis=2)
            s = s_all[:, g0:g0 + gw]
            # the biased exponent of each maximum (its sign bit is 0), less emax, at least 0
            kern.tensor_scalar(s, amax.bitcast(ints), "right_shift", shift, op1="subtract", operand1=emax)
            kern.tensor_scalar(s, s, "max", 0)
            inv = small.tile((128, _CHUNK // _GROUP), ints)[:rp, :gw]
            kern.tensor_scalar(inv, s, "subtract", 254, reverse0=True, op1="left_shift", operand1=shift)  # 2**(127-s)
            y = yp.tile((128, _CHUNK), dt)[:rp, :kw]  # x times a power of two: exact in x's dtype
            kern.tensor_tensor(y.reshape(rp, gw, _GROUP), xt.reshape(rp, gw, _GROUP),
                               inv.bitcast(dt).reshape(rp, gw, 1).broadcast_to(rp, gw, _GROUP), "multiply")
            qt = qp.tile((128, _CHUNK), elem)[:rp, :kw]
            kern.tensor_scalar(qt, y, "min", fmax, op1="max", operand1=-fmax, engine="scalar")
            done = []
            for t0 in range(0, kw, _K_TILE):  # the fp8 bytes as packed words, words to partitions
                words = min(_K_TILE, kw - t0) // 4
                qT = qtp.tile((_K_TILE // 4, 128), packed)[:words, :rp]
                kern.dma_transpose(qT, qt[:, t0:t0 + 4 * words].bitcast(packed), engine="gpsimd", queue=1)
                done.append(((k0 + t0) // 4, words, qT))
            for w0, words, qT in done:  # stored once all four are under way
                kern.dma_copy(q[w0:w0 + words, r0:r0 + rp], qT, engine="gpsimd", queue=2)
        for c0 in range(0, groups, 128):
            cw = min(128, groups - c0)
            sT = stp.tile((128, 128), "int32")[:cw, :rp]
            kern.dma_transpose(sT, s_all[:, c0:c0 + cw], engine="gpsimd", queue=1)
            s8 = stp.tile((128, 128), "uint8")[:cw, :rp]
            kern.tensor_copy(s8, sT, engine="gpsimd")
            kern.dma_copy(scale[c0:c0 + cw, r0:r0 + rp], s8, engine="gpsimd", queue=2)
    return kern
