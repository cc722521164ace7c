"""The TensorE matmul datapath: a C core, with the numpy definition beside it.

:mod:`trnsim.native.reference` defines the numbers (read its docstring for the rules); the C core
(``trnsim.native._datapath``, built by ``pip install -e .`` through cffi) computes the same bits
faster. The functions here dispatch to the C core unless the environment variable
``TRNSIM_NATIVE=0`` is set, in which case they call the reference. The variable is read at each
call. ``TRNSIM_NATIVE_THREADS=n`` lets the C core split one matmul's output columns over n
threads (n in 1..64, default 1; the result is identical for every n; anything else is a
one-line ConfigError).

If the C core was not built, importing this package still works; calling into it raises an
ImportError that says how to build it.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from trnsim.config import env_int
from trnsim.native import dtypes, reference
from trnsim.native.dtypes import Dtype, get_dtype
from trnsim.native.reference import check_operands

__all__ = ["matmul", "matmul_batched", "conv2d_grouped", "convert", "backend", "reference", "dtypes", "Dtype", "get_dtype",
           "batched_entry"]

try:
    from trnsim.native import _datapath  # type: ignore[attr-defined]

    _IMPORT_ERROR: ImportError | None = None
except ImportError as exc:  # not built: fine until someone calls into it
    _datapath = None
    _IMPORT_ERROR = exc

_NOT_BUILT = (
    "trnsim.native._datapath (the C matmul datapath) is not built: run `pip install -e .` "
    "(needs gcc and cffi), or set TRNSIM_NATIVE=0 to use the numpy reference"
)

# Element-format codes of datapath.h.
_CODES = {
    "float32": 0,
    "float16": 1,
    "bfloat16": 2,
    "float8_e4m3": 3,
    "float8_e4m3fn": 4,
    "float8_e5m2": 5,
}
# The same codes keyed by numpy dtype: ``dtype.name`` costs ~2 us, a dict lookup ~0.1 us, and
# a small matmul's whole C call is a few us.
_CODE_OF = {get_dtype(name).np_dtype: code for name, code in _CODES.items()}
_ISAS = {"generic": 0, "avx2": 1, "avx512": 2}
_FMA_POLICIES = {"on": 1, "off": 0}
_C_ERRORS = {
    1: "unsupported dtype code",
    2: "out of memory",
    4: "could not start a thread",
    5: "invalid argument",
}


def backend() -> str:
    """``"reference"`` if ``TRNSIM_NATIVE=0`` is set, else ``"native"``."""
    return "reference" if os.environ.get("TRNSIM_NATIVE", "").strip() == "0" else "native"


def _lib() -> Any:
    if _datapath is None:
        raise ImportError(_NOT_BUILT) from _IMPORT_ERROR
    return _datapath.lib


MAX_THREADS = 64  # the C core's own cap (datapath.c); more would be ignored, so it is refused


def _threads() -> int:
    raw = os.environ.get("TRNSIM_NATIVE_THREADS")
    if raw is None:  # the common case, without the parsing (a small matmul costs a few us)
        return 1
    return env_int("TRNSIM_NATIVE_THREADS", 1, 1, MAX_THREADS, "a whole number of matmul threads")


def check_env() -> None:
    """Refuse a bad ``TRNSIM_NATIVE_THREADS`` now (a one-line ConfigError), not inside a run."""
    _threads()


def kernel_families() -> list[str]:
    """The C kernel families this CPU can run, best last (``["generic", "avx2", "avx512"]``)."""
    best = _lib().trn_best_isa()
    return [name for name, code in _ISAS.items() if code <= best]


def _operand(a: np.ndarray) -> tuple[np.ndarray, int, int]:
    """(array to pass, element stride of axis 0, element stride of axis 1); copies only an
    array whose strides are not whole elements."""
    item = a.itemsize
    st0, st1 = a.strides
    if st0 % item or st1 % item:
        a = np.ascontiguousarray(a)
        st0, st1 = a.strides
    return a, st0 // item, st1 // item


def _address(a: np.ndarray, ctype: str = "char[]") -> Any:
    """A cdata pointing at ``a``'s first element, kept alive with it.

    ``ffi.from_buffer`` takes ~0.2 us where ``a.ctypes.data`` takes ~1 us (three of those
    were a fifth of a 64x64x16 matmul); it needs a C-contiguous buffer, which a transposed
    view (the torch bridge's stationary operand) gives through ``a.T``.
    """
    ffi = _datapath.ffi
    if a.flags.c_contiguous:
        return ffi.from_buffer(ctype, a)
    if a.ndim == 2 and a.T.flags.c_contiguous:
        return ffi.from_buffer(ctype, a.T)
    return ffi.cast(ctype.replace("[]", " *"), a.ctypes.data)


def _raise_c_error(rc: int) -> None:
    if rc == 3:
        raise ValueError("this CPU cannot run the requested kernel family")
    if rc == 2:
        raise MemoryError("trnsim.native: out of memory packing matmul operands")
    raise RuntimeError(f"trnsim.native: C datapath failed: {_C_ERRORS.get(rc, rc)}")


def _matmul_native(
    stationary: np.ndarray,
    moving: np.ndarray,
    *,
    out: np.ndarray | None = None,
    accumulate: bool = False,
    k_chunk: int = 128,
    kernel: str | None = None,
    fma: str = "on",
    threads: int | None = None,
) -> np.ndarray:
    """The C core; ``kernel``/``fma``/``threads`` exist for tests and benchmarks.

    ``kernel``: ``"generic"``, ``"avx2"`` or ``"avx512"`` (default: the best this CPU runs).
    ``fma``: ``"on"`` (one rounding per MAC: the definition) or ``"off"`` (multiply and add
    rounded apart; deliberately wrong for fp32, to show that tests would catch such a kernel).
    """
    lib = _lib()
    s, v, K, M, N = check_operands(stationary, moving, out, accumulate, k_chunk)
    if kernel is not None and kernel not in _ISAS:
        raise ValueError(f"unknown kernel family {kernel!r}: expected one of {', '.join(_ISAS)}")
    if fma not in _FMA_POLICIES:
        raise ValueError(f"unknown fma policy {fma!r}: expected one of {', '.join(_FMA_POLICIES)}")
    if out is None:
        out = np.empty((M, N), dtype=np.float32)
    s, s_sk, s_sm = _operand(s)
    v, v_sk, v_sn = _operand(v)
    o_sm, o_sn = out.strides
    if o_sm % 4 or o_sn % 4:  # pragma: no cover - float32 views are aligned
        raise ValueError("out must have strides that are whole float32 elements")
    rc = lib.trn_matmul(
        _address(s),
        _CODE_OF[s.dtype],
        s_sk,
        s_sm,
        _address(v),
        _CODE_OF[v.dtype],
        v_sk,
        v_sn,
        _address(out, "float[]"),
        o_sm // 4,
        o_sn // 4,
        K,
        M,
        N,
        int(k_chunk),
        int(bool(accumulate)),
        -1 if kernel is None else _ISAS[kernel],
        _FMA_POLICIES[fma],
        _threads() if threads is None else int(threads),
    )
    if rc != 0:
        _raise_c_error(rc)
    return out


def matmul_batched(stationary: np.ndarray, moving: np.ndarray, *, k_chunk: int = 128,
                   out: np.ndarray | None = None) -> np.ndarray:
    """``stationary[b]ᵀ @ moving[b]`` for every b, each exactly as :func:`matmul` computes it:
    float32 [B, M, N]. One call for the batch: the operands are checked once and the C core
    runs the whole batch in one call (one set of packing buffers), so a batch of small matmuls
    (attention heads) pays the fixed costs once, not per item.

    Args:
        stationary: [B, K, M] array in any supported float format; any strides.
        moving: [B, K, N] array in any of those formats; any strides.
        k_chunk: rows of K per matmul instruction (partitions).
        out: optional C-contiguous float32 [B, M, N] array, written and returned (a caller's own
            buffer: the torch bridge passes memory from its host cache).
    """
    s, v = np.asarray(stationary), np.asarray(moving)
    if s.ndim != 3 or v.ndim != 3 or s.shape[0] != v.shape[0]:
        raise ValueError(f"stationary [B, K, M] and moving [B, K, N] must be 3-D with the same B, "
                         f"got shapes {s.shape} and {v.shape}")
    check_operands(s[0] if len(s) else np.empty(s.shape[1:], s.dtype),
                   v[0] if len(v) else np.empty(v.shape[1:], v.dtype), None, False, k_chunk)
    batch, K, M = s.shape
    N = v.shape[2]
    if out is None:
        out = np.empty((batch, M, N), dtype=np.float32)
    elif out.shape != (batch, M, N) or out.dtype != np.float32 or not out.flags.c_contiguous:
        raise ValueError(f"out must be a C-contiguous float32 array of shape {(batch, M, N)}, "
                         f"got {out.dtype} {out.shape}")
    if backend() == "reference":
        for b in range(batch):
            reference.matmul(s[b], v[b], out=out[b], k_chunk=k_chunk)
        return out
    lib, ffi = _lib(), _datapath.ffi
    if any(st % s.itemsize for st in s.strides):
        s = np.ascontiguousarray(s)
    if any(st % v.itemsize for st in v.strides):
        v = np.ascontiguousarray(v)
    si, vi = s.itemsize, v.itemsize
    rc = lib.trn_matmul_batched(
        ffi.cast("char *", s.ctypes.data), _CODE_OF[s.dtype],
        s.strides[0] // si, s.strides[1] // si, s.strides[2] // si,
        ffi.cast("char *", v.ctypes.data), _CODE_OF[v.dtype],
        v.strides[0] // vi, v.strides[1] // vi, v.strides[2] // vi,
        ffi.from_buffer("float[]", out), M * N, N, 1,
        batch, K, M, N, int(k_chunk), 0, -1, _FMA_POLICIES["on"], _threads(),
    )
    if rc != 0:
        _raise_c_error(rc)
    return out


def conv2d_grouped(x: np.ndarray, w: np.ndarray, groups: int, stride: tuple[int, int], dilation: tuple[int, int],
                   out_hw: tuple[int, int], *, k_chunk: int = 128) -> np.ndarray:
    """A grouped 2-d convolution as TensorE computes its im2col matmuls: float32 [N, K, Ho, Wo],
    bit for bit what one :func:`matmul` per group of ``weights[K/g, C/g*R*S]`` and the group's
    patches ``[C/g*R*S, N*Ho*Wo]`` (im2col order: channel, filter row, column) gives, without
    making the patches. For depthwise convolutions, whose per-group matmuls have one row.

    Args:
        x: float32 [N, C, H, W], already zero-padded (C = groups x C/g).
        w: float32 [K, C/g, R, S].
        out_hw: (Ho, Wo).
    """
    x = np.ascontiguousarray(x, dtype=np.float32)
    w = np.ascontiguousarray(w, dtype=np.float32)
    n, c, h, wd = x.shape
    k, cg, r, s = w.shape
    ho, wo = out_hw
    out = np.empty((n, k, ho, wo), dtype=np.float32)
    if backend() == "reference":
        raise ValueError("conv2d_grouped has no reference backend: use matmul on the im2col patches")
    lib, ffi = _lib(), _datapath.ffi
    rc = lib.trn_conv2d_grouped(ffi.cast("float *", x.ctypes.data), n, c, h, wd, ffi.cast("float *", w.ctypes.data),
                                k, cg, r, s, int(groups), int(stride[0]), int(stride[1]), int(dilation[0]),
                                int(dilation[1]), ho, wo, int(k_chunk), ffi.from_buffer("float[]", out))
    if rc != 0:
        _raise_c_error(rc)
    return out


def batched_entry() -> tuple[int, tuple[int, int, int], int]:
    """For native callers that run the datapath themselves (the torch bridge's C++ fast path):
    the address of ``trn_matmul_batched`` (datapath.h), the float32, float16 and bfloat16 format
    codes and the "on" FMA policy code, so they call it exactly as :func:`matmul_batched` does."""
    lib, ffi = _lib(), _datapath.ffi
    address = int(ffi.cast("uintptr_t", ffi.addressof(lib, "trn_matmul_batched")))
    return address, (_CODES["float32"], _CODES["float16"], _CODES["bfloat16"]), _FMA_POLICIES["on"]


def grouped_entry() -> int:
    """The address of ``trn_conv2d_grouped`` (datapath.h), for the torch bridge's C++ fast path,
    which calls it as :func:`conv2d_grouped` does."""
    lib, ffi = _lib(), _datapath.ffi
    return int(ffi.cast("uintptr_t", ffi.addressof(lib, "trn_conv2d_grouped")))


def _convert_native(x: Any, dtype: Any) -> np.ndarray:
    lib = _lib()
    target = reference._float_dtype(dtype, "target")
    a = np.asarray(x)
    source = reference._float_dtype(a.dtype, "source")
    if not a.flags.c_contiguous:
        a = a.copy(order="C")
    result = np.empty(a.shape, dtype=target.np_dtype)
    ffi = _datapath.ffi
    rc = lib.trn_convert(
        ffi.cast("void *", a.ctypes.data),
        _CODES[source.name],
        ffi.cast("void *", result.ctypes.data),
        _CODES[target.name],
        a.size,
    )
    if rc != 0:
        _raise_c_error(rc)
    return result


def matmul(
    stationary: np.ndarray,
    moving: np.ndarray,
    *,
    out: np.ndarray | None = None,
    accumulate: bool = False,
    k_chunk: int = 128,
) -> np.ndarray:
    """``stationary[K, M]ᵀ @ moving[K, N]`` as TensorE computes it: float32 [M, N].

    Args:
        stationary: [K, M] array (float32, float16, bfloat16 or an fp8 format); any strides.
        moving: [K, N] array in any of those formats; any strides.
        out: optional float32 [M, N] array (the PSUM tile; any strides); written and returned.
        accumulate: add the first chunk's result to ``out`` instead of overwriting it.
        k_chunk: rows of K per matmul instruction (partitions; 128, or 256 for fp8 double-row).

    Rules: :mod:`trnsim.native.reference`. Dispatches on :func:`backend`.
    """
    if backend() == "reference":
        return reference.matmul(
            stationary, moving, out=out, accumulate=accumulate, k_chunk=k_chunk
        )
    return _matmul_native(stationary, moving, out=out, accumulate=accumulate, k_chunk=k_chunk)


def convert(x: Any, dtype: Any) -> np.ndarray:
    """Round ``x`` (any supported float format) to ``dtype``; returns a new array.

    Round-to-nearest-even with ml_dtypes' overflow/NaN/subnormal behaviour (numpy's for
    float16); ``dtype="float32"`` widens exactly. Dispatches on :func:`backend`.
    """
    if backend() == "reference":
        return reference.convert(x, dtype)
    return _convert_native(x, dtype)
