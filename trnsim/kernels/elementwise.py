"""Elementwise kernels over a [rows, cols] tensor: ``unary``, ``binary`` (with broadcasting) and
``activation``, written as an NKI author would for an HBM-bound stream.

* **Tiling.** Work is cut into pieces of at most ``tile_bytes`` per partition. When a whole row
  fits, each partition takes ``g`` consecutive rows (a contiguous HBM block of ``g*cols``
  elements), so even narrow tensors move in large DMA descriptors (§6: >= 2-4 KiB per partition
  saturates an engine; < 512 B is overhead-bound). Wider rows are cut into 128-row x
  ``tile_bytes`` column tiles. A ragged last piece uses fewer partitions or columns.
* **Buffering.** Inputs and results each rotate through ``bufs`` buffers (3 by default), so an
  input buffer is free again as soon as its compute is done, not when its store is. Loads
  alternate between two DMA queues triggered from the Sync engine; stores go on another queue
  triggered from an engine that does no compute in this kernel, so a store waiting for its
  compute never holds up the next load.
* **Engines.** Vector-class work (ALU ops) alternates between VectorE and GpSimd in proportion
  to their rates; transcendental functions run on ScalarE (activation, datasheet §4.4).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

import numpy as np

from ..config import ChipConfig
from ..isa import ACTIVATIONS, ALU_OPS, HbmAP, HbmTensor, KernelError, TileAP
from ..builder.kernel import Kernel
from ..native.dtypes import Dtype, get_dtype
from .reference import round_to
from .registry import register_kernel, split_dims

__all__ = ["build_unary", "build_binary", "build_activation", "Piece", "row_pieces", "hbm_piece", "compute_engines",
           "tile_free_elems", "kernel_dtype", "checked_choice", "checked_bufs"]

DTYPES = ("bf16", "fp16", "fp32")

#: unary op -> (engine class, instruction, argument): "alu" ops are a tensor_scalar with an
#: immediate on Vector/GpSimd; "act" ops are ScalarE activation functions (reciprocal is 8N on
#: VectorE but N on ScalarE, §7).
UNARY_OPS: dict[str, tuple[str, str, float]] = {
    "neg": ("alu", "multiply", -1.0),
    "abs": ("alu", "abs_max", 0.0),
    "relu": ("alu", "maximum", 0.0),
    "square": ("act", "square", 0.0),
    "sqrt": ("act", "sqrt", 0.0),
    "rsqrt": ("act", "rsqrt", 0.0),
    "reciprocal": ("act", "reciprocal", 0.0),
    "exp": ("act", "exp", 0.0),
    "log": ("act", "log", 0.0),
    "sign": ("act", "sign", 0.0),
}
#: float ALU ops a binary kernel may apply (bitwise and comparison ops are not elementwise math)
BINARY_OPS = ("add", "subtract", "multiply", "divide", "maximum", "minimum", "abs_max", "power")
BROADCASTS = ("none", "row", "col", "scalar")
#: activation functions that want positive inputs (log, sqrt, ...) when checked with values
POSITIVE_DOMAIN = frozenset({"log", "sqrt", "rsqrt", "reciprocal"})


@dataclass(frozen=True)
class Piece:
    """A block of the [rows, cols] tensor handled by one tile: rows ``r0 .. r0 + p*g`` and
    columns ``c0 .. c0 + cols``; partition ``i`` holds ``g`` consecutive rows."""

    r0: int
    p: int
    g: int
    c0: int
    cols: int

    @property
    def free(self) -> int:
        return self.g * self.cols


def tile_free_elems(tile_bytes: int, dt: Dtype, what: str) -> int:
    """Elements per partition of a tile of ``tile_bytes`` (a kernel parameter, checked)."""
    if isinstance(tile_bytes, bool) or not isinstance(tile_bytes, int) or tile_bytes < dt.itemsize:
        raise KernelError(f"{what}: tile_bytes must be an integer >= {dt.itemsize} (bytes per partition), "
                          f"got {tile_bytes!r}")
    return tile_bytes // dt.itemsize


def row_pieces(rows: int, cols: int, max_free: int, partitions: int) -> Iterator[Piece]:
    """Cover [rows, cols] with pieces of at most ``partitions`` rows and ``max_free`` elements per
    partition. Column tiles are the outer loop when rows are cut, so a per-column operand is
    loaded once per column tile."""
    if cols <= max_free:
        g = max(1, max_free // cols)
        r = 0
        while rows - r >= partitions:
            gg = min(g, (rows - r) // partitions)
            yield Piece(r, partitions, gg, 0, cols)
            r += partitions * gg
        if r < rows:
            yield Piece(r, rows - r, 1, 0, cols)
        return
    for c in range(0, cols, max_free):
        for r in range(0, rows, partitions):
            yield Piece(r, min(partitions, rows - r), 1, c, min(max_free, cols - c))


def hbm_piece(t: HbmTensor, pc: Piece) -> HbmAP:
    """The HBM view of ``pc`` shaped [p, g*cols]; grouped rows are one contiguous block."""
    if pc.g == 1:
        return t[pc.r0:pc.r0 + pc.p, pc.c0:pc.c0 + pc.cols]
    return t[pc.r0:pc.r0 + pc.p * pc.g, :].reshape(pc.p, pc.g * pc.cols)


def compute_engines(dt: Dtype, split: bool) -> tuple[str, ...]:
    """Round-robin pattern for Vector-class work. For 16-bit data VectorE's performance modes
    (§4.3: 2-4x) make it about 3x GpSimd's rate (2N cycles at 1.2 GHz, §7), so GpSimd takes one
    tile in four; for fp32 the two are about even, so they alternate."""
    if not split:
        return ("vector",)
    return ("vector", "vector", "vector", "gpsimd") if dt.itemsize == 2 else ("vector", "gpsimd")


def kernel_dtype(dtype: Any, what: str) -> Dtype:
    """The kernel's data type: one of DTYPES (the engines compute in fp32 and round once)."""
    try:
        dt = get_dtype(dtype)
    except ValueError:
        dt = None
    if dt is None or dt.short not in DTYPES:
        name = dt.short if dt is not None else repr(dtype)
        raise KernelError(f"{what}: dtype {name} not supported; expected one of {', '.join(DTYPES)}")
    return dt


def checked_choice(value: Any, allowed: tuple[str, ...] | Mapping[str, Any], what: str) -> str:
    """``value`` if it is one of ``allowed``, else a one-line error listing them."""
    if value not in allowed:
        raise KernelError(f"{what}: expected one of {', '.join(allowed)}, got {value!r}")
    return str(value)


def checked_bufs(bufs: Any, what: str) -> int:
    if isinstance(bufs, bool) or not isinstance(bufs, int) or bufs < 2:
        raise KernelError(f"{what}: bufs must be an integer >= 2 (double buffering or deeper), got {bufs!r}")
    return bufs


def _stream(kern: Kernel, x: HbmTensor, out: HbmTensor, dt: Dtype, max_free: int, bufs: int,
            compute: Callable[[TileAP, TileAP, int], None], store_engine: str) -> None:
    """Load each piece of ``x``, ``compute(result, tile, i)``, store the result to ``out``. The
    result has buffers of its own, so a load need not wait for the store of its buffer."""
    rows, cols = x.shape
    pool = kern.tile_pool("x", bufs=bufs)
    res_pool = kern.tile_pool("out", bufs=bufs)
    for i, pc in enumerate(row_pieces(rows, cols, max_free, kern.config.core.sbuf.partitions)):
        t = pool.tile((pc.p, pc.free), dt)
        kern.dma_copy(t, hbm_piece(x, pc), queue=i % 2)
        o = res_pool.tile((pc.p, pc.free), dt)
        compute(o, t, i)
        kern.dma_copy(hbm_piece(out, pc), o, engine=store_engine, queue=0)


# ---- unary ------------------------------------------------------------------------------------


def _x_input(rows: int, cols: int, positive: bool, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Random x for a value check; functions defined for positive x (log, sqrt...) get (0.1, 4)."""
    if positive:
        return {"x": rng.uniform(0.1, 4.0, (rows, cols)).astype(np.float32)}
    return {"x": (2 * rng.standard_normal((rows, cols))).astype(np.float32)}


def _unary_inputs(shape, dtype, params, rng):
    return _x_input(*shape, UNARY_OPS[params["op"]][1] in POSITIVE_DOMAIN, rng)


def _unary_ref(x: np.ndarray, op: str) -> np.ndarray:
    kind, name, arg = UNARY_OPS[op]
    if kind == "alu":
        return ALU_OPS[name](x, arg)
    return ACTIVATIONS[name][0](x)


def _unary_reference(inputs, shape, dtype, params):
    return {"out": _unary_ref(round_to(inputs["x"], dtype), params["op"])}


@register_kernel("unary", dims="rowsxcols", dtypes=DTYPES, default_shape=(4096, 4096),
                 summary="out = op(x): neg/abs/relu on VectorE+GpSimd, sqrt/rsqrt/reciprocal/exp/... on ScalarE",
                 params={"op": "neg", "tile_bytes": 16384, "bufs": 3, "split": True},
                 inputs=_unary_inputs, reference=_unary_reference, split=split_dims(0, 1))
def build_unary(rows: int, cols: int, dtype: str = "bf16", config: ChipConfig | str = "trn2", op: str = "neg",
                tile_bytes: int = 16384, bufs: int = 3, split: bool = True) -> Kernel:
    what = "unary"
    op = checked_choice(op, UNARY_OPS, f"{what}: op")
    dt = kernel_dtype(dtype, what)
    kern = Kernel(f"unary_{op}", config)
    x = kern.input("x", (rows, cols), dt)
    out = kern.output("out", (rows, cols), dt)
    kind, name, arg = UNARY_OPS[op]
    engines = compute_engines(dt, split)

    def compute(o: TileAP, t: TileAP, i: int) -> None:
        if kind == "alu":
            kern.tensor_scalar(o, t, name, arg, engine=engines[i % len(engines)])
        else:
            kern.activation(o, name, t)

    _stream(kern, x, out, dt, tile_free_elems(tile_bytes, dt, what), checked_bufs(bufs, what), compute,
            store_engine="scalar" if kind == "alu" else "gpsimd")
    return kern


# ---- activation -------------------------------------------------------------------------------


def _act_inputs(shape, dtype, params, rng):
    return _x_input(*shape, params["fn"] in POSITIVE_DOMAIN, rng)


def _act_reference(inputs, shape, dtype, params):
    x = round_to(inputs["x"], dtype) * params["scale"]
    return {"out": ACTIVATIONS[params["fn"]][0](x)}


@register_kernel("activation", dims="rowsxcols", dtypes=DTYPES, default_shape=(4096, 4096),
                 summary=f"out = fn(x*scale) on ScalarE; fn: {', '.join(sorted(ACTIVATIONS))}",
                 params={"fn": "gelu", "scale": 1.0, "tile_bytes": 16384, "bufs": 3},
                 inputs=_act_inputs, reference=_act_reference, split=split_dims(0, 1))
def build_activation(rows: int, cols: int, dtype: str = "bf16", config: ChipConfig | str = "trn2",
                     fn: str = "gelu", scale: float = 1.0, tile_bytes: int = 16384, bufs: int = 3) -> Kernel:
    what = "activation"
    fn = checked_choice(fn, tuple(sorted(ACTIVATIONS)), f"{what}: fn")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise KernelError(f"{what}: scale must be a number, got {scale!r}")
    dt = kernel_dtype(dtype, what)
    kern = Kernel(f"activation_{fn}", config)
    x = kern.input("x", (rows, cols), dt)
    out = kern.output("out", (rows, cols), dt)

    def compute(o: TileAP, t: TileAP, i: int) -> None:
        kern.activation(o, fn, t, scale=float(scale))

    _stream(kern, x, out, dt, tile_free_elems(tile_bytes, dt, what), checked_bufs(bufs, what), compute,
            store_engine="gpsimd")
    return kern


# ---- binary -----------------------------------------------------------------------------------


def _b_shape(rows: int, cols: int, broadcast: str) -> tuple[int, int]:
    return {"none": (rows, cols), "row": (1, cols), "col": (rows, 1), "scalar": (1, 1)}[broadcast]


def _binary_inputs(shape, dtype, params, rng):
    rows, cols = shape
    a = rng.standard_normal((rows, cols)).astype(np.float32)
    b = rng.standard_normal(_b_shape(rows, cols, params["broadcast"])).astype(np.float32)
    if params["op"] == "divide":  # keep the divisor away from zero
        b = np.where(b < 0, b - 0.5, b + 0.5).astype(np.float32)
    if params["op"] == "power":  # a positive base, modest exponents
        a = np.abs(a) + 0.25
        b = np.clip(b, -2.0, 2.0)
    return {"a": a, "b": b}


def _binary_reference(inputs, shape, dtype, params):
    a, b = round_to(inputs["a"], dtype), round_to(inputs["b"], dtype)
    return {"out": ALU_OPS[params["op"]](a, b)}


@register_kernel("binary", dims="rowsxcols", dtypes=DTYPES, default_shape=(4096, 4096),
                 summary="out = a op b; op: " + "/".join(BINARY_OPS) + "; b is [rows,cols], [1,cols] (row), "
                         "[rows,1] (col) or [1,1] (scalar)",
                 params={"op": "add", "broadcast": "none", "tile_bytes": 16384, "bufs": 3, "split": True},
                 inputs=_binary_inputs, reference=_binary_reference, split=split_dims(0, 1))
def build_binary(rows: int, cols: int, dtype: str = "bf16", config: ChipConfig | str = "trn2", op: str = "add",
                 broadcast: str = "none", tile_bytes: int = 16384, bufs: int = 3, split: bool = True) -> Kernel:
    what = "binary"
    op = checked_choice(op, BINARY_OPS, f"{what}: op")
    broadcast = checked_choice(broadcast, BROADCASTS, f"{what}: broadcast")
    dt = kernel_dtype(dtype, what)
    bufs = checked_bufs(bufs, what)
    max_free = tile_free_elems(tile_bytes, dt, what)
    kern = Kernel(f"binary_{op}", config)
    a = kern.input("a", (rows, cols), dt)
    b = kern.input("b", _b_shape(rows, cols, broadcast), dt)
    out = kern.output("out", (rows, cols), dt)
    engines = compute_engines(dt, split)
    a_pool = kern.tile_pool("a", bufs=bufs)
    b_pool = kern.tile_pool("b", bufs=bufs if broadcast in ("none", "col") else 2)
    o_pool = kern.tile_pool("out", bufs=bufs)  # a result tile of its own frees the inputs' buffers early

    b_tile: TileAP | None = None
    if broadcast == "scalar":  # one value, replicated to every partition by a stride-0 read
        parts = kern.config.core.sbuf.partitions
        b_tile = b_pool.tile((parts, 1), dt)
        kern.dma_copy(b_tile, b.ap(0, [[0, parts], [1, 1]]), queue=1)
    b_c0 = -1
    for i, pc in enumerate(row_pieces(rows, cols, max_free, kern.config.core.sbuf.partitions)):
        eng = engines[i % len(engines)]
        t = a_pool.tile((pc.p, pc.free), dt)
        kern.dma_copy(t, hbm_piece(a, pc), queue=0)
        o = o_pool.tile((pc.p, pc.free), dt)
        if broadcast == "none":
            bt = b_pool.tile((pc.p, pc.free), dt)
            kern.dma_copy(bt, hbm_piece(b, pc), queue=1)
            kern.tensor_tensor(o, t, bt, op, engine=eng)
        elif broadcast == "scalar":
            assert b_tile is not None
            kern.tensor_scalar(o, t, op, b_tile[:pc.p], engine=eng)
        elif broadcast == "row":
            if pc.c0 != b_c0:  # the row of b for this column tile, on every partition
                parts = kern.config.core.sbuf.partitions
                b_tile = b_pool.tile((parts, pc.cols), dt)
                kern.dma_copy(b_tile, b.ap(pc.c0, [[0, parts], [1, pc.cols]]), queue=1)
                b_c0 = pc.c0
            assert b_tile is not None
            bv = b_tile[:pc.p].broadcast_to(pc.p, pc.g, pc.cols)
            kern.tensor_tensor(o.reshape(pc.p, pc.g, pc.cols), t.reshape(pc.p, pc.g, pc.cols), bv, op, engine=eng)
        else:  # col: one value per row
            bt = b_pool.tile((pc.p, pc.g), dt)
            kern.dma_copy(bt, hbm_piece(b, Piece(pc.r0, pc.p, pc.g, 0, 1)), queue=1)
            if pc.g == 1:
                kern.tensor_scalar(o, t, op, bt, engine=eng)
            else:
                bv = bt.reshape(pc.p, pc.g, 1).broadcast_to(pc.p, pc.g, pc.cols)
                kern.tensor_tensor(o.reshape(pc.p, pc.g, pc.cols), t.reshape(pc.p, pc.g, pc.cols), bv, op, engine=eng)
        kern.dma_copy(hbm_piece(out, pc), o, engine="scalar", queue=0)
    return kern
