/* Every decoder layer of one decode step in one call, on the kernels of small_rows.c and
 * one_row_attention.c (AVX-512).
 *
 * h [S, hidden] is the residual stream of S decoding sequences, updated in place through every
 * layer: h += o_proj(attention(rope(qkv(norm(h))))); h += down(silu(gate) * up)(norm(h)). Each
 * elementwise step rounds to the model's dtype where torch's does (a bfloat16 RMSNorm rounds the
 * normalized row, then its product with the weight; RoPE rounds x1 * cos, then the sum), so the
 * result is torch's up to float32 summation order. The final norm and LM head stay with the caller.
 *
 * Built by cachesmith/model/native_build.py, called by native.py (see there for why). Per layer, `weights` holds the
 * addresses of: the packed qkv, o, gate|up and down weights (native.pack), the qkv bias (0: none),
 * the input and post-attention norm weights.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "kernel_alloc.h"
#if defined(__AVX512F__)
#include <immintrin.h>
#include "simd_math.h"

#define NUM_WEIGHT_FIELDS 7

static inline float f32_in(float x) { return x; }
static inline float f32_out(float x) { return x; }

/* torch's bfloat16 results round each op; float32 ones need no rounding between ops */
static inline float bf16_round(float x) { return bf16_in(bf16_out(x)); }
static inline float f32_round(float x) { return x; }

#define GLUE(T, S)                                                                           \
static void rms_norm_##S(const T* x, const T* w, T* out, int64_t rows, int64_t dim, float eps) { \
    for (int64_t r = 0; r < rows; r++) {                                                     \
        const T* xr = x + r * dim;                                                           \
        float ss = 0.0f;                                                                     \
        for (int64_t i = 0; i < dim; i++) ss += S##_in(xr[i]) * S##_in(xr[i]);               \
        float rstd = 1.0f / sqrtf(ss / (float)dim + eps);                                    \
        for (int64_t i = 0; i < dim; i++)                                                    \
            out[r * dim + i] = S##_out(S##_round(S##_in(xr[i]) * rstd) * S##_in(w[i]));      \
    }                                                                                        \
}                                                                                            \
static void add_##S(T* h, const T* d, int64_t n) {                                           \
    for (int64_t i = 0; i < n; i++) h[i] = S##_out(S##_in(h[i]) + S##_in(d[i]));             \
}                                                                                            \
/* x [rows, heads, D] at row stride `stride`, rotated in place: x1 c - x2 s | x2 c + x1 s */ \
static void rope_##S(T* x, int64_t rows, int64_t stride, int64_t heads, int64_t head_dim,   \
                     const T* cos, const T* sin) {                                           \
    int64_t half = head_dim / 2;                                                             \
    for (int64_t r = 0; r < rows; r++)                                                       \
        for (int64_t h = 0; h < heads; h++) {                                                \
            T* x1 = x + r * stride + h * head_dim;                                           \
            T* x2 = x1 + half;                                                               \
            for (int64_t i = 0; i < half; i++) {                                             \
                float a = S##_in(x1[i]), b = S##_in(x2[i]);                                  \
                float c = S##_in(cos[r * head_dim + i]), s = S##_in(sin[r * head_dim + i]);  \
                x1[i] = S##_out(S##_round(a * c) - b * s);                                   \
                x2[i] = S##_out(S##_round(b * c) + a * s);                                   \
            }                                                                                \
        }                                                                                    \
}                                                                                            \
/* gu [rows, 2 I] -> out [rows, I] = silu(gate) * up; `gate` is float scratch of I */      \
static void silu_mul_##S(const T* gu, T* out, int64_t rows, int64_t inter, float* gate) {    \
    for (int64_t r = 0; r < rows; r++) {                                                     \
        for (int64_t i = 0; i < inter; i++) gate[i] = S##_in(gu[r * 2 * inter + i]);         \
        silu_inplace(gate, inter);                                                           \
        for (int64_t i = 0; i < inter; i++)                                                  \
            out[r * inter + i] = S##_out(S##_round(gate[i]) * S##_in(gu[r * 2 * inter + inter + i])); \
    }                                                                                        \
}                                                                                            \
static void add_bias_##S(T* y, const T* bias, int64_t rows, int64_t n) {                     \
    for (int64_t r = 0; r < rows; r++)                                                       \
        for (int64_t i = 0; i < n; i++) y[r * n + i] = S##_out(S##_in(y[r * n + i]) + S##_in(bias[i])); \
}

GLUE(float, f32)
#if defined(__AVX512BF16__)
GLUE(uint16_t, bf16)
#endif

#define LAYERS(NAME, T, S, MATMUL, ATTEND)                                                   \
void MATMUL(const T*, const T*, T*, int64_t, int64_t, int64_t, int);                         \
int64_t ATTEND(const T*, const T*, const T*, T*, const int64_t*, int64_t, int64_t, int64_t,  \
               int64_t, int64_t, float, int);                                                \
int64_t NAME(T* h, const int64_t* weights, const int64_t* seqs, const T* cos, const T* sin,    \
          int64_t num_seqs, int64_t num_layers, int64_t hidden, int64_t num_heads,           \
          int64_t num_kv_heads, int64_t head_dim, int64_t inter, float eps, int num_threads) { \
    int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;               \
    int64_t qkv_size = q_size + 2 * kv_size, n = num_seqs;                                   \
    size_t buf_bytes = sizeof(T) * n * (2 * hidden + qkv_size + 2 * q_size + 2 * kv_size + 3 * inter); \
    T* buf = cs_malloc(buf_bytes);                                                           \
    float* gate = cs_malloc(sizeof(float) * inter);                                          \
    if (!buf || !gate) {  /* the bytes not had: the caller raises MemoryError */             \
        free(buf);                                                                           \
        free(gate);                                                                          \
        return (int64_t)(buf ? sizeof(float) * inter : buf_bytes);                           \
    }                                                                                        \
    int64_t failed = 0;                                                                      \
    T *x = buf, *qkv = x + n * hidden, *q = qkv + n * qkv_size, *k = q + n * q_size;         \
    T *v = k + n * kv_size, *attn = v + n * kv_size, *o = attn + n * q_size;                 \
    T *gu = o + n * hidden, *act = gu + n * 2 * inter;                                       \
    for (int64_t l = 0; l < num_layers; l++) {                                               \
        const int64_t* w = weights + l * NUM_WEIGHT_FIELDS;                                  \
        rms_norm_##S(h, (const T*)(intptr_t)w[5], x, n, hidden, eps);                        \
        MATMUL((const T*)(intptr_t)w[0], x, qkv, n, qkv_size, hidden, num_threads);          \
        if (w[4]) add_bias_##S(qkv, (const T*)(intptr_t)w[4], n, qkv_size);                  \
        rope_##S(qkv, n, qkv_size, num_heads + num_kv_heads, head_dim, cos, sin);            \
        for (int64_t s = 0; s < n; s++) {                                                    \
            memcpy(q + s * q_size, qkv + s * qkv_size, sizeof(T) * q_size);                  \
            memcpy(k + s * kv_size, qkv + s * qkv_size + q_size, sizeof(T) * kv_size);       \
            memcpy(v + s * kv_size, qkv + s * qkv_size + q_size + kv_size, sizeof(T) * kv_size); \
        }                                                                                    \
        failed = ATTEND(q, k, v, attn, seqs, n, l, num_kv_heads, num_heads / num_kv_heads,   \
                        head_dim, 1.0f / sqrtf((float)head_dim), num_threads);               \
        if (failed) break;                                                                   \
        MATMUL((const T*)(intptr_t)w[1], attn, o, n, hidden, q_size, num_threads);           \
        add_##S(h, o, n * hidden);                                                           \
        rms_norm_##S(h, (const T*)(intptr_t)w[6], x, n, hidden, eps);                        \
        MATMUL((const T*)(intptr_t)w[2], x, gu, n, 2 * inter, hidden, num_threads);          \
        silu_mul_##S(gu, act, n, inter, gate);                                               \
        MATMUL((const T*)(intptr_t)w[3], act, o, n, hidden, inter, num_threads);             \
        add_##S(h, o, n * hidden);                                                           \
    }                                                                                        \
    free(gate);                                                                              \
    free(buf);                                                                               \
    return failed;                                                                           \
}

LAYERS(cs_decode_layers_f32, float, f32, cs_matmul_f32, cs_decode_attention_f32)
#if defined(__AVX512BF16__)
LAYERS(cs_decode_layers_bf16, uint16_t, bf16, cs_matmul_bf16, cs_decode_attention_bf16)
#endif
#endif
