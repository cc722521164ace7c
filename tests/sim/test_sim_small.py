"""simulate(timeline="auto") runs calls of at most SIMPY_MAX_INSTRUCTIONS instructions on the
simpy processes (their set-up is cheaper than the native loop's there) and larger ones on the
native loop; either way the run is the one the other timeline makes (test_sim_equivalence.py
compares the two on every library kernel)."""

from __future__ import annotations

import pytest

from trnsim import load_config
from trnsim.kernels import get_kernel
from trnsim.sim import SIMPY_MAX_INSTRUCTIONS, native_available, simulate

pytestmark = pytest.mark.skipif(not native_available(), reason="trnsim.native.accel._sched is not built")


def _run(tls):
    return [(tl.total_ticks, tl.ready, tl.end, tl.trigger, tl.owner, tl.segments) for tl in tls]


@pytest.mark.parametrize("shape,cores", [((128, 512), 1), ((128, 512), 2), ((4096, 4096), 1), ((8192, 4096), 1)])
def test_auto_picks_by_size_with_the_same_run(shape, cores):
    cfg = load_config("trn2")
    kern = get_kernel("binary").make(shape, "bf16", cfg)
    kernels = [kern] * cores
    small = len(kern.instructions) * cores <= SIMPY_MAX_INSTRUCTIONS
    auto = simulate(cfg, kernels)
    assert all((type(t).__name__ == "_NativeTimeline") == (not small) for t in auto)
    assert _run(auto) == _run(simulate(cfg, kernels, timeline="native")) == _run(simulate(cfg, kernels, timeline="simpy"))


def test_the_sizes_tested_fall_on_both_sides():
    cfg = load_config("trn2")
    e = get_kernel("binary")
    assert len(e.make((128, 512), "bf16", cfg).instructions) * 2 <= SIMPY_MAX_INSTRUCTIONS
    assert len(e.make((8192, 4096), "bf16", cfg).instructions) > SIMPY_MAX_INSTRUCTIONS
