"""What the transformer kernels share: argument checks, the token-row prologue (residual add,
RMSNorm, FP8 quantisation, PE transposes), weight streaming and the TensorE projection loop,
and the bound each kernel is measured against.

Layouts (the contract of :mod:`trnsim.kernels.transformer`):

* token rows ``x[T, H]``, ``T = B * S`` in (batch, position) order;
* a contraction dim ``K`` (H, I, heads x D) is read with ``k = p * K1 + j`` (partition ``p``,
  ``K1 = K / 128``): a weight's rows for one partition are then ``K1`` consecutive rows of
  ``W[K, N]``, one contiguous run per partition per load (the NKI library's "H0/H1" layout,
  ``qkv_tkg``'s ``hidden [H0, BxS, H1]``), and the activations' PE transposes read every ``K1``-th
  column. ``K`` must be a multiple of 128, as the library kernels require.

A projection ``out[T, N] = X[T, K] @ W[K, N]`` runs with the tokens stationary (``Xᵀ [128, tb]``
per k-tile, ``tb <= 128`` tokens) and 512-column weight tiles moving through one PSUM bank each
(``max(64, N)`` PE cycles per 128 x 512 weights): in decode the weights stream once past a
resident ``Xᵀ``; in prefill a column block of the weights stays resident while token blocks go
by (:func:`weight_blocks`).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

import numpy as np

from ...isa import HbmAP, HbmTensor, KernelError, TileAP
from ...builder.kernel import Kernel, TilePool
from ...native.dtypes import Dtype, get_dtype
from ..reference import round_to
from .bounds import BOUNDS, Bound, Measured, bound_fraction, measure  # the bounds' own module; re-exported

__all__ = ["P", "BANK", "flag", "choice", "positive", "k_tiles", "bcast", "xT_view", "Pools", "RowPrologue",
           "weight_blocks", "load_weights", "matmul_tokens", "Bound", "bound_fraction", "store_heads",
           "rms_rows_reference", "FP8", "fp8_max", "HBM_Q", "row_vector", "shard_range", "shards", "weight_group", "XT", "DMA_T",
           "BOUNDS", "Measured", "measure"]

P = 128          # partitions
BANK = 512       # fp32 columns of one PSUM bank (moving free size of one matmul on NC-v3)
FP8 = "float8_e4m3"
HBM_Q = (0, 1, 2, 3)  # DMA queues the weight loads rotate over (loads on several queues overlap their start latency)


# ---------------------------------------------------------------------------------------------
# Argument checks (one line naming the kernel, the argument and what it takes)
# ---------------------------------------------------------------------------------------------


def flag(kernel: str, name: str, value: Any) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise KernelError(f"{kernel}: {name} must be true or false, got {value!r}")
    return bool(value)


def choice(kernel: str, name: str, value: Any, options: Sequence[str]) -> str:
    if not isinstance(value, str) or value.lower() not in options:
        raise KernelError(f"{kernel}: {name} must be one of {', '.join(options)}, got {value!r}")
    return value.lower()


def positive(kernel: str, **dims: Any) -> None:
    for nm, v in dims.items():
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise KernelError(f"{kernel}: {nm} must be a positive integer, got {v!r}")


def k_tiles(kernel: str, name: str, k: int) -> tuple[int, int]:
    """How a contraction dim ``K`` sits on the partitions: ``(kp, K1)`` with ``K = kp * K1``,
    ``kp <= 128`` partitions and ``K1`` k-tiles (``k = p * K1 + j``), the fewest tiles that
    divide ``K`` evenly (448 = 112 x 4: Llama-3.1-70B's I at TP=64), or a one-line error."""
    lo = -(-k // P)
    for k1 in range(lo, 2 * lo + 1):
        if k % k1 == 0:
            return k // k1, k1
    raise KernelError(f"{kernel}: {name}={k} cannot be laid out on the PE array's {P} partitions (no split "
                      f"K = partitions x tiles with at most {P} partitions and up to {2 * lo} tiles); use a "
                      f"multiple of {P}")


def shard_range(kernel: str, shard: Any, units: int) -> tuple[int, int]:
    """The units ``[lo, hi)`` share ``"i/n"`` of ``units`` takes (near-equal, the first ones one
    larger): an LNC=2 core's share of an output's columns (heads, 128-column tiles)."""
    try:
        i_s, n_s = str(shard).split("/")
        i, n = int(i_s), int(n_s)
        ok = 0 <= i < n
    except ValueError:
        ok = False
    if not ok:
        raise KernelError(f"{kernel}: shard must be 'i/n' with 0 <= i < n (this core's share of the output), "
                          f"got {shard!r}")
    if n > units:
        raise KernelError(f"{kernel}: shard {shard}: {units} units cannot be shared by {n} cores")
    q, r = divmod(units, n)
    lo = i * q + min(i, r)
    return lo, lo + q + (1 if i < r else 0)


def shards(n: int) -> list[dict[str, str]]:
    return [{"shard": f"{i}/{n}"} for i in range(n)]


def fp8_max(name: str = FP8) -> float:
    import ml_dtypes

    return float(ml_dtypes.finfo(get_dtype(name).np_dtype).max)


# ---------------------------------------------------------------------------------------------
# Views
# ---------------------------------------------------------------------------------------------


def bcast(ap: TileAP, n: int) -> TileAP:
    """``ap`` with a stride-0 innermost dim of ``n`` appended: each element repeated ``n`` times
    along the free axis (a per-column value over a block of rows of another operand)."""
    return TileAP(ap.alloc, ap.p_start, ap.p_count, ap.offset, tuple(ap.dims) + ((0, n),), ap.dtype)


def online_max(kern: Kernel, pools: "Pools", red: TileAP, m_old: TileAP, n: int, keys: int, parts: int,
               scale: float, *, tr_pool: str, m_bufs: int) -> tuple[TileAP, TileAP, TileAP]:
    """One chunk's step of the online softmax's running maximum (flash decoding). ``red`` [keys, n]
    holds the chunk's per-partition maxima; one PE transpose to [n, keys] and a reduce give the
    chunk's maximum, ``m = max(m_old, it)``, and ``alpha = exp(scale (m_old - m))`` is the rescale
    of what the earlier chunks summed. Both are broadcast over the partitions by transposing them
    repeated along the free axis (a stride-0 view, one PE instruction each): returns ``m``,
    ``mb`` [keys, n] (to subtract from the scores) and ``ab`` [parts, n] (to rescale o and l)."""
    tr = pools(tr_pool, 1, "psum").tile((P, 2 * P), "fp32")[:n, :keys]
    kern.nc_transpose(tr, red)
    m_new = pools("m", m_bufs).tile((P, 1), "fp32")[:n]
    kern.tensor_reduce(m_new, "max", tr, axis=1)
    kern.tensor_tensor(m_new, m_new, m_old, "max")
    nm = pools("nm", 2).tile((P, 1), "fp32")[:n]
    kern.tensor_scalar(nm, m_new, "multiply", -scale)
    alpha = pools("alpha", 2).tile((P, 1), "fp32")[:n]
    kern.activation(alpha, "exp", m_old, scale=scale, bias=nm)
    bc = pools("bcast", 1, "psum").tile((P, 2 * P), "fp32")
    mb, ab = bc[:keys, :n], bc[:parts, P:P + n]
    kern.nc_transpose(mb, bcast(m_new, keys))
    kern.nc_transpose(ab, bcast(alpha, parts))
    return m_new, mb, ab


def online_rescale(kern: Kernel, pools: "Pools", o: TileAP, l_old: TileAP, o_alpha: TileAP, ab: TileAP,
                   o_ps: TileAP, l_ps: TileAP, n: int, *, l_bufs: int) -> TileAP:
    """``o = o * alpha + o(chunk)`` in place and ``l = l * alpha + l(chunk)`` into a new tile
    (returned); ``o_alpha`` is ``ab`` viewed over o's free dims."""
    kern.tensor_tensor(o, o, o_alpha, "multiply")
    kern.tensor_tensor(o, o, o_ps, "add")
    lr = pools("l", l_bufs).tile((1, P), "fp32")[:, :n]
    kern.tensor_tensor(lr, l_old, ab[0:1, :], "multiply")
    kern.tensor_tensor(lr, lr, l_ps, "add")
    return lr


def xT_view(rows: TileAP, j: int, k1: int, kp: int = P) -> TileAP:
    """Columns ``j, j + K1, j + 2 K1, ...`` of a ``[tb, K]`` row tile: the ``[tb, kp]`` block
    whose transpose is k-tile ``j`` in the ``k = p * K1 + j`` layout."""
    (s, _), = rows.dims[-1:]
    base = rows.offset + j * s
    return TileAP(rows.alloc, rows.p_start, rows.p_count, base, ((s * k1, kp),), rows.dtype)


def row_vector(kern: Kernel, tile: TileAP, vec: HbmAP, queue: int = 1) -> None:
    """A [n] HBM vector into every partition of ``tile`` [p, n] (a stride-0 partition access)."""
    n = tile.free_size
    kern.dma_copy(tile, vec.tensor.ap(vec.offset, [[0, tile.p_count], [1, n]]), queue=queue)


# ---------------------------------------------------------------------------------------------
# Pools
# ---------------------------------------------------------------------------------------------


class Pools:
    """The tile pools a kernel's phases share, made on first use (a pool's buffers are sized by
    the first tile asked of them, so each use has its own pool name)."""

    def __init__(self, kern: Kernel):
        self.kern = kern
        self._pools: dict[str, TilePool] = {}

    def __call__(self, name: str, bufs: int, space: str = "sbuf") -> TilePool:
        p = self._pools.get(name)
        if p is None:
            p = self._pools[name] = self.kern.tile_pool(name, bufs=bufs, space=space)
        return p

    def release(self) -> None:
        """Free every pool's buffers (the next phase of a kernel reuses the memory; the builder
        orders its writes after the last reads of what was there)."""
        for p in self._pools.values():
            p.release()
        self._pools.clear()


# ---------------------------------------------------------------------------------------------
# The token-row prologue: rows -> (residual add) -> (RMSNorm) -> PE transposes -> Xᵀ
# ---------------------------------------------------------------------------------------------


DMA_T = 32  # token blocks this small load straight into the [128, T, K1] layout (see RowPrologue)


class XT:
    """``Xᵀ`` of one token block in SBUF: ``[128, K1, tb]`` (PE-transposed rows) or, token-major,
    ``[128, tb, K1]`` (loaded by DMA in that layout: ``x[t, p*K1 + j]`` at ``[p, t, j]``)."""

    def __init__(self, tile: TileAP, tb: int, tmajor: bool):
        self.tile, self.tb, self.tmajor = tile, tb, tmajor

    @property
    def k1(self) -> int:
        return self.tile.shape[2] if self.tmajor else self.tile.shape[1]

    def st(self, j: int, fp8: bool = False) -> TileAP:
        """k-tile ``j`` as a matmul's stationary ``[128, tb]`` (fp8: k-tiles j, j+1 as ``[128, 2, tb]``)."""
        t, tb = self.tile, self.tb
        if not self.tmajor:
            return t[:, j:j + 2, :tb] if fp8 else t[:, j, :tb]
        k1 = t.shape[2]
        dims = ((1, 2), (k1, tb)) if fp8 else ((k1, tb),)
        return TileAP(t.alloc, t.p_start, t.p_count, t.offset + j, dims, t.dtype)


class RowPrologue:
    """Turns token rows ``x[t0:t0+tb, :K]`` into :class:`XT` for the projections: residual add
    (the sum stored as the new residual stream ``h_out``), RMSNorm, FP8 quantisation.

    ``xnᵀ = round(round(x * rstd) * gamma)`` (quantising: ``round_fp8(round(x * rstd) * gamma /
    in_scale)``), ``rstd = (mean(x²) + eps)^-1/2``. Two layouts, by token count:

    * decode (``tb <= 32``, NKI's TKG layout ``[H0, BxS, H1]``): one DMA loads ``x`` straight into
      ``[128, tb, K1]``; the norm runs there: ScalarE squares, VectorE sums each token's ``K1``
      squares per partition, one fp32 matmul with a 128 x 128 ones matrix sums over the
      partitions and broadcasts the total to every partition, VectorE makes rstd and scales;
    * prefill: the rows are loaded as ``[tb, K]``; ScalarE takes each row's sum of squares in one
      pass, VectorE ``y = x * rstd`` (bf16, its 4x copy mode), TensorE transposes 128 columns at a
      time (``k = p*K1 + j``) and the evacuation from PSUM multiplies by gamma (a per-partition
      factor in that layout).
    """

    def __init__(self, kern: Kernel, pools: Pools, *, k: int, dt: Dtype, x: HbmTensor | None,
                 res: HbmTensor | None = None, h_out: HbmTensor | None = None, gamma: HbmTensor | None = None,
                 eps: float = 1e-6, in_scale: HbmTensor | None = None, norm: bool = True, tokens: int = P + 1,
                 tag: str = "x", rows_of: Callable[[int, int], TileAP] | None = None):
        self.kern, self.pools, self.k, self.dt, self.x = kern, pools, k, dt, x
        # the layout is the kernel's, not each block's (their PSUM differs); rows that come from
        # elsewhere (``rows_of(t0, tb)``: in SBUF, or loaded another way) are PE-transposed
        self.tmajor = tokens <= DMA_T and rows_of is None
        self.rows_of = rows_of
        self.res, self.h_out, self.eps, self.tag, self.norm = res, h_out, eps, tag, norm
        self.kp, self.k1 = k_tiles(kern.name, "K", k)
        kp = self.kp
        self.quant = in_scale is not None
        self.out_dt = get_dtype(FP8) if self.quant else dt
        self.gamma_t: TileAP | None = None
        self._evac = 0
        self._ones: TileAP | None = None
        self._gamma_rows: TileAP | None = None
        self.gamma = gamma
        if gamma is not None or in_scale is not None:
            # gamma[p*K1 + j] at [p, j]: one contiguous run per partition; quantising, the factor
            # is gamma / in_scale (fp32), in_scale broadcast to every partition
            g = kern.sbuf((kp, self.k1), "fp32", name=f"{tag}_gamma")
            if gamma is not None:
                gl = kern.sbuf((kp, self.k1), dt, name=f"{tag}_gamma_in")
                kern.dma_copy(gl, gamma.ap(0, [[self.k1, kp], [1, self.k1]]), queue=7)
                kern.tensor_copy(g, gl, engine="gpsimd")
            else:
                kern.memset(g, 1.0, engine="gpsimd")
            if in_scale is not None:
                s = kern.sbuf((kp, 1), "fp32", name=f"{tag}_in_scale")
                kern.dma_copy(s, in_scale.ap(0, [[0, kp], [1, 1]]), queue=7)
                kern.reciprocal(s, s)
                kern.tensor_scalar(g, g, "multiply", s, engine="gpsimd")
            self.gamma_t = g

    @property
    def sbuf_bytes(self) -> int:
        """Bytes per partition its own buffers take (the caller's pool of results aside)."""
        isz = self.dt.itemsize
        if self.tmajor:  # loads (and residual), squares, the [128, T] statistics
            return DMA_T * self.k1 * (2 * isz * (2 + (self.res is not None)) + 4) + 4 * DMA_T * 4 + \
                self.k1 * 4 * 2 + (P * 4 if self.norm else 0)
        if self.rows_of is not None:
            return self.k1 * 8
        rows = self.k * isz * (2 + (self.res is not None) + (2 if self.norm else 0))
        return rows + (min(self.k, 4096) * isz if self.norm else 0) + self.k1 * 8

    def stage_a(self, t0: int, tb: int, pool: TilePool) -> Any:
        """Loads and the norm of token block ``[t0, t0+tb)``: the whole prologue for a decode
        block (returns its :class:`XT`), the rows ``y`` for a prefill block (see :meth:`stage_b`)."""
        if self.tmajor:
            return self._block_tmajor(t0, tb, pool)
        r = self.rows(t0, tb)
        return self.normalize(r) if self.norm else r

    def stage_b(self, state: Any, pool: TilePool) -> XT:
        """The PE transposes of a prefill block's rows (a decode block's :class:`XT` as it is)."""
        xT, steps = self.stage_b_steps(state, pool)
        for st in steps:
            st()
        return xT

    def stage_b_steps(self, state: Any, pool: TilePool) -> tuple[XT, list[Callable[[], None]]]:
        """:meth:`stage_b` as its result and the steps that make it (to be interleaved)."""
        if isinstance(state, XT):
            return state, []
        dst = pool.tile((self.kp, self.k1, P), self.out_dt)
        return XT(dst, state.p_count, False), self.transpose_steps(state, dst)

    def block(self, t0: int, tb: int, pool: TilePool) -> XT:
        """The whole prologue for one token block; the result in a tile of ``pool``."""
        return self.stage_b(self.stage_a(t0, tb, pool), pool)

    # ---- decode: the token-major layout -----------------------------------------------------
    def _tmajor_view(self, t: HbmTensor, t0: int, tb: int) -> HbmAP:
        return t.ap(t0 * self.k, [[self.k1, self.kp], [self.k, tb], [1, self.k1]])

    def _block_tmajor(self, t0: int, tb: int, pool: TilePool) -> XT:
        kern, pools, k1, kp = self.kern, self.pools, self.k1, self.kp
        assert self.x is not None
        xin = pools(f"{self.tag}_tm", 2).tile((kp, DMA_T, k1), self.dt)[:, :tb, :]
        kern.dma_copy(xin, self._tmajor_view(self.x, t0, tb), queue=4)
        if self.res is not None:
            r2 = pools(f"{self.tag}_tm_res", 2).tile((kp, DMA_T, k1), self.dt)[:, :tb, :]
            kern.dma_copy(r2, self._tmajor_view(self.res, t0, tb), queue=5)
            kern.tensor_tensor(xin, xin, r2, "add")
            if self.h_out is not None:
                kern.dma_copy(self._tmajor_view(self.h_out, t0, tb), xin, engine="gpsimd", queue=1)
        if self.norm:
            sq = pools(f"{self.tag}_tm_sq", 1).tile((kp, DMA_T, k1), "fp32")[:, :tb, :]
            kern.activation(sq, "square", xin)
            red = pools(f"{self.tag}_tm_red", 2).tile((kp, DMA_T), "fp32")[:, :tb]
            kern.tensor_reduce(red, "add", sq, axis=2)
            if self._ones is None:
                self._ones = kern.sbuf((kp, kp), "fp32", name=f"{self.tag}_ones")
                kern.memset(self._ones, 1.0, engine="gpsimd")
            ps = pools("tr_psum", 2, "psum").tile((P, DMA_T), "fp32")[:kp, :tb]  # shares the transposes' banks
            kern.nc_matmul(ps, self._ones, red)  # every partition: the token's sum over all K
            rstd = pools(f"{self.tag}_tm_rstd", 2).tile((kp, DMA_T), "fp32")[:, :tb]
            kern.tensor_scalar(rstd, ps, "multiply", 1.0 / self.k, op1="add", operand1=self.eps)
            kern.tensor_scalar(rstd, rstd, "power", -0.5)
            # y into a buffer of its own: the store of h (behind the weights' loads on the DMA
            # queues) may still be reading the sum
            y = pools(f"{self.tag}_tm_y", 2).tile((kp, DMA_T, k1), self.dt)[:, :tb, :]
            kern.tensor_tensor(y, xin, bcast(rstd, k1), "multiply")
            xin = y
        if self.gamma_t is None:
            return XT(xin, tb, True)
        dst = pool.tile((kp, DMA_T, k1), self.out_dt)[:, :tb, :]
        g = self.gamma_t
        kern.tensor_tensor(dst, xin, TileAP(g.alloc, g.p_start, kp, g.offset, ((0, tb), (1, k1)), g.dtype), "multiply")
        return XT(dst, tb, True)

    # ---- prefill: rows and PE transposes ----------------------------------------------------
    def rows(self, t0: int, tb: int) -> TileAP:
        """Load token rows ``[t0, t0 + tb)`` (with the residual added and stored)."""
        if self.rows_of is not None:
            return self.rows_of(t0, tb)
        kern, pools, k = self.kern, self.pools, self.k
        assert self.x is not None
        r = pools(f"{self.tag}_rows", 2).tile((P, k), self.dt)[:tb]
        kern.dma_copy(r, self.x[t0:t0 + tb, :], queue=4)
        if self.res is not None:
            r2 = pools(f"{self.tag}_res", 1).tile((P, k), self.dt)[:tb]
            kern.dma_copy(r2, self.res[t0:t0 + tb, :], queue=5)
            kern.tensor_tensor(r, r, r2, "add")
            if self.h_out is not None:  # the norm reads the sum meanwhile (its result has a buffer of its own)
                kern.dma_copy(self.h_out[t0:t0 + tb, :], r, engine="gpsimd", queue=1)
        return r

    def normalize(self, r: TileAP) -> TileAP:
        """``y = round(x * rstd)`` into a buffer of its own (rstd from a ScalarE sum of squares;
        the product on VectorE, bf16 in and out: its 4x mode); gamma is applied as the
        transposes leave PSUM."""
        kern, pools = self.kern, self.pools
        tb = r.p_count
        scratch = pools(f"{self.tag}_sq", 1).tile((P, min(self.k, 4096)), self.dt)
        parts = pools(f"{self.tag}_ssp", 4).tile((P, -(-self.k // 4096)), "fp32")[:tb]
        ss = pools(f"{self.tag}_ss", 4).tile((P, 1), "fp32")[:tb]
        n_chunks = -(-self.k // 4096)
        if n_chunks == 1:
            kern.activation(scratch[:tb, :self.k], "square", r, reduce_op="add", reduce_res=ss)
        else:
            for c in range(n_chunks):
                lo, hi = c * 4096, min(self.k, (c + 1) * 4096)
                kern.activation(scratch[:tb, :hi - lo], "square", r[:, lo:hi], reduce_op="add",
                                reduce_res=parts[:, c:c + 1])
            kern.tensor_reduce(ss, "add", parts, axis=1)
        kern.tensor_scalar(ss, ss, "multiply", 1.0 / self.k, op1="add", operand1=self.eps)
        kern.tensor_scalar(ss, ss, "power", -0.5)
        y = pools(f"{self.tag}_y", 2).tile((P, self.k), self.dt)[:tb]
        kern.tensor_scalar(y, r, "multiply", ss)
        return y

    def transpose(self, r: TileAP, dst: TileAP) -> None:
        """``dst [128, K1, tb]`` = the transposed rows times gamma (see :meth:`transpose_steps`)."""
        for step in self.transpose_steps(r, dst):
            step()

    def transpose_steps(self, r: TileAP, dst: TileAP) -> list[Callable[[], None]]:
        """The transposes into ``dst [128, K1, tb]``, one PSUM bank of them per step, times gamma
        (quantising: gamma / in_scale, into fp8), a per-partition factor of each k-tile: the
        evacuations alternate VectorE (a bank of k-tiles against gamma broadcast along the
        tokens) and ScalarE (one activation per k-tile, gamma its per-partition scale). The
        steps are for a caller to interleave with other TensorE work (:class:`Projection`
        spreads them over the previous block's matmuls, so each bank has time to be evacuated)."""
        kern, pools = self.kern, self.pools
        tb, k1 = r.p_count, self.k1
        g = max(1, min(k1, 2048 // (tb * r.dtype.itemsize)))  # transposes per PSUM bank
        ps_pool = pools("tr_psum", 2, "psum")
        gam = self.gamma_t

        def step(j0: int) -> None:
            n = min(g, k1 - j0)
            ps = ps_pool.tile((P, g, tb), r.dtype)[:self.kp]
            kern.nc_transpose_many([(ps[:, i, :], xT_view(r, j0 + i, k1, self.kp)) for i in range(n)])
            d = dst[:, j0:j0 + n, :tb]
            vector = self._evac % 2 == 0
            self._evac += 1
            if gam is None:
                kern.tensor_copy(d, ps[:, :n, :], engine="vector" if vector else "scalar")
            elif vector:
                kern.tensor_tensor(d, ps[:, :n, :], bcast(gam[:, j0:j0 + n], tb), "multiply")
            else:
                for i in range(n):
                    kern.activation(dst[:, j0 + i, :tb], "copy", ps[:, i, :], scale=gam[:, j0 + i:j0 + i + 1])

        return [lambda j0=j0: step(j0) for j0 in range(0, k1, g)]


def rms_rows_reference(x: np.ndarray, eps: float, dtype: str) -> np.ndarray:
    """``round(x * rstd)`` as :class:`RowPrologue` computes it (rstd in float64)."""
    rstd = 1.0 / np.sqrt((x * x).mean(axis=1, keepdims=True) + eps)
    return round_to(x * rstd, dtype)


# ---------------------------------------------------------------------------------------------
# Weights and the projection loop
# ---------------------------------------------------------------------------------------------


def weight_blocks(n: int, k1: int, isz: int, budget: int, bank_cols: int = BANK, max_banks: int = 4
                  ) -> list[tuple[int, int]]:
    """Column blocks ``(c0, width)`` of an ``[K, N]`` weight: as wide as ``max_banks`` PSUM banks
    and ``budget`` bytes per partition of resident weights allow, equal-sized (whole banks where
    they can be), covering ``N``."""
    per_col = k1 * isz
    cap = max(1, min(max_banks * bank_cols, budget // per_col))
    if cap >= n:
        return [(0, n)]
    nb = -(-n // cap)
    width = -(-n // nb)
    if width > bank_cols:
        width = -(-width // bank_cols) * bank_cols  # whole banks
        width = min(width, cap) if cap >= bank_cols else width
    out, c = [], 0
    while c < n:
        out.append((c, min(width, n - c)))
        c += width
    return out


def load_weights(kern: Kernel, pool: TilePool, w: HbmTensor, base: int, k1: int, n_total: int, c0: int, cw: int,
                 group: int, queue0: int = 0, lookahead: int | None = None, k_range: tuple[int, int] | None = None,
                 kp: int = P) -> Any:
    """Columns ``[c0, c0+cw)`` of a ``[K, N]`` weight (``n_total`` columns, starting at element
    ``base``) in the ``k = p*K1 + j`` layout, as k-groups of ``group`` tiles ``(j0, [128, g, cw])``,
    each one DMA whose per-partition runs are ``g`` whole rows when ``cw == N``.

    With ``lookahead`` (streaming), a generator: each group's load is emitted ``lookahead``
    groups ahead of its use (the pool must have ``lookahead + 1`` buffers: a load then waits only
    for the readers of the group before). Without, a :class:`LazyGroups`: the groups stay
    resident (the pool holds them all) and each is loaded when first used or when the caller
    asks (:meth:`LazyGroups.load_next`), so the loads can be spread between other transfers
    (the DMA queues are served in the order transfers become ready)."""
    j_lo, j_hi = k_range or (0, k1)
    starts = list(range(j_lo, j_hi, group))

    def load(gi: int) -> tuple[int, TileAP]:
        j0 = starts[gi]
        g = min(group, j_hi - j0)
        t = pool.tile((P, group, cw), w.dtype)[:kp, :g, :]
        src = w.ap(base + j0 * n_total + c0, [[k1 * n_total, kp], [n_total, g], [1, cw]])
        kern.dma_copy(t, src, queue=HBM_Q[(queue0 + gi) % len(HBM_Q)])
        return j0, t

    if lookahead is None:
        return LazyGroups(load, len(starts))

    def gen() -> Iterable[tuple[int, TileAP]]:
        ready = [load(gi) for gi in range(min(lookahead, len(starts)))]
        for gi in range(len(starts)):
            if gi + lookahead < len(starts):
                ready.append(load(gi + lookahead))
            yield ready[gi]

    return gen()


class LazyGroups:
    """A resident weight's k-groups, each loaded (its DMA emitted) when first needed."""

    def __init__(self, load: Callable[[int], tuple[int, TileAP]], n: int):
        self._load, self.n = load, n
        self.groups: list[tuple[int, TileAP]] = []

    def load_next(self) -> bool:
        """Emit the next group's load; False when all are loaded."""
        if len(self.groups) >= self.n:
            return False
        self.groups.append(self._load(len(self.groups)))
        return True

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterable[tuple[int, TileAP]]:
        for gi in range(self.n):
            while len(self.groups) <= gi:
                self.load_next()
            yield self.groups[gi]


def weight_group(k1: int, cw: int, isz: int, target: int = 4096) -> int:
    """k-tiles per weight DMA: about ``target`` bytes per partition (a 512 KiB transfer, enough
    to run at the sustained rate), near-equal groups (the last group's matmuls are the tail
    after the last load)."""
    g = max(1, min(k1, target // max(1, cw * isz)))
    n = -(-k1 // g)
    return -(-k1 // n)


def matmul_tokens(kern: Kernel, xT: XT, groups: Iterable[tuple[int, TileAP]], accs: Sequence[TileAP],
                  cw: int, fp8: bool = False, first: bool = True) -> None:
    """``accs[b] [tb, <=512] = Σ_j xT[:, j, :tb]ᵀ @ W[:, j, bank b]`` over every k-tile of
    ``groups``: each stationary token tile serves all the banks of its row before it changes, so
    LoadStationary overlaps the previous multiply. fp8 operands contract two k-tiles per
    instruction (double row)."""
    step = 2 if fp8 else 1
    tb = xT.tb
    for j0, wt in groups:
        g = wt.shape[1]
        for jj in range(0, g, step):
            j = j0 + jj
            pairs = []
            for b, acc in enumerate(accs):
                c, w = b * BANK, min(BANK, cw - b * BANK)
                mv = wt[:, jj:jj + 2, c:c + w] if fp8 else wt[:, jj, c:c + w]
                pairs.append((acc[:tb, :w], mv))
            kern.nc_matmul_row(xT.st(j, fp8), pairs, accumulate=not first)
            first = False


# ---------------------------------------------------------------------------------------------
# Stores of per-head outputs
# ---------------------------------------------------------------------------------------------


def store_heads(kern: Kernel, out: HbmTensor, tile: TileAP, t0: int, tb: int, h0: int, nh: int, s: int,
                queue: int = 0) -> None:
    """Token rows ``[t0, t0+tb)`` of heads ``[h0, h0+nh)`` from ``tile [tb, nh, D]`` into
    ``out [B, n, S, D]`` (token ``t = b*S + s``): one DMA per batch the rows touch (one in all
    when ``S == 1``)."""
    _, n, _, d = out.shape
    if s == 1:
        kern.dma_copy(out.ap((t0 * n + h0) * d, [[n * d, tb], [d, nh], [1, d]]), tile, engine="gpsimd",
                      queue=queue)
        return
    t = t0
    while t < t0 + tb:
        b, si = divmod(t, s)
        m = min(s - si, t0 + tb - t)
        src = tile[t - t0:t - t0 + m]
        kern.dma_copy(out.ap(((b * n + h0) * s + si) * d, [[d, m], [s * d, nh], [1, d]]), src, engine="gpsimd",
                      queue=queue)
        t += m
