"""The NKI programming model on trnsim: views and index expressions, masks, deferred results
(assignment, += into PSUM), nl.zeros in PSUM, block dims, the nl.* ops and their lowering, and
the new nki.isa instructions through nisa."""

import ml_dtypes
import numpy as np
import pytest

import trnsim.nki as nki
import trnsim.nki.isa as nisa
import trnsim.nki.language as nl

RNG = np.random.default_rng(3)


def ops(run):
    return [i.describe() for i in run.traced.kernel.instructions]


def test_indexing_views_and_mgrid():
    @nki.jit
    def k(x):
        out = nl.ndarray((128, 256), dtype=x.dtype, buffer=nl.shared_hbm)
        g = nl.mgrid[0:128, 0:256]
        t = nl.load(x[1, g.p, g.x + 256])            # an integer, then index arrays with an offset
        u = nl.ndarray((128, 256), dtype=x.dtype, buffer=nl.sbuf)
        u[:, 0:128] = t[:, nl.ds(128, 128)]          # a deferred copy writes into the view
        u[:, 128:256] = t[:, 0:256:2]                # a strided view
        nl.store(out, value=u)
        return out

    x = RNG.standard_normal((2, 128, 512), dtype=np.float32)
    r = nki.run(k, x)
    want = np.concatenate([x[1, :, 256 + 128:512], x[1, :, 256:512:2]], axis=1)
    assert np.array_equal(r.outputs, want)
    assert ops(r).count("TensorCopy") == 2  # the two assignments copy, nothing more


def test_on_chip_integer_index_keeps_the_partition_dim():
    seen = {}

    @nki.jit
    def k(x):
        t = nl.load(x)
        seen["p0"] = t[0, :].shape
        seen["col"] = t[:, 3].shape
        seen["h"] = x[0].shape
        out = nl.ndarray((128, 1), dtype=x.dtype, buffer=nl.shared_hbm)
        nl.store(out, value=nl.copy(t[:, 3]))
        return out

    x = RNG.standard_normal((128, 8), dtype=np.float32)
    r = nki.run(k, x)
    assert seen == {"p0": (1, 8), "col": (128, 1), "h": (8,)}
    assert np.array_equal(r.outputs, x[:, 3:4])


def test_masks_restrict_every_operand():
    @nki.jit
    def k(x):
        out = nl.ndarray((64, 256), dtype=x.dtype, buffer=nl.shared_hbm)
        i_p = nl.arange(128)[:, None]
        i_f = nl.arange(512)[None, :]
        t = nl.load(x[i_p, i_f])
        sq = nl.square(t, mask=(i_p < 64) & (i_f < 256))
        nl.store(out[i_p, i_f], value=sq[i_p, i_f], mask=(i_p < 64) & (i_f < 256))
        return out

    x = RNG.standard_normal((128, 512), dtype=np.float32)
    r = nki.run(k, x)
    assert np.array_equal(r.outputs, np.square(x[:64, :256]))
    act = next(i for i in r.traced.kernel.instructions if i.opcode == "Activation")
    assert (act.data.p_count, act.data.free_size) == (64, 256)  # the cost of the masked box only


def test_psum_zeros_plus_equals_matmul_folds_the_memset():
    @nki.jit
    def k(a, b):
        out = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.shared_hbm)
        acc = nl.zeros((128, 512), dtype=nl.float32, buffer=nl.psum)
        for i in nl.affine_range(2):
            acc += nisa.nc_matmul(nl.load(a[i * 128:(i + 1) * 128, :]), nl.load(b[i * 128:(i + 1) * 128, :]))
        half = nl.zeros((128, 512), dtype=nl.float32, buffer=nl.psum)
        half[:, 0:256] += nisa.nc_matmul(nl.load(a[0:128, :]), nl.load(b[0:128, 0:256]))
        res = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.sbuf)
        res[...] = nl.add(nl.copy(acc), nl.copy(half))
        nl.store(out, value=res)
        return out

    a, b = RNG.standard_normal((256, 128), dtype=np.float32), RNG.standard_normal((256, 512), dtype=np.float32)
    r = nki.run(k, a, b)
    half = np.zeros((128, 512))
    half[:, :256] = a[:128].T @ b[:128, :256]
    assert np.allclose(r.outputs, a.T @ b + half, rtol=1e-5, atol=1e-4)
    mms = [i for i in r.traced.traced.instructions if i.opcode == "MatMul"]
    assert [m.accumulate for m in mms] == [False, True, True]  # the half tile keeps zeros elsewhere...
    assert ops(r).count("Memset") == 1                           # ...so its memset stays; acc's folds away


def test_block_dims_with_par_dim():
    @nki.jit
    def k(x):
        out = nl.ndarray((2, 128, 64), dtype=x.dtype, buffer=nl.shared_hbm)
        t = nl.ndarray((2, nl.par_dim(128), 64), dtype=x.dtype, buffer=nl.sbuf)
        for i in nl.affine_range(2):
            t[i] = nl.load(x[i])
            t[i] = nl.multiply(t[i], float(i + 1))
        for i in nl.affine_range(2):
            nl.store(out[i], value=t[i])
        return out

    x = RNG.standard_normal((2, 128, 64), dtype=np.float32)
    assert np.array_equal(nki.run(k, x).outputs, x * np.array([1, 2], np.float32)[:, None, None])


def test_nl_ops_lower_to_their_engines():
    @nki.jit
    def k(x, w):
        out = nl.ndarray(x.shape, dtype=nl.float32, buffer=nl.shared_hbm)
        t = nl.load(x)
        s = nl.softmax(t, axis=1)
        n = nl.rms_norm(t, nl.load(w), axis=1, n=x.shape[1])
        y = nl.where(nl.greater(t, 0.0), s, n)
        z = nl.maximum(nl.exp(y), nl.mean(t, axis=1))
        nl.store(out, value=z)
        return out

    x = RNG.standard_normal((128, 256), dtype=np.float32)
    w = RNG.standard_normal((128, 256), dtype=np.float32)
    r = nki.run(k, x, w)
    e = np.exp(x - x.max(1, keepdims=True))
    soft = e / e.sum(1, keepdims=True)
    rms = x / np.sqrt((x * x).mean(1, keepdims=True) + 1e-6) * w
    want = np.maximum(np.exp(np.where(x > 0, soft, rms)), x.mean(1, keepdims=True))
    assert np.allclose(r.outputs, want, rtol=2e-5, atol=1e-6)
    by_engine = {n: e.instructions for n, e in r.report.engines.items()}
    assert by_engine["Scalar"] >= 4 and by_engine["Vector"] >= 8
    assert "CopyPredicated" in ops(r)  # nl.where selects with the predicated copy


def test_matmul_and_transpose_of_nl():
    @nki.jit
    def k(a, b):
        out = nl.ndarray((128, 128), dtype=nl.float32, buffer=nl.shared_hbm)
        prod = nl.matmul(nl.load(a), nl.load(b))  # transpose_x=False: a transposed on the PE array first
        nl.store(out, value=nl.copy(nl.transpose(nl.copy(prod))))
        return out

    a, b = RNG.standard_normal((128, 64), dtype=np.float32), RNG.standard_normal((64, 128), dtype=np.float32)
    r = nki.run(k, a, b)
    assert np.allclose(r.outputs, (a @ b).T, rtol=1e-5, atol=1e-4)
    assert ops(r).count("Transpose") == 2 and ops(r).count("MatMul") == 1


def test_shared_identity_constant_and_expand_dims():
    @nki.jit
    def k(x):
        out = nl.ndarray((128, 128), dtype=nl.float32, buffer=nl.shared_hbm)
        eye = nl.shared_identity_matrix(128, dtype=nl.float32)
        c = nl.load(nl.shared_constant(np.full((128, 128), 2.0, np.float32)))
        t = nl.load(x)
        nl.store(out, value=nl.add(nl.multiply(eye, c), t))
        return out

    x = RNG.standard_normal((128, 128), dtype=np.float32)
    assert np.array_equal(nki.run(k, x).outputs, x + 2 * np.eye(128, dtype=np.float32))


def test_no_reorder_and_depends_on_keep_program_order():
    @nki.jit
    def k(x):
        out = nl.ndarray((2, 128, 512), dtype=x.dtype, buffer=nl.shared_hbm)
        with nl.no_reorder():
            for i in nl.affine_range(2):
                nl.store(out[i], value=nl.exp(nl.load(x[i])))
        return out

    x = RNG.standard_normal((2, 128, 512), dtype=np.float32)
    r = nki.run(k, x)
    assert r.traced.kernel.schedule_origin == sorted(r.traced.kernel.schedule_origin)
    assert np.allclose(r.outputs, np.exp(x), rtol=1e-6)

    @nki.jit
    def k2(x):
        out = nl.ndarray((128, 512), dtype=x.dtype, buffer=nl.shared_hbm)
        a, b = nl.ndarray((128, 512), dtype=x.dtype, buffer=nl.sbuf), nl.ndarray((128, 512), dtype=x.dtype, buffer=nl.sbuf)
        la = nisa.dma_copy(dst=a, src=x)
        lb = nisa.dma_copy(dst=b, src=x)
        lb.depends_on(la)
        nisa.tensor_tensor(dst=a, data1=a, data2=b, op=nl.add)
        nisa.dma_copy(dst=out, src=a)
        return out

    r2 = nki.run(k2, x[0])
    assert np.array_equal(r2.outputs, x[0] + x[0])
    assert r2.traced.kernel.schedule_origin.index(0) < r2.traced.kernel.schedule_origin.index(1)


def test_new_isa_through_nisa():
    @nki.jit
    def k(a, b, lo, hi, pred):
        out = nl.ndarray((4, 128, 256), dtype=nl.float32, buffer=nl.shared_hbm)
        ta, tb, tlo, thi = nl.load(a), nl.load(b), nl.load(lo), nl.load(hi)
        scan = nisa.tensor_tensor_scan(ta, tb, initial=0.0, op0=np.multiply, op1=np.add)
        stt = nisa.scalar_tensor_tensor(data=ta, op0=nl.subtract, operand0=tlo, op1=nl.multiply, operand1=tb)
        rs = nisa.range_select(on_true_tile=ta, comp_op0=nl.greater_equal, comp_op1=nl.less, bound0=tlo, bound1=thi,
                               range_start=0)
        sel = nl.ndarray((128, 256), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=sel, src=tb)
        nisa.tensor_copy_predicated(dst=sel, src=ta, predicate=nl.load(pred))
        for i, t in enumerate((scan, stt, rs, sel)):
            nl.store(out[i], value=t)
        return out

    a, b = RNG.random((128, 256), dtype=np.float32), RNG.random((128, 256), dtype=np.float32)
    lo = RNG.integers(0, 100, (128, 1)).astype(np.float32)
    hi = lo + 50
    pred = (RNG.random((128, 256)) < 0.5).astype(np.uint8)
    r = nki.run(k, a, b, lo, hi, pred)
    scan = np.empty_like(a)
    prev = np.zeros(128, np.float32)
    for i in range(256):
        prev = scan[:, i] = (a[:, i] * prev).astype(np.float32) + b[:, i]
    idx = np.arange(256, dtype=np.float32)[None, :]
    want = [scan, ((a - lo).astype(np.float32) * b).astype(np.float32),
            np.where((idx >= lo) & (idx < hi), a, np.float32(-3.4028234663852886e38)), np.where(pred != 0, a, b)]
    for got, w in zip(r.outputs, want):
        assert np.array_equal(got, w)


def test_dma_transpose_and_load_transpose2d():
    @nki.jit
    def k(x):
        out = nl.ndarray((2, 128, 256), dtype=x.dtype, buffer=nl.shared_hbm)
        nl.store(out[0], value=nl.load_transpose2d(x))
        t = nl.ndarray((128, 256), dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_transpose(dst=t, src=x)
        nl.store(out[1], value=t)
        return out

    x = RNG.standard_normal((256, 128), dtype=np.float32).astype(ml_dtypes.bfloat16)
    r = nki.run(k, x)
    assert np.array_equal(r.outputs[0].view(np.uint16), np.ascontiguousarray(x.T).view(np.uint16))
    assert r.report.instruction_counts["DmaTranspose"] == 2


def test_mx_matmul_through_nisa_on_trn3():
    @nki.jit(config="trn3")
    def k(st, mv, sst, smv):
        out = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.shared_hbm)
        acc = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.psum)
        a = nl.load(st.view(nl.float8_e4m3fn_x4))  # packed data arrives as uint32, as NKI users pass uint8
        b = nl.load(mv.view(nl.float8_e5m2_x4))
        nisa.nc_matmul_mx(dst=acc, stationary=a, moving=b, stationary_scale=nl.load(sst), moving_scale=nl.load(smv))
        nl.store(out, value=nl.copy(acc))
        return out

    one = ml_dtypes.float8_e4m3fn(1.0).view(np.uint8)
    st = np.full((128, 128), int(one) * 0x01010101, np.uint32)  # four 1.0 values per element
    mv = np.full((128, 512), int(ml_dtypes.float8_e5m2(1.0).view(np.uint8)) * 0x01010101, np.uint32)
    ss, sm = np.full((128, 128), 127, np.uint8), np.full((128, 512), 128, np.uint8)  # scales 1 and 2
    r = nki.run(k, st, mv, ss, sm)
    assert np.array_equal(r.outputs, np.full((128, 512), 512 * 2.0, np.float32))  # K = 512 ones, times 2


def test_free_dims_broadcast_in_binary_ops_and_a_mismatch_says_so():
    """nl.add of [128, 4, 16] and [128, 1, 16] was refused as 'nl.all is not supported': the
    broadcast check called all(), which in this module is the unsupported nl.all (found by a
    hunt); a true mismatch got the same line."""
    import trnsim.nki as nki_mod
    import trnsim.nki.language as nl_mod

    @nki_mod.jit
    def add(x, y):
        out = nl_mod.ndarray(x.shape, dtype=x.dtype, buffer=nl_mod.shared_hbm)
        nl_mod.store(out, value=nl_mod.add(nl_mod.load(x), nl_mod.load(y)))
        return out

    x, y = np.ones((128, 4, 16), np.float32), np.arange(16, dtype=np.float32).reshape(1, 1, 16).repeat(128, 0)
    assert np.array_equal(add(x, y), x + y)
    with pytest.raises(nki_mod.NkiError, match=r"nl\.add: cannot broadcast shapes \(128, 64\) and \(128, 65\)$"):
        add(np.ones((128, 64), np.float32), np.ones((128, 65), np.float32))


# ---- an NKI values hunt's findings ------------------------------------------------------------
def test_assigning_a_matmul_overwrites_and_plus_equals_adds_to_any_earlier_write():
    """``res[...] = nc_matmul`` into a PSUM tile an earlier matmul wrote overwrote nothing (it
    added); ``acc += nc_matmul`` onto what a memset, a copy or a vector op left in PSUM dropped
    it (only earlier matmuls counted)."""
    @nki.jit
    def k(x, y, b):
        out = nl.ndarray((4, 128, 64), dtype=nl.float32, buffer=nl.shared_hbm)
        res = nl.ndarray((128, 64), dtype=nl.float32, buffer=nl.psum)
        for o in nl.sequential_range(2):
            res[...] = nisa.nc_matmul(nl.load(x[o]), nl.load(y))
            nl.store(out[o], nl.copy(res))
        acc = nl.full((128, 64), 1.0, dtype=nl.float32, buffer=nl.psum)
        acc += nisa.nc_matmul(nl.load(x[0]), nl.load(y))
        nl.store(out[2], acc)
        acc2 = nl.zeros((128, 64), dtype=nl.float32, buffer=nl.psum)
        acc2 += nl.load(b)
        acc2 += nisa.nc_matmul(nl.load(x[1]), nl.load(y))
        nl.store(out[3], acc2)
        return out

    x = RNG.standard_normal((2, 128, 128)).astype(np.float32)
    y = RNG.standard_normal((128, 64)).astype(np.float32)
    b = RNG.standard_normal((128, 64)).astype(np.float32)
    mm = [x[o].T.astype(np.float64) @ y for o in range(2)]
    want = np.stack([mm[0], mm[1], mm[0] + 1.0, mm[1] + b])
    np.testing.assert_allclose(k(x, y, b), want, rtol=1e-4, atol=1e-3)


def test_mixed_dtypes_promote_and_fractional_scalars_stay_fractional():
    """NKI's type promotion (a tile of each dtype, a weakly typed Python number) and fp32
    arithmetic wherever an operand is fractional: the result took the first tile's dtype, and an
    int tile times 0.5 cut the 0.5 to 0."""
    @nki.jit
    def k(a, i, h, c):
        o = nl.ndarray((4,) + a.shape, dtype=nl.float32, buffer=nl.shared_hbm)
        oi = nl.ndarray((2,) + a.shape, dtype=nl.int32, buffer=nl.shared_hbm)
        ta, ti, th = nl.load(a), nl.load(i), nl.load(h)
        s = nl.add(th, ta)           # bf16 + fp32 -> fp32
        t = nl.add(ti, ta)           # int32 + fp32 -> fp32
        u = nl.multiply(ti, 0.5)     # int32 * weak float -> fp32
        v = nl.multiply(th, 3)       # bf16 * weak int -> bf16
        assert (str(s.dtype), str(t.dtype), str(u.dtype), str(v.dtype)) == ("float32", "float32", "float32", "bfloat16")
        nl.store(o[0], s)
        nl.store(o[1], t)
        nl.store(o[2], u)
        nl.store(o[3], v)
        nl.store(oi[0], nisa.tensor_scalar(ti, nl.multiply, 2.6, dtype=nl.int32))
        nl.store(oi[1], nisa.tensor_scalar(ti, nl.multiply, nl.load(c), dtype=nl.int32))
        return o, oi

    a = (RNG.standard_normal((128, 16)) * 0.37).astype(np.float32)
    i = np.tile(np.arange(1, 17, dtype=np.int32), (128, 1))
    h = RNG.standard_normal((128, 16)).astype(ml_dtypes.bfloat16)
    c = np.full((128, 1), 0.5, np.float32)
    got, goti = k(a, i, h, c)
    hf = h.astype(np.float32)
    np.testing.assert_array_equal(got[0], hf + a)
    np.testing.assert_array_equal(got[1], i.astype(np.float32) + a)
    np.testing.assert_array_equal(got[2], i * np.float32(0.5))
    np.testing.assert_array_equal(got[3], (hf * 3).astype(ml_dtypes.bfloat16).astype(np.float32))
    np.testing.assert_array_equal(goti[0], np.rint(i.astype(np.float32) * np.float32(2.6)).astype(np.int32))
    np.testing.assert_array_equal(goti[1], np.rint(i.astype(np.float32) * np.float32(0.5)).astype(np.int32))


def test_where_takes_any_non_zero_condition_as_true():
    @nki.jit
    def k(c):
        out = nl.ndarray(c.shape, dtype=nl.float32, buffer=nl.shared_hbm)
        nl.store(out, nl.where(nl.load(c), 10.0, -10.0))
        return out

    c = np.tile(np.array([0.3, -2.0, 1.0, 0.0, 0.5, -0.4, 7.0, np.nan], np.float32), (128, 1))
    np.testing.assert_array_equal(k(c), np.where(c != 0, 10.0, -10.0).astype(np.float32))
