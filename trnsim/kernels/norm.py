"""Row-wise normalisations: softmax, layer norm and RMS norm (optionally fused with FP8 quantization).

Each kernel works on ``x[rows, hidden]`` and is written the way an NKI author writes one:

* 128 rows per tile, one row per partition, the hidden dim along the free axis; the last tile
  may be ragged (fewer partitions, always starting at partition 0);
* loads on the Sync queue into a pool of rotating buffers (the next tile streams
  in while this one is computed), stores triggered from GpSimd on their own queue, so a store
  never waits behind the next load;
* ScalarE does the full-width passes whose per-row sum or max it can fuse (``activation`` with
  ``reduce_op``/``reduce_res``: exp + row sum, square + sum of squares, abs + row max); VectorE
  does the [P, 1] statistics and the elementwise products with gamma/beta, so the two engines
  split the work of a tile and overlap across tiles;
* gamma and beta are loaded once, broadcast across the partitions by a stride-0 HBM access
  pattern, and stay resident;
* the loop over row tiles is software-pipelined (:func:`_pipelined`): engines run their
  instructions in program order, so the next tile's statistics are queued before this tile's
  finishing pass.

Tiles are updated in place where the input is no longer needed, which keeps SBUF use to a few
rows of ``hidden`` per partition; ScalarE's discarded elementwise results go to one scratch tile
of at most 4096 columns (wider rows take one pass per chunk).

Rows too wide for that layout (layernorm and rmsnorm at hidden 32768 bf16 on Trn2) run *wide*:
no work buffers; the finishing pass works in place, chunk by chunk, on the input row. SBUF holds
the input rows (two buffers where they fit, so the next row tile streams in while this one is
computed) and gamma/beta: resident where they fit beside two input buffers, else streamed per
4096-column chunk for every row tile (broadcast to every partition by the DMA, so a streamed
vector costs HBM reads the size of a row tile: layernorm bf16 32768 keeps gamma and streams
beta). The fixed skew of :func:`_pipelined` is too short for so few buffers, so a wide kernel
is list-scheduled (:mod:`trnsim.schedule`), as the Neuron compiler schedules a kernel.
``hidden`` is limited by one access-pattern dim (65535 elements) and by the wide layout fitting
SBUF; a one-line error names the largest that fits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import ml_dtypes
import numpy as np

from ..config import ChipConfig
from ..isa import HbmTensor, KernelError, TileAP
from ..isa import AP_MAX_SIZE
from ..builder.kernel import Kernel, TilePool, checked_dtype
from ..native.dtypes import Dtype, get_dtype
from .reference import default_tolerance, round_to
from .registry import register_kernel, split_dims

__all__ = ["build_softmax", "build_layernorm", "build_rmsnorm", "build_rmsnorm_fp8"]

FP8_OUT = ("float8_e4m3", "float8_e4m3fn")  # 3 mantissa bits: the rounding _fp8_tolerance allows for
SCRATCH_COLS = 4096  # elements per partition of the scratch tile; wider rows take several passes
STATS_GRANULES = 64  # allocation granules per partition for the [P, 1] statistics tiles (generous)


# ---------------------------------------------------------------------------------------------
# Shared structure
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Plan:
    """The SBUF layout shared by the kernels."""

    parts: int  # partitions per row tile (128, or fewer when rows < 128)
    io_bufs: int  # rotating input buffers (pipeline stages + 1 when SBUF allows, at least 2)
    scratch_cols: int  # width of the scratch tile ScalarE writes discarded results to
    wide: bool = False  # rows too wide for the resident layout: the finishing pass goes by chunks
    chunk: int = SCRATCH_COLS  # columns per chunk in the wide layout
    resident: int = 0  # wide: how many of the kernel's vectors (gamma, beta) stay resident; the rest stream


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _plan(name: str, rows: int, hidden: int, dt: Dtype, kern: Kernel, rows_dt: int, rows_fp8: int = 0,
          stages: int = 2, chunk_bufs: int = 0, vectors: int = 0) -> _Plan:
    """Choose the buffering and check that ``hidden`` fits SBUF.

    Besides the input buffers, a kernel keeps ``rows_dt`` [P, hidden] tiles of ``dt`` (gamma,
    beta, work buffers), ``rows_fp8`` of one byte per element (fp8 output buffers) and a
    scratch tile of at most ``SCRATCH_COLS`` elements. A kernel pipelined over ``stages`` has
    that many tiles in flight, so ``stages + 1`` input buffers let the next load run ahead.
    """
    cfg = kern.config
    cap = cfg.core.sbuf.partition_bytes
    granule = cfg.core.sbuf.allocation_granule

    def need(h: int, io_bufs: int) -> int:
        row = _round_up(h * dt.itemsize, granule)
        scratch = _round_up(min(h, SCRATCH_COLS) * dt.itemsize, granule)
        return (io_bufs + rows_dt) * row + rows_fp8 * _round_up(h, granule) + scratch + STATS_GRANULES * granule

    parts = min(cfg.core.sbuf.partitions, rows)
    if hidden <= AP_MAX_SIZE and need(hidden, 2) <= cap:
        io_bufs = max(n for n in range(2, stages + 2) if need(hidden, n) <= cap)
        return _Plan(parts=parts, io_bufs=io_bufs, scratch_cols=min(hidden, SCRATCH_COLS))

    def need_wide(h: int, io_bufs: int, resident: int) -> int:
        """Input rows and the resident vectors; chunk tiles for streamed vectors and outputs."""
        row = _round_up(h * dt.itemsize, granule)
        chunk = _round_up(min(h, SCRATCH_COLS) * max(dt.itemsize, 1), granule)
        streamed = 2 * (vectors - resident)
        return (io_bufs + resident) * row + (chunk_bufs + streamed + 1) * chunk + STATS_GRANULES * granule + 64 * granule

    if hidden <= AP_MAX_SIZE and vectors:
        # keep as many vectors resident as still leave two input buffers (loads overlap compute);
        # a streamed vector is read from HBM again for every row tile (the DMA broadcasts it to
        # each partition); with room for one input buffer only, keep them all resident
        options = [(io, res) for res in range(vectors, -1, -1) for io in (2, 1) if need_wide(hidden, io, res) <= cap]
        options.sort(key=lambda o: (-o[0], -o[1]))
        if options:
            io, res = options[0]
            if io == 1:
                res = max(r for i, r in options if i == 1)
            io = max(n for n in range(io, stages + 2) if need_wide(hidden, n, res) <= cap)
            return _Plan(parts=parts, io_bufs=io, scratch_cols=min(hidden, SCRATCH_COLS), wide=True, resident=res)
    if hidden > AP_MAX_SIZE:
        raise KernelError(f"{name}: hidden={hidden} exceeds the {AP_MAX_SIZE} elements one access-pattern dim can "
                          f"address (uint16 sizes, datasheet §4.6); hidden must be <= {AP_MAX_SIZE}")
    fits = (lambda h: need_wide(h, 1, 0) <= cap) if vectors else (lambda h: need(h, 2) <= cap)
    hmax = min(AP_MAX_SIZE, cap // max(1, dt.itemsize))
    while hmax > 1 and not fits(hmax):
        hmax -= 1
    needed = need_wide(hidden, 1, 0) if vectors else need(hidden, 2)
    raise KernelError(f"{name}: hidden={hidden} {dt.short} does not fit SBUF on {cfg.name} "
                      f"({needed // 1024} KiB per partition needed, {cap // 1024} KiB available); "
                      f"hidden must be <= {hmax}")


def _check_dims(name: str, rows: int, hidden: int) -> None:
    for what, n in (("rows", rows), ("hidden", hidden)):
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise KernelError(f"{name}: {what} must be a positive integer, got {n!r}")


def _check_eps(name: str, eps: Any) -> float:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        raise KernelError(f"{name}: eps must be a positive number, got {eps!r}")
    return float(eps)


def _broadcast_rows(kern: Kernel, tile: TileAP, vec: HbmTensor) -> None:
    """Load a [hidden] vector into every partition of a resident [parts, hidden] tile. Kernels
    issue it after their first row tile's load, on a second queue, so ScalarE can start on
    those rows while it streams in (gamma is needed only by the second pass)."""
    (hidden,) = vec.shape
    kern.dma_copy(tile, vec.ap(0, [[0, tile.p_count], [1, hidden]]), queue=1)


def _fused_reduce(kern: Kernel, scratch: TileAP, func: str, src: TileAP, res: TileAP, reduce_op: str,
                  partials: TilePool, *, bias: TileAP | None = None) -> None:
    """``res = reduce_op over the row of func(src + bias)`` on ScalarE, the elementwise results
    going to ``scratch``. Rows wider than the scratch tile take one pass per chunk, each reducing
    into a column of a ``partials`` tile, and one more pass combines the columns."""
    p, n = src.p_count, src.free_size
    cols = scratch.free_size
    if n <= cols:
        kern.activation(scratch[:p, :n], func, src, bias=bias, reduce_op=reduce_op, reduce_res=res)
        return
    chunks = -(-n // cols)
    part = partials.tile((scratch.p_count, chunks), "fp32")[:p]
    for c in range(chunks):
        lo, hi = c * cols, min(n, (c + 1) * cols)
        kern.activation(scratch[:p, :hi - lo], func, src[:, lo:hi], bias=bias, reduce_op=reduce_op,
                        reduce_res=part[:, c:c + 1])
    # combined on ScalarE too: in order after its own passes, so no other engine waits for them
    kern.activation(part, "copy", part, reduce_op=reduce_op, reduce_res=res)


def _row_tiles(rows: int, parts: int) -> list[tuple[int, int]]:
    """(first row, row count) of each tile; the last may be ragged."""
    return [(r, min(parts, rows - r)) for r in range(0, rows, parts)]


def _pipelined(tiles: list[tuple[int, int]], *stages: Callable[[int, int, Any], Any], bufs: int) -> None:
    """Emit the stages of successive row tiles skewed, newest tile first: with two stages
    A(0), A(1) B(0), A(2) B(1), ... Each engine runs its instructions in program order, so this
    queues the next tile's statistics ahead of this tile's finishing pass, and an engine waiting
    for another's result has work to do meanwhile (what the Neuron compiler's scheduler does
    for an NKI loop). Each stage takes (first row, row count, the previous stage's result).

    A tile's input buffer is live from its first stage to its last, so the skew is at most
    ``bufs`` (the rotating input buffers) deep: with fewer buffers than stages, the last stages
    run together as one."""
    if bufs < 1:
        raise ValueError("bufs must be >= 1")
    while len(stages) > bufs:
        *head, b, c = stages
        stages = (*head, lambda r, p, st, b=b, c=c: c(r, p, b(r, p, st)))
    states: list[Any] = [None] * len(tiles)
    for step in range(len(tiles) + len(stages) - 1):
        for s, stage in enumerate(stages):
            i = step - s
            if 0 <= i < len(tiles):
                states[i] = stage(*tiles[i], states[i])


# ---------------------------------------------------------------------------------------------
# Inputs and references (float64 from the rounded inputs)
# ---------------------------------------------------------------------------------------------


def _x_inputs(shape, dtype, params, rng):
    rows, hidden = shape
    return {"x": rng.standard_normal((rows, hidden), dtype=np.float32)}


def _affine_inputs(shape, dtype, params, rng, with_beta: bool):
    rows, hidden = shape
    out = _x_inputs(shape, dtype, params, rng)
    out["gamma"] = (1.0 + 0.25 * rng.standard_normal(hidden)).astype(np.float32)
    if with_beta:
        out["beta"] = (0.25 * rng.standard_normal(hidden)).astype(np.float32)
    return out


def _softmax_reference(inputs, shape, dtype, params):
    x = round_to(inputs["x"], dtype)
    e = np.exp(x - x.max(axis=1, keepdims=True))
    return {"y": e / e.sum(axis=1, keepdims=True)}


def _layernorm_reference(inputs, shape, dtype, params):
    x = round_to(inputs["x"], dtype)
    mean = x.mean(axis=1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=1, keepdims=True)
    y = (x - mean) / np.sqrt(var + params["eps"])
    return {"y": y * round_to(inputs["gamma"], dtype) + round_to(inputs["beta"], dtype)}


def _fp8_max(name: str) -> float:
    return float(ml_dtypes.finfo(get_dtype(name).np_dtype).max)


def _rmsnorm_reference(inputs, shape, dtype, params):
    x = round_to(inputs["x"], dtype)
    y = x / np.sqrt((x * x).mean(axis=1, keepdims=True) + params["eps"]) * round_to(inputs["gamma"], dtype)
    if not params.get("quantize"):
        return {"y": y}
    amax = np.abs(y).max(axis=1, keepdims=True)
    scale = amax / _fp8_max(params["fp8"])
    return {"q": y / scale, "scale": scale}


# ---------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------


@register_kernel("softmax", dims="ROWSxCOLS", dtypes=("bf16", "fp32"), default_shape=(4096, 4096),
                 summary="y = softmax(x) along each row, max-subtracted; exp and row sum fused on ScalarE",
                 inputs=_x_inputs, reference=_softmax_reference, split=split_dims(0))
def build_softmax(rows: int, cols: int, dtype: str = "bf16", config: ChipConfig | str = "trn2",
                  name: str = "softmax") -> Kernel:
    _check_dims("softmax", rows, cols)
    kern = Kernel(name, config)
    dt = checked_dtype(dtype, kern.name)
    plan = _plan("softmax", rows, cols, dt, kern, rows_dt=0)
    x = kern.input("x", (rows, cols), dt)
    y = kern.output("y", (rows, cols), dt)
    io = kern.tile_pool("io", bufs=plan.io_bufs)
    stats = kern.tile_pool("stats", bufs=6)

    def stage_a(r: int, p: int, _: None) -> tuple[TileAP, TileAP]:
        t = io.tile((plan.parts, cols), dt)[:p]
        kern.dma_copy(t, x[r:r + p, :])
        # the row max is one of the inputs, so it is exact in their dtype (and bf16 reduces at 2x)
        neg_max = stats.tile((plan.parts, 1), dt)[:p]
        row_sum = stats.tile((plan.parts, 1), "fp32")[:p]
        kern.tensor_reduce(neg_max, "max", t, axis=1, negate=True)
        # exp(x - max) in place; the row sum is taken from the fp32 results before rounding
        kern.activation(t, "exp", t, bias=neg_max, reduce_op="add", reduce_res=row_sum)
        return t, row_sum

    def stage_b(r: int, p: int, st: tuple[TileAP, TileAP]) -> None:
        t, row_sum = st
        kern.tensor_scalar(t, t, "divide", row_sum)
        kern.dma_copy(y[r:r + p, :], t, engine="gpsimd")

    _pipelined(_row_tiles(rows, plan.parts), stage_a, stage_b, bufs=plan.io_bufs)
    return kern


@register_kernel("layernorm", dims="ROWSxHIDDEN", dtypes=("bf16", "fp32"), default_shape=(4096, 4096),
                 summary="y = (x - mean) / sqrt(var + eps) * gamma + beta per row (two-pass variance)",
                 params={"eps": 1e-5}, inputs=lambda s, d, p, g: _affine_inputs(s, d, p, g, True),
                 reference=_layernorm_reference, split=split_dims(0))
def build_layernorm(rows: int, hidden: int, dtype: str = "bf16", config: ChipConfig | str = "trn2",
                    eps: float = 1e-5, name: str = "layernorm") -> Kernel:
    _check_dims("layernorm", rows, hidden)
    eps = _check_eps("layernorm", eps)
    kern = Kernel(name, config)
    dt = checked_dtype(dtype, kern.name)
    plan = _plan("layernorm", rows, hidden, dt, kern, rows_dt=2, stages=3, vectors=2)
    x = kern.input("x", (rows, hidden), dt)
    gamma = kern.input("gamma", (hidden,), dt)
    beta = kern.input("beta", (hidden,), dt)
    y = kern.output("y", (rows, hidden), dt)
    # gamma and beta broadcast to every partition, resident; in the wide layout (rows too wide
    # for work buffers) those that do not fit are streamed per chunk and the finishing pass runs
    # in place, a chunk at a time
    (g, b), stream = _vectors(kern, plan, dt, gamma, beta)
    chunks = _chunks(hidden, plan.chunk) if plan.wide else [(0, hidden)]
    # ScalarE must write its squares somewhere; one scratch tile serves every row tile
    scratch = kern.sbuf((plan.parts, plan.scratch_cols), dt, name="scratch")
    io = kern.tile_pool("io", bufs=plan.io_bufs)
    stats = kern.tile_pool("stats", bufs=16)
    partials = kern.tile_pool("partials", bufs=4)
    inv_h = 1.0 / hidden

    # ScalarE: row sum, then the centred sum of squares; VectorE: the [P, 1] statistics, then
    # the normalisation and gamma/beta. Each stage needs only earlier stages' results, so in
    # the skewed order every engine finds its first instruction of a step ready.
    def load_sum(r: int, p: int, _: None) -> tuple[TileAP, TileAP]:
        t = io.tile((plan.parts, hidden), dt)[:p]
        kern.dma_copy(t, x[r:r + p, :])
        if r == 0:
            for tile, vec in ((g, gamma), (b, beta)):
                if tile is not None:
                    _broadcast_rows(kern, tile, vec)
        row_sum = stats.tile((plan.parts, 1), "fp32")[:p]
        _fused_reduce(kern, scratch, "identity", t, row_sum, "add", partials)
        return t, row_sum

    def variance(r: int, p: int, st: tuple[TileAP, TileAP]) -> tuple[TileAP, TileAP, TileAP]:
        t, row_sum = st
        neg_mean, ssd = (stats.tile((plan.parts, 1), "fp32")[:p] for _ in range(2))
        kern.tensor_scalar(neg_mean, row_sum, "multiply", -inv_h)
        # sum((x - mean)^2): the centred second pass, fused with its sum on ScalarE
        _fused_reduce(kern, scratch, "square", t, ssd, "add", partials, bias=neg_mean)
        return t, neg_mean, ssd

    def normalize(r: int, p: int, st: tuple[TileAP, TileAP, TileAP]) -> None:
        t, neg_mean, ssd = st
        rstd = stats.tile((plan.parts, 1), "fp32")[:p]
        kern.tensor_scalar(rstd, ssd, "multiply", inv_h, op1="add", operand1=eps)
        kern.tensor_scalar(rstd, rstd, "power", -0.5)
        for c0, c1 in chunks:
            tc = t[:, c0:c1]
            kern.tensor_scalar(tc, tc, "add", neg_mean, op1="multiply", operand1=rstd)
            kern.tensor_tensor(tc, tc, _chunk_of(kern, plan, dt, g, stream, gamma, c0, c1, p), "multiply")
            kern.tensor_tensor(tc, tc, _chunk_of(kern, plan, dt, b, stream, beta, c0, c1, p), "add")
        kern.dma_copy(y[r:r + p, :], t, engine="gpsimd")

    _pipelined(_row_tiles(rows, plan.parts), load_sum, variance, normalize, bufs=plan.io_bufs)
    return _scheduled(kern) if plan.wide else kern


def _chunks(hidden: int, cols: int) -> list[tuple[int, int]]:
    return [(c, min(hidden, c + cols)) for c in range(0, hidden, cols)]


def _stream_rows(kern: Kernel, pool: TilePool, plan: _Plan, vec: HbmTensor, c0: int, c1: int, p: int,
                 dt: Dtype) -> TileAP:
    """Columns [c0, c1) of a [hidden] vector broadcast to ``p`` partitions, in a chunk tile."""
    t = pool.tile((plan.parts, plan.chunk), dt)[:p, :c1 - c0]
    kern.dma_copy(t, vec.ap(c0, [[0, p], [1, c1 - c0]]), queue=1)
    return t


def _vectors(kern: Kernel, plan: _Plan, dt: Dtype, *vecs: HbmTensor) -> tuple[list[TileAP | None], TilePool]:
    """gamma/beta broadcast to every partition: all resident, or in the wide layout the first
    ``plan.resident`` (loaded with the first row tile), the others None (streamed per chunk from
    the pool)."""
    resident = plan.resident if plan.wide else len(vecs)
    tiles: list[TileAP | None] = []
    for i, v in enumerate(vecs):
        tiles.append(kern.sbuf((plan.parts, v.shape[0]), dt, name=f"{v.name}_bcast") if i < resident else None)
    return tiles, kern.tile_pool("stream", bufs=2 * (len(vecs) - resident) or 1)


def _chunk_of(kern: Kernel, plan: _Plan, dt: Dtype, tile: TileAP | None, pool: TilePool, vec: HbmTensor,
              c0: int, c1: int, p: int) -> TileAP:
    return tile[:p, c0:c1] if tile is not None else _stream_rows(kern, pool, plan, vec, c0, c1, p, dt)


@register_kernel("rmsnorm", dims="ROWSxHIDDEN", dtypes=("bf16", "fp32"), default_shape=(4096, 8192),
                 summary="y = x / sqrt(mean(x^2) + eps) * gamma per row; sum of squares fused on ScalarE",
                 params={"eps": 1e-6}, inputs=lambda s, d, p, g: _affine_inputs(s, d, p, g, False),
                 reference=_rmsnorm_reference, split=split_dims(0))
def build_rmsnorm(rows: int, hidden: int, dtype: str = "bf16", config: ChipConfig | str = "trn2",
                  eps: float = 1e-6, quantize: bool = False, fp8: str = "fp8_e4m3", name: str = "rmsnorm"
                  ) -> Kernel:
    """With ``quantize``, the outputs are ``q`` [rows, hidden] in ``fp8`` and ``scale`` [rows, 1]
    fp32 with ``y = q * scale`` (per-row absmax scaling to the fp8 format's largest finite value),
    the shape of AWS's fused "RMSNorm + FP8 quantization" kernel; ``y`` itself is not written."""
    _check_dims("rmsnorm", rows, hidden)
    eps = _check_eps("rmsnorm", eps)
    if not isinstance(quantize, bool):
        raise KernelError(f"rmsnorm: quantize must be true or false, got {quantize!r}")
    qdt = checked_dtype(fp8, "rmsnorm: fp8") if quantize else None
    if qdt is not None and qdt.name not in FP8_OUT:
        raise KernelError(f"rmsnorm: fp8 must be one of {', '.join(get_dtype(n).short for n in FP8_OUT)}, got {fp8!r}")
    kern = Kernel(name, config)
    dt = checked_dtype(dtype, kern.name)
    # besides the input buffers: gamma, two work buffers (x * gamma), two fp8 output buffers
    plan = _plan("rmsnorm", rows, hidden, dt, kern, rows_dt=3, rows_fp8=2 if qdt is not None else 0,
                 chunk_bufs=2 if qdt is not None else 0, vectors=1)
    x = kern.input("x", (rows, hidden), dt)
    gamma = kern.input("gamma", (hidden,), dt)
    if qdt is None:
        y = kern.output("y", (rows, hidden), dt)
    else:
        q = kern.output("q", (rows, hidden), qdt)
        scale_out = kern.output("scale", (rows, 1), "fp32")
        fp8_max = _fp8_max(qdt.name)
        qpool = kern.tile_pool("q", bufs=2)
    if plan.wide:
        return _rmsnorm_wide(kern, plan, x, gamma, y if qdt is None else None,
                             None if qdt is None else (q, scale_out, qdt, fp8_max, qpool), dt, eps)
    g = kern.sbuf((plan.parts, hidden), dt, name="gamma_bcast")
    scratch = kern.sbuf((plan.parts, plan.scratch_cols), dt, name="scratch")
    io = kern.tile_pool("io", bufs=plan.io_bufs)
    work = kern.tile_pool("work", bufs=2)
    stats = kern.tile_pool("stats", bufs=15)
    partials = kern.tile_pool("partials", bufs=4)
    inv_h = 1.0 / hidden

    def stage_a(r: int, p: int, _: None) -> tuple[TileAP, TileAP, TileAP]:
        t = io.tile((plan.parts, hidden), dt)[:p]
        kern.dma_copy(t, x[r:r + p, :])
        if r == 0:
            _broadcast_rows(kern, g, gamma)
        # x * gamma on VectorE runs alongside the ScalarE sum of squares: it needs neither rstd
        # nor to overwrite x, which ScalarE is reading
        w = work.tile((plan.parts, hidden), dt)[:p]
        kern.tensor_tensor(w, t, g[:p], "multiply")
        ss, rstd = (stats.tile((plan.parts, 1), "fp32")[:p] for _ in range(2))
        _fused_reduce(kern, scratch, "square", t, ss, "add", partials)
        kern.tensor_scalar(rstd, ss, "multiply", inv_h, op1="add", operand1=eps)
        kern.tensor_scalar(rstd, rstd, "power", -0.5)
        return t, w, rstd

    def stage_b(r: int, p: int, st: tuple[TileAP, TileAP, TileAP]) -> None:
        t, w, rstd = st
        if qdt is None:
            # back into the input buffer (free now): the work buffer is then reusable at once,
            # and the input buffer is reloaded only after this store, as with any in-place kernel
            kern.tensor_scalar(t, w, "multiply", rstd)
            kern.dma_copy(y[r:r + p, :], t, engine="gpsimd")
            return
        # absmax of y = rstd * absmax(x * gamma) since rstd > 0: ScalarE takes it from x * gamma
        gmax, scale, qmul = (stats.tile((plan.parts, 1), "fp32")[:p] for _ in range(3))
        _fused_reduce(kern, scratch, "abs", w, gmax, "max", partials)
        kern.tensor_scalar(scale, gmax, "multiply", rstd, op1="max", operand1=1e-30)  # an all-zero row stays finite
        kern.tensor_scalar(scale, scale, "multiply", 1.0 / fp8_max)  # the dequantization scale
        kern.tensor_tensor(qmul, rstd, scale, "divide")
        qt = qpool.tile((plan.parts, hidden), qdt)[:p]
        kern.tensor_scalar(qt, w, "multiply", qmul)
        kern.dma_copy(q[r:r + p, :], qt, engine="gpsimd")
        kern.dma_copy(scale_out[r:r + p, :], scale, engine="gpsimd")

    _pipelined(_row_tiles(rows, plan.parts), stage_a, stage_b, bufs=plan.io_bufs)
    return kern


def _rmsnorm_wide(kern: Kernel, plan: _Plan, x: HbmTensor, gamma: HbmTensor, y: HbmTensor | None,
                  quant: tuple[Any, ...] | None, dt: Dtype, eps: float) -> Kernel:
    """RMSNorm of rows too wide for the work buffers: the sum of squares as before, then per
    chunk ``x * rstd * gamma`` in place (and, quantizing, the row absmax of the result, then
    ``q`` chunk by chunk)."""
    rows, hidden = x.shape
    (g,), stream = _vectors(kern, plan, dt, gamma)
    scratch = kern.sbuf((plan.parts, plan.scratch_cols), dt, name="scratch")
    io = kern.tile_pool("io", bufs=plan.io_bufs)
    stats = kern.tile_pool("stats", bufs=15)
    partials = kern.tile_pool("partials", bufs=4)
    inv_h = 1.0 / hidden

    def stage_a(r: int, p: int, _: None) -> tuple[TileAP, TileAP]:
        t = io.tile((plan.parts, hidden), dt)[:p]
        kern.dma_copy(t, x[r:r + p, :])
        if r == 0 and g is not None:
            _broadcast_rows(kern, g, gamma)
        ss, rstd = (stats.tile((plan.parts, 1), "fp32")[:p] for _ in range(2))
        _fused_reduce(kern, scratch, "square", t, ss, "add", partials)
        kern.tensor_scalar(rstd, ss, "multiply", inv_h, op1="add", operand1=eps)
        kern.tensor_scalar(rstd, rstd, "power", -0.5)
        return t, rstd

    def stage_b(r: int, p: int, st: tuple[TileAP, TileAP]) -> None:
        t, rstd = st
        for c0, c1 in _chunks(hidden, plan.chunk):  # in place, a chunk at a time: no work buffer
            tc = t[:, c0:c1]
            kern.tensor_scalar(tc, tc, "multiply", rstd)
            kern.tensor_tensor(tc, tc, _chunk_of(kern, plan, dt, g, stream, gamma, c0, c1, p), "multiply")
        if quant is None:
            kern.dma_copy(y[r:r + p, :], t, engine="gpsimd")  # type: ignore[index]
            return
        q, scale_out, qdt, fp8_max, qpool = quant
        ymax, scale, qmul = (stats.tile((plan.parts, 1), "fp32")[:p] for _ in range(3))
        _fused_reduce(kern, scratch, "abs", t, ymax, "max", partials)
        kern.tensor_scalar(scale, ymax, "max", 1e-30, op1="multiply", operand1=1.0 / fp8_max)
        kern.reciprocal(qmul, scale)
        for c0, c1 in _chunks(hidden, plan.chunk):
            qt = qpool.tile((plan.parts, plan.chunk), qdt)[:p, :c1 - c0]
            kern.tensor_scalar(qt, t[:, c0:c1], "multiply", qmul)
            kern.dma_copy(q[r:r + p, c0:c1], qt, engine="gpsimd")
        kern.dma_copy(scale_out[r:r + p, :], scale, engine="gpsimd")

    _pipelined(_row_tiles(rows, plan.parts), stage_a, stage_b, bufs=plan.io_bufs)
    return _scheduled(kern)


def _scheduled(kern: Kernel) -> Kernel:
    """The kernel list-scheduled (the wide layouts; see the module docstring)."""
    from ..sim.list_schedule import schedule

    return schedule(kern)


def _fp8_tolerance(dtype: str) -> tuple[float, float]:
    """The input dtype's tolerance plus half an fp8 e4m3 step (2**-4 relative): ``q`` is rounded to
    3 mantissa bits, and a value near a rounding boundary may land in either neighbour."""
    rtol, atol = default_tolerance(dtype)
    return rtol + 2.0**-4, atol


@register_kernel("rmsnorm_fp8", dims="ROWSxHIDDEN", dtypes=("bf16", "fp32"), default_shape=(2048, 8192),
                 summary="RMSNorm + FP8 quantization (datasheet V7): q in fp8 and a per-row scale, y ~ q * scale",
                 params={"eps": 1e-6, "fp8": "fp8_e4m3"},
                 inputs=lambda s, d, p, g: _affine_inputs(s, d, p, g, False),
                 reference=lambda i, s, d, p: _rmsnorm_reference(i, s, d, {**p, "quantize": True}), split=split_dims(0),
                 tolerance=_fp8_tolerance)
def build_rmsnorm_fp8(rows: int, hidden: int, dtype: str = "bf16", config: ChipConfig | str = "trn2",
                      eps: float = 1e-6, fp8: str = "fp8_e4m3", name: str = "rmsnorm_fp8") -> Kernel:
    """:func:`build_rmsnorm` with ``quantize=True``, registered on its own so its check allows
    for the fp8 rounding of ``q``."""
    return build_rmsnorm(rows, hidden, dtype, config, eps=eps, quantize=True, fp8=fp8, name=name)
