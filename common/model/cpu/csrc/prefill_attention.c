/* Causal attention of a prefill span (a whole prompt, a later chunk, a cache hit) read from
 * the paged KV pool in place: the span's new tokens, their K and V already written to the
 * pages, attend to every key up to their own position.
 *
 * Pool rows as in paged_attention.c: a page's layer-l K is row base + 2l, its V row
 * base + 2l + 1, each page_size tokens x kv_heads x head_dim.
 *
 * Flash attention in float32 (the pool, queries and output float32 or bfloat16; bfloat16
 * K and V become float32 as they are packed, the output is rounded once), blocked for the
 * registers: a work item is one KV head and one block of query tokens, whose rows are
 * (token, query head of that KV head) pairs, so every key block packed is used by all the
 * heads that share it (GQA). Per key block of
 * BLOCK_K keys: K packed transposed and V packed (both in float32, zero past the keys that
 * exist), scores S = Q K^T by a register tile of ROWS x NV vectors, the causal mask on the
 * blocks that cross the diagonal (blocks above it are never read; on those a tile of rows
 * computes only the scores up to its last row's keys), an online softmax per row (running
 * max and sum, in base 2: exp2_nonpositive; every row's max first, then every row's exps,
 * so one row's latencies do not stall the next) and O = alpha O + P V by the same tile
 * (the skip and the two passes, on the AVX2 build at SmolLM2's shape: 106 -> 126 GFLOP/s at
 * 128 tokens, 180 -> 190 at 1024). Work items run heaviest first (the last query blocks see
 * the most keys). The packed K and V
 * of the span are a transient float32 copy, 2 x kv_heads x tokens x head_dim (12 MB at
 * 8k tokens for SmolLM2): every query block reads them, and each is packed once.
 *
 * torch's CPU flash kernel computes the same thing from a contiguous copy with each KV head
 * repeated for its query heads (and, after a cached prefix, from the pages gathered and two
 * passes merged); this reads the pages where they are.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_math.h" /* and immintrin.h, where there is AVX */

/* A register tile is ROWS score rows x NV vectors: ROWS x NV accumulators, NV loaded
 * vectors and a broadcast, within the 32 (AVX-512) or 16 (AVX2) vector registers. */
#if defined(__AVX512F__)
#define VL 16 /* floats per vector register */
#define ROWS 6
#define NV 4 /* 24 accumulators */
#else
#define VL 8
#define ROWS 6
#define NV 2 /* 12 accumulators: 3 x 4 needed 17 registers and spilled (1.1-1.25x slower) */
#endif
#define TILE_COLS (NV * VL) /* 64 or 16; head dims are multiples of 16 */
#define BLOCK_K 64          /* keys per block */
#define MAX_HEAD_DIM 256
#define MAX_GROUPS 16
#define TARGET_ROWS 96 /* rows per work item: query tokens x query heads per KV head */

typedef float vec __attribute__((vector_size(VL * 4)));

static inline vec vload(const float *p) {
    vec v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void vstore(float *p, vec v) { memcpy(p, &v, sizeof v); }

/* x in every lane: x - 0 is x exactly (even -0), so this folds to one broadcast; 0 + x
 * does not fold (-0 + 0 is +0) and costs a scalar add per broadcast. */
static inline vec splat(float x) { return x - (vec){0}; }

/* a > b ? a : b per lane: one MAXPS (cpu_math.h's max8 on 8 lanes) */
static inline vec vmax(vec a, vec b) {
#if VL == 16
    return (vec)_mm512_max_ps((__m512)a, (__m512)b);
#else
    return max8(a, b);
#endif
}

/* Horizontal max and sum (cpu_math.h's trees of halves) */
#if VL == 16
#define hmax hmax16
#define hsum hsum16
#else
#define hmax hmax8
#define hsum hsum8
#endif

/* 2^x for x <= 0 on this width's vectors (cpu_math.h; scores are in base 2: q is scaled
 * by log2(e) too) */
#if VL == 16
#define vexp2_nonpositive exp2_nonpositive16
#else
#define vexp2_nonpositive exp2_nonpositive8
#endif

/* s[r][0..TILE_COLS) = sum_c q[r][c] kt[c][0..TILE_COLS) for ROWS rows (row strides d, BLOCK_K). */
static inline __attribute__((always_inline)) void score_tile(const float *q, const float *kt,
                                                             int d, float *s) {
    vec acc[ROWS][NV];
    for (int r = 0; r < ROWS; r++)
        for (int v = 0; v < NV; v++) acc[r][v] = (vec){0};
#pragma GCC unroll 4 /* a step's uops alone: the loop's own 3 more held AVX2 back 2% */
    for (int c = 0; c < d; c++) {
        vec k[NV];
        for (int v = 0; v < NV; v++) k[v] = vload(kt + (int64_t)c * BLOCK_K + v * VL);
        for (int r = 0; r < ROWS; r++) {
            const vec qv = splat(q[(int64_t)r * d + c]);
            for (int v = 0; v < NV; v++) acc[r][v] += qv * k[v];
        }
    }
    for (int r = 0; r < ROWS; r++)
        for (int v = 0; v < NV; v++) vstore(s + (int64_t)r * BLOCK_K + v * VL, acc[r][v]);
}

/* o[r][0..nv VL) = alpha[r] o[r] + sum_{j < n} p[r][j] v[j][0..nv VL) (o and v stride d);
 * nv is a constant where it is called (NV, or 1 for a head dim's last vectors). */
static inline __attribute__((always_inline)) void value_tile(const float *p, const float *v,
                                                             int d, int n, const float *alpha,
                                                             float *o, int nv) {
    vec acc[ROWS][NV];
    for (int r = 0; r < ROWS; r++)
        for (int c = 0; c < nv; c++) acc[r][c] = vload(o + (int64_t)r * d + c * VL) * alpha[r];
#pragma GCC unroll 4
    for (int j = 0; j < n; j++) {
        vec vv[NV];
        for (int c = 0; c < nv; c++) vv[c] = vload(v + (int64_t)j * d + c * VL);
        for (int r = 0; r < ROWS; r++) {
            const vec pv = splat(p[(int64_t)r * BLOCK_K + j]);
            for (int c = 0; c < nv; c++) acc[r][c] += pv * vv[c];
        }
    }
    for (int r = 0; r < ROWS; r++)
        for (int c = 0; c < nv; c++) vstore(o + (int64_t)r * d + c * VL, acc[r][c]);
}

typedef struct {
    const void *pool; /* float32 or, with is_bf16, bfloat16: as q and out */
    int64_t row_elems, layer, q_stride, n_q, q_pos0, out_stride;
    const int64_t *rows;
    const void *q;
    void *out;
    int heads, kv_heads, d, page_size, block_q, is_bf16;
    float scale;
} Args;

typedef struct {
    float *q, *s, *o, *m, *alpha;
    float *l; /* per row, its sum so far in VL lanes (added across them once, at the end) */
} Scratch;

/* Packs key block b of KV head h (keys [b BLOCK_K, + n)): K transposed into kt [d][BLOCK_K],
 * V into v [BLOCK_K][d], as float32; keys past n are zero (never NaN from a stale slot). */
static inline __attribute__((always_inline)) void pack_block(const Args *a, int h, int64_t b,
                                                              int n, float *kt, float *v,
                                                              int is_bf16) {
    const int d = a->d;
    const int64_t tok = (int64_t)a->kv_heads * d, ps = a->page_size;
    for (int j = 0; j < n; j++) {
        const int64_t pos = b * BLOCK_K + j, page = pos / ps, off = pos % ps;
        const int64_t krow = a->rows[page] + 2 * a->layer;
        const int64_t kat = krow * a->row_elems + off * tok + (int64_t)h * d;
        const int64_t vat = kat + a->row_elems;
        for (int c = 0; c < d; c++) kt[(int64_t)c * BLOCK_K + j] = ld(a->pool, kat + c, is_bf16);
        for (int c = 0; c < d; c++) v[(int64_t)j * d + c] = ld(a->pool, vat + c, is_bf16);
    }
    for (int j = n; j < BLOCK_K; j++) {
        for (int c = 0; c < d; c++) kt[(int64_t)c * BLOCK_K + j] = 0.0f;
        memset(v + (int64_t)j * d, 0, sizeof(float) * d);
    }
}

/* How many keys of the block from key k0 (n of them exist) row r sees: those up to its
 * token's position; a padding row (r >= rows) sees what the last real row sees. */
static inline int keys_seen(int masked, int64_t first_pos, int r, int rows, int groups,
                            int64_t k0, int n) {
    if (!masked) return n;
    const int64_t upto = first_pos + (r < rows ? r : rows - 1) / groups - k0 + 1;
    return upto < 0 ? 0 : (upto < n ? (int)upto : n);
}

/* One work item: KV head h, query tokens [t0, t0 + nt). Row r is token t0 + r / groups,
 * query head h * groups + r % groups; rows are padded to a multiple of ROWS with zeros. */
static inline __attribute__((always_inline)) void item(const Args *a, int h, int64_t t0, int nt,
                                                        const float *kt_all, const float *v_all,
                                                        Scratch *w, int is_bf16) {
    const int d = a->d, groups = a->heads / a->kv_heads;
    const int rows = nt * groups, padded = (rows + ROWS - 1) / ROWS * ROWS;
    const float scale2 = a->scale * 1.44269504088896341f; /* scores in base 2 */
    for (int r = 0; r < padded; r++) {
        float *qr = w->q + (int64_t)r * d;
        if (r < rows) {
            const int64_t at = (t0 + r / groups) * a->q_stride + (int64_t)(h * groups + r % groups) * d;
            for (int c = 0; c < d; c++) qr[c] = ld(a->q, at + c, is_bf16) * scale2;
        } else {
            memset(qr, 0, sizeof(float) * d);
        }
        memset(w->o + (int64_t)r * d, 0, sizeof(float) * d);
        w->m[r] = -INFINITY;
        vstore(w->l + (int64_t)r * VL, (vec){0});
    }
    const int64_t first_pos = a->q_pos0 + t0, last_pos = first_pos + nt - 1;
    for (int64_t k0 = 0; k0 <= last_pos; k0 += BLOCK_K) {
        const int n = last_pos + 1 - k0 < BLOCK_K ? (int)(last_pos + 1 - k0) : BLOCK_K;
        const float *kt = kt_all + k0 * d, *v = v_all + k0 * d;
        const int masked = k0 + n - 1 > first_pos; /* a key after some row's own position */
#define SEEN(r) keys_seen(masked, first_pos, (r), rows, groups, k0, n)
        /* on the diagonal a tile of rows skips the score tiles past its last row's keys (the
         * softmax's mask sets them to -inf) */
        for (int r = 0; r < padded; r += ROWS) {
            const int keys = SEEN(r + ROWS - 1);
            for (int c = 0; c < keys; c += TILE_COLS)
                score_tile(w->q + (int64_t)r * d, kt + c, d, w->s + (int64_t)r * BLOCK_K + c);
        }
        /* softmax in two passes over the rows, so no row's chain of latencies (its max, then
         * the exps that wait on it) holds up the next: each row's new max first (in alpha,
         * for now), then the exps */
        for (int r = 0; r < padded; r++) {
            float *s = w->s + (int64_t)r * BLOCK_K;
            for (int j = SEEN(r); j < BLOCK_K; j++) s[j] = -INFINITY; /* exp gives 0 */
            /* the block's max as a tree of halves: log2(BLOCK_K / VL) dependent steps */
            vec part[BLOCK_K / VL];
            for (int j = 0; j < BLOCK_K / VL; j++) part[j] = vload(s + j * VL);
            for (int width = BLOCK_K / VL / 2; width >= 1; width /= 2)
                for (int j = 0; j < width; j++) part[j] = vmax(part[j], part[j + width]);
            const float mx = hmax(part[0]);
            w->alpha[r] = w->m[r] > mx ? w->m[r] : mx;
        }
        for (int r = 0; r < padded; r++) {
            float *s = w->s + (int64_t)r * BLOCK_K;
            const float mx = w->alpha[r];
            vec total = (vec){0};
            for (int j = 0; j < BLOCK_K; j += VL) {
                const vec e = vexp2_nonpositive(vload(s + j) - mx);
                vstore(s + j, e);
                total += e;
            }
            /* 2^0 is 1 exactly: once a row's max settles (most blocks) its exp is skipped */
            w->alpha[r] = mx > w->m[r] ? exp2_nonpositive(w->m[r] - mx) : 1.0f;
            float *l = w->l + (int64_t)r * VL;
            vstore(l, vload(l) * w->alpha[r] + total);
            w->m[r] = mx;
        }
        for (int r = 0; r < padded; r += ROWS) {
            const float *p = w->s + (int64_t)r * BLOCK_K;
            float *o = w->o + (int64_t)r * d;
            const int keys = SEEN(r + ROWS - 1); /* past them every row's p is 0 */
            int c = 0;
            for (; c + TILE_COLS <= d; c += TILE_COLS)
                value_tile(p, v + c, d, keys, w->alpha + r, o + c, NV);
            for (; c < d; c += VL) value_tile(p, v + c, d, keys, w->alpha + r, o + c, 1);
        }
#undef SEEN
    }
    for (int r = 0; r < rows; r++) {
        const int64_t at = (t0 + r / groups) * a->out_stride + (int64_t)(h * groups + r % groups) * d;
        const float inv = 1.0f / hsum(vload(w->l + (int64_t)r * VL));
        const float *o = w->o + (int64_t)r * d;
        for (int c = 0; c < d; c++) st(a->out, at + c, o[c] * inv, is_bf16);
    }
}

static int attend(const Args *a, int threads) {
    const int d = a->d, is_bf16 = a->is_bf16;
    if (a->kv_heads < 1 || a->heads % a->kv_heads || a->heads / a->kv_heads > MAX_GROUPS ||
        d > MAX_HEAD_DIM || d % 16 || a->n_q < 1 || a->q_pos0 < 0 || threads < 1)
        return -1;
    const int groups = a->heads / a->kv_heads;
    const int64_t bq = a->block_q, blocks = (a->n_q + bq - 1) / bq;
    const int64_t items = blocks * a->kv_heads;
    const int64_t padded = (bq * groups + ROWS - 1) / ROWS * ROWS;
    const int64_t keys = a->q_pos0 + a->n_q, kblocks = (keys + BLOCK_K - 1) / BLOCK_K;
    const int64_t per_head = kblocks * BLOCK_K * (int64_t)d; /* K^T blocks, or V blocks */
    const int64_t per_thread = padded * (2 * d + BLOCK_K + 2 + VL);
    if (threads > items) threads = (int)items;
    float *packed = aligned_alloc(64, sizeof(float) * (size_t)(2 * per_head * a->kv_heads));
    /* aligned_alloc wants a multiple of the alignment: 16 floats */
    float *scratch = aligned_alloc(64, sizeof(float) * (size_t)((per_thread * threads + 15) / 16 * 16));
    if (!packed || !scratch) {
        free(packed);
        free(scratch);
        return -2;
    }
#pragma omp parallel num_threads(threads)
    {
        /* every key block of every KV head packed once, then used by all query blocks */
#pragma omp for schedule(static)
        for (int64_t it = 0; it < kblocks * a->kv_heads; it++) {
            const int h = (int)(it / kblocks);
            const int64_t b = it % kblocks;
            const int n = keys - b * BLOCK_K < BLOCK_K ? (int)(keys - b * BLOCK_K) : BLOCK_K;
            float *kt = packed + h * per_head + b * BLOCK_K * d;
            float *v = packed + (a->kv_heads + h) * per_head + b * BLOCK_K * d;
            DTYPE_CONSTANT(pack_block(a, h, b, n, kt, v, is_bf16));
        }
        float *base = scratch + per_thread * omp_get_thread_num();
        Scratch w = {base, base + padded * d, base + padded * (d + BLOCK_K),
                     base + padded * (2 * d + BLOCK_K), base + padded * (2 * d + BLOCK_K + 1),
                     base + padded * (2 * d + BLOCK_K + 2)};
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++) {
            /* heaviest first: the last query block, every KV head, then the one before */
            const int64_t block = blocks - 1 - it / a->kv_heads;
            const int h = (int)(it % a->kv_heads);
            const int64_t t0 = block * bq;
            const int nt = a->n_q - t0 < bq ? (int)(a->n_q - t0) : (int)bq;
            DTYPE_CONSTANT(item(a, h, t0, nt, packed + h * per_head,
                                packed + (a->kv_heads + h) * per_head, &w, is_bf16));
        }
    }
    free(packed);
    free(scratch);
    return 0;
}

/* The entry points (ctypes, common/model/paged_attention.py), one per dtype of the pool,
 * q and out: pool = KVPool.rows of row_elems values per row; rows: the span's pages' base
 * rows, covering q_pos0 + n_q tokens; q [n_q, heads, d] with q_stride values between
 * tokens; out [n_q, heads * d] with out_stride values between tokens. Query token i is at
 * position q_pos0 + i. Return 0, -1 for a shape the kernel does not take, -2 out of memory. */
static int prefill(const void *pool, int64_t row_elems, const int64_t *rows, int64_t layer,
                   const void *q, int64_t q_stride, int64_t n_q, int64_t q_pos0, void *out,
                   int64_t out_stride, int heads, int kv_heads, int d, int page_size,
                   float scale, int threads, int is_bf16) {
    const int groups = kv_heads > 0 ? heads / kv_heads : 1;
    int bq = TARGET_ROWS / (groups > 0 ? groups : 1);
    if (bq < 8) bq = 8;
    const Args a = {pool, row_elems, layer, q_stride, n_q, q_pos0, out_stride, rows, q,
                    out, heads, kv_heads, d, page_size, bq, is_bf16, scale};
    return attend(&a, threads);
}

#define ENTRY(NAME, IS_BF16)                                                                   \
    int NAME(const void *pool, int64_t row_elems, const int64_t *rows, int64_t layer,          \
             const void *q, int64_t q_stride, int64_t n_q, int64_t q_pos0, void *out,          \
             int64_t out_stride, int heads, int kv_heads, int d, int page_size, float scale,   \
             int threads) {                                                                    \
        return prefill(pool, row_elems, rows, layer, q, q_stride, n_q, q_pos0, out,            \
                       out_stride, heads, kv_heads, d, page_size, scale, threads, IS_BF16);    \
    }

ENTRY(paged_prefill_attention_f32, 0)
ENTRY(paged_prefill_attention_bf16, 1)
