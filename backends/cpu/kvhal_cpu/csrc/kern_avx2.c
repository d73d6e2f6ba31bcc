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

#include "kern_template.h"

#if defined(__clang__)
#pragma clang attribute pop
#endif
#endif
