/* AVX2 + FMA + F16C kernels (Haswell and later, Zen 1 and later): the shared template on 8-wide f32. */
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#include <math.h>

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC target("avx2,fma,f16c")
#endif

#include "half.h"

#define FN(x) x##_avx2
#define ISA_NAME "avx2"
#define KV_GEMM_TILES 1

#include "simd_avx2.h"

typedef __m256 VF;
#define VL 8
#define vload _mm256_loadu_ps
#define vstore _mm256_storeu_ps
#define vset1 _mm256_set1_ps
#define vzero _mm256_setzero_ps
#define vadd _mm256_add_ps
#define vsub _mm256_sub_ps
#define vmul _mm256_mul_ps
#define vfma _mm256_fmadd_ps
#define vmax _mm256_max_ps
#define vhsum kv_hsum256
#define vhmax kv_hmax256
#define vexp2 kv_exp2_256

#define F16_TO_F32(src, dst, n) kv_f16_to_f32_row_f16c(src, dst, n)
#define F32_TO_F16(src, dst, n) kv_f32_to_f16_row_f16c(src, dst, n)
#define F32_TO_F16_1(x) ((uint16_t)_cvtss_sh((x), _MM_FROUND_TO_NEAREST_INT))

/* every format's row but f32/f16, 8 lanes at a time, bit-exact with the template's scalar loops (the same
 * d*q, d*(n-o), d*n + m and bit moves, no FMA) */
static int dequant_row_avx2(int fmt, const uint8_t *y, float *dst, int d) {
    if (fmt == KV_F32 || fmt == KV_F16 || d % KV_QK) return 0;
    if (fmt == KV_BF16) {
        for (int i = 0; i < d; i += 8) {
            __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(const void *)(y + 2 * i)));
            _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(h, 16)));
        }
        return 1;
    }
    const int bb = kv_block_bytes[fmt];
    const __m256i m4 = _mm256_set1_epi32(15), lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int b = 0; b < d / KV_QK; b++, dst += KV_QK, y += bb) {
        const __m256 s = _mm256_set1_ps(_cvtsh_ss(kv_load_u16(y)));
        if (fmt == KV_Q8_0) {
            for (int i = 0; i < 4; i++) {
                __m128i q = _mm_loadl_epi64((const __m128i *)(const void *)(y + 2 + 8 * i));
                _mm256_storeu_ps(dst + 8 * i, _mm256_mul_ps(s, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q))));
            }
            continue;
        }
        /* nibble formats: q4_0 (qs at 2), q5_0 (qh at 2, qs at 6), q4_1 (m at 2, qs at 4), q5_1 (m, qh at 4, qs at 8) */
        const int has_min = fmt == KV_Q4_1 || fmt == KV_Q5_1, has_qh = fmt == KV_Q5_0 || fmt == KV_Q5_1;
        const int qs = fmt == KV_Q4_0 ? 2 : fmt == KV_Q5_0 ? 6 : fmt == KV_Q4_1 ? 4 : 8;
        const uint32_t qh = has_qh ? kv_load_u32(y + (has_min ? 4 : 2)) : 0;
        const __m256 m = _mm256_set1_ps(has_min ? _cvtsh_ss(kv_load_u16(y + 2)) : 0.0f);
        const __m256 off = _mm256_set1_ps(has_qh ? 16.0f : 8.0f);
        for (int i = 0; i < 2; i++) {
            __m256i n = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(const void *)(y + qs + 8 * i)));
            for (int hi = 0; hi < 2; hi++) {
                __m256i v = hi ? _mm256_srli_epi32(n, 4) : _mm256_and_si256(n, m4);
                if (has_qh) /* 5th bits: qh bit 8i + lane (low nibbles), 16 + 8i + lane (high) */
                    v = _mm256_or_si256(v, _mm256_slli_epi32(_mm256_and_si256(_mm256_srlv_epi32(
                        _mm256_set1_epi32((int)(qh >> (16 * hi + 8 * i))), lane), _mm256_set1_epi32(1)), 4));
                __m256 x = _mm256_cvtepi32_ps(v);
                x = has_min ? _mm256_add_ps(_mm256_mul_ps(s, x), m) : _mm256_mul_ps(s, _mm256_sub_ps(x, off));
                _mm256_storeu_ps(dst + 16 * hi + 8 * i, x);
            }
        }
    }
    return 1;
}
#define DEQUANT_ROW_OVERRIDE(fmt, src, dst, d) dequant_row_avx2(fmt, src, dst, d)

/* one 32-channel group of a per-channel K page row (kern_template.h's kpage_rows): d * code + m, the
 * multiply and the add rounded apart, as the spec */
static inline void kpage_group_avx2(int four, const uint8_t *y, const float *d, const float *m, float *out) {
    __m128i c[2];
    kv_kpage_codes(four, y, &c[0], &c[1]);
    for (int i = 0; i < 4; i++) {
        const __m128i q8 = i & 1 ? _mm_srli_si128(c[i >> 1], 8) : c[i >> 1];
        const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q8));
        _mm256_storeu_ps(out + 8 * i, _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(d + 8 * i), q), _mm256_loadu_ps(m + 8 * i)));
    }
}
#define KPAGE_GROUP(four, y, d, m, out) kpage_group_avx2(four, y, d, m, out)

/* [KV_T][D] -> [D][KV_T] (kern_template.h's prefill scores), 8x8 blocks in registers */
static void transpose_tile_avx2(const float *src, float *dst, int D) { /* D % 8 == 0: KV_GEMM's D % 16 */
    for (int t = 0; t < KV_T; t += 8)
        for (int j = 0; j < D; j += 8) {
            __m256 r[8], u[8];
            for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps(src + (size_t)(t + i) * D + j);
            for (int i = 0; i < 8; i += 2) {
                u[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
                u[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
            }
            for (int i = 0; i < 8; i += 4) {
                r[i] = _mm256_shuffle_ps(u[i], u[i + 2], 0x44);
                r[i + 1] = _mm256_shuffle_ps(u[i], u[i + 2], 0xEE);
                r[i + 2] = _mm256_shuffle_ps(u[i + 1], u[i + 3], 0x44);
                r[i + 3] = _mm256_shuffle_ps(u[i + 1], u[i + 3], 0xEE);
            }
            for (int i = 0; i < 4; i++) {
                _mm256_storeu_ps(dst + (size_t)(j + i) * KV_T + t, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
                _mm256_storeu_ps(dst + (size_t)(j + i + 4) * KV_T + t, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
            }
        }
}
#define TRANSPOSE_TILE(src, dst, D) transpose_tile_avx2(src, dst, D)

#include "kern_template.h"

#if defined(__clang__)
#pragma clang attribute pop
#endif
#endif
