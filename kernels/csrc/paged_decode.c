/* Paged decode attention on the CPU: one query per request over the slots of its own range, read
 * straight from the slot-indexed pool (no gather into a padded copy, no score matrix beyond one
 * request's row). Built by kernels/native.py with the system C compiler; see that file.
 *
 *   q        [B, Hq, D]      fp32, contiguous
 *   k, v     [S, Hkv, D]     fp32, contiguous (the pool of one layer)
 *   slots    [N]             int64: request b reads slots[offsets[b] .. offsets[b + 1])
 *   offsets  [B + 1]         int64, offsets[0] = 0, every range non-empty
 *   out      [B, Hq, D]      fp32: softmax(q k^T * scale) v
 *   lse      [B, Hq]         fp32: natural log-sum-exp of the scaled scores (to merge passes)
 *
 * Work item = (request, KV head): its GROUP = Hq / Hkv query heads read each key row once. Scores
 * are computed in one pass, then exponentiated against their maximum, then V is accumulated.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int strata_paged_decode_f32(const float *q, const float *k, const float *v, const int64_t *slots,
                            const int64_t *offsets, int64_t batch, int64_t hq, int64_t hkv, int64_t d,
                            float scale, float *out, float *lse) {
    const int64_t group = hq / hkv;
    int failed = 0;
#pragma omp parallel
    {
        float *scores = NULL;
        float *acc = malloc(sizeof(float) * group * d);
        int64_t cap = 0;
        if (acc == NULL) failed = 1;
#pragma omp for schedule(dynamic, 4)
        for (int64_t w = 0; w < batch * hkv; w++) {
            if (failed) continue;
            const int64_t b = w / hkv, h = w % hkv;
            const int64_t n = offsets[b + 1] - offsets[b];
            const int64_t *sl = slots + offsets[b];
            if (n * group > cap) {
                free(scores);
                cap = n * group;
                scores = malloc(sizeof(float) * cap);
                if (scores == NULL) { failed = 1; cap = 0; continue; }
            }
            const float *qh = q + (b * hq + h * group) * d;
            for (int64_t i = 0; i < n; i++) {
                const float *kr = k + (sl[i] * hkv + h) * d;
                for (int64_t g = 0; g < group; g++) {
                    const float *qg = qh + g * d;
                    float s = 0.f;
#pragma omp simd reduction(+ : s)
                    for (int64_t j = 0; j < d; j++) s += qg[j] * kr[j];
                    scores[g * n + i] = s * scale;
                }
            }
            memset(acc, 0, sizeof(float) * group * d);
            for (int64_t g = 0; g < group; g++) {
                float *sg = scores + g * n;
                float m = sg[0];
                for (int64_t i = 1; i < n; i++) m = sg[i] > m ? sg[i] : m;
                float total = 0.f;
#pragma omp simd reduction(+ : total)
                for (int64_t i = 0; i < n; i++) {
                    sg[i] = expf(sg[i] - m);
                    total += sg[i];
                }
                lse[b * hq + h * group + g] = m + logf(total);
                const float inv = 1.f / total;
                for (int64_t i = 0; i < n; i++) sg[i] *= inv;
            }
            for (int64_t i = 0; i < n; i++) {
                const float *vr = v + (sl[i] * hkv + h) * d;
                for (int64_t g = 0; g < group; g++) {
                    const float p = scores[g * n + i];
                    float *ag = acc + g * d;
#pragma omp simd
                    for (int64_t j = 0; j < d; j++) ag[j] += p * vr[j];
                }
            }
            memcpy(out + (b * hq + h * group) * d, acc, sizeof(float) * group * d);
        }
        free(scores);
        free(acc);
    }
    return failed ? -1 : 0;
}
