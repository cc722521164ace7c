"""The matmul family (trnsim/kernels/matmul.py): values against numpy for every dtype, ragged
shapes and transposed operands on trn2 and trn3; the schedule an NKI author would write (double-row
fp8, PE transposes, split evacuation, separate queues); TensorE busy and MFU on a 2048 cube;
pinned errors."""

import numpy as np
import pytest

from trnsim import Chip, KernelError, load_config
from trnsim.isa import DmaCopy, MatMul, TensorCopy, Transpose
from trnsim.kernels.matmul import build_bmm, build_matmul, plan_blocks
from trnsim.kernels import get_kernel
from trnsim.kernels.check import check_entry
from trnsim.native.dtypes import get_dtype

DTYPES = ("bf16", "fp16", "fp32", "fp8_e4m3", "fp8_e5m2")
RAGGED = [(1, 1, 1), (200, 300, 700), (129, 257, 513)]


def check(name, shape, dtype, config, **params):
    res = check_entry(get_kernel(name), shape, dtype, config, params)
    assert res["ok"], res["errors"]
    return res


@pytest.mark.parametrize("config", ["trn2", "trn3"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", RAGGED)
def test_matmul_values(shape, dtype, config):
    check("matmul", shape, dtype, config)


@pytest.mark.parametrize("config", ["trn2", "trn3"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ta,tb", [(True, False), (False, True), (True, True)])
def test_matmul_transposed_operands(ta, tb, dtype, config):
    check("matmul", (129, 301, 513), dtype, config, transpose_a=ta, transpose_b=tb)


@pytest.mark.parametrize("dtype", DTYPES)
def test_transposed_operands_over_several_column_blocks(dtype):
    """A is transposed during the first column block and spilled to HBM; B's next column block
    is transposed on chip as the current one's buffers free up."""
    check("matmul", (130, 259, 2100), dtype, "trn2", transpose_a=True, transpose_b=True)
    check("bmm", (2, 70, 129, 1100), dtype, "trn3", transpose_a=True)


def test_each_operand_crosses_the_pe_array_once():
    def transposes(**kw):
        return sum(isinstance(i, Transpose) for i in build_matmul(256, 512, 4096, "bf16", "trn2", **kw).instructions)

    assert transposes(transpose_a=True) == 2 * 4  # 256/128 row tiles x 512/128 k-tiles, not x 4 column blocks
    assert transposes(transpose_b=True) == 32 * 4
    assert "lhsT" in build_matmul(256, 512, 4096, "bf16", "trn2", transpose_a=True).tensors  # the HBM spill


@pytest.mark.parametrize("dtype", ["bf16", "fp8_e4m3"])
def test_matmul_tiny_transposed(dtype):
    check("matmul", (1, 1, 1), dtype, "trn2", transpose_a=True, transpose_b=True)


@pytest.mark.parametrize("config", ["trn2", "trn3"])
@pytest.mark.parametrize("dtype,ta,tb", [("bf16", False, False), ("fp32", True, False), ("fp8_e4m3", False, True),
                                         ("fp16", True, True)])
def test_bmm_values(dtype, ta, tb, config):
    check("bmm", (3, 65, 257, 600), dtype, config, transpose_a=ta, transpose_b=tb)


def test_long_k_streams_both_operands():
    """When K is too long for resident blocks (here: a small SBUF), both operands stream."""
    assert plan_blocks(4096, 8192, 8192, get_dtype("bf16"), load_config("trn2")).resident
    small = load_config("trn2", {"core.sbuf.partition_bytes": "32KiB"})
    assert not plan_blocks(200, 3000, 600, get_dtype("bf16"), small).resident
    assert not plan_blocks(130, 6001, 600, get_dtype("fp8_e4m3"), small, True, True).resident
    check("matmul", (200, 3000, 600), "bf16", small)
    check("matmul", (130, 6001, 600), "fp8_e4m3", small, transpose_a=True, transpose_b=True)


def test_output_dtypes():
    assert build_matmul(8, 8, 8, "fp32").tensors["out"].dtype.name == "float32"
    for dt in ("bf16", "fp16", "fp8_e4m3"):
        assert build_matmul(8, 8, 8, dt).tensors["out"].dtype.name == "bfloat16"
    assert build_matmul(8, 8, 8, "bf16", out_dtype="fp32").tensors["out"].dtype.name == "float32"
    res = check("matmul", (128, 256, 512), "bf16", "trn2", out_dtype="fp32")
    assert res["errors"]["out"] < 1e-6  # fp32 out keeps PSUM's fp32 sums


def test_schedule_is_what_an_nki_author_writes():
    kern = build_matmul(512, 1024, 2048, "bf16", "trn2")
    ins = kern.instructions
    mms = [i for i in ins if isinstance(i, MatMul)]
    assert len(mms) == (512 // 128) * (1024 // 128) * (2048 // 512)
    # each stationary serves every bank of its row: LoadStationary only when it changes
    assert sum(i.load_stationary for i in mms) == len(mms) // 2
    evac = {i.engine for i in ins if isinstance(i, TensorCopy)}
    assert evac == {"Vector", "Scalar"}
    loads = {i.queue for i in ins if isinstance(i, DmaCopy) and i.src.space == "hbm"}
    stores = {i.queue for i in ins if isinstance(i, DmaCopy) and i.dst.space == "hbm"}
    assert len(loads) == 2 and stores and not loads & stores
    r = Chip("trn2").run(kern, timing_only=True).report
    assert r.engines["Vector"].instructions and r.engines["Scalar"].instructions


def test_fp8_uses_double_row_and_transposes_run_on_tensor_engine():
    fp8 = build_matmul(256, 1024, 512, "fp8_e4m3", "trn2")
    mms = [i for i in fp8.instructions if isinstance(i, MatMul)]
    assert mms and all(i.double_row for i in mms)
    assert len(mms) == 2 * 1024 // 256
    tr = build_matmul(256, 1024, 512, "bf16", "trn2", transpose_a=True)
    assert sum(isinstance(i, Transpose) for i in tr.instructions) == 2 * 8
    base = Chip("trn2").run(build_matmul(256, 1024, 512, "bf16", "trn2"), timing_only=True).report
    slow = Chip("trn2").run(tr, timing_only=True).report
    assert slow.engines["Tensor"].busy_ticks > base.engines["Tensor"].busy_ticks


def test_fp8_e5m2_runs_double_row_at_e4m3s_rate():
    # NC-v3 runs FP8_E4 and FP8_E5 at twice the bf16 rate in double-row mode (datasheet §4.2, S9)
    e5 = build_matmul(256, 1024, 512, "fp8_e5m2", "trn2", transpose_b=True)
    assert all(i.double_row for i in e5.instructions if isinstance(i, MatMul) and not isinstance(i, Transpose))
    e4 = Chip("trn2").run(build_matmul(256, 1024, 512, "fp8_e4m3", "trn2", transpose_b=True), timing_only=True)
    assert Chip("trn2").run(e5, timing_only=True).report.total_cycles == e4.report.total_cycles


def test_fp8_single_row_where_the_core_has_no_double_row():
    assert not load_config("trn1").core.tensor.fp8_double_row
    assert not any(getattr(i, "double_row", False) for i in build_matmul(256, 512, 512, "fp8_e4m3", "trn1").instructions)
    check("matmul", (129, 300, 1100), "fp8_e4m3", "trn1", transpose_a=True, transpose_b=True)


def test_tensor_busy_and_mfu_on_2048_cube():
    """The library matmul keeps TensorE >= 95% active and reaches >= 90% MFU (the tutorial kernels'
    published profiles are ledger rows: validation/nki_tutorials.yaml); 2048^3 is small enough
    for a unit test."""
    r = Chip("trn2").run(build_matmul(2048, 2048, 2048, "bf16", "trn2"), timing_only=True).report
    assert r.engines["Tensor"].active_percent >= 95.0
    assert r.mfu_estimated_percent >= 90.0


def test_deterministic():
    rng = np.random.default_rng(1)
    inputs = {"lhsT": rng.standard_normal((300, 200)), "rhs": rng.standard_normal((300, 700))}
    a = Chip("trn2").run(build_matmul(200, 300, 700), inputs)
    b = Chip("trn2").run(build_matmul(200, 300, 700), inputs)
    assert a.report.total_ticks == b.report.total_ticks
    assert np.array_equal(a["out"].view(np.uint16), b["out"].view(np.uint16))


def test_bmm_overlaps_batches():
    one = Chip("trn2").run(build_matmul(512, 512, 1024), timing_only=True).report
    four = Chip("trn2").run(build_bmm(4, 512, 512, 1024), timing_only=True).report
    assert four.total_ticks < 3.6 * one.total_ticks


@pytest.mark.parametrize("call,msg", [
    (lambda: build_matmul(0, 128, 128), "matmul: M must be a positive integer, got 0"),
    (lambda: build_bmm(2, 8, 8, 8, "int8"), "bmm: dtype int8 not supported; expected one of bf16, fp16, fp32, fp8_e4m3, fp8_e5m2"),
    (lambda: build_matmul(8, 8, 8, transpose_a="yes"), "matmul: transpose_a must be true or false, got 'yes'"),
    (lambda: build_matmul(8, 8, 8, out_dtype="fp7"),
     "matmul: out_dtype: unknown dtype 'fp7': expected one of bf16, fp16, fp32, fp8_e4m3, fp8_e4m3fn, fp8_e5m2, "
     "int8, uint8, int16, int32, uint32"),
    (lambda: get_kernel("matmul").make((8, 8), "bf16", load_config("trn2")),
     "kernel 'matmul': --shape needs 3 dims MxKxN, got 8x8"),
])
def test_errors(call, msg):
    with pytest.raises(KernelError) as e:
        call()
    assert str(e.value) == msg


# ---- MX matmul (NeuronCore-v4) -----------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["mxfp8_e4m3fn", "mxfp8_e5m2", "mxfp4"])
def test_matmul_mx_values(dtype):
    check("matmul_mx", (200, 1152, 700), dtype, "trn3")  # ragged M and N, a k-tile of 64 partitions


def test_matmul_mx_runs_four_times_the_bf16_rate():
    from trnsim.kernels.matmul_mx import build_matmul_mx

    chip = Chip("trn3")
    mx = chip.run(build_matmul_mx(512, 4096, 1024, "mxfp8_e4m3fn", "trn3"), timing_only=True).report
    bf16 = chip.run(build_matmul(512, 4096, 1024, "bf16", "trn3"), timing_only=True).report
    assert mx.instruction_counts["MatMulMx"] == 4 * 8 * 2  # row tiles x k-tiles of 512 x PSUM banks
    assert mx.matmul_flops == bf16.matmul_flops == 2 * 512 * 4096 * 1024
    ratio = mx.engines["Tensor"].busy_ticks / bf16.engines["Tensor"].busy_ticks
    assert 0.25 <= ratio < 0.3, ratio


def test_matmul_mx_errors():
    from trnsim.kernels.matmul_mx import build_matmul_mx

    with pytest.raises(KernelError, match=r"^matmul_mx: trn2 has no MX matmul \(core.tensor.mx_quad is false; it "
                                          r"needs NeuronCore-v4\)$"):
        build_matmul_mx(128, 512, 128, "mxfp8_e4m3fn", "trn2")
    with pytest.raises(KernelError, match=r"^matmul_mx: K=96 must be a multiple of 128 "):
        build_matmul_mx(128, 96, 128, "mxfp8_e4m3fn", "trn3")
    with pytest.raises(KernelError, match=r"^matmul_mx: dtype bf16 not supported; expected one of mxfp8_e4m3fn, "
                                          r"mxfp8_e5m2, mxfp4$"):
        build_matmul_mx(128, 512, 128, "bf16", "trn3")
