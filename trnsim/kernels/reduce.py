"""``reduce``: sum / max / min / mean of a [rows, cols] tensor along one axis, as an NKI author
would write it.

* ``axis=1`` (along a row) is a free-axis reduction: each partition holds ``g`` whole rows
  (the elementwise kernels' grouped-row tiling, so narrow rows still move in big DMA
  descriptors) and one ``tensor_reduce`` over the last free axis yields ``g`` results per
  partition. Rows wider than a tile are reduced in column tiles into an fp32 partial per tile,
  then the partials are reduced. Tiles alternate between VectorE and GpSimd.
* ``axis=0`` (down a column) crosses partitions, which no Vector/Scalar/GpSimd instruction does.
  Sums go through TensorE: ``ones[K, 1]ᵀ @ x[K, N]`` adds the K rows of a tile into a [1, N]
  PSUM row, and successive row tiles accumulate in the same PSUM accumulation group (fp32).
  Max and min are combined elementwise across row tiles on VectorE into a [128, W] fp32
  running result, which is then turned with ``nc_transpose`` (columns onto partitions) and
  reduced along the free axis.

Accumulation is fp32 throughout; the result is rounded once to the output dtype (the input's).
The output is 1-D, as numpy's ``x.sum(axis)``: ``[rows]`` for axis=1, ``[cols]`` for axis=0.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..config import ChipConfig
from ..isa import HbmTensor, KernelError, TileAP
from ..kernel import Kernel
from ..native.dtypes import Dtype
from .elementwise import (DTYPES, PARTITIONS, checked_bufs, checked_choice, kernel_dtype, compute_engines, hbm_piece, row_pieces,
                          tile_free_elems)
from .registry import register_kernel, round_to

__all__ = ["build_reduce"]

REDUCE_OPS = ("sum", "max", "min", "mean")
_ALU = {"sum": "add", "mean": "add", "max": "max", "min": "min"}
_NUMPY = {"sum": np.sum, "mean": np.mean, "max": np.max, "min": np.min}


def _inputs(shape, dtype, params, rng):
    return {"x": rng.standard_normal(shape).astype(np.float32)}


def _reference(inputs, shape, dtype, params):
    return {"out": _NUMPY[params["op"]](round_to(inputs["x"], dtype), axis=params["axis"])}


@register_kernel("reduce", dims="rowsxcols", dtypes=DTYPES, default_shape=(4096, 4096),
                 summary="out = op(x, axis): sum/max/min/mean; axis=1 on VectorE/GpSimd, "
                         "axis=0 through TensorE (ones-vector matmul, or transpose for max/min)",
                 params={"op": "sum", "axis": 1, "tile_bytes": 16384, "bufs": 3, "split": True},
                 inputs=_inputs, reference=_reference)
def build_reduce(rows: int, cols: int, dtype: str = "bf16", config: ChipConfig | str = "trn2", op: str = "sum",
                 axis: int = 1, tile_bytes: int = 16384, bufs: int = 3, split: bool = True) -> Kernel:
    what = "reduce"
    op = checked_choice(op, REDUCE_OPS, f"{what}: op")
    if axis not in (0, 1) or isinstance(axis, bool):
        raise KernelError(f"{what}: axis must be 0 (down the columns) or 1 (along the rows), got {axis!r}")
    dt = kernel_dtype(dtype, what)
    kern = Kernel(f"reduce_{op}_axis{axis}", config)
    x = kern.input("x", (rows, cols), dt)
    out = kern.output("out", (cols,) if axis == 0 else (rows,), dt)
    max_free = tile_free_elems(tile_bytes, dt, what)
    bufs = checked_bufs(bufs, what)
    if axis == 1:
        _reduce_rows(kern, x, out, dt, op, max_free, bufs, compute_engines(dt, split))
    elif op in ("sum", "mean"):
        _sum_columns(kern, x, out, dt, op, max_free, bufs)
    else:
        _extreme_columns(kern, x, out, dt, op, max_free, bufs)
    return kern


def _reduce_rows(kern: Kernel, x: HbmTensor, out: HbmTensor, dt: Dtype, op: str, max_free: int, bufs: int,
                 engines: tuple[str, ...]) -> None:
    rows, cols = x.shape
    alu = _ALU[op]
    pool = kern.tile_pool("x", bufs=bufs)
    res_pool = kern.tile_pool("res", bufs=bufs)
    acc_dt = "fp32" if op == "mean" else dt  # a mean divides the fp32 sum, then rounds once
    if cols <= max_free:  # whole rows per tile: one instruction gives g results per partition
        for i, pc in enumerate(row_pieces(rows, cols, max_free)):
            t = pool.tile((pc.p, pc.free), dt)
            kern.dma_copy(t, hbm_piece(x, pc), queue=i % 2)
            res = res_pool.tile((pc.p, pc.g), acc_dt)
            kern.tensor_reduce(res, alu, t.reshape(pc.p, pc.g, pc.cols), axis=2, engine=engines[i % len(engines)])
            _store(kern, out, pc.r0, pc.p, pc.g, res, dt, op, cols, res_pool)
        return
    # wide rows: reduce each column tile into one fp32 column of a partial, then the partial
    n_ct = -(-cols // max_free)
    part_pool = kern.tile_pool("partial", bufs=2)
    i = 0
    for r0 in range(0, rows, PARTITIONS):
        p = min(PARTITIONS, rows - r0)
        partial = part_pool.tile((p, n_ct), "fp32")
        for j in range(n_ct):
            c0 = j * max_free
            t = pool.tile((p, min(max_free, cols - c0)), dt)
            kern.dma_copy(t, x[r0:r0 + p, c0:c0 + t.free_size], queue=i % 2)
            kern.tensor_reduce(partial[:, j:j + 1], alu, t, axis=1, engine=engines[i % len(engines)])
            i += 1
        res = res_pool.tile((p, 1), acc_dt)
        kern.tensor_reduce(res, alu, partial, axis=1)
        _store(kern, out, r0, p, 1, res, dt, op, cols, res_pool)


def _store(kern: Kernel, out: HbmTensor, r0: int, p: int, g: int, res: TileAP, dt: Dtype, op: str, n: int,
           res_pool: Any) -> None:
    """Store per-partition results [p, g] (rows r0 .. r0 + p*g); a mean first divides by ``n``."""
    if op == "mean":
        mean = res_pool.tile((p, g), dt)
        kern.tensor_scalar(mean, res, "divide", float(n))
        res = mean
    view = out[r0:r0 + p * g]
    kern.dma_copy(view.reshape(p, g) if g > 1 else view, res, engine="scalar", queue=0)


def _sum_columns(kern: Kernel, x: HbmTensor, out: HbmTensor, dt: Dtype, op: str, max_free: int, bufs: int) -> None:
    """Column sums on TensorE: ``ones[p, 1]ᵀ @ x[p, n]`` per row tile, accumulated in PSUM."""
    rows, cols = x.shape
    cfg = kern.config
    tn = min(cfg.core.tensor.moving_max_free, cfg.core.psum.bank_bytes // 4)  # one fp32 PSUM bank
    banks = max(1, min(cfg.core.psum.banks // 2, max_free // tn))
    width = tn * banks  # columns per block: several banks, so each load is a big DMA
    ones = kern.sbuf((PARTITIONS, 1), dt, name="ones")  # TensorE takes bf16/fp16/fp32 as they are
    kern.memset(ones, 1.0)
    pool = kern.tile_pool("x", bufs=bufs)
    psum = kern.tile_pool("acc", bufs=2 * banks, space="psum")
    res_pool = kern.tile_pool("res", bufs=2)
    n_rt = -(-rows // PARTITIONS)
    i = 0
    for c0 in range(0, cols, width):
        w = min(width, cols - c0)
        accs = [psum.tile((1, min(tn, w - k)), "fp32") for k in range(0, w, tn)]
        for rt in range(n_rt):
            r0 = rt * PARTITIONS
            p = min(PARTITIONS, rows - r0)
            t = pool.tile((p, w), dt)
            kern.dma_copy(t, x[r0:r0 + p, c0:c0 + w], queue=i % 2)
            i += 1
            for k, acc in enumerate(accs):
                kern.nc_matmul(acc, ones[:p], t[:, k * tn:k * tn + acc.free_size], accumulate=rt > 0)
        res = res_pool.tile((1, w), dt)
        for k, acc in enumerate(accs):
            dst = res[:, k * tn:k * tn + acc.free_size]
            if op == "mean":
                kern.tensor_scalar(dst, acc, "divide", float(rows), engine="vector" if k % 2 == 0 else "scalar")
            else:
                kern.tensor_copy(dst, acc, engine="vector" if k % 2 == 0 else "scalar")
        kern.dma_copy(out[c0:c0 + w], res, engine="gpsimd", queue=0)


def _extreme_columns(kern: Kernel, x: HbmTensor, out: HbmTensor, dt: Dtype, op: str, max_free: int,
                     bufs: int) -> None:
    """Column max/min: combine row tiles elementwise on VectorE into a [128, w] fp32 running
    result, then put columns on partitions with ``nc_transpose`` and reduce along the free axis."""
    rows, cols = x.shape
    alu = _ALU[op]
    pe = kern.config.core.tensor.stationary_max_free  # columns per transpose
    pool = kern.tile_pool("x", bufs=bufs)
    acc_pool = kern.tile_pool("acc", bufs=2)
    tp_pool = kern.tile_pool("tp", bufs=2, space="psum")
    res_pool = kern.tile_pool("res", bufs=2)
    n_rt = -(-rows // PARTITIONS)
    p0 = min(PARTITIONS, rows)  # partitions holding data in the running result
    i = 0
    for c0 in range(0, cols, max_free):
        w = min(max_free, cols - c0)
        acc = acc_pool.tile((p0, w), "fp32")
        for rt in range(n_rt):
            r0 = rt * PARTITIONS
            p = min(PARTITIONS, rows - r0)
            t = pool.tile((p, w), dt)
            kern.dma_copy(t, x[r0:r0 + p, c0:c0 + w], queue=i % 2)
            i += 1
            if rt == 0:
                kern.tensor_copy(acc, t)
            else:
                kern.tensor_tensor(acc[:p], acc[:p], t, alu)
        for k in range(0, w, pe):
            cb = min(pe, w - k)
            tp = tp_pool.tile((cb, p0), "fp32")
            kern.nc_transpose(tp, acc[:, k:k + cb])
            res = res_pool.tile((cb, 1), dt)
            kern.tensor_reduce(res, alu, tp, axis=1)
            kern.dma_copy(out[c0 + k:c0 + k + cb], res, engine="gpsimd", queue=0)
