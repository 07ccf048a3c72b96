// Microbenchmark (issue 4, device only): what does one dependent hop between GEMV phases cost, and how much of it
// is the synchronisation protocol? No megakernel: a chain of H hops on 128 persistent blocks (one per SM, 512
// threads). Hop h: every block needs the WHOLE vector v[h-1] (N = 2048 fp32, as o_proj / gate-up need the full
// hidden state), computes its 16 rows of v[h] = W_h . v[h-1] (one row per warp, bf16 weights [N][N] per hop: 8 MB,
// H = 48 hops stream 384 MB, ~8x the L2; or no weights: v[h][r] = sum(v[h-1]) * c), and publishes them.
//
//   nvcc -O3 -std=c++17 -arch=sm_90a scripts/hop_micro.cu -o /tmp/hop_micro && /tmp/hop_micro
//
// Protocols (us per hop = kernel time / H, median of 9 launches):
//   counter: the megakernel's (sync.cuh): writers __syncthreads, thread 0 red.release.gpu on the hop's counter;
//            readers: thread 0 polls ld.acquire.gpu (nanosleep backoff 16..128 ns), __syncthreads, every thread
//            loads its part of v[h-1] (__ldcg) into shared memory, __syncthreads;
//   flag   : data and flag in one 8-byte word (value bits | epoch << 32; NCCL's "LL" idea): writers store the word
//            with st.relaxed.gpu, no fence, no counter; every reader thread polls ITS words with ld.relaxed.gpu
//            until all carry this launch's epoch, then one __syncthreads. A single-copy-atomic 8-byte access
//            means a word with the right epoch holds the right value; no other data is read through it.
// Background: thread 32 of every block asks L2 for 32-128 KB of other data when each hop begins (the L2 prefetches
// the megakernel issues for later weights), or -- with the chain on 64 blocks (two rows per warp) -- the other SMs
// issue 16 KB prefetches at a steady paced rate: what does that traffic do to a hop's L2 hits, from the same SMs
// and from others? (Prefetches are hints the memory system may drop; the load modes cannot be dropped.)
// Weights: none; 8 MB per hop loaded after v[h-1] is staged (the megakernel's order); or issued before the wait
// (each lane's whole 8 x 16 B share of its warp's row, held in registers across the wait).
#include <algorithm>
#include <cstdio>
#include <cstdint>
#include <vector>
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include "../vm/csrc/sync.cuh"  // the megakernel's own acquire load and release add (amk_ld_acquire, amk_signal)

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e)); return 1; } } while (0)

constexpr int N = 2048, NB = 128, T = 512, NW = T / 32;  // NB chain blocks: N / NB = 16 rows each, one per warp
constexpr int NB_BG = 64, NX_MAX = 68;  // background modes: 64 chain blocks (two rows per warp) + up to 68 extra

struct Params {
  float* vec;           // counter: [H + 1][N]
  uint64_t* ll;         // flag: [H + 1][N] words (value bits | epoch << 32)
  int* ctr;             // counter: [H + 1], zeroed before each launch (threshold NB)
  const uint4* w;       // [H][N][N] bf16, or null (no weights)
  float* sink;          // [NB] keeps the result alive
  const char* pf;       // background: each block asks L2 for pf_bytes of this buffer per hop (bulk prefetch), or null
  int pf_bytes;
  const char* bg;       // background from NX extra blocks: paced 16 KB bulk prefetches over this buffer, or null
  size_t bg_span;       // bytes of bg to cycle over
  long long bg_cycles;  // SM clocks between one extra block's prefetches
  int* done;            // set by block 0 after its last hop (the extra blocks stop)
  long long* bg_stat;   // [nx][2]: prefetches issued, clocks spent (the achieved rate)
  int nb, nx;           // chain blocks (rows per warp = N / nb / NW), extra blocks
  int H;
  unsigned epoch;
};

__device__ __forceinline__ float wsum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ uint64_t ld_relaxed64(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_relaxed64(uint64_t* p, uint64_t v) {
  asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" :: "l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}

template <bool FLAG, bool PRE>
__global__ void __launch_bounds__(T, 1) hop_kernel(Params p) {
  __shared__ __align__(16) float xs[N];
  __shared__ float red[NW];
  const int b = blockIdx.x, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int rpw = N / p.nb / NW, row = (b * NW + warp) * rpw;  // this warp's rows row .. row + rpw - 1
  if (b >= p.nb) {  // an extra block: steady background traffic until the chain is done
    const int x = b - p.nb;
    if (p.bg && p.bg_cycles < 0) {  // loads, not prefetches: every thread streams 8 x 16 B in flight, flat out
      const uint4* src = (const uint4*)p.bg;
      const size_t n16 = p.bg_span / 16, per = n16 / p.nx;
      size_t i = (size_t)x * per + tid;
      uint32_t acc = 0;
      long long k = 0;
      const long long start = clock64();
      for (;; ++k) {
        if ((k & 63) == 0 && *(volatile int*)p.done) break;
        uint4 v[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) v[u] = ld_stream(src + (i + (size_t)u * T) % n16);
#pragma unroll
        for (int u = 0; u < 8; ++u) acc ^= v[u].x ^ v[u].w;
        i = (i + 8 * T) % n16;
      }
      if (acc == 0x12345678u) p.sink[0] = 0.f;  // keeps the loads
      if (tid == 0) {
        p.bg_stat[2 * x] = k * T * 8 / 1024;  // in 16 KB units, as the prefetch mode counts
        p.bg_stat[2 * x + 1] = clock64() - start;
      }
      return;
    }
    if (tid == 0 && p.bg) {
      size_t off = (size_t)x * (p.bg_span / p.nx) / 16384 * 16384;
      const long long start = clock64();
      long long next = start;
      for (int k = 0;; ++k) {
        if ((k & 15) == 0 && *(volatile int*)p.done) {
          p.bg_stat[2 * x] = k;
          p.bg_stat[2 * x + 1] = clock64() - start;
          break;
        }
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(p.bg + off), "r"(16384) : "memory");
        off = off + 16384 < p.bg_span ? off + 16384 : 0;
        next += p.bg_cycles;
        while (clock64() < next) {}
      }
    }
    return;
  }
  const uint64_t tag = (uint64_t)p.epoch << 32;
  auto publish = [&](int h, float v) {  // lane 0 of each warp: its rows of v[h] (all the same value)
    for (int j = 0; j < rpw; ++j) {
      if (FLAG) st_relaxed64(p.ll + (size_t)h * N + row + j, tag | __float_as_uint(v));
      else p.vec[(size_t)h * N + row + j] = v;
    }
  };
  if (lane == 0) publish(0, 1.0f + 1e-3f * row);
  if (!FLAG) {
    __syncthreads();
    if (tid == 0) amk_signal(p.ctr);
  }
  float acc_all = 0.f;
  for (int h = 1; h <= p.H; ++h) {
    // this hop's first weight batch: 8 chunks of 16 B per lane (a 4 KB row: the whole row), before the wait
    uint4 wv[8];
    const uint4* wrow = p.w ? p.w + ((size_t)(h - 1) * N + row) * (N / 8) : nullptr;
    if (PRE && wrow) {
#pragma unroll
      for (int u = 0; u < 8; ++u) wv[u] = ld_stream(wrow + lane + 32 * u);
    }
    // background traffic (the megakernel's L2 prefetches of later weights): issued when the hop begins
    if (p.pf && tid == 32) {
      const char* base = p.pf + ((size_t)(h - 1) * p.nb + b) * (size_t)p.pf_bytes;
      for (int o = 0; o < p.pf_bytes; o += 16384)
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(base + o), "r"(16384) : "memory");
    }
    // wait for v[h-1] and stage it
    float ss = 0.f;
    if (FLAG) {
      const uint64_t* src = p.ll + (size_t)(h - 1) * N;
      constexpr int PER = N / T;  // words per thread, all loaded at once; the stale ones again until they are fresh
      uint64_t v[PER];
#pragma unroll
      for (int k = 0; k < PER; ++k) v[k] = ld_relaxed64(src + tid + k * T);
      for (;;) {
        bool all = true;
#pragma unroll
        for (int k = 0; k < PER; ++k) all = all && (v[k] >> 32) == p.epoch;
        if (all) break;
#pragma unroll
        for (int k = 0; k < PER; ++k)
          if ((v[k] >> 32) != p.epoch) v[k] = ld_relaxed64(src + tid + k * T);
      }
#pragma unroll
      for (int k = 0; k < PER; ++k) {
        const float f = __uint_as_float((uint32_t)v[k]);
        xs[tid + k * T] = f;
        ss += f;
      }
    } else {
      if (tid == 0) {
        const int* c = p.ctr + (h - 1);
        const int thr = p.nb;  // counters are zeroed before each launch
        unsigned ns = 16;
        while (amk_ld_acquire(c) < thr) {
          __nanosleep(ns);
          if (ns < 128) ns <<= 1;
        }
      }
      __syncthreads();
      const float* src = p.vec + (size_t)(h - 1) * N;
      for (int i = tid; i < N; i += T) {
        const float f = __ldcg(src + i);
        xs[i] = f;
        ss += f;
      }
    }
    ss = wsum(ss);
    if (lane == 0) red[warp] = ss;
    __syncthreads();
    if (!PRE && wrow) {  // the megakernel's order: x staged first, then the weight batch
#pragma unroll
      for (int u = 0; u < 8; ++u) wv[u] = ld_stream(wrow + lane + 32 * u);
    }
    float y;
    if (wrow) {  // row . x: lane's chunks lane + 32u, 8 bf16 each
      float a = 0.f;
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        const int c = lane + 32 * u;
        const uint32_t q[4] = {wv[u].x, wv[u].y, wv[u].z, wv[u].w};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          a = fmaf(__uint_as_float(q[e] << 16), xs[8 * c + 2 * e], a);
          a = fmaf(__uint_as_float(q[e] & 0xffff0000u), xs[8 * c + 2 * e + 1], a);
        }
      }
      y = wsum(a) * 1e-3f;
    } else {
      float t = 0.f;
#pragma unroll
      for (int w = 0; w < NW; ++w) t += red[w];
      y = t * (1.0f / N) + 1e-3f * row;
    }
    acc_all += y;
    if (lane == 0) publish(h, y);
    __syncthreads();  // xs / red are rewritten by the next hop; counter: orders the rows before the release
    if (!FLAG && tid == 0) amk_signal(p.ctr + h);
  }
  if (tid == 0) p.sink[b] = acc_all;
  if (b == 0 && tid == 0) *(volatile int*)p.done = 1;
}

int main() {
  const int H = 48;
  int dev = 0, sms = 0, coop = 0;
  CK(cudaGetDevice(&dev));
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  CK(cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, dev));
  if (sms < NB || !coop) { printf("needs %d SMs and cooperative launch (has %d SMs)\n", NB, sms); return 1; }
  const int nx_bg = sms - NB_BG < NX_MAX ? sms - NB_BG : NX_MAX;
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, dev));
  float* vec; uint64_t* ll; int* ctr; uint4* w; float* sink;
  const size_t wbytes = (size_t)H * N * N * 2 * 2;  // the weights use the first half; the 128 KB prefetches all
  CK(cudaMalloc(&vec, (size_t)(H + 1) * N * 4));
  CK(cudaMalloc(&ll, (size_t)(H + 1) * N * 8));
  CK(cudaMalloc(&ctr, (H + 1) * 4));
  CK(cudaMalloc(&w, wbytes));
  CK(cudaMalloc(&sink, NB * 4));
  CK(cudaMemset(ll, 0, (size_t)(H + 1) * N * 8));
  CK(cudaMemset(ctr, 0, (H + 1) * 4));
  CK(cudaMemset(w, 0x3c, wbytes));  // bf16 0x3c3c ~ 0.0115
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  unsigned epoch = 0;
  printf("%s, %d SMs; %d blocks x %d threads, %d hops, N = %d\n", prop.name, sms, NB, T, H, N);
  printf("%-10s %-13s %10s %12s\n", "protocol", "weights", "us/hop", "result");
  // mode: 0 = no weights, 1 = weights loaded after the wait (the megakernel's order), 2 = weights before the wait,
  // 3..5 = no weights, each block prefetching 32 / 64 / 128 KB of other data into L2 per hop (4 / 8 / 16 MB per hop),
  // 6 = no weights on NB_BG chain blocks, 7..9 = the same with the other SMs prefetching other data at a steady
  // 1 / 2 / 3 TB/s in all, 10..12 = 16 / 32 / all other SMs streaming other data with loads, flat out
  int* done;
  long long* bg_stat;
  CK(cudaMalloc(&done, 4));
  CK(cudaMalloc(&bg_stat, NX_MAX * 2 * 8));
  int clock_khz = 0;
  CK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, dev));
  for (int mode = 0; mode < 13; ++mode) {
    for (int flag = 0; flag < 2; ++flag) {
      std::vector<float> ts;
      float res = 0.f;
      void* fn = flag ? (mode == 2 ? (void*)hop_kernel<true, true> : (void*)hop_kernel<true, false>)
                      : (mode == 2 ? (void*)hop_kernel<false, true> : (void*)hop_kernel<false, false>);
      for (int it = 0; it < 11; ++it) {
        const int pfk = (mode >= 3 && mode <= 5) ? (32 << (mode - 3)) : 0;
        const double tbs = (mode >= 7 && mode <= 9) ? (double)(mode - 6) : 0.0;  // background TB/s in all
        const int nb = mode >= 6 ? NB_BG : NB;
        const int nx = mode >= 10 ? (mode == 10 ? 16 : mode == 11 ? 32 : nx_bg) : (mode >= 6 ? nx_bg : 0);
        const long long cyc = tbs > 0 ? (long long)(16384.0 / (tbs * 1e12 / nx) * clock_khz * 1e3)
                                      : (mode >= 10 ? -1 : 0);
        Params p{vec, ll, ctr, (mode == 1 || mode == 2) ? w : nullptr, sink,
                 (mode >= 3 && mode <= 5) ? (const char*)w : nullptr, pfk * 1024,
                 (tbs > 0 || mode >= 10) ? (const char*)w : nullptr, wbytes, cyc, done, bg_stat, nb, nx, H, ++epoch};
        void* args[] = {&p};
        CK(cudaMemsetAsync(ctr, 0, (H + 1) * 4));
        CK(cudaMemsetAsync(done, 0, 4));
        CK(cudaEventRecord(e0));
        CK(cudaLaunchCooperativeKernel(fn, nb + nx, T, args, 0, 0));
        CK(cudaEventRecord(e1));
        CK(cudaEventSynchronize(e1));
        CK(cudaGetLastError());
        float ms;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        if (it >= 2) ts.push_back(ms * 1000.f / H);
        CK(cudaMemcpy(&res, sink, 4, cudaMemcpyDeviceToHost));
      }
      std::sort(ts.begin(), ts.end());
      const char* mn[13] = {"none", "8MB after", "8MB before", "none+pf4MB", "none+pf8MB", "none+pf16MB",
                            "64blk none", "64blk+bg1TB/s", "64blk+bg2TB/s", "64blk+bg3TB/s",
                            "64blk+ld16SM", "64blk+ld32SM", "64blk+ld68SM"};
      double got = 0.0;  // achieved background TB/s (the last launch)
      const int nxm = mode == 10 ? 16 : mode == 11 ? 32 : nx_bg;
      if (mode >= 7) {
        long long st[NX_MAX * 2];
        CK(cudaMemcpy(st, bg_stat, sizeof(st), cudaMemcpyDeviceToHost));
        for (int x = 0; x < nxm; ++x) got += st[2 * x + 1] > 0 ? st[2 * x] * 16384.0 / (st[2 * x + 1] / (clock_khz * 1e3)) / 1e12 : 0;
      }
      printf("%-10s %-13s %10.2f %12.6g", flag ? "flag" : "counter", mn[mode], ts[ts.size() / 2], res);
      if (mode >= 7) printf("   background achieved %.2f TB/s (at the nominal clock)", got);
      printf("\n");
    }
  }
  return 0;
}
