"""``moe_tkg``: the routed experts of an MoE layer for token generation (the NKI library's
``moe_tkg``, ``nkilib/core/moe/moe_tkg/``: ``selective_expert_impl.py``, ``all_expert_impl.py``,
commit d2ad3a57), given the router's choices (``router_topk``).

``out[t] = Σ_j w[t, j] · down_e(act(x[t] @ gate_e) * (x[t] @ up_e))``, ``e = idx[t, j]``; weights
``[E, H, I]`` / ``[E, I, H]`` as NxD Inference stores them.

* **selective** (few tokens): per token, per chosen expert, the expert's weights are fetched
  by indirect DMA (GpSimd's descriptor generation: which expert is data the kernel reads when it
  runs) - the gate/up rows ``[E*128, K1*I]`` a k-group at a time, the down rows per k-tile and
  column block - and multiplied with the one token (stationary); the routing weight is folded
  into the intermediate (``round(a * w)``) so all ``k`` experts accumulate into one PSUM group
  per output column block. HBM traffic ``T * k`` experts' weights.
* **all** (more tokens than ``0.8 E / k``): every expert's weights stream once (static DMAs)
  through the gate/up and down :class:`~.common.Projection` with all tokens, and each expert's
  output is accumulated in fp32 weighted by its affinity (``Σ_j w[t, j] [idx[t, j] = e]``, made
  on chip from the router's outputs). HBM traffic ``E`` experts' weights.

``mode="auto"`` picks as the library does: selective while the tokens' choices touch fewer than
``0.8 E`` experts' worth of weights. For prefill (context encoding), the blockwise kernel is the
library's ``moe`` (router, token grouping by indirect DMA, expert blocks).

Inputs ``x [T, H]`` (normalised), ``expert_idx [T, k]`` int32, ``expert_w [T, k]`` fp32,
``w_gate``/``w_up [E, H, I]``, ``w_down [E, I, H]``; output ``out [T, H]``.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from ...config import ChipConfig
from ...isa import KernelError, TileAP
from ...builder.kernel import Kernel
from ..reference import round_to
from ..registry import checked_dtype, register_kernel
from .common import BANK, BOUNDS, P, XT, Bound, Pools, RowPrologue, choice, k_tiles, positive, shard_range, shards
from .projection import Projection, Seg

__all__ = ["build_moe_tkg", "moe_tkg_reference", "moe_tkg_bound"]

DTYPES = ("bf16", "fp16")
PARAMS = {"top_k": 2, "mode": "auto", "act": "silu", "shard": "0/1"}
ACTS = {"silu": "silu", "gelu": "gelu", "relu": "relu"}
ALPHA = 0.8  # selective while T*k < ALPHA * E (NxD Inference's moe-arch-deep-dive: "alpha 0.8-1")


def moe_mode(t: int, e: int, k: int, mode: str) -> str:
    """The implementation ``mode`` resolves to for ``t`` tokens, ``e`` experts, top-``k``."""
    if mode != "auto":
        return mode
    return "selective" if t * k < ALPHA * e else "all"


@register_kernel("moe_tkg", dims="TxHxIxE", dtypes=DTYPES, default_shape=(4, 4096, 1536, 16),
                 summary="MoE experts for decode from the router's choices: selective (indirect-DMA expert "
                         "weights per token) or all-expert (every expert streamed once, affinity-weighted)",
                 params=PARAMS, inputs=lambda s, d, p, g: moe_tkg_inputs(s, d, p, g),
                 reference=lambda i, s, d, p: moe_tkg_reference(i, s, d, p), split=lambda s, p, n: moe_tkg_split(s, p, n))
def build_moe_tkg(t: int, h: int, i: int, e: int, dtype: str = "bf16", config: ChipConfig | str = "trn2",
                  top_k: int = 2, mode: str = "auto", act: str = "silu", shard: str = "0/1",
                  name: str = "moe_tkg") -> Kernel:
    """``shard="i/n"``: physical core ``i`` of an LNC=``n`` logical core takes its share of the
    experts (all-expert mode; its partial output exchanged and added) or of the tokens
    (selective) (:func:`moe_tkg_split`)."""
    positive("moe_tkg", T=t, H=h, I=i, E=e)
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= min(8, e):
        raise KernelError(f"moe_tkg: top_k must be an integer in 1..{min(8, e)}, got {top_k!r}")
    if t > P:
        raise KernelError(f"moe_tkg: T={t} tokens; token generation takes at most {P} (prefill: the moe kernel)")
    mode = moe_mode(t, e, top_k, choice("moe_tkg", "mode", mode, ("auto", "selective", "all")))
    act = choice("moe_tkg", "act", act, tuple(ACTS))
    kern = Kernel(name, config)
    dt = checked_dtype("moe_tkg", dtype, DTYPES)
    hp, h1 = k_tiles("moe_tkg", "H", h)
    ip, i1 = k_tiles("moe_tkg", "I", i)
    x = kern.input("x", (t, h), dt)
    idx = kern.input("expert_idx", (t, top_k), "int32")
    wts = kern.input("expert_w", (t, top_k), "fp32")
    wg = kern.input("w_gate", (e, h, i), dt)
    wu = kern.input("w_up", (e, h, i), dt)
    wd = kern.input("w_down", (e, i, h), dt)
    out = kern.output("out", (t, h), dt)
    pools = Pools(kern)
    pro = RowPrologue(kern, pools, k=h, dt=dt, x=x, norm=False, tokens=t)
    xT = pro.block(0, t, pools("xT", 1))
    kw = dict(kern=kern, pools=pools, dt=dt, t=t, h=h, i=i, e=e, k=top_k, hp=hp, h1=h1, ip=ip, i1=i1, x=x,
              idx=idx, wts=wts, wg=wg, wu=wu, wd=wd, out=out, fn=ACTS[act], xT=xT, pro=pro)
    if mode == "selective":
        lo, hi = shard_range("moe_tkg", shard, t)
        _selective(tokens=range(lo, hi), **kw)
    else:
        lo, hi = shard_range("moe_tkg", shard, e)
        _all_experts(experts=range(lo, hi), sharded=(lo, hi) != (0, e), **kw)
    return kern


class _Fixed:
    """A prologue whose ``Xᵀ`` is already made (every expert's projection shares the tokens')."""

    def __init__(self, xT: XT, pro: RowPrologue):
        self.xT, self.kp, self.out_dt, self.sbuf_bytes = xT, pro.kp, pro.out_dt, 0

    def stage_a(self, t0: int, tb: int, pool: Any) -> XT:
        return self.xT

    def stage_b(self, state: Any, pool: Any) -> XT:
        return state

    def stage_b_steps(self, state: Any, pool: Any) -> tuple[XT, list[Any]]:
        return state, []


def _all_experts(*, kern: Kernel, pools: Pools, dt: Any, t: int, h: int, i: int, e: int, k: int, ip: int, i1: int,
                 h1: int, idx: Any, wts: Any, wg: Any, wu: Any, wd: Any, out: Any, fn: str, xT: XT, pro: RowPrologue,
                 experts: range, sharded: bool, **_: Any) -> None:
    cap = kern.config.core.sbuf.partition_bytes
    # the affinities [T, E]: Σ_j w[:, j] · (e == idx[:, j]), from the router's outputs
    iota_e = kern.sbuf((t, e), "fp32", name="iota_e")
    kern.iota(iota_e, base=0, channel_multiplier=0, pattern=[1])
    ix_i = kern.sbuf((t, k), "int32", name="idx_i")
    kern.dma_copy(ix_i, idx.full(), queue=8)
    ix = kern.sbuf((t, k), "fp32", name="idx_f")
    kern.tensor_copy(ix, ix_i, engine="gpsimd")
    wt = kern.sbuf((t, k), "fp32", name="w_route")
    kern.dma_copy(wt, wts.full(), queue=8)
    aff = kern.sbuf((t, e), "fp32", name="aff")
    kern.memset(aff, 0.0, engine="gpsimd")
    tmp = kern.sbuf((t, e), "fp32", name="aff_j")
    for j in range(k):
        kern.tensor_scalar(tmp, iota_e, "equal", ix[:, j:j + 1], op1="multiply", operand1=wt[:, j:j + 1],
                           engine="gpsimd")
        kern.tensor_tensor(aff, aff, tmp, "add", engine="gpsimd")
    acc_out = kern.sbuf((t, h), "fp32", name="out_acc")
    kern.memset(acc_out, 0.0)
    a_rows = kern.sbuf((t, i), dt, name="a_rows")
    fixed = pro.sbuf_bytes + (3 * e + 4 * h + 2 * i) * 4 + 24 * 1024
    fx = _Fixed(xT, pro)
    flip = [0]
    for ex in experts:
        def gate_up(width: int, ex: int = ex) -> list[list[Seg]]:
            return [[Seg(wg, ex * h * i, i, c, min(width, i - c)), Seg(wu, ex * h * i, i, c, min(width, i - c))]
                    for c in range(0, i, width)]

        gu = Projection(kern, pools, k1=h1, tokens=t, prologue=fx, isz=dt.itemsize, make_passes=gate_up,
                        max_width=i, unit=ip, budget=cap - fixed, tag="gu", max_banks=1)

        def evac_gu(pi: int, t0: int, tb: int, accs: list[list[TileAP]], gu: Projection = gu) -> None:
            segs = gu.passes[pi]
            for j in range(len(accs[0])):
                c, w = segs[0].c0 + j * BANK, min(BANK, segs[0].cw - j * BANK)
                ga = pools("act", 2).tile((P, BANK), "fp32")[:t, :w]
                kern.activation(ga, fn, accs[0][j][:, :w])
                kern.tensor_tensor(a_rows[:, c:c + w], ga, accs[1][j][:, :w], "multiply")

        gu.run(evac_gu)
        pro2 = RowPrologue(kern, pools, k=i, dt=dt, x=None, norm=False, tokens=t, tag="a",
                           rows_of=lambda t0, tb: a_rows[t0:t0 + tb])

        def down(width: int, ex: int = ex) -> list[list[Seg]]:
            return [[Seg(wd, ex * i * h, h, c, min(width, h - c))] for c in range(0, h, width)]

        dn = Projection(kern, pools, k1=i1, tokens=t, prologue=pro2, isz=dt.itemsize, make_passes=down,
                        max_width=h, unit=P, budget=cap - fixed, tag="dn")

        def evac_dn(pi: int, t0: int, tb: int, accs: list[list[TileAP]], dn: Projection = dn, ex: int = ex) -> None:
            sg = dn.passes[pi][0]
            for j, acc in enumerate(accs[0]):
                c, w = sg.c0 + j * BANK, min(BANK, sg.cw - j * BANK)
                # out += affinity[:, e] * expert_e(x)  (fp32; the expert's output is not rounded)
                kern.scalar_tensor_tensor(acc_out[:, c:c + w], acc[:, :w], "multiply", aff[:, ex:ex + 1], "add",
                                          acc_out[:, c:c + w])

        dn.run(evac_dn)
    if sharded:  # the peer's partial sum (by DMA; here this core's own, see common.Exchange)
        peer = kern.sbuf((t, h), "fp32", name="out_peer")
        kern.dma_copy(peer, acc_out, engine="gpsimd", queue=6)
        kern.tensor_tensor(acc_out, acc_out, peer, "add")
    res = kern.sbuf((t, h), dt, name="out_rows")
    kern.tensor_copy(res, acc_out, engine="scalar")
    kern.dma_copy(out.full(), res, engine="gpsimd", queue=2)


def _selective(*, kern: Kernel, pools: Pools, dt: Any, t: int, h: int, i: int, e: int, k: int, hp: int, h1: int,
               ip: int, i1: int, idx: Any, wts: Any, wg: Any, wu: Any, wd: Any, out: Any, fn: str, xT: XT,
               tokens: range, **_: Any) -> None:
    group = max(1, min(h1, 4096 // (i * dt.itemsize)))  # gate/up rows gathered ~4 KiB a partition at a time
    ipass = min(i, 3 * BANK)                             # intermediate columns a pass (gate + up banks <= 6)
    hpass = 3 * BANK                                     # output columns a down pass
    iota_h = kern.sbuf((hp, 1), "fp32", name="iota_h")
    kern.iota(iota_h, base=0, channel_multiplier=1, pattern=[0])
    iota_i = kern.sbuf((ip, 1), "fp32", name="iota_i")
    kern.iota(iota_i, base=0, channel_multiplier=1, pattern=[0])

    def rows(n_p: int, t_: int, j: int, iota: TileAP, tag: str) -> TileAP:
        """int32 [n_p, 1]: row e*n_p + p of the expert's ``[E*n_p, ...]`` view (e = idx[t, j])."""
        ei = pools(f"{tag}_ei", 4).tile((P, 1), "int32")[:n_p]
        kern.dma_copy(ei, idx.ap(t_ * k + j, [[0, n_p], [1, 1]]), engine="gpsimd", queue=9)
        ef = pools(f"{tag}_ef", 4).tile((P, 1), "fp32")[:n_p]
        kern.tensor_copy(ef, ei, engine="gpsimd")
        kern.tensor_scalar(ef, ef, "multiply", float(n_p), op1="add", operand1=iota, engine="gpsimd")
        ri = pools(f"{tag}_ri", 4).tile((P, 1), "int32")[:n_p]
        kern.tensor_copy(ri, ef, engine="gpsimd")
        return ri

    for tt in tokens:
        a_slots = []
        for j in range(k):
            r_h = rows(hp, tt, j, iota_h, "h")
            a = pools("a_row", 2 * k).tile((1, i), dt)
            for c0 in range(0, i, ipass):
                cw = min(ipass, i - c0)
                nb = -(-cw // BANK)
                accs = [[pools("acc", 6, "psum").tile((P, BANK), "fp32")[:1] for _ in range(nb)] for _ in range(2)]
                first = True
                for j0 in range(0, h1, group if cw == i else 1):
                    g = min(group if cw == i else 1, h1 - j0)
                    tiles = []
                    for w_ in (wg, wu):
                        wt_ = pools("wsel", 8).tile((P, group, i), dt)[:hp, :g, :cw]
                        src = w_.ap(j0 * i + c0, [[h1 * i, e * hp], [1, g * i if cw == i else cw]])
                        kern.dma_gather(wt_.reshape(hp, g * cw) if cw == i else wt_[:, 0, :], src, r_h,
                                        queue=10 + len(tiles))
                        tiles.append(wt_)
                    for jj in range(g):
                        st = xT.st(j0 + jj)[:, tt:tt + 1]
                        for acc, wt_ in zip(accs, tiles):
                            pairs = [(acc[b][:, :min(BANK, cw - b * BANK)],
                                      wt_[:, jj, b * BANK:b * BANK + min(BANK, cw - b * BANK)]) for b in range(nb)]
                            kern.nc_matmul_row(st, pairs, accumulate=not first)
                        first = False
                for b in range(nb):
                    w = min(BANK, cw - b * BANK)
                    ga = pools("act", 2).tile((P, BANK), "fp32")[:1, :w]
                    kern.activation(ga, fn, accs[0][b][:, :w])
                    kern.tensor_tensor(a[:, c0 + b * BANK:c0 + b * BANK + w], ga, accs[1][b][:, :w], "multiply")
            # aᵀ [ip, I1] times the routing weight (broadcast to the partitions), in the model dtype
            tp = pools("a_tr", 1, "psum").tile((P, P), dt)[:ip, :i1]
            # k-tile c of a (i = p*I1 + c: every I1-th column) transposed to a column
            kern.nc_transpose_many([(tp[:, c:c + 1], TileAP(a.alloc, a.p_start, 1, a.offset + c, ((i1, ip),), a.dtype))
                                    for c in range(i1)])
            wb = pools("w_b", 4).tile((P, 1), "fp32")[:ip]
            kern.dma_copy(wb, wts.ap(tt * k + j, [[0, ip], [1, 1]]), engine="gpsimd", queue=9)
            aT = pools("aT", 2 * k).tile((P, i1), dt)[:ip]
            kern.tensor_scalar(aT, tp, "multiply", wb)
            a_slots.append((aT, rows(ip, tt, j, iota_i, "i")))
        # down: Σ_j (w_j a_j) @ W_down[e_j], every slot and k-tile into one accumulation group
        for c0 in range(0, h, hpass):
            cw = min(hpass, h - c0)
            nb = -(-cw // BANK)
            acc = [pools("acc", 6, "psum").tile((P, BANK), "fp32")[:1] for _ in range(nb)]
            first = True
            for aT, r_i in a_slots:
                for jj in range(i1):
                    wt_ = pools("wsel_d", 8).tile((P, hpass), dt)[:ip, :cw]
                    kern.dma_gather(wt_, wd.ap(jj * h + c0, [[i1 * h, e * ip], [1, cw]]), r_i, queue=12)
                    pairs = [(acc[b][:, :min(BANK, cw - b * BANK)], wt_[:, b * BANK:b * BANK + min(BANK, cw - b * BANK)])
                             for b in range(nb)]
                    kern.nc_matmul_row(aT[:, jj:jj + 1], pairs, accumulate=not first)
                    first = False
            o = pools("o_row", 2).tile((1, hpass), dt)[:, :cw]
            for b in range(nb):
                w = min(BANK, cw - b * BANK)
                kern.tensor_copy(o[:, b * BANK:b * BANK + w], acc[b][:, :w], engine="scalar" if b % 2 else "vector")
            kern.dma_copy(out[tt:tt + 1, c0:c0 + cw], o, engine="gpsimd", queue=2)


def moe_tkg_split(shape: tuple[int, ...], params: Mapping[str, Any], n: int) -> list[Any] | None:
    """LNC=2: selective mode shares the tokens; all-expert mode shares the experts (each core's
    partial sum exchanged and added)."""
    t, h, i, e = shape
    if str(params.get("shard", "0/1")) != "0/1":
        return None
    mode = moe_mode(t, e, int(params.get("top_k", 2)), str(params.get("mode", "auto")))
    units = t if mode == "selective" else e
    return [(shape, sh) for sh in shards(n)] if units >= n else None


def moe_tkg_inputs(shape: tuple[int, ...], dtype: str, params: Mapping[str, Any], rng: np.random.Generator
                   ) -> dict[str, np.ndarray]:
    t, h, i, e = shape
    k = int({**PARAMS, **params}["top_k"])
    idx = np.stack([rng.choice(e, size=k, replace=False) for _ in range(t)]).astype(np.int32)
    w = rng.uniform(0.1, 1.0, (t, k)).astype(np.float32)
    g = lambda *s: rng.standard_normal(s, dtype=np.float32)  # noqa: E731
    return {"x": g(t, h), "expert_idx": idx, "expert_w": w / w.sum(axis=1, keepdims=True),
            "w_gate": g(e, h, i) / np.sqrt(h), "w_up": g(e, h, i) / np.sqrt(h), "w_down": g(e, i, h) / np.sqrt(i)}


def moe_tkg_reference(inputs: Mapping[str, np.ndarray], shape: tuple[int, ...], dtype: str,
                      params: Mapping[str, Any]) -> dict[str, np.ndarray]:
    from ...isa import ACTIVATIONS

    t, h, i, e = shape
    p = {**PARAMS, **params}
    k = int(p["top_k"])
    mode = moe_mode(t, e, k, p["mode"])
    f = ACTIVATIONS[ACTS[p["act"]]][0]
    x = round_to(inputs["x"], dtype)
    wg, wu, wd = (round_to(inputs[n], dtype) for n in ("w_gate", "w_up", "w_down"))
    idx, w = inputs["expert_idx"], inputs["expert_w"].astype(np.float32).astype(np.float64)
    out = np.zeros((t, h))
    for tt in range(t):
        for j in range(k):
            ex = int(idx[tt, j])
            a = round_to(f(x[tt] @ wg[ex]) * (x[tt] @ wu[ex]), dtype)
            if mode == "selective":  # the routing weight folded into a, rounded
                out[tt] += round_to(a * w[tt, j], dtype) @ wd[ex]
            else:
                out[tt] += w[tt, j] * (a @ wd[ex])
    return {"out": round_to(out, dtype)}


def moe_tkg_bound(shape: tuple[int, ...], dtype: str, params: Mapping[str, Any]) -> Bound:
    """The experts the mode reads (selective: each token's k; all: every expert) once, x and out."""
    t, h, i, e = shape
    p = {**PARAMS, **params}
    k = int(p["top_k"])
    n_exp = t * k if moe_mode(t, e, k, p["mode"]) == "selective" else e
    return Bound(2 * (3 * n_exp * h * i + 2 * t * h), 2 * 3 * t * k * h * i)


BOUNDS["moe_tkg"] = moe_tkg_bound
