/* Decoding rows' attention, each over its own sequence's cached keys and values (AVX-512).
 *
 * Per sequence: q [num_kv_heads * group, head_dim] (rotated; query head h * group + j uses KV head
 * h) over keys and values at given (token, head) strides in elements (either cache layout) ->
 * out [num_kv_heads * group, head_dim]: softmax(q k^T * scale) v, in float32 throughout.
 * head_dim must be a multiple of 16.
 *
 * Built by cachesmith/model/native_build.py, called by native.py (see there for why). One call serves every sequence of a
 * decode step's layer, so one parallel region does the layer. A long sequence's keys are cut into
 * one range per thread (any number of KV heads then splits evenly); a range keeps its own maximum,
 * sum and weighted values, merged at the end by their log-sum-exp. Scores are made 8 keys at a time
 * for up to 3 queries of a KV head: each key is loaded once, and 8 lane-wise partial dot products are
 * summed across lanes by one transpose; each value row is likewise loaded once for those queries.
 * The exponentials are a vectorized polynomial (Cephes' expf).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#include "kernel_alloc.h"
#if defined(__AVX512F__)
#include <immintrin.h>
#include "simd_math.h"

static inline __m512 load_f32(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load_bf16(const uint16_t* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

/* s[t] = e^(s[t] - max s) for t in [0, n); *max_out = max s, returns the sum of the new s. */
static float softmax_numerators(float* s, int64_t n, float* max_out) {
    __m512 mv = _mm512_set1_ps(-INFINITY);
    int64_t t = 0;
    for (; t + 16 <= n; t += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(s + t));
    float m = _mm512_reduce_max_ps(mv);
    for (; t < n; t++) m = s[t] > m ? s[t] : m;
    __m512 mb = _mm512_set1_ps(m), lv = _mm512_setzero_ps();
    for (t = 0; t + 16 <= n; t += 16) {
        __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(s + t), mb));
        _mm512_storeu_ps(s + t, e);
        lv = _mm512_add_ps(lv, e);
    }
    if (t < n) {
        __mmask16 tail = (__mmask16)((1u << (n - t)) - 1u);
        __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + t), mb));
        _mm512_mask_storeu_ps(s + t, tail, e);
        lv = _mm512_add_ps(lv, _mm512_maskz_mov_ps(tail, e));
    }
    *max_out = m;
    return _mm512_reduce_add_ps(lv);
}


/* r[0..7] = sum of the 16 lanes of a[0..7] */
static inline __m256 sum_lanes_8(const __m512* a) {
    __m512 u[2];
    for (int g = 0; g < 2; g++) {
        const __m512* b = a + 4 * g;
        __m512 t0 = _mm512_add_ps(_mm512_unpacklo_ps(b[0], b[1]), _mm512_unpackhi_ps(b[0], b[1]));
        __m512 t1 = _mm512_add_ps(_mm512_unpacklo_ps(b[2], b[3]), _mm512_unpackhi_ps(b[2], b[3]));
        u[g] = _mm512_add_ps(_mm512_shuffle_ps(t0, t1, 0x44), _mm512_shuffle_ps(t0, t1, 0xEE));
    }
    __m512 w = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x44), _mm512_shuffle_f32x4(u[0], u[1], 0xEE));
    __m512 r = _mm512_add_ps(_mm512_shuffle_f32x4(w, w, 0x88), _mm512_shuffle_f32x4(w, w, 0xDD));
    return _mm512_castps512_ps256(r);
}

static inline __m512 mac_f32(__m512 acc, const float* q, __m512 kv) {
    return _mm512_fmadd_ps(_mm512_loadu_ps(q), kv, acc);
}

/* scores[j * n + t] = scale * q[j] . k[t] for NQ (1-3) queries and the keys [0, n) of one head:
 * each key is loaded (and converted) once for all the queries, 8 keys at a time. A key vector
 * holds WIDTH elements (KLOAD); MAC multiplies it by the query's and accumulates in float32. */
#define SCORES(NAME, T, QT, WIDTH, KV_TYPE, KLOAD, MAC, NQ)                                  \
static void NAME##_##NQ(const QT* q, int64_t head_dim, const T* k, int64_t stride,           \
                        int64_t n, float scale, float* scores) {                             \
    int nv = (int)(head_dim / WIDTH);                                                        \
    int64_t t = 0;                                                                           \
    for (; t + 8 <= n; t += 8) {                                                             \
        __m512 a[NQ][8];                                                                     \
        for (int j = 0; j < NQ; j++) for (int i = 0; i < 8; i++) a[j][i] = _mm512_setzero_ps(); \
        for (int i = 0; i < 8; i++) {                                                        \
            const T* kt = k + (t + i) * stride;                                              \
            for (int c = 0; c < nv; c++) {                                                   \
                KV_TYPE kv = KLOAD(kt + WIDTH * c);                                          \
                for (int j = 0; j < NQ; j++) a[j][i] = MAC(a[j][i], q + j * head_dim + WIDTH * c, kv); \
            }                                                                                \
        }                                                                                    \
        for (int j = 0; j < NQ; j++)                                                         \
            _mm256_storeu_ps(scores + j * n + t, _mm256_mul_ps(sum_lanes_8(a[j]), _mm256_set1_ps(scale))); \
    }                                                                                        \
    for (; t < n; t++) {                                                                     \
        const T* kt = k + t * stride;                                                        \
        for (int j = 0; j < NQ; j++) {                                                       \
            __m512 a = _mm512_setzero_ps();                                                  \
            for (int c = 0; c < nv; c++) a = MAC(a, q + j * head_dim + WIDTH * c, KLOAD(kt + WIDTH * c)); \
            scores[j * n + t] = scale * _mm512_reduce_add_ps(a);                             \
        }                                                                                    \
    }                                                                                        \
}

/* acc[j] = sum over t of p[j * n + t] v[t] for NQ (1-3) queries: each value row loaded once. */
#define WEIGH(T, LOAD, NQ)                                                                   \
static void weigh_##T##_##NQ(const float* p, const T* v, int64_t stride, int64_t n, int64_t head_dim, \
                              float* acc, int64_t acc_stride) {                              \
    int nv = (int)(head_dim / 16);                                                           \
    for (int c0 = 0; c0 < nv; c0 += 4) {  /* 4 vectors of a row at a time: 12 accumulators */ \
        int cn = nv - c0 < 4 ? nv - c0 : 4;                                                  \
        __m512 av[NQ][4];                                                                    \
        for (int j = 0; j < NQ; j++) for (int c = 0; c < 4; c++) av[j][c] = _mm512_setzero_ps(); \
        for (int64_t t = 0; t < n; t++) {                                                    \
            const T* vt = v + t * stride + 16 * c0;                                          \
            for (int c = 0; c < cn; c++) {                                                   \
                __m512 vv = LOAD(vt + 16 * c);                                               \
                for (int j = 0; j < NQ; j++)                                                 \
                    av[j][c] = _mm512_fmadd_ps(_mm512_set1_ps(p[j * n + t]), vv, av[j][c]);  \
            }                                                                                \
        }                                                                                    \
        for (int j = 0; j < NQ; j++)                                                         \
            for (int c = 0; c < cn; c++) _mm512_storeu_ps(acc + j * acc_stride + 16 * (c0 + c), av[j][c]); \
    }                                                                                        \
}

#define KERNELS(NAME, T, LOAD)                                                               \
    SCORES(NAME, T, float, 16, __m512, LOAD, mac_f32, 1)                                     \
    SCORES(NAME, T, float, 16, __m512, LOAD, mac_f32, 2)                                     \
    SCORES(NAME, T, float, 16, __m512, LOAD, mac_f32, 3)                                     \
    WEIGH(T, LOAD, 1) WEIGH(T, LOAD, 2) WEIGH(T, LOAD, 3)
KERNELS(scores_float, float, load_f32)
KERNELS(scores_bf16_converted, uint16_t, load_bf16)

/* bfloat16 keys with AVX512_BF16 and head_dim a multiple of 32: `vdpbf16ps` multiplies 32 key
 * elements by the query's in one instruction (products exact, summed in float32), where
 * converting the keys took three instructions per 16. The query is bfloat16 recovered exactly
 * from its float32 copy. */
#if defined(__AVX512BF16__)
static inline __m512bh load_bh(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512((const void*)p); }
static inline __m512 mac_bh(__m512 acc, const uint16_t* q, __m512bh kv) {
    return _mm512_dpbf16_ps(acc, load_bh(q), kv);
}
SCORES(scores_bf16_dp, uint16_t, uint16_t, 32, __m512bh, load_bh, mac_bh, 1)
SCORES(scores_bf16_dp, uint16_t, uint16_t, 32, __m512bh, load_bh, mac_bh, 2)
SCORES(scores_bf16_dp, uint16_t, uint16_t, 32, __m512bh, load_bh, mac_bh, 3)
#define USE_DP 1
#else
#define USE_DP 0
#define scores_bf16_dp_1(q, ...) ((void)(q))
#define scores_bf16_dp_2(q, ...) ((void)(q))
#define scores_bf16_dp_3(q, ...) ((void)(q))
#endif

#define SCORES_BF16(NQ)                                                                      \
static void scores_uint16_t_##NQ(const float* qf, int64_t head_dim, const uint16_t* k, int64_t stride, \
                                 int64_t n, float scale, float* scores) {                    \
    if (!USE_DP || head_dim % 32 || head_dim > 256) {                                        \
        scores_bf16_converted_##NQ(qf, head_dim, k, stride, n, scale, scores);               \
        return;                                                                              \
    }                                                                                        \
    uint16_t q[NQ * 256];                                                                    \
    for (int64_t i = 0; i < NQ * head_dim; i++) {                                            \
        union { float f; uint32_t u; } v = { qf[i] };                                        \
        q[i] = (uint16_t)(v.u >> 16);  /* exact: q came from bfloat16 */                    \
    }                                                                                        \
    scores_bf16_dp_##NQ(q, head_dim, k, stride, n, scale, scores);                           \
}
SCORES_BF16(1) SCORES_BF16(2) SCORES_BF16(3)

/* Where one sequence's keys and values of one layer live (element offsets and strides). */
typedef struct {
    int64_t num_keys, k_token_stride, k_head_stride, v_token_stride, v_head_stride;
} layout;

/* Keys [lo, hi) of every head of one sequence: per query its maximum, sum of exp and weighted
 * values, written to slot (query * num_parts + part) of the part arrays. */
#define RANGE(T)                                                                             \
static void range_##T(const float* qf, const T* k, const T* v, const layout* lay, int64_t lo, \
                      int64_t hi, int64_t num_kv_heads, int64_t group, int64_t head_dim,     \
                      float scale, float* part_max, float* part_sum, float* part_acc, int part, \
                      int num_parts, float* scores) {                                        \
    int64_t n = hi - lo;                                                                     \
    for (int64_t h = 0; h < num_kv_heads; h++) {                                             \
        const T* kh = k + lo * lay->k_token_stride + h * lay->k_head_stride;                 \
        const T* vh = v + lo * lay->v_token_stride + h * lay->v_head_stride;                 \
        for (int64_t j0 = 0; j0 < group; j0 += 3) {                                          \
            int nq = group - j0 < 3 ? (int)(group - j0) : 3;                                 \
            int64_t first = h * group + j0;                                                  \
            const float* q = qf + first * head_dim;                                          \
            if (nq == 3) scores_##T##_3(q, head_dim, kh, lay->k_token_stride, n, scale, scores); \
            else if (nq == 2) scores_##T##_2(q, head_dim, kh, lay->k_token_stride, n, scale, scores); \
            else scores_##T##_1(q, head_dim, kh, lay->k_token_stride, n, scale, scores);     \
            for (int j = 0; j < nq; j++) {                                                   \
                float m;                                                                     \
                part_sum[(first + j) * num_parts + part] = softmax_numerators(scores + j * n, n, &m); \
                part_max[(first + j) * num_parts + part] = m;                                \
            }                                                                                \
            float* acc = part_acc + (first * num_parts + part) * head_dim;                   \
            int64_t acc_stride = num_parts * head_dim;                                       \
            if (nq == 3) weigh_##T##_3(scores, vh, lay->v_token_stride, n, head_dim, acc, acc_stride); \
            else if (nq == 2) weigh_##T##_2(scores, vh, lay->v_token_stride, n, head_dim, acc, acc_stride); \
            else weigh_##T##_1(scores, vh, lay->v_token_stride, n, head_dim, acc, acc_stride); \
        }                                                                                    \
    }                                                                                        \
}

RANGE(float)
RANGE(uint16_t)

/* out[q] = sum over parts of e^(m_p - M) acc_p / sum over parts of e^(m_p - M) l_p */
static void merge(const float* part_max, const float* part_sum, const float* part_acc, float* out,
                  int64_t num_queries, int64_t head_dim, int num_parts) {
    for (int64_t q = 0; q < num_queries; q++) {
        float top = -INFINITY, total = 0.0f;
        for (int p = 0; p < num_parts; p++) top = part_max[q * num_parts + p] > top ? part_max[q * num_parts + p] : top;
        for (int64_t d = 0; d < head_dim; d++) out[q * head_dim + d] = 0.0f;
        for (int p = 0; p < num_parts; p++) {
            float m = part_max[q * num_parts + p];
            if (m == -INFINITY) continue;  /* a part with no keys */
            float w = expf(m - top);
            total += w * part_sum[q * num_parts + p];
            const float* acc = part_acc + (q * num_parts + p) * head_dim;
            for (int64_t d = 0; d < head_dim; d++) out[q * head_dim + d] += w * acc[d];
        }
        for (int64_t d = 0; d < head_dim; d++) out[q * head_dim + d] /= total;
    }
}

/* Every sequence's row of layer `layer`. seqs [num_seqs, 10] int64: layer 0's key and value base
 * addresses, num_keys, the key/value token and head strides, and the key/value layer strides (all
 * strides in elements; the last column is unused). Where k_new and
 * v_new [num_seqs, num_kv_heads, head_dim] are given, each is first written as its sequence's last
 * key (row num_keys - 1). Each sequence's keys are cut into one range per thread once long enough;
 * shorter sequences go whole, one per thread in turn. */
#define ATTEND(NAME, T, TO_FLOAT, FROM_FLOAT)                                                \
int64_t NAME(const T* q, const T* k_new, const T* v_new, T* out, const int64_t* seqs,          \
          int64_t num_seqs, int64_t layer, int64_t num_kv_heads, int64_t group, int64_t head_dim, \
          float scale, int num_threads) {                                                    \
    int64_t num_queries = num_kv_heads * group, per_seq = num_queries * head_dim;            \
    int num_parts = num_threads < 1 ? 1 : num_threads;                                       \
    int64_t max_keys = 0;                                                                    \
    for (int64_t s = 0; s < num_seqs; s++) {                                                 \
        const int64_t* d = seqs + 10 * s;                                                    \
        max_keys = d[2] > max_keys ? d[2] : max_keys;                                        \
        if (!k_new) continue;                                                                \
        for (int64_t h = 0; h < num_kv_heads; h++) {                                         \
            T* kd = (T*)(intptr_t)d[0] + layer * d[7] + (d[2] - 1) * d[3] + h * d[4];        \
            T* vd = (T*)(intptr_t)d[1] + layer * d[8] + (d[2] - 1) * d[5] + h * d[6];        \
            memcpy(kd, k_new + (s * num_kv_heads + h) * head_dim, sizeof(T) * head_dim);     \
            memcpy(vd, v_new + (s * num_kv_heads + h) * head_dim, sizeof(T) * head_dim);     \
        }                                                                                    \
    }                                                                                        \
    int64_t part_stride = num_queries * num_parts * (2 + head_dim);                          \
    size_t qf_bytes = sizeof(float) * num_seqs * per_seq * 2;                                \
    size_t parts_bytes = sizeof(float) * num_seqs * part_stride;                             \
    size_t scores_bytes = sizeof(float) * 3 * (max_keys + 8);                                \
    float* qf = cs_malloc(qf_bytes);                                                         \
    float* parts = cs_malloc(parts_bytes);                                                   \
    if (!qf || !parts) {                                                                     \
        free(qf);                                                                            \
        free(parts);                                                                         \
        return (int64_t)(qf ? parts_bytes : qf_bytes);                                       \
    }                                                                                        \
    float* outf = qf + num_seqs * per_seq;                                                   \
    int is_short = 0;  /* a thread that could not get its scores buffer */                   \
    for (int64_t i = 0; i < num_seqs * per_seq; i++) qf[i] = TO_FLOAT(q[i]);                 \
    for (int64_t s = 0; s < num_seqs; s++)                                                   \
        for (int64_t i = 0; i < 2 * num_queries * num_parts; i++)                            \
            parts[s * part_stride + i] = i < num_queries * num_parts ? -INFINITY : 0.0f;     \
    _Pragma("omp parallel num_threads(num_parts)")                                           \
    {                                                                                        \
        int part = omp_get_thread_num(), nt = omp_get_num_threads();                         \
        float* scores = cs_malloc(scores_bytes);                                             \
        if (!scores) {                                                                       \
            _Pragma("omp atomic write")                                                      \
            is_short = 1;                                                                    \
        }                                                                                    \
        for (int64_t s = 0; scores && s < num_seqs; s++) {                                   \
            const int64_t* d = seqs + 10 * s;                                                \
            layout lay = { d[2], d[3], d[4], d[5], d[6] };                                   \
            const T* k = (const T*)(intptr_t)d[0] + layer * d[7];                            \
            const T* v = (const T*)(intptr_t)d[1] + layer * d[8];                            \
            int64_t lo = 0, hi = lay.num_keys;                                               \
            if (lay.num_keys >= 256 * (int64_t)nt) {                                         \
                int64_t per = (lay.num_keys + nt - 1) / nt;                                  \
                lo = part * per < lay.num_keys ? part * per : lay.num_keys;                  \
                hi = lo + per < lay.num_keys ? lo + per : lay.num_keys;                      \
            } else if (s % nt != part) {                                                     \
                continue;                                                                    \
            }                                                                                \
            float* pm = parts + s * part_stride;                                             \
            if (hi > lo)                                                                     \
                range_##T(qf + s * per_seq, k, v, &lay,                                     \
                          lo, hi, num_kv_heads, group, head_dim, scale, pm,                  \
                          pm + num_queries * num_parts, pm + 2 * num_queries * num_parts,    \
                          part, num_parts, scores);                                          \
        }                                                                                    \
        free(scores);                                                                        \
    }                                                                                        \
    if (is_short) {                                                                          \
        free(parts);                                                                         \
        free(qf);                                                                            \
        return (int64_t)scores_bytes;                                                        \
    }                                                                                        \
    for (int64_t s = 0; s < num_seqs; s++) {                                                 \
        float* pm = parts + s * part_stride;                                                 \
        merge(pm, pm + num_queries * num_parts, pm + 2 * num_queries * num_parts,            \
              outf + s * per_seq, num_queries, head_dim, num_parts);                         \
    }                                                                                        \
    for (int64_t i = 0; i < num_seqs * per_seq; i++) out[i] = FROM_FLOAT(outf[i]);           \
    free(parts);                                                                             \
    free(qf);                                                                                \
    return 0;                                                                                \
}

#define IDENTITY(x) (x)
ATTEND(cs_decode_attention_f32, float, IDENTITY, IDENTITY)
ATTEND(cs_decode_attention_bf16, uint16_t, bf16_in, bf16_out)
#endif
