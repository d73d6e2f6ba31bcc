/* The kernels every ISA shares, written once over a small vector layer and compiled per ISA.
 *
 * The including file defines FN(name) (a per-ISA suffix), the vector layer (VF, VL, vload, vstore,
 * vset1, vzero, vadd, vsub, vmul, vfma, vmax, vhsum, vhmax, vexp2) and the fp16 row converters
 * F16_TO_F32(src, dst, n) / F32_TO_F16(src, dst, n) / F32_TO_F16_1(x). It may also provide integer
 * attention kernels (INT_PATH_K / INT_PATH_V, see kern_avx512.c); everything else takes the f32
 * path below: each K/V tile is dequantized into a small L1 buffer and consumed with f32 FMA.
 *
 * Quantizers are bit-exact with kvhal/formats/ggml.py: the build uses -ffp-contract=off so that
 * x*id + 8.5f stays two roundings, as in numpy.
 */
#include <math.h>
#include <string.h>

#include "half.h"
#include "kvcpu.h"

#ifndef KV_PF_STEPS
#define KV_PF_STEPS 2 /* (tile, head) steps of rows requested ahead */
#endif

#ifndef INT_PATH_K
#define INT_PATH_K(fmt) 0
#define INT_PATH_V(fmt) 0
#endif

/* ---- quantize: one row of d floats into ggml bytes ----------------------------------------------- */

KV_INLINE float FN(inverse)(float d) {
    float id = 1.0f / d;
    /* ggml's d ? 1/d : 0; a subnormal d whose inverse overflows also gets 0 (its fp16 scale is 0) */
    return (d == 0.0f || !isfinite(id)) ? 0.0f : id;
}

KV_INLINE void FN(put_f16)(uint8_t *p, float x) {
    uint16_t h = F32_TO_F16_1(x);
    memcpy(p, &h, 2);
}

static void FN(q8_0_block)(const float *x, uint8_t *y) {
    float amax = 0.0f;
    for (int i = 0; i < KV_QK; i++) {
        float a = fabsf(x[i]);
        amax = a > amax ? a : amax;
    }
    float d = amax / 127.0f, id = FN(inverse)(d);
    FN(put_f16)(y, d);
    int8_t *q = (int8_t *)(y + 2);
    for (int i = 0; i < KV_QK; i++) {
        /* C roundf, half away from zero, exactly: |v| - trunc|v| is exact, so no 0.49999997 + 0.5 = 1 */
        float v = x[i] * id, a = fabsf(v);
        int r = (int)a;
        r += a - (float)r >= 0.5f;
        q[i] = (int8_t)(v < 0.0f ? -r : r);
    }
}

/* ggml's loop: the signed value of largest magnitude, first occurrence on ties, and +0.0 for a block
 * of zeros (its max starts at 0.0f and moves only on a strictly larger |v|) */
KV_INLINE float FN(signed_absmax)(const float *x) {
    float amax = 0.0f, mx = 0.0f;
    for (int i = 0; i < KV_QK; i++) {
        float a = fabsf(x[i]);
        if (a > amax) {
            amax = a;
            mx = x[i];
        }
    }
    return mx;
}

/* ggml's `if (v < min) min = v; if (v > max) max = v`: first occurrence wins, which fixes the sign of a
 * zero min/max */
KV_INLINE void FN(minmax)(const float *x, float *lo, float *hi) {
    float mn = x[0], mx = x[0];
    for (int i = 1; i < KV_QK; i++) {
        mn = x[i] < mn ? x[i] : mn;
        mx = x[i] > mx ? x[i] : mx;
    }
    *lo = mn;
    *hi = mx;
}

KV_INLINE void FN(pack_nibbles)(const uint8_t *q, uint8_t *qs) {
    for (int j = 0; j < KV_QK / 2; j++) qs[j] = (uint8_t)((q[j] & 0x0f) | ((q[j + KV_QK / 2] & 0x0f) << 4));
}

KV_INLINE void FN(pack_high_bits)(const uint8_t *q, uint8_t *qh) {
    uint32_t h = 0;
    for (int j = 0; j < KV_QK; j++) h |= (uint32_t)((q[j] >> 4) & 1) << j;
    memcpy(qh, &h, 4); /* little-endian, as ggml */
}

static void FN(q4_0_block)(const float *x, uint8_t *y) {
    float d = FN(signed_absmax)(x) / -8.0f, id = FN(inverse)(d);
    FN(put_f16)(y, d);
    uint8_t q[KV_QK];
    for (int i = 0; i < KV_QK; i++) {
        int v = (int)(x[i] * id + 8.5f);
        q[i] = (uint8_t)(v > 15 ? 15 : v);
    }
    FN(pack_nibbles)(q, y + 2);
}

static void FN(q4_1_block)(const float *x, uint8_t *y) {
    float lo, hi;
    FN(minmax)(x, &lo, &hi);
    float d = (hi - lo) / 15.0f, id = FN(inverse)(d);
    FN(put_f16)(y, d);
    FN(put_f16)(y + 2, lo);
    uint8_t q[KV_QK];
    for (int i = 0; i < KV_QK; i++) {
        int v = (int)((x[i] - lo) * id + 0.5f);
        q[i] = (uint8_t)(v > 15 ? 15 : v);
    }
    FN(pack_nibbles)(q, y + 4);
}

static void FN(q5_0_block)(const float *x, uint8_t *y) {
    float d = FN(signed_absmax)(x) / -16.0f, id = FN(inverse)(d);
    FN(put_f16)(y, d);
    uint8_t q[KV_QK];
    for (int i = 0; i < KV_QK; i++) {
        int v = (int)(x[i] * id + 16.5f);
        q[i] = (uint8_t)(v > 31 ? 31 : v);
    }
    FN(pack_high_bits)(q, y + 2);
    FN(pack_nibbles)(q, y + 6);
}

static void FN(q5_1_block)(const float *x, uint8_t *y) {
    float lo, hi;
    FN(minmax)(x, &lo, &hi);
    float d = (hi - lo) / 31.0f, id = FN(inverse)(d);
    FN(put_f16)(y, d);
    FN(put_f16)(y + 2, lo);
    uint8_t q[KV_QK];
    for (int i = 0; i < KV_QK; i++) {
        int v = (int)((x[i] - lo) * id + 0.5f);
        q[i] = (uint8_t)(v > 31 ? 31 : v);
    }
    FN(pack_high_bits)(q, y + 4);
    FN(pack_nibbles)(q, y + 8);
}

#include "kern_v2.h" /* fp8, mxfp4, nvfp4, kivi rows */

static void FN(quantize)(int fmt, const float *x, uint8_t *dst, int d) {
    if (FN(v2_quantize)(fmt, x, dst, d)) return;
    switch (fmt) {
    case KV_F32:
        memcpy(dst, x, (size_t)d * 4);
        return;
    case KV_F16:
        F32_TO_F16(x, dst, d);
        return;
    case KV_BF16: {
        uint16_t *o = (uint16_t *)(void *)dst;
        for (int i = 0; i < d; i++) {
            uint32_t u = kv_f32_bits(x[i]); /* finite: the sum cannot overflow */
            o[i] = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
        }
        return;
    }
    default:
        break;
    }
#ifdef QUANT_BLOCK_OVERRIDE
    if (QUANT_BLOCK_OVERRIDE(fmt, x, dst, d)) return;
#endif
    void (*blk)(const float *, uint8_t *) = fmt == KV_Q8_0   ? FN(q8_0_block)
                                            : fmt == KV_Q4_0 ? FN(q4_0_block)
                                            : fmt == KV_Q4_1 ? FN(q4_1_block)
                                            : fmt == KV_Q5_0 ? FN(q5_0_block)
                                                             : FN(q5_1_block);
    for (int b = 0; b < d / KV_QK; b++) blk(x + b * KV_QK, dst + b * kv_block_bytes[fmt]);
}

/* ---- dequantize: one stored row into d floats ---------------------------------------------------- */

KV_INLINE float FN(get_f16)(const uint8_t *p) {
    float f;
    F16_TO_F32(p, &f, 1);
    return f;
}

static void FN(dequantize)(int fmt, const uint8_t *src, float *dst, int d) {
    if (FN(v2_dequantize)(fmt, src, dst, d)) return;
#ifdef DEQUANT_ROW_OVERRIDE
    if (DEQUANT_ROW_OVERRIDE(fmt, src, dst, d)) return;
#endif
    switch (fmt) {
    case KV_F32:
        memcpy(dst, src, (size_t)d * 4);
        return;
    case KV_F16:
        F16_TO_F32(src, dst, d);
        return;
    case KV_BF16:
        for (int i = 0; i < d; i++) dst[i] = kv_bits_f32((uint32_t)kv_load_u16(src + 2 * i) << 16);
        return;
    default:
        break;
    }
    for (int b = 0; b < d / KV_QK; b++, dst += KV_QK) {
        switch (fmt) {
        case KV_Q8_0: {
            const uint8_t *y = src + KV_Q8_0_BYTES * b;
            float s = FN(get_f16)(y);
            const int8_t *q = (const int8_t *)(y + 2);
            for (int i = 0; i < KV_QK; i++) dst[i] = s * (float)q[i];
            break;
        }
        case KV_Q4_0: {
            const uint8_t *y = src + KV_Q4_0_BYTES * b;
            float s = FN(get_f16)(y);
            for (int j = 0; j < 16; j++) {
                dst[j] = s * ((float)(y[2 + j] & 0x0f) - 8.0f);
                dst[j + 16] = s * ((float)(y[2 + j] >> 4) - 8.0f);
            }
            break;
        }
        case KV_Q4_1: {
            const uint8_t *y = src + KV_Q4_1_BYTES * b;
            float s = FN(get_f16)(y), m = FN(get_f16)(y + 2);
            for (int j = 0; j < 16; j++) {
                dst[j] = s * (float)(y[4 + j] & 0x0f) + m;
                dst[j + 16] = s * (float)(y[4 + j] >> 4) + m;
            }
            break;
        }
        case KV_Q5_0: {
            const uint8_t *y = src + KV_Q5_0_BYTES * b;
            float s = FN(get_f16)(y);
            uint32_t qh = kv_load_u32(y + 2);
            for (int j = 0; j < 16; j++) {
                int lo = (y[6 + j] & 0x0f) | (int)(((qh >> j) & 1u) << 4);
                int hi = (y[6 + j] >> 4) | (int)(((qh >> (j + 16)) & 1u) << 4);
                dst[j] = s * ((float)lo - 16.0f);
                dst[j + 16] = s * ((float)hi - 16.0f);
            }
            break;
        }
        default: { /* q5_1 */
            const uint8_t *y = src + KV_Q5_1_BYTES * b;
            float s = FN(get_f16)(y), m = FN(get_f16)(y + 2);
            uint32_t qh = kv_load_u32(y + 4);
            for (int j = 0; j < 16; j++) {
                int lo = (y[8 + j] & 0x0f) | (int)(((qh >> j) & 1u) << 4);
                int hi = (y[8 + j] >> 4) | (int)(((qh >> (j + 16)) & 1u) << 4);
                dst[j] = s * (float)lo + m;
                dst[j + 16] = s * (float)hi + m;
            }
            break;
        }
        }
    }
}

/* ---- f32 attention path ------------------------------------------------------------------------- */

KV_INLINE float FN(dot)(const float *a, const float *b, int n) {
    VF acc0 = vzero(), acc1 = vzero();
    int i = 0;
    for (; i + 2 * VL <= n; i += 2 * VL) {
        acc0 = vfma(vload(a + i), vload(b + i), acc0);
        acc1 = vfma(vload(a + i + VL), vload(b + i + VL), acc1);
    }
    for (; i + VL <= n; i += VL) acc0 = vfma(vload(a + i), vload(b + i), acc0);
    float s = vhsum(vadd(acc0, acc1));
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* rows [u0, u0 + n) of a per-channel K page (kivi_k.c's layout) -> f32 rows dst (stride dstride floats):
 * d * code + m, two roundings as the spec's numpy; one 32-channel group at a time, its scales converted
 * once for every row, fixed-length loops the compiler vectorizes for the ISA */
static void FN(kpage_rows)(int fmt, const uint8_t *page, int bs, int D, int u0, int n, float *dst, int64_t dstride) {
    const int four = fmt == KV_KIVI4, gb = four ? 16 : 8; /* code bytes per 32 channels */
    const int64_t cb = (int64_t)D / 32 * gb;
    const uint8_t *scales = page + bs * cb;
    float d[32], m[32], q[32];
    for (int e0 = 0; e0 < D; e0 += 32) {
        F16_TO_F32(scales + 2 * e0, d, 32);
        F16_TO_F32(scales + 2 * D + 2 * e0, m, 32);
        for (int u = 0; u < n; u++) {
            const uint8_t *y = page + (int64_t)(u0 + u) * cb + e0 / 32 * gb;
#ifdef KPAGE_GROUP
            KPAGE_GROUP(four, y, d, m, dst + u * dstride + e0); /* the ISA's vector version of the loops below */
            continue;
#endif
            if (four)
                for (int j = 0; j < 16; j++) {
                    q[j] = (float)(y[j] & 15);
                    q[j + 16] = (float)(y[j] >> 4);
                }
            else
                for (int j = 0; j < 8; j++) {
                    q[j] = (float)(y[j] & 3);
                    q[j + 8] = (float)((y[j] >> 2) & 3);
                    q[j + 16] = (float)((y[j] >> 4) & 3);
                    q[j + 24] = (float)(y[j] >> 6);
                }
            float *out = dst + u * dstride + e0;
            for (int i = 0; i < 32; i++) out[i] = d[i] * q[i] + m[i];
        }
    }
}

/* Prefill tiles (at least KV_GEMM_MIN_ROWS rows per KV head, an ISA that defines KV_GEMM_TILES): the products as a GEMM
 * micro-kernel, KV_MR rows x 2 vectors (of tokens for S, of dims for O) of accumulators in registers, so each
 * loaded K/V vector feeds KV_MR FMAs; the dot form below loads a vector per FMA and reduces every score
 * across lanes. S needs K transposed ([D][KV_T], tokens along lanes): the tile is converted, then transposed
 * once for all the rows. */
#define KV_MR 6
#if defined(KV_GEMM_TILES) && KV_T % (2 * VL) != 0
#error "KV_GEMM_TILES needs KV_T a multiple of two vectors"
#endif

#ifndef TRANSPOSE_TILE
static void FN(transpose_tile)(const float *src, float *dst, int D) { /* [KV_T][D] -> [D][KV_T] */
    for (int t = 0; t < KV_T; t++)
        for (int j = 0; j < D; j++) dst[(size_t)j * KV_T + t] = src[(size_t)t * D + j];
}
#define TRANSPOSE_TILE(src, dst, D) FN(transpose_tile)(src, dst, D)
#endif

/* C[r] (+)= sum_k A[r][k] B[k] for r < R, over N columns of C and B (a multiple of two vectors): the
 * micro-kernel of both products, S = Q.K^T (A = q, B = K transposed) and O += P.V (A = P, B = V rows);
 * inlined into each, whose constant strides and trip counts it then runs at the speed of a copy of its own */
KV_INLINE void FN(gemm_tile)(const float *A, int lda, int K, const float *B, int ldb, int N, float *C, int ldc,
                             int R, int accumulate) {
    for (int r0 = 0; r0 < R; r0 += KV_MR) {
        const int nr = R - r0 < KV_MR ? R - r0 : KV_MR;
        const float *ar[KV_MR]; /* rows past R repeat row r0; their sums are not stored */
        float *cr[KV_MR];
        for (int i = 0; i < KV_MR; i++) {
            ar[i] = A + (size_t)(r0 + (i < nr ? i : 0)) * lda;
            cr[i] = C + (size_t)(r0 + (i < nr ? i : 0)) * ldc;
        }
        for (int n = 0; n < N; n += 2 * VL) {
            VF c[KV_MR][2];
            for (int i = 0; i < KV_MR; i++) {
                c[i][0] = accumulate ? vload(cr[i] + n) : vzero();
                c[i][1] = accumulate ? vload(cr[i] + n + VL) : vzero();
            }
            for (int k = 0; k < K; k++) {
                const VF b0 = vload(B + (size_t)k * ldb + n), b1 = vload(B + (size_t)k * ldb + n + VL);
                for (int i = 0; i < KV_MR; i++) {
                    const VF av = vset1(ar[i][k]);
                    c[i][0] = vfma(av, b0, c[i][0]);
                    c[i][1] = vfma(av, b1, c[i][1]);
                }
            }
            for (int i = 0; i < nr; i++) {
                vstore(cr[i] + n, c[i][0]);
                vstore(cr[i] + n + VL, c[i][1]);
            }
        }
    }
}

#ifdef KV_GEMM_TILES
#define KV_GEMM(R, D) ((R) >= KV_GEMM_MIN_ROWS && (D) % (2 * VL) == 0)
#define KV_GEMM_TILE_BUFS 1 /* the K tile transposed, after tb */
#else
#define KV_GEMM(R, D) 0
#define KV_GEMM_TILE_BUFS 0
#endif

/* scores of R rows against one tile: S[r][t] = qf_r . k_t (qf already carries scale*log2e). tb: the tile's
 * f32 rows, then (tb + KV_T*D) its transpose */
static void FN(k_tile_f32)(const kv_call *c, kv_scratch *ws, int r0, int R, const uint8_t *const *rows, float *tb) {
    const int D = c->head_dim;
#ifdef K_TILE_FLOAT
    if (K_TILE_FLOAT(c, ws, r0, R, rows, tb)) return; /* the ISA's kernel for the float formats */
#endif
    for (int t = 0; t < KV_T; t++) FN(dequantize)(c->kfmt, rows[t], tb + (size_t)t * D, D);
    if (KV_GEMM(R, D)) {
        float *tt = tb + (size_t)KV_T * D;
        TRANSPOSE_TILE(tb, tt, D);
        FN(gemm_tile)(ws->qf + (size_t)r0 * D, D, D, tt, KV_T, KV_T, ws->s, KV_T, R, 0);
        return;
    }
    for (int r = 0; r < R; r++)
        for (int t = 0; t < KV_T; t++)
            ws->s[r * KV_T + t] = FN(dot)(ws->qf + (size_t)(r0 + r) * D, tb + (size_t)t * D, D);
}

/* O[r] += sum_t P[r][t] v_t */
static void FN(v_tile_f32)(const kv_call *c, kv_scratch *ws, int r0, int R, const uint8_t *const *rows, float *tb) {
    const int D = c->head_dim;
#ifdef V_TILE_FLOAT
    if (V_TILE_FLOAT(c, ws, r0, R, rows, tb)) return;
#endif
    for (int t = 0; t < KV_T; t++) FN(dequantize)(c->vfmt, rows[t], tb + (size_t)t * D, D);
    if (KV_GEMM(R, D)) {
        FN(gemm_tile)(ws->s, KV_T, KV_T, tb, D, D, ws->o + (size_t)r0 * D, D, R, 1);
        return;
    }
    for (int r = 0; r < R; r++) {
        const float *p = ws->s + r * KV_T;
        float *o = ws->o + (size_t)(r0 + r) * D;
        int i = 0;
        for (; i + 4 * VL <= D; i += 4 * VL) {
            VF a0 = vload(o + i), a1 = vload(o + i + VL), a2 = vload(o + i + 2 * VL), a3 = vload(o + i + 3 * VL);
            for (int t = 0; t < KV_T; t++) {
                const float *v = tb + (size_t)t * D + i;
                VF pt = vset1(p[t]);
                a0 = vfma(pt, vload(v), a0);
                a1 = vfma(pt, vload(v + VL), a1);
                a2 = vfma(pt, vload(v + 2 * VL), a2);
                a3 = vfma(pt, vload(v + 3 * VL), a3);
            }
            vstore(o + i, a0);
            vstore(o + i + VL, a1);
            vstore(o + i + 2 * VL, a2);
            vstore(o + i + 3 * VL, a3);
        }
        for (; i + VL <= D; i += VL) {
            VF a0 = vload(o + i);
            for (int t = 0; t < KV_T; t++) a0 = vfma(vset1(p[t]), vload(tb + (size_t)t * D + i), a0);
            vstore(o + i, a0);
        }
        for (; i < D; i++) {
            float a = o[i];
            for (int t = 0; t < KV_T; t++) a += p[t] * tb[(size_t)t * D + i];
            o[i] = a;
        }
    }
}

/* ---- the item driver: tiles, masks, online softmax ---------------------------------------------- */

#if KV_T % VL != 0
#error "KV_T must be a multiple of the vector length"
#endif

/* one row's tile: turn scores into probabilities and fold the new max into (m, l, O) */
KV_INLINE void FN(softmax_row)(float *s, float *m, float *l, float *o, int D) {
    VF mx = vload(s);
    for (int t = VL; t < KV_T; t += VL) mx = vmax(mx, vload(s + t));
    float mt = vhmax(mx);
    if (mt == -INFINITY) { /* nothing visible to this row in this tile, unless a NaN score (a NaN in K) hid
                            * from the max (maxps keeps one operand): then the row's sum, and output, is NaN */
        for (int t = 0; t < KV_T; t++)
            if (s[t] != s[t]) *l = NAN;
        memset(s, 0, KV_T * sizeof(float));
        return;
    }
    if (mt > *m) {
        float corr = *m == -INFINITY ? 0.0f : exp2f(*m - mt);
        *l *= corr;
        VF cv = vset1(corr);
        int i = 0;
        for (; i + VL <= D; i += VL) vstore(o + i, vmul(vload(o + i), cv));
        for (; i < D; i++) o[i] *= corr;
        *m = mt;
    }
    VF mv = vset1(*m), sum = vzero();
    for (int t = 0; t < KV_T; t += VL) {
        VF p = vexp2(vsub(vload(s + t), mv));
        vstore(s + t, p);
        sum = vadd(sum, p);
    }
    *l += vhsum(sum);
}

/* extra scratch: the integer kernels' buffers, then the f32 path's tile (K and V may take different paths) */
static size_t FN(int_bytes)(const kv_call *c, int rows) {
#ifdef INT_EXTRA_BYTES
    return INT_EXTRA_BYTES(c, rows);
#else
    (void)c;
    (void)rows;
    return 0;
#endif
}

static size_t FN(extra_bytes)(const kv_call *c, int rows) { /* int scratch | tb | its transpose | per-channel K's f32 tile */
    return FN(int_bytes)(c, rows) + (size_t)(1 + KV_GEMM_TILE_BUFS + (c->kpaged ? 1 : 0)) * KV_T * c->head_dim * sizeof(float);
}

/* One item: query positions [pos0, pos0+npos) of a sequence for KV heads [head0, head0+nheads), over
 * KV positions [lo, hi]. Heads are the inner loop of each tile, so a tile's pages are read front to
 * back (a page holds every head's rows contiguously) and the hardware prefetchers can follow.
 * Rows: r = head_in_group * R + position * G + gqa_head, R = npos * G rows per KV head. */
static void FN(attn_item)(const kv_call *c, const kv_item *it, kv_scratch *ws, float *pm, float *pl, float *po) {
#ifdef DECODE_ITEM
    if (DECODE_ITEM(c, it, ws, pm, pl, po)) return; /* the ISA's decode fast path took it (mxfp4/nvfp4 too) */
#endif
#ifdef V2_DECODE_ITEM
    if (V2_DECODE_ITEM(c, it, ws, pm, pl, po)) return; /* kern_v2.h's decode path took it */
#endif
    const int D = c->head_dim, G = c->n_heads / c->n_kv_heads, R = it->npos * G, RT = R * it->nheads;
    const int s = it->seq;
    const int n_kv = c->seq_lens[s], n_q = c->q_lens[s];
    const int int_k = INT_PATH_K(c->kfmt), int_v = INT_PATH_V(c->vfmt);

    for (int hh = 0; hh < it->nheads; hh++)
        for (int i = 0; i < it->npos; i++) {
            const float *src =
                c->q + ((c->q_start[s] + it->pos0 + i) * c->n_heads + (int64_t)(it->head0 + hh) * G) * D;
            float *dst = ws->qf + (size_t)(hh * R + i * G) * D;
            VF sc = vset1(c->scale2);
            int j = 0;
            for (; j + VL <= G * D; j += VL) vstore(dst + j, vmul(vload(src + j), sc));
            for (; j < G * D; j++) dst[j] = src[j] * c->scale2;
        }
    for (int r = 0; r < RT; r++) {
        ws->m[r] = -INFINITY;
        ws->l[r] = 0.0f;
    }
    memset(ws->o, 0, (size_t)RT * D * sizeof(float));
#ifdef INT_PREP_Q
    if (int_k) INT_PREP_Q(c, ws, RT);
#endif

    float *tb = (float *)(void *)((uint8_t *)ws->extra + FN(int_bytes)(c, RT));
    const uint8_t *krows[KV_T], *vrows[KV_T];
    /* per-channel K pages: each tile's K rows are made f32 rows in kt first (one page run at a time) and
     * scored as f32 K, through a copy of the call that says so */
    float *kt = tb + (size_t)(1 + KV_GEMM_TILE_BUFS) * KV_T * D;
    kv_call kf32;
    if (c->kpaged) {
        kf32 = *c;
        kf32.kfmt = KV_F32;
        kf32.krow = (int64_t)D * (int64_t)sizeof(float);
        kf32.kpaged = 0;
    }
    const kv_call *kc = c->kpaged ? &kf32 : c;
    for (int t0 = it->lo; t0 <= it->hi; t0 += KV_T) {
        int nt = it->hi - t0 + 1 < KV_T ? it->hi - t0 + 1 : KV_T;
        for (int hh = 0; hh < it->nheads; hh++) {
            const int h = it->head0 + hh, r0 = hh * R;
            /* rows by page: one block-table lookup per page, not a division per row */
            for (int t = 0; t < nt;) {
                int j = t0 + t, run = c->block_size - j % c->block_size;
                if (run > nt - t) run = nt - t;
                const uint8_t *kp = kv_row(c, c->kpool, c->krow, s, h, j), *vp = kv_row(c, c->vpool, c->vrow, s, h, j);
                if (c->kpaged) {
                    const int u0 = j % c->block_size;
                    FN(kpage_rows)(c->kfmt, kp - u0 * c->krow, c->block_size, D, u0, run, kt + (size_t)t * D, D);
                    kp = (const uint8_t *)(kt + (size_t)t * D);
                }
                for (int u = 0; u < run; u++, t++) {
                    krows[t] = kp + (int64_t)u * kc->krow;
                    vrows[t] = vp + (int64_t)u * c->vrow;
                }
            }
            for (int t = nt; t < KV_T; t++) { /* padding repeats a real row; its score is masked */
                krows[t] = krows[0];
                vrows[t] = vrows[0];
            }
            /* request the next step's rows (next head of this tile: the same rows one head further
             * into each page; else the next tile's first head), a line at a time. Locality 1
             * (prefetcht2) fills L2 only: into L1 the requests queue on its few miss buffers and
             * stall the core (q8_0 at 16k: 145 vs 225 cycles per token and head on Zen 4). */
            {
                int ph = hh + KV_PF_STEPS, pt = t0; /* the step KV_PF_STEPS ahead: (tile pt, head ph) */
                while (ph >= it->nheads) {
                    ph -= it->nheads;
                    pt += KV_T;
                }
                if (pt <= it->hi) {
                    const int m = it->hi - pt + 1 < KV_T ? it->hi - pt + 1 : KV_T;
                    const int64_t kstep = (int64_t)(ph - hh) * c->block_size * c->krow;
                    const int64_t vstep = (int64_t)(ph - hh) * c->block_size * c->vrow;
                    for (int u = 0; u < m; u++) {
                        const uint8_t *kp, *vp;
                        if (pt == t0) { /* krows of per-channel K pages point at f32 rows: the page's own */
                            kp = c->kpaged ? kv_row(c, c->kpool, c->krow, s, it->head0 + ph, pt + u) : krows[u] + kstep;
                            vp = vrows[u] + vstep;
                        } else {
                            kp = kv_row(c, c->kpool, c->krow, s, it->head0 + ph, pt + u);
                            vp = kv_row(c, c->vpool, c->vrow, s, it->head0 + ph, pt + u);
                        }
                        for (int64_t o = 0; o < c->krow; o += 64) __builtin_prefetch(kp + o, 0, 1);
                        for (int64_t o = 0; o < c->vrow; o += 64) __builtin_prefetch(vp + o, 0, 1);
                    }
                }
            }
#ifdef INT_K_TILE
            if (int_k)
                INT_K_TILE(c, ws, RT, r0, R, krows);
            else
#endif
                FN(k_tile_f32)(kc, ws, r0, R, krows, tb);
            for (int i = 0; i < it->npos; i++) {
                int lo, hi;
                kv_visible(c, n_kv, n_kv - n_q + it->pos0 + i, &lo, &hi);
                int a = lo - t0, b = hi - t0; /* visible tile columns [a, b] */
                if (b > nt - 1) b = nt - 1;
                for (int g = 0; g < G; g++) {
                    const int r = r0 + i * G + g;
                    float *srow = ws->s + (i * G + g) * KV_T;
                    if (a > 0 || b < KV_T - 1)
                        for (int t = 0; t < KV_T; t++)
                            if (t < a || t > b) srow[t] = -INFINITY;
                    FN(softmax_row)(srow, ws->m + r, ws->l + r, ws->o + (size_t)r * D, D);
                }
            }
#ifdef INT_V_TILE
            if (int_v)
                INT_V_TILE(c, ws, RT, r0, R, vrows);
            else
#endif
                FN(v_tile_f32)(c, ws, r0, R, vrows, tb);
        }
    }

    for (int r = 0; r < RT; r++) {
        const float *o = ws->o + (size_t)r * D;
        float *dst;
        const float inv = kv_item_row_end(c, it, r, ws->m, ws->l, pm, pl, po, &dst);
#ifdef INT_V_UNPERMUTE
        if (int_v) {
            INT_V_UNPERMUTE(c, o, dst, inv);
            continue;
        }
#endif
        for (int j = 0; j < D; j++) dst[j] = o[j] * inv;
    }
    (void)int_k;
    (void)int_v;
}

/* ---- attention mass (observe): the weight each key received, from the rows' log-sum-exp ----------- */

#if KV_MASS_T % (2 * VL) != 0
#error "KV_MASS_T must be a multiple of two vectors"
#endif

/* One kvc_attention_mass item: the tile's K rows made f32 (as attention reads them: a row format's dequantize,
 * kpage_rows of per-channel K pages, a codec's kdecode) and transposed to
 * [D][KV_MASS_T], then for every query row of the sequence that sees some key of the tile and each of the KV
 * head's G query heads, 2^(q*scale*log2e . k - lse*log2e) per key: the softmax weight, no max pass, no V.
 * Per key, summed in double over the rows before the window and over the window's rows apart. A key a row
 * does not see (causal, window, the head's hole) gets nothing from it; a row that saw no key (lse -inf) adds
 * nothing; a NaN lse (a NaN in K) makes the sums NaN, as the float64 softmax does. */
static void FN(mass_item)(const kv_call *c, const kv_mass_item *it, float *ws) {
    enum { T = KV_MASS_T, P = 4 }; /* P (query row, head) pairs scored at once: each K vector loaded serves P */
    const int D = c->head_dim, G = c->n_heads / c->n_kv_heads, s = it->seq, h = it->head, bs = c->block_size;
    const int n_kv = c->seq_lens[s], n_q = c->q_lens[s], j0 = it->j0, nt = it->nt, j1 = j0 + nt - 1;
    double *acc = (double *)(void *)ws; /* [2][T]: rows before split, rows from split */
    float *e = ws + 4 * T, *rows = e + P * T, *kt = rows + (size_t)T * D;
    const int hx0 = it->hole0 > j0 ? it->hole0 : j0, hx1 = it->hole1 < j1 + 1 ? it->hole1 : j1 + 1;
    const int holed = hx0 < hx1, first = n_kv - n_q;
    /* rows see [lo, hi] with both ends non-decreasing in the row: from the first whose hi reaches j0 to the
     * last whose lo does not pass j1 */
    int i0 = c->causal && j0 - first > 0 ? j0 - first : 0, i1 = n_q;
    if (c->window > 0 && j1 + c->window - first < i1) i1 = j1 + c->window - first; /* lo = pos - window + 1 <= j1 */
    if (i0 >= i1) { /* no row sees a key of the tile (a window's far past): no K to read */
        for (int t = 0; t < nt; t++) it->total[t] = it->window[t] = 0.0;
        return;
    }
    for (int t = 0; t < nt;) { /* the tile's K rows, a page run at a time */
        const int j = j0 + t, u0 = j % bs;
        int run = bs - u0;
        if (run > nt - t) run = nt - t;
        const uint8_t *kp = kv_row(c, c->kpool, c->krow, s, h, j);
        if (c->kdecode) /* a codec's records (kltq): their coefficients */
            for (int u = 0; u < run; u++) c->kdecode(c->kdecode_ctx, h, kp + (int64_t)u * c->krow, rows + (size_t)(t + u) * D);
        else if (c->kpaged) /* per-channel K pages: the run's rows of the page, as attention reads them */
            FN(kpage_rows)(c->kfmt, kp - u0 * c->krow, bs, D, u0, run, rows + (size_t)t * D, D);
        else
            for (int u = 0; u < run; u++) FN(dequantize)(c->kfmt, kp + (int64_t)u * c->krow, rows + (size_t)(t + u) * D, D);
        t += run;
    }
    for (int d = 0; d < D; d++) {
        for (int t = 0; t < nt; t++) kt[(size_t)d * T + t] = rows[(size_t)t * D + d];
        for (int t = nt; t < T; t++) kt[(size_t)d * T + t] = 0.0f; /* padding: masked below */
    }
    for (int t = 0; t < 2 * T; t++) acc[t] = 0.0;
    const VF sc = vset1(c->scale2);
    const float *qp[P];
    float lse2[P];
    int prow[P], np = 0;
    for (int r = i0 * G; r <= i1 * G; r++) {
        if (r < i1 * G) { /* gather (row, head) pairs that saw a key; score them P at a time */
            const int i = r / G, head = h * G + r % G;
            const int64_t qrow = c->q_start[s] + i;
            const double lse = c->lse[qrow * c->n_heads + head];
            if (lse == -INFINITY) continue; /* it saw no key: it gave no weight */
            qp[np] = c->q + (qrow * c->n_heads + head) * D;
            lse2[np] = (float)(lse * 1.4426950408889634);
            prow[np++] = i;
            if (np < P) continue;
        }
        if (!np) continue;
        for (int p = np; p < P; p++) qp[p] = qp[0]; /* a partial block scores its first pair again, unused */
        /* the common case (every pair sees the whole tile, on one side of split): exponents, 2^ and the
         * block's sum per key in registers, one double add per key and block */
        int fast = np == P && nt == T && !holed && (prow[0] >= it->split) == (prow[P - 1] >= it->split);
        for (int p = 0; fast && p < P; p++) {
            int lo, hi;
            kv_visible(c, n_kv, first + prow[p], &lo, &hi);
            fast = lo <= j0 && hi >= j1;
        }
        for (int t = 0; t < T; t += 2 * VL) { /* 8 independent FMA chains */
            VF a0 = vzero(), a1 = vzero(), a2 = vzero(), a3 = vzero(), b0 = vzero(), b1 = vzero(), b2 = vzero(),
               b3 = vzero();
            const float *k = kt + t;
            for (int d = 0; d < D; d++, k += T) {
                const VF ka = vload(k), kb = vload(k + VL), q0 = vset1(qp[0][d]), q1 = vset1(qp[1][d]),
                         q2 = vset1(qp[2][d]), q3 = vset1(qp[3][d]);
                a0 = vfma(q0, ka, a0), b0 = vfma(q0, kb, b0);
                a1 = vfma(q1, ka, a1), b1 = vfma(q1, kb, b1);
                a2 = vfma(q2, ka, a2), b2 = vfma(q2, kb, b2);
                a3 = vfma(q3, ka, a3), b3 = vfma(q3, kb, b3);
            }
            if (fast) {
                const VF l0 = vset1(lse2[0]), l1 = vset1(lse2[1]), l2 = vset1(lse2[2]), l3 = vset1(lse2[3]);
                VF sa = vadd(vadd(vexp2(vsub(vmul(a0, sc), l0)), vexp2(vsub(vmul(a1, sc), l1))),
                             vadd(vexp2(vsub(vmul(a2, sc), l2)), vexp2(vsub(vmul(a3, sc), l3))));
                VF sb = vadd(vadd(vexp2(vsub(vmul(b0, sc), l0)), vexp2(vsub(vmul(b1, sc), l1))),
                             vadd(vexp2(vsub(vmul(b2, sc), l2)), vexp2(vsub(vmul(b3, sc), l3))));
                vstore(e + t, sa);
                vstore(e + t + VL, sb);
                continue;
            }
            vstore(e + t, a0), vstore(e + t + VL, b0);
            vstore(e + T + t, a1), vstore(e + T + t + VL, b1);
            vstore(e + 2 * T + t, a2), vstore(e + 2 * T + t + VL, b2);
            vstore(e + 3 * T + t, a3), vstore(e + 3 * T + t + VL, b3);
        }
        if (fast) {
            double *a = acc + (prow[0] >= it->split ? T : 0);
            for (int t = 0; t < T; t++) a[t] += (double)e[t];
            np = 0;
            continue;
        }
        for (int p = 0; p < np; p++) { /* the edges: each pair's own mask */
            float *ep = e + p * T;
            const VF lv = vset1(lse2[p]);
            for (int t = 0; t < T; t += VL) vstore(ep + t, vsub(vmul(vload(ep + t), sc), lv));
            int lo, hi;
            kv_visible(c, n_kv, first + prow[p], &lo, &hi);
            if (!(lo <= j0 && hi >= j1 && nt == T && !holed))
                for (int t = 0; t < T; t++) {
                    const int j = j0 + t;
                    if (t >= nt || j < lo || j > hi || (j >= hx0 && j < hx1)) ep[t] = -INFINITY;
                }
            for (int t = 0; t < T; t += VL) vstore(ep + t, vexp2(vload(ep + t)));
            double *a = acc + (prow[p] >= it->split ? T : 0);
            for (int t = 0; t < T; t++) a[t] += (double)ep[t];
        }
        np = 0;
    }
    for (int t = 0; t < nt; t++) {
        it->total[t] = acc[t] + acc[T + t];
        it->window[t] = acc[T + t];
    }
}

const kv_isa FN(kv_isa) = {ISA_NAME,       FN(quantize),    FN(dequantize), FN(kpage_rows),
                           FN(attn_item), FN(extra_bytes), FN(mass_item)};
