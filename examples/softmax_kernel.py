"""A user-written kernel: row-wise softmax over a [rows, cols] bf16 matrix on one NeuronCore.

Written the way an NKI author would: 128 rows per tile (one per partition), double-buffered
loads, VectorE for the max and the final scaling, ScalarE for exp with the per-row sum fused
into the same instruction (activation's reduce), stores on their own DMA queue.

    python examples/softmax_kernel.py [--config trn3] [--rows 1024] [--cols 2048]
"""

from __future__ import annotations

import argparse

import numpy as np

import trnsim


def build_softmax(rows: int, cols: int, config: str = "trn2") -> trnsim.Kernel:
    k = trnsim.Kernel("softmax", config)
    x = k.input("x", (rows, cols), "bf16")
    y = k.output("y", (rows, cols), "bf16")
    io = k.tile_pool("io", bufs=2)
    stats = k.tile_pool("stats", bufs=2)
    for r in range(0, rows, 128):
        t = io.tile((128, cols), "bf16")
        k.dma_copy(t, x[r:r + 128, :])
        neg_max = stats.tile((128, 1), "fp32")
        k.tensor_reduce(neg_max, "max", t, axis=1, negate=True)
        row_sum = stats.tile((128, 1), "fp32")
        k.activation(t, "exp", t, bias=neg_max, reduce_op="add", reduce_res=row_sum)
        k.activation(row_sum, "reciprocal", row_sum)
        k.tensor_scalar(t, t, "multiply", row_sum)
        k.dma_copy(y[r:r + 128, :], t, engine="gpsimd")
    return k


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="trn2")
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--cols", type=int, default=2048)
    args = ap.parse_args()
    if args.rows < 128 or args.rows % 128:
        ap.error(f"--rows must be a positive multiple of 128, got {args.rows}")
    if args.cols < 1:
        ap.error(f"--cols must be a positive integer, got {args.cols}")
    x = np.random.default_rng(0).standard_normal((args.rows, args.cols), dtype=np.float32)
    chip = trnsim.Chip(args.config)
    try:
        result = chip.run(build_softmax(args.rows, args.cols, chip.config), {"x": x})
    except trnsim.KernelError as e:  # a shape the kernel cannot take (a row over one access pattern, SBUF)
        ap.error(f"--rows {args.rows} --cols {args.cols}: {e}")
    xf = x.astype(trnsim.bfloat16.np_dtype).astype(np.float64)
    ref = np.exp(xf - xf.max(axis=1, keepdims=True))
    ref /= ref.sum(axis=1, keepdims=True)
    err = np.abs(result["y"].astype(np.float64) - ref).max()
    rep = result.report
    print(f"softmax {args.rows}x{args.cols} bf16 on {args.config}: max abs error {err:.1e}")
    print(f"{rep.total_cycles:,.0f} cycles ({rep.total_us:.2f} us); HBM {rep.mbu_estimated_percent:.0f}% of the "
          f"core's share; " + ", ".join(f"{n} {e.active_percent:.0f}%" for n, e in rep.engines.items()))


if __name__ == "__main__":
    main()
