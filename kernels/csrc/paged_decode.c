/* Paged decode attention on the CPU: one query per request over the slots of its own range, read
 * straight from the slot-indexed pool (no gather into a padded copy, no score matrix beyond one
 * chunk's row). Built by kernels/native.py with the system C compiler; see that file.
 *
 *   q        [B, Hq, D]      fp32, contiguous
 *   k, v     [S, Hkv, D]     fp32, contiguous (the pool of one layer)
 *   slots    [N]             int64: request b reads slots[starts[b] .. ends[b])
 *   starts, ends [B]         int64, every range non-empty (ranges may overlap or leave gaps: the
 *                            slot table itself can be passed, each request pointing into its row)
 *   out      [B, Hq, D]      fp32: softmax(q k^T * scale) v
 *   lse      [B, Hq]         fp32: natural log-sum-exp of the scaled scores (to merge passes)
 *
 * Work item = one chunk of CHUNK slots of one request (split-K, as flash-decoding does on a GPU), so
 * a single long request keeps every thread busy: decoding one stream was one thread's work. Each
 * slot's K (then V) row — every KV head, Hkv * D contiguous floats — is read once, front to back, for
 * all Hq query heads (query head h reads KV head h / (Hq / Hkv)). A chunk leaves its scores' maximum,
 * their exponentials' sum and the unnormalised sum of V rows; a second pass merges a request's chunks.
 * The chunking depends on the range's length only — not on the batch or the thread count — so a
 * request's result is the same in any batch. Rows a few slots ahead are prefetched: slots are
 * scattered, so the hardware cannot guess the next row.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define PREFETCH_AHEAD 4
#define CHUNK 128

/* Prefetch the row of `row` floats at `base + slot * row` (every KV head of one slot). */
static inline void prefetch_row(const float *base, int64_t slot, int64_t row) {
    const char *p = (const char *)(base + slot * row);
    for (int64_t off = 0; off < row * (int64_t)sizeof(float); off += 64) __builtin_prefetch(p + off);
}

/* One chunk of n <= CHUNK slots for query qb [Hq, D]: per head, the scores' maximum (m), the sum of
 * their exponentials against it (l) and sum_i exp(s_i - m) * v_i (acc [Hq, D]). */
static void attend_chunk(const float *qb, const float *k, const float *v, const int64_t *sl, int64_t n,
                         int64_t hq, int64_t group, int64_t d, int64_t row, float scale, float *scores,
                         float *m, float *l, float *acc) {
    for (int64_t i = 0; i < n; i++) {
        if (i + PREFETCH_AHEAD < n) prefetch_row(k, sl[i + PREFETCH_AHEAD], row);
        const float *kr = k + sl[i] * row;
        for (int64_t h = 0; h < hq; h++) {
            const float *qh = qb + h * d;
            const float *kh = kr + (h / group) * d;
            float s = 0.f;
#pragma omp simd reduction(+ : s)
            for (int64_t j = 0; j < d; j++) s += qh[j] * kh[j];
            scores[h * CHUNK + i] = s * scale;
        }
    }
    for (int64_t h = 0; h < hq; h++) {
        float *sh = scores + h * CHUNK;
        float mh = sh[0];
        for (int64_t i = 1; i < n; i++) mh = sh[i] > mh ? sh[i] : mh;
        float total = 0.f;
#pragma omp simd reduction(+ : total)
        for (int64_t i = 0; i < n; i++) {
            sh[i] = expf(sh[i] - mh);
            total += sh[i];
        }
        m[h] = mh;
        l[h] = total;
    }
    memset(acc, 0, sizeof(float) * hq * d);
    for (int64_t i = 0; i < n; i++) {
        if (i + PREFETCH_AHEAD < n) prefetch_row(v, sl[i + PREFETCH_AHEAD], row);
        const float *vr = v + sl[i] * row;
        for (int64_t h = 0; h < hq; h++) {
            const float p = scores[h * CHUNK + i];
            const float *vh = vr + (h / group) * d;
            float *ah = acc + h * d;
#pragma omp simd
            for (int64_t j = 0; j < d; j++) ah[j] += p * vh[j];
        }
    }
}

int strata_paged_decode_f32(const float *q, const float *k, const float *v, const int64_t *slots,
                            const int64_t *starts, const int64_t *ends, int64_t batch, int64_t hq, int64_t hkv, int64_t d,
                            float scale, float *out, float *lse) {
    const int64_t group = hq / hkv;
    const int64_t row = hkv * d;
    /* first[b] .. first[b + 1]: request b's chunks among the work items */
    int64_t *first = malloc(sizeof(int64_t) * (batch + 1));
    if (first == NULL) return -1;
    first[0] = 0;
    for (int64_t b = 0; b < batch; b++) first[b + 1] = first[b] + (ends[b] - starts[b] + CHUNK - 1) / CHUNK;
    const int64_t items = first[batch];
    int64_t *owner = malloc(sizeof(int64_t) * items);
    /* per item: m [Hq], l [Hq], acc [Hq, D] */
    float *part = malloc(sizeof(float) * items * hq * (d + 2));
    if (owner == NULL || part == NULL) {
        free(first);
        free(owner);
        free(part);
        return -1;
    }
    for (int64_t b = 0; b < batch; b++)
        for (int64_t c = first[b]; c < first[b + 1]; c++) owner[c] = b;
    int failed = 0;
#pragma omp parallel
    {
        float *scores = malloc(sizeof(float) * hq * CHUNK);
        if (scores == NULL) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t c = 0; c < items; c++) {
            if (failed) continue;
            const int64_t b = owner[c];
            const int64_t lo = starts[b] + (c - first[b]) * CHUNK;
            const int64_t n = ends[b] - lo < CHUNK ? ends[b] - lo : CHUNK;
            float *m = part + c * hq * (d + 2);
            attend_chunk(q + b * hq * d, k, v, slots + lo, n, hq, group, d, row, scale, scores, m, m + hq,
                         m + 2 * hq);
        }
        /* the implicit barrier of the loop above: every chunk is done */
#pragma omp for schedule(static)
        for (int64_t b = 0; b < batch; b++) {
            if (failed) continue;
            for (int64_t h = 0; h < hq; h++) {
                float mx = -INFINITY;
                for (int64_t c = first[b]; c < first[b + 1]; c++) {
                    const float mc = part[c * hq * (d + 2) + h];
                    mx = mc > mx ? mc : mx;
                }
                float total = 0.f;
                float *oh = out + (b * hq + h) * d;
                memset(oh, 0, sizeof(float) * d);
                for (int64_t c = first[b]; c < first[b + 1]; c++) {
                    const float *pc = part + c * hq * (d + 2);
                    const float w = expf(pc[h] - mx);
                    total += pc[hq + h] * w;
                    const float *ac = pc + 2 * hq + h * d;
#pragma omp simd
                    for (int64_t j = 0; j < d; j++) oh[j] += w * ac[j];
                }
                lse[b * hq + h] = mx + logf(total);
                const float inv = 1.f / total;
#pragma omp simd
                for (int64_t j = 0; j < d; j++) oh[j] *= inv;
            }
        }
        free(scores);
    }
    free(first);
    free(owner);
    free(part);
    return failed ? -1 : 0;
}
