"""``router_topk``: the MoE router - logits ``x @ W_router`` (+ bias), softmax or sigmoid, the
top ``k <= 8`` experts per token, optional L1 renormalisation of their weights, and the dense
affinities (the chosen weights scattered to ``[T, E]``) - as the NKI library's ``router_topk``
(``nkilib/core/router_topk/router_topk.py``, commit d2ad3a57) computes them.

The logits come from a :class:`~.common.Projection` (tokens stationary, ``E <= 512`` columns in one
PSUM bank) and stay in fp32, as NxD Inference runs the router. Per 128-token block: VectorE the
row max, ScalarE ``exp`` with the row sum fused (or ``sigmoid``), VectorE ``max8`` and
``nc_find_index8`` (the eight largest probabilities and their experts: the ISA's top-k, N cycles
each), the first ``k`` of them, their sum and the renormalised weights; the affinities are
``(p >= p_k) * renorm * p`` (two VectorE instructions). Ties at the k-th value
(which random logits do not make) would select more than ``k`` experts in the affinities, as the
threshold form does in the library's kernel.

Inputs ``x [T, H]`` (model dtype), ``w_router [H, E]``, ``bias [E]`` fp32; outputs ``logits [T, E]``
fp32, ``topk_idx [T, k]`` int32, ``topk_w [T, k]`` fp32 and ``affinity [T, E]`` fp32.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from ...config import ChipConfig
from ...isa import KernelError, TileAP
from ...builder.kernel import Kernel
from ..reference import round_to
from ..registry import checked_dtype, register_kernel
from .common import BOUNDS, P, Bound, Pools, RowPrologue, choice, flag, k_tiles, positive, row_vector
from .projection import Projection, Seg

__all__ = ["build_router_topk", "router_reference", "router_bound"]

DTYPES = ("bf16", "fp16")
PARAMS = {"top_k": 2, "act": "softmax", "norm": True, "bias": False}


@register_kernel("router_topk", dims="TxHxE", dtypes=DTYPES, default_shape=(4, 4096, 128),
                 summary="MoE router: x @ W_router, softmax/sigmoid, top-k (max8 + find_index8), renormalised "
                         "weights and dense affinities",
                 params=PARAMS, inputs=lambda s, d, p, g: router_inputs(s, d, p, g),
                 reference=lambda i, s, d, p: router_reference(i, s, d, p),
                 tolerance=lambda d: (1e-4, 1e-4), split=lambda s, p, n: router_split(s, p, n))
def build_router_topk(t: int, h: int, e: int, dtype: str = "bf16", config: ChipConfig | str = "trn2",
                      top_k: int = 2, act: str = "softmax", norm: bool = True, bias: bool = False,
                      name: str = "router_topk") -> Kernel:
    positive("router_topk", T=t, H=h, E=e)
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= 8:
        raise KernelError(f"router_topk: top_k must be an integer in 1..8 (one max8), got {top_k!r}")
    if not 8 <= e <= 512:
        raise KernelError(f"router_topk: E={e} experts must be within 8..512 (max8 needs 8; one PSUM bank holds 512)")
    act = choice("router_topk", "act", act, ("softmax", "sigmoid"))
    norm, bias = flag("router_topk", "norm", norm), flag("router_topk", "bias", bias)
    kern = Kernel(name, config)
    dt = checked_dtype("router_topk", dtype, DTYPES)
    _, h1 = k_tiles("router_topk", "H", h)
    x = kern.input("x", (t, h), dt)
    w = kern.input("w_router", (h, e), dt)
    b_t = kern.input("bias", (e,), "fp32") if bias else None
    logits_o = kern.output("logits", (t, e), "fp32")
    idx_o = kern.output("topk_idx", (t, top_k), "int32")
    w_o = kern.output("topk_w", (t, top_k), "fp32")
    aff_o = kern.output("affinity", (t, e), "fp32")
    pools = Pools(kern)
    tbw = min(P, t)
    bias_b = None
    if b_t is not None:
        bias_b = kern.sbuf((tbw, e), "fp32", name="bias_b")
        row_vector(kern, bias_b, b_t.full(), queue=7)
    pro = RowPrologue(kern, pools, k=h, dt=dt, x=x, norm=False, tokens=t, tag="x")
    cap = kern.config.core.sbuf.partition_bytes
    fixed = (3 * h * dt.itemsize if t > 32 else 0) + 6 * e * 4 + 24 * 1024

    def passes(width: int) -> list[list[Seg]]:
        return [[Seg(w, 0, e, c, min(width, e - c))] for c in range(0, e, width)]

    proj = Projection(kern, pools, k1=h1, tokens=t, prologue=pro, isz=dt.itemsize, make_passes=passes,
                      max_width=e, unit=e, budget=cap - fixed, tag="r", max_banks=1)

    def evac(pi: int, t0: int, tb: int, accs: list[list[TileAP]]) -> None:
        acc = accs[0][0][:, :e]
        lg = pools("logits", 2).tile((P, e), "fp32")[:tb]
        if bias_b is not None:
            kern.tensor_tensor(lg, acc, bias_b[:tb], "add")
        else:
            kern.tensor_copy(lg, acc, engine="scalar")
        kern.dma_copy(logits_o[t0:t0 + tb, :], lg, engine="gpsimd", queue=1)
        pr = pools("probs", 2).tile((P, e), "fp32")[:tb]
        if act == "softmax":
            nm = pools("nmax", 2).tile((P, 1), "fp32")[:tb]
            kern.tensor_reduce(nm, "max", lg, axis=1, negate=True)
            sm = pools("sum", 2).tile((P, 1), "fp32")[:tb]
            kern.activation(pr, "exp", lg, bias=nm, reduce_op="add", reduce_res=sm)
            kern.tensor_scalar(pr, pr, "divide", sm)
        else:
            kern.activation(pr, "sigmoid", lg)
        top = pools("top8", 2).tile((P, 8), "fp32")[:tb]
        kern.max8(top, pr)
        ix = pools("idx8", 2).tile((P, 8), "uint32")[:tb]
        kern.nc_find_index8(ix, pr, top)
        ii = pools("idx", 2).tile((P, 8), "int32")[:tb]
        kern.tensor_copy(ii[:, :top_k], ix[:, :top_k], engine="gpsimd")
        kern.dma_copy(idx_o[t0:t0 + tb, :], ii[:, :top_k], engine="gpsimd", queue=2)
        wk = pools("wk", 2).tile((P, 8), "fp32")[:tb, :top_k]
        scale = None
        if norm:
            tot = pools("tot", 2).tile((P, 1), "fp32")[:tb]
            kern.tensor_reduce(tot, "add", top[:, :top_k], axis=1)
            scale = pools("rtot", 2).tile((P, 1), "fp32")[:tb]
            kern.reciprocal(scale, tot)
            kern.tensor_scalar(wk, top[:, :top_k], "multiply", scale)
        else:
            kern.tensor_copy(wk, top[:, :top_k], engine="gpsimd")
        kern.dma_copy(w_o[t0:t0 + tb, :], wk, engine="gpsimd", queue=3)
        # the affinities: p where p is among the top k (p >= the k-th largest), renormalised
        af = pools("aff", 2).tile((P, e), "fp32")[:tb]
        kern.tensor_scalar(af, pr, "greater_equal", top[:, top_k - 1:top_k], op1="multiply",
                           operand1=scale if scale is not None else 1.0)
        kern.tensor_tensor(af, af, pr, "multiply")
        kern.dma_copy(aff_o[t0:t0 + tb, :], af, engine="gpsimd", queue=4)

    proj.run(evac)
    return kern


def router_split(shape: tuple[int, ...], params: Mapping[str, Any], n: int) -> list[tuple[int, ...]] | None:
    """LNC=2: the physical cores take half the tokens each."""
    t, h, e = shape
    return [(t // n + (1 if i < t % n else 0), h, e) for i in range(n)] if t >= n else None


def router_inputs(shape: tuple[int, ...], dtype: str, params: Mapping[str, Any], rng: np.random.Generator
                  ) -> dict[str, np.ndarray]:
    t, h, e = shape
    out = {"x": rng.standard_normal((t, h), dtype=np.float32),
           "w_router": (rng.standard_normal((h, e)) / np.sqrt(h)).astype(np.float32)}
    if params.get("bias"):
        out["bias"] = (0.5 * rng.standard_normal(e)).astype(np.float32)
    return out


def router_reference(inputs: Mapping[str, np.ndarray], shape: tuple[int, ...], dtype: str,
                     params: Mapping[str, Any]) -> dict[str, np.ndarray]:
    p = {**PARAMS, **params}
    k = int(p["top_k"])
    x = round_to(inputs["x"], dtype)
    lg = x @ round_to(inputs["w_router"], dtype)
    if p["bias"]:
        lg = lg + inputs["bias"].astype(np.float64)
    lg = lg.astype(np.float32).astype(np.float64)  # logits in fp32
    if p["act"] == "softmax":
        ex = np.exp(lg - lg.max(axis=1, keepdims=True))
        pr = ex / ex.sum(axis=1, keepdims=True)
    else:
        pr = 1.0 / (1.0 + np.exp(-lg))
    idx = np.argsort(-pr, axis=1, kind="stable")[:, :k]
    wk = np.take_along_axis(pr, idx, axis=1)
    kth = wk[:, -1:]
    aff = np.where(pr >= kth, pr, 0.0)
    if p["norm"]:
        tot = wk.sum(axis=1, keepdims=True)
        wk, aff = wk / tot, aff / tot
    return {"logits": lg, "topk_idx": idx.astype(np.int32), "topk_w": wk, "affinity": aff}


def router_bound(shape: tuple[int, ...], dtype: str, params: Mapping[str, Any]) -> Bound:
    t, h, e = shape
    k = int({**PARAMS, **params}["top_k"])
    return Bound(2 * t * h + 2 * h * e + 4 * 2 * t * e + 8 * t * k, 2 * t * h * e)


BOUNDS["router_topk"] = router_bound
