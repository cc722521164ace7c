"""Flash attention ``out = softmax(q kᵀ · scale + mask) v`` over [B, H, S, D], one NeuronCore.

Written the way NKI's flash-attention forward sample is: the score matrix never leaves the
chip and is never held whole. For each 128-query tile the kernel walks the key tiles (512 keys,
one PSUM bank of fp32 scores) and keeps three running quantities per query row: ``nm``, minus
the scaled row max; ``l``, the softmax denominator; ``o``, the unnormalised output. Per key
tile, in three stages:

A. TensorE ``s = q kᵀ`` into PSUM (head dim D on the partition axis of both operands); VectorE
   the row max and the new ``nm``; ScalarE ``p = exp(scale·s + nm)`` with the row sum fused into
   the same instruction and ``alpha = exp(nm_new - nm_old)``, the rescale of what earlier key
   tiles summed; GpSimd ``l = l·alpha + rowsum``.
B. TensorE ``pᵀ``, 128 keys per ``nc_transpose``; VectorE/ScalarE copy it out of PSUM.
C. TensorE ``p v`` accumulated over those 128-key chunks in one PSUM group; GpSimd ``o·alpha``
   and VectorE ``+ p v``.

The last step divides ``o`` by ``l``. Causal attention skips key tiles that start after a
query tile's last row, cuts the others there (keys past it are masked for every row of the
tile), and writes -inf above the diagonal of what remains with ``affine_select`` (GpSimd, so
those scores are first copied out of PSUM).

Engines run their instruction streams in order, so one tile's A -> B -> C chain would leave
every engine waiting on the others. The kernel therefore software-pipelines: two query tiles
walk the keys together, and stage A of key tile j+2 is issued before stage B of j+1 and stage
C of j (buffers are three deep to match). On 1x4x2048x128 bf16 (trn2) this takes the kernel
from 744 us (one query tile, stages in order) to 317 us of simulated time.

The pipeline runs within a head's query tiles and key tiles. With many short heads (sequences
of a few key tiles) there is little to pipeline within a head, and the in-order engines leave
each head's loads waiting for the previous head's stages: 8 x 12 heads of 128 x 64 (bf16, trn2)
took 215 us, 14x their HBM time, no engine above 20% busy. So sequences of at most 512 keys are
list-scheduled (:mod:`trnsim.schedule`, ``schedule="auto"``), as the Neuron compiler schedules an
NKI kernel: heads overlap, and the same shape takes 53 us, bound by its DMA (128-byte rows of
D = 64 bf16 are small descriptors) and VectorE. Longer sequences pipeline well on their own,
and scheduling their tens of thousands of instructions would cost seconds per kernel built.

Inputs arrive as [S, D] rows, so queries and keys are transposed on the PE array; keys once per
head while three heads' K and V (one per pipeline stage) fit in half of SBUF. Longer sequences
are cut into key blocks; the blocks then form the outer loop, each loaded once per head while
every query tile of the head walks it, their running state (qᵀ, o, max, sum) resident. (The
NKI sample reloads the blocks for every group of query tiles instead, as this kernel did: fp32
attention then took 2.04x longer at 5120 keys than at 4096, for 1.56x the work.) Only when the
state of a head's query tiles does not fit beside two key blocks are blocks reloaded per group.
"""

from __future__ import annotations

import math
from typing import Any, Iterator

import numpy as np

from ..config import ChipConfig
from ..isa import DmaCopy, HbmAP, HbmTensor, KernelError, TileAP
from ..builder.kernel import Kernel, Replay, TilePool, ViewCache
from ..native.dtypes import Dtype, get_dtype
from .reference import round_to
from .registry import register_kernel, split_dims

__all__ = ["build_attention"]

_Q_GROUP = 2  # query tiles that walk the keys together (measured best of 1-4 on trn2/trn3)
_DEPTH = 3    # pipeline stages in flight, hence buffers per query tile
_KV_SHARE = 2  # resident K/V blocks may use 1/2 of each SBUF partition; the rest is working tiles
_SCHEDULE_MAX_KEYS = 512  # sequences this short are list-scheduled by default (see the module docstring)
_WORKING_BYTES = 40 * 1024  # SBUF per partition the per-step tiles take (measured: ~38 KiB at fp32, D = 128)


def _inputs(shape, dtype, params, rng):
    b, h, s, d = shape
    out = {n: rng.standard_normal((b, h, s, d), dtype=np.float32) for n in ("q", "k", "v")}
    for i, (bshape, _) in enumerate(params.get("score_buffers") or ()):
        out[f"buf{i}"] = rng.standard_normal(bshape, dtype=np.float32)
    return out


# A score function's inputs after the score (``score_inputs``): the query and key index of each
# score ("q_idx", "kv_idx"), the batch and head index ("b", "h"), and captured tensors read at
# those indices, "buf<i>[<axes>]": buffer i (``score_buffers[i]``: shape, dtype) indexed along
# each of its dims by one of b, h, q, kv (q before kv), e.g. "buf0[h]" (a per-head bias) or
# "buf1[q,kv]" (a bias table). Each is a tile program input of the kind its axes make it.
_INDEX_ROLES = {"q_idx": "full", "kv_idx": "full", "b": "scalar", "h": "scalar"}
_AXES = ("b", "h", "q", "kv")


def parse_score_input(role: Any, buffers: Any) -> tuple[str, int | None, tuple[str, ...]]:
    """(kind, buffer index or None, axes) of one ``score_inputs`` entry, or a KernelError."""
    if role in _INDEX_ROLES:
        return _INDEX_ROLES[role], None, ()
    text = str(role)
    if not (text.startswith("buf") and text.endswith("]") and "[" in text):
        raise KernelError(f"attention: score input {role!r}: expected q_idx, kv_idx, b, h or buf<i>[<axes>]")
    head, _, rest = text[3:-1].partition("[")
    if not head.isdigit() or int(head) >= len(buffers or ()):
        raise KernelError(f"attention: score input {role!r} names no buffer (score_buffers has {len(buffers or ())})")
    axes = tuple(a.strip() for a in rest.split(",") if a.strip())
    shape = buffers[int(head)][0]
    if any(a not in _AXES for a in axes) or len(set(axes)) != len(axes) or len(axes) != len(shape):
        raise KernelError(f"attention: score input {role!r}: one axis (b, h, q or kv) per dim of its "
                          f"{len(shape)}-d buffer, each once")
    if "q" in axes and "kv" in axes and axes.index("q") > axes.index("kv"):
        raise KernelError(f"attention: score input {role!r}: the query axis must come before the key axis")
    kind = "full" if "q" in axes and "kv" in axes else "col" if "q" in axes else "row" if "kv" in axes else "scalar"
    return kind, int(head), axes


def _buffer_strides(shape: Any) -> list[int]:
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * int(shape[i + 1])
    return strides


def _score_arrays(params: Any, inputs: Any, bi: int, hi: int, s: int) -> list[np.ndarray]:
    """The score function's inputs after the score for head (bi, hi), in HBM shapes."""
    roles = params.get("score_inputs") or ("q_idx", "kv_idx")
    buffers = params.get("score_buffers") or ()
    out = []
    for role in roles:
        kind, buf, axes = parse_score_input(role, buffers)
        if role == "q_idx":
            out.append(np.broadcast_to(np.arange(s)[:, None], (s, s)).astype(np.float32))
        elif role == "kv_idx":
            out.append(np.broadcast_to(np.arange(s)[None, :], (s, s)).astype(np.float32))
        elif buf is None:
            out.append(np.array([bi if role == "b" else hi], dtype=np.float32))
        else:
            arr = round_to(inputs[f"buf{buf}"], buffers[buf][1])
            index = tuple({"b": bi, "h": hi}.get(a, slice(0, s)) for a in axes)
            out.append(np.asarray(arr[index], dtype=np.float32).reshape(-1) if kind != "full"
                       else np.asarray(arr[index], dtype=np.float32))
    return out


def _reference(inputs, shape, dtype, params):
    q, k, v = (round_to(inputs[n], dtype) for n in ("q", "k", "v"))
    b, h, s, d = shape
    scores = np.einsum("bhqd,bhkd->bhqk", q, k) * _scale(params.get("scale"), d)
    if params.get("score_mod") is not None:
        from .program import reference as program_reference

        scores = np.stack([np.stack([
            program_reference(params["score_mod"], [scores[bi, hi].astype(np.float32)]
                              + _score_arrays(params, inputs, bi, hi, s), s, s)[0]
            for hi in range(h)]) for bi in range(b)]).astype(np.float64)
    if params.get("causal"):
        scores = np.where(np.tril(np.ones((s, s), dtype=bool)), scores, -np.inf)
    if params.get("block_mask") is not None:
        qbs, kvbs, patterns = params["block_mask"]
        keep = np.zeros((b, h, s, s), dtype=bool)
        for bi in range(b):
            for hi in range(h):
                for qb, kbs in enumerate(patterns[0] if len(patterns) == 1 else patterns[bi * h + hi]):
                    for kb in kbs:
                        keep[bi, hi, qb * qbs:(qb + 1) * qbs, kb * kvbs:(kb + 1) * kvbs] = True
        scores = np.where(keep, scores, -np.inf)
    empty = np.isneginf(scores).all(axis=-1, keepdims=True)  # rows with no key: zeros, as FlexAttention's
    scores = np.where(empty, 0.0, scores)
    scores -= scores.max(axis=-1, keepdims=True)
    p = np.where(empty, 0.0, np.exp(scores))
    p /= np.where(empty, 1.0, p.sum(axis=-1, keepdims=True))
    drop = params.get("dropout_p") or 0.0
    if drop:
        from ..isa import dropout_keep

        counters = np.arange(b * h * s * s, dtype=np.int64).reshape(b, h, s, s)
        p = np.where(dropout_keep(params.get("dropout_seed") or 0, counters, drop), p, 0.0) / (1.0 - drop)
    return {"out": np.einsum("bhqk,bhkd->bhqd", p, v)}


def _scale(scale: Any, d: int) -> float:
    """``scale`` as given, or the usual 1/sqrt(D)."""
    if scale is None:
        return 1.0 / math.sqrt(d)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        # the running max is taken over raw scores, which order like the scaled ones only for scale > 0
        raise KernelError(f"attention: scale must be a positive number, got {scale!r}")
    return float(scale)


def _block_runs(block_mask: Any, b: int, h: int, s: int, tq: int, tc: int) -> Any:
    """``runs(bi, hi, q0)``: the [start, end) key runs the query tile at q0 of head (bi, hi)
    attends to under ``block_mask`` (see :func:`build_attention`), [] for none, or None for all
    keys (no block mask); a KernelError for a pattern of the wrong shape."""
    if block_mask is None:
        return lambda bi, hi, q0: None
    try:
        qbs, kvbs, patterns = block_mask
        qbs, kvbs, patterns = int(qbs), int(kvbs), tuple(tuple(tuple(int(k) for k in ks) for ks in p) for p in patterns)
    except (TypeError, ValueError):
        raise KernelError("attention: block_mask must be (q_block, kv_block, patterns)") from None
    if qbs < 1 or kvbs < 1 or qbs % tq or kvbs % tc:
        raise KernelError(f"attention: block_mask blocks {qbs}x{kvbs}: both must be multiples of {tq} queries and "
                          f"{tc} keys (a query tile, a key chunk)")
    nq, nk = -(-s // qbs), -(-s // kvbs)
    if len(patterns) not in (1, b * h) or any(len(p) != nq or any(not 0 <= k < nk for ks in p for k in ks)
                                              for p in patterns):
        raise KernelError(f"attention: block_mask patterns: one per head ({b * h}) or one for all, each {nq} query "
                          f"blocks of key blocks below {nk}")
    cache: dict[tuple[int, int], list[tuple[int, int]]] = {}

    def runs(bi: int, hi: int, q0: int) -> list[tuple[int, int]]:
        p = patterns[0] if len(patterns) == 1 else patterns[bi * h + hi]
        qb = q0 // qbs
        key = (id(p), qb)
        got = cache.get(key)
        if got is None:
            got = []
            for kb in sorted(set(p[qb])):
                lo, hi_ = kb * kvbs, min(s, (kb + 1) * kvbs)
                if got and got[-1][1] == lo:
                    got[-1] = (got[-1][0], hi_)
                else:
                    got.append((lo, hi_))
            cache[key] = got
        return got
    return runs


class _KeyBlock:
    """Keys [k0, k0 + n) of one head in SBUF: ``kT`` [D, n] and ``v`` [128, chunks, D] (key
    ``k0 + 128·c + p`` at partition p of chunk c)."""

    def __init__(self, k0: int, n: int, kT: TileAP, v: TileAP):
        self.k0, self.n, self.kT, self.v = k0, n, kT, v


class _QueryTile:
    """Queries [q0, q0 + qr) of head (bi, hi), with their running softmax state."""

    def __init__(self, bi: int, hi: int, q0: int, qr: int, qT: TileAP):
        self.bi, self.hi, self.q0, self.qr, self.qT = bi, hi, q0, qr, qT
        self.nm: TileAP | None = None  # -scale · running row max, fp32 [qr, 1]
        self.l: TileAP | None = None   # running sum of exp, fp32 [qr, 1]
        self.o: TileAP | None = None   # running unnormalised output, fp32 [qr, D]


class _Step:
    """One (query tile, key tile) step as it moves through stages A, B, C."""

    def __init__(self, qt: _QueryTile, kb: _KeyBlock, j0: int, kw: int, last: bool):
        self.qt, self.kb, self.j0, self.kw, self.last = qt, kb, j0, kw, last
        self.p: TileAP | None = None
        self.pT: TileAP | None = None
        self.alpha: TileAP | None = None  # None on a query tile's first step


@register_kernel("attention", dims="BxHxSxD", dtypes=("bf16", "fp16", "fp32"), default_shape=(1, 8, 2048, 128),
                 summary="flash attention softmax(q k^T * scale + mask) v, online softmax per 128-query tile",
                 params={"causal": False, "scale": None, "kv_block": 0, "schedule": "auto", "score_mod": None,
                         "score_inputs": None, "score_buffers": None, "block_mask": None, "dropout_p": 0.0,
                         "dropout_seed": 0},
                 inputs=_inputs, reference=_reference, split=split_dims(1, 0))
def build_attention(b: int, h: int, s: int, d: int, dtype: str = "bf16", config: ChipConfig | str = "trn2",
                    causal: bool = False, scale: float | None = None, kv_block: int = 0,
                    schedule: bool | str = "auto", score_mod: Any = None, score_inputs: Any = None,
                    score_buffers: Any = None, block_mask: Any = None, dropout_p: float = 0.0, dropout_seed: int = 0,
                    name: str = "attention") -> Kernel:
    """``kv_block`` is how many keys stay in SBUF at once (a multiple of the 512-key tile); the
    default 0 takes as many as fit, so K and V of a head are loaded once when they can be.
    ``schedule`` list-schedules the instruction stream (:mod:`trnsim.schedule`); ``"auto"`` does
    for sequences of at most 512 keys (see the module docstring).

    ``score_mod`` (a :class:`trnsim.kernels.fused.Program` whose input 0 is the scaled score
    tile, full [queries, keys] fp32) is FlexAttention's score function, applied to each score tile
    in SBUF before the softmax; ``score_inputs`` names its other inputs (default: q_idx, kv_idx;
    see ``parse_score_input``): index tiles come from GpSimd ``iota`` (the batch and head index
    of a head's tiles are constants), captured tensors (``score_buffers``: (shape, dtype) each,
    kernel inputs ``buf<i>``) are loaded per score tile at the indices named, and the steps run
    on the engines a fused region's would.

    ``block_mask`` (FlexAttention's BlockMask as its pattern: ``(q_block, kv_block, patterns)``,
    ``patterns`` one per head (b-major) or one for all, each a tuple per query block of the key
    blocks it attends to) makes the kernel visit only those key blocks: a query tile walks the
    runs of consecutive listed blocks, skipping every fully masked one; keys outside the listed
    blocks are masked; a query tile with none is stored as zeros. Both block sizes must be
    multiples of 128 (a query tile, a key chunk of the p·v contraction).

    ``dropout_p`` drops each attention probability with that probability, as training with
    attention dropout does (``F.scaled_dot_product_attention(dropout_p=...)``): each tile of
    ``exp`` values, once its row sum is taken (the softmax's denominator counts every key), goes
    through VectorE's ``dropout`` before its transpose, and the store scales by ``1 / (1 - p)``
    in the same instruction that divides by the sum. The drop pattern is the instruction's
    counter-based draw at each score's position ``((b·H + h)·S + q)·S + k`` with
    ``dropout_seed`` (:func:`trnsim.isa.dropout_keep`), so a backward regenerates it."""
    sched = {"auto": s <= _SCHEDULE_MAX_KEYS, "true": True, "false": False, True: True, False: False}.get(
        schedule.lower() if isinstance(schedule, str) else schedule)
    if sched is None:
        raise KernelError(f"attention: schedule must be auto, true or false, got {schedule!r}")
    kern = Kernel(name, config)
    cfg = kern.config
    t = cfg.core.tensor
    dt = get_dtype(dtype)
    if d > min(t.max_contraction, t.stationary_max_free):
        raise KernelError(f"attention: head dim D={d} exceeds {min(t.max_contraction, t.stationary_max_free)} "
                          f"(the PE array's contraction partitions on {cfg.name})")
    if not isinstance(causal, (bool, np.bool_)):
        raise KernelError(f"attention: causal must be true or false, got {causal!r}")
    w = _Work(kern, dt, d, _scale(scale, d), bool(causal))
    w.set_dropout(dropout_p, dropout_seed, h, s)
    q = kern.input("q", (b, h, s, d), dt)
    k = kern.input("k", (b, h, s, d), dt)
    v = kern.input("v", (b, h, s, d), dt)
    out = kern.output("out", (b, h, s, d), dt)
    if score_mod is not None:
        w.set_score_mod(score_mod, score_inputs, score_buffers, b, h, s)

    isz, tk, tc = dt.itemsize, w.tk, w.tc
    if isinstance(kv_block, bool) or not isinstance(kv_block, int) or kv_block < 0 or kv_block % tk:
        raise KernelError(f"attention: kv_block must be 0 (auto) or a positive multiple of {tk} keys, got {kv_block!r}")
    blk = kv_block or tk
    if not kv_block:
        # the largest key block (a multiple of the key tile) of which _DEPTH fit the K/V share of SBUF
        budget = cfg.core.sbuf.partition_bytes // _KV_SHARE // _DEPTH
        while blk < s and (blk + tk) * isz + -(-(blk + tk) // tc) * d * isz <= budget:
            blk += tk
    blocks = {k0: min(blk, s - k0) for k0 in range(0, s, blk)}  # first key -> keys

    n_q = -(-s // w.tq)
    # Keys in several blocks: walk the blocks in the outer loop and every query tile of the head
    # through each, keeping their running softmax state in SBUF, so each block of K and V is
    # loaded once per head; when the state of all a head's query tiles does not fit either, each
    # group of query tiles walks all the blocks (reloading them), as the NKI sample does.
    kv_outer = len(blocks) > 1 and w.query_state_fits(n_q, blk)
    if kv_outer:
        w.hold_query_state(n_q)

    runs_of = _block_runs(block_mask, b, h, s, w.tq, tc)

    def steps(bi: int, hi: int, qt: Any, q0: int, qr: int, k0: int, n: int) -> list[tuple[Any, int, int, int]]:
        """(query tile ``qt`` [q0, q0 + qr), block, key tile, width) for the key tiles of block k0
        this tile needs: causal attention cuts key tiles at the tile's last row and skips those
        after it; a block mask keeps the runs of listed key blocks in each tile."""
        out = []
        runs = runs_of(bi, hi, q0)
        for j0 in range(0, n, tk):
            if causal and k0 + j0 > q0 + qr - 1:
                break
            lo, hi_ = k0 + j0, k0 + j0 + (min(tk, n - j0, q0 + qr - k0 - j0) if causal else min(tk, n - j0))
            for a, z in ([(lo, hi_)] if runs is None else runs):
                if a < hi_ and z > lo:
                    out.append((qt, k0, max(a, lo) - k0, min(z, hi_) - max(a, lo)))
        return out

    def batches() -> Iterator[list[_Step]]:
        """Steps in issue order with the key blocks outer (``kv_outer``): per block, per group of
        query tiles, one batch per key tile."""
        for bi in range(b):
            for hi in range(h):
                tiles_all: list[_QueryTile] = []
                plan: list[tuple[int, list[list[tuple[_QueryTile, int, int, int]]]]] = []  # (block, batches)
                for g0 in range(0, s, w.tq * _Q_GROUP):
                    tiles = []
                    for q0 in range(g0, min(s, g0 + w.tq * _Q_GROUP), w.tq):
                        qr = min(w.tq, s - q0)
                        if runs_of(bi, hi, q0) == []:  # attends to nothing: zeros
                            w.store_zeros(out, bi, hi, q0, qr)
                            continue
                        tiles.append(_QueryTile(bi, hi, q0, qr, w.load_queries(q, bi, hi, q0, qr)))
                    tiles_all.append(tiles)  # type: ignore[arg-type]
                for k0, n in blocks.items():
                    for tiles in tiles_all:  # type: ignore[assignment]
                        per = [steps(bi, hi, qt, qt.q0, qt.qr, k0, n) for qt in tiles]  # type: ignore[attr-defined]
                        for j in range(max(map(len, per), default=0)):
                            plan.append((k0, [st[j] for st in per if j < len(st)]))
                yield from _emit_batches(w, k, v, bi, hi, blocks, plan, resident_ok=False)

    inflight: list[list[_Step]] = []  # newest first: waiting for stage B, then for stage C
    if kv_outer:
        for batch in batches():
            for st in batch:
                w.stage_a(st)
            inflight.insert(0, batch)
            _advance(w, inflight, out)
    else:
        groups = _Groups(w, q, k, v, out, blocks, inflight)
        for bi in range(b):
            for hi in range(h):
                for g0 in range(0, s, w.tq * _Q_GROUP):
                    specs = tuple((q0, min(w.tq, s - q0)) for q0 in range(g0, min(s, g0 + w.tq * _Q_GROUP), w.tq))
                    for q0, qr in specs:
                        if runs_of(bi, hi, q0) == []:  # attends to nothing: zeros
                            w.store_zeros(out, bi, hi, q0, qr)
                    specs = tuple(sp for sp in specs if runs_of(bi, hi, sp[0]) != [])
                    if not specs:
                        continue
                    plan = []
                    for k0, n in blocks.items():
                        per = [steps(bi, hi, ti, q0, qr, k0, n) for ti, (q0, qr) in enumerate(specs)]
                        for j in range(max(map(len, per))):
                            plan.append((k0, tuple(st[j] for st in per if j < len(st))))
                    groups.run(bi, hi, g0, specs, tuple(plan))
    for _ in range(_DEPTH - 1):  # drain the pipeline
        inflight.insert(0, [])
        _advance(w, inflight, out)
    if sched:
        from ..sim.list_schedule import schedule as schedule_pass

        return schedule_pass(kern)
    return kern


def _emit_batches(w: "_Work", k: HbmTensor, v: HbmTensor, bi: int, hi: int, blocks: dict[int, int],
                  plan: list[tuple[int, list[tuple[_QueryTile, int, int, int]]]], resident_ok: bool
                  ) -> Iterator[list[_Step]]:
    """The batches of ``plan`` as steps, loading each key block when the plan reaches it (once,
    and kept for the next groups, when the head has a single block: ``resident_ok``)."""
    last = {id(qt): (k0, j0) for _, batch in plan for qt, k0, j0, _ in batch}
    kb = None
    for k0, batch in plan:
        if not batch:
            continue
        if kb is None or kb.k0 != k0:
            if resident_ok:
                kb = w.resident if w.resident is not None and w.resident_of == (bi, hi) else None
                if kb is None:
                    kb = w.load_block(k, v, bi, hi, k0, blocks[k0])
                    w.resident, w.resident_of = kb, (bi, hi)
            else:
                kb = w.load_block(k, v, bi, hi, k0, blocks[k0])
        yield [_Step(qt, kb, j0, kw, last[id(qt)] == (k0, j0)) for qt, _, j0, kw in batch]


def _advance(w: "_Work", inflight: list[list[_Step]], out: HbmTensor) -> None:
    """Issue stage B of the batch after the newest and stage C (then the stores) of the one after."""
    if len(inflight) > 1:
        for st in inflight[1]:
            w.stage_b(st)
    if len(inflight) > 2:
        for st in inflight.pop():
            w.stage_c(st)
            if st.last:
                w.store(out, st.qt)


class _Groups:
    """The groups of query tiles of the plan with the key blocks inner, in issue order: each
    group loads its queries, walks its key tiles (loading key blocks as it reaches them) and
    advances the pipeline, whose stages carry over from the group before.

    Building: from a steady state on, groups emit the same instructions up to their HBM views
    (query loads, key/value loads, output stores), so a group that starts in a state an earlier
    group started in is emitted by replaying that group (:meth:`Kernel.replay`): the same
    instructions, several times faster (``kernel.replays`` counts them). The state is the
    group's plan (query tile sizes, key tiles; with causal masking their positions too),
    whether it finds its head's key block resident (and which), the evacuation parity, the
    steps in flight (the previous groups' last key tiles: their tiles and query tiles'
    running-state tiles, compared by identity), and for each tile() call the group makes the
    pool position and the buffer it finds there (a view that tile() hands back as it is, since
    asked for the same shape and dtype). A replayed group makes the same tile() calls and sets
    the Python state (query tiles, steps, key blocks, the pipeline, the resident block, the
    evacuation count) as building it would have. Not replayed: a score function (its emitter's
    own tiles are not noted), dropout (its draws are placed by each tile's position), the
    key-blocks-outer plan, a reference build."""

    _MAX_TEMPLATES = 32  # templates kept per kernel (the default shape makes 10)

    def __init__(self, w: "_Work", q: HbmTensor, k: HbmTensor, v: HbmTensor, out: HbmTensor, blocks: dict[int, int],
                 inflight: list[list[_Step]]):
        self.w, self.q, self.k, self.v, self.out, self.blocks, self.inflight = w, q, k, v, out, blocks, inflight
        self.resident_ok = len(blocks) == 1
        # key -> templates (a built group's arguments to template() until a later group wants it)
        self.templates: dict[tuple[Any, ...], list[Any]] | None = \
            None if w.kern.reference or w.mod is not None or w.dropout else {}
        self.kept = 0

    def run(self, bi: int, hi: int, g0: int, specs: tuple[tuple[int, int], ...],
            plan: tuple[tuple[int, tuple[tuple[int, int, int, int], ...]], ...]) -> None:
        """The group of query tiles ``specs`` ((q0, rows) each) of head (bi, hi), starting at
        query g0; ``plan``: (block, ((tile index, block, key tile, width), ...)) per batch."""
        templates = self.templates
        if templates is None:
            self.build(bi, hi, specs, plan)
            return
        key, table = self.state(bi, hi, specs, plan)
        got = templates.get(key)
        if got is not None:
            for n, tpl in enumerate(got):
                if type(tpl) is tuple:  # a group built with this key: its template, made when first wanted
                    if not self.pools_ready(tpl[-2], tpl[-1]):
                        continue
                    tpl = got[n] = self.template(*tpl)
                if tpl is not None and self.replay(tpl, table, bi, hi, g0):
                    return
        if self.kept >= self._MAX_TEMPLATES:
            self.build(bi, hi, specs, plan)
            return
        w = self.w
        kern = w.kern
        i0, ev, resident = len(kern.instructions), w.evac, w.resident
        w.calls, w.hbm, w.new_blocks = [], [], []
        try:
            tiles, made = self.build(bi, hi, specs, plan)
            calls, hbm, new_blocks = w.calls, w.hbm, w.new_blocks
        finally:
            w.calls = w.hbm = w.new_blocks = None
        # what a template needs of the group's end, noted now (later groups change these objects);
        # the rest is worked out if a later group starts in this state
        steps = [x for x in table if type(x) is _Step] + made
        qts = [x for x in table if type(x) is _QueryTile] + tiles
        end = (len(kern.instructions), kern._loaded_stationary, [list(b) for b in self.inflight], w.resident,
               w.resident_of, w.evac - ev, [(st, st.p, st.pT, st.alpha) for st in steps],
               [(qt, qt.nm, qt.l, qt.o) for qt in qts])
        pools = self.pool_state(calls)
        if pools is None:
            return
        templates.setdefault(key, []).append((i0, resident, table, calls, hbm, new_blocks, tiles, made, bi, hi, g0, end,
                                              *pools))
        self.kept += 1

    def build(self, bi: int, hi: int, specs: tuple[tuple[int, int], ...],
              plan: tuple[tuple[int, tuple[tuple[int, int, int, int], ...]], ...]
              ) -> tuple[list[_QueryTile], list[_Step]]:
        """The group, built: its query tiles and steps."""
        w, inflight = self.w, self.inflight
        tiles = [_QueryTile(bi, hi, q0, qr, w.load_queries(self.q, bi, hi, q0, qr)) for q0, qr in specs]
        qplan = [(k0, [(tiles[ti], kb0, j0, kw) for ti, kb0, j0, kw in batch]) for k0, batch in plan]
        made: list[_Step] = []
        for batch in _emit_batches(w, self.k, self.v, bi, hi, self.blocks, qplan, self.resident_ok):
            made.extend(batch)
            for st in batch:
                w.stage_a(st)
            inflight.insert(0, batch)
            _advance(w, inflight, self.out)
        return tiles, made

    def state(self, bi: int, hi: int, specs: tuple[tuple[int, int], ...], plan: tuple[Any, ...]
              ) -> tuple[tuple[Any, ...], list[Any]]:
        """The replay key of a group about to start, and the objects it carries over (steps in
        flight, their query tiles and key blocks, the resident block if it is the group's) in a
        fixed order: the key numbers them, so equal keys mean the same sharing."""
        w = self.w
        table: list[Any] = []
        index: dict[int, int] = {}
        sig: list[Any] = []

        def ref(x: Any, attrs: Any) -> None:
            i = index.get(id(x))
            if i is None:
                index[id(x)] = len(table)
                table.append(x)
                sig.append(attrs())
            else:
                sig.append(i)

        for batch in self.inflight:
            sig.append(len(batch))
            for st in batch:
                ref(st, lambda: (st.j0, st.kw, st.last, st.p, st.pT, st.alpha))
                qt, kb = st.qt, st.kb
                ref(qt, lambda: (qt.qr, qt.nm, qt.l, qt.o))
                ref(kb, lambda: (kb.k0, kb.n, _shape_of(kb.kT), _shape_of(kb.v)))
        r = w.resident
        hit = self.resident_ok and r is not None and w.resident_of == (bi, hi)
        sig.append(hit)
        if hit:
            ref(r, lambda: (r.k0, r.n, _shape_of(r.kT), _shape_of(r.v)))
        sizes = specs if w.causal else tuple(qr for _, qr in specs)  # only causal masking reads positions
        return (sizes, plan, w.evac & 1, tuple(sig)), table

    @staticmethod
    def pool_state(calls: list[tuple[Any, ...]]) -> tuple[list[tuple[TilePool, int]], list[tuple[Any, ...]]] | None:
        """Where a group's tile() calls start in each pool and the buffer each first finds, or
        None when a call would not reuse its buffer's allocation. Each call must (then it hands
        out a view equal to the template's, which _Work.tile makes the template's object): the
        first call at a position finds the buffer before the group (checked at each replay: the
        same allocation, the same partitions), a later call at the same position the one the
        earlier call left."""
        seen: dict[tuple[int, int], TileAP] = {}
        starts: dict[int, tuple[TilePool, int]] = {}
        finds = []
        for pool, i, shape, dtype, t in calls:
            starts.setdefault(id(pool), (pool, i))
            prev = seen.get((id(pool), i))
            if prev is None:
                finds.append((pool, i, t.alloc, t.p_count))
            elif prev.alloc is not t.alloc:
                return None
            seen[(id(pool), i)] = t
        return list(starts.values()), finds

    @staticmethod
    def pools_ready(starts: list[tuple[TilePool, int]], finds: list[tuple[Any, ...]]) -> bool:
        """Do the pools stand as a template's tile() calls found them?"""
        for pool, i in starts:
            if pool._next != i:
                return False
        for pool, i, alloc, parts in finds:
            old = pool._slots[i]
            if old is None or old.alloc is not alloc or old.p_count != parts:
                return False
        return True

    def template(self, i0: int, resident: _KeyBlock | None, carried: list[Any], calls: list[tuple[Any, ...]],
                 hbm: list[tuple[Any, ...]], new_blocks: list[_KeyBlock], tiles: list[_QueryTile], made: list[_Step],
                 bi: int, hi: int, g0: int, end_state: tuple[Any, ...], starts: list[tuple[TilePool, int]],
                 finds: list[tuple[Any, ...]]) -> "_GroupTemplate | None":
        """The group built from instruction ``i0`` (``end_state``: what it left, see run()) as a
        template, or None when it cannot be one (a tile() call that would not reuse its buffer's
        allocation, an HBM view not of this group, an instruction Kernel.replay_template does
        not take)."""
        kern = self.w.kern
        i1, loaded, inflight, res_now, res_of, evacs, step_attrs, tile_attrs = end_state
        ins = kern.instructions[i0:i1]
        pos = [j for j, x in enumerate(ins) if type(x) is DmaCopy and (type(x.src) is HbmAP or type(x.dst) is HbmAP)]
        if len(pos) != len(hbm) or any(e[0] is not (ins[j].src if type(ins[j].src) is HbmAP else ins[j].dst)
                                       for j, e in zip(pos, hbm)):
            return None
        table = carried + tiles + new_blocks + made
        index = {id(x): i for i, x in enumerate(table)}
        views: list[tuple[Any, ...]] = []
        for e in hbm:
            if e[1] == "q":
                if e[2:4] != (bi, hi):
                    return None
                views.append(("q", e[4] - g0, e[5]))
            elif e[1] == "rows":
                if e[3:5] != (bi, hi):
                    return None
                views.append(("rows", e[2], e[5], e[6], e[7]))
            else:
                i = index.get(id(e[2]))
                if i is None:
                    return None
                views.append(("out", i))
        try:
            end = [[index[id(st)] for st in batch] for batch in inflight]
            new_steps = [(index[id(st.qt)], index[id(st.kb)], st.j0, st.kw, st.last) for st in made]
        except KeyError:
            return None
        if res_now is resident:
            res_end = -1
        elif id(res_now) in index and res_of == (bi, hi):
            res_end = index[id(res_now)]
        else:
            return None
        # the carried key blocks are the template's parameters: their tiles' reads are replaced
        # by the same slices of the replayed group's blocks (K and V of another head)
        param: dict[Any, tuple[int, int]] = {}
        for i, x in enumerate(carried):
            if type(x) is _KeyBlock:
                for which, t in enumerate((x.kT, x.v)):
                    if t.alloc in param:
                        return None
                    param[t.alloc] = (i, which)
        tiles_at, subst = [], []
        if param:
            for j, x in enumerate(ins):
                for ap in x.reads:
                    if type(ap) is TileAP and ap.alloc in param:
                        kbi, which = param[ap.alloc]
                        base = carried[kbi].kT if which == 0 else carried[kbi].v
                        tiles_at.append((j, ap))
                        subst.append((kbi, which, ap, ap.p_start - base.p_start))
                for ap in x.writes:
                    if type(ap) is TileAP and ap.alloc in param:
                        return None
        rep = kern.replay_template(i0, pos, tiles_at, (i1, loaded))
        if rep is None:
            return None
        return _GroupTemplate(
            subst, rep, views, starts, finds,
            [(pool, shape, dtype, t) for pool, _, shape, dtype, t in calls], len(carried),
            [(qt.q0 - g0, qt.qr, qt.qT) for qt in tiles], [(kb.k0, kb.n, kb.kT, kb.v) for kb in new_blocks],
            new_steps, end, [(index[id(st)], p, pT, alpha) for st, p, pT, alpha in step_attrs],
            [(index[id(qt)], nm, l, o) for qt, nm, l, o in tile_attrs], res_end, evacs)

    def replay(self, tpl: "_GroupTemplate", carried: list[Any], bi: int, hi: int, g0: int) -> bool:
        """Emit ``tpl`` again as the group at (bi, hi, g0), whose carried objects are
        ``carried`` (False, having changed nothing, when a pool is not where the template's
        calls found it or Kernel.replay refuses)."""
        rep = tpl.rep
        if not self.pools_ready(tpl.starts, tpl.finds):
            return False
        table = list(carried)
        if len(table) != tpl.n_carried:
            return False
        table += [_QueryTile(bi, hi, g0 + dq, qr, qT) for dq, qr, qT in tpl.new_tiles]
        table += [_KeyBlock(k0, n, kT, v) for k0, n, kT, v in tpl.new_blocks]
        table += [_Step(table[qi], table[ki], j0, kw, last) for qi, ki, j0, kw, last in tpl.new_steps]
        views: list[Any] = []
        tc = self.w.tc
        for e in tpl.views:
            if e[0] == "q":
                views.append(self.q[bi, hi, g0 + e[1]:g0 + e[1] + e[2], :])
            elif e[0] == "rows":
                views.append(_row_views(e[1], bi, hi, e[2], e[3], tc)[e[4]])
            else:
                qt = table[e[1]]
                views.append(self.out[qt.bi, qt.hi, qt.q0:qt.q0 + qt.qr, :])
        w = self.w
        tiles: list[TileAP] = []
        if tpl.subst:
            # the same slices for every group of the blocks' head: made once per template and blocks
            bkey = tuple(a for i in tpl.subst_blocks for a in (table[i].kT.alloc, table[i].v.alloc))
            got_tiles = tpl.moved.get(bkey)
            if got_tiles is None:
                got_tiles = tpl.moved[bkey] = self.moved_tiles(tpl.subst, table)
            tiles = got_tiles
        if not w.kern.replay(rep, views, tiles):
            return False
        assert w.canon_of is not None and w.calls is None  # w.tile hands out the canonical views, noting nothing
        for pool, shape, dtype, t in tpl.calls:  # the group's own tile() calls: each reuses its buffer
            c = w.tile(pool, shape, dtype)
            assert c is t, "attention replay: a tile() call did not give the template's view"
        for i, p, pT, alpha in tpl.step_attrs:
            st = table[i]
            st.p, st.pT, st.alpha = p, pT, alpha
        for i, nm, l, o in tpl.tile_attrs:
            qt = table[i]
            qt.nm, qt.l, qt.o = nm, l, o
        self.inflight[:] = [[table[i] for i in batch] for batch in tpl.end]
        if tpl.resident >= 0:
            w.resident, w.resident_of = table[tpl.resident], (bi, hi)
        w.evac += tpl.evacs
        return True

    def moved_tiles(self, subst: list[tuple[int, int, TileAP, int]], table: list[Any]) -> list[TileAP]:
        """The template's slices of its carried key blocks (``subst``), as the same slices of the
        blocks ``table`` carries now (one object per slice and buffer, kept in ``_Work.moved``)."""
        moved, tiles = self.w.moved, []
        for kbi, which, ap, dp in subst:
            kb = table[kbi]
            base = kb.kT if which == 0 else kb.v
            a = base.alloc
            if a is ap.alloc:  # the template's own block
                tiles.append(ap)
                continue
            t = moved.get((ap, a))
            if t is None:  # the slice ``ap`` is of the template's block: the same slice of this one
                t = moved[(ap, a)] = TileAP(a, base.p_start + dp, ap.p_count, ap.offset, ap.dims, ap.dtype)
            tiles.append(t)
        return tiles


def _shape_of(t: TileAP) -> tuple[Any, ...]:
    """A tile view's geometry within its allocation (what a slice of it in another allocation keeps)."""
    return (t.alloc.space, t.alloc.nbytes, t.p_start - t.alloc.p_start, t.p_count, t.offset, t.dims, t.dtype.name)


class _GroupTemplate:
    """A group to replay (:class:`_Groups`): the instructions (:class:`Replay`), the K/V block
    slices to replace (``subst``), its HBM views as recipes
    (("q", query offset in the group, rows), ("rows", tensor, first row, rows, part), ("out",
    query tile)), the pool positions and buffers its tile() calls start from / find, the calls,
    and the Python state it leaves, over a table of objects: the carried ones, then the
    group's query tiles, key blocks and steps (recipes to make them), the pipeline's batches,
    each step's and query tile's tiles, the resident block (-1: unchanged), the evacuations."""

    __slots__ = ("subst", "subst_blocks", "moved", "rep", "views", "starts", "finds", "calls", "n_carried",
                 "new_tiles", "new_blocks", "new_steps", "end", "step_attrs", "tile_attrs", "resident", "evacs")

    def __init__(self, subst: list[tuple[int, int, TileAP, int]], rep: Replay,
                 views: list[tuple[Any, ...]], starts: list[tuple[TilePool, int]],
                 finds: list[tuple[Any, ...]], calls: list[tuple[Any, ...]], n_carried: int,
                 new_tiles: list[tuple[int, int, TileAP]], new_blocks: list[tuple[int, int, TileAP, TileAP]],
                 new_steps: list[tuple[int, int, int, int, bool]], end: list[list[int]],
                 step_attrs: list[tuple[Any, ...]], tile_attrs: list[tuple[Any, ...]], resident: int, evacs: int):
        self.subst = subst  # (carried key block, kT or v, the template's slice of it, its partition offset)
        self.subst_blocks = sorted({kbi for kbi, _, _, _ in subst})
        self.moved: dict[tuple[Any, ...], list[TileAP]] = {}  # those blocks' allocations -> the slices of them
        self.rep, self.views, self.starts, self.finds, self.calls = rep, views, starts, finds, calls
        self.n_carried, self.new_tiles, self.new_blocks, self.new_steps = n_carried, new_tiles, new_blocks, new_steps
        self.end, self.step_attrs, self.tile_attrs = end, step_attrs, tile_attrs
        self.resident, self.evacs = resident, evacs


class _Work:
    """The tile pools of one attention kernel and the stages that use them."""

    def __init__(self, kern: Kernel, dt: Dtype, d: int, scale: float, causal: bool):
        t = kern.config.core.tensor
        psum = kern.config.core.psum
        self.kern, self.dt, self.d, self.scale, self.causal = kern, dt, d, scale, causal
        self.tq = min(t.stationary_max_free, t.pe_cols)           # queries per tile: stationary free size
        self.tc = t.pe_rows                                      # keys per transpose and per p·v contraction
        self.tk = min(t.moving_max_free, psum.bank_bytes // 4)   # keys per score tile: one bank of fp32
        self.tk -= self.tk % self.tc
        self.group = psum.bank_bytes // (self.tc * dt.itemsize)  # PE transposes per PSUM bank
        sb = kern.tile_pool
        g, deep = _Q_GROUP, _Q_GROUP * _DEPTH
        self.kT_pool, self.v_pool, self.kstage = sb("kT", _DEPTH), sb("v", _DEPTH), sb("kstage", 2)
        self.q_pool, self.qT_pool = sb("q", 2 * g), sb("qT", 2 * g)
        self.s_pool, self.red_pool = sb("s", 2 * g), sb("rowmax", 2 * g)
        self.p_pool, self.pT_pool, self.alpha_pool = sb("p", deep), sb("pT", deep), sb("alpha", deep)
        self.nm_pool, self.l_pool, self.sum_pool = sb("nm", deep), sb("l", deep), sb("rowsum", deep)
        self.nm_tile: list[Any] = []  # per query tile instead, when a head's tiles all stay resident
        self.l_tile: list[Any] = []
        self.o_pool, self.res_pool = sb("o", 2 * g), sb("res", 2 * g)
        self.resident: _KeyBlock | None = None  # the single key block of a head, kept across groups
        self.resident_of: tuple[int, int] | None = None
        quarter = max(1, psum.banks // 4)  # one bank each: transposes in, scores, pᵀ, p·v
        self.tr_ps, self.s_ps = sb("tr_psum", quarter, space="psum"), sb("s_psum", quarter, space="psum")
        self.pT_ps, self.pv_ps = sb("pT_psum", quarter, space="psum"), sb("pv_psum", quarter, space="psum")
        self.evac = 0
        self.mod: Any = None
        self.dropout = 0.0  # attention dropout (set_dropout)
        # while a group is built to serve as a replay template (_Groups): every tile() call as
        # (pool, position, shape, dtype, view), every HBM view of a DMA as (view, what, ...), the
        # key blocks loaded; None otherwise
        self.calls: list[tuple[Any, ...]] | None = None
        # pool views -> the equal view handed out instead (None: the pool's own, in a reference
        # build and with a score function, which do not replay)
        self.canon_of: dict[TileAP, TileAP] | None = None if kern.reference else {}
        self.canon: dict[tuple[Any, ...], TileAP] = {}
        # (a template's slice of its key block, another block's allocation) -> the same slice of it
        self.moved: dict[tuple[TileAP, Any], TileAP] = {}
        self.hbm: list[tuple[Any, ...]] | None = None
        self.new_blocks: list[_KeyBlock] | None = None
        # operand slices by (base view, which slice, ints...), made once per kernel
        self.view = ViewCache(kern).get

    def set_dropout(self, p: Any, seed: Any, h: int, s: int) -> None:
        """Attention dropout with probability ``p`` (0: none), draws placed by ``seed`` and each
        score's position in the [B, H, S, S] scores."""
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p < 1.0:
            raise KernelError(f"attention: dropout_p must be a probability in [0, 1), got {p!r}")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise KernelError(f"attention: dropout_seed must be a whole number >= 0, got {seed!r}")
        self.dropout, self.seed, self.heads, self.seq = float(p), seed, h, s

    def set_score_mod(self, program: Any, roles: Any, buffers: Any, b: int, h: int, s: int) -> None:
        """FlexAttention's score function as a tile program: input 0 the score, then ``roles``
        (see ``parse_score_input``; default q_idx, kv_idx) over captured ``buffers``."""
        from .program import FULL, assign_engines, Emitter, step_class

        roles = tuple(roles) if roles is not None else ("q_idx", "kv_idx")
        buffers = tuple(buffers or ())
        kinds = program.kinds()
        parsed = [parse_score_input(r, buffers) for r in roles]
        want = [FULL] + [kd for kd, _, _ in parsed]
        if [k for k, _ in program.inputs] != want or len(program.outputs) != 1:
            raise KernelError(f"attention: score_mod must read the score and its score_inputs ({', '.join(want)}) and "
                              f"write one value")
        if not program.elementwise:
            raise KernelError("attention: score_mod must be elementwise")
        self.mod = program
        self.mod_roles, self.mod_inputs, self.mod_kinds = roles, parsed, kinds
        self.canon_of = None  # no replay (see _Groups): the pools' own views
        self.mod_em = Emitter(self.kern, program, kinds, assign_engines([step_class(st, kinds, True) for st in program.steps],
                                                                  [1.0] * len(program.steps), self.kern.config))
        self.mod_bufs = []
        for i, (bshape, bdt) in enumerate(buffers):
            shape = tuple(int(x) for x in bshape)
            self.mod_bufs.append((self.kern.input(f"buf{i}", shape, get_dtype(bdt)), _buffer_strides(shape)))
        for kind, buf, axes in parsed:
            if buf is None:
                continue
            shape = self.mod_bufs[buf][0].shape
            for a, n in zip(axes, shape):
                need = {"b": b, "h": h, "q": s, "kv": s}[a]
                if n < need:
                    raise KernelError(f"attention: score buffer buf{buf} {tuple(shape)}: its {a} dim has {n}, "
                                      f"the kernel indexes {need}")
        used = {a for st in program.steps for a in (st[2:4] if st[0] == "tt" else (st[2],) if st[0] in ("act", "red")
                                                     else (st[1],))}
        self.mod_used = [i for i in range(1, len(program.inputs)) if i in used]
        self.mod_pool = self.kern.tile_pool("score_mod", bufs=3 * max(1, len(program.steps)))
        self.idx_pool = self.kern.tile_pool("score_idx", bufs=4 * max(1, len(self.mod_used)))

    def modified(self, s_ps: TileAP, qt: _QueryTile, k0: int, qr: int, kw: int) -> TileAP:
        """``score_mod(scale * s, ...)`` for one [qr, kw] score tile of query tile ``qt``, in SBUF (fp32)."""
        kern, prog = self.kern, self.mod
        q0 = qt.q0
        tiles = {0: self.tile(self.mod_pool, (qr, kw), "fp32")}
        kern.tensor_scalar(tiles[0], s_ps, "multiply", self.scale)
        for i in self.mod_used:
            role, (kind, buf, axes) = self.mod_roles[i - 1], self.mod_inputs[i - 1]
            if role in ("q_idx", "kv_idx"):  # query index: q0 + partition; key index: k0 + column
                is_q = role == "q_idx"
                t = self.tile(self.idx_pool, (qr, kw), "fp32")
                kern.iota(t, base=q0 if is_q else k0, channel_multiplier=1 if is_q else 0, pattern=[0 if is_q else 1])
            elif buf is None:  # the head's batch or head index: the same for every score of the tile
                t = self.tile(self.idx_pool, (qr, 1), "fp32")
                kern.iota(t, base=qt.bi if role == "b" else qt.hi, channel_multiplier=0, pattern=[0])
            else:  # a captured tensor at this tile's indices (per-partition rows, key columns)
                src, strides = self.mod_bufs[buf]
                at = {"b": qt.bi, "h": qt.hi, "q": q0, "kv": k0}
                offset = sum(at[a] * st for a, st in zip(axes, strides))
                sq = strides[axes.index("q")] if "q" in axes else 0
                skv = strides[axes.index("kv")] if "kv" in axes else 1
                cols = kw if kind in ("full", "row") else 1
                t = self.tile(self.idx_pool, (qr, cols), src.dtype)
                kern.dma_copy(t, src.ap(offset, [[sq, qr], [skv, cols]]), queue=3)
            tiles[i] = t
        kinds = self.mod_kinds
        for j in range(len(prog.steps)):
            narrow = kinds[len(prog.inputs) + j] in ("col", "scalar")  # a per-row value: one column
            dst = self.tile(self.mod_pool, (qr, 1 if narrow else kw), "fp32")
            self.mod_em.step(j, dst, tiles, qr, 1, kw, 0)
            tiles[len(prog.inputs) + j] = dst
        return tiles[prog.outputs[0][0]]

    def query_state_fits(self, n_q: int, blk: int) -> bool:
        """Can the running state of ``n_q`` query tiles (qᵀ, o, the max and sum chains) stay in
        SBUF beside two key blocks (one computed on, the next loading) and the working tiles?"""
        per_tile = (self.tq * self.dt.itemsize + self.d * 4 + 3 * 2 * self.kern.config.core.sbuf.allocation_granule)
        block = blk * self.dt.itemsize + -(-blk // self.tc) * self.d * self.dt.itemsize
        working = _WORKING_BYTES
        if self.mod is not None:  # the score function's fp32 [q, key tile] tiles
            working += (3 * max(1, len(self.mod.steps)) + 4) * self.tk * 4
        return n_q * per_tile + 2 * block + working <= self.kern.config.core.sbuf.partition_bytes

    def hold_query_state(self, n_q: int) -> None:
        """Pools deep enough that every query tile of a head keeps its state while the key
        blocks go by (each walks every block before its state is stored); two key blocks."""
        g, deep = _Q_GROUP, _Q_GROUP * _DEPTH
        sb = self.kern.tile_pool
        self.kT_pool, self.v_pool = sb("kT", 2), sb("v", 2)
        self.qT_pool, self.o_pool = sb("qT", n_q + 2 * g), sb("o", n_q + 2 * g)
        # the running max and sum: a pool per query tile. One shared rotating pool would have to
        # outlast every other tile's allocations between two visits of a tile, which is n_q x the
        # key tiles of a block, not n_q (10,048 causal keys reused a live max). nm is read by the
        # tile's next step only; l also by the store, at most _DEPTH batches after its last step.
        self.nm_tile = [sb(f"nm{i}", 2) for i in range(n_q)]
        self.l_tile = [sb(f"l{i}", _DEPTH + 1) for i in range(n_q)]
        self.sum_pool = sb("rowsum", deep)

    def tile(self, pool: TilePool, shape: tuple[int, ...], dtype: Any) -> TileAP:
        """``pool.tile(shape, dtype)``, as one view object per value (see ``canon``), noted in
        ``calls`` while a group is recorded."""
        canon_of = self.canon_of
        if canon_of is None:
            return pool.tile(shape, dtype)
        i = pool._next
        t = pool.tile(shape, dtype)
        c = canon_of.get(t)
        if c is None:
            c = self.canonical(t)
        if self.calls is not None:
            self.calls.append((pool, i, shape, dtype, c))
        return c

    def canonical(self, t: TileAP) -> TileAP:
        """The view object that stands for every view equal to ``t`` (same allocation, partitions,
        offset, dims, dtype): a pool whose buffer is asked for shapes in turn (PE transposes of
        queries, then of keys) makes a new, equal view at each change, and replaying a group
        needs the views it finds to be the template's objects."""
        key = (t.alloc, t.p_start, t.p_count, t.offset, t.dims, t.dtype.name)
        c = self.canon.get(key)
        if c is None:
            c = self.canon[key] = t
        self.canon_of[t] = c  # type: ignore[index]
        return c

    def _copy(self, dst: TileAP, src: TileAP) -> None:
        """PSUM evacuation, alternating VectorE and ScalarE."""
        self.kern.tensor_copy(dst, src, engine="vector" if self.evac % 2 == 0 else "scalar")
        self.evac += 1

    def load_block(self, k: HbmTensor, v: HbmTensor, bi: int, hi: int, k0: int, n: int) -> _KeyBlock:
        """Keys [k0, k0+n) of head (bi, hi): kᵀ through PE transposes, v as 128-key chunks."""
        kern, tc, d, dt = self.kern, self.tc, self.d, self.dt
        chunks = -(-n // tc)
        kT = self.tile(self.kT_pool, (d, n), dt)
        vt = self.tile(self.v_pool, (tc, chunks, d), dt)
        _load_rows(kern, vt, v, bi, hi, k0, n, tc, queue=2, log=self.hbm)
        for c0 in range(0, chunks, self.group):
            g = min(self.group, chunks - c0)
            rows = min(g * tc, n - c0 * tc)
            stage = self.tile(self.kstage, (tc, g, d), dt)
            _load_rows(kern, stage, k, bi, hi, k0 + c0 * tc, rows, tc, queue=1, log=self.hbm)
            ps = self.tile(self.tr_ps, (d, g * tc), dt)
            # nc_transpose(dst, data) for each 128-key chunk, in order
            kern.nc_transpose_many(self.view((ps, stage, rows), lambda: [
                (ps[:, j * tc:j * tc + min(tc, rows - j * tc)], stage[:min(tc, rows - j * tc), j, :]) for j in range(g)]))
            view = self.view
            self._copy(view((kT, 0, c0, rows), lambda: kT[:, c0 * tc:c0 * tc + rows]),
                       view((ps, 2, rows), lambda: ps[:, :rows]))
        kb = _KeyBlock(k0, n, kT, vt)
        if self.new_blocks is not None:
            self.new_blocks.append(kb)
        return kb

    def load_queries(self, q: HbmTensor, bi: int, hi: int, q0: int, qr: int) -> TileAP:
        """qᵀ [D, qr] of queries [q0, q0+qr): loaded as rows, transposed on the PE array."""
        rows = self.tile(self.q_pool, (qr, self.d), self.dt)
        src = q[bi, hi, q0:q0 + qr, :]
        if self.hbm is not None:
            self.hbm.append((src, "q", bi, hi, q0, qr))
        self.kern.dma_copy(rows, src, queue=0)
        ps = self.tile(self.tr_ps, (self.d, qr), self.dt)
        self.kern.nc_transpose(ps, rows)
        qT = self.tile(self.qT_pool, (self.d, qr), self.dt)
        self._copy(qT, ps)
        return qT

    def stage_a(self, st: _Step) -> None:
        """Scores, running max, p = exp(scale·s + nm) with its row sum, alpha and l."""
        kern, qt, kw = self.kern, st.qt, st.kw
        qr = qt.qr
        kt0 = st.kb.k0 + st.j0
        s_ps = self.tile(self.s_ps, (qr, kw), "fp32")
        kT = st.kb.kT
        kern.nc_matmul(s_ps, qt.qT, self.view((kT, 4, st.j0, kw), lambda: kT[:, st.j0:st.j0 + kw]))
        scores = s_ps
        if self.mod is not None:
            scores = self.modified(s_ps, qt, kt0, qr, kw)
        if self.causal and kt0 + kw - 1 > qt.q0:
            # keep key kt0+i for query q0+p when q0 + p - kt0 - i >= 0; GpSimd reads SBUF only,
            # and only keys from q0 on can be masked
            if scores is s_ps:
                scores = self.tile(self.s_pool, (qr, kw), "fp32")
                kern.tensor_copy(scores, s_ps, engine="vector")
            c0 = max(0, qt.q0 - kt0)
            kern.affine_select(scores[:, c0:], scores[:, c0:], cmp="greater_equal", offset=qt.q0 - kt0 - c0,
                               channel_multiplier=1, pattern=[-1], on_false=-math.inf)
        sc = 1.0 if self.mod is not None else self.scale  # a score function's scores are scaled already
        slot = qt.q0 // self.tq
        nm_pool = self.nm_tile[slot] if self.nm_tile else self.nm_pool
        l_pool = self.l_tile[slot] if self.l_tile else self.l_pool
        nm = self.tile(nm_pool, (qr, 1), "fp32")
        if qt.nm is None:
            kern.tensor_reduce(nm, "max", scores, axis=1, negate=True)
            kern.tensor_scalar(nm, nm, "multiply", sc)
        else:
            neg_max = self.tile(self.red_pool, (qr, 1), "fp32")
            kern.tensor_reduce(neg_max, "max", scores, axis=1, negate=True)
            kern.tensor_scalar(nm, neg_max, "multiply", sc, op1="minimum", operand1=qt.nm)
        st.p = self.tile(self.p_pool, (qr, kw), self.dt)
        rowsum = self.tile(l_pool if qt.l is None else self.sum_pool, (qr, 1), "fp32")
        kern.activation(st.p, "exp", scores, scale=sc, bias=nm, reduce_op="add", reduce_res=rowsum)
        if self.dropout:  # after the row sum: the softmax's denominator counts every key
            s = self.seq
            kern.dropout(st.p, st.p, self.dropout, seed=self.seed,
                         offset=((qt.bi * self.heads + qt.hi) * s + qt.q0) * s + kt0, row_stride=s)
        if qt.nm is not None and qt.l is not None:
            st.alpha = self.tile(self.alpha_pool, (qr, 1), "fp32")
            kern.activation(st.alpha, "exp", qt.nm, scale=-1.0, bias=nm)
            l_new = self.tile(l_pool, (qr, 1), "fp32")
            kern.tensor_scalar(l_new, qt.l, "multiply", st.alpha, op1="add", operand1=rowsum, engine="gpsimd")
            rowsum = l_new
        qt.nm, qt.l = nm, rowsum

    def stage_b(self, st: _Step) -> None:
        """pᵀ, 128 keys per PE transpose, copied to SBUF as [128 keys, chunks, qr]."""
        kern, tc, qr, kw = self.kern, self.tc, st.qt.qr, st.kw
        assert st.p is not None
        chunks, full = -(-kw // tc), kw // tc
        ps = self.tile(self.pT_ps, (tc, chunks, qr), self.dt)
        st.pT = pT = self.tile(self.pT_pool, (tc, chunks, qr), self.dt)
        p = st.p

        def operands() -> tuple[list[tuple[TileAP, TileAP]], list[tuple[TileAP, TileAP]]]:
            tr = [(ps[:min(tc, kw - j * tc), j, :], p[:, j * tc:j * tc + min(tc, kw - j * tc)]) for j in range(chunks)]
            copies = [(pT[:, :full, :], ps[:, :full, :])] if full else []
            if full < chunks:
                kc = kw - full * tc
                copies.append((pT[:kc, full, :], ps[:kc, full, :]))
            return tr, copies

        tr, copies = self.view((ps, p, pT, kw), operands)
        kern.nc_transpose_many(tr)  # nc_transpose(dst, data) for each, in order
        for dst, src in copies:
            self._copy(dst, src)

    def stage_c(self, st: _Step) -> None:
        """p·v over the key chunks into one PSUM group, then o = o·alpha + p·v."""
        kern, tc, qt, kw = self.kern, self.tc, st.qt, st.kw
        assert st.pT is not None
        pv = self.tile(self.pv_ps, (qt.qr, self.d), "fp32")
        chunks, c0 = -(-kw // tc), st.j0 // tc
        pT, v = st.pT, st.kb.v
        # nc_matmul(pv, pT chunk j, v chunk c0 + j, accumulate=j > 0) for each chunk, in order
        kern.nc_matmul_many(self.view((pv, pT, v, c0, kw), lambda: [
            (pv, pT[:min(tc, kw - j * tc), j, :], v[:min(tc, kw - j * tc), c0 + j, :], j > 0) for j in range(chunks)]))
        if qt.o is None:
            qt.o = self.tile(self.o_pool, (qt.qr, self.d), "fp32")
            kern.tensor_copy(qt.o, pv, engine="vector")
            return
        assert st.alpha is not None
        kern.tensor_scalar(qt.o, qt.o, "multiply", st.alpha, engine="gpsimd")
        kern.tensor_tensor(qt.o, qt.o, pv, "add")

    def store_zeros(self, out: HbmTensor, bi: int, hi: int, q0: int, qr: int) -> None:
        """Zeros for query rows a block mask leaves no key (FlexAttention's output for them)."""
        res = self.tile(self.res_pool, (qr, self.d), self.dt)
        self.kern.memset(res, 0.0, engine="gpsimd")
        self.kern.dma_copy(out[bi, hi, q0:q0 + qr, :], res, engine="gpsimd")

    def store(self, out: HbmTensor, qt: _QueryTile) -> None:
        """``out = o / l`` for one query tile, stored on GpSimd's DMA queue."""
        assert qt.o is not None and qt.l is not None
        res = self.tile(self.res_pool, (qt.qr, self.d), self.dt)
        if self.dropout:  # the kept probabilities scaled by 1 / (1 - p) in the same instruction
            self.kern.tensor_scalar(res, qt.o, "divide", qt.l, op1="multiply", operand1=1.0 / (1.0 - self.dropout))
        else:
            self.kern.tensor_scalar(res, qt.o, "divide", qt.l)
        dst = out[qt.bi, qt.hi, qt.q0:qt.q0 + qt.qr, :]
        if self.hbm is not None:
            self.hbm.append((dst, "out", qt))
        self.kern.dma_copy(dst, res, engine="gpsimd")


def _row_views(src: HbmTensor, bi: int, hi: int, r0: int, n: int, tc: int) -> list[HbmAP | None]:
    """The HBM sides of :func:`_load_rows`: the whole chunks (or None), the ragged tail (or None)."""
    _, heads, s, d = src.shape
    full, tail = divmod(n, tc)
    base = ((bi * heads + hi) * s + r0) * d
    return [src.ap(base, [[d, tc], [tc * d, full], [1, d]]) if full else None,
            src[bi, hi, r0 + full * tc:r0 + n, :] if tail else None]


def _load_rows(kern: Kernel, dst: TileAP, src: HbmTensor, bi: int, hi: int, r0: int, n: int, tc: int,
               queue: int, log: list[tuple[Any, ...]] | None = None) -> None:
    """Rows [r0, r0+n) of ``src[bi, hi]`` into ``dst`` [tc, chunks, D], row r0 + tc·c + p at
    partition p of chunk c: one DMA for the whole chunks, one for a ragged tail (each HBM view
    noted in ``log`` as (view, "rows", tensor, bi, hi, r0, n, which))."""
    full, tail = divmod(n, tc)
    views = _row_views(src, bi, hi, r0, n, tc)
    if views[0] is not None:
        if log is not None:
            log.append((views[0], "rows", src, bi, hi, r0, n, 0))
        kern.dma_copy(dst[:, :full, :], views[0], queue=queue)
    if views[1] is not None:
        if log is not None:
            log.append((views[1], "rows", src, bi, hi, r0, n, 1))
        kern.dma_copy(dst[:tail, full, :], views[1], queue=queue)
