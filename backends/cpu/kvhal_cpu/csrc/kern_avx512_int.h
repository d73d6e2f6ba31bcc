/* Integer attention kernels for the quantized formats (AVX-512 VL + VNNI), included by kern_avx512.c.
 *
 * K.q: each query row (already scaled by softmax scale * log2 e) is quantized to 16 bits with one
 * scale per row, split into a signed high byte and a signed low byte, qi = 256*qh + ql. Stored K
 * values are made unsigned (q8_0: k^0x80 = k+128; nibbles as they are) and VPDPBUSD runs on 16
 * tokens at once: 16 K rows of one 32-value block are transposed by dwords so each lane is one
 * token, and the 4-byte groups of qh/ql are broadcast. The offset (128, 8 or 16 times sum qi) is an integer
 * constant per row and block, so the block sum is exact in int32 until it meets the fp16 scales.
 *
 * P.V: p*d_v for each row, block and token of the tile is quantized to int16 with one scale per row
 * and block (per tile), two tokens are interleaved per 32-bit lane and VPDPWSSD accumulates them in
 * int32; the tile's sum is scaled back to f32 into the output accumulator.
 *
 * Both quantizations keep ~1e-4 of the f32 result (attention_tolerance). No f32 copy of K or V is made.
 * Decode with 4 query rows per KV head (GQA 4) has fused kernels that keep a K block of 16 tokens
 * and the V pair vectors in registers; other row counts stage them in L1 (kt, vx).
 */

#define INT_PATH_K(fmt) ((fmt) >= KV_Q8_0 && (fmt) <= KV_Q5_1) /* the ggml formats; kern_v2.h's take the f32 path
                                                                 (mxfp4/nvfp4 decode: kern_avx512_decode.h) */
#define INT_PATH_V(fmt) ((fmt) >= KV_Q8_0 && (fmt) <= KV_Q5_1)

#define QI_MAX 32512.0f /* 127*256: qh and ql then both fit int8 */

/* acc += dot4(a, broadcast *m) in place. The intrinsics make GCC copy every accumulator around each
 * VNNI op inside loops; the asm keeps the accumulator in its register and broadcasts from memory. */
#define VNNI_BCAST(op, acc, a, m) __asm__(op " %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(a), "m"(m))
#define DPBUSD_B(acc, a, m) VNNI_BCAST("vpdpbusd", acc, a, m)
#define DPWSSD_B(acc, a, m) VNNI_BCAST("vpdpwssd", acc, a, m)
/* the same ops with the broadcast already in a register */
#define INT_DPB(acc, a, b) __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b))
#define INT_DPW(acc, a, b) __asm__("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b))

/* int_scales_d128's word indices are written for ggml's 34-byte q8_0 and 18-byte q4_0 blocks */
_Static_assert(KV_Q8_0_BYTES == 34 && KV_Q4_0_BYTES == 18, "the scale permutes assume ggml's q8_0 and q4_0 blocks");

typedef struct {
    int32_t *qh, *ql; /* [R][nb][8] 4-byte groups */
    int32_t *qoff;    /* [R][nb]: -offset * sum qi */
    int32_t *qoffs;   /* [R][2 nb]: the same per 16-value half block (nvfp4's sub-blocks, decode path) */
    float *qsum;      /* [R][nb]: dq * sum qi over the block (min term of q4_1/q5_1) */
    float *dq;        /* [R] */
    float *kd, *km, *vd, *vm; /* [nb][KV_T] per-token block scales and mins (kd, vd: [2 nb], nvfp4) */
    int16_t *w;               /* [R][nb][KV_T] quantized p*d_v ([2 nb]: nvfp4 in the decode path) */
    float *wc;                /* [R][nb] weight scales ([2 nb]) */
    int32_t *wsum;            /* [R][nb] sum of quantized weights ([2 nb]) */
    uint8_t *u8;              /* [KV_T][D] unpacked values (q4_1, q5_0, q5_1) */
    __m512i *kt;              /* [nb][8] K of 16 tokens, transposed: lane = token, vector = 4-byte group */
    __m512i *vx;              /* [KV_T/2][2] V of one block, token pairs interleaved as int16 */
    float *vsum;              /* [R][nb] sum of p * (m + 8d) over the tile (q4_1 V, decode path) */
    int32_t *pqh, *pql;       /* [KV_T/16][R][nb][8] q times a page's per-channel d (kivi K, decode path) */
    int32_t *pqx;             /* [KV_T/16][R][nb][8] its third byte (kivi2: 24 bits) */
    float *pdq, *pc;          /* [KV_T/16][R][nb] their scales, [KV_T/16][R] the min terms sum q*m */
    float *pks, *pqm;         /* [R][D] q scaled to the integer range per block, [R][nb] the scales (kivi K) */
} int_ws;

static size_t int_layout(const kv_call *c, int R, uint8_t *base, int_ws *L) {
    const size_t nb = (size_t)c->head_dim / KV_QK, r = (size_t)R;
    size_t off = 0;
#define TAKE(field, type, count) KV_WS_TAKE(L, base, off, field, type, count)
    TAKE(qh, int32_t, r * nb * 8);
    TAKE(ql, int32_t, r * nb * 8);
    TAKE(qoff, int32_t, r * nb);
    TAKE(qoffs, int32_t, r * 2 * nb);
    TAKE(qsum, float, r * nb);
    TAKE(dq, float, r);
    TAKE(kd, float, 2 * nb * KV_T);
    TAKE(km, float, nb * KV_T);
    TAKE(vd, float, 2 * nb * KV_T);
    TAKE(vm, float, nb * KV_T);
    TAKE(w, int16_t, r * 2 * nb * KV_T);
    TAKE(wc, float, r * 2 * nb);
    TAKE(wsum, int32_t, r * 2 * nb);
    TAKE(u8, uint8_t, (size_t)KV_T * c->head_dim);
    TAKE(kt, __m512i, nb * 8);
    TAKE(vx, __m512i, KV_T);
    TAKE(vsum, float, r * nb);
    const size_t pages = c->kpaged ? KV_T / 16 : 0; /* a decode tile's 16-row groups: at most one page each */
    TAKE(pqh, int32_t, pages * r * nb * 8);
    TAKE(pql, int32_t, pages * r * nb * 8);
    TAKE(pqx, int32_t, pages * r * nb * 8);
    TAKE(pdq, float, pages * r * nb);
    TAKE(pc, float, pages * r);
    TAKE(pks, float, pages ? r * c->head_dim : 0);
    TAKE(pqm, float, pages ? r * nb : 0);
#undef TAKE
    return off;
}

static size_t int_extra_bytes(const kv_call *c, int R) {
    if (c->head_dim % KV_QK) return 0;
    return int_layout(c, R, NULL, NULL);
}
#define INT_EXTRA_BYTES(c, R) int_extra_bytes(c, R)

static inline int_ws int_get(const kv_call *c, kv_scratch *ws, int R) {
    int_ws L;
    int_layout(c, R, (uint8_t *)ws->extra, &L);
    return L;
}

/* offset subtracted from the stored unsigned values: q8_0 is made unsigned by +128, q4_0/q5_0 are
 * stored with +8/+16, and q4_1/q5_1 are centred the same way (d*n + m = d*(n-8) + (m + 8d)) so the
 * integer sums stay as small as the _0 formats' and keep their relative precision */
static inline int int_koff(int fmt) {
    return fmt == KV_Q8_0 ? 128 : (fmt == KV_Q4_0 || fmt == KV_Q4_1) ? 8 : (fmt == KV_Q5_0 || fmt == KV_Q5_1) ? 16
         : (fmt == KV_MXFP4 || fmt == KV_NVFP4) ? 12 /* doubled e2m1 values -12..12, +12 (decode path) */
                                                 : 0;
}
static inline int int_has_min(int fmt) { return fmt == KV_Q4_1 || fmt == KV_Q5_1; }

static void int_prep_q(const kv_call *c, kv_scratch *ws, int R) {
    const int D = c->head_dim, nb = D / KV_QK, koff = int_koff(c->kfmt);
    int_ws L = int_get(c, ws, R);
    const __m512 sign = _mm512_set1_ps(-0.0f);
    for (int r = 0; r < R; r++) {
        const float *x = ws->qf + (size_t)r * D;
        __m512 mx = _mm512_setzero_ps();
        __mmask16 nan = 0; /* maxps keeps one operand and may drop a NaN: a NaN or inf q makes the row's dq NaN */
        for (int i = 0; i < D; i += 16) {
            const __m512 v = _mm512_loadu_ps(x + i);
            nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            mx = _mm512_max_ps(mx, _mm512_andnot_ps(sign, v));
        }
        float amax = _mm512_reduce_max_ps(mx);
        if (nan || amax > FLT_MAX) amax = NAN;
        float inv = amax > 0.0f && amax <= FLT_MAX ? QI_MAX / amax : 0.0f;
        L.dq[r] = amax / QI_MAX;
        __m512 vinv = _mm512_set1_ps(inv);
        for (int b = 0; b < nb; b++) {
            __m512i sum = _mm512_setzero_si512();
            for (int half = 0; half < 2; half++) {
                __m512 v = _mm512_loadu_ps(x + 32 * b + 16 * half);
                __m512i qi = _mm512_cvtps_epi32(_mm512_mul_ps(v, vinv));
                __m512i lo = _mm512_srai_epi32(_mm512_slli_epi32(qi, 24), 24);
                __m512i hi = _mm512_srai_epi32(_mm512_sub_epi32(qi, lo), 8);
                _mm_storeu_si128((__m128i *)(void *)((uint8_t *)(L.ql + ((size_t)r * nb + b) * 8) + 16 * half),
                                 _mm512_cvtepi32_epi8(lo));
                _mm_storeu_si128((__m128i *)(void *)((uint8_t *)(L.qh + ((size_t)r * nb + b) * 8) + 16 * half),
                                 _mm512_cvtepi32_epi8(hi));
                sum = _mm512_add_epi32(sum, qi);
            }
            int32_t qs = _mm512_reduce_add_epi32(sum);
            L.qoff[r * nb + b] = -koff * qs;
            /* the min term takes the same quantized q as the integer part: d*n + m then cancels exactly
             * instead of magnifying q's rounding when a block is skewed (an outlier channel) */
            L.qsum[r * nb + b] = (float)qs * L.dq[r];
        }
    }
}
#define INT_PREP_Q(c, ws, R) int_prep_q(c, ws, R)

/* fp16 fields at byte offset `off` of every block of every tile row, as f32 [nb][KV_T]: one 8-row
 * gather per block (scalar loads into a staging array would stall on store-to-load forwarding) */
static void int_scales_gather(const uint8_t *const *rows, int nb, int bb, int off, float *dst) {
    const __m512i base = _mm512_set1_epi64((int64_t)(intptr_t)rows[0]);
    for (int t0 = 0; t0 < KV_T; t0 += 8) {
        __m512i idx = _mm512_sub_epi64(_mm512_loadu_si512((const void *)(rows + t0)), base);
        for (int b = 0; b < nb; b++) {
            __m256i w = _mm512_i64gather_epi32(idx, (const void *)(rows[0] + off + (size_t)b * bb), 1);
            _mm256_storeu_ps(dst + b * KV_T + t0, _mm256_cvtph_ps(_mm256_cvtepi32_epi16(w)));
        }
    }
}

/* head_dim 128 (4 blocks) of q8_0 / q4_0: the scales sit in the first 128 bytes of a row, so two
 * masked word permutes of the row (already in L1 for the dot products) place them, cheaper than gathers */
static void int_scales_d128(int fmt, const uint8_t *const *rows, float *dst) {
    /* word index of each block's scale within the 64-byte window it lies in */
    const int w0 = 0, w1 = fmt == KV_Q8_0 ? 17 : 9, w2 = fmt == KV_Q8_0 ? 2 : 18, w3 = fmt == KV_Q8_0 ? 19 : 27;
    const __m512i lo16 = _mm512_set_epi16(w1, w1, w1, w1, w1, w1, w1, w1, w1, w1, w1, w1, w1, w1, w1, w1, w0, w0, w0,
                                          w0, w0, w0, w0, w0, w0, w0, w0, w0, w0, w0, w0, w0);
    const __m512i hi16 = _mm512_set_epi16(w3, w3, w3, w3, w3, w3, w3, w3, w3, w3, w3, w3, w3, w3, w3, w3, w2, w2, w2,
                                          w2, w2, w2, w2, w2, w2, w2, w2, w2, w2, w2, w2, w2);
    const int second = fmt == KV_Q8_0 ? 64 : 0; /* q4_0's four scales are all in the first window */
    for (int g = 0; g < KV_T / 16; g++) {
        /* zero-masked permutes ORed in four independent chains (a merge-masked chain is latency bound) */
        __m512i a[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512()};
        __m512i b[4] = {a[0], a[0], a[0], a[0]};
        for (int t = 0; t < 16; t++) {
            const uint8_t *p = rows[16 * g + t];
            __mmask32 m = (__mmask32)((1u << t) | (1u << (16 + t)));
            a[t & 3] = _mm512_or_si512(a[t & 3], _mm512_maskz_permutexvar_epi16(m, lo16, _mm512_loadu_si512((const void *)p)));
            b[t & 3] = _mm512_or_si512(
                b[t & 3], _mm512_maskz_permutexvar_epi16(m, hi16, _mm512_loadu_si512((const void *)(p + second))));
        }
        __m512i a01 = _mm512_or_si512(_mm512_or_si512(a[0], a[1]), _mm512_or_si512(a[2], a[3]));
        __m512i a23 = _mm512_or_si512(_mm512_or_si512(b[0], b[1]), _mm512_or_si512(b[2], b[3]));
        _mm512_storeu_ps(dst + 0 * KV_T + 16 * g, _mm512_cvtph_ps(_mm512_castsi512_si256(a01)));
        _mm512_storeu_ps(dst + 1 * KV_T + 16 * g, _mm512_cvtph_ps(_mm512_extracti64x4_epi64(a01, 1)));
        _mm512_storeu_ps(dst + 2 * KV_T + 16 * g, _mm512_cvtph_ps(_mm512_castsi512_si256(a23)));
        _mm512_storeu_ps(dst + 3 * KV_T + 16 * g, _mm512_cvtph_ps(_mm512_extracti64x4_epi64(a23, 1)));
    }
}

/* fp16 field at byte offset `off` of every block of every tile row, as f32 [nb][KV_T] */
static void int_scales(const uint8_t *const *rows, int nb, int bb, int off, float *dst) {
    if (off == 0 && nb == 4 && (bb == KV_Q8_0_BYTES || bb == KV_Q4_0_BYTES)) {
        int_scales_d128(bb == KV_Q8_0_BYTES ? KV_Q8_0 : KV_Q4_0, rows, dst);
        return;
    }
    int_scales_gather(rows, nb, bb, off, dst);
}

/* mins of q4_1/q5_1 moved to the centred values: m + off*d */
static void int_centre_min(const uint8_t *const *rows, int nb, int bb, int off, const float *d,
                           float *m) {
    int_scales(rows, nb, bb, 2, m);
    const __m512 o = _mm512_set1_ps((float)off);
    for (int i = 0; i < nb * KV_T; i += 16)
        _mm512_storeu_ps(m + i, _mm512_fmadd_ps(_mm512_loadu_ps(d + i), o, _mm512_loadu_ps(m + i)));
}

/* q4_1 / q5_0 / q5_1 rows to one unsigned byte per value, dims in natural order */
static void int_unpack(int fmt, const uint8_t *const *rows, int D, uint8_t *u8) {
    const int nb = D / KV_QK, bb = kv_block_bytes[fmt];
    const int qs_off = fmt == KV_Q4_1 ? 4 : fmt == KV_Q5_0 ? 6 : 8, qh_off = fmt == KV_Q5_0 ? 2 : 4;
    const __m128i m4 = _mm_set1_epi8(0x0f);
    for (int t = 0; t < KV_T; t++)
        for (int b = 0; b < nb; b++) {
            const uint8_t *y = rows[t] + (size_t)b * bb;
            __m128i x = _mm_loadu_si128((const __m128i *)(const void *)(y + qs_off));
            __m256i v = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_and_si128(x, m4)),
                                                _mm_and_si128(_mm_srli_epi16(x, 4), m4), 1);
            if (fmt != KV_Q4_1) v = _mm256_or_si256(v, _mm256_maskz_mov_epi8(kv_load_u32(y + qh_off), _mm256_set1_epi8(0x10)));
            _mm256_storeu_si256((__m256i *)(void *)(u8 + (size_t)t * D + 32 * b), v);
        }
}

/* 8 rows x 8 dwords -> 8 vectors of one dword for 8 tokens; a[k], b[k] = dwords 0-3 / 4-7 of tokens k, k+4 */
static inline void int_transpose4(__m256i a0, __m256i a1, __m256i a2, __m256i a3, __m256i *o) {
    __m256i t0 = _mm256_unpacklo_epi32(a0, a1), t1 = _mm256_unpackhi_epi32(a0, a1);
    __m256i t2 = _mm256_unpacklo_epi32(a2, a3), t3 = _mm256_unpackhi_epi32(a2, a3);
    o[0] = _mm256_unpacklo_epi64(t0, t2);
    o[1] = _mm256_unpackhi_epi64(t0, t2);
    o[2] = _mm256_unpacklo_epi64(t1, t3);
    o[3] = _mm256_unpackhi_epi64(t1, t3);
}

static inline __m256i int_pair128(const uint8_t *lo, const uint8_t *hi) {
    return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(const void *)lo)),
                                   _mm_loadu_si128((const __m128i *)(const void *)hi), 1);
}

/* 16 rows x 4 dwords -> 4 vectors of one dword for 16 tokens; row t's dwords at p[t] (128-bit loads) */
static inline void int_transpose16x4(const uint8_t *const *p, int off, __m512i *o) {
    __m512i a[4];
    for (int k = 0; k < 4; k++) {
        __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(const void *)(p[k] + off)));
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(const void *)(p[k + 4] + off)), 1);
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(const void *)(p[k + 8] + off)), 2);
        a[k] = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(const void *)(p[k + 12] + off)), 3);
    }
    __m512i t0 = _mm512_unpacklo_epi32(a[0], a[1]), t1 = _mm512_unpackhi_epi32(a[0], a[1]);
    __m512i t2 = _mm512_unpacklo_epi32(a[2], a[3]), t3 = _mm512_unpackhi_epi32(a[2], a[3]);
    o[0] = _mm512_unpacklo_epi64(t0, t2); /* lane 4m+k = token 4m+k */
    o[1] = _mm512_unpackhi_epi64(t0, t2);
    o[2] = _mm512_unpacklo_epi64(t1, t3);
    o[3] = _mm512_unpackhi_epi64(t1, t3);
}

/* K of tokens [16g, 16g+16) of the tile, every block, transposed into kt (unsigned values) */
static void int_k_transpose(int fmt, const uint8_t *const *rg, const uint8_t *u8, int D, __m512i *kt) {
    const int nb = D / KV_QK;
    const __m512i flip = _mm512_set1_epi8((char)0x80), m4 = _mm512_set1_epi8(0x0f);
    const uint8_t *p[16];
    for (int b = 0; b < nb; b++, kt += 8) {
        if (fmt == KV_Q4_0) {
            __m512i n[4];
            int_transpose16x4(rg, KV_Q4_0_BYTES * b + 2, n);
            for (int j = 0; j < 4; j++) {
                kt[j] = _mm512_and_si512(n[j], m4);
                kt[4 + j] = _mm512_and_si512(_mm512_srli_epi16(n[j], 4), m4);
            }
            continue;
        }
        int off = KV_Q8_0_BYTES * b + 2;
        const uint8_t *const *src = rg;
        if (fmt != KV_Q8_0) {
            for (int t = 0; t < 16; t++) p[t] = u8 + (size_t)t * D;
            src = p;
            off = 32 * b;
        }
        int_transpose16x4(src, off, kt);
        int_transpose16x4(src, off + 16, kt + 4);
        if (fmt == KV_Q8_0)
            for (int j = 0; j < 8; j++) kt[j] = _mm512_xor_si512(kt[j], flip);
    }
}

/* row R of the 4 (r0 + R): its 8 VNNI pairs over block b's kt[8] (dk: the block's K scales) into SACC */
#define INT_K_ROW(SACC, R)                                                                                 \
    do {                                                                                                   \
        const int32_t *qh = L->qh + ((size_t)(r0 + R) * nb + b) * 8, *ql = L->ql + ((size_t)(r0 + R) * nb + b) * 8; \
        __m512i ah = _mm512_setzero_si512(), al = _mm512_set1_epi32(L->qoff[(r0 + R) * nb + b]);            \
        for (int j = 0; j < 8; j++) {                                                                      \
            DPBUSD_B(ah, kt[j], qh[j]);                                                                    \
            DPBUSD_B(al, kt[j], ql[j]);                                                                    \
        }                                                                                                  \
        SACC = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(ah, 8), al)), dk, SACC); \
    } while (0)

/* decode, 4 rows per KV head (GQA 4): K of 16 tokens x one block stays in registers for all 4 rows */
static __attribute__((noinline)) void int_k_fused4(int fmt, const uint8_t *const *rg, const int_ws *L, int r0, int nb,
                                                   int g, float *s) {
    const __m512i flip = _mm512_set1_epi8((char)0x80), m4 = _mm512_set1_epi8(0x0f);
    __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    for (int b = 0; b < nb; b++) {
        __m512i kt[8];
        if (fmt == KV_Q4_0) {
            __m512i n[4];
            int_transpose16x4(rg, KV_Q4_0_BYTES * b + 2, n);
            for (int j = 0; j < 4; j++) {
                kt[j] = _mm512_and_si512(n[j], m4);
                kt[4 + j] = _mm512_and_si512(_mm512_srli_epi16(n[j], 4), m4);
            }
        } else {
            int_transpose16x4(rg, KV_Q8_0_BYTES * b + 2, kt);
            int_transpose16x4(rg, KV_Q8_0_BYTES * b + 2 + 16, kt + 4);
            for (int j = 0; j < 8; j++) kt[j] = _mm512_xor_si512(kt[j], flip);
        }
        const __m512 dk = _mm512_loadu_ps(L->kd + b * KV_T + 16 * g);
        INT_K_ROW(s0, 0);
        INT_K_ROW(s1, 1);
        INT_K_ROW(s2, 2);
        INT_K_ROW(s3, 3);
    }
    _mm512_storeu_ps(s + 16 * g, _mm512_mul_ps(s0, _mm512_set1_ps(L->dq[r0])));
    _mm512_storeu_ps(s + KV_T + 16 * g, _mm512_mul_ps(s1, _mm512_set1_ps(L->dq[r0 + 1])));
    _mm512_storeu_ps(s + 2 * KV_T + 16 * g, _mm512_mul_ps(s2, _mm512_set1_ps(L->dq[r0 + 2])));
    _mm512_storeu_ps(s + 3 * KV_T + 16 * g, _mm512_mul_ps(s3, _mm512_set1_ps(L->dq[r0 + 3])));
}

/* 4 rows against the 16 tokens of the transposed kt (every block): each block's 8 K vectors are loaded
 * into registers once and feed the 4 rows (8 independent VNNI chains). One row at a time reloaded
 * them per row and took 1.5 loads per VNNI op, so prefill's K.q was bound by the load ports. */
static __attribute__((noinline)) void int_k_rows4(const __m512i *ktall, const int_ws *L, int r0, int nb, int g,
                                                  int has_min, float *s) {
    __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0, m0 = s0, m1 = s0, m2 = s0, m3 = s0;
    for (int b = 0; b < nb; b++) {
        __m512i kt[8];
        for (int j = 0; j < 8; j++) kt[j] = _mm512_load_si512(ktall + 8 * b + j);
        const __m512 dk = _mm512_loadu_ps(L->kd + b * KV_T + 16 * g);
        INT_K_ROW(s0, 0);
        INT_K_ROW(s1, 1);
        INT_K_ROW(s2, 2);
        INT_K_ROW(s3, 3);
        if (has_min) {
            const __m512 km = _mm512_loadu_ps(L->km + b * KV_T + 16 * g);
            m0 = _mm512_fmadd_ps(km, _mm512_set1_ps(L->qsum[r0 * nb + b]), m0);
            m1 = _mm512_fmadd_ps(km, _mm512_set1_ps(L->qsum[(r0 + 1) * nb + b]), m1);
            m2 = _mm512_fmadd_ps(km, _mm512_set1_ps(L->qsum[(r0 + 2) * nb + b]), m2);
            m3 = _mm512_fmadd_ps(km, _mm512_set1_ps(L->qsum[(r0 + 3) * nb + b]), m3);
        }
    }
    _mm512_storeu_ps(s + 16 * g, _mm512_fmadd_ps(s0, _mm512_set1_ps(L->dq[r0]), m0));
    _mm512_storeu_ps(s + KV_T + 16 * g, _mm512_fmadd_ps(s1, _mm512_set1_ps(L->dq[r0 + 1]), m1));
    _mm512_storeu_ps(s + 2 * KV_T + 16 * g, _mm512_fmadd_ps(s2, _mm512_set1_ps(L->dq[r0 + 2]), m2));
    _mm512_storeu_ps(s + 3 * KV_T + 16 * g, _mm512_fmadd_ps(s3, _mm512_set1_ps(L->dq[r0 + 3]), m3));
}

#undef INT_K_ROW

static void int_k_tile(const kv_call *c, kv_scratch *ws, int RT, int r0, int R, const uint8_t *const *rows) {
    const int D = c->head_dim, nb = D / KV_QK, fmt = c->kfmt, bb = kv_block_bytes[fmt];
    int_ws L = int_get(c, ws, RT);
    const int has_min = int_has_min(fmt);
    int_scales(rows, nb, bb, 0, L.kd);
    if (has_min) int_centre_min(rows, nb, bb, int_koff(fmt), L.kd, L.km);
    if (fmt != KV_Q8_0 && fmt != KV_Q4_0) int_unpack(fmt, rows, D, L.u8);
    if (R == 4 && (fmt == KV_Q8_0 || fmt == KV_Q4_0)) {
        for (int g = 0; g < KV_T / 16; g++) int_k_fused4(fmt, rows + 16 * g, &L, r0, nb, g, ws->s);
        return;
    }
    for (int g = 0; g < KV_T / 16; g++) {
        int_k_transpose(fmt, rows + 16 * g, L.u8 + (size_t)16 * g * D, D, L.kt);
        int r = r0;
        for (; r + 4 <= r0 + R; r += 4) int_k_rows4(L.kt, &L, r, nb, g, has_min, ws->s + (size_t)(r - r0) * KV_T);
        for (; r < r0 + R; r++) {
            /* blocks accumulate in registers; four short VNNI chains per block (latency 4-5 cycles) */
            __m512 acc = _mm512_setzero_ps(), macc = _mm512_setzero_ps();
            for (int b = 0; b < nb; b++) {
                const int32_t *qh = L.qh + ((size_t)r * nb + b) * 8, *ql = L.ql + ((size_t)r * nb + b) * 8;
                const __m512i *kt = L.kt + 8 * b;
                __m512i ah0 = _mm512_setzero_si512(), ah1 = ah0, al1 = ah0;
                __m512i al0 = _mm512_set1_epi32(L.qoff[r * nb + b]);
                for (int j = 0; j < 8; j += 2) {
                    __m512i k0 = _mm512_load_si512(kt + j), k1 = _mm512_load_si512(kt + j + 1);
                    DPBUSD_B(ah0, k0, qh[j]);
                    DPBUSD_B(al0, k0, ql[j]);
                    DPBUSD_B(ah1, k1, qh[j + 1]);
                    DPBUSD_B(al1, k1, ql[j + 1]);
                }
                __m512i ah = _mm512_add_epi32(ah0, ah1), al = _mm512_add_epi32(al0, al1);
                __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(ah, 8), al));
                acc = _mm512_fmadd_ps(dot, _mm512_loadu_ps(L.kd + b * KV_T + 16 * g), acc);
                if (has_min)
                    macc = _mm512_fmadd_ps(_mm512_loadu_ps(L.km + b * KV_T + 16 * g), _mm512_set1_ps(L.qsum[r * nb + b]),
                                           macc);
            }
            _mm512_storeu_ps(ws->s + (r - r0) * KV_T + 16 * g, _mm512_fmadd_ps(acc, _mm512_set1_ps(L.dq[r]), macc));
        }
    }
}
#define INT_K_TILE(c, ws, RT, r0, R, rows) int_k_tile(c, ws, RT, r0, R, rows)

/* V of block b for the tile's 16 token pairs: lane i of vx[2u+h] = (v[2u][i'], v[2u+1][i']) as int16 */
static void int_v_interleave(int fmt, const uint8_t *const *rows, const uint8_t *u8, int D, int b, __m512i *vx) {
    if (fmt == KV_Q4_0) {
        const __m512i m4 = _mm512_set1_epi16(0x0f);
        const int o = KV_Q4_0_BYTES * b + 2;
        for (int u = 0; u < KV_T / 2; u++) {
            __m128i a = _mm_loadu_si128((const __m128i *)(const void *)(rows[2 * u] + o));
            __m128i e = _mm_loadu_si128((const __m128i *)(const void *)(rows[2 * u + 1] + o));
            __m512i z = _mm512_cvtepu8_epi16(
                _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_unpacklo_epi8(a, e)), _mm_unpackhi_epi8(a, e), 1));
            vx[2 * u] = _mm512_and_si512(z, m4);
            vx[2 * u + 1] = _mm512_srli_epi16(z, 4);
        }
        return;
    }
    for (int u = 0; u < KV_T / 2; u++) {
        const uint8_t *pa, *pb;
        if (fmt == KV_Q8_0) {
            pa = rows[2 * u] + KV_Q8_0_BYTES * b + 2;
            pb = rows[2 * u + 1] + KV_Q8_0_BYTES * b + 2;
        } else {
            pa = u8 + (size_t)(2 * u) * D + 32 * b;
            pb = pa + D;
        }
        __m256i a = _mm256_loadu_si256((const __m256i *)(const void *)pa);
        __m256i e = _mm256_loadu_si256((const __m256i *)(const void *)pb);
        __m256i lo = _mm256_unpacklo_epi8(a, e), hi = _mm256_unpackhi_epi8(a, e);
        if (fmt == KV_Q8_0) {
            vx[2 * u] = _mm512_cvtepi8_epi16(lo);
            vx[2 * u + 1] = _mm512_cvtepi8_epi16(hi);
        } else {
            vx[2 * u] = _mm512_cvtepu8_epi16(lo);
            vx[2 * u + 1] = _mm512_cvtepu8_epi16(hi);
        }
    }
}

/* out[2r], out[2r+1] = sum over token pairs u of vx[2u], vx[2u+1] times row r's weight pair u, for 4
 * rows (w: int16 pairs, `stride` int32 between rows). Named accumulators: an array would live on the
 * stack. */
static __attribute__((noinline)) void int_v_dot4(const __m512i *vx, const int32_t *w, size_t stride, __m512i *out) {
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    const int32_t *w0 = w, *w1 = w + stride, *w2 = w + 2 * stride, *w3 = w + 3 * stride;
    for (int u = 0; u < KV_T / 2; u++) {
        const __m512i x0 = _mm512_load_si512(vx + 2 * u), x1 = _mm512_load_si512(vx + 2 * u + 1);
        DPWSSD_B(a0, x0, w0[u]);
        DPWSSD_B(a1, x1, w0[u]);
        DPWSSD_B(a2, x0, w1[u]);
        DPWSSD_B(a3, x1, w1[u]);
        DPWSSD_B(a4, x0, w2[u]);
        DPWSSD_B(a5, x1, w2[u]);
        DPWSSD_B(a6, x0, w3[u]);
        DPWSSD_B(a7, x1, w3[u]);
    }
    out[0] = a0, out[1] = a1, out[2] = a2, out[3] = a3, out[4] = a4, out[5] = a5, out[6] = a6, out[7] = a7;
}

/* decode (4 rows per KV head): interleave and accumulate in one pass, no staging of vx */
/* each weight pair is broadcast into a register once and feeds both VNNI ops of its row: a memory
 * broadcast per op made the loop bound by load ports (also used by kern_avx512_decode.h) */
#define INT_V_ACC4(X0, X1, U)                                                                              \
    do {                                                                                                   \
        __m512i wb = _mm512_set1_epi32(w0[U]);                                                             \
        INT_DPW(a0, X0, wb);                                                                               \
        INT_DPW(a1, X1, wb);                                                                               \
        wb = _mm512_set1_epi32(w1[U]);                                                                     \
        INT_DPW(a2, X0, wb);                                                                               \
        INT_DPW(a3, X1, wb);                                                                               \
        wb = _mm512_set1_epi32(w2[U]);                                                                     \
        INT_DPW(a4, X0, wb);                                                                               \
        INT_DPW(a5, X1, wb);                                                                               \
        wb = _mm512_set1_epi32(w3[U]);                                                                     \
        INT_DPW(a6, X0, wb);                                                                               \
        INT_DPW(a7, X1, wb);                                                                               \
    } while (0)

static __attribute__((noinline)) void int_v_fused4(int fmt, const uint8_t *const *rows, int b, const int32_t *w,
                                                   size_t stride, __m512i *out) {
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    const int32_t *w0 = w, *w1 = w + stride, *w2 = w + 2 * stride, *w3 = w + 3 * stride;
    if (fmt == KV_Q8_0) {
        const int o = KV_Q8_0_BYTES * b + 2;
        for (int u = 0; u < KV_T / 2; u++) {
            __m256i a = _mm256_loadu_si256((const __m256i *)(const void *)(rows[2 * u] + o));
            __m256i e = _mm256_loadu_si256((const __m256i *)(const void *)(rows[2 * u + 1] + o));
            __m512i x0 = _mm512_cvtepi8_epi16(_mm256_unpacklo_epi8(a, e));
            __m512i x1 = _mm512_cvtepi8_epi16(_mm256_unpackhi_epi8(a, e));
            INT_V_ACC4(x0, x1, u);
        }
    } else { /* q4_0 */
        const __m512i m4 = _mm512_set1_epi16(0x0f);
        const int o = KV_Q4_0_BYTES * b + 2;
        for (int u = 0; u < KV_T / 2; u++) {
            __m128i a = _mm_loadu_si128((const __m128i *)(const void *)(rows[2 * u] + o));
            __m128i e = _mm_loadu_si128((const __m128i *)(const void *)(rows[2 * u + 1] + o));
            __m512i z = _mm512_cvtepu8_epi16(
                _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_unpacklo_epi8(a, e)), _mm_unpackhi_epi8(a, e), 1));
            __m512i x0 = _mm512_and_si512(z, m4), x1 = _mm512_srli_epi16(z, 4);
            INT_V_ACC4(x0, x1, u);
        }
    }
    out[0] = a0, out[1] = a1, out[2] = a2, out[3] = a3, out[4] = a4, out[5] = a5, out[6] = a6, out[7] = a7;
}

static __attribute__((noinline)) void int_v_dot1(const __m512i *vx, const int32_t *w, size_t stride, __m512i *out) {
    (void)stride;
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, c0 = a0, c1 = a0; /* two chains per output */
    for (int u = 0; u < KV_T / 2; u += 2) {
        DPWSSD_B(a0, _mm512_load_si512(vx + 2 * u), w[u]);
        DPWSSD_B(a1, _mm512_load_si512(vx + 2 * u + 1), w[u]);
        DPWSSD_B(c0, _mm512_load_si512(vx + 2 * u + 2), w[u + 1]);
        DPWSSD_B(c1, _mm512_load_si512(vx + 2 * u + 3), w[u + 1]);
    }
    out[0] = _mm512_add_epi32(a0, c0);
    out[1] = _mm512_add_epi32(a1, c1);
}

/* 16 vectors -> one vector whose lane j is the max (sum) of all lanes of vector j: 30 shuffles for
 * 16 reductions. The tree leaves lane L holding slot TREE_SLOT(L), so callers fill slot s with their
 * vector TREE_SLOT(s) (the map is a 4x4 transpose, its own inverse). */
#define TREE_SLOT(s) (4 * ((s) & 3) + ((s) >> 2))
#define TREE16(OP, v)                                                                                       \
    do {                                                                                                    \
        for (int i = 0; i < 8; i++)                                                                         \
            v[i] = OP(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),                                   \
                      _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xee));                                  \
        for (int i = 0; i < 4; i++)                                                                         \
            v[i] = OP(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x88),                                   \
                      _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xdd));                                  \
        for (int i = 0; i < 2; i++)                                                                         \
            v[i] = OP(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1])); \
        v[0] = OP(_mm512_shuffle_ps(v[0], v[1], 0x44), _mm512_shuffle_ps(v[0], v[1], 0xee));                \
    } while (0)
#define TREE_ADDI(a, b) _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(a), _mm512_castps_si512(b)))

/* int16 weights of the 16 (row, block) pairs k0..k0+15 (k = row * nb + block, rows from the tile's
 * first): one batched max for their scales, one vector division, one batched sum for the offset term,
 * instead of 16 reductions and 32 scalar divisions. The same values as the per-pair loop. */
static inline __attribute__((always_inline)) void int_v_weights16(const float *s, const float *vd, const int nb,
                                                                  int k0, int need_sum, int16_t *w, float *wc,
                                                                  int32_t *wsum) {
    enum { NC = KV_T / 16 };
    const __m512 sign = _mm512_set1_ps(-0.0f);
    __m512 v[16];
    for (int sl = 0; sl < 16; sl++) {
        const int k = k0 + TREE_SLOT(sl), r = k / nb, b = k % nb;
        __m512 mx = _mm512_setzero_ps();
        for (int i = 0; i < NC; i++) /* p >= 0, so |p*d| = p*|d| */
            mx = _mm512_max_ps(mx, _mm512_mul_ps(_mm512_loadu_ps(s + r * KV_T + 16 * i),
                                                 _mm512_andnot_ps(sign, _mm512_loadu_ps(vd + b * KV_T + 16 * i))));
        v[sl] = mx;
    }
    TREE16(_mm512_max_ps, v);
    const __m512 amax = v[0], qmax = _mm512_set1_ps(32767.0f);
    float inv[16];
    _mm512_storeu_ps(inv, _mm512_maskz_div_ps(_mm512_cmp_ps_mask(amax, _mm512_setzero_ps(), _CMP_GT_OQ), qmax, amax));
    _mm512_storeu_ps(wc + k0, _mm512_div_ps(amax, qmax));
    __m512 qs[16];
    for (int sl = 0; sl < 16; sl++) {
        const int k = k0 + TREE_SLOT(sl), r = k / nb, b = k % nb;
        const __m512 iv = _mm512_set1_ps(inv[k - k0]);
        __m512i acc = _mm512_setzero_si512();
        for (int i = 0; i < NC; i++) {
            __m512 x = _mm512_mul_ps(_mm512_loadu_ps(s + r * KV_T + 16 * i), _mm512_loadu_ps(vd + b * KV_T + 16 * i));
            __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(x, iv));
            acc = _mm512_add_epi32(acc, q);
            _mm256_storeu_si256((__m256i *)(void *)(w + (size_t)k * KV_T + 16 * i), _mm512_cvtsepi32_epi16(q));
        }
        qs[sl] = _mm512_castsi512_ps(acc);
    }
    if (need_sum) TREE16(TREE_ADDI, qs);
    _mm512_storeu_si512((void *)(wsum + k0), need_sum ? _mm512_castps_si512(qs[0]) : _mm512_setzero_si512());
}

static void int_v_tile(const kv_call *c, kv_scratch *ws, int RT, int r0, int R, const uint8_t *const *rows) {
    const int D = c->head_dim, nb = D / KV_QK, fmt = c->vfmt, bb = kv_block_bytes[fmt];
    int_ws L = int_get(c, ws, RT);
    const int has_min = int_has_min(fmt);
    int_scales(rows, nb, bb, 0, L.vd);
    if (has_min) int_centre_min(rows, nb, bb, int_koff(fmt), L.vd, L.vm);
    if (fmt != KV_Q8_0 && fmt != KV_Q4_0) int_unpack(fmt, rows, D, L.u8);
    const __m512 sign = _mm512_set1_ps(-0.0f);
    enum { NC = KV_T / 16 };
    /* head_dim 128: a constant nb turns the (row, block) index arithmetic into shifts */
    const int batched = !has_min && nb == 4 && R % 4 == 0;
    if (batched)
        for (int k0 = 0; k0 < R * 4; k0 += 16)
            int_v_weights16(ws->s, L.vd, 4, k0, fmt != KV_Q8_0, L.w + (size_t)r0 * nb * KV_T, L.wc + r0 * nb,
                            L.wsum + r0 * nb);
    for (int r = r0; r < r0 + R && !batched; r++) {
        const float *p = ws->s + (r - r0) * KV_T;
        __m512 pc[NC];
        for (int i = 0; i < NC; i++) pc[i] = _mm512_loadu_ps(p + 16 * i);
        for (int b = 0; b < nb; b++) {
            const int rb = r * nb + b;
            __m512 w[NC], mx = _mm512_setzero_ps();
            for (int i = 0; i < NC; i++) {
                w[i] = _mm512_mul_ps(pc[i], _mm512_loadu_ps(L.vd + b * KV_T + 16 * i));
                mx = _mm512_max_ps(mx, _mm512_andnot_ps(sign, w[i]));
            }
            float amax = _mm512_reduce_max_ps(mx);
            float inv = amax > 0.0f ? 32767.0f / amax : 0.0f;
            L.wc[rb] = amax / 32767.0f;
            __m512i qs = _mm512_setzero_si512();
            for (int i = 0; i < NC; i++) {
                __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(w[i], _mm512_set1_ps(inv)));
                qs = _mm512_add_epi32(qs, q);
                _mm256_storeu_si256((__m256i *)(void *)(L.w + (size_t)rb * KV_T + 16 * i), _mm512_cvtsepi32_epi16(q));
            }
            L.wsum[rb] = fmt == KV_Q8_0 ? 0 : _mm512_reduce_add_epi32(qs); /* offset term */
            if (has_min) {
                __m512 mm = _mm512_setzero_ps();
                for (int i = 0; i < NC; i++) mm = _mm512_fmadd_ps(pc[i], _mm512_loadu_ps(L.vm + b * KV_T + 16 * i), mm);
                float m = _mm512_reduce_add_ps(mm);
                float *o = ws->o + (size_t)r * D + 32 * b;
                __m512 mv = _mm512_set1_ps(m);
                _mm512_storeu_ps(o, _mm512_add_ps(_mm512_loadu_ps(o), mv));
                _mm512_storeu_ps(o + 16, _mm512_add_ps(_mm512_loadu_ps(o + 16), mv));
            }
        }
    }
    const int voff = fmt == KV_Q8_0 ? 0 : int_koff(fmt); /* q8_0 V is used signed */
    const size_t stride = (size_t)nb * KV_T / 2; /* int32 pairs between rows of L.w */
    const int fused = R == 4 && (fmt == KV_Q8_0 || fmt == KV_Q4_0);
    for (int b = 0; b < nb; b++) {
        if (!fused) int_v_interleave(fmt, rows, L.u8, D, b, L.vx);
        for (int r = r0; r < r0 + R;) {
            __m512i acc[8];
            const int32_t *w = (const int32_t *)(const void *)(L.w + ((size_t)r * nb + b) * KV_T);
            int nr = r0 + R - r >= 4 ? 4 : 1;
            if (fused)
                int_v_fused4(fmt, rows, b, w, stride, acc);
            else if (nr == 4)
                int_v_dot4(L.vx, w, stride, acc);
            else
                int_v_dot1(L.vx, w, stride, acc);
            for (int i = 0; i < nr; i++, r++) {
                const int rb = r * nb + b;
                if (L.wc[rb] == 0.0f) continue;
                __m512i off = _mm512_set1_epi32(voff * L.wsum[rb]);
                __m512 cw = _mm512_set1_ps(L.wc[rb]);
                float *o = ws->o + (size_t)r * D + 32 * b;
                _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[2 * i], off)), cw,
                                                    _mm512_loadu_ps(o)));
                _mm512_storeu_ps(o + 16, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[2 * i + 1], off)), cw,
                                                         _mm512_loadu_ps(o + 16)));
            }
        }
    }
}
#define INT_V_TILE(c, ws, RT, r0, R, rows) int_v_tile(c, ws, RT, r0, R, rows)

/* q8_0 and the unpacked formats interleave bytes within 128-bit lanes: accumulator lane order per
 * block is dims 0-7, 16-23, 8-15, 24-31; q4_0 keeps natural order */
static void int_v_unpermute(const kv_call *c, const float *o, float *dst, float inv) {
    const int D = c->head_dim;
    if (c->vfmt == KV_Q4_0 || c->vfmt == KV_MXFP4) { /* nvfp4 (decode path) is in q8_0's order */
        for (int j = 0; j < D; j++) dst[j] = o[j] * inv;
        return;
    }
    for (int b = 0; b < D; b += 32)
        for (int k = 0; k < 8; k++) {
            dst[b + k] = o[b + k] * inv;
            dst[b + 16 + k] = o[b + 8 + k] * inv;
            dst[b + 8 + k] = o[b + 16 + k] * inv;
            dst[b + 24 + k] = o[b + 24 + k] * inv;
        }
}
#define INT_V_UNPERMUTE(c, o, dst, inv) int_v_unpermute(c, o, dst, inv)
