"""The timing model: exact timelines of small programs (as SimPy's own tests assert event
logs), overlap of DMA and compute, LoadStationary overlap, the TensorE power ramp.

trn2 runs at 4.8 GHz ticks: TensorE 2 ticks/cycle, VectorE 5, ScalarE 4, GpSimd 4, Sync 4.
"""

import pytest

import trnsim
from trnsim import Chip, Kernel

NO_THROTTLE = ["core.tensor.throttle_initial_util=1.0"]


def timeline(result, lanes=None):
    return [(lane, label, s, e) for lane, label, s, e, _ in result.report.timeline if lanes is None or lane in lanes]


def test_dependent_chain_across_engines():
    chip = Chip("trn2")
    k = chip.kernel("chain")
    t = k.sbuf((128, 64), "fp32")
    u = k.sbuf((128, 64), "fp32")
    k.iota(t, base=0, channel_multiplier=1)           # GpSimd: 150 + 64 cycles
    k.tensor_scalar(u, t, "multiply", 2.0)            # VectorE: max(64, 64) cycles, fp32 -> no perf mode
    k.activation(t, "exp", u)                         # ScalarE: max(64, 64) + 512 table load
    r = chip.run(k, timing_only=True)
    assert timeline(r) == [
        ("GpSimd", "Iota", 0, 214 * 4),
        # GpSimd result visible 36 cycles (144 ticks) after its end
        ("Vector", "TensorScalar[multiply]", 1000, 1000 + 64 * 5),
        # VectorE result visible 36 VectorE cycles (180 ticks) later
        ("Scalar", "Activation[exp]", 1500, 1500 + (64 + 512) * 4),
    ]
    assert r.report.total_ticks == 1500 + 576 * 4 + 200 * 4
    # a second exp needs no table load; a gelu needs another table set
    k2 = chip.kernel("tables")
    x = k2.sbuf((128, 256), "fp32")
    k2.memset(x, 0.5)
    for fn in ("exp", "exp", "gelu"):
        k2.activation(x, fn, x)
    acts = [e - s for lane, _, s, e in timeline(chip.run(k2, timing_only=True)) if lane == "Scalar"]
    assert acts == [(256 + 512) * 4, 256 * 4, (256 + 512) * 4]


def test_vector_performance_modes():
    chip = Chip("trn2")
    k = chip.kernel("modes")
    a = k.sbuf((128, 1024), "bf16")
    b = k.sbuf((128, 1024), "bf16")
    f = k.sbuf((128, 1024), "fp32")
    p = k.psum((128, 512), "fp32")
    k.memset(a, 0.0)                                   # zero into 16-bit: N/2 = 512 cycles
    k.tensor_copy(b, a)                                # 4x: 1024/4 = 256
    k.tensor_copy(b[:, 0:1024:2], a[:, 0:512])         # non-contiguous 16-bit: 2x -> 512/2 = 256
    k.tensor_copy(f, a)                                # fp32 destination: 1x -> 1024
    k.tensor_tensor(b, a, b, "add")                    # bf16 SBUF add: k=1, 2x -> 512
    k.tensor_tensor(f, f, f, "multiply")               # fp32: k=2 -> 2048
    k.tensor_copy(b[:, 0:512], p)                      # PSUM -> SBUF bf16: 2x -> 256
    k.tensor_reduce(a[:, 0:1], "add", b, axis=1)       # bf16 in/out add: N/2 = 512
    r = chip.run(k, timing_only=True)
    busy = [(e - s) // 5 for lane, _, s, e in timeline(r, {"Vector"})]
    assert busy == [512, 256, 256, 1024, 512, 2048, 256, 512]


def test_matmul_issue_interval_and_stationary_reuse():
    chip = Chip("trn2", NO_THROTTLE)
    k = chip.kernel("mm")
    st = k.sbuf((128, 128), "bf16")
    mv = k.sbuf((128, 512), "bf16")
    acc = k.psum((128, 512), "fp32")
    k.memset(st, 1.0)
    k.memset(mv, 1.0)
    k.nc_matmul(acc, st, mv)
    k.nc_matmul(acc, st, mv, accumulate=True)          # same stationary: no LoadStationary
    k.nc_matmul(acc, mv[:, 0:128], mv, accumulate=True)  # new stationary: LS overlaps the MM before
    out = k.sbuf((128, 512), "bf16")
    k.tensor_copy(out, acc)
    r = chip.run(k, timing_only=True)
    vec = timeline(r, {"Vector"})
    # memset(1.0) is not a zero: max(64, N) cycles -> 128 and 512 VectorE cycles
    assert [(s, e) for _, _, s, e in vec[:2]] == [(0, 640), (640, 640 + 2560)]
    st_ready, mv_ready = 640 + 180, 640 + 2560 + 180
    tens = timeline(r, {"Tensor", "Tensor (LS)"})
    assert tens == [
        # LoadStationary needs only the stationary: it runs while the moving tile is being written
        ("Tensor (LS)", "LoadStationary", st_ready, st_ready + 32 * 2),   # 128 columns / 4 (fast LS)
        ("Tensor", "MultiplyMoving", mv_ready, mv_ready + 1024),          # max(64, 512) PE cycles
        ("Tensor", "MultiplyMoving", mv_ready + 1024, mv_ready + 2048),   # same stationary: no LS
        ("Tensor (LS)", "LoadStationary", mv_ready + 1024, mv_ready + 1088),  # overlaps the MM before
        ("Tensor", "MultiplyMoving", mv_ready + 2048, mv_ready + 3072),
    ]
    ready = mv_ready - 64
    # the copy waits for the PSUM result: fill/drain of 128 + 128 - 2 PE cycles after the last MM
    copy = vec[2]
    assert copy[2] == mv_ready + 3072 + 254 * 2


def test_fp32_matmul_costs_four_times():
    chip = Chip("trn2", NO_THROTTLE)
    durations = {}
    for dt in ("bf16", "fp32"):
        k = chip.kernel(dt)
        st = k.sbuf((128, 128), dt)
        mv = k.sbuf((128, 512), dt)
        acc = k.psum((128, 512), "fp32")
        k.nc_matmul(acc, st, mv)
        (mm,) = timeline(chip.run(k, timing_only=True), {"Tensor"})
        durations[dt] = mm[3] - mm[2]
    assert durations == {"bf16": 1024, "fp32": 4096}


def test_load_stationary_overlap_switch():
    """With overlap off the next LS waits for the previous result to drain (SCALE-Sim's
    weight-stationary schedule): F folds take F*(LS + N + R + C - 2)."""
    def run(overlap):
        chip = Chip("trn2", NO_THROTTLE + [f"core.tensor.overlap_load_stationary={overlap}",
                                           "core.tensor.load_stationary_speedup=1"])
        k = chip.kernel("folds")
        tiles = [k.sbuf((128, 128), "bf16") for _ in range(4)]
        mv = k.sbuf((128, 256), "bf16")
        acc = k.psum((128, 256), "fp32")
        for t in tiles:
            k.nc_matmul(acc, t, mv, accumulate=True)
        r = chip.run(k, timing_only=True)
        mm = timeline(r, {"Tensor", "Tensor (LS)"})
        return (max(e for _, _, _, e in mm) - min(s for _, _, s, _ in mm)) // 2, r.report.total_ticks // 2
    span_on, total_on = run("true")
    span_off, total_off = run("false")
    # pipelined: R + F*max(N, R) ; drained every fold: F*(R + N) + (F-1)*(R+C-2)
    assert span_on == 128 + 4 * 256
    assert span_off == 4 * (128 + 256) + 3 * 254


def test_power_ramp_slows_the_first_microseconds():
    chip = Chip("trn2")
    k = chip.kernel("ramp")
    st = k.sbuf((128, 128), "bf16")
    mv = k.sbuf((128, 512), "bf16")
    acc = k.psum((128, 512), "fp32")
    for i in range(40):
        k.nc_matmul(acc, st, mv, accumulate=i > 0)
    mms = [e - s for lane, _, s, e in timeline(chip.run(k, timing_only=True), {"Tensor"})]
    assert mms[0] == 2048                    # 50% of the rate at the start of a burst
    assert mms[-1] == 1024                   # full rate after ~3 us
    assert mms == sorted(mms, reverse=True)  # monotone ramp
    ramp_end = next(i for i, d in enumerate(mms) if d == 1024)
    assert 3.0e-6 * 4.8e9 <= sum(mms[:ramp_end]) <= 3.5e-6 * 4.8e9  # the ramp lasts ~3 us


def test_dma_single_transfer_timeline():
    chip = Chip("trn2")
    k = chip.kernel("dma")
    x = k.input("x", (4, 4096), "bf16")
    t = k.sbuf((4, 4096), "bf16")
    k.dma_copy(t, x)
    r = chip.run(k, timing_only=True)
    trig, xfer = timeline(r)
    assert trig == ("Sync", "DmaTrigger[qSyncIO0]", 0, 256)    # 64 Sync cycles
    assert xfer[0] == "qSyncIO0" and xfer[2] == 256 + 6240    # 1300 ns start latency
    # one engine: 32 KiB at the sustained 23 GB/s + 4 chunks x 10 ns + 20 ns completion
    assert xfer[3] - xfer[2] == -(-32768 * 4_800_000_000 // 23_000_000_000) + 4 * 48 + 96
    assert r.report.total_ticks == xfer[3]


def _pipeline(bufs, n=8):
    chip = Chip("trn2")
    k = chip.kernel(f"bufs{bufs}")
    x = k.input("x", (n * 128, 2048), "bf16")
    y = k.output("y", (n * 128, 2048), "bf16")
    pool = k.tile_pool("io", bufs=bufs)
    for i in range(n):
        t = pool.tile((128, 2048), "bf16")
        k.dma_copy(t, x[i * 128:(i + 1) * 128, :])
        k.activation(t, "exp", t)
        k.dma_copy(y[i * 128:(i + 1) * 128, :], t, engine="gpsimd")
    return chip.run(k, timing_only=True)


def _overlap(a, b):
    return sum(max(0, min(e1, e2) - max(s1, s2)) for _, _, s1, e1 in a for _, _, s2, e2 in b)


def test_double_buffering_overlaps_dma_with_compute():
    single = _pipeline(1)
    double = _pipeline(2)
    loads_1 = timeline(single, {"qSyncIO0"})
    acts_1 = timeline(single, {"Scalar"})
    loads_2 = timeline(double, {"qSyncIO0"})
    acts_2 = timeline(double, {"Scalar"})
    # single-buffered: a load never runs while the engine computes on the (only) buffer
    assert _overlap(loads_1, acts_1) == 0
    # double-buffered: the next load streams while ScalarE works on the other buffer
    assert _overlap(loads_2, acts_2) > 0.25 * sum(e - s for _, _, s, e in acts_2)
    assert double.report.total_ticks < 0.6 * single.report.total_ticks


def test_queues_overlap_start_latency():
    """Transfers queued back to back hide each other's 1.3 us start latency."""
    chip = Chip("trn2")
    k = chip.kernel("q")
    x = k.input("x", (128, 8192), "bf16")
    tiles = [k.sbuf((128, 1024), "bf16") for _ in range(8)]
    for i, t in enumerate(tiles):
        k.dma_copy(t, x[:, i * 1024:(i + 1) * 1024])
    r = chip.run(k, timing_only=True)
    xfers = timeline(r, {"qSyncIO0"})
    assert all(b[2] < a[3] for a, b in zip(xfers, xfers[1:]))  # each starts before the previous ends
    assert r.report.total_us < 1.3 + 8 * 1.3


def test_same_program_same_cycles():
    a = _pipeline(2)
    b = _pipeline(2)
    assert a.report.timeline == b.report.timeline
    assert a.report.total_ticks == b.report.total_ticks
