/* Paged attention on the CPU for queries that attend, without a causal mask, to ranges of slots read
 * straight from the slot-indexed pool (no gather into a padded copy, no score matrix beyond one
 * chunk's). Built by kernels/native.py with the system C compiler; see that file.
 *
 *   q        [T, Hq, D]      fp32, contiguous (a forward's queries; only the tokens named below are read)
 *   k, v     [S, Hkv, D]     fp32, contiguous (the pool of one layer)
 *   slots    [N]             int64: segment s reads slots[seg_starts[s] .. seg_ends[s])
 *   seg_starts, seg_ends [G] int64, every range non-empty (ranges may overlap or leave gaps: the
 *                            slot table itself can be passed, each segment pointing into a row)
 *   seg_ptr  [G + 1]         int64: segment s is attended by the query tokens
 *   seg_tokens               seg_tokens[seg_ptr[s] .. seg_ptr[s + 1]) (indices into q, < T)
 *   seg_causal [G] or NULL   -1: every token reads the whole range; b >= 0: the segment's j-th token
 *                            reads its first b + j + 1 slots (a prefill chunk over its cached prefix
 *                            of b slots and, causally, its own new tokens)
 *   out      [T, Hq, D]      fp32: for every token named by some segment, softmax(q k^T * scale) v over
 *                            the union of its segments' slots (other tokens' rows are left alone)
 *   lse      [T, Hq]         fp32: natural log-sum-exp of those scaled scores (to merge passes)
 *
 * A decode is one token over its own range (one segment); a prefix group's members also share one
 * segment, the run they all hold, which is then read once for the whole group (cascade attention);
 * a prefill chunk is one causal segment over its cached prefix and its new tokens.
 *
 * Work item = one chunk of TOKEN_CHUNK slots of a one-token segment (split-K, as flash-decoding does
 * on a GPU, so a single long request keeps every thread busy), or, for a segment of several tokens, a
 * block of up to QB_ROWS query rows over a span of CHUNK-slot chunks merged online (the span as short
 * as keeps about ITEMS_WANTED such items; a causal block stops at its last token's slot). A one-token
 * item reads each slot's K row — every KV head, Hkv * D contiguous floats — once, front to back, for all
 * Hq query heads (query head h reads KV head h / (Hq / Hkv)), prefetching its V row; then the V rows
 * (from cache) once per KV head, that head's query heads' sums in registers. An item of several tokens
 * works per KV head on the rows (token, query head of that KV head), 16 rows to a vector: the scores
 * are outer products of each key with the transposed queries, and each value row is multiplied into 8
 * rows' accumulators at once. An item leaves, per row, its scores' maximum, their exponentials' sum
 * and the unnormalised sum of V rows; a second pass merges each token's items. The chunking depends on
 * a segment's length only — not on the batch or the thread count — so a one-token segment's result is
 * the same in any batch. Rows a few slots ahead are prefetched: slots are scattered, so the hardware
 * cannot guess the next row.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define PREFETCH_AHEAD 8
#define CHUNK 128
/* A one-token item's chunk: longer, as that item streams whole rows (random 64 x 256 decode steps:
 * attention ~5 % faster at 256 than at 128; items of several tokens measured no better). */
#define TOKEN_CHUNK 256
/* Query rows (token, query head) of one KV head per item of several tokens. */
#define QB_ROWS 64
/* Items of several tokens cover up to this many chunks each, merged online, so that a long causal
 * prefill leaves one partial result per token rather than one per chunk: the span is the least
 * that still gives about ITEMS_WANTED such items, so the threads stay busy. */
#define ITEMS_WANTED 32
/* A masked score, and below this a row's maximum means it read no slot (finite: fast math). */
#define MASKED -1e30f
#define EMPTY -1e29f

typedef float v16 __attribute__((vector_size(64)));

static inline v16 ld16(const float *p) {
    v16 x;
    memcpy(&x, p, sizeof x);
    return x;
}

static inline void st16(float *p, v16 x) { memcpy(p, &x, sizeof x); }

typedef int32_t vi16 __attribute__((vector_size(64)));

/* exp(x) for x <= 0 (a score minus its row's maximum), 16 at a time: 2^n * p(f) with n the nearest
 * integer to x / ln 2, f = x - n ln 2 (in two parts), p the degree-7 Taylor polynomial; within
 * ~4e-7 relative of exp, and exactly 0 below -87 (a masked score, or one too small to count).
 * glibc's vector expf, which the compiler calls from the simd loops, took ~2 ns a value here (its
 * 8-wide AVX2 variant); this ~0.15, and the softmax of a chunk of keys had cost as much as its
 * two products. */
static inline v16 exp16_neg(v16 x) {
    const vi16 keep = x >= -87.0f;
    x = (v16)(((vi16)x & keep) | ((vi16)((v16){0} - 87.0f) & ~keep));
    const vi16 ni = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, vi16); /* <= 0: truncation rounds */
    const v16 n = __builtin_convertvector(ni, v16);
    v16 f = x - n * 0.693359375f;
    f = f - n * -2.12194440e-4f;
    v16 p = (v16){0} + 1.0f / 5040.0f;
    p = p * f + 1.0f / 720.0f;
    p = p * f + 1.0f / 120.0f;
    p = p * f + 1.0f / 24.0f;
    p = p * f + 1.0f / 6.0f;
    p = p * f + 0.5f;
    p = p * f + 1.0f;
    p = p * f + 1.0f;
    return (v16)((vi16)(p * (v16)((ni + 127) << 23)) & keep);
}

/* Prefetch the n floats at p (one slot's row of every KV head, or of one). */
static inline void prefetch_floats(const float *p, int64_t n) {
    for (int64_t off = 0; off < n * (int64_t)sizeof(float); off += 64) __builtin_prefetch((const char *)p + off);
}

/* Prefetch the row of `row` floats at `base + slot * row` (every KV head of one slot). */
static inline void prefetch_row(const float *base, int64_t slot, int64_t row) {
    prefetch_floats(base + slot * row, row);
}

/* Slot i's K row (of n slots sl[0..n)), after prefetching the K row a few slots ahead and this slot's V
 * row, which the value pass reads next: misses overlap. */
static inline const float *key_row(const float *k, const float *v, const int64_t *sl, int64_t i, int64_t n,
                                   int64_t row) {
    if (i + PREFETCH_AHEAD < n) prefetch_row(k, sl[i + PREFETCH_AHEAD], row);
    prefetch_row(v, sl[i], row);
    return k + sl[i] * row;
}

/* Lane i of the result: the sum of the 16 lanes of x[i] (x: 16 vectors of 16 floats, contiguous). Four
 * levels, each summing the halves of every vector's blocks into blocks half as wide and packing two
 * vectors into one: 15 adds and 30 shuffles for 16 sums, instead of a horizontal sum (a chain of
 * shuffles and adds) per vector. */
static inline v16 sum_lanes16(const float *x) {
    v16 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++) {
        const v16 x0 = ld16(x + 32 * i), x1 = ld16(x + 32 * i + 16);
        a[i] = __builtin_shufflevector(x0, x1, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
               __builtin_shufflevector(x0, x1, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    }
    for (int i = 0; i < 4; i++) {
        const v16 a0 = a[2 * i], a1 = a[2 * i + 1];
        b[i] = __builtin_shufflevector(a0, a1, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
               __builtin_shufflevector(a0, a1, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    }
    for (int i = 0; i < 2; i++) {
        const v16 b0 = b[2 * i], b1 = b[2 * i + 1];
        c[i] = __builtin_shufflevector(b0, b1, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
               __builtin_shufflevector(b0, b1, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    }
    return __builtin_shufflevector(c[0], c[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           __builtin_shufflevector(c[0], c[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

/* acc[g * astride + 0 .. 16 C) = sum_i p[g * pstride + i] * v_i[off .. off + 16 C) for g < G: G heads' 16 C
 * output columns kept in registers over all n slots, each value row's 16 C floats loaded once for the G
 * heads (G and C constants after inlining: G 1, 2 or 4; C 2 or 4). */
static inline __attribute__((always_inline)) void pv_tile(const float *v, const int64_t *sl, int64_t n, int64_t row,
                                                          int64_t off, const float *p, int64_t pstride, float *acc,
                                                          int64_t astride, const int G, const int C) {
    v16 a[4][4];
#pragma GCC unroll 4
    for (int g = 0; g < G; g++)
#pragma GCC unroll 4
        for (int c = 0; c < C; c++) a[g][c] = (v16){0};
    for (int64_t i = 0; i < n; i++) {
        const float *vr = v + sl[i] * row + off;
        v16 vv[4];
#pragma GCC unroll 4
        for (int c = 0; c < C; c++) vv[c] = ld16(vr + 16 * c);
#pragma GCC unroll 4
        for (int g = 0; g < G; g++) {
            const float pg = p[g * pstride + i];
#pragma GCC unroll 4
            for (int c = 0; c < C; c++) a[g][c] += pg * vv[c];
        }
    }
#pragma GCC unroll 4
    for (int g = 0; g < G; g++)
#pragma GCC unroll 4
        for (int c = 0; c < C; c++) st16(acc + g * astride + 16 * c, a[g][c]);
}

/* pv_tile for a tile of G heads with C 16-column chunks chosen at run time (the compiler needs them
 * constant to keep the accumulators in registers). */
static void pv_tiles(const float *v, const int64_t *sl, int64_t n, int64_t row, int64_t off, const float *p,
                     int64_t pstride, float *acc, int64_t astride, int G, int C) {
    if (C == 4) {
        if (G == 4) pv_tile(v, sl, n, row, off, p, pstride, acc, astride, 4, 4);
        else if (G == 2) pv_tile(v, sl, n, row, off, p, pstride, acc, astride, 2, 4);
        else pv_tile(v, sl, n, row, off, p, pstride, acc, astride, 1, 4);
    } else {
        if (G == 4) pv_tile(v, sl, n, row, off, p, pstride, acc, astride, 4, 2);
        else if (G == 2) pv_tile(v, sl, n, row, off, p, pstride, acc, astride, 2, 2);
        else pv_tile(v, sl, n, row, off, p, pstride, acc, astride, 1, 2);
    }
}

/* One chunk of n <= TOKEN_CHUNK slots for query qb [Hq, D]: per head, the scores' maximum (m), the sum of
 * their exponentials against it (l) and sum_i exp(s_i - m) * v_i (acc [Hq, D]). part: scratch of Hq * 256
 * floats. With D a multiple of 16 from 32 on, each (slot, head) product is left as 16 partial sums and
 * sixteen slots' are summed at once (sum_lanes16); with D a multiple of 32, the values are summed per KV
 * head with the accumulators in registers (pv_tile). */
static void attend_chunk(const float *qb, const float *k, const float *v, const int64_t *sl, int64_t n,
                         int64_t hq, int64_t group, int64_t d, int64_t row, float scale, float *scores,
                         float *m, float *l, float *acc, float *part) {
    for (int64_t i = 0; i < n && i < PREFETCH_AHEAD; i++) prefetch_row(k, sl[i], row);
    if (d % 16 == 0 && d >= 32) { /* (at 16, one product per pair: no faster than its horizontal sum) */
        for (int64_t i0 = 0; i0 < n; i0 += 16) {
            for (int64_t s = 0; s < 16 && i0 + s < n; s++) {
                const float *kr = key_row(k, v, sl, i0 + s, n, row);
                for (int64_t h = 0; h < hq; h++) {
                    const float *qh = qb + h * d, *kh = kr + (h / group) * d;
                    v16 a = ld16(qh) * ld16(kh);
                    for (int64_t j = 16; j < d; j += 16) a += ld16(qh + j) * ld16(kh + j);
                    st16(part + (h * 16 + s) * 16, a);
                }
            }
            /* Lane s sums slot s's partials only, so past n it sums stale scratch into lanes that are
             * stored (i0 + 16 <= TOKEN_CHUNK) and never read. */
            for (int64_t h = 0; h < hq; h++) st16(scores + h * TOKEN_CHUNK + i0, sum_lanes16(part + h * 256) * scale);
        }
    } else {
        for (int64_t i = 0; i < n; i++) {
            const float *kr = key_row(k, v, sl, i, n, row);
            for (int64_t h = 0; h < hq; h++) {
                const float *qh = qb + h * d;
                const float *kh = kr + (h / group) * d;
                float s = 0.f;
#pragma omp simd reduction(+ : s)
                for (int64_t j = 0; j < d; j++) s += qh[j] * kh[j];
                scores[h * TOKEN_CHUNK + i] = s * scale;
            }
        }
    }
    for (int64_t h = 0; h < hq; h++) {
        float *sh = scores + h * TOKEN_CHUNK;
        float mh = sh[0];
        for (int64_t i = 1; i < n; i++) mh = sh[i] > mh ? sh[i] : mh;
        v16 tot = {0};
        int64_t i = 0;
        for (; i + 16 <= n; i += 16) {
            const v16 e = exp16_neg(ld16(sh + i) - mh);
            st16(sh + i, e);
            tot += e;
        }
        float total = 0.f;
        for (int u = 0; u < 16; u++) total += tot[u];
        for (; i < n; i++) {
            sh[i] = expf(sh[i] - mh);
            total += sh[i];
        }
        m[h] = mh;
        l[h] = total;
    }
    if (d % 32 == 0) {
        const int tile = group % 4 == 0 ? 4 : group % 2 == 0 ? 2 : 1, chunks = d % 64 == 0 ? 4 : 2;
        for (int64_t kh = 0; kh < hq / group; kh++)
            for (int64_t g = 0; g < group; g += tile)
                for (int64_t c = 0; c < d; c += 16 * chunks) {
                    const int64_t h = kh * group + g;
                    pv_tiles(v, sl, n, row, kh * d + c, scores + h * TOKEN_CHUNK, TOKEN_CHUNK, acc + h * d + c, d, tile,
                             chunks);
                }
        return;
    }
    memset(acc, 0, sizeof(float) * hq * d);
    for (int64_t i = 0; i < n; i++) {
        const float *vr = v + sl[i] * row;
        for (int64_t h = 0; h < hq; h++) {
            const float p = scores[h * TOKEN_CHUNK + i];
            const float *vh = vr + (h / group) * d;
            float *ah = acc + h * d;
#pragma omp simd
            for (int64_t j = 0; j < d; j++) ah[j] += p * vh[j];
        }
    }
}

/* One chunk of n <= CHUNK slots for the rows of KV head kh: qt [D][r16] holds the rows' queries
 * (already scaled), transposed, padded with zero rows to r16 (a multiple of 16; D a multiple of 16).
 * Leaves per row r < r16 the scores' maximum (mx), their exponentials' sum (sum) and
 * acc [r16][D] = sum_i exp(s_ri - mx_r) v_i. sc [CHUNK][r16] is scratch. */
static void attend_rows(const float *qt, int64_t r16, const float *k, const float *v, const int64_t *sl, int64_t n,
                        int64_t kh, int64_t d, int64_t row, const int64_t *lim, float *sc, float *mx, float *sum,
                        float *acc) {
    /* scores: 8 keys x 32 rows (16 accumulators), or 8 keys x 16 rows, per pass: enough
     * independent accumulators to hide the FMAs' latency, 10 loads per 16 FMAs */
    for (int64_t i = 0; i < PREFETCH_AHEAD && i < n; i++) prefetch_floats(k + sl[i] * row + kh * d, d);
    for (int64_t t = 0; t < r16; t += 32) {
        const int two = t + 32 <= r16;
        int64_t i = 0;
        for (; i + 8 <= n; i += 8) {
            if (t == 0) /* keys a few slots ahead; these slots' values for the second loop */
                for (int64_t a = i; a < i + 8; a++) {
                    if (a + PREFETCH_AHEAD < n) prefetch_floats(k + sl[a + PREFETCH_AHEAD] * row + kh * d, d);
                    prefetch_floats(v + sl[a] * row + kh * d, d);
                }
            const float *kr[8];
            for (int a = 0; a < 8; a++) kr[a] = k + sl[i + a] * row + kh * d;
            v16 acc_a[8], acc_b[8];
#pragma GCC unroll 8
            for (int a = 0; a < 8; a++) acc_a[a] = acc_b[a] = (v16){0};
            if (two) {
                for (int64_t j = 0; j < d; j++) {
                    const v16 qa = ld16(qt + j * r16 + t), qb = ld16(qt + j * r16 + t + 16);
#pragma GCC unroll 8
                    for (int a = 0; a < 8; a++) {
                        acc_a[a] += qa * kr[a][j];
                        acc_b[a] += qb * kr[a][j];
                    }
                }
#pragma GCC unroll 8
                for (int a = 0; a < 8; a++) st16(sc + (i + a) * r16 + t + 16, acc_b[a]);
            } else {
                for (int64_t j = 0; j < d; j++) {
                    const v16 qa = ld16(qt + j * r16 + t);
#pragma GCC unroll 8
                    for (int a = 0; a < 8; a++) acc_a[a] += qa * kr[a][j];
                }
            }
#pragma GCC unroll 8
            for (int a = 0; a < 8; a++) st16(sc + (i + a) * r16 + t, acc_a[a]);
        }
        for (; i < n; i++) {
            const float *k0 = k + sl[i] * row + kh * d;
            if (t == 0) prefetch_floats(v + sl[i] * row + kh * d, d);
            for (int64_t u = t; u < (two ? t + 32 : t + 16); u += 16) {
                v16 a0 = {0};
                for (int64_t j = 0; j < d; j++) a0 += ld16(qt + j * r16 + u) * k0[j];
                st16(sc + i * r16 + u, a0);
            }
        }
    }
    if (lim != NULL) /* causal: row r reads the chunk's first lim[r] slots; a row that reads none ends empty */
        for (int64_t r = 0; r < r16; r++)
            for (int64_t i = lim[r] > 0 ? lim[r] : 0; i < n; i++) sc[i * r16 + r] = MASKED;
    for (int64_t r = 0; r < r16; r++) mx[r] = sc[r];
    for (int64_t i = 1; i < n; i++) {
        const float *si = sc + i * r16;
#pragma omp simd
        for (int64_t r = 0; r < r16; r++) mx[r] = si[r] > mx[r] ? si[r] : mx[r];
    }
    memset(sum, 0, sizeof(float) * r16);
    for (int64_t r = 0; r < r16; r += 16) { /* r16 is a multiple of 16 */
        const v16 m = ld16(mx + r);
        const vi16 live = m > EMPTY; /* a row that reads none of these keys gets 0 */
        v16 total = {0};
        for (int64_t i = 0; i < n; i++) {
            const v16 e = (v16)((vi16)exp16_neg(ld16(sc + i * r16 + r) - m) & live);
            st16(sc + i * r16 + r, e);
            total += e;
        }
        st16(sum + r, total);
    }
    /* values: 8 rows x 32 (else 16) columns per pass, each value row loaded once for the 8 rows */
    for (int64_t r = 0; r < r16; r += 8) {
        int64_t j = 0;
        for (; j + 32 <= d; j += 32) {
            v16 a[8], b[8];
#pragma GCC unroll 8
            for (int x = 0; x < 8; x++) a[x] = b[x] = (v16){0};
            for (int64_t i = 0; i < n; i++) {
                const float *vr = v + sl[i] * row + kh * d + j;
                const v16 va = ld16(vr), vb = ld16(vr + 16);
                const float *p = sc + i * r16 + r;
#pragma GCC unroll 8
                for (int x = 0; x < 8; x++) {
                    a[x] += p[x] * va;
                    b[x] += p[x] * vb;
                }
            }
#pragma GCC unroll 8
            for (int x = 0; x < 8; x++) {
                st16(acc + (r + x) * d + j, a[x]);
                st16(acc + (r + x) * d + j + 16, b[x]);
            }
        }
        for (; j < d; j += 16) {
            v16 a[8];
#pragma GCC unroll 8
            for (int x = 0; x < 8; x++) a[x] = (v16){0};
            for (int64_t i = 0; i < n; i++) {
                const v16 va = ld16(v + sl[i] * row + kh * d + j);
                const float *p = sc + i * r16 + r;
#pragma GCC unroll 8
                for (int x = 0; x < 8; x++) a[x] += p[x] * va;
            }
#pragma GCC unroll 8
            for (int x = 0; x < 8; x++) st16(acc + (r + x) * d + j, a[x]);
        }
    }
}

typedef struct {
    /* segment, its first token here (an index into seg_tokens), tokens, slots [lo, hi) (indices into
     * slots), where its partial results start */
    int64_t seg, q0, nq, lo, hi, part;
} item_t;

/* How many of a segment's len slots its j-th token reads: all, or with a causal base, base + j + 1. */
static inline int64_t readable(int64_t len, int64_t causal, int64_t j) {
    if (causal < 0) return len;
    return causal + j + 1 < len ? causal + j + 1 : len;
}

/* Whether segment s takes the several-row path: read by several tokens, and a head size it takes. */
static inline int several(const int64_t *seg_ptr, int64_t s, int64_t d) {
    return seg_ptr[s + 1] - seg_ptr[s] > 1 && d % 16 == 0;
}

/* The items of segment s (see the header), into it[] when it is not NULL; returns their count. A
 * segment on the several-row path (multi) is cut into blocks of qb tokens, each block's readable
 * range into spans of span chunks; any other segment token by token, into single chunks. */
static int64_t make_items(int64_t s, const int64_t *seg_starts, const int64_t *seg_ends, const int64_t *seg_ptr,
                          const int64_t *seg_causal, int64_t qb, int64_t span, int multi, item_t *it,
                          int64_t *part, int64_t per_token) {
    const int64_t nq = seg_ptr[s + 1] - seg_ptr[s], len = seg_ends[s] - seg_starts[s];
    const int64_t causal = seg_causal != NULL ? seg_causal[s] : -1;
    const int64_t step = multi ? qb : 1;
    int64_t c = 0;
    for (int64_t q0 = 0; q0 < nq; q0 += step) {
        const int64_t m = nq - q0 < step ? nq - q0 : step;
        const int64_t end = readable(len, causal, q0 + m - 1); /* the block's last token reads most */
        const int64_t width = multi ? span * CHUNK : TOKEN_CHUNK;
        for (int64_t lo = 0; lo < end; lo += width) {
            if (it != NULL) {
                const int64_t hi = end - lo < width ? end : lo + width;
                it[c] = (item_t){s, seg_ptr[s] + q0, m, seg_starts[s] + lo, seg_starts[s] + hi, *part};
                *part += m * per_token;
            }
            c++;
        }
    }
    return c;
}

int strata_paged_attend_f32(const float *q, const float *k, const float *v, const int64_t *slots, int64_t nseg,
                            const int64_t *seg_starts, const int64_t *seg_ends, const int64_t *seg_ptr,
                            const int64_t *seg_tokens, const int64_t *seg_causal, int64_t ntok, int64_t hq,
                            int64_t hkv, int64_t d, float scale, float *out, float *lse) {
    const int64_t group = hq / hkv;
    const int64_t row = hkv * d;
    const int64_t qb = group >= QB_ROWS ? 1 : QB_ROWS / group; /* tokens per item of several */
    const int64_t per_token = hq * (d + 2);
    /* the span: chunks of several-token items, one chunk each first, then as many as keep ITEMS_WANTED */
    int64_t work = 0;
    for (int64_t s = 0; s < nseg; s++)
        if (several(seg_ptr, s, d))
            work += make_items(s, seg_starts, seg_ends, seg_ptr, seg_causal, qb, 1, 1, NULL, NULL, 0);
    const int64_t span = work / ITEMS_WANTED > 1 ? work / ITEMS_WANTED : 1;
    int64_t items = 0;
    for (int64_t s = 0; s < nseg; s++)
        items += make_items(s, seg_starts, seg_ends, seg_ptr, seg_causal, qb, span, several(seg_ptr, s, d), NULL, NULL,
                            0);
    item_t *it = malloc(sizeof(item_t) * (items + 1));
    int64_t *cnt = calloc(ntok + 1, sizeof(int64_t)); /* then each token's first occurrence */
    if (it == NULL || cnt == NULL) {
        free(it);
        free(cnt);
        return -1;
    }
    /* Items of several tokens first: the longest work goes out before the threads run dry. */
    int64_t c = 0, part = 0;
    for (int pass = 0; pass < 2; pass++)
        for (int64_t s = 0; s < nseg; s++) {
            const int multi = several(seg_ptr, s, d);
            if (multi != (pass == 0)) continue;
            c += make_items(s, seg_starts, seg_ends, seg_ptr, seg_causal, qb, span, multi, it + c, &part,
                            per_token);
        }
    for (int64_t i = 0; i < items; i++)
        for (int64_t m = 0; m < it[i].nq; m++) {
            const int64_t t = seg_tokens[it[i].q0 + m];
            if (t < 0 || t >= ntok) {
                free(it);
                free(cnt);
                return -2;
            }
            cnt[t + 1]++;
        }
    for (int64_t t = 0; t < ntok; t++) cnt[t + 1] += cnt[t];
    int64_t *occ = malloc(sizeof(int64_t) * (cnt[ntok] + 1)); /* (item, token in item) as item * qb + m */
    int64_t *fill = malloc(sizeof(int64_t) * (ntok + 1));
    float *parts = malloc(sizeof(float) * (part + 1));
    if (occ == NULL || fill == NULL || parts == NULL) {
        free(it);
        free(cnt);
        free(occ);
        free(fill);
        free(parts);
        return -1;
    }
    memcpy(fill, cnt, sizeof(int64_t) * (ntok + 1));
    for (int64_t i = 0; i < items; i++)
        for (int64_t m = 0; m < it[i].nq; m++) occ[fill[seg_tokens[it[i].q0 + m]]++] = i * qb + m;
    const int64_t r16max = (qb * group + 15) / 16 * 16;
    int failed = 0;
#pragma omp parallel
    {
        /* token path: scores [Hq, TOKEN_CHUNK], one token's partial; several-row path: scores [CHUNK, r16],
         * queries [D, r16], a chunk's (mx, sum, acc) and the running ones, the rows' limits */
        const int64_t r_floats = CHUNK * r16max + d * r16max + 2 * r16max * (d + 2);
        float *scores = malloc(sizeof(float) * (hq * TOKEN_CHUNK + per_token + r_floats + hq * 256));
        float *part = scores + hq * TOKEN_CHUNK + per_token + r_floats; /* attend_chunk's partial products */
        int64_t *lim = malloc(sizeof(int64_t) * r16max);
        if (scores == NULL || lim == NULL) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < items; i++) {
            if (failed) continue;
            const item_t w = it[i];
            float *pm = parts + w.part;
            const int64_t base = w.lo - seg_starts[w.seg], len = seg_ends[w.seg] - seg_starts[w.seg];
            const int64_t causal = seg_causal != NULL ? seg_causal[w.seg] : -1;
            const int64_t first = w.q0 - seg_ptr[w.seg]; /* this item's first token among the segment's */
            if (!several(seg_ptr, w.seg, d)) { /* token by token, one chunk */
                for (int64_t m = 0; m < w.nq; m++) {
                    /* one token's m [Hq], l [Hq], acc [Hq, D] are its item's layout when it is alone */
                    float *tmp = w.nq == 1 ? pm : scores + hq * TOKEN_CHUNK;
                    const int64_t n = readable(len, causal, first + m) - base;
                    if (n > 0) {
                        attend_chunk(q + seg_tokens[w.q0 + m] * hq * d, k, v, slots + w.lo,
                                     n < w.hi - w.lo ? n : w.hi - w.lo, hq, group, d, row, scale, scores, tmp,
                                     tmp + hq, tmp + 2 * hq, part);
                    } else { /* reads none of this chunk: an empty partial */
                        for (int64_t h = 0; h < hq; h++) tmp[h] = MASKED;
                        memset(tmp + hq, 0, sizeof(float) * hq * (d + 1));
                    }
                    if (w.nq == 1) break;
                    memcpy(pm + m * hq, tmp, sizeof(float) * hq);
                    memcpy(pm + (w.nq + m) * hq, tmp + hq, sizeof(float) * hq);
                    memcpy(pm + 2 * w.nq * hq + m * hq * d, tmp + 2 * hq, sizeof(float) * hq * d);
                }
                continue;
            }
            const int64_t r16 = (w.nq * group + 15) / 16 * 16; /* this item's rows, padded */
            float *sc = scores + hq * TOKEN_CHUNK + per_token, *qt = sc + CHUNK * r16, *mx = qt + d * r16;
            float *sum = mx + r16, *acc = sum + r16, *rmx = acc + r16 * d, *rsum = rmx + r16, *racc = rsum + r16;
            for (int64_t kh = 0; kh < hkv; kh++) {
                memset(qt, 0, sizeof(float) * d * r16);
                for (int64_t m = 0; m < w.nq; m++)
                    for (int64_t g = 0; g < group; g++) {
                        const float *qh = q + (seg_tokens[w.q0 + m] * hq + kh * group + g) * d;
                        for (int64_t j = 0; j < d; j++) qt[j * r16 + m * group + g] = qh[j] * scale;
                    }
                for (int64_t lo = w.lo; lo < w.hi; lo += CHUNK) {
                    const int64_t n = w.hi - lo < CHUNK ? w.hi - lo : CHUNK;
                    int masked = 0;
                    for (int64_t r = 0; r < r16; r++) {
                        const int64_t m = r / group;
                        lim[r] = m < w.nq ? readable(len, causal, first + m) - (lo - seg_starts[w.seg]) : n;
                        masked |= lim[r] < n;
                    }
                    const int head = lo == w.lo; /* the first chunk writes the running state itself */
                    attend_rows(qt, r16, k, v, slots + lo, n, kh, d, row, masked ? lim : NULL, sc, head ? rmx : mx,
                                head ? rsum : sum, head ? racc : acc);
                    if (head) continue;
                    for (int64_t r = 0; r < r16; r++) { /* merge this chunk into the running state */
                        const float top = mx[r] > rmx[r] ? mx[r] : rmx[r];
                        const float a = expf(rmx[r] - top), b = expf(mx[r] - top);
                        rmx[r] = top;
                        rsum[r] = rsum[r] * a + sum[r] * b;
                        float *ra = racc + r * d;
                        const float *ca = acc + r * d;
#pragma omp simd
                        for (int64_t j = 0; j < d; j++) ra[j] = ra[j] * a + ca[j] * b;
                    }
                }
                for (int64_t m = 0; m < w.nq; m++)
                    for (int64_t g = 0; g < group; g++) {
                        const int64_t r = m * group + g, h = m * hq + kh * group + g;
                        pm[h] = rmx[r];
                        pm[w.nq * hq + h] = rsum[r];
                        memcpy(pm + 2 * w.nq * hq + h * d, racc + r * d, sizeof(float) * d);
                    }
            }
        }
        /* the implicit barrier of the loop above: every item is done */
#pragma omp for schedule(static)
        for (int64_t t = 0; t < ntok; t++) {
            if (failed || cnt[t] == cnt[t + 1]) continue;
            for (int64_t h = 0; h < hq; h++) {
                float top = -INFINITY;
                for (int64_t o = cnt[t]; o < cnt[t + 1]; o++) {
                    const item_t *w = it + occ[o] / qb;
                    const float mc = parts[w->part + (occ[o] % qb) * hq + h];
                    top = mc > top ? mc : top;
                }
                float total = 0.f;
                float *oh = out + (t * hq + h) * d;
                memset(oh, 0, sizeof(float) * d);
                for (int64_t o = cnt[t]; o < cnt[t + 1]; o++) {
                    const item_t *w = it + occ[o] / qb;
                    const int64_t m = occ[o] % qb;
                    const float *pw = parts + w->part;
                    const float wt = expf(pw[m * hq + h] - top);
                    total += pw[w->nq * hq + m * hq + h] * wt;
                    const float *ac = pw + 2 * w->nq * hq + (m * hq + h) * d;
#pragma omp simd
                    for (int64_t j = 0; j < d; j++) oh[j] += wt * ac[j];
                }
                lse[t * hq + h] = top + logf(total);
                const float inv = 1.f / total;
#pragma omp simd
                for (int64_t j = 0; j < d; j++) oh[j] *= inv;
            }
        }
        free(scores);
        free(lim);
    }
    free(it);
    free(cnt);
    free(occ);
    free(fill);
    free(parts);
    return failed ? -1 : 0;
}
