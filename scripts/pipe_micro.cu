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
// reg and the row-per-warp tma consumer sum each row in the same order, so their y must be bit-identical (checked). Printed: the step span (first block
// start -> last block done, median of 5 launches), the effective TB/s, and per phase family the mean window
// (last done of the phase - last done of the phase before) over layers 1-15.
#include "micro_common.cuh"  // CK, saddr, mbar_*, bulk_g2s, ldg_w, evict_first, gtime
#include <algorithm>
#include <cstring>
#include <vector>

constexpr int kK = 2048, kRowBytes = kK * 2, kChunks = kRowBytes / 16, kCpl = kChunks / 32;  // 8 chunks per lane
constexpr int kNW = 16;  // compute warps
constexpr int kMaxStages = 32;

struct Phase {
  long long tile_bytes;  // per block (0: a spin phase)
  long long w_off;       // block b's tile at W + w_off + b * tile_bytes
  int spin_ns;
  int fam;               // family index (printing)
};
struct Args {
  const char* W;
  const float* X;              // [n_ph][kK]
  float* Y;                    // [n_ph][nblk][max_rows]
  unsigned* ctr;               // [n_ph], zeroed before each launch
  unsigned long long* t_done;  // [n_ph][nblk]
  unsigned long long* t_start; // [nblk]
  unsigned* smid;              // [nblk]
  const Phase* ph;
  int n_ph, nblk, max_rows;
  int pf_bytes;                // reg: wait prefetch per tile
  int S, B;                    // tma: stages, stage bytes
  int win;                     // tma: at most this many copies in flight (issued, not landed)
  int split;                   // tma: the megakernel's consumer (each stage's rows split over warp groups)
  int gate_pf_bytes;           // reg: the first bytes of the layer's gate/up tile asked into L2 as the attention
                               // spin starts (the megakernel's L2_PREFETCH task, mlp_prefetch_kb)
  int pump;                    // tma: no producer warp -- the block's waiting threads issue the copies (pump_try)
  int xsm;                     // tma: the consumers read x from shared memory per row, not from registers
  int halves;                  // tma: each stage as two bulk copies of B / 2 (the megakernel's gate/up stages: gate
                               // rows, then up rows)
  int nowait;                  // no phase waits for the one before (a bound: the same bytes and spins without the
                               // hops; y is unchanged, x does not depend on earlier phases here)
};

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ void fma8(const uint4& v, const float4& a, const float4& b, float& acc) {
  acc = fmaf(__uint_as_float(v.x << 16), a.x, acc); acc = fmaf(__uint_as_float(v.x & 0xffff0000u), a.y, acc);
  acc = fmaf(__uint_as_float(v.y << 16), a.z, acc); acc = fmaf(__uint_as_float(v.y & 0xffff0000u), a.w, acc);
  acc = fmaf(__uint_as_float(v.z << 16), b.x, acc); acc = fmaf(__uint_as_float(v.z & 0xffff0000u), b.y, acc);
  acc = fmaf(__uint_as_float(v.w << 16), b.z, acc); acc = fmaf(__uint_as_float(v.w & 0xffff0000u), b.w, acc);
}
// Wait until *c >= n (acquire); gives up after 50 ms so a bug cannot hang the GPU (the timings are then garbage).
// (idle(): between two polls, as mbar_wait's.)
template <class Idle = NoIdle>
__device__ __forceinline__ void wait_ctr(const unsigned* c, unsigned n, Idle idle = {}) {
  const uint64_t t0 = gtime();
  for (;;) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(c) : "memory");
    if (v >= n || gtime() - t0 > 50000000ull) return;
    idle();
  }
}
__device__ __forceinline__ void signal_ctr(unsigned* c) {
  asm volatile("red.release.gpu.global.add.u32 [%0], 1;" :: "l"(c) : "memory");
}
template <class Idle = NoIdle>
__device__ __forceinline__ void spin(int ns, Idle idle = {}) {
  const uint64_t t0 = gtime();
  while (gtime() - t0 < (uint64_t)ns) idle();
}
__device__ __forceinline__ void prefetch_l2(const char* p, uint32_t bytes) {
  for (uint32_t o = 0; o < bytes; o += 4096)
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(p + o), "r"(4096u) : "memory");
}
// Non-blocking: has the phase of parity `parity` of the mbarrier completed?
__device__ __forceinline__ bool mbar_test(uint32_t bar, uint32_t parity) {
  uint32_t ok;
  asm volatile("{\n .reg .pred q;\n mbarrier.test_wait.parity.shared::cta.b64 q, [%1], %2;\n selp.u32 %0, 1, 0, q;\n}"
               : "=r"(ok) : "r"(bar), "r"(parity) : "memory");
  return ok != 0;
}

// The ring without a producer warp ("pump" variants): whichever thread of the block is waiting -- thread 0 on a
// grid counter or in a spin phase, a consumer lane 0 on a stage that has not landed -- takes the lock and issues
// every copy the ring allows now, in stream order (the slot free, at most `win` copies in flight), then returns.
// Someone waits whenever a copy is still needed, so the stream always makes progress; a block then launches 16
// warps (512 threads: 128 registers) instead of 17 (96).
struct Pump {
  int lock;
  uint32_t issued;  // copies issued so far
  int p;            // phase of the next copy
  long long off;    // its offset in that phase's tile
};
extern __shared__ __align__(128) unsigned char dyn[];
__device__ __noinline__ void pump_try(const Args& a, Pump* P, uint64_t* full, uint64_t* empty) {
  if (atomicCAS(&P->lock, 0, 1) != 0) return;
  __threadfence_block();
  const uint32_t S = (uint32_t)a.S, B = (uint32_t)a.B;
  const uint64_t pol = evict_first();
  volatile Pump* V = P;
  uint32_t n = V->issued;
  int p = V->p;
  long long off = V->off;
  while (p < a.n_ph) {
    const Phase ph = a.ph[p];
    if (off >= ph.tile_bytes) {
      ++p;
      off = 0;
      continue;
    }
    const uint32_t slot = n % S;
    if (n >= S && !mbar_test(saddr(empty + slot), ((n / S) - 1) & 1)) break;
    if (n >= (uint32_t)a.win && !mbar_test(saddr(full + (n - a.win) % S), ((n - a.win) / S) & 1)) break;
    mbar_expect(saddr(full + slot), B);
    bulk_g2s(saddr(dyn + (size_t)slot * B), a.W + ph.w_off + (size_t)blockIdx.x * ph.tile_bytes + off, B,
             saddr(full + slot), true, pol);
    off += B;
    ++n;
  }
  V->issued = n;
  V->p = p;
  V->off = off;
  __threadfence_block();
  atomicExch(&P->lock, 0);
}
// A consumer waits for a stage (pump variants: lane 0 pumps meanwhile).
template <bool PUMP>
__device__ __forceinline__ void stage_wait(const Args& a, Pump* P, uint64_t* full, uint64_t* empty, uint32_t bar,
                                           uint32_t parity) {
  mbar_wait(bar, parity, [&] {
    if (PUMP && (threadIdx.x & 31) == 0) pump_try(a, P, full, empty);
  });
}

__device__ __forceinline__ void stamp_start(const Args& a) {
  if (threadIdx.x == 0) {
    a.t_start[blockIdx.x] = gtime();
    unsigned s;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
    a.smid[blockIdx.x] = s;
  }
}
// Thread 0 after the block's phase barrier: stamp, then release its count.
__device__ __forceinline__ void finish_phase(const Args& a, int p) {
  a.t_done[(size_t)p * a.nblk + blockIdx.x] = gtime();
  signal_ctr(a.ctr + p);
}

// The register path (512 threads).
__global__ void __launch_bounds__(kNW * 32, 1) k_reg(Args a) {
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
};

int main(int argc, char** argv) {
  int dev = 0, nsm = 0;
  CK(cudaGetDevice(&dev));
  CK(cudaDeviceGetAttribute(&nsm, cudaDevAttrMultiProcessorCount, dev));
  const int layers = argc > 1 ? atoi(argv[1]) : 16;
  const int nblk = nsm;
  // the phases of one layer: (KB per SM, spin ns, family)
  const int fam_kb[6] = {96, 0, 0, 64, 512, 256};
  const int fam_spin[6] = {0, 4000, 1500, 0, 0, 0};
  const char* fam_name[6] = {"qkv", "attn", "merge", "o_proj", "gate/up", "down"};
  std::vector<Phase> ph;
  long long off = 0, per_blk = 0;
  for (int l = 0; l < layers; ++l)
    for (int f = 0; f < 6; ++f) {
      const long long tb = (long long)fam_kb[f] * 1024;
      ph.push_back(Phase{tb, off, fam_spin[f], f});
      off += tb * nblk;
      per_blk += tb;
    }
  const int n_ph = (int)ph.size(), max_rows = 512 * 1024 / kRowBytes;
  const size_t wbytes = (size_t)off;
  printf("pipe_micro: %d SMs, %d layers x 6 phases, %.1f MB of weights (%.0f KB per SM per layer)\n", nsm, layers,
         wbytes / 1e6, per_blk / 1024.0 / layers);
  char* W;
  float *X, *Y, *Yref;
  unsigned *ctr, *smid;
  unsigned long long *t_done, *t_start;
  Phase* dph;
  CK(cudaMalloc(&W, wbytes));
  CK(cudaMalloc(&X, (size_t)n_ph * kK * 4));
  CK(cudaMalloc(&Y, (size_t)n_ph * nblk * max_rows * 4));
  CK(cudaMalloc(&Yref, (size_t)n_ph * nblk * max_rows * 4));
  CK(cudaMalloc(&ctr, n_ph * 4));
  CK(cudaMalloc(&smid, nblk * 4));
  CK(cudaMalloc(&t_done, (size_t)n_ph * nblk * 8));
  CK(cudaMalloc(&t_start, nblk * 8));
  CK(cudaMalloc(&dph, n_ph * sizeof(Phase)));
  CK(cudaMemcpy(dph, ph.data(), n_ph * sizeof(Phase), cudaMemcpyHostToDevice));
  k_fill<<<1024, 256>>>((uint16_t*)W, wbytes / 2, 1u);
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
    Args a{W, X, Y, ctr, t_done, t_start, smid, dph, n_ph, nblk, max_rows, v.pf_kb * 1024, v.S, v.B, v.win, v.split,
           v.gate_kb * 1024, v.pump, v.xsm, v.halves, v.nowait};
    const int threads = v.tma && !v.pump ? (kNW + 1) * 32 : kNW * 32;
    const int dyn_bytes = v.tma ? v.S * v.B : v.dyn_kb * 1024;
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
      else k_reg<<<nblk, threads, dyn_bytes>>>(a);
      CK(cudaGetLastError());
      CK(cudaDeviceSynchronize());
      if (rep == 0) continue;  // warm-up
      std::vector<unsigned long long> td((size_t)n_ph * nblk), ts(nblk);
      CK(cudaMemcpy(td.data(), t_done, td.size() * 8, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(ts.data(), t_start, ts.size() * 8, cudaMemcpyDeviceToHost));
      std::vector<unsigned long long> end(n_ph);
      for (int p = 0; p < n_ph; ++p) end[p] = *std::max_element(td.begin() + (size_t)p * nblk, td.begin() + (size_t)(p + 1) * nblk);
      const unsigned long long t0 = *std::min_element(ts.begin(), ts.end());
      spans.push_back((end[n_ph - 1] - t0) / 1e3);
      for (int p = 6; p < n_ph; ++p) {  // layers 1..: window = last done - last done of the phase before
        fam_sum[ph[p].fam] += (end[p] - end[p - 1]) / 1e3;
        fam_n[ph[p].fam] += 1;
      }
    }
    std::sort(spans.begin(), spans.end());
    const double us = spans[spans.size() / 2];
    std::vector<unsigned> hs(nblk);
    CK(cudaMemcpy(hs.data(), smid, nblk * 4, cudaMemcpyDeviceToHost));
    std::sort(hs.begin(), hs.end());
    const int distinct = (int)(std::unique(hs.begin(), hs.end()) - hs.begin());
    const size_t ny = (size_t)n_ph * nblk * max_rows;
    long long diff = -1;
    if (!have_ref) {
      CK(cudaMemcpy(Yref, Y, ny * 4, cudaMemcpyDeviceToDevice));
      have_ref = true;
      diff = 0;
    } else {
      std::vector<float> h1(ny), h2(ny);
      CK(cudaMemcpy(h1.data(), Y, ny * 4, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(h2.data(), Yref, ny * 4, cudaMemcpyDeviceToHost));
      diff = 0;
      for (size_t i = 0; i < ny; ++i) diff += h1[i] != h2[i];
    }
    printf("| %s | %.1f | %.2f | %d | %lld differ |", v.name, us, wbytes / (us * 1e-6) / 1e12, distinct, diff);
    for (int f = 0; f < 6; ++f) printf(" %.2f |", fam_n[f] ? fam_sum[f] / fam_n[f] : 0.0);
    printf("\n");
  }
  printf("\nfamily columns: mean window per layer (us), layers 1-%d\n", layers - 1);
  return 0;
}
