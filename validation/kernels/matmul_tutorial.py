"""The matmul kernels of AWS's NKI matmul tutorials, written for trnsim's builder from the
tutorials' descriptions, so the ledger can predict the figures published for each version.

Sources: aws-neuron-sdk ``nki/tutorials/matrix_multiplication.rst`` at 61e24fff (Trn1: latency and
HFU of four versions, datasheet V1) and ``nki/guides/tutorials/kernel-optimization.rst`` at
81ce03ae (Trn2: TensorE and DMA active % of the tiled, hoisted and blocked versions, V4). Both
compute ``result[M, N] = lhsT[K, M].T @ rhs[K, N]`` in bf16 with fp32 PSUM accumulation on
``[4096, 8192] @ [8192, 8192]``. The loop structures and block sizes are the tutorials' (their
text states them); the code is ours. Called as ``build(M, K, N, dtype=..., config=...)``, the
convention of ``trnsim kernel path.py:function``.

What the Neuron compiler adds to the tutorials' NKI code, and these builds do by hand: tiles
allocated in a loop body rotate through two buffers where two fit in SBUF (so the next
iteration's loads overlap this one's matmuls), loads of the two operands go to two DMA queues,
PSUM is copied out by VectorE and results are stored from a third queue. What the compiler may
also do and these builds do not: merge or hoist the loads of an ``affine_range`` loop (the tiled
kernel's profile on Trn2, TensorE 87% active, suggests it moved far fewer bytes than the loops as
written do).

* :func:`tiled` - output tiles of 128 x 512; for each, the K loop loads one lhsT and one rhs tile
  and multiplies them: every tile is loaded N/512 (lhsT) or M/128 (rhs) times.
* :func:`hoisted` - "Optimization 1: removing redundant loads": for each 128-row block of the
  result every K tile of lhsT is loaded once, and for each 512-column block every K tile of rhs.
* :func:`blocked_free` - "Optimization 2: blocking the free dimensions": blocks of 2 x 128 rows
  and 2 x 512 columns share their loaded lhsT and rhs tiles.
* :func:`fully_optimized` - "Optimization 3": blocks of 16 x 128 rows, 2 x 512 columns and 8 x
  128 of K; each K block's partial sums are added into a result column block kept in SBUF,
  stored once every K block is done.
"""

from __future__ import annotations

import trnsim

TM, TK, TN = 128, 128, 512  # stationary free (rows of the result), contraction, moving free


def _kernel(name: str, m: int, k: int, n: int, dtype: str, config: object, tiles: tuple[int, int, int] = (1, 1, 1)
            ) -> tuple[trnsim.Kernel, object, object, object]:
    bm, bn, bk = TM * tiles[0], TN * tiles[1], TK * tiles[2]
    if m % bm or n % bn or k % bk:
        raise trnsim.KernelError(f"{name}: M, K, N = {m}, {k}, {n} must be multiples of {bm}, {bk}, {bn}")
    kern = trnsim.Kernel(name, config)
    return kern, kern.input("lhsT", (k, m), dtype), kern.input("rhs", (k, n), dtype), kern.output("result", (m, n), dtype)


def _store(kern: trnsim.Kernel, pool: trnsim.TilePool, acc: object, result: object, m0: int, n0: int, dtype: str) -> None:
    res = pool.tile((TM, TN), dtype)
    kern.tensor_copy(res, acc)
    kern.dma_copy(result[m0:m0 + TM, n0:n0 + TN], res, engine="gpsimd", queue=2)


def tiled(m: int, k: int, n: int, *, dtype: str = "bf16", config: object = "trn2") -> trnsim.Kernel:
    kern, lhsT, rhs, result = _kernel("matmul_tutorial.tiled", m, k, n, dtype, config)
    a_pool, b_pool = kern.tile_pool("a", bufs=2), kern.tile_pool("b", bufs=2)
    acc_pool, res_pool = kern.tile_pool("acc", bufs=2, space="psum"), kern.tile_pool("res", bufs=2)
    for mi in range(m // TM):
        for ni in range(n // TN):
            acc = acc_pool.tile((TM, TN), "fp32")
            for ki in range(k // TK):
                a, b = a_pool.tile((TK, TM), dtype), b_pool.tile((TK, TN), dtype)
                kern.dma_copy(a, lhsT[ki * TK:(ki + 1) * TK, mi * TM:(mi + 1) * TM], queue=0)
                kern.dma_copy(b, rhs[ki * TK:(ki + 1) * TK, ni * TN:(ni + 1) * TN], queue=1)
                kern.nc_matmul(acc, a, b, accumulate=ki > 0)
            _store(kern, res_pool, acc, result, mi * TM, ni * TN, dtype)
    return kern


def hoisted(m: int, k: int, n: int, *, dtype: str = "bf16", config: object = "trn2") -> trnsim.Kernel:
    kern, lhsT, rhs, result = _kernel("matmul_tutorial.hoisted", m, k, n, dtype, config)
    kt = k // TK
    a_pool, b_pool = kern.tile_pool("a", bufs=2), kern.tile_pool("b", bufs=2)
    acc_pool, res_pool = kern.tile_pool("acc", bufs=2, space="psum"), kern.tile_pool("res", bufs=2)
    for mi in range(m // TM):
        a = a_pool.tile((TK, kt, TM), dtype)  # every K tile of this row block
        for ki in range(kt):
            kern.dma_copy(a[:, ki, :], lhsT[ki * TK:(ki + 1) * TK, mi * TM:(mi + 1) * TM], queue=0)
        for ni in range(n // TN):
            b = b_pool.tile((TK, kt, TN), dtype)
            for ki in range(kt):
                kern.dma_copy(b[:, ki, :], rhs[ki * TK:(ki + 1) * TK, ni * TN:(ni + 1) * TN], queue=1)
            acc = acc_pool.tile((TM, TN), "fp32")
            for ki in range(kt):
                kern.nc_matmul(acc, a[:, ki, :], b[:, ki, :], accumulate=ki > 0)
            _store(kern, res_pool, acc, result, mi * TM, ni * TN, dtype)
    return kern


def blocked_free(m: int, k: int, n: int, *, dtype: str = "bf16", config: object = "trn2", tiles_m: int = 2,
                 tiles_n: int = 2) -> trnsim.Kernel:
    kern, lhsT, rhs, result = _kernel("matmul_tutorial.blocked_free", m, k, n, dtype, config, (tiles_m, tiles_n, 1))
    kt = k // TK
    rows, cols = TM * tiles_m, TN * tiles_n
    # an rhs block is [K, cols]: 128 KiB per partition at K = 8192, so two do not fit in SBUF (192 or
    # 224 KiB per partition) and the next block's load waits for this one's last matmul; the lhsT
    # block (32 KiB) is double-buffered where SBUF has room for it
    item = 4 if dtype == "fp32" else 2
    room = kern.config.core.sbuf.partition_bytes - 2 * TN * item - kt * cols * item
    a_pool = kern.tile_pool("a", bufs=2 if room >= 2 * kt * rows * item else 1)
    b_pool = kern.tile_pool("b", bufs=1)
    acc_pool, res_pool = kern.tile_pool("acc", bufs=2, space="psum"), kern.tile_pool("res", bufs=2)
    for mb in range(m // rows):
        a = a_pool.tile((TK, kt, rows), dtype)
        for ki in range(kt):
            kern.dma_copy(a[:, ki, :], lhsT[ki * TK:(ki + 1) * TK, mb * rows:(mb + 1) * rows], queue=0)
        for nb in range(n // cols):
            b = b_pool.tile((TK, kt, cols), dtype)
            for ki in range(kt):
                kern.dma_copy(b[:, ki, :], rhs[ki * TK:(ki + 1) * TK, nb * cols:(nb + 1) * cols], queue=1)
            for i in range(tiles_m):
                for j in range(tiles_n):
                    acc = acc_pool.tile((TM, TN), "fp32")
                    for ki in range(kt):
                        kern.nc_matmul(acc, a[:, ki, i * TM:(i + 1) * TM], b[:, ki, j * TN:(j + 1) * TN],
                                       accumulate=ki > 0)
                    _store(kern, res_pool, acc, result, mb * rows + i * TM, nb * cols + j * TN, dtype)
    return kern


def fully_optimized(m: int, k: int, n: int, *, dtype: str = "bf16", config: object = "trn2", tiles_m: int = 16,
                    tiles_n: int = 2, tiles_k: int = 8) -> trnsim.Kernel:
    kern, lhsT, rhs, result = _kernel("matmul_tutorial.fully_optimized", m, k, n, dtype, config,
                                      (tiles_m, tiles_n, tiles_k))
    rows, cols, kb_rows = TM * tiles_m, TN * tiles_n, TK * tiles_k
    blocks_m = m // rows
    a_pool, b_pool = kern.tile_pool("a", bufs=2), kern.tile_pool("b", bufs=2)
    acc_pool, res_pool = kern.tile_pool("acc", bufs=2, space="psum"), kern.tile_pool("res", bufs=1)
    for nb in range(n // cols):
        # this column block of the result, every row of it, accumulated over the K blocks in SBUF
        res = res_pool.tile((TM, blocks_m * tiles_m, cols), dtype)
        kern.memset(res, 0.0)
        for kb in range(k // kb_rows):
            b = b_pool.tile((TK, tiles_k, cols), dtype)
            for ki in range(tiles_k):
                k0 = kb * kb_rows + ki * TK
                kern.dma_copy(b[:, ki, :], rhs[k0:k0 + TK, nb * cols:(nb + 1) * cols], queue=1)
            for mb in range(blocks_m):
                a = a_pool.tile((TK, tiles_k, rows), dtype)
                for ki in range(tiles_k):
                    k0 = kb * kb_rows + ki * TK
                    kern.dma_copy(a[:, ki, :], lhsT[k0:k0 + TK, mb * rows:(mb + 1) * rows], queue=0)
                for i in range(tiles_m):
                    for j in range(tiles_n):
                        acc = acc_pool.tile((TM, TN), "fp32")
                        for ki in range(tiles_k):
                            kern.nc_matmul(acc, a[:, ki, i * TM:(i + 1) * TM], b[:, ki, j * TN:(j + 1) * TN],
                                           accumulate=ki > 0)
                        out = res[:, mb * tiles_m + i, j * TN:(j + 1) * TN]
                        kern.tensor_tensor(out, out, acc, "add")
        for r in range(blocks_m * tiles_m):
            kern.dma_copy(result[r * TM:(r + 1) * TM, nb * cols:(nb + 1) * cols], res[:, r, :], engine="gpsimd",
                          queue=2)
    return kern
