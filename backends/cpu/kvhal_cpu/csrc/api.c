/* The exported C API (loaded by kvhal_cpu through ctypes): ISA selection, store, load, copy_slots, block I/O and
 * the attention driver that cuts a batch into (sequence, KV head, query chunk, KV split) items,
 * runs them on the thread pool and merges split-KV partials with a log-sum-exp. */
#define _GNU_SOURCE
#include <math.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>

#include "kvcpu.h"

/* query rows (positions x GQA heads) per KV head and item in prefill: each K/V tile an item reads is
 * converted and walked once for all of them. 64 against 16 (AMD EPYC, 1 thread, 512 queries over 4k,
 * GQA 4): f16 565 -> 423 ms, q8_0 391 -> 276 ms, q4_0 324 -> 281 ms. 128 against 64 (2 threads, 512
 * queries, interleaved, with 128-token tiles and unsplit prefill KV): q8_0 16k 1.04-1.06x, f16 16k
 * 1.06x, f16 4k 1.04x, q8_0 4k and q4_0 16k 1.00-1.01x; 256 was no faster. */
#define KV_ROWS_TARGET 128
/* AMX prefill (kern_amx.c): rows per KV head and item; each K/V tile is dequantized and split into bf16
 * once for all of them, which at 128 rows took a third of the item's time (q8_0, 4k). 1024 against 512
 * (q8_0, 512 queries GQA 4, 1 thread, CPU time): the tile preparation 14 -> 8 ms at 4k, 4-5% of the
 * call at 4k and 16k; 2048 halves it again but a tile's pass over the rows' Q^T and O^T (2 MB) then
 * leaves L2 and the main loop slows by more (80 -> 90 ms at 4k). */
#ifndef KV_AMX_ROWS_TARGET
#define KV_AMX_ROWS_TARGET 1024
#endif
#define KV_HEAD_GROUP 8   /* KV heads per item: their rows lie back to back in a page */
/* rows of a decode-sized item (positions x query heads of its KV heads): up to this many keep kv_split
 * slices and the tile chosen by where K/V sits; more (prefill) take longer slices and 128-token tiles */
#define KV_DECODE_ROWS 128

enum { KV_OK = 0, KV_EUNSUPPORTED = -1, KV_ENOMEM = -2, KV_EARG = -3 };

#if (defined(__x86_64__) || defined(_M_X64)) && defined(__GNUC__)
#include <cpuid.h>
/* clang's __builtin_cpu_supports has no "f16c": read CPUID.1:ECX bit 29 directly */
static int kv_has_f16c(void) {
    unsigned a, b, c, d;
    return __get_cpuid(1, &a, &b, &c, &d) && (c & (1u << 29));
}
#endif

KV_EXPORT int kvc_abi_version(void) { return 6; }

/* kv_args as this build lays it out: "kv_args <size>" then "<name> <offset> <size> <kind>" per field in
 * declaration order (kind: i int32, q int64, f float, p pointer), ';'-separated. Python compares it
 * with its mirror, so a field added, moved, renamed or retyped on one side only refuses the library. */
#define KV_KIND(x) _Generic((x), int32_t: 'i', int64_t: 'q', float: 'f', default: 'p')
#define KV_FIELD(f) {#f, offsetof(kv_args, f), sizeof(((kv_args *)0)->f), KV_KIND(((kv_args *)0)->f)}
KV_EXPORT int kvc_args_layout(char *out, int cap) {
    static const struct {
        const char *name;
        size_t offset, size;
        char kind;
    } fields[] = {KV_FIELD(isa),        KV_FIELD(threads),     KV_FIELD(kv_split),  KV_FIELD(tile),
                  KV_FIELD(kfmt),       KV_FIELD(vfmt),        KV_FIELD(n_kv_heads), KV_FIELD(head_dim),
                  KV_FIELD(block_size), KV_FIELD(n_heads),     KV_FIELD(kpaged),    KV_FIELD(krow),
                  KV_FIELD(vrow),
                  KV_FIELD(kpool),      KV_FIELD(vpool),       KV_FIELD(k),         KV_FIELD(v),
                  KV_FIELD(slots),      KV_FIELD(dst_slots),   KV_FIELD(blocks),    KV_FIELD(kout),
                  KV_FIELD(vout),       KV_FIELD(n),           KV_FIELD(raw),       KV_FIELD(raw_stride),
                  KV_FIELD(q),          KV_FIELD(out),         KV_FIELD(lse),       KV_FIELD(block_table),
                  KV_FIELD(seq_lens),   KV_FIELD(q_lens),      KV_FIELD(holes),     KV_FIELD(n_seqs),
                  KV_FIELD(max_blocks), KV_FIELD(causal),      KV_FIELD(window),    KV_FIELD(scale)};
    int n = snprintf(out, (size_t)cap, "kv_args %zu", sizeof(kv_args));
    for (size_t i = 0; i < sizeof fields / sizeof fields[0]; i++)
        n += snprintf(out + (n < cap ? n : cap), (size_t)(n < cap ? cap - n : 0), ";%s %zu %zu %c", fields[i].name,
                      fields[i].offset, fields[i].size, fields[i].kind);
    return n; /* the length it needs; the text is whole when that is < cap */
}

/* the formats these kernels implement, as (id, values per block, bytes per block) triples from
 * formats.h: Python checks them against kvhal's registry and refuses the formats not listed */
KV_EXPORT int kvc_format_table(int32_t *out, int cap) {
    static const int implemented[] = {KV_F32,      KV_F16,      KV_BF16,  KV_Q8_0,  KV_Q4_0,  KV_Q4_1,  KV_Q5_0,
                                      KV_Q5_1,     KV_FP8_E4M3, KV_FP8_E5M2, KV_MXFP4, KV_NVFP4, KV_KIVI4, KV_KIVI2};
    const int n = (int)(sizeof implemented / sizeof implemented[0]);
    for (int i = 0; i < n && 3 * i + 2 < cap; i++) {
        out[3 * i] = implemented[i];
        out[3 * i + 1] = kv_block_len[implemented[i]];
        out[3 * i + 2] = kv_block_bytes[implemented[i]];
    }
    return n;
}

static int isa_probe(int isa) {
    switch (isa) {
    case KV_ISA_SCALAR:
        return 1;
#if (defined(__x86_64__) || defined(_M_X64)) && defined(__GNUC__)
    case KV_ISA_AVX2:
        __builtin_cpu_init();
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && kv_has_f16c();
    case KV_ISA_AVX512:
        __builtin_cpu_init();
        return isa_probe(KV_ISA_AVX2) && __builtin_cpu_supports("avx512f") &&
               __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
               __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vnni");
    case KV_ISA_AMX:
        return isa_probe(KV_ISA_AVX512) && kv_amx_supported();
#endif
#if defined(__aarch64__)
    case KV_ISA_NEON:
        return 1; /* Advanced SIMD and fp16 conversions are mandatory in AArch64 */
#endif
    default:
        return 0;
    }
}

/* cpuid traps to the hypervisor in a VM (microseconds each): probe once, then answer from the cache */
KV_EXPORT int kvc_isa_supported(int isa) {
    static _Atomic int known[KV_NISA]; /* 0: not probed yet, 1: no, 2: yes */
    if (isa < 0 || isa >= KV_NISA) return 0;
    int k = atomic_load_explicit(&known[isa], memory_order_relaxed);
    if (!k) {
        k = isa_probe(isa) ? 2 : 1;
        atomic_store_explicit(&known[isa], k, memory_order_relaxed);
    }
    return k == 2;
}

KV_EXPORT int kvc_best_isa(void) {
    for (int isa = KV_NISA - 1; isa > 0; isa--)
        if (kvc_isa_supported(isa)) return isa;
    return KV_ISA_SCALAR;
}

static const kv_isa *get_isa(int isa) {
    if (!kvc_isa_supported(isa)) return NULL;
    switch (isa) {
#if defined(__x86_64__) || defined(_M_X64)
    case KV_ISA_AVX2:
        return &kv_isa_avx2;
    case KV_ISA_AVX512:
    case KV_ISA_AMX: /* store, load and decode: the AVX-512 kernels; prefill items go to kern_amx.c */
        return &kv_isa_avx512;
#endif
#if defined(__aarch64__)
    case KV_ISA_NEON:
        return &kv_isa_neon;
#endif
    default:
        return &kv_isa_scalar;
    }
}

/* 0 when every value is finite, with the largest |x| in *amax; 1 otherwise */
KV_EXPORT int kvc_scan_f32(const float *x, int64_t n, float *amax) {
    float m = 0.0f;
    int bad = 0;
    for (int64_t i = 0; i < n; i++) {
        float a = fabsf(x[i]);
        bad |= !(a <= 3.4028235e38f); /* NaN compares false */
        m = a > m ? a : m;
    }
    *amax = m;
    return bad;
}

/* ---- store / load / copy ------------------------------------------------------------------------ */

#define ROWS_PER_TASK 64

typedef struct {
    const kv_isa *isa;
    int fmt[2];
    const float *x[2];
    uint8_t *pool[2];
    int64_t row_bytes[2];
    const int64_t *slots;
    int64_t n;
    int H, D, bs;
} store_ctx;

static void store_task(void *p, int64_t task, int worker) {
    (void)worker;
    store_ctx *c = (store_ctx *)p;
    int64_t rows = c->n * c->H, r0 = task * ROWS_PER_TASK, r1 = r0 + ROWS_PER_TASK;
    if (r1 > rows) r1 = rows;
    for (int w = c->pool[0] ? 0 : 1; w < 2; w++) /* pool[0] NULL: K is stored by pages (kpage_task) */
        for (int64_t r = r0; r < r1; r++) {
            int64_t i = r / c->H, h = r % c->H, slot = c->slots[i];
            int64_t dst = ((slot / c->bs) * c->H + h) * c->bs + slot % c->bs;
            c->isa->quantize(c->fmt[w], c->x[w] + r * c->D, c->pool[w] + dst * c->row_bytes[w], c->D);
        }
}

/* one (page, KV head) of a per-channel K store: slots [task / H * bs, +bs) fill that page in order */
static void kpage_task(void *p, int64_t task, int worker) {
    (void)worker;
    const kv_args *a = (const kv_args *)p;
    const int H = a->n_kv_heads, D = a->head_dim, bs = a->block_size;
    const int64_t i0 = task / H * bs, h = task % H, page = a->slots[i0] / bs;
    kv_kpage_quantize(a->kfmt, a->k + (i0 * H + h) * D, (int64_t)H * D, bs, D, a->kpool + (page * H + h) * bs * a->krow);
}

KV_EXPORT int kvc_store(const kv_args *a) {
    const kv_isa *isa = get_isa(a->isa);
    if (!isa) return KV_EUNSUPPORTED;
    const int bs = a->block_size;
    if (a->kpaged) { /* whole pages, each in token order (Python checks this first and says why) */
        if (a->n % bs) return KV_EARG;
        for (int64_t i = 0; i < a->n; i++)
            if (a->slots[i] % bs != i % bs || a->slots[i] / bs != a->slots[i - i % bs] / bs) return KV_EARG;
    }
    store_ctx c = {isa, {a->kfmt, a->vfmt}, {a->k, a->v}, {a->kpaged ? NULL : a->kpool, a->vpool}, {a->krow, a->vrow},
                   a->slots, a->n, a->n_kv_heads, a->head_dim, bs};
    if (a->kpaged) kv_pool_run(kpage_task, (void *)a, a->n / bs * a->n_kv_heads, a->threads);
    kv_pool_run(store_task, &c, (a->n * a->n_kv_heads + ROWS_PER_TASK - 1) / ROWS_PER_TASK, a->threads);
    return KV_OK;
}

/* load_cvt.c: f32 -> f16/bf16 rows (dtype 1 f16, 2 bf16), and the output copy (non-temporal when stream) */
void kv_cvt_row(int isa, int dtype, const float *src, uint16_t *dst, int n);
void kv_out_copy(int isa, void *dst, const void *src, size_t n, int stream);
void kv_out_fence(void);
int kv_load_row(int isa, int fmt, const uint8_t *src, void *dst, int dtype, int d);

/* outputs of at least this many bytes (K and V) are written with non-temporal stores: far larger than the caches,
 * so a regular store's read-for-ownership of each line would add the output's size again to the traffic */
#define KV_STREAM_OUT_BYTES (8 << 20)

typedef struct {
    const kv_isa *isa;
    const kv_args *a;
    int64_t skip;
    int dtype;      /* 0 f32, 1 f16, 2 bf16 */
    int stream;     /* stage each token's rows, then copy them out with non-temporal stores */
    float *scratch; /* per worker: scratch_floats f32 */
    size_t scratch_floats;
} load_to_ctx;

/* kvc_load_to's task: page `task`'s tokens t >= skip (K then V) into output rows t - skip. Rows are dequantized
 * into a scratch that stays in L1, narrowed there, and copied out a token (all heads: contiguous in the output)
 * at a time; an f32 output that is not streamed is written directly. */
static void load_to_task(void *p, int64_t task, int worker) {
    const load_to_ctx *c = (const load_to_ctx *)p;
    const kv_args *a = c->a;
    const int H = a->n_kv_heads, D = a->head_dim, bs = a->block_size, isa = a->isa;
    const int direct = c->dtype == 0 && !c->stream;
    const int64_t t0 = task * bs, HD = (int64_t)H * D;
    const int nt = a->n - t0 < bs ? (int)(a->n - t0) : bs;
    const int u0 = c->skip > t0 ? (int)(c->skip - t0) : 0; /* first token of this page that is written */
    const size_t esize = c->dtype ? 2 : 4, tok_bytes = (size_t)HD * esize;
    /* f32 rows: [D], or a head's page [bs][D] of per-channel K; then the stage [H][D] of the output dtype */
    float *f32 = c->scratch + (size_t)worker * c->scratch_floats;
    uint8_t *stage = (uint8_t *)(void *)(f32 + (((size_t)(a->kpaged ? bs : 1) * D + 15) & ~(size_t)15));
    for (int w = 0; w < 2; w++) {
        const int fmt = w ? a->vfmt : a->kfmt;
        const int64_t row = w ? a->vrow : a->krow;
        const uint8_t *page = (w ? a->vpool : a->kpool) + a->blocks[task] * H * bs * row;
        uint8_t *out = (uint8_t *)(w ? a->vout : a->kout) + (size_t)(t0 + u0 - c->skip) * tok_bytes;
        const int paged = !w && a->kpaged;
        if (direct) {
            for (int h = 0; h < H; h++) {
                float *o = (float *)(void *)out + (int64_t)h * D;
                if (paged) c->isa->kpage_rows(fmt, page + (int64_t)h * bs * row, bs, D, u0, nt - u0, o, HD);
                else
                    for (int t = u0; t < nt; t++) c->isa->dequantize(fmt, page + ((int64_t)h * bs + t) * row, o + (t - u0) * HD, D);
            }
            continue;
        }
        if (paged) { /* a head's rows come from its whole page: dequantized at once, then narrowed row by row */
            const size_t row_out = (size_t)D * esize;
            for (int h = 0; h < H; h++) {
                c->isa->kpage_rows(fmt, page + (int64_t)h * bs * row, bs, D, u0, nt - u0, f32, D);
                for (int t = 0; t < nt - u0; t++) {
                    const float *src = f32 + (size_t)t * D;
                    if (c->dtype) kv_cvt_row(isa, c->dtype, src, (uint16_t *)(void *)stage, D);
                    kv_out_copy(isa, out + (size_t)t * tok_bytes + h * row_out, c->dtype ? (const void *)stage : src,
                                row_out, c->stream);
                }
            }
            continue;
        }
        for (int t = u0; t < nt; t++) {
            for (int h = 0; h < H; h++) {
                uint8_t *o = stage + (size_t)h * D * esize;
                const uint8_t *src = page + ((int64_t)h * bs + t) * row;
                if (kv_load_row(isa, fmt, src, o, c->dtype, D)) continue;
                float *dst = c->dtype ? f32 : (float *)(void *)o;
                c->isa->dequantize(fmt, src, dst, D);
                if (c->dtype) kv_cvt_row(isa, c->dtype, dst, (uint16_t *)(void *)o, D);
            }
            kv_out_copy(isa, out + (size_t)(t - u0) * tok_bytes, stage, tok_bytes, c->stream);
        }
    }
    if (c->stream) kv_out_fence();
}

/* K and V of tokens [skip, n) of the pages a->blocks (skip < block_size) into a->kout / a->vout, rows
 * [n - skip][n_kv_heads][head_dim] of dtype 0 f32, 1 f16, 2 bf16 (uint16 bits) */
KV_EXPORT int kvc_load_to(const kv_args *a, int64_t skip, int32_t dtype) {
    const kv_isa *isa = get_isa(a->isa);
    if (!isa) return KV_EUNSUPPORTED;
    if (skip < 0 || skip > a->n || skip >= a->block_size || dtype < 0 || dtype > 2) return KV_EARG;
    const int workers = a->threads > 1 ? a->threads : 1;
    const int64_t HD = (int64_t)a->n_kv_heads * a->head_dim;
    const int stream = 2 * (a->n - skip) * HD * (dtype ? 2 : 4) >= KV_STREAM_OUT_BYTES;
    /* per worker: f32 rows (one, or a page of per-channel K) and an [H][D] stage, each a 64-byte multiple so every
     * worker's stays aligned */
    const size_t rows = (size_t)(a->kpaged ? a->block_size : 1) * (size_t)a->head_dim;
    const size_t per = ((rows + 15) & ~(size_t)15) + (((size_t)HD + 15) & ~(size_t)15);
    float *scratch = NULL;
    if ((dtype || stream) && !(scratch = (float *)aligned_alloc(64, (size_t)workers * per * sizeof(float))))
        return KV_ENOMEM;
    load_to_ctx c = {isa, a, skip, dtype, stream, scratch, per};
    kv_pool_run(load_to_task, &c, (a->n + a->block_size - 1) / a->block_size, workers);
    free(scratch);
    return KV_OK;
}

/* gather every source row first, then scatter: sources and destinations may overlap (seq_rm) */
static int copy_slots(uint8_t *pool, int64_t row_bytes, const int64_t *src, const int64_t *dst, int64_t n, int H,
                      int bs) {
    uint8_t *tmp = (uint8_t *)malloc((size_t)(n * H * row_bytes) + 1);
    if (!tmp) return KV_ENOMEM;
    for (int pass = 0; pass < 2; pass++)
        for (int64_t i = 0; i < n; i++) {
            int64_t slot = pass ? dst[i] : src[i];
            for (int h = 0; h < H; h++) {
                uint8_t *row = pool + (((slot / bs) * H + h) * bs + slot % bs) * row_bytes;
                uint8_t *t = tmp + (i * H + h) * row_bytes;
                if (pass)
                    memcpy(row, t, (size_t)row_bytes);
                else
                    memcpy(t, row, (size_t)row_bytes);
            }
        }
    free(tmp);
    return KV_OK;
}

/* the stored rows of a->slots into a->dst_slots, K and V */
KV_EXPORT int kvc_copy_slots(const kv_args *a) {
    int rc = copy_slots(a->kpool, a->krow, a->slots, a->dst_slots, a->n, a->n_kv_heads, a->block_size);
    return rc ? rc : copy_slots(a->vpool, a->vrow, a->slots, a->dst_slots, a->n, a->n_kv_heads, a->block_size);
}

/* whole pages between the pools and the raw block layout, BLOCKS_PER_TASK blocks per task */
#define BLOCKS_PER_TASK 8

typedef struct {
    const kv_args *a;
    int write; /* 1: raw -> pools, 0: pools -> raw */
} blocks_ctx;

static void blocks_task(void *p, int64_t task, int worker) {
    (void)worker;
    const blocks_ctx *c = (const blocks_ctx *)p;
    const kv_args *a = c->a;
    const int64_t rows = (int64_t)a->n_kv_heads * a->block_size, kb = rows * a->krow, vb = rows * a->vrow;
    int64_t i1 = (task + 1) * BLOCKS_PER_TASK;
    if (i1 > a->n) i1 = a->n;
    for (int64_t i = task * BLOCKS_PER_TASK; i < i1; i++) {
        uint8_t *raw = a->raw + i * a->raw_stride, *kp = a->kpool + a->blocks[i] * kb, *vp = a->vpool + a->blocks[i] * vb;
        if (c->write) {
            memcpy(kp, raw, (size_t)kb);
            memcpy(vp, raw + kb, (size_t)vb);
        } else {
            memcpy(raw, kp, (size_t)kb);
            memcpy(raw + kb, vp, (size_t)vb);
        }
    }
}

static int copy_blocks(const kv_args *a, int write) {
    blocks_ctx c = {a, write};
    kv_pool_run(blocks_task, &c, (a->n + BLOCKS_PER_TASK - 1) / BLOCKS_PER_TASK, a->threads);
    return KV_OK;
}

/* this layer's K and V pages of the blocks a->blocks into a->raw */
KV_EXPORT int kvc_read_blocks(const kv_args *a) { return copy_blocks(a, 0); }

/* a->raw into this layer's K and V pages of the blocks a->blocks (distinct ids: tasks run in parallel) */
KV_EXPORT int kvc_write_blocks(const kv_args *a) { return copy_blocks(a, 1); }

/* ---- attention ---------------------------------------------------------------------------------- */

typedef struct {
    int first_part, n_parts; /* partials of one (sequence, head group, chunk) */
    int seq, head0, nheads, pos0, npos;
} kv_group;

typedef struct {
    const kv_call *c;
    const kv_isa *isa;
    kv_item *items;
    kv_group *groups;
    kv_scratch *ws;
    float *part_m, *part_l, *part_o;
    int rows_max;
    int amx; /* items of at least KV_AMX_MIN_ROWS rows per KV head run kv_amx_attn_item */
} attn_ctx;

static void attn_task(void *p, int64_t task, int worker) {
    attn_ctx *a = (attn_ctx *)p;
    const kv_item *it = &a->items[task];
    size_t R = (size_t)a->rows_max, D = (size_t)a->c->head_dim, k = it->part < 0 ? 0 : (size_t)it->part;
    if (a->amx && it->npos * (a->c->n_heads / a->c->n_kv_heads) >= KV_AMX_MIN_ROWS) {
        kv_amx_attn_item(a->c, it, &a->ws[worker], a->part_m + k * R, a->part_l + k * R, a->part_o + k * R * D);
        return;
    }
    a->isa->attn_item(a->c, it, &a->ws[worker], a->part_m + k * R, a->part_l + k * R, a->part_o + k * R * D);
}

static void merge_task(void *p, int64_t task, int worker) {
    (void)worker;
    attn_ctx *a = (attn_ctx *)p;
    const kv_call *c = a->c;
    const kv_group *g = &a->groups[task];
    const int G = c->n_heads / c->n_kv_heads, D = c->head_dim, R = g->npos * G;
    const size_t RM = (size_t)a->rows_max;
    for (int r = 0; r < R * g->nheads; r++) {
        float M = -INFINITY;
        for (int k = 0; k < g->n_parts; k++) {
            float m = a->part_m[(g->first_part + k) * RM + r];
            M = m > M ? m : M;
        }
        float L = 0.0f;
        const int head = (g->head0 + r / R) * G + r % G;
        const int64_t qrow = c->q_start[g->seq] + g->pos0 + (r % R) / G;
        float *dst = c->out + (qrow * c->n_heads + head) * D;
        memset(dst, 0, (size_t)D * sizeof(float));
        for (int k = 0; k < g->n_parts; k++) {
            size_t pk = (size_t)(g->first_part + k);
            float m = a->part_m[pk * RM + r];
            if (m == -INFINITY) continue; /* this slice saw nothing of this row */
            float w = exp2f(m - M);
            L += w * a->part_l[pk * RM + r];
            const float *o = a->part_o + (pk * RM + r) * D;
            for (int j = 0; j < D; j++) dst[j] += w * o[j];
        }
        float inv = kv_row_done(c, qrow, head, M, L);
        for (int j = 0; j < D; j++) dst[j] *= inv;
    }
}

static void *aligned(size_t n) {
    void *p = NULL;
    if (posix_memalign(&p, 64, n ? n : 64)) return NULL;
    return p;
}

/* Software prefetch of the next rows (the decode fast path's) pays only when the call's K/V comes from DRAM: with it all in
 * the last-level cache it cost 6-25% (Zen 5, 2 threads: q4_0 8k, 9.4 MB, 487 vs 552 us without; q4_0
 * 12k, 14 MB, 843 vs 945 us with). The crossover sat near a third of the 32 MiB L3. */
static int prefetch_pays(int64_t kv_bytes) {
    /* the L3 this core shares, read once (sysfs; glibc's sysconf sums every CCX of the socket on AMD) */
    static _Atomic int64_t llc;
    int64_t n = atomic_load_explicit(&llc, memory_order_relaxed);
    if (!n) {
        long kib = 0;
        FILE *f = fopen("/sys/devices/system/cpu/cpu0/cache/index3/size", "r");
        if (f) {
            if (fscanf(f, "%ldK", &kib) != 1) kib = 0;
            fclose(f);
        }
        n = kib > 0 ? (int64_t)kib << 10 : (int64_t)32 << 20;
        atomic_store_explicit(&llc, n, memory_order_relaxed);
    }
    return kv_bytes > n / 3;
}

/* The KV slice length of a query chunk whose items hold `rows` query rows: kv_split, doubled while the
 * rows exceed KV_DECODE_ROWS per doubling (kv_split x the power of two >= rows / KV_DECODE_ROWS). A
 * slice costs its partials (rows x head_dim floats written, merged, and fresh pages for them each call)
 * and its query preparation, both per row; with slices of a fixed token length a prefill chunk of 512
 * rows (64 per KV head then) paid them every 1024 tokens (a 16k prefill of 512 queries allocated 134 MB of partials). Decode
 * (one position: G x heads rows) keeps kv_split. Shapes only, so results still do not change with
 * threads, and every slice length is a multiple of kv_split. */
static int chunk_split(int split, int64_t rows) {
    if (split <= 0) return 0;
    int64_t s = split;
    while (s * KV_DECODE_ROWS < rows * (int64_t)split && s * 2 <= (1 << 30)) s *= 2;
    return (int)s;
}

/* Per-head eviction: whether some KV head of sequence s has a hole (a->holes) inside KV positions [lo, hi]. */
static int chunk_holed(const kv_args *a, int s, int lo, int hi) {
    if (!a->holes) return 0;
    for (int h = 0; h < a->n_kv_heads; h++) {
        const int32_t *x = a->holes + ((int64_t)s * a->n_kv_heads + h) * 2;
        if (x[0] < x[1] && x[0] <= hi && x[1] > lo) return 1;
    }
    return 0;
}

/* [lo, hi] minus KV head h's hole: at most two ranges into seg; returns how many */
static int hole_cut(const kv_args *a, int s, int h, int lo, int hi, int seg[4]) {
    const int32_t *x = a->holes + ((int64_t)s * a->n_kv_heads + h) * 2;
    int n = 0;
    if (x[0] >= x[1] || x[0] > hi || x[1] <= lo) {
        seg[0] = lo, seg[1] = hi;
        return 1;
    }
    if (x[0] - 1 >= lo) seg[2 * n] = lo, seg[2 * n + 1] = x[0] - 1, n++;
    if (x[1] <= hi) seg[2 * n] = x[1], seg[2 * n + 1] = hi, n++;
    return n;
}

/* the pieces a KV range [x, y] splits into with slices of sp tokens (0: no split) */
static int range_pieces(int x, int y, int sp) { return y < x ? 0 : sp > 0 && y - x + 1 > sp ? y / sp - x / sp + 1 : 1; }

KV_EXPORT int kvc_attention(const kv_args *a) {
    const kv_isa *isa = get_isa(a->isa);
    if (!isa) return KV_EUNSUPPORTED;
    const int n_seqs = a->n_seqs, n_kv_heads = a->n_kv_heads, D = a->head_dim, split = a->kv_split, tile = a->tile;
    const int32_t *seq_lens = a->seq_lens, *q_lens = a->q_lens;
    if (n_seqs <= 0 || n_kv_heads <= 0 || a->n_heads % n_kv_heads || (tile && tile != 64 && tile != 128)) return KV_EARG;
    const int threads = a->threads < 1 ? 1 : a->threads;
    const int G = a->n_heads / n_kv_heads;
    int64_t *q_start = (int64_t *)malloc(sizeof(int64_t) * (size_t)n_seqs);
    if (!q_start) return KV_ENOMEM;
    /* kivi4's V rows are ggml's q4_1 bytes (kivi.py): they take q4_1's kernels (the integer P.V on AVX-512) */
    const int vfmt = a->vfmt == KV_KIVI4 ? KV_Q4_1 : a->vfmt;
    kv_call c = {n_seqs, a->n_heads, n_kv_heads, D, a->block_size, a->max_blocks, a->kfmt, vfmt, a->causal,
                 a->window, a->krow, a->vrow, a->scale * 1.4426950408889634f, a->q, a->out, a->lse, a->kpool, a->vpool,
                 a->block_table, seq_lens, q_lens, q_start, 0, a->kpaged};
    int64_t acc = 0;
    for (int s = 0; s < n_seqs; s++) {
        q_start[s] = acc;
        acc += q_lens[s];
    }
    /* positions per item: enough GQA rows to share each K/V byte read, and all of one decode step */
    const int amx = a->isa == KV_ISA_AMX && kv_amx_takes(&c);
    const int rows_target = amx ? KV_AMX_ROWS_TARGET : KV_ROWS_TARGET;
    int npc = rows_target / G > 0 ? rows_target / G : 1;
    int n_hg = (n_kv_heads + KV_HEAD_GROUP - 1) / KV_HEAD_GROUP, hg = (n_kv_heads + n_hg - 1) / n_hg;
    if (amx) { /* AMX's longer chunks: fewer head groups per item where the chunks alone leave threads idle */
        int64_t chunks = 0;
        for (int s = 0; s < n_seqs; s++) chunks += (q_lens[s] + npc - 1) / npc;
        while (chunks * n_hg < 2 * (int64_t)threads && n_hg < n_kv_heads) {
            n_hg++;
            hg = (n_kv_heads + n_hg - 1) / n_hg;
        }
        n_hg = (n_kv_heads + hg - 1) / hg;
    }
    int rows_max = 0, head_rows_max = 0;
    int64_t n_items = 0, n_parts = 0, n_groups = 0, kv_bytes = 0;
    for (int s = 0; s < n_seqs; s++) {
        int n_kv = seq_lens[s], n_q = q_lens[s];
        for (int p0 = 0; p0 < n_q; p0 += npc) {
            int np = n_q - p0 < npc ? n_q - p0 : npc;
            int lo, hi, lo2, hi2;
            kv_visible(&c, n_kv, n_kv - n_q + p0, &lo, &hi);
            kv_visible(&c, n_kv, n_kv - n_q + p0 + np - 1, &lo2, &hi2);
            hi = hi2;
            if (np * G * hg > rows_max) rows_max = np * G * hg;
            if (np * G > head_rows_max) head_rows_max = np * G;
            if (hi >= lo) kv_bytes += (int64_t)(hi - lo + 1) * n_kv_heads * (c.krow + c.vrow); /* what the items read */
            const int sp = chunk_split(split, (int64_t)np * G * hg);
            if (chunk_holed(a, s, lo, hi)) { /* one KV head per item, its range cut around its hole */
                for (int h = 0; h < n_kv_heads; h++) {
                    int seg[4], ns = hole_cut(a, s, h, lo, hi, seg), pieces = 0;
                    for (int k = 0; k < ns; k++) pieces += range_pieces(seg[2 * k], seg[2 * k + 1], sp);
                    n_items += pieces;
                    if (pieces > 1) n_parts += pieces, n_groups++;
                }
                continue;
            }
            int pieces = 1;
            if (sp > 0 && hi - lo + 1 > sp) pieces = hi / sp - lo / sp + 1;
            n_items += (int64_t)pieces * n_hg;
            if (pieces > 1) {
                n_parts += (int64_t)pieces * n_hg;
                n_groups += n_hg;
            }
        }
    }
    c.prefetch = prefetch_pays(kv_bytes);
#if defined(__x86_64__) || defined(_M_X64)
    /* AVX-512 tiles (tile 0: by format and where K/V sits): 128 tokens for quantized K and V from the
     * LLC, else 64 (kern_avx512_t128.c says why); and 128 for calls with prefill items (more than
     * KV_DECODE_ROWS rows) wherever K/V sits: they compute long enough on each K/V byte for the next
     * rows to arrive (AMD EPYC, 2 cores, q8_0 512 queries over 16k, interleaved: 1.07-1.15x on 1 thread,
     * q4_0 1.13x on 2) */
    const int prefill = rows_max > KV_DECODE_ROWS;
    if (isa == &kv_isa_avx512 && (tile == 128 || (tile == 0 && (!c.prefetch || prefill) && kv_is_quant(a->kfmt) &&
                                                  kv_is_quant(a->vfmt))))
        isa = &kv_isa_avx512_t128;
#endif
    kv_item *items = (kv_item *)malloc(sizeof(kv_item) * (size_t)n_items);
    kv_group *groups = (kv_group *)malloc(sizeof(kv_group) * (size_t)(n_groups + 1));
    float *pm = (float *)aligned(sizeof(float) * (size_t)(n_parts * rows_max + 1));
    float *pl = (float *)aligned(sizeof(float) * (size_t)(n_parts * rows_max + 1));
    float *po = (float *)aligned(sizeof(float) * (size_t)(n_parts * rows_max * D + 1));
    kv_scratch *ws = (kv_scratch *)calloc((size_t)threads, sizeof(kv_scratch));
    int ok = items && groups && pm && pl && po && ws;
    size_t R = (size_t)rows_max, extra = isa->extra_bytes(&c, rows_max);
    if (amx && kv_amx_extra_bytes(&c, head_rows_max) > extra) extra = kv_amx_extra_bytes(&c, head_rows_max);
    for (int w = 0; ok && w < threads; w++) {
        ws[w].qf = (float *)aligned(sizeof(float) * R * (size_t)D);
        ws[w].o = (float *)aligned(sizeof(float) * R * (size_t)D);
        ws[w].m = (float *)aligned(sizeof(float) * R);
        ws[w].l = (float *)aligned(sizeof(float) * R);
        ws[w].s = (float *)aligned(sizeof(float) * R * KV_T_MAX);
        ws[w].extra = aligned(extra);
        ws[w].extra_bytes = extra;
        ok = ws[w].qf && ws[w].o && ws[w].m && ws[w].l && ws[w].s && ws[w].extra;
    }
    int rc = KV_ENOMEM;
    if (ok) {
        int64_t ni = 0, npart = 0, ng = 0;
        for (int s = 0; s < n_seqs; s++) {
            int n_kv = seq_lens[s], n_q = q_lens[s];
            for (int p0 = 0; p0 < n_q; p0 += npc) {
                int np = n_q - p0 < npc ? n_q - p0 : npc;
                int lo, hi, lo2, hi2;
                kv_visible(&c, n_kv, n_kv - n_q + p0, &lo, &hi);
                kv_visible(&c, n_kv, n_kv - n_q + p0 + np - 1, &lo2, &hi2);
                hi = hi2;
                const int sp = chunk_split(split, (int64_t)np * G * hg);
                if (chunk_holed(a, s, lo, hi)) {
                    for (int h = 0; h < n_kv_heads; h++) {
                        int seg[4], ns = hole_cut(a, s, h, lo, hi, seg), pieces = 0;
                        for (int k = 0; k < ns; k++) pieces += range_pieces(seg[2 * k], seg[2 * k + 1], sp);
                        if (pieces == 0) { /* this head sees no key from these rows: 0, lse -inf */
                            for (int r = 0; r < np * G; r++) {
                                const int64_t qrow = q_start[s] + p0 + r / G;
                                memset(c.out + (qrow * a->n_heads + h * G + r % G) * D, 0, sizeof(float) * (size_t)D);
                                if (c.lse) c.lse[qrow * a->n_heads + h * G + r % G] = -INFINITY;
                            }
                            continue;
                        }
                        if (pieces > 1) groups[ng++] = (kv_group){(int)npart, pieces, s, h, 1, p0, np};
                        for (int k = 0; k < ns; k++) {
                            const int x = seg[2 * k], y = seg[2 * k + 1], nk = range_pieces(x, y, sp);
                            for (int j = 0; j < nk; j++) {
                                int lo1 = x, hi1 = y;
                                if (nk > 1) {
                                    lo1 = (x / sp + j) * sp, hi1 = lo1 + sp - 1;
                                    lo1 = lo1 > x ? lo1 : x, hi1 = hi1 < y ? hi1 : y;
                                }
                                items[ni++] = (kv_item){s, h, 1, p0, np, lo1, hi1, pieces > 1 ? (int)npart++ : -1};
                            }
                        }
                    }
                    continue;
                }
                int pieces = 1;
                if (sp > 0 && hi - lo + 1 > sp) pieces = hi / sp - lo / sp + 1;
                for (int h0 = 0; h0 < n_kv_heads; h0 += hg) {
                    int nh = n_kv_heads - h0 < hg ? n_kv_heads - h0 : hg;
                    if (pieces == 1) {
                        items[ni++] = (kv_item){s, h0, nh, p0, np, lo, hi, -1};
                        continue;
                    }
                    groups[ng++] = (kv_group){(int)npart, pieces, s, h0, nh, p0, np};
                    for (int k = 0; k < pieces; k++) {
                        int a = (lo / sp + k) * sp, b = a + sp - 1;
                        items[ni++] = (kv_item){s, h0, nh, p0, np, a > lo ? a : lo, b < hi ? b : hi, (int)npart++};
                    }
                }
            }
        }
        attn_ctx ctx = {&c, isa, items, groups, ws, pm, pl, po, rows_max, amx};
        kv_pool_run(attn_task, &ctx, ni, threads);
        kv_pool_run(merge_task, &ctx, ng, threads);
        rc = KV_OK;
    }
    for (int w = 0; ws && w < threads; w++) {
        free(ws[w].qf);
        free(ws[w].o);
        free(ws[w].m);
        free(ws[w].l);
        free(ws[w].s);
        free(ws[w].extra);
    }
    free(ws);
    free(items);
    free(groups);
    free(pm);
    free(pl);
    free(po);
    free(q_start);
    return rc;
}

typedef struct {
    const kv_call *c;
    const kv_isa *isa;
    const kv_mass_item *items;
    float *scratch; /* per worker: KV_MASS_SCRATCH(D) floats */
    size_t stride;
} mass_ctx;

static void mass_task(void *p, int64_t task, int worker) {
    const mass_ctx *m = (const mass_ctx *)p;
    m->isa->mass_item(m->c, m->items + task, m->scratch + (size_t)worker * m->stride);
}

/* The attention mass of a call whose rows' log-sum-exp a->lse holds (kvc_attention's, with the same q, pages
 * and mask; K of a row format or per-channel pages): per sequence s, per KV head h, the weight each key received
 * summed over the KV head's query heads, from all of s's queries into total and from its last `tail` queries
 * into window, both [n_kv_heads][seq_lens[s]] doubles at offset n_kv_heads * (seq_lens[0] + ... +
 * seq_lens[s - 1]). Work items are (sequence, KV head, KV_MASS_T keys): each writes its own keys' sums, so
 * results do not change with threads. kltq K: kvc_kltq_attention_mass (kltq.c), through the same driver. */
KV_EXPORT int kvc_attention_mass(const kv_args *a, int32_t tail, double *total, double *window) {
    const kv_isa *isa = get_isa(a->isa);
    if (!isa) return KV_EUNSUPPORTED;
    if (!a->lse) return KV_EARG;
    kv_call c = {a->n_seqs, a->n_heads, a->n_kv_heads, a->head_dim, a->block_size, a->max_blocks, a->kfmt,
                 a->vfmt, a->causal, a->window, a->krow, a->vrow, a->scale * 1.4426950408889634f, a->q, NULL,
                 a->lse, a->kpool, a->vpool, a->block_table, a->seq_lens, a->q_lens, NULL, 0, a->kpaged, NULL, NULL};
    return kv_attention_mass_run(c, isa, a->holes, a->threads, tail, total, window);
}

int kv_attention_mass_run(kv_call c, const kv_isa *isa, const int32_t *holes, int threads, int32_t tail,
                          double *total, double *window) {
    const int n_seqs = c.n_seqs, H = c.n_kv_heads, D = c.head_dim;
    if (n_seqs <= 0 || H <= 0 || c.n_heads % H || !c.lse || tail < 0) return KV_EARG;
    threads = threads < 1 ? 1 : threads;
    int64_t *q_start = (int64_t *)malloc(sizeof(int64_t) * (size_t)n_seqs);
    if (!q_start) return KV_ENOMEM;
    c.q_start = q_start;
    int64_t acc = 0, n_items = 0;
    for (int s = 0; s < n_seqs; s++) {
        q_start[s] = acc;
        acc += c.q_lens[s];
        n_items += (int64_t)H * ((c.seq_lens[s] + KV_MASS_T - 1) / KV_MASS_T);
    }
    kv_mass_item *items = (kv_mass_item *)malloc(sizeof(kv_mass_item) * (size_t)(n_items + 1));
    const size_t stride = (KV_MASS_SCRATCH(D) + 15) & ~(size_t)15;
    float *scratch = (float *)aligned(sizeof(float) * stride * (size_t)threads);
    int rc = KV_ENOMEM;
    if (items && scratch) {
        int64_t ni = 0, off = 0;
        for (int s = 0; s < n_seqs; s++) {
            const int n_kv = c.seq_lens[s], n_q = c.q_lens[s], split = n_q - tail > 0 ? n_q - tail : 0;
            for (int h = 0; h < H; h++) {
                const int32_t *x = holes ? holes + ((int64_t)s * H + h) * 2 : NULL;
                const int h0 = x ? x[0] : 0, h1 = x ? x[1] : 0;
                double *tot = total + off + (int64_t)h * n_kv, *win = window + off + (int64_t)h * n_kv;
                for (int j0 = 0; j0 < n_kv; j0 += KV_MASS_T) {
                    const int nt = n_kv - j0 < KV_MASS_T ? n_kv - j0 : KV_MASS_T;
                    if (h0 <= j0 && h1 >= j0 + nt) { /* the whole tile is in this head's hole: it received nothing */
                        memset(tot + j0, 0, sizeof(double) * (size_t)nt);
                        memset(win + j0, 0, sizeof(double) * (size_t)nt);
                        continue;
                    }
                    items[ni++] = (kv_mass_item){s, h, j0, nt, split, h0, h1, tot + j0, win + j0};
                }
            }
            off += (int64_t)H * n_kv;
        }
        mass_ctx m = {&c, isa, items, scratch, stride};
        kv_pool_run(mass_task, &m, ni, threads);
        rc = KV_OK;
    }
    free(items);
    free(scratch);
    free(q_start);
    return rc;
}

/* Which kernels run a call of this layer (a's isa, formats, head_dim, kpaged, n_kv_heads, n_heads) whose
 * sequences have q_len queries: "amx-bf16" (kern_amx.c), "avx512-vnni" (integer kernels for a ggml
 * K or V format), "avx512-fma" (f32 FMA), "avx2-gemm" (f32 FMA, register-blocked tiles), "avx2", "neon",
 * "scalar". For `kvhal bench` and users on
 * another CPU; it follows kvc_attention's own choices. */
KV_EXPORT const char *kvc_attention_path(const kv_args *a, int32_t q_len) {
    if (!kvc_isa_supported(a->isa)) return "unsupported";
    const int G = a->n_kv_heads > 0 && a->n_heads >= a->n_kv_heads ? a->n_heads / a->n_kv_heads : 1;
    const int target = a->isa == KV_ISA_AMX ? KV_AMX_ROWS_TARGET : KV_ROWS_TARGET;
    const int npc = target / G > 0 ? target / G : 1, np = q_len < npc ? q_len : npc;
    switch (a->isa) {
    case KV_ISA_AMX: {
        kv_call c;
        memset(&c, 0, sizeof c);
        c.head_dim = a->head_dim, c.kfmt = a->kfmt, c.vfmt = a->vfmt, c.kpaged = a->kpaged;
        if (kv_amx_takes(&c) && np * G >= KV_AMX_MIN_ROWS) return "amx-bf16";
    } /* fall through */
    case KV_ISA_AVX512:
        return kv_is_quant(a->kfmt) || kv_is_quant(a->vfmt) || a->vfmt == KV_KIVI4 ? "avx512-vnni" : "avx512-fma";
    case KV_ISA_AVX2:
        return np * G >= KV_GEMM_MIN_ROWS && a->head_dim % 16 == 0 ? "avx2-gemm" : "avx2";
    case KV_ISA_NEON:
        return "neon";
    default:
        return "scalar";
    }
}
