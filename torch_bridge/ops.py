"""Which library kernel an aten op lowers to, with which shape and params.

Each rule reads the op's arguments and result and returns ``(kernel, shape, params)`` or None
when the library kernel does not express this call (then the op gets the generic kernel). The
shapes are the library's: elementwise and reduction kernels see the tensor as
``[numel / last dim, last dim]``, as a NeuronCore kernel tiles it (rows on partitions).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch

__all__ = ["RULES", "Route"]

Route = Optional[tuple[str, tuple[int, ...], dict[str, Any]]]

BINARY = {"add": "add", "sub": "subtract", "rsub": "subtract", "mul": "multiply", "div": "divide",
          "maximum": "maximum", "minimum": "minimum", "pow": "power"}
UNARY = {"neg": "neg", "abs": "abs", "relu": "relu", "sqrt": "sqrt", "rsqrt": "rsqrt", "reciprocal": "reciprocal",
         "exp": "exp", "log": "log", "sign": "sign", "square": "square"}
ACTIVATION = {"sigmoid": "sigmoid", "tanh": "tanh", "silu": "silu", "erf": "erf", "softplus": "softplus",
              "mish": "mish", "sin": "sin", "atan": "arctan"}
REDUCE = {"sum": "sum", "mean": "mean", "amax": "max", "amin": "min", "max": "max", "min": "min"}


def _rows_cols(t: torch.Tensor) -> tuple[int, int]:
    cols = t.shape[-1] if t.dim() else 1
    return (t.numel() // cols if cols else 0), cols


def _binary(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], out: torch.Tensor) -> Route:
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
    return "binary", (rows, cols), {"op": BINARY[name.rstrip("_")], "broadcast": bc}


def _unary(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], out: torch.Tensor) -> Route:
    return "unary", _rows_cols(out), {"op": UNARY[name.rstrip("_")]}


def _activation(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], out: torch.Tensor) -> Route:
    return "activation", _rows_cols(out), {"fn": ACTIVATION[name.rstrip("_")]}


def _gelu(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], out: torch.Tensor) -> Route:
    approximate = kwargs.get("approximate", args[1] if len(args) > 1 else "none")
    return "activation", _rows_cols(out), {"fn": "gelu_apprx_tanh" if approximate == "tanh" else "gelu"}


def _reduce(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], out: torch.Tensor) -> Route:
    x = args[0]
    dim = kwargs.get("dim")
    if len(args) > 1 and not isinstance(args[1], (torch.dtype, bool)):
        dim = args[1]
    dims = [dim] if isinstance(dim, int) else list(dim) if dim is not None else []
    dims = sorted({d % max(x.dim(), 1) for d in dims})
    if not dims or len(dims) == x.dim():  # a full reduction: the row pass does the work
        rows, cols = _rows_cols(x)
        return "reduce", (rows, cols), {"op": REDUCE[name], "axis": 1}
    if dims == [x.dim() - 1]:
        return "reduce", _rows_cols(x), {"op": REDUCE[name], "axis": 1}
    if dims == [0] and x.dim() >= 2:
        return "reduce", (x.shape[0], x.numel() // x.shape[0]), {"op": REDUCE[name], "axis": 0}
    return None


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


RULES: dict[str, Callable[..., Route]] = {
    **{n: _binary for n in BINARY}, **{n + "_": _binary for n in BINARY},
    **{n: _unary for n in UNARY}, **{n + "_": _unary for n in UNARY},
    **{n: _activation for n in ACTIVATION}, **{n + "_": _activation for n in ACTIVATION},
    "gelu": _gelu, "gelu_": _gelu,
    **{n: _reduce for n in REDUCE},
    "_softmax": _softmax,
    "native_layer_norm": _layer_norm,
    "embedding": _embedding,
}
