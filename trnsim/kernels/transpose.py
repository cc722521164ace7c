"""``transpose``: ``out[cols, rows] = x[rows, cols]ᵀ`` of any shape, through TensorE.

The kernel works on square blocks of ``B`` rows x ``B`` columns (``B = block_bytes`` per
partition, e.g. 2048 bf16 elements for 4 KiB), so both the loads and the stores move at least
``block_bytes`` per partition and per descriptor (datasheet §6: >= 2-4 KiB per partition
saturates a DMA engine; a plain 128x128 tiling would store 256 B rows, deep in the
overhead-bound range). Per block:

* load ``B/128`` row tiles ``[128, B]`` (all queued at once, double-buffered across blocks, on
  two Sync queues);
* for each 128-column slice, ``nc_transpose`` the row tiles' slices into a PSUM bank, as many
  128x128 blocks as it holds (8 bf16, 4 fp32), and evacuate a whole bank per copy on
  VectorE/ScalarE in turn into an SBUF result tile ``[128, B]`` — ``B`` consecutive output
  columns of 128 output rows;
* store the result tile with one DMA triggered from GpSimd.

Narrow rows (``cols < B``) would make each load descriptor a single short row, so a partition
instead loads ``g`` consecutive whole rows at once and the evacuation scatters slice ``j`` to
every ``g``-th output column. Short rows (``rows < B``) would make each store descriptor a short
output row, so a result partition instead gathers ``g`` consecutive output rows, transposing
stride-``g`` column slices of the loaded tile.

``nc_transpose`` moves values bit for bit, and 2-byte types stay 2-byte in PSUM, so the output is
exact for every supported dtype. Ragged edges use fewer partitions or columns.
"""

from __future__ import annotations

import numpy as np

from ..config import ChipConfig
from ..isa import KernelError, TileAP
from ..builder.kernel import Kernel
from .elementwise import DTYPES, checked_bufs, kernel_dtype
from .reference import round_to
from .registry import register_kernel, split_dims

__all__ = ["build_transpose"]


def _inputs(shape, dtype, params, rng):
    return {"x": rng.standard_normal(shape).astype(np.float32)}


def _reference(inputs, shape, dtype, params):
    return {"out": round_to(inputs["x"], dtype).T}


def _exact(dtype: str) -> tuple[float, float]:
    return (0.0, 0.0)


@register_kernel("transpose", dims="rowsxcols", dtypes=DTYPES, default_shape=(4096, 4096),
                 summary="out[cols,rows] = x[rows,cols]^T via TensorE nc_transpose in square blocks",
                 params={"block_bytes": 4096, "bufs": 2}, inputs=_inputs, reference=_reference, tolerance=_exact,
                 split=split_dims(0, 1))
def build_transpose(rows: int, cols: int, dtype: str = "bf16", config: ChipConfig | str = "trn2",
                    block_bytes: int = 4096, bufs: int = 2) -> Kernel:
    what = "transpose"
    dt = kernel_dtype(dtype, what)
    bufs = checked_bufs(bufs, what)
    kern = Kernel("transpose", config)
    cfg = kern.config
    parts = cfg.core.sbuf.partitions
    if isinstance(block_bytes, bool) or not isinstance(block_bytes, int) or block_bytes < parts * dt.itemsize:
        raise KernelError(f"{what}: block_bytes must be an integer >= {parts * dt.itemsize} "
                          f"({parts} {dt.short} elements per partition), got {block_bytes!r}")
    pe = min(cfg.core.tensor.pe_rows, cfg.core.tensor.stationary_max_free)  # block edge per transpose
    bank_cols = cfg.core.psum.bank_bytes // dt.itemsize  # transposed columns one PSUM bank holds
    per_bank = max(1, bank_cols // parts)
    x = kern.input("x", (rows, cols), dt)
    out = kern.output("out", (cols, rows), dt)
    blk = block_bytes // dt.itemsize // parts * parts
    tiles_per_block = -(-min(blk, rows) // parts)
    x_pool = kern.tile_pool("x", bufs=bufs * tiles_per_block)
    o_pool = kern.tile_pool("out", bufs=2 * bufs)  # stores take ~2.5 us to complete; keep several in flight
    ps_pool = kern.tile_pool("tp", bufs=4, space="psum")
    xg_pool = kern.tile_pool("xg", bufs=bufs + 1)
    n_load = n_evac = 0

    def evacuate(dst: TileAP, src: TileAP) -> None:
        nonlocal n_evac
        kern.tensor_copy(dst, src, engine="vector" if n_evac % 2 == 0 else "scalar")
        n_evac += 1

    c_start = 0
    if rows < blk and rows <= bank_cols:
        # short rows: output rows are only `rows` long, so partition i of a result tile takes gc
        # consecutive output rows (x columns gc*i + j, a stride-gc slice of the loaded tile) and
        # stores one contiguous block of gc*rows elements
        gc = min(-(-blk // rows), blk // 16)  # loads of at most 8 blocks' bytes per partition
        span = parts * gc
        while cols - c_start >= span:
            c0 = c_start
            tiles = []
            for rr in range(0, rows, parts):
                p = min(parts, rows - rr)
                t = x_pool.tile((p, span), dt)
                kern.dma_copy(t, x[rr:rr + p, c0:c0 + span], queue=n_load % 2)
                n_load += 1
                tiles.append(t)
            o = o_pool.tile((parts, gc * rows), dt)
            for j in range(gc):
                ps = ps_pool.tile((parts, rows), dt)
                for i, t in enumerate(tiles):
                    kern.nc_transpose(ps[:, i * parts:i * parts + t.p_count], t[:, j::gc])
                evacuate(o[:, j * rows:(j + 1) * rows], ps)
            kern.dma_copy(out[c0:c0 + span, :].reshape(parts, gc * rows), o, engine="gpsimd", queue=0)
            c_start += span
    for c0 in range(c_start, cols, blk):
        w = min(blk, cols - c0)
        r_start = 0
        if w == cols < blk:
            # narrow rows: one load per window of blk rows, partition i holding rows g*i .. g*i+g-1
            # (one contiguous block), so loads are as big as stores; slice j of the tile holds
            # rows g*i + j, which land in every g-th output column
            g = max(blk // parts, min(-(-blk // w), blk // 16))  # loads of >= block_bytes
            hw = parts * g  # rows per window
            while rows - r_start >= hw:
                r0 = r_start
                t = xg_pool.tile((parts, g * w), dt)
                kern.dma_copy(t, x[r0:r0 + hw, :].reshape(parts, g * w), queue=n_load % 2)
                n_load += 1
                for k in range(0, w, pe):
                    cb = min(pe, w - k)
                    o = o_pool.tile((cb, hw), dt)
                    for j0 in range(0, g, per_bank):
                        nb = min(per_bank, g - j0)
                        ps = ps_pool.tile((cb, nb * parts), dt)
                        for jj in range(nb):
                            lo = (j0 + jj) * w + k
                            kern.nc_transpose(ps[:, jj * parts:(jj + 1) * parts], t[:, lo:lo + cb])
                        for jj in range(nb):
                            evacuate(o[:, j0 + jj::g], ps[:, jj * parts:(jj + 1) * parts])
                    kern.dma_copy(out[c0 + k:c0 + k + cb, r0:r0 + hw], o, engine="gpsimd", queue=0)
                r_start += hw
        for r0 in range(r_start, rows, blk):
            h = min(blk, rows - r0)
            tiles = []
            for rr in range(0, h, parts):
                p = min(parts, h - rr)
                t = x_pool.tile((p, w), dt)
                kern.dma_copy(t, x[r0 + rr:r0 + rr + p, c0:c0 + w], queue=n_load % 2)
                n_load += 1
                tiles.append(t)
            for k in range(0, w, pe):
                cb = min(pe, w - k)
                o = o_pool.tile((cb, h), dt)
                for g0 in range(0, len(tiles), per_bank):
                    group = tiles[g0:g0 + per_bank]
                    gw = sum(t.p_count for t in group)
                    ps = ps_pool.tile((cb, gw), dt)
                    off = 0
                    for t in group:
                        kern.nc_transpose(ps[:, off:off + t.p_count], t[:, k:k + cb])
                        off += t.p_count
                    col = g0 * parts
                    evacuate(o[:, col:col + gw], ps)
                kern.dma_copy(out[c0 + k:c0 + k + cb, r0:r0 + h], o, engine="gpsimd", queue=0)
    return kern
