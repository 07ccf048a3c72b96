// Device diagnostic (issue 4): the H100's two L2 partitions. Which partition is each SM next to, which partition is
// each 128-byte line of a buffer homed in, and does an SM stream faster when every line it reads is homed next to it?
//
//   nvcc -O3 -std=c++17 -arch=sm_90a scripts/l2_home_micro.cu -o /tmp/l2_home && /tmp/l2_home [out_dir]
//
// The twenty-seventh session (docs/PERF.md) found that a line homed in the other partition reads about as slowly
// as DRAM even when it is in L2, and that a cold stream sends ~55% of its sectors across the fabric between the
// partitions. This probe asks whether placing a tile's bytes in memory homed next to its SM is a lever.
//
// 1. SM map: after an L2 flush, one thread of the block on SM s loads NP fixed lines one at a time (each load's
//    address depends on the previous load's value, each timed with clock64), for every s in turn. A line homed in
//    the far partition pays the fabric crossing; the per-line latencies split the SMs into two groups.
// 2. Line homes: the same timed walk over every line of a region, sequentially, from two SMs of each group (a flush
//    before each walk); a line is homed next to the group that read it faster. Prints, for each address bit 7..20,
//    the fraction of lines whose home flips with that bit (an XOR hash gives 0 or 1 for each bit).
// 3. Streaming: every SM (512 threads, the GEMV loop's pattern: 8 lanes per 128-byte line, 8 x 16-byte loads per
//    lane in flight, the L2 evict-first hint, bf16 x fp32 FMAs) reads 4096 lines (512 KB) from a per-SM line list:
//    contiguous lines, lines homed next to its SM, or lines homed in the other partition. GB/s over the GPU, best of
//    5 launches, each after a flush.
// Writes out_dir/l2_home_sm.bin (int32 group per SM id, -1 for ids not in use) and out_dir/l2_home_lines.bin (int8 home per line of the
// region, -1 where undecided) when out_dir is given.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "micro_common.cuh"

constexpr int NP = 2048;              // lines of the SM-map probe
constexpr size_t REGION = 96u << 20;  // bytes of the line-home walk and of the streaming lists
constexpr int LIST = 4096;            // lines per SM in the streaming test (512 KB)

__device__ __forceinline__ unsigned smid() {
  unsigned s;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
  return s;
}
__device__ __forceinline__ long long clk() {  // ordered against the memory operations around it
  long long t;
  asm volatile("mov.u64 %0, %%clock64;" : "=l"(t) :: "memory");
  return t;
}

// ids[blockIdx.x] = the block's %smid (one block per SM): the SM ids in use, not assumed to be 0..n-1.
__global__ void ids(int* out) {
  if (threadIdx.x == 0) out[blockIdx.x] = (int)smid();
}

// The block on SM `target` (one block per SM: the dynamic shared memory leaves room for one) walks lines[0..n) of
// buf (uint32 index of each line), one dependent load at a time; lat[i] = cycles of load i.
__global__ void walk(const uint32_t* buf, const uint32_t* lines, int n, int target, uint32_t* lat, int* hit) {
  extern __shared__ uint32_t sink[];
  if ((int)smid() != target || threadIdx.x != 0) return;
  *hit = 1;
  uint32_t v = 0;
  for (int i = 0; i < n; ++i) {
    const uint32_t* p = buf + lines[i] + v;  // v is always 0 (buf is zeroed), but the compiler cannot know
    const long long t0 = clk();
    asm volatile("ld.global.cg.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    *(volatile uint32_t*)sink = v;  // issues once the load is back: the clock below is read after it
    const long long t1 = clk();
    lat[i] = (uint32_t)(t1 - t0);
  }
}

// Every block streams the LIST lines of its SM's list (list[slot[smid] * LIST ...], line indices into buf in 128-byte
// units): 16 warps, each warp-wide load covers 4 lines (8 lanes x 16 B per line), 8 loads per lane in flight.
__global__ void __launch_bounds__(512) stream(const char* buf, const uint32_t* list, const int* slot, float* out) {
  extern __shared__ float xs[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  for (int i = tid; i < 64; i += 512) xs[i] = 0.001f * (i + 1);
  __syncthreads();
  const uint32_t* L = list + (size_t)slot[smid()] * LIST;
  const uint64_t pol = evict_first();
  float acc = 0.f;
  // per batch: 16 warps x 8 loads x 4 lines = 512 lines
  for (int b = 0; b < LIST; b += 512) {
    uint4 v[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const uint32_t line = __ldg(L + b + (warp * 8 + j) * 4 + (lane >> 3));
      v[j] = ldg_w(buf + (size_t)line * 128 + (lane & 7) * 16, pol, true);
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) fma_bf16x8(v[j], xs + (lane & 7) * 8, acc);
  }
  if (acc == 1.2345f) out[0] = acc;
}

// 4. A gate/up tile (64 gate + 64 up rows of 4 KB, the rows given as 4 KB chunk indices: tab[slot * 128 + r] gate
// row r, tab[slot * 128 + 64 + r] up row r), as l2_reuse_micro.cu's k_tile: the first `pf` gate rows asked into L2
// (cp.async.bulk.prefetch.L2, one 4 KB piece per row) by the block of slot (k + shift) % n, a grid barrier, 30 us,
// a grid barrier, then the timed row-pair loop (warp w: rows 4w..4w+3, 4 x 16 B of the gate row and of the up row
// per lane in flight, evict-first hint, bf16 x fp32 FMAs: micro_common.cuh gate_up_pair). times[2k], times[2k+1]:
// globaltimer start / end.
__global__ void __launch_bounds__(512, 1) tile(const char* buf, const uint32_t* tab, const int* slot, int pf,
                                               int shift, unsigned* bars, unsigned long long* times, float* out) {
  __shared__ __align__(16) float xs[2048];
  __shared__ uint32_t rows[128];
  const int n = gridDim.x, k = slot[smid()];
  for (int i = threadIdx.x; i < 2048; i += 512) xs[i] = 1.0f + 1e-3f * i;
  if (threadIdx.x < 128) rows[threadIdx.x] = tab[k * 128 + threadIdx.x];
  if (pf > 0 && threadIdx.x < pf) {
    const int f = (k + shift) % n;
    const char* p = buf + (size_t)tab[f * 128 + threadIdx.x] * 4096;
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(4096) : "memory");
  }
  grid_bar(bars, n);
  if (threadIdx.x == 0) {
    const uint64_t t0 = gtime();
    while (gtime() - t0 < 30000) __nanosleep(256);
  }
  grid_bar(bars + 1, n);
  const unsigned long long t_start = gtime();
  const uint64_t pol = evict_first();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float acc = 0.f;
  for (int r = warp * 4; r < warp * 4 + 4; ++r)
    acc += gate_up_pair(buf + (size_t)rows[r] * 4096, buf + (size_t)rows[64 + r] * 4096, 4096, xs, lane, pol, true);
  __syncthreads();
  if (threadIdx.x == 0) {
    times[2 * k] = t_start;
    times[2 * k + 1] = gtime();
  }
  if (acc == 12345.f) out[0] = acc;
}

int main(int argc, char** argv) {
  const std::string outdir = argc > 1 ? argv[1] : "";
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  const int nsm = prop.multiProcessorCount;
  const int smem = (int)(prop.sharedMemPerBlockOptin / 2 + 1024);  // one block per SM
  CK(cudaFuncSetAttribute(ids, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  CK(cudaFuncSetAttribute(walk, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  CK(cudaFuncSetAttribute(stream, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  printf("%s, %d SMs, L2 %d MB\n", prop.name, nsm, prop.l2CacheSize >> 20);

  uint32_t *buf, *d_lines, *d_lat, *d_out;
  int *d_hit, *d_ids, *d_slot;
  uint4* fl;
  const size_t FL = 256u << 20;
  CK(cudaMalloc(&buf, REGION));
  CK(cudaMemset(buf, 0, REGION));
  CK(cudaMalloc(&fl, FL));
  CK(cudaMemset(fl, 1, FL));
  const int nreg = (int)(REGION / 128);
  CK(cudaMalloc(&d_lines, sizeof(uint32_t) * nreg));
  CK(cudaMalloc(&d_lat, sizeof(uint32_t) * nreg));
  CK(cudaMalloc(&d_out, 64));
  CK(cudaMalloc(&d_hit, sizeof(int)));
  CK(cudaMalloc(&d_ids, sizeof(int) * nsm));
  CK(cudaMalloc(&d_slot, sizeof(int) * 4096));
  // the SM ids in use (slot = index in ascending order)
  ids<<<nsm, 32, smem>>>(d_ids);
  std::vector<int> sid(nsm), slot(4096, 0);
  CK(cudaMemcpy(sid.data(), d_ids, sizeof(int) * nsm, cudaMemcpyDeviceToHost));
  std::sort(sid.begin(), sid.end());
  if (std::unique(sid.begin(), sid.end()) != sid.end() || sid.back() >= 4096) {
    printf("the %d blocks did not land on %d distinct SMs: stop\n", nsm, nsm);
    return 1;
  }
  for (int k = 0; k < nsm; ++k) slot[sid[k]] = k;
  CK(cudaMemcpy(d_slot, slot.data(), sizeof(int) * 4096, cudaMemcpyHostToDevice));
  printf("SM ids %d..%d\n", sid.front(), sid.back());

  auto do_flush = [&] { k_flush<<<nsm * 4, 512>>>(fl, FL / 16, (float*)d_out); };
  auto do_walk = [&](const std::vector<uint32_t>& lines, int k, std::vector<uint32_t>& lat) -> int {
    CK(cudaMemcpy(d_lines, lines.data(), sizeof(uint32_t) * lines.size(), cudaMemcpyHostToDevice));
    CK(cudaMemset(d_hit, 0, sizeof(int)));
    do_flush();
    walk<<<nsm, 32, smem>>>(buf, d_lines, (int)lines.size(), sid[k], d_lat, d_hit);
    CK(cudaDeviceSynchronize());
    int hit = 0;
    CK(cudaMemcpy(&hit, d_hit, sizeof(int), cudaMemcpyDeviceToHost));
    if (hit != 1) printf("SM %d: no block ran there\n", sid[k]);
    lat.resize(lines.size());
    CK(cudaMemcpy(lat.data(), d_lat, sizeof(uint32_t) * lines.size(), cudaMemcpyDeviceToHost));
    return 0;
  };

  // 1. SM map: NP random lines of the first 64 MB, in random order (uint32 index of the line start)
  std::mt19937 rng(1234);
  std::vector<uint32_t> probe(NP);
  for (auto& x : probe) x = (uint32_t)(rng() % ((64u << 20) / 128)) * 32u;
  std::vector<std::vector<uint32_t>> lat(nsm);
  for (int k = 0; k < nsm; ++k)
    if (do_walk(probe, k, lat[k])) return 1;
  // per line: fast (1) where below the line's median over the SMs
  std::vector<std::vector<int>> fast(nsm, std::vector<int>(NP));
  for (int i = 0; i < NP; ++i) {
    std::vector<uint32_t> c(nsm);
    for (int k = 0; k < nsm; ++k) c[k] = lat[k][i];
    std::nth_element(c.begin(), c.begin() + nsm / 2, c.end());
    const uint32_t med = c[nsm / 2];
    for (int k = 0; k < nsm; ++k) fast[k][i] = lat[k][i] < med;
  }
  // group by agreement with the first SM's fast set
  std::vector<int> grp(nsm);
  std::vector<double> agree(nsm);
  double lo1 = 1.0, hi1 = 0.0, lo0 = 1.0;
  for (int k = 0; k < nsm; ++k) {
    int a = 0;
    for (int i = 0; i < NP; ++i) a += fast[k][i] == fast[0][i];
    agree[k] = (double)a / NP;
    grp[k] = agree[k] >= 0.5 ? 0 : 1;
    if (grp[k] == 0) lo0 = std::min(lo0, agree[k]);
    else { lo1 = std::min(lo1, agree[k]); hi1 = std::max(hi1, agree[k]); }
  }
  int n0 = 0;
  for (int k = 0; k < nsm; ++k) n0 += grp[k] == 0;
  printf("\n1. SM map: group 0 (with SM %d) %d SMs, group 1 %d SMs; agreement with SM %d's fast lines: group 0 "
         ">= %.3f, group 1 %.3f..%.3f\n", sid[0], n0, nsm - n0, sid[0], lo0, lo1, hi1);
  printf("   group by SM id (ascending):");
  for (int k = 0; k < nsm; ++k) printf("%s%d", k % 44 == 0 ? "\n   " : "", grp[k]);
  printf("\n");
  {  // mean latency of a line from its near group vs its far group (near: the group whose mean is lower)
    double near = 0, far = 0;
    for (int i = 0; i < NP; ++i) {
      double m[2] = {0, 0};
      int c[2] = {0, 0};
      for (int k = 0; k < nsm; ++k) { m[grp[k]] += lat[k][i]; ++c[grp[k]]; }
      m[0] /= std::max(c[0], 1);
      m[1] /= std::max(c[1], 1);
      near += std::min(m[0], m[1]);
      far += std::max(m[0], m[1]);
    }
    printf("   cold load latency, cycles, mean over the lines: from the near group %.0f, from the far group %.0f\n",
           near / NP, far / NP);
  }

  // 2. line homes over REGION: a sequential walk from 2 SMs of each group
  std::vector<int> g0, g1;
  for (int k = 0; k < nsm; ++k) (grp[k] == 0 ? g0 : g1).push_back(k);
  if (g0.size() < 2 || g1.size() < 2) {
    printf("a group has fewer than 2 SMs: stop\n");
    return 1;
  }
  std::vector<uint32_t> all(nreg);
  for (int i = 0; i < nreg; ++i) all[i] = (uint32_t)i * 32u;
  std::vector<double> d(nreg, 0.0);
  const int walkers[4] = {g0[0], g0[g0.size() / 2], g1[0], g1[g1.size() / 2]};
  for (int w = 0; w < 4; ++w) {
    std::vector<uint32_t> l;
    if (do_walk(all, walkers[w], l)) return 1;
    for (int i = 0; i < nreg; ++i) d[i] += (w < 2 ? 1.0 : -1.0) * l[i];
  }
  // home: 0 where group 0 read it faster (d < 0), 1 where group 1 did; undecided within +-margin
  std::vector<double> ad(nreg);
  for (int i = 0; i < nreg; ++i) ad[i] = std::abs(d[i]);
  std::vector<double> tmp = ad;
  std::nth_element(tmp.begin(), tmp.begin() + nreg / 2, tmp.end());
  const double margin = 0.25 * tmp[nreg / 2];
  std::vector<int8_t> home(nreg);
  int und = 0, h0 = 0;
  for (int i = 0; i < nreg; ++i) {
    home[i] = ad[i] < margin ? -1 : (d[i] < 0 ? 0 : 1);
    und += home[i] < 0;
    h0 += home[i] == 0;
  }
  printf("\n2. line homes over %zu MB (%d lines): group 0 %d, group 1 %d, undecided %d (|d| < %.0f cycles, a "
         "quarter of the median |d|; d = sum of 2 walks from group 0 - 2 from group 1)\n", REGION >> 20, nreg, h0,
         nreg - h0 - und, und, margin);
  printf("   bit: fraction of decided line pairs (a, a ^ 2^bit) with different homes\n   ");
  for (int b = 7; b <= 26; ++b) {
    const int lb = b - 7;
    long long diff = 0, tot = 0;
    for (int i = 0; i < nreg; ++i) {
      const int j = i ^ (1 << lb);
      if (j <= i || j >= nreg || home[i] < 0 || home[j] < 0) continue;
      ++tot;
      diff += home[i] != home[j];
    }
    printf("%d:%.3f%s", b, tot ? (double)diff / tot : -1.0, b == 16 ? "\n   " : " ");
  }
  for (int row = 0; row < 4; ++row) {
    printf("\n   lines %d..%d: ", row * 128, row * 128 + 127);
    for (int i = row * 128; i < row * 128 + 128; ++i) printf("%c", home[i] < 0 ? '?' : '0' + home[i]);
  }
  printf("\n");

  // 3. streaming: per-SM lists of LIST lines
  const size_t nl = (size_t)nsm * LIST;
  std::vector<uint32_t> contig(nl), nearl(nl), farl(nl);
  for (size_t i = 0; i < nl; ++i) contig[i] = (uint32_t)i;
  bool ok = nl <= (size_t)nreg;
  std::vector<std::vector<uint32_t>> pool(2);
  for (int i = 0; i < nreg; ++i)
    if (home[i] >= 0) pool[home[i]].push_back((uint32_t)i);
  for (int mode = 0; mode < 2 && ok; ++mode) {  // 0: near, 1: far
    size_t take[2] = {0, 0};
    auto& dst = mode == 0 ? nearl : farl;
    for (int k = 0; k < nsm && ok; ++k) {
      const int p = mode == 0 ? grp[k] : 1 - grp[k];
      if (take[p] + LIST > pool[p].size()) { ok = false; break; }
      std::copy(pool[p].begin() + take[p], pool[p].begin() + take[p] + LIST, dst.begin() + (size_t)k * LIST);
      take[p] += LIST;
    }
  }
  if (!ok) {
    printf("not enough decided lines of one home for the near / far lists\n");
    return 1;
  }
  uint32_t* d_list;
  CK(cudaMalloc(&d_list, sizeof(uint32_t) * nl));
  printf("\n3. streaming %d x 512 KB (best of 5, a flush before each):", nsm);
  const char* names[3] = {"contiguous", "near-homed", "far-homed"};
  const std::vector<uint32_t>* lists[3] = {&contig, &nearl, &farl};
  cudaEvent_t ea, eb;
  cudaEventCreate(&ea);
  cudaEventCreate(&eb);
  for (int round = 0; round < 2; ++round) {
    printf("\n  ");
    for (int m = 0; m < 3; ++m) {
      CK(cudaMemcpy(d_list, lists[m]->data(), sizeof(uint32_t) * nl, cudaMemcpyHostToDevice));
      float best = 1e9f;
      for (int r = 0; r < 6; ++r) {
        do_flush();
        cudaEventRecord(ea);
        stream<<<nsm, 512, smem>>>((const char*)buf, d_list, d_slot, (float*)d_out);
        cudaEventRecord(eb);
        CK(cudaEventSynchronize(eb));
        float ms;
        cudaEventElapsedTime(&ms, ea, eb);
        if (r > 0) best = std::min(best, ms);
      }
      printf(" %s %.2f us (%.0f GB/s);", names[m], best * 1e3, (double)nl * 128 / (best * 1e-3) / 1e9);
    }
  }
  printf("\n");

  // 4. gate/up tiles from 4 KB chunk tables (a chunk's home: the majority of its 32 lines)
  {
    const int nch = nreg / 32;
    std::vector<std::vector<uint32_t>> cpool(2);
    int cund = 0;
    for (int c = 0; c < nch; ++c) {
      int v[2] = {0, 0};
      for (int i = 0; i < 32; ++i)
        if (home[c * 32 + i] >= 0) ++v[home[c * 32 + i]];
      if (v[0] >= 20 && v[1] <= 3) cpool[0].push_back(c);
      else if (v[1] >= 20 && v[0] <= 3) cpool[1].push_back(c);
      else ++cund;
    }
    printf("\n4. 4 KB chunks: home 0 %zu, home 1 %zu, mixed or undecided %d\n", cpool[0].size(), cpool[1].size(),
           cund);
    const size_t nt = (size_t)nsm * 128;
    std::vector<uint32_t> tc(nt), tn(nt), tf(nt);
    for (size_t i = 0; i < nt; ++i) tc[i] = (uint32_t)i;
    bool ok4 = true;
    for (int mode = 0; mode < 2 && ok4; ++mode) {
      size_t take[2] = {0, 0};
      auto& dst = mode == 0 ? tn : tf;
      for (int k = 0; k < nsm && ok4; ++k) {
        const int p = mode == 0 ? grp[k] : 1 - grp[k];
        if (take[p] + 128 > cpool[p].size()) { ok4 = false; break; }
        std::copy(cpool[p].begin() + take[p], cpool[p].begin() + take[p] + 128, dst.begin() + (size_t)k * 128);
        take[p] += 128;
      }
    }
    if (!ok4) {
      printf("not enough chunks of one home\n");
      return 1;
    }
    uint32_t* d_tab;
    unsigned* d_bars;
    unsigned long long* d_times;
    CK(cudaMalloc(&d_tab, sizeof(uint32_t) * nt));
    CK(cudaMalloc(&d_bars, 64));
    CK(cudaMalloc(&d_times, sizeof(unsigned long long) * 2 * nsm));
    CK(cudaFuncSetAttribute(tile, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    const char* tnames[3] = {"contiguous", "near-homed", "far-homed"};
    const std::vector<uint32_t>* tabs[3] = {&tc, &tn, &tf};
    struct F { const char* name; int pf, shift; };
    const F fetches[3] = {{"cold", 0, 0}, {"192 KB prefetched by its SM", 48, 0},
                          {"192 KB prefetched by SM slot k+n/2", 48, -1}};
    printf("   the tile phase (last end - first start), us, median of 5 launches (each after a flush); per-block "
           "median in ()\n");
    for (const F& fe : fetches) {
      printf("   %-36s", fe.name);
      for (int m = 0; m < 3; ++m) {
        CK(cudaMemcpy(d_tab, tabs[m]->data(), sizeof(uint32_t) * nt, cudaMemcpyHostToDevice));
        std::vector<double> ph, blk;
        for (int r = 0; r < 6; ++r) {
          do_flush();
          CK(cudaMemset(d_bars, 0, 64));
          tile<<<nsm, 512, smem>>>((const char*)buf, d_tab, d_slot, fe.pf, fe.shift < 0 ? nsm / 2 : fe.shift, d_bars,
                                   d_times, (float*)d_out);
          CK(cudaDeviceSynchronize());
          std::vector<unsigned long long> t(2 * nsm);
          CK(cudaMemcpy(t.data(), d_times, sizeof(unsigned long long) * 2 * nsm, cudaMemcpyDeviceToHost));
          unsigned long long lo = ~0ull, hi = 0;
          std::vector<double> b(nsm);
          for (int k = 0; k < nsm; ++k) {
            lo = std::min(lo, t[2 * k]);
            hi = std::max(hi, t[2 * k + 1]);
            b[k] = (t[2 * k + 1] - t[2 * k]) * 1e-3;
          }
          std::sort(b.begin(), b.end());
          if (r > 0) { ph.push_back((hi - lo) * 1e-3); blk.push_back(b[nsm / 2]); }
        }
        std::sort(ph.begin(), ph.end());
        std::sort(blk.begin(), blk.end());
        printf("  %s %.2f (%.2f)", tnames[m], ph[ph.size() / 2], blk[blk.size() / 2]);
      }
      printf("\n");
    }
  }
  CK(cudaGetLastError());
  if (!outdir.empty()) {
    std::vector<int> by_id(4096, -1);
    for (int k = 0; k < nsm; ++k) by_id[sid[k]] = grp[k];
    FILE* f = fopen((outdir + "/l2_home_sm.bin").c_str(), "wb");
    if (f) { fwrite(by_id.data(), sizeof(int), sid.back() + 1, f); fclose(f); }
    f = fopen((outdir + "/l2_home_lines.bin").c_str(), "wb");
    if (f) { fwrite(home.data(), 1, nreg, f); fclose(f); }
  }
  return 0;
}
