/* K of kivi4 / kivi2 stored per channel over whole pages (kvhal/formats/kivi.py, the spec, bit for bit).
 *
 * The page of one KV head holds block_size rows of codes, then f16 d[D] and f16 m[D]: one scale and one
 * minimum per channel over the page's tokens (ggml's q4_1 rule along the channel). Codes are packed per
 * 32 values as the formats' V rows: value j + w*i in field i (bits*i .. bits*i + bits - 1) of byte j,
 * w = 32*bits/8 bytes (4 bits: ggml's q4_1 nibbles; 2 bits: 4 fields). A page is quantized once, when its
 * last token arrives (the cache keeps the open page in its f16 tail). Portable C (its loops vectorize): a
 * store runs once per page;
 * reading pages back (load, attention) is each ISA's kpage_rows (kern_template.h).
 */
#include <string.h>

#include "half.h"
#include "kvcpu.h"

static inline int kpage_bits(int fmt) { return fmt == KV_KIVI4 ? 4 : 2; }

int64_t kv_kpage_code_bytes(int fmt, int D) { return (int64_t)D * kpage_bits(fmt) / 8; }

/* ggml's id = d ? 1/d : 0, also 0 when 1/d overflows (kivi.py's _inverse) */
static inline float kpage_inverse(float d) {
    const float id = 1.0f / d;
    return (d == 0.0f || !isfinite(id)) ? 0.0f : id;
}

void kv_kpage_quantize(int fmt, const float *x, int64_t xstride, int bs, int D, uint8_t *page) {
    const int bits = kpage_bits(fmt), top = (1 << bits) - 1, w = 4 * bits; /* bytes per 32-value group */
    const int64_t cb = kv_kpage_code_bytes(fmt, D);
    uint8_t *scales = page + bs * cb;
    /* per 32-channel group, token-outer loops over its contiguous channels (the compiler vectorizes them):
     * min and max (the first occurrence wins ties, 0.0 against -0.0, as ggml), scales, then each row's
     * codes, value j + w*i of the group in field i of byte j */
    for (int e0 = 0; e0 < D; e0 += 32) {
        float lo[32], hi[32], id[32];
        uint8_t q[32];
        memcpy(lo, x + e0, sizeof lo);
        memcpy(hi, x + e0, sizeof hi);
        for (int u = 1; u < bs; u++) {
            const float *r = x + u * xstride + e0;
            for (int e = 0; e < 32; e++) {
                lo[e] = r[e] < lo[e] ? r[e] : lo[e];
                hi[e] = r[e] > hi[e] ? r[e] : hi[e];
            }
        }
        for (int e = 0; e < 32; e++) {
            const float d = (hi[e] - lo[e]) / (float)top;
            id[e] = kpage_inverse(d);
            const uint16_t dh = kv_f32_to_f16_sw(d), mh = kv_f32_to_f16_sw(lo[e]);
            memcpy(scales + 2 * (e0 + e), &dh, 2);
            memcpy(scales + 2 * D + 2 * (e0 + e), &mh, 2);
        }
        for (int u = 0; u < bs; u++) {
            const float *r = x + u * xstride + e0;
            for (int e = 0; e < 32; e++) {
                /* truncf as the spec: the argument is >= 0 and at most top + 1/2, so the int conversion agrees */
                const int c = (int)((r[e] - lo[e]) * id[e] + 0.5f);
                q[e] = (uint8_t)(c > top ? top : c);
            }
            uint8_t *out = page + u * cb + e0 / 32 * w;
            for (int j = 0; j < w; j++) {
                uint8_t b = 0;
                for (int f = 0; f < 32 / w; f++) b |= (uint8_t)(q[j + w * f] << (bits * f));
                out[j] = b;
            }
        }
    }
}
