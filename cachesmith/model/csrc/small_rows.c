/* Small-row matmuls for decode, y[M, N] = x[M, K] @ w[N, K]^T, over a weight packed once at load.
 *
 * Built by cachesmith/model/native.py with the CPU's own instruction set (-march=native); see there
 * for why and for the measurements. The packed weight is [N / 8, K / L, 8, L] (L = 16 float32 or
 * 32 bfloat16 lanes): a block of 8 output rows is read front to back, so the memory system streams
 * it. Each thread takes a contiguous range of blocks; rows of x go through in groups of up to 3
 * (24 accumulators in registers). Accumulation is in float32; bfloat16 outputs are rounded to
 * nearest even, as torch rounds.
 */
#include <stdint.h>
#include <omp.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define BLOCK 8

int cs_kernels(void) {  /* bit 0: float32, bit 1: bfloat16 */
    int kernels = 0;
#if defined(__AVX512F__)
    kernels |= 1;
#endif
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    kernels |= 2;
#endif
    return kernels;
}

static inline void block_range(int64_t num_blocks, int64_t* lo, int64_t* hi) {
    int t = omp_get_thread_num(), nt = omp_get_num_threads();
    int64_t per = (num_blocks + nt - 1) / nt;
    *lo = t * per;
    *hi = *lo + per < num_blocks ? *lo + per : num_blocks;
}

#if defined(__AVX512F__)
#define F32_GROUP(MR) do {                                                                  \
    __m512 acc[MR][BLOCK];                                                                  \
    for (int r = 0; r < MR; r++) for (int i = 0; i < BLOCK; i++) acc[r][i] = _mm512_setzero_ps(); \
    const float* wp = w + b * BLOCK * K;                                                    \
    for (int64_t k = 0; k < K; k += 16, wp += BLOCK * 16) {                                 \
        __m512 xv[MR];                                                                      \
        for (int r = 0; r < MR; r++) xv[r] = _mm512_loadu_ps(x + (m + r) * K + k);          \
        for (int i = 0; i < BLOCK; i++) {                                                   \
            __m512 wv = _mm512_loadu_ps(wp + i * 16);                                       \
            for (int r = 0; r < MR; r++) acc[r][i] = _mm512_fmadd_ps(wv, xv[r], acc[r][i]); \
        }                                                                                   \
    }                                                                                       \
    for (int r = 0; r < MR; r++) for (int i = 0; i < BLOCK; i++)                            \
        y[(m + r) * N + b * BLOCK + i] = _mm512_reduce_add_ps(acc[r][i]);                   \
} while (0)

void cs_matmul_f32(const float* w, const float* x, float* y, int64_t M, int64_t N, int64_t K,
                   int num_threads) {
    #pragma omp parallel num_threads(num_threads)
    {
        int64_t lo, hi;
        block_range(N / BLOCK, &lo, &hi);
        for (int64_t b = lo; b < hi; b++) {
            int64_t m = 0;
            for (; m + 3 <= M; m += 3) F32_GROUP(3);
            if (M - m == 2) F32_GROUP(2);
            else if (M - m == 1) F32_GROUP(1);
        }
    }
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define BF16_GROUP(MR) do {                                                                 \
    __m512 acc[MR][BLOCK];                                                                  \
    for (int r = 0; r < MR; r++) for (int i = 0; i < BLOCK; i++) acc[r][i] = _mm512_setzero_ps(); \
    const uint16_t* wp = w + b * BLOCK * K;                                                 \
    for (int64_t k = 0; k < K; k += 32, wp += BLOCK * 32) {                                 \
        __m512bh xv[MR];                                                                    \
        for (int r = 0; r < MR; r++)                                                        \
            xv[r] = (__m512bh)_mm512_loadu_si512((const void*)(x + (m + r) * K + k));       \
        for (int i = 0; i < BLOCK; i++) {                                                   \
            __m512bh wv = (__m512bh)_mm512_loadu_si512((const void*)(wp + i * 32));         \
            for (int r = 0; r < MR; r++) acc[r][i] = _mm512_dpbf16_ps(acc[r][i], wv, xv[r]); \
        }                                                                                   \
    }                                                                                       \
    for (int r = 0; r < MR; r++) {                                                          \
        float sums[BLOCK];                                                                  \
        for (int i = 0; i < BLOCK; i++) sums[i] = _mm512_reduce_add_ps(acc[r][i]);          \
        __m128bh out = _mm256_cvtneps_pbh(_mm256_loadu_ps(sums));                           \
        _mm_storeu_si128((__m128i*)(y + (m + r) * N + b * BLOCK), (__m128i)out);            \
    }                                                                                       \
} while (0)

void cs_matmul_bf16(const uint16_t* w, const uint16_t* x, uint16_t* y, int64_t M, int64_t N,
                    int64_t K, int num_threads) {
    #pragma omp parallel num_threads(num_threads)
    {
        int64_t lo, hi;
        block_range(N / BLOCK, &lo, &hi);
        for (int64_t b = lo; b < hi; b++) {
            int64_t m = 0;
            for (; m + 3 <= M; m += 3) BF16_GROUP(3);
            if (M - m == 2) BF16_GROUP(2);
            else if (M - m == 1) BF16_GROUP(1);
        }
    }
}
#endif
