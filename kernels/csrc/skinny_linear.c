/* A linear layer over a few rows: out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]), fp32, 1 <= M <= 8.
 *
 * A decode step of a small batch multiplies a handful of hidden vectors by every weight matrix of
 * the model. The weights do not stay in cache from one step to the next, so the step can be no
 * faster than streaming them from memory once, which MKL's sgemm does at M = 1 but not at
 * M = 2..8: on the bench model's layers, with cold weights, it took 1.8x the time of M = 1 at
 * M = 4 and 2.2x at M = 8. This kernel reads each weight row once and multiplies it with every
 * input row while it is in registers: R weight rows x M input rows of 16-lane accumulators (R = 4
 * up to M = 4, 3 beyond: 24 accumulators and 4 operands fit AVX-512's 32 registers), K walked 16
 * at a time with a scalar tail, each accumulator summed across its lanes at the end.
 *
 * Threads (OpenMP, static) split the weight rows. Every (M, R) pair is its own function, so the
 * compiler sees both as constants inside the outlined parallel region and keeps the accumulators
 * in registers. The summation order is not MKL's: results agree with torch's to rounding (about
 * 1e-6 relative), not bit for bit, as MKL's own results differ between M = 1 and M = 8.
 */
#include <stdint.h>
#include <string.h>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

typedef float v16 __attribute__((vector_size(64)));

static inline v16 load16(const float *p) {
    v16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline float hsum16(v16 v) {
#ifdef __AVX512F__
    return _mm512_reduce_add_ps((__m512)v);
#else
    float s = 0.0f;
    for (int i = 0; i < 16; i++) s += v[i];
    return s;
#endif
}

#define MAX_R 4
#define MAX_M 8

/* Weight rows w[0 .. r_len) (row stride k_len) against the m_len input rows of x; results into
 * out[m * ldo + r]. Inlined with constant m_len and r_len. */
static inline __attribute__((always_inline)) void tile(const float *x, const float *w, float *out, int64_t ldo,
                                                       int64_t k_len, const int m_len, const int r_len) {
    v16 acc[MAX_R][MAX_M];
    for (int r = 0; r < r_len; r++)
        for (int m = 0; m < m_len; m++) acc[r][m] = (v16){0};
    int64_t k = 0;
    for (; k + 16 <= k_len; k += 16) {
        v16 b[MAX_R];
        for (int r = 0; r < r_len; r++) {
            b[r] = load16(w + r * k_len + k);
            __builtin_prefetch(w + r * k_len + k + 256);
        }
        for (int m = 0; m < m_len; m++) {
            v16 xv = load16(x + m * k_len + k);
            for (int r = 0; r < r_len; r++) acc[r][m] += b[r] * xv;
        }
    }
    for (int r = 0; r < r_len; r++)
        for (int m = 0; m < m_len; m++) {
            float s = hsum16(acc[r][m]);
            for (int64_t j = k; j < k_len; j++) s += w[r * k_len + j] * x[m * k_len + j];
            out[m * ldo + r] = s;
        }
}

#define DEFINE_RUN(M, R)                                                                                 \
    static void run_##M(const float *x, const float *w, float *out, int64_t n_len, int64_t k_len) {    \
        int64_t tiles = n_len / (R);                                                                     \
        _Pragma("omp parallel for schedule(static)") for (int64_t t = 0; t < tiles; t++)                 \
            tile(x, w + t * (R) * k_len, out + t * (R), n_len, k_len, M, R);                             \
        for (int64_t n = tiles * (R); n < n_len; n++) tile(x, w + n * k_len, out + n, n_len, k_len, M, 1); \
    }

DEFINE_RUN(1, 4)
DEFINE_RUN(2, 4)
DEFINE_RUN(3, 4)
DEFINE_RUN(4, 4)
DEFINE_RUN(5, 3)
DEFINE_RUN(6, 3)
DEFINE_RUN(7, 3)
DEFINE_RUN(8, 3)

/* x [M, K], w [N, K], bias [N] or NULL, out [M, N]: contiguous fp32. Returns 0, or -1 when M is
 * outside [1, 8] (nothing written). */
int strata_skinny_linear_f32(const float *x, const float *w, const float *bias, float *out, int64_t m_len,
                             int64_t n_len, int64_t k_len) {
    switch (m_len) {
    case 1: run_1(x, w, out, n_len, k_len); break;
    case 2: run_2(x, w, out, n_len, k_len); break;
    case 3: run_3(x, w, out, n_len, k_len); break;
    case 4: run_4(x, w, out, n_len, k_len); break;
    case 5: run_5(x, w, out, n_len, k_len); break;
    case 6: run_6(x, w, out, n_len, k_len); break;
    case 7: run_7(x, w, out, n_len, k_len); break;
    case 8: run_8(x, w, out, n_len, k_len); break;
    default: return -1;
    }
    if (bias)
        for (int64_t m = 0; m < m_len; m++)
            for (int64_t n = 0; n < n_len; n++) out[m * n_len + n] += bias[n];
    return 0;
}

/* 1 where this build keeps the kernel's accumulators in registers: AVX-512's 32 registers hold
 * the 24 16-lane accumulators and 4 operands; AVX2's 16 (8-lane) registers do not, and there the
 * spills made it slower than MKL (2.5x at M = 8 on an AVX2-only EPYC: kernels/linear.py). */
int strata_skinny_linear_pays(void) {
#ifdef __AVX512F__
    return 1;
#else
    return 0;
#endif
}

/* A few rows with 8-lane vectors: out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]), fp32, 1 <= M <= 8.
 *
 * A decode step of a small batch reads every weight once and does M multiply-adds with each: it
 * is bound by how fast the weights stream from memory. MKL's sgemm and oneDNN's packed weights read
 * them at 11-13 GB/s at one row on an AVX2 EPYC whose plain `sum` over the same bytes runs at
 * 19-22 GB/s, and slower from two rows. Here each thread walks its share of the rows R at a time,
 * one 8-lane accumulator per (row, input) pair: R independent streams for the hardware prefetchers,
 * R x M accumulators + R weight vectors + 1 input vector within AVX2's 16 registers (R = 8 at one
 * row, 4 at two, 3 at three and four, 2 at five, 1 from six), K in steps of 8 with a scalar tail.
 * The same code serves AVX-512 builds (with 8 lanes). Measured there (2 threads, cold weights),
 * the bench model's 57 matrices, ms per pass, kernel / oneDNN packed / MKL:
 *
 *     M = 1   9.6-10.4 / 13.4-18.8 / 18.2-18.6      M = 4   16.0 / 25.7-26.2 / 34.7-37.0
 *     M = 2  11.9-13.1 / 19.3-20.6 / 27.9-32.9      M = 8   18.3-18.6 / 24.5-26.9 / 36.9
 *
 * and Qwen3-0.6B's 151,936 x 1,024 LM head at one row 28-35 ms against 46-47 and 59. The
 * summation order is not MKL's (about 1e-6 relative). */
typedef float v8 __attribute__((vector_size(32)));

static inline v8 load8(const float *p) {
    v8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline float hsum8(v8 v) {
    float s = 0.0f;
    for (int i = 0; i < 8; i++) s += v[i];
    return s;
}

#define MAX_R8 8

/* Weight rows w[0 .. r_len) (row stride k_len) against the m_len input rows of x; results into
 * out[m * ldo + r]. Inlined with constant m_len and r_len. */
static inline __attribute__((always_inline)) void tile8(const float *x, const float *w, float *out, int64_t ldo,
                                                        int64_t k_len, const int m_len, const int r_len) {
    v8 acc[MAX_R8][MAX_M];
    for (int r = 0; r < r_len; r++)
        for (int m = 0; m < m_len; m++) acc[r][m] = (v8){0};
    int64_t k = 0;
    for (; k + 8 <= k_len; k += 8) {
        v8 b[MAX_R8];
        for (int r = 0; r < r_len; r++) b[r] = load8(w + r * k_len + k);
        for (int m = 0; m < m_len; m++) {
            v8 xv = load8(x + m * k_len + k);
            for (int r = 0; r < r_len; r++) acc[r][m] += b[r] * xv;
        }
    }
    for (int r = 0; r < r_len; r++)
        for (int m = 0; m < m_len; m++) {
            float s = hsum8(acc[r][m]);
            for (int64_t j = k; j < k_len; j++) s += w[r * k_len + j] * x[m * k_len + j];
            out[m * ldo + r] = s;
        }
}

#define DEFINE_RUN8(M, R)                                                                                 \
    static void run8_##M(const float *x, const float *w, float *out, int64_t n_len, int64_t k_len) {     \
        int64_t tiles = n_len / (R);                                                                      \
        _Pragma("omp parallel for schedule(static)") for (int64_t t = 0; t < tiles; t++)                  \
            tile8(x, w + t * (R) * k_len, out + t * (R), n_len, k_len, M, R);                             \
        for (int64_t n = tiles * (R); n < n_len; n++) tile8(x, w + n * k_len, out + n, n_len, k_len, M, 1); \
    }

DEFINE_RUN8(1, 8)
DEFINE_RUN8(2, 4)
DEFINE_RUN8(3, 3)
DEFINE_RUN8(4, 3)
DEFINE_RUN8(5, 2)
DEFINE_RUN8(6, 1)
DEFINE_RUN8(7, 1)
DEFINE_RUN8(8, 1)

/* x [M, K], w [N, K], bias [N] or NULL, out [M, N]: contiguous fp32. Returns 0, or -1 when M is
 * outside [1, 8] (nothing written). */
int strata_rows_linear_f32(const float *x, const float *w, const float *bias, float *out, int64_t m_len,
                           int64_t n_len, int64_t k_len) {
    switch (m_len) {
    case 1: run8_1(x, w, out, n_len, k_len); break;
    case 2: run8_2(x, w, out, n_len, k_len); break;
    case 3: run8_3(x, w, out, n_len, k_len); break;
    case 4: run8_4(x, w, out, n_len, k_len); break;
    case 5: run8_5(x, w, out, n_len, k_len); break;
    case 6: run8_6(x, w, out, n_len, k_len); break;
    case 7: run8_7(x, w, out, n_len, k_len); break;
    case 8: run8_8(x, w, out, n_len, k_len); break;
    default: return -1;
    }
    if (bias)
        for (int64_t m = 0; m < m_len; m++)
            for (int64_t n = 0; n < n_len; n++) out[m * n_len + n] += bias[n];
    return 0;
}
