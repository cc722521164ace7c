"""The TensorE datapath: the numpy definition, and the C core against it bit for bit."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import zlib

import ml_dtypes
import numpy as np
import pytest

import trnsim.native as native
from trnsim.native import dtypes, reference

F32, F16, BF16 = np.float32, np.float16, ml_dtypes.bfloat16
E4M3, E4M3FN, E5M2 = ml_dtypes.float8_e4m3, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2
FLOATS = [F32, F16, BF16, E4M3, E4M3FN, E5M2]
NARROW = [F16, BF16, E4M3, E4M3FN, E5M2]
PAIRS = [(t, t) for t in FLOATS] + [
    (E4M3, E5M2),
    (E5M2, E4M3FN),
    (BF16, F16),
    (F16, E4M3),
    (F32, BF16),
    (E4M3FN, BF16),
]
SHAPES = [(1, 1, 1), (3, 5, 7), (127, 13, 33), (128, 12, 32), (129, 25, 65), (300, 40, 70)]
UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32}


def name(t: type) -> str:
    return np.dtype(t).name


def bits(a: np.ndarray) -> np.ndarray:
    a = np.asarray(a)
    return a.view(UINT[a.dtype.itemsize])


def assert_same_bits(got: np.ndarray, want: np.ndarray) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    g, w = bits(got), bits(want)
    bad = np.argwhere(g != w)
    if len(bad):
        i = tuple(bad[0])
        raise AssertionError(
            f"{len(bad)} of {g.size} elements differ; first at {i}: "
            f"got {got[i]!r} (0x{int(g[i]):x}), want {want[i]!r} (0x{int(w[i]):x})"
        )


def families() -> list[str]:
    return native.kernel_families()


@pytest.fixture(params=["generic", "avx2", "avx512"])
def family(request: pytest.FixtureRequest) -> str:
    if request.param not in families():
        pytest.skip(f"this CPU cannot run the {request.param} kernels")
    return request.param


def check(s: np.ndarray, v: np.ndarray, *, kernels: list[str] | None = None, **kw) -> np.ndarray:
    """Reference result; asserts every native kernel family gives the same bits."""
    out0 = kw.pop("out", None)
    want = reference.matmul(s, v, out=None if out0 is None else out0.copy(), **kw)
    for fam in kernels or families():
        out = None if out0 is None else out0.copy()
        got = native._matmul_native(s, v, out=out, kernel=fam, **kw)
        assert_same_bits(got, want)
    return want


def unfused_differs(s: np.ndarray, v: np.ndarray, want: np.ndarray) -> bool:
    """Whether every family's multiply-then-add kernel gets other bits than ``want``: the data
    can tell a fused MAC from a reverted one."""
    return all(
        (bits(native._matmul_native(s, v, kernel=fam, fma="off")) != bits(want)).any()
        for fam in families()
    )


def randn(rng: np.random.Generator, shape: tuple[int, ...], t: type, scale: float = 1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32).astype(t)


def specials(t: type) -> tuple[np.ndarray, np.ndarray]:
    """Edge values of format t, as t: (zeros, subnormals, extreme normals; NaN and ±Inf)."""
    fi = ml_dtypes.finfo(t)
    vals = [0.0, 1.0, fi.smallest_subnormal, fi.smallest_normal, fi.max, fi.eps]
    vals = [float(x) for x in vals]
    vals += [3 * float(fi.smallest_subnormal), float(fi.max) / 2]
    arr = np.array(vals + [-x for x in vals], dtype=np.float32).astype(t)
    with np.errstate(invalid="ignore"):
        nonfinite = np.array([np.nan, np.inf, -np.inf], dtype=np.float32).astype(t)
    return arr, nonfinite


# --------------------------------------------------------------------------------------------
# The definition itself


def test_chunked_accumulation_order_is_part_of_the_definition():
    # One dot product of [2^24, 1, 1, 1] (s all ones), k in order, fp32:
    #   2^24 + 1 = 16777217 is a tie -> 16777216 (even); + 1 -> 16777216; + 1 -> 16777216.
    # In chunks of 2 (PSUM accumulation group of two instructions):
    #   chunk 0: 2^24 + 1 -> 16777216; chunk 1: 1 + 1 = 2; out = 16777216 + 2 = 16777218.
    # (Exact: 16777219. A "simplified" single dot product or a pairwise sum gets it wrong.)
    s = np.ones((4, 1), dtype=F32)
    v = np.array([[2.0**24], [1.0], [1.0], [1.0]], dtype=F32)
    for mm in (reference.matmul, native.matmul):
        assert mm(s, v, k_chunk=4)[0, 0] == 16777216.0
        assert mm(s, v, k_chunk=2)[0, 0] == 16777218.0
        assert mm(s, v, k_chunk=1)[0, 0] == 16777216.0  # 2^24, +1 tie to even, ...
        out = np.full((1, 1), 2.0, dtype=F32)
        # accumulate: 2 + 16777216 = 16777218, then + 2 = 16777220
        assert mm(s, v, out=out, accumulate=True, k_chunk=2)[0, 0] == 16777220.0


def test_fp32_mac_is_fused():
    # k=0: acc = -(1 + 2^-22). k=1: p = (1 + 2^-23)^2 = 1 + 2^-22 + 2^-46 exactly; a fused MAC
    # keeps the 2^-46 (acc = 2^-46), a rounded product (1 + 2^-22) would cancel to +0.
    e = 2.0**-23
    s = np.array([[1.0], [1 + e]], dtype=F32)
    v = np.array([[-(1 + 2 * e)], [1 + e]], dtype=F32)
    for mm in (reference.matmul, native.matmul):
        assert mm(s, v)[0, 0] == 2.0**-46
    for fam in families():
        assert bits(native._matmul_native(s, v, fma="off", kernel=fam))[0, 0] == 0


def test_accumulator_starts_at_positive_zero():
    # -0 * 1 = -0; +0 + -0 = +0: an accumulator started at -0 (or at the first product)
    # would give -0.
    s = np.array([[-0.0]], dtype=F32)
    v = np.array([[1.0]], dtype=F32)
    for mm in (reference.matmul, native.matmul):
        assert bits(mm(s, v))[0, 0] == 0


def test_nan_results_are_canonical():
    nan_payload = np.array([0xFFC12345], dtype=np.uint32).view(F32)[0]
    s = np.array([[nan_payload, 1.0], [np.inf, 0.0]], dtype=F32)
    v = np.array([[1.0], [0.0]], dtype=F32)  # [NaN*1 + inf*0, 1*1 + 0*0]
    for mm in (reference.matmul, native.matmul):
        r = bits(mm(s, v))
        assert r[0, 0] == reference.CANONICAL_NAN_BITS and r[1, 0] == 0x3F800000


def test_empty_k_is_one_empty_chunk():
    s = np.zeros((0, 3), dtype=BF16)
    v = np.zeros((0, 2), dtype=BF16)
    out = np.full((3, 2), -0.0, dtype=F32)
    want = check(s, v, out=out, accumulate=True)  # -0 + +0 = +0
    assert (bits(want) == 0).all()
    assert (check(s, v) == 0).all()


def test_empty_m_and_n():
    for sm, vn in ((0, 4), (4, 0)):
        s = np.ones((5, sm), dtype=F16)
        v = np.ones((5, vn), dtype=F16)
        assert check(s, v).shape == (sm, vn)


# --------------------------------------------------------------------------------------------
# Native vs reference, bit for bit


@pytest.mark.parametrize("k_chunk", [128, 256])
@pytest.mark.parametrize("st,mt", PAIRS, ids=lambda t: name(t))
def test_random_matches_reference(st, mt, k_chunk):
    rng = np.random.default_rng(zlib.crc32(f"{name(st)} {name(mt)} {k_chunk}".encode()))
    for K, M, N in SHAPES:
        check(randn(rng, (K, M), st), randn(rng, (K, N), mt), k_chunk=k_chunk)


@pytest.mark.parametrize("t", FLOATS, ids=name)
def test_special_values(t):
    rng = np.random.default_rng(7)
    finite, nonfinite = specials(t)
    K, M, N = 200, 19, 37
    for pool, density in ((finite, 0.3), (nonfinite, 0.01)):
        s, v = randn(rng, (K, M), t), randn(rng, (K, N), t)
        for a in (s, v):
            mask = rng.random(a.shape) < density
            a[mask] = rng.choice(pool, size=int(mask.sum()))
        check(s, v)
        check(s, v, k_chunk=64, out=randn(rng, (M, N), F32), accumulate=True)
    # fp8/fp16 maxima everywhere: large but finite sums
    fmax = ml_dtypes.finfo(t).max
    s = np.full((K, M), fmax, dtype=t)
    v = np.where(rng.random((K, N)) < 0.5, fmax, -fmax).astype(t)
    check(s, v)


def test_bf16_products_that_overflow_and_underflow():
    rng = np.random.default_rng(3)
    K, M, N = 256, 14, 33
    big = randn(rng, (K, M), BF16, 1e30)
    check(big, randn(rng, (K, N), BF16, 1e10))  # products ~1e40: Inf, and Inf - Inf = NaN
    tiny = randn(rng, (K, M), BF16, 1e-25)
    check(tiny, randn(rng, (K, N), BF16, 1e-15))  # products ~1e-40: subnormal, inexact
    mixed = randn(rng, (K, M), BF16)
    mixed[200] = BF16(3e-39)  # a bf16 subnormal
    check(mixed, randn(rng, (K, N), BF16))
    # Underflowing products next to a nonzero accumulator: the one case where 16-bit inputs
    # tell a fused MAC from a multiply-then-add.
    s = randn(rng, (K, M), BF16, 1e-20)
    v = randn(rng, (K, N), BF16, 1e-19)
    s[0], v[0] = BF16(1e-38), BF16(1.0)
    assert unfused_differs(s, v, check(s, v))


@pytest.mark.parametrize("st,mt", [p for p in PAIRS if F32 not in p], ids=lambda t: name(t))
def test_narrow_products_are_exact_so_fusing_changes_nothing(st, mt):
    # 16- and 8-bit products fit fp32, so multiply-then-add gives the definition's bits.
    rng = np.random.default_rng(zlib.crc32(f"unfused {name(st)} {name(mt)}".encode()))
    s, v = randn(rng, (200, 19), st), randn(rng, (200, 37), mt)
    want = reference.matmul(s, v)
    for fam in families():
        assert_same_bits(native._matmul_native(s, v, kernel=fam, fma="off"), want)


def test_fp32_macs_are_fused():
    # Random fp32 data is enough to tell a fused MAC from a rounded product, in every family,
    # ragged tiles, chunked, accumulating and not.
    rng = np.random.default_rng(11)
    for K, M, N, kw in ((128, 24, 64, {}), (300, 13, 37, {"k_chunk": 64})):
        s, v = randn(rng, (K, M), F32), randn(rng, (K, N), F32)
        assert unfused_differs(s, v, check(s, v, **kw))
        out = randn(rng, (M, N), F32)
        check(s, v, out=out, accumulate=True, **kw)


def _c_fmaf(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """C's fmaf, one call per element: the oracle for the reference's numpy emulation."""
    fmaf = ctypes.CDLL(None).fmaf
    fmaf.argtypes = [ctypes.c_float] * 3
    fmaf.restype = ctypes.c_float
    r = [fmaf(float(x), float(y), float(z)) for x, y, z in zip(a.ravel(), b.ravel(), c.ravel())]
    return np.array(r, dtype=F32)


def _midpoint_triples(rng: np.random.Generator, n: int, subnormal: bool) -> tuple[np.ndarray, ...]:
    """(a, b, c) where c + a*b is within an fp64 half-ulp of an fp32 midpoint: the sum rounded to
    fp64 lands on the midpoint, and only the TwoSum error says which way fmaf rounds.

    a*b has significand ma*mb = 2^47 + d with |d| < 2^18, scaled to half an ulp of c, so the
    tail d lies below c's fp64 rounding bit. ``subnormal``: c and the result are fp32
    subnormals (ulp 2^-149) in [2^-127, 2^-126), where fp64 rounds at 2^-179, so |d| < 2^16."""
    ma = rng.integers(2**23, 2**24, 32 * n)
    mb = np.rint(2.0**47 / ma).astype(np.int64)
    tail = 2**16 if subnormal else 2**18
    ok = (mb >= 2**23) & (mb < 2**24) & (np.abs(ma * mb - 2**47) < tail)
    ma, mb = ma[ok][:n], mb[ok][:n]
    k = len(ma)
    sign = lambda: rng.choice([-1.0, 1.0], k)  # noqa: E731
    if subnormal:  # a*b ~ 2^47 * 2^-197 = 2^-150
        ta, tb, c = -100, np.full(k, -97), rng.integers(2**22, 2**23, k) * 2.0**-149
    else:  # a*b ~ 2^(t+1), c = 24 bits with ulp 2^(t+2)
        t = rng.integers(-120, 60, k)
        ta, tb, c = t - 23, np.full(k, -23), rng.integers(2**23, 2**24, k) * 2.0 ** (t + 2)
    a = (ma * 2.0**ta * sign()).astype(F32)
    b = (mb * 2.0**tb * sign()).astype(F32)
    return a, b, (c * sign()).astype(F32)


def test_reference_fma32_is_c_fmaf():
    rng = np.random.default_rng(17)
    n = 3000
    a, b, c = (randn(rng, (n,), F32) for _ in range(3))
    exact = (a.astype(np.float64) * b).astype(F32)
    cases = [
        (a, b, c),
        (a, b, -exact),  # cancellation: the result is the product's rounding error
        _midpoint_triples(rng, n, subnormal=False),
        _midpoint_triples(rng, n, subnormal=True),
        # subnormal addends and results
        (
            (rng.integers(1, 2**24, n) * 2.0**-90).astype(F32),
            (rng.integers(1, 2**24, n) * 2.0**-80).astype(F32),
            (rng.integers(-(2**12), 2**12, n) * 2.0**-149).astype(F32),
        ),
        # near and past FLT_MAX, and non-finite operands
        (
            np.array([3.4e38, 3.4e38, -3.4e38, 2.0**64, 2.0**64, np.inf, np.inf, np.nan, 0], F32),
            np.array([1.0000001, 2, 1, 2.0**64 * (1 - 2.0**-24), 2.0**64, 0, 1, 1, np.inf], F32),
            np.array([2.0**103, -3.4e38, -(2.0**103), -(2.0**103), -(2.0**104), 1, -np.inf, 0, 1],
                     F32),
        ),
    ]
    for x, y, z in cases:
        want, got = _c_fmaf(x, y, z), reference.fma32(x, y, z)
        same = (bits(got) == bits(want)) | (np.isnan(got) & np.isnan(want))
        assert same.all(), (x[~same][:3], y[~same][:3], z[~same][:3])
    # The midpoint cases are real: rounding the fp64 sum alone gets many of them wrong.
    for x, y, z in cases[2:4]:
        naive = (z.astype(np.float64) + x.astype(np.float64) * y).astype(F32)
        assert (bits(naive) != bits(_c_fmaf(x, y, z))).sum() > len(x) // 4


def test_every_kernel_family(family):
    rng = np.random.default_rng(13)
    for st, mt in PAIRS:
        for K, M, N in ((129, 25, 65), (64, 24, 64)):
            check(randn(rng, (K, M), st), randn(rng, (K, N), mt), kernels=[family])


def test_strided_and_transposed_views():
    rng = np.random.default_rng(17)
    K, M, N = 150, 30, 45
    base_s = randn(rng, (M * 2, K * 3), BF16)  # transposed, stepped source
    base_v = randn(rng, (K * 2, N * 2), E4M3)
    views_s = [
        base_s[:M, :K].T,  # [K, M] with K contiguous
        base_s[::2, ::3].T,
        base_s[:M, :K].T[::-1],  # negative K stride
        base_s[:M, :K].T[:, ::-1],  # negative M stride
    ]
    views_v = [
        base_v[:K, :N],
        base_v[::2, ::2],
        base_v[:K, :N][::-1, ::-1],
        np.broadcast_to(base_v[0, :N], (K, N)),  # zero K stride
        np.broadcast_to(base_v[:K, :1], (K, N)),  # zero N stride
    ]
    for s in views_s:
        for v in views_v:
            check(s, v)
    s, v = views_s[0], views_v[0]
    base = randn(rng, (3 * M, 4 * N), F32)
    out_views = [
        lambda b: b[::3, ::4],  # strided rows and columns
        lambda b: b[:N, :M].T,  # column-major: computed as the transposed problem
        lambda b: b[M - 1 :: -1, ::-2][:, :N],  # negative strides
        lambda b: b[:M, :N],  # row stride wider than N
    ]
    for make_out in out_views:
        for accumulate in (False, True):
            for fam in families():
                big = base.copy()
                out = make_out(big)
                assert out.shape == (M, N) and not out.flags.c_contiguous
                want = reference.matmul(s, v, out=out.copy(), accumulate=accumulate)
                got = native._matmul_native(s, v, out=out, accumulate=accumulate, kernel=fam)
                assert got is out
                assert_same_bits(out, want)


@pytest.mark.parametrize("backend", ["native", "reference"])
def test_batched_is_each_item_as_matmul_computes_it(monkeypatch, backend):
    if backend == "reference":
        monkeypatch.setenv("TRNSIM_NATIVE", "0")
    rng = np.random.default_rng(23)
    B, K, M, N = 5, 150, 20, 33  # K over one 128-row chunk: each item is an accumulation group
    cases = [
        (randn(rng, (B, K, M), F32), randn(rng, (B, K, N), F32)),
        (randn(rng, (B, M, K), BF16).transpose(0, 2, 1), randn(rng, (N, B, K), F16).transpose(1, 2, 0)),
        (randn(rng, (2 * B, K, M), E4M3)[::2], randn(rng, (B, K, 2 * N), BF16)[:, :, ::2]),
    ]
    for s, v in cases:
        got = native.matmul_batched(s, v)
        assert got.shape == (B, M, N) and got.dtype == np.float32
        for b in range(B):
            assert_same_bits(got[b], reference.matmul(s[b], v[b]))
        out = np.full((B, M, N), np.nan, F32)  # a caller's buffer (the torch bridge's host cache): written whole
        assert native.matmul_batched(s, v, out=out) is out
        assert_same_bits(out, got)
    assert native.matmul_batched(np.zeros((0, K, M), F32), np.zeros((0, K, N), F32)).shape == (0, M, N)
    with pytest.raises(ValueError, match=r"out must be a C-contiguous float32 array of shape \(5, 20, 33\)"):
        native.matmul_batched(*cases[0], out=np.zeros((B, N, M), F32).transpose(0, 2, 1))
    with pytest.raises(ValueError, match=r"must be 3-D with the same B, got shapes \(2, 4, 3\) and \(3, 4, 5\)"):
        native.matmul_batched(np.zeros((2, 4, 3), F32), np.zeros((3, 4, 5), F32))


def test_ragged_tiles_every_family():
    """Every tile edge the kernels special-case: row counts 1..MR+1 (one instance per row
    count), one or two column vectors with masked stores, K over a chunk, accumulate on and
    off, plain and transposed (torch bridge) stationary layouts, fp32 read in place and the
    narrow formats packed."""
    rng = np.random.default_rng(29)
    Ms, Ns, Ks = (1, 5, 11, 12, 13, 25), (1, 7, 15, 16, 17, 31, 32, 33, 48), (1, 17, 129)
    for n_case, (M, N) in enumerate((m, n) for m in Ms for n in Ns):
        K = Ks[n_case % len(Ks)]
        k_chunk = (128, 16)[n_case % 2]
        for t in (F32, BF16, F16, E4M3):
            s = randn(rng, (M, K), t).T if n_case % 3 else randn(rng, (K, M), t)
            v = randn(rng, (K, N), t)
            out = randn(rng, (M, N), F32) if n_case % 4 == 1 else None
            check(s, v, k_chunk=k_chunk, out=out, accumulate=out is not None)


def test_fp32_in_place_and_packed_paths():
    """fp32 stationary is read where it lies, unless its columns are contiguous and more than
    two column panels reuse it (packed); fp32 moving too, unless many row panels revisit
    a wide chunk of it whose rows are a multiple of 1 KiB apart, or its columns are not
    contiguous. Each choice must give the reference's bits."""
    rng = np.random.default_rng(31)
    K, M, N = 130, 600, 100  # moving rows 400 B apart: read in place by 50 row panels
    s, v = randn(rng, (M, K), F32).T, randn(rng, (K, N), F32)
    check(s, v)
    check(s, randn(rng, (K, 256), F32))  # rows 1 KiB apart: packed
    check(s, randn(rng, (K, 32), F32)[:, :24])  # 24 of 32 columns: a partial panel, packed
    check(s, randn(rng, (K, N), BF16))  # fp32 in place beside a packed narrow operand
    check(s, randn(rng, (K, 2 * N), F32)[:, ::2])  # strided moving columns: packed
    wide = randn(rng, (40, 1024), F32)  # 4 KiB between stationary rows
    check(wide[:, :K].T, randn(rng, (K, 80), F32), k_chunk=64)
    check(randn(rng, (K, 12), F32), randn(rng, (K, 16), F32))  # one tile, read in place
    s_cols = randn(rng, (300, 40), F32)  # [K, M] contiguous (x.t() in a weight gradient)
    check(s_cols, randn(rng, (300, 200), F32))  # 3+ column panels in every family: packed
    check(s_cols, randn(rng, (300, 200), F32)[:, :9], k_chunk=64)  # one or two panels: in place
    check(randn(rng, (K, 90), F32)[:, 3:80], randn(rng, (K, 200), F32))  # packed, offset view


def test_k_contiguous_fp32_operands():
    """Transposed views (k contiguous: a row-major a[M, K], a w.t() moving) are packed by
    16 x 16 register transposes on AVX-512: every k remainder mod 16 and ragged panel width."""
    rng = np.random.default_rng(43)
    for K in (1, 15, 16, 17, 130):
        for N in (1, 16, 17, 33, 100):
            s = randn(rng, (13, K), F32).T  # stationary [K, 13], k contiguous
            v = randn(rng, (N, K), F32).T   # moving [K, N], k contiguous: always packed
            check(s, v, k_chunk=64)


def test_column_blocks():
    """Wide N is done in column blocks sized to L2 (64 columns when a chunk has 2048 rows):
    three blocks here, the last ragged."""
    rng = np.random.default_rng(41)
    K, M, N = 2100, 13, 150
    for st, mt in ((F32, F32), (BF16, BF16), (E4M3, F16)):
        check(randn(rng, (M, K), st).T, randn(rng, (K, N), mt), k_chunk=2048)


@pytest.mark.parametrize("threads", ["1", "3", "5"])  # 3: split the batch, 5 > B: the columns
def test_batched_ragged_threads_and_chunks(monkeypatch, threads):
    monkeypatch.setenv("TRNSIM_NATIVE_THREADS", threads)
    rng = np.random.default_rng(37)
    B, K, M, N = 4, 70, 13, 50
    for t in (F32, BF16):
        s = randn(rng, (B, M, K), t).transpose(0, 2, 1)
        v = randn(rng, (B, K, N), t)
        got = native.matmul_batched(s, v, k_chunk=32)
        for b in range(B):
            assert_same_bits(got[b], reference.matmul(s[b], v[b], k_chunk=32))


def test_out_view_writes_only_its_elements():
    rng = np.random.default_rng(19)
    s, v = randn(rng, (40, 13), F16), randn(rng, (40, 35), F16)
    big = np.full((30, 80), 7.0, dtype=F32)
    view = big[1::2, 3::2][:13, :35]
    native.matmul(s, v, out=view)
    mask = np.zeros(big.shape, bool)
    mask[1::2, 3::2][:13, :35] = True
    assert (big[~mask] == 7.0).all()
    assert_same_bits(view, reference.matmul(s, v))


@pytest.mark.parametrize("k_chunk", [1, 7, 128, 256, 1000])
def test_accumulate_into_existing_psum(k_chunk):
    rng = np.random.default_rng(k_chunk)
    s, v = randn(rng, (300, 17), E5M2), randn(rng, (300, 40), BF16)
    out = randn(rng, (17, 40), F32, 100.0)
    out[0, 0], out[1, 1], out[2, 2] = -0.0, np.nan, np.inf
    check(s, v, out=out, accumulate=True, k_chunk=k_chunk)
    check(s, v, out=out, accumulate=False, k_chunk=k_chunk)


def test_threads_give_identical_results():
    rng = np.random.default_rng(23)
    s, v = randn(rng, (300, 50), BF16), randn(rng, (300, 300), BF16)
    one = native._matmul_native(s, v, threads=1)
    for t in (2, 3, 64):
        assert_same_bits(native._matmul_native(s, v, threads=t), one)
    assert_same_bits(one, reference.matmul(s, v))


def test_threads_env(monkeypatch):
    monkeypatch.delenv("TRNSIM_NATIVE", raising=False)
    s = np.ones((3, 2), F16)
    for bad in ("0", "-1", "abc", "65", "1" * 5000):
        monkeypatch.setenv("TRNSIM_NATIVE_THREADS", bad)
        with pytest.raises(ValueError, match=r"^TRNSIM_NATIVE_THREADS='[-0-9a-z]{1,40}'(\.\.\. \(5,000 characters\))?: "
                                             r"expected a whole number of matmul threads, 1\.\.64$"):
            native.matmul(s, s)
    monkeypatch.setenv("TRNSIM_NATIVE_THREADS", "2")
    assert_same_bits(native.matmul(s, s), reference.matmul(s, s))


# --------------------------------------------------------------------------------------------
# Conversions


def _boundary_inputs(t: type) -> np.ndarray:
    """fp32 values at and around every code of t and every midpoint between neighbours."""
    n = 256 if np.dtype(t).itemsize == 1 else 65536
    codes = np.arange(n, dtype=UINT[np.dtype(t).itemsize]).view(t)
    with np.errstate(invalid="ignore", over="ignore"):
        w = codes.astype(F32)
    w = w[np.isfinite(w)]
    w = np.unique(w)
    mids = (w[:-1].astype(np.float64) + w[1:].astype(np.float64)) / 2
    mids = mids[np.abs(mids) < 3.4e38].astype(F32)  # exact: one bit more than t has
    pts = np.concatenate([w, mids]).view(np.uint32)
    around = np.concatenate([pts, pts + 1, pts - 1]).view(F32)
    return around[~np.isnan(around)]


def _sweep_inputs() -> np.ndarray:
    rng = np.random.default_rng(29)
    randoms = rng.integers(0, 2**32, size=2**20, dtype=np.uint32)
    nans = np.array(
        [0x7F800001, 0x7FC00000, 0x7FFFFFFF, 0x7FA00000, 0x7F802000, 0x7F801FFF, 0x7FC12345],
        dtype=np.uint32,
    )
    edges = np.array([0, 1, 0x7FFFFF, 0x800000, 0x7F7FFFFF, 0x7F800000], dtype=np.uint32)
    extra = np.concatenate([nans, edges])
    return np.concatenate([randoms, extra, extra | 0x80000000]).view(F32)


@pytest.mark.parametrize("t", FLOATS, ids=name)
def test_convert_fp32_to_format(t):
    x = np.concatenate([_sweep_inputs(), *[_boundary_inputs(u) for u in NARROW]])
    with np.errstate(invalid="ignore", over="ignore"):
        want = x.astype(t)  # ml_dtypes (numpy for float16): the definition
    assert_same_bits(reference.convert(x, t), want)
    assert_same_bits(native.convert(x, t), want)
    assert_same_bits(native.convert(x, name(t)), want)


@pytest.mark.parametrize("t", NARROW, ids=name)
def test_widen_every_code(t):
    n = 256 if np.dtype(t).itemsize == 1 else 65536
    codes = np.arange(n, dtype=UINT[np.dtype(t).itemsize]).view(t)
    want = codes.astype(F32)
    assert_same_bits(reference.convert(codes, F32), want)
    assert_same_bits(native.convert(codes, "float32"), want)


@pytest.mark.parametrize("src", NARROW, ids=name)
@pytest.mark.parametrize("dst", NARROW, ids=name)
def test_narrow_to_narrow_goes_through_fp32(src, dst):
    n = 256 if np.dtype(src).itemsize == 1 else 65536
    codes = np.arange(n, dtype=UINT[np.dtype(src).itemsize]).view(src)
    want = reference.convert(codes, dst)
    with np.errstate(invalid="ignore", over="ignore"):
        assert_same_bits(want, codes.astype(F32).astype(dst))
    assert_same_bits(native.convert(codes, dst), want)


@pytest.mark.parametrize("t", [E4M3, E4M3FN, E5M2], ids=name)
def test_fp8_round_trip_all_codes(t):
    codes = np.arange(256, dtype=np.uint8).view(t)
    wide = native.convert(codes, F32)
    back = native.convert(wide, t)
    with np.errstate(invalid="ignore"):
        assert_same_bits(back, codes.astype(F32).astype(t))
    finite = ~np.isnan(wide)
    assert_same_bits(back[finite], codes[finite])  # every non-NaN code survives


def test_convert_keeps_shape_and_accepts_views():
    x = np.arange(24, dtype=F32).reshape(2, 3, 4)[:, ::-1, ::2] * 1.37
    for t in NARROW:
        got = native.convert(x, t)
        assert got.shape == (2, 3, 2)
        assert_same_bits(got, reference.convert(x, t))
    assert native.convert(np.float32(3.0), "bf16").shape == ()


# --------------------------------------------------------------------------------------------
# Dispatch, build errors, argument errors


def test_backend_switch(monkeypatch):
    monkeypatch.delenv("TRNSIM_NATIVE", raising=False)
    assert native.backend() == "native"
    monkeypatch.setenv("TRNSIM_NATIVE", "0")
    assert native.backend() == "reference"
    calls = []
    monkeypatch.setattr(reference, "matmul", lambda *a, **k: calls.append("matmul") or "ref")
    monkeypatch.setattr(reference, "convert", lambda *a, **k: calls.append("convert") or "ref")
    s = np.ones((2, 2), F32)
    assert native.matmul(s, s) == "ref" and native.convert(s, "bf16") == "ref"
    assert calls == ["matmul", "convert"]
    monkeypatch.setenv("TRNSIM_NATIVE", "1")
    assert native.backend() == "native"


def test_backend_switch_in_a_fresh_process():
    code = (
        "import numpy as np, trnsim.native as n; "
        "s = np.ones((2, 2), np.float32); "
        "print(n.backend(), n.matmul(s, s)[0, 0])"
    )
    for value, want in (("0", "reference 2.0"), ("1", "native 2.0")):
        env = dict(os.environ, TRNSIM_NATIVE=value)
        out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False
    )
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == want


NOT_BUILT = (
    "trnsim.native._datapath (the C matmul datapath) is not built: run `pip install -e .` "
    "(needs gcc and cffi), or set TRNSIM_NATIVE=0 to use the numpy reference"
)


def test_missing_extension_fails_on_call_not_import():
    # A fresh interpreter in which the compiled module cannot be found.
    code = (
        "import sys, importlib.abc\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name == 'trnsim.native._datapath':\n"
        "            raise ImportError('blocked')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import numpy as np, os, trnsim.native as n\n"
        "s = np.ones((2, 2), np.float32)\n"
        "try:\n"
        "    n.matmul(s, s)\n"
        "except ImportError as e:\n"
        "    print(e)\n"
        "os.environ['TRNSIM_NATIVE'] = '0'\n"
        "print(n.matmul(s, s)[0, 0])\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRNSIM_NATIVE"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [NOT_BUILT, "2.0"]


@pytest.mark.parametrize("mm", [reference.matmul, native.matmul], ids=["reference", "native"])
def test_argument_errors(mm):
    s = np.ones((4, 3), F16)
    v = np.ones((4, 5), BF16)
    cases = [
        (dict(stationary=np.ones(4, F16)), r"^stationary must be 2-D \[K, M\], got shape \(4,\)$"),
        (dict(moving=np.ones((4, 5, 1), F16)), r"^moving must be 2-D \[K, N\], got shape \(4, 5, 1\)$"),
        (
            dict(moving=np.ones((3, 5), F16)),
            r"^stationary and moving must have the same K \(partition\) extent, got 4 and 3$",
        ),
        (
            dict(stationary=np.ones((4, 3))),
            r"^stationary dtype float64 is not a float format: expected one of "
            r"bf16, fp16, fp32, fp8_e4m3, fp8_e4m3fn, fp8_e5m2$",
        ),
        (dict(moving=np.ones((4, 5), np.int8)), r"^moving dtype int8 is not a float format: "),
        (dict(k_chunk=0), r"^k_chunk must be a positive int, got 0$"),
        (dict(k_chunk=1.5), r"^k_chunk must be a positive int, got 1\.5$"),
        (dict(accumulate=True), r"^accumulate=True needs out \(the PSUM tile to add to\)$"),
        (
            dict(out=np.zeros((3, 4), F32)),
            r"^out must be a float32 array of shape \(3, 5\), got float32 \(3, 4\)$",
        ),
        (
            dict(out=np.zeros((3, 5))),
            r"^out must be a float32 array of shape \(3, 5\), got float64 \(3, 5\)$",
        ),
        (dict(out=np.broadcast_to(np.zeros(5, F32), (3, 5))), r"^out must be writeable$"),
    ]
    for overrides, message in cases:
        kw = dict(stationary=s, moving=v)
        kw.update(overrides)
        args = (kw.pop("stationary"), kw.pop("moving"))
        with pytest.raises(ValueError, match=message):
            mm(*args, **kw)
    a = np.zeros((4, 4), F32)
    with pytest.raises(ValueError, match=r"^out must not share memory with stationary or moving$"):
        mm(a, a, out=a)


@pytest.mark.parametrize("conv", [reference.convert, native.convert], ids=["reference", "native"])
def test_convert_errors(conv):
    with pytest.raises(ValueError, match=r"^unknown dtype 'fp64': expected one of bf16, fp16, "):
        conv(np.ones(3, F32), "fp64")
    with pytest.raises(ValueError, match=r"^target dtype int8 is not a float format: "):
        conv(np.ones(3, F32), "int8")
    with pytest.raises(ValueError, match=r"^source dtype float64 is not a float format: "):
        conv(np.ones(3), "bf16")


def test_private_kernel_errors():
    s = np.ones((2, 2), F32)
    with pytest.raises(ValueError, match=r"^unknown kernel family 'sse9': expected one of generic, avx2, avx512$"):
        native._matmul_native(s, s, kernel="sse9")
    with pytest.raises(ValueError, match=r"^unknown fma policy 'maybe': expected one of on, off$"):
        native._matmul_native(s, s, fma="maybe")
    if "avx512" not in families():
        with pytest.raises(ValueError, match=r"^this CPU cannot run the requested kernel family$"):
            native._matmul_native(s, s, kernel="avx512")


# --------------------------------------------------------------------------------------------
# Dtype registry


def test_dtype_registry():
    assert dtypes.get_dtype("bf16") is dtypes.bfloat16
    assert dtypes.get_dtype("BFloat16") is dtypes.bfloat16
    assert dtypes.get_dtype(BF16) is dtypes.bfloat16
    assert dtypes.get_dtype(np.dtype(E4M3FN)) is dtypes.float8_e4m3fn
    assert dtypes.get_dtype(np.float32) is dtypes.float32
    assert dtypes.get_dtype(dtypes.int32) is dtypes.int32
    for alias, canonical in [
        ("fp32", "float32"),
        ("f32", "float32"),
        ("fp16", "float16"),
        ("fp8_e4m3", "float8_e4m3"),
        ("e4m3", "float8_e4m3"),
        ("e4m3fn", "float8_e4m3fn"),
        ("fp8_e5m2", "float8_e5m2"),
        ("int32", "int32"),
        ("u8", "uint8"),
    ]:
        assert dtypes.get_dtype(alias).name == canonical
    d = dtypes.bfloat16
    assert (d.name, d.np_dtype, d.itemsize, d.is_float, d.short) == (
        "bfloat16",
        np.dtype(BF16),
        2,
        True,
        "bf16",
    )
    assert not dtypes.int8.is_float and dtypes.float8_e5m2.itemsize == 1
    assert [x.short for x in dtypes.FLOAT_DTYPES] == [
        "bf16", "fp16", "fp32", "fp8_e4m3", "fp8_e4m3fn", "fp8_e5m2"
    ]
    with pytest.raises(AttributeError):
        d.name = "x"  # type: ignore[misc]


@pytest.mark.parametrize("bad,shown", [("xyz", "'xyz'"), (np.float64, "'float64'"), (None, "None")])
def test_dtype_registry_errors(bad, shown):
    message = (
        f"unknown dtype {shown}: expected one of bf16, fp16, fp32, fp8_e4m3, fp8_e4m3fn, "
        "fp8_e5m2, int8, uint8, int16, int32, uint32"
    )
    with pytest.raises(ValueError) as info:
        dtypes.get_dtype(bad)
    assert str(info.value) == message
