"""Mixture-of-experts block (Mixtral's sparse MoE layer), written as an NKI author would.

``out[t] = sum_k w[t,k] * expert_{e[t,k]}(x[t])`` with ``e``, ``w`` the top-k of
``softmax(x @ w_router)`` (renormalised over the k chosen when ``normalize``), and each expert a
SwiGLU MLP ``(silu(x @ w_gate[e]) * (x @ w_up[e])) @ w_down[e]``. Also returns the router logits,
as Hugging Face's ``MixtralSparseMoeBlock`` does. The weights are stored as a Neuron deployment
lays them out for TensorE: ``w_router [H, E]``, ``w_gate``/``w_up [E, H, F]``, ``w_down [E, F, H]``
(contraction dim first).

The kernel's instruction stream is fixed by the shapes, while which tokens go to which expert is
known only when it runs; the token grouping is therefore computed on chip and applied by
indirect DMA, the way NKI-lib's blockwise MoE kernels do it:

1. **Routing** (per 128-token tile): x rows are loaded and turned on TensorE (PE transposes), the
   router logits accumulate in PSUM over the hidden dim, are rounded to the model dtype and
   stored; the softmax runs on VectorE (row max) and ScalarE (exp with the row sum fused); top-k
   on VectorE, k rounds of (row max, the first expert holding it, mask it out). Each token's
   choices become one-hot rows; the rank of a token among the earlier tokens that chose the
   same expert is an exclusive prefix sum *across partitions*, done on TensorE as a matmul with
   a strictly triangular ones matrix (plus the running per-expert counts of earlier tiles).
2. **Grouping.** Each expert's slots are padded to whole blocks of ``B`` tokens (``block``, a
   power of two, at most the token count rounded up to one): the padded counts, their exclusive
   scan over experts (VectorE ``tensor_tensor_scan``) and each slot's place in the
   expert-sorted order follow on VectorE. GpSimd scatters each slot's token id to its place
   (indirect DMA into an HBM table pre-filled with token 0), and the expert of every block
   (how many experts end at or before it) becomes the base row of the weights it reads. The
   number of blocks is the worst case over routings, ``(T*k + min(E, T*k) * (B - 1)) // B``:
   every block runs, so the time does not depend on the routing (padding rows compute on token
   0 and are never read back).
3. **Experts** (per block): GpSimd gathers the block's token rows (indirect DMA), TensorE
   transposes them; gate and up projections accumulate in PSUM (tokens stationary, 512-column
   weight tiles moving, gathered from the block's expert by indirect DMA), ScalarE applies silu
   and VectorE the product; PE transposes put the intermediate dim on partitions for the down
   projection, whose result is stored to an expert-sorted HBM buffer.
4. **Combine** (per token tile): GpSimd gathers each token's k expert outputs back (indirect DMA)
   and VectorE sums them weighted by the routing weights, in fp32, rounding once.

Expert weights are re-read from HBM for every block (a block does not know at build time whether
the previous block used the same expert), which is what large blocks amortise; with block 256 a
Mixtral-sized layer is close to balanced between TensorE and DMA. LNC=2 splits the tokens.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from ..config import ChipConfig
from ..isa import KernelError
from ..builder.kernel import Kernel, checked_int
from ..native.dtypes import get_dtype
from .reference import round_to
from .registry import register_kernel, split_dims

__all__ = ["build_moe", "moe_blocks", "moe_block_size", "moe_reference", "route", "Routing", "checked_args", "combine",
           "block_inputs", "transpose_rows", "transpose_cols"]

DTYPES = ("bf16", "fp16", "fp32")
_PARAMS = {"top_k": 2, "normalize": True, "block": 256}
_BIG = 1024.0  # larger than any expert index: "not this expert" in the first-index search
_COMBINE_COLS = 2048  # hidden columns the combine step gathers per token tile at once
_COMPARE_ELEMS = 4096  # elements per partition of one block-to-expert comparison


def moe_block_size(tokens: int, block: int) -> int:
    """Tokens per block: ``block`` (a power of two), or fewer when every token fits one block."""
    b = 1
    while b < min(block, tokens):
        b *= 2
    return b


def moe_blocks(tokens: int, experts: int, top_k: int, block: int) -> int:
    """Blocks the kernel runs: the most any routing of ``tokens * top_k`` slots can need when each
    expert's slots are padded to whole blocks (at most ``min(E, T*k)`` experts are non-empty)."""
    b = moe_block_size(tokens, block)
    slots = tokens * top_k
    return (slots + min(experts, slots) * (b - 1)) // b


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def moe_reference(x: np.ndarray, w_router: np.ndarray, w_gate: np.ndarray, w_up: np.ndarray, w_down: np.ndarray,
                  top_k: int, normalize: bool, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """(out, router logits) in float64 from rounded inputs, rounding where the kernel rounds: the
    logits, the SwiGLU product and each expert's output to ``dtype``; the weighted sum in full
    precision, rounded once. Ties in routing go to the lower expert index, as in the kernel."""
    logits = round_to(x @ w_router, dtype)
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    chosen = np.argsort(-p, axis=1, kind="stable")[:, :top_k]
    w = np.take_along_axis(p, chosen, axis=1)
    if normalize:
        w = w / w.sum(axis=1, keepdims=True)
    out = np.zeros_like(x)
    for e in range(w_gate.shape[0]):
        rows, slot = np.nonzero(chosen == e)
        if rows.size == 0:
            continue
        xe = x[rows]
        h = round_to(_silu(xe @ w_gate[e]) * (xe @ w_up[e]), dtype)
        y = round_to(h @ w_down[e], dtype)
        np.add.at(out, rows, w[rows, slot][:, None] * y)
    return round_to(out, dtype), logits


def block_inputs(shape: tuple[int, ...], dtype: str, params: Mapping[str, Any], rng: np.random.Generator
            ) -> dict[str, np.ndarray]:
    t, h, f, e = shape
    g = lambda *s: rng.standard_normal(s, dtype=np.float32)  # noqa: E731
    return {"x": g(t, h), "w_router": g(h, e) / np.sqrt(h), "w_gate": g(e, h, f) / np.sqrt(h),
            "w_up": g(e, h, f) / np.sqrt(h), "w_down": g(e, f, h) / np.sqrt(f)}


def _reference(inputs: Mapping[str, np.ndarray], shape: tuple[int, ...], dtype: str, params: Mapping[str, Any]
               ) -> dict[str, np.ndarray]:
    r = {n: round_to(v, dtype) for n, v in inputs.items()}
    out, logits = moe_reference(r["x"], r["w_router"], r["w_gate"], r["w_up"], r["w_down"],
                                int(params.get("top_k", 2)), bool(params.get("normalize", True)), dtype)
    return {"out": out, "router_logits": logits}


def checked_args(what: str, cfg: ChipConfig, dtype: str, tokens: int, hidden: int, ffn: int, experts: int,
                 top_k: int, block: int) -> tuple[Any, int, int, int, int, int, int]:
    """A block kernel's arguments, checked: (dtype, T, H, F, E, top_k, block)."""
    dt = get_dtype(dtype)
    if dt.short not in DTYPES:
        raise KernelError(f"{what}: dtype {dt.short} not supported; expected one of {', '.join(DTYPES)}")
    T, H, F, E = (checked_int(v, f"{what}: {n}", lo=1) for v, n in
                  ((tokens, "tokens"), (hidden, "hidden"), (ffn, "ffn"), (experts, "experts")))
    k = checked_int(top_k, f"{what}: top_k", lo=1)
    block = checked_int(block, f"{what}: block", lo=1)
    if block & (block - 1):
        raise KernelError(f"{what}: block must be a power of two (tokens per expert block), got {block}")
    TN = min(cfg.core.tensor.moving_max_free, cfg.core.psum.bank_bytes // 4)  # one fp32 PSUM bank of columns
    if k > E:
        raise KernelError(f"{what}: top_k {k} exceeds the {E} experts")
    if E > TN:
        raise KernelError(f"{what}: {E} experts; the router's logits take one PSUM bank, at most {TN} experts")
    return dt, T, H, F, E, k, block


def combine(kern: Kernel, rows: Any, out: Any, r: "Routing", T: int, H: int, k: int, dt: Any, weighted: bool) -> None:
    """Each token's k rows of the expert-sorted ``rows`` [NB, H], gathered back (indirect DMA)
    and summed in fp32 (each scaled by its routing weight when ``weighted``), rounded once to
    ``out`` [T, H]."""
    P = kern.config.core.sbuf.partitions
    f32 = get_dtype("fp32")
    yk_pool = kern.tile_pool("combine_rows", bufs=2 * k)
    acc_pool = kern.tile_pool("combine_acc", bufs=2)
    o_pool = kern.tile_pool("combine_out", bufs=2)
    for j in range(-(-T // P)):
        t0, n = j * P, min(P, T - j * P)
        for h0 in range(0, H, _COMBINE_COLS):
            hc = min(_COMBINE_COLS, H - h0)
            acc = acc_pool.tile((P, _COMBINE_COLS), f32)[:n, :hc]
            ot = o_pool.tile((P, _COMBINE_COLS), dt)[:n, :hc]
            for kk in range(k):
                yk = yk_pool.tile((P, _COMBINE_COLS), dt)[:n, :hc]
                kern.dma_gather(yk, rows[:, h0:h0 + hc], r.place(j, kk, n), engine="gpsimd", queue=5)
                dst = ot if kk == k - 1 else acc
                if not weighted:
                    if kk == 0:
                        kern.tensor_copy(dst, yk)
                    else:
                        kern.tensor_tensor(dst, yk, acc, "add")
                elif kk == 0:
                    kern.tensor_scalar(dst, yk, "multiply", r.weight(j, kk, n))
                else:
                    kern.scalar_tensor_tensor(dst, yk, "multiply", r.weight(j, kk, n), "add", acc)
            kern.dma_copy(out[t0:t0 + n, h0:h0 + hc], ot, engine="sync", queue=2)


@register_kernel("moe", dims="TOKENSxHIDDENxFFNxEXPERTS", dtypes=DTYPES, default_shape=(128, 4096, 14336, 8),
                 summary="MoE block: router softmax + top-k, tokens grouped per expert by indirect DMA, "
                         "SwiGLU expert MLPs on TensorE, weighted combine", params=dict(_PARAMS),
                 inputs=block_inputs, reference=_reference, split=split_dims(0))
def build_moe(tokens: int, hidden: int, ffn: int, experts: int, dtype: str = "bf16", config: ChipConfig | str = "trn2",
              top_k: int = 2, normalize: bool = True, block: int = 256, name: str = "moe") -> Kernel:
    kern = Kernel(name, config)
    cfg = kern.config
    dt, T, H, F, E, k, block = checked_args("moe", cfg, dtype, tokens, hidden, ffn, experts, top_k, block)
    P = cfg.core.sbuf.partitions
    TN = min(cfg.core.tensor.moving_max_free, cfg.core.psum.bank_bytes // 4)  # one fp32 PSUM bank of columns
    B = moe_block_size(T, block)
    N = moe_blocks(T, E, k, block)
    NB = N * B
    KT, FT = -(-H // P), -(-F // P)
    subs = [(s * P, min(P, B - s * P)) for s in range(-(-B // P))]
    banks = cfg.core.psum.banks
    if 2 + 3 * len(subs) > banks:  # two for transposes, gate + up + down per 128-token sub-block
        most = max(1, (banks - 2) // 3) * P
        raise KernelError(f"moe: block {block} needs {2 + 3 * len(subs)} PSUM banks (gate, up and down "
                          f"accumulators per 128 tokens, two for transposes); {cfg.name} has {banks}: use "
                          f"block <= {most}")
    f32, i32 = get_dtype("fp32"), get_dtype("int32")

    x = kern.input("x", (T, H), dt)
    wr = kern.input("w_router", (H, E), dt)
    wg = kern.input("w_gate", (E, H, F), dt)
    wu = kern.input("w_up", (E, H, F), dt)
    wd = kern.input("w_down", (E, F, H), dt)
    out = kern.output("out", (T, H), dt)
    logits_out = kern.output("router_logits", (T, E), dt)
    perm = kern.scratch("perm", (NB, 1), i32)  # expert-sorted place -> token id
    ysort = kern.scratch("y", (NB, H), dt)      # expert outputs in expert-sorted order
    wg_rows, wu_rows, wd_rows = wg.reshape(E * H, F), wu.reshape(E * H, F), wd.reshape(E * F, H)

    r = route(kern, x, wr, logits_out, perm, T, H, F, E, k, normalize, B, N, dt)
    bases_h, bases_f, tpsum = r.bases_h, r.bases_f, r.tpsum

    # ---- 3. experts, per block ------------------------------------------------------------------
    rows_h = kern.sbuf((P, KT), i32, name="row_iota_h")  # p + kt*P
    kern.iota(rows_h, base=0, channel_multiplier=1, pattern=[P])
    rows_f = kern.sbuf((P, FT), i32, name="row_iota_f")
    kern.iota(rows_f, base=0, channel_multiplier=1, pattern=[P])
    with kern.scope():
        idx_pool = kern.tile_pool("block_ids", bufs=2)
        xg_pool = kern.tile_pool("block_rows", bufs=2)
        # the block's rows transposed (hidden on partitions) and its SwiGLU output transposed
        # (ffn on partitions): one tile per 128-row slab, reused by every block
        xT = [kern.sbuf((P, B), dt, name=f"block_x_t{kt}") for kt in range(KT)]
        hT = [kern.sbuf((P, B), dt, name=f"block_h_t{ft}") for ft in range(FT)]
        gi_pool = kern.tile_pool("gate_up_rows", bufs=2)
        di_pool = kern.tile_pool("down_rows", bufs=2)
        w_pool = kern.tile_pool("weights", bufs=8)
        silu_pool = kern.tile_pool("silu", bufs=2)
        h_pool = kern.tile_pool("swiglu", bufs=2)
        y_pool = kern.tile_pool("y", bufs=3)
        gpsum = kern.tile_pool("gate_up_psum", bufs=2 * len(subs), space="psum")
        opsum = kern.tile_pool("down_psum", bufs=len(subs), space="psum")
        evac = 0
        for b in range(N):
            r0 = b * B
            for s0, ns in subs:
                ids = idx_pool.tile((P, 1), i32)[:ns]
                kern.dma_copy(ids, perm[r0 + s0:r0 + s0 + ns, :], engine="sync", queue=1)
                xg = xg_pool.tile((P, H), dt)[:ns]
                kern.dma_gather(xg, x, ids, engine="gpsimd", queue=0)
                transpose_rows(kern, tpsum, xT, xg, ns, H, P, s0, dt)
            gi = gi_pool.tile((P, KT), i32)
            kern.tensor_scalar(gi, rows_h, "add", bases_h[:, b:b + 1])
            di = di_pool.tile((P, FT), i32)
            kern.tensor_scalar(di, rows_f, "add", bases_f[:, b:b + 1])
            for f0 in range(0, F, TN):
                fw = min(TN, F - f0)
                pg = [gpsum.tile((P, TN), f32)[:ns, :fw] for _, ns in subs]
                pu = [gpsum.tile((P, TN), f32)[:ns, :fw] for _, ns in subs]
                for kt in range(KT):
                    kw = min(P, H - kt * P)
                    wgt = w_pool.tile((P, TN), dt)[:kw, :fw]
                    kern.dma_gather(wgt, wg_rows[:, f0:f0 + fw], gi[:kw, kt:kt + 1], engine="gpsimd", queue=2)
                    wut = w_pool.tile((P, TN), dt)[:kw, :fw]
                    kern.dma_gather(wut, wu_rows[:, f0:f0 + fw], gi[:kw, kt:kt + 1], engine="gpsimd", queue=3)
                    for (s0, ns), g, u in zip(subs, pg, pu):
                        st = xT[kt][:kw, s0:s0 + ns]
                        kern.nc_matmul(g, st, wgt, accumulate=kt > 0)
                        kern.nc_matmul(u, st, wut, accumulate=kt > 0)
                for (s0, ns), g, u in zip(subs, pg, pu):
                    sg = silu_pool.tile((P, TN), f32)[:ns, :fw]
                    kern.activation(sg, "silu", g)
                    ht = h_pool.tile((P, TN), dt)[:ns, :fw]
                    kern.tensor_tensor(ht, sg, u, "multiply")
                    transpose_cols(kern, tpsum, hT, ht, ns, fw, f0, P, s0, dt)
            for h0 in range(0, H, TN):
                hw = min(TN, H - h0)
                po = [opsum.tile((P, TN), f32)[:ns, :hw] for _, ns in subs]
                for ft in range(FT):
                    fwi = min(P, F - ft * P)
                    wdt = w_pool.tile((P, TN), dt)[:fwi, :hw]
                    kern.dma_gather(wdt, wd_rows[:, h0:h0 + hw], di[:fwi, ft:ft + 1], engine="gpsimd", queue=4)
                    for (s0, ns), o in zip(subs, po):
                        kern.nc_matmul(o, hT[ft][:fwi, s0:s0 + ns], wdt, accumulate=ft > 0)
                for (s0, ns), o in zip(subs, po):
                    yt = y_pool.tile((P, TN), dt)[:ns, :hw]
                    kern.tensor_copy(yt, o, engine="vector" if evac % 2 == 0 else "scalar")
                    evac += 1
                    kern.dma_copy(ysort[r0 + s0:r0 + s0 + ns, h0:h0 + hw], yt, engine="scalar", queue=2)

    # ---- 4. combine: each token's k expert outputs, weighted ------------------------------------
    with kern.scope():
        combine(kern, ysort, out, r, T, H, k, dt, weighted=True)
    return kern


class Routing:
    """What :func:`route` leaves on chip for the blocks: per token tile and slot the chosen
    expert, its routing weight and (int) its place in the expert-sorted order; per block the
    first weight row of its expert (``bases_h``: expert * H, ``bases_f``: expert * F)."""

    def __init__(self, k: int, slots: list[Any], places: list[Any], bases_h: Any, bases_f: Any, tpsum: Any):
        self.k, self.slots, self.places, self.bases_h, self.bases_f = k, slots, places, bases_h, bases_f
        self.tpsum = tpsum  # the PSUM pool of PE transposes, kept for the blocks

    def weight(self, j: int, kk: int, n: int) -> Any:
        return self.slots[j][:n, 2 * self.k + kk:2 * self.k + kk + 1]

    def place(self, j: int, kk: int, n: int) -> Any:
        return self.places[j][:n, kk:kk + 1]


def route(kern: Kernel, x: Any, wr: Any, logits_out: Any, perm: Any, T: int, H: int, F: int, E: int, k: int,
          normalize: bool, B: int, N: int, dt: Any, wsort: Any = None) -> Routing:
    """Phases 1 and 2 of the block (the module docstring): routing per 128-token tile (the
    logits stored to ``logits_out``), then the grouping, which fills ``perm`` (expert-sorted
    place -> token id, token 0 where a block is padded) and, when given, ``wsort`` (place ->
    the slot's routing weight, 0.0 where padded: what the backward scales by)."""
    cfg = kern.config
    P = cfg.core.sbuf.partitions
    KT = -(-H // P)
    n_tiles = -(-T // P)
    NB = N * B
    f32, i32 = get_dtype("fp32"), get_dtype("int32")
    # ---- constants and routing state ----------------------------------------------------------
    iota_i = kern.sbuf((P, E), i32, name="iota_e_i")
    kern.iota(iota_i, base=0, channel_multiplier=0, pattern=[1])
    iota_e = kern.sbuf((P, E), f32, name="iota_e")
    kern.tensor_copy(iota_e, iota_i)
    iota_big = kern.sbuf((P, E), f32, name="iota_e_big")  # expert index - BIG
    kern.tensor_scalar(iota_big, iota_e, "subtract", _BIG)
    ones = kern.sbuf((P, max(P, E)), f32, name="ones")  # (E columns: the scan over experts multiplies by them)
    kern.memset(ones, 1.0)
    upper = kern.sbuf((P, P), f32, name="upper")  # upper[p, f] = 1 where p < f: exclusive prefix
    kern.affine_select(upper, ones[:, :P], cmp="greater", offset=0, channel_multiplier=-1, pattern=[1],
                       on_false=0.0)
    counts = kern.sbuf((P, E), f32, name="counts")  # slots per expert so far, on every partition
    kern.memset(counts, 0.0)
    # per token tile and slot: the chosen expert (as index - BIG), its rank among the expert's
    # earlier slots, its routing weight; and (int) its place in the expert-sorted order. One
    # tile per token tile keeps each tile's dependency history short.
    slots = [kern.sbuf((P, 3 * k), f32, name=f"slots{j}") for j in range(n_tiles)]
    places = [kern.sbuf((P, k), i32, name=f"places{j}") for j in range(n_tiles)]
    wr_sb = kern.sbuf((P, KT * E), dt, name="w_router")
    for kt in range(KT):
        kw = min(P, H - kt * P)
        kern.dma_copy(wr_sb[:kw, kt * E:(kt + 1) * E], wr[kt * P:kt * P + kw, :], engine="scalar", queue=0)
    zeros = kern.sbuf((P, 1), i32, name="zeros")
    kern.memset(zeros, 0, engine="gpsimd")
    for r0 in range(0, NB, P):  # the sorted-place table starts as token 0 everywhere
        n = min(P, NB - r0)
        kern.dma_copy(perm[r0:r0 + n, :], zeros[:n], engine="gpsimd", queue=1)
    if wsort is not None:  # padded places scale by zero
        zf = kern.sbuf((P, 1), f32, name="zeros_f")
        kern.memset(zf, 0.0, engine="gpsimd")
        for r0 in range(0, NB, P):
            n = min(P, NB - r0)
            kern.dma_copy(wsort[r0:r0 + n, :], zf[:n], engine="gpsimd", queue=1)

    def choice(j: int, kk: int, n: int) -> Any:
        return slots[j][:n, kk:kk + 1]

    def rank(j: int, kk: int, n: int) -> Any:
        return slots[j][:n, k + kk:k + kk + 1]

    def weight(j: int, kk: int, n: int) -> Any:
        return slots[j][:n, 2 * k + kk:2 * k + kk + 1]

    def place(j: int, kk: int, n: int) -> Any:
        return places[j][:n, kk:kk + 1]

    # ---- 1. routing, per 128-token tile --------------------------------------------------------
    xpool = kern.tile_pool("x_rows", bufs=2)
    xtpool = [kern.tile_pool(f"x_t{kt}", bufs=2) for kt in range(KT)]  # a tile per slab: short histories
    tpsum = kern.tile_pool("transpose_psum", bufs=2, space="psum")
    rpsum = kern.tile_pool("router_psum", bufs=3, space="psum")
    pools: dict[str, Any] = {}

    def small(role: str, shape: tuple[int, int], dtype: Any, n: int) -> Any:
        """A routing tile of ``role`` (each role double buffered), its first ``n`` partitions."""
        if role not in pools:
            pools[role] = kern.tile_pool(f"routing_{role}", bufs=2)
        return pools[role].tile(shape, dtype)[:n]

    for j in range(n_tiles):
        t0, n = j * P, min(P, T - j * P)
        xt = xpool.tile((P, H), dt)[:n]
        kern.dma_copy(xt, x[t0:t0 + n, :], engine="sync", queue=0)
        xT = [pool.tile((P, P), dt) for pool in xtpool]
        transpose_rows(kern, tpsum, xT, xt, n, H, P, 0, dt)
        lp = rpsum.tile((P, E), f32)[:n]
        for kt in range(KT):
            kw = min(P, H - kt * P)
            kern.nc_matmul(lp, xT[kt][:kw, :n], wr_sb[:kw, kt * E:(kt + 1) * E], accumulate=kt > 0)
        lg = small("logits", (P, E), dt, n)
        kern.tensor_copy(lg, lp, engine="scalar")
        kern.dma_copy(logits_out[t0:t0 + n, :], lg, engine="scalar", queue=1)
        # softmax over the experts (fp32), from the logits as the model rounds them
        negmax = small("negmax", (P, 1), f32, n)
        kern.tensor_reduce(negmax, "max", lg, axis=1, negate=True)
        total = small("total", (P, 1), f32, n)
        probs = small("probs", (P, E), f32, n)
        kern.activation(probs, "exp", lg, bias=negmax, reduce_op="add", reduce_res=total)
        inv = small("inv", (P, 1), f32, n)
        kern.reciprocal(inv, total)
        kern.tensor_scalar(probs, probs, "multiply", inv)
        # top-k: the largest probability, the first expert that holds it, masked out in turn
        eq = small("eq", (P, E), f32, n)
        oh = [small(f"onehot{kk}", (P, E), f32, n) for kk in range(k)]
        for kk in range(k):
            kern.tensor_reduce(weight(j, kk, n), "max", probs, axis=1)
            kern.tensor_scalar(eq, probs, "equal", weight(j, kk, n))
            kern.tensor_tensor(eq, eq, iota_big[:n], "multiply")
            kern.tensor_reduce(choice(j, kk, n), "min", eq, axis=1)
            kern.tensor_scalar(oh[kk], iota_big[:n], "equal", choice(j, kk, n))
            if kk + 1 < k:  # probabilities are <= 1: minus 2 puts the chosen one below all others
                kern.scalar_tensor_tensor(probs, oh[kk], "multiply", -2.0, "add", probs)
        weights = slots[j][:n, 2 * k:3 * k]
        if normalize and k > 1:
            wsum = small("wsum", (P, 1), f32, n)
            kern.tensor_reduce(wsum, "add", weights, axis=1)
            kern.reciprocal(wsum, wsum)
            kern.tensor_scalar(weights, weights, "multiply", wsum)
        elif normalize:
            kern.memset(weights, 1.0)
        # rank of each slot among earlier slots of its expert: TensorE prefix sum over tokens
        assign = oh[0]
        if k > 1:
            assign = small("assign", (P, E), f32, n)
            kern.tensor_tensor(assign, oh[0], oh[1], "add")
            for kk in range(2, k):
                kern.tensor_tensor(assign, assign, oh[kk], "add")
        prefix = rpsum.tile((P, E), f32)[:n]
        kern.nc_matmul(prefix, upper[:n, :n], assign)
        before = small("before", (P, E), f32, n)
        kern.tensor_tensor(before, prefix, counts[:n], "add")
        for kk in range(k):
            kern.tensor_tensor(eq, oh[kk], before, "multiply")
            kern.tensor_reduce(rank(j, kk, n), "add", eq, axis=1)
        colsum = rpsum.tile((P, E), f32)
        kern.nc_matmul(colsum, ones[:n, :P], assign)
        kern.tensor_tensor(counts, counts, colsum, "add")
    for pool in [xpool, rpsum, *xtpool, *pools.values()]:
        pool.release()

    # ---- 2. grouping: padded offsets, each slot's place, each block's expert -------------------
    bases_h = kern.sbuf((P, N), i32, name="w_rows_h")  # each block's first weight row: expert * H
    bases_f = kern.sbuf((P, N), i32, name="w_rows_f")  # ... and expert * F
    with kern.scope():
        ci = kern.sbuf((P, E), i32)
        kern.tensor_copy(ci, counts)
        kern.tensor_scalar(ci, ci, "add", B - 1, op1="bitwise_and", operand1=-B)  # up to whole blocks
        padded = kern.sbuf((P, E), f32)
        kern.tensor_copy(padded, ci)
        ends = kern.sbuf((P, E), f32)  # where each expert's blocks end (inclusive scan)
        kern.tensor_tensor_scan(ends, ones[:, :E], padded, 0.0, "multiply", "add")
        starts = kern.sbuf((P, E), f32)
        kern.tensor_tensor(starts, ends, padded, "subtract")
        tmp = kern.sbuf((P, E), f32)
        off = kern.sbuf((P, 1), f32)
        tok = kern.sbuf((P, 1), i32)
        for j in range(n_tiles):
            t0, n = j * P, min(P, T - j * P)
            kern.iota(tok[:n], base=t0, channel_multiplier=1, pattern=[0])
            for kk in range(k):
                kern.tensor_scalar(tmp[:n], iota_big[:n], "equal", choice(j, kk, n))  # the one-hot again
                kern.tensor_tensor(tmp[:n], tmp[:n], starts[:n], "multiply")
                kern.tensor_reduce(off[:n], "add", tmp[:n], axis=1)
                kern.tensor_tensor(off[:n], off[:n], rank(j, kk, n), "add")
                kern.tensor_copy(place(j, kk, n), off[:n])
                kern.dma_scatter(perm, tok[:n], place(j, kk, n), engine="gpsimd", queue=1)
                if wsort is not None:
                    kern.dma_scatter(wsort, weight(j, kk, n), place(j, kk, n), engine="gpsimd", queue=1)
        # block b's expert: the number of experts whose blocks end at or before b*B (the tail
        # past the last expert's blocks is padding: clamped to the last expert)
        nc = max(1, min(N, _COMPARE_ELEMS // E))  # blocks per comparison
        bi = kern.sbuf((P, nc), i32)
        bstart = kern.sbuf((P, nc), f32)
        cmp = kern.sbuf((P, nc * E), f32)
        eb = kern.sbuf((P, nc), f32)
        ebh = kern.sbuf((P, nc), f32)
        for c0 in range(0, N, nc):
            m = min(nc, N - c0)
            kern.iota(bi[:, :m], base=c0 * B, channel_multiplier=0, pattern=[B])
            kern.tensor_copy(bstart[:, :m], bi[:, :m])
            view = cmp[:, :m * E].reshape(P, m, E)
            kern.tensor_tensor(view, ends.reshape(P, 1, E).broadcast_to(P, m, E),
                               bstart[:, :m].reshape(P, m, 1).broadcast_to(P, m, E), "less_equal")
            kern.tensor_reduce(eb[:, :m], "add", view, axis=2)
            kern.tensor_scalar(eb[:, :m], eb[:, :m], "minimum", float(E - 1))
            kern.tensor_scalar(ebh[:, :m], eb[:, :m], "multiply", float(H))
            kern.tensor_copy(bases_h[:, c0:c0 + m], ebh[:, :m])
            kern.tensor_scalar(ebh[:, :m], eb[:, :m], "multiply", float(F))
            kern.tensor_copy(bases_f[:, c0:c0 + m], ebh[:, :m])
    return Routing(k, slots, places, bases_h, bases_f, tpsum)


def transpose_rows(kern: Kernel, tpsum: Any, dst: list[Any], rows: Any, n: int, width: int, P: int, c0: int,
                    dt: Any) -> None:
    """``dst[kt][:, c0 + i] = rows[i, kt*P + :]`` for each 128-column slab ``kt`` of the ``[n,
    width]`` rows: PE transposes, as many slabs to a PSUM bank as fit, evacuated by VectorE."""
    slabs = -(-width // P)
    per = max(1, (kern.config.core.psum.bank_bytes // dt.itemsize) // P)  # slabs of P columns per bank
    for g0 in range(0, slabs, per):
        g1 = min(slabs, g0 + per)
        pt = tpsum.tile((P, per * P), dt)
        for kt in range(g0, g1):
            kw = min(P, width - kt * P)
            kern.nc_transpose(pt[:kw, (kt - g0) * P:(kt - g0) * P + n], rows[:n, kt * P:kt * P + kw])
        for kt in range(g0, g1):
            kw = min(P, width - kt * P)
            kern.tensor_copy(dst[kt][:kw, c0:c0 + n], pt[:kw, (kt - g0) * P:(kt - g0) * P + n])


def transpose_cols(kern: Kernel, tpsum: Any, dst: list[Any], tile: Any, n: int, fw: int, f0: int, P: int, c0: int,
                    dt: Any) -> None:
    """The ``[n, fw]`` tile (columns ``f0..`` of the whole dim) into ``dst`` with its columns on
    partitions: ``dst[ft][:, c0 + i]`` for each 128-column slab ``ft``."""
    slabs = -(-fw // P)
    pt = tpsum.tile((P, slabs * P), dt)
    for s in range(slabs):
        w = min(P, fw - s * P)
        kern.nc_transpose(pt[:w, s * P:s * P + n], tile[:n, s * P:s * P + w])
    for s in range(slabs):
        w = min(P, fw - s * P)
        kern.tensor_copy(dst[(f0 + s * P) // P][:w, c0:c0 + n], pt[:w, s * P:s * P + n], engine="scalar")
