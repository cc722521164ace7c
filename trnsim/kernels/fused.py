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
* ``("cast", x, dtype)``: round to ``dtype`` (an explicit ``.to()`` in the graph);
* ``("causal", x, fill, period, diag)``: ``fill`` where ``col - (row mod period) >= diag``, else
  ``x`` - a causal mask (``masked_fill`` with ``torch.triu(ones, diag)``) made on GpSimd by
  ``affine_select`` from the indices, never loaded (one row per partition, row tiles inside one
  period).

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
from typing import Any, Callable, Mapping

import numpy as np

from ..config import ChipConfig
from ..isa import KernelError, TileAP
from ..builder.kernel import Kernel
from ..native.dtypes import get_dtype
from .elementwise import Piece, hbm_piece, row_pieces
from .program import (COL, FULL, HBM_SHAPES, KINDS, REDUCE, ROW, SCALAR, Emitter, Program, assign_engines,  # noqa: F401 - the program's names, re-exported
                      broadcast_row, csum_banks, emission_slots, fold_steps, last_uses, pipeline, program_phases,
                      reference, step_args, step_class, step_levels, tile_dtype, value_slots)
from .reference import round_to
from .registry import register_kernel, split_dims

__all__ = ["Program", "FULL", "ROW", "COL", "SCALAR", "reference", "build_fused", "build_matmul_fused", "PATTERNS",
           "pattern"]


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
    phase = program_phases(prog, kinds)
    ins = [kern.input(f"in{i}", HBM_SHAPES[k](rows, cols), dt) for i, (k, dt) in enumerate(prog.inputs)]
    outs = [kern.output(f"out{j}", HBM_SHAPES[kinds[v]](rows, cols), dt) for j, (v, dt) in enumerate(prog.outputs)]
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
        activation -> reduction steps made in one ScalarE pass (:func:`fold_steps`)."""
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
        both = [registers(depth, {}), registers(depth, fold_steps(prog, kinds, phase, True))]
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
    if csum_banks(prog, cols, tn) > cfg.core.psum.banks:
        raise KernelError(f"{name}: column sums over {cols} columns need {csum_banks(prog, cols, tn)} PSUM "
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
            res[i] = broadcast_row(kern, ins[i], P, cols, dt, f"row{i}")
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

    folded = fold_steps(prog, kinds, phase, g1)
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
            em.step(j, dst, tiles, p, g, c, c0, red, r0=pc.r0)
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
    ins: dict[int, Any] = {i: kern.input(f"in{i}", HBM_SHAPES[kd](m, n), dt)
                           for i, (kd, dt) in enumerate(prog.inputs) if i > 0}
    outs = [kern.output(f"out{j}", HBM_SHAPES[kinds[v]](m, n), dt) for j, (v, dt) in enumerate(prog.outputs)]
    res: dict[int, TileAP] = {}
    P = min(P, m)
    for i, (kd, dt) in ((i, x) for i, x in enumerate(prog.inputs) if i > 0):
        if kd == ROW:
            res[i] = broadcast_row(kern, ins[i], P, n, dt, f"row{i}")
        elif kd == SCALAR:
            res[i] = kern.sbuf((P, 1), dt, name=f"scalar{i}")
            kern.dma_copy(res[i], ins[i].ap(0, [[0, P], [1, 1]]), queue=3)
    phase = program_phases(prog, kinds)
    for j in range(len(prog.steps)):
        if phase[n_in + j] == "pre":
            raise KernelError(f"{name}: step {j} computes on per-column values only; fold it into the program's inputs")
    cls = [step_class(st, kinds, True) for st in prog.steps]
    engines = assign_engines(cls, [1.0] * len(cls), cfg, [0 in step_args(st) for st in prog.steps])
    em = Emitter(kern, prog, kinds, engines)
    out_of: dict[int, list[int]] = {}
    for j, (v, _) in enumerate(prog.outputs):
        out_of.setdefault(v, []).append(j)
    last = last_uses(prog, phase)
    nslots, slot_of = value_slots(prog, phase, kinds, last, FULL)
    ncols, col_slot_of = value_slots(prog, phase, kinds, last, COL)
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
        a = rng.standard_normal(HBM_SHAPES[kind](rows, cols)).astype(np.float32)
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


def _split_rows(shape: tuple[int, ...], params: Mapping[str, Any], n: int) -> list[tuple[int, ...]] | None:
    """Rows cut between the physical cores; a program with a causal step only at whole periods
    of its mask (each core's kernel numbers its rows from 0), else on one core."""
    prog = params.get("program")
    periods = [st[3] for st in prog.steps if st[0] == "causal"] if isinstance(prog, Program) else []
    parts = split_dims(0)(shape, params, n)
    if parts and any(p[0] % q for p in parts[:-1] for q in periods):
        return None
    return parts


@register_kernel("fused", dims="ROWSxCOLS", dtypes=("fp32", "bf16", "fp16"), default_shape=(1024, 1024),
                 summary="a compiled region's ops as one kernel (a tile program: elementwise, row reductions, column "
                         "sums); --param pattern=" + "/".join(PATTERNS),
                 params={"pattern": "bias_gelu", "program": None, "bufs": 3}, inputs=_fused_inputs,
                 reference=_fused_reference, tolerance=_tolerance, split=_split_rows)
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
