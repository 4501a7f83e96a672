/* Conversions and vector math shared by the decode kernels (AVX-512). */
#ifndef CACHESMITH_SIMD_MATH_H
#define CACHESMITH_SIMD_MATH_H
#include <immintrin.h>
#include <stdint.h>

static inline float bf16_in(uint16_t h) {  /* bfloat16 bits -> float32, exactly */
    union { uint32_t u; float f; } v = { (uint32_t)h << 16 };
    return v.f;
}

static inline uint16_t bf16_out(float f) {  /* float32 -> bfloat16, to nearest even as torch rounds */
    union { float f; uint32_t u; } v = { f };
    if (f != f) return 0x7fc0;
    return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

/* e^x for x <= 0, 16 lanes (Cephes' expf polynomial; 2^n applied by vscalefps) */
static inline __m512 exp_nonpositive(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

/* x[i] = silu(x[i]) = x[i] / (1 + e^-x[i]) for i in [0, n), in place */
static inline void silu_inplace(float* x, int64_t n) {
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 lanes = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1u);
        __m512 v = _mm512_maskz_loadu_ps(lanes, x + i);
        /* e^-|x| never overflows; sigmoid(x) = 1 / (1 + e^-x) for x >= 0, e^x / (1 + e^x) below */
        __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(v)));
        __m512 one_plus = _mm512_add_ps(_mm512_set1_ps(1.0f), e);
        __mmask16 negative = _mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_LT_OQ);
        __m512 sig = _mm512_mask_blend_ps(negative, _mm512_div_ps(_mm512_set1_ps(1.0f), one_plus),
                                          _mm512_div_ps(e, one_plus));
        _mm512_mask_storeu_ps(x + i, lanes, _mm512_mul_ps(v, sig));
    }
}

#endif
