"""Fused kernels for compiled regions: a tile program run as one instruction stream.

``torch.compile`` on the neuron device (``torch_bridge/compile``) cuts an FX graph into regions
one NeuronCore kernel can run and writes each as a :class:`Program`: the region's inputs, the
engine steps its ops become, and its outputs. The builders here emit that program as a real
kernel with the public builder, so its time is simulated like any library kernel's (never a
discount on the eager ops' costs), and :func:`reference` defines what it computes in numpy.

A program works on one ``[rows, cols]`` layout (rows = the leading dims, cols = the last). Each
value has a *kind*: ``full`` [rows, cols], ``row`` [cols] (broadcast over rows: a bias, a norm's
weight), ``col`` [rows] (broadcast over cols: a row's statistic) or ``scalar``. Steps:

* ``("act", fn, x, scale, bias)``: ``fn(x * scale + bias)`` on ScalarE (an activation table);
* ``("ts", x, op0, imm0, op1, imm1, rev0)``: ``(x op0 imm0) op1 imm1`` with immediates
  (``rev0``: ``imm0 op0 x``; ``op1`` may be None) on VectorE, GpSimd or ScalarE;
* ``("tt", op, a, b)``: ``a op b``, broadcast by kind (a per-row value as a per-partition
  operand, a per-column one as a stride-0 view of a resident tile);
* ``("red", op, x)``: reduce along the row (add/max/min) -> ``col``, fused into the ScalarE pass
  that produced ``x`` when one did;
* ``("csum", x)``: sum down the columns -> ``row`` (a bias gradient, a norm weight's gradient):
  ``ones[rows]ᵀ @ x`` on TensorE, accumulated in PSUM over every row tile;
* ``("cast", x, dtype)``: round to ``dtype`` (an explicit ``.to()`` in the graph).

Intermediates stay in SBUF in fp32 (the engines compute in fp32); only outputs are rounded to
their dtype. That is where a fused region's numbers can differ from eager: there each op rounds
its result to the tensor's dtype (bf16 intermediates), here only the region's outputs are.

``fused`` tiles the rows as the elementwise kernels do (128 partitions, several consecutive rows
per partition when rows are narrow, whole rows when the program reduces along them); loads run
on the Sync queues, each step on the engine a greedy balance by the engines' published costs
gives it, stores are triggered by the engine that produced the value, and the loop over tiles
is software-pipelined in two stages. ``matmul_fused`` is the library matmul with the program
applied as its PSUM evacuation (the matmul result is input 0): a bias, an activation, a residual
add and scaling cost no HBM round trip.

At LNC=2 ``fused`` splits the rows between the two physical cores; a column sum is then two
partial sums, whose final add of ``cols`` elements is not modelled.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from ..config import ChipConfig
from ..isa import ACTIVATIONS, ALU_OPS, KernelError, TileAP
from ..builder.kernel import Kernel, TilePool
from ..native.dtypes import get_dtype
from .elementwise import Piece, hbm_piece, row_pieces
from .reference import round_to
from .registry import register_kernel, split_dims

__all__ = ["Program", "FULL", "ROW", "COL", "SCALAR", "reference", "build_fused", "build_matmul_fused", "PATTERNS",
           "pattern"]

FULL, ROW, COL, SCALAR = "full", "row", "col", "scalar"
KINDS = (FULL, ROW, COL, SCALAR)
REDUCE = ("add", "max", "min")
_RANK = {SCALAR: 0, ROW: 1, COL: 1, FULL: 2}


@dataclass(frozen=True)
class Program:
    """A fused region as engine steps (see the module docstring). ``inputs`` are (kind, dtype),
    ``outputs`` (value index, dtype); values are numbered inputs first, then one per step."""

    inputs: tuple[tuple[str, str], ...]
    steps: tuple[tuple[Any, ...], ...]
    outputs: tuple[tuple[int, str], ...]

    def kinds(self) -> list[str]:
        """The kind of every value, checking each step's operands."""
        kinds = []
        for i, (kind, dt) in enumerate(self.inputs):
            if kind not in KINDS:
                raise KernelError(f"fused: input {i} has kind {kind!r}; expected one of {', '.join(KINDS)}")
            get_dtype(dt)
            kinds.append(kind)
        for j, st in enumerate(self.steps):
            args = step_args(st)
            if any(not 0 <= a < len(kinds) for a in args):
                raise KernelError(f"fused: step {j} {st[0]} reads a value not yet defined")
            k = [kinds[a] for a in args]
            op = st[0]
            if op in ("act", "ts", "cast"):
                kinds.append(k[0])
                if op == "act" and st[1] not in ACTIVATIONS:
                    raise KernelError(f"fused: step {j}: unknown activation {st[1]!r}")
            elif op == "tt":
                if st[1] not in ALU_OPS:
                    raise KernelError(f"fused: step {j}: unknown ALU op {st[1]!r}")
                kinds.append(FULL if (ROW in k and COL in k) else max(k, key=_RANK.__getitem__))
            elif op == "red":
                if st[1] not in REDUCE:
                    raise KernelError(f"fused: step {j}: reduce op must be one of {', '.join(REDUCE)}")
                kinds.append({FULL: COL, ROW: SCALAR}.get(k[0], k[0]))
            elif op == "csum":
                kinds.append({FULL: ROW, COL: SCALAR}.get(k[0], k[0]))
            else:
                raise KernelError(f"fused: step {j}: unknown step {op!r}")
        for v, dt in self.outputs:
            if not 0 <= v < len(kinds):
                raise KernelError(f"fused: output value {v} is not defined")
            get_dtype(dt)
        return kinds

    @property
    def reduces_rows(self) -> bool:
        return any(st[0] == "red" for st in self.steps)

    @property
    def elementwise(self) -> bool:
        return not any(st[0] in ("red", "csum") for st in self.steps)


def step_args(st: tuple[Any, ...]) -> tuple[int, ...]:
    op = st[0]
    if op == "act":
        return (st[2],)
    if op == "tt":
        return (st[2], st[3])
    if op == "red":
        return (st[2],)
    return (st[1],)  # ts, csum, cast


# ---------------------------------------------------------------------------------------------
# the definition: numpy, float64 from the inputs as the kernel saw them
# ---------------------------------------------------------------------------------------------

_SHAPES: dict[str, Callable[[int, int], tuple[int, int]]] = {
    FULL: lambda r, c: (r, c), ROW: lambda r, c: (1, c), COL: lambda r, c: (r, 1), SCALAR: lambda r, c: (1, 1)}
_HBM_SHAPES: dict[str, Callable[[int, int], tuple[int, ...]]] = {
    FULL: lambda r, c: (r, c), ROW: lambda r, c: (c,), COL: lambda r, c: (r,), SCALAR: lambda r, c: (1,)}


def _alu(op: str, a: np.ndarray, b: Any) -> np.ndarray:
    with np.errstate(all="ignore"):
        return np.asarray(ALU_OPS[op](a, b), dtype=np.float64)


def reference(program: Program, arrays: Sequence[np.ndarray], rows: int, cols: int) -> list[np.ndarray]:
    """What ``program`` computes from ``arrays`` (its inputs, any float dtype, HBM shapes):
    float64 throughout, inputs rounded to their dtypes, outputs shaped as the kernel writes them."""
    kinds = program.kinds()
    vals: list[np.ndarray] = []
    for (kind, dt), a in zip(program.inputs, arrays):
        vals.append(round_to(np.asarray(a, dtype=np.float32), dt).reshape(_SHAPES[kind](rows, cols)))
    for st in program.steps:
        op = st[0]
        if op == "act":
            fn, x, scale, bias = st[1:]
            with np.errstate(all="ignore"):
                vals.append(np.asarray(ACTIVATIONS[fn][0](vals[x] * scale + bias), dtype=np.float64))
        elif op == "ts":
            x, op0, imm0, op1, imm1, rev0 = st[1:]
            y = _alu(op0, imm0, vals[x]) if rev0 else _alu(op0, vals[x], imm0)
            vals.append(_alu(op1, y, imm1) if op1 is not None else y)
        elif op == "tt":
            vals.append(_alu(st[1], vals[st[2]], vals[st[3]]))
        elif op == "red":
            fn = {"add": np.sum, "max": np.max, "min": np.min}[st[1]]
            vals.append(fn(vals[st[2]], axis=1, keepdims=True))
        elif op == "csum":
            vals.append(np.sum(vals[st[1]], axis=0, keepdims=True))
        else:  # cast
            vals.append(round_to(vals[st[1]], st[2]))
    outs = []
    for v, dt in program.outputs:
        shape = _SHAPES[kinds[v]](rows, cols)
        outs.append(np.broadcast_to(vals[v], shape).reshape(_HBM_SHAPES[kinds[v]](rows, cols)))
    return outs


# ---------------------------------------------------------------------------------------------
# engine choice: a greedy balance by the published per-element costs
# ---------------------------------------------------------------------------------------------


def _per_element(cfg: ChipConfig) -> dict[str, dict[str, float]]:
    """ns per element per partition of each step kind on each engine that can run it (fp32:
    datasheet §7 as the engine modules charge it: tensor_tensor 2N on VectorE/GpSimd, N else)."""
    v, s, g = (1e9 / cfg.engine_clocks[n] for n in ("Vector", "Scalar", "GpSimd"))
    return {"act": {"scalar": s}, "ts": {"vector": v, "gpsimd": g, "scalar": s},
            "cast": {"vector": v, "gpsimd": g, "scalar": s}, "tt": {"vector": 2 * v, "gpsimd": 2 * g},
            "tts": {"vector": v, "gpsimd": g, "scalar": s}, "red": {"vector": v, "gpsimd": g}}


def assign_engines(kinds_of_step: Sequence[str], weights: Sequence[float], cfg: ChipConfig,
            psum: Sequence[bool] = ()) -> list[str]:
    """An engine for each step: heaviest steps first, each to the engine that ends least loaded
    (``psum[i]``: step i reads PSUM, which GpSimd cannot)."""
    costs = _per_element(cfg)
    load = {"vector": 0.0, "gpsimd": 0.0, "scalar": 0.0}
    out = [""] * len(kinds_of_step)
    for i in sorted(range(len(kinds_of_step)), key=lambda i: -weights[i] * min(costs[kinds_of_step[i]].values())):
        opts = costs[kinds_of_step[i]]
        if i < len(psum) and psum[i]:
            opts = {e: c for e, c in opts.items() if e != "gpsimd"}
        eng = min(opts, key=lambda e: (load[e] + opts[e] * weights[i], e))
        load[eng] += opts[eng] * weights[i]
        out[i] = eng
    return out


# ---------------------------------------------------------------------------------------------
# emitting a program over tiles
# ---------------------------------------------------------------------------------------------


class Emitter:
    """Emits program steps over one layout of tiles: full values [p, g, c] (flat [p, g*c]),
    per-row values [p, g], per-column values as a resident [P, cols] tile (or [1, cols] after
    a column sum), scalars [P, 1]."""

    def __init__(self, kern: Kernel, program: Program, kinds: list[str], engines: list[str]):
        self.kern, self.program, self.kinds, self.engines = kern, program, kinds, engines

    def full_view(self, t: TileAP, p: int, g: int, c: int) -> TileAP:
        return t.reshape(p, g, c) if g > 1 else t

    def operand(self, v: int, tiles: dict[int, TileAP], p: int, g: int, c: int, c0: int) -> TileAP:
        """Value ``v`` as a [p, g, c] (or [p, c]) view for a full-sized operation."""
        t = tiles[v]
        kind = self.kinds[v]
        if kind == FULL:
            return self.full_view(t, p, g, c)
        if kind == ROW:
            r = t[:p, c0:c0 + c]
            return r.broadcast_to(p, g, c) if g > 1 else r
        if kind == COL:
            return t.reshape(p, g, 1).broadcast_to(p, g, c) if g > 1 else t.broadcast_to(p, c)
        return t[:p].broadcast_to(p, g, c) if g > 1 else t[:p].broadcast_to(p, c)

    def step(self, j: int, dst: TileAP, tiles: dict[int, TileAP], p: int, g: int, c: int, c0: int,
             reduce_into: tuple[TileAP, str] | None = None) -> None:
        """Emit step ``j`` writing ``dst`` (already shaped for the step's kind)."""
        kern, st, eng = self.kern, self.program.steps[j], self.engines[j]
        op = st[0]
        kind = self.kinds[len(self.program.inputs) + j]
        if op == "act":
            fn, x, scale, bias = st[1:]
            src = tiles[x]
            if reduce_into is not None:
                kern.activation(dst, fn, src, scale=float(scale), bias=float(bias), reduce_op=reduce_into[1],
                                reduce_res=reduce_into[0])
            else:
                kern.activation(dst, fn, src, scale=float(scale), bias=float(bias))
        elif op == "ts":
            x, op0, imm0, op1, imm1, rev0 = st[1:]
            kern.tensor_scalar(dst, tiles[x], op0, float(imm0), op1=op1,
                               operand1=None if op1 is None else float(imm1), reverse0=bool(rev0), engine=eng)
        elif op == "cast":
            kern.tensor_copy(dst, tiles[st[1]], engine=eng)
        elif op == "tt":
            self.binary(st[1], st[2], st[3], dst, kind, tiles, p, g, c, c0, eng)
        elif op == "red":
            src = tiles[st[2]]
            if g > 1:
                kern.tensor_reduce(dst, st[1], src.reshape(p, g, c), axis=2, engine=eng)
            else:
                kern.tensor_reduce(dst, st[1], src, axis=1, engine=eng)
        else:
            raise AssertionError(op)

    def binary(self, op: str, a: int, b: int, dst: TileAP, kind: str, tiles: dict[int, TileAP], p: int, g: int,
               c: int, c0: int, eng: str) -> None:
        kern, ka, kb = self.kern, self.kinds[a], self.kinds[b]
        if kind == FULL:
            # a per-partition operand (a scalar, or a row statistic with one row per partition) is
            # a tensor_scalar: N cycles instead of tensor_tensor's 2N, and ScalarE may take it
            for x, y, rev in ((a, b, False), (b, a, True)):
                kx, ky = self.kinds[x], self.kinds[y]
                if kx == FULL and (ky == SCALAR or (ky == COL and g == 1)):
                    opnd = tiles[y][:p] if ky == SCALAR else tiles[y]
                    kern.tensor_scalar(dst, tiles[x], op, opnd, reverse0=rev, engine=eng)
                    return
            d = self.full_view(dst, p, g, c)
            kern.tensor_tensor(d, self.operand(a, tiles, p, g, c, c0), self.operand(b, tiles, p, g, c, c0), op,
                               engine="gpsimd" if eng == "gpsimd" else "vector")
            return
        ta, tb = tiles[a], tiles[b]
        if kind == COL:  # [p, g] values (and scalars)
            if kb == SCALAR or ka == SCALAR:
                x, y, rev = (a, b, False) if kb == SCALAR else (b, a, True)
                kern.tensor_scalar(dst, tiles[x], op, tiles[y][:dst.p_count], reverse0=rev, engine=eng)
            else:
                kern.tensor_tensor(dst, ta, tb, op, engine="gpsimd" if eng == "gpsimd" else "vector")
            return
        # row or scalar values: resident tiles, the same partition count
        n = dst.p_count
        if kb == SCALAR and ka == ROW:
            kern.tensor_scalar(dst, ta[:n], op, tb[:n], engine=eng)
        elif ka == SCALAR and kb == ROW:
            kern.tensor_scalar(dst, tb[:n], op, ta[:n], reverse0=True, engine=eng)
        else:
            kern.tensor_tensor(dst, ta[:n], tb[:n], op, engine="gpsimd" if eng == "gpsimd" else "vector")


def step_class(st: tuple[Any, ...], kinds: list[str], g1: bool) -> str:
    if st[0] != "tt":
        return st[0]
    ka, kb = kinds[st[2]], kinds[st[3]]
    if FULL in (ka, kb) and (SCALAR in (ka, kb) or (COL in (ka, kb) and g1)):
        return "tts"
    return "tt"


def _phases(program: Program, kinds: list[str]) -> list[str]:
    """Each value's phase: ``pre`` (per-column or scalar, computed once before the tile loop),
    ``loop`` (per tile) or ``post`` (after it, from a column sum)."""
    n_in = len(program.inputs)
    phase = ["loop" if k in (FULL, COL) else "pre" for k in kinds[:n_in]]
    for j, st in enumerate(program.steps):
        args = step_args(st)
        kind = kinds[n_in + j]
        if st[0] == "csum":
            phase.append("post")
        elif any(phase[a] == "post" for a in args):
            if kind not in (ROW, SCALAR) or any(phase[a] == "loop" for a in args):
                raise KernelError(f"fused: step {j} uses a column sum inside the tile loop (that needs a "
                                  f"second pass over the rows, which this kernel does not make)")
            phase.append("post")
        elif kind in (ROW, SCALAR) and all(phase[a] == "pre" for a in args):
            phase.append("pre")
        else:
            phase.append("loop")
    return phase


def _last_uses(program: Program, phase: list[str]) -> dict[int, int]:
    """For each loop value, the index of the last loop step (or output store) that reads it."""
    n_in = len(program.inputs)
    last: dict[int, int] = {}
    for j, st in enumerate(program.steps):
        for a in step_args(st):
            if phase[a] == "loop":
                last[a] = j
    for v, _ in program.outputs:
        if phase[v] == "loop":
            last[v] = max(last.get(v, -1), v - n_in)
    return last


def _csum_banks(program: Program, cols: int, tn: int) -> int:
    return sum(1 for st in program.steps if st[0] == "csum") * -(-cols // tn)


def build_fused(rows: int, cols: int, dtype: str = "fp32", config: ChipConfig | str = "trn2",
                pattern: str = "bias_gelu", program: Program | None = None, bufs: int = 3,
                name: str = "fused") -> Kernel:
    """One fused region over ``[rows, cols]``: ``program`` (or the named preset ``pattern`` in
    ``dtype``). Inputs ``in0``.., outputs ``out0``.. in HBM, shaped by kind."""
    for what, d in (("rows", rows), ("cols", cols)):
        if isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 1:
            raise KernelError(f"{name}: {what} must be a positive integer, got {d!r}")
    prog = resolve(program if program is not None else globals()["pattern"](pattern, dtype), cols)
    kinds = prog.kinds()
    for j, st in enumerate(prog.steps):
        if st[0] == "csum" and kinds[st[1]] != FULL:
            raise KernelError(f"{name}: step {j} sums a '{kinds[st[1]]}' value down the columns; only full values")
    kern = Kernel(name, config)
    cfg = kern.config
    P = cfg.core.sbuf.partitions
    n_in = len(prog.inputs)
    phase = _phases(prog, kinds)
    ins = [kern.input(f"in{i}", _HBM_SHAPES[k](rows, cols), dt) for i, (k, dt) in enumerate(prog.inputs)]
    outs = [kern.output(f"out{j}", _HBM_SHAPES[kinds[v]](rows, cols), dt) for j, (v, dt) in enumerate(prog.outputs)]
    out_of = {}
    for j, (v, _) in enumerate(prog.outputs):
        out_of.setdefault(v, []).append(j)

    # ---- sizes: SBUF for resident per-column values, the loop's slots, PSUM for column sums
    resident = sum(1 for v in range(len(kinds)) if phase[v] in ("pre", "post") and kinds[v] == ROW)
    depth = bufs
    budget = cfg.core.sbuf.partition_bytes * 7 // 8 - resident * cols * 4
    loop_steps = [j for j in range(len(prog.steps)) if phase[n_in + j] == "loop" or prog.steps[j][0] == "csum"]
    levels = step_levels(prog, phase)
    top = max((levels[j] for j in loop_steps), default=1)

    def registers(depth: int, folded: Mapping[int, int]
                  ) -> tuple[list[list[int]], int, dict[int, int], int, dict[int, int]]:
        """The pipeline's stages (software pipelining: steps grouped by dependency level into up
        to ``depth - 1`` stages, stage s of tile i issued with stage 0 of tile i + s, so each
        engine has another tile's work queued) and the slots of full and per-row loop values, a
        linear scan in that emission order (:func:`emission_slots`); ``folded``: the
        activation -> reduction steps made in one ScalarE pass (:func:`_folds`)."""
        nstages = max(1, min(depth - 1, top))
        stages = [[j for j in loop_steps if (levels[j] - 1) * nstages // top == si] for si in range(nstages)]
        order = [v for v in range(n_in) if phase[v] == "loop"]
        for sj in stages:
            for j in sj:
                if prog.steps[j][0] == "csum" or j in folded.values():
                    continue  # a column sum goes to PSUM; a folded reduction is made with its activation
                order.append(n_in + j)
                if j in folded:
                    order.append(n_in + folded[j])
        pos = {v: t for t, v in enumerate(order)}
        at = {j: pos[n_in + j] for j in loop_steps if n_in + j in pos}
        at.update({rj: pos[n_in + j] for j, rj in folded.items()})  # emitted with its activation
        for j in loop_steps:
            at.setdefault(j, max(pos.values(), default=0))  # a column sum: after the stage's values
        lastpos = dict(pos)
        end0 = max([pos[n_in + j] for j in stages[0] if n_in + j in pos] + [pos[v] for v in order if v < n_in] +
                   [0])
        for j in loop_steps:
            for a in step_args(prog.steps[j]):
                if a in lastpos:
                    lastpos[a] = max(lastpos[a], at[j])
        for v, _ in prog.outputs:  # an input passed through is stored at the end of stage 0
            if v < n_in and v in lastpos:
                lastpos[v] = max(lastpos[v], end0)
        nf, full_of = emission_slots([v for v in order if kinds[v] == FULL], lastpos)
        nc, col_of = emission_slots([v for v in order if kinds[v] == COL], lastpos)
        return stages, nf, full_of, nc, col_of

    def plan(depth: int) -> tuple[int, list[Piece], int]:
        """Tile width (elements per partition), the row tiles, and the widest per-row tile: at
        most 64 rows per partition, so per-row tiles stay small."""
        # the fold of reductions into activations depends on the row tiles this chooses: size
        # the slots for either outcome
        both = [registers(depth, {}), registers(depth, _folds(prog, kinds, phase, True))]
        slots_full, slots_col = max(r[1] for r in both), max(r[3] for r in both)
        room = budget - (slots_col * depth + 8) * 64 * 4
        width = min(4096, 64 * cols)
        if slots_full:
            width = min(width, max(0, room // (slots_full * depth * 4)))
        if prog.reduces_rows:  # whole rows; one per partition when that moves >= 2 KiB per partition
            width = cols if (cols * 4 >= 2048 and width >= cols) else width
        if width < 1 or (prog.reduces_rows and width < cols):
            return 0, [], 0
        pcs = list(row_pieces(rows, cols, width, P))
        return width, pcs, max(pc.g for pc in pcs)

    width, pieces, gmax = plan(depth)
    if not width:
        depth = 2
        width, pieces, gmax = plan(depth)
    if not width or (prog.reduces_rows and any(pc.cols != cols for pc in pieces)):
        live = registers(depth, {})[1]
        raise KernelError(f"{name}: rows of {cols} elements do not fit SBUF on {cfg.name} with {live} live "
                          f"tiles per row tile (a reduction needs whole rows)")
    width = max(width, max(pc.free for pc in pieces))
    cw = max(16, gmax)  # per-row tiles: one column per row of a partition
    tn = min(cfg.core.tensor.moving_max_free, cfg.core.psum.bank_bytes // 4)
    if _csum_banks(prog, cols, tn) > cfg.core.psum.banks:
        raise KernelError(f"{name}: column sums over {cols} columns need {_csum_banks(prog, cols, tn)} PSUM "
                          f"banks; {cfg.core.psum.banks} on {cfg.name}")
    g1 = all(pc.g == 1 for pc in pieces)
    step_cls = [step_class(st, kinds, g1) for st in prog.steps]
    weights = [1.0 if phase[n_in + j] == "loop" else 0.0 for j in range(len(prog.steps))]
    engines = ["" if st[0] == "csum" else e for st, e in zip(prog.steps, assign_engines(
        ["ts" if st[0] == "csum" else c for st, c in zip(prog.steps, step_cls)], weights, cfg))]
    em = Emitter(kern, prog, kinds, engines)

    # ---- resident values: per-column inputs broadcast to every partition, scalars, and steps on them
    res: dict[int, TileAP] = {}
    P = min(P, rows)  # a per-column value is broadcast to the partitions the row tiles use
    for i, (k, dt) in enumerate(prog.inputs):
        if k == ROW:
            res[i] = _broadcast_row(kern, ins[i], P, cols, dt, f"row{i}")
        elif k == SCALAR:
            res[i] = kern.sbuf((P, 1), dt, name=f"scalar{i}")
            kern.dma_copy(res[i], ins[i].ap(0, [[0, P], [1, 1]]), queue=3)
    for j, st in enumerate(prog.steps):
        v = n_in + j
        if phase[v] == "pre":
            res[v] = kern.sbuf((P, cols if kinds[v] == ROW else 1), "fp32", name=f"pre{v}")
            em.step(j, res[v], res, P, 1, cols, 0)

    # ---- column sums accumulate in PSUM banks; ones in each dtype a summed value has
    csums = [j for j, st in enumerate(prog.steps) if st[0] == "csum"]
    acc: dict[int, list[TileAP]] = {j: [kern.psum((1, tn), "fp32", name=f"csum{j}_{b}") for b in range(-(-cols // tn))]
                                    for j in csums}
    ones: dict[str, TileAP] = {}
    for j in csums:
        dt = tile_dtype(prog, kinds, phase, prog.steps[j][1], out_of)
        if dt not in ones:
            ones[dt] = kern.sbuf((P, 1), dt, name=f"ones_{dt}")
            kern.memset(ones[dt], 1.0)
    started: set[tuple[int, int]] = set()

    folded = _folds(prog, kinds, phase, g1)
    stages, slots_full, slot_of, slots_col, col_slot_of = registers(depth, folded)
    nstages = len(stages)
    # buffer sets: piece i uses set i % depth; at most nstages pieces are in flight in emission
    # order, and depth >= nstages + 1 lets a piece's loads start before the set's previous piece ends
    full_sets = [[kern.tile_pool(f"v{s}_{d}", bufs=1) for s in range(slots_full)] for d in range(depth)]
    col_sets = [[kern.tile_pool(f"c{s}_{d}", bufs=1) for s in range(slots_col)] for d in range(depth)]

    def stage(si: int, i: int, pc: Piece, tiles: dict[int, TileAP]) -> None:
        p, g, c, c0 = pc.p, pc.g, pc.cols, pc.c0
        pools, col_pools = full_sets[i % depth], col_sets[i % depth]
        if si == 0:
            for v in range(n_in):
                if phase[v] == "loop":
                    if kinds[v] == FULL:
                        t = pools[slot_of[v]].tile((P, width * 4 // get_dtype(prog.inputs[v][1]).itemsize),
                                                   prog.inputs[v][1])[:p, :pc.free]
                        kern.dma_copy(t, hbm_piece(ins[v], pc), queue=v % 3)
                    else:
                        t = col_pools[col_slot_of[v]].tile((P, cw), prog.inputs[v][1])[:p, :g]
                        kern.dma_copy(t, ins[v].ap(pc.r0, [[g, p], [1, g]]), queue=v % 3)
                    tiles[v] = t
        for j in stages[si]:
            v = n_in + j
            st = prog.steps[j]
            if st[0] == "csum":
                src = tiles[st[1]]
                sv = src.reshape(p, g, c) if g > 1 else None
                for gi in range(g):
                    for b0 in range(0, c, tn):
                        w = min(tn, c - b0)
                        bank = (c0 + b0) // tn
                        mv = sv[:, gi, b0:b0 + w] if sv is not None else src[:, b0:b0 + w]
                        key = (j, bank)
                        kern.nc_matmul(acc[j][bank][:1, :w], ones[src.dtype.name][:p], mv, accumulate=key in started)
                        started.add(key)
                continue
            if j in folded.values():
                continue  # emitted with the activation that produced its input
            dt = tile_dtype(prog, kinds, phase, v, out_of)
            if kinds[v] == FULL:
                dst = pools[slot_of[v]].tile((P, width * 4 // get_dtype(dt).itemsize), dt)[:p, :pc.free]
            else:
                dst = col_pools[col_slot_of[v]].tile((P, cw), dt)[:p, :g]
            red = None
            if j in folded:
                rj = folded[j]
                rv = n_in + rj
                rdst = col_pools[col_slot_of[rv]].tile((P, cw), tile_dtype(prog, kinds, phase, rv, out_of))[:p, :1]
                tiles[rv] = rdst
                red = (rdst, prog.steps[rj][1])
            em.step(j, dst, tiles, p, g, c, c0, red)
            tiles[v] = dst
            for vv in (v, *((n_in + folded[j],) if j in folded else ())):
                for o in out_of.get(vv, []):
                    if kinds[vv] == FULL:
                        kern.dma_copy(hbm_piece(outs[o], pc), tiles[vv], engine=engines[j] or "sync", queue=0)
                    elif kinds[vv] == COL:
                        kern.dma_copy(outs[o].ap(pc.r0, [[g, p], [1, g]]), tiles[vv], engine=engines[j] or "sync",
                                      queue=0)
        if si == 0:
            for v in range(n_in):  # loop inputs that are outputs as they are (a region passing one through)
                for o in out_of.get(v, []):
                    if phase[v] == "loop":
                        dst_ap = hbm_piece(outs[o], pc) if kinds[v] == FULL else outs[o].ap(pc.r0, [[g, p], [1, g]])
                        kern.dma_copy(dst_ap, tiles[v], queue=4)

    pipeline(pieces, nstages, stage, lambda: dict(res))

    # ---- after the loop: column sums out of PSUM, the steps on them, per-column outputs
    post: dict[int, TileAP] = dict(res)
    for j in csums:
        v = n_in + j
        t = kern.sbuf((1, cols), "fp32", name=f"colsum{v}")
        for b, a in enumerate(acc[j]):
            w = min(tn, cols - b * tn)
            kern.tensor_copy(t[:, b * tn:b * tn + w], a[:1, :w], engine="vector")
        post[v] = t
    for j, st in enumerate(prog.steps):
        v = n_in + j
        if phase[v] == "post" and st[0] != "csum":
            post[v] = kern.sbuf((1, cols if kinds[v] == ROW else 1), "fp32", name=f"post{v}")
            em.step(j, post[v], post, 1, 1, cols, 0)
    for o, (v, _) in enumerate(prog.outputs):
        if phase[v] in ("pre", "post"):
            src = post[v][:1]
            kern.dma_copy(outs[o].ap(0, [[0, 1], [1, src.free_size]]), src, queue=5)
    return kern


def pipeline(pieces: Sequence[Any], nstages: int, stage: Callable[[int, int, Any, dict[int, TileAP]], None],
             initial: Callable[[], dict[int, TileAP]]) -> None:
    """Software pipelining: at step t, stage s of piece t - s is issued (``stage(s, index, piece,
    tiles)``), so each engine has another piece's work queued behind a dependent one; a piece's
    tile map is dropped once its last stage is issued."""
    states = [initial() for _ in pieces]
    for t in range(len(pieces) + nstages - 1):
        for si in range(nstages):
            i = t - si
            if 0 <= i < len(pieces):
                stage(si, i, pieces[i], states[i])
        if t >= nstages - 1:
            states[t - nstages + 1] = {}


def _broadcast_row(kern: Kernel, vec: Any, parts: int, cols: int, dt: str, name: str) -> TileAP:
    """A [cols] HBM vector on ``parts`` partitions, read from HBM once: one partition's DMA, then
    ``ones[1, parts]ᵀ @ row[1, cols]`` on TensorE (a stride-0 DMA to every partition would read
    it ``parts`` times)."""
    cfg = kern.config
    tn = min(cfg.core.tensor.moving_max_free, cfg.core.psum.bank_bytes // 4)
    row = kern.sbuf((1, cols), dt, name=f"{name}_1")
    kern.dma_copy(row, vec.ap(0, [[0, 1], [1, cols]]), queue=3)
    ones = kern.sbuf((1, parts), "fp32" if get_dtype(dt).name == "float32" else dt, name=f"{name}_ones")
    kern.memset(ones, 1.0)
    out = kern.sbuf((parts, cols), "fp32", name=name)
    ps = kern.psum((parts, tn), "fp32", name=f"{name}_ps")
    for c0 in range(0, cols, tn):
        w = min(tn, cols - c0)
        kern.nc_matmul(ps[:, :w], ones, row[:, c0:c0 + w])
        kern.tensor_copy(out[:, c0:c0 + w], ps[:, :w], engine="vector")
    kern.free(ps)
    return out


def tile_dtype(prog: Program, kinds: list[str], phase: list[str], v: int, out_of: Mapping[int, list[int]]) -> str:
    """What a value's tile holds: an input its HBM dtype; an intermediate fp32; an output that no
    later step reads its output dtype (the producing engine rounds once, as it writes)."""
    n_in = len(prog.inputs)
    if v < n_in:
        return get_dtype(prog.inputs[v][1]).name
    if v in out_of and not any(v in step_args(st) for st in prog.steps[v - n_in + 1:]):
        dts = {prog.outputs[o][1] for o in out_of[v]}
        if len(dts) == 1:
            return get_dtype(dts.pop()).name
    return "float32"


def _slots(prog: Program, phase: list[str], kinds: list[str], last: Mapping[int, int], kind: str
           ) -> tuple[int, dict[int, int]]:
    """Linear-scan register allocation of the loop values of ``kind`` in step order (a loop body
    emitted whole, as the matmul epilogue is): a slot per live value."""
    n_in = len(prog.inputs)
    order = [v for v in range(n_in) if phase[v] == "loop" and kinds[v] == kind] + \
            [n_in + j for j in range(len(prog.steps)) if phase[n_in + j] == "loop" and kinds[n_in + j] == kind]
    here = {v: v - n_in if v >= n_in else -1 for v in order}  # inputs are there before step 0
    return emission_slots(order, {v: last.get(v, here[v]) for v in order}, here)


def emission_slots(order: Sequence[int], lastpos: Mapping[int, int], pos: Mapping[int, int] | None = None
                   ) -> tuple[int, dict[int, int]]:
    """Linear-scan register allocation over one piece's values in the order a software-pipelined
    loop emits them (``order``; ``lastpos[v]``: the position in it of v's last reader): a value
    takes a slot only once every earlier holder's last reader is emitted. Each piece in flight
    then uses a buffer set of its own (piece ``i`` the set ``i % sets``), so a tile is never
    handed to a later value while an earlier one in it still has a reader to come, whatever the
    interleaving of the pieces' stages. ``pos``: the positions ``lastpos`` counts in (default:
    the index in ``order``). Returns (slots, value -> slot)."""
    if pos is None:
        pos = {v: t for t, v in enumerate(order)}
    slot_of: dict[int, int] = {}
    free: list[int] = []
    live: list[int] = []
    n = 0
    for v in order:
        for lv in [x for x in live if lastpos[x] < pos[v]]:
            live.remove(lv)
            free.append(slot_of[lv])
        if free:
            slot_of[v] = free.pop()
        else:
            slot_of[v], n = n, n + 1
        live.append(v)
    return n, slot_of


def step_levels(prog: Program, phase: list[str]) -> list[int]:
    n_in = len(prog.inputs)
    level = [0] * (n_in + len(prog.steps))
    for j, st in enumerate(prog.steps):
        level[n_in + j] = 1 + max((level[a] for a in step_args(st) if phase[a] == "loop"), default=0)
    return level[n_in:]


def _folds(prog: Program, kinds: list[str], phase: list[str], g1: bool) -> dict[int, int]:
    """Row reductions ScalarE takes in the same pass as the activation that made their input
    (``activation`` with ``reduce_res``): act step -> red step. One row per partition only."""
    if not g1:
        return {}
    n_in = len(prog.inputs)
    out: dict[int, int] = {}
    for j, st in enumerate(prog.steps):
        if st[0] == "red" and st[2] >= n_in:
            src = st[2] - n_in
            if prog.steps[src][0] == "act" and src not in out and kinds[st[2]] == FULL and phase[st[2]] == "loop":
                out[src] = j
    return out


# ---------------------------------------------------------------------------------------------
# matmul with the program as its PSUM evacuation
# ---------------------------------------------------------------------------------------------


def build_matmul_fused(m: int, k: int, n: int, dtype: str = "fp32", config: ChipConfig | str = "trn2",
                       transpose_a: bool = False, transpose_b: bool = False, pattern: str = "mm_bias_gelu",
                       program: Program | None = None, name: str = "matmul_fused") -> Kernel:
    """``out = program(A @ B, ...)``: the library matmul whose PSUM evacuation runs the program's
    elementwise steps (input 0 is the fp32 matmul result) on [128, <=512] tiles straight out of
    PSUM; per-column operands (a bias) stay resident, full ones (a residual) stream per tile."""
    from . import matmul as mmlib

    prog = resolve(program if program is not None else globals()["pattern"](pattern, dtype), n)
    kinds = prog.kinds()
    if not prog.elementwise:
        raise KernelError(f"{name}: a matmul epilogue must be elementwise (no reductions)")
    if prog.inputs[0][0] != FULL:
        raise KernelError(f"{name}: input 0 of the program is the matmul result, kind 'full'")
    mmlib._check_dims(name, M=m, K=k, N=n)
    kern, mm = mmlib._setup(name, m, k, n, dtype, config, transpose_a, transpose_b, "float32")
    cfg = kern.config
    P = cfg.core.sbuf.partitions
    n_in = len(prog.inputs)
    a_rows = kern.input("a", (m, k), mm.dt).full() if transpose_a else None
    spill = a_rows is None or n > mm.plan.bn
    a = (kern.scratch("lhsT", (k, m), mm.dt) if transpose_a else kern.input("lhsT", (k, m), mm.dt)).full() \
        if spill else None
    b = kern.input("b", (n, k), mm.dt) if transpose_b else kern.input("rhs", (k, n), mm.dt)
    ins: dict[int, Any] = {i: kern.input(f"in{i}", _HBM_SHAPES[kd](m, n), dt)
                           for i, (kd, dt) in enumerate(prog.inputs) if i > 0}
    outs = [kern.output(f"out{j}", _HBM_SHAPES[kinds[v]](m, n), dt) for j, (v, dt) in enumerate(prog.outputs)]
    res: dict[int, TileAP] = {}
    P = min(P, m)
    for i, (kd, dt) in ((i, x) for i, x in enumerate(prog.inputs) if i > 0):
        if kd == ROW:
            res[i] = _broadcast_row(kern, ins[i], P, n, dt, f"row{i}")
        elif kd == SCALAR:
            res[i] = kern.sbuf((P, 1), dt, name=f"scalar{i}")
            kern.dma_copy(res[i], ins[i].ap(0, [[0, P], [1, 1]]), queue=3)
    phase = _phases(prog, kinds)
    for j in range(len(prog.steps)):
        if phase[n_in + j] == "pre":
            raise KernelError(f"{name}: step {j} computes on per-column values only; fold it into the program's inputs")
    cls = [step_class(st, kinds, True) for st in prog.steps]
    engines = assign_engines(cls, [1.0] * len(cls), cfg, [0 in step_args(st) for st in prog.steps])
    em = Emitter(kern, prog, kinds, engines)
    out_of: dict[int, list[int]] = {}
    for j, (v, _) in enumerate(prog.outputs):
        out_of.setdefault(v, []).append(j)
    last = _last_uses(prog, phase)
    nslots, slot_of = _slots(prog, phase, kinds, last, FULL)
    ncols, col_slot_of = _slots(prog, phase, kinds, last, COL)
    tm, bn = mm.plan.tm, mm.plan.bn
    pools = [kern.tile_pool(f"ep{s}", bufs=2) for s in range(nslots)]
    col_pools = [kern.tile_pool(f"epc{s}", bufs=2) for s in range(ncols)]
    out_tiles = kern.tile_pool("epout", bufs=2 * max(1, len(prog.outputs)))

    def epilogue(mm_: Any, job: Any, r0: int, ms: int, n0: int, row: list[TileAP]) -> None:
        """Run the program on each PSUM bank of the [ms, nw] block at (r0, n0); store each output once."""
        nw = sum(t.free_size for t in row)
        full_in = {}
        for i in ins:
            if kinds[i] == FULL:
                t = pools[slot_of[i]].tile((tm, bn * 4 // get_dtype(prog.inputs[i][1]).itemsize),
                                           prog.inputs[i][1])[:ms, :nw]
                kern.dma_copy(t, ins[i][r0:r0 + ms, n0:n0 + nw], queue=3)
                full_in[i] = t
            elif kinds[i] == COL:
                t = col_pools[col_slot_of[i]].tile((tm, 64), prog.inputs[i][1])[:ms, :1]
                kern.dma_copy(t, ins[i].ap(r0, [[1, ms], [1, 1]]), queue=3)
                full_in[i] = t
        otiles = [out_tiles.tile((tm, bn * 4 // get_dtype(dt).itemsize), dt)[:ms, :nw] for _, dt in prog.outputs]
        c0 = 0
        for acc in row:
            w = acc.free_size
            direct: set[int] = set()
            tiles: dict[int, TileAP] = dict(res)
            tiles[0] = acc
            for i, t in full_in.items():
                tiles[i] = t[:, c0:c0 + w] if kinds[i] == FULL else t
            for j in range(len(prog.steps)):
                v = n_in + j
                if v in out_of and not any(v in step_args(st) for st in prog.steps[j + 1:]):
                    dst = otiles[out_of[v][0]][:, c0:c0 + w]
                    direct.add(out_of[v][0])
                elif kinds[v] == FULL:
                    dst = pools[slot_of[v]].tile((tm, bn), "fp32")[:ms, :w]
                else:
                    dst = col_pools[col_slot_of[v]].tile((tm, 64), "fp32")[:ms, :1]
                em.step(j, dst, tiles, ms, 1, w, n0 + c0)
                tiles[v] = dst
            for o, (v, _) in enumerate(prog.outputs):
                if o not in direct and kinds[v] == FULL:  # read again later, or the matmul result itself
                    kern.tensor_copy(otiles[o][:, c0:c0 + w], tiles[v], engine=mm_.evac_engine())
            c0 += w
        for o, (v, _) in enumerate(prog.outputs):
            if kinds[v] == FULL:
                kern.dma_copy(outs[o][r0:r0 + ms, n0:n0 + nw], otiles[o], engine="gpsimd", queue=mmlib._STORE_Q)

    mm.epilogue = epilogue
    mm.emit([mmlib._Job(a, b.full(), outs[0].full() if kinds[prog.outputs[0][0]] == FULL else None, m, n, a_rows,
                        bool(transpose_b))])
    return kern


# ---------------------------------------------------------------------------------------------
# presets: the patterns a compiled model makes most, for `trnsim kernel fused --param pattern=...`
# ---------------------------------------------------------------------------------------------

_S2PI = math.sqrt(2.0 / math.pi)


def _gelu_tanh_steps(x: int, base: int) -> list[tuple[Any, ...]]:
    """GPT-2's gelu_new as its graph spells it: 0.5*x*(1+tanh(sqrt(2/pi)*(x+0.044715*x^3)))."""
    return [("ts", x, "power", 3.0, "multiply", 0.044715, False),  # base+0
            ("tt", "add", x, base),                                   # +1
            ("act", "tanh", base + 1, _S2PI, 0.0),                    # +2
            ("ts", base + 2, "add", 1.0, "multiply", 0.5, False),      # +3
            ("tt", "multiply", x, base + 3)]                          # +4


def pattern(name: str, dtype: str = "fp32") -> Program:
    """A named preset program in ``dtype`` (see :data:`PATTERNS`)."""
    if name not in PATTERNS:
        raise KernelError(f"fused: unknown pattern {name!r}; expected one of {', '.join(sorted(PATTERNS))}")
    return PATTERNS[name][1](get_dtype(dtype).short)


def _p_bias_gelu(dt: str) -> Program:
    return Program(((FULL, dt), (ROW, dt)), (("tt", "add", 0, 1), *_gelu_tanh_steps(2, 3)), ((7, dt),))


def _p_softmax(dt: str) -> Program:
    return Program(((FULL, dt),), (("red", "max", 0), ("tt", "subtract", 0, 1), ("act", "exp", 2, 1.0, 0.0),
                                   ("red", "add", 3), ("tt", "divide", 3, 4)), ((5, dt),))


def _p_layernorm(dt: str) -> Program:
    # x, gamma, beta -> y, mean, rstd (native_layer_norm's three outputs)
    return Program(((FULL, dt), (ROW, dt), (ROW, dt)), (
        ("red", "add", 0),                                     # 3: row sum
        ("ts", 3, "multiply", "1/cols", None, None, False),    # 4: mean (immediate filled per shape)
        ("tt", "subtract", 0, 4),                              # 5: x - mean
        ("act", "square", 5, 1.0, 0.0),                        # 6
        ("red", "add", 6),                                     # 7
        ("ts", 7, "multiply", "1/cols", "add", 1e-5, False),   # 8: var + eps
        ("act", "rsqrt", 8, 1.0, 0.0),                         # 9: rstd
        ("tt", "multiply", 5, 9),                              # 10
        ("tt", "multiply", 10, 1),                             # 11
        ("tt", "add", 11, 2)), ((12, dt), (4, "fp32"), (9, "fp32")))


def _p_rmsnorm(dt: str) -> Program:
    # Llama's RMSNorm as its graph spells it: x * rsqrt(mean(x^2) + eps) * weight
    return Program(((FULL, dt), (ROW, dt)), (
        ("ts", 0, "power", 2.0, None, None, False),            # 2
        ("red", "add", 2),                                     # 3
        ("ts", 3, "multiply", "1/cols", "add", 1e-6, False),   # 4
        ("act", "rsqrt", 4, 1.0, 0.0),                         # 5
        ("tt", "multiply", 0, 5),                              # 6
        ("tt", "multiply", 1, 6)), ((7, dt),))


def _p_softmax_backward(dt: str) -> Program:
    # grad, y -> y * (grad - sum(grad * y))
    return Program(((FULL, dt), (FULL, dt)), (("tt", "multiply", 0, 1), ("red", "add", 2),
                                              ("tt", "subtract", 0, 3), ("tt", "multiply", 1, 4)), ((5, dt),))


def _p_bias_grad(dt: str) -> Program:
    # gelu backward's output and the bias gradient summed from it in the same pass
    return Program(((FULL, dt), (FULL, dt)), (("tt", "multiply", 0, 1), ("csum", 2)), ((2, dt), (3, "fp32")))


def _p_mm_bias_gelu(dt: str) -> Program:
    return Program(((FULL, "fp32"), (ROW, dt)), (("tt", "add", 0, 1), *_gelu_tanh_steps(2, 3)), ((7, dt),))


def _p_mm_residual(dt: str) -> Program:
    return Program(((FULL, "fp32"), (ROW, dt), (FULL, dt)), (("tt", "add", 0, 1), ("tt", "add", 3, 2)), ((4, dt),))


PATTERNS: dict[str, tuple[str, Callable[[str], Program]]] = {
    "bias_gelu": ("x + bias, then GPT-2's tanh gelu (7 elementwise ops)", _p_bias_gelu),
    "softmax": ("softmax along each row, decomposed (max, subtract, exp, sum, divide)", _p_softmax),
    "layernorm": ("layer norm with its mean and rstd outputs", _p_layernorm),
    "rmsnorm": ("Llama's RMSNorm: x * rsqrt(mean(x^2) + eps) * weight", _p_rmsnorm),
    "softmax_backward": ("y * (grad - sum(grad * y)) along each row", _p_softmax_backward),
    "bias_grad": ("grad * x and its column sum (a bias gradient) in one pass", _p_bias_grad),
    "mm_bias_gelu": ("matmul epilogue: PSUM + bias, then tanh gelu", _p_mm_bias_gelu),
    "mm_residual": ("matmul epilogue: PSUM + bias + a residual", _p_mm_residual),
}


def resolve(program: Program, cols: int) -> Program:
    """``program`` with the shape-dependent immediates (``"1/cols"``: a mean's divisor) filled in."""
    def fix(x: Any) -> Any:
        return 1.0 / cols if x == "1/cols" else x
    return Program(program.inputs, tuple(tuple(fix(a) for a in st) for st in program.steps), program.outputs)


# ---------------------------------------------------------------------------------------------
# registry entries (inputs and references for `trnsim kernel ... --check` and the tests)
# ---------------------------------------------------------------------------------------------


def _program_of(shape: tuple[int, ...], dtype: str, params: Mapping[str, Any]) -> Program:
    prog = params.get("program") or pattern(params.get("pattern", "bias_gelu"), dtype)
    if not isinstance(prog, Program):
        raise KernelError("fused: program must be a trnsim.kernels.fused.Program (from Python); on the command line "
                          "choose a preset with pattern=")
    return resolve(prog, shape[-1])


def _inputs_for(prog: Program, rows: int, cols: int, rng: np.random.Generator, first: int = 0) -> dict[str, np.ndarray]:
    out = {}
    for i, (kind, _) in enumerate(prog.inputs):
        if i < first:
            continue
        a = rng.standard_normal(_HBM_SHAPES[kind](rows, cols)).astype(np.float32)
        out[f"in{i}"] = a
    return out


def _fused_inputs(shape, dtype, params, rng):
    return _inputs_for(_program_of(shape, dtype, params), shape[0], shape[1], rng)


def _fused_reference(inputs, shape, dtype, params):
    prog = _program_of(shape, dtype, params)
    arrays = [inputs[f"in{i}"] for i in range(len(prog.inputs))]
    return {f"out{j}": o for j, o in enumerate(reference(prog, arrays, shape[0], shape[1]))}


def _tolerance(dtype: str) -> tuple[float, float]:
    """(rtol, atol): fp32 sums in another order than the reference's, rounded to the output dtype
    (bf16/fp16: ~2 ulps; fp8 outputs: one ulp of a 3-bit mantissa)."""
    size = get_dtype(dtype).itemsize
    return {1: (0.13, 0.13), 2: (2e-2, 2e-2)}.get(size, (1e-4, 1e-4))


@register_kernel("fused", dims="ROWSxCOLS", dtypes=("fp32", "bf16", "fp16"), default_shape=(1024, 1024),
                 summary="a compiled region's ops as one kernel (a tile program: elementwise, row reductions, column "
                         "sums); --param pattern=" + "/".join(PATTERNS),
                 params={"pattern": "bias_gelu", "program": None, "bufs": 3}, inputs=_fused_inputs,
                 reference=_fused_reference, tolerance=_tolerance, split=split_dims(0))
def _fused_entry(rows: int, cols: int, dtype: str = "fp32", config: ChipConfig | str = "trn2",
                 pattern: str = "bias_gelu", program: Program | None = None, bufs: int = 3) -> Kernel:
    prog = _program_of((rows, cols), dtype, {"pattern": pattern, "program": program})
    return build_fused(rows, cols, dtype, config, program=prog, bufs=bufs)


def _mm_fused_inputs(shape, dtype, params, rng):
    m, k, n = shape
    prog = _program_of(shape, dtype, params)
    a = (m, k) if params.get("transpose_a") else (k, m)
    b = (n, k) if params.get("transpose_b") else (k, n)
    out = {("a" if params.get("transpose_a") else "lhsT"): rng.standard_normal(a, dtype=np.float32),
           ("b" if params.get("transpose_b") else "rhs"): rng.standard_normal(b, dtype=np.float32)}
    out.update(_inputs_for(prog, m, n, rng, first=1))
    return out


def _mm_fused_reference(inputs, shape, dtype, params):
    m, k, n = shape
    prog = _program_of(shape, dtype, params)
    a = round_to(inputs["a"], dtype) if "a" in inputs else round_to(inputs["lhsT"], dtype).T
    b = round_to(inputs["b"], dtype).T if "b" in inputs else round_to(inputs["rhs"], dtype)
    arrays = [(a @ b).astype(np.float32)] + [inputs[f"in{i}"] for i in range(1, len(prog.inputs))]
    return {f"out{j}": o for j, o in enumerate(reference(prog, arrays, m, n))}


@register_kernel("matmul_fused", dims="MxKxN", dtypes=("fp32", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2"),
                 default_shape=(1024, 1024, 1024),
                 summary="matmul with a compiled region's elementwise ops as its PSUM evacuation (bias, activation, "
                         "residual, scaling); --param pattern=mm_bias_gelu/mm_residual",
                 params={"transpose_a": False, "transpose_b": False, "pattern": "mm_bias_gelu", "program": None},
                 inputs=_mm_fused_inputs, reference=_mm_fused_reference, tolerance=_tolerance,
                 split=lambda shape, params, n: split_dims(*((0, 2) if shape[0] >= shape[2] else (2, 0)))(shape, params, n))
def _matmul_fused_entry(m: int, k: int, n: int, dtype: str = "fp32", config: ChipConfig | str = "trn2",
                        transpose_a: bool = False, transpose_b: bool = False, pattern: str = "mm_bias_gelu",
                        program: Program | None = None) -> Kernel:
    prog = _program_of((m, k, n), dtype, {"pattern": pattern, "program": program})
    return build_matmul_fused(m, k, n, dtype, config, transpose_a, transpose_b, program=prog)
