"""A multi-tensor (``_foreach_*``) fused kernel: one instruction stream over a list of tensors.

An optimizer step is a chain of ``_foreach_*`` ops over lists of tensors (parameters, gradients,
optimizer state) whose element ``i`` has the shape of parameter ``i``. ``torch.compile`` on the
neuron device (``torch_bridge/compile/foreach.py``) writes such a chain as one elementwise
:class:`~trnsim.kernels.fused.Program` per list index, the same for every index, and this kernel
runs it over every tensor in one launch, as Inductor's foreach kernels do on GPUs:

* each ``full`` input (a parameter, a gradient, a state tensor) is streamed from HBM once, each
  output written once; an output listed in ``inplace`` is written back into the input it
  updates (the functionalized graph's ``copy_`` into the parameter or state, absorbed as the
  kernel's store), so the kernel's HBM traffic is the step's own: read p, g, m, v, write p, m, v;
* ``scalar`` inputs are one element per tensor (a step count, a bias correction): all tensors'
  scalars are loaded into one ``[1, tensors]`` row (one DMA when the host holds them and passes
  them as an argument block, ``scalar_args``; else one per tensor), broadcast to the partitions
  by a ones-matmul, and the program's steps on scalars only run once on that ``[P, tensors]``
  tile, before the tile loop; a tile of tensor ``i`` reads column ``i`` as a per-partition operand;
* a tensor of ``n`` elements is laid out ``[P, n // P]`` (partition ``p`` holds a contiguous
  chunk) in column tiles of up to ``width`` elements, plus a ``[n % P, 1]`` remainder; small
  tensors (under :data:`SMALL_COLS` elements per partition, or fewer than ``P`` elements) are
  packed side by side into shared tiles, one instruction per step for the pack, their scalars
  expanded to columns once; the tiles of all tensors form one loop, software-pipelined with one
  stage per dependency level (a small tensor's chain of ~10 dependent steps is latency, not
  work: up to :data:`STAGES` tiles are in flight), each step on the engine the greedy balance of
  the fused kernel gives it (published per-element costs, datasheet §7). Registers: a linear
  scan in emission order, each tile using one of ``stages + 1`` fixed buffer sets in turn.

Shape ``TENSORSxELEMS``: the kernel's core streams ``ELEMS`` elements shared over ``TENSORS``
tensors in proportion to ``sizes`` (default equal): at LNC=2 each physical core takes half of every
tensor, as an SPMD multi-tensor kernel splits its work. Values: :func:`reference` per tensor.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import numpy as np

from ..config import ChipConfig
from ..isa import KernelError, TileAP
from ..builder.kernel import Kernel
from ..native.dtypes import get_dtype
from .program import (FULL, SCALAR, Program, step_args, assign_engines, Emitter, step_levels, step_class, emission_slots, pipeline,
                      tile_dtype, reference)
from .registry import register_kernel

#: pipeline stages at most (one per dependency level of the program)
STAGES = 8
#: elements per partition under which a tensor is packed with others: transfers under 512 B per
#: partition are overhead-bound (datasheet §6: "under 256 B per partition: severely"), and an
#: instruction costs at least MIN_II = 64 cycles (§7) however few elements it has
SMALL_COLS = 128

__all__ = ["build_foreach_fused", "shares", "PATTERNS", "pattern", "foreach_reference"]


def shares(tensors: int, elems: int, sizes: Sequence[int] | None) -> list[int]:
    """Elements of each tensor this core streams: ``elems`` shared in proportion to ``sizes``
    (equal shares without them); with ``elems == sum(sizes)``, exactly ``sizes``."""
    if sizes is None:
        sizes = [1] * tensors
    try:  # from the CLI: "65536,32768,..."
        sizes = [int(s) for s in (str(sizes).split(",") if isinstance(sizes, (str, int)) else sizes)]
    except (TypeError, ValueError):
        raise KernelError(f"foreach_fused: sizes must be element counts joined by ',' (one per tensor), "
                          f"got {str(sizes)[:40]!r}") from None
    if len(sizes) != tensors or any(s < 0 for s in sizes) or sum(sizes) < 1:
        raise KernelError(f"foreach_fused: sizes must be {tensors} element counts >= 0 (one per tensor), "
                          f"got {len(sizes)}")
    total = sum(sizes)
    out = [s * elems // total for s in sizes]
    rest = elems - sum(out)
    for i in sorted(range(tensors), key=lambda i: -sizes[i])[:rest]:
        out[i] += 1
    return out


def _pairs(inplace: Any, name: str) -> list[tuple[int, int]]:
    """``inplace`` as (output, input) pairs; the command line's ``"0:0,1:2"`` too."""
    try:
        if isinstance(inplace, str):
            return [(int(a), int(b)) for a, b in (x.split(":") for x in inplace.split(",") if x)]
        return [(int(a), int(b)) for a, b in inplace]
    except (TypeError, ValueError):
        raise KernelError(f"{name}: inplace must be (output, input) pairs, e.g. inplace=0:0,1:2; got "
                          f"{str(inplace)[:40]!r}") from None


def _phases(prog: Program, kinds: list[str]) -> list[str]:
    """``pre`` (scalars: once for all tensors, before the loop) or ``loop`` (per tile)."""
    phase = ["loop" if k == FULL else "pre" for k in kinds[:len(prog.inputs)]]
    for st in prog.steps:
        phase.append("loop" if any(phase[a] == "loop" for a in step_args(st)) else "pre")
    return phase


def build_foreach_fused(tensors: int, elems: int, dtype: str = "fp32", config: ChipConfig | str = "trn2",
                        pattern: str = "adamw", program: Program | None = None, sizes: Sequence[int] | None = None,
                        inplace: Sequence[tuple[int, int]] | None = None, width: int = 2048, bufs: int = 3,
                        scalar_args: bool = False, name: str = "foreach_fused") -> Kernel:
    """``program`` (or the preset ``pattern``) over ``tensors`` tensors of ``elems`` elements in all
    (module docstring). HBM: ``in{k}_{i}`` / ``out{j}_{i}`` for input ``k`` / output ``j`` of tensor
    ``i``; ``inplace`` pairs (output j, input k): output j is stored into ``in{k}_{i}`` (inout).
    ``scalar_args``: each scalar input is one ``in{k}`` of ``tensors`` elements, the block of kernel
    arguments the host writes for values it holds (a non-capturable optimizer's step-derived
    scalars), read with one DMA; otherwise each tensor's scalar is a device tensor of its own."""
    for what, d in (("tensors", tensors), ("elems", elems), ("width", width), ("bufs", bufs)):
        if isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 1:
            raise KernelError(f"{name}: {what} must be a positive integer, got {d!r}")
    if program is not None and not isinstance(program, Program):
        raise KernelError(f"{name}: program must be a trnsim.kernels.fused.Program (from Python); on the command "
                          f"line choose a preset with pattern=")
    prog = program if program is not None else globals()["pattern"](pattern, dtype)
    kinds = prog.kinds()
    if not prog.elementwise or any(k not in (FULL, SCALAR) for k in kinds):
        raise KernelError(f"{name}: a multi-tensor program is elementwise on 'full' and 'scalar' values only")
    inplace = _pairs(inplace if inplace is not None else PATTERNS_INPLACE.get(pattern, ()) if program is None else (),
                     name)
    into: dict[int, int] = {}
    for j, k in inplace:
        if not (0 <= j < len(prog.outputs) and 0 <= k < len(prog.inputs)) or k in into.values() or j in into:
            raise KernelError(f"{name}: inplace pair ({j}, {k}) must name an output and an input, each once")
        if kinds[prog.outputs[j][0]] != prog.inputs[k][0] or get_dtype(prog.outputs[j][1]) != get_dtype(prog.inputs[k][1]):
            raise KernelError(f"{name}: output {j} cannot be written into input {k} (kind or dtype differ)")
        into[j] = k
        if scalar_args and prog.inputs[k][0] == SCALAR:
            raise KernelError(f"{name}: scalar input {k} is a host argument (scalar_args); it cannot be written")
    ns = shares(tensors, elems, sizes)
    if min(ns) < 1:
        raise KernelError(f"{name}: {elems} elements leave tensor {ns.index(0)} of {tensors} with none; give each "
                          f"tensor at least one (ELEMS >= TENSORS, sizes > 0)")
    kern = Kernel(name, config)
    cfg = kern.config
    P = cfg.core.sbuf.partitions
    n_in = len(prog.inputs)
    phase = _phases(prog, kinds)

    def hbm_shape(kind: str, n: int) -> tuple[int, ...]:
        return (max(n, 1),) if kind == FULL else (1,)

    ins: list[list[Any]] = []
    outs: list[list[Any]] = []
    args = {k: kern.input(f"in{k}", (tensors,), dt) for k, (kd, dt) in enumerate(prog.inputs)
            if kd == SCALAR and scalar_args}
    for i, n in enumerate(ns):
        row = [args[k] if k in args else kern.input(f"in{k}_{i}", hbm_shape(kd, n), dt)
               for k, (kd, dt) in enumerate(prog.inputs)]
        for k in into.values():
            row[k].kind = "inout"  # the kernel writes it: an optimizer's parameter or state, updated in place
        ins.append(row)
        outs.append([row[into[j]] if j in into else kern.output(f"out{j}_{i}", hbm_shape(kinds[v], n), dt)
                     for j, (v, dt) in enumerate(prog.outputs)])
    out_of: dict[int, list[int]] = {}
    for j, (v, _) in enumerate(prog.outputs):
        out_of.setdefault(v, []).append(j)

    # ---- scalars: every tensor's in one row, broadcast once, the scalar steps once for all tensors
    L = tensors
    res: dict[int, TileAP] = {}
    scalar_ins = [k for k in range(n_in) if kinds[k] == SCALAR]
    if scalar_ins:
        tn = min(cfg.core.tensor.moving_max_free, cfg.core.psum.bank_bytes // 4)
        ones = kern.sbuf((1, P), "fp32", name="ones")
        kern.memset(ones, 1.0)
        ps = kern.psum((P, min(L, tn)), "fp32", name="scalars_ps")
        for k in scalar_ins:
            row1 = kern.sbuf((1, L), prog.inputs[k][1], name=f"scalars{k}_1")
            if k in args:
                kern.dma_copy(row1, args[k].ap(0, [[0, 1], [1, L]]), queue=3)
            else:
                for i in range(L):
                    kern.dma_copy(row1[:, i:i + 1], ins[i][k].ap(0, [[0, 1], [1, 1]]), queue=3 + i % 4)
            res[k] = kern.sbuf((P, L), "fp32", name=f"scalars{k}")
            for c0 in range(0, L, tn):
                w = min(tn, L - c0)
                kern.nc_matmul(ps[:, :w], ones, row1[:, c0:c0 + w])
                kern.tensor_copy(res[k][:, c0:c0 + w], ps[:, :w], engine="vector")
        kern.free(ps)
    g1 = True
    cls = [step_class(st, kinds, g1) for st in prog.steps]
    weights = [1.0 if phase[n_in + j] == "loop" else 0.0 for j in range(len(prog.steps))]
    engines = assign_engines(cls, weights, cfg)
    em = Emitter(kern, prog, kinds, engines)
    for j in range(len(prog.steps)):
        v = n_in + j
        if phase[v] == "pre":
            res[v] = kern.sbuf((P, L), "fp32", name=f"pre{v}")
            em.step(j, res[v], res, P, 1, L, 0)
    for j, (v, _) in enumerate(prog.outputs):
        if phase[v] == "pre":
            for i in range(L):
                kern.dma_copy(outs[i][j].ap(0, [[0, 1], [1, 1]]), res[v][:1, i:i + 1], queue=3 + i % 4)

    # ---- the tile loop over every tensor's pieces, software-pipelined
    loop_steps = [j for j in range(len(prog.steps)) if phase[n_in + j] == "loop"]
    levels = step_levels(prog, phase)
    top = max((levels[j] for j in loop_steps), default=1)
    nstages = max(1, min(top, STAGES))
    stages = [[j for j in loop_steps if (levels[j] - 1) * nstages // top == si] for si in range(nstages)]
    # registers: a linear scan in emission order (loads, then stage 0's steps, stage 1's ...), so a
    # value reuses a slot only after its last reader is emitted; each piece uses one of `sets`
    # fixed sets of slot buffers in turn (piece i and i + sets never overlap in time)
    order = [k for k in range(n_in) if phase[k] == "loop"] + [n_in + j for sj in stages for j in sj]
    pos = {v: t for t, v in enumerate(order)}
    lastpos = {v: pos[v] for v in order}
    for j in loop_steps:
        for a in step_args(prog.steps[j]):
            if phase[a] == "loop":
                lastpos[a] = max(lastpos[a], pos[n_in + j])
    nslots, slot_of = emission_slots(order, lastpos)
    sets = nstages + (1 if bufs > 2 else 0)
    budget = cfg.core.sbuf.partition_bytes * 7 // 8 - (len(res) + 1) * L * 4
    # small tensors (under SMALL_COLS elements per partition: DMA- and instruction-overhead-bound on
    # their own, datasheet §6-7) are packed side by side into shared tiles, one instruction per step
    # for the pack; tensors of fewer than P elements sit on their first partitions, one column each
    small = [i for i, n in enumerate(ns) if n and ((n % P == 0 and n // P < SMALL_COLS) or n < P)]
    cols_small = sum(max(1, ns[i] // P) for i in small)
    width = min(width, max([n // P for n in ns] + [cols_small, 1]))
    width = min(width, budget // max(1, sets * nslots * 4))
    if width < 1:
        raise KernelError(f"{name}: {nslots} live tiles per piece do not fit SBUF on {cfg.name}")
    pools = [[kern.tile_pool(f"v{s}_{d}", bufs=1) for s in range(nslots)] for d in range(sets)]
    # a piece: (partitions, columns, members); a member: (tensor, first column, HBM offset,
    # partitions, columns, HBM row stride)
    Member = tuple[int, int, int, int, int, int]
    pieces: list[tuple[int, int, list[Member]]] = []
    packs: dict[int, list[Member]] = {}  # partitions -> the open pack's members
    for i, n in enumerate(ns):
        m = n // P
        if i in small:
            p, w = (P, m) if n % P == 0 else (n, 1)
            pack = packs.setdefault(p, [])
            if sum(x[4] for x in pack) + w > width:
                pieces.append((p, sum(x[4] for x in pack), pack))
                pack = packs[p] = []
            pack.append((i, sum(x[4] for x in pack), 0, p, w, w))
            continue
        for c0 in range(0, m, width):
            w = min(width, m - c0)
            pieces.append((P, w, [(i, 0, c0, P, w, m)]))
        if n % P:
            pieces.append((n % P, 1, [(i, 0, P * m, n % P, 1, 1)]))
    pieces += [(p, sum(x[4] for x in pack), pack) for p, pack in sorted(packs.items()) if pack]
    # a pack reads each tensor's scalars as columns: expanded once, before the loop
    expand = [v for v in range(len(kinds)) if phase[v] == "pre" and
              any(v in step_args(prog.steps[j]) for j in loop_steps)]
    packed_kinds = [FULL if v in expand else k for v, k in enumerate(kinds)]
    em_packed = Emitter(kern, prog, packed_kinds, engines)
    expanded: dict[int, dict[int, TileAP]] = {}
    turn = 0
    for q, (p, w, members) in enumerate(pieces):
        if len(members) < 2:
            continue
        expanded[q] = {}
        for v in expand:
            e = expanded[q][v] = kern.sbuf((p, w), "fp32", name=f"pack{q}_{v}")
            for i, c, _, pi, wi, _ in members:
                kern.tensor_copy(e[:pi, c:c + wi], res[v][:pi, i:i + 1].broadcast_to(pi, wi),
                                 engine=("vector", "gpsimd")[turn % 2])
                turn += 1

    def hbm(t: Any, mb: Member) -> Any:
        _, _, off, p, w, stride = mb
        return t.ap(off, [[stride, p], [1, w]])

    def stage(si: int, pi: int, pc: tuple[int, int, list[Member]], tiles: dict[int, TileAP]) -> None:
        p, w, members = pc
        slots = pools[pi % sets]
        packed = len(members) > 1
        i0 = members[0][0]
        if si == 0:
            for k in range(n_in):
                if phase[k] == "pre":
                    tiles[k] = expanded[pi][k][:p, :w] if k in expand and packed else res[k][:p, i0:i0 + 1]
                    continue
                dt = prog.inputs[k][1]
                t = slots[slot_of[k]].tile((P, width * 4 // get_dtype(dt).itemsize), dt)[:p, :w]
                for x, mb in enumerate(members):  # a pack's many small transfers spread over more queues
                    kern.dma_copy(t[:mb[3], mb[1]:mb[1] + mb[4]], hbm(ins[mb[0]][k], mb),
                                  queue=(k + 3 * x) % 9 if packed else k % 3)
                tiles[k] = t
            for j in range(len(prog.steps)):
                v = n_in + j
                if phase[v] == "pre":
                    tiles[v] = expanded[pi][v][:p, :w] if v in expand and packed else res[v][:p, i0:i0 + 1]
        for j in stages[si]:
            v = n_in + j
            dt = tile_dtype(prog, kinds, phase, v, out_of)
            dst = slots[slot_of[v]].tile((P, width * 4 // get_dtype(dt).itemsize), dt)[:p, :w]
            (em_packed if packed else em).step(j, dst, tiles, p, 1, w, 0)
            tiles[v] = dst
            for o in out_of.get(v, []):
                for x, mb in enumerate(members):
                    kern.dma_copy(hbm(outs[mb[0]][o], mb), dst[:mb[3], mb[1]:mb[1] + mb[4]], engine=engines[j],
                                  queue=x % 2)
        if si == 0:
            for k in range(n_in):  # an input that is an output as it is
                for o in out_of.get(k, []):
                    for mb in members:
                        if phase[k] == "loop" and outs[mb[0]][o] is not ins[mb[0]][k]:
                            kern.dma_copy(hbm(outs[mb[0]][o], mb), tiles[k][:mb[3], mb[1]:mb[1] + mb[4]], queue=4)

    pipeline(pieces, nstages, stage, dict)
    return kern


# ---------------------------------------------------------------------------------------------
# presets and the registry entry
# ---------------------------------------------------------------------------------------------


def _p_adamw(dt: str) -> Program:
    """One tensor of AdamW (lr 1e-3, betas 0.9/0.999, eps 1e-8, weight decay 0.01) as the compiled
    (capturable) step spells it: param, grad, exp_avg, exp_avg_sq, step -> the four updated."""
    return Program(((FULL, dt), (FULL, dt), (FULL, dt), (FULL, dt), (SCALAR, "fp32")), (
        ("ts", 4, "add", 1.0, None, None, False),                    # 5: step + 1
        ("ts", 5, "power", 0.9, "multiply", -1.0, True),             # 6: -beta1^t
        ("ts", 6, "add", 1.0, None, None, False),                    # 7: bias correction 1
        ("ts", 5, "power", 0.999, "multiply", -1.0, True),           # 8: -beta2^t
        ("ts", 8, "add", 1.0, None, None, False),                    # 9: bias correction 2
        ("act", "sqrt", 9, 1.0, 0.0),                                # 10
        ("ts", 7, "divide", 1e-3, None, None, True),                 # 11: step size lr / bc1
        ("ts", 0, "multiply", 1.0 - 1e-3 * 0.01, None, None, False),  # 12: decayed param
        ("tt", "subtract", 1, 2),                                    # 13: g - m
        ("ts", 13, "multiply", 0.1, None, None, False),              # 14
        ("tt", "add", 2, 14),                                        # 15: m'
        ("ts", 3, "multiply", 0.999, None, None, False),             # 16
        ("act", "square", 1, 1.0, 0.0),                              # 17: g^2
        ("ts", 17, "multiply", 1e-3, None, None, False),             # 18
        ("tt", "add", 16, 18),                                       # 19: v'
        ("act", "sqrt", 19, 1.0, 0.0),                               # 20
        ("tt", "divide", 20, 10),                                    # 21
        ("ts", 21, "add", 1e-8, None, None, False),                  # 22: denominator
        ("tt", "divide", 15, 22),                                    # 23
        ("tt", "multiply", 23, 11),                                  # 24
        ("tt", "subtract", 12, 24)), ((25, dt), (15, dt), (19, dt), (5, "fp32")))


def _p_adamw_host(dt: str) -> Program:
    """AdamW as a compiled non-capturable step runs on the device: the step count and the bias
    corrections stay on the host, two scalars per tensor (sqrt(bias correction 2) and -bc1/lr)."""
    return Program(((FULL, dt), (FULL, dt), (FULL, dt), (FULL, dt), (SCALAR, "fp32"), (SCALAR, "fp32")), (
        ("ts", 0, "multiply", 1.0 - 1e-3 * 0.01, None, None, False),  # 6: decayed param
        ("tt", "subtract", 1, 2),                                    # 7: g - m
        ("ts", 7, "multiply", 0.1, None, None, False),               # 8
        ("tt", "add", 2, 8),                                         # 9: m'
        ("ts", 3, "multiply", 0.999, None, None, False),             # 10
        ("act", "square", 1, 1.0, 0.0),                              # 11: g^2
        ("ts", 11, "multiply", 1e-3, None, None, False),             # 12
        ("tt", "add", 10, 12),                                       # 13: v'
        ("act", "sqrt", 13, 1.0, 0.0),                               # 14
        ("tt", "divide", 14, 4),                                     # 15
        ("ts", 15, "add", 1e-8, None, None, False),                  # 16
        ("tt", "divide", 16, 5),                                     # 17: denominator / step size
        ("tt", "divide", 9, 17),                                     # 18
        ("tt", "add", 6, 18)), ((19, dt), (9, dt), (13, dt)))


def _p_sgd_momentum(dt: str) -> Program:
    """One tensor of SGD (lr 0.05, momentum 0.9, weight decay 1e-4): param, grad, momentum buffer ->
    the updated param and buffer."""
    return Program(((FULL, dt), (FULL, dt), (FULL, dt)), (
        ("ts", 0, "multiply", 1e-4, None, None, False),   # 3
        ("tt", "add", 1, 3),                              # 4: g + wd p
        ("ts", 2, "multiply", 0.9, None, None, False),    # 5
        ("tt", "add", 5, 4),                              # 6: buf'
        ("ts", 6, "multiply", 0.05, None, None, False),   # 7
        ("tt", "subtract", 0, 7)), ((8, dt), (6, dt)))


PATTERNS: dict[str, tuple[str, Callable[[str], Program]]] = {
    "adamw": ("AdamW's step per tensor (param, grad, exp_avg, exp_avg_sq, step), state updated in place", _p_adamw),
    "adamw_host": ("AdamW per tensor with the step and bias corrections on the host (scalar_args=true: one "
                   "argument block per scalar)", _p_adamw_host),
    "sgd_momentum": ("SGD with momentum and weight decay per tensor, param and buffer updated in place",
                     _p_sgd_momentum),
}
PATTERNS_INPLACE: dict[str, tuple[tuple[int, int], ...]] = {
    "adamw": ((0, 0), (1, 2), (2, 3), (3, 4)), "adamw_host": ((0, 0), (1, 2), (2, 3)), "sgd_momentum": ((0, 0), (1, 2))}


def pattern(name: str, dtype: str = "fp32") -> Program:
    if name not in PATTERNS:
        raise KernelError(f"foreach_fused: unknown pattern {name!r}; expected one of {', '.join(sorted(PATTERNS))}")
    return PATTERNS[name][1](get_dtype(dtype).short)


def _setup(shape: tuple[int, ...], dtype: str, params: Mapping[str, Any]) -> tuple[Program, list[int], dict[int, int]]:
    prog = params.get("program") or pattern(params.get("pattern", "adamw"), dtype)
    inplace = params.get("inplace")
    if inplace is None:
        inplace = PATTERNS_INPLACE.get(params.get("pattern", "adamw"), ()) if not params.get("program") else ()
    return prog, shares(shape[0], shape[1], params.get("sizes")), dict(_pairs(inplace, "foreach_fused"))


def foreach_reference(prog: Program, arrays: Sequence[Sequence[np.ndarray]], into: Mapping[int, int]
                      ) -> list[dict[str, np.ndarray]]:
    """Per tensor ``i``: ``{HBM name: array}`` of what the kernel writes (numpy, float64)."""
    out = []
    for i, arrs in enumerate(arrays):
        n = max(np.asarray(arrs[0]).size, 1) if prog.inputs[0][0] == FULL else 1
        flat = [np.asarray(a).reshape(1, -1) if kd == FULL else np.asarray(a).reshape(1, 1)
                for a, (kd, _) in zip(arrs, prog.inputs)]
        res = reference(prog, flat, 1, n)
        out.append({(f"in{into[j]}_{i}" if j in into else f"out{j}_{i}"): r.reshape(-1) for j, r in enumerate(res)})
    return out


def _inputs(shape, dtype, params, rng):
    prog, ns, _ = _setup(shape, dtype, params)
    out = {}
    for k, (kd, _) in enumerate(prog.inputs):
        if kd == SCALAR and params.get("scalar_args"):
            out[f"in{k}"] = np.asarray([float(i % 7 + 1) for i in range(len(ns))], dtype=np.float32)
    for i, n in enumerate(ns):
        for k, (kd, _) in enumerate(prog.inputs):
            if kd == SCALAR and params.get("scalar_args"):
                continue
            if kd == SCALAR:
                out[f"in{k}_{i}"] = np.asarray([float(i % 7 + 1)], dtype=np.float32)  # a step count
            elif k == 3 and str(params.get("pattern", "adamw")).startswith("adamw") and not params.get("program"):
                out[f"in{k}_{i}"] = np.abs(rng.standard_normal(max(n, 1))).astype(np.float32)  # exp_avg_sq >= 0
            else:
                out[f"in{k}_{i}"] = rng.standard_normal(max(n, 1)).astype(np.float32)
    return out


def _reference(inputs, shape, dtype, params):
    from .reference import round_to

    prog, ns, into = _setup(shape, dtype, params)
    def arr(k: int, i: int, kd: str) -> np.ndarray:
        return inputs[f"in{k}"][i:i + 1] if kd == SCALAR and params.get("scalar_args") else inputs[f"in{k}_{i}"]
    arrays = [[round_to(arr(k, i, kd), dt) for k, (kd, dt) in enumerate(prog.inputs)] for i in range(len(ns))]
    res: dict[str, np.ndarray] = {}
    for d in foreach_reference(prog, arrays, into):
        res.update(d)
    return res


def _split(shape: tuple[int, ...], params: Mapping[str, Any], n: int) -> list[tuple[int, ...]] | None:
    """Each physical core takes about 1/n of every tensor (an SPMD multi-tensor kernel)."""
    tensors, elems = shape
    parts = [(tensors, elems // n + (1 if r < elems % n else 0)) for r in range(n)]
    try:
        if any(min(shares(tensors, e, params.get("sizes"))) < 1 for _, e in parts):
            return None  # a tensor too small to share: one core runs it all
    except KernelError:
        return None
    return parts


@register_kernel("foreach_fused", dims="TENSORSxELEMS", dtypes=("fp32", "bf16", "fp16"), default_shape=(16, 1 << 20),
                 summary="a compiled optimizer step: one multi-tensor kernel over every parameter, gradient and state "
                         "tensor, updated in place; --param pattern=" + "/".join(PATTERNS),
                 params={"pattern": "adamw", "program": None, "sizes": None, "inplace": None, "width": 2048, "bufs": 3,
                         "scalar_args": False},
                 inputs=_inputs, reference=_reference, tolerance=lambda dt: (2e-2, 2e-2) if get_dtype(dt).itemsize == 2
                 else (1e-4, 1e-4), split=_split)
def _foreach_entry(tensors: int, elems: int, dtype: str = "fp32", config: ChipConfig | str = "trn2",
                   pattern: str = "adamw", program: Program | None = None, sizes: Sequence[int] | None = None,
                   inplace: Sequence[tuple[int, int]] | None = None, width: int = 2048, bufs: int = 3,
                   scalar_args: bool = False) -> Kernel:
    return build_foreach_fused(tensors, elems, dtype, config, pattern=pattern, program=program, sizes=sizes,
                               inplace=inplace, width=width, bufs=bufs, scalar_args=scalar_args)
