/* K of kivi4 / kivi2 stored per channel over whole pages (kvhal/formats/kivi.py, the spec, bit for bit).
 *
 * The page of one KV head holds block_size rows of codes, then f16 d[D] and f16 m[D]: one scale and one
 * minimum per channel over the page's tokens (ggml's q4_1 rule along the channel). Codes are packed per
 * 32 values as the formats' V rows: value j + w*i in field i (bits*i .. bits*i + bits - 1) of byte j,
 * w = 32*bits/8 bytes (4 bits: ggml's q4_1 nibbles; 2 bits: 4 fields). A page is quantized once, when its
 * last token arrives (the cache keeps the open page in its f16 tail). Portable C: a store runs once per page;
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
    memset(page, 0, (size_t)(bs * cb));
    for (int e = 0; e < D; e++) {
        float lo = x[e], hi = x[e]; /* the first occurrence wins ties (0.0 against -0.0), as ggml */
        for (int u = 1; u < bs; u++) {
            const float v = x[u * xstride + e];
            if (v < lo) lo = v;
            if (v > hi) hi = v;
        }
        const float d = (hi - lo) / (float)top, id = kpage_inverse(d);
        const uint16_t dh = kv_f32_to_f16_sw(d), mh = kv_f32_to_f16_sw(lo);
        memcpy(scales + 2 * e, &dh, 2);
        memcpy(scales + 2 * D + 2 * e, &mh, 2);
        const int byte = (e >> 5) * w + (e & 31) % w, shift = bits * ((e & 31) / w);
        for (int u = 0; u < bs; u++) {
            float q = truncf((x[u * xstride + e] - lo) * id + 0.5f);
            if (q > (float)top) q = (float)top;
            page[u * cb + byte] |= (uint8_t)((int)q << shift);
        }
    }
}
