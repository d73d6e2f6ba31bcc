/* AVX-512 (F, BW, VL, DQ) + VNNI kernels: Ice Lake / Sapphire Rapids / Zen 4 and later.
 *
 * Float formats run the shared template on 16-wide f32. Quantized formats run integer kernels
 * (kern_avx512_int.h): q is quantized to 16 bits per row and K.q is done with VPDPBUSD on the stored
 * nibbles/bytes, P.V with VPDPWSSD on 16-bit weights, so no f32 copy of K or V is ever made. */
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#include <math.h>

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni"))), apply_to = function)
#else
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")
#endif

#include "half.h"

#define FN(x) x##_avx512
#define ISA_NAME "avx512"

#include "simd_avx2.h"

typedef __m512 VF;
#define VL 16
#define vload _mm512_loadu_ps
#define vstore _mm512_storeu_ps
#define vset1 _mm512_set1_ps
#define vzero _mm512_setzero_ps
#define vadd _mm512_add_ps
#define vsub _mm512_sub_ps
#define vmul _mm512_mul_ps
#define vfma _mm512_fmadd_ps
#define vmax _mm512_max_ps
#define vhsum _mm512_reduce_add_ps
#define vhmax _mm512_reduce_max_ps
#define vexp2 kv_exp2_512

/* 2^x for x <= 0; x < -126 (and -inf) give exactly 0 */
static inline __m512 kv_exp2_512(__m512 x) {
    __m512 lim = _mm512_set1_ps(-126.0f);
    __mmask16 live = _mm512_cmp_ps_mask(x, lim, _CMP_GE_OQ);
    x = _mm512_max_ps(x, lim);
    __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(x, n);
    __m512 p = KV_EXP2_POLY(f, _mm512_fmadd_ps, _mm512_set1_ps);
    return _mm512_maskz_scalef_ps(live, p, n);
}

#define F16_TO_F32(src, dst, n) kv_f16_to_f32_row_f16c(src, dst, n)
#define F32_TO_F16(src, dst, n) kv_f32_to_f16_row_f16c(src, dst, n)
#define F32_TO_F16_1(x) ((uint16_t)_cvtss_sh((x), _MM_FROUND_TO_NEAREST_INT))

#include "kern_avx512_int.h"
#include "kern_template.h"

#if defined(__clang__)
#pragma clang attribute pop
#endif
#endif
