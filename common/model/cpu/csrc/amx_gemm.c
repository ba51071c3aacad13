/* y = x @ W.T for bfloat16 at decode's row counts, on AMX tiles (Intel Sapphire Rapids and
 * later): the weight streamed once from memory per call, in the tiles' own layout.
 *
 * At 1-64 rows a product reads each weight once and does a few multiply-adds with it, so
 * its time is the weight's bytes over the memory bandwidth. oneDNN's bfloat16 products
 * reached about a third of that on a 2-core AMX Xeon (common/model/gemm.py has the
 * figures); this kernel keeps the tile units fed from a weight laid out as they read it.
 *
 * Packed layout (common/model/amx_gemm.py packs it with one permutation): the weight
 * [N, K] cut into blocks of 16 output columns x 32 inputs; block (n, k) is 16 rows of 16
 * column pairs, element [p][c][e] = W[16n + c][32k + 2p + e] (the VNNI pairs a
 * TDPBF16PS B tile holds), and the blocks lie n-major: one column block's weights are 1 KiB
 * per 32 inputs, contiguous, read front to back.
 *
 * Per pair of column blocks and per 32 rows of x: four accumulator tiles (2 row tiles x 2
 * column blocks), two x tiles, two weight tiles. The rows loop inside the column loop, so
 * above 32 rows a column pair's weights come from cache the second time. Accumulation is
 * float32 in the tile unit's order; the result is rounded to bfloat16 once, as torch rounds
 * its product's float32 sum. Threads take contiguous ranges of column pairs.
 *
 * Compiled to a stub (amx_gemm_ready() == 0) in every variant but amx (common/model/cpu/
 * build.py), whose flags enable AMX.
 */
#include <stdint.h>
#include <string.h>

#include "cpu_math.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define HAVE_AMX 1
#include <immintrin.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define BLOCK_N 16 /* output columns per weight tile */
#define BLOCK_K 32 /* inputs per weight tile (16 VNNI pairs) */
#define TILE_ELEMS (BLOCK_N * BLOCK_K)
#define PREFETCH 4 /* weight tiles ahead */

#ifdef HAVE_AMX

typedef struct {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

/* Tiles 0-3: accumulators (row tile r, column block c) = 2c + r; 4-5: x rows 0-15 and
 * 16-31; 6-7: the two column blocks' weights. `rows1` is the second row tile's height. */
static void configure(int rows0, int rows1) {
    TileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    const int heights[8] = {rows0, rows1, rows0, rows1, rows0, rows1, BLOCK_K / 2, BLOCK_K / 2};
    for (int t = 0; t < 8; t++) {
        const int h = heights[t] > 0 ? heights[t] : 1;
        cfg.rows[t] = (uint8_t)h;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

/* The accumulators of one column pair and up to 32 rows to y, rounded to bfloat16; torch
 * rounds the product, then adds the bias and rounds again. */
static void store_rows(float acc[32][2 * BLOCK_N], int rows, int blocks, const bf16 *bias,
                       bf16 *y, int64_t ldy) {
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < blocks; c++) {
            f32x16 v;
            memcpy(&v, &acc[r][c * BLOCK_N], sizeof v);
            u16x16 h = to_bf16x16(v);
            if (bias != NULL)
                h = to_bf16x16(load_bf16x16((const bf16 *)&h) + load_bf16x16(bias + c * BLOCK_N));
            memcpy(y + r * ldy + c * BLOCK_N, &h, sizeof h);
        }
}

/* One column pair (or a last single block, `two_cols` 0) over rows [0, rows) of x. */
static inline __attribute__((always_inline)) void pair_rows(const bf16 *x, int64_t ldx,
                                                            const bf16 *w0, int64_t kb,
                                                            int two_rows, int two_cols,
                                                            float acc[32][2 * BLOCK_N]) {
    const bf16 *w1 = w0 + kb * TILE_ELEMS;
    _tile_zero(0);
    _tile_zero(2);
    if (two_rows) {
        _tile_zero(1);
        _tile_zero(3);
    }
    for (int64_t b = 0; b < kb; b++) {
        /* Into L1 four tiles ahead: without it the tile loads wait on memory, 1.25x slower
         * over SmolLM2's products at 1-32 rows. Past a block's end this fetches the next
         * block's start (or nothing: a prefetch never faults). */
        const char *p0 = (const char *)(w0 + (b + PREFETCH) * TILE_ELEMS);
        const char *p1 = (const char *)(w1 + (b + PREFETCH) * TILE_ELEMS);
        for (int line = 0; line < 1024; line += 64) {
            _mm_prefetch(p0 + line, _MM_HINT_T0);
            if (two_cols) _mm_prefetch(p1 + line, _MM_HINT_T0);
        }
        _tile_loadd(4, x + b * BLOCK_K, ldx * 2);
        _tile_loadd(6, w0 + b * TILE_ELEMS, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (two_cols) {
            _tile_loadd(7, w1 + b * TILE_ELEMS, 64);
            _tile_dpbf16ps(2, 4, 7);
        }
        if (two_rows) {
            _tile_loadd(5, x + 16 * ldx + b * BLOCK_K, ldx * 2);
            _tile_dpbf16ps(1, 5, 6);
            if (two_cols) _tile_dpbf16ps(3, 5, 7);
        }
    }
    const int64_t stride = 2 * BLOCK_N * sizeof(float);
    _tile_stored(0, &acc[0][0], stride);
    if (two_cols) _tile_stored(2, &acc[0][BLOCK_N], stride);
    if (two_rows) {
        _tile_stored(1, &acc[16][0], stride);
        if (two_cols) _tile_stored(3, &acc[16][BLOCK_N], stride);
    }
}

static void columns(const bf16 *x, int64_t ldx, int64_t m, const bf16 *packed, int64_t kb,
                    int64_t pair0, int64_t pair1, int64_t nblocks, const bf16 *bias, bf16 *y,
                    int64_t ldy) {
    float acc[32][2 * BLOCK_N] __attribute__((aligned(64)));
    int configured = -1;
    for (int64_t pair = pair0; pair < pair1; pair++) {
        const int64_t nb = 2 * pair;
        const int two_cols = nb + 1 < nblocks;
        const bf16 *w0 = packed + nb * kb * TILE_ELEMS;
        const bf16 *b = bias != NULL ? bias + nb * BLOCK_N : NULL;
        for (int64_t r0 = 0; r0 < m; r0 += 32) {
            const int rows = m - r0 < 32 ? (int)(m - r0) : 32;
            const int rows0 = rows < 16 ? rows : 16;
            if (configured != rows) {
                configure(rows0, rows - rows0);
                configured = rows;
            }
            if (rows > 16)
                pair_rows(x + r0 * ldx, ldx, w0, kb, 1, two_cols, acc);
            else
                pair_rows(x + r0 * ldx, ldx, w0, kb, 0, two_cols, acc);
            store_rows(acc, rows, two_cols ? 2 : 1, b, y + r0 * ldy + nb * BLOCK_N,
                       ldy);
        }
    }
    _tile_release();
}

static int permitted = -1;

int amx_gemm_ready(void) {
    if (permitted < 0)
        permitted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return permitted;
}

/* y [m, n] (row stride ldy) = x [m, k] (row stride ldx) @ W.T (+ bias [n]), W packed by
 * common/model/amx_gemm.py. Returns 0, or -1 where AMX cannot be used (the kernel did not
 * permit it, or a shape not in whole blocks). */
int amx_gemm_bf16(const bf16 *x, int64_t ldx, int64_t m, const bf16 *packed, int64_t n,
                  int64_t k, const bf16 *bias, bf16 *y, int64_t ldy, int threads) {
    if (!amx_gemm_ready() || n % BLOCK_N != 0 || k % BLOCK_K != 0 || m < 1) return -1;
    const int64_t nblocks = n / BLOCK_N, pairs = (nblocks + 1) / 2, kb = k / BLOCK_K;
    if (threads > pairs) threads = (int)pairs;
    if (threads <= 1) {
        columns(x, ldx, m, packed, kb, 0, pairs, nblocks, bias, y, ldy);
        return 0;
    }
#pragma omp parallel num_threads(threads)
    {
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        columns(x, ldx, m, packed, kb, pairs * t / nt, pairs * (t + 1) / nt, nblocks, bias, y,
                ldy);
    }
    return 0;
}

#else

int amx_gemm_ready(void) { return 0; }

int amx_gemm_bf16(const bf16 *x, int64_t ldx, int64_t m, const bf16 *packed, int64_t n,
                  int64_t k, const bf16 *bias, bf16 *y, int64_t ldy, int threads) {
    (void)x, (void)ldx, (void)m, (void)packed, (void)n, (void)k, (void)bias, (void)y, (void)ldy,
        (void)threads;
    return -1;
}

#endif
