/* Decode attention read straight from the paged KV pool: one query token per sequence,
 * its keys and values taken page by page where the pool holds them (no gathered copy).
 *
 * Pool rows (common/kv_pool.py): row r holds page_size tokens x kv_heads x head_dim of one
 * layer's K (or V); a page's layer-l K is row base + 2l and its V row base + 2l + 1, where
 * `rows[b, p]` is the base row of sequence b's p-th page.
 *
 * A work item is one sequence, or one range of its pages when there are few sequences (so
 * every thread has work), with all its heads: a page's K and V rows are then read front to
 * back, and each key vector once for all the query heads that share its KV head (GQA).
 * Softmax is online, per block of a page (16 keys, their scores one vector, in base 2):
 * running max, running sum, rescaled accumulator, all in float32. Ranges are merged by
 * their maxima at the end, as flash-decoding does.
 * Built at install time by common/model/cpu/build.py (-O3 -fopenmp, once per instruction
 * set; the loader picks the variant the CPU runs). No -ffast-math: sums are in the order written, rounding is IEEE's, apart
 * from exp (cpu_math.h).
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_GROUPS 16
#define MAX_HEADS 128
#define MAX_HEAD_DIM 256
#define BLOCK 16 /* keys scored at once, one vector of scores (a page is split into blocks) */

#include "cpu_math.h"

/* 16 floats (cpu_math.h's f32x16): GCC vector extensions, one AVX-512 register, two AVX2
 * ones, four NEON ones. Head dims are multiples of 16 (checked by the caller). */
typedef f32x16 vf;

/* Lane j of the result: the sum of d[j]'s lanes, for 16 vectors at once (16 dot products'
 * partial sums). A transposing tree of 15 shuffle pairs and adds, where a horizontal sum
 * per dot product took 7 dependent steps each. */
static inline vf sum_lanes(const vf d[BLOCK]) {
    vf w[8], x[4], y[2];
    for (int i = 0; i < 8; i++) /* lanes 0-7: d[2i]'s halves added; 8-15: d[2i + 1]'s */
        w[i] = __builtin_shufflevector(d[2 * i], d[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17,
                                       18, 19, 20, 21, 22, 23) +
               __builtin_shufflevector(d[2 * i], d[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24,
                                       25, 26, 27, 28, 29, 30, 31);
    for (int i = 0; i < 4; i++) /* lanes 4k..4k+3: d[4i + k]'s sum in 4 parts */
        x[i] = __builtin_shufflevector(w[2 * i], w[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17,
                                       18, 19, 24, 25, 26, 27) +
               __builtin_shufflevector(w[2 * i], w[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20,
                                       21, 22, 23, 28, 29, 30, 31);
    for (int i = 0; i < 2; i++) /* lanes 2k, 2k+1: d[8i + k]'s sum in 2 parts */
        y[i] = __builtin_shufflevector(x[2 * i], x[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17,
                                       20, 21, 24, 25, 28, 29) +
               __builtin_shufflevector(x[2 * i], x[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18,
                                       19, 22, 23, 26, 27, 30, 31);
    return __builtin_shufflevector(y[0], y[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24,
                                   26, 28, 30) +
           __builtin_shufflevector(y[0], y[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25,
                                   27, 29, 31);
}

typedef struct {
    const void *pool;
    int64_t row_elems, width, layer, q_stride, batch;
    const int64_t *rows, *lens;
    const void *q;
    int heads, kv_heads, d, page_size, splits;
    float scale;
} Args;

/* One work item: sequence b, tokens [t0, t1), every head. Pages are visited in order and
 * each page's K and V rows for this layer are read front to back (all KV heads of a token
 * are adjacent), with the next page's rows prefetched: pages lie anywhere in the pool, so
 * the hardware prefetcher loses the stream at every page boundary. Writes the running max,
 * sum and unnormalized output of every head to m_out, l_out, acc_out. */
static inline __attribute__((always_inline)) void attend_item(const Args *a, int64_t b,
                                                              int64_t t0, int64_t t1,
                                                              float *m_out, float *l_out,
                                                              float *acc_out, vf *work,
                                                              int is_bf16, int nv) {
    const int groups = a->heads / a->kv_heads, d = a->d;
    const int64_t tok_elems = (int64_t)a->kv_heads * d, ps = a->page_size;
    const int64_t elem = is_bf16 ? 2 : 4;
    vf *qv = work, *acc = work + (int64_t)a->heads * nv; /* [heads][nv] each */
    /* scores in base 2 (q scaled by log2(e) too): softmax's exp is 2^x (cpu_math.h) */
    const float scale2 = a->scale * 1.44269504088896341f;
    const i32x16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    float m[MAX_HEADS], l[MAX_HEADS], s[MAX_GROUPS][BLOCK];
    vf dots[MAX_GROUPS][BLOCK];
    for (int h = 0; h < a->heads; h++) {
        for (int c = 0; c < nv; c++) {
            qv[h * nv + c] = load16(a->q, b * a->q_stride + (int64_t)h * d + 16 * c, is_bf16) * scale2;
            acc[h * nv + c] = (vf){0};
        }
        m[h] = -INFINITY;
        l[h] = 0.0f;
    }
    const int64_t *page_rows = a->rows + b * a->width;
    for (int64_t t = t0; t < t1;) {
        const int64_t page = t / ps, off = t % ps;
        int64_t n = ps - off;
        if (n > t1 - t) n = t1 - t;
        if (n > BLOCK) n = BLOCK;
        const int64_t krow = page_rows[page] + 2 * a->layer;
        const int64_t kbase = krow * a->row_elems + off * tok_elems, vbase = kbase + a->row_elems;
        if (off == 0 && t + ps < t1) { /* the next page's K and V rows, a cache line at a time */
            const char *next = (const char *)a->pool +
                               (page_rows[page + 1] + 2 * a->layer) * a->row_elems * elem;
            for (int64_t byte = 0; byte < 2 * a->row_elems * elem; byte += 64)
                __builtin_prefetch(next + byte);
        }
        /* lanes below n: (lane - n)'s sign, spread (a shift, not a comparison: cpu_math.h) */
        const i32x16 valid = (lane - (int32_t)n) >> 31;
        for (int kvh = 0; kvh < a->kv_heads; kvh++) {
            const int h0 = kvh * groups;
            for (int64_t j = 0; j < BLOCK; j++) {
                if (j >= n) { /* past the block's keys: no load, a score masked below */
                    for (int g = 0; g < groups; g++) dots[g][j] = (vf){0};
                    continue;
                }
                vf kv[MAX_HEAD_DIM / 16];
                const int64_t at = kbase + j * tok_elems + (int64_t)kvh * d;
                for (int c = 0; c < nv; c++) kv[c] = load16(a->pool, at + 16 * c, is_bf16);
                for (int g = 0; g < groups; g++) {
                    const vf *qh = qv + (int64_t)(h0 + g) * nv;
                    vf dot = qh[0] * kv[0];
                    for (int c = 1; c < nv; c++) dot += qh[c] * kv[c];
                    dots[g][j] = dot;
                }
            }
            for (int g = 0; g < groups; g++) {
                const int h = h0 + g;
                vf sc = sum_lanes(dots[g]);
                sc = (vf)((valid & (i32x16)sc) | (~valid & (i32x16)((vf){0} - INFINITY)));
                const float top = hmax16(sc), bm = top > m[h] ? top : m[h];
                /* 2^0 is 1 exactly: once a head's max settles its rescale is skipped */
                const float corr = bm > m[h] ? exp2_nonpositive(m[h] - bm) : 1.0f;
                const vf e = exp2_nonpositive16(sc - bm); /* 0 where masked */
                memcpy(s[g], &e, sizeof e);
                l[h] = l[h] * corr + hsum16(e);
                m[h] = bm;
                if (corr != 1.0f)
                    for (int c = 0; c < nv; c++) acc[(int64_t)h * nv + c] *= corr;
            }
            for (int64_t j = 0; j < n; j++) {
                vf vv[MAX_HEAD_DIM / 16];
                const int64_t at = vbase + j * tok_elems + (int64_t)kvh * d;
                for (int c = 0; c < nv; c++) vv[c] = load16(a->pool, at + 16 * c, is_bf16);
                for (int g = 0; g < groups; g++) {
                    vf *ah = acc + (int64_t)(h0 + g) * nv;
                    const float p = s[g][j];
                    for (int c = 0; c < nv; c++) ah[c] += p * vv[c];
                }
            }
        }
        t += n;
    }
    for (int h = 0; h < a->heads; h++) {
        m_out[h] = m[h];
        l_out[h] = l[h];
        memcpy(acc_out + (int64_t)h * d, acc + (int64_t)h * nv, sizeof(vf) * nv);
    }
}

static inline __attribute__((always_inline)) int attend(const Args *a, void *out, int threads,
                                                        int is_bf16) {
    const int heads = a->heads, d = a->d, splits = a->splits, nv = a->d / 16;
    if (a->kv_heads < 1 || heads % a->kv_heads || heads / a->kv_heads > MAX_GROUPS ||
        heads > MAX_HEADS || d > MAX_HEAD_DIM || d % 16 || splits < 1 || threads < 1)
        return -1;
    const int64_t items = a->batch * splits, part = (int64_t)heads * (d + 2);
    const int64_t work_size = 2 * (int64_t)heads * nv * (int64_t)sizeof(vf);
    float *parts = malloc(sizeof(float) * items * part);
    vf *work = aligned_alloc(64, (size_t)(work_size * threads));
    if (!parts || !work) {
        free(parts);
        free(work);
        return -2;
    }
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t it = 0; it < items; it++) {
        const int64_t b = it / splits, sp = it % splits, len = a->lens[b];
        /* splits cut at page boundaries, as evenly as the pages allow */
        const int64_t pages = (len + a->page_size - 1) / a->page_size;
        const int64_t t0 = (pages * sp / splits) * a->page_size;
        int64_t t1 = (pages * (sp + 1) / splits) * a->page_size;
        if (t1 > len) t1 = len;
        float *pm = parts + it * part, *pl = pm + heads, *pa = pl + heads;
        vf *mine = work + (int64_t)omp_get_thread_num() * (work_size / (int64_t)sizeof(vf));
        /* head dims 64 and 128 get their own copies, the vector count a constant there (the
         * key and value vectors then stay in registers: 1.2-1.4x measured at 64); and each
         * dtype its own (cpu_math.h) */
        DTYPE_CONSTANT(if (nv == 4) attend_item(a, b, t0, t1, pm, pl, pa, mine, is_bf16, 4);
                       else if (nv == 8) attend_item(a, b, t0, t1, pm, pl, pa, mine, is_bf16, 8);
                       else attend_item(a, b, t0, t1, pm, pl, pa, mine, is_bf16, nv));
    }
    /* merge each head's splits by their maxima (an empty split has max -inf) */
    for (int64_t b = 0; b < a->batch; b++) {
        for (int h = 0; h < heads; h++) {
            float mx = -INFINITY, total = 0.0f, o[MAX_HEAD_DIM];
            for (int sp = 0; sp < splits; sp++) {
                const float mv = parts[(b * splits + sp) * part + h];
                mx = mv > mx ? mv : mx;
            }
            for (int i = 0; i < d; i++) o[i] = 0.0f;
            for (int sp = 0; sp < splits; sp++) {
                const float *pm = parts + (b * splits + sp) * part;
                if (pm[h] == -INFINITY) continue;
                const float w = exp2_nonpositive(pm[h] - mx); /* maxima in base 2 */
                total += w * pm[heads + h];
                const float *pa = pm + 2 * heads + (int64_t)h * d;
                for (int i = 0; i < d; i++) o[i] += w * pa[i];
            }
            const float inv = 1.0f / total;
            for (int i = 0; i < d; i++) st(out, (b * heads + h) * d + i, o[i] * inv, is_bf16);
        }
    }
    free(parts);
    free(work);
    return 0;
}

/* The entry points (ctypes, common/model/paged_attention.py): pool = KVPool.rows of
 * row_elems values per row; rows [batch, width] int64 base rows; lens [batch] int64 (>= 1);
 * q [batch, heads, d] with q_stride values between sequences; out [batch, heads, d]
 * contiguous. Returns 0, -1 for a shape the kernel does not take, -2 out of memory. */
#define ENTRY(NAME, IS_BF16)                                                                   \
    int NAME(const void *pool, int64_t row_elems, const int64_t *rows, int64_t width,          \
             const int64_t *lens, int64_t batch, int64_t layer, const void *q,                 \
             int64_t q_stride, void *out, int heads, int kv_heads, int d, int page_size,       \
             float scale, int splits, int threads) {                                           \
        const Args a = {pool, row_elems, width, layer, q_stride, batch, rows, lens, q,         \
                        heads, kv_heads, d, page_size, splits, scale};                         \
        return attend(&a, out, threads, IS_BF16);                                              \
    }

ENTRY(paged_decode_attention_f32, 0)
ENTRY(paged_decode_attention_bf16, 1)
