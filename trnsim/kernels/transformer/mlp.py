"""``mlp``: the fused MLP of a transformer layer - residual add, RMSNorm, gate and up projections,
activation, down projection - in one kernel (the NKI library's ``mlp`` kernel,
``nkilib/core/mlp/mlp.py``, ``mlp_tkg/``, ``mlp_cte/``, commit d2ad3a57).

``out = (act(xn @ W_gate) * (xn @ W_up)) @ W_down`` with ``xn = RMSNorm(x + res)`` (``gated=False``:
``act(xn @ W_up) @ W_down``). Two projections of :class:`~.common.Projection`:

1. **gate/up**: each pass pairs 512 columns of ``W_gate`` with the same columns of ``W_up``, so the
   evacuation has both: ScalarE ``act(g)`` out of PSUM into fp32, VectorE ``* u`` (the other PSUM
   bank), rounded once to the model dtype - the intermediate ``a``;
2. **down**: ``a @ W_down``, ``a`` transposed on TensorE 128 columns at a time. In decode ``a``
   stays in SBUF between the two; in prefill it goes through an HBM scratch (a token block's
   ``a`` is complete only after the last gate/up pass).

Decode is HBM-bound (the three weights stream once), prefill TensorE-bound. At LNC=2 decode
shares ``H`` between the physical cores, as the TKG kernel does: the gate/up projections
contract each core's rows of the weights and exchange the partial sums
(:class:`~.common.Exchange`, the kernel's ``sendrecv``), the down projection computes each core's
columns of the output; prefill shares the tokens.

Inputs ``x [T, H]``, ``res [T, H]`` (``residual``), ``gamma [H]`` (``norm``), ``w_gate [H, I]``
(``gated``), ``w_up [H, I]``, ``w_down [I, H]``; outputs ``out [T, H]`` (this rank's partial sum,
before the TP all-reduce) and, with ``residual``, ``h = x + res``.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from ...config import ChipConfig
from ...isa import KernelError, TileAP
from ...builder.kernel import Kernel
from ..reference import round_to
from ..registry import checked_dtype, register_kernel
from .common import (BANK, BOUNDS, P, Bound, Pools, RowPrologue, choice, flag, k_tiles, positive, rms_rows_reference,
                     shard_range, shards)
from .projection import Exchange, Projection, Seg

__all__ = ["build_mlp", "mlp_reference", "mlp_bound"]

DTYPES = ("bf16", "fp16")
PARAMS = {"norm": "rmsnorm", "eps": 1e-6, "residual": False, "act": "silu", "gated": True, "shard": "0/1"}
ACTS = {"silu": "silu", "gelu": "gelu", "gelu_tanh": "gelu_apprx_tanh", "relu": "relu"}


@register_kernel("mlp", dims="BxSxHxI", dtypes=DTYPES, default_shape=(4, 1, 4096, 1792),
                 summary="residual add + RMSNorm + act(x @ W_gate) * (x @ W_up) @ W_down in one kernel (SwiGLU)",
                 params=PARAMS, inputs=lambda s, d, p, g: mlp_inputs(s, d, p, g),
                 reference=lambda i, s, d, p: mlp_reference(i, s, d, p), split=lambda s, p, n: mlp_split(s, p, n))
def build_mlp(b: int, s: int, h: int, i: int, dtype: str = "bf16", config: ChipConfig | str = "trn2",
              norm: str = "rmsnorm", eps: float = 1e-6, residual: bool = False, act: str = "silu",
              gated: bool = True, shard: str = "0/1", name: str = "mlp") -> Kernel:
    """``shard="i/n"`` (decode, ``B*S <= 128``): physical core ``i`` of an LNC=``n`` logical core
    contracts its share of H in the gate/up projections (its rows of the weights: one
    contiguous run per partition), the partial sums are exchanged (:class:`~.common.Exchange`),
    both cores make the whole intermediate, and each computes its share of the output columns
    with its columns of ``W_down`` (:func:`mlp_split`); values are checked unsharded."""
    positive("mlp", B=b, S=s, H=h, I=i)
    norm = choice("mlp", "norm", norm, ("rmsnorm", "none"))
    act = choice("mlp", "act", act, tuple(ACTS))
    residual, gated = flag("mlp", "residual", residual), flag("mlp", "gated", gated)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        raise KernelError(f"mlp: eps must be a positive number, got {eps!r}")
    kern = Kernel(name, config)
    dt = checked_dtype("mlp", dtype, DTYPES)
    cfg = kern.config
    t = b * s
    hp, h1 = k_tiles("mlp", "H", h)
    ip, i1 = k_tiles("mlp", "I", i)
    lo, hi = shard_range("mlp", shard, h1)
    sharded = (lo, hi) != (0, h1)
    if sharded and t > P:
        raise KernelError(f"mlp: shard applies to decode (B*S <= {P}); B*S={t} is split by tokens")
    x = kern.input("x", (t, h), dt)
    res = kern.input("res", (t, h), dt) if residual else None
    gamma = kern.input("gamma", (h,), dt) if norm == "rmsnorm" else None
    w_gate = kern.input("w_gate", (h, i), dt) if gated else None
    w_up = kern.input("w_up", (h, i), dt)
    w_down = kern.input("w_down", (i, h), dt)
    out = kern.output("out", (t, h), dt)
    h_out = kern.output("h", (t, h), dt) if residual else None
    fn = ACTS[act]
    cap = cfg.core.sbuf.partition_bytes
    isz = dt.itemsize

    pools = Pools(kern)
    pro = RowPrologue(kern, pools, k=h, dt=dt, x=x, res=res, h_out=h_out if lo == 0 else None, gamma=gamma,
                      eps=eps, norm=norm == "rmsnorm", tokens=t)
    decode = t <= P
    a_rows = kern.sbuf((t, i), dt, name="a_rows") if decode else None
    a_hbm = None if decode else kern.scratch("a", (t, i), dt)
    rows_bytes = 0 if t <= 32 else pro.sbuf_bytes  # the prologue's rows (the norm's only when it norms)
    fixed = rows_bytes + (i * isz if decode else 0) + 24 * 1024
    xchg = Exchange(kern, pools) if sharded else None

    def gate_up(width: int) -> list[list[Seg]]:
        return [([Seg(w_gate, 0, i, c, min(width, i - c))] if w_gate is not None else [])
                + [Seg(w_up, 0, i, c, min(width, i - c))] for c in range(0, i, width)]

    gu = Projection(kern, pools, k1=h1, tokens=t, prologue=pro, isz=isz, make_passes=gate_up, max_width=i,
                    unit=ip, budget=cap - fixed, tag="gu", max_banks=(2 if decode else 1) if gated else 3,
                    k_range=(lo, hi) if sharded else None)
    flip = [0]

    def summed(acc: TileAP) -> TileAP:
        """A bank of gate/up output; sharing H, plus the peer core's partial sums."""
        return xchg.add_peer(acc, 0, acc.free_size) if xchg is not None else acc

    def evac_gu(pi: int, t0: int, tb: int, accs: list[list[TileAP]]) -> None:
        segs = gu.passes[pi]
        c0 = segs[0].c0
        for j in range(len(accs[0])):
            w = min(BANK, segs[0].cw - j * BANK)
            cols = slice(c0 + j * BANK, c0 + j * BANK + w)
            dst = a_rows[t0:t0 + tb, cols] if a_rows is not None else \
                pools("a_out", 3).tile((P, BANK), dt)[:tb, :w]
            if gated:
                g, u = summed(accs[0][j][:, :w]), summed(accs[1][j][:, :w])
                ga = pools("act", 2).tile((P, BANK), "fp32")[:tb, :w]
                kern.activation(ga, fn, g)
                kern.tensor_tensor(dst, ga, u, "multiply")
            else:
                kern.activation(dst, fn, summed(accs[0][j][:, :w]))
            if a_hbm is not None:
                kern.dma_copy(a_hbm[t0:t0 + tb, cols], dst, engine="gpsimd", queue=2 + flip[0] % 2)
                flip[0] += 1

    gu.run(evac_gu)
    if not decode:  # prefill: the norm's row buffers are done with; the down projection takes their room
        pools.release()

    # down projection: every row of W_down; sharing H (decode), this core's columns of it
    if a_rows is not None:
        pro2 = RowPrologue(kern, pools, k=i, dt=dt, x=None, norm=False, tokens=t, tag="a",
                           rows_of=lambda t0, tb: a_rows[t0:t0 + tb])
    else:
        pro2 = RowPrologue(kern, pools, k=i, dt=dt, x=a_hbm, norm=False, tokens=t, tag="a")
    own_lo, own_hi = lo * hp, hi * hp
    rows2 = 0 if decode else i * isz * 2 + 8 * 1024
    budget2 = cap - (24 * 1024 + i * isz if decode else 24 * 1024 + rows2)
    if decode:  # the gate/up pools stay: take what they left
        budget2 -= gu.w_bytes + pro.sbuf_bytes + 2 * h1 * t * isz
    own_w = own_hi - own_lo

    def down(width: int) -> list[list[Seg]]:
        return [[Seg(w_down, 0, h, own_lo + c, min(width, own_w - c))] for c in range(0, own_w, width)]

    dn = Projection(kern, pools, k1=i1, tokens=t, prologue=pro2, isz=isz, make_passes=down, max_width=own_w,
                    unit=P, budget=budget2, tag="dn")

    def evac_dn(pi: int, t0: int, tb: int, accs: list[list[TileAP]]) -> None:
        sg = dn.passes[pi][0]
        for j, acc in enumerate(accs[0]):
            c, w = sg.c0 + j * BANK, min(BANK, sg.cw - j * BANK)
            o = pools("o", 3).tile((P, BANK), dt)[:tb, :w]
            kern.tensor_copy(o, acc[:, :w], engine="scalar" if flip[0] % 2 else "vector")
            flip[0] += 1
            kern.dma_copy(out[t0:t0 + tb, c:c + w], o, engine="gpsimd", queue=2 + flip[0] % 2)

    dn.run(evac_dn)
    return kern


def mlp_split(shape: tuple[int, ...], params: Mapping[str, Any], n: int) -> list[Any] | None:
    """LNC=2: decode shares I between the physical cores (each reads its columns of W_gate/W_up
    and rows of W_down once), prefill shares the tokens."""
    b, s, h, i = shape
    if str(params.get("shard", "0/1")) != "0/1":
        return None
    if b * s <= P:
        return [(shape, sh) for sh in shards(n)] if k_tiles("mlp", "H", h)[1] >= n else None
    if b >= n:
        return [(b // n + (1 if k < b % n else 0), s, h, i) for k in range(n)]
    if s >= n:
        return [(b, s // n + (1 if k < s % n else 0), h, i) for k in range(n)]
    return None


def mlp_inputs(shape: tuple[int, ...], dtype: str, params: Mapping[str, Any], rng: np.random.Generator
               ) -> dict[str, np.ndarray]:
    b, s, h, i = shape
    t = b * s
    p = {**PARAMS, **params}
    out = {"x": rng.standard_normal((t, h), dtype=np.float32)}
    if p["residual"]:
        out["res"] = rng.standard_normal((t, h), dtype=np.float32)
    if p["norm"] == "rmsnorm":
        out["gamma"] = (1.0 + 0.25 * rng.standard_normal(h)).astype(np.float32)
    if p["gated"]:
        out["w_gate"] = (rng.standard_normal((h, i)) / np.sqrt(h)).astype(np.float32)
    out["w_up"] = (rng.standard_normal((h, i)) / np.sqrt(h)).astype(np.float32)
    out["w_down"] = (rng.standard_normal((i, h)) / np.sqrt(i)).astype(np.float32)
    return out


def _act(name: str, x: np.ndarray) -> np.ndarray:
    from ...isa import ACTIVATIONS

    return ACTIVATIONS[ACTS[name]][0](x)


def mlp_reference(inputs: Mapping[str, np.ndarray], shape: tuple[int, ...], dtype: str,
                  params: Mapping[str, Any]) -> dict[str, np.ndarray]:
    p = {**PARAMS, **params}
    x = round_to(inputs["x"], dtype)
    out: dict[str, np.ndarray] = {}
    if p["residual"]:
        x = round_to(x + round_to(inputs["res"], dtype), dtype)
        out["h"] = x
    if p["norm"] == "rmsnorm":
        x = round_to(rms_rows_reference(x, p["eps"], dtype) * round_to(inputs["gamma"], dtype), dtype)
    up = x @ round_to(inputs["w_up"], dtype)
    if p["gated"]:
        a = round_to(_act(p["act"], x @ round_to(inputs["w_gate"], dtype)) * up, dtype)
    else:
        a = round_to(_act(p["act"], up), dtype)
    out["out"] = round_to(a @ round_to(inputs["w_down"], dtype), dtype)
    return out


def mlp_bound(shape: tuple[int, ...], dtype: str, params: Mapping[str, Any]) -> Bound:
    b, s, h, i = shape
    p = {**PARAMS, **params}
    t = b * s
    mats = 3 if p["gated"] else 2
    bytes_ = 2 * (t * h * (3 if p["residual"] else 1) + mats * h * i + t * h + (h if p["norm"] == "rmsnorm" else 0))
    return Bound(bytes_, 2 * t * h * i * mats)


BOUNDS["mlp"] = mlp_bound
