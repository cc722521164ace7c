"""Kernel build and simulate speed: the big library kernels, timed the way `trnsim kernel` runs
them (build the instruction stream, then simulate it timing-only).

Prints, in one run:

* the baseline — a raw simpy process doing one ``timeout`` per "instruction", the least work a
  simpy model can do per instruction — measured here, now, on this machine;
* per kernel: build seconds, simulate seconds, instructions, simulated instructions per second
  and that rate against the baseline, instructions built and simulated per second end to end by
  wall time and by the process's CPU time (issue 30's goal: every kernel >= 500,000 per second,
  judged on CPU time, which the machine's load does not stretch); build + simulate against the 2 s budget of
  ``trnsim kernel matmul --shape 4096x4096x4096 --dtype bf16``;
* end to end: instructions built and simulated per second over all the kernels, against the
  baseline and against the goal of 200,000 per second (printed, not an exit status: one round
  on a shared machine varies by up to 1.5x; ``--rounds`` prints the median the goal is judged
  on), and the microseconds an instruction costs to build and to simulate beside raw simpy's
  one timeout;
* the seconds to make the trace segments list afterwards (the native loop's timelines make it
  when a report first reads it), one run of the reference simpy processes, and whether it gives
  the same ticks, ready/end times and segments;
* the reference build of each kernel (:func:`trnsim.kernel.reference_build`: the Python
  dependency tracker, one instruction at a time, as the builder worked before its fast paths),
  its seconds and whether the fast build made exactly the same instruction stream (every
  instruction's fields, :func:`trnsim.kernel.stream_fingerprint`); build microseconds per
  instruction of both;
* that CLI command itself, run as a subprocess (Python start-up and imports included).

Exit status 1 if matmul 4096^3 build + simulate (best of the repeats) takes 2 s or more, if a
fast build's stream differs from the reference's, or if the simulator and its simpy reference
disagree on any kernel.

    OMP_NUM_THREADS=1 python benchmarks/bench_kernels.py [--quick] [--rounds N] [--repeats N]

``--rounds N`` times build + simulate N times in all (the checks and the CLI run once) and prints
each round's end-to-end rate and their median against the goal: on a shared machine one run
varies by up to 1.5x, so a claim about the goal rests on the median of several rounds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")


from trnsim import load_config  # noqa: E402
from trnsim.kernel import reference_build, stream_fingerprint  # noqa: E402
from trnsim.kernels import get_kernel, kernel_names  # noqa: E402
from trnsim.sim import native_available, simulate  # noqa: E402

from bench_scheduler import raw_simpy  # noqa: E402  (the same baseline, from the script beside this one)
from _args import whole  # noqa: E402  (the script beside this one)

BUDGET_S = 2.0
END_TO_END_GOAL = 200_000  # instructions built + simulated per second, over all the kernels
KERNEL_GOAL = 500_000  # ... and of every kernel on its own (issue 30)
BIG = [("matmul", (4096, 4096, 4096)), ("matmul", (4096, 8192, 8192)), ("bmm", (8, 1024, 1024, 1024))]
QUICK = [("matmul", (4096, 4096, 4096)), ("bmm", (4, 512, 512, 512))]
OTHERS = ("attention", "conv2d", "rmsnorm", "softmax")  # at their default shapes, when registered


def best(fn, repeats: int) -> tuple[float, object]:
    t_best, _, out = best2(fn, repeats)
    return t_best, out


def best2(fn, repeats: int) -> tuple[float, float, object]:
    """(best wall s, best process CPU s, the last result) over ``repeats`` calls of ``fn``."""
    out, t_best, c_best = None, float("inf"), float("inf")
    for _ in range(repeats):
        out = None  # free the previous repeat's result first: its teardown is not this repeat's cost
        t, c = time.perf_counter(), time.process_time()
        out = fn()
        t_best = min(t_best, time.perf_counter() - t)
        c_best = min(c_best, time.process_time() - c)
    return t_best, c_best, out


def timed_round(cases: list[tuple[str, tuple[int, ...]]], cfg, repeats: int, n_base: int
                ) -> tuple[float, float, list[float]]:
    """One more round of the timed work only: instructions built and simulated per second over
    ``cases`` (best of ``repeats`` each, as the first round times them), raw simpy's rate
    (``n_base`` timeouts), and each kernel's own rate by process CPU time (as the first round's)."""
    t_base, _ = best(lambda: raw_simpy(n_base), repeats)
    total_instr, total_s = 0, 0.0
    per_kernel = []
    for name, shape in cases:
        entry = get_kernel(name)
        t_build, c_build, kern = best2(lambda: entry.make(shape, entry.default_dtype, cfg), repeats)
        t_sim, c_sim, _ = best2(lambda: simulate(cfg, [kern]), repeats)
        total_instr += len(kern)
        total_s += t_build + t_sim
        per_kernel.append(len(kern) / (c_build + c_sim))
        kern = None
    return total_instr / total_s, n_base / t_base, per_kernel


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="matmul 4096^3 and a small bmm, one repeat, no CLI run")
    ap.add_argument("--rounds", type=whole(1, 100), default=1, metavar="N",
                    help="time build + simulate of every kernel N times in all (the checks run once) and print "
                         "the median end-to-end rate: one run on a shared machine varies by up to 1.5x")
    ap.add_argument("--repeats", type=whole(1, 100), default=None, metavar="N",
                    help="time build and simulate of each kernel N times and keep the best (default 3, 1 with "
                         "--quick): on a loaded machine the best of 3 still varies by 1.5x or more")
    args = ap.parse_args(argv)
    repeats = args.repeats or (1 if args.quick else 3)
    cfg = load_config("trn2")
    names = set(kernel_names())
    cases = list(QUICK if args.quick else BIG)
    if not args.quick:
        cases += [(n, get_kernel(n).default_shape) for n in OTHERS if n in names]

    n_base = 20_000 if args.quick else 200_000
    t_base, _ = best(lambda: raw_simpy(n_base), repeats)
    base_rate = n_base / t_base
    print(f"baseline: raw simpy, one timeout per instruction: {base_rate:,.0f} instr/s (trn2, best of {repeats})")
    print("simulator: " + ("native event loop" if native_available() else
                           "simpy processes (trnsim.native.accel._sched is not built)"))
    print(f"{'kernel':<34} {'instrs':>8} {'build s':>8} {'sim s':>7} {'sim i/s':>10} {'vs simpy':>9} {'total s':>8} "
          f"{'e2e i/s':>10} {'e2e cpu i/s':>11} {'ref build s':>11} {'stream':>7} {'segs s':>7} {'simpy s':>8} {'ticks':>6}")
    ok = same_all = ticks_all = True
    total_instr, total_s, total_build, total_ref, total_segs, total_sim_ref = 0, 0.0, 0.0, 0.0, 0.0, 0.0
    per_kernel: list[tuple[str, float, float]] = []
    for name, shape in cases:
        entry = get_kernel(name)
        t_build, c_build, kern = best2(lambda: entry.make(shape, entry.default_dtype, cfg), repeats)
        t_sim, c_sim, tls = best2(lambda: simulate(cfg, [kern]), repeats)
        t0 = time.perf_counter()
        segs = tls[0].segments  # the native loop's timelines make this list when it is first read
        t_segs = time.perf_counter() - t0
        t0 = time.perf_counter()
        sim_ref = simulate(cfg, [kern], timeline="simpy")[0]  # the reference: every tick must agree
        t_sim_ref = time.perf_counter() - t0
        ticks = ((sim_ref.total_ticks, sim_ref.ready, sim_ref.end, sim_ref.segments)
                 == (tls[0].total_ticks, tls[0].ready, tls[0].end, segs))
        ticks_all = ticks_all and ticks
        tls = segs = sim_ref = None
        with reference_build():
            t_ref, ref = best(lambda: entry.make(shape, entry.default_dtype, cfg), 1)
        same = stream_fingerprint(ref) == stream_fingerprint(kern)
        same_all = same_all and same
        ref = None
        rate = len(kern) / t_sim
        label = f"{name} {entry.default_dtype} {'x'.join(map(str, shape))}"
        e2e_k, e2e_c = len(kern) / (t_build + t_sim), len(kern) / (c_build + c_sim)
        per_kernel.append((label, e2e_k, e2e_c))
        print(f"{label:<34} {len(kern):>8,} {t_build:>8.3f} {t_sim:>7.3f} {rate:>10,.0f} {rate / base_rate:>8.2f}x "
              f"{t_build + t_sim:>8.3f} {e2e_k:>10,.0f} {e2e_c:>11,.0f} {t_ref:>11.3f} {'same' if same else 'DIFFERS':>7} "
              f"{t_segs:>7.3f} {t_sim_ref:>8.3f} {'same' if ticks else 'DIFFER':>6}")
        total_segs += t_segs
        total_sim_ref += t_sim_ref
        total_instr += len(kern)
        total_s += t_build + t_sim
        total_build += t_build
        total_ref += t_ref
        if name == "matmul" and shape == (4096, 4096, 4096):
            ok = t_build + t_sim < BUDGET_S
            print(f"{'':<34} build + simulate {t_build + t_sim:.3f} s; budget < {BUDGET_S:.0f} s: "
                  f"{'met' if ok else 'MISSED'}")
    e2e = total_instr / total_s
    print(f"per instruction: build {total_build / total_instr * 1e6:.1f} us, simulate "
          f"{(total_s - total_build) / total_instr * 1e6:.2f} us (+{total_segs / total_instr * 1e6:.2f} us to make "
          f"the segments list when a report reads it; the simpy processes: {total_sim_ref / total_instr * 1e6:.1f} us); "
          f"raw simpy {1e6 / base_rate:.1f} us")
    print(f"same ticks, ready/end and segments as the simpy reference on every kernel: {'yes' if ticks_all else 'NO'}")
    print(f"build per instruction: fast {total_build / total_instr * 1e6:.1f} us, reference "
          f"{total_ref / total_instr * 1e6:.1f} us ({total_ref / total_build:.1f}x); instruction streams "
          f"{'identical' if same_all else 'DIFFER'}")
    print(f"end to end (build + simulate, every kernel above): {e2e:,.0f} instr/s = {e2e / base_rate:.2f}x raw simpy; "
          f"goal >= {END_TO_END_GOAL:,}: {'met' if e2e >= END_TO_END_GOAL else 'MISSED'} "
          f"({END_TO_END_GOAL / e2e:.1f}x short)" if e2e < END_TO_END_GOAL else
          f"end to end (build + simulate): {e2e:,.0f} instr/s = {e2e / base_rate:.2f}x raw simpy; goal met")
    slow = [(lab, w, c) for lab, w, c in per_kernel if c < KERNEL_GOAL]
    print(f"every kernel >= {KERNEL_GOAL:,} instr/s end to end (issue 30; judged on process CPU time, the wall "
          f"rate beside it varies with the machine's load): {len(per_kernel) - len(slow)} of {len(per_kernel)} "
          f"met{'' if not slow else '; MISSED: ' + '; '.join(f'{lab} {c:,.0f} ({KERNEL_GOAL / c:.1f}x short)' for lab, w, c in slow)}")
    if args.rounds > 1:
        rates, bases = [e2e], [base_rate]
        kernel_rates = [[c] for _, _, c in per_kernel]
        for _ in range(args.rounds - 1):
            r, b, ks = timed_round(cases, cfg, repeats, n_base)
            rates.append(r)
            bases.append(b)
            for acc, c in zip(kernel_rates, ks):
                acc.append(c)
        # each kernel's goal judged on its median over the rounds, as the end-to-end rate is (one
        # round's best of 3 still moves a small kernel's rate by 1.5x on this machine)
        meds = [(lab, statistics.median(acc)) for (lab, _, _), acc in zip(per_kernel, kernel_rates)]
        slow_med = [(lab, c) for lab, c in meds if c < KERNEL_GOAL]
        print(f"every kernel >= {KERNEL_GOAL:,} instr/s end to end, median of {args.rounds} rounds (process CPU): "
              f"{len(meds) - len(slow_med)} of {len(meds)} met: "
              + "; ".join(f"{lab} {c:,.0f}{'' if c >= KERNEL_GOAL else ' (%.1fx short)' % (KERNEL_GOAL / c)}"
                          for lab, c in meds))
        med = statistics.median(rates)
        ratio = statistics.median(r / b for r, b in zip(rates, bases))
        print(f"end to end over {args.rounds} rounds: " + ", ".join(f"{r:,.0f}" for r in rates) + " instr/s")
        print(f"  median {med:,.0f} instr/s (range {min(rates):,.0f}-{max(rates):,.0f}), "
              f"median {ratio:.2f}x raw simpy of the same round; goal >= {END_TO_END_GOAL:,}: "
              f"{'met' if med >= END_TO_END_GOAL else 'MISSED'}")
    if not args.quick:  # this checkout's CLI (an installed `trnsim` script may import another one)
        cmd = [sys.executable, "-m", "trnsim.cli", "kernel", "matmul", "--shape", "4096x4096x4096", "--dtype", "bf16"]
        t_cli, proc = best(lambda: subprocess.run(cmd, capture_output=True, text=True), repeats)
        status = "ok" if proc.returncode == 0 else f"exit {proc.returncode}: {proc.stderr.strip()[:120]}"
        print(f"CLI `{' '.join(['trnsim'] + cmd[3:])}`: {t_cli:.3f} s wall incl. start-up ({status})")
    return 0 if ok and same_all and ticks_all else 1


if __name__ == "__main__":
    sys.exit(main())
