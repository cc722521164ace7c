"""HBM against the configs' own figures: an HBM-bound elementwise kernel reaches >= 85% of what
each core can reach (its HBM share or its DMA engines' sustained rate) with every core busy, and
Trn2/Trn3 time ratios follow the ratio of those (memory-bound) and the TensorE peak-rate ratio
(compute-bound).

1. Bandwidth: a bf16 ``binary`` add of two [R, C] tensors into a third (2 reads + 1 write per
   element) runs on every physical core at once (``Chip.run_spmd``), each on its own tensors, so
   the cores on one HBM stack share it. The slowest core's HBM bytes over its time must reach 85%
   of what one core can: the smaller of its HBM share (datasheet §1: 2.9 TB/s / 8 = 362.5 GB/s on
   Trn2, 4.9 / 8 = 612.5 on Trn3) and its 16 DMA engines' sustained rate (§6: 16 x 23 = 368 and
   16 x 33 = 528 GB/s). A Trn2 core is HBM-bound, a Trn3 core DMA-bound.
2. Memory-bound ratio: Trn2/Trn3 time of (1) follows 528 / 362.5 = 1.457 within 7% (each 16 KiB
   descriptor's 10 ns costs the DMA-bound Trn3 core 2%; the fill and drain are the rest), and the
   configs' own bound (descriptor cost included) within 2.5%.
3. Compute-bound ratio: a bf16 matmul runs > 95% of TensorE peak on both, so its time ratio
   follows clock x PE array (2.4 GHz x 128 x 128 on both: 1.000) within 2%.
"""

from dataclasses import dataclass

import pytest

from trnsim import Chip, load_config
from trnsim.config import ChipConfig
from trnsim.kernels import get_kernel

DESCRIPTOR_BYTES = 16384  # the binary kernel's default tile_bytes: one descriptor per partition


@dataclass(frozen=True)
class Check:
    """One figure: simulated next to expected; ``floor`` checks sim >= expected * tol."""

    name: str
    simulated: float
    expected: float
    tolerance: float
    floor: bool = False

    @property
    def ok(self) -> bool:
        if self.floor:
            return self.simulated >= self.expected * self.tolerance
        return abs(self.simulated / self.expected - 1.0) <= self.tolerance


def _stream(cfg: ChipConfig, shape: tuple[int, int]) -> tuple[float, float]:
    """(seconds, bytes/s) of the slowest core, the binary add on every core at once."""
    entry = get_kernel("binary")
    runs = Chip(cfg).run_spmd([entry.make(shape, "bf16", cfg) for _ in range(cfg.chip.cores)], timing_only=True)
    slow = max((r.report for r in runs), key=lambda r: r.total_ticks)
    seconds = slow.total_ticks / slow.tick_hz
    return seconds, (slow.hbm_read_bytes + slow.hbm_write_bytes) / seconds


def _matmul(cfg: ChipConfig, n: int) -> tuple[float, float]:
    rep = Chip(cfg).run(get_kernel("matmul").make((n, n, n), "bf16", cfg), timing_only=True).report
    return rep.total_ticks / rep.tick_hz, rep.mfu_estimated_percent


def _reachable(cfg: ChipConfig) -> float:
    return min(cfg.hbm_bandwidth_per_core, cfg.core.dma.engines * cfg.core.dma.engine_bandwidth)


def _dma_bound(cfg: ChipConfig) -> float:
    d = cfg.core.dma
    per_desc = DESCRIPTOR_BYTES / d.engine_bandwidth
    eff = per_desc / (per_desc + d.descriptor_overhead * 1e-12)
    return min(cfg.hbm_bandwidth_per_core, d.engines * d.engine_bandwidth * eff)


def _measure() -> list[Check]:
    cfgs = {name: load_config(name) for name in ("trn2", "trn3")}
    streams = {n: _stream(c, (4096, 8192)) for n, c in cfgs.items()}
    mms = {n: _matmul(c, 2048) for n, c in cfgs.items()}
    checks = [Check(f"{n} HBM GB/s per core (>= 85% of reachable)", streams[n][1] / 1e9, _reachable(c) / 1e9, 0.85,
                    floor=True) for n, c in cfgs.items()]
    mem = streams["trn2"][0] / streams["trn3"][0]
    checks.append(Check("memory-bound time ratio trn2/trn3 vs reachable ratio", mem,
                        _reachable(cfgs["trn3"]) / _reachable(cfgs["trn2"]), 0.07))
    checks.append(Check("memory-bound time ratio trn2/trn3 vs config bound ratio", mem,
                        _dma_bound(cfgs["trn3"]) / _dma_bound(cfgs["trn2"]), 0.025))
    peak = cfgs["trn3"].peak_flops_per_core("bf16") / cfgs["trn2"].peak_flops_per_core("bf16")
    checks.append(Check("compute-bound time ratio trn2/trn3 vs peak-rate ratio", mms["trn2"][0] / mms["trn3"][0],
                        peak, 0.02))
    checks += [Check(f"{n} matmul MFU % (compute-bound: > 95%)", mms[n][1], 100.0, 0.95, floor=True) for n in cfgs]
    return checks


@pytest.fixture(scope="module")
def checks():
    return {c.name: c for c in _measure()}


def test_every_quick_check_passes(checks):
    assert len(checks) == 7
    missed = [f"{c.name}: {c.simulated:.3f} vs {c.expected:.3f}" for c in checks.values() if not c.ok]
    assert not missed


@pytest.mark.parametrize("config", ["trn2", "trn3"])
def test_elementwise_add_reaches_85_percent_of_what_a_core_reaches(checks, config):
    c = checks[f"{config} HBM GB/s per core (>= 85% of reachable)"]
    cfg = load_config(config)
    share = cfg.hbm_bandwidth_per_core / 1e9
    engines = 16 * {"trn2": 23, "trn3": 33}[config]  # sustained B/ns per engine (datasheet §6, S12)
    assert c.expected == min(share, engines)
    assert 0.85 * c.expected <= c.simulated <= 1.01 * c.expected  # all cores busy: nobody gets more


def test_memory_bound_ratio_follows_what_a_core_reaches(checks):
    c = checks["memory-bound time ratio trn2/trn3 vs reachable ratio"]
    # Trn3: 16 engines x 33 B/ns (DMA-bound, datasheet §6); Trn2: 2.9 TB/s / 8 (HBM-bound, §1)
    assert c.expected == pytest.approx(528 / 362.5)
    assert abs(c.simulated / c.expected - 1) <= 0.07
    b = checks["memory-bound time ratio trn2/trn3 vs config bound ratio"]
    assert abs(b.simulated / b.expected - 1) <= 0.025


def test_compute_bound_ratio_follows_tensor_peak(checks):
    c = checks["compute-bound time ratio trn2/trn3 vs peak-rate ratio"]
    assert c.expected == 1.0  # 2.4 GHz x 128x128 PEs on both (datasheet §1, §4.1)
    assert abs(c.simulated - 1.0) <= 0.02
    # and the memory-bound ratio is far from it: the two regimes are told apart
    assert checks["memory-bound time ratio trn2/trn3 vs reachable ratio"].simulated > 1.35


def test_check_logic_reports_misses():
    assert not Check("r", 1.2, 1.0, 0.1).ok
    assert Check("r", 1.09, 1.0, 0.1).ok
    assert not Check("f", 80.0, 100.0, 0.85, floor=True).ok
