"""The scheduling pass (trnsim.schedule): a plain loop reaches the overlap of a hand-pipelined
kernel, no instruction ever moves across a dependency (checked against an independent oracle
that replays every byte's last writer), SBUF/PSUM capacity holds, and the result is
deterministic and bit-identical in values."""

import numpy as np
import pytest

from trnsim import Chip, Kernel, KernelError
from trnsim.isa import HbmAP, TileAP
from trnsim.kernels import get_kernel
from trnsim.schedule import schedule


def plain_loop(chip, n=16, cols=2048):
    """One iteration after another, each tile allocated and freed inside the loop body."""
    k = chip.kernel("plain")
    x = k.input("x", (n * 128, cols), "bf16")
    y = k.output("y", (n * 128, cols), "bf16")
    for i in range(n):
        with k.scope():
            t = k.sbuf((128, cols), "bf16")
            u = k.sbuf((128, cols), "bf16")
            k.dma_copy(t, x[i * 128:(i + 1) * 128, :])
            k.activation(u, "exp", t)
            k.tensor_scalar(u, u, "multiply", 2.0)
            k.dma_copy(y[i * 128:(i + 1) * 128, :], u)
    return k


def hand_pipelined(chip, n=16, cols=2048, bufs=3):
    """The same work, triple-buffered, stores on their own queue: what an author tunes by hand."""
    k = chip.kernel("piped")
    x = k.input("x", (n * 128, cols), "bf16")
    y = k.output("y", (n * 128, cols), "bf16")
    pin, pout = k.tile_pool("in", bufs), k.tile_pool("out", bufs)
    for i in range(n):
        t, u = pin.tile((128, cols), "bf16"), pout.tile((128, cols), "bf16")
        k.dma_copy(t, x[i * 128:(i + 1) * 128, :])
        k.activation(u, "exp", t)
        k.tensor_scalar(u, u, "multiply", 2.0)
        k.dma_copy(y[i * 128:(i + 1) * 128, :], u, engine="gpsimd")
    return k


def test_a_plain_loop_reaches_the_overlap_of_a_hand_pipelined_kernel():
    chip = Chip("trn2")
    plain, piped = plain_loop(chip), hand_pipelined(chip)
    t_plain = chip.run(plain, timing_only=True).report.total_ticks
    t_piped = chip.run(piped, timing_only=True).report.total_ticks
    scheduled = schedule(plain)
    rep = chip.run(scheduled, timing_only=True).report
    assert t_plain > 2.0 * t_piped                  # in order, nothing overlaps
    assert rep.total_ticks <= 1.02 * t_piped        # scheduled, it overlaps as the hand-tuned one does
    assert rep.total_ticks == scheduled.schedule_stats.ticks
    assert scheduled.schedule_stats.estimated_ticks == rep.total_ticks  # the pass's own estimate is exact here
    assert scheduled.schedule_stats.as_built_ticks == t_plain
    # loads overlap compute: the ScalarE is busy while DMA queues move the next tiles
    busy = {name: e.active_percent for name, e in rep.engines.items()}
    assert busy["Scalar"] > 1.8 * chip.run(plain, timing_only=True).report.engines["Scalar"].active_percent
    assert rep.sbuf_peak_bytes <= chip.config.core.sbuf.partition_bytes


def test_a_hand_tuned_kernel_is_kept_as_built():
    chip = Chip("trn2")
    k = get_kernel("matmul").make((512, 1024, 1024), "bf16", chip.config)
    s = schedule(k)
    assert s.schedule_stats.policy == "as built"
    assert chip.run(s, timing_only=True).report.total_ticks == chip.run(k, timing_only=True).report.total_ticks
    assert [i.describe() for i in s.instructions] == [i.describe() for i in k.instructions]


# ---- the oracle: every instruction reads what it read in program order ------------------------


def _footprint(ap, config):
    """(space key, flat indices) of the memory an access pattern touches: bytes of SBUF/PSUM
    (partition-major), elements of an HBM tensor."""
    grids = np.ix_(*[np.arange(n) * s for s, n in ap.dims])
    elems = ap.offset + sum(grids) if grids else np.array([ap.offset])
    elems = np.asarray(elems).reshape(-1)
    if isinstance(ap, HbmAP):
        return ("hbm", ap.tensor.uid), elems
    pb = (config.core.sbuf if ap.space == "sbuf" else config.core.psum).partition_bytes
    isz = ap.dtype.itemsize
    byte = ap.alloc.addr + elems[None, :] * isz + np.arange(isz)[:, None]
    parts = np.arange(ap.p_start, ap.p_start + ap.p_count)
    return (ap.space,), (parts[:, None] * pb + byte.reshape(-1)[None, :]).reshape(-1)


def writers_read(kernel, origin=None):
    """For each instruction (by original index): the set of original instructions whose writes it
    reads; and, for each HBM output, the last writer of every element."""
    cfg = kernel.config
    last = {("sbuf",): np.full(cfg.core.sbuf.partitions * cfg.core.sbuf.partition_bytes, -1, np.int64),
            ("psum",): np.full(cfg.core.psum.partitions * cfg.core.psum.partition_bytes, -1, np.int64)}
    for t in kernel.tensors.values():
        last[("hbm", t.uid)] = np.full(t.size, -1, np.int64)
    seen = {}
    for pos, ins in enumerate(kernel.instructions):
        me = pos if origin is None else origin[pos]
        got = set()
        for ap in ins.reads:
            key, idx = _footprint(ap, cfg)
            got |= set(np.unique(last[key][idx]).tolist())
        seen[me] = frozenset(got)
        for ap in ins.writes:
            key, idx = _footprint(ap, cfg)
            last[key][idx] = me
    final = {name: last[("hbm", t.uid)].copy() for name, t in kernel.tensors.items() if t.kind == "output"}
    return seen, final


def random_kernel(seed, config="trn2"):
    """A kernel of random fp32 work over few tiles, reused often: pools, partial and in-place
    writes, PSUM accumulation, HBM scratch written and read back."""
    rng = np.random.default_rng(seed)
    k = Kernel(f"random{seed}", config)
    x = k.input("x", (128, 1024), "fp32")
    w = k.input("w", (128, 128), "fp32")
    out = k.output("out", (128, 1024), "fp32")
    scratch = k.scratch("scratch", (128, 512), "fp32")
    tiles = [k.sbuf((128, 256), "fp32") for _ in range(3)]
    pool = k.tile_pool("p", bufs=int(rng.integers(1, 3)))
    ps = k.psum((128, 256), "fp32")
    wt = k.sbuf((128, 128), "fp32")
    k.dma_copy(wt, w)
    for t in tiles:
        k.memset(t, 0.5)
    k.memset(ps, 0.0)
    for _ in range(int(rng.integers(25, 45))):
        op = int(rng.integers(0, 10))
        a, b = (tiles[int(i)] for i in rng.integers(0, len(tiles), 2))
        c0 = int(rng.integers(0, 4)) * 256
        if op == 0:
            k.dma_copy(a, x[:, c0:c0 + 256], queue=int(rng.integers(0, 2)))
        elif op == 1:
            k.tensor_tensor(a, a, b, "add")
        elif op == 2:
            k.tensor_scalar(a[:, :128], b[:, 128:], "multiply", 0.75, engine="gpsimd")
        elif op == 3:
            k.activation(a, "exp", b, scale=0.01)
        elif op == 4:
            k.nc_matmul(ps, wt, a, accumulate=bool(rng.integers(0, 2)))
        elif op == 5:
            k.tensor_copy(a, ps, engine="scalar")
        elif op == 6:
            k.dma_copy(out[:, c0:c0 + 256], a, engine="gpsimd")
        elif op == 7:
            k.dma_copy(scratch[:, :256], a)
            k.dma_copy(b, scratch[:, :256], queue=1)
        elif op == 8:
            t = pool.tile((128, 256), "fp32")
            k.tensor_copy(t, a)
            k.tensor_tensor(b, t, b, "subtract")
        else:
            with k.scope():
                t = k.sbuf((128, 256), "fp32")
                k.dma_copy(t, x[:, c0:c0 + 256])
                k.tensor_tensor(a, a, t, "maximum")
    k.dma_copy(out[:, :256], tiles[0])
    return k


@pytest.mark.parametrize("seed", range(12))
def test_never_reorders_across_a_dependency(seed):
    chip = Chip("trn2")
    k = random_kernel(seed)
    s = schedule(k)
    before, final_before = writers_read(k)
    after, final_after = writers_read(s, s.schedule_origin)
    assert sorted(s.schedule_origin) == list(range(len(k)))  # a permutation of the same instructions
    assert after == before            # every instruction reads exactly the writes it read in program order
    for name in final_before:         # and every output element ends with the same last writer
        assert np.array_equal(final_before[name], final_after[name])
    rng = np.random.default_rng(seed)
    inputs = {"x": rng.standard_normal((128, 1024), dtype=np.float32), "w": rng.standard_normal((128, 128), dtype=np.float32)}
    assert np.array_equal(chip.run(k, inputs)["out"].view(np.uint32), chip.run(s, inputs)["out"].view(np.uint32))


def test_the_oracle_catches_a_reordered_dependency():
    """Swapping a load and its consumer is what the property above must reject."""
    chip = Chip("trn2")
    k = chip.kernel("swap")
    x = k.input("x", (128, 64), "fp32")
    out = k.output("out", (128, 64), "fp32")
    t = k.sbuf((128, 64), "fp32")
    k.dma_copy(t, x)
    k.tensor_scalar(t, t, "add", 1.0)
    k.dma_copy(out, t)
    before, _ = writers_read(k)
    bad = Kernel("swapped", chip.config)
    bad.tensors = dict(k.tensors)
    bad.instructions = [k.instructions[1], k.instructions[0], k.instructions[2]]
    after, _ = writers_read(bad, [1, 0, 2])
    assert after != before


def test_capacity_is_respected_when_memory_is_tight():
    """On an SBUF of 24 KiB per partition the plain loop's 8 KiB tiles fit three at a time: the
    schedule overlaps what fits and never holds more."""
    chip = Chip("trn2", ["core.sbuf.partition_bytes=24KiB"])
    k = plain_loop(chip, n=8, cols=2048)  # two 4 KiB tiles per iteration
    s = schedule(k)
    rep = chip.run(s, timing_only=True).report
    assert rep.sbuf_peak_bytes <= 24 * 1024
    assert rep.total_ticks < chip.run(k, timing_only=True).report.total_ticks
    roomy = schedule(plain_loop(Chip("trn2"), n=8, cols=2048))
    assert roomy.sbuf_peak_bytes > 24 * 1024  # with room, it runs further ahead
    before, _ = writers_read(k)
    after, _ = writers_read(s, s.schedule_origin)
    assert after == before


def test_psum_banks_bound_how_many_accumulation_groups_run_ahead():
    chip = Chip("trn2")
    k = chip.kernel("groups")
    a = k.input("a", (128, 128), "bf16")
    b = k.input("b", (128, 512), "bf16")
    out = k.output("out", (16 * 128, 512), "fp32")
    st, mv = k.sbuf((128, 128), "bf16"), k.sbuf((128, 512), "bf16")
    k.dma_copy(st, a)
    k.dma_copy(mv, b, queue=1)
    for g in range(16):
        with k.scope():
            acc = k.psum((128, 512), "fp32")
            for j in range(4):
                k.nc_matmul(acc, st, mv, accumulate=j > 0)
            res = k.sbuf((128, 512), "fp32")
            k.tensor_copy(res, acc)
            k.dma_copy(out[g * 128:(g + 1) * 128, :], res)
    s = schedule(k)
    assert s.psum_peak_bytes <= chip.config.core.psum.partition_bytes
    assert chip.run(s, timing_only=True).report.total_ticks <= chip.run(k, timing_only=True).report.total_ticks
    before, final_before = writers_read(k)
    after, final_after = writers_read(s, s.schedule_origin)
    assert after == before and np.array_equal(final_before["out"], final_after["out"])


def test_extra_dependencies_are_kept():
    """``extra_deps`` (NKI's depends_on / no_reorder) orders instructions the data does not."""
    chip = Chip("trn2")
    k = plain_loop(chip, n=4, cols=512)
    free = schedule(k)
    assert free.schedule_origin.index(4) < free.schedule_origin.index(3)  # the 2nd load moves ahead of the 1st store
    pinned = schedule(k, extra_deps={4: [3]})
    assert pinned.schedule_origin.index(3) < pinned.schedule_origin.index(4)
    with pytest.raises(KernelError, match=r"^schedule: instruction #2 cannot depend on #5 \(only on earlier ones\)$"):
        schedule(k, extra_deps={2: [5]})


def test_schedule_is_deterministic():
    chip = Chip("trn2")
    k = get_kernel("attention").make((2, 4, 128, 64), "bf16", chip.config, {"causal": True, "schedule": False})
    a, b = schedule(k), schedule(k)
    assert a.schedule_origin == b.schedule_origin
    assert chip.run(a, timing_only=True).report.total_ticks == chip.run(b, timing_only=True).report.total_ticks
    assert a.schedule_stats.policy != "as built"  # many short heads: the list schedule wins clearly
    assert a.schedule_stats.ticks < 0.6 * a.schedule_stats.as_built_ticks


def test_schedule_rejects_what_is_not_a_kernel():
    with pytest.raises(KernelError, match=r"^schedule expects a trnsim.Kernel, got int$"):
        schedule(3)
    with pytest.raises(KernelError, match=r"^schedule: speculative_share must be in \(0, 1\], got 0$"):
        schedule(Kernel("k"), speculative_share=0)
