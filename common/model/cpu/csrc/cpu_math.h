/* What the CPU kernels share: bfloat16 as torch rounds it, and vectorizable exps. */
#ifndef PDSERVE_CPU_MATH_H
#define PDSERVE_CPU_MATH_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX__)
#include <immintrin.h>
#endif

typedef uint16_t bf16;

static inline float from_bf16(bf16 x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline bf16 to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16)((u >> 16) | 0x40u); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest even, as torch does */
    return (bf16)(u >> 16);
}

/* A value of the model's dtype at index i, as float; stored back rounded. */
static inline __attribute__((always_inline)) float ld(const void *p, int64_t i, int is_bf16) {
    return is_bf16 ? from_bf16(((const bf16 *)p)[i]) : ((const float *)p)[i];
}

static inline __attribute__((always_inline)) void st(void *p, int64_t i, float x, int is_bf16) {
    if (is_bf16)
        ((bf16 *)p)[i] = to_bf16(x);
    else
        ((float *)p)[i] = x;
}

/* STMT compiled once per dtype, with `is_bf16` (a variable in scope) a constant in each.
 * For loop bodies under `omp parallel`: GCC outlines such a body into one function shared by
 * every inlined copy of the function around it, so a dtype the entry points pass down as a
 * constant arrives there as a variable, and every ld and st branches on it per element (a
 * bfloat16 silu_mul of 1024 rows ran 12x slower on 2 threads than on 1). */
#define DTYPE_CONSTANT(STMT)             \
    do {                                 \
        if (is_bf16) {                   \
            const int is_bf16 = 1;       \
            STMT;                        \
        } else {                         \
            const int is_bf16 = 0;       \
            STMT;                        \
        }                                \
    } while (0)

/* The value as the dtype holds it (a product or sum torch rounds before the next op). */
static inline __attribute__((always_inline)) float rnd(float x, int is_bf16) {
    return is_bf16 ? from_bf16(to_bf16(x)) : x;
}

/* exp's reduction and polynomial on x of any float type (float, or a vector of floats,
 * the constants broadcast): x = n ln2 + r, |r| <= ln2/2, sets p ~ exp(r) (degree-6 Taylor,
 * relative error < 2e-7) and n. n is rounded by adding and taking away 1.5 * 2^23
 * (nearbyintf is a library call here, and this is plain arithmetic the compiler
 * vectorizes). x must lie within [-126 ln2, 128 ln2]. */
#define EXP_REDUCE(x, n, p)                                                         \
    do {                                                                            \
        (n) = ((x) * 1.44269504088896341f + 12582912.0f) - 12582912.0f;             \
        const __typeof__(x) r_ = (x) - (n) * 0.693145751953125f -                   \
                                 (n) * 1.42860682030941723e-6f;                     \
        (p) = r_ * (1.0f / 720.0f) + 1.0f / 120.0f;                                 \
        (p) = (p) * r_ + 1.0f / 24.0f;                                              \
        (p) = (p) * r_ + 1.0f / 6.0f;                                               \
        (p) = (p) * r_ + 0.5f;                                                      \
        (p) = (p) * r_ + 1.0f;                                                      \
        (p) = (p) * r_ + 1.0f;                                                      \
    } while (0)

/* 8 and 4 lanes, for horizontal max and sum as trees of halves (lane by lane they are
 * dependent steps: a fifth of the prefill kernel's time when written so). */
typedef float f32x8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef float f32x4 __attribute__((vector_size(16)));
typedef int32_t i32x4 __attribute__((vector_size(16)));

/* a > b ? a : b per lane (b where either is a NaN): one MAXPS where there is AVX (the
 * compare-and-blend GCC makes of the generic form is two dependent instructions, 7 cycles a
 * step on a chain of maxima) */
static inline f32x8 max8(f32x8 a, f32x8 b) {
#if defined(__AVX__)
    return (f32x8)_mm256_max_ps((__m256)a, (__m256)b);
#else
    const i32x8 m = a > b;
    return (f32x8)(((i32x8)a & m) | ((i32x8)b & ~m));
#endif
}

static inline float hmax8(f32x8 a) {
    const f32x4 l = __builtin_shufflevector(a, a, 0, 1, 2, 3);
    const f32x4 h = __builtin_shufflevector(a, a, 4, 5, 6, 7);
    const i32x4 m = l > h;
    const f32x4 b = (f32x4)(((i32x4)l & m) | ((i32x4)h & ~m));
    const float x = b[0] > b[2] ? b[0] : b[2], y = b[1] > b[3] ? b[1] : b[3];
    return x > y ? x : y;
}

static inline float hsum8(f32x8 a) {
    const f32x4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
}

/* 16 lanes (one AVX-512 register, two AVX2 ones) of bfloat16 widened to float, and of
 * float rounded to bfloat16 as to_bf16 rounds them. */
typedef float f32x16 __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));

/* A 16-lane vector's halves, and two halves joined. Without AVX-512 GCC splits 16-lane
 * arithmetic into two AVX2 halves itself but a 16-lane comparison into one scalar compare
 * per lane, so code that compares works on 8-lane halves there (or on shifts, not
 * comparisons). */
static inline f32x8 lo8(f32x16 v) { return __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7); }
static inline f32x8 hi8(f32x16 v) { return __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15); }
static inline f32x16 join8(f32x8 lo, f32x8 hi) {
    return __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}

static inline f32x16 load_bf16x16(const bf16 *p) {
    u16x16 h;
    memcpy(&h, p, sizeof h);
    const u32x16 w = __builtin_convertvector(h, u32x16) << 16;
    f32x16 v;
    memcpy(&v, &w, sizeof v);
    return v;
}

static inline u16x16 to_bf16x16(f32x16 f) {
    u32x16 u;
    memcpy(&u, &f, sizeof u);
    /* a NaN's magnitude bits exceed infinity's: the difference's sign, spread (a shift, not
     * a comparison: see lo8) */
    const u32x16 nan = (u32x16)(((i32x16){0} + 0x7f800000 - (i32x16)(u & 0x7fffffffu)) >> 31);
    const u32x16 rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return __builtin_convertvector((nan & ((u >> 16) | 0x40u)) | (~nan & rounded), u16x16);
}

/* 16 values of the dtype (float32, or bfloat16 with is_bf16) from p[i..] as floats, and
 * 16 floats stored back rounded to it; `is_bf16` is a constant in each caller. */
static inline __attribute__((always_inline)) f32x16 load16(const void *p, int64_t i,
                                                           int is_bf16) {
    if (is_bf16) return load_bf16x16((const bf16 *)p + i);
    f32x16 v;
    memcpy(&v, (const float *)p + i, sizeof v);
    return v;
}

static inline __attribute__((always_inline)) void store16(void *p, int64_t i, f32x16 x,
                                                          int is_bf16) {
    if (is_bf16) {
        const u16x16 h = to_bf16x16(x);
        memcpy((bf16 *)p + i, &h, sizeof h);
    } else {
        memcpy((float *)p + i, &x, sizeof x);
    }
}

/* 2^x for softmax's x <= 0 (a score minus its row's max, with the scores in base 2), a
 * vector at a time: x = n + f, n an integer, |f| <= 1/2, 2^f by its degree-6 Taylor
 * polynomial in f ln 2 (relative error < 2e-7), scaled by 2^n. Below -125 it gives exactly
 * 0 (2^-125 is nothing against the row's largest term, 1; the cut keeps every 2^n normal,
 * so no product meets a subnormal). A NaN stays NaN. On AVX-512 the rounding and the
 * scaling are an instruction each (VRNDSCALEPS, VSCALEFPS) and the cut a mask: 12 vector
 * ops per 16 scores against 19 for exp's two-constant reduction. Written on vectors: GCC
 * left a scalar form's selects as branches and its loop unvectorized. */
#define EXP2_POLY(f, p)                                                   \
    do {                                                                  \
        (p) = (f) * 1.5403530393381606e-4f + 1.3333558146428443e-3f;      \
        (p) = (p) * (f) + 9.6181291076284772e-3f;                         \
        (p) = (p) * (f) + 5.5504108664821580e-2f;                         \
        (p) = (p) * (f) + 2.4022650695910071e-1f;                         \
        (p) = (p) * (f) + 6.9314718055994531e-1f;                         \
        (p) = (p) * (f) + 1.0f;                                           \
    } while (0)

/* The portable form, on a vector type VT of floats with int32 lanes MT: rounded to the
 * nearest integer by adding and taking away 1.5 * 2^23, scaled in the exponent bits. */
#define DEFINE_EXP2_NONPOSITIVE(NAME, VT, MT)                                     \
    static inline VT NAME(VT x) {                                                 \
        const MT low = x < -125.0f;                                               \
        x = (VT)((low & (MT)((VT){0} - 125.0f)) | (~low & (MT)x));                 \
        const VT n = (x + 12582912.0f) - 12582912.0f;                             \
        const VT f = x - n;                                                       \
        VT p;                                                                     \
        EXP2_POLY(f, p);                                                          \
        const MT bits = (MT)p + (__builtin_convertvector(n, MT) << 23);           \
        return (VT)(bits & ~low);                                                 \
    }

#if defined(__AVX512F__)
static inline f32x16 exp2_nonpositive16(f32x16 x) {
    const __m512 v = (__m512)x;
    /* not below the cut: true for a NaN too (unordered) */
    const __mmask16 kept = _mm512_cmp_ps_mask(v, _mm512_set1_ps(-125.0f), _CMP_NLT_UQ);
    const __m512 n = _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const f32x16 f = (f32x16)_mm512_sub_ps(v, n);
    f32x16 p;
    EXP2_POLY(f, p);
    return (f32x16)_mm512_maskz_scalef_ps(kept, (__m512)p, n);
}
#else
#if defined(__AVX2__)
/* AVX2: the cut one compare and one MAXPS (which gives its second operand, x, where x is a
 * NaN), the zero below it one AND: 15 vector ops per 8 scores against the portable form's
 * 17 (its clamp is a three-op select); with prefill_attention.c's unrolled tiles, a
 * prefill's attention 3-5% faster at 1k-4k tokens */
static inline f32x8 exp2_nonpositive8(f32x8 x) {
    const __m256 v = (__m256)x, cut = _mm256_set1_ps(-125.0f);
    const __m256 kept = _mm256_cmp_ps(v, cut, _CMP_NLT_UQ);
    const f32x8 xc = (f32x8)_mm256_max_ps(cut, v);
    const f32x8 n = (xc + 12582912.0f) - 12582912.0f, f = xc - n;
    f32x8 p;
    EXP2_POLY(f, p);
    const i32x8 bits = (i32x8)p + (__builtin_convertvector(n, i32x8) << 23);
    return (f32x8)_mm256_and_ps(kept, (__m256)bits);
}
#else
DEFINE_EXP2_NONPOSITIVE(exp2_nonpositive8, f32x8, i32x8)
#endif
static inline f32x16 exp2_nonpositive16(f32x16 x) {
    return join8(exp2_nonpositive8(lo8(x)), exp2_nonpositive8(hi8(x)));
}
#endif

/* The same for one float, on one register's lanes (x - 0 broadcasts it in one instruction;
 * 0 + x does not fold). */
#if defined(__AVX512F__)
static inline float exp2_nonpositive(float x) { return exp2_nonpositive16(x - (f32x16){0})[0]; }
#else
static inline float exp2_nonpositive(float x) { return exp2_nonpositive8(x - (f32x8){0})[0]; }
#endif

/* Horizontal sum and max of 16 lanes: their halves folded, then the 8-lane trees. */
static inline float hsum16(f32x16 v) { return hsum8(lo8(v) + hi8(v)); }
static inline float hmax16(f32x16 v) { return hmax8(max8(lo8(v), hi8(v))); }

/* exp over the whole float range, on a vector type VT of floats with int32 lanes MT: 2^n
 * p(r) by EXP_REDUCE; overflow gives inf, underflow 0 (no subnormals), a NaN stays NaN. The
 * scale goes in two halves, so 2^128 does not overflow the exponent field. Written on
 * vectors: the scalar form's clamps and selects stayed branches under AVX2 and left
 * silu_mul's loop unvectorized (6x slower than under AVX-512, 3x slower than torch's). */
#define DEFINE_EXP_POLY(NAME, VT, MT)                                                     \
    static inline VT NAME(VT x) {                                                         \
        const MT high = x > 88.7f, low = x < -87.3f, mid = ~(high | low);                 \
        const VT xc = (VT)((high & (MT)((VT){0} + 88.7f)) | (low & (MT)((VT){0} - 87.3f)) | \
                           (mid & (MT)x));                                                \
        VT n, p;                                                                          \
        EXP_REDUCE(xc, n, p);                                                             \
        const MT e = __builtin_convertvector(n, MT), e1 = e >> 1, e2 = e - e1;            \
        const VT y = p * (VT)((e1 + 127) << 23) * (VT)((e2 + 127) << 23);                 \
        return (VT)((high & (MT)((VT){0} + INFINITY)) | (mid & (MT)y));                   \
    }

/* 16 lanes: one AVX-512 register, or two AVX2 halves (see lo8; on 16 AVX2 lanes a silu took
 * 3.9 ns per element, not 0.8). */
#if defined(__AVX512F__)
DEFINE_EXP_POLY(exp_poly16, f32x16, i32x16)
#else
DEFINE_EXP_POLY(exp_poly8, f32x8, i32x8)
static inline f32x16 exp_poly16(f32x16 x) {
    return join8(exp_poly8(lo8(x)), exp_poly8(hi8(x)));
}
#endif

#endif
