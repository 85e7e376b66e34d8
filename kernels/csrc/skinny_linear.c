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

/* One row: out[n] = sum_k x[k] * w[n, k] (+ bias[n]), fp32 (a batch-1 decode step's every matrix).
 *
 * Such a step reads every weight once and does one multiply-add per weight: it is bound by how
 * fast the weights stream from memory. MKL's sgemv and oneDNN's packed weights read them at
 * 11-13 GB/s on an AVX2 EPYC whose plain `sum` over the same bytes runs at 19-22 GB/s. Here each
 * thread walks its share of the rows 8 at a time, one 8-lane accumulator per row: 8 independent
 * streams for the hardware prefetchers, 8 + 1 registers on AVX2's 16, K in steps of 8 with a
 * scalar tail. Measured there (2 threads, cold weights): Qwen3-0.6B's 151,936 x 1,024 LM head
 * 28-35 ms against oneDNN's 46-47 and MKL's 59; the bench model's 57 matrices 8.7 against 11.8-13.2
 * and 15.3-16.0 ms. The summation order is not MKL's (about 1e-6 relative). */
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

static inline __attribute__((always_inline)) void gemv_tile(const float *x, const float *w, float *out,
                                                            int64_t k_len, const int r_len) {
    v8 acc[8];
    for (int r = 0; r < r_len; r++) acc[r] = (v8){0};
    int64_t k = 0;
    for (; k + 8 <= k_len; k += 8) {
        v8 xv = load8(x + k);
        for (int r = 0; r < r_len; r++) acc[r] += load8(w + r * k_len + k) * xv;
    }
    for (int r = 0; r < r_len; r++) {
        float s = hsum8(acc[r]);
        for (int64_t j = k; j < k_len; j++) s += w[r * k_len + j] * x[j];
        out[r] = s;
    }
}

/* x [K], w [N, K], bias [N] or NULL, out [N]: contiguous fp32. */
void strata_gemv_f32(const float *x, const float *w, const float *bias, float *out, int64_t n_len, int64_t k_len) {
    int64_t tiles = n_len / 8;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tiles; t++) gemv_tile(x, w + t * 8 * k_len, out + t * 8, k_len, 8);
    for (int64_t n = tiles * 8; n < n_len; n++) gemv_tile(x, w + n * k_len, out + n, k_len, 1);
    if (bias)
        for (int64_t n = 0; n < n_len; n++) out[n] += bias[n];
}
