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

/* q8_0 / q4_0 rows to f32, 8 lanes at a time (the same d*q and d*(n-8) as the template's loops) */
static int dequant_row_avx2(int fmt, const uint8_t *y, float *dst, int d) {
    if (fmt != KV_Q8_0 && fmt != KV_Q4_0) return 0;
    for (int b = 0; b < d / KV_QK; b++, dst += KV_QK) {
        __m256 s = _mm256_set1_ps(_cvtsh_ss(kv_load_u16(y)));
        if (fmt == KV_Q8_0) {
            for (int i = 0; i < 4; i++) {
                __m128i q = _mm_loadl_epi64((const __m128i *)(const void *)(y + 2 + 8 * i));
                _mm256_storeu_ps(dst + 8 * i, _mm256_mul_ps(s, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q))));
            }
            y += KV_Q8_0_BYTES;
        } else {
            const __m256 eight = _mm256_set1_ps(8.0f);
            const __m256i m4 = _mm256_set1_epi32(15);
            for (int i = 0; i < 2; i++) {
                __m256i n = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(const void *)(y + 2 + 8 * i)));
                __m256 lo = _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_and_si256(n, m4)), eight);
                __m256 hi = _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(n, 4)), eight);
                _mm256_storeu_ps(dst + 8 * i, _mm256_mul_ps(s, lo));
                _mm256_storeu_ps(dst + 16 + 8 * i, _mm256_mul_ps(s, hi));
            }
            y += KV_Q4_0_BYTES;
        }
    }
    return 1;
}
#define DEQUANT_ROW_OVERRIDE(fmt, src, dst, d) dequant_row_avx2(fmt, src, dst, d)

#include "kern_template.h"

#if defined(__clang__)
#pragma clang attribute pop
#endif
#endif
