/* What both CPU kernels share: bfloat16 as torch rounds it, and a vectorizable exp. */
#ifndef PDSERVE_CPU_MATH_H
#define PDSERVE_CPU_MATH_H

#include <math.h>
#include <stdint.h>
#include <string.h>

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

/* The value as the dtype holds it (a product or sum torch rounds before the next op). */
static inline __attribute__((always_inline)) float rnd(float x, int is_bf16) {
    return is_bf16 ? from_bf16(to_bf16(x)) : x;
}

/* exp over the whole float range: 2^n * p(r), x = n ln2 + r, |r| <= ln2/2, p degree-6
 * Taylor (relative error < 2e-7); overflow gives inf, underflow 0 (no subnormals). n is
 * rounded by adding and taking away 1.5 * 2^23 (nearbyintf is a library call here, and
 * this is plain arithmetic the compiler vectorizes). */
static inline float exp_poly(float x) {
    const float big = 12582912.0f; /* 1.5 * 2^23 */
    const float xc = x > 88.7f ? 88.7f : (x < -87.3f ? -87.3f : x);
    const float n = (xc * 1.44269504088896341f + big) - big;
    const float r = xc - n * 0.693145751953125f - n * 1.42860682030941723e-6f;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    /* |n| <= 128: the scale in two halves, so 2^128 does not overflow the exponent field */
    const int32_t e = (int32_t)n, e1 = e >> 1, e2 = e - e1;
    const int32_t b1 = (e1 + 127) << 23, b2 = (e2 + 127) << 23;
    float s1, s2;
    memcpy(&s1, &b1, sizeof s1);
    memcpy(&s2, &b2, sizeof s2);
    const float y = p * s1 * s2;
    return x > 88.7f ? INFINITY : (x < -87.3f ? 0.0f : y);
}

#endif
