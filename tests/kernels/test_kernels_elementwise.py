"""Elementwise, activation, reduce and transpose library kernels: values against numpy (via each
kernel's registered reference), ragged shapes, both chip generations, structure and errors."""

import re

import numpy as np
import pytest

import trnsim
from trnsim.isa import ACTIVATIONS, DmaCopy, MatMul, TensorScalar, TensorTensor, Transpose
from trnsim.kernels import get_kernel
from trnsim.kernels.elementwise import BINARY_OPS, UNARY_OPS, row_pieces
from trnsim.kernels.check import check_entry

DTYPES = ("bf16", "fp16", "fp32")
ODD = ((1, 1), (129, 1000), (300, 7))
CONFIGS = ("trn2", "trn3")


def check(name, shape, dtype, config="trn2", **params):
    r = check_entry(get_kernel(name), shape, dtype, config, params)
    assert r["ok"], f"{name} {shape} {dtype} {config} {params}: errors {r['errors']}"
    return r


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("broadcast", ("none", "row", "col", "scalar"))
def test_binary_add_broadcasts_odd_shapes(broadcast, dtype, config):
    for shape in ODD:
        check("binary", shape, dtype, config, op="add", broadcast=broadcast)


@pytest.mark.parametrize("op", BINARY_OPS)
def test_binary_ops(op):
    for dtype in DTYPES:
        check("binary", (300, 7), dtype, "trn3", op=op, broadcast="col")
    check("binary", (129, 1000), "bf16", "trn2", op=op)


@pytest.mark.parametrize("broadcast", ("none", "row", "col", "scalar"))
def test_binary_wide_rows_cut_into_column_tiles(broadcast):
    # 256 B tiles force several column tiles per row and a ragged last one
    check("binary", (130, 300), "bf16", "trn2", op="subtract", broadcast=broadcast, tile_bytes=256)
    check("binary", (130, 300), "fp32", "trn3", op="divide", broadcast=broadcast, tile_bytes=256, bufs=2)


@pytest.mark.parametrize("op", sorted(UNARY_OPS))
def test_unary_ops(op):
    for dtype in DTYPES:
        check("unary", (300, 7), dtype, "trn2", op=op)
    check("unary", (129, 1000), "bf16", "trn3", op=op)
    check("unary", (1, 1), "fp32", "trn3", op=op)


@pytest.mark.parametrize("fn", sorted(ACTIVATIONS))
def test_activation_functions(fn):
    check("activation", (129, 100), "bf16", "trn2", fn=fn)
    check("activation", (300, 7), "fp32", "trn3", fn=fn, scale=0.5)


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_activation_odd_shapes(dtype, config):
    for shape in ODD:
        check("activation", shape, dtype, config, fn="gelu_apprx_tanh")


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("axis", (0, 1))
@pytest.mark.parametrize("op", ("sum", "max", "min", "mean"))
def test_reduce(op, axis, config):
    for dtype in DTYPES:
        for shape in ODD:
            check("reduce", shape, dtype, config, op=op, axis=axis)
    # several column tiles per row (axis=1 partials) and several row tiles / PSUM banks (axis=0)
    check("reduce", (260, 1100), "bf16", config, op=op, axis=axis, tile_bytes=512)


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_transpose_exact(dtype, config):
    for shape in ODD + ((7, 300), (300, 130)):
        r = check("transpose", shape, dtype, config)
        assert r["errors"]["out"] == 0.0
    # several blocks each way, ragged, more row tiles than one PSUM bank holds
    check("transpose", (700, 390), dtype, config, block_bytes=256 * 4)
    # narrow rows (grouped-row loads, strided evacuation) and short rows (grouped-row stores,
    # strided transpose input), each with whole windows and a ragged tail
    small = 1024 if dtype == "fp32" else 512  # 256-element blocks
    check("transpose", (3000, 30), dtype, config, block_bytes=small)
    check("transpose", (30, 3000), dtype, config, block_bytes=small)


def test_row_pieces_cover_the_tensor_once():
    for rows, cols, free in ((300, 7, 64), (129, 1000, 256), (1, 1, 8), (1000, 3, 12), (256, 20, 8192)):
        seen = np.zeros((rows, cols), dtype=int)
        for pc in row_pieces(rows, cols, free, 128):
            assert 1 <= pc.p <= 128 and pc.free <= max(free, cols if cols <= free else free)
            seen[pc.r0:pc.r0 + pc.p * pc.g, pc.c0:pc.c0 + pc.cols] += 1
        assert (seen == 1).all()


def _dma_chunks(kernel):
    return [i.plan.chunk_bytes for i in kernel.instructions if isinstance(i, DmaCopy)]


def test_streaming_kernels_move_big_descriptors_on_separate_queues():
    # narrow rows are grouped so each partition moves one contiguous 16 KiB block
    k = get_kernel("binary").make((65536, 64), "bf16", trnsim.load_config("trn2"))
    assert min(_dma_chunks(k)) == 16384
    loads = {i.queue for i in k.instructions if isinstance(i, DmaCopy) and i.src.space == "hbm"}
    stores = {i.queue for i in k.instructions if isinstance(i, DmaCopy) and i.dst.space == "hbm"}
    assert len(loads) == 2 and stores.isdisjoint(loads)
    engines = {i.engine for i in k.instructions if isinstance(i, TensorTensor)}
    assert engines == {"Vector", "GpSimd"}
    t = get_kernel("transpose").make((4096, 4096), "bf16", trnsim.load_config("trn2"))
    assert min(_dma_chunks(t)) == 4096
    assert sum(isinstance(i, Transpose) for i in t.instructions) == 32 * 32
    for shape in ((65536, 64), (64, 65536)):  # narrow or short rows still move >= 4 KiB descriptors
        t = get_kernel("transpose").make(shape, "bf16", trnsim.load_config("trn2"))
        assert min(_dma_chunks(t)) >= 4096


def test_reduce_axis0_uses_the_right_engines():
    cfg = trnsim.load_config("trn2")
    s = get_kernel("reduce").make((1024, 1024), "bf16", cfg, {"op": "sum", "axis": 0})
    assert sum(isinstance(i, MatMul) for i in s.instructions) == 8 * 2
    m = get_kernel("reduce").make((1024, 1024), "bf16", cfg, {"op": "max", "axis": 0})
    assert sum(isinstance(i, Transpose) for i in m.instructions) == 8
    assert not any(isinstance(i, MatMul) for i in m.instructions)


def test_scalar_broadcast_is_one_load_and_per_partition_operand():
    k = get_kernel("binary").make((512, 512), "bf16", trnsim.load_config("trn2"), {"broadcast": "scalar"})
    b_loads = [i for i in k.instructions if isinstance(i, DmaCopy) and i.src.space == "hbm" and i.src.tensor.name == "b"]
    assert len(b_loads) == 1
    assert all(isinstance(i.operand0, trnsim.isa.TileAP) for i in k.instructions if isinstance(i, TensorScalar))


def test_deterministic_cycles_and_values():
    runs = [check("binary", (300, 700), "bf16", "trn3", op="multiply", broadcast="row") for _ in range(2)]
    assert runs[0]["report"].total_ticks == runs[1]["report"].total_ticks
    assert runs[0]["errors"] == runs[1]["errors"]


@pytest.mark.parametrize("name, params, message", [
    ("binary", {"op": "xor"}, "binary: op: expected one of add, subtract, multiply, divide, maximum, minimum, "
                              "abs_max, power, got 'xor'"),
    ("binary", {"broadcast": "diag"}, "binary: broadcast: expected one of none, row, col, scalar, got 'diag'"),
    ("binary", {"bufs": 1}, "binary: bufs must be an integer >= 2 (double buffering or deeper), got 1"),
    ("unary", {"tile_bytes": 1}, "unary: tile_bytes must be an integer >= 2 (bytes per partition), got 1"),
    ("activation", {"fn": "swish9"}, "activation: fn: expected one of "),
    ("reduce", {"axis": 2}, "reduce: axis must be 0 (down the columns) or 1 (along the rows), got 2"),
    ("reduce", {"op": "prod"}, "reduce: op: expected one of sum, max, min, mean, got 'prod'"),
    ("transpose", {"block_bytes": 100}, "transpose: block_bytes must be an integer >= 256 (128 bf16 elements "
                                        "per partition), got 100"),
])
def test_bad_params_are_one_line_errors(name, params, message):
    with pytest.raises(trnsim.KernelError, match="^" + re.escape(message)):
        get_kernel(name).make((256, 256), "bf16", trnsim.load_config("trn2"), params)


def test_unsupported_dtype():
    with pytest.raises(trnsim.KernelError, match=r"^kernel 'binary': dtype fp8_e4m3 not supported; expected one of "
                                                 r"bf16, fp16, fp32$"):
        get_kernel("binary").make((128, 128), "fp8_e4m3", trnsim.load_config("trn2"))
