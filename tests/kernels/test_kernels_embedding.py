"""Indirect DMA (dma_gather / dma_scatter) and the embedding kernel built on it."""

from __future__ import annotations

import numpy as np
import pytest

from trnsim import Chip, Kernel, KernelError, load_config
from trnsim.kernels.embedding import build_embedding
from trnsim.kernels import get_kernel
from trnsim.kernels.check import check_entry
from trnsim.kernels.reference import round_to
from trnsim.native.dtypes import get_dtype


def _embed(tokens, vocab, dim, dtype="bf16", config="trn2", ids=None, seed=0, **kw):
    """Run the embedding kernel with values; return (ids, rounded table, RunResult)."""
    rng = np.random.default_rng(seed)
    if ids is None:
        ids = rng.integers(0, vocab, size=tokens, dtype=np.int32)
    table = rng.standard_normal((vocab, dim), dtype=np.float32)
    chip = Chip(config)
    k = build_embedding(tokens, vocab, dim, dtype=dtype, config=chip.config, **kw)
    return ids, round_to(table, dtype), chip.run(k, {"ids": ids, "table": table})


# ---- the embedding kernel: values --------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("config", ["trn2", "trn3"])
def test_embedding_matches_numpy_bit_for_bit(dtype, config):
    ids, table, r = _embed(200, 300, 48, dtype, config)
    assert r["out"].dtype == get_dtype(dtype).np_dtype
    assert np.array_equal(r["out"].astype(np.float64), table[ids])


@pytest.mark.parametrize("tokens,vocab,dim", [(1, 1, 1), (127, 5, 3), (129, 1000, 65), (300, 64, 16)])
def test_embedding_ragged_sizes(tokens, vocab, dim):
    ids, table, r = _embed(tokens, vocab, dim)
    assert r["out"].shape == (tokens, dim)
    assert np.array_equal(r["out"].astype(np.float64), table[ids])


def test_embedding_repeated_ids():
    ids = np.array([3, 3, 3, 0, 7, 3, 0] * 40, dtype=np.int32)  # 280 tokens over 3 tiles
    _, table, r = _embed(len(ids), 8, 32, ids=ids)
    assert np.array_equal(r["out"].astype(np.float64), table[ids])


def test_embedding_splits_wide_rows_into_column_blocks():
    cfg = load_config("trn2", {"core.sbuf.partition_bytes": "16KiB"})
    ids, table, r = _embed(130, 20, 3000, "fp32", cfg)  # 12 KB rows > the 4 KiB row buffers
    k = build_embedding(130, 20, 3000, dtype="fp32", config=cfg)
    assert sum(ins.opcode == "DmaGather" for ins in k.instructions) == 2 * 3  # 2 token tiles x 3 blocks
    assert np.array_equal(r["out"].astype(np.float64), table[ids])


def test_embedding_registry_entry_checks_exactly():
    entry = get_kernel("embedding")
    assert entry.dims == ("TOKENS", "VOCAB", "DIM") and entry.dtypes == ("bf16", "fp16", "fp32")
    res = check_entry(entry, (150, 40, 24), "fp16", "trn3")
    assert res["ok"] and res["errors"] == {"out": 0.0}


def test_embedding_rejects_bad_dtype():
    with pytest.raises(KernelError, match=r"^embedding: dtype fp8_e4m3 not supported; expected one of bf16, fp16, fp32$"):
        build_embedding(128, 10, 8, dtype="fp8_e4m3")


def test_embedding_out_of_range_id_is_a_clear_error():
    ids = np.zeros(200, dtype=np.int32)
    ids[150] = 10
    with pytest.raises(KernelError, match=r"^DmaGather #\d+: index 10 on partition 22 of 'ids\[1\]' is outside rows "
                                          r"0\.\.9 of 'table' \(oob_mode='error'; 'skip' leaves such partitions "
                                          r"alone\)$"):
        _embed(200, 10, 8, ids=ids)
    ids[150] = -1
    with pytest.raises(KernelError, match=r"index -1 on partition 22"):
        _embed(200, 10, 8, ids=ids)


# ---- the embedding kernel: timing --------------------------------------------------------------


def _ticks(tokens, vocab=32000, dim=1024, **kw):
    chip = Chip("trn2")
    return chip.run(build_embedding(tokens, vocab, dim, config=chip.config, **kw), timing_only=True).report.total_ticks


def test_embedding_time_grows_with_tokens():
    t = [_ticks(n) for n in (128, 512, 2048)]
    assert t[0] < t[1] < t[2]
    # once the first tile's latency is paid the kernel streams: 4x the extra tokens, >= ~4x the extra time
    assert t[2] - t[1] > 3.6 * (t[1] - t[0])


def test_embedding_streams_near_dma_peak():
    """4 KiB rows are past the >= 2 KiB-per-partition point where DMA runs near peak (datasheet §6):
    gathers plus stores keep the core's 16 engines (23 GB/s each, sustained) mostly busy."""
    chip = Chip("trn2")
    rep = chip.run(build_embedding(2048, 32000, 2048, config=chip.config), timing_only=True).report
    peak = chip.config.core.dma.engines * float(chip.config.core.dma.engine_bandwidth)
    assert 0.7 < rep.dma.achieved_bytes_per_s / peak < 1.0


def test_embedding_double_buffering_overlaps_tiles():
    assert _ticks(1024, bufs=2) < 0.75 * _ticks(1024, bufs=1)


def test_embedding_is_deterministic_and_timing_ignores_index_values():
    ids, _, a = _embed(300, 50, 40, seed=1)
    _, _, b = _embed(300, 50, 40, seed=1)
    _, _, c = _embed(300, 50, 40, ids=np.zeros(300, dtype=np.int32), seed=1)
    assert np.array_equal(a["out"].view(np.uint16), b["out"].view(np.uint16))
    assert a.report.total_ticks == b.report.total_ticks == c.report.total_ticks == _ticks(300, 50, 40)


# ---- dma_gather / dma_scatter in the builder ---------------------------------------------------


def _gather_kernel(rows, dim, vocab=64, dtype="bf16", oob_mode="error"):
    k = Kernel("g", "trn2")
    ids = k.input("ids", (rows, 1), "int32")
    table = k.input("table", (vocab, dim), dtype)
    out = k.output("out", (rows, dim), dtype)
    it = k.sbuf((rows, 1), "int32", name="it")
    t = k.sbuf((rows, dim), dtype, name="t")
    k.memset(t, 7.0)
    k.dma_copy(it, ids)
    g = k.dma_gather(t, table, it, oob_mode=oob_mode)
    k.dma_copy(out, t, queue=1)
    return k, g


def test_gather_waits_for_its_index_tile():
    k, g = _gather_kernel(4, 4096)
    assert g.engine == "GpSimd" and g.queue == "qGpSimdIO0"
    assert 1 in g.deps  # RAW on the index tile loaded by instruction #1
    r = Chip("trn2").run(k, timing_only=True)
    (load,) = r.report.segments("qSyncIO0")
    (gather,) = r.report.segments("qGpSimdIO0")
    assert gather[2] >= load[3]


def test_gather_costs_one_descriptor_per_row():
    """4 rows of 8 KiB on one DMA engine is datasheet V3's transfer (32 KiB, 1416 ns); the same
    32 KiB as 8 rows of 4 KiB pays exactly 4 more descriptor overheads."""
    chip = Chip("trn2")

    def gather_ns(rows, dim):
        k, _ = _gather_kernel(rows, dim)
        r = chip.run(k, timing_only=True)
        (seg,) = r.report.segments("qGpSimdIO0")
        return (seg[3] - seg[2]) / r.report.tick_hz * 1e9

    four = gather_ns(4, 4096)
    assert four == pytest.approx(1416, rel=0.10)
    overhead_ns = chip.config.core.dma.descriptor_overhead / 1000  # ps -> ns
    assert gather_ns(8, 2048) - four == pytest.approx(4 * overhead_ns, abs=0.01)


def test_gather_skip_leaves_out_of_range_partitions_alone():
    k, _ = _gather_kernel(4, 8, vocab=10, oob_mode="skip")
    table = np.arange(80, dtype=np.float32).reshape(10, 8)
    out = Chip("trn2").run(k, {"ids": np.array([[2], [10], [-5], [9]]), "table": table})["out"]
    assert np.array_equal(out.astype(np.float32), np.stack([table[2], np.full(8, 7.0), np.full(8, 7.0), table[9]]))


def test_gather_from_a_column_block_and_casting():
    k = Kernel("g", "trn2")
    ids = k.input("ids", (3, 1), "int32")
    table = k.input("table", (5, 10), "fp32")
    out = k.output("out", (3, 4), "bf16")
    it, t = k.sbuf((3, 1), "int32"), k.sbuf((3, 4), "bf16")
    k.dma_copy(it, ids)
    k.dma_gather(t, table[:, 2:6], it)
    k.dma_copy(out, t)
    x = np.random.default_rng(0).standard_normal((5, 10), dtype=np.float32)
    got = Chip("trn2").run(k, {"ids": np.array([[4], [0], [4]]), "table": x})["out"]
    assert np.array_equal(got.astype(np.float64), round_to(x[[4, 0, 4], 2:6], "bf16"))


def _scatter_kernel():
    k = Kernel("s", "trn2")
    ids = k.input("ids", (4, 1), "int32")
    src = k.input("src", (4, 8), "fp32")
    dst = k.output("dst", (10, 8), "fp32")
    it, t = k.sbuf((4, 1), "int32"), k.sbuf((4, 8), "fp32")
    k.dma_copy(it, ids)
    k.dma_copy(t, src, queue=1)
    k.dma_scatter(dst, t, it)
    return k


def test_scatter_writes_rows_and_rejects_duplicates():
    x = np.arange(32, dtype=np.float32).reshape(4, 8)
    got = Chip("trn2").run(_scatter_kernel(), {"ids": np.array([[9], [0], [5], [2]]), "src": x})["dst"]
    assert np.array_equal(got[[9, 0, 5, 2]], x)
    with pytest.raises(KernelError, match=r"^DmaScatter #2: row 5 of 'dst' is named by partitions 1 and 3 of "
                                          r"'sbuf\d+'; scatter indices must be unique"):
        Chip("trn2").run(_scatter_kernel(), {"ids": np.array([[9], [5], [0], [5]]), "src": x})


@pytest.mark.parametrize("call,message", [
    (lambda k, t, tab, it: k.dma_gather(t, tab, it, engine="sync"),
     r"^dma_gather: engine 'sync' cannot generate indirect descriptors; only gpsimd \(software DGE\) can "
     r"\(datasheet §6\)$"),
    (lambda k, t, tab, it: k.dma_gather(t, tab, k.sbuf((128, 1), "fp32")),
     r"^dma_gather: indices must be an int32 SBUF tile, got sbuf:\w+\[0:128\]@0\[\(1, 1\)\]$"),
    (lambda k, t, tab, it: k.dma_gather(t, tab, it[:64]),
     r"^dma_gather: indices 'it' must be \[128, 1\] \(one row index per partition of 't'\), got \(64, 1\)$"),
    (lambda k, t, tab, it: k.dma_gather(t[:, :16], tab, it),
     r"^dma_gather: dst 't' has 16 elements per partition but src rows of 'table' have 32$"),
    (lambda k, t, tab, it: k.dma_gather(t, tab.reshape(2, 32, 32), it),
     r"^dma_gather: src 'table' must be a 2-D \[rows, D\] view, got shape \(2, 32, 32\)$"),
    (lambda k, t, tab, it: k.dma_gather(t, tab, it, oob_mode="clamp"),
     r"^dma_gather: oob_mode must be 'error' or 'skip', got 'clamp'$"),
    (lambda k, t, tab, it: k.dma_scatter(tab, k.psum((128, 32), "fp32"), it),
     r"^dma_scatter: src must be an SBUF tile, got psum:"),
])
def test_indirect_dma_bad_operands(call, message):
    k = Kernel("bad", "trn2")
    tab = k.input("table", (64, 32), "fp32")
    it, t = k.sbuf((128, 1), "int32", name="it"), k.sbuf((128, 32), "fp32", name="t")
    with pytest.raises(KernelError, match=message):
        call(k, t, tab, it)
