/* Integer attention kernels for the quantized formats (AVX-512 VL + VNNI), included by kern_avx512.c.
 *
 * K.q: each query row (already scaled by softmax scale * log2 e) is quantized to 16 bits with one
 * scale per row, split into a signed high byte and a signed low byte, qi = 256*qh + ql. Stored K
 * values are made unsigned (q8_0: k^0x80 = k+128; nibbles as they are) and VPDPBUSD runs on 8 tokens
 * at once: 8 K rows of one 32-value block are transposed by dwords so each lane is one token, and
 * the 4-byte groups of qh/ql are broadcast. The offset (128, 8 or 16 times sum qi) is an integer
 * constant per row and block, so the block sum is exact in int32 until it meets the fp16 scales.
 *
 * P.V: p*d_v for each row, block and token of the tile is quantized to int16 with one scale per row
 * and block (per tile), two tokens are interleaved per 32-bit lane and VPDPWSSD accumulates them in
 * int32; the tile's sum is scaled back to f32 into the output accumulator.
 *
 * Both quantizations keep ~1e-4 of the f32 result (attention_tolerance). No f32 copy of K or V is made.
 */

#define INT_PATH_K(fmt) ((fmt) >= KV_Q8_0)
#define INT_PATH_V(fmt) ((fmt) >= KV_Q8_0)

#define QI_MAX 32512.0f /* 127*256: qh and ql then both fit int8 */

static const int kv_block_bytes[KV_NFMT] = {0, 0, 0, 34, 18, 20, 22, 24};

typedef struct {
    int32_t *qh, *ql; /* [R][nb][8] 4-byte groups */
    int32_t *qoff;    /* [R][nb]: -offset * sum qi */
    float *qsum;      /* [R][nb]: dq * sum qi over the block (min term of q4_1/q5_1) */
    float *dq;        /* [R] */
    float *kd, *km, *vd, *vm; /* [nb][KV_T] per-token block scales and mins */
    uint16_t *h16;            /* [2][nb][KV_T] fp16 staging */
    int16_t *w;               /* [R][nb][KV_T] quantized p*d_v */
    float *wc;                /* [R][nb] weight scales */
    int32_t *wsum;            /* [R][nb] sum of quantized weights */
    uint8_t *u8;              /* [KV_T][D] unpacked values (q4_1, q5_0, q5_1) */
    __m256i *kt;              /* [nb][8] K of 8 tokens, transposed: lane = token, vector = 4-byte group */
    __m512i *vx;              /* [KV_T/2][2] V of one block, token pairs interleaved as int16 */
} int_ws;

static size_t int_layout(const kv_call *c, int R, uint8_t *base, int_ws *L) {
    const size_t nb = (size_t)c->head_dim / KV_QK, r = (size_t)R;
    size_t off = 0;
#define TAKE(field, type, count)                                                 \
    do {                                                                         \
        if (L) L->field = (type *)(void *)(base + off);                          \
        off += ((size_t)(count) * sizeof(type) + 63) & ~(size_t)63;              \
    } while (0)
    TAKE(qh, int32_t, r * nb * 8);
    TAKE(ql, int32_t, r * nb * 8);
    TAKE(qoff, int32_t, r * nb);
    TAKE(qsum, float, r * nb);
    TAKE(dq, float, r);
    TAKE(kd, float, nb * KV_T);
    TAKE(km, float, nb * KV_T);
    TAKE(vd, float, nb * KV_T);
    TAKE(vm, float, nb * KV_T);
    TAKE(h16, uint16_t, 2 * nb * KV_T);
    TAKE(w, int16_t, r * nb * KV_T);
    TAKE(wc, float, r * nb);
    TAKE(wsum, int32_t, r * nb);
    TAKE(u8, uint8_t, (size_t)KV_T * c->head_dim);
    TAKE(kt, __m256i, nb * 8);
    TAKE(vx, __m512i, KV_T);
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
    return fmt == KV_Q8_0 ? 128 : (fmt == KV_Q4_0 || fmt == KV_Q4_1) ? 8 : (fmt == KV_Q5_0 || fmt == KV_Q5_1) ? 16 : 0;
}
static inline int int_has_min(int fmt) { return fmt == KV_Q4_1 || fmt == KV_Q5_1; }

static void int_prep_q(const kv_call *c, kv_scratch *ws, int R) {
    const int D = c->head_dim, nb = D / KV_QK, koff = int_koff(c->kfmt);
    int_ws L = int_get(c, ws, R);
    const __m512 sign = _mm512_set1_ps(-0.0f);
    for (int r = 0; r < R; r++) {
        const float *x = ws->qf + (size_t)r * D;
        __m512 mx = _mm512_setzero_ps();
        for (int i = 0; i < D; i += 16) mx = _mm512_max_ps(mx, _mm512_andnot_ps(sign, _mm512_loadu_ps(x + i)));
        float amax = _mm512_reduce_max_ps(mx);
        float inv = amax > 0.0f ? QI_MAX / amax : 0.0f;
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

/* fp16 fields at byte offset `off` of every block of every tile row, as f32 [nb][KV_T] */
static void int_scales(const uint8_t *const *rows, int nb, int bb, int off, uint16_t *h16, float *dst) {
    for (int t = 0; t < KV_T; t++) {
        const uint8_t *p = rows[t] + off;
        for (int b = 0; b < nb; b++) h16[b * KV_T + t] = kv_load_u16(p + (size_t)b * bb);
    }
    for (int i = 0; i < nb * KV_T; i += 16)
        _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(const void *)(h16 + i))));
}

/* mins of q4_1/q5_1 moved to the centred values: m + off*d */
static void int_centre_min(const uint8_t *const *rows, int nb, int bb, int off, uint16_t *h16, const float *d,
                           float *m) {
    int_scales(rows, nb, bb, 2, h16, m);
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

/* K of tokens [8g, 8g+8) of the tile, every block, transposed into L.kt (unsigned values) */
static void int_k_transpose(int fmt, const uint8_t *const *rg, const uint8_t *u8, int D, __m256i *kt) {
    const int nb = D / KV_QK;
    const __m256i flip = _mm256_set1_epi8((char)0x80), m4 = _mm256_set1_epi8(0x0f);
    for (int b = 0; b < nb; b++, kt += 8) {
        if (fmt == KV_Q4_0) {
            __m256i n[4];
            const int o = 18 * b + 2;
            int_transpose4(int_pair128(rg[0] + o, rg[4] + o), int_pair128(rg[1] + o, rg[5] + o),
                           int_pair128(rg[2] + o, rg[6] + o), int_pair128(rg[3] + o, rg[7] + o), n);
            for (int j = 0; j < 4; j++) {
                kt[j] = _mm256_and_si256(n[j], m4);
                kt[4 + j] = _mm256_and_si256(_mm256_srli_epi16(n[j], 4), m4);
            }
            continue;
        }
        const uint8_t *p[8];
        for (int t = 0; t < 8; t++) p[t] = fmt == KV_Q8_0 ? rg[t] + 34 * b + 2 : u8 + (size_t)t * D + 32 * b;
        __m256i x[8];
        int_transpose4(int_pair128(p[0], p[4]), int_pair128(p[1], p[5]), int_pair128(p[2], p[6]), int_pair128(p[3], p[7]), x);
        int_transpose4(int_pair128(p[0] + 16, p[4] + 16), int_pair128(p[1] + 16, p[5] + 16),
                       int_pair128(p[2] + 16, p[6] + 16), int_pair128(p[3] + 16, p[7] + 16), x + 4);
        for (int j = 0; j < 8; j++) kt[j] = fmt == KV_Q8_0 ? _mm256_xor_si256(x[j], flip) : x[j];
    }
}

static void int_k_tile(const kv_call *c, kv_scratch *ws, int RT, int r0, int R, const uint8_t *const *rows) {
    const int D = c->head_dim, nb = D / KV_QK, fmt = c->kfmt, bb = kv_block_bytes[fmt];
    int_ws L = int_get(c, ws, RT);
    const int has_min = int_has_min(fmt);
    int_scales(rows, nb, bb, 0, L.h16, L.kd);
    if (has_min) int_centre_min(rows, nb, bb, int_koff(fmt), L.h16, L.kd, L.km);
    if (fmt != KV_Q8_0 && fmt != KV_Q4_0) int_unpack(fmt, rows, D, L.u8);
    for (int g = 0; g < KV_T / 8; g++) {
        int_k_transpose(fmt, rows + 8 * g, L.u8 + (size_t)8 * g * D, D, L.kt);
        for (int r = r0; r < r0 + R; r++) {
            /* blocks accumulate in registers: 2*nb independent VNNI chains per row */
            __m256 acc = _mm256_setzero_ps(), macc = _mm256_setzero_ps();
            for (int b = 0; b < nb; b++) {
                const int32_t *qh = L.qh + ((size_t)r * nb + b) * 8, *ql = L.ql + ((size_t)r * nb + b) * 8;
                const __m256i *kt = L.kt + 8 * b;
                /* four short chains instead of two long ones: VNNI latency is 4-5 cycles */
                __m256i ah0 = _mm256_setzero_si256(), ah1 = ah0, al1 = ah0;
                __m256i al0 = _mm256_set1_epi32(L.qoff[r * nb + b]);
                for (int j = 0; j < 8; j += 2) {
                    __m256i k0 = _mm256_load_si256(kt + j), k1 = _mm256_load_si256(kt + j + 1);
                    ah0 = _mm256_dpbusd_epi32(ah0, k0, _mm256_set1_epi32(qh[j]));
                    al0 = _mm256_dpbusd_epi32(al0, k0, _mm256_set1_epi32(ql[j]));
                    ah1 = _mm256_dpbusd_epi32(ah1, k1, _mm256_set1_epi32(qh[j + 1]));
                    al1 = _mm256_dpbusd_epi32(al1, k1, _mm256_set1_epi32(ql[j + 1]));
                }
                __m256i ah = _mm256_add_epi32(ah0, ah1), al = _mm256_add_epi32(al0, al1);
                __m256 dot = _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_slli_epi32(ah, 8), al));
                acc = _mm256_fmadd_ps(dot, _mm256_loadu_ps(L.kd + b * KV_T + 8 * g), acc);
                if (has_min)
                    macc = _mm256_fmadd_ps(_mm256_loadu_ps(L.km + b * KV_T + 8 * g), _mm256_set1_ps(L.qsum[r * nb + b]), macc);
            }
            _mm256_storeu_ps(ws->s + (r - r0) * KV_T + 8 * g, _mm256_fmadd_ps(acc, _mm256_set1_ps(L.dq[r]), macc));
        }
    }
}
#define INT_K_TILE(c, ws, RT, r0, R, rows) int_k_tile(c, ws, RT, r0, R, rows)

/* V of block b for the tile's 16 token pairs: lane i of vx[2u+h] = (v[2u][i'], v[2u+1][i']) as int16 */
static void int_v_interleave(int fmt, const uint8_t *const *rows, const uint8_t *u8, int D, int b, __m512i *vx) {
    if (fmt == KV_Q4_0) {
        const __m512i m4 = _mm512_set1_epi16(0x0f);
        const int o = 18 * b + 2;
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
            pa = rows[2 * u] + 34 * b + 2;
            pb = rows[2 * u + 1] + 34 * b + 2;
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

/* acc[2r..2r+1] += sum over token pairs u of vx[u] * w_r[u] for NR rows; w_r: int16 pairs, stride ws */
KV_INLINE void int_v_dot(const __m512i *vx, const int32_t *w, size_t stride, const int NR, __m512i *out) {
    __m512i acc[8];
    for (int i = 0; i < 2 * NR; i++) acc[i] = _mm512_setzero_si512();
    for (int u = 0; u < KV_T / 2; u++) {
        const __m512i x0 = _mm512_load_si512(vx + 2 * u), x1 = _mm512_load_si512(vx + 2 * u + 1);
        for (int r = 0; r < NR; r++) {
            const __m512i wv = _mm512_set1_epi32(w[r * stride + u]);
            acc[2 * r] = _mm512_dpwssd_epi32(acc[2 * r], x0, wv);
            acc[2 * r + 1] = _mm512_dpwssd_epi32(acc[2 * r + 1], x1, wv);
        }
    }
    for (int i = 0; i < 2 * NR; i++) out[i] = acc[i];
}

static __attribute__((noinline)) void int_v_dot4(const __m512i *vx, const int32_t *w, size_t stride, __m512i *out) {
    int_v_dot(vx, w, stride, 4, out);
}
static __attribute__((noinline)) void int_v_dot1(const __m512i *vx, const int32_t *w, size_t stride, __m512i *out) {
    int_v_dot(vx, w, stride, 1, out);
}

static void int_v_tile(const kv_call *c, kv_scratch *ws, int RT, int r0, int R, const uint8_t *const *rows) {
    const int D = c->head_dim, nb = D / KV_QK, fmt = c->vfmt, bb = kv_block_bytes[fmt];
    int_ws L = int_get(c, ws, RT);
    const int has_min = int_has_min(fmt);
    int_scales(rows, nb, bb, 0, L.h16, L.vd);
    if (has_min) int_centre_min(rows, nb, bb, int_koff(fmt), L.h16, L.vd, L.vm);
    if (fmt != KV_Q8_0 && fmt != KV_Q4_0) int_unpack(fmt, rows, D, L.u8);
    const __m512 sign = _mm512_set1_ps(-0.0f);
    for (int r = r0; r < r0 + R; r++) {
        const float *p = ws->s + (r - r0) * KV_T;
        __m512 p0 = _mm512_loadu_ps(p), p1 = _mm512_loadu_ps(p + 16);
        for (int b = 0; b < nb; b++) {
            const int rb = r * nb + b;
            __m512 w0 = _mm512_mul_ps(p0, _mm512_loadu_ps(L.vd + b * KV_T));
            __m512 w1 = _mm512_mul_ps(p1, _mm512_loadu_ps(L.vd + b * KV_T + 16));
            float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, w0), _mm512_andnot_ps(sign, w1)));
            float inv = amax > 0.0f ? 32767.0f / amax : 0.0f;
            L.wc[rb] = amax / 32767.0f;
            __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(w0, _mm512_set1_ps(inv)));
            __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(w1, _mm512_set1_ps(inv)));
            L.wsum[rb] = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
            _mm256_storeu_si256((__m256i *)(void *)(L.w + (size_t)rb * KV_T), _mm512_cvtsepi32_epi16(q0));
            _mm256_storeu_si256((__m256i *)(void *)(L.w + (size_t)rb * KV_T + 16), _mm512_cvtsepi32_epi16(q1));
            if (has_min) {
                float m = _mm512_reduce_add_ps(_mm512_fmadd_ps(p0, _mm512_loadu_ps(L.vm + b * KV_T),
                                                               _mm512_mul_ps(p1, _mm512_loadu_ps(L.vm + b * KV_T + 16))));
                float *o = ws->o + (size_t)r * D + 32 * b;
                __m512 mv = _mm512_set1_ps(m);
                _mm512_storeu_ps(o, _mm512_add_ps(_mm512_loadu_ps(o), mv));
                _mm512_storeu_ps(o + 16, _mm512_add_ps(_mm512_loadu_ps(o + 16), mv));
            }
        }
    }
    const int voff = fmt == KV_Q8_0 ? 0 : int_koff(fmt); /* q8_0 V is used signed */
    const size_t stride = (size_t)nb * KV_T / 2; /* int32 pairs between rows of L.w */
    for (int b = 0; b < nb; b++) {
        int_v_interleave(fmt, rows, L.u8, D, b, L.vx);
        for (int r = r0; r < r0 + R;) {
            __m512i acc[8];
            const int32_t *w = (const int32_t *)(const void *)(L.w + ((size_t)r * nb + b) * KV_T);
            int nr = r0 + R - r >= 4 ? 4 : 1;
            if (nr == 4)
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
    if (c->vfmt == KV_Q4_0) {
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
