/* f32 rows -> f16 / bf16 for kvc_load_to (api.c): the narrowing step of a load into a caller's f16/bf16 output.
 * Round to nearest even like numpy's astype(float16) / ml_dtypes' bfloat16 and torch's .to(bfloat16); NaN stays
 * a quiet NaN of the same sign. One portable version and, where the CPU has them, AVX-512 and F16C ones (each a
 * function with its own target attribute, so this file builds with the baseline flags). */
#include <stdint.h>
#include <string.h>

#include "half.h"
#include "kvcpu.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

enum { KV_OUT_F32 = 0, KV_OUT_F16 = 1, KV_OUT_BF16 = 2 };

static inline uint16_t kv_f32_to_bf16_sw(float f) {
    uint32_t x = kv_f32_bits(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40u); /* NaN: quiet, sign kept */
    return (uint16_t)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

static void cvt_sw(int dtype, const float *src, uint16_t *dst, int n) {
    if (dtype == KV_OUT_BF16)
        for (int i = 0; i < n; i++) dst[i] = kv_f32_to_bf16_sw(src[i]);
    else
        for (int i = 0; i < n; i++) dst[i] = kv_f32_to_f16_sw(src[i]);
}

#if (defined(__x86_64__) || defined(_M_X64)) && defined(__GNUC__)
__attribute__((target("avx512f,avx512bw,avx512vl"))) static void cvt_avx512(int dtype, const float *src, uint16_t *dst,
                                                                             int n) {
    int i = 0;
    if (dtype == KV_OUT_BF16) {
        const __m512i one = _mm512_set1_epi32(1), bias = _mm512_set1_epi32(0x7fff), qnan = _mm512_set1_epi32(0x40);
        const __m512i abs = _mm512_set1_epi32(0x7fffffff), inf = _mm512_set1_epi32(0x7f800000);
        for (; i + 16 <= n; i += 16) {
            const __m512i x = _mm512_loadu_si512((const void *)(src + i));
            const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(x, abs), inf);
            const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(x, 16), one);
            __m512i r = _mm512_srli_epi32(_mm512_add_epi32(x, _mm512_add_epi32(bias, lsb)), 16);
            r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(x, 16), qnan);
            _mm256_storeu_si256((__m256i *)(void *)(dst + i), _mm512_cvtepi32_epi16(r));
        }
    } else {
        for (; i + 16 <= n; i += 16)
            _mm256_storeu_si256((__m256i *)(void *)(dst + i),
                                _mm512_cvtps_ph(_mm512_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
    cvt_sw(dtype, src + i, dst + i, n - i);
}

__attribute__((target("avx2,f16c"))) static void cvt_f16c(const float *src, uint16_t *dst, int n) {
    int i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(void *)(dst + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
    cvt_sw(KV_OUT_F16, src + i, dst + i, n - i);
}
#endif

#if (defined(__x86_64__) || defined(_M_X64)) && defined(__GNUC__)
#define KV_T512 __attribute__((target("avx512f,avx512bw,avx512vl,f16c")))

/* 16 f32 values to dst + i as dtype */
KV_T512 static inline void put16(__m512 x, void *dst, int i, int dtype) {
    if (dtype == KV_OUT_F32) {
        _mm512_storeu_ps((float *)dst + i, x);
    } else if (dtype == KV_OUT_F16) {
        _mm256_storeu_si256((__m256i *)(void *)((uint16_t *)dst + i), _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    } else {
        const __m512i u = _mm512_castps_si512(x);
        const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
        const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
        __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb)), 16);
        r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
        _mm256_storeu_si256((__m256i *)(void *)((uint16_t *)dst + i), _mm512_cvtepi32_epi16(r));
    }
}

/* one stored row of the ggml formats straight to dtype, with the same operations as the kernels' dequantization
 * (d*(n-o), d*n + m, no FMA: bit-exact with it); 0 for a format or head_dim it leaves to the generic path */
KV_T512 static int row_avx512(int fmt, const uint8_t *y, void *dst, int dtype, int d) {
    if (d % KV_QK) return 0;
    if (fmt == KV_F32 || fmt == KV_F16 || fmt == KV_BF16) {
        for (int i = 0; i < d; i += 16) {
            __m512 x;
            if (fmt == KV_F32) x = _mm512_loadu_ps((const float *)(const void *)y + i);
            else if (fmt == KV_F16) x = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(const void *)(y + 2 * i)));
            else x = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(const void *)(y + 2 * i))), 16));
            put16(x, dst, i, dtype);
        }
        return 1;
    }
    if (!kv_is_quant(fmt)) return 0;
    const int bb = kv_block_bytes[fmt];
    const int has_min = fmt == KV_Q4_1 || fmt == KV_Q5_1, has_qh = fmt == KV_Q5_0 || fmt == KV_Q5_1;
    const int qs = fmt == KV_Q4_0 ? 2 : fmt == KV_Q5_0 ? 6 : fmt == KV_Q4_1 ? 4 : 8;
    for (int b = 0, i = 0; b < d / KV_QK; b++, i += KV_QK, y += bb) {
        const __m512 s = _mm512_set1_ps(_cvtsh_ss(kv_load_u16(y)));
        if (fmt == KV_Q8_0) {
            __m256i q = _mm256_loadu_si256((const __m256i *)(const void *)(y + 2));
            put16(_mm512_mul_ps(s, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q)))), dst, i, dtype);
            put16(_mm512_mul_ps(s, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1)))), dst, i + 16, dtype);
            continue;
        }
        const uint32_t qh = has_qh ? kv_load_u32(y + (has_min ? 4 : 2)) : 0;
        const __m512i n = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(const void *)(y + qs)));
        for (int hi = 0; hi < 2; hi++) {
            __m512i v = hi ? _mm512_srli_epi32(n, 4) : _mm512_and_si512(n, _mm512_set1_epi32(15));
            if (has_qh) v = _mm512_or_si512(v, _mm512_maskz_mov_epi32((__mmask16)(hi ? qh >> 16 : qh), _mm512_set1_epi32(16)));
            const __m512 x = _mm512_cvtepi32_ps(v);
            const __m512 r = has_min ? _mm512_add_ps(_mm512_mul_ps(s, x), _mm512_set1_ps(_cvtsh_ss(kv_load_u16(y + 2))))
                                     : _mm512_mul_ps(s, _mm512_sub_ps(x, _mm512_set1_ps(has_qh ? 16.0f : 8.0f)));
            put16(r, dst, i + 16 * hi, dtype);
        }
    }
    return 1;
}
#endif

/* one stored row of fmt (d values) to dst as dtype (0 f32, 1 f16, 2 bf16) in one pass where `isa` has a fused
 * kernel for fmt; 0 otherwise (the caller dequantizes and narrows) */
int kv_load_row(int isa, int fmt, const uint8_t *src, void *dst, int dtype, int d) {
#if (defined(__x86_64__) || defined(_M_X64)) && defined(__GNUC__)
    if (isa == KV_ISA_AVX512 || isa == KV_ISA_AMX) return row_avx512(fmt, src, dst, dtype, d);
#else
    (void)isa, (void)fmt, (void)src, (void)dst, (void)dtype, (void)d;
#endif
    return 0;
}

/* n f32 values -> dst as dtype (KV_OUT_F16 or KV_OUT_BF16), with the kernels of `isa` (an ISA this CPU runs) */
void kv_cvt_row(int isa, int dtype, const float *src, uint16_t *dst, int n) {
#if (defined(__x86_64__) || defined(_M_X64)) && defined(__GNUC__)
    if (isa == KV_ISA_AVX512 || isa == KV_ISA_AMX) {
        cvt_avx512(dtype, src, dst, n);
        return;
    }
    if (isa == KV_ISA_AVX2 && dtype == KV_OUT_F16) { /* the avx2 ISA requires F16C (api.c's probe) */
        cvt_f16c(src, dst, n);
        return;
    }
#else
    (void)isa;
#endif
    cvt_sw(dtype, src, dst, n);
}

#if (defined(__x86_64__) || defined(_M_X64)) && defined(__GNUC__)
__attribute__((target("avx512f"))) static void stream_avx512(uint8_t *dst, const uint8_t *src, size_t n) {
    size_t head = (size_t)(-(uintptr_t)dst & 63);
    if (head > n) head = n;
    memcpy(dst, src, head);
    size_t i = head;
    for (; i + 64 <= n; i += 64) _mm512_stream_si512((void *)(dst + i), _mm512_loadu_si512((const void *)(src + i)));
    memcpy(dst + i, src + i, n - i);
}
#endif

/* n bytes to dst; stream: with non-temporal stores where the ISA has them (an output much larger than the caches
 * then costs no read-for-ownership of its lines), fenced by kv_out_fence before the task ends */
void kv_out_copy(int isa, void *dst, const void *src, size_t n, int stream) {
#if (defined(__x86_64__) || defined(_M_X64)) && defined(__GNUC__)
    if (stream && (isa == KV_ISA_AVX512 || isa == KV_ISA_AMX)) {
        stream_avx512((uint8_t *)dst, (const uint8_t *)src, n);
        return;
    }
#else
    (void)isa;
    (void)stream;
#endif
    memcpy(dst, src, n);
}

void kv_out_fence(void) {
#if (defined(__x86_64__) || defined(_M_X64)) && defined(__GNUC__)
    _mm_sfence();
#endif
}
