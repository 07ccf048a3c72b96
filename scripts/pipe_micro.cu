// Microbenchmark (issue 4, device only): a llama-3.2-1b-shaped decode step's weight stream WITH its dependency
// hops, run two ways, to price the megakernel's hop costs against a warp-specialised bulk-copy pipeline before
// building one. No megakernel around it. Results: docs/PERF.md, forty-fourth session.
//
//   nvcc -O3 -std=c++17 -arch=sm_90a scripts/pipe_micro.cu -o /tmp/pipe_micro && /tmp/pipe_micro [LAYERS [FILTER]]
//   (FILTER: run only the variants whose name contains it)
//
// A "step" is 16 layers of six phases; every block (one per SM) runs every phase, and phase p starts only when all
// blocks have finished phase p-1 (a grid counter, acquire / release, as the megakernel's waits):
//   qkv 96 KB per SM | attn (no weights, a 4 us spin) | merge (1.5 us spin) | o_proj 64 KB | gate/up 512 KB | down 256 KB
// (llama-3.2-1b's 121.6 MB per layer spread over 132 SMs). A phase with weights is a GEMV tile: rows of K = 2048
// bf16 (4 KB) times an fp32 x of 2048 read from global memory after the wait; y written, one fp32 per row.
//
//   reg: the megakernel's register path -- 16 warps, each owns rows r, r + 16 (two at a time), 4 x 16 B of each row
//        per lane in flight (64 KB per SM), x staged in shared memory (split layout); optionally the first `pf` KB
//        of the tile asked into L2 (cp.async.bulk.prefetch.L2) before the wait (the wait prefetch), and the first
//        `gate` KB of the layer's gate/up tile as the attention spin starts (the L2_PREFETCH task): "reg pf64
//        gate192" is the megakernel's register path with both of its prefetches (added in the fiftieth session);
//   tma: a warp-specialised pipeline -- one producer thread streams the block's tiles of ALL phases, in order, into
//        an S-stage ring of B-byte 1-D bulk copies (full / empty mbarriers), never waiting on the grid counters
//        (weights are constant), with at most `win` copies in flight (issued, not landed); 16 consumer warps wait the counter, load x into registers (8 chunks of 8 per lane)
//        and take rows from the ring (row i of a tile -> warp i % 16), one row per warp at a time.
//   tma ... split: the megakernel's ring consumer instead (vm/csrc/ops_gemv.cuh amk_gemv_streamed): every warp takes
//        part in every stage, each stage's rows split over warp groups (16 / rows-per-stage warps per row), partials
//        through shared memory, summed after the tile -- a different summation order, so its y differs in the last
//        bits.
//   tma ... xsm: the row-per-warp consumer reading x from shared memory per row (as the megakernel's does), not
//        from registers; pump ...: the same ring without a producer warp -- 16 warps, and whichever thread waits
//        (thread 0 on a grid counter or in a spin, a consumer's lane 0 on a stage not landed yet) issues the copies
//        the ring allows (pump_try); tma / pump ... items: the megakernel's ring consumer for whole-row work items
//        (2 chunks per lane in flight, x from shared memory, a stash summed after the tile). Added in the fiftieth
//        session to price the in-kernel ring's differences (x from shared memory, the producer warp's 96-register
//        cap, its consumer) one at a time before building them.
//   ... halves: each stage as two bulk copies of half the stage (the megakernel's gate/up stages); the 8 x 16 KB,
//        16 x 8 KB and 4 x 32 KB rings are the 128 KB the megakernel's shared memory leaves next to its op area;
//        nowait ...: the same variant with no phase waiting for the one before (a bound on what hiding every hop is
//        worth). Added in the fifty-first session.
//   reg ... strN: N of the SMs are streamer blocks (pipe_micro.cuh streamer: bulk copies of the weights, in the order
//        the phases read them, into a shared-memory sink, at most ahead_mb past the phase being read, so the lines are
//        in L2 when the compute blocks get there, hops or not); the other SMs run the register path over tiles grown to
//        keep the layer's bytes. "sink128": the register path with the streamer variants' 128 KB of shared memory and
//        no streamers. Added in the fifty-second session; their y is not compared (other tiles).
// reg and the row-per-warp tma consumer sum each row in the same order, so their y must be bit-identical (checked). Printed: the step span (first block
// start -> last block done, median of 5 launches), the effective TB/s, and per phase family the mean window
// (last done of the phase - last done of the phase before) over layers 1-15.
#include "pipe_micro.cuh"  // Phase, Args, waits, pump_try, streamer (and micro_common.cuh)
#include <algorithm>
#include <cstring>
#include <vector>

// The register path (512 threads).
__global__ void __launch_bounds__(kNW * 32, 1) k_reg(Args a) {
  if ((int)blockIdx.x >= a.nblk) {
    streamer(a, (int)blockIdx.x - a.nblk);
    return;
  }
  __shared__ __align__(16) float xs[kK];  // split layout: chunk c's elements 0-3 at float4 c, 4-7 at float4 K/8 + c
  const int b = blockIdx.x, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const uint64_t pol = evict_first();
  stamp_start(a);
  for (int p = 0; p < a.n_ph; ++p) {
    const Phase ph = a.ph[p];
    const char* tile = a.W + ph.w_off + (size_t)b * ph.tile_bytes;
    if (threadIdx.x == 0) {
      if (a.pf_bytes > 0 && ph.tile_bytes > 0 && p > 0)
        prefetch_l2(tile, (uint32_t)(a.pf_bytes < ph.tile_bytes ? a.pf_bytes : ph.tile_bytes));
      if (p > 0 && !a.nowait) wait_ctr(a.ctr + p - 1, a.nblk);
    }
    __syncthreads();
    if (ph.tile_bytes == 0) {
      if (threadIdx.x == 0) {
        if (a.gate_pf_bytes > 0 && ph.fam == 1 && p + 3 < a.n_ph) {  // attention spin: gate/up is 3 phases on
          const Phase g = a.ph[p + 3];
          prefetch_l2(a.W + g.w_off + (size_t)b * g.tile_bytes,
                      (uint32_t)(a.gate_pf_bytes < g.tile_bytes ? a.gate_pf_bytes : g.tile_bytes));
        }
        spin(ph.spin_ns);
      }
    } else {
      const float4* x4 = (const float4*)(a.X + (size_t)p * kK);
      float4* xs4 = (float4*)xs;
      for (int c = threadIdx.x; c < kChunks; c += kNW * 32) {
        xs4[c] = __ldcg(x4 + 2 * c);
        xs4[kChunks + c] = __ldcg(x4 + 2 * c + 1);
      }
      __syncthreads();
      const int rows = (int)(ph.tile_bytes / kRowBytes);
      float* y = a.Y + ((size_t)p * a.nblk + b) * a.max_rows;
      for (int r = warp; r < rows; r += 2 * kNW) {
        const int r2 = r + kNW;
        const bool two = r2 < rows;
        const char* w0 = tile + (size_t)r * kRowBytes;
        const char* w1 = tile + (size_t)(two ? r2 : r) * kRowBytes;
        float acc0 = 0.f, acc1 = 0.f;
        for (int c = lane; c < kChunks; c += 32 * 4) {
          uint4 v0[4], v1[4];
#pragma unroll
          for (int u = 0; u < 4; ++u) {
            v0[u] = ldg_w(w0 + (size_t)(c + 32 * u) * 16, pol, true);
            v1[u] = two ? ldg_w(w1 + (size_t)(c + 32 * u) * 16, pol, true) : make_uint4(0, 0, 0, 0);
          }
#pragma unroll
          for (int u = 0; u < 4; ++u) {
            const int cc = c + 32 * u;
            const float4 xa = xs4[cc], xb = xs4[kChunks + cc];
            fma8(v0[u], xa, xb, acc0);
            fma8(v1[u], xa, xb, acc1);
          }
        }
        acc0 = warp_sum(acc0);
        acc1 = warp_sum(acc1);
        if (lane == 0) {
          y[r] = acc0;
          if (two) y[r2] = acc1;
        }
      }
    }
    __syncthreads();
    if (threadIdx.x == 0) finish_phase(a, p);
  }
}

// The warp-specialised bulk-copy pipeline (16 consumer warps + 1 producer warp). PUMP: no producer warp (a.pump);
// XSM: x read from shared memory (a.xsm). ITEMS: the megakernel's ring consumer for whole-row items instead
// (vm/csrc/ops_gemv.cuh amk_gemv_streamed with 4 KB rows: two 16-byte chunks per lane in flight (AMK_RING_U), x
// from shared memory, the row's sum into a shared stash that the block sums after the tile -- the same bits).
// Template switches, so the first variants' code is as it was measured.
template <bool PUMP, bool XSM, bool ITEMS>
__global__ void __launch_bounds__(PUMP ? kNW * 32 : (kNW + 1) * 32, 1) k_tma(Args a) {
  __shared__ Pump P;
  __shared__ __align__(16) float xs[kK];  // linear
  __shared__ __align__(8) uint64_t full[kMaxStages], empty[kMaxStages];
  __shared__ float stash[512 * 1024 / kRowBytes * kNW];  // split: per (row, sub-warp) partials of a tile
  const int b = blockIdx.x, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int S = a.S, B = a.B, rps = B / kRowBytes;
  if (threadIdx.x == 0) {
    for (int s = 0; s < S; ++s) {
      mbar_init(saddr(full + s));  // one arrival (the producer's expect_tx) + the bytes
      asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(saddr(empty + s)), "r"(a.split ? kNW : rps)
                   : "memory");
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    P.lock = 0;
    P.issued = 0;
    P.p = 0;
    P.off = 0;
  }
  stamp_start(a);
  __syncthreads();
  if (PUMP && threadIdx.x == 0) pump_try(a, &P, full, empty);  // the first copies, before any wait
  if (warp == kNW) {  // producer
    if (lane == 0) {
      const uint64_t pol = evict_first();
      uint32_t n = 0;
      for (int p = 0; p < a.n_ph; ++p) {
        const Phase ph = a.ph[p];
        const char* tile = a.W + ph.w_off + (size_t)b * ph.tile_bytes;
        for (long long off = 0; off < ph.tile_bytes; off += B, ++n) {
          const uint32_t slot = n % S;
          if (n >= (uint32_t)S) mbar_wait(saddr(empty + slot), ((n / S) - 1) & 1);
          if (n >= (uint32_t)a.win) {  // the copy `win` stages back has landed: at most win in flight
            const uint32_t m = n - a.win;
            mbar_wait(saddr(full + m % S), (m / S) & 1);
          }
          mbar_expect(saddr(full + slot), (uint32_t)B);
          if (a.halves) {
            const uint32_t h = (uint32_t)B / 2;
            bulk_g2s(saddr(dyn + (size_t)slot * B), tile + off, h, saddr(full + slot), true, pol);
            bulk_g2s(saddr(dyn + (size_t)slot * B + h), tile + off + h, h, saddr(full + slot), true, pol);
          } else {
            bulk_g2s(saddr(dyn + (size_t)slot * B), tile + off, (uint32_t)B, saddr(full + slot), true, pol);
          }
        }
      }
    }
    return;  // (every copy completes before the consumers, which wait for all of them, finish)
  }
  uint32_t seq = 0;  // rows of the block's stream consumed so far (all consumer threads alike)
  for (int p = 0; p < a.n_ph; ++p) {
    const Phase ph = a.ph[p];
    if (threadIdx.x == 0 && p > 0 && !a.nowait) {
      wait_ctr(a.ctr + p - 1, a.nblk, [&] {
        if (PUMP) pump_try(a, &P, full, empty);  // pump variants: the ring keeps filling while thread 0 polls
      });
    }
    asm volatile("bar.sync 1, %0;" :: "n"(kNW * 32) : "memory");
    if (ph.tile_bytes == 0) {
      if (threadIdx.x == 0) {
        spin(ph.spin_ns, [&] {
          if (PUMP) pump_try(a, &P, full, empty);
        });
      }
    } else {
      const float4* x4 = (const float4*)(a.X + (size_t)p * kK);
      for (int i = threadIdx.x; i < kK / 4; i += kNW * 32) ((float4*)xs)[i] = __ldcg(x4 + i);
      asm volatile("bar.sync 1, %0;" :: "n"(kNW * 32) : "memory");
      float4 xa[kCpl], xb[kCpl];  // x of this lane's chunks lane + 32 j
#pragma unroll
      for (int j = 0; j < kCpl; ++j) {
        xa[j] = ((const float4*)xs)[2 * (lane + 32 * j)];
        xb[j] = ((const float4*)xs)[2 * (lane + 32 * j) + 1];
      }
      const int rows = (int)(ph.tile_bytes / kRowBytes);
      float* y = a.Y + ((size_t)p * a.nblk + b) * a.max_rows;
      if (a.split) {  // every warp takes part in every stage: wpr warps per row, partials via shared memory
        const int wpr = kNW / rps, groups = kNW / wpr, gi = warp / wpr, sub = warp - gi * wpr;
        for (int r0 = 0; r0 < rows; r0 += rps) {
          const uint32_t n = (seq + r0) / rps, slot = n % S;
          stage_wait<PUMP>(a, &P, full, empty, saddr(full + slot), (n / S) & 1);
          const char* st = (const char*)dyn + (size_t)slot * B;
          for (int r = gi; r < rps && gi < groups; r += groups) {
            float acc = 0.f;
            for (int c = sub * 32 + lane; c < kChunks; c += 32 * wpr) {
              uint4 v;
              asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                           : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(saddr(st + (size_t)r * kRowBytes + c * 16)));
              fma8(v, ((const float4*)xs)[2 * c], ((const float4*)xs)[2 * c + 1], acc);
            }
            acc = warp_sum(acc);
            if (lane == 0) stash[(r0 + r) * wpr + sub] = acc;
          }
          __syncwarp();
          if (lane == 0)
            asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(saddr(empty + slot)) : "memory");
        }
        asm volatile("bar.sync 1, %0;" :: "n"(kNW * 32) : "memory");
        for (int r = threadIdx.x; r < rows; r += kNW * 32) {
          float acc = 0.f;
          for (int j = 0; j < wpr; ++j) acc += stash[r * wpr + j];
          y[r] = acc;
        }
        seq += rows;
        goto phase_done;
      }
      for (int r = warp; r < rows; r += kNW) {
        const uint32_t g = seq + r, n = g / rps, slot = n % S;
        stage_wait<PUMP>(a, &P, full, empty, saddr(full + slot), (n / S) & 1);
        const char* row = (const char*)dyn + (size_t)slot * B + (size_t)(g % rps) * kRowBytes;
        float acc = 0.f;
        if (ITEMS) {
#pragma unroll 1
          for (int j = 0; j < kCpl; j += 2) {
            uint4 w[2];
#pragma unroll
            for (int u = 0; u < 2; ++u)
              asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                           : "=r"(w[u].x), "=r"(w[u].y), "=r"(w[u].z), "=r"(w[u].w)
                           : "r"(saddr(row + (size_t)(lane + 32 * (j + u)) * 16)));
#pragma unroll
            for (int u = 0; u < 2; ++u) {
              const int c = lane + 32 * (j + u);
              fma8(w[u], ((const float4*)xs)[2 * c], ((const float4*)xs)[2 * c + 1], acc);
            }
          }
        } else {
          uint4 v[kCpl];
#pragma unroll
          for (int j = 0; j < kCpl; ++j)
            asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                         : "=r"(v[j].x), "=r"(v[j].y), "=r"(v[j].z), "=r"(v[j].w)
                         : "r"(saddr(row + (size_t)(lane + 32 * j) * 16)));
          if (XSM) {  // x from shared memory, as the megakernel's ring consumer reads it
#pragma unroll
            for (int j = 0; j < kCpl; ++j)
              fma8(v[j], ((const float4*)xs)[2 * (lane + 32 * j)], ((const float4*)xs)[2 * (lane + 32 * j) + 1], acc);
          } else {
#pragma unroll
            for (int j = 0; j < kCpl; ++j) fma8(v[j], xa[j], xb[j], acc);
          }
        }
        acc = warp_sum(acc);  // (every lane's shared loads are consumed before lane 0 releases the slot)
        if (lane == 0) {
          if (ITEMS) stash[r] = acc;
          else y[r] = acc;
          asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(saddr(empty + slot)) : "memory");
        }
      }
      if (ITEMS) {  // the stash summed after the tile (one partial per row here: the same value)
        asm volatile("bar.sync 1, %0;" :: "n"(kNW * 32) : "memory");
        for (int r = threadIdx.x; r < rows; r += kNW * 32) y[r] = stash[r];
      }
      seq += rows;
    }
  phase_done:
    asm volatile("bar.sync 1, %0;" :: "n"(kNW * 32) : "memory");
    if (threadIdx.x == 0) finish_phase(a, p);
  }
}

__global__ void k_fill(uint16_t* w, size_t n, uint32_t seed) {  // random bf16 in about [-1/16, 1/16]
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    uint32_t h = (uint32_t)i * 2654435761u ^ seed;
    h ^= h >> 15; h *= 2246822519u; h ^= h >> 13;
    const float f = ((h & 0xffff) / 65536.f - 0.5f) * 0.125f;
    w[i] = (uint16_t)(__float_as_uint(f) >> 16);
  }
}

struct Variant {
  const char* name;
  bool tma;
  int pf_kb, S, B, win, split;
  int dyn_kb;   // reg: unused dynamic shared memory (the megakernel's carve-out: ~76 KB)
  int gate_kb;  // reg: gate/up tile head asked into L2 during the attention spin (0: none)
  int pump = 0, xsm = 0;  // tma: no producer warp / x from shared memory (Args)
  int items = 0;          // tma: the megakernel's work-item consumer (k_tma's ITEMS)
  int halves = 0;         // tma: two copies per stage (Args::halves)
  int nowait = 0;         // no hops (Args::nowait): a bound
  int n_str = 0, str_kb = 32, str_slots = 4, ahead_mb = 16;  // reg: streamer blocks (Args::n_str ...)
  int dyn_big = 0;        // reg: dynamic shared memory as the streamer variants' (str_slots x str_kb), no streamers
};

int main(int argc, char** argv) {
  int dev = 0, nsm = 0;
  CK(cudaGetDevice(&dev));
  CK(cudaDeviceGetAttribute(&nsm, cudaDevAttrMultiProcessorCount, dev));
  const int layers = argc > 1 ? atoi(argv[1]) : 16;
  // the phases of one layer: (KB per SM of 132, spin ns, family); with fewer compute blocks (streamer variants)
  // each tile grows to keep the layer's bytes (rounded up to whole rows)
  const int fam_kb[6] = {96, 0, 0, 64, 512, 256};
  const int fam_spin[6] = {0, 4000, 1500, 0, 0, 0};
  const char* fam_name[6] = {"qkv", "attn", "merge", "o_proj", "gate/up", "down"};
  auto build = [&](int nb, std::vector<Phase>& out) {
    out.clear();
    long long o = 0;
    for (int l = 0; l < layers; ++l)
      for (int f = 0; f < 6; ++f) {
        const long long rows = ((long long)fam_kb[f] * 1024 * nsm / nb + kRowBytes - 1) / kRowBytes;
        const long long tb = rows * kRowBytes;
        out.push_back(Phase{tb, o, fam_spin[f], f});
        o += tb * nb;
      }
    return o;
  };
  const int kMaxStr = 32;
  std::vector<Phase> ph;
  const size_t wmax = (size_t)build(nsm - kMaxStr, ph);
  const int nblk = nsm;
  const size_t wbytes = (size_t)build(nblk, ph);
  long long per_blk = 0;
  for (const Phase& q : ph) per_blk += q.tile_bytes;
  // rows per tile at most: gate/up grows to 169 rows of 4 KB with kMaxStr streamers on 132 SMs
  const int n_ph = (int)ph.size(), max_rows = 2 * 512 * 1024 / kRowBytes;
  printf("pipe_micro: %d SMs, %d layers x 6 phases, %.1f MB of weights (%.0f KB per SM per layer)\n", nsm, layers,
         wbytes / 1e6, per_blk / 1024.0 / layers);
  char* W;
  float *X, *Y, *Yref;
  unsigned *ctr, *smid;
  unsigned long long *t_done, *t_start;
  Phase* dph;
  CK(cudaMalloc(&W, wmax));
  CK(cudaMalloc(&X, (size_t)n_ph * kK * 4));
  CK(cudaMalloc(&Y, (size_t)n_ph * nblk * max_rows * 4));
  CK(cudaMalloc(&Yref, (size_t)n_ph * nblk * max_rows * 4));
  CK(cudaMalloc(&ctr, n_ph * 4));
  CK(cudaMalloc(&smid, nblk * 4));
  CK(cudaMalloc(&t_done, (size_t)n_ph * nblk * 8));
  CK(cudaMalloc(&t_start, nblk * 8));
  CK(cudaMalloc(&dph, n_ph * sizeof(Phase)));
  CK(cudaMemcpy(dph, ph.data(), n_ph * sizeof(Phase), cudaMemcpyHostToDevice));
  k_fill<<<1024, 256>>>((uint16_t*)W, wmax / 2, 1u);
  {
    std::vector<float> hx((size_t)n_ph * kK);
    for (size_t i = 0; i < hx.size(); ++i) hx[i] = 0.5f + (float)((i * 7919) % 1000) / 1000.f;
    CK(cudaMemcpy(X, hx.data(), hx.size() * 4, cudaMemcpyHostToDevice));
  }
  CK(cudaDeviceSynchronize());

  // argv[2] (optional): run only the variants whose name contains it ("reg", "win", "split", ...)
  const Variant vs[] = {
      {"reg", false, 0, 0, 0, 0, 0, 76, 0},
      {"reg pf64 gate192 (the megakernel's prefetches)", false, 64, 0, 0, 0, 0, 76, 192},
      {"tma 12x16K win2", true, 0, 12, 16384, 2, 0, 0, 0},
      {"tma 12x16K win1", true, 0, 12, 16384, 1, 0, 0, 0},
      {"tma 24x8K win2", true, 0, 24, 8192, 2, 0, 0, 0},
      {"tma 24x8K win3", true, 0, 24, 8192, 3, 0, 0, 0},
      {"tma 24x8K win4", true, 0, 24, 8192, 4, 0, 0, 0},
      {"tma 24x8K win6", true, 0, 24, 8192, 6, 0, 0, 0},
      {"tma 24x8K win6 xsm", true, 0, 24, 8192, 6, 0, 0, 0, 0, 1},
      {"pump 24x8K win6", true, 0, 24, 8192, 6, 0, 0, 0, 1, 0},
      {"pump 12x16K win2", true, 0, 12, 16384, 2, 0, 0, 0, 1, 0},
      {"pump 24x8K win6 xsm", true, 0, 24, 8192, 6, 0, 0, 0, 1, 1},
      {"tma 24x8K win6 items", true, 0, 24, 8192, 6, 0, 0, 0, 0, 0, 1},
      {"pump 24x8K win6 items", true, 0, 24, 8192, 6, 0, 0, 0, 1, 0, 1},
      // the ring sizes the megakernel's shared memory leaves (128 KB next to its op area; fifty-first session)
      {"tma 8x16K win2 items", true, 0, 8, 16384, 2, 0, 0, 0, 0, 0, 1},
      {"tma 8x16K win4 items", true, 0, 8, 16384, 4, 0, 0, 0, 0, 0, 1},
      {"tma 16x8K win6 items", true, 0, 16, 8192, 6, 0, 0, 0, 0, 0, 1},
      {"tma 4x32K win2 items", true, 0, 4, 32768, 2, 0, 0, 0, 0, 0, 1},
      {"tma 8x16K win2 items halves", true, 0, 8, 16384, 2, 0, 0, 0, 0, 0, 1, 1},
      {"tma 24x8K win6 items halves", true, 0, 24, 8192, 6, 0, 0, 0, 0, 0, 1, 1},
      {"tma 12x16K win2 items", true, 0, 12, 16384, 2, 0, 0, 0, 0, 0, 1},
      // streamer blocks (fifty-second session): n_str SMs only bulk-copy the weights ahead into L2 (a sink), the
      // other SMs compute with the register path; {name, tma, pf, S, B, win, split, dyn, gate, pump, xsm, items,
      // halves, nowait, n_str, str_kb, str_slots, ahead_mb, dyn_big}
      {"reg pf64 gate192 sink128", false, 64, 0, 0, 0, 0, 76, 192, 0, 0, 0, 0, 0, 0, 32, 4, 16, 1},
      {"reg str8", false, 0, 0, 0, 0, 0, 76, 0, 0, 0, 0, 0, 0, 8, 32, 4, 16},
      {"reg str16", false, 0, 0, 0, 0, 0, 76, 0, 0, 0, 0, 0, 0, 16, 32, 4, 16},
      {"reg str16 ahead8", false, 0, 0, 0, 0, 0, 76, 0, 0, 0, 0, 0, 0, 16, 32, 4, 8},
      {"reg str16 ahead32", false, 0, 0, 0, 0, 0, 76, 0, 0, 0, 0, 0, 0, 16, 32, 4, 32},
      {"reg str16 6x32K", false, 0, 0, 0, 0, 0, 76, 0, 0, 0, 0, 0, 0, 16, 32, 6, 16},
      {"reg str24", false, 0, 0, 0, 0, 0, 76, 0, 0, 0, 0, 0, 0, 24, 32, 4, 16},
      {"reg str32", false, 0, 0, 0, 0, 0, 76, 0, 0, 0, 0, 0, 0, 32, 32, 4, 16},
      {"reg pf64 gate192 str16", false, 64, 0, 0, 0, 0, 76, 192, 0, 0, 0, 0, 0, 16, 32, 4, 16},
      {"nowait reg str16", false, 0, 0, 0, 0, 0, 76, 0, 0, 0, 0, 0, 1, 16, 32, 4, 16},
      // bounds: the same streams without the hops (nothing waits for the phase before)
      {"nowait reg pf64 gate192", false, 64, 0, 0, 0, 0, 76, 192, 0, 0, 0, 0, 1},
      {"nowait tma 24x8K win6", true, 0, 24, 8192, 6, 0, 0, 0, 0, 0, 0, 0, 1},
      {"nowait tma 12x16K win2 items", true, 0, 12, 16384, 2, 0, 0, 0, 0, 0, 1, 0, 1},
      {"tma 12x16K win2 split", true, 0, 12, 16384, 2, 1, 0, 0},
      {"tma 24x8K win6 split", true, 0, 24, 8192, 6, 1, 0, 0},
      {"tma 6x32K win2 split", true, 0, 6, 32768, 2, 1, 0, 0},
  };
  const char* only = argc > 2 ? argv[2] : nullptr;
  printf("\n| variant | step us (median of 5) | TB/s | SMs used | y vs reg |");
  for (int f = 0; f < 6; ++f) printf(" %s |", fam_name[f]);
  printf("\n|---|---|---|---|---|---|---|---|---|---|---|\n");
  bool have_ref = false;
  for (const Variant& v : vs) {
    if (only != nullptr && strstr(v.name, only) == nullptr) continue;
    if (v.n_str < 0 || v.n_str > kMaxStr) {  // (W and Y are sized for at most kMaxStr streamers)
      printf("| %s | skipped: n_str %d outside 0..%d |\n", v.name, v.n_str, kMaxStr);
      continue;
    }
    const int nb = nsm - v.n_str;  // compute blocks
    std::vector<Phase> phv;
    const size_t wb = (size_t)build(nb, phv);
    CK(cudaMemcpy(dph, phv.data(), n_ph * sizeof(Phase), cudaMemcpyHostToDevice));
    Args a{W, X, Y, ctr, t_done, t_start, smid, dph, n_ph, nb, max_rows, v.pf_kb * 1024, v.S, v.B, v.win, v.split,
           v.gate_kb * 1024, v.pump, v.xsm, v.halves, v.nowait, v.n_str, v.str_kb * 1024, v.str_slots,
           (long long)v.ahead_mb << 20};
    const int threads = v.tma && !v.pump ? (kNW + 1) * 32 : kNW * 32;
    const int sink = (v.n_str || v.dyn_big) ? v.str_slots * v.str_kb * 1024 + 8 * v.str_slots : 0;
    const int dyn_bytes = v.tma ? v.S * v.B : std::max(v.dyn_kb * 1024, sink);
    void (*kt)(Args) = nullptr;
    if (v.tma)
      kt = v.items ? (v.pump ? k_tma<true, false, true> : k_tma<false, false, true>)
           : v.pump ? (v.xsm ? k_tma<true, true, false> : k_tma<true, false, false>)
                    : (v.xsm ? k_tma<false, true, false> : k_tma<false, false, false>);
    CK(cudaFuncSetAttribute(v.tma ? kt : k_reg, cudaFuncAttributeMaxDynamicSharedMemorySize, dyn_bytes));
    std::vector<double> spans;
    std::vector<double> fam_sum(6, 0.0);
    std::vector<int> fam_n(6, 0);
    for (int rep = 0; rep < 6; ++rep) {
      CK(cudaMemset(ctr, 0, n_ph * 4));
      CK(cudaMemset(Y, 0, (size_t)n_ph * nblk * max_rows * 4));
      if (v.tma) kt<<<nblk, threads, dyn_bytes>>>(a);
      else k_reg<<<nsm, threads, dyn_bytes>>>(a);
      CK(cudaGetLastError());
      CK(cudaDeviceSynchronize());
      if (rep == 0) continue;  // warm-up
      std::vector<unsigned long long> td((size_t)n_ph * nb), ts(nb);
      CK(cudaMemcpy(td.data(), t_done, td.size() * 8, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(ts.data(), t_start, ts.size() * 8, cudaMemcpyDeviceToHost));
      std::vector<unsigned long long> end(n_ph);
      for (int p = 0; p < n_ph; ++p) end[p] = *std::max_element(td.begin() + (size_t)p * nb, td.begin() + (size_t)(p + 1) * nb);
      const unsigned long long t0 = *std::min_element(ts.begin(), ts.end());
      spans.push_back((end[n_ph - 1] - t0) / 1e3);
      for (int p = 6; p < n_ph; ++p) {  // layers 1..: window = last done - last done of the phase before
        fam_sum[ph[p].fam] += (end[p] - end[p - 1]) / 1e3;
        fam_n[ph[p].fam] += 1;
      }
    }
    std::sort(spans.begin(), spans.end());
    const double us = spans[spans.size() / 2];
    std::vector<unsigned> hs(nb);
    CK(cudaMemcpy(hs.data(), smid, nb * 4, cudaMemcpyDeviceToHost));
    std::sort(hs.begin(), hs.end());
    const int distinct = (int)(std::unique(hs.begin(), hs.end()) - hs.begin());
    const size_t ny = (size_t)n_ph * nblk * max_rows;
    long long diff = -1;  // (streamer variants: other tiles, not compared)
    if (v.n_str == 0 && !have_ref) {
      CK(cudaMemcpy(Yref, Y, ny * 4, cudaMemcpyDeviceToDevice));
      have_ref = true;
      diff = 0;
    } else if (v.n_str == 0) {
      std::vector<float> h1(ny), h2(ny);
      CK(cudaMemcpy(h1.data(), Y, ny * 4, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(h2.data(), Yref, ny * 4, cudaMemcpyDeviceToHost));
      diff = 0;
      for (size_t i = 0; i < ny; ++i) diff += h1[i] != h2[i];
    }
    printf("| %s | %.1f | %.2f | %d | %lld differ |", v.name, us, wb / (us * 1e-6) / 1e12, distinct, diff);
    for (int f = 0; f < 6; ++f) printf(" %.2f |", fam_n[f] ? fam_sum[f] / fam_n[f] : 0.0);
    printf("\n");
  }
  printf("\nfamily columns: mean window per layer (us), layers 1-%d\n", layers - 1);
  return 0;
}
