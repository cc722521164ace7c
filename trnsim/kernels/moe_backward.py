"""The backward of the MoE block (:mod:`trnsim.kernels.moe`): expert gradients by blocks.

Given the block's inputs and the gradient of its output ``grad_out [T, H]``, computes

* ``grad_w_gate``, ``grad_w_up [E, H, F]`` and ``grad_w_down [E, F, H]`` (the experts' weights,
  in the forward's layout),
* ``grad_x [T, H]``, the experts' part of the input's gradient (the router's part is the
  router's backward: ``grad_logits @ w_router^T``),
* ``grad_weights [T, k]`` (fp32), the gradient of each token's k routing weights after
  normalisation, from which the router's backward (softmax, top-k, normalise, the router
  linear) follows on ``[T, E]`` tensors,

the way NxD Training's dropless blockwise-matmul backward does it (NKI's ``blockwise_mm_bwd``):

1. **Routing and grouping** are those of the forward (:func:`trnsim.kernels.moe.route`,
   recomputed from ``x`` and ``w_router`` rather than saved), plus each place's routing weight
   scattered to an expert-sorted table (0.0 at padded places, so padding contributes nothing).
2. **Per block** (``B <= 128`` tokens of one expert): GpSimd gathers the block's rows of ``x``
   and ``grad_out`` (indirect DMA); PE transposes put hidden on partitions. Per 256-column chunk
   of the ffn dim the gate and up projections are recomputed in PSUM (activation recompute:
   the forward keeps no checkpoint), ``grad_out @ w_down^T`` accumulates over hidden (w_down's
   rows gathered and PE-transposed), ScalarE's sigmoid and VectorE give ``h = silu(g) * u``,
   the routing weight's gradient ``sum(h * (grad_out @ w_down^T))`` and ``dh = a * (...)``,
   ``du = dh * silu(g)``, ``dg = dh * u * s * (1 + g (1 - s))``. The weight gradients of the
   block's expert, ``x^T dg``, ``x^T du`` and ``(a h)^T grad_out``, are added to the gradient
   tensors in HBM by a read-modify-write (indirect gather, VectorE add, indirect scatter of the
   expert's rows: which expert a block has is known only when it runs); ``dg @ w_gate^T + du @
   w_up^T`` (the gathered gate/up weight tiles PE-transposed) accumulates each row's input
   gradient in fp32 over the chunks.
3. **Combine**: each token's k rows of the input gradient (expert-sorted) are gathered back and
   summed in fp32, rounding once; its k routing-weight gradients are gathered likewise.

The weight gradients are zeroed in HBM first and accumulated in the model dtype, one rounding
per block. As in the forward every block of the worst case over routings runs, so the time does
not depend on the routing. The kernel runs on one physical core (no LNC split: split by tokens,
each core would hold a partial gradient of every expert to reduce).

How fast: at Mixtral's per-rank training shape under TP=8 with 256 tokens (``256x4096x1792x8``,
bf16, trn2) it takes 17.0 ms, HBM 29.6% busy (MBU) and TensorE 18.9% active: not at its bound. The
weight gradients' read-modify-write is the slow part: a chunk's reads of a gradient tensor wait
for the previous block's indirect writes to it (their rows are known only at run time), so the
blocks' updates serialise on DMA latency. NKI's kernel writes with the DMA engines' accumulate,
which trnsim's DMA model does not have.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from ..config import ChipConfig
from ..isa import KernelError
from ..builder.kernel import Kernel
from ..native.dtypes import get_dtype
from .moe import DTYPES, block_inputs, transpose_cols, transpose_rows, checked_args, combine, \
    moe_block_size, moe_blocks, route
from .reference import round_to
from .registry import register_kernel

__all__ = ["build_moe_backward", "moe_backward_reference"]

_PARAMS = {"top_k": 2, "normalize": True, "block": 128}
_ZERO_COLS = 2048  # columns of the zero tile the weight gradients are cleared from


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def moe_backward_reference(x: np.ndarray, w_router: np.ndarray, w_gate: np.ndarray, w_up: np.ndarray,
                           w_down: np.ndarray, grad_out: np.ndarray, top_k: int, normalize: bool, dtype: str,
                           block: int) -> dict[str, np.ndarray]:
    """The kernel's outputs in float64 from rounded inputs, rounding where the kernel rounds:
    the logits, the matmul operands (``dg``, ``du``, ``a * h``), each block's row gradients and
    the weight gradients after each block's update; blocks as the kernel forms them (each
    expert's slots in token order, ``B`` at a time)."""
    T, H = x.shape
    E, _, F = w_gate.shape
    logits = round_to(x @ w_router, dtype)
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    chosen = np.argsort(-p, axis=1, kind="stable")[:, :top_k]
    w = np.take_along_axis(p, chosen, axis=1)
    if normalize:
        w = w / w.sum(axis=1, keepdims=True)
    B = moe_block_size(T, block)
    dwg, dwu, dwd = np.zeros_like(w_gate), np.zeros_like(w_up), np.zeros_like(w_down)
    dx = np.zeros_like(x)
    dweights = np.zeros((T, top_k))
    for e in range(E):
        rows_all, slot_all = np.nonzero(chosen == e)
        for b0 in range(0, rows_all.size, B):
            rows, slot = rows_all[b0:b0 + B], slot_all[b0:b0 + B]
            xb, gb, a = x[rows], grad_out[rows], w[rows, slot][:, None]
            g, u = xb @ w_gate[e], xb @ w_up[e]
            s = _sigmoid(g)
            sl = g * s
            h = sl * u
            pd = gb @ w_down[e].T
            dweights[rows, slot] = (pd * h).sum(axis=1)
            dh = a * pd
            du = round_to(dh * sl, dtype)
            dg = round_to(dh * u * s * (g - sl + 1.0), dtype)
            ah = round_to(a * h, dtype)
            dwg[e] = round_to(dwg[e] + xb.T @ dg, dtype)
            dwu[e] = round_to(dwu[e] + xb.T @ du, dtype)
            dwd[e] = round_to(dwd[e] + ah.T @ gb, dtype)
            dx[rows] += round_to(dg @ w_gate[e].T + du @ w_up[e].T, dtype)
    return {"grad_x": round_to(dx, dtype), "grad_weights": dweights, "grad_w_gate": dwg, "grad_w_up": dwu,
            "grad_w_down": dwd}


def _inputs(shape: tuple[int, ...], dtype: str, params: Mapping[str, Any], rng: np.random.Generator
            ) -> dict[str, np.ndarray]:
    t, h, _, _ = shape
    out = block_inputs(shape, dtype, params, rng)
    out["grad_out"] = rng.standard_normal((t, h), dtype=np.float32)
    return out


def _reference(inputs: Mapping[str, np.ndarray], shape: tuple[int, ...], dtype: str, params: Mapping[str, Any]
               ) -> dict[str, np.ndarray]:
    r = {n: round_to(v, dtype) for n, v in inputs.items()}
    p = {**_PARAMS, **params}
    return moe_backward_reference(r["x"], r["w_router"], r["w_gate"], r["w_up"], r["w_down"], r["grad_out"],
                                  int(p["top_k"]), bool(p["normalize"]), dtype, int(p["block"]))


@register_kernel("moe_backward", dims="TOKENSxHIDDENxFFNxEXPERTS", dtypes=DTYPES, default_shape=(256, 4096, 1792, 8),
                 summary="MoE block backward (NxD's blockwise backward): routing recomputed, per block the "
                         "gate/up recompute and the expert weight and input gradients, read-modify-write of "
                         "the expert's weight gradients by indirect DMA", params=dict(_PARAMS),
                 inputs=_inputs, reference=_reference)
def build_moe_backward(tokens: int, hidden: int, ffn: int, experts: int, dtype: str = "bf16",
                       config: ChipConfig | str = "trn2", top_k: int = 2, normalize: bool = True, block: int = 128,
                       name: str = "moe_backward") -> Kernel:
    kern = Kernel(name, config)
    cfg = kern.config
    dt, T, H, F, E, k, block = checked_args("moe_backward", cfg, dtype, tokens, hidden, ffn, experts, top_k, block)
    P = cfg.core.sbuf.partitions
    TN = min(cfg.core.tensor.moving_max_free, cfg.core.psum.bank_bytes // 4)  # one fp32 PSUM bank of columns
    FC = max(P, TN // 2)  # ffn columns per chunk: half a bank keeps the chunk's transposed weights in SBUF
    B = moe_block_size(T, block)
    if B > P:
        raise KernelError(f"moe_backward: block {block} gives {B}-token blocks; the backward takes at most {P} "
                          f"(one token per partition): use block <= {P}")
    if cfg.core.psum.banks < 8:
        raise KernelError(f"moe_backward: needs 8 PSUM banks (transposes, gate, up, down, weight and input "
                          f"gradients); {cfg.name} has {cfg.core.psum.banks}")
    N = moe_blocks(T, E, k, block)
    NB = N * B
    KT, FT = -(-H // P), -(-F // P)
    n_tiles = -(-T // P)
    f32, i32 = get_dtype("fp32"), get_dtype("int32")

    x = kern.input("x", (T, H), dt)
    wr = kern.input("w_router", (H, E), dt)
    wg = kern.input("w_gate", (E, H, F), dt)
    wu = kern.input("w_up", (E, H, F), dt)
    wd = kern.input("w_down", (E, F, H), dt)
    go = kern.input("grad_out", (T, H), dt)
    dx_out = kern.output("grad_x", (T, H), dt)
    dw_out = kern.output("grad_weights", (T, k), f32)
    dwg = kern.output("grad_w_gate", (E, H, F), dt)
    dwu = kern.output("grad_w_up", (E, H, F), dt)
    dwd = kern.output("grad_w_down", (E, F, H), dt)
    logits = kern.scratch("router_logits", (T, E), dt)
    perm = kern.scratch("perm", (NB, 1), i32)
    wsort = kern.scratch("w_sorted", (NB, 1), f32)
    dxs = kern.scratch("grad_x_sorted", (NB, H), dt)
    dws = kern.scratch("grad_weights_sorted", (NB, 1), f32)
    wg_rows, wu_rows, wd_rows = wg.reshape(E * H, F), wu.reshape(E * H, F), wd.reshape(E * F, H)
    dwg_rows, dwu_rows, dwd_rows = dwg.reshape(E * H, F), dwu.reshape(E * H, F), dwd.reshape(E * F, H)

    # ---- 0. the weight gradients start at zero ------------------------------------------------
    with kern.scope():
        zt = kern.sbuf((P, _ZERO_COLS), dt, name="zeros_grad")
        kern.memset(zt, 0.0)
        q = 0
        for rows_view, nrows, ncols in ((dwg_rows, E * H, F), (dwu_rows, E * H, F), (dwd_rows, E * F, H)):
            for r0 in range(0, nrows, P):
                n = min(P, nrows - r0)
                for c0 in range(0, ncols, _ZERO_COLS):
                    c = min(_ZERO_COLS, ncols - c0)
                    kern.dma_copy(rows_view[r0:r0 + n, c0:c0 + c], zt[:n, :c], engine="sync", queue=q % 2)
                    q += 1

    # ---- 1. routing and grouping (the forward's) ----------------------------------------------
    r = route(kern, x, wr, logits, perm, T, H, F, E, k, normalize, B, N, dt, wsort=wsort)
    tpsum = r.tpsum

    # ---- 2. per block ----------------------------------------------------------------------------
    rows_h = kern.sbuf((P, KT), i32, name="row_iota_h")  # p + kt*P
    kern.iota(rows_h, base=0, channel_multiplier=1, pattern=[P])
    rows_f = kern.sbuf((P, FT), i32, name="row_iota_f")
    kern.iota(rows_f, base=0, channel_multiplier=1, pattern=[P])
    fs_max = -(-FC // P)  # ffn slabs per chunk
    with kern.scope():
        idx_pool = kern.tile_pool("block_ids", bufs=2)
        aff_pool = kern.tile_pool("block_weights", bufs=2)
        xg_pool = kern.tile_pool("block_x", bufs=1)
        gg_pool = kern.tile_pool("block_grad", bufs=1)
        xT = [kern.sbuf((P, B), dt, name=f"block_x_t{kt}") for kt in range(KT)]
        gT = [kern.sbuf((P, B), dt, name=f"block_grad_t{kt}") for kt in range(KT)]
        # the chunk's gate/up weights with ffn on partitions (for the input gradient), w_down's
        # transposed tiles with hidden on partitions (for grad_out @ w_down^T)
        wgT = [kern.sbuf((P, H), dt, name=f"w_gate_t{s}") for s in range(fs_max)]
        wuT = [kern.sbuf((P, H), dt, name=f"w_up_t{s}") for s in range(fs_max)]
        wdT = [kern.sbuf((P, FC), dt, name=f"w_down_t{kt}") for kt in range(KT)]
        dgT = [kern.sbuf((P, B), dt, name=f"dg_t{s}") for s in range(fs_max)]
        duT = [kern.sbuf((P, B), dt, name=f"du_t{s}") for s in range(fs_max)]
        gi_pool = kern.tile_pool("gate_up_rows", bufs=2)
        di_pool = kern.tile_pool("down_rows", bufs=2)
        w_pool = kern.tile_pool("weights", bufs=4)
        wdr_pool = kern.tile_pool("w_down_rows", bufs=1)
        ew_pool = kern.tile_pool("elementwise", bufs=6)
        op_pool = kern.tile_pool("operands", bufs=3)
        rmw_pool = kern.tile_pool("grad_rows", bufs=KT)  # a chunk's gate or up gradient rows
        rmwd_pool = kern.tile_pool("grad_down_rows", bufs=-(-H // TN))  # a slab's down gradient rows
        col_pool = kern.tile_pool("row_sums", bufs=2)
        dx_acc = kern.sbuf((P, H), f32, name="grad_x_acc")
        dwa = kern.sbuf((P, 1), f32, name="grad_weight_acc")
        dxb_pool = kern.tile_pool("grad_x_rows", bufs=1)
        gpsum = kern.tile_pool("gate_up_psum", bufs=2, space="psum")
        ppsum = kern.tile_pool("down_t_psum", bufs=1, space="psum")
        wpsum = kern.tile_pool("weight_grad_psum", bufs=2, space="psum")
        xpsum = kern.tile_pool("x_grad_psum", bufs=1, space="psum")
        evac = 0
        for b in range(N):
            r0 = b * B
            ids = idx_pool.tile((P, 1), i32)[:B]
            kern.dma_copy(ids, perm[r0:r0 + B, :], engine="sync", queue=1)
            a = aff_pool.tile((P, 1), f32)[:B]
            kern.dma_copy(a, wsort[r0:r0 + B, :], engine="sync", queue=1)
            xg = xg_pool.tile((P, H), dt)[:B]
            kern.dma_gather(xg, x, ids, engine="gpsimd", queue=0)
            gg = gg_pool.tile((P, H), dt)[:B]
            kern.dma_gather(gg, go, ids, engine="gpsimd", queue=1)
            transpose_rows(kern, tpsum, xT, xg, B, H, P, 0, dt)
            transpose_rows(kern, tpsum, gT, gg, B, H, P, 0, dt)
            gi = gi_pool.tile((P, KT), i32)
            kern.tensor_scalar(gi, rows_h, "add", r.bases_h[:, b:b + 1])
            di = di_pool.tile((P, FT), i32)
            kern.tensor_scalar(di, rows_f, "add", r.bases_f[:, b:b + 1])
            kern.memset(dx_acc[:B], 0.0)
            kern.memset(dwa[:B], 0.0)
            for f0 in range(0, F, FC):
                fw = min(FC, F - f0)
                slabs = [(s, min(P, fw - s * P)) for s in range(-(-fw // P))]
                # gate and up recomputed; their weight tiles transposed for the input gradient
                pg = gpsum.tile((P, TN), f32)[:B, :fw]
                pu = gpsum.tile((P, TN), f32)[:B, :fw]
                for kt in range(KT):
                    kw = min(P, H - kt * P)
                    wgt = w_pool.tile((P, FC), dt)[:kw, :fw]
                    kern.dma_gather(wgt, wg_rows[:, f0:f0 + fw], gi[:kw, kt:kt + 1], engine="gpsimd", queue=2)
                    wut = w_pool.tile((P, FC), dt)[:kw, :fw]
                    kern.dma_gather(wut, wu_rows[:, f0:f0 + fw], gi[:kw, kt:kt + 1], engine="gpsimd", queue=3)
                    kern.nc_matmul(pg, xT[kt][:kw, :B], wgt, accumulate=kt > 0)
                    kern.nc_matmul(pu, xT[kt][:kw, :B], wut, accumulate=kt > 0)
                    transpose_cols(kern, tpsum, wgT, wgt, kw, fw, 0, P, kt * P, dt)
                    transpose_cols(kern, tpsum, wuT, wut, kw, fw, 0, P, kt * P, dt)
                # grad_out @ w_down^T for the chunk: w_down's rows gathered, transposed per slab
                for s, w in slabs:
                    ft = f0 // P + s
                    wdr = wdr_pool.tile((P, H), dt)[:w]
                    kern.dma_gather(wdr, wd_rows, di[:w, ft:ft + 1], engine="gpsimd", queue=4)
                    transpose_rows(kern, tpsum, wdT, wdr, w, H, P, s * P, dt)
                pd = ppsum.tile((P, TN), f32)[:B, :fw]
                for kt in range(KT):
                    kw = min(P, H - kt * P)
                    kern.nc_matmul(pd, gT[kt][:kw, :B], wdT[kt][:kw, :fw], accumulate=kt > 0)
                # the activation's backward, fp32
                sg = ew_pool.tile((P, FC), f32)[:B, :fw]
                kern.activation(sg, "sigmoid", pg)
                sl = ew_pool.tile((P, FC), f32)[:B, :fw]
                kern.tensor_tensor(sl, pg, sg, "multiply")
                h = ew_pool.tile((P, FC), f32)[:B, :fw]
                kern.tensor_tensor(h, sl, pu, "multiply")
                prod = ew_pool.tile((P, FC), f32)[:B, :fw]
                kern.tensor_tensor(prod, pd, h, "multiply")
                part = col_pool.tile((P, 1), f32)[:B]
                kern.tensor_reduce(part, "add", prod, axis=1)
                kern.tensor_tensor(dwa[:B], dwa[:B], part, "add")
                dh = ew_pool.tile((P, FC), f32)[:B, :fw]
                kern.tensor_scalar(dh, pd, "multiply", a)
                dud = op_pool.tile((P, FC), dt)[:B, :fw]
                kern.tensor_tensor(dud, dh, sl, "multiply")
                t1 = ew_pool.tile((P, FC), f32)[:B, :fw]
                kern.tensor_tensor(t1, pg, sl, "subtract")
                kern.scalar_tensor_tensor(t1, t1, "add", 1.0, "multiply", sg)  # s * (1 + g (1 - s))
                kern.tensor_tensor(dh, dh, pu, "multiply")  # da = dh * u
                dgd = op_pool.tile((P, FC), dt)[:B, :fw]
                kern.tensor_tensor(dgd, dh, t1, "multiply")
                ahd = op_pool.tile((P, FC), dt)[:B, :fw]
                kern.tensor_scalar(ahd, h, "multiply", a)
                # the expert's gate/up weight gradients x^T dg and x^T du, added in HBM: every
                # row tile of the chunk read first, then updated and written back (an indirect
                # write's rows are known only when it runs, so a read after it waits for it)
                for src, rows_view in ((dgd, dwg_rows), (dud, dwu_rows)):
                    curs = []
                    for kt in range(KT):
                        kw = min(P, H - kt * P)
                        cur = rmw_pool.tile((P, FC), dt)[:kw, :fw]
                        kern.dma_gather(cur, rows_view[:, f0:f0 + fw], gi[:kw, kt:kt + 1], engine="gpsimd", queue=5)
                        curs.append(cur)
                    for kt, cur in enumerate(curs):
                        kw = min(P, H - kt * P)
                        pw = wpsum.tile((P, TN), f32)[:kw, :fw]
                        kern.nc_matmul(pw, xg[:B, kt * P:kt * P + kw], src)
                        kern.tensor_tensor(cur, pw, cur, "add")
                    for kt, cur in enumerate(curs):
                        kw = min(P, H - kt * P)
                        kern.dma_scatter(rows_view[:, f0:f0 + fw], cur, gi[:kw, kt:kt + 1], engine="gpsimd", queue=5)
                # ... and the down weight gradient (a h)^T grad_out, per ffn slab
                for s, w in slabs:
                    ft = f0 // P + s
                    curs = []
                    for h0 in range(0, H, TN):
                        hw = min(TN, H - h0)
                        cur = rmwd_pool.tile((P, TN), dt)[:w, :hw]
                        kern.dma_gather(cur, dwd_rows[:, h0:h0 + hw], di[:w, ft:ft + 1], engine="gpsimd", queue=6)
                        curs.append(cur)
                    for h0, cur in zip(range(0, H, TN), curs):
                        hw = min(TN, H - h0)
                        pw = wpsum.tile((P, TN), f32)[:w, :hw]
                        kern.nc_matmul(pw, ahd[:, s * P:s * P + w], gg[:, h0:h0 + hw])
                        kern.tensor_tensor(cur, pw, cur, "add")
                    for h0, cur in zip(range(0, H, TN), curs):
                        hw = min(TN, H - h0)
                        kern.dma_scatter(dwd_rows[:, h0:h0 + hw], cur, di[:w, ft:ft + 1], engine="gpsimd", queue=6)
                # the rows' input gradient: dg @ w_gate^T + du @ w_up^T, over the chunk's slabs
                transpose_cols(kern, tpsum, dgT, dgd, B, fw, 0, P, 0, dt)
                transpose_cols(kern, tpsum, duT, dud, B, fw, 0, P, 0, dt)
                for h0 in range(0, H, TN):
                    hw = min(TN, H - h0)
                    px = xpsum.tile((P, TN), f32)[:B, :hw]
                    first = True
                    for s, w in slabs:
                        for lhs, rhs in ((dgT, wgT), (duT, wuT)):
                            kern.nc_matmul(px, lhs[s][:w, :B], rhs[s][:w, h0:h0 + hw], accumulate=not first)
                            first = False
                    kern.tensor_tensor(dx_acc[:B, h0:h0 + hw], dx_acc[:B, h0:h0 + hw], px, "add")
            dxb = dxb_pool.tile((P, H), dt)[:B]
            kern.tensor_copy(dxb, dx_acc[:B], engine="vector" if evac % 2 == 0 else "scalar")
            evac += 1
            kern.dma_copy(dxs[r0:r0 + B, :], dxb, engine="scalar", queue=2)
            kern.dma_copy(dws[r0:r0 + B, :], dwa[:B], engine="scalar", queue=3)

    # ---- 3. combine: each token's k rows and routing-weight gradients --------------------------
    with kern.scope():
        combine(kern, dxs, dx_out, r, T, H, k, dt, weighted=False)
        dw_pool = kern.tile_pool("combine_weights", bufs=2)
        for j in range(n_tiles):
            t0, n = j * P, min(P, T - j * P)
            dwt = dw_pool.tile((P, k), f32)[:n]
            for kk in range(k):
                kern.dma_gather(dwt[:, kk:kk + 1], dws, r.place(j, kk, n), engine="gpsimd", queue=6)
            kern.dma_copy(dw_out[t0:t0 + n, :], dwt, engine="sync", queue=3)
    return kern
