"""NKI kernels written the way NKI authors write them (the current destination-passing API and
the legacy one that returns tiles), importing trnsim.nki where a Neuron user imports
neuronxcc.nki. The tests run them for values against numpy and for cycles; the CLI test runs
them from this file (``trnsim kernel tests/nki/nki_kernels.py:tiled_matmul``)."""

import numpy as np

import trnsim.nki as nki
import trnsim.nki.isa as nisa
import trnsim.nki.language as nl


@nki.jit
def tiled_matmul(lhsT, rhs):
    """result[M, N] = lhsT[K, M].T @ rhs[K, N], K and M multiples of 128, N of 512: one PSUM
    accumulation group per output tile, written as a plain loop nest."""
    K, M = lhsT.shape
    K2, N = rhs.shape
    assert K == K2, "contraction dims differ"
    TM, TK, TN = nl.tile_size.gemm_stationary_fmax, nl.tile_size.pmax, nl.tile_size.gemm_moving_fmax
    result = nl.ndarray((M, N), dtype=lhsT.dtype, buffer=nl.shared_hbm)
    for m in nl.affine_range(M // TM):
        for n in nl.affine_range(N // TN):
            acc = nl.ndarray((TM, TN), dtype=nl.float32, buffer=nl.psum)
            for k in nl.affine_range(K // TK):
                a = nl.ndarray((TK, TM), dtype=lhsT.dtype, buffer=nl.sbuf)
                b = nl.ndarray((TK, TN), dtype=rhs.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=a, src=lhsT[k * TK:(k + 1) * TK, m * TM:(m + 1) * TM])
                nisa.dma_copy(dst=b, src=rhs[k * TK:(k + 1) * TK, n * TN:(n + 1) * TN])
                nisa.nc_matmul(dst=acc, stationary=a, moving=b)
            res = nl.ndarray((TM, TN), dtype=result.dtype, buffer=nl.sbuf)
            nisa.tensor_copy(dst=res, src=acc)
            nisa.dma_copy(dst=result[m * TM:(m + 1) * TM, n * TN:(n + 1) * TN], src=res)
    return result


@nki.jit
def tiled_matmul_legacy(lhsT, rhs):
    """The same product in the legacy style: nl.load, nl.zeros in PSUM and ``+=`` of
    nisa.nc_matmul results, nl.store."""
    K, M = lhsT.shape
    _, N = rhs.shape
    result = nl.ndarray((M, N), dtype=lhsT.dtype, buffer=nl.shared_hbm)
    for m in nl.affine_range(M // 128):
        for n in nl.affine_range(N // 512):
            acc = nl.zeros((128, 512), nl.float32, buffer=nl.psum)
            for k in nl.affine_range(K // 128):
                a = nl.load(lhsT[k * 128:(k + 1) * 128, m * 128:(m + 1) * 128])
                b = nl.load(rhs[k * 128:(k + 1) * 128, n * 512:(n + 1) * 512])
                acc += nisa.nc_matmul(a, b)
            nl.store(result[m * 128:(m + 1) * 128, n * 512:(n + 1) * 512], value=nl.copy(acc, dtype=result.dtype))
    return result


@nki.jit
def fused_softmax(x):
    """Row softmax of x[R, C], 128 rows at a time: row max, exp(x - max) with its row sum fused
    on ScalarE, a reciprocal and a scale; index arrays and a mask for a ragged last tile."""
    R, C = x.shape
    out = nl.ndarray((R, C), dtype=x.dtype, buffer=nl.shared_hbm)
    i_p, i_f = nl.mgrid[0:128, 0:C]
    for t in nl.affine_range((R + 127) // 128):
        rows = t * 128 + i_p
        tile = nl.load(x[rows, i_f], mask=(rows < R))
        negmax = nisa.tensor_reduce(nl.max, tile, axis=1, negate=True, mask=(rows < R))
        rowsum = nl.ndarray((128, 1), dtype=nl.float32, buffer=nl.sbuf)
        e = nisa.activation(op=nl.exp, data=tile, bias=negmax, reduce_op=nl.add, reduce_res=rowsum,
                            mask=(rows < R))
        inv = nisa.reciprocal(rowsum, mask=(rows < R))
        y = nisa.tensor_scalar(e, nl.multiply, inv, mask=(rows < R))
        nl.store(out[rows, i_f], value=y, mask=(rows < R))
    return out


@nki.jit
def layer_norm(x, gamma, beta, eps=1e-5):
    """LayerNorm over the last dim of x[R, H] (R a multiple of 128): mean and variance from
    ScalarE passes with fused row sums, VectorE normalisation, gamma and beta broadcast across
    rows by loading them onto every partition."""
    R, H = x.shape
    out = nl.ndarray((R, H), dtype=x.dtype, buffer=nl.shared_hbm)
    g = nl.load(gamma.reshape((1, H))[nl.arange(128)[:, None] * 0, nl.arange(H)[None, :]])
    b = nl.load(beta.reshape((1, H))[nl.arange(128)[:, None] * 0, nl.arange(H)[None, :]])
    for t in nl.affine_range(R // 128):
        tile = nl.load(x[t * 128:(t + 1) * 128, :], dtype=nl.float32)
        s = nl.ndarray((128, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=nl.ndarray((128, H), dtype=nl.float32, buffer=nl.sbuf), op=nl.copy, data=tile,
                        reduce_op=nl.add, reduce_res=s)
        negmean = nisa.tensor_scalar(s, nl.multiply, -1.0 / H)
        ss = nl.ndarray((128, 1), dtype=nl.float32, buffer=nl.sbuf)
        centred = nisa.activation(op=nl.identity, data=tile, bias=negmean, reduce_op=nl.add, reduce_res=ss)
        sq = nl.ndarray((128, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=nl.ndarray((128, H), dtype=nl.float32, buffer=nl.sbuf), op=nl.square, data=centred,
                        reduce_op=nl.add, reduce_res=sq)
        rstd = nl.rsqrt(nisa.tensor_scalar(sq, nl.multiply, 1.0 / H, op1=nl.add, operand1=eps))
        y = nisa.tensor_scalar(centred, nl.multiply, rstd)
        y = nl.multiply(y, g)
        nl.store(out[t * 128:(t + 1) * 128, :], value=nl.add(y, b, dtype=x.dtype))
    return out


@nki.jit
def flash_attention_fwd(q, k, v, causal=False):
    """softmax(q kᵀ / sqrt(D)) v for one head, q/k/v [S, D] (S a multiple of 512, D <= 128):
    per 128-query tile an online softmax over 512-key tiles, the score matrix never leaving
    the chip; causal key tiles past the query tile are skipped and the diagonal masked with
    affine_select. Written as a plain loop: the scheduling pass overlaps the tiles."""
    S, D = q.shape
    out = nl.ndarray((S, D), dtype=q.dtype, buffer=nl.shared_hbm)
    scale = 1.0 / float(np.sqrt(D))
    i_q, i_k = nl.mgrid[0:128, 0:512]
    for qt in nl.affine_range(S // 128):
        q_rows = nl.load(q[qt * 128:(qt + 1) * 128, :])
        qT = nl.copy(nisa.nc_transpose(q_rows), dtype=q.dtype)              # [D, 128]
        m = nl.full((128, 1), -1e30, dtype=nl.float32)                      # running max
        l = nl.zeros((128, 1), dtype=nl.float32)                            # running sum
        o = nl.zeros((128, D), dtype=nl.float32)                            # running output
        last = (qt * 128 + 127) // 512 if causal else S // 512 - 1
        for kt in nl.sequential_range(last + 1):
            k_rows = nl.ndarray((128, 4, D), dtype=k.dtype, buffer=nl.sbuf)
            v_rows = nl.ndarray((128, 4, D), dtype=v.dtype, buffer=nl.sbuf)
            for c in nl.affine_range(4):
                nisa.dma_copy(dst=k_rows[:, c, :], src=k[kt * 512 + c * 128:kt * 512 + (c + 1) * 128, :])
                nisa.dma_copy(dst=v_rows[:, c, :], src=v[kt * 512 + c * 128:kt * 512 + (c + 1) * 128, :])
            kT = nl.ndarray((D, 512), dtype=k.dtype, buffer=nl.sbuf)
            for c in nl.affine_range(4):
                kT[:, c * 128:(c + 1) * 128] = nl.copy(nisa.nc_transpose(k_rows[:, c, :]), dtype=k.dtype)
            s = nisa.nc_matmul(qT, kT)                                      # [128, 512] fp32 in PSUM
            s = nl.copy(s, dtype=nl.float32)
            if causal and kt * 512 + 511 > qt * 128:
                # keep key kt*512 + i for query qt*128 + p when qt*128 + p - kt*512 - i >= 0
                s = nisa.affine_select((qt * 128 + i_q) - (kt * 512 + i_k) >= 0, s[i_q, i_k], -1e30)
            m_new = nl.maximum(m, nisa.tensor_scalar(nl.max(s, axis=1), nl.multiply, scale))
            neg = nisa.tensor_scalar(m_new, nl.multiply, -1.0)
            rowsum = nl.ndarray((128, 1), dtype=nl.float32, buffer=nl.sbuf)
            p = nisa.activation(op=nl.exp, data=s, scale=scale, bias=neg, reduce_op=nl.add, reduce_res=rowsum,
                                dtype=q.dtype)
            alpha = nisa.activation(op=nl.exp, data=m, bias=neg)
            l = nisa.scalar_tensor_tensor(data=l, op0=nl.multiply, operand0=alpha, op1=nl.add, operand1=rowsum)
            pv = nl.zeros((128, D), dtype=nl.float32, buffer=nl.psum)
            for c in nl.affine_range(4):
                pT = nl.copy(nisa.nc_transpose(p[:, c * 128:(c + 1) * 128]), dtype=q.dtype)
                pv += nisa.nc_matmul(pT, v_rows[:, c, :])
            o = nisa.scalar_tensor_tensor(data=o, op0=nl.multiply, operand0=alpha, op1=nl.add, operand1=pv)
            m = m_new
        res = nisa.tensor_scalar(o, nl.divide, l, dtype=q.dtype)
        nl.store(out[qt * 128:(qt + 1) * 128, :], value=res)
    return out


@nki.jit
def gelu_chain(x, bias, scale=0.5):
    """An elementwise chain over affine_range: y = gelu(x * scale + bias) * x, 128 x 512 tiles,
    a masked tail when the columns do not divide."""
    R, C = x.shape
    out = nl.ndarray((R, C), dtype=x.dtype, buffer=nl.shared_hbm)
    b = nl.load(bias)                                                       # [128, 1], one per partition
    i_p, i_f = nl.mgrid[0:128, 0:512]
    for r in nl.affine_range(R // 128):
        for c in nl.affine_range((C + 511) // 512):
            cols = c * 512 + i_f
            t = nl.load(x[r * 128 + i_p, cols], mask=(cols < C))
            g = nisa.activation(op=nl.gelu, data=t, scale=scale, bias=b, mask=(cols < C))
            y = nl.multiply(g, t, mask=(cols < C))
            nl.store(out[r * 128 + i_p, cols], value=y, mask=(cols < C))
    return out


@nki.jit
def add_spmd(a, b):
    """The NKI SPMD tensor-add: each program adds one 128 x 512 tile."""
    out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
    ix = nl.program_id(0) * 128 + nl.arange(128)[:, None]
    iy = nl.program_id(1) * 512 + nl.arange(512)[None, :]
    nl.store(out[ix, iy], value=nl.load(a[ix, iy]) + nl.load(b[ix, iy]))
    return out
