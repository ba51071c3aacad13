/* y = x @ W.T in float32 on AVX-512, from a weight packed once into column panels, with the
 * next panel's weights fetched from memory while the current one is multiplied.
 *
 * Why: at the row counts of decode and of short prompts (1-256 rows) a product's weight
 * comes from memory every time (a model's weights outgrow the caches), and MKL's and
 * oneDNN's float32 products wait for it: on a 2-core AMX Xeon, SmolLM2's 120 products at
 * 128 rows took 97 ms with each layer's own weights and 81 ms with one layer's weights hot
 * in cache (oneDNN packed; 32 rows: 40 against 28 ms). The multiply-adds leave the memory
 * idle, so this kernel streams the next panel in during them.
 *
 * Packed layout (common/model/f32_gemm.py packs it): W [N, K] cut into panels of NR = 32
 * output columns (N padded with zero columns to whole panels); panel p is K rows of 32
 * floats, element [p][k][j] = W[32p + j][k], the panels in order, so a panel is one
 * contiguous run of 128 K bytes read front to back.
 *
 * Per panel, the rows of x in blocks of MR = 12: a block's 12 x 32 sums stay in 24
 * registers over all of K (two weight vectors and one broadcast x element per multiply-add
 * pair), then go to y with the bias added. While a panel's blocks run they prefetch the
 * next panel into L2, its lines spread evenly over the blocks (all in the first block
 * asked more of the memory than it gives: at 128 rows that ran no faster than oneDNN);
 * the later blocks read their own panel from L2. Rows go in chunks whose x is at most
 * CHUNK_BYTES, so a chunk's x stays in L2 across the panels. Threads take contiguous
 * ranges of panels. Tried and no faster on the AMX Xeon: x packed into k-major blocks, K cut
 * into parts of 64-256 (a panel's part held in L1), blocks of 8 or 14 rows.
 *
 * Sums run in k order per output (one rounding per multiply-add), so results differ from
 * MKL's (which splits K) by float rounding only.
 *
 * Compiled to a stub (f32_gemm_ready() == 0) without AVX-512F.
 */
#include <stdint.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#include <omp.h>
#endif

#define NR 32 /* output columns per panel: two 16-float vectors */
#define MR 12 /* rows of x per block: 24 accumulators, of the 32 vector registers */
#define CHUNK_BYTES (512 << 10) /* x rows per pass over the panels: at most this much */

#if defined(__AVX512F__)

/* rows [0, mr) of x times one panel (w, k inputs) into y's columns [0, cols) of the panel,
 * the bias added if given. `lines` cache lines from `ahead` are prefetched into L2 on the
 * way, one every few steps. mr is a constant in each inlined copy, so the sums stay in
 * registers. */
static inline __attribute__((always_inline)) void block(const float *x, int64_t ldx, int mr,
                                                        const float *w, int64_t k,
                                                        const char *ahead, int64_t lines,
                                                        const float *bias, float *y,
                                                        int64_t ldy, int cols) {
    const __mmask16 m0 = cols >= 16 ? 0xffff : (__mmask16)((1u << cols) - 1);
    const __mmask16 m1 = cols >= 32 ? 0xffff : cols <= 16 ? 0 : (__mmask16)((1u << (cols - 16)) - 1);
    __m512 acc[MR][2];
    for (int r = 0; r < mr; r++) {
        acc[r][0] = _mm512_setzero_ps();
        acc[r][1] = _mm512_setzero_ps();
    }
    const int64_t every = lines > 0 ? (k + lines - 1) / lines : k + 1;
    int64_t countdown = 0;
    for (int64_t i = 0; i < k; i++) {
        if (--countdown <= 0 && lines > 0) {
            _mm_prefetch(ahead, _MM_HINT_T1);
            ahead += 64;
            lines--;
            countdown = every;
        }
        const __m512 w0 = _mm512_loadu_ps(w + i * NR), w1 = _mm512_loadu_ps(w + i * NR + 16);
        for (int r = 0; r < mr; r++) {
            const __m512 a = _mm512_set1_ps(x[r * ldx + i]);
            acc[r][0] = _mm512_fmadd_ps(a, w0, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(a, w1, acc[r][1]);
        }
    }
    __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
    if (bias != NULL) {
        b0 = _mm512_maskz_loadu_ps(m0, bias);
        b1 = _mm512_maskz_loadu_ps(m1, bias + 16);
    }
    for (int r = 0; r < mr; r++) {
        __m512 v0 = acc[r][0], v1 = acc[r][1];
        if (bias != NULL) {
            v0 = _mm512_add_ps(v0, b0);
            v1 = _mm512_add_ps(v1, b1);
        }
        _mm512_mask_storeu_ps(y + r * ldy, m0, v0);
        _mm512_mask_storeu_ps(y + r * ldy + 16, m1, v1);
    }
}

#define BLOCK_CASE(R) \
    case R: block(x, ldx, R, w, k, ahead, lines, bias, y, ldy, cols); break;

static void any_block(const float *x, int64_t ldx, int mr, const float *w, int64_t k,
                      const char *ahead, int64_t lines, const float *bias,
                      float *y, int64_t ldy, int cols) {
    switch (mr) {
        BLOCK_CASE(1) BLOCK_CASE(2) BLOCK_CASE(3) BLOCK_CASE(4) BLOCK_CASE(5) BLOCK_CASE(6)
        BLOCK_CASE(7) BLOCK_CASE(8) BLOCK_CASE(9) BLOCK_CASE(10) BLOCK_CASE(11) BLOCK_CASE(12)
        default: break;
    }
}

/* Panels [p0, p1) for rows [0, m), in chunks of rows whose x fits in L2 beside a panel. */
static void panels(const float *x, int64_t ldx, int64_t m, const float *packed, int64_t n,
                   int64_t k, int64_t p0, int64_t p1, const float *bias, float *y,
                   int64_t ldy) {
    int64_t chunk = CHUNK_BYTES / (k * 4) / MR * MR;
    if (chunk < MR) chunk = MR;
    const int64_t lines = k * NR * 4 / 64;
    for (int64_t c0 = 0; c0 < m; c0 += chunk) {
        const int64_t rows = m - c0 < chunk ? m - c0 : chunk, nb = (rows + MR - 1) / MR;
        for (int64_t p = p0; p < p1; p++) {
            const float *w = packed + p * k * NR;
            /* the next panel (this range's first again for the next chunk, from cache by
             * then), its lines spread evenly over this panel's row blocks */
            const int64_t q = p + 1 < p1 ? p + 1 : c0 + chunk < m ? p0 : -1;
            const char *next = (const char *)(packed + q * k * NR);
            const int64_t to_fetch = q >= 0 && q != p ? lines : 0;
            const int cols = n - p * NR < NR ? (int)(n - p * NR) : NR;
            const float *b = bias != NULL ? bias + p * NR : NULL;
            for (int64_t bi = 0; bi < nb; bi++) {
                const int64_t r0 = c0 + bi * MR;
                const int mr = c0 + rows - r0 < MR ? (int)(c0 + rows - r0) : MR;
                const int64_t first = to_fetch * bi / nb, last = to_fetch * (bi + 1) / nb;
                any_block(x + r0 * ldx, ldx, mr, w, k, next + first * 64, last - first, b,
                          y + r0 * ldy + p * NR, ldy, cols);
            }
        }
    }
}

int f32_gemm_ready(void) { return 1; }

/* y [m, n] (row stride ldy) = x [m, k] (row stride ldx) @ W.T (+ bias [n]), W packed by
 * common/model/f32_gemm.py into ceil(n / 32) panels. Returns 0, or -1 for a bad shape. */
int f32_gemm(const float *x, int64_t ldx, int64_t m, const float *packed, int64_t n,
             int64_t k, const float *bias, float *y, int64_t ldy, int threads) {
    if (m < 1 || n < 1 || k < 1) return -1;
    const int64_t np = (n + NR - 1) / NR;
    if (threads > np) threads = (int)np;
    if (threads <= 1) {
        panels(x, ldx, m, packed, n, k, 0, np, bias, y, ldy);
        return 0;
    }
#pragma omp parallel num_threads(threads)
    {
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        panels(x, ldx, m, packed, n, k, np * t / nt, np * (t + 1) / nt, bias, y, ldy);
    }
    return 0;
}

#else

int f32_gemm_ready(void) { return 0; }

int f32_gemm(const float *x, int64_t ldx, int64_t m, const float *packed, int64_t n,
             int64_t k, const float *bias, float *y, int64_t ldy, int threads) {
    (void)x, (void)ldx, (void)m, (void)packed, (void)n, (void)k, (void)bias, (void)y, (void)ldy,
        (void)threads;
    return -1;
}

#endif
