/* Cross-ISA check of the kernel library, for ISAs the test machine can only emulate (NEON under
 * qemu-aarch64): every level this binary's CPU reports must give the scalar baseline's stored bytes,
 * loads and (within 1e-5) attention. Build: cc -O2 -pthread isa_check.c ../../kvhal_cpu/csrc/(api,pool,kern_*).c -lm */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int kvc_isa_supported(int isa);
int kvc_store(int isa, int threads, int kfmt, int vfmt, const float *k, const float *v, int64_t n, int H, int D,
              uint8_t *kpool, uint8_t *vpool, const int64_t *slots, int bs);
int kvc_load(int isa, int threads, int fmt, const uint8_t *pool, const int64_t *blocks, int64_t n, int H, int D, int bs,
             float *out);
int kvc_attention(int isa, int threads, int split, int kfmt, int vfmt, const float *q, float *out, const uint8_t *kpool,
                  const uint8_t *vpool, const int32_t *block_table, const int32_t *seq_lens, const int32_t *q_lens,
                  int n_seqs, int max_blocks, int n_heads, int n_kv_heads, int D, int bs, float scale, int causal,
                  int window, int tile);

static const int BB[8] = {4, 2, 2, 34, 18, 20, 22, 24};
static int64_t row_bytes(int fmt, int d) { return fmt >= 3 ? d / 32 * BB[fmt] : (int64_t)d * BB[fmt]; }
static float randn(void) {
    float u = (float)((rand() + 1.0) / (RAND_MAX + 2.0)), v = (float)((rand() + 1.0) / (RAND_MAX + 2.0));
    return sqrtf(-2.0f * logf(u)) * cosf(6.2831853f * v);
}

int main(void) {
    enum { H = 2, D = 64, BS = 16, N = 96, NB = N / BS, HQ = 8 };
    static float k[N * H * D], v[N * H * D], q[3 * HQ * D], o0[3 * HQ * D], o1[3 * HQ * D], l0[N * H * D], l1[N * H * D];
    int64_t slots[N], blocks[NB];
    int32_t table[2 * NB] = {0}, lens[2] = {70, 26}, qlens[2] = {2, 1};
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
    for (int i = 0; i < 3 * HQ * D; i++) q[i] = randn();
    int fails = 0, checked = 0;
    for (int isa = 1; isa < 4; isa++) {
        if (!kvc_isa_supported(isa)) continue;
        for (int fmt = 0; fmt < 8; fmt++) {
            size_t n = (size_t)NB * H * BS * row_bytes(fmt, D);
            uint8_t *p[4];
            for (int j = 0; j < 4; j++) p[j] = calloc(n, 1);
            kvc_store(0, 1, fmt, fmt, k, v, N, H, D, p[0], p[1], slots, BS);
            kvc_store(isa, 2, fmt, fmt, k, v, N, H, D, p[2], p[3], slots, BS);
            if (memcmp(p[0], p[2], n) || memcmp(p[1], p[3], n)) {
                printf("isa %d fmt %d: stored bytes differ\n", isa, fmt);
                fails++;
            }
            kvc_load(0, 1, fmt, p[0], blocks, N, H, D, BS, l0);
            kvc_load(isa, 2, fmt, p[0], blocks, N, H, D, BS, l1);
            if (memcmp(l0, l1, sizeof l0)) {
                printf("isa %d fmt %d: loads differ\n", isa, fmt);
                fails++;
            }
            /* attention on unit-scale K (the edge-case blocks above are for the quantizers only) */
            kvc_store(0, 1, fmt, fmt, k + 4 * 32, v, N - 1, H, D, p[0], p[1], slots, BS);
            /* tiles 64 and 128: the two AVX-512 builds (other ISAs have one tile size) */
            for (int causal = 0; causal < 2; causal++) {
                kvc_attention(0, 1, 0, fmt, fmt, q, o0, p[0], p[1], table, lens, qlens, 2, NB, HQ, H, D, BS, 0.125f,
                              causal, causal ? 0 : 20, 0);
                for (int tile = 64; tile <= 128; tile += 64) {
                    kvc_attention(isa, 2, 32, fmt, fmt, q, o1, p[0], p[1], table, lens, qlens, 2, NB, HQ, H, D, BS,
                                  0.125f, causal, causal ? 0 : 20, tile);
                    float err = 0.0f;
                    for (int i = 0; i < 3 * HQ * D; i++) err = fmaxf(err, fabsf(o0[i] - o1[i]));
                    if (!(err <= (isa == 2 && fmt >= 3 ? 3e-4f : 1e-5f))) { /* avx512: integer kernels */
                        printf("isa %d fmt %d causal %d tile %d: attention differs by %g\n", isa, fmt, causal, tile, err);
                        fails++;
                    }
                }
            }
            for (int j = 0; j < 4; j++) free(p[j]);
            checked++;
        }
    }
    printf("%d format x isa combinations checked, %d failures\n", checked, fails);
    return fails != 0;
}
