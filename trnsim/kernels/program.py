"""Tile programs: what a fused region computes, as a :class:`Program` of engine steps over one
``[rows, cols]`` layout (the kinds ``full``/``row``/``col``/``scalar`` and the steps are described
in :mod:`trnsim.kernels.fused`), with its numpy definition (:func:`reference`), the engines a
greedy balance gives each step (:func:`assign_engines`), the :class:`Emitter` that writes steps
as builder instructions, and the scheduling helpers (phases, value slots, software
pipelining) the fused, foreach and attention kernels share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from ..config import ChipConfig
from ..isa import ACTIVATIONS, ALU_OPS, KernelError, TileAP
from ..builder.kernel import Kernel
from ..native.dtypes import get_dtype
from .reference import round_to

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
            if op == "causal":
                if k[0] != FULL or len(st) != 5 or isinstance(st[3], bool) or not isinstance(st[3], int) or \
                        st[3] < 1 or isinstance(st[4], bool) or not isinstance(st[4], int):
                    raise KernelError(f"fused: step {j}: causal takes a full value, a fill, a row period >= 1 "
                                      f"and a whole diagonal")
                kinds.append(FULL)
            elif op in ("act", "ts", "cast"):
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
HBM_SHAPES: dict[str, Callable[[int, int], tuple[int, ...]]] = {
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
        elif op == "causal":  # fill where col - (row mod period) >= diag (torch.triu(ones, diag)'s ones)
            x, fill, period, diag = st[1:]
            above = (np.arange(cols)[None, :] - (np.arange(rows) % period)[:, None]) >= diag
            vals.append(np.where(above, np.float64(fill), vals[x]))
        else:  # cast
            vals.append(round_to(vals[st[1]], st[2]))
    outs = []
    for v, dt in program.outputs:
        shape = _SHAPES[kinds[v]](rows, cols)
        outs.append(np.broadcast_to(vals[v], shape).reshape(HBM_SHAPES[kinds[v]](rows, cols)))
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
            "tts": {"vector": v, "gpsimd": g, "scalar": s}, "red": {"vector": v, "gpsimd": g},
            "causal": {"gpsimd": g}}  # affine_select: GpSimd only


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
             reduce_into: tuple[TileAP, str] | None = None, r0: int | None = None) -> None:
        """Emit step ``j`` writing ``dst`` (already shaped for the step's kind); ``r0``: the
        tile's first row (a causal step needs it)."""
        kern, st, eng = self.kern, self.program.steps[j], self.engines[j]
        op = st[0]
        kind = self.kinds[len(self.program.inputs) + j]
        if op == "causal":
            # GpSimd's affine_select keeps x where (row mod period) + diag - 1 - col >= 0: with the
            # tile's rows inside one period, row mod period = r0 mod period + g partition + i (its
            # i-th of g rows), and the predicate is affine in (partition, i, column)
            x, fill, period, diag = st[1:]
            if r0 is None or r0 % period + p * g > period:
                raise KernelError("fused: a causal step needs row tiles inside one period of the mask")
            off = r0 % period + diag - 1 - c0
            if g > 1:
                kern.affine_select(self.full_view(dst, p, g, c), self.full_view(tiles[x], p, g, c),
                                   cmp="greater_equal", offset=off, channel_multiplier=g, pattern=[1, -1],
                                   on_false=float(fill))
            else:
                kern.affine_select(dst, tiles[x], cmp="greater_equal", offset=off, channel_multiplier=1,
                                   pattern=[-1], on_false=float(fill))
        elif op == "act":
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


def program_phases(program: Program, kinds: list[str]) -> list[str]:
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


def last_uses(program: Program, phase: list[str]) -> dict[int, int]:
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


def csum_banks(program: Program, cols: int, tn: int) -> int:
    return sum(1 for st in program.steps if st[0] == "csum") * -(-cols // tn)


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


def broadcast_row(kern: Kernel, vec: Any, parts: int, cols: int, dt: str, name: str) -> TileAP:
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


def value_slots(prog: Program, phase: list[str], kinds: list[str], last: Mapping[int, int], kind: str
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


def fold_steps(prog: Program, kinds: list[str], phase: list[str], g1: bool) -> dict[int, int]:
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
