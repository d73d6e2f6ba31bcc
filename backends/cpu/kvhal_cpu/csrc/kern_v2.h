/* The formats of kvhal 2 (fp8_e4m3, fp8_e5m2, mxfp4, nvfp4, kivi4, kivi2 rows), included by kern_template.h
 * after its ggml quantizers; every ISA gets the portable rows below, and the AVX-512 / AVX2 builds also
 * vector dequantizers (the attention's f32 path dequantizes each K/V tile through them).
 *
 * Each function is bit-exact with kvhal/formats/{fp8,fp4,kivi}.py, the spec: the same float32 operations
 * in the same order (the build keeps -ffp-contract=off), integer bit moves where numpy moves bits.
 * kivi4 rows are ggml's q4_1 bytes; kivi2 rows are {f16 d; f16 m; u8 qs[8]} per 32 values. K stored per
 * channel over whole pages (the KIVI K layout) is kivi_k.c's.
 */
#ifndef KV_V2_COMMON
#define KV_V2_COMMON
/* the doubled e2m1 values (ggml's kvalues_mxfp4 as floats); code 8 is +0, as in numpy */
static const float kv_e2m1x2[16] KV_ALIGN(64) = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

static inline int kv_is_v2(int fmt) { return fmt >= KV_FP8_E4M3 && fmt <= KV_KIVI2; }

/* software prefetch (into L1, as kern_avx512_decode.h's; L2 only measured slower) of the rows of a later
 * step, a token's rows at a time inside the work loops: the same lines requested in one burst per step
 * filled the miss queues and stalled the core */
typedef struct {
    const uint8_t *row[16];
    int n;         /* rows to prefetch (0: none) */
    int64_t bytes; /* of a row */
} kv_v2_pf;
static inline void kv_v2_pf_rows(const kv_v2_pf *pf, int t, int count) {
    for (int i = t; i < t + count && i < pf->n; i++)
        for (int64_t o = 0; o < pf->bytes; o += 64) __builtin_prefetch(pf->row[i] + o, 0, 3);
}

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

/* the e4m3 scale code -> its value times one half (0 and 0x7F read 0): fp4.py's _ue4m3_half of every
 * byte, generated from it (exact: 4 significant bits, exponents -10..7) */
static const float kv_ue4m3_half_tab[256] = {
    0.0f, 0x1p-10f, 0x1p-9f, 0x1.8p-9f, 0x1p-8f, 0x1.4p-8f, 0x1.8p-8f, 0x1.cp-8f, 0x1p-7f, 0x1.2p-7f, 0x1.4p-7f, 0x1.6p-7f, 0x1.8p-7f, 0x1.ap-7f, 0x1.cp-7f, 0x1.ep-7f,
    0x1p-6f, 0x1.2p-6f, 0x1.4p-6f, 0x1.6p-6f, 0x1.8p-6f, 0x1.ap-6f, 0x1.cp-6f, 0x1.ep-6f, 0x1p-5f, 0x1.2p-5f, 0x1.4p-5f, 0x1.6p-5f, 0x1.8p-5f, 0x1.ap-5f, 0x1.cp-5f, 0x1.ep-5f,
    0x1p-4f, 0x1.2p-4f, 0x1.4p-4f, 0x1.6p-4f, 0x1.8p-4f, 0x1.ap-4f, 0x1.cp-4f, 0x1.ep-4f, 0x1p-3f, 0x1.2p-3f, 0x1.4p-3f, 0x1.6p-3f, 0x1.8p-3f, 0x1.ap-3f, 0x1.cp-3f, 0x1.ep-3f,
    0x1p-2f, 0x1.2p-2f, 0x1.4p-2f, 0x1.6p-2f, 0x1.8p-2f, 0x1.ap-2f, 0x1.cp-2f, 0x1.ep-2f, 0x1p-1f, 0x1.2p-1f, 0x1.4p-1f, 0x1.6p-1f, 0x1.8p-1f, 0x1.ap-1f, 0x1.cp-1f, 0x1.ep-1f,
    0x1p+0f, 0x1.2p+0f, 0x1.4p+0f, 0x1.6p+0f, 0x1.8p+0f, 0x1.ap+0f, 0x1.cp+0f, 0x1.ep+0f, 0x1p+1f, 0x1.2p+1f, 0x1.4p+1f, 0x1.6p+1f, 0x1.8p+1f, 0x1.ap+1f, 0x1.cp+1f, 0x1.ep+1f,
    0x1p+2f, 0x1.2p+2f, 0x1.4p+2f, 0x1.6p+2f, 0x1.8p+2f, 0x1.ap+2f, 0x1.cp+2f, 0x1.ep+2f, 0x1p+3f, 0x1.2p+3f, 0x1.4p+3f, 0x1.6p+3f, 0x1.8p+3f, 0x1.ap+3f, 0x1.cp+3f, 0x1.ep+3f,
    0x1p+4f, 0x1.2p+4f, 0x1.4p+4f, 0x1.6p+4f, 0x1.8p+4f, 0x1.ap+4f, 0x1.cp+4f, 0x1.ep+4f, 0x1p+5f, 0x1.2p+5f, 0x1.4p+5f, 0x1.6p+5f, 0x1.8p+5f, 0x1.ap+5f, 0x1.cp+5f, 0x1.ep+5f,
    0x1p+6f, 0x1.2p+6f, 0x1.4p+6f, 0x1.6p+6f, 0x1.8p+6f, 0x1.ap+6f, 0x1.cp+6f, 0x1.ep+6f, 0x1p+7f, 0x1.2p+7f, 0x1.4p+7f, 0x1.6p+7f, 0x1.8p+7f, 0x1.ap+7f, 0x1.cp+7f, 0.0f,
    0.0f, 0x1p-10f, 0x1p-9f, 0x1.8p-9f, 0x1p-8f, 0x1.4p-8f, 0x1.8p-8f, 0x1.cp-8f, 0x1p-7f, 0x1.2p-7f, 0x1.4p-7f, 0x1.6p-7f, 0x1.8p-7f, 0x1.ap-7f, 0x1.cp-7f, 0x1.ep-7f,
    0x1p-6f, 0x1.2p-6f, 0x1.4p-6f, 0x1.6p-6f, 0x1.8p-6f, 0x1.ap-6f, 0x1.cp-6f, 0x1.ep-6f, 0x1p-5f, 0x1.2p-5f, 0x1.4p-5f, 0x1.6p-5f, 0x1.8p-5f, 0x1.ap-5f, 0x1.cp-5f, 0x1.ep-5f,
    0x1p-4f, 0x1.2p-4f, 0x1.4p-4f, 0x1.6p-4f, 0x1.8p-4f, 0x1.ap-4f, 0x1.cp-4f, 0x1.ep-4f, 0x1p-3f, 0x1.2p-3f, 0x1.4p-3f, 0x1.6p-3f, 0x1.8p-3f, 0x1.ap-3f, 0x1.cp-3f, 0x1.ep-3f,
    0x1p-2f, 0x1.2p-2f, 0x1.4p-2f, 0x1.6p-2f, 0x1.8p-2f, 0x1.ap-2f, 0x1.cp-2f, 0x1.ep-2f, 0x1p-1f, 0x1.2p-1f, 0x1.4p-1f, 0x1.6p-1f, 0x1.8p-1f, 0x1.ap-1f, 0x1.cp-1f, 0x1.ep-1f,
    0x1p+0f, 0x1.2p+0f, 0x1.4p+0f, 0x1.6p+0f, 0x1.8p+0f, 0x1.ap+0f, 0x1.cp+0f, 0x1.ep+0f, 0x1p+1f, 0x1.2p+1f, 0x1.4p+1f, 0x1.6p+1f, 0x1.8p+1f, 0x1.ap+1f, 0x1.cp+1f, 0x1.ep+1f,
    0x1p+2f, 0x1.2p+2f, 0x1.4p+2f, 0x1.6p+2f, 0x1.8p+2f, 0x1.ap+2f, 0x1.cp+2f, 0x1.ep+2f, 0x1p+3f, 0x1.2p+3f, 0x1.4p+3f, 0x1.6p+3f, 0x1.8p+3f, 0x1.ap+3f, 0x1.cp+3f, 0x1.ep+3f,
    0x1p+4f, 0x1.2p+4f, 0x1.4p+4f, 0x1.6p+4f, 0x1.8p+4f, 0x1.ap+4f, 0x1.cp+4f, 0x1.ep+4f, 0x1p+5f, 0x1.2p+5f, 0x1.4p+5f, 0x1.6p+5f, 0x1.8p+5f, 0x1.ap+5f, 0x1.cp+5f, 0x1.ep+5f,
    0x1p+6f, 0x1.2p+6f, 0x1.4p+6f, 0x1.6p+6f, 0x1.8p+6f, 0x1.ap+6f, 0x1.cp+6f, 0x1.ep+6f, 0x1p+7f, 0x1.2p+7f, 0x1.4p+7f, 0x1.6p+7f, 0x1.8p+7f, 0x1.ap+7f, 0x1.cp+7f, 0x1.ep+7f,
};
static inline float kv_ue4m3_half(uint8_t c) { return kv_ue4m3_half_tab[c]; }

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

#endif /* KV_V2_COMMON */

/* ---- quantize ------------------------------------------------------------------------------------ */

/* the codes nearest to x[0 .. n) (n a multiple of 16) for scale d: |d*v - x| in float32, lowest code on ties;
 * 16 values at a time through the ISA's E2M1_CODES16 where it has one */
static inline void FN(e2m1_codes)(const float *x, float d, int n, int32_t *code) {
    float v[16];
    for (int k = 0; k < 16; k++) v[k] = d * kv_e2m1x2[k];
    for (int i0 = 0; i0 < n; i0 += 16) {
#ifdef E2M1_CODES16
        E2M1_CODES16(x + i0, v, code + i0);
#else
        for (int i = i0; i < i0 + 16; i++) {
            float best = fabsf(v[0] - x[i]);
            code[i] = 0;
            for (int k = 1; k < 16; k++) {
                const float e = fabsf(v[k] - x[i]);
                if (e < best) best = e, code[i] = k;
            }
        }
#endif
    }
}

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
    int32_t c[32];
    FN(e2m1_codes)(x, d, 32, c);
    for (int j = 0; j < 16; j++) y[1 + j] = (uint8_t)(c[j] | c[j + 16] << 4);
}

static void FN(nvfp4_block)(const float *x, uint8_t *y) {
    for (int s = 0; s < 4; s++, x += 16) {
        float amax = 0.0f;
        for (int i = 0; i < 16; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
        const uint8_t sc = kv_ue4m3(amax / 6.0f);
        const float d = kv_ue4m3_half(sc);
        y[s] = sc;
        int32_t c[16];
        FN(e2m1_codes)(x, d, 16, c);
        for (int j = 0; j < 8; j++) y[4 + 8 * s + j] = (uint8_t)(c[j] | c[j + 8] << 4);
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
#elif VL == 8 && (defined(__x86_64__) || defined(_M_X64))
/* AVX2 + F16C: 16 fp8 bytes through f16 (as the AVX-512 decode path: e5m2 is an f16's high byte, e4m3
 * moves one bit down and is scaled by 2^8, the inf/NaN codes read NaN) */
static inline void FN(v2_fp8_16_avx2)(const uint8_t *p, float *dst, int e4m3) {
    __m256i w = _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(const void *)p)), 8);
    __m256i bad;
    if (e4m3) {
        w = _mm256_and_si256(_mm256_srai_epi16(w, 1), _mm256_set1_epi16((short)0xbfff));
        bad = _mm256_cmpeq_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x7fff)), _mm256_set1_epi16(0x3f80));
    } else {
        bad = _mm256_cmpeq_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x7fff)), _mm256_set1_epi16(0x7c00));
    }
    w = _mm256_blendv_epi8(w, _mm256_set1_epi16(0x7e00), bad);
    const __m256 sc = _mm256_set1_ps(e4m3 ? 256.0f : 1.0f);
    _mm256_storeu_ps(dst, _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(w)), sc));
    _mm256_storeu_ps(dst + 8, _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(w, 1)), sc));
}
#define KV_V2_AVX2 1
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
#elif defined(KV_V2_AVX2)
        for (; i + 16 <= d; i += 16) FN(v2_fp8_16_avx2)(src + i, dst + i, fmt == KV_FP8_E4M3);
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

#ifdef KV_V2_VEC
/* ---- AVX-512 decode path for the v2 formats ------------------------------------------------------
 * One query position per item, head_dim 64..256 (a multiple of 32), K and V each a v2 or float format.
 * The f32 path dequantizes a whole tile into L1 and reduces every (row, token) dot product on its own;
 * here each 16-value chunk of a K row is decoded into a register and meets every query row of its KV
 * head, the 16 tokens' partial sums are reduced together (a 4-level shuffle tree: 2 ops per dot, not
 * ~8), and V is decoded once per token into a small buffer the query rows' accumulators stream over. */

/* chunks 2*c2 and 2*c2 + 1 (values 32*c2 .. 32*c2 + 31) of a stored row as f32 times 1 / KV_V2_SCALE(fmt);
 * fmt is a constant once inlined. fp8 goes through f16: e5m2 is an f16's high byte; e4m3's
 * exponent/mantissa bits moved to an f16's are its value / 2^8 (subnormals included), the 2^8 applied to
 * the scores and the output instead of every value; the inf/NaN codes (never stored) read NaN. */
#define KV_V2_SCALE(fmt) ((fmt) == KV_FP8_E4M3 ? 256.0f : 1.0f)
KV_INLINE void FN(v2_pair)(int fmt, const uint8_t *row, int c2, int nan, __m512 *a, __m512 *b) {
    const __m512 tab = _mm512_load_ps(kv_e2m1x2);
    switch (fmt) {
    case KV_F32:
        *a = _mm512_loadu_ps((const float *)(const void *)row + 32 * c2);
        *b = _mm512_loadu_ps((const float *)(const void *)row + 32 * c2 + 16);
        return;
    case KV_F16:
        *a = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(const void *)(row + 64 * c2)));
        *b = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(const void *)(row + 64 * c2 + 32)));
        return;
    case KV_BF16:
        *a = _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(const void *)(row + 64 * c2))), 16));
        *b = _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(const void *)(row + 64 * c2 + 32))), 16));
        return;
    case KV_FP8_E4M3:
    case KV_FP8_E5M2: { /* the bytes sign-extended to 16 bits (x); with nan, an inf/NaN code (x + 4 for e5m2,
                         * x + 1 for e4m3, has 7 low zero bits) reads NaN, as the spec's table; K rows skip
                         * that test (v2_decode_item checks them whole: kv_v2_fp8_bad) */
        const __m512i x = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(const void *)(row + 32 * c2)));
        __m512i w;
        if (fmt == KV_FP8_E4M3) /* x << 7 with bit 14 (a sign copy) cleared: the value / 256 (KV_V2_SCALE) */
            w = _mm512_and_si512(_mm512_slli_epi16(x, 7), _mm512_set1_epi16((short)0xbfff));
        else
            w = _mm512_slli_epi16(x, 8);
        if (nan) {
            const __m512i inc = _mm512_set1_epi16(fmt == KV_FP8_E4M3 ? 1 : 4);
            const __mmask32 bad = _mm512_testn_epi16_mask(_mm512_add_epi16(x, inc), _mm512_set1_epi16(0x7f));
            w = _mm512_mask_mov_epi16(w, bad, _mm512_set1_epi16(0x7e00));
        }
        *a = _mm512_cvtph_ps(_mm512_castsi512_si256(w));
        *b = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(w, 1));
        return;
    }
    case KV_MXFP4: { /* VPERMPS reads the low 4 index bits: the low nibbles need no mask */
        const uint8_t *y = row + KV_MXFP4_BYTES * c2;
        const __m512i n = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(const void *)(y + 1)));
        const __m512 d = _mm512_set1_ps(kv_e8m0_half(y[0]));
        *a = _mm512_mul_ps(d, _mm512_permutexvar_ps(n, tab));
        *b = _mm512_mul_ps(d, _mm512_permutexvar_ps(_mm512_srli_epi32(n, 4), tab));
        return;
    }
    case KV_NVFP4: { /* sub-blocks sb, sb + 1 (sb = 2*(c2&1)): 8 bytes each, values j (low nibble) and j + 8 (high) */
        const uint8_t *y = row + KV_NVFP4_BYTES * (c2 >> 1);
        const int sb = 2 * (c2 & 1);
        const __m512i n = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(const void *)(y + 4 + 8 * sb)));
        const __m512 lo = _mm512_permutexvar_ps(n, tab), hi = _mm512_permutexvar_ps(_mm512_srli_epi32(n, 4), tab);
        const __m512i ia = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
        const __m512i ib = _mm512_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
        *a = _mm512_mul_ps(_mm512_set1_ps(kv_ue4m3_half_tab[y[sb]]), _mm512_permutex2var_ps(lo, ia, hi));
        *b = _mm512_mul_ps(_mm512_set1_ps(kv_ue4m3_half_tab[y[sb + 1]]), _mm512_permutex2var_ps(lo, ib, hi));
        return;
    }
    case KV_KIVI4: {
        const uint8_t *y = row + KV_KIVI4_BYTES * c2;
        const __m512i n = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(const void *)(y + 4)));
        const __m512 d = _mm512_set1_ps(FN(v2_f16)(y)), m = _mm512_set1_ps(FN(v2_f16)(y + 2));
        *a = _mm512_add_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_and_si512(n, _mm512_set1_epi32(15)))), m);
        *b = _mm512_add_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_srli_epi32(n, 4))), m);
        return;
    }
    default: { /* kivi2: lane k of the 8 bytes twice is byte k % 8; field k / 8 (+2 for the second chunk) */
        const uint8_t *y = row + KV_KIVI2_BYTES * c2;
        const __m128i b8 = _mm_loadl_epi64((const __m128i *)(const void *)(y + 4));
        const __m512i n = _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(b8, b8)), three = _mm512_set1_epi32(3);
        const __m512i sh = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2);
        const __m512 d = _mm512_set1_ps(FN(v2_f16)(y)), m = _mm512_set1_ps(FN(v2_f16)(y + 2));
        *a = _mm512_add_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srlv_epi32(n, sh), three))), m);
        *b = _mm512_add_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srlv_epi32(_mm512_srli_epi32(n, 4), sh), three))), m);
        return;
    }
    }
}

static inline int kv_v2_dec_fmt(int fmt) { return fmt <= KV_BF16 || kv_is_v2(fmt); }

/* whether an fp8 row of d bytes holds an inf/NaN code (e4m3: exponent and mantissa all ones; e5m2:
 * exponent all ones), which the spec reads as NaN: a byte with those bits set has none left by ANDNOT */
static inline int kv_v2_fp8_bad(const uint8_t *row, int d, int fmt) {
    const __m256i bits = _mm256_set1_epi8(fmt == KV_FP8_E4M3 ? 0x7f : 0x7c);
    __m256i m = bits;
    for (int j = 0; j < d; j += 32)
        m = _mm256_min_epu8(m, _mm256_andnot_si256(_mm256_loadu_si256((const __m256i *)(const void *)(row + j)), bits));
    return _mm256_testn_epi8_mask(m, m) != 0;
}

/* sum of each of 16 vectors s[t*16 ..] into lane t */
static inline __m512 kv_v2_reduce16(const float *s) {
    __m512 x[8], y[4], z[2];
    for (int i = 0; i < 8; i++) {
        const __m512 a = _mm512_load_ps(s + 16 * i), b = _mm512_load_ps(s + 16 * (i + 8));
        x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xee));
    }
    for (int i = 0; i < 4; i++)
        y[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x[i], x[i + 4], 0x88), _mm512_shuffle_f32x4(x[i], x[i + 4], 0xdd));
    for (int i = 0; i < 2; i++)
        z[i] = _mm512_add_ps(_mm512_shuffle_ps(y[i], y[i + 2], 0x44), _mm512_shuffle_ps(y[i], y[i + 2], 0xee));
    const __m512 w = _mm512_add_ps(_mm512_shuffle_ps(z[0], z[1], 0x88), _mm512_shuffle_ps(z[0], z[1], 0xdd));
    /* w holds tokens 0 2 1 3 8 10 9 11 4 6 5 7 12 14 13 15: the same permutation puts them in order */
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15), w);
}

/* scores of G query rows (qf, [G][D]) against 16 K rows into S [G][16 tokens][16 partials] */
KV_INLINE void FN(v2_k16)(int kfmt, int NC, const float *qf, int G, const uint8_t *const *kr, float *S, const kv_v2_pf *pf) {
    if (NC <= 8) { /* two tokens at a time: four independent FMA chains per query row */
        for (int t = 0; t < 16; t += 2) {
            kv_v2_pf_rows(pf, t, 2);
            __m512 k0[8], k1[8];
            for (int ch = 0; ch < NC; ch += 2) {
                FN(v2_pair)(kfmt, kr[t], ch / 2, 0, &k0[ch], &k0[ch + 1]);
                FN(v2_pair)(kfmt, kr[t + 1], ch / 2, 0, &k1[ch], &k1[ch + 1]);
            }
            for (int r = 0; r < G; r++) {
                const float *q = qf + (size_t)r * NC * 16;
                __m512 q0 = _mm512_loadu_ps(q), q1 = _mm512_loadu_ps(q + 16);
                __m512 a0 = _mm512_mul_ps(k0[0], q0), a1 = _mm512_mul_ps(k0[1], q1);
                __m512 b0 = _mm512_mul_ps(k1[0], q0), b1 = _mm512_mul_ps(k1[1], q1);
                for (int ch = 2; ch < NC; ch += 2) {
                    q0 = _mm512_loadu_ps(q + 16 * ch);
                    q1 = _mm512_loadu_ps(q + 16 * ch + 16);
                    a0 = _mm512_fmadd_ps(k0[ch], q0, a0);
                    a1 = _mm512_fmadd_ps(k0[ch + 1], q1, a1);
                    b0 = _mm512_fmadd_ps(k1[ch], q0, b0);
                    b1 = _mm512_fmadd_ps(k1[ch + 1], q1, b1);
                }
                _mm512_store_ps(S + (size_t)(r * 16 + t) * 16, _mm512_add_ps(a0, a1));
                _mm512_store_ps(S + (size_t)(r * 16 + t + 1) * 16, _mm512_add_ps(b0, b1));
            }
        }
        return;
    }
    for (int t = 0; t < 16; t++) {
        kv_v2_pf_rows(pf, t, 1);
        __m512 kv[16];
        for (int ch = 0; ch < NC; ch += 2) FN(v2_pair)(kfmt, kr[t], ch / 2, 0, &kv[ch], &kv[ch + 1]);
        for (int r = 0; r < G; r++) {
            const float *q = qf + (size_t)r * NC * 16;
            __m512 a0 = _mm512_mul_ps(kv[0], _mm512_loadu_ps(q)), a1 = _mm512_mul_ps(kv[1], _mm512_loadu_ps(q + 16));
            for (int ch = 2; ch < NC; ch += 2) {
                a0 = _mm512_fmadd_ps(kv[ch], _mm512_loadu_ps(q + 16 * ch), a0);
                a1 = _mm512_fmadd_ps(kv[ch + 1], _mm512_loadu_ps(q + 16 * ch + 16), a1);
            }
            _mm512_store_ps(S + (size_t)(r * 16 + t) * 16, _mm512_add_ps(a0, a1));
        }
    }
}

KV_INLINE void FN(v2_v16)(int vfmt, int NC, const uint8_t *const *vr, float *VB, const kv_v2_pf *pf) {
    for (int t = 0; t < 16; t++)
        for (int ch = 0; ch < NC; ch += 2) {
            if (ch == 0) kv_v2_pf_rows(pf, t, 1);
            __m512 a, b;
            FN(v2_pair)(vfmt, vr[t], ch / 2, 1, &a, &b);
            _mm512_store_ps(VB + (size_t)(t * NC + ch) * 16, a);
            _mm512_store_ps(VB + (size_t)(t * NC + ch + 1) * 16, b);
        }
}

/* G = 4 query rows: V chunks decoded straight into the FMAs, four chunks of the four rows' outputs (16
 * registers) at a time, so no V buffer is written and read back */
KV_INLINE void FN(v2_pv4)(int vfmt, int NC, const uint8_t *const *vr, const float *P, float *o, int D, int nt,
                          const kv_v2_pf *pf) {
    for (int ch = 0; ch < NC; ch += 4) {
        __m512 a[4][4];
        for (int r = 0; r < 4; r++)
            for (int k = 0; k < 4; k++) a[r][k] = _mm512_loadu_ps(o + (size_t)r * D + 16 * (ch + k));
        for (int t = 0; t < nt; t++) {
            if (ch == 0) kv_v2_pf_rows(pf, t, 1);
            __m512 v[4];
            FN(v2_pair)(vfmt, vr[t], ch / 2, 1, &v[0], &v[1]);
            FN(v2_pair)(vfmt, vr[t], ch / 2 + 1, 1, &v[2], &v[3]);
            for (int r = 0; r < 4; r++) {
                const __m512 pt = _mm512_set1_ps(P[16 * r + t]);
                for (int k = 0; k < 4; k++) a[r][k] = _mm512_fmadd_ps(pt, v[k], a[r][k]);
            }
        }
        for (int r = 0; r < 4; r++)
            for (int k = 0; k < 4; k++) _mm512_storeu_ps(o + (size_t)r * D + 16 * (ch + k), a[r][k]);
    }
}

#define KV_V2_FMT_CASES(X, NC)                                                                                   \
    X(KV_F32, NC) X(KV_F16, NC) X(KV_BF16, NC) X(KV_FP8_E4M3, NC) X(KV_FP8_E5M2, NC) X(KV_MXFP4, NC) X(KV_NVFP4, NC) \
    X(KV_KIVI4, NC) X(KV_KIVI2, NC)
#define KV_V2_K_CASE(F, NC)                                                                                      \
    case F:                                                                                                      \
        FN(v2_k16)(F, NC, qf, G, kr, S, pf);                                                                      \
        break;
#define KV_V2_V_CASE(F, NC)                                                                                      \
    case F:                                                                                                      \
        FN(v2_v16)(F, NC, vr, VB, pf);                                                                             \
        break;

static void FN(v2_k16_any)(int kfmt, int NC, const float *qf, int G, const uint8_t *const *kr, float *S,
                            const kv_v2_pf *pf) {
    if (NC == 8) {
        switch (kfmt) { KV_V2_FMT_CASES(KV_V2_K_CASE, 8) }
    } else {
        switch (kfmt) { KV_V2_FMT_CASES(KV_V2_K_CASE, NC) }
    }
}
#define KV_V2_PV4_CASE(F, NC)                                                                                    \
    case F:                                                                                                      \
        FN(v2_pv4)(F, NC, vr, P, o, D, nt, pf);                                                                   \
        break;
static void FN(v2_pv4_any)(int vfmt, int NC, const uint8_t *const *vr, const float *P, float *o, int D, int nt,
                            const kv_v2_pf *pf) {
    if (NC == 8) {
        switch (vfmt) { KV_V2_FMT_CASES(KV_V2_PV4_CASE, 8) }
    } else {
        switch (vfmt) { KV_V2_FMT_CASES(KV_V2_PV4_CASE, NC) }
    }
}
static void FN(v2_v16_any)(int vfmt, int NC, const uint8_t *const *vr, float *VB, const kv_v2_pf *pf) {
    if (NC == 8) {
        switch (vfmt) { KV_V2_FMT_CASES(KV_V2_V_CASE, 8) }
    } else {
        switch (vfmt) { KV_V2_FMT_CASES(KV_V2_V_CASE, NC) }
    }
}

/* the K and V rows of tokens [t0, t0 + n) of head h, to prefetch */
static void FN(v2_pf_set)(const kv_call *c, int s, int h, int t0, int n, kv_v2_pf *pk, kv_v2_pf *pv) {
    pk->n = pv->n = n;
    pk->bytes = c->krow;
    pv->bytes = c->vrow;
    for (int t = 0; t < n;) {
        int j = t0 + t, run = c->block_size - j % c->block_size;
        if (run > n - t) run = n - t;
        const uint8_t *kp = kv_row(c, c->kpool, c->krow, s, h, j), *vp = kv_row(c, c->vpool, c->vrow, s, h, j);
        for (int u = 0; u < run; u++, t++) {
            pk->row[t] = kp + (int64_t)u * c->krow;
            pv->row[t] = vp + (int64_t)u * c->vrow;
        }
    }
}

/* o[0..D) += sum_t p[t] VB[t], four 16-value chunks (two at the end) of o in registers at a time */
static void FN(v2_pv)(float *o, const float *p, const float *VB, int nt, int NC) {
    int ch = 0;
    for (; ch + 4 <= NC; ch += 4) {
        __m512 a0 = _mm512_loadu_ps(o + 16 * ch), a1 = _mm512_loadu_ps(o + 16 * ch + 16);
        __m512 a2 = _mm512_loadu_ps(o + 16 * ch + 32), a3 = _mm512_loadu_ps(o + 16 * ch + 48);
        for (int t = 0; t < nt; t++) {
            const __m512 pt = _mm512_set1_ps(p[t]);
            const float *v = VB + (size_t)(t * NC + ch) * 16;
            a0 = _mm512_fmadd_ps(pt, _mm512_load_ps(v), a0);
            a1 = _mm512_fmadd_ps(pt, _mm512_load_ps(v + 16), a1);
            a2 = _mm512_fmadd_ps(pt, _mm512_load_ps(v + 32), a2);
            a3 = _mm512_fmadd_ps(pt, _mm512_load_ps(v + 48), a3);
        }
        _mm512_storeu_ps(o + 16 * ch, a0);
        _mm512_storeu_ps(o + 16 * ch + 16, a1);
        _mm512_storeu_ps(o + 16 * ch + 32, a2);
        _mm512_storeu_ps(o + 16 * ch + 48, a3);
    }
    for (; ch < NC; ch += 2) {
        __m512 a0 = _mm512_loadu_ps(o + 16 * ch), a1 = _mm512_loadu_ps(o + 16 * ch + 16);
        for (int t = 0; t < nt; t++) {
            const __m512 pt = _mm512_set1_ps(p[t]);
            const float *v = VB + (size_t)(t * NC + ch) * 16;
            a0 = _mm512_fmadd_ps(pt, _mm512_load_ps(v), a0);
            a1 = _mm512_fmadd_ps(pt, _mm512_load_ps(v + 16), a1);
        }
        _mm512_storeu_ps(o + 16 * ch, a0);
        _mm512_storeu_ps(o + 16 * ch + 16, a1);
    }
}

static int FN(v2_decode_item)(const kv_call *c, const kv_item *it, kv_scratch *ws, float *pm, float *pl, float *po) {
    const int D = c->head_dim, G = c->n_heads / c->n_kv_heads, NC = D / 16;
    if (it->npos != 1 || c->kpaged || !(kv_is_v2(c->kfmt) || kv_is_v2(c->vfmt)) || !kv_v2_dec_fmt(c->kfmt) ||
        !kv_v2_dec_fmt(c->vfmt) || D % 32 || D > 256)
        return 0;
    if ((size_t)(G * 256 + 16 * D) * sizeof(float) + 64 > ws->extra_bytes) return 0;
    float *S = (float *)(void *)(((uintptr_t)ws->extra + 63) & ~(uintptr_t)63), *VB = S + (size_t)G * 256;
    const int s = it->seq, n_kv = c->seq_lens[s], n_q = c->q_lens[s];
    const int64_t qrow = c->q_start[s] + it->pos0;
    int lo, hi;
    kv_visible(c, n_kv, n_kv - n_q + it->pos0, &lo, &hi);
    if (lo < it->lo) lo = it->lo;
    if (hi > it->hi) hi = it->hi;
    const int RT = G * it->nheads;
    const __m512 sc = _mm512_set1_ps(c->scale2), ksc = _mm512_set1_ps(KV_V2_SCALE(c->kfmt));
    const int kfp8 = c->kfmt == KV_FP8_E4M3 || c->kfmt == KV_FP8_E5M2;
    for (int hh = 0; hh < it->nheads; hh++) {
        const float *src = c->q + (qrow * c->n_heads + (int64_t)(it->head0 + hh) * G) * D;
        float *dst = ws->qf + (size_t)hh * G * D;
        for (int j = 0; j < G * D; j += 16) _mm512_storeu_ps(dst + j, _mm512_mul_ps(_mm512_loadu_ps(src + j), sc));
    }
    for (int r = 0; r < RT; r++) {
        ws->m[r] = -INFINITY;
        ws->l[r] = 0.0f;
    }
    memset(ws->o, 0, (size_t)RT * D * sizeof(float));
    const uint8_t *kr[16], *vr[16];
    for (int t0 = lo; t0 <= hi; t0 += 16) {
        const int nt = hi - t0 + 1 < 16 ? hi - t0 + 1 : 16;
        const __mmask16 valid = (__mmask16)((1u << nt) - 1u);
        for (int hh = 0; hh < it->nheads; hh++) {
            const int h = it->head0 + hh;
            for (int t = 0; t < nt;) { /* rows by page: one block-table lookup per page */
                int j = t0 + t, run = c->block_size - j % c->block_size;
                if (run > nt - t) run = nt - t;
                const uint8_t *kp = kv_row(c, c->kpool, c->krow, s, h, j), *vp = kv_row(c, c->vpool, c->vrow, s, h, j);
                for (int u = 0; u < run; u++, t++) {
                    kr[t] = kp + (int64_t)u * c->krow;
                    vr[t] = vp + (int64_t)u * c->vrow;
                }
            }
            for (int t = nt; t < 16; t++) { /* padding repeats a real row; its weight is 0 */
                kr[t] = kr[0];
                vr[t] = vr[0];
            }
            kv_v2_pf pk, pv; /* the rows two steps ahead (next heads of this chunk, then the next chunk) */
            pk.n = pv.n = 0;
            if (c->prefetch) {
                int ph = hh + 2, pt = t0;
                if (ph >= it->nheads) {
                    ph -= it->nheads;
                    pt += 16;
                }
                if (ph < it->nheads && pt <= hi) FN(v2_pf_set)(c, s, it->head0 + ph, pt, hi - pt + 1 < 16 ? hi - pt + 1 : 16, &pk, &pv);
            }
            if (kfp8) /* a NaN K value makes every score of the token NaN and with it the rows' outputs, as in
                       * float64: the rows are marked by l = NaN and o = NaN, which every later step keeps */
                for (int t = 0; t < nt; t++)
                    if (kv_v2_fp8_bad(kr[t], D, c->kfmt)) {
                        for (int r = hh * G; r < hh * G + G; r++) {
                            ws->l[r] = NAN;
                            for (int j = 0; j < D; j++) ws->o[(size_t)r * D + j] = NAN;
                        }
                        break;
                    }
            const float *qf = ws->qf + (size_t)hh * G * D;
            FN(v2_k16_any)(c->kfmt, NC, qf, G, kr, S, &pk);
            float *P = ws->s;
            for (int g = 0; g < G; g++) {
                const int r = hh * G + g;
                __m512 sv = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), valid, kv_v2_reduce16(S + (size_t)g * 256), ksc);
                const float mt = _mm512_reduce_max_ps(sv);
                if (mt > ws->m[r]) {
                    const float corr = ws->m[r] == -INFINITY ? 0.0f : exp2f(ws->m[r] - mt);
                    ws->l[r] *= corr;
                    float *o = ws->o + (size_t)r * D;
                    for (int j = 0; j < D; j += 16) _mm512_storeu_ps(o + j, _mm512_mul_ps(_mm512_loadu_ps(o + j), _mm512_set1_ps(corr)));
                    ws->m[r] = mt;
                }
                const __m512 p = kv_exp2_512(_mm512_sub_ps(sv, _mm512_set1_ps(ws->m[r]))); /* masked: exp2(-inf) = 0 */
                ws->l[r] += _mm512_reduce_add_ps(p);
                _mm512_storeu_ps(P + 16 * g, p);
            }
            if (G == 4 && NC % 4 == 0) {
                FN(v2_pv4_any)(c->vfmt, NC, vr, P, ws->o + (size_t)hh * G * D, D, nt, &pv);
                continue;
            }
            FN(v2_v16_any)(c->vfmt, NC, vr, VB, &pv);
            for (int g = 0; g < G; g++) FN(v2_pv)(ws->o + (size_t)(hh * G + g) * D, P + 16 * g, VB, nt, NC);
        }
    }
    for (int r = 0; r < RT; r++) { /* o holds V / KV_V2_SCALE(vfmt) weighted */
        const float *o = ws->o + (size_t)r * D;
        float *dst;
        const __m512 f = _mm512_set1_ps(kv_item_row_end(c, it, r, ws->m, ws->l, pm, pl, po, &dst) * KV_V2_SCALE(c->vfmt));
        for (int j = 0; j < D; j += 16) _mm512_storeu_ps(dst + j, _mm512_mul_ps(_mm512_loadu_ps(o + j), f));
    }
    return 1;
}
#define V2_DECODE_ITEM(c, it, ws, pm, pl, po) FN(v2_decode_item)(c, it, ws, pm, pl, po)
#endif
#undef KV_V2_VEC
#undef KV_V2_AVX2
