/* The formats of kvhal 2 (fp8_e4m3, fp8_e5m2, mxfp4, nvfp4, kivi4, kivi2 rows), included by kern_template.h
 * after its ggml quantizers; every ISA gets the portable rows below, and the AVX-512 / AVX2 builds also
 * vector dequantizers (the attention's f32 path dequantizes each K/V tile through them).
 *
 * Each function is bit-exact with kvhal/formats/{fp8,fp4,kivi}.py, the spec: the same float32 operations
 * in the same order (the build keeps -ffp-contract=off), integer bit moves where numpy moves bits.
 * kivi4 rows are ggml's q4_1 bytes; kivi2 rows are {f16 d; f16 m; u8 qs[8]} per 32 values. K stored per
 * channel over whole pages (the KIVI K layout) is not run here: api.c stores and loads rows.
 */
#ifndef KV_V2_COMMON
#define KV_V2_COMMON
/* the doubled e2m1 values (ggml's kvalues_mxfp4 as floats); code 8 is +0, as in numpy */
static const float kv_e2m1x2[16] KV_ALIGN(64) = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

static inline int kv_is_v2(int fmt) { return fmt >= KV_FP8_E4M3 && fmt <= KV_KIVI2; }

/* fp8 with man mantissa bits, exponent bias `bias`: saturating round to nearest even of a finite float */
static inline uint8_t kv_fp8_encode(float x, int man, int bias, uint32_t max_bits) {
    const uint32_t u = kv_f32_bits(x), a = u & 0x7fffffffu, sign = (u >> 24) & 0x80u;
    const int min_exp = 1 - bias;
    uint32_t code;
    if (a >= max_bits) { /* at or beyond the largest finite value: that value */
        code = ((max_bits >> 23) - 127 + (uint32_t)bias) << man | ((max_bits >> (23 - man)) & ((1u << man) - 1));
    } else if ((int)(a >> 23) - 127 >= min_exp) { /* normal: round the f32 mantissa, carries move the exponent */
        const int sh = 23 - man;
        const uint32_t r = (a + (1u << (sh - 1)) - 1u + ((a >> sh) & 1u)) >> sh;
        code = r - ((uint32_t)(127 - bias) << man);
    } else { /* subnormal quanta of 2^(min_exp - man): exact scaling, then rint (half to even) */
        const float q = kv_bits_f32(a) * ldexpf(1.0f, man - min_exp);
        code = (uint32_t)nearbyintf(q); /* 2^man here is the smallest normal's code, as it should be */
    }
    return (uint8_t)(code | sign);
}

/* fp8 byte -> f32: the code's exponent/mantissa bits placed into an f32 and rescaled by 2^(127-bias), exact
 * for normals and subnormals alike; the inf/NaN codes (never stored) read NaN as the numpy table does */
static inline float kv_fp8_decode(uint8_t b, int man, int bias) {
    const uint32_t em = b & 0x7fu;
    const int exp_bits = 7 - man;
    if ((man == 3 && em == 0x7fu) || (man == 2 && (em >> man) == ((1u << exp_bits) - 1))) return kv_bits_f32(0x7fc00000u);
    const float v = kv_bits_f32(em << (23 - man)) * ldexpf(1.0f, 127 - bias);
    return (b & 0x80u) ? -v : v;
}
#define KV_E4M3_MAX 0x43e00000u /* 448 */
#define KV_E5M2_MAX 0x47600000u /* 57344 */

/* ggml_e8m0_to_fp32_half */
static inline float kv_e8m0_half(uint8_t e) { return kv_bits_f32(e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23); }

/* the e4m3 scale code -> its value times one half (0 and 0x7F read 0) */
static inline float kv_ue4m3_half(uint8_t c) {
    const int exp = (c >> 3) & 0xf;
    const float man = (float)(c & 7);
    if (c == 0 || c == 0x7f) return 0.0f;
    const float raw = exp == 0 ? man * 0x1p-9f : (1.0f + man / 8.0f) * ldexpf(1.0f, exp - 7);
    return raw * 0.5f;
}

/* ggml_fp32_to_ue4m3 of a non-negative float, as fp4.py's _ue4m3 */
static inline uint8_t kv_ue4m3(float x) {
    x = x < 0.0f ? 0.0f : x > 448.0f ? 448.0f : x; /* np.clip: NaN cannot occur (finite input) */
    if (x <= 0.0f) return 0;
    const uint32_t bits = kv_f32_bits(x);
    const int exp = (int)((bits >> 23) & 0xff) - 127 + 7;
    if (exp <= 0) {
        int s = (int)(x * 512.0f + 0.5f);
        return (uint8_t)(s < 0 ? 0 : s > 7 ? 7 : s);
    }
    if (exp >= 15) return 0x7e;
    int man = (int)((bits >> 20) & 7) + (int)((bits >> 19) & 1), e = exp;
    if (man > 7) {
        man = 0;
        e++;
    }
    return (uint8_t)(e >= 15 ? 0x7e : (e << 3) | man);
}

/* the code nearest to x for scale d: |d*v - x| in float32, lowest code on ties */
static inline uint8_t kv_e2m1_nearest(float x, float d) {
    int best = 0;
    float be = fabsf(d * kv_e2m1x2[0] - x);
    for (int k = 1; k < 16; k++) {
        float e = fabsf(d * kv_e2m1x2[k] - x);
        if (e < be) {
            be = e;
            best = k;
        }
    }
    return (uint8_t)best;
}
#endif /* KV_V2_COMMON */

/* ---- quantize ------------------------------------------------------------------------------------ */

static void FN(mxfp4_block)(const float *x, uint8_t *y) {
    float amax = 0.0f;
    for (int i = 0; i < 32; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
    int e = 0;
    if (amax > 0.0f) { /* numpy's float32 log2, correctly rounded, then floor; clipped to [0, 254] */
        e = (int)floorf((float)log2((double)amax)) - 2 + 127;
        e = e < 0 ? 0 : e > 254 ? 254 : e;
    }
    const float d = kv_e8m0_half((uint8_t)e);
    y[0] = (uint8_t)e;
    for (int j = 0; j < 16; j++)
        y[1 + j] = (uint8_t)(kv_e2m1_nearest(x[j], d) | kv_e2m1_nearest(x[j + 16], d) << 4);
}

static void FN(nvfp4_block)(const float *x, uint8_t *y) {
    for (int s = 0; s < 4; s++, x += 16) {
        float amax = 0.0f;
        for (int i = 0; i < 16; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
        const uint8_t sc = kv_ue4m3(amax / 6.0f);
        const float d = kv_ue4m3_half(sc);
        y[s] = sc;
        for (int j = 0; j < 8; j++)
            y[4 + 8 * s + j] = (uint8_t)(kv_e2m1_nearest(x[j], d) | kv_e2m1_nearest(x[j + 8], d) << 4);
    }
}

static void FN(kivi2_block)(const float *x, uint8_t *y) {
    float lo, hi;
    FN(minmax)(x, &lo, &hi);
    float d = (hi - lo) / 3.0f, id = FN(inverse)(d);
    FN(put_f16)(y, d);
    FN(put_f16)(y + 2, lo);
    uint8_t qs[8] = {0};
    for (int i = 0; i < KV_QK; i++) {
        int v = (int)((x[i] - lo) * id + 0.5f);
        qs[i % 8] |= (uint8_t)((v > 3 ? 3 : v) << (2 * (i / 8)));
    }
    memcpy(y + 4, qs, 8);
}

/* 1 when fmt is a v2 format (its row written), else 0 */
static int FN(v2_quantize)(int fmt, const float *x, uint8_t *dst, int d) {
    switch (fmt) {
    case KV_FP8_E4M3:
        for (int i = 0; i < d; i++) dst[i] = kv_fp8_encode(x[i], 3, 7, KV_E4M3_MAX);
        return 1;
    case KV_FP8_E5M2:
        for (int i = 0; i < d; i++) dst[i] = kv_fp8_encode(x[i], 2, 15, KV_E5M2_MAX);
        return 1;
    case KV_MXFP4:
        for (int b = 0; b < d / KV_MXFP4_LEN; b++) FN(mxfp4_block)(x + b * KV_MXFP4_LEN, dst + b * KV_MXFP4_BYTES);
        return 1;
    case KV_NVFP4:
        for (int b = 0; b < d / KV_NVFP4_LEN; b++) FN(nvfp4_block)(x + b * KV_NVFP4_LEN, dst + b * KV_NVFP4_BYTES);
        return 1;
    case KV_KIVI4: /* ggml's q4_1 bytes */
        for (int b = 0; b < d / KV_QK; b++) FN(q4_1_block)(x + b * KV_QK, dst + b * KV_KIVI4_BYTES);
        return 1;
    case KV_KIVI2:
        for (int b = 0; b < d / KV_QK; b++) FN(kivi2_block)(x + b * KV_QK, dst + b * KV_KIVI2_BYTES);
        return 1;
    default:
        return 0;
    }
}

/* ---- dequantize ---------------------------------------------------------------------------------- */

KV_INLINE float FN(v2_f16)(const uint8_t *p) {
    float f;
    F16_TO_F32(p, &f, 1);
    return f;
}

#if VL == 16 && (defined(__x86_64__) || defined(_M_X64))
/* AVX-512: fp8 bytes by the bit placement of kv_fp8_decode, e2m1 nibbles through a 16-float VPERMPS table */
static inline __m512 FN(v2_fp8_16)(const uint8_t *p, int man, int bias) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(const void *)p));
    const __m512i em = _mm512_and_si512(b, _mm512_set1_epi32(0x7f));
    __m512 v = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(em, 23 - man)), _mm512_set1_ps(ldexpf(1.0f, 127 - bias)));
    v = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(v), _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x80)), 24)));
    const __mmask16 nan = man == 3 ? _mm512_cmpeq_epi32_mask(em, _mm512_set1_epi32(0x7f))
                                   : _mm512_cmpge_epi32_mask(em, _mm512_set1_epi32(0x7c));
    return _mm512_mask_mov_ps(v, nan, _mm512_castsi512_ps(_mm512_set1_epi32(0x7fc00000)));
}
/* 16 bytes of nibbles -> the 16 low-nibble values into lo, the 16 high into hi, times d */
static inline void FN(v2_e2m1_32)(const uint8_t *p, __m512 d, __m512 *lo, __m512 *hi) {
    const __m512 tab = _mm512_load_ps(kv_e2m1x2);
    const __m512i n = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(const void *)p));
    *lo = _mm512_mul_ps(d, _mm512_permutexvar_ps(n, tab)); /* VPERMPS reads the low 4 index bits */
    *hi = _mm512_mul_ps(d, _mm512_permutexvar_ps(_mm512_srli_epi32(n, 4), tab));
}
#define KV_V2_VEC 1
#endif

static int FN(v2_dequantize)(int fmt, const uint8_t *src, float *dst, int d) {
    if (!kv_is_v2(fmt)) return 0;
    switch (fmt) {
    case KV_FP8_E4M3:
    case KV_FP8_E5M2: {
        const int man = fmt == KV_FP8_E4M3 ? 3 : 2, bias = fmt == KV_FP8_E4M3 ? 7 : 15;
        int i = 0;
#ifdef KV_V2_VEC
        for (; i + 16 <= d; i += 16) _mm512_storeu_ps(dst + i, FN(v2_fp8_16)(src + i, man, bias));
#endif
        for (; i < d; i++) dst[i] = kv_fp8_decode(src[i], man, bias);
        return 1;
    }
    case KV_MXFP4:
        for (int b = 0; b < d / KV_MXFP4_LEN; b++, dst += KV_MXFP4_LEN) {
            const uint8_t *y = src + b * KV_MXFP4_BYTES;
            const float s = kv_e8m0_half(y[0]);
#ifdef KV_V2_VEC
            __m512 lo, hi;
            FN(v2_e2m1_32)(y + 1, _mm512_set1_ps(s), &lo, &hi);
            _mm512_storeu_ps(dst, lo);
            _mm512_storeu_ps(dst + 16, hi);
#else
            for (int j = 0; j < 16; j++) {
                dst[j] = s * kv_e2m1x2[y[1 + j] & 15];
                dst[j + 16] = s * kv_e2m1x2[y[1 + j] >> 4];
            }
#endif
        }
        return 1;
    case KV_NVFP4:
        for (int b = 0; b < d / KV_NVFP4_LEN; b++, dst += KV_NVFP4_LEN) {
            const uint8_t *y = src + b * KV_NVFP4_BYTES;
#ifdef KV_V2_VEC
            /* qs[0..15] holds sub-blocks 0, 1; lanes 0-7 of the low nibbles are sub-block 0's values 0-7 */
            for (int h = 0; h < 2; h++) {
                const float s0 = kv_ue4m3_half(y[2 * h]), s1 = kv_ue4m3_half(y[2 * h + 1]);
                const __m512 dv = _mm512_mask_blend_ps(0xff00, _mm512_set1_ps(s0), _mm512_set1_ps(s1));
                __m512 lo, hi; /* lo lane k: sub-block k/8 value k%8; hi lane k: value k%8 + 8 */
                FN(v2_e2m1_32)(y + 4 + 16 * h, dv, &lo, &hi);
                const __m512i i_a = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
                const __m512i i_b = _mm512_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
                _mm512_storeu_ps(dst + 32 * h, _mm512_permutex2var_ps(lo, i_a, hi));
                _mm512_storeu_ps(dst + 32 * h + 16, _mm512_permutex2var_ps(lo, i_b, hi));
            }
#else
            for (int s = 0; s < 4; s++) {
                const float sc = kv_ue4m3_half(y[s]);
                for (int j = 0; j < 8; j++) {
                    dst[16 * s + j] = sc * kv_e2m1x2[y[4 + 8 * s + j] & 15];
                    dst[16 * s + j + 8] = sc * kv_e2m1x2[y[4 + 8 * s + j] >> 4];
                }
            }
#endif
        }
        return 1;
    case KV_KIVI4:
        for (int b = 0; b < d / KV_QK; b++, dst += KV_QK) {
            const uint8_t *y = src + b * KV_KIVI4_BYTES;
            const float s = FN(v2_f16)(y), m = FN(v2_f16)(y + 2);
#ifdef KV_V2_VEC
            const __m512i n = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(const void *)(y + 4)));
            const __m512 sv = _mm512_set1_ps(s), mv = _mm512_set1_ps(m);
            _mm512_storeu_ps(dst, _mm512_add_ps(_mm512_mul_ps(sv, _mm512_cvtepi32_ps(_mm512_and_si512(n, _mm512_set1_epi32(15)))), mv));
            _mm512_storeu_ps(dst + 16, _mm512_add_ps(_mm512_mul_ps(sv, _mm512_cvtepi32_ps(_mm512_srli_epi32(n, 4))), mv));
#else
            for (int j = 0; j < 16; j++) {
                dst[j] = s * (float)(y[4 + j] & 0x0f) + m;
                dst[j + 16] = s * (float)(y[4 + j] >> 4) + m;
            }
#endif
        }
        return 1;
    default: /* kivi2 */
        for (int b = 0; b < d / KV_QK; b++, dst += KV_QK) {
            const uint8_t *y = src + b * KV_KIVI2_BYTES;
            const float s = FN(v2_f16)(y), m = FN(v2_f16)(y + 2);
#ifdef KV_V2_VEC
            /* lane k of the 8 bytes broadcast twice: byte k%8, field k/8 (+2 for the second half) */
            long long q8;
            memcpy(&q8, y + 4, 8);
            const __m512i q = _mm512_cvtepu8_epi32(_mm_set1_epi64x(q8));
            const __m512i sh = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2);
            const __m512 sv = _mm512_set1_ps(s), mv = _mm512_set1_ps(m);
            for (int h = 0; h < 2; h++) {
                __m512i c = _mm512_and_si512(_mm512_srlv_epi32(q, _mm512_add_epi32(sh, _mm512_set1_epi32(4 * h))), _mm512_set1_epi32(3));
                _mm512_storeu_ps(dst + 16 * h, _mm512_add_ps(_mm512_mul_ps(sv, _mm512_cvtepi32_ps(c)), mv));
            }
#else
            for (int i = 0; i < KV_QK; i++) dst[i] = s * (float)((y[4 + i % 8] >> (2 * (i / 8))) & 3) + m;
#endif
        }
        return 1;
    }
}
#undef KV_V2_VEC
