/* Dequantizing stored KV blocks (cachesmith/kvstore/codec.py's layouts) into a staging buffer.
 *
 * A block holds `rows` rows of `cols` levels (int8, or int4 two a byte, the even one low, stored
 * as q + 8), then float16 scales: per column when `group` is 0 (keys: per channel over the
 * block), else one per `group` consecutive levels of a row (values: per token and head, or per
 * group of 32). out[b, r, c] = q * scale, written as float32 or rounded to bfloat16 (nearest
 * even, as torch rounds). One pass, one thread: it runs on a store's loader threads beside the
 * model's compute, so it takes no OpenMP threads from it. The caller checks every size.
 */
#include <stdint.h>
#include <string.h>

static inline float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else {  /* subnormal: normalize */
            exp = 127 - 15 + 1;
            while (!(man & 0x400)) { man <<= 1; exp--; }
            bits = sign | (exp << 23) | ((man & 0x3FF) << 13);
        }
    } else if (exp == 0x1F) {
        bits = sign | 0x7F800000 | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t float_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7FFF + ((u >> 16) & 1);
    return (uint16_t)(u >> 16);
}

/* One row of levels times its scales into `row` (float32), in two passes over the row (in L1):
 * the levels as floats, then per column (group 0) or per `group` consecutive levels the scale.
 * Each inner loop runs over contiguous elements with no branch, so it vectorizes. */
static inline void scale_row(const int8_t* q8, const uint8_t* q4, int64_t cols, const float* scales,
                             int64_t group, float* row) {
    if (q8) {
        for (int64_t c = 0; c < cols; c++) row[c] = (float)q8[c];
    } else {
        for (int64_t i = 0; i < cols / 2; i++) {
            row[2 * i] = (float)((int)(q4[i] & 0xF) - 8);
            row[2 * i + 1] = (float)((int)(q4[i] >> 4) - 8);
        }
    }
    if (group == 0) {
        for (int64_t c = 0; c < cols; c++) row[c] *= scales[c];
    } else {
        for (int64_t start = 0; start < cols; start += group) {
            float s = scales[start / group];
            for (int64_t c = start; c < start + group; c++) row[c] *= s;
        }
    }
}

/* `num_rows` rows in blocks of `block_rows` (the last may hold fewer), block b at raw + b * block_bytes.
 * bits: 8 or 4. out_bf16: 0 writes float32, 1 bfloat16. Returns 0, or -1 for a row too wide. */
int cs_kv_dequant(const uint8_t* raw, int64_t num_rows, int64_t block_rows, int64_t block_bytes, int64_t cols,
                  int64_t group, int bits, void* out, int out_bf16) {
    enum { MAX_COLS = 8192 };
    if (cols > MAX_COLS || cols <= 0 || block_rows <= 0) return -1;
    float scales[MAX_COLS], row[MAX_COLS];
    int64_t q_row = bits == 8 ? cols : cols / 2;
    int64_t per_row = group == 0 ? cols : cols / group;  /* scales of a row (per column: shared by all) */
    for (int64_t first = 0, b = 0; first < num_rows; first += block_rows, b++) {
        int64_t rows = num_rows - first < block_rows ? num_rows - first : block_rows;
        const uint8_t* block = raw + b * block_bytes;
        const uint8_t* scale_bytes = block + rows * q_row;
        for (int64_t r = 0; r < rows; r++) {
            if (group != 0 || r == 0) {
                const uint8_t* at = scale_bytes + (group == 0 ? 0 : 2 * r * per_row);
                for (int64_t s = 0; s < per_row; s++) {
                    uint16_t h;
                    memcpy(&h, at + 2 * s, 2);
                    scales[s] = half_to_float(h);
                }
            }
            const uint8_t* q = block + r * q_row;
            int64_t at = (first + r) * cols;
            if (!out_bf16) {
                scale_row(bits == 8 ? (const int8_t*)q : 0, bits == 4 ? q : 0, cols, scales, group, (float*)out + at);
            } else {
                scale_row(bits == 8 ? (const int8_t*)q : 0, bits == 4 ? q : 0, cols, scales, group, row);
                uint16_t* dst = (uint16_t*)out + at;
                for (int64_t c = 0; c < cols; c++) dst[c] = float_to_bf16(row[c]);
            }
        }
    }
    return 0;
}
