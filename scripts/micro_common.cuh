// Shared by the standalone microbenchmarks (scripts/ring_micro.cu, mem_micro.cu, l2_reuse_micro.cu,
// l2_home_micro.cu): the error check, the shared-space address of a pointer, the best-of-N CUDA-event timing of one
// launch, L2 cache policies, the GEMV's 16-byte weight load (with or without the evict-first hint) and its bf16 x
// fp32 work per chunk, the globaltimer, a grid barrier and the gate/up row-pair loop.
#pragma once
#include <cstdio>
#include <cstdint>
#include <cuda_runtime.h>

// In main() only: print the failing call and return 1.
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e)); return 1; } } while (0)

__device__ __forceinline__ uint32_t saddr(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }

// L2 cache policies (createpolicy, fraction 1.0).
__device__ __forceinline__ uint64_t evict_first() {
  uint64_t pol;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
  return pol;
}
__device__ __forceinline__ uint64_t evict_last() {
  uint64_t pol;
  asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(pol));
  return pol;
}
__device__ __forceinline__ uint64_t evict_normal() {
  uint64_t pol;
  asm volatile("createpolicy.fractional.L2::evict_normal.b64 %0, 1.0;" : "=l"(pol));
  return pol;
}

// One 16-byte weight load, non-coherent, no L1 allocation; hint: the L2 evict-first policy `pol` the megakernel's
// weight loads carry (AmkSrcGlobal).
__device__ __forceinline__ uint4 ldg_w(const void* p, uint64_t pol, bool hint) {
  uint4 v;
  if (hint)
    asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0,%1,%2,%3}, [%4], %5;"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p), "l"(pol));
  else
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

// sm_90 mbarrier + 1-D bulk copy (global -> shared) primitives; one thread uses them.
__device__ __forceinline__ void mbar_init(uint32_t bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(bar) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
// The caller's arrival, arming the current phase for `bytes` of copies.
__device__ __forceinline__ void mbar_expect(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes) : "memory");
}
// What a wait does between two unsuccessful looks (pipe_micro.cu's pump variants issue copies): nothing by default.
struct NoIdle {
  __device__ __forceinline__ void operator()() const {}
};
// (Gives up after 50 ms, so a bug cannot hang the GPU: the timings are then garbage.)
template <class Idle = NoIdle>
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity, Idle idle = {}) {
  uint64_t t0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  for (;;) {
    uint32_t ok;
    asm volatile("{\n .reg .pred q;\n mbarrier.try_wait.parity.shared::cta.b64 q, [%1], %2;\n selp.u32 %0, 1, 0, q;\n}"
                 : "=r"(ok) : "r"(bar), "r"(parity) : "memory");
    if (ok) return;
    idle();
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    if (t - t0 > 50000000ull) return;
  }
}
// hint: with the L2 policy `pol`.
__device__ __forceinline__ void bulk_g2s(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar, bool hint = false,
                                         uint64_t pol = 0) {
  if (hint)
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, "
                 "[%3], %4;" :: "r"(dst), "l"(src), "r"(bytes), "r"(bar), "l"(pol) : "memory");
  else
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}

// acc += the 8 bf16 weights of v times x[0..7] (fp32, shared memory), element by element: the GEMV loop's work.
__device__ __forceinline__ void fma_bf16x8(const uint4& v, const float* x, float& acc) {
  const float4 x0 = *(const float4*)x, x1 = *(const float4*)(x + 4);
  acc = fmaf(__uint_as_float(v.x << 16), x0.x, acc); acc = fmaf(__uint_as_float(v.x & 0xffff0000u), x0.y, acc);
  acc = fmaf(__uint_as_float(v.y << 16), x0.z, acc); acc = fmaf(__uint_as_float(v.y & 0xffff0000u), x0.w, acc);
  acc = fmaf(__uint_as_float(v.z << 16), x1.x, acc); acc = fmaf(__uint_as_float(v.z & 0xffff0000u), x1.y, acc);
  acc = fmaf(__uint_as_float(v.w << 16), x1.z, acc); acc = fmaf(__uint_as_float(v.w & 0xffff0000u), x1.w, acc);
}

// %globaltimer in ns.
__device__ __forceinline__ uint64_t gtime() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
// All blocks co-resident (one per SM: the launch asks for more than half of an SM's shared memory): a counting
// barrier on bar (zeroed before the launch).
__device__ __forceinline__ void grid_bar(unsigned* bar, unsigned n) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(bar, 1u);
    const uint64_t t0 = gtime();  // never hang: give up after 50 ms (the timings are then garbage)
    while (atomicAdd(bar, 0u) < n && gtime() - t0 < 50000000ull) __nanosleep(64);
  }
  __syncthreads();
}

// One warp's gate/up row pair as the megakernel's GEMV_SILU_MUL streams it: rows gr and ur of `row_bytes` bf16
// bytes, 4 x 16 B of each per lane in flight, x (fp32, shared memory) times the weights; returns gate . x * up . x
// (the lanes' partial sums, not reduced).
__device__ __forceinline__ float gate_up_pair(const char* gr, const char* ur, int row_bytes, const float* xs,
                                              int lane, uint64_t pol, bool hint) {
  float ag = 0.f, au = 0.f;
  for (int c = lane; c < row_bytes / 16; c += 32 * 4) {
    uint4 vg[4], vu[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      vg[u] = ldg_w(gr + (size_t)(c + 32 * u) * 16, pol, hint);
      vu[u] = ldg_w(ur + (size_t)(c + 32 * u) * 16, pol, hint);
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      fma_bf16x8(vg[u], xs + (c + 32 * u) * 8, ag);
      fma_bf16x8(vu[u], xs + (c + 32 * u) * 8, au);
    }
  }
  return ag * au;
}

// Evicts L2: reads all of p (n 16-byte words; 256 MB in the micros), the normal L2 policy.
__global__ void k_flush(const uint4* p, size_t n, float* out) {
  float a = 0.f;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    a += __uint_as_float(p[i].x);
  if (a == 12345.f) out[0] = a;
}

// launch() once to warm up, then the fastest of `reps` timed launches, in ms.
template <class F>
float micro_best_ms(F launch, int reps = 5) {
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  launch();
  cudaDeviceSynchronize();
  float best = 1e9f;
  for (int r = 0; r < reps; ++r) {
    cudaEventRecord(a);
    launch();
    cudaEventRecord(b);
    cudaEventSynchronize(b);
    float ms;
    cudaEventElapsedTime(&ms, a, b);
    best = ms < best ? ms : best;
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return best;
}
