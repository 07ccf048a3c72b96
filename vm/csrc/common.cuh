// Common device helpers of the AMK megakernel: build knobs, the per-task context, reductions, typed loads.
//
// Memory rules (see schedule/ir.py's sync contract):
//   * weights / CONST tables are read-only for the whole launch: streamed with ld.global.nc + L1::no_allocate +
//     an L2 evict-first policy (amk_ld_stream), or __ldg for small scalar reads;
//   * activations, IO words and the KV cache may be written inside the launch by another block: always read with
//     coherent L2 loads (__ldcg), never ld.global.nc.
// Reductions are fixed-order (xor-butterfly shuffles + per-warp slots summed in warp order), so reruns are
// bit-identical.
#pragma once
#include <limits.h>
#include <stdint.h>
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include "amk_abi.h"
#include "amk_launch.h"

#ifndef AMK_THREADS
#define AMK_THREADS 512
#endif
#ifndef AMK_PREFETCH_DEPTH
#define AMK_PREFETCH_DEPTH 2
#endif
static_assert(AMK_THREADS % 32 == 0 && AMK_THREADS >= 128 && AMK_THREADS <= 1024, "AMK_THREADS: 128..1024, x32");
static_assert(AMK_PREFETCH_DEPTH >= 0 && AMK_PREFETCH_DEPTH <= 8, "AMK_PREFETCH_DEPTH out of range");

// Element types of weights / KV caches compiled in: bit (1 << AMK_DTYPE_x). Each type instantiates every GEMV and
// attention body, so a build for one type has ~half the code (vm/jit.py builds for the program's types).
#ifndef AMK_DTYPES
#define AMK_DTYPES ((1 << AMK_DTYPE_F32) | (1 << AMK_DTYPE_BF16) | (1 << AMK_DTYPE_F16))
#endif
#define AMK_HAS_DTYPE(dt) (((AMK_DTYPES) >> (dt)) & 1)
#define AMK_DTYPE_DETAIL (-200)  // BAD_INPUT detail of a dtype this build lacks: AMK_DTYPE_DETAIL - dtype
static_assert((AMK_DTYPES & 7) != 0 && (AMK_DTYPES & ~7) == 0, "AMK_DTYPES: a non-empty mask of F32/BF16/F16");

#define AMK_NWARPS (AMK_THREADS / 32)
// The sm_90+ bulk-copy weight ring (stream.cuh; vm/jit.py BuildSpec.tma). A ring build launches one more warp per
// block, the ring's producer (warp AMK_NWARPS): the ops' AMK_THREADS compute threads never count it, and their block
// barrier (amk_sync) is barrier 0 over AMK_THREADS threads, which the producer never joins.
#ifndef AMK_TMA
#define AMK_TMA 0
#endif
// -DAMK_RING_WG=1 (ring builds for sm_90a, an A/B build switch; timed in the fifty-second session: -3.5% against
// the 17-warp ring, +17.6% against the register path): the producer is a whole warpgroup
// (warp AMK_NWARPS's lane 0 issues, the other three warps exit) that hands its registers to the compute warps with
// setmaxnreg. A block of 17 warps puts 5 on one scheduler, so ptxas caps every function at 96 registers (+7%,
// docs/PERF.md forty-sixth session); 5 whole warpgroups launch at 96 too (AMK_RING_WG_LAUNCH_REGS), but the producer
// warpgroup drops to 32 and the compute warpgroups rise to what the block's pool then holds (AMK_RING_WG_COMPUTE_REGS:
// 112 at 512 compute threads). ptxas allocates the code after setmaxnreg.inc, the noinline op bodies included, with
// the raised limit (scripts/setmaxnreg_probe.cu) -- provided no noinline function is called from two of the regions
// (before setmaxnreg, the producer's, the compute warps'): ptxas then ignores both (C7507), so amk_exit and
// amk_mbar_wait_for take a per-region copy (kSite). The host refuses to launch a build whose kernel did not get the
// launch registers the pool arithmetic assumes (setmaxnreg.inc would wait forever for registers the pool lacks).
// Status (fifty-first session): compiles, ptxas honours it (tests/vm/test_nvcc_compile.py), the op bodies spill
// less; NOT yet run on a GPU: correctness (tests/vm/test_megakernel_gpu.py::test_ring_wg_is_bit_identical_to_the_ring)
// and timing next.
#ifndef AMK_RING_WG
#define AMK_RING_WG 0
#endif
#define AMK_PRODUCER_THREADS (AMK_TMA ? (AMK_RING_WG ? 128 : 32) : 0)
#define AMK_BLOCK_THREADS (AMK_THREADS + AMK_PRODUCER_THREADS)
static_assert(!AMK_RING_WG || (AMK_TMA && AMK_THREADS % 128 == 0),
              "AMK_RING_WG: a weight-ring build (AMK_TMA=1) of whole warpgroups (AMK_THREADS a multiple of 128)");
#ifndef AMK_RING_WG_PRODUCER_REGS
#define AMK_RING_WG_PRODUCER_REGS 32  // (32 leaves the compute warps 112 at 512 threads; 24 gives no more)
#endif
// registers per thread at launch: a scheduler's 16384 over its share of the block's threads, in steps of 8
#define AMK_RING_WG_LAUNCH_REGS ((16384 / (AMK_BLOCK_THREADS / 4)) / 8 * 8)
#define AMK_RING_WG_COMPUTE_REGS \
  ((AMK_RING_WG_LAUNCH_REGS * AMK_BLOCK_THREADS - 128 * AMK_RING_WG_PRODUCER_REGS) / AMK_THREADS / 8 * 8)
static_assert(!AMK_RING_WG || (AMK_RING_WG_COMPUTE_REGS > AMK_RING_WG_LAUNCH_REGS && AMK_RING_WG_COMPUTE_REGS <= 256),
              "AMK_RING_WG: the compute warps would gain no registers");
// -DAMK_DBG_NOSTREAM=1 (A/B builds of the ring): no task streams (stream.cuh amk_stream_geom says no, the producer
// warp finds nothing to issue, flagged tasks keep their wait prefetch), so a ring build runs the register path in
// the ring build's block -- its 17th warp, the 96-register cap that gives the compute warps, its shared memory --
// which prices those apart from the streaming itself.
#ifndef AMK_DBG_NOSTREAM
#define AMK_DBG_NOSTREAM 0
#endif
// Whether a task's weights go through the weight ring (the loader flags only tasks whose rows fit a stage): the one
// test for the ring's consumers (stream.cuh amk_stream_geom) and the wait prefetch, which leaves those bytes to the
// producer (sync.cuh amk_wait_all).
__host__ __device__ __forceinline__ bool amk_task_streams(const AmkInstr& in) {
  return AMK_TMA && !AMK_DBG_NOSTREAM && (in.flags & AMK_INSTR_FLAG_STREAM) != 0;
}
static_assert(AMK_BLOCK_THREADS <= 1024, "AMK_THREADS + the ring's producer warp must fit a block");
__device__ __forceinline__ void amk_sync() {
#if AMK_TMA
  asm volatile("bar.sync 0, %0;" ::"n"(AMK_THREADS) : "memory");
#else
  __syncthreads();
#endif
}
#define AMK_ATTN_TILE 256   // max keys per attention tile (scores staged in smem)
// The attention op copies each tile's K and V rows into shared memory with cp.async (AMK_ATTN_STAGES buffers of
// AMK_ATTN_STAGE_BYTES, K then V), issuing tile t+STAGES-1 before computing tile t: every KV byte of a tile is in
// flight at once. vm/jit.py sets both (BuildSpec.attn_stages / attn_stage_bytes) and vm/smem.py mirrors the area.
#ifndef AMK_ATTN_STAGES
#define AMK_ATTN_STAGES 2
#endif
#ifndef AMK_ATTN_STAGE_BYTES
#define AMK_ATTN_STAGE_BYTES 32768
#endif
static_assert(AMK_ATTN_STAGES >= 1 && AMK_ATTN_STAGES <= 4, "AMK_ATTN_STAGES: 1..4");
static_assert(AMK_ATTN_STAGE_BYTES % 16 == 0 && AMK_ATTN_STAGE_BYTES >= 4096 && AMK_ATTN_STAGE_BYTES <= 65536,
              "AMK_ATTN_STAGE_BYTES: 4096..65536, x16");
// q heads per register block in attention. 4 covers the GQA groups of the presets (2-4) in one pass; 8 made the
// op's code ~2x larger and each attention task ~2.6 us slower on an H100 (docs/PERF.md, third session).
#ifndef AMK_ATTN_GB
#define AMK_ATTN_GB 4
#endif
#define AMK_ATTN_RGMAX 32   // max key row-groups in the P.V pass

// Loads in flight per lane in the GEMV inner loop: R rows x U 16-byte chunks; T*R*U*16 B ~ 64 KB per block.
#define AMK_CLAMP(v, lo, hi) ((v) < (lo) ? (lo) : ((v) > (hi) ? (hi) : (v)))
#ifndef AMK_U1
#define AMK_U1 AMK_CLAMP(4096 / AMK_THREADS, 1, 16)
#endif
#ifndef AMK_U2
#define AMK_U2 AMK_CLAMP(2048 / AMK_THREADS, 1, 16)
#endif
// o_proj split by KV group: its weight rows go out before its merged input is staged (ops_gemv.cuh,
// amk_gemv_group_body); 0: the generic order (input, then weights).
#ifndef AMK_GROUP_EARLY
#define AMK_GROUP_EARLY 1
#endif
// Short rows (K fits one 16-byte chunk per lane, ops_gemv.cuh): rows per warp in flight at once.
#ifndef AMK_RS
#define AMK_RS AMK_CLAMP(4096 / AMK_THREADS, 1, 16)
#endif

// The kernel's dynamic shared memory: [weight ring | preload buffer | op area] (megakernel.cu).
extern __shared__ __align__(128) unsigned char amk_dyn_smem[];
// p (a generic pointer into the dynamic shared memory, e.g. AmkCtx.smem) re-derived from the shared array: the
// compiler then knows the address space and emits 32-bit shared loads (LDS) instead of generic 64-bit ones (LD
// with address arithmetic: ~2.5x the instructions in the attention op's P.V loop, ncu, fifth session).
template <class P>
__device__ __forceinline__ P* amk_in_smem(P* p) {
  return (P*)(amk_dyn_smem + ((const unsigned char*)p - amk_dyn_smem));
}

struct AmkRing;  // stream.cuh
struct AmkPre;   // preload.cuh

// One buffer slot of the running task, resolved into shared memory while thread 0 waits (amk_prep_slots): the
// descriptor's pointer and dtype, and for IO_INPUT buffers (token, pos: constant during a launch) their first word.
struct AmkSlot {
  uint64_t ptr;
  int dtype;
  int scalar;
};

// Everything an op needs: launch params, the task's instruction (a shared-memory copy), smem areas, its SM.
struct AmkCtx {
  const AmkParams* p;
  const AmkInstr* ins;   // shared memory
  float* smem;           // dynamic shared memory op area (op-specific carve-up, see amk_smem_floats)
  float* red;            // static scratch, 64 floats (block reductions)
  float* part;           // static scratch, 64 floats (split-K partials)
  int* flag;             // shared abort flag: set to 1 by an op that reported an error
  int sm;
  int instr_index;
  AmkRing* ring;         // weight ring state (shared memory; stream.cuh)
  unsigned char* ring_base;  // slot 0 of the ring (dynamic shared memory)
  int q1;                // end of this block's queue (read by no op since the ring's producer warp took the
                         // pump; kept: the context's stack layout is part of measured builds)
  AmkPre* pre;           // preload state (shared memory; preload.cuh)
  const unsigned char* pre_buf;  // the preload buffer (dynamic shared memory)
  const AmkSlot* slots;  // shared memory: the task's buffer slots, resolved before the op starts
  const float* nw;       // shared memory: the task's fused RMSNorm weight as fp32 (amk_prep_norm), after its area
};

__host__ __device__ __forceinline__ int amk_pad4(int n) { return (n + 3) & ~3; }

__device__ __forceinline__ int amk_tid() { return (int)threadIdx.x; }
__device__ __forceinline__ int amk_lane() { return (int)threadIdx.x & 31; }
__device__ __forceinline__ int amk_warp() { return (int)threadIdx.x >> 5; }

// ---------------------------------------------------------------------------------------------------------------
// Status reporting: the first error wins the code word; every error raises the abort flag.
// ---------------------------------------------------------------------------------------------------------------
__device__ __forceinline__ void amk_report(const AmkParams& p, int code, int task, int op, int detail, int sm) {
  if (atomicCAS(&p.status[AMK_STATUS_CODE], 0, code) == 0) {
    p.status[AMK_STATUS_TASK] = task;
    p.status[AMK_STATUS_OPCODE] = op;
    p.status[AMK_STATUS_DETAIL] = detail;
    p.status[AMK_STATUS_SM] = sm;
    __threadfence();
  }
  atomicExch(&p.status[AMK_STATUS_ABORT], 1);
}

// Called by ONE thread of the block; the caller's following __syncthreads publishes *flag.
// Trace mark k (0..AMK_TRACE_MARKS-1) of the running task, by thread 0, when the launch traces (AmkParams.trace).
// Marks are compiled in only for profiling builds (-DAMK_MARKS=1, scripts/trace_breakdown.py --marks): even
// untaken, the checks cost ~2% of a llama-3.2-1b step on an H100 (docs/PERF.md, third session).
#ifndef AMK_MARKS
#define AMK_MARKS 0
#endif
// AMK_DBG_ATTN_STAGE_MARKS 1 (diagnostic, with AMK_MARKS): an attention task's marks 2 and 3 time its input stage
// instead: entry of the tensor-core body, and its KV copies issued (before q is used); so 0 -> 2 -> 3 -> 1.
#ifndef AMK_DBG_ATTN_STAGE_MARKS
#define AMK_DBG_ATTN_STAGE_MARKS 0
#endif
// AMK_DBG_SETUP_MARK 1 (diagnostic, with AMK_MARKS): a GEMV-family tile (amk_gemv_rows: GEMV, GEMV_SILU_MUL,
// QKV_ROPE; register, short-row, preloaded and ring paths; the o_proj-by-group body) sets mark 2 once, where its
// rows' loads begin, instead of after its rows (a fused down block's tile sets none), so 1 -> 2 times the setup
// between the staged input and the first weight load, and 2 -> 3 the rows and the closing barrier.
#ifndef AMK_DBG_SETUP_MARK
#define AMK_DBG_SETUP_MARK 0
#endif
// Mark k of the running task, written by the calling thread where `writer` holds.
__device__ __forceinline__ void amk_mark_if(const AmkCtx& c, int k, bool writer) {
  if (AMK_MARKS && c.p->trace != nullptr && writer) {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    c.p->trace[(size_t)c.instr_index * AMK_TRACE_WORDS + 4 + k] = t;
  }
}
__device__ __forceinline__ void amk_mark(const AmkCtx& c, int k) { amk_mark_if(c, k, threadIdx.x == 0); }
// Mark k by lane 0 of the calling warp (diagnostic marks written by every warp).
__device__ __forceinline__ void amk_mark_lane0(const AmkCtx& c, int k) { amk_mark_if(c, k, (threadIdx.x & 31) == 0); }

__device__ __forceinline__ void amk_fail(const AmkCtx& c, int code, int detail) {
  amk_report(*c.p, code, c.ins->task_id, c.ins->op, detail, c.sm);
  *c.flag = 1;
}

// ---------------------------------------------------------------------------------------------------------------
// Reductions (deterministic).
// ---------------------------------------------------------------------------------------------------------------
__device__ __forceinline__ float amk_warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float amk_warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// ---------------------------------------------------------------------------------------------------------------
// Element types. T::VE = elements per 16-byte chunk; unpack() turns a chunk into VE floats; ro() is a read-only
// global element (__ldg); ld() / ld2() are plain loads (shared memory) of element i / elements i, i+1 (i even).
// ---------------------------------------------------------------------------------------------------------------
__device__ __forceinline__ float amk_bf16_bits(uint32_t b16) { return __uint_as_float(b16 << 16); }
__device__ __forceinline__ float amk_f16_bits(uint32_t b16) {
  return __half2float(__ushort_as_half((unsigned short)b16));
}
__device__ __forceinline__ unsigned short amk_ld_u16_ro(const void* p, int64_t i) {
  return __ldg((const unsigned short*)p + i);
}

struct AmkF32 {
  static constexpr int VE = 4, BYTES = 4;
  __device__ static __forceinline__ void unpack(const uint4& v, float (&f)[4]) {
    f[0] = __uint_as_float(v.x); f[1] = __uint_as_float(v.y); f[2] = __uint_as_float(v.z); f[3] = __uint_as_float(v.w);
  }
  __device__ static __forceinline__ float ro(const void* p, int64_t i) { return __ldg((const float*)p + i); }
  __device__ static __forceinline__ float ld(const void* p, int i) { return ((const float*)p)[i]; }
  __device__ static __forceinline__ float2 ld2(const void* p, int i) { return *(const float2*)((const float*)p + i); }
};
struct AmkBF16 {
  static constexpr int VE = 8, BYTES = 2;
  __device__ static __forceinline__ void unpack(const uint4& v, float (&f)[8]) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      f[2 * i] = __uint_as_float(w[i] << 16);
      f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
  }
  __device__ static __forceinline__ float ro(const void* p, int64_t i) { return amk_bf16_bits(amk_ld_u16_ro(p, i)); }
  __device__ static __forceinline__ float ld(const void* p, int i) { return amk_bf16_bits(((const unsigned short*)p)[i]); }
  __device__ static __forceinline__ float2 ld2(const void* p, int i) {
    const uint32_t w = *(const uint32_t*)((const unsigned short*)p + i);
    return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
  }
};
struct AmkF16 {
  static constexpr int VE = 8, BYTES = 2;
  __device__ static __forceinline__ void unpack(const uint4& v, float (&f)[8]) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) { f[2 * i] = amk_f16_bits(w[i] & 0xffffu); f[2 * i + 1] = amk_f16_bits(w[i] >> 16); }
  }
  __device__ static __forceinline__ float ro(const void* p, int64_t i) { return amk_f16_bits(amk_ld_u16_ro(p, i)); }
  __device__ static __forceinline__ float ld(const void* p, int i) { return amk_f16_bits(((const unsigned short*)p)[i]); }
  __device__ static __forceinline__ float2 ld2(const void* p, int i) {
    const uint32_t w = *(const uint32_t*)((const unsigned short*)p + i);
    return make_float2(amk_f16_bits(w & 0xffffu), amk_f16_bits(w >> 16));
  }
};

// f(T()) for the element type dt; only the types of AMK_DTYPES are compiled in (common.cuh). A type that is not
// reports BAD_INPUT (detail AMK_DTYPE_DETAIL - dt) and returns false; vm/jit.py picks a build that covers the program.
template <class F>
__device__ __forceinline__ bool amk_dispatch_dtype(const AmkCtx& c, int dt, F f) {
  if (AMK_HAS_DTYPE(AMK_DTYPE_BF16) && dt == AMK_DTYPE_BF16) { f(AmkBF16()); return true; }
  if (AMK_HAS_DTYPE(AMK_DTYPE_F16) && dt == AMK_DTYPE_F16) { f(AmkF16()); return true; }
  if (AMK_HAS_DTYPE(AMK_DTYPE_F32) && dt == AMK_DTYPE_F32) { f(AmkF32()); return true; }
  if (amk_tid() == 0) amk_fail(c, AMK_ERR_BAD_INPUT, AMK_DTYPE_DETAIL - dt);
  return false;
}

// Read-only element of a weight / CONST buffer of run-time dtype (small vectors: norm weights, bias, inv_freq).
__device__ __forceinline__ float amk_ldw(const void* p, int dt, int64_t i) {
  switch (dt) {
    case AMK_DTYPE_BF16: return AmkBF16::ro(p, i);
    case AMK_DTYPE_F16: return AmkF16::ro(p, i);
    default: return AmkF32::ro(p, i);
  }
}
// Store one float into a cache of run-time dtype, rounding to nearest even.
__device__ __forceinline__ void amk_store_elem(void* p, int dt, int64_t i, float v) {
  switch (dt) {
    case AMK_DTYPE_BF16: ((unsigned short*)p)[i] = __bfloat16_as_ushort(__float2bfloat16_rn(v)); break;
    case AMK_DTYPE_F16: ((unsigned short*)p)[i] = __half_as_ushort(__float2half_rn(v)); break;
    default: ((float*)p)[i] = v; break;
  }
}

// 16-byte streaming load of read-only weights: no L1 allocation, L2 evict-first (weights are read once per step).
__device__ __forceinline__ uint64_t amk_policy_evict_first() {
  uint64_t pol;
  asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
  return pol;
}
__device__ __forceinline__ uint4 amk_ld_stream(const void* ptr, uint64_t pol) {
  uint4 r;
  asm("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
      : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(ptr), "l"(pol));
  return r;
}

// 16-byte cp.async (.cg: L2 only, coherent with the counters' acquire), commit and wait-group.
__device__ __forceinline__ void amk_cp_async16(void* dst_smem, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"((uint32_t)__cvta_generic_to_shared(dst_smem)),
               "l"(src)
               : "memory");
}
__device__ __forceinline__ void amk_cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void amk_cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// (va, ia) beats (vb, ib)? A total order, so the block result does not depend on the reduction order.
__device__ __forceinline__ bool amk_argmax_better(float va, int ia, float vb, int ib) {
  const bool na = va != va, nb = vb != vb;
  if (na != nb) return na;
  if (!na && va != vb) return va > vb;
  return ia < ib;
}

// Block-wide argmax of every thread's (bv, bi): the result in thread 0's (bv, bi). Uses c.red / c.part; the
// caller must not have them in use (one barrier inside).
__device__ __forceinline__ void amk_argmax_block(const AmkCtx& c, float& bv, int& bi) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
    const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
    if (amk_argmax_better(ov, oi, bv, bi)) { bv = ov; bi = oi; }
  }
  int* ri = (int*)c.part;  // [NWARPS] indices, values in red
  if (amk_lane() == 0) { c.red[amk_warp()] = bv; ri[amk_warp()] = bi; }
  amk_sync();
  if (amk_tid() == 0) {
    for (int w = 1; w < AMK_NWARPS; ++w)
      if (amk_argmax_better(c.red[w], ri[w], bv, bi)) { bv = c.red[w]; bi = ri[w]; }
  }
}

// A task's slot, from the shared-memory copy (no global round trip once the op runs).
__device__ __forceinline__ void* amk_ptr(const AmkCtx& c, int slot) { return (void*)(uintptr_t)c.slots[slot].ptr; }
__device__ __forceinline__ int amk_dtype(const AmkCtx& c, int slot) { return c.slots[slot].dtype; }
__device__ __forceinline__ int amk_dtype_bytes(int dt) { return (dt == AMK_DTYPE_BF16 || dt == AMK_DTYPE_F16) ? 2 : 4; }
// The first int32 of an IO_INPUT slot (token id, position), read before the task's wait.
__device__ __forceinline__ int amk_io_scalar(const AmkCtx& c, int slot) { return c.slots[slot].scalar; }

// The value of an IO_INPUT buffer (first word at ptr) for this launch: the token id / position the launch was given
// in its params (AMK_IO_TOKEN / AMK_IO_POS), else the buffer's word. A multi-step launch's later positions 'pos@s'
// are always read from memory (the loader writes them before a launch given its position): this sits in the task
// loop, whose register allocation moves with any change, so it stays one comparison per word.
__device__ __forceinline__ int amk_io_value(const AmkParams& p, const int* ptr) {
  if ((p.io_flags & AMK_IO_TOKEN) && ptr == p.token) return p.in_token;
  if ((p.io_flags & AMK_IO_POS) && ptr == p.pos) return p.in_pos;
  return __ldcg(ptr);
}

// Lanes 0..n_bufs-1 of one warp, while thread 0 waits: resolve the task's slots into s (descriptors are constant;
// IO_INPUT buffers are written only between launches -- the last block of a launch writes the next step's there,
// amk_exit -- so reading them before the wait is safe).
__device__ __forceinline__ void amk_prep_slots(const AmkParams& p, const AmkInstr& in, AmkSlot* s, int lane) {
  if (lane < in.n_bufs && lane < AMK_MAX_BUFS) {
    const AmkBufDesc d = p.bufs[in.buf[lane]];
    s[lane].ptr = d.ptr;
    s[lane].dtype = d.dtype;
    s[lane].scalar = d.kind == AMK_KIND_IO_INPUT ? amk_io_value(p, (const int*)(uintptr_t)d.ptr) : 0;
  }
}
__device__ __forceinline__ bool amk_aligned16(const void* p) { return ((uintptr_t)p & 15u) == 0; }
