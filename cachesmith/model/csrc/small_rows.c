/* Small-row matmuls for decode, y[M, N] = x[M, K] @ w[N, K]^T, over a weight packed once at load.
 *
 * Built by cachesmith/model/native_build.py with the CPU's own instruction set (-march=native); see native.py
 * for why and for the measurements. The packed weight is a run of panels of 32 output columns,
 * each read front to back: float32 [N / 32, K, 32]; bfloat16 [N / 32, K / 2, 32, 2] (the pairs
 * `vdpbf16ps` multiplies). For every k, a panel's 32 weights are multiplied by each row's x[m, k]
 * (broadcast) into 2 registers of outputs per row, so no sum across lanes is ever needed and one
 * read of the panel serves up to 12 rows (24 accumulators). Threads take contiguous ranges of
 * panels. Accumulation is in float32; bfloat16 outputs are rounded to nearest even, as torch does.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include "kernel_alloc.h"

#define PANEL 32
#define MAX_GROUP_ROWS 12

static int64_t max_alloc = -1;  /* see kernel_alloc.h */

void cs_set_max_alloc(int64_t max_bytes) { max_alloc = max_bytes; }

void* cs_malloc(size_t num_bytes) {
    if (max_alloc >= 0 && (uint64_t)num_bytes > (uint64_t)max_alloc) return NULL;
    return malloc(num_bytes);
}

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

/* Calls GROUP(..., rows) with the row count as a constant, so the accumulators stay in registers. */
#define BY_ROWS(GROUP, ...) switch (rows) {                                                  \
    case 1: GROUP(__VA_ARGS__, 1); break;   case 2: GROUP(__VA_ARGS__, 2); break;            \
    case 3: GROUP(__VA_ARGS__, 3); break;   case 4: GROUP(__VA_ARGS__, 4); break;            \
    case 5: GROUP(__VA_ARGS__, 5); break;   case 6: GROUP(__VA_ARGS__, 6); break;            \
    case 7: GROUP(__VA_ARGS__, 7); break;   case 8: GROUP(__VA_ARGS__, 8); break;            \
    case 9: GROUP(__VA_ARGS__, 9); break;   case 10: GROUP(__VA_ARGS__, 10); break;          \
    case 11: GROUP(__VA_ARGS__, 11); break; default: GROUP(__VA_ARGS__, 12); }

/* Each thread: its panels, and every group of up to MAX_GROUP_ROWS rows over each panel. */
#define OVER_PANELS(GROUP, T)                                                                \
    _Pragma("omp parallel num_threads(num_threads)")                                         \
    {                                                                                        \
        int t = omp_get_thread_num(), nt = omp_get_num_threads();                            \
        int64_t num_panels = N / PANEL, per = (num_panels + nt - 1) / nt;                    \
        int64_t lo = t * per, hi = lo + per < num_panels ? lo + per : num_panels;            \
        for (int64_t p = lo; p < hi; p++)                                                    \
            for (int64_t m0 = 0; m0 < M; m0 += MAX_GROUP_ROWS) {                             \
                int rows = M - m0 < MAX_GROUP_ROWS ? (int)(M - m0) : MAX_GROUP_ROWS;         \
                BY_ROWS(GROUP, w + p * K * PANEL, x + m0 * K, y + m0 * N + p * PANEL, K, N)  \
            }                                                                                \
    }

#if defined(__AVX512F__)
static inline __attribute__((always_inline)) void f32_group(
        const float* wp, const float* x, float* y, int64_t K, int64_t N, int rows) {
    __m512 acc[MAX_GROUP_ROWS][2];
    for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k++, wp += PANEL) {
        __m512 w0 = _mm512_loadu_ps(wp), w1 = _mm512_loadu_ps(wp + 16);
        for (int r = 0; r < rows; r++) {
            __m512 xb = _mm512_set1_ps(x[r * K + k]);
            acc[r][0] = _mm512_fmadd_ps(xb, w0, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(xb, w1, acc[r][1]);
        }
    }
    for (int r = 0; r < rows; r++) {
        _mm512_storeu_ps(y + r * N, acc[r][0]);
        _mm512_storeu_ps(y + r * N + 16, acc[r][1]);
    }
}

void cs_matmul_f32(const float* w, const float* x, float* y, int64_t M, int64_t N, int64_t K,
                   int num_threads) {
    OVER_PANELS(f32_group, float)
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__)
static inline __attribute__((always_inline)) void bf16_group(
        const uint16_t* wp, const uint16_t* x, uint16_t* y, int64_t K, int64_t N, int rows) {
    __m512 acc[MAX_GROUP_ROWS][2];
    for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 2, wp += 2 * PANEL) {
        __m512bh w0 = (__m512bh)_mm512_loadu_si512(wp), w1 = (__m512bh)_mm512_loadu_si512(wp + PANEL);
        for (int r = 0; r < rows; r++) {
            int32_t pair;  /* x[k], x[k + 1] */
            memcpy(&pair, x + r * K + k, sizeof pair);
            __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], w0, xb);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], w1, xb);
        }
    }
    for (int r = 0; r < rows; r++) {
        _mm256_storeu_si256((__m256i*)(y + r * N), (__m256i)_mm512_cvtneps_pbh(acc[r][0]));
        _mm256_storeu_si256((__m256i*)(y + r * N + 16), (__m256i)_mm512_cvtneps_pbh(acc[r][1]));
    }
}

void cs_matmul_bf16(const uint16_t* w, const uint16_t* x, uint16_t* y, int64_t M, int64_t N,
                    int64_t K, int num_threads) {
    OVER_PANELS(bf16_group, uint16_t)
}
#endif
