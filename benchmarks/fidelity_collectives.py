"""Collective fidelity: the simulation next to the alpha-beta closed form, busbw at 1 GiB against
the link bound, and the published Neuron collective figures next to the simulation.

Parts 1-3 check the network alone (``trnsim.collectives.runtime.network_only``: the runtime's
launch, issue, handshake and proxy costs zero, a transfer on all of a core's DMA engines), as
the network layer's own closed form describes it; part 4 runs the configs as shipped, with the
runtime's calibrated costs (the validation ledger, ``trnsim validate``, holds every published
row with its source and role).

1. **Simulation vs the alpha-beta form, where its assumptions hold.** Ring, 2D ring
   (``per-dim-ring``) and halving-doubling (``rdh``) all-reduce, all-gather and reduce-scatter,
   8 B ... 4 GiB, on topologies where every step has one flow per link direction and switch port
   and every rank its own HBM stack:
   ring on all 64 ranks of a trn2.48xlarge (the snake ring crosses one link per chip);
   2D ring on one rank per chip of the 4x4 torus (each row and column its own links);
   rdh on one rank per chip of a Trn3 Gen1 server (every partner one switch port away).
   The form (``trnsim.collectives.analytic``) is a sum over the algorithm's steps of
   ``alpha + max(link, HBM, DMA)`` from the same config figures; the simulation runs chunk by
   chunk on FIFO links, HBM stacks and DMA engines. Goal: within 2%. Exit status 1 if missed.
2. **Where a textbook form's assumptions do not hold,** each case with the reason, printed for
   reading, beside the textbook form (one flow per link). Our form counts the flows a step's
   routes put on each link (rdh on the torus: partners two chips apart share the link between
   them; mesh on the torus), and then agrees; it does not model a chip's ranks sharing a port
   with staggered starts (per-dim-ring and rdh on 64 ranks: one flow's start latency hides behind
   the others' data, so the simulation beats a step-by-step sum), nor pipelined segments meeting
   in a rank's HBM (broadcast chain); and the chunk granularity (``collectives.max_chunks``:
   flows sharing a port take turns chunk by chunk, so one ends a chunk before another).
3. **busbw at 1 GiB against the link bound** (nccl-tests: busbw "should reflect the speed of the
   hardware bottleneck"): the link bandwidth per direction from the system config, and the
   config's bound: the busbw the form's bandwidth terms allow without latency (the link, or a
   ring step's HBM touches: reduce-scatter 2 reads + 1 write per byte on each rank's stack).
4. **Published Neuron figures** (nccom-test examples, notes/collectives.md §3.2; the guide says
   they "should not be considered up-to-date" and names no instance: 32 ranks per node means
   trn1.32xlarge), sim next to source, with what we think is mis-modelled. No constant is tuned
   to them.

    OMP_NUM_THREADS=1 python benchmarks/fidelity_collectives.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

os.environ.setdefault("OMP_NUM_THREADS", "1")

from trnsim.collectives import simulate_collective  # noqa: E402
from trnsim.collectives.runtime import network_only  # noqa: E402
from trnsim.config import SystemConfig, load_system  # noqa: E402


def network(system: str, overrides: list[str] | None = None) -> SystemConfig:
    """The system with the runtime's costs taken out (the network alone)."""
    return load_system(system, network_only(system) + list(overrides or []))

TOL = 0.02
GIB = 2**30


@dataclass(frozen=True)
class Row:
    case: str
    nbytes: int
    sim_us: float
    form_us: float
    ok: bool | None  # None: informational

    @property
    def ratio(self) -> float:
        return self.sim_us / self.form_us if self.form_us else float("nan")


def _size(n: int) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:g} {unit}"
    return f"{n} B"


def sizes(quick: bool) -> list[int]:
    if quick:
        return [8, 64 << 10, 16 << 20]
    return [8 * 4**k for k in range(15)] + [4 * GIB]  # 8 B, 32 B, ... 2 GiB, 4 GiB


CASES = [  # (name, system, algorithm, group)
    ("ring, trn2.48xlarge, 64 ranks", "trn2.48xlarge", "ring", list(range(64))),
    ("2D ring, trn2.48xlarge 4x4 torus, 1 rank/chip", "trn2.48xlarge", "per-dim-ring", list(range(0, 64, 4))),
    ("rdh, trn3 Gen1 server switch, 1 rank/chip", "trn3-ultraserver-gen1", "rdh", list(range(0, 64, 4))),
]


def form_checks(quick: bool) -> list[Row]:
    rows = []
    for name, system, algo, group in CASES:
        sysc = network(system)
        for coll in ("all-reduce", "all-gather", "reduce-scatter"):
            for n in sizes(quick):
                r = simulate_collective(sysc, coll, n, group=group, algorithm=algo)
                ok = abs(r.time_s / r.estimate.time_s - 1) <= TOL
                rows.append(Row(f"{coll:14s} {name}", r.nbytes, r.time_us, r.estimate.time_us, ok))
    return rows


def contended(quick: bool) -> list[tuple[str, Row, float]]:
    """(why, row, textbook us): the form here counts the flows a step puts on each link (from
    the routes); the textbook form (one flow per link) is printed beside it."""
    out = []
    big = 16 << 20 if quick else 1 << 30
    trn2 = network("trn2.48xlarge")
    cases = [
        ("rdh", trn2, "all-reduce", list(range(0, 64, 4)),
         "partners 2 chips apart on a ring of 4 route through the chip between: two flows on its link. The form "
         "counts them and agrees; a textbook form (one flow per link) does not"),
        ("mesh", trn2, "all-gather", list(range(16)),
         "direct writes to non-neighbours share links; counted by the form, not by the textbook one"),
        ("per-dim-ring", trn2, "all-reduce", list(range(64)),
         "a chip's 4 ranks run their x lines over the same links: one flow's start latency hides behind the "
         "others' data, so the simulation beats a step-by-step sum"),
        ("rdh", trn2, "all-reduce", list(range(64)),
         "as above, and steps are not in lockstep: a rank whose flows shared less starts its next step early"),
        ("ring", trn2, "broadcast", list(range(16)),
         "a pipelined chain: the form fills it one hop at a time, but the next segment arrives while a rank "
         "sends the last, sharing its HBM"),
    ]
    for algo, sysc, coll, group, why in cases:
        r = simulate_collective(sysc, coll, big, group=group, algorithm=algo)
        out.append((why, Row(f"{coll} {algo} on {sysc.name}, {len(group)} ranks", r.nbytes, r.time_us,
                             r.estimate.time_us, None), r.estimate.textbook_s * 1e6))
    for chunks in ((2, 8, 32) if quick else (2, 8, 32, 128)):
        s = network("trn2.48xlarge", [f"collectives.max_chunks={chunks}"])
        r = simulate_collective(s, "all-reduce", 16 << 20 if quick else 256 << 20, ranks=64, algorithm="rdh")
        out.append((f"collectives.max_chunks={chunks}: flows sharing a port take turns chunk by chunk, so one ends "
                    f"a chunk before another; finer chunks approach the form (the default is 8, for speed)",
                    Row(f"all-reduce rdh, trn2 64 ranks, max_chunks={chunks}", r.nbytes, r.time_us,
                        r.estimate.time_us, None), r.estimate.textbook_s * 1e6))
    return out


def busbw_rows(quick: bool) -> list[tuple[str, float, float, float, str]]:
    """(case, busbw GB/s, link GB/s, the config's bound GB/s, what binds). The bound is the
    busbw the form's bandwidth terms allow (no latency): the link, or a ring step's HBM touches
    (all-gather: 1 read + 1 write per byte on each rank's stack; reduce-scatter: 2 + 1)."""
    n = 64 << 20 if quick else GIB
    out = []
    for label, system, coll, algo, group in [
            ("ring all-reduce, trn2.48xlarge, 64 ranks", "trn2.48xlarge", "all-reduce", "ring", range(64)),
            ("ring all-gather, trn2.48xlarge, 64 ranks", "trn2.48xlarge", "all-gather", "ring", range(64)),
            ("bidir-ring all-gather, trn2.48xlarge, 1 rank/chip", "trn2.48xlarge", "all-gather", "bidir-ring",
             range(0, 64, 4)),
            ("ring all-reduce, trn3 Gen1, 64 ranks", "trn3-ultraserver-gen1", "all-reduce", "ring", range(64)),
            ("ring all-reduce, trn1.32xlarge, 32 ranks", "trn1.32xlarge", "all-reduce", "ring", range(32))]:
        sysc = network(system)
        r = simulate_collective(sysc, coll, n, group=list(group), algorithm=algo)
        link = min(d.bandwidth for d in sysc.topology if d.size > 1)
        beta = r.estimate.time_s - r.estimate.latency_s
        bound = r.nbytes * r.busbw_factor / beta
        out.append((label, r.busbw / 1e9, link / 1e9, bound / 1e9, r.estimate.bound))
    return out


PUBLISHED = [  # (what, system, overrides, collective, ranks, bytes, published us): nccom-test examples
    ("-r 2 allr, 1 KiB (floor)", "trn1.32xlarge", [], "all-reduce", 2, 1 << 10, 58.0),
    ("-r 2 allr, 1 MiB", "trn1.32xlarge", [], "all-reduce", 2, 1 << 20, 68.0),
    ("-r 2 allr, 16 MiB", "trn1.32xlarge", [], "all-reduce", 2, 16 << 20, 332.0),
    ("-r 2 allr, 1 GiB (52.83 GiB/s busbw)", "trn1.32xlarge", [], "all-reduce", 2, 1 << 30, 18930.0),
    ("-r 32 allg, 64 KiB", "trn1.32xlarge", [], "all-gather", 32, 64 << 10, 150.0),
    ("-r 64 -N 2 allr, 8 B (floor)", "trn1.32xlarge", ["topology.efa.size=2"], "all-reduce", 64, 8, 520.0),
    ("-r 64 -N 2 allr, 1 MiB", "trn1.32xlarge", ["topology.efa.size=2"], "all-reduce", 64, 1 << 20, 1328.0),
    ("-r 64 -N 2 allr, 1 GiB (47.09 GiB/s busbw)", "trn1.32xlarge", ["topology.efa.size=2"], "all-reduce", 64,
     1 << 30, 41806.0),
    ("-r 8 allg, 1 KiB", "trn2.48xlarge", [], "all-gather", 8, 1 << 10, 10.0),
    ("-r 8 allg, 512 KiB", "trn2.48xlarge", [], "all-gather", 8, 512 << 10, 14.83),
    ("-r 16 allr, 2 MiB (rdh)", "trn2.48xlarge", [], "all-reduce", 16, 2 << 20, 686.32),
    ("-r 16 allr, 512 MiB (kangaring)", "trn2.48xlarge", [], "all-reduce", 16, 512 << 20, 9689.51),
]


def published(quick: bool) -> list[tuple[str, float, float, str, float]]:
    out = []
    for what, system, overrides, coll, ranks, n, us in PUBLISHED:
        if quick and n > 16 << 20:
            continue
        r = simulate_collective(load_system(system, overrides), coll, n, ranks=ranks, dtype="fp32")
        out.append((what, r.time_us, us, r.algorithm, r.busbw / GIB))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a few sizes up to 64 MiB, for the tests")
    args = ap.parse_args(argv)
    print("1. Simulation vs the alpha-beta form where its assumptions hold (goal: within 2%)")
    rows = form_checks(args.quick)
    print(f"   {'case':64s} {'size':>9s} {'sim us':>12s} {'form us':>12s} {'sim/form':>9s}")
    for r in rows:
        print(f"   {r.case:64s} {_size(r.nbytes):>9s} {r.sim_us:12.2f} {r.form_us:12.2f} {r.ratio:9.4f} "
              f"{'ok' if r.ok else 'MISS'}")
    worst = max(rows, key=lambda r: abs(r.ratio - 1))
    print(f"   {sum(r.ok for r in rows)}/{len(rows)} within 2%; largest gap {100 * (worst.ratio - 1):+.2f}% "
          f"({worst.case.strip()}, {_size(worst.nbytes)})")
    print()
    print("2. Where a textbook form's assumptions do not hold (for reading)")
    for why, r, textbook in contended(args.quick):
        print(f"   {r.case:50s} {_size(r.nbytes):>8s} sim {r.sim_us:10.2f} us  form {r.form_us:10.2f} us "
              f"(sim/form {r.ratio:.3f})  textbook {textbook:10.2f} us")
        print(f"      why: {why}")
    print()
    print(f"3. busbw at {'64 MiB (1 GiB without --quick)' if args.quick else '1 GiB'} against the link bound "
          f"(GB/s = 1e9 B/s, as nccl-tests)")
    for label, bus, link, bound, what in busbw_rows(args.quick):
        print(f"   {label:52s} busbw {bus:7.1f}  link {link:6.1f}  config bound {bound:6.1f} ({what})  "
              f"busbw/link {bus / link:.3f}  busbw/bound {bus / bound:.3f}")
    print()
    print("4. Published nccom-test examples, with the runtime's costs as configured (trnsim validate runs every row)")
    print(f"   {'example':44s} {'sim us':>10s} {'published us':>13s} {'published/sim':>14s}  algorithm  sim busbw GiB/s")
    for what, sim, pub, algo, bus in published(args.quick):
        print(f"   {what:44s} {sim:10.1f} {pub:13.1f} {pub / sim:14.2f}  {algo:14s} {bus:8.2f}")
    print("   Reading: the runtime's launch, issue and proxy costs and the collective's DMA rings are calibrated on "
          "one row\n   each (configs/systems/*.yaml say which); the other rows validate them. Trn1's 2-node table "
          "steps from 520 to\n   1,315 us between 128 B and 64 KiB, which the model does not reproduce; the 16-rank "
          "Trn2 all-reduce's 300 us\n   floor is 30x its 8-rank all-gather's and is not modelled either.")
    missed = [r for r in rows if not r.ok]
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
