"""Matmul fidelity: the library matmul on the shape of AWS's NKI matmul tutorial, beside the
figures AWS published for it (datasheet §10).

* V4 (Trn2, one NeuronCore, ``[4096, 8192] @ [8192, 8192]`` bf16): neuron-profile's TensorE and
  DMA active percentages for the tutorial's tiled / hoisted / blocked kernels. Our kernel keeps
  the rhs block resident and streams lhsT, like the hoisted/blocked versions. Targets: TensorE
  active >= 95% and MFU (report.mfu_estimated_percent) >= 90%; exit status 1 if missed. Our DMA
  active is lower than published: with 1024-column resident rhs blocks the kernel re-reads lhsT
  8 times (~0.6 GiB in all), so the queues idle between loads; the tutorial's blocks differ.
* V1 (Trn1, one NC-v2, same shape): latency and HFU of the tutorial's best version (6.97 ms,
  85.24%). Printed for comparison only: on trn1 our kernel is DMA-bound (small DMA runs pay the
  larger trn1 descriptor overhead, configs/trn1.yaml), so no target is set.

Cycle counts come from simulating the kernel's instruction stream (timing only). ``--quick``
runs 2048x2048x2048 on trn2 instead, where the V4 targets also hold (the published figures are
for the full shape and are printed for reference).

    OMP_NUM_THREADS=1 python benchmarks/fidelity_matmul.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

from trnsim import Chip, load_config  # noqa: E402
from trnsim.kernels.matmul import build_matmul  # noqa: E402

V4_SHAPE = (4096, 8192, 8192)  # M, K, N
V4_PUBLISHED = {"tiled": (87.28, 99.93), "hoisted": (99.85, 99.73), "blocked": (99.52, 95.70)}  # TensorE, DMA %
V1_PUBLISHED_MS, V1_PUBLISHED_HFU = 6.97, 85.24
ACTIVE_TARGET, MFU_TARGET = 95.0, 90.0


def simulate(shape: tuple[int, int, int], config: str):
    cfg = load_config(config)
    t0 = time.perf_counter()
    report = Chip(cfg).run(build_matmul(*shape, "bf16", cfg), timing_only=True).report
    return report, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="2048^3 on trn2 only (about 0.1 s)")
    args = ap.parse_args(argv)
    shape = (2048, 2048, 2048) if args.quick else V4_SHAPE
    m, k, n = shape

    r, wall = simulate(shape, "trn2")
    tensor = r.engines["Tensor"].active_percent
    print(f"V4  trn2, one NeuronCore, bf16 M={m} K={k} N={n}  (simulated in {wall:.2f} s wall)")
    if args.quick:
        print(f"    (--quick: published figures are for M={V4_SHAPE[0]} K={V4_SHAPE[1]} N={V4_SHAPE[2]})")
    print(f"    {'':<22} {'TensorE active':>15} {'DMA active':>11} {'MFU':>8} {'latency':>10}")
    print(f"    {'trnsim':<22} {tensor:>14.2f}% {r.dma.active_percent:>10.2f}% {r.mfu_estimated_percent:>7.2f}% "
          f"{r.total_us / 1000:>7.3f} ms")
    for version, (pe, dma) in V4_PUBLISHED.items():
        print(f"    {'published, ' + version:<22} {pe:>14.2f}% {dma:>10.2f}% {'-':>8} {'-':>10}")
    ok = tensor >= ACTIVE_TARGET and r.mfu_estimated_percent >= MFU_TARGET
    print(f"    targets: TensorE active >= {ACTIVE_TARGET:.0f}%, MFU >= {MFU_TARGET:.0f}%: {'met' if ok else 'MISSED'}")

    if not args.quick:
        r1, wall1 = simulate(V4_SHAPE, "trn1")
        print(f"\nV1  trn1, one NC-v2, bf16 M={m} K={k} N={n}  (simulated in {wall1:.2f} s wall)")
        print(f"    {'':<22} {'latency':>10} {'HFU':>8} {'TensorE active':>15} {'DMA active':>11}")
        print(f"    {'trnsim':<22} {r1.total_us / 1000:>7.3f} ms {r1.hfu_estimated_percent:>7.2f}% "
              f"{r1.engines['Tensor'].active_percent:>14.2f}% {r1.dma.active_percent:>10.2f}%")
        print(f"    {'published, best':<22} {V1_PUBLISHED_MS:>7.3f} ms {V1_PUBLISHED_HFU:>7.2f}% {'-':>15} {'-':>11}")
        print(f"    simulated / published latency: {r1.total_us / 1000 / V1_PUBLISHED_MS:.3f} (no target)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
