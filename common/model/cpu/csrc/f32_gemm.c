/* y = x @ W.T in float32 on AVX-512 or AVX2+FMA, from a weight packed once into column
 * panels, with the next panel's weights fetched from memory while the current one is
 * multiplied.
 *
 * Why: at the row counts of decode and of short prompts (1-256 rows) a product's weight
 * comes from memory every time (a model's weights outgrow the caches), and MKL's and
 * oneDNN's float32 products wait for it: on a 2-core AMX Xeon, SmolLM2's 120 products at
 * 128 rows took 97 ms with each layer's own weights and 81 ms with one layer's weights hot
 * in cache (oneDNN packed; 32 rows: 40 against 28 ms). The multiply-adds leave the memory
 * idle, so this kernel streams the next panel in during them.
 *
 * Packed layout (common/model/f32_gemm.py packs it, asking f32_gemm_panel() for NR): W [N, K]
 * cut into panels of NR output columns (N padded with zero columns to whole panels); panel p
 * is K rows of NR floats, element [p][k][j] = W[NR p + j][k], the panels in order, so a panel
 * is one contiguous run of 4 NR K bytes read front to back. NR is 32 with AVX-512 and 16
 * with AVX2, so the packed copy belongs to the build that made it.
 *
 * Per panel, the rows of x in blocks of MR: a block's MR x NR sums stay in registers over
 * all of K (NR / VL weight vectors and one broadcast x element per k), then go to y with the
 * bias added. AVX-512: 12 x 32, 24 of the 32 zmm registers; AVX2: 6 x 16, 12 of the 16 ymm
 * (12 x 32 would spill there). While a panel's blocks run they prefetch the next panel into
 * L2, its lines spread evenly over the blocks (all in the first block asked more of the
 * memory than it gives: at 128 rows that ran no faster than oneDNN); the later blocks read
 * their own panel from L2. Rows go in chunks whose x is at most a quarter of the core's L2
 * (chunk_bytes), so a chunk's x stays in L2 across the panels. Threads take contiguous
 * ranges of panels. Tried and no faster on the AMX Xeon: x packed into k-major blocks, K cut
 * into parts of 64-256 (a panel's part held in L1), blocks of 8 or 14 rows.
 *
 * Sums run in k order per output (one rounding per multiply-add), so results differ from
 * MKL's (which splits K) by float rounding only.
 *
 * Compiled to a stub (f32_gemm_ready() == 0, f32_gemm_panel() == 0) without AVX-512F or
 * AVX2 with FMA.
 */
#include <stdint.h>
#include <unistd.h>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#include <omp.h>
#endif

#if defined(__AVX512F__)
/* 16-float vectors; a block's 12 x 32 sums take 24 of the 32 vector registers */
#define NR 32
#define MR 12
typedef __m512 vec;
#define VL 16
#define VZERO() _mm512_setzero_ps()
#define VLOAD(p) _mm512_loadu_ps(p)
#define VSET1(a) _mm512_set1_ps(a)
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VADD(a, b) _mm512_add_ps(a, b)
typedef __mmask16 vmask;
#define VMASK(n) ((n) >= VL ? (vmask)0xffff : (n) <= 0 ? (vmask)0 : (vmask)((1u << (n)) - 1))
#define VLOAD_MASKED(m, p) _mm512_maskz_loadu_ps(m, p)
#define VSTORE_MASKED(p, m, v) _mm512_mask_storeu_ps(p, m, v)
#elif defined(__AVX2__) && defined(__FMA__)
/* 8-float vectors; 6 x 16 sums take 12 of the 16, beside two weight vectors and the
 * broadcast (the AVX-512 shape would spill) */
#define NR 16
#define MR 6
typedef __m256 vec;
#define VL 8
#define VZERO() _mm256_setzero_ps()
#define VLOAD(p) _mm256_loadu_ps(p)
#define VSET1(a) _mm256_set1_ps(a)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VADD(a, b) _mm256_add_ps(a, b)
typedef __m256i vmask;
/* lanes below n set */
#define VMASK(n) _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7))
#define VLOAD_MASKED(m, p) _mm256_maskload_ps(p, m)
#define VSTORE_MASKED(p, m, v) _mm256_maskstore_ps(p, m, v)
#endif

#ifdef NR
#define NV (NR / VL) /* weight vectors per k step */
#define SEGMENT_MIN 4 /* steps between prefetches from which they run as segments */

/* rows [0, mr) of x times one panel (w, k inputs) into y's columns [0, cols) of the panel,
 * the bias added if given. `lines` cache lines from `ahead` are prefetched into L2 on the
 * way, one every few steps. mr is a constant in each inlined copy, so the sums stay in
 * registers. */
static inline __attribute__((always_inline)) void block(const float *x, int64_t ldx, int mr,
                                                        const float *w, int64_t k,
                                                        const char *ahead, int64_t lines,
                                                        const float *bias, float *y,
                                                        int64_t ldy, int cols) {
    vec acc[MR][NV];
    for (int r = 0; r < mr; r++)
        for (int v = 0; v < NV; v++) acc[r][v] = VZERO();
    /* one k step: NV weight vectors, then per row a broadcast x element and NV multiply-adds */
#define STEP(i)                                                                     \
    do {                                                                            \
        vec wv[NV];                                                                 \
        for (int v = 0; v < NV; v++) wv[v] = VLOAD(w + (i) * NR + v * VL);          \
        for (int r = 0; r < mr; r++) {                                              \
            const vec a = VSET1(x[r * ldx + (i)]);                                  \
            for (int v = 0; v < NV; v++) acc[r][v] = VFMA(a, wv[v], acc[r][v]);     \
        }                                                                           \
    } while (0)
    /* the next of the `lines` lines from `ahead` into L2 */
#define FETCH()                                     \
    do {                                            \
        if (lines > 0) {                            \
            _mm_prefetch(ahead, _MM_HINT_T1);       \
            ahead += 64;                            \
            lines--;                                \
        }                                           \
    } while (0)
    const int64_t every = lines > 0 ? (k + lines - 1) / lines : k;
    if (every >= SEGMENT_MIN) {
        /* a prefetch, then `every` steps as a plain loop unrolled by 4, so the loop's uops
         * are the steps' own: an AVX2 step is 20 (2 loads, 6 broadcasts, 12 multiply-adds),
         * about what the front end issues in the 6 cycles of its multiply-adds, and the
         * countdown's 4 more per step held them back (6% slower at 1024 rows) */
        for (int64_t i0 = 0; i0 < k; i0 += every) {
            FETCH();
            const int64_t end = i0 + every < k ? i0 + every : k;
#pragma GCC unroll 4
            for (int64_t i = i0; i < end; i++) STEP(i);
        }
    } else {
        /* a prefetch every step or few (decode's few row blocks fetch a whole panel): a
         * countdown in the one loop, which ran faster there than segments of 1-3 steps */
        int64_t countdown = 0;
        for (int64_t i = 0; i < k; i++) {
            if (--countdown <= 0) {
                FETCH();
                countdown = every;
            }
            STEP(i);
        }
    }
#undef FETCH
#undef STEP
    vmask m[NV];
    vec b[NV];
    for (int v = 0; v < NV; v++) {
        m[v] = VMASK(cols - v * VL);
        b[v] = bias != NULL ? VLOAD_MASKED(m[v], bias + v * VL) : VZERO();
    }
    for (int r = 0; r < mr; r++)
        for (int v = 0; v < NV; v++)
            VSTORE_MASKED(y + r * ldy + v * VL, m[v],
                          bias != NULL ? VADD(acc[r][v], b[v]) : acc[r][v]);
}

#define BLOCK_CASE(R) \
    case R: block(x, ldx, R, w, k, ahead, lines, bias, y, ldy, cols); break;

static void any_block(const float *x, int64_t ldx, int mr, const float *w, int64_t k,
                      const char *ahead, int64_t lines, const float *bias,
                      float *y, int64_t ldy, int cols) {
    switch (mr) {
        BLOCK_CASE(1) BLOCK_CASE(2) BLOCK_CASE(3) BLOCK_CASE(4) BLOCK_CASE(5) BLOCK_CASE(6)
#if MR > 6
        BLOCK_CASE(7) BLOCK_CASE(8) BLOCK_CASE(9) BLOCK_CASE(10) BLOCK_CASE(11) BLOCK_CASE(12)
#endif
        default: break;
    }
}

/* A chunk's x may take a quarter of this core's L2 (512 KiB on a 2 MiB Xeon core, 128 KiB
 * on a 512 KiB Zen 3 core), beside the panel it multiplies and the next one coming in. Set
 * once as the library loads. */
static int64_t chunk_bytes = 128 << 10;

__attribute__((constructor)) static void size_chunks(void) {
    const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
    if (l2 >= (512 << 10)) chunk_bytes = l2 / 4;
}

/* Panels [p0, p1) for rows [0, m), in chunks of rows whose x fits in L2 beside a panel. */
static void panels(const float *x, int64_t ldx, int64_t m, const float *packed, int64_t n,
                   int64_t k, int64_t p0, int64_t p1, const float *bias, float *y,
                   int64_t ldy) {
    int64_t chunk = chunk_bytes / (k * 4) / MR * MR;
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

/* Output columns per panel in this build's layout: 32 with AVX-512, 16 with AVX2. */
int f32_gemm_panel(void) { return NR; }

/* y [m, n] (row stride ldy) = x [m, k] (row stride ldx) @ W.T (+ bias [n]), W packed by
 * common/model/f32_gemm.py into ceil(n / NR) panels. Returns 0, or -1 for a bad shape. */
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

int f32_gemm_panel(void) { return 0; }

int f32_gemm(const float *x, int64_t ldx, int64_t m, const float *packed, int64_t n,
             int64_t k, const float *bias, float *y, int64_t ldy, int threads) {
    (void)x, (void)ldx, (void)m, (void)packed, (void)n, (void)k, (void)bias, (void)y, (void)ldy,
        (void)threads;
    return -1;
}

#endif
