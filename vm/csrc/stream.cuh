// The weight ring (sm_90+, AMK_TMA=1): GEMV-family weights stream HBM -> shared memory with 1-D bulk copies
// (cp.async.bulk, mbarrier complete_tx), AMK_STAGES stages of AMK_STAGE_BYTES, in queue order and across task
// boundaries. Thread 0 is the producer: it fills free stages with the next rows of the current or any later task
// of this block's queue -- before the block spins on a task's waits, so weights never wait on activations -- and
// refills a stage as soon as the block has consumed it. All threads consume stages in the same order.
//
// A stage holds whole rows: sr = AMK_STAGE_BYTES / (nmat * row_bytes) rows of each of the task's nmat matrices
// (GEMV_SILU_MUL: gate rows then up rows). The loader sets AMK_INSTR_FLAG_STREAM only where row_bytes % 16 == 0 and
// nmat * row_bytes <= AMK_STAGE_BYTES; other tasks (and non-sm_90 builds) use the register streaming path.
// Stage n lives in slot n % AMK_STAGES; its mbarrier phase parity is (n / AMK_STAGES) & 1.
//
// Status: correct (the GPU tests run every model through both paths) but OPT-IN (AMK_TMA=1 / tma=True): on an H100
// (llama-3.2-1b bf16, 2026 runs) the ring measured 2.78-2.97 ms/token against 1.66-1.83 ms for the register path,
// and 2.0x the register path's 1.19 ms again on 2026-11-24 after a rebuild without block barriers per stage
// (branch wip/ring-producer-warp, not merged). scripts/ring_micro.cu shows why (docs/PERF.md, fifteenth session):
// with this GEMV consumer and the producer inside a consuming warp a block streams ~11 GB/s whatever the number of
// stages, a dedicated producer warp gets ~20 GB/s, and 1-D bulk copies alone top out at ~33 GB/s per SM, where
// plain register loads reach 55 GB/s per SM when the HBM has room.
#pragma once
#include "common.cuh"
#include "mbarrier.cuh"

#ifndef AMK_TMA
#define AMK_TMA 0
#endif
#ifndef AMK_STAGES
#define AMK_STAGES 4
#endif
#ifndef AMK_STAGE_BYTES
#define AMK_STAGE_BYTES 32768
#endif
static_assert(AMK_STAGE_BYTES % 128 == 0 && AMK_STAGES >= 1 && AMK_STAGES <= 16, "bad ring geometry");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && AMK_TMA
#define AMK_RING_DEVICE 1
#else
#define AMK_RING_DEVICE 0
#endif
// Dynamic shared memory taken by the ring (host and device agree: the loader reads it from build_info).
#define AMK_RING_BYTES (AMK_TMA ? AMK_STAGES * AMK_STAGE_BYTES : 0)

struct AmkGeom {
  int rows, nmat, row_bytes, sr;
};

// Stream geometry of an instruction; false if its weights do not go through the ring.
__device__ __forceinline__ bool amk_stream_geom(const AmkInstr& in, AmkGeom& g) {
  if (!AMK_RING_DEVICE || !(in.flags & AMK_INSTR_FLAG_STREAM)) return false;
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

// Warps per row inside a stage of a streamed task, and the op's smem scratch for the per-warp partials.
__host__ __device__ __forceinline__ int amk_stream_wpr(const AmkGeom& g) {
  return g.sr >= AMK_NWARPS ? 1 : AMK_NWARPS / g.sr;
}
__host__ __device__ __forceinline__ int amk_stash_floats(const AmkGeom& g) {
  return g.rows * g.nmat * amk_stream_wpr(g);
}

// Ring state in shared memory. Producer fields are touched by thread 0 only; `consumed` is written by thread 0
// after a barrier and read by all threads at op entry (always separated by barriers).
struct AmkRing {
  uint32_t issued, consumed;  // stage sequence numbers
  int pq;                     // producer: queue position of the task being issued
  int prow;                   // producer: next row of that task
  int loaded;                 // producer: geometry below is valid for queue position pq
  int rows, nmat, row_bytes, sr;
  uint64_t src[2];
  uint32_t base;              // shared address of slot 0
  uint32_t bar;               // shared address of mbarrier 0 (8 bytes each)
};

// Thread 0, once per launch: barriers + producer state.
__device__ __forceinline__ void amk_ring_init(AmkRing& R, uint64_t* bars, void* ring_base, int q0) {
  R.issued = R.consumed = 0;
  R.pq = q0;
  R.prow = 0;
  R.loaded = 0;
  R.base = amk_smem_addr(ring_base);
  R.bar = amk_smem_addr(bars);
#if AMK_RING_DEVICE
  for (int s = 0; s < AMK_STAGES; ++s) amk_mbar_init(R.bar + 8u * s);
#endif
}

// Thread 0: fill free stages with the next rows of this block's queue (from queue position R.pq up to q1).
__device__ __forceinline__ void amk_ring_pump(const AmkParams& p, AmkRing& R, int q1) {
#if AMK_RING_DEVICE
  const uint64_t pol = amk_policy_evict_first();
  while (R.issued - R.consumed < (uint32_t)AMK_STAGES) {
    if (!R.loaded) {
      if (R.pq >= q1) return;
      const AmkInstr& in = p.instrs[p.queue_items[R.pq]];
      AmkGeom g;
      if (!amk_stream_geom(in, g)) { ++R.pq; continue; }
      R.rows = g.rows; R.nmat = g.nmat; R.row_bytes = g.row_bytes; R.sr = g.sr;
      R.src[0] = in.prefetch_ptr[0];
      R.src[1] = in.prefetch_ptr[1];
      R.prow = 0;
      R.loaded = 1;
    }
    const int n = (R.rows - R.prow) < R.sr ? (R.rows - R.prow) : R.sr;
    const uint32_t slot = R.issued % AMK_STAGES;
    const uint32_t bar = R.bar + 8u * slot, dst = R.base + slot * (uint32_t)AMK_STAGE_BYTES;
    const uint32_t bytes = (uint32_t)n * (uint32_t)R.row_bytes;
    amk_mbar_expect(bar, bytes * R.nmat);
    for (int m = 0; m < R.nmat; ++m)
      amk_bulk_g2s(dst + (uint32_t)m * bytes, R.src[m] + (uint64_t)R.prow * (uint64_t)R.row_bytes, bytes, bar, pol);
    ++R.issued;
    R.prow += n;
    if (R.prow >= R.rows) { R.loaded = 0; ++R.pq; }
  }
#else
  (void)p; (void)R; (void)q1;
#endif
}

// Thread 0: wait until stage `seq` has landed. 0 = ready; 1 = abort seen or timed out (reported).
__device__ __forceinline__ int amk_ring_wait(const AmkParams& p, const AmkRing& R, uint32_t seq, const AmkInstr& in,
                                             int sm) {
  return amk_mbar_wait(p, R.bar + 8u * (seq % AMK_STAGES), (seq / AMK_STAGES) & 1u, in, -1 - (int)(seq % AMK_STAGES),
                       sm);
}

// Thread 0, before the block exits early: let in-flight bulk copies land (bounded), so no copy outlives the block.
__device__ __forceinline__ void amk_ring_drain(const AmkParams& p, const AmkRing& R) {
#if AMK_RING_DEVICE
  for (uint32_t s = R.consumed; s != R.issued; ++s)
    amk_mbar_drain(p, R.bar + 8u * (s % AMK_STAGES), (s / AMK_STAGES) & 1u);
#else
  (void)p; (void)R;
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
