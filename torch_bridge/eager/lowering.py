"""Lowering: an op call's metadata -> the kernel whose simulated cost is the op's device cost.

The one place a torch op becomes a :class:`trnsim.device.KernelSpec`; nothing else in the bridge
costs anything. It reads only metadata - shapes, dtypes, strides and scalar parameters - never
values, so the same lowering serves eager ops on real tensors, fake or meta tensors (timing-only
runs) and FX graph nodes (compiled regions): a meta tensor of a shape costs what a real one does.

:data:`OPS` is the single table from aten op names to kernels: the library kernel an op lowers to
(with the rule that reads its call into the kernel's shape and parameters) and, for ops no library
kernel expresses, the engine its *generic* streaming kernel (:mod:`trnsim.kernels.generic`) runs
them on. Library shapes are the library's: elementwise and row-wise kernels see a tensor as
``[numel / last dim, last dim]``, as a NeuronCore kernel tiles it (rows on partitions).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from trnsim.device import KernelSpec
from trnsim.kernels.generic import STREAM
from trnsim.native.dtypes import get_dtype

__all__ = ["OPS", "Op", "TileDtype", "tile_dtype", "matmul_dtype", "flat_tensors", "op_spec", "generic_spec",
           "matmul_spec", "mx_linear_specs", "fused_op_specs", "conv_specs", "conv_backward_specs", "depthwise_spec", "copy_spec",
           "attention_specs", "attention_backward_specs", "fused_spec", "tkg_prior", "kv_cost_key"]

Route = Optional[tuple[str, tuple[int, ...], dict[str, Any]]]


# ---- how torch dtypes travel through the chip -----------------------------------------------
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
    return TileDtype("uint8", torch.empty((), dtype=dt, device="meta").element_size())


_MATMUL_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float8_e4m3fn: "fp8_e4m3",
                  torch.float8_e4m3fnuz: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2", torch.float8_e5m2fnuz: "fp8_e5m2"}


def matmul_dtype(dt: torch.dtype) -> str:
    """The TensorE input format a torch dtype runs as (fp32 for anything the PE array lacks). The
    fp8 formats run in double-row mode, E4M3 and E5M2 alike (datasheet §4.2, S9)."""
    return _MATMUL_DTYPES.get(dt, "fp32")


def flat_tensors(x: Any, out: list[torch.Tensor]) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        out.append(x)
    elif isinstance(x, (list, tuple)):
        for y in x:
            flat_tensors(y, out)
    return out


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _rows_cols(t: torch.Tensor) -> tuple[int, int]:
    cols = t.shape[-1] if t.dim() else 1
    return (t.numel() // cols if cols else 0), cols


# ---- library rules: (name, args, kwargs, out) -> (kernel, shape, params) or None --------------
def _binary(op: str) -> Callable[..., Route]:
    def rule(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], out: torch.Tensor) -> Route:
        a, b = args[0], args[1] if len(args) > 1 else None
        if not isinstance(a, torch.Tensor):
            a, b = b, a
        if not isinstance(a, torch.Tensor):
            return None
        if isinstance(b, torch.Tensor) and b.numel() > a.numel():
            a, b = b, a
        rows, cols = _rows_cols(out)
        if a.numel() != out.numel():
            return None
        if not isinstance(b, torch.Tensor) or b.numel() == 1:
            bc = "scalar"
        elif b.numel() == out.numel():
            bc = "none"
        elif b.numel() == cols and b.shape[-1] == cols:
            bc = "row"
        elif b.numel() == rows and b.dim() and b.shape[-1] == 1:
            bc = "col"
        else:
            return None
        return "binary", (rows, cols), {"op": op, "broadcast": bc}
    return rule


def _unary(op: str) -> Callable[..., Route]:
    def rule(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], out: torch.Tensor) -> Route:
        return "unary", _rows_cols(out), {"op": op}
    return rule


def _activation(fn: str) -> Callable[..., Route]:
    def rule(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], out: torch.Tensor) -> Route:
        return "activation", _rows_cols(out), {"fn": fn}
    return rule


def _gelu(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], out: torch.Tensor) -> Route:
    approximate = kwargs.get("approximate", args[1] if len(args) > 1 else "none")
    return "activation", _rows_cols(out), {"fn": "gelu_apprx_tanh" if approximate == "tanh" else "gelu"}


def _reduce(op: str) -> Callable[..., Route]:
    def rule(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], out: torch.Tensor) -> Route:
        x = args[0]
        dim = kwargs.get("dim")
        if len(args) > 1 and not isinstance(args[1], (torch.dtype, bool)):
            dim = args[1]
        dims = [dim] if isinstance(dim, int) else list(dim) if dim is not None else []
        dims = sorted({d % max(x.dim(), 1) for d in dims})
        if not dims or len(dims) == x.dim():  # a full reduction: the row pass does the work
            return "reduce", _rows_cols(x), {"op": op, "axis": 1}
        if dims == [x.dim() - 1]:
            return "reduce", _rows_cols(x), {"op": op, "axis": 1}
        if dims == [0] and x.dim() >= 2:
            return "reduce", (x.shape[0], x.numel() // x.shape[0]), {"op": op, "axis": 0}
        return None
    return rule


def _softmax(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], out: torch.Tensor) -> Route:
    x, dim = args[0], args[1]
    if dim % max(x.dim(), 1) != x.dim() - 1 and x.dim() > 0:
        return None
    return "softmax", _rows_cols(x), {}


def _layer_norm(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], out: torch.Tensor) -> Route:
    x, normalized_shape, eps = args[0], args[1], args[4] if len(args) > 4 else 1e-5
    hidden = math.prod(normalized_shape)
    return "layernorm", (x.numel() // hidden, hidden), {"eps": float(eps)}


def _embedding(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], out: torch.Tensor) -> Route:
    weight, indices = args[0], args[1]
    return "embedding", (indices.numel(), weight.shape[0], weight.shape[1]), {}


def _scale_kind(scale: Any, m: int, n: int) -> str | None:
    """How a scaled matmul's scale broadcasts over its [M, N] result: one value (tensor-wise),
    one per row ([M, 1]) or one per column ([1, N], row-wise scaling's scale_b); None for a
    layout the epilogue does not take (block-wise scales)."""
    from trnsim.kernels.fused import COL, ROW, SCALAR

    if not isinstance(scale, torch.Tensor):
        return None
    if scale.numel() == 1:
        return SCALAR
    if scale.dim() == 2 and tuple(scale.shape) == (m, 1):
        return COL
    if scale.dim() == 2 and tuple(scale.shape) == (1, n):
        return ROW
    return None


def _scaled_mm(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], inputs: Sequence[torch.Tensor],
               outputs: Sequence[torch.Tensor]) -> KernelSpec | None:
    """``aten::_scaled_mm`` (and ``_scaled_mm_v2``, ``F.scaled_mm``'s op): an fp8 matmul on TensorE
    whose PSUM evacuation applies the scales, the bias and the output rounding - the library
    ``matmul_fused`` in the operands' fp8 format (double-row), its epilogue program multiplying by
    each scale (a scalar, a per-row [M, 1] or a per-column [1, N] value) and adding the bias. Where
    the epilogue cannot take the scales, the plain fp8 matmul with the output dtype is the kernel.
    E4M3 and E5M2 operands may be mixed at the same rate (datasheet §4.2, S9): the kernel runs in
    A's format."""
    from trnsim.kernels.fused import FULL, ROW, SCALAR, Program

    a, b, out = args[0], args[1], outputs[0]
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0] or min(a.shape[0], a.shape[1], b.shape[1]) == 0:
        return None
    m, k, n = a.shape[0], a.shape[1], b.shape[1]
    ta, tb = matmul_layout(a, b)
    odt = tile_dtype(out.dtype).name
    if name == "_scaled_mm":
        scales = [args[2], args[3]]
        bias = _arg(args, kwargs, 4, "bias")
        result = _arg(args, kwargs, 5, "scale_result")
        if result is not None and out.element_size() == 1:
            scales.append(result)  # an fp8 result is scaled once more before it is rounded
    else:
        sa, sb = args[2], args[5]
        scales = [sa[0] if len(sa) == 1 else None, sb[0] if len(sb) == 1 else None]
        bias = _arg(args, kwargs, 8, "bias")
    dt = matmul_dtype(a.dtype)
    plain = KernelSpec.of("matmul", (m, k, n), dt, {"transpose_a": ta, "transpose_b": tb, "out_dtype": odt})
    kinds = [_scale_kind(sc, m, n) for sc in scales]
    if None in kinds:
        return plain
    ins = [(FULL, "fp32")] + [(kd, "fp32") for kd in kinds]
    if isinstance(bias, torch.Tensor):
        if bias.numel() not in (1, n):
            return plain
        ins.append((ROW if bias.numel() == n else SCALAR, tile_dtype(bias.dtype).name))
    steps: list[tuple[Any, ...]] = []
    value = 0  # values are numbered inputs first, then one per step
    for i in range(1, 1 + len(kinds)):
        steps.append(("tt", "multiply", value, i))
        value = len(ins) + len(steps) - 1
    if isinstance(bias, torch.Tensor):
        steps.append(("tt", "add", value, len(ins) - 1))
        value = len(ins) + len(steps) - 1
    prog = Program(tuple(ins), tuple(steps), ((value, odt),))
    return KernelSpec.of("matmul_fused", (m, k, n), dt, {"program": prog, "transpose_a": ta, "transpose_b": tb},
                         label="matmul_fused", fallback=plain)


def _slow_conv2d(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], inputs: Sequence[torch.Tensor],
                 outputs: Sequence[torch.Tensor]) -> KernelSpec | None:
    """``aten._slow_conv2d_forward`` (CPU's own convolution, called directly): the convolution's
    kernel, as :func:`conv_specs` lowers any 2-d convolution."""
    x, w, out = args[0], args[1], outputs[0]
    stride, padding = _arg(args, kwargs, 4, "stride", (1, 1)), _arg(args, kwargs, 5, "padding", (0, 0))
    specs = conv_specs(x, w, out, 1, list(stride), list(padding), [1, 1], False)
    return specs[0] if len(specs) == 1 else None


def _mx_matmul(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], inputs: Sequence[torch.Tensor],
               outputs: Sequence[torch.Tensor]) -> KernelSpec | None:
    """``trnsim::mx_matmul`` (``torch.neuron.mx_matmul``): the library ``matmul_mx`` kernel on
    ``nc_matmul_mx`` in A's MX format (MXFP8 formats may be mixed at the same rate), K rounded up
    to a whole scale quadrant (128 values)."""
    a, b, out = args[0], args[2], outputs[0]
    m, k, n = a.shape[0], a.shape[1], b.shape[1]
    fmt = "mxfp8_e5m2" if a.dtype == torch.float8_e5m2 else "mxfp8_e4m3fn"
    return KernelSpec.of("matmul_mx", (m, -(-k // 128) * 128, n), fmt, {"out_dtype": tile_dtype(out.dtype).name})


# ---- the table ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Op:
    """How one aten op lowers: ``library`` reads a call into a library kernel's (name, shape,
    params), or None where the library has no kernel for the call; ``engine`` runs the op's
    generic kernel otherwise (VectorE unless a table-driven activation or an index/random/scan op),
    ``fn`` is the ScalarE function that kernel applies. ``spec`` builds the whole kernel spec
    instead, for an op whose kernel is more than a (name, shape, params) route (its dtype is not
    its first input's, or it has a fallback kernel of its own): ``spec(name, args, kwargs, inputs,
    outputs)`` -> KernelSpec, or None for the generic kernel."""

    library: Callable[..., Route] | None = None
    engine: str = "vector"
    fn: str = "exp"
    spec: Callable[..., KernelSpec | None] | None = None


OPS: dict[str, Op] = {}


def _add(names: Sequence[str], op: Op, inplace: bool = False) -> None:
    for n in names:
        OPS[n] = op
        if inplace:
            OPS[n + "_"] = op


# binary (library "binary"), with in-place forms; pow's generic form runs on ScalarE
for _name, _lib in {"add": "add", "sub": "subtract", "rsub": "subtract", "mul": "multiply", "div": "divide",
                    "maximum": "maximum", "minimum": "minimum"}.items():
    _add([_name], Op(_binary(_lib)), inplace=True)
_add(["pow"], Op(_binary("power"), "scalar", "exp"), inplace=True)
# unary (library "unary"); the ScalarE ones keep their function for the generic form
for _name, (_eng, _fn) in {"neg": ("vector", "exp"), "abs": ("vector", "exp"), "relu": ("vector", "exp"),
                           "sign": ("vector", "exp"), "square": ("vector", "exp"), "sqrt": ("scalar", "sqrt"),
                           "rsqrt": ("scalar", "rsqrt"), "reciprocal": ("scalar", "reciprocal"),
                           "exp": ("scalar", "exp"), "log": ("scalar", "log")}.items():
    _add([_name], Op(_unary(_name), _eng, _fn), inplace=True)
# ScalarE activations (library "activation")
for _name, _fn in {"sigmoid": "sigmoid", "tanh": "tanh", "silu": "silu", "erf": "erf", "softplus": "softplus",
                   "mish": "mish", "sin": "sin", "atan": "arctan"}.items():
    _add([_name], Op(_activation(_fn), "scalar", _fn if _fn != "arctan" else "exp"), inplace=True)
_add(["gelu"], Op(_gelu, "scalar", "gelu"), inplace=True)
for _name, _lib in {"sum": "sum", "mean": "mean", "amax": "max", "amin": "min", "max": "max", "min": "min"}.items():
    _add([_name], Op(_reduce(_lib)))
_add(["_softmax"], Op(_softmax, "scalar", "exp"))
_add(["native_layer_norm"], Op(_layer_norm))
_add(["embedding"], Op(_embedding, "gpsimd"))
_add(["_scaled_mm", "_scaled_mm_v2"], Op(spec=_scaled_mm))
_add(["_slow_conv2d_forward"], Op(spec=_slow_conv2d))
_add(["mx_matmul"], Op(spec=_mx_matmul))
# no library kernel: generic on ScalarE (table-driven functions) ...
_add(["exp2", "expm1", "log2", "log10", "log1p", "cos", "tan", "erfinv", "asin", "acos", "sinh", "cosh",
      "gelu_backward", "silu_backward", "sigmoid_backward", "tanh_backward", "softplus_backward",
      "_log_softmax", "_softmax_backward_data", "_log_softmax_backward_data", "logsumexp", "elu", "selu",
      "hardswish", "lgamma", "digamma"], Op(None, "scalar", "exp"))
# ... and on GpSimd (index, random, scan and sort ops)
_add(["gather", "scatter", "scatter_add", "scatter_reduce", "index", "index_put", "index_put_", "_index_put_impl_",
      "index_select", "index_add", "index_copy", "index_fill", "embedding_dense_backward", "masked_select",
      "masked_scatter", "nonzero", "sort", "topk", "argsort", "cumsum", "cumprod", "cummax", "cummin", "normal",
      "normal_", "uniform_", "bernoulli", "bernoulli_", "random_", "randperm", "multinomial", "exponential_",
      "arange", "tril", "triu", "tril_", "triu_", "unique", "_unique2", "take", "take_along_dim",
      "nll_loss_forward", "nll_loss_backward", "nll_loss2d_forward", "nll_loss2d_backward", "searchsorted",
      "bucketize", "native_dropout", "roll", "flip"], Op(None, "gpsimd"))


def out_is_self(args: tuple[Any, ...], kwargs: dict[str, Any], out_names: Sequence[str]) -> bool:
    """An out= call whose out is its first argument: the in-place form (``index_copy_`` is
    ``index_copy.out(self, .., out=self)``), which a cost key tells apart from the same call into
    a fresh out (:func:`_scatter_inplace` costs the two differently)."""
    return bool(out_names) and bool(args) and any(kwargs.get(n) is args[0] for n in out_names)


def _touched(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], self_: torch.Tensor) -> int | None:
    """How many of ``self_``'s elements the in-place scatter ``name`` (its base name) writes (None
    where the call's indices do not tell without their values: a boolean mask)."""
    if name in ("index_copy", "index_add"):
        return _arg(args, kwargs, 3, "source").numel()
    if name in ("scatter", "scatter_add", "scatter_reduce"):
        return _arg(args, kwargs, 2, "index").numel()
    if name == "index_fill":
        index, dim = _arg(args, kwargs, 2, "index"), _arg(args, kwargs, 1, "dim")
        size = self_.shape[dim] if self_.dim() else 1
        return index.numel() * (self_.numel() // size) if size else 0
    indices = _arg(args, kwargs, 1, "indices")  # index_put_ / _index_put_impl_
    if any(t is not None and (not isinstance(t, torch.Tensor) or t.dtype in (torch.bool, torch.uint8))
           for t in indices):
        return None
    shape = torch.broadcast_shapes(*(tuple(t.shape) for t in indices if t is not None))
    rest = [d for i, d in enumerate(self_.shape) if i >= len(indices) or indices[i] is None]
    return math.prod(shape) * math.prod(rest)


def _scatter_inplace(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], inputs: Sequence[torch.Tensor],
                     outputs: Sequence[torch.Tensor]) -> KernelSpec | None:
    """An in-place scatter (``index_copy_``, ``index_put_``, ``scatter_``, ...: a KV cache's
    update) moves only what it writes: its indices and sources in, and the elements it writes out
    (with those elements read first where it accumulates), an indirect DMA on GpSimd. The rest of
    the tensor it writes into is not read or written. None (the generic kernel over every tensor,
    a full pass over ``self``) for the out-of-place forms, which copy ``self`` first, and where
    the indices are a boolean mask."""
    self_ = args[0] if args else None
    if not isinstance(self_, torch.Tensor) or not outputs or outputs[0] is not self_:
        return None
    # (index_fill_ is costed by its own name, the others by their base's)
    base = name if name in ("index_put_", "_index_put_impl_") else name.rstrip("_")
    touched = _touched(base, args, kwargs, self_)
    if touched is None or touched >= self_.numel():
        return None
    accumulate = base in ("index_add", "scatter_add", "scatter_reduce") or \
        (base in ("index_put_", "_index_put_impl_") and bool(_arg(args, kwargs, 3, "accumulate", False))) or \
        (base == "scatter" and _arg(args, kwargs, 4, "reduce") is not None)
    written = torch.empty(touched, dtype=self_.dtype, device="meta")
    moved = [t for t in inputs if t is not self_] + ([written] if accumulate else [])
    return generic_spec(name, moved, [written])


# (the names their calls are costed by: index_copy_ is index_copy.out(out=self), costed as "index_copy",
# index_fill_ as itself)
_add(["index_copy", "index_add", "scatter", "scatter_add", "scatter_reduce", "index_fill", "index_fill_", "index_put_",
      "_index_put_impl_"], Op(None, "gpsimd", spec=_scatter_inplace))
_DEFAULT = Op()


# ---- specs ----------------------------------------------------------------------------------
def generic_spec(op: str, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> KernelSpec:
    """The generic streaming kernel of ``op`` reading ``inputs`` and writing ``outputs`` (flat
    tensor lists; only their sizes and dtypes are read)."""
    in_bytes = sum(_nbytes(t) for t in inputs)
    out_bytes = sum(_nbytes(t) for t in outputs)
    ref = outputs[0] if outputs else (inputs[0] if inputs else None)
    td = tile_dtype(ref.dtype) if ref is not None else TileDtype("fp32", 1)
    work = max([t.numel() for t in outputs] + [t.numel() for t in inputs] + [0]) * td.per_element
    if len(outputs) > 1 and all(o.shape == outputs[0].shape for o in outputs):
        work = sum(o.numel() for o in outputs) * td.per_element  # foreach ops: one pass per tensor
    entry = OPS.get(op, _DEFAULT)
    engine = entry.engine
    if engine == "scalar" and not td.name.startswith(("fp", "bf")):
        engine = "vector"
    binary = sum(1 for t in inputs if t.numel() > 1) >= 2
    isz = get_dtype(td.name).itemsize
    shape = (-(-in_bytes // isz), work, -(-out_bytes // isz))
    return KernelSpec.of(STREAM, shape, td.name, {"engine": engine, "binary": binary, "fn": entry.fn},
                         label=f"generic:{op}", generic=True)



def _library(kernel: str, shape: tuple[int, ...], dtype: torch.dtype, params: dict[str, Any],
             fallback: KernelSpec | None) -> KernelSpec | None:
    """Library kernel ``kernel`` for ``shape``, or None where its dtypes cannot take ``dtype``."""
    from trnsim.kernels import get_kernel

    entry = get_kernel(kernel)
    if any(d <= 0 for d in shape):
        return None
    dt = matmul_dtype(dtype) if kernel in ("matmul", "bmm") else tile_dtype(dtype).name
    if dt not in entry.dtypes or (kernel not in ("matmul", "bmm") and tile_dtype(dtype).per_element != 1):
        return None
    return KernelSpec.of(kernel, shape, dt, params, fallback=fallback)


def op_spec(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], inputs: Sequence[torch.Tensor],
            outputs: Sequence[torch.Tensor]) -> KernelSpec:
    """The kernel of one op call (``inputs``/``outputs``: its flat tensors on the device): the
    library kernel :data:`OPS` gives for it, falling back to the generic kernel."""
    generic = generic_spec(name, inputs, outputs)
    entry = OPS.get(name)
    if entry is not None and entry.spec is not None and outputs and inputs:
        try:
            spec = entry.spec(name, args, kwargs, inputs, outputs)
        except (TypeError, IndexError, AttributeError, ValueError):
            spec = None  # an overload the rule does not read: cost it generically
        return spec or generic
    if entry is None or entry.library is None or not outputs or not inputs:
        return generic
    try:
        route = entry.library(name, args, kwargs, outputs[0])
    except (TypeError, IndexError, AttributeError, ValueError, ZeroDivisionError):
        route = None  # an overload the rule does not read: cost it generically
    if route is None:
        return generic
    kernel, shape, params = route
    return _library(kernel, shape, inputs[0].dtype, params, generic) or generic


# Batched matmuls of small items go to the packed kernel (G items per DMA, PSUM bank and store):
# items of at most 4096 outputs and 128 columns, K and M on one PE pass. Measured on trn2 against
# the per-item bmm (simulated us, bf16): 192x11x16x11 172 -> 32, 96x64x64x64 90 -> 65,
# 64x1x64x64 60 -> 18; past it (32x128x64x128: 32 -> 43, 48x16x36x512: 55 -> 164) bmm wins.
PACKED_MAX_OUTPUT = 4096
PACKED_MAX_N = 128
PACKED_MAX_K = 128


def matmul_spec(batch: int, m: int, k: int, n: int, dtype: torch.dtype, transpose_a: bool = False,
                transpose_b: bool = False) -> KernelSpec | None:
    """``batch`` matmuls [M,K] @ [K,N] on TensorE: the library's matmul/bmm (``transpose_a``: A is
    stored [M,K] row-major rather than as lhsT [K,M]; ``transpose_b``: B is stored [N,K]).
    None when there are no products (the launch is all there is)."""
    if min(batch, m, k, n) == 0:
        return None
    params = {"transpose_a": transpose_a, "transpose_b": transpose_b}
    if batch > 1:
        bmm = KernelSpec.of("bmm", (batch, m, k, n), matmul_dtype(dtype), params)
        if m * n <= PACKED_MAX_OUTPUT and n <= PACKED_MAX_N and k <= PACKED_MAX_K and m <= PACKED_MAX_K:
            return KernelSpec.of("bmm_packed", (batch, m, k, n), matmul_dtype(dtype), params, fallback=bmm)
        return bmm
    return KernelSpec.of("matmul", (m, k, n), matmul_dtype(dtype), params)


def mx_linear_specs(m: int, k: int, n: int, dtype: torch.dtype, transpose_a: bool, transpose_b: bool,
                    fmt: str) -> list[KernelSpec]:
    """A matmul [M,K] @ [K,N] of an MX linear (TorchAO's MXFP8 linear on trn3): each operand cast
    to ``fmt`` along K by the library's ``mx_quantize`` kernel (``rows`` where K is its contiguous
    dim: A row-major, B stored [N,K]; ``cols`` otherwise), then ``matmul_mx`` on the two; K
    padded to a whole scale quadrant (128 values), as ``torch.neuron.mx_matmul`` charges it."""
    kp = -(-k // 128) * 128
    src = tile_dtype(dtype).name
    out = "float32" if dtype == torch.float32 else "bfloat16"
    return [KernelSpec.of("mx_quantize", (m, kp), src, {"fmt": fmt, "layout": "rows" if transpose_a else "cols"}),
            KernelSpec.of("mx_quantize", (n, kp), src, {"fmt": fmt, "layout": "rows" if transpose_b else "cols"}),
            KernelSpec.of("matmul_mx", (m, kp, n), fmt, {"out_dtype": out})]


def matmul_layout(a: torch.Tensor | None, b: torch.Tensor | None) -> tuple[bool, bool]:
    """The operand forms the operands' strides pick: a row-major A[M,K] is loaded as ``a``
    (transpose_a), a column-major one is already lhsT[K,M]; a row-major B[K,N] is ``rhs``, a
    column-major one (``x @ w.t()``) is stored as b[N,K] (transpose_b)."""
    ta = a is not None and a.stride(-1) == 1 and a.shape[-1] > 1
    tb = b is not None and b.stride(-1) != 1 and b.shape[-1] > 1
    return ta, tb


def conv_specs(inp: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, groups: int, stride: Any = None,
               padding: Any = None, dilation: Any = None, transposed: bool = True) -> list[KernelSpec]:
    """A plain 2-d convolution (one group, square filter, equal strides and paddings, no
    dilation) lowers to the library's conv2d kernel. Any other convolution is costed as the matmul
    of its im2col patches: M = batch x output positions, K = input channels per group x filter
    size, N = output channels per group; one per group."""
    kernel_numel = math.prod(weight.shape[2:])
    positions = math.prod(out.shape[2:])
    m = out.shape[0] * positions
    k = weight.shape[1] * kernel_numel
    n = weight.shape[0] // groups
    im2col = matmul_spec(groups, m, k, n, inp.dtype)
    dw = depthwise_spec(inp, weight, groups, stride, padding, dilation, transposed, im2col)
    if dw is not None:
        return [dw]
    if (not transposed and groups == 1 and inp.dim() == 4 and weight.shape[2] == weight.shape[3]
            and len(set(stride)) == 1 and len(set(padding)) == 1 and set(dilation) == {1}):
        nb, c, h, w = inp.shape
        spec = _library("conv2d", (nb, c, h, w, weight.shape[0], weight.shape[2]), inp.dtype,
                        {"stride": int(stride[0]), "padding": int(padding[0])}, im2col)
        if spec is not None:
            return [spec]
    return [im2col] if im2col is not None else []


def depthwise_spec(inp: torch.Tensor, weight: torch.Tensor, groups: int, stride: Any, padding: Any, dilation: Any,
                   transposed: bool, fallback: KernelSpec | None) -> KernelSpec | None:
    """A 2-d depthwise convolution (one input and one output channel per group, square filter,
    equal strides and paddings, no dilation) as the library's VectorE/GpSimd depthwise kernel;
    None for any other convolution."""
    if (transposed or inp.dim() != 4 or stride is None or groups < 2 or weight.shape[0] != groups
            or weight.shape[1] != 1 or inp.shape[1] != groups or weight.shape[2] != weight.shape[3]
            or len(set(stride)) != 1 or len(set(padding)) != 1 or set(dilation) != {1}):
        return None
    nb, c, h, w = inp.shape
    return _library("dwconv2d", (nb, c, h, w, weight.shape[2]), inp.dtype,
                    {"stride": int(stride[0]), "padding": int(padding[0])}, fallback)


def conv_backward_specs(inp: torch.Tensor, weight: torch.Tensor, grad_out: torch.Tensor, groups: int, stride: Any,
                        padding: Any, dilation: Any, transposed: bool, output_mask: Any) -> list[KernelSpec]:
    """A convolution's backward: the input gradient and the weight gradient, each as many MACs
    as the forward.

    * depthwise: both on the depthwise kernel at the forward's shape (grad-input is a depthwise
      convolution of the output gradient, grad-weight a per-channel correlation of input and
      output gradient: the same per-tap multiply-adds);
    * a plain 2-d convolution: grad-input as the library conv2d of the output gradient with the
      filter's channels swapped, at the output's resolution ([N,K,Ho,Wo] -> [N,C,Ho,Wo]: the
      forward's MACs whatever the stride), grad-weight as the matmul that contracts input
      patches with the output gradient over every output position ([C*R*R, N*Ho*Wo] x
      [N*Ho*Wo, K]: one accumulation group, the small result written once);
    * anything else as im2col matmuls (grad_out x weight, input x grad_out)."""
    dw = depthwise_spec(inp, weight, groups, stride, padding, dilation, transposed, None)
    plain = (not transposed and groups == 1 and inp.dim() == 4 and stride is not None
             and weight.shape[2] == weight.shape[3] and len(set(stride)) == 1 and len(set(padding)) == 1
             and set(dilation) == {1})
    specs: list[KernelSpec] = []
    for i, needed in enumerate(output_mask[:2]):
        if not needed:
            continue
        if dw is not None:
            specs.append(dw)
        elif plain and i == 0:
            nb, k, ho, wo = grad_out.shape
            r = weight.shape[2]
            im2col = conv_specs(grad_out, weight, inp, groups)
            spec = _library("conv2d", (nb, k, ho, wo, inp.shape[1], r), inp.dtype,
                            {"stride": 1, "padding": (r - 1) // 2}, im2col[0] if im2col else None)
            specs.extend([spec] if spec is not None else im2col)
        elif plain:
            nb, k, ho, wo = grad_out.shape
            spec = matmul_spec(1, weight.shape[1] * weight.shape[2] * weight.shape[3], nb * ho * wo, k, inp.dtype)
            specs.extend([spec] if spec is not None else [])
        elif i == 0:
            specs.extend(conv_specs(grad_out, weight, inp, groups))
        else:
            specs.extend(conv_specs(inp, weight, grad_out, groups))
    return specs


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], i: int, name: str, default: Any = None) -> Any:
    return args[i] if len(args) > i else kwargs.get(name, default)


def _dense_tokens(x: torch.Tensor) -> tuple[int, int, int]:
    """(batch, length, width) of a [B, L, E] (or [L, E]) activation."""
    if x.dim() == 2:
        return 1, x.shape[0], x.shape[1]
    return x.shape[0], x.shape[1], x.shape[-1]


def _attention_block(b: int, lq: int, lk: int, heads: int, head_dim: int, dtype: torch.dtype,
                     mask: torch.Tensor | None) -> list[KernelSpec]:
    """Multi-head attention's core for b x heads x [lq, lk]: the library flash attention where
    queries and keys are as long, else its two batched matmuls and a softmax."""
    if lq == lk:
        q = torch.empty((b, heads, lq, head_dim), dtype=dtype, device="meta")
        return attention_specs(q, mask, False, None)
    scores = torch.empty((b * heads, lq, lk), dtype=dtype, device="meta")
    soft = _library("softmax", (b * heads * lq, lk), dtype, {}, generic_spec("_softmax", [scores], [scores]))
    return [sp for sp in (matmul_spec(b * heads, lq, head_dim, lk, dtype, True, True), soft,
                          matmul_spec(b * heads, lq, lk, head_dim, dtype, True, False)) if sp is not None]


def _linear(tokens: int, k: int, n: int, dtype: torch.dtype) -> list[KernelSpec]:
    spec = matmul_spec(1, tokens, k, n, dtype, True, True)  # x @ w.T: row-major x, w stored [N, K]
    return [spec] if spec is not None else []


def _rows(kernel: str, rows: int, cols: int, dtype: torch.dtype, params: dict[str, Any], op: str) -> KernelSpec:
    meta = torch.empty((rows, cols), dtype=dtype, device="meta")
    generic = generic_spec(op, [meta, meta] if kernel == "binary" else [meta], [meta])
    return _library(kernel, (rows, cols), dtype, params, generic) or generic


def fused_op_specs(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], outputs: Sequence[torch.Tensor]
                   ) -> list[KernelSpec] | None:
    """The kernels of a fused op PyTorch's eval fast paths call (``nn.TransformerEncoderLayer``
    in eval under no_grad, ``nn.MultiheadAttention(need_weights=False)``): their projections and
    feed-forward matmuls on TensorE, attention as the library kernel, norms and residual adds on
    their library kernels - what the same layer costs in train mode, not one generic kernel with
    no FLOPs. None for every other op."""
    if any(isinstance(t, torch.Tensor) and t.dim() not in (2, 3) for t in args[:2]):
        return None  # not a [B, L, E] (or [L, E]) activation: the generic kernel's charge
    if name == "_native_multi_head_attention":
        q, k = args[0], args[1]
        embed, heads = int(args[3]), int(args[4])
        mask = _arg(args, kwargs, 9, "mask")
        b, lq, _ = _dense_tokens(q)
        _, lk, _ = _dense_tokens(k)
        dt = q.dtype
        return (_linear(b * lq, embed, embed, dt) + _linear(b * lk, embed, 2 * embed, dt)
                + _attention_block(b, lq, lk, heads, embed // heads, dt, mask) + _linear(b * lq, embed, embed, dt))
    if name == "_transformer_encoder_layer_fwd":
        src = args[0]
        embed, heads = int(args[1]), int(args[2])
        use_gelu, eps = bool(args[7]), float(args[9])
        ffn = args[14].shape[0]
        mask = _arg(args, kwargs, 18, "mask")
        b, length, _ = _dense_tokens(src)
        t, dt = b * length, src.dtype
        norm = _rows("layernorm", t, embed, dt, {"eps": eps}, "native_layer_norm")
        act = _rows("activation", t, ffn, dt, {"fn": "gelu" if use_gelu else "relu"}, "gelu" if use_gelu else "relu")
        add = _rows("binary", t, embed, dt, {"op": "add", "broadcast": "none"}, "add")
        return (_linear(t, embed, 3 * embed, dt) + _attention_block(b, length, length, heads, embed // heads, dt, mask)
                + _linear(t, embed, embed, dt) + [add, norm] + _linear(t, embed, ffn, dt) + [act]
                + _linear(t, ffn, embed, dt) + [add, norm])
    return None


def copy_spec(kind: str, src: torch.Tensor, dst: torch.Tensor) -> KernelSpec:
    """A copy between host and device or within the device (``kind``: copy_h2d/copy_d2h/copy_d2d)."""
    return generic_spec(kind, [src], [dst])


def fused_spec(op: str, lists: Sequence[Sequence[torch.Tensor]], singles: Sequence[torch.Tensor],
               produced: Sequence[torch.Tensor]) -> KernelSpec:
    """A ``_foreach_*`` op as one multi-tensor kernel: each tensor list read as one stream of all
    its elements, the outputs (or, in place, the first list) written as one."""
    def fused(ts: Sequence[Any]) -> torch.Tensor:
        tensors = [t for t in ts if isinstance(t, torch.Tensor)]
        return torch.empty(sum(t.numel() for t in tensors), dtype=tensors[0].dtype, device="meta")
    inputs = [fused(ts) for ts in lists] + list(singles)
    outputs = [fused(produced)] if produced else [fused(lists[0])] if lists else []
    return generic_spec(op, inputs, outputs)


TKG_BUCKET = 128  # attention_tkg reads the cached keys in whole 128-key tiles (a cache bucket)


def tkg_prior(s: int, l: int) -> int:
    """The cached keys ``attention_tkg`` reads for ``l`` active queries over ``s`` keys: the
    ``s - l`` before them, rounded up to whole :data:`TKG_BUCKET` tiles."""
    return -(-(s - l) // TKG_BUCKET) * TKG_BUCKET


def kv_cost_key(kv: tuple[int, int], l: int) -> tuple[Any, ...]:
    """``kv`` = (key heads, keys) as :func:`attention_specs`' kernels depend on it for ``l``
    queries: a decode step's keys by the bucket its cache is read in, so a cost memo keyed by it
    holds one entry per bucket of a generation's tokens, not one per token."""
    nkv, s = kv
    return (nkv, ("cache", tkg_prior(s, l)) if s != l else s)


def attention_specs(q: torch.Tensor, mask: torch.Tensor | None, causal: bool, scale: float | None,
                    dropout_p: float = 0.0, kv: tuple[int, int] | None = None) -> list[KernelSpec]:
    """The forward of fused attention, plus a generic kernel reading an explicit mask once.
    Queries as many as the keys: the library's flash-attention kernel (``causal`` when asked,
    dropping probabilities in the kernel with ``dropout_p``). ``kv`` = (key heads, keys) with
    fewer queries than keys (decoding over a KV cache: :func:`torch_bridge.ops.attention.takes_meta`
    admits up to ``TKG_MAX_ACTIVE``): the library's token-generation kernel ``attention_tkg``, the
    last ``L`` keys its active tokens and the ``S - L`` before them its cache, read as the kernel
    reads a cache, in whole tiles of :data:`TKG_BUCKET` keys (the ones past the sequence masked
    in the kernel). Its cost does not depend on the scale or on which keys are masked."""
    heads = q.shape[-3]
    b = q.numel() // max(1, heads * q.shape[-2] * q.shape[-1])
    l, e = q.shape[-2:]
    meta = torch.empty(q.shape, dtype=q.dtype, device="meta")
    generic = generic_spec("scaled_dot_product_attention", [meta, meta, meta], [meta])
    if kv is not None and kv[1] != l:
        nkv, s = kv
        specs = [_library("attention_tkg", (b, heads, nkv, l, tkg_prior(s, l), e), q.dtype, {}, generic) or generic]
    else:
        specs = [_library("attention", (b, heads, l, e), q.dtype,
                          {"causal": bool(causal), "scale": scale, "kv_block": 0,
                           **({"dropout_p": float(dropout_p)} if dropout_p else {})}, generic) or generic]
    if mask is not None:
        specs.append(generic_spec("attn_mask", [torch.empty(mask.shape, dtype=mask.dtype, device="meta")], []))
    return specs


def attention_backward_specs(q: torch.Tensor, s: int, dtype: torch.dtype) -> list[KernelSpec]:
    """The backward of fused attention: its four matmuls and a generic softmax backward
    (reads P and dP, writes dS)."""
    bh = q.numel() // (q.shape[-2] * q.shape[-1])
    l, e = q.shape[-2:]
    specs = [matmul_spec(bh, s, l, e, dtype, False, False),  # dV = Pᵀ dO (Pᵀ is P [L,S] read as lhsT)
             matmul_spec(bh, l, e, s, dtype, True, True),    # dP = dO Vᵀ (V stored [S,E])
             matmul_spec(bh, l, s, e, dtype, True, False),   # dQ = dS K
             matmul_spec(bh, s, l, e, dtype, False, False)]  # dK = dSᵀ Q (dS stored [L,S])
    scores = torch.empty((bh, l, s), dtype=torch.float32, device="meta")
    return [sp for sp in specs if sp is not None] + [generic_spec("softmax_bwd", [scores, scores], [scores])]
