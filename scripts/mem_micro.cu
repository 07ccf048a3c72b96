// Microbenchmark (issue 4, device only): per-SM streaming rates of the memory paths a GEMV tile can take, with no
// megakernel around them. One block of 512 threads per SM; every mode is timed on all SMs and on 16 SMs (where the
// HBM has room and per-SM limits show); best of 5 launches. Results: docs/PERF.md, twenty-sixth session.
//
//   nvcc -O3 -std=c++17 -arch=sm_90a scripts/mem_micro.cu -o /tmp/mem_micro && /tmp/mem_micro
//
// Questions it answers:
//   * reg N: 16-byte register loads, N per lane in flight (the GEMV loop: 8 per lane = 64 KB per SM), HBM stream;
//   * l2 N: the same loads re-reading a per-SM slice that stays in L2 (is an L2 hit under load faster per SM?);
//   * mix: warps 0-7 re-read the L2 slice, warps 8-15 stream from HBM (a gate/up tile with its gate rows in L2);
//   * "+ bf16 FMA": each chunk also multiplied with fp32 x from shared memory (the GEMV loop's work); "pipe 2x4":
//     the same 8 loads per lane software-pipelined in two halves (k_reg pipe), so loads stay in flight while summing;
//   * bulk S x B: S one-dimensional bulk copies (cp.async.bulk) of B bytes each in flight, issued by one thread,
//     nobody reads the data (the raw rate of the copy engine path at that depth);
//   * "evict-first hint": the same with the L2 evict-first cache policy the megakernel's weight loads carry;
//   * ldgsts N: 16-byte cp.async copies into shared memory, N per lane in flight (commit groups, wait_group).
#include "micro_common.cuh"  // CK, saddr, micro_best_ms

constexpr int kThreads = 512;


// acc += one 16-byte chunk of bf16 weights j times fp32 x from shared memory (the GEMV loop's work per chunk,
// K = 2048: x chunk j mod 256), or a cheap use of the bytes without fma.
template <bool fma>
__device__ __forceinline__ void use(const uint4& v, size_t j, const float* xs, float& acc) {
  if (fma) fma_bf16x8(v, xs + (int)(j & 255) * 8, acc);
  else acc += __uint_as_float(v.x ^ v.w);
}

// What one thread of a k_reg block walks: warps below l2_warps re-read the block's l2src slice `passes`
// times, the others stream the block's bytes of src once; t / nt: the thread's index / count in its group.
struct Walk {
  const uint4* base;
  size_t n;
  int t, nt, reps;
};
__device__ __forceinline__ Walk walk(const char* src, size_t bytes, int passes, const char* l2src, size_t l2_bytes,
                                     int l2_warps) {
  const bool l2 = (int)threadIdx.x / 32 < l2_warps;
  Walk w;
  w.nt = l2_warps > 0 ? (l2 ? l2_warps : kThreads / 32 - l2_warps) * 32 : kThreads;
  w.t = l2_warps > 0 ? (l2 ? (int)threadIdx.x : (int)threadIdx.x - l2_warps * 32) : (int)threadIdx.x;
  w.base = (const uint4*)(l2 ? l2src + blockIdx.x * l2_bytes : src + blockIdx.x * bytes);
  w.n = (l2 ? l2_bytes : bytes) / 16;
  w.reps = l2 ? passes : 1;
  return w;
}

// x of the FMA work: fp32 in shared memory, as the GEMV loop stages it.
__device__ __forceinline__ void init_x(float* xs) {
  for (int i = threadIdx.x; i < 2048; i += kThreads) xs[i] = 1.0f + 1e-3f * i;
  __syncthreads();
}

// Each lane keeps N loads in flight; the block walks `bytes` of src (passes times) in 512 * N * 16-byte batches.
// l2_warps > 0: warps below it read the `l2src` slice of l2_bytes over and over instead (their share of the work).
// pipe (N = 8): the 8 loads software-pipelined in two halves -- a half's next loads are issued right after it is
// used, so 4 stay in flight while the other half is summed (otherwise the next 8 go out only after all 8 are summed).
template <int N, bool hint = false, bool fma = false, bool pipe = false>
__global__ void __launch_bounds__(kThreads, 1) k_reg(const char* __restrict__ src, size_t bytes, int passes,
                                                    const char* __restrict__ l2src, size_t l2_bytes, int l2_warps,
                                                    float* out) {
  static_assert(!pipe || N == 8, "the pipelined walk is two halves of 4");
  __shared__ __align__(16) float xs[2048];
  init_x(xs);
  const Walk wk = walk(src, bytes, passes, l2src, l2_bytes, l2_warps);
  const uint4* base = wk.base;
  const size_t n = wk.n, nt = (size_t)wk.nt;
  const uint64_t pol = hint ? evict_first() : 0;
  float acc = 0.f;
  auto load = [&](uint4* v, int k, size_t i) {
#pragma unroll
    for (int u = 0; u < k; ++u) {
      const size_t j = i + (size_t)u * nt;
      v[u] = j < n ? ldg_w(base + j, pol, hint) : make_uint4(0, 0, 0, 0);
    }
  };
  auto sum = [&](const uint4* v, int k, size_t i) {
#pragma unroll
    for (int u = 0; u < k; ++u) use<fma>(v[u], i + (size_t)u * nt, xs, acc);
  };
  for (int rep = 0; rep < wk.reps; ++rep) {
    if constexpr (pipe) {
      uint4 a[4], b[4];
      size_t i = wk.t;
      load(a, 4, i);
      load(b, 4, i + 4 * nt);
      for (; i < n; i += 8 * nt) {
        sum(a, 4, i);
        load(a, 4, i + 8 * nt);
        sum(b, 4, i + 4 * nt);
        load(b, 4, i + 12 * nt);
      }
    } else {
      for (size_t i = wk.t; i < n; i += N * nt) {
        uint4 v[N];
        load(v, N, i);
        sum(v, N, i);
      }
    }
  }
  if (acc == 12345.f) out[0] = acc;
}

extern __shared__ __align__(128) unsigned char dyn[];

// S bulk copies of B bytes in flight, thread 0 issues and waits (full barriers only: nobody reads the slots).
template <bool hint = false>
__global__ void __launch_bounds__(kThreads, 1) k_bulk(const char* __restrict__ src, size_t bytes, int S, int B,
                                                     float* out) {
  __shared__ __align__(8) uint64_t bars[64];
  if (threadIdx.x != 0) return;
  for (int s = 0; s < S; ++s) mbar_init(saddr(bars + s));
  const char* p = src + blockIdx.x * bytes;
  const uint32_t nst = (uint32_t)(bytes / B);
  const uint64_t pol = hint ? evict_first() : 0;
  for (uint32_t k = 0; k < nst + S; ++k) {
    if (k >= (uint32_t)S) {  // wait for copy k - S, then reuse its slot
      const uint32_t j = k - S;
      mbar_wait(saddr(bars + j % S), (j / S) & 1);
    }
    if (k < nst) {
      const uint32_t bar = saddr(bars + k % S);
      mbar_expect(bar, B);
      bulk_g2s(saddr(dyn + (size_t)(k % S) * B), p + (size_t)k * B, B, bar, hint, pol);
    }
  }
  if (bytes == 12345) out[0] = 0.f;
}

// N 16-byte cp.async copies per lane in flight (one commit group per batch, two batches overlapping).
template <int N>
__global__ void __launch_bounds__(kThreads, 1) k_ldgsts(const char* __restrict__ src, size_t bytes, float* out) {
  const uint4* base = (const uint4*)(src + blockIdx.x * bytes);
  const size_t n = bytes / 16, step = (size_t)N / 2 * kThreads;
  int b = 0;
  for (size_t i = threadIdx.x; i < n; i += step, b ^= 1) {
#pragma unroll
    for (int u = 0; u < N / 2; ++u) {
      const size_t j = i + (size_t)u * kThreads;
      const uint32_t dst = saddr(dyn + ((size_t)(b * (N / 2) + u) * kThreads + threadIdx.x) * 16);
      if (j < n) asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(dst), "l"(base + j) : "memory");
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
    asm volatile("cp.async.wait_group 1;" ::: "memory");
  }
  asm volatile("cp.async.wait_group 0;" ::: "memory");
  if (bytes == 12345) out[0] = 0.f;
}

int main() {
  setvbuf(stdout, nullptr, _IONBF, 0);
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const size_t per_block = 4u << 20;   // 4 MB per SM streamed: ~528 MB in all, 10x the L2
  const size_t l2_slice = 128u << 10;  // 128 KB per SM re-read: ~17 MB in all, a third of the L2
  const int passes = 32;
  char *w, *l2w;
  float* out;
  CK(cudaMalloc(&w, per_block * sms));
  CK(cudaMemset(w, 1, per_block * sms));
  CK(cudaMalloc(&l2w, l2_slice * sms));
  CK(cudaMemset(l2w, 1, l2_slice * sms));
  CK(cudaMalloc(&out, 4));
  CK(cudaFuncSetAttribute(k_bulk<false>, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024));
  CK(cudaFuncSetAttribute(k_bulk<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024));
  CK(cudaFuncSetAttribute(k_ldgsts<16>, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024));
  CK(cudaFuncSetAttribute(k_ldgsts<24>, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024));
  for (int grid : {sms, 16}) {
    printf("\n%-40s %9s %9s   (%d blocks of %d threads)\n", "mode", "GB/s", "GB/s/SM", grid, kThreads);
    auto row = [&](const char* name, double bytes_per_block, float ms) {
      const double g = bytes_per_block * grid / (ms * 1e-3) / 1e9;
      printf("%-40s %9.0f %9.1f\n", name, g, g / grid);
    };
    row("reg 8/lane (64 KB/SM), HBM", per_block,
        micro_best_ms([&] { k_reg<8><<<grid, kThreads>>>(w, per_block, 1, l2w, 0, 0, out); }));
    row("reg 8/lane, HBM, + bf16 FMA", per_block,
        micro_best_ms([&] { k_reg<8, false, true><<<grid, kThreads>>>(w, per_block, 1, l2w, 0, 0, out); }));
    row("pipe 2x4/lane, HBM, + bf16 FMA", per_block,
        micro_best_ms([&] { k_reg<8, false, true, true><<<grid, kThreads>>>(w, per_block, 1, l2w, 0, 0, out); }));
    row("reg 8/lane, HBM, evict-first hint", per_block,
        micro_best_ms([&] { k_reg<8, true><<<grid, kThreads>>>(w, per_block, 1, l2w, 0, 0, out); }));
    row("reg 16/lane (128 KB/SM), HBM", per_block,
        micro_best_ms([&] { k_reg<16><<<grid, kThreads>>>(w, per_block, 1, l2w, 0, 0, out); }));
    row("l2 8/lane (64 KB/SM), 128 KB slice", (double)l2_slice * passes,
        micro_best_ms([&] { k_reg<8><<<grid, kThreads>>>(w, 0, passes, l2w, l2_slice, 16, out); }));
    row("l2 8/lane + bf16 FMA", (double)l2_slice * passes,
        micro_best_ms([&] { k_reg<8, false, true><<<grid, kThreads>>>(w, 0, passes, l2w, l2_slice, 16, out); }));
    row("l2 pipe 2x4/lane + bf16 FMA", (double)l2_slice * passes,
        micro_best_ms([&] { k_reg<8, false, true, true><<<grid, kThreads>>>(w, 0, passes, l2w, l2_slice, 16, out); }));
    row("l2 16/lane (128 KB/SM), 128 KB slice", (double)l2_slice * passes,
        micro_best_ms([&] { k_reg<16><<<grid, kThreads>>>(w, 0, passes, l2w, l2_slice, 16, out); }));
    // mix: 8 warps stream 1 MB from HBM while the other 8 re-read the slice `mp` times (about as long)
    const size_t mix_hbm = 1u << 20;
    for (int mp : {2, 4, 8}) {
      char name[64];
      snprintf(name, sizeof name, "mix 8/lane: 1 MB HBM + %dx128 KB L2", mp);
      row(name, (double)mix_hbm + (double)l2_slice * mp,
          micro_best_ms([&] { k_reg<8><<<grid, kThreads>>>(w, mix_hbm, mp, l2w, l2_slice, 8, out); }));
      snprintf(name, sizeof name, "  ... + bf16 FMA");
      row(name, (double)mix_hbm + (double)l2_slice * mp,
          micro_best_ms([&] { k_reg<8, false, true><<<grid, kThreads>>>(w, mix_hbm, mp, l2w, l2_slice, 8, out); }));
      snprintf(name, sizeof name, "  ... pipe 2x4 + bf16 FMA");
      row(name, (double)mix_hbm + (double)l2_slice * mp,
          micro_best_ms([&] { k_reg<8, false, true, true><<<grid, kThreads>>>(w, mix_hbm, mp, l2w, l2_slice, 8, out); }));
    }
    const int cfgs[][2] = {{4, 32768}, {6, 32768}, {8, 16384}, {16, 8192}, {32, 4096}, {48, 4096}, {12, 16384}};
    for (const auto& c : cfgs) {
      char name[64];
      snprintf(name, sizeof name, "bulk %2d x %5d B (%3d KB/SM)", c[0], c[1], c[0] * c[1] / 1024);
      row(name, per_block, micro_best_ms([&] { k_bulk<<<grid, kThreads, c[0] * c[1]>>>(w, per_block, c[0], c[1], out); }));
    }
    row("bulk  4 x 32768 B, evict-first hint", per_block,
        micro_best_ms([&] { k_bulk<true><<<grid, kThreads, 4 * 32768>>>(w, per_block, 4, 32768, out); }));
    row("ldgsts 16/lane (128 KB/SM)", per_block,
        micro_best_ms([&] { k_ldgsts<16><<<grid, kThreads, 16 * kThreads * 16>>>(w, per_block, out); }));
    row("ldgsts 24/lane (192 KB/SM)", per_block,
        micro_best_ms([&] { k_ldgsts<24><<<grid, kThreads, 24 * kThreads * 16>>>(w, per_block, out); }));
    CK(cudaGetLastError());
  }
  return 0;
}
