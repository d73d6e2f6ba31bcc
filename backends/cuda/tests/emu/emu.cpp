// A small SIMT emulator that runs kernels/kvhal.cu on the CPU, for the tests on machines without a GPU.
// It includes "kvhal.cu" as kvhal_cuda.source.kernel_source() writes it (constants generated, platform.h
// inlined, which adds nothing under KVHAL_EMULATE).
//
// Every GPU thread is a fiber (ucontext); one CTA runs at a time. Shuffles, kv_syncwarp and __syncthreads
// are the only points where fibers switch, so warp-synchronous code runs as on hardware. The emulator is
// strict where CUDA is undefined: a shuffle that not all 32 lanes of a warp reach, or a barrier that
// lanes of one warp reach while others wait on a shuffle, is an error, not a silent result.
#include <ucontext.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#define KVHAL_EMULATE 1
#define __global__
#define __device__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)

struct emu_dim3 {
  unsigned x = 0, y = 0, z = 0;
};
static emu_dim3 threadIdx, blockIdx, blockDim, gridDim;

namespace emu {
enum State { READY, WAIT_WARP, WAIT_CTA, DONE };
struct Fiber {
  ucontext_t ctx;
  State state = READY;
  unsigned shuffles = 0;  // parity picks the exchange buffer
};
static ucontext_t sched_ctx;
static std::vector<Fiber> fibers;
static std::vector<char> stacks;
static std::vector<uint32_t> xbuf;  // [warp][2][32]
static std::vector<char> smem_buf;
static int cur = -1;
static std::function<void()> body;
static std::string error;
static std::string fault;  // the first misaligned access of a launch (a fault on the GPU)
constexpr size_t STACK = 64 * 1024;

static void entry() {
  body();
  fibers[cur].state = DONE;
  swapcontext(&fibers[cur].ctx, &sched_ctx);
}

static void block_on(State s) {
  fibers[cur].state = s;
  swapcontext(&fibers[cur].ctx, &sched_ctx);
}

static uint32_t exchange(uint32_t v, int src) {
  Fiber& f = fibers[cur];
  const int warp = cur / 32, lane = cur % 32;
  uint32_t* slot = &xbuf[(warp * 2 + (f.shuffles++ & 1)) * 32];
  slot[lane] = v;
  block_on(WAIT_WARP);
  return slot[src & 31];
}

// run one CTA to completion; false (with error set) on divergence or deadlock
static bool run_cta(int n) {
  for (int i = 0; i < n; ++i) {
    Fiber& f = fibers[i];
    f.state = READY;
    f.shuffles = 0;
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = stacks.data() + i * STACK;
    f.ctx.uc_stack.ss_size = STACK;
    f.ctx.uc_link = &sched_ctx;
    makecontext(&f.ctx, entry, 0);
  }
  for (;;) {
    for (int i = 0; i < n; ++i) {
      if (fibers[i].state != READY) continue;
      cur = i;
      threadIdx.x = i % blockDim.x;
      threadIdx.y = i / blockDim.x % blockDim.y;
      threadIdx.z = i / (blockDim.x * blockDim.y);
      swapcontext(&sched_ctx, &fibers[i].ctx);
    }
    bool done = true, released = false;
    int at_cta = 0, live = 0;
    for (int w = 0; w * 32 < n; ++w) {
      int waiting = 0, lanes = 0, finished = 0;
      for (int i = w * 32; i < n && i < w * 32 + 32; ++i) {
        ++lanes;
        waiting += fibers[i].state == WAIT_WARP;
        finished += fibers[i].state == DONE;
      }
      if (waiting && waiting != lanes) {
        if (waiting + finished == lanes) {
          error = "warp " + std::to_string(w) + ": a shuffle reached by " + std::to_string(waiting) + " of " +
                  std::to_string(lanes) + " lanes (the others exited)";
          return false;
        }
        continue;  // other lanes still running or at a CTA barrier: resolved below
      }
      if (waiting == lanes) {
        for (int i = w * 32; i < w * 32 + lanes; ++i) fibers[i].state = READY;
        released = true;
      }
    }
    for (int i = 0; i < n; ++i) {
      if (fibers[i].state != DONE) done = false, ++live;
      at_cta += fibers[i].state == WAIT_CTA;
    }
    if (done) return true;
    if (released) continue;
    if (at_cta == live) {  // threads that exited count as arrived, as on hardware
      for (int i = 0; i < n; ++i)
        if (fibers[i].state == WAIT_CTA) fibers[i].state = READY;
      continue;
    }
    error = "deadlock: lanes of a warp wait on a shuffle while others wait at __syncthreads";
    return false;
  }
}
}  // namespace emu

static inline void __syncthreads() { emu::block_on(emu::WAIT_CTA); }

static inline float kv_u32_as_f32(unsigned int u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
static inline unsigned int kv_f32_as_u32(float f) {
  unsigned int u;
  std::memcpy(&u, &f, 4);
  return u;
}
static inline float kv_shfl(float v, int src) { return kv_u32_as_f32(emu::exchange(kv_f32_as_u32(v), src)); }
static inline int kv_shfl(int v, int src) { return (int)emu::exchange((uint32_t)v, src); }
static inline float kv_shfl_xor(float v, int m) { return kv_shfl(v, (int)(threadIdx.x & 31) ^ m); }
static inline int kv_shfl_xor(int v, int m) { return kv_shfl(v, (int)(threadIdx.x & 31) ^ m); }
// __syncwarp: a warp-wide rendezvous, as strict as a shuffle (every lane of the warp must reach it)
static inline void kv_syncwarp() { (void)emu::exchange(0u, 0); }
static inline int kv_lane() { return (int)(threadIdx.x & 31); }
static inline int kv_opaque(int x) { return x; }
static inline int kv_tid_x() { return (int)threadIdx.x; }
static inline int kv_ctaid_x() { return (int)blockIdx.x; }
static inline int kv_ctaid_y() { return (int)blockIdx.y; }
// __byte_perm with the selector's low 3 bits per result byte (kvhal.cu sets no sign-replicate bit)
static inline unsigned int kv_prmt(unsigned int x, unsigned int y, unsigned int s) {
  const uint64_t b = (uint64_t)y << 32 | x;
  unsigned int r = 0;
  for (int i = 0; i < 4; ++i) r |= (unsigned int)((b >> (8 * ((s >> (4 * i)) & 7))) & 0xff) << (8 * i);
  return r;
}
struct alignas(16) float4 {
  float x, y, z, w;
};
struct alignas(8) uint2 {
  unsigned int x, y;
};
struct alignas(16) uint4 {
  unsigned int x, y, z, w;
};
// built with -ffp-contract=off: plain IEEE single-precision operations
static inline float kv_fmul_rn(float a, float b) { return a * b; }
static inline float kv_fadd_rn(float a, float b) { return a + b; }
static inline float kv_fsub_rn(float a, float b) { return a - b; }
static inline float kv_fdiv_rn(float a, float b) { return a / b; }
static inline unsigned short kv_f32_to_f16(float f) {
  _Float16 h = (_Float16)f;
  unsigned short u;
  std::memcpy(&u, &h, 2);
  return u;
}
static inline float kv_f16_to_f32(unsigned short u) {
  _Float16 h;
  std::memcpy(&h, &u, 2);
  return (float)h;
}
static inline void kv_check_aligned(const void* p, unsigned a) {
  if (reinterpret_cast<uintptr_t>(p) % a && emu::fault.empty())
    emu::fault = "misaligned " + std::to_string(a) + "-byte access (thread " + std::to_string(threadIdx.x) + ")";
}
using std::max;
using std::min;
#define KV_DYNAMIC_SMEM(T, name) T* name = reinterpret_cast<T*>(emu::smem_buf.data())

#include "kvhal.cu"

namespace {
using Thunk = std::function<void(void**)>;
template <class... A, size_t... I>
void call(void (*k)(A...), void** a, std::index_sequence<I...>) {
  k(*static_cast<A*>(a[I])...);
}
template <class... A>
Thunk make(void (*k)(A...)) {
  return [k](void** a) { call(k, a, std::index_sequence_for<A...>{}); };
}
const std::map<std::string, Thunk>& table() {
  static const std::map<std::string, Thunk> t = {
      {"kvhal_store_quant", make(kvhal_store_quant)},   {"kvhal_store_float", make(kvhal_store_float)},
      {"kvhal_load", make(kvhal_load)},                 {"kvhal_copy_gather", make(kvhal_copy_gather)},
      {"kvhal_copy_scatter", make(kvhal_copy_scatter)}, {"kvhal_attn_decode", make(kvhal_attn_decode)},
      {"kvhal_attn_prefill", make(kvhal_attn_prefill)}, {"kvhal_attn_merge", make(kvhal_attn_merge)},
      {"kvhal_blocks_gather", make(kvhal_blocks_gather)}, {"kvhal_blocks_scatter", make(kvhal_blocks_scatter)},
      {"kvhal_store_kpage", make(kvhal_store_kpage)},   {"kvhal_load_bf16", make(kvhal_load_bf16)},
  };
  return t;
}
}  // namespace

// cuLaunchKernel's shape: args[i] points at the i-th kernel parameter. Returns 0, or -1 with err set.
extern "C" int emu_launch(const char* name, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                          unsigned bz, size_t smem, void** args, char* err, size_t errlen) {
  auto it = table().find(name);
  if (it == table().end()) {
    std::snprintf(err, errlen, "no kernel named %s", name);
    return -1;
  }
  const int n = (int)(bx * by * bz);
  if (n <= 0 || n > 1024) {
    std::snprintf(err, errlen, "%s: block of %d threads (CUDA allows 1..1024)", name, n);
    return -1;
  }
  if (smem > 48 * 1024) {
    std::snprintf(err, errlen, "%s: %zu bytes of dynamic shared memory exceed the 48 KiB default", name, smem);
    return -1;
  }
  gridDim = {gx, gy, gz};
  blockDim = {bx, by, bz};
  emu::fibers.assign(n, emu::Fiber{});
  emu::stacks.resize((size_t)n * emu::STACK);
  emu::xbuf.assign((size_t)(n + 31) / 32 * 64, 0);
  emu::smem_buf.assign(smem + 16, (char)0xA5);  // garbage-filled, as shared memory starts
  emu::body = [&]() { it->second(args); };
  emu::fault.clear();
  for (unsigned z = 0; z < gz; ++z)
    for (unsigned y = 0; y < gy; ++y)
      for (unsigned x = 0; x < gx; ++x) {
        blockIdx = {x, y, z};
        if (!emu::run_cta(n) || !emu::fault.empty()) {
          const std::string& why = emu::fault.empty() ? emu::error : emu::fault;
          std::snprintf(err, errlen, "%s block (%u,%u,%u): %s", name, x, y, z, why.c_str());
          return -1;
        }
      }
  return 0;
}
