/* The elementwise chains of a decoder layer, each as one pass over its tensor (fp32, contiguous,
 * OpenMP over rows). Torch runs each chain as several kernels, every one reading and writing the
 * whole [T, width] tensor again: at a 2k-token prefill that memory traffic, not the arithmetic,
 * is what they cost. Built into the same library as paged_decode.c (see kernels/native.py).
 *
 *   strata_silu_mul_f32       gate := silu(gate) * up                           (SwiGLU)
 *   strata_add_rms_norm_f32   x := x + residual; out := weight * x / rms(x)     (residual + norm)
 *   strata_rms_norm_rope_f32  per head: x := rotate(weight * x / rms(x))        (q / k norm + rotary)
 *
 * Each row's sum of squares is accumulated in double, so a row's norm does not depend on how the
 * compiler vectorises the loop (torch's own fused RMSNorm accumulates in float, in blocks: the
 * two differ in the last bit at most, well inside the engine's 1e-4 tolerance).
 */
#include <math.h>
#include <stdint.h>

/* Below these sizes (values in the tensor) a chain runs on the calling thread: a decode batch's
 * [64, 512] norm is ~10 us of work, and entering the parallel region right after a GEMM's cost
 * more than that (in a 64-row decode step of the bench model the three chains took 4.9 ms
 * parallel, 2.1 ms with these bounds). silu's expf is heavier, so it goes parallel sooner. */
#ifndef SERIAL_BELOW
#define SERIAL_BELOW 262144
#endif
#ifndef SILU_SERIAL_BELOW
#define SILU_SERIAL_BELOW 16384
#endif

void strata_silu_mul_f32(float *gate, const float *up, int64_t n) {
#pragma omp parallel for simd schedule(static) if (n > SILU_SERIAL_BELOW)
    for (int64_t i = 0; i < n; i++) {
        const float g = gate[i];
        gate[i] = g / (1.0f + expf(-g)) * up[i];
    }
}

static inline float inv_rms(const float *x, int64_t h, float eps) {
    double ss = 0.0;
    for (int64_t j = 0; j < h; j++) ss += (double)x[j] * (double)x[j];
    return (float)(1.0 / sqrt(ss / (double)h + (double)eps));
}

void strata_add_rms_norm_f32(float *x, const float *residual, const float *weight, float *out, int64_t rows,
                             int64_t h, float eps) {
#pragma omp parallel for schedule(static) if (rows * h > SERIAL_BELOW)
    for (int64_t r = 0; r < rows; r++) {
        float *xr = x + r * h;
        const float *res = residual + r * h;
        float *o = out + r * h;
#pragma omp simd
        for (int64_t j = 0; j < h; j++) xr[j] += res[j];
        const float s = inv_rms(xr, h, eps);
#pragma omp simd
        for (int64_t j = 0; j < h; j++) o[j] = weight[j] * (xr[j] * s);
    }
}

/* x [T, H, D] in place: an optional RMSNorm over each head's D values (weight [D], or NULL for
 * none), then the rotary embedding of the first `rot` dims in the rotate-half layout with
 * cos / sin [T, rot / 2]: x1 * c - x2 * s and x2 * c + x1 * s. */
void strata_rms_norm_rope_f32(float *x, int64_t t, int64_t heads, int64_t d, const float *weight, float eps,
                              const float *cos_t, const float *sin_t, int64_t rot) {
    const int64_t half = rot / 2;
#pragma omp parallel for schedule(static) if (t * heads * d > SERIAL_BELOW)
    for (int64_t row = 0; row < t * heads; row++) {
        float *xr = x + row * d;
        const int64_t tok = row / heads;
        const float *c = cos_t + tok * half;
        const float *s = sin_t + tok * half;
        if (weight != 0) {
            const float inv = inv_rms(xr, d, eps);
#pragma omp simd
            for (int64_t j = 0; j < d; j++) xr[j] = weight[j] * (xr[j] * inv);
        }
#pragma omp simd
        for (int64_t j = 0; j < half; j++) {
            const float a = xr[j], b = xr[j + half];
            xr[j] = a * c[j] - b * s[j];
            xr[j + half] = b * c[j] + a * s[j];
        }
    }
}
