/* AMX prefill attention (Sapphire Rapids and later): scores and P.V on the tile unit.
 *
 * api.c hands this file the items of an "amx" call that hold at least KV_AMX_MIN_ROWS query rows per KV
 * head (prefill chunks); decode items, store and load stay on the AVX-512 kernels. Every K/V format
 * with a row dequantizer runs here (per-channel kivi K pages do not): each KV tile of AMX_T tokens of
 * one head is dequantized once into f32 (the AVX-512 row dequantizers, bit-exact) and split into bf16
 * pieces, x = x0 + x1 (+ x2), each piece the rest of the ones before rounded to bf16 (amx_round): 1
 * piece is exact for bf16 and fp8, 2 for f16 and for the 4-bit codes times an fp16 scale, 2 pieces hold
 * int8 codes times a scale to 2^-18, 3 hold f32. Whole-context copies are never made: one tile of K and
 * V at a time, in the layout the tile unit reads.
 *
 * The problem is computed transposed, so that the softmax runs along vector lanes = query rows with
 * no horizontal reductions:
 *   S^T [t][r] = K [t][d] . Q^T [d][r]        A = K rows (bf16 as stored), B = Q^T (VNNI pairs of dims)
 *   O^T [d][r] += V^T [d][t] . P^T [t][r]     A = V^T (pairs of tokens), B = P^T (pairs of tokens)
 * each product as TDPBF16PS passes over pairs of pieces (i, j) with i + j below the larger piece count
 * (q and p are split the same way: 3 pieces where the call is held to 1e-5, else 2). Products of bf16
 * are exact in f32, so the error is that of the dropped pairs and f32 accumulation: ~1e-6 of the f64
 * result for the float formats, ~4e-5 for the ggml ones (their tolerance: 5e-4).
 *
 * Schedule of one tile: the K and V pieces are prepared, then for each block of 32 query rows the
 * softmax's vector work runs with the tile unit's work of the neighbouring blocks issued between its
 * ops (amx_step): the scores of block rb + 32 and the P.V of block rb - 32. What bounds it (q8_0, 512
 * queries GQA 4 over 4k, one thread, CPU time, -DAMX_PROF and builds with parts removed): the
 * softmax's vector work alone 32 ms, with the tile loads added (no TDPBF16PS) 62 ms, everything 84
 * ms: the 1 KiB tile loads (8 per 12 TDPBF16PS, K and V pieces from L2) cost about as much as the
 * products themselves; 6.3M TDPBF16PS at the 6 ns one takes with its operands in tiles is 38 ms.
 *
 * Why bf16 for the integer formats too (not AMX-INT8 on the codes): ggml blocks carry one fp16 scale per
 * 32 values and token, so an int8 dot product must be kept apart per 32-dim block (and per hi/lo half
 * of a 16-bit q) and read out of the tiles with a scale per token and block: eight accumulator tiles read
 * back per 16x16 scores against one here, and int8 q would cost ~1e-2 of accuracy.
 *
 * Compiled only where the compiler and assembler know AMX (setup.py defines KV_NO_AMX otherwise); run
 * only where cpuid reports AMX-TILE/BF16, AVX512-BF16 is not needed, and Linux grants the tile data
 * state (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), asked once per process. */
#define _GNU_SOURCE /* syscall() under -std=c11 */
#include "kvcpu.h"

#if (defined(__x86_64__) || defined(_M_X64)) && defined(__linux__) && !defined(KV_NO_AMX) &&                  \
    ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11))
#define KV_AMX_BUILT 1
#endif

#ifdef KV_AMX_BUILT
#include <cpuid.h>
#include <immintrin.h>
#include <math.h>
#include <stdatomic.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq"))), apply_to = function)
#else
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq")
#endif


/* KV tokens per tile (a multiple of 32): each tile's C tiles of O^T are loaded and stored once per 32-row
 * block, and its softmax bookkeeping runs once. Interleaved single-thread runs, q8_0 / f16, 512 queries
 * over 4k (CPU ms): 64 tokens 151-162 / 177-179, 128 131-134 / 156-159, 256 121-123 / 142-146, 512
 * 123-139 / 146-148; with the P.V issued inside the softmax, q8_0: 64 tokens 126-132, 128 110-117, 256
 * 110-119. */
#ifndef AMX_T
#define AMX_T 256
#endif

/* The tile instructions as plain asm (the assembler must know them; setup.py checks): the "memory"
 * clobbers order the tile loads and stores with the AVX-512 code that fills and reads the buffers,
 * which the compilers' own intrinsics do not promise. */
#define TLOAD(t, base, stride) \
    __asm__ volatile("tileloadd (%0,%1,1), %%tmm" #t ::"r"((const void *)(base)), "r"((long)(stride)) : "memory")
#define TSTORE(t, base, stride) \
    __asm__ volatile("tilestored %%tmm" #t ", (%0,%1,1)" ::"r"((void *)(base)), "r"((long)(stride)) : "memory")
#define TZERO(t) __asm__ volatile("tilezero %%tmm" #t ::)
#define TDP(c, a, b) __asm__ volatile("tdpbf16ps %%tmm" #b ", %%tmm" #a ", %%tmm" #c ::)

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} kv_tilecfg;

static void amx_config(void) {
    kv_tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 8; i++) {
        cfg.colsb[i] = 64;
        cfg.rows[i] = 16;
    }
    __asm__ volatile("ldtilecfg %0" ::"m"(cfg) : "memory");
}
static void amx_release(void) { __asm__ volatile("tilerelease" ::: "memory"); }

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

int kv_amx_supported(void) {
    static _Atomic int known; /* 0: not asked yet, 1: no, 2: yes */
    int k = atomic_load(&known);
    if (k) return k == 2;
    unsigned a, b, c, d;
    int ok = __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d & (1u << 24)) /* AMX-TILE */ &&
             (d & (1u << 22)) /* AMX-BF16 */ && __get_cpuid(1, &a, &b, &c, &d) && (c & (1u << 27)) /* OSXSAVE */;
    if (ok) {
        unsigned lo, hi;
        __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
        ok = (lo & (3u << 17)) == (3u << 17); /* XTILECFG and XTILEDATA enabled by the OS */
    }
    /* Linux (5.16+) hands the tile data state to a process only on request; refused (an older kernel,
     * a seccomp filter): the AVX-512 kernels run instead */
    if (ok) ok = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    atomic_store(&known, ok ? 2 : 1);
    return ok;
}

/* the calls this file runs: rows of a dequantizable K and V (not per-channel K pages), whole 32-dim steps */
int kv_amx_takes(const kv_call *c) { return !c->kpaged && c->head_dim % 32 == 0 && c->head_dim <= 512; }

/* x = hi + lo in bf16, as f32 bit patterns whose high halves are the bf16 values: hi is x rounded to the
 * nearest bf16 (ties away from zero: adding half an ulp to the bits carries into the kept half), lo the
 * rest rounded the same way; |x - hi - lo| <= 2^-18 |x|. Only the high halves are ever read (amx_pack*),
 * so the low bits stay as they fall. inf and NaN keep their class in hi (callers that split them use lo
 * only for finite formats). */
#define AMX_HALF _mm512_set1_epi32(0x8000)
#define AMX_HIGH _mm512_set1_epi32((int)0xffff0000u)
static inline __m512i amx_round(__m512 x) { return _mm512_add_epi32(_mm512_castps_si512(x), AMX_HALF); }
static inline __m512 amx_rest(__m512 x, __m512i hi) { /* x - (the bf16 value of hi) */
    return _mm512_sub_ps(x, _mm512_castsi512_ps(_mm512_and_si512(hi, AMX_HIGH)));
}

/* the bf16 halves of a's and b's 16 lanes, in order: a row of 32 bf16 (words 0-15 from a, 16-31 from b) */
static inline __m512i amx_pack(__m512i a, __m512i b) {
    const __m512i idx = _mm512_set_epi16(63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33, 31, 29, 27,
                                         25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
    return _mm512_permutex2var_epi16(a, idx, b);
}
/* the bf16 halves of a's and b's lanes interleaved: dword i = (a[i] low word, b[i] high word), a VNNI pair */
static inline __m512i amx_pair(__m512i a, __m512i b) {
    const __m512i idx = _mm512_set_epi16(63, 31, 61, 29, 59, 27, 57, 25, 55, 23, 53, 21, 51, 19, 49, 17, 47, 15, 45,
                                         13, 43, 11, 41, 9, 39, 7, 37, 5, 35, 3, 33, 1);
    return _mm512_permutex2var_epi16(a, idx, b);
}

/* 16 rows of 16 dwords (row i at src + i * ss dwords) -> transposed (row j at dst + j * ds dwords) */
static inline void amx_transpose16(const uint32_t *src, size_t ss, uint32_t *dst, size_t ds) {
    __m512i r[16], t[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_si512((const void *)(src + i * ss));
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    /* r[4a + b] now holds, in 128-bit lane L, column 4L + b of rows 4a..4a+3; output row 4L + b gathers lane L
     * of r[b], r[4 + b], r[8 + b], r[12 + b]: two rounds of 128-bit lane shuffles */
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
        r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
        r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xdd);
    }
    for (int j = 0; j < 16; j++) _mm512_storeu_si512((void *)(dst + j * ds), r[j]);
}

/* 2^x for x <= AMX_SLACK, in 8 vector ops: a degree-5 polynomial fitted to 2^f on [-1/2, 1/2] for
 * relative error (2.3e-7 evaluated in f32, against kv_exp2_512's degree 7: the softmax is this file's
 * vector-bound part), scaled by 2^n. x < -126, -inf included, gives exactly 0 (the mask: -inf would
 * otherwise make NaN of f); NaN gives NaN. */
static inline __m512 amx_exp2(__m512 x) {
    const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-126.0f), _CMP_NLT_UQ);
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(1.3276468e-3f), f, _mm512_set1_ps(9.6755419e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5507135e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022120e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314694e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0000001f));
    return _mm512_maskz_scalef_ps(live, p, n);
}

/* Scratch of one worker. Rows are padded to RP (a multiple of 32) and blocked by 32: the Q^T and O^T of a
 * 32-row block are contiguous, and a tile's scores, softmax and P.V run one row block at a time on
 * buffers that stay in L1 (S, P). */
typedef struct {
    uint32_t *q[3];      /* Q^T pieces [RP/32][D/2][32]: dword (dp, r) = bf16 q[r][2dp], q[r][2dp+1] */
    uint16_t *k[3];      /* K pieces [AMX_T][D] bf16 */
    float *xf;           /* [24][D]: two f32 rows of the tile, or amx_q's staging of 16 rows x 3 pieces */
    uint32_t *vx;        /* [3][AMX_T/2][D] token pairs of V's pieces before the transpose */
    uint32_t *v[3];      /* V^T pieces [D][AMX_T/2]: dword (d, tp) = bf16 v[2tp][d], v[2tp+1][d] */
    float *s;            /* S^T of two row blocks [2][AMX_T][32]: one scored while the other's softmax runs */
    uint32_t *p[2][3];   /* P^T pieces of two row blocks [AMX_T/2][32]: dword (tp, r) = bf16 p[2tp][r], p[2tp+1][r];
                          * one written by the softmax while the tile unit reads the other (P.V) */
    float *o;            /* O^T [RP/32][D][32] */
    float *m, *l;        /* [RP] */
    int32_t *lo, *hi;    /* [RP] visible KV positions of each row, within the item's range */
    int32_t *tend;       /* [RP/32] each row block's amx_tend for the current tile */
    int nq, nk, nv, np;  /* pieces of q, K, V, P */
    int nqk, npv;        /* products kept: pieces i, j with i + j < these */
} amx_ws;

static size_t amx_layout(int D, int rows, uint8_t *base, amx_ws *L) {
    const size_t RP = ((size_t)rows + 31) & ~(size_t)31, d = (size_t)D, T = AMX_T;
    size_t off = 0;
#define TAKE(field, type, count) KV_WS_TAKE(L, base, off, field, type, count)
    for (int i = 0; i < 3; i++) TAKE(q[i], uint32_t, d / 2 * RP);
    for (int i = 0; i < 3; i++) TAKE(k[i], uint16_t, T * d);
    TAKE(xf, float, 24 * d);
    TAKE(vx, uint32_t, 3 * T / 2 * d);
    for (int i = 0; i < 3; i++) TAKE(v[i], uint32_t, d * T / 2);
    TAKE(s, float, 2 * T * 32);
    for (int i = 0; i < 6; i++) TAKE(p[i / 3][i % 3], uint32_t, T / 2 * 32);
    TAKE(o, float, d * RP);
    TAKE(m, float, RP);
    TAKE(l, float, RP);
    TAKE(lo, int32_t, RP);
    TAKE(hi, int32_t, RP);
    TAKE(tend, int32_t, RP / 32);
#undef TAKE
    return off;
}

size_t kv_amx_extra_bytes(const kv_call *c, int rows) { return amx_layout(c->head_dim, rows, NULL, NULL); }

/* whether a format's values are bf16 exactly (one piece: its lo passes are skipped) */
static int amx_exact(int fmt) { return fmt == KV_BF16 || fmt == KV_FP8_E4M3 || fmt == KV_FP8_E5M2; }

/* row t of the tile (t < nt) dequantized into x [D] f32; rows past nt are zero */
static inline void amx_row_f32(int fmt, const uint8_t *const *rows, int t, int nt, int D, float *x) {
    if (t < nt)
        kv_isa_avx512.dequantize(fmt, rows[t], x, D);
    else
        memset(x, 0, (size_t)D * sizeof(float));
}

/* K's pieces, a row at a time through a D-float buffer that stays in L1 */
static void amx_k_tile(const amx_ws *L, int fmt, const uint8_t *const *rows, int nt, int D) {
    for (int t = 0; t < AMX_T; t++) {
        amx_row_f32(fmt, rows, t, nt, D, L->xf);
        for (int j = 0; j < D; j += 32) {
            __m512 x0 = _mm512_loadu_ps(L->xf + j), x1 = _mm512_loadu_ps(L->xf + j + 16);
            const size_t i = (size_t)t * D + j;
            for (int k = 0; k < L->nk; k++) {
                const __m512i h0 = amx_round(x0), h1 = amx_round(x1);
                _mm512_storeu_si512((void *)(L->k[k] + i), amx_pack(h0, h1));
                x0 = amx_rest(x0, h0);
                x1 = amx_rest(x1, h1);
            }
        }
    }
}

/* V's pieces: token pairs (two rows at a time through L1) interleaved, then transposed to V^T */
static void amx_v_tile(const amx_ws *L, int fmt, const uint8_t *const *rows, int nt, int D) {
    const size_t piece = (size_t)AMX_T / 2 * D;
    float *x2 = L->xf + D;
    for (int tp = 0; tp < AMX_T / 2; tp++) {
        amx_row_f32(fmt, rows, 2 * tp, nt, D, L->xf);
        amx_row_f32(fmt, rows, 2 * tp + 1, nt, D, x2);
        for (int j = 0; j < D; j += 16) {
            __m512 x0 = _mm512_loadu_ps(L->xf + j), x1 = _mm512_loadu_ps(x2 + j);
            for (int k = 0; k < L->nv; k++) {
                const __m512i h0 = amx_round(x0), h1 = amx_round(x1);
                _mm512_storeu_si512((void *)(L->vx + k * piece + (size_t)tp * D + j), amx_pair(h0, h1));
                x0 = amx_rest(x0, h0);
                x1 = amx_rest(x1, h1);
            }
        }
    }
    for (int k = 0; k < L->nv; k++)
        for (int tp = 0; tp < AMX_T / 2; tp += 16)
            for (int j = 0; j < D; j += 16)
                amx_transpose16(L->vx + k * piece + (size_t)tp * D + j, (size_t)D, L->v[k] + (size_t)j * (AMX_T / 2) + tp, AMX_T / 2);
}

/* queries of KV head h of the item (rows r < R: position r / G, query head r % G), scaled by scale*log2 e,
 * into nq Q^T pieces; rows R..RP are zero */
static void amx_q(const kv_call *c, const kv_item *it, int h, int R, int RP, const amx_ws *L) {
    const int D = c->head_dim, G = c->n_heads / c->n_kv_heads, nq = L->nq;
    const __m512 sc = _mm512_set1_ps(c->scale2);
    /* 16 rows at a time: each piece's bf16 rows into a [16][D/2]-dword staging block (in xf), transposed */
    uint32_t *st = (uint32_t *)(void *)L->xf;
    const size_t sz = 16 * (size_t)D / 2;
    for (int r0 = 0; r0 < RP; r0 += 16) {
        for (int i = 0; i < 16; i++) {
            const int r = r0 + i;
            const float *src = r < R ? c->q + ((c->q_start[it->seq] + it->pos0 + r / G) * c->n_heads + (int64_t)h * G + r % G) * D : NULL;
            for (int j = 0; j < D; j += 32) {
                __m512 x0 = src ? _mm512_mul_ps(_mm512_loadu_ps(src + j), sc) : _mm512_setzero_ps();
                __m512 x1 = src ? _mm512_mul_ps(_mm512_loadu_ps(src + j + 16), sc) : _mm512_setzero_ps();
                for (int k = 0; k < nq; k++) {
                    const __m512i h0 = amx_round(x0), h1 = amx_round(x1);
                    _mm512_storeu_si512((void *)(st + k * sz + (size_t)i * D / 2 + j / 2), amx_pack(h0, h1));
                    x0 = amx_rest(x0, h0);
                    x1 = amx_rest(x1, h1);
                }
            }
        }
        for (int k = 0; k < nq; k++)
            for (int dp = 0; dp < D / 2; dp += 16)
                amx_transpose16(st + k * sz + dp, (size_t)D / 2, L->q[k] + (size_t)(r0 / 32) * D * 16 + (size_t)dp * 32 + r0 % 32, 32);
    }
}

/* S^T = K . Q^T for the tile and the 32 rows of block rb into s [AMX_T][32], over the pieces (K piece i
 * with q piece j, i + j < the larger count: the products of order 2^-9(i+j) kept): C tiles 0-3 = 32 tokens
 * x 32 rows, A (K) in 4-5, B (Q^T) in 6-7. Run as steps of 4 TDPBF16PS (amx_sc_step), so that amx_softmax
 * can issue the next row block's scores between its own vector work: the tile unit and the vector
 * units then overlap instead of taking turns. */
typedef struct {
    const amx_ws *L;
    float *s;
    size_t qoff;                     /* the row block's Q^T within each piece */
    int D, tb, kk, i, jj, nj, lastb; /* the next step */
    int tend;                        /* tokens of the tile the block sees any of (amx_tend) */
    int done;
} amx_sc;

static inline int amx_sc_nj(const amx_ws *L, int i) { return L->nq < L->nqk - i ? L->nq : L->nqk - i; }

static inline void amx_sc_load_a(const amx_sc *st) {
    const uint16_t *k0 = st->L->k[st->i] + (size_t)st->tb * st->D + st->kk;
    TLOAD(4, k0, (long)st->D * 2);
    TLOAD(5, k0 + (size_t)16 * st->D, (long)st->D * 2);
}

static void amx_sc_begin(amx_sc *st, const amx_ws *L, int D, int rb, float *s, int tend) {
    *st = (amx_sc){L, s, (size_t)(rb / 32) * D * 16, D, 0, 0, 0, 0, amx_sc_nj(L, 0), -1, tend, tend == 0};
    if (st->done) return;
    TZERO(0);
    TZERO(1);
    TZERO(2);
    TZERO(3);
    amx_sc_load_a(st);
}

static inline void amx_sc_step(amx_sc *st) {
    if (st->done) return;
    const amx_ws *L = st->L;
    const int j = st->i & 1 ? st->jj : st->nj - 1 - st->jj; /* q pieces down for even K pieces, up for odd:
                                                           * the last B stays in 6-7 for the next */
    if (j != st->lastb) {
        const uint32_t *q = L->q[j] + st->qoff + (size_t)(st->kk / 2) * 32;
        TLOAD(6, q, 128);
        TLOAD(7, q + 16, 128);
        st->lastb = j;
    }
    TDP(0, 4, 6);
    TDP(1, 4, 7);
    TDP(2, 5, 6);
    TDP(3, 5, 7);
    if (++st->jj < st->nj) return;
    st->jj = 0;
    if (++st->i < L->nk) {
        st->nj = amx_sc_nj(L, st->i);
        amx_sc_load_a(st);
        return;
    }
    st->i = 0;
    st->nj = amx_sc_nj(L, 0);
    st->lastb = -1;
    if ((st->kk += 32) < st->D) {
        amx_sc_load_a(st);
        return;
    }
    st->kk = 0;
    float *sp = st->s + (size_t)st->tb * 32;
    TSTORE(0, sp, 128);
    TSTORE(1, sp + 16, 128);
    TSTORE(2, sp + 16 * 32, 128);
    TSTORE(3, sp + 16 * 32 + 16, 128);
    if ((st->tb += 32) < st->tend) {
        TZERO(0);
        TZERO(1);
        TZERO(2);
        TZERO(3);
        amx_sc_load_a(st);
        return;
    }
    st->done = 1;
}

static inline int amx_sc_steps(const amx_ws *L, int D, int tend) { /* steps of one row block's scores */
    int n = 0;
    for (int i = 0; i < L->nk; i++) n += amx_sc_nj(L, i);
    return n * (D / 32) * (tend / 32);
}

/* O^T += V^T . P^T for row block rb, over the pieces (V piece i with P piece j, i + j < the larger
 * count, as the scores), as steps of 4 TDPBF16PS like amx_sc: units of 32 dims, whose C tiles 0-3 (32
 * dims x 32 rows) are loaded from O^T at the unit's first step and stored back after its last, A (V^T)
 * in 4-5, B (P^T) in 6-7. amx_softmax issues these steps of the previous row block between its vector
 * work too, so that the tile unit's P.V no longer runs alone (see amx_step). */
typedef struct {
    const amx_ws *L;
    uint32_t *const *p; /* the row block's P^T pieces */
    float *ob;          /* the row block's O^T */
    int D, db, kt, i, jj, nj, lastb;
    int tend; /* as amx_sc: the block's p past it are 0 and not written */
    int started, done;
} amx_pvs;

static inline int amx_pv_nj(const amx_ws *L, int i) { return L->np < L->npv - i ? L->np : L->npv - i; }

static inline void amx_pv_load_a(const amx_pvs *st) {
    const uint32_t *v0 = st->L->v[st->i] + (size_t)st->db * (AMX_T / 2) + st->kt;
    TLOAD(4, v0, AMX_T * 2);
    TLOAD(5, v0 + (size_t)16 * (AMX_T / 2), AMX_T * 2);
}

static inline void amx_pv_load_c(const amx_pvs *st) {
    const float *o = st->ob + (size_t)st->db * 32;
    TLOAD(0, o, 128);
    TLOAD(1, o + 16, 128);
    TLOAD(2, o + 16 * 32, 128);
    TLOAD(3, o + 16 * 32 + 16, 128);
}

/* the steps of row block rb's P.V, none issued yet (the tiles may still hold another unit's work) */
static void amx_pv_begin(amx_pvs *st, const amx_ws *L, int D, int rb, uint32_t *const *p, int tend) {
    *st = (amx_pvs){L, p, L->o + (size_t)(rb / 32) * D * 32, D, 0, 0, 0, 0, amx_pv_nj(L, 0), -1, tend, 0, tend == 0};
}

static inline void amx_pv_step(amx_pvs *st) {
    if (st->done) return;
    const amx_ws *L = st->L;
    if (!st->started) {
        st->started = 1;
        amx_pv_load_c(st);
        amx_pv_load_a(st);
    }
    const int j = st->i & 1 ? st->jj : st->nj - 1 - st->jj; /* as amx_sc_step: B reused across V pieces */
    if (j != st->lastb) {
        const uint32_t *p = st->p[j] + (size_t)st->kt * 32;
        TLOAD(6, p, 128);
        TLOAD(7, p + 16, 128);
        st->lastb = j;
    }
    TDP(0, 4, 6);
    TDP(1, 4, 7);
    TDP(2, 5, 6);
    TDP(3, 5, 7);
    if (++st->jj < st->nj) return;
    st->jj = 0;
    if (++st->i < L->nv) {
        st->nj = amx_pv_nj(L, st->i);
        amx_pv_load_a(st);
        return;
    }
    st->i = 0;
    st->nj = amx_pv_nj(L, 0);
    st->lastb = -1;
    if ((st->kt += 16) < st->tend / 2) {
        amx_pv_load_a(st);
        return;
    }
    st->kt = 0;
    float *o = st->ob + (size_t)st->db * 32;
    TSTORE(0, o, 128);
    TSTORE(1, o + 16, 128);
    TSTORE(2, o + 16 * 32, 128);
    TSTORE(3, o + 16 * 32 + 16, 128);
    if ((st->db += 32) < st->D) {
        amx_pv_load_c(st);
        amx_pv_load_a(st);
        return;
    }
    st->done = 1;
}

static inline int amx_pv_steps(const amx_ws *L, int D, int tend) { /* steps of one row block's P.V */
    int n = 0;
    for (int i = 0; i < L->nv; i++) n += amx_pv_nj(L, i);
    return n * (D / 32) * (tend / 32);
}

/* The tile unit's work that one row block's softmax hides: the next block's scores, then the previous
 * block's P.V (each a sequence of 4-TDP steps on all 8 tiles; the P.V starts once the scores are done) */
typedef struct {
    amx_sc sc;
    amx_pvs pv;
} amx_next;

static inline void amx_step(amx_next *n) {
    if (!n->sc.done)
        amx_sc_step(&n->sc);
    else
        amx_pv_step(&n->pv);
}

/* A row's reference max m moves only when a tile's max exceeds it by more than AMX_SLACK (log2 units): p =
 * 2^(s - m) then stays below 2^AMX_SLACK, and O^T and l are rescaled at a few tiles per row instead of
 * whenever any of 16 rows sees a new max (lazy rescaling; the pieces keep p's relative precision, but
 * the row's largest p is no longer exactly 1: with 2-piece p that cost 6.8e-6 against 1.8e-6 on bf16) */
#define AMX_SLACK 8.0f

/* p of tokens 2tp, 2tp + 1 (16 rows each) into the P^T pieces at dword off = tp * 32 + the rows' column */
static inline void amx_p_pieces(const amx_ws *L, uint32_t *const *pw, size_t off, __m512 x0, __m512 x1) {
    for (int k = 0;; k++) {
        const __m512i h0 = amx_round(x0), h1 = amx_round(x1);
        _mm512_storeu_si512((void *)(pw[k] + off), amx_pair(h0, h1));
        if (k + 1 == L->np) break;
        x0 = amx_rest(x0, h0);
        x1 = amx_rest(x1, h1);
    }
}

/* The tokens of the tile [t0, t0 + AMX_T) that row block rb sees any of: [t0, t0 + tend), tend a multiple of
 * 32 (0: none). A causal prefill's rows see less of the tile that holds their own positions, so the tile
 * unit's work and the softmax stop there instead of scoring keys that every row of the block masks. */
static int amx_tend(const amx_ws *L, int rb, int t0) {
    int end = 0;
    for (int r = rb; r < rb + 32; r++)
        if (L->lo[r] <= L->hi[r] && L->lo[r] < t0 + AMX_T && L->hi[r] >= t0) {
            const int e = (L->hi[r] < t0 + AMX_T - 1 ? L->hi[r] : t0 + AMX_T - 1) - t0 + 1;
            end = e > end ? e : end;
        }
    return (end + 31) & ~31;
}

/* the online softmax of row block rb over the tokens [t0, t0 + tend) of the tile, 16 rows per vector: S ->
 * P^T pieces, with (m, l) and O^T rescaled where a row's max moved */
static void amx_softmax(const amx_ws *L, int D, int rb, int t0, int tend, const float *sbuf, uint32_t *const *pw,
                        amx_next *next) {
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    /* one step of the tile unit's work every `every` iterations of the loops below (2 tend per block) */
    const int steps = (next->sc.done ? 0 : amx_sc_steps(L, D, next->sc.tend)) +
                      (next->pv.done ? 0 : amx_pv_steps(L, D, next->pv.tend));
    const int every = steps == 0 ? 1 << 30 : (2 * tend) / (steps + 1) > 0 ? (2 * tend) / (steps + 1) : 1;
    int tick = 0;
#define AMX_TICK()                                  \
    do {                                            \
        if (++tick >= every) {                      \
            tick = 0;                               \
            amx_step(next);                         \
        }                                           \
    } while (0)
    for (int g = 0; g < 32; g += 16) {
        const int r = rb + g;
        const __m512i lo = _mm512_loadu_si512((const void *)(L->lo + r)), hi = _mm512_loadu_si512((const void *)(L->hi + r));
        /* the tile lies inside every row's visible range: no masks */
        const int inside = _mm512_reduce_max_epi32(lo) <= t0 && _mm512_reduce_min_epi32(hi) >= t0 + tend - 1;
        const __m512 m0 = _mm512_loadu_ps(L->m + r);
        float *s = (float *)sbuf + g;
        /* a tile inside the visible range of rows whose max is set: max and p in one pass over S, p taken
         * against the current max; where some row's max moves past AMX_SLACK (the first tile of each row,
         * rarely later) the pass is done again below, with the max taken first */
        if (inside && !_mm512_cmp_ps_mask(m0, ninf, _CMP_EQ_OQ)) {
            __m512 mx0 = ninf, mx1 = ninf, sum0 = _mm512_setzero_ps(), sum1 = sum0;
            for (int tp = 0; tp < tend / 2; tp++) {
                AMX_TICK(); /* twice: the ticks of the max pass this one saves */
                AMX_TICK();
                const __m512 s0 = _mm512_loadu_ps(s + (2 * tp) * 32), s1 = _mm512_loadu_ps(s + (2 * tp + 1) * 32);
                mx0 = _mm512_max_ps(s0, mx0);
                mx1 = _mm512_max_ps(s1, mx1);
                const __m512 p0 = amx_exp2(_mm512_sub_ps(s0, m0)), p1 = amx_exp2(_mm512_sub_ps(s1, m0));
                sum0 = _mm512_add_ps(sum0, p0);
                sum1 = _mm512_add_ps(sum1, p1);
                amx_p_pieces(L, pw, (size_t)tp * 32 + g, p0, p1);
            }
            if (!_mm512_cmp_ps_mask(_mm512_max_ps(mx0, mx1), _mm512_add_ps(m0, _mm512_set1_ps(AMX_SLACK)), _CMP_GT_OQ)) {
                _mm512_storeu_ps(L->l + r, _mm512_add_ps(_mm512_loadu_ps(L->l + r), _mm512_add_ps(sum0, sum1)));
                continue;
            }
        }
        __m512 mx0 = ninf, mx1 = ninf;
        if (inside)
            for (int t = 0; t < tend; t += 2) { /* NaN scores are skipped: max_ps returns its second operand */
                mx0 = _mm512_max_ps(_mm512_loadu_ps(s + t * 32), mx0);
                mx1 = _mm512_max_ps(_mm512_loadu_ps(s + t * 32 + 32), mx1);
                AMX_TICK();
            }
        else
            for (int t = 0; t < tend; t++) {
                if (t & 1) AMX_TICK();
                const __m512i pos = _mm512_set1_epi32(t0 + t);
                const __mmask16 vis = _mm512_cmp_epi32_mask(lo, pos, _MM_CMPINT_LE) & _mm512_cmp_epi32_mask(pos, hi, _MM_CMPINT_LE);
                const __m512 v = _mm512_mask_mov_ps(ninf, vis, _mm512_loadu_ps(s + t * 32));
                _mm512_storeu_ps(s + t * 32, v);
                mx0 = _mm512_max_ps(v, mx0);
            }
        const __m512 mx = _mm512_max_ps(mx0, mx1);
        const __mmask16 move = _mm512_cmp_ps_mask(mx, _mm512_add_ps(m0, _mm512_set1_ps(AMX_SLACK)), _CMP_GT_OQ);
        __m512 l = _mm512_loadu_ps(L->l + r), m = m0;
        if (move) {
            m = _mm512_mask_mov_ps(m0, move, mx);
            const __m512 corr = _mm512_mask_blend_ps(move, _mm512_set1_ps(1.0f), amx_exp2(_mm512_sub_ps(m0, mx)));
            l = _mm512_mul_ps(l, corr);
            float *o = L->o + (size_t)(rb / 32) * D * 32 + g;
            for (int d = 0; d < D; d++) _mm512_storeu_ps(o + d * 32, _mm512_mul_ps(_mm512_loadu_ps(o + d * 32), corr));
            _mm512_storeu_ps(L->m + r, m);
        }
        /* a row with nothing visible yet keeps max -inf: its scores are all -inf and give p = 0 */
        const __m512 mu = _mm512_mask_mov_ps(m, _mm512_cmp_ps_mask(m, ninf, _CMP_EQ_OQ), _mm512_setzero_ps());
        __m512 sum0 = _mm512_setzero_ps(), sum1 = sum0;
        for (int tp = 0; tp < tend / 2; tp++) {
            AMX_TICK();
            const __m512 p0 = amx_exp2(_mm512_sub_ps(_mm512_loadu_ps(s + (2 * tp) * 32), mu));
            const __m512 p1 = amx_exp2(_mm512_sub_ps(_mm512_loadu_ps(s + (2 * tp + 1) * 32), mu));
            sum0 = _mm512_add_ps(sum0, p0);
            sum1 = _mm512_add_ps(sum1, p1);
            amx_p_pieces(L, pw, (size_t)tp * 32 + g, p0, p1);
        }
        _mm512_storeu_ps(L->l + r, _mm512_add_ps(l, _mm512_add_ps(sum0, sum1)));
    }
#undef AMX_TICK
}

#ifdef AMX_PROF /* phase cycle counts of the last calls, single-threaded profiling builds only */
#include <time.h>
double amx_prof[8]; /* thread CPU seconds: this machine's other tenants take the wall clock */
static double amx_now(void) { struct timespec t; clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
#define PROF_T0() double prof_t = amx_now()
#define PROF(i) do { double prof_n = amx_now(); amx_prof[i] += prof_n - prof_t; prof_t = prof_n; } while (0)
#else
#define PROF_T0() (void)0
#define PROF(i) (void)0
#endif

void kv_amx_attn_item(const kv_call *c, const kv_item *it, kv_scratch *ws, float *pm, float *pl, float *po) {
    const int D = c->head_dim, G = c->n_heads / c->n_kv_heads, R = it->npos * G, RP = (R + 31) & ~31;
    const int s = it->seq, n_kv = c->seq_lens[s], n_q = c->q_lens[s];
    amx_ws L;
    amx_layout(D, R, (uint8_t *)ws->extra, &L);
    /* Pieces: K and V 2 (exact for f16, 2^-18 of int8 or 4-bit codes times an fp16 scale), 1 where bf16
     * holds them exactly, 3 for f32 in calls held to 1e-5; products of pieces i, j with i + j < the larger
     * count are kept. Calls held to the f32 paths' 1e-5 (no ggml format in K or V) take q and p in 3
     * pieces (exact), the rest 2 (2^-18): the 2-piece q measured 1.5e-5 against f64 (bf16 K, 70
     * queries over 300; 3 pieces: 1.8e-6), the 2-piece p 1.1e-5 (f16, a 33-token window), the
     * quantized formats 4e-5 against their 5e-4. */
    const int precise = !kv_is_quant(c->kfmt) && !kv_is_quant(c->vfmt);
    L.nk = amx_exact(c->kfmt) ? 1 : c->kfmt == KV_F32 && precise ? 3 : 2; /* f32: 24 bits */
    L.nv = amx_exact(c->vfmt) ? 1 : c->vfmt == KV_F32 && precise ? 3 : 2;
    L.nq = L.np = precise ? 3 : 2;
    L.nqk = L.nq > L.nk ? L.nq : L.nk;
    L.npv = L.nv > L.np ? L.nv : L.np;
    for (int r = 0; r < RP; r++) { /* each row's visible KV positions within the item's [lo, hi]; padding: none */
        int lo = 1, hi = 0;
        if (r < R) {
            kv_visible(c, n_kv, n_kv - n_q + it->pos0 + r / G, &lo, &hi);
            lo = lo > it->lo ? lo : it->lo;
            hi = hi < it->hi ? hi : it->hi;
        }
        L.lo[r] = lo;
        L.hi[r] = hi;
    }
    amx_config();
    const uint8_t *krows[AMX_T], *vrows[AMX_T];
    PROF_T0();
    for (int hh = 0; hh < it->nheads; hh++) {
        const int h = it->head0 + hh;
        amx_q(c, it, h, R, RP, &L);
        PROF(0);
        for (int r = 0; r < RP; r++) {
            L.m[r] = -INFINITY;
            L.l[r] = 0.0f;
        }
        memset(L.o, 0, (size_t)D * RP * sizeof(float));
        for (int t0 = it->lo; t0 <= it->hi; t0 += AMX_T) {
            const int nt = it->hi - t0 + 1 < AMX_T ? it->hi - t0 + 1 : AMX_T;
            for (int t = 0; t < nt;) { /* rows by page: one block-table lookup per page */
                const int j = t0 + t;
                int run = c->block_size - j % c->block_size;
                if (run > nt - t) run = nt - t;
                const uint8_t *kp = kv_row(c, c->kpool, c->krow, s, h, j), *vp = kv_row(c, c->vpool, c->vrow, s, h, j);
                for (int u = 0; u < run; u++, t++) {
                    krows[t] = kp + (int64_t)u * c->krow;
                    vrows[t] = vp + (int64_t)u * c->vrow;
                }
            }
            PROF(7);
            amx_k_tile(&L, c->kfmt, krows, nt, D);
            amx_v_tile(&L, c->vfmt, vrows, nt, D);
            PROF(1);
            /* row block rb's softmax runs while the tile unit scores block rb + 32 and then runs block
             * rb - 32's P.V (amx_step): the S and P buffers alternate between even and odd blocks */
            for (int rb = 0; rb < RP; rb += 32) L.tend[rb / 32] = amx_tend(&L, rb, t0);
            amx_next nx = {.pv = {.done = 1}};
            amx_sc_begin(&nx.sc, &L, D, 0, L.s, L.tend[0]);
            while (!nx.sc.done) amx_sc_step(&nx.sc);
            PROF(2);
            for (int rb = 0; rb < RP; rb += 32) {
                const int b = (rb / 32) & 1;
                if (rb + 32 < RP)
                    amx_sc_begin(&nx.sc, &L, D, rb + 32, L.s + (size_t)(b ^ 1) * AMX_T * 32, L.tend[rb / 32 + 1]);
                else
                    nx.sc.done = 1;
                if (rb > 0)
                    amx_pv_begin(&nx.pv, &L, D, rb - 32, L.p[b ^ 1], L.tend[rb / 32 - 1]);
                else
                    nx.pv.done = 1;
                amx_softmax(&L, D, rb, t0, L.tend[rb / 32], L.s + (size_t)b * AMX_T * 32, L.p[b], &nx);
                while (!nx.sc.done || !nx.pv.done) amx_step(&nx);
                PROF(3);
            }
            amx_pv_begin(&nx.pv, &L, D, RP - 32, L.p[((RP / 32) - 1) & 1], L.tend[RP / 32 - 1]);
            while (!nx.pv.done) amx_pv_step(&nx.pv);
            PROF(5);
        }
        /* rows of this head: item rows hh * R + r, O^T column r */
        for (int r = 0; r < R; r++) {
            const int ir = hh * R + r;
            ws->m[ir] = L.m[r];
            ws->l[ir] = L.l[r];
            float *dst;
            const float f = kv_item_row_end(c, it, ir, ws->m, ws->l, pm, pl, po, &dst);
            const float *o = L.o + (size_t)(r / 32) * D * 32 + r % 32;
            for (int d = 0; d < D; d++) dst[d] = o[d * 32] * f;
        }
        PROF(6);
    }
    amx_release();
}

#if defined(__clang__)
#pragma clang attribute pop
#endif

#else /* no AMX in this build */

int kv_amx_supported(void) { return 0; }
int kv_amx_takes(const kv_call *c) {
    (void)c;
    return 0;
}
size_t kv_amx_extra_bytes(const kv_call *c, int rows) {
    (void)c;
    (void)rows;
    return 0;
}
void kv_amx_attn_item(const kv_call *c, const kv_item *it, kv_scratch *ws, float *pm, float *pl, float *po) {
    (void)c, (void)it, (void)ws, (void)pm, (void)pl, (void)po;
}

#endif
