/* Baseline kernels: portable C, no ISA extensions beyond the compiler's default target. */
#include <math.h>

#include "half.h"

#define FN(x) x##_scalar
#define ISA_NAME "scalar"

typedef float VF;
#define VL 1
#define vload(p) (*(p))
#define vstore(p, x) (*(p) = (x))
#define vset1(x) (x)
#define vzero() 0.0f
#define vadd(a, b) ((a) + (b))
#define vsub(a, b) ((a) - (b))
#define vmul(a, b) ((a) * (b))
#define vfma(a, b, c) ((a) * (b) + (c))
#define vmax(a, b) ((a) > (b) ? (a) : (b))
#define vhsum(x) (x)
#define vhmax(x) (x)
#define vexp2(x) exp2f(x)

static inline void f16_to_f32_row(const uint8_t *src, float *dst, int n) {
    for (int i = 0; i < n; i++) dst[i] = kv_f16_to_f32_sw(kv_load_u16(src + 2 * i));
}
static inline void f32_to_f16_row(const float *src, uint8_t *dst, int n) {
    for (int i = 0; i < n; i++) {
        uint16_t h = kv_f32_to_f16_sw(src[i]);
        memcpy(dst + 2 * i, &h, 2);
    }
}
#define F16_TO_F32(src, dst, n) f16_to_f32_row(src, dst, n)
#define F32_TO_F16(src, dst, n) f32_to_f16_row(src, dst, n)
#define F32_TO_F16_1(x) kv_f32_to_f16_sw(x)

#include "kern_template.h"
