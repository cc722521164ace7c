"""Calibration against the datasheet on trn2 (numbers cited from ../shared/trainium-datasheet.md)."""

import pytest

from trnsim import Chip


def test_one_dma_engine_moves_32KiB_in_1416ns():
    """V3 (§10, S13): 32 KiB bf16 [4, 4096] HBM->SBUF on a single DMA engine takes 1416 ns."""
    chip = Chip("trn2")
    k = chip.kernel("v3")
    x = k.input("x", (4, 4096), "bf16")
    t = k.sbuf((4, 4096), "bf16")
    k.dma_copy(t, x)
    r = chip.run(k, timing_only=True)
    (seg,) = r.report.segments("qSyncIO0")
    assert {e for e, _, _ in k.instructions[0].plan.engines} == {0}  # 4 partitions: one engine
    ns = (seg[3] - seg[2]) / r.report.tick_hz * 1e9
    assert ns == pytest.approx(1416, rel=0.10)


def _stream(dtype, n=1000, new_stationary=False):
    chip = Chip("trn2")
    k = chip.kernel(f"stream-{dtype}")
    a = k.input("a", (128, 128 * 8), dtype)
    b = k.input("b", (128, 512), dtype)
    st = k.sbuf((128, 128 * 8), dtype)
    mv = k.sbuf((128, 512), dtype)
    k.dma_copy(st, a)
    k.dma_copy(mv, b, queue=1)
    banks = [k.psum((128, 512), "fp32") for _ in range(8)]
    for i in range(n):
        s = (i % 8) if new_stationary else 0
        k.nc_matmul(banks[i % 8], st[:, s * 128:(s + 1) * 128], mv, accumulate=i >= 8)
    return chip.run(k, timing_only=True).report


def test_bf16_matmul_stream_reaches_97_percent_of_peak():
    """§1/§12.1: 128x128 PEs x 2 FLOP x 2.4 GHz = 78.6 TFLOPS bf16 per core; a stream of
    128x128x512 matmuls issues one every max(N, 64) = 512 PE cycles."""
    rep = _stream("bf16")
    assert rep.matmul_flops == 1000 * 2 * 128 * 128 * 512
    assert rep.mfu_estimated_percent >= 97.0
    # LoadStationary for a new stationary each time hides behind the previous MM
    assert _stream("bf16", new_stationary=True).mfu_estimated_percent >= 97.0


def test_fp32_matmul_runs_at_a_quarter():
    """§4.2/§7: fp32 matmuls cost 4x the PE cycles (19.7 TFLOPS per core)."""
    bf16 = _stream("bf16")
    fp32 = _stream("fp32")
    assert fp32.mfu_estimated_percent == pytest.approx(bf16.mfu_estimated_percent / 4, rel=0.02)
    assert fp32.hfu_estimated_percent >= 97.0  # in BF16-equivalent hardware FLOPs it is full


def test_fp8_double_row_doubles_throughput():
    """§4.2: FP8 double-row contracts 256 rows in the cycles of 128 (157 TFLOPS per core)."""
    chip = Chip("trn2")
    k = chip.kernel("fp8")
    st = k.sbuf((128, 2, 128), "fp8_e4m3")
    mv = k.sbuf((128, 2, 512), "fp8_e4m3")
    k.memset(st, 0.0)
    k.memset(mv, 0.0)
    acc = k.psum((128, 512), "fp32")
    for i in range(1000):
        k.nc_matmul(acc, st, mv, accumulate=i > 0)
    rep = chip.run(k, timing_only=True).report
    assert rep.mfu_estimated_percent >= 2 * 97.0


def _dma_rate(bytes_per_partition, n=16):
    chip = Chip("trn2")
    k = chip.kernel("eff")
    cols = bytes_per_partition // 2
    x = k.input("x", (128, cols * n), "bf16")
    t = k.sbuf((128, cols * n), "bf16")
    for i in range(n):
        k.dma_copy(t[:, i * cols:(i + 1) * cols], x[:, i * cols:(i + 1) * cols], queue=i % 4)
    rep = chip.run(k, timing_only=True).report
    first = min(s for lane, _, s, _, _ in rep.timeline if lane.startswith("q"))
    last = max(e for lane, _, _, e, _ in rep.timeline if lane.startswith("q"))
    return rep.dma.bytes / ((last - first) / rep.tick_hz)


def test_dma_efficiency_grows_with_bytes_per_partition():
    """§6 (S12/S13): <256 B per partition is overhead-bound, >=2 KiB near peak, >=4 KiB saturates.
    The per-core peak is the sustained rate: 16 engines x 23 B/ns = 368 GB/s on Trn2 (S12)."""
    rates = {b: _dma_rate(b) for b in (128, 512, 2048, 8192)}
    peak = 16 * 23e9
    assert rates[128] < 0.5 * peak
    assert rates[128] < rates[512] < rates[2048] < rates[8192]
    assert rates[2048] > 0.8 * peak
    assert rates[8192] > 0.9 * peak


@pytest.mark.parametrize("config, sustained", [("trn1", 17e9), ("trn2", 23e9), ("trn3", 33e9)])
def test_large_transfers_settle_at_the_sustained_engine_rate(config, sustained):
    """The NKI DMA bandwidth guide (§6, S12) gives 17/23/33 B/ns per engine on Trn1/2/3 for
    payloads of >= 4 KiB per partition; the rate must settle there, not climb toward the
    theoretical 27.2/38.4 GB/s. One engine (8 partitions), 64 KiB per partition, timed from its
    data start to its end."""
    chip = Chip(config)
    k = chip.kernel("settle")
    x = k.input("x", (8, 32768), "bf16")
    t = k.sbuf((8, 32768), "bf16")
    k.dma_copy(t, x)
    r = chip.run(k, timing_only=True)
    (seg,) = r.report.segments("qSyncIO0")
    rate = 8 * 65536 / ((seg[3] - seg[2]) / r.report.tick_hz)
    assert 0.97 * sustained < rate < sustained


def test_cores_on_one_hbm_stack_share_its_bandwidth():
    """HBM bandwidth is a chip resource: on Trn2 each stack serves two cores (§1, S20)."""
    cfg = ["chip.hbm.bandwidth=400GB/s"]  # a slow chip: 100 GB/s per stack, below one core's DMA rate

    def kernel(chip):
        k = chip.kernel("stream")
        x = k.input("x", (128, 65536), "bf16")
        t = k.sbuf((128, 8192), "bf16")
        for i in range(8):
            k.dma_copy(t, x[:, i * 8192:(i + 1) * 8192], queue=i % 2)
        return k

    chip = Chip("trn2", cfg)
    alone = chip.run(kernel(chip), timing_only=True).report.total_ticks
    pair = chip.run_spmd([kernel(chip), kernel(chip)], timing_only=True)  # cores 0 and 1: one stack
    assert max(r.report.total_ticks for r in pair) > 1.8 * alone
    apart = chip.run_spmd([kernel(chip)] + [chip.kernel("idle")] * 3 + [kernel(chip)], timing_only=True)
    assert apart[4].report.total_ticks == alone  # core 4 sits on another stack


def test_hbm_streaming_reports_bandwidth_within_what_a_core_can_reach():
    chip = Chip("trn2")
    k = chip.kernel("stream")
    x = k.input("x", (128, 16 * 4096), "bf16")
    t = k.sbuf((128, 16 * 4096), "bf16")
    for i in range(16):
        k.dma_copy(t[:, i * 4096:(i + 1) * 4096], x[:, i * 4096:(i + 1) * 4096], queue=i % 4)
    rep = chip.run(k, timing_only=True).report
    reachable = min(16 * 23e9, 2.9e12 / 4)  # its DMA engines at the sustained rate, capped by its HBM stack
    assert rep.hbm_bytes_per_s == pytest.approx(rep.hbm_read_bytes / (rep.total_us * 1e-6))
    assert 50 < rep.mbu_estimated_percent <= 100
    assert rep.mbu_estimated_percent == pytest.approx(100 * rep.hbm_bytes_per_s / reachable)
