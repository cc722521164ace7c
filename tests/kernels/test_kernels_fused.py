"""The fused region kernels (trnsim.kernels.fused) against their numpy definition, every preset
pattern in each dtype at ragged shapes, on trn2 and trn3; and their hardware limits as errors."""

from __future__ import annotations

import pytest

from trnsim.isa import KernelError
from trnsim.kernels import get_kernel
from trnsim.kernels.check import check_entry
from trnsim.kernels.fused import FULL, PATTERNS, ROW, Program, build_fused


@pytest.mark.parametrize("config", ["trn2", "trn3"])
@pytest.mark.parametrize("pattern", sorted(PATTERNS))
def test_pattern_matches_numpy(pattern, config):
    name = "matmul_fused" if pattern.startswith("mm_") else "fused"
    # (640, 512): five row tiles of one row per partition, so pipeline stages of different tiles
    # interleave and a value's buffer must outlive them (layer norm read a reused tile once)
    shapes = [(130, 200, 300)] if name == "matmul_fused" else [(300, 256), (1030, 64), (128, 2048), (640, 512)]
    for shape in shapes:
        for dtype in ("fp32", "bf16"):
            out = check_entry(get_kernel(name), shape, dtype, config, {"pattern": pattern})
            assert out["ok"], f"{pattern} {shape} {dtype}: {out['errors']}"


def test_rows_too_wide_for_a_row_reduction_is_one_line():
    with pytest.raises(KernelError, match=r"^fused: rows of 1000000 elements do not fit SBUF on trn2"):
        build_fused(128, 1_000_000, "fp32", "trn2", pattern="softmax")


def test_a_column_sum_read_in_the_tile_loop_is_refused():
    prog = Program(((FULL, "fp32"),), (("csum", 0), ("tt", "add", 0, 1)), ((2, "fp32"),))
    with pytest.raises(KernelError, match=r"^fused: step 1 uses a column sum inside the tile loop"):
        build_fused(256, 64, "fp32", "trn2", program=prog)


def test_matmul_epilogue_must_be_elementwise():
    from trnsim.kernels.fused import build_matmul_fused

    prog = Program(((FULL, "fp32"), (ROW, "fp32")), (("red", "add", 0),), ((2, "fp32"),))
    with pytest.raises(KernelError, match=r"^matmul_fused: a matmul epilogue must be elementwise"):
        build_matmul_fused(128, 128, 128, "fp32", "trn2", program=prog)


@pytest.mark.parametrize("config", ["trn1", "trn2"])
def test_a_causal_masked_softmax_matches_numpy_and_torch(config):
    """NxD's CoreAttention's scale, causal mask and softmax as one region: the mask made by
    GpSimd's affine_select from the indices (2 heads of 512 queries x 512 keys: row tiles of 128
    partitions, a row each, sit inside one head's period; at LNC=2 the rows split at the head
    boundary)."""
    import numpy as np
    import torch

    from trnsim import Chip
    from trnsim.kernels.fused import reference

    heads, q, k = 2, 512, 512
    steps = (("ts", 0, "multiply", 0.125, None, None, False), ("causal", 1, -10000.0, q, 1),
             ("red", "max", 2), ("tt", "subtract", 2, 3), ("act", "exp", 4, 1.0, 0.0), ("red", "add", 5),
             ("tt", "divide", 5, 6))
    prog = Program(((FULL, "fp32"),), steps, ((7, "fp32"),))
    out = check_entry(get_kernel("fused"), (heads * q, k), "fp32", config, {"program": prog})
    assert out["ok"], out["errors"]
    x = np.random.default_rng(0).standard_normal((heads * q, k)).astype(np.float32)
    mask = torch.ones(1, 1, q, k, dtype=torch.bool).triu(1)
    want = torch.softmax(torch.from_numpy(x).view(1, heads, q, k).mul(0.125).masked_fill(mask, -10000.0), -1)
    (ref,) = reference(prog, [x], heads * q, k)
    assert np.allclose(ref, want.reshape(heads * q, k).numpy(), rtol=1e-5, atol=1e-6)
    kern = build_fused(heads * q, k, "fp32", config, program=prog)
    res = Chip(config).run(kern, {"in0": x})
    assert np.allclose(res.outputs["out0"], ref, rtol=1e-3, atol=1e-5)


def test_a_causal_step_across_a_period_inside_one_row_tile_is_refused():
    prog = Program(((FULL, "fp32"),), (("causal", 0, 0.0, 100, 1), ("tt", "add", 0, 1)), ((2, "fp32"),))
    with pytest.raises(KernelError, match=r"^fused: a causal step needs row tiles inside one period of the mask"):
        build_fused(400, 2048, "fp32", "trn2", program=prog)
