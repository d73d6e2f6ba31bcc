// kvhal kernels for CUDA and HIP: store (quantize + scatter), load (gather + dequantize), paged attention
// (split-KV decode, tiled prefill, log-sum-exp merge) and copy_slots, over every kvhal ggml format.
//
// Pools are [n_blocks, n_kv_heads, block_size, row_bytes] bytes, a row being one token of one head in
// ggml's byte layout (kvhal/formats/ggml.py is the spec). Quantization is bit-exact with that spec:
// fp32 inverse of the *unrounded* scale (0 when it is 0 or overflows), C roundf (half away from zero,
// exact just below 0.5) for q8_0, truncation of x*id + 8.5 / +16.5 / +0.5, RNE f32->f16 of the scales,
// ggml's first-occurrence reductions, and no FMA contraction (kv_*_rn, see platform.h).
//
// Every row starts at an even byte offset (all row and block sizes are even), so 16-bit loads and
// stores are aligned. Launch geometry and argument layout come from kvhal_cuda/plan.py; format ids, block
// sizes and the geometry constants (KV_NW, KV_MAXC, KV_RPW_MAX) from the generated kvhal_constants.h.
#include "platform.h"
#include "kvhal_constants.h"

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;

// one 32-lane warp quantizes one block; the bit layouts below are ggml's 32-value blocks
static_assert(KV_Q8_0_BLOCK_LEN == 32 && KV_Q4_0_BLOCK_LEN == 32 && KV_Q4_1_BLOCK_LEN == 32 &&
                  KV_Q5_0_BLOCK_LEN == 32 && KV_Q5_1_BLOCK_LEN == 32,
              "kvhal.cu quantizes 32-value blocks");

__device__ __forceinline__ float kv_neg_inf() { return kv_u32_as_f32(0xff800000u); }
__device__ __forceinline__ u16 ld16(const u8* p) { return *reinterpret_cast<const u16*>(p); }
__device__ __forceinline__ void st16(u8* p, u16 v) { *reinterpret_cast<u16*>(p) = v; }
__device__ __forceinline__ float ldf16(const u8* p) { return kv_f16_to_f32(ld16(p)); }
__device__ __forceinline__ u32 ld32_2(const u8* p) { return (u32)ld16(p) | ((u32)ld16(p + 2) << 16); }
__device__ __forceinline__ void st32_2(u8* p, u32 v) {
  st16(p, (u16)(v & 0xffffu));
  st16(p + 2, (u16)(v >> 16));
}

// byte offset of (slot, head) in a pool
__device__ __forceinline__ i64 row_offset(i64 slot, int h, int H, int bs, int row_bytes) {
  const i64 blk = slot / bs;
  const i64 off = slot - blk * bs;
  return ((blk * H + h) * bs + off) * (i64)row_bytes;
}

// byte offset of token t of a sequence whose pages are table[0..]
__device__ __forceinline__ i64 token_offset(const int* table, int t, int hk, int H, int bs, int row_bytes) {
  const int page = t / bs;
  return (((i64)table[page] * H + hk) * bs + (t - page * bs)) * (i64)row_bytes;
}

// ---- dequantization: value e of a stored row, op for op as kvhal/formats/ggml.py -----------------

__device__ __forceinline__ int nibble(const u8* qs, int j) { return (qs[j & 15] >> ((j >> 4) * 4)) & 15; }

template <int F>
__device__ __forceinline__ float deq(const u8* row, int e) {
  const int j = e & 31;
  if (F == KV_F32) return kv_u32_as_f32(ld32_2(row + KV_F32_BLOCK_BYTES * (i64)e));
  if (F == KV_F16) return kv_f16_to_f32(ld16(row + KV_F16_BLOCK_BYTES * (i64)e));
  if (F == KV_BF16) return kv_u32_as_f32((u32)ld16(row + KV_BF16_BLOCK_BYTES * (i64)e) << 16);
  if (F == KV_Q8_0) {
    const u8* b = row + (e >> 5) * KV_Q8_0_BLOCK_BYTES;
    return kv_fmul_rn(ldf16(b), (float)(signed char)b[2 + j]);
  }
  if (F == KV_Q4_0) {
    const u8* b = row + (e >> 5) * KV_Q4_0_BLOCK_BYTES;
    return kv_fmul_rn(ldf16(b), (float)(nibble(b + 2, j) - 8));
  }
  if (F == KV_Q4_1) {
    const u8* b = row + (e >> 5) * KV_Q4_1_BLOCK_BYTES;
    return kv_fadd_rn(kv_fmul_rn(ldf16(b), (float)nibble(b + 4, j)), ldf16(b + 2));
  }
  if (F == KV_Q5_0) {
    const u8* b = row + (e >> 5) * KV_Q5_0_BLOCK_BYTES;
    const int q = nibble(b + 6, j) | (int)(((ld32_2(b + 2) >> j) & 1u) << 4);
    return kv_fmul_rn(ldf16(b), (float)(q - 16));
  }
  // KV_Q5_1
  const u8* b = row + (e >> 5) * KV_Q5_1_BLOCK_BYTES;
  const int q = nibble(b + 8, j) | (int)(((ld32_2(b + 4) >> j) & 1u) << 4);
  return kv_fadd_rn(kv_fmul_rn(ldf16(b), (float)q), ldf16(b + 2));
}

// runtime format dispatch; the switch is uniform across the grid, so it costs a branch, not divergence
#define KV_DISPATCH(fmt, CALL)   \
  switch (fmt) {                 \
    case KV_F32: CALL(KV_F32);   \
    case KV_F16: CALL(KV_F16);   \
    case KV_BF16: CALL(KV_BF16); \
    case KV_Q8_0: CALL(KV_Q8_0); \
    case KV_Q4_0: CALL(KV_Q4_0); \
    case KV_Q4_1: CALL(KV_Q4_1); \
    case KV_Q5_0: CALL(KV_Q5_0); \
    default: CALL(KV_Q5_1);      \
  }

__device__ __forceinline__ float kv_deq(int fmt, const u8* row, int e) {
#define KV_DEQ(F) return deq<F>(row, e)
  KV_DISPATCH(fmt, KV_DEQ)
#undef KV_DEQ
}

// sum over this lane's elements e = lane + 32c of qv[c] * K[e]
template <int F>
__device__ __forceinline__ float dot_lane(const u8* row, const float (&qv)[KV_MAXC], int lane, int D) {
  float part = 0.0f;
#pragma unroll
  for (int c = 0; c < KV_MAXC; ++c) {
    const int e = lane + 32 * c;
    if (e < D) part += qv[c] * deq<F>(row, e);
  }
  return part;
}
__device__ __forceinline__ float kv_dot_lane(int fmt, const u8* row, const float (&qv)[KV_MAXC], int lane, int D) {
#define KV_DOT(F) return dot_lane<F>(row, qv, lane, D)
  KV_DISPATCH(fmt, KV_DOT)
#undef KV_DOT
}

// acc[c] += p * V[lane + 32c]
template <int F>
__device__ __forceinline__ void axpy_lane(const u8* row, float p, float (&acc)[KV_MAXC], int lane, int D) {
#pragma unroll
  for (int c = 0; c < KV_MAXC; ++c) {
    const int e = lane + 32 * c;
    if (e < D) acc[c] += p * deq<F>(row, e);
  }
}
__device__ __forceinline__ void kv_axpy_lane(int fmt, const u8* row, float p, float (&acc)[KV_MAXC], int lane, int D) {
#define KV_AXPY(F) axpy_lane<F>(row, p, acc, lane, D); return
  KV_DISPATCH(fmt, KV_AXPY)
#undef KV_AXPY
}

// ---- 32-lane reductions (every lane ends with the result) ----------------------------------------

__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, kv_shfl_xor(v, o));
  return v;
}
__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += kv_shfl_xor(v, o);
  return v;
}
__device__ __forceinline__ int warp_or(int v) {
  for (int o = 16; o > 0; o >>= 1) v |= kv_shfl_xor(v, o);
  return v;
}
// ggml's reductions keep the first value that is strictly better, so ties (in particular 0.0 against
// -0.0, which compare equal) go to the lowest index: reduce (value, lane) pairs, lower lane on ties.
// better(a, b): 0 = |a| > |b| (q4_0/q5_0), 1 = a < b (min), 2 = a > b (max)
template <int K>
__device__ __forceinline__ float warp_first(float x, int lane) {
  float v = x;
  int i = lane;
  for (int o = 16; o > 0; o >>= 1) {
    const float v2 = kv_shfl_xor(v, o);
    const int i2 = kv_shfl_xor(i, o);
    const bool better = K == 0 ? fabsf(v2) > fabsf(v) : K == 1 ? v2 < v : v2 > v;
    const bool tie = K == 0 ? fabsf(v2) == fabsf(v) : v2 == v;
    if (better || (tie && i2 < i)) {
      v = v2;
      i = i2;
    }
  }
  return kv_shfl(x, i);
}
// q4_0/q5_0: the signed value of largest magnitude; ggml starts from max = 0.0f, so an all-zero block
// gives +0.0 even when its zeros are negative
__device__ __forceinline__ float warp_signed_absmax(float x, int lane) {
  const float m = warp_first<0>(x, lane);
  return m == 0.0f ? 0.0f : m;
}

// ---- quantization ----------------------------------------------------------------------------------

// ggml's id = d ? 1/d : 0; a subnormal d whose inverse overflows also gets 0 (kvhal's _inverse)
__device__ __forceinline__ float kv_inverse(float d) {
  const float inv = kv_fdiv_rn(1.0f, d);
  return (d == 0.0f || !(fabsf(inv) <= 3.402823466e38f)) ? 0.0f : inv;
}
// C roundf, exactly (the spec's _roundf adds 0.5 in float64): |x| - floor(|x|) is exact in f32, so
// 0.49999997 stays 0 where a float32 |x| + 0.5 would round up to 1
__device__ __forceinline__ float kv_round(float x) {
  const float a = fabsf(x);
  float r = floorf(a);
  if (kv_fsub_rn(a, r) >= 0.5f) r += 1.0f;
  return copysignf(r, x);
}

// nibbles: value j in the low half and value j+16 in the high half of byte j; fifth bits in qh
__device__ __forceinline__ void put_quants(u8* b, int qs_off, int qh_off, int q, int j) {
  const int hi = kv_shfl(q, (j + 16) & 31);
  if (j < 16) b[qs_off + j] = (u8)((q & 15) | ((hi & 15) << 4));
  if (qh_off >= 0) {
    const int qh = warp_or(((q >> 4) & 1) << j);
    if (j == 0) st32_2(b + qh_off, (u32)qh);
  }
}

// One 32-value block, value j in lane j; b is the block's first byte. Every lane must call it.
__device__ __forceinline__ void quant_block(int fmt, float x, int j, u8* b) {
  switch (fmt) {
    case KV_Q8_0: {
      const float d = kv_fdiv_rn(warp_max(fabsf(x)), 127.0f);
      const float q = kv_round(kv_fmul_rn(x, kv_inverse(d)));
      b[2 + j] = (u8)(signed char)(int)q;
      if (j == 0) st16(b, kv_f32_to_f16(d));
      break;
    }
    case KV_Q4_0:
    case KV_Q5_0: {
      const bool five = fmt == KV_Q5_0;
      const float d = kv_fdiv_rn(warp_signed_absmax(x, j), five ? -16.0f : -8.0f);
      const float t = truncf(kv_fadd_rn(kv_fmul_rn(x, kv_inverse(d)), five ? 16.5f : 8.5f));
      const int q = (int)fminf(t, five ? 31.0f : 15.0f);
      put_quants(b, five ? 6 : 2, five ? 2 : -1, q, j);
      if (j == 0) st16(b, kv_f32_to_f16(d));
      break;
    }
    case KV_Q4_1:
    case KV_Q5_1: {
      const bool five = fmt == KV_Q5_1;
      const float lo = warp_first<1>(x, j);
      const float d = kv_fdiv_rn(kv_fsub_rn(warp_first<2>(x, j), lo), five ? 31.0f : 15.0f);
      const float t = truncf(kv_fadd_rn(kv_fmul_rn(kv_fsub_rn(x, lo), kv_inverse(d)), 0.5f));
      const int q = (int)fminf(t, five ? 31.0f : 15.0f);
      put_quants(b, five ? 8 : 4, five ? 4 : -1, q, j);
      if (j == 0) {
        st16(b, kv_f32_to_f16(d));
        st16(b + 2, kv_f32_to_f16(lo));
      }
      break;
    }
  }
}

__device__ __forceinline__ int block_bytes(int fmt) {
  switch (fmt) {
    case KV_Q8_0: return KV_Q8_0_BLOCK_BYTES;
    case KV_Q4_0: return KV_Q4_0_BLOCK_BYTES;
    case KV_Q4_1: return KV_Q4_1_BLOCK_BYTES;
    case KV_Q5_0: return KV_Q5_0_BLOCK_BYTES;
    case KV_Q5_1: return KV_Q5_1_BLOCK_BYTES;
  }
  return 0;
}

// x [n, H, D] f32 into slots[i] of pool, quantized formats: one warp per 32-value block.
extern "C" __global__ void kvhal_store_quant(const float* __restrict__ x, const i64* __restrict__ slots,
                                             u8* __restrict__ pool, int n, int H, int D, int bs, int row_bytes,
                                             int fmt) {
  const i64 gw = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;  // uniform per warp
  const int j = threadIdx.x & 31;
  const int nc = D >> 5;
  if (gw >= (i64)n * H * nc) return;  // whole warps only: blockDim is a multiple of 32
  const int c = (int)(gw % nc);
  const i64 th = gw / nc;
  const int h = (int)(th % H);
  const i64 t = th / H;
  const float v = x[(t * H + h) * D + c * 32 + j];
  quant_block(fmt, v, j, pool + row_offset(slots[t], h, H, bs, row_bytes) + c * block_bytes(fmt));
}

// x [n, H, D] f32 into slots[i] of pool, f32/f16/bf16: one thread per value.
extern "C" __global__ void kvhal_store_float(const float* __restrict__ x, const i64* __restrict__ slots,
                                             u8* __restrict__ pool, int n, int H, int D, int bs, int row_bytes,
                                             int fmt) {
  const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (i64)n * H * D) return;
  const int e = (int)(i % D);
  const i64 th = i / D;
  const int h = (int)(th % H);
  u8* row = pool + row_offset(slots[th / H], h, H, bs, row_bytes);
  const float v = x[i];
  if (fmt == KV_F32) {
    st32_2(row + KV_F32_BLOCK_BYTES * (i64)e, kv_f32_as_u32(v));
  } else if (fmt == KV_F16) {
    st16(row + KV_F16_BLOCK_BYTES * (i64)e, kv_f32_to_f16(v));
  } else {  // bf16: round to nearest even on the upper half (finite inputs, checked by the core)
    const u32 u = kv_f32_as_u32(v);
    st16(row + KV_BF16_BLOCK_BYTES * (i64)e, (u16)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16));
  }
}

// out [n, H, D] f32: the first n tokens of the pages block_ids, dequantized. One thread per value.
extern "C" __global__ void kvhal_load(const u8* __restrict__ pool, const int* __restrict__ block_ids,
                                      float* __restrict__ out, int n, int H, int D, int bs, int row_bytes, int fmt) {
  const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (i64)n * H * D) return;
  const int e = (int)(i % D);
  const i64 th = i / D;
  const int h = (int)(th % H);
  out[i] = kv_deq(fmt, pool + token_offset(block_ids, (int)(th / H), h, H, bs, row_bytes), e);
}

// copy_slots in two launches, so overlapping src/dst (a sequence shifting down) read before any write
extern "C" __global__ void kvhal_copy_gather(const u8* __restrict__ pool, const i64* __restrict__ slots,
                                             u8* __restrict__ tmp, int n, int H, int bs, int row_bytes) {
  const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (i64)n * H * row_bytes) return;
  const i64 th = i / row_bytes;
  tmp[i] = pool[row_offset(slots[th / H], (int)(th % H), H, bs, row_bytes) + i % row_bytes];
}

extern "C" __global__ void kvhal_copy_scatter(const u8* __restrict__ tmp, const i64* __restrict__ slots,
                                              u8* __restrict__ pool, int n, int H, int bs, int row_bytes) {
  const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (i64)n * H * row_bytes) return;
  const i64 th = i / row_bytes;
  pool[row_offset(slots[th / H], (int)(th % H), H, bs, row_bytes) + i % row_bytes] = tmp[i];
}

// Raw block I/O (kvhal/backend.py): blocks [n, L * (kb + vb)] bytes hold, per block and layer, the K page
// then the V page; pools[2l] and pools[2l + 1] are the addresses of layer l's K and V pools. One CTA per
// (block, layer, K|V) page, 16-bit copies (page sizes are even), coalesced on both sides.
template <bool GATHER>
__device__ __forceinline__ void copy_pages(const unsigned long long* pools, const i64* ids, u8* blocks, int L, i64 kb,
                                           i64 vb) {
  const i64 g = blockIdx.x;
  const i64 b = g / (2 * L);
  const int lv = (int)(g - b * 2 * L);  // 2 * layer + (0: K, 1: V)
  const i64 bytes = (lv & 1) ? vb : kb;
  u8* page = reinterpret_cast<u8*>(pools[lv]) + ids[b] * bytes;
  u8* raw = blocks + (b * L + (lv >> 1)) * (kb + vb) + ((lv & 1) ? kb : 0);
  for (i64 e = 2 * (i64)threadIdx.x; e < bytes; e += 2 * (i64)blockDim.x) {
    if (GATHER)
      st16(raw + e, ld16(page + e));
    else
      st16(page + e, ld16(raw + e));
  }
}

extern "C" __global__ void kvhal_blocks_gather(const unsigned long long* __restrict__ pools,
                                               const i64* __restrict__ ids, u8* __restrict__ blocks, int L, i64 kb,
                                               i64 vb) {
  copy_pages<true>(pools, ids, blocks, L, kb, vb);
}

extern "C" __global__ void kvhal_blocks_scatter(const unsigned long long* __restrict__ pools,
                                                const i64* __restrict__ ids, u8* __restrict__ blocks, int L, i64 kb,
                                                i64 vb) {
  copy_pages<false>(pools, ids, blocks, L, kb, vb);
}

// ---- attention ---------------------------------------------------------------------------------------
//
// Query row r sees the KV interval [lo[r], hi[r]) of its sequence, computed on the host by
// kvhal.backend_util.visible_range and packed into meta (plan.plan_attention). KV is cut into splits of
// split_pages pages; with n_splits > 1 every CTA writes its split's normalized output and log-sum-exp to
// part_o/part_lse and kvhal_attn_merge combines them.

struct AttnArgs {
  const float* q;  // [R, Hq, D]
  const u8* kpool;
  const u8* vpool;
  const int* meta;  // plan.plan_attention: table [S, tstride] | seq_lens | q_lens | q_start | lo | hi | work lists
  float* out;       // [R, Hq, D]
  float* part_o;    // [n_splits, R, Hq, D]
  float* part_lse;  // [n_splits, R, Hq]
};

// One online-softmax step over up to 32 tokens: lane j holds token j's score (-inf if masked);
// value_at(j, e) gives its V. Updates m, l and acc (lane's elements e = lane + 32c).
template <class V>
__device__ __forceinline__ void online_step(float sc, int nt, int lane, int D, float& m, float& l,
                                            float (&acc)[KV_MAXC], const V value_at) {
  const float mt = warp_max(sc);
  if (mt == kv_neg_inf()) return;  // uniform: nothing visible in this tile for this row
  const float mn = fmaxf(m, mt);
  const float alpha = expf(m - mn);  // m = -inf on the first tile: 0
  const float p = expf(sc - mn);
  l = l * alpha + warp_sum(p);
#pragma unroll
  for (int c = 0; c < KV_MAXC; ++c) acc[c] *= alpha;
  for (int j = 0; j < nt; ++j) {
    const float pj = kv_shfl(p, j);
    if (pj != 0.0f) value_at.axpy(j, pj, acc, lane, D);  // uniform
  }
  m = mn;
}

struct GlobalV {
  const u8* vpool;
  const int* trow;
  int t0, hk, H, bs, rb, fmt;
  __device__ __forceinline__ void axpy(int j, float p, float (&acc)[KV_MAXC], int lane, int D) const {
    kv_axpy_lane(fmt, vpool + token_offset(trow, t0 + j, hk, H, bs, rb), p, acc, lane, D);
  }
};

struct SharedV {
  const float* vs;
  int D;
  __device__ __forceinline__ void axpy(int j, float p, float (&acc)[KV_MAXC], int lane, int D_) const {
#pragma unroll
    for (int c = 0; c < KV_MAXC; ++c) {
      const int e = lane + 32 * c;
      if (e < D_) acc[c] += p * vs[j * D + e];
    }
  }
};

// a finished row (or split of a row): normalized output and its log-sum-exp
__device__ __forceinline__ void emit(const AttnArgs& a, int R, int Hq, int D, int n_splits, int p, int r, int h, int e,
                                     float o, float lse, bool write_lse) {
  const i64 rh = (i64)r * Hq + h;
  if (n_splits == 1) {
    a.out[rh * D + e] = o;
  } else {
    a.part_o[((i64)p * R * Hq + rh) * D + e] = o;
    if (write_lse) a.part_lse[(i64)p * R * Hq + rh] = lse;
  }
}

// Decode: one CTA per (query row, q head, split); its warps take interleaved 32-token tiles, read
// K/V straight from the pages (lanes over head_dim), and merge their softmax states at the end.
// grid (n_decode, Hq, n_splits), block KV_NW * 32, dynamic smem plan.decode_smem_bytes(D).
// 8 CTAs (32 warps) per SM: decode is bound by memory latency, so occupancy beats registers
extern "C" __global__ void __launch_bounds__(KV_NW * 32, 8)
    kvhal_attn_decode(const float* __restrict__ q, const u8* __restrict__ kpool, const u8* __restrict__ vpool,
                      const int* __restrict__ meta, float* __restrict__ out, float* __restrict__ part_o,
                      float* __restrict__ part_lse, int tstride, int range_off, int dec_off, int R, int Hq, int Hkv,
                      int D, int bs, int krb, int vrb, int kfmt, int vfmt, float scale, int split_pages,
                      int n_splits) {
  KV_DYNAMIC_SMEM(float, smem);
  const AttnArgs a{q, kpool, vpool, meta, out, part_o, part_lse};
  const int w = blockIdx.x, h = blockIdx.y, p = blockIdx.z;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int s = meta[dec_off + 2 * w], r = meta[dec_off + 2 * w + 1];
  const int lo = meta[range_off + r], hi = meta[range_off + R + r];
  const int a0 = max(lo, p * split_pages * bs), b0 = min(hi, (p + 1) * split_pages * bs);
  const int hk = h / (Hq / Hkv);
  const int* trow = meta + (i64)s * tstride;

  float qv[KV_MAXC], acc[KV_MAXC];
  const float* qr = q + ((i64)r * Hq + h) * D;
#pragma unroll
  for (int c = 0; c < KV_MAXC; ++c) {
    const int e = lane + 32 * c;
    qv[c] = e < D ? qr[e] * scale : 0.0f;
    acc[c] = 0.0f;
  }
  float m = kv_neg_inf(), l = 0.0f;
  for (int t0 = a0 + 32 * warp; t0 < b0; t0 += 32 * KV_NW) {
    const int nt = min(32, b0 - t0);
    float sc = kv_neg_inf();
    for (int j = 0; j < nt; ++j) {
      const u8* krow = kpool + token_offset(trow, t0 + j, hk, Hkv, bs, krb);
      const float dot = warp_sum(kv_dot_lane(kfmt, krow, qv, lane, D));
      if (lane == j) sc = dot;
    }
    online_step(sc, nt, lane, D, m, l, acc, GlobalV{vpool, trow, t0, hk, Hkv, bs, vrb, vfmt});
  }

  // merge the warps: smem [KV_NW][D + 2] = acc, m, l
  float* mine = smem + warp * (D + 2);
#pragma unroll
  for (int c = 0; c < KV_MAXC; ++c) {
    const int e = lane + 32 * c;
    if (e < D) mine[e] = acc[c];
  }
  if (lane == 0) {
    mine[D] = m;
    mine[D + 1] = l;
  }
  __syncthreads();
  float M = kv_neg_inf();
  for (int u = 0; u < KV_NW; ++u) M = fmaxf(M, smem[u * (D + 2) + D]);
  float L = 0.0f;
  for (int u = 0; u < KV_NW; ++u) {
    const float mu = smem[u * (D + 2) + D];
    if (mu != kv_neg_inf()) L += smem[u * (D + 2) + D + 1] * expf(mu - M);
  }
  for (int e = threadIdx.x; e < D; e += blockDim.x) {
    float o = 0.0f;
    for (int u = 0; u < KV_NW; ++u) {
      const float mu = smem[u * (D + 2) + D];
      if (mu != kv_neg_inf()) o += smem[u * (D + 2) + e] * expf(mu - M);
    }
    const bool any = L > 0.0f;  // false only for a split past this row's visible range
    emit(a, R, Hq, D, n_splits, p, r, h, e, any ? o / L : 0.0f, any ? M + logf(L) : kv_neg_inf(), e == 0);
  }
}

// Prefill: one CTA per (tile of up to KV_NW * rpw query rows of one sequence, q head, split). K/V tiles
// of bt tokens are dequantized once into shared memory and reused by every row; warp w owns rows
// w, w + KV_NW, ...; lane j scores token j of the tile. grid (n_tiles, Hq, n_splits), block KV_NW * 32,
// dynamic smem plan.prefill_geometry(D).smem_bytes: q rows | K tile (row stride kst, odd) | V tile.
extern "C" __global__ void __launch_bounds__(KV_NW * 32, 4)
    kvhal_attn_prefill(const float* __restrict__ q, const u8* __restrict__ kpool, const u8* __restrict__ vpool,
                       const int* __restrict__ meta, float* __restrict__ out, float* __restrict__ part_o,
                       float* __restrict__ part_lse, int S, int tstride, int range_off, int tile_off, int R, int Hq,
                       int Hkv, int D, int bs, int krb, int vrb, int kfmt, int vfmt, float scale, int split_pages,
                       int n_splits, int rpw, int bt, int kst) {
  KV_DYNAMIC_SMEM(float, smem);
  const AttnArgs a{q, kpool, vpool, meta, out, part_o, part_lse};
  const int w = blockIdx.x, h = blockIdx.y, p = blockIdx.z;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int* q_start = meta + S * tstride + 2 * S;
  const int s = meta[tile_off + 3 * w], i0 = meta[tile_off + 3 * w + 1], nr = meta[tile_off + 3 * w + 2];
  const int r0 = q_start[s] + i0;  // the tile's rows are r0 .. r0 + nr - 1
  const int* lo = meta + range_off;
  const int* hi = lo + R;
  const int hk = h / (Hq / Hkv);
  const int* trow = meta + (i64)s * tstride;
  float* qs = smem;
  float* ks = qs + KV_NW * rpw * D;
  float* vs = ks + bt * kst;

  // lo and hi grow with the row's position: the tile's first row starts its range, its last row ends it
  const int a0 = max(lo[r0], p * split_pages * bs), b0 = min(hi[r0 + nr - 1], (p + 1) * split_pages * bs);

  for (int idx = threadIdx.x; idx < nr * D; idx += blockDim.x)
    qs[idx] = q[((i64)(r0 + idx / D) * Hq + h) * D + idx % D] * scale;

  float m[KV_RPW_MAX], l[KV_RPW_MAX], acc[KV_RPW_MAX][KV_MAXC];
#pragma unroll
  for (int u = 0; u < KV_RPW_MAX; ++u) {
    m[u] = kv_neg_inf();
    l[u] = 0.0f;
#pragma unroll
    for (int c = 0; c < KV_MAXC; ++c) acc[u][c] = 0.0f;
  }
  __syncthreads();

  for (int t0 = a0; t0 < b0; t0 += bt) {
    const int nt = min(bt, b0 - t0);
    for (int idx = threadIdx.x; idx < nt * D; idx += blockDim.x) {
      const int j = idx / D, e = idx - (idx / D) * D;
      ks[j * kst + e] = kv_deq(kfmt, kpool + token_offset(trow, t0 + j, hk, Hkv, bs, krb), e);
      vs[j * D + e] = kv_deq(vfmt, vpool + token_offset(trow, t0 + j, hk, Hkv, bs, vrb), e);
    }
    __syncthreads();
#pragma unroll
    for (int u = 0; u < KV_RPW_MAX; ++u) {
      const int k = warp + KV_NW * u;
      if (u >= rpw || k >= nr) continue;  // uniform per warp
      const int t = t0 + lane;
      float sc = kv_neg_inf();
      if (lane < nt && t >= lo[r0 + k] && t < hi[r0 + k]) {
        const float* qk = qs + k * D;
        const float* kr = ks + lane * kst;
        float dot = 0.0f;
        for (int d = 0; d < D; ++d) dot += qk[d] * kr[d];
        sc = dot;
      }
      online_step(sc, nt, lane, D, m[u], l[u], acc[u], SharedV{vs, D});
    }
    __syncthreads();
  }

#pragma unroll
  for (int u = 0; u < KV_RPW_MAX; ++u) {
    const int k = warp + KV_NW * u;
    if (u >= rpw || k >= nr) continue;
    const bool any = l[u] > 0.0f;
    const float lse = any ? m[u] + logf(l[u]) : kv_neg_inf();
#pragma unroll
    for (int c = 0; c < KV_MAXC; ++c) {
      const int e = lane + 32 * c;
      if (e < D) emit(a, R, Hq, D, n_splits, p, r0 + k, h, e, any ? acc[u][c] / l[u] : 0.0f, lse, e == 0);
    }
  }
}

// out[r, h] = sum_p exp(lse_p - M) o_p / sum_p exp(lse_p - M), M = max_p lse_p (plan.merge_splits).
// grid (R * Hq), block >= 32; every row has at least one split with a visible token.
extern "C" __global__ void kvhal_attn_merge(const float* __restrict__ part_o, const float* __restrict__ part_lse,
                                            float* __restrict__ out, int R, int Hq, int D, int n_splits) {
  const i64 rh = blockIdx.x;
  const i64 stride = (i64)R * Hq;
  float M = kv_neg_inf();
  for (int p = 0; p < n_splits; ++p) M = fmaxf(M, part_lse[p * stride + rh]);
  float wsum = 0.0f;
  for (int p = 0; p < n_splits; ++p) {
    const float lse = part_lse[p * stride + rh];
    if (lse != kv_neg_inf()) wsum += expf(lse - M);
  }
  for (int e = threadIdx.x; e < D; e += blockDim.x) {
    float o = 0.0f;
    for (int p = 0; p < n_splits; ++p) {
      const float lse = part_lse[p * stride + rh];
      if (lse != kv_neg_inf()) o += expf(lse - M) * part_o[(p * stride + rh) * D + e];
    }
    out[rh * D + e] = wsum > 0.0f ? o / wsum : 0.0f;
  }
}
