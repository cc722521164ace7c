"""The NKI-style kernels of nki_kernels.py through trnsim.nki: values against numpy, and cycles
(deterministic, scheduled faster than the program order, what bounds them)."""

import math

import ml_dtypes
import numpy as np
import pytest

import nki_kernels as K
import trnsim.nki as nki

RNG = np.random.default_rng(0)


def bf16(x):
    return np.asarray(x, dtype=np.float32).astype(ml_dtypes.bfloat16)


def rel_err(got, want):
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


@pytest.fixture(scope="module")
def matmul_runs():
    a = RNG.standard_normal((512, 256), dtype=np.float32)
    b = RNG.standard_normal((512, 1024), dtype=np.float32)
    return a, b, {f.__name__: nki.run(f, a, b) for f in (K.tiled_matmul, K.tiled_matmul_legacy)}


def test_tiled_matmul_values_and_cycles(matmul_runs):
    a, b, runs = matmul_runs
    for r in runs.values():
        assert rel_err(r.outputs, a.T @ b) < 1e-6  # fp32 in, fp32 PSUM accumulation
    new, old = runs["tiled_matmul"], runs["tiled_matmul_legacy"]
    # the current API and the legacy one (nl.zeros in PSUM, +=, nl.load/nl.store) emit the same work
    assert new.report.instruction_counts == {"DmaCopy": 36, "MatMul": 16, "TensorCopy": 4}
    assert old.report.instruction_counts == new.report.instruction_counts  # the PSUM memset was folded away
    assert old.report.total_ticks == new.report.total_ticks
    st = new.schedule_stats
    assert st.policy != "program order" and st.ticks < 0.8 * st.as_built_ticks
    assert new.report.matmul_flops == 2 * 512 * 256 * 1024
    assert nki.run(K.tiled_matmul, a, b).report.total_ticks == new.report.total_ticks  # deterministic


def test_tiled_matmul_bf16_and_program_order():
    a, b = bf16(RNG.standard_normal((256, 128))), bf16(RNG.standard_normal((256, 512)))
    r = nki.run(K.tiled_matmul, a, b)
    want = a.astype(np.float32).T @ b.astype(np.float32)
    assert r.outputs.dtype == ml_dtypes.bfloat16 and rel_err(r.outputs, want) < 1e-2
    plain = nki.JitKernel(K.tiled_matmul.fn, schedule=False).run(a, b)
    assert plain.schedule_stats.policy == "program order"
    assert np.array_equal(plain.outputs.view(np.uint16), r.outputs.view(np.uint16))  # same values in any order
    assert plain.report.total_ticks == r.schedule_stats.as_built_ticks >= r.report.total_ticks


def test_fused_softmax_with_a_masked_ragged_tile():
    x = RNG.standard_normal((300, 700), dtype=np.float32)
    r = nki.run(K.fused_softmax, x)
    e = np.exp(x.astype(np.float64) - x.max(1, keepdims=True))
    assert rel_err(r.outputs, e / e.sum(1, keepdims=True)) < 1e-6
    # three row tiles, the last of 44 rows: every instruction of it covers 44 partitions only
    loads = [i for i in r.traced.kernel.instructions if i.describe().startswith("DmaCopy") and i.src.space == "hbm"]
    assert sorted(i.dst.p_count for i in loads) == [44, 128, 128]
    busy = {n: e.active_percent for n, e in r.report.engines.items()}
    assert busy["Scalar"] > 20 and busy["Vector"] > 10


def test_layer_norm():
    x = RNG.standard_normal((256, 1024), dtype=np.float32)
    g, b = RNG.standard_normal(1024, dtype=np.float32), RNG.standard_normal(1024, dtype=np.float32)
    r = nki.run(K.layer_norm, x, g, b)
    mu, var = x.mean(1, keepdims=True), x.var(1, keepdims=True)
    assert rel_err(r.outputs, (x - mu) / np.sqrt(var + 1e-5) * g + b) < 1e-5
    # gamma and beta broadcast to 128 partitions by a stride-0 HBM read: one DMA each
    bcast = [i for i in r.traced.kernel.instructions
             if i.describe().startswith("DmaCopy") and i.src.space == "hbm" and i.src.dims[0][0] == 0]
    assert len(bcast) == 2
    r2 = nki.run(K.layer_norm, x, g, b, eps=1e-2)  # a compile-time argument
    assert rel_err(r2.outputs, (x - mu) / np.sqrt(var + 1e-2) * g + b) < 1e-5


def _attention(q, k, v, causal):
    qf, kf, vf = (z.astype(np.float64) for z in (q, k, v))
    s = qf @ kf.T / math.sqrt(q.shape[1])
    if causal:
        s = np.where(np.tril(np.ones(s.shape, bool)), s, -np.inf)
    p = np.exp(s - s.max(1, keepdims=True))
    return (p / p.sum(1, keepdims=True)) @ vf


@pytest.mark.parametrize("causal", [False, True])
def test_flash_attention_forward(causal):
    q, k, v = (bf16(RNG.standard_normal((1024, 64))) for _ in range(3))
    r = nki.run(K.flash_attention_fwd, q, k, v, causal=causal)
    assert rel_err(r.outputs, _attention(q, k, v, causal)) < 2e-2
    counts = r.report.instruction_counts
    tiles = 8 * 2 if not causal else sum((qt * 128 + 127) // 512 + 1 for qt in range(8))  # (query, key) tile pairs
    assert counts["MatMul"] == tiles * 5  # q.kT and four 128-key p.v chunks per pair
    assert counts.get("AffineSelect", 0) == (8 if causal else 0)  # the diagonal tile of each query tile
    st = r.schedule_stats
    assert st.ticks < 0.5 * st.as_built_ticks  # a plain loop: the scheduling pass overlaps its tiles


def test_causal_is_cheaper():
    q, k, v = (bf16(RNG.standard_normal((1024, 64))) for _ in range(3))
    full = nki.run(K.flash_attention_fwd, q, k, v, causal=False, timing_only=True)
    causal = nki.run(K.flash_attention_fwd, q, k, v, causal=True, timing_only=True)
    assert full.outputs is None
    assert causal.report.total_ticks < full.report.total_ticks


def test_gelu_chain_over_affine_range():
    x = RNG.standard_normal((256, 1100), dtype=np.float32)
    bias = RNG.standard_normal((128, 1), dtype=np.float32)
    r = nki.run(K.gelu_chain, x, bias)
    gelu = np.vectorize(lambda z: 0.5 * z * (1 + math.erf(z / math.sqrt(2))))
    want = gelu(x.astype(np.float64) * 0.5 + np.tile(bias, (2, 1))) * x
    assert rel_err(r.outputs, want) < 1e-6
    # 2 x 3 tiles; the last column tile masked to 76 columns in every instruction
    acts = [i for i in r.traced.kernel.instructions if i.opcode == "Activation"]
    assert sorted(i.data.free_size for i in acts) == [76, 76, 512, 512, 512, 512]
    assert r.report.engines["Scalar"].instructions == 6


def test_spmd_grid_runs_every_program_on_one_core():
    a, b = RNG.standard_normal((256, 1024), dtype=np.float32), RNG.standard_normal((256, 1024), dtype=np.float32)
    r = nki.run(K.add_spmd[2, 2], a, b)
    assert np.array_equal(r.outputs, a + b)
    assert r.report.instruction_counts == {"DmaCopy": 12, "TensorTensor": 4}
    with pytest.raises(nki.NkiError, match=r"^add_spmd\[\(2, 0\)\]: an SPMD grid is positive integers"):
        K.add_spmd[2, 0]
