/* The AVX-512 kernels built a second time with 128-token tiles. api.c takes them when K and V are both
 * quantized (the integer kernels) and the call's K/V fits in the last-level cache (no software
 * prefetch): the per-tile work (softmax reductions, weight scales, output accumulation, row pointers)
 * halves again, 4-6% faster decode there (Zen 5, q4_0 and q8_0, 4k-8k context). From DRAM, with the
 * rows of the next head prefetched, the 64-token build is 3-20% faster (minimum of runs): a 128-token
 * head-tile and its prefetched successor crowd the 48 KiB L1. The int16 weights then share one scale
 * over 128 tokens: worst error 8.1e-5 on the contract-like cases (6.8e-5 with 64), 3.8e-4 over the
 * full contract sweep (tolerance 5e-4: the weights' rounding grows as sqrt(tokens per scale)).
 * The f32 path (float formats) dequantizes each tile into L1 and is 1.4-1.5x slower with 128 (f16,
 * 2k-4k), so it keeps 64. */
#define KV_T 128
#define FN(x) x##_avx512_t128
#include "kern_avx512.c"
