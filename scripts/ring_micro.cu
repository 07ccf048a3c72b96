// Microbenchmark (issue 4, device only): how fast can one block of 512 threads per SM stream weights HBM -> shared
// memory with 1-D bulk copies (cp.async.bulk + full/empty mbarriers), against plain 16-byte register loads? No
// megakernel, no dependencies: every block streams its own 4 MB slice of a buffer ~10x the L2; best of 5 launches.
//
//   nvcc -O3 -std=c++17 -arch=sm_90a scripts/ring_micro.cu -o /tmp/ring_micro && /tmp/ring_micro
//
// Modes (GB/s in all and per SM, on every SM and then on 16 SMs, where the HBM has room and per-SM limits show):
//   reg: each lane keeps 8 x 16 B loads in flight (the megakernel's register GEMV pattern, without the FMAs);
//   bulk S x B: S slots of B bytes; nocons = thread 0 only waits for the bytes; read = all threads read each stage;
//   gemv = the megakernel's GEMV consumer (bf16 rows, fp32 x in shared memory, warp sums) with thread 0 producing
//   between its own stages; gemv producer-warp = the same consumer on 15 warps and a warp that only produces;
//   test-spin / try_wait: how consumers poll a stage's full barrier. Results: docs/PERF.md, fifteenth session.
#include "micro_common.cuh"  // CK, saddr, micro_best_ms

__device__ __forceinline__ void mb_init(uint32_t b, uint32_t n) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(b), "r"(n) : "memory");
}
__device__ __forceinline__ void mb_expect(uint32_t b, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(b), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mb_arrive(uint32_t b) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(b) : "memory");
}
__device__ __forceinline__ bool mb_try(uint32_t b, uint32_t par) {
  uint32_t ok;
  asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
               : "=r"(ok) : "r"(b), "r"(par) : "memory");
  return ok;
}
__device__ __forceinline__ bool mb_test(uint32_t b, uint32_t par) {
  uint32_t ok;
  asm volatile("{\n .reg .pred p;\n mbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
               : "=r"(ok) : "r"(b), "r"(par) : "memory");
  return ok;
}
// One 1-D bulk copy with the L2 evict-first hint (as the megakernel's ring issues them).
__device__ __forceinline__ void bulk(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  bulk_g2s(dst, src, bytes, bar, true, evict_first());
}

extern __shared__ __align__(128) unsigned char dyn[];

__device__ __forceinline__ float wsum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// bulk ring: S slots of B bytes; `cons` 1 = all warps read + arrive on empty; 0 = thread 0 waits only; 2 = the
// megakernel's GEMV consumer (bf16 rows of K = 2048, x fp32 in shared memory, rows split over warps, warp sums
// stashed), thread 0 producing between its own stages; 3 = the same consumer on warps 0..nw-2 while warp nw-1 only
// produces (a dedicated producer warp: lane 0 waits on each slot's empty barrier and refills it).
__global__ void __launch_bounds__(512, 1) k_bulk(const char* __restrict__ w, size_t per_block, int S, int B, int cons,
                                                 int spin, float* out) {
  __shared__ __align__(8) uint64_t bars[64];
  __shared__ __align__(16) float xs[2048];
  __shared__ float stash[1024];
  for (int i = threadIdx.x; i < 2048; i += blockDim.x) xs[i] = 1.0f + 1e-3f * i;
  const uint32_t full0 = saddr(bars), empty0 = saddr(bars + 32), base = saddr(dyn);
  const int nw = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  if (threadIdx.x == 0) {
    for (int s = 0; s < S; ++s) {
      mb_init(full0 + 8 * s, 1);
      mb_init(empty0 + 8 * s, cons == 3 ? nw - 1 : (cons ? nw : 1));
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  const char* src = w + (size_t)blockIdx.x * per_block;
  const uint32_t nst = (uint32_t)(per_block / B);
  uint32_t issued = 0;
  float acc = 0.f;
  auto pump = [&]() {
    while (issued < nst) {
      const uint32_t n = issued;
      if (n >= (uint32_t)S && !mb_test(empty0 + 8 * (n % S), ((n / S) & 1) ^ 1)) return;
      const uint32_t bar = full0 + 8 * (n % S);
      mb_expect(bar, B);
      bulk(base + (n % S) * B, src + (size_t)n * B, B, bar);
      ++issued;
    }
  };
  if (cons == 3 && warp == nw - 1 && lane == 0)  // the producer warp
    while (issued < nst) pump();
  for (uint32_t seq = 0; seq < nst && !(cons == 3 && warp == nw - 1); ++seq) {
    const uint32_t bar = full0 + 8 * (seq % S), par = (seq / S) & 1;
    if (cons >= 2) {
      if (cons == 2 && threadIdx.x == 0) { for (;;) { pump(); if (mb_test(bar, par)) break; } }
      if (spin) { while (!mb_test(bar, par)) {} }  // busy poll
      while (!mb_try(bar, par)) {}
      // B bytes = rows of 4096 B (bf16, K = 2048); wpr warps per row, each a K range
      const int ncw = cons == 3 ? nw - 1 : nw;  // consumer warps
      const int rows = B / 4096, wpr = rows >= nw ? 1 : nw / rows;
      const char* st = (const char*)dyn + (seq % S) * B;
      for (int item = warp; item < rows * wpr; item += ncw) {  // (row, K slice) items, round robin over warps
        const int r = item / wpr, sub = item % wpr;
        float a = 0.f;
        for (int ch = sub * 32 + lane; ch < 256; ch += 32 * wpr) {
          uint4 v;
          asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                       : "r"(saddr(st + r * 4096 + ch * 16)));
          const float4 x0 = *(const float4*)(xs + ch * 8), x1 = *(const float4*)(xs + ch * 8 + 4);
          a = fmaf(__uint_as_float(v.x << 16), x0.x, a); a = fmaf(__uint_as_float(v.x & 0xffff0000u), x0.y, a);
          a = fmaf(__uint_as_float(v.y << 16), x0.z, a); a = fmaf(__uint_as_float(v.y & 0xffff0000u), x0.w, a);
          a = fmaf(__uint_as_float(v.z << 16), x1.x, a); a = fmaf(__uint_as_float(v.z & 0xffff0000u), x1.y, a);
          a = fmaf(__uint_as_float(v.w << 16), x1.z, a); a = fmaf(__uint_as_float(v.w & 0xffff0000u), x1.w, a);
        }
        a = wsum(a);
        if (lane == 0) stash[(r * wpr + sub) & 1023] = a;
      }
      __syncwarp();
      if (lane == 0) mb_arrive(empty0 + 8 * (seq % S));
    } else if (cons) {
      if (threadIdx.x == 0) { for (;;) { pump(); if (mb_test(bar, par)) break; } }
      while (!mb_try(bar, par)) {}
      const uint4* st = (const uint4*)(dyn + (seq % S) * B);
      for (int i = threadIdx.x; i < B / 16; i += blockDim.x) { uint4 v = st[i]; acc += __uint_as_float(v.x ^ v.w); }
      __syncwarp();
      if (lane == 0) mb_arrive(empty0 + 8 * (seq % S));
    } else if (threadIdx.x == 0) {
      for (;;) { pump(); if (mb_test(bar, par)) break; }
      mb_arrive(empty0 + 8 * (seq % S));
    }
  }
  __syncthreads();
  if (acc == 12345.f || stash[threadIdx.x & 1023] == 12345.f) out[0] = acc;
}

// fma = 1: each 16-byte chunk is also multiplied with fp32 x from shared memory like the GEMV's bf16 rows (K = 2048).
__global__ void __launch_bounds__(512, 1) k_reg(const char* __restrict__ w, size_t per_block, int fma, float* out) {
  __shared__ __align__(16) float xs[2048];
  for (int i = threadIdx.x; i < 2048; i += blockDim.x) xs[i] = 1.0f + 1e-3f * i;
  __syncthreads();
  const uint4* src = (const uint4*)(w + (size_t)blockIdx.x * per_block);
  const size_t n = per_block / 16;
  float acc = 0.f;
  for (size_t i = threadIdx.x; i < n; i += 8 * blockDim.x) {
    uint4 v[8];
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      const size_t j = i + (size_t)u * blockDim.x;
      if (j < n) asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                              : "=r"(v[u].x), "=r"(v[u].y), "=r"(v[u].z), "=r"(v[u].w) : "l"(src + j));
      else v[u] = make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      if (fma) {
        const int ch = (int)((i + (size_t)u * blockDim.x) & 255);
        const float4 x0 = *(const float4*)(xs + ch * 8), x1 = *(const float4*)(xs + ch * 8 + 4);
        acc = fmaf(__uint_as_float(v[u].x << 16), x0.x, acc); acc = fmaf(__uint_as_float(v[u].x & 0xffff0000u), x0.y, acc);
        acc = fmaf(__uint_as_float(v[u].y << 16), x0.z, acc); acc = fmaf(__uint_as_float(v[u].y & 0xffff0000u), x0.w, acc);
        acc = fmaf(__uint_as_float(v[u].z << 16), x1.x, acc); acc = fmaf(__uint_as_float(v[u].z & 0xffff0000u), x1.y, acc);
        acc = fmaf(__uint_as_float(v[u].w << 16), x1.z, acc); acc = fmaf(__uint_as_float(v[u].w & 0xffff0000u), x1.w, acc);
      } else {
        acc += __uint_as_float(v[u].x ^ v[u].w);
      }
    }
  }
  if (acc == 12345.f) out[0] = acc;
}

int main() {
  setvbuf(stdout, nullptr, _IONBF, 0);
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const size_t per_block = 4u << 20;  // 4 MB per SM: ~528 MB in all, 10x the L2
  char* w;
  float* out;
  CK(cudaMalloc(&w, per_block * sms));
  CK(cudaMemset(w, 1, per_block * sms));
  CK(cudaMalloc(&out, 4));
  CK(cudaFuncSetAttribute(k_bulk, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024));
  int grid = sms;
  auto timeit = [&](auto launch) { return (double)per_block * grid / (micro_best_ms(launch) * 1e-3) / 1e9; };
  for (int gr : {sms, 16}) {
  grid = gr;
  printf("%-44s %8s %10s   (%d blocks)\n", "mode", "GB/s", "GB/s/SM", grid);
  double g = timeit([&] { k_reg<<<grid, 512>>>(w, per_block, 0, out); });
  printf("%-44s %8.0f %10.1f\n", "reg 8x16B/lane (64 KB/SM in flight)", g, g / grid);
  g = timeit([&] { k_reg<<<grid, 512>>>(w, per_block, 1, out); });
  printf("%-44s %8.0f %10.1f\n", "reg 8x16B/lane + bf16 x fp32 FMA", g, g / grid);
  struct M { int S, B, cons, spin; };
  const M ms[] = {{4, 32768, 1, 0}, {4, 32768, 0, 0}, {4, 32768, 2, 0}, {4, 32768, 2, 1},
                  {8, 16384, 2, 0}, {8, 16384, 2, 1}, {4, 32768, 3, 0}, {4, 32768, 3, 1},
                  {8, 16384, 3, 1}, {4, 32768, 1, 1}};
  for (const M& m : ms) {
    if (cudaGetLastError() != cudaSuccess) return 1;
    g = timeit([&] { k_bulk<<<grid, 512, m.S * m.B>>>(w, per_block, m.S, m.B, m.cons, m.spin, out); });
    char name[64];
    const char* cn[] = {" nocons", " read", " gemv", " gemv producer-warp"};
    snprintf(name, sizeof name, "bulk %2d x %5d B%s%s", m.S, m.B, cn[m.cons], m.spin ? " test-spin" : " try_wait");
    printf("%-44s %8.0f %10.1f\n", name, g, g / grid);
  }
  }
  CK(cudaGetLastError());
  return 0;
}
