/* Cross-ISA check of the kernel library, for ISAs the test machine can only emulate (NEON under
 * qemu-aarch64): every level this binary's CPU reports must give the scalar baseline's stored bytes,
 * loads, (within 1e-5) attention and (within 1e-5 relative) the attention mass from the same LSEs. Build: cc -O2 -pthread isa_check.c ../../kvhal_cpu/csrc/\*.c -lm */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../kvhal_cpu/csrc/kvcpu.h"

int kvc_isa_supported(int isa);
int kvc_store(const kv_args *a);
int kvc_load_to(const kv_args *a, int64_t skip, int32_t dtype);
int kvc_attention(const kv_args *a);
int kvc_attention_mass(const kv_args *a, int32_t tail, double *total, double *window);
int kvc_format_table(int32_t *out, int cap);

static int64_t row_bytes(int fmt, int d) { return (int64_t)d / kv_block_len[fmt] * kv_block_bytes[fmt]; }
static float randn(void) {
    float u = (float)((rand() + 1.0) / (RAND_MAX + 2.0)), v = (float)((rand() + 1.0) / (RAND_MAX + 2.0));
    return sqrtf(-2.0f * logf(u)) * cosf(6.2831853f * v);
}

int main(void) {
    enum { H = 2, D = 64, BS = 16, N = 96, NB = N / BS, HQ = 8, NQ = 17 }; /* queries: 16 + 1 */
    static float k[N * H * D], v[N * H * D], q[NQ * HQ * D], o0[NQ * HQ * D], o1[NQ * HQ * D], l0[N * H * D], l1[N * H * D],
        v0[N * H * D], v1[N * H * D];
    int64_t slots[N], blocks[NB];
    int32_t table[2 * NB] = {0}, lens[2] = {70, 26}, qlens[2] = {16, 1}; /* 64 rows per KV head: the prefill kernels */
    for (int i = 0; i < N; i++) slots[i] = i;
    for (int i = 0; i < NB; i++) blocks[i] = i;
    for (int i = 0; i < 5; i++) table[i] = i;
    table[NB] = 5;
    table[NB + 1] = 4; /* second sequence: pages 5, 4 */
    srand(3);
    for (int i = 0; i < N * H * D; i++) {
        k[i] = randn() * ((i % D) == 3 ? 8.0f : 1.0f);
        v[i] = randn();
    }
    for (int i = 0; i < 32; i++) {
        k[i] = 0.0f;                      /* zero block */
        k[32 + i] = 1e-41f * (float)i;    /* subnormal scale */
        k[64 + i] = (float)(i - 8);       /* q4_0 ties */
        k[96 + i] = roundf(-127.0f + 8.2f * i) + 0.5f;
    }
    for (int i = 0; i < NQ * HQ * D; i++) q[i] = randn();
    int fails = 0, checked = 0;
    for (int isa = 1; isa < KV_NISA; isa++) {
        if (!kvc_isa_supported(isa)) continue;
        int32_t table[3 * KV_NFMT];
        const int n_fmt = kvc_format_table(table, 3 * KV_NFMT); /* the formats the kernels implement */
        for (int t = 0; t < n_fmt; t++)
        for (int paged = 0; paged <= (table[3 * t] == KV_KIVI4 || table[3 * t] == KV_KIVI2); paged++) {
            /* kivi formats twice: K as rows, then K per channel over whole pages (kivi_k.c) */
            const int fmt = table[3 * t];
            const int64_t krow = paged ? kv_kpage_code_bytes(fmt, D) + 4 * D / BS : row_bytes(fmt, D);
            size_t n = (size_t)NB * H * BS * (size_t)(krow > row_bytes(fmt, D) ? krow : row_bytes(fmt, D));
            uint8_t *p[4];
            for (int j = 0; j < 4; j++) p[j] = calloc(n, 1);
            /* one layer of one cache, then each call's own fields */
            const kv_args layer = {.threads = 1, .kfmt = fmt, .vfmt = fmt, .n_kv_heads = H, .head_dim = D, .block_size = BS,
                                   .kpaged = paged, .krow = krow, .vrow = row_bytes(fmt, D), .kpool = p[0], .vpool = p[1]};
            kv_args a = layer, b = layer;
            b.isa = isa, b.threads = 2, b.kpool = p[2], b.vpool = p[3];
            a.k = b.k = k, a.v = b.v = v, a.slots = b.slots = slots, a.n = b.n = N;
            kvc_store(&a);
            kvc_store(&b);
            if (memcmp(p[0], p[2], n) || memcmp(p[1], p[3], n)) {
                printf("isa %d fmt %d%s: stored bytes differ\n", isa, fmt, paged ? " (K pages)" : "");
                fails++;
            }
            a = layer, b = layer;
            b.isa = isa, b.threads = 2;
            a.blocks = b.blocks = blocks, a.n = b.n = N, a.kout = l0, a.vout = v0, b.kout = l1, b.vout = v1;
            for (int dtype = 0; dtype < 3; dtype++) /* f32, f16, bf16 outputs, from a row inside the first page */
                for (int skip = 0; skip < 4; skip += 3) {
                    kvc_load_to(&a, skip, dtype);
                    kvc_load_to(&b, skip, dtype);
                    if (memcmp(l0, l1, sizeof l0) || memcmp(v0, v1, sizeof v0)) {
                        printf("isa %d fmt %d%s: loads differ (dtype %d, skip %d)\n", isa, fmt, paged ? " (K pages)" : "",
                               dtype, skip);
                        fails++;
                    }
                }
            /* attention on unit-scale K (the edge-case blocks above are for the quantizers only) */
            a = layer;
            a.k = k + 4 * 32, a.v = v, a.slots = slots, a.n = paged ? N - BS : N - 1; /* paged: whole pages */
            kvc_store(&a);
            a = layer;
            a.q = q, a.block_table = table, a.seq_lens = lens, a.q_lens = qlens, a.n_seqs = 2, a.max_blocks = NB;
            a.n_heads = HQ, a.scale = 0.125f;
            /* tiles 64 and 128: the two AVX-512 builds (other ISAs have one tile size) */
            for (int causal = 0; causal < 2; causal++) {
                a.causal = causal, a.window = causal ? 0 : 20, a.out = o0;
                kvc_attention(&a);
                for (int tile = 64; tile <= 128; tile += 64) {
                    b = a;
                    b.isa = isa, b.threads = 2, b.kv_split = 32, b.tile = tile, b.out = o1;
                    kvc_attention(&b);
                    float err = 0.0f;
                    for (int i = 0; i < NQ * HQ * D; i++) err = fmaxf(err, fabsf(o0[i] - o1[i]));
                    /* avx512 (and amx, whose decode-sized items are avx512's): integer kernels (kivi4 V rows are
                     * q4_1 bytes and take its kernels) */
                    const int int_isa = isa == KV_ISA_AVX512 || isa == KV_ISA_AMX;
                    if (!(err <= (int_isa && (kv_is_quant(fmt) || fmt == KV_KIVI4) ? 5e-4f : 1e-5f))) {
                        printf("isa %d fmt %d%s causal %d tile %d: attention differs by %g\n", isa, fmt,
                               paged ? " (K pages)" : "", causal, tile, err);
                        fails++;
                    }
                }
                { /* the attention mass from the scalar call's LSEs, on this ISA (K rows or K pages) */
                    static double lse[NQ * HQ], m0[2][H * N], m1[2][H * N];
                    a.lse = lse;
                    kvc_attention(&a);
                    b = a;
                    b.isa = isa, b.threads = 2;
                    kvc_attention_mass(&a, 2, m0[0], m0[1]);
                    kvc_attention_mass(&b, 2, m1[0], m1[1]);
                    double err = 0.0;
                    for (int i = 0; i < 2 * H * (lens[0] + lens[1]); i++) {
                        const double x = m0[i / (H * N)][i % (H * N)], y = m1[i / (H * N)][i % (H * N)];
                        err = fmax(err, fabs(x - y) / (1.0 + fabs(x)));
                    }
                    if (!(err <= 1e-5)) {
                        printf("isa %d fmt %d%s causal %d: attention mass differs by %g\n", isa, fmt,
                               paged ? " (K pages)" : "", causal, err);
                        fails++;
                    }
                    a.lse = NULL;
                }
            }
            for (int j = 0; j < 4; j++) free(p[j]);
            checked++;
        }
    }
    printf("%d format x isa combinations checked, %d failures\n", checked, fails);
    return fails != 0;
}
