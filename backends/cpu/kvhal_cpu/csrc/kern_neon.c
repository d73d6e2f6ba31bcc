/* AArch64 Advanced SIMD kernels: the shared template on 4-wide f32 with hardware fp16 conversion. */
#if defined(__aarch64__)
#include <arm_neon.h>
#include <math.h>

#include "half.h"

#define FN(x) x##_neon
#define ISA_NAME "neon"

typedef float32x4_t VF;
#define VL 4
#define vload vld1q_f32
#define vstore vst1q_f32
#define vset1 vdupq_n_f32
#define vzero() vdupq_n_f32(0.0f)
#define vadd vaddq_f32
#define vsub vsubq_f32
#define vmul vmulq_f32
#define vfma(a, b, c) vfmaq_f32((c), (a), (b))
#define vmax vmaxq_f32
#define vhsum vaddvq_f32
#define vhmax vmaxvq_f32
#define vexp2 kv_exp2_neon

static inline float32x4_t kv_exp2_mla(float32x4_t acc, float32x4_t f, float32x4_t c) { return vfmaq_f32(c, acc, f); }

/* 2^x for x <= 0; x < -126 (and -inf) give exactly 0, NaN gives NaN (FMAX keeps a NaN; as kv_exp2_256) */
static inline float32x4_t kv_exp2_neon(float32x4_t x) {
    float32x4_t lim = vdupq_n_f32(-126.0f);
    uint32x4_t live = vmvnq_u32(vcltq_f32(x, lim));
    x = vmaxq_f32(x, lim);
    float32x4_t n = vrndnq_f32(x);
    float32x4_t f = vsubq_f32(x, n);
    float32x4_t p = vdupq_n_f32(1.525273380405984e-05f);
    p = kv_exp2_mla(p, f, vdupq_n_f32(1.5403530393381606e-04f));
    p = kv_exp2_mla(p, f, vdupq_n_f32(1.3333558146428443e-03f));
    p = kv_exp2_mla(p, f, vdupq_n_f32(9.618129107628477e-03f));
    p = kv_exp2_mla(p, f, vdupq_n_f32(5.550410866482158e-02f));
    p = kv_exp2_mla(p, f, vdupq_n_f32(2.402265069591007e-01f));
    p = kv_exp2_mla(p, f, vdupq_n_f32(6.931471805599453e-01f));
    p = kv_exp2_mla(p, f, vdupq_n_f32(1.0f));
    int32x4_t e = vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127)), 23);
    float32x4_t r = vmulq_f32(p, vreinterpretq_f32_s32(e));
    return vreinterpretq_f32_u32(vandq_u32(vreinterpretq_u32_f32(r), live));
}

static inline void kv_f16_to_f32_row_neon(const uint8_t *src, float *dst, int n) {
    int i = 0;
    for (; i + 4 <= n; i += 4) vst1q_f32(dst + i, vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16((const uint16_t *)(const void *)(src + 2 * i)))));
    for (; i < n; i++) dst[i] = kv_f16_to_f32_sw(kv_load_u16(src + 2 * i));
}

static inline void kv_f32_to_f16_row_neon(const float *src, uint8_t *dst, int n) {
    int i = 0;
    /* FCVTN rounds with FPCR's mode, round-to-nearest-even unless someone changed it */
    for (; i + 4 <= n; i += 4) vst1_u16((uint16_t *)(void *)(dst + 2 * i), vreinterpret_u16_f16(vcvt_f16_f32(vld1q_f32(src + i))));
    for (; i < n; i++) {
        uint16_t h = kv_f32_to_f16_sw(src[i]);
        memcpy(dst + 2 * i, &h, 2);
    }
}

#define F16_TO_F32(src, dst, n) kv_f16_to_f32_row_neon(src, dst, n)
#define F32_TO_F16(src, dst, n) kv_f32_to_f16_row_neon(src, dst, n)
#define F32_TO_F16_1(x) kv_f32_to_f16_sw(x)

#include "kern_template.h"
#endif
