/* The TensorE matmul datapath in C. trnsim/native/reference.py is the definition; this is the
 * fast implementation that must match it bit for bit. Declarations only: build.py hands
 * this file (minus preprocessor lines) to cffi as its cdef. */
#ifndef TRNSIM_DATAPATH_H
#define TRNSIM_DATAPATH_H

#include <stdint.h>

/* Element formats (codes shared with trnsim/native/__init__.py). */
enum {
    TRN_F32 = 0,
    TRN_F16 = 1,
    TRN_BF16 = 2,
    TRN_E4M3 = 3,   /* ml_dtypes.float8_e4m3: IEEE-like, bias 7, has Inf */
    TRN_E4M3FN = 4, /* ml_dtypes.float8_e4m3fn: OCP, no Inf */
    TRN_E5M2 = 5    /* ml_dtypes.float8_e5m2 */
};

/* Kernel families, best last. trn_best_isa() says which this CPU runs. */
enum { TRN_ISA_AUTO = -1, TRN_ISA_GENERIC = 0, TRN_ISA_AVX2 = 1, TRN_ISA_AVX512 = 2 };

/* MAC kernels: fused, one rounding per MAC (the definition; default), or multiply and add
 * rounded apart (wrong for fp32 on purpose; tests use it to show they catch such a kernel). */
enum { TRN_FMA_OFF = 0, TRN_FMA_ON = 1 };

/* Return codes. */
enum { TRN_OK = 0, TRN_EDTYPE = 1, TRN_ENOMEM = 2, TRN_EISA = 3, TRN_ETHREAD = 4, TRN_EARG = 5 };

/* out[M,N] (fp32) = stationary[K,M]^T @ moving[K,N] under the rules of reference.py.
 * Strides are in elements and may be negative or zero; the pointers address element [0,0].
 * out must not overlap the operands. */
int trn_matmul(const void *s, int s_dt, int64_t s_sk, int64_t s_sm,
               const void *v, int v_dt, int64_t v_sk, int64_t v_sn,
               float *out, int64_t o_sm, int64_t o_sn,
               int64_t K, int64_t M, int64_t N, int64_t k_chunk,
               int accumulate, int isa, int fma_policy, int nthreads);

/* trn_matmul for B independent items: item b reads s + b*s_sb, v + b*v_sb and writes
 * out + b*o_sb (batch strides in elements). One call for a batch of small matmuls (attention
 * heads): the checks, MXCSR set-up and packing buffers are paid once. */
int trn_matmul_batched(const void *s, int s_dt, int64_t s_sb, int64_t s_sk, int64_t s_sm,
                       const void *v, int v_dt, int64_t v_sb, int64_t v_sk, int64_t v_sn,
                       float *out, int64_t o_sb, int64_t o_sm, int64_t o_sn,
                       int64_t B, int64_t K, int64_t M, int64_t N, int64_t k_chunk,
                       int accumulate, int isa, int fma_policy, int nthreads);

/* A grouped 2-d convolution, out[N,K,Ho,Wo] (fp32), exactly as trn_matmul computes its im2col
 * matmuls (one per group: weights[K/g, CG*R*S] @ patches[CG*R*S, N*Ho*Wo]), from x, the input
 * already zero-padded [N,C,H,W] (C = CG*groups), and w [K,CG,R,S], both fp32 and contiguous. */
int trn_conv2d_grouped(const float *x, int64_t N, int64_t C, int64_t H, int64_t W,
                       const float *w, int64_t K, int64_t CG, int64_t R, int64_t S, int64_t groups,
                       int64_t sh, int64_t sw, int64_t dh, int64_t dw, int64_t Ho, int64_t Wo,
                       int64_t k_chunk, float *out);

/* dst[i] = src[i] rounded to dst_dt (contiguous arrays of n elements). */
int trn_convert(const void *src, int src_dt, void *dst, int dst_dt, int64_t n);

/* Best kernel family this CPU and OS support (TRN_ISA_*). */
int trn_best_isa(void);

/* Register tile (rows of M, columns of N) of a kernel family; 0 if unknown. */
int trn_tile_m(int isa);
int trn_tile_n(int isa);

#endif
