// The weight ring (sm_90+, AMK_TMA=1): GEMV-family weights stream HBM -> shared memory with 1-D bulk copies
// (cp.async.bulk, mbarrier complete_tx), AMK_STAGES stages of AMK_STAGE_BYTES, in queue order and across task
// boundaries. A ring build launches one more warp per block, the PRODUCER (warp AMK_NWARPS, lane 0): from the
// launch's start it walks the block's queue and issues the stages of every streamed task in order, never waiting on
// a task's counters (weights are constant for the launch), so the ring fills while the block waits on a dependency
// or runs attention -- and at most AMK_RING_WINDOW copies are in flight at once (a stage is issued only when the
// one AMK_RING_WINDOW stages back has landed). The compute warps consume stages without block barriers: each warp
// takes work items -- (row, K-slice) pairs of the task in stage order, item i to warp i % AMK_NWARPS, so the warps
// spread over several landed stages at once -- waits on an item's stage itself, and the warp that finishes a stage's
// last item frees its slot (one arrival on the stage's empty barrier).
//
// Why the window (scripts/pipe_micro.cu, docs/PERF.md forty-fourth session): a llama-3.2-1b-shaped step of six
// dependent phases per layer ran 926 us with the register path, 930 us with a 12 x 16 KB ring and no window (every
// SM's 192 KB of copies in flight queue the hops' counter polls and input loads behind them), 811 us with the same
// ring and at most 2 copies in flight (32 KB), 806 us with 24 x 8 KB and 6 in flight.
//
// A stage holds whole rows: sr = AMK_STAGE_BYTES / (nmat * row_bytes) rows of each of the task's nmat matrices
// (GEMV_SILU_MUL: gate rows then up rows). The loader sets AMK_INSTR_FLAG_STREAM only where row_bytes % 16 == 0 and
// nmat * row_bytes <= AMK_STAGE_BYTES; other tasks (and non-sm_90 builds) use the register streaming path.
// Stage n lives in slot n % AMK_STAGES; its mbarrier phase parity is (n / AMK_STAGES) & 1.
// -DAMK_RING_WG=1: the producer as a whole warpgroup that gives the compute warps 112 registers instead of 96
// (setmaxnreg; common.cuh): bit-identical to the 17-warp ring; llama-3.2-1b ctx 512 on an H100 1310.9 us against
// 1357.7 for the 17-warp ring and 1114.5 for the register path (docs/PERF.md fifty-second session).
//
// Status: correct (the GPU tests run every model through both paths, and a 3-stage ring whose work items run
// further ahead than the ring is long) but OPT-IN (AMK_TMA=1 / tma=True) and still SLOWER than the register path.
// llama-3.2-1b bf16 ctx 512, 16 KB stages, no L2 prefetch tasks: on an H100 1405-1418 us with 512 compute threads +
// the producer against 1124 us (forty-fourth / forty-fifth sessions); on an H200 1260 us against 952-964 after the
// wait's fast path (forty-fifth), 1244-1248 us against 963-973 with the item loop's context reads and most of its
// spill reloads out (7-8 local loads per work item -> 3-4, SASS; forty-sixth). Taken apart (forty-sixth, H200,
// AMK_DBG_NOSTREAM / AMK_LB_THREADS): the 96-register cap the producer warp forces costs +7%, the rest of the ring
// build's block +5%, its shared memory +5%, and streaming through the ring instead of the register loads + L2
// prefetch +13%. What the traces and ncu said before (docs/PERF.md, forty-fifth session): the producer is far ahead
// (a task's stages land tens of us before its wait ends), but a streamed task's warps first reach their landed stage
// ~1.8 us after the input is staged and the closing barrier + epilogue take ~1 us; ring builds run 4-5x the register
// path's local-memory loads with 10-48% L1 misses; and the bulk copies' steady rate with 2-4 in flight is below the
// register path's (gate/up 25.7 vs 18.0 us on the H200). QKV tiles with the RoPE-pair split (two ranges) never
// stream.

#pragma once
#include "common.cuh"
#include "mbarrier.cuh"
#include "sync.cuh"

#ifndef AMK_STAGES
#define AMK_STAGES 4
#endif
#ifndef AMK_STAGE_BYTES
#define AMK_STAGE_BYTES 32768
#endif
#ifndef AMK_RING_WINDOW
#define AMK_RING_WINDOW 2
#endif
static_assert(AMK_STAGE_BYTES % 128 == 0 && AMK_STAGES >= 1 && AMK_STAGES <= 32, "bad ring geometry");
static_assert(AMK_RING_WINDOW >= 1 && (AMK_RING_WINDOW < AMK_STAGES || AMK_STAGES == 1),
              "AMK_RING_WINDOW: 1 .. AMK_STAGES - 1 copies in flight");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && AMK_TMA
#define AMK_RING_DEVICE 1
#else
#define AMK_RING_DEVICE 0
#endif
// Dynamic shared memory taken by the ring (host and device agree: the loader reads it from build_info).
#define AMK_RING_BYTES (AMK_TMA ? AMK_STAGES * AMK_STAGE_BYTES : 0)

// setmaxnreg (AMK_RING_WG builds, common.cuh): every warp of a warpgroup takes registers from the block's pool
// (kInc, waiting until the pool has them) or gives them back, to R per thread. An sm_90a / sm_100a feature.
template <bool kInc, int R>
__device__ __forceinline__ void amk_setmaxnreg() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL) || defined(__CUDA_ARCH_FEAT_SM100_ALL)
  if constexpr (kInc) asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(R) : "memory");
  else asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(R) : "memory");
#elif defined(__CUDA_ARCH__)
  static_assert(R < 0, "AMK_RING_WG needs setmaxnreg: build for sm_90a or sm_100a");
#endif
}

struct AmkGeom {
  int rows, nmat, row_bytes, sr;
};

// Stream geometry of an instruction; false if its weights do not go through the ring.
__device__ __forceinline__ bool amk_stream_geom(const AmkInstr& in, AmkGeom& g) {
  if (!AMK_RING_DEVICE || !amk_task_streams(in)) return false;
  switch (in.op) {
    case AMK_OP_GEMV: g.rows = in.ip[AMK_GEMV_IP_ROW_COUNT]; break;
    case AMK_OP_GEMV_SILU_MUL: g.rows = in.ip[AMK_GEMV_SILU_MUL_IP_ROW_COUNT]; break;
    case AMK_OP_QKV_ROPE: g.rows = in.ip[AMK_QKV_ROPE_IP_HEAD_COUNT] * in.ip[AMK_QKV_ROPE_IP_HEAD_DIM]; break;
    default: return false;
  }
  if (g.rows <= 0) return false;
  g.nmat = in.prefetch_bytes[1] > 0 ? 2 : 1;
  g.row_bytes = (int)(in.prefetch_bytes[0] / g.rows);
  g.sr = g.row_bytes > 0 ? AMK_STAGE_BYTES / (g.nmat * g.row_bytes) : 0;
  return g.sr >= 1;
}

// K-slices per row of a streamed task (vm/smem.py mirrors it): a row is cut into slices of at most
// AMK_RING_SLICE_BYTES per matrix, each slice one work item of one warp (ops_gemv.cuh amk_gemv_streamed), and the
// task's smem scratch holds one partial per (row, matrix, slice).
#ifndef AMK_RING_SLICE_BYTES
#define AMK_RING_SLICE_BYTES 4096
#endif
// 16-byte chunks per lane in flight in a streamed work item's dot product (shared-memory reads: a few cover their
// latency; the register path's AMK_U1 / AMK_U2 cover an HBM round trip and cost registers the ring's loop lacks
// with the producer warp's 96-register cap).
#ifndef AMK_RING_U
#define AMK_RING_U 2
#endif
__host__ __device__ __forceinline__ int amk_stream_wpr(const AmkGeom& g) {
  const int s = (g.row_bytes + AMK_RING_SLICE_BYTES - 1) / AMK_RING_SLICE_BYTES;
  return s < 1 ? 1 : (s > AMK_NWARPS ? AMK_NWARPS : s);
}
__host__ __device__ __forceinline__ int amk_stash_floats(const AmkGeom& g) {
  return g.rows * g.nmat * amk_stream_wpr(g);
}

// Ring state in shared memory. `consumed` (stages consumed by the finished streamed tasks) is written by thread 0
// after a task's closing barrier and read by every compute thread at a streamed op's entry; `stop` is raised by the
// compute warps when the block leaves the launch early (abort / timeout), so the producer stops issuing.
struct AmkRing {
  uint32_t consumed;
  volatile uint32_t issued;  // stages the producer has armed and issued (a consumer waits for stage n only after n)
  volatile int stop;
  int done[AMK_STAGES];  // work items of the stage in each slot finished so far (the last one frees the slot)
  uint32_t base;  // shared address of slot 0
  uint32_t bar;   // shared address of full mbarrier 0 (8 bytes each; slot s at bar + 8 s)
  uint32_t ebar;  // shared address of empty mbarrier 0
};

// Thread 0, once per launch, before the block's first barrier: barriers + state.
__device__ __forceinline__ void amk_ring_init(AmkRing& R, uint64_t* bars, uint64_t* ebars, void* ring_base) {
  R.consumed = 0;
  R.issued = 0;
  R.stop = 0;
  for (int s = 0; s < AMK_STAGES; ++s) R.done[s] = 0;
  R.base = amk_smem_addr(ring_base);
  R.bar = amk_smem_addr(bars);
  R.ebar = amk_smem_addr(ebars);
#if AMK_RING_DEVICE
  for (int s = 0; s < AMK_STAGES; ++s) {
    amk_mbar_init(R.bar + 8u * s);
    amk_mbar_init(R.ebar + 8u * s);  // one arrival: the warp that finishes the stage's last work item
  }
#endif
}

// The producer (lane 0 of warp AMK_NWARPS), for the whole launch: every stage of every streamed task of queue
// positions [q0, q1), in order. It returns when all are issued (the compute warps consume every one before the
// block ends), or on stop, after the copies in flight have landed (bounded), so none outlives the block. Its waits
// (a slot released, the copy AMK_RING_WINDOW back landed) end on R.stop too; a timeout is reported as one of the
// task being issued, with detail -1 - AMK_STAGES - slot for a slot never released.
__device__ __noinline__ void amk_ring_produce(const AmkParams& p, AmkRing& R, int q0, int q1, int sm) {
#if AMK_RING_DEVICE
  const uint64_t pol = amk_policy_evict_first();
  uint32_t n = 0;  // stages issued
  for (int q = q0; q < q1; ++q) {
    const int idx = __ldg(p.queue_items + q);
    const AmkInstr& in = p.instrs[idx];
    AmkGeom g;
    if (!amk_stream_geom(in, g)) continue;
    const uint64_t src0 = in.prefetch_ptr[0], src1 = in.prefetch_ptr[1];
    uint64_t* const mk = (AMK_MARKS && p.trace) ? p.trace + (size_t)idx * AMK_TRACE_WORDS + 4
                                                : nullptr;  // marks 4 / 5: this task's first / last stage issued
    for (int r0 = 0; r0 < g.rows; r0 += g.sr, ++n) {
      const uint32_t slot = n % AMK_STAGES;
      const uint32_t bar = R.bar + 8u * slot, dst = R.base + slot * (uint32_t)AMK_STAGE_BYTES;
      if (n >= (uint32_t)AMK_STAGES &&
          amk_mbar_wait_for<AMK_RING_WG>(p, R.ebar + 8u * slot, ((n / AMK_STAGES) - 1u) & 1u, in.task_id,
                                         in.op, -1 - AMK_STAGES - (int)slot, sm, &R.stop))
        goto drain;
      if (n >= (uint32_t)AMK_RING_WINDOW) {  // the copy AMK_RING_WINDOW stages back has landed
        const uint32_t m = n - AMK_RING_WINDOW;
        if (amk_mbar_wait_for<AMK_RING_WG>(p, R.bar + 8u * (m % AMK_STAGES), (m / AMK_STAGES) & 1u, in.task_id,
                                           in.op, -1 - (int)(m % AMK_STAGES), sm, &R.stop))
          goto drain;
      }
      const int nr = (g.rows - r0) < g.sr ? (g.rows - r0) : g.sr;
      const uint32_t bytes = (uint32_t)nr * (uint32_t)g.row_bytes;
      amk_mbar_expect(bar, bytes * g.nmat);
      amk_bulk_g2s(dst, src0 + (uint64_t)r0 * (uint64_t)g.row_bytes, bytes, bar, pol);
      if (g.nmat > 1) amk_bulk_g2s(dst + bytes, src1 + (uint64_t)r0 * (uint64_t)g.row_bytes, bytes, bar, pol);
      __threadfence_block();  // the stage's barrier is armed before the count says so
      R.issued = n + 1u;
      if (mk != nullptr && (r0 == 0 || r0 + g.sr >= g.rows)) mk[r0 == 0 ? 4 : 5] = amk_globaltimer();
    }
  }
  return;
drain:
  for (uint32_t m = n > (uint32_t)AMK_RING_WINDOW ? n - AMK_RING_WINDOW : 0u; m < n; ++m)
    amk_mbar_drain(p, R.bar + 8u * (m % AMK_STAGES), (m / AMK_STAGES) & 1u);
#else
  (void)p; (void)R; (void)q0; (void)q1; (void)sm;
#endif
}

// A compute warp: wait until stage `seq` has been issued and has landed (lane 0 waits bounded, then every lane
// acquires it). The work items spread the warps over up to AMK_NWARPS stages, more than the ring holds when rows are
// long (gate/up: two items per stage), so a warp can ask for stage n + AMK_STAGES while slot n % AMK_STAGES still
// waits for stage n: the parity alone would take the slot's previous phase for this one; the issued count rules
// that out. false: abort seen or timed out (reported); the caller stops using the ring.
// The slow path (the bounded wait and its report) is a call that reads the task's context; the fast path touches
// only the ring state R, which the caller holds in a register: a context field read here is a local-memory load
// after every "memory"-clobbering mbarrier asm, i.e. once per work item (the ring's item loop made ~6 such loads and
// spill reloads per item, each an L2 round trip when the L1 -- small next to a deep ring -- misses).
__device__ __noinline__ bool amk_ring_wait_slow(const AmkCtx& c, const AmkRing& R, uint32_t seq) {
  const uint32_t bar = R.bar + 8u * (seq % AMK_STAGES), parity = (seq / AMK_STAGES) & 1u;
  int bad = 0;
  if (amk_lane() == 0)
    bad = amk_mbar_wait_for(*c.p, bar, parity, c.ins->task_id, c.ins->op, -1 - (int)(seq % AMK_STAGES), c.sm,
                            nullptr, &R.issued, seq);
  bad = __shfl_sync(0xffffffffu, bad, 0);
  if (bad) return false;
  while (!amk_mbar_try(bar, parity)) {}
  return true;
}
__device__ __forceinline__ bool amk_ring_wait_warp(const AmkCtx& c, const AmkRing& R, uint32_t seq) {
  const uint32_t bar = R.bar + 8u * (seq % AMK_STAGES), parity = (seq / AMK_STAGES) & 1u;
  // Fast path, no call: the stage is issued and has landed (the producer runs ahead, so mostly it has). A
  // noinline call here would make every work item save and reload registers through the stack (ncu, forty-fifth
  // session: ring builds ran 4-5x the register path's local loads).
  if (__all_sync(0xffffffffu, (int32_t)(R.issued - seq) > 0 && amk_mbar_try(bar, parity))) return true;
  return amk_ring_wait_slow(c, R, seq);
}

// A compute warp finished one of the `items` work items of stage `seq` (every lane's shared loads consumed): the
// warp that finishes the stage's last item frees the slot for the producer (one arrival on its empty barrier).
__device__ __forceinline__ void amk_ring_item_done(AmkRing& R, uint32_t seq, int items) {
  __syncwarp();
#if AMK_RING_DEVICE
  if (amk_lane() == 0) {
    const uint32_t slot = seq % AMK_STAGES;
    __threadfence_block();  // this warp's reads of the stage before the count (and the other warps' before theirs)
    if (atomicAdd(&R.done[slot], 1) == items - 1) {
      R.done[slot] = 0;  // (the slot's next use starts only after the arrival below)
      __threadfence_block();
      asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(R.ebar + 8u * slot) : "memory");
    }
  }
#else
  (void)R; (void)seq; (void)items;
#endif
}

// 16-byte loads from the two weight sources of the GEMV inner loop.
struct AmkSrcGlobal {
  uint64_t pol;
  __device__ __forceinline__ uint4 ld(const char* p) const { return amk_ld_stream(p, pol); }
};
struct AmkSrcShared {
  __device__ __forceinline__ uint4 ld(const char* p) const {
    uint4 r;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "r"(amk_smem_addr(p)));
    return r;
  }
};
