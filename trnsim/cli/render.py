"""What the ``trnsim`` command prints: a chip's figures (``info``), a kernel's cycle report and DMA
queues, and the run reports of ``trnsim run`` (ops, regions, ranks, eager against compiled)."""

from __future__ import annotations

from typing import Any, Sequence

from .base import Out
from ..config import ChipConfig, format_quantity
from ..sim.report import KernelReport, bound_of

# ---------------------------------------------------------------------------------------------
# info
# ---------------------------------------------------------------------------------------------


def info_data(cfg: ChipConfig) -> dict[str, Any]:
    """The figures ``trnsim info`` prints, as plain data."""
    c, chip = cfg.core, cfg.chip
    dtypes = ["bf16", "fp16", "fp8", "fp32"] + (["mxfp8"] if c.tensor.mx_quad else [])
    peaks = {d: cfg.peak_flops_per_core(d) for d in dtypes}
    dma_core = c.dma.engines * c.dma.engine_bandwidth
    return {
        "name": cfg.name,
        "description": cfg.description,
        "source": cfg.source,
        "overrides": dict(cfg.overrides),
        "core_version": c.version,
        "physical_cores": chip.cores,
        "lnc": chip.lnc,
        "logical_cores": cfg.logical_cores,
        "clocks_hz": cfg.engine_clocks,
        "tick_hz": cfg.tick_hz,
        "pe_array": [c.tensor.pe_rows, c.tensor.pe_cols],
        "peak_flops_per_core": peaks,
        "peak_flops_per_chip": {d: v * chip.cores for d, v in peaks.items()},
        "sbuf_bytes_per_core": c.sbuf.bytes,
        "sbuf_partitions": c.sbuf.partitions,
        "sbuf_partition_bytes": c.sbuf.partition_bytes,
        "psum_bytes_per_core": c.psum.bytes,
        "psum_banks": c.psum.banks,
        "psum_bank_bytes": c.psum.bank_bytes,
        "hbm_bytes": chip.hbm.capacity,
        "hbm_bandwidth": chip.hbm.bandwidth,
        "hbm_stacks": chip.hbm.stacks,
        "hbm_bandwidth_per_core": cfg.hbm_bandwidth_per_core,
        "dma_engines_per_core": c.dma.engines,
        "dma_queues_per_engine": c.dma.queues,
        "dma_engine_bandwidth": c.dma.engine_bandwidth,
        "dma_bandwidth_per_core": dma_core,
        "dma_bandwidth_per_chip": dma_core * chip.cores,
        "dma_start_latency_ns": c.dma.start_latency / 1000,
        "neuronlink": {
            "version": chip.neuronlink.version,
            "links": chip.neuronlink.links,
            "bandwidth": chip.neuronlink.bandwidth,
        },
        "host_dispatch_ns": cfg.host.dispatch / 1000,
        "host_max_inflight": cfg.host.max_inflight,
    }


def render_info(cfg: ChipConfig, console: Any) -> None:
    from rich.table import Table

    d = info_data(cfg)
    c = cfg.core
    title = f"{cfg.name}: {cfg.description}"
    if cfg.overrides:
        title += f"  (with {cfg.describe_overrides()})"
    t = Table(title=title, show_header=False, title_justify="left", box=None, padding=(0, 2))
    t.add_column(style="bold")
    t.add_column()
    bw = lambda v: format_quantity(v, "bandwidth")  # noqa: E731
    hz = lambda v: format_quantity(v, "hz")  # noqa: E731
    by = lambda v: format_quantity(v, "bytes")  # noqa: E731
    t.add_row("Cores", f"{d['physical_cores']} physical {c.version}, LNC={d['lnc']} -> {d['logical_cores']} logical")
    t.add_row("Clocks", ", ".join(f"{k} {hz(v)}" for k, v in d["clocks_hz"].items()))
    t.add_row("PE array", f"{c.tensor.pe_rows} x {c.tensor.pe_cols}, moving tile <= {c.tensor.moving_max_free}, "
                          f"stationary <= {c.tensor.stationary_max_free}")
    peaks = ", ".join(f"{k} {v / 1e12:.1f}" for k, v in d["peak_flops_per_core"].items())
    chip_peaks = ", ".join(f"{k} {v / 1e12:.0f}" for k, v in d["peak_flops_per_chip"].items())
    t.add_row("Peak TFLOP/s", f"per core: {peaks}")
    t.add_row("", f"per chip: {chip_peaks}")
    t.add_row("SBUF", f"{by(c.sbuf.bytes)} per core = {c.sbuf.partitions} partitions x {by(c.sbuf.partition_bytes)}")
    t.add_row("PSUM", f"{by(c.psum.bytes)} per core = {c.psum.partitions} partitions x {c.psum.banks} banks x "
                      f"{by(c.psum.bank_bytes)}")
    t.add_row("HBM", f"{by(cfg.chip.hbm.capacity)}, {bw(cfg.chip.hbm.bandwidth)} over {cfg.chip.hbm.stacks} stacks "
                     f"({bw(cfg.hbm_bandwidth_per_core)} per core)")
    t.add_row("DMA", f"{c.dma.engines} engines x {c.dma.queues} queues per core, {bw(c.dma.engine_bandwidth)} per "
                     f"engine = {bw(d['dma_bandwidth_per_core'])} per core, {bw(d['dma_bandwidth_per_chip'])} per chip; "
                     f"start latency {format_quantity(c.dma.start_latency, 'time')}")
    nl = cfg.chip.neuronlink
    t.add_row("NeuronLink", f"{nl.version}, {nl.links} links, {bw(nl.bandwidth)} per chip; systems in configs/systems/")
    t.add_row("Host", f"{format_quantity(cfg.host.dispatch, 'time')} to issue a launch, up to "
                      f"{cfg.host.max_inflight} unfinished launches per logical core")
    t.add_row("Source", cfg.source_display)
    console.print(t)


# ---------------------------------------------------------------------------------------------
# kernel reports
# ---------------------------------------------------------------------------------------------


def render_report(report: KernelReport, console: Any, config: ChipConfig | None = None) -> None:
    from rich.table import Table

    head = Table(title=f"Kernel '{report.kernel}' on {report.config} (core {report.core})",
                 show_header=False, title_justify="left", box=None, padding=(0, 2))
    head.add_column(style="bold")
    head.add_column()
    head.add_row("Total", f"{report.total_cycles:,.0f} cycles ({report.total_us:,.3f} us) at the TensorE clock, "
                          f"first issue to last result")
    head.add_row("MFU", f"{report.mfu_estimated_percent:.2f}%  (HFU {report.hfu_estimated_percent:.2f}%, "
                        f"{report.achieved_flops_per_s / 1e12:.2f} TFLOP/s)")
    hbm = report.hbm_read_bytes + report.hbm_write_bytes
    head.add_row("HBM", f"read {format_quantity(report.hbm_read_bytes, 'bytes')}, written "
                        f"{format_quantity(report.hbm_write_bytes, 'bytes')}; MBU {report.mbu_estimated_percent:.1f}%")
    if report.matmul_flops and hbm:
        head.add_row("Intensity", f"{report.matmul_flops / hbm:.1f} FLOP/byte of HBM traffic")
    head.add_row("DMA", f"{report.dma.transfers} transfers, {format_quantity(report.dma.bytes, 'bytes')}, "
                        f"avg {format_quantity(report.dma.average_bytes, 'bytes')}, "
                        f"{format_quantity(report.dma.achieved_bytes_per_s, 'bandwidth')}, "
                        f"active {report.dma.active_percent:.1f}%")
    head.add_row("SBUF peak", f"{format_quantity(report.sbuf_peak_bytes, 'bytes')} per partition; PSUM peak "
                              f"{format_quantity(report.psum_peak_bytes, 'bytes')} per partition")
    head.add_row("Bound by", bound_of(report))
    console.print(head)
    t = Table(title="Engines", title_justify="left")
    for col in ("engine", "instructions", "busy cycles (own clock)", "busy us", "active"):
        t.add_column(col, justify="left" if col == "engine" else "right")
    for name, s in report.engines.items():
        t.add_row(name, f"{s.instructions:,}", f"{s.busy_cycles:,.0f}", f"{s.busy_us:,.3f}", f"{s.active_percent:.1f}%")
    t.add_row("DMA", f"{report.dma.transfers:,}", "", f"{report.dma.active_percent * report.total_us / 100:,.3f}",
              f"{report.dma.active_percent:.1f}%")
    console.print(t)
    c = Table(title="Instructions", title_justify="left")
    c.add_column("kind")
    c.add_column("count", justify="right")
    for kind, n in sorted(report.instruction_counts.items(), key=lambda kv: -kv[1]):
        c.add_row(kind, f"{n:,}")
    console.print(c)


def render_dma_queues(report: KernelReport, console: Any) -> None:
    """Per DMA queue: transfers, bytes, busy time (any transfer in flight) and the bandwidth
    achieved while busy."""
    from rich.table import Table

    if not report.dma.queues:
        return
    t = Table(title="DMA queues", title_justify="left")
    for col in ("queue", "transfers", "bytes", "busy us", "bandwidth while busy", "active"):
        t.add_column(col, justify="left" if col == "queue" else "right")
    for lane, q in sorted(report.dma.queues.items()):
        busy_us = q["busy_us"]
        bw = q["bytes"] / (busy_us * 1e-6) if busy_us else 0.0
        t.add_row(lane, f"{q['transfers']:,.0f}", format_quantity(q["bytes"], "bytes"), f"{busy_us:,.3f}",
                  format_quantity(bw, "bandwidth"), f"{100 * busy_us / report.total_us if report.total_us else 0:.1f}%")
    console.print(t)


def render_comparison(eager: Any, compiled: Any, title: str, console: Any) -> None:
    """The same run eager and compiled, side by side (``trnsim run --compare-eager``)."""
    from rich.table import Table

    t = Table(title=f"eager vs compiled: {title}", title_justify="left")
    for col in ("", "eager", "compiled", "compiled / eager"):
        t.add_column(col, justify="left" if not col else "right")

    def ratio(a: float, b: float) -> str:
        return f"{b / a:.2f}x" if a else "-"

    for name, a, b, fmt in (("elapsed us (simulated)", eager.elapsed_us, compiled.elapsed_us, "{:,.1f}"),
                            ("device time us", eager.device_us, compiled.device_us, "{:,.1f}"),
                            ("device waiting on the host us", eager.host_wait_us, compiled.host_wait_us, "{:,.1f}"),
                            ("kernel launches", eager.launches, compiled.launches, "{:,}"),
                            ("host dispatches", eager.dispatches, compiled.dispatches, "{:,}"),
                            ("HBM MB", eager.hbm_bytes / 1e6, compiled.hbm_bytes / 1e6, "{:,.2f}")):
        t.add_row(name, fmt.format(a), fmt.format(b), ratio(a, b))
    console.print(t)
    speedup = eager.elapsed_us / compiled.elapsed_us if compiled.elapsed_us else 0.0
    console.print(f"compiled is {speedup:.2f}x faster in simulated time" if speedup >= 1 else
                  f"compiled is {1 / speedup:.2f}x slower in simulated time" if speedup else "nothing ran")
    if not compiled.compiled_graphs:
        console.print("(the script compiled nothing: wrap the model in torch.compile(..., backend=\"neuron\") to "
                      "compare)")


def _render_regions(rep: Any, console: Any) -> None:
    """The compiled regions of a run: what each fused kernel replaced and what that saved."""
    cols = ("region (fused aten ops)", "kernel", "calls", "time us", "eager us", "HBM MB", "eager HBM MB",
            "launches saved")
    rows = [[" ".join(r.fused_ops), r.kernel, f"{r.calls:,}", f"{r.time_us:,.1f}", f"{r.eager_time_us:,.1f}",
             f"{r.hbm_bytes / 1e6:,.2f}", f"{r.eager_hbm_bytes / 1e6:,.2f}", f"{r.eager_launches - r.calls:,}"]
            for r in rep.regions]
    console.print(_fitted_table(f"compiled regions: {len(rep.regions)} fused kernels", cols, rows,
                                names=cols[:2]))


REPORT_WIDTH = 120
RUN_REPORT_WIDTH = REPORT_WIDTH
NAME_COLUMN = 28  # characters of an op, kernel or region name in a table


def run_report_width(rep: Any) -> int:
    """The console width of a run report (:data:`REPORT_WIDTH`, whatever its rows)."""
    return REPORT_WIDTH


def _size(n: int) -> str:
    """Bytes in the largest binary unit that keeps a number >= 1, two decimals (4.12 MiB)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n} B"


def _fitted_table(title: str, cols: Sequence[str], rows: Sequence[Sequence[str]], names: Sequence[str] = (),
                  left: Sequence[str] = ()) -> Any:
    """A report table that fits :data:`REPORT_WIDTH`: figures are never cut (each column as wide as
    its widest cell or its header's longest word; a longer header takes two lines), the ``names``
    columns share what is left, at most :data:`NAME_COLUMN` each, and cut a longer name with an
    ellipsis (the data - --json, Parquet, the trace - keeps it whole). ``left``: columns aligned
    left besides the names."""
    import textwrap

    from rich import box
    from rich.table import Table

    widths = [max([len(r[i]) for r in rows] + [len(w) for w in col.split()]) for i, col in enumerate(cols)]
    named = [i for i, col in enumerate(cols) if col in names]
    for i in named:
        widths[i] = min(max([len(r[i]) for r in rows] + [len(cols[i])]), NAME_COLUMN)
    # the SIMPLE_HEAD box: one space of padding each side of a cell, a separator between cells and
    # at each edge
    room = REPORT_WIDTH - (3 * len(cols) + 1) - sum(w for i, w in enumerate(widths) if i not in named)
    while named and sum(widths[i] for i in named) > room and max(widths[i] for i in named) > 4:
        widest = max(named, key=lambda i: widths[i])
        widths[widest] -= 1
    t = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD)
    for i, col in enumerate(cols):
        header = col if i in named else textwrap.fill(col, widths[i])
        t.add_column(header, justify="left" if i in named or col in left else "right", width=widths[i],
                     no_wrap=True, overflow="ellipsis")
    for r in rows:
        t.add_row(*r)
    return t


def render_run_report(rep: Any, title: str, console: Any) -> None:
    """A RunReport as a table, busiest op first (``trnsim run``, ``trnsim demo`` and
    examples/train_gpt2.py print it this way), then the run's time figures and its host-only ops.
    Collective rows (torch.distributed on the neuron backend) add what they moved: bytes (S),
    busbw and the time waiting for the group's last rank."""
    colls = any(r.collective is not None for r in rep.rows)
    cols = ["op", "kernel", "calls", "time us", "share", "wait us", "MFU", "HBM MB", "bound"]
    if colls:
        cols += ["bytes", "busbw GiB/s", "peers us", "shared"]
    rows = []
    for r in rep.rows:
        cells = [r.op, r.kernel + (" *" if r.generic else ""), f"{r.calls:,}", f"{r.time_us:,.1f}",
                 f"{r.share_percent:.1f}%", f"{r.host_wait_us:,.1f}", f"{r.mfu_percent:.1f}%",
                 f"{r.hbm_bytes / 1e6:,.2f}", r.bound]
        if colls:
            c = r.collective
            cells += [_size(c.bytes), f"{c.busbw / 2**30:,.2f}", f"{c.peer_wait_us:,.1f}", f"{c.slowdown:.2f}x"] \
                if c is not None else ["", "", "", ""]
        rows.append(cells)
    console.print(_fitted_table(f"neuron run report: {title}", cols, rows, names=("op", "kernel", "bound")))
    console.print(f"elapsed: {rep.elapsed_us:,.1f} us simulated; {rep.launches:,} launches: {rep.device_us:,.1f} us "
                  f"of device time, {rep.host_wait_us:,.1f} us of device idle waiting on the host")
    console.print(f"host: {rep.host_us:,.1f} us issuing launches; MFU {rep.mfu_percent:.1f}%")
    if rep.overlap_us >= 0.05:
        console.print(f"streams: {rep.overlap_us:,.1f} us of device time ran beside another stream's kernel on the same "
                      f"core (so device time can exceed elapsed); sharing the core's engines added "
                      f"{rep.contention_us:,.1f} us to those kernels (contention)")
    if rep.compiled_graphs or rep.graph_launches:
        console.print(f"compiled: {rep.compiled_graphs} graphs compiled in {rep.compile_seconds:.2f} s wall (not "
                      f"charged to the device); {rep.graph_launches:,} graph launches ({rep.dispatches:,} host "
                      f"dispatches for {rep.launches:,} kernels)")
    if rep.regions:
        console.print(f"fused regions: {sum(r.calls for r in rep.regions):,} launches of {len(rep.regions)} fused "
                      f"kernels instead of {sum(r.eager_launches for r in rep.regions):,} eager ones: "
                      f"{rep.launches_saved:,} launches and {rep.hbm_bytes_saved / 1e6:,.2f} MB of HBM traffic saved")
        _render_regions(rep, console)
    if rep.host_ops:
        ops = ", ".join(f"{op} {n:,}" for op, n in sorted(rep.host_ops.items(), key=lambda kv: (-kv[1], kv[0])))
        console.print(f"host-only ops (metadata, no device kernel): {rep.host_only_calls:,} calls: {ops}")
    console.print("(* generic kernel: DMA + engine streaming, no library kernel; wait: device idle waiting on the host; "
                  "bound launch: the device waited longer than it worked)")
    if colls:
        console.print("(collective rows: kernel is collective:algorithm of the NeuronLink model; bytes is nccl-tests' "
                      "S summed over calls; busbw over the model's time; peers: waiting for the group's last rank; "
                      "shared: the model's time over the same calls' alone, each simulated beside its sibling groups' "
                      "(the other TP or DP groups of an SPMD step); bound: what held the collective back in the model)")


def render_rank_report(rep: Any, title: str, console: Any) -> None:
    """A :class:`trnsim.ranks.MultiRankReport`: the rows of every rank summed (collectives beside
    compute), then one line per rank and the step time as the slowest rank saw it."""
    render_run_report(rep.total, f"{title} (all ranks)", console)

    def pct(part: float, whole: float) -> str:
        return f"{100.0 * part / whole:.0f}%" if whole else "-"
    rows = [[str(r), str(s.chip), f"{s.elapsed_us:,.1f}", f"{s.compute_us:,.1f}", f"{s.collective_us:,.1f}",
             pct(s.overlapped_us, s.collective_us), pct(s.beside_compute_us, s.collective_us),
             f"{s.exposed_us:,.1f}", f"{s.peer_wait_us:,.1f}", f"{s.collectives:,}", str(len(s.step_ends_us))]
            for r, s in sorted(rep.summaries.items())]
    console.print(_fitted_table(f"per rank ({rep.world} ranks of {rep.system}, rank r = NeuronCore r)",
                                ("rank", "chip", "elapsed us", "compute us", "collective us", "overlapped",
                                 "beside compute", "exposed us", "peers us", "collectives", "steps"), rows))
    slow = max(rep.summaries.values(), key=lambda s: s.elapsed_us)
    if rep.step_times_us:
        console.print(f"step: {rep.step_us:,.1f} us simulated as the slowest rank saw it "
                      f"({len(rep.step_times_us)} optimizer steps; the first, with setup, took "
                      f"{rep.step_times_us[0]:,.1f} us); slowest rank {slow.rank}: {slow.elapsed_us:,.1f} us elapsed")
    else:
        console.print(f"no optimizer steps; slowest rank {slow.rank}: {slow.elapsed_us:,.1f} us elapsed")
    console.print("(compute/collective: union of the rank's kernels / collectives on its timeline; exposed: collective "
                  "time with compute stalled on it (a kernel issued and held back, none running); overlapped: the rest, "
                  "hidden behind compute or the host still issuing; beside compute: with a kernel running at the same "
                  "time; peers: waiting for the last rank of a group)")


def print_run_report(rep: Any, title: str) -> None:
    """:func:`render_run_report` to stdout, wide enough for op and kernel names."""
    render_run_report(rep, title, Out(width=run_report_width(rep)))
