"""The generic stream kernel's costs shared by geometry (issue 30): ``Device.cost`` simulates one
of the element counts whose columns per partition are the same and gives the others its cost.
The proof is that the builder reads nothing else of the counts: every shape of a geometry builds
the same stream (every instruction's fields, deps and DMA plan), and each cost taken from the
geometry cache equals, field by field, the one a fresh device simulates for that very shape."""

from __future__ import annotations

import random

import pytest

from trnsim import load_config
from trnsim.builder.replay import stream_fingerprint
from trnsim.device import Device, KernelSpec, OpCost
from trnsim.kernels.generic import build_stream, stream_geometry
from trnsim.kernels.registry import split_parts


def _spec(shape: tuple[int, int, int], **params: object) -> KernelSpec:
    p = {"binary": True, "engine": "gpsimd", "fn": "exp", **params}
    return KernelSpec.of("stream", shape, "fp32", p, label="generic:index_put", generic=True)


def _fields(c: OpCost) -> tuple[object, ...]:
    reps = tuple((r.total_ticks, r.busy_ticks, r.hbm_read_bytes, r.hbm_write_bytes, r.dma.bytes, r.matmul_flops,
                  r.engine_flops) for r in c.reports)
    return (c.kernel, c.generic, c.ticks, c.busy, c.cores, c.hbm_bytes, c.matmul_flops, c.demand, c.engine_flops,
            c.hbm_read_bytes, c.hbm_write_bytes, c.dma_bytes, reps)


def test_same_geometry_builds_the_same_stream():
    cfg = load_config("trn2")
    p = cfg.core.sbuf.partitions
    for a, b in (((174, 64, 64), (144, 64, 64)), ((1408, 2048, 2048), (1400, 1921, 2048)), ((0, 129, 1), (0, 256, 3))):
        assert stream_geometry(a, p) == stream_geometry(b, p)
        ka, kb = build_stream(*a, "fp32", cfg), build_stream(*b, "fp32", cfg)
        assert stream_fingerprint(ka) == stream_fingerprint(kb)
    # a different column count is a different stream, and "none" is not one column
    assert stream_geometry((128, 1, 1), p) != stream_geometry((129, 1, 1), p)
    assert stream_geometry((0, 1, 1), p) != stream_geometry((1, 1, 1), p)


@pytest.mark.parametrize("chip", ["trn2", "trn1"])
def test_costs_shared_by_geometry_equal_fresh_simulations(chip: str):
    cfg = load_config(chip)
    shared = Device(cfg)
    rng = random.Random(7)
    shapes = [(rng.choice([0, rng.randint(1, 3000)]), rng.randint(1, 3000), rng.randint(0, 3000)) for _ in range(16)]
    shapes += [(n * 128 + d, 128, 128) for n in (1, 2) for d in (-1, 0, 1)]  # the column edges
    before = 0
    hits = 0
    for shape in shapes:
        spec = _spec(shape)
        cost = shared.cost(spec)
        hits += shared.simulated == before
        before = shared.simulated
        fresh = Device(cfg).cost(spec)
        assert _fields(cost) == _fields(fresh), shape
    assert hits > 0  # some shapes shared a geometry (and were not simulated)


def test_geometry_key_keeps_what_the_cost_depends_on():
    """Name, parameters, dtype and the cores' split are part of the key: a cost is never handed
    to a spec that differs in any of them."""
    dev = Device(load_config("trn2"))
    a = dev.cost(_spec((300, 300, 300)))
    sim = dev.simulated
    b = dev.cost(_spec((301, 300, 300)))  # same columns on each core: shared, as a new object
    assert dev.simulated == sim and b is not a and _fields(a) == _fields(b)
    for other in (_spec((300, 300, 300), engine="vector"), _spec((300, 300, 300), binary=False),
                  KernelSpec.of("stream", (300, 300, 300), "bf16", {"binary": True, "engine": "gpsimd", "fn": "exp"},
                                label="generic:index_put", generic=True),
                  KernelSpec.of("stream", (300, 300, 300), "fp32", {"binary": True, "engine": "gpsimd", "fn": "exp"},
                                label="generic:cat", generic=True)):
        before = dev.simulated
        dev.cost(other)
        assert dev.simulated > before, other
    # the split over the two physical cores is part of the key: 257 elements split 129 + 128
    # (two columns, then one) is not 256 split 128 + 128
    parts = [s for s, _ in split_parts("stream", (257, 257, 257), {}, 2)]
    assert parts == [(129, 129, 129), (128, 128, 128)]
    before = dev.simulated
    dev.cost(_spec((256, 256, 256)))
    dev.cost(_spec((257, 257, 257)))
    assert dev.simulated == before + 4
