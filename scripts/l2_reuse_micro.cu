// Microbenchmark (issue 4, device only): a gate/up tile that finds part of its weights in L2 because an SM fetched
// them earlier -- does it matter HOW they were fetched, and by WHICH SM? The twenty-sixth session measured L2-resident
// rows re-read by the SM that loaded them at ~45 GB/s per SM (mem_micro.cu), while the megakernel's gate/up tiles,
// whose gate rows an L2_PREFETCH task asked for, stream at ~26 GB/s per SM with 37% of their bytes from L2.
// Results (docs/PERF.md, twenty-seventh session): the prefetch instructions leave ~60% of what they ask for off chip
// (asked 2-3 times, all of it lands), and what lands sits in the address's home L2 partition: the half homed in the
// other partition crosses the L2 fabric and reads no faster than DRAM. Lines brought in by loads or bulk copies keep
// a copy in the loader's partition and read ~30% faster.
//
//   nvcc -O3 -std=c++17 -arch=sm_90a scripts/l2_reuse_micro.cu -o /tmp/l2_reuse && /tmp/l2_reuse
//   /tmp/l2_reuse "mode name"      (that mode once: for ncu, see scripts/ncu_l2_reuse.sh)
//
// One block of 512 threads per SM, block b owns tile b: 64 gate rows and 64 up rows of K = 2048 bf16 (256 KB
// each, in two [tiles * 64, 2048] matrices as in a checkpoint). One launch per measurement:
//   1. (after an L2 flush kernel) block b fetches the first 192 KB of the gate rows of tile (b + shift) % n:
//      cp.async.bulk.prefetch.L2 (as the megakernel's L2_PREFETCH task and wait prefetch), with an L2 policy,
//      paced, in other piece sizes or asked again 2 us later; prefetch.global.L2 per line; plain loads; or bulk
//      copies into shared memory;
//   2. grid barrier, thread 0 of every block sleeps `delay` us (the attention chain), grid barrier;
//   3. timed (globaltimer, per block): the tile's row-pair loop as the megakernel's GEMV_SILU_MUL runs it -- each
//      warp 4 row pairs, per iteration 4 x 16 B of the gate row and 4 x 16 B of the up row per lane in flight
//      (64 KB per SM), bf16 x fp32 FMAs with x from shared memory, L2 evict-first hint on the loads; or ("only
//      fetched rows") just the fetched 192 KB, 8 loads per lane in flight.
// Prints per mode: the phase (last block end - first block start) in us, the per-block time (median, max), and
// GB/s per SM over the phase; median of 5 launches, after a warm-up pass that is not printed.
#include <algorithm>
#include <cstring>
#include <vector>
#include "micro_common.cuh"  // CK, saddr, L2 policies, ldg_w, fma_bf16x8, mbarrier + bulk copy, gtime, grid_bar

constexpr int kThreads = 512, kRows = 64, kK = 2048, kRowBytes = kK * 2;

enum Fetch { F_NONE, F_BULK, F_LD, F_BULK_LAST, F_BULK_NORMAL, F_LINE, F_LINE_LAST, F_COPY };
extern __shared__ __align__(128) unsigned char dyn[];

struct Mode {
  const char* name;
  int fetch;     // 0 none, 1 bulk L2 prefetch, 2 loads
  int shift;     // tile fetched by block b: (b + shift) % n; -1: n / 2
  int pf_bytes;  // bytes of the gate rows asked for (from the tile's first row); up rows never
  int delay_us;  // sleep between the fetch and the timed loop
  int both;      // 1: half of pf_bytes from the gate head, half from the up head
  int hint;      // the timed loads carry the L2 evict-first hint (as the megakernel's weight loads)
  int only_pf;   // 1: the timed loop reads only the fetched head of the gate rows (is it in L2?)
  int piece;     // bulk prefetch: bytes per instruction (0: 16 KB)
  int pace_ns;   // bulk prefetch: one piece per pace_ns (0: all at once)
  int repeat;    // bulk prefetch: the whole range asked for this many times, 2 us apart (0: once)
};

__global__ void __launch_bounds__(kThreads, 1) k_tile(const char* gate, const char* up, Mode m, unsigned* bars,
                                                      unsigned long long* times, float* out) {
  __shared__ __align__(16) float xs[kK];
  for (int i = threadIdx.x; i < kK; i += kThreads) xs[i] = 1.0f + 1e-3f * i;
  const int n = gridDim.x, b = blockIdx.x;
  const size_t tile = (size_t)kRows * kRowBytes;
  if (m.fetch) {
    const int shift = m.shift < 0 ? n / 2 : m.shift, f = (b + shift) % n;
    const int ga = m.both ? m.pf_bytes / 2 : m.pf_bytes, ua = m.both ? m.pf_bytes / 2 : 0;
    for (int s = 0; s < 2; ++s) {
      const char* p = (s == 0 ? gate : up) + f * tile;
      const int bytes = s == 0 ? ga : ua;
      if (m.fetch == F_BULK || m.fetch == F_BULK_LAST || m.fetch == F_BULK_NORMAL) {
        if (threadIdx.x == 0) {
          const uint64_t pol = m.fetch == F_BULK_LAST ? evict_last() : evict_normal();
          const int piece = m.piece > 0 ? m.piece : 16384;
          uint64_t next = gtime();
          for (int r = 0; r < (m.repeat > 0 ? m.repeat : 1); ++r) {
            if (r > 0) {  // the next round 2 us after the previous one was issued
              const uint64_t t0 = gtime();
              while (gtime() - t0 < 2000) __nanosleep(64);
            }
            for (int o = 0; o < bytes; o += piece) {
              const unsigned sz = min(piece, bytes - o);
              if (m.pace_ns > 0) {  // one piece per pace_ns
                while (gtime() < next) __nanosleep(64);
                next += m.pace_ns;
              }
              if (m.fetch == F_BULK)
                asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p + o), "r"(sz) : "memory");
              else
                asm volatile("cp.async.bulk.prefetch.L2.global.L2::cache_hint [%0], %1, %2;" ::"l"(p + o),
                             "r"(sz), "l"(pol) : "memory");
            }
          }
        }
      } else if (m.fetch == F_LINE) {
        for (int o = threadIdx.x * 128; o < bytes; o += kThreads * 128)
          asm volatile("prefetch.global.L2 [%0];" ::"l"(p + o));
      } else if (m.fetch == F_LINE_LAST) {
        for (int o = threadIdx.x * 128; o < bytes; o += kThreads * 128)
          asm volatile("prefetch.global.L2::evict_last [%0];" ::"l"(p + o));
      } else if (m.fetch == F_LD) {
        float a = 0.f;
        for (int o = threadIdx.x * 16; o < bytes; o += kThreads * 16) {
          const uint4 v = __ldcg((const uint4*)(p + o));
          a += __uint_as_float(v.x ^ v.w);
        }
        if (a == 12345.f) out[1] = a;
      } else if (m.fetch == F_COPY) {  // bulk copies into shared memory, 16 KB each, 96 KB at a time; never read
        __shared__ __align__(8) uint64_t bar;
        if (threadIdx.x == 0) {
          mbar_init(saddr(&bar));
          uint32_t par = 0;
          for (int o0 = 0; o0 < bytes; o0 += 96 << 10, par ^= 1) {
            const int chunk = min(96 << 10, bytes - o0);
            mbar_expect(saddr(&bar), chunk);
            for (int o = 0; o < chunk; o += 16384)
              bulk_g2s(saddr(dyn + o), p + o0 + o, min(16384, chunk - o), saddr(&bar));
            mbar_wait(saddr(&bar), par);
          }
        }
      }
    }
  }
  grid_bar(bars, n);
  if (threadIdx.x == 0) {
    const uint64_t t0 = gtime();
    while (gtime() - t0 < (uint64_t)m.delay_us * 1000) __nanosleep(256);
  }
  grid_bar(bars + 1, n);
  unsigned long long t_start = gtime();
  // the row-pair loop: warp w takes rows 4w..4w+3; per iteration 4 chunks of gate row r and of up row r per lane
  const uint64_t pol = evict_first();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const char* g0 = gate + b * tile;
  const char* u0 = up + b * tile;
  float acc = 0.f;
  if (m.only_pf) {  // the fetched gate rows only (pf_bytes / 4 KB rows, spread over the warps), 8 loads per lane
    const int rows = m.pf_bytes / kRowBytes;
    for (int r = warp; r < rows; r += 16) {
      const char* gr = g0 + (size_t)r * kRowBytes;
      uint4 v[8];
#pragma unroll
      for (int u = 0; u < 8; ++u) v[u] = ldg_w(gr + (size_t)(lane + 32 * u) * 16, pol, m.hint);
#pragma unroll
      for (int u = 0; u < 8; ++u) fma_bf16x8(v[u], xs + (lane + 32 * u) * 8, acc);
    }
  } else {
    for (int r = warp * (kRows / 16); r < (warp + 1) * (kRows / 16); ++r)
      acc += gate_up_pair(g0 + (size_t)r * kRowBytes, u0 + (size_t)r * kRowBytes, kRowBytes, xs, lane, pol, m.hint);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    times[2 * b] = t_start;
    times[2 * b + 1] = gtime();
  }
  if (acc == 12345.f) out[0] = acc;
}

int main(int argc, char** argv) {
  setvbuf(stdout, nullptr, _IONBF, 0);
  // one argument: run only the mode of that exact name, once (for ncu: --kernel-name k_tile)
  const char* only = argc > 1 ? argv[1] : nullptr;
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const size_t tile = (size_t)kRows * kRowBytes, flush_bytes = 256u << 20;
  char *gate, *up, *flush;
  unsigned* bars;
  unsigned long long* times;
  float* out;
  CK(cudaMalloc(&gate, tile * sms));
  CK(cudaMalloc(&up, tile * sms));
  CK(cudaMalloc(&flush, flush_bytes));
  CK(cudaMemset(gate, 1, tile * sms));
  CK(cudaMemset(up, 1, tile * sms));
  CK(cudaMemset(flush, 2, flush_bytes));
  CK(cudaMalloc(&bars, 8));
  CK(cudaMalloc(&times, 16 * sms));
  CK(cudaMalloc(&out, 8));
  CK(cudaFuncSetAttribute(k_tile, cudaFuncAttributeMaxDynamicSharedMemorySize, 120 << 10));
  const int K192 = 192 << 10;
  const Mode modes[] = {
      // name, fetch, shift (-1: n/2), bytes, delay us, both, hint, only_pf, piece, pace_ns
      {"cold (no prefetch)", F_NONE, 0, 0, 30, 0, 1, 0},
      {"bulk pf 16 KB pieces, own tile", F_BULK, 0, K192, 30, 0, 1, 0},
      {"bulk pf 16 KB pieces, tile b+1", F_BULK, 1, K192, 30, 0, 1, 0},
      {"bulk pf 16 KB pieces, tile b+n/2", F_BULK, -1, K192, 30, 0, 1, 0},
      {"bulk pf 96+96 KB gate+up heads", F_BULK, 0, K192, 30, 1, 1, 0},
      {"bulk pf 4 KB pieces", F_BULK, 0, K192, 30, 0, 1, 0, 4096},
      {"bulk pf 64 KB pieces", F_BULK, 0, K192, 30, 0, 1, 0, 65536},
      {"bulk pf 16 KB paced 500 ns", F_BULK, 0, K192, 30, 0, 1, 0, 16384, 500},
      {"bulk pf 16 KB paced 2000 ns", F_BULK, 0, K192, 30, 0, 1, 0, 16384, 2000},
      {"bulk pf 4 KB pieces, asked twice", F_BULK, 0, K192, 30, 0, 1, 0, 4096, 0, 2},
      {"bulk pf 4 KB pieces, asked 3 times", F_BULK, 0, K192, 30, 0, 1, 0, 4096, 0, 3},
      {"bulk pf evict_last policy", F_BULK_LAST, 0, K192, 30, 0, 1, 0},
      {"bulk pf evict_normal policy", F_BULK_NORMAL, 0, K192, 30, 0, 1, 0},
      {"prefetch.global.L2 lines", F_LINE, 0, K192, 30, 0, 1, 0},
      {"prefetch.global.L2::evict_last lines", F_LINE_LAST, 0, K192, 30, 0, 1, 0},
      {"ld 192 KB gate, own tile", F_LD, 0, K192, 30, 0, 1, 0},
      {"ld 192 KB gate, tile b+n/2", F_LD, -1, K192, 30, 0, 1, 0},
      {"ld own, no delay", F_LD, 0, K192, 0, 0, 1, 0},
      {"bulk copy to smem, own tile", F_COPY, 0, K192, 30, 0, 1, 0},
      {"bulk copy to smem, tile b+n/2", F_COPY, -1, K192, 30, 0, 1, 0},
      {"cold, loads without evict-first hint", F_NONE, 0, 0, 30, 0, 0, 0},
      {"bulk pf, loads without the hint", F_BULK, 0, K192, 30, 0, 0, 0},
      {"only fetched rows: cold", F_NONE, 0, K192, 30, 0, 1, 1},
      {"only fetched rows: bulk pf", F_BULK, 0, K192, 30, 0, 1, 1},
      {"only fetched rows: bulk pf paced 1000", F_BULK, 0, K192, 30, 0, 1, 1, 16384, 1000},
      {"only fetched rows: line pf", F_LINE, 0, K192, 30, 0, 1, 1},
      {"only fetched rows: bulk pf 4 KB x2", F_BULK, 0, K192, 30, 0, 1, 1, 4096, 0, 2},
      {"only fetched rows: bulk pf 4 KB x3", F_BULK, 0, K192, 30, 0, 1, 1, 4096, 0, 3},
      {"only fetched rows: ld", F_LD, 0, K192, 30, 0, 1, 1},
      {"only fetched rows: bulk copy", F_COPY, 0, K192, 30, 0, 1, 1},
  };



  std::vector<unsigned long long> h(2 * sms);
  printf("%d blocks of %d threads; tile = 64 gate + 64 up rows of 4 KB (512 KB per SM)\n", sms, kThreads);
  printf("%-38s %8s %8s %8s %9s\n", "mode", "phase us", "blk med", "blk max", "GB/s/SM");
  // pass 0 warms up (the first launches of a process run slower: TLB / page state) and is not printed
  for (int rep = only ? 1 : 0; rep < 2; ++rep) {
    for (const Mode& m : modes) {
      if (only && strcmp(only, m.name) != 0) continue;
      std::vector<double> phase, med, mx;
      for (int it = 0; it < (only ? 1 : 5); ++it) {
        k_flush<<<sms * 4, 512>>>((const uint4*)flush, flush_bytes / 16, out);
        CK(cudaMemset(bars, 0, 8));
        k_tile<<<sms, kThreads, 120 << 10>>>(gate, up, m, bars, times, out);
        CK(cudaDeviceSynchronize());
        CK(cudaMemcpy(h.data(), times, 16 * sms, cudaMemcpyDeviceToHost));
        unsigned long long s = ~0ull, e = 0;
        std::vector<double> d(sms);
        for (int b = 0; b < sms; ++b) {
          s = std::min(s, h[2 * b]);
          e = std::max(e, h[2 * b + 1]);
          d[b] = (h[2 * b + 1] - h[2 * b]) * 1e-3;
        }
        std::sort(d.begin(), d.end());
        phase.push_back((e - s) * 1e-3);
        med.push_back(d[sms / 2]);
        mx.push_back(d[sms - 1]);
      }
      std::sort(phase.begin(), phase.end());
      std::sort(med.begin(), med.end());
      std::sort(mx.begin(), mx.end());
      if (rep == 0) continue;
      const size_t mid = phase.size() / 2;
      const double bytes = m.only_pf ? (double)m.pf_bytes : 2.0 * tile;
      printf("%-38s %8.2f %8.2f %8.2f %9.1f\n", m.name, phase[mid], med[mid], mx[mid], bytes / (phase[mid] * 1e3));
    }
  }
  CK(cudaGetLastError());
  return 0;
}
