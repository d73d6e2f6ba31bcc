/* Decode fast path (AVX-512 VNNI), included by kern_avx512.c after kern_avx512_int.h.
 *
 * Taken for one query position per item (a decode step), head_dim 128, K and V each q8_0, q4_0, q4_1, mxfp4
 * or nvfp4 (kivi4/kivi2: below), a multiple of 4 query rows per KV head (GQA 4, 8, ...) and pages of a
 * multiple of 16 rows; the
 * general kernels (kern_template.h + kern_avx512_int.h) run everything else, with the same numerics:
 * q at 16 bits per row (VPDPBUSD on the stored bytes/nibbles) and p*d_v at 16 bits per (row, block,
 * 64-token tile) (VPDPWSSD).
 *
 * Why a separate path: on Zen 4/5 the general kernel was bound by load ports, not by the VNNI units
 * (one 4-byte broadcast load per VNNI op, plus per-token row pointers and per-row scale permutes).
 * Here a 16-token group is one contiguous run of rows in a page, so
 *   - K of 32 tokens is transposed into registers and each q broadcast feeds 4 VNNI ops;
 *   - each p*d_v broadcast feeds 2 VNNI ops;
 *   - the fp16 block scales of 16 rows come from a 4-level VPERMT2W tree (1 permute per row);
 *   - row addresses are one page lookup per group and tile, not one per token;
 *   - the next step's rows are prefetched a few lines per block of work: the same requests issued in
 *     one burst per step overflowed the miss queues (q4_0 at 32k, one thread: 16.4 -> 12.0 ns per
 *     token and KV head).
 * Measured single-threaded on Zen 5 against the general kernel: q4_0 15 -> 11 ns, q8_0 17 -> 14 ns
 * per token and KV head (GQA 4, data in L3).
 */


/* the permute tables and offsets below are written for ggml's 34-byte q8_0 and 18-byte q4_0 blocks */
_Static_assert(KV_Q8_0_BYTES == 34 && KV_Q4_0_BYTES == 18, "the decode path assumes ggml's q8_0 and q4_0 blocks");
_Static_assert(KV_MXFP4_BYTES == 17 && KV_NVFP4_BYTES == 36, "the decode path assumes mxfp4's and nvfp4's blocks");
enum { DEC_NB = 4, DEC_D = 128, DEC_Q8_RB = DEC_NB * KV_Q8_0_BYTES, DEC_Q4_RB = DEC_NB * KV_Q4_0_BYTES };

/* q4_1 K runs as q4_0's, centred (d * (n - 8) per block), with (m + 8d) * sum q per token and block added
 * to the scores (d and m + 8d as the V side reads them, dec_vmin_scales16).
 * mxfp4 and nvfp4 take this path too: their e2m1 codes are integers (the doubled values -12..12, a
 * 16-byte VPSHUFB table) times a block scale, so they run q4_0's kernels with a table lookup after the
 * nibble split: K made unsigned (+12, the offset term as q4_0's +8), V signed (no offset). An nvfp4 row
 * is 2 blocks of 4 scales + 32 nibble bytes; its "block" b here is 32 values (bytes 36*(b/2) + 4 +
 * 16*(b%2)) of two 16-value sub-blocks with their own scales, in the nibble order low = values 0-7 of each
 * sub-block, high = 8-15: K keeps one integer sum per sub-block (q's 4-byte groups permuted to match),
 * V weights one per sub-block (lanes 0-7 and 8-15), its output in q8_0's kernel order. */
static inline int dec_fmt(int fmt) { return fmt == KV_Q8_0 || fmt == KV_Q4_0 || fmt == KV_MXFP4 || fmt == KV_NVFP4; }
static inline int dec_rb(int fmt) {
    return fmt == KV_Q8_0 ? DEC_Q8_RB : fmt == KV_Q4_0 ? DEC_Q4_RB : fmt == KV_Q4_1 ? DEC_NB * KV_Q4_1_BYTES
         : fmt == KV_KIVI2 ? DEC_NB * KV_KIVI2_BYTES : fmt == KV_MXFP4 ? DEC_NB * KV_MXFP4_BYTES : 2 * KV_NVFP4_BYTES;
}
/* byte offset of block b's values (32 bytes, q8_0; 16 nibble bytes, the others) in a row */
static inline int dec_qs(int fmt, int b) {
    return fmt == KV_Q8_0 ? KV_Q8_0_BYTES * b + 2 : fmt == KV_Q4_0 ? KV_Q4_0_BYTES * b + 2
         : fmt == KV_Q4_1 ? KV_Q4_1_BYTES * b + 4 : fmt == KV_KIVI2 ? KV_KIVI2_BYTES * b + 4
         : fmt == KV_MXFP4 ? KV_MXFP4_BYTES * b + 1 : KV_NVFP4_BYTES * (b >> 1) + 4 + 16 * (b & 1);
}

/* kivi4 and kivi2 K pages (kivi_k.c) take this path too. A page holds one scale d and one minimum m per channel, so
 * d goes into q once per (page, KV head): q'_c = q_c * d_c, quantized to 16 bits per row and 32-channel block,
 * and m into one f32 constant per row, sum q_c * m_c. A token's score is then C + sum over blocks of
 * dq'_b * (q' . codes): an integer sum per block of the unsigned codes (kivi4's nibbles laid out as q4_0's,
 * kivi2's 2-bit fields), no offset, no per-token scale (dec_prep_q_kivi). At 16-token pages the prep still
 * costs about half the codes' VNNI work (kivi4 K ~1.3x q4_0 K at 16k, ~1.1x at 64-token pages); pages of a
 * multiple of 16 rows keep each 16-row group inside one page.
 * V may be q4_1 (kivi4's V rows are its bytes) or kivi2: q4_0's kernels on the codes, d and m + centre * d
 * read per row (dec_vmin_scales16), the centred min term a per-(row, block) sum of p * (m + centre * d) added to the output. */
/* code bytes per page row: kivi4 nibbles, kivi2 2-bit fields (value j + 8i in field i of byte j of each
 * 8-byte group of 32) */
static inline int dec_kivi_cb(int fmt) { return fmt == KV_KIVI4 ? DEC_D / 2 : DEC_D / 4; }
static inline int dec_kfmt(const kv_call *c) {
    return c->kpaged ? c->kfmt == KV_KIVI4 || c->kfmt == KV_KIVI2 : dec_fmt(c->kfmt) || c->kfmt == KV_Q4_1;
}
/* V rows with d and m per block (q4_1 and kivi2's: 2-bit fields as kivi2's K pages) run centred: the codes
 * minus half their range (8, 2) times p * d, plus p * (m + centre * d) */
static inline int dec_vmin(int fmt) { return fmt == KV_Q4_1 || fmt == KV_KIVI2; }
static inline int dec_vfmt(int fmt) { return dec_fmt(fmt) || dec_vmin(fmt); }
/* scale slots per row: nvfp4's 8 sub-blocks, else 4 blocks */
static inline int dec_ns(int fmt) { return fmt == KV_NVFP4 ? 2 * DEC_NB : DEC_NB; }
/* the doubled e2m1 values in a 16-byte VPSHUFB table: +12 (unsigned, K) and as they are (V) */
#define DEC_E2M1_U 12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0
#define DEC_E2M1_S 0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12
static const int8_t dec_e2m1_u[64] KV_ALIGN(64) = {DEC_E2M1_U, DEC_E2M1_U, DEC_E2M1_U, DEC_E2M1_U};
static const int8_t dec_e2m1_s[32] KV_ALIGN(32) = {DEC_E2M1_S, DEC_E2M1_S};

static int dec_applies(const kv_call *c, const kv_item *it) {
    const int G = c->n_heads / c->n_kv_heads;
    return it->npos == 1 && c->head_dim == DEC_D && dec_kfmt(c) && dec_vfmt(c->vfmt) && G % 4 == 0 &&
           c->block_size % 16 == 0;
}

/* VPERMT2W index tables of the scale tree (index bit 5 picks the second table). Level 1 takes the
 * 4 scales of each row (q4_0: words 0, 9, 18, 27 of a 72-byte row's first 64 bytes, two rows per
 * permute; q8_0: words 0, 17 | 34, 51 of a 136-byte row's first 128 bytes, then rows paired), levels
 * 2 and 3 concatenate, level 4 turns [token][block] of 2 x 8 tokens into [block][token]. */
static const uint16_t dec_q4_l1[32] KV_ALIGN(64) = {0, 9, 18, 27, 32, 41, 50, 59};
static const uint16_t dec_q8_l0[32] KV_ALIGN(64) = {0, 17, 34, 51};
static const uint16_t dec_q8_l1[32] KV_ALIGN(64) = {0, 1, 2, 3, 32, 33, 34, 35};
static const uint16_t dec_l2[32] KV_ALIGN(64) = {0, 1, 2, 3, 4, 5, 6, 7, 32, 33, 34, 35, 36, 37, 38, 39};
static const uint16_t dec_l3[32] KV_ALIGN(64) = {0,  1,  2,  3,  4,  5,  6,  7,  8,  9,  10, 11, 12, 13, 14, 15,
                                                 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47};
static const uint16_t dec_l4a[32] KV_ALIGN(64) = {0, 4, 8,  12, 16, 20, 24, 28, 32, 36, 40, 44, 48, 52, 56, 60,
                                                  1, 5, 9,  13, 17, 21, 25, 29, 33, 37, 41, 45, 49, 53, 57, 61};
static const uint16_t dec_l4b[32] KV_ALIGN(64) = {2, 6, 10, 14, 18, 22, 26, 30, 34, 38, 42, 46, 50, 54, 58, 62,
                                                  3, 7, 11, 15, 19, 23, 27, 31, 35, 39, 43, 47, 51, 55, 59, 63};

#define DEC_LD(p) _mm512_loadu_si512((const void *)(p))
#define DEC_P2(a, idx, b) _mm512_permutex2var_epi16(a, idx, b)

/* the e8m0 (mxfp4) or ue4m3 (nvfp4) scale bytes of 16 rows, slot k of row t into byte t of 128-bit lane k
 * of the result: each row's bytes (mxfp4: 0, 17, 34, 51 of its first 64; nvfp4: 4 bytes at `off`,
 * broadcast to every lane) picked by one byte-masked VPSHUFB, four independent chains */
static inline __m512i dec_fp4_bytes(int fmt, const uint8_t *p, int off) {
    const __m512i ctl = _mm512_set_epi32(0x03030303, 0x03030303, 0x03030303, 0x03030303, 0x02020202, 0x02020202,
                                         0x02020202, 0x02020202, 0x01010101, 0x01010101, 0x01010101, 0x01010101, 0, 0, 0, 0);
    const int rb = dec_rb(fmt);
    __m512i a[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512()};
    for (int t = 0; t < 16; t++) {
        const uint8_t *r = p + (size_t)rb * t;
        const __m512i x = fmt == KV_MXFP4 ? _mm512_loadu_si512((const void *)r)
                                          : _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(const void *)(r + off)));
        a[t & 3] = _mm512_mask_shuffle_epi8(a[t & 3], (__mmask64)(0x0001000100010001ull << t), x, ctl);
    }
    return _mm512_or_si512(_mm512_or_si512(a[0], a[1]), _mm512_or_si512(a[2], a[3]));
}

/* 16 scale codes -> f32: e8m0 as ggml_e8m0_to_fp32_half (kv_e8m0_half), ue4m3 as kv_ue4m3_half (the
 * code's 7 low bits placed into an f32 and rescaled: exact, subnormals included; 0x7F reads 0) */
static inline __m512 dec_fp4_scale(int fmt, __m128i bytes) {
    const __m512i e = _mm512_cvtepu8_epi32(bytes);
    if (fmt == KV_MXFP4) {
        const __m512i v = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
        const __mmask16 small = _mm512_cmplt_epu32_mask(e, _mm512_set1_epi32(2));
        return _mm512_castsi512_ps(_mm512_mask_sllv_epi32(v, small, _mm512_set1_epi32(0x00200000), e));
    }
    const __m512i em = _mm512_and_si512(e, _mm512_set1_epi32(0x7f));
    const __m512 v = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(em, 20)), _mm512_set1_ps(0x1p119f));
    return _mm512_maskz_mov_ps(_mm512_cmpneq_epi32_mask(e, _mm512_set1_epi32(0x7f)), v);
}

/* block (or sub-block) scales of the 16 rows at p (stride rb) as f32 into dst[slot * KV_T + i], i < 16 */
static inline void dec_scales16(int fmt, const uint8_t *p, float *dst) {
    if (fmt == KV_MXFP4 || fmt == KV_NVFP4) {
        for (int h = 0; h < (fmt == KV_NVFP4 ? 2 : 1); h++) {
            const __m512i x = dec_fp4_bytes(fmt, p, KV_NVFP4_BYTES * h);
            float *d = dst + 4 * h * KV_T;
            _mm512_storeu_ps(d, dec_fp4_scale(fmt, _mm512_castsi512_si128(x)));
            _mm512_storeu_ps(d + KV_T, dec_fp4_scale(fmt, _mm512_extracti32x4_epi32(x, 1)));
            _mm512_storeu_ps(d + 2 * KV_T, dec_fp4_scale(fmt, _mm512_extracti32x4_epi32(x, 2)));
            _mm512_storeu_ps(d + 3 * KV_T, dec_fp4_scale(fmt, _mm512_extracti32x4_epi32(x, 3)));
        }
        return;
    }
    __m512i l1[8], l2[4];
    if (fmt == KV_Q4_0) {
        const __m512i i1 = DEC_LD(dec_q4_l1);
        for (int i = 0; i < 8; i++) l1[i] = DEC_P2(DEC_LD(p + 2 * DEC_Q4_RB * i), i1, DEC_LD(p + 2 * DEC_Q4_RB * i + DEC_Q4_RB));
    } else {
        const __m512i i0 = DEC_LD(dec_q8_l0), i1 = DEC_LD(dec_q8_l1);
        for (int i = 0; i < 8; i++) {
            const uint8_t *a = p + 2 * DEC_Q8_RB * i, *b = a + DEC_Q8_RB;
            l1[i] = DEC_P2(DEC_P2(DEC_LD(a), i0, DEC_LD(a + 64)), i1, DEC_P2(DEC_LD(b), i0, DEC_LD(b + 64)));
        }
    }
    const __m512i i2 = DEC_LD(dec_l2), i3 = DEC_LD(dec_l3);
    for (int i = 0; i < 4; i++) l2[i] = DEC_P2(l1[2 * i], i2, l1[2 * i + 1]);
    const __m512i a = DEC_P2(l2[0], i3, l2[1]), b = DEC_P2(l2[2], i3, l2[3]);
    const __m512i lo = DEC_P2(a, DEC_LD(dec_l4a), b), hi = DEC_P2(a, DEC_LD(dec_l4b), b);
    _mm512_storeu_ps(dst, _mm512_cvtph_ps(_mm512_castsi512_si256(lo)));
    _mm512_storeu_ps(dst + KV_T, _mm512_cvtph_ps(_mm512_extracti64x4_epi64(lo, 1)));
    _mm512_storeu_ps(dst + 2 * KV_T, _mm512_cvtph_ps(_mm512_castsi512_si256(hi)));
    _mm512_storeu_ps(dst + 3 * KV_T, _mm512_cvtph_ps(_mm512_extracti64x4_epi64(hi, 1)));
}

/* q4_1 / kivi2 V (d, m, then the codes per block): d of the 16 rows' blocks into d[b * KV_T + i] and
 * m + centre * d into m[...]. Each row's 4 (d, m) dwords (at 5-dword steps, q4_1; 3, kivi2) come in by one
 * masked load (nothing past them is read) and a permute tree turns [row][block] into [block][row]:
 * 20 permutes per 16 rows, cheaper than 4 dword gathers. */
static inline void dec_vmin_scales16(int fmt, const uint8_t *p, float *d, float *m) {
    const int step = fmt == KV_Q4_1 ? KV_Q4_1_BYTES / 4 : KV_KIVI2_BYTES / 4, rb = DEC_NB * 4 * step;
    const __mmask16 take = (__mmask16)(1u | 1u << step | 1u << 2 * step | 1u << 3 * step);
    const __m512i pair = _mm512_setr_epi32(0, step, 2 * step, 3 * step, 16, 16 + step, 16 + 2 * step, 16 + 3 * step,
                                           0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i quad = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
    const __m512i lo01 = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 1, 5, 9, 13, 17, 21, 25, 29);
    const __m512i hi23 = _mm512_setr_epi32(2, 6, 10, 14, 18, 22, 26, 30, 3, 7, 11, 15, 19, 23, 27, 31);
    const __m512i top = _mm512_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    __m512i y[8], z[4];
    for (int i = 0; i < 8; i++)
        y[i] = _mm512_permutex2var_epi32(_mm512_maskz_loadu_epi32(take, p + (size_t)rb * 2 * i), pair,
                                         _mm512_maskz_loadu_epi32(take, p + (size_t)rb * (2 * i + 1)));
    for (int j = 0; j < 4; j++) z[j] = _mm512_permutex2var_epi32(y[2 * j], quad, y[2 * j + 1]); /* rows 4j.., [r][b] */
    const __m512i u0 = _mm512_permutex2var_epi32(z[0], lo01, z[1]), u1 = _mm512_permutex2var_epi32(z[2], lo01, z[3]);
    const __m512i u2 = _mm512_permutex2var_epi32(z[0], hi23, z[1]), u3 = _mm512_permutex2var_epi32(z[2], hi23, z[3]);
    const __m512i x[DEC_NB] = {_mm512_permutex2var_epi32(u0, quad, u1), _mm512_permutex2var_epi32(u0, top, u1),
                               _mm512_permutex2var_epi32(u2, quad, u3), _mm512_permutex2var_epi32(u2, top, u3)};
    const __m512 centre = _mm512_set1_ps(fmt == KV_Q4_1 ? 8.0f : 2.0f);
    for (int b = 0; b < DEC_NB; b++) {
        const __m512 dv = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(x[b]));
        const __m512 mv = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(x[b], 16)));
        _mm512_storeu_ps(d + b * KV_T, dv);
        _mm512_storeu_ps(m + b * KV_T, _mm512_fmadd_ps(dv, centre, mv));
    }
}

/* 16 rows (stride rb) x 4 dwords at byte offset off -> 4 vectors, lane t = row t */
static inline void dec_transpose(const uint8_t *p, int64_t rb, int off, __m512i *o) {
    __m512i a[4];
    for (int k = 0; k < 4; k++) {
        const uint8_t *r = p + off + rb * k;
        __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(const void *)r));
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(const void *)(r + 4 * rb)), 1);
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(const void *)(r + 8 * rb)), 2);
        a[k] = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(const void *)(r + 12 * rb)), 3);
    }
    __m512i t0 = _mm512_unpacklo_epi32(a[0], a[1]), t1 = _mm512_unpackhi_epi32(a[0], a[1]);
    __m512i t2 = _mm512_unpacklo_epi32(a[2], a[3]), t3 = _mm512_unpackhi_epi32(a[2], a[3]);
    o[0] = _mm512_unpacklo_epi64(t0, t2);
    o[1] = _mm512_unpackhi_epi64(t0, t2);
    o[2] = _mm512_unpacklo_epi64(t1, t3);
    o[3] = _mm512_unpackhi_epi64(t1, t3);
}

/* K values of block b of 16 rows, unsigned, transposed: kt[j] lane t = values 4j..4j+3 of row t */
static inline void dec_k_block(int fmt, const uint8_t *p, int b, __m512i *kt) {
    if (fmt != KV_Q8_0) {
        const __m512i m4 = _mm512_set1_epi8(0x0f);
        __m512i n[4];
        dec_transpose(p, dec_rb(fmt), dec_qs(fmt, b), n);
        for (int j = 0; j < 4; j++) {
            kt[j] = _mm512_and_si512(n[j], m4);
            kt[4 + j] = _mm512_and_si512(_mm512_srli_epi16(n[j], 4), m4);
        }
        if (fmt == KV_MXFP4 || fmt == KV_NVFP4) { /* e2m1 codes -> their doubled values + 12 */
            const __m512i tab = _mm512_load_si512((const void *)dec_e2m1_u);
            for (int j = 0; j < 8; j++) kt[j] = _mm512_shuffle_epi8(tab, kt[j]);
        }
    } else {
        const __m512i flip = _mm512_set1_epi8((char)0x80);
        dec_transpose(p, DEC_Q8_RB, KV_Q8_0_BYTES * b + 2, kt);
        dec_transpose(p, DEC_Q8_RB, KV_Q8_0_BYTES * b + 2 + 16, kt + 4);
        for (int j = 0; j < 8; j++) kt[j] = _mm512_xor_si512(kt[j], flip);
    }
}

/* software prefetch of the next step's rows, issued a few lines at a time through the step: requests
 * in one burst overflow the miss queues and are dropped or stall the core */
typedef struct {
    const uint8_t *p[KV_T / 16];
    int n, i, off, len;
} dec_pf;
static inline void dec_pf_pump(dec_pf *f, int lines) {
    for (; lines > 0 && f->i < f->n; lines--) {
        __builtin_prefetch(f->p[f->i] + f->off, 0, 3); /* into L1: ~3% over L2 only */
        if ((f->off += 64) >= f->len) f->i++, f->off = 0;
    }
}

/* scores (before the q scale dq) of R rows against 2 groups of 16 rows: S[r][col .. col+32) */
static __attribute__((noinline)) void dec_k_unit(int fmt, const uint8_t *g0, const uint8_t *g1, const int_ws *L,
                                                 int r0, int R, int col, float *S, dec_pf *pf, int quota) {
    for (int b = 0; b < DEC_NB; b++) {
        dec_pf_pump(pf, quota);
        __m512i k0[8], k1[8];
        dec_k_block(fmt, g0, b, k0);
        dec_k_block(fmt, g1, b, k1);
        const __m512 dk0 = _mm512_loadu_ps(L->kd + b * KV_T + col), dk1 = _mm512_loadu_ps(L->kd + b * KV_T + col + 16);
        /* two rows at a time: 8 independent VNNI chains keep both units busy (latency 4-5 cycles) */
        for (int r = 0; r < R; r += 2) {
            const size_t ra = (size_t)(r0 + r) * DEC_NB + b, rc = ra + DEC_NB;
            const int32_t *qha = L->qh + ra * 8, *qla = L->ql + ra * 8, *qhc = L->qh + rc * 8, *qlc = L->ql + rc * 8;
            __m512i ha0 = _mm512_setzero_si512(), ha1 = ha0, hc0 = ha0, hc1 = ha0;
            __m512i la0 = _mm512_set1_epi32(L->qoff[ra]), la1 = la0, lc0 = _mm512_set1_epi32(L->qoff[rc]), lc1 = lc0;
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++) {
                __m512i q = _mm512_set1_epi32(qha[j]);
                INT_DPB(ha0, k0[j], q);
                INT_DPB(ha1, k1[j], q);
                q = _mm512_set1_epi32(qla[j]);
                INT_DPB(la0, k0[j], q);
                INT_DPB(la1, k1[j], q);
                q = _mm512_set1_epi32(qhc[j]);
                INT_DPB(hc0, k0[j], q);
                INT_DPB(hc1, k1[j], q);
                q = _mm512_set1_epi32(qlc[j]);
                INT_DPB(lc0, k0[j], q);
                INT_DPB(lc1, k1[j], q);
            }
#define DEC_K_OUT(H, Lo, DK, S)                                                                    \
    do {                                                                                           \
        const __m512 d = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(H, 8), Lo));         \
        _mm512_storeu_ps(S, b ? _mm512_fmadd_ps(d, DK, _mm512_loadu_ps(S)) : _mm512_mul_ps(d, DK)); \
    } while (0)
            float *sa = S + r * KV_T + col, *sc = sa + KV_T;
            DEC_K_OUT(ha0, la0, dk0, sa);
            DEC_K_OUT(ha1, la1, dk1, sa + 16);
            DEC_K_OUT(hc0, lc0, dk0, sc);
            DEC_K_OUT(hc1, lc1, dk1, sc + 16);
#undef DEC_K_OUT
            if (fmt == KV_Q4_1) { /* centred: d * (n - 8) above, + (m + 8d) * sum q (qoff = -8 sum q) */
                const __m512 m0 = _mm512_loadu_ps(L->km + b * KV_T + col), m1 = _mm512_loadu_ps(L->km + b * KV_T + col + 16);
                const __m512 qa = _mm512_set1_ps((float)L->qoff[ra] * -0.125f), qc = _mm512_set1_ps((float)L->qoff[rc] * -0.125f);
                _mm512_storeu_ps(sa, _mm512_fmadd_ps(m0, qa, _mm512_loadu_ps(sa)));
                _mm512_storeu_ps(sa + 16, _mm512_fmadd_ps(m1, qa, _mm512_loadu_ps(sa + 16)));
                _mm512_storeu_ps(sc, _mm512_fmadd_ps(m0, qc, _mm512_loadu_ps(sc)));
                _mm512_storeu_ps(sc + 16, _mm512_fmadd_ps(m1, qc, _mm512_loadu_ps(sc + 16)));
            }
        }
    }
}

/* out[i] = the sum of a[i]'s lanes, four at once: lane-pair sums, then the 4 128-bit lanes hold partials of
 * [a0, a1, a2, a3] */
static inline void dec_hsum4(const __m512 *a, float *out) {
    const __m512 s01 = _mm512_add_ps(_mm512_unpacklo_ps(a[0], a[1]), _mm512_unpackhi_ps(a[0], a[1]));
    const __m512 s23 = _mm512_add_ps(_mm512_unpacklo_ps(a[2], a[3]), _mm512_unpackhi_ps(a[2], a[3]));
    const __m512 s4 = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(s01), _mm512_castps_pd(s23))),
                                    _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(s01), _mm512_castps_pd(s23))));
    const __m256 s2 = _mm256_add_ps(_mm512_castps512_ps256(s4), _mm512_extractf32x8_ps(s4, 1));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(s2), _mm256_extractf128_ps(s2, 1)));
}

/* kivi K: the score of row r against token t of a page is sum_c q_c * (d_c * code_tc + m_c), so the codes take
 * q'_c = q_c * d_c, quantized per row and 32-channel block b (an outlier channel's large d costs the
 * precision of its block only). The scale is a bound, found without a pass over q * d: per call, q is
 * scaled to ks = q * QMAX / max|q| over the block (dec_kivi_q), and per page d to dn = d / max d over the
 * block, so q'_c = round(ks_c * dn_c) fits QMAX and dq[r][b] = max|q| * max d / QMAX. The codes are
 * unsigned (0 .. 15, 0 .. 3): the rounding errors e_c of q' would add centre * sum_c e_c to every score of
 * the page, a bias between pages that the softmax sees, so the min term C = sum_c q_c * m_c takes that sum
 * back and leaves sum_c e_c * (code_c - centre), centred as the _0 formats' sums. */
/* kivi2 (wide): 24 bits, qx/qh/ql bytes. A 2-bit code's d is 5x a 4-bit one's, so one outlier channel's
 * q'_c takes a block's 16-bit range and leaves the rest a few bits; 2-bit codes keep 24-bit sums in int32. */
enum { DEC_QW_MAX = 127 * 65536 };
static inline float dec_kivi_qmax(int wide) { return wide ? (float)DEC_QW_MAX : QI_MAX; }

/* per call: ks [RT][128] and qm [RT][4] = max|q| / QMAX per block; a block of q with a NaN or inf gets
 * qm NaN (its rows' scores are NaN, as float attention's), ks 0 */
static void dec_kivi_q(const float *qf, int RT, int wide, float *ks, float *qm) {
    const float qmax = dec_kivi_qmax(wide);
    for (int i = 0; i < RT * DEC_NB; i++) {
        const float *x = qf + 32 * (size_t)i;
        const __m512 a0 = _mm512_loadu_ps(x), a1 = _mm512_loadu_ps(x + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a0), _mm512_abs_ps(a1)));
        const int finite = amax <= FLT_MAX; /* false for inf and NaN (max_ps may drop a NaN: checked below) */
        const __mmask16 nan = _mm512_cmp_ps_mask(a0, a0, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(a1, a1, _CMP_UNORD_Q);
        const float inv = finite && !nan && amax > 0.0f ? qmax / amax : 0.0f;
        qm[i] = finite && !nan ? amax / qmax : NAN;
        _mm512_storeu_ps(ks + 32 * (size_t)i, _mm512_mul_ps(a0, _mm512_set1_ps(inv)));
        _mm512_storeu_ps(ks + 32 * (size_t)i + 16, _mm512_mul_ps(a1, _mm512_set1_ps(inv)));
    }
}

/* per page, R rows (a multiple of 4) of q (qf, ks, qm) against the page's f16 d[128] then m[128] at
 * `scales`: q' as 16-bit halves qh/ql [R][4 blocks][8 dwords] (kivi2: 24 bits, qx too), dq [R][4], C [R] */
static void dec_prep_q_kivi(const float *qf, const float *ks, const float *qm, int R, const uint8_t *scales,
                            int wide, int32_t *qx, int32_t *qh, int32_t *ql, float *dq, float *cm) {
    const __m512i magnitude = _mm512_set1_epi32(0x7fffffff);
    __m512 dn[8], bm[4];
    for (int i = 0; i < 8; i++)
        dn[i] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(const void *)(scales + 32 * i)));
    for (int b = 0; b < DEC_NB; b++) /* |d| as integers: a NaN orders above inf */
        bm[b] = _mm512_castsi512_ps(_mm512_and_si512(
            _mm512_max_epu32(_mm512_and_si512(_mm512_castps_si512(dn[2 * b]), magnitude),
                             _mm512_and_si512(_mm512_castps_si512(dn[2 * b + 1]), magnitude)), magnitude));
    float dmax[DEC_NB], inv[DEC_NB];
    for (int b = 0; b < DEC_NB; b++) {
        const __mmask16 nan = _mm512_cmp_ps_mask(bm[b], bm[b], _CMP_UNORD_Q);
        dmax[b] = nan ? NAN : _mm512_reduce_max_ps(bm[b]);
        inv[b] = dmax[b] > 0.0f && dmax[b] <= FLT_MAX ? 1.0f / dmax[b] : 0.0f;
    }
    const float centre = wide ? 1.5f : 7.5f; /* the codes' mean */
    __m512 mc[8]; /* m + centre * d: C = sum q_c * mc_c - centre * sum_c dq * q'_c (the sum of the e_c taken back) */
    for (int i = 0; i < 8; i++) {
        const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(const void *)(scales + 2 * DEC_D + 32 * i)));
        mc[i] = _mm512_fmadd_ps(dn[i], _mm512_set1_ps(centre), m);
        dn[i] = _mm512_mul_ps(dn[i], _mm512_set1_ps(inv[i / 2]));
    }
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    for (int r0 = 0; r0 < R; r0 += 4) {
        { /* dq of 4 rows x 4 blocks: NaN where the bound is not finite */
            const __m512 p = _mm512_mul_ps(_mm512_loadu_ps(qm + (size_t)r0 * DEC_NB), _mm512_broadcast_f32x4(_mm_loadu_ps(dmax)));
            const __mmask16 finite = _mm512_cmplt_epu32_mask(_mm512_and_si512(_mm512_castps_si512(p), magnitude),
                                                             _mm512_set1_epi32(0x7f800000));
            _mm512_storeu_ps(dq + (size_t)r0 * DEC_NB, _mm512_mask_blend_ps(finite, _mm512_set1_ps(NAN), p));
        }
        __m512 cs[4];
        for (int i = 0; i < 4; i++) {
            const size_t r = (size_t)(r0 + i);
            const float *x = qf + r * DEC_D, *k = ks + r * DEC_D;
            __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(x), mc[0]), sq = _mm512_setzero_ps();
            for (int e = 1; e < 8; e++) acc = _mm512_fmadd_ps(_mm512_loadu_ps(x + 16 * e), mc[e], acc);
            for (int e = 0; e < DEC_D; e += 64) { /* 64 channels: blocks e / 32 and e / 32 + 1 */
                __m512i qi[4];
                for (int j = 0; j < 4; j++) qi[j] = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(k + e + 16 * j), dn[e / 16 + j]));
                for (int h = 0; h < 2; h++)
                    sq = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(qi[2 * h], qi[2 * h + 1])),
                                         _mm512_set1_ps(dq[r * DEC_NB + e / 32 + h]), sq);
                const size_t at = r * 32 + e / 4;
                if (wide) {
                    for (int j = 0; j < 4; j++) { /* three bytes per value, each signed */
                        const __m512i lo = _mm512_srai_epi32(_mm512_slli_epi32(qi[j], 24), 24);
                        const __m512i t = _mm512_srai_epi32(_mm512_sub_epi32(qi[j], lo), 8);
                        const __m512i mid = _mm512_srai_epi32(_mm512_slli_epi32(t, 24), 24);
                        _mm_storeu_si128((__m128i *)(void *)(ql + at + 4 * j), _mm512_cvtepi32_epi8(lo));
                        _mm_storeu_si128((__m128i *)(void *)(qh + at + 4 * j), _mm512_cvtepi32_epi8(mid));
                        _mm_storeu_si128((__m128i *)(void *)(qx + at + 4 * j),
                                         _mm512_cvtepi32_epi8(_mm512_srai_epi32(_mm512_sub_epi32(t, mid), 8)));
                    }
                    continue;
                }
                /* 16-bit, then low bytes and high bytes; dword i of the packed bytes holds chunk i % 4,
                 * channels 4 * (i / 4) ..: back to order */
                const __m512i w0 = _mm512_packs_epi32(qi[0], qi[1]), w1 = _mm512_packs_epi32(qi[2], qi[3]);
                const __m512i l0 = _mm512_srai_epi16(_mm512_slli_epi16(w0, 8), 8); /* the low byte, signed */
                const __m512i l1 = _mm512_srai_epi16(_mm512_slli_epi16(w1, 8), 8);
                const __m512i h0 = _mm512_srai_epi16(_mm512_add_epi16(w0, _mm512_set1_epi16(128)), 8); /* (w - l) / 256 */
                const __m512i h1 = _mm512_srai_epi16(_mm512_add_epi16(w1, _mm512_set1_epi16(128)), 8);
                _mm512_storeu_si512((void *)(ql + at), _mm512_permutexvar_epi32(order, _mm512_packs_epi16(l0, l1)));
                _mm512_storeu_si512((void *)(qh + at), _mm512_permutexvar_epi32(order, _mm512_packs_epi16(h0, h1)));
            }
            cs[i] = _mm512_fnmadd_ps(sq, _mm512_set1_ps(centre), acc);
        }
        dec_hsum4(cs, cm + r0);
    }
}

/* kivi K: scores of R rows (a multiple of 4) against the 16 rows of codes at `codes` (one group of a page,
 * stride dec_kivi_cb): S[r][0 .. 16) = C[r] + sum over blocks of dq[r][b] * (q'_r . codes) over the block,
 * 4 rows x (qh, ql) = 8 VNNI chains per block */
static __attribute__((noinline)) void dec_k_group_kivi(int fmt, const uint8_t *codes, const int32_t *qx,
                                                       const int32_t *qh, const int32_t *ql, const float *dq,
                                                       const float *cm, int R, float *S, dec_pf *pf, int quota) {
    const __m512i m4 = _mm512_set1_epi8(0x0f), m2 = _mm512_set1_epi8(0x03);
    for (int r0 = 0; r0 < R; r0 += 4) {
        __m512 s0 = _mm512_set1_ps(cm[r0]), s1 = _mm512_set1_ps(cm[r0 + 1]);
        __m512 s2 = _mm512_set1_ps(cm[r0 + 2]), s3 = _mm512_set1_ps(cm[r0 + 3]);
        for (int b = 0; b < DEC_NB; b++) {
            dec_pf_pump(pf, quota);
            __m512i n[4], kt[8];
            if (fmt == KV_KIVI4) {
                dec_transpose(codes, DEC_D / 2, 16 * b, n);
                for (int j = 0; j < 4; j++) {
                    kt[j] = _mm512_and_si512(n[j], m4);
                    kt[4 + j] = _mm512_and_si512(_mm512_srli_epi16(n[j], 4), m4);
                }
            } else { /* channels 4j.. of block b: dword 2b + (j & 1) of the row, field j >> 1 */
                dec_transpose(codes, DEC_D / 4, 16 * (b >> 1), n);
                for (int j = 0; j < 8; j++)
                    kt[j] = _mm512_and_si512(_mm512_srli_epi16(n[2 * (b & 1) + (j & 1)], 2 * (j >> 1)), m2);
            }
            const int32_t *a = qh + (size_t)r0 * 32 + 8 * b, *e = ql + (size_t)r0 * 32 + 8 * b;
            __m512i h0 = _mm512_setzero_si512(), h1 = h0, h2 = h0, h3 = h0, l0 = h0, l1 = h0, l2 = h0, l3 = h0;
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++) {
                DPBUSD_B(h0, kt[j], a[j]);
                DPBUSD_B(h1, kt[j], a[32 + j]);
                DPBUSD_B(h2, kt[j], a[64 + j]);
                DPBUSD_B(h3, kt[j], a[96 + j]);
                DPBUSD_B(l0, kt[j], e[j]);
                DPBUSD_B(l1, kt[j], e[32 + j]);
                DPBUSD_B(l2, kt[j], e[64 + j]);
                DPBUSD_B(l3, kt[j], e[96 + j]);
            }
            if (fmt == KV_KIVI2) { /* the third byte: h becomes x * 256 + h */
                const int32_t *x = qx + (size_t)r0 * 32 + 8 * b;
                __m512i x0 = _mm512_setzero_si512(), x1 = x0, x2 = x0, x3 = x0;
#pragma GCC unroll 8
                for (int j = 0; j < 8; j++) {
                    DPBUSD_B(x0, kt[j], x[j]);
                    DPBUSD_B(x1, kt[j], x[32 + j]);
                    DPBUSD_B(x2, kt[j], x[64 + j]);
                    DPBUSD_B(x3, kt[j], x[96 + j]);
                }
                h0 = _mm512_add_epi32(_mm512_slli_epi32(x0, 8), h0);
                h1 = _mm512_add_epi32(_mm512_slli_epi32(x1, 8), h1);
                h2 = _mm512_add_epi32(_mm512_slli_epi32(x2, 8), h2);
                h3 = _mm512_add_epi32(_mm512_slli_epi32(x3, 8), h3);
            }
            const float *dqb = dq + (size_t)r0 * DEC_NB + b;
#define DEC_KIVI_ACC(S, H, Lo, i) \
    S = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(H, 8), Lo)), _mm512_set1_ps(dqb[(i) * DEC_NB]), S)
            DEC_KIVI_ACC(s0, h0, l0, 0);
            DEC_KIVI_ACC(s1, h1, l1, 1);
            DEC_KIVI_ACC(s2, h2, l2, 2);
            DEC_KIVI_ACC(s3, h3, l3, 3);
#undef DEC_KIVI_ACC
        }
        _mm512_storeu_ps(S + (size_t)r0 * KV_T, s0);
        _mm512_storeu_ps(S + (size_t)(r0 + 1) * KV_T, s1);
        _mm512_storeu_ps(S + (size_t)(r0 + 2) * KV_T, s2);
        _mm512_storeu_ps(S + (size_t)(r0 + 3) * KV_T, s3);
    }
}

/* dec_k_unit for nvfp4: one row at a time, an integer sum per 16-value sub-block (kt[j] is sub-block
 * (j >> 1) & 1 of the block; q's groups were permuted to kt's order), 8 chains */
static __attribute__((noinline)) void dec_k_unit_nv(const uint8_t *g0, const uint8_t *g1, const int_ws *L, int r0,
                                                    int R, int col, float *S, dec_pf *pf, int quota) {
    for (int b = 0; b < DEC_NB; b++) {
        dec_pf_pump(pf, quota);
        __m512i k0[8], k1[8];
        dec_k_block(KV_NVFP4, g0, b, k0);
        dec_k_block(KV_NVFP4, g1, b, k1);
        const float *kd = L->kd + 2 * b * KV_T + col;
        const __m512 d00 = _mm512_loadu_ps(kd), d01 = _mm512_loadu_ps(kd + KV_T);
        const __m512 d10 = _mm512_loadu_ps(kd + 16), d11 = _mm512_loadu_ps(kd + KV_T + 16);
        for (int r = 0; r < R; r++) {
            const size_t ra = (size_t)(r0 + r) * DEC_NB + b;
            const int32_t *qh = L->qh + ra * 8, *ql = L->ql + ra * 8, *qo = L->qoffs + 2 * ra;
            __m512i h00 = _mm512_setzero_si512(), h01 = h00, h10 = h00, h11 = h00;
            __m512i l00 = _mm512_set1_epi32(qo[0]), l10 = l00, l01 = _mm512_set1_epi32(qo[1]), l11 = l01;
#pragma GCC unroll 4
            for (int j = 0; j < 8; j += 4) { /* j, j + 1: sub-block 0; j + 2, j + 3: sub-block 1 */
#define DEC_NV_STEP(J, H0, H1, L0, L1)                                                                           \
    do {                                                                                                         \
        __m512i q = _mm512_set1_epi32(qh[J]);                                                                    \
        INT_DPB(H0, k0[J], q);                                                                                   \
        INT_DPB(H1, k1[J], q);                                                                                   \
        q = _mm512_set1_epi32(ql[J]);                                                                            \
        INT_DPB(L0, k0[J], q);                                                                                   \
        INT_DPB(L1, k1[J], q);                                                                                   \
    } while (0)
                DEC_NV_STEP(j, h00, h10, l00, l10);
                DEC_NV_STEP(j + 2, h01, h11, l01, l11);
                DEC_NV_STEP(j + 1, h00, h10, l00, l10);
                DEC_NV_STEP(j + 3, h01, h11, l01, l11);
#undef DEC_NV_STEP
            }
#define DEC_NV_OUT(HA, LA, DA, HB, LB, DB, S)                                                                    \
    do {                                                                                                         \
        const __m512 da = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(HA, 8), LA));                    \
        const __m512 db = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(HB, 8), LB));                    \
        const __m512 x = _mm512_fmadd_ps(db, DB, _mm512_mul_ps(da, DA));                                         \
        _mm512_storeu_ps(S, b ? _mm512_add_ps(_mm512_loadu_ps(S), x) : x);                                       \
    } while (0)
            float *sa = S + r * KV_T + col;
            DEC_NV_OUT(h00, l00, d00, h01, l01, d01, sa);
            DEC_NV_OUT(h10, l10, d10, h11, l11, d11, sa + 16);
#undef DEC_NV_OUT
        }
    }
}

/* P.V of 4 rows over block b of one tile: acc[2i], acc[2i+1] = dims of block b (kernel order) of row i.
 * w: int16 weight pairs of row 0 at block b (stride between rows in int32 pairs); INT_V_ACC4 accumulates. */
#define DEC_V_BEGIN(w, stride)                                                                  \
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0; \
    const int32_t *w0 = w, *w1 = w + stride, *w2 = w + 2 * stride, *w3 = w + 3 * stride
#define DEC_V_END(out) out[0] = a0, out[1] = a1, out[2] = a2, out[3] = a3, out[4] = a4, out[5] = a5, out[6] = a6, out[7] = a7

/* q8_0: rows 2u and 2u+1 of a group interleaved by bytes within 128-bit lanes, sign-extended */
static __attribute__((noinline)) void dec_v_q8(const uint8_t *const *grp, int ng, int b, const int32_t *w,
                                               size_t stride, __m512i *out, dec_pf *pf, int quota) {
    DEC_V_BEGIN(w, stride);
    for (int g = 0; g < ng; g++) {
        dec_pf_pump(pf, quota);
        const uint8_t *p = grp[g] + KV_Q8_0_BYTES * b + 2;
        for (int u = 0; u < 8; u++, p += 2 * DEC_Q8_RB) {
            __m256i x = _mm256_loadu_si256((const __m256i *)(const void *)p);
            __m256i e = _mm256_loadu_si256((const __m256i *)(const void *)(p + DEC_Q8_RB));
            __m512i x0 = _mm512_cvtepi8_epi16(_mm256_unpacklo_epi8(x, e));
            __m512i x1 = _mm512_cvtepi8_epi16(_mm256_unpackhi_epi8(x, e));
            INT_V_ACC4(x0, x1, 8 * g + u);
        }
    }
    DEC_V_END(out);
}

/* q4_0 (and q4_1's nibbles): both rows' 16 nibble bytes interleaved, zero-extended to int16 pairs (a VBMI
 * VPERMT2B version measured no faster on Zen 5) */
static __attribute__((noinline)) void dec_v_q4(int fmt, const uint8_t *const *grp, int ng, int b, const int32_t *w,
                                               size_t stride, __m512i *out, dec_pf *pf, int quota) {
    DEC_V_BEGIN(w, stride);
    const __m512i m4 = _mm512_set1_epi16(0x0f);
    const int rb = dec_rb(fmt), qs = dec_qs(fmt, b);
    for (int g = 0; g < ng; g++) {
        dec_pf_pump(pf, quota);
        const uint8_t *p = grp[g] + qs;
        for (int u = 0; u < 8; u++, p += 2 * rb) {
            __m128i x = _mm_loadu_si128((const __m128i *)(const void *)p);
            __m128i e = _mm_loadu_si128((const __m128i *)(const void *)(p + rb));
            __m512i z = _mm512_cvtepu8_epi16(
                _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_unpacklo_epi8(x, e)), _mm_unpackhi_epi8(x, e), 1));
            __m512i x0 = _mm512_and_si512(z, m4), x1 = _mm512_srli_epi16(z, 4);
            INT_V_ACC4(x0, x1, 8 * g + u);
        }
    }
    DEC_V_END(out);
}

/* kivi2: both rows' 8 code bytes interleaved, zero-extended to int16 pairs; fields 0 and 1 (values 0-15) and
 * 2 and 3 (16-31) in natural order */
static __attribute__((noinline)) void dec_v_k2(const uint8_t *const *grp, int ng, int b, const int32_t *w,
                                               size_t stride, __m512i *out, dec_pf *pf, int quota) {
    DEC_V_BEGIN(w, stride);
    const __m512i m2 = _mm512_set1_epi16(0x03);
    const int rb = dec_rb(KV_KIVI2), qs = dec_qs(KV_KIVI2, b);
    for (int g = 0; g < ng; g++) {
        dec_pf_pump(pf, quota);
        const uint8_t *p = grp[g] + qs;
        for (int u = 0; u < 8; u++, p += 2 * rb) {
            const __m128i x = _mm_loadl_epi64((const __m128i *)(const void *)p);
            const __m128i e = _mm_loadl_epi64((const __m128i *)(const void *)(p + rb));
            const __m256i z = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(x, e));
            const __m512i zz = _mm512_inserti64x4(_mm512_castsi256_si512(z), _mm256_srli_epi16(z, 2), 1);
            __m512i x0 = _mm512_and_si512(zz, m2), x1 = _mm512_and_si512(_mm512_srli_epi16(zz, 4), m2);
            INT_V_ACC4(x0, x1, 8 * g + u);
        }
    }
    DEC_V_END(out);
}

/* mxfp4 / nvfp4: as q4_0, the nibbles looked up as their signed doubled values before the widening.
 * nvfp4: lanes 0-7 are the block's first sub-block, 8-15 its second, each with its own weight (w, w2) */
#define DEC_V_FP4(NV)                                                                                            \
    DEC_V_BEGIN(w, stride);                                                                                      \
    const int rb = dec_rb(fmt), qs = dec_qs(fmt, b);                                                             \
    const __m256i m4 = _mm256_set1_epi8(0x0f), tab = _mm256_load_si256((const __m256i *)(const void *)dec_e2m1_s); \
    for (int g = 0; g < ng; g++) {                                                                               \
        dec_pf_pump(pf, quota);                                                                                  \
        const uint8_t *p = grp[g] + qs;                                                                          \
        for (int u = 0; u < 8; u++, p += 2 * rb) {                                                               \
            __m128i x = _mm_loadu_si128((const __m128i *)(const void *)p);                                       \
            __m128i e = _mm_loadu_si128((const __m128i *)(const void *)(p + rb));                                \
            __m256i z = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_unpacklo_epi8(x, e)),              \
                                                _mm_unpackhi_epi8(x, e), 1);                                     \
            __m512i x0 = _mm512_cvtepi8_epi16(_mm256_shuffle_epi8(tab, _mm256_and_si256(z, m4)));                \
            __m512i x1 = _mm512_cvtepi8_epi16(_mm256_shuffle_epi8(tab, _mm256_and_si256(_mm256_srli_epi16(z, 4), m4))); \
            if (NV)                                                                                              \
                DEC_V_ACC4_NV(x0, x1, 8 * g + u);                                                                \
            else                                                                                                 \
                INT_V_ACC4(x0, x1, 8 * g + u);                                                                   \
        }                                                                                                        \
    }                                                                                                            \
    DEC_V_END(out)

#define DEC_V_ACC4_NV(X0, X1, U)                                                                                 \
    do {                                                                                                         \
        __m512i wb = _mm512_mask_set1_epi32(_mm512_set1_epi32(w0[U]), 0xff00, w0[U + KV_T / 2]);                 \
        INT_DPW(a0, X0, wb);                                                                                     \
        INT_DPW(a1, X1, wb);                                                                                     \
        wb = _mm512_mask_set1_epi32(_mm512_set1_epi32(w1[U]), 0xff00, w1[U + KV_T / 2]);                         \
        INT_DPW(a2, X0, wb);                                                                                     \
        INT_DPW(a3, X1, wb);                                                                                     \
        wb = _mm512_mask_set1_epi32(_mm512_set1_epi32(w2[U]), 0xff00, w2[U + KV_T / 2]);                         \
        INT_DPW(a4, X0, wb);                                                                                     \
        INT_DPW(a5, X1, wb);                                                                                     \
        wb = _mm512_mask_set1_epi32(_mm512_set1_epi32(w3[U]), 0xff00, w3[U + KV_T / 2]);                         \
        INT_DPW(a6, X0, wb);                                                                                     \
        INT_DPW(a7, X1, wb);                                                                                     \
    } while (0)

static __attribute__((noinline)) void dec_v_mx(const uint8_t *const *grp, int ng, int b, const int32_t *w,
                                               size_t stride, __m512i *out, dec_pf *pf, int quota) {
    const int fmt = KV_MXFP4;
    DEC_V_FP4(0);
}
/* w: the weights of sub-block 2b; those of 2b + 1 follow, KV_T / 2 pairs on */
static __attribute__((noinline)) void dec_v_nv(const uint8_t *const *grp, int ng, int b, const int32_t *w,
                                               size_t stride, __m512i *out, dec_pf *pf, int quota) {
    const int fmt = KV_NVFP4;
    DEC_V_FP4(1);
}

/* nvfp4: q's 4-byte groups of each block in kt's order (sub-block 0's values 0-3, 4-7, sub-block 1's 0-3,
 * 4-7, then the 8-11, 12-15 of each) and the offset term per sub-block */
static void dec_prep_q_nv(int_ws *L, int RT) {
    static const int perm[8] = {0, 1, 4, 5, 2, 3, 6, 7};
    for (int rb = 0; rb < RT * DEC_NB; rb++) {
        int32_t *qh = L->qh + (size_t)rb * 8, *ql = L->ql + (size_t)rb * 8, h[8], l[8];
        int32_t sum[2] = {0, 0};
        for (int j = 0; j < 8; j++) {
            const int8_t *bh = (const int8_t *)(const void *)(qh + j), *bl = (const int8_t *)(const void *)(ql + j);
            for (int i = 0; i < 4; i++) sum[j >> 2] += 256 * bh[i] + bl[i];
        }
        for (int j = 0; j < 8; j++) h[j] = qh[perm[j]], l[j] = ql[perm[j]];
        memcpy(qh, h, sizeof h);
        memcpy(ql, l, sizeof l);
        L->qoffs[2 * rb] = -12 * sum[0];
        L->qoffs[2 * rb + 1] = -12 * sum[1];
    }
}

/* the codes of a 16-row group of a kivi K page for KV head h: `row` is the group's first row at head 0
 * (page * n_kv_heads * block_size + u, u = j % block_size for its first token j) */
static inline const uint8_t *dec_kivi_codes(const kv_call *c, int64_t row, int j, int h) {
    const int u = j % c->block_size;
    return c->kpool + (row - u + (int64_t)h * c->block_size) * c->krow + (int64_t)u * dec_kivi_cb(c->kfmt);
}

static int dec_item(const kv_call *c, const kv_item *it, kv_scratch *ws, float *pm, float *pl, float *po) {
    if (!dec_applies(c, it)) return 0;
    const int G = c->n_heads / c->n_kv_heads, R = G, RT = R * it->nheads, s = it->seq;
    const int kf = c->kfmt, vf = c->vfmt, kivi = c->kpaged, krb = kivi ? dec_kivi_cb(kf) : dec_rb(kf), vrb = dec_rb(vf);
    const int64_t qpos = c->q_start[s] + it->pos0;
    for (int hh = 0; hh < it->nheads; hh++) {
        const float *src = c->q + (qpos * c->n_heads + (int64_t)(it->head0 + hh) * G) * DEC_D;
        float *dst = ws->qf + (size_t)hh * R * DEC_D;
        const __m512 sc = _mm512_set1_ps(c->scale2);
        for (int j = 0; j < G * DEC_D; j += 16) _mm512_storeu_ps(dst + j, _mm512_mul_ps(_mm512_loadu_ps(src + j), sc));
    }
    for (int r = 0; r < RT; r++) ws->m[r] = -INFINITY, ws->l[r] = 0.0f;
    memset(ws->o, 0, (size_t)RT * DEC_D * sizeof(float));
    if (!kivi) int_prep_q(c, ws, RT); /* kivi K quantizes q per page instead (dec_prep_q_kivi) */
    int_ws L = int_get(c, ws, RT);
    if (kivi) dec_kivi_q(ws->qf, RT, kf == KV_KIVI2, L.pks, L.pqm);
    if (kf == KV_NVFP4) dec_prep_q_nv(&L, RT);
    const int voff = vf == KV_Q4_0 || vf == KV_Q4_1 ? 8 : vf == KV_KIVI2 ? 2 : 0, nsv = dec_ns(vf); /* V: q4_0 stored +8, q4_1 centred;
                                                                                  e2m1 values signed */
    const size_t wstride = (size_t)nsv * KV_T / 2;
    const int lo = it->lo, hi = it->hi, first = lo & ~15;

    /* row index (at head 0) of each 16-row group of a tile: one block-table lookup per group and tile */
    const int32_t *bt = c->block_table + (int64_t)s * c->max_blocks;
    const int64_t head_rows = c->block_size;
#define DEC_GROUP_ROWS(t0, out, n)                                                                  \
    for (int g = 0; g < KV_T / 16; g++) {                                                           \
        int j = (t0) + 16 * (g < (n) ? g : 0); /* groups past the end repeat group 0: masked */     \
        out[g] = (int64_t)bt[j / c->block_size] * c->n_kv_heads * head_rows + j % c->block_size;    \
    }
    int64_t cur[KV_T / 16], nxt[KV_T / 16];
    int ng = (hi - first) / 16 + 1 < KV_T / 16 ? (hi - first) / 16 + 1 : KV_T / 16;
    DEC_GROUP_ROWS(first, cur, ng);
    for (int t0 = first; t0 <= hi; t0 += KV_T) {
        ng = (hi - t0) / 16 + 1 < KV_T / 16 ? (hi - t0) / 16 + 1 : KV_T / 16;
        const int t1 = t0 + KV_T, ng1 = t1 > hi ? 0 : (hi - t1) / 16 + 1 < KV_T / 16 ? (hi - t1) / 16 + 1 : KV_T / 16;
        if (ng1) DEC_GROUP_ROWS(t1, nxt, ng1);
        /* visible columns of this tile: [a, b] */
        const int a = lo > t0 ? lo - t0 : 0, bcol = hi - t0 < KV_T - 1 ? hi - t0 : KV_T - 1;
        for (int hh = 0; hh < it->nheads; hh++) {
            const int h = it->head0 + hh, r0 = hh * R;
            const uint8_t *kg[KV_T / 16], *vg[KV_T / 16];
            for (int g = 0; g < KV_T / 16; g++) {
                kg[g] = kivi ? dec_kivi_codes(c, cur[g], t0 + 16 * (g < ng ? g : 0), h)
                             : c->kpool + (cur[g] + h * head_rows) * krb;
                vg[g] = c->vpool + (cur[g] + h * head_rows) * vrb;
            }
            /* the next step's rows (next head of this tile, else the next tile's first head): its K
             * during this step's K work, its V during this step's V work */
            dec_pf pfk = {{0}, 0, 0, 0, 16 * krb}, pfv = {{0}, 0, 0, 0, 16 * vrb};
            int kq = 0, vq = 0; /* lines per K block / per V call; 0 (and no divisions) with prefetch off */
            if (c->prefetch) {
                const int last = hh + 1 == it->nheads, n = last ? ng1 : ng;
                const int64_t *rows = last ? nxt : cur, ph = last ? it->head0 : h + 1;
                for (int g = 0; g < n; g++) {
                    pfk.p[pfk.n++] = kivi ? dec_kivi_codes(c, rows[g], (last ? t1 : t0) + 16 * g, (int)ph)
                                          : c->kpool + (rows[g] + ph * head_rows) * krb;
                    pfv.p[pfv.n++] = c->vpool + (rows[g] + ph * head_rows) * vrb;
                }
                const int kcalls = kivi ? ng * (R / 4) * DEC_NB : 2 * DEC_NB; /* dec_pf_pump calls of the K work */
                kq = (pfk.n * 16 * krb / 64 + kcalls - 1) / kcalls;
                vq = (pfv.n * 16 * vrb / 64 + DEC_NB * ng * (R / 4) - 1) / (DEC_NB * ng * (R / 4));
            }
            if (kivi) { /* K: q prepared once per page, then scores of 16 tokens at a time */
                const uint8_t *prev = NULL;
                int slot = -1;
                for (int g = 0; g < ng; g++) {
                    const uint8_t *scales = kg[g] + (c->block_size - (t0 + 16 * g) % c->block_size) * krb;
                    if (scales != prev) {
                        slot++;
                        dec_prep_q_kivi(ws->qf + (size_t)r0 * DEC_D, L.pks + (size_t)r0 * DEC_D, L.pqm + (size_t)r0 * DEC_NB, R, scales, kf == KV_KIVI2, L.pqx + (size_t)slot * R * 32, L.pqh + (size_t)slot * R * 32,
                                        L.pql + (size_t)slot * R * 32, L.pdq + (size_t)slot * R * DEC_NB, L.pc + slot * R);
                        prev = scales;
                    }
                    dec_k_group_kivi(kf, kg[g], L.pqx + (size_t)slot * R * 32, L.pqh + (size_t)slot * R * 32, L.pql + (size_t)slot * R * 32,
                                     L.pdq + (size_t)slot * R * DEC_NB, L.pc + slot * R, R, ws->s + 16 * g, &pfk, kq);
                }
            } else { /* K: scales, then scores of 32 tokens at a time */
            for (int g = 0; g < KV_T / 16; g++) {
                if (kf == KV_Q4_1)
                    dec_vmin_scales16(kf, kg[g], L.kd + 16 * g, L.km + 16 * g);
                else
                    dec_scales16(kf, kg[g], L.kd + 16 * g);
            }
            for (int u = 0; u < KV_T / 32; u++) {
                if (kf == KV_NVFP4)
                    dec_k_unit_nv(kg[2 * u], kg[2 * u + 1], &L, r0, R, 32 * u, ws->s, &pfk, kq);
                else
                    dec_k_unit(kf, kg[2 * u], kg[2 * u + 1], &L, r0, R, 32 * u, ws->s, &pfk, kq);
            }
            }
            /* softmax: scale by dq, mask, online max/sum */
            for (int r = 0; r < R; r++) {
                float *srow = ws->s + r * KV_T;
                const __m512 dq = _mm512_set1_ps(kivi ? 1.0f : L.dq[r0 + r]); /* kivi: scores are final */
                __m512 sv[KV_T / 16], mx = _mm512_set1_ps(-INFINITY);
                for (int i = 0; i < KV_T / 16; i++) {
                    __mmask16 keep = 0xffff;
                    if (a > 16 * i) keep &= (__mmask16)(0xffffu << (a - 16 * i < 16 ? a - 16 * i : 16));
                    if (bcol < 16 * i + 15) keep &= (__mmask16)(bcol < 16 * i ? 0 : 0xffffu >> (15 - (bcol - 16 * i)));
                    sv[i] = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), keep, _mm512_loadu_ps(srow + 16 * i), dq);
                    mx = _mm512_max_ps(mx, sv[i]);
                }
                const float mt = _mm512_reduce_max_ps(mx);
                if (mt == -INFINITY) { /* nothing of this tile is visible to the row, unless a NaN score hid from
                                        * the max (maxps keeps one operand): then the row's output is NaN */
                    for (int i = 0; i < KV_T / 16; i++)
                        if (_mm512_cmp_ps_mask(sv[i], sv[i], _CMP_UNORD_Q)) *(ws->l + r0 + r) = NAN;
                    memset(srow, 0, KV_T * sizeof(float));
                    continue;
                }
                float *m = ws->m + r0 + r, *l = ws->l + r0 + r, *o = ws->o + (size_t)(r0 + r) * DEC_D;
                if (mt > *m) {
                    const float corr = *m == -INFINITY ? 0.0f : exp2f(*m - mt);
                    *l *= corr;
                    const __m512 cv = _mm512_set1_ps(corr);
                    for (int i = 0; i < DEC_D; i += 16) _mm512_storeu_ps(o + i, _mm512_mul_ps(_mm512_loadu_ps(o + i), cv));
                    *m = mt;
                }
                const __m512 mv = _mm512_set1_ps(*m);
                __m512 sum = _mm512_setzero_ps();
                for (int i = 0; i < KV_T / 16; i++) {
                    const __m512 p = kv_exp2_512(_mm512_sub_ps(sv[i], mv)); /* -inf - m -> 0 */
                    _mm512_storeu_ps(srow + 16 * i, p);
                    sum = _mm512_add_ps(sum, p);
                }
                *l += _mm512_reduce_add_ps(sum);
            }
            /* V: scales, 16-bit weights p*d_v, P.V */
            for (int g = 0; g < KV_T / 16; g++) {
                if (dec_vmin(vf))
                    dec_vmin_scales16(vf, vg[g], L.vd + 16 * g, L.vm + 16 * g);
                else
                    dec_scales16(vf, vg[g], L.vd + 16 * g);
            }
            for (int k0 = 0; k0 < R * nsv; k0 += 16) int_v_weights16(ws->s, L.vd, nsv, k0, voff != 0, L.w, L.wc, L.wsum);
            if (dec_vmin(vf)) /* the min term: sum over the tile of p * (m + centre * d), per row and block */
                for (int r = 0; r < R; r++) {
                    __m512 acc[DEC_NB] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
                    for (int i = 0; i < KV_T; i += 16) {
                        const __m512 p = _mm512_loadu_ps(ws->s + r * KV_T + i);
                        for (int b = 0; b < DEC_NB; b++) acc[b] = _mm512_fmadd_ps(p, _mm512_loadu_ps(L.vm + b * KV_T + i), acc[b]);
                    }
                    dec_hsum4(acc, L.vsum + r * DEC_NB);
                }
            for (int b = 0; b < DEC_NB; b++) {
                const int sl = vf == KV_NVFP4 ? 2 * b : b; /* weight slot of the block (nvfp4: its first sub-block) */
                for (int r = 0; r < R; r += 4) {
                    __m512i acc[8];
                    const int32_t *w = (const int32_t *)(const void *)(L.w + ((size_t)r * nsv + sl) * KV_T);
                    if (vf == KV_Q8_0)
                        dec_v_q8(vg, ng, b, w, wstride, acc, &pfv, vq);
                    else if (vf == KV_Q4_0 || vf == KV_Q4_1)
                        dec_v_q4(vf, vg, ng, b, w, wstride, acc, &pfv, vq);
                    else if (vf == KV_KIVI2)
                        dec_v_k2(vg, ng, b, w, wstride, acc, &pfv, vq);
                    else if (vf == KV_MXFP4)
                        dec_v_mx(vg, ng, b, w, wstride, acc, &pfv, vq);
                    else
                        dec_v_nv(vg, ng, b, w, wstride, acc, &pfv, vq);
                    for (int i = 0; i < 4; i++) {
                        const int rb = (r + i) * nsv + sl, rb2 = vf == KV_NVFP4 ? rb + 1 : rb;
                        const float mt = dec_vmin(vf) ? L.vsum[(r + i) * DEC_NB + b] : 0.0f;
                        if (L.wc[rb] == 0.0f && L.wc[rb2] == 0.0f && mt == 0.0f) continue;
                        const __m512i off = _mm512_set1_epi32(voff * L.wsum[rb]);
                        const __m512 cw = _mm512_mask_blend_ps(0xff00, _mm512_set1_ps(L.wc[rb]), _mm512_set1_ps(L.wc[rb2]));
                        const __m512 mv = _mm512_set1_ps(mt);
                        float *o = ws->o + (size_t)(r0 + r + i) * DEC_D + 32 * b;
                        _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[2 * i], off)), cw,
                                                            _mm512_add_ps(_mm512_loadu_ps(o), mv)));
                        _mm512_storeu_ps(o + 16, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[2 * i + 1], off)),
                                                                 cw, _mm512_add_ps(_mm512_loadu_ps(o + 16), mv)));
                    }
                }
            }
        }
        memcpy(cur, nxt, sizeof cur);
    }
#undef DEC_GROUP_ROWS

    for (int r = 0; r < RT; r++) {
        float *dst;
        const float inv = kv_item_row_end(c, it, r, ws->m, ws->l, pm, pl, po, &dst);
        if (dec_vmin(vf)) /* dec_v_q4's and dec_v_k2's natural order (the general kernels keep q4_1 permuted) */
            for (int j = 0; j < DEC_D; j++) dst[j] = ws->o[(size_t)r * DEC_D + j] * inv;
        else
            int_v_unpermute(c, ws->o + (size_t)r * DEC_D, dst, inv);
    }
    return 1;
}
#define DECODE_ITEM(c, it, ws, pm, pl, po) dec_item(c, it, ws, pm, pl, po)
