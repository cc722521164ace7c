/* The TensorE matmul datapath: a fast implementation of the definition in reference.py.
 *
 * Bit-exactness comes from three things.
 *
 * 1. Narrow operands are packed into fp32 panels (widening every format is exact; fp32 ones
 *    are mostly read in place), then a register-blocked micro-kernel computes an MR x NR tile
 *    (or its ragged edge) of one chunk. Each output element lives in one register lane and
 *    sees its products in k order 0..kc-1, starting from +0.0, exactly as the definition's
 *    loop. Blocking over M and N changes nothing per element; K is
 *    only split at chunk boundaries, where the definition itself adds chunk results to out.
 *
 * 2. Every MAC is one fused multiply-add, acc = fl(acc + s*v), as the definition says: the
 *    kernels use the FMA instructions (fmaf in the portable kernel), and the build uses -O3
 *    -ffp-contract=off and never -ffast-math, so the compiler neither fuses nor splits
 *    anything on its own, and nothing flushes subnormals. The x86 entry point also clears
 *    FTZ/DAZ and selects round-to-nearest in MXCSR for the duration of the call, in case
 *    something else in the process changed them.
 *
 * 3. The chunk and accumulate additions into out are plain fp32 adds, as in the definition.
 *
 * A separate multiply-and-add ("unfused") kernel stays for TRN_FMA_OFF: it is wrong for fp32
 * inputs on purpose, so tests can show they would catch a kernel that rounds the product.
 *
 * NaN results are written as the default quiet NaN 0x7FC00000 (see reference.py): IEEE leaves
 * open which payload propagates, and the vector FMA instructions and libm's fmaf may differ.
 */
#include "datapath.h"

#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define TRN_X86 1
#else
#define TRN_X86 0
#endif

/* Packing is integer work whose results do not depend on the instruction set; built once per
 * ISA (picked at load time through an ifunc) it vectorises with AVX2/AVX-512 instead of the
 * x86-64 baseline's SSE2. */
#if TRN_X86 && defined(__gnu_linux__) && defined(__GNUC__)
#define TRN_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define TRN_CLONES
#endif

#ifdef __FAST_MATH__
#error "datapath.c must not be compiled with -ffast-math: the datapath is IEEE fp32"
#endif

#define CANON_NAN_BITS 0x7FC00000u

typedef union {
    float f;
    uint32_t u;
} f32bits;

static inline float bits_f32(uint32_t u) {
    f32bits b;
    b.u = u;
    return b.f;
}

static inline uint32_t f32_bits(float f) {
    f32bits b;
    b.f = f;
    return b.u;
}

/* ---------------------------------------------------------------------------------------- */
/* Widening to fp32 (exact).                                                                 */

/* numpy's float16 -> float32 (npy_halfbits_to_floatbits): NaN payloads kept, sNaN not quieted. */
static inline uint32_t f16_to_f32_bits(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t em = h & 0x7fffu;
    uint32_t r;
    if (em >= 0x7c00u) {
        r = 0x7f800000u | ((em & 0x3ffu) << 13);
    } else if (em >= 0x0400u) {
        r = (em << 13) + 0x38000000u;
    } else {
        /* zero or subnormal: em * 2^-24, exact in fp32 */
        r = f32_bits((float)em * 0x1p-24f);
    }
    return sign | r;
}

static inline uint32_t bf16_to_f32_bits(uint16_t h) { return (uint32_t)h << 16; }

/* fp8 -> fp32 tables, filled once. ml_dtypes widens every NaN code to sign | 0x7FC00000. */
static uint32_t tab_e4m3[256], tab_e4m3fn[256], tab_e5m2[256];
static pthread_once_t tab_once = PTHREAD_ONCE_INIT;

static uint32_t fp8_decode(unsigned code, int mbits, int bias, unsigned inf_code, unsigned nan_min) {
    uint32_t sign = (uint32_t)(code & 0x80u) << 24;
    unsigned a = code & 0x7fu;
    if (a >= nan_min) return sign | CANON_NAN_BITS;
    if (inf_code && a == inf_code) return sign | 0x7f800000u;
    unsigned e = a >> mbits, m = a & ((1u << mbits) - 1u);
    if (e == 0) return sign | f32_bits((float)m * ldexpf(1.0f, 1 - bias - mbits));
    return sign | ((uint32_t)(e - bias + 127) << 23) | ((uint32_t)m << (23 - mbits));
}

static void fill_tables(void) {
    for (unsigned c = 0; c < 256; c++) {
        tab_e4m3[c] = fp8_decode(c, 3, 7, 0x78, 0x79);    /* 0x78 Inf, 0x79..0x7f NaN */
        tab_e4m3fn[c] = fp8_decode(c, 3, 7, 0, 0x7f);     /* no Inf, 0x7f NaN */
        tab_e5m2[c] = fp8_decode(c, 2, 15, 0x7c, 0x7d);   /* 0x7c Inf, 0x7d..0x7f NaN */
    }
}

static const uint32_t *fp8_table(int dt) {
    pthread_once(&tab_once, fill_tables);
    switch (dt) {
    case TRN_E4M3: return tab_e4m3;
    case TRN_E4M3FN: return tab_e4m3fn;
    case TRN_E5M2: return tab_e5m2;
    default: return NULL;
    }
}

static int dtype_ok(int dt) { return dt >= TRN_F32 && dt <= TRN_E5M2; }

/* ---------------------------------------------------------------------------------------- */
/* Narrowing from fp32 (round to nearest even, ml_dtypes / numpy semantics).                 */

/* One routine for every target: mb mantissa bits, bias, width in bits, largest finite code
 * (without sign), the code overflow rounds to (Inf, or NaN for e4m3fn; always maxc + 1), the
 * code Inf maps to, the code NaN maps to (ml_dtypes: sign | quiet NaN), and numpy's float16
 * NaN rule (keep the top payload bits, never produce Inf). */
static inline uint32_t narrow_bits(uint32_t x, const int mb, const int bias, const int width,
                                   const uint32_t maxc, const uint32_t ovf, const uint32_t infc,
                                   const uint32_t qnan, const int f16_nan) {
    uint32_t sign = (x >> 31) << (width - 1);
    uint32_t a = x & 0x7fffffffu;
    uint32_t code;
    if (a > 0x7f800000u) {
        if (f16_nan) {
            uint32_t m = (a & 0x7fffffu) >> 13;
            code = 0x7c00u | (m ? m : 1u);
        } else {
            code = qnan;
        }
    } else if (a == 0x7f800000u) {
        code = infc;
    } else if (a >= ((uint32_t)(128 - bias) << 23)) {
        /* a normal number of the target format (or an overflow) */
        const int sh = 23 - mb;
        uint32_t r = a + ((1u << (sh - 1)) - 1u) + ((a >> sh) & 1u);
        code = (r >> sh) - ((uint32_t)(127 - bias) << mb);
        if (code > maxc) code = ovf;
    } else {
        /* below the target's smallest normal: round |x| / 2^(1-bias-mb) to an integer */
        uint32_t e = a >> 23;
        uint32_t m = (a & 0x7fffffu) | (e ? 0x800000u : 0u);
        if (!e) e = 1;
        int s = 151 - bias - mb - (int)e; /* >= 24 - mb >= 1 */
        if (s > 25) {
            code = 0; /* m < 2^24: less than half the smallest subnormal */
        } else {
            code = (m + (1u << (s - 1)) - 1u + ((m >> s) & 1u)) >> s;
        }
    }
    return sign | code;
}

static inline uint16_t f32_to_bf16(uint32_t x) {
    return (uint16_t)narrow_bits(x, 7, 127, 16, 0x7f7fu, 0x7f80u, 0x7f80u, 0x7fc0u, 0);
}
static inline uint16_t f32_to_f16(uint32_t x) {
    return (uint16_t)narrow_bits(x, 10, 15, 16, 0x7bffu, 0x7c00u, 0x7c00u, 0, 1);
}
static inline uint8_t f32_to_e4m3(uint32_t x) {
    return (uint8_t)narrow_bits(x, 3, 7, 8, 0x77u, 0x78u, 0x78u, 0x7cu, 0);
}
static inline uint8_t f32_to_e4m3fn(uint32_t x) {
    return (uint8_t)narrow_bits(x, 3, 7, 8, 0x7eu, 0x7fu, 0x7fu, 0x7fu, 0);
}
static inline uint8_t f32_to_e5m2(uint32_t x) {
    return (uint8_t)narrow_bits(x, 2, 15, 8, 0x7bu, 0x7cu, 0x7cu, 0x7eu, 0);
}

/* src[0..n) in src_dt -> fp32 bits */
static void widen_block(const void *src, int dt, int64_t n, uint32_t *dst) {
    switch (dt) {
    case TRN_F32: memcpy(dst, src, (size_t)n * 4); break;
    case TRN_F16: {
        const uint16_t *p = (const uint16_t *)src;
        for (int64_t i = 0; i < n; i++) dst[i] = f16_to_f32_bits(p[i]);
        break;
    }
    case TRN_BF16: {
        const uint16_t *p = (const uint16_t *)src;
        for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_f32_bits(p[i]);
        break;
    }
    default: {
        const uint8_t *p = (const uint8_t *)src;
        const uint32_t *t = fp8_table(dt);
        for (int64_t i = 0; i < n; i++) dst[i] = t[p[i]];
        break;
    }
    }
}

static void narrow_block(const uint32_t *src, int dt, int64_t n, void *dst) {
    switch (dt) {
    case TRN_F32: memcpy(dst, src, (size_t)n * 4); break;
    case TRN_F16: {
        uint16_t *p = (uint16_t *)dst;
        for (int64_t i = 0; i < n; i++) p[i] = f32_to_f16(src[i]);
        break;
    }
    case TRN_BF16: {
        uint16_t *p = (uint16_t *)dst;
        for (int64_t i = 0; i < n; i++) p[i] = f32_to_bf16(src[i]);
        break;
    }
    case TRN_E4M3: {
        uint8_t *p = (uint8_t *)dst;
        for (int64_t i = 0; i < n; i++) p[i] = f32_to_e4m3(src[i]);
        break;
    }
    case TRN_E4M3FN: {
        uint8_t *p = (uint8_t *)dst;
        for (int64_t i = 0; i < n; i++) p[i] = f32_to_e4m3fn(src[i]);
        break;
    }
    default: {
        uint8_t *p = (uint8_t *)dst;
        for (int64_t i = 0; i < n; i++) p[i] = f32_to_e5m2(src[i]);
        break;
    }
    }
}

static int64_t dt_size(int dt) {
    switch (dt) {
    case TRN_F32: return 4;
    case TRN_F16:
    case TRN_BF16: return 2;
    default: return 1;
    }
}

int trn_convert(const void *src, int src_dt, void *dst, int dst_dt, int64_t n) {
    if (!dtype_ok(src_dt) || !dtype_ok(dst_dt)) return TRN_EDTYPE;
    if (n < 0) return TRN_EARG;
    enum { BLK = 1024 };
    uint32_t buf[BLK];
    const char *s = (const char *)src;
    char *d = (char *)dst;
    const int64_t ss = dt_size(src_dt), ds = dt_size(dst_dt);
    for (int64_t i = 0; i < n; i += BLK) {
        int64_t b = n - i < BLK ? n - i : BLK;
        widen_block(s + i * ss, src_dt, b, buf);
        narrow_block(buf, dst_dt, b, d + i * ds);
    }
    return TRN_OK;
}

/* ---------------------------------------------------------------------------------------- */
/* Packing: one chunk of an operand [K, X] -> panels of R columns, each kc x R fp32, k-major,
 * zero-padded past the last column.                                                          */

#define PACK_ROWS(T, CONV)                                                                     \
    do {                                                                                       \
        const T *base = (const T *)src;                                                        \
        if (sk == 1 && sx != 1) {                                                              \
            /* k contiguous (a transposed view): read each column's run of k in order */       \
            for (int64_t r = 0; r < xn; r++) {                                                 \
                const T *col = base + k0 + (x0 + r) * sx;                                      \
                for (int64_t k = 0; k < kc; k++) dst[k * R + r] = CONV(col[k]);                \
            }                                                                                  \
            for (int64_t k = 0; k < kc; k++)                                                   \
                for (int64_t r = xn; r < R; r++) dst[k * R + r] = 0;                           \
            break;                                                                             \
        }                                                                                      \
        for (int64_t k = 0; k < kc; k++) {                                                     \
            const T *row = base + (k0 + k) * sk + x0 * sx;                                     \
            uint32_t *d = dst + k * R;                                                         \
            if (sx == 1) {                                                                     \
                for (int64_t r = 0; r < xn; r++) d[r] = CONV(row[r]);                          \
            } else {                                                                           \
                for (int64_t r = 0; r < xn; r++) d[r] = CONV(row[r * sx]);                     \
            }                                                                                  \
            for (int64_t r = xn; r < R; r++) d[r] = 0;                                         \
        }                                                                                      \
    } while (0)

#define CONV_F32(x) (x)
#define CONV_F16(x) f16_to_f32_bits(x)
#define CONV_BF16(x) bf16_to_f32_bits(x)
#define CONV_TAB(x) tab[x]

/* BODY(element type, widening) for the element format dt. */
#define FOR_FORMAT(dt, BODY)                                                                   \
    switch (dt) {                                                                              \
    case TRN_F32: BODY(uint32_t, CONV_F32); break;                                             \
    case TRN_F16: BODY(uint16_t, CONV_F16); break;                                             \
    case TRN_BF16: BODY(uint16_t, CONV_BF16); break;                                           \
    default: {                                                                                 \
        const uint32_t *tab = fp8_table(dt);                                                   \
        BODY(uint8_t, CONV_TAB);                                                               \
        break;                                                                                 \
    }                                                                                          \
    }

/* Pack columns [x0, x0+xn) of rows [k0, k0+kc) into dst (kc x R). */
/* Rows of R contiguous fp32 values, copied with a size the compiler knows: a few vector moves
 * per row instead of a loop with a remainder. */
#define COPY_ROWS(R_)                                                                          \
    do {                                                                                       \
        const uint32_t *row = (const uint32_t *)src + k0 * sk + x0;                            \
        for (int64_t k = 0; k < kc; k++) memcpy(dst + k * (R_), row + k * sk, (R_) * 4);       \
    } while (0)

TRN_CLONES static void pack_panel(const void *src, int dt, int64_t sk, int64_t sx, int64_t k0, int64_t kc,
                       int64_t x0, int64_t xn, int64_t R, uint32_t *dst) {
    if (dt == TRN_F32 && sx == 1 && xn == R) {
        switch (R) {
        case 8: COPY_ROWS(8); return;
        case 16: COPY_ROWS(16); return;
        case 32: COPY_ROWS(32); return;
        default: break;
        }
    }
    FOR_FORMAT(dt, PACK_ROWS)
}

/* Pack np full panels of R columns from rows whose columns are contiguous (sx = 1): panel p
 * holds columns [x0 + p*R, x0 + (p+1)*R) at dst + p*pstride. k outer, so each source row is
 * read once, front to back. Panel by panel (pack_panel) reads one short piece of every row
 * per panel instead, and rows a multiple of 4 KiB apart (a 1024-wide x.t() in a weight
 * gradient) all land in one L1 set: each panel re-read its rows from L2, a quarter of the
 * 1024x1024x256 matmul's time. */
#define COPY_PANELS(R_)                                                                        \
    do {                                                                                       \
        for (int64_t k = 0; k < kc; k++) {                                                     \
            const uint32_t *row = (const uint32_t *)src + (k0 + k) * sk + x0;                  \
            for (int64_t p = 0; p < np; p++)                                                   \
                memcpy(dst + p * pstride + k * (R_), row + p * (R_), (R_) * 4);                \
        }                                                                                      \
    } while (0)
#define CONV_PANELS(T, CONV)                                                                   \
    do {                                                                                       \
        for (int64_t k = 0; k < kc; k++) {                                                     \
            const T *row = (const T *)src + (k0 + k) * sk + x0;                                \
            for (int64_t p = 0; p < np; p++) {                                                 \
                uint32_t *d = dst + p * pstride + k * R;                                       \
                for (int64_t r = 0; r < R; r++) d[r] = CONV(row[p * R + r]);                   \
            }                                                                                  \
        }                                                                                      \
    } while (0)

TRN_CLONES static void pack_panels_rows(const void *src, int dt, int64_t sk, int64_t k0, int64_t kc,
                                        int64_t x0, int64_t np, int64_t R, uint32_t *dst,
                                        int64_t pstride) {
    if (dt == TRN_F32) {
        switch (R) {
        case 8: COPY_PANELS(8); return;
        case 12: COPY_PANELS(12); return;
        case 16: COPY_PANELS(16); return;
        case 32: COPY_PANELS(32); return;
        default: break;
        }
    }
    FOR_FORMAT(dt, CONV_PANELS)
}

/* ---------------------------------------------------------------------------------------- */
/* Micro-kernels. kern(kc, a, ak, ai, b, bk, dst, ldd, add, mr, nc):
 *   a: stationary panel, element (k, i) at a[k*ak + i*ai] for i < mr: a packed panel
 *      (ak = MR, ai = 1) or, for fp32 input, the caller's array itself (no copy);
 *   b: moving panel, row k at b + k*bk, panel_width(nc) floats (aligned), zero past column nc:
 *      packed, or the caller's fp32 rows when they are a whole panel wide;
 *   acc[i][j] = +0.0, then for k in order acc = fma(a[k][i], b[k][j], acc);
 *   dst[i*ldd + j] = canon(add ? dst[i*ldd + j] + acc : acc) for i < mr, j < nc only.
 * A ragged edge tile is thus written straight into out (masked stores), with no temporary
 * tile and no work for rows past mr. The _fma variants are the definition (one rounding per
 * MAC); the _unfused ones round the multiply and the add apart (TRN_FMA_OFF, for tests).    */

typedef void (*kern_fn)(int64_t kc, const float *a, int64_t ak, int64_t ai, const float *b,
                        int64_t bk, float *dst, int64_t ldd, int add, int mr, int nc);

static inline float canon_f32(float x) { return x != x ? bits_f32(CANON_NAN_BITS) : x; }

/* Portable kernel: plain C the compiler vectorises for the baseline ISA. */
#define G_MR 4
#define G_NR 8

static inline __attribute__((always_inline)) void
generic_tile(const int fused, int64_t kc, const float *a, int64_t ak, int64_t ai, const float *b,
             int64_t bk, float *dst, int64_t ldd, int add, int mr, int nc) {
    float acc[G_MR][G_NR];
    for (int i = 0; i < G_MR; i++)
        for (int j = 0; j < G_NR; j++) acc[i][j] = 0.0f;
    for (int64_t k = 0; k < kc; k++) {
        const float *bkp = b + k * bk;
        for (int i = 0; i < G_MR; i++) {
            const float aki = i < mr ? a[k * ak + i * ai] : 0.0f;
            for (int j = 0; j < G_NR; j++)
                acc[i][j] = fused ? fmaf(aki, bkp[j], acc[i][j]) : acc[i][j] + aki * bkp[j];
        }
    }
    for (int i = 0; i < mr; i++) {
        float *d = dst + i * ldd;
        for (int j = 0; j < nc; j++) d[j] = canon_f32(add ? d[j] + acc[i][j] : acc[i][j]);
    }
}

static void kern_generic_unfused(int64_t kc, const float *a, int64_t ak, int64_t ai,
                                 const float *b, int64_t bk, float *dst, int64_t ldd, int add,
                                 int mr, int nc) {
    generic_tile(0, kc, a, ak, ai, b, bk, dst, ldd, add, mr, nc);
}

/* fmaf is a libm call unless the target has FMA instructions (the x86-64 baseline does not);
 * this kernel is the fallback for CPUs without AVX2+FMA and for tests, so that is acceptable. */
static void kern_generic_fma(int64_t kc, const float *a, int64_t ak, int64_t ai, const float *b,
                             int64_t bk, float *dst, int64_t ldd, int add, int mr, int nc) {
    generic_tile(1, kc, a, ak, ai, b, bk, dst, ldd, add, mr, nc);
}

#if TRN_X86

/* The x86 kernels are one always-inlined body per family, instantiated for every row count
 * 1..MR and for one or two vectors of columns (a narrow last panel, e.g. N = 16, computes one
 * vector instead of padding to two). mr, nv and fused are constants in each instance, so the
 * loops unroll fully and the accumulators stay in registers. */
#define KERNEL_CASE(BODY, MR_, FUSED)                                                          \
    case MR_:                                                                                  \
        if (nv == 2)                                                                           \
            BODY(MR_, 2, FUSED, kc, a, AK_, AI_, b, bk, dst, ldd, add, nc);                    \
        else                                                                                   \
            BODY(MR_, 1, FUSED, kc, a, AK_, AI_, b, bk, dst, ldd, add, nc);                    \
        break;

/* AVX2: up to 6 rows x 2 vectors of 8 columns, 12 ymm accumulators. */
#define A2_MR 6
#define A2_VW 8

static inline __attribute__((always_inline, target("avx2,fma"))) void
a2_tile(const int mr, const int nv, const int fused, int64_t kc, const float *a, int64_t ak,
        int64_t ai, const float *b, int64_t bk, float *dst, int64_t ldd, int add, int nc) {
    __m256 c[A2_MR][2];
    _Pragma("GCC unroll 6") for (int i = 0; i < mr; i++) {
        c[i][0] = _mm256_setzero_ps();
        c[i][1] = _mm256_setzero_ps();
        _mm_prefetch((const char *)(dst + i * ldd), _MM_HINT_T0); /* as in a5_tile */
    }
    for (int64_t k = 0; k < kc; k++) {
        const __m256 b0 = _mm256_loadu_ps(b + k * bk);
        const __m256 b1 = nv > 1 ? _mm256_loadu_ps(b + k * bk + A2_VW) : b0;
        _Pragma("GCC unroll 6") for (int i = 0; i < mr; i++) {
            const __m256 aki = _mm256_broadcast_ss(a + k * ak + i * ai);
            c[i][0] = fused ? _mm256_fmadd_ps(aki, b0, c[i][0])
                            : _mm256_add_ps(c[i][0], _mm256_mul_ps(aki, b0));
            if (nv > 1)
                c[i][1] = fused ? _mm256_fmadd_ps(aki, b1, c[i][1])
                                : _mm256_add_ps(c[i][1], _mm256_mul_ps(aki, b1));
        }
    }
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i m0 = _mm256_cmpgt_epi32(_mm256_set1_epi32(nc), lane);
    const __m256i m1 = _mm256_cmpgt_epi32(_mm256_set1_epi32(nc - A2_VW), lane);
    const __m256 canon = _mm256_castsi256_ps(_mm256_set1_epi32((int)CANON_NAN_BITS));
    /* A vector of columns all inside nc is read and written with plain moves: the same lanes
     * as the masked ones, and a masked store is microcoded on AMD's cores (Zen 3: the
     * epilogue's twelve of them took ~15% of a 512x128x128 matmul). */
    const int full0 = nc >= A2_VW, full1 = nc >= 2 * A2_VW;
    _Pragma("GCC unroll 6") for (int i = 0; i < mr; i++) {
        _Pragma("GCC unroll 2") for (int h = 0; h < nv; h++) {
            float *d = dst + i * ldd + A2_VW * h;
            const __m256i m = h ? m1 : m0;
            const int full = h ? full1 : full0;
            __m256 r = c[i][h];
            if (add) r = _mm256_add_ps(full ? _mm256_loadu_ps(d) : _mm256_maskload_ps(d, m), r);
            r = _mm256_blendv_ps(r, canon, _mm256_cmp_ps(r, r, _CMP_UNORD_Q));
            if (full)
                _mm256_storeu_ps(d, r);
            else
                _mm256_maskstore_ps(d, m, r);
        }
    }
}

#define DEFINE_AVX2_KERNEL(NAME, FUSED, AK, AI)                                                \
    __attribute__((target("avx2,fma"))) static void NAME(                                     \
        int64_t kc, const float *a, int64_t ak, int64_t ai, const float *b, int64_t bk,        \
        float *dst, int64_t ldd, int add, int mr, int nc) {                                    \
        const int nv = nc > A2_VW ? 2 : 1;                                                     \
        const int64_t AK_ = (AK), AI_ = (AI);                                                  \
        (void)ak, (void)ai;                                                                    \
        switch (mr) {                                                                          \
            KERNEL_CASE(a2_tile, 1, FUSED)                                                     \
            KERNEL_CASE(a2_tile, 2, FUSED)                                                     \
            KERNEL_CASE(a2_tile, 3, FUSED)                                                     \
            KERNEL_CASE(a2_tile, 4, FUSED)                                                     \
            KERNEL_CASE(a2_tile, 5, FUSED)                                                     \
            KERNEL_CASE(a2_tile, 6, FUSED)                                                     \
        default: break;                                                                        \
        }                                                                                      \
    }

DEFINE_AVX2_KERNEL(kern_avx2_unfused, 0, ak, ai)
DEFINE_AVX2_KERNEL(kern_avx2_fma, 1, ak, ai)
/* The same body for a packed stationary panel (ak = MR, ai = 1 as constants: the broadcasts
 * become fixed offsets, and the strides no longer take registers). */
DEFINE_AVX2_KERNEL(kern_avx2_fma_packed, 1, A2_MR, 1)

/* AVX-512: up to 12 rows x 2 vectors of 16 columns, 24 zmm accumulators: one FMA per 16 MACs
 * on each of two FP ports. */
#define A5_MR 12
#define A5_VW 16

static inline __attribute__((always_inline, target("avx512f"))) void
a5_tile(const int mr, const int nv, const int fused, int64_t kc, const float *a, int64_t ak,
        int64_t ai, const float *b, int64_t bk, float *dst, int64_t ldd, int add, int nc) {
    __m512 c[A5_MR][2];
    _Pragma("GCC unroll 12") for (int i = 0; i < mr; i++) {
        c[i][0] = _mm512_setzero_ps();
        c[i][1] = _mm512_setzero_ps();
        /* out's tile is touched only after the k loop: ask for its lines now, so a chunk
         * added to a PSUM tile that left L1 (K > k_chunk) does not wait for them */
        _mm_prefetch((const char *)(dst + i * ldd), _MM_HINT_T0);
        if (nv > 1) _mm_prefetch((const char *)(dst + i * ldd + A5_VW), _MM_HINT_T0);
    }
    for (int64_t k = 0; k < kc; k++) {
        const __m512 b0 = _mm512_loadu_ps(b + k * bk);
        const __m512 b1 = nv > 1 ? _mm512_loadu_ps(b + k * bk + A5_VW) : b0;
        _Pragma("GCC unroll 12") for (int i = 0; i < mr; i++) {
            const __m512 aki = _mm512_set1_ps(a[k * ak + i * ai]);
            c[i][0] = fused ? _mm512_fmadd_ps(aki, b0, c[i][0])
                            : _mm512_add_ps(c[i][0], _mm512_mul_ps(aki, b0));
            if (nv > 1)
                c[i][1] = fused ? _mm512_fmadd_ps(aki, b1, c[i][1])
                                : _mm512_add_ps(c[i][1], _mm512_mul_ps(aki, b1));
        }
    }
    const __mmask16 m0 = nc >= A5_VW ? 0xffff : (__mmask16)((1u << nc) - 1u);
    const __mmask16 m1 = nc >= 2 * A5_VW ? 0xffff
                         : nc > A5_VW    ? (__mmask16)((1u << (nc - A5_VW)) - 1u)
                                         : 0;
    const __m512 canon = _mm512_castsi512_ps(_mm512_set1_epi32((int)CANON_NAN_BITS));
    _Pragma("GCC unroll 12") for (int i = 0; i < mr; i++) {
        _Pragma("GCC unroll 2") for (int h = 0; h < nv; h++) {
            float *d = dst + i * ldd + A5_VW * h;
            const __mmask16 m = h ? m1 : m0;
            __m512 r = c[i][h];
            if (add) r = _mm512_add_ps(_mm512_maskz_loadu_ps(m, d), r);
            r = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(r, r, _CMP_UNORD_Q), r, canon);
            _mm512_mask_storeu_ps(d, m, r);
        }
    }
}

#define DEFINE_AVX512_KERNEL(NAME, FUSED, AK, AI)                                              \
    __attribute__((target("avx512f"))) static void NAME(                                      \
        int64_t kc, const float *a, int64_t ak, int64_t ai, const float *b, int64_t bk,        \
        float *dst, int64_t ldd, int add, int mr, int nc) {                                    \
        const int nv = nc > A5_VW ? 2 : 1;                                                     \
        const int64_t AK_ = (AK), AI_ = (AI);                                                  \
        (void)ak, (void)ai;                                                                    \
        switch (mr) {                                                                          \
            KERNEL_CASE(a5_tile, 1, FUSED)                                                     \
            KERNEL_CASE(a5_tile, 2, FUSED)                                                     \
            KERNEL_CASE(a5_tile, 3, FUSED)                                                     \
            KERNEL_CASE(a5_tile, 4, FUSED)                                                     \
            KERNEL_CASE(a5_tile, 5, FUSED)                                                     \
            KERNEL_CASE(a5_tile, 6, FUSED)                                                     \
            KERNEL_CASE(a5_tile, 7, FUSED)                                                     \
            KERNEL_CASE(a5_tile, 8, FUSED)                                                     \
            KERNEL_CASE(a5_tile, 9, FUSED)                                                     \
            KERNEL_CASE(a5_tile, 10, FUSED)                                                    \
            KERNEL_CASE(a5_tile, 11, FUSED)                                                    \
            KERNEL_CASE(a5_tile, 12, FUSED)                                                    \
        default: break;                                                                        \
        }                                                                                      \
    }

DEFINE_AVX512_KERNEL(kern_avx512_unfused, 0, ak, ai)
DEFINE_AVX512_KERNEL(kern_avx512_fma, 1, ak, ai)
DEFINE_AVX512_KERNEL(kern_avx512_fma_packed, 1, A5_MR, 1) /* packed stationary, as for AVX2 */

/* fp32 panel packing for a k-contiguous operand (sk = 1: a row-major a[M, K] as stationary,
 * a transposed view w.t() as moving): pack_panel's column-by-column copy writes one float per
 * store R floats apart; this transposes 16 x 16 blocks in registers (unpack, then two 128-bit
 * lane shuffles) and stores whole rows. Columns [x0, x0 + xn) of rows [k0, k0 + kc) go to
 * dst (kc x R, R <= 32, zero past xn), exactly the floats pack_panel writes. */
__attribute__((target("avx512f"))) static void pack_t_avx512(const float *src, int64_t sx, int64_t k0,
                                                            int64_t kc, int64_t x0, int64_t xn,
                                                            int64_t R, uint32_t *dst) {
    for (int64_t h = 0; h * 16 < R; h++) {
        const int64_t c0 = h * 16;                         /* first column of this half */
        const int64_t nc = xn - c0 < 0 ? 0 : (xn - c0 > 16 ? 16 : xn - c0); /* real columns */
        const int64_t w = R - c0 < 16 ? R - c0 : 16;       /* lanes stored per row */
        const __mmask16 smask = w >= 16 ? (__mmask16)0xffffu : (__mmask16)((1u << w) - 1u);
        for (int64_t kb = 0; kb < kc; kb += 16) {
            const int64_t kn = kc - kb < 16 ? kc - kb : 16;
            const __mmask16 lmask = kn >= 16 ? (__mmask16)0xffffu : (__mmask16)((1u << kn) - 1u);
            __m512 r[16];
            for (int i = 0; i < 16; i++)
                r[i] = i < nc ? _mm512_maskz_loadu_ps(lmask, src + (x0 + c0 + i) * sx + k0 + kb)
                              : _mm512_setzero_ps();
            __m512 t[16], u[16];
            for (int i = 0; i < 8; i++) {
                t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
                t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
            }
            /* u[4g + j], lane l: columns 4g..4g+3 at k = 4l + j */
            for (int g = 0; g < 4; g++) {
                const __m512d a0 = _mm512_castps_pd(t[4 * g]), a1 = _mm512_castps_pd(t[4 * g + 1]);
                const __m512d b0 = _mm512_castps_pd(t[4 * g + 2]), b1 = _mm512_castps_pd(t[4 * g + 3]);
                u[4 * g + 0] = _mm512_castpd_ps(_mm512_unpacklo_pd(a0, b0));
                u[4 * g + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a0, b0));
                u[4 * g + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(a1, b1));
                u[4 * g + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(a1, b1));
            }
            for (int j = 0; j < 4; j++) {
                const __m512 vlo = _mm512_shuffle_f32x4(u[j], u[4 + j], 0x44);
                const __m512 vhi = _mm512_shuffle_f32x4(u[j], u[4 + j], 0xEE);
                const __m512 wlo = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], 0x44);
                const __m512 whi = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], 0xEE);
                const __m512 out[4] = {_mm512_shuffle_f32x4(vlo, wlo, 0x88), _mm512_shuffle_f32x4(vlo, wlo, 0xDD),
                                       _mm512_shuffle_f32x4(vhi, whi, 0x88), _mm512_shuffle_f32x4(vhi, whi, 0xDD)};
                for (int l = 0; l < 4; l++) {
                    const int64_t k = 4 * l + j; /* row of this block */
                    if (k < kn) _mm512_mask_storeu_ps((float *)dst + (kb + k) * R + c0, smask, out[l]);
                }
            }
        }
    }
}

#endif /* TRN_X86 */

typedef struct {
    int isa;    /* TRN_ISA_* */
    int mr, nr; /* register tile: rows, and columns of a full panel */
    int vw;     /* columns of one vector: a panel of at most vw columns is packed vw wide */
    kern_fn fma, unfused; /* the definition; mul+add rounded apart (TRN_FMA_OFF) */
    kern_fn fma_packed;   /* fma for a packed stationary panel (ak = mr, ai = 1) */
} kernel_family;

static int get_family(int isa, kernel_family *f) {
    f->isa = isa;
    switch (isa) {
    case TRN_ISA_GENERIC:
        f->mr = G_MR, f->nr = G_NR, f->vw = G_NR;
        f->fma = kern_generic_fma, f->unfused = kern_generic_unfused;
        f->fma_packed = kern_generic_fma;
        return 1;
#if TRN_X86
    case TRN_ISA_AVX2:
        f->mr = A2_MR, f->nr = 2 * A2_VW, f->vw = A2_VW;
        f->fma = kern_avx2_fma, f->unfused = kern_avx2_unfused;
        f->fma_packed = kern_avx2_fma_packed;
        return 1;
    case TRN_ISA_AVX512:
        f->mr = A5_MR, f->nr = 2 * A5_VW, f->vw = A5_VW;
        f->fma = kern_avx512_fma, f->unfused = kern_avx512_unfused;
        f->fma_packed = kern_avx512_fma_packed;
        return 1;
#endif
    default: return 0;
    }
}

/* Packed width of a moving panel holding nc columns (what the kernel reads for that nc). */
static int64_t panel_width(const kernel_family *f, int64_t nc) { return nc <= f->vw ? f->vw : f->nr; }

int trn_best_isa(void) {
#if TRN_X86
    /* libgcc's cpu model checks XCR0 too, so these mean "CPU and OS support it". */
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) return TRN_ISA_AVX512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return TRN_ISA_AVX2;
#endif
    return TRN_ISA_GENERIC;
}

int trn_tile_m(int isa) {
    kernel_family f;
    return get_family(isa, &f) ? f.mr : 0;
}

int trn_tile_n(int isa) {
    kernel_family f;
    return get_family(isa, &f) ? f.nr : 0;
}

/* ---------------------------------------------------------------------------------------- */
/* Packing buffers. A small matmul's allocation costs as much as its arithmetic, so each
 * thread keeps its buffer between calls; one above SCRATCH_KEEP bytes is freed after the call
 * so a single huge matmul does not pin its memory. Worker threads free theirs on exit.       */

#define SCRATCH_KEEP ((size_t)8 << 20)

static __thread void *scratch_buf;
static __thread size_t scratch_cap;

static void *scratch_get(size_t bytes) {
    if (bytes > scratch_cap) {
        free(scratch_buf);
        scratch_buf = NULL, scratch_cap = 0;
        bytes = (bytes + 63) & ~(size_t)63;
        if (posix_memalign(&scratch_buf, 64, bytes) != 0) {
            scratch_buf = NULL;
            return NULL;
        }
        scratch_cap = bytes;
    }
    return scratch_buf;
}

static void scratch_trim(size_t keep) {
    if (scratch_cap > keep) {
        free(scratch_buf);
        scratch_buf = NULL, scratch_cap = 0;
    }
}

/* ---------------------------------------------------------------------------------------- */
/* Driver.                                                                                    */

typedef struct {
    const char *s;
    int s_dt;
    int64_t s_sb, s_sk, s_sm; /* strides in elements; s_sb between batch items */
    const char *v;
    int v_dt;
    int64_t v_sb, v_sk, v_sn;
    float *out;
    int64_t o_sb, o_sm, o_sn;
    int64_t B, K, M, N, k_chunk;
    int accumulate, fma_policy;
    kernel_family fam;
    int64_t b0, b1; /* this worker's batch items */
    int64_t n0, n1; /* and output columns */
    int status;
} job;

/* Moving columns per block: a block's packed chunk (k_chunk x NC floats, 512 KiB) stays in L2
 * while every row panel walks it, and the packing buffer stays that size however wide N is
 * (a 50257-column vocabulary projection would otherwise pack 25 MiB per chunk). */
static int64_t block_cols(const kernel_family *F, int64_t kmax) {
    const int64_t panels = ((int64_t)512 << 10) / (kmax > 0 ? kmax * 4 : 4) / F->nr;
    return (panels > 0 ? panels : 1) * F->nr;
}

/* pack_panel, or its AVX-512 transpose for k-contiguous fp32 (same floats). */
static void pack_one(const kernel_family *F, const void *src, int dt, int64_t sk, int64_t sx,
                     int64_t k0, int64_t kc, int64_t x0, int64_t xn, int64_t R, uint32_t *dst) {
#if TRN_X86
    if (F->isa == TRN_ISA_AVX512 && dt == TRN_F32 && sk == 1 && sx != 1 && R <= 32) {
        pack_t_avx512((const float *)src, sx, k0, kc, x0, xn, R, dst);
        return;
    }
#else
    (void)F;
#endif
    pack_panel(src, dt, sk, sx, k0, kc, x0, xn, R, dst);
}

/* Whether the kernel broadcasts fp32 stationary values straight from the caller's array
 * (element (k, i) at s[k*s_sk + i*s_sm]) instead of a packed k-major panel. In place, a row
 * panel stays in L1 across the column panels only if its lines do not fight over a few L1
 * sets (48 KiB, 12 ways: addresses 4 KiB apart share a set). With columns contiguous (a
 * transposed view: x.t() in a weight gradient, s_sm = 1) each k step is a new line s_sk apart,
 * kc of them per chunk, and the usual power-of-two widths alias; packing those is a 48-byte
 * copy per k and measured faster once a panel is reused a few times (256x1024x1024: 86 -> 106
 * GFLOP/s; 1024x1024x256: 68 -> 98). Rows contiguous in k (a row-major a[M, K]) stay in place:
 * packing them is a transpose, which cost more than it saved even at K = 1024 (rows 4 KiB
 * apart: 107 -> 92). */
static int stationary_direct(const job *J, int64_t column_panels) {
    if (J->s_dt != TRN_F32) return 0;
    return column_panels <= 2 || J->s_sm != 1 || J->s_sk == 1;
}

/* One batch item, columns [n0, n1): s, v, out point at its [0, 0] elements. sp/vp/tile are
 * the packing buffers, sized by run_job for kmax rows of all row panels and one column block.
 *
 * fp32 operands are mostly not copied: the kernel broadcasts stationary values straight from
 * the caller's array (any strides; one row panel at a time, which stays in L1), and reads
 * moving rows in place when they hold a whole panel contiguously, unless many row panels
 * revisit a chunk whose rows are a multiple of 1 KiB apart: those rows fight over a few L1
 * sets, and packing them measured faster (1024^3: 80 vs 76 GFLOP/s; in place wins at 512 B
 * and 1.5 KiB strides, e.g. 64x128x128 batches 71 -> 78).
 * Packing is for the narrow formats, which need widening. */
static void run_item(const job *J, const void *s, const void *v, float *out, uint32_t *sp,
                     uint32_t *vp, float *tile) {
    const kernel_family *F = &J->fam;
    const int64_t MR = F->mr, NR = F->nr;
    const int64_t M = J->M, Nj = J->n1 - J->n0;
    const int64_t mp = (M + MR - 1) / MR;
    const int64_t nchunks = J->K > 0 ? (J->K + J->k_chunk - 1) / J->k_chunk : 1;
    const int64_t NC = block_cols(F, J->K < J->k_chunk ? J->K : J->k_chunk);
    const int s_direct = stationary_direct(J, (Nj + NR - 1) / NR);
    const int64_t v_span = (J->v_sk < 0 ? -J->v_sk : J->v_sk) * (int64_t)sizeof(float);
    const kern_fn kern = J->fma_policy == TRN_FMA_OFF ? F->unfused : s_direct ? F->fma : F->fma_packed;
    for (int64_t c = 0; c < nchunks; c++) {
        const int64_t k0 = c * J->k_chunk;
        const int64_t kc = J->K - k0 < J->k_chunk ? J->K - k0 : J->k_chunk;
        const int v_direct = J->v_dt == TRN_F32 && J->v_sn == 1 &&
                             (mp <= 2 || kc * v_span <= 32768 || v_span % 1024 != 0);
        const int add = c > 0 || J->accumulate;
        if (!s_direct) {
            /* full panels of a row-contiguous stationary row by row, the rest panel by panel */
            const int64_t rows_first = J->s_sm == 1 && J->s_sk != 1 ? M / MR : 0;
            if (rows_first > 0)
                pack_panels_rows(s, J->s_dt, J->s_sk, k0, kc, 0, rows_first, MR, sp, kc * MR);
            for (int64_t ip = rows_first; ip < mp; ip++) {
                const int64_t x0 = ip * MR, xn = M - x0 < MR ? M - x0 : MR;
                pack_one(F, s, J->s_dt, J->s_sk, J->s_sm, k0, kc, x0, xn, MR, sp + ip * kc * MR);
            }
        }
        for (int64_t jb = 0; jb < Nj; jb += NC) {
            const int64_t nb = Nj - jb < NC ? Nj - jb : NC; /* columns in this block */
            const int64_t np_ = (nb + NR - 1) / NR;
            /* as for stationary: full packed panels of row-contiguous moving row by row */
            const int64_t v_rows_first = !v_direct && J->v_sn == 1 && J->v_sk != 1 ? nb / NR : 0;
            if (v_rows_first > 0)
                pack_panels_rows(v, J->v_dt, J->v_sk, k0, kc, J->n0 + jb, v_rows_first, NR, vp,
                                 kc * NR);
            for (int64_t jp = v_rows_first; jp < np_; jp++) {
                const int64_t x0 = jp * NR, xn = nb - x0 < NR ? nb - x0 : NR;
                if (v_direct && xn == panel_width(F, xn)) continue;
                pack_one(F, v, J->v_dt, J->v_sk, J->v_sn, k0, kc, J->n0 + jb + x0, xn,
                           panel_width(F, xn), vp + jp * kc * NR);
            }
            /* Row panels outside the column panels: one stationary panel stays in L1 while
             * the block's moving panels stream from L2, and out is walked in row strips
             * (a column strip of a wide out is rows a power of two apart, which conflict). */
            for (int64_t ip = 0; ip < mp; ip++) {
                const int64_t i0 = ip * MR, in = M - i0 < MR ? M - i0 : MR;
                const float *a = (const float *)(sp + ip * kc * MR);
                int64_t ak = MR, ai = 1;
                if (s_direct) {
                    a = (const float *)s + k0 * J->s_sk + i0 * J->s_sm;
                    ak = J->s_sk, ai = J->s_sm;
                }
                for (int64_t jp = 0; jp < np_; jp++) {
                    const int64_t j0 = jb + jp * NR, jn = Nj - j0 < NR ? Nj - j0 : NR;
                    const float *b = (const float *)(vp + jp * kc * NR);
                    int64_t bk = panel_width(F, jn);
                    if (v_direct && jn == bk) {
                        b = (const float *)v + k0 * J->v_sk + J->n0 + j0;
                        bk = J->v_sk;
                    }
                    float *o = out + i0 * J->o_sm + (J->n0 + j0) * J->o_sn;
                    if (J->o_sn == 1) {
                        kern(kc, a, ak, ai, b, bk, o, J->o_sm, add, (int)in, (int)jn);
                    } else {
                        /* neither output stride is 1: compute the tile aside, then scatter it */
                        kern(kc, a, ak, ai, b, bk, tile, NR, 0, (int)in, (int)jn);
                        for (int64_t i = 0; i < in; i++) {
                            for (int64_t j = 0; j < jn; j++) {
                                float *d = o + i * J->o_sm + j * J->o_sn;
                                float t = tile[i * NR + j];
                                *d = canon_f32(add ? *d + t : t);
                            }
                        }
                    }
                }
            }
        }
    }
}

static void run_job(job *J) {
#if TRN_X86
    /* IEEE behaviour regardless of the caller's MXCSR: no FTZ/DAZ, round to nearest, all
     * exceptions masked. Restored on exit. */
    const unsigned int saved_csr = _mm_getcsr();
    _mm_setcsr((saved_csr & ~(0x8000u | 0x0040u | 0x6000u)) | 0x1f80u);
#endif
    const int64_t MR = J->fam.mr, NR = J->fam.nr;
    const int64_t kmax = J->K < J->k_chunk ? J->K : J->k_chunk;
    const int64_t NC = block_cols(&J->fam, kmax), Nj = J->n1 - J->n0;
    const int64_t mp = (J->M + MR - 1) / MR, np_ = ((Nj < NC ? Nj : NC) + NR - 1) / NR;
    /* 64-byte aligned regions: packed stationary, packed moving, one output tile */
    const size_t sp_n = ((size_t)(kmax * mp * MR) + 15) & ~(size_t)15;
    const size_t vp_n = ((size_t)(kmax * np_ * NR) + 15) & ~(size_t)15;
    const size_t tile_n = ((size_t)(MR * NR) + 15) & ~(size_t)15;
    uint32_t *sp = scratch_get((sp_n + vp_n + tile_n) * sizeof(float));
    if (!sp) {
        J->status = TRN_ENOMEM;
    } else {
        uint32_t *vp = sp + sp_n;
        float *tile = (float *)(vp + vp_n);
        const int64_t ss = dt_size(J->s_dt), vs = dt_size(J->v_dt);
        for (int64_t b = J->b0; b < J->b1; b++) {
            run_item(J, J->s + b * J->s_sb * ss, J->v + b * J->v_sb * vs, J->out + b * J->o_sb,
                     sp, vp, tile);
        }
    }
    scratch_trim(SCRATCH_KEEP);
#if TRN_X86
    _mm_setcsr(saved_csr);
#endif
}

static void *run_job_thread(void *arg) {
    run_job((job *)arg);
    scratch_trim(0);
    return NULL;
}

int trn_matmul_batched(const void *s, int s_dt, int64_t s_sb, int64_t s_sk, int64_t s_sm,
                       const void *v, int v_dt, int64_t v_sb, int64_t v_sk, int64_t v_sn,
                       float *out, int64_t o_sb, int64_t o_sm, int64_t o_sn,
                       int64_t B, int64_t K, int64_t M, int64_t N, int64_t k_chunk,
                       int accumulate, int isa, int fma_policy, int nthreads) {
    if (!dtype_ok(s_dt) || !dtype_ok(v_dt)) return TRN_EDTYPE;
    if (B < 0 || K < 0 || M < 0 || N < 0 || k_chunk < 1) return TRN_EARG;
    if (fma_policy != TRN_FMA_OFF && fma_policy != TRN_FMA_ON) return TRN_EARG;
    if (isa == TRN_ISA_AUTO) isa = trn_best_isa();
    if (isa > trn_best_isa()) return TRN_EISA;
    if (B == 0 || M == 0 || N == 0) return TRN_OK;

    /* out[m,n] = sum_k s[k,m] v[k,n] and out^T[n,m] = sum_k v[k,n] s[k,m] are the same
     * numbers (a fused multiply-add is symmetric in its two factors; the k order is unchanged), so a column-major out
     * is computed as the transposed problem, whose rows are contiguous. */
    if (o_sn != 1 && o_sm == 1) {
        const void *tp = s;
        int tdt = s_dt;
        int64_t tb = s_sb, tk = s_sk, tx = s_sm, tn = M;
        s = v, s_dt = v_dt, s_sb = v_sb, s_sk = v_sk, s_sm = v_sn, M = N;
        v = tp, v_dt = tdt, v_sb = tb, v_sk = tk, v_sn = tx, N = tn;
        o_sm = o_sn, o_sn = 1;
    }

    job base;
    memset(&base, 0, sizeof base);
    base.s = (const char *)s, base.s_dt = s_dt, base.s_sb = s_sb, base.s_sk = s_sk;
    base.s_sm = s_sm;
    base.v = (const char *)v, base.v_dt = v_dt, base.v_sb = v_sb, base.v_sk = v_sk;
    base.v_sn = v_sn;
    base.out = out, base.o_sb = o_sb, base.o_sm = o_sm, base.o_sn = o_sn;
    base.B = B, base.K = K, base.M = M, base.N = N, base.k_chunk = k_chunk;
    base.accumulate = accumulate, base.fma_policy = fma_policy;
    if (!get_family(isa, &base.fam)) return TRN_EISA;
    base.b0 = 0, base.b1 = B, base.n0 = 0, base.n1 = N;

    /* Threads split the batch when it has an item per thread (attention heads are often one
     * narrow panel each), else the output columns, NR-aligned; every element is computed
     * exactly as in the single-threaded run, so the result does not depend on the thread
     * count. */
    const int64_t panels = (N + base.fam.nr - 1) / base.fam.nr;
    int64_t nt = nthreads < 1 ? 1 : nthreads;
    if (nt > 64) nt = 64;
    const int by_batch = B >= nt;
    if (!by_batch && nt > panels) nt = panels;
    if (nt <= 1) {
        run_job(&base);
        return base.status;
    }
    job jobs[64];
    pthread_t tids[64];
    int started[64];
    int status = TRN_OK;
    for (int64_t t = 0; t < nt; t++) {
        jobs[t] = base;
        if (by_batch) {
            jobs[t].b0 = B * t / nt;
            jobs[t].b1 = B * (t + 1) / nt;
        } else {
            jobs[t].n0 = (panels * t / nt) * base.fam.nr;
            jobs[t].n1 = (panels * (t + 1) / nt) * base.fam.nr;
            if (jobs[t].n1 > N) jobs[t].n1 = N;
        }
    }
    for (int64_t t = 1; t < nt; t++) {
        started[t] = pthread_create(&tids[t], NULL, run_job_thread, &jobs[t]) == 0;
        if (!started[t]) run_job(&jobs[t]);
    }
    run_job(&jobs[0]);
    for (int64_t t = 0; t < nt; t++) {
        if (t > 0 && started[t]) pthread_join(tids[t], NULL);
        if (jobs[t].status != TRN_OK) status = jobs[t].status;
    }
    return status;
}

int trn_matmul(const void *s, int s_dt, int64_t s_sk, int64_t s_sm,
               const void *v, int v_dt, int64_t v_sk, int64_t v_sn,
               float *out, int64_t o_sm, int64_t o_sn,
               int64_t K, int64_t M, int64_t N, int64_t k_chunk,
               int accumulate, int isa, int fma_policy, int nthreads) {
    return trn_matmul_batched(s, s_dt, 0, s_sk, s_sm, v, v_dt, 0, v_sk, v_sn, out, 0, o_sm, o_sn,
                              1, K, M, N, k_chunk, accumulate, isa, fma_policy, nthreads);
}

/* ---------------------------------------------------------------------------------------- */
/* Grouped 2-d convolutions (depthwise ones above all) computed as the datapath computes their
 * im2col matmuls, without the im2col: output element (n, k, ho, wo) of group g = k / (K/groups)
 * is the matmul element weights[k, :] . patches[:, (n, ho, wo)] over the group's C/groups*R*S
 * taps in im2col order (channel, then filter row, then column), chunked every k_chunk taps: each
 * chunk from +0.0 with one fused multiply-add per tap, chunk results added to the output in
 * order (reference.py's rules). The input comes zero-padded, so a padding tap is the same
 * fmaf(w, +0.0, acc) the im2col matmul makes. Per element the operations are the matmul's, in
 * its order, so the bits are too; one matmul per group with one output row each (depthwise) is
 * what made the datapath slow here. */
static inline __attribute__((always_inline)) void
conv_grouped_body(const float *x, int64_t C, int64_t H, int64_t W, const float *w, int64_t K,
                  int64_t CG, int64_t R, int64_t S, int64_t KG, int64_t sh, int64_t sw, int64_t dh,
                  int64_t dw, int64_t Ho, int64_t Wo, int64_t k_chunk, int64_t n, int64_t k,
                  float *o, float *acc) {
    const int64_t ck = CG * R * S, g = k / KG, P = Ho * Wo;
    if (P <= 16) {
        /* a few output elements (the last stages of a small network): the same taps in the same
         * order per element (so the same bits), each tap one pass over the elements at offsets
         * worked out once, without a loop over rows and columns per tap, whose set-up cost more
         * than the tap when a row is a few elements */
        int64_t off[16];
        for (int64_t ho = 0, p = 0; ho < Ho; ho++)
            for (int64_t wo = 0; wo < Wo; wo++) off[p++] = ho * sh * W + wo * sw;
        float a[16];
        int64_t c = 0, r = 0, s = 0;
        for (int64_t c0 = 0; c0 < ck; c0 += k_chunk) {
            const int64_t c1 = c0 + k_chunk < ck ? c0 + k_chunk : ck;
            for (int64_t p = 0; p < P; p++) a[p] = 0.0f;
            for (int64_t kk = c0; kk < c1; kk++) {
                const float wv = w[k * ck + kk];
                const float *xc = x + ((n * C + g * CG + c) * H + r * dh) * W + s * dw;
                for (int64_t p = 0; p < P; p++) a[p] = fmaf(wv, xc[off[p]], a[p]);
                if (++s == S) {
                    s = 0;
                    if (++r == R) {
                        r = 0;
                        c++;
                    }
                }
            }
            for (int64_t p = 0; p < P; p++) o[p] = c0 == 0 ? a[p] : o[p] + a[p];
        }
        for (int64_t p = 0; p < P; p++) o[p] = canon_f32(o[p]);
        return;
    }
    for (int64_t c0 = 0; c0 < ck; c0 += k_chunk) {
        const int64_t c1 = c0 + k_chunk < ck ? c0 + k_chunk : ck;
        for (int64_t i = 0; i < P; i++) acc[i] = 0.0f;
        /* the tap's (channel, row, column), stepped along with kk: a division per tap cost more
         * than the tap's multiply-adds when the output is a few elements */
        int64_t c = c0 / (R * S), r = (c0 / S) % R, s = c0 % S;
        for (int64_t kk = c0; kk < c1; kk++) {
            const float wv = w[k * ck + kk];
            const float *xc = x + ((n * C + g * CG + c) * H + r * dh) * W + s * dw;
            for (int64_t ho = 0; ho < Ho; ho++) {
                const float *xr = xc + ho * sh * W;
                float *ar = acc + ho * Wo;
                if (sw == 1) {
                    for (int64_t wo = 0; wo < Wo; wo++) ar[wo] = fmaf(wv, xr[wo], ar[wo]);
                } else {
                    for (int64_t wo = 0; wo < Wo; wo++) ar[wo] = fmaf(wv, xr[wo * sw], ar[wo]);
                }
            }
            if (++s == S) {  /* the next tap in im2col order: column, then row, then channel */
                s = 0;
                if (++r == R) {
                    r = 0;
                    c++;
                }
            }
        }
        if (c0 == 0) {
            for (int64_t i = 0; i < P; i++) o[i] = acc[i];
        } else {
            for (int64_t i = 0; i < P; i++) o[i] = o[i] + acc[i];
        }
    }
    for (int64_t i = 0; i < P; i++) o[i] = canon_f32(o[i]);
}

#define CONV_GROUPED(NAME, ATTR)                                                                 \
    ATTR static void NAME(const float *x, int64_t N, int64_t C, int64_t H, int64_t W,            \
                          const float *w, int64_t K, int64_t CG, int64_t R, int64_t S,           \
                          int64_t KG, int64_t sh, int64_t sw, int64_t dh, int64_t dw,            \
                          int64_t Ho, int64_t Wo, int64_t k_chunk, float *out, float *acc) {     \
        for (int64_t n = 0; n < N; n++)                                                          \
            for (int64_t k = 0; k < K; k++)                                                      \
                conv_grouped_body(x, C, H, W, w, K, CG, R, S, KG, sh, sw, dh, dw, Ho, Wo,        \
                                  k_chunk, n, k, out + (n * K + k) * Ho * Wo, acc);              \
    }

CONV_GROUPED(conv_grouped_generic, )
#if TRN_X86
CONV_GROUPED(conv_grouped_fma, __attribute__((target("avx2,fma"))))
#endif

int trn_conv2d_grouped(const float *x, int64_t N, int64_t C, int64_t H, int64_t W,
                       const float *w, int64_t K, int64_t CG, int64_t R, int64_t S, int64_t groups,
                       int64_t sh, int64_t sw, int64_t dh, int64_t dw, int64_t Ho, int64_t Wo,
                       int64_t k_chunk, float *out) {
    if (N < 0 || C < 0 || H < 0 || W < 0 || K < 0 || CG < 1 || R < 1 || S < 1 || groups < 1 ||
        sh < 1 || sw < 1 || dh < 1 || dw < 1 || Ho < 0 || Wo < 0 || k_chunk < 1 ||
        C != CG * groups || K % groups != 0 || (Ho > 0 && (Ho - 1) * sh + (R - 1) * dh >= H) ||
        (Wo > 0 && (Wo - 1) * sw + (S - 1) * dw >= W))
        return TRN_EARG;
    if (N == 0 || K == 0 || Ho == 0 || Wo == 0) return TRN_OK;
    float *acc = malloc((size_t)(Ho * Wo) * sizeof(float));
    if (!acc) return TRN_ENOMEM;
#if TRN_X86
    const unsigned int saved_csr = _mm_getcsr();
    _mm_setcsr((saved_csr & ~(0x8000u | 0x0040u | 0x6000u)) | 0x1f80u);
    if (trn_best_isa() >= TRN_ISA_AVX2)
        conv_grouped_fma(x, N, C, H, W, w, K, CG, R, S, K / groups, sh, sw, dh, dw, Ho, Wo, k_chunk,
                         out, acc);
    else
#endif
        conv_grouped_generic(x, N, C, H, W, w, K, CG, R, S, K / groups, sh, sw, dh, dw, Ho, Wo,
                             k_chunk, out, acc);
#if TRN_X86
    _mm_setcsr(saved_csr);
#endif
    free(acc);
    return TRN_OK;
}
