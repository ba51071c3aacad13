/* The small per-layer steps of the forward pass, each one call instead of two to six torch
 * ops (their dispatch, their temporaries, a thread wake-up each): at decode's row counts
 * they took a quarter to a third of a step (measured on an AMX Xeon, bfloat16 batch 32:
 * 16 of 50 ms outside the products and attention).
 *
 *   add_rms_norm  x += y, then h = w * x * rsqrt(mean(x^2) + eps)   (residual, next norm)
 *   rope_store    q and k rotated (rotate-half RoPE), k and v written to their pool slots
 *   silu_mul      silu(gate) * up
 *
 * Rounding follows torch's ops step by step: each op's result is rounded to the model's
 * dtype where torch rounds it (float32 math inside, as torch's CPU kernels do), and this
 * file is compiled with -ffp-contract=off so no multiply and add are fused where torch
 * rounds between them. Two things differ by float rounding only: the order of the sum in
 * the norm, and exp (a polynomial, relative error < 2e-7, where torch uses Sleef's: exp_poly16).
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_math.h"

/* A strided matrix's rows laid out contiguously, in this thread's reusable buffer (a
 * weight-major product's output is a transposed view; torch's copy of one measured 3-4x
 * slower than its use here). Blocks of 64 columns keep the source lines in L1. */
static __thread char *rows_buf;
static __thread size_t rows_cap;

static const void *contiguous_rows(const void *src, int64_t rs, int64_t cs, int64_t rows,
                                   int64_t cols, int is_bf16) {
    if (cs == 1) return src;
    const size_t need = (size_t)(rows * cols) * (is_bf16 ? 2 : 4);
    if (need > rows_cap) {
        char *grown = realloc(rows_buf, need);
        if (!grown) return NULL;
        rows_buf = grown;
        rows_cap = need;
    }
    for (int64_t i0 = 0; i0 < cols; i0 += 64) {
        const int64_t i1 = i0 + 64 < cols ? i0 + 64 : cols;
        for (int64_t t = 0; t < rows; t++)
            for (int64_t i = i0; i < i1; i++) {
                if (is_bf16)
                    ((bf16 *)rows_buf)[t * cols + i] = ((const bf16 *)src)[t * rs + i * cs];
                else
                    ((float *)rows_buf)[t * cols + i] = ((const float *)src)[t * rs + i * cs];
            }
    }
    return rows_buf;
}

/* Rows split over threads only where the work pays for waking them (torch's grain size,
 * 32768 elements). Not `omp parallel if (...)`: with libgomp that costs about 9 us a call
 * even when false, 7x a 1536-wide silu on one row. `nthreads` and `is_bf16` must be in
 * scope. */
#define FOR_ROWS(rows, elems, CALL)                                                            \
    do {                                                                                       \
        if (nthreads > 1 && (elems) >= 32768) {                                                \
            _Pragma("omp parallel for schedule(static) num_threads(nthreads)")                 \
            for (int64_t t = 0; t < (rows); t++) DTYPE_CONSTANT(CALL);                         \
        } else {                                                                               \
            for (int64_t t = 0; t < (rows); t++) CALL;                                         \
        }                                                                                      \
    } while (0)

static inline __attribute__((always_inline)) void add_rms_norm_row(
    void *x, const void *y, int64_t y_rs, int64_t y_cs, const void *w, void *h, int64_t t,
    int64_t hidden, float eps, int is_bf16) {
    if (y)
        for (int64_t i = 0; i < hidden; i++)
            st(x, t * hidden + i,
               ld(x, t * hidden + i, is_bf16) + ld(y, t * y_rs + i * y_cs, is_bf16), is_bf16);
    /* 16 running sums (vectorized), added as a tree */
    float lanes[16] = {0};
    int64_t i = 0;
    for (; i + 16 <= hidden; i += 16)
        for (int l = 0; l < 16; l++) {
            const float v = ld(x, t * hidden + i + l, is_bf16);
            lanes[l] += v * v;
        }
    for (; i < hidden; i++) {
        const float v = ld(x, t * hidden + i, is_bf16);
        lanes[i % 16] += v * v;
    }
    for (int width = 8; width >= 1; width /= 2)
        for (int l = 0; l < width; l++) lanes[l] += lanes[l + width];
    const float r = 1.0f / sqrtf(lanes[0] / (float)hidden + eps);
    for (i = 0; i < hidden; i++) {
        const float n = rnd(ld(x, t * hidden + i, is_bf16) * r, is_bf16);
        st(h, t * hidden + i, ld(w, i, is_bf16) * n, is_bf16);
    }
}

static inline __attribute__((always_inline)) void add_rms_norm(
    void *x, const void *y, int64_t y_rs, int64_t y_cs, const void *w, void *h, int64_t rows,
    int64_t hidden, float eps, int nthreads, int is_bf16) {
    FOR_ROWS(rows, rows * hidden,
             add_rms_norm_row(x, y, y_rs, y_cs, w, h, t, hidden, eps, is_bf16));
}

static inline __attribute__((always_inline)) void rope_store_row(
    const void *qkv, int64_t rs, const int64_t *positions, const void *cos_t,
    const void *sin_rot_t, void *qk_out, void *pool_tokens, const int64_t *slots,
    int64_t k_offset, int64_t v_offset, int64_t t, int heads, int kv_heads, int d, int is_bf16) {
    const int half = d / 2, rotated = heads + kv_heads;
    const int64_t kv_size = (int64_t)kv_heads * d, elem = is_bf16 ? 2 : 4;
    const int64_t trig = positions[t] * d, k_slot = slots[t] + k_offset;
    for (int hd = 0; hd < rotated; hd++) {
        const int64_t at = t * rs + (int64_t)hd * d, out_at = (t * rotated + hd) * d;
        for (int i = 0; i < d; i++) { /* x * cos + cat(x2, x1) * sin_rot */
            const int j = i < half ? i + half : i - half;
            const float a = rnd(ld(qkv, at + i, is_bf16) * ld(cos_t, trig + i, is_bf16), is_bf16);
            const float b =
                rnd(ld(qkv, at + j, is_bf16) * ld(sin_rot_t, trig + i, is_bf16), is_bf16);
            st(qk_out, out_at + i, a + b, is_bf16);
        }
    }
    /* the rotated K heads and V to their slots (V as it is: a copy, no rounding) */
    char *pool = (char *)pool_tokens;
    memcpy(pool + k_slot * kv_size * elem,
           (const char *)qk_out + ((t * rotated + heads) * (int64_t)d) * elem, kv_size * elem);
    memcpy(pool + (k_slot + v_offset) * kv_size * elem,
           (const char *)qkv + (t * rs + (int64_t)rotated * d) * elem, kv_size * elem);
}

static inline __attribute__((always_inline)) int rope_store(
    const void *qkv, int64_t rs, int64_t cs, const int64_t *positions, const void *cos_t,
    const void *sin_rot_t, void *qk_out, void *pool_tokens, const int64_t *slots,
    int64_t k_offset, int64_t v_offset, int64_t rows, int heads, int kv_heads, int d,
    int nthreads, int is_bf16) {
    const int64_t width = (int64_t)(heads + 2 * kv_heads) * d;
    qkv = contiguous_rows(qkv, rs, cs, rows, width, is_bf16);
    if (!qkv) return -2;
    if (cs != 1) rs = width;
    FOR_ROWS(rows, rows * width,
             rope_store_row(qkv, rs, positions, cos_t, sin_rot_t, qk_out, pool_tokens, slots,
                            k_offset, v_offset, t, heads, kv_heads, d, is_bf16));
    return 0;
}

/* silu(g) rounded to the dtype, times u (store16 rounds the product) */
static inline __attribute__((always_inline)) f32x16 silu_times(f32x16 g, f32x16 u, int is_bf16) {
    f32x16 s = g / (1.0f + exp_poly16(-g));
    if (is_bf16) {
        const u16x16 h = to_bf16x16(s);
        s = load_bf16x16((const bf16 *)&h);
    }
    return s * u;
}

/* n outputs out[o0..] = silu(gu[g0..]) * gu[u0..], each a contiguous run; a tail of under
 * 16 through a zero-padded block, so every element takes the same arithmetic. */
static inline __attribute__((always_inline)) void silu_mul_run(const void *gu, int64_t g0,
                                                               int64_t u0, void *out, int64_t o0,
                                                               int64_t n, int is_bf16) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        store16(out, o0 + i,
             silu_times(load16(gu, g0 + i, is_bf16), load16(gu, u0 + i, is_bf16), is_bf16), is_bf16);
    if (i == n) return;
    float g[16] = {0}, u[16] = {0}, y[16];
    for (int64_t j = i; j < n; j++) {
        g[j - i] = ld(gu, g0 + j, is_bf16);
        u[j - i] = ld(gu, u0 + j, is_bf16);
    }
    f32x16 gv, uv;
    memcpy(&gv, g, sizeof gv);
    memcpy(&uv, u, sizeof uv);
    const f32x16 yv = silu_times(gv, uv, is_bf16);
    memcpy(y, &yv, sizeof y);
    for (int64_t j = i; j < n; j++) st(out, o0 + j, y[j - i], is_bf16);
}

static inline __attribute__((always_inline)) void silu_mul_row(const void *gu, int64_t rs,
                                                               void *out, int64_t t,
                                                               int64_t inter, int is_bf16) {
    silu_mul_run(gu, t * rs, t * rs + inter, out, t * inter, inter, is_bf16);
}

/* A transposed gate_up (each column's rows adjacent: a weight-major product's output),
 * column by column, into a transposed output: out[i * rows + t]. The down product takes
 * that view as it is (weight-major reads it as the contiguous matrix it is). */
static inline __attribute__((always_inline)) void silu_mul_column(const void *gu, int64_t cs,
                                                                  void *out, int64_t i,
                                                                  int64_t rows, int64_t inter,
                                                                  int is_bf16) {
    silu_mul_run(gu, i * cs, (inter + i) * cs, out, i * rows, rows, is_bf16);
}

/* Row-major in, row-major out; transposed in (rs == 1, cs != 1), transposed out; any
 * other layout is made row-major first. */
static inline __attribute__((always_inline)) int silu_mul(const void *gu, int64_t rs, int64_t cs,
                                                          void *out, int64_t rows, int64_t inter,
                                                          int nthreads, int is_bf16) {
    if (cs == 1) {
        FOR_ROWS(rows, rows * inter, silu_mul_row(gu, rs, out, t, inter, is_bf16));
    } else if (rs == 1) {
        FOR_ROWS(inter, rows * inter, silu_mul_column(gu, cs, out, t, rows, inter, is_bf16));
    } else {
        gu = contiguous_rows(gu, rs, cs, rows, 2 * inter, is_bf16);
        if (!gu) return -2;
        FOR_ROWS(rows, rows * inter, silu_mul_row(gu, 2 * inter, out, t, inter, is_bf16));
    }
    return 0;
}

/* Entry points (ctypes, common/model/fused_ops.py): `rs`, `cs` are a strided input's row
 * and column strides in elements (a transposed view allowed); outputs are contiguous.
 * rope_store and silu_mul return 0, or -2 out of memory. */
#define ENTRIES(SUFFIX, IS_BF16)                                                               \
    void add_rms_norm_##SUFFIX(void *x, const void *y, int64_t y_rs, int64_t y_cs,             \
                               const void *w, void *h, int64_t rows, int64_t hidden, float eps, \
                               int threads) {                                                  \
        add_rms_norm(x, y, y_rs, y_cs, w, h, rows, hidden, eps, threads, IS_BF16);             \
    }                                                                                          \
    int rope_store_##SUFFIX(const void *qkv, int64_t rs, int64_t cs, const int64_t *positions, \
                            const void *cos_t, const void *sin_rot_t, void *qk_out,            \
                            void *pool_tokens, const int64_t *slots, int64_t k_offset,         \
                            int64_t v_offset, int64_t rows, int heads, int kv_heads, int d,    \
                            int threads) {                                                     \
        return rope_store(qkv, rs, cs, positions, cos_t, sin_rot_t, qk_out, pool_tokens,       \
                          slots, k_offset, v_offset, rows, heads, kv_heads, d, threads,        \
                          IS_BF16);                                                            \
    }                                                                                          \
    int silu_mul_##SUFFIX(const void *gu, int64_t rs, int64_t cs, void *out, int64_t rows,     \
                          int64_t inter, int threads) {                                        \
        return silu_mul(gu, rs, cs, out, rows, inter, threads, IS_BF16);                       \
    }

ENTRIES(f32, 0)
ENTRIES(bf16, 1)
