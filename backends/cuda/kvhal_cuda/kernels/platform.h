// The only place where CUDA, HIP and the CPU emulator (backends/cuda/tests/emu) differ.
//
// kvhal.cu is written for groups of 32 lanes ("warps"). On wave64 AMD GPUs (gfx90a, gfx908) a
// wavefront holds two such groups, so every shuffle passes width 32 and never crosses a group.
// Quantization must be bit-exact with numpy: kv_fmul_rn & co. are never contracted into FMAs, and
// f16 conversion is the hardware's round-to-nearest-even with subnormals kept (no -ftz).
#pragma once

#if defined(KVHAL_EMULATE)
// the emulator defines the primitives below before it includes kvhal.cu

#elif defined(__HIPCC__) || defined(__HIP_PLATFORM_AMD__) || defined(__HIPCC_RTC__)
#ifndef __HIPCC_RTC__
#include <hip/hip_runtime.h>
#endif
#define KV_DYNAMIC_SMEM(T, name) extern __shared__ T name[]

__device__ __forceinline__ float kv_shfl(float v, int src) { return __shfl(v, src, 32); }
__device__ __forceinline__ int kv_shfl(int v, int src) { return __shfl(v, src, 32); }
__device__ __forceinline__ float kv_shfl_xor(float v, int m) { return __shfl_xor(v, m, 32); }
__device__ __forceinline__ int kv_shfl_xor(int v, int m) { return __shfl_xor(v, m, 32); }
// orders the lanes' shared-memory writes before reads of other lanes of the group: a wavefront runs in
// lockstep and its LDS operations complete in order, so a compiler barrier with a wavefront fence suffices
__device__ __forceinline__ void kv_syncwarp() {
  __builtin_amdgcn_fence(__ATOMIC_RELEASE, "wavefront");
  __builtin_amdgcn_wave_barrier();
  __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "wavefront");
}
__device__ __forceinline__ int kv_lane() { return (int)(threadIdx.x & 31); }
__device__ __forceinline__ int kv_opaque(int x) { return x; }
__device__ __forceinline__ int kv_tid_x() { return (int)threadIdx.x; }
__device__ __forceinline__ int kv_ctaid_x() { return (int)blockIdx.x; }
__device__ __forceinline__ int kv_ctaid_y() { return (int)blockIdx.y; }
__device__ __forceinline__ unsigned int kv_prmt(unsigned int x, unsigned int y, unsigned int s) {
  return __byte_perm(x, y, s);
}

// hip-clang contracts a*b+c across inlined calls unless told not to (-ffp-contract=fast-honor-pragmas)
__device__ __forceinline__ float kv_fmul_rn(float a, float b) {
#pragma clang fp contract(off)
  return a * b;
}
__device__ __forceinline__ float kv_fadd_rn(float a, float b) {
#pragma clang fp contract(off)
  return a + b;
}
__device__ __forceinline__ float kv_fsub_rn(float a, float b) {
#pragma clang fp contract(off)
  return a - b;
}
__device__ __forceinline__ float kv_fdiv_rn(float a, float b) {
#pragma clang fp contract(off)
  return a / b;  // correctly rounded: hipcc's default -fhip-fp32-correctly-rounded-divide-sqrt
}
__device__ __forceinline__ unsigned short kv_f32_to_f16(float f) {
  return __builtin_bit_cast(unsigned short, static_cast<_Float16>(f));
}
__device__ __forceinline__ float kv_f16_to_f32(unsigned short h) {
  return static_cast<float>(__builtin_bit_cast(_Float16, h));
}
__device__ __forceinline__ float kv_u32_as_f32(unsigned int u) { return __builtin_bit_cast(float, u); }
__device__ __forceinline__ unsigned int kv_f32_as_u32(float f) { return __builtin_bit_cast(unsigned int, f); }
__device__ __forceinline__ void kv_check_aligned(const void*, unsigned) {}  // the emulator checks

#else  // CUDA (nvcc or NVRTC); no header needed
#define KV_DYNAMIC_SMEM(T, name) extern __shared__ T name[]

__device__ __forceinline__ float kv_shfl(float v, int src) { return __shfl_sync(0xffffffffu, v, src, 32); }
__device__ __forceinline__ int kv_shfl(int v, int src) { return __shfl_sync(0xffffffffu, v, src, 32); }
__device__ __forceinline__ float kv_shfl_xor(float v, int m) { return __shfl_xor_sync(0xffffffffu, v, m, 32); }
__device__ __forceinline__ int kv_shfl_xor(int v, int m) { return __shfl_xor_sync(0xffffffffu, v, m, 32); }
__device__ __forceinline__ void kv_syncwarp() { __syncwarp(); }  // all 32 lanes of the warp must reach it
// byte i of the result is byte (s >> 4i) & 7 of {y, x} (x the low four); one PRMT instruction
__device__ __forceinline__ unsigned int kv_prmt(unsigned int x, unsigned int y, unsigned int s) {
  return __byte_perm(x, y, s);
}
// the lane index, a copy of x, threadIdx.x, blockIdx.x / .y, opaque to the optimizer (volatile): values derived
// from them inside a loop are recomputed there rather than hoisted and kept in registers (or spilled) across it
__device__ __forceinline__ int kv_lane() {
  int l;
  asm volatile("mov.u32 %0, %%laneid;" : "=r"(l));
  return l;
}
__device__ __forceinline__ int kv_opaque(int x) {
  int r;
  asm volatile("mov.b32 %0, %1;" : "=r"(r) : "r"(x));
  return r;
}
__device__ __forceinline__ int kv_tid_x() {
  int r;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(r));
  return r;
}
__device__ __forceinline__ int kv_ctaid_x() {
  int r;
  asm volatile("mov.u32 %0, %%ctaid.x;" : "=r"(r));
  return r;
}
__device__ __forceinline__ int kv_ctaid_y() {
  int r;
  asm volatile("mov.u32 %0, %%ctaid.y;" : "=r"(r));
  return r;
}

__device__ __forceinline__ float kv_fmul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ float kv_fadd_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ float kv_fsub_rn(float a, float b) { return __fsub_rn(a, b); }
__device__ __forceinline__ float kv_fdiv_rn(float a, float b) { return __fdiv_rn(a, b); }
__device__ __forceinline__ unsigned short kv_f32_to_f16(float f) {
  unsigned short h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}
__device__ __forceinline__ float kv_f16_to_f32(unsigned short h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}
__device__ __forceinline__ float kv_u32_as_f32(unsigned int u) { return __uint_as_float(u); }
__device__ __forceinline__ unsigned int kv_f32_as_u32(float f) { return __float_as_uint(f); }
__device__ __forceinline__ void kv_check_aligned(const void*, unsigned) {}  // the emulator checks
#endif
