/* 8-wide helpers shared by the AVX2 and AVX-512 translation units (compiled under their targets). */
#ifndef KV_SIMD_AVX2_H
#define KV_SIMD_AVX2_H
#include <immintrin.h>
#include <stdint.h>

static inline float kv_hsum256(__m256 x) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* one 32-channel group of a per-channel K page row (kivi_k.c's packing) as one code byte per channel:
 * channels 0-15 into *a, 16-31 into *b. kivi4: ggml's q4_1 nibbles; kivi2: value j + 8i in bits 2i..2i+1
 * of byte j */
static inline void kv_kpage_codes(int four, const uint8_t *y, __m128i *a, __m128i *b) {
    if (four) {
        const __m128i x = _mm_loadu_si128((const __m128i *)(const void *)y), m4 = _mm_set1_epi8(15);
        *a = _mm_and_si128(x, m4);
        *b = _mm_and_si128(_mm_srli_epi16(x, 4), m4);
    } else {
        const __m128i x = _mm_loadl_epi64((const __m128i *)(const void *)y), m2 = _mm_set1_epi8(3);
        *a = _mm_unpacklo_epi64(_mm_and_si128(x, m2), _mm_and_si128(_mm_srli_epi16(x, 2), m2));
        *b = _mm_unpacklo_epi64(_mm_and_si128(_mm_srli_epi16(x, 4), m2), _mm_and_si128(_mm_srli_epi16(x, 6), m2));
    }
}

static inline float kv_hmax256(__m256 x) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* 2^f on [-0.5, 0.5]: Taylor series of e^(f ln2) to degree 7, truncation error ~5e-9 */
#define KV_EXP2_POLY(F, MUL_ADD, SET1)                                                                    \
    MUL_ADD(MUL_ADD(MUL_ADD(MUL_ADD(MUL_ADD(MUL_ADD(MUL_ADD(SET1(1.525273380405984e-05f), F,               \
                                                            SET1(1.5403530393381606e-04f)),                \
                                                    F, SET1(1.3333558146428443e-03f)),                     \
                                            F, SET1(9.618129107628477e-03f)),                              \
                                    F, SET1(5.550410866482158e-02f)),                                      \
                            F, SET1(2.402265069591007e-01f)),                                              \
                    F, SET1(6.931471805599453e-01f)),                                                      \
            F, SET1(1.0f))

/* 2^x for x <= 0; x < -126 (and -inf) give exactly 0, NaN gives NaN (a NaN score, from a NaN in K, must
 * reach the row's sum as it does in float64: maxps returns its second operand when one is NaN) */
static inline __m256 kv_exp2_256(__m256 x) {
    __m256 lim = _mm256_set1_ps(-126.0f);
    __m256 dead = _mm256_cmp_ps(x, lim, _CMP_LT_OQ);
    x = _mm256_max_ps(lim, x);
    __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 f = _mm256_sub_ps(x, n);
    __m256 p = KV_EXP2_POLY(f, _mm256_fmadd_ps, _mm256_set1_ps);
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(dead, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

static inline void kv_f16_to_f32_row_f16c(const uint8_t *src, float *dst, int n) {
    int i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + 2 * i))));
    for (; i < n; i++) {
        uint16_t h;
        memcpy(&h, src + 2 * i, 2);
        dst[i] = _cvtsh_ss(h);
    }
}

static inline void kv_f32_to_f16_row_f16c(const float *src, uint8_t *dst, int n) {
    int i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(dst + 2 * i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; i++) {
        uint16_t h = (uint16_t)_cvtss_sh(src[i], _MM_FROUND_TO_NEAREST_INT);
        memcpy(dst + 2 * i, &h, 2);
    }
}
#endif
