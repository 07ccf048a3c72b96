// scripts/pipe_micro.cu's shared parts: the step's phase table and launch arguments, the grid-counter waits and
// spins, the pump variants' copy issuer and the streamer blocks (docs/PERF.md, forty-fourth to fifty-second
// sessions). Included by pipe_micro.cu only; the kernels and the variant table are there.
#pragma once
#include "micro_common.cuh"  // CK, saddr, mbar_*, bulk_g2s, ldg_w, evict_first, gtime

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
  int n_str;                   // reg: streamer blocks after the nblk compute blocks (0: none)
  int str_chunk, str_slots;    // streamer: bytes per bulk copy, copies in flight (a sink of str_slots x str_chunk)
  long long str_ahead;         // streamer: at most this many bytes past the start of the phase being consumed
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

// A streamer block (reg variants with n_str > 0; fifty-second session): it computes nothing; its thread 0 walks the
// step's weights in the order the compute blocks consume them -- phase by phase, and within a phase the first
// str_chunk bytes of every block's tile, then the next ones -- and bulk-copies its share (chunk i -> streamer
// i % n_str) into a shared-memory sink nobody reads, so the lines land in L2 as loaded lines do (twenty-seventh
// session: read as fast as the loader's own), while the compute blocks' hops leave the HBM idle. It stays at most
// str_ahead bytes past the start of the phase the compute blocks are in (the phase counters), so what it fetches
// is still in L2 when it is read, and skips the chunks of phases already done.
__device__ void streamer(const Args& a, int s) {
  if (threadIdx.x != 0) return;
  uint64_t* bars = (uint64_t*)(dyn + (size_t)a.str_slots * a.str_chunk);
  for (int k = 0; k < a.str_slots; ++k) mbar_init(saddr(bars + k));
  const uint64_t pol = evict_normal();
  const long long C = a.str_chunk;
  int pc = 0;           // first phase not finished by every compute block (as far as this thread has seen)
  int p = 0;            // phase of chunk gi
  long long base = 0;   // first chunk index of phase p
  uint32_t n = 0;       // copies issued
  for (long long gi = s;; gi += a.n_str) {
    long long nch = 0;
    for (;;) {  // chunk gi -> phase p
      while (p < a.n_ph && a.ph[p].tile_bytes == 0) ++p;
      if (p >= a.n_ph) break;
      nch = (long long)a.nblk * ((a.ph[p].tile_bytes + C - 1) / C);
      if (gi < base + nch) break;
      base += nch;
      ++p;
    }
    if (p >= a.n_ph) break;
    const long long j = gi - base, b = j % a.nblk, off = (j / a.nblk) * C;
    for (;;) {  // flow control: the phase counters
      while (pc < a.n_ph) {
        unsigned v;
        asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(a.ctr + pc) : "memory");
        if (v < (unsigned)a.nblk) break;
        ++pc;
      }
      if (pc > p) break;  // its phase is done: skip it
      const long long lead = a.ph[p].w_off - a.ph[pc].w_off + off * a.nblk;  // bytes past phase pc's start
      if (lead <= a.str_ahead) break;
      spin(200);
    }
    if (pc > p) continue;
    const uint32_t slot = n % a.str_slots;
    if (n >= (uint32_t)a.str_slots) mbar_wait(saddr(bars + slot), ((n / a.str_slots) - 1) & 1);
    const uint32_t bytes = (uint32_t)(a.ph[p].tile_bytes - off < C ? a.ph[p].tile_bytes - off : C);
    mbar_expect(saddr(bars + slot), bytes);
    bulk_g2s(saddr(dyn + (size_t)slot * C), a.W + a.ph[p].w_off + b * a.ph[p].tile_bytes + off, bytes,
             saddr(bars + slot), true, pol);
    ++n;
  }
  for (uint32_t m = n > (uint32_t)a.str_slots ? n - a.str_slots : 0u; m < n; ++m)
    mbar_wait(saddr(bars + m % a.str_slots), (m / a.str_slots) & 1);
}

