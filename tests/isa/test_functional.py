"""The functional model: every instruction's numbers against numpy, and determinism."""

import ml_dtypes
import numpy as np
import pytest

from trnsim import Chip, KernelError
from trnsim.kernels.matmul import build_matmul
from trnsim.native import reference

BF16 = ml_dtypes.bfloat16
rng = np.random.default_rng(1234)


def bf16(x):
    return np.asarray(x, np.float32).astype(BF16)


def bits(x):
    x = np.asarray(x)
    return x.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[x.itemsize])


def run_elementwise(build, inputs, shape=(128, 64), dtype="fp32", out_dtype=None):
    """Load inputs into SBUF tiles, let ``build`` emit compute into ``out``, store ``out``."""
    chip = Chip("trn2")
    k = chip.kernel("ew")
    tiles = []
    for name, arr in inputs.items():
        x = k.input(name, arr.shape, dtype)
        t = k.sbuf(arr.shape, dtype, name=name + "_t")
        k.dma_copy(t, x)
        tiles.append(t)
    o = k.output("o", shape, out_dtype or dtype)
    ot = k.sbuf(shape, out_dtype or dtype, name="o_t")
    build(k, ot, *tiles)
    k.dma_copy(o, ot)
    return chip.run(k, inputs)["o"]


def test_dma_cast_rounds_to_nearest_even():
    a = rng.standard_normal((128, 64)).astype(np.float32)
    out = run_elementwise(lambda k, o, x: k.tensor_copy(o, x), {"a": a}, out_dtype="bf16")
    assert np.array_equal(bits(out), bits(a.astype(BF16)))
    chip = Chip("trn2")
    k = chip.kernel("cast")
    x = k.input("x", (128, 64), "fp32")
    y = k.output("y", (128, 64), "bf16")
    t = k.sbuf((128, 64), "bf16")
    k.dma_copy(t, x)                    # DMA casts through fp32
    k.dma_copy(y, t)
    assert np.array_equal(bits(chip.run(k, {"x": a})["y"]), bits(a.astype(BF16)))


@pytest.mark.parametrize("op,fn", [("add", np.add), ("subtract", np.subtract), ("multiply", np.multiply),
                                   ("maximum", np.maximum), ("divide", np.divide)])
def test_tensor_tensor_bf16(op, fn):
    a = rng.standard_normal((128, 64)).astype(np.float32)
    b = rng.standard_normal((128, 64)).astype(np.float32) + 3
    out = run_elementwise(lambda k, o, x, y: k.tensor_tensor(o, x, y, op), {"a": a, "b": b}, dtype="bf16")
    # fp32 inside, one rounding to bf16 at the output
    want = fn(bf16(a).astype(np.float32), bf16(b).astype(np.float32)).astype(np.float32).astype(BF16)
    assert np.array_equal(bits(out), bits(want))


def test_tensor_scalar_with_per_partition_operand_and_reverse():
    a = rng.standard_normal((128, 64)).astype(np.float32)
    s = rng.standard_normal((128, 1)).astype(np.float32)

    def build(k, o, x, col):
        k.tensor_scalar(o, x, "subtract", col, op1="multiply", operand1=3.0, reverse0=True)

    out = run_elementwise(build, {"a": a, "s": s})
    assert np.array_equal(out, ((s - a) * np.float32(3.0)).astype(np.float32))


def test_tensor_reduce_and_broadcast():
    a = rng.standard_normal((128, 4, 32)).astype(np.float32)

    def build(k, o, x):
        k.tensor_reduce(o, "max", x, axis=2)

    out = run_elementwise(build, {"a": a}, shape=(128, 4))
    assert np.array_equal(out, a.max(axis=2))

    def build2(k, o, x):
        red = k.sbuf((128, 1), "fp32", name="red")
        k.tensor_reduce(red, "add", x, axis=1)
        k.tensor_tensor(o, x, red.broadcast_to(128, 64), "subtract")

    b = rng.standard_normal((128, 64)).astype(np.float32)
    out = run_elementwise(build2, {"b": b})
    assert np.array_equal(out, (b - b.sum(axis=1, dtype=np.float32, keepdims=True)).astype(np.float32))


@pytest.mark.parametrize("fn,ref", [
    ("exp", np.exp), ("tanh", np.tanh), ("relu", lambda x: np.maximum(x, 0)),
    ("sigmoid", lambda x: 1 / (1 + np.exp(-x))),
    ("gelu", lambda x: 0.5 * x * (1 + np.vectorize(__import__("math").erf)(x / np.sqrt(2)))),
    ("silu", lambda x: x / (1 + np.exp(-x))),
])
def test_activation_functions(fn, ref):
    a = rng.standard_normal((128, 64)).astype(np.float32)
    bias = rng.standard_normal((128, 1)).astype(np.float32)

    def build(k, o, x, b):
        r = k.sbuf((128, 1), "fp32", name="r")
        k.activation(o, fn, x, bias=b, scale=0.5, reduce_op="add", reduce_res=r)

    out = run_elementwise(build, {"a": a, "b": bias})
    pre = (a * np.float32(0.5)).astype(np.float32) + bias
    want = ref(pre.astype(np.float64))
    np.testing.assert_allclose(out, want, rtol=2e-6, atol=1e-7)


def test_iota_and_affine_select_make_a_causal_mask():
    chip = Chip("trn2")
    k = chip.kernel("mask")
    o = k.output("o", (128, 128), "fp32")
    idx = k.sbuf((128, 128), "fp32", name="idx")
    k.iota(idx, base=5, channel_multiplier=1000, pattern=[1])
    m = k.sbuf((128, 128), "fp32", name="m")
    # keep where p - i >= 0 (lower triangle), else -inf
    k.affine_select(m, idx, cmp="greater_equal", offset=0, channel_multiplier=1, pattern=[-1], on_false=-np.inf)
    k.dma_copy(o, m)
    out = chip.run(k)["o"]
    p, i = np.meshgrid(np.arange(128), np.arange(128), indexing="ij")
    vals = (5 + 1000 * p + i).astype(np.float32)
    assert np.array_equal(out, np.where(p >= i, vals, -np.inf).astype(np.float32))


def test_transpose_is_bit_exact():
    a = bf16(rng.standard_normal((128, 96)))
    a[0, 0] = np.nan
    chip = Chip("trn2")
    k = chip.kernel("tr")
    x = k.input("x", (128, 96), "bf16")
    y = k.output("y", (96, 128), "bf16")
    t = k.sbuf((128, 96), "bf16")
    p = k.psum((96, 128), "bf16")
    s = k.sbuf((96, 128), "bf16")
    k.dma_copy(t, x)
    k.nc_transpose(p, t)
    k.tensor_copy(s, p)
    k.dma_copy(y, s)
    assert np.array_equal(bits(chip.run(k, {"x": a})["y"]), bits(a.T))


def test_matmul_kernel_matches_the_datapath_definition():
    m, kk, n = 256, 512, 1024
    lhsT = rng.standard_normal((kk, m)).astype(np.float32)
    rhs = rng.standard_normal((kk, n)).astype(np.float32)
    out = Chip("trn2").run(build_matmul(m, kk, n, "bf16"), {"lhsT": lhsT, "rhs": rhs})["out"]
    # PSUM accumulation group over 128-row chunks, then rounded once to bf16 on evacuation
    want = reference.matmul(bf16(lhsT), bf16(rhs), k_chunk=128).astype(BF16)
    assert np.array_equal(bits(out), bits(want))
    np.testing.assert_allclose(out.astype(np.float32), lhsT.T @ rhs, rtol=0.05, atol=0.5)


def test_fp8_double_row_contracts_256_rows():
    e4 = ml_dtypes.float8_e4m3
    a = rng.standard_normal((128, 2, 64)).astype(np.float32).astype(e4)
    b = rng.standard_normal((128, 2, 128)).astype(np.float32).astype(e4)
    chip = Chip("trn2")
    k = chip.kernel("fp8")
    xa = k.input("a", a.shape, "fp8_e4m3")
    xb = k.input("b", b.shape, "fp8_e4m3")
    y = k.output("y", (64, 128), "fp32")
    ta, tb = k.sbuf(a.shape, "fp8_e4m3"), k.sbuf(b.shape, "fp8_e4m3")
    k.dma_copy(ta, xa)
    k.dma_copy(tb, xb)
    acc = k.psum((64, 128), "fp32")
    k.nc_matmul(acc, ta, tb)
    res = k.sbuf((64, 128), "fp32")
    k.tensor_copy(res, acc)
    k.dma_copy(y, res)
    out = chip.run(k, {"a": a, "b": b})["y"]
    want = reference.matmul(a.reshape(256, 64), b.reshape(256, 128), k_chunk=256)
    assert np.array_equal(bits(out), bits(want))


def test_unwritten_memory_reads_as_nan():
    chip = Chip("trn2")
    k = chip.kernel("poison")
    o = k.output("o", (128, 8), "fp32")
    t = k.sbuf((128, 8), "fp32")
    k.dma_copy(o[:, 0:4], t[:, 0:4])
    out = chip.run(k)["o"]
    assert np.isnan(out).all()


def test_two_runs_are_identical_and_timing_only_gives_the_same_cycles():
    lhsT = rng.standard_normal((256, 128)).astype(np.float32)
    rhs = rng.standard_normal((256, 512)).astype(np.float32)
    chip = Chip("trn2")
    k = build_matmul(128, 256, 512, "bf16")
    a = chip.run(k, {"lhsT": lhsT, "rhs": rhs})
    b = chip.run(k, {"lhsT": lhsT, "rhs": rhs})
    t = chip.run(k, timing_only=True)
    assert np.array_equal(bits(a["out"]), bits(b["out"]))
    assert a.report.timeline == b.report.timeline == t.report.timeline
    assert a.report.to_dict() == t.report.to_dict()
    with pytest.raises(KeyError, match="timing-only"):
        t["out"]


def test_input_errors():
    chip = Chip("trn2")
    k = build_matmul(128, 128, 512, "bf16")
    with pytest.raises(KernelError, match=r"^missing input 'rhs' for kernel 'matmul' \(shape \(128, 512\), bf16\)$"):
        chip.run(k, {"lhsT": np.zeros((128, 128))})
    with pytest.raises(KernelError, match=r"^input 'rhs' has shape \(4, 4\), kernel 'matmul' expects \(128, 512\)$"):
        chip.run(k, {"lhsT": np.zeros((128, 128)), "rhs": np.zeros((4, 4))})
    with pytest.raises(KernelError, match=r"^unknown input 'x' for kernel 'matmul'; its inputs are lhsT, rhs$"):
        chip.run(k, {"x": 1})


def test_integer_ops_stay_integer():
    a = rng.integers(-1000, 1000, size=(128, 64)).astype(np.int32)
    b = rng.integers(1, 1000, size=(128, 64)).astype(np.int32)
    out = run_elementwise(lambda k, o, x, y: k.tensor_tensor(o, x, y, "bitwise_and"), {"a": a, "b": b},
                          dtype="int32")
    assert np.array_equal(out, a & b)
    big = np.full((128, 64), 2**30 + 1, dtype=np.int32)   # not representable in fp32
    out = run_elementwise(lambda k, o, x, y: k.tensor_tensor(o, x, y, "add"), {"a": big, "b": b}, dtype="int32")
    assert np.array_equal(out, big + b)


def test_integer_immediates_and_memset_are_exact():
    x = np.array([[1, 300, 33554431, -200]] * 128, dtype=np.int32)
    out = run_elementwise(lambda k, o, a: k.tensor_scalar(o, a, "add", 16777217), {"x": x}, shape=(128, 4), dtype="int32")
    assert np.array_equal(out, x + 16777217)
    out = run_elementwise(lambda k, o, a: k.tensor_scalar(o, a, "bitwise_and", 0x1FFFFFF), {"x": x}, shape=(128, 4),
                          dtype="int32")
    assert np.array_equal(out, x & 0x1FFFFFF)
    out = run_elementwise(lambda k, o, a: k.memset(o, 16777217), {"x": x}, shape=(128, 4), dtype="int32")
    assert (out == 16777217).all()


def test_integer_conversions_round_to_nearest_even_and_saturate():
    chip = Chip("trn2")
    k = chip.kernel("ints")
    x = k.input("x", (1, 6), "int32")
    y = k.output("y", (1, 6), "int8")
    t = k.sbuf((1, 6), "int32")
    u = k.sbuf((1, 6), "int8")
    k.dma_copy(t, x)
    k.tensor_copy(u, t)
    k.dma_copy(y, u)
    out = chip.run(k, {"x": np.array([[2.5, 3.5, 2.7, -2.7, 300, -300]])})["y"]
    assert out.tolist() == [[2, 4, 3, -3, 127, -128]]
