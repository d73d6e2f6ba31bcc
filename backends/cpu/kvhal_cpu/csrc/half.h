/* Portable fp16 conversions, IEEE round-to-nearest-even like numpy's astype(float16) and F16C. */
#ifndef KV_HALF_H
#define KV_HALF_H

#include <stdint.h>
#include <string.h>

#include "kvcpu.h"

static inline uint32_t kv_f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}
static inline float kv_bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t kv_f32_to_f16_sw(float f) {
    uint32_t x = kv_f32_bits(f);
    uint32_t sign = (x >> 16) & 0x8000u;
    uint32_t ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) return (uint16_t)(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u : 0u));
    if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* rounds to inf */
    if (ax < 0x38800000u) {
        /* f16 subnormal: the hardware add rounds |f| to a multiple of 2^-24 (RNE) in the low bits */
        float r = kv_bits_f32(ax) + 0.5f;
        return (uint16_t)(sign | (kv_f32_bits(r) - 0x3f000000u));
    }
    uint32_t odd = (ax >> 13) & 1u;
    ax += ((uint32_t)(15 - 127) << 23) + 0xfffu + odd;
    return (uint16_t)(sign | (ax >> 13));
}

static inline float kv_f16_to_f32_sw(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0) {
        float f = (float)m * 5.9604644775390625e-8f; /* m * 2^-24 */
        return sign ? -f : f;
    }
    if (e == 31) return kv_bits_f32(sign | 0x7f800000u | (m << 13));
    return kv_bits_f32(sign | ((e + 112u) << 23) | (m << 13));
}

static inline uint16_t kv_load_u16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}
static inline uint32_t kv_load_u32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

#endif
