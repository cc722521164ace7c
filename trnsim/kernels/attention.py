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
from ..isa import KernelError
from ..builder.kernel import Kernel
from ..native.dtypes import get_dtype
from .attention_groups import Groups
from .attention_stages import (DEPTH, KV_SHARE, Q_GROUP, SCHEDULE_MAX_KEYS, QueryTile, Step, Work, advance,  # noqa: F401
                               emit_batches, parse_score_input)
from .reference import round_to
from .registry import register_kernel, split_dims

__all__ = ["build_attention"]


def _inputs(shape, dtype, params, rng):
    b, h, s, d = shape
    out = {n: rng.standard_normal((b, h, s, d), dtype=np.float32) for n in ("q", "k", "v")}
    for i, (bshape, _) in enumerate(params.get("score_buffers") or ()):
        out[f"buf{i}"] = rng.standard_normal(bshape, dtype=np.float32)
    return out


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
    sched = {"auto": s <= SCHEDULE_MAX_KEYS, "true": True, "false": False, True: True, False: False}.get(
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
    w = Work(kern, dt, d, _scale(scale, d), bool(causal))
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
        # the largest key block (a multiple of the key tile) of which DEPTH fit the K/V share of SBUF
        budget = cfg.core.sbuf.partition_bytes // KV_SHARE // DEPTH
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

    def batches() -> Iterator[list[Step]]:
        """Steps in issue order with the key blocks outer (``kv_outer``): per block, per group of
        query tiles, one batch per key tile."""
        for bi in range(b):
            for hi in range(h):
                tiles_all: list[QueryTile] = []
                plan: list[tuple[int, list[list[tuple[QueryTile, int, int, int]]]]] = []  # (block, batches)
                for g0 in range(0, s, w.tq * Q_GROUP):
                    tiles = []
                    for q0 in range(g0, min(s, g0 + w.tq * Q_GROUP), w.tq):
                        qr = min(w.tq, s - q0)
                        if runs_of(bi, hi, q0) == []:  # attends to nothing: zeros
                            w.store_zeros(out, bi, hi, q0, qr)
                            continue
                        tiles.append(QueryTile(bi, hi, q0, qr, w.load_queries(q, bi, hi, q0, qr)))
                    tiles_all.append(tiles)  # type: ignore[arg-type]
                for k0, n in blocks.items():
                    for tiles in tiles_all:  # type: ignore[assignment]
                        per = [steps(bi, hi, qt, qt.q0, qt.qr, k0, n) for qt in tiles]  # type: ignore[attr-defined]
                        for j in range(max(map(len, per), default=0)):
                            plan.append((k0, [st[j] for st in per if j < len(st)]))
                yield from emit_batches(w, k, v, bi, hi, blocks, plan, resident_ok=False)

    inflight: list[list[Step]] = []  # newest first: waiting for stage B, then for stage C
    if kv_outer:
        for batch in batches():
            for st in batch:
                w.stage_a(st)
            inflight.insert(0, batch)
            advance(w, inflight, out)
    else:
        groups = Groups(w, q, k, v, out, blocks, inflight)
        for bi in range(b):
            for hi in range(h):
                for g0 in range(0, s, w.tq * Q_GROUP):
                    specs = tuple((q0, min(w.tq, s - q0)) for q0 in range(g0, min(s, g0 + w.tq * Q_GROUP), w.tq))
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
    for _ in range(DEPTH - 1):  # drain the pipeline
        inflight.insert(0, [])
        advance(w, inflight, out)
    if sched:
        from ..sim.list_schedule import schedule as schedule_pass

        return schedule_pass(kern)
    return kern
