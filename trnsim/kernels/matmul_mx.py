"""MX matmul (NeuronCore-v4): ``out[M, N] = A @ B`` from MXFP8/MXFP4 operands and their E8M0
block scales, on ``nc_matmul_mx`` (datasheet §4.2, S10/S22: K = 512 per instruction in the cycles
of a bf16 matmul of K = 128, four times the bf16 rate).

Operands arrive as the hardware reads them (what an MX quantisation leaves in HBM):

* ``lhsT`` ``[K/4, M]`` and ``rhs`` ``[K/4, N]`` of quad-packed elements (``float8_e4m3fn_x4``,
  ``float8_e5m2_x4``: four fp8 bytes in 32 bits; ``float4_e2m1fn_x4``: four fp4 nibbles in 16).
  Row ``128·t + p`` of k-tile ``t`` holds its four contraction values at partition ``p``;
* ``lhsT_scale`` ``[K/32, M]`` and ``rhs_scale`` ``[K/32, N]``: one uint8 E8M0 scale (2**(s-127))
  per 32 contraction values, group ``g`` of k-tile ``t`` at row ``16·t + g``. A group is 8
  partitions x 4 values (partitions ``8g .. 8g+7``); in SBUF its scale sits at partition
  ``32·(g//4) + g%4`` of the scale tile (:class:`trnsim.isa.MatMulMx`), so each k-tile's scales
  are loaded as four [4, cols] pieces, one per 32-partition quadrant.

A torch MX tensor (32 consecutive K values per scale) maps onto this by numbering K inside a
k-tile as the 32-value groups go (value ``r`` of group ``g`` is partition ``8g + r//4``, byte
``r%4``): the same order for both operands, so the products summed are the same.

Schedule: the output is cut into column blocks of whole PSUM banks (512 fp32 columns each, as many
as half of SBUF holds the rhs k-tiles and scales of, up to half the banks) that stay resident,
and row tiles of 128 whose lhsT k-tiles stream through a double-buffered pool on their own DMA
queue; each stationary k-tile serves every bank of its row before it changes, each [128, 512]
output tile accumulates over K in one PSUM group, is evacuated alternately by VectorE and
ScalarE (rounding to the output dtype) and stored on GpSimd's queue. When K is too long for one
bank's rhs to stay, both operands stream k-tile by k-tile.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..config import ChipConfig
from ..isa import KernelError
from ..builder.kernel import Kernel
from ..native.dtypes import get_dtype
from .registry import checked_dims, checked_dtype, register_kernel, split_dims

__all__ = ["build_matmul_mx", "K_TILE", "pack_k"]

_DTYPES = ("mxfp8_e4m3fn", "mxfp8_e5m2", "mxfp4")
K_TILE = 512  # contraction values per nc_matmul_mx: 128 partitions x 4
_GROUPS = 16  # 32-value scale groups per k-tile
_N_TILE = 512  # moving free size: one PSUM bank of fp32
_LHS_Q, _RHS_Q, _SCALE_Q = 0, 1, 2


def pack_k(k: int) -> int:
    """Partitions a contraction of ``k`` values takes in its last k-tile (k a multiple of 128)."""
    rem = k % K_TILE or K_TILE
    return rem // 4


def _out_dtype(name: str, out_dtype: str | None) -> Any:
    try:
        dt = get_dtype("bfloat16" if out_dtype in (None, "", "auto") else out_dtype)
    except ValueError as e:
        raise KernelError(f"{name}: out_dtype: {e}") from None
    if dt.name not in ("bfloat16", "float32", "float16"):
        raise KernelError(f"{name}: out_dtype {dt.short}: expected bf16, fp16 or fp32")
    return dt


# ---- values: random finite MX operands and the numpy definition -----------------------------
_FP4 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])


def _inputs(shape: tuple[int, ...], dtype: str, params: Any, rng: np.random.Generator) -> dict[str, np.ndarray]:
    m, k, n = shape
    dt = get_dtype(dtype)
    out = {}
    for name, cols in (("lhsT", m), ("rhs", n)):
        if dt.name == "float4_e2m1fn_x4":
            nib = rng.integers(0, 16, (k // 4, cols, 4))
            out[name] = (nib[..., 0] | nib[..., 1] << 4 | nib[..., 2] << 8 | nib[..., 3] << 12).astype(np.uint16)
        else:
            import ml_dtypes

            fp8 = ml_dtypes.float8_e5m2 if dt.name == "float8_e5m2_x4" else ml_dtypes.float8_e4m3fn
            vals = rng.standard_normal((k // 4, cols, 4)).astype(fp8)
            out[name] = np.ascontiguousarray(vals).view(np.uint8).reshape(k // 4, cols, 4).view(np.uint32)[..., 0]
        out[f"{name}_scale"] = rng.integers(124, 131, (k // 32, cols)).astype(np.uint8)
    return out


def _dequantize(raw: np.ndarray, scales: np.ndarray, dtype: str, k: int) -> np.ndarray:
    """[K, cols] float64 in the kernel's K order (k-tile t, byte j, partition p -> 512 t + 128 j + p)."""
    import ml_dtypes

    cols = raw.shape[1]
    if dtype == "float4_e2m1fn_x4":
        vals = _FP4[np.stack([(raw >> (4 * j)) & 0xF for j in range(4)], axis=-1)]
    else:
        fp8 = ml_dtypes.float8_e5m2 if dtype == "float8_e5m2_x4" else ml_dtypes.float8_e4m3fn
        vals = np.ascontiguousarray(raw).view(np.uint8).reshape(raw.shape + (4,)).view(fp8).astype(np.float64)
    rows = np.arange(k // 4)
    group = (rows // 128) * _GROUPS + (rows % 128) // 8  # the scale row of each packed row
    s = scales[group].astype(np.float64)
    vals = vals * np.where(s == 255, np.nan, np.exp2(s - 127))[:, :, None]
    out = np.zeros((k, cols))
    for t0 in range(0, k // 4, 128):  # one k-tile of p partitions: value j of partition i is K row j*p + i
        p = min(128, k // 4 - t0)
        for j in range(4):
            out[4 * t0 + j * p:4 * t0 + (j + 1) * p] = vals[t0:t0 + p, :, j]
    return out


def _reference(inputs: dict[str, np.ndarray], shape: tuple[int, ...], dtype: str, params: Any) -> dict[str, np.ndarray]:
    m, k, n = shape
    name = get_dtype(dtype).name
    a = _dequantize(inputs["lhsT"], inputs["lhsT_scale"], name, k)
    b = _dequantize(inputs["rhs"], inputs["rhs_scale"], name, k)
    return {"out": a.T @ b}


def _tolerance(dtype: str) -> tuple[float, float]:
    return 2e-2, 2e-2  # fp32 sums in another order, rounded to the bf16 output


# ---- the kernel ---------------------------------------------------------------------------------
@register_kernel("matmul_mx", dims="MxKxN", dtypes=_DTYPES, default_shape=(4096, 4096, 4096),
                 summary="MX matmul (trn3): quad-packed MXFP8/MXFP4 lhsT[K/4,M], rhs[K/4,N] and E8M0 scales on "
                         "nc_matmul_mx, K = 512 per instruction; K a multiple of 128",
                 params={"out_dtype": "auto"}, inputs=_inputs, reference=_reference, tolerance=_tolerance,
                 split=lambda shape, params, n: split_dims(*((0, 2) if shape[0] >= shape[2] else (2, 0)))(shape,
                                                                                                          params, n))
def build_matmul_mx(m: int, k: int, n: int, dtype: str = "mxfp8_e4m3fn", config: ChipConfig | str = "trn3",
                    out_dtype: str | None = "auto", name: str = "matmul_mx") -> Kernel:
    """``out[M, N]`` (bf16 by default) from the packed operands and scales described above."""
    checked_dims(name, M=m, K=k, N=n)
    if k % 128:
        raise KernelError(f"{name}: K={k} must be a multiple of 128 (whole 32-partition scale quadrants of 4 values)")
    kern = Kernel(name, config)
    cfg = kern.config
    if not cfg.core.tensor.mx_quad:
        raise KernelError(f"{name}: {cfg.name} has no MX matmul (core.tensor.mx_quad is false; it needs "
                          f"NeuronCore-v4)")
    dt = checked_dtype(name, dtype, _DTYPES)
    odt = _out_dtype(name, out_dtype)
    tm = min(cfg.core.tensor.stationary_max_free, 128)
    kt_n = -(-k // K_TILE)
    lhsT = kern.input("lhsT", (k // 4, m), dt)
    rhs = kern.input("rhs", (k // 4, n), dt)
    lhs_s = kern.input("lhsT_scale", (k // 32, m), "uint8")
    rhs_s = kern.input("rhs_scale", (k // 32, n), "uint8")
    out = kern.output("out", (m, n), odt)
    # column blocks of whole PSUM banks whose rhs k-tiles and scales stay resident in half of SBUF
    # (as wide as that allows: lhsT is then loaded once per column block); with too long a K for
    # one bank's width, both operands stream k-tile by k-tile
    per_col = kt_n * (dt.itemsize + 1)
    bn = min(-(-n // _N_TILE) * _N_TILE, max(_N_TILE, cfg.core.sbuf.partition_bytes // 2 // per_col // _N_TILE * _N_TILE),
             (cfg.core.psum.banks // 2) * _N_TILE)
    resident = kt_n * _N_TILE * (dt.itemsize + 1) <= cfg.core.sbuf.partition_bytes // 2
    if not resident:
        bn = _N_TILE
    rhs_pool = kern.tile_pool("rhs", bufs=kt_n if resident else 4)
    rhs_spool = kern.tile_pool("rhs_scale", bufs=kt_n if resident else 4)
    lhs_pool = kern.tile_pool("lhsT", bufs=2 * kt_n if resident else 4)
    lhs_spool = kern.tile_pool("lhsT_scale", bufs=2 * kt_n if resident else 4)
    acc_pool = kern.tile_pool("acc", bufs=2 * (bn // _N_TILE), space="psum")
    res_pool = kern.tile_pool("res", bufs=2 * (bn // _N_TILE))
    evac = 0

    def load(pool: Any, spool: Any, data: Any, scales: Any, t: int, c0: int, cols: int, queue: int) -> tuple[Any, Any]:
        parts = min(128, k // 4 - 128 * t)
        tile = pool.tile((128, cols), dt)[:parts]
        kern.dma_copy(tile, data[128 * t:128 * t + parts, c0:c0 + cols], queue=queue)
        st = spool.tile((128, cols), "uint8")
        for quad in range(parts // 32):  # groups 4q..4q+3 of the k-tile at partitions 32q..32q+3
            row = _GROUPS * t + 4 * quad
            kern.dma_copy(st[32 * quad:32 * quad + 4], scales[row:row + 4, c0:c0 + cols], queue=_SCALE_Q)
        return tile, st[:32 * ((parts - 1) // 32) + 4]

    for n0 in range(0, n, bn):
        nw = min(bn, n - n0)
        subs = [(c0, min(_N_TILE, nw - c0)) for c0 in range(0, nw, _N_TILE)]
        kept = [load(rhs_pool, rhs_spool, rhs, rhs_s, t, n0, nw, _RHS_Q) for t in range(kt_n)] if resident else None
        for m0 in range(0, m, tm):
            mw = min(tm, m - m0)
            accs = [acc_pool.tile((tm, _N_TILE), "fp32")[:mw, :w] for _, w in subs]
            for t in range(kt_n):
                a, sa = load(lhs_pool, lhs_spool, lhsT, lhs_s, t, m0, mw, _LHS_Q)
                b, sb = kept[t] if kept is not None else load(rhs_pool, rhs_spool, rhs, rhs_s, t, n0, nw, _RHS_Q)
                for (c0, w), acc in zip(subs, accs):  # the stationary serves every bank before it changes
                    kern.nc_matmul_mx(acc, a, b[:, c0:c0 + w], sa, sb[:, c0:c0 + w], accumulate=t > 0)
            for (c0, w), acc in zip(subs, accs):
                res = res_pool.tile((tm, _N_TILE), odt)[:mw, :w]
                kern.tensor_copy(res, acc, engine="vector" if evac % 2 == 0 else "scalar")
                evac += 1
                kern.dma_copy(out[m0:m0 + mw, n0 + c0:n0 + c0 + w], res, engine="gpsimd", queue=3)
    return kern
