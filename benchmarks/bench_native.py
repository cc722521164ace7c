"""Native TensorE datapath vs numpy's float32 matmul, single-threaded.

Prints the GFLOP/s (2*M*N*K / seconds, median of a few repeats) of

- the C core on bf16 inputs with fp32 accumulation, k_chunk=128 (the definition's chunked PSUM
  accumulation, bit-identical to trnsim.native.reference), 1024 x 1024 x 1024;
- the same with a multiply-then-add kernel (two instructions per MAC instead of one FMA: what
  the datapath cost before its MACs were defined as fused), fp8 with k_chunk=256, and fp32
  inputs (fused MACs, like every dtype);
- numpy ``a @ b`` on float32 arrays of the same shape: the baseline;

and the ratio native/numpy (goal: >= 0.5x). It also checks a slice of the native result against
the reference, so the number is for a correct result.

Then the shapes of a training step on the torch device (fp32 ``a[M, K] @ b[K, N]``, batched
attention-head matmuls), each through the public entry points the torch bridge calls
(``native.matmul(a.T, b)``, ``native.matmul_batched``: Python overhead included) against
numpy ``a @ b`` on the same arrays in the same run. Every MAC is one fused multiply-add, as in
BLAS, but in the definition's fixed k order with a fresh accumulator per 128-row chunk.

How it was run (see the closing report of the change that added it)::

    pip install -e .                             # builds trnsim/native/_datapath
    python benchmarks/bench_native.py            # 1024^3 and the training shapes, a few seconds
    python benchmarks/bench_native.py --quick    # 256^3 and fewer repeats, under a second

Before importing numpy the script pins every thread pool to one thread (OPENBLAS_NUM_THREADS,
OMP_NUM_THREADS, MKL_NUM_THREADS; threadpoolctl too when it is installed) and removes
OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE / OPENBLAS_VERBOSE from its environment: some machines set
them, and a forced core type makes OpenBLAS run a slower kernel (e.g. Haswell instead of
SkylakeX), which would flatter the ratio. It prints which OpenBLAS kernel numpy runs and which
variables it removed; ``--keep-blas-env`` keeps them.
"""

from __future__ import annotations

import argparse
import os
import sys

from _args import whole  # (the script beside this one)

_BLAS_OVERRIDES = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "OPENBLAS_VERBOSE")
_THREAD_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="256^3 instead of 1024^3")
    p.add_argument("--size", type=whole(1, 8192), default=None, help="M = N = K (default 1024)")
    p.add_argument("--repeats", type=whole(1, 1000), default=None, help="timed runs per case (median; default 7, 3 with --quick)")
    p.add_argument(
        "--keep-blas-env",
        action="store_true",
        help="keep OPENBLAS_CORETYPE/OPENBLAS_L2_SIZE if the environment sets them",
    )
    return p.parse_args()


ARGS = _parse()
REMOVED = []
if not ARGS.keep_blas_env:
    for _name in _BLAS_OVERRIDES:
        if _name in os.environ:
            REMOVED.append(f"{_name}={os.environ.pop(_name)}")
for _name in _THREAD_VARS:
    os.environ[_name] = "1"
os.environ["TRNSIM_NATIVE_THREADS"] = "1"

import ctypes  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

import trnsim.native as native  # noqa: E402
from trnsim.native import reference  # noqa: E402

try:  # optional: belt and braces for the thread count
    from threadpoolctl import threadpool_limits  # type: ignore[import-not-found]

    threadpool_limits(1)
except ImportError:
    pass


def openblas_kernel() -> str:
    """The OpenBLAS core numpy's BLAS runs ("SkylakeX", "Haswell", ...), if it can be asked."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "openblas" in line.lower()}
    except OSError:
        return "unknown"
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for sym in (
            "scipy_openblas_get_corename64_",
            "scipy_openblas_get_corename",
            "openblas_get_corename64_",
            "openblas_get_corename",
        ):
            fn = getattr(lib, sym, None)
            if fn is not None:
                fn.restype = ctypes.c_char_p
                return f"OpenBLAS {fn().decode()} ({os.path.basename(path)})"
    return "not OpenBLAS (or unknown)"


def gflops(fn, flops: float, repeats: int) -> float:
    fn()  # warm up: page in buffers, load code
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return flops / statistics.median(times) / 1e9


def main() -> int:
    n = ARGS.size or (256 if ARGS.quick else 1024)
    repeats = ARGS.repeats or (3 if ARGS.quick else 7)
    flops = 2.0 * n * n * n
    rng = np.random.default_rng(0)
    a32 = rng.standard_normal((n, n), dtype=np.float32)
    b32 = rng.standard_normal((n, n), dtype=np.float32)
    s_bf16 = a32.astype(ml_dtypes.bfloat16)  # stationary [K, M]
    v_bf16 = b32.astype(ml_dtypes.bfloat16)  # moving [K, N]
    s_fp8 = (a32 * 8).astype(ml_dtypes.float8_e4m3)
    v_fp8 = (b32 * 8).astype(ml_dtypes.float8_e4m3)
    out = np.empty((n, n), dtype=np.float32)

    print(f"trnsim native datapath: M = N = K = {n}, single thread, median of {repeats}")
    print(f"numpy {np.__version__}; numpy BLAS: {openblas_kernel()}")
    print(f"removed from the environment: {', '.join(REMOVED) if REMOVED else 'nothing'}")
    print(f"native kernel family: {native.kernel_families()[-1]}")

    def nat(s, v, k_chunk=128, fma="on"):
        return lambda: native._matmul_native(s, v, out=out, k_chunk=k_chunk, fma=fma, threads=1)

    rows = [
        ("native bf16 in, fp32 acc, k_chunk=128", nat(s_bf16, v_bf16)),
        ("native bf16, k_chunk=128, unfused kernel", nat(s_bf16, v_bf16, fma="off")),
        ("native fp8_e4m3, k_chunk=256", nat(s_fp8, v_fp8, k_chunk=256)),
        ("native fp32 (fused MACs), k_chunk=128", nat(a32, b32)),
        ("numpy float32 a @ b (baseline)", lambda: np.matmul(a32, b32)),
    ]
    results = {}
    for label, fn in rows:
        results[label] = gflops(fn, flops, repeats)
        print(f"  {label:<42} {results[label]:8.1f} GFLOP/s")
    ratio = results[rows[0][0]] / results[rows[-1][0]]
    print(f"ratio native bf16 / numpy fp32: {ratio:.2f}x (goal >= 0.5x)")
    ok = training_shapes(rng, 20 if ARGS.quick else 200)

    # The number is only worth having for the right answer: compare 8 columns bit for bit
    # (columns are independent, so a slice of moving gives the same columns).
    got = native._matmul_native(s_bf16, v_bf16, threads=1)[:, :8]
    want = reference.matmul(s_bf16, v_bf16[:, :8])
    same = np.array_equal(got.view(np.uint32), want.view(np.uint32))
    print(f"check vs reference (8 columns): {'bit-identical' if same else 'MISMATCH'}")
    return 0 if same and ok else 1


#: (batch, M, K, N): a[M, K] @ b[K, N] as the torch device computes linear/mm/bmm values.
TRAINING_SHAPES = [
    (1, 512, 128, 384),
    (1, 512, 384, 128),
    (1, 512, 128, 512),
    (1, 64, 64, 16),
    (32, 64, 64, 16),
]


def training_shapes(rng: np.random.Generator, small_repeats: int) -> bool:
    """Time each training-step shape (fp32) native vs numpy; True if every result matched
    the reference bit for bit."""
    print("training-step shapes, fp32 a[M,K] @ b[K,N] through the public API (median):")
    print(f"  {'shape':<18} {'native GFLOP/s':>15} {'numpy GFLOP/s':>14} {'native us':>10} {'ratio':>6}")
    ok = True
    for batch, m, k, n in TRAINING_SHAPES:
        a = rng.standard_normal((batch, m, k), dtype=np.float32)
        b = rng.standard_normal((batch, k, n), dtype=np.float32)
        flops = 2.0 * batch * m * k * n
        repeats = small_repeats if flops < 1e7 else 15
        if batch == 1:
            a2, b2 = a[0], b[0]
            nat = lambda: native.matmul(a2.T, b2)  # noqa: E731 - the torch bridge's call
            ref = lambda: a2 @ b2  # noqa: E731
            got, want = nat(), reference.matmul(a2.T, b2)
            label = f"{m}x{k}x{n}"
        else:
            at = a.transpose(0, 2, 1)
            nat = lambda: native.matmul_batched(at, b)  # noqa: E731
            ref = lambda: a @ b  # noqa: E731
            got = nat()
            want = np.stack([reference.matmul(at[i], b[i]) for i in range(batch)])
            label = f"{batch} x {m}x{k}x{n}"
        ok = ok and np.array_equal(got.view(np.uint32), want.view(np.uint32))
        g_nat, g_np = gflops(nat, flops, repeats), gflops(ref, flops, repeats)
        print(f"  {label:<18} {g_nat:15.1f} {g_np:14.1f} {flops / g_nat / 1e3:10.1f} {g_nat / g_np:5.2f}x")
    print(f"training shapes vs reference: {'bit-identical' if ok else 'MISMATCH'}")
    return ok


if __name__ == "__main__":
    sys.exit(main())
