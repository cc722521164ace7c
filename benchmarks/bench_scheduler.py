"""Scheduler throughput: simulated instructions per wall second.

Prints, in one run:

* the raw simpy baseline — a process doing one ``timeout`` per "instruction", the least work
  any simpy model can do per instruction — measured here, now, on this machine;
* trnsim's scheduler (``trnsim.sim.simulate``, timing only) on built-in kernels, as
  instructions/s and as a ratio against that baseline;
* end to end (build the kernel + simulate + report), as a user of ``Chip.run`` sees it.

Goal (issue 2): >= 100k simulated instructions per second for the scheduler.

    OMP_NUM_THREADS=1 python benchmarks/bench_scheduler.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import simpy  # noqa: E402

from trnsim import Chip, load_config  # noqa: E402
from trnsim.kernels.matmul import build_matmul  # noqa: E402
from trnsim.sim import simulate  # noqa: E402


def best_of(fn, repeats):
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times), statistics.median(times)


def raw_simpy(n: int) -> None:
    env = simpy.Environment()

    def proc():
        for _ in range(n):
            yield env.timeout(1)

    env.process(proc())
    env.run()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small kernels, one repeat (seconds, for CI)")
    args = ap.parse_args()
    repeats = 1 if args.quick else 3
    shapes = [(1024, 1024, 1024)] if args.quick else [(2048, 2048, 2048), (4096, 4096, 4096), (4096, 8192, 8192)]
    cfg = load_config("trn2")

    n_base = 20_000 if args.quick else 200_000
    t_base, _ = best_of(lambda: raw_simpy(n_base), repeats)
    base_rate = n_base / t_base
    print(f"baseline: raw simpy, one timeout per instruction: {base_rate:,.0f} instr/s")
    print(f"{'kernel':<28} {'instrs':>8} {'sim s':>8} {'instr/s':>10} {'vs simpy':>9} {'end-to-end s':>13}")
    worst = None
    for m, k, n in shapes:
        kern = build_matmul(m, k, n, "bf16", cfg)
        t_sim, _ = best_of(lambda: simulate(cfg, [kern]), repeats)
        rate = len(kern) / t_sim

        def e2e():
            Chip(cfg).run(build_matmul(m, k, n, "bf16", cfg), timing_only=True)

        t_e2e, _ = best_of(e2e, repeats)
        worst = rate if worst is None else min(worst, rate)
        print(f"{f'matmul bf16 {m}x{k}x{n}':<28} {len(kern):>8,} {t_sim:>8.3f} {rate:>10,.0f} "
              f"{rate / base_rate:>8.2f}x {t_e2e:>13.3f}")
    goal = 100_000
    print(f"scheduler throughput (slowest kernel): {worst:,.0f} instr/s; goal >= {goal:,}: "
          f"{'met' if worst >= goal else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
