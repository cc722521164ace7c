"""Lowering: one aten op call -> one trnsim kernel whose timing-only run is the op's device cost.

An op with a library kernel (``trnsim.kernels``) lowers to it; every other op gets a *generic*
kernel built here with the same public builder: its input bytes stream HBM->SBUF through DMA,
its elements pass through the engine that would run them on a NeuronCore (ScalarE for
table-driven activations, GpSimd for index, random and scan ops, VectorE for the rest), and its
output bytes stream back, tiled and double-buffered. That is an honest lower bound of what a
compiler would emit for the op, and reports mark it ``generic``.

Kernels are keyed by (op, shapes, dtypes, params, config); each key is simulated once
(timing-only) and its :class:`~trnsim.report.KernelReport` reused. Values are never cached.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from trnsim import Chip, ChipConfig, Kernel, KernelError, KernelReport
from trnsim.kernels import get_kernel, kernel_names
from trnsim.native.dtypes import get_dtype

from .ops import RULES

__all__ = ["Lowered", "KernelCache", "TileDtype", "tile_dtype", "build_generic", "build_matmul_any"]

# Elements per partition per generic tile: 2048 fp32 = 8 KiB a partition, well above the 4 KiB
# per partition where DMA nears saturation (datasheet §6), and small enough to double-buffer.
GENERIC_TILE_FREE = 2048

SCALAR_OPS = {
    "exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "tanh", "sigmoid", "gelu", "silu", "mish",
    "softplus", "sqrt", "rsqrt", "sin", "cos", "tan", "erf", "erfinv", "atan", "asin", "acos", "sinh", "cosh",
    "pow", "reciprocal", "gelu_backward", "silu_backward", "sigmoid_backward", "tanh_backward", "softplus_backward",
    "_softmax", "_log_softmax", "_softmax_backward_data", "_log_softmax_backward_data", "logsumexp", "elu", "selu",
    "hardswish", "lgamma", "digamma",
}
GPSIMD_OPS = {
    "gather", "scatter", "scatter_add", "scatter_reduce", "index", "index_put", "index_put_", "_index_put_impl_",
    "index_select", "index_add", "index_copy", "index_fill", "embedding", "embedding_dense_backward",
    "masked_select", "masked_scatter", "nonzero", "sort", "topk", "argsort", "cumsum", "cumprod", "cummax",
    "cummin", "normal", "normal_", "uniform_", "bernoulli", "bernoulli_", "random_", "randperm", "multinomial",
    "exponential_", "arange", "tril", "triu", "tril_", "triu_", "unique", "_unique2", "take", "take_along_dim",
    "nll_loss_forward", "nll_loss_backward", "nll_loss2d_forward", "nll_loss2d_backward", "searchsorted",
    "bucketize", "native_dropout", "roll", "flip",
}
ACTIVATION_OF = {"sigmoid": "sigmoid", "tanh": "tanh", "gelu": "gelu", "silu": "silu", "exp": "exp", "log": "log",
                 "sqrt": "sqrt", "rsqrt": "rsqrt", "erf": "erf", "sin": "sin", "softplus": "softplus",
                 "reciprocal": "reciprocal", "mish": "mish"}


@dataclass(frozen=True)
class TileDtype:
    """How a torch dtype's bytes travel through the chip: a trnsim dtype and how many of its
    elements one torch element takes (float64 -> 2 x fp32: the chip has no 64-bit datapath)."""

    name: str
    per_element: int


_TILE_DTYPES = {
    torch.float32: TileDtype("fp32", 1), torch.bfloat16: TileDtype("bf16", 1), torch.float16: TileDtype("fp16", 1),
    torch.int32: TileDtype("int32", 1), torch.int16: TileDtype("int16", 1), torch.int8: TileDtype("int8", 1),
    torch.uint8: TileDtype("uint8", 1), torch.bool: TileDtype("uint8", 1),
    torch.float8_e4m3fn: TileDtype("fp8_e4m3fn", 1), torch.float8_e5m2: TileDtype("fp8_e5m2", 1),
    torch.float64: TileDtype("fp32", 2), torch.int64: TileDtype("int32", 2), torch.complex64: TileDtype("fp32", 2),
    torch.complex128: TileDtype("fp32", 4),
}


def tile_dtype(dt: torch.dtype) -> TileDtype:
    if dt in _TILE_DTYPES:
        return _TILE_DTYPES[dt]
    return TileDtype("uint8", torch.empty((), dtype=dt).element_size())


def matmul_dtype(dt: torch.dtype) -> str:
    """The TensorE input format a torch dtype runs as (fp32 for anything the PE array lacks)."""
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float8_e4m3fn: "fp8_e4m3"}.get(dt, "fp32")


def _cols(n: int, p: int) -> int:
    return max(1, -(-n // p))


def build_generic(label: str, in_bytes: int, out_bytes: int, work: int, dtype: str, engine: str,
                  config: ChipConfig, binary: bool = False, activation: str = "exp") -> Kernel:
    """A streaming kernel: ``in_bytes`` HBM->SBUF, ``work`` elements through ``engine``
    (``"vector"``, ``"scalar"`` or ``"gpsimd"``), ``out_bytes`` SBUF->HBM; 128 partitions,
    :data:`GENERIC_TILE_FREE` elements per partition per tile, triple-buffered."""
    k = Kernel(label, config)
    p = config.core.sbuf.partitions
    isz = get_dtype(dtype).itemsize
    cin = _cols(-(-in_bytes // isz), p) if in_bytes else 0
    cout = _cols(-(-out_bytes // isz), p) if out_bytes else 0
    cw = _cols(work, p) if work else 0
    width = min(GENERIC_TILE_FREE, max(cin, cw, cout, 1))
    x = k.input("x", (p, cin), dtype) if cin else None
    y = k.output("y", (p, cout), dtype) if cout else None
    loads = k.tile_pool("in", bufs=3)
    results = k.tile_pool("out", bufs=3)
    last_in = last_res = None
    for c0 in range(0, max(cin, cw, cout, 1), width):
        if x is not None and c0 < cin:
            w = min(width, cin - c0)
            last_in = loads.tile((p, width), dtype)
            k.dma_copy(last_in[:, :w], x[:, c0:c0 + w], queue=0)
        if c0 < cw:
            w = min(width, cw - c0)
            res = results.tile((p, width), dtype)
            dst = res[:, :w]
            if last_in is None:
                k.memset(dst, 0.0, engine="gpsimd" if engine == "gpsimd" else "vector")
            else:
                src = last_in[:, :w]
                if engine == "scalar":
                    k.activation(dst, activation, src)
                elif binary and engine == "vector":
                    k.tensor_tensor(dst, src, src, "add")
                else:
                    k.tensor_scalar(dst, src, "multiply", 1.0, engine=engine)
            last_res = res
        if y is not None and c0 < cout:
            w = min(width, cout - c0)
            src_tile = last_res if last_res is not None else last_in
            if src_tile is None:
                src_tile = results.tile((p, width), dtype)
                k.memset(src_tile[:, :w], 0.0)
            k.dma_copy(y[:, c0:c0 + w], src_tile[:, :w], queue=1)
    return k


def build_matmul_any(batch: int, m: int, k: int, n: int, dtype: str, config: ChipConfig,
                     label: str = "matmul") -> Kernel:
    """``batch`` matmuls ``[M,K] @ [K,N]`` of any sizes: ragged edges become partial tiles.

    Straightforward tiling (stationary ``lhsT`` tiles of <=128x128, moving tiles of <=512
    columns, PSUM accumulation over K, evacuation alternating VectorE/ScalarE, operands
    double-buffered); it reloads operands per output tile, so its HBM traffic is an upper bound.
    """
    kern = Kernel(label, config)
    t = config.core.tensor
    tk, tm = t.max_contraction, t.stationary_max_free
    tn = min(t.moving_max_free, config.core.psum.bank_bytes // 4)
    odt = "fp32" if dtype == "fp32" else "bf16"
    a = kern.input("lhsT", (k, batch * m), dtype)
    b = kern.input("rhs", (k, batch * n), dtype)
    out = kern.output("out", (batch * m, n), odt)
    lhs = kern.tile_pool("lhsT", bufs=2)
    rhs = kern.tile_pool("rhs", bufs=2)
    res = kern.tile_pool("res", bufs=2)
    acc = kern.tile_pool("acc", bufs=2, space="psum")
    evac = 0
    for bi in range(batch):
        for m0 in range(0, m, tm):
            mw = min(tm, m - m0)
            for n0 in range(0, n, tn):
                nw = min(tn, n - n0)
                ps = acc.tile((mw, nw), "fp32")
                for k0 in range(0, k, tk):
                    kw = min(tk, k - k0)
                    st = lhs.tile((kw, mw), dtype)
                    kern.dma_copy(st, a[k0:k0 + kw, bi * m + m0:bi * m + m0 + mw], queue=0)
                    mv = rhs.tile((kw, nw), dtype)
                    kern.dma_copy(mv, b[k0:k0 + kw, bi * n + n0:bi * n + n0 + nw], queue=1)
                    kern.nc_matmul(ps, st, mv, accumulate=k0 > 0)
                r = res.tile((mw, nw), odt)
                kern.tensor_copy(r, ps, engine="vector" if evac % 2 == 0 else "scalar")
                evac += 1
                kern.dma_copy(out[bi * m + m0:bi * m + m0 + mw, n0:n0 + nw], r, queue=2)
    return kern


@dataclass(frozen=True)
class Lowered:
    """The kernel an op call lowers to: ``kernel`` names it in reports; ``generic`` says it was
    built by :func:`build_generic` rather than taken from the library."""

    kernel: str
    generic: bool
    report: KernelReport | None  # None: a metadata-only op (no device kernel, launch overhead only)


class KernelCache:
    """Timing-only kernel runs keyed by (op, shapes, dtypes, params, config); each simulated once."""

    def __init__(self, config: ChipConfig):
        self.config = config
        self.chip = Chip(config)
        self._reports: dict[tuple[Any, ...], tuple[str, KernelReport]] = {}
        self.rejected: set[tuple[Any, ...]] = set()  # library kernels that refused a shape
        self.simulated = 0  # kernels actually simulated (cache misses)

    def __len__(self) -> int:
        return len(self._reports)

    def get(self, key: tuple[Any, ...], build: Callable[[], tuple[str, Kernel]]) -> tuple[str, KernelReport]:
        hit = self._reports.get(key)
        if hit is None:
            label, kernel = build()
            hit = (label, self.chip.run(kernel, timing_only=True).report)
            self._reports[key] = hit
            self.simulated += 1
        return hit


_library: dict[str, Any] = {}


def library_kernel(name: str) -> Any | None:
    """The library kernel entry ``name``, or None if the library has no such kernel."""
    if not _library:
        _library.update({n: get_kernel(n) for n in kernel_names()})
    return _library.get(name)


def flat_tensors(x: Any, out: list[torch.Tensor]) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        out.append(x)
    elif isinstance(x, (list, tuple)):
        for y in x:
            flat_tensors(y, out)
    return out


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Lowering:
    """Maps op calls to kernels and their simulated reports, through one :class:`KernelCache`."""

    def __init__(self, config: ChipConfig):
        self.config = config
        self.cache = KernelCache(config)

    # ---- entry points ---------------------------------------------------------------------
    def generic(self, op: str, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> Lowered:
        """The generic kernel of ``op`` over ``inputs`` -> ``outputs`` (flat tensor lists)."""
        in_bytes = sum(_nbytes(t) for t in inputs)
        out_bytes = sum(_nbytes(t) for t in outputs)
        ref = outputs[0] if outputs else (inputs[0] if inputs else None)
        td = tile_dtype(ref.dtype) if ref is not None else TileDtype("fp32", 1)
        work = max([t.numel() for t in outputs] + [t.numel() for t in inputs] + [0]) * td.per_element
        if len(outputs) > 1 and all(o.shape == outputs[0].shape for o in outputs):
            work = sum(o.numel() for o in outputs) * td.per_element  # foreach ops: one pass per tensor
        engine = "scalar" if op in SCALAR_OPS else "gpsimd" if op in GPSIMD_OPS else "vector"
        if engine == "scalar" and not td.name.startswith(("fp", "bf")):
            engine = "vector"
        binary = sum(1 for t in inputs if t.numel() > 1) >= 2
        act = ACTIVATION_OF.get(op, "exp")
        key = ("generic", op, in_bytes, out_bytes, work, td.name, engine, binary)
        label = f"generic:{op}"
        _, rep = self.cache.get(key, lambda: (label, build_generic(label, in_bytes, out_bytes, work, td.name, engine,
                                                                   self.config, binary, act)))
        return Lowered(label, True, rep)

    def op(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any], inputs: Sequence[torch.Tensor],
           outputs: Sequence[torch.Tensor]) -> Lowered:
        """The kernel of one fallback op call: a library kernel when a rule in
        :data:`torch_bridge.ops.RULES` expresses it, else the generic kernel."""
        def generic() -> Lowered:
            return self.generic(name, inputs, outputs)
        rule = RULES.get(name)
        if rule is None or not outputs or not inputs:
            return generic()
        try:
            route = rule(name, args, kwargs, outputs[0])
        except (TypeError, IndexError, AttributeError, ValueError, ZeroDivisionError):
            route = None  # an overload the rule does not read: cost it generically
        if route is None:
            return generic()
        kernel, shape, params = route
        return self.library(kernel, shape, inputs[0].dtype, params, generic)

    def matmul(self, op: str, batch: int, m: int, k: int, n: int, dtype: torch.dtype,
               transpose_a: bool = False, transpose_b: bool = False) -> Lowered:
        """A (batched) matmul on TensorE: the library's matmul/bmm kernel (``transpose_a``: A is
        stored [M,K] row-major rather than as lhsT [K,M]; ``transpose_b``: B is stored [N,K]),
        else :func:`build_matmul_any` (marked generic)."""
        dt = matmul_dtype(dtype)
        if min(batch, m, k, n) == 0:  # no products: the launch is all there is
            return Lowered("empty matmul (launch only)", False, None)

        def any_size() -> Lowered:
            key = ("matmul_any", batch, m, k, n, dt)
            label = f"generic:{'bmm' if batch > 1 else 'matmul'}"
            _, rep = self.cache.get(key, lambda: (label, build_matmul_any(batch, m, k, n, dt, self.config, label)))
            return Lowered(label, True, rep)
        params = {"transpose_a": transpose_a, "transpose_b": transpose_b}
        if batch > 1:
            return self.library("bmm", (batch, m, k, n), dtype, params, any_size)
        return self.library("matmul", (m, k, n), dtype, params, any_size)

    def library(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, params: dict[str, Any],
                fallback: Callable[[], Lowered]) -> Lowered:
        """Library kernel ``name`` if it exists and accepts the shape/dtype/params, else ``fallback()``."""
        entry = library_kernel(name)
        if entry is None or any(d <= 0 for d in shape):
            return fallback()
        dt = matmul_dtype(dtype) if name in ("matmul", "bmm") else tile_dtype(dtype).name
        if dt not in entry.dtypes or (name not in ("matmul", "bmm") and tile_dtype(dtype).per_element != 1):
            return fallback()
        key = ("lib", name, shape, dt, tuple(sorted(params.items())))
        if key in self.cache.rejected:
            return fallback()
        try:
            label, rep = self.cache.get(key, lambda: (name, entry.make(shape, dt, self.config, params)))
        except KernelError:
            self.cache.rejected.add(key)
            return fallback()
        return Lowered(label, False, rep)
