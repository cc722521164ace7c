"""``bmm_packed``: many small matmuls ``out[b] = A[b] @ B[b]`` (M, K <= 128, N <= 512), packed.

The general ``bmm`` kernel treats each batch item as a matmul of its own: its loads, a PSUM
accumulation group, an evacuation and a store, each paying a DMA's fixed cost, so a batch of
192 tiny problems (attention with small heads, grouped convolutions) costs ~2 us per item
whatever its size. An NKI author packs small problems instead:

* **loads**: G items share one DMA per operand. A ``rhs``/``lhsT`` operand ([K, N] per item) is
  loaded as one ``[K, G, N]`` tile (K on partitions, the items side by side on the free axis);
  an operand stored the other way round (``a[M, K]``, ``b[N, K]``: the torch layouts of
  ``x @ w`` and ``q @ k.T``) is loaded with its rows stacked on partitions (G·rows <= 128, one
  contiguous DMA) and turned with one PE transpose per 128 rows, so K reaches the partitions
  for all G items at once;
* **PSUM**: the G results ``[M, N]`` are written side by side into one bank (G·N <= 512 fp32),
  so one evacuation per group drains them all;
* **stores**: one DMA per group writes ``[M, G, N]`` back to ``out[b0:b0+G]``.

The matmuls stay one instruction per item (K and M use the PE array's partitions and columns as
the item needs them); their issue interval, ``max(N, 64)`` cycles, is what the PE array costs.
Groups are double-buffered so group g+1 loads while group g computes; loads use two DMA queues
(one per operand) and stores a third, on other engines' sequencers, as the matmul kernel does.
"""

from __future__ import annotations

from typing import Any


from ..config import ChipConfig
from ..isa import KernelError, TileAP
from ..builder.kernel import Kernel
from .matmul import MATMUL_DTYPES, MATMUL_PARAMS, mm_inputs, mm_reference, matmul_out_dtype
from .registry import checked_dims, checked_dtype, register_kernel, split_dims

__all__ = ["build_bmm_packed", "fits_packed", "group_size"]

_A_Q, _B_Q, _STORE_Q = 0, 1, 2


def fits_packed(m: int, k: int, n: int, config: ChipConfig) -> bool:
    """True when one item fits the kernel: K on one contraction tile, M on the stationary's
    columns, N in one PSUM bank of fp32."""
    t = config.core.tensor
    bank = config.core.psum.bank_bytes // 4
    return k <= t.max_contraction and m <= t.stationary_max_free and n <= min(t.moving_max_free, bank)


def group_size(batch: int, m: int, k: int, n: int, config: ChipConfig, transpose_a: bool, transpose_b: bool) -> int:
    """Items per group: their results share one PSUM bank (G·N <= 512) and, for an operand
    loaded row-stacked, one PE transpose holds whole items (G·rows <= 128)."""
    parts = config.core.tensor.max_contraction
    bank = config.core.psum.bank_bytes // 4
    g = max(1, bank // n)
    if transpose_a:
        g = min(g, max(1, parts // m))
    if transpose_b:
        g = min(g, max(1, parts // n))
    return max(1, min(g, batch))


def _load_direct(kern: Kernel, tile: TileAP, src: Any, b0: int, g: int, k: int, cols: int, queue: int) -> None:
    """``src[b0:b0+g]`` ([g, K, cols] in HBM) -> ``tile[K, g·cols]`` in one DMA."""
    view = src.ap(b0 * k * cols, [[cols, k], [k * cols, g], [1, cols]])
    kern.dma_copy(tile[:k, :g * cols].reshape(k, g, cols), view, engine="sync" if queue == _A_Q else "scalar",
                  queue=queue)


def _load_rows_t(kern: Kernel, tile: TileAP, raws: Any, tr: Any, src: Any, b0: int, g: int, k: int, rows: int,
                 queue: int, evac: list[int]) -> None:
    """``src[b0:b0+g]`` ([g, rows, K] in HBM) -> ``tile[K, g·rows]``: the items' rows stacked on
    partitions, 128 at a time (one contiguous DMA each), each block turned by one PE transpose
    into PSUM and copied into its columns."""
    parts = kern.config.core.tensor.max_contraction
    total = g * rows
    for j0 in range(0, total, parts):
        j1 = min(total, j0 + parts)
        raw = raws.tile((parts, k), tile.dtype)
        kern.dma_copy(raw[:j1 - j0, :k], src.ap((b0 * rows + j0) * k, [[k, j1 - j0], [1, k]]),
                      engine="sync" if queue == _A_Q else "scalar", queue=queue)
        ps = tr.tile((k, parts), "float32" if tile.dtype.name == "float32" else tile.dtype.name)
        kern.nc_transpose(ps[:k, :j1 - j0], raw[:j1 - j0, :k])
        evac[0] += 1
        kern.tensor_copy(tile[:k, j0:j1], ps[:k, :j1 - j0], engine="vector" if evac[0] % 2 else "scalar")


def build_bmm_packed(batch: int, m: int, k: int, n: int, dtype: str = "bf16", config: ChipConfig | str = "trn2",
                     transpose_a: bool = False, transpose_b: bool = False, out_dtype: str | None = "auto",
                     name: str = "bmm_packed") -> Kernel:
    """Inputs ``lhsT[B, K, M]`` (or ``a[B, M, K]`` with ``transpose_a``) and ``rhs[B, K, N]`` (or
    ``b[B, N, K]`` with ``transpose_b``); output ``out[B, M, N]`` (bf16; fp32 for fp32 inputs)."""
    checked_dims(name, B=batch, M=m, K=k, N=n)
    kern = Kernel(name, config)
    cfg = kern.config
    dt = checked_dtype(name, dtype, MATMUL_DTYPES)
    if not fits_packed(m, k, n, cfg):
        t = cfg.core.tensor
        raise KernelError(f"{name}: items of M={m}, K={k}, N={n} do not fit one PE pass (M <= {t.stationary_max_free}, "
                          f"K <= {t.max_contraction}, N <= {cfg.core.psum.bank_bytes // 4}); use bmm")
    odt = matmul_out_dtype(name, dt, out_dtype)
    g_max = group_size(batch, m, k, n, cfg, bool(transpose_a), bool(transpose_b))
    a = kern.input("a", (batch, m, k), dt) if transpose_a else kern.input("lhsT", (batch, k, m), dt)
    b = kern.input("b", (batch, n, k), dt) if transpose_b else kern.input("rhs", (batch, k, n), dt)
    out = kern.output("out", (batch, m, n), odt)
    parts = cfg.core.tensor.max_contraction
    stat = kern.tile_pool("stat", bufs=2)
    mov = kern.tile_pool("mov", bufs=2)
    res = kern.tile_pool("res", bufs=2)
    acc = kern.tile_pool("acc", bufs=2, space="psum")
    raw_a = kern.tile_pool("raw_a", bufs=4) if transpose_a else None
    raw_b = kern.tile_pool("raw_b", bufs=4) if transpose_b else None
    tr = kern.tile_pool("tr", bufs=2, space="psum") if transpose_a or transpose_b else None
    evac = [0]
    for b0 in range(0, batch, g_max):
        g = min(g_max, batch - b0)
        st = stat.tile((parts, g_max * m), dt)
        mv = mov.tile((parts, g_max * n), dt)
        if transpose_a:
            _load_rows_t(kern, st, raw_a, tr, a, b0, g, k, m, _A_Q, evac)
        else:
            _load_direct(kern, st, a, b0, g, k, m, _A_Q)
        if transpose_b:
            _load_rows_t(kern, mv, raw_b, tr, b, b0, g, k, n, _B_Q, evac)
        else:
            _load_direct(kern, mv, b, b0, g, k, n, _B_Q)
        ps = acc.tile((m, g_max * n), "float32")
        for i in range(g):
            kern.nc_matmul(ps[:m, i * n:(i + 1) * n], st[:k, i * m:(i + 1) * m], mv[:k, i * n:(i + 1) * n])
        r = res.tile((m, g_max * n), odt)
        evac[0] += 1
        kern.tensor_copy(r[:m, :g * n], ps[:m, :g * n], engine="vector" if evac[0] % 2 else "scalar")
        kern.dma_copy(out.ap(b0 * m * n, [[n, m], [m * n, g], [1, n]]), r[:m, :g * n].reshape(m, g, n),
                      engine="gpsimd", queue=_STORE_Q)
    return kern


@register_kernel("bmm_packed", dims="BxMxKxN", dtypes=MATMUL_DTYPES, default_shape=(192, 11, 16, 11),
                 summary="many small matmuls (M,K<=128, N<=512): G items per DMA, PSUM bank and store",
                 params=MATMUL_PARAMS, inputs=mm_inputs, reference=mm_reference, split=split_dims(0))
def _registered(batch: int, m: int, k: int, n: int, dtype: str = "bf16", config: ChipConfig | str = "trn2",
                transpose_a: bool = False, transpose_b: bool = False, out_dtype: str | None = "auto") -> Kernel:
    return build_bmm_packed(batch, m, k, n, dtype, config, transpose_a, transpose_b, out_dtype)
