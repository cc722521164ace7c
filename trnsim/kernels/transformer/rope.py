"""``rope``: rotary position embedding as its own kernel (the NKI library's ``RoPE``,
``nkilib/core/embeddings/rope.py``, commit d2ad3a57), for q or k heads that did not get it fused
into the QKV projection (``qkv`` with ``rope``).

``out = [x1 cos - x2 sin, x2 cos + x1 sin]`` per head (the half-split layout: ``x1``, ``x2`` the
first and second halves of the head dim), each token with its own angles ``cos``/``sin [T, D/2]``
(``T = B*S``, token ``b*S + s``; positions differ per sequence in decode).

Layout: partition ``p`` of a block holds ``R`` consecutive tokens of one sequence for every head,
``[128, heads, R, D]``, so each partition reads one run of ``R x D`` elements per head (R up to 8:
2 KiB per run at D = 128 bf16) and one run of angles shared by all heads. The six products and
sums run on VectorE in the model dtype (its 2x bf16 mode), each rounded as the datapath rounds
it: ``round(round(x1 c) - round(x2 s))``; the block is stored back the way it came. HBM-bound.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from ...config import ChipConfig
from ...isa import KernelError, TileAP
from ...builder.kernel import Kernel
from ..reference import round_to
from ..registry import checked_dtype, register_kernel
from .common import BOUNDS, P, Bound, Pools, positive

__all__ = ["build_rope", "rope_kernel_reference", "rope_bound"]

DTYPES = ("bf16", "fp16")


@register_kernel("rope", dims="BxHxSxD", dtypes=DTYPES, default_shape=(1, 32, 2048, 128),
                 summary="rotary position embedding of x [B, heads, S, D] with per-token cos/sin [B*S, D/2]",
                 inputs=lambda s, d, p, g: rope_inputs(s, d, p, g),
                 reference=lambda i, s, d, p: rope_kernel_reference(i, s, d, p),
                 split=lambda s, p, n: rope_split(s, p, n))
def build_rope(b: int, h: int, s: int, d: int, dtype: str = "bf16", config: ChipConfig | str = "trn2",
               name: str = "rope") -> Kernel:
    positive("rope", B=b, H=h, S=s, D=d)
    if d % 2:
        raise KernelError(f"rope: head dim D={d} must be even (pairs of elements rotate)")
    kern = Kernel(name, config)
    dt = checked_dtype("rope", dtype, DTYPES)
    half = d // 2
    x = kern.input("x", (b, h, s, d), dt)
    cos = kern.input("cos", (b * s, half), dt)
    sin = kern.input("sin", (b * s, half), dt)
    out = kern.output("out", (b, h, s, d), dt)
    cap = kern.config.core.sbuf.partition_bytes
    room = cap - 16 * 1024

    def need(r: int) -> int:  # a partition's bytes of every pool _block takes at r tokens a partition:
        return dt.itemsize * r * d * (8 * h + 3)  # x and o (3 bufs each), cos/sin (3), ta and tb (2 each)

    # tokens per partition: up to 8 (2 KiB runs), a divisor of S, within the block buffers
    r = 1
    while r < 8 and s % (2 * r) == 0 and s // (2 * r) >= P // 2 and 3 * h * 2 * r * d * dt.itemsize <= cap // 2 \
            and need(2 * r) <= room:
        r *= 2
    if need(r) > room:
        raise KernelError(f"rope: {h} heads x D={d} per token do not fit SBUF on {kern.config.name}")
    pools = Pools(kern)
    if s == 1:  # decode: one token per sequence, the sequences on the partitions
        for b0 in range(0, b, P):
            _block(kern, pools, x, cos, sin, out, b0, 0, min(P, b - b0), 1, h, s, d, dt)
        return kern
    for bi in range(b):
        for s0 in range(0, s, P * r):  # r divides S: the last block has fewer partitions, never a part
            _block(kern, pools, x, cos, sin, out, bi, s0, min(P, (s - s0) // r), r, h, s, d, dt)
    return kern


def _block(kern: Kernel, pools: Pools, x: Any, cos: Any, sin: Any, out: Any, bi: int, s0: int, np_: int, r: int,
           h: int, s: int, d: int, dt: Any) -> None:
    """Tokens ``s0 .. s0 + np_*r`` of sequence ``bi``: ``r`` per partition, every head."""
    half = d // 2
    xt = pools(f"x{r}", 3).tile((P, h, r, d), dt)[:np_]
    base = (bi * h * s + s0) * d
    # partition p: tokens s0 + p*r .. + r of every head (S = 1: sequence bi + p)
    pstride = h * d if s == 1 else r * d
    hbm = [[pstride, np_], [s * d, h], [d, r], [1, d]]
    kern.dma_copy(xt, x.ap(base, hbm), queue=0)
    cs = pools(f"cs{r}", 3).tile((P, 2, r, half), dt)[:np_]
    t0 = bi * s + s0
    t0 = bi if s == 1 else t0
    for k, src in enumerate((cos, sin)):
        kern.dma_copy(cs[:, k], src.ap(t0 * half, [[r * half, np_], [half, r], [1, half]]), queue=1)
    o = pools(f"o{r}", 3).tile((P, h, r, d), dt)[:np_]

    def part(t: TileAP, off: int) -> TileAP:  # [np_, h, r, D/2] at element off of each head row
        return TileAP(t.alloc, t.p_start, np_, t.offset + off, ((r * d, h), (d, r), (1, half)), t.dtype)

    def ang(k: int) -> TileAP:  # cos (k=0) or sin (k=1), broadcast over the heads
        return TileAP(cs.alloc, cs.p_start, np_, cs.offset + k * r * half, ((0, h), (half, r), (1, half)), cs.dtype)

    x1, x2, o1, o2 = part(xt, 0), part(xt, half), part(o, 0), part(o, half)
    ta = pools(f"ta{r}", 2).tile((P, h, r, half), dt)[:np_]
    tb = pools(f"tb{r}", 2).tile((P, h, r, half), dt)[:np_]
    for dst, a, bb, op in ((o1, x1, x2, "subtract"), (o2, x2, x1, "add")):
        kern.tensor_tensor(ta, a, ang(0), "multiply")
        kern.tensor_tensor(tb, bb, ang(1), "multiply")
        kern.tensor_tensor(dst, ta, tb, op)
    kern.dma_copy(out.ap(base, hbm), o, engine="gpsimd", queue=2)


def rope_split(shape: tuple[int, ...], params: Mapping[str, Any], n: int) -> list[tuple[int, ...]] | None:
    """LNC=2: the physical cores take half the heads (or half the sequences)."""
    b, h, s, d = shape
    if h >= n:
        return [(b, h // n + (1 if i < h % n else 0), s, d) for i in range(n)]
    if b >= n:
        return [(b // n + (1 if i < b % n else 0), h, s, d) for i in range(n)]
    return None


def rope_inputs(shape: tuple[int, ...], dtype: str, params: Mapping[str, Any], rng: np.random.Generator
                ) -> dict[str, np.ndarray]:
    from .qkv import rope_angles

    b, h, s, d = shape
    c, sn = rope_angles(b * s, d, rng)
    return {"x": rng.standard_normal((b, h, s, d), dtype=np.float32), "cos": c, "sin": sn}


def rope_kernel_reference(inputs: Mapping[str, np.ndarray], shape: tuple[int, ...], dtype: str,
                          params: Mapping[str, Any]) -> dict[str, np.ndarray]:
    b, h, s, d = shape
    half = d // 2
    x = round_to(inputs["x"], dtype)
    c = round_to(inputs["cos"], dtype).reshape(b, 1, s, half)
    sn = round_to(inputs["sin"], dtype).reshape(b, 1, s, half)
    x1, x2 = x[..., :half], x[..., half:]
    r = lambda a: round_to(a, dtype)  # noqa: E731
    o1 = r(r(x1 * c) - r(x2 * sn))
    o2 = r(r(x2 * c) + r(x1 * sn))
    return {"out": np.concatenate([o1, o2], axis=-1)}


def rope_bound(shape: tuple[int, ...], dtype: str, params: Mapping[str, Any]) -> Bound:
    b, h, s, d = shape
    return Bound(2 * (2 * b * h * s * d + b * s * d), 0)


BOUNDS["rope"] = rope_bound
