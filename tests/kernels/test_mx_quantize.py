"""MXFP8 quantisation (issue 29, MXFP8 training on trn3): the ``mx_quantize`` kernel against its
numpy reference byte for byte, a hand-worked group, and its outputs fed to ``matmul_mx``."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from trnsim import KernelError
from trnsim.kernels import get_kernel
from trnsim.kernels.check import check_entry
from trnsim.kernels.matmul_mx import build_matmul_mx
from trnsim.kernels.mx_quantize import build_mx_quantize, mx_quantize_reference
from trnsim.sim.chip import Chip


@pytest.mark.parametrize("layout", ["rows", "cols"])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_mx_quantize_matches_its_reference_bytes(layout, dtype):
    # ragged rows, a last chunk of one k-tile and a partial one (2688 = 2048 + 512 + 128)
    out = check_entry(get_kernel("mx_quantize"), (200, 2688), dtype, "trn3", {"layout": layout})
    assert out["ok"] and out["errors"] == {"q": 0.0, "scale": 0.0}


def test_mx_quantize_e5m2():
    out = check_entry(get_kernel("mx_quantize"), (130, 640), "bf16", "trn3", {"fmt": "mxfp8_e5m2"})
    assert out["ok"] and out["errors"] == {"q": 0.0, "scale": 0.0}


def _run(kernel, inputs, config="trn3"):
    return Chip(config).run(kernel, inputs)


def test_a_group_worked_by_hand():
    # row 0: group 0 has max |x| 1000 = 1.95 * 2**9: E8M0 scale 2**(9 - 8) (byte 128); 1000 / 2 = 500
    # saturates to e4m3's 448, 3 / 2 = 1.5 is exact. Group 1 has max 1.0: scale 2**-8 (byte 119);
    # 0.1 * 256 = 25.6 rounds to 26 (e4m3 steps by 2 there). Group 2 is all zero: byte 0, values 0.
    x = np.zeros((1, 128), np.float32)
    x[0, 0], x[0, 1], x[0, 5] = 1000.0, 3.0, -2.0
    x[0, 32], x[0, 33] = 1.0, 0.1
    res = _run(build_mx_quantize(1, 128, "fp32", "trn3"), {"x": x})
    q, s = np.asarray(res["q"]), np.asarray(res["scale"])
    assert q.shape == (32, 1) and s.shape == (4, 1)
    assert s[:, 0].tolist() == [128, 119, 0, 0]
    vals = q.view(np.uint8).reshape(32, 4).view(ml_dtypes.float8_e4m3fn).astype(np.float32).reshape(-1)
    assert vals[[0, 1, 5]].tolist() == [448.0, 1.5, -1.0]
    assert vals[[32, 33]].tolist() == [256.0, 26.0]
    assert not vals[64:].any()
    ref_q, ref_s = mx_quantize_reference(x)
    assert np.array_equal(ref_q, q) and np.array_equal(ref_s, s)


def test_quantised_operands_feed_matmul_mx():
    # x [M, K] (rows) and w [K, N] (cols, a weight stored [in, out]) quantised on the device, then
    # matmul_mx on the packed outputs: the MX product of the dequantised operands, which is x @ w
    # to MXFP8's precision
    rng = np.random.default_rng(3)
    m, k, n = 96, 640, 160
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.float32)
    qa = _run(build_mx_quantize(m, k, "fp32", "trn3", layout="rows"), {"x": x})
    qb = _run(build_mx_quantize(n, k, "fp32", "trn3", layout="cols"), {"x": w})
    out = _run(build_matmul_mx(m, k, n, "mxfp8_e4m3fn", "trn3", out_dtype="fp32"),
               {"lhsT": np.asarray(qa["q"]), "lhsT_scale": np.asarray(qa["scale"]),
                "rhs": np.asarray(qb["q"]), "rhs_scale": np.asarray(qb["scale"])})
    got = np.asarray(out["out"], np.float64)

    def deq(q, s):  # [K/4, R] packed, [K/32, R] scales -> [K, R], K in row-major order
        v = np.asarray(q).T.copy().view(np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
        return (v.reshape(v.shape[0], -1, 32) * np.exp2(np.asarray(s).T.astype(np.float64) - 127)[..., None]).reshape(
            v.shape[0], -1).T
    exact = deq(qa["q"], qa["scale"]).T @ deq(qb["q"], qb["scale"])
    assert np.abs(got - exact).max() <= 1e-5 * np.abs(exact).max()
    want = x.astype(np.float64) @ w
    assert np.abs(got - want).max() <= 0.05 * np.abs(want).max()


def test_mx_quantize_refusals():
    with pytest.raises(KernelError, match=r"^mx_quantize: K=100 must be a multiple of 128"):
        build_mx_quantize(4, 100)
    with pytest.raises(KernelError, match=r"^mx_quantize: fmt 'mxfp4': expected one of mxfp8_e4m3fn, mxfp8_e5m2$"):
        build_mx_quantize(4, 128, fmt="mxfp4")
    with pytest.raises(KernelError, match=r"^mx_quantize: layout 'diag': expected rows"):
        build_mx_quantize(4, 128, layout="diag")
    with pytest.raises(KernelError, match=r"^mx_quantize: trn1 has no DMA transpose"):
        build_mx_quantize(4, 128, config="trn1")
