// kvhal kernels for CUDA and HIP: store (quantize + scatter), load (gather + dequantize), paged attention
// (split-KV decode, tiled prefill, log-sum-exp merge) and copy_slots, over every kvhal format (K of kivi4/kivi2,
// per channel over whole pages, by kvhal_store_kpage and k_value / k_kpage: its fmt id carries KV_KPAGED).
//
// Pools are [n_blocks, n_kv_heads, block_size, row_bytes] bytes, a row being one token of one head in
// its format's byte layout (the numpy references in kvhal/formats/ are the spec). Quantization is
// bit-exact with that spec: fp32 inverse of the *unrounded* scale (0 when it is 0 or overflows), C roundf
// (half away from zero, exact just below 0.5) for q8_0, truncation of x*id + 8.5 / +16.5 / +0.5, RNE
// f32->f16 of the scales, ggml's first-occurrence reductions, and no FMA contraction (kv_*_rn, see
// platform.h); the v2 formats (fp8, mxfp4, nvfp4, kivi) as their helpers below say.
//
// Rows of formats with 16-bit fields start at even byte offsets (their row and block sizes are even), so
// 16-bit loads and stores are aligned; fp8 and mxfp4 rows, which may be odd-sized, are read bytewise.
// Launch geometry and argument layout come from kvhal_cuda/plan.py; format ids, block sizes and the
// geometry constants (KV_NW, KV_MAXC, KV_RPW_MAX) from the generated kvhal_constants.h.
#include "platform.h"
#include "kvhal_constants.h"

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;

// one 32-lane warp quantizes 32 values: one block, or half of an nvfp4 block (two of its 16-value sub-blocks)
static_assert(KV_Q8_0_BLOCK_LEN == 32 && KV_Q4_0_BLOCK_LEN == 32 && KV_Q4_1_BLOCK_LEN == 32 &&
                  KV_Q5_0_BLOCK_LEN == 32 && KV_Q5_1_BLOCK_LEN == 32 && KV_MXFP4_BLOCK_LEN == 32 &&
                  KV_KIVI4_BLOCK_LEN == 32 && KV_KIVI2_BLOCK_LEN == 32,
              "kvhal.cu quantizes 32-value blocks");
static_assert(KV_NVFP4_BLOCK_LEN == 64, "kvhal.cu quantizes nvfp4 as two 32-value halves of a 64-value block");
static_assert(KV_FP8_E4M3_BLOCK_LEN == 1 && KV_FP8_E5M2_BLOCK_LEN == 1, "fp8 is one byte per value");

__device__ __forceinline__ float kv_neg_inf() { return kv_u32_as_f32(0xff800000u); }
__device__ __forceinline__ u16 ld16(const u8* p) {
  kv_check_aligned(p, 2);  // a fault on the GPU; the emulator fails the launch
  return *reinterpret_cast<const u16*>(p);
}
__device__ __forceinline__ void st16(u8* p, u16 v) {
  kv_check_aligned(p, 2);
  *reinterpret_cast<u16*>(p) = v;
}
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

// ---- dequantization: value e of a stored row, op for op as kvhal/formats/*.py ----------------------

__device__ __forceinline__ int nibble(const u8* qs, int j) { return (qs[j & 15] >> ((j >> 4) * 4)) & 15; }
__device__ __forceinline__ float kv_nan() { return kv_u32_as_f32(0x7fc00000u); }

// fp8 (kvhal/formats/fp8.py): sign, EB exponent bits with bias 2^(EB-1) - 1, MB mantissa bits, subnormals at
// exponent 0; codes above the largest finite value (e4m3: 0x7f; e5m2: exponent 31) decode to NaN as the spec's
// table does (a store never writes them)
template <int EB, int MB>
__device__ __forceinline__ float fp8_decode(u32 c) {
  const int bias = (1 << (EB - 1)) - 1;
  const u32 sign = (c >> 7) << 31;
  const u32 ex = (c & 0x7fu) >> MB, man = c & ((1u << MB) - 1u);
  if (EB == 4 ? (c & 0x7fu) == 0x7fu : ex == 31u) return kv_nan();
  if (ex == 0) {  // m * 2^(1 - bias - MB), exact
    const float mag = kv_fmul_rn((float)man, kv_u32_as_f32((u32)(127 + 1 - bias - MB) << 23));
    return kv_u32_as_f32(kv_f32_as_u32(mag) | sign);
  }
  return kv_u32_as_f32(sign | ((ex - bias + 127) << 23) | (man << (23 - MB)));
}

// the doubled e2m1 value of a 4-bit code: {0, 1, 2, 3, 4, 6, 8, 12}, codes 8..15 negative (code 8 is +0)
__device__ __forceinline__ int e2m1x2(int c) {
  const int m = c & 7;
  const int v = m < 4 ? m : (2 + (m & 1)) << ((m >> 1) - 1);
  return (c & 8) ? -v : v;
}
// mxfp4's e8m0 scale as ggml_e8m0_to_fp32_half: 2^(e-127) / 2, subnormal bit patterns for e < 2
__device__ __forceinline__ float e8m0_half(u32 e) {
  return kv_u32_as_f32(e < 2 ? 0x00200000u << e : (e - 1u) << 23);
}
// nvfp4's unsigned e4m3 scale times one half (ggml_ue4m3_to_fp32); codes 0 and 0x7f decode to 0
__device__ __forceinline__ float ue4m3_half(u32 c) {
  const u32 ex = (c >> 3) & 15u, man = c & 7u;
  if (c == 0 || c == 0x7fu) return 0.0f;
  if (ex == 0) return kv_fmul_rn((float)man, kv_u32_as_f32((u32)(127 - 10) << 23));  // man * 2^-9 / 2
  return kv_u32_as_f32(((ex + 119u) << 23) | (man << (23 - 3)));  // (1 + man/8) * 2^(ex-7) / 2
}

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
  if (F == KV_Q5_1) {
    const u8* b = row + (e >> 5) * KV_Q5_1_BLOCK_BYTES;
    const int q = nibble(b + 8, j) | (int)(((ld32_2(b + 4) >> j) & 1u) << 4);
    return kv_fadd_rn(kv_fmul_rn(ldf16(b), (float)q), ldf16(b + 2));
  }
  if (F == KV_FP8_E4M3) return fp8_decode<4, 3>(row[e]);
  if (F == KV_FP8_E5M2) return fp8_decode<5, 2>(row[e]);
  if (F == KV_MXFP4) {
    const u8* b = row + (e >> 5) * KV_MXFP4_BLOCK_BYTES;
    return kv_fmul_rn(e8m0_half(b[0]), (float)e2m1x2(nibble(b + 1, j)));
  }
  if (F == KV_NVFP4) {  // sub-block s: value p low, p + 8 high nibble of qs[8s + p]
    const u8* b = row + (e >> 6) * KV_NVFP4_BLOCK_BYTES;
    const int s = (e >> 4) & 3, p = e & 15;
    const int c = (b[4 + 8 * s + (p & 7)] >> ((p >> 3) * 4)) & 15;
    return kv_fmul_rn(ue4m3_half(b[s]), (float)e2m1x2(c));
  }
  if (F == KV_KIVI4) return deq<KV_Q4_1>(row, e);  // kivi4 V rows are q4_1's
  // KV_KIVI2: value j + 8i of a group in bits 2i..2i+1 of byte j
  const u8* b = row + (e >> 5) * KV_KIVI2_BLOCK_BYTES;
  const int q = (b[4 + (j & 7)] >> (2 * (j >> 3))) & 3;
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
    case KV_Q5_1: CALL(KV_Q5_1); \
    case KV_FP8_E4M3: CALL(KV_FP8_E4M3); \
    case KV_FP8_E5M2: CALL(KV_FP8_E5M2); \
    case KV_MXFP4: CALL(KV_MXFP4); \
    case KV_NVFP4: CALL(KV_NVFP4); \
    case KV_KIVI4: CALL(KV_KIVI4); \
    default: CALL(KV_KIVI2);     \
  }

__device__ __forceinline__ float kv_deq(int fmt, const u8* row, int e) {
#define KV_DEQ(F) return deq<F>(row, e)
  KV_DISPATCH(fmt, KV_DEQ)
#undef KV_DEQ
}

// ---- 32-lane reductions (every lane ends with the result) ----------------------------------------

// max that keeps a NaN (fmaxf drops it): a NaN score (a NaN in q or K) must reach its row's output
__device__ __forceinline__ float kv_max(float a, float b) { return (a != a || b != b) ? a + b : fmaxf(a, b); }

__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = kv_max(v, kv_shfl_xor(v, o));
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

// fp8 (kvhal/formats/fp8.py): round to nearest even, saturating at max_finite, the sign kept on zero. In
// software on every arch (bit manipulation): older archs need it anyway, and sm_89's native
// cvt.rn.satfinite is not used until its bytes are checked against the spec on a GPU.
template <int EB, int MB>
__device__ __forceinline__ u8 fp8_encode(float x, float max_finite) {
  const int bias = (1 << (EB - 1)) - 1;
  const u32 sign = (kv_f32_as_u32(x) >> 31) << 7;
  const float a = fminf(fabsf(x), max_finite);
  const u32 u = kv_f32_as_u32(a);
  u32 code;
  if ((int)(u >> 23) - 127 >= 1 - bias) {  // normal: RNE of the f32 mantissa to MB bits, carry into the exponent
    const int shift = 23 - MB;
    const u32 r = (u + ((1u << (shift - 1)) - 1u) + ((u >> shift) & 1u)) >> shift;
    code = r - ((u32)(127 - bias) << MB);  // max_finite is representable: never rounds past it
  } else {  // subnormal: a / 2^(1 - bias - MB) is exact, rintf rounds half to even
    code = (u32)rintf(kv_fmul_rn(a, kv_u32_as_f32((u32)(127 - 1 + bias + MB) << 23)));  // 2^MB: smallest normal
  }
  return (u8)(code | sign);
}

// the nearest doubled e2m1 value to x / d, lowest code on ties, errors |d*v - x| rounded as in f32 (fp4.py)
__device__ __forceinline__ int e2m1_code(float x, float d) {
  int best = 0;
  float err = fabsf(kv_fsub_rn(kv_fmul_rn(d, 0.0f), x));
  for (int c = 1; c < 16; ++c) {
    const float ec = fabsf(kv_fsub_rn(kv_fmul_rn(d, (float)e2m1x2(c)), x));
    if (ec < err) {
      err = ec;
      best = c;
    }
  }
  return best;
}

// ggml_fp32_to_ue4m3 as fp4.py transcribes it: round half up on the first dropped bit, saturating at 0x7e
__device__ __forceinline__ u32 ue4m3(float v) {
  const float x = fminf(fmaxf(v, 0.0f), 448.0f);
  if (!(x > 0.0f)) return 0;
  const u32 bits = kv_f32_as_u32(x);
  const int ex = (int)((bits >> 23) & 0xffu) - 127 + 7;
  if (ex <= 0) {
    const int sub = (int)kv_fadd_rn(kv_fmul_rn(x, 512.0f), 0.5f);
    return (u32)min(max(sub, 0), 7);
  }
  if (ex >= 15) return 0x7eu;
  int man = (int)((bits >> (23 - 3)) & 7u) + (int)((bits >> (23 - 4)) & 1u);
  int exr = ex;
  if (man > 7) {
    man = 0;
    exr = ex + 1;
  }
  return exr >= 15 ? 0x7eu : (u32)((exr << 3) | man);
}

// mxfp4's e8m0 exponent floor(log2(amax)) - 2 + 127, clipped to 0..254. The spec takes log2 in f32
// (numpy, as ggml's log2f), which rounds up to an integer just below a power of two; the double log2
// rounded once to f32 reproduces that.
__device__ __forceinline__ u32 mxfp4_exponent(float amax) {
  if (!(amax > 0.0f)) return 0;
  const int e = (int)floorf((float)log2((double)amax)) - 2 + 127;
  return (u32)min(max(e, 0), 254);
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
    case KV_KIVI4:  // kivi4 V rows are q4_1's
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
    case KV_KIVI2: {  // q4_1's rule with 2-bit codes; value j + 8i in bits 2i..2i+1 of byte j
      const float lo = warp_first<1>(x, j);
      const float d = kv_fdiv_rn(kv_fsub_rn(warp_first<2>(x, j), lo), 3.0f);
      const float t = truncf(kv_fadd_rn(kv_fmul_rn(kv_fsub_rn(x, lo), kv_inverse(d)), 0.5f));
      const int q = (int)fminf(t, 3.0f);
      const int q1 = kv_shfl(q, (j + 8) & 31), q2 = kv_shfl(q, (j + 16) & 31), q3 = kv_shfl(q, (j - 8) & 31);
      if (j < 8) b[4 + j] = (u8)(q | (q1 << 2) | (q2 << 4) | (q3 << 6));
      if (j == 0) {
        st16(b, kv_f32_to_f16(d));
        st16(b + 2, kv_f32_to_f16(lo));
      }
      break;
    }
    case KV_MXFP4: {
      const u32 e = mxfp4_exponent(warp_max(fabsf(x)));
      const int c = e2m1_code(x, e8m0_half(e));
      const int hi = kv_shfl(c, (j + 16) & 31);
      if (j < 16) b[1 + j] = (u8)(c | (hi << 4));
      if (j == 0) b[0] = (u8)e;
      break;
    }
  }
}

// nvfp4: lane j holds value 32 * half + j of the 64-value block at b, so lanes 0-15 and 16-31 are the
// sub-blocks s = 2 * half and 2 * half + 1. Every lane must call it.
__device__ __forceinline__ void quant_nvfp4_half(float x, int j, int half, u8* b) {
  float amax = fabsf(x);
  for (int o = 8; o > 0; o >>= 1) amax = fmaxf(amax, kv_shfl_xor(amax, o));  // within each 16-lane group
  const u32 sc = ue4m3(kv_fdiv_rn(amax, 6.0f));
  const int c = e2m1_code(x, ue4m3_half(sc));
  const int hi = kv_shfl(c, (j + 8) & 31);
  const int s = 2 * half + (j >> 4), p = j & 15;
  if (p < 8) b[4 + 8 * s + p] = (u8)(c | (hi << 4));
  if (p == 0) b[s] = (u8)sc;
}

__device__ __forceinline__ int block_bytes(int fmt) {
  switch (fmt) {
    case KV_Q8_0: return KV_Q8_0_BLOCK_BYTES;
    case KV_Q4_0: return KV_Q4_0_BLOCK_BYTES;
    case KV_Q4_1: return KV_Q4_1_BLOCK_BYTES;
    case KV_Q5_0: return KV_Q5_0_BLOCK_BYTES;
    case KV_Q5_1: return KV_Q5_1_BLOCK_BYTES;
    case KV_MXFP4: return KV_MXFP4_BLOCK_BYTES;
    case KV_NVFP4: return KV_NVFP4_BLOCK_BYTES;
    case KV_KIVI4: return KV_KIVI4_BLOCK_BYTES;
    case KV_KIVI2: return KV_KIVI2_BLOCK_BYTES;
  }
  return 0;
}

// x [n, H, D] f32 into slots[i] of pool, quantized formats: one warp per 32 values (a block; for nvfp4 half
// of one, D being a multiple of its 64-value block).
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
  u8* row = pool + row_offset(slots[t], h, H, bs, row_bytes);
  if (fmt == KV_NVFP4)
    quant_nvfp4_half(v, j, c & 1, row + (c >> 1) * KV_NVFP4_BLOCK_BYTES);
  else
    quant_block(fmt, v, j, row + c * block_bytes(fmt));
}

// x [n, H, D] f32 into slots[i] of pool, f32/f16/bf16/fp8: one thread per value.
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
  } else if (fmt == KV_FP8_E4M3) {
    row[e] = fp8_encode<4, 3>(v, 448.0f);
  } else if (fmt == KV_FP8_E5M2) {
    row[e] = fp8_encode<5, 2>(v, 57344.0f);
  } else {  // bf16: round to nearest even on the upper half (finite inputs, checked by the core)
    const u32 u = kv_f32_as_u32(v);
    st16(row + KV_BF16_BLOCK_BYTES * (i64)e, (u16)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16));
  }
}

// ---- K of kivi4/kivi2 per channel over whole pages (kvhal/formats/kivi.py's _page_codec) ----------------
// The K fmt id carries KV_KPAGED. One (page, KV head) is bs rows of cb = D*bits/8 code bytes (packed as the
// V rows, no scales), then f16 d[D], f16 m[D]: one scale and minimum per channel over the page's tokens.

__device__ __forceinline__ int kpage_bits(int kfmt) { return (kfmt & ~KV_KPAGED) == KV_KIVI4 ? 4 : 2; }

// byte of channel e in a code row and its field's shift: value j + w*i of a 32-group in field i of byte j,
// w = 4*bits bytes per group (4 bits: q4_1's nibbles; 2 bits: four fields)
__device__ __forceinline__ int kpage_byte(int e, int bits) { return (e >> 5) * 4 * bits + (e & 31) % (4 * bits); }
__device__ __forceinline__ int kpage_shift(int e, int bits) { return bits * ((e & 31) / (4 * bits)); }

// value e of token u of the page of one head starting at hp: d*q + m, rounded as the spec (no FMA)
__device__ __forceinline__ float kpage_value(const u8* hp, int u, int e, int D, int bs, int bits) {
  const int cb = D * bits / 8;
  const u8* sc = hp + (i64)bs * cb;
  const int q = (hp[(i64)u * cb + kpage_byte(e, bits)] >> kpage_shift(e, bits)) & ((1 << bits) - 1);
  return kv_fadd_rn(kv_fmul_rn(ldf16(sc + 2 * e), (float)q), ldf16(sc + 2 * D + 2 * e));
}

// value e of token t of a sequence (pages table[0..]) from a K pool of either kind
__device__ __forceinline__ float k_value(int kfmt, const u8* kpool, const int* table, int t, int hk, int H, int bs,
                                         int krb, int D, int e) {
  if (kfmt & KV_KPAGED) {
    const int page = t / bs;
    return kpage_value(kpool + ((i64)table[page] * H + hk) * bs * krb, t - page * bs, e, D, bs, kpage_bits(kfmt));
  }
  return kv_deq(kfmt, kpool + token_offset(table, t, hk, H, bs, krb), e);
}

// code byte b of every row of one (page, head) page hp from its bs tokens xh (xs floats apart): the 8/BITS
// channels sharing that byte, each over the page's tokens: lo, hi (the first occurrence wins ties, as ggml),
// d = (hi - lo) / top, q = trunc((x - lo) * id + 0.5). BITS a template parameter: the per-channel lo and id
// stay in registers (a runtime count would put them in local memory)
template <int BITS>
__device__ __forceinline__ void kpage_quant_byte(const float* xh, i64 xs, u8* hp, int b, int D, int bs) {
  constexpr int PER = 8 / BITS, W = 4 * BITS, TOP = (1 << BITS) - 1;
  const int cb = D * BITS / 8;
  float lo[PER], id[PER];
#pragma unroll
  for (int f = 0; f < PER; ++f) {
    const int e = (b / W) * 32 + b % W + W * f;
    float l = xh[e], hi = xh[e];
    for (int u = 1; u < bs; ++u) {
      const float v = xh[u * xs + e];
      if (v < l) l = v;
      if (v > hi) hi = v;
    }
    const float d = kv_fdiv_rn(kv_fsub_rn(hi, l), (float)TOP);
    lo[f] = l;
    id[f] = kv_inverse(d);
    st16(hp + (i64)bs * cb + 2 * e, kv_f32_to_f16(d));
    st16(hp + (i64)bs * cb + 2 * D + 2 * e, kv_f32_to_f16(l));
  }
  for (int u = 0; u < bs; ++u) {
    int byte = 0;
#pragma unroll
    for (int f = 0; f < PER; ++f) {
      const int e = (b / W) * 32 + b % W + W * f;
      const float t = truncf(kv_fadd_rn(kv_fmul_rn(kv_fsub_rn(xh[u * xs + e], lo[f]), id[f]), 0.5f));
      byte |= (int)fminf(t, (float)TOP) << (BITS * f);
    }
    hp[(i64)u * cb + b] = (u8)byte;
  }
}

// x [n, H, D] f32, n a multiple of bs: slots [i*bs, (i+1)*bs) fill one page in order (whole_pages checks it).
// One CTA per (page i, head h); thread b owns code byte b of every row, so no two threads write one byte.
extern "C" __global__ void kvhal_store_kpage(const float* __restrict__ x, const i64* __restrict__ slots,
                                             u8* __restrict__ pool, int n, int H, int D, int bs, int row_bytes,
                                             int fmt) {
  const int h = blockIdx.x % H;
  const i64 i0 = (i64)(blockIdx.x / H) * bs;
  if (i0 + bs > n) return;  // the grid covers n / bs pages (at least one CTA when n = 0)
  const int bits = kpage_bits(fmt);
  u8* hp = pool + (slots[i0] / bs * H + h) * bs * (i64)row_bytes;
  const float* xh = x + (i0 * H + h) * D;
  for (int b = threadIdx.x; b < D * bits / 8; b += blockDim.x) {
    if (bits == 4)
      kpage_quant_byte<4>(xh, (i64)H * D, hp, b, D, bs);
    else
      kpage_quant_byte<2>(xh, (i64)H * D, hp, b, D, bs);
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
  out[i] = k_value(fmt, pool, block_ids, (int)(th / H), h, H, bs, row_bytes, D, e);  // V pools too (no KV_KPAGED)
}

// out [n, H, D] bf16 bits: kvhal_load rounded to nearest even (NaN stays a quiet NaN of its sign), what the
// torch SDPA prefill route (sdpa.py) hands FlashAttention: the dequantization pass that route pays, half the
// bytes of f32
extern "C" __global__ void kvhal_load_bf16(const u8* __restrict__ pool, const int* __restrict__ block_ids,
                                           u16* __restrict__ out, int n, int H, int D, int bs, int row_bytes, int fmt) {
  const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (i64)n * H * D) return;
  const int e = (int)(i % D);
  const i64 th = i / D;
  const int h = (int)(th % H);
  const unsigned int u = kv_f32_as_u32(k_value(fmt, pool, block_ids, (int)(th / H), h, H, bs, row_bytes, D, e));
  out[i] = (u & 0x7fffffffu) > 0x7f800000u ? (u16)((u >> 16) | 0x40u) : (u16)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
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
// (block, layer, K|V) page, 16-bit copies when both page sizes are even, else byte copies, coalesced.
template <bool GATHER>
__device__ __forceinline__ void copy_pages(const unsigned long long* pools, const i64* ids, u8* blocks, int L, i64 kb,
                                           i64 vb) {
  const i64 g = blockIdx.x;
  const i64 b = g / (2 * L);
  const int lv = (int)(g - b * 2 * L);  // 2 * layer + (0: K, 1: V)
  const i64 bytes = (lv & 1) ? vb : kb;
  u8* page = reinterpret_cast<u8*>(pools[lv]) + ids[b] * bytes;
  u8* raw = blocks + (b * L + (lv >> 1)) * (kb + vb) + ((lv & 1) ? kb : 0);
  if ((kb | vb) & 1) {  // odd page sizes (fp8 or mxfp4 rows): pages start at odd offsets, copy bytes
    for (i64 e = threadIdx.x; e < bytes; e += blockDim.x) {
      if (GATHER)
        raw[e] = page[e];
      else
        page[e] = raw[e];
    }
    return;
  }
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
// kvhal.attention.visible_range and packed into meta (plan.plan_attention). KV is cut into splits of
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
  const float mn = kv_max(m, mt);
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

// ---- decode ---------------------------------------------------------------------------------------------
//
// Per 32-token tile a warp (1) stages the tile's K rows in shared memory with a coalesced copy, (2) scores
// with lanes over tokens: lane j takes token j's whole row against the G pre-scaled q vectors (broadcast
// reads of shared memory), so a score needs no cross-lane reduction, (3) runs one online-softmax step per
// head and (4) accumulates V with lanes over head_dim, VW consecutive elements per lane load. Block formats
// multiply by their scale once per block (K) or per lane load (V). Integer codes become floats exactly
// through the exponent trick: the bits 0x4B000000 | u are the float 2^23 + u (u < 2^23), so one byte
// select / OR and one subtraction replace a conversion instruction (a quarter-rate pipe on NVIDIA GPUs).

__device__ __forceinline__ u32 lds32(const u8* p) {  // a 4-byte aligned 32-bit load (global or shared)
  kv_check_aligned(p, 4);
  return *reinterpret_cast<const u32*>(p);
}
// byte k of w as a float: 2^23 + byte - bias, exact; one PRMT ({byte k, 0, 0, 0x4B}) and one FADD
__device__ __forceinline__ float byte_f(u32 w, int k, float bias) {
  return kv_u32_as_f32(kv_prmt(w, 0x4B000000u, 0x7540u | (u32)k)) - bias;
}
__device__ __forceinline__ float lo16_f16(u32 w) { return kv_f16_to_f32((u16)(w & 0xffffu)); }
__device__ __forceinline__ float hi16_f16(u32 w) { return kv_f16_to_f32((u16)(w >> 16)); }
// an fp8 e4m3 code as its value * 2^-120: sign, exponent and mantissa moved into place, subnormals included
// (f32 subnormals, exact; callers scale by 2^120 once). 0x7f / 0xff (NaN in the spec) are caught by e4m3_nan.
__device__ __forceinline__ float e4m3_scaled(u32 w, int k) {
  const u32 b = (w >> (8 * k)) & 0xffu;
  return kv_u32_as_f32(((b >> 7) << 31) | ((b & 0x7fu) << (23 - 3)));
}
// nonzero when a byte of w is 0x7f or 0xff
__device__ __forceinline__ u32 e4m3_nan(u32 w) {
  const u32 t = (w & 0x7f7f7f7fu) ^ 0x7f7f7f7fu;  // a zero byte where w's byte was x7f
  return (t - 0x01010101u) & ~t & 0x80808080u;
}
#define KV_2P120 1.329227995784916e36f  // 2^120

template <int G>
struct QView {  // the G pre-scaled q rows in shared memory, [G][Dq] with Dq a multiple of 4
  const float* q;
  int Dq;
  __device__ __forceinline__ float4 at4(int g, int e) const {
    return *reinterpret_cast<const float4*>(q + g * Dq + e);
  }
  __device__ __forceinline__ float at(int g, int e) const { return q[g * Dq + e]; }
};

// t[g] += q[g][e..e+3] . x[0..3]
template <int G>
__device__ __forceinline__ void dot4(const QView<G>& q, int e, const float (&x)[4], float (&t)[G]) {
#pragma unroll
  for (int g = 0; g < G; ++g) {
    const float4 v = q.at4(g, e);
    t[g] += v.x * x[0];  // one FMA each (a sum of the four products first would add an FADD)
    t[g] += v.y * x[1];
    t[g] += v.z * x[2];
    t[g] += v.w * x[3];
  }
}

// scores of one K row (lane's own token) against the G heads, value by value through deq<F>: every format,
// any alignment, elements [e0, D)
template <int G, int F>
__device__ __forceinline__ void k_generic(const u8* row, const QView<G>& q, int e0, int D, float (&sc)[G]) {
#pragma unroll 1
  for (int e = e0; e < D; ++e) {
    const float x = deq<F>(row, e);
#pragma unroll
    for (int g = 0; g < G; ++g) sc[g] += q.at(g, e) * x;
  }
}

// q8_0: 34-byte blocks, so a pair of blocks is 17 aligned words: block b's scale in the low half of word 0,
// its codes from the high half of word 0 to the low half of word 8; block b+1's scale in the high half of
// word 8, its codes in words 9..16. Needs a 4-byte aligned row (staged) and reads up to the pair's 68th byte
// (inside the staged stride).
static_assert(KV_Q8_0_BLOCK_BYTES == 2 + KV_Q8_0_BLOCK_LEN && KV_Q4_0_BLOCK_BYTES == 2 + KV_Q4_0_BLOCK_LEN / 2,
              "k_q8_0 / k_q4_0 read block pairs as aligned words: an f16 scale then the codes");
// code word i (bytes 4i .. 4i + 3) of a block whose codes start at p, 4-byte aligned or (HALF) 2 bytes past
template <bool HALF>
__device__ __forceinline__ u32 code_word(const u8* p, int i) {
  if (!HALF) return lds32(p + 4 * i);
  const u8* a = p - 2 + 4 * i;
  return (lds32(a) >> 16) | (lds32(a + 4) << 16);
}
// the loops over a block's words stay (mostly) rolled: unrolled, the compiler hoists every q load of
// the block and runs out of registers
template <int G, bool HALF>
__device__ __forceinline__ void k_q8_block(const u8* codes, float d, const QView<G>& q, int e, float (&sc)[G]) {
  float t[G];
#pragma unroll
  for (int g = 0; g < G; ++g) t[g] = 0.0f;
#pragma unroll 2
  for (int i = 0; i < 8; ++i) {
    const u32 w = code_word<HALF>(codes, i) ^ 0x80808080u;  // signed byte + 128
    const float x[4] = {byte_f(w, 0, 8388736.0f), byte_f(w, 1, 8388736.0f), byte_f(w, 2, 8388736.0f),
                        byte_f(w, 3, 8388736.0f)};
    dot4(q, e + 4 * i, x, t);
  }
#pragma unroll
  for (int g = 0; g < G; ++g) sc[g] += t[g] * d;
}
template <int G>
__device__ __forceinline__ void k_q8_0(const u8* row, const QView<G>& q, int D, float (&sc)[G]) {
  const int nb = D >> 5;
#pragma unroll 1
  for (int b = 0; b < nb; b += 2) {
    const u8* p = row + 2 * KV_Q8_0_BLOCK_BYTES * (b >> 1);
    k_q8_block<G, true>(p + 2, lo16_f16(lds32(p)), q, 32 * b, sc);
    if (b + 1 < nb) k_q8_block<G, false>(p + KV_Q8_0_BLOCK_BYTES + 2, hi16_f16(lds32(p + 32)), q, 32 * (b + 1), sc);
  }
}

// q4_0: 18-byte blocks, a pair is 9 aligned words (scale, 16 code bytes; scale, 16 code bytes): block b's
// codes from the high half of word 0 to the low half of word 4, block b+1's scale in the high half of word 4
// and its codes in words 5..8. Value j in the low nibble of byte j, value j + 16 in its high nibble.
template <int G, bool HALF>
__device__ __forceinline__ void k_q4_block(const u8* codes, float d, const QView<G>& q, int e, float (&sc)[G]) {
  float t[G];
#pragma unroll
  for (int g = 0; g < G; ++g) t[g] = 0.0f;
#pragma unroll 1
  for (int i = 0; i < 4; ++i) {
    const u32 c = code_word<HALF>(codes, i);
    const u32 lo = c & 0x0f0f0f0fu, hi = (c >> 4) & 0x0f0f0f0fu;
    const float xl[4] = {byte_f(lo, 0, 8388616.0f), byte_f(lo, 1, 8388616.0f), byte_f(lo, 2, 8388616.0f),
                         byte_f(lo, 3, 8388616.0f)};
    const float xh[4] = {byte_f(hi, 0, 8388616.0f), byte_f(hi, 1, 8388616.0f), byte_f(hi, 2, 8388616.0f),
                         byte_f(hi, 3, 8388616.0f)};
    dot4(q, e + 4 * i, xl, t);
    dot4(q, e + 16 + 4 * i, xh, t);
  }
#pragma unroll
  for (int g = 0; g < G; ++g) sc[g] += t[g] * d;
}
template <int G>
__device__ __forceinline__ void k_q4_0(const u8* row, const QView<G>& q, int D, float (&sc)[G]) {
  const int nb = D >> 5;
#pragma unroll 1
  for (int b = 0; b < nb; b += 2) {
    const u8* p = row + 2 * KV_Q4_0_BLOCK_BYTES * (b >> 1);
    k_q4_block<G, true>(p + 2, lo16_f16(lds32(p)), q, 32 * b, sc);
    if (b + 1 < nb) k_q4_block<G, false>(p + KV_Q4_0_BLOCK_BYTES + 2, hi16_f16(lds32(p + 16)), q, 32 * (b + 1), sc);
  }
}

// fp8_e4m3: four codes per word, products taken at 2^-120 scale (f32 subnormal codes stay exact; a product
// that underflows loses at most 2^-149 * 2^120 = 2^-29 of the score), rescaled once; a NaN code makes the
// score NaN as deq's would. Row 4-byte aligned (staged).
template <int G>
__device__ __forceinline__ void k_fp8_e4m3(const u8* row, const QView<G>& q, int D, float (&sc)[G]) {
  float t[G];
#pragma unroll
  for (int g = 0; g < G; ++g) t[g] = 0.0f;
  u32 nan = 0;
  const int D4 = D & ~3;
#pragma unroll 1
  for (int e = 0; e < D4; e += 4) {
    const u32 w = lds32(row + e);
    nan |= e4m3_nan(w);
    const float x[4] = {e4m3_scaled(w, 0), e4m3_scaled(w, 1), e4m3_scaled(w, 2), e4m3_scaled(w, 3)};
    dot4(q, e, x, t);
  }
#pragma unroll
  for (int g = 0; g < G; ++g) sc[g] += nan ? kv_nan() : t[g] * KV_2P120;
  k_generic<G, KV_FP8_E4M3>(row, q, D4, D, sc);
}

// f16: two values per word (the row is 4-byte aligned when D is even: staged, or straight from the pool)
template <int G>
__device__ __forceinline__ void k_f16(const u8* row, const QView<G>& q, int D, float (&sc)[G]) {
  const int D4 = (D & 1) ? 0 : D & ~3;
#pragma unroll 1
  for (int e = 0; e < D4; e += 4) {
    const u32 a = lds32(row + 2 * e), b = lds32(row + 2 * e + 4);
    const float x[4] = {lo16_f16(a), hi16_f16(a), lo16_f16(b), hi16_f16(b)};
    dot4(q, e, x, sc);
  }
  k_generic<G, KV_F16>(row, q, D4, D, sc);
}

// f32: float4 loads for a row read straight from the pool when 16-byte aligned, words otherwise (staged)
template <int G>
__device__ __forceinline__ void k_f32(const u8* row, const QView<G>& q, int D, bool vec, float (&sc)[G]) {
  const int D4 = D & ~3;
#pragma unroll 1
  for (int e = 0; e < D4; e += 4) {
    float x[4];
    if (vec) {
      kv_check_aligned(row + 4 * e, 16);
      const float4 v = *reinterpret_cast<const float4*>(row + 4 * e);
      x[0] = v.x, x[1] = v.y, x[2] = v.z, x[3] = v.w;
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) x[i] = kv_u32_as_f32(lds32(row + 4 * (e + i)));
    }
    dot4(q, e, x, sc);
  }
  k_generic<G, KV_F32>(row, q, D4, D, sc);
}

template <int G>
__device__ __forceinline__ void k_scores_g(int fmt, const u8* row, bool staged, const QView<G>& q, int D,
                                           float (&sc)[G]) {
#pragma unroll
  for (int g = 0; g < G; ++g) sc[g] = 0.0f;
  switch (fmt) {
    case KV_Q8_0: k_q8_0(row, q, D, sc); return;
    case KV_Q4_0: k_q4_0(row, q, D, sc); return;
    case KV_FP8_E4M3: k_fp8_e4m3(row, q, D, sc); return;
    case KV_F16: k_f16(row, q, D, sc); return;
    case KV_F32: k_f32(row, q, D, !staged && (D & 3) == 0, sc); return;
    default: break;
  }
#define KV_KGEN(F) k_generic<G, F>(row, q, 0, D, sc); return
  KV_DISPATCH(fmt, KV_KGEN)
#undef KV_KGEN
}
// eight heads take two passes of four over the row: one pass would hold twice the q values in flight, more
// than the registers left beside the accumulators
template <int G>
__device__ __forceinline__ void k_scores(int fmt, const u8* row, bool staged, const QView<G>& q, int D,
                                         float (&sc)[G]) {
  if constexpr (G <= 4) {
    k_scores_g<G>(fmt, row, staged, q, D, sc);
  } else {
#pragma unroll
    for (int h = 0; h < G; h += 4) {
      float s4[4];
      k_scores_g<4>(fmt, row, staged, QView<4>{q.q + h * q.Dq, q.Dq}, D, s4);
#pragma unroll
      for (int g = 0; g < 4; ++g) sc[h + g] = s4[g];
    }
  }
}

// scores of token u of a per-channel K page (hp: the page of the KV head) against the G heads, value by value:
// the channel's scale and minimum are the page's, so a row alone cannot be staged and scored as the others
template <int G>
__device__ __forceinline__ void k_kpage(const u8* hp, int u, int bits, const QView<G>& q, int D, int bs,
                                        float (&sc)[G]) {
#pragma unroll
  for (int g = 0; g < G; ++g) sc[g] = 0.0f;
#pragma unroll 1
  for (int e = 0; e < D; ++e) {
    const float x = kpage_value(hp, u, e, D, bs, bits);
#pragma unroll
    for (int g = 0; g < G; ++g) sc[g] += q.at(g, e) * x;
  }
}

// V values e0 .. e0 + VW - 1 of a row (e0 a multiple of VW, VW in 1, 2, 4, all < D): one or two loads per
// lane for the specialized formats, the block scale applied once per load
template <int F, int VW>
__device__ __forceinline__ void v_vals(const u8* row, int e0, float* x) {
  if (F == KV_Q8_0 || F == KV_Q4_0) {
    const bool q8 = F == KV_Q8_0;
    const u8* b = row + (e0 >> 5) * (q8 ? KV_Q8_0_BLOCK_BYTES : KV_Q4_0_BLOCK_BYTES);
    const float d = ldf16(b);
    const int o = e0 & 31;
    const u8* c = b + 2 + (q8 ? o : (o & 15));  // even for VW >= 2: blocks and rows are even-sized
    const u32 w = VW == 4 ? ld32_2(c) : VW == 2 ? (u32)ld16(c) : (u32)c[0];
    if (q8) {
#pragma unroll
      for (int i = 0; i < VW; ++i) x[i] = byte_f(w ^ 0x80808080u, i, 8388736.0f) * d;
    } else {  // values o .. o + VW - 1: all low or all high nibbles of consecutive bytes
      const u32 n = (w >> (4 * (o >> 4))) & 0x0f0f0f0fu;
#pragma unroll
      for (int i = 0; i < VW; ++i) x[i] = byte_f(n, i, 8388616.0f) * d;
    }
  } else if (F == KV_FP8_E4M3) {
    const u8* c = row + e0;
    const u32 w = VW == 4 ? ld32_2(c) : VW == 2 ? (u32)ld16(c) : (u32)c[0];  // bytes past VW are 0: not NaN
#pragma unroll
    for (int i = 0; i < VW; ++i) x[i] = e4m3_scaled(w, i) * KV_2P120;
    if (e4m3_nan(w)) {
#pragma unroll
      for (int i = 0; i < VW; ++i) x[i] = deq<F>(row, e0 + i);
    }
  } else if (F == KV_F16 && VW > 1) {
#pragma unroll
    for (int i = 0; i < VW; i += 2) {
      const u32 w = lds32(row + 2 * (e0 + i));
      x[i] = lo16_f16(w);
      x[i + 1] = hi16_f16(w);
    }
  } else if (F == KV_F32) {
#pragma unroll
    for (int i = 0; i < VW; ++i) x[i] = kv_u32_as_f32(lds32(row + 4 * (e0 + i)));
  } else {
#pragma unroll
    for (int i = 0; i < VW; ++i) x[i] = deq<F>(row, e0 + i);
  }
}

// the lane's V elements: group k of VW consecutive values at e = 32 VW k + VW lane (block formats: inside one
// 32-value block, as D is a multiple of 32 for them)
template <int C>
__device__ __forceinline__ int v_elem(int lane, int c) {
  constexpr int VW = C < 4 ? C : 4;
  return (c / VW) * 32 * VW + lane * VW + c % VW;
}

// acc[g][c] += p_j[g] * V_j[c] over the tile's tokens; p in ps[g][32] (0 past nt), V row offsets in rv[32]
// (clamped to a visible token past nt, so every load is in bounds); f16 needs an even D (4-byte aligned
// rows), as every block format's V groups lie in one block
template <int G, int C, int F>
__device__ __forceinline__ void v_accum(const u8* vpool, const i64* rv, const float* ps, int nt, int lane, int D,
                                        float (&acc)[G][C]) {
  constexpr int VW = C < 4 ? C : 4;
  // tokens per step (their loads in flight together): 2 for the specialized formats, 1 for deq's; more do not
  // fit in registers beside the accumulators
  constexpr int VJ = (F == KV_Q8_0 || F == KV_Q4_0 || F == KV_FP8_E4M3 || F == KV_F16 || F == KV_F32) ? 2 : 1;
  // D a multiple of VW (always for block formats): a lane's groups are wholly inside or outside the row, and a
  // group past D reads group 0 instead (in bounds; its sums are never written), so no branch per token
  const bool fast = D % VW == 0;
  for (int j0 = 0; j0 < nt; j0 += VJ) {
#pragma unroll
    for (int jj = 0; jj < VJ; ++jj) {
      const u8* row = vpool + rv[j0 + jj];
      float x[C];
#pragma unroll
      for (int k = 0; k < C / VW; ++k) {
        const int e0 = k * 32 * VW + lane * VW;
        if (fast) {
          v_vals<F, VW>(row, e0 < D ? e0 : 0, x + k * VW);
        } else {
#pragma unroll
          for (int i = 0; i < VW; ++i) x[k * VW + i] = e0 + i < D ? deq<F>(row, e0 + i) : 0.0f;
        }
      }
#pragma unroll
      for (int g = 0; g < G; ++g) {
        const float p = ps[32 * g + j0 + jj];
#pragma unroll
        for (int c = 0; c < C; ++c) acc[g][c] += p * x[c];
      }
    }
  }
}

// copy the tile's nt K rows (offsets rk) to rows of S words at dst, unit bytes at a time (16, 8 or 4 when the row
// size allows, else 2 or 1), consecutive lanes on consecutive units of a run of consecutive rows, four loads in flight
// per lane; unit i of a run is unit i - j W of its row j = i / W (a multiply-high, div_w)
template <int U>
struct Unit;
template <>
struct Unit<1> {
  typedef u8 T;
};
template <>
struct Unit<2> {
  typedef u16 T;
};
template <>
struct Unit<4> {
  typedef u32 T;
};
template <>
struct Unit<8> {
  typedef uint2 T;
};
template <>
struct Unit<16> {
  typedef uint4 T;
};
// i / W for 0 <= i <= 32 W, W <= 4 * KV_DEC_STAGE_MAX: the high word of i * ceil(2^32 / W), exact as i * (the
// rounding error of M, < W) stays below 2^32
__device__ __forceinline__ int div_w(int i, u32 M, int W) {
  return W == 1 ? i : (int)(((unsigned long long)(u32)i * M) >> 32);
}
// a unit into a staged row (4-byte aligned: 8-byte units as two words)
template <class T>
__device__ __forceinline__ void put_unit(u8* p, T v) {
  *reinterpret_cast<T*>(p) = v;
}
__device__ __forceinline__ void put_unit(u8* p, uint2 v) {
  kv_check_aligned(p, 4);
  reinterpret_cast<u32*>(p)[0] = v.x;
  reinterpret_cast<u32*>(p)[1] = v.y;
}
__device__ __forceinline__ void put_unit(u8* p, uint4 v) {  // 16-byte loads, stored as four words
  kv_check_aligned(p, 4);
  reinterpret_cast<u32*>(p)[0] = v.x;
  reinterpret_cast<u32*>(p)[1] = v.y;
  reinterpret_cast<u32*>(p)[2] = v.z;
  reinterpret_cast<u32*>(p)[3] = v.w;
}
template <int U>
__device__ __forceinline__ void stage_units(const u8* src0, u8* dst, int S, int W, int total, int lane) {
  typedef typename Unit<U>::T T;
  const T* run = reinterpret_cast<const T*>(src0);
  const u32 M = 0xffffffffu / (u32)W + 1u;  // ceil(2^32 / W) for W > 1
  const int C1 = 4 * S - U * W;              // unit i of row j = i / W lands at byte j C1 + U i
  int i0 = 0;
  for (; i0 + 128 <= total; i0 += 128) {
    T v[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      kv_check_aligned(run + i0 + 32 * u + lane, U);
      v[u] = run[i0 + 32 * u + lane];
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int i = i0 + 32 * u + lane;
      put_unit(dst + div_w(i, M, W) * C1 + U * i, v[u]);
    }
  }
  for (int i = i0 + lane; i < total; i += 32) {
    kv_check_aligned(run + i, U);
    put_unit(dst + div_w(i, M, W) * C1 + U * i, run[i]);
  }
}
// the tile's rows in runs of consecutive rows (one per page it touches: rows of one head are contiguous within a
// page), each copied as one contiguous source
template <int U>
__device__ __forceinline__ void stage_rows(const u8* kpool, const i64* rk, u8* dst, int S, int krb, int nt, int t0,
                                           int bs, int lane) {
  const int W = krb / U;
  for (int ja = 0; ja < nt;) {
    const int jb = min(nt, ja + bs - (t0 + ja) % bs);
    stage_units<U>(kpool + rk[ja], dst + 4 * S * ja, S, W, (jb - ja) * W, lane);
    ja = jb;
  }
}

template <int G, int C>
__device__ __forceinline__ void v_dispatch(int fmt, const u8* vpool, const i64* rv, const float* ps, int nt, int lane,
                                           int D, float (&acc)[G][C]) {
#define KV_VACC(F) v_accum<G, C, F>(vpool, rv, ps, nt, lane, D, acc); return
  KV_DISPATCH(fmt, KV_VACC)
#undef KV_VACC
}

// G query heads (h0 .. h0 + G - 1, one KV head's) of one decode row and split. Shared memory
// (plan.decode_smem_bytes): q [G][Dq] | per warp: p [G][32], K and V row offsets [32] each, staged K rows
// [32][S words] (S odd: lane j reading word i of row j hits bank (jS + i) mod 32, all distinct; none when
// the rows exceed KV_DEC_STAGE_MAX and lanes read them from the pool); the warp merge [KV_NW][G][D + 2]
// reuses it from offset 0 after a barrier.
// noinline, one function per G: inlined into one kernel, ptxas allocates registers over the four variants together
// and spills where each alone fits; the call costs nothing once per CTA (arguments in registers, no stack)
template <int G, int C>
__device__ __noinline__ void decode_heads(const AttnArgs a, float* smem, int tstride, int range_off, int dec_off,
                                             int R, int Hq, int Hkv, int D, int bs, int krb, int vrb, int kfmt,
                                             int vfmt, float scale, int split_pages, int n_splits) {
  const int w = blockIdx.x, h0 = blockIdx.y * G, p = blockIdx.z;
  const int r = a.meta[dec_off + 2 * w + 1];  // the sequence, meta[dec_off + 2 w], is read per tile
  const int lo = a.meta[range_off + r], hi = a.meta[range_off + R + r];
  const int a0 = max(lo, p * split_pages * bs), b0 = min(hi, (p + 1) * split_pages * bs);
  {
    const int Dq = (D + 3) & ~3;
    for (int i = threadIdx.x; i < G * Dq; i += blockDim.x) {
      const int g = i / Dq, e = i - g * Dq;
      smem[i] = e < D ? a.q[((i64)r * Hq + h0 + g) * D + e] * scale : 0.0f;
    }
  }
  // head g's running max and sum live in lane g (registers are what the K and V loops need)
  float acc[G][C], ml = kv_neg_inf(), ll = 0.0f;
#pragma unroll
  for (int g = 0; g < G; ++g) {
#pragma unroll
    for (int c = 0; c < C; ++c) acc[g][c] = 0.0f;
  }
  __syncthreads();

  for (int t0 = a0 + 32 * (int)(threadIdx.x >> 5); t0 < b0; t0 += 32 * KV_NW) {
    const int nt = min(32, b0 - t0);  // >= 1, and every token of [t0, t0 + nt) is visible to row r
    // Everything below that does not change over the loop is rederived per tile from opaque sources (kv_lane and
    // co., platform.h; a few instructions per 32 tokens): hoisted for every format's path, it would not fit in
    // registers beside the accumulators.
    const int lane = kv_lane(), warp = kv_tid_x() >> 5, kb = kv_opaque(krb);
    const int Dq = (kv_opaque(D) + 3) & ~3;
    const bool kpaged = (kfmt & KV_KPAGED) != 0;  // per-channel K pages are scored from the pool (k_kpage)
    const bool staged = !kpaged && kb <= KV_DEC_STAGE_MAX;
    const int S = staged ? ((kb + 3) >> 2) | 1 : 0;
    const int hk = kv_ctaid_y() * G / (Hq / Hkv);
    const int* trow = a.meta + (i64)a.meta[dec_off + 2 * kv_ctaid_x()] * tstride;
    float* ps = smem + G * Dq + warp * (G * 32 + 128 + 32 * S);  // see above: q | per warp p, rk, rv, K rows
    i64* rk = reinterpret_cast<i64*>(ps + G * 32);
    i64* rv = rk + 32;
    u8* ks = reinterpret_cast<u8*>(rv + 32);
    const QView<G> qv{smem, Dq};
    {  // lane j: token t0 + j's row, clamped to the tile's last token
      const int t = t0 + min(lane, nt - 1), page = t / bs;
      const i64 row = ((i64)trow[page] * Hkv + hk) * bs + (t - page * bs);
      rk[lane] = row * (i64)(u32)krb;  // zero-extended: no register for a sign word
      rv[lane] = row * (i64)(u32)vrb;
    }
    kv_syncwarp();
    const u8* krow;
    if (staged) {
      if ((kb & 15) == 0)  // rows of 16-byte multiples (fp8, q4_1, f16/bf16 at head_dim 128): 16 bytes per lane load
        stage_rows<16>(a.kpool, rk, ks, S, kb, nt, t0, bs, lane);
      else if ((kb & 7) == 0)
        stage_rows<8>(a.kpool, rk, ks, S, kb, nt, t0, bs, lane);
      else if ((kb & 3) == 0)
        stage_rows<4>(a.kpool, rk, ks, S, kb, nt, t0, bs, lane);
      else if ((kb & 1) == 0)
        stage_rows<2>(a.kpool, rk, ks, S, kb, nt, t0, bs, lane);
      else
        stage_rows<1>(a.kpool, rk, ks, S, kb, nt, t0, bs, lane);
      kv_syncwarp();
      krow = ks + 4 * S * min(lane, nt - 1);
    } else {
      krow = a.kpool + rk[lane];
    }
    float sc[G];
    if (kpaged) {
      const int u = (t0 + min(lane, nt - 1)) % bs;  // rk[lane] is row u of its page's head: the head starts u rows back
      k_kpage<G>(a.kpool + rk[lane] - (i64)u * kb, u, kpage_bits(kfmt), qv, D, bs, sc);
    } else {
      k_scores<G>(kfmt, krow, staged, qv, D, sc);
    }
#pragma unroll
    for (int g = 0; g < G; ++g) {
      if (lane >= nt) sc[g] = kv_neg_inf();
      const float m = kv_shfl(ml, g);
      const float mn = kv_max(m, warp_max(sc[g]));
      const float alpha = expf(m - mn);  // m = -inf on the first tile: 0
      const float pr = expf(sc[g] - mn);  // lane j: token j's weight under the head's new running max
      const float l = kv_shfl(ll, g) * alpha + warp_sum(pr);
#pragma unroll
      for (int c = 0; c < C; ++c) acc[g][c] *= alpha;
      if (lane == g) ml = mn, ll = l;
      ps[32 * g + lane] = pr;
    }
    kv_syncwarp();
    v_dispatch<G, C>(vfmt, a.vpool, rv, ps, nt, lane, D, acc);
    kv_syncwarp();  // every lane is done with rk, rv, ps and the staged rows before the next tile
  }

  // merge the warps: smem [KV_NW][G][D + 2] = acc, m, l
  __syncthreads();  // the merge area overlaps the tile buffers
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int g = 0; g < G; ++g) {
    float* mine = smem + (warp * G + g) * (D + 2);
#pragma unroll
    for (int c = 0; c < C; ++c) {
      const int e = v_elem<C>(lane, c);
      if (e < D) mine[e] = acc[g][c];
    }
    if (lane == g) {
      mine[D] = ml;
      mine[D + 1] = ll;
    }
  }
  __syncthreads();
  for (int g = 0; g < G; ++g) {
    float M = kv_neg_inf();
    for (int u = 0; u < KV_NW; ++u) M = kv_max(M, smem[(u * G + g) * (D + 2) + D]);
    float L = 0.0f;
    for (int u = 0; u < KV_NW; ++u) {
      const float mu = smem[(u * G + g) * (D + 2) + D];
      if (mu != kv_neg_inf()) L += smem[(u * G + g) * (D + 2) + D + 1] * expf(mu - M);
    }
    for (int e = threadIdx.x; e < D; e += blockDim.x) {
      float o = 0.0f;
      for (int u = 0; u < KV_NW; ++u) {
        const float mu = smem[(u * G + g) * (D + 2) + D];
        if (mu != kv_neg_inf()) o += smem[(u * G + g) * (D + 2) + e] * expf(mu - M);
      }
      // false only for a split past this row's visible range (L >= 1 otherwise); a NaN score makes L NaN,
      // and the output NaN as float64 attention's
      const bool any = L != 0.0f;
      emit(a, R, Hq, D, n_splits, p, r, h0 + g, e, any ? o / L : 0.0f, any ? M + logf(L) : kv_neg_inf(), e == 0);
    }
  }
}

// Decode: one CTA per (query row, group of G query heads of one KV head, split); its warps take interleaved
// 32-token tiles (decode_heads: K staged and scored lanes over tokens, V lanes over head_dim), each row read
// once for the G heads, and merge their softmax states at the end. grid (n_decode, Hq / G, n_splits), block
// KV_NW * 32, dynamic smem plan.decode_smem_bytes(D, G, k_row_bytes); G = plan.decode_group(): 8, 4 or 2 with
// G * ceil(D / 32) <= 16, else 1.
extern "C" __global__ void __launch_bounds__(KV_NW * 32, 4)
    kvhal_attn_decode(const float* __restrict__ q, const u8* __restrict__ kpool, const u8* __restrict__ vpool,
                      const int* __restrict__ meta, float* __restrict__ out, float* __restrict__ part_o,
                      float* __restrict__ part_lse, int tstride, int range_off, int dec_off, int R, int Hq, int Hkv,
                      int D, int bs, int krb, int vrb, int kfmt, int vfmt, float scale, int split_pages,
                      int n_splits, int G) {
  KV_DYNAMIC_SMEM(float, smem);
  const AttnArgs a{q, kpool, vpool, meta, out, part_o, part_lse};
#define KV_DECODE(GG, CC)                                                                                          \
  decode_heads<GG, CC>(a, smem, tstride, range_off, dec_off, R, Hq, Hkv, D, bs, krb, vrb, kfmt, vfmt, scale,       \
                       split_pages, n_splits)
  switch (G) {
    case 8: KV_DECODE(8, 2); break;
    case 4: KV_DECODE(4, 4); break;
    case 2: KV_DECODE(2, 8); break;
    default: KV_DECODE(1, KV_MAXC); break;
  }
#undef KV_DECODE
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
      ks[j * kst + e] = k_value(kfmt, kpool, trow, t0 + j, hk, Hkv, bs, krb, D, e);
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
    const bool any = l[u] != 0.0f;  // 0: nothing visible in this split; NaN (a NaN score) stays NaN
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
  for (int p = 0; p < n_splits; ++p) M = kv_max(M, part_lse[p * stride + rh]);
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
    out[rh * D + e] = wsum != 0.0f ? o / wsum : 0.0f;  // a NaN split (NaN score) gives NaN
  }
}
