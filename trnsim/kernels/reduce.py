"""``reduce``: sum / max / min / mean of a [rows, cols] tensor along one axis, as an NKI author
would write it.

* ``axis=1`` (along a row) is a free-axis reduction: each partition holds ``g`` whole rows
  (the elementwise kernels' grouped-row tiling, so narrow rows still move in big DMA
  descriptors) and one ``tensor_reduce`` over the last free axis yields ``g`` results per
  partition. Rows wider than a tile are reduced in column tiles into an fp32 partial per tile,
  then the partials are reduced. Tiles alternate between VectorE and GpSimd.
* ``axis=0`` (down a column) crosses partitions, which no Vector/Scalar/GpSimd instruction does.
  Sums go through TensorE: ``ones[K, 1]ᵀ @ x[K, N]`` adds the K rows of a tile into a [1, N]
  PSUM row, and successive rows and row tiles accumulate in the same PSUM accumulation group
  (fp32). Max and min are combined elementwise across row tiles on VectorE and GpSimd into
  [128, W] running results (exact in the input dtype), which are then turned with
  ``nc_transpose`` (columns onto partitions) and reduced along the free axis. Narrow tensors use
  grouped rows here too, so a partition's DMA is one contiguous block.

Accumulation is fp32 throughout; the result is rounded once to the output dtype (the input's).
The output is 1-D, as numpy's ``x.sum(axis)``: ``[rows]`` for axis=1, ``[cols]`` for axis=0.
"""

from __future__ import annotations

import numpy as np

from ..config import ChipConfig
from ..isa import HbmTensor, KernelError, TileAP
from ..builder.kernel import Kernel, TilePool
from ..native.dtypes import Dtype
from .elementwise import (DTYPES, Piece, checked_bufs, checked_choice, compute_engines, hbm_piece,
                          kernel_dtype, row_pieces, tile_free_elems)
from .reference import round_to
from .registry import register_kernel, split_dims

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
                 params={"op": "sum", "axis": 1, "tile_bytes": 16384, "bufs": 4, "split": True},
                 inputs=_inputs, reference=_reference,
                 split=lambda shape, params, n: split_dims(1 if params["axis"] == 0 else 0)(shape, params, n))
def build_reduce(rows: int, cols: int, dtype: str = "bf16", config: ChipConfig | str = "trn2", op: str = "sum",
                 axis: int = 1, tile_bytes: int = 16384, bufs: int = 4, split: bool = True) -> Kernel:
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
        _reduce_rows(kern, x, out, dt, op, max_free, bufs, split)
    elif op in ("sum", "mean"):
        _sum_columns(kern, x, out, dt, op, max_free, bufs)
    else:
        _extreme_columns(kern, x, out, dt, op, max_free, bufs, split)
    return kern


def _reduce_rows(kern: Kernel, x: HbmTensor, out: HbmTensor, dt: Dtype, op: str, max_free: int, bufs: int,
                 split: bool) -> None:
    rows, cols = x.shape
    alu = _ALU[op]
    pool = kern.tile_pool("x", bufs=bufs)
    res_pool = kern.tile_pool("res", bufs=bufs)
    mean = op == "mean"
    acc_dt = "fp32" if mean else dt  # a mean divides the fp32 sum, then rounds once
    # VectorE reduces bf16 -> bf16 add/max at N/2 cycles, 3x GpSimd's N at 1.2 GHz: it takes three
    # tiles in four; otherwise VectorE's N cycles at 0.96-1.2 GHz match GpSimd's and they alternate
    fast = dt.name == "bfloat16" and not mean and alu in ("add", "max")
    engines = compute_engines(dt, split) if fast else ("vector", "gpsimd") if split else ("vector",)
    if cols <= max_free:  # whole rows per tile: one instruction gives g results per partition
        for i, pc in enumerate(row_pieces(rows, cols, max_free, kern.config.core.sbuf.partitions)):
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
    for r0 in range(0, rows, kern.config.core.sbuf.partitions):
        p = min(kern.config.core.sbuf.partitions, rows - r0)
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
           res_pool: TilePool) -> None:
    """Store per-partition results [p, g] (rows r0 .. r0 + p*g); a mean first divides by ``n``."""
    if op == "mean":
        mean = res_pool.tile((p, g), dt)
        kern.tensor_scalar(mean, res, "divide", float(n))
        res = mean
    view = out[r0:r0 + p * g]
    kern.dma_copy(view.reshape(p, g) if g > 1 else view, res, engine="scalar", queue=0)


def _column_pieces(rows: int, cols: int, max_free: int, width: int, partitions: int) -> list[Piece]:
    """Pieces for a reduction down the columns: grouped rows when a row fits in ``width``
    columns, else column blocks of ``width`` (the outer loop) cut into partition-row tiles."""
    if cols <= min(max_free, width):
        return list(row_pieces(rows, cols, max_free, partitions))
    return list(row_pieces(rows, cols, min(max_free, width), partitions))


def _column_blocks(pieces: list[Piece]) -> list[list[Piece]]:
    blocks: list[list[Piece]] = []
    for pc in pieces:
        if not blocks or (blocks[-1][0].c0, blocks[-1][0].cols) != (pc.c0, pc.cols):
            blocks.append([])
        blocks[-1].append(pc)
    return blocks


def _sum_columns(kern: Kernel, x: HbmTensor, out: HbmTensor, dt: Dtype, op: str, max_free: int, bufs: int) -> None:
    """Column sums on TensorE: ``ones[p, 1]ᵀ @ x[p, n]`` for each row a partition holds,
    accumulated in one PSUM accumulation group per column chunk (fp32)."""
    rows, cols = x.shape
    cfg = kern.config
    tn = min(cfg.core.tensor.moving_max_free, cfg.core.psum.bank_bytes // 4)  # one fp32 PSUM bank
    banks = max(1, cfg.core.psum.banks // 2)  # half the banks, so the next block overlaps evacuation
    ones = kern.sbuf((kern.config.core.sbuf.partitions, 1), dt, name="ones")  # TensorE takes bf16/fp16/fp32 as they are
    kern.memset(ones, 1.0)
    pool = kern.tile_pool("x", bufs=bufs)
    psum = kern.tile_pool("acc", bufs=2 * banks, space="psum")
    res_pool = kern.tile_pool("res", bufs=2)
    i = 0
    parts = kern.config.core.sbuf.partitions
    for block in _column_blocks(_column_pieces(rows, cols, max_free, tn * banks, parts)):
        c0, w = block[0].c0, block[0].cols
        accs = [psum.tile((1, min(tn, w - k)), "fp32") for k in range(0, w, tn)]
        first = True
        for pc in block:
            t = pool.tile((pc.p, pc.free), dt)
            kern.dma_copy(t, hbm_piece(x, pc), queue=i % 2)
            i += 1
            for j in range(pc.g):
                for k, acc in enumerate(accs):
                    lo = j * w + k * tn
                    kern.nc_matmul(acc, ones[:pc.p], t[:, lo:lo + acc.free_size], accumulate=not first)
                first = False
        res = res_pool.tile((1, w), dt)
        for k, acc in enumerate(accs):
            dst = res[:, k * tn:k * tn + acc.free_size]
            eng = "vector" if k % 2 == 0 else "scalar"
            if op == "mean":
                kern.tensor_scalar(dst, acc, "divide", float(rows), engine=eng)
            else:
                kern.tensor_copy(dst, acc, engine=eng)
        kern.dma_copy(out[c0:c0 + w], res, engine="gpsimd", queue=0)


def _extreme_columns(kern: Kernel, x: HbmTensor, out: HbmTensor, dt: Dtype, op: str, max_free: int,
                     bufs: int, split: bool) -> None:
    """Column max/min (exact in the input dtype): each tile's grouped rows are first reduced to
    one row per partition, then combined into a running [128, w] result per engine; the
    engines' results are combined, turned with ``nc_transpose`` (columns onto partitions) and
    reduced along the free axis."""
    rows, cols = x.shape
    alu = _ALU[op]
    # VectorE does a 16-bit tensor_tensor in N cycles at 0.96-1.2 GHz, GpSimd in 2N at 1.2 GHz
    # (§7, §4.3): Vector takes two tiles for GpSimd's one; for fp32 (2N on both) they alternate
    engines = (("vector", "vector", "gpsimd") if dt.itemsize == 2 else ("vector", "gpsimd")) if split else ("vector",)
    pool = kern.tile_pool("x", bufs=bufs)
    red_pool = kern.tile_pool("rowred", bufs=2)
    acc_pool = kern.tile_pool("acc", bufs=4)
    tp_pool = kern.tile_pool("tp", bufs=2, space="psum")
    res_pool = kern.tile_pool("res", bufs=2)
    i = 0
    parts = kern.config.core.sbuf.partitions
    for block in _column_blocks(_column_pieces(rows, cols, max_free, max_free, parts)):
        c0, w = block[0].c0, block[0].cols
        accs: dict[str, TileAP] = {}
        for n, pc in enumerate(block):
            t = pool.tile((pc.p, pc.free), dt)
            kern.dma_copy(t, hbm_piece(x, pc), queue=i % 2)
            i += 1
            # a ragged last row tile joins the first engine's result, which has every partition
            eng = engines[n % len(engines)] if pc.p == kern.config.core.sbuf.partitions or n == 0 else engines[0]
            part = t
            if pc.g > 1:
                part = red_pool.tile((pc.p, w), dt)
                kern.tensor_reduce(part, alu, t.reshape(pc.p, pc.g, w), axis=1, engine=eng)
            if eng not in accs:
                accs[eng] = acc_pool.tile((pc.p, w), dt)
                kern.tensor_copy(accs[eng], part, engine=eng)
            else:
                acc = accs[eng][:pc.p]
                kern.tensor_tensor(acc, acc, part, alu, engine=eng)
        acc, *others = accs.values()
        for other in others:
            kern.tensor_tensor(acc, acc, other, alu)
        _reduce_partitions(kern, out, c0, acc, alu, dt, tp_pool, res_pool)


def _reduce_partitions(kern: Kernel, out: HbmTensor, c0: int, acc: TileAP, alu: str, dt: Dtype, tp_pool: TilePool,
                       res_pool: TilePool) -> None:
    """``out[c0 + c] = alu over partitions of acc[:, c]``: turn 128-column slices onto partitions
    with ``nc_transpose``, as many per PSUM bank as fit, and reduce each bank with one
    instruction; result ``res[c, k]`` is column ``k*128 + c``, stored with one strided DMA."""
    pe = kern.config.core.tensor.stationary_max_free
    p0, w = acc.p_count, acc.free_size
    per_bank = max(1, kern.config.core.psum.bank_bytes // (p0 * dt.itemsize))
    full, rag = divmod(w, pe)
    res = res_pool.tile((pe, full + (1 if rag else 0)), dt)
    for k0 in range(0, full, per_bank):
        nb = min(per_bank, full - k0)
        tp = tp_pool.tile((pe, nb * p0), dt)
        for k in range(nb):
            kern.nc_transpose(tp[:, k * p0:(k + 1) * p0], acc[:, (k0 + k) * pe:(k0 + k + 1) * pe])
        kern.tensor_reduce(res[:, k0:k0 + nb], alu, tp.reshape(pe, nb, p0), axis=2)
    if full:
        kern.dma_copy(out.ap(c0, [[1, pe], [pe, full]]), res[:, :full], engine="gpsimd", queue=0)
    if rag:
        tp = tp_pool.tile((rag, p0), dt)
        kern.nc_transpose(tp, acc[:, full * pe:])
        kern.tensor_reduce(res[:rag, full:full + 1], alu, tp, axis=1)
        kern.dma_copy(out[c0 + full * pe:c0 + w], res[:rag, full:full + 1], engine="gpsimd", queue=0)
