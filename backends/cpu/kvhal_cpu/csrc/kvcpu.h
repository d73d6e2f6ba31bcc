/* kvhal cpu backend: shared declarations.
 *
 * Every translation unit (scalar, avx2, avx512, neon) fills one kv_isa table; api.c picks one at run
 * time (cpuid, or KVHAL_CPU_ISA through the Python side) and drives the thread pool. Pools use
 * kvhal's layout [n_blocks][n_kv_heads][block_size][row_bytes], rows in ggml's byte layout.
 */
#ifndef KVCPU_H
#define KVCPU_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>

#if defined(__GNUC__)
#define KV_EXPORT __attribute__((visibility("default")))
#define KV_INLINE static inline __attribute__((always_inline))
#define KV_ALIGN(n) __attribute__((aligned(n)))
#else
#define KV_EXPORT
#define KV_INLINE static inline
#define KV_ALIGN(n)
#endif

#include "formats.h" /* format ids and block sizes, generated from kvhal's registry */

/* KV_ISA_AMX: the AVX-512 kernels, with prefill items on the AMX tile unit (kern_amx.c) */
enum { KV_ISA_SCALAR = 0, KV_ISA_AVX2, KV_ISA_AVX512, KV_ISA_NEON, KV_ISA_AMX, KV_NISA };

#define KV_QK 32 /* values per block of every quantized format the kernels run */
_Static_assert(KV_Q8_0_LEN == KV_QK && KV_Q4_0_LEN == KV_QK && KV_Q4_1_LEN == KV_QK && KV_Q5_0_LEN == KV_QK &&
                   KV_Q5_1_LEN == KV_QK && KV_F32_LEN == 1 && KV_F16_LEN == 1 && KV_BF16_LEN == 1,
               "the kernels are written for 32-value quantized blocks and one-value float blocks");
/* KV tokens per attention tile, per ISA (each kern_*.c is its own translation unit and may define
 * KV_T before including this); KV_T_MAX sizes the shared score buffer */
#define KV_T_MAX 128
#ifndef KV_T
#define KV_T 32
#endif
#if KV_T > KV_T_MAX
#error "KV_T exceeds KV_T_MAX"
#endif

static const int kv_block_len[KV_NFMT] = KV_BLOCK_LEN_TABLE;
static const int kv_block_bytes[KV_NFMT] = KV_BLOCK_BYTES_TABLE;

/* ggml's 32-value block formats (q8_0 .. q5_1): those the integer kernels run; the later block formats
 * (kern_v2.h) take the f32 path */
static inline int kv_is_quant(int fmt) { return fmt >= KV_Q8_0 && fmt <= KV_Q5_1; }

/* The arguments of every exported call, one struct mirrored field for field by kvhal_cpu/_abi.py;
 * kvc_args_layout() reports its size and offsets, and Python refuses a library whose layout differs.
 * The first fields describe one layer of one cache (filled once per cache); the rest are per call. */
typedef struct {
    int32_t isa, threads, kv_split, tile; /* kv_split 0: never split; tile 0: chosen per call */
    int32_t kfmt, vfmt;                   /* format ids (formats.h) */
    int32_t n_kv_heads, head_dim, block_size, n_heads; /* n_heads: query heads of an attention call */
    int32_t kpaged;                       /* K of kfmt (kivi4/kivi2) per channel over whole pages (kivi_k.c) */
    int64_t krow, vrow;                   /* bytes of one stored row (from kvhal's registry) */
    uint8_t *kpool, *vpool;               /* the layer's pools [n_blocks][n_kv_heads][block_size][row] */
    /* store: k, v [n][n_kv_heads][head_dim] into slots[n]; copy_slots: slots[n] into dst_slots[n];
     * load: the first n tokens of the pages blocks[] into kout, vout [n][n_kv_heads][head_dim] */
    const float *k, *v;
    const int64_t *slots, *dst_slots, *blocks;
    float *kout, *vout;
    int64_t n;
    /* read_blocks / write_blocks: the pages of the n blocks blocks[] and raw [n][raw_stride] bytes, this
     * layer's K page at raw + i * raw_stride, its V page right after */
    uint8_t *raw;
    int64_t raw_stride;
    /* attention of q [sum q_lens][n_heads][head_dim] into out over block_table [n_seqs][max_blocks];
     * lse (NULL: not wanted) gets each row's natural log-sum-exp of its scaled scores [sum q_lens][n_heads],
     * -inf for a row that sees no key (its out row is 0). holes (NULL: none) [n_seqs][n_kv_heads][2]: KV head h of
     * sequence s does not attend positions [lo, hi) (a per-head eviction's dropped rows; empty when lo >= hi) */
    const float *q;
    float *out;
    double *lse;
    const int32_t *block_table, *seq_lens, *q_lens, *holes;
    int32_t n_seqs, max_blocks, causal, window; /* window <= 0: none */
    float scale;
} kv_args;

/* One attention call as the kernels see it: kv_args plus what the driver derives once per call. */
typedef struct {
    int n_seqs, n_heads, n_kv_heads, head_dim, block_size, max_blocks;
    int kfmt, vfmt, causal, window; /* window <= 0: none */
    int64_t krow, vrow;             /* row bytes */
    float scale2;                   /* softmax scale * log2(e): kernels use exp2 */
    const float *q;                 /* [sum q_lens][n_heads][head_dim] */
    float *out;
    double *lse;                    /* [sum q_lens][n_heads] or NULL */
    const uint8_t *kpool, *vpool;
    const int32_t *block_table, *seq_lens, *q_lens;
    const int64_t *q_start; /* first q row of each sequence */
    int prefetch;           /* software prefetch of the rows ahead: the call's K/V outgrows the cache */
    int kpaged;             /* K per channel over whole pages: attention turns each tile into f32 rows first */
    /* K records of a codec with side data (kltq, kltq.c): the stored row of KV head h -> its f32 coefficients,
     * what the mass pass scores (q in coefficient space); NULL: K rows of kfmt (or kpaged pages) */
    void (*kdecode)(const void *ctx, int h, const uint8_t *row, float *out);
    const void *kdecode_ctx;
} kv_call;

/* One unit of work: query positions [pos0, pos0+npos) of one sequence and KV heads
 * [head0, head0+nheads), against KV positions [lo, hi] (inclusive). part >= 0: a slice of a split KV
 * range, written to the partials. */
typedef struct {
    int seq, head0, nheads, pos0, npos, lo, hi;
    int part; /* -1: final output */
} kv_item;

/* per-channel K pages (kivi_k.c): a page's bytes are block_size rows of codes, then f16 d[D] and m[D] */
int64_t kv_kpage_code_bytes(int fmt, int D);
/* x rows u < bs (stride xstride floats) of one KV head -> its page */
void kv_kpage_quantize(int fmt, const float *x, int64_t xstride, int bs, int D, uint8_t *page);

/* Per-thread scratch, sized by the driver for the largest item of the call. */
typedef struct {
    float *qf;   /* [R][D] scaled queries */
    float *o;    /* [R][D] output accumulator (kernel-defined dim order) */
    float *m, *l;
    float *s;    /* [R][KV_T] scores, then probabilities */
    void *extra; /* kernel scratch */
    size_t extra_bytes;
} kv_scratch;


/* One unit of kvc_attention_mass: KV head `head` of sequence `seq`, keys [j0, j0 + nt) (nt <= KV_MASS_T), whose
 * sums go to total[t] and window[t] (t < nt); query rows from `split` on are the last `tail` of the sequence,
 * summed into window as well. hole0 < hole1: keys this head does not attend (per-head eviction). */
#define KV_MASS_T 64
typedef struct {
    int seq, head, j0, nt, split, hole0, hole1;
    double *total, *window;
} kv_mass_item;
/* floats of one worker's kvc_attention_mass scratch: sums [2][KV_MASS_T] doubles, scores [4][KV_MASS_T], the
 * tile's K rows [KV_MASS_T][D] and the same transposed [D][KV_MASS_T] */
#define KV_MASS_SCRATCH(D) ((size_t)(8 * KV_MASS_T + 2 * KV_MASS_T * (D)))

typedef struct {
    const char *name;
    void (*quantize)(int fmt, const float *x, uint8_t *dst, int d);
    void (*dequantize)(int fmt, const uint8_t *src, float *dst, int d);
    /* rows [u0, u0 + n) of a per-channel K page -> f32 rows dst (stride dstride floats) */
    void (*kpage_rows)(int fmt, const uint8_t *page, int bs, int D, int u0, int n, float *dst, int64_t dstride);
    /* run one item; writes rows of out (part < 0) or its partial (m, l, o in natural dim order) */
    void (*attn_item)(const kv_call *c, const kv_item *it, kv_scratch *ws, float *part_m, float *part_l,
                      float *part_o);
    size_t (*extra_bytes)(const kv_call *c, int rows);
    /* one kvc_attention_mass item (c->lse holds the rows' log-sum-exp), with KV_MASS_SCRATCH floats of scratch */
    void (*mass_item)(const kv_call *c, const kv_mass_item *it, float *scratch);
} kv_isa;

/* kvc_attention_mass's driver (api.c) for a call c (q_start filled here) with `isa`'s mass_item: the items
 * of every (sequence, KV head, KV_MASS_T keys) on `threads` threads; holes as kv_args' (NULL: none) */
int kv_attention_mass_run(kv_call c, const kv_isa *isa, const int32_t *holes, int threads, int32_t tail,
                          double *total, double *window);

extern const kv_isa kv_isa_scalar;
#if defined(__x86_64__) || defined(_M_X64)
extern const kv_isa kv_isa_avx2;
extern const kv_isa kv_isa_avx512;
extern const kv_isa kv_isa_avx512_t128; /* the same kernels with 128-token tiles */
#endif
#if defined(__aarch64__)
extern const kv_isa kv_isa_neon;
#endif

/* AMX prefill (kern_amx.c; stubs that say no where the build has no AMX): whether this CPU and OS run it
 * (cpuid, XCR0, and Linux's tile-state permission, asked once), whether a call's formats and head_dim
 * do, and its item kernel, which api.c gives items of at least KV_AMX_MIN_ROWS query rows per KV head */
#define KV_AMX_MIN_ROWS 16
/* items of at least this many query rows per KV head run kern_template.h's GEMM-form tiles (avx2) */
#define KV_GEMM_MIN_ROWS 12
int kv_amx_supported(void);
int kv_amx_takes(const kv_call *c);
size_t kv_amx_extra_bytes(const kv_call *c, int rows);
void kv_amx_attn_item(const kv_call *c, const kv_item *it, kv_scratch *ws, float *part_m, float *part_l, float *part_o);

/* thread pool (pool.c) */
typedef void (*kv_task_fn)(void *ctx, int64_t task, int worker);
void kv_pool_run(kv_task_fn fn, void *ctx, int64_t n_tasks, int n_threads);

/* rows visible to query position pos: [lo, hi] */
KV_INLINE void kv_visible(const kv_call *c, int n_kv, int pos, int *lo, int *hi) {
    *hi = c->causal ? pos : n_kv - 1;
    *lo = c->window > 0 ? pos - c->window + 1 : 0;
    if (*lo < 0) *lo = 0;
}

/* pointer to the stored row of KV position j of sequence s, head h */
KV_INLINE const uint8_t *kv_row(const kv_call *c, const uint8_t *pool, int64_t row_bytes, int s, int h, int j) {
    int32_t blk = c->block_table[(int64_t)s * c->max_blocks + j / c->block_size];
    int64_t r = ((int64_t)blk * c->n_kv_heads + h) * c->block_size + j % c->block_size;
    return pool + r * row_bytes;
}

/* The end of query row `qrow`, head `head`, whose online softmax holds max m (log2 units: scores carry
 * scale*log2 e) and sum l: its log-sum-exp into c->lse when wanted, and the factor its output takes
 * (1/l; 0 for a row that saw no key, so it reads 0 rather than 0/0) */
KV_INLINE float kv_row_done(const kv_call *c, int64_t qrow, int head, float m, float l) {
    if (l != l) { /* a NaN score (kern_v2.h: an fp8 K inf/NaN code): lse and output NaN, as in float64 */
        if (c->lse) c->lse[qrow * c->n_heads + head] = NAN;
        return NAN;
    }
    if (c->lse) c->lse[qrow * c->n_heads + head] = l > 0.0f ? (double)m * 0.6931471805599453 + log((double)l) : -INFINITY;
    return l > 0.0f ? 1.0f / l : 0.0f;
}

/* Where row r of an item ends (rows r = head_in_group * R + position * G + gqa_head, R = npos * G): a final
 * item's output row, with kv_row_done's lse and factor 1/l; a split's partial slot po[r], with m and l kept
 * for the merge and factor 1. Every kernel's epilogue writes o times the returned factor to *dst. */
KV_INLINE float kv_item_row_end(const kv_call *c, const kv_item *it, int r, const float *m, const float *l,
                                float *pm, float *pl, float *po, float **dst) {
    const int G = c->n_heads / c->n_kv_heads, R = it->npos * G;
    if (it->part >= 0) {
        *dst = po + (size_t)r * c->head_dim;
        pm[r] = m[r];
        pl[r] = l[r];
        return 1.0f;
    }
    const int head = (it->head0 + r / R) * G + r % G;
    const int64_t qrow = c->q_start[it->seq] + it->pos0 + (r % R) / G;
    *dst = c->out + (qrow * c->n_heads + head) * c->head_dim;
    return kv_row_done(c, qrow, head, m[r], l[r]);
}

/* Carving a kernel's workspace: point L->field at base + off (when L is given: a first call with L NULL
   only sizes it) and advance off past count items of type, 64-byte aligned. */
#define KV_WS_TAKE(L, base, off, field, type, count)                 \
    do {                                                             \
        if (L) (L)->field = (type *)(void *)((base) + (off));        \
        (off) += ((size_t)(count) * sizeof(type) + 63) & ~(size_t)63; \
    } while (0)

#endif
