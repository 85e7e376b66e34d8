/* Paged decode attention on the CPU: one query per request over the slots of its own range, read
 * straight from the slot-indexed pool (no gather into a padded copy, no score matrix beyond one
 * request's row). Built by kernels/native.py with the system C compiler; see that file.
 *
 *   q        [B, Hq, D]      fp32, contiguous
 *   k, v     [S, Hkv, D]     fp32, contiguous (the pool of one layer)
 *   slots    [N]             int64: request b reads slots[starts[b] .. ends[b])
 *   starts, ends [B]         int64, every range non-empty (ranges may overlap or leave gaps: the
 *                            slot table itself can be passed, each request pointing into its row)
 *   out      [B, Hq, D]      fp32: softmax(q k^T * scale) v
 *   lse      [B, Hq]         fp32: natural log-sum-exp of the scaled scores (to merge passes)
 *
 * Work item = one request: each slot's K (then V) row — every KV head, Hkv * D contiguous floats —
 * is read once, front to back, for all Hq query heads (query head h reads KV head h / (Hq / Hkv)).
 * Scores go to a [Hq, n] scratch row, are exponentiated against their maximum, then V rows are
 * accumulated. Rows a few slots ahead are prefetched: slots are scattered, so the hardware cannot
 * guess the next row.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define PREFETCH_AHEAD 4

/* Prefetch the row of `row` floats at `base + slot * row` (every KV head of one slot). */
static inline void prefetch_row(const float *base, int64_t slot, int64_t row) {
    const char *p = (const char *)(base + slot * row);
    for (int64_t off = 0; off < row * (int64_t)sizeof(float); off += 64) __builtin_prefetch(p + off);
}

int strata_paged_decode_f32(const float *q, const float *k, const float *v, const int64_t *slots,
                            const int64_t *starts, const int64_t *ends, int64_t batch, int64_t hq, int64_t hkv, int64_t d,
                            float scale, float *out, float *lse) {
    const int64_t group = hq / hkv;
    const int64_t row = hkv * d;
    int failed = 0;
#pragma omp parallel
    {
        float *scores = NULL;
        int64_t cap = 0;
        float *acc = malloc(sizeof(float) * hq * d);
        if (acc == NULL) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t b = 0; b < batch; b++) {
            if (failed) continue;
            const int64_t n = ends[b] - starts[b];
            const int64_t *sl = slots + starts[b];
            if (n * hq > cap) {
                free(scores);
                cap = n * hq;
                scores = malloc(sizeof(float) * cap);
                if (scores == NULL) { failed = 1; cap = 0; continue; }
            }
            const float *qb = q + b * hq * d;
            for (int64_t i = 0; i < n; i++) {
                if (i + PREFETCH_AHEAD < n) prefetch_row(k, sl[i + PREFETCH_AHEAD], row);
                const float *kr = k + sl[i] * row;
                for (int64_t h = 0; h < hq; h++) {
                    const float *qh = qb + h * d;
                    const float *kh = kr + (h / group) * d;
                    float s = 0.f;
#pragma omp simd reduction(+ : s)
                    for (int64_t j = 0; j < d; j++) s += qh[j] * kh[j];
                    scores[h * n + i] = s * scale;
                }
            }
            for (int64_t h = 0; h < hq; h++) {
                float *sh = scores + h * n;
                float m = sh[0];
                for (int64_t i = 1; i < n; i++) m = sh[i] > m ? sh[i] : m;
                float total = 0.f;
#pragma omp simd reduction(+ : total)
                for (int64_t i = 0; i < n; i++) {
                    sh[i] = expf(sh[i] - m);
                    total += sh[i];
                }
                lse[b * hq + h] = m + logf(total);
                const float inv = 1.f / total;
#pragma omp simd
                for (int64_t i = 0; i < n; i++) sh[i] *= inv;
            }
            memset(acc, 0, sizeof(float) * hq * d);
            for (int64_t i = 0; i < n; i++) {
                if (i + PREFETCH_AHEAD < n) prefetch_row(v, sl[i + PREFETCH_AHEAD], row);
                const float *vr = v + sl[i] * row;
                for (int64_t h = 0; h < hq; h++) {
                    const float p = scores[h * n + i];
                    const float *vh = vr + (h / group) * d;
                    float *ah = acc + h * d;
#pragma omp simd
                    for (int64_t j = 0; j < d; j++) ah[j] += p * vh[j];
                }
            }
            memcpy(out + b * hq * d, acc, sizeof(float) * hq * d);
        }
        free(scores);
        free(acc);
    }
    return failed ? -1 : 0;
}
