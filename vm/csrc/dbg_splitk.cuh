// Diagnostic (A/B builds only, -DAMK_DBG_SPLITK_QKV=1; docs/PERF.md forty-eighth session, item 4): the COST side of
// QKV as a split-K epilogue of the down tiles, with correct results. After every GEMV tile with a residual and
// K >= AMK_DBG_SPLITK_MIN_K (llama-3.2-1b: the down tiles, K = 8192; o_proj has K = 2048), the block streams
// rn x AMK_DBG_SPLITK_N bf16 weights (a contiguous slice of one of 16 per-layer copies in a 201 MB static device
// array, as a transposed W_qkv's rows [r0, r0 + rn) would be) and adds y[r] * w[r, :] over its rn rows into a
// static fp32 [AMK_DBG_SPLITK_N] accumulator with red.global.add (v4 on sm_90), before the task signals. Nobody
// reads the accumulator, so the program's results are unchanged and the A/B is correctness-gated; the benefit side
// is the AMK_DBG_QKV_NOSTREAM bound (ops_qkv.cuh). Default builds only (flagged y words are not decoded here).
#pragma once
#include "common.cuh"
#include "sync.cuh"   // amk_prefetch_range (mode 3)

#ifndef AMK_DBG_SPLITK_QKV
#define AMK_DBG_SPLITK_QKV 0
#endif
#if AMK_DBG_SPLITK_QKV
#ifndef AMK_DBG_SPLITK_N
#define AMK_DBG_SPLITK_N 3072   // llama-3.2-1b: q + k + v rows
#endif
#ifndef AMK_DBG_SPLITK_MIN_K
#define AMK_DBG_SPLITK_MIN_K 4096
#endif
#ifndef AMK_DBG_SPLITK_ROWS
#define AMK_DBG_SPLITK_ROWS 2048   // the hidden size: rows of the transposed weight
#endif
#ifndef AMK_DBG_SPLITK_MODE
// 0: stream + reduce after the tile; 1: stream only (sums stored to a per-block scratch, no atomics); 2: reduce only
// (no weight loads: y times a constant); 3: as 0, with the slice asked into L2 as the op starts (after its wait)
#define AMK_DBG_SPLITK_MODE 0
#endif
#ifndef AMK_DBG_SPLITK_LAYERS
#define AMK_DBG_SPLITK_LAYERS 16   // weight copies, one per layer: the same 12.6 MB every layer would stay in L2
#endif
static_assert(AMK_DBG_SPLITK_N % 8 == 0, "AMK_DBG_SPLITK_N: whole 16-byte chunks per row");
// bf16 [LAYERS, ROWS, N] (zeros); a block's k-th call reads copy k % LAYERS (one down tile per block and layer)
__device__ uint4 amk_dbg_splitk_w[(size_t)AMK_DBG_SPLITK_LAYERS * AMK_DBG_SPLITK_ROWS * AMK_DBG_SPLITK_N / 8];
__device__ float amk_dbg_splitk_acc[AMK_DBG_SPLITK_N];
__device__ unsigned amk_dbg_splitk_calls[1024];   // per block (grids of up to 1024 blocks)
__device__ float amk_dbg_splitk_scratch[1024 * AMK_DBG_SPLITK_N];   // mode 1: per-block sums, nobody reads them

__device__ __forceinline__ bool amk_dbg_splitk_applies(const AmkInstr& in) {
  return in.ip[AMK_GEMV_IP_HAS_RESIDUAL] != 0 && in.ip[AMK_GEMV_IP_K] >= AMK_DBG_SPLITK_MIN_K;
}

// Mode 3: the block asks L2 for the tile's slice as the GEMV op starts (after its wait, before its own stream).
__device__ __forceinline__ void amk_dbg_splitk_pre(const AmkCtx& c) {
#if AMK_DBG_SPLITK_MODE == 3
  const AmkInstr& in = *c.ins;
  if (!amk_dbg_splitk_applies(in)) return;
  const int r0 = in.ip[AMK_GEMV_IP_ROW_START], rn = in.ip[AMK_GEMV_IP_ROW_COUNT];
  const unsigned call = amk_dbg_splitk_calls[blockIdx.x % 1024];
  constexpr int NC = AMK_DBG_SPLITK_N / 8;
  const int rows = r0 + rn <= AMK_DBG_SPLITK_ROWS ? rn : AMK_DBG_SPLITK_ROWS - r0;
  const uint4* base = amk_dbg_splitk_w + ((size_t)(call % AMK_DBG_SPLITK_LAYERS) * AMK_DBG_SPLITK_ROWS + r0) * NC;
  amk_prefetch_range((uint64_t)base, (int64_t)rows * NC * 16);
#else
  (void)c;
#endif
}

__device__ __noinline__ void amk_dbg_splitk(const AmkCtx& c) {
  const AmkInstr& in = *c.ins;
  if (!amk_dbg_splitk_applies(in)) return;
  const int r0 = in.ip[AMK_GEMV_IP_ROW_START], rn = in.ip[AMK_GEMV_IP_ROW_COUNT];
  int s = AMK_GEMV_N_REQUIRED_IN + (in.ip[AMK_GEMV_IP_HAS_NORM] != 0) + (in.ip[AMK_GEMV_IP_HAS_BIAS] != 0) + 1;
  const float* y = (const float*)amk_ptr(c, s) + r0;  // this tile's rows, written by this block before the barrier
  const unsigned call = amk_dbg_splitk_calls[blockIdx.x % 1024];  // read by every thread before the barrier
  amk_sync();
  if (*c.flag) return;
  constexpr int NC = AMK_DBG_SPLITK_N / 8;  // 16-byte chunks per weight row
#if AMK_DBG_SPLITK_MODE != 2
  const uint4* wl = amk_dbg_splitk_w + (size_t)(call % AMK_DBG_SPLITK_LAYERS) * AMK_DBG_SPLITK_ROWS * NC;
#endif
  for (int cc = amk_tid(); cc < NC; cc += AMK_THREADS) {
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll 16
    for (int r = 0; r < rn && r0 + r < AMK_DBG_SPLITK_ROWS; ++r) {
      const float yr = __ldcg(y + r);
      float wf[8];
#if AMK_DBG_SPLITK_MODE == 2
      for (int e = 0; e < 8; ++e) wf[e] = 0.25f * (float)(e + 1);
#else
      const uint4 w = wl[(size_t)(r0 + r) * NC + cc];
      AmkBF16::unpack(w, wf);
#endif
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[e] = fmaf(wf[e], yr, acc[e]);
    }
#if AMK_DBG_SPLITK_MODE == 1
    float4* sc = (float4*)(amk_dbg_splitk_scratch + (size_t)(blockIdx.x % 1024) * AMK_DBG_SPLITK_N + 8 * cc);
    sc[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
    sc[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    float* dst = amk_dbg_splitk_acc + 8 * cc;
    asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(dst), "f"(acc[0]), "f"(acc[1]), "f"(acc[2]),
                 "f"(acc[3]) : "memory");
    asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(dst + 4), "f"(acc[4]), "f"(acc[5]),
                 "f"(acc[6]), "f"(acc[7]) : "memory");
#else
    for (int e = 0; e < 8; ++e) atomicAdd(amk_dbg_splitk_acc + 8 * cc + e, acc[e]);
#endif
  }
  if (amk_tid() == 0) amk_dbg_splitk_calls[blockIdx.x % 1024] = call + 1;  // (every thread read it before the barrier)
}
#else
__device__ __forceinline__ void amk_dbg_splitk_pre(const AmkCtx&) {}   // the default: nothing before a GEMV tile
__device__ __forceinline__ void amk_dbg_splitk(const AmkCtx&) {}   // the default: nothing after a GEMV tile
#endif
