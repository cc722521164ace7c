"""``qkv``: the fused QKV projection of a transformer layer - residual add, RMSNorm (optionally
FP8-quantised activations against FP8 weights), ``x @ W_qkv``, bias and RoPE - in one kernel.

The NKI library's ``qkv`` kernel (``nkilib/core/qkv/qkv.py``, ``qkv_tkg.py``, ``qkv_cte.py``,
commit d2ad3a57) chooses a token-generation or a context-encoding implementation by ``B x S``;
here one instruction stream serves both, the loop order chosen by the token count:

* **decode** (``B*S <= 128``): the normalised ``Xᵀ`` stays in SBUF and the weights stream past it
  once, in k-groups of ~8 KiB per partition on four DMA queues, each 128 x 512 weight tile a
  matmul into its own PSUM bank (tokens stationary). HBM-bound: the PE array consumes a weight
  tile in 512 cycles (213 ns), its load takes 356 ns per physical core on trn2.
* **prefill**: a column block of ``W`` stays resident while 128-token blocks go by, each
  normalised and transposed once per column block; TensorE-bound.

Per token block the prologue is :class:`~.common.RowPrologue`; per PSUM bank the evacuation adds
the bias (and, quantised, dequantises by ``in_scale * w_scale[col]``), rotates the q and k heads
(``[x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin]``, the half-split layout) on VectorE in fp32,
rounds once to the output dtype and stores the bank's heads to ``q``, ``k``, ``v``
``[B, heads, S, D]`` (GpSimd's DMA queue).

Inputs: ``x [T, H]`` (``T = B*S``), ``res [T, H]`` (``residual``), ``gamma [H]`` (``norm``),
``w_qkv [H, (NQ + 2 NKV) * D]`` (q heads, then k heads, then v heads), ``bias`` ``[(NQ+2NKV)*D]``,
``cos``/``sin [T, D/2]`` (``rope``: each token's own angles), and when ``quant="fp8"``:
``w_qkv`` in fp8 e4m3, ``w_scale [(NQ+2NKV)*D]`` fp32 and ``in_scale [1]`` fp32 (static activation
scale, NKI's STATIC quantisation). Outputs ``q``, ``k``, ``v`` and, with ``residual``, ``h = x + res``.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from ...config import ChipConfig
from ...isa import KernelError, TileAP
from ...builder.kernel import Kernel
from ..reference import default_tolerance, round_to
from ..registry import checked_dtype, register_kernel
from .common import (BANK, BOUNDS, FP8, P, Bound, Pools, RowPrologue, choice, flag, k_tiles, positive,
                     rms_rows_reference, row_vector, shard_range, shards, store_heads)
from .projection import Projection, Seg, Exchange

__all__ = ["build_qkv", "qkv_reference", "qkv_bound"]

DTYPES = ("bf16", "fp16")
PARAMS = {"norm": "rmsnorm", "eps": 1e-6, "bias": False, "rope": False, "residual": False, "quant": "none",
          "shard": "0/1"}
_NORMS = ("rmsnorm", "none")
_QUANTS = ("none", "fp8")


def _check(b: int, s: int, h: int, nq: int, nkv: int, d: int, norm: Any, eps: Any, bias: Any, rope: Any,
           residual: Any, quant: Any) -> tuple[str, float, bool, bool, bool, str]:
    positive("qkv", B=b, S=s, H=h, NQ=nq, NKV=nkv, D=d)
    norm = choice("qkv", "norm", norm, _NORMS)
    quant = choice("qkv", "quant", quant, _QUANTS)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        raise KernelError(f"qkv: eps must be a positive number, got {eps!r}")
    if BANK % d or d > P:
        raise KernelError(f"qkv: head dim D={d} must divide {BANK} and be at most {P} (a PSUM bank holds whole heads)")
    if nq % nkv:
        raise KernelError(f"qkv: NQ={nq} must be a multiple of NKV={nkv} (grouped-query attention)")
    return norm, float(eps), flag("qkv", "bias", bias), flag("qkv", "rope", rope), flag("qkv", "residual", residual), \
        quant


@register_kernel("qkv", dims="BxSxHxNQxNKVxD", dtypes=DTYPES, default_shape=(4, 1, 4096, 4, 1, 128),
                 summary="residual add + RMSNorm (+fp8) + x @ W_qkv + bias + RoPE -> q, k, v [B, heads, S, D]",
                 params=PARAMS, inputs=lambda s, d, p, g: qkv_inputs(s, d, p, g),
                 reference=lambda i, s, d, p: qkv_reference(i, s, d, p),
                 tolerance=lambda d: _tolerance(d), split=lambda s, p, n: qkv_split(s, p, n))
def build_qkv(b: int, s: int, h: int, nq: int, nkv: int, d: int, dtype: str = "bf16",
              config: ChipConfig | str = "trn2", norm: str = "rmsnorm", eps: float = 1e-6, bias: bool = False,
              rope: bool = False, residual: bool = False, quant: str = "none", shard: str = "0/1",
              name: str = "qkv") -> Kernel:
    """``shard="i/n"`` (decode, ``B*S <= 128``): what physical core ``i`` of an LNC=``n`` logical
    core runs (:func:`qkv_split`, the NKI library's ``qkv_tkg`` H sharding): the prologue (the
    norm needs all of H) on every core, the projection over its share of H, the partial sums
    exchanged (:class:`~.common.Exchange`), then the evacuation and stores of its share of the
    heads; only core 0 stores ``h``. Prefill is split by tokens instead. Values are checked
    unsharded (``0/1``)."""
    norm, eps, bias, rope, residual, quant = _check(b, s, h, nq, nkv, d, norm, eps, bias, rope, residual, quant)
    kern = Kernel(name, config)
    dt = checked_dtype("qkv", dtype, DTYPES)
    cfg = kern.config
    t, n = b * s, (nq + 2 * nkv) * d
    _, h1 = k_tiles("qkv", "H", h)
    head_lo, head_hi = shard_range("qkv", shard, nq + 2 * nkv)
    sharded = str(shard) != "0/1" and (head_lo, head_hi) != (0, nq + 2 * nkv)
    if sharded and t > P:
        raise KernelError(f"qkv: shard applies to decode (B*S <= {P}); B*S={t} is split by tokens")
    fp8 = quant == "fp8"
    if fp8 and not cfg.core.tensor.fp8_double_row:
        raise KernelError(f"qkv: quant=fp8 needs the fp8 double-row matmul, which {cfg.name} lacks")
    if fp8 and h1 % 2:
        raise KernelError(f"qkv: quant=fp8 contracts 256 rows per matmul; H={h} must be a multiple of 256")
    x = kern.input("x", (t, h), dt)
    res = kern.input("res", (t, h), dt) if residual else None
    gamma = kern.input("gamma", (h,), dt) if norm == "rmsnorm" else None
    w = kern.input("w_qkv", (h, n), FP8 if fp8 else dt)
    w_scale = kern.input("w_scale", (n,), "fp32") if fp8 else None
    in_scale = kern.input("in_scale", (1,), "fp32") if fp8 else None
    bias_t = kern.input("bias", (n,), dt) if bias else None
    cos = kern.input("cos", (t, d // 2), dt) if rope else None
    sin = kern.input("sin", (t, d // 2), dt) if rope else None
    outs = {"q": kern.output("q", (b, nq, s, d), dt), "k": kern.output("k", (b, nkv, s, d), dt),
            "v": kern.output("v", (b, nkv, s, d), dt)}
    h_out = kern.output("h", (t, h), dt) if residual else None

    pools = Pools(kern)
    pro = RowPrologue(kern, pools, k=h, dt=dt, x=x, res=res, h_out=h_out if head_lo == 0 else None, gamma=gamma,
                      eps=eps, in_scale=in_scale, norm=norm == "rmsnorm", tokens=t)
    tbw = min(P, t)
    # per-column factors, broadcast to the token partitions once: the bias, and quantised the
    # dequantisation scale in_scale * w_scale
    bias_b = scale_b = None
    if bias_t is not None:
        bias_b = kern.sbuf((tbw, n), dt, name="bias_b")
        row_vector(kern, bias_b, bias_t.full(), queue=7)
    if w_scale is not None:
        scale_b = kern.sbuf((tbw, n), "fp32", name="w_scale_b")
        row_vector(kern, scale_b, w_scale.full(), queue=7)
        isc = kern.sbuf((tbw, 1), "fp32", name="in_scale_b")
        kern.dma_copy(isc, in_scale.ap(0, [[0, tbw], [1, 1]]), queue=7)  # type: ignore[union-attr]
        kern.tensor_scalar(scale_b, scale_b, "multiply", isc, engine="gpsimd")

    isz = 1 if fp8 else dt.itemsize
    cap = cfg.core.sbuf.partition_bytes
    rows_bytes = 0 if t <= 32 else pro.sbuf_bytes  # the prologue's rows (the norm's only when it norms)
    fixed = rows_bytes + min(t, P) * n * (4 * fp8 + dt.itemsize * bias) // P + 24 * 1024
    k_range = None
    xchg = None
    if sharded:
        i_s, n_s = (int(v) for v in str(shard).split("/"))
        units = h1 // 2 if fp8 else h1
        lo, hi = shard_range("qkv", f"{i_s}/{n_s}", units)
        k_range = (lo * 2, hi * 2) if fp8 else (lo, hi)
        xchg = Exchange(kern, pools)

    def make_passes(width: int) -> list[list[Seg]]:
        return [[Seg(w, 0, n, c, min(width, n - c))] for c in range(0, n, width)]

    proj = Projection(kern, pools, k1=h1, tokens=t, prologue=pro, isz=isz, make_passes=make_passes, max_width=n,
                      unit=d, budget=cap - fixed, fp8=fp8, tag="w", k_range=k_range)
    passes = proj.passes
    ev = _Evac(kern, pools, dt=dt, d=d, nq=nq, nkv=nkv, s=s, outs=outs, bias_b=bias_b, scale_b=scale_b,
               cos=cos, sin=sin)
    if proj.stream:
        ev.rope_rows(0, t)

    own_lo, own_hi = head_lo * d, head_hi * d

    def evac(pi: int, t0: int, tb: int, accs: list[list[TileAP]]) -> None:
        ev.rope_rows(t0, tb)
        sg = passes[pi][0]
        for j, acc in enumerate(accs[0]):
            c, w = sg.c0 + j * BANK, min(BANK, sg.cw - j * BANK)
            a, z = max(c, own_lo), min(c + w, own_hi)
            if a < z:
                bank = acc[:, :w]
                part = xchg.add_peer(bank, a - c, z - c) if xchg is not None else bank[:, a - c:z - c]
                ev.bank(part, t0, tb, a)

    proj.run(evac)
    return kern


class _Evac:
    """The evacuation of one PSUM bank of qkv output: dequantise, bias, RoPE, round, store."""

    def __init__(self, kern: Kernel, pools: Pools, *, dt: Any, d: int, nq: int, nkv: int, s: int,
                 outs: Mapping[str, Any], bias_b: TileAP | None, scale_b: TileAP | None, cos: Any, sin: Any):
        self.kern, self.pools, self.dt, self.d, self.nq, self.nkv, self.s = kern, pools, dt, d, nq, nkv, s
        self.outs, self.bias_b, self.scale_b, self.cos, self.sin = outs, bias_b, scale_b, cos, sin
        self.cs: TileAP | None = None
        self.cs_of = -1
        self.flip = 0

    def rope_rows(self, t0: int, tb: int) -> None:
        """cos and sin of token block ``t0`` (loaded once per block)."""
        if self.cos is None or self.cs_of == t0:
            return
        half = self.d // 2
        cs = self.pools("cs", 2).tile((P, 2, half), self.dt)[:tb]
        self.kern.dma_copy(cs[:, 0, :], self.cos[t0:t0 + tb, :], queue=6)
        self.kern.dma_copy(cs[:, 1, :], self.sin[t0:t0 + tb, :], queue=6)
        self.cs, self.cs_of = cs, t0

    def bank(self, acc: TileAP, t0: int, tb: int, c0: int) -> None:
        kern, d = self.kern, self.d
        w = acc.free_size
        h_lo, h_hi = c0 // d, (c0 + w) // d
        n_rope = 0
        if self.cs is not None:
            n_rope = max(0, min(h_hi, self.nq + self.nkv) - h_lo)
        src = acc
        if self.scale_b is not None or self.bias_b is not None or n_rope:
            # out of PSUM into fp32 SBUF (ScalarE, else idle), dequantised and biased on the way,
            # so VectorE and GpSimd (which cannot read PSUM) can share the rotation
            e = self.pools("e", 2).tile((P, BANK), "fp32")[:tb, :w]
            if self.scale_b is not None:
                kern.tensor_tensor(e, acc, self.scale_b[:tb, c0:c0 + w], "multiply")
                if self.bias_b is not None:
                    kern.tensor_tensor(e, e, self.bias_b[:tb, c0:c0 + w], "add")
            elif self.bias_b is not None:
                kern.tensor_tensor(e, acc, self.bias_b[:tb, c0:c0 + w], "add")
            elif acc.space == "sbuf":
                e = acc  # already out of PSUM (the LNC exchange's sum)
            else:
                kern.activation(e, "copy", acc)
            src = e
        o = self.pools("o", 3).tile((P, BANK), self.dt)[:tb, :w]
        if n_rope:
            self._rope(src[:, :n_rope * d], o[:, :n_rope * d], n_rope)
        if n_rope < h_hi - h_lo:
            eng = "scalar" if self.flip % 2 else "vector"
            self.flip += 1
            kern.tensor_copy(o[:, n_rope * d:], src[:, n_rope * d:], engine=eng)
        o3 = TileAP(o.alloc, o.p_start, tb, o.offset, ((d, h_hi - h_lo), (1, d)), o.dtype)
        # the bank's heads by output: q [0, NQ), k [NQ, NQ+NKV), v after; each on its own queue
        bounds = (("q", 0, self.nq), ("k", self.nq, self.nq + self.nkv), ("v", self.nq + self.nkv, self.nq + 2 * self.nkv))
        for qi, (nm, lo, hi) in enumerate(bounds):
            a, z = max(lo, h_lo), min(hi, h_hi)
            if a < z:
                store_heads(kern, self.outs[nm], o3[:, a - h_lo:z - h_lo, :], t0, tb, a - lo, z - a, self.s,
                            queue=2 + qi)

    def _rope(self, src: TileAP, o: TileAP, nh: int) -> None:
        """``o = [x1 cos - x2 sin, x2 cos + x1 sin]`` per head: fp32 products, one rounding; the
        first half on VectorE, the second on GpSimd."""
        kern, d = self.kern, self.d
        half = d // 2
        cs = self.cs
        assert cs is not None
        tb = src.p_count

        def heads(ap: TileAP, off: int) -> TileAP:
            return TileAP(ap.alloc, ap.p_start, tb, ap.offset + off, ((d, nh), (1, half)), ap.dtype)

        def angles(k: int) -> TileAP:
            return TileAP(cs.alloc, cs.p_start, tb, cs.offset + k * half, ((0, nh), (1, half)), cs.dtype)

        def scratch(nm: str) -> TileAP:
            t = self.pools(nm, 2).tile((P, BANK // 2), "fp32")
            return TileAP(t.alloc, t.p_start, tb, t.offset, ((half, nh), (1, half)), t.dtype)

        x1, x2, o1, o2 = heads(src, 0), heads(src, half), heads(o, 0), heads(o, half)
        c, s = angles(0), angles(1)
        for (dst, ca, cb, op), eng, tag in (((o1, x1, x2, "subtract"), "vector", "ra"), ((o2, x2, x1, "add"), "gpsimd", "rb")):
            a, b = scratch(tag + "0"), scratch(tag + "1")
            kern.tensor_tensor(a, ca, c, "multiply", engine=eng)
            kern.tensor_tensor(b, cb, s, "multiply", engine=eng)
            kern.tensor_tensor(dst, a, b, op, engine=eng)


def qkv_split(shape: tuple[int, ...], params: Mapping[str, Any], n: int) -> list[Any] | None:
    """LNC=2: decode shares H between the physical cores (each reads its rows of ``W_qkv``, the
    bytes decode is bound by, once per logical core; ``shard``), prefill shares the tokens (the
    batch, or the sequence of one)."""
    b, s, h, nq, nkv, d = shape
    if str(params.get("shard", "0/1")) != "0/1":
        return None
    if b * s <= P:
        units = h // P // (2 if params.get("quant") == "fp8" else 1)
        return [(shape, sh) for sh in shards(n)] if units >= n and nq + 2 * nkv >= n else None
    if b >= n:
        return [(b // n + (1 if i < b % n else 0), s, h, nq, nkv, d) for i in range(n)]
    if s >= n:
        return [(b, s // n + (1 if i < s % n else 0), h, nq, nkv, d) for i in range(n)]
    return None


# ---------------------------------------------------------------------------------------------
# Inputs, reference, tolerance, bound
# ---------------------------------------------------------------------------------------------


def rope_angles(t: int, d: int, rng: np.random.Generator, theta: float = 10000.0) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin [t, d/2] of random token positions (the half-split RoPE of Llama)."""
    pos = rng.integers(0, 4096, size=t).astype(np.float64)
    inv = theta ** (-np.arange(0, d // 2, dtype=np.float64) * 2.0 / d)
    ang = pos[:, None] * inv[None, :]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def qkv_inputs(shape: tuple[int, ...], dtype: str, params: Mapping[str, Any], rng: np.random.Generator
               ) -> dict[str, np.ndarray]:
    b, s, h, nq, nkv, d = shape
    t, n = b * s, (nq + 2 * nkv) * d
    out = {"x": rng.standard_normal((t, h), dtype=np.float32)}
    if params.get("residual"):
        out["res"] = rng.standard_normal((t, h), dtype=np.float32)
    if params.get("norm", "rmsnorm") == "rmsnorm":
        out["gamma"] = (1.0 + 0.25 * rng.standard_normal(h)).astype(np.float32)
    if params.get("quant", "none") == "fp8":
        out["w_qkv"] = rng.standard_normal((h, n), dtype=np.float32) * 16.0
        out["w_scale"] = (rng.uniform(0.5, 1.5, n) / (16.0 * np.sqrt(h))).astype(np.float32)
        out["in_scale"] = np.array([1.0 / 32.0], dtype=np.float32)
    else:
        out["w_qkv"] = (rng.standard_normal((h, n)) / np.sqrt(h)).astype(np.float32)
    if params.get("bias"):
        out["bias"] = (0.1 * rng.standard_normal(n)).astype(np.float32)
    if params.get("rope"):
        out["cos"], out["sin"] = rope_angles(t, d, rng)
    return out


def rope_reference(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """``x [T, heads, D]`` rotated with per-token ``cos``/``sin [T, D/2]`` (half-split layout)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def qkv_reference(inputs: Mapping[str, np.ndarray], shape: tuple[int, ...], dtype: str,
                  params: Mapping[str, Any]) -> dict[str, np.ndarray]:
    b, s, h, nq, nkv, d = shape
    p = {**PARAMS, **params}
    t = b * s
    x = round_to(inputs["x"], dtype)
    out: dict[str, np.ndarray] = {}
    if p["residual"]:
        x = round_to(x + round_to(inputs["res"], dtype), dtype)
        out["h"] = x
    fp8 = p["quant"] == "fp8"
    gamma = round_to(inputs["gamma"], dtype) if p["norm"] == "rmsnorm" else np.ones(h)
    y = rms_rows_reference(x, p["eps"], dtype) if p["norm"] == "rmsnorm" else x
    if fp8:
        g = gamma.astype(np.float32) * np.float32(1.0 / np.float32(inputs["in_scale"][0]))
        xn = round_to(y * g.astype(np.float64), FP8)
        acc = xn @ round_to(inputs["w_qkv"], FP8)
        acc = acc * (np.float64(np.float32(inputs["in_scale"][0])) * inputs["w_scale"].astype(np.float64))
    else:
        xn = round_to(y * gamma, dtype) if p["norm"] == "rmsnorm" else y
        acc = xn @ round_to(inputs["w_qkv"], dtype)
    if p["bias"]:
        acc = acc + round_to(inputs["bias"], dtype)
    heads = acc.reshape(t, nq + 2 * nkv, d)
    if p["rope"]:
        cos, sin = round_to(inputs["cos"], dtype), round_to(inputs["sin"], dtype)
        heads = heads.copy()
        heads[:, :nq + nkv] = rope_reference(heads[:, :nq + nkv], cos, sin)
    heads = round_to(heads, dtype)

    def split(lo: int, hi: int) -> np.ndarray:
        return heads[:, lo:hi].reshape(b, s, hi - lo, d).transpose(0, 2, 1, 3)

    out["q"], out["k"], out["v"] = split(0, nq), split(nq, nq + nkv), split(nq + nkv, nq + 2 * nkv)
    return out


def _tolerance(dtype: str) -> tuple[float, float]:
    rtol, atol = default_tolerance(dtype)
    return rtol, atol


def qkv_bound(shape: tuple[int, ...], dtype: str, params: Mapping[str, Any]) -> Bound:
    """Compulsory HBM traffic (activations in and out once, weights once) and matmul FLOPs."""
    b, s, h, nq, nkv, d = shape
    p = {**PARAMS, **params}
    t, n = b * s, (nq + 2 * nkv) * d
    isz = 2
    wsz = 1 if p["quant"] == "fp8" else isz
    bytes_ = t * h * isz * (3 if p["residual"] else 1) + h * n * wsz + t * n * isz
    bytes_ += (t * d * isz if p["rope"] else 0) + (h * isz if p["norm"] == "rmsnorm" else 0)
    flops = 2 * t * h * n
    return Bound(bytes_, 0 if p["quant"] == "fp8" else flops, flops if p["quant"] == "fp8" else 0)


BOUNDS["qkv"] = qkv_bound
