"""The nki.isa instructions beyond the core set: tensor_tensor_scan, scalar_tensor_tensor,
tensor_copy_predicated and range_select (predicated ops), reciprocal, max8 and nc_find_index8
(the top-k of the NKI library's router), dropout, dma_transpose,
element-strided DMA and the MX matmul of NC-v4. Each: values against numpy, and its cost pinned
to the published "estimated instruction cost" (datasheet §7, S16) or DMA figure (§6).

trn2 ticks: 4.8 GHz, VectorE 5 ticks per cycle (0.96 GHz), TensorE 2 (2.4 GHz)."""

import ml_dtypes
import numpy as np
import pytest

from trnsim import Chip, KernelError
from trnsim.kernel import FP32_MIN

RNG = np.random.default_rng(7)


def vector_ticks(result):
    """(label, busy ticks) of each VectorE instruction."""
    return [(label, e - s) for lane, label, s, e, _ in result.report.timeline if lane == "Vector"]


def load(k, name, shape, dtype, queue=0):
    x = k.input(name, shape, dtype)
    t = k.sbuf(shape, dtype, name=f"{name}_sb")
    k.dma_copy(t, x, queue=queue)
    return t


def store(k, name, tile):
    y = k.output(name, tile.shape, tile.dtype)
    k.dma_copy(y, tile, engine="gpsimd")


# ---- tensor_tensor_scan ----------------------------------------------------------------------


def test_tensor_tensor_scan_values_and_cost():
    chip = Chip("trn2")
    k = chip.kernel("scan")
    a, b = load(k, "a", (128, 300), "fp32"), load(k, "b", (128, 300), "fp32", queue=1)
    init = load(k, "init", (128, 1), "fp32", queue=2)
    out1, out2 = k.sbuf((128, 300), "fp32"), k.sbuf((128, 300), "fp32")
    k.tensor_tensor_scan(out1, a, b, 0.5, "multiply", "add")                   # out = a*prev + b
    k.tensor_tensor_scan(out2, a, b, init, "subtract", "maximum", reverse0=True)  # out = max(prev - a, b)
    store(k, "o1", out1)
    store(k, "o2", out2)
    xa, xb = RNG.random((128, 300), dtype=np.float32), RNG.random((128, 300), dtype=np.float32)
    xi = RNG.standard_normal((128, 1), dtype=np.float32)
    r = chip.run(k, {"a": xa, "b": xb, "init": xi})
    want1, want2 = np.empty_like(xa), np.empty_like(xa)
    p1, p2 = np.full(128, 0.5, np.float32), xi[:, 0]
    for i in range(300):
        p1 = want1[:, i] = (xa[:, i] * p1).astype(np.float32) + xb[:, i]
        p2 = want2[:, i] = np.maximum((p2 - xa[:, i]).astype(np.float32), xb[:, i])
    assert np.array_equal(r["o1"], want1) and np.array_equal(r["o2"], want2)
    # max(MIN_II, 2N) VectorE cycles
    assert vector_ticks(r) == [("TensorTensorScan[multiply,add]", 600 * 5), ("TensorTensorScan[subtract,maximum]", 600 * 5)]


def test_tensor_tensor_scan_rejects_two_psum_inputs():
    k = Chip("trn2").kernel("bad")
    p, q, d = k.psum((128, 64), "fp32"), k.psum((128, 64), "fp32"), k.sbuf((128, 64), "fp32")
    with pytest.raises(KernelError, match=r"^tensor_tensor_scan: data0 and data1 cannot both be in PSUM$"):
        k.tensor_tensor_scan(d, p, q, 0.0, "multiply", "add")
    with pytest.raises(KernelError, match=r"^tensor_tensor_scan: 'greater' is not an arithmetic op$"):
        k.tensor_tensor_scan(d, d, d, 0.0, "greater", "add")


# ---- scalar_tensor_tensor --------------------------------------------------------------------


def test_scalar_tensor_tensor_values_and_cost():
    chip = Chip("trn2")
    k = chip.kernel("stt")
    x, y = load(k, "x", (128, 512), "bf16"), load(k, "y", (128, 512), "bf16", queue=1)
    col = load(k, "col", (128, 1), "fp32", queue=2)
    o1, o2 = k.sbuf((128, 512), "bf16"), k.sbuf((128, 512), "fp32")
    k.scalar_tensor_tensor(o1, x, "subtract", col, "multiply", y)       # bf16, subtract then multiply: N
    k.scalar_tensor_tensor(o2, x, "add", 2.0, "divide", y, reverse1=True)  # otherwise 2N
    store(k, "o1", o1)
    store(k, "o2", o2)
    xs, ys = RNG.standard_normal((128, 512), dtype=np.float32), RNG.random((128, 512), dtype=np.float32) + 0.5
    cs = RNG.standard_normal((128, 1), dtype=np.float32)
    r = chip.run(k, {"x": xs, "y": ys, "col": cs})
    xb = xs.astype(ml_dtypes.bfloat16).astype(np.float32)
    yb = ys.astype(ml_dtypes.bfloat16).astype(np.float32)
    want1 = ((xb - cs).astype(np.float32) * yb).astype(ml_dtypes.bfloat16)
    with np.errstate(divide="ignore"):
        want2 = (yb / (xb + np.float32(2.0)).astype(np.float32)).astype(np.float32)
    assert np.array_equal(r["o1"].view(np.uint16), want1.view(np.uint16))
    assert np.array_equal(r["o2"], want2)
    assert vector_ticks(r) == [("ScalarTensorTensor[subtract,multiply]", 512 * 5),
                               ("ScalarTensorTensor[add,divide]", 1024 * 5)]


# ---- predicated ops: tensor_copy_predicated, range_select ---------------------------------------


def test_tensor_copy_predicated_values_and_cost():
    chip = Chip("trn2")
    k = chip.kernel("select")
    src, dst = load(k, "src", (128, 256), "fp32"), load(k, "dst", (128, 256), "fp32", queue=1)
    pred = load(k, "pred", (128, 256), "uint8", queue=2)
    ps = k.psum((128, 256), "fp32")
    k.tensor_copy(ps, src)
    k.tensor_copy_predicated(dst, src, pred)                       # both in SBUF: 2N
    k.tensor_copy_predicated(dst, ps, pred, reverse_pred=True)     # src in PSUM: N
    k.tensor_copy_predicated(dst[:, :64], -1.0, pred[:, :64])      # an immediate: N (floor MIN_II)
    store(k, "out", dst)
    xs, xd = RNG.standard_normal((128, 256), dtype=np.float32), RNG.standard_normal((128, 256), dtype=np.float32)
    xp = (RNG.random((128, 256)) < 0.3).astype(np.uint8)
    r = chip.run(k, {"src": xs, "dst": xd, "pred": xp})
    want = np.where(xp != 0, xs, xd)
    want = np.where(xp == 0, xs, want)
    want[:, :64] = np.where(xp[:, :64] != 0, np.float32(-1.0), want[:, :64])
    assert np.array_equal(r["out"], want)
    costs = [t for label, t in vector_ticks(r) if label == "CopyPredicated"]
    assert costs == [512 * 5, 256 * 5, 64 * 5]


def test_tensor_copy_predicated_checks():
    k = Chip("trn2").kernel("bad")
    a, b = k.sbuf((128, 64), "fp32"), k.sbuf((128, 64), "bf16")
    with pytest.raises(KernelError, match=r"^tensor_copy_predicated: predicate 'sbuf2' is bf16; expected uint8, "
                                          r"uint16 or uint32$"):
        k.tensor_copy_predicated(a, a, b)
    p = k.sbuf((128, 64), "uint8")
    with pytest.raises(KernelError, match=r"^tensor_copy_predicated: src 'sbuf2' is bf16 but dst 'sbuf1' is fp32; "
                                          r"they must share a dtype$"):
        k.tensor_copy_predicated(a, b, p)


def test_range_select_values_and_cost():
    chip = Chip("trn2")
    k = chip.kernel("range")
    x = load(k, "x", (128, 512), "fp32")
    lo, hi = load(k, "lo", (128, 1), "fp32", queue=1), load(k, "hi", (128, 1), "fp32", queue=2)
    out, mx = k.sbuf((128, 512), "fp32"), k.sbuf((128, 1), "fp32")
    k.range_select(out, x, "greater_equal", "less", lo, hi, range_start=100, reduce_res=mx)
    store(k, "out", out)
    store(k, "mx", mx)
    xs = RNG.standard_normal((128, 512), dtype=np.float32)
    xlo = RNG.integers(0, 400, (128, 1)).astype(np.float32)
    xhi = xlo + RNG.integers(1, 300, (128, 1)).astype(np.float32)
    r = chip.run(k, {"x": xs, "lo": xlo, "hi": xhi})
    idx = 100 + np.arange(512, dtype=np.float32)[None, :]
    want = np.where((idx >= xlo) & (idx < xhi), xs, np.float32(FP32_MIN))
    assert np.array_equal(r["out"], want)
    assert np.array_equal(r["mx"], want.max(axis=1, keepdims=True))
    assert vector_ticks(r) == [("RangeSelect[greater_equal,less]", 512 * 5)]  # max(MIN_II, N)


def test_range_select_checks():
    k = Chip("trn2").kernel("bad")
    x, b = k.sbuf((128, 64), "fp32"), k.sbuf((128, 1), "fp32")
    with pytest.raises(KernelError, match=r"^range_select: on_false must be FP32_MIN \(-3.4028235e\+38\), the only "
                                          r"value the hardware takes, got 0.0$"):
        k.range_select(x, x, "less", "less", b, b, on_false=0.0)
    with pytest.raises(KernelError, match=r"^range_select: needs NeuronCore-v3 or newer, trn1 is NeuronCore-v2$"):
        k1 = Chip("trn1").kernel("old")
        y, c = k1.sbuf((128, 64), "fp32"), k1.sbuf((128, 1), "fp32")
        k1.range_select(y, y, "less", "less", c, c)


def test_reciprocal_on_vector_costs_eight_cycles_an_element():
    chip = Chip("trn2")
    k = chip.kernel("recip")
    x = load(k, "x", (128, 200), "fp32")
    y = k.sbuf((128, 200), "fp32")
    k.reciprocal(y, x)
    store(k, "y", y)
    xs = RNG.random((128, 200), dtype=np.float32) + 0.1
    r = chip.run(k, {"x": xs})
    assert np.array_equal(r["y"], (np.float32(1.0) / xs).astype(np.float32))
    assert vector_ticks(r) == [("Reciprocal", 1600 * 5)]  # max(MIN_II, 8N)


def test_dropout_values_rate_and_cost():
    chip = Chip("trn2")
    k = chip.kernel("drop")
    x = load(k, "x", (128, 300), "fp32")
    y = k.sbuf((128, 300), "fp32")
    k.dropout(y, x, 0.25, seed=3, offset=1000, row_stride=4096)
    store(k, "y", y)
    xs = RNG.random((128, 300), dtype=np.float32) + 0.5  # never zero: a zero out is a dropped element
    r = chip.run(k, {"x": xs})
    counters = 1000 + np.arange(128)[:, None] * 4096 + np.arange(300)[None, :]
    # the draw of every element, written out here (splitmix32's finaliser of seed and counter)
    x_ = (counters.astype(np.uint64) + np.uint64(3 * 0x9E3779B9)) & np.uint64(0xFFFFFFFF)
    for shift, mul in ((16, 0x7FEB352D), (15, 0x846CA68B)):
        x_ ^= x_ >> np.uint64(shift)
        x_ = (x_ * np.uint64(mul)) & np.uint64(0xFFFFFFFF)
    x_ ^= x_ >> np.uint64(16)
    keep = x_ >= np.uint64(1 << 30)
    assert np.array_equal(r["y"], np.where(keep, xs, 0.0).astype(np.float32))
    assert abs((r["y"] == 0).mean() - 0.25) < 0.01  # the drop rate over 38,400 draws
    assert vector_ticks(r) == [("Dropout", 300 * 5)]  # max(MIN_II, N)


def test_dropout_checks():
    k = Chip("trn2").kernel("drop")
    x, i = k.sbuf((4, 8), "fp32"), k.sbuf((4, 8), "int32")
    with pytest.raises(KernelError, match=r"^dropout: prob must be a probability in \[0, 1\], got 1.5$"):
        k.dropout(x, x, 1.5)
    with pytest.raises(KernelError, match=r"^dropout: data and dst must be float tiles"):
        k.dropout(i, i, 0.1)
    with pytest.raises(KernelError, match=r"^dropout: seed"):
        k.dropout(x, x, 0.1, seed=-1)


def test_max8_and_find_index8_values_and_cost():
    chip = Chip("trn2")
    k = chip.kernel("top8")
    x = load(k, "x", (128, 300), "fp32")
    v = k.sbuf((128, 8), "fp32")
    i = k.sbuf((128, 8), "uint32")
    k.max8(v, x)
    k.nc_find_index8(i, x, v)
    store(k, "v", v)
    store(k, "i", i)
    xs = RNG.standard_normal((128, 300)).astype(np.float32)
    r = chip.run(k, {"x": xs})
    assert np.array_equal(r["v"], -np.sort(-xs, axis=1)[:, :8])
    assert np.array_equal(r["i"].astype(np.int64), np.argsort(-xs, axis=1, kind="stable")[:, :8])
    assert vector_ticks(r) == [("Max8", 300 * 5), ("FindIndex8", 300 * 5)]  # max(MIN_II, N)


def test_max8_and_find_index8_checks():
    chip = Chip("trn2")
    k = chip.kernel("top8")
    x = k.sbuf((4, 7), "fp32")
    with pytest.raises(KernelError, match=r"^max8: data '.*' has 7 elements per partition; max8 needs at least 8$"):
        k.max8(k.sbuf((4, 8), "fp32"), x)
    y = k.sbuf((4, 20), "fp32")
    with pytest.raises(KernelError, match=r"^nc_find_index8: dst '.*' must be uint32 or int32, got fp32$"):
        k.nc_find_index8(k.sbuf((4, 8), "fp32"), y, k.sbuf((4, 8), "fp32"))


# ---- DMA: transpose and element-strided access -------------------------------------------------


def _dma_ticks(result, lane="qSyncIO0"):
    (seg,) = result.report.segments(lane)
    return seg[3] - seg[2]


def test_dma_transpose_values_and_rates():
    """Trn2 DMA transpose: HBM->SBUF at 90% of a copy's throughput, SBUF->SBUF at 50% (datasheet
    §6, S9): the transfer takes a copy of the same destination's time / 0.9 (or / 0.5)."""
    chip = Chip("trn2")
    dma = chip.config.core.dma
    k = chip.kernel("dmat")
    x = k.input("x", (512, 128), "bf16")
    t = k.sbuf((128, 512), "bf16")
    k.dma_transpose(t, x)
    u = k.sbuf((128, 128), "bf16")
    k.dma_transpose(u, t[:, :128], queue=1)
    store(k, "t", t)
    store(k, "u", u)
    xs = RNG.standard_normal((512, 128), dtype=np.float32)
    r = chip.run(k, {"x": xs})
    xb = xs.astype(ml_dtypes.bfloat16)
    assert np.array_equal(r["t"].view(np.uint16), xb.T.view(np.uint16))
    assert np.array_equal(r["u"].view(np.uint16), np.ascontiguousarray(xb.T[:, :128].T).view(np.uint16))
    tick_hz = chip.config.tick_hz

    def copy_ticks(rows, cols):  # one engine's share of a copy into [128, cols]: 8 rows, 8 descriptors
        return -(-8 * cols * 2 * tick_hz // dma.engine_bandwidth) + 8 * chip.config.ps_to_ticks(dma.descriptor_overhead)

    latency = chip.config.ps_to_ticks(dma.transfer_latency)
    assert _dma_ticks(r, "qSyncIO0") == -(-copy_ticks(128, 512) * 10 // 9) + latency
    assert _dma_ticks(r, "qSyncIO1") == -(-copy_ticks(128, 128) * 2 // 1) + latency
    assert r.report.instruction_counts["DmaTranspose"] == 2


def test_dma_transpose_checks():
    k = Chip("trn2").kernel("bad")
    x = k.input("x", (512, 128), "bf16")
    with pytest.raises(KernelError, match=r"^dma_transpose: dst 'sbuf2' has shape \(128, 256\); transposing \(512, 128\) "
                                          r"needs \(128, 512\)$"):
        k.dma_transpose(k.sbuf((128, 256), "bf16"), x)
    k1 = Chip("trn1").kernel("old")
    y = k1.input("y", (256, 128), "bf16")
    with pytest.raises(KernelError, match=r"^dma_transpose: trn1 has no DMA transpose \(core.dma.transpose_rate_hbm is 0; "
                                          r"it needs NeuronCore-v3\)$"):
        k1.dma_transpose(k1.sbuf((128, 256), "bf16"), y)


def test_element_strided_dma_pays_a_whole_hbm_transaction_per_element():
    """Reading every other bf16 element of a row: each 2-byte element is its own descriptor and
    moves a whole 64-byte HBM transaction (core.dma.hbm_access_bytes, an estimate); the engine
    spends 64 B / 23 B/ns + 10 ns per element, and the HBM stack 64 B."""
    chip = Chip("trn2")
    dma = chip.config.core.dma
    k = chip.kernel("strided")
    x = k.input("x", (128, 512), "bf16")
    t = k.sbuf((128, 256), "bf16")
    k.dma_copy(t, x[:, 0:512:2])
    c = k.sbuf((128, 256), "bf16")
    k.dma_copy(c, x[:, 0:256], queue=1)
    store(k, "t", t)
    xs = RNG.standard_normal((128, 512), dtype=np.float32)
    r = chip.run(k, {"x": xs})
    assert np.array_equal(r["t"].view(np.uint16), xs.astype(ml_dtypes.bfloat16)[:, ::2].view(np.uint16))
    tick_hz, desc = chip.config.tick_hz, chip.config.ps_to_ticks(dma.descriptor_overhead)
    latency = chip.config.ps_to_ticks(dma.transfer_latency)
    per_engine = 8 * 256  # 8 partitions x 256 elements, one descriptor each
    assert _dma_ticks(r, "qSyncIO0") == -(-per_engine * 64 * tick_hz // dma.engine_bandwidth) + per_engine * desc + latency
    assert _dma_ticks(r, "qSyncIO1") == -(-8 * 512 * tick_hz // dma.engine_bandwidth) + 8 * desc + latency
    plan = k.instructions[0].plan
    assert plan.hbm_read_bytes == 128 * 256 * 2 and plan.hbm_bus_bytes == 128 * 256 * 64


# ---- MX matmul (Trn3) ------------------------------------------------------------------------


def _pack_fp8(vals, fp8):
    """[P, F, 4] float -> [P, F] uint32 of fp8 bytes (value j at byte j)."""
    return np.ascontiguousarray(np.asarray(vals).astype(fp8)).view(np.uint8).reshape(vals.shape[:2] + (4,)).view(np.uint32)[..., 0]


def _dequant(vals, scales):
    """numpy MX: value (p, f, j) is K row j*P + p, scaled by 2**(s-127) of its 8-partition group."""
    p = vals.shape[0]
    rows = 32 * (np.arange(p) // 32) + (np.arange(p) % 32) // 8
    mult = np.exp2(scales[rows].astype(np.float64) - 127)
    deq = vals.astype(np.float64) * mult[:, :, None]
    return np.transpose(deq, (2, 0, 1)).reshape(4 * p, -1)


def test_mx_matmul_values_and_cost_on_trn3():
    chip = Chip("trn3", ["core.tensor.throttle_initial_util=1.0"])
    k = chip.kernel("mx")
    st = load(k, "st", (128, 128), "float8_e4m3fn_x4")
    mv = load(k, "mv", (128, 512), "float8_e5m2_x4", queue=1)
    sst = load(k, "sst", (128, 128), "uint8", queue=2)
    smv = load(k, "smv", (128, 512), "uint8", queue=3)
    acc = k.psum((128, 512), "fp32")
    for i in range(4):
        k.nc_matmul_mx(acc, st, mv, sst, smv, accumulate=i > 0)
    res = k.sbuf((128, 512), "fp32")
    k.tensor_copy(res, acc)
    store(k, "out", res)
    vs = RNG.choice([-2.0, -1.0, -0.5, 0.0, 0.25, 1.0, 1.5, 3.0], size=(128, 128, 4))
    vm = RNG.choice([-4.0, -1.0, 0.0, 0.5, 1.0, 2.0], size=(128, 512, 4))
    ss = RNG.integers(127, 129, (128, 128)).astype(np.uint8)  # scales 1 or 2: every sum stays exact in fp32
    sm = RNG.integers(126, 128, (128, 512)).astype(np.uint8)
    r = chip.run(k, {"st": _pack_fp8(vs, ml_dtypes.float8_e4m3fn), "mv": _pack_fp8(vm, ml_dtypes.float8_e5m2),
                     "sst": ss, "smv": sm})
    want = 4 * (_dequant(vs, ss).T @ _dequant(vm, sm))  # small integers x powers of 2: exact in fp32
    assert np.array_equal(r["out"], want.astype(np.float32))
    mms = [e - s for lane, label, s, e, _ in r.report.timeline if lane == "Tensor" and label == "MultiplyMoving"]
    assert mms == [512 * chip.config.ticks_per_cycle("Tensor")] * 4  # max(min(64, M), N) PE cycles, as bf16 with K = 128
    assert r.report.matmul_flops == 4 * 2 * 512 * 128 * 512  # K = 512 per instruction
    assert r.report.instruction_counts["MatMulMx"] == 4


def test_mx_matmul_fp4_values():
    chip = Chip("trn3")
    k = chip.kernel("mx4")
    st = load(k, "st", (32, 16), "float4_e2m1fn_x4")
    mv = load(k, "mv", (32, 64), "float4_e2m1fn_x4", queue=1)
    sst = load(k, "sst", (32, 16), "uint8", queue=2)
    smv = load(k, "smv", (32, 64), "uint8", queue=3)
    acc = k.psum((16, 64), "fp32")
    k.nc_matmul_mx(acc, st, mv, sst, smv)
    res = k.sbuf((16, 64), "fp32")
    k.tensor_copy(res, acc)
    store(k, "out", res)
    table = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
    ns, nm = RNG.integers(0, 16, (32, 16, 4)), RNG.integers(0, 16, (32, 64, 4))
    pack = lambda nib: (nib[..., 0] | nib[..., 1] << 4 | nib[..., 2] << 8 | nib[..., 3] << 12).astype(np.uint16)
    ss, sm = RNG.integers(124, 130, (32, 16)).astype(np.uint8), RNG.integers(124, 130, (32, 64)).astype(np.uint8)
    r = chip.run(k, {"st": pack(ns), "mv": pack(nm), "sst": ss, "smv": sm})
    want = _dequant(table[ns], ss).T @ _dequant(table[nm], sm)
    assert np.array_equal(r["out"], want.astype(np.float32))


def test_mx_matmul_needs_nc_v4():
    k = Chip("trn2").kernel("no-mx")
    a = k.sbuf((128, 128), "float8_e4m3fn_x4")
    s = k.sbuf((128, 128), "uint8")
    with pytest.raises(KernelError, match=r"^nc_matmul_mx: trn2 has no MX matmul \(core.tensor.mx_quad is false; "
                                          r"it needs NeuronCore-v4\)$"):
        k.nc_matmul_mx(k.psum((128, 128), "fp32"), a, a, s, s)
    k3 = Chip("trn3").kernel("bad-scale")
    a3, s3 = k3.sbuf((128, 128), "float8_e4m3fn_x4"), k3.sbuf((128, 64), "uint8")
    with pytest.raises(KernelError, match=r"^nc_matmul_mx: stationary_scale 'sbuf2' has shape \(128, 64\); expected at "
                                          r"least \[100, 128\] \(4 partitions of scales per 32-partition quadrant\)$"):
        k3.nc_matmul_mx(k3.psum((128, 128), "fp32"), a3, a3, s3, s3)


def test_max8_and_find_index8_from_nki():
    import trnsim.nki as nki
    import trnsim.nki.isa as nisa
    import trnsim.nki.language as nl

    @nki.jit
    def top8(x):
        out_v = nl.ndarray((x.shape[0], 8), dtype=nl.float32, buffer=nl.shared_hbm)
        out_i = nl.ndarray((x.shape[0], 8), dtype=nl.uint32, buffer=nl.shared_hbm)
        t = nl.load(x)
        v = nl.ndarray((x.shape[0], 8), dtype=nl.float32, buffer=nl.sbuf)
        nisa.max8(dst=v, src=t)
        i = nl.ndarray((x.shape[0], 8), dtype=nl.uint32, buffer=nl.sbuf)
        nisa.nc_find_index8(dst=i, data=t, vals=v)
        nl.store(out_v, v)
        nl.store(out_i, i)
        return out_v, out_i

    xs = RNG.standard_normal((64, 100)).astype(np.float32)
    v, i = top8(xs)
    assert np.array_equal(v, -np.sort(-xs, axis=1)[:, :8])
    assert np.array_equal(i.astype(np.int64), np.argsort(-xs, axis=1, kind="stable")[:, :8])
