/* One decode step of the gated delta rule (Qwen3-Next's linear attention) over a pool of states,
 * in one pass per (request, value head): the torch path (kernels/gated_delta.py) runs ~10 kernels
 * over tiny tensors per layer, and at a decode step their dispatch, not the arithmetic, is what
 * they cost. Built into the same library as paged_decode.c (see kernels/native.py).
 *
 * Per value head h of request b, with S = state[idx[b], h] ([Dk, Dv], fp32, row-major), the key /
 * query head h / (Hv / Hk), q and k already L2-normalised and q already scaled:
 *
 *   S <- S * exp(g);  u = k^T S;  d = beta * (v - u);  S <- S + k (x) d;  o = q^T S
 *
 * in two passes over S's rows: the decay and u, then the update and o. Sums run over the rows in
 * order (torch's reductions may block them otherwise: the two agree to a few ulps).
 * q, k [B, Hk, Dk]; v [B, Hv, Dv]; g, beta [B, Hv]; out [B, Hv, Dv]: fp32, contiguous.
 * state [N, Hv, Dk, Dv] fp32 contiguous; idx [B] int64, distinct, each in [0, N). Returns 0; -1
 * when Dv is larger than the kernel's stack buffers (the caller keeps the torch path); -2, before
 * touching anything, when an index is outside the pool.
 */
#include <math.h>
#include <stdint.h>

#define GD_MAX_DV 1024

int strata_gated_delta_step_f32(const float *q, const float *k, const float *v, const float *g, const float *beta,
                                float *state, const int64_t *idx, float *out, int64_t batch, int64_t hk,
                                int64_t hv, int64_t dk, int64_t dv, int64_t pool) {
    if (dv > GD_MAX_DV) return -1;
    for (int64_t b = 0; b < batch; b++)
        if (idx[b] < 0 || idx[b] >= pool) return -2;
    const int64_t rep = hv / hk;
#pragma omp parallel for schedule(static) if (batch * hv * dk * dv > 65536)
    for (int64_t bh = 0; bh < batch * hv; bh++) {
        const int64_t b = bh / hv, h = bh % hv;
        float *s = state + (idx[b] * hv + h) * dk * dv;
        const float *qh = q + (b * hk + h / rep) * dk;
        const float *kh = k + (b * hk + h / rep) * dk;
        const float *vh = v + bh * dv;
        const float decay = expf(g[bh]), bt = beta[bh];
        float u[GD_MAX_DV], d[GD_MAX_DV];
        float *o = out + bh * dv;
        for (int64_t j = 0; j < dv; j++) u[j] = 0.0f;
        for (int64_t i = 0; i < dk; i++) {
            float *row = s + i * dv;
            const float ki = kh[i];
#pragma omp simd
            for (int64_t j = 0; j < dv; j++) {
                row[j] *= decay;
                u[j] += row[j] * ki;
            }
        }
#pragma omp simd
        for (int64_t j = 0; j < dv; j++) {
            d[j] = (vh[j] - u[j]) * bt;
            o[j] = 0.0f;
        }
        for (int64_t i = 0; i < dk; i++) {
            float *row = s + i * dv;
            const float ki = kh[i], qi = qh[i];
#pragma omp simd
            for (int64_t j = 0; j < dv; j++) {
                row[j] += ki * d[j];
                o[j] += row[j] * qi;
            }
        }
    }
    return 0;
}
