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
