"""Collective traffic is DMA: beside a DMA-bound kernel on the same logical core, both slow
down (shared DMA engines and HBM stack); the API a device model uses to run collectives in its
own simpy environment."""

import json

import simpy

import trnsim
from trnsim.bandwidth import BandwidthPipe
from trnsim.collectives import ChipResources, CollectiveCall, CollectiveRunner, simulate_beside_kernels, \
    simulate_collective
from trnsim.collectives.trace import write_collective_trace
from trnsim.config import load_system
from trnsim.memory.hbm import stack_bandwidth, stack_of_core
from trnsim.report import build_report
from trnsim.sim import CoreTimeline

TRN2 = load_system("trn2.48xlarge")
CFG = TRN2.chip


def streaming_kernel(blocks=16, cols=8192):
    """HBM -> SBUF -> HBM in [128, cols] bf16 blocks on two queues: DMA-bound."""
    k = trnsim.Kernel("stream", CFG)
    x = k.input("x", (128 * blocks, cols), "bf16")
    y = k.output("y", (128 * blocks, cols), "bf16")
    pool = k.tile_pool("io", bufs=4)
    for i in range(blocks):
        t = pool.tile((128, cols), "bf16")
        k.dma_copy(t, x[i * 128:(i + 1) * 128, :])
        k.dma_copy(y[i * 128:(i + 1) * 128, :], t, queue=1)
    return k


def test_a_collective_beside_a_dma_bound_kernel_slows_both():
    kernel = streaming_kernel()
    alone_k = trnsim.Chip(CFG).run(kernel, timing_only=True).report
    assert alone_k.dma.active_percent > 80
    call = CollectiveCall("all-reduce", 64 << 20, group=[0, 1, 2, 3], algorithm="ring")  # rank 0 = cores 0, 1
    alone_c = simulate_collective(TRN2, "all-reduce", 64 << 20, group=[0, 1, 2, 3], algorithm="ring")
    (rep,), tls = simulate_beside_kernels(TRN2, [call], {0: [kernel]})
    tl = tls[0][0]
    together_k = build_report(kernel.name, kernel.instructions, tl.segments, tl.total_ticks, CFG, 0,
                              kernel.sbuf_peak_bytes, kernel.psum_peak_bytes)
    assert together_k.total_ticks > 1.1 * alone_k.total_ticks
    assert rep.time_ticks > 1.05 * alone_c.time_ticks  # on its 2 rings per core of the 16 the kernel streams on
    # on another chip, nothing is shared: both run as fast as alone
    (far,), tls = simulate_beside_kernels(TRN2, [call], {3: [kernel]})
    assert far.time_ticks == alone_c.time_ticks and tls[3][0].total_ticks == alone_k.total_ticks


def test_a_device_model_runs_collectives_in_its_own_environment():
    """What the device model does: its own env and kernel timelines, a CollectiveRunner over
    them, launches at given ticks, and per-rank completion events."""
    env = simpy.Environment()
    pipes = [BandwidthPipe(stack_bandwidth(CFG), CFG.tick_hz) for _ in range(CFG.chip.hbm.stacks)]
    idle = trnsim.Kernel("idle", CFG)
    tls = [CoreTimeline(env, CFG, idle, pipes[stack_of_core(CFG, c)], c) for c in range(CFG.chip.cores)]
    engine = CollectiveRunner(TRN2, env, {0: ChipResources.from_timelines(tls, pipes)})
    h = engine.launch(CollectiveCall("all-gather", 4 << 20, group=[0, 1, 2, 3], start=[0, 100, 200, 300]))
    seen = {}

    def waiter(r):
        tick = yield h.rank_done[r]
        seen[r] = (tick, env.now)

    for r in (0, 1, 2, 3):
        env.process(waiter(r))
    env.run()
    rep = engine.report(h)
    assert {r: t for r, (t, _) in seen.items()} == dict(zip(rep.group, rep.end_ticks))
    assert all(t == now for t, now in seen.values())
    assert rep.start_ticks == (0, 100, 200, 300) and rep.algorithm == "kangaring"  # 4 MiB on 4 ranks: 64 MiB per 64
    assert h.done.triggered


def test_trace_has_link_lanes_and_cc_queues(tmp_path):
    r = simulate_collective(TRN2, "all-reduce", 4 << 20, ranks=8, algorithm="ring", trace=True)
    path = write_collective_trace(tmp_path / "t.json", [r], TRN2.ranks_per_chip)
    doc = json.loads(path.read_text())
    names = {e["args"]["name"] for e in doc["traceEvents"] if e.get("name") == "thread_name"}
    procs = {e["args"]["name"] for e in doc["traceEvents"] if e.get("name") == "process_name"}
    assert procs == {"chip 0", "chip 1"}
    assert {"link chip 0 -> chip 1 (x+)", "link chip 1 -> chip 0 (x-)", "rank 0 CC0", "rank 7 CC0"} <= names
    bars = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert sum(1 for e in bars if e["cat"] == "cc") == r.transfers
    assert all(e["dur"] > 0 for e in bars)
