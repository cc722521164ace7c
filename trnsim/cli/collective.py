"""``trnsim collective``: one collective on a system, simulated over a range of sizes (nccl-tests'
columns), its parser and its trace."""

from __future__ import annotations

import argparse
import json
from typing import Any

from .base import Out, UsageError, emit
from ..config import clip_text, format_quantity
from ..sweep import check_collective_bytes, check_collective_ranks
from .render import REPORT_WIDTH


# ---------------------------------------------------------------------------------------------
# collective
# ---------------------------------------------------------------------------------------------


def _gib(v: float) -> str:
    return f"{v / 2**30:.2f}"


def cmd_collective(args: argparse.Namespace) -> int:
    from rich.markup import escape
    from rich.table import Table

    from ..collectives import CollectiveError, simulate_collective
    from ..collectives.runner import parse_sizes
    from ..collectives.trace import write_collective_trace
    from ..config import load_system
    from ..config.files import AtomicOutput

    system = load_system(args.system, args.set)
    reps = []
    out = AtomicOutput(args.trace, "--trace") if args.trace else None  # refused now, not after the run
    try:
        sizes = parse_sizes(args.bytes, args.factor)
        check_collective_ranks(system, args.ranks, "--ranks" if args.ranks is not None else args.collective)
        for n in sizes:
            check_collective_bytes(system, args.ranks, n, f"--bytes {clip_text(args.bytes, 60)}")
        for i, n in enumerate(sizes):
            trace = bool(args.trace) and i == len(sizes) - 1
            reps.append(simulate_collective(system, args.collective, n, ranks=args.ranks, dtype=args.dtype,
                                            algorithm=args.algo, trace=trace, instances=args.nodes,
                                            streams=args.streams))
        if out is not None:
            write_collective_trace(out, [reps[-1]], system.ranks_per_chip)
    except CollectiveError as e:
        raise UsageError(str(e)) from None
    except OSError as e:
        raise UsageError(f"--trace {args.trace}: cannot write it ({e.strerror or type(e).__name__})") from None
    finally:
        if out is not None:
            out.discard()  # a no-op once committed
    last = reps[-1]
    if args.json:
        doc = {"collective": last.collective, "system": system.name, "ranks": last.ranks, "dtype": last.dtype,
               "placement": last.placement,
               "overrides": dict(system.overrides), "units": {"time": "us", "algbw": "GiB/s", "busbw": "GiB/s"},
               "results": [{"size(B)": r.nbytes, "count(elems)": r.count, "type": r.dtype, "time:avg(us)": r.time_us,
                            "algbw(GiB/s)": r.algbw / 2**30, "busbw(GiB/s)": r.busbw / 2**30,
                            "algorithm": r.algorithm, "estimate(us)": r.estimate.time_us, "report": r.to_dict()}
                           for r in reps]}
        emit(json.dumps(doc, indent=2))
        return 0
    console = Out(width=REPORT_WIDTH)
    cfg = system.chip
    head = (f"[bold]{last.collective}[/bold] on {escape(system.name)} ({system.chips} chips of "
            f"{system.ranks_per_chip} logical cores, LNC={cfg.chip.lnc}): {escape(last.placement)}, {last.dtype}")
    if system.overrides:
        head += f" ({escape(system.describe_overrides())})"
    console.print(head)
    t = Table(box=None, padding=(0, 1, 0, 1), pad_edge=False, collapse_padding=True, show_edge=False)
    cols = ("size(B)", "count(elems)", "type", "time(us)", "algbw(GiB/s)", "busbw(GiB/s)", "algorithm", "steps",
            "hops", "bound", "a-b(us)")
    why: dict[str, str] = {}
    rows = []
    for r in reps:
        why.setdefault(r.algorithm, r.reason)
        bound = r.bound if r.bound == "latency" else f"{r.bound} {r.bound_percent:.0f}%"
        rows.append((str(r.nbytes), str(r.count), r.dtype, f"{r.time_us:.2f}", _gib(r.algbw), _gib(r.busbw),
                     r.algorithm, str(r.steps), str(r.max_hops), bound, f"{r.estimate.time_us:.2f}"))
    for i, col in enumerate(cols):
        # figures are never cut; the algorithm and the bound give way (an ellipsis; --json has them whole)
        text = col in ("type", "algorithm", "bound")
        t.add_column(col, justify="left" if text else "right", no_wrap=True, overflow="ellipsis",
                     min_width=None if col in ("algorithm", "bound") else max(len(col), *(len(row[i]) for row in rows)))
    for row in rows:
        t.add_row(*(escape(c) for c in row))
    console.print(t)
    avg = sum(r.busbw for r in reps) / len(reps)
    console.print(f"Avg bus bandwidth: {_gib(avg)} GiB/s")
    factor = {"all-reduce": "2(n-1)/n", "all-gather": "(n-1)/n", "reduce-scatter": "(n-1)/n",
              "all-to-all": "(n-1)/n"}.get(last.collective, "1")
    console.print(f"algbw = size / time, busbw = algbw x {factor} = {last.busbw_factor:.4g} (nccl-tests' factor); "
                  f"both in GiB/s (2^30 bytes/s), as nccom-test prints them.")
    console.print("a-b(us): the alpha-beta estimate of the same call. bound: what held the chunks back longest "
                  "(latency: nothing, half the time).")
    for algo, reason in why.items():
        console.print(f"{algo}: {escape(reason)}")
    top = max(last.link_bytes.items(), key=lambda kv: kv[1], default=None)
    links = (f"; busiest link {escape(top[0])}: {format_quantity(top[1], 'bytes')} over {len(last.link_bytes)} "
             f"link directions used" if top else "; no link used (one chip: HBM to HBM)")
    console.print(f"At {format_quantity(last.nbytes, 'bytes')}: {last.transfers:,} transfers in {last.chunks:,} "
                  f"chunks{links}.")
    if args.trace:
        console.print(f"Trace of the {format_quantity(last.nbytes, 'bytes')} run written to {escape(args.trace)} "
                      f"(open it in ui.perfetto.dev or chrome://tracing)")
    return 0


def add_collective_parser(sub: Any) -> None:
    from ..collectives import ALGORITHMS, COLLECTIVES
    from ..config import system_names

    c = sub.add_parser("collective", help="simulate a collective over a system's chips and links and print an "
                                          "nccom-test style table (size, count, type, time, algbw, busbw)")
    c.add_argument("collective", metavar="COLLECTIVE", help=f"one of {', '.join(COLLECTIVES)} (or nccom-test's "
                                                            f"allr, allg, redsct, alltoall, sendrecv)")
    c.add_argument("--system", default="trn2.48xlarge",
                   help=f"a system ({', '.join(system_names())}) or a YAML path; default trn2.48xlarge")
    c.add_argument("--ranks", type=int, help="ranks (logical NeuronCores, rank r on chip r // cores per chip); "
                                             "a divisor of the system's; default all")
    c.add_argument("--bytes", default="8B:4GiB", help="SIZE, MIN:MAX (times --factor each step) or SIZE,SIZE,...; "
                                                      "nccl-tests' S (the all-reduce buffer, the all-gather output...); "
                                                      "default 8B:4GiB")
    c.add_argument("-N", "--nodes", type=int, help="instances the ranks spread over, equally, as nccom-test's -N "
                                                   "(default: every instance of the system when they divide)")
    c.add_argument("--streams", type=int, default=1,
                   help="CC streams the program runs collectives on at once, as nccom-test's --streams-json entries "
                        "(default 1); where the runtime has no multi-stream mesh (collectives.multistream_mesh) "
                        "they run rings")
    c.add_argument("--factor", type=int, default=2, help="growth factor of a MIN:MAX range (default 2)")
    c.add_argument("--algo", help=f"force an algorithm: {', '.join(ALGORITHMS)} (default: the size rule)")
    c.add_argument("--dtype", default="bf16", help="element type (default bf16; int64, uint64, fp64 move as 8-byte "
                                                   "words)")
    c.add_argument("--set", action="append", default=[], metavar="K=V",
                   help="dotted override of the system (topology.x.bandwidth=128GB/s) or its chip "
                        "(core.dma.engine_bandwidth=40GB/s) (repeatable)")
    c.add_argument("--json", action="store_true", help="print the results as JSON")
    c.add_argument("--trace", metavar="OUT.json", help="write a Perfetto trace of the largest size: link lanes "
                                                       "and the ranks' CC DMA queues")
    c.set_defaults(fn=cmd_collective)
